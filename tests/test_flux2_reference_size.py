"""FLUX.2 [klein]'s reference size without preparing the image: ``_prepared_size`` (what ``reference_size`` answers
from the image's own size, and the size ``reference_pixels`` crops to) is the size of the image as prepared, for
tiny, odd, huge and extreme-aspect sizes. The preparation is done here again as Flux2ImageProcessor does it (a
Lanczos resize to ``int(side * sqrt(1024^2 / area))`` above 1024^2 pixels, then a centre crop to multiples of 16), and
by ``reference_pixels`` itself. In-memory PIL images only."""
from __future__ import annotations

import math

import pytest
from PIL import Image

from sdlite.errors import RequestError
from sdlite.families.flux2 import _prepared_size, reference_pixels, reference_size

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZES = [
    (64, 64), (64, 65), (79, 64), (65, 127), (97, 131), (255, 257),           # tiny and odd
    (1024, 1024), (1023, 1025), (1025, 1024), (1024, 1025), (1040, 1008),      # about the 1024^2 area
    (2048, 512), (1448, 725), (1331, 1999), (4096, 3072),                      # above it, one huge
    (512, 4096), (4000, 500), (64, 512), (401, 3200), (3203, 401),            # aspect 8:1 and near it
]


def _prepared_by_pil(image: Image.Image) -> Image.Image:
    """The pipeline's preparation, step by step (Flux2ImageProcessor._resize_if_exceeds_area, then the crop of
    Flux2KleinPipeline's ``image_width // 16 * 16``)."""
    width, height = image.size
    if width * height > 1024 * 1024:
        scale = math.sqrt(1024 * 1024 / (width * height))
        image = image.resize((int(width * scale), int(height * scale)), Image.Resampling.LANCZOS)
    width, height = image.size
    cw, ch = width // 16 * 16, height // 16 * 16
    left, top = (width - cw) // 2, (height - ch) // 2
    return image.crop((left, top, left + cw, top + ch))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_prepared_size_is_the_prepared_images(size):
    expected = _prepared_by_pil(Image.new("L", size)).size    # the mode does not change the size
    image = Image.new("RGB", size, (120, 30, 200))
    assert _prepared_size(*size) == expected
    assert reference_size(image, 0) == expected
    pixels = reference_pixels(image, 0)
    assert (pixels.shape[3], pixels.shape[2]) == expected
    assert expected[0] % 16 == 0 and expected[1] % 16 == 0 and expected[0] * expected[1] <= 1024 * 1024


@pytest.mark.parametrize("size, message", [((63, 200), "at least 64 pixels"), ((600, 64), "above 8:1"),
                                           ((64, 513), "above 8:1")])
def test_refused_alike(size, message):
    """An image too small or too long is refused by ``reference_size`` as by ``reference_pixels``."""
    image = Image.new("RGB", size)
    for prepare in (reference_size, reference_pixels):
        with pytest.raises(RequestError, match=rf"reference image 2 is {size[0]}x{size[1]}: .*{message}"):
            prepare(image, 1)
