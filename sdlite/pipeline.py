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

import dataclasses
import gc
import random
import time
from dataclasses import dataclass, field
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

    from .engine.memory import ModelManager, check_memory_mode, trim_heap
    from .engine.tiling import tiled_decode
    from .errors import SDLiteError
    from .loader import StableDiffusion, open_model, resolve_prediction_type
    from .sampling.denoisers import CFGDenoiser, Denoiser
    from .sampling.samplers import SAMPLERS, resolve_sampler, sample
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


def validate(request: Request, native_size: int = 512) -> Request:
    """Check every parameter and resolve the defaults; a bad one raises :class:`RequestError`."""
    r = request
    width = native_size if r.width is None else r.width
    height = native_size if r.height is None else r.height
    for name, value in (("width", width), ("height", height)):
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
    return r.replace(width=width, height=height, sampler=sampler, schedule=schedule, seed=seed,
                     cfg_scale=float(r.cfg_scale))


def initial_noise(generators: list[torch.Generator], shape: tuple[int, ...]) -> torch.Tensor:
    """(B, *shape) standard normal noise, image i drawn from ``generators[i]`` (CPU), as the reference does."""
    return torch.cat([torch.randn((1, *shape), generator=g) for g in generators])


def latents_to_images(images: torch.Tensor) -> list:
    """Decoded images in [-1, 1] (B, 3, H, W) -> PIL images, rounded as the reference does."""
    arr = (images.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in (arr * 255).round().astype(np.uint8)]


class Engine:
    """A model on a device, ready to generate. Holds no per-request state.

    Which networks stay in memory is the :class:`~sdlite.engine.memory.ModelManager`'s business (memory modes
    0/1/2); the engine asks it for each network when it needs it.
    """

    def __init__(self, model: StableDiffusion | ModelManager, device: str | torch.device = "cpu",
                 tokenizer=None, spec=None, scheduler_config: dict | None = None, vae_tile: int | None = None):
        if isinstance(model, StableDiffusion):
            tokenizer, spec, scheduler_config = model.tokenizer, model.spec, model.scheduler_config
            model = ModelManager(model.checkpoint, mode=1, device=device, preloaded=model)
        self.models = model
        self.device = torch.device(device)
        self.vae_tile = vae_tile  # tiled-decode tile in latent pixels; None: automatic; 0: off
        self.tokenizer, self.spec = tokenizer, spec
        self.schedule = NoiseSchedule.from_config(scheduler_config)

    @classmethod
    def load(cls, path, device: str = "cpu", dtype: torch.dtype | None = None,
             prediction_type: str | None = None, memory_mode: int = 1,
             weight_dtype: torch.dtype | None = None, quantize: str = "none",
             vae_tile: int | None = None, prepack: bool | None = None) -> "Engine":
        """Open ``path`` and prepare it in ``memory_mode`` (see :data:`~sdlite.engine.memory.MEMORY_MODES`).

        ``dtype`` is the compute dtype (default fp32 on the CPU, fp16 on a GPU); ``weight_dtype`` the dtype the
        resident weights are kept in when it differs (e.g. fp16 weights computed in fp32, block by block);
        ``quantize`` one of :data:`~sdlite.engine.quant.QUANTIZE_MODES` for the UNet; ``vae_tile`` the tiled-decode
        tile in latent pixels (None: tile latents larger than 96x96, i.e. images above 768 px; 0: never);
        ``prepack`` whether fp32 CPU weights are reordered once for oneDNN (:mod:`sdlite.engine.packing`; None:
        where that applies and this CPU gains from it, as :func:`sdlite.engine.cpu.default_prepack` decides).
        """
        check_memory_mode(memory_mode)
        device = check_device(device)
        if dtype is None:
            dtype = torch.float32 if device.type == "cpu" else torch.float16
        ckpt = open_model(path, prediction_type=prediction_type)
        manager = ModelManager(ckpt, memory_mode, dtype, device, weight_dtype=weight_dtype, quantize=quantize,
                               prepack=prepack)
        if memory_mode != 0:
            manager.get("unet")  # resident from the start: the load is part of getting ready
        if ckpt.prediction_source == "unresolved":
            with manager.use("unet") as unet:
                resolve_prediction_type(ckpt, unet, device=device)
        return cls(manager, device, ckpt.tokenizer(), ckpt.spec, ckpt.scheduler_config, vae_tile=vae_tile)

    def encode_prompt(self, prompts: list[str], clip_skip: int = 1,
                      labels: list[str] | None = None) -> tuple[torch.Tensor, list[str]]:
        """(B, 77, width) contexts in one text-encoder pass; a warning for each prompt cut at 77 tokens, saying
        where (``labels`` name the prompts in those warnings)."""
        labels = labels or ["prompt"] * len(prompts)
        warnings, rows = [], []
        for label, text in zip(labels, prompts):
            info = self.tokenizer.tokenize_with_info(text)
            if info.truncated:
                warnings.append(f"{label} truncated to 77 tokens: {info.num_dropped} tokens after token "
                                f"{info.num_kept} were dropped: {info.dropped_text!r}")
            rows.append(torch.tensor(info.input_ids, dtype=torch.long))
        layers = self.spec.text.layers
        if clip_skip > layers:
            raise RequestError(f"clip skip {clip_skip} is not valid for this model: its text encoder has "
                               f"{layers} layers, so 1..{layers} are valid")
        with torch.no_grad(), self.models.use("text_encoder") as text_encoder:
            ctx = text_encoder(torch.stack(rows).to(self.device), clip_skip=clip_skip)
        return ctx, warnings

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Unscaled latents (B, 4, h, w) -> images (B, 3, 8h, 8w) in about [-1, 1]."""
        tile = self.vae_tile
        if tile is None:  # automatic: large images are decoded in tiles, which bounds the decoder's temporaries
            side = max(latents.shape[-2:])
            if self.models.mode == 0:  # low memory: an untiled 512^2 decode alone needs about 1 GB of temporaries
                tile = LOW_MEMORY_TILE if side > LOW_MEMORY_TILE else 0
            else:
                tile = AUTO_TILE if side > AUTO_TILE_ABOVE else 0
        if not tile:
            with torch.no_grad(), self.models.use("vae") as vae:
                return vae.decode(latents.to(self.device, vae.dtype))
        with torch.no_grad(), self.models.use_whole("vae") as vae:  # tiling calls the layers one by one
            return tiled_decode(vae, latents.to(self.device, vae.dtype), tile)

    def generate(self, request: Request, callback: Callable[[int, int], None] | None = None) -> Result:
        """Run one request. ``callback(step, total)`` is called after each sampler step."""
        r = validate(request, self.spec.default_size)
        if self.spec.unet.in_channels != self.spec.vae.latent_channels:
            raise RequestError(f"{self.spec.family} models take a source image and a mask besides the prompt; "
                               "text-to-image needs a text-to-image model")
        t0 = time.perf_counter()
        seeds = [r.seed + i for i in range(r.batch_size)]
        use_cfg = r.cfg_scale > 1.0
        if use_cfg:
            ctx, warnings = self.encode_prompt([r.prompt, r.negative_prompt], r.clip_skip,
                                               ["prompt", "negative prompt"])
            uncond = ctx[1:2].expand(r.batch_size, -1, -1)   # (B, 77, width), negative first in the CFG batch
        else:
            ctx, warnings = self.encode_prompt([r.prompt], r.clip_skip)
            uncond = None
        ctx = ctx[0:1].expand(r.batch_size, -1, -1)
        t1 = time.perf_counter()

        vae_scale = self.spec.vae.downscale
        shape = (self.spec.vae.latent_channels, r.height // vae_scale, r.width // vae_scale)
        # image i's generator draws its initial noise, then (stochastic samplers) its per-step noise
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        noise = initial_noise(generators, shape).to(self.device)

        def on_step(i, total, x):
            if callback is not None:
                callback(i + 1, total)

        with torch.no_grad(), self.models.use("unet") as unet:
            denoiser = CFGDenoiser(Denoiser(unet, self.schedule, self.spec.prediction_type, dtype=unet.dtype),
                                   r.cfg_scale if use_cfg else 1.0)
            latents = sample(r.sampler, denoiser, noise, self.schedule, r.steps, r.schedule, generator=generators,
                             spacing=r.timestep_spacing, eta=r.eta, callback=on_step, extra_args={"context": ctx, "uncond": uncond})
        # glibc keeps the sampling loop's freed activations in its heap (they are reused step after step); hand
        # them back before the decoder allocates its own, larger ones, or both count in the peak (about 250 MB
        # less peak at 512^2 for SD 1.5)
        trim_heap()
        t2 = time.perf_counter()
        decoded = self.decode_latents(latents / self.spec.vae.scaling_factor)
        t3 = time.perf_counter()
        return Result(images=latents_to_images(decoded), seeds=seeds, request=r, latents=latents,
                      warnings=warnings, timings={"text": t1 - t0, "sampling": t2 - t1, "decode": t3 - t2,
                                                  "total": t3 - t0})


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


__all__ = ["Engine", "Request", "Result", "RequestError", "validate", "initial_noise", "check_device",
           "SAMPLERS", "DEFAULT_SAMPLER"]
