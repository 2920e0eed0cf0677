"""Qwen2.5-VL's vision tower: an image's patches in, one token per merged unit out, as wide as the language model.

Module names are transformers' (``Qwen2_5_VisionTransformerPretrainedModel``): ``patch_embed.proj``,
``blocks.{i}.norm1``, ``blocks.{i}.attn.qkv``, ``blocks.{i}.attn.proj``, ``blocks.{i}.norm2``,
``blocks.{i}.mlp.{gate,up,down}_proj``, ``merger.ln_q``, ``merger.mlp.0``, ``merger.mlp.2``; so a checkpoint's
``visual.*`` tensors load key for key once the prefix is gone (:mod:`sdlite.weights.qwen_vision_keys`).

The input is what the image processor makes (:func:`sdlite.tokenizers.qwen_images.vision_patches`):
``pixel_values`` (N, C * T * P * P), each image's patches in *merge-block order* (the 2 x 2 patches of a merged unit
next to each other, the units row by row), and ``grid_thw`` (k, 3): each image's frames, patch rows and patch
columns. Per image, in the order of the network (``config`` is :class:`sdlite.config.qwen_vision.QwenVisionConfig`):

1. **Patch embedding**: each row viewed as (C, T, P, P) through a Conv3d whose kernel is the whole patch.
2. **Window order**: the merged units are regrouped window by window (windows of ``window_units`` x
   ``window_units`` units, row-major over the image, units row-major inside a window; the last row and column of
   windows are cut short where the grid does not fill them), each unit's patches staying together. Every block runs
   on this order; attention that is windowed sees each window as one contiguous segment.
3. **2-D rotary embedding**: a patch at row ``r`` and column ``c`` rotates the first half of each head's rotated
   pairs by ``r * f`` and the second by ``c * f``, ``f = theta ** (-4i / head_dim)`` for ``i < head_dim / 4``, in the
   "rotate half" layout; computed in float32 and applied to q and k in float32, then cast back.
4. **Blocks**: ``x += attn(norm1(x)); x += mlp(norm2(x))`` (RMSNorm; SwiGLU with biases). Attention runs within each
   window, except in the blocks of ``fullatt_block_indexes``, which attend within each frame of each image.
5. **Patch merger**: RMSNorm, each unit's ``merge ** 2`` patches concatenated, Linear, GELU, Linear.
6. The tokens are put back from window order into merge-block order.

It runs in the dtype of its weights (the pixels are cast to it, the rotary products are float32). In float32 the
output is bit-identical to transformers' with ``attn_implementation="sdpa"``: the same ops in the same order. Where
transformers loops (positions and windows per image, attention per segment), this module works on whole tensors:
segments of equal length run as one batched SDPA call, which computes each (segment, head) exactly as a call of its
own does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.qwen_vision import QwenVisionConfig
from .qwen import QwenRMSNorm, QwenTextEncoder, rotate_half

__all__ = ["QwenVisionTower", "QwenVLEncoder", "VisionLayout", "vision_layout", "vision_rotary", "apply_vision_rotary",
           "segment_attention"]


class VisionLayout:
    """What the grids say about a batch of images, computed once per forward: ``positions`` (N, 2) each patch's
    (row, column) in the processor's order; ``window_index`` (N / merge_unit,) the merged units in window order;
    ``cu_windows`` and ``cu_frames`` the cumulative segment bounds (int32) of the windows and of the frames in window
    order."""

    __slots__ = ("positions", "window_index", "cu_windows", "cu_frames")

    def __init__(self, positions, window_index, cu_windows, cu_frames):
        self.positions, self.window_index = positions, window_index
        self.cu_windows, self.cu_frames = cu_windows, cu_frames


def _check_grid(grid_thw: torch.Tensor, merge: int) -> list[tuple[int, int, int]]:
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        shape = tuple(grid_thw.shape) if isinstance(grid_thw, torch.Tensor) else type(grid_thw).__name__
        raise ValueError(f"Qwen vision tower: grid_thw must be a (images, 3) tensor of frames, rows and columns, "
                         f"got {shape}")
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"Qwen vision tower: image {i} has the grid (t={t}, h={h}, w={w}); each must be "
                             f"positive and h, w multiples of the merge size {merge}")
    return grids


def vision_layout(grid_thw: torch.Tensor, merge: int, window_units: int,
                  device: torch.device | str | None = None) -> VisionLayout:
    """The positions, window order and segment bounds of the images of ``grid_thw`` (see :class:`VisionLayout`)."""
    grids = _check_grid(grid_thw, merge)
    positions, window_index, windows, frames = [], [], [], []
    offset = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        # each patch's (row, column) in merge-block order: unit row, unit column, row in unit, column in unit
        rows = torch.arange(h).view(gh, merge, 1, 1).expand(gh, merge, gw, merge).permute(0, 2, 1, 3)
        cols = torch.arange(w).view(1, 1, gw, merge).expand(gh, merge, gw, merge).permute(0, 2, 1, 3)
        positions.append(torch.stack((rows.flatten(), cols.flatten()), dim=-1).repeat(t, 1))   # (t*h*w, 2)
        # the units sorted by (frame, window row, window column, row in window, column in window)
        ti = torch.arange(t).view(t, 1, 1)
        ui = torch.arange(gh).view(1, gh, 1)
        uj = torch.arange(gw).view(1, 1, gw)
        wh, ww = -(-gh // window_units), -(-gw // window_units)
        window = (ti * wh + ui // window_units) * ww + uj // window_units                     # (t, gh, gw)
        inside = (ui % window_units) * window_units + uj % window_units
        key = (window * window_units * window_units + inside).flatten()
        window_index.append(torch.argsort(key) + offset)
        counts = torch.bincount(window.flatten(), minlength=t * wh * ww)
        windows.append(counts[counts > 0] * merge * merge)
        frames.append(torch.full((t,), h * w, dtype=torch.long))
        offset += t * gh * gw

    def bounds(lengths):
        return F.pad(torch.cat(lengths).cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)

    return VisionLayout(torch.cat(positions).to(device), torch.cat(window_index).to(device), bounds(windows),
                        bounds(frames))


def vision_rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each (N, head_dim) float32, of patches at ``positions`` (N, 2) (row, column): the angles
    ``row * f`` and ``column * f`` side by side, the pair repeated (rotate-half layout)."""
    quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float, device=positions.device)
    inv_freq = 1.0 / (theta ** (quarter / (head_dim // 2)))                  # (D/4,)
    angles = positions[..., None].float() * inv_freq                          # (N, 2, D/4)
    cos, sin = angles.cos(), angles.sin()

    def layout(a):
        a = torch.cat((a[:, 0], a[:, 1]), dim=-1)                            # (N, D/2)
        return torch.cat((a, a), dim=-1)                                     # (N, D)

    return layout(cos), layout(sin)


def apply_vision_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``q`` and ``k`` (N, heads, D) with tables (N, D), in float32, the results cast back."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()          # (N, 1, D)
    qf, kf = q.float(), k.float()
    q_out = qf * cos + rotate_half(qf) * sin
    k_out = kf * cos + rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Attention of ``q``, ``k``, ``v`` (heads, N, D) within the segments bounded by ``cu`` (S + 1,), as an (N, heads,
    D) tensor. Segments of the same length run as one batched SDPA call."""
    heads, n, d = q.shape
    bounds = cu.tolist()
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    lengths = torch.tensor(bounds[1:], dtype=torch.long) - starts
    out = q.new_empty(n, heads, d)
    for length in torch.unique(lengths).tolist():
        if length == 0:
            continue
        first = starts[lengths == length]                                     # (S_L,)
        if first.numel() == 1:
            s = int(first)
            sl = slice(s, s + length)
            o = F.scaled_dot_product_attention(q[None, :, sl], k[None, :, sl], v[None, :, sl], scale=scale)
            out[sl] = o[0].transpose(0, 1)
            continue
        index = (first[:, None] + torch.arange(length)).to(q.device)          # (S_L, L)
        qs, ks, vs = (x[:, index].transpose(0, 1) for x in (q, k, v))         # (S_L, heads, L, D)
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)           # (S_L, heads, L, D)
        out[index.flatten()] = o.transpose(1, 2).reshape(-1, heads, d)
    return out


class QwenVisionAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (with bias), the 2-D RoPE, and segments."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)   # each (N, h, D)
        q, k = apply_vision_rotary(q, k, cos, sin)
        out = segment_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu,
                                self.head_dim ** -0.5)                        # (N, h, D)
        return self.proj(out.reshape(n, -1))                                  # (N, hidden)


class QwenVisionMLP(nn.Module):
    """SwiGLU with biases: down_proj(silu(gate_proj x) * up_proj x)."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenVisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.norm1 = QwenRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = QwenVisionAttention(cfg)
        self.norm2 = QwenRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = QwenVisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp(self.norm2(x))


class QwenPatchEmbed(nn.Module):
    """A Conv3d whose kernel and stride are the patch (T, P, P), no bias: (N, C*T*P*P) -> (N, hidden)."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.view(-1, *self.shape).to(self.proj.weight.dtype)          # (N, C, T, P, P)
        return self.proj(x).view(x.shape[0], -1)                              # (N, hidden)


class QwenPatchMerger(nn.Module):
    """RMSNorm, ``merge ** 2`` neighbouring patches concatenated, Linear, GELU, Linear to the language model's width."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.ln_q = QwenRMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width,
                                                                                          cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))                   # (N / merge^2, out)


class QwenVisionTower(nn.Module):
    """``tower(pixel_values (N, C*T*P*P), grid_thw (k, 3) long) -> (sum t*h*w / merge^2, out_hidden_size)``: the
    images' tokens in the processor's order (see the module's notes). It runs in the dtype of its weights."""

    def __init__(self, cfg: QwenVisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = QwenPatchEmbed(cfg)
        self.blocks = nn.ModuleList(QwenVisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = QwenPatchMerger(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 2 or \
                pixel_values.shape[1] != cfg.patch_dim:
            shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else \
                type(pixel_values).__name__
            raise ValueError(f"Qwen vision tower: pixel_values must be (patches, {cfg.patch_dim}), got {shape}")
        device = pixel_values.device   # (the weights may be placeholders until their layer runs: memory mode 0)
        layout = vision_layout(grid_thw, cfg.spatial_merge_size, cfg.window_units, device)
        n = pixel_values.shape[0]
        if n != len(layout.positions):
            raise ValueError(f"Qwen vision tower: {n} patches in pixel_values, but grid_thw "
                             f"{grid_thw.tolist()} describes {len(layout.positions)}")
        unit = cfg.merge_unit

        def window_order(x):                                                 # (N, ...) in window order
            return x.reshape(n // unit, unit, -1)[layout.window_index].reshape(n, -1)

        x = window_order(self.patch_embed(pixel_values.to(device)))          # (N, hidden)
        cos, sin = vision_rotary(layout.positions, cfg.head_dim, cfg.rope_theta)
        cos, sin = window_order(cos), window_order(sin)                      # (N, D) float32
        full = set(cfg.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout.cu_frames if i in full else layout.cu_windows)
        tokens = self.merger(x)                                              # (N / unit, out), window order
        return tokens[torch.argsort(layout.window_index)]


class QwenVLEncoder(QwenTextEncoder):
    """Qwen2.5-VL as Qwen-Image-Edit's text encoder: the language model (:class:`~sdlite.models.qwen.QwenTextEncoder`)
    and its vision tower as ``visual`` (``config.vision``), named as transformers names them. The caller runs
    ``visual`` on the images and hands its tokens to :meth:`forward` as ``image_features``."""

    def __init__(self, cfg):
        if cfg.vision is None:
            raise ValueError("Qwen VL encoder: the config has no vision tower (QwenConfig.vision)")
        super().__init__(cfg)
        self.visual = QwenVisionTower(cfg.vision)
