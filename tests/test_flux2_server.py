"""FLUX.2 [klein] on the server's front-ends, on the tiny random klein of :mod:`tests.test_flux2_pipeline` written as a
diffusers folder ``klein`` under the models folder.

* OpenAI's ``/v1/images/edits`` without a mask: the uploaded ``image`` (and ``image[]``) are the reference images
  (instruction editing from noise, the family's 4 steps): the engine's image with those references, not the
  text-only one, at the first image's size.
* A1111's ``/sdapi/v1/img2img``: ``init_images[0]`` is the init image and the first reference, the others follow.
* MCP's ``edit_image``: the engine's edit; a model that does not edit from references refuses it, saying so.
* ComfyUI: the klein templates' graph in its KSampler form (UNETLoader, CLIPLoader type flux2, VAELoader,
  EmptyFlux2LatentImage) is the engine's image of the files; with LoadImage, VAEEncode and ReferenceLatent it is the
  engine's edit of that image; Flux2Scheduler's sigmas are FLUX.2's shifted schedule.
"""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from sdlite.pipeline import Engine, Request
from tests import test_flux2_pipeline as tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "make the circle red"
OPTIONS = {"precision": "exact"}
DEFAULTS = dict(steps=4, cfg_scale=1.0, sampler="euler")   # the distilled klein's (Flux2Family.sampling_defaults)
# the release's 128-wide heads and rotary split (a single file's shapes cannot tell them) and 32 norm groups
TRANSFORMER = dict(tiny.TRANSFORMER, attention_head_dim=128, num_attention_heads=1, axes_dims_rope=(32, 32, 32, 32))
VAE = dict(tiny.VAE, block_out_channels=(32, 32, 32, 32), norm_num_groups=32)
UNET, QWEN, AE = "flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"
FIRST, SECOND = tiny._image(96, 64, 1), tiny._image(64, 64, 2)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from fastapi.testclient import TestClient

    from sdlite.demo import model_path
    from sdlite.server.app import build_app
    from sdlite.server.backend import Server

    from safetensors.torch import save_file

    from tests.test_flux2_files import _bfl, _original_vae, _state

    models = tmp_path_factory.mktemp("flux2-server") / "models"
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (models / sub).mkdir(parents=True)
    pipe = tiny._pipeline(models / "klein", transformer=TRANSFORMER, vae=VAE)   # and ComfyUI's files of it: BFL's names,
    save_file(_bfl(_state(pipe.transformer)), models / "diffusion_models" / UNET)
    save_file({"model." + k: v for k, v in _state(pipe.text_encoder).items()},   # Qwen3 under model.
              models / "text_encoders" / QWEN)
    save_file(_original_vae(_state(pipe.vae)), models / "vae" / AE)
    server = Server(model_path(), models, preload=False, engine_options=OPTIONS)
    with TestClient(build_app(server)) as c:
        yield c, server, Engine.load(models / "klein", **OPTIONS)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _b64(image: Image.Image) -> str:
    return base64.b64encode(_png(image)).decode("ascii")


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _own(engine, **kw) -> np.ndarray:
    return np.asarray(engine.generate(Request(**{"prompt": PROMPT, **DEFAULTS, **kw})).images[0])


def _edit(c, images, **fields):
    files = [(name, (f"{i}.png", _png(im), "image/png")) for i, (name, im) in enumerate(images)]
    return c.post("/v1/images/edits", files=files, data={"prompt": PROMPT, "model": "klein", **fields})


def test_openai_edit_takes_the_image_as_the_reference(env):
    c, _, engine = env
    r = _edit(c, [("image", FIRST)], seed="3")
    assert r.status_code == 200, r.text
    assert r.json()["size"] == "96x64"
    got = _pixels(r.json()["data"][0]["b64_json"])
    assert got.shape == (64, 96, 3)
    assert np.array_equal(got, _own(engine, seed=3, reference_images=(FIRST,)))
    assert not np.array_equal(got, _own(engine, seed=3, width=96, height=64))


def test_openai_edit_takes_several_images_as_references(env):
    c, _, engine = env
    r = _edit(c, [("image[]", FIRST), ("image[]", SECOND)], seed="4")
    assert r.status_code == 200, r.text
    got = _pixels(r.json()["data"][0]["b64_json"])
    assert got.shape == (64, 96, 3)
    assert np.array_equal(got, _own(engine, seed=4, reference_images=(FIRST, SECOND)))
    assert not np.array_equal(got, _own(engine, seed=4, reference_images=(FIRST,)))


def test_a1111_img2img_makes_the_init_images_references(env):
    c, _, engine = env
    body = {"prompt": PROMPT, "seed": 5, "init_images": [_b64(FIRST), _b64(SECOND)], "denoising_strength": 0.6,
            "override_settings": {"sd_model_checkpoint": "klein"}, "override_settings_restore_afterwards": True}
    r = c.post("/sdapi/v1/img2img", json=body)
    assert r.status_code == 200, r.text
    got = _pixels(r.json()["images"][0])
    assert got.shape == (64, 96, 3)
    want = _own(engine, seed=5, init_image=FIRST, strength=0.6, reference_images=(FIRST, SECOND))
    assert np.array_equal(got, want)
    assert not np.array_equal(got, _own(engine, seed=5, init_image=FIRST, strength=0.6))
    assert not any("init_images" in w for w in json.loads(r.json()["info"])["warnings"])


def test_a1111_sdlite_edit_takes_the_init_images_as_references_only(env):
    """The web page's Edit tab: ``sdlite_edit`` makes every init image a reference and draws from noise (``sdlite
    edit``'s request); a model that does not edit from images refuses it, and ``/options`` says which edits."""
    c, _, engine = env
    body = {"prompt": PROMPT, "seed": 7, "init_images": [_b64(FIRST), _b64(SECOND)], "sdlite_edit": True}
    assert c.get("/sdapi/v1/options").json()["sdlite_edits_from_images"] is False   # the demo model, current
    r = c.post("/sdapi/v1/img2img", json=body)
    assert r.status_code == 422 and "FLUX.2 [klein]" in r.json()["detail"], r.text
    r = c.post("/sdapi/v1/img2img", json={**body, "override_settings": {"sd_model_checkpoint": "klein"}})
    assert r.status_code == 200, r.text
    got = _pixels(r.json()["images"][0])
    assert np.array_equal(got, _own(engine, seed=7, reference_images=(FIRST, SECOND)))


def _mcp(server, tool, arguments):
    import anyio
    from mcp import Client

    from sdlite.server.mcp.server import mcp_app
    from sdlite.server.mcp.tools import Tools

    async def call():
        async with Client(mcp_app(Tools(server))) as mcp:
            return await mcp.call_tool(tool, arguments)

    return anyio.run(call)


def test_mcp_edit_image(env):
    _, server, engine = env
    result = _mcp(server, "edit_image", {"image": _b64(FIRST), "instruction": PROMPT, "model": "klein", "seed": 6,
                                         "reference_images": [_b64(SECOND)]})
    assert not result.is_error, result.content
    image = next(c for c in result.content if c.type == "image")
    assert np.array_equal(_pixels(image.data), _own(engine, seed=6, reference_images=(FIRST, SECOND)))
    assert (result.structured_content["width"], result.structured_content["height"]) == (96, 64)


def test_mcp_edit_image_is_refused_by_a_model_without_references(env):
    _, server, _ = env
    result = _mcp(server, "edit_image", {"image": _b64(FIRST), "instruction": PROMPT, "steps": 1})
    assert result.is_error
    text = result.content[0].text
    assert text.startswith("edit_image:") and "FLUX.2 [klein]" in text and "reference images" in text


# --- ComfyUI ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def comfy(env, tmp_path_factory):
    from sdlite.server.comfy.workflow import ComfyDirs, Executor

    root = tmp_path_factory.mktemp("flux2-comfy")
    dirs = ComfyDirs(root / "input", root / "output", root / "temp")
    for folder in (dirs.input, dirs.output, dirs.temp):
        folder.mkdir()
    FIRST.save(dirs.input / "first.png")
    _, server, _ = env
    engine = Engine.load(server.checkpoints.models_dir / "diffusion_models" / UNET, **OPTIONS)
    return Executor(server, dirs), dirs, engine


def workflow(seed=5, edit=False, width=64, height=64):
    """ComfyUI's klein text-to-image / image-edit template in its KSampler form, in API format."""
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": QWEN, "type": "flux2", "device": "default"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": AE}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["2", 0]}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["2", 0]}},
        "6": {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}},
        "7": {"class_type": "KSampler", "inputs": {
            "seed": seed, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
            "model": ["1", 0], "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["3", 0]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "klein", "images": ["8", 0]}},
    }
    if edit:
        prompt.update({
            "10": {"class_type": "LoadImage", "inputs": {"image": "first.png"}},
            "11": {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["3", 0]}},
            "12": {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["4", 0], "latent": ["11", 0]}},
            "13": {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["5", 0], "latent": ["11", 0]}}})
        prompt["7"]["inputs"].update(positive=["12", 0], negative=["13", 0])
    return prompt


def _run(comfy, prompt) -> np.ndarray:
    from sdlite.server.comfy.workflow import validate
    from tests.test_comfy_workflow import Control

    executor, dirs, _ = comfy
    history = executor.run("pid", prompt, validate(prompt, executor.server), Control(watched=False),   # no preview:
                           lambda *a: None)   # the tiny VAE has no cheap-preview colours
    with Image.open(dirs.output / history["9"]["images"][0]["filename"]) as im:
        return np.asarray(im.convert("RGB"))


def _comfy_own(engine, seed, **kw) -> np.ndarray:
    return _own(engine, seed=seed, schedule="simple", negative_prompt="", noise="comfy", **kw)


def test_comfy_text_to_image(comfy):
    got = _run(comfy, workflow(seed=5))
    assert got.shape == (64, 64, 3) and got.std() > 5
    assert np.array_equal(got, _comfy_own(comfy[2], 5, width=64, height=64))


def test_comfy_reference_latent_edit(comfy):
    got = _run(comfy, workflow(seed=7, edit=True, width=96, height=64))
    want = _comfy_own(comfy[2], 7, width=96, height=64, reference_images=(FIRST,))
    assert got.shape == (64, 96, 3)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 2
    assert not np.array_equal(got, _comfy_own(comfy[2], 7, width=96, height=64))


def test_flux2_scheduler_sigmas():
    import math

    from sdlite.families.flux2 import empirical_mu
    from sdlite.server.comfy.flux2 import flux2_sigmas

    sigmas = flux2_sigmas(4, 1024, 1024)
    mu = empirical_mu(4096, 4)
    assert sigmas.shape == (5,) and sigmas[0] == 1 and sigmas[-1] == 0 and bool((sigmas[:-1] > sigmas[1:]).all())
    assert math.isclose(float(sigmas[2]), math.exp(mu) / (math.exp(mu) + 1), rel_tol=1e-6)
