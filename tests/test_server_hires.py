"""The server's hires fix and extras through A1111's API (FastAPI's TestClient, the shipped demo model): enable_hr
with every hr_* field, the upscaler listings, /extra-single-image and /extra-batch-images, and the limits."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from sdlite.hires import LATENT_MODES
from sdlite.server.app import create_app
from sdlite.server.limits import Limits

PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(limits=Limits(max_steps=1000, max_pixels=256 * 256))) as c:
        yield c


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def b64png(image: Image.Image, parameters: str | None = None) -> str:
    from sdlite.images import png_bytes

    return base64.b64encode(png_bytes(image, parameters)).decode("ascii")


def txt2img(client, **fields):
    r = client.post("/sdapi/v1/txt2img", json={"prompt": PROMPT, "steps": 6, "seed": 3, **fields})
    return r, (json.loads(r.json()["info"]) if r.status_code == 200 else None)


@pytest.mark.parametrize("upscaler", ["Latent", "Lanczos"])
def test_enable_hr_returns_the_upscaled_image_with_a1111_fields(client, upscaler):
    r, info = txt2img(client, enable_hr=True, hr_scale=2, hr_upscaler=upscaler, denoising_strength=0.5,
                      hr_second_pass_steps=4)
    assert r.status_code == 200, r.text
    image = decode(r.json()["images"][0])
    assert image.size == (128, 128)
    extra = info["extra_generation_params"]
    assert extra["Hires upscaler"] == upscaler and extra["Hires upscale"] == "2" and extra["Hires steps"] == "4"
    assert extra["Denoising strength"] == "0.5"
    assert "Hires upscale: 2" in image.info["parameters"] and "Size: 64x64" in image.info["parameters"]
    assert not any("enable_hr" in w for w in info["warnings"])
    assert info["width"] == 64   # A1111 reports the first pass's size


def test_every_hr_field(client):
    r, info = txt2img(client, enable_hr=True, hr_resize_x=96, hr_resize_y=0, hr_upscaler="Latent (nearest-exact)",
                      hr_sampler_name="Euler a", hr_scheduler="Automatic", hr_cfg=5.0, hr_prompt="a red circle",
                      hr_negative_prompt="blurry", hr_checkpoint_name="Use same checkpoint", denoising_strength=0.6)
    assert r.status_code == 200, r.text
    assert decode(r.json()["images"][0]).size == (96, 96)
    extra = info["extra_generation_params"]
    assert extra["Hires resize"] == "96x0" and extra["Hires sampler"] == "Euler a"
    assert extra["Hires CFG Scale"] == "5" and extra["Hires prompt"] == "a red circle"
    assert extra["Hires negative prompt"] == "blurry"
    # the legacy form: width/height are the target, firstphase_* the first pass
    r, info = txt2img(client, enable_hr=True, firstphase_width=64, firstphase_height=64, width=128, height=128)
    assert r.status_code == 200, r.text
    assert decode(r.json()["images"][0]).size == (128, 128)


@pytest.mark.parametrize("fields,message", [
    ({"hr_upscaler": "4x-Missing"}, "hr_upscaler: upscaler '4x-Missing' is not known"),
    ({"hr_scale": 0.5}, "hires scale 0.5"),
    ({"hr_scale": 8, "width": 64, "height": 64}, "the hires fix's target"),      # 512x512 > max_pixels 256x256
    ({"hr_checkpoint_name": "nothing-like-it"}, "hr_checkpoint_name='nothing-like-it'"),
])
def test_bad_hires_fields_are_refused_by_name(client, fields, message):
    r, _ = txt2img(client, enable_hr=True, **fields)
    assert r.status_code in (404, 422), r.text
    assert message in r.text


def test_upscaler_listings(client):
    names = [u["name"] for u in client.get("/sdapi/v1/upscalers").json()]
    assert names[:3] == ["None", "Lanczos", "Nearest"]
    for entry in client.get("/sdapi/v1/upscalers").json():
        assert set(entry) == {"name", "model_name", "model_path", "model_url", "scale"}
    assert [m["name"] for m in client.get("/sdapi/v1/latent-upscale-modes").json()] == list(LATENT_MODES)


def test_extra_single_image_keeps_the_parameters(client):
    source = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8))
    r = client.post("/sdapi/v1/extra-single-image",
                    json={"image": b64png(source, "a cat\nSteps: 20, Seed: 1"), "upscaler_1": "Lanczos",
                          "upscaling_resize": 2, "gfpgan_visibility": 0.5})
    assert r.status_code == 200, r.text
    out = decode(r.json()["image"])
    assert out.size == (112, 80)
    assert out.info["parameters"] == "a cat\nSteps: 20, Seed: 1, Postprocess upscale by: 2, Postprocess upscaler: Lanczos"
    expected = source.resize((112, 80), Image.Resampling.LANCZOS)
    assert np.array_equal(np.asarray(out.convert("RGB")), np.asarray(expected))
    assert "Postprocess upscaler: Lanczos" in r.json()["html_info"] and "face restoration" in r.json()["html_info"]


def test_extra_scale_to_with_crop_and_a_second_upscaler(client):
    source = Image.new("RGB", (64, 32), (200, 30, 40))
    r = client.post("/sdapi/v1/extra-single-image",
                    json={"image": b64png(source), "resize_mode": 1, "upscaling_resize_w": 96,
                          "upscaling_resize_h": 96, "upscaling_crop": True, "upscaler_1": "Nearest",
                          "upscaler_2": "Lanczos", "extras_upscaler_2_visibility": 0.5})
    assert r.status_code == 200, r.text
    out = decode(r.json()["image"])
    assert out.size == (96, 96)
    assert "Postprocess upscale to: 96x96, Postprocess crop to: 96x96, Postprocess upscaler: Nearest, " \
           "Postprocess upscaler 2: Lanczos" in out.info["parameters"]


def test_extra_batch_images(client):
    images = [{"data": b64png(Image.new("RGB", (32, 32), c)), "name": f"im{i}"}
              for i, c in enumerate([(255, 0, 0), (0, 0, 255)])]
    r = client.post("/sdapi/v1/extra-batch-images", json={"imageList": images, "upscaler_1": "Lanczos",
                                                          "upscaling_resize": 3})
    assert r.status_code == 200, r.text
    outs = [decode(b) for b in r.json()["images"]]
    assert [o.size for o in outs] == [(96, 96)] * 2
    assert outs[1].getpixel((10, 10)) == (0, 0, 255)


@pytest.mark.parametrize("body,status,message", [
    ({"upscaler_1": "Lanczos"}, 404, "Image not found"),
    ({"upscaler_1": "4x-Nope", "image": "x"}, 422, "upscaler '4x-Nope' is not known"),
    ({"upscaler_1": "Lanczos", "upscaling_resize": 20, "image": "x"}, 422, "upscaling_resize 20"),
    ({"upscaler_1": "Lanczos", "upscaling_resize": 8, "image": "IMG"}, 422, "the upscaled image"),
])
def test_extras_errors(client, body, status, message):
    if body.get("image") == "IMG":
        body = dict(body, image=b64png(Image.new("RGB", (64, 64))))
    r = client.post("/sdapi/v1/extra-single-image", json=body)
    assert r.status_code == status, r.text
    assert message in r.text


def test_upscaler_dir_is_listed_and_used(tmp_path):
    import torch
    from safetensors.torch import save_file

    from sdlite.upscalers.nets import SRVGGConfig, SRVGGNetCompact

    torch.manual_seed(0)
    net = SRVGGNetCompact(SRVGGConfig(num_feat=8, num_conv=2, scale=2))
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "tiny-2x.safetensors")
    (tmp_path / "notes.txt").write_text("not an upscaler")
    with TestClient(create_app(limits=Limits(max_steps=1000), upscaler_dir=str(tmp_path))) as c:
        listed = {u["name"]: u for u in c.get("/sdapi/v1/upscalers").json()}
        assert listed["tiny-2x"]["scale"] == 2 and listed["tiny-2x"]["model_path"].endswith("tiny-2x.safetensors")
        r = c.post("/sdapi/v1/extra-single-image", json={"image": b64png(Image.new("RGB", (16, 16), (9, 9, 200))),
                                                         "upscaler_1": "tiny-2x", "upscaling_resize": 2})
        assert r.status_code == 200, r.text
        assert decode(r.json()["image"]).size == (32, 32)
        r, info = txt2img(c, enable_hr=True, hr_upscaler="tiny-2x", denoising_strength=0.5)
        assert r.status_code == 200, r.text
        assert decode(r.json()["images"][0]).size == (128, 128)
        assert info["extra_generation_params"]["Hires upscaler"] == "tiny-2x"
