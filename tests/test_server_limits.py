"""Issue 23's bounds on the work one request may ask of `sdlite serve`: the per-request limits (422 naming the field,
its value and the limit, answered before anything is queued), the job time limit, memory admission (503 when a job
does not fit now, 422 when it never could) and the pieces a large batch runs in (the same images bit for bit).

In-process through FastAPI's TestClient, on the shipped demo model."""
from __future__ import annotations

import base64
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastapi.testclient import TestClient

from sdlite.demo import model_path
from sdlite.engine import budget
from sdlite.pipeline import Engine, Request, validate
from sdlite.server import create_app
from sdlite.server.limits import Limits, NeverFits, NotEnoughMemoryNow, admit, parse_size
from tests import loopback

API = "/sdapi/v1"
PROMPT = "a red circle on a blue background"
MB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def idle(c) -> bool:
    return c.get(f"{API}/progress").json()["state"]["job_count"] == 0


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app()) as c:
        loopback.wait_for(lambda: idle(c), timeout=120, every=0.05)   # the model is loaded
        yield c


@pytest.fixture(scope="module")
def engine():
    return Engine.load(model_path())


def b64png(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def refused(c, body, path="txt2img"):
    t0 = time.perf_counter()
    r = c.post(f"{API}/{path}", json=body)
    seconds = time.perf_counter() - t0
    assert r.status_code == 422, r.text
    assert set(r.json()) == {"error", "detail", "body", "errors"} and r.json()["error"] == "LimitExceeded"
    return r.json()["detail"], seconds


@pytest.mark.parametrize("body, words", [
    ({"width": 20000, "height": 20000}, ["width x height", "20000 x 20000", "400000000", "4194304", "--max-pixels"]),
    ({"width": 4096, "height": 4096}, ["width x height", "4096 x 4096", "16777216", "4194304", "--max-pixels"]),
    ({"batch_size": 64, "n_iter": 100}, ["batch_size x n_iter", "64 x 100", "6400", "16", "--max-images"]),
    ({"prompt": "x" * 100_000}, ["prompt", "100000 characters", "10000", "--max-prompt-chars"]),
    ({"negative_prompt": "y" * 10_001}, ["negative_prompt", "10001 characters", "--max-prompt-chars"]),
    ({"steps": 151}, ["steps=151", "150", "--max-steps"]),
])
def test_requests_over_the_default_limits_get_422_at_once(client, body, words):
    detail, seconds = refused(client, {"prompt": PROMPT, **body})
    for word in words:
        assert word in detail, detail
    # refused before the queue: no job was started, and the answer came at once (the bound is generous, for a busy
    # machine; the time is printed with -s)
    assert idle(client)
    print(f"\n{json.dumps(body)[:60]}: 422 in {seconds * 1000:.1f} ms")
    assert seconds < 2.0


def test_limits_are_shown_in_cmd_flags(client):
    flags = client.get(f"{API}/cmd-flags").json()
    assert flags["max_pixels"] == 2048 * 2048 and flags["max_steps"] == 150 and flags["max_images"] == 16
    assert flags["max_prompt_chars"] == 10_000 and flags["job_timeout"] == 0 and flags["shutdown_grace"] == 30
    assert flags["max_memory_mb"] == 0 and flags["memory_margin_mb"] == 0


def test_img2img_source_size_counts_when_no_size_is_given():
    limits = Limits(max_pixels=parse_size("64x64"))
    with TestClient(create_app(limits=limits, preload=False)) as c:
        big = b64png(Image.new("RGB", (128, 96), (0, 0, 255)))
        detail, _ = refused(c, {"prompt": PROMPT, "init_images": [big]}, "img2img")
        assert "init_images[0]" in detail and "128 x 96" in detail and "4096" in detail
        # within the limit when the size asked for is small
        r = c.post(f"{API}/img2img", json={"prompt": PROMPT, "init_images": [big], "width": 64, "height": 64,
                                           "steps": 2})
        assert r.status_code == 200, r.text
        assert c.get(f"{API}/cmd-flags").json()["max_pixels"] == 4096


def test_native_size_counts_when_no_size_is_given():
    """The demo's native size is 64x64: a limit below it refuses a request that gives no size, once the model is
    known (in the job)."""
    with TestClient(create_app(limits=Limits(max_pixels=32 * 32))) as c:
        detail, _ = refused(c, {"prompt": PROMPT, "steps": 2})
        assert "native size" in detail and "64 x 64" in detail


def test_flags_are_checked():
    for bad in ({"max_pixels": 0}, {"max_steps": -1}, {"max_steps": 1001}, {"max_images": 1.5}, {"job_timeout": -1},
                {"shutdown_grace": float("nan")}, {"max_memory_mb": -5}):
        with pytest.raises(ValueError) as e:
            Limits(**bad)
        assert "--" + next(iter(bad)).replace("_mb", "").replace("_", "-") in str(e.value)
    assert parse_size("2048x1024") == 2048 * 1024 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="--max-pixels"):
        parse_size("big")


def test_job_timeout_returns_the_partial_image_with_a_warning():
    with TestClient(create_app(limits=Limits(job_timeout=1.0, max_steps=1000))) as c:
        loopback.wait_for(lambda: idle(c), timeout=120, every=0.05)
        t0 = time.perf_counter()
        r = c.post(f"{API}/txt2img", json={"prompt": PROMPT, "steps": 1000, "n_iter": 3, "seed": 5})
        seconds = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        info = json.loads(r.json()["info"])
        assert any("--job-timeout" in w and "1 s" in w for w in info["warnings"]), info["warnings"]
        assert any(w.startswith("stopped after step") for w in info["warnings"]), info["warnings"]
        assert any("1 of 3 iterations" in w for w in info["warnings"]), info["warnings"]
        assert len(r.json()["images"]) == 1
        assert Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))).size == (64, 64)
        # 3 x 1000 steps take far longer than the limit; the job stopped within a few steps of it
        assert seconds < 60
        assert c.get(f"{API}/cmd-flags").json()["job_timeout"] == 1.0
        # the next job runs whole, with no warning
        r = c.post(f"{API}/txt2img", json={"prompt": PROMPT, "steps": 3, "seed": 5})
        assert json.loads(r.json()["info"])["warnings"] == []


# --- memory admission ------------------------------------------------------------------------------------------

def test_admission_refuses_what_does_not_fit_now_or_ever(engine):
    request = Request(PROMPT, width=512, height=512, batch_size=2, cfg_scale=7.0)
    sized = validate(request, 64)
    need = budget.estimate(engine, sized.height, sized.width, sized.batch_size, cfg=sized.cfg_scale > 1.0,
                           encode=sized.init_image is not None).peak
    limits = Limits(memory_margin_mb=100)
    plenty = budget.Memory(available=need + 200 * MB, total=need + 4000 * MB)
    assert admit(engine, request, limits, memory=plenty, rss=1000 * MB).peak == need
    # fits in the machine, but not in what is free now: 503, with the figures
    busy = budget.Memory(available=need + 50 * MB, total=need + 4000 * MB)
    with pytest.raises(NotEnoughMemoryNow) as e:
        admit(engine, request, limits, memory=busy, rss=1000 * MB)
    assert "not enough memory for this job now" in str(e.value) and f"{need // MB} MB" in str(e.value)
    assert e.value.retry_after > 0
    # never: more than all the memory, less what the server holds and the margin: 422
    small = budget.Memory(available=need, total=need + 1000 * MB)
    with pytest.raises(NeverFits) as e:
        admit(engine, request, limits, memory=small, rss=1000 * MB)
    assert "can never give it" in str(e.value) and "512x512, batch 2" in str(e.value)
    # --max-memory caps both
    with pytest.raises(NeverFits, match="--max-memory"):
        admit(engine, request, Limits(max_memory_mb=1100, memory_margin_mb=10), memory=plenty, rss=1000 * MB)


def test_admission_over_http_with_max_memory():
    rss = budget.process_rss() // MB
    limits = Limits(max_memory_mb=rss + 600, memory_margin_mb=50)
    with TestClient(create_app(limits=limits)) as c:
        loopback.wait_for(lambda: idle(c), timeout=120, every=0.05)
        assert c.post(f"{API}/txt2img", json={"prompt": PROMPT, "steps": 2}).status_code == 200
        r = c.post(f"{API}/txt2img", json={"prompt": PROMPT, "steps": 2, "width": 2048, "height": 2048,
                                           "batch_size": 4})
        assert r.status_code == 422 and r.json()["error"] == "NeverFits", r.text
        assert "--max-memory" in r.json()["detail"]
        assert idle(c)


def test_estimate_is_not_below_the_measured_peak():
    """In a fresh process (bench/admission.py's measurement): the estimate of a whole generation's peak is at least
    the peak RSS measured above the RSS before it, and not wildly above it."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import admission
    finally:
        sys.path.pop(0)
    for width, batch in ((256, 2), (512, 1)):
        r = admission.measure_in_fresh_process(str(model_path()), width, width, batch, timeout=600)
        print(f"\n{width}^2 batch {batch}: estimate {r['estimate'] / MB:.0f} MB, measured {r['measured'] / MB:.0f} MB")
        assert r["measured"] <= r["estimate"] <= 4 * r["measured"] + 100 * MB, r


# --- pieces ------------------------------------------------------------------------------------------------------

def test_a_batch_in_pieces_gives_each_piece_sized_batch_bit_for_bit(engine):
    """A batch cut into pieces (here forced: pieces of 2 for the UNet, 1 for the decoder) gives, image for image,
    exactly what batches of the piece's size starting at the same seeds give: each piece is computed as such a
    batch is."""
    r = Request(PROMPT, steps=4, seed=10, batch_size=4, sampler="euler_a", negative_prompt="blurry")
    try:
        engine.unet_piece_bytes = 2 * budget.unet_call_bytes(engine, 2, 64) - 2 * budget.UNET_FIXED
        engine.decode_piece_bytes = 1
        assert budget.pieces(engine, 64, 64, 4, cfg=True) == (2, 1)
        pieced = engine.generate(r)
        halves = [engine.generate(r.replace(seed=10 + 2 * k, batch_size=2)) for k in range(2)]
    finally:
        engine.unet_piece_bytes = engine.decode_piece_bytes = None
    assert pieced.seeds == [10, 11, 12, 13]
    for i in range(4):
        half = halves[i // 2]
        assert torch.equal(pieced.latents[i], half.latents[i % 2]), i
        assert np.array_equal(np.asarray(pieced.images[i]), np.asarray(half.images[i % 2])), i


def test_pieces_follow_the_size_not_the_free_memory(engine):
    assert budget.pieces(engine, 64, 64, 16) == (16, 16)      # the demo's usual requests: one call, as before
    unet_piece, decode_piece = budget.pieces(engine, 2048, 2048, 4)
    assert 1 <= unet_piece < 4 and decode_piece < 4
    est = budget.estimate(engine, 2048, 2048, 4)
    assert (est.unet_piece, est.decode_piece) == (unet_piece, decode_piece)
    whole_batch_unet = budget.unet_call_bytes(engine, 2 * 4, 256 * 256)
    assert est.phases["sampling"] < whole_batch_unet
