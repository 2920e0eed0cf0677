"""OpenAI's Images API (`sdlite serve`'s /v1) driven by the official `openai` Python client, on a server on a
loopback port, with the shipped demo model (64x64, a few steps).

The images must be the engine's own for the same settings (generations, and edits run as A1111's inpainting with
OpenAI's transparent-area mask), served as base64 or by URL; models are listed; the Bearer key of --api-key is
checked on every front-end's routes; bad input gets OpenAI's error shape with the param named, and the server goes
on serving.
"""
from __future__ import annotations

import argparse
import base64
import functools
import io
import threading

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from PIL import Image, ImageDraw

from sdlite.demo import model_path
from sdlite.pipeline import Engine, Request
from sdlite.server import create_app
from sdlite.server.limits import Limits
from sdlite.server.openai import ImageStore
from tests import loopback

KEY = "sk-test-0123456789"
PROMPT = "a red circle on a blue background"
wait_for = functools.partial(loopback.wait_for, timeout=60.0, every=0.02)


@pytest.fixture(scope="module")
def server():
    """The app on a free loopback port in a thread (uvicorn), the demo model loaded; its base URL."""
    port = loopback.free_port()
    # a queue of one waiting job (the 503 test), long jobs allowed (it holds the queue with one)
    app = create_app(api_key=KEY, queue_size=1, limits=Limits(max_steps=1000))
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: uv.started, timeout=60)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        wait_for(lambda: http.get("/sdapi/v1/progress").json()["state"]["job_count"] == 0, timeout=120)
    yield base
    uv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine():
    return Engine.load(model_path())


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def opened(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def assert_openai_error(r, status: int, param, code=None, *words):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    for word in words:
        assert word in body["error"]["message"], body
    return body["error"]


def source_and_masks():
    """A 64x64 source, OpenAI's mask (transparent = edit) of a square in the middle, and the same area as the
    white-on-black mask the engine takes."""
    source = Image.new("RGB", (64, 64), (0, 0, 255))
    ImageDraw.Draw(source).ellipse((22, 22, 42, 42), fill=(255, 0, 0))
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (16, 16, 48, 48))
    area = Image.new("L", (64, 64), 0)
    area.paste(255, (16, 16, 48, 48))
    return source, mask, area


# --- generations ----------------------------------------------------------------------------------------------------

def test_generate_b64_equals_the_engine(client, engine):
    r = client.images.generate(prompt=PROMPT, n=2, size="64x64", response_format="b64_json",
                               extra_body={"steps": 4, "seed": 21, "sampler": "Euler a", "cfg_scale": 6.5,
                                           "negative_prompt": "green"})
    assert r.created > 0 and len(r.data) == 2 and r.size == "64x64" and r.output_format == "png"
    expected = engine.generate(Request(PROMPT, negative_prompt="green", width=64, height=64, steps=4, seed=21,
                                       cfg_scale=6.5, sampler="euler_a", batch_size=2))
    for item, want, seed in zip(r.data, expected.images, (21, 22)):
        assert item.url is None
        image = opened(base64.b64decode(item.b64_json))
        assert image.format == "PNG" and image.size == (64, 64)
        assert np.array_equal(pixels(image), pixels(want)), f"seed {seed}: not the engine's pixels"
        assert f"Seed: {seed}" in image.info["parameters"] and "Steps: 4" in image.info["parameters"]


def test_generate_url_and_output_formats(client, server, engine):
    settings = dict(prompt=PROMPT, size="64x64", extra_body={"steps": 3, "seed": 5})
    by_b64 = client.images.generate(response_format="b64_json", **settings).data[0].b64_json
    r = client.images.generate(response_format="url", **settings)
    url = r.data[0].url
    assert url.startswith(f"{server}/v1/images/files/") and r.data[0].b64_json is None
    fetched = httpx.get(url, timeout=30)   # no credentials: the unguessable name is the key
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert fetched.content == base64.b64decode(by_b64)
    gone = httpx.get(url[:-8] + "AAAA.png", timeout=30)
    assert_openai_error(gone, 404, None, "not_found", "expired")

    for fmt, pil in (("jpeg", "JPEG"), ("webp", "WEBP")):
        r = client.images.generate(output_format=fmt, output_compression=90, **settings)
        image = opened(base64.b64decode(r.data[0].b64_json))
        assert image.format == pil and r.output_format == fmt
        assert np.abs(pixels(image) - pixels(opened(base64.b64decode(by_b64)))).mean() < 12   # the same picture

    # size auto: the model's native size; OpenAI's own model names and OpenAI fields sdlite ignores are accepted
    r = client.images.generate(prompt=PROMPT, size="auto", model="dall-e-3", quality="hd", style="vivid",
                               user="someone", extra_body={"steps": 2, "seed": 1})
    native = engine.spec.default_size
    assert r.size == f"{native}x{native}" and opened(base64.b64decode(r.data[0].b64_json)).size == (native, native)


def test_models_listed_and_named(client, http):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["demo"] and models.data[0].owned_by == "sdlite"
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = client.images.generate(prompt=PROMPT, model="demo", size="64x64", extra_body={"steps": 2, "seed": 3})
    assert len(r.data) == 1
    with pytest.raises(openai.NotFoundError) as e:
        client.images.generate(prompt=PROMPT, model="sd-xl-nowhere", size="64x64")
    assert "sd-xl-nowhere" in e.value.body["message"] and "demo" in e.value.body["message"]


# --- edits ----------------------------------------------------------------------------------------------------------

def test_edit_with_a_transparent_mask_is_inpainting(client, engine):
    source, mask, area = source_and_masks()
    prompt = "a yellow star on a blue background"
    r = client.images.edit(image=("source.png", png(source), "image/png"), mask=("mask.png", png(mask), "image/png"),
                           prompt=prompt, size="64x64", extra_body={"steps": 4, "seed": 9})
    image = pixels(opened(base64.b64decode(r.data[0].b64_json)))
    expected = engine.generate(Request(prompt, width=64, height=64, steps=4, seed=9, cfg_scale=7.0,
                                       sampler="dpmpp_2m", schedule="karras", init_image=source, mask=area,
                                       strength=1.0, mask_blur=4, inpaint_fill="fill", inpaint_area="whole"))
    assert np.array_equal(image, pixels(expected.images[0]))
    # outside the blurred mask the source comes back exactly; inside it was repainted
    assert np.array_equal(image[:5], pixels(source)[:5]) and np.array_equal(image[:, -5:], pixels(source)[:, -5:])
    assert np.abs(image[24:40, 24:40] - pixels(source)[24:40, 24:40]).mean() > 10

    # no mask: the image's own fully transparent pixels are the area (the same image); image[] is taken too
    transparent = source.copy()
    transparent.putalpha(mask.getchannel("A"))
    r2 = client.images.edit(image=[("t.png", png(transparent), "image/png")], prompt=prompt, size="64x64",
                            extra_body={"steps": 4, "seed": 9})
    assert np.array_equal(pixels(opened(base64.b64decode(r2.data[0].b64_json))), image)


def test_edit_without_transparency_is_image_to_image(client, engine):
    source, _, _ = source_and_masks()
    r = client.images.edit(image=("s.png", png(source), "image/png"), prompt=PROMPT, n=1,
                           extra_body={"steps": 4, "seed": 2, "strength": 0.5})
    expected = engine.generate(Request(PROMPT, steps=4, seed=2, cfg_scale=7.0, sampler="dpmpp_2m",
                                       schedule="karras", init_image=source, strength=0.5))
    assert r.size == "64x64"   # the source's size
    assert np.array_equal(pixels(opened(base64.b64decode(r.data[0].b64_json))), pixels(expected.images[0]))


# --- auth -----------------------------------------------------------------------------------------------------------

def test_the_key_is_required_on_every_front_end(server):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.get(f"{server}/v1/models", timeout=30)
    assert_openai_error(r, 401, None, "invalid_api_key", "API key")
    assert r.headers["www-authenticate"] == "Bearer"
    # A1111's routes take the same key, and answer in their own shape without it
    assert httpx.get(f"{server}/sdapi/v1/options", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    r = httpx.get(f"{server}/sdapi/v1/options", timeout=30)
    assert r.status_code == 401 and r.json()["error"] == "HTTPException"


def test_basic_and_bearer_together_either_passes():
    with TestClient(create_app(api_auth="alice:s3cret", api_key=KEY, preload=False)) as c:
        assert c.get("/sdapi/v1/options", auth=("alice", "s3cret")).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert c.get("/v1/models", auth=("alice", "s3cret")).status_code == 200
        assert c.get("/sdapi/v1/options", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/sdapi/v1/options", auth=("alice", "nope")).status_code == 401
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Basic, Bearer"
        assert "HTTP Basic" in r.json()["error"]["message"] and "Bearer" in r.json()["error"]["message"]


# --- bad input ------------------------------------------------------------------------------------------------------

def test_bad_generations_name_the_param(http):
    def post(body):
        return http.post("/v1/images/generations", json=body)

    assert_openai_error(post({}), 400, "prompt", "missing_required_parameter")
    assert_openai_error(post({"prompt": 3}), 400, "prompt", "invalid_type")
    assert_openai_error(post({"prompt": PROMPT, "n": 0}), 400, "n", None, "out of range")
    assert_openai_error(post({"prompt": PROMPT, "n": 500}), 400, "n")
    assert_openai_error(post({"prompt": PROMPT, "n": True}), 400, "n", "invalid_type")
    assert_openai_error(post({"prompt": PROMPT, "size": "big"}), 400, "size", None, "WIDTHxHEIGHT")
    assert_openai_error(post({"prompt": PROMPT, "size": "9000x9000"}), 400, "size", None, "--max-pixels")
    assert_openai_error(post({"prompt": PROMPT, "response_format": "gif"}), 400, "response_format")
    assert_openai_error(post({"prompt": PROMPT, "output_format": "svg"}), 400, "output_format")
    assert_openai_error(post({"prompt": PROMPT, "output_compression": 101}), 400, "output_compression")
    assert_openai_error(post({"prompt": PROMPT, "background": "transparent"}), 400, "background", None, "opaque")
    assert_openai_error(post({"prompt": PROMPT, "stream": True}), 400, "stream")
    assert_openai_error(post({"prompt": PROMPT, "stream": 0}), 400, "stream")   # equal to false, not false
    assert_openai_error(post({"prompt": PROMPT, "response_format": {}}), 400, "response_format")
    assert_openai_error(post({"prompt": PROMPT, "sampler_name": "Euler"}), 400, "sampler_name", "unknown_parameter")
    assert_openai_error(post({"prompt": PROMPT, "steps": "many"}), 400, "steps", "invalid_type")
    assert_openai_error(post({"prompt": PROMPT, "steps": 5000}), 400, "steps", None, "--max-steps")
    assert_openai_error(post({"prompt": PROMPT, "seed": -7}), 400, "seed")
    assert_openai_error(post({"prompt": PROMPT, "sampler": "nope", "size": "64x64"}), 400, "sampler", None,
                        "not known")
    assert_openai_error(post({"prompt": PROMPT, "cfg_scale": "x"}), 400, "cfg_scale", "invalid_type")
    assert_openai_error(post({"prompt": "x" * 20_000}), 400, "prompt", None, "--max-prompt-chars")
    assert_openai_error(post([1, 2]), 400, None, "invalid_json")
    bad_json = http.post("/v1/images/generations", content=b'{"prompt": NaN}',
                         headers={"Content-Type": "application/json"})
    assert_openai_error(bad_json, 400, None, "invalid_json", "NaN")
    broken = http.post("/v1/images/generations", content=b"{", headers={"Content-Type": "application/json"})
    assert_openai_error(broken, 400, None, "invalid_json")
    assert_openai_error(http.get("/v1/images/generations"), 405, None)
    assert http.post("/v1/images/generations", json={"prompt": PROMPT, "size": "64x64", "steps": 2}).status_code == 200


def test_the_routes_are_published_with_their_bodies(http):
    """/openapi.json describes the four routes (what tests/test_server_fuzz.py fuzzes): the generation's JSON body
    and the edit's form with this server's limits, the answers and OpenAI's error shape; what the schema refuses,
    the server refuses with a 400."""
    schema = http.get("/openapi.json").json()
    assert {(method.upper(), path) for path, item in schema["paths"].items() for method in item
            if path.startswith("/v1/")} == {("POST", "/v1/images/generations"), ("POST", "/v1/images/edits"),
                                            ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}")}
    generations = schema["paths"]["/v1/images/generations"]["post"]
    body = jsonschema.Draft202012Validator(generations["requestBody"]["content"]["application/json"]["schema"])
    assert body.is_valid({"prompt": PROMPT, "n": 2, "size": "64x64", "response_format": None, "steps": 1000,
                          "seed": -1, "sampler": "Euler a", "quality": "high", "user": "me"})
    for param, bad in (("prompt", {"n": 1}), ("sampler_name", {"sampler_name": "Euler"}), ("steps", {"steps": 1001}),
                       ("stream", {"stream": True}), ("size", {"size": "big"}), ("n", {"n": 0}),
                       ("background", {"background": "transparent"}), ("output_format", {"output_format": "gif"})):
        bad = bad if param == "prompt" else {"prompt": PROMPT, **bad}
        assert not body.is_valid(bad), bad
        assert_openai_error(http.post("/v1/images/generations", json=bad), 400, param)
    assert set(generations["responses"]) == {"200", "400", "401", "404", "413", "503"}
    error = jsonschema.Draft202012Validator(generations["responses"]["400"]["content"]["application/json"]["schema"])
    assert error.is_valid(http.post("/v1/images/generations", json={}).json())
    form = schema["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["required"] == ["image", "prompt"] and form["additionalProperties"] is False
    assert form["properties"]["image"]["format"] == form["properties"]["mask"]["format"] == "binary"
    models = schema["paths"]["/v1/models/{model_id}"]["get"]
    assert set(models["responses"]) == {"200", "401", "404"}   # no FastAPI 422: /v1 answers 400s in OpenAI's shape
    listed = jsonschema.Draft202012Validator(schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"])
    assert listed.is_valid(http.get("/v1/models").json())


def test_bad_edits_name_the_param(http):
    source, mask, _ = source_and_masks()

    def post(files, **fields):
        return http.post("/v1/images/edits", files=files, data={"prompt": PROMPT, "steps": "2", **fields})

    image = ("image", ("s.png", png(source), "image/png"))
    assert_openai_error(post([]), 400, "image", "missing_required_parameter")
    assert_openai_error(post([image, ("image[]", ("t.png", png(source), "image/png"))]), 400, "image", None,
                        "one image")
    assert_openai_error(post([image, ("mask", ("m.png", png(source), "image/png"))]), 400, "mask", None,
                        "alpha channel")
    opaque = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    assert_openai_error(post([image, ("mask", ("m.png", png(opaque), "image/png"))]), 400, "mask", None,
                        "nothing to edit")
    small = mask.resize((32, 32))
    assert_openai_error(post([image, ("mask", ("m.png", png(small), "image/png"))]), 400, "mask", None,
                        "same size")
    assert_openai_error(post([("image", ("x.png", b"not an image", "image/png"))]), 400, "image")
    assert_openai_error(post([image], n="two"), 400, "n", "invalid_type")
    assert_openai_error(post([image], markup="x"), 400, "markup")
    assert_openai_error(post([image], strength="0"), 400, "strength")
    as_json = http.post("/v1/images/edits", json={"prompt": PROMPT, "image": "abc"})
    assert_openai_error(as_json, 400, None, "invalid_content_type", "multipart/form-data")
    assert post([image], n="1").status_code == 200


def test_body_cap_and_the_url_store_bounds():
    with TestClient(create_app(max_body_bytes=50_000, preload=False)) as c:
        big = Image.effect_noise((256, 256), 60).convert("RGB")   # a PNG of ~180 kB
        r = c.post("/v1/images/edits", files={"image": ("big.png", png(big), "image/png")}, data={"prompt": PROMPT})
        assert_openai_error(r, 413, None, "request_too_large", "50000")
        r = c.post("/v1/images/generations", json={"prompt": "x" * 60_000})
        assert_openai_error(r, 413, None, "request_too_large")
        assert c.get("/v1/models").json()["data"][0]["id"] == "demo"   # no auth configured: open

    store = ImageStore(ttl=60, max_bytes=10, max_count=3)
    names = [store.put(bytes([i]) * 4, "image/png", "png") for i in range(4)]
    assert store.get(names[0]) is None and store.get(names[1]) is None   # over 10 bytes: the oldest dropped
    assert store.get(names[3]) == (bytes([3]) * 4, "image/png") and len(set(names)) == 4
    gone = ImageStore(ttl=0.0)
    assert gone.get(gone.put(b"x", "image/png", "png")) is None   # expired at once


def test_listen_needs_a_credential(monkeypatch):
    from sdlite.cli import serve
    from sdlite.errors import SDLiteError

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    with pytest.raises(SDLiteError, match="--api-key KEY"):
        serve.cmd_serve(parser.parse_args(["serve", "--listen"]))
    with pytest.raises(SDLiteError, match="non-empty and hold no spaces"):
        serve.cmd_serve(parser.parse_args(["serve", "--listen", "--api-key", "two words"]))
    monkeypatch.setenv(serve.API_KEY_ENV, "a b")   # the variable is read as --api-key is, and checked the same
    with pytest.raises(SDLiteError, match="non-empty and hold no spaces"):
        serve.cmd_serve(parser.parse_args(["serve", "--listen"]))


def test_a_full_queue_is_503_in_openai_shape(http):
    results = []
    running = threading.Thread(target=lambda: results.append(
        http.post("/sdapi/v1/txt2img", json={"prompt": PROMPT, "steps": 400, "seed": 1})))
    running.start()
    wait_for(lambda: http.get("/sdapi/v1/progress").json()["state"]["sampling_step"] > 0)
    queued = threading.Thread(target=lambda: results.append(
        http.post("/v1/images/generations", json={"prompt": PROMPT, "size": "64x64", "steps": 2, "seed": 1})))
    queued.start()
    wait_for(lambda: "1 job waiting" in (http.get("/sdapi/v1/progress").json()["textinfo"] or ""))
    r = http.post("/v1/images/generations", json={"prompt": PROMPT, "size": "64x64", "steps": 2})
    assert_openai_error(r, 503, None, "queue_full", "queue is full")
    assert int(r.headers["retry-after"]) >= 1
    http.post("/sdapi/v1/interrupt")
    running.join(60)
    queued.join(60)
    assert sorted(r.status_code for r in results) == [200, 200]
