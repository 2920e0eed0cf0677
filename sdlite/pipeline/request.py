"""The one narrow contract: a :class:`Request` in, a :class:`Result` out, and :func:`validate`, which checks every
parameter and resolves the defaults before any work. Every front-end (the CLI, the servers, Ray) builds these."""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field

import torch

from ..config import CFG_RANGE, MAX_BATCH, MAX_SEED, MAX_STEPS
from ..engine.blockcache import BlockCacheError, check_threshold
from ..engine.stepcache import DEFAULT_BRANCH as DEFAULT_CACHE_BRANCH
from ..engine.stepcache import StepCacheError
from ..engine.stepcache import check_options as check_cache_options
from ..errors import RequestError
from ..sampling.comfy import COMFY_SAMPLERS, COMFY_SCHEDULERS
from ..sampling.samplers import resolve_sampler
from ..sampling.schedules import SIGMA_KINDS, SPACINGS

DEFAULT_SAMPLER = "dpmpp_2m_karras"   # A1111's default: "DPM++ 2M" with the "Karras" schedule


@dataclass
class Request:
    prompt: str
    negative_prompt: str = ""
    width: int | None = None          # None: the model's native size
    height: int | None = None
    steps: int = 20
    cfg_scale: float = 7.5
    sampler: str = DEFAULT_SAMPLER    # our names or A1111's ("DPM++ 2M Karras", "Euler a", ...)
    schedule: str | None = None       # discrete | karras | exponential; None: what the sampler name implies
    seed: int = -1                    # -1: a random seed, reported in the result
    batch_size: int = 1
    clip_skip: int = 1                # A1111 numbering: 1 = last layer
    eta: float | None = None          # DDIM / ancestral / SDE noise amount; None: the sampler's default
    timestep_spacing: str | None = None  # leading | linspace | trailing; None: what the model's scheduler says
    # explicit noise levels replacing the sampler's schedule (diffusers' timesteps= / sigmas=), one or the other:
    # integer training timesteps, descending (DMD2's 999,749,499,249), or sigmas, descending, steps + 1 of them,
    # the last where sampling ends (0). Given, they set ``steps`` (one per timestep, one less than the sigmas)
    timesteps: tuple | None = None
    sigmas: tuple | None = None
    # image to image, inpainting, outpainting (see sdlite.sources for the pixel side, A1111's rules)
    init_image: object = None         # a path or a PIL image: image to image (and inpainting with a mask)
    mask: object = None               # a path or a PIL image; white = repaint
    strength: float = 0.75            # (0, 1]: the last int(steps * strength) steps are run
    mask_blur: int = 4                # px, A1111's default
    inpaint_fill: str | None = None   # original | fill | latent-noise | latent-nothing; None: original (fill
                                      # when outpainting)
    invert_mask: bool = False
    inpaint_area: str = "whole"       # whole | masked (crop around the mask, generate at full size, paste back)
    inpaint_padding: int = 32         # px around the mask's box for inpaint_area="masked"
    overlay: bool = True              # paste the source back outside the (blurred) mask, as A1111 does
    outpaint: tuple | None = None     # (left, top, right, bottom) px, multiples of 8: extend the canvas
    resize_mode: str = "just-resize"  # just-resize | crop | fill: how a source of another size is fitted
    mask_from_alpha: bool = False     # the init image's transparency is the mask
    # editing from reference images (FLUX.2 klein, FLUX.1 Kontext, Qwen-Image-Edit): paths or PIL images the model sees beside the
    # prompt, in order
    # (the first sets the output size where width and height are left unset); () = none. Families without reference
    # conditioning refuse them
    reference_images: tuple = ()
    # FLUX.1 Kontext: resize the reference images to the resolutions Kontext was trained at (nearest aspect ratio),
    # as FluxKontextPipeline does by default; False keeps each image's own size (rounded down to multiples of 16)
    reference_resize: bool = True
    # add-ons
    loras: tuple = ()                 # (path, weight) pairs, besides the prompt's <lora:name:weight> tags;
                                      # a weight may be {"unet": a, "text_encoder": b} (networks.py)
    lora_dir: str | None = None       # where <lora:name:...> tags are looked up
    embeddings_dir: str | None = None  # textual-inversion embeddings: a prompt word equal to a file stem uses it
    # SDXL's size conditioning, (height, width) and (top, left) as diffusers takes them; None: the output size.
    # The refiner's time ids hold an aesthetic score instead of the target size (positive / negative prompt).
    original_size: tuple | None = None
    crops_coords_top_left: tuple = (0, 0)
    target_size: tuple | None = None
    aesthetic_score: float = 6.0
    negative_aesthetic_score: float = 2.5
    # SDXL base + refiner: the fraction of the steps the base runs before the engine's refiner takes the latents
    # over (A1111's "refiner switch at"; diffusers' denoising_end / denoising_start). None: no hand-off.
    refiner_switch_at: float | None = None
    # the hires fix (text to image): a :class:`sdlite.hires.Hires`, the second pass's upscale and options; None: off
    hires: object = None
    # ControlNet units (:class:`sdlite.control.ControlUnit`), applied in order, their residuals summed
    controls: tuple = ()
    # skip-layer guidance (SD3.5; diffusers' skip_guidance_layers): the transformer blocks skipped in an extra pass of
    # the prompt, whose difference from the full pass is added times slg_scale, in the steps between slg_start and
    # slg_stop (fractions of the steps). () = off; SD3.5 Medium's recommended layers are 7, 8, 9
    slg_layers: tuple = ()
    slg_scale: float = 2.8
    slg_start: float = 0.01
    slg_stop: float = 0.2
    # FLUX.1 dev's distilled guidance scale (diffusers' guidance_scale for FluxPipeline, Forge's "Distilled CFG
    # Scale"), embedded by the transformer: not classifier-free guidance, which cfg_scale is. None: the model's
    # default (3.5); models without a guidance embedding refuse a value
    guidance: float | None = None
    # the step cache (DeepCache, sdlite.engine.stepcache): the whole UNet runs every cache_interval-th step (and the
    # last), the steps between reuse its deep features and run only skip branch cache_branch (0: the shallowest).
    # 0 = off (the default: exact). On a transformer (SD3, FLUX, Z-Image) the step cache is the first-block cache
    # (sdlite.engine.blockcache): on where cache_interval is set (at the default threshold) or cache_threshold is given;
    # the blocks after the first are skipped on a call whose first block changed less than cache_threshold
    cache_interval: int = 0
    cache_branch: int = DEFAULT_CACHE_BRANCH
    cache_threshold: float | None = None
    # how the noise is drawn and the sigmas placed: "a1111" (diffusers' and A1111's: image i's noise from a generator
    # seeded with seed + i) or "comfy" (ComfyUI's KSampler: the whole batch from one generator seeded with the seed,
    # ComfyUI's schedulers, which ``schedule`` may then name (normal, simple, sgm_uniform, ...; None: normal, or the
    # sampler name's Karras / Exponential), its start-latent scaling; text to image: sdlite.pipeline.latents)
    noise: str = "a1111"

    @property
    def is_img2img(self) -> bool:
        return self.init_image is not None

    @property
    def is_inpaint(self) -> bool:
        return self.init_image is not None and (self.mask is not None or self.mask_from_alpha
                                                or self.outpaint is not None)

    def replace(self, **changes) -> "Request":
        return dataclasses.replace(self, **changes)


@dataclass
class Result:
    images: list                      # PIL images
    seeds: list[int]                  # seed of each image (request.seed + i)
    request: Request                  # the parameters actually used (seed, size, sampler and schedule resolved)
    latents: torch.Tensor             # (B, 4, h, w) final latents, unscaled by the VAE factor
    warnings: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    infotext: dict = field(default_factory=dict)   # extra A1111 parameters ("Lora hashes", "TI hashes")
    interrupted: bool = False         # a step callback raised StopSampling: the images are the estimate at that step
    # the ControlNet units' control maps as the networks got them: (unit index, map, mask or None) per unit and pass
    # (a hires fix: the second pass's, then the first's)
    control_maps: list = field(default_factory=list)


def _validate_image_options(r: Request) -> Request:
    """The image-to-image options: each checked, the fill mode resolved. Images are not opened here."""
    from ..sources import INPAINT_AREAS, INPAINT_FILLS, RESIZE_MODES

    if r.init_image is None:
        for name, value, default in (("mask", r.mask, None), ("outpaint", r.outpaint, None),
                                     ("mask_from_alpha", r.mask_from_alpha, False)):
            if value != default:
                raise RequestError(f"{name} needs a source image (init_image / --init-image)")
        return r
    strength = r.strength
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0.0 < strength <= 1.0:
        raise RequestError(f"strength {strength!r} is not valid: it must be above 0 and at most 1 "
                           "(1 repaints everything, 0.3 keeps most of the source)")
    if int(r.steps * strength) < 1:
        least = math.ceil(1000 / r.steps) / 1000   # rounded up, so that it does run a step
        raise RequestError(f"strength {strength:g} with {r.steps} steps runs int({r.steps} x {strength:g}) = 0 "
                           f"steps: raise the strength to at least {least:g} or the steps")
    if r.mask is not None and r.mask_from_alpha:
        raise RequestError("give either a mask or mask_from_alpha (--mask-from-alpha), not both")
    if isinstance(r.mask_blur, bool) or not isinstance(r.mask_blur, int) or r.mask_blur < 0:
        raise RequestError(f"mask blur {r.mask_blur!r} is not valid: it must be 0 or more pixels")
    if isinstance(r.inpaint_padding, bool) or not isinstance(r.inpaint_padding, int) or r.inpaint_padding < 0:
        raise RequestError(f"inpaint padding {r.inpaint_padding!r} is not valid: it must be 0 or more pixels")
    fill = r.inpaint_fill or ("fill" if r.outpaint is not None else "original")
    if fill not in INPAINT_FILLS:
        raise RequestError(f"inpaint fill {fill!r} is not valid: expected one of {', '.join(INPAINT_FILLS)}")
    if r.inpaint_area not in INPAINT_AREAS:
        raise RequestError(f"inpaint area {r.inpaint_area!r} is not valid: expected one of {', '.join(INPAINT_AREAS)}")
    if r.resize_mode not in RESIZE_MODES:
        raise RequestError(f"resize mode {r.resize_mode!r} is not valid: expected one of {', '.join(RESIZE_MODES)}")
    outpaint = r.outpaint
    if outpaint is not None:
        try:
            outpaint = tuple(outpaint)
        except TypeError:
            outpaint = (outpaint,)
        if len(outpaint) != 4:
            raise RequestError(f"outpaint {r.outpaint!r} is not valid: expected four values LEFT,TOP,RIGHT,BOTTOM "
                               "in pixels, multiples of 8 (e.g. 64,0,64,0)")
        for side, value in zip(("left", "top", "right", "bottom"), outpaint):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % 8:
                raise RequestError(f"outpaint {side}={value!r} is not valid: it must be a multiple of 8 pixels, "
                                   "0 or more")
        if not any(outpaint):
            raise RequestError("outpaint 0,0,0,0 extends nothing: give at least one side a multiple of 8 above 0")
    return r.replace(inpaint_fill=fill if r.is_inpaint else r.inpaint_fill, outpaint=outpaint,
                     strength=float(strength))


def validate(request: Request, native_size: int = 512) -> Request:
    """Check every parameter and resolve the defaults; a bad one raises :class:`RequestError`.

    With a source image, a width or height left None stays None: it comes from the source's size when the
    source is read (:meth:`Engine.generate`)."""
    r = _validate_explicit(request)
    r = _validate_references(r)
    sized_by_source = r.init_image is not None or bool(r.reference_images)
    width = (None if sized_by_source else native_size) if r.width is None else r.width
    height = (None if sized_by_source else native_size) if r.height is None else r.height
    for name, value in (("width", width), ("height", height)):
        if value is None:
            continue
        if not isinstance(value, int) or value < 8 or value % 8:
            raise RequestError(f"{name}={value!r} is not valid: it must be a positive multiple of 8")
    if not isinstance(r.steps, int) or not 1 <= r.steps <= MAX_STEPS:
        raise RequestError(f"steps={r.steps!r} is not valid: it must be between 1 and {MAX_STEPS}")
    if not CFG_RANGE[0] <= float(r.cfg_scale) <= CFG_RANGE[1]:
        raise RequestError(f"cfg scale {r.cfg_scale!r} is out of range: it must be between {CFG_RANGE[0]:g} "
                           f"and {CFG_RANGE[1]:g} (1 turns guidance off)")
    if not isinstance(r.batch_size, int) or not 1 <= r.batch_size <= MAX_BATCH:
        raise RequestError(f"batch size {r.batch_size!r} is not valid: it must be between 1 and {MAX_BATCH}")
    if not isinstance(r.clip_skip, int) or r.clip_skip < 1:
        raise RequestError(f"clip skip {r.clip_skip!r} is not valid: it must be 1 (no skip) or more")
    if r.eta is not None and not 0.0 <= r.eta <= 1.0:
        raise RequestError(f"eta={r.eta!r} is not valid: it must be between 0 and 1")
    try:
        sampler, implied = resolve_sampler(r.sampler)
    except ValueError as e:
        raise RequestError(str(e)) from None
    schedule = r.schedule or implied
    if r.noise == "comfy":
        schedule = _validate_comfy(r, sampler, r.schedule or ("normal" if implied == "discrete" else implied))
    elif r.noise != "a1111":
        raise RequestError(f"noise {r.noise!r} is not valid: expected a1111 (a generator per image, seed + i) or "
                           "comfy (ComfyUI's KSampler: one generator for the batch)")
    elif schedule not in SIGMA_KINDS:
        raise RequestError(f"schedule {schedule!r} is not valid: expected one of {', '.join(SIGMA_KINDS)}")
    if r.timestep_spacing is not None and r.timestep_spacing not in SPACINGS:
        raise RequestError(f"timestep spacing {r.timestep_spacing!r} is not valid: expected one of "
                           f"{', '.join(SPACINGS)}")
    seed = r.seed
    top = COMFY_MAX_SEED if r.noise == "comfy" else MAX_SEED   # ComfyUI seeds its one generator with 64 bits
    if not isinstance(seed, int) or isinstance(seed, bool) or not -1 <= seed <= top:
        raise RequestError(f"seed {seed!r} is not valid: it must be -1 (random) or 0..{top}")
    if seed == -1:
        seed = random.SystemRandom().randrange(0, MAX_SEED - MAX_BATCH)
    if r.noise != "comfy" and seed + r.batch_size - 1 > MAX_SEED:
        raise RequestError(f"seed {seed} + batch {r.batch_size} runs past the largest seed {MAX_SEED}")
    _validate_sdxl_options(r)
    _validate_slg(r)
    if r.guidance is not None and (isinstance(r.guidance, bool) or not isinstance(r.guidance, (int, float))
                                   or not 0.0 <= float(r.guidance) <= 100.0):
        raise RequestError(f"distilled guidance scale {r.guidance!r} is not valid: expected a number from 0 to 100 "
                           "(FLUX.1 dev: 3.5 by default)")
    hires = _validate_hires(r, width, height)
    try:
        check_cache_options(r.cache_interval, r.cache_branch)
        check_threshold(r.cache_threshold)
    except (StepCacheError, BlockCacheError) as e:
        raise RequestError(str(e)) from None
    return _validate_image_options(r).replace(width=width, height=height, sampler=sampler, schedule=schedule,
                                              seed=seed, cfg_scale=float(r.cfg_scale), hires=hires,
                                              controls=_validate_controls(r))


MAX_REFERENCE_IMAGES = 10   # FLUX.2's limit for its reference images (BFL: up to 10 for [dev], fewer for [klein])


def _validate_references(r: Request) -> Request:
    """The reference images as a tuple of paths, PIL images (not opened here) or encoded latents (ComfyUI's
    ReferenceLatent), at most MAX_REFERENCE_IMAGES."""
    from pathlib import Path

    from PIL import Image

    if not isinstance(r.reference_resize, bool):
        raise RequestError(f"reference_resize {r.reference_resize!r} is not valid: expected true or false")
    refs = r.reference_images
    if refs is None:
        return r.replace(reference_images=())
    if isinstance(refs, (str, Path, Image.Image)):
        refs = (refs,)
    try:
        refs = tuple(refs)
    except TypeError:
        raise RequestError(f"reference_images {refs!r} is not valid: expected a list of image paths or images") \
            from None
    for i, ref in enumerate(refs):
        if isinstance(ref, torch.Tensor):   # an encoded reference: (1, C, h, w) latents in the sampler's scaling
            if ref.ndim != 4 or ref.shape[0] != 1:
                raise RequestError(f"reference image {i + 1}: a latent of shape {tuple(ref.shape)}; an encoded "
                                   "reference is one image's latents, (1, channels, height, width)")
            continue
        if not isinstance(ref, (str, Path, Image.Image)) or (isinstance(ref, str) and not ref):
            raise RequestError(f"reference image {i + 1} ({ref!r}) is not valid: expected an image path or a PIL image")
    if len(refs) > MAX_REFERENCE_IMAGES:
        raise RequestError(f"{len(refs)} reference images: at most {MAX_REFERENCE_IMAGES} are taken")
    return r.replace(reference_images=refs)


COMFY_MAX_SEED = 2**64 - 1
# the samplers noise="comfy" runs: every one a ComfyUI name maps to (sdlite.sampling.comfy.COMFY_SAMPLERS). The
# comfy path (pipeline/latents.py) calls a sampler's function on ComfyUI's sigmas with only what every sampler takes
# (generator, callback, extra_args; schedule and eta where its signature has them), so each of them runs there
COMFY_NOISE_SAMPLERS = tuple(dict.fromkeys(COMFY_SAMPLERS.values()))


def _validate_comfy(r: Request, sampler: str, schedule: str) -> str:
    """noise="comfy": the sampler and ComfyUI scheduler name checked, and what it does not run refused by name."""
    if sampler not in COMFY_NOISE_SAMPLERS:
        raise RequestError(f"sampler {sampler!r} does not run with noise='comfy' (ComfyUI's KSampler); the ones that "
                           f"do: {', '.join(COMFY_NOISE_SAMPLERS)}")
    if schedule not in COMFY_SCHEDULERS:
        raise RequestError(f"schedule {schedule!r} is not valid with noise='comfy': expected one of ComfyUI's "
                           f"schedulers {', '.join(COMFY_SCHEDULERS)}")
    for name, value, default in (("init_image", r.init_image, None), ("hires", r.hires, None),
                                 ("refiner_switch_at", r.refiner_switch_at, None), ("timesteps", r.timesteps, None),
                                 ("sigmas", r.sigmas, None), ("cache_interval", r.cache_interval, 0),
                                 ("cache_threshold", r.cache_threshold, None),
                                 ("slg_layers", tuple(r.slg_layers), ())):
        if value != default:
            raise RequestError(f"{name} does not run with noise='comfy', which samples as ComfyUI's KSampler does "
                               "from text (image to image and the rest: a ComfyUI workflow's nodes, or noise='a1111')")
    return schedule


def _validate_explicit(r: Request) -> Request:
    """Explicit timesteps or sigmas: each checked (what the model's schedule can check without the model), the
    steps set from their count. Which samplers take them, and a timestep's upper end, the model's schedule checks
    when it plans the run (:meth:`sdlite.sampling.NoiseSchedule.with_custom`)."""
    from ..sampling.schedules import ScheduleError, check_custom_sigmas, check_custom_timesteps

    if r.timesteps is None and r.sigmas is None:
        return r
    if r.timesteps is not None and r.sigmas is not None:
        raise RequestError("give explicit timesteps or explicit sigmas, not both")
    try:
        if r.timesteps is not None:
            timesteps, sigmas = check_custom_timesteps(r.timesteps), None
            steps = len(timesteps)
        else:
            timesteps, sigmas = None, check_custom_sigmas(r.sigmas)
            steps = len(sigmas) - 1
    except ScheduleError as e:
        raise RequestError(str(e)) from None
    if steps > MAX_STEPS:
        raise RequestError(f"explicit {'timesteps' if sigmas is None else 'sigmas'} give {steps} steps: at most "
                           f"{MAX_STEPS}")
    try:
        _, implied = resolve_sampler(r.sampler)
    except ValueError as e:
        raise RequestError(str(e)) from None
    kind = r.schedule or implied
    if kind != "discrete":
        raise RequestError(f"explicit {'timesteps' if sigmas is None else 'sigmas'} replace the sigma schedule: they "
                           f"cannot be {kind} sigmas (sampler {r.sampler!r}): choose the discrete schedule or a "
                           "sampler name without Karras / Exponential")
    if r.hires is not None:
        raise RequestError("explicit timesteps or sigmas plan one pass: the hires fix's second pass has its own steps "
                           "(leave the lists out, or the hires fix)")
    return r.replace(timesteps=timesteps, sigmas=sigmas, steps=steps)


def _validate_slg(r: Request) -> None:
    """Skip-layer guidance's options (which blocks a model has is the family's to check)."""
    layers = r.slg_layers
    if not isinstance(layers, (tuple, list)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                        for i in layers):
        raise RequestError(f"skip-layer guidance layers {layers!r} are not valid: expected block indices (0 or more), "
                           "e.g. 7,8,9")
    if not isinstance(r.slg_scale, (int, float)) or not 0.0 <= float(r.slg_scale) <= 10.0:
        raise RequestError(f"skip-layer guidance scale {r.slg_scale!r} is not valid: expected 0 to 10 (2.8 is "
                           "diffusers' default)")
    start, stop = r.slg_start, r.slg_stop
    if not all(isinstance(v, (int, float)) for v in (start, stop)) or not 0.0 <= start < stop <= 1.0:
        raise RequestError(f"skip-layer guidance start {start!r} and stop {stop!r} are not valid: expected fractions "
                           "of the steps with 0 <= start < stop <= 1")


def _validate_controls(r: Request) -> tuple:
    """The ControlNet units with their values checked and their names made ours."""
    from ..control import ControlError, ControlUnit

    units = []
    for i, unit in enumerate(r.controls or ()):
        if not isinstance(unit, ControlUnit):
            raise RequestError(f"ControlNet unit {i}: expected a ControlUnit, got {type(unit).__name__}")
        try:
            units.append(unit.checked(i))
        except ControlError as e:
            raise RequestError(str(e)) from None
    return tuple(units)


def _validate_hires(r: Request, width: int | None, height: int | None):
    """The hires fix's options, checked (:func:`sdlite.hires.validate`) with its target size and sampler."""
    if r.hires is None:
        return None
    from .. import hires as hires_module

    if not isinstance(r.hires, hires_module.Hires):
        raise RequestError(f"hires {r.hires!r} is not valid: expected a sdlite.hires.Hires")
    if r.init_image is not None:
        raise RequestError("the hires fix runs text to image; for image to image give the source at the size "
                           "wanted (or upscale it first: sdlite upscale)")
    try:
        h = hires_module.validate(r.hires, r.steps)
        hires_module.target_size(width, height, h)
        if h.sampler is not None:
            resolve_sampler(h.sampler)
    except (hires_module.HiresError, ValueError) as e:
        raise RequestError(str(e)) from None
    if h.schedule is not None and h.schedule not in SIGMA_KINDS:
        raise RequestError(f"hires schedule {h.schedule!r} is not valid: expected one of {', '.join(SIGMA_KINDS)}")
    return h


def _validate_sdxl_options(r: Request) -> None:
    """SDXL's size conditioning and the refiner hand-off."""
    for name in ("original_size", "target_size", "crops_coords_top_left"):
        value = getattr(r, name)
        if value is None:
            continue
        least = 0 if name == "crops_coords_top_left" else 1
        try:
            ok = len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= least
                                         for v in value)
        except TypeError:
            ok = False
        if not ok:
            what = "(top, left), pixels, 0 or more" if least == 0 else "(height, width), pixels, 1 or more"
            raise RequestError(f"{name} {value!r} is not valid: expected two integers {what}")
    for name in ("aesthetic_score", "negative_aesthetic_score"):
        value = getattr(r, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"{name} {value!r} is not valid: expected a number (the refiner was trained on 0-10)")
    switch = r.refiner_switch_at
    if switch is not None and (isinstance(switch, bool) or not isinstance(switch, (int, float))
                               or not 0.0 < switch < 1.0):
        raise RequestError(f"refiner switch {switch!r} is not valid: it must be above 0 and below 1 (the fraction "
                           "of the steps the base model runs, e.g. 0.8)")
