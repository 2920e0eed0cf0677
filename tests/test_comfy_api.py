"""ComfyUI's HTTP API and websocket on `sdlite serve` (sdlite/server/comfy/routes.py, queue.py,
frontend.py) through FastAPI's TestClient, with real workflows on the shipped demo model (64x64, a few steps)
run by the ComfyUI executor in the server's one job queue.

Checked: the websocket's event sequence of a real prompt (status, execution_start, execution_cached, executing,
progress, executed, binary previews, execution_success, the final executing null) and the cache on a re-queue; the
history, /view and the image on disk; ComfyUI's 400 bodies; the queue's order (front, number) shared with the A1111
jobs, delete, clear and interrupt; uploads that never overwrite; the listings; the web page's start-up routes
(settings, user data); auth on the routes and the websocket; and the clear refusal on a server without a job queue.
"""
from __future__ import annotations

import base64
import io
import json
import struct
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from sdlite.adapters.lora import engine_with_loras, find_lora
from sdlite.server import create_app
from sdlite.server.app import build_app
from sdlite.server.backend import ServerBase
from sdlite.server.limits import Limits

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # the tiny demo model: one torch thread is faster

PROMPT = "a red circle on a blue background"
WAIT_S = 120


def workflow(seed: int = 3, steps: int = 4, size: int = 64, prefix: str = "sdlite") -> dict:
    """ComfyUI's default text-to-image graph in API format, on the demo model."""
    return {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "demo"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "3": {"class_type": "KSampler", "inputs": {"seed": seed, "steps": steps, "cfg": 7.0, "sampler_name": "euler",
                                                   "scheduler": "normal", "denoise": 1.0, "model": ["4", 0],
                                                   "positive": ["6", 0], "negative": ["7", 0],
                                                   "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["8", 0]}},
    }


@pytest.fixture(scope="module")
def comfy_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("comfy")


@pytest.fixture(scope="module")
def client(comfy_dir):
    with TestClient(create_app(comfy_dir=comfy_dir, limits=Limits(max_steps=1000))) as c:
        server = c.app.state.server
        assert server.jobs.wait_idle(WAIT_S)   # the model is loaded
        server.set_options({"show_progress_every_n_steps": 1})   # a preview each step while a client listens
        yield c


def receive_until_done(ws, prompt_id: str) -> tuple[list[dict], list[bytes]]:
    """The JSON messages and binary frames up to the prompt's final ``executing`` with ``node`` null."""
    messages, frames = [], []
    while True:
        message = ws.receive()
        if message.get("bytes") is not None:
            frames.append(message["bytes"])
            continue
        data = json.loads(message["text"])
        messages.append(data)
        if data["type"] == "executing" and data["data"]["node"] is None and data["data"]["prompt_id"] == prompt_id:
            return messages, frames


def post_prompt(client, prompt: dict, path: str = "/prompt", **fields):
    r = client.post(path, json={"prompt": prompt, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def wait_history(client, prompt_id: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        item = client.get(f"/history/{prompt_id}").json()
        if item:
            return item[prompt_id]
        time.sleep(0.05)
    raise AssertionError(f"prompt {prompt_id} did not finish")


class HeldQueue:
    """A job that holds the queue's worker until released, so that what is queued meanwhile waits."""

    def __init__(self, client):
        self.jobs = client.app.state.server.jobs
        self.release = threading.Event()
        started = threading.Event()
        self.job = self.jobs.submit(lambda control: (started.set(), self.release.wait(WAIT_S)), "hold")
        assert started.wait(WAIT_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release.set()
        assert self.jobs.wait_idle(WAIT_S)


def test_prompt_events_history_view_and_cache(client, comfy_dir):
    with client.websocket_connect("/ws?clientId=me") as ws:
        hello = ws.receive_json()
        assert hello == {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}, "sid": "me"}}
        ws.send_text(json.dumps({"type": "feature_flags", "data": {"supports_preview_metadata": False}}))
        assert ws.receive_json()["type"] == "feature_flags"
        # previews on for this prompt (the page's "Live preview method"); the server's default is ComfyUI's, none
        body = post_prompt(client, workflow(seed=3), client_id="me", extra_data={"preview_method": "auto"})
        assert set(body) == {"prompt_id", "number", "node_errors"} and body["node_errors"] == {}
        pid = body["prompt_id"]
        messages, frames = receive_until_done(ws, pid)
        kinds = [m["type"] for m in messages]
        # status on queueing and starting, then the executor's events in ComfyUI's order, then success and the end
        assert kinds[0] == "status" and messages[0]["data"]["status"]["exec_info"]["queue_remaining"] == 1
        run = [k for k in kinds if k != "status"]
        assert run[:2] == ["execution_start", "execution_cached"]
        assert run[-3:] == ["executed", "execution_success", "executing"]
        executing = [m["data"]["node"] for m in messages if m["type"] == "executing"]
        assert executing[-1] is None and set(executing[:-1]) == set(workflow())
        assert executing.index("3") < executing.index("8") < executing.index("9")
        progress = [m["data"] for m in messages if m["type"] == "progress"]
        assert [p["value"] for p in progress] == [1, 2, 3, 4] and {p["max"] for p in progress} == {4}
        assert {p["node"] for p in progress} == {"3"} and {p["prompt_id"] for p in progress} == {pid}
        assert all(m["data"]["prompt_id"] == pid for m in messages if m["type"] != "status")
        # the binary previews: event type 1 (PREVIEW_IMAGE), format 1 (JPEG), then a JPEG
        assert frames, "no preview frames while the client listened"
        for frame in frames:
            assert struct.unpack(">II", frame[:8]) == (1, 1)
            assert Image.open(io.BytesIO(frame[8:])).format == "JPEG"
        executed = next(m["data"] for m in messages if m["type"] == "executed")
        image_ref = executed["output"]["images"][0]
        assert executed["node"] == "9" and image_ref["type"] == "output"
        # after the run: idle, history with the outputs and the messages, the image through /view and on disk
        assert messages[-1]["type"] == "executing"
        history = wait_history(client, pid)
        assert history["status"]["status_str"] == "success" and history["status"]["completed"] is True
        assert [m[0] for m in history["status"]["messages"]] == ["execution_start", "execution_cached",
                                                                 "execution_success"]
        assert history["outputs"]["9"]["images"] == [image_ref]
        assert history["prompt"][1] == pid and history["prompt"][2] == workflow(seed=3)
        assert history["prompt"][3] == {"client_id": "me", "preview_method": "auto"} and history["prompt"][4] == ["9"]
        r = client.get("/api/view", params=image_ref)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        on_disk = comfy_dir / "output" / image_ref["subfolder"] / image_ref["filename"]
        assert r.content == on_disk.read_bytes()
        image = Image.open(io.BytesIO(r.content))
        assert image.size == (64, 64)
        assert np.asarray(image.convert("RGB")).std() > 5   # a picture, not a flat fill
        # the same graph with a new seed: the loader and the text encodings come from the cache
        pid2 = post_prompt(client, workflow(seed=4), client_id="me")["prompt_id"]
        messages2, frames2 = receive_until_done(ws, pid2)
        assert frames2 == []   # no preview_method: the server's --preview-method, none as ComfyUI's
        cached = next(m["data"]["nodes"] for m in messages2 if m["type"] == "execution_cached")
        assert {"4", "6", "7", "5"} <= set(cached) and "3" not in cached
        ran = [m["data"]["node"] for m in messages2 if m["type"] == "executing"][:-1]
        assert set(ran) == {"3", "8", "9"}
    assert client.get("/prompt").json() == {"exec_info": {"queue_remaining": 0}}
    assert client.get("/queue").json() == {"queue_running": [], "queue_pending": []}
    # the page's /jobs view of the same history
    jobs = client.get("/api/jobs", params={"status": "completed"}).json()
    assert [j["id"] for j in jobs["jobs"]][:2] == [pid2, pid] and jobs["pagination"]["total"] >= 2
    assert client.get(f"/api/jobs/{pid}").json()["outputs"]["9"]["images"] == [image_ref]


def test_refused_prompts_in_comfyuis_shape(client):
    bad = workflow()
    bad["10"] = {"class_type": "NoSuchNode", "inputs": {}}
    r = client.post("/prompt", json={"prompt": bad})
    assert r.status_code == 400 and set(r.json()) == {"error", "node_errors"}
    assert "NoSuchNode" in json.dumps(r.json())
    r = client.post("/api/prompt", json={"client_id": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "no_prompt"
    r = client.post("/prompt", content=b"{not json", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_prompt"
    r = client.post("/prompt", json={"prompt": [1, 2]})
    assert r.status_code == 400 and "API format" in r.json()["error"]["message"]
    r = client.post("/prompt", json={"prompt": workflow(), "number": "first"})
    assert r.status_code == 400 and "number" in r.json()["error"]["message"]
    missing = workflow()
    del missing["3"]["inputs"]["model"]
    r = client.post("/prompt", json={"prompt": missing})
    assert r.status_code == 400 and "3" in r.json()["node_errors"]
    assert client.get("/queue").json()["queue_pending"] == []


def test_queue_order_delete_clear_and_a1111_jobs_in_the_same_line(client):
    jobs = client.app.state.server.jobs
    with HeldQueue(client):
        a = post_prompt(client, workflow(seed=11))
        b = post_prompt(client, workflow(seed=12))
        c = post_prompt(client, workflow(seed=13), front=True)
        d = post_prompt(client, workflow(seed=14), number=a["number"] + 0.5)
        assert c["number"] < 0 and d["number"] == a["number"] + 0.5
        pending = client.get("/queue").json()["queue_pending"]
        assert [item[1] for item in pending] == [c["prompt_id"], a["prompt_id"], d["prompt_id"], b["prompt_id"]]
        assert client.get("/prompt").json()["exec_info"]["queue_remaining"] == 4
        assert jobs.queued == 4   # one line: the held job runs, the prompts wait in the server's queue
        # the worker will take them in the same order
        order = [j for j in list(jobs._queue)]
        assert [client.app.state.comfy._by_job[j.id].prompt_id for j in order] == \
            [c["prompt_id"], a["prompt_id"], d["prompt_id"], b["prompt_id"]]
        assert client.post("/queue", json={"delete": [a["prompt_id"]]}).status_code == 200
        assert [i[1] for i in client.get("/queue").json()["queue_pending"]] == \
            [c["prompt_id"], d["prompt_id"], b["prompt_id"]]
        assert client.post("/api/queue", json={"clear": True}).status_code == 200
        assert client.get("/queue").json()["queue_pending"] == [] and jobs.queued == 0
        kept = post_prompt(client, workflow(seed=15, steps=2))
        assert client.post("/queue", json={"delete": "all"}).status_code == 400
    history = wait_history(client, kept["prompt_id"])
    assert history["status"]["completed"]
    for dropped in (a, b, c, d):   # deleted from the queue: never run, not in the history
        assert client.get(f"/history/{dropped['prompt_id']}").json() == {}


def test_interrupt_stops_the_running_prompt(client):
    with client.websocket_connect("/ws?clientId=stopper") as ws:
        ws.receive_json()
        pid = post_prompt(client, workflow(steps=600), client_id="stopper")["prompt_id"]
        other = post_prompt(client, workflow(steps=2), client_id="stopper")["prompt_id"]
        while True:   # wait until it samples
            message = ws.receive()
            data = json.loads(message["text"]) if message.get("text") is not None else {}
            if data.get("type") == "progress" and data["data"]["prompt_id"] == pid:
                break
        assert client.post("/interrupt", json={"prompt_id": other}).status_code == 200   # not running: no effect
        assert client.post("/api/interrupt", json={"prompt_id": pid}).status_code == 200
        messages, _ = receive_until_done(ws, pid)
        kinds = [m["type"] for m in messages]
        assert "execution_interrupted" in kinds and "execution_success" not in kinds
        interrupted = next(m["data"] for m in messages if m["type"] == "execution_interrupted")
        assert interrupted["prompt_id"] == pid and interrupted["node_id"] == "3"
        assert interrupted["node_type"] == "KSampler" and "4" in interrupted["executed"]
        messages, _ = receive_until_done(ws, other)   # the next prompt runs as usual
        assert "execution_success" in [m["type"] for m in messages]
    history = wait_history(client, pid)
    assert history["status"] == {**history["status"], "status_str": "error", "completed": False}
    assert client.get("/api/jobs", params={"status": "cancelled"}).json()["jobs"][0]["id"] == pid


def test_history_listing_and_deletion(client):
    ids = [post_prompt(client, workflow(seed=20 + i, steps=1))["prompt_id"] for i in range(3)]
    for pid in ids:
        wait_history(client, pid)
    newest = client.get("/history", params={"max_items": 2}).json()
    assert list(newest) == ids[1:]
    assert list(client.get("/api/history", params={"max_items": 1, "offset": 1}).json()) == [ids[1]]
    assert client.post("/history", json={"delete": [ids[0]]}).status_code == 200
    assert client.get(f"/history/{ids[0]}").json() == {} and ids[1] in client.get("/history").json()
    assert client.post("/history", json={"delete": 5}).status_code == 400
    assert client.post("/api/history", json={"clear": True}).status_code == 200
    assert client.get("/history").json() == {}


def png(color, size=(16, 16), mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color).save(out, format="PNG")
    return out.getvalue()


def test_uploads_never_overwrite_and_view_refuses_escapes(client, comfy_dir):
    def upload(data, name="cat.png", path="/upload/image", **fields):
        return client.post(path, files={"image": (name, data, "image/png")}, data=fields)

    red, blue = png("red"), png("blue")
    assert upload(red).json() == {"name": "cat.png", "subfolder": "", "type": "input"}
    assert upload(red).json()["name"] == "cat.png"          # the same bytes: the same file
    assert upload(blue).json()["name"] == "cat (1).png"     # other bytes: a new name, the old file kept
    assert upload(png("green")).json()["name"] == "cat (2).png"
    assert (comfy_dir / "input" / "cat.png").read_bytes() == red
    assert upload(blue, overwrite="true").json()["name"] == "cat.png"
    assert (comfy_dir / "input" / "cat.png").read_bytes() == blue
    r = upload(red, subfolder="pets", type="temp")
    assert r.json() == {"name": "cat.png", "subfolder": "pets", "type": "temp"}
    assert (comfy_dir / "temp" / "pets" / "cat.png").read_bytes() == red
    assert upload(red, subfolder="../../etc").status_code == 403
    assert upload(red, type="models").status_code == 400
    assert client.post("/upload/image", data={"overwrite": "true"}).status_code == 400
    # a mask goes into the alpha channel of the image it belongs to
    mask = Image.new("RGBA", (16, 16), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 8, 16))
    out = io.BytesIO()
    mask.save(out, format="PNG")
    ref = json.dumps({"filename": "cat.png", "subfolder": "", "type": "input"})
    r = upload(out.getvalue(), name="cat_mask.png", path="/api/upload/mask", original_ref=ref)
    assert r.status_code == 200 and r.json()["name"] == "cat_mask.png"
    masked = Image.open(comfy_dir / "input" / "cat_mask.png")
    assert masked.mode == "RGBA" and masked.getpixel((2, 2)) == (0, 0, 255, 0)
    assert masked.getpixel((12, 2)) == (0, 0, 255, 255)
    assert upload(red, name="m.png", path="/upload/mask").status_code == 400
    gone = json.dumps({"filename": "nope.png", "type": "input"})
    assert upload(red, name="m.png", path="/upload/mask", original_ref=gone).status_code == 404
    # /view
    r = client.get("/view", params={"filename": "cat.png", "type": "input"})
    assert r.status_code == 200 and r.content == blue
    r = client.get("/view", params={"filename": "cat.png", "type": "input", "preview": "jpeg;80"})
    assert r.headers["content-type"] == "image/jpeg" and Image.open(io.BytesIO(r.content)).format == "JPEG"
    for params, status in (({"filename": "../secret", "type": "input"}, 400),
                           ({"filename": "/etc/passwd"}, 400),
                           ({"filename": "passwd", "subfolder": "../../../../etc"}, 403),
                           ({"filename": "cat.png", "type": "elsewhere"}, 400),
                           ({"filename": "nothing.png", "type": "input"}, 404),
                           ({}, 400)):
        r = client.get("/view", params=params)
        assert r.status_code == status, (params, r.text)
        assert r.json()["detail"]


def test_listings_and_free(client):
    info = client.get("/object_info").json()
    assert {"CheckpointLoaderSimple", "KSampler", "SaveImage"} <= set(info)
    assert "demo" in json.dumps(info["CheckpointLoaderSimple"]["input"])
    assert list(client.get("/api/object_info/KSampler").json()) == ["KSampler"]
    assert client.get("/object_info/NoSuchNode").json() == {}
    stats = client.get("/system_stats").json()
    assert stats["system"]["ram_total"] > 0 and stats["devices"][0]["type"] == "cpu"
    assert client.get("/embeddings").json() == []
    assert "checkpoints" in client.get("/models").json()
    assert client.get("/api/models/checkpoints").json() == ["demo"]
    assert client.get("/models/loras").json() == []
    r = client.get("/models/nowhere")
    assert r.status_code == 404 and "nowhere" in r.json()["detail"]
    server = client.app.state.server
    assert server.jobs.wait_idle(WAIT_S)
    engine = server.engines.loaded(server.checkpoints.current)
    with engine_with_loras(engine, [(find_lora("demo_teal"), 1.0)]):   # kept after it (memory mode 1)
        pass
    assert engine.models.kept_loras is not None
    assert client.post("/free", json={"unload_models": True, "free_memory": True}).status_code == 200
    assert client.post("/free", json=[1]).status_code == 400
    assert server.jobs.wait_idle(WAIT_S)
    assert engine.models.kept_loras is None   # /free let go of the merged LoRA layers


def test_web_page_start_up_routes(client, comfy_dir):
    assert client.get("/comfy").status_code == 200   # redirected to /comfy/
    page = client.get("/comfy/")
    assert page.status_code == 200 and "<title>ComfyUI</title>" in page.text
    assert client.get("/comfy/api/users").json() == {"storage": "server", "migrated": True}
    assert client.get("/comfy/api/extensions").json() == []
    assert client.get("/comfy/api/i18n").json() == {}
    assert client.get("/comfy/api/features").json()["max_upload_size"] > 0
    assert client.get("/comfy/api/workflow_templates").json() == {}
    (module,) = client.get("/comfy/templates/index.json").json()
    (template,) = module["templates"]
    graph = client.get(f"/comfy/templates/{template['name']}.json").json()
    widgets = {node["type"]: node["widgets_values"] for node in graph["nodes"]}
    assert widgets["CheckpointLoaderSimple"] == ["demo"] and widgets["EmptyLatentImage"] == [64, 64, 1]
    assert len(graph["links"]) == 9 and {n["id"] for n in graph["nodes"]} == {3, 4, 5, 6, 7, 8, 9}
    thumbnail = client.get(f"/comfy/templates/{template['name']}-1.{template['mediaSubtype']}")
    assert Image.open(io.BytesIO(thumbnail.content)).size == (256, 256)
    assert client.get("/comfy/api/object_info").json().keys() == client.get("/object_info").json().keys()
    # settings, per user
    assert client.post("/comfy/api/settings", json={"Comfy.Locale": "en", "A": 1}).status_code == 200
    assert client.post("/api/settings/Comfy.Theme", json="dark").status_code == 200
    assert client.get("/api/settings").json() == {"Comfy.Locale": "en", "A": 1, "Comfy.Theme": "dark"}
    assert client.get("/api/settings/Comfy.Theme").json() == "dark"
    assert client.get("/api/settings/Unset").json() is None
    assert json.loads((comfy_dir / "user" / "default" / "comfy.settings.json").read_text())["A"] == 1
    assert client.get("/api/settings", headers={"Comfy-User": "other"}).json() == {}
    assert client.get("/api/settings", headers={"Comfy-User": "../x"}).status_code == 400
    # user data: written, never replaced without overwrite=true, listed, moved, deleted, kept inside its folder
    graph = json.dumps({"nodes": []}).encode()
    r = client.post("/api/userdata/workflows%2Fa.json", content=graph)
    assert r.status_code == 200 and r.json() == "workflows/a.json"
    assert client.post("/api/userdata/workflows%2Fa.json", content=b"{}").status_code == 409
    assert client.get("/api/userdata/workflows%2Fa.json").content == graph
    r = client.post("/api/userdata/workflows%2Fa.json", params={"overwrite": "true", "full_info": "true"},
                    content=b"{}")
    assert r.json()["path"] == "workflows/a.json" and r.json()["size"] == 2
    assert client.get("/api/userdata", params={"dir": "workflows"}).json() == ["a.json"]
    listed = client.get("/api/userdata", params={"dir": "workflows", "full_info": "true"}).json()
    assert listed[0]["path"] == "a.json" and listed[0]["size"] == 2
    assert client.post("/api/userdata/workflows%2Fb.json", content=b"[]").status_code == 200
    assert client.post("/api/userdata/workflows%2Fa.json/move/workflows%2Fb.json").status_code == 409
    assert client.post("/api/userdata/workflows%2Fa.json/move/workflows%2Fc.json").json() == "workflows/c.json"
    assert client.get("/api/userdata", params={"dir": "workflows"}).json() == ["b.json", "c.json"]
    assert client.delete("/api/userdata/workflows%2Fc.json").status_code == 204
    assert client.get("/api/userdata/workflows%2Fc.json").status_code == 404
    assert client.post("/api/userdata/..%2F..%2Fescape.json", content=b"{}").status_code == 403
    assert client.get("/api/userdata", params={"dir": "nowhere"}).status_code == 404
    assert client.get("/api/userdata").status_code == 400


def test_auth_covers_routes_and_websocket(tmp_path):
    with TestClient(create_app(api_auth="me:secret", comfy_dir=tmp_path, preload=False)) as c:
        assert c.get("/object_info").status_code == 401
        assert c.post("/prompt", json={"prompt": workflow()}).status_code == 401
        assert c.get("/comfy/api/settings").status_code == 401
        from starlette.websockets import WebSocketDisconnect

        with pytest.raises(WebSocketDisconnect):
            with c.websocket_connect("/ws") as ws:
                ws.receive_json()
        token = base64.b64encode(b"me:secret").decode()
        headers = {"Authorization": f"Basic {token}"}
        assert c.get("/api/queue", headers=headers).status_code == 200
        with c.websocket_connect("/ws", headers=headers) as ws:
            assert ws.receive_json()["type"] == "status"


def test_a_server_without_a_job_queue_refuses_prompts_clearly(tmp_path):
    server = ServerBase(comfy_dir=tmp_path)
    server.jobs = object()   # a job table that is no in-process queue, and no comfy_queue of its own
    with TestClient(build_app(server)) as c:
        r = c.post("/prompt", json={"prompt": workflow()})
        assert r.status_code == 501 and "no job queue for ComfyUI workflows" in r.json()["error"]["message"]
        assert c.get("/queue").json() == {"queue_running": [], "queue_pending": []}
        assert "KSampler" in c.get("/object_info").json()


def test_huge_uploads_and_bad_websocket_messages(tmp_path):
    with TestClient(create_app(comfy_dir=tmp_path, preload=False, max_body_bytes=100_000)) as c:
        r = c.post("/upload/image", files={"image": ("big.png", b"\0" * 200_000, "image/png")})
        assert r.status_code == 413 and "cap" in r.json()["detail"]
        assert list((tmp_path / "input").iterdir()) == []
        r = c.post("/api/userdata/workflows%2Fbig.json", content=b"[" * 200_000)
        assert r.status_code == 413 and not (tmp_path / "user" / "default" / "workflows" / "big.json").exists()
        with c.websocket_connect("/ws?clientId=odd") as ws:
            assert ws.receive_json()["data"]["sid"] == "odd"
            ws.send_bytes(b"\xff\x00 not a message")
            ws.send_text("not json")
            ws.send_text(json.dumps({"type": "unknown", "data": [1, 2]}))
            ws.send_text(json.dumps({"type": "feature_flags", "data": {}}))
            assert ws.receive_json()["type"] == "feature_flags"   # what it cannot read is ignored; it answers on
        with c.websocket_connect("/api/ws") as ws:   # no clientId: the server names the client
            assert len(ws.receive_json()["data"]["sid"]) == 32


def test_serve_hands_a_comfy_dir_to_the_ray_server(tmp_path, monkeypatch):
    """`sdlite serve --ray --comfy-dir DIR` is served (ComfyUI's prompts then run on the replicas:
    tests/test_scale_ray.py); here only that the CLI hands the folder on, without starting Ray."""
    from sdlite.cli import main
    from sdlite.scale import ray_serve

    seen = {}
    monkeypatch.setattr(ray_serve, "serve_cli", lambda args, host, flags, limits: seen.update(dir=args.comfy_dir) or 0)
    assert main(["serve", "--ray", "--comfy-dir", str(tmp_path)]) == 0
    assert seen == {"dir": str(tmp_path)}


def test_a_comfy_dir_that_cannot_be_made_leaves_the_other_routes_serving(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with TestClient(create_app(comfy_dir=blocker / "comfy", preload=False)) as c:
        assert "ComfyUI's folders cannot be made" in caplog.text
        assert c.get("/sdapi/v1/samplers").status_code == 200
        assert "KSampler" in c.get("/object_info").json()


def test_the_pages_prompt_fields(client):
    """What ComfyUI's page sends: "" as client_id before its socket has an id (events then go to every client),
    partial_execution_targets, extra_data with its preview choice and ComfyUI account keys (never kept)."""
    graph = workflow(seed=30, steps=3)
    graph["10"] = {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}}
    with client.websocket_connect("/ws?clientId=watcher") as ws:
        ws.receive_json()
        pid = post_prompt(client, graph, client_id="", partial_execution_targets=["10"],
                          extra_data={"preview_method": "none", "api_key_comfy_org": "secret",
                                      "extra_pnginfo": {"workflow": {"nodes": []}}})["prompt_id"]
        messages, frames = receive_until_done(ws, pid)   # broadcast: no client_id
    assert frames == []   # preview_method "none"
    assert [m["data"]["node"] for m in messages if m["type"] == "executed"] == ["10"]
    history = wait_history(client, pid)
    assert list(history["outputs"]) == ["10"] and history["outputs"]["10"]["images"][0]["type"] == "temp"
    assert history["prompt"][4] == ["10"] and "api_key_comfy_org" not in history["prompt"][3]
    assert "client_id" not in history["prompt"][3]
    r = client.post("/prompt", json={"prompt": graph, "partial_execution_targets": ["7"]})
    assert r.status_code == 400 and "7" in r.json()["error"]["message"]
    r = client.post("/prompt", json={"prompt": graph, "partial_execution_targets": "10"})
    assert r.status_code == 400 and "partial_execution_targets" in r.json()["error"]["message"]
