"""Image to image, inpainting and outpainting on the shipped demo model, judged by the automatic classifier
(sdlite.demo.classify): a red circle is recoloured by the prompt at strength 0.8, and keeps its place and
background at strength 0.1 (its colour too, without guidance); a masked circle is repainted as a yellow star while every pixel outside the blurred mask stays the source's; an
outpainted border continues the source's background colour around the unchanged source; a batch of two is the
two seeds run alone.

The sources are drawn by the training data's own renderer (sdlite.demo.data.render), so they are exactly the
kind of picture the model was trained on. Each check runs SEEDS and asserts what held for every one of them
when this file was written (pass rates in the docstrings: seeds 0-11 measured, 0-3 asserted), with at most one
miss allowed where the model's drawing, not the engine, decides; the engine's own guarantees (paste-back,
batch = seeds alone) are asserted for every seed.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image, ImageDraw

from sdlite.demo import model_path
from sdlite.demo import data as D
from sdlite.demo.classify import classify, nearest_colour
from sdlite.pipeline import Engine, Request
from sdlite.sources import blur_mask, outpaint_canvas

SEEDS = (0, 1, 2, 3)
MOST = len(SEEDS) - 1          # "most seeds": all but one

SOURCE = D.Scene("red", "circle", "blue", cx=32, cy=32, size=36)       # img2img and outpainting source
RECOLOUR_PROMPT = "a blue circle on a yellow background"
INPAINT_SOURCE = D.Scene("red", "circle", "blue", cx=32, cy=32, size=28)
INPAINT_BOX = (16, 16, 48, 48)  # x1, y1, x2, y2 (exclusive): a 32x32 square over the 28 px circle
INPAINT_PROMPT = "a yellow star on a blue background"
OUTPAINT = (32, 32, 32, 32)


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def engine():
    return Engine.load(model_path())


def render(scene: D.Scene) -> Image.Image:
    return Image.fromarray(D.render(scene))


def square_mask(box, size: int = D.IMAGE_SIZE) -> Image.Image:
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=255)
    return mask


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int32)


def foreground(image, background: str) -> np.ndarray:
    """Pixels far from a palette background colour (more than 100 in RGB; the closest palette pair is 100
    apart, and the shape colours here are all much farther from the background)."""
    return np.sqrt(((pixels(image) - np.array(D.COLOURS[background])) ** 2).sum(axis=2)) > 100


def iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max((a | b).sum(), 1))


# --- image to image ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recoloured(engine):
    src = render(SOURCE)
    out = {strength: [engine.generate(Request(RECOLOUR_PROMPT, init_image=src, strength=strength, seed=s)).images[0]
                      for s in SEEDS]
           for strength in (0.8, 0.1)}
    return src, out


def test_img2img_recolours_at_strength_0_8(recoloured):
    """Measured, seeds 0-11: blue 12/12, yellow background 12/12 (the shape: a circle 8/12, a triangle 4/12)."""
    src, out = recoloured
    assert classify(src).combo == ("red", "circle", "blue")
    results = [classify(im) for im in out[0.8]]
    assert all(im.size == src.size for im in out[0.8])                 # the size comes from the source
    assert sum(r.colour == "blue" for r in results) >= MOST, [r.combo for r in results]
    assert sum(r.background == "yellow" for r in results) >= MOST, [r.combo for r in results]


def test_img2img_low_strength_keeps_the_source(recoloured):
    """Strength 0.1 runs int(20 x 0.1) = 2 steps near the end of the schedule: the background stays the
    source's blue and the circle stays where it was, at the size it was (measured 12/12: foreground IoU with the
    source's 0.89-0.91, against 0.43-0.71 at strength 0.8), and the picture is far closer to the source than
    at 0.8 (mean absolute difference 23 against 147 of 255).

    Not asserted, because it does not hold: at the default guidance (7.5) the circle's colour is not kept even
    at strength 0.1; it turns yellow (12/12), the prompt's other colour, as it does in diffusers with the same
    seeds (guided predictions of this small model are strong even at the lowest noise levels). Without
    guidance the colour is kept: see the next test."""
    src, out = recoloured
    src_fg = foreground(src, "blue")
    for im in out[0.1]:
        c = classify(im)
        assert c.background == "blue" and c.shape == "circle", c.combo
        assert iou(foreground(im, "blue"), src_fg) >= 0.85
    far = np.mean([np.abs(pixels(im) - pixels(src)).mean() for im in out[0.8]])
    near = np.mean([np.abs(pixels(im) - pixels(src)).mean() for im in out[0.1]])
    assert near < far / 3, (near, far)


def test_img2img_strength_decides_the_colour_without_guidance(engine):
    """cfg 1 (guidance off), same prompt: strength 0.1 keeps the circle red (measured 12/12), strength 1.0 (the
    source noised to the top of the schedule) draws it blue (12/12) on yellow (12/12)."""
    src = render(SOURCE)
    low = [classify(engine.generate(Request(RECOLOUR_PROMPT, init_image=src, strength=0.1, cfg_scale=1.0,
                                            seed=s)).images[0]) for s in SEEDS]
    high = [classify(engine.generate(Request(RECOLOUR_PROMPT, init_image=src, strength=1.0, cfg_scale=1.0,
                                             seed=s)).images[0]) for s in SEEDS]
    assert all(r.colour == "red" and r.background == "blue" for r in low), [r.combo for r in low]
    assert sum(r.colour == "blue" and r.background == "yellow" for r in high) >= MOST, [r.combo for r in high]


# --- inpainting --------------------------------------------------------------------------------------------------


def test_inpainting_paints_a_yellow_star_inside_the_mask_only(engine):
    """The 32x32 mask covers the source's circle, so a right result is a yellow star on blue, classified on the
    whole image (measured 12/12 at the defaults: strength 0.75, blur 4, fill "original", paste-back on), with
    no red left; outside the blurred mask, the source's exact pixels (within 2/255, measured 0)."""
    src, mask = render(INPAINT_SOURCE), square_mask(INPAINT_BOX)
    blurred = np.asarray(blur_mask(mask, 4))
    outside = blurred == 0
    assert Image.fromarray(blurred).getbbox() == (6, 6, 58, 58)    # blur 4 (21 taps) reaches 10 px past the square
    assert outside.sum() > 1000
    results = []
    for s in SEEDS:
        im = engine.generate(Request(INPAINT_PROMPT, init_image=src, mask=mask, seed=s)).images[0]
        assert im.size == src.size
        assert np.abs(pixels(im) - pixels(src))[outside].max() <= 2
        red = np.sqrt(((pixels(im) - np.array(D.COLOURS["red"])) ** 2).sum(axis=2)) < 60
        assert red.sum() == 0, f"seed {s}: {red.sum()} red pixels left"
        results.append(classify(im))
    assert sum(r.combo == ("yellow", "star", "blue") for r in results) >= MOST, [r.combo for r in results]


# --- outpainting -------------------------------------------------------------------------------------------------


def test_outpainting_continues_the_background(engine):
    """64x64 -> 128x128 with the source's caption as the prompt. The new border's median colour is the source's
    background (nearest palette colour: measured 12/12; 4.4-5.4 from it in RGB) and most of its pixels are near it
    (measured 81-90% within 60; the rest are extra red shapes the model adds in the border, which it never saw in
    training: one shape per 64x64 image); the source is unchanged where the blurred mask is 0 (the central
    44x44, measured max difference 0)."""
    src = render(SOURCE)
    canvas, border = outpaint_canvas(src, *OUTPAINT)
    new = np.asarray(border) == 255
    keep = np.asarray(blur_mask(border, 4)) == 0
    assert keep.sum() == 44 * 44 and not (keep & new).any()
    bg = np.array(D.COLOURS[SOURCE.background])
    for s in SEEDS:
        im = engine.generate(Request(D.prompt(SOURCE.combo), init_image=src, outpaint=OUTPAINT, seed=s)).images[0]
        assert im.size == (128, 128)
        ring = pixels(im)[new]
        median = np.median(ring, axis=0)
        assert nearest_colour(median) == SOURCE.background and math.dist(median, bg) <= 20, (s, median)
        assert (np.sqrt(((ring - bg) ** 2).sum(axis=1)) < 60).mean() >= 0.7
        assert np.abs(pixels(im) - pixels(canvas))[keep].max() <= 2


# --- batches -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["img2img", "inpaint"])
def test_batch_of_two_is_each_seed_alone(engine, kind):
    """Image i of a batch is seed + i run alone: each draws its latent sample, noise (and masked-image sample)
    from its own generator."""
    if kind == "img2img":
        base = Request(RECOLOUR_PROMPT, init_image=render(SOURCE), strength=0.8, seed=7)
    else:
        base = Request(INPAINT_PROMPT, init_image=render(INPAINT_SOURCE), mask=square_mask(INPAINT_BOX), seed=7)
    batch = engine.generate(base.replace(batch_size=2))
    assert batch.seeds == [7, 8]
    for i, im in enumerate(batch.images):
        alone = engine.generate(base.replace(seed=7 + i)).images[0]
        assert np.abs(pixels(im) - pixels(alone)).max() <= 1
    assert np.abs(pixels(batch.images[0]) - pixels(batch.images[1])).max() > 10   # the seeds differ
