"""Tokenizers behind one interface: CLIP's byte-level BPE (:mod:`sdlite.tokenizers.clip_bpe`, SD 1.x/2.x) and BERT's
WordPiece (:mod:`sdlite.tokenizers.wordpiece`, Chinese models such as Taiyi). The pipeline does not care which it
has; every tokenizer offers:

* ``kind`` ("clip_bpe" | "wordpiece"), ``vocab_size``, ``max_length``, ``bos_token_id`` / ``eos_token_id`` (the
  start and end tokens: CLIP's ``<|startoftext|>``/``<|endoftext|>``, BERT's ``[CLS]``/``[SEP]``), ``pad_token_id``;
* ``encode(text) -> list[int]``: the text's ids without start/end tokens, not truncated;
* ``tok(texts) -> LongTensor (B, max_length)``: framed, truncated and padded as the reference does;
* ``tokenize_with_info(text) -> TokenizedPrompt``: one framed row and what was cut (for the user's warning);
* ``decode(ids) -> str`` (for debugging).

:func:`load_tokenizer` picks the right one from a model folder's ``tokenizer/`` files.
"""
from __future__ import annotations

import re
from pathlib import Path

from .clip_bpe import CLIPTokenizer, TokenizedPrompt
from .wordpiece import WordPieceTokenizer

__all__ = ["CLIPTokenizer", "TokenizedPrompt", "WordPieceTokenizer", "load_tokenizer", "tokenizer_kind"]


def tokenizer_kind(folder: str | Path) -> str | None:
    """"wordpiece" (``vocab.txt``, or a WordPiece ``tokenizer.json``), "clip_bpe" (``vocab.json`` + ``merges.txt``, or a
    BPE ``tokenizer.json``) or None."""
    folder = Path(folder)
    if (folder / "vocab.txt").is_file():
        return "wordpiece"
    if (folder / "vocab.json").is_file():
        return "clip_bpe"
    if (folder / "tokenizer.json").is_file():   # transformers 5 saves only this: its model says which
        try:
            with open(folder / "tokenizer.json", encoding="utf-8") as f:
                head = f.read(1 << 16)
        except OSError:
            return "clip_bpe"
        return "wordpiece" if re.search(r'"type"\s*:\s*"WordPiece"', head) or \
            re.search(r'"type"\s*:\s*"BertNormalizer"', head) else "clip_bpe"
    return None


def load_tokenizer(folder: str | Path, max_length: int | None = None):
    """The tokenizer of a ``tokenizer/`` folder (see :func:`tokenizer_kind`)."""
    kind = tokenizer_kind(folder)
    if kind == "wordpiece":
        return WordPieceTokenizer.from_pretrained_dir(folder, max_length=max_length)
    if kind == "clip_bpe":
        return CLIPTokenizer.from_pretrained_dir(folder) if max_length is None else \
            CLIPTokenizer.from_pretrained_dir(folder, max_length=max_length)
    raise FileNotFoundError(f"no tokenizer files in {str(folder)!r}: expected vocab.txt (WordPiece) or "
                            "vocab.json + merges.txt (CLIP BPE)")

