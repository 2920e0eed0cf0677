"""FLUX.2 [klein] LoRAs in the layouts they are published in, against diffusers' ``load_lora_weights`` +
``fuse_lora`` on the tiny random Flux2KleinPipeline of tests/test_flux2_pipeline.py. Every Linear of the transformer is
targeted (the blocks' attention and feed-forward, the single blocks' fused projections, the shared modulations, the
embedders, the output layer), q, k and v of a double block's attention sharing their down factor so that BFL's stacked
``img_attn.qkv`` holds them:

* diffusers / PEFT ``transformer.*`` with the alpha in ``lora_adapter_metadata``: the reference itself;
* diffusers' names under ComfyUI's and ai-toolkit's ``diffusion_model.`` with ``.alpha`` keys;
* BFL's names (ComfyUI's: ``double_blocks.0.img_attn.qkv``, ``single_blocks.0.linear1``, ...) under
  ``diffusion_model.``, as ``lora_down`` / ``lora_up``;
* kohya's ``lora_unet_`` over diffusers' names,

all made of the same factors, so all give diffusers' image."""
from __future__ import annotations

import numpy as np
import pytest

from sdlite.pipeline import Engine
from sdlite.weights.flux2_keys import flux2_to_original
from tests.reference import factors_on, lora_and_base, lora_factors, lora_files, lora_request, under, write_lora
from tests.test_flux2_pipeline import MAX_PIXEL_DIFF, PROMPT, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEIGHT = 0.8
SIZE = 64
# q, k and v of an attention share their down factor (each stream's own)
SHARES = {"to_k": "to_q", "to_v": "to_q", "add_k_proj": "add_q_proj", "add_v_proj": "add_q_proj"}


def _bfl(factors: dict) -> dict:
    """The same factors on BFL's names: q, k and v of each stream as one ``qkv`` (their ups stacked), a reordered
    modulation's halves exchanged."""
    out = factors_on(flux2_to_original, factors)
    assert "double_blocks.0.img_attn.qkv" in out and "single_blocks.0.linear1" in out, sorted(out)[:8]
    return out


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("klein_lora")
    pipe = _pipeline(tmp / "klein")
    factors = lora_factors(pipe.transformer.named_modules(), 11, SHARES)
    comfy = under("diffusion_model.", _bfl(factors))
    files = {**lora_files(tmp, factors), "comfy": write_lora(tmp / "comfy.safetensors", comfy, parts="lora_down")}
    return pipe, Engine.load(tmp / "klein", precision="exact"), files, tmp


@pytest.fixture(scope="module")
def expected(klein):
    """Flux2KleinPipeline's batch of 2 (3 steps) with the PEFT file fused at WEIGHT, and without it."""
    pipe, _, files, _ = klein
    return lora_and_base(pipe, PROMPT, SIZE, files["peft"], WEIGHT, least=4)


def _request(**kw):
    return lora_request(PROMPT, SIZE, **kw)


@pytest.mark.parametrize("layout", ["peft", "diffusion_model", "comfy", "kohya"])
def test_each_layout_gives_diffusers_image(klein, expected, layout):
    _, engine, files, _ = klein
    with_lora, base = expected
    got = _pixels(engine.generate(_request(loras=((files[layout], WEIGHT),))).images)
    assert np.abs(got - with_lora).max() <= MAX_PIXEL_DIFF
    assert np.abs(_pixels(engine.generate(_request()).images) - base).max() <= MAX_PIXEL_DIFF, "restored exactly"


def test_low_memory_mode_merges_as_blocks_stream(klein, expected):
    _, _, files, tmp = klein
    low = Engine.load(tmp / "klein", precision="exact", memory_mode=0)
    got = _pixels(low.generate(_request(loras=((files["comfy"], WEIGHT),))).images)
    assert np.abs(got - expected[0]).max() <= MAX_PIXEL_DIFF
