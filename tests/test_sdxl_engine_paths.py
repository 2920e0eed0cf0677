"""The lean CPU paths on SDXL's UNet (tiny base and refiner configs), against our plain fp32 UNet: weights streamed
block by block (memory mode 0, and half-precision stored weights computed in fp32), int8 / bf16 quantisation and
prepacked oneDNN weights. SDXL adds what SD 1.x/2.x lack: the added-conditioning MLP (``add_embedding``) fed
with the pooled text embedding and the size/crop ids, Linear projections in every transformer and transformer
depths above 1."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

from sdlite.engine.memory import WeightStreamer, stream_units
from sdlite.engine.packing import PackedConv2d, PackedLinear, prepack_model
from sdlite.engine.quant import (
    BF16Linear, BF16Warning, Int8Linear, QuantizeError, layer_counts, quantize_model,
)
from sdlite.models.unet import UNet
from tests.reference import max_rel_err, seed_all
from tests.test_quant import BF16_REFUSED, check_int8_layers_against_emulation, cosine, min_cosine_for
from tests.test_sdxl_unet import TINY_REFINER, TINY_SDXL

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py

BASE = pytest.param(TINY_SDXL, id="base")
REFINER = pytest.param(TINY_REFINER, id="refiner")
# the MLPs on one vector per sample, kept in fp32 by quantisation (engine.quant.KEEP_FP32)
EMBEDDING_LAYERS = ("time_embedding.linear_1", "time_embedding.linear_2", "add_embedding.linear_1",
                    "add_embedding.linear_2")


@functools.cache
def tiny_unet(cfg) -> UNet:
    """The fp32 reference, built once per config: tests copy it before changing anything."""
    torch.manual_seed(0)
    return seed_all(UNet(cfg).eval().requires_grad_(False), 0, scale=0.05)


def copy_of(cfg) -> UNet:
    """A copy of :func:`tiny_unet` to change (built on the meta device and given cloned weights: faster than
    ``copy.deepcopy``)."""
    with torch.device("meta"):
        unet = UNet(cfg)
    unet.load_state_dict({k: v.clone() for k, v in tiny_unet(cfg).state_dict().items()}, strict=True, assign=True)
    return unet.eval().requires_grad_(False)


def inputs(cfg, crop=0.0):
    """Latents, timesteps, context, pooled text and time ids as the SDXL pipeline sends them (batch 2, CFG)."""
    g = torch.Generator().manual_seed(1)
    n_ids = 6 if cfg is TINY_SDXL else 5
    pooled = cfg.add_embed_in - n_ids * cfg.addition_time_embed_dim
    ids = ([1024.0, 1024.0, crop, 0.0, 1024.0, 1024.0] if n_ids == 6 else [1024.0, 1024.0, crop, 0.0, 6.0])
    return (torch.randn(2, cfg.in_channels, 16, 16, generator=g), torch.tensor([20.0, 700.0]),
            torch.randn(2, 7, cfg.context_dim, generator=g), torch.randn(2, pooled, generator=g),
            torch.tensor([ids, ids]))


def run(unet, args):
    x, t, ctx, pooled, time_ids = args
    with torch.no_grad():
        return unet(x, t, ctx, text_embeds=pooled, time_ids=time_ids)


@functools.cache
def expected(cfg, crop=0.0) -> torch.Tensor:
    return run(tiny_unet(cfg), inputs(cfg, crop))


@pytest.fixture(scope="module", autouse=True)
def _free_the_shared_models():
    yield
    tiny_unet.cache_clear()
    expected.cache_clear()


# --- weights streamed block by block ----------------------------------------------------------------------------


def streamed(cfg, stored: dict[str, torch.Tensor], released: list) -> UNet:
    """A UNet with no resident weights whose blocks take theirs from ``stored`` while they run, as
    engine.memory.streamed_model builds it from a checkpoint."""
    with torch.device("meta"):
        unet = UNet(cfg)
    unet._streamer = WeightStreamer(unet, stored.__getitem__, torch.float32, "cpu", release=lambda: released.append(1))
    return unet.eval().requires_grad_(False)


@pytest.mark.parametrize("cfg", [BASE, REFINER])
def test_streamed_weights_equal_the_resident_model(cfg):
    """Memory mode 0: bit for bit the resident model's output, nothing resident between blocks."""
    resident = tiny_unet(cfg)
    released = []
    unet = streamed(cfg, resident.state_dict(), released)
    units = [name for name, _ in unet._streamer.units]
    assert set(EMBEDDING_LAYERS) <= set(units)
    assert sum(sum(p.numel() for p in u.parameters()) for _, u in stream_units(unet)) == \
        sum(p.numel() for p in resident.parameters())
    for _ in range(2):                                   # the hooks put the placeholders back after each block
        assert torch.equal(run(unet, inputs(cfg)), expected(cfg))
        assert all(p.is_meta for p in unet.parameters())
    assert len(released) == 2 * len(units)              # each block ran once per call and let its weights go
    # the added conditioning reaches the streamed blocks: other crop ids, the resident model's other output
    moved = run(unet, inputs(cfg, crop=64.0))
    assert torch.equal(moved, expected(cfg, 64.0)) and not torch.equal(moved, expected(cfg))


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_stored_weights_computed_in_fp32(weight_dtype):
    """--weight-dtype: weights kept in half precision, each block up-cast while it runs; bit for bit the fp32 model
    with its weights rounded to that dtype, and within that rounding of the fp32 model."""
    cfg = TINY_SDXL
    stored = {k: v.to(weight_dtype) for k, v in tiny_unet(cfg).state_dict().items()}
    unet = streamed(cfg, stored, [])
    with torch.device("meta"):
        rounded = UNet(cfg).eval()
    rounded.load_state_dict({k: v.float() for k, v in stored.items()}, strict=True, assign=True)
    got = run(unet, inputs(cfg))
    assert torch.equal(got, run(rounded, inputs(cfg)))
    assert all(p.is_meta for p in unet.parameters())
    # the weights' relative rounding (2^-11 for fp16, 2^-8 for bf16), carried through the network
    assert 0 < max_rel_err(got, expected(cfg)) <= (5e-3 if weight_dtype == torch.float16 else 3e-2)


# --- quantisation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg, mode, min_cosine", [(TINY_SDXL, "int8", 0.999), (TINY_REFINER, "int8", 0.999),
                                                   (TINY_SDXL, "int8-bf16", 0.9999), (TINY_SDXL, "bf16", 0.9999)],
                         ids=["int8-base", "int8-refiner", "int8-bf16-base", "bf16-base"])
def test_quantized_sdxl_unet_close_to_fp32(cfg, mode, min_cosine):
    """The thresholds of test_quant.py for the same modes (7-bit activations without VNNI: 4x the 1 - cosine)."""
    if "bf16" in mode and BF16_REFUSED:
        with pytest.raises(QuantizeError, match="needs bf16 kernels"):
            quantize_model(copy_of(cfg), mode)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BF16Warning)   # bf16 emulated with AVX-512 (tested in test_quant.py)
        q = quantize_model(copy_of(cfg), mode)
    got = run(q, inputs(cfg))
    assert got.dtype == torch.float32 and got.shape == expected(cfg).shape
    assert cosine(got, expected(cfg)) > min_cosine_for(min_cosine, mode)
    assert not torch.equal(got, expected(cfg))
    counts = layer_counts(q)
    # stem, head and both embedding MLPs in fp32; every other Linear and Conv2d converted, the transformers'
    # Linear projections included
    assert counts["Conv2d"] == 2 and counts["Linear"] == len(EMBEDDING_LAYERS)
    linear_kind = BF16Linear if mode == "bf16" else Int8Linear
    first_attention = next(name for name, _ in q.named_modules() if name.endswith("attentions.0"))
    for name in ("proj_in", "proj_out", "transformer_blocks.0.attn2.to_k", "transformer_blocks.0.ff.net.0.proj"):
        assert type(q.get_submodule(f"{first_attention}.{name}")) is linear_kind, name
    assert type(q.get_submodule("down_blocks.0.resnets.0.time_emb_proj")) is linear_kind
    if mode == "int8":
        # the size/crop ids and the pooled text go through the fp32 MLP unchanged (their effect on the whole
        # output, about 1e-3 of it here, is below the int8 noise, so only that it moves can be checked there)
        _, _, _, pooled, time_ids = inputs(cfg)
        reference = tiny_unet(cfg)
        with torch.no_grad():
            assert torch.equal(q._added_embedding(pooled, time_ids, 2, torch.float32),
                               reference._added_embedding(pooled, time_ids, 2, torch.float32))
        assert not torch.equal(run(q, inputs(cfg, crop=64.0)), got)


def test_int8_sdxl_layers_equal_their_emulation():
    """Every int8 layer of the SDXL UNet, on the activations it really gets, against exact integer arithmetic
    (test_quant.emulate): oneDNN's kernels hold at these shapes and with this CPU's activation bits."""
    cfg = TINY_SDXL
    q = quantize_model(copy_of(cfg), "int8")
    check_int8_layers_against_emulation(tiny_unet(cfg), q, lambda: run(q, inputs(cfg)))


# --- prepacked weights --------------------------------------------------------------------------------------------


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("cfg", [BASE, REFINER])
def test_prepacked_sdxl_unet_equals_plain(cfg):
    """fp32 rounding apart (test_packing.py's tolerance), the plain model's output; every layer prepacked."""
    packed = prepack_model(copy_of(cfg))
    kinds = {type(m) for m in packed.modules()}
    assert nn.Conv2d not in kinds and nn.Linear not in kinds
    assert isinstance(packed.add_embedding.linear_1, PackedLinear) and isinstance(packed.conv_in, PackedConv2d)
    assert packed.dtype == torch.float32
    assert _rel(run(packed, inputs(cfg)), expected(cfg)) < 1e-5
    assert _rel(run(packed, inputs(cfg, crop=64.0)), expected(cfg, 64.0)) < 1e-5


def test_int8_then_prepacked_as_the_engine_builds_it():
    """Memory modes 1 and 2 with --quantize int8 quantise the UNet and then prepack what stayed fp32 (stem, head,
    the embedding MLPs)."""
    cfg = TINY_SDXL
    q = prepack_model(quantize_model(copy_of(cfg), "int8"))
    kinds = {type(m) for m in q.modules()}
    assert nn.Linear not in kinds and nn.Conv2d not in kinds
    assert all(isinstance(q.get_submodule(name), PackedLinear) for name in EMBEDDING_LAYERS)
    assert cosine(run(q, inputs(cfg)), expected(cfg)) > min_cosine_for(0.999, "int8")
