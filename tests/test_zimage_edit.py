"""Z-Image image to image, inpainting and the hires fix, against diffusers' ZImageImg2ImgPipeline and
ZImageInpaintPipeline on the tiny random model of tests/test_zimage_pipeline.py (the same components).

How sdlite's requests map onto diffusers' parameters (A1111's names in brackets):

* ``init_image`` + ``strength`` [denoising strength] is ``image`` + ``strength``: the last steps of a ``steps``-step
  schedule, diffusers' rounding of ``steps * strength``; cfg g + 1 is diffusers' ``guidance_scale`` g;
* the source's latent sample is drawn once, by the first image's generator, and shared by the batch (the Z-Image
  pipelines encode the one source image once); each image's noise comes from its own generator after it;
* ``mask`` is ``mask_image``: binarised at half white, nearest-resized to the latent, the unmasked region put back
  after each step (the source noised to the next step's level, the clean source after the last). A1111's mask blur
  comes first (the blurred mask is what diffusers binarises), "fill" [masked content: fill] pre-fills the source's
  pixels, inpaint area "masked" [inpaint at full resolution] runs diffusers on the crop around the mask, resized to
  the request's size, and pastes it back; ``overlay`` (A1111's paste of the source outside the blurred mask) is a
  step after the pipeline, off for the comparisons.

The hires fix has no diffusers reference: its second pass is checked to be this module's image to image (itself
checked against diffusers) on the first pass's upscaled images, and the latent upscaler to run and refine."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.hires import Hires
from sdlite.pipeline import Engine, Request, RequestError
from sdlite.sources import blur_mask, fill_masked, prepare
from tests.test_zimage_pipeline import MAX_PIXEL_DIFF, NEGATIVE, PROMPT, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDTH, HEIGHT = 96, 64   # not square: rows and columns of patches are not mixed up


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(img2img pipeline, inpaint pipeline, engine): both diffusers pipelines over one set of components."""
    from diffusers import ZImageImg2ImgPipeline, ZImageInpaintPipeline

    folder = tmp_path_factory.mktemp("zimage_edit") / "z-image"
    pipe = _pipeline(folder)
    img2img = ZImageImg2ImgPipeline(**pipe.components)
    inpaint = ZImageInpaintPipeline(**pipe.components)
    for p in (img2img, inpaint):
        p.set_progress_bar_config(disable=True)
    return img2img, inpaint, Engine.load(folder, precision="exact")


def _source(seed: int, width: int = WIDTH, height: int = HEIGHT) -> Image.Image:
    """Smooth colours with some noise: a source the tiny VAE encodes to something that decodes back recognisably."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    base = np.stack([x, y, 1 - x * y], axis=-1) * 200 + rng.normal(0, 25, (height, width, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def _mask(box=(16, 16, 64, 48), width: int = WIDTH, height: int = HEIGHT) -> Image.Image:
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, box)
    return mask


def _seeds(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def _np(out) -> np.ndarray:
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def _request(**kw) -> Request:
    return Request(**{"prompt": PROMPT, "sampler": "euler", "cfg_scale": 1.0, **kw})


# --- image to image ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps,strength", [(5, 0.6), (4, 1.0)])
def test_img2img_matches_zimageimg2imgpipeline(model, steps, strength):
    """Batch 2 without guidance (the Turbo's way); strength 0.6 of 5 steps runs 4 (diffusers' rounding of
    5 x 0.6), strength 1 all of them from the source noised to sigma 1."""
    img2img, _, engine = model
    source = _source(0)
    expected = _np(img2img(prompt=PROMPT, image=source, strength=strength, num_inference_steps=steps,
                           guidance_scale=0.0, num_images_per_prompt=2, generator=_seeds(9, 10),
                           output_type="np").images)
    got = _pixels(engine.generate(_request(init_image=source, strength=strength, steps=steps, seed=9,
                                           batch_size=2)).images)
    assert got.shape == expected.shape == (2, HEIGHT, WIDTH, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert np.abs(got[0] - got[1]).mean() > 4, "each image has its own noise"


def test_img2img_with_guidance(model):
    """cfg 3 with a negative prompt is diffusers' guidance_scale 2."""
    img2img, _, engine = model
    source = _source(1)
    expected = _np(img2img(prompt=PROMPT, negative_prompt=NEGATIVE, image=source, strength=0.7,
                           num_inference_steps=4, guidance_scale=2.0, generator=_seeds(3), output_type="np").images)
    got = _pixels(engine.generate(_request(negative_prompt=NEGATIVE, init_image=source, strength=0.7, steps=4,
                                           seed=3, cfg_scale=3.0)).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


# --- inpainting --------------------------------------------------------------------------------------------------


def _inpaint_reference(inpaint, image, mask, strength, steps, seeds, **kw) -> np.ndarray:
    return _np(inpaint(prompt=PROMPT, image=image, mask_image=mask, strength=strength, num_inference_steps=steps,
                       guidance_scale=0.0, num_images_per_prompt=len(seeds), generator=_seeds(*seeds),
                       output_type="np", **kw).images)


@pytest.mark.parametrize("strength", [0.8, 1.0])
def test_inpainting_matches_zimageinpaintpipeline(model, strength):
    """Batch 2, no mask blur, no overlay: the unmasked region re-imposed after each step as the pipeline does."""
    _, inpaint, engine = model
    source, mask = _source(2), _mask()
    expected = _inpaint_reference(inpaint, source, mask, strength, 4, (4, 5))
    got = _pixels(engine.generate(_request(init_image=source, mask=mask, strength=strength, steps=4, seed=4,
                                           batch_size=2, mask_blur=0, overlay=False)).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    repaint = np.asarray(mask) > 0
    assert np.abs(got[0] - got[1])[repaint].mean() > 4, "each image repaints the mask with its own noise"


def test_inpainting_mask_blur_fill_and_guidance(model):
    """A1111's mask blur (4 px) is applied before diffusers' binarisation, "fill" pre-fills the source's pixels
    under it; cfg 2.5 is guidance_scale 1.5."""
    _, inpaint, engine = model
    source, mask = _source(3), _mask((24, 8, 80, 40))
    blurred = blur_mask(mask, 4)
    expected = _np(inpaint(prompt=PROMPT, negative_prompt=NEGATIVE, image=fill_masked(source, blurred),
                           mask_image=blurred, strength=0.9, num_inference_steps=3, guidance_scale=1.5,
                           generator=_seeds(6), output_type="np").images)
    got = _pixels(engine.generate(_request(negative_prompt=NEGATIVE, init_image=source, mask=mask, strength=0.9,
                                           steps=3, seed=6, cfg_scale=2.5, mask_blur=4, inpaint_fill="fill",
                                           overlay=False)).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


def test_inpaint_at_full_resolution(model):
    """Inpaint area "masked": diffusers on the crop around the mask (with its padding), resized to the request's
    64 x 64, pasted back into the source."""
    _, inpaint, engine = model
    source, mask = _source(4), _mask((40, 20, 60, 44))
    r = _request(init_image=source, mask=mask, strength=0.75, steps=4, seed=8, width=64, height=64, mask_blur=0,
                 inpaint_area="masked", inpaint_padding=8, overlay=False)
    prepared = prepare(r)
    assert prepared.paste_box is not None and prepared.image.size == (64, 64)
    crop = _inpaint_reference(inpaint, prepared.image, prepared.mask, 0.75, 4, (8,))[0]
    expected = np.asarray(prepared.finish(Image.fromarray(crop.astype(np.uint8)), overlay=False), np.int16)
    got = _pixels(engine.generate(r).images)[0]
    assert got.shape == (HEIGHT, WIDTH, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    x1, y1, x2, y2 = prepared.paste_box
    outside = np.ones((HEIGHT, WIDTH), bool)
    outside[y1:y2, x1:x2] = False
    assert np.array_equal(got[outside], np.asarray(source, np.int16)[outside]), "the source is kept outside the crop"


def test_latent_fills_and_overlay_run(model):
    """The fills without a diffusers counterpart ("latent noise", "latent nothing") change the start where it is
    the source noised (strength 0.6 of 3 steps runs 2, from sigma below 1; from sigma 1 it is all noise); with
    A1111's defaults (mask blur 4, overlay) the source is kept where the blurred mask is black."""
    _, _, engine = model
    source, mask = _source(5), _mask()
    common = dict(init_image=source, mask=mask, strength=0.6, steps=3, seed=2, mask_blur=0, overlay=False)
    images = {fill: _pixels(engine.generate(_request(inpaint_fill=fill, **common)).images)[0]
              for fill in ("original", "latent-noise", "latent-nothing")}
    assert np.abs(images["latent-noise"] - images["original"]).mean() > 1
    assert np.abs(images["latent-nothing"] - images["latent-noise"]).mean() > 1
    got = _pixels(engine.generate(_request(init_image=source, mask=mask, strength=0.8, steps=3, seed=2)).images)[0]
    black = np.asarray(blur_mask(mask, 4)) == 0
    assert np.array_equal(got[black], np.asarray(source, np.int16)[black])


# --- the hires fix -----------------------------------------------------------------------------------------------


def test_hires_fix_is_image_to_image_on_the_upscaled_first_pass(model):
    """Lanczos: the first pass decoded, upscaled to 128 x 96 and image to image at the hires denoise, each image
    from its own seed: two image-to-image requests on the upscaled images give the same pixels, to the rounding of a
    batch of two against one (and those are diffusers', by the tests above). The result is no plain upscale of the
    first pass."""
    _, _, engine = model
    first = engine.generate(_request(steps=3, seed=11, batch_size=2, width=64, height=48))
    upscaled = [im.resize((128, 96), Image.Resampling.LANCZOS) for im in first.images]
    got = engine.generate(_request(steps=3, seed=11, batch_size=2, width=64, height=48,
                                   hires=Hires(scale=2, upscaler="Lanczos", denoise=0.7, steps=4)))
    assert [im.size for im in got.images] == [(128, 96)] * 2
    for i, image in enumerate(upscaled):
        alone = engine.generate(_request(init_image=image, strength=0.7, steps=4, seed=11 + i))
        assert np.abs(_pixels(got.images)[i] - _pixels(alone.images)[0]).max() <= 1   # a batch of 2 against 1
    assert np.abs(_pixels(got.images) - _pixels(upscaled)).mean() > 3, "the second pass should repaint"
    assert got.infotext["Hires upscaler"] == "Lanczos" and got.infotext["Hires steps"] == 4


def test_hires_fix_latent_upscale_runs(model):
    """A1111's "Latent" upscaler (the sampler's latents interpolated): the target size, the second pass's steps
    reported, and an image that differs from the first pass's plain upscale."""
    _, _, engine = model
    steps = []
    got = engine.generate(_request(steps=3, seed=5, width=64, height=64,
                                   hires=Hires(scale=1.5, upscaler="Latent", denoise=0.6)),
                          callback=lambda step, total: steps.append((step, total)))
    assert got.images[0].size == (96, 96)
    assert steps[-1] == (5, 5)   # 3, then 3 - int(3 - 3 x 0.6) = 2 of a 3-step schedule (diffusers' rounding)
    plain = engine.generate(_request(steps=3, seed=5, width=64, height=64)).images[0]
    upscaled = _pixels([plain.resize((96, 96), Image.Resampling.LANCZOS)])
    assert np.abs(_pixels(got.images) - upscaled).mean() > 3
    assert got.infotext.get("Hires upscaler") == "Latent"


# --- refusals ----------------------------------------------------------------------------------------------------


def test_refusals_name_the_problem(model):
    _, _, engine = model
    with pytest.raises(RequestError, match=r"hires fix's target size 88x88 \(scale 1.375 of 64x64\).*multiple of 16"):
        engine.generate(_request(steps=2, width=64, height=64, hires=Hires(scale=1.375)))
    with pytest.raises(RequestError, match=r"hires fix's target size 88x64 \(resize 88x0 of 64x48\)"):
        engine.generate(_request(steps=2, width=64, height=48, hires=Hires(resize_x=88)))
    with pytest.raises(RequestError, match=r"multiples of 16 .*72x64 is not: the nearest that are: 64x64 or 80x64"):
        engine.generate(_request(width=72, height=64, steps=2))


def test_a_source_whose_sides_are_not_multiples_of_16_is_fitted_as_diffusers_fits_it(model, monkeypatch):
    """Image to image with no size given: the source's size rounded down to multiples of 16 (72x56 -> 64x48) and the
    source resized to it, as ZImageImg2ImgPipeline's image processor does with a source it gets no size for: its
    image. A size given that Z-Image cannot draw is refused naming the nearest sizes, before any model work."""
    img2img, _, engine = model
    source = _source(5, 72, 56)
    expected = _np(img2img(prompt=PROMPT, image=source, strength=0.6, num_inference_steps=4, guidance_scale=0.0,
                           generator=_seeds(6), output_type="np").images)
    result = engine.generate(_request(init_image=source, strength=0.6, steps=4, seed=6))
    got = _pixels(result.images)
    assert got.shape == expected.shape == (1, 48, 64, 3)
    assert (result.request.width, result.request.height) == (64, 48)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF

    def no_model_work(*args, **kwargs):
        raise AssertionError("the text encoder ran before the size was refused")

    monkeypatch.setattr(type(engine.family), "encode_texts", no_model_work)
    with pytest.raises(RequestError, match=r"72x\(the source's\) is not: the nearest that are: "
                                           r"64x\(the source's\) or 80x\(the source's\)"):
        engine.generate(_request(init_image=source, width=72, strength=0.6, steps=2))
