"""The one-pass decoder of quantised weights (sdlite/kernels/dequant.py, dequant.cpp): bit for bit the PyTorch decoders
of sdlite/weights/quants.py for every type it takes, into float32 and bfloat16, on one thread and several; used by
QuantizedTensor.dequantize (and so by every GGUF, int8 and int4 layer); refused, with PyTorch's decoders running
instead, wherever it does not apply. (The PyTorch decoders and the kernel both meet the gguf package's numpy
reference in tests/test_gguf.py, which runs through QuantizedTensor.dequantize.)"""
from __future__ import annotations

import pytest
import torch

from sdlite.engine.lowbit import LowBitLinear
from sdlite.kernels import build
from sdlite.kernels import dequant
from sdlite.machine import CPUInfo
from sdlite.weights import quants
from sdlite.weights.quants import GGML_TYPES, QuantizedTensor

RUNS_HERE = dequant.cpu_problem() is None and build.compiler() is not None and not build.disabled()
GGML = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# where each type keeps its fp16 scales (bytes from the block's start)
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _random_blocks(name: str, blocks: int, seed: int = 0, finite: bool = True) -> torch.Tensor:
    """Random bytes of ``blocks`` blocks of ``name``; with ``finite`` its fp16 scales are random finite numbers of
    every exponent (subnormals and zero included), else left as random bytes (some NaN and infinite)."""
    t = GGML_TYPES[name]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (blocks, t.type_size), dtype=torch.uint8, generator=g)
    if finite:
        for at in HALVES[name]:
            bits = torch.randint(0, 1 << 16, (blocks,), generator=g, dtype=torch.int32)
            bits = torch.where((bits >> 10) & 0x1F == 0x1F, bits & ~(1 << 14), bits)  # no Inf / NaN exponent
            raw[:, at:at + 2] = bits.to(torch.int16).view(-1, 1).view(torch.uint8)
    return raw


def _torch_decode(t, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The PyTorch decoders' result, rounded once to ``dtype`` as QuantizedTensor.dequantize rounds it."""
    out = torch.empty(raw.shape[0], t.block_size, dtype=dtype)
    out[:] = t.decode(raw)
    return out


def _same_bits(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal bit for bit, where a NaN must stay a NaN (PyTorch's vector and scalar roundings to bf16 write different
    NaN bits)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(BITS[ref.dtype]), ref[~nan].view(BITS[ref.dtype]))


def _kernel(name, raw, dtype) -> torch.Tensor:
    t = GGML_TYPES[name]
    out = torch.full((raw.shape[0], t.block_size), 7.0, dtype=dtype)
    assert dequant.decode(name, t.block_size, t.type_size, raw.reshape(-1), out) is RUNS_HERE
    return out


@pytest.mark.parametrize("name", GGML)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_ggml_type_decodes_to_the_pytorch_decoders_bits(name, dtype):
    t = GGML_TYPES[name]
    raw = _random_blocks(name, 3001 if t.block_size == 32 else 801)
    ref = _torch_decode(t, raw, dtype)
    if not RUNS_HERE:  # refused, and the PyTorch decoders give the values
        assert not dequant.decode(name, t.block_size, t.type_size, raw.reshape(-1), torch.empty_like(ref))
        _same_bits(QuantizedTensor(raw.reshape(-1), name, tuple(ref.shape)).dequantize(dtype), ref)
        return
    _same_bits(_kernel(name, raw, dtype), ref)
    # one block; and the scales' NaN and infinities as they come (thread counts: the next test)
    _same_bits(_kernel(name, raw[:1], dtype), ref[:1])
    wild = _random_blocks(name, 2000, seed=1, finite=False)
    _same_bits(_kernel(name, wild, dtype), _torch_decode(t, wild, dtype))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_same_bits_on_any_thread_count(threads):
    """decode asks for one thread (dequant.THREADS); the kernel itself splits a tensor among as many as given."""
    raw = _random_blocks("Q4_K", 1000, seed=2)
    ref = _torch_decode(GGML_TYPES["Q4_K"], raw, torch.bfloat16)
    if not RUNS_HERE:
        assert isinstance(dequant._library(), str)
        return
    out = torch.empty_like(ref)
    assert dequant._library().sdl_dequant(raw.data_ptr(), dequant.KINDS["Q4_K"], 256, 144, 1000, out.data_ptr(), 1,
                                          threads) == 0
    _same_bits(out, ref)


@pytest.mark.parametrize("kind", ["I8_ROW", "I4_G64", "I4_G32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdlites_own_types_decode_to_the_pytorch_decoders_bits(kind, dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 384, generator=g) * 0.05
    w[5, 7] = 40.0  # a row with an outlier: its scale is far from the others'
    qt = quants.quantize_int8_rows(w) if kind == "I8_ROW" else quants.quantize_int4_groups(w, int(kind[4:]))
    t = qt.type
    raw = qt.data.view(-1, t.type_size)
    ref = _torch_decode(t, raw, dtype)
    out = torch.empty_like(ref)
    assert dequant.decode(t.name, t.block_size, t.type_size, qt.data, out) is RUNS_HERE
    if RUNS_HERE:
        _same_bits(out, ref)


def test_quantized_tensors_and_lowbit_layers_decode_through_it(monkeypatch):
    raw = _random_blocks("Q6_K", 48, seed=4)
    qt = QuantizedTensor(raw.reshape(-1), "Q6_K", (16, 768))
    calls = []
    real = dequant.decode
    monkeypatch.setattr(dequant, "decode", lambda *a: calls.append(a[0]) or real(*a))
    for dtype in (torch.float32, torch.bfloat16):
        _same_bits(qt.dequantize(dtype), _torch_decode(qt.type, raw, dtype).view(16, 768))
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(5))
    layer = LowBitLinear(qt, torch.zeros(16))
    expected = torch.nn.functional.linear(x, _torch_decode(qt.type, raw, torch.float32).view(16, 768), torch.zeros(16))
    assert torch.equal(layer(x), expected)
    assert calls == ["Q6_K"] * 3


def test_where_it_does_not_apply_the_pytorch_decoders_run(monkeypatch):
    raw = _random_blocks("Q8_0", 64, seed=6)
    t = GGML_TYPES["Q8_0"]
    # float16 output, a type it does not know, bytes that are not whole blocks, a strided output
    assert not dequant.decode("Q8_0", 32, 34, raw.reshape(-1), torch.empty(64, 32, dtype=torch.float16))
    assert not dequant.decode("IQ4_NL", 32, 18, raw.reshape(-1)[:18 * 64], torch.empty(64, 32))
    assert not dequant.decode("Q8_0", 32, 34, raw.reshape(-1)[:-1], torch.empty(64, 32))
    assert not dequant.decode("Q8_0", 32, 34, raw.reshape(-1), torch.empty(32, 128).t())
    # a size the kernel's own check refuses (Q8_0 is 34 bytes a block): it writes nothing
    out = torch.full((64, 32), 7.0)
    assert not dequant.decode("Q8_0", 32, 36, torch.zeros(64 * 36, dtype=torch.uint8), out)
    assert torch.all(out == 7.0)
    qt = QuantizedTensor(raw.reshape(-1), "Q8_0", (64, 32))
    _same_bits(qt.dequantize(torch.float16), _torch_decode(t, raw, torch.float16))
    # kernels turned off
    monkeypatch.setenv("SDLITE_KERNELS", "off")
    dequant._library.cache_clear()
    try:
        assert not dequant.decode("Q8_0", 32, 34, raw.reshape(-1), torch.empty(64, 32))
        assert "SDLITE_KERNELS" in dequant.status()
        _same_bits(qt.dequantize(torch.bfloat16), _torch_decode(t, raw, torch.bfloat16))
    finally:
        monkeypatch.delenv("SDLITE_KERNELS")
        dequant._library.cache_clear()


def test_a_cpu_without_avx2_is_named():
    cpu = CPUInfo(model="test cpu", arch="x86_64", cores=2, flags=frozenset({"sse4_1", "avx"}))
    assert "avx2" in dequant.cpu_problem(cpu)
    arm = CPUInfo(model="test cpu", arch="aarch64", cores=2, flags=frozenset({"neon"}))
    assert "x86" in dequant.cpu_problem(arm)
