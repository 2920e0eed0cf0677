"""sdlite's fp32 kernels for AVX2 (sdlite/kernels/fp32.py, avx2_fp32.cpp) and the fp32-fast precision that uses them:
attention, GEGLU and Winograd F(4x4, 3x3) convolutions against float64 references, the same bits on any thread count,
used only where a model is marked for them (never on the exact path), and fp32-fast's images against exact's."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torch import nn

from sdlite.demo import model_path
from sdlite.engine import winograd as W
from sdlite.machine import CPUInfo
from sdlite.engine.memory import channels_last
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


def _rel_err(x, ref):
    """Largest error relative to the reference's largest value."""
    return float((x.double() - ref).abs().max() / ref.abs().max())


@needs_kernels
@pytest.mark.parametrize("n,c,k,h,w,padding,bias,layout", [
    (2, 320, 320, 64, 64, (1, 1), True, "channels_last"),   # SD 1.x's first level, as the UNet runs it
    (1, 128, 64, 37, 35, (1, 1), True, "nchw"),             # odd sizes (the last blocks cropped), plain input
    (1, 64, 24, 33, 40, (0, 0), False, "channels_last"),    # tiled decoding's own padding, no bias
    (2, 16, 40, 32, 45, (1, 0), True, "channels_last"),     # asymmetric padding
])
def test_winograd43_matches_float64_convolution(n, c, k, h, w, padding, bias, layout):
    """F(4x4, 3x3) with sdlite's transforms against a float64 convolution: about 1e-5 of the output's largest value
    (the filter transform's 1/6, 1/12, 1/24 round; PyTorch's fp32 convolution: about 3e-7)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, c, h, w, generator=g)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(k, c, 3, 3, generator=g) / (3 * math.sqrt(c))
    b = torch.randn(k, generator=g) if bias else None
    ref = F.conv2d(x.double(), weight.double(), None if b is None else b.double(), padding=padding)
    got = torch.ops.sdlite.winograd43_f32(x, weight, b, *padding)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert _rel_err(got, ref) < 3e-5, _rel_err(got, ref)
    assert _snr(got, ref) > 90


@needs_kernels
@pytest.mark.parametrize("budget,tiles", [(36 * 16 * 24, 10**6),   # output channels in slices of 16, 16, 8
                                          (36 * 24 * 35, 9),       # slices of 32 and 8, several chunks of tiles
                                          (1, 5)])                 # the smallest slice: 8 channels
def test_winograd43_slices_and_chunks_give_the_whole_result(monkeypatch, budget, tiles):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 24, 33, 35, generator=g).contiguous(memory_format=torch.channels_last)
    weight, b = torch.randn(40, 24, 3, 3, generator=g) / 15, torch.randn(40, generator=g)
    whole = torch.ops.sdlite.winograd43_f32(x, weight, b, 1, 1)
    monkeypatch.setattr(W, "FILTER_BUDGET", budget)
    monkeypatch.setattr(W, "FAST_TILES_PER_CHUNK", tiles)
    W.release_workspace()
    sliced = torch.ops.sdlite.winograd43_f32(x, weight, b, 1, 1)
    # the products of a slice may be blocked differently: the same result to the method's rounding
    ref = F.conv2d(x.double(), weight.double(), b.double(), padding=1)
    assert _rel_err(sliced, ref) < 3e-5 and _rel_err(sliced, whole.double()) < 3e-5
    assert W._workspace.buffers["u43"].numel() <= max(budget, 36 * 8 * 24)
    W.release_workspace()


@needs_kernels
@pytest.mark.parametrize("threads", [1, 3])
def test_winograd43_transforms_give_the_same_bits_on_any_thread_count(threads):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 16, 21, 19, generator=g).contiguous(memory_format=torch.channels_last)
    th, tw = 6, 5
    m = torch.randn(36, 2 * 2 * tw, 24, generator=g)
    b = torch.randn(24, generator=g)
    before = torch.get_num_threads()
    results = []
    try:
        for t in (2, threads):
            torch.set_num_threads(t)
            v = torch.empty(36, 2 * 3 * tw, 16)
            kf.wino43_input(x, (1, 1), 2, 3, tw, v)
            y = torch.zeros(2, 4 * th, 4 * tw, 24)
            kf.wino43_output(m, b, y, 1, 0)
            results.append((v, y))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    # the input transform of one tile, by its definition: V = B^T d B of the 6x6 zero-padded input window
    bt = torch.tensor([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
                       [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], dtype=torch.float64)
    padded = F.pad(x.double(), (1, 1 + 4 * tw, 1, 1 + 4 * th))
    tile = padded[1, 5, 4 * 3: 4 * 3 + 6, 4 * 2: 4 * 2 + 6]             # batch 1, channel 5, tile row 3, column 2
    p = (1 * 3 + (3 - 2)) * tw + 2                                       # its index among the chunk's tiles
    assert torch.allclose(results[0][0][:, p, 5].double(), (bt @ tile @ bt.T).reshape(36), atol=1e-4)
    # and the output transform of one block: Y = A^T M A, plus the bias
    at = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
                      dtype=torch.float64)
    block = at @ m[:, 7, 3].double().reshape(6, 6) @ at.T + b[3]       # tile 7: batch 0, tile row 1 + 1, column 2
    assert torch.allclose(results[0][1][0, 8:12, 8:12, 3].double(), block, atol=1e-4)


def test_winograd43_filter_transform_is_lavin_and_gray():
    """U = G g G^T, and the 36 products transformed back give one 4x4 block of the valid correlation."""
    g = torch.Generator().manual_seed(10)
    d, f = torch.randn(6, 6, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g, dtype=torch.float64)
    bt = torch.tensor([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
                       [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], dtype=torch.float64)
    at = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
                      dtype=torch.float64)
    u = (W._G36.double() @ f.reshape(9)).reshape(6, 6)
    y = at @ (u * (bt @ d @ bt.T)) @ at.T
    direct = torch.tensor([[(d[i:i + 3, j:j + 3] * f).sum() for j in range(4)] for i in range(4)], dtype=torch.float64)
    assert torch.allclose(y, direct, atol=1e-6)      # _G36 is fp32: its 1/6, 1/12, 1/24 round


def test_winograd_layers_run_f43_only_when_marked_on_large_maps(monkeypatch):
    calls = []
    real = kf.wino43_input
    monkeypatch.setattr(kf, "wino43_input", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.manual_seed(11)
    conv = nn.Conv2d(64, 64, 3, padding=1)
    layer = W.WinogradConv2d.from_conv(conv)
    big, small = torch.randn(1, 64, W.FAST_MIN_SIDE, 40), torch.randn(1, 64, W.FAST_MIN_SIDE - 1, 40)
    with torch.no_grad():
        plain = layer(big)
        assert calls == []
        kf.use_fp32_kernels(nn.Sequential(layer))
        fast = layer(big)
        assert calls == ([big.shape] if RUNS_HERE else [])
        assert _rel_err(fast, F.conv2d(big.double(), conv.weight.double(), conv.bias.double(), padding=1)) < 3e-5
        assert torch.equal(layer(small), W.winograd_conv2d(small, conv.weight, conv.bias))   # F(2x2, 3x3) below
        odd = W.WinogradConv2d.from_conv(nn.Conv2d(60, 64, 3, padding=1))                    # not 8-channel lanes
        odd.fp32_kernels = True
        odd(torch.randn(1, 60, 40, 40))
        assert len(calls) == (1 if RUNS_HERE else 0)
        kf.use_fp32_kernels(nn.Sequential(layer), False)
        assert torch.equal(layer(big), plain)


def test_fast_rule_takes_the_vaes_narrow_layers_and_keeps_their_weights_plain():
    narrow = [nn.Conv2d(128, 128, 3, padding=1), nn.Conv2d(256, 128, 3, padding=1), nn.Conv2d(64, 64, 3, padding=1)]
    never = [nn.Conv2d(128, 3, 3, padding=1), nn.Conv2d(4, 512, 3, padding=1), nn.Conv2d(60, 64, 3, padding=1),
             nn.Conv2d(128, 128, 3, stride=2, padding=1), nn.Conv2d(1280, 2560, 3, padding=1)]
    assert all(W.eligible(c, wide=True, fast=True) for c in narrow)
    assert not any(W.eligible(c, wide=True) for c in narrow)
    assert not any(W.eligible(c, wide=True, fast=True) for c in never)
    net = W.winograd_model(nn.Sequential(nn.Conv2d(4, 128, 3, padding=1), *narrow[:2], nn.Conv2d(128, 3, 1)),
                           wide=True, fast=True)
    assert [type(m) for m in net] == [nn.Conv2d, W.WinogradConv2d, W.WinogradConv2d, nn.Conv2d]
    channels_last(net)
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last) and not net[0].weight.is_contiguous()
    assert net[3].weight.is_contiguous(memory_format=torch.channels_last)
    assert net[1].weight.is_contiguous() and net[2].weight.is_contiguous()   # the filter transform's layout


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
    assert (plan.name, plan.dtype, plan.vae_dtype, plan.text_dtype, plan.fp32_kernels, plan.channels_last) == \
        ("fp32-fast", torch.float32, torch.float32, torch.float32, True, True)
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


def test_transformers_attention_runs_it_up_to_head_dim_64_when_marked(monkeypatch):
    """fp32-fast marks a transformer too (SD3/SD3.5, FLUX.1, FLUX.2, Qwen-Image): its attention runs the kernel at
    SD3's head dim 64 and keeps PyTorch's at FLUX's 128, where PyTorch's was measured faster (mmdit's
    FP32_KERNEL_MAX_HEAD_DIM); unmarked, PyTorch's bits."""
    from types import SimpleNamespace

    from sdlite.engine.memory import ModelManager
    from sdlite.models import mmdit
    from sdlite.models.flux import FluxAttention

    calls = []
    real = kf.attend
    monkeypatch.setattr(kf, "attend", lambda *a: calls.append(a[0].shape[-1]) or real(*a))
    for d in (64, 128):
        q, k, v = _qkv(1, 4, 300, 300, d, seed=d)
        sdpa = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 300, 4 * d)
        assert torch.equal(mmdit.attention(q, k, v, False), sdpa)
        fast = mmdit.attention(q, k, v, True)
        if d == 64 and RUNS_HERE:
            assert not torch.equal(fast, sdpa) and _snr(fast, _reference(q, k, v)) > 120
        else:
            assert torch.equal(fast, sdpa)
    assert calls == [64]
    for on in (False, True):
        layer = nn.Sequential(FluxAttention(128, 2, True))
        ModelManager._kernels(SimpleNamespace(fp32_kernels=on), "transformer", layer)
        assert layer[0].fp32_kernels is on
