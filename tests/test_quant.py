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
from sdlite.engine.quant import (
    KEEP_FP32, QUANTIZE_CHOICES, BF16Conv2d, BF16Linear, Int8Conv2d, Int8Linear, QuantizeError, check_quantize_mode,
    compare_quality, layer_counts, psnr, quantize_activation, quantize_model, quantize_weight, weight_bytes,
)
from sdlite.models.clip import CLIPTextEncoder
from sdlite.models.unet import UNet
from tests.reference import TINY_TEXT_SD1, TINY_UNET_SD1, TINY_UNET_SD2, seed_all


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny layers gain nothing from threads, and on a busy machine the thread barriers cost 5-10x; the bench
    (bench/quant.py) runs the kernels with all threads at full size."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    with torch.no_grad():
        ref = unet(x, t, ctx)
        q = quantize_model(copy.deepcopy(unet), mode)
        out = q(x, t, ctx)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert cosine(out, ref) > min_cosine
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
    for layer in unet.modules():
        if isinstance(layer, (Int8Linear, Int8Conv2d)):
            assert layer.packed_weight.is_mkldnn and layer.packed_weight.dtype == torch.int8
            assert layer.weight_scale.dtype == torch.float32
    # the forward pass runs oneDNN's u8 x s8 kernels, and only the two fp32 convolutions run as float ones
    x, t, ctx = unet_inputs(TINY_UNET_SD1)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        unet(x, t, ctx)
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
        assert cosine(q(ids), ref) > 0.999
    assert out.shape == ref.shape
    assert layer_counts(q)["Int8Linear"] == 6 * TINY_TEXT_SD1.layers


def test_weight_memory():
    unet = tiny_unet(TINY_UNET_SD1)
    fp32 = weight_bytes(unet)
    assert fp32 == sum(p.numel() * 4 for p in unet.parameters())
    layers = [m for n, m in unet.named_modules() if type(m) in (nn.Linear, nn.Conv2d)
              and not any(n == k or n.startswith(k + ".") for k in KEEP_FP32)]
    weights = sum(m.weight.numel() for m in layers)
    channels = sum(m.weight.shape[0] for m in layers)
    q = quantize_model(copy.deepcopy(unet), "int8")
    # each quantized weight goes from 4 bytes to 1, plus one fp32 scale per output channel
    assert weight_bytes(q) == fp32 - 3 * weights + 4 * channels
    b = quantize_model(copy.deepcopy(unet), "bf16")
    assert weight_bytes(b) == fp32 - 2 * sum(p.numel() for m in layers for p in m.parameters())


def test_quantize_twice_and_none_are_no_ops():
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
    assert out.dtype == torch.float32 and cosine(out, ref) > 0.999


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
    from sdlite.tokenizer import CLIPTokenizer
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
