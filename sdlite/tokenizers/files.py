"""Reading tokenizer files, with messages naming the file: a file's text (:func:`read_text`), a ``tokenizers`` library
JSON file (:func:`read_tokenizer_json`) and the ``tokenizer.json`` shipped in the package (:func:`packaged_tokenizer`,
read once per process); and what the tokenizers over a ``tokenizers.Tokenizer`` (T5's Unigram, Qwen's BPE) share: the
check of its model and special tokens (:func:`special_ids`) and :class:`JSONTokenizer` (building one from the packaged
file or a file, its vocabulary's size, ids as text). CLIP's BPE and BERT's WordPiece read their vocabulary files here
too."""
from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import ClassVar, TypeVar

import tokenizers
import torch

__all__ = ["read_text", "read_tokenizer_json", "packaged_tokenizer", "special_ids", "JSONTokenizer"]

_T = TypeVar("_T", bound="JSONTokenizer")


def read_text(path: Path, what: str, unreadable: str | None = None) -> str:
    """The text (UTF-8) of the file ``what`` (``"T5 tokenizer file"``) at ``path``: a FileNotFoundError ``"<what> not
    found: '<path>'"`` when it is not there, a ValueError ``"cannot read <unreadable or what> '<path>': ..."`` when it
    cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {str(path)!r}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {unreadable or what} {str(path)!r}: {err}") from None


def read_tokenizer_json(path: str | Path, what: str) -> tokenizers.Tokenizer:
    """A ``tokenizers`` JSON file (``tokenizer.json``) as a ``tokenizers.Tokenizer``; the errors of :func:`read_text`
    naming it as ``what``, and a ValueError when it is not a tokenizers JSON file."""
    path = Path(path)
    text = read_text(path, what)
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as err:   # the library raises a bare Exception naming the JSON problem
        raise ValueError(f"{str(path)!r} is not a tokenizers JSON file: {err}") from None


@lru_cache(maxsize=None)
def packaged_tokenizer(parts: tuple[str, ...], what: str, remedy: str) -> tokenizers.Tokenizer:
    """The ``tokenizers`` JSON file shipped in the package at ``sdlite/<parts...>`` (read once per process). A missing
    file is a FileNotFoundError saying ``remedy`` (``"reinstall sdlite, or ..."``); an unreadable or damaged one a
    RuntimeError; each names the file and ``what`` (``"Qwen tokenizer"``)."""
    name = "/".join(("sdlite",) + parts)
    try:
        text = resources.files("sdlite").joinpath(*parts).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"the packaged {what} {name} is missing; {remedy}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise RuntimeError(f"cannot read the packaged {what} {name}: {err}") from err
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as err:   # the library raises a bare Exception naming the JSON problem
        raise RuntimeError(f"the packaged {what} {name} is damaged: {err}") from err


def special_ids(tokenizer: tokenizers.Tokenizer, tokens: Iterable[str], *, source: str, kind: str, model: str,
                model_text: str | None = None) -> dict[str, int]:
    """The ids of ``tokens`` in ``tokenizer``, a ``tokenizers.Tokenizer`` whose model must be ``model`` (``"BPE"``):
    a TypeError for another object, a ValueError naming ``source`` for another model (``"a <kind> tokenizer's model
    is <model_text or model>, this one is ..."``) or for tokens the vocabulary lacks."""
    if not isinstance(tokenizer, tokenizers.Tokenizer):
        raise TypeError(f"expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    found = type(tokenizer.model).__name__
    if found != model:
        raise ValueError(f"{source}: a {kind} tokenizer's model is {model_text or model}, this one is {found}")
    ids = {name: tokenizer.token_to_id(name) for name in tokens}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"{source}: not a {kind} tokenizer, its vocabulary lacks the token(s) "
                         f"{', '.join(map(repr, missing))}")
    return ids


class JSONTokenizer:
    """What the tokenizers over a ``tokenizers.Tokenizer`` share (:class:`~sdlite.tokenizers.t5.T5Tokenizer`,
    :class:`~sdlite.tokenizers.qwen.QwenTokenizer`): building one from the packaged ``tokenizer.json`` or from a file,
    the vocabulary's size, ids as text. A subclass names itself in ``label`` (for messages), its packaged file in
    ``package_file`` (under ``sdlite/``), its row length in ``default_max_length`` and the folder its
    ``from_pretrained_dir`` reads in ``folder_hint``; its ``__init__`` takes ``(tokenizer, max_length=, source=)`` and
    keeps the tokenizer as ``_tokenizer``."""

    label: ClassVar[str]
    package_file: ClassVar[tuple[str, ...]]
    default_max_length: ClassVar[int]
    folder_hint: ClassVar[str] = "tokenizer"
    _tokenizer: tokenizers.Tokenizer
    max_length: int

    @classmethod
    def from_package(cls: type[_T], max_length: int | None = None) -> _T:
        """The tokenizer shipped in the package (read once per process); ``max_length`` None: the default length."""
        tokenizer = packaged_tokenizer(cls.package_file, f"{cls.label} tokenizer", "reinstall sdlite, or load a model "
                                       f"folder's {cls.folder_hint} with {cls.__name__}.from_pretrained_dir")
        return cls(tokenizer, max_length=cls._default(max_length), source="/".join(("sdlite",) + cls.package_file))

    @classmethod
    def from_file(cls: type[_T], path: str | Path, max_length: int | None = None) -> _T:
        """From a ``tokenizers`` JSON file (``tokenizer.json``); ``max_length`` None: the default length."""
        tokenizer = read_tokenizer_json(path, f"{cls.label} tokenizer file")
        return cls(tokenizer, max_length=cls._default(max_length), source=str(Path(path)))

    @classmethod
    def _default(cls, max_length: int | None) -> int:
        return cls.default_max_length if max_length is None else max_length

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can give, special tokens included (T5 v1.1: 32100, Qwen: 151669; the encoders'
        embeddings have more rows)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Text of ids (for debugging); with ``skip_special_tokens`` the special tokens (``</s>``, ``<pad>``,
        ``<|im_start|>`` and the like) are left out."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"id {bad[0]} is not in the {self.label} vocabulary (size {self.vocab_size})")
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, max_length={self.max_length})"
