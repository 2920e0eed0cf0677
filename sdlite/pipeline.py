"""The one narrow API: a :class:`Request` in, images and the parameters actually used out.

    engine = Engine.load("model.safetensors")           # or Engine(StableDiffusion, device=...)
    result = engine.generate(Request(prompt="a red circle on a blue background", seed=42))
    result.images[0].save("out.png")

Conventions follow the reference implementation (diffusers' StableDiffusionPipeline), so the same seed gives
the same image: the initial noise is drawn on the CPU from ``torch.Generator().manual_seed(seed + i)`` for
image i of a batch (so any image can be regenerated alone), whatever the compute device; classifier-free
guidance runs the negative and positive prompts as one doubled batch, negative first, and only when the scale
is above 1.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import re
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Importing torch triggers several full garbage collections, each walking every object torch has created so far
# (about 0.4 s of CPU in all); nothing in an import is cyclic garbage worth collecting, so the collector is paused
# until the imports below are done.
_GC_WAS_ENABLED = gc.isenabled()
gc.disable()
try:
    import numpy as np
    import torch
    from PIL import Image

    from .engine import budget
    from .engine.memory import ModelManager, check_memory_mode, trim_heap, tune_heap
    from .engine.precision import Precision, choose_precision, whole_unet
    from .engine.precision import resolve as resolve_precision
    from .conditioning import chunk_prompt, encode_chunks, pad_to_same_length, single_row
    from .config import is_bert
    from .embeddings import EmbeddingDB
    from .engine.tiling import tiled_decode
    from .errors import SDLiteError
    from .prompts import ScheduledPrompt, extract_networks, prompt_schedule, text_at_step
    from .loader import Checkpoint, StableDiffusion, open_model, resolve_prediction_type
    from .sampling.denoisers import CFGDenoiser, Denoiser
    from .sampling.samplers import SAMPLERS, img2img_start, plan, resolve_sampler, sample
    from .sampling.schedules import SIGMA_KINDS, SPACINGS, NoiseSchedule
finally:
    if _GC_WAS_ENABLED:
        gc.enable()

MAX_SEED = 2**32 - 1
AUTO_TILE, AUTO_TILE_ABOVE = 64, 96   # latent pixels: tile 512 px when an image side exceeds 768 px
LOW_MEMORY_TILE = 32                  # memory mode 0: tiles of 256 px above 256 px (a 512^2 decode in 4 tiles)
CFG_RANGE = (1.0, 30.0)
MAX_STEPS = 1000
MAX_BATCH = 64
DEFAULT_SAMPLER = "dpmpp_2m_karras"   # A1111's default: "DPM++ 2M" with the "Karras" schedule


class RequestError(SDLiteError, ValueError):
    """A request parameter is out of range; the message names it, its value and what is valid."""


class StopSampling(Exception):
    """Raised by a step callback (``callback`` or ``on_latents`` of :meth:`Engine.generate`) to end sampling after
    the current step: the result then holds the images decoded from the latest estimate of the final latents
    (``Result.interrupted`` is True). A server's interrupt and skip use it."""


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
    # add-ons
    loras: tuple = ()                 # (path, weight) pairs, besides the prompt's <lora:name:weight> tags
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
    from .sources import INPAINT_AREAS, INPAINT_FILLS, RESIZE_MODES

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
    r = request
    sized_by_source = r.init_image is not None
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
    if schedule not in SIGMA_KINDS:
        raise RequestError(f"schedule {schedule!r} is not valid: expected one of {', '.join(SIGMA_KINDS)}")
    if r.timestep_spacing is not None and r.timestep_spacing not in SPACINGS:
        raise RequestError(f"timestep spacing {r.timestep_spacing!r} is not valid: expected one of "
                           f"{', '.join(SPACINGS)}")
    seed = r.seed
    if not isinstance(seed, int) or not -1 <= seed <= MAX_SEED:
        raise RequestError(f"seed {seed!r} is not valid: it must be -1 (random) or 0..{MAX_SEED}")
    if seed == -1:
        seed = random.SystemRandom().randrange(0, MAX_SEED - MAX_BATCH)
    if seed + r.batch_size - 1 > MAX_SEED:
        raise RequestError(f"seed {seed} + batch {r.batch_size} runs past the largest seed {MAX_SEED}")
    _validate_sdxl_options(r)
    hires = _validate_hires(r, width, height)
    return _validate_image_options(r).replace(width=width, height=height, sampler=sampler, schedule=schedule,
                                              seed=seed, cfg_scale=float(r.cfg_scale), hires=hires,
                                              controls=_validate_controls(r))


def _validate_controls(r: Request) -> tuple:
    """The ControlNet units with their values checked and their names made ours."""
    from .control import ControlError, ControlUnit

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
    from . import hires as hires_module

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


def initial_noise(generators: list[torch.Generator], shape: tuple[int, ...]) -> torch.Tensor:
    """(B, *shape) standard normal noise, image i drawn from ``generators[i]`` (CPU), as the reference does."""
    return torch.cat([torch.randn((1, *shape), generator=g) for g in generators])


def latents_to_images(images: torch.Tensor) -> list:
    """Decoded images in [-1, 1] (B, 3, H, W) -> PIL images, rounded as the reference does."""
    arr = (images.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in (arr * 255).round().astype(np.uint8)]


# latent -> RGB in [-1, 1], one linear map per latent channel: the approximation of the SD 1.x/2.x VAE that the
# A1111 web UI calls "Approx cheap" (after https://discuss.huggingface.co/t/decoding-latents-to-rgb-without-upscaling/23204)
_CHEAP_RGB = ((0.298, 0.207, 0.208), (0.187, 0.286, 0.173), (-0.158, 0.189, 0.264), (-0.184, -0.271, -0.473))
# the same for SDXL's VAE (the coefficients A1111 and other UIs use for SDXL's cheap preview)
_CHEAP_RGB_SDXL = ((0.3448, 0.4168, 0.4395), (-0.1953, -0.0290, 0.0250), (0.1074, 0.0886, -0.0163),
                   (-0.3730, -0.2499, -0.2088))


def approximate_images(latents: torch.Tensor, scale: int = 8, sdxl: bool = False) -> list:
    """Scaled latents (B, 4, h, w) -> PIL images (scale h x scale w) through a fixed linear map of the four
    channels: no network runs, so it costs next to nothing. Faithful for the SD 1.x/2.x VAE (``sdxl``: for SDXL's);
    for another VAE (the demo model's) it shows where the shapes are, in approximate colours."""
    coefs = torch.tensor(_CHEAP_RGB_SDXL if sdxl else _CHEAP_RGB, dtype=torch.float32)
    if latents.shape[1] != coefs.shape[0]:
        raise RequestError(f"the cheap preview needs {coefs.shape[0]} latent channels, not {latents.shape[1]}")
    rgb = torch.einsum("bchw,cr->brhw", latents.detach().float().cpu(), coefs)
    rgb = torch.nn.functional.interpolate(rgb, scale_factor=scale, mode="bilinear", align_corners=False)
    return latents_to_images(rgb)


class Engine:
    """A model on a device, ready to generate. Holds no per-request state.

    Which networks stay in memory is the :class:`~sdlite.engine.memory.ModelManager`'s business (memory modes
    0/1/2); the engine asks it for each network when it needs it.
    """

    def __init__(self, model: StableDiffusion | ModelManager, device: str | torch.device = "cpu",
                 tokenizer=None, spec=None, scheduler_config: dict | None = None, vae_tile: int | None = None,
                 tokenizers: dict | None = None):
        if isinstance(model, StableDiffusion):
            tokenizer, spec, scheduler_config = model.tokenizer, model.spec, model.scheduler_config
            tokenizers = {"text_encoder": model.tokenizer, "text_encoder_2": model.tokenizer_2}
            model = ModelManager(model.checkpoint, mode=1, device=device, preloaded=model)
        self.models = model
        self.device = torch.device(device)
        self.vae_tile = vae_tile  # tiled-decode tile in latent pixels; None: automatic; 0: off
        self.tokenizer, self.spec = tokenizer, spec
        # each text encoder's tokenizer (SDXL: two; they differ in their padding)
        self.tokenizers = {name: (tokenizers or {}).get(name) or tokenizer for name in spec.text_encoders}
        self.schedule = NoiseSchedule.from_config(scheduler_config)
        # SDXL: a refiner engine that takes the latents over for the last steps of a request that asks for it
        # (Request.refiner_switch_at); see :meth:`set_refiner`
        self.refiner: Engine | None = None
        # TAESDs (sdlite.models.taesd): one that decodes the final images instead of the VAE (:meth:`set_vae_decoder`)
        # and one for the "TAESD" live previews (:meth:`set_preview_decoder`); None: the VAE / no such previews
        self.vae_decoder = None
        self.preview_decoder = None
        # a batch whose estimated UNet (decoder) activations exceed these bytes runs in pieces (None: the device's
        # default, sdlite.engine.budget); the rule never looks at the memory free, so images never depend on it
        self.unet_piece_bytes: int | None = None
        self.decode_piece_bytes: int | None = None
        # what each network computes in (sdlite.engine.precision; :meth:`load` sets it); recorded in the PNG
        self.precision: Precision = resolve_precision("exact" if self.device.type == "cpu" else "fp16", self.device)
        # where the hires fix and upscales look up network upscalers by name (sdlite.upscalers.registry)
        self.upscaler_dir: str | None = None

    def set_refiner(self, refiner: "Engine | None") -> None:
        """Attach (or, with None, detach) an SDXL refiner for requests with ``refiner_switch_at``: both models must
        work in the same latent space (the same VAE latents)."""
        if refiner is not None:
            mine, theirs = self.spec.vae, refiner.spec.vae
            if (mine.latent_channels, mine.scaling_factor) != (theirs.latent_channels, theirs.scaling_factor):
                raise RequestError(f"the refiner ({refiner.spec.family}) does not share this model's latent space: "
                                   f"{theirs.latent_channels} latent channels scaled by {theirs.scaling_factor:g}, "
                                   f"this model {mine.latent_channels} by {mine.scaling_factor:g}")
        self.refiner = refiner

    def set_vae_decoder(self, taesd) -> None:
        """Decode the final images with ``taesd`` (a :class:`~sdlite.models.taesd.TinyAutoencoder` with a decoder)
        instead of the VAE: a fraction of the VAE's time, some detail lost; the PNG parameters say ``VAE decoder``.
        None: the VAE again."""
        self.vae_decoder = self._checked_taesd(taesd)

    def set_preview_decoder(self, taesd) -> None:
        """The TAESD for :meth:`preview` with ``tiny`` (A1111's "TAESD" live previews); None: none."""
        self.preview_decoder = self._checked_taesd(taesd)

    def _checked_taesd(self, taesd):
        if taesd is None:
            return None
        from .weights.taesd import model_variant

        cfg, vae, name = taesd.config, self.spec.vae, taesd.name
        if taesd.decoder is None:
            raise RequestError(f"{name} holds no TAESD decoder")
        if cfg.latent_channels != vae.latent_channels or cfg.downscale != vae.downscale:
            raise RequestError(f"{name} decodes {cfg.latent_channels}-channel latents {cfg.downscale}x; this model's "
                               f"are {vae.latent_channels}-channel, {vae.downscale}x")
        wanted = model_variant(self.spec)
        if cfg.variant is not None and cfg.variant != wanted:
            raise RequestError(f"{name} is a TAESD for {cfg.variant} latents; this model ({self.spec.family}) needs "
                               f"one for {wanted}")
        return taesd.to(self.device)

    @classmethod
    def load(cls, path, device: str = "cpu", dtype: torch.dtype | None = None,
             prediction_type: str | None = None, memory_mode: int = 1,
             weight_dtype: torch.dtype | None = None, quantize: str = "none",
             vae_tile: int | None = None, prepack: bool | None = None,
             winograd: bool | None = None, precision: str | None = None,
             compile: bool = False) -> "Engine":
        """Open ``path`` (or take an already opened :class:`~sdlite.loader.Checkpoint`) and prepare it in
        ``memory_mode`` (see :data:`~sdlite.engine.memory.MEMORY_MODES`).

        ``precision`` is the policy of :mod:`sdlite.engine.precision`: ``auto`` (the default: bf16 on a CPU with
        native bf16, fp16 on a GPU, else fp32), ``exact`` (fp32, the diffusers-exact path), ``bf16``, ``int8``,
        ``int8-bf16`` or ``fp16``. The older ``dtype`` and ``quantize`` name a precision too (``dtype=float32`` is
        ``exact``, ``quantize="int8"`` is ``int8``); given with ``precision`` they must agree with it.

        ``dtype`` is the compute dtype; ``weight_dtype`` the dtype the
        resident weights are kept in when it differs (e.g. fp16 weights computed in fp32, block by block);
        ``quantize`` one of :data:`~sdlite.engine.quant.QUANTIZE_MODES` for the UNet; ``vae_tile`` the tiled-decode
        tile in latent pixels (None: tile latents larger than 96x96, i.e. images above 768 px; 0: never);
        ``prepack`` whether fp32 CPU weights are reordered once for oneDNN (:mod:`sdlite.engine.packing`; None:
        where that applies and this CPU gains from it, as :func:`sdlite.engine.cpu.default_prepack` decides);
        ``winograd`` whether the UNet's and VAE's large-map 3x3 convolutions run by Winograd's F(2x2, 3x3)
        (:mod:`sdlite.engine.winograd`; None: wherever the compute is fp32 on a CPU); ``compile`` whether the UNet
        runs through ``torch.compile`` (:mod:`sdlite.engine.compile`: per input shape, cached on disk; eager, with one
        line on stderr saying why, where it does not apply).
        """
        check_memory_mode(memory_mode)
        device = check_device(device)
        choose_precision(precision, dtype, quantize, device)   # bad names and options refused before the open
        if device.type == "cpu":
            tune_heap()   # activations stay in the heap from step to step (engine.memory.tune_heap)
        # a Checkpoint already opened (headers read) by the caller is used as it is
        ckpt = path if isinstance(path, Checkpoint) else open_model(path, prediction_type=prediction_type)
        plan = whole_unet(choose_precision(precision, dtype, quantize, device, spec=ckpt.spec),
                          streams=memory_mode == 0 or weight_dtype is not None)
        dtype, quantize = plan.dtype, plan.quantize
        if (weight_dtype is None and ckpt.spec.is_sdxl and device.type == "cpu" and dtype == torch.float32
                and memory_mode != 0 and quantize == "none" and not prepack
                and ckpt.storage_dtype in (torch.float16, torch.bfloat16)):
            # SDXL on the CPU: its weights stay in the file's half precision (zero-copy), computed in fp32 block by
            # block -- 6.9 GB resident instead of 13.5 GB
            weight_dtype = ckpt.storage_dtype
        # SDXL's VAE overflows in fp16: it decodes in fp32 then (bf16 has fp32's range)
        vae_dtype = torch.float32 if ckpt.spec.is_sdxl and ckpt.spec.vae.force_upcast and \
            plan.vae_dtype == torch.float16 else plan.vae_dtype
        manager = ModelManager(ckpt, memory_mode, dtype, device, weight_dtype=weight_dtype, quantize=quantize,
                               prepack=prepack, vae_dtype=vae_dtype, winograd=winograd, text_dtype=plan.text_dtype,
                               channels_last=plan.channels_last, compile=compile, fp32_kernels=plan.fp32_kernels)
        if memory_mode != 0:
            manager.get("unet")  # resident from the start: the load is part of getting ready
        if ckpt.prediction_source == "unresolved":
            with manager.use("unet") as unet:
                resolve_prediction_type(ckpt, unet, device=device)
        engine = cls(manager, device, ckpt.tokenizer(), ckpt.spec, ckpt.scheduler_config, vae_tile=vae_tile,
                     tokenizers=ckpt.tokenizers())
        engine.precision = plan
        return engine

    def encode_prompt(self, prompts: list[str], clip_skip: int = 1, labels: list[str] | None = None,
                      embeddings: EmbeddingDB | None = None) -> tuple[torch.Tensor, list[str]]:
        """(P, 77 k, width) contexts of P prompts in one text-encoder pass, by A1111's rules
        (:mod:`sdlite.conditioning`: emphasis, 75-token chunks, ``BREAK``, ``embeddings``); prompts with fewer
        chunks are padded with the empty prompt's encoding; with a WordPiece tokenizer (BERT text encoders), one row
        of the tokenizer's length each (:func:`sdlite.conditioning.single_row`). Returns the warnings too (for
        CLIP none: long prompts are chunked, not cut; for BERT a cut prompt or an ignored BREAK)."""
        warnings: list[str] = []
        if self.spec.is_sdxl:
            encoded = self._encode_sdxl(list(prompts), clip_skip, embeddings)[0]
            empty = self._encode_sdxl([""], clip_skip, None)[0][0] if len({e.shape[1] for e in encoded}) > 1 else None
            return torch.cat(pad_to_same_length(encoded, empty) if empty is not None else encoded), warnings
        encoded = self._encode_texts(list(prompts), clip_skip, embeddings, warnings)
        empty = self._encode_texts([""], clip_skip, None)[0] if len({e.shape[1] for e in encoded}) > 1 else None
        return torch.cat(pad_to_same_length(encoded, empty) if empty is not None else encoded), warnings

    def _encode_texts(self, texts: list[str], clip_skip: int, embeddings: EmbeddingDB | None,
                      warnings: list[str] | None = None) -> list[torch.Tensor]:
        """Each text's (1, 77 k, width) conditioning (with a WordPiece tokenizer: (1, max_length, width), one row),
        in one text-encoder pass; warnings about the texts (a cut prompt, an ignored BREAK) go to ``warnings``."""
        layers = self.spec.text.layers
        if is_bert(self.spec.text) and clip_skip != 1:
            raise RequestError(f"clip skip {clip_skip} is not valid for this model: clip skip picks a layer of a "
                               "CLIP text encoder, and this model's text encoder is BERT (Taiyi), whose last "
                               "hidden state the UNet was trained on; use 1")
        if clip_skip > layers:
            raise RequestError(f"clip skip {clip_skip} is not valid for this model: its text encoder has "
                               f"{layers} layers, so 1..{layers} are valid")
        if getattr(self.tokenizer, "kind", "clip_bpe") == "wordpiece":
            if embeddings is not None and embeddings.embeddings:
                raise RequestError("textual-inversion embeddings are made for CLIP tokenizers and text encoders; "
                                   "this model reads WordPiece tokens (a BERT-style prompt row), so they cannot "
                                   "be used with it")
            chunk_lists = []
            for t in texts:
                chunks, _, notes = single_row(self.tokenizer, t)
                chunk_lists.append(chunks)
                if warnings is not None:
                    warnings += [n for n in notes if n not in warnings]
        else:
            chunk_lists = [chunk_prompt(self.tokenizer, t, embeddings)[0] for t in texts]
        with torch.no_grad(), self.models.use("text_encoder") as text_encoder:
            return encode_chunks(text_encoder, chunk_lists, clip_skip, self.device)

    def _encode_sdxl(self, texts: list[str], clip_skip: int,
                     embeddings: EmbeddingDB | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """SDXL: each text's (1, 77 k, width) context -- the penultimate hidden states (``clip_skip`` 2 and up reach
        further back, as diffusers' ``clip_skip`` 1 and up do) of its text encoders without their final LayerNorm,
        concatenated along the channels -- and its (1, proj) pooled embedding from the second encoder, whose
        tokenizer pads with its own pad token. Chunked by A1111's rules, each encoder's chunks weighted on their
        own, the pooled embedding of the first chunk (as A1111 does)."""
        if embeddings is not None and embeddings.embeddings:
            raise RequestError("textual-inversion embeddings for SDXL (with clip_l and clip_g vectors) are not "
                               "supported yet; remove embeddings_dir / --embeddings for this model")
        parts, pooled = [], None
        for name in self.spec.text_encoders:
            cfg = self.spec.text if name == "text_encoder" else self.spec.text2
            if clip_skip + 1 > cfg.layers:
                raise RequestError(f"clip skip {clip_skip} is not valid for this model: SDXL reads the layer before "
                                   f"the one clip skip names, and its {name} has {cfg.layers} layers, so "
                                   f"1..{cfg.layers - 1} are valid")
            chunk_lists = [chunk_prompt(self.tokenizers[name], t, None)[0] for t in texts]
            with torch.no_grad(), self.models.use(name) as text_encoder:
                if name == "text_encoder_2":
                    hidden, pooled = encode_chunks(text_encoder, chunk_lists, clip_skip, self.device, sdxl=True,
                                                   pooled=True)
                else:
                    hidden = encode_chunks(text_encoder, chunk_lists, clip_skip, self.device, sdxl=True)
            parts.append(hidden)
        return [torch.cat(hs, dim=-1) for hs in zip(*parts)], pooled

    def time_ids(self, r: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """SDXL's (1, 6) size/crop ids of the prompt and of the negative prompt, as diffusers builds them:
        original size, crop top-left, target size (the refiner: original size, crop, aesthetic score, (1, 5))."""
        size = (r.height, r.width)
        head = (*(r.original_size or size), *r.crops_coords_top_left)
        if self.spec.requires_aesthetics_score:
            pos, neg = (*head, r.aesthetic_score), (*head, r.negative_aesthetic_score)
        else:
            pos = neg = (*head, *(r.target_size or size))
        return (torch.tensor([pos], dtype=torch.float32, device=self.device),
                torch.tensor([neg], dtype=torch.float32, device=self.device))

    def conditioning(self, r: Request, use_cfg: bool,
                     embeddings: EmbeddingDB | None = None) -> "ScheduledConditioning":
        """The request's prompt and negative prompt (network tags already removed) as per-step conditioning:
        A1111's prompt editing and alternation (:func:`sdlite.prompts.prompt_schedule`) over ``r.steps``, each
        distinct text encoded once, in one text-encoder pass."""
        schedules = [prompt_schedule(r.prompt, r.steps)]
        if use_cfg:
            schedules.append(prompt_schedule(r.negative_prompt, r.steps))
        texts = list(dict.fromkeys(p.text for schedule in schedules for p in schedule))
        if use_cfg:
            texts.append("")  # the padding of a prompt and negative of different lengths
        warnings: list[str] = []
        if self.spec.is_sdxl:
            contexts, pooled = self._encode_sdxl(texts, r.clip_skip, embeddings)
            # no negative prompt: zeros for its context and pooled embedding, where the model's config says so
            # (diffusers: negative_prompt None; A1111: an empty negative prompt)
            zero = use_cfg and self.spec.force_zeros_for_empty_prompt and r.negative_prompt == ""
            return ScheduledConditioning(schedules[0], schedules[1] if use_cfg else None, dict(zip(texts, contexts)),
                                         warnings, pooled=dict(zip(texts, pooled)), zero_negative=zero,
                                         time_ids=self.time_ids(r))
        encoded = dict(zip(texts, self._encode_texts(texts, r.clip_skip, embeddings, warnings)))
        return ScheduledConditioning(schedules[0], schedules[1] if use_cfg else None, encoded, warnings)

    def decode_tile(self, height: int, width: int) -> int:
        """The tile (latent pixels; 0: untiled) a latent of ``height`` x ``width`` is decoded in."""
        tile = self.vae_tile
        if tile is None:  # automatic: large images are decoded in tiles, which bounds the decoder's temporaries
            side = max(height, width)
            if self.models.mode == 0:  # low memory: an untiled 512^2 decode alone needs about 1 GB of temporaries
                tile = LOW_MEMORY_TILE if side > LOW_MEMORY_TILE else 0
            else:
                tile = AUTO_TILE if side > AUTO_TILE_ABOVE else 0
        return tile

    def decode_latents(self, latents: torch.Tensor, piece: int | None = None) -> torch.Tensor:
        """Unscaled latents (B, 4, h, w) -> images (B, 3, 8h, 8w) in about [-1, 1]; ``piece`` images per decoder
        call (None: all at once)."""
        if piece is not None and piece < latents.shape[0]:
            return torch.cat([self.decode_latents(latents[i:i + piece]) for i in range(0, latents.shape[0], piece)])
        tile = self.decode_tile(*latents.shape[-2:])
        if not tile:
            with torch.no_grad(), self.models.use("vae") as vae:
                return vae.decode(latents.to(self.device, vae.dtype))
        with torch.no_grad(), self.models.use_whole("vae") as vae:  # tiling calls the layers one by one
            return tiled_decode(vae, latents.to(self.device, vae.dtype), tile)

    def decode_scaled(self, latents: torch.Tensor, piece: int | None = None) -> torch.Tensor:
        """Latents as the sampler gives them (B, 4, h, w) -> images (B, 3, 8h, 8w) in about [-1, 1]: by the TAESD of
        :meth:`set_vae_decoder` when there is one (it takes them as they are), else by the VAE."""
        if self.vae_decoder is None:
            return self.decode_latents(latents / self.spec.vae.scaling_factor, piece=piece)
        taesd, piece = self.vae_decoder, piece or latents.shape[0]
        with torch.no_grad():
            return torch.cat([taesd.decode(latents[i:i + piece].to(taesd.device, taesd.dtype))
                              for i in range(0, latents.shape[0], piece)])

    def preview(self, latents: torch.Tensor, full: bool = False, tiny: bool = False) -> list:
        """Images of an estimate of the final latents (what ``on_latents`` of :meth:`generate` receives): decoded by
        the VAE (``full``: exact, a decoder pass), by the TAESD of :meth:`set_preview_decoder` (``tiny``: close, a
        small fraction of the VAE's time) or by :func:`approximate_images` (instant, approximate)."""
        if tiny and self.preview_decoder is not None:
            taesd = self.preview_decoder
            with torch.no_grad():
                return latents_to_images(taesd.decode(latents.to(taesd.device, taesd.dtype)))
        if not full:
            return approximate_images(latents, self.spec.vae.downscale, sdxl=self.spec.is_sdxl)
        return latents_to_images(self.decode_latents(latents / self.spec.vae.scaling_factor))

    def encode_image(self, image: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
        """Images (1, 3, H, W) in [-1, 1] -> scaled latents (B, 4, H/8, W/8): one encoder pass, then one sample
        of the latent distribution per generator, each drawn as the reference draws it (``randn`` of the
        latent's shape from generator i; diffusers encodes the image once per batch item to the same moments).
        Without generators, the distribution's mean (B = 1)."""
        with torch.no_grad(), self.models.use("vae") as vae:
            mean, logvar = vae.encode_moments(image.to(self.device, vae.dtype))
        mean, std = mean.float(), torch.exp(0.5 * logvar.float())
        if not generators:
            return mean * self.spec.vae.scaling_factor
        draws = torch.cat([torch.randn(mean.shape, generator=g) for g in generators]).to(mean.device)
        return (mean + std * draws) * self.spec.vae.scaling_factor

    def prepare_source(self, r: Request) -> "Source":
        """Read the source image (and mask) of an image-to-image request and prepare the pixels as A1111 does:
        outpaint canvas, mask inversion and blur, fitting to the generation size (or the crop around the mask),
        the fill mode's pre-fill. Returns the pixels to encode and what the paste-back needs."""
        from . import sources

        try:
            loaded = sources.load_image(r.init_image, "init image")
            mask = None
            if r.mask_from_alpha:
                mask = sources.load_mask(loaded, "init image's transparency", from_alpha=True)
            elif r.mask is not None:
                mask = sources.load_mask(r.mask, "mask")
            image = sources.to_rgb(loaded)
            if mask is not None and mask.size != image.size:
                mask = mask.resize(image.size, Image.Resampling.LANCZOS).point(lambda v: 255 if v > 128 else 0)
            if mask is not None and r.invert_mask:
                mask = sources.invert_mask(mask)
            if r.outpaint is not None:
                image, border = sources.outpaint_canvas(image, *r.outpaint)
                if mask is None:
                    mask = border
                else:  # the given mask over the source, plus the new border
                    padded = Image.new("L", image.size, 0)
                    padded.paste(mask, (r.outpaint[0], r.outpaint[1]))
                    mask = Image.fromarray(np.maximum(np.asarray(padded), np.asarray(border)))
            if mask is not None:
                sources.check_mask_not_empty(mask, "the mask" + (" (inverted)" if r.invert_mask else ""))
        except sources.ImageInputError as e:
            raise RequestError(str(e)) from None
        # the source's size, rounded down to a multiple of 8 as diffusers' image processor does
        width = r.width or max(8, image.width // 8 * 8)
        height = r.height or max(8, image.height // 8 * 8)
        blurred = sources.blur_mask(mask, r.mask_blur) if mask is not None and r.mask_blur else mask
        paste_box = None
        if mask is not None and r.inpaint_area == "masked":
            paste_box = sources.crop_region(blurred, r.inpaint_padding, width, height)
            overlay_source, overlay_mask = image, blurred
            image = sources.resize_image(image.crop(paste_box), width, height, "fill")
            blurred = sources.resize_image(blurred.crop(paste_box), width, height, "fill")
        else:
            image = sources.resize_image(image, width, height, r.resize_mode)
            if blurred is not None:
                blurred = sources.resize_image(blurred, width, height, r.resize_mode)
            overlay_source, overlay_mask = image, blurred
        if blurred is not None and r.inpaint_fill == "fill":
            image = sources.fill_masked(image, blurred)
        return Source(image=image, mask=blurred, width=width, height=height, overlay_source=overlay_source,
                      overlay_mask=overlay_mask, paste_box=paste_box)

    def generate(self, request: Request, callback: Callable[[int, int], None] | None = None, *,
                 on_latents: Callable[[int, int, torch.Tensor], None] | None = None) -> Result:
        """Run one request. ``callback(step, total)`` is called after each sampler step, and before it
        ``on_latents(step, total, latents)`` with the current estimate of the final latents (the denoiser's
        prediction of x0, in the scaling of ``Result.latents``; :meth:`preview` turns it into images). Either may
        raise :class:`StopSampling` to end the run after that step with the images of that estimate."""
        if getattr(self.spec, "is_x4_upscaler", False):
            raise RequestError(f"{self.spec.family} is the SD x4 upscaler: it upscales images rather than drawing "
                               "them (sdlite upscale IMAGE --model PATH, or sdlite.upscalers.x4.X4Upscaler)")
        r = validate(request, self.spec.default_size)
        inpaint_model = self.spec.unet.in_channels != self.spec.vae.latent_channels
        if inpaint_model and self.spec.unet.in_channels != 2 * self.spec.vae.latent_channels + 1:
            raise RequestError(f"this UNet takes {self.spec.unet.in_channels} input channels: sdlite runs "
                               f"{self.spec.vae.latent_channels} (text to image, image to image) or "
                               f"{2 * self.spec.vae.latent_channels + 1} (inpainting models)")
        if inpaint_model and r.is_img2img and not r.is_inpaint:
            raise RequestError(f"{self.spec.family} is an inpainting model: image to image needs a mask "
                               "(--mask, --mask-from-alpha or --outpaint); without one it would repaint everything")
        if r.refiner_switch_at is not None:
            if self.refiner is None:
                raise RequestError("refiner_switch_at needs a refiner: load one (--refiner PATH, "
                                   "Engine.set_refiner) or leave the switch unset")
            if r.is_img2img:
                raise RequestError("the base-to-refiner hand-off runs text to image; for image to image run the "
                                   "refiner alone on the image (--model REFINER --init-image ...)")
        t0 = time.perf_counter()
        if r.hires is not None:
            if inpaint_model:
                raise RequestError(f"{self.spec.family} is an inpainting model: the hires fix runs on text-to-image "
                                   "models (load the base model for it)")
            return self._generate_hires(r, callback, on_latents, t0)
        source = self.prepare_source(r) if r.is_img2img else None
        if source is not None:
            r = r.replace(width=source.width, height=source.height)
        controls = self.prepare_controls(r, r.width, r.height, source=source)
        seeds = [r.seed + i for i in range(r.batch_size)]
        use_cfg = r.cfg_scale > 1.0
        networks = self.prompt_networks(r)
        with networks.applied(self):
            result = self._generate(r, source, seeds, use_cfg, networks, inpaint_model, callback, t0, on_latents,
                                    controls=controls)
        result.infotext.update(self.controls_infotext(r))
        result.control_maps = [c.map for c in controls]
        if self.vae_decoder is not None:
            result.infotext["VAE decoder"] = self.vae_decoder.name
        return result

    # -- ControlNet ------------------------------------------------------------------------------------------------

    def controlnet(self, path) -> tuple[torch.nn.Module, str]:
        """The ControlNet at ``path`` (a file or a diffusers folder) for this model, and its A1111 label ("name
        [hash]"): loaded in the UNet's compute precision and layout (Winograd, prepacked or channels-last where the
        UNet is: :meth:`~sdlite.engine.memory.ModelManager.adapt_like_unet`), or in memory mode 0 a
        network that streams its weights from the file block by block as the UNet does. Kept for the next request;
        the ones a request does not use are dropped (:meth:`prepare_controls`)."""
        from .control.apply import legacy_hash
        from .engine.memory import streamed_model
        from .weights.controlnet import ControlNetError, check_compatible, open_controlnet

        key = os.path.realpath(path)
        cache = self.__dict__.setdefault("_controlnets", {})
        if key not in cache:
            try:
                cfile = open_controlnet(path, self.spec.unet)
                try:
                    check_compatible(cfile.config, self.spec.unet, cfile.name, self.spec.family)
                    dtype = self.models.dtype_of("unet")
                    if self.models.mode == 0:
                        net = streamed_model(cfile, "controlnet", dtype, self.device)
                    else:
                        net = self.models.adapt_like_unet(cfile.load(dtype, self.device))
                        cfile.close()
                except BaseException:
                    cfile.close()
                    raise
            except ControlNetError as e:
                raise RequestError(f"ControlNet: {e}") from None
            cache[key] = (net, f"{cfile.name} [{legacy_hash(path)}]", cfile)
        net, label, _ = cache[key]
        return net, label

    def _drop_controlnets(self, keep_paths) -> None:
        cache = self.__dict__.get("_controlnets", {})
        wanted = {os.path.realpath(p) for p in keep_paths}
        for key in [k for k in cache if k not in wanted]:
            cache.pop(key)[2].close()

    def prepare_controls(self, r: Request, width: int, height: int, hires_pass: int | None = None,
                         source: "Source | None" = None) -> list:
        """The request's ControlNet units that apply to this pass (``hires_pass``: 1 or 2 in a hires fix), ready for
        a ``width`` x ``height`` run: each unit's image (the init image where it has none) run through its
        preprocessor and fitted by its resize mode, and its network. Inpainting only the masked area (``source``
        with a paste box), the extension's rule: the image fitted to the source canvas by the unit's resize mode,
        cropped to the same region as the source, then fitted to the run's size as "resize and fill"."""
        from . import sources
        from .control import ControlError, preprocess
        from .control.apply import ActiveControl, fit_control, hint_tensor

        self._drop_controlnets([u.model for u in r.controls])
        out = []
        for i, u in enumerate(r.controls):
            if not u.applies_to(hires_pass):
                continue
            image = u.image if u.image is not None else r.init_image
            if image is None:
                raise RequestError(f"ControlNet unit {i}: no control image (give one, or an init image for the unit "
                                   "to use)")
            mask = None
            box = source.paste_box if source is not None else None
            resize_mode = "resize-and-fill" if box is not None else u.resize_mode

            def crop(im):   # inpainting the masked area only: the source's region of the canvas
                if box is None:
                    return im
                return fit_control(im, *source.overlay_source.size, u.resize_mode).crop(box)
            try:
                image = crop(sources.load_image(image, f"ControlNet unit {i}'s image"))
                p = preprocess.find(u.preprocessor)
                if p.name == "inpaint":
                    where = u.mask if u.mask is not None else r.mask
                    if where is None:
                        raise RequestError(f"ControlNet unit {i}: the inpaint preprocessor needs a mask (the unit's "
                                           "or the request's)")
                    mask = fit_control(crop(sources.load_mask(where, f"ControlNet unit {i}'s mask")), width, height,
                                       resize_mode)
                elif p.name != "none":
                    res = (preprocess.pixel_perfect_resolution(image.size, width, height, resize_mode)
                           if u.pixel_perfect else u.processor_res)
                    image = preprocess.run(p.name, image, res, u.threshold_a, u.threshold_b)
            except (ControlError, sources.ImageInputError) as e:
                raise RequestError(str(e)) from None
            net, label = self.controlnet(u.model)
            fitted = fit_control(image, width, height, resize_mode)
            out.append(ActiveControl(u, net, hint_tensor(fitted, mask), label, map=(i, fitted, mask)))
        return out

    def controls_infotext(self, r: Request) -> dict:
        """A1111's ``ControlNet N`` parameters of the request's units."""
        from .control.units import infotext

        return {f"ControlNet {i}": infotext(u, self.controlnet(u.model)[1]) for i, u in enumerate(r.controls)}

    def prompt_networks(self, r: Request) -> "PromptNetworks":
        """The request's add-ons: ``<lora:name:w>`` tags (removed from the text, as A1111 does) and
        ``r.loras``, and the embeddings of ``r.embeddings_dir`` (``<embedding:name>`` rewritten to the name)."""
        from .embeddings import EmbeddingError, rewrite_tags_without_db

        warnings = []
        try:
            db = self._embedding_db(r.embeddings_dir)
            rewrite = db.rewrite_tags if db is not None else rewrite_tags_without_db
            prompt, tags = extract_networks(rewrite(r.prompt))
            negative, negative_tags = extract_networks(rewrite(r.negative_prompt))
        except EmbeddingError as e:
            raise RequestError(str(e)) from None
        loras = [(path, float(weight)) for path, weight in r.loras]
        names = [Path(path).stem for path, _ in r.loras]
        for tag in tags:
            if tag.kind == "lora":
                from . import lora as lora_module

                loras.append((lora_module.find_lora(tag.name, r.lora_dir), tag.weight))
                names.append(tag.name)   # A1111 records a tag's LoRA by the name the prompt gives
            else:
                warnings.append(f"<{tag.kind}:{tag.name}> in the prompt is not supported and was ignored "
                                "(supported: <lora:NAME:WEIGHT>, <embedding:NAME>)")
        if negative_tags:
            warnings.append("network tags in the negative prompt are ignored (as A1111 does): "
                            + ", ".join(f"<{t.kind}:{t.name}>" for t in negative_tags))
        return PromptNetworks(prompt, negative, loras, db, warnings, names)

    def _embedding_db(self, folder) -> EmbeddingDB | None:
        if folder is None:
            return None
        key = os.path.realpath(folder)
        cache = self.__dict__.setdefault("_embedding_dbs", {})
        if key not in cache:
            cache[key] = EmbeddingDB.from_dir(folder, self.tokenizer, self.spec.context_text.width)
        return cache[key]

    def hires_engine(self, checkpoint) -> "Engine":
        """The engine of a hires fix's second pass on another checkpoint (``Hires.checkpoint``: a path): loaded once
        on this engine's device, precision and memory mode, and kept for the next request that names it."""
        key = os.path.realpath(checkpoint)
        cache = self.__dict__.setdefault("_hires_engines", {})
        if key not in cache:
            cache.clear()   # one at a time: a second model resident beside this one is already a lot
            try:
                engine = Engine.load(checkpoint, device=self.device, precision=self.precision.requested,
                                     memory_mode=self.models.mode)
            except FileNotFoundError:
                raise RequestError(f"hires checkpoint {checkpoint!r} was not found") from None
            mine, theirs = self.spec.vae, engine.spec.vae
            if (mine.latent_channels, mine.downscale) != (theirs.latent_channels, theirs.downscale):
                raise RequestError(f"hires checkpoint {checkpoint!r} ({engine.spec.family}) does not work in this "
                                   f"model's ({self.spec.family}) latent space")
            cache[key] = engine
        return cache[key]

    def _generate_hires(self, r: Request, callback, on_latents, t0) -> Result:
        """The hires fix (:mod:`sdlite.hires`): the first pass as asked, an upscale, then image to image at the
        target size on this engine (or the hires checkpoint's)."""
        from . import hires as hires_module
        from .images import sampler_label, schedule_label

        h = r.hires
        target = hires_module.target_size(r.width, r.height, h, self.spec.vae.downscale)
        if not h.is_latent:   # an unknown upscaler is refused before any work
            from .upscalers.registry import UpscalerError, resolve

            try:
                resolve(h.upscaler, self.upscaler_dir)
            except UpscalerError as e:
                raise RequestError(f"hires upscaler: {e} (latent upscalers: "
                                   f"{', '.join(hires_module.LATENT_MODES)})") from None
        second_engine = self if h.checkpoint is None else self.hires_engine(h.checkpoint)
        steps2 = h.steps or r.steps
        r2 = validate(r.replace(width=target.width, height=target.height, steps=steps2,
                                sampler=h.sampler or r.sampler,
                                schedule=h.schedule or (r.schedule if h.sampler is None else None),
                                cfg_scale=r.cfg_scale if h.cfg_scale is None else h.cfg_scale,
                                prompt=r.prompt if h.prompt is None else h.prompt,
                                negative_prompt=r.negative_prompt if h.negative_prompt is None else h.negative_prompt,
                                strength=h.denoise, hires=None), second_engine.spec.default_size)
        first_steps = r.steps
        grand = first_steps + hires_module.second_pass_steps(h, r.steps)
        seeds = [r.seed + i for i in range(r.batch_size)]

        def progress(offset):
            cb = None if callback is None else (lambda step, total: callback(offset + step, grand))
            lat = None if on_latents is None else (lambda step, total, x: on_latents(offset + step, grand, x))
            return cb, lat

        use_cfg = r.cfg_scale > 1.0
        networks = self.prompt_networks(r)
        same_networks = second_engine is self and (r2.prompt, r2.negative_prompt) == (r.prompt, r.negative_prompt)
        cb1, lat1 = progress(0)
        with contextlib.ExitStack() as stack:
            stack.enter_context(networks.applied(self))
            controls1 = self.prepare_controls(r, r.width, r.height, hires_pass=1)
            first = self._generate(r, None, seeds, use_cfg, networks, False, cb1, t0, lat1, decode=False,
                                   controls=controls1)
            if first.interrupted:   # stopped in the first pass: its images, and no second pass
                first.images = latents_to_images(self.decode_scaled(first.latents))
                first.warnings.append("the hires fix's second pass did not run (stopped in the first pass)")
                first.request = r
                first.control_maps = [c.map for c in controls1]
                return first
            if not same_networks:
                stack.close()      # the first pass's LoRAs off; the second pass's go on below
            t_up = time.perf_counter()
            generators = [torch.Generator().manual_seed(s) for s in seeds]
            if h.is_latent:
                x0 = hires_module.upscale_latents(first.latents.float(), target, h.upscaler, self.spec.vae.downscale)
            else:
                from .upscalers.registry import upscale_to

                small = latents_to_images(self.decode_scaled(first.latents))
                box = target.crop_box(self.spec.vae.downscale)
                pixels = [image_to_tensor(upscale_to(im, h.upscaler, target.upscale_width, target.upscale_height,
                                                     folder=self.upscaler_dir, device=self.device).crop(box))
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
            second = second_engine._generate(r2, None, seeds, r2.cfg_scale > 1.0, networks2, False, cb2,
                                             time.perf_counter(), lat2, start_latents=(x0, generators),
                                             controls=controls2)
        warnings = list(first.warnings) + [w for w in second.warnings if w not in first.warnings]
        info = {**first.infotext, **hires_module.infotext(h, r.cfg_scale), **self.controls_infotext(r)}
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

    def _generate(self, r: Request, source, seeds, use_cfg, networks: "PromptNetworks", inpaint_model, callback,
                  t0, on_latents=None, *, decode: bool = True, start_latents=None, controls=None) -> Result:
        """One sampling run and its decode. ``decode=False``: no images (the latents only); ``start_latents``:
        ``(x0, generators)``, image to image from latents ``x0`` (the hires fix's second pass) at ``r.strength``,
        the noise drawn from ``generators`` (already used by an encoder). ``controls``: ControlNet units ready for
        this run (:meth:`prepare_controls`), applied where this model denoises (not an SDXL refiner's steps)."""
        warnings = list(networks.warnings)
        texts = r.replace(prompt=networks.prompt, negative_prompt=networks.negative)
        # who denoises which planned steps: this model, then (SDXL hand-off) the refiner with its own conditioning
        stages = [_Stage(self, self.conditioning(texts, use_cfg, networks.embeddings), 0, r.steps)]
        if r.refiner_switch_at is not None:
            switch = self.refiner_switch_step(r)
            stages = [_Stage(self, stages[0].cond, 0, switch),
                      _Stage(self.refiner, self.refiner.conditioning(texts, use_cfg), switch, r.steps)]
            stages = [st for st in stages if st.end > st.start]
        for st in stages:
            warnings += [w for w in st.cond.warnings if w not in warnings]
        t1 = time.perf_counter()

        vae_scale = self.spec.vae.downscale
        shape = (self.spec.vae.latent_channels, r.height // vae_scale, r.width // vae_scale)
        # image i's generator draws (source latent sample,) its initial noise, (masked-image latent sample,) then
        # (stochastic samplers) its per-step noise: the reference's order
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        concat, start, noised, blend = None, 0, False, None
        if start_latents is not None:   # image to image from latents: diffusers' img2img on 4-channel "images"
            x0, generators = start_latents
            start = img2img_start(r.steps, r.strength)
            p = plan(r.sampler, self.schedule, r.steps, r.schedule, r.timestep_spacing)
            x = (x0 + initial_noise(generators, shape).to(x0.device) * p.sigmas[start]).to(self.device)
            noised = True
        elif source is None and not inpaint_model:
            x = initial_noise(generators, shape).to(self.device)
        else:
            x, start, noised, concat, blend = self._image_latents(r, source, generators, shape, inpaint_model)
        # a run that starts part-way (image to image) skips the stages that end before its start (the base of an
        # SDXL hand-off whose switch comes first)
        for st in stages:
            st.start = max(st.start, start)
        stages = [st for st in stages if st.end > st.start]

        # a large batch runs in pieces (sdlite.engine.budget.pieces: fixed by the model, request and device)
        unet_piece, decode_piece = budget.pieces(self, r)
        done = [0]  # sampler steps completed, over all stages
        interrupted = False
        for st in stages:
            # the conditioning of the next step is put in place after each step (prompt editing, alternation)
            extra = st.cond.extra_at(st.start, r.batch_size)
            if concat is not None:
                extra["concat"] = concat

            controlled = None

            def on_step(i, total, x, st=st, extra=extra):
                done[0] += 1
                if controlled is not None:
                    controlled.step = st.start + i + 1 - start
                if blend is not None:
                    x = blend(i, total, x)
                if st.cond.changes and st.start + i + 1 < r.steps:
                    extra.update(st.cond.extra_at(st.start + i + 1, r.batch_size))
                if on_latents is not None:
                    on_latents(done[0], r.steps - start, denoised.value)
                if callback is not None:
                    callback(done[0], r.steps - start)
                return x

            engine = st.engine
            with torch.no_grad(), engine.models.use("unet") as unet:
                model = engine.models.runner("unet", unet)
                if controls and engine is self:
                    from .control.apply import ControlledUNet

                    model = controlled = ControlledUNet(unet, controls, use_cfg, r.steps - start, st.start - start)
                guided = CFGDenoiser(Denoiser(model, engine.schedule,
                                              engine.spec.prediction_type, dtype=unet.dtype),
                                     r.cfg_scale if use_cfg else 1.0)
                denoised = _Recorded(_Pieces(guided, unet_piece, r.batch_size) if unet_piece < r.batch_size
                                     else guided)
                try:
                    x = sample(r.sampler, denoised, x, engine.schedule, r.steps, r.schedule, generator=generators,
                               spacing=r.timestep_spacing, eta=r.eta, callback=on_step, extra_args=extra,
                               start=st.start, noised=noised or st.start > start, end=st.end)
                except StopSampling:  # raised by a step callback, so after at least one denoiser call
                    x, interrupted = denoised.value, True
                    warnings.append(f"stopped after step {done[0]} of {r.steps - start}: the images "
                                    "are the estimate of the final image at that step")
                    break
        latents = x
        decoder = stages[-1].engine   # the hand-off's images are the refiner's decode, as in diffusers' recipe
        if not decode:
            t2 = time.perf_counter()
            return Result(images=[], seeds=seeds, request=r, latents=latents, warnings=warnings,
                          infotext={**networks.infotext(), "Precision": self.precision.label},
                          timings={"text": t1 - t0, "sampling": t2 - t1, "decode": 0.0, "total": t2 - t0},
                          interrupted=interrupted)
        # glibc keeps the sampling loop's freed activations in its heap (they are reused step after step); hand
        # them back before the decoder allocates its own, larger ones, or both count in the peak (about 250 MB
        # less peak at 512^2 for SD 1.5)
        trim_heap()
        t2 = time.perf_counter()
        if self.vae_decoder is not None:   # a TAESD decodes the latents of whichever model denoised last
            decoder = self
        decoded = decoder.decode_scaled(latents, piece=decode_piece)
        images = latents_to_images(decoded)
        if source is not None and source.mask is not None:
            images = [source.finish(im, r.overlay) for im in images]
        t3 = time.perf_counter()
        return Result(images=images, seeds=seeds, request=r, latents=latents, warnings=warnings,
                      infotext={**networks.infotext(), "Precision": self.precision.label}, timings={"text": t1 - t0, "sampling": t2 - t1, "decode": t3 - t2,
                                                  "total": t3 - t0}, interrupted=interrupted)

    def refiner_switch_step(self, r: Request) -> int:
        """How many planned steps the base runs before the refiner takes over at ``r.refiner_switch_at``: the
        planned timesteps at or above ``round(T * (1 - switch))`` (T = 1000 training steps), the rule of diffusers'
        ``denoising_end`` / ``denoising_start``."""
        p = plan(r.sampler, self.schedule, r.steps, r.schedule, r.timestep_spacing)
        cutoff = round(self.schedule.num_train_timesteps * (1 - r.refiner_switch_at))
        return int((p.timesteps >= cutoff).sum())

    def _image_latents(self, r: Request, source: "Source | None", generators, shape, inpaint_model: bool):
        """The start of an image-to-image or inpainting run, as diffusers' img2img and inpainting pipelines
        build it: ``(x, start, noised, concat, blend)``, the start latent, the planned steps skipped, whether
        ``x`` is already noised, the inpainting UNet's extra channels and the 4-channel model's per-step
        re-imposition of the unmasked region."""
        if source is None:  # an inpainting model asked for text to image: all repainted, from a blank source
            pixels = torch.zeros(1, 3, r.height, r.width)
            mask = torch.ones(1, 1, r.height, r.width)
        else:
            pixels = image_to_tensor(source.image)
            mask = None if source.mask is None else mask_to_tensor(source.mask)
        strength = r.strength if source is not None else 1.0
        start = img2img_start(r.steps, strength)
        strength_max = strength == 1.0
        p = plan(r.sampler, self.schedule, r.steps, r.schedule, r.timestep_spacing)
        sigmas = p.sigmas[start:]
        is_inpaint = mask is not None
        # diffusers' inpainting pipeline starts from pure noise at strength 1 and needs no source latents then,
        # unless a 4-channel UNet re-imposes them; its img2img pipeline always noises the source
        need_source = not is_inpaint or not strength_max or not inpaint_model
        x0 = self.encode_image(pixels, generators) if need_source else None
        noise = initial_noise(generators, shape)
        concat = blend = None
        if is_inpaint:
            lat_mask = torch.nn.functional.interpolate(mask, size=shape[1:])             # nearest, as diffusers
            masked = pixels * (mask < 0.5)
            if inpaint_model:
                masked_latents = self.encode_image(masked, generators)
                concat = torch.cat([lat_mask.expand(len(generators), -1, -1, -1), masked_latents], dim=1)
            else:  # the reference encodes the masked image here too; only its draws matter to what follows
                for g in generators:
                    torch.randn(shape, generator=g)
            if x0 is not None and r.inpaint_fill in ("latent-noise", "latent-nothing"):
                fill = initial_noise(generators, shape) if r.inpaint_fill == "latent-noise" else torch.zeros_like(x0)
                x0 = x0 * (1 - lat_mask) + fill * lat_mask
            if not inpaint_model:
                blend = _Blend(x0.to(self.device), noise.to(self.device), lat_mask.to(self.device), sigmas)
        if is_inpaint and strength_max:
            return noise.to(self.device), start, False, _to(concat, self.device), blend
        x = x0 + noise * sigmas[0]
        return x.to(self.device), start, True, _to(concat, self.device), blend


@dataclass
class PromptNetworks:
    """A request's add-ons, resolved: the prompts without network tags, the LoRAs to apply ((path, weight)),
    the embeddings, and warnings about tags that were ignored."""

    prompt: str
    negative: str
    loras: list[tuple[str, float]]
    embeddings: EmbeddingDB | None
    warnings: list[str]
    lora_names: list[str] = field(default_factory=list)   # as the "Lora hashes" parameter names them

    def applied(self, engine):
        """A context in which the LoRAs are merged into the engine's networks (restored on exit)."""
        if not self.loras:
            return contextlib.nullcontext()
        from . import lora

        return lora.engine_with_loras(engine, self.loras)

    def infotext(self) -> dict:
        """A1111's "Lora hashes" and "TI hashes" parameters for what this request used."""
        from . import lora

        out = {}
        if self.loras:
            out["Lora hashes"] = lora.lora_hashes_infotext(zip(self.lora_names, (p for p, _ in self.loras)))
        if self.embeddings is not None:
            used = [e for e in self.embeddings.embeddings.values()
                    if any(_mentions(text, e.name) for text in (self.prompt, self.negative))]
            if used:
                out["TI hashes"] = ", ".join(f"{e.name}: {e.hash}" for e in used)
        return out


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", text) is not None


@dataclass
class ScheduledConditioning:
    """Per-step conditioning: the prompt's (and negative prompt's) schedule of texts and their encodings."""

    prompt: list[ScheduledPrompt]
    negative: list[ScheduledPrompt] | None
    encoded: dict[str, torch.Tensor]     # text -> (1, 77 k, width)
    warnings: list[str] = field(default_factory=list)   # about the texts: a prompt cut, BREAK ignored
    # SDXL: text -> (1, proj) pooled embedding; the negative conditioning as zeros; (prompt, negative) time ids
    pooled: dict[str, torch.Tensor] | None = None
    zero_negative: bool = False
    time_ids: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def changes(self) -> bool:
        return len(self.prompt) > 1 or (self.negative is not None and len(self.negative) > 1)

    def at(self, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(context, uncond) at 0-based sampler step ``step`` of the planned steps, each (batch, 77 k, width),
        the two of the same length (the shorter padded with the empty prompt's encoding, as A1111 does)."""
        cond = self.encoded[text_at_step(self.prompt, step)]
        if self.negative is None:
            return cond.expand(batch, -1, -1), None
        if self.zero_negative:
            return cond.expand(batch, -1, -1), torch.zeros_like(cond).expand(batch, -1, -1)
        uncond = self.encoded[text_at_step(self.negative, step)]
        if cond.shape[1] != uncond.shape[1]:
            cond, uncond = pad_to_same_length([cond, uncond], self.encoded[""])
        return cond.expand(batch, -1, -1), uncond.expand(batch, -1, -1)

    def extra_at(self, step: int, batch: int) -> dict:
        """The denoiser's conditioning arguments at ``step``: ``context`` and ``uncond`` (:meth:`at`) and, for
        SDXL, ``added`` and ``uncond_added``, the UNet's added conditioning (pooled text embeddings and time ids)."""
        context, uncond = self.at(step, batch)
        extra = {"context": context, "uncond": uncond}
        if self.pooled is None:
            return extra
        pooled = self.pooled[text_at_step(self.prompt, step)]
        time_ids, negative_ids = self.time_ids
        extra["added"] = {"text_embeds": pooled.expand(batch, -1), "time_ids": time_ids.expand(batch, -1)}
        if self.negative is not None:
            neg = torch.zeros_like(pooled) if self.zero_negative else self.pooled[text_at_step(self.negative, step)]
            extra["uncond_added"] = {"text_embeds": neg.expand(batch, -1), "time_ids": negative_ids.expand(batch, -1)}
        return extra


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


@dataclass
class _Stage:
    """One model's share of a run: it denoises the planned steps ``start`` to ``end`` with conditioning ``cond``."""

    engine: "Engine"
    cond: ScheduledConditioning
    start: int
    end: int


@dataclass(frozen=True, eq=False)
class _Recorded:
    """A denoiser that keeps its latest output (the estimate of the final latents) in ``value``, for step
    callbacks (previews) and for the images of a run stopped early. It computes exactly what it wraps."""

    denoiser: Callable
    _last: list = field(default_factory=lambda: [None])

    @property
    def value(self) -> torch.Tensor | None:
        return self._last[0]

    def with_timesteps(self, sigmas: torch.Tensor, timesteps: torch.Tensor) -> "_Recorded":
        return dataclasses.replace(self, denoiser=self.denoiser.with_timesteps(sigmas, timesteps))

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra) -> torch.Tensor:
        out = self.denoiser(x, sigma, **extra)
        self._last[0] = out
        return out


class _Pieces:
    """A denoiser over a batch of ``batch`` images run ``piece`` images at a time: each argument whose first
    dimension is the batch is cut along it (a (1, ...) tensor, broadcast to every image, is passed whole), and the
    pieces' outputs are put back together. Each piece is computed as a batch of ``piece`` images would be."""

    def __init__(self, denoiser, piece: int, batch: int):
        self.denoiser, self.piece, self.batch = denoiser, piece, batch

    def with_timesteps(self, sigmas: torch.Tensor, timesteps: torch.Tensor) -> "_Pieces":
        inner = self.denoiser
        if hasattr(inner, "with_timesteps"):
            inner = inner.with_timesteps(sigmas, timesteps)
        return _Pieces(inner, self.piece, self.batch)

    def _cut(self, value, lo: int, hi: int):
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == self.batch:
            return value[lo:hi]
        if isinstance(value, dict):
            return {k: self._cut(v, lo, hi) for k, v in value.items()}
        return value

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra) -> torch.Tensor:
        outs = []
        for lo in range(0, self.batch, self.piece):
            hi = min(lo + self.piece, self.batch)
            outs.append(self.denoiser(x[lo:hi], self._cut(sigma, lo, hi),
                                      **{k: self._cut(v, lo, hi) for k, v in extra.items()}))
        return torch.cat(outs)


@dataclass
class _Blend:
    """A 4-channel UNet's inpainting (diffusers' StableDiffusionInpaintPipeline): after each step, the
    unmasked region is replaced by the source latents noised to the step's new level (the same noise as the
    start), and after the last by the source latents themselves."""

    x0: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor     # (1, 1, h, w), 1 = repaint
    sigmas: torch.Tensor   # the run's sigmas (after the img2img start)

    def __call__(self, i: int, total: int, x: torch.Tensor) -> torch.Tensor:
        sigma = self.sigmas[i + 1].to(x.device)
        if i < total - 1:
            proper = self.x0 + self.noise * sigma
        else:  # the reference blends its unscaled latents with the clean source: in sigma form, scaled
            proper = self.x0 * (sigma**2 + 1) ** 0.5
        return (1 - self.mask) * proper.to(x.dtype) + self.mask * x


@dataclass
class Source:
    """A prepared source: the pixels to encode (``image``, RGB at width x height) and their ``mask`` ("L",
    blurred, 255 = repaint; None for plain image to image), and what pasting back needs: the source as the
    user sees it (``overlay_source``), the blurred mask at its size, and the crop box the generation covered
    (``paste_box``, inpaint area "masked")."""

    image: Image.Image
    mask: Image.Image | None
    width: int
    height: int
    overlay_source: Image.Image
    overlay_mask: Image.Image | None
    paste_box: tuple[int, int, int, int] | None = None

    def finish(self, result: Image.Image, overlay: bool) -> Image.Image:
        """A generated image as the user gets it: pasted back into the source where only a crop was generated,
        and (``overlay``) with the source's pixels composited back outside the blurred mask, as A1111 does."""
        from . import sources

        if overlay:
            return sources.apply_overlay(result, self.overlay_source, self.overlay_mask, self.paste_box)
        if self.paste_box is None:
            return result
        x1, y1, x2, y2 = self.paste_box
        out = self.overlay_source.copy()
        out.paste(result.resize((x2 - x1, y2 - y1), Image.Resampling.LANCZOS), (x1, y1))
        return out


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image -> (1, 3, H, W) float32 in [-1, 1], as the reference's image processor normalises it."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(arr).permute(2, 0, 1)[None] * 2.0 - 1.0


def mask_to_tensor(mask: Image.Image) -> torch.Tensor:
    """An "L" mask -> (1, 1, H, W) of 0/1: repaint where the (blurred) mask is at least half white, as the
    reference binarises it."""
    arr = np.asarray(mask.convert("L"), dtype=np.float32) / 255.0
    return torch.from_numpy((arr >= 0.5).astype(np.float32))[None, None]


def check_device(device: str | torch.device) -> torch.device:
    """The device, or a clear error when it is not there."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise RequestError(f"device {device!r} is not a device name (try cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RequestError(f"device {device!r} is not available: no CUDA GPU is visible to PyTorch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RequestError(f"device {device!r} is not available: {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise RequestError(f"device {device!r} is not available: Apple MPS is not available here")
    elif dev.type != "cpu":
        raise RequestError(f"device {device!r} is not supported: use cpu, cuda or mps")
    return dev


__all__ = ["Engine", "Request", "Result", "RequestError", "StopSampling", "approximate_images", "validate", "initial_noise", "check_device",
           "SAMPLERS", "DEFAULT_SAMPLER"]
