"""AUTOMATIC1111's web UI API (``/sdapi/v1``) and its ControlNet extension's (``/controlnet``).

:mod:`.api` is the contract: the request and response schemas, the options, sampler and scheduler names, and the
:class:`~.api.Plan` an A1111 request becomes (:func:`~.api.build_plan`). OpenAI's and MCP's front-ends build their
requests as A1111 ones, so they import :mod:`.api` too. :mod:`.controlnet` is the ControlNet extension's units and
models by name; :mod:`.references` an img2img plan's init images as a FLUX.2 [klein] model's reference images;
:mod:`.routes` the FastAPI routes over the shared backend.
"""
