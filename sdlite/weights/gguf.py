"""The GGUF format: a lazy reader over a memory-mapped ``.gguf`` file, whose quantised tensors stay quantised.

A GGUF file (llama.cpp's format; city96's ComfyUI-GGUF and stable-diffusion.cpp store FLUX, SD3 and SD models in it)
is a header of typed key-value metadata (``general.architecture`` = ``"flux"``, ...), a table of tensors (name,
dimensions, ggml type, offset) and the aligned tensor data. The header is parsed by the ``gguf`` package's
``GGUFReader``, which memory-maps the file copy-on-write: no tensor data is read until a tensor is asked for, and
nothing is ever written back.

:func:`open_gguf` returns a :class:`GGUFStore`, the same lazy ``name -> tensor`` mapping as every other reader's
(:class:`~sdlite.weights.store.TensorStore`), so key tables, detection and plans read it as they read a safetensors
file. What differs:

* shapes are in PyTorch's order (GGUF lists dimensions innermost first; they are reversed here), and where
  ComfyUI-GGUF's converter recorded a tensor's original shape (``comfy.gguf.orig_shape.<name>``), that one;
* F32, F16 and BF16 tensors (and the integer types) are plain tensors, zero-copy views of the file;
* every other type is a :class:`~sdlite.weights.quants.QuantizedTensor` over the file's bytes (its
  :meth:`GGUFStore.dtype` is ``torch.uint8``, :meth:`GGUFStore.qtype` names its ggml type, :meth:`GGUFStore.nbytes`
  is its real size); :meth:`GGUFStore.load` with a dtype dequantises it;
* ``metadata`` holds every key-value as a string (JSON for numbers and lists), ``fields`` the typed values.

A tensor type sdlite does not decode (IQ2_XXS, ...), a file that is not GGUF and a truncated or damaged one are
:class:`~sdlite.errors.CheckpointError` s naming the file (and the tensor, and its type), raised when the file is
opened.
"""
from __future__ import annotations

import json
import mmap
import os
import stat
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from .quants import GGML_TYPES, SUPPORTED_TYPES, GGMLType, QuantizedTensor
from .store import Entry, TensorStore, numel_of

__all__ = ["GGUF_MAGIC", "is_gguf", "open_gguf", "GGUFStore", "ORIG_SHAPE_PREFIX"]

GGUF_MAGIC = b"GGUF"

#: metadata key prefix under which ComfyUI-GGUF's converter records a tensor's shape before it was reshaped
ORIG_SHAPE_PREFIX = "comfy.gguf.orig_shape."

_BY_CODE = {t.code: t for t in GGML_TYPES.values()}


def is_gguf(head: bytes) -> bool:
    """Whether a file starting with ``head`` is GGUF (its magic)."""
    return head[:4] == GGUF_MAGIC


class _GGUFEntry(Entry):
    """One tensor of a GGUF file: its bytes in the mapping, its ggml type, its logical shape."""

    __slots__ = ("raw", "type")

    def __init__(self, shape, raw: np.ndarray, gtype: GGMLType):
        super().__init__(shape, gtype.plain if gtype.plain is not None else torch.uint8)
        self.raw = raw
        self.type = gtype

    def load(self):
        data = torch.from_numpy(self.raw)  # shares the (copy-on-write) mapping
        if self.type.plain is None:
            return QuantizedTensor(data, self.type, self.shape)
        if numel_of(self.shape) == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        if data.data_ptr() % self.dtype.itemsize:
            data = data.clone()  # misaligned in the file: copy into aligned memory
        return data.view(self.dtype).view(self.shape)

    def release(self) -> None:
        self.raw = None


class GGUFStore(TensorStore):
    """A :class:`~sdlite.weights.store.TensorStore` over one GGUF file (see the module's notes)."""

    def __init__(self, path: str, entries: dict[str, _GGUFEntry], metadata: dict[str, str],
                 fields: dict[str, Any], mapping: mmap.mmap | None = None):
        super().__init__(path, "gguf", entries, metadata, container="gguf")
        self.fields = fields
        # numpy's memmap does not hold a buffer export on its mapping, so closing the mapping while tensors view it
        # would leave them dangling: it is never closed here, only dropped (unmapped when the last view goes)
        self._mapping = mapping

    def release_pages(self) -> None:
        """As :meth:`TensorStore.release_pages`: the file's pages read so far leave resident memory."""
        if self._mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self._mapping.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        super().close()
        self._mapping = None

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (``"flux"``, ``"sd3"``, ``"sdxl"``, ``"sd1"`` ... in city96's files)."""
        value = self.fields.get("general.architecture")
        return value if isinstance(value, str) else None

    def qtype(self, key: str) -> str:
        """The ggml type the tensor is stored in (``"Q8_0"``, ``"F32"`` ...)."""
        return self._entry(key).type.name

    def is_quantized(self, key: str) -> bool:
        return self._entry(key).type.plain is None

    def nbytes(self, key: str) -> int:
        entry = self._entry(key)
        t = entry.type
        return numel_of(entry.shape) // t.block_size * t.type_size

    def load(self, key: str, dtype: torch.dtype | None = None, device: Any = None):
        """As :meth:`TensorStore.load`; a quantised tensor is dequantised when ``dtype`` is given, else moved as
        it is (a :class:`QuantizedTensor`)."""
        if not self.is_quantized(key):
            return super().load(key, dtype, device)
        qt = self[key]
        if device is not None:
            qt = qt.to(device)
        return qt if dtype is None else qt.dequantize(dtype)

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for entry in self._entries.values():
            kinds[entry.type.name] = kinds.get(entry.type.name, 0) + 1
        listed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        state = ", closed" if self.closed else ""
        return f"GGUFStore({self.path!r}, {len(self)} tensors: {listed}{state})"


def open_gguf(path: str | os.PathLike) -> GGUFStore:
    """Open the GGUF file ``path`` (memory-mapped; only the header is read now)."""
    p = os.fspath(path)
    size = _check_file(p)
    with open(p, "rb") as f:
        head = f.read(8)
    if not is_gguf(head):
        raise CheckpointError(f"is not a GGUF file: it starts with bytes {head.hex(' ') or '(none)'}, not "
                              f"{GGUF_MAGIC!r}", p)
    reader = _read(p, size)
    if getattr(reader, "byte_order", "I") == "S":
        raise CheckpointError("is a big-endian GGUF file; sdlite reads little-endian ones", p)
    fields: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # the reader's own entries for the version and counts
            continue
        try:
            fields[name] = field.contents()
        except Exception as exc:  # a damaged value: name it
            raise CheckpointError(f"metadata entry {name!r} cannot be read ({exc})", p) from None
    metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}

    entries: dict[str, _GGUFEntry] = {}
    unsupported = []
    for tensor in reader.tensors:
        name = tensor.name
        gtype = _BY_CODE.get(int(tensor.tensor_type))
        if gtype is None or (gtype.decode is None and gtype.plain is None):
            unsupported.append((name, gtype.name if gtype else tensor.tensor_type.name))
            continue
        shape = [int(d) for d in reversed(tensor.shape.tolist())]  # GGUF lists ne0 (innermost) first
        orig = fields.get(ORIG_SHAPE_PREFIX + name)
        if orig is not None:
            if (not isinstance(orig, list) or not all(isinstance(d, int) and d >= 0 for d in orig)
                    or numel_of(orig) != numel_of(shape)):
                raise CheckpointError(f"its recorded original shape {orig!r} does not hold the {numel_of(shape)} "
                                      f"values of its stored shape {shape}", p, name)
            shape = orig
        nbytes = numel_of(shape) // gtype.block_size * gtype.type_size
        if tensor.data_offset + nbytes > size:
            raise CheckpointError(f"its data, bytes [{tensor.data_offset}, {tensor.data_offset + nbytes}), lie past "
                                  f"the end of the file ({size} bytes): the file is truncated", p, name)
        raw = tensor.data.reshape(-1).view(np.uint8)
        entries[name] = _GGUFEntry(shape, raw, gtype)
    if unsupported:
        name, kind = unsupported[0]
        more = f" ({len(unsupported)} tensors of such types in all)" if len(unsupported) > 1 else ""
        raise CheckpointError(f"its ggml type {kind} is not supported: sdlite reads {', '.join(SUPPORTED_TYPES)}"
                              f"{more}; convert the file to one of those types", p, name)
    mapping = getattr(reader.data, "_mmap", None)
    return GGUFStore(p, entries, metadata, fields, mapping if isinstance(mapping, mmap.mmap) else None)


def _check_file(p: str) -> int:
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise CheckpointError("no such file", p) from None
    except OSError as exc:
        raise CheckpointError(f"cannot access the file ({exc.strerror or exc})", p) from None
    if stat.S_ISDIR(st.st_mode):
        raise CheckpointError("is a directory, not a GGUF file", p)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError("is not a regular file", p)
    if st.st_size == 0:
        raise CheckpointError("is empty (0 bytes); the download or copy may have failed", p)
    return st.st_size


class _PastEnd(Exception):
    def __init__(self, end: int):
        super().__init__(end)
        self.end = end


def _read(p: str, size: int):
    """The gguf package's reader over ``p``, mapped copy-on-write; a damaged file is a CheckpointError."""
    import gguf

    class Reader(gguf.GGUFReader):
        # every read of the header and of the tensors' data goes through _get: one that runs past the end of the
        # file means a truncated file (without this the reader fails with a numpy reshape error)
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + int(count) * np.dtype(dtype).itemsize
            if end > len(self.data):
                raise _PastEnd(end)
            return super()._get(offset, dtype, count, override_order)

    try:
        return Reader(p, "c")
    except _PastEnd as exc:
        raise CheckpointError(f"is truncated: it is {size} bytes long, but its GGUF header, tensor table or "
                              f"tensor data run to byte {exc.end} at least", p) from None
    except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as exc:
        raise CheckpointError(f"is a damaged or truncated GGUF file ({size} bytes): {exc}", p) from None
    except OSError as exc:
        raise CheckpointError(f"cannot map the file ({exc.strerror or exc})", p) from None
