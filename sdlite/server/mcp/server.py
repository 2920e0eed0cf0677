"""MCP (the Model Context Protocol) for agents: :mod:`.tools`' tools served by the ``mcp`` SDK's low-level server,
on stdio (``sdlite mcp``) and as streamable HTTP under ``/mcp`` on ``sdlite serve``'s app.

Over HTTP, ``/mcp`` is a FastAPI route behind the same dependencies as every other front-end's routes (HTTP Basic of
``--api-auth``, the Bearer key of ``--api-key``), so an unauthorised request never reaches the SDK; the SDK's session
manager then answers it (POST for messages, GET for the server's stream, DELETE to end a session). The manager lives
as long as the app: :func:`sessions` is entered by the app's lifespan, one manager each time the app starts. When the
server binds a loopback address only, the SDK's DNS-rebinding protection is on (a Host or Origin of another name is
refused), as the SDK sets it up for servers on this machine. On a shutdown the calls being answered are answered
before anything closes: ``sdlite serve``'s drain waits for them (:func:`wait_answered`) after the running job, and the
SSE streams are ended only once no POST is being answered, so that a call whose job a SIGTERM's drain let finish or
interrupted still gets its image.

    sdlite mcp --model model.safetensors           # an MCP client starts this and talks to it on stdin/stdout
    sdlite serve ...  ->  http://127.0.0.1:7860/mcp
"""
from __future__ import annotations

import ipaddress
import logging
import signal
import threading
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from mcp import types
from mcp.server.lowlevel import Server as McpServer
from mcp.shared.exceptions import MCPError
from starlette.responses import Response

from ... import __version__
from ..backend import ServerBase
from .tools import TOOLS, Tools

log = logging.getLogger("sdlite.server")

INSTRUCTIONS = ("Stable Diffusion image generation by sdlite. generate makes images from a prompt; img2img and "
                "inpaint redraw an image (inpaint: its masked part); upscale enlarges one. list_models and "
                "list_samplers give the names the other tools take. Images come back as PNG with their parameters.")


def mcp_app(tools: Tools) -> McpServer:
    """The SDK's low-level server answering ``tools/list`` and ``tools/call`` with ``tools``."""
    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools.describe())

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name not in TOOLS:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}; the tools are {', '.join(TOOLS)}")
        return await tools.call(params.name, params.arguments or {}, ctx.session)

    return McpServer("sdlite", version=__version__, instructions=INSTRUCTIONS, on_list_tools=list_tools,
                     on_call_tool=call_tool)


# --- stdio -----------------------------------------------------------------------------------------------------------

async def serve_stdio(server) -> None:
    """Serve ``server`` (a :class:`~.backend.Server`) on this process's stdin and stdout until the client closes
    them; the files a call names may be read (``image_path``). While it runs the SDK points file descriptor 1 at
    stderr, so that nothing but MCP's messages reaches stdout."""
    from mcp.server.stdio import stdio_server

    app = mcp_app(Tools(server, local_files=True))
    async with stdio_server() as (read, write):
        server.start()   # the model loads in the queue meanwhile
        try:
            await app.run(read, write, app.create_initialization_options())
        finally:
            await server.stop()


# --- streamable HTTP under /mcp --------------------------------------------------------------------------------------

class _Endpoint:
    """``/mcp``'s SDK server and its current session manager (one per run of the app)."""

    def __init__(self, server: ServerBase):
        self.tools = Tools(server)
        self.app = mcp_app(self.tools)
        self.max_body_bytes = server.max_body_bytes
        self.host = server.flags.get("host")
        self.manager = None
        # POSTs being answered: a tool call's answer is written on its POST's SSE stream, so a call is answered when
        # that request is done (the tool's return is earlier: the answer still passes through the SDK's session and
        # transport tasks); a shutdown waits for these
        self._answering = 0
        self._answered = threading.Condition()

    async def answer(self, scope, receive, send) -> None:
        """The SDK's session manager answers the request; a POST is counted while it is being answered."""
        manager = self.manager
        if manager is None:
            return await Response("MCP sessions are not running: the app was not started (its lifespan)",
                                  503)(scope, receive, send)
        if scope["method"] != "POST":   # GET: the server's stream, open until the end; DELETE: a session's end
            return await manager.handle_request(scope, receive, send)
        with self._answered:
            self._answering += 1
        try:
            await manager.handle_request(scope, receive, send)
        finally:
            with self._answered:
                self._answering -= 1
                self._answered.notify_all()

    @property
    def answering(self) -> int:
        with self._answered:
            return self._answering

    def wait_answered(self, timeout: float) -> bool:
        """Wait (in a thread other than the event loop's) until no POST is being answered, at most ``timeout``
        seconds; whether none is."""
        with self._answered:
            return self._answered.wait_for(lambda: self._answering == 0, timeout)

    def security(self):
        from mcp.server.transport_security import TransportSecuritySettings

        if not _is_loopback(self.host):   # bound beyond this machine (or not known): names are not checked
            return None
        return TransportSecuritySettings(enable_dns_rebinding_protection=True,
                                         allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
                                         allowed_origins=["http://127.0.0.1:*", "http://localhost:*",
                                                          "http://[::1]:*"])

    @asynccontextmanager
    async def running(self):
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
        from sse_starlette.sse import AppStatus

        # the SDK's SSE responses (sse-starlette) end every stream the moment uvicorn is told to exit, which cut the
        # answer of a job that a SIGTERM's drain had just let finish: the streams are ended here instead, once the
        # calls are answered (_end_streams)
        AppStatus.disable_automatic_graceful_drain()
        AppStatus.should_exit = False   # process-wide: a previous run of an app may have set it
        manager = StreamableHTTPSessionManager(self.app, security_settings=self.security(),
                                               max_request_body_size=self.max_body_bytes)
        async with manager.run(), anyio.create_task_group() as tasks:
            tasks.start_soon(self._end_streams)
            self.manager = manager
            try:
                yield
            finally:
                self.manager = None
                tasks.cancel_scope.cancel()

    async def _end_streams(self) -> None:
        """sse-starlette's rule, answers kept: once uvicorn is told to exit (sdlite serve: after a SIGTERM's drain,
        which waited for the answers), the SSE streams end as soon as no POST is being answered (at most
        ANSWER_WAIT_S later), so that the connections close and the server stops. Ending them while a POST's answer
        was still on its way through the SDK (after the tool had returned) lost that answer."""
        from sse_starlette.sse import AppStatus

        while not _uvicorn_exiting():
            await anyio.sleep(EXIT_POLL_S)
        with anyio.move_on_after(ANSWER_WAIT_S):
            while self.answering:
                await anyio.sleep(EXIT_POLL_S / 4)
        AppStatus.should_exit = True


EXIT_POLL_S = 0.2
ANSWER_WAIT_S = 5.0


def _uvicorn_exiting() -> bool:
    """Whether the uvicorn server running this app was told to exit (its SIGTERM handler is its own bound method,
    which is how sse-starlette finds it too); False under anything else."""
    handler = signal.getsignal(signal.SIGTERM)
    return bool(getattr(getattr(handler, "__self__", None), "should_exit", False))


def _is_loopback(host) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except (TypeError, ValueError):
        return False


class _Handover(Response):
    """The route's answer: the SDK's session manager answers the request itself (an SSE stream or JSON)."""

    def __init__(self, endpoint: _Endpoint):
        super().__init__()
        self.endpoint = endpoint

    async def __call__(self, scope, receive, send) -> None:
        await self.endpoint.answer(scope, receive, send)


def add_routes(app: FastAPI, server: ServerBase, dependencies: list) -> None:
    """``/mcp`` on ``app`` over ``server``, behind ``dependencies`` (the auth check, when there is one). The app's
    lifespan must enter :func:`sessions`."""
    endpoint = app.state.mcp = _Endpoint(server)

    @app.api_route("/mcp", methods=["GET", "POST", "DELETE"], dependencies=dependencies, include_in_schema=False)
    async def mcp():
        return _Handover(endpoint)


def sessions(app: FastAPI):
    """The context in which ``/mcp``'s sessions live: entered by the app's lifespan."""
    return app.state.mcp.running()


def wait_answered(app: FastAPI, timeout: float = ANSWER_WAIT_S) -> bool:
    """A shutdown's wait (from a thread other than the event loop's) for ``/mcp``'s calls being answered: at most
    ``timeout`` seconds; whether all were."""
    return app.state.mcp.wait_answered(timeout)
