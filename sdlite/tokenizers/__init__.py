"""Tokenizers behind one interface: CLIP's byte-level BPE (:mod:`sdlite.tokenizers.clip_bpe`, SD 1.x/2.x), BERT's
WordPiece (:mod:`sdlite.tokenizers.wordpiece`, Chinese models such as Taiyi) and T5's SentencePiece Unigram
(:mod:`sdlite.tokenizers.t5`, SD3 / FLUX) and Qwen's byte-level BPE (:mod:`sdlite.tokenizers.qwen`, the LLM text
encoders of Z-Image and after). The pipeline does not care which it has; every tokenizer offers:

* ``kind`` ("clip_bpe" | "wordpiece" | "t5" | "qwen"), ``vocab_size``, ``max_length``, ``bos_token_id`` / ``eos_token_id``
  (the start and end tokens: CLIP's ``<|startoftext|>``/``<|endoftext|>``, BERT's ``[CLS]``/``[SEP]``; T5 has no
  start token, None, and ends with ``</s>``), ``pad_token_id``;
* ``encode(text) -> list[int]``: the text's ids without start/end tokens, not truncated (T5: with its ``</s>``, as
  transformers gives them; its rows come from ``pad(ids)`` and its weighted prompts from ``encode_weighted``);
* ``tok(texts) -> LongTensor (B, max_length)``: framed, truncated and padded as the reference does;
* ``tokenize_with_info(text) -> TokenizedPrompt``: one framed row and what was cut (for the user's warning);
* ``decode(ids) -> str`` (for debugging).

:func:`load_tokenizer` picks the right one from a model folder's ``tokenizer/`` files.
"""
from __future__ import annotations

import re
from pathlib import Path

from .clip_bpe import CLIPTokenizer, TokenizedPrompt
from .qwen import QwenTokenizer, is_qwen_tokenizer_json
from .t5 import T5Tokenizer, is_t5_tokenizer_json
from .wordpiece import WordPieceTokenizer

__all__ = ["CLIPTokenizer", "QwenTokenizer", "T5Tokenizer", "TokenizedPrompt", "WordPieceTokenizer", "load_tokenizer",
           "tokenizer_kind"]


def tokenizer_kind(folder: str | Path) -> str | None:
    """"wordpiece" (``vocab.txt``, or a WordPiece ``tokenizer.json``), "qwen" (Qwen's ``tokenizer.json``, whatever
    else the folder holds), "clip_bpe" (``vocab.json`` + ``merges.txt``, or a BPE ``tokenizer.json``), "t5" (a
    SentencePiece ``tokenizer.json``, or ``spiece.model`` alone) or None."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file() and is_qwen_tokenizer_json(folder / "tokenizer.json"):
        return "qwen"
    if (folder / "vocab.txt").is_file():
        return "wordpiece"
    if (folder / "vocab.json").is_file():
        return "clip_bpe"
    if (folder / "tokenizer.json").is_file():   # transformers 5 saves only this: its model says which
        if is_t5_tokenizer_json(folder / "tokenizer.json"):
            return "t5"
        try:
            with open(folder / "tokenizer.json", encoding="utf-8") as f:
                head = f.read(1 << 16)
        except OSError:
            return "clip_bpe"
        return "wordpiece" if re.search(r'"type"\s*:\s*"WordPiece"', head) or \
            re.search(r'"type"\s*:\s*"BertNormalizer"', head) else "clip_bpe"
    if (folder / "spiece.model").is_file():
        return "t5"
    return None


def load_tokenizer(folder: str | Path, max_length: int | None = None):
    """The tokenizer of a ``tokenizer/`` folder (see :func:`tokenizer_kind`)."""
    kind = tokenizer_kind(folder)
    if kind == "wordpiece":
        return WordPieceTokenizer.from_pretrained_dir(folder, max_length=max_length)
    if kind == "clip_bpe":
        return CLIPTokenizer.from_pretrained_dir(folder) if max_length is None else \
            CLIPTokenizer.from_pretrained_dir(folder, max_length=max_length)
    if kind == "t5":
        return T5Tokenizer.from_pretrained_dir(folder, max_length=max_length)
    if kind == "qwen":
        return QwenTokenizer.from_pretrained_dir(folder, max_length=max_length)
    raise FileNotFoundError(f"no tokenizer files in {str(folder)!r}: expected vocab.txt (WordPiece), "
                            "vocab.json + merges.txt (CLIP BPE) or a SentencePiece tokenizer.json (T5)")

