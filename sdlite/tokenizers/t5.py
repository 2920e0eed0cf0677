"""T5's SentencePiece (Unigram) tokenizer, as SD3 / 3.5 and FLUX.1 feed their T5-XXL text encoder.

The vocabulary and the rules are a ``tokenizers`` JSON file, read and run by the ``tokenizers`` library: the one
shipped in the package (``sdlite/data/t5/tokenizer.json``, T5 v1.1's vocabulary, which every SD3 and FLUX
folder's ``tokenizer_3`` / ``tokenizer_2`` also holds) or a folder's own. What it does:

1. NFKC-style normalisation (SentencePiece's precompiled character map) and runs of spaces collapsed to one;
2. ``▁`` for each space and one in front, words split at it (Metaspace); the special tokens ``<pad>``, ``</s>``,
   ``<unk>`` and ``<extra_id_N>`` written in the prompt are their ids;
3. each word cut into the vocabulary's pieces of highest total log-probability (Unigram); a character the
   vocabulary lacks (most CJK, emoji) is ``<unk>`` (2);
4. ``</s>`` (1) appended.

The ids equal transformers' ``T5TokenizerFast(tokenizer_file=...)`` with ``add_special_tokens=True``. A row for
the encoder is cut to ``max_length`` with ``</s>`` kept last and padded with ``<pad>`` (0), as diffusers' SD3 and
FLUX pipelines tokenize (``padding="max_length", truncation=True``). T5 has no start token.

Public API::

    tok = T5Tokenizer.from_package()                       # shipped tokenizer.json, 256 tokens (SD3)
    tok = T5Tokenizer.from_package(max_length=512)         # FLUX.1 dev
    tok = T5Tokenizer.from_pretrained_dir(folder)          # a tokenizer folder holding tokenizer.json

    tok.encode("a cat")             -> [3, 9, 1712, 1]                (with </s>, not cut)
    tok.encode_weighted([("a ", 1.0), ("cat", 1.2)]) -> ([3, 9, 1712, 1], [1.0, 1.0, 1.2, 1.0])
    tok.encode_weighted(fragments, max_length=256)  -> (256 ids, 256 weights, tokens cut)
    tok.pad(ids)                    -> max_length ids: cut (</s> kept last) and padded with <pad>
    tok.pad_weights(weights)        -> the weights cut and padded alike (pads weigh 1.0)
    tok(["a cat", "a dog"])         -> LongTensor (2, max_length)
    tok.tokenize_with_info(text)    -> TokenizedPrompt (the row, how many tokens were cut, the cut-off text)
    tok.decode(ids)                 -> str (for debugging)
"""
from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from pathlib import Path

import tokenizers
import torch

from ..config.t5 import SD3_T5_MAX_LENGTH
from ..prompts import is_break
from .clip_bpe import TokenizedPrompt, framed_rows
from .files import JSONTokenizer, special_ids

__all__ = ["T5Tokenizer", "EOS_TOKEN", "PAD_TOKEN", "UNK_TOKEN", "EOS_TOKEN_ID", "PAD_TOKEN_ID", "UNK_TOKEN_ID"]

EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "</s>", "<pad>", "<unk>"
EOS_TOKEN_ID, PAD_TOKEN_ID, UNK_TOKEN_ID = 1, 0, 2   # the ids T5's vocabulary gives them
_NON_SPACE = re.compile(r"\S")


class T5Tokenizer(JSONTokenizer):
    """T5's Unigram tokenizer over a ``tokenizers.Tokenizer`` (see the module docstring).

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` whose model is Unigram and whose vocabulary has ``</s>`` and
            ``<pad>`` (the file's padding and truncation settings, if any, are not used: :meth:`pad` cuts).
        max_length: length of every row given to the encoder (256 for SD3; FLUX.1 dev 512, schnell 256).
        source: where the tokenizer came from (for messages).
    """

    kind = "t5"
    bos_token_id = None   # T5 has no start token
    label = "T5"
    package_file = ("data", "t5", "tokenizer.json")   # T5 v1.1's vocabulary
    default_max_length = SD3_T5_MAX_LENGTH

    def __init__(self, tokenizer: tokenizers.Tokenizer, max_length: int = SD3_T5_MAX_LENGTH, source: str = "T5"):
        ids = special_ids(tokenizer, (EOS_TOKEN, PAD_TOKEN), source=source, kind="T5", model="Unigram",
                          model_text="Unigram (SentencePiece)")
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise ValueError(f"max_length must be an integer >= 1 (room for </s>), got {max_length!r}")
        self._tokenizer = tokenizer
        self.eos_token_id = ids[EOS_TOKEN]
        self.pad_token_id = ids[PAD_TOKEN]
        self.unk_token_id = tokenizer.token_to_id(UNK_TOKEN)
        self.max_length = max_length
        self.source = source

    # ---------------------------------------------------------- construction (from_package, from_file: inherited)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, max_length: int | None = None) -> "T5Tokenizer":
        """From a tokenizer folder (a diffusers SD3 folder's ``tokenizer_3``, a FLUX folder's ``tokenizer_2``) and
        its ``tokenizer.json``. ``max_length`` defaults to SD3's 256 (the pipelines choose the length, not the
        folder's ``model_max_length``). A folder with only SentencePiece's ``spiece.model`` is refused: the
        ``tokenizers`` library reads JSON; :meth:`from_package` holds the same T5 v1.1 vocabulary."""
        folder = Path(path)
        if (folder / "tokenizer.json").is_file():
            return cls.from_file(folder / "tokenizer.json", max_length=max_length)
        if (folder / "spiece.model").is_file():
            raise FileNotFoundError(f"T5 tokenizer folder {str(folder)!r} has spiece.model but no tokenizer.json; "
                                    "only the tokenizers JSON form is read (the packaged T5 v1.1 tokenizer is the "
                                    "same vocabulary)")
        raise FileNotFoundError(f"no T5 tokenizer.json in {str(folder)!r}")

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` followed by ``</s>``, not cut (``T5TokenizerFast(text).input_ids``)."""
        if not isinstance(text, str):
            raise TypeError(f"expected a string, got {type(text).__name__}")
        return [*self._tokenizer.encode(text, add_special_tokens=False).ids, self.eos_token_id]

    def encode_weighted(self, fragments: Sequence[tuple[str, float]], max_length: int | None = None
                        ) -> tuple[list[int], list[float]] | tuple[list[int], list[float], int]:
        """``(ids, weights)`` of a prompt parsed into ``(text, weight)`` fragments
        (:func:`sdlite.prompts.parse_attention`), ``</s>`` last with weight 1.0; not cut. With ``max_length``:
        ``(ids, weights, cut)``, the row the encoder reads (:meth:`pad` and :meth:`pad_weights`) and how many of
        the prompt's tokens were cut to make it (for the caller's warning).

        The ids are those of the fragments' texts joined, tokenized as one text: exactly :meth:`encode` of the
        prompt without its emphasis syntax, so weighting never changes the tokens. Each token carries the weight of
        the fragment holding its first non-space character (a token that is only the ``▁`` of a word: that
        word's). A word split by a bracket (``photo(graph:1.2)``) is one piece ``▁photograph`` taking the first
        fragment's weight. ``BREAK`` markers (``("BREAK", -1.0)``) end a CLIP chunk; T5 reads one row, so each is
        a word break (a space) here and the caller says it was ignored.
        """
        texts: list[str] = []
        weights: list[float] = []
        for fragment in fragments:
            if not (isinstance(fragment, (tuple, list)) and len(fragment) == 2 and isinstance(fragment[0], str)
                    and isinstance(fragment[1], (int, float)) and not isinstance(fragment[1], bool)):
                raise TypeError(f"expected (text, weight) fragments, got {fragment!r}")
            if is_break(tuple(fragment)):
                texts.append(" ")
                weights.append(1.0)
            else:
                texts.append(fragment[0])
                weights.append(float(fragment[1]))
        text = "".join(texts)
        starts = []
        position = 0
        for piece in texts:
            starts.append(position)
            position += len(piece)
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        token_weights = []
        for begin, _ in encoding.offsets:
            found = _NON_SPACE.search(text, begin)
            at = found.start() if found else min(begin, max(len(text) - 1, 0))
            token_weights.append(weights[bisect.bisect_right(starts, at) - 1])
        ids, token_weights = [*encoding.ids, self.eos_token_id], [*token_weights, 1.0]
        if max_length is None:
            return ids, token_weights
        cut = max(0, len(ids) - self._length(max_length))
        return self.pad(ids, max_length), self.pad_weights(token_weights, max_length), cut

    def pad(self, ids: Sequence[int], max_length: int | None = None) -> list[int]:
        """``ids`` (ending in ``</s>``, as :meth:`encode` gives them) as one row of ``max_length`` (default: the
        tokenizer's): cut with ``</s>`` kept last, then padded with ``<pad>``. ``len(ids) - max_length`` tokens
        are cut when that is positive."""
        length = self._length(max_length)
        ids = list(ids)
        if not ids or ids[-1] != self.eos_token_id:
            raise ValueError(f"T5 ids must end with </s> ({self.eos_token_id}), as encode() gives them; got "
                             f"{'no ids' if not ids else f'last id {ids[-1]}'}")
        if len(ids) > length:
            ids = ids[:length - 1] + [self.eos_token_id]
        return ids + [self.pad_token_id] * (length - len(ids))

    def pad_weights(self, weights: Sequence[float], max_length: int | None = None) -> list[float]:
        """The weights of :meth:`encode_weighted` cut and padded as :meth:`pad` cuts and pads its ids (the
        ``</s>`` weight kept last, each pad 1.0)."""
        length = self._length(max_length)
        weights = [float(w) for w in weights]
        if not weights:
            raise ValueError("T5 weights must hold at least the </s> token's")
        if len(weights) > length:
            weights = weights[:length - 1] + [weights[-1]]
        return weights + [1.0] * (length - len(weights))

    def __call__(self, texts: str | Sequence[str]) -> torch.LongTensor:
        """One prompt or a list -> LongTensor (B, max_length): diffusers' T5 tokenization of SD3 and FLUX."""
        return framed_rows(texts, lambda t: self.pad(self.encode(t)), self.max_length)

    def tokenize_with_info(self, text: str) -> TokenizedPrompt:
        """One row of ``max_length`` and what was cut (for the user's warning). ``num_tokens`` and ``num_kept``
        count the prompt's tokens, ``</s>`` not included; ``dropped_text`` is the prompt from the first token cut
        (its leading spaces left out)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids = [*encoding.ids, self.eos_token_id]
        capacity = self.max_length - 1
        kept = min(len(encoding.ids), capacity)
        dropped = ""
        if len(encoding.ids) > capacity:
            dropped = text[encoding.offsets[capacity][0]:].lstrip()
        return TokenizedPrompt(input_ids=self.pad(ids), num_tokens=len(encoding.ids), num_kept=kept,
                               dropped_text=dropped)

    def _length(self, max_length: int | None) -> int:
        length = self.max_length if max_length is None else max_length
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"max_length must be an integer >= 1 (room for </s>), got {length!r}")
        return length


def is_t5_tokenizer_json(path: str | Path) -> bool:
    """Whether a ``tokenizer.json`` holds a SentencePiece tokenizer (the T5 kind sdlite runs), from its head: the
    precompiled character map or Metaspace pre-tokenizer that SentencePiece conversions have."""
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(1 << 16)
    except (OSError, UnicodeDecodeError):
        return False
    return bool(re.search(r'"type"\s*:\s*"(Precompiled|Metaspace|Unigram)"', head))

