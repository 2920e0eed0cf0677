"""sdlite's WordPiece tokenizer against transformers' BertTokenizer (the tokenizers-backed one of transformers 5),
with Taiyi's settings, on generated prompts; and the tokenizer interface it shares with CLIP's BPE."""
from __future__ import annotations

import json

import pytest
import torch

from sdlite.tokenizers import CLIPTokenizer, WordPieceTokenizer, load_tokenizer, tokenizer_kind
from tests.bert_reference import build_vocab, generate_prompts, hf_tokenizer, write_vocab

N_PROMPTS = 1200


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    return write_vocab(tmp_path_factory.mktemp("wordpiece") / "tokenizer", build_vocab())


@pytest.fixture(scope="module")
def pair(vocab_dir):
    return WordPieceTokenizer.from_pretrained_dir(vocab_dir), hf_tokenizer(vocab_dir)


def _ref_ids(hf, prompts, max_length=512):
    return hf(prompts, padding="max_length", max_length=max_length, truncation=True)["input_ids"]


def test_generated_prompts_match_bert_tokenizer(pair):
    ours, hf = pair
    prompts = generate_prompts(N_PROMPTS, ours.vocab)
    expected = _ref_ids(hf, prompts)
    got = ours(prompts).tolist()
    bad = [(p, e, g) for p, e, g in zip(prompts, expected, got) if e != g]
    assert not bad, f"{len(bad)} of {len(prompts)} differ, first: {bad[0][0]!r}\nref  {bad[0][1][:40]}\nours {bad[0][2][:40]}"
    # the kinds really happen: unknown words, ## pieces, cut prompts, CJK one token a character
    flat = [i for row in got for i in row]
    assert ours.unk_token_id in flat
    assert any(ours.vocab[i].startswith("##") for i in flat)
    assert sum(row[-1] not in (ours.pad_token_id,) for row in got) >= N_PROMPTS // 8   # the over-long ones, cut
    assert sum(ours.tokenize_with_info(p).truncated for p in prompts) >= N_PROMPTS // 8


def test_untruncated_encode_matches(pair):
    """Without the frame and the cut, ours equals the reference's ids of the same text."""
    ours, hf = pair
    for p in generate_prompts(200, ours.vocab, seed=5):
        assert ours.encode(p) == hf(p, add_special_tokens=False)["input_ids"], p


@pytest.mark.parametrize("text", [
    "蓝色背景上的红色圆形", "黄色背景上的绿色星星！", "Hello, World!", "ΣΟΦΟΣ", "Café naïve", "２０２４年", "a\u200db",
    "x\x00y\ufffdz", "[MASK]是[SEP]", "[mask]", "🐱🐱", "❤️", "👨‍👩‍👧", "\u3000红\u3000", "a" * 101, "", "   ",
])
def test_edge_cases(pair, text):
    ours, hf = pair
    assert ours([text]).tolist() == _ref_ids(hf, [text]), text


def test_frame_length_and_truncation(vocab_dir):
    ours = WordPieceTokenizer.from_pretrained_dir(vocab_dir, max_length=8)
    ids = ours("红色的圆形在蓝色的背景上")[0].tolist()
    assert len(ids) == 8 and ids[0] == ours.cls_token_id and ids[-1] == ours.sep_token_id
    info = ours.tokenize_with_info("红色的圆形在蓝色的背景上")
    assert info.truncated and info.num_tokens == 12 and info.num_kept == 6
    assert info.dropped_text == "蓝 色 的 背 景 上"
    short = ours.tokenize_with_info("红色")
    assert not short.truncated and short.dropped_text == "" and short.input_ids[3] == ours.sep_token_id
    assert short.input_ids[4:] == [ours.pad_token_id] * 4
    assert ours.decode(ours("red circles")[0]) == "red circles"


def test_taiyi_config_is_read(vocab_dir, tmp_path):
    tok = WordPieceTokenizer.from_pretrained_dir(vocab_dir)
    assert tok.max_length == 512 and tok.do_lower_case and tok.tokenize_chinese_chars
    # a cased config keeps capitals (and then accents, as strip_accents follows lower-casing)
    cased = tmp_path / "cased"
    write_vocab(cased, build_vocab() + ["Red", "Café"])
    cfg = json.loads((cased / "tokenizer_config.json").read_text())
    (cased / "tokenizer_config.json").write_text(json.dumps({**cfg, "do_lower_case": False}))
    from transformers import BertTokenizer

    hf = BertTokenizer(vocab=str(cased / "vocab.txt"), do_lower_case=False)
    ours = WordPieceTokenizer.from_pretrained_dir(cased)
    for text in ["Red red Café café RED", "Σ 红色"]:
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"]


def test_transformers5_folder_without_vocab_txt(vocab_dir, tmp_path):
    """transformers 5 saves a BertTokenizer as tokenizer.json only: that is read too, to the same ids."""
    hf = hf_tokenizer(vocab_dir)
    hf.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "vocab.txt").exists()
    assert tokenizer_kind(tmp_path / "saved") == "wordpiece"
    ours = load_tokenizer(tmp_path / "saved")
    assert isinstance(ours, WordPieceTokenizer)
    prompts = generate_prompts(80, ours.vocab, seed=9)
    assert ours(prompts).tolist() == _ref_ids(hf, prompts)


def test_bad_files_are_named(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "vocab.txt").write_text("[PAD]\n[CLS]\n[SEP]\n[MASK]\n红\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab.txt.*lacks the unk token '\[UNK\]'"):
        WordPieceTokenizer.from_pretrained_dir(folder)
    with pytest.raises(FileNotFoundError, match="vocab.txt"):
        WordPieceTokenizer.from_files(tmp_path / "nowhere" / "vocab.txt")
    (folder / "vocab.txt").write_bytes(b"\xff\xfe[PAD]\n")
    with pytest.raises(ValueError, match="cannot read the WordPiece vocabulary"):
        WordPieceTokenizer.from_pretrained_dir(folder)
    with pytest.raises(FileNotFoundError, match="expected vocab.txt"):
        load_tokenizer(tmp_path)


def test_one_interface_for_both_tokenizers(vocab_dir):
    """The pipeline uses the same members of either tokenizer."""
    wp = WordPieceTokenizer.from_pretrained_dir(vocab_dir)
    bpe = CLIPTokenizer.from_package()
    for tok, kind, length in ((wp, "wordpiece", 512), (bpe, "clip_bpe", 77)):
        assert tok.kind == kind and tok.max_length == length and tok.vocab_size > 1000
        ids = tok("a red circle")
        assert isinstance(ids, torch.Tensor) and ids.shape == (1, length)
        row = ids[0].tolist()
        body = tok.encode("a red circle")
        assert row[: len(body) + 2] == [tok.bos_token_id, *body, tok.eos_token_id]
        assert set(row[len(body) + 2:]) == {tok.pad_token_id}
        info = tok.tokenize_with_info("a red circle")
        assert info.input_ids == row and not info.truncated
        assert tok.decode(ids[0]) == "a red circle"
