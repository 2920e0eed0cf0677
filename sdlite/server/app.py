"""The HTTP server: the FastAPI app over sdlite, its lifecycle, and the web page.

    app = create_app(model="v1-5-pruned-emaonly.safetensors")     # a FastAPI app; `sdlite serve` runs it
    uvicorn.run(app, host="127.0.0.1", port=7860)

:func:`build_app` makes the same app over any :class:`~.backend.ServerBase`: :class:`~.backend.Server` runs the jobs
in this process, :mod:`sdlite.scale.ray_serve` on Ray Serve replicas (``sdlite serve --ray``); both run a request
with :func:`~.backend.run_plan`. The app starts and stops the server with itself, and wraps every route in what
:mod:`.http` holds (the error JSON, auth, the body cap, strict JSON). The routes are the protocols': AUTOMATIC1111's
``/sdapi/v1`` and ``/controlnet`` (:mod:`.a1111.routes`, translating with :mod:`.a1111.api`), OpenAI's
(:mod:`.openai`), MCP's (:mod:`.mcp.server`) and ComfyUI's (:mod:`.comfy.routes`), which all queue their jobs in
:mod:`.jobs`; the engine runs in the queue's worker thread only.

The names the server's callers import from here (``create_app``, ``build_app``, ``ServerBase``, ``Server``,
``run_plan``, ``parse_auth`` ...) stay importable from here.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from .. import __version__
from . import openai
from .a1111 import routes as a1111_routes
from .comfy import routes as comfy_routes
from .mcp import server as mcp_server
from .backend import (DISCONNECT_POLL_S, NO_TAESD_WARNING, STOP_WAIT_S, Server, ServerBase, run_plan,
                      stop_warning)
from .checkpoints import Checkpoint, Checkpoints, Engines
from .http import (MAX_BODY_BYTES, MAX_JSON_DEPTH, AnswerWhenStopped, BodyLimit, BodyTooLarge, StrictJSON,
                   auth_dependency, error_response, install_error_handlers, parse_auth)
from .jobs import JobControl, Jobs, QueueFull, ShuttingDown, Unavailable
from .limits import Limits

__all__ = ["create_app", "build_app", "WEB_DIR",
           # re-exported from where they live now
           "ServerBase", "Server", "run_plan", "stop_warning", "DISCONNECT_POLL_S", "STOP_WAIT_S", "NO_TAESD_WARNING",
           "parse_auth", "BodyTooLarge", "MAX_BODY_BYTES", "MAX_JSON_DEPTH", "Checkpoint", "Checkpoints", "Engines",
           "JobControl", "Jobs", "QueueFull", "ShuttingDown", "Unavailable", "Limits"]

WEB_DIR = Path(__file__).resolve().parent / "web"


def create_app(model=None, models_dir=None, api_auth: str | None = None, queue_size: int = 32, *,
               lora_dir=None, embeddings_dir=None, max_body_bytes: int = MAX_BODY_BYTES, preload: bool = True,
               engine_options: dict | None = None, flags: dict | None = None, limits: Limits | None = None,
               upscaler_dir=None, controlnet_dir=None, api_key: str | None = None, comfy_dir=None,
               vae_dir=None) -> FastAPI:
    """The server as a FastAPI app. ``model``: a checkpoint (default: the shipped demo model, or the first one in
    ``models_dir``); ``models_dir``: where the checkpoints a client can switch to are; ``api_auth``:
    ``USER:PASS[,...]`` for HTTP Basic on every API route; ``queue_size``: waiting jobs beyond which requests get
    503; ``preload``: load the model when the app starts (in the queue, so that the API answers meanwhile);
    ``limits``: what one request may ask for, the job time limit and the shutdown grace (:class:`.limits.Limits`;
    default: its defaults); ``upscaler_dir``: upscaler networks for the hires fix and the extras;
    ``controlnet_dir``: ControlNet models for the units of ``alwayson_scripts`` (:mod:`.a1111.controlnet`); ``api_key``:
    a key every API route also takes as ``Authorization: Bearer KEY`` (OpenAI's clients send it); ``comfy_dir``:
    ComfyUI's input/output/temp/user folders (default: ``comfyui`` in sdlite's cache folder); ``vae_dir``: VAE files
    a request may take in place of the model's own (``sd_vae``, Forge's ``forge_additional_modules``)."""
    server = Server(model, models_dir, api_auth, queue_size, lora_dir=lora_dir, embeddings_dir=embeddings_dir,
                    max_body_bytes=max_body_bytes, engine_options=engine_options, flags=flags, preload=preload,
                    limits=limits, upscaler_dir=upscaler_dir, controlnet_dir=controlnet_dir, api_key=api_key,
                    comfy_dir=comfy_dir, vae_dir=vae_dir)
    return build_app(server)


def build_app(server: ServerBase) -> FastAPI:
    """The FastAPI app (routes, error JSON, auth, body cap, web page) over ``server``: a :class:`Server` (jobs in
    this process) or the Ray cluster's (:mod:`sdlite.scale.ray_serve`). The routes are the same for both."""
    max_body_bytes = server.max_body_bytes

    @asynccontextmanager
    async def lifespan(app):
        server.start()
        async with mcp_server.sessions(app):   # /mcp's sessions live as long as the app
            yield
        await server.stop()

    app = FastAPI(title="sdlite", version=__version__, lifespan=lifespan,
                  description="AUTOMATIC1111-compatible /sdapi/v1 API over sdlite")
    app.state.server = server
    app.add_middleware(StrictJSON)   # added first: inside BodyLimit, which checks the size before it reads
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(AnswerWhenStopped, stopping=server.stopping)   # outermost: around every route and check
    install_error_handlers(app)

    # on every front-end's routes: HTTP Basic (--api-auth) and/or a Bearer key (--api-key)
    dependencies = [Depends(auth_dependency(server))] if server.credentials or server.api_key else []
    a1111_routes.add_routes(app, server, dependencies)
    openai.add_routes(app, server, dependencies)
    mcp_server.add_routes(app, server, dependencies)
    comfy_routes.add_routes(app, server, dependencies)   # ComfyUI's API, /ws and its web page at /comfy/

    @app.get("/", include_in_schema=False)
    async def index():
        page = WEB_DIR / "index.html"
        if not page.is_file():
            return error_response(404, "HTTPException", "the web page is not installed (sdlite/server/web/index.html)")
        return FileResponse(page)

    app.mount("/web", StaticFiles(directory=WEB_DIR, check_dir=False), name="web")
    return app
