"""``bf16-int8`` on a diffusion transformer (issue 55): W8A8 Linear layers in its blocks (sdlite.engine.quant).

* which layers: every Linear inside the block lists of each DiT family sdlite has (FLUX.1, SD3, Z-Image, FLUX.2
  [klein], Qwen-Image), but the per-block modulation Linears; nothing outside the blocks;
* the policy, per CPU (fake CPUs, so every machine asserts every case): accepted for a transformer where the CPU has
  native bf16 and VNNI/AMX, and ``auto``'s choice there; refused with the reason elsewhere and for ``int8-bf16``; fp8
  weight storage beside it refused by name, and taken by ``auto`` as bf16 (so are memory mode 0 and GGUF files);
* the Engine on this CPU: a tiny FLUX.1-schnell and a tiny Z-Image folder load with their block Linears as
  Int8Linear and draw images within a stated distance of exact's (and of bf16's own distance from exact), or, where
  this CPU lacks the features (the Makefile's AVX2-capped pass), the load is refused with the reason; memory mode 0 is
  refused by name; a GGUF transformer's block weights are dequantised, then quantised (no LowBitLinear);
* per-token activations: a transformer's int8 Linears scale each token apart (``quantize_rows``), sdlite's kernels
  giving PyTorch's own codes and products bit for bit, and a token far larger than the rest no longer costing the
  others their precision (one scale per call does).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sdlite.config.flux import FluxConfig
from sdlite.config.mmdit import MMDiTConfig
from sdlite.engine.cpu import bf16_int8_problem
from sdlite.engine.memory import MemoryModeError
from sdlite.engine.precision import PrecisionError, auto_choice, resolve, stored_as
from sdlite.engine.quant import (Int8Linear, bf16_int8_targets, psnr, quantize_model, quantize_rows, quantize_weight,
                                 requantize, scale_rows)
from sdlite.kernels import bf16 as kernels
from sdlite.machine import CPUInfo
from sdlite.models.flux import Flux
from sdlite.models.mmdit import MMDiT
from sdlite.pipeline import Engine, Request
from tests.test_flux_pipeline import PROMPT, SIZE, _pipeline as _flux_pipeline, _pixels
from tests.test_zimage_pipeline import _pipeline as _zimage_pipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# distance from exact's result at the tiny configs (2 Euler steps, 64x64; random weights, so no outlier channels),
# measured on a Zen 4 with AVX512-VNNI/BF16 (1 thread): FLUX latents 2.6e-2 relative (bf16 alone: 2.1e-2), image
# 40.9 dB; Z-Image 8.6e-2 (bf16: 4.8e-2), 31.8 dB. The bounds leave ~2x in the error (~4 dB); a broken quantisation
# (a wrong scale, a layer off) gives > 0.3 and < 20 dB
MAX_LATENT_REL = 0.15
MIN_PSNR_DB = 27.0
# int8's distance from exact as a multiple of bf16's own (the activations' 8 bits on top of bf16's rounding): 1.2x
# and 1.8x measured
MAX_OVER_BF16 = 3.0
STEPS = 2

ZEN4 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                  "avx512_vnni", "avx512_bf16"})
FLUX = FluxConfig(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
MMDIT = MMDiTConfig(sample_size=16, patch_size=2, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                    joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, pos_embed_max_size=16)


def cpu(flags, cap=None) -> CPUInfo:
    return CPUInfo(model="test cpu", arch="x86_64", cores=2, flags=frozenset(flags), onednn_cap=cap)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --- which layers ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [lambda: Flux(FLUX), lambda: MMDiT(MMDIT)], ids=["flux", "sd3"])
def test_targets_are_the_blocks_linears_but_their_modulation(build):
    with torch.device("meta"):
        net = build()
    targets = {name for name, _, split in bf16_int8_targets(net)}
    linears = {name for name, m in net.named_modules() if type(m) is nn.Linear}
    in_blocks = {n for n in linears if n.startswith(("transformer_blocks.", "single_transformer_blocks."))}
    modulation = {n for n in in_blocks if n.rsplit(".", 2)[-2] in ("norm1", "norm1_context", "norm")}
    assert modulation and targets == in_blocks - modulation
    assert any(n.endswith("attn.to_q") for n in targets) and any(".ff" in n or "proj_mlp" in n for n in targets)


# --- per-token activations ------------------------------------------------------------------------------------------

def _tokens(seed=0):
    """(2, 37, 100) bf16: tokens of magnitudes spread over 3 decades, one all zero; 100 columns (a kernel tail)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 37, 100, generator=g) * torch.logspace(-2, 1, 37)[None, :, None]
    x[1, 5] = 0
    return x.bfloat16()


@pytest.mark.parametrize("bits", [8, 7])
def test_row_codes_and_scales_equal_pytorch(bits, monkeypatch):
    """sdlite's per-row kernel gives the codes and scales of quantize_rows' PyTorch operations, bit for bit (where
    this CPU runs the kernel; elsewhere both calls are PyTorch's); the codes hold the shared zero point's range and
    decode to within half a step of each value."""
    x = _tokens()
    q, scales, zero_point = quantize_rows(x.clone(), bits)
    monkeypatch.setattr(kernels, "enabled", False)
    q_ref, scales_ref, zp_ref = quantize_rows(x.clone(), bits)
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref) and zero_point == zp_ref == 1 << (bits - 1)
    assert scales.shape == (2, 37) and scales[1, 5] == 1 and q[1, 5].eq(zero_point).all()
    assert q.min() >= 1 and q.max() == 2 * zero_point - 1
    decoded = (q.float() - zero_point) * scales.unsqueeze(-1)
    assert ((decoded - x.float()).abs() <= scales.unsqueeze(-1) * 0.5001).all()


def test_a_strided_input_gets_the_same_codes(monkeypatch):
    """An int8 layer's input sliced from a longer sequence at batch 2 (SD3's attention output per stream) reaches the
    per-row kernel (copied once) where this CPU runs it, with the codes PyTorch's arithmetic gives."""
    joint = torch.cat([_tokens(), _tokens(1)], dim=1)                      # (2, 74, 100)
    part = joint[:, 10:47]
    assert not part.is_contiguous()
    assert (kernels.row_codes(part, 127.0, 128.0) is not None) == (kernels.row_codes(part.contiguous(), 127.0, 128.0)
                                                                   is not None)
    q, scales, _ = quantize_rows(part)
    monkeypatch.setattr(kernels, "enabled", False)
    q_ref, scales_ref, _ = quantize_rows(part)
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref) and q.shape == part.shape


def test_row_scaling_equals_pytorch(monkeypatch):
    y = _tokens(1)
    scales, bias = torch.rand(2, 37) + 0.5, torch.randn(100)
    got = [scale_rows(y.clone(), scales, b) for b in (bias, None)]
    monkeypatch.setattr(kernels, "enabled", False)
    want = [scale_rows(y.clone(), scales, b) for b in (bias, None)]
    assert all(torch.equal(a, b) and a.dtype == torch.bfloat16 for a, b in zip(got, want))
    assert torch.equal(want[0], (y.float() * scales.unsqueeze(-1) + bias).bfloat16())


def test_non_finite_tokens_are_refused():
    x = _tokens()
    x[0, 3, 7] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        quantize_rows(x)


def test_a_loud_token_costs_only_its_own_precision():
    """One token 1000x the others (a text token beside image tokens in a joint sequence): with one scale per call the
    other tokens lose most of their bits; with one per token their error stays that of 8 bits."""
    g = torch.Generator().manual_seed(2)
    linear = nn.Linear(64, 48).bfloat16()
    x = torch.randn(1, 20, 64, generator=g).bfloat16()
    x[0, 0] *= 1000
    exact = nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    quiet = slice(1, None)
    errors = {}
    for per_token in (False, True):
        out = Int8Linear(linear, 8, stored_as=torch.bfloat16, per_token=per_token)(x.clone())
        errors[per_token] = _relative(out[0, quiet], exact[0, quiet])
    assert errors[True] < 0.02 < 0.2 < errors[False]


def test_transformers_take_per_token_activations_and_unets_per_call():
    from sdlite.models.unet import UNet
    from tests.reference import TINY_UNET_SD1

    if bf16_int8_problem() is not None:
        return
    flux, unet = Flux(FLUX).bfloat16(), UNet(TINY_UNET_SD1).bfloat16()
    quantize_model(flux, "bf16-int8")
    quantize_model(unet, "bf16-int8")
    flux_int8 = [m for m in flux.modules() if isinstance(m, Int8Linear)]
    unet_int8 = [m for m in unet.modules() if isinstance(m, Int8Linear)]
    assert flux_int8 and all(m.per_token for m in flux_int8)
    assert unet_int8 and not any(m.per_token for m in unet_int8)
    again = requantize(flux_int8[0], torch.randn(flux_int8[0].out_features, flux_int8[0].in_features))
    assert again.per_token and "per token" in repr(again)


# --- the policy, per CPU ---------------------------------------------------------------------------------------------

def test_policy_per_cpu():
    from sdlite.config.flux import FLUX_SCHNELL_MODEL as FLUX_SCHNELL

    plan = resolve("bf16-int8", "cpu", cpu(ZEN4), spec=FLUX_SCHNELL)
    assert (plan.name, plan.quantize, plan.dtype, plan.lowbit) == ("bf16-int8", "bf16-int8", torch.bfloat16, "none")
    chosen, why = auto_choice("cpu", cpu(ZEN4), FLUX_SCHNELL)
    assert chosen == "bf16-int8" and "transformer's blocks in int8" in why   # auto's, with native bf16 and VNNI
    assert auto_choice("cpu", cpu(ZEN4 - {"avx512_vnni"}), FLUX_SCHNELL)[0] == "bf16"
    auto = resolve("auto", "cpu", cpu(ZEN4), spec=FLUX_SCHNELL)
    assert stored_as(auto, "fp8_e4m3fn", FLUX_SCHNELL).lowbit == "fp8_e4m3fn"   # the engine takes bf16 then
    with pytest.raises(PrecisionError, match=r"'bf16-int8' needs native bf16.*ONEDNN_MAX_CPU_ISA=AVX2"):
        resolve("bf16-int8", "cpu", cpu(ZEN4, "AVX2"), spec=FLUX_SCHNELL)
    with pytest.raises(PrecisionError, match=r"'bf16-int8' needs exact 8-bit int8 products"):
        resolve("bf16-int8", "cpu", cpu(ZEN4 - {"avx512_vnni"}), spec=FLUX_SCHNELL)
    with pytest.raises(PrecisionError, match=r"'int8-bf16' quantizes a UNet's layers.*--precision bf16-int8"):
        resolve("int8-bf16", "cpu", cpu(ZEN4), spec=FLUX_SCHNELL)
    with pytest.raises(PrecisionError, match="oneDNN's CPU kernels"):
        resolve("bf16-int8", "cuda", spec=FLUX_SCHNELL)
    with pytest.raises(PrecisionError, match="both say how the transformer's"):
        stored_as(plan, "fp8_e4m3fn", FLUX_SCHNELL)


# --- the Engine on this CPU ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux_int8")
    _flux_pipeline(tmp, "schnell")
    return tmp / "schnell"


@pytest.fixture(scope="module")
def zimage(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage_int8") / "z-image"
    _zimage_pipeline(folder)
    return folder


def _load_or_refused(folder, **kw):
    """The bf16-int8 engine, or None where this CPU refuses it (the refusal checked against the CPU's features)."""
    problem = bf16_int8_problem()
    if problem is not None:
        with pytest.raises(PrecisionError, match="'bf16-int8' needs"):
            Engine.load(folder, precision="bf16-int8", **kw)
        return None
    return Engine.load(folder, precision="bf16-int8", **kw)


def _generate(engine, **kw):
    return engine.generate(Request(prompt=PROMPT, steps=STEPS, seed=1, width=SIZE, height=SIZE, sampler="euler", **kw))


@pytest.mark.parametrize("family", ["flux", "zimage"])
def test_block_linears_are_int8_and_the_image_stays_near_exact(family, request):
    folder = request.getfixturevalue(family)
    engine = _load_or_refused(folder)
    if engine is None:
        return
    transformer = engine.models.get("transformer")
    int8 = {name for name, m in transformer.named_modules() if isinstance(m, Int8Linear)}
    kept = {name for name, m in transformer.named_modules() if type(m) is nn.Linear}
    assert int8 == {name for name, _, _ in bf16_int8_targets(engine.models.ckpt.build_empty("transformer"))}
    assert len(int8) == (2 * 12 + 2 * 5 if family == "flux" else 4 * 7)
    assert all(n.split(".")[0] in ("transformer_blocks", "single_transformer_blocks", "layers", "noise_refiner",
                                   "context_refiner") for n in int8)
    modulation = {n for n in kept if n.endswith(("norm1.linear", "norm1_context.linear", "norm.linear",
                                                 "adaLN_modulation.0"))}
    assert modulation, "the per-block modulation Linears stay bf16"
    assert engine.precision.label == "bf16-int8" and transformer.dtype == torch.bfloat16

    exact = Engine.load(folder, precision="exact")
    bf16 = Engine.load(folder, precision="bf16")
    ref, got, half = _generate(exact), _generate(engine), _generate(bf16)
    rel, rel_bf16 = _relative(got.latents, ref.latents), _relative(half.latents, ref.latents)
    db = psnr(torch.tensor(_pixels(got.images)).float(), torch.tensor(_pixels(ref.images)).float())
    print(f"{family} bf16-int8 against exact: latents {rel:.2e} relative (bf16: {rel_bf16:.2e}), image {db:.1f} dB")
    assert rel <= MAX_LATENT_REL and rel <= MAX_OVER_BF16 * rel_bf16
    assert MIN_PSNR_DB <= db < float("inf") and _pixels(ref.images).std() > 10


def test_auto_takes_bf16_where_int8_layers_cannot_be(flux, monkeypatch):
    """auto's bf16-int8 for a transformer gives way to bf16, saying why, where the transformer is streamed (memory
    mode 0), kept in fp8 (weight storage) or read from a GGUF file (its blocks kept as the file holds them)."""
    from sdlite.engine.lowbit import in_gguf
    from sdlite.pipeline import engine as engine_module

    auto = Engine.load(flux)
    if bf16_int8_problem() is not None:
        assert auto.precision.name != "bf16-int8"
        return
    assert auto.precision.label == "bf16-int8 (auto)" and not in_gguf(auto.models.ckpt, "transformer")
    assert isinstance(auto.models.get("transformer").get_submodule("transformer_blocks.0.attn.to_q"), Int8Linear)
    for kw, why in ((dict(memory_mode=0), "streamed block by block"), (dict(weight_storage="fp8_e4m3fn"), "fp8"),
                    ({}, "GGUF")):
        if why == "GGUF":
            monkeypatch.setattr(engine_module, "in_gguf", lambda ckpt, component: component == "transformer")
        plan = Engine.load(flux, **kw).precision
        assert plan.label == "bf16 (auto)" and why in plan.reason, (kw, plan.reason)


def test_memory_mode_0_is_refused_by_name(flux):
    if bf16_int8_problem() is not None:
        return _load_or_refused(flux, memory_mode=0)
    with pytest.raises(MemoryModeError, match=r"bf16-int8.*transformer.*memory mode 0.*--precision bf16"):
        Engine.load(flux, precision="bf16-int8", memory_mode=0)


def test_gguf_block_weights_are_dequantised_then_quantised(flux, monkeypatch):
    """A GGUF transformer (its block Linears in Q8_0) under bf16-int8: Int8Linears whose codes are those of the Q8_0
    values, not LowBitLinears that dequantise per call."""
    import gguf

    from sdlite.engine import memory
    from sdlite.engine.lowbit import LowBitLinear
    from sdlite.weights.quants import QuantizedTensor

    if bf16_int8_problem() is not None:
        return _load_or_refused(flux)
    engine = Engine.load(flux, precision="bf16-int8")
    ckpt = engine.models.ckpt
    module = ckpt.build_empty("transformer")
    keys = [f"{name}.weight" for name, layer in module.named_modules()
            if type(layer) is nn.Linear and layer.in_features % 32 == 0]
    blocks = {}
    for key in keys:
        dense = ckpt.tensor("transformer", key).float().numpy()
        raw = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0)
        blocks[key] = QuantizedTensor(torch.from_numpy(raw.reshape(-1).copy()), "Q8_0", dense.shape)
    plain = ckpt.tensor
    monkeypatch.setattr(memory, "quantized_linears", lambda c, name: dict(blocks) if name == "transformer" else {})
    monkeypatch.setattr(ckpt, "tensor", lambda component, key: blocks[key] if component == "transformer"
                        and key in blocks else plain(component, key))
    engine.models._resident.pop("transformer")
    transformer = engine.models.get("transformer")
    assert not any(isinstance(m, LowBitLinear) for m in transformer.modules())
    name = "transformer_blocks.0.attn.to_q"
    layer = transformer.get_submodule(name)
    assert isinstance(layer, Int8Linear)
    _, want = quantize_weight(blocks[f"{name}.weight"].dequantize(torch.bfloat16), torch.bfloat16)
    assert torch.equal(layer.weight_scale, want)
    assert type(transformer.get_submodule("transformer_blocks.0.norm1.linear")) is nn.Linear
    assert _generate(engine).images[0].size == (SIZE, SIZE)
