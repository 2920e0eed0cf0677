"""FLUX LoRAs in the layouts they are published in, against diffusers' ``load_lora_weights`` + ``fuse_lora`` on a tiny
random FLUX.1 dev pipeline:

* diffusers / PEFT ``transformer.*`` and ``text_encoder.*`` (CLIP-L) with the alphas in ``lora_adapter_metadata``
  (what ai-toolkit writes too): the reference itself;
* kohya's underscored diffusers paths (``lora_transformer_*``, ``lora_te1_``);
* kohya sd-scripts' BFL layout (``lora_unet_double_blocks_N_img_attn_qkv``: q, k and v stacked;
  ``lora_unet_single_blocks_N_linear1``: q, k, v and the MLP's input stacked; the output modulation's halves in BFL's
  order),

all made of the same factors, so all three give diffusers' image; memory mode 0 applies them as the blocks stream.
And XLabs' layout (``double_blocks.N.processor.qkv_lora1`` ...), against diffusers' reading of the same file."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sdlite.adapters import lora as L
from sdlite.pipeline import Engine, Request
from sdlite.weights.flux_keys import flux_to_original
from tests.test_flux_pipeline import MAX_PIXEL_DIFF, PROMPT, SIZE, _pipeline, _pixels, _reference
from tests.test_sd3_lora import RANK, ALPHA, WEIGHT, TEXT_TARGETS, _linears, _write

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRANSFORMER_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                       "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                       "ff_context.net.2", "norm1.linear", "norm1_context.linear", "norm.linear", "proj_mlp",
                       "proj_out", "norm_out.linear", "x_embedder", "context_embedder")
# layers stacked in BFL's layout share their down factor
_GROUPS = {"to_q": ("to_k", "to_v", "proj_mlp"), "add_q_proj": ("add_k_proj", "add_v_proj")}


def _factors(shapes: dict, seed: int, strength: float = 0.6) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}

    def leader(name):
        head, _, leaf = name.rpartition(".")
        block = head.removesuffix(".attn")
        for q, rest in _GROUPS.items():
            if leaf in rest:
                lead = f"{block}.attn.{q}" if leaf == "proj_mlp" else f"{head}.{q}"
                if lead in shapes and (leaf != "proj_mlp" or block.startswith("single_")):
                    return lead
        return None

    for name, (rows, cols) in sorted(shapes.items(), key=lambda item: leader(item[0]) is not None):
        lead = leader(name)
        down = out[lead][0] if lead else torch.randn(RANK, cols, generator=g) / cols ** 0.5
        out[name] = (down, torch.randn(rows, RANK, generator=g) * strength / RANK ** 0.5)
    return out


def _bfl(transformer: dict) -> dict:
    plan = flux_to_original([f"{n}.weight" for n in transformer], prefix="").entries
    out = {}
    for original, entry in plan.items():
        names = [s.removesuffix(".weight") for s in entry.sources]
        if not original.endswith(".weight") or names[0] not in transformer:
            continue
        down = transformer[names[0]][0]
        if entry.transform.op == "cat":
            assert all(transformer[n][0] is down for n in names), names
            up = torch.cat([transformer[n][1] for n in names])
        elif entry.transform.op == "swap_halves":
            up = transformer[names[0]][1]
            up = torch.cat([up[up.shape[0] // 2:], up[:up.shape[0] // 2]])
        else:
            up = transformer[names[0]][1]
        out["lora_unet_" + original.removesuffix(".weight").replace(".", "_")] = (down, up)
    assert any("linear1" in k for k in out) and any("img_attn_qkv" in k for k in out)
    return out


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux_lora")
    pipe = _pipeline(tmp, "dev")
    transformer = _factors(_linears(pipe.transformer, TRANSFORMER_TARGETS), 11)
    clip_l = _factors(_linears(pipe.text_encoder, TEXT_TARGETS), 12)
    config = {}
    for component, factors, alpha in (("transformer", transformer, ALPHA), ("text_encoder", clip_l, RANK)):
        config.update({f"{component}.r": RANK, f"{component}.lora_alpha": alpha, f"{component}.alpha_pattern": {},
                       f"{component}.rank_pattern": {}, f"{component}.use_dora": False,
                       f"{component}.use_rslora": False, f"{component}.peft_type": "LORA",
                       f"{component}.target_modules": sorted(factors)})
    files = {
        "peft": _write(tmp / "peft.safetensors", {**{f"transformer.{n}": f for n, f in transformer.items()},
                                                  **{f"text_encoder.{n}": f for n, f in clip_l.items()}},
                       metadata={"format": "pt", L.METADATA_KEY: json.dumps(config)}),
        "kohya": _write(tmp / "kohya.safetensors",
                        {**{"lora_transformer_" + n.replace(".", "_"): f for n, f in transformer.items()},
                         **{"lora_te1_" + n.replace(".", "_"): f for n, f in clip_l.items()}}, kohya=True),
        "sd-scripts": _write(tmp / "sd_scripts.safetensors",
                             {**_bfl(transformer), **{"lora_te1_" + n.replace(".", "_"): f for n, f in clip_l.items()}},
                             kohya=True),
    }
    return pipe, Engine.load(tmp / "dev", precision="exact"), files, tmp


def _request(**kw) -> Request:
    return Request(**{"prompt": PROMPT, "steps": 3, "cfg_scale": 1.0, "guidance": 3.5, "sampler": "euler", "seed": 21,
                      "batch_size": 2, "width": SIZE, "height": SIZE, **kw})


@pytest.fixture(scope="module")
def expected(flux):
    pipe, _, files, _ = flux
    kw = dict(prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5, num_images_per_prompt=2)
    seeds = lambda: [torch.Generator().manual_seed(s) for s in (21, 22)]   # noqa: E731
    base = _reference(pipe, "dev", generator=seeds(), **kw)
    pipe.load_lora_weights(files["peft"], adapter_name="style")
    try:
        # FluxPipeline fuses the transformer alone unless told (the text encoder's adapter would run unfused at
        # scale 1)
        pipe.fuse_lora(lora_scale=WEIGHT, adapter_names=["style"], components=["transformer", "text_encoder"])
        with_lora = _reference(pipe, "dev", generator=seeds(), **kw)
    finally:
        pipe.unfuse_lora(components=["transformer", "text_encoder"])
        pipe.unload_lora_weights()
    assert np.abs(with_lora - base).mean() > 8, "the LoRA should change the image clearly"
    return with_lora, base


@pytest.mark.parametrize("layout", ["peft", "kohya", "sd-scripts"])
def test_each_layout_gives_diffusers_image(flux, expected, layout):
    _, engine, files, _ = flux
    with_lora, base = expected
    got = _pixels(engine.generate(_request(loras=((files[layout], WEIGHT),))).images)
    assert np.abs(got - with_lora).max() <= MAX_PIXEL_DIFF
    assert np.abs(_pixels(engine.generate(_request()).images) - base).max() <= MAX_PIXEL_DIFF


def test_low_memory_mode_applies_them_as_blocks_stream(flux, expected):
    _, engine, files, tmp = flux
    low = Engine.load(tmp / "dev", precision="exact", memory_mode=0)
    r = _request(loras=((files["sd-scripts"], WEIGHT),))
    got = _pixels(low.generate(r).images)
    assert np.abs(got - expected[0]).max() <= MAX_PIXEL_DIFF
    assert np.array_equal(got, _pixels(engine.generate(r).images))


def _xlabs(transformer) -> dict:
    """An XLabs-layout FLUX LoRA for ``transformer`` (diffusers' module): every double block's image and text
    attention (stacked q/k/v, output) and every single block's (stacked q/k/v, output), no alphas."""
    g = torch.Generator().manual_seed(13)
    shape = lambda path: tuple(transformer.get_submodule(path).weight.shape)   # noqa: E731
    state = {}

    def add(key, rows, cols, strength=0.6):
        state[f"{key}.down.weight"] = torch.randn(RANK, cols, generator=g) / cols ** 0.5
        state[f"{key}.up.weight"] = torch.randn(rows, RANK, generator=g) * strength / RANK ** 0.5

    for i in range(len(transformer.transformer_blocks)):
        b = f"transformer_blocks.{i}.attn"
        add(f"double_blocks.{i}.processor.qkv_lora1", 3 * shape(f"{b}.to_q")[0], shape(f"{b}.to_q")[1])
        add(f"double_blocks.{i}.processor.qkv_lora2", 3 * shape(f"{b}.add_q_proj")[0], shape(f"{b}.add_q_proj")[1])
        add(f"double_blocks.{i}.processor.proj_lora1", *shape(f"{b}.to_out.0"))
        add(f"double_blocks.{i}.processor.proj_lora2", *shape(f"{b}.to_add_out"))
    for i in range(len(transformer.single_transformer_blocks)):
        b = f"single_transformer_blocks.{i}"
        add(f"single_blocks.{i}.processor.qkv_lora", 3 * shape(f"{b}.attn.to_q")[0], shape(f"{b}.attn.to_q")[1])
        add(f"single_blocks.{i}.processor.proj_lora", *shape(f"{b}.proj_out"))
    return state


def test_xlabs_layout_gives_diffusers_image(flux):
    """XLabs' layout read by diffusers' own converter (load_lora_weights) is the reference."""
    from safetensors.torch import save_file

    pipe, engine, _, tmp = flux
    path = str(tmp / "xlabs.safetensors")
    save_file(_xlabs(pipe.transformer), path)
    lora = L.read_lora(path)
    assert lora.format == "xlabs" and {layer.alpha for layer in lora.layers} == {None}
    kw = dict(prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5, num_images_per_prompt=2)
    pipe.load_lora_weights(path, adapter_name="xlabs")
    try:
        pipe.fuse_lora(lora_scale=WEIGHT, adapter_names=["xlabs"], components=["transformer"])
        want = _reference(pipe, "dev", generator=[torch.Generator().manual_seed(s) for s in (21, 22)], **kw)
    finally:
        pipe.unfuse_lora(components=["transformer"])
        pipe.unload_lora_weights()
    got = _pixels(engine.generate(_request(loras=((path, WEIGHT),))).images)
    assert np.abs(got - _pixels(engine.generate(_request()).images)).mean() > 4, "the LoRA should change the image"
    assert np.abs(got - want).max() <= MAX_PIXEL_DIFF


def test_xlabs_layout_errors_name_the_key(tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file({"double_blocks.0.processor.qkv_lora1.down.weight": torch.zeros(4, 8),
               "double_blocks.0.processor.qkv_lora1.up.weight": torch.zeros(10, 4)}, str(bad))
    with pytest.raises(L.LoraError, match=r"qkv_lora1\.up\.weight.*\[10, 4\].*divisible by 3"):
        L.read_lora(bad)
    save_file({"double_blocks.0.processor.qkv_lora1.down.weight": torch.zeros(4, 8),
               "double_blocks.0.processor.ffn_lora1.up.weight": torch.zeros(9, 4)}, str(bad))
    with pytest.raises(L.LoraError, match=r"not XLabs FLUX LoRA weights.*ffn_lora1"):
        L.read_lora(bad)
