"""The one narrow API: a :class:`Request` in, images and the parameters actually used out.

    engine = Engine.load("model.safetensors")           # or Engine(StableDiffusion, device=...)
    result = engine.generate(Request(prompt="a red circle on a blue background", seed=42))
    result.images[0].save("out.png")

:mod:`.request` holds the contract (:class:`Request`, :class:`Result`, :func:`validate`), :mod:`.engine` the loop
that runs it over any model family (:mod:`sdlite.families`); :mod:`.controls`, :mod:`.networks` and :mod:`.hires`
what a run adds around the loop.
"""
from __future__ import annotations

import gc

# Importing torch triggers several full garbage collections, each walking every object torch has created so far
# (about 0.4 s of CPU in all); nothing in an import is cyclic garbage worth collecting, so the collector is paused
# until the imports below are done.
_GC_WAS_ENABLED = gc.isenabled()
gc.disable()
try:
    from ..errors import RequestError, StopSampling
    from ..families.base import approximate_images, initial_noise, latents_to_images
    from ..machine import check_device
    from ..sampling.samplers import SAMPLERS
    from ..sources import Source, image_to_tensor, mask_to_tensor
    from .engine import Engine
    from .request import CFG_RANGE, DEFAULT_SAMPLER, MAX_BATCH, MAX_SEED, MAX_STEPS, Request, Result, validate
finally:
    if _GC_WAS_ENABLED:
        gc.enable()

__all__ = ["Engine", "Request", "Result", "RequestError", "StopSampling", "approximate_images", "validate",
           "initial_noise", "latents_to_images", "check_device", "image_to_tensor", "mask_to_tensor", "Source",
           "SAMPLERS", "DEFAULT_SAMPLER", "MAX_SEED", "MAX_BATCH", "MAX_STEPS", "CFG_RANGE"]
