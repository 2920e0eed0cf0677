"""ComfyUI's custom sampling nodes on sdlite: SamplerCustomAdvanced and the values it takes, NOISE (RandomNoise,
DisableNoise), GUIDER (CFGGuider, BasicGuider), SAMPLER (KSamplerSelect) and SIGMAS (BasicScheduler, and
:mod:`.flux2`'s Flux2Scheduler), and SamplerCustom, which takes the same in one node. ComfyUI's stock FLUX.1,
FLUX.2 [klein] and many Z-Image workflows sample this way instead of with a KSampler.

Each sampler node runs what a KSampler runs (:func:`.nodes._sample`: sdlite's engine with ComfyUI's KSampler
conventions, :func:`sdlite.pipeline.latents.run_latents`); what ComfyUI splits over four nodes becomes one
:class:`~sdlite.pipeline.Request` and one :class:`~sdlite.pipeline.latents.LatentRun`:

* **NOISE**: RandomNoise's ``noise_seed`` is the request's seed, so the initial noise is KSampler's (one draw of the
  whole latent batch from a CPU generator seeded with it) and so is the samplers' per-step noise (ComfyUI gives the
  guider the noise's seed). DisableNoise adds no noise (``LatentRun.add_noise`` False) and its seed is ComfyUI's
  ``Noise_EmptyNoise``'s, 0, for the per-step noise of an ancestral sampler.
* **GUIDER**: CFGGuider's positive, negative and ``cfg`` are KSampler's (cfg in sdlite's range, as KSampler's);
  BasicGuider's conditioning is the positive at cfg 1, with no negative: at cfg 1 none is evaluated, in ComfyUI or
  here. The conditionings carry what they carry for a KSampler: ConditioningCombine's prompts, areas, FLUX's
  guidance, ControlNets, FLUX.2's ReferenceLatent images.
* **SAMPLER**: KSamplerSelect's ``sampler_name``, from KSampler's list (the same names refused).
* **SIGMAS**: Flux2Scheduler's tensor reaches the sampler unchanged (``LatentRun.sigmas``: a 1-D list, steps + 1
  values, each above the next; the run's steps are their count less one). BasicScheduler computes its sigmas from the
  model's own sigma table, which sdlite has only on the engine the sampler loads (the nodes load nothing), so its
  SIGMAS is a :class:`PlannedSigmas`: its model, scheduler, steps and denoise, which the sampler plans on its engine
  exactly as KSampler does (ComfyUI's BasicScheduler and KSampler share the formulas: ``int(steps / denoise)``
  planned steps, the last ``steps + 1`` sigmas kept), at the shift of the scheduler's model (a ModelSampling node
  on it). The scheduler's model must be the guider's file. Denoise 0 samples nothing: the latent comes back as it
  is.

SamplerCustomAdvanced's second output, ``denoised_output``, is the last step's estimate of the clean latent (ComfyUI's
``x0`` of its last callback); when nothing was sampled, the output itself. SamplerCustom is SamplerCustomAdvanced with
a CFGGuider over its model, positive, negative and cfg, and RandomNoise (``add_noise`` true) or DisableNoise (false).

Not here: the other SIGMAS nodes (KarrasScheduler, SplitSigmas, ...), SAMPLER nodes with options
(SamplerEulerAncestral, ...) and guiders (DualCFGGuider, ...): ComfyUI's unknown-node refusal names them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...config import CFG_RANGE, MAX_STEPS
from ...errors import RequestError
from ...pipeline.latents import explicit_sigmas
from ...pipeline.request import COMFY_MAX_SEED
from ...sampling.comfy import COMFY_SCHEDULERS, COMFY_SCHEDULERS_MISSING
from ...sampling.regions import WHOLE
from .nodes import (_SAMPLERS, _SAMPLERS_MISSING, COMBO, FLOAT, INT, LINK, Input, ModelRef, _combined, _request,
                    _sample, node)


@dataclass(frozen=True)
class Noise:
    """A NOISE value: the seed of the initial and per-step noise; ``add`` False: DisableNoise's (no initial noise)."""

    seed: int
    add: bool = True


@dataclass(frozen=True)
class Guider:
    """A GUIDER value: the model, the positive and negative conditionings (lists of :class:`.nodes.Cond`; None:
    BasicGuider's, no negative) and the CFG scale."""

    model: ModelRef
    positive: list
    negative: list | None
    cfg: float


@dataclass(frozen=True)
class SamplerChoice:
    """A SAMPLER value: ComfyUI's sampler name (one of KSampler's)."""

    name: str


@dataclass(frozen=True)
class PlannedSigmas:
    """BasicScheduler's SIGMAS: ComfyUI's ``scheduler`` over ``steps`` steps at ``denoise`` on ``model``'s sigma
    table, planned by the sampler on its engine (:func:`sdlite.pipeline.latents.plan_sigmas`)."""

    model: ModelRef
    scheduler: str
    steps: int
    denoise: float


def _seed() -> Input:
    return INT(0, 0, COMFY_MAX_SEED, control_after_generate=True)


def _cfg() -> Input:
    return FLOAT(8.0, CFG_RANGE[0], CFG_RANGE[1], 0.1, round=0.01)


@node("RandomNoise", "RandomNoise", "sampling/custom_sampling/noise", {"noise_seed": _seed()}, ("NOISE",))
def random_noise(ctx, noise_seed):
    return (Noise(int(noise_seed)),)


@node("DisableNoise", "DisableNoise", "sampling/custom_sampling/noise", {}, ("NOISE",))
def disable_noise(ctx):
    return (Noise(0, add=False),)   # ComfyUI's Noise_EmptyNoise: seed 0


@node("CFGGuider", "CFG Guider", "sampling/custom_sampling/guiders",
      {"model": LINK("MODEL"), "positive": LINK("CONDITIONING"), "negative": LINK("CONDITIONING"), "cfg": _cfg()},
      ("GUIDER",))
def cfg_guider(ctx, model, positive, negative, cfg):
    return (Guider(model, positive, negative, float(cfg)),)


@node("BasicGuider", "Basic Guider", "sampling/custom_sampling/guiders",
      {"model": LINK("MODEL"), "conditioning": LINK("CONDITIONING")}, ("GUIDER",))
def basic_guider(ctx, model, conditioning):
    return (Guider(model, conditioning, None, 1.0),)


@node("KSamplerSelect", "KSamplerSelect", "sampling/custom_sampling/samplers",
      {"sampler_name": COMBO(_SAMPLERS, missing=_SAMPLERS_MISSING)}, ("SAMPLER",))
def ksampler_select(ctx, sampler_name):
    return (SamplerChoice(sampler_name),)


@node("BasicScheduler", "BasicScheduler", "sampling/custom_sampling/schedulers",
      {"model": LINK("MODEL"), "scheduler": COMBO(COMFY_SCHEDULERS, missing=COMFY_SCHEDULERS_MISSING),
       "steps": INT(20, 1, MAX_STEPS), "denoise": FLOAT(1.0, 0.0, 1.0)}, ("SIGMAS",))
def basic_scheduler(ctx, model, scheduler, steps, denoise):
    return (PlannedSigmas(model, scheduler, int(steps), float(denoise)),)


def _file(model: ModelRef):
    return getattr(model.checkpoint, "path", model.checkpoint)


def run_custom(ctx, what: str, noise: Noise, guider: Guider, sampler: SamplerChoice, sigmas, latent: dict) -> tuple:
    """The custom sampler ``what`` (the node's name and id, for errors): ``(output, denoised_output)``."""
    model = guider.model
    positive = guider.positive
    if not positive:
        raise RequestError(f"{what}: guider: no conditioning")
    negative = guider.negative
    if negative is None:   # BasicGuider: cfg 1, so no negative is evaluated; one of the positive's CLIP stands in
        negative = [dataclasses.replace(positive[0], text="", region=WHOLE, zeroed="", references=())]
    run: dict = {}
    if isinstance(sigmas, PlannedSigmas):
        if _file(sigmas.model) != _file(model):
            raise RequestError(f"{what}: sigmas: BasicScheduler's model is {sigmas.model.origin or _file(sigmas.model)}"
                               f", the guider's {model.origin or _file(model)}: sdlite plans the sigmas on the "
                               "sampled model's own table")
        if sigmas.denoise <= 0.0:
            return latent, latent
        steps, scheduler, run["denoise"] = sigmas.steps, sigmas.scheduler, sigmas.denoise
        model = dataclasses.replace(model, shift=sigmas.model.shift, sampling=sigmas.model.sampling)
    elif isinstance(sigmas, torch.Tensor):
        try:
            run["sigmas"] = explicit_sigmas(sigmas)
        except RequestError as e:
            raise RequestError(f"{what}: sigmas: {e}") from None
        if len(run["sigmas"]) < 2:   # ComfyUI samples nothing and returns the latent
            return latent, latent
        steps, scheduler = len(run["sigmas"]) - 1, COMFY_SCHEDULERS[0]   # the scheduler is not used
        if steps > MAX_STEPS:
            raise RequestError(f"{what}: sigmas: {steps} steps; sdlite samples at most {MAX_STEPS}")
    else:
        raise RequestError(f"{what}: sigmas: a {type(sigmas).__name__} is not a SIGMAS value")
    request = _request(ctx, model, noise.seed, steps, guider.cfg, sampler.name, scheduler, positive, negative)
    kept: dict = {}
    (out,) = _sample(ctx, model, positive[0].clip, request, latent, denoised=kept, add_noise=noise.add,
                     **run, **_combined(positive, negative))
    if "x0" not in kept:
        return out, out
    denoised = dict(out)
    denoised["samples"] = kept["x0"].detach().float().cpu()
    return out, denoised


@node("SamplerCustomAdvanced", "SamplerCustomAdvanced", "sampling/custom_sampling",
      {"noise": LINK("NOISE"), "guider": LINK("GUIDER"), "sampler": LINK("SAMPLER"), "sigmas": LINK("SIGMAS"),
       "latent_image": LINK("LATENT")}, ("LATENT", "LATENT"), output_names=("output", "denoised_output"))
def sampler_custom_advanced(ctx, noise, guider, sampler, sigmas, latent_image):
    return run_custom(ctx, f"SamplerCustomAdvanced (node {ctx.node_id})", noise, guider, sampler, sigmas,
                      latent_image)


@node("SamplerCustom", "SamplerCustom", "sampling/custom_sampling",
      {"model": LINK("MODEL"), "add_noise": Input("BOOLEAN", {"default": True}), "noise_seed": _seed(),
       "cfg": _cfg(), "positive": LINK("CONDITIONING"), "negative": LINK("CONDITIONING"),
       "sampler": LINK("SAMPLER"), "sigmas": LINK("SIGMAS"), "latent_image": LINK("LATENT")},
      ("LATENT", "LATENT"), output_names=("output", "denoised_output"))
def sampler_custom(ctx, model, add_noise, noise_seed, cfg, positive, negative, sampler, sigmas, latent_image):
    noise = Noise(int(noise_seed)) if add_noise else Noise(int(noise_seed), add=False)
    return run_custom(ctx, f"SamplerCustom (node {ctx.node_id})", noise, Guider(model, positive, negative, float(cfg)),
                      sampler, sigmas, latent_image)
