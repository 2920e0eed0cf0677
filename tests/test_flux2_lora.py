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

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdlite.adapters import lora as L
from sdlite.pipeline import Engine, Request
from sdlite.weights.flux2_keys import flux2_to_original
from tests.test_flux2_pipeline import MAX_PIXEL_DIFF, PROMPT, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RANK, ALPHA, WEIGHT = 4, 2.0, 0.8
SIZE = 64


def _factors(transformer, seed: int, strength: float = 0.6) -> dict:
    """Diffusers' module path -> (down, up) for every Linear of ``transformer``; q, k and v of an attention share
    ``down`` (each stream's own)."""
    shapes = {name: tuple(m.weight.shape) for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    g = torch.Generator().manual_seed(seed)
    shares = {"to_k": "to_q", "to_v": "to_q", "add_k_proj": "add_q_proj", "add_v_proj": "add_q_proj"}
    out = {}
    for name, (rows, cols) in sorted(shapes.items(), key=lambda item: item[0].rpartition(".")[2] in shares):
        head, _, leaf = name.rpartition(".")
        down = out[f"{head}.{shares[leaf]}"][0] if leaf in shares else torch.randn(RANK, cols, generator=g) / cols ** 0.5
        out[name] = (down, torch.randn(rows, RANK, generator=g) * strength / RANK ** 0.5)
    return out


def _bfl(factors: dict) -> dict:
    """The same factors on BFL's names: q, k and v of each stream as one ``qkv`` (their ups stacked), a reordered
    modulation's halves exchanged."""
    out = {}
    for original, entry in flux2_to_original([f"{name}.weight" for name in factors]).entries.items():
        names = [source.removesuffix(".weight") for source in entry.sources]
        down = factors[names[0]][0]
        if entry.transform.op == "cat":
            assert all(factors[n][0] is down for n in names), names
            up = torch.cat([factors[n][1] for n in names])
        elif entry.transform.op == "swap_halves":
            up = factors[names[0]][1]
            half = up.shape[0] // 2
            up = torch.cat([up[half:], up[:half]])
        else:
            up = factors[names[0]][1]
        out[original.removesuffix(".weight")] = (down, up)
    assert "double_blocks.0.img_attn.qkv" in out and "single_blocks.0.linear1" in out, sorted(out)[:8]
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
def klein(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("klein_lora")
    pipe = _pipeline(tmp / "klein")
    factors = _factors(pipe.transformer, 11)
    under = lambda prefix, layers: {prefix + name: f for name, f in layers.items()}   # noqa: E731
    files = {
        "peft": _write(tmp / "peft.safetensors", under("transformer.", factors), alpha=False,
                       metadata=_peft_metadata(factors)),
        "diffusion_model": _write(tmp / "ai_toolkit.safetensors", under("diffusion_model.", factors)),
        "comfy": _write(tmp / "comfy.safetensors", under("diffusion_model.", _bfl(factors)), parts="lora_down"),
        "kohya": _write(tmp / "kohya.safetensors", {"lora_unet_" + n.replace(".", "_"): f
                                                     for n, f in factors.items()}, parts="lora_down"),
    }
    return pipe, Engine.load(tmp / "klein", precision="exact"), files, tmp


def _seeds():
    return [torch.Generator().manual_seed(s) for s in (21, 22)]


def _diffusers(pipe, path=None) -> np.ndarray:
    """Flux2KleinPipeline's batch of 2 (3 steps), with the LoRA at ``path`` loaded and fused at WEIGHT."""
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
def expected(klein):
    pipe, _, files, _ = klein
    base = _diffusers(pipe)
    with_lora = _diffusers(pipe, files["peft"])
    assert np.abs(with_lora - base).mean() > 4, "the LoRA should change the image clearly"
    return with_lora, base


def _request(**kw) -> Request:
    return Request(**{"prompt": PROMPT, "steps": 3, "cfg_scale": 1.0, "sampler": "euler", "seed": 21,
                      "batch_size": 2, "width": SIZE, "height": SIZE, **kw})


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
