"""The lazy tensor store every checkpoint reader returns, what the readers build it from, and one component's
canonical view of it (:class:`ComponentSource`).

A reader turns a file into :class:`Entry` objects (a tensor's shape and dtype, and how to produce its data) and
wraps them in a :class:`TensorStore`: a read-only ``name -> tensor`` mapping whose names, shapes and dtypes are
known at once while tensor data is read only when a tensor is asked for. :func:`merge_stores` joins several stores
(the shards of one model) into one.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = [
    "TensorStore",
    "ComponentSource",
    "MissingTensorError",
    "merge_stores",
    "Entry",
    "bytes_as",
    "map_file",
    "optional_dtypes",
    "numel_of",
    "is_int",
]


def optional_dtypes(pairs: Iterable[tuple[str, str]]) -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    for code, attr in pairs:
        dt = getattr(torch, attr, None)
        if isinstance(dt, torch.dtype):
            out[code] = dt
    return out


def numel_of(shape: Iterable[int]) -> int:
    return math.prod(shape)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def map_file(path: str, f) -> mmap.mmap:
    try:
        # copy-on-write: tensors viewing the mapping are writable, the file never changes
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot memory-map the file ({exc})", path) from None


# --------------------------------------------------------------------------------------------
# lazily loaded tensors


def bytes_as(buffer: Any, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
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


class Entry:
    """One named tensor of a store: its shape and dtype, and how to produce its data."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: Iterable[int], dtype: torch.dtype):
        self.shape = torch.Size(shape)
        self.dtype = dtype

    def load(self) -> torch.Tensor:
        raise NotImplementedError

    def release(self) -> None:
        """Drop cached views so that the underlying mapping can be closed."""


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
        entries: dict[str, Entry],
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
        return numel_of(entry.shape) * entry.dtype.itemsize

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

    def _entry(self, key: str) -> Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise MissingTensorError(
                f"not in this checkpoint ({len(self._entries)} tensors)", self.path, key
            ) from None


# --------------------------------------------------------------------------------------------
# several files as one store


def merge_stores(stores: Iterable[TensorStore]) -> TensorStore:
    """One store over several (e.g. shards of one model). A name in two stores is an error.

    Closing the merged store closes its parts. Metadata is merged; on a clash the first wins.
    """
    stores = list(stores)
    if not stores:
        raise CheckpointError("no checkpoint files to merge")
    entries: dict[str, Entry] = {}
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


@dataclass
class ComponentSource:
    """One component's weights: a lazy canonical-name view and where it came from."""

    view: object            # Mapping[str, Tensor] with canonical keys, lazy
    shapes: dict            # canonical key -> shape (no tensor read)
    files: tuple[str, ...]
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    origin: dict = field(default_factory=dict)   # canonical key -> the file's key(s) it is made from

    @classmethod
    def from_plan(cls, plan, store: TensorStore, files: tuple[str, ...]) -> "ComponentSource":
        shapes = {k: tuple(store.shape(k)) for k in store.keys()}
        return cls(view=plan.apply(store), shapes=plan.shapes(shapes), files=files,
                   unexpected=list(plan.unexpected), ignored=list(plan.ignored),
                   origin={k: e.sources for k, e in plan.entries.items()})

    def file_key(self, key: str) -> str:
        """The key as the file spells it (for messages)."""
        sources = self.origin.get(key, (key,))
        return sources[0] if len(sources) == 1 else " + ".join(sources)
