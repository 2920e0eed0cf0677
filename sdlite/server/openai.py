"""OpenAI's Images API under ``/v1``: ``POST /v1/images/generations``, ``POST /v1/images/edits``, ``GET /v1/models``
(and ``/v1/models/{id}``), and the images that ``response_format: "url"`` answers with (``GET /v1/images/files/...``).

A thin adapter, as the A1111 routes are: every request becomes AUTOMATIC1111's txt2img / img2img request and then
an :class:`~.a1111.Plan` (:func:`~.a1111.build_plan`) run by ``server.generate``, so the queue, the limits, memory
admission, auth and Ray apply unchanged, and an image equals A1111's route's (and the engine's) for the same settings.

How OpenAI's fields are read (docs/server/openai.md has the table):

* ``prompt`` (required), ``n`` (images: one batch, seeds ``seed``, ``seed + 1`` ... as A1111 numbers them),
  ``size`` (``WxH``; ``auto`` or left out: the model's native size, for an edit the source image's),
  ``response_format`` (``b64_json``, the default here, or ``url``: an absolute URL on this server, valid for
  :data:`URL_TTL_S` seconds, kept in memory, :class:`ImageStore`), ``output_format`` (``png``, the default, with the
  A1111 parameters chunk; ``jpeg``, ``webp``, with ``output_compression`` as the quality), ``model`` (a checkpoint by
  any name A1111 accepts, as ``/v1/models`` lists them; OpenAI's own model names, ``dall-e-*`` and ``gpt-image-*``,
  mean the current model; any other is a 404 ``model_not_found``).
* Accepted and ignored: ``quality``, ``style``, ``moderation``, ``user``, ``safety_identifier``, ``input_fidelity``,
  ``complexity``, ``partial_images``, ``frame_count``, ``frame_duration_ms``, ``svg``. Refused with a 400 naming the
  field: ``background: "transparent"``, ``stream: true``, ``output_format`` gif / svg, ``markup``, more than one
  source image, and any field neither OpenAI nor sdlite has (OpenAI's ``unknown_parameter``).
* sdlite's own fields (JSON, or form fields for an edit): ``steps`` (default :data:`DEFAULTS`; ``steps``,
  ``sampler`` and ``cfg_scale`` left out are the model's own where its family has settings of its own: FLUX.1's,
  SD3's, Z-Image's), ``seed`` (-1: random), ``sampler`` and ``scheduler`` (A1111's or sdlite's names),
  ``negative_prompt``, ``cfg_scale``; for an
  edit ``strength`` (A1111's denoising strength: default 1.0 where a mask marks the area, 0.75 for a whole-image
  edit).
* Edits: the ``mask``'s fully transparent pixels (alpha 0) are the area to repaint, as OpenAI's; without a mask the
  image's own fully transparent pixels are; an image with none is edited whole (image to image). The mask runs as
  A1111's inpainting (fill, mask blur 4, the whole picture): the pixels outside the blurred mask are the source's.
  On a FLUX.2 [klein] model an edit without a mask is instruction editing: ``image`` and every ``image[]`` (up to
  :data:`MAX_EDIT_IMAGES`) are its reference images, the output drawn from noise at the first image's size
  (:func:`~.a1111.references.with_references`); other models edit one image.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every request under ``/v1/``
(:func:`error_shape`, registered with :func:`.http.add_error_shape`, so the shared handlers, auth and body cap
answer in it too): 400 ``invalid_request_error`` naming the param, 401, 404, 413, 503 (queue full, shutting down,
no memory now; with ``Retry-After``), 500.
"""
from __future__ import annotations

import base64
import collections
import functools
import io
import re
import secrets
import threading
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..pipeline import MAX_BATCH, MAX_SEED
from .a1111 import api as a1111
from .backend import ServerBase
from .decode import decode_image
from .http import add_error_shape

PREFIX = "/v1"
DEFAULTS = {"steps": 20, "sampler": "DPM++ 2M", "cfg_scale": 7.0}   # where the request and the model leave them out
OPENAI_MODELS = ("dall-e", "gpt-image")   # name prefixes of OpenAI's models: the current checkpoint
MAX_EDIT_IMAGES = 10   # image / image[] files of one edit: a FLUX.2 [klein] model's reference images (OpenAI: 16)
MASKED_STRENGTH, WHOLE_STRENGTH = 1.0, 0.75   # an edit's default strength, with and without an area to repaint
URL_TTL_S = 3600.0              # how long an image answered by URL can be fetched (OpenAI's: an hour)
URL_STORE_BYTES = 256 << 20     # the images kept for URLs at most, the oldest dropped first
URL_STORE_COUNT = 1024
OUTPUT_FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg"), "webp": ("WEBP", "image/webp")}

# OpenAI's fields: those read, and those accepted and ignored (sdlite has nothing they could change)
_GENERATION = {"prompt", "n", "size", "response_format", "model", "output_format", "output_compression",
               "background", "stream"}
_EDIT = _GENERATION | {"image", "image[]", "mask", "markup"}
_IGNORED = {"quality", "style", "moderation", "user", "safety_identifier", "input_fidelity", "complexity",
            "partial_images", "frame_count", "frame_duration_ms", "svg"}
_EXTRAS = {"steps", "seed", "sampler", "scheduler", "negative_prompt", "cfg_scale"}   # sdlite's own
_EDIT_EXTRAS = _EXTRAS | {"strength"}
# the A1111 field each sdlite field becomes, and back (to name the param of an error)
_A1111_FIELD = {"steps": "steps", "seed": "seed", "sampler": "sampler_name", "scheduler": "scheduler",
                "negative_prompt": "negative_prompt", "cfg_scale": "cfg_scale", "strength": "denoising_strength",
                "prompt": "prompt", "n": "batch_size"}
_PARAM_OF = {v: k for k, v in _A1111_FIELD.items()} | {k: k for k in _EDIT_EXTRAS} | {
    "width": "size", "height": "size", "init_images": "image", "image": "image", "mask": "mask",
    "sampler_index": "sampler"}


# --- errors -------------------------------------------------------------------------------------------------------

class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``status``, the message, the ``param`` it is about, OpenAI's ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def _type_of(status: int) -> str:
    return {401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _type_of(status), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 413: "request_too_large",
          500: "internal_error", "QueueFull": "queue_full", "ShuttingDown": "shutting_down", "NotEnoughMemoryNow": "insufficient_memory",
          "MemoryError": "insufficient_memory", "NeverFits": "request_too_large", "LimitExceeded": "limit_exceeded",
          "ImageTooLarge": "image_too_large", "RequestValidationError": "invalid_json"}


def error_shape(status: int, name: str, detail: Any, headers) -> JSONResponse:
    """The shared handlers' errors under ``/v1/`` in OpenAI's shape: A1111's 422 (a request sdlite refuses) is
    OpenAI's 400; the param is named where the message starts with a field's name."""
    if status == 422:
        status = 400
    if isinstance(detail, list):   # FastAPI's / StrictJSON's: [{"loc", "msg", "ctx"}]
        parts = [f"{'.'.join(str(x) for x in d.get('loc', ())[1:]) or 'body'}: "
                 f"{(d.get('ctx') or {}).get('error') or d.get('msg')}" for d in detail if isinstance(d, dict)]
        message = "We could not parse the JSON body of your request: " + "; ".join(parts)
    else:
        message = str(detail)
    first = re.match(r"[A-Za-z_]+", message)
    param = _PARAM_OF.get(first.group(0)) if first else None
    return error_response(status, message, param, _CODES.get(name, _CODES.get(status)), headers)


# --- images answered by URL -----------------------------------------------------------------------------------------

class ImageStore:
    """The images answered by URL: kept in memory for ``ttl`` seconds, at most ``max_bytes`` and ``max_count`` of
    them (the oldest dropped first), each under an unguessable name."""

    def __init__(self, ttl: float = URL_TTL_S, max_bytes: int = URL_STORE_BYTES, max_count: int = URL_STORE_COUNT):
        self.ttl, self.max_bytes, self.max_count = ttl, max_bytes, max_count
        self._items: collections.OrderedDict[str, tuple[float, bytes, str]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, media_type: str, suffix: str) -> str:
        name = f"{secrets.token_urlsafe(24)}.{suffix}"
        with self._lock:
            self._expire(time.monotonic())
            self._items[name] = (time.monotonic() + self.ttl, data, media_type)
            self._bytes += len(data)
            while self._items and (self._bytes > self.max_bytes or len(self._items) > self.max_count):
                self._drop(next(iter(self._items)))
        return name

    def get(self, name: str) -> tuple[bytes, str] | None:
        with self._lock:
            self._expire(time.monotonic())
            item = self._items.get(name)
            return None if item is None else (item[1], item[2])

    def _expire(self, now: float) -> None:
        while self._items:
            name, (deadline, _, _) = next(iter(self._items.items()))
            if deadline > now:
                break
            self._drop(name)

    def _drop(self, name: str) -> None:
        _, data, _ = self._items.pop(name)
        self._bytes -= len(data)


# --- reading the request ------------------------------------------------------------------------------------------

def _missing(param: str) -> OpenAIError:
    return OpenAIError(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def _invalid(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, f"Invalid '{param}': {message}", param, code)


def _integer(value: Any, param: str, low: int, high: int | None = None, form: bool = False) -> int:
    if form and isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(param, f"expected an integer, got {value!r}", "invalid_type")
    if value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise _invalid(param, f"{value} is out of range: expected an integer {span}")
    return value


def _number(value: Any, param: str, form: bool = False) -> float:
    if form and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(param, f"expected a number, got {value!r}", "invalid_type")
    return float(value)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _invalid(param, f"expected a string, got {type(value).__name__}", "invalid_type")
    return value


def _choice(value: Any, param: str, choices) -> str:
    if value not in choices:
        raise _invalid(param, f"{value!r} is not supported; expected one of {', '.join(map(repr, choices))}")
    return value


def _given(body: dict, name: str, default: str) -> Any:
    """``body[name]``, or ``default`` where it is left out, null or empty (an empty form field)."""
    value = body.get(name)
    return default if value is None or value == "" else value


def _size(value: Any, limits) -> tuple[int | None, int | None]:
    if value is None or value == "auto":
        return None, None
    match = re.fullmatch(r"(\d{1,5})x(\d{1,5})", value) if isinstance(value, str) else None
    if match is None:
        raise _invalid("size", f"{value!r} is not a size: expected 'WIDTHxHEIGHT' (e.g. '512x512') or 'auto' (the "
                               "model's native size)")
    width, height = int(match.group(1)), int(match.group(2))
    if width < 8 or height < 8:
        raise _invalid("size", f"{value!r} is too small: each side must be at least 8 pixels")
    if limits is not None and width * height > limits.max_pixels:
        raise _invalid("size", f"{width}x{height} is {width * height} pixels, over this server's limit of "
                               f"{limits.max_pixels} pixels an image (--max-pixels)")
    return width, height


def _model(value: Any, server: ServerBase) -> str | None:
    """The checkpoint ``model`` names (its name, as ``/v1/models`` lists it), None for the current one."""
    if value is None or value == "":
        return None
    name = _text(value, "model")
    if name.lower().startswith(OPENAI_MODELS):
        return None
    try:
        return server.find_checkpoint(name).name
    except StarletteHTTPException:
        available = ", ".join(c.model_name for c in server.checkpoints.list())
        raise OpenAIError(404, f"The model '{name}' does not exist; available: {available}", "model",
                          "model_not_found") from None


def _options(body: dict, server: ServerBase, edit: bool, form: bool = False) -> tuple[dict, dict]:
    """``(A1111 fields, how to answer)`` of an OpenAI request body; a bad field is an OpenAIError naming it."""
    known = (_EDIT | _EDIT_EXTRAS) if edit else (_GENERATION | _EXTRAS)
    for name in body:
        if name not in known and name not in _IGNORED:
            raise OpenAIError(400, f"Unknown parameter: '{name}'.", name, "unknown_parameter")
    if "markup" in body:
        raise _invalid("markup", "markup images are not supported by sdlite")
    if body.get("prompt") is None:
        raise _missing("prompt")
    prompt = _text(body["prompt"], "prompt")
    limits = server.limits
    if limits is not None and len(prompt) > limits.max_prompt_chars:
        raise _invalid("prompt", f"{len(prompt)} characters is over this server's limit of "
                                 f"{limits.max_prompt_chars} (--max-prompt-chars)", "string_above_max_length")
    most = min(MAX_BATCH, limits.max_images) if limits is not None else MAX_BATCH
    n = 1 if body.get("n") is None else _integer(body["n"], "n", 1, most, form)
    width, height = _size(body.get("size"), limits)
    stream = body.get("stream")
    if stream is not None and stream is not False and not (form and isinstance(stream, str)
                                                            and stream.lower() == "false"):
        raise _invalid("stream", "streaming (partial images) is not supported by sdlite: leave stream out or false")
    if body.get("background") not in (None, "auto", "opaque"):
        raise _invalid("background", f"{body['background']!r} is not supported: sdlite makes opaque images only "
                                     "('auto' or 'opaque')")
    answer = {
        "response_format": _choice(_given(body, "response_format", "b64_json"), "response_format",
                                   ("b64_json", "url")),
        "output_format": _choice(_given(body, "output_format", "png"), "output_format", tuple(OUTPUT_FORMATS)),
        "quality": 100 if body.get("output_compression") is None else
        _integer(body["output_compression"], "output_compression", 0, 100, form),
    }
    fields: dict[str, Any] = {"prompt": prompt, "batch_size": n, "n_iter": 1, "width": width, "height": height,
                              "seed": -1}   # steps, sampler and cfg_scale left out: the model's, else DEFAULTS
    checkpoint = _model(body.get("model"), server)
    if checkpoint is not None:
        fields["override_settings"] = {"sd_model_checkpoint": checkpoint}
    for name in (_EDIT_EXTRAS if edit else _EXTRAS):
        value = body.get(name)
        if value is None:
            continue
        if name in ("steps", "seed"):
            value = _integer(value, name, -1 if name == "seed" else 1, MAX_SEED if name == "seed" else None, form)
            if name == "steps" and limits is not None and value > limits.max_steps:
                raise _invalid("steps", f"{value} is over this server's limit of {limits.max_steps} steps "
                                        "(--max-steps)")
        elif name in ("cfg_scale", "strength"):
            value = _number(value, name, form)
        else:
            value = _text(value, name)
        fields[_A1111_FIELD[name]] = value
    return fields, answer


# --- edits: the image and the area to repaint ---------------------------------------------------------------------

def _transparent(image: Image.Image) -> Image.Image | None:
    """The fully transparent pixels (alpha 0) of ``image`` as an "L" mask (255 = repaint); None without an alpha
    channel."""
    if image.mode == "P" and "transparency" in image.info or image.mode in ("LA", "PA", "La"):
        image = image.convert("RGBA")
    if image.mode not in ("RGBA", "RGBa"):
        return None
    return image.getchannel("A").point(lambda a: 255 if a == 0 else 0)


def _b64_png(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def _edit_images(image_b64: str, mask_b64: str | None, max_bytes: int) -> tuple[str | None, bool]:
    """The repaint mask for A1111's img2img (a base64 "L" PNG, None: the whole image) and whether there is one."""
    image = decode_image(image_b64, "image", max_bytes)
    if mask_b64 is None:
        area = _transparent(image)
        if area is None or area.getbbox() is None:
            return None, False   # no transparency: the whole image is edited
        return _b64_png(area), True
    mask = decode_image(mask_b64, "mask", max_bytes)
    if mask.size != image.size:
        raise _invalid("mask", f"the mask is {mask.width}x{mask.height} and the image {image.width}x{image.height}: "
                               "they must be the same size")
    area = _transparent(mask)
    if area is None:
        raise _invalid("mask", "the mask has no alpha channel: it must be a PNG whose fully transparent pixels "
                               "(alpha 0) mark the area to edit")
    if area.getbbox() is None:
        raise _invalid("mask", "the mask has no fully transparent pixels (alpha 0): there is nothing to edit")
    return _b64_png(area), True


async def _edit_body(request: Request) -> tuple[dict, list[str], str | None]:
    """The form fields of a multipart edit request, the images and the mask (base64)."""
    if not request.headers.get("content-type", "").lower().startswith(("multipart/form-data",
                                                                       "application/x-www-form-urlencoded")):
        raise OpenAIError(400, "Invalid Content-Type: an edit is sent as multipart/form-data (the image and mask as "
                               "files)", None, "invalid_content_type")
    async with request.form(max_files=MAX_EDIT_IMAGES + 1, max_fields=64) as form:   # the uploads' temporary files closed after
        return await _read_form(form)


async def _read_form(form) -> tuple[dict, list[str], str | None]:
    """A parsed form's text fields, its images and its mask (base64; the mask None when there is none)."""
    body: dict[str, Any] = {}
    for name in form:
        if name not in ("image", "image[]", "mask"):
            values = form.getlist(name)
            if len(values) > 1 or isinstance(values[0], UploadFile):
                raise _invalid(name, "expected one text value")
            body[name] = values[0]
    images = form.getlist("image") + form.getlist("image[]")
    if not images:
        raise _missing("image")
    if len(images) > MAX_EDIT_IMAGES:
        raise _invalid("image", f"{len(images)} images were sent; at most {MAX_EDIT_IMAGES} are taken (reference "
                                "images of a FLUX.2 [klein] model)")
    masks = form.getlist("mask")
    if len(masks) > 1:
        raise _invalid("mask", "more than one mask was sent")
    files = []
    for param, item in (*(("image", image) for image in images), ("mask", masks[0] if masks else None)):
        if item is None:
            files.append(None)
            continue
        if not isinstance(item, UploadFile):
            raise _invalid(param, "expected a file (an image uploaded as multipart/form-data)", "invalid_type")
        data = await item.read()
        if not data:
            raise _invalid(param, "the file is empty")
        files.append(base64.b64encode(data).decode("ascii"))
    return body, files[:-1], files[-1]


# --- running and answering ----------------------------------------------------------------------------------------

def _a1111_request(fields: dict, edit: bool) -> a1111.Txt2ImgRequest:
    try:
        return (a1111.Img2ImgRequest if edit else a1111.Txt2ImgRequest)(**fields)
    except ValidationError as e:
        error = e.errors()[0]
        field = str(error.get("loc", ("",))[0])
        param = _PARAM_OF.get(field, field)
        raise _invalid(param, f"{error.get('msg')}, got {error.get('input')!r}", "invalid_type") from None


async def _run(request: Request, server: ServerBase, fields: dict, answer: dict, edit: bool, store: ImageStore):
    req = _a1111_request(fields, edit)
    plan = await run_in_threadpool(server.build_plan, req, None, {_A1111_FIELD[k]: v for k, v in DEFAULTS.items()})
    if edit:   # a FLUX.2 [klein] model edits from the images as references (a1111/references.py)
        plan.reference_mode = "edit"
    outcome = await server.generate(plan, request)
    if outcome is None:   # the client went away
        return Response(status_code=499)
    done = await run_in_threadpool(a1111.response, plan, outcome)
    data = await run_in_threadpool(_encode, done["images"], answer, store, str(request.base_url))
    used = outcome.results[0].request if outcome.results else plan.requests[0]
    return JSONResponse({"created": int(time.time()), "data": data, "background": "opaque",
                         "output_format": answer["output_format"], "size": f"{used.width}x{used.height}"})


def _encode(images: list[str], answer: dict, store: ImageStore, base_url: str) -> list[dict]:
    """A1111's base64 PNGs as OpenAI's ``data``: in the output format, base64 or by URL."""
    pil_format, media_type = OUTPUT_FORMATS[answer["output_format"]]
    out = []
    for b64 in images:
        if pil_format != "PNG":
            image = Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")
            buffer = io.BytesIO()
            image.save(buffer, format=pil_format, quality=answer["quality"])
            b64 = base64.b64encode(buffer.getvalue()).decode("ascii")
        if answer["response_format"] == "url":
            name = store.put(base64.b64decode(b64), media_type, answer["output_format"])
            out.append({"url": f"{base_url.rstrip('/')}{PREFIX}/images/files/{name}"})
        else:
            out.append({"b64_json": b64})
    return out


def _model_entry(model_id: str, checkpoint) -> dict:
    try:
        created = int(checkpoint.path.stat().st_mtime)
    except OSError:
        created = 0
    return {"id": model_id, "object": "model", "created": created, "owned_by": "sdlite"}


# --- the routes' OpenAPI description ---------------------------------------------------------------------------
# The routes read their bodies themselves (OpenAI's errors, a form's files); what they take is published in
# /openapi.json from these tables, the limits of this server included, so that clients and fuzzers see it.

def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _field_schemas(server: ServerBase, form: bool) -> dict[str, dict]:
    """Every field a request may carry (the edit's files aside), as JSON Schema; a form's ignored fields are text."""
    limits = server.limits
    most = min(MAX_BATCH, limits.max_images) if limits is not None else MAX_BATCH
    prompt: dict[str, Any] = {"type": "string", "description": "what to draw"}
    steps: dict[str, Any] = {"type": "integer", "minimum": 1, "description": "sampler steps (sdlite's; default "
                                                                             f"{DEFAULTS['steps']})"}
    if limits is not None:
        prompt["maxLength"] = limits.max_prompt_chars
        steps["maximum"] = limits.max_steps
    text = {"type": "string"}
    return {
        "prompt": prompt,
        "n": {"type": "integer", "minimum": 1, "maximum": most, "description": "images, one batch (default 1)"},
        "size": {"type": "string", "pattern": r"^(auto|[0-9]{1,5}x[0-9]{1,5})$",
                 "description": "WIDTHxHEIGHT, each side at least 8, within the server's --max-pixels; auto: the "
                                "model's native size (an edit: the image's)"},
        "response_format": {"enum": ["b64_json", "url", ""], "description": "empty: b64_json"},
        "model": {"type": "string", "description": "a checkpoint as /v1/models lists it; dall-e-* and gpt-image-*: "
                                                   "the current one"},
        "output_format": {"enum": [*OUTPUT_FORMATS, ""], "description": "empty: png"},
        "output_compression": {"type": "integer", "minimum": 0, "maximum": 100},
        "background": {"enum": ["auto", "opaque"], "description": "sdlite makes opaque images only"},
        "stream": {"type": "boolean", "enum": [False], "description": "streaming is not supported"},
        "steps": steps,
        "seed": {"type": "integer", "minimum": -1, "maximum": MAX_SEED, "description": "-1: random"},
        "sampler": {"type": "string", "description": "A1111's or sdlite's sampler name"},
        "scheduler": {"type": "string", "description": "A1111's or sdlite's scheduler name"},
        "negative_prompt": text,
        "cfg_scale": {"type": "number"},
        "strength": {"type": "number", "description": "A1111's denoising strength (default 1.0 with an area to "
                                                      "repaint, else 0.75)"},
    } | {name: (text if form else {}) | {"description": "accepted and ignored"} for name in _IGNORED}


def _body_schema(server: ServerBase, edit: bool) -> dict:
    """The request body's schema: the edit's multipart form (its image and mask files) or the generation's JSON."""
    fields = _field_schemas(server, form=edit)
    names = ((_EDIT - {"image", "image[]", "mask", "markup"}) | _EDIT_EXTRAS) if edit else (_GENERATION | _EXTRAS)
    properties = {name: fields[name] if name in ("prompt", *_IGNORED) or edit else _nullable(fields[name])
                  for name in sorted(names | _IGNORED)}
    if not edit:
        return {"type": "object", "required": ["prompt"], "properties": properties, "additionalProperties": False}
    image = {"type": "string", "format": "binary"}
    properties = {"image": {**image, "description": "the image to edit (PNG, JPEG, WebP ...; also taken as "
                                                   "image[])"},
                  "mask": {**image, "description": "a PNG of the image's size: its fully transparent pixels are "
                                                   "the area to repaint"}} | properties
    return {"type": "object", "required": ["image", "prompt"], "properties": properties,
            "additionalProperties": False}


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_MODEL_SCHEMA = {"type": "object", "required": ["id", "object", "created", "owned_by"],
                 "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                "created": {"type": "integer"}, "owned_by": {"type": "string"}}}
_IMAGES_SCHEMA = {"type": "object", "required": ["created", "data", "background", "output_format", "size"],
                  "properties": {"created": {"type": "integer"},
                                 "data": {"type": "array", "items": {"type": "object", "properties": {
                                     "b64_json": {"type": "string"}, "url": {"type": "string"}}}},
                                 "background": {"type": "string"}, "output_format": {"enum": list(OUTPUT_FORMATS)},
                                 "size": {"type": "string"}}}
_ERROR_WHEN = {400: "a bad request: the error names the param", 401: "no valid credentials (--api-auth, --api-key)",
               404: "the model (or image) does not exist", 413: "the request body or an image is over the cap",
               503: "the queue is full, the server is stopping or has no memory now: retry after Retry-After "
                    "seconds"}


def _responses(ok: dict, what: str, auth: bool, *statuses: int) -> dict:
    """An operation's answers for the OpenAPI schema: 200 with ``ok``, the ``statuses`` (and 401 behind auth) with
    OpenAI's error."""
    out: dict[int | str, dict] = {200: {"description": what, "content": {"application/json": {"schema": ok}}}}
    for status in sorted({*statuses, *((401,) if auth else ())}):
        out[status] = {"description": _ERROR_WHEN[status],
                       "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
        if status == 503:
            out[status]["headers"] = {"Retry-After": {"schema": {"type": "string"}, "required": True}}
    return out


def add_routes(app: FastAPI, server: ServerBase, dependencies: list) -> None:
    """OpenAI's routes on ``app`` over ``server``, behind ``dependencies`` (the auth check), their errors in OpenAI's
    shape. The images answered by URL are served without auth: their names are unguessable and expire."""
    store = ImageStore()
    app.state.openai_images = store
    add_error_shape(app, PREFIX + "/", error_shape)

    @app.exception_handler(OpenAIError)
    async def openai_error(request, e: OpenAIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    api = APIRouter(prefix=PREFIX, dependencies=dependencies, tags=["OpenAI Images API"])
    auth = bool(dependencies)
    images = functools.partial(_responses, _IMAGES_SCHEMA, "the images", auth, 400, 404, 413, 503)

    @api.post("/images/generations", responses=images(), openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": _body_schema(server, edit=False)}}}})
    async def generations(request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise OpenAIError(400, "We could not parse the JSON body of your request: send a JSON object "
                                   "(Content-Type: application/json)", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, f"The JSON body must be an object, not {type(body).__name__}", None,
                              "invalid_json")
        fields, answer = _options(body, server, edit=False)
        return await _run(request, server, fields, answer, False, store)

    @api.post("/images/edits", responses=images(), openapi_extra={"requestBody": {
        "required": True, "content": {"multipart/form-data": {"schema": _body_schema(server, edit=True)}}}})
    async def edits(request: Request):
        body, images_b64, mask_b64 = await _edit_body(request)
        fields, answer = _options(body, server, edit=True, form=True)
        mask, masked = await run_in_threadpool(_edit_images, images_b64[0], mask_b64, server.max_body_bytes)
        fields.update(init_images=images_b64, mask=mask, inpainting_fill=0, inpaint_full_res=False,
                      resize_mode=0)
        fields.setdefault("denoising_strength", MASKED_STRENGTH if masked else WHOLE_STRENGTH)
        return await _run(request, server, fields, answer, True, store)

    @api.get("/models", responses=_responses({"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": _MODEL_SCHEMA}}}, "the models", auth))
    async def models():
        return {"object": "list", "data": [_model_entry(c.model_name, c) for c in server.checkpoints.list()]}

    # the id is read from the path here, not declared as a FastAPI parameter (whose 422 answer /v1 never gives)
    @api.get("/models/{model_id:path}", responses=_responses(_MODEL_SCHEMA, "the model", auth, 404),
             openapi_extra={"parameters": [{"name": "model_id", "in": "path", "required": True,
                                            "schema": {"type": "string"}}]})
    async def model(request: Request):
        model_id = request.path_params["model_id"]
        if model_id.lower().startswith(OPENAI_MODELS):
            return _model_entry(model_id, server.checkpoints.current)
        found = server.checkpoints.find(model_id)
        if found is None:
            await run_in_threadpool(server.checkpoints.refresh)
            found = server.checkpoints.find(model_id)
        if found is None:
            raise OpenAIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
        return _model_entry(model_id, found)

    app.include_router(api)

    @app.get(PREFIX + "/images/files/{name}", include_in_schema=False)
    async def image_file(name: str):
        item = store.get(name)
        if item is None:
            raise OpenAIError(404, f"The image '{name}' does not exist or has expired (images answered by URL are "
                                   f"kept {URL_TTL_S / 60:g} minutes)", None, "not_found")
        return Response(item[0], media_type=item[1], headers={"Cache-Control": "private, max-age=3600"})
