"""The HTTP server: AUTOMATIC1111's ``/sdapi/v1`` routes over sdlite, and the web page.

    app = create_app(model="v1-5-pruned-emaonly.safetensors")     # a FastAPI app; `sdlite serve` runs it
    uvicorn.run(app, host="127.0.0.1", port=7860)

Routes translate (:mod:`.a1111`) and queue (:mod:`.jobs`); the engine runs in the queue's worker thread only.
:func:`build_app` makes the same app over any :class:`ServerBase`: :class:`Server` runs the jobs in this process,
:mod:`sdlite.scale.ray_serve` on Ray Serve replicas (``sdlite serve --ray``); both run a request with
:func:`run_plan`.
Errors are reported as A1111 reports them: FastAPI's ``{"detail": [...]}`` (422) when the JSON does not fit the
schema, otherwise ``{"error", "detail", "body", "errors"}`` with a fitting status (401, 404, 413, 422, 503).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import datetime
import email.message
import json
import logging
import math
import os
import re
import secrets
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Body, Depends, FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import CheckpointError, SDLiteError
from ..pipeline import RequestError
from html import escape as html_escape

from ..images import parameters_of, png_bytes
from . import a1111
from . import controlnet
from .checkpoints import Checkpoint, Checkpoints, Engines
from .controlnet import ControlNetNotFound, ControlNets
from .jobs import JobControl, Jobs, QueueFull, ShuttingDown, Unavailable  # noqa: F401 (re-exported)
from ..hires import second_pass_steps
from .limits import Limits, admit, check_hires_size, check_size

log = logging.getLogger("sdlite.server")

WEB_DIR = Path(__file__).resolve().parent / "web"
MAX_BODY_BYTES = 64 << 20      # a request body (and any one decoded image) may be at most this large
DISCONNECT_POLL_S = 0.5


class BodyTooLarge(HTTPException):
    """A request body over the cap (an HTTPException, so that FastAPI's body reading passes it on as it is)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the cap of {limit} bytes")


class ServerBase:
    """What the routes share wherever the jobs run: the checkpoints on offer, the options, the credentials, the
    flags and the preview cache. :class:`Server` runs the jobs in this process; :mod:`sdlite.scale.ray_serve`'s
    cluster server sends them to Ray Serve replicas. A subclass provides the asynchronous methods below."""

    def __init__(self, model=None, models_dir=None, api_auth: str | None = None, *, lora_dir=None,
                 embeddings_dir=None, max_body_bytes: int = MAX_BODY_BYTES, flags: dict | None = None,
                 limits: Limits | None = None, upscaler_dir=None, controlnet_dir=None):
        if model is None and models_dir is None:
            from ..demo import model_path

            model = model_path()
        self.checkpoints = Checkpoints(model, models_dir)
        self.options = a1111.default_options()
        self._options_lock = threading.Lock()
        self.credentials = parse_auth(api_auth) if api_auth else None
        self.lora_dir, self.embeddings_dir = lora_dir, embeddings_dir
        self.upscaler_dir = upscaler_dir   # upscaler networks by name (hires fix, extras)
        self.controlnets = ControlNets(controlnet_dir)   # ControlNet models by name (alwayson_scripts units)
        self.max_body_bytes = max_body_bytes
        self.flags = flags or {}
        self.limits = limits if limits is not None else Limits()
        self._preview_cache: tuple[Any, str] | None = None

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

    async def generate(self, plan: a1111.Plan, request: Request) -> a1111.Outcome | None:
        """Run the plan (after the jobs queued before it); None when the client went away meanwhile. Raises
        QueueFull / ShuttingDown (503) when the job is refused."""
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

    def start(self) -> None:
        """Called when the app starts (before requests)."""

    async def stop(self) -> None:
        """Called when the app stops."""


class Server(ServerBase):
    """The single-machine server: one engine cache and one FIFO job queue, in this process."""

    def __init__(self, model=None, models_dir=None, api_auth: str | None = None, queue_size: int = 32, *,
                 lora_dir=None, embeddings_dir=None, max_body_bytes: int = MAX_BODY_BYTES,
                 engine_options: dict | None = None, flags: dict | None = None, preload: bool = True,
                 limits: Limits | None = None, upscaler_dir=None, controlnet_dir=None):
        super().__init__(model, models_dir, api_auth, lora_dir=lora_dir, embeddings_dir=embeddings_dir,
                         max_body_bytes=max_body_bytes, flags=flags, limits=limits, upscaler_dir=upscaler_dir,
                         controlnet_dir=controlnet_dir)
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

    async def generate(self, plan: a1111.Plan, request: Request) -> a1111.Outcome | None:
        job = self.jobs.submit(lambda control: self.run(plan, control), plan.kind)
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

    def start(self) -> None:
        if self._preload:
            self.jobs.call(self.preload, "load model")

    async def stop(self) -> None:
        # bounded: a job abandoned by a shutdown (Jobs.drain) may still run in the worker, a daemon thread
        await run_in_threadpool(self.jobs.stop, STOP_WAIT_S)


STOP_WAIT_S = 0.5   # how long the app's shutdown waits for the queue's worker thread (answered by then, or abandoned)


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
    through ``control`` (a :class:`~.jobs.JobControl`, or anything with its methods: a Ray replica's)."""
    control.begin(len(plan.requests))
    if engines.loaded(checkpoint) is None:
        control.info(f"{plan.kind}: loading {checkpoint.name}")
    engine = engines.get(checkpoint)
    timestamp = datetime.datetime.now().strftime("%Y%m%d%H%M%S")
    downscale = engine.spec.vae.downscale
    if plan.limits is not None:   # a size left out is the model's native one, known only now
        native = engine.spec.default_size
        for request in plan.requests[:1]:
            if request.init_image is None:
                check_size(request.width or native, request.height or native, plan.limits,
                           "width x height (the model's native size where not given)")
            if request.hires is not None:
                check_hires_size(request.width or native, request.height or native, plan.parameters,
                                 plan.limits)
            admit(engine, request, plan.limits)   # 503 when it does not fit now, 422 when it never could
    results, warnings = [], []
    requests = plan.requests
    if plan.hr_checkpoint is not None and plan.hr_checkpoint.path != checkpoint.path:
        from dataclasses import replace

        requests = [r.replace(hires=replace(r.hires, checkpoint=str(plan.hr_checkpoint.path))) for r in requests]
    engine.upscaler_dir = plan.upscaler_dir
    try:
        extra = _attach_refiner(engines, engine, checkpoint, plan, control)
        for i, request in enumerate(requests):
            if control.interrupted:
                break
            hires = request.hires   # its second pass adds to the progress
            control.iteration(i, request.steps + (0 if hires is None else second_pass_steps(hires, request.steps)))

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
    inpainting = engine.spec.unet.in_channels != engine.spec.vae.latent_channels
    warning = stop_warning(control, plan.limits) if control.interrupted else None
    return a1111.Outcome(results, checkpoint.short_name, engines.checkpoints.hash_of(checkpoint), inpainting,
                         timestamp, interrupted=control.interrupted, infotext=extra,
                         warnings=warnings + ([warning] if warning else []))


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


def parse_auth(text: str) -> dict[str, str]:
    """``USER:PASS[,USER2:PASS2]`` (A1111's ``--api-auth``) -> {user: password}."""
    credentials = {}
    for pair in text.split(","):
        user, sep, password = pair.strip().partition(":")
        if not sep or not user or not password:
            raise ValueError(f"--api-auth {pair.strip()!r} is not valid: expected USER:PASSWORD (several separated "
                             "by commas)")
        credentials[user] = password
    return credentials


def _error(status: int, name: str, detail: Any, errors: str | None = None, headers=None) -> JSONResponse:
    body = {"error": name, "detail": detail, "body": "", "errors": errors if errors is not None else str(detail)}
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return _error(e.status_code, "HTTPException", e.detail, f"{e.status_code}: {e.detail}", e.headers)

    @app.exception_handler(ControlNetNotFound)
    async def controlnet_not_found(request, e):
        return _error(404, type(e).__name__, str(e))

    @app.exception_handler(a1111.ImageTooLarge)
    async def too_large(request, e):
        return _error(413, type(e).__name__, str(e))

    @app.exception_handler(Unavailable)   # QueueFull, ShuttingDown, a cluster's lost replica
    async def busy(request, e):
        return _error(503, type(e).__name__, str(e), headers={"Retry-After": str(e.retry_after)})

    @app.exception_handler(SDLiteError)
    async def bad_request(request, e: SDLiteError):
        if isinstance(e, CheckpointError):   # a model in the list that cannot be loaded: the server's problem
            log.error("model cannot be loaded: %s", e)
            return _error(500, type(e).__name__, f"the model cannot be loaded: {e}")
        return _error(422, type(e).__name__, str(e))

    @app.exception_handler(MemoryError)   # an estimate that fell short: the job is lost, the server goes on
    async def out_of_memory(request, e):
        log.error("out of memory in %s %s", request.method, request.url.path)
        return _error(503, "MemoryError", "the job ran out of memory; retry with a smaller size or batch",
                      headers={"Retry-After": "10"})

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):
        log.exception("error in %s %s", request.method, request.url.path)
        return _error(500, type(e).__name__, "internal error; the server log has the details", str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):
        # FastAPI's own 422, with the inputs it echoes made writable: a body that is not read as JSON (text/plain,
        # a form, no Content-Type) reaches the model as bytes, and bytes that are not UTF-8 made FastAPI's encoder
        # fail (a 500); if anything else cannot be written, the answer leaves the inputs out
        detail = jsonable_encoder(e.errors(), custom_encoder={bytes: lambda b: b.decode("utf-8", "backslashreplace")})
        try:
            return JSONResponse({"detail": detail}, status_code=422)
        except (ValueError, UnicodeError):
            bare = [{"type": d.get("type"), "loc": [ascii(x) if isinstance(x, str) else x for x in d.get("loc", ())],
                     "msg": d.get("msg")} for d in detail]
            return JSONResponse({"detail": bare}, status_code=422)


class _BodyLimit:
    """Refuses request bodies over ``max_bytes`` (413): by their Content-Length, or while they are read."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            detail = f"the request body ({length.decode(errors='replace')} bytes) is larger than the cap of " \
                     f"{self.max_bytes} bytes" if length.isdigit() else "the Content-Length header is not a number"
            response = _error(413 if length.isdigit() else 400, "HTTPException", detail)
            return await response(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        return await self.app(scope, limited, send)


MAX_JSON_DEPTH = 100   # nesting levels a JSON body may have (A1111's requests, alwayson_scripts included, use < 10)


class _NotStrictJSON(ValueError):
    pass


def _json_constant(name: str):
    raise _NotStrictJSON(f"{name} is not a JSON value")


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotStrictJSON(f"the number {text[:40]}{'...' if len(text) > 40 else ''} is beyond the range of a double")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")
_LONE_SURROGATE = ("holds a lone UTF-16 surrogate (an escape \\ud800-\\udfff that is not part of a high-low pair), "
                   "which is not a Unicode character")


def _strict_json_problem(body: bytes, max_depth: int) -> tuple[list, str] | None:
    """Where and why ``body``, JSON that Python's json module reads, is not strict JSON: ``(location, reason)``.
    None when it is strict JSON, and when it is not JSON at all (FastAPI answers that itself)."""
    try:
        data = json.loads(body, parse_constant=_json_constant, parse_float=_json_float)
    except _NotStrictJSON as e:
        return [], str(e)
    except RecursionError:
        return [], f"the JSON is nested more than {max_depth} levels deep"
    except ValueError:   # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        return None
    if isinstance(data, str) and not data.isascii() and _SURROGATE.search(data):
        return [], f"the string {_LONE_SURROGATE}"
    stack = [(data, (), 1)]   # iterative: the depth is what is checked
    while stack:
        value, where, depth = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:   # named by the top-level field that holds it
            return list(where[:1]), f"the JSON is nested more than {max_depth} levels deep"
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                return [*where, key.encode("utf-8", "backslashreplace").decode("ascii")], f"the key {_LONE_SURROGATE}"
            if isinstance(item, str):
                if not item.isascii() and _SURROGATE.search(item):
                    return [*where, key], f"the string {_LONE_SURROGATE}"
            elif isinstance(item, (dict, list)):
                stack.append((item, (*where, key), depth + 1))
    return None


def _json_body(scope) -> bool:
    """Whether FastAPI may read the request's body as JSON: a JSON media type, or none given."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            message = email.message.Message()
            message["content-type"] = value.decode("latin-1")
            subtype = message.get_content_subtype()
            return message.get_content_maintype() == "application" and (subtype == "json"
                                                                        or subtype.endswith("+json"))
    return True


class _StrictJSON:
    """Answers 422 (FastAPI's ``json_invalid`` error) to a JSON body that Python's json module reads but JSON does
    not allow, before any route sees it: NaN and Infinity, numbers beyond a double's range (1e400), strings with a
    lone UTF-16 surrogate ("\\ud800"), and nesting deeper than ``max_depth``. Let through, such a value failed only
    when the server wrote it back out (a response echoes the request's fields; /options keeps them): a 500 after the
    work was done, and for /options on every later GET /options. The body is read here, under :class:`_BodyLimit`'s
    cap, and handed on unchanged."""

    def __init__(self, app, max_depth: int = MAX_JSON_DEPTH):
        self.app, self.max_depth = app, max_depth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH") or not _json_body(scope):
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            try:
                message = await receive()
            except StarletteHTTPException as e:   # over the body cap (_BodyLimit)
                response = _error(e.status_code, "HTTPException", e.detail, f"{e.status_code}: {e.detail}", e.headers)
                return await response(scope, receive, send)
            if message["type"] != "http.request":   # the client went away: there is no one to answer
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if len(body) > 1 << 20:
            problem = await run_in_threadpool(_strict_json_problem, body, self.max_depth)
        else:
            problem = _strict_json_problem(body, self.max_depth)
        if problem is not None:
            where, reason = problem
            detail = [{"type": "json_invalid", "loc": ["body", *where], "msg": "JSON decode error", "input": {},
                       "ctx": {"error": reason}}]
            return await JSONResponse({"detail": detail}, status_code=422)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def create_app(model=None, models_dir=None, api_auth: str | None = None, queue_size: int = 32, *,
               lora_dir=None, embeddings_dir=None, max_body_bytes: int = MAX_BODY_BYTES, preload: bool = True,
               engine_options: dict | None = None, flags: dict | None = None, limits: Limits | None = None,
               upscaler_dir=None, controlnet_dir=None) -> FastAPI:
    """The server as a FastAPI app. ``model``: a checkpoint (default: the shipped demo model, or the first one in
    ``models_dir``); ``models_dir``: where the checkpoints a client can switch to are; ``api_auth``:
    ``USER:PASS[,...]`` for HTTP Basic on every API route; ``queue_size``: waiting jobs beyond which requests get
    503; ``preload``: load the model when the app starts (in the queue, so that the API answers meanwhile);
    ``limits``: what one request may ask for, the job time limit and the shutdown grace (:class:`.limits.Limits`;
    default: its defaults); ``upscaler_dir``: upscaler networks for the hires fix and the extras;
    ``controlnet_dir``: ControlNet models for the units of ``alwayson_scripts`` (:mod:`.controlnet`)."""
    server = Server(model, models_dir, api_auth, queue_size, lora_dir=lora_dir, embeddings_dir=embeddings_dir,
                    max_body_bytes=max_body_bytes, engine_options=engine_options, flags=flags, preload=preload,
                    limits=limits, upscaler_dir=upscaler_dir, controlnet_dir=controlnet_dir)
    return build_app(server)


def build_app(server: ServerBase) -> FastAPI:
    """The FastAPI app (routes, error JSON, auth, body cap, web page) over ``server``: a :class:`Server` (jobs in
    this process) or the Ray cluster's (:mod:`sdlite.scale.ray_serve`). The routes are the same for both."""
    max_body_bytes = server.max_body_bytes

    @asynccontextmanager
    async def lifespan(app):
        server.start()
        yield
        await server.stop()

    app = FastAPI(title="sdlite", version=__version__, lifespan=lifespan,
                  description="AUTOMATIC1111-compatible /sdapi/v1 API over sdlite")
    app.state.server = server
    app.add_middleware(_StrictJSON)   # added first: inside _BodyLimit, which checks the size before it reads
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    _install_error_handlers(app)

    dependencies = [Depends(_auth_dependency(server))] if server.credentials else []
    api = APIRouter(prefix="/sdapi/v1", dependencies=dependencies)
    _add_generation_routes(api, server)
    _add_control_routes(api, server)
    _add_listing_routes(api, server)
    app.include_router(api)
    controlnet_routes = APIRouter(prefix="/controlnet", dependencies=dependencies)   # the extension's, at the root
    _add_controlnet_routes(controlnet_routes, server)
    app.include_router(controlnet_routes)

    @app.get("/", include_in_schema=False)
    async def index():
        page = WEB_DIR / "index.html"
        if not page.is_file():
            return _error(404, "HTTPException", "the web page is not installed (sdlite/server/web/index.html)")
        return FileResponse(page)

    app.mount("/web", StaticFiles(directory=WEB_DIR, check_dir=False), name="web")
    return app


def _auth_dependency(server: ServerBase):
    def check(request: Request):
        header = request.headers.get("authorization", "")
        scheme, _, encoded = header.partition(" ")
        user = password = None
        if scheme.lower() == "basic":
            try:
                user, _, password = base64.b64decode(encoded).decode("utf-8").partition(":")
            except (binascii.Error, UnicodeDecodeError):
                user = None
        expected = server.credentials.get(user) if user is not None else None
        if expected is None or not secrets.compare_digest(password.encode(), expected.encode()):
            raise HTTPException(401, "Incorrect username or password", headers={"WWW-Authenticate": "Basic"})
    return check


# --- routes -------------------------------------------------------------------------------------------------------

def _add_generation_routes(api: APIRouter, server: ServerBase) -> None:
    async def generate(body: a1111.Txt2ImgRequest, request: Request):
        options = server.options_snapshot()
        plan = await run_in_threadpool(a1111.build_plan, body, options, max_image_bytes=server.max_body_bytes,
                                       lora_dir=server.lora_dir, embeddings_dir=server.embeddings_dir,
                                       limits=server.limits, upscaler_dir=server.upscaler_dir,
                                       controlnets=server.controlnets)
        if plan.checkpoint is not None:
            server.find_checkpoint(plan.checkpoint)   # 404 now rather than after the queue
        if plan.refiner_name is not None:   # resolved here, so that the plan carries the refiner to any worker
            plan.refiner = await run_in_threadpool(server.find_checkpoint, plan.refiner_name, "refiner_checkpoint")
        if plan.hr_checkpoint_name is not None:
            plan.hr_checkpoint = await run_in_threadpool(server.find_checkpoint, plan.hr_checkpoint_name,
                                                         "hr_checkpoint_name")
        outcome = await server.generate(plan, request)
        if outcome is None:   # the client went away
            return Response(status_code=499)
        return JSONResponse(await run_in_threadpool(a1111.response, plan, outcome))

    @api.post("/txt2img")
    async def txt2img(body: a1111.Txt2ImgRequest, request: Request):
        return await generate(body, request)

    @api.post("/img2img")
    async def img2img(body: a1111.Img2ImgRequest, request: Request):
        return await generate(body, request)


def _add_control_routes(api: APIRouter, server: ServerBase) -> None:
    @api.get("/progress")
    async def progress(skip_current_image: bool = Query(False)):
        body, image = await server.progress(not skip_current_image)
        body["current_image"] = server.preview_b64(image)
        return body

    @api.post("/interrupt")
    async def interrupt():
        await server.interrupt()
        return {}

    @api.post("/skip")
    async def skip():
        await server.skip()
        return {}

    @api.get("/options")
    async def get_options():
        return server.options_snapshot()

    @api.post("/options")
    async def set_options(request: Request, changes: dict[str, Any] = Body(...)):
        changes = dict(changes)
        name = changes.pop("sd_model_checkpoint", None)
        changes.pop("sd_checkpoint_hash", None)   # read-only: it follows the model
        checked = a1111.check_options(changes)
        target = server.find_checkpoint(name) if name is not None else None
        server.set_options(checked)
        if target is not None and target.path != server.checkpoints.current.path:
            await server.switch_model(target, request)
        return {}

    @api.get("/cmd-flags")
    async def cmd_flags():
        return {**server.flags, **server.limits.flags(), "api": True,
                "api_auth": "***" if server.credentials else None}

    @api.post("/refresh-checkpoints")
    async def refresh_checkpoints():
        await run_in_threadpool(server.checkpoints.refresh)
        return {}

    @api.get("/memory")
    async def memory():
        return _memory()

    extras_lock = asyncio.Lock()   # one upscale at a time: a network upscale holds its own activations

    async def run_extras(req, images: list[tuple[str, Any]]) -> tuple[list[str], str]:
        from ..upscalers.extras import fields_text, parameters_after, postprocess

        extras, warnings = a1111.extras_plan(req, server.upscaler_dir, server.limits)
        decoded = []
        for what, data in images:
            image = await run_in_threadpool(a1111.decode_image, data, what, server.max_body_bytes)
            a1111.check_extras_size(image, extras, server.limits, what)
            decoded.append(image)
        out, info = [], {}
        async with extras_lock:
            for image in decoded:
                result, info = await run_in_threadpool(postprocess, image, extras, server.upscaler_dir,
                                                       server.flags.get("device") or "cpu")
                text = parameters_after(parameters_of(image), info)
                out.append(base64.b64encode(png_bytes(result, text)).decode("ascii"))
        html = "<p>" + html_escape(fields_text(info)) + "</p>"
        if warnings:
            html += "".join(f"<p>{html_escape(w)}</p>" for w in warnings)
        return out, html

    @api.post("/extra-single-image")
    async def extra_single_image(body: a1111.ExtrasSingleImageRequest):
        if not body.image:
            raise HTTPException(404, "Image not found")
        images, html = await run_extras(body, [("image", body.image)])
        return {"html_info": html, "image": images[0]}

    @api.post("/extra-batch-images")
    async def extra_batch_images(body: a1111.ExtrasBatchImagesRequest):
        items = body.imageList or []
        if not items:
            raise HTTPException(404, "Image not found")
        if server.limits is not None and len(items) > server.limits.max_images:
            raise RequestError(f"imageList has {len(items)} images, over this server's limit of "
                               f"{server.limits.max_images} (--max-images)")
        images, html = await run_extras(body, [(f"imageList[{i}] ({item.name or 'unnamed'})", item.data)
                                               for i, item in enumerate(items)])
        return {"html_info": html, "images": images}

    @api.post("/png-info")
    async def png_info(body: a1111.PngInfoRequest):
        if not body.image:
            raise HTTPException(404, "Image not found")
        image = await run_in_threadpool(a1111.decode_image, body.image, "image", server.max_body_bytes)
        return a1111.png_info(image)


def _add_listing_routes(api: APIRouter, server: ServerBase) -> None:
    @api.get("/sd-models")
    async def sd_models():
        return [c.describe() for c in server.checkpoints.list()]

    @api.get("/samplers")
    async def samplers():
        return a1111.samplers_list()

    @api.get("/schedulers")
    async def schedulers():
        return a1111.schedulers_list()

    @api.get("/upscalers")
    async def upscalers():
        from ..upscalers.registry import listing

        return await run_in_threadpool(listing, server.upscaler_dir)

    @api.get("/latent-upscale-modes")
    async def latent_upscale_modes():
        from ..hires import LATENT_MODES

        return [{"name": name} for name in LATENT_MODES]

    @api.get("/loras")
    async def loras():
        from .. import lora

        files = await run_in_threadpool(lora.list_loras, server.lora_dir)
        return [{"name": lora.lora_name(p), "alias": lora.lora_alias(p), "path": str(p), "metadata": {}}
                for p in files]

    @api.post("/refresh-loras")
    async def refresh_loras():   # the folder is read on every request: nothing is cached
        return {}

    @api.get("/embeddings")
    async def embeddings():
        return await run_in_threadpool(_embeddings, server)

    @api.post("/refresh-embeddings")
    async def refresh_embeddings():   # read on every request, as for LoRAs
        return {}

    @api.get("/scripts")
    async def scripts():   # ControlNet's units are taken in alwayson_scripts
        return {"txt2img": [controlnet.SCRIPT], "img2img": [controlnet.SCRIPT]}

    for path in ("/script-info", "/sd-vae", "/hypernetworks", "/face-restorers", "/prompt-styles",
                 "/realesrgan-models", "/extensions"):
        api.add_api_route(path, _empty_list, methods=["GET"], name=path.strip("/"))


def _add_controlnet_routes(router: APIRouter, server: ServerBase) -> None:
    """A1111's ControlNet extension's routes (``/controlnet/...``): its version, the models of --controlnet-dir,
    the preprocessors, the control types, its settings and ``detect`` (a preprocessor run on images)."""
    @router.get("/version")
    async def version():
        return {"version": controlnet.API_VERSION}

    @router.get("/model_list")
    async def model_list(update: bool = Query(True)):
        if update:
            await run_in_threadpool(server.controlnets.refresh)
        return {"model_list": server.controlnets.titles()}

    @router.get("/module_list")
    async def module_list(alias_names: bool = Query(False)):
        return controlnet.module_list(alias_names)

    @router.get("/control_types")
    async def control_types():
        return controlnet.control_types(server.controlnets)

    @router.get("/settings")
    async def settings():
        return {"control_net_unit_count": controlnet.UNIT_COUNT}

    detect_lock = asyncio.Lock()   # one detection at a time, as the extras run one upscale at a time

    @router.post("/detect")
    async def detect(body: controlnet.DetectRequest):
        images = body.controlnet_input_images or body.controlnet_images or []
        if not images:
            raise HTTPException(422, "No image selected: send controlnet_input_images (base64 images)")
        if server.limits is not None and len(images) > server.limits.max_images:
            raise RequestError(f"controlnet_input_images has {len(images)} images, over this server's limit of "
                               f"{server.limits.max_images} (--max-images)")
        async with detect_lock:
            maps = await run_in_threadpool(controlnet.detect, body.controlnet_module, images,
                                           body.controlnet_processor_res, body.controlnet_threshold_a,
                                           body.controlnet_threshold_b, server.max_body_bytes)
        return {"images": [base64.b64encode(png_bytes(m)).decode("ascii") for m in maps], "info": "Success"}


async def _empty_list():
    """What sdlite does not have (VAEs apart from the model's own, hypernetworks, face restorers, styles, scripts)."""
    return []


def _embeddings(server: ServerBase) -> dict:
    """A1111's ``/embeddings``: those of ``--embeddings`` that fit the current model's text encoder are loaded,
    the others skipped."""
    from ..embeddings import EXTENSIONS, EmbeddingError, read_embedding

    loaded, skipped = {}, {}
    if server.embeddings_dir is None or not Path(server.embeddings_dir).is_dir():
        return {"loaded": loaded, "skipped": skipped}
    width = server.text_width()
    for path in sorted(Path(server.embeddings_dir).rglob("*")):
        if not (path.is_file() and path.suffix.lower() in EXTENSIONS):
            continue
        try:
            e = read_embedding(path)
        except EmbeddingError as err:
            log.warning("embedding skipped: %s", err)
            continue
        entry = {"step": None, "sd_checkpoint": None, "sd_checkpoint_name": None, "shape": e.width,
                 "vectors": len(e)}
        (loaded if width is None or e.width == width else skipped)[e.name] = entry
    return {"loaded": loaded, "skipped": skipped}


def _memory() -> dict:
    """A1111's ``/memory``: this process's RAM (bytes) and, where there is one, the CUDA device's."""
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
