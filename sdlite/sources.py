"""Pixel-side preparation of source images and masks for image-to-image, inpainting and outpainting.

Everything here works on PIL images (with numpy for the arithmetic) and follows the AUTOMATIC1111 web UI
("A1111"), so that a source image, mask and settings give the same pixels to encode as there:

* :func:`load_image` opens a file (or takes a PIL image), refuses decompression bombs from the header, applies the
  EXIF orientation and normalises the mode to "RGB" or "RGBA".
* :func:`load_mask` is A1111's ``create_binary_mask``: an RGBA mask with real transparency uses its alpha channel,
  anything else its greyscale; values above 128 become 255 (repaint), the rest 0.
* :func:`resize_image` is A1111's ``images.resize_image`` (modes 0, 1, 2: "just-resize", "crop", "fill"), LANCZOS.
* :func:`blur_mask` is A1111's mask blur: OpenCV's ``GaussianBlur`` of standard deviation ``radius`` and kernel size
  ``2 * int(2.5 * radius + 0.5) + 1``, horizontal then vertical, each pass rounded to 8 bits, reflect-101 borders.
* :func:`fill_masked` is A1111's ``masking.fill`` (inpainting fill "fill").
* :func:`crop_region` is A1111's ``get_crop_region`` + ``expand_crop_region`` (inpaint area "only masked").
* :func:`apply_overlay` is A1111's paste-back of the source over the generated image (``apply_overlay`` with its
  ``mask_for_overlay``).
* :func:`outpaint_canvas` grows the canvas for outpainting (A1111 does this in its outpainting scripts; here the new
  border is pre-filled by edge replication and its mask is returned).

Where this deviates from A1111, on purpose:

* A1111 flattens a transparent init image onto a background colour (white by default); :func:`to_rgb` keeps the
  colour channels as they are (transparency means nothing special to an init image here).
* A1111 thresholds only an alpha-channel mask; a greyscale mask is used as it is. :func:`load_mask` thresholds both
  (> 128 is 255), so a mask is always strictly black and white before the blur.
* Resize mode "fill": A1111 fills the empty bands by resizing a zero-height (or zero-width) box at the resized
  image's edge, which PIL's bicubic filter evaluates as a slight extrapolation of the two outermost rows
  (about 1.125 * edge - 0.125 * next). Here the band repeats the edge row (column) exactly. A1111's bottom (right)
  band also stops one pixel short when the gap is odd, leaving a black line; here the bands cover the whole gap.
* The blur is numpy with the exact Gaussian weights. OpenCV's 8-bit path quantises the kernel to steps of 1/256
  (with a correction that keeps the sum at exactly 1), so A1111's blurred masks differ from these by a few levels
  (at most 3 of 255 after both passes, measured for radii 0.5 to 30 against OpenCV 5.0).
* An all-black mask is an error (:class:`ImageInputError`), where A1111 silently does plain image-to-image.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter, ImageOps, UnidentifiedImageError

import torch

from .errors import RequestError, SDLiteError

MAX_PIXELS = 8192 * 8192
"""Decompression-bomb cap on width * height of any input image, checked from the header before decoding."""

RESIZE_MODES = ("just-resize", "crop", "fill")
"""A1111 resize modes 0, 1, 2: stretch; scale to cover and centre-crop; scale to fit and fill the bands."""

INPAINT_FILLS = ("fill", "original", "latent-noise", "latent-nothing")
"""A1111 ``inpainting_fill`` 0..3: what the masked area starts from."""

INPAINT_AREAS = ("whole", "masked")
"""A1111 ``inpaint_full_res`` False / True: generate the whole picture, or only a crop around the mask."""

LANCZOS = Image.Resampling.LANCZOS if hasattr(Image, "Resampling") else Image.LANCZOS

# A1111 masking.fill: (Gaussian blur radius, how many times the blurred layer is composited).
_FILL_PASSES = ((256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1))

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_16BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


class ImageInputError(SDLiteError, ValueError):
    """A source image or mask cannot be used; the message names the file (or "init image" / "mask") and why."""


def _name(source, what: str) -> str:
    """How an error message names the input: ``what`` plus the path, or ``what`` alone (a PIL image)."""
    if isinstance(source, (str, os.PathLike)):
        return f"{what} {os.fspath(source)}"
    return what


def _check_size(size: tuple[int, int], name: str) -> None:
    width, height = size
    if width * height > MAX_PIXELS:
        raise ImageInputError(
            f"{name}: {width}x{height} is {width * height} pixels, more than the cap of {MAX_PIXELS} "
            f"(8192x8192); refused as a possible decompression bomb")
    if width < 1 or height < 1:
        raise ImageInputError(f"{name}: the image is empty ({width}x{height})")


def _transpose(im: Image.Image) -> Image.Image:
    """Apply the EXIF orientation; a broken EXIF block leaves the picture as stored rather than unusable."""
    try:
        return ImageOps.exif_transpose(im)
    except Exception:  # noqa: BLE001 - Pillow raises assorted errors on malformed EXIF data
        return im


def _open(path, name: str) -> Image.Image:
    """Open and decode an image file, the size checked from the header before the pixels are decoded; the result
    is oriented (EXIF) and normalised, and no longer tied to the file."""
    if not os.path.exists(path):
        raise ImageInputError(f"{name}: no such file")
    if os.path.isdir(path):
        raise ImageInputError(f"{name}: is a directory, not an image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                _check_size(im.size, name)  # only the header has been read: the pixels are not decoded yet
                im.load()
                return _normalise(_transpose(im), name)
    except ImageInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageInputError(f"{name}: refused as a possible decompression bomb ({err})") from None
    except UnidentifiedImageError:
        raise ImageInputError(f"{name}: not an image file (or in a format Pillow cannot read)") from None
    except PermissionError:
        raise ImageInputError(f"{name}: cannot be read: permission denied") from None
    except (OSError, ValueError, SyntaxError, EOFError) as err:
        raise ImageInputError(f"{name}: cannot be decoded: {err}") from None


def _has_transparency(im: Image.Image) -> bool:
    if im.mode in _ALPHA_MODES:
        return True
    return im.mode in ("P", "L", "RGB", "1") and "transparency" in im.info


def _to_8bit(im: Image.Image) -> Image.Image:
    """Scale a 16-bit integer ("I;16*", "I") or 32-bit float ("F") greyscale image to "L"."""
    values = np.asarray(im)
    if im.mode in _16BIT_MODES:
        # 16-bit range: 65535 -> 255, i.e. value / 257, rounded. "I" (32-bit) is read as 16-bit data (how Pillow
        # used to open 16-bit PNGs); values outside 0..65535 are clipped.
        scaled = np.clip(values.astype(np.float64), 0, 65535) / 257.0
    else:  # "F"
        values = np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        # A float image whose values all lie in [0, 1] is read as 0..1 (the usual convention for float images);
        # anything else as 0..255 (Pillow's own "F" -> "L" convention), clipped.
        scaled = values * 255.0 if values.size and 0.0 <= values.min() and values.max() <= 1.0 else values
    return Image.fromarray(np.rint(np.clip(scaled, 0, 255)).astype(np.uint8), "L")


def _normalise(im: Image.Image, name: str) -> Image.Image:
    """The image as "RGBA" when it has any transparency, else "RGB"."""
    if im.mode in _16BIT_MODES or im.mode == "F":
        im = _to_8bit(im)
    if im.mode == "RGBA":
        return im.copy()
    if im.mode == "RGB" and "transparency" not in im.info:
        return im.copy()
    target = "RGBA" if _has_transparency(im) else "RGB"
    try:
        return im.convert(target)
    except (ValueError, OSError) as err:
        raise ImageInputError(f"{name}: cannot convert image mode {im.mode!r} to {target}: {err}") from None


def load_image(source, what: str = "init image") -> Image.Image:
    """Open an image file (or take a PIL image) for use as a source: "RGBA" if it has transparency, else "RGB".

    ``source`` is a path (``str`` / ``os.PathLike``) or a PIL image; ``what`` names it in error messages
    ("init image", "mask"). A missing file, a directory, a file that is not an image or cannot be decoded, and an
    image of more than :data:`MAX_PIXELS` pixels (checked from the header, before decoding) raise
    :class:`ImageInputError`. The EXIF orientation is applied. Palette and greyscale images are expanded, 16-bit
    greyscale is scaled by 1/257 (rounded) and float greyscale from 0..1 (or 0..255 if it is not within 0..1).
    """
    name = _name(source, what)
    if isinstance(source, Image.Image):
        _check_size(source.size, name)
        try:
            return _normalise(_transpose(source), name)
        except (OSError, ValueError, SyntaxError, EOFError) as err:  # a lazily opened image that fails to decode
            if isinstance(err, ImageInputError):
                raise
            raise ImageInputError(f"{name}: cannot be decoded: {err}") from None
    if isinstance(source, (str, os.PathLike)):
        return _open(source, name)
    raise ImageInputError(f"{what}: expected a file path or a PIL image, got {type(source).__name__}")


def to_rgb(image: Image.Image) -> Image.Image:
    """The image as "RGB": alpha is dropped, the colour channels are kept as they are (even where transparent)."""
    if image.mode == "RGB":
        return image.copy()
    if image.mode in ("RGBA", "RGBa", "LA", "La", "PA") or image.mode in _16BIT_MODES or image.mode == "F":
        image = _normalise(image, "image")
        if image.mode == "RGBA":
            return Image.fromarray(np.asarray(image)[:, :, :3].copy(), "RGB")
        return image
    return image.convert("RGB")


def load_mask(source, what: str = "mask", from_alpha: bool = False) -> Image.Image:
    """Open a mask (path or PIL image) as an "L" image of only 0 and 255; 255 (white) marks the area to repaint.

    With ``from_alpha`` the mask is the image's alpha channel inverted (transparent = repaint); an image without
    transparency raises :class:`ImageInputError`. Otherwise A1111's rule: an RGBA image whose alpha is not all 255
    uses its alpha channel (opaque = repaint), any other image its greyscale. Either is then thresholded:
    values above 128 become 255, the rest 0.
    """
    name = _name(source, what)
    im = load_image(source, what)
    if from_alpha:
        if im.mode != "RGBA":
            raise ImageInputError(f"{name}: the image has no transparency (alpha channel) to use as a mask")
        values = 255 - np.asarray(im)[:, :, 3].astype(np.int16)
    elif im.mode == "RGBA" and im.getextrema()[3] != (255, 255):
        values = np.asarray(im)[:, :, 3]
    else:
        values = np.asarray(im.convert("L"))
    return Image.fromarray(np.where(values > 128, 255, 0).astype(np.uint8), "L")


def invert_mask(mask: Image.Image) -> Image.Image:
    """The mask inverted (A1111 "inpaint not masked"): 255 - value, as "L"."""
    return ImageOps.invert(mask.convert("L"))


def check_mask_not_empty(mask: Image.Image, what: str = "mask") -> None:
    """Raise :class:`ImageInputError` if the mask is all zero (nothing to repaint)."""
    if mask.convert("L").getbbox() is None:
        raise ImageInputError(f"{what} is all black: nothing to repaint (white marks the area to repaint)")


def _check_dims(width: int, height: int) -> None:
    for label, value in (("width", width), ("height", height)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ImageInputError(f"resize: {label}={value!r} must be a positive whole number of pixels")


def resize_image(image: Image.Image, width: int, height: int, mode: str = "just-resize") -> Image.Image:
    """Resize to ``width`` x ``height`` as A1111's ``images.resize_image`` does (LANCZOS).

    An "RGB", "RGBA" or "L" image keeps its mode; any other is first made "RGB" or "RGBA" as :func:`load_image` does.

    * "just-resize" (A1111 0): stretch to the size, ignoring the aspect ratio.
    * "crop" (A1111 1): scale, keeping the aspect ratio, so the image covers the size; centre it and crop the rest.
    * "fill" (A1111 2): scale so the image fits inside the size; centre it and fill the empty bands on either side
      with the resized image's edge row (or column) repeated.
    """
    if mode not in RESIZE_MODES:
        raise ImageInputError(f"unknown resize mode {mode!r}; expected one of {', '.join(RESIZE_MODES)}")
    _check_dims(width, height)
    if image.mode not in ("RGB", "RGBA", "L"):
        image = _normalise(image, "image")
    if mode == "just-resize":
        return image.resize((width, height), resample=LANCZOS)

    ratio, src_ratio = width / height, image.width / image.height
    # A1111's sizes (integer arithmetic as there): the side that matches the target is the target's, the other
    # one follows the source's aspect ratio, rounded down.
    if mode == "crop":
        fit_width = ratio > src_ratio
    else:  # "fill"
        fit_width = ratio < src_ratio
    if fit_width:
        src_w, src_h = width, max(1, image.height * width // image.width)
    else:
        src_w, src_h = max(1, image.width * height // image.height), height
    resized = image.resize((src_w, src_h), resample=LANCZOS)
    x, y = width // 2 - src_w // 2, height // 2 - src_h // 2
    result = Image.new(image.mode, (width, height))
    result.paste(resized, (x, y))
    if mode == "crop":
        return result

    # The bands: the resized image's outermost row (column) stretched over the gap; NEAREST repeats it exactly.
    nearest = Image.Resampling.NEAREST if hasattr(Image, "Resampling") else Image.NEAREST
    below, right = height - (y + src_h), width - (x + src_w)
    if y > 0:
        result.paste(resized.crop((0, 0, src_w, 1)).resize((src_w, y), nearest), (x, 0))
    if below > 0:
        result.paste(resized.crop((0, src_h - 1, src_w, src_h)).resize((src_w, below), nearest), (x, y + src_h))
    if x > 0:
        result.paste(resized.crop((0, 0, 1, src_h)).resize((x, src_h), nearest), (0, y))
    if right > 0:
        result.paste(resized.crop((src_w - 1, 0, src_w, src_h)).resize((right, src_h), nearest), (x + src_w, y))
    return result


def _reflect101(index: np.ndarray, n: int) -> np.ndarray:
    """OpenCV's BORDER_REFLECT_101 (``gfedcb|abcdefgh|gfedcba``) for any index, also far outside ``0..n-1``."""
    if n == 1:
        return np.zeros_like(index)
    period = 2 * (n - 1)
    index = np.mod(index, period)
    return np.where(index < n, index, period - index)


def gaussian_kernel(radius: float) -> np.ndarray:
    """A1111's 1-D mask-blur kernel: standard deviation ``radius``, ``2 * int(2.5 * radius + 0.5) + 1`` taps,
    weights ``exp(-x^2 / (2 radius^2))`` normalised to sum 1 (OpenCV's ``getGaussianKernel``)."""
    size = 2 * int(2.5 * radius + 0.5) + 1
    x = np.arange(size, dtype=np.float64) - (size - 1) / 2
    kernel = np.exp(-(x * x) / (2.0 * radius * radius))
    return kernel / kernel.sum()


def _blur_axis(values: np.ndarray, kernel: np.ndarray, axis: int) -> np.ndarray:
    """Correlate ``values`` with ``kernel`` along ``axis`` (reflect-101 borders) and round to uint8."""
    n, half = values.shape[axis], len(kernel) // 2
    padded = np.take(values.astype(np.float64), _reflect101(np.arange(-half, n + half), n), axis=axis)
    out = np.zeros(values.shape, dtype=np.float64)
    for tap, weight in enumerate(kernel):
        out += weight * (padded[tap:tap + n] if axis == 0 else padded[:, tap:tap + n])
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def blur_mask(mask: Image.Image, radius: float) -> Image.Image:
    """A1111's mask blur of an "L" mask: Gaussian of standard deviation ``radius``, horizontal then vertical.

    Each pass is OpenCV's ``GaussianBlur`` with a 1-D kernel (see :func:`gaussian_kernel`) and reflect-101 borders,
    its result rounded to 8 bits (as A1111 does between the two passes); the weights are exact where OpenCV's
    8-bit path quantises them (a difference of a few levels). ``radius`` 0 returns an unchanged copy.
    """
    if radius < 0 or not math.isfinite(radius):
        raise ImageInputError(f"mask blur {radius!r} must be a non-negative number")
    mask = mask.convert("L")
    if radius == 0:
        return mask.copy()
    kernel = gaussian_kernel(radius)
    values = np.asarray(mask)
    values = _blur_axis(values, kernel, axis=1)
    values = _blur_axis(values, kernel, axis=0)
    return Image.fromarray(values, "L")


def _premultiplied(rgb: np.ndarray, alpha: np.ndarray) -> Image.Image:
    """An "RGBa" (premultiplied) image from RGB values and an alpha plane, rounded like PIL's paste blend."""
    a = alpha.astype(np.float64)[:, :, None]
    colour = np.rint(rgb.astype(np.float64) * a / 255.0)
    data = np.concatenate([colour, a], axis=2).astype(np.uint8)
    return Image.frombytes("RGBa", (rgb.shape[1], rgb.shape[0]), data.tobytes())


def fill_masked(image: Image.Image, mask: Image.Image) -> Image.Image:
    """A1111's inpainting fill "fill" (``masking.fill``): the masked area gets colours spread from around it.

    The image is made transparent where the mask is white (alpha = 255 - mask, premultiplied). It is then blurred
    with Gaussian radii 256, 64, 16, 4, 2, 0 (PIL ``GaussianBlur``), and each blurred layer is alpha-composited
    over the result so far (1, 1, 2, 4, 2, 1 times): wide blurs first reach deep into the hole, narrower ones then
    refine it near its edge, and the last (radius 0) layer puts the unmasked pixels back unchanged.
    Returns "RGB" at the image's size; ``mask`` ("L", 255 = masked) must have the same size.
    """
    rgb = np.asarray(to_rgb(image))
    mask = mask.convert("L")
    if mask.size != image.size:
        raise ImageInputError(f"mask: size {mask.width}x{mask.height} differs from the image's "
                              f"{image.width}x{image.height}")
    masked = _premultiplied(rgb, 255 - np.asarray(mask).astype(np.int16))
    result = Image.new("RGBA", image.size)
    for radius, repeats in _FILL_PASSES:
        layer = masked.filter(ImageFilter.GaussianBlur(radius)).convert("RGBA")
        for _ in range(repeats):
            result.alpha_composite(layer)
    return result.convert("RGB")


def crop_region(mask: Image.Image, padding: int, width: int, height: int) -> tuple[int, int, int, int]:
    """The box ``(x1, y1, x2, y2)`` (x2, y2 exclusive) to generate for inpaint area "masked" (A1111 "only masked").

    A1111's ``get_crop_region``: the bounding box of the mask's non-zero pixels, grown by ``padding`` on each side
    and clipped to the image. Then its ``expand_crop_region``: the shorter side (relative to the aspect ratio
    ``width``:``height`` of the generation size) is grown symmetrically (the odd pixel going to the bottom/right),
    shifted back inside the image where it runs over an edge, and clipped where the image is too small.
    """
    if padding < 0:
        raise ImageInputError(f"inpaint padding {padding} must not be negative")
    _check_dims(width, height)
    mask = mask.convert("L")
    box = mask.getbbox()
    if box is None:
        raise ImageInputError("the mask is all black: nothing to repaint (white marks the area to repaint)")
    image_w, image_h = mask.size
    x1, y1 = max(box[0] - padding, 0), max(box[1] - padding, 0)
    x2, y2 = min(box[2] + padding, image_w), min(box[3] + padding, image_h)

    ratio_box, ratio_gen = (x2 - x1) / (y2 - y1), width / height
    if ratio_box > ratio_gen:
        y1, y2 = _grow((x2 - x1) / ratio_gen, y1, y2, image_h)
    else:
        x1, x2 = _grow((y2 - y1) * ratio_gen, x1, x2, image_w)
    return x1, y1, x2, y2


def _grow(desired: float, lo: int, hi: int, limit: int) -> tuple[int, int]:
    """One side of A1111's ``expand_crop_region``: grow ``lo..hi`` to ``desired`` (truncated), keep it in 0..limit."""
    diff = int(desired - (hi - lo))
    lo -= diff // 2
    hi += diff - diff // 2
    if hi > limit:  # shift back inside at the far edge...
        lo, hi = lo - (hi - limit), limit
    if lo < 0:  # ...and at the near edge...
        lo, hi = 0, hi - lo
    return lo, min(hi, limit)  # ...and clip what still does not fit


def outpaint_canvas(image: Image.Image, left: int, top: int, right: int,
                    bottom: int) -> tuple[Image.Image, Image.Image]:
    """Grow the canvas by ``left``, ``top``, ``right``, ``bottom`` pixels for outpainting.

    Returns ``(canvas, mask)``: the "RGB" canvas of size (w + left + right, h + top + bottom) with the source at
    (left, top) and the new border pre-filled by replicating the source's edge pixels, and an "L" mask that is 255
    on the new border and 0 over the source. Each amount must be a non-negative multiple of 8, not all zero.
    """
    amounts = {"left": left, "top": top, "right": right, "bottom": bottom}
    for label, value in amounts.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ImageInputError(f"outpaint {label}={value!r} is not a whole number of pixels")
        if value < 0:
            raise ImageInputError(f"outpaint {label}={value} is negative")
        if value % 8:
            raise ImageInputError(f"outpaint {label}={value} is not a multiple of 8")
    if not any(amounts.values()):
        raise ImageInputError("outpaint: left, top, right and bottom are all 0: nothing to extend")
    rgb = np.asarray(to_rgb(image))
    h, w = rgb.shape[:2]
    _check_size((w + left + right, h + top + bottom), "outpaint canvas")
    canvas = np.pad(rgb, ((top, bottom), (left, right), (0, 0)), mode="edge")
    mask = np.full(canvas.shape[:2], 255, dtype=np.uint8)
    mask[top:top + h, left:left + w] = 0
    return Image.fromarray(canvas, "RGB"), Image.fromarray(mask, "L")


def apply_overlay(result: Image.Image, source: Image.Image, overlay_mask: Image.Image,
                  paste_box: tuple[int, int, int, int] | None = None, *,
                  double_mask: bool | None = None) -> Image.Image:
    """Paste the source back over a generated image, as A1111 does after inpainting; returns "RGB".

    ``overlay_mask`` is the (blurred) mask at the source's size ("L", 255 = repainted). With ``paste_box``
    ``(x1, y1, x2, y2)`` the result was generated for that crop of the source: it is resized to the box (A1111 uses
    its resize mode "crop", the inverse of the "fill" the crop was prepared with; for the same aspect ratio that is a
    plain LANCZOS resize) and pasted into a copy of the source. Without, the result must cover the whole source
    (resized with LANCZOS if its size differs).

    Then the source is composited over it with alpha ``255 - m``: where the mask is 0 the source's pixels come back
    exactly, where it is 255 the generated ones stay. A1111 doubles the mask first (``m = min(255, 2 * mask)``, so
    everything from 128 up keeps the generated pixels) for inpaint area "whole", but not for "only masked"; so does
    ``double_mask=None`` (doubled without ``paste_box``, not with it). ``True`` / ``False`` force either.
    """
    source_rgb = to_rgb(source)
    mask = overlay_mask.convert("L")
    if mask.size != source_rgb.size:
        raise ImageInputError(f"mask: size {mask.width}x{mask.height} differs from the source image's "
                              f"{source_rgb.width}x{source_rgb.height}")
    generated = to_rgb(result)
    if paste_box is not None:
        x1, y1, x2, y2 = (int(v) for v in paste_box)
        if not (0 <= x1 < x2 <= source_rgb.width and 0 <= y1 < y2 <= source_rgb.height):
            raise ImageInputError(f"paste box {tuple(paste_box)} does not lie inside the source image "
                                  f"({source_rgb.width}x{source_rgb.height})")
        base = source_rgb.copy()
        base.paste(resize_image(generated, x2 - x1, y2 - y1, "crop"), (x1, y1))
        generated = base
    elif generated.size != source_rgb.size:
        generated = generated.resize(source_rgb.size, resample=LANCZOS)

    if double_mask is None:
        double_mask = paste_box is None
    m = np.asarray(mask).astype(np.float64)
    if double_mask:
        m = np.minimum(255.0, 2.0 * m)
    alpha = (255.0 - m)[:, :, None] / 255.0
    out = np.asarray(source_rgb).astype(np.float64) * alpha + np.asarray(generated).astype(np.float64) * (1 - alpha)
    return Image.fromarray(np.clip(np.rint(out), 0, 255).astype(np.uint8), "RGB")


def fit_size(width: int, height: int, multiple: int = 8) -> tuple[int, int]:
    """A source of ``width`` x ``height`` pixels as a generation size: each side rounded down to a multiple of
    ``multiple`` (at least one multiple), as diffusers' image processor rounds an image to its scale factor (8: the
    VAE's; 16 for the transformers that patch 2x2 latents, FLUX.1 and Z-Image)."""
    return max(multiple, width // multiple * multiple), max(multiple, height // multiple * multiple)


def source_size(r, multiple: int = 8) -> tuple[int, int]:
    """The size an image-to-image request ``r`` is generated at where it leaves width or height unset: its source's
    as :func:`prepare` reads it (EXIF orientation applied, the outpaint border added), by :func:`fit_size`. Sides
    ``r`` gives are kept. Read before any model work, so that a family can fit the size to its patches."""
    try:
        image = load_image(r.init_image, "init image")
    except ImageInputError as e:
        raise RequestError(str(e)) from None
    left, top, right, bottom = r.outpaint or (0, 0, 0, 0)
    width, height = fit_size(image.width + left + right, image.height + top + bottom, multiple)
    return r.width or width, r.height or height


def prepare(r) -> "Source":
    """Read the source image (and mask) of an image-to-image request and prepare the pixels as A1111 does:
    outpaint canvas, mask inversion and blur, fitting to the generation size (or the crop around the mask),
    the fill mode's pre-fill. Returns the pixels to encode and what the paste-back needs."""
    try:
        loaded = load_image(r.init_image, "init image")
        mask = None
        if r.mask_from_alpha:
            mask = load_mask(loaded, "init image's transparency", from_alpha=True)
        elif r.mask is not None:
            mask = load_mask(r.mask, "mask")
        image = to_rgb(loaded)
        if mask is not None and mask.size != image.size:
            mask = mask.resize(image.size, Image.Resampling.LANCZOS).point(lambda v: 255 if v > 128 else 0)
        if mask is not None and r.invert_mask:
            mask = invert_mask(mask)
        if r.outpaint is not None:
            image, border = outpaint_canvas(image, *r.outpaint)
            if mask is None:
                mask = border
            else:  # the given mask over the source, plus the new border
                padded = Image.new("L", image.size, 0)
                padded.paste(mask, (r.outpaint[0], r.outpaint[1]))
                mask = Image.fromarray(np.maximum(np.asarray(padded), np.asarray(border)))
        if mask is not None:
            check_mask_not_empty(mask, "the mask" + (" (inverted)" if r.invert_mask else ""))
    except ImageInputError as e:
        raise RequestError(str(e)) from None
    # the source's size, rounded down to a multiple of 8 as diffusers' image processor does
    width, height = fit_size(image.width, image.height)
    width, height = r.width or width, r.height or height
    blurred = blur_mask(mask, r.mask_blur) if mask is not None and r.mask_blur else mask
    paste_box = None
    if mask is not None and r.inpaint_area == "masked":
        paste_box = crop_region(blurred, r.inpaint_padding, width, height)
        overlay_source, overlay_mask = image, blurred
        image = resize_image(image.crop(paste_box), width, height, "fill")
        blurred = resize_image(blurred.crop(paste_box), width, height, "fill")
    else:
        image = resize_image(image, width, height, r.resize_mode)
        if blurred is not None:
            blurred = resize_image(blurred, width, height, r.resize_mode)
        overlay_source, overlay_mask = image, blurred
    if blurred is not None and r.inpaint_fill == "fill":
        image = fill_masked(image, blurred)
    return Source(image=image, mask=blurred, width=width, height=height, overlay_source=overlay_source,
                  overlay_mask=overlay_mask, paste_box=paste_box)


@dataclass
class Source:
    """A prepared source: the pixels to encode (``image``, RGB at width x height) and their ``mask`` ("L",
    blurred, 255 = repaint; None for plain image to image), and what pasting back needs: the source as the
    user sees it (``overlay_source``), the blurred mask at its size, and the crop box the generation covered
    (``paste_box``, inpaint area "masked")."""

    image: Image.Image
    mask: Image.Image | None
    width: int
    height: int
    overlay_source: Image.Image
    overlay_mask: Image.Image | None
    paste_box: tuple[int, int, int, int] | None = None

    def finish(self, result: Image.Image, overlay: bool) -> Image.Image:
        """A generated image as the user gets it: pasted back into the source where only a crop was generated,
        and (``overlay``) with the source's pixels composited back outside the blurred mask, as A1111 does."""
        if overlay:
            return apply_overlay(result, self.overlay_source, self.overlay_mask, self.paste_box)
        if self.paste_box is None:
            return result
        x1, y1, x2, y2 = self.paste_box
        out = self.overlay_source.copy()
        out.paste(result.resize((x2 - x1, y2 - y1), Image.Resampling.LANCZOS), (x1, y1))
        return out


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image -> (1, 3, H, W) float32 in [-1, 1], as the reference's image processor normalises it."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(arr).permute(2, 0, 1)[None] * 2.0 - 1.0


def mask_to_tensor(mask: Image.Image) -> torch.Tensor:
    """An "L" mask -> (1, 1, H, W) of 0/1: repaint where the (blurred) mask is at least half white, as the
    reference binarises it."""
    arr = np.asarray(mask.convert("L"), dtype=np.float32) / 255.0
    return torch.from_numpy((arr >= 0.5).astype(np.float32))[None, None]
