"""Qwen-Image image to image and inpainting against diffusers' QwenImageImg2ImgPipeline and QwenImageInpaintPipeline
on the tiny random model of tests/test_qwenimage_pipeline.py (the same components).

How sdlite's requests map onto diffusers' parameters:

* ``init_image`` + ``strength`` is ``image`` + ``strength``: the schedule's first ``int(steps - steps * strength)``
  steps skipped; cfg is ``true_cfg_scale`` (with a negative prompt), cfg 1 no guidance;
* the source's posterior sample is drawn once, by the first image's generator, and shared by the batch (the pipelines
  encode the one source image once, ``retrieve_latents`` sampling); each image's noise from its own generator after it;
* ``mask`` is ``mask_image``: binarised at half white, nearest-resized to the latent; the masked image is encoded too
  (a second draw from the first generator); the unmasked region put back after each step. No mask blur and no
  overlay for the comparisons (A1111's steps around the pipeline).

And the VAE's ``encode_moments``: the posterior's mean and log-variance as AutoencoderKLQwenImage gives them.

The hires fix has no diffusers reference: its second pass is checked to be this module's image to image (itself
checked against diffusers) on the first pass's upscaled images, and the latent upscaler to run and refine."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.hires import Hires
from sdlite.pipeline import Engine, Request, RequestError
from tests.test_qwenimage_pipeline import MAX_PIXEL_DIFF, NEGATIVE, PROMPT, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDTH, HEIGHT = 96, 64   # not square: rows and columns are not mixed up


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(img2img pipeline, inpaint pipeline, engine): both diffusers pipelines over one set of components."""
    from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline

    folder = tmp_path_factory.mktemp("qwenimage_edit") / "qwen-image"
    pipe = _pipeline(folder)
    img2img = QwenImageImg2ImgPipeline(**pipe.components)
    inpaint = QwenImageInpaintPipeline(**pipe.components)
    for p in (img2img, inpaint):
        p.set_progress_bar_config(disable=True)
    return img2img, inpaint, Engine.load(folder, precision="exact")


def _source(seed: int, width: int = WIDTH, height: int = HEIGHT) -> Image.Image:
    """Smooth colours with some noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    base = np.stack([x, y, 1 - x * y], axis=-1) * 200 + rng.normal(0, 25, (height, width, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def _mask(box=(16, 16, 64, 48)) -> Image.Image:
    mask = Image.new("L", (WIDTH, HEIGHT), 0)
    mask.paste(255, box)
    return mask


def _seeds(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def _np(out) -> np.ndarray:
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def _request(**kw) -> Request:
    return Request(**{"prompt": PROMPT, "sampler": "euler", "cfg_scale": 1.0, "width": WIDTH, "height": HEIGHT, **kw})


def test_encode_moments_match_autoencoderklqwenimage(model):
    img2img, _, engine = model
    image = torch.rand(2, 3, HEIGHT, WIDTH) * 2 - 1
    with torch.no_grad():
        dist = img2img.vae.encode(image[:, :, None]).latent_dist
        with engine.models.use("vae") as vae:
            mean, logvar = vae.encode_moments(image)
    assert mean.shape == logvar.shape == (2, 16, HEIGHT // 8, WIDTH // 8)
    torch.testing.assert_close(mean, dist.mean[:, :, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logvar, dist.logvar[:, :, 0], rtol=1e-4, atol=1e-5)
    assert logvar.std() > 0.01, "the log-variance should vary"


@pytest.mark.parametrize("steps,strength", [(5, 0.6), (4, 1.0)])
def test_img2img_matches_qwenimageimg2imgpipeline(model, steps, strength):
    """Batch 2 without guidance; strength 0.6 of 5 steps runs 3 (int(5 - 5 x 0.6) = 2 skipped), strength 1 all of
    them from the source noised to sigma 1."""
    img2img, _, engine = model
    source = _source(0)
    expected = _np(img2img(prompt=PROMPT, image=source, strength=strength, num_inference_steps=steps,
                           true_cfg_scale=1.0, num_images_per_prompt=2, generator=_seeds(9, 10), height=HEIGHT,
                           width=WIDTH, output_type="np").images)
    got = _pixels(engine.generate(_request(init_image=source, strength=strength, steps=steps, seed=9,
                                           batch_size=2)).images)
    assert got.shape == expected.shape == (2, HEIGHT, WIDTH, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert np.abs(got[0] - got[1]).mean() > 4, "each image has its own noise"


def test_source_is_a_sample_not_the_mean(model):
    """The pipeline samples the source's posterior: its mean (FLUX.2 klein's way) misses by more than the bar."""
    img2img, _, engine = model
    source = _source(6)
    expected = _np(img2img(prompt=PROMPT, image=source, strength=0.5, num_inference_steps=4, true_cfg_scale=1.0,
                           generator=_seeds(2), height=HEIGHT, width=WIDTH, output_type="np").images)
    request = _request(init_image=source, strength=0.5, steps=4, seed=2)
    sampled = _pixels(engine.generate(request).images)
    engine.family.source_latent = "mean"   # the instance's
    try:
        mean = _pixels(engine.generate(request).images)
    finally:
        del engine.family.source_latent
    assert np.abs(sampled - expected).max() <= MAX_PIXEL_DIFF < np.abs(mean - expected).max()


def test_img2img_with_true_cfg(model):
    img2img, _, engine = model
    source = _source(1)
    expected = _np(img2img(prompt=PROMPT, negative_prompt=NEGATIVE, image=source, strength=0.7,
                           num_inference_steps=4, true_cfg_scale=4.0, generator=_seeds(3), height=HEIGHT,
                           width=WIDTH, output_type="np").images)
    got = _pixels(engine.generate(_request(negative_prompt=NEGATIVE, init_image=source, strength=0.7, steps=4,
                                           seed=3, cfg_scale=4.0)).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


@pytest.mark.parametrize("strength", [0.8, 1.0])
def test_inpainting_matches_qwenimageinpaintpipeline(model, strength):
    _, inpaint, engine = model
    source, mask = _source(2), _mask()
    expected = _np(inpaint(prompt=PROMPT, image=source, mask_image=mask, strength=strength, num_inference_steps=4,
                           true_cfg_scale=1.0, num_images_per_prompt=2, generator=_seeds(4, 5), height=HEIGHT,
                           width=WIDTH, output_type="np").images)
    got = _pixels(engine.generate(_request(init_image=source, mask=mask, strength=strength, steps=4, seed=4,
                                           batch_size=2, mask_blur=0, overlay=False)).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    repaint = np.asarray(mask) > 0
    assert np.abs(got[0] - got[1])[repaint].mean() > 4, "each image repaints the mask with its own noise"
    assert np.abs(got[0] - got[1])[~repaint].mean() < np.abs(got[0] - got[1])[repaint].mean()


def test_img2img_size_from_the_source(model):
    """No size given: the source's, each side rounded down to a multiple of 16."""
    _, _, engine = model
    result = engine.generate(Request(prompt=PROMPT, sampler="euler", cfg_scale=1.0, steps=2, strength=0.5, seed=1,
                                     init_image=_source(5, width=100, height=70)))
    assert result.images[0].size == (96, 64)


# --- the hires fix -----------------------------------------------------------------------------------------------


def test_hires_fix_is_image_to_image_on_the_upscaled_first_pass(model):
    """Lanczos with true CFG: the first pass decoded, upscaled to 128 x 96 and image to image at the hires denoise
    and steps, each image from its own seed (its own posterior sample): two image-to-image requests on the upscaled
    images give the same pixels, to the rounding of a batch of two against one. No plain upscale of the first pass."""
    _, _, engine = model
    common = dict(negative_prompt=NEGATIVE, cfg_scale=4.0, steps=3, seed=11, width=64, height=48)
    first = engine.generate(_request(batch_size=2, **common))
    upscaled = [im.resize((128, 96), Image.Resampling.LANCZOS) for im in first.images]
    got = engine.generate(_request(batch_size=2, hires=Hires(scale=2, upscaler="Lanczos", denoise=0.7, steps=4),
                                   **common))
    assert [im.size for im in got.images] == [(128, 96)] * 2
    for i, image in enumerate(upscaled):
        alone = engine.generate(_request(**{**common, "width": None, "height": None, "steps": 4, "seed": 11 + i},
                                         init_image=image, strength=0.7))
        assert np.abs(_pixels(got.images)[i] - _pixels(alone.images)[0]).max() <= 1   # a batch of 2 against 1
    assert np.abs(_pixels(got.images) - _pixels(upscaled)).mean() > 3, "the second pass should repaint"
    assert got.infotext["Hires upscaler"] == "Lanczos" and got.infotext["Hires steps"] == 4
    assert got.infotext["Denoising strength"] == 0.7 and got.infotext["Hires upscale"] == 2


def test_hires_fix_latent_upscale_runs(model):
    """A1111's "Latent" upscaler: the target size, the second pass's steps counted as the flow schedule's
    image-to-image rule runs them, and an image that differs from the first pass's plain upscale."""
    _, _, engine = model
    steps = []
    got = engine.generate(_request(steps=3, seed=5, width=64, height=64,
                                   hires=Hires(scale=1.5, upscaler="Latent", denoise=0.6)),
                          callback=lambda step, total: steps.append((step, total)))
    assert got.images[0].size == (96, 96)
    assert steps[-1] == (5, 5)   # 3, then 3 - int(3 - 3 x 0.6) = 2 of a 3-step schedule (the pipelines' rounding)
    plain = engine.generate(_request(steps=3, seed=5, width=64, height=64)).images[0]
    upscaled = _pixels([plain.resize((96, 96), Image.Resampling.LANCZOS)])
    assert np.abs(_pixels(got.images) - upscaled).mean() > 3
    assert got.infotext.get("Hires upscaler") == "Latent"


def test_hires_target_not_a_multiple_of_16_is_refused_before_the_first_pass(model):
    _, _, engine = model
    with pytest.raises(RequestError, match=r"hires fix's target size 88x64 \(resize 88x0 of 64x48\).*Qwen-Image"):
        engine.generate(_request(steps=2, width=64, height=48, hires=Hires(resize_x=88)))
