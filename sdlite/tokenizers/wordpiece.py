"""BERT's WordPiece tokenizer, as Chinese Stable Diffusion models (Taiyi) use it with their BERT text encoder.

Exact to transformers' ``BertTokenizer`` (in transformers 5 the ``tokenizers``-backed one: its ``BertNormalizer``,
``BertPreTokenizer``, ``WordPiece`` model and ``[CLS] $A [SEP]`` post-processor), read from a model folder's
``tokenizer/vocab.txt`` (one token a line; the line number is the id) and ``tokenizer_config.json``:

1. special tokens written in the prompt (``[CLS]``, ``[SEP]``, ``[PAD]``, ``[MASK]``, ``[UNK]``, exactly as
   spelled) are their ids; the text between them goes through steps 2-4;
2. clean-up: NUL, U+FFFD and control, format, private-use and surrogate characters (Cc, Cf, Co, Cs; not the
   unassigned code points) are removed; tab, newline, carriage return and every other white-space character
   become a space;
3. every CJK ideograph (the CJK Unified Ideographs blocks and their extensions, and the compatibility
   ideographs; not kana, hangul, nor full-width punctuation) is set apart by spaces, so it is a word of its own;
4. accents are stripped (NFD, then non-spacing marks removed) when ``strip_accents`` says so, or when it is unset
   and the text is lower-cased; then lower-casing (``do_lower_case``);
5. words are split at white space, and each punctuation character (ASCII punctuation and Unicode category P)
   is a word of its own;
6. each word becomes the longest vocabulary entry that starts it, then the longest ``##`` entry that continues
   it, and so on; a word with a piece found nowhere, or longer than 100 characters, is ``[UNK]`` as a whole;
7. ``[CLS]`` + tokens + ``[SEP]``, cut to the model's length (the end token kept last) and padded with ``[PAD]``.

The length is ``model_max_length`` of the tokenizer config (512 for Taiyi); the pipeline warns when a prompt is
cut (:meth:`WordPieceTokenizer.tokenize_with_info`).

Where Python's ``str`` and Rust's ``char`` disagree, this follows the reference (Rust): lower-casing is per
character (a word-final capital sigma becomes ``σ``, not ``ς``), and white space is Unicode's White_Space
property.
"""
from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .clip_bpe import TokenizedPrompt, framed_rows
from .files import read_text

__all__ = ["WordPieceTokenizer", "MAX_INPUT_CHARS_PER_WORD", "is_cjk"]

MAX_INPUT_CHARS_PER_WORD = 100
CONTINUATION = "##"
# the tokens a BERT vocabulary defines by these names, and the config keys that can rename them
_SPECIAL_KEYS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                 "mask_token": "[MASK]"}
# Unicode's White_Space property (what Rust's char::is_whitespace tests), beyond what is in category Z
_WHITE_SPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | frozenset(
    chr(c) for c in range(0x2000, 0x200B))
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def is_cjk(ch: str) -> bool:
    """A CJK ideograph, as BERT's Chinese-character rule defines it (a word of its own)."""
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def _is_whitespace(ch: str) -> bool:
    return ch in _WHITE_SPACE


def _is_control(ch: str) -> bool:
    """Control, format, private-use and surrogate characters (Cc, Cf, Co, Cs); not unassigned code points (Cn),
    which the reference keeps (they become [UNK], or a word of their own in a CJK block)."""
    return ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


class WordPieceTokenizer:
    """WordPiece tokenizer with BERT's normalisation (see the module docstring for the exact steps).

    Args:
        vocab: the tokens in id order (``vocab.txt``'s lines).
        max_length: length of every tokenized row (``model_max_length``; 512 for Taiyi).
        do_lower_case: lower-case the text (BERT-base-Chinese and Taiyi: True).
        strip_accents: None (strip when lower-casing), True or False.
        tokenize_chinese_chars: set every CJK ideograph apart (True for every Chinese model).
        special_tokens: names of the unk/sep/pad/cls/mask tokens (defaults ``[UNK]`` ...).
    """

    kind = "wordpiece"

    def __init__(self, vocab: Sequence[str], max_length: int = 512, do_lower_case: bool = True,
                 strip_accents: bool | None = None, tokenize_chinese_chars: bool = True,
                 special_tokens: dict[str, str] | None = None):
        if not isinstance(vocab, (list, tuple)) or not vocab or not all(isinstance(t, str) for t in vocab):
            raise ValueError("vocab must be a non-empty list of token strings")
        self.vocab: list[str] = list(vocab)
        # a repeated line: the last id wins, as transformers reads vocab.txt
        self.encoder: dict[str, int] = {token: i for i, token in enumerate(self.vocab)}
        self.decoder = {i: t for i, t in enumerate(self.vocab)}
        names = {**_SPECIAL_KEYS, **(special_tokens or {})}
        for key, token in names.items():
            if token not in self.encoder:
                raise ValueError(f"the vocabulary lacks the {key.replace('_', ' ')} {token!r}")
        self.special_tokens = names
        self.unk_token_id = self.encoder[names["unk_token"]]
        self.bos_token_id = self.cls_token_id = self.encoder[names["cls_token"]]
        self.eos_token_id = self.sep_token_id = self.encoder[names["sep_token"]]
        self.pad_token_id = self.encoder[names["pad_token"]]
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
            raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
        self.max_length = max_length
        self.do_lower_case = bool(do_lower_case)
        self.strip_accents = strip_accents
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        specials = sorted(set(names.values()), key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")
        self._cache: dict[str, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_files(cls, vocab_txt: str | Path, config_json: str | Path | None = None,
                   max_length: int | None = None) -> "WordPieceTokenizer":
        """From ``vocab.txt`` and (optionally) ``tokenizer_config.json``; ``max_length`` overrides the config's
        ``model_max_length`` (which defaults to 512)."""
        vocab_txt = Path(vocab_txt)
        text = read_text(vocab_txt, "WordPiece vocabulary file", "the WordPiece vocabulary")
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        vocab = [line.rstrip("\r") for line in lines]
        # transformers strips each line's trailing newline only; a blank line is a token ("") with its id
        return cls._from_config(vocab, cls._read_config(config_json), max_length, vocab_txt)

    @staticmethod
    def _read_config(config_json: str | Path | None) -> dict:
        config: dict = {}
        if config_json is not None and Path(config_json).is_file():
            try:
                config = json.loads(Path(config_json).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"cannot read {str(config_json)!r}: {err}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{str(config_json)!r} must hold a JSON object")
        return config

    @classmethod
    def _from_config(cls, vocab: list[str], config: dict, max_length: int | None, source: Path):
        special = {}
        for key in _SPECIAL_KEYS:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        if max_length is None:
            max_length = config.get("model_max_length", 512)
            if not isinstance(max_length, int) or max_length > 1_000_000:   # transformers' "no limit" sentinel
                max_length = 512
        strip = config.get("strip_accents")
        try:
            return cls(vocab, max_length=max_length, do_lower_case=config.get("do_lower_case", True),
                       strip_accents=strip if isinstance(strip, bool) else None,
                       tokenize_chinese_chars=config.get("tokenize_chinese_chars", True), special_tokens=special)
        except ValueError as err:
            raise ValueError(f"WordPiece vocabulary {str(source)!r}: {err}") from None

    @classmethod
    def from_tokenizer_json(cls, path: str | Path, config_json: str | Path | None = None,
                            max_length: int | None = None) -> "WordPieceTokenizer":
        """From a ``tokenizers`` library ``tokenizer.json`` holding a WordPiece model (what transformers 5 saves
        for a ``BertTokenizer``); its ``BertNormalizer`` settings are the ones used."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            model = data["model"]
            if model.get("type") != "WordPiece":
                raise ValueError(f"its model is {model.get('type')!r}, not WordPiece")
            table = model["vocab"]
            vocab = [None] * len(table)
            for token, i in table.items():
                if not isinstance(i, int) or not 0 <= i < len(vocab) or vocab[i] is not None:
                    raise ValueError(f"token {token!r} has id {i!r}: ids must be 0..{len(vocab) - 1}, each once")
                vocab[i] = token
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError,
                ValueError) as err:
            raise ValueError(f"{str(path)!r} is not a usable WordPiece tokenizer.json: {err}") from None
        if model.get("continuing_subword_prefix", CONTINUATION) != CONTINUATION or \
                model.get("max_input_chars_per_word", MAX_INPUT_CHARS_PER_WORD) != MAX_INPUT_CHARS_PER_WORD:
            raise ValueError(f"{str(path)!r}: only BERT's WordPiece settings are supported (subword prefix "
                             f"{CONTINUATION!r}, {MAX_INPUT_CHARS_PER_WORD} characters a word)")
        config = cls._read_config(config_json)
        normalizer = data.get("normalizer") or {}
        if normalizer.get("type") == "BertNormalizer":
            config = {**config, "do_lower_case": normalizer.get("lowercase", True),
                      "strip_accents": normalizer.get("strip_accents"),
                      "tokenize_chinese_chars": normalizer.get("handle_chinese_chars", True)}
        if isinstance(model.get("unk_token"), str):
            config.setdefault("unk_token", model["unk_token"])
        return cls._from_config(vocab, config, max_length, path)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, max_length: int | None = None) -> "WordPieceTokenizer":
        """From a diffusers model folder (its ``tokenizer/``) or a tokenizer folder holding ``vocab.txt`` (or,
        as transformers 5 saves it, a WordPiece ``tokenizer.json``)."""
        path = Path(path)
        folder = path / "tokenizer" if (path / "tokenizer").is_dir() else path
        if not (folder / "vocab.txt").is_file() and (folder / "tokenizer.json").is_file():
            return cls.from_tokenizer_json(folder / "tokenizer.json", folder / "tokenizer_config.json",
                                           max_length=max_length)
        return cls.from_files(folder / "vocab.txt", folder / "tokenizer_config.json", max_length=max_length)

    # ------------------------------------------------------------------ encoding

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def normalize(self, text: str) -> str:
        """Steps 2-4: clean-up, CJK characters set apart, accents and case."""
        out = []
        for ch in text:
            if ch == "\x00" or ch == "\ufffd" or _is_control(ch):
                continue
            if _is_whitespace(ch):
                out.append(" ")
            elif self.tokenize_chinese_chars and is_cjk(ch):
                out.append(f" {ch} ")
            else:
                out.append(ch)
        text = "".join(out)
        strip = self.strip_accents if self.strip_accents is not None else self.do_lower_case
        if strip:
            text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
        if self.do_lower_case:
            text = "".join(map(str.lower, text))   # per character, as the reference (Rust) lower-cases
        return text

    def words(self, text: str) -> list[str]:
        """Step 5 on normalized text: words split at white space, each punctuation character on its own."""
        words: list[str] = []
        current: list[str] = []
        for ch in text:
            if _is_whitespace(ch) or _is_punctuation(ch):
                if current:
                    words.append("".join(current))
                    current = []
                if not _is_whitespace(ch):
                    words.append(ch)
            else:
                current.append(ch)
        if current:
            words.append("".join(current))
        return words

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without [CLS]/[SEP] and not truncated."""
        if not isinstance(text, str):
            raise TypeError(f"expected a string, got {type(text).__name__}")
        ids: list[int] = []
        for i, part in enumerate(self._special_split.split(text)):
            if i % 2:
                ids.append(self.encoder[part])
                continue
            for word in self.words(self.normalize(part)):
                ids.extend(self._word_ids(word))
        return ids

    def __call__(self, texts: str | Sequence[str]) -> torch.LongTensor:
        """One prompt or a list of prompts -> LongTensor (B, max_length): [CLS] ids [SEP] [PAD]..."""
        return framed_rows(texts, lambda t: self.frame(self.encode(t)), self.max_length)

    def frame(self, ids: list[int]) -> list[int]:
        """[CLS] + ids + [SEP], cut to ``max_length`` (the [SEP] kept last) and padded with [PAD]."""
        row = [self.cls_token_id, *ids[: self.max_length - 2], self.sep_token_id]
        return row + [self.pad_token_id] * (self.max_length - len(row))

    def tokenize_with_info(self, text: str) -> TokenizedPrompt:
        """One prompt framed, and what was cut: ``dropped_text`` holds the words (from the normalized text) the
        model does not see, a word cut inside its pieces included."""
        words = []
        for i, part in enumerate(self._special_split.split(text)):
            words += [part] if i % 2 else self.words(self.normalize(part))
        ids: list[int] = []
        capacity = self.max_length - 2
        first_dropped = None
        for w, word in enumerate(words):
            pieces = (self.encoder[word],) if word in self.encoder and self._special_split.fullmatch(word) \
                else self._word_ids(word)
            if first_dropped is None and len(ids) + len(pieces) > capacity:
                first_dropped = w
            ids.extend(pieces)
        dropped = " ".join(words[first_dropped:]) if first_dropped is not None else ""
        return TokenizedPrompt(input_ids=self.frame(ids), num_tokens=len(ids), num_kept=min(len(ids), capacity),
                               dropped_text=dropped)

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Text of ids (for debugging): ``##`` pieces joined to the piece before, other tokens spaced."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        specials = {self.encoder[t] for t in self.special_tokens.values()} - {self.unk_token_id}
        out: list[str] = []
        for i in ids:
            i = int(i)
            if i not in self.decoder:
                raise ValueError(f"id {i} is not in the vocabulary (size {self.vocab_size})")
            if skip_special_tokens and i in specials:
                continue
            token = self.decoder[i]
            if token.startswith(CONTINUATION) and out:
                out[-1] += token[len(CONTINUATION):]
            else:
                out.append(token)
        return " ".join(out)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, max_length={self.max_length}, "
                f"do_lower_case={self.do_lower_case})")

    # ------------------------------------------------------------------ internals

    def _word_ids(self, word: str) -> tuple[int, ...]:
        ids = self._cache.get(word)
        if ids is None:
            if len(self._cache) > 200_000:
                self._cache.clear()
            ids = self._cache[word] = tuple(self._wordpiece(word))
        return ids

    def _wordpiece(self, word: str) -> list[int]:
        """Greedy longest-match-first pieces of one word; [UNK] for the whole word when a piece is missing."""
        if len(word) > MAX_INPUT_CHARS_PER_WORD:
            return [self.unk_token_id]
        out = []
        start = 0
        while start < len(word):
            end = len(word)
            found = None
            while start < end:
                piece = word[start:end] if start == 0 else CONTINUATION + word[start:end]
                found = self.encoder.get(piece)
                if found is not None:
                    break
                end -= 1
            if found is None:
                return [self.unk_token_id]
            out.append(found)
            start = end
        return out
