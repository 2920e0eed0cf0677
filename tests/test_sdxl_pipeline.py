"""SDXL end to end against diffusers' StableDiffusionXLPipeline on tiny random models saved as diffusers folders: the
two text encoders (penultimate states concatenated, pooled embedding of the second, its "!" padding), the size/crop
time ids, zero negative conditioning when no negative prompt is given, the refiner's aesthetic-score ids and the
base-to-refiner hand-off of diffusers' documented two-pipeline recipe, and the Turbo settings."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sdlite.config import TextEncoderConfig, UNetConfig, VAEConfig
from sdlite.loader import open_model
from sdlite.pipeline import Engine, Request, RequestError
from tests.reference import (diffusers_unet, diffusers_vae, seed_all, use_scheduler, with_contrast,
                             write_hf_tokenizer_files)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_PIXEL_DIFF = 2   # /255, the bar
SIZE = 64            # 8x8 latents

# CLIP ViT-L and OpenCLIP bigG in small, with the real vocabulary so that real prompts tokenize
TEXT_L = TextEncoderConfig(width=32, layers=3, heads=4, mlp_width=37, projection_dim=32)
TEXT_G = TextEncoderConfig(width=40, layers=3, heads=4, mlp_width=64, activation="gelu", pad_token_id=0,
                           eos_token_id=2, projection_dim=24)
TIME_DIM = 8
UNET_BASE = UNetConfig(block_channels=(32, 64), layers_per_block=1, attention=(False, True), heads=(2, 4),
                       context_dim=32 + 40, linear_projection=True, transformer_depth=(1, 2),
                       addition_embed="text_time", addition_time_embed_dim=TIME_DIM, add_embed_in=24 + 6 * TIME_DIM,
                       sample_size=8)
UNET_REFINER = UNetConfig(block_channels=(32, 64), layers_per_block=1, attention=(True, True), heads=(4, 4),
                          context_dim=40, linear_projection=True, transformer_depth=2, addition_embed="text_time",
                          addition_time_embed_dim=TIME_DIM, add_embed_in=24 + 5 * TIME_DIM, sample_size=8)
VAE = VAEConfig(block_channels=(32, 64, 64, 64), layers_per_block=1, scaling_factor=0.13025, sample_size=SIZE)
SDXL_SCHEDULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                      steps_offset=1, timestep_spacing="leading", interpolation_type="linear",
                      prediction_type="epsilon", use_karras_sigmas=False)
PROMPT, NEGATIVE = "a red circle on a blue background", "green, blurry"


def _text(cfg: TextEncoderConfig, projection: bool, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    d = cfg.to_diffusers()
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return seed_all(cls(CLIPTextConfig(**d, attn_implementation="eager")).eval(), seed, scale=0.2)


def _sensitive(unet, gain: float = 3.0):
    """Strengthen the cross-attention and the added conditioning of a tiny random UNet, so that its output depends
    on the conditioning clearly (at seed_all's small scale it hardly does, and a test could not tell a zero
    negative conditioning from an encoded one)."""
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if (".attn2.to_v." in name or ".attn2.to_out." in name or name.startswith("add_embedding.")
                    or ".time_emb_proj." in name):
                p.mul_(gain)
    return unet


def _pipelines(tmp):
    """(base, refiner): tiny StableDiffusionXLPipeline and StableDiffusionXLImg2ImgPipeline sharing the VAE and the
    second text encoder, as the real refiner shares them."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    torch.manual_seed(0)
    tok = CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(tmp / "tok_l")))
    tok_2 = CLIPTokenizer.from_pretrained(str(write_hf_tokenizer_files(tmp / "tok_g", pad_token="!")))
    text, text_2 = _text(TEXT_L, False, 2), _text(TEXT_G, True, 3)
    vae = with_contrast(SimpleNamespace(vae=seed_all(diffusers_vae(VAE), 1, scale=0.05))).vae
    base = StableDiffusionXLPipeline(vae=vae, text_encoder=text, text_encoder_2=text_2, tokenizer=tok,
                                     tokenizer_2=tok_2, unet=_sensitive(seed_all(diffusers_unet(UNET_BASE), 4, scale=0.05)),
                                     scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER),
                                     force_zeros_for_empty_prompt=True)
    refiner = StableDiffusionXLImg2ImgPipeline(vae=vae, text_encoder=None, text_encoder_2=text_2, tokenizer=None,
                                               tokenizer_2=tok_2,
                                               unet=_sensitive(seed_all(diffusers_unet(UNET_REFINER), 5, scale=0.05)),
                                               scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER),
                                               requires_aesthetics_score=True, force_zeros_for_empty_prompt=False)
    for pipe in (base, refiner):
        pipe.set_progress_bar_config(disable=True)
    return base, refiner


def saved_pipelines(tmp, folder=None):
    """:func:`_pipelines`, saved by diffusers as the folders ``base`` and ``refiner`` in ``folder`` (default ``tmp``)."""
    base, refiner = _pipelines(tmp)
    folder = tmp if folder is None else folder
    base.save_pretrained(folder / "base")
    refiner.save_pretrained(folder / "refiner")
    return base, refiner


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sdxl")
    base, refiner = saved_pipelines(tmp)
    engine, ref_engine = Engine.load(tmp / "base", precision="exact"), Engine.load(tmp / "refiner", precision="exact")
    return base, refiner, engine, ref_engine, tmp


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(im, dtype=np.int16) for im in images])


# what a condition must change to count as tested: the final latents' max difference relative to their largest
# value (the tiny random model's images show only part of it), 100 times what fp32 parity leaves (about 1e-5 here)
MIN_CHANGE = 1e-3


def _change(a, b) -> float:
    change = ((a.latents - b.latents).abs().max() / b.latents.abs().max()).item()
    print(f"latents differ by {change:.4f}")
    return change


def _reference(pipe, **kw) -> np.ndarray:
    out = pipe(height=SIZE, width=SIZE, output_type="np", **kw).images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def test_folders_open_as_sdxl(models):
    _, _, engine, ref_engine, tmp = models
    spec = engine.spec
    assert spec.family == "sdxl" and spec.is_sdxl and spec.text_encoders == ("text_encoder", "text_encoder_2")
    assert spec.force_zeros_for_empty_prompt and not spec.requires_aesthetics_score
    assert spec.text2.pad_token_id == 0 and spec.text.pad_token_id == 49407   # "!" and <|endoftext|>
    assert spec.vae.scaling_factor == pytest.approx(0.13025) and spec.default_size == SIZE
    rspec = ref_engine.spec
    assert rspec.family == "sdxl-refiner" and rspec.text is None and rspec.text_encoders == ("text_encoder_2",)
    assert rspec.requires_aesthetics_score and not rspec.force_zeros_for_empty_prompt
    ckpt = open_model(tmp / "base")
    assert set(ckpt.sources) == {"text_encoder", "text_encoder_2", "unet", "vae"} and not ckpt.problems()


@pytest.mark.parametrize("sampler", ["euler", "euler_a", "dpmpp_2m_karras"])
@pytest.mark.parametrize("negative", [None, NEGATIVE], ids=["zeros", "encoded"])
def test_text_to_image_matches_diffusers(models, sampler, negative):
    base, _, engine, _, _ = models
    use_scheduler(base, sampler)
    expected = _reference(base, prompt=PROMPT, negative_prompt=negative, num_inference_steps=4, guidance_scale=6.0,
                          generator=torch.Generator().manual_seed(11))
    got = engine.generate(Request(prompt=PROMPT, negative_prompt=negative or "", steps=4, cfg_scale=6.0,
                                  sampler=sampler, seed=11))
    diff = np.abs(_pixels(got.images) - expected).max()
    assert diff <= MAX_PIXEL_DIFF, f"{sampler}: {diff}/255"
    assert expected.std() > 20          # the images have contrast enough for the bar to mean something


def test_zero_negative_is_not_the_encoded_empty_prompt(models):
    """With force_zeros_for_empty_prompt, "no negative prompt" is zeros, which differs from encoding "" (what a
    negative prompt of a single space gives in diffusers)."""
    base, _, engine, _, _ = models
    use_scheduler(base, "euler")
    encoded_empty = _reference(base, prompt=PROMPT, negative_prompt=" ", num_inference_steps=3, guidance_scale=6.0,
                               generator=torch.Generator().manual_seed(2))
    zeros = engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=6.0, sampler="euler", seed=2))
    space = engine.generate(Request(prompt=PROMPT, negative_prompt=" ", steps=3, cfg_scale=6.0, sampler="euler",
                                    seed=2))
    assert np.abs(_pixels(space.images) - encoded_empty).max() <= MAX_PIXEL_DIFF
    assert _change(zeros, space) > MIN_CHANGE


def test_size_conditioning_matches_diffusers(models):
    base, _, engine, _, _ = models
    use_scheduler(base, "euler")
    kw = dict(original_size=(1024, 768), crops_coords_top_left=(16, 32), target_size=(512, 512))
    expected = _reference(base, prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=3, guidance_scale=5.0,
                          generator=torch.Generator().manual_seed(5), **kw)
    got = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, cfg_scale=5.0, sampler="euler",
                                  seed=5, **kw))
    plain = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, cfg_scale=5.0,
                                    sampler="euler", seed=5))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF
    assert _change(plain, got) > MIN_CHANGE   # the ids matter


def test_clip_skip_matches_diffusers(models):
    """Our clip skip 2 is diffusers' clip_skip=1 (one layer before SDXL's penultimate). diffusers applies it to the
    prompt only, never to a negative prompt (A1111 and sdlite: to both), so the comparison has no negative prompt."""
    base, _, engine, _, _ = models
    use_scheduler(base, "euler")
    expected = _reference(base, prompt=PROMPT, num_inference_steps=3, guidance_scale=5.0, clip_skip=1,
                          generator=torch.Generator().manual_seed(5))
    got = engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=5.0, sampler="euler", seed=5, clip_skip=2))
    plain = engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=5.0, sampler="euler", seed=5))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF
    assert _change(plain, got) > MIN_CHANGE


def test_base_to_refiner_hand_off_matches_the_two_pipeline_recipe(models):
    """diffusers' documented recipe: the base with denoising_end and output_type="latent", the refiner with
    denoising_start on those latents. The switch is at 0.5 here: the last steps at small noise levels hardly depend
    on which model runs them, and the test would not show that the refiner ran."""
    base, refiner, engine, ref_engine, _ = models
    use_scheduler(base, "euler")
    use_scheduler(refiner, "euler")
    latents = base(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=10, guidance_scale=5.0,
                   denoising_end=0.5, output_type="latent", height=SIZE, width=SIZE,
                   generator=torch.Generator().manual_seed(3)).images
    expected = _reference(refiner, prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=10,
                          guidance_scale=5.0, denoising_start=0.5, image=latents,
                          generator=torch.Generator().manual_seed(3))
    engine.set_refiner(ref_engine)
    try:
        steps = []
        got = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=10, cfg_scale=5.0,
                                      sampler="euler", seed=3, refiner_switch_at=0.5),
                              callback=lambda i, n: steps.append((i, n)))
        alone = engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=10, cfg_scale=5.0,
                                        sampler="euler", seed=3))
    finally:
        engine.set_refiner(None)
    assert steps == [(i, 10) for i in range(1, 11)]
    for switch, base_steps in ((0.5, 5), (0.85, 8), (0.9, 9)):   # timesteps 901, 801 .. 1 (leading); 0.85: >= 150
        assert engine.refiner_switch_step(Request(prompt="", steps=10, sampler="euler",
                                                  refiner_switch_at=switch)) == base_steps
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF
    assert _change(alone, got) > MIN_CHANGE


def test_refiner_alone_as_image_to_image_matches_diffusers(models, tmp_path):
    _, refiner, _, ref_engine, _ = models
    use_scheduler(refiner, "euler")
    from PIL import Image

    rng = np.random.default_rng(0)
    source = Image.fromarray(rng.integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8))
    expected = _reference(refiner, prompt=PROMPT, image=source, strength=0.5, num_inference_steps=6,
                          guidance_scale=5.0, aesthetic_score=7.0, negative_aesthetic_score=2.0,
                          generator=torch.Generator().manual_seed(9))
    got = ref_engine.generate(Request(prompt=PROMPT, init_image=source, strength=0.5, steps=6, cfg_scale=5.0,
                                      sampler="euler", seed=9, aesthetic_score=7.0, negative_aesthetic_score=2.0))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF


def test_turbo_settings_match_diffusers(models):
    """SDXL-Turbo as diffusers runs it: Euler a with trailing spacing, one step, no guidance."""
    base, _, engine, _, _ = models
    use_scheduler(base, "euler_a", spacing="trailing")
    expected = _reference(base, prompt=PROMPT, num_inference_steps=1, guidance_scale=0.0,
                          generator=torch.Generator().manual_seed(4))
    got = engine.generate(Request(prompt=PROMPT, steps=1, cfg_scale=1.0, sampler="euler_a", seed=4,
                                  timestep_spacing="trailing"))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF


def test_sdxl_request_errors_name_the_value(models):
    _, _, engine, _, _ = models
    with pytest.raises(RequestError, match="needs a refiner"):
        engine.generate(Request(prompt="x", steps=2, refiner_switch_at=0.8))
    with pytest.raises(RequestError, match="refiner switch 1.5"):
        engine.generate(Request(prompt="x", steps=2, refiner_switch_at=1.5))
    with pytest.raises(RequestError, match=r"original_size \(0, 64\)"):
        engine.generate(Request(prompt="x", steps=2, original_size=(0, 64)))
    with pytest.raises(RequestError, match="clip skip 3 .* 1..2 are valid"):
        engine.generate(Request(prompt="x", steps=2, clip_skip=3))


def test_cli_refiner_and_info(models, tmp_path, capsys):
    """`sdlite generate --refiner --refiner-switch` gives the engine's hand-off image and records the refiner in the
    PNG parameters; `sdlite info` lists both text encoders."""
    from sdlite.cli import main
    from sdlite.images import parse_infotext, read_parameters

    _, _, engine, ref_engine, tmp = models
    out = tmp_path / "r.png"
    assert main(["generate", PROMPT, "--model", str(tmp / "base"), "--refiner", str(tmp / "refiner"),
                 "--refiner-switch", "0.5", "--steps", "4", "--sampler", "euler", "--cfg", "5", "--seed", "7",
                 "--precision", "exact", "-o", str(out)]) == 0
    params = parse_infotext(read_parameters(out))
    assert params["Refiner switch at"] == "0.5" and params["Refiner"].startswith("refiner [")
    engine.set_refiner(ref_engine)
    try:
        expected = engine.generate(Request(prompt=PROMPT, steps=4, sampler="euler", cfg_scale=5.0, seed=7,
                                           refiner_switch_at=0.5))
    finally:
        engine.set_refiner(None)
    from PIL import Image

    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(expected.images[0]))
    capsys.readouterr()
    assert main(["info", str(tmp / "base")]) == 0
    text = capsys.readouterr().out
    assert "family:      sdxl (Stable Diffusion XL)" in text and "text_encoder_2" in text
    assert "zeros when no negative prompt is given" in text and "OpenCLIP" not in text.split("text_encoder_2")[0]


def test_cli_turbo_defaults(models, tmp_path, capsys):
    """A folder whose scheduler says trailing (as SDXL-Turbo's does) is recognised as Turbo: `sdlite generate`
    then runs its settings (1 step, cfg 1, Euler a, trailing) unless told otherwise; --turbo does it for any model."""
    import json
    import shutil

    from sdlite.cli import main
    from sdlite.images import parse_infotext, read_parameters

    _, _, _, _, tmp = models
    turbo = tmp_path / "turbo"
    shutil.copytree(tmp / "base", turbo)
    sched = turbo / "scheduler" / "scheduler_config.json"
    cfg = json.loads(sched.read_text())
    sched.write_text(json.dumps({**cfg, "_class_name": "EulerAncestralDiscreteScheduler",
                                 "timestep_spacing": "trailing"}))
    assert open_model(turbo).spec.turbo and not open_model(tmp / "base").spec.turbo
    for model, extra in ((turbo, []), (tmp / "base", ["--turbo"])):
        out = tmp_path / f"{model.name}.png"
        assert main(["generate", PROMPT, "--model", str(model), "--seed", "3", "-o", str(out), *extra]) == 0
        params = parse_infotext(read_parameters(out))
        assert (params["Steps"], params["CFG scale"], params["Sampler"]) == ("1", "1", "Euler a")
    assert main(["generate", PROMPT, "--model", str(turbo), "--seed", "3", "--steps", "2", "-o",
                 str(tmp_path / "two.png")]) == 0
    assert parse_infotext(read_parameters(tmp_path / "two.png"))["Steps"] == "2"
    capsys.readouterr()
    assert main(["info", str(turbo)]) == 0
    assert "Turbo (distilled" in capsys.readouterr().out


def test_sd_turbo_settings_match_diffusers(tmp_path):
    """SD-Turbo is SD 2.1's architecture distilled: its folder's scheduler (Euler, trailing) makes it Turbo, and one
    step without guidance matches diffusers' StableDiffusionPipeline run the same way."""
    import json

    from tests.reference import diffusers_pipeline, saved_pipeline

    pipe = with_contrast(diffusers_pipeline("sd2", tmp_path))
    use_scheduler(pipe, "euler", spacing="trailing")
    pipe = saved_pipeline(pipe, tmp_path / "sd-turbo")
    pipe.set_progress_bar_config(disable=True)
    assert json.loads((tmp_path / "sd-turbo" / "scheduler" / "scheduler_config.json").read_text())[
        "timestep_spacing"] == "trailing"
    engine = Engine.load(tmp_path / "sd-turbo", precision="exact")
    assert engine.spec.turbo and engine.spec.family == "sd2" and not engine.spec.is_sdxl
    size = engine.spec.default_size
    expected = pipe(PROMPT, num_inference_steps=1, guidance_scale=0.0, generator=torch.Generator().manual_seed(6),
                    height=size, width=size, output_type="np").images
    expected = np.round(np.clip(expected, 0, 1) * 255).astype(np.int16)
    got = engine.generate(Request(prompt=PROMPT, steps=1, cfg_scale=1.0, sampler="euler", seed=6))
    assert np.abs(_pixels(got.images) - expected).max() <= MAX_PIXEL_DIFF


def test_cheap_preview_uses_sdxl_coefficients(models):
    """The instant preview maps SDXL's latent channels with SDXL's coefficients (A1111's "Approx cheap" for SDXL)."""
    _, _, engine, _, _ = models
    latents = torch.zeros(1, 4, 2, 2)
    latents[:, 0] = 1.0
    pixel = np.asarray(engine.preview(latents)[0])[0, 0]
    # channel 0 maps to RGB (0.3448, 0.4168, 0.4395), in [-1, 1]: ((v + 1) / 2 * 255) rounded
    assert pixel.tolist() == [171, 181, 184]


def _fp16_copy(folder, dest):
    """The folder with every weight file stored in fp16, as SDXL's released files are."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    for file in dest.glob("*/*.safetensors"):
        save_file({k: v.half() if v.is_floating_point() else v for k, v in load_file(file).items()}, file)
    return dest


@pytest.mark.parametrize("mode", [0, 2])
def test_memory_modes_and_fp16_default(models, tmp_path, mode):
    """Memory modes 0 (UNet and both text encoders streamed from the file) and 2 give mode 1's image bit for bit;
    an fp16 SDXL folder is kept in fp16 and computed in fp32 by default on the CPU, exactly as --weight-dtype fp16
    does."""
    _, _, _, _, tmp = models
    request = Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, cfg_scale=5.0, sampler="euler", seed=1)
    # plain fp32 weights in mode 1 too (prepacked ones run other kernels, with other rounding)
    resident = Engine.load(tmp / "base", prepack=False, precision="exact").generate(request)
    other = Engine.load(tmp / "base", memory_mode=mode, prepack=False, precision="exact").generate(request)
    assert torch.equal(other.latents, resident.latents)
    if mode == 0:
        half = _fp16_copy(tmp / "base", tmp_path / "fp16")
        default = Engine.load(half, precision="exact")
        assert default.models.weight_dtype == torch.float16 and default.models.dtype == torch.float32
        explicit = Engine.load(half, weight_dtype=torch.float16, prepack=False, precision="exact")
        got = default.generate(request)
        assert torch.equal(got.latents, explicit.generate(request).latents)
        assert np.abs(_pixels(got.images) - _pixels(resident.images)).max() <= 3   # fp16 rounding of the weights
