"""ControlNet (Zhang, Rao & Agrawala 2023, "Adding Conditional Control to Text-to-Image Diffusion Models"): a copy of
the UNet's encoder and middle block that also sees a control image (edges, a pose, a depth map ...), and hands the
UNet one residual per skip activation and one for the middle block.

It is built from the UNet's own blocks (:mod:`sdlite.models.unet`), so SD 1.x, SD 2.x and SDXL (with its added
conditioning) come from the config alone. Module names are the diffusers layout's (``controlnet_cond_embedding``,
``controlnet_down_blocks.N``, ``controlnet_mid_block``); :mod:`sdlite.weights.controlnet` brings the original
layout's (``input_hint_block``, ``zero_convs``, ``middle_block_out``) to them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ControlNetConfig
from .unet import DownBlock, MidBlock, TimeConditioned


class HintEncoder(nn.Module):
    """Control image (B, hint_channels, H, W) -> features (B, C0, H/8, W/8): convolutions with SiLU, three of them
    stride 2, and a last (zero-initialised in training) convolution to the UNet's first width."""

    def __init__(self, cfg: ControlNetConfig):
        super().__init__()
        widths = cfg.hint_widths
        self.conv_in = nn.Conv2d(cfg.hint_channels, widths[0], 3, padding=1)
        blocks = []
        for a, b in zip(widths[:-1], widths[1:]):
            blocks += [nn.Conv2d(a, a, 3, padding=1), nn.Conv2d(a, b, 3, padding=1, stride=2)]
        self.blocks = nn.ModuleList(blocks)
        self.conv_out = nn.Conv2d(widths[-1], cfg.unet.block_channels[0], 3, padding=1)

    def forward(self, hint: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.conv_in(hint))
        for conv in self.blocks:
            x = F.silu(conv(x))
        return self.conv_out(x)


class ControlNet(TimeConditioned):
    """``(x, t, context, hint, scales) -> (down, mid)``: the residuals for the UNet's ``control`` argument.

    ``x`` (B, Cin, h, w) is the UNet's (scaled) latent input, ``t`` its timesteps, ``context`` the text context and
    (SDXL) ``text_embeds`` / ``time_ids`` as the UNet takes them; ``hint`` (B, hint_channels, 8h, 8w) the control
    image in [0, 1]. ``scales``: one number for every residual, or one per residual (``config.residuals`` of them,
    the middle block's last): each residual is multiplied by its scale.
    """

    def __init__(self, cfg: ControlNetConfig):
        super().__init__()
        self.control_config = cfg
        self.config = ucfg = cfg.unet
        chans, temb_dim = ucfg.block_channels, ucfg.time_embed_dim
        self.conv_in = nn.Conv2d(ucfg.in_channels, chans[0], 3, padding=1)
        self._build_embeddings(ucfg)
        self.controlnet_cond_embedding = HintEncoder(cfg)
        self.down_blocks = nn.ModuleList(
            DownBlock(ucfg, i, chans[max(i - 1, 0)], chans[i], temb_dim) for i in range(len(chans)))
        self.mid_block = MidBlock(ucfg, temb_dim)
        # one 1x1 convolution per skip activation, in the order the down path makes them
        skip_widths = [chans[0]]
        for level, ch in enumerate(chans):
            skip_widths += [ch] * ucfg.layers_per_block
            if level < len(chans) - 1:
                skip_widths.append(ch)
        self.controlnet_down_blocks = nn.ModuleList(nn.Conv2d(c, c, 1) for c in skip_widths)
        self.controlnet_mid_block = nn.Conv2d(chans[-1], chans[-1], 1)

    @property
    def dtype(self) -> torch.dtype:
        layer = self.conv_in  # prepacked layers (engine.packing) say so themselves
        return getattr(layer, "compute_dtype", None) or layer.weight.dtype

    def encode_hint(self, hint: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(B, hint_channels, H, W) control image -> (B, C0, H/8, W/8): what the hint encoder adds to the first
        features. It depends on the image alone, so a sampling run computes it once (``forward``'s ``hint``)."""
        hint = hint.to(dtype=dtype or self.dtype)
        if self.control_config.bgr:
            hint = hint.flip(1)
        return self.controlnet_cond_embedding(hint)

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, hint: torch.Tensor,
                scales: float | list[float] = 1.0, text_embeds: torch.Tensor | None = None,
                time_ids: torch.Tensor | None = None, class_labels: torch.Tensor | None = None,
                encoded: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``encoded``: ``hint`` is already :meth:`encode_hint`'s output (B, C0, h, w)."""
        cfg = self.control_config
        n = cfg.residuals
        scales = [float(scales)] * n if isinstance(scales, (int, float)) else [float(s) for s in scales]
        if len(scales) != n:
            raise ValueError(f"ControlNet scales: {len(scales)} given, this ControlNet gives {n} residuals")
        context = context.to(x.dtype)
        factor = 1 if encoded else cfg.hint_downscale
        if hint.shape[-2:] != tuple(s * factor for s in x.shape[-2:]):
            raise ValueError(f"control image {tuple(hint.shape[-2:])} px for a {tuple(x.shape[-2:])} latent: "
                             f"expected {cfg.hint_downscale}x the latent's size")
        if not encoded:
            hint = self.encode_hint(hint.to(x.device), x.dtype)
        temb = self.embed(x, t, text_embeds, time_ids, class_labels)         # (B, 4*C0)
        h = self.conv_in(x) + hint.to(x.dtype)                               # (B, C0, h, w)
        skips = [h]
        for block in self.down_blocks:
            h = block(h, temb, context, skips)
        h = self.mid_block(h, temb, context)
        down = [conv(s) * scale for conv, s, scale in zip(self.controlnet_down_blocks, skips, scales)]
        mid = self.controlnet_mid_block(h) * scales[-1]
        if cfg.global_pool:
            down = [d.mean(dim=(2, 3), keepdim=True) for d in down]
            mid = mid.mean(dim=(2, 3), keepdim=True)
        return down, mid
