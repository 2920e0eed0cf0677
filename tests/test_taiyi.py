"""Taiyi (IDEA-CCNL's Chinese Stable Diffusion): SD 1.x's UNet and VAE with a BERT text encoder and a WordPiece
tokenizer. Our BERT against transformers' BertModel (tiny and at Taiyi's real shape), whole images against
diffusers' StableDiffusionPipeline with a BERT text encoder (tiny; and a full-size Taiyi-shaped folder written by
diffusers' save_pretrained), loading, ``sdlite info``, and the refusals (clip skip, embeddings)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from sdlite.config import TAIYI, BertTextConfig
from sdlite.errors import CheckpointError
from sdlite.loader import open_model
from sdlite.models.bert import BertTextEncoder
from sdlite.pipeline import Engine, Request, RequestError
from sdlite.tokenizers import WordPieceTokenizer
from tests.bert_reference import bert_state, build_vocab, hf_tokenizer, transformers_bert, write_vocab
from tests.reference import (TINY_UNET_SD1, TINY_VAE, diffusers_unet, diffusers_vae, max_rel_err, saved_pipeline,
                             seed_all, use_scheduler, with_contrast)

PROMPT = "蓝色背景上的红色圆形，油画"
NEGATIVE = "模糊，低质量"
VOCAB = build_vocab()
TINY_BERT = BertTextConfig(vocab_size=len(VOCAB), max_positions=512, width=32, layers=2, heads=4, mlp_width=37)


def seed_bert(model, seed: int, scale: float = 0.2):
    """Deterministic random weights, LayerNorm scales about 1 (so the outputs are not all at one scale)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("LayerNorm.weight") else 0.0))
    return model


# --- the encoder -----------------------------------------------------------------------------------------------


def test_bert_matches_transformers_tiny():
    ref = seed_bert(transformers_bert(TINY_BERT), 1)
    ours = BertTextEncoder(TINY_BERT)
    ours.load_state_dict(bert_state(ref), strict=True)
    ids = torch.randint(0, TINY_BERT.vocab_size, (3, 512), generator=torch.Generator().manual_seed(2))
    ids[:, 40:] = 0   # [PAD] after the prompt, attended as the reference attends it (no mask)
    with torch.no_grad():
        err = max_rel_err(ours(ids), ref(ids).last_hidden_state)
        short = max_rel_err(ours(ids[:, :20]), ref(ids[:, :20]).last_hidden_state)
    log_figure(max_rel_err=err, max_rel_err_20_tokens=short)
    assert err <= 1e-5 and short <= 1e-5


@pytest.mark.slow
def test_bert_matches_transformers_at_taiyi_shape():
    """Hidden 768, 12 layers, 12 heads, vocabulary 21128, 512 positions: Taiyi's text encoder."""
    cfg = TAIYI.text
    assert (cfg.width, cfg.layers, cfg.heads, cfg.vocab_size, cfg.max_positions) == (768, 12, 12, 21128, 512)
    torch.manual_seed(0)
    ref = transformers_bert(cfg)
    ours = BertTextEncoder(cfg)
    ours.load_state_dict(bert_state(ref), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(3))
    ids[:, 0], ids[:, 30], ids[:, 31:] = 101, 102, 0
    with torch.no_grad():
        err = max_rel_err(ours(ids), ref(ids).last_hidden_state)
    log_figure(max_rel_err=err)
    assert err <= 1e-4, err


# --- whole pipelines -------------------------------------------------------------------------------------------


def taiyi_pipeline(folder, vocab=VOCAB, seed: int = 0):
    """A tiny diffusers StableDiffusionPipeline with a transformers BertModel and BertTokenizer, as Taiyi's."""
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    torch.manual_seed(seed)
    unet = seed_all(diffusers_unet(TINY_UNET_SD1), seed, scale=0.05)
    vae = seed_all(diffusers_vae(TINY_VAE), seed + 1, scale=0.05)
    text = seed_bert(transformers_bert(TINY_BERT), seed + 2)
    tokenizer = hf_tokenizer(write_vocab(folder / "vocab", vocab), 512)
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)
    return StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def reference(pipe, sampler, *, prompt=PROMPT, negative=NEGATIVE, steps=4, seed=7, size=32, cfg=7.5, **kwargs):
    use_scheduler(pipe, sampler)
    out = pipe(prompt=prompt, negative_prompt=negative, num_inference_steps=steps, guidance_scale=cfg,
               generator=[torch.Generator().manual_seed(seed)], height=size, width=size, output_type="np",
               **kwargs).images
    return (out * 255).round().astype(np.uint8)


def ours(engine, sampler, *, prompt=PROMPT, negative=NEGATIVE, steps=4, seed=7, size=32, cfg=7.5):
    result = engine.generate(Request(prompt=prompt, negative_prompt=negative, steps=steps, sampler=sampler,
                                     seed=seed, width=size, height=size, cfg_scale=cfg))
    return np.stack([np.asarray(im) for im in result.images]), result


def log_figure(**figures) -> None:
    """With SDLITE_PARITY_LOG set, one JSON line per comparison (the figures for a report)."""
    log = os.environ.get("SDLITE_PARITY_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], **figures}) + "\n")


def max_diff(a, b) -> int:
    diff = int(np.abs(a.astype(int) - b.astype(int)).max())
    log_figure(max_pixel_diff=diff)
    return diff


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The reference pipeline and its save_pretrained folder, plus the same folder with vocab.txt as Taiyi ships
    it (transformers 5 writes tokenizer.json only)."""
    tmp = tmp_path_factory.mktemp("taiyi")
    pipe = saved_pipeline(with_contrast(taiyi_pipeline(tmp)), tmp / "model")
    return pipe, tmp / "model", Engine.load(tmp / "model", precision="exact")


@pytest.mark.parametrize("sampler", ["euler_a", "dpmpp_2m_karras", "pndm"])
def test_image_matches_diffusers_with_bert_text_encoder(tiny, sampler):
    pipe, _, engine = tiny
    expected = reference(pipe, sampler)
    got, result = ours(engine, sampler)
    assert got.shape == expected.shape == (1, 32, 32, 3)
    assert max_diff(got, expected) <= 2
    assert result.warnings == []


def test_plain_english_mixed_and_cut_prompts_match(tiny):
    pipe, _, engine = tiny
    long_prompt = "红色的圆形，" * 120   # 720 tokens: cut to 510, as diffusers cuts it
    for prompt, negative in (("a red circle on a blue background", ""), ("Van Gogh 风格的小桥流水人家 2024", "blurry"),
                             (long_prompt, NEGATIVE)):
        expected = reference(pipe, "euler", prompt=prompt, negative=negative, steps=3)
        got, result = ours(engine, "euler", prompt=prompt, negative=negative, steps=3)
        assert max_diff(got, expected) <= 2, prompt[:30]
    assert any("720 tokens" in w and "510" in w for w in result.warnings), result.warnings


def test_context_is_512_bert_states(tiny):
    _, _, engine = tiny
    ctx, warnings = engine.encode_prompt(["蓝色背景上的红色圆形", ""])
    assert ctx.shape == (2, 512, 32) and warnings == []
    with torch.no_grad(), engine.models.use("text_encoder") as te:
        direct = te(engine.tokenizer(["蓝色背景上的红色圆形"]))
    assert torch.equal(ctx[:1], direct)


def test_emphasis_is_applied_and_break_ignored(tiny):
    """Weights scale the tokens' states and the row's mean is restored; BREAK is ignored with a warning."""
    _, _, engine = tiny
    plain, _ = engine.encode_prompt(["红色的圆形"])
    weighted, _ = engine.encode_prompt(["(红色:1.5)的圆形"])
    assert not torch.equal(plain, weighted)
    assert torch.allclose(plain.mean(), weighted.mean(), rtol=1e-4, atol=1e-6)
    ids = engine.tokenizer("红色的圆形")[0]
    # positions 1-2 (红, 色) carry weight 1.5 before the mean is restored: their ratio to the others changed
    ratio = weighted[0, 1:3].norm() / weighted[0, 3:6].norm()
    assert ratio / (plain[0, 1:3].norm() / plain[0, 3:6].norm()) == pytest.approx(1.5, rel=1e-4)
    assert ids[1:3].tolist() == engine.tokenizer.encode("红色")
    broke, warnings = engine.encode_prompt(["红色 BREAK 圆形"])
    assert torch.equal(broke, engine.encode_prompt(["红色  圆形"])[0])
    assert any("BREAK" in w and "ignored" in w for w in warnings)


def test_clip_skip_and_embeddings_are_refused(tiny, tmp_path):
    _, _, engine = tiny
    with pytest.raises(RequestError, match="clip skip 2 .*BERT"):
        engine.generate(Request(prompt=PROMPT, steps=1, clip_skip=2, width=32, height=32, seed=1))
    emb = tmp_path / "emb"
    emb.mkdir()
    from safetensors.torch import save_file

    save_file({"emb_params": torch.zeros(1, 32)}, emb / "mystyle.safetensors")
    with pytest.raises(RequestError, match="embeddings are made for CLIP"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=32, height=32, seed=1, embeddings_dir=str(emb)))


def test_vocab_txt_folder_loads_the_same(tiny, tmp_path):
    """A folder with tokenizer/vocab.txt (as Taiyi publishes it) instead of tokenizer.json: the same ids."""
    import shutil

    _, folder, engine = tiny
    copy = tmp_path / "taiyi"
    shutil.copytree(folder, copy)
    (copy / "tokenizer" / "tokenizer.json").unlink()
    write_vocab(copy / "tokenizer", VOCAB)
    ckpt = open_model(copy)
    tok = ckpt.tokenizer()
    assert isinstance(tok, WordPieceTokenizer) and tok.max_length == 512
    assert torch.equal(tok([PROMPT, "a b c"]), engine.tokenizer([PROMPT, "a b c"]))


def test_folder_is_described_as_taiyi(tiny, capsys):
    from sdlite.cli import main

    _, folder, _ = tiny
    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "family:      sd1 (Taiyi, Chinese BERT text encoder)" in out
    assert "BERT text encoder: 2 layers, width 32, 4 heads" in out
    ckpt = open_model(folder)
    counts = ckpt.parameter_counts()
    ref_bert = sum(v.numel() for k, v in bert_state(transformers_bert(TINY_BERT)).items())
    assert counts["text_encoder"] == ref_bert
    assert "pooler.dense.weight" in ckpt.sources["text_encoder"].ignored


def test_bad_taiyi_folders_are_named(tiny, tmp_path):
    import shutil

    _, folder, _ = tiny
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg_file = bad / "text_encoder" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, "hidden_size": 64, "intermediate_size": 64}))
    with pytest.raises(CheckpointError, match="BERT text encoder's width 64 .* context dim 32"):
        open_model(bad)
    cfg_file.write_text(json.dumps({**cfg, "architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta"}))
    with pytest.raises(CheckpointError, match="XLMRobertaModel"):
        open_model(bad)
    cfg_file.write_text(json.dumps({**cfg, "position_embedding_type": "relative_key"}))
    with pytest.raises(CheckpointError, match="position_embedding_type"):
        open_model(bad)
    cfg_file.write_text(json.dumps(cfg))
    shutil.rmtree(bad / "tokenizer")
    with pytest.raises(CheckpointError, match=r"tokenizer/vocab.txt"):
        Engine.load(bad, precision="exact")


def test_bilingual_clip_architecture_loads_as_declared(tmp_path):
    """Taiyi's Chinese-English variant keeps a CLIP-architecture text tower: a folder declaring CLIPTextModel
    loads as CLIP whatever its tokenizer, and draws what diffusers draws."""
    from tests.reference import diffusers_pipeline

    ref = saved_pipeline(with_contrast(diffusers_pipeline("sd1", tmp_path)), tmp_path / "bilingual")
    engine = Engine.load(tmp_path / "bilingual", precision="exact")
    assert engine.spec.text.architecture == "clip" and engine.tokenizer.kind == "clip_bpe"
    got, _ = ours(engine, "euler", prompt="a red circle", negative="", steps=3, size=64)
    assert max_diff(got, reference(ref, "euler", prompt="a red circle", negative="", steps=3, size=64)) <= 2


# --- full size -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def taiyi_full(sd15_folder, tmp_path_factory):
    """A full-size Taiyi-shaped folder as diffusers writes it: ``model_index.json`` from the pipeline's own
    ``save_config``, a random BertModel at Taiyi's shape saved by ``save_pretrained`` with a 21128-token vocabulary
    (ours, padded with [unused] tokens) and vocab.txt as Taiyi ships it; the UNet, VAE and scheduler are the
    session's SD 1.5 ones (random weights at the real shapes), linked rather than written again (3.6 GB)."""
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    tmp = tmp_path_factory.mktemp("taiyi_full")
    vocab = VOCAB + [f"[unused{i}]" for i in range(TAIYI.text.vocab_size - len(VOCAB))]
    torch.manual_seed(0)
    text = transformers_bert(TAIYI.text)
    pipe = StableDiffusionPipeline(
        vae=AutoencoderKL.from_pretrained(sd15_folder / "vae"), text_encoder=text,
        tokenizer=hf_tokenizer(write_vocab(tmp / "vocab", vocab), 512),
        unet=UNet2DConditionModel.from_pretrained(sd15_folder / "unet"),
        scheduler=PNDMScheduler.from_pretrained(sd15_folder / "scheduler"), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    folder = tmp / "taiyi"
    pipe.save_config(folder)
    pipe.text_encoder.save_pretrained(folder / "text_encoder")
    pipe.tokenizer.save_pretrained(folder / "tokenizer")
    write_vocab(folder / "tokenizer", vocab)
    for part in ("unet", "vae", "scheduler"):
        (folder / part).symlink_to(sd15_folder / part, target_is_directory=True)
    yield pipe, folder
    del pipe


@pytest.mark.slow
def test_full_size_taiyi_folder_loads_and_matches_diffusers(taiyi_full, capsys):
    pipe, folder = taiyi_full
    from sdlite.cli import main

    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    # 102,267,648 parameters with BertModel's pooler (590,592), which SD never uses and the loader ignores
    assert "sd1 (Taiyi, Chinese BERT text encoder)" in out and "101,677,056 params" in out
    engine = Engine.load(folder, precision="exact")
    assert engine.spec.text == TAIYI.text and engine.tokenizer.max_length == 512
    expected = reference(pipe, "euler_a", steps=2, size=64)
    got, _ = ours(engine, "euler_a", steps=2, size=64)
    assert got.shape == (1, 64, 64, 3) and max_diff(got, expected) <= 2


def test_saved_again_by_sdlite(tiny, tmp_path):
    """sdlite writes a Taiyi model back as a diffusers folder (BertModel, vocab.txt) that reads to the same
    conditioning; the single-file layout, which has no BERT convention, is refused."""
    from sdlite.export import save_diffusers, save_single_file
    from sdlite.loader import load_model

    _, folder, engine = tiny
    model = load_model(folder)
    out = save_diffusers(model, tmp_path / "again")
    index = json.loads((out / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "BertModel"] and (out / "tokenizer" / "vocab.txt").is_file()
    again = Engine.load(out, precision="exact")
    assert torch.equal(again.encode_prompt([PROMPT, "a b"])[0], engine.encode_prompt([PROMPT, "a b"])[0])
    with pytest.raises(CheckpointError, match="BERT text encoder"):
        save_single_file(model, tmp_path / "taiyi.safetensors")


def test_memory_modes_with_a_half_precision_bert(tiny, tmp_path):
    """A BERT stored in fp16 is converted once and kept in memory mode 1, loaded whole per prompt in mode 2,
    streamed UNet in mode 0: the same conditioning and image every way."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, folder, _ = tiny
    half = tmp_path / "half"
    shutil.copytree(folder, half)
    weights = half / "text_encoder" / "model.safetensors"
    save_file({k: v.half() if v.is_floating_point() else v for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    engines = [Engine.load(half, memory_mode=m, precision="exact") for m in (1, 2, 0)]
    assert {p.dtype for p in engines[0].models.get("text_encoder").parameters()} == {torch.float32}
    contexts = [e.encode_prompt([PROMPT, ""])[0] for e in engines]
    assert torch.equal(contexts[0], contexts[1]) and torch.equal(contexts[0], contexts[2])
    images = [ours(e, "euler", steps=2)[0] for e in engines]
    assert max_diff(images[0], images[1]) == 0 and max_diff(images[0], images[2]) <= 1
