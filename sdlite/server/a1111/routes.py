"""AUTOMATIC1111's routes: ``/sdapi/v1`` (txt2img and img2img, progress, interrupt and skip, options, the lists,
the extras, PNG info, memory) and the ControlNet extension's ``/controlnet/*``, at the server root as A1111 has them.

They translate (:mod:`.api`, :mod:`.controlnet`) and hand the work to the server
(:class:`~sdlite.server.backend.ServerBase`), which queues it: another protocol's routes go in a package beside this
one, over the same server and queue.
"""
from __future__ import annotations

import asyncio
import base64
import logging
from html import escape as html_escape
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Body, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ...images import png_bytes
from ...pipeline import RequestError
from . import api as a1111
from . import controlnet
from ..backend import ServerBase, process_memory
from .controlnet import ControlNetNotFound
from ..http import error_response

log = logging.getLogger("sdlite.server")


def add_routes(app: FastAPI, server: ServerBase, dependencies: list) -> None:
    """A1111's routes on ``app`` over ``server``, each behind ``dependencies`` (the auth check, when there is one),
    and the answer to a unit's unknown ControlNet model (404)."""
    @app.exception_handler(ControlNetNotFound)
    async def controlnet_not_found(request, e):
        return error_response(404, type(e).__name__, str(e))

    api = APIRouter(prefix="/sdapi/v1", dependencies=dependencies)
    _add_generation_routes(api, server)
    _add_control_routes(api, server)
    _add_listing_routes(api, server)
    app.include_router(api)
    controlnet_routes = APIRouter(prefix="/controlnet", dependencies=dependencies)   # the extension's, at the root
    _add_controlnet_routes(controlnet_routes, server)
    app.include_router(controlnet_routes)


def _add_generation_routes(api: APIRouter, server: ServerBase) -> None:
    async def generate(body: a1111.Txt2ImgRequest, request: Request):
        plan = await run_in_threadpool(server.build_plan, body)
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
    async def get_options():   # with sdlite's read-only sdlite_edits_from_images (the web page's Edit tab)
        edits = await run_in_threadpool(server.edits_from_images)
        return {**server.options_snapshot(), "sdlite_edits_from_images": edits}

    @api.post("/options")
    async def set_options(request: Request, changes: dict[str, Any] = Body(...)):
        changes = dict(changes)
        name = changes.pop("sd_model_checkpoint", None)
        changes.pop("sd_checkpoint_hash", None)   # read-only: they follow the model
        changes.pop("sdlite_edits_from_images", None)
        checked = a1111.check_options(changes)
        if {"sd_vae", "forge_additional_modules"} & set(checked):   # names of VAE files this server has
            await run_in_threadpool(a1111.chosen_vae, {**server.options_snapshot(), **checked}, server.vae_dir)
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
        return process_memory()

    async def run_extras(req, images: list[tuple[str, Any]]) -> tuple[list[str], str]:
        from ...upscalers.extras import fields_text

        results, info, warnings = await server.upscale(req, images)
        out = [base64.b64encode(png).decode("ascii") for _, png in results]
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
        from ...upscalers.registry import listing

        return await run_in_threadpool(listing, server.upscaler_dir)

    @api.get("/latent-upscale-modes")
    async def latent_upscale_modes():
        from ...hires import LATENT_MODES

        return [{"name": name} for name in LATENT_MODES]

    @api.get("/loras")
    async def loras():
        from ...adapters import lora

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

    @api.get("/sd-vae")
    async def sd_vae():   # the VAE files of --vae-dir, by the names sd_vae takes
        return await run_in_threadpool(a1111.list_vaes, server.vae_dir)

    @api.get("/sd-modules")
    async def sd_modules():   # Forge's list (VAEs and text encoders): the VAE files; a model's text encoders are
        return await run_in_threadpool(a1111.list_vaes, server.vae_dir)   # found beside it, never chosen here

    @api.post("/interrogate", include_in_schema=False)   # a 501 by design: no 5xx for the schema's fuzzing
    async def interrogate():
        raise HTTPException(501, "interrogate is not implemented: captioning an image needs a CLIP interrogator "
                                 "(BLIP captions ranked by a CLIP ViT-L model) or, for model='deepdanbooru', a "
                                 "DeepDanbooru tagger, and sdlite ships neither")

    for path in ("/script-info", "/hypernetworks", "/face-restorers", "/prompt-styles", "/realesrgan-models",
                 "/extensions"):
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
    """What sdlite does not have (hypernetworks, face restorers, styles, scripts, extensions)."""
    return []


def _embeddings(server: ServerBase) -> dict:
    """A1111's ``/embeddings``: those of ``--embeddings`` that fit the current model's text encoder are loaded,
    the others skipped."""
    from ...adapters.embeddings import EXTENSIONS, EmbeddingError, read_embedding

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


