"""MCP through the ``mcp`` SDK's own client: ``sdlite mcp`` on stdio (a subprocess) and streamable HTTP under ``/mcp``
on ``sdlite serve`` (a subprocess on a free loopback port, with ``--api-auth`` and ``--api-key``), on the demo model.

The images a tool returns must be the engine's for the same seed and settings, the job's steps must arrive as progress
notifications, a bad argument must come back as a tool error naming it, and ``/mcp`` must refuse a request without
credentials (and one whose Host names another machine). Both servers start once for the module, side by side; the
stdio session's calls run once (a fixture) and the tests check what they returned.
"""
from __future__ import annotations

import base64
import io
import subprocess
import sys
from pathlib import Path

import anyio
import httpx2
import numpy as np
import pytest
import requests
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from PIL import Image

from sdlite.demo import model_path
from sdlite.pipeline import Engine, Request
from tests.loopback import free_port, wait_for
from tests.test_server_api import source_and_mask

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a red circle on a blue background"
USER, PASSWORD, KEY = "agent", "s3cret", "sk-test-mcp"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
TIMEOUT = 120
GENERATE = {"prompt": PROMPT, "steps": 4, "seed": 5, "cfg_scale": 7, "sampler": "Euler a", "width": 64, "height": 64}
TOOLS = {"generate", "img2img", "inpaint", "edit_image", "upscale", "list_models", "list_samplers"}

# the servers run on one torch thread (--threads 1), and so does the engine the images are compared with
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the servers ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    """``sdlite serve`` on a free loopback port; started first, so that it loads while the stdio server does."""
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sdlite", "serve", "--port", str(port), "--threads", "1",
                                 "--api-auth", f"{USER}:{PASSWORD}", "--api-key", KEY, "--max-steps", "1000"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        yield f"http://127.0.0.1:{port}", proc, log
    finally:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def url(http_server):
    base, proc, log = http_server

    def ready():
        assert proc.poll() is None, log.read_text()
        try:
            r = requests.get(f"{base}/sdapi/v1/progress", headers={"Authorization": BASIC}, timeout=5)
        except requests.ConnectionError:
            return False
        return r.status_code == 200 and r.json()["state"]["job_count"] == 0   # the model is loaded

    wait_for(ready, timeout=TIMEOUT, every=0.2)
    return f"{base}/mcp"


@pytest.fixture(scope="module")
def engine():
    return Engine.load(model_path())


def b64png(image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def png_of(content) -> Image.Image:
    assert content.type == "image" and content.mime_type == "image/png"
    image = Image.open(io.BytesIO(base64.b64decode(content.data)))
    image.load()
    assert image.format == "PNG"
    return image


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def error_text(result) -> str:
    assert result.is_error, result
    return result.content[0].text


async def call(session, name, arguments):
    """The tool's result and the progress notifications that came with it."""
    progress = []

    async def on_progress(done, total, message):
        progress.append((done, total, message))

    result = await session.call_tool(name, arguments, progress_callback=on_progress)
    return result, progress


# --- stdio ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stdio(http_server, tmp_path_factory):
    """One ``sdlite mcp`` session: every stdio call, run once; the tests check the results."""
    source, _ = source_and_mask()
    source_file = tmp_path_factory.mktemp("images") / "source.png"
    source.save(source_file)
    params = StdioServerParameters(command=sys.executable, args=["-m", "sdlite", "mcp", "--threads", "1"], cwd=ROOT)

    async def session():
        got = {"faults": []}

        async def on_message(message):   # a line of stdout that is not a JSON-RPC message arrives as an exception
            if isinstance(message, Exception):
                got["faults"].append(message)

        with anyio.fail_after(TIMEOUT):
            async with stdio_client(params) as (read, write), \
                    ClientSession(read, write, message_handler=on_message) as s:
                got["init"] = await s.initialize()
                got["tools"] = (await s.list_tools()).tools
                got["generate"] = await call(s, "generate", GENERATE)
                got["bad"] = await call(s, "generate", {**GENERATE, "steps": 0, "colour": "red"})
                got["img2img"] = await call(s, "img2img", {"prompt": PROMPT, "steps": 3, "seed": 1,
                                                           "image_path": str(source_file)})
                got["missing"] = await call(s, "img2img", {"prompt": PROMPT, "image_path": str(source_file) + ".x"})
        return got

    return anyio.run(session)


def test_stdio_lists_the_tools_with_local_files(stdio):
    assert stdio["init"].server_info.name == "sdlite"
    assert stdio["faults"] == []   # nothing but MCP's messages on stdout (model loading, generation: all on stderr)
    tools = {t.name: t for t in stdio["tools"]}
    assert set(tools) == TOOLS
    assert "image_path" in tools["img2img"].input_schema["properties"]   # this machine's user: files may be named
    assert tools["generate"].input_schema["required"] == ["prompt"]


def test_stdio_generate_equals_the_engine_with_progress(stdio, engine):
    result, progress = stdio["generate"]
    assert not result.is_error, result
    image, text = result.content
    expected = engine.generate(Request(PROMPT, steps=4, seed=5, cfg_scale=7, sampler="euler_a", width=64,
                                       height=64)).images[0]
    got = png_of(image)
    assert got.size == (64, 64) and np.array_equal(pixels(got), pixels(expected))
    assert text.text.startswith("seed 5\n") and "Seed: 5" in text.text and got.info["parameters"] in text.text
    assert result.structured_content["seeds"] == [5]
    assert [(done, total) for done, total, _ in progress] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert progress[-1][2] == "image 1 of 1, step 4 of 4"


def test_stdio_bad_arguments_are_named(stdio):
    result, _ = stdio["bad"]
    text = error_text(result)
    assert "steps=0" in text and "colour: not an argument" in text
    assert "no such file" in error_text(stdio["missing"][0])


def test_stdio_img2img_reads_a_local_file(stdio):
    result, progress = stdio["img2img"]
    assert not result.is_error, result
    assert png_of(result.content[0]).size == (64, 64) and "Denoising strength: 0.75" in result.content[1].text
    assert progress and progress[-1][0] == progress[-1][1]


# --- streamable HTTP under /mcp --------------------------------------------------------------------------------------

def http_session(url, headers, scenario):
    async def run():
        with anyio.fail_after(TIMEOUT):
            async with httpx2.AsyncClient(headers=headers, timeout=TIMEOUT) as client, \
                    streamable_http_client(url, http_client=client) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                return await scenario(session)
    return anyio.run(run)


def test_http_generate_equals_the_engine_with_progress(url, engine):
    async def scenario(session):
        tools = (await session.list_tools()).tools
        return tools, await call(session, "generate", {**GENERATE, "batch_size": 2, "seed": 8})

    tools, (result, progress) = http_session(url, {"Authorization": BASIC}, scenario)
    assert {t.name for t in tools} == TOOLS
    assert "image_path" not in next(t for t in tools if t.name == "img2img").input_schema["properties"]
    assert not result.is_error, result
    images = [png_of(c) for c in result.content if c.type == "image"]
    expected = engine.generate(Request(PROMPT, steps=4, seed=8, cfg_scale=7, sampler="euler_a", width=64, height=64,
                                       batch_size=2)).images
    assert len(images) == 2 and all(np.array_equal(pixels(a), pixels(b)) for a, b in zip(images, expected))
    assert result.structured_content["seeds"] == [8, 9]
    assert progress and progress[-1][:2] == (4, 4)


def test_http_inpaint_upscale_lists_and_errors(url):
    source, mask = source_and_mask()

    async def scenario(session):
        return {name: await call(session, tool, arguments) for name, tool, arguments in (
            ("inpaint", "inpaint", {"prompt": PROMPT, "steps": 3, "seed": 2, "image": b64png(source),
                                    "mask": "data:image/png;base64," + b64png(mask), "inpainting_fill": "fill"}),
            ("upscale", "upscale", {"image": b64png(source), "upscaler": "Lanczos", "scale": 2}),
            ("models", "list_models", {}),
            ("samplers", "list_samplers", {}),
            ("path", "img2img", {"prompt": PROMPT, "image_path": "/etc/hostname"}),
            ("model", "generate", {"prompt": PROMPT, "model": "no-such-model"}),
            ("upscaler", "upscale", {"image": b64png(source), "upscaler": "no-such-upscaler"}),
            ("image", "img2img", {"prompt": PROMPT, "image": "not base64!"}),
        )}

    got = http_session(url, {"Authorization": f"Bearer {KEY}"}, scenario)   # --api-key's Bearer works too
    inpainted = png_of(got["inpaint"][0].content[0])
    assert inpainted.size == (64, 64)
    corner = pixels(inpainted)[:8, :8]   # outside the mask (and its blur): the source, kept
    assert np.abs(corner - np.array([0, 0, 255])).max() <= 2
    upscaled = png_of(got["upscale"][0].content[0])
    assert upscaled.size == (128, 128) and "Postprocess upscaler: Lanczos" in got["upscale"][0].content[1].text
    models = got["models"][0].structured_content
    assert [c["name"] for c in models["checkpoints"]] == ["demo"] and models["checkpoints"][0]["current"]
    assert "Lanczos" in [u["name"] for u in models["upscalers"]]
    assert "Euler a" in [s["name"] for s in got["samplers"][0].structured_content["samplers"]]
    assert "image_path: this server reads no files" in error_text(got["path"][0])
    assert "no-such-model" in error_text(got["model"][0])
    assert "no-such-upscaler" in error_text(got["upscaler"][0])
    assert "image" in error_text(got["image"][0]) and "base64" in error_text(got["image"][0])


def test_http_cancelled_call_stops_its_job(url):
    """A call the client cancels (the SDK sends notifications/cancelled) interrupts its job: the queue is idle long
    before the job's 1000 steps could have run."""
    def idle():
        r = requests.get(f"{url[:-len('/mcp')]}/sdapi/v1/progress", headers={"Authorization": BASIC}, timeout=5)
        return r.json()["state"]["job_count"] == 0

    async def scenario(session):
        started = anyio.Event()

        async def on_progress(done, total, message):
            started.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(session.call_tool, "generate", {**GENERATE, "steps": 1000}, None, on_progress)
            await started.wait()
            assert not idle()
            tasks.cancel_scope.cancel()
        cancelled = anyio.current_time()
        while not idle():
            await anyio.sleep(0.05)
        return anyio.current_time() - cancelled

    assert http_session(url, {"Authorization": BASIC}, scenario) < 10   # the whole job would run 1000 steps


def test_http_refuses_without_credentials(url):
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                             "clientInfo": {"name": "test", "version": "1"}}}
    headers = {"Accept": "application/json, text/event-stream"}
    r = requests.post(url, json=initialize, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 401 and "Basic" in r.headers["WWW-Authenticate"]
    r = requests.post(url, json=initialize, headers={**headers, "Authorization": "Bearer wrong"}, timeout=TIMEOUT)
    assert r.status_code == 401
    r = requests.post(url, json=initialize, headers={**headers, "Authorization": BASIC, "Host": "evil.example"},
                      timeout=TIMEOUT)   # DNS rebinding: a loopback server answers its own names only
    assert r.status_code in (403, 421), r.text
    r = requests.post(url, json=initialize, headers={**headers, "Authorization": BASIC}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers.get("mcp-session-id")


def test_http_bad_requests_get_4xx_and_the_server_goes_on(url):
    """Hand-written bad input (``/mcp`` is left out of the OpenAPI schema that schemathesis fuzzes): each gets a 4xx
    saying what is wrong, and the server then serves a session as before."""
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "Authorization": BASIC}
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                             "clientInfo": {"name": "test", "version": "1"}}}
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "generate", "arguments": {}}}
    for body, extra, status, words in (
            (b"not json", {}, 400, "Parse error"),
            (b'{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"x": NaN}}', {}, 422, "NaN"),
            (b"[" * 200 + b"]" * 200, {}, 422, "nested"),
            (call, {}, 400, "Missing session ID"),                      # a call before any session
            (initialize, {"Accept": "text/html"}, 406, "Not Acceptable"),
            (initialize, {"mcp-session-id": "no-such-session"}, 404, "Session not found")):
        kw = {"json": body} if isinstance(body, dict) else {"data": body}
        r = requests.post(url, headers={**headers, **extra}, timeout=TIMEOUT, **kw)
        assert r.status_code == status and words in r.text, (body, r.status_code, r.text)
    assert requests.put(url, json=initialize, headers=headers, timeout=TIMEOUT).status_code == 405

    r = requests.post(url, json=initialize, headers=headers, timeout=TIMEOUT)   # a session, by hand
    assert r.status_code == 200
    headers["mcp-session-id"] = r.headers["mcp-session-id"]
    requests.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers, timeout=TIMEOUT)
    for params, words in (({"name": "paint", "arguments": {}}, "unknown tool 'paint'"),
                          ({"name": "generate", "arguments": "a cat"}, "Invalid request parameters")):
        r = requests.post(url, json={**call, "params": params}, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200 and '"code":-32602' in r.text and words in r.text, r.text
    r = requests.post(url, json={**call, "params": {"name": "list_samplers", "arguments": {}}}, headers=headers,
                      timeout=TIMEOUT)
    assert r.status_code == 200 and '"result"' in r.text and "Euler a" in r.text, r.text
    assert requests.delete(url, headers=headers, timeout=TIMEOUT).status_code == 200



def test_a_shutdown_waits_for_the_posts_being_answered():
    """sdlite serve's SIGTERM drain (mcp_server.wait_answered) waits until each POST /mcp being answered has sent
    its answer; a GET (the server's stream, open until the end) is not waited for. A call's tool returns before its
    answer is written (it still passes through the SDK's tasks to the POST's SSE stream): a shutdown that ended the
    streams at that point lost the answer about once in 5."""
    from sdlite.server import create_app
    from sdlite.server.mcp import server as mcp_server

    app = create_app(preload=False)
    endpoint = app.state.mcp
    sent, waits = [], []

    async def main():
        release = anyio.Event()

        class Manager:   # the SDK's session manager as the route sees it: it answers once released
            async def handle_request(self, scope, receive, send):
                await release.wait()
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": scope["method"].encode()})

        async def send(message):
            sent.append(message)

        async def drain():   # as sdlite serve's drain thread waits
            waits.append(await anyio.to_thread.run_sync(mcp_server.wait_answered, app, 0.2))
            waits.append(await anyio.to_thread.run_sync(mcp_server.wait_answered, app, 30))

        endpoint.manager = Manager()
        async with anyio.create_task_group() as tasks:
            for method in ("GET", "POST"):
                tasks.start_soon(endpoint.answer, {"type": "http", "method": method}, None, send)
            await anyio.sleep(0.05)
            assert endpoint.answering == 1   # the POST only
            tasks.start_soon(drain)
            while not waits:
                await anyio.sleep(0.01)
            assert waits == [False] and not sent   # nothing answered yet: the first wait ran out
            release.set()
        assert waits == [False, True] and endpoint.answering == 0
        assert [m["body"] for m in sent if "body" in m] in ([b"GET", b"POST"], [b"POST", b"GET"])

    anyio.run(main)
