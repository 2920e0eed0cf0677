"""ComfyUI's stock Qwen-Image-Edit templates (``image_qwen_image_edit``, ``image_qwen_image_edit_2509``) in API format,
posted to sdlite's ComfyUI ``/prompt``, on a tiny random Qwen-Image-Edit written as ComfyUI's split files
(``qwen_image_edit_fp8_e4m3fn.safetensors`` / ``qwen_image_edit_2509_fp8_e4m3fn.safetensors`` by UNETLoader, the
Qwen2.5-VL encoder with its vision tower under ``visual.`` by CLIPLoader of type ``qwen_image``, the Wan-named VAE by
VAELoader): LoadImage -> ImageScaleToTotalPixels (Edit) or FluxKontextImageScale (2509) -> VAEEncode as the latent,
TextEncodeQwenImageEdit(Plus) with the image and the VAE for the instruction and for "", ModelSamplingAuraFlow 3 ->
CFGNorm 1 -> KSampler (euler, simple, cfg 2.5). Its image is ``Engine.generate``'s with the equivalent Request (the
image as the reference, ComfyUI's noise and simple scheduler on ComfyUI's ModelSamplingDiscreteFlow table at shift 3)
within 2/255. The Lightning LoRA (bypassed in the templates) is left out.

Kept short: the source latents' pixel count (the pipelines' 1024^2) is made 256^2 on both sides (the same computation
on fewer tokens); the tower's config, which a file's shapes identify only for the released 7B tower, is the tiny
tower's (as :mod:`tests.test_qwenimage_files` does); the text encoder has the real vocabulary (152064) for the Qwen
tokenizer's ids."""
from __future__ import annotations

import io
import time

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.config.qwen import QwenConfig
from sdlite.models.qwen import QwenTextEncoder
from sdlite.models.qwenimage import QwenImage
from sdlite.models.qwenimage_vae import QwenImageVAE
from sdlite.pipeline import Engine, Request
from tests.test_qwenimage_files import TEXT, TOWER, TRANSFORMER, VAE, _state, _tower_state, _wan, _write
from tests.test_qwenimage_instruct import _source

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "make the circle green"
EDIT, PLUS = "qwen_image_edit_fp8_e4m3fn.safetensors", "qwen_image_edit_2509_fp8_e4m3fn.safetensors"
CLIP, AE = "qwen_2.5_vl_7b_fp8_scaled.safetensors", "qwen_image_vae.safetensors"
VOCAB = 152064                       # Qwen2.5's: the tokenizer's ids (<|image_pad|> 151655) index the embedding
SOURCE = _source(72, 56, 11)         # the picture edited
# ImageScaleToTotalPixels: 72 x 56 -> 112 x 96 (about 0.01 x 1024^2 pixels, sides multiples of 16; multiples of 8,
# which ComfyUI pads to whole 2 x 2 patches, in test_sides_of_multiples_of_8_are_padded_as_comfyui_pads_them)
MEGAPIXELS, STEPS16 = 0.01, 16
KONTEXT_SIZES = ((48, 64), (64, 64), (64, 48))   # FluxKontextImageScale's table, cut small: 72 x 56 -> 64 x 48
WAIT_S = 60


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from fastapi.testclient import TestClient

    import sdlite.families.qwenimage_edit as family
    import sdlite.weights.qwen_vision_keys as vision_keys
    from sdlite.demo import model_path
    from sdlite.families import flux_kontext
    from sdlite.server.app import build_app
    from sdlite.server.backend import Server

    root = tmp_path_factory.mktemp("qwen-edit-comfy")
    models = root / "models"
    text = QwenConfig(**{**TEXT.__dict__, "vocab_size": VOCAB})
    transformer = {k: v * 3 for k, v in _state(QwenImage(TRANSFORMER), 1).items()}   # leaning on its references
    encoder = {f"model.{k}": v.to(torch.bfloat16) for k, v in _state(QwenTextEncoder(text), 3).items()}
    encoder.update({f"visual.{k}": v for k, v in _tower_state().items()})
    _write(models / "diffusion_models" / EDIT, transformer)
    _write(models / "diffusion_models" / PLUS, transformer)
    _write(models / "text_encoders" / CLIP, encoder)
    vae = _wan(_state(QwenImageVAE(VAE), 2))
    vae["decoder.head.2.weight"] = vae["decoder.head.2.weight"] * 8   # contrast in the tiny VAE's images
    _write(models / "vae" / AE, vae)
    _write(models / "text_encoders" / "misplaced_vae.safetensors", vae)   # a VAE where a text encoder should be
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vision_keys, "QWEN25_VL_7B_VISION", TOWER)
        patch.setattr(family, "VAE_AREA", 256 * 256)
        patch.setattr(flux_kontext, "PREFERRED_RESOLUTIONS", KONTEXT_SIZES)
        server = Server(model_path(), models, preload=False, engine_options={"precision": "exact"},
                        comfy_dir=root / "comfy")
        with TestClient(build_app(server)) as client:
            SOURCE.save(root / "comfy" / "input" / "source.png")
            yield client, models


def template(plus: bool = False, seed: int = 5, steps: int = 2) -> dict:
    """The Edit template in API format (its Lightning LoRA bypassed); ``plus``: the 2509 template (its second and
    third images and its "raw latent" group bypassed): TextEncodeQwenImageEditPlus and FluxKontextImageScale."""
    encode = "TextEncodeQwenImageEditPlus" if plus else "TextEncodeQwenImageEdit"
    image = "image1" if plus else "image"
    scale = ({"class_type": "FluxKontextImageScale", "inputs": {"image": ["78", 0]}} if plus else
             {"class_type": "ImageScaleToTotalPixels", "inputs": {
                 "image": ["78", 0], "upscale_method": "lanczos", "megapixels": MEGAPIXELS,
                 "resolution_steps": STEPS16}})
    return {
        "37": {"class_type": "UNETLoader", "inputs": {"unet_name": PLUS if plus else EDIT, "weight_dtype": "default"}},
        "38": {"class_type": "CLIPLoader", "inputs": {"clip_name": CLIP, "type": "qwen_image", "device": "default"}},
        "39": {"class_type": "VAELoader", "inputs": {"vae_name": AE}},
        "78": {"class_type": "LoadImage", "inputs": {"image": "source.png"}},
        "93": scale,
        "88": {"class_type": "VAEEncode", "inputs": {"pixels": ["93", 0], "vae": ["39", 0]}},
        "76": {"class_type": encode, "inputs": {"prompt": PROMPT, "clip": ["38", 0], "vae": ["39", 0],
                                                image: ["93", 0]}},
        "77": {"class_type": encode, "inputs": {"prompt": "", "clip": ["38", 0], "vae": ["39", 0], image: ["93", 0]}},
        "66": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["37", 0], "shift": 3.0}},
        "75": {"class_type": "CFGNorm", "inputs": {"model": ["66", 0], "strength": 1.0}},
        "3": {"class_type": "KSampler", "inputs": {
            "seed": seed, "steps": steps, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
            "model": ["75", 0], "positive": ["76", 0], "negative": ["77", 0], "latent_image": ["88", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["39", 0]}},
        "60": {"class_type": "SaveImage", "inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}},
    }


def _post(client, prompt: dict) -> dict:
    r = client.post("/prompt", json={"prompt": prompt, "client_id": "test"})
    assert r.status_code == 200, r.text
    prompt_id = r.json()["prompt_id"]
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        item = client.get(f"/history/{prompt_id}").json()
        if item:
            return item[prompt_id]
        time.sleep(0.05)
    raise AssertionError(f"prompt {prompt_id} did not finish")


def _image(client, history: dict) -> np.ndarray:
    status = history["status"]
    assert status["status_str"] == "success", status
    entry = history["outputs"]["60"]["images"][0]
    r = client.get("/view", params={"filename": entry["filename"], "subfolder": entry["subfolder"],
                                    "type": entry["type"]})
    assert r.status_code == 200
    return np.asarray(Image.open(io.BytesIO(r.content)).convert("RGB"))


def _engine(models, unet: str):
    """The engine of the same files, its ComfyUI table ModelSamplingDiscreteFlow's at the templates' shift 3 (what
    the graph's ModelSamplingAuraFlow sets; Engine.generate takes the family's own ComfyUI shift)."""
    from sdlite.loader import open_model
    from sdlite.sampling.comfy import DiscreteFlowShift

    source = open_model(models / "diffusion_models" / unet, text_encoders=[models / "text_encoders" / CLIP,
                                                                          models / "vae" / AE])
    engine = Engine.load(source, precision="exact")
    engine.family.comfy_shift = DiscreteFlowShift(3.0)
    return engine


@pytest.mark.parametrize("plus", [False, True], ids=["edit", "edit-2509"])
def test_the_stock_template_is_the_engines_edit(env, plus):
    """The graph's image is the engine's edit of the scaled source (its reference image, the same seed, steps, cfg,
    sampler and size) within 2/255, and not the engine's image of another source."""
    from sdlite.server.comfy import images
    from sdlite.server.comfy.kontext import kontext_scale
    from sdlite.server.comfy.qwenimage import total_pixels_size

    client, models = env
    got = _image(client, _post(client, template(plus=plus)))
    pixels = images.from_pil([SOURCE])
    if plus:
        scaled = images.to_pil(kontext_scale(pixels))[0]
    else:
        scaled = SOURCE.resize(total_pixels_size(72, 56, MEGAPIXELS, STEPS16), Image.Resampling.LANCZOS)
    width, height = scaled.width // 8 * 8, scaled.height // 8 * 8   # VAEEncode crops to multiples of 8
    engine = _engine(models, PLUS if plus else EDIT)   # (the module's patches hold: env's)
    assert engine.spec.family == ("qwen-image-edit-plus" if plus else "qwen-image-edit")
    r = Request(prompt=PROMPT, negative_prompt="", reference_images=(scaled,), steps=2, cfg_scale=2.5,
                sampler="euler", schedule="simple", seed=5, noise="comfy", width=width, height=height)
    want = np.asarray(engine.generate(r).images[0])
    red = Image.new("RGB", (72, 56), (250, 10, 10))
    other = np.asarray(engine.generate(r.replace(reference_images=(red,))).images[0])
    assert got.shape == want.shape == (height, width, 3) and got.std() > 5
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 2
    assert np.abs(got.astype(int) - other.astype(int)).max() > 2


def test_sides_of_multiples_of_8_are_padded_as_comfyui_pads_them(env):
    """ImageScaleToTotalPixels at resolution_steps 8 (72 x 56 -> 120 x 88, a 15 x 11 latent): ComfyUI pads such a
    latent to whole 2 x 2 patches and crops the output (the network's pad_to_patches, against diffusers in
    tests.test_qwenimage_model), so the graph runs; its image is the engine's ComfyUI sampling at that size, guided
    (true CFG's norms over the last, half patches). The A1111 sampling still refuses the size, naming the nearest."""
    from sdlite.errors import RequestError

    client, models = env
    prompt = template()
    prompt["93"]["inputs"]["resolution_steps"] = 8
    got = _image(client, _post(client, prompt))
    scaled = SOURCE.resize((120, 88), Image.Resampling.LANCZOS)
    engine = _engine(models, EDIT)
    r = Request(prompt=PROMPT, negative_prompt="", reference_images=(scaled,), steps=2, cfg_scale=2.5,
                sampler="euler", schedule="simple", seed=5, noise="comfy", width=120, height=88)
    want = np.asarray(engine.generate(r).images[0])
    assert got.shape == want.shape == (88, 120, 3) and got.std() > 5
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 2
    with pytest.raises(RequestError, match="multiples of 16 pixels .* 120x88 is not: the nearest that are: 112x80 or "
                                           "128x96"):
        engine.generate(r.replace(noise="a1111", schedule=None))


def test_unet_loader_fp8_weight_dtype(env):
    """UNETLoader's weight_dtype fp8_e4m3fn on the Qwen-Image-Edit file: the image of the file whose Linear weights
    (every 2-D weight) were cast to fp8 and back by torch, from a transformer that keeps them one byte each; not the
    default weights' image."""
    from safetensors.torch import load_file, save_file

    from sdlite.engine.lowbit import LowBitLinear

    client, models = env
    folder = models / "diffusion_models"
    rounded = "qwen_image_edit_fp8-rounded.safetensors"   # an Edit release by its name, as EDIT
    save_file({k: v.to(torch.float8_e4m3fn).to(v.dtype) if v.ndim == 2 and k.endswith(".weight") else v
               for k, v in load_file(folder / EDIT).items()}, folder / rounded)
    try:
        prompt = template()
        prompt["37"]["inputs"]["weight_dtype"] = "fp8_e4m3fn"
        got = _image(client, _post(client, prompt))
        (engine,) = [e for k, e in client.app.state.server.engines._loaded.items() if k[-1] == "fp8_e4m3fn"]
        with engine.models.use("transformer") as transformer:
            linears = [m for m in transformer.modules() if isinstance(m, (LowBitLinear, torch.nn.Linear))]
        assert linears and all(isinstance(m, LowBitLinear) and m.qtype == "F8_E4M3" for m in linears)
        prompt = template()
        prompt["37"]["inputs"]["unet_name"] = rounded
        assert np.array_equal(got, _image(client, _post(client, prompt)))
        assert not np.array_equal(got, _image(client, _post(client, template())))
    finally:
        (folder / rounded).unlink()


def test_image_scale_to_total_pixels_size():
    from sdlite.server.comfy.qwenimage import total_pixels_size

    assert total_pixels_size(1024, 1024, 1.0) == (1024, 1024)
    assert total_pixels_size(72, 56, 0.01) == (116, 90)
    assert total_pixels_size(3000, 2000, 1.0, 16) == (1248, 832)


def test_refusals_name_the_node_and_input(env):
    """CFGNorm at another strength at validation; a text node with images and no vae when it runs; CLIPLoader's
    qwen_image takes a Qwen LLM, not a VAE."""
    client, _ = env
    prompt = template()
    prompt["75"]["inputs"]["strength"] = 0.5
    r = client.post("/prompt", json={"prompt": prompt})
    assert r.status_code == 400 and "CFGNorm at strength 1" in str(r.json()["node_errors"]["75"])
    prompt = template()
    prompt["38"]["inputs"]["clip_name"] = "misplaced_vae.safetensors"
    r = client.post("/prompt", json={"prompt": prompt})
    assert r.status_code == 400 and "holds a VAE" in str(r.json()["node_errors"]["38"])
    prompt = template(steps=1)
    del prompt["76"]["inputs"]["vae"]
    history = _post(client, prompt)
    assert history["status"]["status_str"] == "error"
    message = str(history["status"]["messages"])
    assert "TextEncodeQwenImageEdit (node 76): images without a vae" in message
