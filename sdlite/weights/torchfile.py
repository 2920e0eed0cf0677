"""PyTorch checkpoints (``.ckpt``, ``.pt``, ``.pth``, ``.bin``), read without unpickling them the standard way.

Containers (recognised by their content, not by their file name):

* zip archives (``torch.save`` since PyTorch 1.6): ``<prefix>/data.pkl`` holds a pickle whose tensors refer to
  storages kept as entries ``<prefix>/data/<key>``; uncompressed entries are memory-mapped in place;
* the older PyTorch format (a run of pickles followed by raw storages) and plain pickles.

Pickles are never unpickled with the standard machinery: :class:`_SafeUnpickler` resolves only a short allow-list
of globals (tensor rebuild functions, storage types, a few containers and inert stand-ins for the harmless
bookkeeping objects found in training checkpoints) and refuses every other global before anything could call it.
The unpickled object is then flattened into named tensors: strided views of the storages, read when asked for.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import struct
import zlib
import zipfile
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from .store import Entry, TensorStore, bytes_as, is_int, map_file, numel_of, optional_dtypes

__all__ = ["open_torch_zip", "open_pickle_file", "allowed_globals"]


# Legacy typed storage classes as pickled by torch.save ("torch.FloatStorage", ...).
_STORAGE_CLASS_DTYPES: dict[str, torch.dtype] = optional_dtypes(
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
_TORCH_DTYPE_NAMES: dict[str, torch.dtype] = optional_dtypes(
    (name, name)
    for name in (
        "float64", "double", "float32", "float", "float16", "half", "bfloat16",
        "int64", "long", "int32", "int", "int16", "short", "int8", "uint8", "bool",
        "uint16", "uint32", "uint64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    )
)

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


class _Malformed(Exception):
    """Internal: the file's structure is inconsistent; turned into a CheckpointError with its path."""


# -- storages and the tensors that view them ---------------------------------------------------


class _EagerEntry(Entry):
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
            view = bytes_as(self.buffer, self.offset, self.nbytes, dtype)
            self._views[dtype] = view
        return view

    def release(self) -> None:
        self._views.clear()
        self.buffer = None
        self.reader = None
        if self.root is not None:
            self.root.release()


class _PickledTensor(Entry):
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
        if numel_of(self.shape) == 0:
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
        if numel_of(self.shape) == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        base = self.storage.as_dtype(self.dtype)
        return base.as_strided(self.shape, self.stride, base.storage_offset() + self.offset)

    def release(self) -> None:
        self.storage.release()


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
    if not is_int(offset):
        raise _Malformed(f"a tensor has storage offset {offset!r}")
    if not isinstance(size, (tuple, list)) or not all(is_int(d) for d in size):
        raise _Malformed(f"a tensor has size {size!r}")
    if not isinstance(stride, (tuple, list)) or not all(is_int(d) for d in stride):
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
    if not isinstance(data, Entry):
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
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not is_int(numel) or numel < 0:
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


def open_torch_zip(path: str, f, size: int) -> TensorStore:
    """The store over ``f``, the open PyTorch zip archive ``path`` of ``size`` bytes (stored entries mapped)."""
    mm = map_file(path, f)
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
    if not (is_int(first) and first == _LEGACY_MAGIC):
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
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not is_int(numel) or numel < 0:
            raise _Malformed(f"malformed storage reference {pid!r:.80}")
        root = roots.get(key)
        if root is None:
            root = roots[key] = _StorageRef(storage_type.dtype, numel, f"'{key}'")
        if view_meta is None:
            return root
        view_key, view_offset, view_numel = view_meta
        view = views.get(view_key)
        if view is None:
            if not (is_int(view_offset) and is_int(view_numel) and view_offset >= 0 and view_numel >= 0):
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


def open_pickle_file(path: str, f, size: int) -> TensorStore:
    """The store over ``f``, the open legacy PyTorch checkpoint or plain pickle ``path`` of ``size`` bytes."""
    mm = map_file(path, f)
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
    if isinstance(obj, Entry):
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
    entries: dict[str, Entry] = {}
    _flatten(path, source, "", entries, 0)
    for name, entry in entries.items():
        if isinstance(entry, _PickledTensor):
            problem = entry.problem()
            if problem:
                raise CheckpointError(f"damaged checkpoint: {problem}", path, name)
    return TensorStore(path, _pickled_format(path), entries, metadata, container=container, resources=resources)


def _pickled_format(path: str) -> str:
    return "bin" if path.lower().endswith(".bin") else "ckpt"


def _flatten(path: str, node: Any, prefix: str, out: dict[str, Entry], depth: int) -> None:
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
        if isinstance(v, Entry):
            if name in out:
                raise CheckpointError("appears twice after flattening nested dicts", path, name)
            out[name] = v
        else:
            _flatten(path, v, name + ".", out, depth + 1)
