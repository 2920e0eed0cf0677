"""LoRA files on disk: read (:func:`read_lora`), found by the name a prompt gives, hashed for infotexts.

For prompts and infotexts: :func:`find_lora` finds the file a ``<lora:NAME:W>`` tag means (by stem in a LoRA
folder and its sub-folders, then by kohya's ``ss_output_name``), :func:`lora_name` and :func:`lora_hash` give
the ``Lora hashes`` entry: A1111's short hash, the first 12 hex digits of kohya's "addnet" hash (the sha256 of
a safetensors file's bytes after its header) or of the whole file's sha256 for other formats; a
``sshs_model_hash`` in the file's metadata takes precedence, as in A1111 (``extensions-builtin/Lora/network.py``,
``modules/hashes.py``).

A1111's LoRA listing (the server's ``/loras``): :func:`list_loras` gives every file a tag can name, in the order
:func:`find_lora` searches them (a LoRA folder, then the LoRAs shipped with sdlite in ``sdlite/data/loras``), and
:func:`lora_alias` the name each is shown under.

Everything is re-exported by :mod:`sdlite.adapters.lora`.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from ..errors import CheckpointError
from .lora_keys import Lora, LoraError, _listing, parse_lora

# --- reading ----------------------------------------------------------------------------------------------------


def read_lora(path: str | os.PathLike) -> Lora:
    """Parse a LoRA file (kohya/A1111 or diffusers/PEFT; see :mod:`sdlite.adapters.lora_keys`). Refuses unsupported
    network types with a :class:`LoraError`; whether the layers fit a model is checked by
    :func:`sdlite.adapters.lora.merge`."""
    from ..weights.io import open_checkpoint

    path = os.fspath(path)
    try:
        store = open_checkpoint(path)
    except CheckpointError as e:
        raise LoraError(e.message if e.key is None else f"tensor {e.key!r}: {e.message}", path) from None
    try:
        keys = list(store.keys())
        metadata = dict(store.metadata)
        tensors = {}
        for key in keys:
            try:
                tensors[key] = store[key].clone()
            except CheckpointError as e:
                raise LoraError(f"tensor {key!r}: {e.message}", path) from None
    finally:
        store.close()
    return parse_lora(path, keys, tensors, metadata)


# --- finding LoRAs by name -------------------------------------------------------------------------------------

EXTENSIONS = (".safetensors", ".pt", ".ckpt")
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "loras"   # the LoRAs sdlite ships (the demo's)


def _candidates(folders: Iterable[Path]) -> list[Path]:
    files = []
    for folder in folders:
        if folder.is_dir():
            files += sorted(p for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS and p.is_file())
    return files


def _alias(path: Path) -> str | None:
    """A safetensors file's ``ss_output_name`` (kohya's training name), read from its header only."""
    if path.suffix.lower() != ".safetensors":
        return None
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 100 << 20:
                return None
            return (json.loads(f.read(n)).get("__metadata__") or {}).get("ss_output_name")
    except (OSError, ValueError, AttributeError):
        return None


def find_lora(name: str, lora_dir: str | os.PathLike | None = None) -> str:
    """The file a ``<lora:NAME:...>`` prompt tag means, as A1111 finds it: a file whose stem is ``name`` (``.safetensors``,
    ``.pt`` or ``.ckpt``, in ``lora_dir`` and its sub-folders, then among the LoRAs shipped with sdlite), else one
    whose training name (``ss_output_name`` metadata) is ``name``. Not found: a :class:`LoraError` listing what
    is there."""
    folders = ([Path(lora_dir)] if lora_dir is not None else []) + [SHIPPED_DIR]
    files = _candidates(folders)
    for match in (lambda p: p.stem == name, lambda p: p.stem.lower() == name.lower(), lambda p: _alias(p) == name):
        found = [p for p in files if match(p)]
        if found:
            return str(found[0])
    where = " or ".join(str(f) for f in folders if f.is_dir()) or "no LoRA folder (give one with --lora-dir)"
    names = sorted({p.stem for p in files})
    have = f"; there: {_listing(names, 10)}" if names else "; there is none there"
    raise LoraError(f"<lora:{name}:...>: no LoRA named {name!r} (NAME.safetensors, .pt or .ckpt) in {where}{have}")


def list_loras(lora_dir: str | os.PathLike | None = None) -> list[Path]:
    """Every LoRA file a ``<lora:NAME:...>`` tag can name: those in ``lora_dir`` (and its sub-folders), then the
    ones shipped with sdlite, in the order :func:`find_lora` searches them."""
    return _candidates(([Path(lora_dir)] if lora_dir is not None else []) + [SHIPPED_DIR])


def lora_alias(path: str | os.PathLike) -> str:
    """The name A1111 shows a LoRA under: its training name (``ss_output_name`` metadata), else its stem."""
    return _alias(Path(path)) or Path(path).stem


def lora_name(path: str | os.PathLike) -> str:
    """The name A1111 writes for a LoRA in ``Lora hashes``: the file's stem (the name its prompt tag uses)."""
    return Path(path).stem


def lora_names(prompt: str, loras: Iterable = ()) -> list[str]:
    """The names of the LoRAs a run applies, before any file is looked up: the stems of ``loras`` ((path, weight)
    pairs, as ``Request.loras`` holds them), then the names of ``prompt``'s ``<lora:NAME:...>`` tags (a malformed
    tag is left to the run, which refuses it). What a family decides a LoRA's own sampling from
    (:meth:`sdlite.families.base.Family.lora_sampling`)."""
    from ..prompts import PromptError, extract_networks

    names = [lora_name(path) for path, _ in loras]
    try:
        names += [t.name for t in extract_networks(prompt or "")[1] if t.kind == "lora"]
    except PromptError:
        pass
    return names


# --- hashes -----------------------------------------------------------------------------------------------------


def lora_hash(path: str | os.PathLike, short: bool = True) -> str:
    """A1111's LoRA hash (``Lora hashes`` infotext): a safetensors file's ``sshs_model_hash`` metadata, else
    kohya's "addnet" hash (sha256 of the bytes after the safetensors header); the file's sha256 for other
    formats. ``short``: the first 12 hex digits, as A1111 writes it."""
    path = os.fspath(path)
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            is_safetensors = path.lower().endswith(".safetensors") and len(head) == 8
            if is_safetensors:
                n = int.from_bytes(head, "little")
                try:
                    header = json.loads(f.read(n))
                    stored = (header.get("__metadata__") or {}).get("sshs_model_hash")
                except ValueError:
                    stored = None
                if stored:
                    return stored[:12] if short else stored
                f.seek(8 + n)
            else:
                f.seek(0)
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as e:
        raise LoraError(f"cannot read the file ({e.strerror or e})", path) from None
    value = digest.hexdigest()
    return value[:12] if short else value


def lora_hashes_infotext(named: Iterable[tuple[str, str | os.PathLike]]) -> str:
    """The value of A1111's ``Lora hashes`` infotext field for ``(name, path)`` pairs: ``name: hash, ...``
    (``:`` and ``,`` dropped from the names, as A1111 does)."""
    return ", ".join(f"{name.replace(':', '').replace(',', '')}: {lora_hash(path)}" for name, path in named)
