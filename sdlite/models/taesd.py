"""TAESD, the tiny autoencoder (madebyollin/taesd): a distilled stand-in for the Stable Diffusion VAE.

1.2 M parameters per half (the SD VAE's decoder: 49.5 M), no GroupNorm, no attention: a 512x512 decode is 71 GMAC
of convolutions against the VAE decoder's 1240 (1/17), at some loss of fine detail. It decodes the latents the UNet
works in as they are (SD's VAE latents times its scaling factor; diffusers' ``AutoencoderTiny`` has scaling factor
1.0), so a sampler's output goes to :meth:`TinyAutoencoder.decode` unchanged. Module names are diffusers'
(``decoder.layers.N...``): every other layout comes in through :mod:`sdlite.weights.convert`.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ..config import TAESDConfig
from ..errors import SDLiteError

TAESD_NAME = "taesd"   # the name of a TAESD whose loader did not give it one


def _conv(n_in: int, n_out: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, stride=stride, padding=1, bias=bias)


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 convolutions on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not under
    ``ONEDNN_MAX_CPU_ISA=AVX2``, where PyTorch's own bf16 convolution runs instead)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _fusable(x: torch.Tensor) -> bool:
    """Whether the convolutions on ``x`` take their ReLU (and a Block's sum) inside oneDNN's convolution: bf16 on a
    CPU where oneDNN runs bf16. The sum and the ReLU are then applied to the float32 result before its one rounding
    to bf16 (unfused: the convolution's output is rounded, then the sum's), and the activations are not read and
    written again for each. Never on the exact (float32) path."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and _onednn_bf16()


def _fused(conv: nn.Conv2d, x: torch.Tensor, relu: bool, add: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(conv(x) [+ add])`` as one oneDNN convolution (see :func:`_fusable`)."""
    args = (conv.weight, conv.bias, list(conv.padding), list(conv.stride), list(conv.dilation), conv.groups)
    unary = "relu" if relu else "none"
    if add is None:
        return torch.ops.mkldnn._convolution_pointwise(x, *args, unary, [None], "")
    return torch.ops.mkldnn._convolution_pointwise(x, add, *args, "add", None, unary, [None], "")


def _run(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``layers(x)``, with each convolution followed by a ReLU fused into it where :func:`_fusable`."""
    if not _fusable(x):
        return layers(x)
    mods = list(layers)
    i = 0
    while i < len(mods):
        m = mods[i]
        if isinstance(m, nn.Conv2d):
            relu = i + 1 < len(mods) and isinstance(mods[i + 1], nn.ReLU)
            x = _fused(m, x, relu)
            i += 2 if relu else 1
        else:
            x = m(x)
            i += 1
    return x


class Block(nn.Module):
    """conv-ReLU-conv-ReLU-conv plus the input, then a ReLU (the skip is the identity: in == out channels)."""

    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Sequential(_conv(ch, ch), nn.ReLU(), _conv(ch, ch), nn.ReLU(), _conv(ch, ch))

    def forward(self, x):
        if _fusable(x):
            c = self.conv
            return _fused(c[4], _fused(c[2], _fused(c[0], x, True), True), True, add=x)
        return torch.relu(self.conv(x) + x)


class TinyEncoder(nn.Module):
    """Image (B, 3, H, W) in [-1, 1] -> latents (B, C, H/8, W/8)."""

    def __init__(self, cfg: TAESDConfig):
        super().__init__()
        chans = cfg.encoder_channels
        layers: list[nn.Module] = []
        for i, blocks in enumerate(cfg.encoder_blocks):
            if i == 0:
                layers.append(_conv(cfg.in_channels, chans[0]))
            else:
                layers.append(_conv(chans[i - 1], chans[i], stride=2, bias=False))     # H/2^i
            layers += [Block(chans[i]) for _ in range(blocks)]
        layers.append(_conv(chans[-1], cfg.latent_channels))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return _run(self.layers, x.add(1).div(2))   # TAESD's images are in [0, 1]


class TinyDecoder(nn.Module):
    """Latents (B, C, h, w) -> image (B, 3, 8h, 8w) in about [-1, 1]."""

    def __init__(self, cfg: TAESDConfig):
        super().__init__()
        chans = cfg.decoder_channels
        layers: list[nn.Module] = [_conv(cfg.latent_channels, chans[0]), nn.ReLU()]
        last = len(cfg.decoder_blocks) - 1
        for i, blocks in enumerate(cfg.decoder_blocks):
            layers += [Block(chans[i]) for _ in range(blocks)]
            if i < last:
                layers += [nn.Upsample(scale_factor=cfg.upsample, mode="nearest"),            # h * upsample^(i+1)
                           _conv(chans[i], chans[i + 1], bias=False)]
        layers.append(_conv(chans[-1], cfg.out_channels))
        self.layers = nn.Sequential(*layers)

    def forward(self, z):
        x = torch.tanh(z / 3) * 3             # a soft clamp of the latents to (-3, 3)
        return _run(self.layers, x).mul(2).sub(1)   # [0, 1] -> [-1, 1]


class TinyAutoencoder(nn.Module):
    """A TAESD: its decoder, its encoder, or both (A1111 keeps the two halves in separate files).

    ``name`` says where it came from (a file or folder name; the loader sets it), for the PNG parameters.
    """

    def __init__(self, cfg: TAESDConfig, encoder: bool = True, decoder: bool = True):
        super().__init__()
        self.config = cfg
        self.encoder = TinyEncoder(cfg) if encoder else None
        self.decoder = TinyDecoder(cfg) if decoder else None
        self.name = TAESD_NAME

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as the UNet works in them (B, C, h, w) -> images (B, 3, 8h, 8w) in about [-1, 1]."""
        if self.decoder is None:
            raise SDLiteError(f"{self.name} has no decoder (only an encoder was loaded)")
        return self.decoder(latents)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] -> latents (B, C, H/8, W/8) as the UNet works in them."""
        if self.encoder is None:
            raise SDLiteError(f"{self.name} has no encoder (only a decoder was loaded)")
        return self.encoder(images)

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> [0, 1] (for storing them as an 8-bit image)."""
        cfg = self.config
        return latents.div(2 * cfg.latent_magnitude).add(cfg.latent_shift).clamp(0, 1)

    def unscale_latents(self, x: torch.Tensor) -> torch.Tensor:
        """[0, 1] -> latents (the inverse of :meth:`scale_latents` inside its range)."""
        cfg = self.config
        return x.sub(cfg.latent_shift).mul(2 * cfg.latent_magnitude)

