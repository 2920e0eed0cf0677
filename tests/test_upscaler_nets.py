"""Upscaler nets (RRDBNet, SRVGGNetCompact), their files and the tiler.

Every published key layout is written to .pth and .safetensors files with random weights at the full size (23
RRDB blocks, 64 features, 32 growth channels; SRVGG 32 and 16 convs) and loaded with ``load_upscaler``; its output
is compared with a forward pass written here with torch.nn.functional straight on the raw state dict of that
layout, so neither our modules nor our key tables take part in the reference.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from sdlite.errors import CheckpointError, SDLiteError
from sdlite.upscalers import (RRDBConfig, RRDBNet, SRVGGConfig, SRVGGNetCompact, Upscaler, UpscalerError,
                              load_upscaler, upscale, upscale_tensor)
from sdlite.upscalers import tiling
from sdlite.weights.safetensors import save_safetensors

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # small inputs: one thread is as fast, and steadier

# --- the layouts, as this test knows them ------------------------------------------------------------------------
# role -> key (without .weight/.bias); "rdb" is formatted with n (block), r (dense block 1-3), c (conv 1-5)

OLD = dict(first="model.0", rdb="model.1.sub.{n}.RDB{r}.conv{c}.0", trunk="model.1.sub.{nb}",
           up=("model.3", "model.6"), hr="model.8", last="model.10")
NEW = dict(first="conv_first", rdb="RRDB_trunk.{n}.RDB{r}.conv{c}", trunk="trunk_conv", up=("upconv1", "upconv2"),
           hr="HRconv", last="conv_last")
REAL = dict(first="conv_first", rdb="body.{n}.rdb{r}.conv{c}", trunk="conv_body", up=("conv_up1", "conv_up2"),
            hr="conv_hr", last="conv_last")


def _conv_weights(sd, key, n_out, n_in, gen, gain):
    sd[f"{key}.weight"] = torch.randn(n_out, n_in, 3, 3, generator=gen) * (gain / math.sqrt(9 * n_in))
    sd[f"{key}.bias"] = torch.randn(n_out, generator=gen) * 0.02


def rrdb_state(names, seed, nb=23, nf=64, gc=32, in_ch=3, out_ch=3, gain=0.5):
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    _conv_weights(sd, names["first"], nf, in_ch, gen, gain)
    for n in range(nb):
        for r in (1, 2, 3):
            for c in range(1, 6):
                _conv_weights(sd, names["rdb"].format(n=n, r=r, c=c), gc if c < 5 else nf, nf + (c - 1) * gc, gen,
                              gain)
    _conv_weights(sd, names["trunk"].format(nb=nb), nf, nf, gen, gain)
    for key in names["up"]:
        _conv_weights(sd, key, nf, nf, gen, gain)
    _conv_weights(sd, names["hr"], nf, nf, gen, gain)
    _conv_weights(sd, names["last"], out_ch, nf, gen, gain)
    sd[f"{names['last']}.bias"] += 0.5      # outputs around mid-grey, so the 8-bit comparisons mean something
    return sd


def reference_rrdb(sd, names, x, nb, unshuffle=1):
    """ESRGAN's forward on the raw state dict ``sd`` whose keys follow ``names``."""
    def conv(key, t):
        return F.conv2d(t, sd[f"{key}.weight"], sd[f"{key}.bias"], padding=1)

    def lrelu(t):
        return F.leaky_relu(t, 0.2)

    if unshuffle > 1:
        x = F.pixel_unshuffle(x, unshuffle)
    first = conv(names["first"], x)
    h = first
    for n in range(nb):
        block_in = h
        for r in (1, 2, 3):
            rdb_in = h
            parts = [h]
            for c in range(1, 5):
                parts.append(lrelu(conv(names["rdb"].format(n=n, r=r, c=c), torch.cat(parts, 1))))
            h = conv(names["rdb"].format(n=n, r=r, c=5), torch.cat(parts, 1)) * 0.2 + rdb_in
        h = h * 0.2 + block_in
    h = first + conv(names["trunk"].format(nb=nb), h)
    for key in names["up"]:
        h = lrelu(conv(key, F.interpolate(h, scale_factor=2, mode="nearest")))
    return conv(names["last"], lrelu(conv(names["hr"], h)))


def srvgg_state(seed, num_conv, nf=64, ch=3, scale=4, gain=1.3):
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    _conv_weights(sd, "body.0", nf, ch, gen, gain)
    for i in range(num_conv + 1):
        sd[f"body.{2 * i + 1}.weight"] = torch.rand(nf, generator=gen) * 0.3     # PReLU slopes
        if i < num_conv:
            _conv_weights(sd, f"body.{2 * i + 2}", nf, nf, gen, gain)
    _conv_weights(sd, f"body.{2 * num_conv + 2}", ch * scale ** 2, nf, gen, gain)
    return sd


def reference_srvgg(sd, x, num_conv, scale):
    h = x
    for i in range(2 * num_conv + 3):
        if i % 2:
            h = F.prelu(h, sd[f"body.{i}.weight"])
        else:
            h = F.conv2d(h, sd[f"body.{i}.weight"], sd[f"body.{i}.bias"], padding=1)
    return F.pixel_shuffle(h, scale) + F.interpolate(x, scale_factor=scale, mode="nearest")


def _save_both(tmp_path, name, sd, wrapper=None):
    pth, st = tmp_path / f"{name}.pth", tmp_path / f"{name}.safetensors"
    torch.save({wrapper: sd} if wrapper else sd, pth)
    save_safetensors(sd, st)
    return [pth, st]


def _eight_bit(t):
    return t.clamp(0, 1).mul(255).round()


def _check(up, x, ref):
    with torch.inference_mode():
        y = up.net(x)
    assert y.shape == ref.shape
    rel = (y - ref).abs().max().item() / ref.abs().max().item()
    assert rel < 1e-4, rel
    assert (_eight_bit(y) - _eight_bit(ref)).abs().max().item() <= 2


# --- each layout at the full size --------------------------------------------------------------------------------

CASES = {   # name: (state builder, reference, arch, scale, layout, .pth wrapper)
    "esrgan_old_x4": (lambda: rrdb_state(OLD, 1), lambda sd, x: reference_rrdb(sd, OLD, x, 23), "RRDBNet", 4,
                      "ESRGAN (old)", None),
    "esrgan_new_x4": (lambda: rrdb_state(NEW, 2), lambda sd, x: reference_rrdb(sd, NEW, x, 23), "RRDBNet", 4,
                      "ESRGAN", None),
    "realesrgan_x4plus": (lambda: rrdb_state(REAL, 3), lambda sd, x: reference_rrdb(sd, REAL, x, 23), "RRDBNet", 4,
                          "Real-ESRGAN", "params_ema"),
    "realesrgan_x2plus": (lambda: rrdb_state(REAL, 4, in_ch=12),
                          lambda sd, x: reference_rrdb(sd, REAL, x, 23, unshuffle=2), "RRDBNet", 2, "Real-ESRGAN",
                          "params_ema"),
    "realesr_general_x4v3": (lambda: srvgg_state(5, 32), lambda sd, x: reference_srvgg(sd, x, 32, 4),
                             "SRVGGNetCompact", 4, "SRVGG", "params"),
    "realesr_animevideov3": (lambda: srvgg_state(6, 16), lambda sd, x: reference_srvgg(sd, x, 16, 4),
                             "SRVGGNetCompact", 4, "SRVGG", "params"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_loads_and_matches_reference(tmp_path, case):
    build, reference, arch, scale, layout, wrapper = CASES[case]
    sd = build()
    x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        ref = reference(sd, x)
    assert ref.shape == (1, 3, 16 * scale, 16 * scale)
    for path in _save_both(tmp_path, case, sd, wrapper):
        up = load_upscaler(path)
        assert (up.arch, up.scale, up.layout, up.name) == (arch, scale, layout, case)
        assert up.dtype == torch.float32 and not any(p.requires_grad for p in up.net.parameters())
        _check(up, x, ref)
    cfg = up.config
    if arch == "RRDBNet":
        assert (cfg.num_block, cfg.num_feat, cfg.num_grow, cfg.in_channels, cfg.out_channels) == (23, 64, 32, 3, 3)
        assert cfg.unshuffle == (2 if scale == 2 else 1)
    else:
        assert (cfg.num_feat, cfg.num_conv) == (64, 32 if "general" in case else 16)


@pytest.mark.parametrize("ups,scale", [((), 1), (("model.3",), 2), (("model.3", "model.6", "model.9"), 8)])
def test_old_layout_scale_from_the_upsampling_convs(tmp_path, ups, scale):
    n = len(ups)
    names = dict(OLD, up=ups, hr=f"model.{2 + 3 * n}", last=f"model.{4 + 3 * n}")
    sd = rrdb_state(names, 10 + n, nb=2, nf=16, gc=8, in_ch=1, out_ch=1, gain=0.8)
    x = torch.rand(2, 1, 12, 10)
    up = load_upscaler(_save_both(tmp_path, f"old{scale}x", sd)[1])
    assert (up.arch, up.scale, up.channels, up.config.num_block, up.config.num_feat) == ("RRDBNet", scale, 1, 2, 16)
    _check(up, x, reference_rrdb(sd, names, x, 2))


def test_realesrgan_x1_unshuffles_by_four(tmp_path):
    sd = rrdb_state(REAL, 20, nb=1, nf=16, gc=8, in_ch=48)
    up = load_upscaler(_save_both(tmp_path, "1x_model", sd)[0])
    assert (up.scale, up.config.unshuffle, up.config.in_channels) == (1, 4, 3)
    x = torch.rand(1, 3, 16, 12)
    _check(up, x, reference_rrdb(sd, REAL, x, 1, unshuffle=4))


def test_params_ema_is_preferred_and_wrappers_unwrap(tmp_path):
    sd = srvgg_state(30, 2, nf=8)
    junk = {k: torch.zeros_like(v) for k, v in sd.items()}
    torch.save({"params": junk, "params_ema": sd}, tmp_path / "both.pth")
    torch.save({"model": {"module": sd}}, tmp_path / "nested.pth")
    x = torch.rand(1, 3, 8, 8)
    ref = reference_srvgg(sd, x, 2, 4)
    for name in ("both.pth", "nested.pth"):
        _check(load_upscaler(tmp_path / name), x, ref)


def test_fp16_file_and_bf16_load(tmp_path):
    sd = srvgg_state(31, 4, nf=16)
    path = tmp_path / "half.safetensors"
    save_safetensors({k: v.half() for k, v in sd.items()}, path, {"name": "half"})
    up = load_upscaler(path, dtype=torch.bfloat16)
    assert up.dtype == torch.bfloat16 and up.metadata == {"name": "half"}
    x = torch.rand(1, 3, 8, 8)
    ref = reference_srvgg({k: v.half().float() for k, v in sd.items()}, x, 4, 4)
    with torch.inference_mode():
        y = up.net(x.bfloat16()).float()
    assert (y - ref).abs().max() < 0.05


# --- refusals ----------------------------------------------------------------------------------------------------


def test_other_architectures_are_refused_by_name(tmp_path):
    swinir = {"conv_first.weight": torch.zeros(60, 3, 3, 3), "patch_embed.norm.weight": torch.zeros(60),
              "layers.0.residual_group.blocks.0.norm1.weight": torch.zeros(60),
              "layers.0.residual_group.blocks.0.attn.relative_position_bias_table": torch.zeros(225, 6),
              "conv_after_body.weight": torch.zeros(60, 60, 3, 3), "conv_last.weight": torch.zeros(3, 64, 3, 3)}
    hat = dict(swinir, **{"layers.0.residual_group.overlap_attn.qkv.weight": torch.zeros(180, 60)})
    gfpgan = {"conv_body_first.weight": torch.zeros(32, 3, 1, 1), "stylegan_decoder.style_mlp.1.weight":
              torch.zeros(512, 512), "toRGB.0.weight": torch.zeros(3, 512, 1, 1)}
    for name, sd, arch in (("swinir", swinir, "a SwinIR upscaler"), ("hat", hat, "a HAT upscaler"),
                           ("gfpgan", gfpgan, "a GFPGAN face restorer")):
        path = tmp_path / f"{name}.pth"
        torch.save({"params_ema": sd}, path)
        with pytest.raises(UpscalerError) as err:
            load_upscaler(path)
        assert str(err.value) == (f"{path}: is {arch}; sdlite runs RRDBNet (ESRGAN, Real-ESRGAN) and "
                                  "SRVGGNetCompact upscalers")


def test_unknown_files_are_refused_with_their_keys(tmp_path):
    path = tmp_path / "random.safetensors"
    save_safetensors({f"encoder.block{i}.weight": torch.zeros(2) for i in range(8)}, path)
    with pytest.raises(UpscalerError) as err:
        load_upscaler(path)
    message = str(err.value)
    assert message.startswith(f"{path}: is not an upscaler sdlite knows") and "'encoder.block0.weight'" in message
    assert "RRDBNet" in message
    with pytest.raises(UpscalerError, match="no such file"):
        load_upscaler(tmp_path / "missing.pth")


def test_shape_errors_name_key_and_shapes(tmp_path):
    sd = rrdb_state(OLD, 40, nb=2, nf=16, gc=8)
    sd["model.1.sub.1.RDB2.conv3.0.weight"] = torch.zeros(8, 31, 3, 3)
    path = tmp_path / "bad.pth"
    torch.save(sd, path)
    with pytest.raises(UpscalerError) as err:
        load_upscaler(path)
    assert str(err.value).startswith(f"{path}: tensor 'model.1.sub.1.RDB2.conv3.0.weight': has shape [8, 31, 3, 3], "
                                     "but this RRDBConfig(")
    assert "needs [8, 32, 3, 3]" in str(err.value)
    del sd["model.1.sub.1.RDB2.conv3.0.weight"]
    torch.save(sd, path)
    with pytest.raises(UpscalerError, match=r"1 missing keys \(first few, in our names: 'body.1.rdb2.conv3.weight'"):
        load_upscaler(path)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pth_never_runs_pickled_code(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pth"
    torch.save({"params_ema": srvgg_state(50, 1, nf=4), "evil": _Evil(marker)}, path)
    with pytest.raises(CheckpointError) as err:
        load_upscaler(path)
    assert "refused" in str(err.value) and "system" in str(err.value) and str(path) in str(err.value)
    assert not marker.exists()


# --- tiling ------------------------------------------------------------------------------------------------------


def _upscaler(net):
    return Upscaler(net.eval().requires_grad_(False), type(net).__name__, net.scale, "test", None, "test")


def _image(h, w, seed=0):
    """A smooth picture with some texture (pure noise would make every output pixel its own case)."""
    g = torch.Generator().manual_seed(seed)
    base = F.interpolate(torch.rand(1, 3, h // 8 + 1, w // 8 + 1, generator=g), size=(h, w), mode="bicubic",
                         align_corners=False)
    return (base + 0.1 * torch.rand(1, 3, h, w, generator=g)).clamp(0, 1)


def test_tiled_srvgg_equals_untiled(tmp_path):
    """The full-size animevideov3 net, the default overlap (its whole receptive field, 18 pixels): the tiles give
    the untiled output up to float rounding."""
    sd = srvgg_state(60, 16)
    up = load_upscaler(_save_both(tmp_path, "anime", sd)[1])
    x = _eight_bit(_image(72, 60)) / 255
    with torch.inference_mode():
        whole = up.net(x)
    assert (upscale_tensor(up, x, tile=24) - whole).abs().max() < 1e-5
    image = Image.fromarray(_eight_bit(x)[0].permute(1, 2, 0).numpy().astype(np.uint8))
    tiled = np.asarray(upscale(up, image, tile=24), np.int16)
    assert tiled.shape == (288, 240, 3)
    assert np.abs(tiled - _eight_bit(whole)[0].permute(1, 2, 0).numpy()).max() <= 1


def test_tiled_rrdbnet_full_size_within_one_level(tmp_path):
    """The full-size net from a file (random weights), tiles smaller than the image and an overlap below the
    default (so that tiles really differ): 8-bit outputs within 1/255."""
    sd = rrdb_state(REAL, 61)
    up = load_upscaler(_save_both(tmp_path, "x4plus", sd, "params_ema")[1])
    x = _image(48, 40)
    with torch.inference_mode():
        whole = up.net(x)
    tiled = upscale_tensor(up, x, tile=24, overlap=12)                 # 2 x 2 tiles of 36 x 32 input pixels
    assert (_eight_bit(tiled) - _eight_bit(whole)).abs().max() <= 1
    assert (tiled - whole).abs().max() < 1e-3


def test_tiling_is_exact_within_the_receptive_field(monkeypatch):
    """Small nets whose whole receptive field fits in the overlap, odd sizes, unshuffle padding, the RRDB tail run
    in small blocks: the same as untiled up to float rounding."""
    monkeypatch.setattr(tiling, "TAIL_BLOCK", 5)
    torch.manual_seed(0)
    for cfg in (RRDBConfig(num_block=1, num_feat=8, num_grow=4), RRDBConfig(num_block=1, num_feat=8, num_grow=4,
                                                                             unshuffle=2),
                RRDBConfig(num_block=1, num_feat=8, num_grow=4, upsamples=0)):
        up = _upscaler(RRDBNet(cfg))
        x = torch.rand(2, 3, 29, 23)
        pad = (0, -23 % cfg.unshuffle, 0, -29 % cfg.unshuffle)
        with torch.inference_mode():
            whole = up.net(F.pad(x, pad, mode="reflect"))[:, :, :29 * cfg.scale, :23 * cfg.scale]
        tiled = upscale_tensor(up, x, tile=8, overlap=18)
        assert tiled.shape == whole.shape and (tiled - whole).abs().max() < 1e-5


def test_image_modes_and_precision():
    up = _upscaler(SRVGGNetCompact(SRVGGConfig(num_feat=8, num_conv=2, scale=2)))
    rgba = Image.fromarray(np.random.default_rng(0).integers(0, 256, (10, 12, 4), dtype=np.uint8), "RGBA")
    for mode in ("RGBA", "RGB", "L", "LA", "P"):
        out = upscale(up, rgba.convert(mode), tile=4)
        assert out.size == (24, 20) and out.mode == {"P": "RGB"}.get(mode, mode)
    alpha = upscale(up, rgba).getchannel("A")
    assert alpha.tobytes() == rgba.getchannel("A").resize((24, 20), Image.Resampling.LANCZOS).tobytes()
    x = torch.rand(1, 3, 10, 12)
    fp32, bf16 = upscale_tensor(up, x), upscale_tensor(up, x, dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32 and (fp32 - bf16).abs().max() < 0.05
    assert up.dtype == torch.float32          # the bf16 run used a converted copy
    with pytest.raises(SDLiteError, match="float32, bfloat16 or float16"):
        upscale_tensor(up, x, dtype=torch.float64)
    with pytest.raises(SDLiteError, match=r"16-bit or float"):
        upscale(up, Image.new("I;16", (4, 4)))
