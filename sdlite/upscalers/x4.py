"""The SD x4 upscaler (stabilityai/stable-diffusion-x4-upscaler): text-guided latent diffusion that makes an image
4x as wide and high.

    from sdlite.upscalers.x4 import X4Upscaler
    up = X4Upscaler.load("stable-diffusion-x4-upscaler")      # a diffusers folder, or x4-upscaler-ema.safetensors
    result = up.upscale(image, prompt="a white cat", seed=42)  # image: a PIL image or a path
    result.images[0].save("big.png")                           # 4x the input; result.seed is the seed used

The public API is :class:`X4Upscaler` (``load``, ``upscale``, ``close``; also built from an already loaded
:class:`~sdlite.loader.StableDiffusion` or :class:`~sdlite.families.loaded.LoadedModel`, such as an
:class:`~sdlite.pipeline.Engine`, of an x4 model), :class:`X4Result`
and :class:`X4Error` (a :class:`~sdlite.errors.RequestError`: a parameter or input image that cannot be used; a
model that is not an x4 upscaler is a :class:`~sdlite.errors.CheckpointError`), and the limits below.

What one :meth:`X4Upscaler.upscale` computes -- diffusers' ``StableDiffusionUpscalePipeline``, which
``precision="exact"`` matches to within fp32 rounding (``tests/test_x4_upscaler.py`` holds every 8-bit pixel to
1/255 of it with the same seed):

1. The input, as RGB in [-1, 1], its sides rounded down to multiples of 4 (a bicubic resize, as diffusers' image
   processor does: an input that is already a multiple of 4 is untouched; see ``X4Result.size``).
2. The prompt and the negative prompt (empty by default) through the OpenCLIP text tower; classifier-free guidance
   (default scale 9.0) runs both as one doubled batch, as the engine does.
3. The low-resolution image noised to ``noise_level`` (default 20, at most the model's ``max_noise_level``, 350) by
   the model's own DDPM schedule (``low_res_scheduler``): ``sqrt(a) x + sqrt(1 - a) n``. The seed's generator draws
   ``n`` first, then the starting latent: 4 channels at the input's own size (the VAE upsamples 4x), then whatever
   the sampler draws per step.
4. The sampler (default: the model's scheduler -- DDIM for the published folder) walks the latent down; at every
   step the UNet reads the scaled latent with the noised image concatenated (7 channels) and ``noise_level`` as a
   class label, for both halves of the guidance batch. The x4 upscaler is a v-prediction model.
5. The VAE decodes ``latent / 0.08333`` into the output, in exact tiles when it is large
   (:func:`sdlite.engine.tiling.tiled_decode`: equal to the untiled decode up to fp32 rounding).

Precision follows :mod:`sdlite.engine.precision` as for every model (``auto``: bf16 on CPUs with native bf16, fp16 on
a GPU, where the VAE decodes in fp32 as diffusers upcasts it). Prompts follow the engine's rules (A1111 emphasis,
75-token chunks): a plain prompt of up to 75 tokens gives diffusers' conditioning.

``DEFAULT_STEPS`` is 20 where diffusers defaults to 75: the model runs at the input's resolution with a 256-wide
first level, and on a CPU each step of a 128x128 input costs seconds.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from PIL import Image

from .. import sources
from ..config import CFG_RANGE, MAX_SEED, MAX_STEPS, X4_FAMILY
from ..engine.memory import ModelManager, check_memory_mode
from ..engine.precision import Precision, choose_precision
from ..errors import CheckpointError, RequestError, StopSampling
from ..families.base import initial_noise, latents_to_images
from ..families.loaded import LoadedModel
from ..families.x4 import X4Family
from ..loader import Checkpoint, StableDiffusion, open_model
from ..machine import check_device
from ..sampling.denoisers import CFGDenoiser, Denoiser, Recorded
from ..sampling.samplers import resolve_sampler, sample
from ..sources import image_to_tensor

__all__ = ["X4Upscaler", "X4Result", "X4Error", "DEFAULT_STEPS", "DEFAULT_CFG", "DEFAULT_NOISE_LEVEL",
           "MAX_INPUT_PIXELS", "MIN_INPUT_SIDE", "SCALE"]

SCALE = 4                      # the output is 4x the (rounded) input each way
DEFAULT_STEPS = 20
DEFAULT_CFG = 9.0              # diffusers' StableDiffusionUpscalePipeline default
DEFAULT_NOISE_LEVEL = 20       # its default too
MIN_INPUT_SIDE = 8             # pixels, after rounding down to a multiple of 4: the UNet halves the size three times
MAX_INPUT_PIXELS = 512 * 512   # the UNet runs at the input's size, the decoder at 4x: a 2048x2048 output at most


class X4Error(RequestError):
    """An upscale parameter or input image that cannot be used (the message names it and what is valid)."""


@dataclass
class X4Result:
    """What :meth:`X4Upscaler.upscale` made, and the parameters it used (seed and sampler resolved)."""

    images: list                  # one PIL image, ``size``
    seed: int
    prompt: str
    negative_prompt: str
    noise_level: int
    steps: int
    cfg_scale: float
    sampler: str                  # our sampler name
    schedule: str                 # its sigma schedule: discrete | karras | exponential
    size: tuple[int, int]         # (width, height) of the output: 4x the input rounded down to multiples of 4
    precision: str                # the precision used, as the PNG parameters record it (e.g. "bf16 (auto)")
    warnings: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    interrupted: bool = False     # a callback raised StopSampling: the image is the estimate at that step

    @property
    def image(self) -> Image.Image:
        return self.images[0]

    def parameters(self) -> dict:
        """The generation parameters in the A1111 style of ``key: value`` pairs (for a PNG's text)."""
        return {"Steps": self.steps, "Sampler": self.sampler, "Schedule type": self.schedule,
                "CFG scale": self.cfg_scale, "Seed": self.seed, "Size": f"{self.size[0]}x{self.size[1]}",
                "Noise level": self.noise_level, "Precision": self.precision}


class X4Upscaler:
    """The x4 upscaler, loaded and ready: holds no per-call state, so one instance serves every call.

    Build it with :meth:`load`, or from an x4 model already loaded (a :class:`~sdlite.loader.StableDiffusion`
    whose spec is the x4 family's, or a :class:`~sdlite.families.loaded.LoadedModel` of one, such as an
    :class:`~sdlite.pipeline.Engine`).
    """

    def __init__(self, model: StableDiffusion | LoadedModel, device: str | torch.device = "cpu"):
        engine = model if isinstance(model, LoadedModel) else LoadedModel(model, device)
        spec = engine.spec
        if not isinstance(engine.family, X4Family) or spec.low_res_scheduler is None:
            raise CheckpointError(f"a {spec.family} model is not the SD x4 upscaler (family {X4_FAMILY}: a UNet of "
                                  "7 input channels with a noise-level class embedding, and a low_res_scheduler)")
        self.engine = engine
        self.spec = spec
        self.family: X4Family = engine.family
        self.low_res_schedule = self.family.low_res_schedule

    @classmethod
    def load(cls, path, device: str | torch.device = "cpu", precision: str | None = None, memory_mode: int = 1,
             vae_tile: int | None = None, prepack: bool | None = None, winograd: bool | None = None,
             compile: bool = False) -> "X4Upscaler":
        """Open an x4 upscaler: a diffusers folder of ``StableDiffusionUpscalePipeline`` or the original single file
        (``x4-upscaler-ema.safetensors`` / ``.ckpt``), or an already opened :class:`~sdlite.loader.Checkpoint`.

        ``precision``: :mod:`sdlite.engine.precision`'s ``auto`` (None), ``exact`` (fp32: the diffusers-exact
        path), ``bf16``, ``int8``, ``int8-bf16`` or ``fp16``; ``memory_mode``, ``vae_tile`` (latent pixels; None:
        automatic; 0: never tile), ``prepack``, ``winograd`` and ``compile`` as :meth:`sdlite.pipeline.Engine.load`
        takes them. Another kind of model is a :class:`~sdlite.errors.CheckpointError` naming what it is."""
        check_memory_mode(memory_mode)
        device = check_device(device)
        choose_precision(precision, None, "none", device)     # a bad name refused before anything is opened
        ckpt = path if isinstance(path, Checkpoint) else open_model(path)
        if not X4Family.takes(ckpt.spec):
            raise CheckpointError(f"this is a {ckpt.spec.family} model, not the SD x4 upscaler (a "
                                  "StableDiffusionUpscalePipeline folder or x4-upscaler-ema.safetensors); generate "
                                  "with it, or give an x4 upscaler", ckpt.path)
        plan = choose_precision(precision, None, "none", device, spec=ckpt.spec)
        _, vae_dtype = X4Family(ckpt.spec).load_dtypes(ckpt, plan, device, memory_mode, prepack, None)
        manager = ModelManager(ckpt, memory_mode, plan.dtype, device, quantize=plan.quantize, prepack=prepack,
                               vae_dtype=vae_dtype, winograd=winograd, text_dtype=plan.text_dtype,
                               channels_last=plan.channels_last, compile=compile)
        if memory_mode != 0:
            manager.get("unet")   # resident from the start: the load is part of getting ready
        engine = LoadedModel(manager, device, ckpt.tokenizer(), ckpt.spec, ckpt.scheduler_config, vae_tile=vae_tile,
                             tokenizers=ckpt.tokenizers())
        engine.precision = plan
        return cls(engine)

    @property
    def precision(self) -> Precision:
        return self.engine.precision

    @property
    def max_noise_level(self) -> int:
        return self.spec.max_noise_level

    def close(self) -> None:
        """Release the model's files (the upscaler cannot be used after)."""
        ckpt = self.engine.models.ckpt
        if ckpt is not None:
            ckpt.close()

    # -- one upscale ---------------------------------------------------------------------------------------------

    def upscale(self, image, prompt: str = "", negative_prompt: str = "", noise_level: int = DEFAULT_NOISE_LEVEL,
                steps: int = DEFAULT_STEPS, cfg_scale: float = DEFAULT_CFG, sampler: str | None = None,
                seed: int = -1, callback: Callable[[int, int], None] | None = None) -> X4Result:
        """``image`` (a PIL image or a path) 4x as wide and high, guided by ``prompt`` (see the module docstring).

        ``noise_level``: how much the low-resolution image is noised before the model reads it (0 to
        :attr:`max_noise_level`; more lets the model invent more detail). ``sampler``: one of our sampler names or
        an A1111 one (``"DPM++ 2M Karras"``); None: the model's own scheduler. ``seed``: -1 picks one at random
        (reported in the result). ``cfg_scale`` 1 turns guidance off. ``callback(step, total)`` is called after each
        step; raising :class:`~sdlite.errors.StopSampling` there ends the run with the image of the current
        estimate (``X4Result.interrupted``). A parameter or image that cannot be used raises :class:`X4Error`."""
        t0 = time.perf_counter()
        sampler_name, schedule_kind, warnings = self._sampler(sampler)
        noise_level, steps, cfg_scale, seed = self._check(noise_level, steps, cfg_scale, seed, prompt,
                                                          negative_prompt)
        pixels, size, note = self._pixels(image)
        if note:
            warnings.append(note)
        engine, device = self.engine, self.engine.device
        use_cfg = cfg_scale > 1.0
        context, text_warnings = engine.encode_prompt([prompt, negative_prompt] if use_cfg else [prompt])
        warnings += [w for w in text_warnings if w not in warnings]
        t1 = time.perf_counter()

        g = torch.Generator().manual_seed(seed)
        # the low-resolution image at the requested noise level: its noise is the generator's first draw
        image = self.family.image_conditioning(pixels, noise_level, g, device)
        x_T = initial_noise([g], (self.family.latent.channels, *pixels.shape[2:]))            # (1, 4, h, w)
        extra = {"context": context[:1], "uncond": context[1:2] if use_cfg else None, **image}

        interrupted = False
        with torch.no_grad(), engine.models.use("unet") as unet:
            guided = CFGDenoiser(Denoiser(engine.models.runner("unet", unet), engine.schedule,
                                          self.family.prediction_type, dtype=unet.dtype), cfg_scale if use_cfg else 1.0)
            latest = Recorded(guided)

            def on_step(i, total, x):
                if callback is not None:
                    callback(i + 1, total)
                return x

            try:
                latents = sample(sampler_name, latest, x_T.to(device), engine.schedule, steps, schedule_kind,
                                 generator=[g], callback=on_step, extra_args=extra)
            except StopSampling:   # raised by the callback, so after at least one denoiser call
                latents, interrupted = latest.value, True
                warnings.append("stopped early: the image is the estimate of the final image at that step")
        t2 = time.perf_counter()
        decoded = engine.decode_latents(latents / self.family.latent.scaling_factor)
        images = latents_to_images(decoded)
        t3 = time.perf_counter()
        return X4Result(images=images, seed=seed, prompt=prompt, negative_prompt=negative_prompt,
                        noise_level=noise_level, steps=steps, cfg_scale=cfg_scale, sampler=sampler_name,
                        schedule=schedule_kind, size=images[0].size, precision=engine.precision.label,
                        warnings=warnings, timings={"text": t1 - t0, "sampling": t2 - t1, "decode": t3 - t2,
                                                    "total": t3 - t0}, interrupted=interrupted)

    def _sampler(self, name: str | None) -> tuple[str, str, list[str]]:
        """(sampler, sigma schedule, warnings): ``name`` resolved, or the model's scheduler's sampler."""
        if name is not None:
            try:
                sampler, kind = resolve_sampler(name)
            except ValueError as e:
                raise X4Error(str(e)) from None
            return sampler, kind, []
        return self.family.default_sampler()

    def _check(self, noise_level, steps, cfg_scale, seed, prompt, negative_prompt) -> tuple[int, int, float, int]:
        top = self.spec.max_noise_level
        if isinstance(noise_level, bool) or not isinstance(noise_level, int) or not 0 <= noise_level <= top:
            raise X4Error(f"noise level {noise_level!r} is not valid: it must be an integer from 0 to {top} (this "
                          "model's max_noise_level; 20 by default, more lets the model invent more detail)")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
            raise X4Error(f"steps={steps!r} is not valid: it must be between 1 and {MAX_STEPS}")
        if isinstance(cfg_scale, bool) or not isinstance(cfg_scale, (int, float)) or \
                not CFG_RANGE[0] <= cfg_scale <= CFG_RANGE[1]:
            raise X4Error(f"cfg scale {cfg_scale!r} is out of range: it must be between {CFG_RANGE[0]:g} and "
                          f"{CFG_RANGE[1]:g} (1 turns guidance off)")
        if isinstance(seed, bool) or not isinstance(seed, int) or not -1 <= seed <= MAX_SEED:
            raise X4Error(f"seed {seed!r} is not valid: it must be -1 (random) or 0..{MAX_SEED}")
        for what, text in (("prompt", prompt), ("negative prompt", negative_prompt)):
            if not isinstance(text, str):
                raise X4Error(f"{what} {text!r} is not valid: expected a string")
        if seed == -1:
            seed = random.SystemRandom().randrange(0, MAX_SEED)
        return noise_level, steps, float(cfg_scale), seed

    def _pixels(self, image) -> tuple[torch.Tensor, tuple[int, int], str | None]:
        """The input as (1, 3, h, w) in [-1, 1], h and w rounded down to multiples of 4 as diffusers' image processor
        does (a bicubic resize); the output size; a note when the input was resized."""
        try:
            image = sources.to_rgb(sources.load_image(image, "input image"))
        except sources.ImageInputError as e:
            raise X4Error(str(e)) from None
        w, h = image.size
        if w * h > MAX_INPUT_PIXELS:
            raise X4Error(f"input image {w}x{h} is {w * h} pixels, more than the x4 upscaler's cap of "
                          f"{MAX_INPUT_PIXELS} (512x512): its output would be {SCALE * w}x{SCALE * h}; downscale the "
                          "input, or upscale it with a tiled network upscaler (sdlite.upscalers)")
        rw, rh = w - w % SCALE, h - h % SCALE
        if min(rw, rh) < MIN_INPUT_SIDE:
            raise X4Error(f"input image {w}x{h} is too small: both sides must be at least {MIN_INPUT_SIDE} pixels")
        note = None
        if (rw, rh) != (w, h):
            image = image.resize((rw, rh), Image.Resampling.BICUBIC)
            note = (f"the input {w}x{h} was resized to {rw}x{rh} (sides that are multiples of {SCALE}, as the "
                    f"model's VAE needs): the output is {SCALE * rw}x{SCALE * rh}")
        return image_to_tensor(image), (SCALE * rw, SCALE * rh), note
