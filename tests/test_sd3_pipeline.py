"""SD3 end to end against diffusers' StableDiffusion3Pipeline (and its img2img pipeline) on tiny random models saved
as diffusers folders: the three text encoders (CLIP-L and bigG at their penultimate layers with their pooled
projections, T5 over 256 tokens, the joint context), the MMDiT-X transformer (dual attention, qk RMS norm), flow
matching with the scheduler's shift, the 16-channel VAE's shift and scale; with and without T5 and a negative prompt,
batch 2; and what the family refuses."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sdlite
from sdlite.config import TextEncoderConfig, VAEConfig
from sdlite.loader import open_model
from sdlite.control import ControlUnit
from sdlite.errors import SDLiteError
from sdlite.pipeline import Engine, Request, RequestError
from tests.reference import diffusers_vae, seed_all, write_hf_tokenizer_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_PIXEL_DIFF = 2   # /255, the bar
SIZE = 64            # 8x8 latents, 16 image tokens
T5_JSON = Path(sdlite.__file__).parent / "data" / "t5" / "tokenizer.json"

TEXT_L = TextEncoderConfig(width=32, layers=3, heads=4, mlp_width=37, projection_dim=32)
TEXT_G = TextEncoderConfig(width=40, layers=3, heads=4, mlp_width=64, activation="gelu", pad_token_id=0,
                           eos_token_id=2, projection_dim=24)
T5_WIDTH = 80
TRANSFORMER = dict(sample_size=SIZE // 8, patch_size=2, in_channels=16, out_channels=16, num_layers=3,
                   attention_head_dim=8, num_attention_heads=4, joint_attention_dim=T5_WIDTH,
                   caption_projection_dim=32, pooled_projection_dim=32 + 24, pos_embed_max_size=16,
                   qk_norm="rms_norm", dual_attention_layers=(0,))
VAE = VAEConfig(latent_channels=16, block_channels=(32, 64, 64, 64), layers_per_block=1, scaling_factor=1.5305,
                shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False, sample_size=SIZE)
PROMPT, NEGATIVE = "a red circle on a blue background", "green, blurry"


def _clip(cfg: TextEncoderConfig, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    d = cfg.to_diffusers()
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    return seed_all(CLIPTextModelWithProjection(CLIPTextConfig(**d, attn_implementation="eager")).eval(), seed,
                    scale=0.2)


def _t5(seed: int, width: int = T5_WIDTH):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=32128, d_model=width, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    model = T5EncoderModel(cfg).eval()
    return seed_all(model, seed, scale=0.2)


def _transformer(seed: int, **changes):
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(**{**TRANSFORMER, **changes}).eval()
    seed_all(model, seed, scale=0.15)
    return model


def _pipeline(tmp: Path, with_t5: bool = True, text_l: TextEncoderConfig = TEXT_L, text_g: TextEncoderConfig = TEXT_G,
              t5_width: int = T5_WIDTH):
    """A tiny StableDiffusion3Pipeline (without T5: ``with_t5=False``); its CLIP towers and T5 width may be others
    than this module's (a single file's tests need CLIP heads 64 wide, which the shapes imply)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTokenizer, T5TokenizerFast

    vae = seed_all(diffusers_vae(VAE), 1, scale=0.05)
    with torch.no_grad():   # contrast enough that 2/255 means something (tests.reference.with_contrast)
        vae.decoder.conv_out.weight.mul_(30.0)
    pipe = StableDiffusion3Pipeline(
        transformer=_transformer(4, joint_attention_dim=t5_width,
                                 pooled_projection_dim=text_l.projection_dim + text_g.projection_dim),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=_clip(text_l, 2), tokenizer=CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(tmp / "l"))),
        text_encoder_2=_clip(text_g, 3),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(tmp / "g", pad_token="!"))),
        text_encoder_3=_t5(5, t5_width) if with_t5 else None,
        tokenizer_3=T5TokenizerFast(tokenizer_file=str(T5_JSON)) if with_t5 else None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd3")
    pipe, bare = _pipeline(tmp), _pipeline(tmp, with_t5=False)
    pipe.save_pretrained(tmp / "sd3")
    bare.save_pretrained(tmp / "sd3-no-t5")
    return (pipe, Engine.load(tmp / "sd3", precision="exact"), bare, Engine.load(tmp / "sd3-no-t5", precision="exact"),
            tmp)


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(im, dtype=np.int16) for im in images])


def _reference(pipe, **kw) -> np.ndarray:
    out = pipe(height=SIZE, width=SIZE, output_type="np", **kw).images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def test_folder_opens_as_sd35_medium(models):
    _, engine, _, bare, tmp = models
    spec = engine.spec
    assert spec.family == "sd3.5-medium" and spec.denoiser == "transformer" and spec.unet is None
    assert spec.text_encoders == ("text_encoder", "text_encoder_2", "text_encoder_3")
    assert spec.text.pad_token_id == 49407 and spec.text2.pad_token_id == 0   # <|endoftext|> and "!"
    assert spec.vae.shift_factor == pytest.approx(0.0609) and spec.vae.scaling_factor == pytest.approx(1.5305)
    assert spec.default_size == SIZE and engine.family.prediction_type == "flow"
    assert bare.spec.text3 is None and bare.spec.text_encoders == ("text_encoder", "text_encoder_2")
    ckpt = open_model(tmp / "sd3")
    assert set(ckpt.sources) == {"text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"}
    assert not ckpt.problems()


@pytest.mark.parametrize("negative", ["", NEGATIVE], ids=["empty-negative", "negative"])
def test_text_to_image_matches_diffusers(models, negative):
    pipe, engine, _, _, _ = models
    expected = _reference(pipe, prompt=PROMPT, negative_prompt=negative, num_inference_steps=4, guidance_scale=5.0,
                          num_images_per_prompt=2, generator=[torch.Generator().manual_seed(s) for s in (7, 8)])
    got = engine.generate(Request(prompt=PROMPT, negative_prompt=negative, steps=4, cfg_scale=5.0, sampler="euler",
                                  seed=7, batch_size=2))
    diff = np.abs(_pixels(got.images) - expected).max()
    assert diff <= MAX_PIXEL_DIFF, f"{diff}/255"
    assert expected.std() > 20   # contrast enough for the bar to mean something


def test_without_t5_matches_diffusers_and_warns(models):
    _, _, bare_pipe, bare, _ = models
    expected = _reference(bare_pipe, prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=3,
                          guidance_scale=4.0, generator=torch.Generator().manual_seed(3))
    got = bare.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, cfg_scale=4.0, sampler="euler",
                                seed=3))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF
    assert any("without T5" in w for w in got.warnings), got.warnings


def test_the_shift_of_the_scheduler_is_followed(models, tmp_path):
    """A folder whose scheduler says shift 1.0 samples other noise levels than the default 3.0, as diffusers does."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe, engine, _, _, tmp = models
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    try:
        pipe.save_pretrained(tmp_path / "shift1")
        expected = _reference(pipe, prompt=PROMPT, num_inference_steps=3, guidance_scale=1.0,
                              generator=torch.Generator().manual_seed(1))
    finally:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    other = Engine.load(tmp_path / "shift1", precision="exact")
    got = other.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, sampler="euler", seed=1))
    default = engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, sampler="euler", seed=1))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF
    assert np.abs(_pixels(default.images) - expected).max() > MAX_PIXEL_DIFF   # the shift matters


def test_image_to_image_matches_diffusers(models):
    from diffusers import StableDiffusion3Img2ImgPipeline
    from PIL import Image

    pipe, engine, _, _, _ = models
    img2img = StableDiffusion3Img2ImgPipeline(**pipe.components)
    img2img.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    source = Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    out = img2img(prompt=PROMPT, negative_prompt=NEGATIVE, image=source, strength=0.6, num_inference_steps=5,
                  guidance_scale=4.0, generator=torch.Generator().manual_seed(9), output_type="np").images
    expected = np.round(np.clip(out, 0, 1) * 255).astype(np.int16)
    got = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, init_image=source, strength=0.6, steps=5,
                                  cfg_scale=4.0, sampler="euler", seed=9))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF


@pytest.mark.parametrize("upscaler", ["Latent", "Latent (bicubic antialiased)", "Lanczos"])
def test_hires_fix_matches_the_diffusers_composition(models, upscaler):
    """The hires fix on SD3 (sdlite.hires states the rule): StableDiffusion3Pipeline's first pass, the upscale (of
    its latents, or of its images by the named upscaler), then StableDiffusion3Img2ImgPipeline at the denoising
    strength with each image's seed; batch 2, 64 -> 128 px."""
    from diffusers import StableDiffusion3Img2ImgPipeline

    from sdlite.hires import LATENT_MODES, Hires
    from sdlite.upscalers.registry import upscale_to

    pipe, engine, _, _, _ = models
    img2img = StableDiffusion3Img2ImgPipeline(**pipe.components)
    img2img.set_progress_bar_config(disable=True)
    seeds = lambda: [torch.Generator().manual_seed(s) for s in (3, 4)]   # noqa: E731
    common = dict(prompt=[PROMPT] * 2, negative_prompt=[NEGATIVE] * 2, guidance_scale=4.0)
    big = 2 * SIZE
    if upscaler in LATENT_MODES:
        latents = pipe(**common, height=SIZE, width=SIZE, num_inference_steps=4, generator=seeds(),
                       output_type="latent").images
        mode, antialias = LATENT_MODES[upscaler]
        image = torch.nn.functional.interpolate(latents, size=(big // 8, big // 8), mode=mode, antialias=antialias)
    else:
        small = pipe(**common, height=SIZE, width=SIZE, num_inference_steps=4, generator=seeds(),
                     output_type="pil").images
        image = [upscale_to(im, upscaler, big, big) for im in small]
    out = img2img(**common, image=image, strength=0.6, num_inference_steps=4, generator=seeds(), height=big,
                  width=big, output_type="np").images
    expected = np.round(np.clip(out, 0, 1) * 255).astype(np.int16)
    got = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, width=SIZE, height=SIZE, steps=4,
                                  cfg_scale=4.0, sampler="euler", seed=3, batch_size=2,
                                  hires=Hires(scale=2, upscaler=upscaler, denoise=0.6)))
    assert [im.size for im in got.images] == [(big, big)] * 2
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF
    assert got.infotext["Hires upscaler"] == upscaler


def test_skip_layer_guidance_matches_diffusers(models):
    """SD3.5's skip-layer guidance: diffusers' skip_guidance_layers with its start/stop window over the steps."""
    pipe, engine, _, _, _ = models
    kw = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=5, guidance_scale=4.0,
              generator=torch.Generator().manual_seed(12))
    expected = _reference(pipe, skip_guidance_layers=[1], skip_layer_guidance_scale=2.0,
                          skip_layer_guidance_start=0.1, skip_layer_guidance_stop=0.7, **kw)
    plain = _reference(pipe, **kw)
    got = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=5, cfg_scale=4.0, sampler="euler",
                                  seed=12, slg_layers=(1,), slg_scale=2.0, slg_start=0.1, slg_stop=0.7))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF
    assert np.abs(plain - expected).max() > 8   # the skipped block matters
    with pytest.raises(RequestError, match="not blocks of this transformer"):
        engine.generate(Request(prompt=PROMPT, steps=2, cfg_scale=4.0, seed=1, slg_layers=(3,)))
    with pytest.raises(RequestError, match="cfg scale above 1"):
        engine.generate(Request(prompt=PROMPT, steps=2, cfg_scale=1.0, seed=1, slg_layers=(1,)))


def test_low_memory_mode_gives_the_same_images(models):
    """Memory mode 0 streams the transformer (block by block) and T5 from the files: the same images as mode 1."""
    _, engine, _, _, tmp = models
    low = Engine.load(tmp / "sd3", precision="exact", memory_mode=0)
    r = Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=2, cfg_scale=4.0, sampler="euler", seed=5)
    assert np.array_equal(_pixels(low.generate(r).images), _pixels(engine.generate(r).images))
    assert low.models.resident() == ["transformer"] or low.models.resident() == []


def test_inpainting_matches_diffusers(models):
    """Inpainting with the SD3 transformer (16 input channels): the unmasked region re-imposed after each step, as
    StableDiffusion3InpaintPipeline does. That pipeline decodes its latents without the VAE's shift factor (0.0609),
    unlike diffusers' SD3 text-to-image and img2img pipelines; sdlite decodes every SD3 latent one way, so the final
    latents are compared, and the image against diffusers' latents decoded as its other SD3 pipelines decode."""
    from diffusers import StableDiffusion3InpaintPipeline

    pipe, engine, _, _, _ = models
    inpaint = StableDiffusion3InpaintPipeline(**pipe.components)
    inpaint.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(1)
    source = Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    mask = Image.new("L", (SIZE, SIZE), 0)
    mask.paste(255, (16, 16, 48, 48))
    latents = inpaint(prompt=PROMPT, negative_prompt=NEGATIVE, image=source, mask_image=mask, strength=0.8,
                      num_inference_steps=5, guidance_scale=4.0, height=SIZE, width=SIZE,
                      generator=torch.Generator().manual_seed(4), output_type="latent").images
    got = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, init_image=source, mask=mask, strength=0.8,
                                  steps=5, cfg_scale=4.0, sampler="euler", seed=4, mask_blur=0, overlay=False))
    assert (got.latents - latents).abs().max() < 1e-4 * latents.abs().max()
    with torch.no_grad():
        decoded = pipe.vae.decode(latents / VAE.scaling_factor + VAE.shift_factor).sample
    expected = np.round(np.clip(pipe.image_processor.postprocess(decoded, output_type="np"), 0, 1) * 255)
    assert np.abs(_pixels(got.images) - expected.astype(np.int16)).max() <= MAX_PIXEL_DIFF
    # the unmasked region is the source's (through the VAE), not what the model drew there
    drawn = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=5, cfg_scale=4.0, sampler="euler",
                                    seed=4))
    outside = np.ones((SIZE, SIZE), bool)
    outside[16:48, 16:48] = False
    assert np.abs(_pixels(got.images)[0][outside] - _pixels(drawn.images)[0][outside]).mean() > 8


def test_int8_weights(models):
    """--precision int8: the MMDiT's block Linears (and T5's) kept in int8 per output channel, dequantised as they run
    (tests/test_lowbit_precision.py has the rest); the image stays near exact's: measured 32.7 dB with bf16 compute,
    where the bf16 precision alone gives 35.0 dB on this tiny model."""
    from sdlite.engine.lowbit import LowBitLinear

    _, engine, _, _, _ = models
    r = Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, cfg_scale=4.0, sampler="euler", seed=2)
    low = Engine.load(engine.models.ckpt.path, precision="int8")
    got, want = _pixels(low.generate(r).images), _pixels(engine.generate(r).images)
    mse = np.mean((got.astype(np.float64) - want) ** 2)
    assert 0 < mse and 10 * np.log10(255 ** 2 / mse) > 28
    with low.models.use("transformer") as transformer:
        assert sum(isinstance(m, LowBitLinear) for m in transformer.modules()) > 20


def test_what_sd3_refuses(models):
    _, engine, _, _, _ = models
    with pytest.raises(SDLiteError, match="'ddim' does not run on a flow-matching model.*euler"):
        engine.generate(Request(prompt=PROMPT, steps=2, sampler="ddim", seed=1))
    with pytest.raises(RequestError, match="ControlNet for SD3"):
        engine.generate(Request(prompt=PROMPT, steps=2, sampler="euler", seed=1,
                                controls=(ControlUnit(image=Image.new("RGB", (SIZE, SIZE)), model="any"),)))
    with pytest.raises(SDLiteError, match="quantizes a UNet's layers.*weight-only int8 and int4"):
        Engine.load(engine.models.ckpt.path, precision="int8-bf16")
    from sdlite.engine.precision import resolve
    from sdlite.engine.cpu import bf16_int8_problem
    # auto runs the transformer's block Linears in int8 where this CPU can (native bf16, VNNI or AMX)
    assert (resolve("auto", spec=engine.spec).name == "bf16-int8") == (bf16_int8_problem() is None)
    with pytest.raises(SDLiteError, match="flow matching"):
        open_model(engine.models.ckpt.path, prediction_type="epsilon")
    with pytest.raises(RequestError, match="ControlNet"):
        engine.generate(Request(prompt=PROMPT, steps=2, seed=1, init_image=Image.new("RGB", (SIZE, SIZE)),
                                controls=(ControlUnit(model="any"),)))


@pytest.mark.parametrize("name", ["sd3-medium", "sd3.5-medium", "sd3.5-large"])
def test_full_size_networks_have_the_published_keys_and_shapes(name):
    """Every network of a released SD3 model, built from sdlite's preset on the meta device, has the keys and shapes of
    the diffusers / transformers class built from the published config (no weights: the meta device)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from sdlite.config.sd3 import SD3_PRESETS
    from sdlite.loader import build_network, model_components

    spec = SD3_PRESETS[name]
    assert model_components(spec) == ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae")

    def clip(cfg):
        d = {k: v for k, v in cfg.to_diffusers().items() if k not in ("architectures", "model_type", "torch_dtype")}
        return CLIPTextModelWithProjection(CLIPTextConfig(**d))

    vae = {k: v for k, v in spec.vae.to_diffusers().items() if k != "_class_name"}
    transformer = {k: v for k, v in spec.transformer.to_diffusers().items() if k != "_class_name"}
    with torch.device("meta"):
        references = {
            "text_encoder": clip(spec.text), "text_encoder_2": clip(spec.text2),
            "text_encoder_3": T5EncoderModel(T5Config(**spec.text3.to_transformers())),
            "transformer": SD3Transformer2DModel(**transformer), "vae": AutoencoderKL(**vae),
        }
        for component, reference in references.items():
            ours = {k: tuple(v.shape) for k, v in build_network(component, spec).state_dict().items()}
            theirs = {k: tuple(v.shape) for k, v in reference.state_dict().items()
                      if not k.endswith("position_ids") and k != "encoder.embed_tokens.weight"}
            assert ours == theirs, component


def test_the_a1111_server_lists_switches_and_runs_sd3(models, tmp_path):
    """`sdlite serve` over a models folder holding the SD3 folder and the demo model: listed, switched to, and its
    txt2img (A1111 sampler names) the image the engine gives."""
    import base64
    import io

    from fastapi.testclient import TestClient

    from sdlite.demo import model_path
    from sdlite.server.app import create_app
    from tests.loopback import wait_for

    _, engine, _, _, tmp = models
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "sd35").symlink_to(tmp / "sd3", target_is_directory=True)
    (folder / "demo").symlink_to(model_path(), target_is_directory=True)
    api = "/sdapi/v1"
    with TestClient(create_app(models_dir=folder, engine_options={"precision": "exact"})) as c:
        wait_for(lambda: c.get(f"{api}/progress").json()["state"]["job_count"] == 0, timeout=120, every=0.1)
        assert sorted(m["model_name"] for m in c.get(f"{api}/sd-models").json()) == ["demo", "sd35"]
        assert c.post(f"{api}/options", json={"sd_model_checkpoint": "sd35"}).json() == {}
        r = c.post(f"{api}/txt2img", json={"prompt": PROMPT, "negative_prompt": NEGATIVE, "steps": 3, "seed": 8,
                                           "cfg_scale": 4.0, "sampler_name": "Euler", "width": SIZE, "height": SIZE})
        assert r.status_code == 200, r.text
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))).convert("RGB"), np.int16)
        expected = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, seed=8, cfg_scale=4.0,
                                           sampler="euler", width=SIZE, height=SIZE))
        assert np.array_equal(got, _pixels(expected.images)[0])
        refused = c.post(f"{api}/txt2img", json={"prompt": PROMPT, "steps": 2, "sampler_name": "DDIM"})
        assert refused.status_code == 422 and "flow-matching" in refused.text, refused.text


def test_large_turbo_is_told_by_its_name_and_gets_its_defaults(models, tmp_path):
    """SD3.5 Large Turbo has Large's network and scheduler; only the name it is published under tells it apart.
    Under that name it gets its model card's settings (4 steps, no guidance) where the command line gives none,
    and `sdlite info` says Turbo; the same folder under another name is Large, with Large's defaults."""
    import argparse

    from sdlite.cli.generate import _resolve_turbo_defaults
    from sdlite.families import family_for
    from sdlite.families.describe import family_name

    pipe = models[0]
    large = _transformer(6, dual_attention_layers=())   # qk norm without dual attention: SD3.5 Large's kind
    pipe_large = type(pipe)(**{**pipe.components, "transformer": large})
    pipe_large.save_pretrained(tmp_path / "stable-diffusion-3.5-large-turbo")
    (tmp_path / "my-large").symlink_to(tmp_path / "stable-diffusion-3.5-large-turbo", target_is_directory=True)
    for name, turbo, defaults in (("stable-diffusion-3.5-large-turbo", True, (4, 1.0)), ("my-large", False, (28, 3.5))):
        spec = open_model(tmp_path / name).spec
        assert (spec.family, spec.turbo) == ("sd3.5-large", turbo)
        assert ("Turbo" in family_name(spec)) == turbo
        args = argparse.Namespace(model=str(tmp_path / name), steps=None, cfg=None, sampler=None,
                                  timestep_spacing=None, turbo=False, prediction_type=None, text_encoder=None)
        _resolve_turbo_defaults(args)
        assert (args.steps, args.cfg, args.sampler) == (*defaults, "euler")
        assert family_for(spec).sampling_defaults["steps"] == defaults[0]
