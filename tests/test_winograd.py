"""Winograd F(2x2, 3x3) convolutions (sdlite.engine.winograd) against PyTorch's direct convolution in float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdlite.engine import winograd as W
from sdlite.engine.packing import conv2d as layer_conv2d

# fp32 rounding of a direct convolution over C*9 products is about 3e-7 of the output's largest value on these
# shapes; F(2x2,3x3)'s transforms have coefficients 0, +-1 and 1/2, so it must stay at the same order
TOL = 2e-6


def _reference(x, w, b, padding):
    return F.conv2d(x.double(), w.double(), None if b is None else b.double(), padding=padding)


def _rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("n,c,k,h,w,padding,bias,channels_last", [
    (2, 320, 320, 16, 16, (1, 1), True, True),
    (1, 24, 40, 9, 13, (1, 1), True, False),        # odd sizes: the last tile row/column is padded and cropped
    (3, 16, 8, 8, 10, (0, 0), False, True),         # no padding (tiled decoding pads by hand)
    (1, 8, 8, 2, 2, (1, 1), True, False),           # a single tile
    (2, 33, 17, 7, 12, (0, 0), True, False),
])
def test_matches_direct_convolution(n, c, k, h, w, padding, bias, channels_last):
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(k, c, 3, 3) / (c * 9) ** 0.5
    b = torch.randn(k) if bias else None
    ref = _reference(x, weight, b, padding)
    got = W.winograd_conv2d(x, weight, b, padding)
    assert got.shape == ref.shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    direct = _rel_err(F.conv2d(x, weight, b, padding=padding), ref)
    assert _rel_err(got, ref) <= TOL, f"direct fp32 convolution: {direct:.1e}"


def test_chunking_does_not_change_the_result(monkeypatch):
    """Chunks of a few tiles (rows of tiles split across chunks, a last partial chunk) give the one-chunk result."""
    torch.manual_seed(1)
    x, weight, b = torch.randn(2, 12, 14, 10), torch.randn(6, 12, 3, 3), torch.randn(6)
    monkeypatch.setattr(W, "TILES_PER_CHUNK", 10**6)
    whole = W.winograd_conv2d(x, weight, b)
    for tiles in (1, 7, 23):
        monkeypatch.setattr(W, "TILES_PER_CHUNK", tiles)
        W.release_workspace()
        assert torch.allclose(W.winograd_conv2d(x, weight, b), whole, rtol=0, atol=1e-5)


def test_the_transforms_are_lavin_and_gray():
    """U = G g G^T and Y = A^T M A as matrices over a tile, checked on one tile against the 1-D definition: the
    transformed product of one 4x4 input tile and one filter is the 2x2 valid correlation."""
    torch.manual_seed(2)
    d, g = torch.randn(4, 4, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    bt = torch.tensor([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=torch.float64)
    u = W._G16.double() @ g.reshape(9)
    v = (bt @ d @ bt.T).reshape(16)
    y = (W._A16.double() @ (u * v)).reshape(2, 2)
    direct = torch.stack([torch.stack([(d[i:i + 3, j:j + 3] * g).sum() for j in range(2)]) for i in range(2)])
    assert torch.allclose(y, direct, atol=1e-12)


def test_eligible_layers():
    yes = [nn.Conv2d(320, 320, 3, padding=1), nn.Conv2d(960, 320, 3, padding=1), nn.Conv2d(1920, 640, 3, padding=1),
           nn.Conv2d(512, 512, 3, padding=1), nn.Conv2d(640, 640, 3, padding=1)]
    no = [nn.Conv2d(1280, 1280, 3, padding=1),       # its filter transform per call costs more than it saves
          nn.Conv2d(4, 320, 3, padding=1), nn.Conv2d(320, 4, 3, padding=1),
          nn.Conv2d(256, 256, 3, padding=1), nn.Conv2d(128, 128, 3, padding=1),   # too few channels (256: packed)
          nn.Conv2d(320, 320, 3, stride=2, padding=1), nn.Conv2d(320, 320, 1), nn.Conv2d(320, 320, 3, padding=2),
          nn.Conv2d(320, 320, 3, padding=1, groups=2), nn.Conv2d(320, 320, 3, padding=1, padding_mode="reflect"),
          nn.Conv2d(320, 320, 3, padding=1, dilation=2)]
    assert all(W.eligible(conv) for conv in yes)
    assert not any(W.eligible(conv) for conv in no)
    assert not W.eligible(W.WinogradConv2d.from_conv(yes[0]))     # already converted
    # against PyTorch's plain convolution (no prepacking) the UNet's 1280-channel layers are taken too
    # (and the VAE's 256-channel ones)
    wide = [nn.Conv2d(1280, 1280, 3, padding=1), nn.Conv2d(2560, 1280, 3, padding=1),
            nn.Conv2d(640, 1280, 3, padding=1), nn.Conv2d(256, 256, 3, padding=1), nn.Conv2d(512, 256, 3, padding=1)]
    assert all(W.eligible(conv, wide=True) for conv in yes + wide)
    assert not any(W.eligible(conv) for conv in wide)
    assert not any(W.eligible(conv, wide=True) for conv in no[1:3] + no[4:] + [
        nn.Conv2d(1280, 2560, 3, padding=1), nn.Conv2d(128, 256, 3, padding=1), nn.Conv2d(256, 128, 3, padding=1)])


@pytest.mark.parametrize("budget,tiles", [(16 * 24 * 16, 10**6),   # slices of 16, 16 and 8 channels, one chunk
                                          (16 * 24 * 35, 9),       # slices of 32 and 8, several chunks
                                          (1, 5)])                 # the smallest slice: 16 channels
def test_output_channel_slices_give_the_unsliced_result(monkeypatch, budget, tiles):
    """Layers whose transformed filter exceeds FILTER_BUDGET run in slices of output channels; any slicing, with
    one chunk of tiles or several, gives the same result and stays within the direct convolution's rounding."""
    torch.manual_seed(6)
    x, weight, b = torch.randn(2, 24, 13, 11), torch.randn(40, 24, 3, 3) / 15, torch.randn(40)
    whole = W.winograd_conv2d(x, weight, b)
    monkeypatch.setattr(W, "FILTER_BUDGET", budget)
    monkeypatch.setattr(W, "TILES_PER_CHUNK", tiles)
    W.release_workspace()
    sliced = W.winograd_conv2d(x, weight, b)
    assert torch.allclose(sliced, whole, rtol=0, atol=1e-5)
    assert _rel_err(sliced, _reference(x, weight, b, (1, 1))) <= TOL
    assert W._workspace.buffers["u"].numel() <= max(budget, 16 * 16 * 24)


def test_layer_shares_the_weights_and_falls_back_on_small_inputs():
    torch.manual_seed(3)
    conv = nn.Conv2d(320, 320, 3, padding=1)
    layer = W.WinogradConv2d.from_conv(conv)
    assert layer.weight.data_ptr() == conv.weight.data_ptr() and layer.bias.data_ptr() == conv.bias.data_ptr()
    with torch.no_grad():
        small = torch.randn(1, 320, W.MIN_SIDE - 1, 12)
        assert torch.equal(layer(small), conv(small))          # the direct convolution itself
        x = torch.randn(1, 320, 12, 12)
        ref = _reference(x, conv.weight, conv.bias, (1, 1))
        assert _rel_err(layer(x), ref) <= TOL
        # tiled decoding's call with its own padding, through the helper it uses
        assert _rel_err(layer_conv2d(layer, x, (0, 0)), _reference(x, conv.weight, conv.bias, (0, 0))) <= TOL


def test_winograd_model_replaces_only_eligible_layers():
    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv2d(4, 320, 3, padding=1), nn.SiLU(), nn.Conv2d(320, 320, 3, padding=1),
                        nn.Conv2d(320, 2560, 3, padding=1), nn.Conv2d(2560, 640, 3, padding=1))
    x = torch.randn(1, 4, 10, 10)
    with torch.no_grad():
        ref = net(x)
        W.winograd_model(net)
        kinds = [type(layer) for layer in net]
        # 2560 output channels; 2560*640 channel pairs
        assert kinds == [nn.Conv2d, nn.SiLU, W.WinogradConv2d, nn.Conv2d, nn.Conv2d]
        assert _rel_err(net(x), ref.double()) <= 1e-5
        W.winograd_model(net, wide=True)                        # 2560*640 taken now, 2560 outputs still not
        assert [type(layer) for layer in net] == [nn.Conv2d, nn.SiLU, W.WinogradConv2d, nn.Conv2d, W.WinogradConv2d]
        assert _rel_err(net(x), ref.double()) <= 1e-5


def test_workspace_is_reused_and_released():
    torch.manual_seed(5)
    x, weight = torch.randn(1, 16, 12, 12), torch.randn(16, 16, 3, 3)
    W.release_workspace()
    W.winograd_conv2d(x, weight, None)
    first = {key: buf.data_ptr() for key, buf in W._workspace.buffers.items()}
    W.winograd_conv2d(x, weight, None)
    assert {key: buf.data_ptr() for key, buf in W._workspace.buffers.items()} == first
    W.release_workspace()
    assert "buffers" not in W._workspace.__dict__


@pytest.mark.slow
def test_full_size_engine_uses_winograd_and_matches_direct(sd15_folder):
    """On the real SD 1.5 shapes (memory mode 1, fp32, CPU): with prepacked weights the UNet's first two levels run
    by Winograd, and with plain weights its 1280-channel layers too; the VAE decoder's and encoder's 512-channel
    layers in both. The UNet's output equals the --no-winograd one within 1e-5 and the image within 1/255. Kept at
    full size in the tests: which layers take Winograd follows from the real channel counts, the prepacking choice
    and the latent sizes, which tiny models do not reach (the kernel itself is checked on small shapes above)."""
    from sdlite.pipeline import Engine, Request

    engines = {"packed": Engine.load(sd15_folder, winograd=True, prepack=True, precision="exact"),
               "plain": Engine.load(sd15_folder, winograd=True, prepack=False, precision="exact"),
               "direct": Engine.load(sd15_folder, winograd=False, precision="exact")}
    levels01 = ("down_blocks.0.", "down_blocks.1.", "up_blocks.2.", "up_blocks.3.")
    for kind, expected in (("packed", 21), ("plain", 47)):
        unet, vae = engines[kind].models.get("unet"), engines[kind].models.get("vae")
        wino = [name for name, layer in unet.named_modules() if isinstance(layer, W.WinogradConv2d)]
        # levels 0 and 1: 4 + 4 resnet convs down, 6 + 6 up, and up_blocks.2's upsampler conv (640 -> 640);
        # plain, also levels 2 and 3: 4 + 4 down, 4 in the mid block, 6 + 6 up and two upsampler convs
        assert len(wino) == expected, (kind, wino)
        assert all(name.startswith(levels01) for name in wino) == (kind == "packed")
        # the decoder's mid block (4), up_blocks.0 and .1 (6 resnet convs and an upsampler conv each); the
        # encoder's 512-channel ones (3 in down_blocks.2, 4 in down_blocks.3, 4 in the mid block); plain, also
        # those with 256 channels in or out: the decoder's up_blocks.2 (6 and its upsampler), the encoder's
        # down_blocks.1 (3 of 4, the first taking 128) and down_blocks.2's first (256 -> 512)
        assert sum(isinstance(layer, W.WinogradConv2d) for layer in vae.decoder.modules()) == \
            {"packed": 18, "plain": 25}[kind]
        assert sum(isinstance(layer, W.WinogradConv2d) for layer in vae.encoder.modules()) == \
            {"packed": 11, "plain": 15}[kind]
    assert not any(isinstance(layer, W.WinogradConv2d) for layer in engines["direct"].models.get("unet").modules())
    torch.manual_seed(0)
    # 32x32 latents: levels 0-2 at 8x8 or more run by Winograd, level 3 (4x4) by the direct fallback
    x, t, ctx = torch.randn(2, 4, 32, 32), torch.tensor([500.0, 500.0]), torch.randn(2, 77, 768)
    request = Request(prompt="a red circle", steps=2, seed=7, width=128, height=128, sampler="euler")
    with torch.no_grad():
        outs = {kind: engine.models.get("unet")(x, t, ctx) for kind, engine in engines.items()}
    images = {kind: np.asarray(engine.generate(request).images[0], dtype=np.int16)
              for kind, engine in engines.items()}
    for kind in ("packed", "plain"):
        assert _rel_err(outs[kind], outs["direct"].double()) <= 1e-5, kind
        assert np.abs(images[kind] - images["direct"]).max() <= 1, kind
