"""ComfyUI's API as a real client uses it: `comfy-api-simplified` (PyPI), a client ComfyUI users script with, against
`sdlite serve` running as a process on 127.0.0.1 behind HTTP Basic auth (the client's user and password, on the
routes and in the websocket's URL).

The client queues API-format workflows on the shipped demo model and takes their images as it does from ComfyUI
(from the websocket's binary frames if any come, else /history and /view): text to image, which must equal `sdlite
generate --noise comfy` with the same settings pixel for pixel; a LoRA workflow, a ControlNet workflow, image to
image and inpainting from images uploaded through the client, each equal to sdlite's own engine (its Python API, in
this process) for the same settings. The websocket's event sequence for a prompt is checked on a socket of our own
with the client's id. With no ``--preview-method`` the server sends no live previews, as ComfyUI by default, so the
client's images are the saved ones.
"""
from __future__ import annotations

import base64
import io
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from comfy_api_simplified import ComfyApiWrapper
from websockets.sync.client import connect

from tests.loopback import serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # the tiny demo model: one torch thread, as the server

USER, PASSWORD = "comfy", "s3cret"
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry"
SIZE, STEPS, CFG, SEED = 64, 4, 6.0, 11
WAIT_S = 120


def graph(seed: int = SEED, latent: dict | None = None, denoise: float = 1.0, sampler: str = "euler",
          scheduler: str = "normal") -> dict:
    """An API-format workflow with the titles ComfyUI's exports carry (the client finds its output node by title)."""
    nodes = {
        "4": ("CheckpointLoaderSimple", {"ckpt_name": "demo"}),
        "6": ("CLIPTextEncode", {"text": PROMPT, "clip": ["4", 1]}),
        "7": ("CLIPTextEncode", {"text": NEGATIVE, "clip": ["4", 1]}),
        "5": ("EmptyLatentImage", {"width": SIZE, "height": SIZE, "batch_size": 1}),
        "3": ("KSampler", {"seed": seed, "steps": STEPS, "cfg": CFG, "sampler_name": sampler, "scheduler": scheduler,
                           "denoise": denoise, "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                           "latent_image": latent or ["5", 0]}),
        "8": ("VAEDecode", {"samples": ["3", 0], "vae": ["4", 2]}),
        "9": ("SaveImage", {"filename_prefix": "client", "images": ["8", 0]}),
    }
    titles = {"3": "KSampler", "9": "Save Image"}
    return {k: {"class_type": c, "inputs": i, "_meta": {"title": titles.get(k, c)}} for k, (c, i) in nodes.items()}


def pixels(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im.convert("RGB"))


def only_image(images: dict) -> np.ndarray:
    assert len(images) == 1, f"expected one image, got {list(images)}"
    (png,) = images.values()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"   # the saved PNG, not a JPEG preview frame
    image = pixels(png)
    assert image.shape == (SIZE, SIZE, 3) and image.std() > 5   # a picture, not a flat fill
    return image


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A source image for image to image, and the same with its right half transparent (LoadImage's mask)."""
    folder = tmp_path_factory.mktemp("client-src")
    rng = np.random.default_rng(5)
    image = Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    image.save(folder / "src.png")
    holed = image.convert("RGBA")
    alpha = np.full((SIZE, SIZE), 255, np.uint8)
    alpha[:, SIZE // 2:] = 0
    holed.putalpha(Image.fromarray(alpha))
    holed.save(folder / "holed.png")
    return folder


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("client-server")
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    with serve(["--comfy-dir", str(folder / "comfy"), "--api-auth", f"{USER}:{PASSWORD}"], folder / "serve.log",
               "/system_stats", headers={"Authorization": f"Basic {auth}"}) as base:
        yield base


@pytest.fixture(scope="module")
def api(url):
    return ComfyApiWrapper(url, user=USER, password=PASSWORD)


@pytest.fixture(scope="module")
def engine():
    from sdlite.demo import model_path
    from sdlite.pipeline import Engine

    return Engine.load(model_path())


def request(**fields):
    from sdlite.pipeline import Request

    return Request(prompt=PROMPT, negative_prompt=NEGATIVE, width=SIZE, height=SIZE, steps=STEPS, cfg_scale=CFG,
                   sampler="euler", schedule="normal", seed=SEED, noise="comfy").replace(**fields)


def test_txt2img_equals_sdlite_generate(api, tmp_path):
    got = only_image(api.queue_and_wait_images(graph(), "Save Image"))
    out = tmp_path / "generate.png"
    subprocess.run([sys.executable, "-m", "sdlite", "generate", PROMPT, "--negative", NEGATIVE, "--width", str(SIZE),
                    "--height", str(SIZE), "--steps", str(STEPS), "--cfg", str(CFG), "--sampler", "euler",
                    "--schedule", "normal", "--noise", "comfy", "--seed", str(SEED), "--threads", "1",
                    "--output", str(out)], check=True, capture_output=True, timeout=WAIT_S)
    want = pixels(out.read_bytes())
    assert got.shape == (SIZE, SIZE, 3)
    assert np.array_equal(got, want)


def test_websocket_events_and_the_history_as_the_client_reads_them(api, url):
    """The client's own calls (queue_prompt with its id, get_history, get_image), and the events ComfyUI sends that
    id: status, execution_start, execution_cached, executing per node, progress per step, executed for the output,
    execution_success and the final executing with node null."""
    client_id = "sdlite-test-client"
    ws_url = url.replace("http://", f"ws://{USER}:{PASSWORD}@") + f"/ws?clientId={client_id}"
    with connect(ws_url, open_timeout=WAIT_S) as ws:
        assert json.loads(ws.recv(timeout=WAIT_S))["type"] == "status"
        prompt_id = api.queue_prompt(graph(seed=SEED + 1), client_id)["prompt_id"]
        events = []
        while True:
            message = ws.recv(timeout=WAIT_S)
            assert isinstance(message, str), "a binary preview frame without --preview-method"
            event = json.loads(message)
            events.append(event)
            if event["type"] == "executing" and event["data"]["node"] is None:
                break
    kinds = [e["type"] for e in events if e["type"] != "status"]
    assert kinds[:2] == ["execution_start", "execution_cached"] and kinds[-3:] == ["executed", "execution_success",
                                                                                  "executing"]
    assert all(e["data"]["prompt_id"] == prompt_id for e in events if e["type"] != "status")
    ran = [e["data"]["node"] for e in events if e["type"] == "executing"][:-1]
    assert ran.index("3") < ran.index("8") < ran.index("9")
    assert [e["data"]["value"] for e in events if e["type"] == "progress"] == list(range(1, STEPS + 1))
    executed = next(e["data"] for e in events if e["type"] == "executed")
    history = api.get_history(prompt_id)[prompt_id]
    assert history["status"]["status_str"] == "success"
    saved = history["outputs"]["9"]["images"]
    assert executed["node"] == "9" and executed["output"]["images"] == saved
    image = pixels(api.get_image(saved[0]["filename"], saved[0]["subfolder"], saved[0]["type"]))
    assert image.shape == (SIZE, SIZE, 3) and image.std() > 5
    assert api.get_queue() == {"queue_running": [], "queue_pending": []}


def test_lora_workflow_equals_the_engine(api, engine):
    from sdlite.adapters.lora_files import find_lora

    prompt = graph()
    prompt["10"] = {"class_type": "LoraLoader", "inputs": {"model": ["4", 0], "clip": ["4", 1],
                                                           "lora_name": "demo_teal.safetensors",
                                                           "strength_model": 0.7, "strength_clip": 0.7}}
    prompt["3"]["inputs"]["model"] = ["10", 0]
    prompt["6"]["inputs"]["clip"] = prompt["7"]["inputs"]["clip"] = ["10", 1]
    got = only_image(api.queue_and_wait_images(prompt, "Save Image"))
    want = np.asarray(engine.generate(request(loras=((find_lora("demo_teal"), 0.7),))).images[0])
    assert np.array_equal(got, want)
    assert not np.array_equal(got, np.asarray(engine.generate(request()).images[0]))


def test_controlnet_workflow_equals_the_engine(api, engine, source):
    from sdlite.control import ControlUnit
    from sdlite.server.a1111.controlnet import ControlNets

    uploaded = api.upload_image(source / "src.png", subfolder="client")
    name = f"{uploaded['subfolder']}/{uploaded['name']}"
    prompt = graph()
    prompt["12"] = {"class_type": "LoadImage", "inputs": {"image": name}}
    prompt["30"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": "demo-position"}}
    prompt["31"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
        "positive": ["6", 0], "negative": ["7", 0], "control_net": ["30", 0], "image": ["12", 0], "strength": 0.8,
        "start_percent": 0.0, "end_percent": 0.75}}
    prompt["3"]["inputs"]["positive"], prompt["3"]["inputs"]["negative"] = ["31", 0], ["31", 1]
    got = only_image(api.queue_and_wait_images(prompt, "Save Image"))
    with Image.open(source / "src.png") as im:
        unit = ControlUnit(model=ControlNets(None).resolve("demo-position", "test"), image=im.convert("RGB"),
                           weight=0.8, guidance_start=0.0, guidance_end=0.75, preprocessor="none",
                           resize_mode="crop-and-resize")
    want = np.asarray(engine.generate(request(controls=(unit,))).images[0])
    assert np.array_equal(got, want)


def _engine_from_latents(engine, latents, mask=None, denoise=1.0, **fields) -> np.ndarray:
    """sdlite's engine sampling given latents as ComfyUI's KSampler does, decoded as VAEDecode + SaveImage."""
    from sdlite.pipeline.latents import LatentRun
    from sdlite.server.comfy import images as comfy_images

    result = engine.sample_latents(request(**fields), LatentRun(latents, mask=mask, denoise=denoise))
    return np.asarray(comfy_images.to_pil(comfy_images.decoded_to_image(engine.decode_scaled(result.latents)))[0])


def _encoded(engine, image: np.ndarray) -> torch.Tensor:
    """VAEEncode of an RGB image (H, W, 3) in 0..1."""
    vae_in = torch.from_numpy(image).float().permute(2, 0, 1)[None] * 2.0 - 1.0
    return engine.encode_image(vae_in, None).cpu().float()


def test_img2img_workflow_equals_the_engine(api, engine, source):
    uploaded = api.upload_image(source / "src.png", subfolder="client")
    name = f"{uploaded['subfolder']}/{uploaded['name']}"
    prompt = graph(latent=["13", 0], denoise=0.55, sampler="dpmpp_2m", scheduler="karras")
    prompt["12"] = {"class_type": "LoadImage", "inputs": {"image": name}}
    prompt["13"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["12", 0], "vae": ["4", 2]}}
    got = only_image(api.queue_and_wait_images(prompt, "Save Image"))
    with Image.open(source / "src.png") as im:
        image = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
    want = _engine_from_latents(engine, _encoded(engine, image), denoise=0.55, sampler="dpmpp_2m",
                                schedule="karras")
    assert np.array_equal(got, want)


def test_inpaint_workflow_equals_the_engine(api, engine, source):
    """LoadImage of a PNG with a transparent half (its mask), SetLatentNoiseMask on the encoded image: the half is
    repainted, the rest kept at the source's latents."""
    uploaded = api.upload_image(source / "holed.png", subfolder="client")
    name = f"{uploaded['subfolder']}/{uploaded['name']}"
    prompt = graph(latent=["14", 0], denoise=0.9)
    prompt["12"] = {"class_type": "LoadImage", "inputs": {"image": name}}
    prompt["13"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["12", 0], "vae": ["4", 2]}}
    prompt["14"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["13", 0], "mask": ["12", 1]}}
    got = only_image(api.queue_and_wait_images(prompt, "Save Image"))
    with Image.open(source / "holed.png") as im:
        rgba = np.asarray(im.convert("RGBA"), dtype=np.float32) / 255.0
    mask = torch.from_numpy(1.0 - rgba[..., 3])[None, None]   # ComfyUI's mask: 1 where transparent
    want = _engine_from_latents(engine, _encoded(engine, rgba[..., :3]), mask=mask, denoise=0.9)
    assert np.array_equal(got, want)
    kept = np.abs(got[:, : SIZE // 2 - 8].astype(float) - rgba[:, : SIZE // 2 - 8, :3] * 255).mean()
    repainted = np.abs(got[:, SIZE // 2 + 8:].astype(float) - rgba[:, SIZE // 2 + 8:, :3] * 255).mean()
    assert kept < repainted
