"""ComfyUI's own web page (the pinned comfyui-frontend-package) served by ``sdlite serve`` at ``/comfy/``, in a real
browser against the real server.

As in tests/test_web_page.py: Debian's chromium driven by Playwright's sync API, headless, against ``sdlite serve``
started as a subprocess on a free loopback port with the shipped demo model. The user opens the page, opens
ComfyUI's classic default text-to-image graph (a workflow file, through the page's own file input: the package's
built-in default graph is a Z-Image Turbo graph whose loaders and sampling nodes sdlite does not have), points its
checkpoint at the demo model and a small size, and presses the queue button. The image must come back through the
websocket and ``/view`` into the page, equal to the file sdlite wrote; every request the page made at start-up must
have been answered (no 404 but the optional stylesheets and template files ComfyUI answers 404 as well).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from PIL import Image

from tests.loopback import free_port

from playwright import sync_api  # noqa: E402  (the test extra; the browser is Debian's chromium)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 120_000
# what the page may find missing: the user's optional stylesheets, its optional template settings file, and the
# core templates' logo index (ComfyUI answers 404 to these too when they are absent)
OPTIONAL = ("/comfy/user.css", "/comfy/api/userdata/user.css", "/comfy/api/userdata/comfy.templates.json",
            "/comfy/templates/index_logo.json")

# ComfyUI's classic default graph: (id, type, widget values, inputs as (name, type, link), outputs as
# (name, type, links))
NODES = [
    (4, "CheckpointLoaderSimple", ["v1-5-pruned-emaonly-fp16.safetensors"], [],
     [("MODEL", "MODEL", [1]), ("CLIP", "CLIP", [3, 5]), ("VAE", "VAE", [8])]),
    (6, "CLIPTextEncode", ["beautiful scenery nature glass bottle landscape, , purple galaxy bottle,"],
     [("clip", "CLIP", 3)], [("CONDITIONING", "CONDITIONING", [4])]),
    (7, "CLIPTextEncode", ["text, watermark"], [("clip", "CLIP", 5)], [("CONDITIONING", "CONDITIONING", [6])]),
    (5, "EmptyLatentImage", [512, 512, 1], [], [("LATENT", "LATENT", [2])]),
    (3, "KSampler", [156680208700286, "randomize", 20, 8, "euler", "normal", 1],
     [("model", "MODEL", 1), ("positive", "CONDITIONING", 4), ("negative", "CONDITIONING", 6),
      ("latent_image", "LATENT", 2)], [("LATENT", "LATENT", [7])]),
    (8, "VAEDecode", [], [("samples", "LATENT", 7), ("vae", "VAE", 8)], [("IMAGE", "IMAGE", [9])]),
    (9, "SaveImage", ["ComfyUI"], [("images", "IMAGE", 9)], []),
]
LINKS = [[1, 4, 0, 3, 0, "MODEL"], [2, 5, 0, 3, 3, "LATENT"], [3, 4, 1, 6, 0, "CLIP"], [4, 6, 0, 3, 1, "CONDITIONING"],
         [5, 4, 1, 7, 0, "CLIP"], [6, 7, 0, 3, 2, "CONDITIONING"], [7, 3, 0, 8, 0, "LATENT"], [8, 4, 2, 8, 1, "VAE"],
         [9, 8, 0, 9, 0, "IMAGE"]]


def default_graph() -> dict:
    """The classic default graph in the page's own workflow format (as its Save writes it)."""
    nodes = []
    for order, (node_id, kind, widgets, inputs, outputs) in enumerate(NODES):
        nodes.append({"id": node_id, "type": kind, "pos": [100 + 300 * (order % 4), 100 + 300 * (order // 4)],
                      "size": [300, 200], "flags": {}, "order": order, "mode": 0,
                      "inputs": [{"name": n, "type": t, "link": link} for n, t, link in inputs],
                      "outputs": [{"name": n, "type": t, "links": links, "slot_index": i}
                                  for i, (n, t, links) in enumerate(outputs)],
                      "properties": {"Node name for S&R": kind}, "widgets_values": widgets})
    return {"last_node_id": 9, "last_link_id": 9, "nodes": nodes, "links": LINKS, "groups": [], "config": {},
            "extra": {}, "version": 0.4}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``sdlite serve`` with the demo model and its ComfyUI folders in a temporary folder."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    comfy_dir = tmp_path_factory.mktemp("comfy")
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sdlite", "serve", "--host", "127.0.0.1", "--port", str(port),
                                 "--comfy-dir", str(comfy_dir)], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"sdlite serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(url + "/api/prompt", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"sdlite serve did not answer within 120 s:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url, comfy_dir
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


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


def test_open_the_default_graph_queue_and_see_the_image(server, page):
    url, comfy_dir = server
    page.goto(url + "/comfy/")
    page.wait_for_function("window.app && window.app.graph && window.app.canvas && "
                           "document.querySelector('[data-testid=queue-button]')")
    # the first visit opens the template browser (sdlite ships no templates: it says "No templates found"); the
    # user closes it
    dialog = page.locator("[role=dialog]")
    dialog.wait_for(state="visible")
    assert "No templates found" in dialog.inner_text()
    page.keyboard.press("Escape")
    dialog.wait_for(state="hidden")
    # the user opens ComfyUI's classic default text-to-image graph (Workflow > Open: the page's file input)
    page.set_input_files("#comfy-file-input", files=[{"name": "default.json", "mimeType": "application/json",
                                                      "buffer": json.dumps(default_graph()).encode()}])
    page.wait_for_function("window.app.graph.nodes.length === 7 && "
                           "window.app.graph.getNodeById(4).widgets[0].value.endsWith('.safetensors')")
    # ... points the checkpoint at sdlite's demo model (the combo lists it), a small size, a few steps and a seed in
    # the range sdlite's KSampler offers (the graph's own seed is beyond it)
    options = page.evaluate("window.app.graph.getNodeById(4).widgets[0].options.values")
    assert "demo" in options
    page.evaluate("""() => {
        const set = (id, name, value) => { window.app.graph.getNodeById(id).widgets.find(w => w.name === name).value = value }
        set(4, 'ckpt_name', 'demo'); set(5, 'width', 64); set(5, 'height', 64); set(3, 'steps', 4); set(3, 'seed', 3)
        set(6, 'text', 'a red circle on a blue background'); set(9, 'filename_prefix', 'from_the_page')
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
