"""FLUX.1 end to end against diffusers' FluxPipeline on tiny random models saved as diffusers folders: CLIP-L's pooled
output, T5's context over the model's token row, the transformer (double and single blocks, rotary ids, dev's guidance
embedding), flow matching with FLUX's sigmas and (dev) the resolution-dependent shift, the 16-channel VAE's shift and
scale; dev and schnell, batch 2, true CFG with a negative prompt; and what the family refuses."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import sdlite
from sdlite.config import TextEncoderConfig, VAEConfig
from sdlite.pipeline import Engine, Request, RequestError
from tests.reference import diffusers_vae, seed_all, write_hf_tokenizer_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_PIXEL_DIFF = 2   # /255, the bar
SIZE = 64            # 8x8 latents, 16 image tokens
T5_JSON = Path(sdlite.__file__).parent / "data" / "t5" / "tokenizer.json"
TEXT_L = TextEncoderConfig(width=32, layers=3, heads=4, mlp_width=37, projection_dim=32)
T5_WIDTH = 48
TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=T5_WIDTH, pooled_projection_dim=32,
                   axes_dims_rope=(4, 6, 6))
VAE = VAEConfig(latent_channels=16, block_channels=(32, 64, 64, 64), layers_per_block=1, scaling_factor=0.3611,
                shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, sample_size=SIZE)
PROMPT, NEGATIVE = "a red circle on a blue background", "green, blurry"
T5_TOKENS = {"dev": 512, "schnell": 256}


def _clip(seed: int, cfg: TextEncoderConfig = TEXT_L):
    from transformers import CLIPTextConfig, CLIPTextModel

    d = cfg.to_diffusers()
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    return seed_all(CLIPTextModel(CLIPTextConfig(**d, attn_implementation="eager")).eval(), seed, scale=0.2)


def _t5(seed: int):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=32128, d_model=T5_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    return seed_all(T5EncoderModel(cfg).eval(), seed, scale=0.2)


def _pipeline(tmp: Path, kind: str, text_l: TextEncoderConfig = TEXT_L, save: bool = True, **transformer):
    """A tiny FluxPipeline (dev: with the guidance embedding), saved as ``tmp / kind``; its CLIP tower and
    transformer may be others than this module's (a single file's tests need heads as wide as the releases')."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTokenizer, T5TokenizerFast

    from sdlite.config.flux import FLUX_DEV_SCHEDULER, FLUX_SCHNELL_SCHEDULER

    vae = seed_all(diffusers_vae(VAE), 1, scale=0.05)
    with torch.no_grad():   # contrast enough that 2/255 means something (tests.reference.with_contrast)
        vae.decoder.conv_out.weight.mul_(30.0)
    transformer = seed_all(FluxTransformer2DModel(**{**TRANSFORMER, **transformer}, guidance_embeds=kind == "dev")
                           .eval(), 4, scale=0.15)
    sched = FLUX_DEV_SCHEDULER if kind == "dev" else FLUX_SCHNELL_SCHEDULER
    pipe = FluxPipeline(
        transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**{k: v for k, v in sched.items() if not k.startswith("_")}),
        text_encoder=_clip(2, text_l), tokenizer=CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(tmp / "l"))),
        text_encoder_2=_t5(5), tokenizer_2=T5TokenizerFast(tokenizer_file=str(T5_JSON)))
    pipe.set_progress_bar_config(disable=True)
    if save:
        pipe.save_pretrained(tmp / kind)
    return pipe


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux")
    out = {}
    for kind in ("dev", "schnell"):
        pipe = _pipeline(tmp, kind)
        out[kind] = (pipe, Engine.load(tmp / kind, precision="exact"))
    out["folder"] = tmp
    return out


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(im, dtype=np.int16) for im in images])


def _reference(pipe, kind, size=SIZE, **kw) -> np.ndarray:
    out = pipe(height=size, width=size, output_type="np", max_sequence_length=T5_TOKENS[kind], **kw).images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def test_folders_open_as_dev_and_schnell(models):
    for kind in ("dev", "schnell"):
        spec = models[kind][1].spec
        assert spec.family == f"flux-{kind}" and spec.denoiser == "transformer"
        assert spec.text_encoders == ("text_encoder", "text_encoder_3")
        assert spec.vae.shift_factor == pytest.approx(0.1159) and spec.vae.scaling_factor == pytest.approx(0.3611)
        assert spec.transformer.guidance_embeds == (kind == "dev")
    assert models["dev"][1].family.sampling_defaults["steps"] == 28
    assert models["schnell"][1].family.sampling_defaults["steps"] == 4


@pytest.mark.parametrize("kind,steps,guidance,size", [("dev", 4, 3.5, 64), ("dev", 3, 5.0, 96),
                                                      ("schnell", 4, None, 64)])
def test_txt2img_matches_fluxpipeline(models, kind, steps, guidance, size):
    """Batch 2, FlowMatch Euler; dev with its guidance scale at two sizes (mu follows the token count)."""
    pipe, engine = models[kind]
    kw = {} if guidance is None else {"guidance_scale": guidance}
    expected = _reference(pipe, kind, size, prompt=PROMPT, num_inference_steps=steps, num_images_per_prompt=2,
                          generator=[torch.Generator().manual_seed(s) for s in (7, 8)], **kw)
    got = _pixels(engine.generate(Request(prompt=PROMPT, steps=steps, cfg_scale=1.0, seed=7, batch_size=2,
                                          width=size, height=size, sampler="euler", guidance=guidance)).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert got.std() > 10, "the images should not be flat"


def test_true_cfg_with_a_negative_prompt(models):
    """cfg > 1 with a negative prompt is diffusers' true CFG (true_cfg_scale, negative_prompt)."""
    pipe, engine = models["dev"]
    expected = _reference(pipe, "dev", prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0,
                          num_inference_steps=3, generator=torch.Generator().manual_seed(3))
    got = _pixels(engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, cfg_scale=4.0, seed=3,
                                          width=SIZE, height=SIZE, sampler="euler")).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


def test_refusals_name_the_problem(models):
    engine = models["schnell"][1]
    with pytest.raises(RequestError, match="multiples of 16"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=72, height=SIZE, sampler="euler"))
    with pytest.raises(RequestError, match="distilled guidance scale"):
        models["dev"][1].generate(Request(prompt=PROMPT, steps=1, width=SIZE, height=SIZE, guidance=-1.0,
                                          sampler="euler"))
    with pytest.raises(RequestError, match="clip skip has no meaning"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=SIZE, height=SIZE, clip_skip=2, sampler="euler"))
    with pytest.raises(RequestError, match="skip-layer guidance is SD3.5's"):
        engine.generate(Request(prompt=PROMPT, steps=1, width=SIZE, height=SIZE, cfg_scale=2.0, slg_layers=(1,),
                                sampler="euler"))


def _source(seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))


def test_image_to_image_matches_fluximg2imgpipeline(models):
    """dev, strength 0.6 (mu from the source's size), guidance 4; batch 2, the source encoded once with the first
    image's generator and shared by the batch, as the pipeline does."""
    from diffusers import FluxImg2ImgPipeline

    pipe, engine = models["dev"]
    img2img = FluxImg2ImgPipeline(**pipe.components)
    img2img.set_progress_bar_config(disable=True)
    source = _source(0)
    out = img2img(prompt=PROMPT, image=source, strength=0.6, num_inference_steps=5, guidance_scale=4.0, height=SIZE,
                  width=SIZE,
                  max_sequence_length=512, num_images_per_prompt=2,
                  generator=[torch.Generator().manual_seed(s) for s in (9, 10)], output_type="np").images
    expected = np.round(np.clip(out, 0, 1) * 255).astype(np.int16)
    got = engine.generate(Request(prompt=PROMPT, init_image=source, strength=0.6, steps=5, guidance=4.0,
                                  sampler="euler", seed=9, cfg_scale=1.0, batch_size=2))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF


def test_a_source_whose_sides_are_not_multiples_of_16_is_fitted_to_them(models):
    """Image to image with no size given on a 72x56 source: the source's size rounded down to multiples of 16
    (64x48) and the source resized to it: FluxImg2ImgPipeline's image at that size (it resizes a source to the size it
    is given). A size given that FLUX cannot draw is refused naming the nearest sizes."""
    from diffusers import FluxImg2ImgPipeline
    from PIL import Image

    pipe, engine = models["schnell"]
    img2img = FluxImg2ImgPipeline(**pipe.components)
    img2img.set_progress_bar_config(disable=True)
    source = Image.fromarray(np.random.default_rng(3).integers(0, 256, (56, 72, 3), dtype=np.uint8))
    out = img2img(prompt=PROMPT, image=source, strength=0.7, num_inference_steps=4, height=48, width=64,
                  max_sequence_length=256, generator=torch.Generator().manual_seed(2), output_type="np").images
    expected = np.round(np.clip(out, 0, 1) * 255).astype(np.int16)
    got = engine.generate(Request(prompt=PROMPT, init_image=source, strength=0.7, steps=4, sampler="euler", seed=2,
                                  cfg_scale=1.0))
    assert _pixels(got.images).shape == expected.shape == (1, 48, 64, 3)
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF
    with pytest.raises(RequestError, match=r"56x\(the source's\) is not: the nearest that are: 48x\(the source's\) "
                                           r"or 64x\(the source's\)"):
        engine.generate(Request(prompt=PROMPT, init_image=source, width=56, steps=2, sampler="euler"))


def test_inpainting_matches_fluxinpaintpipeline(models):
    """schnell, the unmasked region re-imposed after each step as FluxInpaintPipeline does; batch 2."""
    from diffusers import FluxInpaintPipeline
    from PIL import Image

    pipe, engine = models["schnell"]
    inpaint = FluxInpaintPipeline(**pipe.components)
    inpaint.set_progress_bar_config(disable=True)
    source = _source(1)
    mask = Image.new("L", (SIZE, SIZE), 0)
    mask.paste(255, (16, 16, 48, 48))
    out = inpaint(prompt=PROMPT, image=source, mask_image=mask, strength=0.8, num_inference_steps=4, height=SIZE,
                  width=SIZE, max_sequence_length=256, num_images_per_prompt=2,
                  generator=[torch.Generator().manual_seed(s) for s in (4, 5)], output_type="np").images
    expected = np.round(np.clip(out, 0, 1) * 255).astype(np.int16)
    got = engine.generate(Request(prompt=PROMPT, init_image=source, mask=mask, strength=0.8, steps=4,
                                  sampler="euler", seed=4, mask_blur=0, overlay=False, cfg_scale=1.0, batch_size=2))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF


def test_hires_fix_matches_the_diffusers_composition(models):
    """FluxPipeline's first pass, its latents upscaled (A1111's "Latent": bilinear), then FluxImg2ImgPipeline at the
    denoising strength with each image's seed (mu of the larger size); batch 2, 64 -> 128 px."""
    from diffusers import FluxImg2ImgPipeline, FluxPipeline

    from sdlite.hires import LATENT_MODES, Hires

    pipe, engine = models["dev"]
    img2img = FluxImg2ImgPipeline(**pipe.components)
    img2img.set_progress_bar_config(disable=True)
    seeds = lambda: [torch.Generator().manual_seed(s) for s in (3, 4)]   # noqa: E731
    common = dict(prompt=[PROMPT] * 2, guidance_scale=3.5, max_sequence_length=512)
    big = 2 * SIZE
    packed = pipe(**common, height=SIZE, width=SIZE, num_inference_steps=4, generator=seeds(),
                  output_type="latent").images
    latents = FluxPipeline._unpack_latents(packed, SIZE, SIZE, 8)   # the sampler's latents, which img2img takes
    mode, antialias = LATENT_MODES["Latent"]
    image = torch.nn.functional.interpolate(latents, size=(big // 8, big // 8), mode=mode, antialias=antialias)
    out = img2img(**common, image=image, strength=0.6, num_inference_steps=4, generator=seeds(), height=big,
                  width=big, output_type="np").images
    expected = np.round(np.clip(out, 0, 1) * 255).astype(np.int16)
    got = engine.generate(Request(prompt=PROMPT, width=SIZE, height=SIZE, steps=4, sampler="euler", seed=3,
                                  cfg_scale=1.0, batch_size=2, hires=Hires(scale=2, upscaler="Latent", denoise=0.6)))
    assert [im.size for im in got.images] == [(big, big)] * 2
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF


def test_a_zeroed_negative_is_diffusers_true_cfg_with_zero_embeddings(models):
    """ComfyUI's ConditioningZeroOut as the negative at cfg 2 (LatentRun.negative_zeroed, as the ComfyUI server's
    KSampler runs it; ModelSamplingFlux's shift for the size is FluxPipeline's mu): T5's rows and CLIP's pooled
    output of the negative are zeros, which is FluxPipeline's true CFG given zero negative embeddings. A negative of
    the encoded prompt gives another image."""
    from sdlite.families.base import latents_to_images
    from sdlite.pipeline.latents import LatentRun
    from sdlite.sampling.comfy import flux_shift

    pipe, engine = models["dev"]
    embeds, pooled, _ = pipe.encode_prompt(prompt=PROMPT, prompt_2=None, max_sequence_length=512)
    expected = _reference(pipe, "dev", prompt_embeds=embeds, pooled_prompt_embeds=pooled, true_cfg_scale=2.0,
                          negative_prompt_embeds=torch.zeros_like(embeds),
                          negative_pooled_prompt_embeds=torch.zeros_like(pooled), num_inference_steps=4,
                          generator=torch.Generator().manual_seed(3))
    r = Request(prompt=PROMPT, negative_prompt=PROMPT, steps=4, cfg_scale=2.0, sampler="euler", schedule="simple",
                seed=3)
    empty = torch.zeros(1, 16, SIZE // 8, SIZE // 8)

    def image(**zeroed):
        run = LatentRun(empty, shift=flux_shift(SIZE, SIZE), **zeroed)
        return _pixels(latents_to_images(engine.decode_scaled(engine.sample_latents(r, run).latents)))

    got = image(negative_zeroed=(0,))
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF and got.std() > 10
    assert np.abs(image() - expected).max() > 20


def test_low_memory_mode_gives_the_same_images(models):
    """Memory mode 0 streams the transformer (block by block) and T5: the same images as mode 1."""
    pipe, engine = models["dev"]
    low = Engine.load(models["folder"] / "dev", precision="exact", memory_mode=0)
    r = Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=2, cfg_scale=2.0, sampler="euler", seed=5,
                width=SIZE, height=SIZE)
    assert np.array_equal(_pixels(low.generate(r).images), _pixels(engine.generate(r).images))


def test_cli_png_parameters_and_ignored_guidance(models, tmp_path):
    """`sdlite generate` on the dev folder: the engine's image, "Distilled CFG Scale" in the PNG parameters; schnell
    ignores a guidance scale with a warning."""
    from PIL import Image

    from sdlite.cli import main
    from sdlite.images import read_parameters

    pipe, engine = models["dev"]
    out = tmp_path / "flux.png"
    main(["generate", PROMPT, "-m", str(models["folder"] / "dev"), "--steps", "3", "--guidance", "4.5",
          "--seed", "11", "--width", str(SIZE), "--height", str(SIZE), "--precision", "exact", "-o", str(out)])
    got = np.asarray(Image.open(out).convert("RGB"), np.int16)
    expected = engine.generate(Request(prompt=PROMPT, steps=3, guidance=4.5, seed=11, width=SIZE, height=SIZE,
                                       sampler="euler", cfg_scale=1.0))
    assert np.array_equal(got, _pixels(expected.images)[0])
    params = read_parameters(out)
    assert "Distilled CFG Scale: 4.5" in params and "CFG scale: 1," in params and "Steps: 3" in params
    plain = models["dev"][1].generate(Request(prompt=PROMPT, steps=1, width=SIZE, height=SIZE, seed=1,
                                              sampler="euler", cfg_scale=1.0))
    assert plain.request.guidance == 3.5
    ignored = models["schnell"][1].generate(Request(prompt=PROMPT, steps=1, width=SIZE, height=SIZE, seed=1,
                                                    guidance=3.0, sampler="euler", cfg_scale=1.0))
    assert any("has none: ignored" in w for w in ignored.warnings)


def test_info_describes_flux(models, capsys):
    from sdlite.cli import main

    main(["info", str(models["folder"] / "dev")])
    out = capsys.readouterr().out
    assert "FLUX.1 dev" in out and "FLUX transformer: 2 double and 2 single blocks" in out
    assert "guidance embedding" in out and "distilled, 3.5 by default" in out and "over 512 tokens" in out
    main(["info", str(models["folder"] / "schnell")])
    out = capsys.readouterr().out
    assert "FLUX.1 schnell" in out and "guidance embedding" not in out and "4 steps" in out


def test_the_a1111_server_runs_flux_with_forges_field(models, tmp_path):
    """`sdlite serve` over a models folder holding the dev folder: listed, switched to, its txt2img with Forge's
    distilled_cfg_scale the engine's image at that guidance, recorded in the infotext."""
    import base64
    import io
    import json

    from fastapi.testclient import TestClient
    from PIL import Image

    from sdlite.server.app import create_app
    from tests.loopback import wait_for

    engine = models["dev"][1]
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "flux-dev").symlink_to(models["folder"] / "dev", target_is_directory=True)
    api = "/sdapi/v1"
    with TestClient(create_app(models_dir=folder, engine_options={"precision": "exact"})) as c:
        wait_for(lambda: c.get(f"{api}/progress").json()["state"]["job_count"] == 0, timeout=120, every=0.1)
        assert [m["model_name"] for m in c.get(f"{api}/sd-models").json()] == ["flux-dev"]
        assert c.post(f"{api}/options", json={"sd_model_checkpoint": "flux-dev"}).json() == {}
        r = c.post(f"{api}/txt2img", json={"prompt": PROMPT, "steps": 3, "seed": 8, "cfg_scale": 1.0,
                                           "distilled_cfg_scale": 5.0, "sampler_name": "Euler", "width": SIZE,
                                           "height": SIZE})
        assert r.status_code == 200, r.text
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))).convert("RGB"), np.int16)
        expected = engine.generate(Request(prompt=PROMPT, steps=3, seed=8, cfg_scale=1.0, guidance=5.0,
                                           sampler="euler", width=SIZE, height=SIZE))
        assert np.array_equal(got, _pixels(expected.images)[0])
        assert "Distilled CFG Scale: 5" in json.loads(r.json()["info"])["infotexts"][0]
