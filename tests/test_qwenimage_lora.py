"""Qwen-Image LoRAs in the layouts they are published in, each against diffusers' ``QwenImagePipeline.load_lora_weights``
+ ``fuse_lora`` of the same file on the tiny random model of tests/test_qwenimage_pipeline.py. Every Linear of the
transformer is targeted (the blocks' attention, modulations and MLPs of both streams, the embedders, the output
layers). The transformer's names are diffusers' and ComfyUI's alike, so every layout is a prefix and a naming of the
factors:

* diffusers / PEFT ``transformer.*`` with the alpha in ``lora_adapter_metadata``;
* ComfyUI's and ai-toolkit's ``diffusion_model.*``, as ``lora_A`` / ``lora_B`` and as ``lora_down`` / ``lora_up``,
  with ``.alpha`` keys;
* bare module paths with ``lora_down`` / ``lora_up`` and ``.alpha`` (how lightx2v's Qwen-Image-Lightning files name
  their layers);
* kohya's ``lora_unet_`` over the underscored names.

The model is restored exactly after each request; a text encoder's layers are refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdlite.adapters import lora as L
from sdlite.pipeline import Engine, Request
from tests.test_qwenimage_pipeline import MAX_PIXEL_DIFF, PROMPT, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK, ALPHA, WEIGHT = 4, 2.0, 0.8
SIZE = 64
LAYOUTS = ["peft", "diffusion_model", "comfy", "bare", "kohya"]


def _factors(transformer, seed: int, strength: float = 0.6) -> dict:
    """Diffusers' module path -> (down, up) for every Linear of ``transformer``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in sorted(transformer.named_modules()):
        if isinstance(module, torch.nn.Linear):
            rows, cols = module.weight.shape
            out[name] = (torch.randn(RANK, cols, generator=g) / cols ** 0.5,
                         torch.randn(rows, RANK, generator=g) * strength / RANK ** 0.5)
    return out


def _write(path, layers: dict, parts: str = "lora_A", alpha: bool = True, metadata: dict | None = None) -> str:
    down_part, up_part = ("lora_A", "lora_B") if parts == "lora_A" else ("lora_down", "lora_up")
    state = {}
    for name, (down, up) in layers.items():
        state[f"{name}.{down_part}.weight"] = down.clone()
        state[f"{name}.{up_part}.weight"] = up.clone()
        if alpha:
            state[f"{name}.alpha"] = torch.tensor(ALPHA)
    save_file(state, str(path), metadata=metadata)
    return str(path)


def _peft_metadata(names) -> dict:
    config = {"transformer.r": RANK, "transformer.lora_alpha": ALPHA, "transformer.alpha_pattern": {},
              "transformer.rank_pattern": {}, "transformer.use_dora": False, "transformer.use_rslora": False,
              "transformer.peft_type": "LORA", "transformer.target_modules": sorted(names)}
    return {"format": "pt", L.METADATA_KEY: json.dumps(config)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwenimage_lora")
    pipe = _pipeline(tmp / "qwen-image")
    factors = _factors(pipe.transformer, 11)
    assert {"img_in", "txt_in", "proj_out", "norm_out.linear", "transformer_blocks.1.img_mod.1",
            "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.txt_mlp.net.2"} <= set(factors)
    under = lambda prefix, layers: {prefix + name: f for name, f in layers.items()}   # noqa: E731
    files = {
        "peft": _write(tmp / "peft.safetensors", under("transformer.", factors), alpha=False,
                       metadata=_peft_metadata(factors)),
        "diffusion_model": _write(tmp / "ai_toolkit.safetensors", under("diffusion_model.", factors)),
        "comfy": _write(tmp / "comfy.safetensors", under("diffusion_model.", factors), parts="lora_down"),
        "bare": _write(tmp / "lightning.safetensors", factors, parts="lora_down"),
        "kohya": _write(tmp / "kohya.safetensors", {"lora_unet_" + n.replace(".", "_"): f
                                                     for n, f in factors.items()}, parts="lora_down"),
    }
    return pipe, Engine.load(tmp / "qwen-image", precision="exact"), files, tmp


def _seeds():
    return [torch.Generator().manual_seed(s) for s in (21, 22)]


def _diffusers(pipe, path=None) -> np.ndarray:
    """QwenImagePipeline's batch of 2 (3 steps, no guidance), with the LoRA at ``path`` loaded and fused at WEIGHT."""
    kw = dict(prompt=PROMPT, num_inference_steps=3, num_images_per_prompt=2, height=SIZE, width=SIZE,
              output_type="np")
    if path is None:
        out = pipe(generator=_seeds(), **kw).images
    else:
        pipe.load_lora_weights(path, adapter_name="style")
        try:
            pipe.fuse_lora(lora_scale=WEIGHT, adapter_names=["style"], components=["transformer"])
            out = pipe(generator=_seeds(), **kw).images
        finally:
            pipe.unfuse_lora(components=["transformer"])
            pipe.unload_lora_weights()
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


@pytest.fixture(scope="module")
def base(qwen):
    return _diffusers(qwen[0])


def _request(**kw) -> Request:
    return Request(**{"prompt": PROMPT, "steps": 3, "cfg_scale": 1.0, "sampler": "euler", "seed": 21,
                      "batch_size": 2, "width": SIZE, "height": SIZE, **kw})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_gives_diffusers_image(qwen, base, layout):
    pipe, engine, files, _ = qwen
    expected = _diffusers(pipe, files[layout])
    assert np.abs(expected - base).mean() > 4, "the LoRA should change the image clearly"
    got = _pixels(engine.generate(_request(loras=((files[layout], WEIGHT),))).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert np.abs(_pixels(engine.generate(_request()).images) - base).max() <= MAX_PIXEL_DIFF, "restored exactly"


def test_model_restored_exactly(qwen):
    _, engine, files, _ = qwen
    before = _pixels(engine.generate(_request()).images)
    engine.generate(_request(loras=((files["comfy"], WEIGHT),)))
    assert np.array_equal(_pixels(engine.generate(_request()).images), before)


def test_text_encoder_layers_refused(qwen):
    _, engine, _, tmp = qwen
    path = _write(tmp / "te.safetensors", {"lora_te_encoder_layers_0_self_attn_q_proj":
                                            (torch.zeros(RANK, 32), torch.zeros(32, RANK))}, parts="lora_down")
    with pytest.raises(L.LoraError, match=r"Qwen-Image.*Qwen2\.5-VL.*takes no LoRA"):
        engine.generate(_request(loras=((path, WEIGHT),)))
