"""CLIP text tokenizer: byte-level byte-pair encoding, as used by Stable Diffusion's text encoders.

The behaviour follows OpenAI CLIP's reference tokenizer:

1. clean-up: ``ftfy.fix_text``, ``html.unescape`` twice, strip, collapse every run of
   whitespace to one space, lower-case (Python's ``str.lower``);
2. split into pieces with CLIP's regular expression (case-insensitive, ``regex`` module);
3. encode each piece as UTF-8 bytes, map each byte to its printable stand-in character,
   mark the last symbol with ``</w>`` and apply the BPE merges in rank order;
4. wrap in ``<|startoftext|>`` ... ``<|endoftext|>``, truncate (the end token is kept as the
   last token) and pad to ``max_length`` (77).

The pad id depends on the model family: SD 1.x pads with the end token (49407), SD 2.x, whose
text encoder was trained with the OpenCLIP tokenizer, pads with 0 (the token ``!``).

Public API::

    tok = CLIPTokenizer.from_package()                    # shipped merge list, SD 1.x padding
    tok = CLIPTokenizer.from_package(pad_token_id=SD2_PAD_TOKEN_ID)
    tok = CLIPTokenizer.from_pretrained_dir(model_dir)     # diffusers folder (tokenizer/vocab.json, merges.txt)
    tok = CLIPTokenizer.from_files(vocab_json, merges_txt, pad_token_id=...)

    tok.encode("a cat")          -> [320, 2368]            (no start/end token, not truncated)
    tok(["a cat", "a dog"])      -> LongTensor (2, 77)
    tok.tokenize_with_info(text) -> TokenizedPrompt (ids, how many tokens were cut, the cut-off text)
    tok.decode(ids)              -> str (for debugging)
"""

from __future__ import annotations

import functools
import gc
import gzip
import heapq
import html
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import ftfy
import regex
import torch

from .files import read_text

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "MAX_LENGTH",
    "SD1_PAD_TOKEN_ID",
    "SD2_PAD_TOKEN_ID",
    "CLIPTokenizer",
    "TokenizedPrompt",
    "clean_text",
]

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
END_OF_WORD = "</w>"
MAX_LENGTH = 77
SD1_PAD_TOKEN_ID = 49407  # SD 1.x: pad with <|endoftext|>
SD2_PAD_TOKEN_ID = 0  # SD 2.x (OpenCLIP): pad with id 0 ("!")

# The shipped merge list: line 1 is a header, the next 49152 - 256 - 2 lines are the merges CLIP
# uses (vocabulary of 49408 = 2 * 256 byte tokens + 48894 merges + 2 special tokens).
_PACKAGE_MERGES_FILE = ("data", "clip", "bpe_simple_vocab_16e6.txt.gz")
_PACKAGE_NUM_MERGES = 48894

# CLIP's piece pattern. CLIP compiles it case-insensitively; that matters beyond ASCII (see
# "Known differences" in CLIPTokenizer's docstring).
_SPLIT_PATTERN = regex.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    regex.IGNORECASE,
)
_WHITESPACE = regex.compile(r"\s+")

# The word cache is cleared when it grows past this many entries (a long-running server sees
# an unbounded number of distinct words).
_CACHE_LIMIT = 200_000


def _without_gc(build):
    """Run ``build`` with the cyclic garbage collector paused.

    A vocabulary is about 100,000 new strings, tuples and dicts, none in a reference cycle, so the collector
    finds nothing in them; yet allocating them triggers its full collections, each of which walks every object
    of the process (torch's included): 0.3 s of the 0.4 s a tokenizer took to build after ``import torch``.
    """

    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return build(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper


def _byte_stand_ins() -> tuple[str, ...]:
    """Printable character standing for each byte value 0..255 (index = byte value).

    Bytes that are visible Latin-1 characters stand for themselves; the other 68 (controls,
    space, DEL, NBSP, soft hyphen ...) are given the characters U+0100, U+0101, ... in byte
    order, so that every BPE symbol is a string of visible characters.
    """
    table = []
    shifted = 0
    for b in range(256):
        if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF:
            table.append(chr(b))
        else:
            table.append(chr(0x100 + shifted))
            shifted += 1
    return tuple(table)


_BYTE_TO_CHAR = _byte_stand_ins()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
# CLIP's vocabulary lists the byte tokens in code point order of their stand-in characters.
_BASE_TOKENS = tuple(sorted(_BYTE_TO_CHAR))


def clean_text(text: str) -> str:
    """CLIP's text clean-up: ftfy, HTML-unescape twice, strip, collapse whitespace, lower-case."""
    text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text))
    text = text.strip()
    text = _WHITESPACE.sub(" ", text).strip()
    return text.lower()


def framed_rows(texts: str | Sequence[str], frame_text, max_length: int) -> torch.LongTensor:
    """One prompt or a list of prompts -> LongTensor (B, max_length), ``frame_text(text)`` giving each row (start
    and end tokens, truncation and padding as the tokenizer's reference does). Shared by every tokenizer's
    ``__call__``."""
    if isinstance(texts, str):
        texts = [texts]
    elif not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
        raise TypeError("expected a string or a list of strings")
    rows = [frame_text(t) for t in texts]
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), max_length)


@dataclass(frozen=True)
class TokenizedPrompt:
    """Result of :meth:`CLIPTokenizer.tokenize_with_info`.

    ``input_ids`` has exactly ``max_length`` ids: start token, the kept tokens, end token, padding.
    When the prompt is longer than ``max_length - 2`` tokens, the cut happens after content token
    number ``num_kept`` (the start token not counted); ``dropped_text`` is the part of the
    cleaned-up (lower-cased, whitespace-collapsed) prompt that the model does not see. When the
    cut falls inside a word, ``dropped_text`` begins with the rest of that word (a character whose
    UTF-8 bytes were split by the cut counts as dropped).
    """

    input_ids: list[int]
    num_tokens: int  # content tokens before truncation (no start/end token)
    num_kept: int  # content tokens kept
    dropped_text: str  # "" when nothing was cut

    @property
    def num_dropped(self) -> int:
        return self.num_tokens - self.num_kept

    @property
    def truncated(self) -> bool:
        return self.num_tokens > self.num_kept


class CLIPTokenizer:
    """CLIP byte-level BPE tokenizer.

    Args:
        encoder: token string -> id. Must hold the 512 byte-level tokens (each byte stand-in with and
            without ``</w>``), the result of every merge, ``<|startoftext|>`` and ``<|endoftext|>``.
        merges: BPE merges, highest priority first, as ``(left, right)`` symbol pairs.
        pad_token_id: id written after the end token; 49407 for SD 1.x, 0 for SD 2.x.
        max_length: length of every tokenized row (77 for CLIP text encoders).

    Known differences from HF ``transformers.CLIPTokenizer`` (tokenizers backend), where this class
    follows OpenAI CLIP / OpenCLIP instead (each has a test in tests/test_tokenizer.py):

    * transformers skips CLIP's ftfy / HTML-unescape clean-up;
    * transformers applies NFC after the clean-up; CLIP does not (ftfy already returns NFC text, but
      an entity unescaped afterwards, e.g. ``&amp;#769;`` or ``&#769;`` in a text holding a ``<``,
      which ftfy leaves alone, can leave a decomposed sequence that CLIP keeps as is);
    * transformers lower-cases character by character, so a word-final capital sigma becomes ``σ``;
      Python's ``str.lower`` (CLIP) writes ``ς``;
    * CLIP's split pattern is case-insensitive: ``'s`` also matches ``'ſ`` (long s, also what ftfy
      makes of the ligature ``ﬅ``), and U+0345 COMBINING GREEK YPOGEGRAMMENI, which case-folds to a
      letter, is matched by no alternative and dropped; transformers matches case-sensitively;
    * a special token written in a prompt: CLIP lower-cases before matching, so ``<|ENDOFTEXT|>`` is
      the end token, and does not see one glued to punctuation (``!<|endoftext|>`` is the
      punctuation run ``!<|`` and more); transformers matches special tokens in the raw text;
    * with ``pad_token="!"`` (SD 2.x folders) transformers treats every ``!`` in a prompt as that
      special token, so ``?!`` becomes ``?`` + ``!``; here the pad id only fills the row;
    * characters that are new in recent Unicode versions are classed by the ``regex`` module's and
      Python's Unicode tables here (as in CLIP), by Rust's tables in transformers.
    """

    kind = "clip_bpe"

    def __init__(
        self,
        encoder: Mapping[str, int],
        merges: Sequence[tuple[str, str]],
        pad_token_id: int = SD1_PAD_TOKEN_ID,
        max_length: int = MAX_LENGTH,
    ):
        if not isinstance(encoder, Mapping) or not (
            # exact types first (a JSON vocabulary): a set of types is much cheaper than 49408 isinstance calls
            set(map(type, encoder.keys())) <= {str} and set(map(type, encoder.values())) <= {int}
            or all(isinstance(t, str) and isinstance(i, int) and not isinstance(i, bool) for t, i in encoder.items())
        ):
            raise ValueError("encoder must map token strings to integer ids")
        self.encoder: dict[str, int] = dict(encoder)
        self.decoder: dict[int, str] = {i: t for t, i in self.encoder.items()}
        if len(self.decoder) != len(self.encoder):
            raise ValueError("encoder gives the same id to two tokens")
        for special in (BOS_TOKEN, EOS_TOKEN):
            if special not in self.encoder:
                raise ValueError(f"vocabulary lacks the special token {special!r}")
        missing = [t for t in _BASE_TOKENS if t not in self.encoder or t + END_OF_WORD not in self.encoder]
        if missing:
            raise ValueError(f"vocabulary lacks {len(missing)} of the 256 byte-level tokens, e.g. {missing[0]!r}")

        self.merges: list[tuple[str, str]] = []
        self.bpe_ranks: dict[tuple[str, str], int] = {}
        if not self._fast_merges(merges):
            self._checked_merges(merges)  # the slow path names the first bad merge

        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
        if pad_token_id not in self.decoder:
            raise ValueError(f"pad_token_id {pad_token_id!r} is not an id in the vocabulary")
        self.bos_token_id = self.encoder[BOS_TOKEN]
        self.eos_token_id = self.encoder[EOS_TOKEN]
        self.pad_token_id = pad_token_id
        self.max_length = max_length
        self._cache: dict[str, tuple[int, ...]] = {}
        self._reset_cache()

    def _fast_merges(self, merges: Sequence[tuple[str, str]]) -> bool:
        """Take ``merges`` in bulk when they are valid (the usual case: several times faster than checking them
        one by one). False, with nothing taken, when any check fails: :meth:`_checked_merges` then finds which."""
        if not isinstance(merges, (list, tuple)) or not merges:
            return False
        types = set(map(type, merges))
        if not types <= {tuple, list} or set(map(len, merges)) != {2}:
            return False
        pairs = list(merges) if types == {tuple} else [tuple(p) for p in merges]
        lefts, rights = zip(*pairs)
        if not (set(map(type, lefts)) | set(map(type, rights)) <= {str} and all(lefts) and all(rights)):
            return False
        ranks = dict(zip(pairs, range(len(pairs))))
        if len(ranks) != len(pairs) or not all(map(self.encoder.__contains__, map(str.__add__, lefts, rights))):
            return False
        self.merges, self.bpe_ranks = pairs, ranks
        return True

    def _checked_merges(self, merges: Sequence[tuple[str, str]]) -> None:
        for rank, pair in enumerate(merges):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(s, str) and s for s in pair)):
                raise ValueError(f"merge {rank} is not a pair of symbols: {pair!r}")
            pair = (pair[0], pair[1])
            if pair in self.bpe_ranks:
                raise ValueError(f"merge {rank} {pair!r} repeats merge {self.bpe_ranks[pair]}")
            if pair[0] + pair[1] not in self.encoder:
                raise ValueError(f"merge {rank} {pair!r} makes {pair[0] + pair[1]!r}, which is not in the vocabulary")
            self.bpe_ranks[pair] = rank
            self.merges.append(pair)

    # ------------------------------------------------------------------ construction

    @classmethod
    @_without_gc
    def from_package(cls, pad_token_id: int = SD1_PAD_TOKEN_ID, max_length: int = MAX_LENGTH) -> CLIPTokenizer:
        """The tokenizer built from the merge list shipped inside the package (no files needed)."""
        encoder, merges = _package_vocabulary()
        return cls(encoder, merges, pad_token_id=pad_token_id, max_length=max_length)

    @classmethod
    @_without_gc
    def from_files(
        cls,
        vocab_json: str | Path,
        merges_txt: str | Path,
        pad_token_id: int = SD1_PAD_TOKEN_ID,
        max_length: int = MAX_LENGTH,
    ) -> CLIPTokenizer:
        """Build from a Hugging Face style ``vocab.json`` (token -> id) and ``merges.txt``."""
        encoder = _read_vocab_json(Path(vocab_json))
        merges = _read_merges_txt(Path(merges_txt))
        try:
            return cls(encoder, merges, pad_token_id=pad_token_id, max_length=max_length)
        except ValueError as err:
            raise ValueError(f"CLIP tokenizer files {str(vocab_json)!r} and {str(merges_txt)!r}: {err}") from None

    @classmethod
    @_without_gc
    def from_tokenizer_json(
        cls, path: str | Path, pad_token_id: int = SD1_PAD_TOKEN_ID, max_length: int = MAX_LENGTH
    ) -> CLIPTokenizer:
        """Build from a ``tokenizers`` library ``tokenizer.json`` holding a BPE model (vocab and merges)."""
        path = Path(path)
        text = read_text(path, "CLIP tokenizer BPE file")
        try:
            model = json.loads(text)["model"]
            encoder, raw_merges = model["vocab"], model["merges"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{str(path)!r} is not a tokenizers BPE file: {err}") from None
        merges = []
        for i, m in enumerate(raw_merges):
            pair = m.split(" ") if isinstance(m, str) else m
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError(f"{str(path)!r}: merge {i} is not a pair of symbols: {m!r}")
            merges.append((pair[0], pair[1]))
        try:
            return cls(encoder, merges, pad_token_id=pad_token_id, max_length=max_length)
        except ValueError as err:
            raise ValueError(f"CLIP tokenizer file {str(path)!r}: {err}") from None

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, max_length: int = MAX_LENGTH) -> CLIPTokenizer:
        """Build from a diffusers model folder (its ``tokenizer/`` subfolder) or a tokenizer folder.

        The pad token is read from ``special_tokens_map.json``, else ``tokenizer_config.json``
        (SD 2.x folders name ``"!"``, id 0); without either it is the end token (SD 1.x).
        """
        path = Path(path)
        folder = path / "tokenizer" if (path / "tokenizer").is_dir() else path
        vocab_json, merges_txt = folder / "vocab.json", folder / "merges.txt"
        if not vocab_json.is_file() and (folder / "tokenizer.json").is_file():
            # transformers 5 saves only the ``tokenizers`` file, which holds the same vocabulary and merges
            vocab_json = folder / "tokenizer.json"
            tok = cls.from_tokenizer_json(vocab_json, max_length=max_length)
        else:
            tok = cls.from_files(vocab_json, merges_txt, max_length=max_length)
        pad = _read_pad_token(folder)
        if pad is not None:
            name, source = pad
            if name not in tok.encoder:
                raise ValueError(f"{source}: pad token {name!r} is not in {str(vocab_json)!r}")
            tok.pad_token_id = tok.encoder[name]
        return tok

    # ------------------------------------------------------------------ encoding

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` after CLIP's clean-up, without start/end token and untruncated."""
        ids: list[int] = []
        for piece in _SPLIT_PATTERN.findall(clean_text(text)):
            ids.extend(self._word_ids(piece))
        return ids

    def __call__(self, texts: str | Sequence[str]) -> torch.LongTensor:
        """Tokenize one prompt or a list of prompts into a LongTensor of shape (B, max_length)."""
        return framed_rows(texts, lambda t: self._frame(self.encode(t)), self.max_length)

    def tokenize_with_info(self, text: str) -> TokenizedPrompt:
        """Tokenize one prompt and report truncation (for a user warning); see :class:`TokenizedPrompt`."""
        cleaned = clean_text(text)
        pieces = list(_SPLIT_PATTERN.finditer(cleaned))
        ids: list[int] = []
        ends: list[int] = []  # number of content tokens after each piece
        for m in pieces:
            ids.extend(self._word_ids(m.group()))
            ends.append(len(ids))
        capacity = self.max_length - 2
        num_kept = min(len(ids), capacity)
        dropped = ""
        if len(ids) > capacity:
            # The piece holding the first dropped token, and how many of its tokens were kept.
            k = next(i for i, end in enumerate(ends) if end > capacity)
            first_of_piece = ends[k - 1] if k else 0
            kept_in_piece = capacity - first_of_piece
            piece = pieces[k]
            kept_bytes = sum(self._token_byte_length(t) for t in ids[first_of_piece : first_of_piece + kept_in_piece])
            chars = 0
            consumed = 0
            for ch in piece.group():
                width = len(ch.encode("utf-8"))
                if consumed + width > kept_bytes:
                    break
                consumed += width
                chars += 1
            dropped = cleaned[piece.start() + chars :]
        return TokenizedPrompt(
            input_ids=self._frame(ids), num_tokens=len(ids), num_kept=num_kept, dropped_text=dropped
        )

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Text of a sequence of ids (for debugging). Word ends become spaces.

        With ``skip_special_tokens`` the start/end tokens are left out, and so is everything after the
        last end token (the padding, whatever the pad id).
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            if self.eos_token_id in ids:
                ids = ids[: len(ids) - ids[::-1].index(self.eos_token_id)]
            ids = [i for i in ids if i not in (self.bos_token_id, self.eos_token_id)]
        out = bytearray()
        for i in ids:
            token = self.decoder.get(i)
            if token is None:
                raise ValueError(f"id {i} is not in the vocabulary (size {self.vocab_size})")
            if token in (BOS_TOKEN, EOS_TOKEN):
                out += token.encode("utf-8")
                continue
            word_end = token.endswith(END_OF_WORD)
            if word_end:
                token = token[: -len(END_OF_WORD)]
            out += bytes(_CHAR_TO_BYTE[c] for c in token)
            if word_end:
                out += b" "
        return out.decode("utf-8", errors="replace").strip()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"pad_token_id={self.pad_token_id}, max_length={self.max_length})"
        )

    # ------------------------------------------------------------------ internals

    def _frame(self, ids: list[int]) -> list[int]:
        """Start token + ids + end token, truncated (end token kept last) and padded to max_length."""
        row = [self.bos_token_id, *ids[: self.max_length - 2], self.eos_token_id]
        return row + [self.pad_token_id] * (self.max_length - len(row))

    def _token_byte_length(self, token_id: int) -> int:
        token = self.decoder[token_id]
        if token in (BOS_TOKEN, EOS_TOKEN):
            return len(token)
        return len(token) - (len(END_OF_WORD) if token.endswith(END_OF_WORD) else 0)

    def _reset_cache(self) -> None:
        self._cache.clear()
        # A special token written in the prompt maps to its id, as in CLIP.
        self._cache[BOS_TOKEN] = (self.bos_token_id,)
        self._cache[EOS_TOKEN] = (self.eos_token_id,)

    def _word_ids(self, piece: str) -> tuple[int, ...]:
        ids = self._cache.get(piece)
        if ids is None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._reset_cache()
            ids = tuple(self.encoder[s] for s in self._bpe(piece))
            self._cache[piece] = ids
        return ids

    def _bpe(self, piece: str) -> list[str]:
        """BPE symbols of one piece.

        Same result as CLIP's loop (repeatedly take the best-ranked adjacent pair and merge all its
        non-overlapping occurrences left to right), in O(n log n): symbols form a linked list and a
        heap holds (rank, position) of candidate pairs; stale entries are skipped when popped.
        """
        symbols: list[str | None] = [_BYTE_TO_CHAR[b] for b in piece.encode("utf-8")]
        symbols[-1] += END_OF_WORD
        n = len(symbols)
        if n == 1:
            return symbols
        ranks = self.bpe_ranks
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None:
                heap.append((r, i))
        heapq.heapify(heap)
        while heap:
            rank = heap[0][0]
            left, right = self.merges[rank]
            merged = left + right
            touched = []
            # All entries of this rank, popped in position order: merge left to right, skipping
            # occurrences that overlap one already merged (their node is gone or has changed).
            while heap and heap[0][0] == rank:
                i = heapq.heappop(heap)[1]
                j = nxt[i]
                if j == -1 or symbols[i] != left or symbols[j] != right:
                    continue
                symbols[i] = merged
                symbols[j] = None
                k = nxt[j]
                nxt[i] = k
                if k != -1:
                    prv[k] = i
                touched.append(i)
            # New neighbour pairs enter the heap only after the whole rank is done, as in CLIP.
            for i in touched:
                p = prv[i]
                if p != -1:
                    r = ranks.get((symbols[p], symbols[i]))
                    if r is not None:
                        heapq.heappush(heap, (r, p))
                k = nxt[i]
                if k != -1:
                    r = ranks.get((symbols[i], symbols[k]))
                    if r is not None:
                        heapq.heappush(heap, (r, i))
        out = []
        i = 0
        while i != -1:
            out.append(symbols[i])
            i = nxt[i]
        return out


# ---------------------------------------------------------------------- file reading


@lru_cache(maxsize=1)
def _package_vocabulary() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    ref = resources.files("sdlite").joinpath(*_PACKAGE_MERGES_FILE)
    name = "/".join(("sdlite",) + _PACKAGE_MERGES_FILE)
    try:
        text = gzip.decompress(ref.read_bytes()).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise RuntimeError(f"cannot read the packaged CLIP merge list {name}: {err}") from err
    lines = text.split("\n")[1 : 1 + _PACKAGE_NUM_MERGES]
    pairs = [line.split() for line in lines]
    merges = [(p[0], p[1]) for p in pairs] if all(len(p) == 2 for p in pairs) else []  # in bulk: the usual case
    for number, line in enumerate(lines if not merges else (), start=2):
        parts = line.split()
        if len(parts) != 2:
            raise RuntimeError(f"packaged CLIP merge list {name}, line {number}: expected two symbols, got {line!r}")
        merges.append((parts[0], parts[1]))
    if len(merges) != _PACKAGE_NUM_MERGES:
        raise RuntimeError(f"packaged CLIP merge list {name} holds {len(merges)} merges, expected {_PACKAGE_NUM_MERGES}")
    tokens = list(_BASE_TOKENS) + [t + END_OF_WORD for t in _BASE_TOKENS] + [a + b for a, b in merges]
    tokens += [BOS_TOKEN, EOS_TOKEN]
    return {t: i for i, t in enumerate(tokens)}, tuple(merges)


def _read_vocab_json(path: Path) -> dict[str, int]:
    text = read_text(path, "CLIP tokenizer vocabulary file")
    try:
        vocab = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"CLIP tokenizer vocabulary file {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"CLIP tokenizer vocabulary file {str(path)!r} must hold a non-empty JSON object")
    if set(map(type, vocab.values())) <= {int} and min(vocab.values()) >= 0:
        return vocab  # the usual case, checked in bulk
    for token, index in vocab.items():
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"CLIP tokenizer vocabulary file {str(path)!r}: token {token!r} has id {index!r}")
    return vocab


def _read_merges_txt(path: Path) -> list[tuple[str, str]]:
    text = read_text(path, "CLIP tokenizer merges file")
    # the usual file in bulk (about 4x faster than line by line); anything odd goes through the loop below,
    # which names the bad line
    lines = text.split("\n")
    if "\r" in text:
        lines = [line.rstrip("\r") for line in lines]
    if lines[0].startswith("#version"):
        lines[0] = ""
    pairs = [line.split(" ") for line in lines if line]
    if pairs and all(len(p) == 2 and p[0] and p[1] for p in pairs):
        return [(a, b) for a, b in pairs]
    merges = []
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"CLIP tokenizer merges file {str(path)!r}, line {number}: expected two symbols, got {line!r}")
        merges.append((parts[0], parts[1]))
    if not merges:
        raise ValueError(f"CLIP tokenizer merges file {str(path)!r} holds no merges")
    return merges


def _read_pad_token(folder: Path) -> tuple[str, str] | None:
    """(pad token string, file it came from), or None when no file names one."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read {str(path)!r}: {err}") from None
        pad = data.get("pad_token") if isinstance(data, dict) else None
        if isinstance(pad, dict):
            pad = pad.get("content")
        if isinstance(pad, str):
            return pad, str(path)
        if pad is not None:
            raise ValueError(f"{str(path)!r}: pad_token must be a string or an object with 'content', got {pad!r}")
    return None
