"""Qwen-Image-Edit inpainting against diffusers' QwenImageEditInpaintPipeline on the tiny random components of
tests/test_qwenimage_instruct.py, saved as a folder of that class (which opens as the Qwen-Image-Edit family).

How sdlite's request maps onto the pipeline's arguments:

* ``init_image`` + ``mask`` + the instruction as ``prompt`` is ``image`` + ``mask_image`` + ``prompt``: the source is
  the image edited, to the vision tower (at the drawn size) and to the VAE;
* the source's posterior sample is drawn once by the first image's generator and shared by the batch (the pipeline's
  ``retrieve_latents`` sampling): it is the start at ``strength``, the region put back after each step and the latent
  in the transformer's sequence; each image's noise from its own generator after it;
* the size left unset is the source's ``edit_size`` (the pipeline draws nothing else);
* cfg is ``true_cfg_scale`` with a negative prompt; no mask blur and no overlay for the comparisons (A1111's steps
  around the pipeline).

The pipeline fixes the source (and so the output) at about 1024^2 pixels; the parity runs make that area 160 x 96 on
both sides (the pipeline's ``calculate_dimensions`` and the family's ``VAE_AREA``), the same computation on fewer
tokens, to keep the module short. The size at the real area is checked without a run.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

import sdlite.families.qwenimage_edit as edit_family
from sdlite.config.qwenimage import QWEN_IMAGE_EDIT_PLUS_FAMILY
from sdlite.families.qwenimage_edit import VAE_AREA, QwenImageEditFamily, edit_size
from sdlite.pipeline import Engine, Request, RequestError
from sdlite.sources import image_to_tensor, prepare
from tests.test_qwenimage_instruct import INSTRUCTION, NEGATIVE, _processor, _save, _source, _text_encoder
from tests.test_qwenimage_pipeline import MAX_PIXEL_DIFF, TRANSFORMER, VAE, _generators, _pixels, _seeded

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDTH, HEIGHT = 80, 48         # the source: not square
SMALL_AREA = 160 * 96          # the parity runs' stand-in for the pipeline's 1024^2: 80 x 48 -> 160 x 96
BOX = (24, 8, 64, 36)          # the mask's white box on the source


def _mask() -> Image.Image:
    mask = Image.new("L", (WIDTH, HEIGHT), 0)
    mask.paste(255, BOX)
    return mask


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(QwenImageEditInpaintPipeline, engine, its folder) over one set of tiny random components."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditInpaintPipeline,
                           QwenImageTransformer2DModel)

    from sdlite.config.qwenimage import QWEN_IMAGE_SCHEDULER

    vae = _seeded(AutoencoderKLQwenImage(**VAE).eval(), 1, 0.1)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(8.0)
    pipe = QwenImageEditInpaintPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**{k: v for k, v in QWEN_IMAGE_SCHEDULER.items()
                                                     if not k.startswith("_")}),
        vae=vae, text_encoder=_text_encoder(), tokenizer=_processor().tokenizer, processor=_processor(),
        transformer=_seeded(QwenImageTransformer2DModel(**TRANSFORMER).eval(), 4, 0.15))
    pipe.set_progress_bar_config(disable=True)
    folder = tmp_path_factory.mktemp("qwen-edit-inpaint") / "edit-inpaint"
    _save(pipe, folder, "QwenImageEditInpaintPipeline")
    return pipe, Engine.load(folder, precision="exact"), folder


@pytest.fixture
def small_area(monkeypatch):
    """The pipeline's and the family's 1024^2 pixels made SMALL_AREA."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint as reference

    dimensions = reference.calculate_dimensions
    monkeypatch.setattr(reference, "calculate_dimensions", lambda area, ratio: dimensions(SMALL_AREA, ratio))
    monkeypatch.setattr(edit_family, "VAE_AREA", SMALL_AREA)


def _reference(pipe, **kw) -> np.ndarray:
    out = pipe(image=_source(WIDTH, HEIGHT, 3), mask_image=_mask(), prompt=INSTRUCTION, output_type="np", **kw).images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def _request(**kw) -> Request:
    return Request(prompt=INSTRUCTION, init_image=_source(WIDTH, HEIGHT, 3), mask=_mask(), sampler="euler",
                   mask_blur=0, overlay=False, **kw)


def test_the_folder_opens_as_qwen_image_edit(model):
    _, engine, _ = model
    assert engine.spec.family == "qwen-image-edit" and engine.family.name == "qwen-image-edit"
    assert any("QwenImageEditInpaintPipeline" in line for line in engine.family.info_lines())


def test_strength_0_6_batch_2_with_true_cfg(model, small_area):
    """3 steps at strength 0.6 run the last 2 (int(3 - 1.8) = 1 skipped) from the source's sample noised to the
    second sigma; batch 2 (the sample shared, the noise each image's own), true CFG with a negative prompt."""
    pipe, engine, _ = model
    expected = _reference(pipe, negative_prompt=NEGATIVE, true_cfg_scale=4.0, strength=0.6, num_inference_steps=3,
                          num_images_per_prompt=2, generator=_generators(5, 6))
    got = _pixels(engine.generate(_request(negative_prompt=NEGATIVE, cfg_scale=4.0, strength=0.6, steps=3, seed=5,
                                           batch_size=2)).images)
    assert got.shape == expected.shape == (2, 96, 160, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    repaint = np.asarray(_mask().resize((160, 96), Image.Resampling.NEAREST)) > 0
    assert np.abs(got[0] - got[1])[repaint].mean() > 4, "each image repaints the mask with its own noise"


def test_strength_1_without_guidance(model, small_area):
    """Strength 1: the masked area from pure noise, the source still in the caption and the sequence."""
    pipe, engine, _ = model
    expected = _reference(pipe, true_cfg_scale=1.0, strength=1.0, num_inference_steps=2, generator=_generators(7))
    got = _pixels(engine.generate(_request(cfg_scale=1.0, strength=1.0, steps=2, seed=7)).images)
    assert got.shape == expected.shape == (1, 96, 160, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert got.std() > 10


def test_the_sequence_holds_the_sample_not_the_mean(model, small_area, monkeypatch):
    """The source latent in the sequence is the start's sample (the pipeline's ``image_latents``), not the plain Edit
    pipeline's mean: the mean there misses the pipeline by more than the bar."""
    pipe, engine, _ = model
    expected = _reference(pipe, true_cfg_scale=1.0, strength=1.0, num_inference_steps=2, generator=_generators(7))
    monkeypatch.setattr(engine.family, "source_latent_of",
                        lambda model, source, seed: model.encode_image(image_to_tensor(source.image), None))
    got = _pixels(engine.generate(_request(cfg_scale=1.0, strength=1.0, steps=2, seed=7)).images)
    assert np.abs(got - expected).max() > MAX_PIXEL_DIFF


def test_the_source_is_encoded_once(model, monkeypatch):
    """The source's posterior sample is the sequence's latent (the family's) and the start (the engine's), two draws
    of one seed from the same moments, as the pipeline's one ``image_latents``: one VAE encode serves both, and a
    re-rolled seed encodes nothing again. The images are those of a model that remembers nothing (two encodes a
    request)."""
    _, engine, _ = model
    engine._moments_memo = None   # what an earlier test encoded
    calls = []
    with engine.models.use("vae") as vae:
        encode = type(vae).encode_moments
    monkeypatch.setattr(type(vae), "encode_moments", lambda self, x: calls.append(tuple(x.shape)) or encode(self, x))
    request = _request(cfg_scale=1.0, strength=0.6, steps=2, seed=3, width=64, height=48)
    first = _pixels(engine.generate(request).images)
    assert len(calls) == 1, calls
    again = _pixels(engine.generate(request.replace(seed=4)).images)
    assert len(calls) == 1, calls
    # a model that remembers nothing: the family's encode and the engine's, each request
    monkeypatch.setattr(type(engine), "_moments_memo", property(lambda self: None, lambda self, value: None),
                        raising=False)
    fresh = [_pixels(engine.generate(request.replace(seed=s)).images) for s in (3, 4)]
    assert len(calls) == 1 + 4, calls
    assert np.array_equal(first, fresh[0]) and np.array_equal(again, fresh[1])
    assert not np.array_equal(first, again)


def test_the_size_and_the_vision_image(model):
    """No size: the source's edit size at the real area (1024^2); a size given is drawn as given. The vision tower
    sees the source as drawn (Edit), or at about 384^2 pixels (Plus)."""
    _, engine, _ = model
    resolved = engine.family.resolve(_request())
    assert (resolved.width, resolved.height) == edit_size(WIDTH, HEIGHT, VAE_AREA) == (1312, 800)
    given = engine.family.resolve(_request(width=64, height=48))
    assert (given.width, given.height) == (64, 48)
    source = prepare(given)
    assert engine.family.source_vision_image(source) is source.overlay_source
    plus = QwenImageEditFamily(dataclasses.replace(engine.spec, family=QWEN_IMAGE_EDIT_PLUS_FAMILY))
    assert plus.source_vision_image(source).size == edit_size(64, 48, 384 * 384)
    cropped = prepare(given.replace(inpaint_area="masked"))
    assert cropped.paste_box is not None
    assert engine.family.source_vision_image(cropped).size == edit_size(WIDTH, HEIGHT, VAE_AREA)


def test_reference_images_with_a_mask(model):
    """Edit takes one image, the source: references beside it are refused. Plus takes the source and up to 2."""
    _, engine, _ = model
    other = _source(40, 40, 4)
    with pytest.raises(RequestError, match="Qwen-Image-Edit takes one image, and when it inpaints that is the source"):
        engine.generate(_request(reference_images=(other,), steps=2, width=32, height=32))
    plus = QwenImageEditFamily(dataclasses.replace(engine.spec, family=QWEN_IMAGE_EDIT_PLUS_FAMILY))
    plus.check_request(_request(reference_images=(other, other), width=32, height=32))
    with pytest.raises(RequestError, match="the inpainting source and 3 reference images: .* take 3 images in all"):
        plus.check_request(_request(reference_images=(other,) * 3, width=32, height=32))
    with pytest.raises(RequestError, match="or an init image with a mask to inpaint"):
        engine.generate(Request(prompt=INSTRUCTION, steps=2, width=32, height=32, sampler="euler"))


def test_sdlite_edit_with_a_mask_inpaints(model, small_area, tmp_path, capsys):
    """``sdlite edit IMAGE "instruction" --mask MASK``: IMAGE is the init image, strength 1 by default; the PNG is the
    engine's image of that request (A1111's mask blur and overlay, as generate's defaults)."""
    from sdlite.cli import main

    _, engine, folder = model
    photo, mask = tmp_path / "photo.png", tmp_path / "mask.png"
    _source(WIDTH, HEIGHT, 3).save(photo)
    _mask().save(mask)
    assert main(["edit", str(photo), INSTRUCTION, "--mask", str(mask), "--model", str(folder), "--steps", "2",
                 "--cfg", "1", "--sampler", "euler", "--seed", "3", "--precision", "exact",
                 "--output", str(tmp_path / "out.png")]) == 0
    (written,) = capsys.readouterr().out.split()
    with Image.open(written) as im:
        got = np.asarray(im.convert("RGB"))
    want = engine.generate(Request(prompt=INSTRUCTION, init_image=str(photo), mask=str(mask), strength=1.0, steps=2,
                                   cfg_scale=1.0, sampler="euler", seed=3)).images[0]
    assert got.shape == (96, 160, 3) and np.array_equal(got, np.asarray(want.convert("RGB")))
    assert main(["edit", str(photo), INSTRUCTION, "--strength", "0.5", "--model", str(folder)]) == 2
    assert "--strength needs --mask" in capsys.readouterr().err
