"""Opening checkpoint files: the readers' common entry, which recognises a file's format by its content.

Every reader returns a :class:`~sdlite.weights.store.TensorStore`: a read-only mapping from tensor name to tensor
whose names, shapes and dtypes are known as soon as the file is opened, while tensor data is read only when a
tensor is asked for. One reader per format:

* ``.safetensors`` (:mod:`sdlite.weights.safetensors`) -- an 8-byte little-endian header length, a JSON header,
  then raw tensor data. The header is validated up front and the data is memory-mapped. The module also has the
  writer, :func:`save_safetensors`.
* PyTorch checkpoints (:mod:`sdlite.weights.torchfile`; ``.ckpt``/``.pt``/``.pth``/``.bin``) -- zip archives
  (``torch.save`` since PyTorch 1.6) whose storages are memory-mapped in place, the older PyTorch format and plain
  pickles, all read through an allow-list unpickler that never imports or calls anything else.

* GGUF (:mod:`sdlite.weights.gguf`; ``.gguf``, recognised by its magic) -- city96's and stable-diffusion.cpp's
  files: plain tensors zero-copy, tensors in ggml's block formats as :class:`~sdlite.weights.quants.QuantizedTensor`
  (they stay quantised until dequantised).

A sharded model (``*.index.json``) opens as one store over its shards (:func:`open_sharded`).

Memory-mapped tensors are copy-on-write views of the file: nothing a caller does to a tensor is
ever written back, and no reader writes anything to disk.
"""

from __future__ import annotations

import json
import os
import stat
import struct

from ..errors import CheckpointError
from .gguf import is_gguf, open_gguf
from .safetensors import MAX_HEADER, SAFETENSORS_DTYPES, open_safetensors, save_safetensors
from .store import MissingTensorError, TensorStore, merge_stores
from .torchfile import open_pickle_file, open_torch_zip

__all__ = [
    "TensorStore",
    "MissingTensorError",
    "open_checkpoint",
    "open_sharded",
    "merge_stores",
    "save_safetensors",
    "SAFETENSORS_DTYPES",
]


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
        if is_gguf(head):
            return open_gguf(p)
        if kind == "safetensors":
            return open_safetensors(p, f, size)
        if kind == "zip":
            return open_torch_zip(p, f, size)
        if kind == "pickle":
            return open_pickle_file(p, f, size)
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
            f"is not a checkpoint format sdlite knows (safetensors, GGUF, PyTorch zip or pickle); "
            f"it starts with bytes {head[:16].hex(' ')}",
            p,
        )


def _sniff(head: bytes, size: int) -> str:
    if len(head) >= 9 and head[8:9] == b"{":
        n = struct.unpack_from("<Q", head)[0]
        if 2 <= n <= MAX_HEADER:
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
