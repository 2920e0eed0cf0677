"""ComfyUI's own web page at ``/comfy/``, from the pinned ``comfyui-frontend-package``, and what the page asks the
server for besides workflows: the user (one, "default"), its settings and user data (saved workflows, templates
of its own), the extensions (none: sdlite runs no custom nodes), translations (none beyond the page's own), the
server's features, and the workflow templates: one, ComfyUI's classic text-to-image graph on the server's current
checkpoint (the package's own default graph is a Z-Image Turbo graph: its nodes and its ``res_multistep`` sampler
are sdlite's too, but it needs Z-Image's files in ComfyUI's folders).

The page finds its API next to itself: it takes the path it was loaded from (``/comfy/``) as its base and calls
``/comfy/api/...`` and ``/comfy/ws``, which :mod:`.routes` answers as it answers ``/api/...``. A user's files
live in ``<comfy dir>/user/<user>/`` (``comfy.settings.json``, ``workflows/``); a file is never replaced unless the
request says ``overwrite=true``, and no path may leave the user's folder.
"""
from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from urllib.parse import unquote

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

DEFAULT_USER = "default"
SETTINGS_FILE = "comfy.settings.json"
USER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_SETTINGS_BYTES = 4 << 20   # a user's settings file at most (the page writes a few kB)


def inside(base: Path, relative: str, what: str) -> Path:
    """``base / relative`` resolved (``base`` itself for ""): 400 when ``relative`` cannot be a path (a NUL, a name
    too long for the file system), 403 when it leads out of ``base`` (``..``, an absolute path, a link)."""
    if "\x00" in relative or len(relative) > 1024 or any(len(part.encode("utf-8", "replace")) > 255
                                                         for part in relative.replace("\\", "/").split("/")):
        raise HTTPException(400, f"{what} {relative[:120]!r} is not a valid path")
    path = (base / relative).resolve() if relative else base
    if path != base and base not in path.parents:
        raise HTTPException(403, f"{what} {relative[:120]!r} points outside the {base.name} folder")
    return path


def static_dir() -> Path | None:
    """The frontend package's ``static/`` folder, or None when the package is not installed."""
    try:
        import comfyui_frontend_package
    except ImportError:
        return None
    path = Path(comfyui_frontend_package.__file__).resolve().parent / "static"
    return path if (path / "index.html").is_file() else None


def frontend_version() -> str:
    """The installed ``comfyui-frontend-package``'s version ("" when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("comfyui-frontend-package")
    except PackageNotFoundError:
        return ""


def server_features(server) -> dict:
    """ComfyUI's server feature flags (``/features``, and the websocket's answer to the page's own flags)."""
    return {"supports_preview_metadata": False, "max_upload_size": server.max_body_bytes}


def mount_page(app: FastAPI, server, prefix: str, dependencies: list) -> None:
    """The page's files under ``prefix`` (``/comfy/``); a clear 404 where the frontend package is missing."""
    static = static_dir()

    @app.get(prefix, include_in_schema=False)
    async def page_root():
        return RedirectResponse(prefix + "/")

    if static is None:
        @app.get(prefix + "/", include_in_schema=False)
        async def no_page():
            raise HTTPException(404, "ComfyUI's web page is not installed: pip install 'sdlite[server]' (the "
                                     "comfyui-frontend-package it pins)")
        return
    # ComfyUI's core templates come from another package, which sdlite does not ship; its template browser offers
    # sdlite's one instead: the classic text-to-image graph on this server's current checkpoint
    @app.get(prefix + "/templates/index.json", include_in_schema=False, dependencies=dependencies)
    async def templates():
        return [{"moduleName": "default", "title": "sdlite", "type": "image", "category": "sdlite",
                 "templates": [{"name": TEMPLATE, "title": "Text to image", "mediaType": "image",
                                "mediaSubtype": "png", "description": "ComfyUI's classic text-to-image graph on the "
                                                                      "model sdlite serves"}]}]

    @app.get(prefix + "/templates/index_logo.json", include_in_schema=False)
    async def template_logos():   # no provider logos
        return {}

    @app.get(f"{prefix}/templates/{TEMPLATE}.json", include_in_schema=False, dependencies=dependencies)
    async def template():
        return classic_graph(server.checkpoints.current.name, _native_size(server))

    @app.get(f"{prefix}/templates/{TEMPLATE}-1.png", include_in_schema=False)
    async def template_thumbnail():
        return Response(_thumbnail(), media_type="image/png")

    favicons = static / "assets" / "images" / "favicon_progress_16x16"

    @app.get("/assets/images/favicon_progress_16x16/{name}", include_in_schema=False)
    async def progress_favicon(name: str):   # the page asks for these at the site's root, where ComfyUI has it
        path = favicons / name
        if not re.fullmatch(r"frame_\d+\.png", name) or not path.is_file():
            raise HTTPException(404, f"no progress icon {name!r}")
        return FileResponse(path)

    app.mount(prefix, StaticFiles(directory=static, html=True), name="comfy-page")


class UserFiles:
    """One server's user folder: settings and user data per user, one writer at a time."""

    def __init__(self, root: Path):
        self.root = root
        self._lock = threading.Lock()
        for folder in ("workflows", "subgraphs"):   # what the page lists at start-up: empty, not missing
            try:
                (root / DEFAULT_USER / folder).mkdir(parents=True, exist_ok=True)
            except OSError:   # a folder that cannot be written (routes warned): its routes answer the error
                pass

    def user_dir(self, request: Request) -> Path:
        """The folder of the request's user: ``Comfy-User`` names it; without one, the default user."""
        user = request.headers.get("comfy-user") or DEFAULT_USER
        if not USER_NAME.match(user) or user in (".", ".."):
            raise HTTPException(400, f"Comfy-User {user[:80]!r} is not a valid user name (letters, digits, _ . -)")
        path = self.root / user
        path.mkdir(parents=True, exist_ok=True)
        return path

    def path(self, request: Request, relative: str) -> Path:
        """``relative`` in the user's folder; 400 when it is empty or leaves the folder."""
        if not relative:
            raise HTTPException(400, "the user data path is empty: name a file inside the user's folder")
        path = inside(self.user_dir(request).resolve(), relative, "the user data path")
        if path == self.user_dir(request).resolve():
            raise HTTPException(400, f"the user data path {relative[:120]!r} names the user's folder itself")
        return path

    # --- settings ---------------------------------------------------------------------------------------------

    def settings(self, request: Request) -> dict:
        path = self.user_dir(request) / SETTINGS_FILE
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError):
            return {}
        return data if isinstance(data, dict) else {}

    def update_settings(self, request: Request, changes: dict) -> None:
        with self._lock:
            settings = {**self.settings(request), **changes}
            text = json.dumps(settings, indent=4)
            if len(text) > MAX_SETTINGS_BYTES:
                raise HTTPException(413, f"the settings would be {len(text)} bytes, over the cap of "
                                         f"{MAX_SETTINGS_BYTES}")
            path = self.user_dir(request) / SETTINGS_FILE
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)


TEMPLATE = "sdlite_text_to_image"
# ComfyUI's classic default graph: (id, type, widget values, inputs as (name, type, link), outputs as
# (name, type, links)); the checkpoint and the size are filled in
CLASSIC_NODES = [
    (4, "CheckpointLoaderSimple", ["{ckpt}"], [],
     [("MODEL", "MODEL", [1]), ("CLIP", "CLIP", [3, 5]), ("VAE", "VAE", [8])]),
    (6, "CLIPTextEncode", ["beautiful scenery nature glass bottle landscape, , purple galaxy bottle,"],
     [("clip", "CLIP", 3)], [("CONDITIONING", "CONDITIONING", [4])]),
    (7, "CLIPTextEncode", ["text, watermark"], [("clip", "CLIP", 5)], [("CONDITIONING", "CONDITIONING", [6])]),
    (5, "EmptyLatentImage", ["{size}", "{size}", 1], [], [("LATENT", "LATENT", [2])]),
    (3, "KSampler", [156680208, "randomize", 20, 8, "euler", "normal", 1],
     [("model", "MODEL", 1), ("positive", "CONDITIONING", 4), ("negative", "CONDITIONING", 6),
      ("latent_image", "LATENT", 2)], [("LATENT", "LATENT", [7])]),
    (8, "VAEDecode", [], [("samples", "LATENT", 7), ("vae", "VAE", 8)], [("IMAGE", "IMAGE", [9])]),
    (9, "SaveImage", ["ComfyUI"], [("images", "IMAGE", 9)], []),
]
CLASSIC_LINKS = [[1, 4, 0, 3, 0, "MODEL"], [2, 5, 0, 3, 3, "LATENT"], [3, 4, 1, 6, 0, "CLIP"],
                 [4, 6, 0, 3, 1, "CONDITIONING"], [5, 4, 1, 7, 0, "CLIP"], [6, 7, 0, 3, 2, "CONDITIONING"],
                 [7, 3, 0, 8, 0, "LATENT"], [8, 4, 2, 8, 1, "VAE"], [9, 8, 0, 9, 0, "IMAGE"]]


def classic_graph(ckpt_name: str, size: int) -> dict:
    """ComfyUI's classic text-to-image graph in the page's own workflow format (as its Save writes it), on the
    checkpoint ``ckpt_name`` at ``size`` x ``size``; its seed is one sdlite's KSampler takes."""
    fill = {"{ckpt}": ckpt_name, "{size}": size}
    nodes = []
    for order, (node_id, kind, widgets, inputs, outputs) in enumerate(CLASSIC_NODES):
        nodes.append({"id": node_id, "type": kind, "pos": [100 + 340 * (order % 4), 100 + 320 * (order // 4)],
                      "size": [315, 220], "flags": {}, "order": order, "mode": 0,
                      "inputs": [{"name": n, "type": t, "link": link} for n, t, link in inputs],
                      "outputs": [{"name": n, "type": t, "links": links, "slot_index": i}
                                  for i, (n, t, links) in enumerate(outputs)],
                      "properties": {"Node name for S&R": kind},
                      "widgets_values": [fill.get(w, w) if isinstance(w, str) else w for w in widgets]})
    return {"last_node_id": 9, "last_link_id": 9, "nodes": nodes, "links": CLASSIC_LINKS, "groups": [],
            "config": {}, "extra": {}, "version": 0.4}


def _native_size(server) -> int:
    """The current model's native image side when it is loaded in this process, else 512."""
    engines = getattr(server, "engines", None)
    engine = engines.loaded(server.checkpoints.current) if engines is not None else None
    return int(engine.spec.default_size) if engine is not None else 512


def _thumbnail() -> bytes:
    """The template's picture: the demo model's subject, a red circle on blue, drawn."""
    import io

    from PIL import Image, ImageDraw

    image = Image.new("RGB", (256, 256), (40, 70, 200))
    ImageDraw.Draw(image).ellipse((64, 64, 192, 192), fill=(220, 40, 40))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _flag(value: str | None, default: bool) -> bool:
    return default if value is None else value.lower() in ("true", "1", "yes")


def _info(path: Path, base: Path) -> dict:
    stat = path.stat()
    return {"path": path.relative_to(base).as_posix(), "size": stat.st_size, "modified": stat.st_mtime * 1000,
            "created": stat.st_ctime * 1000}


def add_api_routes(router: APIRouter, server, user_root: Path) -> None:
    """The page's start-up routes on ``router`` (mounted at the root, ``/api`` and ``/comfy/api``)."""
    files = UserFiles(user_root)

    @router.get("/users")
    async def users():
        return {"storage": "server", "migrated": True}

    @router.post("/users")
    async def new_user():
        raise HTTPException(400, f"this server has one user ({DEFAULT_USER!r}); it does not create others")

    @router.get("/settings")
    async def get_settings(request: Request):
        return await run_in_threadpool(files.settings, request)

    @router.post("/settings")
    async def post_settings(request: Request):
        changes = await _json_body(request)
        if not isinstance(changes, dict):
            raise HTTPException(400, "the settings must be a JSON object of setting ids and values")
        await run_in_threadpool(files.update_settings, request, changes)
        return Response(status_code=200)

    @router.get("/settings/{setting_id}")
    async def get_setting(setting_id: str, request: Request):
        return JSONResponse((await run_in_threadpool(files.settings, request)).get(setting_id))

    @router.post("/settings/{setting_id}")
    async def post_setting(setting_id: str, request: Request):
        value = await _json_body(request)
        await run_in_threadpool(files.update_settings, request, {setting_id: value})
        return Response(status_code=200)

    @router.get("/userdata")
    async def list_userdata(request: Request, dir: str | None = None, recurse: str | None = None,
                            full_info: str | None = None, split: str | None = None):
        if not dir:
            raise HTTPException(400, "dir is required: the folder of the user's data to list (e.g. workflows)")
        folder = files.path(request, dir)
        if not folder.is_dir():
            raise HTTPException(404, f"no folder {dir!r} in the user's data")
        return await run_in_threadpool(_listing, folder, _flag(recurse, False), _flag(full_info, False),
                                       _flag(split, False))

    @router.api_route("/userdata/{rest:path}", methods=["GET", "POST", "DELETE"])
    async def userdata(rest: str, request: Request):
        raw = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1").split("?")[0]
        parts = raw[raw.index("/userdata/") + len("/userdata/"):].split("/")
        if len(parts) == 3 and parts[1] == "move" and request.method == "POST":
            return await run_in_threadpool(_move, files, request, unquote(parts[0]), unquote(parts[2]))
        relative = unquote("/".join(parts))
        path = files.path(request, relative)
        if request.method == "GET":
            if not path.is_file():
                raise HTTPException(404, f"no file {relative!r} in the user's data")
            return FileResponse(path)
        if request.method == "DELETE":
            if not path.is_file():
                raise HTTPException(404, f"no file {relative!r} in the user's data")
            path.unlink()
            return Response(status_code=204)
        body = await request.body()
        overwrite = _flag(request.query_params.get("overwrite"), False)
        if path.exists() and not overwrite:
            raise HTTPException(409, f"{relative!r} exists; send overwrite=true to replace it")
        if path.is_dir():
            raise HTTPException(409, f"{relative!r} is a folder")
        await run_in_threadpool(_write, path, body)
        base = files.user_dir(request).resolve()
        if _flag(request.query_params.get("full_info"), False):
            return _info(path, base)
        return path.relative_to(base).as_posix()

    @router.get("/extensions")
    async def extensions():   # sdlite runs no custom nodes, so it has no web extensions to load
        return []

    @router.get("/i18n")
    async def i18n():   # translations of custom nodes: there are none
        return {}

    @router.get("/features")
    async def features():
        return server_features(server)

    @router.get("/workflow_templates")
    async def workflow_templates():   # custom nodes' templates: there are none
        return {}

    @router.get("/global_subgraphs")
    async def global_subgraphs():   # subgraph blueprints that custom nodes ship: there are none
        return {}


async def _json_body(request: Request):
    body = await request.body()
    try:
        return json.loads(body) if body.strip() else None
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPException(400, f"the request body is not JSON: {e}") from None


def _listing(folder: Path, recurse: bool, full_info: bool, split: bool) -> list:
    found = sorted(p for p in (folder.rglob("*") if recurse else folder.iterdir()) if p.is_file())
    if full_info:
        return [_info(p, folder) for p in found]
    names = [p.relative_to(folder).as_posix() for p in found]
    return [[name, *name.split("/")] for name in names] if split else names


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _move(files: UserFiles, request: Request, source: str, dest: str):
    src, dst = files.path(request, source), files.path(request, dest)
    if not src.is_file():
        raise HTTPException(404, f"no file {source!r} in the user's data")
    if dst.exists() and not _flag(request.query_params.get("overwrite"), False):
        raise HTTPException(409, f"{dest!r} exists; send overwrite=true to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)
    base = files.user_dir(request).resolve()
    if _flag(request.query_params.get("full_info"), False):
        return _info(dst, base)
    return dst.relative_to(base).as_posix()
