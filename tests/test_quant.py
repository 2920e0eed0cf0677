"""``--quantize``: int8 (oneDNN VNNI kernels) and bf16 layers against the fp32 model, at tiny configs."""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdlite.config import SD15
from sdlite.engine import quant as quantmod
from sdlite.engine.cpu import bf16_support, int8_activation_bits
from sdlite.machine import this_cpu
from sdlite.engine.quant import (
    KEEP_FP32, QUANTIZE_CHOICES, BF16Conv2d, BF16Linear, BF16Warning, Int8Conv2d, Int8Linear, QuantizeError,
    check_quantize_mode, check_quantize_supported, compare_quality, layer_counts, psnr, quantize_activation, quantize_model, quantize_weight,
    weight_bytes,
)
from sdlite.models.clip import CLIPTextEncoder
from sdlite.models.unet import UNet
from tests.reference import TINY_TEXT_SD1, TINY_UNET_SD1, TINY_UNET_SD2, seed_all


# The activation range this CPU uses: 8 bits with VNNI/AMX, 7 without (engine.cpu); make test runs this file
# natively and under ONEDNN_MAX_CPU_ISA=AVX2.
BITS = int8_activation_bits()


def min_cosine_for(min_cosine_8bit: float, mode: str, bits: int = BITS) -> float:
    """The accuracy an int8 mode is designed to reach with ``bits``-bit activations, from its 8-bit target.

    Uniform quantization noise has variance step^2 / 12, and 1 - cosine grows with the noise variance: 7 bits
    have a step (255 / 127)^2 ~ 4x larger, so the allowed 1 - cosine is 4x the 8-bit one (weight quantization,
    unchanged, only makes the true ratio smaller). bf16 has no int8 activations.
    """
    if "int8" not in mode:
        return min_cosine_8bit
    return 1.0 - (1.0 - min_cosine_8bit) * (255.0 / ((1 << bits) - 1)) ** 2


@pytest.fixture
def bf16_allowed(monkeypatch):
    """For tests of how bf16 layers are built (not of the CPU policy): bf16 treated as native."""
    monkeypatch.setattr(quantmod, "bf16_support", lambda: "native")


# bf16 modes are refused where oneDNN has no bf16 kernel (x86 below AVX-512, e.g. under ONEDNN_MAX_CPU_ISA=AVX2)
BF16_REFUSED = bf16_support() == "none"


@pytest.fixture(autouse=True)
def no_bf16_warning_noise():
    """bf16 modes warn on CPUs without native bf16 (tested on its own below); silence it elsewhere."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BF16Warning)
        yield


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def tiny_unet(cfg, seed=0):
    torch.manual_seed(seed)
    return seed_all(UNet(cfg).eval().requires_grad_(False), seed, scale=0.05)


def unet_inputs(cfg, size=16):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, cfg.in_channels, size, size, generator=g), torch.tensor([20.0, 700.0]),
            torch.randn(2, 7, cfg.context_dim, generator=g))


@pytest.mark.parametrize("mode, min_cosine", [("int8", 0.999), ("int8-bf16", 0.9999), ("bf16", 0.9999)])
@pytest.mark.parametrize("cfg", [TINY_UNET_SD1, TINY_UNET_SD2], ids=["sd1", "sd2"])
def test_quantized_unet_output_close_to_fp32(cfg, mode, min_cosine):
    unet = tiny_unet(cfg)
    x, t, ctx = unet_inputs(cfg)
    if "bf16" in mode and BF16_REFUSED:
        with pytest.raises(QuantizeError, match="needs bf16 kernels.*--quantize int8"):
            quantize_model(unet, mode)
        assert layer_counts(unet).get("Int8Linear") is None and layer_counts(unet).get("BF16Conv2d") is None
        return
    with torch.no_grad():
        ref = unet(x, t, ctx)
        q = quantize_model(copy.deepcopy(unet), mode)
        out = q(x, t, ctx)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert cosine(out, ref) > min_cosine_for(min_cosine, mode)
    assert not torch.equal(out, ref)          # the quantized layers really ran
    assert q.dtype == torch.float32           # the UNet's stem is fp32, so callers keep feeding it fp32


def test_int8_layers_use_onednn_quantized_kernels():
    unet = tiny_unet(TINY_UNET_SD1)
    fp32 = layer_counts(unet)
    quantize_model(unet, "int8")
    counts = layer_counts(unet)
    # everything but the stem and the head (convolutions) and the timestep MLP (Linear) is int8
    assert counts == {"Int8Linear": fp32["Linear"] - 2, "Int8Conv2d": fp32["Conv2d"] - 2, "Conv2d": 2, "Linear": 2}
    assert counts["Int8Conv2d"] > 20 and counts["Int8Linear"] > 20
    for name in ("conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2"):
        layer = unet.get_submodule(name)
        assert type(layer) in (nn.Conv2d, nn.Linear) and layer.weight.dtype == torch.float32
    # the forward pass runs oneDNN's u8 x s8 kernels, and only the two fp32 convolutions run as float ones
    x, t, ctx = unet_inputs(TINY_UNET_SD1)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        unet(x, t, ctx)
    for layer in unet.modules():
        if isinstance(layer, (Int8Linear, Int8Conv2d)):
            # a 1x1 convolution's weight is packed for each input shape it meets (here one)
            packed = list(layer.packs.values()) if getattr(layer, "per_shape", False) else [layer.packed_weight]
            assert len(packed) == 1 and packed[0].is_mkldnn and packed[0].dtype == torch.int8
            assert layer.weight_scale.dtype == torch.float32
    calls = {}
    for e in prof.events():
        calls[e.name] = calls.get(e.name, 0) + 1
    assert calls.get("onednn::qconv_pointwise") == counts["Int8Conv2d"]
    assert calls.get("onednn::qlinear_pointwise") == counts["Int8Linear"]
    assert calls.get("aten::convolution") == 2


def test_weight_quantization_roundtrip():
    w = torch.randn(8, 5, 3, 3)
    w[3] = 0.0                                             # an all-zero channel keeps a usable scale
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (8,)
    assert q.abs().amax(dim=(1, 2, 3)).tolist() == [127] * 3 + [0] + [127] * 4
    err = (q.float() * scale.view(-1, 1, 1, 1) - w).abs()
    assert (err <= scale.view(-1, 1, 1, 1) / 2 + 1e-7).all()


@pytest.mark.parametrize("shape, dtype", [((1280, 12), torch.float32), ((96, 640, 3, 3), torch.bfloat16),
                                          ((3, 70000), torch.float16), ((7, 1), torch.float32)])
def test_weight_quantization_in_chunks_equals_the_whole_tensor_formula(shape, dtype):
    """Row blocks through one buffer (rows wider and narrower than a chunk, bf16/fp16 weights, a zero row) give
    exactly round(w / (max |w| / 127)) in float32 over the whole tensor at once."""
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.02).to(dtype)
    w[1] = 0.0
    q, scale = quantize_weight(w)
    whole = w.float()
    amax = whole.abs().reshape(shape[0], -1).amax(dim=1)
    want_scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    want = torch.round(whole / want_scale.view(-1, *([1] * (len(shape) - 1)))).clamp(-127, 127).to(torch.int8)
    assert torch.equal(scale, want_scale) and torch.equal(q, want) and q.shape == shape


def test_activation_quantization_covers_range_and_keeps_zero_exact():
    x = torch.tensor([[-1.0, 0.0, 0.25, 3.0]])
    q, scale, zp = quantize_activation(x)
    assert q.dtype == torch.uint8 and q[0, 0] == 0 and q[0, 3] == 255 and q[0, 1] == zp
    assert ((q.float() - zp) * scale - x).abs().max() <= scale / 2 + 1e-6
    q, scale, zp = quantize_activation(torch.rand(10) + 1.0)       # all positive: the range still holds 0
    assert zp == 0
    q, scale, zp = quantize_activation(torch.zeros(4))
    assert q.tolist() == [zp] * 4
    with pytest.raises(FloatingPointError, match="non-finite"):
        quantize_activation(torch.tensor([1.0, float("nan")]))


def test_int8_text_encoder_close_to_fp32():
    torch.manual_seed(0)
    text = seed_all(CLIPTextEncoder(TINY_TEXT_SD1).eval().requires_grad_(False), 0, scale=0.2)
    ids = torch.randint(0, TINY_TEXT_SD1.vocab_size, (2, 77), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = text(ids)
        q = quantize_model(copy.deepcopy(text), "int8")
        out = q(ids, clip_skip=2)
        assert cosine(q(ids), ref) > min_cosine_for(0.999, "int8")
    assert out.shape == ref.shape
    assert layer_counts(q)["Int8Linear"] == 6 * TINY_TEXT_SD1.layers


def test_weight_memory(bf16_allowed):
    unet = tiny_unet(TINY_UNET_SD1)
    fp32 = weight_bytes(unet)
    assert fp32 == sum(p.numel() * 4 for p in unet.parameters())
    layers = [m for n, m in unet.named_modules() if type(m) in (nn.Linear, nn.Conv2d)
              and not any(n == k or n.startswith(k + ".") for k in KEEP_FP32)]
    weights = sum(m.weight.numel() for m in layers)
    channels = sum(m.weight.shape[0] for m in layers)
    conv_channels = sum(m.weight.shape[0] for m in layers if isinstance(m, nn.Conv2d))
    q = quantize_model(copy.deepcopy(unet), "int8")
    # each quantized weight goes from 4 bytes to 1, plus one fp32 scale per output channel, and for convolutions
    # one fp32 per output channel more (what a unit of input code adds: the zero point's share of the bias)
    assert weight_bytes(q) == fp32 - 3 * weights + 4 * channels + 4 * conv_channels
    b = quantize_model(copy.deepcopy(unet), "bf16")
    assert weight_bytes(b) == fp32 - 2 * sum(p.numel() for m in layers for p in m.parameters())


def test_quantize_twice_and_none_are_no_ops(bf16_allowed):
    cfg = TINY_UNET_SD1
    x, t, ctx = unet_inputs(cfg)
    unet = tiny_unet(cfg)
    fp32 = layer_counts(unet)
    assert set(fp32) == {"Conv2d", "Linear"}
    assert quantize_model(unet, "none") is unet and layer_counts(unet) == fp32
    q = quantize_model(unet, "bf16")
    assert q is unet
    with torch.no_grad():
        once = q(x, t, ctx)
        again = quantize_model(q, "bf16")(x, t, ctx)
    assert torch.equal(once, again)
    assert all(m.weight.dtype == torch.bfloat16 for m in q.modules() if isinstance(m, (BF16Linear, BF16Conv2d)))


def test_half_precision_model_is_made_fp32_around_the_quantized_layers():
    cfg = TINY_UNET_SD1
    unet = tiny_unet(cfg)
    x, t, ctx = unet_inputs(cfg)
    with torch.no_grad():
        ref = unet(x, t, ctx)
        out = quantize_model(copy.deepcopy(unet).to(torch.bfloat16), "int8")(x, t, ctx)
    assert out.dtype == torch.float32 and cosine(out, ref) > min_cosine_for(0.999, "int8")


@pytest.mark.parametrize("bad", ["int3", "INT8", "", None, 8])
def test_bad_mode_is_a_clear_error(bad):
    unet = tiny_unet(TINY_UNET_SD1)
    with pytest.raises(QuantizeError) as err:
        quantize_model(unet, bad)
    message = str(err.value)
    assert repr(bad) in message
    for mode in QUANTIZE_CHOICES:
        assert mode in message
    assert isinstance(err.value, ValueError)
    assert layer_counts(unet).get("Int8Linear") is None        # nothing was touched


def test_mode_list_and_check():
    assert QUANTIZE_CHOICES[:2] == ("none", "int8") and "bf16" in QUANTIZE_CHOICES
    assert all(check_quantize_mode(m) == m for m in QUANTIZE_CHOICES)


def test_model_not_on_cpu_is_refused():
    with torch.device("meta"):
        unet = UNet(TINY_UNET_SD1)
    with pytest.raises(QuantizeError, match="CPU only.*meta"):
        quantize_model(unet, "int8")


def test_psnr():
    a = torch.zeros(2, 3, 4, 4)
    assert psnr(a, a) == math.inf
    b = a.clone()
    b[0, 0, 0, 0] = 255.0                                   # mse = 255^2 / 96
    assert psnr(b, a) == pytest.approx(10 * math.log10(96))
    with pytest.raises(ValueError, match="shapes"):
        psnr(a, a[:1])


@pytest.fixture(scope="module")
def tiny_model():
    from sdlite.loader import StableDiffusion
    from sdlite.models.vae import AutoencoderKL
    from sdlite.tokenizers.clip_bpe import CLIPTokenizer
    from tests.reference import TINY_TEXT_SD1_FULLVOCAB, TINY_VAE

    spec = SD15.replace(text=TINY_TEXT_SD1_FULLVOCAB, vae=TINY_VAE, default_size=32,
                        unet=dataclasses.replace(TINY_UNET_SD1, context_dim=TINY_TEXT_SD1_FULLVOCAB.width))
    torch.manual_seed(0)   # PyTorch's default init for the UNet and the VAE, as bench/quant.py uses at full size
    return StableDiffusion(
        spec=spec, tokenizer=CLIPTokenizer.from_package(),
        text_encoder=seed_all(CLIPTextEncoder(spec.text).eval(), 1, scale=0.2), unet=UNet(spec.unet).eval(),
        vae=AutoencoderKL(spec.vae).eval(), scheduler_config=dict(spec.scheduler))


def test_image_quality_of_int8_against_fp32(tiny_model):
    """The issue's criterion (PSNR >= 30 dB of decoded images against fp32), on a tiny random model."""
    before = {k: v.clone() for k, v in tiny_model.unet.state_dict().items()}
    report = compare_quality(tiny_model, "int8", steps=8, size=32, text_encoder=True)
    assert report.image_std > 20.0                          # a real image, not a flat one
    assert 30.0 <= report.psnr_db < math.inf
    assert report.latent_cosine > 0.995
    assert "PSNR" in str(report)
    # the model given is left as it was
    assert layer_counts(tiny_model.unet).get("Int8Conv2d") is None
    assert all(torch.equal(v, before[k]) for k, v in tiny_model.unet.state_dict().items())


def test_image_quality_harness_is_exact_without_quantization(tiny_model):
    report = compare_quality(tiny_model, "none", steps=4, size=32)
    assert report.psnr_db == math.inf and report.max_pixel_diff == 0 and report.latent_cosine == pytest.approx(1.0)
    with pytest.raises(ValueError, match="multiple of 4"):
        compare_quality(tiny_model, "int8", size=30)


# --- the int8 kernels against exact integer arithmetic -------------------------------------------------------


def emulate(layer, x: torch.Tensor) -> torch.Tensor:
    """What an int8 layer is designed to compute, in float64: the same activation and weight quantization, the
    products summed exactly (float64 holds these int32 sums exactly), then scaled back and biased."""
    q, scale, zero_point = quantize_activation(x, layer.activation_bits)
    qx = q.double() - zero_point
    if isinstance(layer, Int8Linear):
        qw, wscale = layer.int_weight
        acc = F.linear(qx, qw.double())
        out = acc * (scale * wscale.double())
    else:
        qw, wscale = layer.int_weight
        acc = F.conv2d(qx, qw.double(), None, layer.stride, layer.padding, layer.dilation)
        out = acc * (scale * wscale.double()).view(1, -1, 1, 1)
    if layer.bias is not None:
        out = out + (layer.bias.double() if out.dim() != 4 else layer.bias.double().view(1, -1, 1, 1))
    return out


def int8_layer(kind, bits, seed=0):
    """A 320-wide Linear or 3x3 convolution (UNet-like) with spread-out weights, converted to int8."""
    torch.manual_seed(seed)
    layer = nn.Linear(320, 320) if kind == "linear" else nn.Conv2d(64, 64, 3, padding=1)
    nn.init.normal_(layer.weight)
    converted = (Int8Linear if kind == "linear" else Int8Conv2d)(layer, bits)
    converted.int_weight = quantize_weight(layer.weight)
    return converted


def int8_input(kind, dist):
    g = torch.Generator().manual_seed(3)
    shape = (256, 320) if kind == "linear" else (2, 64, 12, 12)
    # all-positive inputs put the activations at the top of the range, where int16 pair sums overflow first
    return torch.randn(*shape, generator=g) if dist == "normal" else torch.rand(*shape, generator=g)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("dist", ["normal", "positive"])
def test_int8_kernels_equal_exact_integer_arithmetic(kind, dist):
    """oneDNN's int8 kernels are designed to sum u8 x s8 products exactly in int32; only the final fp32
    rescale rounds (relative error ~1e-7). This holds with the activation range this CPU uses and always with 7
    bits; 8 bits match only where VNNI/AMX sums without int16 saturation (about 1e-2 off elsewhere)."""
    x = int8_input(kind, dist)
    for bits in sorted({BITS, 7}):
        layer = int8_layer(kind, bits)
        with torch.no_grad():
            assert rel(layer(x), emulate(layer, x)) < 1e-5, bits
    eight = int8_layer(kind, 8)
    with torch.no_grad():
        exact = rel(eight(x), emulate(eight, x)) < 1e-5
    assert exact == (BITS == 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_convolution_takes_the_zero_point_through_the_bias(dtype):
    """oneDNN sums the input codes as they are (no zero point: it would reorder the weights at every call), over an
    input padded with the zero point's code, and the zero point's share comes off through the bias. The result is
    exact integer arithmetic's on every pixel, the borders included, for 3x3, strided and 1x1 convolutions, batch 1
    and 2, signed inputs and non-negative ones (zero point 0), fp32 and channels-last bf16."""
    torch.manual_seed(2)
    convs = [nn.Conv2d(64, 32, 3, padding=1), nn.Conv2d(64, 48, 3, stride=2, padding=1), nn.Conv2d(64, 16, 1)]
    g = torch.Generator().manual_seed(5)
    for conv in convs:
        nn.init.normal_(conv.weight)
        layer = Int8Conv2d(conv, BITS)
        layer.int_weight = quantize_weight(conv.weight)
        for shape, positive in [((1, 64, 16, 16), False), ((2, 64, 9, 21), False), ((1, 64, 12, 12), True)]:
            x = torch.randn(*shape, generator=g)
            x = x.abs() if positive else x
            if dtype is torch.bfloat16:
                x = x.bfloat16().contiguous(memory_format=torch.channels_last)
            with torch.no_grad():
                got = layer(x)
            assert (quantize_activation(x, BITS)[2] == 0) == positive
            ref = emulate(layer, x.float())
            bound = 1e-5 if dtype is torch.float32 else 4e-3
            assert got.dtype == dtype and rel(got, ref) < bound, (conv, shape)
            for edge in ((..., 0, slice(None)), (..., -1, slice(None)), (..., slice(None), 0), (..., slice(None), -1)):
                assert rel(got[edge], ref[edge]) < bound, (conv, shape, edge)          # the padded borders
            assert got.is_contiguous(memory_format=torch.channels_last) == (dtype is torch.bfloat16)


def test_int8_1x1_convolution_packs_its_weight_per_input_shape(capfd):
    """A 1x1 weight packed for no input shape is reordered by oneDNN at every call (a slow generic reorder: 32 ms of
    a 0.46 ms convolution at SD 1.5's 1280 channels); the layer packs it for each input shape it meets and keeps the
    last PER_SHAPE_PACKS. A shape met before runs with no reorder at all (with VNNI), and every result is exact
    integer arithmetic's."""
    torch.manual_seed(4)
    conv = nn.Conv2d(64, 32, 1)
    nn.init.normal_(conv.weight)
    layer = Int8Conv2d(conv, BITS)
    layer.int_weight = quantize_weight(conv.weight)
    g = torch.Generator().manual_seed(6)
    shapes = [(1, 64, 16, 16), (2, 64, 16, 16), (1, 64, 9, 21), (1, 64, 8, 8), (3, 64, 5, 5), (1, 64, 16, 16)]
    for i, shape in enumerate(shapes):
        x = torch.randn(*shape, generator=g).bfloat16().contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            layer(x)                                          # the first call at this shape (packs, if new)
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                got = layer(x)
        calls = [line for line in capfd.readouterr().out.splitlines() if ",exec," in line]
        reorders = [line for line in calls if ",reorder," in line]
        # (without VNNI oneDNN's int8 convolution takes plain weights: a fast reorder of any packed one, every call)
        assert calls and (not reorders if this_cpu().vnni else len(reorders) <= 1), (shape, calls)
        assert rel(got, emulate(layer, x.float())) < 4e-3, shape
        assert len(layer.packs) == min(i + 1, quantmod.PER_SHAPE_PACKS) and next(reversed(layer.packs)) == shape
    assert (1, 64, 16, 16) not in list(layer.packs)[:-1]   # met again: packed again, as the most recent


def test_8bit_saturates_exactly_where_the_cpu_says_there_is_no_vnni():
    """255 * 127 * 2 = 64770 does not fit in int16: without VNNI oneDNN returns 32767 per pair of products."""
    layer = Int8Linear(nn.Linear(64, 16), 8)
    layer.packed_weight = torch.ops.onednn.qlinear_prepack(torch.full((16, 64), 127, dtype=torch.int8), None)
    q = torch.full((4, 64), 255, dtype=torch.uint8)
    out = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, layer.packed_weight, torch.ones(16),
                                             torch.zeros((), dtype=torch.int64), None, 1.0, 0, torch.float32,
                                             "none", [], "")
    expected = 255 * 127 * 64 if this_cpu().vnni else 32767 * 32
    assert (out == expected).all()


@pytest.mark.parametrize("cfg", [TINY_UNET_SD1, TINY_UNET_SD2], ids=["sd1", "sd2"])
def test_int8_unet_layers_equal_their_emulation(cfg):
    """Every int8 layer of a quantized UNet, on the activations it really gets, against :func:`emulate`.

    (The whole network cannot be compared so tightly: the activation scales are dynamic, so a last-bit fp32
    difference in one layer's input max moves the next layer's whole quantization grid.)"""
    unet = tiny_unet(cfg)
    x, t, ctx = unet_inputs(cfg)
    q = quantize_model(copy.deepcopy(unet), "int8")

    def call():
        with torch.no_grad():
            q(x, t, ctx)
    check_int8_layers_against_emulation(unet, q, call)


def check_int8_layers_against_emulation(unet, q, call, least_layers: int = 40) -> None:
    """Run ``call()`` (which runs the quantized ``q``) with every int8 layer of ``q`` hooked, and check that each
    one's output equals :func:`emulate` of its input, with the weights ``unet`` (the fp32 original) quantizes to."""
    errors = {}

    def check(name):
        def hook(module, args, output):
            errors[name] = rel(output, emulate(module, args[0]))
        return hook

    for name, layer in q.named_modules():
        if isinstance(layer, (Int8Linear, Int8Conv2d)):
            assert layer.activation_bits == BITS
            layer.int_weight = quantize_weight(unet.get_submodule(name).weight)
            layer.register_forward_hook(check(name))
    call()
    assert len(errors) == sum(1 for m in q.modules() if isinstance(m, (Int8Linear, Int8Conv2d))) > least_layers
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, (worst, errors[worst])


def test_activation_bits(bf16_allowed):
    x = torch.linspace(-1.0, 3.0, 1000)
    for bits, top in ((8, 255), (7, 127)):
        q, scale, zp = quantize_activation(x, bits)
        assert q.min() == 0 and q.max() == top and scale == pytest.approx(4.0 / top)
        assert ((q.float() - zp) * scale - x).abs().max() <= scale / 2 + 1e-6
    with pytest.raises(QuantizeError, match="activation bits"):
        quantize_activation(x, 6)
    unet = quantize_model(tiny_unet(TINY_UNET_SD1), "int8", activation_bits=7)
    assert {m.activation_bits for m in unet.modules() if isinstance(m, (Int8Linear, Int8Conv2d))} == {7}
    assert "7-bit" in repr(unet)
    default = quantize_model(tiny_unet(TINY_UNET_SD1), "int8-bf16")
    assert {m.activation_bits for m in default.modules() if isinstance(m, Int8Linear)} == {BITS}


@pytest.mark.parametrize("support, outcome", [("native", None), ("unknown", None), ("emulated", "warning"),
                                              ("none", "refused")])
def test_bf16_modes_per_cpu(monkeypatch, support, outcome):
    import warnings

    monkeypatch.setattr(quantmod, "bf16_support", lambda: support)
    for mode in ("bf16", "int8-bf16"):
        unet = tiny_unet(TINY_UNET_SD1)
        if outcome == "refused":
            with pytest.raises(QuantizeError) as err:
                quantize_model(unet, mode)
            assert "needs bf16 kernels" in str(err.value) and "--quantize int8" in str(err.value)
            assert "BF16Conv2d" not in layer_counts(unet)                        # nothing was touched
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quantize_model(unet, mode)
        warned = [w for w in caught if issubclass(w.category, BF16Warning)]
        assert len(warned) == (outcome == "warning")
        assert layer_counts(unet)["BF16Conv2d"] > 0
    assert check_quantize_supported("int8") == "" and check_quantize_supported("none") == ""   # never refused


def test_bf16_policy_on_this_cpu():
    """Here, natively and under ONEDNN_MAX_CPU_ISA=AVX2: refused exactly where oneDNN has no bf16 kernels."""
    cpu = this_cpu()
    expected = "native" if cpu.native_bf16 else ("emulated" if cpu.avx512 else "none")
    assert bf16_support() == expected
    if expected == "none":
        with pytest.raises(QuantizeError, match="int8"):
            check_quantize_supported("bf16")
    else:
        assert check_quantize_supported("bf16") == expected


# --- bf16-int8 ----------------------------------------------------------------------------------------------------

BF16_INT8_RUNS = bf16_support() == "native" and BITS == 8


def expected_bf16_int8_layers(unet):
    """Independently of quant.bf16_int8_targets: the ResNet blocks' conv1/conv2, the down- and upsamplers'
    convolutions, and the transformer blocks' Linear layers but the cross-attention's key and value."""
    from sdlite.models.layers import Downsample, ResnetBlock, Upsample
    from sdlite.models.unet import TransformerBlock

    names = set()
    for owner, module in unet.named_modules():
        if isinstance(module, ResnetBlock):
            names |= {f"{owner}.conv1", f"{owner}.conv2"}
        elif isinstance(module, (Downsample, Upsample)):
            names.add(f"{owner}.conv")
        elif isinstance(module, TransformerBlock):
            names |= {f"{owner}.{n}" for n, m in module.named_modules()
                      if isinstance(m, nn.Linear) and n not in ("attn2.to_k", "attn2.to_v")}
    return names


@pytest.mark.parametrize("cfg", [TINY_UNET_SD1, TINY_UNET_SD2], ids=["sd1", "sd2"])
def test_bf16_int8_unet_against_bf16_and_fp32(cfg):
    """bf16-int8 makes int8 exactly the layers it names (the GEGLU projection split in its two halves), leaves the
    rest of the bf16 model in bf16, keeps channels-last activations, and stays close to the bf16 and fp32 models.
    A CPU without native bf16 and 8-bit int8 products refuses it."""
    unet = tiny_unet(cfg)
    x, t, ctx = unet_inputs(cfg)
    if not BF16_INT8_RUNS:
        with pytest.raises(QuantizeError, match="bf16-int8 needs"):
            quantize_model(copy.deepcopy(unet).bfloat16(), "bf16-int8")
        return
    with torch.no_grad():
        ref = unet(x, t, ctx)
        bf16 = copy.deepcopy(unet).bfloat16().to(memory_format=torch.channels_last)
        out_bf16 = bf16(x.bfloat16(), t, ctx.bfloat16())
        q = quantize_model(copy.deepcopy(unet).bfloat16(), "bf16-int8").to(memory_format=torch.channels_last)
        layouts = {}
        def record(name):
            def hook(module, args):
                layouts.setdefault(name, args[0].is_contiguous(memory_format=torch.channels_last)
                                   and not args[0].is_contiguous())
            return hook

        hooks = [m.register_forward_pre_hook(record(name))
                 for name, m in q.named_modules() if isinstance(m, (Int8Conv2d, nn.Conv2d, nn.GroupNorm))]
        out = q(x.bfloat16(), t, ctx.bfloat16())
        for hook in hooks:
            hook.remove()
    # every image-shaped activation after the first convolution stays channels-last (an NCHW one costs copies at
    # every int8 convolution, whose oneDNN output is NHWC), through the transformers' projections too
    assert layouts.pop("conv_in") is False and layouts and all(layouts.values()), \
        [name for name, kept in layouts.items() if not kept]
    int8 = {name: m for name, m in q.named_modules() if isinstance(m, (Int8Linear, Int8Conv2d))}
    assert set(int8) == expected_bf16_int8_layers(unet) and len(int8) > 20
    assert any(name.endswith("downsamplers.0.conv") for name in int8) and \
        any(name.endswith("upsamplers.0.conv") for name in int8)
    assert {name for name, m in int8.items() if getattr(m, "split", False)} == \
        {name for name in int8 if name.endswith("ff.net.0.proj")}
    assert all(p.dtype == torch.bfloat16 for p in q.parameters())               # nothing else went back to fp32
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert cosine(out.float(), ref) > 0.999 and cosine(out.float(), out_bf16.float()) > 0.999
    assert not torch.equal(out, out_bf16)                                       # the int8 layers really ran
    with torch.no_grad():
        conv = next(m for m in int8.values() if isinstance(m, Int8Conv2d))
        h = torch.randn(2, conv.in_channels, 8, 8).bfloat16().contiguous(memory_format=torch.channels_last)
        assert conv(h).is_contiguous(memory_format=torch.channels_last)          # no NCHW round trip
        assert conv(h.contiguous()).is_contiguous()


@pytest.mark.parametrize("stored", [torch.float16, torch.float32])
def test_one_pass_bf16_int8_load_equals_load_then_quantize(tiny_model, tmp_path, stored):
    """load_bf16_int8 quantizes the int8 layers straight from the file's tensors as bf16 holds them: the very same
    network as loading it in bf16 and quantizing it (its scales, its outputs), from an fp16 and an fp32 file; the
    memory manager loads a bf16-int8 UNet that way."""
    from sdlite.engine.memory import ModelManager
    from sdlite.engine.quant import load_bf16_int8
    from sdlite.export import save_diffusers
    from sdlite.loader import open_model

    save_diffusers(tiny_model, tmp_path / "m", dtype=stored)
    ckpt = open_model(tmp_path / "m")
    if not BF16_INT8_RUNS:
        with pytest.raises(QuantizeError, match="bf16-int8 needs"):
            load_bf16_int8(ckpt, "unet")
        return
    cfg = tiny_model.spec.unet
    x, t, ctx = unet_inputs(cfg)
    two_step = quantize_model(ckpt.load("unet", torch.bfloat16, "cpu"), "bf16-int8")
    one_pass = load_bf16_int8(ckpt, "unet", torch.bfloat16)
    assert [type(m) for m in one_pass.modules()] == [type(m) for m in two_step.modules()]
    assert not any(p.is_meta for p in [*one_pass.parameters(), *one_pass.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(one_pass.buffers(), two_step.buffers()))
    assert all(torch.equal(a, b) for a, b in zip(one_pass.parameters(), two_step.parameters()))
    with torch.no_grad():
        out = one_pass(x.bfloat16(), t, ctx.bfloat16())
        assert torch.equal(out, two_step(x.bfloat16(), t, ctx.bfloat16()))
    assert cosine(out.float(), tiny_model.unet(x, t, ctx)) > 0.99
    with ModelManager(ckpt, mode=1, dtype=torch.bfloat16, quantize="bf16-int8").use("unet") as unet:
        assert isinstance(unet.down_blocks[0].resnets[0].conv1, Int8Conv2d)
        with torch.no_grad():
            assert torch.equal(unet(x.bfloat16(), t, ctx.bfloat16()), out)


def test_int8_linear_halves_are_its_two_products():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    whole, split = Int8Linear(linear, 8), Int8Linear(linear, 8, split=True)
    x = torch.randn(5, 64)
    with torch.no_grad():
        value, gate = split.halves(x)
        assert torch.allclose(torch.cat([value, gate], -1) + split.bias, whole(x), atol=1e-5)
        assert torch.allclose(split(x), whole(x), atol=1e-5)
    with pytest.raises(QuantizeError, match="no halves"):
        whole.halves(x)
    with pytest.raises(QuantizeError, match="95 output features has no halves"):
        Int8Linear(nn.Linear(64, 95), 8, split=True)
