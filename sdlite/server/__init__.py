"""``sdlite serve``: an HTTP server speaking AUTOMATIC1111's, ComfyUI's, OpenAI's and MCP's APIs, so their existing
clients work unchanged, plus a small web page.

    from sdlite.server import create_app
    app = create_app(model="model.safetensors")     # FastAPI; run it with uvicorn

One sub-package a protocol, each turning its requests into :class:`~sdlite.pipeline.Request` s and its results into
its own JSON, with no model logic: :mod:`.a1111` (AUTOMATIC1111's ``/sdapi/v1`` and its ControlNet extension),
:mod:`.comfy` (ComfyUI's API and web page), :mod:`.openai` (OpenAI's Images API), :mod:`.mcp` (MCP's tools).
Shared by them all, here: :mod:`.app` makes the FastAPI app and runs its lifecycle, :mod:`.http` the error JSON,
auth, body cap and strict JSON, :mod:`.backend` the server the routes talk to (:class:`~.backend.Server`: the jobs
in this process; :mod:`sdlite.scale.ray_serve`: on Ray Serve replicas), :mod:`.jobs` the FIFO queue with progress,
interrupt and previews, :mod:`.limits` what one request may ask for, :mod:`.checkpoints` the models on offer,
:mod:`.decode` base64 images in.
Needs the ``server`` extra: ``pip install 'sdlite[server]'``.
"""
from .app import create_app

__all__ = ["create_app"]
