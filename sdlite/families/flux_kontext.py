"""FLUX.1 Kontext (Black Forest Labs, 2025): instruction editing on FLUX.1 dev's network. The source image's latents
join the transformer's sequence after the image's tokens, with position ids whose first axis is 1
(:func:`sdlite.models.flux.reference_ids`); the transformer's output for them is dropped. This module prepares those
latents from ``Request.reference_images`` for :class:`~sdlite.families.flux.FluxFamily`, as diffusers'
``FluxKontextPipeline`` does:

* the image's sides rounded down to multiples of 16 pixels (the pipeline's image processor, of scale factor 16);
* a Kontext release (family ``flux-kontext``: a ``FluxKontextPipeline`` folder, or "kontext" in a file's name) then
  resizes it to the one of the 17 resolutions Kontext was trained at (:data:`PREFERRED_RESOLUTIONS`, about 1024^2
  pixels each) whose aspect ratio is nearest to the image's (the pipeline's ``_auto_resize``, on by default;
  ``Request.reference_resize=False``, the CLI's ``--no-ref-resize``, keeps the image's own size);
* the resize is PIL's Lanczos (a no-op where the size is kept), the pixels scaled to [-1, 1];
* encoded to the VAE's mean latent (the pipeline's ``sample_mode="argmax"``), then FLUX's shift and scale; a latent
  given as the reference (ComfyUI's ReferenceLatent after a VAEEncode) is taken as it is.

Any FLUX.1 dev-architecture model takes a reference image this way (ComfyUI's ReferenceLatent gives one to whatever
FLUX.1 model it conditions); only a Kontext release resizes it by default. More than one reference: diffusers'
pipeline takes one image; sdlite takes several as ComfyUI's chained ReferenceLatents place them (each with first
axis 1, beside the ones before it).

Inpainting with a Kontext release, as diffusers' ``FluxKontextInpaintPipeline`` runs it: the source image
(``Request.init_image`` with ``mask``, outpainting or a mask from its transparency) drawn, where no size is given, at
its Kontext size (:func:`inpaint_size`: its sides rounded down to 16, then the preferred resolution nearest its aspect
unless ``reference_resize`` is off; the pipeline's ``image`` always takes that size), encoded to its mean latent,
which is the start (noised to ``strength``) and the latent the unmasked region is re-imposed from after each step
(the mask binarised at 0.5 and nearest to the latent grid); the source as prepared for the run is also the one
reference in the sequence (:func:`source_reference`). ``Request.reference_images`` given with the inpainting source
are the pipeline's ``image_reference``: they take the source's place in the sequence (the pipeline places its
``image_reference`` instead of the source, not beside it), each prepared as a reference. The pipeline's
``padding_mask_crop`` is sdlite's ``inpaint_area="masked"`` with ``inpaint_padding`` (A1111's crop around the mask;
the reference is the crop too), and the mask blur and overlay are A1111's options (``mask_blur=0, overlay=False`` for
the pipeline's exact behaviour).

Where sdlite's defaults differ from the pipeline's, on purpose: the output size left unset is the (resized) first
reference's, as in ComfyUI's Kontext template (which samples at the scaled image's size), where the pipeline draws
1024 x 1024; a size given is drawn as given, where the pipeline rescales any size to about ``max_area`` (1024^2)
pixels at its aspect ratio. The distilled guidance scale of a Kontext release is 2.5 by default: the model card's
and ComfyUI's Kontext template's (``FluxKontextPipeline``'s argument defaults to FLUX.1 dev's 3.5).
"""
from __future__ import annotations

import torch
from PIL import Image

from ..errors import RequestError
from ..sources import image_to_tensor, load_image, prepare, source_size, to_rgb

__all__ = ["PREFERRED_RESOLUTIONS", "KONTEXT_GUIDANCE", "KONTEXT_FAMILY", "preferred_size", "kontext_size",
           "kontext_image", "reference_size", "encode_references", "inpaint_size", "source_reference"]

KONTEXT_FAMILY = "flux-kontext"
KONTEXT_GUIDANCE = 2.5        # the Kontext dev model card's guidance scale, and ComfyUI's template's FluxGuidance
SIDE = 16                     # a reference's sides: multiples of 16 pixels (2 x 2 patches of the 8x VAE latent)
VAE_DOWNSCALE = 8
# (width, height) of the resolutions Kontext was trained at: FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS
PREFERRED_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024),
    (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688), (1568, 672),
)


def preferred_size(width: int, height: int) -> tuple[int, int]:
    """The preferred resolution (width, height) whose aspect ratio is nearest to ``width / height`` (on a tie the
    narrower, as the pipeline's ``min`` over (distance, width, height) picks)."""
    aspect = width / height
    _, w, h = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_RESOLUTIONS)
    return w, h


def kontext_size(width: int, height: int, resize: bool, what: str = "reference image 1") -> tuple[int, int]:
    """The size (width, height) an image of ``width`` x ``height`` pixels is given before encoding: its sides rounded
    down to multiples of 16, then (``resize``) the nearest preferred resolution by aspect ratio."""
    w, h = width - width % SIDE, height - height % SIDE
    if w < SIDE or h < SIDE:
        raise RequestError(f"{what} is {width}x{height}: both sides must be at least {SIDE} pixels")
    if resize:
        w, h = preferred_size(w, h)
    return w, h


def kontext_image(source, index: int, resize: bool) -> Image.Image:
    """Reference image ``index`` (a path or a PIL image) at its :func:`kontext_size`, RGB (Lanczos where the size
    changes, as the pipeline's image processor resizes)."""
    what = f"reference image {index + 1}"
    image = to_rgb(load_image(source, what))
    size = kontext_size(*image.size, resize, what)
    return image if image.size == size else image.resize(size, Image.Resampling.LANCZOS)


def reference_size(source, index: int, resize: bool) -> tuple[int, int]:
    """(width, height) in pixels of reference ``index`` as it is encoded; an encoded latent's: 8 pixels a value."""
    if isinstance(source, torch.Tensor):
        return source.shape[3] * VAE_DOWNSCALE, source.shape[2] * VAE_DOWNSCALE
    return kontext_image(source, index, resize).size


def encode_references(family, model, r, resize: bool) -> tuple[torch.Tensor, ...]:
    """The request's reference images as latents (1, 16, H/8, W/8) in the sampler's scaling: each image at its
    :func:`kontext_size`, encoded to the VAE's mean latent; a latent given as it is (its channels checked; sides
    even, but on ComfyUI's sampling any, the network padding an odd one as ComfyUI does)."""
    channels = family.latent.channels
    even = r.noise != "comfy"   # a ComfyUI latent may have an odd side
    out = []
    for i, source in enumerate(r.reference_images):
        if isinstance(source, torch.Tensor):
            if source.shape[1] != channels or (even and (source.shape[2] % 2 or source.shape[3] % 2)):
                raise RequestError(f"reference image {i + 1}: a latent of shape {tuple(source.shape)}; this model's "
                                   f"references are {channels}-channel latents with even sides (encode the image "
                                   "with its own VAE at a multiple of 16 pixels)")
            out.append(source.float().to(model.device))
            continue
        pixels = image_to_tensor(kontext_image(source, i, resize))                   # (1, 3, H, W) in [-1, 1]
        with torch.no_grad(), model.models.use("vae") as vae:
            mean, _ = vae.encode_moments(pixels.to(model.device, vae.dtype))
        out.append(family.latent.scale(mean.float()))
    return tuple(out)


def inpaint_size(r, resize: bool):
    """Kontext inpainting's request ``r`` with its unset sides filled as FluxKontextInpaintPipeline sizes its output:
    the source's size (the outpaint border included) rounded down to multiples of 16, then (``resize``) the
    preferred resolution nearest its aspect ratio. Sides ``r`` gives are kept (the source is resized to them)."""
    if r.width is not None and r.height is not None:
        return r
    width, height = source_size(r, SIDE)
    if resize:
        width, height = preferred_size(width, height)
    return r.replace(width=r.width or width, height=r.height or height)


def source_reference(family, model, r) -> torch.Tensor:
    """The inpainting source of ``r`` as prepared for the run (its size, crop, outpaint canvas and fill) encoded to
    the VAE's mean latent in the sampler's scaling, (1, 16, H/8, W/8): Kontext inpainting's reference in the sequence
    (the pipeline's ``image_latents``)."""
    # the mean latent, remembered for the engine's start latent (LoadedModel.encode_image)
    return model.encode_image(image_to_tensor(prepare(r).image), None)
