"""The safetensors format: a lazy, zero-copy reader over a memory-mapped file, and an atomic writer.

A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape and byte
range, plus an optional ``__metadata__`` of strings), then the raw tensor data. The reader validates the whole
header before anything is mapped; each tensor is then a copy-on-write view of the mapping, read when asked for.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from .store import Entry, TensorStore, bytes_as, is_int, map_file, numel_of, optional_dtypes

__all__ = ["SAFETENSORS_DTYPES", "MAX_HEADER", "open_safetensors", "save_safetensors"]


#: safetensors dtype code -> torch dtype (the codes this torch build can represent)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = optional_dtypes(
    [
        ("F64", "float64"),
        ("F32", "float32"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("I64", "int64"),
        ("I32", "int32"),
        ("I16", "int16"),
        ("I8", "int8"),
        ("U8", "uint8"),
        ("BOOL", "bool"),
        ("U16", "uint16"),
        ("U32", "uint32"),
        ("U64", "uint64"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("C64", "complex64"),
    ]
)
_SAFETENSORS_CODES: dict[torch.dtype, str] = {dt: code for code, dt in SAFETENSORS_DTYPES.items()}

#: the largest header accepted: a longer length field means a damaged file, or not a safetensors one
MAX_HEADER = 100 * 1024 * 1024


class _ContiguousEntry(Entry):
    """A tensor stored as one contiguous run of bytes (safetensors)."""

    __slots__ = ("buffer", "offset", "nbytes")

    def __init__(self, shape, dtype, buffer, offset: int, nbytes: int):
        super().__init__(shape, dtype)
        self.buffer = buffer
        self.offset = offset
        self.nbytes = nbytes

    def load(self) -> torch.Tensor:
        if numel_of(self.shape) == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return bytes_as(self.buffer, self.offset, self.nbytes, self.dtype).view(self.shape)

    def release(self) -> None:
        self.buffer = None


# --------------------------------------------------------------------------------------------
# reading


def open_safetensors(path: str, f, size: int) -> TensorStore:
    """The store over ``f``, the open safetensors file ``path`` of ``size`` bytes (its data memory-mapped)."""
    if size < 8:
        raise CheckpointError(f"is too short ({size} bytes) to be a safetensors file", path)
    f.seek(0)
    n = struct.unpack("<Q", f.read(8))[0]
    if n > size - 8:
        raise CheckpointError(
            f"safetensors header length field says {n} bytes but only {size - 8} bytes follow it "
            "(the file is truncated, or not a safetensors file)",
            path,
        )
    if n > MAX_HEADER:
        raise CheckpointError(f"safetensors header length {n} is implausibly large", path)
    raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"safetensors header is not UTF-8 text (byte {exc.start})", path) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"safetensors header is not valid JSON ({exc.msg} at header byte {exc.pos})", path
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"safetensors header is a JSON {type(header).__name__}, expected an object", path
        )

    metadata: dict[str, str] = {}
    raw_meta = header.pop("__metadata__", None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict):
            raise CheckpointError("safetensors __metadata__ is not a JSON object", path)
        for k, v in raw_meta.items():
            metadata[str(k)] = v if isinstance(v, str) else json.dumps(v)

    data_start = 8 + n
    data_len = size - data_start
    specs: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
    out_of_bounds: list[tuple[int, str, int]] = []
    for key, spec in header.items():
        if not isinstance(spec, dict):
            raise CheckpointError("header entry is not a JSON object", path, key)
        code = spec.get("dtype")
        shape = spec.get("shape")
        offsets = spec.get("data_offsets")
        if code not in SAFETENSORS_DTYPES:
            known = ", ".join(SAFETENSORS_DTYPES)
            raise CheckpointError(f"unsupported dtype {code!r} (known: {known})", path, key)
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"shape {shape!r} is not a list of non-negative integers", path, key)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(f"data_offsets {offsets!r} is not a [begin, end] byte range", path, key)
        dtype = SAFETENSORS_DTYPES[code]
        begin, end = offsets
        needed = numel_of(shape) * dtype.itemsize
        if end - begin != needed:
            raise CheckpointError(
                f"data_offsets [{begin}, {end}) hold {end - begin} bytes but shape {shape} "
                f"of {code} needs {needed}",
                path,
                key,
            )
        if end > data_len:
            out_of_bounds.append((begin, key, end))
        specs[key] = (dtype, shape, begin, end)

    if out_of_bounds:
        begin, key, end = min(out_of_bounds)
        raise CheckpointError(
            f"data bytes [{begin}, {end}) lie past the end of the file's data section "
            f"({data_len} bytes): the file is truncated ({len(out_of_bounds)} of {len(specs)} "
            "tensors affected)",
            path,
            key,
        )

    mm = map_file(path, f)
    entries: dict[str, Entry] = {
        key: _ContiguousEntry(shape, dtype, mm, data_start + begin, end - begin)
        for key, (dtype, shape, begin, end) in specs.items()
    }
    return TensorStore(path, "safetensors", entries, metadata, container="safetensors", resources=[mm])


# --------------------------------------------------------------------------------------------
# writing


def save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    overwrite: bool = False,
) -> None:
    """Write ``tensors`` to a .safetensors file, atomically.

    The data goes to a temporary file in the destination folder which then replaces ``path``
    in one step, so a reader never sees a half-written file. An existing ``path`` is an error
    unless ``overwrite=True``. Tensors are written from the CPU in C order; names are sorted
    (widest dtype first, so every tensor is aligned to its element size).
    """
    p = os.fspath(path)
    if sys.byteorder != "little":
        raise CheckpointError("writing safetensors needs a little-endian machine", p)
    if os.path.isdir(p):
        raise CheckpointError("is a directory; give a file name to write", p)
    if os.path.lexists(p) and not overwrite:
        raise CheckpointError("already exists; refusing to overwrite it (pass overwrite=True)", p)
    folder = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(folder):
        raise CheckpointError(f"cannot write: folder {folder!r} does not exist", p)

    meta: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(f"metadata entry {k!r}: {v!r} is not a str -> str pair", p)
        meta[k] = v

    prepared: list[tuple[str, torch.Tensor, str]] = []
    for key, tensor in tensors.items():
        if not isinstance(key, str) or key == "__metadata__":
            raise CheckpointError(f"cannot be used as a tensor name", p, str(key))
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"is a {type(tensor).__name__}, not a tensor", p, key)
        code = _SAFETENSORS_CODES.get(tensor.dtype)
        if code is None:
            raise CheckpointError(f"dtype {tensor.dtype} cannot be stored in safetensors", p, key)
        if tensor.layout != torch.strided or tensor.is_meta:
            raise CheckpointError("only dense tensors with data can be saved", p, key)
        prepared.append((key, tensor, code))
    prepared.sort(key=lambda item: (-item[1].dtype.itemsize, item[0]))

    header: dict[str, Any] = {}
    if meta:
        header["__metadata__"] = meta
    offset = 0
    for key, tensor, code in prepared:
        nbytes = tensor.numel() * tensor.dtype.itemsize
        header[key] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)

    tmp = _create_temp(folder, os.path.basename(p))
    try:
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(header_bytes)))
            out.write(header_bytes)
            for _key, tensor, _code in prepared:
                if tensor.numel() == 0:
                    continue
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                out.write(memoryview(data.numpy()))
            out.flush()
            os.fsync(out.fileno())
        _publish(tmp, p, overwrite)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _sync_folder(folder)


def _create_temp(folder: str, base: str) -> str:
    for _ in range(100):
        candidate = os.path.join(folder, f".{base}.{secrets.token_hex(4)}.tmp")
        try:
            with open(candidate, "xb"):  # exclusive create, normal permissions (umask)
                return candidate
        except FileExistsError:
            continue
        except OSError as exc:
            raise CheckpointError(f"cannot write in {folder!r} ({exc.strerror or exc})", os.path.join(folder, base)) from None
    raise CheckpointError("cannot create a temporary file next to it", os.path.join(folder, base))


def _publish(tmp: str, path: str, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails atomically if someone created path meanwhile
    except FileExistsError:
        raise CheckpointError("already exists; refusing to overwrite it (pass overwrite=True)", path) from None
    except OSError:  # no hard links on this filesystem
        if os.path.lexists(path):
            raise CheckpointError("already exists; refusing to overwrite it (pass overwrite=True)", path) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _sync_folder(folder: str) -> None:
    if os.name != "posix":
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
