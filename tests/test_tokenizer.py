"""Tests for sdlite.tokenizers.clip_bpe against independent references.

References used here, none of which calls sdlite's code:

* ``transformers.CLIPTokenizer`` (the ``tokenizers``-backed one in transformers 5), built from a
  ``vocab.json`` / ``merges.txt`` that this file derives from the shipped merge list. It does NFC,
  ``\\s+`` -> " ", lower-case, CLIP's split pattern and byte-level BPE, but not CLIP's ftfy / HTML
  clean-up; ``reference_clean`` below supplies that from ftfy and ``html`` directly.
* ``clip_reference_ids``: OpenAI CLIP's pipeline restated from its published pieces (clean-up,
  CLIP's split pattern compiled case-insensitively with the ``regex`` module) with the BPE step done
  by the ``tokenizers`` BPE model. Used only where transformers is known to differ from CLIP.
"""

from __future__ import annotations

import gzip
import html
import json
import random
import time
import unicodedata
from importlib import resources

import ftfy
import pytest
import regex
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import pre_tokenizers  # noqa: E402  (installed with transformers)

from sdlite.tokenizers.clip_bpe import (  # noqa: E402
    SD1_PAD_TOKEN_ID,
    SD2_PAD_TOKEN_ID,
    CLIPTokenizer,
    TokenizedPrompt,
)

BOS, EOS = 49406, 49407
CLIP_PATTERN = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
NUM_PROMPTS = 1200


# ---------------------------------------------------------------------------- references


def derive_vocab_and_merges() -> tuple[list[str], list[str]]:
    """Tokens (index = id) and merge lines, from the shipped merge list and the README's rules."""
    data = resources.files("sdlite").joinpath("data", "clip", "bpe_simple_vocab_16e6.txt.gz").read_bytes()
    lines = gzip.decompress(data).decode("utf-8").split("\n")
    merge_lines = lines[1:48895]
    # The 256 byte-level characters in CLIP's order, which is code point order.
    base = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(base) == 256
    tokens = base + [b + "</w>" for b in base] + [m.replace(" ", "") for m in merge_lines]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return tokens, merge_lines


def write_hf_files(folder, tokens, merge_lines) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(
        json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False), encoding="utf-8"
    )
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merge_lines) + "\n", encoding="utf-8")


def reference_clean(text: str) -> str:
    """CLIP's clean-up steps that transformers' tokenizer skips."""
    return html.unescape(html.unescape(ftfy.fix_text(text))).strip()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    tokens, merge_lines = derive_vocab_and_merges()
    folder = tmp_path_factory.mktemp("clip_hf") / "tokenizer"
    write_hf_files(folder, tokens, merge_lines)
    return folder


@pytest.fixture(scope="module")
def hf(hf_dir):
    return transformers.CLIPTokenizer.from_pretrained(str(hf_dir))


@pytest.fixture(scope="module")
def hf_sd2(hf_dir):
    return transformers.CLIPTokenizer.from_pretrained(str(hf_dir), pad_token="!")


@pytest.fixture(scope="module")
def tok():
    return CLIPTokenizer.from_package()


def hf_ids(hf, text: str) -> list[int]:
    return hf(text, add_special_tokens=False)["input_ids"]


def clip_reference_ids(hf, text: str) -> list[int]:
    text = regex.sub(r"\s+", " ", reference_clean(text)).strip().lower()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model = hf.backend_tokenizer.model
    ids = []
    for piece in regex.findall(CLIP_PATTERN, text, regex.IGNORECASE):
        if piece in ("<|startoftext|>", "<|endoftext|>"):
            ids.append(BOS if piece == "<|startoftext|>" else EOS)
            continue
        ((chars, _),) = byte_level.pre_tokenize_str(piece)
        ids.extend(t.id for t in model.tokenize(chars))
    return ids


# ---------------------------------------------------------------------------- prompt generator

LATIN = "abcdefghijklmnopqrstuvwxyz"
ACCENTED = "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßœłđšžčřőű"
# Combining marks (U+0345 is left out on purpose: see test_divergence_ypogegrammeni).
COMBINING = ["\u0300", "\u0301", "\u0302", "\u0303", "\u0308", "\u030a", "\u030c", "\u0327", "\u0323"]
# Greek without sigma: word-final capital sigma lower-cases differently (test_divergence_final_sigma).
GREEK = "αβγδεζηθικλμνξοπρτυφχψωάέήίόύώ"
CYRILLIC = "абвгдеёжзийклмнопрстуфхцчшщъыьэюяіїєґ"
ARABIC = "ابتثجحخدذرزسشصضطظعغفقكلمنهوي"
HEBREW = "אבגדהוזחטיכלמנסעפצקרשת"
DEVANAGARI = ["न", "म", "स्", "ते", "क", "हि", "न्दी", "ग", "र"]
CJK = "猫犬山川花火水月日本語中文字東京美少女風景"
KANA = "ねこいぬさくらカタカナひらがなアニメ"
HANGUL = "고양이강아지한국어풍경하늘"
THAI = "แมวสุนัขภาษาไทย"
SCRIPTS = [LATIN, ACCENTED, GREEK, CYRILLIC, ARABIC, HEBREW, DEVANAGARI, CJK, KANA, HANGUL, THAI]

EMOJI = [
    "😀", "🐱", "🌅", "🔥", "✨", "❤️", "👍🏽", "👋🏻", "🧑🏿", "👨‍👩‍👧‍👦", "👩🏽‍💻", "🏳️‍🌈",
    "🧑‍🚀", "🇯🇵", "🇫🇷", "1️⃣", "☕", "🫠", "🦄", "👁‍🗨",
]
PUNCT = [
    "!", "!!!", "?!", "...", "…", ",", ";", ":", "--", "—", "-", "_", "/", "\\", "|", "@", "#", "$", "%",
    "^", "*", "~", "`", "+", "=", "(((", ")))", "[[", "]]", "{", "}", "<", ">", "\"", "'", "«»", "¿¡", "§",
    "©", "®", "™", "°", "·", "•", "→", "★", "♪",
]
NUMBERS = [
    "1", "42", "1,000", "3.14", "2024-01-01", "1e10", "8k", "4K", "16:9", "50%", "1/2", "v2.1", "٣٤",
    "½", "²", "Ⅻ", "१२", "10,000.50", "0x1F", "+7", "-3",
]
CONTRACTIONS = [
    "it's", "don't", "you're", "we've", "I'm", "they'll", "he'd", "IT'S", "Won't", "cat's", "'re", "'ll",
]
ENTITIES = ["&amp;", "&lt;", "&gt;", "&#39;", "&quot;", "&nbsp;", "&#233;", "&#x1F600;", "&copy;", "&amp;amp;",
            "&#8217;", "&eacute;", "&hellip;"]
MOJIBAKE = ["cafÃ©", "Ã¼ber", "doesnâ€™t", "naÃ¯ve", "â€œquotedâ€\x9d"]
WHITESPACE = [" ", " ", " ", "  ", "\t", "\n", " \t\n ", "\u00a0", "\u2003", "\u202f"]
# Whitespace that ftfy rewrites (CR LF -> LF, ideographic space -> space): used in some prompts only.
FTFY_WHITESPACE = ["\r\n", "\u3000", "\r"]
SD_PROMPTS = [
    "(masterpiece:1.2), best quality, [blurry], ((detailed eyes)), 8k uhd",
    "a portrait of a woman, by greg rutkowski and alphonse mucha, trending on artstation",
    "(((ultra-detailed))), {sharp focus}, <lora:detail_tweaker:0.8>, RAW photo, DSLR",
    "photo of an astronaut riding a horse on mars, cinematic lighting, 35mm, f/1.8",
    "low quality, worst quality:1.4, (bad anatomy), extra fingers, jpeg artifacts, watermark",
    "A Cozy Cabin in the Woods, Snow, Warm Light, Studio Ghibli Style, 4K HDR",
    "cyberpunk city at night, neon signs, rain, reflections, [[[people]]], octane render",
    "isometric voxel art of a tiny island | pastel colours | (tilt-shift:0.7)",
]


def random_word(rng: random.Random) -> str:
    alphabet = rng.choice(SCRIPTS)
    n = rng.randint(1, 9)
    if isinstance(alphabet, list):
        return "".join(rng.choice(alphabet) for _ in range(max(1, n // 3)))
    word = "".join(rng.choice(alphabet) for _ in range(n))
    if alphabet in (LATIN, ACCENTED, GREEK) and rng.random() < 0.25:
        i = rng.randrange(len(word) + 1)
        word = word[:i] + rng.choice(COMBINING) + word[i:]
    return word


def mixed_case(rng: random.Random, text: str) -> str:
    mode = rng.random()
    if mode < 0.5:
        return text
    out = []
    for c in text:
        up = c.upper()
        flip = mode > 0.9 or rng.random() < 0.3
        out.append(up if flip and len(up) == 1 and up != "\u03a3" else c)
    return "".join(out)


def random_token(rng: random.Random, dirty: bool) -> str:
    kind = rng.random()
    if dirty and kind < 0.15:
        return rng.choice(ENTITIES + MOJIBAKE)
    if kind < 0.55:
        return random_word(rng)
    if kind < 0.65:
        return rng.choice(EMOJI)
    if kind < 0.77:
        return rng.choice(PUNCT)
    if kind < 0.87:
        return rng.choice(NUMBERS)
    if kind < 0.95:
        return rng.choice(CONTRACTIONS)
    return rng.choice(LATIN) * rng.randint(2, 5)


def random_prompt(rng: random.Random) -> str:
    style = rng.random()
    dirty = rng.random() < 0.2
    spaces = WHITESPACE + FTFY_WHITESPACE if rng.random() < 0.15 else WHITESPACE
    if style < 0.2:
        base = rng.choice(SD_PROMPTS)
        extra = " ".join(random_token(rng, dirty) for _ in range(rng.randint(0, 4)))
        text = f"{base}, {extra}" if extra else base
    else:
        n = rng.randint(60, 160) if style > 0.92 else rng.randint(1, 25)  # some far over 77 tokens
        parts = []
        for _ in range(n):
            parts.append(random_token(rng, dirty))
            parts.append(rng.choice(spaces) if rng.random() < 0.85 else "")
        text = "".join(parts)
    if rng.random() < 0.1:
        text = rng.choice(spaces) + text + rng.choice(spaces)
    return mixed_case(rng, text)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    rng = random.Random(20240607)
    out = ["", "   ", "\t\n", "a cat on a beach", "A CAT ON A BEACH", "&amp;", "it's", "🏳️‍🌈"]
    while len(out) < NUM_PROMPTS:
        p = random_prompt(rng)
        if "<|" not in p and "|>" not in p:
            out.append(p)
    return out


def test_generator_covers_what_it_should(prompts):
    joined = "".join(prompts)
    assert len(prompts) >= 1000
    for needle in ["&amp;", "&nbsp;", "&#", "Ã", "\u200d", "\U0001f3fd", "\t", "\n", "'s", "(masterpiece:1.2)", "[blurry]"]:
        assert needle in joined, needle
    assert any(unicodedata.combining(c) for c in joined)
    assert any(p != p.lower() and p != p.upper() for p in prompts)  # mixed case
    for script_char in ["α", "ж", "猫", "ね", "고", "ا", "א", "ไ"]:
        assert script_char in joined.lower(), script_char


# ---------------------------------------------------------------------------- vocabulary


def test_derived_vocab_reproduces_readme_example(hf):
    assert len(hf) == 49408
    assert hf("a cat on a beach")["input_ids"] == [49406, 320, 2368, 525, 320, 2117, 49407]


def test_package_vocabulary_matches_derived_vocab(tok):
    tokens, merge_lines = derive_vocab_and_merges()
    assert tok.encoder == {t: i for i, t in enumerate(tokens)}
    assert [" ".join(m) for m in tok.merges] == merge_lines
    assert tok.vocab_size == 49408
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOS, SD1_PAD_TOKEN_ID)


def test_readme_example(tok):
    assert tok.encode("a cat on a beach") == [320, 2368, 525, 320, 2117]
    row = tok("a cat on a beach")
    assert row.dtype == torch.long and row.shape == (1, 77)
    assert row[0, :7].tolist() == [49406, 320, 2368, 525, 320, 2117, 49407]
    assert row[0, 7:].tolist() == [49407] * 70


# ---------------------------------------------------------------------------- agreement with transformers


def test_ids_match_transformers_after_reference_clean(tok, hf, prompts):
    cleaned = [reference_clean(p) for p in prompts]
    expected = hf(cleaned, add_special_tokens=False)["input_ids"]
    mismatches = [(p, ours, ref) for p, ours, ref in zip(prompts, map(tok.encode, prompts), expected) if ours != ref]
    assert not mismatches, mismatches[:3]


def test_ids_match_transformers_directly_where_cleanup_is_a_no_op(tok, hf, prompts):
    # Prompts with no entity / mojibake / ftfy fix: the clean-up changes nothing but surrounding
    # whitespace (which the split ignores), so transformers on the raw text is the reference.
    direct = [p for p in prompts if html.unescape(html.unescape(ftfy.fix_text(p))) == p]
    assert len(direct) >= 700
    expected = hf(direct, add_special_tokens=False)["input_ids"]
    mismatches = [(p, ours, ref) for p, ours, ref in zip(direct, map(tok.encode, direct), expected) if ours != ref]
    assert not mismatches, mismatches[:3]
    assert len(direct) < len(prompts)  # the clean-up does matter for the rest


def test_batches_match_transformers_padding_and_truncation(tok, hf, prompts):
    cleaned = [reference_clean(p) for p in prompts]
    kwargs = dict(padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    assert any(len(tok.encode(p)) > 75 for p in prompts)
    expected = hf(cleaned, **kwargs)["input_ids"]
    assert torch.equal(tok(prompts), expected)
    # SD 2.x: the same rows with 0 after the (first) end token. transformers itself cannot be the
    # reference here, see test_divergence_sd2_pad_token_splits_exclamation_marks.
    after_end = torch.arange(77) > (expected == EOS).int().argmax(dim=1, keepdim=True)
    sd2 = CLIPTokenizer.from_package(pad_token_id=SD2_PAD_TOKEN_ID)
    assert torch.equal(sd2(prompts), expected.masked_fill(after_end, 0))


def test_long_words_match_transformers_and_are_fast(tok, hf):
    rng = random.Random(7)
    for alphabet in (LATIN, ACCENTED, CJK, CYRILLIC):
        word = "".join(rng.choice(alphabet) for _ in range(3000))
        start = time.perf_counter()
        ours = tok.encode(word)
        assert time.perf_counter() - start < 2.0
        assert ours == hf_ids(hf, reference_clean(word))  # ftfy takes some accent runs for mojibake
    # Overlapping occurrences of a merge pair ("aa" merges left to right).
    for n in range(1, 12):
        assert tok.encode("a" * n) == hf_ids(hf, "a" * n)


def test_encoding_1000_prompts_is_fast(prompts):
    fresh = CLIPTokenizer.from_package()  # empty word cache
    start = time.perf_counter()
    fresh(prompts[:1000])
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"{elapsed:.2f} s for 1000 prompts"


# ---------------------------------------------------------------------------- divergences from transformers
# Where transformers' tokenizer differs from OpenAI CLIP, sdlite follows CLIP. The reference is
# clip_reference_ids (CLIP's clean-up and case-insensitive split, BPE from `tokenizers`), and
# each test also shows that transformers really differs, so a change on either side is noticed.


def test_divergence_final_sigma(tok, hf):
    # Python's str.lower (CLIP) writes a word-final capital sigma as ς; transformers' Lowercase
    # normalizer maps characters one by one, giving σ.
    text = "ΟΔΟΣ ΚΟΣΜΟΣ Σ"
    assert "οδος κοσμος σ" == text.lower()
    assert tok.encode(text) == clip_reference_ids(hf, text) == hf_ids(hf, text.lower())
    assert tok.encode(text) != hf_ids(hf, text)


def test_divergence_long_s_contraction(tok, hf):
    # CLIP compiles its pattern case-insensitively, and the regex module folds ſ (U+017F) to s, so
    # "'ſ" is the contraction piece "'s"-alike; transformers splits it into "'" and a letter run.
    text = "it'ſ fine"
    assert regex.findall(CLIP_PATTERN, text, regex.IGNORECASE) == ["it", "'ſ", "fine"]
    assert tok.encode(text) == clip_reference_ids(hf, text)
    assert tok.encode(text) != hf_ids(hf, text)
    # The ligature ﬅ becomes "ſt" in ftfy, so it takes the same path.
    assert tok.encode("it'ﬅ") == clip_reference_ids(hf, "it'ﬅ") == tok.encode("it'ſt")


def test_divergence_ypogegrammeni(tok, hf):
    # U+0345 COMBINING GREEK YPOGEGRAMMENI case-folds to ι: under CLIP's case-insensitive pattern it
    # is neither "not a letter" nor (in the regex module) part of a letter run, so no alternative
    # matches and CLIP drops it. transformers keeps it as a piece of its own.
    text = "ε\u0345 q\u0345q"
    assert regex.findall(CLIP_PATTERN, text, regex.IGNORECASE) == ["ε", "q", "q"]
    assert tok.encode(text) == clip_reference_ids(hf, text) == hf_ids(hf, "ε q q")
    assert tok.encode(text) != hf_ids(hf, text)


def test_divergence_nfc_after_unescape(tok, hf):
    # ftfy returns NFC text, but CLIP unescapes HTML after ftfy and does not normalize again, so an
    # entity for a combining mark stays decomposed. (ftfy unescapes entities itself unless the text
    # holds a "<"; the double escape survives its pass.) transformers applies NFC and composes é.
    text = "cafe&amp;#769; <3"
    assert reference_clean(text) == "cafe\u0301 <3"
    assert tok.encode(text) == clip_reference_ids(hf, text)
    assert tok.encode(text) != hf_ids(hf, reference_clean(text))
    assert hf_ids(hf, reference_clean(text)) == hf_ids(hf, "café <3")


def test_divergence_special_tokens_in_prompt(tok, hf):
    # A special token written in the prompt: both give its id when it is written in lower case and
    # stands alone.
    assert tok.encode("a <|endoftext|> b") == hf_ids(hf, "a <|endoftext|> b") == [320, EOS, 321]
    assert tok.encode("<|startoftext|>x") == [BOS, 343]
    # CLIP lower-cases first, so upper case still gives the id; transformers matches special tokens
    # before lower-casing and spells it out with ordinary tokens.
    text = "a <|ENDOFTEXT|> b"
    assert tok.encode(text) == clip_reference_ids(hf, text) == [320, EOS, 321]
    assert hf_ids(hf, text) != [320, EOS, 321]
    # Glued to punctuation, CLIP's pattern takes "!<|" as one punctuation run, so there is no
    # special token; transformers still finds it.
    text = "wow!<|endoftext|>"
    assert EOS not in tok.encode(text)
    assert tok.encode(text) == clip_reference_ids(hf, text)
    assert EOS in hf_ids(hf, text)


def test_recent_unicode_follows_python_side(tok, hf):
    # Characters that Python 3.11's tables (Unicode 14) call unassigned but newer tables know, e.g.
    # U+10D50 (Garay, Unicode 16) and U+A7CB (capital rams horn, Unicode 16): the class used by the
    # split comes from the installed regex module and lower-casing from Python, as in CLIP; Rust's
    # tables in transformers may class them otherwise. The generated prompts avoid such characters.
    for char in ["\U00010d50", "\ua7cb", "\U00010940"]:
        text = f"q{char}q {char}"
        assert tok.encode(text) == clip_reference_ids(hf, text)


def test_whitespace_definition(tok, hf):
    # CLIP collapses whitespace with the regex module, whose \s is Unicode White_Space, as is the
    # Rust \s in transformers: they agree on every code point. Python's str.isspace / re also count
    # U+001C..U+001F, but ftfy removes those control characters first (and HTML-unescaping never
    # produces them), so that difference cannot reach the split.
    spaced = "a\u2003\u00a0\u202f\u1680b\u2029\x0bc\x85d"
    assert tok.encode(spaced) == hf_ids(hf, reference_clean(spaced)) == clip_reference_ids(hf, spaced)
    assert tok.encode(spaced)[:3] == tok.encode("a b c")
    assert ftfy.fix_text("a\x1cb\x1fc") == "abc"
    assert tok.encode("a\x1cb\x1fc") == hf_ids(hf, "abc")


def test_divergence_sd2_pad_token_splits_exclamation_marks(tok, hf_sd2):
    # With pad_token="!" (SD 2.x folders), transformers registers "!" as a special added token and
    # splits it out of the text before BPE, so "?!" becomes "?" + "!" and "!!" two tokens. OpenCLIP,
    # which SD 2.x's text encoder was trained with, treats "!" as ordinary text; the pad token only
    # fills the row. sdlite follows OpenCLIP: the pad id changes padding, never the prompt's ids.
    # (Pipelines compared with diffusers on SD 2.x prompts holding "!" will see this difference.)
    sd2 = CLIPTokenizer.from_package(pad_token_id=SD2_PAD_TOKEN_ID)
    text = "wow?! so cool!!"
    assert sd2.encode(text) == tok.encode(text) == clip_reference_ids(hf_sd2, text)
    assert hf_sd2.pad_token_id == 0
    assert hf_sd2(text, add_special_tokens=False)["input_ids"] != tok.encode(text)


# ---------------------------------------------------------------------------- padding, truncation, info


def test_padding_by_family():
    sd1 = CLIPTokenizer.from_package()
    sd2 = CLIPTokenizer.from_package(pad_token_id=SD2_PAD_TOKEN_ID)
    assert sd1("a cat")[0].tolist() == [BOS, 320, 2368, EOS] + [49407] * 73
    assert sd2("a cat")[0].tolist() == [BOS, 320, 2368, EOS] + [0] * 73
    assert sd1("")[0].tolist() == [BOS, EOS] + [49407] * 75
    assert sd2("")[0].tolist() == [BOS, EOS] + [0] * 75
    assert sd2(["", " \t "]).tolist() == [[BOS, EOS] + [0] * 75] * 2
    assert sd1([]).shape == (0, 77)


def test_long_prompt_keeps_eos_last(tok, prompts):
    long = [p for p in prompts if len(tok.encode(p)) > 75]
    assert len(long) >= 20
    rows = tok(long)
    assert rows.shape == (len(long), 77)
    assert (rows[:, 0] == BOS).all() and (rows[:, 76] == EOS).all()
    for p, row in zip(long, rows.tolist()):
        assert row[1:76] == tok.encode(p)[:75]


def single_token_words(hf, count: int) -> list[str]:
    """Distinct ASCII words that are one token each, per transformers."""
    words = []
    for token, _ in sorted(hf.get_vocab().items(), key=lambda kv: kv[1]):
        w = token[: -len("</w>")] if token.endswith("</w>") else ""
        if len(w) >= 3 and w.isascii() and w.isalpha() and len(hf_ids(hf, w)) == 1:
            words.append(w)
            if len(words) == count:
                return words
    raise AssertionError("not enough single-token words")


def test_truncation_info_cut_between_words(tok, hf):
    words = single_token_words(hf, 90)
    text = " ".join(words)
    info = tok.tokenize_with_info(text)
    assert isinstance(info, TokenizedPrompt)
    assert (info.num_tokens, info.num_kept, info.num_dropped, info.truncated) == (90, 75, 15, True)
    assert info.dropped_text == " ".join(words[75:])
    assert info.input_ids == tok(text)[0].tolist()
    assert info.input_ids[1:76] == hf_ids(hf, " ".join(words[:75]))
    assert info.input_ids[76] == EOS


def test_truncation_info_is_cleaned_text(tok, hf):
    words = single_token_words(hf, 75)
    info = tok.tokenize_with_info(" ".join(words) + "  The\tEND &amp; More ")
    assert info.num_dropped == 4
    assert info.dropped_text == "the end & more"


def test_truncation_info_cut_inside_a_word(tok, hf):
    words = single_token_words(hf, 74)
    long_word = "supercalifragilisticexpialidocious"
    pieces = hf.convert_ids_to_tokens(hf_ids(hf, long_word))
    assert len(pieces) >= 3
    info = tok.tokenize_with_info(" ".join(words) + f" {long_word} tail")
    assert info.num_kept == 75 and info.num_tokens == 74 + len(pieces) + 1
    assert info.dropped_text == long_word[len(pieces[0]) :] + " tail"


def test_truncation_info_cut_inside_a_character(tok, hf):
    # A character the vocabulary does not hold whole: its UTF-8 bytes span several tokens, and a cut
    # after the first of them reports the whole character as dropped.
    char = next(c for c in "𝕏𓀀𝄞ꙮ" if len(hf_ids(hf, c)) >= 2)
    words = single_token_words(hf, 74)
    info = tok.tokenize_with_info(" ".join(words) + f" {char} tail")
    assert info.num_kept == 75 and info.num_dropped >= 2
    assert info.dropped_text == f"{char} tail"


def test_info_without_truncation(tok):
    for text in ["", "a cat on a beach", "word " * 75]:
        info = tok.tokenize_with_info(text)
        assert not info.truncated and info.num_dropped == 0 and info.dropped_text == ""
        assert info.num_tokens == info.num_kept == len(tok.encode(text))
        assert info.input_ids == tok(text)[0].tolist()
    assert tok.tokenize_with_info("word " * 76).dropped_text == "word"


def test_max_length_argument():
    small = CLIPTokenizer(*_package_parts(), pad_token_id=0, max_length=6)
    assert small("a cat on a beach").tolist() == [[BOS, 320, 2368, 525, 320, EOS]]
    info = small.tokenize_with_info("a cat on a beach")
    assert (info.num_kept, info.dropped_text) == (4, "beach")
    with pytest.raises(ValueError):
        CLIPTokenizer(*_package_parts(), max_length=1)
    with pytest.raises(ValueError, match="pad_token_id"):
        CLIPTokenizer(*_package_parts(), pad_token_id=49408)


def _package_parts():
    tokens, merge_lines = derive_vocab_and_merges()
    return {t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merge_lines]


# ---------------------------------------------------------------------------- decode


def test_decode(tok, hf, prompts):
    assert tok.decode(tok("A cat, on a beach!")[0]) == "a cat , on a beach !"
    sd2 = CLIPTokenizer.from_package(pad_token_id=0)
    assert sd2.decode(sd2("a cat!")[0]) == "a cat !"  # padding "!" after the end token is not text
    assert tok.decode(tok("a cat")[0], skip_special_tokens=False).startswith("<|startoftext|>a cat <|endoftext|>")
    for p in prompts[:300]:
        ids = tok.encode(p)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="49408"):
        tok.decode([49408])


def test_call_rejects_non_strings(tok):
    with pytest.raises(TypeError):
        tok(["a", 3])
    with pytest.raises(TypeError):
        tok(None)


# ---------------------------------------------------------------------------- files and folders


def test_from_files_and_folder(tmp_path, hf_dir, tok, prompts):
    from_files = CLIPTokenizer.from_files(hf_dir / "vocab.json", hf_dir / "merges.txt")
    assert from_files.pad_token_id == 49407
    assert torch.equal(from_files(prompts[:200]), tok(prompts[:200]))

    model = tmp_path / "sd2"
    tokens, merge_lines = derive_vocab_and_merges()
    write_hf_files(model / "tokenizer", tokens, merge_lines)
    # SD 1.x folders name no pad token other than the end token; without files, the default holds.
    assert CLIPTokenizer.from_pretrained_dir(model).pad_token_id == 49407
    (model / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"pad_token": {"content": "<|endoftext|>", "special": True}, "model_max_length": 77})
    )
    assert CLIPTokenizer.from_pretrained_dir(model).pad_token_id == 49407
    # SD 2.x: special_tokens_map.json names "!" (id 0) and takes precedence.
    (model / "tokenizer" / "special_tokens_map.json").write_text(json.dumps({"pad_token": "!"}))
    sd2 = CLIPTokenizer.from_pretrained_dir(model)
    assert sd2.pad_token_id == 0
    assert sd2("a cat")[0].tolist() == [BOS, 320, 2368, EOS] + [0] * 73
    # The tokenizer folder itself works too.
    assert CLIPTokenizer.from_pretrained_dir(model / "tokenizer").pad_token_id == 0
    (model / "tokenizer" / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>"}))
    with pytest.raises(ValueError, match="special_tokens_map.json"):
        CLIPTokenizer.from_pretrained_dir(model)


def test_missing_files_are_named(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match="vocab.json"):
        CLIPTokenizer.from_files(tmp_path / "vocab.json", hf_dir / "merges.txt")
    with pytest.raises(FileNotFoundError, match="merges.txt"):
        CLIPTokenizer.from_files(hf_dir / "vocab.json", tmp_path / "merges.txt")
    with pytest.raises(FileNotFoundError, match="vocab.json"):
        CLIPTokenizer.from_pretrained_dir(tmp_path)


def test_garbled_files_are_named(tmp_path, hf_dir):
    merges = hf_dir / "merges.txt"
    vocab = hf_dir / "vocab.json"
    bad = tmp_path / "vocab.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="vocab.json.*not valid JSON"):
        CLIPTokenizer.from_files(bad, merges)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="vocab.json"):
        CLIPTokenizer.from_files(bad, merges)
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\ni n\nt h e\n")
    with pytest.raises(ValueError, match=r"merges.txt.*line 3"):
        CLIPTokenizer.from_files(vocab, bad_merges)
    bad_merges.write_text("")
    with pytest.raises(ValueError, match="merges.txt"):
        CLIPTokenizer.from_files(vocab, bad_merges)
    # A vocabulary that lacks a merge's result: both files are named.
    encoder = json.loads(vocab.read_text(encoding="utf-8"))
    del encoder["in"]
    bad.write_text(json.dumps(encoder, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab.json.*merges.txt.*'in'"):
        CLIPTokenizer.from_files(bad, merges)
    # Merges that do not belong to this vocabulary.
    bad_merges.write_text("#version: 0.2\nzz qq\n", encoding="utf-8")
    with pytest.raises(ValueError, match="merges.txt"):
        CLIPTokenizer.from_files(vocab, bad_merges)
