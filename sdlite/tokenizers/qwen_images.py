"""Qwen2.5-VL's image processor: images in, the vision tower's patches out (what a tokenizer is to text).

Each image, as transformers' ``Qwen2VLImageProcessor`` prepares it (its PIL flavour, ``Qwen2VLImageProcessorPil``,
which transformers uses where torchvision is not installed):

1. **RGB**: an image with an alpha band (or a palette's transparency) is laid over white, any other mode converted.
2. **Size** (:func:`smart_resize`): both sides rounded to multiples of ``factor = patch_size * merge_size`` (28),
   then, if the area is over ``max_pixels``, scaled down (rounding down), or if under ``min_pixels``, scaled up
   (rounding up), keeping the aspect ratio as closely as whole units allow; resized with PIL's bicubic filter.
3. **Values**: ``x / 255`` (computed in float64, stored as float32), then ``(x - mean) / std`` per channel in
   float32, with OpenAI CLIP's mean and std.
4. **Patches**: the (C, H, W) image cut into ``patch_size`` squares in *merge-block order*: the ``merge_size`` x
   ``merge_size`` patches of a merged unit next to each other, the units row by row. Each patch is repeated
   ``temporal_patch_size`` times (an image is a clip of one frame, the tower's Conv3d wants two) and flattened
   channel-major: one row of ``C * T * P * P`` = 1176 values.

:func:`vision_patches` returns all images' rows stacked, ``pixel_values`` float32 (N, 1176), and ``grid_thw`` long
(k, 3): (1, H / 14, W / 14) per image. The values are equal (``torch.equal``) to ``Qwen2VLImageProcessorPil``'s. The
tower turns each image into ``t * h * w / merge ** 2`` tokens, the count of ``<|image_pad|>`` tokens Qwen2VLProcessor
writes for it in the prompt (:func:`image_tokens`).

Public API::

    smart_resize(height, width, factor=28, min_pixels=3136, max_pixels=12845056) -> (height, width)
    vision_patches(images, min_pixels=..., max_pixels=...)  -> (pixel_values (N, 1176), grid_thw (k, 3))
    image_tokens(grid_thw, merge=2)                          -> [tokens of image 0, ...]
    processor_settings(preprocessor_config)                  -> vision_patches' keyword arguments of a folder's
                                                                preprocessor_config.json
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from ..config.qwen_vision import (
    VISION_IMAGE_MEAN, VISION_IMAGE_STD, VISION_MAX_PIXELS, VISION_MERGE_SIZE, VISION_MIN_PIXELS, VISION_PATCH_SIZE,
    VISION_TEMPORAL_PATCH_SIZE,
)

__all__ = ["smart_resize", "vision_patches", "image_tokens", "processor_settings", "MAX_ASPECT_RATIO"]

#: the longest side may be at most this many times the shortest (Qwen2VLImageProcessor refuses more)
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int = VISION_PATCH_SIZE * VISION_MERGE_SIZE,
                 min_pixels: int = VISION_MIN_PIXELS, max_pixels: int = VISION_MAX_PIXELS) -> tuple[int, int]:
    """The (height, width) an image of ``height`` x ``width`` is resized to: multiples of ``factor``, an area within
    ``[min_pixels, max_pixels]`` where whole units allow it, the aspect ratio kept as closely as they allow. A side
    below 1 or an aspect ratio over 200 is a ValueError."""
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Qwen image size: {name} {value!r} is not a positive whole number of pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"Qwen image size {width}x{height}: an aspect ratio of "
                         f"{max(height, width) / min(height, width):g}, over the {MAX_ASPECT_RATIO} the vision "
                         "tower accepts")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _rgb(image: Image.Image) -> Image.Image:
    """The image in RGB; transparency laid over white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _patches(chw: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """(C, H, W) -> (H/P * W/P, C * T * P * P), patches in merge-block order, each repeated T times."""
    c, height, width = chw.shape
    gh, gw = height // patch, width // patch
    x = chw.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)                                    # (gh/m, gw/m, m, m, C, P, P)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
    return x.reshape(gh * gw, c * temporal * patch * patch)


def vision_patches(images: Sequence[Image.Image], min_pixels: int = VISION_MIN_PIXELS,
                   max_pixels: int = VISION_MAX_PIXELS, *, patch_size: int = VISION_PATCH_SIZE,
                   merge_size: int = VISION_MERGE_SIZE, temporal_patch_size: int = VISION_TEMPORAL_PATCH_SIZE,
                   image_mean: Sequence[float] = VISION_IMAGE_MEAN,
                   image_std: Sequence[float] = VISION_IMAGE_STD) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values, grid_thw)`` of ``images`` (PIL images): float32 (N, 3 * T * P * P) and long (k, 3), see the
    module's notes. Anything but a PIL image, an empty image or one too narrow (aspect ratio over 200) is a
    ValueError naming the image's index and size."""
    if isinstance(images, Image.Image):
        images = [images]
    if not isinstance(images, Sequence) or not images:
        raise ValueError(f"Qwen image processor: expected a non-empty list of PIL images, got {images!r:.80}")
    factor = patch_size * merge_size
    mean = np.array(image_mean, dtype=np.float32)
    std = np.array(image_std, dtype=np.float32)
    rows, grids = [], []
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"Qwen image processor: image {i} is a {type(image).__name__}, not a PIL image")
        width, height = image.size
        if width < 1 or height < 1:
            raise ValueError(f"Qwen image processor: image {i} is {width}x{height} pixels; it has no pixels")
        try:
            new_h, new_w = smart_resize(height, width, factor, min_pixels, max_pixels)
        except ValueError as e:
            raise ValueError(f"Qwen image processor: image {i} ({width}x{height}): {e}") from None
        rgb = _rgb(image).resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
        x = (np.asarray(rgb).astype(np.float64) * (1 / 255)).astype(np.float32)   # (H, W, 3)
        x = (x - mean) / std
        rows.append(_patches(np.ascontiguousarray(x.transpose(2, 0, 1)), patch_size, merge_size,
                             temporal_patch_size))
        grids.append((1, new_h // patch_size, new_w // patch_size))
    return torch.from_numpy(np.concatenate(rows, axis=0)), torch.tensor(grids, dtype=torch.long)


def image_tokens(grid_thw, merge: int = VISION_MERGE_SIZE) -> list[int]:
    """How many ``<|image_pad|>`` tokens each image of ``grid_thw`` ((k, 3) tensor or rows of (t, h, w)) stands for:
    ``t * h * w / merge ** 2``, one per token of the vision tower's output."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(r) for r in grid_thw]
    counts = []
    for i, row in enumerate(rows):
        if len(row) != 3:
            raise ValueError(f"Qwen image grid {i}: {row!r} is not (frames, rows, columns)")
        t, h, w = (int(v) for v in row)
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(f"Qwen image grid {i}: (t={t}, h={h}, w={w}) is not whole {merge}x{merge} units")
        counts.append(t * h * w // merge ** 2)
    return counts


def processor_settings(config: dict) -> dict:
    """:func:`vision_patches`' keyword arguments from a ``preprocessor_config.json`` (a Qwen2VLImageProcessor's:
    ``min_pixels`` / ``max_pixels``, or transformers 5's ``size`` of ``shortest_edge`` / ``longest_edge``,
    ``patch_size``, ``merge_size``, ``temporal_patch_size``, ``image_mean``, ``image_std``); what is missing keeps
    the released defaults. A bilinear or other resample, or switched-off rescaling or normalisation, is refused."""
    if not isinstance(config, dict):
        raise ValueError(f"a Qwen preprocessor config is a JSON object, got {type(config).__name__}")
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    out = {
        "min_pixels": config.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", VISION_MIN_PIXELS))),
        "max_pixels": config.get("max_pixels", size.get("longest_edge", size.get("max_pixels", VISION_MAX_PIXELS))),
        "patch_size": config.get("patch_size", VISION_PATCH_SIZE),
        "merge_size": config.get("merge_size", VISION_MERGE_SIZE),
        "temporal_patch_size": config.get("temporal_patch_size", VISION_TEMPORAL_PATCH_SIZE),
        "image_mean": tuple(config.get("image_mean", VISION_IMAGE_MEAN)),
        "image_std": tuple(config.get("image_std", VISION_IMAGE_STD)),
    }
    for name in ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size"):
        value = out[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Qwen preprocessor config field {name}={value!r}: expected a positive integer")
    for name in ("image_mean", "image_std"):
        if len(out[name]) != 3 or not all(isinstance(v, (int, float)) for v in out[name]):
            raise ValueError(f"Qwen preprocessor config field {name}={list(out[name])!r}: expected 3 numbers")
    if any(v <= 0 for v in out["image_std"]):
        raise ValueError(f"Qwen preprocessor config field image_std={list(out['image_std'])!r}: expected numbers > 0")
    if config.get("resample", 3) != 3:
        raise ValueError(f"Qwen preprocessor config field resample={config['resample']!r} is not supported "
                         "(expected 3: bicubic)")
    if abs(config.get("rescale_factor", 1 / 255) - 1 / 255) > 1e-12:
        raise ValueError(f"Qwen preprocessor config field rescale_factor={config['rescale_factor']!r} is not "
                         "supported (expected 1/255)")
    for name in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if config.get(name, True) is not True:
            raise ValueError(f"Qwen preprocessor config field {name}={config[name]!r} is not supported "
                             "(expected true)")
    return out
