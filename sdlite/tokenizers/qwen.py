"""Qwen's byte-level BPE tokenizer (Qwen2, Qwen2.5 and Qwen3 share it), as the text encoders of Z-Image, FLUX.2 klein
and Qwen-Image read their prompts.

The vocabulary and the rules are a ``tokenizers`` JSON file run by the ``tokenizers`` library: the one shipped in the
package (``sdlite/data/qwen/tokenizer.json``, its README says how it was built and which ids are known) or a folder's
own (a diffusers folder's ``tokenizer/tokenizer.json``). What it does: NFC normalisation; Qwen's split regex (letters,
single digits, punctuation runs, newlines, spaces); each piece's UTF-8 bytes as GPT-2's byte symbols, merged by the
BPE ranks. No start token is added and nothing is appended. The special tokens ``<|endoftext|>`` (151643),
``<|im_start|>`` (151644), ``<|im_end|>`` (151645) and the rest written in the text are their ids, so a chat
template is plain text.

The ids equal transformers' ``Qwen2TokenizerFast(tokenizer_file=...)``. A row for the encoder is the ids cut to
``max_length`` (the end cut off) and padded on the right with ``<|endoftext|>`` (Qwen's pad token), with an attention
mask of 1 for the tokens and 0 for the pads: diffusers' ``tokenizer(texts, padding="max_length",
max_length=512, truncation=True)`` in the Z-Image and FLUX.2 klein pipelines. The pad id is also a real token's, so
the mask, not the ids, says where a row's tokens end.

The chat template (:meth:`QwenTokenizer.chat_prompt`) is Qwen3's, as ``tokenizer.apply_chat_template([{"role":
"user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=...)`` renders one user
message: ``<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n``, followed by an empty think block
``<think>\\n\\n</think>\\n\\n`` when ``enable_thinking=False``. Z-Image calls it with ``enable_thinking=True`` (no
think block), FLUX.2 klein with ``enable_thinking=False``. With ``system`` a system turn comes first, in the same
format (Qwen-Image's fixed template is a system turn, the user turn and the assistant's start).

Public API::

    tok = QwenTokenizer.from_package()                    # shipped tokenizer.json, rows of 512
    tok = QwenTokenizer.from_pretrained_dir(folder)       # a tokenizer/ folder, or a model folder holding one

    tok.encode("Hello, world")        -> [9707, 11, 1879]   (no start token, not cut)
    tok.chat_prompt("a cat")          -> "<|im_start|>user\\na cat<|im_end|>\\n<|im_start|>assistant\\n"
    tok.pad(ids)                      -> (max_length ids, max_length mask)
    tok.rows(texts)                   -> (LongTensor ids (B, max_length), LongTensor mask (B, max_length))
    tok.chat_rows(prompts)            -> rows of the chat-templated prompts (Z-Image; enable_thinking=False: klein)
    tok(texts)                        -> LongTensor (B, max_length), the ids of rows()
    tok.tokenize_with_info(text)      -> TokenizedPrompt (the row, how many tokens were cut, the cut-off text)
    tok.decode(ids)                   -> str (for debugging)
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import tokenizers
import torch

from ..config.qwen import QWEN_MAX_LENGTH
from .clip_bpe import TokenizedPrompt, framed_rows
from .files import JSONTokenizer, special_ids

__all__ = ["QwenTokenizer", "ENDOFTEXT_TOKEN", "IM_START_TOKEN", "IM_END_TOKEN", "PAD_TOKEN_ID", "IM_START_ID",
           "IM_END_ID", "THINK_BLOCK", "is_qwen_tokenizer_json"]

ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
PAD_TOKEN_ID, IM_START_ID, IM_END_ID = 151643, 151644, 151645   # the ids Qwen's vocabulary gives them
#: the empty reasoning block Qwen3's template opens the assistant's turn with when thinking is off
THINK_BLOCK = "<think>\n\n</think>\n\n"
_REQUIRED = (ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)


class QwenTokenizer(JSONTokenizer):
    """Qwen's byte-level BPE over a ``tokenizers.Tokenizer`` (see the module docstring).

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` whose model is BPE and whose vocabulary has ``<|endoftext|>``,
            ``<|im_start|>`` and ``<|im_end|>`` (the file's own padding and truncation settings are not used).
        max_length: length of every row given to the encoder (512 in the Z-Image and FLUX.2 klein pipelines).
        source: where the tokenizer came from (for messages).
    """

    kind = "qwen"
    bos_token_id = None   # Qwen adds no start token
    label = "Qwen"
    package_file = ("data", "qwen", "tokenizer.json")
    default_max_length = QWEN_MAX_LENGTH
    folder_hint = "tokenizer/"

    def __init__(self, tokenizer: tokenizers.Tokenizer, max_length: int = QWEN_MAX_LENGTH, source: str = "Qwen"):
        ids = special_ids(tokenizer, _REQUIRED, source=source, kind="Qwen", model="BPE")
        _check_length(max_length)
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self.pad_token_id = self.eos_token_id = ids[ENDOFTEXT_TOKEN]
        self.im_start_id, self.im_end_id = ids[IM_START_TOKEN], ids[IM_END_TOKEN]
        self.max_length = max_length
        self.source = source

    # ---------------------------------------------------------- construction (from_package, from_file: inherited)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, max_length: int | None = None) -> "QwenTokenizer":
        """From a tokenizer folder holding ``tokenizer.json`` (a diffusers Z-Image, FLUX.2 klein or Qwen-Image
        folder's ``tokenizer/``), or a model folder whose ``tokenizer/`` holds it. ``max_length`` defaults to 512
        (the pipelines choose the length, not the folder's ``model_max_length``). A folder with only ``vocab.json``
        and ``merges.txt`` is refused: the packaged tokenizer (:meth:`from_package`) is the same vocabulary."""
        folder = Path(path)
        for candidate in (folder, folder / "tokenizer"):
            if (candidate / "tokenizer.json").is_file():
                return cls.from_file(candidate / "tokenizer.json", max_length=max_length)
        if not folder.is_dir():
            raise FileNotFoundError(f"Qwen tokenizer folder not found: {str(folder)!r}")
        if (folder / "vocab.json").is_file() or (folder / "tokenizer" / "vocab.json").is_file():
            raise FileNotFoundError(f"Qwen tokenizer folder {str(folder)!r} has vocab.json but no tokenizer.json; "
                                    "only the tokenizers JSON form is read (QwenTokenizer.from_package() holds the "
                                    "same vocabulary)")
        raise FileNotFoundError(f"no Qwen tokenizer.json in {str(folder)!r} or its tokenizer/ folder")

    # ------------------------------------------------------------------ encoding

    def token_to_id(self, token: str) -> int | None:
        """The id of one token (``"<|im_start|>"`` -> 151644), None when the vocabulary lacks it."""
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, nothing added, not cut (``Qwen2TokenizerFast(text).input_ids``); special tokens
        written in the text are their ids."""
        if not isinstance(text, str):
            raise TypeError(f"expected a string, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    @staticmethod
    def chat_prompt(prompt: str, *, enable_thinking: bool = True, system: str | None = None) -> str:
        """``prompt`` as the one user message of Qwen3's chat template with the generation prompt (the assistant's
        turn opened): ``<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n``, plus :data:`THINK_BLOCK`
        when ``enable_thinking`` is False (FLUX.2 klein); with ``system`` a
        ``<|im_start|>system\\n{system}<|im_end|>\\n`` turn first."""
        if not isinstance(prompt, str):
            raise TypeError(f"expected the prompt as a string, got {type(prompt).__name__}")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"expected the system message as a string, got {type(system).__name__}")
        head = "" if system is None else f"{IM_START_TOKEN}system\n{system}{IM_END_TOKEN}\n"
        text = f"{head}{IM_START_TOKEN}user\n{prompt}{IM_END_TOKEN}\n{IM_START_TOKEN}assistant\n"
        return text if enable_thinking else text + THINK_BLOCK

    def pad(self, ids: Sequence[int], max_length: int | None = None) -> tuple[list[int], list[int]]:
        """``ids`` as one row of ``max_length`` (default: the tokenizer's) and its attention mask: the first
        ``max_length`` ids, then ``<|endoftext|>`` pads; the mask 1 on the ids and 0 on the pads."""
        length = _check_length(self.max_length if max_length is None else max_length)
        ids = [int(i) for i in ids][:length]
        pads = length - len(ids)
        return ids + [self.pad_token_id] * pads, [1] * len(ids) + [0] * pads

    def rows(self, texts: str | Sequence[str], max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One text or a list -> ``(ids, mask)``, LongTensors (B, max_length): diffusers' ``tokenizer(texts,
        padding="max_length", max_length=..., truncation=True)`` ``input_ids`` and ``attention_mask``."""
        texts = _texts(texts)
        length = _check_length(self.max_length if max_length is None else max_length)
        pairs = [self.pad(e.ids, length) for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]
        ids = torch.tensor([p[0] for p in pairs], dtype=torch.long).reshape(len(pairs), length)
        mask = torch.tensor([p[1] for p in pairs], dtype=torch.long).reshape(len(pairs), length)
        return ids, mask

    def chat_rows(self, prompts: str | Sequence[str], *, enable_thinking: bool = True, system: str | None = None,
                  max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`rows` of the prompts in the chat template (:meth:`chat_prompt`): Z-Image's encoding with the
        defaults, FLUX.2 klein's with ``enable_thinking=False``."""
        texts = [self.chat_prompt(p, enable_thinking=enable_thinking, system=system) for p in _texts(prompts)]
        return self.rows(texts, max_length)

    def __call__(self, texts: str | Sequence[str]) -> torch.LongTensor:
        """One text or a list -> LongTensor (B, max_length): the ids of :meth:`rows` (the mask is :meth:`rows`')."""
        return framed_rows(texts, lambda t: self.pad(self.encode(t))[0], self.max_length)

    def tokenize_with_info(self, text: str) -> TokenizedPrompt:
        """One row of ``max_length`` and what was cut (for the user's warning): ``num_tokens`` and ``num_kept`` count
        the text's tokens; ``dropped_text`` is the text from the first token cut (its leading spaces left out)."""
        if not isinstance(text, str):
            raise TypeError(f"expected a string, got {type(text).__name__}")
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        kept = min(len(encoding.ids), self.max_length)
        dropped = ""
        if len(encoding.ids) > self.max_length:
            dropped = text[encoding.offsets[self.max_length][0]:].lstrip()
        return TokenizedPrompt(input_ids=self.pad(encoding.ids)[0], num_tokens=len(encoding.ids), num_kept=kept,
                               dropped_text=dropped)


def _check_length(length) -> int:
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"max_length must be an integer >= 1, got {length!r}")
    return length


def _texts(texts: str | Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
        raise TypeError("expected a string or a list of strings")
    return list(texts)


def is_qwen_tokenizer_json(path: str | Path) -> bool:
    """Whether a ``tokenizer.json`` holds Qwen's tokenizer, from its head: the added tokens, listed first, include
    ``<|im_start|>`` and ``<|endoftext|>``, and the model is BPE."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(1 << 16)
    except (OSError, UnicodeDecodeError):
        return False
    return IM_START_TOKEN in head and ENDOFTEXT_TOKEN in head and \
        not re.search(r'"type"\s*:\s*"(Unigram|WordPiece)"', head)
