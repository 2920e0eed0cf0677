"""Checkpoint file readers (one per format) and a safetensors writer.

Every reader returns a :class:`TensorStore`: a read-only mapping from tensor name to tensor whose
names, shapes and dtypes are known as soon as the file is opened, while tensor data is read only
when a tensor is asked for.

Formats (recognised by their content, not by their file name):

* ``.safetensors`` -- an 8-byte little-endian header length, a JSON header, then raw tensor data.
  The header is validated up front and the data is memory-mapped.
* PyTorch zip archives (``torch.save`` since PyTorch 1.6; ``.ckpt``/``.pt``/``.pth``/``.bin``) --
  ``<prefix>/data.pkl`` holds a pickle whose tensors refer to storages kept as uncompressed
  entries ``<prefix>/data/<key>``; those entries are memory-mapped in place.
* The older PyTorch format (a run of pickles followed by raw storages) and plain pickles.

Pickles are never unpickled with the standard machinery: :class:`_SafeUnpickler` resolves only a
short allow-list of globals (tensor rebuild functions, storage types, a few containers and inert
stand-ins for the harmless bookkeeping objects found in training checkpoints) and refuses every
other global before anything could call it.

Memory-mapped tensors are copy-on-write views of the file: nothing a caller does to a tensor is
ever written back, and no reader writes anything to disk.
"""

from __future__ import annotations

import _compat_pickle
import io
import json
import math
import mmap
import os
import pickle
import secrets
import stat
import struct
import sys
import zlib
import zipfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError

__all__ = [
    "TensorStore",
    "MissingTensorError",
    "open_checkpoint",
    "open_sharded",
    "merge_stores",
    "save_safetensors",
    "SAFETENSORS_DTYPES",
]


# --------------------------------------------------------------------------------------------
# dtypes


def _optional_dtypes(pairs: Iterable[tuple[str, str]]) -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    for code, attr in pairs:
        dt = getattr(torch, attr, None)
        if isinstance(dt, torch.dtype):
            out[code] = dt
    return out


#: safetensors dtype code -> torch dtype (the codes this torch build can represent)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = _optional_dtypes(
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

# Legacy typed storage classes as pickled by torch.save ("torch.FloatStorage", ...).
_STORAGE_CLASS_DTYPES: dict[str, torch.dtype] = _optional_dtypes(
    [
        ("DoubleStorage", "float64"),
        ("FloatStorage", "float32"),
        ("HalfStorage", "float16"),
        ("BFloat16Storage", "bfloat16"),
        ("LongStorage", "int64"),
        ("IntStorage", "int32"),
        ("ShortStorage", "int16"),
        ("CharStorage", "int8"),
        ("ByteStorage", "uint8"),
        ("BoolStorage", "bool"),
        ("ComplexFloatStorage", "complex64"),
        ("ComplexDoubleStorage", "complex128"),
    ]
)

# torch dtype objects that may appear by name in a pickle (e.g. _rebuild_tensor_v3's dtype).
_TORCH_DTYPE_NAMES: dict[str, torch.dtype] = _optional_dtypes(
    (name, name)
    for name in (
        "float64", "double", "float32", "float", "float16", "half", "bfloat16",
        "int64", "long", "int32", "int", "int16", "short", "int8", "uint8", "bool",
        "uint16", "uint32", "uint64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    )
)

_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def _numel(shape: Iterable[int]) -> int:
    return math.prod(shape)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Malformed(Exception):
    """Internal: the file's structure is inconsistent; turned into a CheckpointError with its path."""


# --------------------------------------------------------------------------------------------
# lazily loaded tensors


def _bytes_as(buffer: Any, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` over ``buffer[offset:offset + nbytes]``, sharing its memory."""
    count = nbytes // dtype.itemsize
    if count == 0:
        return torch.empty(0, dtype=dtype)
    # Through a memoryview: the tensor then holds a buffer export, so the mapping cannot be
    # unmapped (mmap.close raises BufferError) while any tensor still views it.
    raw = torch.frombuffer(memoryview(buffer), dtype=torch.uint8, count=count * dtype.itemsize, offset=offset)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()  # misaligned in the file: copy into aligned memory
    return raw.view(dtype)


class _Entry:
    """One named tensor of a store: its shape and dtype, and how to produce its data."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: Iterable[int], dtype: torch.dtype):
        self.shape = torch.Size(shape)
        self.dtype = dtype

    def load(self) -> torch.Tensor:
        raise NotImplementedError

    def release(self) -> None:
        """Drop cached views so that the underlying mapping can be closed."""


class _ContiguousEntry(_Entry):
    """A tensor stored as one contiguous run of bytes (safetensors)."""

    __slots__ = ("buffer", "offset", "nbytes")

    def __init__(self, shape, dtype, buffer, offset: int, nbytes: int):
        super().__init__(shape, dtype)
        self.buffer = buffer
        self.offset = offset
        self.nbytes = nbytes

    def load(self) -> torch.Tensor:
        if _numel(self.shape) == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return _bytes_as(self.buffer, self.offset, self.nbytes, self.dtype).view(self.shape)

    def release(self) -> None:
        self.buffer = None


class _EagerEntry(_Entry):
    """A tensor already materialised while reading the file (rare paths, e.g. numpy-backed)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        super().__init__(tensor.shape, tensor.dtype)
        self.tensor = tensor

    def load(self) -> torch.Tensor:
        return self.tensor


class _StorageRef:
    """A storage of a pickled checkpoint: a byte range that tensors view with offsets/strides.

    The byte range is either in ``buffer`` (the file's mapping, or bytes held in memory) or is
    produced on demand by ``reader`` (a compressed zip entry); a legacy "storage view" refers to a
    slice of a root storage instead.
    """

    __slots__ = ("dtype", "numel", "label", "buffer", "offset", "reader", "root", "root_offset", "_views")

    def __init__(self, dtype: torch.dtype, numel: int, label: str):
        self.dtype = dtype
        self.numel = numel  # in elements of self.dtype
        self.label = label
        self.buffer: Any = None
        self.offset = 0
        self.reader = None
        self.root: _StorageRef | None = None
        self.root_offset = 0
        self._views: dict[torch.dtype, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def as_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole storage as a 1-D tensor of ``dtype`` (shared with every view of it)."""
        if self.root is not None:
            base = self.root.as_dtype(self.dtype)
            return base[self.root_offset : self.root_offset + self.numel].view(dtype)
        view = self._views.get(dtype)
        if view is None:
            if self.buffer is None:
                self.buffer = bytearray(self.reader())
                self.offset = 0
                self.reader = None
            view = _bytes_as(self.buffer, self.offset, self.nbytes, dtype)
            self._views[dtype] = view
        return view

    def release(self) -> None:
        self._views.clear()
        self.buffer = None
        self.reader = None
        if self.root is not None:
            self.root.release()


class _PickledTensor(_Entry):
    """A tensor of a pickled checkpoint: a strided view into a storage."""

    __slots__ = ("storage", "offset", "stride")

    def __init__(self, storage: _StorageRef, offset: int, shape, stride, dtype: torch.dtype):
        super().__init__(shape, dtype)
        self.storage = storage
        self.offset = offset
        self.stride = tuple(stride)

    def problem(self) -> str | None:
        """Why this view cannot be taken from its storage, or None."""
        if len(self.stride) != len(self.shape):
            return f"shape {list(self.shape)} and stride {list(self.stride)} differ in length"
        if self.offset < 0 or any(s < 0 for s in self.shape) or any(s < 0 for s in self.stride):
            return f"negative offset/shape/stride (offset {self.offset}, stride {list(self.stride)})"
        if _numel(self.shape) == 0:
            return None
        if self.storage.nbytes % self.dtype.itemsize:
            return (
                f"storage {self.storage.label} holds {self.storage.nbytes} bytes, "
                f"not a whole number of {self.dtype} elements"
            )
        available = self.storage.nbytes // self.dtype.itemsize
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        if last >= available:
            return (
                f"view (offset {self.offset}, shape {list(self.shape)}, stride {list(self.stride)}) "
                f"reaches element {last} of storage {self.storage.label}, which has {available} "
                f"{self.dtype} elements"
            )
        return None

    def load(self) -> torch.Tensor:
        if _numel(self.shape) == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        base = self.storage.as_dtype(self.dtype)
        return base.as_strided(self.shape, self.stride, base.storage_offset() + self.offset)

    def release(self) -> None:
        self.storage.release()


# --------------------------------------------------------------------------------------------
# the store


class MissingTensorError(CheckpointError, KeyError):
    """A tensor name that the checkpoint does not contain (also a KeyError, as Mapping wants)."""

    def __str__(self) -> str:  # KeyError would quote the message; keep CheckpointError's form
        return CheckpointError.__str__(self)


class TensorStore(Mapping):
    """Read-only, lazy ``name -> torch.Tensor`` mapping over one checkpoint (or several merged).

    * ``keys()``, ``len()``, ``in``, :meth:`shape`, :meth:`dtype`, :meth:`nbytes` never read
      tensor data.
    * ``store[name]`` returns the tensor in the file's dtype, on the CPU. For memory-mapped
      files it is a zero-copy, copy-on-write view of the file (modifying it never changes the
      file). :meth:`load` / :meth:`get` can convert straight to a compute dtype and device.
    * ``metadata``: ``dict[str, str]`` -- safetensors ``__metadata__``, or the top-level scalar
      entries of a pickled checkpoint (e.g. ``global_step``).
    * ``path``: the file (for a merged store: the common directory of its files); ``paths``: all
      files. ``format``: ``"safetensors"``, ``"ckpt"`` or ``"bin"`` (pickled formats; ``"bin"``
      when the file name ends in ``.bin``), ``"mixed"`` for a merge of different formats.
      ``container``: finer detail (``"safetensors"``, ``"torch-zip"``, ``"torch-legacy"``,
      ``"pickle"``, ``"merged"``).
    * :meth:`close` (or ``with``) releases the file; tensors already returned stay valid.
    """

    def __init__(
        self,
        path: str,
        format: str,
        entries: dict[str, _Entry],
        metadata: Mapping[str, str] | None = None,
        *,
        container: str | None = None,
        paths: tuple[str, ...] | None = None,
        resources: Iterable[Any] = (),
    ):
        self.path = path
        self.paths = paths if paths is not None else (path,)
        self.format = format
        self.container = container or format
        self.metadata: dict[str, str] = dict(metadata or {})
        self._entries = entries
        self._resources = list(resources)
        self._closed = False

    # -- Mapping ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: str) -> torch.Tensor:
        entry = self._entry(key)
        if self._closed:
            raise CheckpointError("this checkpoint has been closed; reopen it to read tensors", self.path)
        return entry.load()

    def get(self, key: str, default: Any = None, *, dtype: torch.dtype | None = None, device: Any = None):
        """``load(key, dtype, device)`` when the key exists, else ``default`` (Mapping.get)."""
        if key not in self._entries:
            return default
        return self.load(key, dtype=dtype, device=device)

    # -- metadata-only queries ---------------------------------------------------------------

    def shape(self, key: str) -> torch.Size:
        return self._entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        return self._entry(key).dtype

    def nbytes(self, key: str) -> int:
        entry = self._entry(key)
        return _numel(entry.shape) * entry.dtype.itemsize

    # -- data ---------------------------------------------------------------------------------

    def load(self, key: str, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
        """The tensor ``key``, converted to ``dtype`` and moved to ``device`` when given.

        With neither (or with the file's own dtype on the CPU) this is ``store[key]`` itself.
        A narrowing conversion happens before the move, a widening one after it, so the
        transfer always carries the smaller form.
        """
        tensor = self[key]
        if dtype is not None and dtype != tensor.dtype and dtype.itemsize <= tensor.dtype.itemsize:
            tensor = tensor.to(dtype)
        if device is not None:
            tensor = tensor.to(device)
        if dtype is not None and dtype != tensor.dtype:
            tensor = tensor.to(dtype)
        return tensor

    def release_pages(self) -> None:
        """Let the kernel drop the file pages read so far from resident memory (Linux ``MADV_DONTNEED``).

        Use it after tensors were *converted* (e.g. fp16 file -> fp32 model), so the file's pages do not count
        a second time in resident memory. Mapped pages are re-read from the file if touched again, so zero-copy
        tensors stay correct -- as long as nobody wrote into them (private copies of written pages are
        discarded); callers must not release a store whose zero-copy tensors may have been modified.
        """
        for resource in self._resources:
            if isinstance(resource, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
                try:
                    resource.madvise(mmap.MADV_DONTNEED)
                except (OSError, ValueError):
                    pass
            elif isinstance(resource, TensorStore):
                resource.release_pages()

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the file. Tensors handed out earlier stay valid (they keep the mapping alive)."""
        if self._closed:
            return
        self._closed = True
        for entry in self._entries.values():
            entry.release()
        for resource in self._resources:
            try:
                resource.close()
            except BufferError:
                pass  # tensors still view the mapping; it is unmapped when they are freed
        self._resources.clear()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return f"TensorStore({self.path!r}, format={self.format!r}, {len(self)} tensors{state})"

    # -- internals -------------------------------------------------------------------------------

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise MissingTensorError(
                f"not in this checkpoint ({len(self._entries)} tensors)", self.path, key
            ) from None


# --------------------------------------------------------------------------------------------
# opening files


def open_checkpoint(path: str | os.PathLike) -> TensorStore:
    """Open one checkpoint file, recognising its format from its content.

    Raises CheckpointError (naming the file) for a missing path, a directory, an empty file,
    an unknown or damaged format, and for any pickle that refers to something not on the
    allow-list.
    """
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise CheckpointError("no such file", p) from None
    except OSError as exc:
        raise CheckpointError(f"cannot access the file ({exc.strerror or exc})", p) from None
    if stat.S_ISDIR(st.st_mode):
        raise CheckpointError(
            "is a directory, not a checkpoint file (open the weight files inside it, or its "
            "*.index.json with open_sharded)",
            p,
        )
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError("is not a regular file", p)
    size = st.st_size
    if size == 0:
        raise CheckpointError("is empty (0 bytes); the download or copy may have failed", p)
    try:
        f = open(p, "rb")
    except OSError as exc:
        raise CheckpointError(f"cannot open the file ({exc.strerror or exc})", p) from None
    with f:
        head = f.read(512)
        kind = _sniff(head, size)
        if kind == "safetensors":
            return _open_safetensors(p, f, size)
        if kind == "zip":
            return _open_torch_zip(p, f, size)
        if kind == "pickle":
            return _open_pickle_file(p, f, size)
        if kind == "tar":
            raise CheckpointError(
                "is in PyTorch's pre-1.0 tar checkpoint format, which sdlite does not read; "
                "re-save it with a current PyTorch or convert it to .safetensors",
                p,
            )
        if kind == "lfs":
            raise CheckpointError(
                "is a Git LFS pointer file, not the weights themselves (fetch the LFS object)", p
            )
        if p.lower().endswith(".safetensors") and len(head) >= 8:
            n = struct.unpack_from("<Q", head)[0]
            raise CheckpointError(
                f"is not a valid safetensors file: its first 8 bytes give a header length of {n} "
                f"(file size {size}) and no JSON header follows",
                p,
            )
        raise CheckpointError(
            f"is not a checkpoint format sdlite knows (safetensors, PyTorch zip or pickle); "
            f"it starts with bytes {head[:16].hex(' ')}",
            p,
        )


def _sniff(head: bytes, size: int) -> str:
    if len(head) >= 9 and head[8:9] == b"{":
        n = struct.unpack_from("<Q", head)[0]
        if 2 <= n <= _SAFETENSORS_MAX_HEADER:
            return "safetensors"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    if head.startswith(b"version https://git-lfs"):
        return "lfs"
    return "unknown"


def _map_file(path: str, f) -> mmap.mmap:
    try:
        # copy-on-write: tensors viewing the mapping are writable, the file never changes
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot memory-map the file ({exc})", path) from None


def _pickled_format(path: str) -> str:
    return "bin" if path.lower().endswith(".bin") else "ckpt"


# -- safetensors -------------------------------------------------------------------------------


def _open_safetensors(path: str, f, size: int) -> TensorStore:
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
    if n > _SAFETENSORS_MAX_HEADER:
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
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"shape {shape!r} is not a list of non-negative integers", path, key)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(f"data_offsets {offsets!r} is not a [begin, end] byte range", path, key)
        dtype = SAFETENSORS_DTYPES[code]
        begin, end = offsets
        needed = _numel(shape) * dtype.itemsize
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

    mm = _map_file(path, f)
    entries: dict[str, _Entry] = {
        key: _ContiguousEntry(shape, dtype, mm, data_start + begin, end - begin)
        for key, (dtype, shape, begin, end) in specs.items()
    }
    return TensorStore(path, "safetensors", entries, metadata, container="safetensors", resources=[mm])


# -- the restricted unpickler ------------------------------------------------------------------


class _Inert:
    """Stand-in for a harmless non-tensor object of a checkpoint: keeps its pickled state, runs nothing."""

    _sdlite_origin = "?"

    def __new__(cls, *args: Any, **kwargs: Any):
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any):
        self._sdlite_args = args

    def __setstate__(self, state: Any) -> None:
        self._sdlite_state = state

    def __repr__(self) -> str:
        return f"<stand-in for {self._sdlite_origin}>"


class _ParameterDictStandIn(_Inert):
    """torch.nn.ParameterDict (textual-inversion embeddings): exposes its parameters."""

    def tensors(self) -> dict:
        state = getattr(self, "_sdlite_state", None)
        if isinstance(state, tuple) and state and isinstance(state[0], dict):
            state = state[0]
        params = state.get("_parameters") if isinstance(state, dict) else None
        return dict(params) if isinstance(params, dict) else {}


class _NDArrayStandIn(_Inert):
    """numpy.ndarray: rebuilt as a real array only for plain (non-object) dtypes."""

    array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        try:
            _version, shape, dtype, fortran, raw = state
            if isinstance(dtype, np.dtype) and not dtype.hasobject and isinstance(raw, (bytes, bytearray)):
                flat = np.frombuffer(bytearray(raw), dtype=dtype)
                self.array = flat.reshape(tuple(shape), order="F" if fortran else "C")
        except (TypeError, ValueError):
            self.array = None


_STANDIN_CLASSES: dict[str, type] = {}


def _standin(qualname: str, base: type = _Inert) -> type:
    cls = _STANDIN_CLASSES.get(qualname)
    if cls is None:
        cls = type(qualname.rsplit(".", 1)[-1], (base,), {"_sdlite_origin": qualname})
        _STANDIN_CLASSES[qualname] = cls
    return cls


# Globals that are kept as inert stand-ins (their state is kept, their code is never imported).
_STANDIN_GLOBALS: dict[tuple[str, str], type] = {
    ("pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint"): _Inert,
    ("pytorch_lightning.callbacks", "model_checkpoint"): _Inert,
    ("pytorch_lightning.callbacks", "ModelCheckpoint"): _Inert,
    ("lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint"): _Inert,
    ("pytorch_lightning.callbacks.early_stopping", "EarlyStopping"): _Inert,
    ("pytorch_lightning.callbacks.lr_monitor", "LearningRateMonitor"): _Inert,
    ("torch.nn.modules.container", "ParameterDict"): _ParameterDictStandIn,
    ("numpy", "ndarray"): _NDArrayStandIn,
    ("torch", "Tensor"): _Inert,  # only as the type argument of _rebuild_from_type_v2
    ("torch._tensor", "Tensor"): _Inert,
    ("torch.nn.parameter", "Parameter"): _Inert,
}

# torch globals that are legitimate but describe tensors sdlite does not read.
_UNSUPPORTED_TORCH = {
    ("torch._utils", "_rebuild_qtensor"): "quantized tensors",
    ("torch._utils", "_rebuild_sparse_tensor"): "sparse tensors",
    ("torch._utils", "_rebuild_sparse_csr_tensor"): "sparse tensors",
    ("torch._utils", "_rebuild_nested_tensor"): "nested tensors",
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): "meta tensors (no data)",
    ("torch._utils", "_rebuild_wrapper_subclass"): "tensor subclasses",
    ("torch._utils", "_rebuild_mkldnn_tensor"): "MKL-DNN tensors",
    ("torch._utils", "_rebuild_xla_tensor"): "XLA tensors",
}

_BUILTIN_GLOBALS = {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex, "bytearray": bytearray}

_ENCODINGS = {"latin1", "latin-1", "iso-8859-1", "utf-8", "utf8", "ascii"}


class _StorageType:
    """Marker for a storage class named in a pickle (torch.FloatStorage, torch.UntypedStorage, ...)."""

    __slots__ = ("dtype", "name")

    def __init__(self, dtype: torch.dtype, name: str):
        self.dtype = dtype
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any):
        raise _Malformed(f"the pickle tries to construct {self.name} directly")


def _make_tensor(storage: Any, offset: Any, size: Any, stride: Any, dtype: torch.dtype | None) -> _PickledTensor:
    if not isinstance(storage, _StorageRef):
        raise _Malformed(f"a tensor refers to {type(storage).__name__!s} instead of a storage")
    if not _is_int(offset):
        raise _Malformed(f"a tensor has storage offset {offset!r}")
    if not isinstance(size, (tuple, list)) or not all(_is_int(d) for d in size):
        raise _Malformed(f"a tensor has size {size!r}")
    if not isinstance(stride, (tuple, list)) or not all(_is_int(d) for d in stride):
        raise _Malformed(f"a tensor has stride {stride!r}")
    return _PickledTensor(storage, offset, size, stride, dtype if dtype is not None else storage.dtype)


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _make_tensor(storage, storage_offset, size, stride, None)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return _make_tensor(storage, storage_offset, size, stride, None)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if not isinstance(dtype, torch.dtype):
        raise _Malformed(f"a tensor has dtype {dtype!r}")
    return _make_tensor(storage, storage_offset, size, stride, dtype)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    if not isinstance(data, _Entry):
        raise _Malformed(f"a parameter wraps {type(data).__name__} instead of a tensor")
    return data


def _rebuild_device_tensor_from_numpy(data, dtype, device=None, requires_grad=False):
    array = getattr(data, "array", None)
    if not isinstance(array, np.ndarray) or not isinstance(dtype, torch.dtype):
        raise _Malformed("a numpy-backed tensor has no readable numeric array")
    return _EagerEntry(torch.from_numpy(array).to(dtype))


_REBUILDERS = (_rebuild_tensor, _rebuild_tensor_v2, _rebuild_tensor_v3)


def _rebuild_from_type_v2(func, new_type, args, state):
    if func not in _REBUILDERS or not isinstance(args, tuple):
        raise _Malformed("a tensor subclass is rebuilt with an unexpected function")
    if not (isinstance(new_type, type) and issubclass(new_type, _Inert)):
        raise _Malformed("a tensor subclass of an unexpected type")
    return func(*args)


def _codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    if not isinstance(obj, str) or encoding.lower() not in _ENCODINGS or errors != "strict":
        raise _Malformed("_codecs.encode is used with unexpected arguments")
    return obj.encode(encoding)


def _numpy_scalar(dtype: Any, data: Any = None) -> Any:
    if isinstance(dtype, np.dtype) and not dtype.hasobject and isinstance(data, (bytes, bytearray)):
        try:
            return np.frombuffer(bytes(data), dtype=dtype, count=1)[0].item()
        except (TypeError, ValueError):
            pass
    return _standin("numpy.core.multiarray.scalar")()


def _numpy_reconstruct(subtype: Any, shape: Any = None, dtype: Any = None) -> _NDArrayStandIn:
    return _NDArrayStandIn()


_ALLOWED_FUNCTIONS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._utils", "_rebuild_device_tensor_from_numpy"): _rebuild_device_tensor_from_numpy,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("_codecs", "encode"): _codecs_encode,
    ("numpy", "dtype"): np.dtype,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
}


def allowed_globals() -> list[str]:
    """The ``module.name`` globals a checkpoint pickle may refer to (for docs and diagnostics)."""
    names = {f"{m}.{n}" for m, n in _ALLOWED_FUNCTIONS}
    names |= {f"{m}.{n}" for m, n in _STANDIN_GLOBALS}
    names |= {f"torch.{n}" for n in _STORAGE_CLASS_DTYPES}
    names |= {"torch.UntypedStorage", "torch.storage.UntypedStorage", "torch.storage._load_from_bytes"}
    names |= {f"torch.{n}" for n in _TORCH_DTYPE_NAMES}
    names |= {f"builtins.{n}" for n in _BUILTIN_GLOBALS}
    return sorted(names)


class _LoadContext:
    def __init__(self, path: str, depth: int = 0):
        self.path = path
        self.depth = depth


class _SafeUnpickler(pickle.Unpickler):
    """An unpickler that resolves only allow-listed globals and never imports or calls anything else."""

    def __init__(self, file, ctx: _LoadContext, persistent=None):
        super().__init__(file, encoding="utf-8")
        self._ctx = ctx
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        # protocol-2 pickles spell Python 3 names the Python 2 way (__builtin__, commands, ...);
        # resolve them as pickle itself would, so allow-list and messages use the real name
        written = f"{module}.{name}"
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        key = (module, name)
        if key in _ALLOWED_FUNCTIONS:
            return _ALLOWED_FUNCTIONS[key]
        if key in _STANDIN_GLOBALS:
            return _standin(f"{module}.{name}", _STANDIN_GLOBALS[key])
        if module in ("torch", "torch.cuda") and name in _STORAGE_CLASS_DTYPES:
            return _StorageType(_STORAGE_CLASS_DTYPES[name], f"{module}.{name}")
        if key in (("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")):
            return _StorageType(torch.uint8, f"{module}.{name}")
        if module == "torch" and name in _TORCH_DTYPE_NAMES:
            return _TORCH_DTYPE_NAMES[name]
        if module == "builtins" and name in _BUILTIN_GLOBALS:
            return _BUILTIN_GLOBALS[name]
        if key == ("torch.storage", "_load_from_bytes"):
            return self._load_from_bytes
        if key in _UNSUPPORTED_TORCH:
            raise CheckpointError(
                f"contains {_UNSUPPORTED_TORCH[key]} ({module}.{name}), which sdlite does not read",
                self._ctx.path,
            )
        spelled = "" if written == f"{module}.{name}" else f" (written '{written}')"
        raise CheckpointError(
            f"refused to load: its pickle refers to the global '{module}.{name}'{spelled}, which is not on "
            "sdlite's allow-list of checkpoint contents (it was not imported or called). The file "
            "may be malicious; only load it if you trust its source, and prefer .safetensors",
            self._ctx.path,
        )

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise _Malformed(f"the pickle refers to external data ({pid!r:.80}) outside a PyTorch checkpoint")
        return self._persistent(pid)

    def _load_from_bytes(self, data: Any) -> _StorageRef:
        """torch.storage._load_from_bytes: a storage pickled as an embedded torch.save blob."""
        if not isinstance(data, (bytes, bytearray)) or self._ctx.depth >= 1:
            raise _Malformed("unexpected embedded storage data")
        inner = _LoadContext(self._ctx.path, self._ctx.depth + 1)
        buffer = bytearray(data)
        if buffer[:4] == b"PK\x03\x04":
            obj, _ = _read_torch_zip(inner, io.BytesIO(bytes(buffer)), buffer)
        else:
            kind, obj = _read_legacy(inner, io.BytesIO(bytes(buffer)), buffer)
            if kind != "torch-legacy":
                raise _Malformed("embedded storage data is not a PyTorch storage")
        if not isinstance(obj, _StorageRef):
            raise _Malformed("embedded storage data does not hold a storage")
        return obj


def _unpickle(ctx: _LoadContext, file, persistent=None) -> Any:
    try:
        return _SafeUnpickler(file, ctx, persistent).load()
    except CheckpointError:
        raise
    except _Malformed as exc:
        raise CheckpointError(f"damaged checkpoint: {exc}", ctx.path) from None
    except RecursionError:
        raise CheckpointError("damaged checkpoint: the pickle is nested too deeply", ctx.path) from None
    except Exception as exc:  # anything the pickle machinery raises on bad input
        raise CheckpointError(
            f"cannot read the pickled data ({type(exc).__name__}: {exc}); the file is damaged or "
            "not a checkpoint",
            ctx.path,
        ) from exc


# -- PyTorch zip archives ----------------------------------------------------------------------


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


def _read_torch_zip(ctx: _LoadContext, fileobj, buffer) -> tuple[Any, list[_StorageRef]]:
    """Unpickle ``data.pkl`` of a torch zip archive; storages map byte ranges of ``buffer``."""
    path = ctx.path
    try:
        archive = zipfile.ZipFile(fileobj)
        infos = archive.infolist()
    except Exception as exc:
        raise CheckpointError(
            f"is not a complete zip archive ({exc}); the file is truncated or damaged", path
        ) from None
    by_name = {info.filename: info for info in infos}
    pkl_names = [n for n in by_name if n == "data.pkl" or (n.endswith("/data.pkl") and n.count("/") == 1)]
    if not pkl_names:
        raise CheckpointError("is a zip archive but not a PyTorch checkpoint (no data.pkl inside)", path)
    if len(pkl_names) > 1:
        raise CheckpointError(f"holds several pickles ({', '.join(sorted(pkl_names))}); expected one", path)
    prefix = pkl_names[0][: -len("data.pkl")]
    byteorder = by_name.get(prefix + "byteorder")
    try:
        if byteorder is not None and archive.read(byteorder).strip() not in (b"little", b""):
            raise CheckpointError("was saved on a big-endian machine; sdlite reads little-endian data only", path)
        pickle_bytes = archive.read(pkl_names[0])
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read {pkl_names[0]} from the archive ({exc})", path) from None

    storages: dict[str, _StorageRef] = {}
    size = len(buffer)

    def persistent(pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _Malformed(f"unexpected persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not _is_int(numel) or numel < 0:
            raise _Malformed(f"malformed storage reference {pid!r:.80}")
        cached = storages.get(key)
        if cached is not None:
            return cached
        name = f"{prefix}data/{key}"
        info = by_name.get(name)
        if info is None:
            raise CheckpointError(f"storage record '{name}' is missing from the archive", path)
        ref = _StorageRef(storage_type.dtype, numel, f"'{name}'")
        if info.file_size < ref.nbytes:
            raise CheckpointError(
                f"storage record '{name}' holds {info.file_size} bytes but the checkpoint needs "
                f"{ref.nbytes} ({numel} x {storage_type.dtype})",
                path,
            )
        if info.flag_bits & 0x1:
            raise CheckpointError(f"storage record '{name}' is encrypted", path)
        if size < info.header_offset + _LOCAL_HEADER.size:
            raise CheckpointError(f"storage record '{name}' lies past the end of the file (truncated)", path)
        sig, _v, _fl, _m, _t, _d, _crc, _cs, _us, name_len, extra_len = _LOCAL_HEADER.unpack_from(buffer, info.header_offset)
        if sig != 0x04034B50:
            raise CheckpointError(f"storage record '{name}' has a damaged zip header", path)
        data_offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if data_offset + info.compress_size > size:
            raise CheckpointError(
                f"storage record '{name}' needs bytes up to {data_offset + info.compress_size} but "
                f"the file has {size} (truncated)",
                path,
            )
        if info.compress_type == zipfile.ZIP_STORED:
            ref.buffer = buffer
            ref.offset = data_offset
        elif info.compress_type == zipfile.ZIP_DEFLATED:
            start, stop, expect = data_offset, data_offset + info.compress_size, info.file_size

            def inflate(start=start, stop=stop, expect=expect, name=name):
                data = zlib.decompress(buffer[start:stop], -15)
                if len(data) != expect:
                    raise CheckpointError(f"storage record '{name}' does not decompress cleanly", path)
                return data

            ref.reader = inflate
        else:
            raise CheckpointError(
                f"storage record '{name}' uses zip compression method {info.compress_type}, "
                "which sdlite does not read",
                path,
            )
        storages[key] = ref
        return ref

    obj = _unpickle(ctx, io.BytesIO(pickle_bytes), persistent)
    archive.close()
    return obj, list(storages.values())


def _open_torch_zip(path: str, f, size: int) -> TensorStore:
    mm = _map_file(path, f)
    try:
        obj, _ = _read_torch_zip(_LoadContext(path), f, mm)
        return _build_pickled_store(path, "torch-zip", obj, [mm])
    except BaseException:
        _close_quietly(mm)
        raise


# -- legacy PyTorch format and plain pickles -------------------------------------------------------


def _read_legacy(ctx: _LoadContext, fileobj, buffer) -> tuple[str, Any]:
    """Read a pickle stream: ('torch-legacy', obj) for torch's pre-1.6 format, else ('pickle', obj)."""
    path = ctx.path
    first = _unpickle(ctx, fileobj)
    if not (_is_int(first) and first == _LEGACY_MAGIC):
        return "pickle", first
    protocol = _unpickle(ctx, fileobj)
    if protocol != _LEGACY_PROTOCOL:
        raise CheckpointError(f"uses legacy PyTorch protocol {protocol!r}; expected {_LEGACY_PROTOCOL}", path)
    sys_info = _unpickle(ctx, fileobj)
    if isinstance(sys_info, dict) and sys_info.get("little_endian") is False:
        raise CheckpointError("was saved on a big-endian machine; sdlite reads little-endian data only", path)

    roots: dict[str, _StorageRef] = {}
    views: dict[str, _StorageRef] = {}

    def persistent(pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            if isinstance(pid, tuple) and pid and pid[0] == "module":
                raise CheckpointError(
                    "holds a pickled torch module with its source code; sdlite reads state dicts "
                    "only (refused, nothing was executed)",
                    path,
                )
            raise _Malformed(f"unexpected persistent id {pid!r:.80}")
        _, storage_type, key, _location, numel, view_meta = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not _is_int(numel) or numel < 0:
            raise _Malformed(f"malformed storage reference {pid!r:.80}")
        root = roots.get(key)
        if root is None:
            root = roots[key] = _StorageRef(storage_type.dtype, numel, f"'{key}'")
        if view_meta is None:
            return root
        view_key, view_offset, view_numel = view_meta
        view = views.get(view_key)
        if view is None:
            if not (_is_int(view_offset) and _is_int(view_numel) and view_offset >= 0 and view_numel >= 0):
                raise _Malformed(f"malformed storage view {view_meta!r:.80}")
            view = views[view_key] = _StorageRef(root.dtype, view_numel, f"'{view_key}'")
            view.root, view.root_offset = root, view_offset
        return view

    obj = _unpickle(ctx, fileobj, persistent)
    keys = _unpickle(ctx, fileobj)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointError("damaged legacy checkpoint: the storage key list is unreadable", path)
    offset = fileobj.tell()
    size = len(buffer)
    for key in keys:
        ref = roots.get(key)
        if ref is None:
            raise CheckpointError(f"damaged legacy checkpoint: storage '{key}' is listed but never used", path)
        if offset + 8 > size:
            raise CheckpointError(f"storage '{key}' lies past the end of the file (truncated)", path)
        (numel,) = struct.unpack_from("<q", buffer, offset)
        if numel != ref.numel:
            raise CheckpointError(
                f"damaged legacy checkpoint: storage '{key}' records {numel} elements, expected {ref.numel}", path
            )
        offset += 8
        if offset + ref.nbytes > size:
            raise CheckpointError(
                f"storage '{key}' needs bytes up to {offset + ref.nbytes} but the file has {size} (truncated)",
                path,
            )
        ref.buffer, ref.offset = buffer, offset
        offset += ref.nbytes
    missing = sorted(set(roots) - set(keys))
    if missing:
        raise CheckpointError(f"damaged legacy checkpoint: no data for storage '{missing[0]}'", path)
    for view in views.values():
        if view.root_offset + view.numel > view.root.numel:
            raise CheckpointError(f"damaged legacy checkpoint: storage view {view.label} exceeds its storage", path)
    return "torch-legacy", obj


def _open_pickle_file(path: str, f, size: int) -> TensorStore:
    mm = _map_file(path, f)
    try:
        f.seek(0)
        kind, obj = _read_legacy(_LoadContext(path), f, mm)
        return _build_pickled_store(path, kind, obj, [mm])
    except BaseException:
        _close_quietly(mm)
        raise


def _close_quietly(resource: Any) -> None:
    try:
        resource.close()
    except BufferError:
        pass


# -- from an unpickled object to named tensors -----------------------------------------------------

_MAX_NESTING = 32


def _describe(obj: Any) -> str:
    if isinstance(obj, _Entry):
        return "a single tensor"
    return f"a {type(obj).__name__}"


def _build_pickled_store(path: str, container: str, obj: Any, resources: list) -> TensorStore:
    """Flatten the unpickled object into ``name -> tensor``.

    A top-level ``state_dict`` (Lightning and most training code) is used when present; its
    siblings (``optimizer_states``, ``callbacks``, ...) are ignored. Nested dicts (and lists)
    become dotted names, non-tensor values are dropped, and top-level scalars (``global_step``,
    ``epoch``, ...) are kept as metadata strings.
    """
    if not isinstance(obj, dict):
        raise CheckpointError(f"holds {_describe(obj)} at the top level, not a dict of named tensors", path)
    metadata: dict[str, str] = {}
    for k, v in obj.items():
        if isinstance(v, (bool, int, float, str)):
            metadata[str(k)] = str(v)
    source = obj.get("state_dict")
    if not isinstance(source, dict):
        source = obj
    entries: dict[str, _Entry] = {}
    _flatten(path, source, "", entries, 0)
    for name, entry in entries.items():
        if isinstance(entry, _PickledTensor):
            problem = entry.problem()
            if problem:
                raise CheckpointError(f"damaged checkpoint: {problem}", path, name)
    return TensorStore(path, _pickled_format(path), entries, metadata, container=container, resources=resources)


def _flatten(path: str, node: Any, prefix: str, out: dict[str, _Entry], depth: int) -> None:
    if depth > _MAX_NESTING:
        return
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    elif isinstance(node, _ParameterDictStandIn):
        items = node.tensors().items()
    else:
        return
    for k, v in items:
        name = f"{prefix}{k}"
        if isinstance(v, _Entry):
            if name in out:
                raise CheckpointError("appears twice after flattening nested dicts", path, name)
            out[name] = v
        else:
            _flatten(path, v, name + ".", out, depth + 1)


# --------------------------------------------------------------------------------------------
# several files as one store


def merge_stores(stores: Iterable[TensorStore]) -> TensorStore:
    """One store over several (e.g. shards of one model). A name in two stores is an error.

    Closing the merged store closes its parts. Metadata is merged; on a clash the first wins.
    """
    stores = list(stores)
    if not stores:
        raise CheckpointError("no checkpoint files to merge")
    entries: dict[str, _Entry] = {}
    owner: dict[str, str] = {}
    metadata: dict[str, str] = {}
    for store in stores:
        for key in store:
            if key in entries:
                raise CheckpointError(f"also present in {owner[key]}", store.path, key)
            entries[key] = store._entries[key]
            owner[key] = store.path
        for k, v in store.metadata.items():
            metadata.setdefault(k, v)
    paths = tuple(p for s in stores for p in s.paths)
    formats = {s.format for s in stores}
    fmt = formats.pop() if len(formats) == 1 else "mixed"
    dirs = {os.path.dirname(os.path.abspath(p)) for p in paths}
    path = paths[0] if len(paths) == 1 else (dirs.pop() if len(dirs) == 1 else os.path.commonpath(list(dirs)))
    return TensorStore(path, fmt, entries, metadata, container="merged", paths=paths, resources=stores)


def open_sharded(index_path: str | os.PathLike) -> TensorStore:
    """Open a sharded model through its ``*.index.json`` (``{"weight_map": {name: file}}``)."""
    p = os.fspath(index_path)
    try:
        with open(p, "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError("no such file", p) from None
    except IsADirectoryError:
        raise CheckpointError("is a directory, not a shard index (*.index.json)", p) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"is not a readable JSON shard index ({exc})", p) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError("shard index has no 'weight_map' of tensor name -> file name", p)
    folder = os.path.dirname(p)
    stores: list[TensorStore] = []
    try:
        for shard in dict.fromkeys(weight_map.values()):
            if os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
                raise CheckpointError(f"shard index names {shard!r}, outside the index's folder", p)
            stores.append(open_checkpoint(os.path.join(folder, shard)))
        by_file = {os.path.basename(s.path): s for s in stores}
        for key, shard in weight_map.items():
            store = by_file[os.path.basename(shard)]
            if key not in store:
                raise CheckpointError(f"listed in {os.path.basename(p)} but missing from this shard", store.path, key)
        return merge_stores(stores)
    except BaseException:
        for store in stores:
            store.close()
        raise


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
