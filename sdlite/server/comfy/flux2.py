"""The nodes of ComfyUI's stock FLUX.2 [klein] workflows (Comfy-Org's ``image_flux2_klein`` text-to-image and image
edit templates) that the other families' graphs do not use, on sdlite: EmptyFlux2LatentImage, Flux2Scheduler and
ReferenceLatent. The rest is the other modules': UNETLoader (``flux-2-klein-4b.safetensors``), CLIPLoader of type
``flux2`` (the Qwen3 text encoder, ``qwen_3_4b.safetensors``; klein 9B's ``qwen_3_8b``) and VAELoader
(``flux2-vae.safetensors``) are :mod:`.loaders`'; CLIPTextEncode, LoadImage, VAEEncode, KSampler, VAEDecode and
SaveImage :mod:`.nodes`'.

**The sampler.** The stock templates sample with SamplerCustomAdvanced over RandomNoise, CFGGuider, KSamplerSelect
and Flux2Scheduler (:mod:`.custom`), which run as they are: Flux2Scheduler's sigmas reach the sampler unchanged. The
same graph with a KSampler (``euler``, cfg 1 for the distilled model) also runs; its sigmas are ComfyUI's scheduler's
on the model's flow table, not Flux2Scheduler's.

**EmptyFlux2LatentImage** is ComfyUI's: zeros (B, 128, H/16, W/16), the 32-channel VAE latent cut into 2 x 2 patches.
A model whose patch latents have other channels (a tiny test model) takes zeros of its own (the sampler's
``fix_empty_latent_channels``).

**Flux2Scheduler**'s sigmas: ``linspace(1, 0, steps + 1)`` through the time shift ``e^mu / (e^mu + (1/t - 1))``, mu
FLUX.2's empirical fit (:func:`sdlite.families.flux2.empirical_mu`) for ``width * height / 256`` tokens and the steps.

**ReferenceLatent** appends a VAEEncode's latent to the conditioning's reference latents (the editing templates feed
each image through ImageScaleToTotalPixels and VAEEncode; without a latent the conditioning passes unchanged). The
sampler hands the positive's references to the engine as ``Request.reference_images`` (encoded: the VAE's mean latent,
what the family would make of the image itself); FLUX.2 conditions both guidance halves on them, so a negative's
ReferenceLatent (the templates give both halves the same images) adds nothing. A model that does not edit from
references (anything but FLUX.2 [klein]) refuses them at run time, naming it.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ...config import MAX_BATCH, MAX_STEPS
from ...errors import RequestError
from ...families.flux2 import empirical_mu
from ...pipeline.request import MAX_REFERENCE_IMAGES
from .nodes import INT, LINK, MAX_RESOLUTION, node

FLUX2_LATENT_CHANNELS = 128   # 32 VAE channels x 2 x 2 patches
FLUX2_DOWNSCALE = 16          # pixels per patch latent


@node("EmptyFlux2LatentImage", "Empty Flux 2 Latent", "latent",
      {"width": INT(1024, 16, MAX_RESOLUTION, 16), "height": INT(1024, 16, MAX_RESOLUTION, 16),
       "batch_size": INT(1, 1, MAX_BATCH)}, ("LATENT",))
def empty_flux2_latent(ctx, width, height, batch_size):
    return ({"samples": torch.zeros(batch_size, FLUX2_LATENT_CHANNELS, height // FLUX2_DOWNSCALE,
                                    width // FLUX2_DOWNSCALE)},)


def flux2_sigmas(steps: int, width: int, height: int) -> torch.Tensor:
    """Flux2Scheduler's ``steps + 1`` sigmas, from 1 down to 0, shifted by FLUX.2's empirical mu."""
    mu = empirical_mu(round(width * height / (FLUX2_DOWNSCALE * FLUX2_DOWNSCALE)), steps)
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    shifted = torch.zeros_like(t)
    inside = t > 0
    shifted[inside] = math.exp(mu) / (math.exp(mu) + (1 / t[inside] - 1))
    return shifted.float()


@node("Flux2Scheduler", "Flux2Scheduler", "sampling/custom_sampling/schedulers",
      {"steps": INT(20, 1, MAX_STEPS), "width": INT(1024, 16, MAX_RESOLUTION, 1),
       "height": INT(1024, 16, MAX_RESOLUTION, 1)}, ("SIGMAS",))
def flux2_scheduler(ctx, steps, width, height):
    return (flux2_sigmas(steps, width, height),)


@node("ReferenceLatent", "ReferenceLatent", "advanced/conditioning/edit_models",
      {"conditioning": LINK("CONDITIONING"), "latent": LINK("LATENT", required=False)}, ("CONDITIONING",),
      description="Edit models: the latent (a VAEEncode's) becomes one more reference image of the conditioning")
def reference_latent(ctx, conditioning, latent=None):
    if latent is None:
        return (conditioning,)
    samples = latent["samples"]
    if samples.ndim != 4:
        raise RequestError(f"ReferenceLatent (node {ctx.node_id}): latent: {tuple(samples.shape)} is not an image "
                           "latent (batch, channels, height, width)")
    found = tuple(samples[i:i + 1].detach().float().cpu() for i in range(samples.shape[0]))
    out = []
    for c in conditioning:
        references = c.references + found
        if len(references) > MAX_REFERENCE_IMAGES:
            raise RequestError(f"ReferenceLatent (node {ctx.node_id}): {len(references)} reference latents; FLUX.2 "
                               f"takes at most {MAX_REFERENCE_IMAGES}")
        out.append(dataclasses.replace(c, references=references))
    return (out,)
