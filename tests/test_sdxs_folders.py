"""IDKiro's SDXS diffusers folders: ``vae/`` is an ``AutoencoderTiny`` (the tiny decoder SDXS was trained with, which
diffusers' StableDiffusionPipeline loads as the pipeline's ``vae``) and ``vae_large/`` the full ``AutoencoderKL``.

A tiny SDXS-shaped folder is written by diffusers (``save_pretrained`` of a pipeline whose vae is an AutoencoderTiny,
the AutoencoderKL saved beside it as ``vae_large`` and listed in model_index.json) and run as SDXS recommends it:
one Euler step on trailing timesteps, no guidance (diffusers' guidance_scale 0, sdlite's --cfg 1). sdlite decodes
with the AutoencoderTiny by default and gives diffusers' image on that folder; ``--vae-decoder vae`` gives
diffusers' image with ``vae=vae_large``. A folder with only the AutoencoderTiny also runs, its image-to-image sources
encoded by the tiny encoder, as diffusers does.
"""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sdlite.cli import main
from sdlite.errors import CheckpointError
from sdlite.images import parse_infotext, read_parameters
from sdlite.loader import open_model
from sdlite.config import VAEConfig
from tests.reference import diffusers_vae, seed_all, with_contrast
from tests.test_generate import PROMPT, max_pixel_diff
from tests.test_small_unets import VARIANTS, _sd_pipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZE, SEED = 64, 11
VAE_8X = VAEConfig(block_channels=(32, 32, 32, 32), layers_per_block=1, sample_size=SIZE)   # 8x, as TAESD's


def _to_uint8(images) -> np.ndarray:
    return (images * 255).round().astype(np.uint8)


def _reference(folder, vae=None, steps: int = 1):
    """diffusers' StableDiffusionPipeline on ``folder`` (``vae``: instead of the folder's own), as SDXS's card runs
    it: trailing timesteps (from the folder's scheduler config), no guidance."""
    from diffusers import StableDiffusionPipeline

    extra = {} if vae is None else {"vae": vae}
    pipe = StableDiffusionPipeline.from_pretrained(folder, dtype=torch.float32, local_files_only=True,
                                                   safety_checker=None, requires_safety_checker=False, **extra)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=PROMPT, num_inference_steps=steps, guidance_scale=0.0, height=SIZE, width=SIZE,
               generator=torch.Generator().manual_seed(SEED), output_type="np").images
    return _to_uint8(out)


@pytest.fixture(scope="module")
def sdxs(tmp_path_factory):
    """(the SDXS-shaped folder, the same without vae_large/)."""
    from diffusers import AutoencoderTiny, EulerDiscreteScheduler

    tmp = tmp_path_factory.mktemp("sdxs")
    pipe = _sd_pipeline(VARIANTS["sdxs-512-dreamshaper"], tmp)
    large = with_contrast(SimpleNamespace(vae=seed_all(diffusers_vae(VAE_8X), 1, scale=0.05))).vae
    tiny = seed_all(AutoencoderTiny(), seed=4, scale=0.05)
    with torch.no_grad():   # images that span the 8-bit range (as tests.reference.with_contrast does for the KL)
        tiny.decoder.layers[-1].weight.mul_(30.0)
    pipe.vae = tiny
    pipe.register_modules(vae=tiny)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")
    folder = tmp / "sdxs"
    pipe.save_pretrained(folder)
    large.save_pretrained(folder / "vae_large")
    index = json.loads((folder / "model_index.json").read_text())
    index["vae_large"] = ["diffusers", "AutoencoderKL"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    only_tiny = tmp / "sdxs-tiny-only"
    shutil.copytree(folder, only_tiny, ignore=shutil.ignore_patterns("vae_large"))
    del index["vae_large"]
    (only_tiny / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder, only_tiny


def _generate(model, out, *extra):
    argv = ["generate", PROMPT, "--model", str(model), "--steps", "1", "--cfg", "1", "--sampler", "euler",
            "--seed", str(SEED), "--width", str(SIZE), "--height", str(SIZE), "--precision", "exact",
            "--output", str(out), *extra]
    assert main(argv) == 0
    from PIL import Image

    return np.asarray(Image.open(out).convert("RGB"))[None], parse_infotext(read_parameters(out))


def test_opens_with_the_kl_vae_and_the_tiny_decoder(sdxs):
    folder, only_tiny = sdxs
    with open_model(folder) as ckpt:
        assert ckpt.tiny_vae == str(folder / "vae") and ckpt.has_vae
        assert ckpt.sources["vae"].files[0].startswith(str(folder / "vae_large"))
        assert "vae" in ckpt.components and not ckpt.problems()
        assert ckpt.spec.vae.scaling_factor == 0.18215 and ckpt.spec.vae.block_channels == (32, 32, 32, 32)
    with open_model(only_tiny) as ckpt:
        assert ckpt.tiny_vae == str(only_tiny / "vae") and not ckpt.has_vae
        assert "vae" not in ckpt.components and not ckpt.problems()


def test_default_decoder_is_the_tiny_one_as_in_diffusers(sdxs, tmp_path):
    folder, only_tiny = sdxs
    expected = _reference(folder)
    for model in (folder, only_tiny):
        got, params = _generate(model, tmp_path / f"{model.name}.png")
        assert max_pixel_diff(got, expected) <= 2, model.name
        assert params["VAE decoder"] == "vae (AutoencoderTiny)"


def test_full_vae_on_request_is_diffusers_with_vae_large(sdxs, tmp_path, capsys):
    from diffusers import AutoencoderKL

    folder, only_tiny = sdxs
    expected = _reference(folder, vae=AutoencoderKL.from_pretrained(folder / "vae_large"))
    got, params = _generate(folder, tmp_path / "kl.png", "--vae-decoder", "vae")
    assert max_pixel_diff(got, expected) <= 2
    assert "VAE decoder" not in params
    assert max_pixel_diff(got, _reference(folder)) > 10     # the two decoders do differ
    argv = ["generate", PROMPT, "--model", str(only_tiny), "--steps", "1", "--cfg", "1", "--sampler", "euler",
            "--vae-decoder", "vae", "--output", str(tmp_path / "none.png")]
    capsys.readouterr()
    assert main(argv) == 2
    assert "has no full VAE" in capsys.readouterr().err and not (tmp_path / "none.png").exists()


def test_tiny_only_img2img_encodes_with_the_tiny_encoder_as_diffusers(sdxs, tmp_path):
    from diffusers import StableDiffusionImg2ImgPipeline
    from PIL import Image

    _, only_tiny = sdxs
    g = np.random.default_rng(5)
    source = Image.fromarray(g.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    source.save(tmp_path / "source.png")
    pipe = StableDiffusionImg2ImgPipeline.from_pretrained(only_tiny, dtype=torch.float32, local_files_only=True,
                                                          safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    expected = _to_uint8(pipe(prompt=PROMPT, image=source, strength=0.5, num_inference_steps=2, guidance_scale=0.0,
                              generator=torch.Generator().manual_seed(SEED), output_type="np").images)
    got, _ = _generate(only_tiny, tmp_path / "i2i.png", "--init-image", str(tmp_path / "source.png"),
                       "--strength", "0.5", "--steps", "2")
    assert max_pixel_diff(got, expected) <= 2


def test_info_says_which_decoder(sdxs, capsys):
    folder, only_tiny = sdxs
    assert main(["info", str(folder)]) == 0
    assert main(["info", str(only_tiny)]) == 0
    out = capsys.readouterr().out
    assert "vae decoder: the AutoencoderTiny (TAESD) in vae/, by default; --vae-decoder vae: the AutoencoderKL in " \
           "vae_large/" in out
    assert "vae decoder: the AutoencoderTiny (TAESD) in vae/, by default; no full VAE" in out


def test_other_vae_classes_are_refused_by_name(sdxs, tmp_path):
    folder, _ = sdxs
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "vae" / "config.json").read_text())
    (bad / "vae" / "config.json").write_text(json.dumps({**config, "_class_name": "ConsistencyDecoderVAE"}))
    with pytest.raises(CheckpointError, match=r"bad[/\\]vae[/\\]config\.json: .*names the class ConsistencyDecoderVAE"):
        open_model(bad)
    (bad / "vae" / "config.json").write_text(json.dumps(config))
    large = json.loads((bad / "vae_large" / "config.json").read_text())
    (bad / "vae_large" / "config.json").write_text(json.dumps({**large, "_class_name": "AutoencoderTiny"}))
    with pytest.raises(CheckpointError, match=r"bad[/\\]vae_large[/\\]config\.json: .*names the class AutoencoderTiny"):
        open_model(bad)
