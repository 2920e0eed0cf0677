"""``sdlite serve``: an HTTP server speaking the AUTOMATIC1111 web UI's ``/sdapi/v1`` API, so existing A1111 clients
work unchanged, plus a small web page.

    from sdlite.server import create_app
    app = create_app(model="model.safetensors")     # FastAPI; run it with uvicorn

Shared by every front-end: :mod:`.app` makes the FastAPI app and runs its lifecycle, :mod:`.http` the error JSON,
auth, body cap and strict JSON, :mod:`.backend` the server the routes talk to (:class:`~.backend.Server`: the jobs
in this process; :mod:`sdlite.scale.ray_serve`: on Ray Serve replicas), :mod:`.jobs` the FIFO queue with progress,
interrupt and previews, :mod:`.limits` what one request may ask for, :mod:`.checkpoints` the models on offer,
:mod:`.decode` base64 images in. AUTOMATIC1111's front-end: :mod:`.a1111_routes` its routes, :mod:`.a1111` the
request and response schemas and the name mapping, :mod:`.controlnet` A1111's ControlNet extension (its units, its
models by name, its ``/controlnet`` routes' answers). The server holds no model logic: it turns A1111 requests into
:class:`~sdlite.pipeline.Request` s and results into A1111 JSON.
Needs the ``server`` extra: ``pip install 'sdlite[server]'``.
"""
from .app import create_app

__all__ = ["create_app"]
