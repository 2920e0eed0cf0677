"""The conditional denoising UNet of Stable Diffusion 1.x and 2.x (Rombach et al. 2022, "High-Resolution
Image Synthesis with Latent Diffusion Models"), module names as in the diffusers layout.

Down path: per level ``layers_per_block`` ResBlocks (each optionally followed by a spatial transformer),
then a stride-2 convolution except at the last level. Middle: ResBlock, transformer, ResBlock (or one ResBlock, or
none: the distilled UNets). Up path:
per level ``layers_per_block + 1`` ResBlocks, each fed the concatenation with one saved skip activation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import UNetConfig
from ..kernels import fp32
from ..kernels.bf16 import geglu, geglu_epilogue
from .layers import (Attention, Downsample, ResnetBlock, TimestepEmbedding, Upsample, norm_silu, residual,
                     timestep_embedding)


class GEGLU(nn.Module):
    """Linear to 2x the inner width, then value * GELU(gate) (Shazeer 2020). ``fp32_kernels``: as in
    :class:`~sdlite.models.layers.Attention`."""
    fp32_kernels = False

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner * 2)

    def forward(self, x):
        if type(self.proj) is nn.Linear:   # not a prepacked, quantized or wrapped layer
            fused = geglu(x, self.proj.weight, self.proj.bias)   # bf16 on AVX512-BF16 CPUs: one pass; else None
            if fused is None and self.fp32_kernels:
                fused = fp32.geglu(x, self.proj.weight, self.proj.bias)   # fp32-fast on AVX2 CPUs; else None
            if fused is not None:
                return fused
        elif getattr(self.proj, "split", False):   # int8 (bf16-int8): the halves' products, then one epilogue
            return geglu_epilogue(*self.proj.halves(x), self.proj.bias)
        value, gate = self.proj(x).chunk(2, dim=-1)
        return value * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        # index 1 is the (inference no-op) dropout of the reference layout; keep the indices of the keys
        self.net = nn.ModuleList([GEGLU(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x):
        for layer in self.net:
            x = layer(x)
        return x


class TransformerBlock(nn.Module):
    """Pre-LayerNorm self-attention, cross-attention on the text context, and a GEGLU feed-forward.

    ``cross_only``: the first attention attends to the text context as well, in place of the self-attention (the x4
    upscaler's middle levels)."""

    def __init__(self, dim: int, heads: int, context_dim: int, cross_only: bool = False):
        super().__init__()
        self.cross_only = cross_only
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, context_dim=context_dim if cross_only else None)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, heads, context_dim=context_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x, context):
        x = residual(x, self.attn1(self.norm1(x), context if self.cross_only else None))
        x = residual(x, self.attn2(self.norm2(x), context))
        return residual(x, self.ff(self.norm3(x)))


def _channels_last(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


class SpatialTransformer(nn.Module):
    """GroupNorm, project in, transformer blocks over the H*W tokens, project out, residual.

    SD 1.x projects with 1x1 convolutions before flattening; SD 2.x with Linear layers after flattening.
    """

    def __init__(self, ch: int, heads: int, context_dim: int, depth: int, linear: bool, groups: int,
                 cross_only: bool = False):
        super().__init__()
        self.linear = linear
        self.norm = nn.GroupNorm(groups, ch, eps=1e-6)
        self.proj_in = nn.Linear(ch, ch) if linear else nn.Conv2d(ch, ch, 1)
        self.transformer_blocks = nn.ModuleList(TransformerBlock(ch, heads, context_dim, cross_only)
                                                for _ in range(depth))
        self.proj_out = nn.Linear(ch, ch) if linear else nn.Conv2d(ch, ch, 1)

    def forward(self, x, context):
        b, c, hgt, wid = x.shape
        h = self.norm(x)
        if self.linear:
            h = self.proj_in(h.permute(0, 2, 3, 1).reshape(b, hgt * wid, c))     # (B, HW, C)
        else:
            h = self.proj_in(h).permute(0, 2, 3, 1).reshape(b, hgt * wid, c)     # (B, HW, C)
        for block in self.transformer_blocks:
            h = block(h, context)
        if self.linear:
            h = self.proj_out(h).reshape(b, hgt, wid, c).permute(0, 3, 1, 2)     # (B, C, H, W)
        else:
            # the tokens are already a channels-last image: kept so where the model runs channels-last (no copy;
            # every later layer stays channels-last), made NCHW as diffusers does where it does not
            layout = torch.channels_last if _channels_last(x) else torch.contiguous_format
            h = self.proj_out(h.reshape(b, hgt, wid, c).permute(0, 3, 1, 2).contiguous(memory_format=layout))
        return residual(x, h)


class DownBlock(nn.Module):
    def __init__(self, cfg: UNetConfig, level: int, in_ch: int, out_ch: int, temb_dim: int):
        super().__init__()
        n, g, eps = cfg.layers_per_block, cfg.norm_groups, cfg.norm_eps
        self.resnets = nn.ModuleList(ResnetBlock(in_ch if i == 0 else out_ch, out_ch, temb_dim, g, eps)
                                     for i in range(n))
        if cfg.attention[level]:
            self.attentions = nn.ModuleList(
                SpatialTransformer(out_ch, cfg.heads[level], cfg.context_dim, cfg.depth_at(level, i),
                                   cfg.linear_projection, g, cfg.cross_only_at(level)) for i in range(n))
        if level < len(cfg.block_channels) - 1:
            self.downsamplers = nn.ModuleList([Downsample(out_ch, padding=1)])

    def forward(self, x, temb, context, skips: list, stop: int | None = None):
        """``stop``: return as soon as ``skips`` holds that many activations (a step cache's shallow step)."""
        for i, resnet in enumerate(self.resnets):
            if stop is not None and len(skips) >= stop:
                return x
            x = resnet(x, temb)
            if hasattr(self, "attentions"):
                x = self.attentions[i](x, context)
            skips.append(x)
        if hasattr(self, "downsamplers") and (stop is None or len(skips) < stop):
            x = self.downsamplers[0](x)
            skips.append(x)
        return x


class UpBlock(nn.Module):
    def __init__(self, cfg: UNetConfig, level: int, prev_ch: int, temb_dim: int):
        super().__init__()
        chans, n, g, eps = cfg.block_channels, cfg.layers_per_block, cfg.norm_groups, cfg.norm_eps
        out_ch = chans[level]
        resnets = []
        for i in range(n + 1):
            # the skip of the last resnet comes from the level below (or the stem at level 0)
            skip_ch = chans[max(level - 1, 0)] if i == n else out_ch
            in_ch = prev_ch if i == 0 else out_ch
            resnets.append(ResnetBlock(in_ch + skip_ch, out_ch, temb_dim, g, eps))
        self.resnets = nn.ModuleList(resnets)
        if cfg.attention[level]:
            self.attentions = nn.ModuleList(
                SpatialTransformer(out_ch, cfg.heads[level], cfg.context_dim, cfg.up_depth_at(level, i),
                                   cfg.linear_projection, g, cfg.cross_only_at(level)) for i in range(n + 1))
        if level > 0:
            self.upsamplers = nn.ModuleList([Upsample(out_ch)])

    def forward(self, x, temb, context, skips: list, size=None, layers: range | None = None):
        """``layers``: only these of the block's layers (a step cache's part of the up path); the upsampler runs
        after the last."""
        layers = range(len(self.resnets)) if layers is None else layers
        for i in layers:
            x = self.resnets[i](torch.cat([x, skips.pop()], dim=1), temb)
            if hasattr(self, "attentions"):
                x = self.attentions[i](x, context)
        if hasattr(self, "upsamplers") and layers.stop == len(self.resnets):
            x = self.upsamplers[0](x, size)
        return x


class MidBlock(nn.Module):
    """``cfg.mid_block``: "cross_attn" (resnet, transformer, resnet), "resnet" (one resnet: SSD-1B, Vega) or None
    (nothing: BK-SDM Small/Tiny, SDXS; the block has no weights and passes its input on)."""

    def __init__(self, cfg: UNetConfig, temb_dim: int):
        super().__init__()
        ch, g, eps = cfg.block_channels[-1], cfg.norm_groups, cfg.norm_eps
        if cfg.mid_block is None:
            return
        count = 2 if cfg.mid_block == "cross_attn" else 1
        self.resnets = nn.ModuleList(ResnetBlock(ch, ch, temb_dim, g, eps) for _ in range(count))
        if cfg.mid_block == "cross_attn":
            self.attentions = nn.ModuleList([SpatialTransformer(ch, cfg.heads[-1], cfg.context_dim,
                                                                cfg.depth_at(-1), cfg.linear_projection, g)])

    def forward(self, x, temb, context):
        if not hasattr(self, "resnets"):
            return x
        x = self.resnets[0](x, temb)
        if hasattr(self, "attentions"):
            x = self.attentions[0](x, context)
            x = self.resnets[1](x, temb)
        return x


class TimeConditioned(nn.Module):
    """What the UNet and a ControlNet share before their first convolution: the time embedding of the timestep,
    plus a class-conditioned network's class embedding, plus SDXL's added conditioning. ``self.config`` is the
    :class:`UNetConfig` they are built from; ``time_embedding`` (and ``class_embedding``, ``add_embedding``) are
    their own modules."""

    config: UNetConfig

    def _build_embeddings(self, cfg: UNetConfig) -> None:
        temb_dim = cfg.time_embed_dim
        self.time_embedding = TimestepEmbedding(cfg.block_channels[0], temb_dim)
        if cfg.addition_embed == "text_time":
            self.add_embedding = TimestepEmbedding(cfg.add_embed_in, temb_dim)
        if cfg.num_class_embeds:
            self.class_embedding = nn.Embedding(cfg.num_class_embeds, temb_dim)

    def embed(self, x: torch.Tensor, t: torch.Tensor, text_embeds=None, time_ids=None,
              class_labels=None) -> torch.Tensor:
        """(B, 4*C0): the vector every ResBlock adds (through its own projection) for timesteps ``t``."""
        cfg = self.config
        t = t.reshape(-1).to(x.device)
        if t.numel() == 1:
            t = t.expand(x.shape[0])
        temb = timestep_embedding(t, cfg.block_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)
        temb = self.time_embedding(temb.to(x.dtype))                       # (B, 4*C0)
        if cfg.num_class_embeds or class_labels is not None:
            temb = temb + self._class_embedding(class_labels, x)
        if cfg.addition_embed == "text_time":
            temb = temb + self._added_embedding(text_embeds, time_ids, x.shape[0], x.dtype)
        return temb

    def _class_embedding(self, labels, x: torch.Tensor) -> torch.Tensor:
        n = self.config.num_class_embeds
        if not n:
            raise ValueError("class_labels were given, but this UNet has no class embedding (num_class_embeds)")
        if labels is None:
            raise ValueError(f"this UNet is class-conditioned ({n} class embeddings; the x4 upscaler: the noise "
                             "level of its low-resolution input): pass class_labels")
        batch = x.shape[0]
        labels = torch.as_tensor(labels).reshape(-1).to(x.device, torch.long)
        if labels.numel() == 1 and batch > 1:
            labels = labels.expand(batch)
        if labels.numel() != batch or not bool(((labels >= 0) & (labels < n)).all()):
            raise ValueError(f"class_labels {labels.tolist()}: expected {batch} integers from 0 to {n - 1}")
        return self.class_embedding(labels).to(x.dtype)                     # (B, 4*C0)

    def _added_embedding(self, text_embeds, time_ids, batch: int, dtype) -> torch.Tensor:
        cfg = self.config
        if text_embeds is None or time_ids is None:
            raise ValueError("this UNet (SDXL) is conditioned on the pooled text embedding and the size/crop ids: "
                             "pass text_embeds and time_ids")
        n_ids = (cfg.add_embed_in - text_embeds.shape[-1]) // cfg.addition_time_embed_dim
        if time_ids.shape[-1] != n_ids or text_embeds.shape[-1] + n_ids * cfg.addition_time_embed_dim != cfg.add_embed_in:
            raise ValueError(f"SDXL added conditioning: {text_embeds.shape[-1]} pooled values and "
                             f"{time_ids.shape[-1]} ids of {cfg.addition_time_embed_dim} do not make the "
                             f"{cfg.add_embed_in} inputs this UNet expects")
        ids = timestep_embedding(time_ids.reshape(-1).to(text_embeds.device), cfg.addition_time_embed_dim,
                                 cfg.flip_sin_to_cos, cfg.freq_shift)           # (B * n_ids, D), as diffusers
        ids = ids.reshape(time_ids.shape[0], -1)
        added = torch.cat([text_embeds.float(), ids], dim=-1).to(dtype)
        if added.shape[0] == 1 and batch > 1:
            added = added.expand(batch, -1)
        return self.add_embedding(added)


class UNet(TimeConditioned):
    """eps (or v) prediction: (B, Cin, h, w) latent, (B,) timesteps, (B, 77, Cctx) context -> (B, Cout, h, w).

    SDXL (``addition_embed="text_time"``) also takes ``text_embeds`` (B, pooled width), the pooled text
    embedding, and ``time_ids`` (B, 6 or 5), the size/crop ids (original size, crop top-left, target size; the
    refiner has an aesthetic score instead of the target size): each id is embedded sinusoidally, the pooled text
    is appended, and an MLP (``add_embedding``) maps them to a vector added to the time embedding.

    A class-conditioned UNet (``num_class_embeds``: the x4 upscaler, whose class is the noise level of its
    low-resolution input) takes ``class_labels`` (B,) integers: the row of ``class_embedding`` each selects is added
    to the time embedding.
    """

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.config = cfg
        chans, temb_dim = cfg.block_channels, cfg.time_embed_dim
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1)
        self._build_embeddings(cfg)
        self.down_blocks = nn.ModuleList(
            DownBlock(cfg, i, chans[max(i - 1, 0)], chans[i], temb_dim) for i in range(len(chans)))
        self.mid_block = MidBlock(cfg, temb_dim)
        ups, prev = [], chans[-1]
        for level in reversed(range(len(chans))):
            ups.append(UpBlock(cfg, level, prev, temb_dim))
            prev = chans[level]
        self.up_blocks = nn.ModuleList(ups)
        self.conv_norm_out = nn.GroupNorm(cfg.norm_groups, chans[0], eps=cfg.norm_eps)
        self.conv_out = nn.Conv2d(chans[0], cfg.out_channels, 3, padding=1)

    @property
    def dtype(self) -> torch.dtype:
        layer = self.conv_in  # prepacked layers (engine.packing) say so themselves
        return getattr(layer, "compute_dtype", None) or layer.weight.dtype

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                text_embeds: torch.Tensor | None = None, time_ids: torch.Tensor | None = None,
                class_labels: torch.Tensor | None = None, control: tuple | None = None,
                cache=None) -> torch.Tensor:
        """``control``: ``(down, mid)``, residuals to add (a ControlNet's, :mod:`sdlite.models.controlnet`): ``down[i]``
        to the i-th skip activation of the down path (the stem's first), ``mid`` to the middle block's output.

        ``cache``: a step cache's branch (DeepCache, :mod:`sdlite.engine.stepcache`): ``cache.skips`` = k, the skip
        connections every step computes afresh. With ``cache.feature`` None (a full step) the whole network runs and
        ``cache.keep`` is handed the up path's activation where it takes in skip k-1; else (a cached step) only the
        down layers that make skips 0..k-1 and the up layers from that point run, starting from ``cache.feature``."""
        context = context.to(x.dtype)  # the text encoders may compute in another precision (fp32 under bf16)
        temb = self.embed(x, t, text_embeds, time_ids, class_labels)      # (B, 4*C0)
        shallow = cache is not None and cache.feature is not None
        stop = cache.skips if shallow else None

        x = self.conv_in(x)                                                # (B, C0, h, w)
        skips = [x]
        sizes = []
        for block in self.down_blocks:
            if stop is not None and len(skips) >= stop:
                break
            sizes.append(x.shape[-2:])
            x = block(x, temb, context, skips, stop)
        if not shallow:
            x = self.mid_block(x, temb, context)
        if control is not None:
            down, mid = control
            total = sum(len(b.resnets) for b in self.up_blocks)
            if len(down) != total:
                raise ValueError(f"control: {len(down)} down-path residuals for a UNet with {total} skips")
            skips = [s + r.to(s.dtype) for s, r in zip(skips, down)]
            if not shallow:
                x = x + mid.to(x.dtype)
        return self._up(x, temb, context, skips, sizes, cache, shallow)

    def _up(self, x, temb, context, skips: list, sizes: list, cache, shallow: bool) -> torch.Tensor:
        """The up path and the output layers; with a step cache (see :meth:`forward`) from or past its branch."""
        # up layer j takes skip (n - 1 - j): the branch point of skip k-1 is up layer n - k
        n = sum(len(b.resnets) for b in self.up_blocks)
        branch = None if cache is None else n - cache.skips
        first = branch if shallow else 0
        if shallow:
            x = cache.feature
        j = 0   # the first up layer of the block
        for i, block in enumerate(self.up_blocks):
            count, level = len(block.resnets), len(self.up_blocks) - 1 - i
            lo = max(first - j, 0)
            if lo < count:
                # upsample to the size the matching down level had, so odd latent sizes round-trip
                size = sizes[level - 1] if level > 0 else None
                if branch is not None and not shallow and j <= branch < j + count:   # a full step keeps the feature
                    x = block(x, temb, context, skips, size, range(lo, branch - j))
                    cache.keep(x)
                    lo = branch - j
                x = block(x, temb, context, skips, size, range(lo, count))
            j += count
        return self.conv_out(norm_silu(self.conv_norm_out, x))
