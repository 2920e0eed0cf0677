"""Building blocks shared by the networks: the UNet's and the VAE's, the transformers' (timestep embeddings, RMSNorm,
per-sample values, ComfyUI's padding of a latent to whole patches, the rotary embedding of channel pairs) and the text
encoders' (RMSNorm).

Module attribute names equal the canonical (diffusers) checkpoint key names, so that loading is a
key-for-key copy. Shapes are written as comments where they change: B batch, C channels, H/W spatial,
N tokens, D head dim.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import RequestError
from ..kernels import fp32
from ..kernels.bf16 import attend, attention_pays, rms_scale, rope


def norm_silu(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``silu(norm(x))``; when no gradient is being recorded the SiLU runs in place on the norm's output, so the
    pair needs one activation-sized buffer instead of two."""
    return F.silu(norm(x), inplace=not torch.is_grad_enabled())


def residual(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """``x + branch``, where ``branch`` is a fresh tensor of ``x``'s shape that nothing else holds: when no
    gradient is being recorded the sum is written into it (one activation-sized buffer less; same values)."""
    return x + branch if torch.is_grad_enabled() else branch.add_(x)


def run_blocks(first, rest, state: tuple, cache=None) -> tuple:
    """A transformer's block stack as its step cache sees it: ``first(state)`` runs the first block and ``rest`` the
    ones after it (and whatever joins or splits the streams between them); a state is a tuple of the streams'
    tokens. With no ``cache`` this is ``rest(first(state))``, the plain forward. A ``cache`` (the network's
    ``forward(..., cache=)``, :mod:`sdlite.engine.blockcache`) is called as ``cache(first, rest, state)`` and may
    skip ``rest``."""
    if cache is None:
        return rest(first(state))
    return cache(first, rest, state)


def pad_to_patches(x: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """x (B, C, h, w) with h or w not a multiple of ``patch`` made one by wrapping around: the first rows (columns)
    repeated after the last. ComfyUI's ``pad_to_patch_size`` (circular padding at the bottom and the right), which its
    DiTs (FLUX.1 and Kontext's references, Z-Image, Qwen-Image) apply to every latent before cutting it into patches,
    cropping the output back; a ComfyUI latent of a side that is a multiple of 8 pixels but not of 16 has an odd side.
    x itself when both sides are whole patches."""
    rows, cols = -x.shape[-2] % patch, -x.shape[-1] % patch
    return F.pad(x, (0, cols, 0, rows), mode="circular") if rows or cols else x


def timestep_embedding(t: torch.Tensor, dim: int, flip_sin_to_cos: bool = True, shift: float = 0.0,
                       max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (possibly fractional) timesteps, (B,) -> (B, dim), computed in fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
                      / (half - shift))
    args = t.float()[:, None] * freqs[None]                       # (B, half)
    sin, cos = torch.sin(args), torch.cos(args)
    emb = torch.cat([cos, sin] if flip_sin_to_cos else [sin, cos], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def per_sample(value, b: int, device, what: str) -> torch.Tensor:
    """``value`` (a number, or a tensor of one value or of ``b``) as one value per sample, (b,); a number becomes
    float32, a tensor keeps its dtype. Another shape is a :class:`~sdlite.errors.RequestError` naming ``what``
    (``"FLUX guidance"``)."""
    value = torch.as_tensor(value, device=device, dtype=torch.float32 if not torch.is_tensor(value) else None)
    if value.ndim == 0:
        value = value.expand(b)
    if tuple(value.shape) != (b,):
        raise RequestError(f"{what} have shape {list(value.shape)}: expected ({b},) or a single value")
    return value


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding on x (B, S, h, D) of FLUX.1 and the transformers after it: each channel pair (x0, x1) ->
    (x0 cos - x1 sin, x1 cos + x0 sin), with ``cos`` and ``sin`` (S, D) or (B, S, D) float32 repeating each pair's
    value twice; computed in fp32 as ``x * cos + (-x1, x0) * sin`` and returned in x's dtype. bf16 runs sdlite's kernel
    (one pass, the same arithmetic and so the same bits) where it applies."""
    out = rope(x, cos, sin)
    if out is not None:
        return out
    x0, x1 = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    turned = torch.stack([-x1, x0], dim=-1).flatten(3)
    cos, sin = (t[None, :, None] if t.dim() == 2 else t[:, :, None] for t in (cos, sin))
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


def rotate_joined(parts: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotate_pairs` of the sequence that ``parts`` (B, S_i, h, D) make joined along S (cos and sin cover the
    whole of it). bf16 on sdlite's kernel writes each part's rotation straight into its slice of the joined tensor;
    elsewhere the parts are joined, then rotated."""
    first = parts[0]
    if first.dtype is torch.bfloat16 and first.device.type == "cpu":
        b, _, h, d = first.shape
        out = torch.empty(b, sum(p.shape[1] for p in parts), h, d, dtype=first.dtype)
        at = 0
        for part in parts:
            n = part.shape[1]
            if rope(part, cos[..., at:at + n, :], sin[..., at:at + n, :], out[:, at:at + n]) is None:
                break
            at += n
        else:
            return out
    return rotate_pairs(torch.cat(parts, dim=1), cos, sin)


def pair_tables(factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Complex rotary factors (..., S, D/2) as :func:`rotate_pairs`' tables: their real and imaginary parts, each
    repeated for the two channels of its pair, (..., S, D) float32."""
    return (factors.real.repeat_interleave(2, dim=-1).contiguous(),
            factors.imag.repeat_interleave(2, dim=-1).contiguous())


class RMSNorm(nn.Module):
    """RMS normalisation with a learned scale, no mean and no bias: the mean square in fp32, a half-precision scale
    applied in its own dtype (diffusers' RMSNorm and transformers' T5LayerNorm, op for op): SD3's qk norms, Z-Image's
    norms and T5's layer norms. In bf16 the scaling after the mean square runs on sdlite's kernel where it applies
    (:func:`sdlite.kernels.bf16.rms_scale`: one pass for three, the same bits)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)      # (..., 1)
        factor = torch.rsqrt(variance + self.eps)
        if x.dtype is torch.bfloat16:   # bf16: the rest in one pass on sdlite's kernel, the same roundings
            out = rms_scale(x, factor, self.weight)
            if out is not None:
                return out
        x = x * factor                                                    # fp32 (promoted)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


class TimestepEmbedding(nn.Module):
    """Linear -> SiLU -> Linear on the sinusoidal embedding."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_2(F.silu(self.linear_1(x)))


class Attention(nn.Module):
    """Multi-head attention over token sequences (B, N, C); ``context`` (B, M, Cc) makes it cross-attention.

    ``qkv_bias`` is False in the UNet's transformers and True in the VAE's single-head mid-block attention.

    ``slice_tokens`` (None: off) bounds the attention-score memory: the queries are processed in slices of at
    most that many tokens, one (batch, head) at a time, so no more than ``slice_tokens x M`` scores exist at
    once. Each query row's result does not depend on the other rows, so slicing changes only fp rounding. Set it
    on a whole model with :func:`sdlite.engine.attention.set_attention_slicing`.

    ``fp32_kernels`` (the ``fp32-fast`` precision; :func:`sdlite.kernels.fp32.use_fp32_kernels`) runs fp32 attention
    on sdlite's AVX2 kernel instead of PyTorch's, which the ``exact`` path keeps.
    """
    fp32_kernels = False

    def __init__(self, dim: int, heads: int, context_dim: int | None = None, qkv_bias: bool = False):
        super().__init__()
        self.heads = heads
        self.slice_tokens: int | None = None
        context_dim = context_dim or dim
        self.to_q = nn.Linear(dim, dim, bias=qkv_bias)
        self.to_k = nn.Linear(context_dim, dim, bias=qkv_bias)
        self.to_v = nn.Linear(context_dim, dim, bias=qkv_bias)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        b, n, c = x.shape
        h = self.heads
        q = self.to_q(x).view(b, n, h, c // h).transpose(1, 2)          # (B, h, N, D)
        k = self.to_k(context).view(b, -1, h, c // h).transpose(1, 2)   # (B, h, M, D)
        v = self.to_v(context).view(b, -1, h, c // h).transpose(1, 2)   # (B, h, M, D)
        s = self.slice_tokens
        if s is None or (n <= s and b * h == 1):
            # bf16 on AVX512-BF16 where the kernel beats PyTorch's here: (B, N, C), else None
            out = attend(q, k, v) if q.dtype is torch.bfloat16 and attention_pays() else None
            if out is None and self.fp32_kernels:
                out = fp32.attend(q, k, v)                              # fp32-fast on AVX2: (B, N, C), else None
            if out is None:
                out = F.scaled_dot_product_attention(q, k, v)          # (B, h, N, D)
                out = out.transpose(1, 2).reshape(b, n, c)              # (B, N, C)
        else:
            out = q.new_empty(b, n, h, c // h)                          # (B, N, h, D), written slice by slice
            for i in range(b):
                for j in range(h):
                    for t in range(0, n, s):
                        qs = q[i:i + 1, j:j + 1, t:t + s]               # (1, 1, <=s, D)
                        out[i:i + 1, t:t + s, j:j + 1] = F.scaled_dot_product_attention(
                            qs, k[i:i + 1, j:j + 1], v[i:i + 1, j:j + 1]).transpose(1, 2)
            out = out.view(b, n, c)                                     # (B, N, C)
        return self.to_out[0](out)


class ResnetBlock(nn.Module):
    """GroupNorm -> SiLU -> conv, (+ time embedding), GroupNorm -> SiLU -> conv, plus the (1x1) shortcut."""

    def __init__(self, in_ch: int, out_ch: int, temb_dim: int | None, groups: int = 32, eps: float = 1e-5):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch, eps=eps)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        if temb_dim is not None:
            self.time_emb_proj = nn.Linear(temb_dim, out_ch)
        self.norm2 = nn.GroupNorm(groups, out_ch, eps=eps)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        if in_ch != out_ch:
            self.conv_shortcut = nn.Conv2d(in_ch, out_ch, 1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        h = self.conv1(norm_silu(self.norm1, x))
        if temb is not None:
            h = residual(self.time_emb_proj(F.silu(temb))[:, :, None, None], h)
        h = self.conv2(norm_silu(self.norm2, h))
        if hasattr(self, "conv_shortcut"):
            x = self.conv_shortcut(x)
        return residual(x, h)


class Downsample(nn.Module):
    """3x3 stride-2 convolution. The VAE pads asymmetrically (right/bottom) by hand, the UNet by 1 all round."""

    def __init__(self, ch: int, padding: int = 1):
        super().__init__()
        self.padding = padding
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=padding)

    def forward(self, x):
        if self.padding == 0:
            x = F.pad(x, (0, 1, 0, 1))
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest-neighbour 2x (or to ``size``) followed by a 3x3 convolution."""

    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x, size: tuple[int, int] | None = None):
        dtype = x.dtype
        if dtype == torch.bfloat16 and x.device.type != "cpu":   # slow or missing on some GPU backends; on the CPU
            x = x.float()                                           # bf16 is 3-4x faster and copies the same values
        if size is None:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        else:
            x = F.interpolate(x, size=size, mode="nearest")
        return self.conv(x.to(dtype))
