"""The hires fix as the loop runs it (A1111's; :mod:`sdlite.hires` holds its options and sizes): the first pass as
asked, an upscale (in latent space, or of the decoded images by a named upscaler), then image to image at the
target size on the same engine or on the hires checkpoint's."""
from __future__ import annotations

import contextlib
import os
import time

import torch

from ..errors import RequestError
from ..families.base import latents_to_images
from ..sources import image_to_tensor
from .request import Request, Result, validate


def hires_engine(engine, checkpoint):
    """The engine of a hires fix's second pass on another checkpoint (``Hires.checkpoint``: a path): loaded once
    on this engine's device, precision and memory mode, and kept for the next request that names it."""
    key = os.path.realpath(checkpoint)
    cache = engine.__dict__.setdefault("_hires_engines", {})
    if key not in cache:
        cache.clear()   # one at a time: a second model resident beside this one is already a lot
        try:
            other = type(engine).load(checkpoint, device=engine.device, precision=engine.precision.requested,
                                      memory_mode=engine.models.mode)
        except FileNotFoundError:
            raise RequestError(f"hires checkpoint {checkpoint!r} was not found") from None
        mine, theirs = engine.family.latent, other.family.latent
        if (mine.channels, mine.downscale) != (theirs.channels, theirs.downscale):
            raise RequestError(f"hires checkpoint {checkpoint!r} ({other.spec.family}) does not work in this "
                               f"model's ({engine.spec.family}) latent space")
        cache[key] = other
    return cache[key]


def second_pass(engine, r: Request):
    """``(target, second engine, second request)`` of the validated hires-fix request ``r``: the upscaled size, the
    engine the second pass runs on (this one, or the hires checkpoint's, loaded once) and its image-to-image request
    at the target size, with the hires options in place of the first pass's."""
    from .. import hires as hires_module

    h = r.hires
    target = hires_module.target_size(r.width, r.height, h, engine.family.latent.downscale)
    second_engine = engine if h.checkpoint is None else engine.hires_engine(h.checkpoint)
    r2 = validate(r.replace(width=target.width, height=target.height, steps=h.steps or r.steps,
                            sampler=h.sampler or r.sampler,
                            schedule=h.schedule or (r.schedule if h.sampler is None else None),
                            cfg_scale=r.cfg_scale if h.cfg_scale is None else h.cfg_scale,
                            prompt=r.prompt if h.prompt is None else h.prompt,
                            negative_prompt=r.negative_prompt if h.negative_prompt is None else h.negative_prompt,
                            strength=h.denoise, hires=None), second_engine.family.default_size)
    return target, second_engine, r2


def total_steps(engine, request: Request) -> int:
    """The sampler steps ``engine`` runs for the text-to-image ``request`` in all, as its step callback counts them:
    with the hires fix its first pass's and its second's (the second pass's share of its planned steps by that pass's
    noise schedule's rule: a flow model may run one more than a DDPM model, :func:`sdlite.hires.second_pass_steps`),
    else the request's steps. What a front-end reports as a job's total before the job runs."""
    from .. import hires as hires_module

    r = validate(request, engine.family.default_size)
    if r.hires is None:
        return r.steps
    _, second_engine, r2 = second_pass(engine, r)
    return r.steps + hires_module.second_pass_steps(r.hires, r.steps, second_engine.schedule_for(r2))


def generate_hires(engine, r: Request, callback, on_latents, t0) -> Result:
    """The hires fix (:mod:`sdlite.hires`): the first pass as asked, an upscale, then image to image at the
    target size on this engine (or the hires checkpoint's)."""
    from .. import hires as hires_module
    from ..images import sampler_label, schedule_label

    h = r.hires
    if not h.is_latent:   # an unknown upscaler is refused before any work
        from ..upscalers.registry import UpscalerError, resolve

        try:
            resolve(h.upscaler, engine.upscaler_dir)
        except UpscalerError as e:
            raise RequestError(f"hires upscaler: {e} (latent upscalers: "
                               f"{', '.join(hires_module.LATENT_MODES)})") from None
    target, second_engine, r2 = second_pass(engine, r)
    first_steps = r.steps
    grand = first_steps + hires_module.second_pass_steps(h, r.steps, second_engine.schedule_for(r2))
    seeds = [r.seed + i for i in range(r.batch_size)]

    def progress(offset):
        cb = None if callback is None else (lambda step, total: callback(offset + step, grand))
        lat = None if on_latents is None else (lambda step, total, x: on_latents(offset + step, grand, x))
        return cb, lat

    use_cfg = r.cfg_scale > 1.0
    networks = engine.prompt_networks(r)
    same_networks = second_engine is engine and (r2.prompt, r2.negative_prompt) == (r.prompt, r.negative_prompt)
    cb1, lat1 = progress(0)
    with contextlib.ExitStack() as stack:
        stack.enter_context(networks.applied(engine))
        controls1 = engine.prepare_controls(r, r.width, r.height, hires_pass=1)
        first = engine.run_pass(r, None, seeds, use_cfg, networks, False, cb1, t0, lat1, decode=False,
                               controls=controls1)
        if first.interrupted:   # stopped in the first pass: its images, and no second pass
            first.images = latents_to_images(engine.decode_scaled(first.latents))
            first.warnings.append("the hires fix's second pass did not run (stopped in the first pass)")
            first.request = r
            first.control_maps = [c.map for c in controls1]
            return first
        if not same_networks:
            stack.close()      # the first pass's LoRAs off; the second pass's go on below
        t_up = time.perf_counter()
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        if h.is_latent:
            x0 = hires_module.upscale_latents(first.latents.float(), target, h.upscaler, engine.family.latent.downscale)
        else:
            from ..upscalers.registry import upscale_to

            small = latents_to_images(engine.decode_scaled(first.latents))
            box = target.crop_box(engine.family.latent.downscale)
            pixels = [image_to_tensor(upscale_to(im, h.upscaler, target.upscale_width, target.upscale_height,
                                                 folder=engine.upscaler_dir, device=engine.device).crop(box))
                      for im in small]
            del small
            # each image encoded alone, its latent sample drawn from its own generator (the reference's order)
            x0 = torch.cat([second_engine.encode_image(px, [g]) for px, g in zip(pixels, generators)])
            del pixels
        upscale_time = time.perf_counter() - t_up
        networks2 = networks
        if not same_networks:
            networks2 = second_engine.prompt_networks(r2)
            stack.enter_context(networks2.applied(second_engine))
        cb2, lat2 = progress(first_steps)
        controls2 = second_engine.prepare_controls(r2, r2.width, r2.height, hires_pass=2)
        second = second_engine.run_pass(r2, None, seeds, r2.cfg_scale > 1.0, networks2, False, cb2,
                                         time.perf_counter(), lat2, start_latents=(x0, generators),
                                         controls=controls2)
    warnings = list(first.warnings) + [w for w in second.warnings if w not in first.warnings]
    info = {**first.infotext, **hires_module.infotext(h, r.cfg_scale), **engine.controls_infotext(r)}
    if r2.sampler != r.sampler:
        info["Hires sampler"] = sampler_label(r2.sampler)
    if r2.schedule != r.schedule:
        info["Hires schedule type"] = schedule_label(r2.schedule)
    if r2.prompt != r.prompt:
        info["Hires prompt"] = r2.prompt
    if r2.negative_prompt != r.negative_prompt:
        info["Hires negative prompt"] = r2.negative_prompt
    if "Lora hashes" in second.infotext and second.infotext["Lora hashes"] != info.get("Lora hashes"):
        info["Hires Lora hashes"] = second.infotext["Lora hashes"]
    timings = {"text": first.timings["text"] + second.timings["text"],
               "sampling": first.timings["sampling"] + second.timings["sampling"],
               "upscale": upscale_time, "decode": second.timings["decode"],
               "total": time.perf_counter() - t0}
    return Result(images=second.images, seeds=seeds, request=r, latents=second.latents, warnings=warnings,
                  infotext=info, timings=timings, interrupted=second.interrupted,
                  control_maps=[c.map for c in controls2 + controls1])
