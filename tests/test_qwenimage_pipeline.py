"""Qwen-Image end to end against diffusers' QwenImagePipeline on a tiny random model saved as a diffusers folder: the
system-prompt template with its first 34 tokens dropped, Qwen2.5-VL's last hidden state of the real tokens (the whole
Qwen2_5_VLForConditionalGeneration with a tiny vision tower, as the pipeline calls it; sdlite reads only its language
model), captions of their own lengths masked in the batched call, true CFG with its norm-preserving rescale, the
dynamic shift from the token count with Qwen-Image's scheduler (shift_terminal), the 16-channel latents normalised by
the VAE config's statistics, the single-frame VAE; batch 2, a non-square size, English and Chinese prompts, and what
the family refuses."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import sdlite
from sdlite.config.qwenimage import QWEN_IMAGE_SCHEDULER
from sdlite.config.qwenimage_vae import QWEN_IMAGE_LATENTS_MEAN, QWEN_IMAGE_LATENTS_STD
from sdlite.errors import CheckpointError
from sdlite.families.qwenimage import DROPPED_TOKENS, true_cfg
from sdlite.hires import Hires
from sdlite.pipeline import Engine, Request, RequestError
from tests.reference import seed_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_PIXEL_DIFF = 2   # /255, the bar
QWEN_JSON = Path(sdlite.__file__).parent / "data" / "qwen" / "tokenizer.json"
TEXT_WIDTH = 32
# Qwen2.5-VL's language model: 2 heads of 16 (8 rotary pairs in mrope sections 2, 3, 3), q/k/v biases
TEXT = dict(vocab_size=152064, hidden_size=TEXT_WIDTH, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6, max_position_embeddings=2048,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_WIDTH,
              fullatt_block_indexes=[0])
TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=TEXT_WIDTH, guidance_embeds=False,
                   axes_dims_rope=(4, 6, 6))
VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True],
           latents_mean=list(QWEN_IMAGE_LATENTS_MEAN), latents_std=list(QWEN_IMAGE_LATENTS_STD))
PROMPT, NEGATIVE = "a red circle on a blue background", "green, blurry, low quality, distorted shapes"
PROMPT_ZH = "蓝色背景上的红色圆圈，一只猫举着写有“你好”的牌子"


def _seeded(module, seed: int, scale: float):
    """Random weights: 1-D norm scales around 1, the rest N(0, scale)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.state_dict().items()):
            if p.is_floating_point():
                around = 1.0 if p.ndim == 1 and ("norm" in name or name.endswith("gamma")) else 0.0
                p.copy_(torch.randn(p.shape, generator=g) * scale + around)
    return module


def _text_encoder(seed: int = 2):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, vision_start_token_id=151652,
                              vision_end_token_id=151653, image_token_id=151655, video_token_id=151656)
    config._attn_implementation = "sdpa"
    return seed_all(Qwen2_5_VLForConditionalGeneration(config).eval(), seed, scale=0.2)


def _pipeline(folder: Path, contrast: float = 8.0):
    """A QwenImagePipeline of random weights with Qwen-Image's scheduler, saved in ``folder``."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2TokenizerFast

    vae = _seeded(AutoencoderKLQwenImage(**VAE).eval(), 1, 0.1)
    with torch.no_grad():   # contrast enough that 2/255 means something, few pixels clipped (2% at 0 or 255)
        vae.decoder.conv_out.weight.mul_(contrast)
    transformer = _seeded(QwenImageTransformer2DModel(**TRANSFORMER).eval(), 4, 0.15)
    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(QWEN_JSON))
    scheduler = FlowMatchEulerDiscreteScheduler(**{k: v for k, v in QWEN_IMAGE_SCHEDULER.items()
                                                   if not k.startswith("_")})
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=_text_encoder(), tokenizer=tokenizer,
                             transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder)
    return pipe


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwenimage") / "qwen-image"
    pipe = _pipeline(folder)
    return pipe, Engine.load(folder, precision="exact"), folder


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(im, dtype=np.int16) for im in images])


def _reference(pipe, width, height, **kw) -> np.ndarray:
    out = pipe(height=height, width=width, output_type="np", **kw).images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def _generators(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_folder_opens_as_qwenimage(model):
    _, engine, _ = model
    spec = engine.spec
    assert spec.family == "qwen-image" and spec.denoiser == "transformer"
    assert spec.text_encoders == ("text_encoder",)
    assert spec.text.hidden_size == TEXT_WIDTH and spec.text.attention_bias and not spec.text.qk_norm
    assert spec.transformer.num_layers == 2 and spec.transformer.joint_attention_dim == TEXT_WIDTH
    assert spec.vae.latents_std == pytest.approx(QWEN_IMAGE_LATENTS_STD) and spec.vae.downscale == 8
    assert engine.family.name == "qwen-image" and engine.family.latent.channels == 16
    assert engine.family.sampling_defaults == {"steps": 50, "cfg": 4.0, "sampler": "euler", "timestep_spacing": None}
    assert spec.default_size == 1328
    assert engine.schedule.use_dynamic_shifting and engine.schedule.shift_terminal == pytest.approx(0.02)
    assert any("vision tower" in n for n in engine.models.ckpt.notes)


def test_captions_equal_the_pipelines(model):
    """The template, the 34 dropped tokens and the last hidden state: each caption equals the pipeline's embeds."""
    pipe, engine, _ = model
    texts = [PROMPT, PROMPT_ZH, ""]
    got, pooled = engine.family.encode_texts(engine, texts, 1, None)
    assert pooled is None
    for text, caption in zip(texts, got):
        want, mask = pipe.encode_prompt(text, device="cpu")
        assert mask is None and caption.shape == want.shape
        torch.testing.assert_close(caption, want, rtol=0, atol=1e-6)
    ids = engine.tokenizers["text_encoder"].encode(engine.tokenizers["text_encoder"].chat_prompt(
        "", system=pipe.prompt_template_encode.split("\n")[1].split("<|im_end|>")[0]))
    assert len(ids) == DROPPED_TOKENS + 5 and got[2].shape[1] == 5   # "" leaves the template's closing tokens


@pytest.mark.parametrize("prompt,negative", [(PROMPT, NEGATIVE), (PROMPT_ZH, "")])
def test_true_cfg_matches_qwenimagepipeline(model, prompt, negative):
    """Batch 2 at a non-square size with true CFG 4 (norm-preserving): an English prompt with a longer negative (the
    captions masked to their own lengths in one batched call), and a Chinese prompt with the empty negative."""
    pipe, engine, _ = model
    width, height = 96, 64
    expected = _reference(pipe, width, height, prompt=prompt, negative_prompt=negative, true_cfg_scale=4.0,
                          num_inference_steps=4, num_images_per_prompt=2, generator=_generators(7, 8))
    got = _pixels(engine.generate(Request(prompt=prompt, negative_prompt=negative, steps=4, cfg_scale=4.0, seed=7,
                                          batch_size=2, width=width, height=height, sampler="euler")).images)
    assert got.shape == expected.shape == (2, height, width, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert got.std() > 10, "the images should not be flat"
    assert np.abs(got[0] - got[1]).max() > 10, "each image should draw its own noise"


def test_without_guidance_and_the_rescale_matters(model):
    """cfg 1 is the pipeline without a negative prompt; with guidance, the plain A1111 combination (no rescale) misses
    the pipeline's images by more than the bar that true CFG meets."""
    pipe, engine, _ = model
    expected = _reference(pipe, 64, 64, prompt=PROMPT, num_inference_steps=3, num_images_per_prompt=2,
                          generator=_generators(3, 4))
    request = Request(prompt=PROMPT, steps=3, cfg_scale=1.0, seed=3, batch_size=2, width=64, height=64,
                      sampler="euler")
    unguided = _pixels(engine.generate(request).images)
    assert np.abs(unguided - expected).max() <= MAX_PIXEL_DIFF
    expected = _reference(pipe, 64, 64, prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0,
                          num_inference_steps=3, num_images_per_prompt=2, generator=_generators(3, 4))
    guided = request.replace(negative_prompt=NEGATIVE, cfg_scale=4.0)
    true = _pixels(engine.generate(guided).images)
    engine.family.guidance = None   # the instance's: A1111's uncond + cfg (cond - uncond)
    try:
        plain = _pixels(engine.generate(guided).images)
    finally:
        del engine.family.guidance
    assert np.abs(true - expected).max() <= MAX_PIXEL_DIFF < np.abs(plain - expected).max()
    assert np.abs(true - unguided).max() > 10, "guidance should change the images"


def test_true_cfg_is_the_pipelines_formula():
    """On the denoised estimates of a flow model, :func:`true_cfg` is the pipeline's combination of the packed
    velocities, rescaled per token to the prompt's norm."""
    g = torch.Generator().manual_seed(0)
    x, v_u, v_c = (torch.randn(2, 16, 4, 6, generator=g) for _ in range(3))
    sigma = torch.tensor([0.7, 0.3])
    s = sigma.view(-1, 1, 1, 1)
    got = true_cfg(x, sigma, x - s * v_u, x - s * v_c, 4.0)

    def pack(t):   # the pipeline's _pack_latents
        return t.view(2, 16, 2, 2, 3, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 6, 64)

    comb = pack(v_u) + 4.0 * (pack(v_c) - pack(v_u))
    v = comb * (torch.norm(pack(v_c), dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    torch.testing.assert_close(pack((x - got) / s), v, rtol=1e-5, atol=1e-5)


def test_one_step_is_refused_at_validation_naming_the_minimum(model, monkeypatch):
    """One step of the pipelines' schedule is a lone sigma 1, which the stretch to shift_terminal cannot move: a
    RequestError naming the steps and the minimum before any network runs (not the schedule's error from inside the
    loop), the hires fix's second pass too. ComfyUI's sampling (its own flow table, no stretch) runs one step."""
    _, engine, _ = model

    def no_encoding(*args, **kwargs):
        raise AssertionError("the text encoder ran before the steps were checked")

    monkeypatch.setattr(engine.family, "encode_texts", no_encoding)
    r = Request(prompt=PROMPT, steps=1, width=64, height=64, sampler="euler")
    with pytest.raises(RequestError, match=r"^steps=1: Qwen-Image's schedule stretches its sigmas to end at "
                                           r"shift_terminal=0\.02, which takes at least 2 steps; use 2 or more$"):
        engine.generate(r)
    with pytest.raises(RequestError, match=r"^the hires fix's steps=1: .* at least 2 steps"):
        engine.generate(r.replace(steps=2, hires=Hires(scale=2.0, upscaler="Latent", steps=1, denoise=1.0)))
    monkeypatch.undo()
    comfy = engine.generate(r.replace(noise="comfy", schedule="simple"))
    assert comfy.images[0].size == (64, 64)


def test_refusals(model, tmp_path):
    _, engine, folder = model
    with pytest.raises(RequestError, match="multiples of 16"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=72, height=64, sampler="euler"))
    with pytest.raises(RequestError, match="clip skip"):
        engine.generate(Request(prompt=PROMPT, steps=2, width=64, height=64, clip_skip=2, sampler="euler"))
    with pytest.raises(RequestError, match="skip-layer guidance"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=64, height=64, cfg_scale=2.0, slg_layers=(0,),
                                sampler="euler"))
    with pytest.raises(RequestError, match=r"hires fix's target size 88x88 \(scale 1.375 of 64x64\).*Qwen-Image"):
        engine.generate(Request(prompt=PROMPT, steps=4, width=64, height=64, sampler="euler",
                                hires=Hires(scale=1.375, upscaler="Latent")))
    edit = tmp_path / "edit"
    edit.mkdir()
    (edit / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPipeline"}))
    with pytest.raises(CheckpointError, match="the QwenImageEditPipeline folder has no text_encoder"):
        Engine.load(edit)
