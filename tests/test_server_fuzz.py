"""Fuzzing `sdlite serve`, a real process on 127.0.0.1, with the shipped demo model and tight limits.

schemathesis (PyPI) drives every operation of the server's own OpenAPI schema (/openapi.json) twice, as a
subprocess (`st run`), one request at a time, with a fixed (deterministic) generation and a fixed number of examples
per operation:

* the schema as published: every phase (coverage, fuzzing, stateful), valid and invalid data; A1111's routes,
  OpenAI's Images API (/v1: the generation's JSON, the edit's multipart form, the models) and ComfyUI's API routes.
  Not in the schema, so not fuzzed here: /mcp (JSON-RPC over streamable HTTP, which OpenAPI cannot describe:
  tests/test_mcp.py sends it bad input by hand), ComfyUI's /ws (a websocket) and the routes of ComfyUI's web page
  (/comfy/, its settings and user data: the page's own, with no published schema), and the images /v1 answers by
  URL (unguessable names);
* the generation routes (txt2img, img2img, png-info) with the schema narrowed to what the server's limits and the
  model accept (steps, sizes, samplers, base64 images ...), valid data only, so that most requests make images
  instead of stopping at a 422.

Then hand-written cases for what a schema cannot express: base64 bombs (a small PNG that declares 30000x30000
pixels, a base64 string over the body cap), PNG headers that lie, deeply nested JSON, NaN / Infinity / lone
surrogates (JSON that Python reads and JSON forbids), a 1-character body and bodies that are not JSON, and slow
clients (slowloris-style, bounded). Each must get a clear 4xx and leave the server alive. After all of it: no 500 in
any answer or in the server's log, the reference txt2img made before the fuzzing gives the same pixels again, and
the server's RSS is within 10% of its RSS after that reference request.

Before the reference request the server is warmed up (:func:`warm_up`): the engine keeps what it allocates once per
image shape and per code path (75 MB for the demo model over the shapes and paths the fuzzing takes; a second run
of the whole fuzzing adds nothing, measured), which is not growth. The generation fuzzing asks for a few image
shapes only (:data:`SIDES`), each warmed up: about 1-3 MB stay per shape the engine has run.

The figures (requests sent, operations covered, server errors, durations) are printed (``-s``) and written to
build/server_fuzz.json.
"""
from __future__ import annotations

import base64
import collections
import copy
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import psutil
import pytest
import requests
from PIL import Image, ImageDraw

from tests.loopback import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
REPORT_PATH = ROOT / "build" / "server_fuzz.json"
PROMPT = "a red circle on a blue background"

JOB_TIMEOUT = 10.0   # --job-timeout: no job runs longer, so no request waits longer than one job for its answer
LIMIT_FLAGS = ["--max-pixels", "128x128", "--max-steps", "8", "--max-images", "2", "--max-prompt-chars", "2000",
               "--job-timeout", f"{JOB_TIMEOUT:g}"]
MAX_STEPS = 8
# the sides of the images the generation fuzzing asks for (width and height each): a few, each warmed up first
SIDES = (32, 64, 128)
# one request at a time: an answer waits for at most one job (stopped by the server after JOB_TIMEOUT) and its
# encoding; 6x that for a loaded machine
REQUEST_TIMEOUT = 6 * JOB_TIMEOUT
STARTUP_TIMEOUT = 180.0   # importing torch and loading the demo model on a busy machine
# a whole schemathesis run: about 2,400 requests answered at once, or 180 that make small images; each run takes
# 10-20 s alone and 45-55 s on 2 cores kept busy by other processes; one that is not over after this hangs
RUN_TIMEOUT = 600.0
PUBLISHED_EXAMPLES = 100   # --max-examples for the schema as published, per operation
NARROWED_EXAMPLES = 60     # and for the narrowed generation routes (each request makes images)
RSS_TOLERANCE = 0.10
# the request made before the fuzzing and after: everything that could come from the server's options is given
REFERENCE = {"prompt": PROMPT, "negative_prompt": "", "seed": 1234, "steps": MAX_STEPS, "width": 64, "height": 64,
             "cfg_scale": 7.0, "sampler_name": "Euler a", "scheduler": "Automatic", "eta": 1.0, "batch_size": 1,
             "n_iter": 1, "override_settings": {"CLIP_stop_at_last_layers": 1}}
HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}

REPORT: dict = {}


def record(key, value) -> None:
    """Add ``key`` to the report and write it out (so that a failing test still leaves its figures)."""
    REPORT[key] = value
    REPORT_PATH.parent.mkdir(exist_ok=True)
    REPORT_PATH.write_text(json.dumps(REPORT, indent=1) + "\n")


class Fuzzed:
    """The server process and what was measured before the fuzzing."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"
        self.api = f"{self.base}/sdapi/v1"
        self.http = requests.Session()
        self.http.trust_env = False   # loopback: never through a proxy from the environment
        self.reference_pixels: np.ndarray | None = None
        self.reference_seconds = 0.0
        self.rss_start = 0

    def post(self, path, payload=None, **kw):
        return self.http.post(f"{self.api}/{path}", json=payload, timeout=REQUEST_TIMEOUT, **kw)

    def raw(self, path, body: bytes, content_type: str | None = "application/json"):
        headers = {"Content-Type": content_type} if content_type else {}
        return self.http.post(f"{self.api}/{path}", data=body, headers=headers, timeout=REQUEST_TIMEOUT)

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def reference(self) -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        r = self.post("txt2img", REFERENCE)
        seconds = time.perf_counter() - t0
        assert r.status_code == 200, r.text[:500]
        return pixels(r.json()["images"][0]), seconds

    def assert_alive(self, stage: str | None = None):
        """The process runs and answers; ``stage``: record its RSS under that name."""
        assert self.proc.poll() is None, "the server exited"
        r = self.http.get(f"{self.api}/progress", params={"skip_current_image": "true"}, timeout=REQUEST_TIMEOUT)
        assert r.status_code == 200 and "state" in r.json(), r.text[:300]
        if stage:
            record("rss_mb", {**REPORT.get("rss_mb", {}), stage: round(self.rss() / 2**20, 1)})


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def warm_up(server: Fuzzed) -> int:
    """One request down each path the generation fuzzing takes (each sampler; txt2img, img2img and inpainting at
    each image shape and batch size), before the reference request whose RSS is the baseline. Returns the number
    of requests."""
    sent = 0

    def ok(route, payload):
        nonlocal sent
        r = server.post(route, {"prompt": PROMPT, "steps": 2, "seed": 1, **payload})
        assert r.status_code == 200, (route, payload, r.text[:300])
        sent += 1

    samplers = [s["name"] for s in server.http.get(f"{server.api}/samplers", timeout=REQUEST_TIMEOUT).json()]
    for sampler in samplers:
        ok("txt2img", {"sampler_name": sampler, "width": 64, "height": 64})
    source, mask = _image("RGB", (64, 64)), _mask((64, 64))
    for i, (width, height, batch) in enumerate((w, h, b) for w in SIDES for h in SIDES for b in (1, 2)):
        size = {"width": width, "height": height, "batch_size": batch}
        ok("txt2img", size)
        ok("img2img", {**size, "init_images": [source], "denoising_strength": 1.0})
        ok("img2img", {**size, "init_images": [source], "mask": mask, "denoising_strength": 1.0,
                       "inpainting_fill": i % 4, "inpaint_full_res": i % 2 == 0})
    return sent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("fuzz-log") / "server.log"
    comfy_dir = tmp_path_factory.mktemp("fuzz-comfy")   # what the fuzzed ComfyUI uploads and user data write
    # --log-level debug: uvicorn's access log, one line per request with its status (checked at the end)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sdlite", "serve", "--port", str(port), "--threads", "1",
                                 "--log-level", "debug", "--comfy-dir", str(comfy_dir), *LIMIT_FLAGS], stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    fuzzed = Fuzzed(proc, port, log)

    def ready():
        try:
            state = fuzzed.http.get(f"{fuzzed.api}/progress", params={"skip_current_image": "true"}, timeout=10)
            options = fuzzed.http.get(f"{fuzzed.api}/options", timeout=10)
        except requests.ConnectionError:
            return False
        assert proc.poll() is None, log.read_text()[-3000:]
        return state.json()["state"]["job_count"] == 0 and options.json()["sd_checkpoint_hash"]

    try:
        wait_for(ready, timeout=STARTUP_TIMEOUT, every=0.2)
        REPORT.clear()
        rss_idle = fuzzed.rss()
        first_pixels, _ = fuzzed.reference()
        rss_first = fuzzed.rss()
        t0 = time.monotonic()
        warmed = warm_up(fuzzed)
        warm_up_s = time.monotonic() - t0
        # the request made before the fuzzing and after it; its RSS is where the server starts
        fuzzed.reference_pixels, fuzzed.reference_seconds = fuzzed.reference()
        assert np.array_equal(fuzzed.reference_pixels, first_pixels)
        fuzzed.rss_start = fuzzed.rss()
        record("server", {"flags": " ".join(["--threads", "1", *LIMIT_FLAGS]),
                          "rss_idle_mb": round(rss_idle / 2**20, 1),
                          "rss_after_first_ever_request_mb": round(rss_first / 2**20, 1),
                          "warm_up_requests": warmed, "warm_up_s": round(warm_up_s, 1),
                          "reference_txt2img_s": round(fuzzed.reference_seconds, 3),
                          "rss_before_fuzzing_mb": round(fuzzed.rss_start / 2**20, 1)})
        yield fuzzed
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


# --- schemathesis --------------------------------------------------------------------------------------------------

def schema_operations(schema: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in schema["paths"].items() for method in item
            if method in HTTP_METHODS}


def schemathesis(location: str, workdir: Path, *args: str) -> dict:
    """Run `st run LOCATION` (one worker, deterministic generation, check not_a_server_error) and read its reports:
    every request it sent, each with the status it got (None: no answer, e.g. a timeout)."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "schemathesis.cli", "run", location, "--checks", "not_a_server_error",
               "--generation-deterministic", "--workers", "1", "--request-timeout", f"{REQUEST_TIMEOUT:g}",
               "--no-shrink", "--max-failures", "25", "--no-color", "--report", "json,ndjson",
               "--report-dir", str(workdir), *args]
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    t0 = time.monotonic()
    # cwd: schemathesis keeps a cache (.schemathesis/) in its working directory
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    seconds = time.monotonic() - t0
    output = done.stdout + done.stderr
    reports = {p.suffix: p for p in workdir.iterdir() if p.suffix in (".json", ".ndjson")}
    assert set(reports) == {".json", ".ndjson"}, output[-5000:]
    summary = json.loads(reports[".json"].read_text())
    sent = []
    for line in reports[".ndjson"].read_text().splitlines():
        event = json.loads(line)
        finished = event.get("ScenarioFinished")
        if finished is None:
            continue
        for interaction in finished["recorder"].get("interactions", {}).values():
            request, response = interaction["request"], interaction["response"]
            sent.append((request["method"].upper(), urlsplit(request["uri"]).path,
                         response["status_code"] if response else None))
    return {"exit_code": done.returncode, "output": output, "summary": summary, "sent": sent, "seconds": seconds}


def figures(run: dict, operations: set[tuple[str, str]]) -> dict:
    """The figures of one run, for the report and the asserts."""
    statuses = collections.Counter(status for _, _, status in run["sent"])
    per_operation: dict = collections.defaultdict(collections.Counter)
    # a path with parameters (ComfyUI's /history/{prompt_id} ...) is matched by its template, one segment a parameter
    templates = [(m, p, re.compile(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(p)))) for m, p in operations]
    for method, path, status in run["sent"]:
        for m, template, pattern in templates:
            if m == method and pattern.fullmatch(path):
                per_operation[f"{method} {template}"][str(status)] += 1
                break
    summary = run["summary"]
    return {
        "requests_sent": len(run["sent"]),
        "operations_in_schema": len(operations),
        "operations_exercised": sum(1 for op in operations if f"{op[0]} {op[1]}" in per_operation),
        "server_errors": sum(n for s, n in statuses.items() if s is not None and s >= 500),
        "no_answer": statuses.get(None, 0),
        "statuses": {str(s): n for s, n in sorted(statuses.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))},
        "test_cases": summary["test_cases"]["generated"],
        "failures": len(summary["failures"]),
        "errors": len(summary["errors"]),
        "exit_code": run["exit_code"],
        "seconds": round(run["seconds"], 1),
        "per_operation": {k: dict(v) for k, v in sorted(per_operation.items())},
    }


def assert_clean(run: dict, result: dict, operations: set[tuple[str, str]]):
    tail = run["output"][-6000:]
    assert result["server_errors"] == 0, tail
    assert result["no_answer"] == 0, tail   # a timeout or a dropped connection
    assert result["failures"] == 0 and result["errors"] == 0 and result["exit_code"] == 0, tail
    missing = sorted(f"{m} {p}" for m, p in operations if f"{m} {p}" not in result["per_operation"])
    assert not missing, f"operations never exercised: {missing}\n{tail}"


def test_schemathesis_published_schema(server, tmp_path):
    """Every operation of /openapi.json as the server publishes it, every phase, valid and invalid data."""
    schema = server.http.get(f"{server.base}/openapi.json", timeout=REQUEST_TIMEOUT).json()
    operations = schema_operations(schema)
    assert len(operations) >= 20, sorted(operations)
    run = schemathesis(f"{server.base}/openapi.json", tmp_path / "published",
                       "--phases", "examples,coverage,fuzzing,stateful", "--max-examples", str(PUBLISHED_EXAMPLES))
    result = figures(run, operations)
    record("schemathesis_published_schema", result)
    print(f"\nschemathesis, the published schema: {result['requests_sent']} requests, "
          f"{result['operations_exercised']}/{result['operations_in_schema']} operations, "
          f"{result['server_errors']} server errors, {result['seconds']} s; statuses {result['statuses']}")
    assert_clean(run, result, operations)
    server.assert_alive("after the published schema")


# the images a narrowed request may carry (any mode, size and format the server must read)
def _image(mode, size, fmt="PNG", data_uri=False) -> str:
    image = Image.new("RGB", size, (0, 0, 255))
    ImageDraw.Draw(image).ellipse((size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4), fill=(255, 0, 0))
    out = io.BytesIO()
    image.convert(mode).save(out, format=fmt)
    encoded = base64.b64encode(out.getvalue()).decode("ascii")
    return f"data:image/{fmt.lower()};base64,{encoded}" if data_uri else encoded


def _mask(size) -> str:
    mask = Image.new("L", size, 0)
    ImageDraw.Draw(mask).rectangle((size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4), fill=255)
    out = io.BytesIO()
    mask.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def narrowed_schema(schema: dict, samplers: list[str], schedulers: list[str]) -> dict:
    """The published schema with the generation requests' fields narrowed to what the server's limits and the
    demo model accept; the other fields stay optional and nullable, as published."""
    images = [_image("RGB", (64, 64)), _image("L", (32, 128)), _image("RGBA", (128, 32)), _image("P", (32, 32)),
              _image("RGB", (64, 64), "JPEG"), _image("RGB", (128, 64), "WEBP"), _image("RGB", (64, 64), data_uri=True)]
    masks = [_mask((64, 64)), _mask((40, 24)), _mask((16, 16))]
    prompt = {"type": "string", "maxLength": 200}
    common = {
        "prompt": prompt, "negative_prompt": prompt, "hr_prompt": prompt, "hr_negative_prompt": prompt,
        "steps": {"type": "integer", "minimum": 2, "maximum": MAX_STEPS},
        "width": {"enum": list(SIDES)}, "height": {"enum": list(SIDES)},
        "batch_size": {"type": "integer", "minimum": 1, "maximum": 2},
        "n_iter": {"type": "integer", "minimum": 1, "maximum": 1},
        "seed": {"type": "integer", "minimum": -1, "maximum": 2**32 - 3},
        "cfg_scale": {"type": "number", "minimum": 1, "maximum": 30},
        "eta": {"type": "number", "minimum": 0, "maximum": 1},
        "denoising_strength": {"type": "number", "minimum": 0.5, "maximum": 1},
        "sampler_name": {"enum": samplers}, "sampler_index": {"enum": samplers},
        "scheduler": {"enum": schedulers},
        "refiner_checkpoint": {"enum": ["None", ""]},
        "hr_scale": {"type": "number", "minimum": 1, "maximum": 2},
        "hr_second_pass_steps": {"type": "integer", "minimum": 0, "maximum": MAX_STEPS},
        "hr_upscaler": {"enum": ["Latent", "Latent (nearest)", "Lanczos", "Nearest", "None"]},
        "hr_resize_x": {"enum": [0, 64, 128]}, "hr_resize_y": {"enum": [0, 64, 128]},
        "hr_sampler_name": {"enum": samplers}, "hr_cfg": {"type": "number", "minimum": 1, "maximum": 30},
        "hr_checkpoint_name": {"enum": ["Use same checkpoint", ""]},
        "script_name": {"enum": [""]},
        "override_settings": {"type": "object", "properties": {
            "CLIP_stop_at_last_layers": {"enum": [1, 2]}, "eta_ancestral": {"type": "number", "minimum": 0,
                                                                            "maximum": 1}}},
    }
    img2img = {
        **common,
        "init_images": {"type": "array", "items": {"enum": images}, "minItems": 1, "maxItems": 2},
        "mask": {"enum": masks},
        "resize_mode": {"enum": [0, 1, 2, 3]}, "inpainting_fill": {"enum": [0, 1, 2, 3]},
        "inpainting_mask_invert": {"enum": [0, 1]},
        "mask_blur": {"type": "integer", "minimum": 0, "maximum": 16},
        "mask_blur_x": {"type": "integer", "minimum": 0, "maximum": 16},
        "mask_blur_y": {"type": "integer", "minimum": 0, "maximum": 16},
        "inpaint_full_res_padding": {"type": "integer", "minimum": 0, "maximum": 64},
    }
    narrowed = copy.deepcopy(schema)
    components = narrowed["components"]["schemas"]
    # never null: the default steps (50) are over the limit, and there is nothing to do without an image
    given = {"steps", "init_images", "image"}
    # always present, null or not (a generator leaves most optional fields out: these are the ones that matter)
    present = ["width", "height", "seed", "sampler_name", "scheduler", "cfg_scale", "batch_size"]
    for name, fields, required in (
            ("Txt2ImgRequest", common, ["steps", *present]),
            ("Img2ImgRequest", img2img, ["steps", "init_images", *present, "mask", "denoising_strength",
                                         "resize_mode", "inpainting_fill", "inpainting_mask_invert", "mask_blur"]),
            ("PngInfoRequest", {"image": {"enum": images}}, ["image"])):
        properties = components[name]["properties"]
        for field, narrow in fields.items():
            assert field in properties, (name, field)
            title = properties[field].get("title", field)
            properties[field] = {**narrow, "title": title} if field in given else \
                {"anyOf": [narrow, {"type": "null"}], "title": title}
        components[name]["required"] = required
    return narrowed


def test_schemathesis_narrowed_generation(server, tmp_path):
    """txt2img, img2img and png-info with the schema narrowed to the server's limits: mostly images made."""
    schema = server.http.get(f"{server.base}/openapi.json", timeout=REQUEST_TIMEOUT).json()
    samplers = [s["name"] for s in server.http.get(f"{server.api}/samplers", timeout=REQUEST_TIMEOUT).json()]
    schedulers = [s["name"] for s in server.http.get(f"{server.api}/schedulers", timeout=REQUEST_TIMEOUT).json()]
    samplers += ["DPM++ 2M Karras", "Euler a Exponential", "k_euler", "dpmpp_2m_karras"]
    schedulers += ["Karras", "SGM Uniform", "beta"]   # a label, and two that sdlite does not have (a warning)
    narrowed = narrowed_schema(schema, samplers, schedulers)
    operations = {op for op in schema_operations(narrowed) if re.search(r"/(txt2img|img2img|png-info)$", op[1])}
    assert len(operations) == 3
    location = tmp_path / "narrowed-openapi.json"
    location.write_text(json.dumps(narrowed))
    run = schemathesis(str(location), tmp_path / "narrowed", "--url", server.base,
                       "--include-path-regex", r"/(txt2img|img2img|png-info)$", "--mode", "positive",
                       "--phases", "fuzzing", "--max-examples", str(NARROWED_EXAMPLES))
    result = figures(run, operations)
    made = {op: counts.get("200", 0) for op, counts in result["per_operation"].items()}
    result["answered_200"] = made
    record("schemathesis_narrowed_generation", result)
    print(f"\nschemathesis, generation routes narrowed to the limits: {result['requests_sent']} requests, "
          f"{result['operations_exercised']}/{result['operations_in_schema']} operations, "
          f"{result['server_errors']} server errors, {result['seconds']} s; 200s {made}; statuses "
          f"{result['statuses']}")
    assert_clean(run, result, operations)
    # the narrowing works: most requests get past the checks and make images (or read them)
    for op, count in made.items():
        assert count >= NARROWED_EXAMPLES // 4, (op, result["per_operation"][op], run["output"][-3000:])
    server.assert_alive("after the narrowed generation")


# --- hand-written cases ----------------------------------------------------------------------------------------

HAND: dict = {}


def clear_4xx(r: requests.Response, name: str, *codes: int) -> None:
    """``r`` is a 4xx (one of ``codes`` when given) with an error body: A1111's {"error", "detail", "body",
    "errors"} or FastAPI's 422 {"detail": [...]}."""
    HAND[name] = r.status_code
    record("hand_written", HAND)
    assert 400 <= r.status_code < 500 and (not codes or r.status_code in codes), (name, r.status_code, r.text[:500])
    body = r.json()
    if set(body) == {"error", "detail", "body", "errors"}:
        assert body["error"] and body["detail"], (name, body)
    else:
        assert set(body) == {"detail"} and isinstance(body["detail"], list) and body["detail"], (name, body)
        assert all({"loc", "msg", "type"} <= set(d) for d in body["detail"]), (name, body)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png(width, height, rows: bytes, *, depth=8, colour=2, ihdr_crc_ok=True, end=True) -> bytes:
    """A PNG from its parts: the IHDR may say anything, the IDAT holds ``rows`` (filter bytes included)."""
    ihdr = _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0))
    if not ihdr_crc_ok:
        ihdr = ihdr[:-4] + b"\0\0\0\0"
    data = b"\x89PNG\r\n\x1a\n" + ihdr + _chunk(b"IDAT", zlib.compress(rows, 9))
    return data + _chunk(b"IEND", b"") if end else data


def _constant_png(width, height) -> bytes:
    """A real ``width`` x ``height`` PNG of one colour (1-bit grey), compressed row by row: 30000x30000 (900 million
    pixels, 113 MB of 1-bit rows, 2.7 GB as RGB) is about 110 KB."""
    compressor = zlib.compressobj(9)
    row = b"\0" * (1 + (width + 7) // 8)
    parts = [compressor.compress(row) for _ in range(height)]
    parts.append(compressor.flush())
    ihdr = _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + ihdr + _chunk(b"IDAT", b"".join(parts)) + _chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def image_routes(server, name: str, data: str, *codes: int) -> None:
    """``data`` as img2img's init image, as its mask, and to png-info: a clear 4xx each."""
    good = _image("RGB", (64, 64))
    clear_4xx(server.post("img2img", {"init_images": [data], "steps": 4}), f"{name}: img2img init_images", *codes)
    clear_4xx(server.post("img2img", {"init_images": [good], "mask": data, "steps": 4}), f"{name}: img2img mask",
              *codes)
    clear_4xx(server.post("png-info", {"image": data}), f"{name}: png-info", *codes)


def test_base64_bombs(server):
    bomb = _constant_png(30000, 30000)
    assert len(bomb) < 200_000
    image_routes(server, "30000x30000 PNG bomb", b64(bomb), 413)
    # over the server's own cap (8192x8192) and under Pillow's bomb warning: a few KB
    small = _constant_png(9000, 9000)
    assert len(small) < 20_000
    image_routes(server, "9000x9000 PNG (few KB)", b64(small), 413)
    # a GIF whose screen says 65535x65535
    gif = (b"GIF89a" + struct.pack("<HHBBB", 65535, 65535, 0, 0, 0)
           + b"," + struct.pack("<HHHHB", 0, 0, 65535, 65535, 0) + b"\x02\x02\x44\x01\x00;")
    image_routes(server, "65535x65535 GIF", b64(gif))
    # a base64 string over the body cap (64 MiB): refused by its Content-Length, and sent chunked (no length)
    huge = b'{"init_images": ["' + b"A" * (65 << 20) + b'"], "steps": 4}'
    clear_4xx(server.raw("img2img", huge), "65 MiB base64, Content-Length", 413)

    def chunks():
        for i in range(0, len(huge), 1 << 20):
            yield huge[i:i + (1 << 20)]

    r = server.http.post(f"{server.api}/img2img", data=chunks(), headers={"Content-Type": "application/json"},
                         timeout=REQUEST_TIMEOUT)
    clear_4xx(r, "65 MiB base64, chunked", 413)
    # not base64 at all, and base64 of something that is not an image
    clear_4xx(server.post("png-info", {"image": "%%%not base64%%%"}), "png-info: not base64", 422)
    clear_4xx(server.post("png-info", {"image": b64(b"hello" * 1000)}), "png-info: base64 of text", 422)
    server.assert_alive("after the base64 bombs")


def test_png_headers_that_lie(server):
    rows_64 = (b"\0" + b"\x80" * (3 * 64)) * 64
    # says 64x64; the file stops in the middle of its pixel data
    truncated = _png(64, 64, rows_64, end=False)
    image_routes(server, "64x64 PNG cut short", b64(truncated[:len(truncated) // 2]), 422)
    # says 100000x100000; holds one row
    image_routes(server, "100000x100000 PNG of one row", b64(_png(100000, 100000, b"\0" * 300001)), 413)
    # says 64x64 with a wrong checksum
    image_routes(server, "64x64 PNG, bad IHDR CRC", b64(_png(64, 64, rows_64, ihdr_crc_ok=False)), 422)
    # says 0x64
    image_routes(server, "0x64 PNG", b64(_png(0, 64, b"\0" * 64)), 422)
    # says 16-bit colour; holds 8-bit rows (half the data)
    image_routes(server, "16-bit PNG holding 8-bit rows", b64(_png(64, 64, rows_64, depth=16)), 422)
    # says 64x64; its compressed stream ends cleanly after 10 rows: Pillow pads the rest (black), which is no error
    short = b64(_png(64, 64, rows_64[:10 * (1 + 3 * 64)]))
    r = server.post("png-info", {"image": short})
    HAND["64x64 PNG whose data ends after 10 rows: png-info"] = r.status_code
    assert r.status_code < 500 and (r.status_code == 200 or r.json().get("detail")), r.text[:300]
    server.assert_alive("after the lying PNGs")


def test_deeply_nested_json(server):
    deep_lists = "[" * 100_000 + "]" * 100_000
    deep_objects = '{"a":' * 100_000 + "1" + "}" * 100_000
    for route, field, value in (("txt2img", "comments", deep_objects), ("txt2img", "script_args", deep_lists),
                                ("img2img", "alwayson_scripts", deep_objects), ("png-info", "image", deep_lists)):
        body = f'{{"prompt": "x", "steps": 2, "{field}": {value}}}'.encode()
        clear_4xx(server.raw(route, body), f"100000 levels in {route} {field}")
    clear_4xx(server.raw("options", deep_lists.encode()), "100000 levels: options, top level")
    clear_4xx(server.raw("options", f'{{"x": {deep_objects}}}'.encode()), "100000 levels: options value")
    # deep enough for Python's parser, too deep to be written back (a response echoes the fields): it was a 500,
    # after the image was made
    clear_4xx(server.raw("txt2img", ('{"prompt": "x", "steps": 2, "width": 64, "height": 64, "comments": '
                                     + '{"a":' * 960 + "1" + "}" * 960 + "}").encode()), "960 levels in comments", 422)
    # what real clients send (alwayson_scripts a few levels deep) still works
    r = server.post("txt2img", {"prompt": "x", "steps": 2, "width": 64, "height": 64,
                                "alwayson_scripts": {"x": {"args": [{"a": [[{"b": [1]}]]}]}}})
    assert r.status_code == 200, r.text[:300]
    server.assert_alive("after the nested JSON")


def test_json_that_python_reads_and_json_forbids(server):
    """NaN, Infinity, 1e400 and lone surrogates: each was a 500 (after the image was made), and /options kept
    them, so that every later GET /options was a 500."""
    cases = {"NaN": '{"prompt": "x", "steps": 2, "s_noise": NaN}',
             "Infinity": '{"prompt": "x", "steps": 2, "hr_scale": Infinity}',
             "1e400": '{"prompt": "x", "steps": 2, "eta": 1e400}',
             "lone surrogate": '{"prompt": "a\\ud800", "steps": 2}',
             "lone surrogate, unknown field": '{"prompt": "x", "steps": 2, "hr_upscaler": "\\udfff"}',
             "lone surrogate, wrong type": '{"steps": "\\ud800"}'}
    for name, body in cases.items():
        clear_4xx(server.raw("txt2img", body.encode()), f"txt2img {name}", 422)
    clear_4xx(server.raw("png-info", b'{"image": NaN}'), "png-info NaN", 422)
    for name, body in {"NaN": '{"zzz": NaN}', "-Infinity": '{"zzz": -Infinity}',
                       "lone surrogate value": '{"zzz": "\\ud800"}', "lone surrogate key": '{"\\udc00": 1}'}.items():
        clear_4xx(server.raw("options", body.encode()), f"options {name}", 422)
    assert server.http.get(f"{server.api}/options", timeout=REQUEST_TIMEOUT).status_code == 200
    # a surrogate pair is a character: fine
    r = server.raw("txt2img", b'{"prompt": "a \\ud83d\\ude00", "steps": 2, "width": 64, "height": 64}')
    assert r.status_code == 200, r.text[:300]
    server.assert_alive("after NaN and surrogates")


def test_tiny_and_non_json_bodies(server):
    bodies = {"'{'": (b"{", "application/json"), "'x'": (b"x", "application/json"),
              "'1'": (b"1", "application/json"), "' '": (b" ", "application/json"),
              "empty": (b"", "application/json"), "null": (b"null", "application/json"),
              "[]": (b"[]", "application/json"), '"a"': (b'"a"', "application/json"),
              "\\xff": (b"\xff", "application/json"), "text": (b"hello, world", "application/json"),
              "JSON as text/plain": (b'{"prompt": "x"}', "text/plain"),
              "form": (b"prompt=x&steps=2", "application/x-www-form-urlencoded"),
              "not UTF-8, no type": (b"\xff\xfe\x00", None), "not UTF-8 as octets": (b"\xed\xa0\x80",
                                                                                   "application/octet-stream")}
    for route in ("txt2img", "img2img", "png-info", "options"):
        for name, (body, content_type) in bodies.items():
            clear_4xx(server.raw(route, body, content_type), f"{route} body {name}")
    server.assert_alive("after the tiny bodies")


def _held(server, ports: set[int]) -> int:
    """How many connections from the client ``ports`` the server holds open."""
    process = psutil.Process(server.proc.pid)
    connections = process.net_connections("tcp") if hasattr(process, "net_connections") else process.connections("tcp")
    return sum(1 for c in connections if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED)


def test_slow_clients(server):
    """30 clients dribble requests a byte at a time (20 their headers, 10 their body) for 10 s; meanwhile a normal
    txt2img is answered promptly, with the same pixels; afterwards the server is alive and holds no connection."""
    duration, every = 10.0, 0.25
    head = (f"POST /sdapi/v1/txt2img HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
            f"X-Padding: {'p' * 200}\r\n\r\n").encode()
    body = json.dumps({"prompt": PROMPT, "steps": 2, "comments": {"pad": "p" * 2000}}).encode()
    with_body = head.replace(b"\r\n\r\n", f"\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    clients = []
    for i in range(30):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        if i < 20:
            clients.append([s, head, 0])
        else:
            s.sendall(with_body)
            clients.append([s, body, 0])
    sockets = [c[0] for c in clients]
    ports = {s.getsockname()[1] for s in sockets}
    held = 0
    stop = threading.Event()
    closed_by_server = []

    def dribble():
        while not stop.is_set():
            for client in clients:
                s, data, sent = client
                if s is None or sent >= len(data):
                    continue
                try:
                    s.sendall(data[sent:sent + 1])
                    client[2] += 1
                except OSError:
                    closed_by_server.append(sent)
                    client[0] = None
            stop.wait(every)

    worker = threading.Thread(target=dribble, daemon=True)
    t_start = time.monotonic()
    worker.start()
    try:
        wait_for(lambda: all(c[2] > 2 for c in clients), timeout=30, every=0.05)
        held = _held(server, ports)
        pixels_now, seconds = server.reference()
        progress_t0 = time.perf_counter()
        server.assert_alive()
        progress_seconds = time.perf_counter() - progress_t0
        stop.wait(max(0.0, duration - (time.monotonic() - t_start)))
    finally:
        stop.set()
        worker.join(30)
        for s in sockets:
            s.close()
    # promptly: the work of one 64x64 image (measured alone at the start), with a wide margin for a loaded machine
    bound = 20 * server.reference_seconds + 5.0
    record("slow_clients", {"clients": len(clients), "seconds": duration, "byte_every_s": every,
                            "connections_held_by_server_during": held,
                            "closed_by_server": len(closed_by_server),
                            "txt2img_during_s": round(seconds, 3),
                            "txt2img_alone_s": round(server.reference_seconds, 3),
                            "progress_during_s": round(progress_seconds, 3)})
    assert seconds < bound, (seconds, bound)
    assert np.array_equal(pixels_now, server.reference_pixels)
    assert held == len(clients)   # all of them were connected while the request ran
    wait_for(lambda: _held(server, ports) == 0, timeout=30, every=0.1)
    server.assert_alive("after the slow clients")


# --- after all of it ---------------------------------------------------------------------------------------------

ACCESS_LINE = re.compile(r'"[A-Z]+ \S+ HTTP/[\d.]+" (\d{3})')


def test_after_the_fuzzing(server):
    """No 500 anywhere in the server's log, the reference txt2img gives the same pixels, RSS within 10%."""
    server.assert_alive()
    now, seconds = server.reference()
    same = bool(np.array_equal(now, server.reference_pixels))
    rss = server.rss()
    log = server.log.read_text(errors="replace")
    statuses = collections.Counter(int(m.group(1)) for m in ACCESS_LINE.finditer(log))
    problems = [line for line in log.splitlines()
                if "Traceback" in line or "error in " in line or "Exception in ASGI" in line or "ERROR" in line]
    result = {"same_pixels_as_before": same, "rss_before_fuzzing_mb": round(server.rss_start / 2**20, 1),
              "rss_after_fuzzing_mb": round(rss / 2**20, 1), "rss_change": round(rss / server.rss_start - 1, 4),
              "server_log_requests": sum(statuses.values()),
              "server_log_statuses": {str(k): v for k, v in sorted(statuses.items())},
              "server_log_5xx": sum(v for k, v in statuses.items() if k >= 500),
              "server_log_tracebacks_or_errors": len(problems)}
    record("after", result)
    print("\nserver fuzz:", json.dumps(REPORT, indent=1))
    assert result["server_log_5xx"] == 0 and not problems, "\n".join(problems[:40])
    assert same
    assert abs(rss / server.rss_start - 1) <= RSS_TOLERANCE, result
