"""Few-step LoRAs (LCM-LoRA, TCD, Hyper-SD, SDXL-Lightning, DMD2) in the key layouts they are published in, merged by
sdlite into a tiny SD 1.x-shaped and a tiny SDXL-shaped UNet, against diffusers' ``load_lora_weights`` +
``fuse_lora`` on the same weights (diffusers' loader reads all of these files; it is the independent reference).

The layouts, as their publishers' code writes them (facts taken from that code, the writers below are ours):

* ``kohya-diffusers-names``: ``lora_unet_<diffusers module path, "." -> "_">.lora_down.weight`` / ``.lora_up.weight``
  / ``.alpha`` per layer, the UNet only, no metadata. LCM-LoRA (latent-consistency/lcm-lora-sdv1-5 and
  lcm-lora-sdxl: the LCM repository's kohya conversion of its peft adapter, ``lora_unet_up_blocks_2_attentions_0_
  proj_in.lora_up.weight``, factors and alpha in the saving dtype, fp16), SDXL-Lightning's LoRAs (the same key set
  as lcm-lora-sdxl: the two files differ by 32 header bytes), DMD2's (tianweiy/DMD2 ``extract_lora_module.py``:
  rank 64, alpha 8, fp32 factors and alpha, or both fp16 for the ``_fp16`` file). The layers are these trainers'
  target list: attention projections, ``proj_in`` / ``proj_out`` (1x1 convolutions on SD 1.x, linear on SDXL),
  the feed-forward, the ResBlocks' ``conv1`` / ``conv2`` (3x3 LoCon), ``conv_shortcut`` and ``time_emb_proj``,
  the down- and upsamplers' 3x3 convolutions.
* ``kohya-no-alpha``: the same keys without ``.alpha`` (a scale of 1, as A1111 and diffusers take it).
* ``diffusers-script``: what a diffusers training script that saves through ``convert_state_dict_to_diffusers``
  writes: ``unet.<path>.lora.down.weight`` / ``.lora.up.weight`` for the attention projections (that renaming
  table touches only ``to_q`` / ``to_k`` / ``to_v`` / ``to_out.0``) and ``unet.<path>.lora_A.weight`` /
  ``.lora_B.weight`` for every other layer, in one file, no alpha. diffusers' own loader renames the legacy
  spelling only when the file's first key has it, and otherwise leaves those layers out (with a warning), so its
  reference here is the same factors in the uniform spelling, ``peft-no-alpha``.

TCD's (h1t/TCD-SD15-LoRA, TCD-SDXL-LoRA) and Hyper-SD's LoRAs come without the code that wrote them; the spellings
they can have are the ones above (kohya with diffusers' names, with or without alphas, or a diffusers script's
save) and the PEFT / kohya-SGM ones below.

* ``peft-no-alpha`` (the reference's spelling only): ``unet.<path>.lora_A.weight`` / ``.lora_B.weight``, no alpha.

The PEFT layouts with and without diffusers' ``lora_adapter_metadata`` are tests/test_lora.py's and
tests/test_lora_sdxl.py's, kohya's SDXL files in Stability's SGM block names (``lora_unet_input_blocks_4_1_...``)
tests/test_lora_sdxl.py's.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from sdlite.adapters import lora as L
from sdlite.models.unet import UNet
from tests.reference import TINY_UNET_SD1, diffusers_unet, seed_all
from tests.test_sdxl_pipeline import UNET_BASE

pytest.importorskip("peft", reason="the reference (diffusers' load_lora_weights) needs the PEFT backend")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the LCM-LoRA / DMD2 trainers' LoRA target modules (peft suffixes)
FEWSTEP_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1",
                   "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj")
ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")
RANK, ALPHA = 4, 8.0     # alpha != rank, as published (rank 64, alpha 8): a scale that a reader can get wrong


# --- the published layouts ----------------------------------------------------------------------------------------


def _targets(unet: torch.nn.Module) -> list[str]:
    return sorted(name for name, m in unet.named_modules()
                  if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
                  and any(name == t or name.endswith("." + t) for t in FEWSTEP_TARGETS))


def factors_for(unet: torch.nn.Module, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (down, up) for every few-step target layer: LoCon factors (a kxk ``down``, a 1x1 ``up``) on the
    convolutions; as strong as a layer's own weights."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in _targets(unet):
        shape = tuple(unet.get_submodule(name).weight.shape)
        fan_in = 1
        for n in shape[1:]:
            fan_in *= n
        down = torch.randn((RANK, *shape[1:]), generator=g) / fan_in ** 0.5
        up = torch.randn((shape[0], RANK, *([1, 1] if len(shape) == 4 else [])), generator=g) * 0.5 / RANK ** 0.5
        out[name] = (down, up)
    return out


def write_layout(layout: str, factors, path, dtype=torch.float16):
    state, metadata = {}, None
    for name, (down, up) in factors.items():
        down, up = down.to(dtype).clone(), up.to(dtype).clone()
        if layout in ("kohya-diffusers-names", "kohya-no-alpha"):
            key = "lora_unet_" + name.replace(".", "_")
            state[f"{key}.lora_down.weight"], state[f"{key}.lora_up.weight"] = down, up
            if layout == "kohya-diffusers-names":
                state[f"{key}.alpha"] = torch.tensor(ALPHA, dtype=dtype)
        elif layout == "diffusers-script":
            legacy = name.endswith(ATTENTION_PROJECTIONS)
            state[f"unet.{name}.lora.down.weight" if legacy else f"unet.{name}.lora_A.weight"] = down
            state[f"unet.{name}.lora.up.weight" if legacy else f"unet.{name}.lora_B.weight"] = up
            metadata = {"format": "pt"}
        elif layout == "peft-no-alpha":
            state[f"unet.{name}.lora_A.weight"], state[f"unet.{name}.lora_B.weight"] = down, up
            metadata = {"format": "pt"}
        else:
            raise AssertionError(layout)
    save_file(state, str(path), metadata=metadata)
    return path


# (family, layout, factor dtype, multiplier, alpha the file means), named by the files published so; the SDXL
# LoRAs' layout once more in fp32 (DMD2's dmd2_sdxl_4step_lora.safetensors)
CASES = {
    "sd15-lcm-fp16": ("sd1", "kohya-diffusers-names", torch.float16, 1.0, ALPHA),
    "sd15-kohya-no-alpha": ("sd1", "kohya-no-alpha", torch.float16, 0.8, None),
    "sdxl-lcm-lightning-fp16": ("sdxl", "kohya-diffusers-names", torch.float16, 1.0, ALPHA),
    "sdxl-dmd2-fp32": ("sdxl", "kohya-diffusers-names", torch.float32, 0.75, ALPHA),
    "sdxl-diffusers-script": ("sdxl", "diffusers-script", torch.float32, 1.0, None),
}


# --- fixtures -----------------------------------------------------------------------------------------------------


def _pipeline_with(family: str, unet):
    """A diffusers pipeline holding only ``unet`` (what load_lora_weights needs for a UNet-only LoRA)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    if family == "sd1":
        return StableDiffusionPipeline(vae=None, text_encoder=None, tokenizer=None, unet=unet,
                                       scheduler=EulerDiscreteScheduler(), safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
    return StableDiffusionXLPipeline(vae=None, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                     tokenizer_2=None, unet=unet, scheduler=EulerDiscreteScheduler())


@pytest.fixture(scope="module")
def nets():
    """family -> (diffusers' pipeline with the tiny UNet, sdlite's UNet with the same weights, the LoRA's
    factors), built when first asked for."""
    built = {}

    def get(family):
        if family not in built:
            cfg = {"sd1": TINY_UNET_SD1, "sdxl": UNET_BASE}[family]
            theirs = seed_all(diffusers_unet(cfg), 5, scale=0.05)
            ours = UNet(cfg).eval()
            ours.load_state_dict(theirs.state_dict(), strict=True)
            built[family] = _pipeline_with(family, theirs), ours, factors_for(ours, seed=11)
        return built[family]

    return get


def diffusers_fused(pipe, path, weight) -> dict[str, torch.Tensor]:
    """The UNet's weights after diffusers' load_lora_weights + fuse_lora(lora_scale=weight); undone after."""
    pipe.load_lora_weights(str(path), adapter_name="x")
    try:
        pipe.fuse_lora(lora_scale=weight, adapter_names=["x"])
        return {k.replace(".base_layer.", "."): v.clone() for k, v in pipe.unet.state_dict().items()
                if "lora_" not in k}
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


# --- tests --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_fewstep_layout_merges_as_diffusers_does(nets, tmp_path, case):
    """sdlite reads the file (every layer, its factors and its scale multiplier * alpha / rank, or the multiplier
    alone without an alpha) and merges it into the UNet to diffusers' fused weights within fp32 rounding; exactly
    the file's layers change; restore() gives the UNet back bit for bit."""
    family, layout, dtype, weight, alpha = CASES[case]
    pipe, unet, factors = nets(family)
    path = write_layout(layout, factors, tmp_path / f"{case}.safetensors", dtype)

    lora = L.read_lora(path)
    assert lora.components() == ["unet"] and lora.made_for_unet
    names = L.resolve_targets(unet, lora, "unet")
    by_module = {names[layer.key]: layer for layer in lora.layers}
    assert sorted(by_module) == sorted(factors)
    for name, layer in by_module.items():
        assert torch.equal(layer.down.float(), factors[name][0].to(dtype).float()), name
        assert torch.equal(layer.up.float(), factors[name][1].to(dtype).float()), name
        assert layer.scale(weight) == pytest.approx(weight * (alpha / RANK if alpha is not None else 1.0)), name

    reference = path
    if layout == "diffusers-script":   # what diffusers reads whole: the same factors in one spelling
        reference = write_layout("peft-no-alpha", factors, tmp_path / "uniform.safetensors", dtype)
    expected = diffusers_fused(pipe, reference, weight)
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    handle = L.merge(unet, [(path, weight)], "unet")
    try:
        got = unet.state_dict()
        assert got.keys() == expected.keys()
        changed = sorted(k.removesuffix(".weight") for k in got if not torch.equal(got[k], before[k]))
        assert changed == sorted(factors)                      # every layer of the file, no other
        worst = max(((got[k] - expected[k]).abs().max() / (expected[k] - before[k]).abs().max()).item()
                    for k in got if k.removesuffix(".weight") in factors)
        assert worst < 1e-5, worst
        assert all(torch.equal(got[k], expected[k]) for k in got if k.removesuffix(".weight") not in factors)
    finally:
        handle.restore()
    assert all(torch.equal(v, before[k]) for k, v in unet.state_dict().items())
