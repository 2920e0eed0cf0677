"""FLUX.1 Kontext inpainting against diffusers' FluxKontextInpaintPipeline on a tiny random model saved as that
pipeline's folder: the source at its Kontext size, encoded to its mean latent, the start (noised to the strength)
and the one reference in the sequence; the mask binarised and nearest on the latent grid, the unmasked region
re-imposed after each step; a reference image given takes the source's place (the pipeline's ``image_reference``);
batch 2 at strength 0.7 and 1; the sizes the pipeline's auto-resize picks; what is refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.pipeline import Engine, Request, RequestError
from sdlite.pipeline.request import validate
from tests.test_flux_kontext import _image
from tests.test_flux_pipeline import MAX_PIXEL_DIFF, PROMPT, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from diffusers import FluxKontextInpaintPipeline

    tmp = tmp_path_factory.mktemp("kontext-inpaint")
    dev = _pipeline(tmp, "dev", save=False)
    pipe = FluxKontextInpaintPipeline(**dev.components)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(tmp / "kontext")
    return {"pipe": pipe, "engine": Engine.load(tmp / "kontext", precision="exact")}


def _mask(width: int, height: int, box: tuple[int, int, int, int]) -> Image.Image:
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, box)
    return mask


def _expected(pipe, seeds=(4,), **kw) -> np.ndarray:
    out = pipe(prompt=PROMPT, num_inference_steps=4, guidance_scale=2.5, max_sequence_length=512,
               num_images_per_prompt=len(seeds), generator=[torch.Generator().manual_seed(s) for s in seeds],
               output_type="np", _auto_resize=False, **kw).images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def _request(**kw) -> Request:
    return Request(prompt=PROMPT, steps=4, sampler="euler", cfg_scale=1.0, seed=4, mask_blur=0, overlay=False,
                   reference_resize=False, **kw)


@pytest.mark.parametrize("strength", [0.7, 1.0])
def test_inpainting_matches_fluxkontextinpaintpipeline(models, strength):
    """A 72x56 source drawn at 64x48 (its sides rounded down to 16, Lanczos), the mask resized with it; batch 2, each
    image its own generator, the source encoded once to its mean; Kontext's guidance 2.5 by default."""
    source, mask = _image(11, 72, 56), _mask(72, 56, (16, 8, 56, 40))
    expected = _expected(models["pipe"], seeds=(4, 5), image=source, mask_image=mask, strength=strength)
    got = models["engine"].generate(_request(init_image=source, mask=mask, strength=strength, batch_size=2))
    assert got.request.guidance == 2.5 and (got.request.width, got.request.height) == (64, 48)
    pixels = _pixels(got.images)
    assert pixels.shape == expected.shape == (2, 48, 64, 3)
    assert np.abs(pixels - expected).max() <= MAX_PIXEL_DIFF
    repaint = np.asarray(mask.resize((64, 48), Image.Resampling.LANCZOS)) >= 128
    assert np.abs(pixels[0] - pixels[1])[repaint].mean() > 2, "each image repaints the mask with its own noise"


def test_a_reference_image_is_the_pipelines_image_reference(models):
    """``reference_images`` with the inpainting source: the pipeline's ``image_reference``, in the sequence in the
    source's place; the source still starts the run and fills the unmasked region. (This tiny VAE encodes every
    picture to nearly the same latent, so what tells the placements apart is how many references there are: the
    source beside the reference is far from the pipeline.)"""
    source, mask, reference = _image(12, 64, 64), _mask(64, 64, (8, 8, 40, 56)), _image(13, 48, 80)
    expected = _expected(models["pipe"], image=source, mask_image=mask, image_reference=reference, strength=0.8)
    r = _request(init_image=source, mask=mask, strength=0.8)
    got = _pixels(models["engine"].generate(r.replace(reference_images=(reference,))).images)
    assert got.shape == expected.shape == (1, 64, 64, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    both = _pixels(models["engine"].generate(r.replace(reference_images=(source, reference))).images)
    assert np.abs(both - expected).max() > 2 * MAX_PIXEL_DIFF


def test_the_size_is_the_sources_kontext_size(models):
    """With resize on (the default) the output is the preferred resolution nearest the source's aspect, as the
    pipeline's ``_auto_resize`` draws it; a size given is kept; outpainting counts the new border."""
    family = models["engine"].family

    def size(**kw):
        r = family.resolve(validate(Request(prompt=PROMPT, init_image=_image(0, 83, 50), **kw)))
        return r.width, r.height

    mask = _mask(83, 50, (0, 0, 40, 40))
    assert size(mask=mask) == (1328, 800)
    assert size(mask=mask, reference_resize=False) == (80, 48)
    assert size(mask=mask, width=96, height=64) == (96, 64)
    assert size(outpaint=(0, 0, 0, 72)) == (880, 1184)     # 83x122 -> 80x112: aspect 0.71
    assert size() == (80, 48)                              # image to image keeps FLUX's fitting to 16


def test_refusals_name_the_problem(models):
    engine = models["engine"]
    source = _image(0, 64, 64)
    with pytest.raises(RequestError, match="the mask is all black: nothing to repaint"):
        engine.generate(_request(init_image=source, mask=_mask(64, 64, (0, 0, 0, 0))))
    with pytest.raises(RequestError, match=r"reference image 1: a latent of shape \(1, 4, 8, 8\); this model's "
                                           "references are 16-channel latents"):
        engine.generate(_request(init_image=source, mask=_mask(64, 64, (0, 0, 32, 32)),
                                 reference_images=(torch.zeros(1, 4, 8, 8),)))
