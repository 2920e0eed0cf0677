"""demo-zh: the shipped demo model with a Chinese text encoder (a tiny BERT distilled from the demo CLIP encoder by
tools/train_demo_zh.py). Its tokenizer against transformers' BertTokenizer on its own vocabulary, its folder
(text encoder and tokenizer only, the rest shared with the demo), what Chinese prompts draw (checked by the
classifier on a sample; docs/demo_zh.md measures every combination), the CLI's choice of it, the package size."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdlite.cli import main
from sdlite.demo import DEFAULT_PROMPT_ZH, generate, model_path
from sdlite.demo import data as D
from sdlite.demo import zh as Z
from sdlite.demo.classify import classify, score
from sdlite.images import parse_infotext, read_parameters
from sdlite.loader import open_model
from sdlite.pipeline import Engine
from sdlite.tokenizers import WordPieceTokenizer
from tests.bert_reference import generate_prompts, hf_tokenizer

FOLDER = model_path("demo-zh")
MAX_PACKAGE_DATA = 30 * 2**20


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def engine():
    return Engine.load(FOLDER)


def test_tokenizer_matches_bert_tokenizer_on_the_demo_vocabulary():
    ours = WordPieceTokenizer.from_pretrained_dir(FOLDER)
    hf = hf_tokenizer(FOLDER / "tokenizer", ours.max_length)
    rng_prompts = generate_prompts(1000, ours.vocab, seed=3)
    captions = [Z.caption_zh(*c, template=t) for c in D.ALL_COMBOS[:40] for t in range(len(Z.TEMPLATES_ZH))]
    prompts = rng_prompts + captions + ["A Red Circle, ON a blue background!", "红色的圆形 and a blue star"]
    expected = hf(prompts, padding="max_length", max_length=ours.max_length, truncation=True)["input_ids"]
    assert ours(prompts).tolist() == expected
    # the captions are all in the vocabulary: one token a character, no [UNK]
    ids = ours.encode(DEFAULT_PROMPT_ZH)
    assert len(ids) == len(DEFAULT_PROMPT_ZH) and ours.unk_token_id not in ids


def test_folder_holds_only_its_text_encoder_and_tokenizer():
    index = json.loads((FOLDER / "model_index.json").read_text())
    assert index["_sdlite_shared_from"] == "../demo"
    assert index["text_encoder"] == ["transformers", "BertModel"]
    assert sorted(p.name for p in FOLDER.iterdir()) == ["model_index.json", "text_encoder", "tokenizer"]
    size = sum(f.stat().st_size for f in FOLDER.rglob("*") if f.is_file())
    assert size < 2**20
    ckpt = open_model(FOLDER)
    demo = open_model(model_path())
    assert ckpt.spec.unet == demo.spec.unet and ckpt.spec.vae == demo.spec.vae
    assert ckpt.sources["unet"].files == demo.sources["unet"].files     # the demo's own file, not a copy
    assert ckpt.spec.text.architecture == "bert" and ckpt.spec.text.max_positions == 77
    assert any("shared from '../demo'" in n for n in ckpt.notes)


def test_package_data_stays_under_30_mb():
    data = Path(model_path()).parent
    total = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    assert total <= MAX_PACKAGE_DATA, f"sdlite/data holds {total / 2**20:.1f} MiB"


# a sample of 32 combinations: every colour as the shape's colour 4 times and as the background 4 times, every
# shape 8 times, 4 of them held out of the demo UNet's training
SAMPLE = tuple(D.ALL_COMBOS[i] for i in range(3, len(D.ALL_COMBOS), 7))


def test_chinese_prompts_draw_what_they_say(engine):
    images = generate(engine, SAMPLE, prompts=Z.prompt_zh)
    s = score([classify(im) for im in images], list(SAMPLE))
    assert s["colour"] >= 0.90 and s["shape"] >= 0.80 and s["background"] >= 0.90, s


def test_paraphrases_draw_what_they_say(engine):
    import numpy as np

    rng = np.random.default_rng(7)
    sample = SAMPLE[::2]
    texts = {c: Z.paraphrase_zh(c, rng) for c in sample}
    images = generate(engine, sample, prompts=texts.__getitem__)
    s = score([classify(im) for im in images], list(sample))
    assert s["colour"] >= 0.85 and s["shape"] >= 0.75, (s, texts)


def test_cli_picks_demo_zh_for_a_chinese_prompt(tmp_path):
    out = tmp_path / "zh.png"
    assert main(["generate", DEFAULT_PROMPT_ZH, "--seed", "1", "--steps", "12", "--output", str(out)]) == 0
    params = parse_infotext(read_parameters(out))
    assert params["Model"] == "demo-zh" and params["prompt"] == DEFAULT_PROMPT_ZH
    from PIL import Image

    got = classify(Image.open(out))
    assert (got.colour, got.background) == ("red", "blue")
    en = tmp_path / "en.png"
    assert main(["generate", "a red circle on a blue background", "--seed", "1", "--steps", "4",
                 "--output", str(en)]) == 0
    assert parse_infotext(read_parameters(en))["Model"] == "demo"
    named = tmp_path / "named.png"
    assert main(["generate", "a green star on a yellow background", "--model", "demo-zh", "--seed", "2",
                 "--steps", "12", "--output", str(named)]) == 0
    assert parse_infotext(read_parameters(named))["Model"] == "demo-zh"
    assert classify(Image.open(named)).colour == "green"


def test_info_and_tokens_for_demo_zh(capsys):
    assert main(["info", "demo-zh"]) == 0
    out = capsys.readouterr().out
    assert "sd1 (Taiyi, Chinese BERT text encoder)" in out and "BERT text encoder: " in out
    assert main(["tokens", "(红色:1.2)的圆形"]) == 0
    data = json.loads(capsys.readouterr().out)
    chunk = data["schedule"][0]["chunks"][0]
    assert len(chunk["tokens"]) == 77 and chunk["prompt_tokens"] == 5
    assert chunk["weights"][1:3] == [1.2, 1.2] and chunk["text"] == "红 色 的 圆 形"
