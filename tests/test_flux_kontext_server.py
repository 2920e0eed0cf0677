"""ComfyUI's stock FLUX.1 Kontext dev template (``flux_kontext_dev_basic``, in API format: its second image bypassed)
on sdlite's ComfyUI executor, with a tiny FLUX.1 dev written as ComfyUI's files (``flux1-dev-kontext.safetensors``:
a Kontext release by its name, clip_l and T5 by DualCLIPLoader, ae by VAELoader): LoadImageOutput -> ImageStitch ->
FluxKontextImageScale -> VAEEncode -> ReferenceLatent -> FluxGuidance 2.5 -> KSampler on the encoded latent,
ConditioningZeroOut as the negative, is the engine's edit of that image. The resolution table is cut to small sizes
for the graph (the real one gives about 1024^2 pixels, slow on a tiny model); FluxKontextImageScale on the real table,
ImageStitch and the refusals are checked node by node."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from sdlite.pipeline import Engine, Request
from tests.test_flux_kontext import _image
from tests.test_flux_pipeline import _pipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "make the circle red"
UNET = "flux1-dev-kontext.safetensors"
SMALL = ((48, 64), (64, 64), (64, 48))   # (width, height): the graph's resolution table
SOURCE = _image(21, 96, 72)              # 4:3 -> 64 x 48 of SMALL, no crop


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from sdlite.demo import model_path
    from sdlite.server.backend import Server
    from sdlite.server.comfy.workflow import ComfyDirs, Executor
    from tests.test_flux_files import TEXT_L, TRANSFORMER, _parts

    root = tmp_path_factory.mktemp("kontext-comfy")
    models = root / "models"
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (models / sub).mkdir(parents=True)
    parts = _parts(_pipeline(root, "dev", text_l=TEXT_L, save=False, **TRANSFORMER))
    save_file(parts["transformer"], models / "diffusion_models" / UNET)
    save_file(parts["clip_l"], models / "text_encoders" / "clip_l.safetensors")
    save_file(parts["t5"], models / "text_encoders" / "t5xxl_fp16.safetensors")
    save_file(parts["vae"], models / "vae" / "ae.safetensors")
    dirs = ComfyDirs(root / "input", root / "output", root / "temp")
    for folder in (dirs.input, dirs.output, dirs.temp):
        folder.mkdir()
    SOURCE.save(dirs.output / "ComfyUI_00018_.png")
    server = Server(model_path(), models, preload=False, engine_options={"precision": "exact"})
    yield server, Executor(server, dirs), models, dirs
    server.jobs.stop(1)


def template(seed=5, steps=2, method=None):
    """flux_kontext_dev_basic in API format (the bypassed LoadImageOutput and EmptySD3LatentImage left out)."""
    prompt = {
        "37": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
        "38": {"class_type": "DualCLIPLoader", "inputs": {"clip_name1": "clip_l.safetensors",
                                                          "clip_name2": "t5xxl_fp16.safetensors", "type": "flux",
                                                          "device": "default"}},
        "39": {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}},
        "142": {"class_type": "LoadImageOutput", "inputs": {"image": "ComfyUI_00018_.png [output]"}},
        "146": {"class_type": "ImageStitch", "inputs": {"image1": ["142", 0], "direction": "right",
                                                        "match_image_size": True, "spacing_width": 0,
                                                        "spacing_color": "white"}},
        "42": {"class_type": "FluxKontextImageScale", "inputs": {"image": ["146", 0]}},
        "173": {"class_type": "PreviewImage", "inputs": {"images": ["42", 0]}},
        "124": {"class_type": "VAEEncode", "inputs": {"pixels": ["42", 0], "vae": ["39", 0]}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["38", 0]}},
        "177": {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["6", 0], "latent": ["124", 0]}},
        "35": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["177", 0], "guidance": 2.5}},
        "135": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["6", 0]}},
        "31": {"class_type": "KSampler", "inputs": {
            "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
            "model": ["37", 0], "positive": ["35", 0], "negative": ["135", 0], "latent_image": ["124", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["31", 0], "vae": ["39", 0]}},
        "136": {"class_type": "SaveImage", "inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}},
    }
    if method is not None:
        prompt["179"] = {"class_type": "FluxKontextMultiReferenceLatentMethod",
                         "inputs": {"conditioning": ["35", 0], "reference_latents_method": method}}
        prompt["31"]["inputs"]["positive"] = ["179", 0]
    return prompt


def _run(env, prompt) -> np.ndarray:
    from sdlite.server.comfy.workflow import validate
    from tests.test_comfy_workflow import Control

    server, executor, _, dirs = env
    history = executor.run("pid", prompt, validate(prompt, server), Control(watched=False), lambda *a: None)
    with Image.open(dirs.output / history["136"]["images"][0]["filename"]) as im:
        return np.asarray(im.convert("RGB"))


def test_the_stock_template_is_the_engines_edit(env, monkeypatch):
    """The graph's image is the engine's Kontext edit of the same picture (resized by the same table, encoded to its
    mean latent as the reference, ComfyUI's noise and simple scheduler, guidance 2.5) within 2/255."""
    from sdlite.families import flux_kontext
    from sdlite.loader import open_model

    monkeypatch.setattr(flux_kontext, "PREFERRED_RESOLUTIONS", SMALL)
    _, _, models, _ = env
    got = _run(env, template(method="offset"))
    source = open_model(models / "diffusion_models" / UNET, text_encoders=[
        models / "text_encoders" / "clip_l.safetensors", models / "text_encoders" / "t5xxl_fp16.safetensors",
        models / "vae" / "ae.safetensors"])
    engine = Engine.load(source, precision="exact")
    assert engine.family.kontext
    r = Request(prompt=PROMPT, negative_prompt="", reference_images=(SOURCE,), steps=2, cfg_scale=1.0,
                sampler="euler", schedule="simple", seed=5, noise="comfy")
    want = np.asarray(engine.generate(r).images[0])
    assert got.shape == want.shape == (48, 64, 3) and got.std() > 5
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 2
    plain = np.asarray(engine.generate(r.replace(reference_images=(), width=64, height=48)).images[0])
    assert np.abs(got.astype(int) - plain.astype(int)).max() > 2   # (this tiny model leans little on references)


def test_flux_kontext_image_scale_on_the_real_table():
    """ComfyUI's node: the preferred resolution nearest the image's own aspect ratio (83 x 50 -> 1328 x 800, not
    rounded to 16 first), Lanczos after a centre crop to that aspect."""
    from sdlite.server.comfy import images
    from sdlite.server.comfy.kontext import kontext_scale

    picture = _image(3, 83, 50)
    image = images.from_pil([picture])
    out = kontext_scale(image)
    assert out.shape == (1, 800, 1328, 3)
    # 83 / 50 and 1328 / 800 are both 1.66: no crop
    want = images.from_pil([picture.resize((1328, 800), Image.Resampling.LANCZOS)])
    assert torch.equal(out, want)
    tall = kontext_scale(images.from_pil([_image(4, 30, 64)]))
    assert tall.shape == (1, 1504, 688, 3)                              # 0.469: 688/1504 = 0.457 is nearest


def test_image_stitch():
    from sdlite.server.comfy.kontext import stitch

    a, b = torch.rand(1, 8, 12, 3), torch.rand(2, 4, 4, 3)
    assert stitch(a, None, "right", True, 0, "white") is a
    right = stitch(a, b, "right", True, 0, "white")                      # b resized to 8 x 8, the batch repeated
    assert right.shape == (2, 8, 20, 3) and torch.equal(right[1, :, :12], a[0])
    up = stitch(a, b, "up", False, 3, "red")                 # b padded to 12 wide, 4 px of red (3 rounded up), a
    assert up.shape == (2, 16, 12, 3) and torch.equal(up[0, 0, :4], torch.zeros(4, 3))
    assert torch.equal(up[0, 5, 0], torch.tensor([1.0, 0.0, 0.0])) and torch.equal(up[1, 8:], a[0])


def test_refusals_name_the_node_and_input(env):
    from sdlite.server.comfy.workflow import PromptError, validate

    server = env[0]
    with pytest.raises(PromptError) as caught:
        validate(template(method="index"), server)
    assert "sdlite places FLUX.1 Kontext's references by 'offset'" in str(caught.value.node_errors["179"])
    prompt = template()
    prompt["142"]["inputs"]["image"] = "missing.png [output]"
    with pytest.raises(PromptError) as caught:
        validate(prompt, server)
    assert "missing.png [output]" in str(caught.value.node_errors["142"])
