"""The HTTP machinery every front-end shares, around the routes: the error JSON and the handlers that answer with it,
HTTP Basic auth (``--api-auth``), the request-body cap, the strict-JSON check and the answer to a request cut off
by a shutdown at once (three ASGI middlewares).

Errors are reported as A1111 reports them: FastAPI's ``{"detail": [...]}`` (422) when the JSON does not fit the
schema, otherwise ``{"error", "detail", "body", "errors"}`` with a fitting status (401, 404, 413, 422, 503). A
front-end whose protocol has an error shape of its own registers it for its path prefix (:func:`add_error_shape`:
OpenAI's ``{"error": {...}}`` under ``/v1/``); the handlers and middlewares here answer in it there.
"""
from __future__ import annotations

import base64
import asyncio
import binascii
import email.message
import json
import logging
import math
import re
import secrets
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import CheckpointError, SDLiteError
from .decode import ImageTooLarge
from .jobs import ShuttingDown, Unavailable

log = logging.getLogger("sdlite.server")

MAX_BODY_BYTES = 64 << 20      # a request body (and any one decoded image) may be at most this large


class BodyTooLarge(HTTPException):
    """A request body over the cap (an HTTPException, so that FastAPI's body reading passes it on as it is)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the cap of {limit} bytes")


# --- errors -------------------------------------------------------------------------------------------------------

def error_response(status: int, name: str, detail: Any, errors: str | None = None, headers=None) -> JSONResponse:
    """An error as A1111 answers it: ``{"error", "detail", "body", "errors"}`` with ``status``."""
    body = {"error": name, "detail": detail, "body": "", "errors": errors if errors is not None else str(detail)}
    return JSONResponse(body, status_code=status, headers=headers)


def add_error_shape(app: FastAPI, prefix: str, shape) -> None:
    """Answer errors of requests whose path starts with ``prefix`` with ``shape(status, name, detail, headers)`` (a
    Response) instead of A1111's JSON."""
    app.state.error_shapes = [*getattr(app.state, "error_shapes", []), (prefix, shape)]


def _shape_for(scope):
    app = scope.get("app")
    for prefix, shape in getattr(getattr(app, "state", None), "error_shapes", ()):
        if scope.get("path", "").startswith(prefix):
            return shape
    return None


def shaped_error(scope, status: int, name: str, detail: Any, errors: str | None = None, headers=None):
    """:func:`error_response`, or the error shape registered for the request's path (:func:`add_error_shape`)."""
    shape = _shape_for(scope)
    if shape is not None:
        return shape(status, name, detail, headers)
    return error_response(status, name, detail, errors, headers)


def install_error_handlers(app: FastAPI) -> None:
    """The exceptions every route may raise, as the error JSON: HTTPException (its status), an image over the cap
    (413), a refused job (503 with ``Retry-After``), a bad request (422; a model that cannot be loaded: 500), out of
    memory (503), anything else (500), and FastAPI's own 422 for JSON that does not fit the schema."""
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return shaped_error(request.scope, e.status_code, "HTTPException", e.detail, f"{e.status_code}: {e.detail}",
                            e.headers)

    @app.exception_handler(ImageTooLarge)
    async def too_large(request, e):
        return shaped_error(request.scope, 413, type(e).__name__, str(e))

    @app.exception_handler(Unavailable)   # QueueFull, ShuttingDown, a cluster's lost replica
    async def busy(request, e):
        return shaped_error(request.scope, 503, type(e).__name__, str(e),
                            headers={"Retry-After": str(e.retry_after)})

    @app.exception_handler(SDLiteError)
    async def bad_request(request, e: SDLiteError):
        if isinstance(e, CheckpointError):   # a model in the list that cannot be loaded: the server's problem
            log.error("model cannot be loaded: %s", e)
            return shaped_error(request.scope, 500, type(e).__name__, f"the model cannot be loaded: {e}")
        return shaped_error(request.scope, 422, type(e).__name__, str(e))

    @app.exception_handler(MemoryError)   # an estimate that fell short: the job is lost, the server goes on
    async def out_of_memory(request, e):
        log.error("out of memory in %s %s", request.method, request.url.path)
        return shaped_error(request.scope, 503, "MemoryError",
                            "the job ran out of memory; retry with a smaller size or batch",
                            headers={"Retry-After": "10"})

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):
        log.exception("error in %s %s", request.method, request.url.path)
        return shaped_error(request.scope, 500, type(e).__name__, "internal error; the server log has the details",
                            str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, e: RequestValidationError):
        # FastAPI's own 422, with the inputs it echoes made writable: a body that is not read as JSON (text/plain,
        # a form, no Content-Type) reaches the model as bytes, and bytes that are not UTF-8 made FastAPI's encoder
        # fail (a 500); if anything else cannot be written, the answer leaves the inputs out
        detail = jsonable_encoder(e.errors(), custom_encoder={bytes: lambda b: b.decode("utf-8", "backslashreplace")})
        shape = _shape_for(request.scope)
        if shape is not None:
            return shape(422, "RequestValidationError", detail, None)
        try:
            return JSONResponse({"detail": detail}, status_code=422)
        except (ValueError, UnicodeError):
            bare = [{"type": d.get("type"), "loc": [ascii(x) if isinstance(x, str) else x for x in d.get("loc", ())],
                     "msg": d.get("msg")} for d in detail]
            return JSONResponse({"detail": bare}, status_code=422)


# --- auth ---------------------------------------------------------------------------------------------------------

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


def auth_dependency(server):
    """The FastAPI dependency that checks the request's credentials (401 otherwise): HTTP Basic against
    ``server.credentials`` (``--api-auth``), ``Authorization: Bearer KEY`` against ``server.api_key``
    (``--api-key``, what OpenAI's clients send); with both, either passes."""
    credentials = server.credentials or {}
    key = getattr(server, "api_key", None)
    challenge = ", ".join(scheme for scheme, given in (("Basic", credentials), ("Bearer", key)) if given)
    wanted = " or ".join(what for what, given in (("a username and password (HTTP Basic)", credentials),
                                                  ("an API key (Authorization: Bearer KEY)", key)) if given)

    def check(request: Request):
        header = request.headers.get("authorization", "")
        scheme, _, encoded = header.partition(" ")
        scheme = scheme.lower()
        if scheme == "bearer" and key:
            if secrets.compare_digest(encoded.strip().encode(), key.encode()):
                return
            raise HTTPException(401, "Incorrect API key provided", headers={"WWW-Authenticate": challenge})
        user = password = None
        if scheme == "basic" and credentials:
            try:
                user, _, password = base64.b64decode(encoded).decode("utf-8").partition(":")
            except (binascii.Error, UnicodeDecodeError):
                user = None
        expected = credentials.get(user) if user is not None else None
        if expected is None or not secrets.compare_digest(password.encode(), expected.encode()):
            tried = (scheme == "basic" and credentials) or not key   # Basic alone: the answer A1111 gives
            detail = "Incorrect username or password" if tried else f"Authentication required: send {wanted}"
            raise HTTPException(401, detail, headers={"WWW-Authenticate": challenge})
    return check


# --- the body: its size, strict JSON ------------------------------------------------------------------------------

class BodyLimit:
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
            response = shaped_error(scope, 413 if length.isdigit() else 400, "HTTPException", detail)
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


class AnswerWhenStopped:
    """Answers 503 (:class:`~.jobs.ShuttingDown`, with ``Retry-After``) to a request whose handler is cancelled by
    a shutdown at once (SIGINT, a second SIGTERM) before its response started, where the ASGI server would send a
    bare 500. The handler may be anywhere then: waiting for its job, or writing the finished job's images.
    ``stopping()`` says whether the server is stopping; a cancellation at any other time passes on."""

    def __init__(self, app, stopping):
        self.app, self.stopping = app, stopping

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started or not self.stopping():
                raise
            e = ShuttingDown(running=True)
            response = shaped_error(scope, 503, type(e).__name__, str(e), headers={"Retry-After": str(e.retry_after)})
            await response(scope, receive, send)


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


class StrictJSON:
    """Answers 422 (FastAPI's ``json_invalid`` error) to a JSON body that Python's json module reads but JSON does
    not allow, before any route sees it: NaN and Infinity, numbers beyond a double's range (1e400), strings with a
    lone UTF-16 surrogate ("\\ud800"), and nesting deeper than ``max_depth``. Let through, such a value failed only
    when the server wrote it back out (a response echoes the request's fields; /options keeps them): a 500 after the
    work was done, and for /options on every later GET /options. The body is read here, under :class:`BodyLimit`'s
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
            except StarletteHTTPException as e:   # over the body cap (BodyLimit)
                response = shaped_error(scope, e.status_code, "HTTPException", e.detail,
                                        f"{e.status_code}: {e.detail}", e.headers)
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
            shape = _shape_for(scope)
            response = shape(422, "RequestValidationError", detail, None) if shape is not None else \
                JSONResponse({"detail": detail}, status_code=422)
            return await response(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
