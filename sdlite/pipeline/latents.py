"""Sampling from given latents with ComfyUI's KSampler conventions: the run behind ``Request(noise="comfy")`` and
behind a ComfyUI workflow's KSampler / KSamplerAdvanced nodes and its custom samplers (SamplerCustomAdvanced's
explicit sigmas: :attr:`LatentRun.sigmas`) (:mod:`sdlite.server.comfy.workflow`).

What differs from the A1111 loop of :meth:`Engine.run_pass <sdlite.pipeline.engine.Engine.run_pass>` is ComfyUI's
(:mod:`sdlite.sampling.comfy`): the sigmas come from ComfyUI's scheduler formulas, cut by KSampler's ``denoise`` or
KSamplerAdvanced's start and end steps; the initial noise is one draw of the whole batch from a generator seeded
with the seed, scaled onto the given latent as ComfyUI's ``noise_scaling`` does; the samplers' per-step noise comes
from a second generator (seeded with seed + 1 on a CPU); a noise mask keeps the unmasked region at the source latent
noised to each step's level (ComfyUI's ``KSamplerX0Inpaint``); the UNet gets the nearest training timestep of each
sigma.

Latents here are in the sampler's scaling (the VAE's latents times the family's scaling factor), as
:attr:`Result.latents <sdlite.pipeline.request.Result>` holds them. On a flow-matching model (SD3, FLUX) the sigmas
come from ComfyUI's flow tables (:class:`sdlite.sampling.comfy.FlowTable`: the model's shift for SD3, ComfyUI's
1.15 for FLUX.1 dev unless a ModelSamplingFlux node gives another).
"""
from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass

import torch

from ..control.apply import ControlledUNet
from ..engine import budget
from ..errors import RequestError, StopSampling
from ..families.base import latents_to_images
from ..sampling.comfy import (advanced_sigmas, comfy_noise, comfy_sigmas, comfy_timesteps, denoise_sigmas,
                              inverse_noise_scaling, noise_scaling, step_generator)
from ..sampling.denoisers import Averaged, CFGDenoiser, Pieces, Recorded
from ..sampling.regions import WHOLE, Regional, plan, refuse
from ..sampling.samplers import SAMPLERS
from .request import Request, Result

@dataclass
class LatentRun:
    """What a KSampler node gives the engine besides the request: the start ``latents`` (B, C, h, w) in the
    sampler's scaling (zeros: text to image), a ``mask`` (ComfyUI's noise mask: (B or 1, 1, H, W) at any size,
    1 = denoise), KSampler's ``denoise`` and KSamplerAdvanced's ``start_step`` / ``last_step`` (None: not given),
    ``add_noise`` and ``force_full_denoise`` (False: return with the leftover noise). ``prompts`` /
    ``negative_prompts``: more prompts for each guidance half (ComfyUI's ConditioningCombine): the run's denoised
    estimate is the mean over every (prompt, negative prompt) pair of the guided estimate, which is the negative
    prompts' mean prediction plus the scale times (the prompts' mean minus it), as ComfyUI averages the predictions
    of combined conditionings. ``regions`` / ``negative_regions``: where each prompt of a half applies and at what
    strength (:class:`~sdlite.sampling.regions.Region`, one per prompt, the request's first; ComfyUI's
    ConditioningSetArea and ConditioningSetAreaStrength), empty for the whole latent at strength 1: with them each
    half's prediction is ComfyUI's weighted blend of its prompts' predictions on their areas
    (:class:`~sdlite.sampling.regions.Regional`). ``sigmas``: explicit sigmas (ComfyUI's SIGMAS, a custom sampler's:
    a 1-D float tensor, descending) that the sampler is given as they are, in place of the request's scheduler,
    steps and denoise and of ``start_step`` / ``last_step`` (fewer than two: nothing to sample)."""

    latents: torch.Tensor
    mask: torch.Tensor | None = None
    denoise: float = 1.0
    start_step: int | None = None
    last_step: int | None = None
    add_noise: bool = True
    force_full_denoise: bool = False
    shift: float | None = None   # a flow model's: ModelSamplingSD3's shift, ModelSamplingFlux's mu; None: ComfyUI's
    prompts: tuple = ()
    negative_prompts: tuple = ()
    regions: tuple = ()
    negative_regions: tuple = ()
    # ComfyUI's ConditioningZeroOut: which prompts of each half (0: the request's, then ``prompts`` /
    # ``negative_prompts`` in order) condition with zeros of their encoding's shape, pooled embedding zeroed too
    zeroed: tuple = ()
    negative_zeroed: tuple = ()
    sigmas: torch.Tensor | None = None


ZEROED = "\x00zeros of "   # the key of a zeroed text's encoding (no prompt holds a NUL)


def zero_out(cond, prompt: bool, negative: bool):
    """``cond`` (a ScheduledConditioning) with the prompt's and/or the negative prompt's encodings replaced by zeros
    of their shape and their pooled embeddings by zeros, as ComfyUI's ConditioningZeroOut makes them (``torch.
    zeros_like`` of the conditioning and of its ``pooled_output``; its other entries, such as a caption's length, are
    the encoded text's). The zeros are kept under keys of their own: a text that is both a prompt and a zeroed
    negative (the stock Z-Image workflow zeroes its positive) keeps its encoding for the prompt."""
    if not prompt and not (negative and cond.negative is not None):
        return cond
    encoded = dict(cond.encoded)
    pooled = None if cond.pooled is None else dict(cond.pooled)

    def zeros(schedule):
        out = []
        for entry in schedule:
            key = ZEROED + entry.text
            encoded[key] = torch.zeros_like(cond.encoded[entry.text])
            if pooled is not None:
                pooled[key] = torch.zeros_like(cond.pooled[entry.text])
            out.append(dataclasses.replace(entry, text=key))
        return out

    changes = {"prompt": zeros(cond.prompt)} if prompt else {}
    if negative and cond.negative is not None:
        changes["negative"] = zeros(cond.negative)
    return dataclasses.replace(cond, encoded=encoded, pooled=pooled, **changes)


def plan_sigmas(engine, r: Request, run: LatentRun) -> torch.Tensor | None:
    """The run's sigmas (descending), as ComfyUI's KSampler cuts them; None when there is nothing to sample
    (denoise 0, or a start step at or past the end, or fewer than two explicit sigmas: the latent is returned
    untouched)."""
    if run.sigmas is not None:
        sigmas = explicit_sigmas(run.sigmas)
        return sigmas if len(sigmas) >= 2 else None
    schedule = engine.schedule_for(r)

    def full(steps: int) -> torch.Tensor:
        shift = run.shift if run.shift is not None else engine.family.comfy_shift   # a ModelSampling node's first
        return comfy_sigmas(schedule, r.schedule, steps, shift)

    sigmas = denoise_sigmas(full, r.steps, run.denoise)
    if len(sigmas) < 2:
        return None
    if run.start_step is None and run.last_step is None:
        return sigmas
    last = len(sigmas) - 1 if run.last_step is None else run.last_step
    return advanced_sigmas(sigmas, run.start_step or 0, last, run.force_full_denoise)


def explicit_sigmas(sigmas) -> torch.Tensor:
    """Explicit sigmas as the sampler takes them: a float32 CPU copy of a 1-D list of finite sigmas, each above the
    next and none below 0 (the last may be above 0: the run then returns the latent with that noise left in it, as
    KSamplerAdvanced's leftover noise). Raises :class:`RequestError` naming what is wrong."""
    values = torch.as_tensor(sigmas).detach().to("cpu", torch.float32)
    if values.ndim != 1:
        raise RequestError(f"sigmas: a tensor of shape {tuple(values.shape)}; expected one sigma per step boundary, "
                           "a 1-D list")
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise RequestError(f"sigmas {values.tolist()}: each must be a finite number, 0 or more")
    if len(values) > 1 and not bool((values[:-1] > values[1:]).all()):
        raise RequestError(f"sigmas {values.tolist()} are not strictly descending")
    return values.clone()


def prepare_mask(mask: torch.Tensor, shape: tuple) -> torch.Tensor:
    """ComfyUI's noise mask at the latent's size: bilinear, repeated over the channels and the batch."""
    m = mask.float().reshape(-1, 1, *mask.shape[-2:])
    m = torch.nn.functional.interpolate(m, size=tuple(shape[2:]), mode="bilinear")
    m = m.expand(-1, shape[1], -1, -1)
    if m.shape[0] < shape[0]:
        m = m.repeat((shape[0] + m.shape[0] - 1) // m.shape[0], 1, 1, 1)
    return m[:shape[0]]


@dataclass(frozen=True, eq=False)
class MaskedDenoiser:
    """ComfyUI's ``KSamplerX0Inpaint``: before each call the kept region (mask 0) is set to the source latent
    noised to the call's sigma (with the run's initial noise); after it, the estimate there is the source."""

    denoiser: object
    latent: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor     # 1 = denoise
    schedule: object

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra) -> torch.Tensor:
        keep = 1.0 - self.mask
        s = sigma.reshape(-1, *([1] * (x.ndim - 1))).to(x)
        if self.schedule.latent_form == "flow":
            kept = self.noise * s + self.latent * (1.0 - s)
        else:
            kept = self.latent + self.noise * s
        x = x * self.mask + kept * keep
        out = self.denoiser(x, sigma, **extra)
        return out * self.mask + self.latent * keep


def _combined(engine, r: Request, run: LatentRun, networks, use_cfg: bool, regional: bool = False) -> list:
    """The conditionings of every (prompt, negative prompt) pair of ``run``'s combined prompts but the request's own
    pair (the negative ones only with guidance); ``regional``: of each further prompt with the first negative prompt,
    then of the first prompt with each further negative prompt (each half's prompts run on their own). Their
    ``<lora:...>`` tags must be the request's: a LoRA is applied for the whole run."""
    prompts = [r.prompt, *run.prompts]
    negatives = [r.negative_prompt, *run.negative_prompts] if use_cfg else [r.negative_prompt]
    if regional:
        pairs = [(i, 0) for i in range(1, len(prompts))] + [(0, j) for j in range(1, len(negatives))]
    else:
        pairs = [(i, j) for i in range(len(prompts)) for j in range(len(negatives)) if i or j]
    conds = []
    for i, j in pairs:
        prompt, negative = prompts[i], negatives[j]
        pair = engine.prompt_networks(r.replace(prompt=prompt, negative_prompt=negative))
        if pair.loras != networks.loras:
            raise RequestError(f"combined prompt {prompt!r}: its <lora:...> tags are not the first prompt's; "
                               "sdlite applies LoRAs for the whole run")
        cond = engine.conditioning(r.replace(prompt=pair.prompt, negative_prompt=pair.negative), use_cfg,
                                   networks.embeddings)
        conds.append(zero_out(cond, i in run.zeroed, j in run.negative_zeroed))
    return conds


def _parts(run: LatentRun, schedule, controls, shape: tuple):
    """The parts of each guidance half (:func:`sdlite.sampling.regions.plan`) of a run with areas or strengths, the
    denoiser arguments of :func:`_combined`'s regional order; None when every prompt conditions the whole latent at
    strength 1."""
    prompts, negatives = 1 + len(run.prompts), 1 + len(run.negative_prompts)
    regions = tuple(run.regions) or (WHOLE,) * prompts
    negative_regions = tuple(run.negative_regions) or (WHOLE,) * negatives
    if all(g == WHOLE for g in regions + negative_regions):
        return None
    if len(regions) != prompts or len(negative_regions) != negatives:
        raise RequestError(f"{len(regions)} regions for {prompts} prompts and {len(negative_regions)} negative regions "
                           f"for {negatives} negative prompts: one for each")
    refuse(regions + negative_regions, schedule.latent_form == "flow", bool(controls))
    negative = [(0 if j == 0 else prompts - 1 + j, g) for j, g in enumerate(negative_regions)]
    return plan(list(enumerate(regions)), negative, shape[2], shape[3])


def run_latents(engine, r: Request, run: LatentRun, callback=None, on_latents=None, *,
                decode: bool = False) -> Result:
    """Sample ``run``'s latents for the checked request ``r`` (its prompts, guidance, sampler, ComfyUI scheduler
    name in ``r.schedule``, seed, LoRAs, ControlNets). ``callback(step, total)`` / ``on_latents(step, total,
    estimate)`` as :meth:`Engine.generate`; :class:`StopSampling` from either ends the run with the estimate. The
    result's latents are in the sampler's scaling; ``decode``: its images too."""
    t0 = time.perf_counter()
    schedule = engine.schedule_for(r)
    latent = run.latents.detach().to("cpu", torch.float32)
    if latent.ndim != 4 or latent.shape[1] != engine.family.latent.channels:
        raise RequestError(f"latents of shape {tuple(latent.shape)} do not fit this model ({engine.spec.family}): "
                           f"it samples (batch, {engine.family.latent.channels}, height/8, width/8)")
    sigmas = plan_sigmas(engine, r, run)
    warnings: list[str] = []
    interrupted = False
    if sigmas is None:
        x, t1 = latent, time.perf_counter()
    else:
        noise = comfy_noise(r.seed, tuple(latent.shape)) if run.add_noise else torch.zeros_like(latent)
        x = noise_scaling(schedule, float(sigmas[0]), noise, latent).to(engine.device)
        batch = latent.shape[0]
        networks = engine.prompt_networks(r)
        warnings += networks.warnings
        use_cfg = r.cfg_scale > 1.0
        steps = len(sigmas) - 1
        controls = engine.prepare_controls(r, r.width, r.height)
        unet_piece, _ = budget.pieces(engine, r.height, r.width, r.batch_size, cfg=use_cfg)
        parts = _parts(run, schedule, controls, tuple(latent.shape))
        with networks.applied(engine):
            cond = engine.conditioning(r.replace(prompt=networks.prompt, negative_prompt=networks.negative), use_cfg,
                                       networks.embeddings)
            conds = [zero_out(cond, 0 in run.zeroed, 0 in run.negative_zeroed)]
            if parts is not None or run.prompts or (use_cfg and run.negative_prompts):
                conds += _combined(engine, r, run, networks, use_cfg, parts is not None)
            for cond in conds:
                warnings += [w for w in cond.warnings if w not in warnings]
            extras = [cond.extra_at(0, batch) for cond in conds]
            extra = extras[0]
            t1 = time.perf_counter()
            network = engine.spec.denoiser
            with torch.no_grad(), engine.models.use(network) as unet:
                model = controlled = None
                model = engine.models.runner(network, unet)
                if controls:
                    model = controlled = ControlledUNet(unet, controls, use_cfg, steps, 0)
                scale = r.cfg_scale if use_cfg else 1.0
                guided = engine.family.denoiser(model, schedule, unet.dtype)
                if parts is None:   # with areas each prompt runs on its own (Regional guides them; no ControlNets)
                    guided = CFGDenoiser(guided, scale, combine=engine.family.guidance)
                timesteps = comfy_timesteps(schedule, sigmas[:-1])
                if timesteps is not None:
                    guided = guided.with_timesteps(sigmas, timesteps)
                if unet_piece < batch:   # a large batch in pieces, as the A1111 loop runs it (engine.budget)
                    guided = Pieces(guided, unet_piece, batch)
                if parts is not None:
                    guided = Regional(guided, extras, parts[0], parts[1] if use_cfg else None, scale,
                                      *latent.shape[2:])
                elif len(conds) > 1:
                    guided = Averaged(guided, extras)
                if run.mask is not None:
                    mask = prepare_mask(run.mask, tuple(latent.shape)).to(engine.device)
                    guided = MaskedDenoiser(guided, latent.to(engine.device), noise.to(engine.device), mask,
                                            schedule)
                denoised = Recorded(guided)

                def on_step(i, total, _x):
                    if controlled is not None:
                        controlled.step = i + 1
                    for cond, its_extra in zip(conds, extras):
                        if cond.changes and i + 1 < total:
                            its_extra.update(cond.extra_at(i + 1, batch))
                    if on_latents is not None:
                        on_latents(i + 1, total, denoised.value)
                    if callback is not None:
                        callback(i + 1, total)

                info = SAMPLERS[r.sampler]
                params = inspect.signature(info.fn).parameters
                options = {"schedule": schedule} if "schedule" in params else {}
                if r.eta is not None and "eta" in params:
                    options["eta"] = r.eta
                try:
                    x = info.fn(denoised, x, sigmas, generator=step_generator(r.seed, x.device), callback=on_step,
                                extra_args=extra, **options)
                    x = inverse_noise_scaling(schedule, float(sigmas[-1]), x)
                except StopSampling:
                    x, interrupted = denoised.value, True
                    warnings.append("stopped early: the latents are the estimate of the final ones at that step")
    t2 = time.perf_counter()
    latents = x.float()
    images = []
    if decode:
        engine.release_before_decode()
        piece = budget.pieces(engine, r.height, r.width, r.batch_size, cfg=r.cfg_scale > 1.0)[1]
        images = latents_to_images(engine.decode_scaled(latents, piece=piece))
    t3 = time.perf_counter()
    seeds = [r.seed] * latents.shape[0]
    return Result(images=images, seeds=seeds, request=r, latents=latents, warnings=warnings,
                  infotext={"Noise": "comfy", "Precision": engine.precision.label},
                  timings={"text": t1 - t0, "sampling": t2 - t1, "decode": t3 - t2, "total": t3 - t0},
                  interrupted=interrupted)
