"""The server behind the routes: what every front-end's routes share, and where and how a job runs.

:class:`ServerBase` holds what the routes share wherever the jobs run (the checkpoints on offer, the options, the
credentials, the flags, the limits, the preview cache). :class:`Server` runs the jobs in this process, in one FIFO
job queue (:mod:`.jobs`) whose worker thread alone runs the engine; :mod:`sdlite.scale.ray_serve`'s cluster server
sends them to Ray Serve replicas. Both run a request with :func:`run_plan`.
"""
from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import os
import threading
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request
from starlette.concurrency import run_in_threadpool

from ..images import parameters_of, png_bytes
from ..pipeline import RequestError
from ..pipeline.hires import total_steps
from .a1111 import api as a1111
from .checkpoints import Checkpoint, Checkpoints, Engines
from .a1111.controlnet import ControlNets
from .a1111.references import with_references
from .http import MAX_BODY_BYTES, parse_auth
from .jobs import JobControl, Jobs, ShuttingDown
from .limits import Limits, admit, check_hires_size, check_size, check_steps

log = logging.getLogger("sdlite.server")

DISCONNECT_POLL_S = 0.5


class ServerBase:
    """What the routes share wherever the jobs run: the checkpoints on offer, the options, the credentials, the
    flags and the preview cache. :class:`Server` runs the jobs in this process; :mod:`sdlite.scale.ray_serve`'s
    cluster server sends them to Ray Serve replicas. A subclass provides the asynchronous methods below."""

    def __init__(self, model=None, models_dir=None, api_auth: str | None = None, *, lora_dir=None,
                 embeddings_dir=None, max_body_bytes: int = MAX_BODY_BYTES, flags: dict | None = None,
                 limits: Limits | None = None, upscaler_dir=None, controlnet_dir=None, api_key: str | None = None,
                 comfy_dir=None, vae_dir=None):
        if model is None and models_dir is None:
            from ..demo import model_path

            model = model_path()
        self.checkpoints = Checkpoints(model, models_dir)
        self.options = a1111.default_options()
        self._options_lock = threading.Lock()
        self.credentials = parse_auth(api_auth) if api_auth else None
        self.api_key = api_key or None   # --api-key: "Authorization: Bearer KEY" (http.auth_dependency)
        self.comfy_dir = comfy_dir       # --comfy-dir: ComfyUI's input/output/temp/user folders (.comfy.routes)
        self.lora_dir, self.embeddings_dir = lora_dir, embeddings_dir
        self.upscaler_dir = upscaler_dir   # upscaler networks by name (hires fix, extras)
        self.vae_dir = vae_dir             # VAE files by name (sd_vae, Forge's additional modules)
        self.controlnets = ControlNets(controlnet_dir)   # ControlNet models by name (alwayson_scripts units)
        self.max_body_bytes = max_body_bytes
        self.flags = flags or {}
        self.limits = limits if limits is not None else Limits()
        self._preview_cache: tuple[Any, str] | None = None
        self._upscale_lock = asyncio.Lock()   # the extras: one upscale at a time (upscale)
        self._edits: dict[Path, bool | None] = {}   # checkpoint path -> an editing model (edits_from_images)

    # --- options -------------------------------------------------------------------------------------------

    def options_snapshot(self) -> dict:
        with self._options_lock:
            current = self.checkpoints.current
            return {**self.options, "sd_model_checkpoint": current.title, "sd_checkpoint_hash": current.hash}

    def set_options(self, changes: dict) -> None:
        with self._options_lock:
            self.options.update(changes)

    def _preview_due(self, step: int, total: int) -> bool:
        with self._options_lock:
            enabled, every = self.options["live_previews_enable"], self.options["show_progress_every_n_steps"]
        return enabled and (step == total if every == -1 else step % every == 0)

    def build_plan(self, req: a1111.Txt2ImgRequest, options: dict | None = None,
                   defaults: dict | None = None) -> a1111.Plan:
        """:func:`~.a1111.build_plan` with this server's folders, limits and ControlNets: what every front-end's request
        becomes (``options``: a snapshot of the options; None: the current ones; ``defaults``: the front-end's own
        for fields left out, in place of A1111's)."""
        return a1111.build_plan(req, self.options_snapshot() if options is None else options,
                                max_image_bytes=self.max_body_bytes, lora_dir=self.lora_dir,
                                embeddings_dir=self.embeddings_dir, limits=self.limits, upscaler_dir=self.upscaler_dir,
                                controlnets=self.controlnets, vae_dir=self.vae_dir, defaults=defaults)

    def find_checkpoint(self, name: Any, field: str | None = None) -> Checkpoint:
        """The checkpoint ``name`` means (404 when there is none; ``field`` names the request field it came from)."""
        if not isinstance(name, str) or self.checkpoints.find(name) is None:
            self.checkpoints.refresh()   # A1111 refreshes its list once before giving up
        found = self.checkpoints.find(name) if isinstance(name, str) else None
        if found is None:
            what = f"{field}={name!r}" if field else repr(name)
            raise HTTPException(404, f"Model not found: {what}; available: {', '.join(self.checkpoints.names())}")
        return found

    def keep_overrides(self, plan: a1111.Plan, checkpoint: Checkpoint) -> None:
        """``override_settings_restore_afterwards`` false: the request's overrides stay after it."""
        if plan.keep_overrides:
            if plan.checkpoint is not None:
                self.checkpoints.current = checkpoint
            self.set_options({k: v for k, v in plan.keep_overrides.items() if k != "sd_model_checkpoint"})

    async def upscale(self, request: a1111.ExtrasSingleImageRequest, images: list[tuple[str, Any]]):
        """A1111's extras (``request``'s upscalers and size) on ``images``, ``(what, base64)`` each: all checked
        first (422 on a bad field, 413 on an image too large, the output within the limits), then upscaled in this
        process, one upscale at a time whichever front-end asked (a network upscale holds its own activations).
        Returns ``([(image, png), ...], fields, warnings)``: each result with its PNG (the source's ``parameters`` and
        the fields that record the upscale), the fields, and the warnings of what was ignored."""
        from ..upscalers.extras import parameters_after, postprocess

        extras, warnings = a1111.extras_plan(request, self.upscaler_dir, self.limits)
        decoded = []
        for what, data in images:
            image = await run_in_threadpool(a1111.decode_image, data, what, self.max_body_bytes)
            a1111.check_extras_size(image, extras, self.limits, what)
            decoded.append(image)
        out, fields = [], {}
        async with self._upscale_lock:
            for image in decoded:
                result, fields = await run_in_threadpool(postprocess, image, extras, self.upscaler_dir,
                                                         self.flags.get("device") or "cpu")
                png = await run_in_threadpool(png_bytes, result, parameters_after(parameters_of(image), fields))
                out.append((result, png))
        return out, fields, warnings

    def preview_b64(self, image) -> str | None:
        if image is None:
            return None
        cached = self._preview_cache
        if cached is not None and cached[0] is image:
            return cached[1]
        encoded = base64.b64encode(png_bytes(image)).decode("ascii")
        self._preview_cache = (image, encoded)
        return encoded

    # --- what a subclass provides ----------------------------------------------------------------------------

    async def generate(self, plan: a1111.Plan, request: Request, progress=None) -> a1111.Outcome | None:
        """Run the plan (after the jobs queued before it); None when the client went away meanwhile. Raises
        QueueFull / ShuttingDown (503) when the job is refused. ``progress(iteration, iterations, step, steps)`` is
        called after each sampler step, from the worker thread, where the job runs in this process."""
        raise NotImplementedError

    async def progress(self, want_image: bool) -> tuple[dict, Any]:
        """A1111's progress JSON (without ``current_image``) and the latest preview image or None."""
        raise NotImplementedError

    async def interrupt(self) -> None:
        raise NotImplementedError

    async def skip(self) -> None:
        raise NotImplementedError

    async def switch_model(self, target: Checkpoint, request: Request) -> None:
        """Make ``target`` the current model, loaded after the jobs queued before; returns once it is loaded."""
        raise NotImplementedError

    def text_width(self) -> int | None:
        """The current model's text-encoder width when it is known without loading it, else None."""
        return None

    def edits_from_images(self) -> bool | None:
        """Whether the current model is an editing model (its family's ``edits_from_images``: FLUX.2 [klein], FLUX.1
        Kontext), read once from its headers (no tensor data); None where they cannot tell (a part missing). The web
        page's Edit tab asks (``sdlite_edits_from_images`` in A1111's ``/options``)."""
        from ..families import family_for
        from ..loader import open_model

        path = self.checkpoints.current.path
        if path not in self._edits:
            try:
                with open_model(path) as ckpt:
                    self._edits[path] = bool(family_for(ckpt.spec).edits_from_images)
            except Exception:  # noqa: BLE001 - unknown: the server says so when an edit runs
                self._edits[path] = None
        return self._edits[path]

    def stopping(self) -> bool:
        """Whether a shutdown has begun (the queue takes no new jobs)."""
        return False

    def start(self) -> None:
        """Called when the app starts (before requests)."""

    async def stop(self) -> None:
        """Called when the app stops."""


class Server(ServerBase):
    """The single-machine server: one engine cache and one FIFO job queue, in this process."""

    def __init__(self, model=None, models_dir=None, api_auth: str | None = None, queue_size: int = 32, *,
                 lora_dir=None, embeddings_dir=None, max_body_bytes: int = MAX_BODY_BYTES,
                 engine_options: dict | None = None, flags: dict | None = None, preload: bool = True,
                 limits: Limits | None = None, upscaler_dir=None, controlnet_dir=None, api_key: str | None = None,
                 comfy_dir=None, vae_dir=None):
        super().__init__(model, models_dir, api_auth, lora_dir=lora_dir, embeddings_dir=embeddings_dir,
                         max_body_bytes=max_body_bytes, flags=flags, limits=limits, upscaler_dir=upscaler_dir,
                         controlnet_dir=controlnet_dir, api_key=api_key, comfy_dir=comfy_dir, vae_dir=vae_dir)
        self.engines = Engines(self.checkpoints, limit=1, **(engine_options or {}))
        self.jobs = Jobs(queue_size, preview_every=self._preview_due, job_timeout=self.limits.job_timeout)
        self._preload = preload

    def set_options(self, changes: dict) -> None:
        super().set_options(changes)
        with self._options_lock:
            self.engines.limit = self.options["sd_checkpoints_limit"]

    # --- work done in the queue's worker thread ------------------------------------------------------------

    def switch(self, checkpoint: Checkpoint) -> None:
        """Load ``checkpoint`` and make it the current model."""
        self.engines.get(checkpoint)
        self.checkpoints.current = checkpoint

    def preload(self) -> None:
        self.engines.get(self.checkpoints.current)

    def run(self, plan: a1111.Plan, control: JobControl) -> a1111.Outcome:
        """One txt2img / img2img request: its iterations, one after another, with progress and previews."""
        checkpoint = self.checkpoints.current if plan.checkpoint is None else self.find_checkpoint(plan.checkpoint)
        outcome = run_plan(self.engines, checkpoint, plan, control)
        self.keep_overrides(plan, checkpoint)
        return outcome

    # --- awaiting jobs -------------------------------------------------------------------------------------

    async def wait(self, job, request: Request):
        """The job's result; a client that goes away meanwhile gets its job dropped (queued) or interrupted."""
        future = asyncio.wrap_future(job.future)
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
                if done:
                    return future.result()
                if await request.is_disconnected():
                    self.jobs.cancel(job)
                    log.info("client went away: job %d (%s) dropped", job.id, job.label)
                    return None
        except asyncio.CancelledError:
            self.jobs.cancel(job)
            if self.jobs.closed:   # the server stops at once (SIGINT): its client gets a 503, not a bare 500
                raise ShuttingDown(running=True) from None
            raise

    # --- ServerBase ----------------------------------------------------------------------------------------

    async def generate(self, plan: a1111.Plan, request: Request, progress=None) -> a1111.Outcome | None:
        job = self.jobs.submit(lambda control: self.run(plan, control), plan.kind, on_step=progress)
        return await self.wait(job, request)

    async def progress(self, want_image: bool) -> tuple[dict, Any]:
        return self.jobs.progress(want_image=want_image)

    async def interrupt(self) -> None:
        self.jobs.interrupt()

    async def skip(self) -> None:
        self.jobs.skip()

    async def switch_model(self, target: Checkpoint, request: Request) -> None:
        # the model is loaded in the queue: after the jobs before it, never during one
        job = self.jobs.call(lambda: self.switch(target), f"load {target.name}")
        await self.wait(job, request)

    def text_width(self) -> int | None:
        engine = self.engines.loaded(self.checkpoints.current)
        return engine.spec.context_text.width if engine is not None else None   # an SDXL refiner: its only one

    def edits_from_images(self) -> bool | None:
        engine = self.engines.loaded(self.checkpoints.current)   # loaded: its family says; else its headers
        return bool(engine.family.edits_from_images) if engine is not None else super().edits_from_images()

    def stopping(self) -> bool:
        return self.jobs.closed

    def start(self) -> None:
        if self._preload:
            self.jobs.call(self.preload, "load model")

    async def stop(self) -> None:
        # bounded: a job abandoned by a shutdown (Jobs.drain) may still run in the worker, a daemon thread
        await run_in_threadpool(self.jobs.stop, STOP_WAIT_S)


STOP_WAIT_S = 0.5   # how long the app's shutdown waits for the queue's worker thread (answered by then, or abandoned)


# --- a request's work, wherever it runs ---------------------------------------------------------------------------

def stop_warning(control, limits: Limits | None) -> str | None:
    """The warning a job interrupted by the server itself carries: past ``--job-timeout``, or by a shutdown."""
    reason = getattr(control, "stop_reason", None)
    if reason == "timeout":
        limit = f" of {limits.job_timeout:g} s" if limits is not None else ""
        return (f"the job ran past this server's time limit{limit} (--job-timeout) and was "
                "interrupted: the images are those of the step it had reached")
    if reason == "shutdown":
        grace = f" after its grace of {limits.shutdown_grace:g} s (--shutdown-grace)" if limits else ""
        return (f"the server is shutting down: the job was interrupted{grace}; the images are those of the step it "
                "had reached")
    if reason == "stop":
        return ("the server was stopped at once (SIGINT, or a second SIGTERM): the job was interrupted; the images "
                "are those of the step it had reached")
    return None


def run_plan(engines: Engines, checkpoint: Checkpoint, plan: a1111.Plan, control) -> a1111.Outcome:
    """Run one A1111 request's iterations on ``checkpoint``'s engine (loaded by ``engines`` if needed), reporting
    through ``control`` (a :class:`~.jobs.JobControl`, or anything with its methods: a Ray replica's). The sampling
    fields the client left out take the model family's own settings where it has them (:func:`~.a1111.model_defaults`:
    FLUX.1's, SD3's and Z-Image's model cards)."""
    control.begin(len(plan.requests))
    vae = getattr(plan, "vae", None)   # a VAE file in place of the model's own (sd_vae)
    if engines.loaded(checkpoint, vae) is None:
        control.info(f"{plan.kind}: loading {checkpoint.name}" + (f" with the VAE {Path(vae).name}" if vae else ""))
    engine = engines.get(checkpoint, vae)
    timestamp = datetime.datetime.now().strftime("%Y%m%d%H%M%S")
    downscale = engine.spec.vae.downscale
    first = plan.requests[0] if plan.requests else None   # a Lightning LoRA's steps and cfg where it applies one
    requests, defaulted = a1111.model_defaults(plan, engine.sampling_defaults_for(first))
    requests = with_references(plan, requests, engine.family.edits_from_images)   # klein's and Kontext's editing
    if plan.limits is not None:   # a size left out is the model's native one, steps the family's: known only now
        native = engine.spec.default_size
        for request in requests[:1]:
            if "steps" in plan.unset:
                own = "the model's default" if "steps" in defaulted else "the default"
                check_steps(request.steps, plan.limits, f"steps={{steps}} ({own}, as the request leaves steps out)")
            if request.init_image is None:
                check_size(request.width or native, request.height or native, plan.limits,
                           "width x height (the model's native size where not given)")
            if request.hires is not None:
                check_hires_size(request.width or native, request.height or native, plan.parameters,
                                 plan.limits)
            admit(engine, request, plan.limits)   # 503 when it does not fit now, 422 when it never could
    results, warnings = [], []
    if plan.hr_checkpoint is not None and plan.hr_checkpoint.path != checkpoint.path:
        from dataclasses import replace

        requests = [r.replace(hires=replace(r.hires, checkpoint=str(plan.hr_checkpoint.path))) for r in requests]
    engine.upscaler_dir = plan.upscaler_dir
    try:
        extra = _attach_refiner(engines, engine, checkpoint, plan, control)
        if vae:
            extra["VAE"] = Path(vae).name
        for i, request in enumerate(requests):
            if control.interrupted:
                break
            control.iteration(i, total_steps(engine, request))   # a hires fix's second pass adds to the progress

            def on_latents(step, total, latents):
                if control.preview_due(step, total):
                    pixels = latents.shape[-1] * latents.shape[-2] * downscale**2
                    full = plan.preview == "Full" or (plan.preview == "Auto"
                                                      and pixels <= a1111.AUTO_FULL_PREVIEW_PIXELS)
                    tiny = plan.preview == "TAESD"
                    if tiny and engine.preview_decoder is None and not warnings:
                        warnings.append(NO_TAESD_WARNING)
                        log.warning(NO_TAESD_WARNING)
                    control.set_preview(engine.preview(latents[:1], full=full, tiny=tiny)[0], step)

            results.append(engine.generate(request, callback=control.step, on_latents=on_latents))
    finally:
        engine.set_refiner(None)   # attached for this job only: the engine holds no per-request state otherwise
    inpainting = engine.family.inpainting
    warning = stop_warning(control, plan.limits) if control.interrupted else None
    return a1111.Outcome(results, checkpoint.short_name, engines.checkpoints.hash_of(checkpoint), inpainting,
                         timestamp, interrupted=control.interrupted, infotext=extra,
                         warnings=warnings + ([warning] if warning else []), defaulted=defaulted)


NO_TAESD_WARNING = ("live previews: show_progress_type 'TAESD' needs a TAESD for this model's latents (sdlite serve "
                    "--taesd PATH); the previews were made by 'Approx cheap' instead")


def _attach_refiner(engines: Engines, engine, checkpoint: Checkpoint, plan: a1111.Plan, control) -> dict:
    """Attach the plan's ``refiner_checkpoint`` to ``engine`` and return the infotext fields that record it (none
    without a refiner). The refiner is loaded in the job (progress stays readable meanwhile) and must share the
    base's latent space (a RequestError, 422, naming both models)."""
    if plan.refiner_name is None:
        return {}
    target = plan.refiner
    if target is None:   # build_plan names it; the routes resolve it
        raise RequestError(f"refiner_checkpoint={plan.refiner_name!r} was not resolved to a checkpoint")
    if target.path == checkpoint.path:
        refiner = engine   # the model refines its own latents: no second copy
    else:
        if engines.loaded(target) is None:
            control.info(f"{plan.kind}: loading the refiner {target.name}")
        refiner = engines.refiner(target)
    try:
        engine.set_refiner(refiner)
    except RequestError as e:
        raise RequestError(f"refiner_checkpoint {target.name!r} cannot refine {checkpoint.name!r}: {e}") from None
    return {"Refiner": f"{target.short_name} [{engines.checkpoints.hash_of(target)}]",
            "Refiner switch at": plan.refiner_switch_at}


def process_memory() -> dict:
    """This process's RAM (bytes) and, where there is one, the CUDA device's: A1111's ``/memory`` answer, and the
    RAM that ComfyUI's ``/system_stats`` reports."""
    try:
        import psutil

        process = psutil.Process(os.getpid())
        used, total = process.memory_info().rss, psutil.virtual_memory().total
    except ImportError:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        used = pages * os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    ram = {"free": total - used, "used": used, "total": total}
    try:
        import torch

        if torch.cuda.is_available():
            free, size = torch.cuda.mem_get_info()
            stats = torch.cuda.memory_stats()
            cuda = {"system": {"free": free, "used": size - free, "total": size},
                    "active": {"current": stats["active_bytes.all.current"], "peak": stats["active_bytes.all.peak"]},
                    "allocated": {"current": stats["allocated_bytes.all.current"],
                                  "peak": stats["allocated_bytes.all.peak"]},
                    "reserved": {"current": stats["reserved_bytes.all.current"],
                                 "peak": stats["reserved_bytes.all.peak"]},
                    "inactive": {"current": stats["inactive_split_bytes.all.current"],
                                 "peak": stats["inactive_split_bytes.all.peak"]},
                    "events": {"retries": stats["num_alloc_retries"], "oom": stats["num_ooms"]}}
        else:
            cuda = {"error": "unavailable"}
    except Exception as e:  # noqa: BLE001 - reported, as A1111 reports it
        cuda = {"error": str(e)}
    return {"ram": ram, "cuda": cuda}
