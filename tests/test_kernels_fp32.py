"""sdlite's fp32 kernels for AVX2 (sdlite/kernels/fp32.py, avx2_fp32.cpp) and the fp32-fast precision that uses them:
attention and GEGLU against float64 references (as close as PyTorch's own fp32 operations come), the same bits on
any thread count, used only where a model is marked for them (never on the exact path), and fp32-fast's images
against exact's."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sdlite.demo import model_path
from sdlite.engine.cpu import CPUInfo
from sdlite.engine.precision import PrecisionError, resolve
from sdlite.kernels import build
from sdlite.kernels import fp32 as kf
from sdlite.models.layers import Attention
from sdlite.models.unet import GEGLU
from sdlite.pipeline import Engine, Request

RUNS_HERE = kf.cpu_problem() is None and build.compiler() is not None and not build.disabled()
needs_kernels = pytest.mark.skipif(not RUNS_HERE, reason="the fp32 kernels do not run on this machine")
# (batch, heads, queries, keys, head dim): SD 1.x's three levels (head dims 40, 80, 160), self and cross (77 keys),
# SD 2.x/SDXL's 64, the VAE's single 512-wide head, and odd sizes (tails of every block and register tile)
SHAPES = [(2, 8, 1024, 1024, 40), (2, 8, 1024, 77, 40), (2, 8, 256, 256, 80), (2, 8, 256, 77, 160),
          (2, 10, 256, 256, 64), (1, 1, 256, 256, 512), (2, 9, 277, 277, 13), (1, 5, 1000, 333, 40),
          (2, 2, 503, 1029, 33), (1, 3, 7, 5, 6)]


def _qkv(b, h, n, m, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (B, tokens, h, D) transposed, as Attention lays them out
    q = (torch.randn(b, n, h, d, generator=g) * 2).transpose(1, 2)
    k = (torch.randn(b, m, h, d, generator=g) * 2).transpose(1, 2)
    v = torch.randn(b, m, h, d, generator=g).transpose(1, 2)
    return q, k, v


def _snr(x, ref):
    return 10 * math.log10(ref.pow(2).mean() / (x.double() - ref).pow(2).mean())


def _reference(q, k, v):
    """float64 attention, as (B, N, h*D)."""
    b, h, n, d = q.shape
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double()).transpose(1, 2).reshape(b, n, h * d)


def _cpu(flags, cap=None):
    return CPUInfo(model="test cpu", arch="x86_64", cores=2, flags=frozenset(flags), onednn_cap=cap)


def test_cpu_problem_names_what_is_missing():
    assert "avx2" in kf.cpu_problem(_cpu({"sse4_1", "avx", "fma"}))
    assert "fma" in kf.cpu_problem(_cpu({"sse4_1", "avx", "avx2"}))
    assert kf.cpu_problem(_cpu({"avx", "avx2", "fma"})) is None
    assert kf.cpu_problem(_cpu({"avx", "avx2", "fma", "avx512f"}, cap="AVX2")) is None   # the cap keeps AVX2
    assert "x86" in kf.cpu_problem(CPUInfo(model="x", arch="aarch64", cores=2, flags=frozenset({"asimd"})))


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_matches_float64_as_closely_as_pytorchs_fp32_kernel(shape):
    q, k, v = _qkv(*shape)
    ref = _reference(q, k, v)
    got = torch.ops.sdlite.attention_f32(q, k, v)
    b, h, n, d = q.shape
    torch_fp32 = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, h * d)
    assert got.shape == ref.shape and got.dtype == torch.float32
    # fp32 rounding on both (~120 dB here); the exp2 polynomial and the longer sums cost a few dB at most
    assert _snr(got, ref) >= _snr(torch_fp32, ref) - 10 and _snr(got, ref) > 100, (_snr(got, ref),
                                                                                    _snr(torch_fp32, ref))
    assert (got.double() - ref).abs().max() < 1e-4


@needs_kernels
def test_attention_takes_large_scores_and_strided_inputs():
    """Scores up to ~500 (softmax saturates: the running maximum must keep it finite) and q, k, v that are views of
    one fused projection (token stride 3 h D)."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 300, 3, 4, 32, generator=g) * 4
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))          # (2, 4, 300, 32), strided
    got = torch.ops.sdlite.attention_f32(q, k, v)
    ref = _reference(q, k, v)
    assert torch.isfinite(got).all() and _snr(got, ref) > 100


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_thread_counts_do_not_change_either_kernels_result(threads):
    q, k, v = _qkv(2, 3, 301, 150, 40, seed=2)
    x, w, b = torch.randn(1500, 72), torch.randn(2 * 200, 72) * 0.1, torch.randn(2 * 200)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.sdlite.attention_f32(q, k, v), torch.ops.sdlite.geglu_f32(x, w, b)
        torch.set_num_threads(threads)
        many = torch.ops.sdlite.attention_f32(q, k, v), torch.ops.sdlite.geglu_f32(x, w, b)
    finally:
        torch.set_num_threads(before)
    # attention: rows split across threads, each computed the same way; GEGLU: elementwise after the products,
    # which oneDNN computes the same way for one thread or several at these shapes
    assert torch.equal(one[0], many[0])
    assert torch.allclose(one[1], many[1], rtol=0, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("tokens,dim,inner,bias", [(4096, 320, 1280, True), (1024, 640, 2560, True),
                                                   (1500, 72, 203, False)])
def test_geglu_matches_float64(tokens, dim, inner, bias):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, dim, generator=g)
    w = torch.randn(2 * inner, dim, generator=g) / math.sqrt(dim)
    b = torch.randn(2 * inner, generator=g) if bias else None
    value, gate = F.linear(x.double(), w.double(), None if b is None else b.double()).chunk(2, -1)
    ref = value * F.gelu(gate)
    got = kf.geglu(x, w, b)
    value32, gate32 = F.linear(x, w, b).chunk(2, -1)
    torch_fp32 = value32 * F.gelu(gate32)
    assert got.shape == (tokens, inner)
    assert _snr(got, ref) >= _snr(torch_fp32, ref) - 6 and _snr(got, ref) > 110, (_snr(got, ref),
                                                                                   _snr(torch_fp32, ref))


@needs_kernels
def test_geglu_gelu_is_the_exact_erf_form():
    """Gates where tanh's GELU and erf's differ by far more than fp32 rounding: the kernel follows erf's."""
    gate = torch.linspace(-6, 6, 4096)
    x = torch.eye(8)[:1].expand(2048, 8).contiguous()              # every token is e0
    w = torch.zeros(2 * 4096, 8)
    w[:4096, 0] = 1.0                                                # value: 1
    b = torch.cat([torch.zeros(4096), gate])                          # gate: the bias
    got = kf.geglu(x, w, b)[0]
    exact, tanh = F.gelu(gate.double()), F.gelu(gate.double(), approximate="tanh")
    assert (got.double() - exact).abs().max() < 2e-6 < (tanh - exact).abs().max()


def test_not_used_where_it_does_not_apply():
    q, k, v = _qkv(2, 4, 64, 77, 16)                                   # the demo's attention at 64x64 px: too small
    assert kf.attend(q, k, v) is None
    assert kf.attend(*(t.bfloat16() for t in _qkv(2, 8, 256, 256, 40))) is None          # bf16: not these
    x, w = torch.randn(64, 32), torch.randn(256, 32)
    assert kf.geglu(x, w, None) is None                                # 64 tokens: too few
    q, k, v = _qkv(2, 8, 256, 256, 40)
    assert (kf.attend(q, k, v) is not None) == RUNS_HERE


def test_layers_use_it_only_when_marked(monkeypatch):
    """Attention and GEGLU layers run PyTorch's operations (the exact path's bits) unless marked by
    use_fp32_kernels, and the marked ones call the kernels."""
    calls = []
    real_attend, real_geglu = kf.attend, kf.geglu
    monkeypatch.setattr(kf, "attend", lambda *a: calls.append("attend") or real_attend(*a))
    monkeypatch.setattr(kf, "geglu", lambda *a: calls.append("geglu") or real_geglu(*a))
    torch.manual_seed(0)
    attn, ff = Attention(320, 8).eval(), GEGLU(320, 1280).eval()
    x = torch.randn(2, 1024, 320)
    with torch.no_grad():
        plain = attn(x), ff(x)
        assert calls == []
        holder = torch.nn.Sequential(attn, ff)
        kf.use_fp32_kernels(holder)
        fast = attn(x), ff(x)
        assert calls == ["attend", "geglu"]
        value, gate = ff.proj(x).chunk(2, -1)
        q = attn.to_q(x).view(2, 1024, 8, 40).transpose(1, 2)
        k = attn.to_k(x).view(2, 1024, 8, 40).transpose(1, 2)
        v = attn.to_v(x).view(2, 1024, 8, 40).transpose(1, 2)
        sdpa = attn.to_out[0](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 1024, 320))
        assert torch.equal(plain[0], sdpa) and torch.equal(plain[1], value * F.gelu(gate))
        for f, p in zip(fast, plain):
            assert _snr(f, p.double()) > 100
        kf.use_fp32_kernels(holder, False)
        assert torch.equal(attn(x), plain[0])


def test_fp32_fast_precision():
    plan = resolve("fp32-fast", "cpu", _cpu({"avx", "avx2", "fma"}))
    assert (plan.name, plan.dtype, plan.vae_dtype, plan.text_dtype, plan.fp32_kernels) == \
        ("fp32-fast", torch.float32, torch.float32, torch.float32, True)
    assert not resolve("exact", "cpu", _cpu({"avx", "avx2", "fma"})).fp32_kernels
    with pytest.raises(PrecisionError, match=r"'fp32-fast' needs a CPU with AVX2 and FMA.*avx2.*use exact"):
        resolve("fp32-fast", "cpu", _cpu({"sse4_1", "avx"}))
    with pytest.raises(PrecisionError, match=r"'fp32-fast' runs sdlite's AVX2 CPU kernels; on cuda"):
        resolve("fp32-fast", "cuda")


def _psnr(a, b):
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@needs_kernels
def test_fp32_fast_demo_image_is_exacts_within_fp32_rounding(monkeypatch):
    """The demo at 256x256 (attention over 1024 tokens: the kernels run): fp32-fast marks the UNet and VAE, calls
    the kernels, records its precision, and draws exact's image to within fp32 rounding."""
    calls = []
    real = kf.attend
    monkeypatch.setattr(kf, "attend", lambda *a: (lambda out: calls.append(out is not None) or out)(real(*a)))
    exact = Engine.load(model_path(), precision="exact")
    fast = Engine.load(model_path(), precision="fp32-fast")
    assert fast.precision.fp32_kernels and not exact.precision.fp32_kernels
    r = Request("a red circle on a blue background", width=256, height=256, steps=8, seed=3)
    a = exact.generate(r)
    assert calls == []                                                  # exact never calls them
    b = fast.generate(r)
    assert any(calls)
    assert b.infotext["Precision"] == "fp32-fast"
    value = _psnr(np.asarray(a.images[0]), np.asarray(b.images[0]))
    print(f"demo 256^2, fp32-fast against exact: {value:.1f} dB")
    assert value >= 60.0
