"""FLUX.2 [klein] end to end against diffusers' Flux2KleinPipeline on a tiny random model saved as a diffusers folder:
Qwen3's hidden states 9, 18 and 27 stacked over the chat-templated prompt padded to 512 tokens, the transformer on
normalised 2 x 2 patches of the 32-channel VAE's latent (here 8 channels), the empirical mu from the token and step
counts; the distilled model (no guidance) and the base model (CFG, a negative prompt), batch 2, a non-square size,
editing with one and with two reference images of other sizes, and what the family refuses."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sdlite
from sdlite.pipeline import Engine, Request, RequestError
from sdlite.sources import ImageInputError
from tests.reference import seed_all
from tests.test_qwen import QWEN3_CHAT_TEMPLATE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_PIXEL_DIFF = 2   # /255, the bar
QWEN_JSON = Path(sdlite.__file__).parent / "data" / "qwen" / "tokenizer.json"
TEXT_WIDTH = 16
# klein reads hidden states 9, 18 and 27: the tiny encoder needs 27 layers (the pipeline computes all of them)
QWEN = dict(vocab_size=151936, hidden_size=TEXT_WIDTH, intermediate_size=24, num_hidden_layers=27,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            max_position_embeddings=1024, tie_word_embeddings=True)
LATENT_CHANNELS = 8
TRANSFORMER = dict(patch_size=1, in_channels=4 * LATENT_CHANNELS, out_channels=None, num_layers=1,
                   num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                   joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32, mlp_ratio=3.0,
                   axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=False)
VAE = dict(in_channels=3, out_channels=3, block_out_channels=(16, 32, 32, 32), layers_per_block=1,
           latent_channels=LATENT_CHANNELS, norm_num_groups=8, sample_size=64, use_quant_conv=True,
           use_post_quant_conv=True, batch_norm_eps=1e-4)
PROMPT, NEGATIVE = "a red circle on a blue background", "green, blurry"


def _qwen(seed: int, config: dict = QWEN, scale: float = 0.2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return seed_all(Qwen3ForCausalLM(Qwen3Config(**config, attn_implementation="eager")).eval(), seed, scale=scale)


def _vae(config: dict = VAE, contrast: float = 30.0):
    from diffusers import AutoencoderKLFlux2

    vae = seed_all(AutoencoderKLFlux2(**config).eval(), 1, scale=0.05)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(contrast)   # contrast enough that 2/255 means something
        vae.encoder.conv_out.weight.mul_(contrast)   # and latents of reference images that vary enough to matter
        vae.quant_conv.weight.mul_(contrast)
        g = torch.Generator().manual_seed(5)         # statistics that are not the identity
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=g) * 0.3)
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=g) * 2 + 0.2)
    return vae


def _pipeline(folder: Path, *, distilled: bool = True, transformer: dict = TRANSFORMER, qwen: dict = QWEN,
              vae: dict = VAE, scales: tuple[float, float] = (0.15, 0.2), sharpness: float = 20.0):
    """A Flux2KleinPipeline of random weights with klein's scheduler, saved in ``folder``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen2TokenizerFast

    from sdlite.config.flux2 import FLUX2_KLEIN_SCHEDULER

    network = seed_all(Flux2Transformer2DModel(**transformer).eval(), 4, scale=scales[0])
    with torch.no_grad():   # attention sharp enough that a few reference tokens among 512 text tokens matter
        for name, param in network.named_parameters():
            if ".norm_q." in name or ".norm_k." in name or ".norm_added_q." in name or ".norm_added_k." in name:
                param.mul_(sharpness)
    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(QWEN_JSON))
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    scheduler = FlowMatchEulerDiscreteScheduler(**{k: v for k, v in FLUX2_KLEIN_SCHEDULER.items()
                                                   if not k.startswith("_")})
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=_vae(vae), text_encoder=_qwen(2, qwen, scales[1]),
                              tokenizer=tokenizer, transformer=network, is_distilled=distilled)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder)
    return pipe


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("klein") / "klein"
    pipe = _pipeline(folder)
    return pipe, Engine.load(folder, precision="exact"), folder


@pytest.fixture(scope="module")
def base(tmp_path_factory, distilled):
    """The same weights as a base model (is_distilled false): a copy of the folder with its model index changed."""
    import shutil

    from diffusers import Flux2KleinPipeline

    folder = tmp_path_factory.mktemp("klein-base") / "klein-base"
    shutil.copytree(distilled[2], folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["is_distilled"] = False
    (folder / "model_index.json").write_text(json.dumps(index))
    pipe = Flux2KleinPipeline.from_pretrained(folder)
    pipe.tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    pipe.set_progress_bar_config(disable=True)
    return pipe, Engine.load(folder, precision="exact"), folder


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(im, dtype=np.int16) for im in images])


def _reference(pipe, **kw) -> np.ndarray:
    out = pipe(output_type="np", **kw).images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def _image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random picture (a few blobs of colour), so that the VAE sees structure."""
    g = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    rgb = np.zeros((height, width, 3))
    for _ in range(4):
        cy, cx, r = g.uniform(0, 1, 3)
        rgb += g.uniform(0, 1, 3) * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (0.05 + 0.1 * r))[..., None]
    return Image.fromarray((255 * rgb / rgb.max()).astype(np.uint8))


def test_folder_opens_as_klein(distilled, base):
    _, engine, _ = distilled
    spec = engine.spec
    assert spec.family == "flux2-klein" and spec.denoiser == "transformer"
    assert spec.text.hidden_size == TEXT_WIDTH and spec.text.num_hidden_layers == 27
    assert spec.transformer.joint_attention_dim == 3 * TEXT_WIDTH and spec.transformer.in_channels == 32
    assert engine.family.latent.channels == 32 and engine.family.latent.downscale == 16
    assert engine.family.sampling_defaults["steps"] == 4 and engine.family.sampling_defaults["cfg"] == 1.0
    assert base[1].spec.family == "flux2-klein-base"
    assert base[1].family.sampling_defaults["steps"] == 50 and base[1].family.sampling_defaults["cfg"] == 4.0


@pytest.mark.parametrize("steps,width,height", [(4, 64, 64), (3, 96, 64)])
def test_distilled_txt2img_matches_pipeline(distilled, steps, width, height):
    """Batch 2 without guidance, square and non-square: the mu of each size and step count."""
    pipe, engine, _ = distilled
    expected = _reference(pipe, prompt=PROMPT, height=height, width=width, num_inference_steps=steps,
                          num_images_per_prompt=2, generator=[torch.Generator().manual_seed(s) for s in (7, 8)])
    got = _pixels(engine.generate(Request(prompt=PROMPT, steps=steps, cfg_scale=1.0, seed=7, batch_size=2,
                                          width=width, height=height, sampler="euler")).images)
    assert got.shape == expected.shape == (2, height, width, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert got.std() > 10, "the images should not be flat"


def test_base_model_cfg_with_a_negative_prompt(base):
    """The base model's CFG: the pipeline's guidance_scale is A1111's cfg (uncond + g (cond - uncond)); its negative
    prompt is fixed to "", so the negative's embeddings are handed to it."""
    pipe, engine, _ = base
    negative = pipe.encode_prompt(NEGATIVE)[0]
    expected = _reference(pipe, prompt=PROMPT, negative_prompt_embeds=negative, height=64, width=64,
                          num_inference_steps=3, guidance_scale=3.5, num_images_per_prompt=2,
                          generator=[torch.Generator().manual_seed(s) for s in (3, 4)])
    got = _pixels(engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, cfg_scale=3.5, seed=3,
                                          batch_size=2, width=64, height=64, sampler="euler")).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    unguided = _pixels(engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, seed=3, batch_size=2,
                                               width=64, height=64, sampler="euler")).images)
    assert np.abs(got - unguided).max() > 10, "guidance should change the images"


def test_editing_with_one_reference_image(distilled):
    """One reference of another size than the output; the output size defaults to the reference's (cropped to a
    multiple of 16)."""
    pipe, engine, _ = distilled
    ref = _image(80, 72, 1)
    expected = _reference(pipe, prompt=PROMPT, image=[ref], height=64, width=96, num_inference_steps=3,
                          generator=torch.Generator().manual_seed(5))
    got = _pixels(engine.generate(Request(prompt=PROMPT, reference_images=(ref,), steps=3, cfg_scale=1.0, seed=5,
                                          width=96, height=64, sampler="euler")).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    plain = _pixels(engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, seed=5, width=96, height=64,
                                            sampler="euler")).images)
    # the reference changes the image by more than the parity bar allows (so a run without it would fail above)
    assert np.abs(got - plain).max() > 2 * MAX_PIXEL_DIFF, "the reference should change the image"
    sized = engine.generate(Request(prompt=PROMPT, reference_images=(ref,), steps=1, seed=5, sampler="euler"))
    assert sized.images[0].size == (80, 64)


def test_editing_with_two_reference_images_and_batch_2(distilled, tmp_path):
    """Two references of different sizes (one from a file), batch 2: each image's tokens at t = 10 and 20."""
    pipe, engine, _ = distilled
    first, second = _image(64, 96, 2), _image(112, 80, 3)
    second.save(tmp_path / "second.png")
    expected = _reference(pipe, prompt=PROMPT, image=[first, second], height=64, width=64, num_inference_steps=2,
                          num_images_per_prompt=2, generator=[torch.Generator().manual_seed(s) for s in (9, 10)])
    got = _pixels(engine.generate(Request(prompt=PROMPT, reference_images=(first, str(tmp_path / "second.png")),
                                          steps=2, cfg_scale=1.0, seed=9, batch_size=2, width=64, height=64,
                                          sampler="euler")).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


def test_refusals(distilled):
    _, engine, _ = distilled
    with pytest.raises(RequestError, match="multiples of 16"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=72, height=64, sampler="euler"))
    with pytest.raises(RequestError, match="clip skip"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=64, height=64, clip_skip=2, sampler="euler"))
    with pytest.raises(RequestError, match="at least 64"):
        engine.generate(Request(prompt=PROMPT, steps=1, reference_images=(_image(48, 64, 1),), sampler="euler"))
    with pytest.raises(ImageInputError, match="reference image 1"):
        engine.generate(Request(prompt=PROMPT, steps=1, reference_images=("/nonexistent/ref.png",),
                                sampler="euler"))


def _mask(width: int, height: int, box: tuple[int, int, int, int]) -> Image.Image:
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, box)
    return mask


@pytest.fixture(scope="module")
def inpaint(distilled):
    from diffusers import Flux2KleinInpaintPipeline

    pipe = Flux2KleinInpaintPipeline.from_pretrained(distilled[2])
    pipe.tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("strength", [0.8, 1.0])
def test_inpainting_matches_klein_inpaint_pipeline(distilled, inpaint, strength):
    """Batch 2, no mask blur, no overlay: the source encoded to its mean latent is both the start and the first
    reference; the mask binarised and bilinear on the patch grid; the unmasked region re-imposed after each step."""
    _, engine, _ = distilled
    source, mask = _image(96, 64, 4), _mask(96, 64, (16, 8, 64, 48))
    expected = _reference(inpaint, prompt=PROMPT, image=source, mask_image=mask, strength=strength,
                          num_inference_steps=4, num_images_per_prompt=2,
                          generator=[torch.Generator().manual_seed(s) for s in (4, 5)])
    got = _pixels(engine.generate(Request(prompt=PROMPT, init_image=source, mask=mask, strength=strength, steps=4,
                                          cfg_scale=1.0, seed=4, batch_size=2, mask_blur=0, overlay=False,
                                          sampler="euler")).images)
    assert got.shape == expected.shape == (2, 64, 96, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    repaint = np.asarray(mask) > 0
    assert np.abs(got[0] - got[1])[repaint].mean() > 2, "each image repaints the mask with its own noise"


def test_inpainting_encodes_the_source_once(distilled, monkeypatch):
    """The source's mean latent is both the first reference (the family's conditioning) and the start (the engine's):
    one VAE encode serves both (and the next request with the same source needs none)."""
    _, engine, _ = distilled
    engine._moments_memo = None   # what an earlier test encoded
    calls = []
    with engine.models.use("vae") as vae:
        encode = type(vae).encode_moments
    monkeypatch.setattr(type(vae), "encode_moments", lambda self, x: calls.append(x.shape) or encode(self, x))
    source, mask = _image(96, 64, 4), _mask(96, 64, (16, 8, 64, 48))
    request = Request(prompt=PROMPT, init_image=source, mask=mask, strength=0.6, steps=2, cfg_scale=1.0, seed=4,
                      mask_blur=0, overlay=False, sampler="euler")
    first = engine.generate(request).images[0]
    assert calls == [(1, 3, 64, 96)]
    again = engine.generate(request.replace(seed=5)).images[0]
    assert calls == [(1, 3, 64, 96)] and np.asarray(first).shape == np.asarray(again).shape


def test_first_block_cache_with_references(distilled):
    """The first-block cache (--cache T) on klein, the references in every call: threshold 0 skips nothing (the
    uncached image exactly); a call whose first block's residual did not change skips the other blocks and adds their
    kept residuals (the same output within rounding)."""
    from sdlite.engine.blockcache import BlockCache

    _, engine, _ = distilled
    r = Request(prompt=PROMPT, reference_images=(_image(64, 64, 6),), steps=4, cfg_scale=1.0, seed=2, width=64,
                height=64, sampler="euler")
    plain = engine.generate(r)
    zero = engine.generate(r.replace(cache_threshold=0.0))
    assert np.array_equal(_pixels(zero.images), _pixels(plain.images))
    assert zero.infotext["Step cache"] == "first-block 0"
    cache = BlockCache(0.5)
    g = torch.Generator().manual_seed(3)
    x, ref = torch.randn(1, 32, 4, 4, generator=g), torch.randn(1, 32, 3, 5, generator=g)
    context = torch.randn(1, 7, 3 * TEXT_WIDTH, generator=g)
    with torch.no_grad(), engine.models.use("transformer") as network:
        wrapped = cache.wrap(network)
        full = wrapped(x, torch.tensor([0.7]), context, references=[ref])
        cache.step = 1
        again = wrapped(x, torch.tensor([0.7]), context, references=[ref])
    assert (cache.full_calls, cache.skipped_calls) == (1, 1)
    torch.testing.assert_close(again, full, rtol=1e-5, atol=1e-5)


def test_comfyui_schedulers_use_comfyuis_flux2_shift(distilled):
    """ComfyUI samples FLUX.2 with ModelSamplingFlux at mu 2.02 (not FLUX.1's 1.15): its KSampler's "simple" sigmas
    on klein are those of that table; a ModelSampling node's shift still wins."""
    from sdlite.pipeline.latents import LatentRun, plan_sigmas
    from sdlite.sampling.comfy import comfy_sigmas

    _, engine, _ = distilled
    r = engine._checked(Request(prompt=PROMPT, steps=4, cfg_scale=1.0, width=64, height=64, sampler="euler",
                                schedule="simple", noise="comfy", seed=1))
    latent = torch.zeros(1, 32, 4, 4)
    schedule = engine.schedule_for(r)
    got = plan_sigmas(engine, r, LatentRun(latent))
    assert torch.equal(got, comfy_sigmas(schedule, "simple", 4, 2.02))
    assert not torch.equal(got, comfy_sigmas(schedule, "simple", 4, None))   # FLUX.1's 1.15
    sig = torch.tensor(1.0 - 1 / 4)   # the simple scheduler's second sigma: timestep 0.75 of ModelSamplingFlux
    assert float(got[1]) == pytest.approx(float(np.exp(2.02) / (np.exp(2.02) + 1 / sig - 1)), rel=1e-4)
    assert torch.equal(plan_sigmas(engine, r, LatentRun(latent, shift=1.5)), comfy_sigmas(schedule, "simple", 4, 1.5))
