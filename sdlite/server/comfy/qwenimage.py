"""The nodes of ComfyUI's stock Qwen-Image-Edit workflows (Comfy-Org's ``image_qwen_image_edit`` and
``image_qwen_image_edit_2509`` templates) that the other families' graphs do not use, on sdlite:
TextEncodeQwenImageEdit, TextEncodeQwenImageEditPlus, CFGNorm and ImageScaleToTotalPixels. The rest is the other
modules': UNETLoader (``qwen_image_edit_fp8_e4m3fn.safetensors``, ``qwen_image_edit_2509_fp8_e4m3fn``: a file named
``qwen_image_edit*`` is an editing release, 2509 / 2511 in the name the Plus one), CLIPLoader of type ``qwen_image``
(``qwen_2.5_vl_7b_fp8_scaled.safetensors``, its vision tower read under ``visual.``) and VAELoader
(``qwen_image_vae.safetensors``) are :mod:`.loaders`'; LoraLoaderModelOnly (the Lightning LoRA, bypassed in the
templates), LoadImage, VAEEncode, KSampler, VAEDecode and SaveImage :mod:`.nodes`'; ModelSamplingAuraFlow
:mod:`.zimage`'s; FluxKontextImageScale (2509's image scaling) :mod:`.kontext`'s.

The templates' graph: LoadImage -> ImageScaleToTotalPixels (Edit) or FluxKontextImageScale (2509) -> VAEEncode as
KSampler's ``latent_image`` (denoise 1: pure noise at that image's size); the same image into two
TextEncodeQwenImageEdit(Plus) nodes with the CLIP and the VAE, the instruction as the positive and "" as the negative;
UNETLoader -> ModelSamplingAuraFlow (shift 3) -> CFGNorm (1) -> KSampler (20 steps, cfg 2.5, euler, simple; with the
4-step Lightning LoRA 4 steps at cfg 1).

**TextEncodeQwenImageEdit** (``image``) and **TextEncodeQwenImageEditPlus** (``image1`` .. ``image3``) make a
conditioning of the prompt whose images are the request's ``reference_images``: KSampler's run becomes a
:class:`~sdlite.pipeline.Request` with the positive's text, the negative's text and the positive's images (every
image of a batch, in the order of the inputs), and the family prepares them as diffusers' pipelines do
(:mod:`sdlite.families.qwenimage_edit`): each image to the vision tower in the edit template (Edit: at about 1024^2
pixels; Plus: about 384^2, "Picture N:" before each) and its mean latent at about 1024^2 pixels into the transformer's
sequence. The negative is encoded with the positive's images (the templates give both the same); a negative node's own
images are not read. Where this differs from ComfyUI's own preparation:

* ComfyUI resizes with ``area`` (torch's adaptive average), the sides ``round(side * scale)`` (the reference latents of
  Plus rounded to multiples of 8, the VAE then cropping to multiples of 8); sdlite with Lanczos, the sides rounded to
  multiples of 32 (diffusers' ``calculate_dimensions``). The vision tower's own fit to multiples of 28 pixels is
  Qwen2-VL's image processor's in both;
* ComfyUI numbers Plus's pictures by input (an ``image2`` alone is "Picture 2"); sdlite numbers the images given, in
  order (it is "Picture 1");
* a ``vae`` left unconnected in ComfyUI keeps the images out of the transformer's sequence (the model sees them only
  through the vision tower; the 2509 template's bypassed "raw latent" group then adds a VAEEncode's latent by
  ReferenceLatent). sdlite's family always places the images it reads in the sequence, so a node with images and no
  ``vae`` is refused when it runs, naming the node; ReferenceLatent's latents (pixels' latents, not pixels) are refused
  by the family.

**CFGNorm** (``strength``) is ComfyUI's norm rescale after its plain CFG: the guided x0 scaled, pixel by pixel over
the channels, to at most the prompt's own x0 norm. sdlite's Qwen-Image guides as its pipeline does, always: the guided
velocity rescaled, per 2 x 2 latent patch, to the prompt's own velocity's norm (:func:`sdlite.families.qwenimage.
true_cfg`; no clamp); so CFGNorm at strength 1 passes the model on, and without CFGNorm sdlite still rescales (ComfyUI
does not). At cfg 1 (the Lightning LoRA's) neither rescales anything. A strength other than 1 is refused at
validation; CFGNorm on a model other than Qwen-Image when the sampler runs (:func:`.modelsampling.check_sampling`).
ComfyUI's newer ``pre_cfg`` (rescale before the combine, unclamped) is the closer of its two to sdlite's; both are
taken as the pipeline's rescale.

**ImageScaleToTotalPixels** is ComfyUI's: the image resized (``upscale_method``, no crop) to about ``megapixels`` x
1024^2 pixels at its aspect ratio, each side ``round(side * scale / resolution_steps) * resolution_steps``.

**The schedule.** ComfyUI samples Qwen-Image with ModelSamplingDiscreteFlow at shift 1.15 (ModelSamplingAuraFlow's
shift in the templates), not with the pipeline's shift by image size: the sampler's sigmas are ComfyUI's
(:mod:`.modelsampling`).
"""
from __future__ import annotations

import dataclasses
import math

from ...errors import RequestError
from . import images
from ..limits import check_size
from .nodes import COMBO, FLOAT, INT, LINK, Cond, Input, Refused, node

__all__ = ["total_pixels_size", "reference_images"]

EDIT_CATEGORY = "advanced/conditioning"


def total_pixels_size(width: int, height: int, megapixels: float, steps: int = 1) -> tuple[int, int]:
    """ImageScaleToTotalPixels' (width, height): about ``megapixels`` x 1024^2 pixels at the aspect ratio, each side
    rounded to a multiple of ``steps``."""
    scale = math.sqrt(int(megapixels * 1024 * 1024) / (width * height))
    return round(width * scale / steps) * steps, round(height * scale / steps) * steps


@node("ImageScaleToTotalPixels", "Scale Image to Total Pixels", "image/upscaling",
      {"image": LINK("IMAGE"), "upscale_method": COMBO(images.UPSCALE_METHODS),
       "megapixels": FLOAT(1.0, 0.01, 16.0), "resolution_steps": INT(1, 1, 256)}, ("IMAGE",))
def image_scale_to_total_pixels(ctx, image, upscale_method, megapixels, resolution_steps=1):
    width, height = total_pixels_size(image.shape[2], image.shape[1], megapixels, resolution_steps)
    check_size(width, height, ctx.server.limits, "the scaled image's width x height")
    scaled = images.common_upscale(image.permute(0, 3, 1, 2), width, height, upscale_method, "disabled")
    return (scaled.permute(0, 2, 3, 1),)


def reference_images(ctx, name: str, vae, given: list) -> tuple:
    """The node's images (IMAGE tensors or None, in input order) as PIL images, every image of each batch; a node with
    images and no ``vae`` is refused (see the module's notes)."""
    found = [im for image in given if image is not None for im in images.to_pil(image[..., :3])]
    if found and vae is None:
        raise RequestError(f"{name} (node {ctx.node_id}): images without a vae: ComfyUI then keeps the images out of "
                           "the transformer's sequence (the model sees them through the vision tower only), which "
                           "sdlite's Qwen-Image-Edit does not do: it always places the images it reads. Connect the "
                           "VAE (as the stock templates do)")
    return tuple(found)


_PROMPT = Input("STRING", {"multiline": True, "dynamicPrompts": True})


@node("TextEncodeQwenImageEdit", "TextEncodeQwenImageEdit", EDIT_CATEGORY,
      {"clip": LINK("CLIP"), "prompt": _PROMPT, "vae": LINK("VAE", required=False),
       "image": LINK("IMAGE", required=False)}, ("CONDITIONING",),
      description="Qwen-Image-Edit: the prompt with its source image, read by the text encoder's vision tower and "
                  "placed in the transformer's sequence")
def text_encode_qwen_image_edit(ctx, clip, prompt, vae=None, image=None):
    found = reference_images(ctx, "TextEncodeQwenImageEdit", vae, [image])
    return ([Cond(prompt, clip, references=found)],)


@node("TextEncodeQwenImageEditPlus", "TextEncodeQwenImageEditPlus", EDIT_CATEGORY,
      {"clip": LINK("CLIP"), "prompt": _PROMPT, "vae": LINK("VAE", required=False),
       "image1": LINK("IMAGE", required=False), "image2": LINK("IMAGE", required=False),
       "image3": LINK("IMAGE", required=False)}, ("CONDITIONING",),
      description="Qwen-Image-Edit-2509 / 2511: the prompt with up to 3 images, each read by the text encoder's "
                  "vision tower and placed in the transformer's sequence")
def text_encode_qwen_image_edit_plus(ctx, clip, prompt, vae=None, image1=None, image2=None, image3=None):
    found = reference_images(ctx, "TextEncodeQwenImageEditPlus", vae, [image1, image2, image3])
    return ([Cond(prompt, clip, references=found)],)


def _refuse_strength(values: dict, lists) -> None:
    strength = values.get("strength", 1.0)
    if strength != 1.0:
        raise Refused("strength", f"{strength!r}: sdlite's Qwen-Image rescales the guided prediction to the norm of "
                                  "the prompt's own, as its pipeline does (CFGNorm at strength 1); other strengths "
                                  "are not computed")


@node("CFGNorm", "CFGNorm", "advanced/guidance",
      {"model": LINK("MODEL"), "strength": FLOAT(1.0, 0.0, 100.0),
       "pre_cfg": Input("BOOLEAN", {"default": False}, required=False)}, ("MODEL",),
      output_names=("patched_model",), refuse=_refuse_strength,
      description="Qwen-Image: the guided prediction rescaled to the norm of the prompt's own (sdlite: as the "
                  "pipeline's true CFG does)")
def cfg_norm(ctx, model, strength, pre_cfg=False):
    return (dataclasses.replace(model, cfg_norm=float(strength)),)
