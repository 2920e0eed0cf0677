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

import numpy as np
import pytest
import torch

from sdlite.adapters import lora as L
from sdlite.pipeline import Engine
from tests.reference import (LORA_RANK, fused_lora_images, lora_factors, lora_files, lora_request, under,
                             write_lora)
from tests.test_qwenimage_pipeline import MAX_PIXEL_DIFF, PROMPT, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK, WEIGHT = LORA_RANK, 0.8
SIZE = 64
LAYOUTS = ["peft", "diffusion_model", "comfy", "bare", "kohya"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwenimage_lora")
    pipe = _pipeline(tmp / "qwen-image")
    factors = lora_factors(sorted(pipe.transformer.named_modules()), 11)
    assert {"img_in", "txt_in", "proj_out", "norm_out.linear", "transformer_blocks.1.img_mod.1",
            "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.txt_mlp.net.2"} <= set(factors)
    files = {
        **lora_files(tmp, factors),
        "comfy": write_lora(tmp / "comfy.safetensors", under("diffusion_model.", factors), parts="lora_down"),
        "bare": write_lora(tmp / "lightning.safetensors", factors, parts="lora_down"),
    }
    return pipe, Engine.load(tmp / "qwen-image", precision="exact"), files, tmp


def _diffusers(pipe, path=None) -> np.ndarray:
    """QwenImagePipeline's batch of 2 (3 steps, no guidance), with the LoRA at ``path`` loaded and fused at WEIGHT."""
    return fused_lora_images(pipe, PROMPT, SIZE, path, WEIGHT)


@pytest.fixture(scope="module")
def base(qwen):
    return _diffusers(qwen[0])


def _request(**kw):
    return lora_request(PROMPT, SIZE, **kw)


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
    path = write_lora(tmp / "te.safetensors", {"lora_te_encoder_layers_0_self_attn_q_proj":
                                                (torch.zeros(RANK, 32), torch.zeros(32, RANK))}, parts="lora_down")
    with pytest.raises(L.LoraError, match=r"Qwen-Image.*Qwen2\.5-VL.*takes no LoRA"):
        engine.generate(_request(loras=((path, WEIGHT),)))
