"""The SD x4 upscaler (sdlite.upscalers.x4) against diffusers' StableDiffusionUpscalePipeline, same weights, same seed.

* A tiny model of the x4 architecture (7 input channels, a noise-level class embedding, cross-only attention at a
  middle level, a 3-level VAE), built by diffusers from config with random weights and saved as a folder: our whole
  upscale from that folder against the pipeline's, with the model's own scheduler (DDIM) and with Euler a (whose
  per-step draws come after the image noise and the latent). The same weights as an original-layout single file (no
  metadata, as Stability publishes x4-upscaler-ema.safetensors) give the same image.
* The published architecture at full size (random weights shared by both sides, no copies), at a 16x16 input.
* The errors a caller can meet.

Every comparison is of 8-bit images, precision "exact".
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.config import (PUBLISHED_SCHEDULERS, SD_X4_UPSCALER, X4_FAMILY, X4_LOW_RES_SCHEDULER,
                           TextEncoderConfig, UNetConfig, VAEConfig)
from sdlite.errors import CheckpointError
from sdlite.pipeline import StopSampling
from sdlite.upscalers.x4 import MAX_INPUT_PIXELS, X4Error, X4Upscaler
from tests.reference import (diffusers_unet, diffusers_vae, seed_all, transformers_text, with_contrast,
                             write_hf_tokenizer_files)

PROMPT = "a red circle on a blue square"
# the family's conventions, so that the single file (shapes only) reads the same model: 8 UNet heads at every
# level, 64-wide text heads
TINY_UNET = UNetConfig(in_channels=7, block_channels=(32, 32, 64), layers_per_block=1, attention=(False, True, True),
                       heads=(8, 8, 8), context_dim=64, linear_projection=True, num_class_embeds=1000,
                       cross_only=(False, True, False), sample_size=16)
TINY_TEXT = TextEncoderConfig(width=64, layers=2, heads=1, mlp_width=96, activation="gelu", pad_token_id=0,
                              projection_dim=64)
TINY_VAE = VAEConfig(block_channels=(32, 32, 64), layers_per_block=1, scaling_factor=0.08333, sample_size=64)


@pytest.fixture(autouse=True)
def _threads(request):
    """The tiny models run on one torch thread, as conftest's one_torch_thread explains (a second thread's spin-waits
    cost seconds on a busy machine); the full-size tests (marked slow) use them all."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _schedulers():
    from diffusers import DDIMScheduler, DDPMScheduler

    main = {k: v for k, v in PUBLISHED_SCHEDULERS[X4_FAMILY][1].items() if k != "_class_name"}
    low = {k: v for k, v in X4_LOW_RES_SCHEDULER.items() if k != "_class_name"}
    return DDIMScheduler.from_config(main), DDPMScheduler.from_config(low)


def _pipeline(vae, text, unet, tok_dir):
    from diffusers import StableDiffusionUpscalePipeline
    from transformers import CLIPTokenizer

    scheduler, low = _schedulers()
    pipe = StableDiffusionUpscalePipeline(vae=vae, text_encoder=text, tokenizer=CLIPTokenizer.from_pretrained(
        str(tok_dir)), unet=unet, low_res_scheduler=low, scheduler=scheduler, max_noise_level=350)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _input(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth random RGB image (noise, blurred by a bilinear upsampling), as a photo's pixels vary."""
    g = np.random.default_rng(seed)
    small = Image.fromarray(g.integers(0, 256, (height // 4 + 1, width // 4 + 1, 3), dtype=np.uint8))
    return small.resize((width, height), Image.Resampling.BILINEAR)


def _diff(a: Image.Image, b: Image.Image) -> int:
    assert a.size == b.size
    return int(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, reference pipeline loaded from it): the tiny x4 model saved by diffusers."""
    from diffusers import StableDiffusionUpscalePipeline

    root = tmp_path_factory.mktemp("x4")
    torch.manual_seed(0)
    pipe = _pipeline(seed_all(diffusers_vae(TINY_VAE), 1, 0.05), seed_all(transformers_text(TINY_TEXT), 2, 0.2),
                     seed_all(diffusers_unet(TINY_UNET), 0, 0.2), write_hf_tokenizer_files(root / "tok", "!"))
    with_contrast(pipe)
    folder = root / "x4"
    pipe.save_pretrained(folder)
    ref = StableDiffusionUpscalePipeline.from_pretrained(folder, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    return folder, ref


@pytest.fixture(scope="module")
def tiny_upscaler(tiny):
    up = X4Upscaler.load(tiny[0], precision="exact")
    yield up
    up.close()


# --- the tiny model ---------------------------------------------------------------------------------------------

def test_folder_is_read_as_the_x4_upscaler(tiny, tiny_upscaler):
    spec = tiny_upscaler.spec
    assert spec.family == X4_FAMILY and spec.is_x4_upscaler
    assert spec.unet == TINY_UNET and spec.vae == TINY_VAE
    assert spec.prediction_type == "v_prediction"
    assert spec.max_noise_level == 350
    assert spec.low_res_scheduler["_class_name"] == "DDPMScheduler"
    assert spec.low_res_scheduler["beta_start"] == 0.0001 and spec.low_res_scheduler["beta_end"] == 0.02
    assert spec.scheduler["_class_name"] == "DDIMScheduler" and spec.scheduler["timestep_spacing"] == "leading"
    assert tiny_upscaler.precision.name == "exact"


@pytest.mark.parametrize("sampler,steps", [(None, 8), ("euler_a", 6)], ids=["scheduler-ddim", "euler_a"])
def test_tiny_matches_diffusers(tiny, tiny_upscaler, sampler, steps):
    import diffusers

    _, ref = tiny
    image = _input(24, 16)
    base = ref.scheduler
    if sampler == "euler_a":
        ref.scheduler = diffusers.EulerAncestralDiscreteScheduler.from_config(base.config)
    try:
        expected = ref(prompt=PROMPT, image=image, num_inference_steps=steps,
                       generator=torch.Generator().manual_seed(7)).images[0]
    finally:
        ref.scheduler = base
    got = tiny_upscaler.upscale(image, prompt=PROMPT, steps=steps, sampler=sampler, seed=7)
    assert got.size == expected.size == (96, 64)
    assert got.seed == 7 and got.sampler == (sampler or "ddim") and got.precision == "exact"
    assert np.asarray(expected).std() > 30   # an image with contrast, where a wrong step would show
    diff = _diff(got.images[0], expected)
    print(f"tiny x4 upscaler, {got.sampler}: max pixel difference {diff}/255")
    assert diff <= 1


def test_noise_level_negative_prompt_and_guidance_are_diffusers(tiny, tiny_upscaler):
    """Another noise level (its class label and the image's noise), a negative prompt, no guidance: still the
    pipeline's image, and each visibly changes it (the UNet's weights are large enough for its inputs to matter)."""
    _, ref = tiny
    image = _input(16, 16, seed=1)
    plain = tiny_upscaler.upscale(image, prompt=PROMPT, steps=4, seed=3).images[0]
    for kwargs in ({"noise_level": 150}, {"negative_prompt": "green"}, {"cfg_scale": 1.0}):
        expected = ref(prompt=PROMPT, image=image, num_inference_steps=4,
                       generator=torch.Generator().manual_seed(3),
                       **{{"cfg_scale": "guidance_scale"}.get(k, k): v for k, v in kwargs.items()}).images[0]
        got = tiny_upscaler.upscale(image, prompt=PROMPT, steps=4, seed=3, **kwargs).images[0]
        assert _diff(got, expected) <= 1, kwargs
        assert _diff(got, plain) > 2, kwargs


def test_single_file_in_the_original_layout(tiny, tiny_upscaler, tmp_path):
    """The tiny model written as Stability writes x4-upscaler-ema.safetensors (label_emb.weight, OpenCLIP's fused
    attention with one block more than is used, no metadata) reads back as the same model."""
    from safetensors.torch import save_file

    from sdlite.weights.convert import plan_to_original

    from sdlite.loader import open_model

    with open_model(tiny[0]) as ckpt:
        states = {name: {k: v.clone() for k, v in ckpt.load(name).state_dict().items()}
                  for name in ("unet", "vae", "text_encoder")}
    plan = plan_to_original({name: list(sd) for name, sd in states.items()}, text_encoder="openclip",
                            unet_structure=TINY_UNET, vae_levels=3)
    merged = plan.merge(states)
    tensors = {k: merged[k].contiguous().clone() for k in merged}
    assert "model.diffusion_model.label_emb.weight" in tensors
    last = f"cond_stage_model.model.transformer.resblocks.{TINY_TEXT.layers - 1}."
    for key in [k for k in tensors if k.startswith(last)]:   # OpenCLIP's last block, which SD 2.x never reads
        tensors[key.replace(f"resblocks.{TINY_TEXT.layers - 1}.", f"resblocks.{TINY_TEXT.layers}.")] = \
            tensors[key].clone()
    # the noise augmentation's schedule buffers and the LDM wrapper's own, which the file carries and nothing reads
    betas = torch.linspace(0.0001 ** 0.5, 0.02 ** 0.5, 1000) ** 2
    tensors.update({"low_scale_model.betas": betas, "low_scale_model.alphas_cumprod": torch.cumprod(1 - betas, 0),
                    "betas": betas.clone()})
    path = tmp_path / "x4-upscaler-tiny.safetensors"
    save_file(tensors, path)
    up = X4Upscaler.load(path, precision="exact")
    try:
        assert up.spec.family == X4_FAMILY
        # shapes do not show the sample sizes: the published model's are taken
        assert dataclasses.replace(up.spec.unet, sample_size=TINY_UNET.sample_size) == TINY_UNET
        assert dataclasses.replace(up.spec.vae, sample_size=TINY_VAE.sample_size) == TINY_VAE
        assert up.spec.text.layers == TINY_TEXT.layers
        assert up.spec.prediction_type == "v_prediction" and up.spec.max_noise_level == 350
        assert not [n for n in up.engine.models.ckpt.notes if "outside the known components" in n]
        image = _input(16, 16, seed=2)
        got = up.upscale(image, prompt=PROMPT, steps=4, seed=5).images[0]
        expected = tiny_upscaler.upscale(image, prompt=PROMPT, steps=4, seed=5).images[0]
        assert _diff(got, expected) == 0
    finally:
        up.close()


def test_folder_details(tiny, tmp_path):
    """A folder without low_res_scheduler gets the published one; a VAE config without the 0.08333 factor gets it
    (as diffusers enforces), with a note; a max_noise_level the schedule cannot reach is refused."""
    from sdlite.loader import open_model

    src, _ = tiny
    folder = tmp_path / "x4"
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns("low_res_scheduler"))
    vae_cfg = json.loads((folder / "vae" / "config.json").read_text())
    del vae_cfg["scaling_factor"]
    (folder / "vae" / "config.json").write_text(json.dumps(vae_cfg))
    ckpt = open_model(folder)
    try:
        assert ckpt.spec.low_res_scheduler == X4_LOW_RES_SCHEDULER
        assert ckpt.spec.vae.scaling_factor == 0.08333
        assert any("low_res_scheduler" in n for n in ckpt.notes) and any("0.08333" in n for n in ckpt.notes)
    finally:
        ckpt.close()
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "max_noise_level": 1000}))
    with pytest.raises(CheckpointError, match="max_noise_level 1000"):
        open_model(folder)
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(CheckpointError, match="StableDiffusionPipeline but the UNet is an x4 upscaler's"):
        open_model(folder)


# --- errors -----------------------------------------------------------------------------------------------------

def test_errors_name_what_is_wrong(tiny_upscaler, tmp_path):
    up = tiny_upscaler
    image = _input(16, 16)
    big = Image.new("RGB", (520, 520))
    assert 520 * 520 > MAX_INPUT_PIXELS
    with pytest.raises(X4Error, match=r"input image 520x520 .* cap .* 2080x2080"):
        up.upscale(big)
    with pytest.raises(X4Error, match="too small"):
        up.upscale(Image.new("RGB", (6, 30)))
    with pytest.raises(X4Error, match="input image .*missing.png"):
        up.upscale(tmp_path / "missing.png")
    for level in (351, -1, 2.5, True):
        with pytest.raises(X4Error, match=r"noise level .* 0 to 350"):
            up.upscale(image, noise_level=level)
    with pytest.raises(X4Error, match="steps=0"):
        up.upscale(image, steps=0)
    with pytest.raises(X4Error, match="cfg scale 31"):
        up.upscale(image, cfg_scale=31)
    with pytest.raises(X4Error, match="seed -2"):
        up.upscale(image, seed=-2)
    with pytest.raises(X4Error, match="unknown sampler 'nope'"):
        up.upscale(image, sampler="nope")
    with pytest.raises(X4Error, match="prompt"):
        up.upscale(image, prompt=None)
    # not an x4 upscaler: the shipped demo (an SD 1.x model)
    from pathlib import Path

    import sdlite

    with pytest.raises(CheckpointError, match="sd1 model, not the SD x4 upscaler"):
        X4Upscaler.load(Path(sdlite.__file__).parent / "data" / "demo")
    with pytest.raises(ValueError, match="precision 'fast'"):
        X4Upscaler.load(tmp_path, precision="fast")


def test_odd_sizes_seed_and_interrupt(tiny, tiny_upscaler):
    up = tiny_upscaler
    odd = up.upscale(_input(18, 21), steps=2, seed=1)
    assert odd.size == odd.images[0].size == (64, 80)
    assert any("resized to 16x20" in w for w in odd.warnings)
    expected = tiny[1](prompt="", image=_input(18, 21), num_inference_steps=2,
                       generator=torch.Generator().manual_seed(1)).images[0]
    assert _diff(odd.images[0], expected) <= 1   # diffusers' image processor rounds the sides down the same way
    random_seed = up.upscale(_input(16, 16), steps=1)
    assert 0 <= random_seed.seed and random_seed.parameters()["Seed"] == random_seed.seed
    seen = []

    def stop(step, total):
        seen.append((step, total))
        if step == 2:
            raise StopSampling

    stopped = up.upscale(_input(16, 16), steps=5, seed=1, callback=stop)
    assert stopped.interrupted and seen == [(1, 5), (2, 5)] and stopped.images[0].size == (64, 64)


def test_tiled_decode_and_precisions(tiny, tiny_upscaler):
    """A large output is decoded in tiles (equal to the untiled decode up to fp32 rounding); auto resolves as for any
    model (exact for a UNet this small); bf16, where this CPU runs it, stays close to exact."""
    import warnings

    from sdlite.engine.precision import PrecisionError, resolve

    up = tiny_upscaler
    image = _input(40, 32, seed=4)
    whole = up.upscale(image, prompt=PROMPT, steps=2, seed=1).images[0]
    up.engine.vae_tile = 4   # latent pixels: the 40x32 latent in 10x8 = 80 tiles a layer
    try:
        tiled = up.upscale(image, prompt=PROMPT, steps=2, seed=1).images[0]
    finally:
        up.engine.vae_tile = None
    assert whole.size == (160, 128) and _diff(tiled, whole) <= 1
    auto = X4Upscaler.load(tiny[0])
    assert auto.precision.name == resolve("auto", "cpu", spec=auto.spec).name == "exact"
    auto.close()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bf16 = X4Upscaler.load(tiny[0], precision="bf16")
    except PrecisionError as e:
        pytest.skip(f"bf16 does not run here: {e}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = bf16.upscale(image, prompt=PROMPT, steps=2, seed=1)
        a, b = (np.asarray(im, dtype=np.float64) for im in (whole, got.images[0]))
        psnr = 10 * np.log10(255**2 / ((a - b) ** 2).mean())
        print(f"tiny x4 upscaler, bf16 against exact: {psnr:.1f} dB")
        assert got.precision == "bf16" and psnr > 30
    finally:
        bf16.close()


def test_detection_refuses_other_class_conditioned_unets():
    from sdlite.models.unet import UNet
    from sdlite.weights.detect import UnsupportedModelError, describe, detect

    with torch.device("meta"):
        unet = UNet(UNetConfig(in_channels=4, block_channels=(32, 64), layers_per_block=1, attention=(True, True),
                               heads=(2, 2), context_dim=32, num_class_embeds=10))
    shapes = {k: tuple(v.shape) for k, v in unet.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=r"10 class embeddings .* 4 input channels .* x4 upscaler"):
        detect({"unet": shapes})
    assert "unCLIP" in describe([*shapes, "class_embedding.linear_1.weight"])


# --- full size ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    """(our upscaler, diffusers' pipeline) at the published x4 architecture, every weight tensor shared between the
    two (seeded windows of random pools, tests.test_sdxl_fullsize.pooled_weights: about 0.6 GB instead of 3.5 GB)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from torch import nn
    from transformers import CLIPTextConfig, CLIPTextModel

    from sdlite.config import explicit_spacing
    from sdlite.loader import StableDiffusion
    from sdlite.models.clip import CLIPTextEncoder
    from sdlite.models.unet import UNet
    from sdlite.models.vae import AutoencoderKL as OurVAE
    from sdlite.tokenizers.clip_bpe import CLIPTokenizer
    from tests.test_sdxl_fullsize import pooled_weights

    spec = SD_X4_UPSCALER
    text_cfg = spec.text.to_diffusers()
    for k in ("architectures", "model_type", "torch_dtype"):
        text_cfg.pop(k)
    with torch.device("meta"):
        refs = {"unet": UNet2DConditionModel(**{k: v for k, v in spec.unet.to_diffusers().items()
                                                 if k != "_class_name"}),
                "vae": AutoencoderKL(**{k: v for k, v in spec.vae.to_diffusers().items() if k != "_class_name"}),
                "text_encoder": CLIPTextModel(CLIPTextConfig(**text_cfg, attn_implementation="eager"))}
        ours = {"unet": UNet(spec.unet), "vae": OurVAE(spec.vae), "text_encoder": CLIPTextEncoder(spec.text)}
    for i, (name, ref) in enumerate(refs.items()):
        norms = {n for n, m in ref.named_modules() if isinstance(m, (nn.GroupNorm, nn.LayerNorm))}
        state = {k: v for k, v in ref.state_dict().items() if not k.endswith("position_ids")}
        ref.load_state_dict(pooled_weights(state, norms, seed=i), strict=False, assign=True)
        for buffer, value in list(ref.named_buffers()):   # transformers' position ids, left on the meta device
            if value.is_meta:
                assert buffer.endswith("position_ids"), buffer
                owner, _, leaf = buffer.rpartition(".")
                ref.get_submodule(owner).register_buffer(leaf, torch.arange(value.shape[-1]).expand(value.shape),
                                                         persistent=False)
        state = {k: v for k, v in ref.state_dict().items() if not k.endswith("position_ids")}
        if name == "text_encoder":   # transformers 5 drops the text_model. prefix that folders (and we) have
            state = {k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in state.items()}
        ours[name].load_state_dict(state, strict=True, assign=True)
        ref.eval().requires_grad_(False)
        ours[name].eval().requires_grad_(False)
    # the decoder's last layer scaled up, so that the output spans the 8-bit range (a fresh tensor: the pools'
    # windows overlap)
    conv_out = nn.Parameter(refs["vae"].decoder.conv_out.weight * 30.0, requires_grad=False)
    refs["vae"].decoder.conv_out.weight = conv_out
    ours["vae"].decoder.conv_out.weight = conv_out
    pipe = _pipeline(refs["vae"], refs["text_encoder"], refs["unet"],
                     write_hf_tokenizer_files(tmp_path_factory.mktemp("x4full") / "tok", "!"))
    model = StableDiffusion(spec=spec, tokenizer=CLIPTokenizer.from_package(pad_token_id=0),
                            text_encoder=ours["text_encoder"], unet=ours["unet"], vae=ours["vae"],
                            scheduler_config=explicit_spacing(spec.scheduler)[0])
    return X4Upscaler(model), pipe


@pytest.mark.slow
def test_full_size_single_file_is_detected_from_its_shapes():
    """x4-upscaler-ema.safetensors' keys and shapes (the published architecture written in the original layout, on
    the meta device: nothing is allocated) detected as the x4 upscaler with the published configs."""
    from sdlite.loader import build_network
    from sdlite.weights.convert import plan_to_original
    from sdlite.weights.detect import detect

    spec = SD_X4_UPSCALER
    with torch.device("meta"):
        states = {name: build_network(name, spec).state_dict() for name in ("unet", "vae", "text_encoder")}
        plan = plan_to_original({name: list(sd) for name, sd in states.items()}, text_encoder="openclip",
                                unet_structure=spec.unet, vae_levels=3)
        merged = plan.merge(states)
        shapes = {k: tuple(merged[k].shape) for k in merged}
    last = f"cond_stage_model.model.transformer.resblocks.{spec.text.layers - 1}."
    shapes.update({k.replace(last, last.replace(str(spec.text.layers - 1), str(spec.text.layers))): v
                   for k, v in shapes.items() if k.startswith(last)})   # the 24th block, unused
    assert shapes["model.diffusion_model.label_emb.weight"] == (1000, 1024)
    found = detect(shapes)
    assert found.family == X4_FAMILY and found.layout == "original"
    assert dataclasses.replace(spec.unet, **found.unet.config_kwargs()) == spec.unet
    assert dataclasses.replace(spec.vae, **found.vae.config_kwargs()) == spec.vae
    assert found.text_encoder.layers == spec.text.layers == 23 and found.text_encoder.width == 1024


@pytest.mark.slow
def test_full_size_shares_weights(full_size):
    up, pipe = full_size
    ours = up.engine.models.get("unet").state_dict()
    theirs = pipe.unet.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].data_ptr() == theirs[k].data_ptr() for k in ours)
    n = sum(p.numel() for p in pipe.unet.parameters())
    assert 473e6 < n < 474e6, n   # stabilityai/stable-diffusion-x4-upscaler's unet: 473.3M


@pytest.mark.slow
def test_full_size_matches_diffusers(full_size):
    up, pipe = full_size
    image = _input(16, 16, seed=3)
    expected = pipe(prompt=PROMPT, image=image, num_inference_steps=3,
                    generator=torch.Generator().manual_seed(11)).images[0]
    got = up.upscale(image, prompt=PROMPT, steps=3, seed=11)
    assert got.size == (64, 64) and got.sampler == "ddim"
    assert np.asarray(expected).std() > 20
    diff = _diff(got.images[0], expected)
    print(f"full-size x4 upscaler, 3 DDIM steps: max pixel difference {diff}/255; ours {got.timings}")
    assert diff <= 2


# --- the command line, the hires fix's upscaler, and generate's refusal -------------------------------------------

def test_cli_upscale_with_the_x4_model(tiny, tmp_path, capsys):
    from sdlite.cli import main
    from sdlite.images import read_parameters

    folder, ref = tiny
    source = tmp_path / "in.png"
    _input(16, 12, seed=3).save(source)
    assert main(["upscale", str(source), "--model", str(folder), "--prompt", "a cat", "--seed", "5", "--steps", "3",
                 "--precision", "exact", "-o", str(tmp_path / "out.png")]) == 0
    out = Image.open(tmp_path / "out.png")
    assert out.size == (64, 48)
    expected = ref(prompt="a cat", image=_input(16, 12, seed=3), num_inference_steps=3, guidance_scale=9.0,
                   noise_level=20, generator=torch.Generator().manual_seed(5)).images[0]
    assert _diff(out.convert("RGB"), expected) <= 1
    text = read_parameters(tmp_path / "out.png")
    assert "Postprocess upscaler: SD x4 (x4)" in text and "x4 Seed: 5" in text and "seed 5" in capsys.readouterr().err


def test_generate_on_the_x4_model_points_to_upscale(tiny):
    from sdlite.pipeline import Engine, Request, RequestError

    with pytest.raises(RequestError, match="sdlite upscale IMAGE --model PATH"):
        Engine.load(tiny[0], precision="exact").generate(Request("a cat", width=32, height=32, steps=2))


def test_x4_folder_as_a_named_upscaler(tiny, tmp_path):
    """An x4 upscaler folder in the upscaler folder is listed by its name and upscales (seed 0, its defaults) as
    X4Upscaler does; A1111's rule then resizes to the target."""
    from sdlite.upscalers import registry

    folder, _ = tiny
    (tmp_path / "x4-up").symlink_to(folder, target_is_directory=True)
    assert "x4-up" in [u["name"] for u in registry.listing(tmp_path)]
    source = _input(16, 12, seed=4)
    got = registry.upscale_to(source, "x4-up", 64, 48, folder=tmp_path)
    expected = X4Upscaler.load(folder).upscale(source, seed=0).image
    assert got.size == (64, 48) and _diff(got, expected) == 0
