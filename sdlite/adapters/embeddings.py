"""Textual-inversion embeddings: learned token vectors that a prompt word stands for.

Files (read without executing pickled code, through :func:`sdlite.weights.io.open_checkpoint`):

* AUTOMATIC1111 ``.pt`` / ``.safetensors``: ``string_to_param`` (a one-entry dict, usually ``"*"``) holding an
  (n, width) tensor; older files hold a single tensor under ``emb_params`` or under any one key;
* diffusers ``learned_embeds.safetensors``: ``{"<token>": (width,) or (n, width)}``.

An embedding is named by its file's stem (as A1111 names it; for diffusers' ``learned_embeds.*`` file, which
every embedding shares the name of, by its folder's name). A prompt word equal to that name uses it, as in A1111,
and so does ``<embedding:name>`` (ComfyUI's spelling, rewritten to the name before parsing). Matching works on
token ids: the name is tokenized like the prompt and, where that token sequence occurs in a prompt, its tokens
are replaced by the embedding's n vectors (A1111's ``EmbeddingDatabase.find_embedding_at_position``; the longest
name wins where two start alike).
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SDLiteError

EXTENSIONS = (".pt", ".safetensors", ".bin")
_TAG = re.compile(r"<embedding:([^>:]+)>")


class EmbeddingError(SDLiteError, ValueError):
    """An embedding file cannot be used; the message names the file and why."""


@dataclass(frozen=True, eq=False)
class Embedding:
    name: str
    vectors: torch.Tensor      # (n, width), float32
    path: str
    hash: str = ""             # A1111's short hash ("TI hashes"): the first 12 hex digits of the file's sha256

    @property
    def width(self) -> int:
        return self.vectors.shape[1]

    def __len__(self) -> int:
        return self.vectors.shape[0]


def _file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


def read_embedding(path: str | os.PathLike, name: str | None = None) -> Embedding:
    """Read one embedding file (see the module docstring for the formats)."""
    from ..errors import CheckpointError
    from ..weights.io import open_checkpoint

    p = os.fspath(path)
    try:
        store = open_checkpoint(p)
    except CheckpointError as e:
        raise EmbeddingError(str(e)) from None
    with store:
        keys = list(store.keys())
        params = [k for k in keys if k.startswith("string_to_param.")]
        if params:
            key = params[0]
        elif "emb_params" in keys:
            key = "emb_params"
        elif len(keys) == 1:
            key = keys[0]
        else:
            shown = ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")
            raise EmbeddingError(f"{p}: not a textual-inversion embedding: expected string_to_param, emb_params or "
                                 f"a single tensor, found {len(keys)} tensors ({shown})")
        vectors = store[key].detach().float().clone()
    if vectors.ndim == 1:
        vectors = vectors[None]
    if vectors.ndim != 2 or vectors.shape[0] == 0:
        raise EmbeddingError(f"{p}: tensor {key!r} has shape {tuple(vectors.shape)}: expected (vectors, width)")
    if name is None:
        stem = Path(p).stem
        name = Path(p).parent.name if stem == "learned_embeds" else stem
    return Embedding(name=name, vectors=vectors, path=p, hash=_file_hash(p))


@dataclass
class EmbeddingDB:
    """The embeddings of one folder, matched against prompts by token ids."""

    embeddings: dict[str, Embedding] = field(default_factory=dict)
    _ids: dict[int, list[tuple[tuple[int, ...], Embedding]]] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, folder: str | os.PathLike, tokenizer, width: int) -> "EmbeddingDB":
        """Every embedding file directly in ``folder`` (or below it), checked against the text encoder's width."""
        folder = Path(folder)
        if not folder.is_dir():
            raise EmbeddingError(f"embeddings folder {folder}: not a folder")
        db = cls()
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.suffix.lower() in EXTENSIONS:
                db.add(read_embedding(path), tokenizer, width)
        return db

    def add(self, embedding: Embedding, tokenizer, width: int) -> None:
        if embedding.width != width:
            raise EmbeddingError(f"{embedding.path}: embedding {embedding.name!r} has vectors of width "
                                 f"{embedding.width}, but this model's text encoder has width {width} "
                                 f"(it was made for another model family)")
        ids = tuple(tokenizer.encode(embedding.name))
        if not ids:
            raise EmbeddingError(f"{embedding.path}: the name {embedding.name!r} gives no tokens to match in a prompt")
        self.embeddings[embedding.name] = embedding
        entries = [e for e in self._ids.get(ids[0], []) if e[1].name != embedding.name] + [(ids, embedding)]
        self._ids[ids[0]] = sorted(entries, key=lambda e: len(e[0]), reverse=True)

    def find_at(self, tokens: list[int], position: int) -> tuple[Embedding, int] | None:
        """The embedding whose name's tokens start at ``tokens[position]`` and their count, or None."""
        for ids, embedding in self._ids.get(tokens[position], ()):
            if tuple(tokens[position:position + len(ids)]) == ids:
                return embedding, len(ids)
        return None

    def rewrite_tags(self, text: str) -> str:
        """``<embedding:name>`` -> ``name`` (an unknown name is an error naming the known ones)."""
        def sub(m: re.Match) -> str:
            name = m.group(1).strip()
            if name not in self.embeddings:
                known = ", ".join(sorted(self.embeddings)) or "none loaded (use --embeddings DIR)"
                raise EmbeddingError(f"embedding {name!r} in the prompt is not known; embeddings: {known}")
            return name
        return _TAG.sub(sub, text)


def rewrite_tags_without_db(text: str) -> str:
    """With no embeddings loaded, ``<embedding:name>`` is an error."""
    m = _TAG.search(text)
    if m:
        raise EmbeddingError(f"embedding {m.group(1)!r} in the prompt is not known: no embeddings are loaded "
                             "(use --embeddings DIR)")
    return text
