"""The engine: a loaded model (:class:`~sdlite.families.loaded.LoadedModel`) with the request loop on top.

    engine = Engine.load("model.safetensors")           # or Engine(StableDiffusion, device=...)
    result = engine.generate(Request(prompt="a red circle on a blue background", seed=42))
    result.images[0].save("out.png")

Conventions follow the reference implementation (diffusers' StableDiffusionPipeline), so the same seed gives
the same image: the initial noise is drawn on the CPU from ``torch.Generator().manual_seed(seed + i)`` for
image i of a batch (so any image can be regenerated alone), whatever the compute device; classifier-free
guidance runs the negative and positive prompts as one doubled batch, negative first, and only when the scale
is above 1.

The loop is the same for every family: it asks the model's :class:`~sdlite.families.base.Family` for conditioning,
latent format and parameterisation, and never tests which family it runs. Around it: text to image, image to image,
inpainting and outpainting (:mod:`sdlite.sources`), a refiner's hand-off, ControlNets (:mod:`.controls`), LoRAs and
embeddings (:mod:`.networks`) and the hires fix (:mod:`.hires`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .. import sources
from ..engine import budget
from ..engine.lowbit import in_gguf
from ..engine.memory import ModelManager, check_memory_mode, tune_heap
from ..engine.precision import STREAMED_WHY, choose_precision, stored_as, whole_unet
from ..engine import blockcache
from ..engine.blockcache import BlockCache
from ..engine.stepcache import StepCache, StepCacheError, cache_infotext
from ..errors import RequestError, StopSampling
from ..families import family_for
from ..families.base import ScheduledConditioning, initial_noise, latents_to_images
from ..families.loaded import LoadedModel
from ..loader import Checkpoint, open_model, resolve_prediction_type
from ..machine import check_device
from ..sampling.denoisers import CFGDenoiser, Pieces, Recorded
from ..sampling.samplers import img2img_start, plan, sample
from ..sampling.schedules import ScheduleError
from ..sources import Source, image_to_tensor, mask_to_tensor
from . import controls
from .hires import generate_hires, hires_engine
from .latents import LatentRun, run_latents
from .networks import PromptNetworks, prompt_networks
from .request import Request, Result, validate


class Engine(LoadedModel):
    """A model on a device, ready to generate. Holds no per-request state.

    Which networks stay in memory is the :class:`~sdlite.engine.memory.ModelManager`'s business (memory modes
    0/1/2); the engine asks it for each network when it needs it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)   # LoadedModel's arguments
        # a refiner engine that takes the latents over for the last steps of a request that asks for it
        # (Request.refiner_switch_at; SDXL's); see :meth:`set_refiner`
        self.refiner: Engine | None = None
        # where the hires fix looks up network upscalers by name (sdlite.upscalers.registry)
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

    @classmethod
    def load(cls, path, device: str = "cpu", dtype: torch.dtype | None = None,
             prediction_type: str | None = None, memory_mode: int = 1,
             weight_dtype: torch.dtype | None = None, quantize: str = "none",
             vae_tile: int | None = None, prepack: bool | None = None,
             winograd: bool | None = None, precision: str | None = None,
             compile: bool = False, text_encoders=(), weight_storage: str = "default") -> "Engine":
        """Open ``path`` (or take an already opened :class:`~sdlite.loader.Checkpoint`) and prepare it in
        ``memory_mode`` (see :data:`~sdlite.engine.memory.MEMORY_MODES`).

        ``precision`` is the policy of :mod:`sdlite.engine.precision`: ``auto`` (the default: bf16 on a CPU with
        native bf16, fp16 on a GPU, else fp32), ``exact`` (fp32, the diffusers-exact path), ``bf16``, ``int8``,
        ``int8-bf16``, ``int4`` (a transformer's) or ``fp16``. The older ``dtype`` and ``quantize`` name a precision
        too (``dtype=float32`` is ``exact``, ``quantize="int8"`` is ``int8``); given with ``precision`` they must agree
        with it.

        ``dtype`` is the compute dtype; ``weight_dtype`` the dtype the
        resident weights are kept in when it differs (e.g. fp16 weights computed in fp32, block by block);
        ``quantize`` one of :data:`~sdlite.engine.quant.QUANTIZE_MODES` for the UNet; ``vae_tile`` the tiled-decode
        tile in latent pixels (None: tile latents larger than 96x96, i.e. images above 768 px; 0: never);
        ``prepack`` whether fp32 CPU weights are reordered once for oneDNN (:mod:`sdlite.engine.packing`; None:
        where that applies and this CPU gains from it, as :func:`sdlite.engine.cpu.default_prepack` decides);
        ``winograd`` whether the UNet's and VAE's large-map 3x3 convolutions run by Winograd's F(2x2, 3x3)
        (:mod:`sdlite.engine.winograd`; None: wherever the compute is fp32 on a CPU); ``compile`` whether the
        denoiser (the UNet or a transformer) runs through ``torch.compile`` (:mod:`sdlite.engine.compile`: per input
        shape, cached on disk; eager, with one line on stderr saying why, where it does not apply);
        ``text_encoders`` the files of the text encoders a single-file SD3 model lacks
        (:func:`sdlite.loader.open_model`); ``weight_storage`` how a transformer's (FLUX, SD3) Linear weights are
        kept: ``default`` (as the precision says), ``fp8_e4m3fn`` or ``fp8_e5m2`` (ComfyUI's
        UNETLoader ``weight_dtype``: one byte a weight, converted into the compute dtype layer by layer as they run;
        :func:`sdlite.engine.precision.stored_as`).
        """
        check_memory_mode(memory_mode)
        device = check_device(device)
        stored_as(choose_precision(precision, dtype, quantize, device), weight_storage)   # refused before the open
        if device.type == "cpu":
            tune_heap()   # activations stay in the heap from step to step (engine.memory.tune_heap)
        # a Checkpoint already opened (headers read) by the caller is used as it is
        ckpt = path if isinstance(path, Checkpoint) else open_model(path, prediction_type=prediction_type,
                                                                    text_encoders=text_encoders)
        plan = whole_unet(choose_precision(precision, dtype, quantize, device, spec=ckpt.spec),
                          *_int8_unfit(ckpt, memory_mode, weight_dtype, weight_storage))
        plan = stored_as(plan, weight_storage, ckpt.spec)
        dtype, quantize = plan.dtype, plan.quantize
        # what the family keeps its weights and decodes in (SDXL on a CPU: half-precision weights computed in fp32,
        # its VAE in fp32 under fp16)
        weight_dtype, vae_dtype = family_for(ckpt.spec).load_dtypes(ckpt, plan, device, memory_mode, prepack,
                                                                    weight_dtype)
        manager = ModelManager(ckpt, memory_mode, dtype, device, weight_dtype=weight_dtype, quantize=quantize,
                               prepack=prepack, vae_dtype=vae_dtype, winograd=winograd, text_dtype=plan.text_dtype,
                               channels_last=plan.channels_last, compile=compile, fp32_kernels=plan.fp32_kernels,
                               t5_dtype=plan.t5_dtype, lowbit=plan.lowbit)
        if memory_mode != 0:
            manager.get(ckpt.spec.denoiser)  # resident from the start: the load is part of getting ready
        if ckpt.prediction_source == "unresolved":
            with manager.use("unet") as unet:
                resolve_prediction_type(ckpt, unet, device=device)
        engine = cls(manager, device, ckpt.tokenizer(), ckpt.spec, ckpt.scheduler_config, vae_tile=vae_tile,
                     tokenizers=ckpt.tokenizers())
        engine.precision = plan
        return engine

    def generate(self, request: Request, callback: Callable[[int, int], None] | None = None, *,
                 on_latents: Callable[[int, int, torch.Tensor], None] | None = None) -> Result:
        """Run one request. ``callback(step, total)`` is called after each sampler step, and before it
        ``on_latents(step, total, latents)`` with the current estimate of the final latents (the denoiser's
        prediction of x0, in the scaling of ``Result.latents``; :meth:`preview` turns it into images). Either may
        raise :class:`StopSampling` to end the run after that step with the images of that estimate."""
        r = self._checked(request)
        if r.timesteps is not None or r.sigmas is not None:   # what the lists allow is the model schedule's to say
            try:
                plan(r.sampler, self.schedule_for(r), r.steps, r.schedule, r.timestep_spacing)
            except ScheduleError as e:
                raise RequestError(str(e)) from None
        self.check_step_cache(r)
        ignored = [] if request.guidance is None or r.guidance is not None else [
            "a distilled guidance scale is FLUX.1 dev's (--guidance, Forge's distilled_cfg_scale); this model "
            f"({self.spec.family}) has none: ignored"]
        if r.noise == "comfy":   # ComfyUI's KSampler on an empty latent (sdlite.pipeline.latents)
            latent = self.family.latent
            empty = torch.zeros(r.batch_size, latent.channels, r.height // latent.downscale, r.width // latent.downscale)
            result = run_latents(self, r, LatentRun(empty), callback, on_latents, decode=True)
            result.infotext.update(self.controls_infotext(r))
            return self._finished(result, r, ignored)
        inpaint_model = self.family.inpainting
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
            result = generate_hires(self, r, callback, on_latents, t0)
            return self._finished(result, r, ignored)
        source = self.prepare_source(r) if r.is_img2img else None
        if source is not None:
            r = r.replace(width=source.width, height=source.height)
        controls = self.prepare_controls(r, r.width, r.height, source=source)
        seeds = [r.seed + i for i in range(r.batch_size)]
        use_cfg = r.cfg_scale > 1.0
        networks = self.prompt_networks(r)
        with networks.applied(self):
            result = self.run_pass(r, source, seeds, use_cfg, networks, inpaint_model, callback, t0, on_latents,
                                    controls=controls)
        result.infotext.update(self.controls_infotext(r))
        result.control_maps = [c.map for c in controls]
        return self._finished(result, r, ignored)

    def _checked(self, request: Request) -> Request:
        """``request`` validated, checked by the family and resolved (its defaults filled in)."""
        self.family.check_generate(request)
        r = validate(request, self.family.default_size)
        if r.reference_images and not self.family.takes_references:
            raise RequestError(f"reference images (editing from images) are for FLUX.2 [klein], FLUX.1 dev / "
                               f"Kontext and Qwen-Image-Edit models; this model "
                               f"({self.spec.family}) takes none: use init_image (--init-image) for image to image")
        self.family.check_request(r)
        return self.family.resolve(r)

    def sample_latents(self, request: Request, run: LatentRun, callback: Callable[[int, int], None] | None = None,
                       *, on_latents: Callable[[int, int, torch.Tensor], None] | None = None) -> Result:
        """Sample from given latents as ComfyUI's KSampler does (:func:`sdlite.pipeline.latents.run_latents`):
        ``run`` holds the latents, noise mask, denoise and step range; the request its prompts, sampler, ComfyUI
        scheduler name and seed (its ``noise`` is taken as "comfy", its size and batch as the latents'). Returns the
        latents, no images."""
        latent = self.family.latent
        b, _, h, w = run.latents.shape
        r = self._checked(request.replace(noise="comfy", batch_size=b, width=w * latent.downscale,
                                          height=h * latent.downscale))
        return run_latents(self, r, run, callback, on_latents)

    def _finished(self, result: Result, r: Request, ignored: list[str]) -> Result:
        """``result`` with what every generation adds to its parameters and warnings (the hires fix's too)."""
        if self.vae_decoder is not None:
            result.infotext["VAE decoder"] = self.vae_decoder.name
        result.warnings += ignored
        own = self.lora_sampling(r)   # a distilled LoRA's schedule in place of the model's (Qwen-Image-Lightning)
        if own is not None:
            result.warnings.append(own.note(r.steps, r.cfg_scale))
        if self.spec.denoiser == "unet":
            result.infotext.update(cache_infotext(r.cache_interval, r.cache_branch))
        else:
            result.infotext.update(blockcache.cache_infotext(self.block_cache_threshold(r)))
        return result

    # -- what a run uses: a source image, ControlNets, LoRAs and embeddings, a hires checkpoint ---------------

    def prepare_source(self, r: Request) -> Source:
        """The source image (and mask) of an image-to-image request, prepared as A1111 does
        (:func:`sdlite.sources.prepare`)."""
        return sources.prepare(r)

    def controlnet(self, path) -> tuple[torch.nn.Module, str]:
        """The ControlNet at ``path`` for this model and its A1111 label (:func:`sdlite.pipeline.controls.controlnet`)."""
        return controls.controlnet(self, path)

    def prepare_controls(self, r: Request, width: int, height: int, hires_pass: int | None = None,
                         source: "Source | None" = None) -> list:
        """The request's ControlNet units ready for a ``width`` x ``height`` pass
        (:func:`sdlite.pipeline.controls.prepare_controls`)."""
        return controls.prepare_controls(self, r, width, height, hires_pass, source)

    def controls_infotext(self, r: Request) -> dict:
        """A1111's ``ControlNet N`` parameters of the request's units."""
        return controls.controls_infotext(self, r)

    def prompt_networks(self, r: Request) -> PromptNetworks:
        """The request's LoRAs and embeddings, its prompts without network tags
        (:func:`sdlite.pipeline.networks.prompt_networks`)."""
        return prompt_networks(self, r)

    def hires_engine(self, checkpoint) -> "Engine":
        """The engine of a hires fix's second pass on another checkpoint (:func:`sdlite.pipeline.hires.hires_engine`)."""
        return hires_engine(self, checkpoint)

    # -- the loop ----------------------------------------------------------------------------------------------------

    def run_pass(self, r: Request, source, seeds, use_cfg, networks: "PromptNetworks", inpaint_model, callback,
                  t0, on_latents=None, *, decode: bool = True, start_latents=None, controls=None) -> Result:
        """One sampling run and its decode. ``decode=False``: no images (the latents only); ``start_latents``:
        ``(x0, generators)``, image to image from latents ``x0`` (the hires fix's second pass) at ``r.strength``,
        the noise drawn from ``generators`` (already used by an encoder). ``controls``: ControlNet units ready for
        this run (:meth:`prepare_controls`), applied where this model denoises (not an SDXL refiner's steps)."""
        warnings = list(networks.warnings)
        texts = r.replace(prompt=networks.prompt, negative_prompt=networks.negative)
        # who denoises which planned steps: this model, then (SDXL hand-off) the refiner with its own conditioning
        stages = [Stage(self, self.conditioning(texts, use_cfg, networks.embeddings), 0, r.steps)]
        if r.refiner_switch_at is not None:
            switch = self.refiner_switch_step(r)
            stages = [Stage(self, stages[0].cond, 0, switch),
                      Stage(self.refiner, self.refiner.conditioning(texts, use_cfg), switch, r.steps)]
            stages = [st for st in stages if st.end > st.start]
        for st in stages:
            warnings += [w for w in st.cond.warnings if w not in warnings]
        t1 = time.perf_counter()

        latent = self.family.latent
        shape = (latent.channels, r.height // latent.downscale, r.width // latent.downscale)
        # image i's generator draws (source latent sample,) its initial noise, (masked-image latent sample,) then
        # (stochastic samplers) its per-step noise: the reference's order
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        concat, start, noised, blend = None, 0, False, None
        schedule = self.schedule_for(r)
        if start_latents is not None:   # image to image from latents: diffusers' img2img on 4-channel "images"
            x0, generators = start_latents
            start = img2img_start(r.steps, r.strength, schedule)
            p = plan(r.sampler, schedule, r.steps, r.schedule, r.timestep_spacing)
            x = schedule.noised(x0, initial_noise(generators, shape).to(x0.device), p.sigmas[start])
            x = x.to(self.device)
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
        unet_piece, decode_piece = budget.pieces(self, r.height, r.width, r.batch_size, cfg=r.cfg_scale > 1.0)
        done = [0]  # sampler steps completed, over all stages
        interrupted = False
        for st in stages:
            # the conditioning of the next step is put in place after each step (prompt editing, alternation)
            extra = st.cond.extra_at(st.start, r.batch_size)
            if concat is not None:
                extra["concat"] = concat

            controlled = cache = None

            def on_step(i, total, x, st=st, extra=extra):
                done[0] += 1
                if controlled is not None:
                    controlled.step = st.start + i + 1 - start
                if cache is not None:
                    cache.step = i + 1
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
            network = engine.spec.denoiser   # the UNet, or a transformer
            with torch.no_grad(), engine.models.use(network) as unet:
                model = engine.models.runner(network, unet)
                if r.cache_interval or r.cache_threshold is not None:   # a fresh cache for each stage of each run
                    cache = engine.step_cache(r, unet, st.end - st.start)
                    model = cache.wrap(unet)
                if controls and engine is self:
                    from ..control.apply import ControlledUNet

                    model = controlled = ControlledUNet(unet, controls, use_cfg, r.steps - start, st.start - start)
                stage_schedule = engine.schedule_for(r)
                guided = CFGDenoiser(engine.family.denoiser(model, stage_schedule, unet.dtype),
                                     r.cfg_scale if use_cfg else 1.0, combine=engine.family.guidance,
                                     **engine.skip_layer_guidance(r))
                denoised = Recorded(Pieces(guided, unet_piece, r.batch_size) if unet_piece < r.batch_size
                                     else guided)
                try:
                    x = sample(r.sampler, denoised, x, stage_schedule, r.steps, r.schedule, generator=generators,
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
        t2 = time.perf_counter()
        if self.vae_decoder is not None:   # a TAESD decodes the latents of whichever model denoised last
            decoder = self
        decoder.release_before_decode()
        decoded = decoder.decode_scaled(latents, piece=decode_piece)
        images = latents_to_images(decoded)
        if source is not None and source.mask is not None:
            images = [source.finish(im, r.overlay) for im in images]
        t3 = time.perf_counter()
        return Result(images=images, seeds=seeds, request=r, latents=latents, warnings=warnings,
                      infotext={**networks.infotext(), "Precision": self.precision.label}, timings={"text": t1 - t0, "sampling": t2 - t1, "decode": t3 - t2,
                                                  "total": t3 - t0}, interrupted=interrupted)

    def check_step_cache(self, r: Request) -> None:
        """Refuse a step cache (``r.cache_interval``, :mod:`sdlite.engine.stepcache`; on a transformer the first-block
        cache, :mod:`sdlite.engine.blockcache`) where it cannot run: a compiled network, a branch the UNet does not
        have, a first-block threshold on a UNet."""
        if not r.cache_interval and r.cache_threshold is None:
            return
        what = "the step cache (cache_interval / --cache)"
        if self.models.compile:
            network = "UNet" if self.spec.denoiser == "unet" else "transformer"
            raise RequestError(f"{what} does not run on a compiled {network} (its graph is the whole "
                               "network): leave out --compile or the cache")
        if self.spec.denoiser != "unet":
            return
        if r.cache_threshold is not None:
            raise RequestError(f"step cache threshold {r.cache_threshold!r} (cache_threshold / --cache T) is the "
                               f"first-block cache of a transformer; this model ({self.spec.family}) denoises with a "
                               "UNet: its step cache is DeepCache (cache_interval, --cache N[:B])")
        cfg = self.spec.unet
        n = len(cfg.block_channels) * (cfg.layers_per_block + 1)   # one skip per up layer
        if r.cache_branch >= n:
            raise RequestError(f"step cache branch {r.cache_branch} is not valid for this model: its UNet has {n} "
                               f"skip branches (0 to {n - 1})")

    def block_cache_threshold(self, r: Request) -> float | None:
        """The first-block cache's threshold for ``r`` on a transformer: its own, the default where only the
        interval turns the cache on, None where the cache is off."""
        if r.cache_threshold is not None:
            return float(r.cache_threshold)
        return blockcache.DEFAULT_THRESHOLD if r.cache_interval else None

    def step_cache(self, r: Request, unet, steps: int) -> StepCache | BlockCache:
        """A fresh step cache for one stage of ``steps`` steps of ``r`` on ``unet`` (checked by
        :meth:`check_step_cache`): DeepCache on a UNet, the first-block cache on a transformer."""
        self.check_step_cache(r)
        if self.spec.denoiser != "unet":
            return BlockCache(self.block_cache_threshold(r))
        try:
            return StepCache(r.cache_interval, r.cache_branch, steps).checked(unet)
        except StepCacheError as e:
            raise RequestError(str(e)) from None

    def skip_layer_guidance(self, r: Request) -> dict:
        """The guidance's skip-layer options for ``r`` (:class:`~sdlite.sampling.denoisers.CFGDenoiser`): the blocks,
        the scale and the noise levels of the planned steps ``i`` with ``steps * start < i < steps * stop``, as
        diffusers' StableDiffusion3Pipeline picks them (the family has checked that its network has the blocks)."""
        if not r.slg_layers:
            return {}
        p = plan(r.sampler, self.schedule_for(r), r.steps, r.schedule, r.timestep_spacing)
        active = frozenset(float(p.sigmas[i]) for i in range(r.steps)
                           if r.steps * r.slg_start < i < r.steps * r.slg_stop)
        return {"skip_layers": tuple(r.slg_layers), "skip_scale": float(r.slg_scale), "skip_sigmas": active}

    def refiner_switch_step(self, r: Request) -> int:
        """How many planned steps the base runs before the refiner takes over at ``r.refiner_switch_at``: the
        planned timesteps at or above ``round(T * (1 - switch))`` (T = 1000 training steps), the rule of diffusers'
        ``denoising_end`` / ``denoising_start``."""
        p = plan(r.sampler, self.schedule_for(r), r.steps, r.schedule, r.timestep_spacing)
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
        schedule = self.schedule_for(r)
        start = img2img_start(r.steps, strength, schedule)
        strength_max = strength == 1.0
        p = plan(r.sampler, schedule, r.steps, r.schedule, r.timestep_spacing)
        sigmas = p.sigmas[start:]
        is_inpaint = mask is not None
        # diffusers' inpainting pipeline starts from pure noise at strength 1 and needs no source latents then,
        # unless a 4-channel UNet re-imposes them; its img2img pipeline always noises the source
        need_source = not is_inpaint or not strength_max or not inpaint_model
        # one source image: a latent sample drawn by each image's generator, or (the family's pipelines encode it
        # once) by the first image's alone, shared by the batch
        drawing = generators[:1] if self.family.shared_source_sample else generators
        if self.family.source_latent == "mean":   # no draw: the distribution's mean (FLUX.2 klein's pipelines)
            drawing = []
        x0 = self.encode_image(pixels, drawing or None).expand(len(generators), -1, -1, -1) if need_source else None
        noise = initial_noise(generators, shape)
        concat = blend = None
        if is_inpaint:
            lat_mask = self.family.latent_mask(mask, shape[1:])
            masked = pixels * (mask < 0.5)
            if inpaint_model:
                masked_latents = self.encode_image(masked, generators)
                concat = torch.cat([lat_mask.expand(len(generators), -1, -1, -1), masked_latents], dim=1)
            else:  # the reference encodes the masked image here too; only its draws matter to what follows
                for g in drawing:
                    torch.randn(shape, generator=g)
            if x0 is not None and r.inpaint_fill in ("latent-noise", "latent-nothing"):
                fill = initial_noise(generators, shape) if r.inpaint_fill == "latent-noise" else torch.zeros_like(x0)
                x0 = x0 * (1 - lat_mask) + fill * lat_mask
            if not inpaint_model:
                blend = Blend(x0.to(self.device), noise.to(self.device), lat_mask.to(self.device), sigmas,
                              schedule)
        if is_inpaint and strength_max:
            return noise.to(self.device), start, False, on_device(concat, self.device), blend
        x = schedule.noised(x0, noise, sigmas[0])
        return x.to(self.device), start, True, on_device(concat, self.device), blend


# --- the loop's small parts around the denoiser -------------------------------------------------------------

def _int8_unfit(ckpt: Checkpoint, memory_mode: int, weight_dtype, weight_storage: str) -> tuple[bool, str]:
    """(whether the denoiser cannot hold int8 layers here, why): :func:`~sdlite.engine.precision.whole_unet`'s
    arguments. It cannot while it is streamed (memory mode 0, or weights kept in another dtype) or its weights are
    kept in fp8; and ``auto`` leaves a GGUF transformer's blocks as the file holds them (int8 layers would hold a
    byte a weight, more than the 4-6 bits of the formats people pick to save memory)."""
    if memory_mode == 0 or weight_dtype is not None:
        return True, STREAMED_WHY
    if weight_storage != "default":
        return True, f"the transformer's weights are kept in {weight_storage} (weight storage), not int8"
    if ckpt.spec.unet is None and in_gguf(ckpt, ckpt.spec.denoiser):
        return True, ("the transformer's file is a GGUF, whose blocks are kept as the file holds them (int8 layers "
                      "would hold a byte a weight)")
    return False, ""


def on_device(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


@dataclass
class Stage:
    """One model's share of a run: it denoises the planned steps ``start`` to ``end`` with conditioning ``cond``."""

    engine: object   # the Engine that denoises these steps
    cond: ScheduledConditioning
    start: int
    end: int


@dataclass
class Blend:
    """A 4-channel UNet's inpainting (diffusers' StableDiffusionInpaintPipeline): after each step, the
    unmasked region is replaced by the source latents noised to the step's new level (the same noise as the
    start), and after the last by the source latents themselves."""

    x0: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor     # (1, 1, h, w), 1 = repaint
    sigmas: torch.Tensor   # the run's sigmas (after the img2img start)
    schedule: object       # the model's schedule: how a latent is noised to a sigma, and the sampler's scaling

    def __call__(self, i: int, total: int, x: torch.Tensor) -> torch.Tensor:
        sigma = self.sigmas[i + 1].to(x.device)
        if i < total - 1:
            proper = self.schedule.noised(self.x0, self.noise, sigma)
        else:  # the reference blends its own latents with the clean source: in the sampler's scaling
            proper = self.schedule.to_sampler(self.x0, sigma)
        return (1 - self.mask) * proper.to(x.dtype) + self.mask * x
