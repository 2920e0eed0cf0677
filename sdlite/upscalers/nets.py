"""Image super-resolution networks of the ESRGAN family: :class:`RRDBNet` and :class:`SRVGGNetCompact`.

* :class:`RRDBNet` -- ESRGAN (Wang et al. 2018, "ESRGAN: Enhanced Super-Resolution Generative Adversarial
  Networks") and Real-ESRGAN (Wang et al. 2021), and the many community models of that architecture (4x, 2x, 1x,
  8x). A trunk of Residual-in-Residual Dense Blocks at the input's resolution, then nearest-neighbour x2
  upsamplings each followed by a 3x3 convolution. Real-ESRGAN's x2plus (and 1x models) first fold the input into
  channels with ``pixel_unshuffle`` (by 2, or by 4) so that the same x4 body gives x2 (or x1).
* :class:`SRVGGNetCompact` -- Real-ESRGAN's compact VGG-style net (``realesr-general-x4v3``,
  ``realesr-animevideov3``): a plain stack of 3x3 convolutions and PReLUs at the input's resolution, a last
  convolution to ``out_channels * scale**2`` channels, ``pixel_shuffle``, plus the nearest-upsampled input.

Images are (B, C, H, W) in [0, 1]; outputs are (B, C, scale*H, scale*W), not clamped. Module names are the
Real-ESRGAN/basicsr ones (``conv_first``, ``body.N.rdb1.conv1``, ``conv_body``, ``conv_up1`` ... ; SRVGG
``body.N``); every other published layout is renamed to these in :mod:`sdlite.upscalers.files`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RRDBConfig", "SRVGGConfig", "RRDBNet", "SRVGGNetCompact", "ResidualDenseBlock", "RRDB"]

LRELU_SLOPE = 0.2        # every LeakyReLU of ESRGAN
RESIDUAL_SCALE = 0.2     # ESRGAN's residual scaling: a dense block's and an RRDB's branch are multiplied by it


def _conv(n_in: int, n_out: int) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1)


def _lrelu(x: torch.Tensor) -> torch.Tensor:
    return F.leaky_relu(x, LRELU_SLOPE, inplace=True)


@dataclass(frozen=True)
class RRDBConfig:
    """Every fact of an :class:`RRDBNet`. ESRGAN's and Real-ESRGAN x4plus' are the defaults.

    ``upsamples``: the number of nearest x2 upsampling stages (conv_up1, conv_up2, ...); ``unshuffle``: the
    pixel-unshuffle factor applied to the input first (1: none; Real-ESRGAN x2plus: 2; its 1x models: 4).
    """

    in_channels: int = 3
    out_channels: int = 3
    num_feat: int = 64
    num_block: int = 23
    num_grow: int = 32
    upsamples: int = 2
    unshuffle: int = 1

    @property
    def scale(self) -> int:
        return 2 ** self.upsamples // self.unshuffle

    def __post_init__(self):
        if self.unshuffle not in (1, 2, 4) or 2 ** self.upsamples % self.unshuffle:
            raise ValueError(f"an RRDBNet with {self.upsamples} x2 upsamplings cannot undo a pixel unshuffle by "
                             f"{self.unshuffle}")

    @property
    def receptive_radius(self) -> float:
        """How far (in input pixels) an output pixel can see: every 3x3 convolution adds one pixel of its own
        resolution. A dense block's longest path is its 5 convolutions; an RRDB chains 3 dense blocks."""
        low = (2 + 15 * self.num_block) * self.unshuffle               # conv_first, the trunk, conv_body
        high = sum(1 / 2 ** (i + 1) for i in range(self.upsamples)) + 2 / 2 ** self.upsamples  # up, hr, last
        return low + high * self.unshuffle


@dataclass(frozen=True)
class SRVGGConfig:
    """Every fact of an :class:`SRVGGNetCompact` (``realesr-general-x4v3``: the defaults; ``animevideov3``:
    ``num_conv=16``)."""

    in_channels: int = 3
    out_channels: int = 3
    num_feat: int = 64
    num_conv: int = 32
    scale: int = 4

    def __post_init__(self):
        if self.in_channels != self.out_channels:   # the nearest-upsampled input is added to the output
            raise ValueError(f"an SRVGGNetCompact needs as many output channels as input channels, not "
                             f"{self.out_channels} and {self.in_channels}")

    @property
    def receptive_radius(self) -> int:
        """How far (in input pixels) an output pixel can see: one pixel per 3x3 convolution (the nearest-upsampled
        input that is added sees only its own pixel)."""
        return self.num_conv + 2


class ResidualDenseBlock(nn.Module):
    """Five 3x3 convolutions, each seeing the block's input and every earlier output (dense connections);
    the last one's output, scaled by 0.2, is added to the input."""

    def __init__(self, num_feat: int, num_grow: int):
        super().__init__()
        self.conv1 = _conv(num_feat, num_grow)
        self.conv2 = _conv(num_feat + num_grow, num_grow)
        self.conv3 = _conv(num_feat + 2 * num_grow, num_grow)
        self.conv4 = _conv(num_feat + 3 * num_grow, num_grow)
        self.conv5 = _conv(num_feat + 4 * num_grow, num_feat)

    def forward(self, x):
        feats = [x]                                                     # (B, F, H, W)
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            feats.append(_lrelu(conv(torch.cat(feats, 1))))             # (B, G, H, W) each
        return self.conv5(torch.cat(feats, 1)) * RESIDUAL_SCALE + x


class RRDB(nn.Module):
    """Residual in Residual Dense Block: three dense blocks in a row, their result scaled by 0.2 plus the input."""

    def __init__(self, num_feat: int, num_grow: int):
        super().__init__()
        self.rdb1 = ResidualDenseBlock(num_feat, num_grow)
        self.rdb2 = ResidualDenseBlock(num_feat, num_grow)
        self.rdb3 = ResidualDenseBlock(num_feat, num_grow)

    def forward(self, x):
        return self.rdb3(self.rdb2(self.rdb1(x))) * RESIDUAL_SCALE + x


class RRDBNet(nn.Module):
    """ESRGAN's generator: (B, in, H, W) -> (B, out, scale*H, scale*W).

    With ``unshuffle`` > 1, H and W must be multiples of it (the tiler pads to that).
    """

    TAIL_HALO = 2   # feature pixels: conv_up_i sees 1/2^i of one, conv_hr and conv_last 1/2^n each (2 when n = 0)

    def __init__(self, cfg: RRDBConfig = RRDBConfig()):
        super().__init__()
        self.config = cfg
        f = cfg.num_feat
        self.conv_first = _conv(cfg.in_channels * cfg.unshuffle ** 2, f)
        self.body = nn.Sequential(*[RRDB(f, cfg.num_grow) for _ in range(cfg.num_block)])
        self.conv_body = _conv(f, f)
        for i in range(cfg.upsamples):
            self.add_module(f"conv_up{i + 1}", _conv(f, f))
        self.conv_hr = _conv(f, f)
        self.conv_last = _conv(f, cfg.out_channels)

    @property
    def scale(self) -> int:
        return self.config.scale

    def features(self, x):
        """The trunk, at the input's resolution (divided by ``unshuffle``): (B, in, H, W) -> (B, F, H/u, W/u)."""
        if self.config.unshuffle > 1:
            x = F.pixel_unshuffle(x, self.config.unshuffle)            # (B, in*u^2, H/u, W/u)
        feat = self.conv_first(x)                                       # (B, F, h, w)
        return feat + self.conv_body(self.body(feat))

    def upsample(self, feat):
        """The upsampling tail: (B, F, h, w) -> (B, out, 2^n h, 2^n w). An output pixel sees at most
        :attr:`TAIL_HALO` feature pixels around its own (the tiler runs the tail in blocks with that halo)."""
        for i in range(self.config.upsamples):
            feat = F.interpolate(feat, scale_factor=2, mode="nearest")  # (B, F, 2^(i+1) h, 2^(i+1) w)
            feat = _lrelu(getattr(self, f"conv_up{i + 1}")(feat))
        return self.conv_last(_lrelu(self.conv_hr(feat)))               # (B, out, 2^n h, 2^n w)

    def forward(self, x):
        return self.upsample(self.features(x))


class SRVGGNetCompact(nn.Module):
    """Real-ESRGAN's compact net: (B, in, H, W) -> (B, out, scale*H, scale*W).

    ``body`` alternates convolution and PReLU (one slope per channel): ``body.0`` conv in -> F, ``body.1`` PReLU,
    then ``num_conv`` (conv F -> F, PReLU) pairs, and last ``body.{2 num_conv + 2}`` conv F -> out * scale^2.
    """

    def __init__(self, cfg: SRVGGConfig = SRVGGConfig()):
        super().__init__()
        self.config = cfg
        f = cfg.num_feat
        layers: list[nn.Module] = [_conv(cfg.in_channels, f), nn.PReLU(f)]
        for _ in range(cfg.num_conv):
            layers += [_conv(f, f), nn.PReLU(f)]
        layers.append(_conv(f, cfg.out_channels * cfg.scale ** 2))
        self.body = nn.Sequential(*layers)

    @property
    def scale(self) -> int:
        return self.config.scale

    def forward(self, x):
        out = F.pixel_shuffle(self.body(x), self.config.scale)          # (B, out, sH, sW)
        return out + F.interpolate(x, scale_factor=self.config.scale, mode="nearest")
