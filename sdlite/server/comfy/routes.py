"""ComfyUI's HTTP API and websocket: ``/prompt``, ``/queue``, ``/history``, ``/interrupt``, ``/view``, the uploads,
``/object_info``, the listings, ``/free`` and ``/ws``, at the server root and again under ``/api/`` as ComfyUI
answers them, plus under ``/comfy/api/`` for ComfyUI's own web page at ``/comfy/`` (:mod:`.frontend`), which
finds its API next to itself.

Workflows are validated and run by :mod:`.workflow`; a valid one is queued in the server's one job queue
(:mod:`.queue`), beside the A1111 requests. Its images go to the ComfyUI folders (``sdlite serve
--comfy-dir``: ``input/`` for uploads and LoadImage, ``output/`` for SaveImage, ``temp/`` for PreviewImage, ``user/``
for the web page's settings and workflows). Errors are answered in ComfyUI's shapes: ``/prompt``'s 400
``{"error": {...}, "node_errors": {...}}``, elsewhere a status with a sentence saying what is wrong.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import platform
import sys
from pathlib import Path

from fastapi import APIRouter, FastAPI, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ... import __version__
from ..backend import ServerBase, process_memory
from . import frontend as comfy_frontend
from .frontend import frontend_version, inside, server_features
from .queue import EventHub, PromptError, PromptQueue
from ..jobs import Jobs
from .workflow import ComfyDirs, Executor, object_info, validate
from .workflow import PromptError as WorkflowError

log = logging.getLogger("sdlite.server")

PREFIXES = ("", "/api", "/comfy/api")   # the root and /api as ComfyUI; /comfy/api for its web page at /comfy/
UI_PREFIX = "/comfy"
FILE_TYPES = ("input", "output", "temp")
SENSITIVE_EXTRA_DATA = ("auth_token_comfy_org", "api_key_comfy_org")
MODEL_FOLDERS = ("checkpoints", "loras", "embeddings", "controlnet", "upscale_models", "vae", "clip",
                 "text_encoders", "diffusion_models", "unet")   # ComfyUI's folder names that its stock loaders read


def comfy_dirs(root: Path) -> tuple[ComfyDirs, Path]:
    """The ComfyUI folders under ``root`` (made where missing) and the user folder."""
    dirs = ComfyDirs(input=root / "input", output=root / "output", temp=root / "temp")
    try:
        for path in (dirs.input, dirs.output, dirs.temp, root / "user"):
            path.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # the server still serves its other front-ends; ComfyUI's file routes will say why
        log.warning("ComfyUI's folders cannot be made in %s (%s): its uploads and images will fail; give "
                    "--comfy-dir a writable folder", root, e)
    return dirs, root / "user"


def add_routes(app: FastAPI, server: ServerBase, dependencies: list) -> None:
    """ComfyUI's routes and websocket on ``app`` over ``server`` (behind ``dependencies``) and its web page."""
    from ...machine import cache_dir

    root = Path(getattr(server, "comfy_dir", None) or cache_dir() / "comfyui")
    dirs, user_dir = comfy_dirs(root)
    # a server with a queue of its own for them (a Ray cluster's: sdlite.scale.comfy) makes it; else the prompts
    # run in this process's job queue, where there is one
    make = getattr(server, "comfy_queue", None)
    queue = make(dirs) if make is not None else \
        PromptQueue(server, Executor(server, dirs)) if isinstance(getattr(server, "jobs", None), Jobs) else None
    hub = queue.hub if queue is not None else EventHub(lambda: 0)
    app.state.comfy = queue
    router = APIRouter(dependencies=dependencies)
    _add_prompt_routes(router, server, queue, hub, dirs)
    _add_file_routes(router, server, dirs)
    _add_listing_routes(router, server, dirs)
    page = APIRouter(dependencies=dependencies, include_in_schema=False)   # the web page's own start-up routes
    comfy_frontend.add_api_routes(page, server, user_dir)
    for prefix in PREFIXES:
        app.include_router(router, prefix=prefix, include_in_schema=prefix == "")
        app.include_router(page, prefix=prefix)
        app.add_api_websocket_route(f"{prefix}/ws" if prefix != "/comfy/api" else f"{UI_PREFIX}/ws",
                                    _websocket(hub, dependencies, server_features(server)))
    internal = APIRouter(dependencies=dependencies, include_in_schema=False)   # ComfyUI's /internal routes

    @internal.get("/internal/folder_paths")
    async def folder_paths():
        return _folder_paths(server)

    for prefix in ("", UI_PREFIX):
        app.include_router(internal, prefix=prefix)
    comfy_frontend.mount_page(app, server, UI_PREFIX, dependencies)


# --- bodies and errors --------------------------------------------------------------------------------------------

async def _json(request: Request, default=None):
    """The request's JSON body (``default`` when it is empty); 400 naming the problem when it is not JSON."""
    body = await request.body()
    if not body.strip():
        return default
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPException(400, f"the request body is not JSON: {e}") from None


def _prompt_error(e) -> JSONResponse:
    return JSONResponse({"error": e.error, "node_errors": e.node_errors}, status_code=400)


def _ids(value, field: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise HTTPException(400, f"{field} must be a list of prompt ids (strings), not {value!r:.80}")
    return value


# --- queueing and history -----------------------------------------------------------------------------------------

def _add_prompt_routes(router: APIRouter, server: ServerBase, queue: PromptQueue | None, hub: EventHub,
                       dirs: ComfyDirs) -> None:
    @router.post("/prompt")
    async def post_prompt(request: Request):
        try:
            body = await _json(request, {})
        except HTTPException as e:
            return _prompt_error(PromptError("invalid_prompt", "the request body is not JSON", e.detail))
        if queue is None:
            return JSONResponse({"error": {"type": "not_supported", "extra_info": {},
                                           "message": "this server has no job queue for ComfyUI workflows",
                                           "details": "its server object runs no jobs of its own (neither a job "
                                                      "queue in this process nor a Ray cluster's); use the A1111 "
                                                      "API (/sdapi/v1)"},
                                 "node_errors": {}}, status_code=501)
        hub.attach(asyncio.get_running_loop())
        try:
            fields = _prompt_fields(body)
            targets = fields.pop("targets")
            outputs = await run_in_threadpool(validate, fields["prompt"], server, dirs)
            if targets is not None:   # the page's "run selected outputs": only those of the valid outputs
                unknown = [t for t in targets if t not in outputs]
                if unknown:
                    raise PromptError("invalid_prompt", "partial_execution_targets names nodes that are not output "
                                      f"nodes of this prompt: {', '.join(unknown)}")
                outputs = [o for o in outputs if o in targets]
            # in a thread: a Ray cluster's queue asks its job table to admit the prompt
            entry = await run_in_threadpool(lambda: queue.submit(fields["prompt"], outputs, **{
                k: v for k, v in fields.items() if k != "prompt"}))
        except (PromptError, WorkflowError) as e:
            return _prompt_error(e)
        return {"prompt_id": entry.prompt_id, "number": entry.number, "node_errors": {}}

    @router.get("/prompt")
    async def get_prompt():
        return {"exec_info": {"queue_remaining": queue.remaining() if queue is not None else 0}}

    @router.get("/queue")
    async def get_queue():
        return queue.queue() if queue is not None else {"queue_running": [], "queue_pending": []}

    async def clear_or_delete(request: Request, clear: str, delete: str) -> Response:
        """POST /queue and /history: ``{"clear": true}`` calls the queue's method ``clear``, ``{"delete": [ids]}``
        its method ``delete``."""
        body = await _json(request, {})
        if not isinstance(body, dict):
            raise HTTPException(400, "the body must be a JSON object with 'clear' or 'delete'")
        if queue is not None:
            if body.get("clear"):
                getattr(queue, clear)()
            if "delete" in body:
                getattr(queue, delete)(_ids(body["delete"], "delete"))
        return Response(status_code=200)

    @router.post("/queue")
    async def post_queue(request: Request):
        return await clear_or_delete(request, "clear", "delete")

    @router.post("/interrupt")
    async def post_interrupt(request: Request):
        body = await _json(request, {})
        prompt_id = body.get("prompt_id") if isinstance(body, dict) else None
        if queue is not None:
            queue.interrupt(prompt_id if isinstance(prompt_id, str) else None)
        else:
            await server.interrupt()
        return Response(status_code=200)

    @router.get("/history")
    async def get_history(max_items: int | None = None, offset: int = 0):
        return queue.history(max_items, offset) if queue is not None else {}

    @router.get("/history/{prompt_id}")
    async def get_history_item(prompt_id: str):
        return queue.history_item(prompt_id) if queue is not None else {}

    @router.post("/history")
    async def post_history(request: Request):
        return await clear_or_delete(request, "clear_history", "delete_history")

    @router.post("/free")
    async def post_free(request: Request):
        body = await _json(request, {})
        if not isinstance(body, dict):
            raise HTTPException(400, "the body must be a JSON object with 'unload_models' and/or 'free_memory'")
        unload, free = bool(body.get("unload_models", False)), bool(body.get("free_memory", False))
        if queue is not None and (unload or free):
            queue.free(unload, free)   # in the queue, after the running job; answered at once as ComfyUI does
        return Response(status_code=200)

    _add_job_routes(router, queue)


JOB_STATUSES = ("pending", "in_progress", "completed", "failed", "cancelled")


def _add_job_routes(router: APIRouter, queue: PromptQueue | None) -> None:
    """ComfyUI's ``/jobs`` view of the same queue and history, which its web page reads: one list of prompts
    with a status each (pending, in_progress, completed, failed), newest first, and one prompt in detail."""
    @router.get("/jobs")
    async def list_jobs(status: str | None = None, limit: int = 200, offset: int = 0, sort_order: str = "desc"):
        wanted = set(status.split(",")) if status else set(JOB_STATUSES)
        unknown = wanted - set(JOB_STATUSES)
        if unknown:
            raise HTTPException(400, f"status {', '.join(sorted(unknown))} is not valid: expected "
                                     f"{', '.join(JOB_STATUSES)}")
        if limit < 0 or offset < 0:
            raise HTTPException(400, "limit and offset must not be negative")
        jobs = [job for job in _jobs(queue) if job["status"] in wanted]
        jobs.sort(key=lambda job: job["create_time"], reverse=sort_order != "asc")
        page = jobs[offset:offset + limit]
        return {"jobs": page, "pagination": {"offset": offset, "limit": limit, "total": len(jobs),
                                             "has_more": offset + len(page) < len(jobs)}}

    @router.get("/jobs/{prompt_id}")
    async def job_detail(prompt_id: str):
        for job in _jobs(queue, detail=prompt_id):
            if job["id"] == prompt_id:
                return job
        raise HTTPException(404, f"no job {prompt_id!r}: it is neither queued nor in the history")

    @router.post("/jobs/{prompt_id}/cancel")
    async def cancel_job(prompt_id: str):
        _cancel(queue, [prompt_id])
        return Response(status_code=200)

    @router.post("/jobs/cancel")
    async def cancel_jobs(request: Request):
        body = await _json(request, {})
        _cancel(queue, _ids(body.get("job_ids") if isinstance(body, dict) else None, "job_ids"))
        return Response(status_code=200)


def _cancel(queue: PromptQueue | None, prompt_ids: list[str]) -> None:
    if queue is None:
        return
    for prompt_id in prompt_ids:
        if not queue.interrupt(prompt_id):
            queue.delete([prompt_id])


def _jobs(queue: PromptQueue | None, detail: str | None = None) -> list[dict]:
    """Every prompt as a ``/jobs`` entry; the one ``detail`` names with its workflow and outputs."""
    if queue is None:
        return []
    jobs = []
    for entry in queue.pending():
        jobs.append({"id": entry.prompt_id, "status": "in_progress" if entry.started else "pending",
                     "create_time": entry.created, "execution_start_time": entry.started,
                     "execution_end_time": None, "preview_output": None, "outputs_count": None,
                     "previewable_outputs_count": None, "execution_error": None, "priority": entry.number,
                     "workflow_id": None})
    for prompt_id, record in queue.history().items():
        created, started, ended = queue.times(prompt_id)
        images = [dict(image, nodeId=node, mediaType="images") for node, out in record["outputs"].items()
                  for image in (out.get("images") or []) if isinstance(image, dict)]
        error = next((data for event, data in record["status"]["messages"] if event == "execution_error"), None)
        interrupted = any(event == "execution_interrupted" for event, _ in record["status"]["messages"])
        status = "completed" if record["status"]["completed"] else "cancelled" if interrupted else "failed"
        job = {"id": prompt_id, "status": status, "create_time": created, "execution_start_time": started,
               "execution_end_time": ended, "preview_output": images[-1] if images else None,
               "outputs_count": len(images), "previewable_outputs_count": len(images),
               "execution_error": {k: v for k, v in error.items() if k != "timestamp"} if error else None,
               "priority": record["prompt"][0], "workflow_id": None}
        if prompt_id == detail:
            job.update(workflow={"prompt": record["prompt"][2], "extra_data": record["prompt"][3]},
                       outputs=record["outputs"], execution_status=record["status"], update_time=ended)
        jobs.append(job)
    return jobs


def _prompt_fields(body) -> dict:
    """``/prompt``'s fields: the workflow and how it is queued (``number``, ``front``, ``client_id``,
    ``extra_data``, ``prompt_id``); PromptError naming a field that is not what ComfyUI takes."""
    if not isinstance(body, dict):
        raise PromptError("invalid_prompt", "the body must be a JSON object", f"got {type(body).__name__}")
    prompt = body.get("prompt")
    if prompt is None:
        raise PromptError("no_prompt", "No prompt provided", "No prompt provided")
    if not isinstance(prompt, dict):
        raise PromptError("invalid_prompt", "the prompt must be a JSON object of nodes by id (ComfyUI's API format)",
                          f"prompt is a {type(prompt).__name__}")
    number = body.get("number")
    if number is not None and (isinstance(number, bool) or not isinstance(number, (int, float))):
        raise PromptError("invalid_prompt", f"number must be a number, not {number!r:.40}")
    extra = body.get("extra_data", {})
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise PromptError("invalid_prompt", f"extra_data must be a JSON object, not {type(extra).__name__}")
    # the page sends "" before its websocket has its id: no client, as ComfyUI takes it
    client_id = body.get("client_id", extra.get("client_id")) or None
    prompt_id = body.get("prompt_id")
    for name, value in (("client_id", client_id), ("prompt_id", prompt_id)):
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= 200):
            raise PromptError("invalid_prompt", f"{name} must be a string of 1 to 200 characters, not {value!r:.40}")
    targets = body.get("partial_execution_targets")
    if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise PromptError("invalid_prompt", "partial_execution_targets must be a list of node ids (strings)")
    # ComfyUI's account credentials (for its paid API nodes) are neither used nor kept (never shown by /history)
    extra = {k: v for k, v in extra.items() if k not in SENSITIVE_EXTRA_DATA}
    return {"prompt": prompt, "number": number, "front": bool(body.get("front", False)), "client_id": client_id,
            "extra_data": extra, "prompt_id": prompt_id, "targets": targets}


# --- the websocket ------------------------------------------------------------------------------------------------

def _websocket(hub: EventHub, dependencies: list, features: dict):
    async def ws(websocket: WebSocket):
        for dependency in dependencies:   # the same auth as the HTTP routes (it reads the headers only)
            try:
                dependency.dependency(websocket)
            except HTTPException as e:
                await websocket.close(code=1008, reason=str(e.detail)[:120])
                return
        sid = websocket.query_params.get("clientId") or os.urandom(16).hex()
        await websocket.accept()
        outgoing = hub.connect(sid)
        outgoing.put_nowait(hub.status_message(sid))   # first: the client learns its id from it
        sender = asyncio.create_task(_send_loop(websocket, outgoing))   # the one task that sends on this socket
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                try:
                    data = json.loads(text) if text else None
                except ValueError:
                    data = None   # ComfyUI ignores what it cannot read
                if isinstance(data, dict) and data.get("type") == "feature_flags":
                    await outgoing.put(json.dumps({"type": "feature_flags", "data": features}))
        except WebSocketDisconnect:
            pass
        finally:
            hub.disconnect(sid, outgoing)
            sender.cancel()
    return ws


async def _send_loop(websocket: WebSocket, outgoing: asyncio.Queue) -> None:
    try:
        while True:
            message = await outgoing.get()
            if isinstance(message, bytes):
                await websocket.send_bytes(message)
            else:
                await websocket.send_text(message)
    except (WebSocketDisconnect, RuntimeError, OSError):   # the client went away
        pass


# --- files: view and upload ---------------------------------------------------------------------------------------

def _folder(dirs: ComfyDirs, kind: str) -> Path:
    if kind not in FILE_TYPES:
        raise HTTPException(400, f"type {kind!r} is not valid: expected one of {', '.join(FILE_TYPES)}")
    return Path(getattr(dirs, kind)).resolve()


def _inside(base: Path, subfolder: str, filename: str | None = None) -> Path:
    """``base/subfolder[/filename]``: 403 when it leaves ``base``, 400 when it cannot be a path."""
    folder = inside(base, subfolder, "subfolder")
    return folder if filename is None else inside(base, (Path(subfolder) / filename).as_posix() if subfolder
                                                  else filename, "subfolder and filename")


def _check_name(filename: str, field: str = "filename") -> None:
    if not filename or filename[0] in "/\\" or ".." in filename or "\x00" in filename:
        raise HTTPException(400, f"{field} {filename!r} is not valid: a file name without '..' or a leading slash")


def _add_file_routes(router: APIRouter, server: ServerBase, dirs: ComfyDirs) -> None:
    @router.get("/view")
    async def view(filename: str = "", type: str = "output", subfolder: str = "", preview: str | None = None,
                   channel: str | None = None):
        _check_name(filename)
        path = _inside(_folder(dirs, type), subfolder, filename)
        if not path.is_file():
            raise HTTPException(404, f"no file {filename!r} in the {type} folder"
                                     + (f" (subfolder {subfolder!r})" if subfolder else ""))
        if preview is None and channel in (None, "rgba"):
            return FileResponse(path, filename=path.name, content_disposition_type="inline")
        content, media = await run_in_threadpool(_converted, path, preview, channel)
        return Response(content, media_type=media, headers={"Content-Disposition": f'inline; filename="{path.name}"'})

    @router.post("/upload/image")
    async def upload_image(request: Request):
        form = await request.form()
        saved = await run_in_threadpool(_save_upload, dirs, form, None)
        return saved

    @router.post("/upload/mask")
    async def upload_mask(request: Request):
        form = await request.form()
        ref = form.get("original_ref")
        try:
            original = json.loads(ref) if isinstance(ref, str) else None
        except ValueError:
            original = None
        if not isinstance(original, dict) or not isinstance(original.get("filename"), str):
            raise HTTPException(400, "original_ref must be JSON naming the image the mask is for: "
                                     '{"filename": ..., "subfolder": ..., "type": ...}')
        return await run_in_threadpool(_save_upload, dirs, form, original)


def _converted(path: Path, preview: str | None, channel: str | None) -> tuple[bytes, str]:
    """``/view``'s ``preview=webp;90`` / ``jpeg;90`` and ``channel=rgb`` / ``a`` renderings of an image."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(path)
        image.load()
    except (UnidentifiedImageError, OSError):
        raise HTTPException(400, f"{path.name} is not an image, so preview/channel cannot be applied") from None
    if channel == "a":
        alpha = image.getchannel("A") if "A" in image.getbands() else Image.new("L", image.size, 255)
        image = Image.merge("RGBA", (Image.new("L", image.size, 0),) * 3 + (alpha,))
    elif channel == "rgb":
        image = image.convert("RGB")
    elif channel not in (None, "rgba"):
        raise HTTPException(400, f"channel {channel!r} is not valid: expected rgba, rgb or a")
    fmt, quality = "png", 90
    if preview:
        parts = preview.split(";")
        fmt = parts[0].lower()
        if fmt not in ("webp", "jpeg", "png"):
            raise HTTPException(400, f"preview format {parts[0]!r} is not valid: expected webp, jpeg or png")
        if len(parts) > 1 and parts[1].isdigit():
            quality = min(int(parts[1]), 100)
    if fmt == "jpeg":
        image = image.convert("RGB")
    out = io.BytesIO()
    image.save(out, format=fmt.upper(), quality=quality)
    return out.getvalue(), f"image/{fmt}"


def _save_upload(dirs: ComfyDirs, form, original: dict | None) -> dict:
    """Write an uploaded image (``image``, ``type``, ``subfolder``, ``overwrite``) into its folder. A name that is
    taken gets `` (N)`` before its suffix, as ComfyUI does, unless ``overwrite`` is true or the file there holds the
    same bytes; a mask is first put into the alpha channel of the image it belongs to."""
    upload = form.get("image")
    if upload is None or isinstance(upload, str) or not getattr(upload, "filename", None):
        raise HTTPException(400, "no image uploaded: send the file in the multipart field 'image'")
    kind = str(form.get("type") or "input")
    subfolder = str(form.get("subfolder") or "")
    name = os.path.basename(upload.filename)
    _check_name(name, "the uploaded file's name")
    overwrite = str(form.get("overwrite", "")).lower() in ("true", "1")
    base = _folder(dirs, kind)
    folder = _inside(base, subfolder)
    data = upload.file.read()
    if original is not None:
        data = _mask_into(dirs, original, data)
    folder.mkdir(parents=True, exist_ok=True)
    path = _inside(base, subfolder, name)
    if not overwrite:
        stem, suffix, n = Path(name).stem, Path(name).suffix, 1
        while path.exists() and not _same_bytes(path, data):
            name = f"{stem} ({n}){suffix}"
            path, n = _inside(base, subfolder, name), n + 1
    path.write_bytes(data)
    return {"name": name, "subfolder": subfolder, "type": kind}


def _same_bytes(path: Path, data: bytes) -> bool:
    if not path.is_file() or path.stat().st_size != len(data):
        return False
    return hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()


def _mask_into(dirs: ComfyDirs, original: dict, mask_data: bytes) -> bytes:
    """``/upload/mask``: the original image with the uploaded mask's alpha as its alpha channel, as PNG bytes."""
    import io

    from PIL import Image, UnidentifiedImageError

    kind = str(original.get("type") or "output")
    filename = original["filename"]
    _check_name(filename, "original_ref.filename")
    path = _inside(_folder(dirs, kind), str(original.get("subfolder") or ""), filename)
    if not path.is_file():
        raise HTTPException(404, f"original_ref: no file {filename!r} in the {kind} folder")
    try:
        image = Image.open(path)
        mask = Image.open(io.BytesIO(mask_data))
        image.load()
        mask.load()
    except (UnidentifiedImageError, OSError) as e:
        raise HTTPException(400, f"the mask or its original image cannot be read as an image: {e}") from None
    alpha = mask.getchannel("A") if "A" in mask.getbands() else mask.convert("L")
    image = image.convert("RGBA")
    image.putalpha(alpha.resize(image.size))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


# --- listings -----------------------------------------------------------------------------------------------------

def _add_listing_routes(router: APIRouter, server: ServerBase, dirs: ComfyDirs) -> None:
    @router.get("/object_info")
    async def get_object_info():
        return await run_in_threadpool(object_info, server, dirs)

    @router.get("/object_info/{node_class}")
    async def get_node_info(node_class: str):
        info = await run_in_threadpool(object_info, server, dirs)
        return {node_class: info[node_class]} if node_class in info else {}

    @router.get("/system_stats")
    async def system_stats():
        return await run_in_threadpool(_system_stats, server)

    @router.get("/embeddings")
    async def embeddings():
        return [Path(name).stem for name in await run_in_threadpool(_models, server, "embeddings")]

    @router.get("/models")
    async def models():
        return list(MODEL_FOLDERS)

    @router.get("/models/{folder}")
    async def models_in(folder: str):
        if folder not in MODEL_FOLDERS:
            raise HTTPException(404, f"no model folder {folder!r}: this server has {', '.join(MODEL_FOLDERS)}")
        return await run_in_threadpool(_models, server, folder)

    @router.get("/experiment/models")
    async def model_library():   # the page's model library: the folders, none of them on disk as ComfyUI's are
        return [{"name": folder, "folders": []} for folder in MODEL_FOLDERS]

    @router.get("/experiment/models/{folder}")
    async def model_library_folder(folder: str):
        if folder not in MODEL_FOLDERS:
            raise HTTPException(404, f"no model folder {folder!r}: this server has {', '.join(MODEL_FOLDERS)}")
        return [{"name": name, "pathIndex": 0} for name in await run_in_threadpool(_models, server, folder)]


def _files(folder, suffixes) -> list[str]:
    if folder is None or not Path(folder).is_dir():
        return []
    base = Path(folder)
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*")
                  if p.is_file() and p.suffix.lower() in suffixes)


def _models(server: ServerBase, folder: str) -> list[str]:
    """The files of a ComfyUI model folder, as sdlite has them: checkpoints (``--model``, ``--models-dir``), LoRAs
    (``--lora-dir``), embeddings, ControlNets and upscalers from their folders; diffusion models, text encoders and
    VAEs from ComfyUI's folders under ``--models-dir`` (and ``--vae-dir``), as the separate-file loaders list them."""
    if folder == "checkpoints":
        return [c.name for c in server.checkpoints.list()]
    if folder == "loras":
        return _files(server.lora_dir, (".safetensors", ".ckpt", ".pt"))
    if folder == "embeddings":
        return _files(server.embeddings_dir, (".safetensors", ".pt", ".bin"))
    if folder == "controlnet":
        server.controlnets.refresh()
        return list(server.controlnets.titles())
    if folder == "upscale_models":
        return _files(server.upscaler_dir, (".pth", ".pt", ".safetensors"))
    if folder in ("diffusion_models", "unet", "text_encoders", "clip", "vae"):
        from .loaders import MODEL_SUFFIXES, folder_files

        kind = {"unet": "diffusion_models", "clip": "text_encoders"}.get(folder, folder)
        return list(folder_files(server, kind, (*MODEL_SUFFIXES, ".gguf")))
    return []


def _folder_paths(server: ServerBase) -> dict:
    """ComfyUI's model folders and where sdlite finds each (``--models-dir``, ``--lora-dir`` ...); none for those
    it keeps no separate files of."""
    where = {"checkpoints": server.checkpoints.models_dir, "loras": server.lora_dir,
             "embeddings": server.embeddings_dir, "controlnet": server.controlnets.folder,
             "upscale_models": server.upscaler_dir}
    paths = {folder: [str(where[folder])] if where.get(folder) is not None else [] for folder in MODEL_FOLDERS}
    models_dir = server.checkpoints.models_dir
    if models_dir is not None:
        for folder in ("diffusion_models", "unet", "text_encoders", "clip", "vae"):
            paths[folder] = [str(models_dir / folder)]
    if getattr(server, "vae_dir", None) is not None:
        paths["vae"].append(str(server.vae_dir))
    return paths


def _system_stats(server: ServerBase) -> dict:
    import torch

    from ...machine import this_cpu

    ram = process_memory()["ram"]
    devices = [{"name": f"cpu {this_cpu().model}", "type": "cpu",
                "index": None, "vram_total": ram["total"], "vram_free": ram["free"], "torch_vram_total": 0,
                "torch_vram_free": 0}]
    device = str(server.flags.get("device") or "cpu")
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.cuda.current_device() if device == "cuda" else int(device.split(":")[1])
        free, total = torch.cuda.mem_get_info(index)
        devices = [{"name": f"cuda:{index} {torch.cuda.get_device_name(index)}", "type": "cuda", "index": index,
                    "vram_total": total, "vram_free": free, "torch_vram_total": torch.cuda.memory_reserved(index),
                    "torch_vram_free": torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)}]
    return {"system": {"os": sys.platform, "ram_total": ram["total"], "ram_free": ram["free"],
                       "comfyui_version": __version__, "required_frontend_version": frontend_version(),
                       "python_version": sys.version, "pytorch_version": torch.__version__,
                       "embedded_python": False, "argv": sys.argv, "server": f"sdlite {__version__}",
                       "machine": platform.machine()},
            "devices": devices}
