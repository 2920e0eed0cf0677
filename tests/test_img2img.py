"""Image to image and inpainting against diffusers' StableDiffusionImg2ImgPipeline and
StableDiffusionInpaintPipeline: the same seeds give the same PNG pixels (at most 2/255 apart), at batch 2, on a tiny
model: every sampler, and the samplers and strengths people use most (``PARITY_CASES``), which bench/parity.py runs
through the same functions at the real SD 1.5 shapes (random weights, 128x128). Parity with diffusers is measured
with no mask blur and no paste-back, which diffusers does not do."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from sdlite.pipeline import Engine, Request
from tests.reference import (MORE_SCHEDULERS, SCHEDULERS, diffusers_pipeline, saved_pipeline, use_scheduler,
                             with_contrast)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "a red circle on a blue background"
NEGATIVE = "blurry, green"


def source_image(size: int) -> Image.Image:
    """A structured RGB source: a diagonal gradient with a disc and a bar, so every latent channel varies."""
    y, x = np.mgrid[0:size, 0:size]
    arr = np.stack([x * 255 // (size - 1), y * 255 // (size - 1), (x + y) * 127 // (size - 1)], -1).astype(np.uint8)
    image = Image.fromarray(arr)
    draw = ImageDraw.Draw(image)
    draw.ellipse([size // 4, size // 4, 3 * size // 4, 3 * size // 4], fill=(220, 30, 40))
    draw.rectangle([0, size - size // 8, size - 1, size - 1], fill=(20, 200, 90))
    return image


def square_mask(size: int) -> Image.Image:
    """White (repaint) over a square off the centre, black elsewhere."""
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle([size // 8, size // 4, size // 2 + size // 8, 3 * size // 4], fill=255)
    return mask


def as_uint8(images) -> np.ndarray:
    if isinstance(images, np.ndarray):
        return (images * 255).round().astype(np.uint8)
    return np.stack([np.asarray(im.convert("RGB")) for im in images])


def max_pixel_diff(a, b) -> int:
    assert a.shape == b.shape
    diff = int(np.abs(a.astype(int) - b.astype(int)).max())
    log = os.environ.get("SDLITE_PARITY_LOG")   # the figures for a report: one JSON line per comparison
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                                "max_pixel_diff": diff}) + "\n")
    return diff


def reference_img2img(pipe, sampler, image, strength, *, steps, seed, batch=2, cfg=7.5):
    use_scheduler(pipe, sampler)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(batch)]
    out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, image=image, strength=strength, num_inference_steps=steps,
               guidance_scale=cfg, generator=generators, num_images_per_prompt=batch, output_type="np").images
    return as_uint8(out)


def reference_inpaint(pipe, sampler, image, mask, strength, *, steps, seed, batch=2, cfg=7.5):
    """One source and one mask per batch item, as sdlite does: each image's generator then draws its own
    latent samples (given a single source, diffusers' inpainting pipeline draws them from the first generator
    only, so image i could not be regenerated alone from seed + i)."""
    use_scheduler(pipe, sampler)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(batch)]
    out = pipe(prompt=[PROMPT] * batch, negative_prompt=[NEGATIVE] * batch, image=[image] * batch,
               mask_image=[mask] * batch,
               strength=strength, num_inference_steps=steps, guidance_scale=cfg, generator=generators,
               height=image.height, width=image.width, output_type="np").images
    return as_uint8(out)


def ours(engine, sampler, image, strength, *, steps, seed, batch=2, cfg=7.5, mask=None, **options):
    request = Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=steps, cfg_scale=cfg, sampler=sampler,
                      seed=seed, batch_size=batch, init_image=image, strength=strength, mask=mask, **options)
    if mask is not None:  # diffusers neither blurs the mask nor pastes the source back
        request = request.replace(mask_blur=0, overlay=False)
    result = engine.generate(request)
    assert result.seeds == [seed + i for i in range(batch)]
    return as_uint8(result.images), result


# The samplers and strengths people use most: (sampler, strength) per mode, 4 steps. The tiny model runs each
# below; bench/parity.py runs the same list at the real SD 1.5 shapes (the 9-channel UNet from an inpainting
# folder, the 4-channel one from the plain model).
PARITY_CASES = {
    "img2img": [(sampler, strength) for sampler in ("euler", "euler_a", "dpmpp_2m_karras", "ddim")
                for strength in (0.3, 0.75, 1.0)],
    "inpaint_4ch": [("euler_a", 0.75), ("dpmpp_2m_karras", 1.0)],
    "inpaint_9ch": [("euler", 1.0), ("euler_a", 0.75), ("dpmpp_2m_karras", 0.75)],
}
PARITY_STEPS = 4
PARITY_SEEDS = {"img2img": 42, "inpaint_4ch": 7, "inpaint_9ch": 5}


def parity_case(pipes, engines, mode, sampler, strength, *, size):
    """One case of ``PARITY_CASES``: (sdlite's pixels, diffusers' pixels) at batch 2. ``pipes`` / ``engines``: the
    diffusers pipeline and the sdlite engine by mode ("img2img", "inpaint_4ch", "inpaint_9ch")."""
    image, seed = source_image(size), PARITY_SEEDS[mode]
    if mode == "img2img":
        expected = reference_img2img(pipes[mode], sampler, image, strength, steps=PARITY_STEPS, seed=seed)
        got, _ = ours(engines[mode], sampler, image, strength, steps=PARITY_STEPS, seed=seed)
    else:
        mask = square_mask(size)
        expected = reference_inpaint(pipes[mode], sampler, image, mask, strength, steps=PARITY_STEPS, seed=seed)
        got, _ = ours(engines[mode], sampler, image, strength, steps=PARITY_STEPS, seed=seed, mask=mask)
    return got, expected


# --- tiny model -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline

    tmp = tmp_path_factory.mktemp("tiny_i2i")
    pipe = saved_pipeline(with_contrast(diffusers_pipeline("sd1", tmp)), tmp / "model")
    inpaint = saved_pipeline(with_contrast(diffusers_pipeline("sd1-inpaint", tmp, seed=5)), tmp / "inpaint")
    return {"img2img": StableDiffusionImg2ImgPipeline(**pipe.components), "engine": Engine.load(tmp / "model", precision="exact"),
            "engine_path": tmp / "model",
            "inpaint": StableDiffusionInpaintPipeline(**inpaint.components),
            "inpaint_4ch": StableDiffusionInpaintPipeline(**pipe.components),
            "inpaint_engine": Engine.load(tmp / "inpaint", precision="exact")}


ALL_SAMPLERS = [*SCHEDULERS, *MORE_SCHEDULERS]


@pytest.mark.parametrize("sampler", ALL_SAMPLERS)
def test_tiny_img2img_matches_diffusers(tiny, sampler):
    # PLMS below strength 1 is not compared: diffusers' PNDMScheduler lists its warm-up timestep twice, and
    # img2img slices that list by step count, so from there on it gives the UNet a timestep one step below the
    # latent's noise level; sdlite's PLMS runs the same remaining noise levels as every other sampler
    strength = 1.0 if sampler == "pndm" else 0.6
    image = source_image(64)
    expected = reference_img2img(tiny["img2img"], sampler, image, strength, steps=5, seed=21)
    got, result = ours(tiny["engine"], sampler, image, strength, steps=5, seed=21)
    assert (result.request.width, result.request.height) == (64, 64)  # the source's size
    assert max_pixel_diff(got, expected) <= 2


@pytest.mark.parametrize("sampler", ["euler", "euler_a", "dpmpp_2m_karras", "ddim", "unipc"])
@pytest.mark.parametrize("strength", [0.5, 1.0])
def test_tiny_inpaint_4ch_matches_diffusers(tiny, sampler, strength):
    image, mask = source_image(64), square_mask(64)
    expected = reference_inpaint(tiny["inpaint_4ch"], sampler, image, mask, strength, steps=4, seed=8)
    got, _ = ours(tiny["engine"], sampler, image, strength, steps=4, seed=8, mask=mask)
    assert max_pixel_diff(got, expected) <= 2


@pytest.mark.parametrize("sampler", ["euler", "euler_a", "dpmpp_2m_karras", "ddim"])
@pytest.mark.parametrize("strength", [0.5, 1.0])
def test_tiny_inpaint_9ch_matches_diffusers(tiny, sampler, strength):
    image, mask = source_image(64), square_mask(64)
    expected = reference_inpaint(tiny["inpaint"], sampler, image, mask, strength, steps=4, seed=9)
    got, _ = ours(tiny["inpaint_engine"], sampler, image, strength, steps=4, seed=9, mask=mask)
    assert max_pixel_diff(got, expected) <= 2


@pytest.mark.parametrize("mode,sampler,strength", [(mode, *case) for mode, cases in PARITY_CASES.items()
                                                    for case in cases])
def test_tiny_parity_cases_match_diffusers(tiny, mode, sampler, strength):
    """The cases bench/parity.py compares at the real SD 1.5 shapes, on the tiny model: low strengths (0.3 runs
    one of the 4 steps) to full repainting, with both inpainting UNets."""
    pipes = {"img2img": tiny["img2img"], "inpaint_4ch": tiny["inpaint_4ch"], "inpaint_9ch": tiny["inpaint"]}
    engines = {"img2img": tiny["engine"], "inpaint_4ch": tiny["engine"], "inpaint_9ch": tiny["inpaint_engine"]}
    got, expected = parity_case(pipes, engines, mode, sampler, strength, size=64)
    assert max_pixel_diff(got, expected) <= 2


def test_img2img_image_regenerates_alone_from_its_seed(tiny):
    image = source_image(64)
    batch, _ = ours(tiny["engine"], "euler_a", image, 0.7, steps=5, seed=40, batch=2)
    alone, _ = ours(tiny["engine"], "euler_a", image, 0.7, steps=5, seed=41, batch=1)
    assert max_pixel_diff(alone[0], batch[1]) <= 1


def test_low_memory_mode_gives_the_same_inpainting(tiny, tmp_path):
    """Memory mode 0 loads the VAE for the encode, frees it, and loads it again for the decode: same pixels."""
    low = Engine.load(tiny["engine_path"], memory_mode=0, precision="exact")
    image, mask = source_image(64), square_mask(64)
    resident, _ = ours(tiny["engine"], "dpmpp_2m_karras", image, 0.8, steps=4, seed=12, mask=mask)
    streamed, _ = ours(low, "dpmpp_2m_karras", image, 0.8, steps=4, seed=12, mask=mask)
    assert max_pixel_diff(streamed, resident) <= 1


def test_inpainting_model_does_text_to_image_with_a_full_mask(tiny):
    """Asked for plain text to image, an inpainting model repaints everything: diffusers' inpainting pipeline
    with a white mask at strength 1 (the source then only enters through the masked image, which is blank)."""
    from diffusers import StableDiffusionInpaintPipeline

    pipe: StableDiffusionInpaintPipeline = tiny["inpaint"]
    use_scheduler(pipe, "euler")
    white = Image.new("L", (64, 64), 255)
    generators = [torch.Generator().manual_seed(3)]
    expected = as_uint8(pipe(prompt=PROMPT, negative_prompt=NEGATIVE, image=source_image(64), mask_image=white,
                             num_inference_steps=4, generator=generators, height=64, width=64,
                             output_type="np").images)
    result = tiny["inpaint_engine"].generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=4,
                                                     sampler="euler", seed=3, width=64, height=64))
    assert max_pixel_diff(as_uint8(result.images), expected) <= 2
