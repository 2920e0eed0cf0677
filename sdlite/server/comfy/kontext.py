"""The nodes of ComfyUI's stock FLUX.1 Kontext dev workflow (Comfy-Org's ``flux_kontext_dev_basic`` template) that the
other families' graphs do not use, on sdlite: FluxKontextImageScale, ImageStitch and LoadImageOutput, and
FluxKontextMultiReferenceLatentMethod. The rest is the other modules': UNETLoader (``flux1-dev-kontext_fp8_scaled
.safetensors``: a file named "kontext" is a Kontext release), DualCLIPLoader of type ``flux`` and VAELoader
(``ae.safetensors``) are :mod:`.loaders`'; ReferenceLatent :mod:`.flux2`'s; ConditioningZeroOut :mod:`.zimage`'s;
CLIPTextEncode, FluxGuidance, VAEEncode, KSampler, VAEDecode, SaveImage and PreviewImage :mod:`.nodes`'.

The template's graph: LoadImageOutput (a second one bypassed) -> ImageStitch -> FluxKontextImageScale -> VAEEncode ->
ReferenceLatent on the prompt -> FluxGuidance 2.5 -> KSampler's positive, ConditioningZeroOut of the prompt as its
negative, the VAEEncode's latent as its ``latent_image`` at denoise 1 (pure noise at the scaled image's size; an
EmptySD3LatentImage, bypassed, is the template's other choice), 20 steps of euler / simple at cfg 1.

**FluxKontextImageScale** is ComfyUI's: the image resized to the one of Kontext's 17 preferred resolutions
(:data:`sdlite.families.flux_kontext.PREFERRED_RESOLUTIONS`) whose aspect ratio is nearest the image's (its own
size, not rounded first), by ``common_upscale`` with Lanczos (PIL's, on 8-bit images) after a centre crop to the
target's aspect ratio. Its input is ``image``, its output ``IMAGE``.

**ImageStitch** is ComfyUI's: ``image2`` (optional; without it ``image1`` passes unchanged) joined to ``image1`` on
the side ``direction`` says, resized (Lanczos, no crop) to ``image1``'s height (left, right) or width (up, down) where
``match_image_size``, else the narrower padded to the other's size, centred, with the spacing colour (black where the
colour is not grey); ``spacing_width`` pixels (rounded up to even) of ``spacing_color`` between them; batches of
different sizes repeat their last image.

**LoadImageOutput** is LoadImage on ComfyUI's output folder (names as ``"name.png [output]"``), as the template uses
it to edit an image a run saved.

**FluxKontextMultiReferenceLatentMethod** says how several references are placed: sdlite places them by ComfyUI's
``offset`` (each beside the ones before it, first axis 1: :func:`sdlite.models.flux.reference_ids`), the default; the
node with ``offset`` passes the conditioning on, and ``index`` or ``uxo/uno`` are refused at validation, naming them.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ...errors import RequestError
from ...families.flux_kontext import preferred_size
from . import images
from .nodes import COMBO, INT, LINK, Input, Refused, node

DIRECTIONS = ("right", "down", "left", "up")
SPACING_COLORS = {"white": (1.0, 1.0, 1.0), "black": (0.0, 0.0, 0.0), "red": (1.0, 0.0, 0.0),
                  "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0)}
REFERENCE_METHODS = ("offset", "index", "uxo/uno")


def kontext_scale(image: torch.Tensor) -> torch.Tensor:
    """FluxKontextImageScale: IMAGE (B, H, W, 3) at the preferred resolution nearest its aspect ratio."""
    width, height = preferred_size(image.shape[2], image.shape[1])
    scaled = images.common_upscale(image.permute(0, 3, 1, 2), width, height, "lanczos", "center")
    return scaled.permute(0, 2, 3, 1)


@node("FluxKontextImageScale", "FluxKontextImageScale", "advanced/conditioning/flux", {"image": LINK("IMAGE")},
      ("IMAGE",), description="This node resizes the image to one that is more optimal for flux kontext.")
def flux_kontext_image_scale(ctx, image):
    return (kontext_scale(image),)


def _repeat_last(image: torch.Tensor, batch: int) -> torch.Tensor:
    if image.shape[0] >= batch:
        return image
    return torch.cat([image, image[-1:].repeat(batch - image.shape[0], 1, 1, 1)])


def _pad_centred(image: torch.Tensor, dim: int, size: int, value: float) -> torch.Tensor:
    """``image`` (B, H, W, C) padded on both sides of ``dim`` (1: height, 2: width) to ``size``, centred."""
    missing = size - image.shape[dim]
    if missing <= 0:
        return image
    before = missing // 2
    pad = [0, 0, 0, 0, 0, 0]          # (C, W, H) pairs, last dimension first
    at = 2 * (3 - dim)
    pad[at], pad[at + 1] = before, missing - before
    return torch.nn.functional.pad(image, pad, mode="constant", value=value)


def stitch(image1: torch.Tensor, image2: torch.Tensor | None, direction: str, match_image_size: bool,
           spacing_width: int, spacing_color: str) -> torch.Tensor:
    """ImageStitch: ``image2`` joined to ``image1`` on its ``direction`` side (see the module's notes)."""
    if image2 is None:
        return image1
    batch = max(image1.shape[0], image2.shape[0])
    image1, image2 = _repeat_last(image1, batch), _repeat_last(image2, batch)
    across = direction in ("left", "right")
    colour = SPACING_COLORS[spacing_color]
    if match_image_size:
        (h1, w1), (h2, w2) = image1.shape[1:3], image2.shape[1:3]
        aspect = w2 / h2
        width, height = (int(h1 * aspect), h1) if across else (w1, int(w1 / aspect))
        image2 = images.common_upscale(image2.permute(0, 3, 1, 2), width, height, "lanczos",
                                       "disabled").permute(0, 2, 3, 1)
    else:
        dim = 1 if across else 2
        size = max(image1.shape[dim], image2.shape[dim])
        value = colour[0] if len(set(colour)) == 1 else 0.0
        image1, image2 = _pad_centred(image1, dim, size, value), _pad_centred(image2, dim, size, value)
    parts = [image2, image1] if direction in ("left", "up") else [image1, image2]
    if spacing_width > 0:
        spacing_width += spacing_width % 2
        shape = ((batch, max(image1.shape[1], image2.shape[1]), spacing_width, 3) if across
                 else (batch, spacing_width, max(image1.shape[2], image2.shape[2]), 3))
        parts.insert(1, torch.tensor(colour, dtype=image1.dtype).expand(shape))
    if any(p.shape[1 if across else 2] != parts[0].shape[1 if across else 2] for p in parts):
        sizes = " and ".join("x".join(map(str, (p.shape[2], p.shape[1]))) for p in (image1, image2))
        raise RequestError(f"ImageStitch: images of {sizes} cannot be joined {direction}: their "
                           f"{'heights' if across else 'widths'} differ")
    return torch.cat(parts, dim=2 if across else 1)


@node("ImageStitch", "Image Stitch", "image/transform",
      {"image1": LINK("IMAGE"), "direction": COMBO(DIRECTIONS, default="right"),
       "match_image_size": Input("BOOLEAN", {"default": True}), "spacing_width": INT(0, 0, 1024, 2),
       "spacing_color": COMBO(tuple(SPACING_COLORS), default="white"), "image2": LINK("IMAGE", required=False)},
      ("IMAGE",), description="Stitches image2 to image1 in the specified direction; without image2, image1 "
                              "unchanged.")
def image_stitch(ctx, image1, direction, match_image_size, spacing_width, spacing_color, image2=None):
    return (stitch(image1, image2, direction, match_image_size, spacing_width, spacing_color),)


OUTPUT = " [output]"


def output_images(lists) -> list[str]:
    """The output folder's images as LoadImageOutput lists them: ``"name [output]"``."""
    return [name + OUTPUT for name in images.input_images(getattr(lists.dirs, "output", None))]


def _output_name(image: str) -> str:
    return re.sub(r"\s*\[output\]$", "", image)


def _output_stamp(inputs: dict, lists):
    folder = getattr(lists.dirs, "output", None)
    name = inputs.get("image")
    return images.file_stamp(folder, _output_name(name)) if isinstance(name, str) else None


@node("LoadImageOutput", "Load Image (from Outputs)", "image",
      {"image": COMBO(output_images, image_upload=True, image_folder="output")}, ("IMAGE", "MASK"),
      changed=_output_stamp,
      description="Load an image from the output folder (to edit an image a run saved).")
def load_image_output(ctx, image):
    name = _output_name(image)
    folder = Path(ctx.dirs.output)
    if not (folder / name).is_file():
        raise RequestError(f"LoadImageOutput (node {ctx.node_id}): image {name!r} is not in the output folder")
    return images.load_image(folder, name)


def _refuse_method(values: dict, lists) -> None:
    method = values.get("reference_latents_method")
    if method != "offset":
        raise Refused("reference_latents_method", f"{method!r}: sdlite places FLUX.1 Kontext's references by "
                                                  "'offset' (ComfyUI's default) only")


@node("FluxKontextMultiReferenceLatentMethod", "Edit Model Reference Method", "advanced/conditioning/flux",
      {"conditioning": LINK("CONDITIONING"), "reference_latents_method": COMBO(REFERENCE_METHODS)},
      ("CONDITIONING",), refuse=_refuse_method)
def flux_kontext_multi_reference_latent_method(ctx, conditioning, reference_latents_method):
    return (conditioning,)


__all__ = ["kontext_scale", "stitch", "output_images"]
