"""Qwen-Image's VAE (``AutoencoderKLQwenImage``, Wan 2.1's causal 3D autoencoder) on single frames: images in,
16-channel latents out, and back.

The weights are the 3D network's, under diffusers' names (``encoder.conv_in``, ``encoder.down_blocks.N``,
``encoder.mid_block``, ``quant_conv``, ``post_quant_conv``, ``decoder.up_blocks.N.resnets.M`` ...; every causal
convolution's weight is 5-D (out, in, time, height, width)), so a diffusers folder loads key for key. What runs is the
single-frame network (see :mod:`sdlite.config.qwenimage_vae`): a causal convolution with a temporal kernel of 3 pads
one frame with two zero frames before it, so its output is a 2D convolution by the kernel's last temporal tap (the
other taps meet zeros); the temporal resamplers' ``time_conv`` is not run on a first frame (diffusers' cache marks
it and skips it); the attention and the 2D resamplers work frame by frame anyway. The results equal diffusers' on
one frame up to fp32 rounding (its 3D convolutions sum the zero taps too, in another order).

Images are (B, 3, H, W) in [-1, 1] with H and W multiples of 8; latents (B, 16, H/8, W/8), not normalised
(:meth:`QwenImageVAE.normalize` and :meth:`QwenImageVAE.denormalize` are the pipelines' per-channel statistics).
:meth:`QwenImageVAE.encode_moments` gives the posterior's moments, from which image to image draws its sample.
Shapes are written where they change: B batch, C channels, H/W spatial.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.qwenimage_vae import QwenImageVAEConfig
from ..errors import RequestError

__all__ = ["QwenImageVAE", "CausalConv", "ChannelRMSNorm"]


class CausalConv(nn.Module):
    """A causal 3D convolution's weights (``weight`` (out, in, kt, kh, kw), ``bias``) run on one frame: the 2D
    convolution by the last temporal tap, padded in space as the 3D one is (``(k - 1) / 2``)."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int, int]):
        super().__init__()
        kernel = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        self.weight = nn.Parameter(torch.empty(cout, cin, *kernel))
        self.bias = nn.Parameter(torch.zeros(cout))
        self.padding = (kernel[1] // 2, kernel[2] // 2)
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, H, W) -> (B, out, H, W)."""
        return F.conv2d(x, self.weight[:, :, -1], self.bias, padding=self.padding)


class ChannelRMSNorm(nn.Module):
    """RMS normalisation over the channels: ``F.normalize`` (fp32 for half inputs) times ``sqrt(C)`` times ``gamma``.
    ``gamma`` keeps the checkpoint's shape, (C, 1, 1, 1) in the 3D blocks or (C, 1, 1) in the attention."""

    def __init__(self, dim: int, video: bool = True):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim, *((1, 1, 1) if video else (1, 1))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, H, W)."""
        half = x.dtype in (torch.float16, torch.bfloat16)
        normed = F.normalize(x.float() if half else x, dim=1).to(x.dtype)
        return normed * self.scale * self.gamma.view(-1, 1, 1)


class ResidualBlock(nn.Module):
    """norm, SiLU, 3x3(x3) conv, norm, SiLU, conv; plus the input (through a 1x1 conv when the width changes)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = ChannelRMSNorm(cin)
        self.conv1 = CausalConv(cin, cout, 3)
        self.norm2 = ChannelRMSNorm(cout)
        self.conv2 = CausalConv(cout, cout, 3)
        self.conv_shortcut = CausalConv(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)))
        x = self.conv2(F.silu(self.norm2(x)))
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the positions of a frame: the norm, q/k/v by one 1x1 conv, the output by
    another; plus the input."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = ChannelRMSNorm(dim, video=False)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b, 1, c * 3, h * w).permute(0, 1, 3, 2).contiguous()  # (B, 1, HW, 3C)
        q, k, v = qkv.chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)                                # (B, 1, HW, C)
        out = out.squeeze(1).permute(0, 2, 1).reshape(b, c, h, w)
        return self.proj(out) + x


class MidBlock(nn.Module):
    """A residual block, the attention, a residual block."""

    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class Resample(nn.Module):
    """A 2x spatial resampling: down (pad right and bottom by one, 3x3 conv of stride 2, ``resample.1``) or up
    (nearest-exact 2x in fp32, 3x3 conv to half the channels). The temporal variants' ``time_conv`` weights exist
    (their shapes are the checkpoint's) but a first frame does not use them."""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        self.up = mode.startswith("upsample")
        conv = nn.Conv2d(dim, dim // 2, 3, padding=1) if self.up else nn.Conv2d(dim, dim, 3, stride=2)
        self.resample = nn.Sequential(nn.Identity(), conv)
        if mode == "upsample3d":
            self.time_conv = CausalConv(dim, dim * 2, (3, 1, 1))
        elif mode == "downsample3d":
            self.time_conv = CausalConv(dim, dim, (3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.up:
            x = F.interpolate(x.float(), scale_factor=2.0, mode="nearest-exact").type_as(x)   # (B, C, 2H, 2W)
        else:
            x = F.pad(x, (0, 1, 0, 1))
        return self.resample[1](x)


class Encoder(nn.Module):
    def __init__(self, cfg: QwenImageVAEConfig):
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = CausalConv(cfg.input_channels, dims[0], 3)
        blocks = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(cin, cout))
                cin = cout
            if i != len(cfg.dim_mult) - 1:
                blocks.append(Resample(cout, "downsample3d" if cfg.temperal_downsample[i] else "downsample2d"))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = ChannelRMSNorm(dims[-1])
        self.conv_out = CausalConv(dims[-1], 2 * cfg.z_dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)                                                          # (B, C0, H, W)
        for block in self.down_blocks:
            x = block(x)                                                             # (B, C, H/8, W/8) at the end
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.norm_out(x)))                               # (B, 2 z, H/8, W/8)


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, count: int, mode: str | None):
        super().__init__()
        self.resnets = nn.ModuleList(ResidualBlock(cin if i == 0 else cout, cout) for i in range(count))
        self.upsamplers = nn.ModuleList([Resample(cout, mode)]) if mode is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.upsamplers is None else self.upsamplers[0](x)


class Decoder(nn.Module):
    def __init__(self, cfg: QwenImageVAEConfig):
        super().__init__()
        mult = cfg.dim_mult
        dims = [cfg.base_dim * m for m in (mult[-1], *mult[::-1])]
        upsample_time = cfg.temperal_downsample[::-1]
        self.conv_in = CausalConv(cfg.z_dim, dims[0], 3)
        self.mid_block = MidBlock(dims[0])
        blocks = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                cin //= 2            # the upsampler before halved the channels
            mode = None if i == len(mult) - 1 else ("upsample3d" if upsample_time[i] else "upsample2d")
            blocks.append(UpBlock(cin, cout, cfg.num_res_blocks + 1, mode))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = ChannelRMSNorm(dims[-1])
        self.conv_out = CausalConv(dims[-1], cfg.input_channels, 3)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))                                          # (B, C, h, w)
        for block in self.up_blocks:
            x = block(x)                                                             # (B, C', 8h, 8w) at the end
        return self.conv_out(F.silu(self.norm_out(x)))                               # (B, 3, 8h, 8w)


class QwenImageVAE(nn.Module):
    """``encode(image)`` -> the latent (the posterior's mean), ``decode(latent)`` -> the image in [-1, 1], each one
    frame; :meth:`moments` gives mean and log-variance. Build it from a
    :class:`~sdlite.config.qwenimage_vae.QwenImageVAEConfig`; it runs in its weights' dtype."""

    def __init__(self, cfg: QwenImageVAEConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.quant_conv = CausalConv(2 * cfg.z_dim, 2 * cfg.z_dim, 1)
        self.post_quant_conv = CausalConv(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    def moments(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """image (B, C, H, W) in [-1, 1], H and W multiples of 8 -> (mean, log-variance), each (B, z, H/8, W/8);
        the log-variance clamped to [-30, 20] as diffusers' ``DiagonalGaussianDistribution`` does."""
        cfg, f = self.config, self.config.scale_factor
        if image.ndim != 4 or image.shape[1] != cfg.input_channels or image.shape[2] % f or image.shape[3] % f:
            raise RequestError(f"Qwen-Image VAE image has shape {list(image.shape)}: expected (batch, "
                               f"{cfg.input_channels}, height, width) with height and width multiples of {f}")
        h = self.quant_conv(self.encoder(image.to(self.dtype)))                      # (B, 2 z, H/8, W/8)
        mean, logvar = h.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def encode_moments(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`moments` under the name the engine's image to image and inpainting call on every VAE: the posterior
        of one frame, (mean, log-variance) each (B, z, H/8, W/8), not normalised; a sample is ``mean + exp(logvar /
        2) * noise``, as ``AutoencoderKLQwenImage.encode(x).latent_dist.sample`` draws it (with a frame axis)."""
        return self.moments(image)

    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """image (B, C, H, W) in [-1, 1] -> the posterior's mean (B, z, H/8, W/8), as the edit pipelines take it
        (``sample_mode="argmax"``); not normalised."""
        return self.moments(image)[0]

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, z_dim, h, w), not normalised -> the image (B, C, 8h, 8w), clamped to [-1, 1]."""
        cfg = self.config
        if z.ndim != 4 or z.shape[1] != cfg.z_dim:
            raise RequestError(f"Qwen-Image VAE latent has shape {list(z.shape)}: expected (batch, {cfg.z_dim}, "
                               "height, width)")
        return self.decoder(self.post_quant_conv(z.to(self.dtype))).clamp(-1.0, 1.0)

    def _statistics(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.config.z_dim, 1, 1)
        mean = torch.tensor(self.config.latents_mean).view(shape).to(z.device, z.dtype)
        std = torch.tensor(self.config.latents_std).view(shape).to(z.device, z.dtype)
        return mean, std

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """An encoded latent as the sampler holds it: ``(z - latents_mean) / latents_std`` (the edit pipelines')."""
        mean, std = self._statistics(z)
        return (z - mean) / std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """The sampler's latent as the decoder takes it: ``z / (1 / latents_std) + latents_mean`` (the pipelines')."""
        mean, std = self._statistics(z)
        return z / (1.0 / std) + mean
