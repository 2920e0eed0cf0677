"""The nodes of ComfyUI's stock Z-Image workflow (Comfy-Org's ``image_z_image_turbo``) that the other families' graphs
do not use, on sdlite: ModelSamplingAuraFlow and ConditioningZeroOut. The rest of that workflow is the other modules':
UNETLoader (``z_image_turbo_bf16.safetensors``), CLIPLoader of type ``lumina2`` (``qwen_3_4b.safetensors``) and
VAELoader (``ae.safetensors``) are :mod:`.loaders`'; CLIPTextEncode, EmptySD3LatentImage, KSampler, VAEDecode and
SaveImage :mod:`.nodes`'. The workflow's sampler, ``res_multistep`` (:func:`sdlite.sampling.samplers.
sample_res_multistep`), is KSampler's as every sampler sdlite's ComfyUI noise path runs
(``sdlite.pipeline.request.COMFY_NOISE_SAMPLERS``); ``euler`` with the ``simple`` scheduler is Z-Image-Turbo's own
setting (diffusers' ZImagePipeline).

**ModelSamplingAuraFlow** is ComfyUI's ModelSamplingSD3 with a timestep multiplier of 1 instead of 1000 (the networks
of AuraFlow, Lumina 2 and Z-Image take sigma itself as their timestep). The multiplier changes only what the network
is given, which sdlite's family does its own way (Z-Image's transformer is called with ``1 - sigma``): the sigma table,
``shift * t / (1 + (shift - 1) * t)`` over the 1000 timesteps, and so every scheduler's sigmas, are ModelSamplingSD3's
at the same shift. The node therefore sets the model's shift as ModelSamplingSD3 does. Z-Image's own shift is 3 (the
stock workflow sets 3; the node's default is AuraFlow's 1.73). On a model whose shift follows the image size (FLUX.1
dev), or one without flow matching, the sampler refuses it naming the node (:func:`.modelsampling.check_sampling`).

**ConditioningZeroOut** makes a conditioning of zeros: the stock workflow's negative, made from its positive prompt.
At cfg 1 (the Turbo's, and the workflow's) the negative is never evaluated, neither in ComfyUI (its cfg-1
optimisation) nor in sdlite, so the workflow's image does not depend on it. Evaluated (the negative at a cfg above 1,
or a positive), it is what ComfyUI computes: zeros of the shape of the conditioning it was made from (Z-Image: a
caption of that prompt's length, all zeros; FLUX: T5's rows of zeros) and a pooled embedding of zeros
(:func:`sdlite.pipeline.latents.zero_out`). The conditioning keeps its text, which the sampler encodes for the shape.
"""
from __future__ import annotations

import dataclasses

from .nodes import FLOAT, LINK, node


@node("ModelSamplingAuraFlow", "ModelSamplingAuraFlow", "advanced/model",
      {"model": LINK("MODEL"), "shift": FLOAT(1.73, 0.0, 100.0, 0.01)}, ("MODEL",))
def model_sampling_aura_flow(ctx, model, shift):
    return (dataclasses.replace(model, shift=float(shift), sampling="ModelSamplingAuraFlow"),)


@node("ConditioningZeroOut", "ConditioningZeroOut", "advanced/conditioning",
      {"conditioning": LINK("CONDITIONING")}, ("CONDITIONING",))
def conditioning_zero_out(ctx, conditioning):
    origin = f"ConditioningZeroOut (node {ctx.node_id})"
    return ([dataclasses.replace(c, zeroed=origin) for c in conditioning],)
