"""``sdlite serve``: an HTTP server speaking the AUTOMATIC1111 web UI's ``/sdapi/v1`` API, so existing A1111 clients
work unchanged, plus a small web page.

    from sdlite.server import create_app
    app = create_app(model="model.safetensors")     # FastAPI; run it with uvicorn

:mod:`.app` holds the routes, :mod:`.a1111` the request and response schemas and the name mapping, :mod:`.jobs`
the FIFO queue with progress, interrupt and previews, :mod:`.checkpoints` the models on offer, :mod:`.controlnet`
A1111's ControlNet extension (its units, its models by name, its ``/controlnet`` routes' answers). The server holds
no model logic: it turns A1111 requests into :class:`~sdlite.pipeline.Request` s and results into A1111 JSON.
Needs the ``server`` extra: ``pip install 'sdlite[server]'``.
"""
from .app import create_app

__all__ = ["create_app"]
