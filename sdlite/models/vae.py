"""AutoencoderKL (Rombach et al. 2022): the image <-> latent autoencoder, module names as in diffusers.

The encoder maps (B, 3, H, W) in [-1, 1] to the mean and log-variance of a (B, 4, H/8, W/8) Gaussian;
the decoder maps latents back. Latents are scaled by ``scaling_factor`` (0.18215 for SD 1.x/2.x) before the
UNet sees them; ``encode``/``decode`` here work on unscaled latents, the pipeline applies the factor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VAEConfig
from .layers import Attention, Downsample, ResnetBlock, Upsample, norm_silu, residual


class VAEAttention(Attention):
    """Single-head self-attention over the H*W positions, with its own GroupNorm and a residual."""

    def __init__(self, ch: int, groups: int):
        super().__init__(ch, heads=1, qkv_bias=True)
        self.group_norm = nn.GroupNorm(groups, ch, eps=1e-6)

    def forward(self, x):
        b, c, h, w = x.shape
        tokens = self.group_norm(x).view(b, c, h * w).transpose(1, 2)   # (B, HW, C)
        out = super().forward(tokens).transpose(1, 2).reshape(b, c, h, w)
        return residual(x, out)


class MidBlock(nn.Module):
    def __init__(self, ch: int, groups: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(ch, ch, None, groups, 1e-6), ResnetBlock(ch, ch, None, groups, 1e-6)])
        self.attentions = nn.ModuleList([VAEAttention(ch, groups)])

    def forward(self, x):
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class ResnetStack(nn.Module):
    """ResBlocks at one resolution, then optionally a resampler: ``resample`` is "down", "up" or None."""

    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, resample: str | None):
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(in_ch if i == 0 else out_ch, out_ch, None, groups, 1e-6)
                                     for i in range(layers))
        if resample == "down":
            self.downsamplers = nn.ModuleList([Downsample(out_ch, padding=0)])
        elif resample == "up":
            self.upsamplers = nn.ModuleList([Upsample(out_ch)])

    def forward(self, x):
        for resnet in self.resnets:
            x = resnet(x)
        for resampler in getattr(self, "downsamplers", ()) or getattr(self, "upsamplers", ()):
            x = resampler(x)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        chans, g = cfg.block_channels, cfg.norm_groups
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            ResnetStack(chans[max(i - 1, 0)], chans[i], cfg.layers_per_block, g,
                        "down" if i < len(chans) - 1 else None)
            for i in range(len(chans)))
        self.mid_block = MidBlock(chans[-1], g)
        self.conv_norm_out = nn.GroupNorm(g, chans[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(chans[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x):
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(norm_silu(self.conv_norm_out, x))


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        chans, g = cfg.block_channels, cfg.norm_groups
        rev = list(reversed(chans))
        self.conv_in = nn.Conv2d(cfg.latent_channels, rev[0], 3, padding=1)
        self.mid_block = MidBlock(rev[0], g)
        self.up_blocks = nn.ModuleList(
            ResnetStack(rev[max(i - 1, 0)], rev[i], cfg.layers_per_block + 1, g, "up" if i < len(rev) - 1 else None)
            for i in range(len(rev)))
        self.conv_norm_out = nn.GroupNorm(g, rev[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(rev[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z):
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(norm_silu(self.conv_norm_out, x))


class AutoencoderKL(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        # 1x1 convolutions on the latent's moments and on the latent (absent from SD3's and FLUX's VAEs)
        self.quant_conv = nn.Conv2d(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1) \
            if cfg.use_quant_conv else None
        self.post_quant_conv = nn.Conv2d(cfg.latent_channels, cfg.latent_channels, 1) \
            if cfg.use_post_quant_conv else None

    @property
    def dtype(self) -> torch.dtype:
        # prepacked layers (engine.packing) say so themselves
        layer = self.post_quant_conv if self.post_quant_conv is not None else self.decoder.conv_in
        return getattr(layer, "compute_dtype", None) or layer.weight.dtype

    def quantize(self, moments: torch.Tensor) -> torch.Tensor:
        """The encoder's output -> the latent distribution's moments (through ``quant_conv`` where there is one)."""
        return moments if self.quant_conv is None else self.quant_conv(moments)

    def post_quantize(self, z: torch.Tensor) -> torch.Tensor:
        """An unscaled latent -> the decoder's input (through ``post_quant_conv`` where there is one)."""
        return z if self.post_quant_conv is None else self.post_quant_conv(z)

    def encode_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Image (B, 3, H, W) in [-1, 1] -> (mean, logvar), each (B, 4, H/8, W/8), logvar clamped as in LDM."""
        moments = self.quantize(self.encoder(x))
        mean, logvar = moments.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample a latent (the mean when no generator is given), unscaled."""
        mean, logvar = self.encode_moments(x)
        if generator is None:
            return mean
        noise = torch.randn(mean.shape, generator=generator, device=generator.device, dtype=mean.dtype)
        return mean + torch.exp(0.5 * logvar) * noise.to(mean.device)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latent (B, 4, h, w) -> image (B, 3, 8h, 8w), roughly in [-1, 1]."""
        return self.decoder(self.post_quantize(z))
