"""Image to image and inpainting against diffusers' StableDiffusionImg2ImgPipeline and
StableDiffusionInpaintPipeline: the same seeds give the same PNG pixels (at most 2/255 apart), at batch 2, for
every sampler on a tiny model and at the real SD 1.5 shapes (random weights, 128x128, 4 steps) for the samplers
and strengths people use most. Parity with diffusers is measured with no mask blur and no paste-back, which
diffusers does not do."""
from __future__ import annotations

import gc
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from sdlite.pipeline import Engine, Request
from tests.reference import (MORE_SCHEDULERS, SCHEDULERS, diffusers_pipeline, saved_pipeline, use_scheduler,
                             with_contrast)

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


# --- tiny model: every sampler -------------------------------------------------------------------------------

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


# --- the real SD 1.5 shapes ----------------------------------------------------------------------------------

# the full-size pipelines and engines (about 8 GB a set): one set alive at a time
_FULL: dict = {}


def _full_set(name, build) -> dict:
    if name not in _FULL:
        _FULL.clear()
        gc.collect()
        _FULL[name] = build()
    return _FULL[name]


@pytest.fixture(scope="module", autouse=True)
def _free_full_sets():
    yield
    _FULL.clear()
    gc.collect()


@pytest.fixture
def sd15(sd15_folder):
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline

    def build():
        pipe = StableDiffusionImg2ImgPipeline.from_pretrained(sd15_folder, dtype=torch.float32,
                                                              local_files_only=True, safety_checker=None,
                                                              requires_safety_checker=False)
        return {"img2img": pipe, "inpaint_4ch": StableDiffusionInpaintPipeline(**pipe.components),
                "engine": Engine.load(sd15_folder, precision="exact")}
    return _full_set("sd15", build)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["euler", "euler_a", "dpmpp_2m_karras", "ddim"])
@pytest.mark.parametrize("strength", [0.3, 0.75, 1.0])
def test_full_size_img2img_matches_diffusers(sd15, sampler, strength):
    image = source_image(128)
    expected = reference_img2img(sd15["img2img"], sampler, image, strength, steps=4, seed=42)
    got, _ = ours(sd15["engine"], sampler, image, strength, steps=4, seed=42)
    assert max_pixel_diff(got, expected) <= 2


@pytest.mark.slow
@pytest.mark.parametrize("sampler,strength", [("euler_a", 0.75), ("dpmpp_2m_karras", 1.0)])
def test_full_size_inpaint_4ch_matches_diffusers(sd15, sampler, strength):
    image, mask = source_image(128), square_mask(128)
    expected = reference_inpaint(sd15["inpaint_4ch"], sampler, image, mask, strength, steps=4, seed=7)
    got, _ = ours(sd15["engine"], sampler, image, strength, steps=4, seed=7, mask=mask)
    assert max_pixel_diff(got, expected) <= 2


@pytest.fixture
def sd15_inpaint(sd15_inpaint_folder):
    from diffusers import StableDiffusionInpaintPipeline

    def build():
        pipe = StableDiffusionInpaintPipeline.from_pretrained(sd15_inpaint_folder, dtype=torch.float32,
                                                              local_files_only=True, safety_checker=None,
                                                              requires_safety_checker=False)
        return {"inpaint": pipe, "engine": Engine.load(sd15_inpaint_folder, precision="exact")}
    return _full_set("sd15_inpaint", build)


@pytest.mark.slow
@pytest.mark.parametrize("sampler,strength", [("euler", 1.0), ("euler_a", 0.75), ("dpmpp_2m_karras", 0.75)])
def test_full_size_inpaint_9ch_matches_diffusers(sd15_inpaint, sampler, strength):
    image, mask = source_image(128), square_mask(128)
    expected = reference_inpaint(sd15_inpaint["inpaint"], sampler, image, mask, strength, steps=4, seed=5)
    got, _ = ours(sd15_inpaint["engine"], sampler, image, strength, steps=4, seed=5, mask=mask)
    assert max_pixel_diff(got, expected) <= 2
