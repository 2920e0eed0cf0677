"""`sdlite serve` as a real process on 127.0.0.1: HTTP, the PyPI client `webuiapi` used unchanged, faults (a client
killed mid-request, interrupt, SIGTERM during a job) and a load run of 16 concurrent clients.

The server starts once for the module with ``--models-dir`` holding two names for the demo model (symlinks, no
copies), so that model switching is exercised; the SIGTERM test runs last and stops it. Load figures are printed
(``-s``) and written to build/server_load.json.
"""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
from PIL import Image, ImageDraw

import webuiapi

from sdlite.demo import model_path
from tests import demo_controlnet
from tests.loopback import free_port

PROMPT = "a red circle on a blue background"
ROOT = Path(__file__).resolve().parent.parent
LOAD_REPORT = ROOT / "build" / "server_load.json"
TIMEOUT = 120


class Live:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"
        self.api = f"{self.base}/sdapi/v1"

    def get(self, path, **kw):
        return requests.get(f"{self.api}/{path}", timeout=TIMEOUT, **kw)

    def post(self, path, payload=None, **kw):
        return requests.post(f"{self.api}/{path}", json=payload, timeout=TIMEOUT, **kw)

    def txt2img(self, **fields):
        r = self.post("txt2img", {"prompt": PROMPT, "steps": 5, **fields})
        assert r.status_code == 200, r.text
        return r

    def state(self):
        return self.get("progress", params={"skip_current_image": "true"}).json()

    def wait_idle(self, timeout=TIMEOUT):
        wait_for(lambda: self.state()["state"]["job_count"] == 0, timeout)


def wait_for(predicate, timeout=TIMEOUT, every=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except requests.ConnectionError:
            value = None
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out waiting")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    (models / "demo-a").symlink_to(model_path(), target_is_directory=True)
    (models / "demo-b").symlink_to(model_path(), target_is_directory=True)
    controlnets = tmp_path_factory.mktemp("controlnets")
    demo_controlnet.write(controlnets)
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sdlite", "serve", "--port", str(port), "--models-dir",
                                 str(models), "--max-steps", "1000", "--controlnet-dir", str(controlnets)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    server = Live(proc, port, log)
    try:
        wait_for(lambda: server.get("options").json()["sd_checkpoint_hash"], timeout=180, every=0.2)
        server.wait_idle()
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def b64png(image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def as_array(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def test_http_endpoints_and_the_wiki_curl_request(live):
    r = subprocess.run(["curl", "-s", "-X", "POST", f"{live.api}/txt2img", "-H", "Content-Type: application/json",
                        "-d", json.dumps({"prompt": PROMPT, "steps": 5, "seed": 1})],
                       capture_output=True, timeout=TIMEOUT)
    body = json.loads(r.stdout)
    image = decode(body["images"][0])
    assert image.size == (64, 64) and "Seed: 1" in image.info["parameters"]
    assert [m["model_name"] for m in live.get("sd-models").json()] == ["demo-a", "demo-b"]
    assert live.get("samplers").status_code == 200 and live.get("memory").json()["ram"]["used"] > 0
    r = requests.get(f"{live.base}/", timeout=TIMEOUT)
    assert r.status_code in (200, 404)


def test_webuiapi_client_unchanged(live):
    api = webuiapi.WebUIApi(host="127.0.0.1", port=live.port, sampler="Euler a", steps=5)
    report = {}

    result = api.txt2img(prompt=PROMPT, seed=5, width=64, height=64, cfg_scale=7)
    assert result.image.size == (64, 64) and result.info["all_seeds"] == [5]
    assert result.info["sampler_name"] == "Euler a" and result.parameters["seed"] == 5
    report["txt2img"] = "works"

    source = Image.new("RGB", (64, 64), (0, 0, 255))
    ImageDraw.Draw(source).ellipse((22, 22, 42, 42), fill=(255, 0, 0))
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle((16, 16, 47, 47), fill=255)
    result = api.img2img(images=[source], mask_image=mask, prompt="a yellow star on a blue background", seed=2,
                         denoising_strength=0.75, inpaint_full_res=False, width=64, height=64)
    out = as_array(result.image)
    assert out.shape == (64, 64, 3) and np.array_equal(out[:6], as_array(source)[:6])
    assert "Mask blur: 4" in result.info["infotexts"][0]
    report["img2img (mask)"] = "works"

    info = api.png_info(result.image)
    assert info.info == result.info["infotexts"][0]
    report["png_info"] = "works"

    progress = api.get_progress()
    assert progress["progress"] == 0 and progress["state"]["job_count"] == 0
    report["get_progress"] = "works"
    api.util_wait_for_ready(check_interval=0.1)
    report["util_wait_for_ready"] = "works"
    assert api.interrupt() == {} and api.skip() == {}
    report["interrupt"] = report["skip"] = "works"

    options = api.get_options()
    assert options["sd_model_checkpoint"].startswith("demo-a")
    assert api.set_options({"CLIP_stop_at_last_layers": 2}) == {}
    assert api.get_options()["CLIP_stop_at_last_layers"] == 2
    api.set_options({"CLIP_stop_at_last_layers": 1})
    report["get_options / set_options"] = "works"

    titles = api.util_get_model_names()
    assert len(titles) == 2 and titles[0].startswith("demo-a [") and titles[1].startswith("demo-b")
    assert [m["model_name"] for m in api.get_sd_models()] == ["demo-a", "demo-b"]
    api.util_set_model("demo-b")            # lower-cased and matched by similarity, as webuiapi does
    assert api.util_get_current_model().startswith("demo-b")
    result = api.txt2img(prompt=PROMPT, seed=5, width=64, height=64, cfg_scale=7)
    assert result.info["sd_model_name"] == "demo-b"
    # a short name is matched by similarity, so "demo-a" alone ties with "demo-b [hash]"; the title is exact
    api.util_set_model(titles[0])
    assert api.util_get_current_model() == titles[0]
    report["get_sd_models / util_set_model / util_get_current_model"] = "works"

    for method in ("get_samplers", "get_schedulers", "get_upscalers", "get_loras", "get_sd_vae", "get_embeddings",
                   "get_memory", "get_cmd_flags", "get_scripts", "get_hypernetworks", "get_face_restorers",
                   "get_prompt_styles", "get_realesrgan_models", "get_latent_upscale_modes", "refresh_checkpoints",
                   "util_get_sampler_names", "util_get_scheduler_names"):
        value = getattr(api, method)()
        assert value is not None, method
        report[method] = "works"
    assert "Euler a" in api.util_get_sampler_names() and "karras" in api.util_get_scheduler_names()
    # the hires fix with a latent and an image upscaler, and the extras upscale, as the client sends them
    for upscaler in (webuiapi.HiResUpscaler.Latent, webuiapi.HiResUpscaler.Lanczos):
        result = api.txt2img(prompt=PROMPT, seed=6, width=64, height=64, enable_hr=True, hr_scale=2,
                             hr_upscaler=upscaler, denoising_strength=0.5)
        assert result.image.size == (128, 128), upscaler
        extra = result.info["extra_generation_params"]
        assert extra["Hires upscaler"] == upscaler.value and extra["Hires upscale"] == "2", extra
        report[f"txt2img enable_hr ({upscaler.value})"] = "works"
    result = api.extra_single_image(source, upscaler_1="Lanczos", upscaling_resize=2)
    assert result.image.size == (source.width * 2, source.height * 2)
    assert "Postprocess upscaler: Lanczos" in result.image.info["parameters"]
    report["extra_single_image"] = "works"
    # not implemented (no interrogator): a 501 naming what it needs, which the client reports as an error
    for method, args in (("interrogate", (source,)),):
        with pytest.raises(RuntimeError) as e:
            getattr(api, method)(*args)
        assert e.value.args[0] == 501 and "CLIP interrogator" in str(e.value.args[1]), method
        report[method] = "not supported (501)"
    print("\nwebuiapi", webuiapi.__version__ if hasattr(webuiapi, "__version__") else "", json.dumps(report, indent=1))


def test_webuiapi_controlnet_unit(live):
    """webuiapi's ControlNet calls, unchanged: the version, model and module lists, a ControlNetUnit in txt2img (the
    same image as the extension's JSON sent directly; the control map after it), detect (its older field name
    controlnet_images), and the empty args it sends with every request once it believes ControlNet is there."""
    from sdlite.control import preprocess

    api = webuiapi.WebUIApi(host="127.0.0.1", port=live.port, sampler="Euler", steps=5)
    assert api.controlnet_version() == 3
    models = api.controlnet_model_list()
    demo = next(m for m in models if m.startswith("demo-control ["))
    assert [m.split(" [")[0] for m in models][:2] == ["control_demo_edges", "demo-control"]
    assert api.controlnet_module_list()[:2] == ["none", "canny"]
    control = demo_controlnet.shape_image()
    unit = webuiapi.ControlNetUnit(image=control, module="canny", model=demo, weight=0.8, control_mode=1,
                                   threshold_a=100, threshold_b=200, guidance_end=0.8)
    result = api.txt2img(prompt=PROMPT, seed=5, width=64, height=64, cfg_scale=7, controlnet_units=[unit])
    assert len(result.images) == 2 and result.image.size == (64, 64)     # the image, then the control map
    text = result.info["infotexts"][0]
    assert 'ControlNet 0: "Module: canny, Model: demo-control [' in text
    assert "Control Mode: My prompt is more important" in text and "Resize Mode: Resize and Fill" in text
    assert result.info["warnings"] == []
    direct = live.txt2img(seed=5, width=64, height=64, cfg_scale=7, sampler_name="Euler", alwayson_scripts={
        "controlnet": {"args": [{"enabled": True, "image": b64png(control), "module": "canny", "model": demo,
                                 "weight": 0.8, "resize_mode": "Resize and Fill", "processor_res": 512,
                                 "control_mode": "My prompt is more important", "guidance_end": 0.8}]}})
    assert np.array_equal(as_array(result.image), as_array(decode(direct.json()["images"][0])))
    detected = api.controlnet_detect([control], module="canny", processor_res=64, threshold_a=100, threshold_b=200)
    assert detected.info == "Success" and len(detected.images) == 1
    assert np.array_equal(as_array(detected.image), as_array(preprocess.run("canny", control, 64, 100, 200)))
    api.has_controlnet = True          # as if /scripts had shown "controlnet m2m": {"ControlNet": {"args": []}}
    plain = api.txt2img(prompt=PROMPT, seed=5, width=64, height=64, cfg_scale=7)
    assert len(plain.images) == 1 and plain.info["warnings"] == []
    assert not np.array_equal(as_array(plain.image), as_array(result.image))


def test_client_killed_mid_request(live):
    client = subprocess.Popen([sys.executable, "-c", (
        "import requests, sys; requests.post(sys.argv[1], json={'prompt': 'x', 'steps': 1000, 'seed': 1}, "
        "timeout=600)"), f"{live.api}/txt2img"])
    try:
        wait_for(lambda: live.state()["state"]["sampling_step"] > 0)
        client.send_signal(signal.SIGKILL)
        client.wait(30)
        live.wait_idle(60)   # the orphaned job was interrupted, not run to its 1000th step
        assert live.proc.poll() is None
        assert len(live.txt2img(seed=3).json()["images"]) == 1
    finally:
        if client.poll() is None:
            client.kill()


def test_interrupt_returns_a_partial_image(live):
    results = []
    worker = threading.Thread(target=lambda: results.append(live.post("txt2img", {"prompt": PROMPT, "steps": 500,
                                                                                  "seed": 9})))
    worker.start()
    wait_for(lambda: live.state()["state"]["sampling_step"] >= 3)
    assert live.post("interrupt").json() == {}
    worker.join(TIMEOUT)
    r = results[0]
    assert r.status_code == 200 and decode(r.json()["images"][0]).size == (64, 64)
    assert any("stopped after step" in w for w in json.loads(r.json()["info"])["warnings"])
    live.wait_idle(30)
    assert live.state()["state"]["job_count"] == 0 and live.state()["progress"] == 0


def test_load_16_clients(live):
    """16 concurrent clients x 3 requests: each image equals the same request made alone, /progress stays fast,
    and the server's memory does not grow."""
    seeds = list(range(100, 108))
    alone = {s: as_array(decode(live.txt2img(seed=s, steps=3).json()["images"][0])) for s in seeds}
    process = psutil.Process(live.proc.pid)
    rss_first = process.memory_info().rss

    latencies, mismatches, failures = [], [], []
    poll_times, stop = [], threading.Event()

    def client(k):
        session = requests.Session()
        for j in range(3):
            seed = seeds[(3 * k + j) % len(seeds)]
            t0 = time.perf_counter()
            try:
                r = session.post(f"{live.api}/txt2img", json={"prompt": PROMPT, "steps": 3, "seed": seed},
                                 timeout=300)
            except requests.RequestException as e:
                failures.append(repr(e))
                continue
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                failures.append(f"{r.status_code} {r.text[:200]}")
            elif not np.array_equal(as_array(decode(r.json()["images"][0])), alone[seed]):
                mismatches.append(seed)

    def poller():
        session = requests.Session()
        while not stop.is_set():
            t0 = time.perf_counter()
            session.get(f"{live.api}/progress", timeout=30)
            poll_times.append(time.perf_counter() - t0)
            time.sleep(0.05)

    polling = threading.Thread(target=poller)
    polling.start()
    t0 = time.perf_counter()
    clients = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(600)
    wall = time.perf_counter() - t0
    stop.set()
    polling.join(30)
    live.wait_idle(60)
    rss_after = process.memory_info().rss

    figures = {
        "clients": 16, "requests_each": 3, "completed": len(latencies) - len(failures), "steps": 3, "size": "64x64",
        "wall_s": round(wall, 2), "throughput_images_per_min": round(len(latencies) / wall * 60, 1),
        "latency_p50_s": round(float(np.percentile(latencies, 50)), 3),
        "latency_p95_s": round(float(np.percentile(latencies, 95)), 3),
        "progress_polls": len(poll_times), "progress_p95_ms": round(float(np.percentile(poll_times, 95)) * 1000, 1),
        "rss_after_first_request_mb": round(rss_first / 2**20, 1), "rss_after_load_mb": round(rss_after / 2**20, 1),
        "rss_growth_pct": round((rss_after / rss_first - 1) * 100, 2), "cpu_count": os.cpu_count(),
    }
    print("\nserver load:", json.dumps(figures, indent=1))
    LOAD_REPORT.parent.mkdir(exist_ok=True)
    LOAD_REPORT.write_text(json.dumps(figures, indent=1) + "\n")

    assert not failures, failures[:3]
    assert len(latencies) == 48 and not mismatches, f"images differing from their single-request image: {mismatches}"
    assert figures["progress_p95_ms"] < 200
    assert abs(rss_after / rss_first - 1) <= 0.10


def test_sigterm_finishes_the_running_job_then_exits_0(live):
    """Runs last: it stops the module's server."""
    results = []
    worker = threading.Thread(target=lambda: results.append(live.post("txt2img", {"prompt": PROMPT, "steps": 30,
                                                                                  "seed": 4})))
    worker.start()
    wait_for(lambda: live.state()["state"]["sampling_step"] > 0)
    live.proc.send_signal(signal.SIGTERM)
    refused = live.post("txt2img", {"prompt": PROMPT, "steps": 2})
    assert refused.status_code == 503 and "shutting down" in refused.json()["detail"]
    assert int(refused.headers["retry-after"]) > 0
    worker.join(TIMEOUT)
    r = results[0]
    assert r.status_code == 200, r.text
    info = json.loads(r.json()["info"])
    assert len(r.json()["images"]) == 1 and info["steps"] == 30 and not info["warnings"]   # ran to the end
    assert live.proc.wait(60) == 0
