"""ComfyUI's own web page (the pinned comfyui-frontend-package) served by ``sdlite serve`` at ``/comfy/``, in a real
browser against the real server.

As in tests/test_web_page.py: Debian's chromium driven by Playwright's sync API, headless, against ``sdlite serve``
started as a subprocess on a free loopback port with the shipped demo model. The user opens the page, picks
sdlite's template in the template browser the first visit opens (ComfyUI's classic text-to-image graph on the
server's model at its native size: the package's built-in default graph is a Z-Image Turbo graph whose loaders and
sampling nodes sdlite does not have), asks for fewer steps, and presses the queue button. The image must come back through the
websocket and ``/view`` into the page, equal to the file sdlite wrote; every request the page made at start-up must
have been answered (no 404 but the optional stylesheets and template files ComfyUI answers 404 as well).
"""
from __future__ import annotations

import io
import json
import urllib.request

import numpy as np
import pytest
from PIL import Image

from tests.loopback import CHROMIUM, CHROMIUM_ARGS, serve

from playwright import sync_api  # noqa: E402  (the test extra; the browser is Debian's chromium)

TIMEOUT_MS = 120_000
# what the page may find missing: the user's optional stylesheets and its optional template settings file (ComfyUI
# answers 404 to these too when they are absent)
OPTIONAL = ("/comfy/user.css", "/comfy/api/userdata/user.css", "/comfy/api/userdata/comfy.templates.json")

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``sdlite serve`` with the demo model and its ComfyUI folders in a temporary folder."""
    comfy_dir = tmp_path_factory.mktemp("comfy")
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve(["--comfy-dir", str(comfy_dir)], log_path, "/api/prompt") as url:
        yield url, comfy_dir


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            # the page's only requests beyond this server (release notes, telemetry) are cut off, as offline
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            context.route(lambda url: not url.startswith(server[0]), lambda route: route.abort())
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.failed = []
            page.on("response", lambda r: page.failed.append((r.status, r.url)) if r.status >= 400 else None)
            yield page
        finally:
            browser.close()


def test_pick_the_template_queue_and_see_the_image(server, page):
    url, comfy_dir = server
    page.goto(url + "/comfy/")
    page.wait_for_function("window.app && window.app.graph && window.app.canvas && "
                           "document.querySelector('[data-testid=queue-button]')")
    # the first visit opens the template browser; sdlite offers ComfyUI's classic text-to-image graph on the model
    # it serves (the package's own default graph is a Z-Image Turbo graph, whose nodes sdlite does not have)
    page.click("[data-testid=template-workflow-sdlite_text_to_image]")
    page.locator("[role=dialog]").wait_for(state="hidden")
    page.wait_for_function("window.app.graph.nodes.length === 7")
    widgets = json.loads(page.evaluate("JSON.stringify(Object.fromEntries(window.app.graph.nodes.map("
                                       "n => [n.type + n.id, (n.widgets || []).map(w => w.value)])))"))
    assert widgets["CheckpointLoaderSimple4"] == ["demo"]   # the server's current checkpoint
    assert widgets["EmptyLatentImage5"] == [64, 64, 1]        # its native size
    assert "demo" in page.evaluate("window.app.graph.getNodeById(4).widgets[0].options.values")
    # the user asks for fewer steps, its own prompt and file name
    page.evaluate("""() => {
        const set = (id, name, value) => { window.app.graph.getNodeById(id).widgets.find(w => w.name === name).value = value }
        set(3, 'steps', 4); set(6, 'text', 'a red circle on a blue background'); set(9, 'filename_prefix', 'from_the_page')
    }""")
    # ... and presses the queue button; the image comes back through the websocket and /view
    with page.expect_response(lambda r: "/comfy/api/view?" in r.url and "from_the_page" in r.url
                              and r.status == 200) as shown:
        page.click("[data-testid=queue-button]")
    served = shown.value.body()
    files = sorted((comfy_dir / "output").glob("from_the_page*.png"))
    assert len(files) == 1 and files[0].read_bytes() == served
    image = Image.open(io.BytesIO(served))
    assert image.size == (64, 64) and np.asarray(image.convert("RGB")).std() > 5
    # the page holds the output of the SaveImage node, as ComfyUI's page does after "executed"
    outputs = page.evaluate("JSON.stringify(window.app.nodeOutputs)")
    assert files[0].name in outputs
    # the sent workflow is in the history with the page's client id, and everything the page asked for was answered
    history = json.load(urllib.request.urlopen(url + "/history"))
    (entry,) = history.values()
    assert entry["status"]["completed"] and entry["prompt"][2]["4"]["inputs"]["ckpt_name"] == "demo"
    assert entry["prompt"][3]["client_id"]
    unanswered = [(status, u) for status, u in page.failed if u.startswith(url)
                  and not any(u.split("?")[0].endswith(path) for path in OPTIONAL)]
    assert unanswered == []


def test_websocket_events_over_a_real_connection(server):
    """The `websockets` package's client on the real server's /ws (uvicorn's websocket, not the test client's)."""
    from websockets.sync.client import connect

    url, comfy_dir = server
    graph = {"4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "demo"}},
             "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle", "clip": ["4", 1]}},
             "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
             "3": {"class_type": "KSampler", "inputs": {"seed": 5, "steps": 3, "cfg": 7.0, "sampler_name": "euler",
                                                        "scheduler": "normal", "denoise": 1.0, "model": ["4", 0],
                                                        "positive": ["6", 0], "negative": ["6", 0],
                                                        "latent_image": ["5", 0]}},
             "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
             "9": {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}}}
    with connect(url.replace("http", "ws") + "/ws?clientId=real", open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=30))["data"]["sid"] == "real"
        body = json.dumps({"prompt": graph, "client_id": "real"}).encode()
        request = urllib.request.Request(url + "/api/prompt", data=body, headers={"Content-Type": "application/json"})
        prompt_id = json.load(urllib.request.urlopen(request, timeout=30))["prompt_id"]
        kinds = []
        while True:
            message = ws.recv(timeout=TIMEOUT_MS / 1000)
            if isinstance(message, bytes):
                continue
            data = json.loads(message)
            kinds.append(data["type"])
            if data["type"] == "executing" and data["data"]["node"] is None:
                break
    events = [k for k in kinds if k != "status"]
    assert events[:2] == ["execution_start", "execution_cached"] and events[-2:] == ["execution_success", "executing"]
    assert events.count("progress") == 3 and "executed" in events
    (image,) = json.load(urllib.request.urlopen(f"{url}/history/{prompt_id}"))[prompt_id]["outputs"]["9"]["images"]
    assert image["type"] == "temp" and (comfy_dir / "temp" / image["subfolder"] / image["filename"]).is_file()
