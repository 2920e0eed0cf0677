"""The Qwen decoder (Qwen2 / Qwen2.5 and Qwen3) as a text encoder: token ids in, the hidden states of the layers the
caller asks for out. Z-Image reads Qwen3-4B's second-to-last hidden state, FLUX.2 klein stacks layers 9, 18 and 27
of Qwen3-4B / 8B, Qwen-Image reads the last hidden state of Qwen2.5-VL-7B's language model.

Module names are those of transformers' ``Qwen3Model`` / ``Qwen2Model`` (``embed_tokens``,
``layers.{i}.self_attn.q_proj`` ... ``q_norm``, ``layers.{i}.mlp.gate_proj`` ..., ``layers.{i}.input_layernorm``,
``layers.{i}.post_attention_layernorm``, ``norm``), so a checkpoint loads key for key; there is no LM head.

The network, block by block (a pre-norm decoder; ``config`` is :class:`sdlite.config.qwen.QwenConfig`):

* **RMSNorm**: ``weight * (x / sqrt(mean(x^2) + eps))``, the statistics and the division in float32 and the result
  cast back to the input's dtype before the weight multiplies it (as transformers computes it).
* **Attention**: grouped-query attention, ``num_attention_heads`` query heads sharing ``num_key_value_heads``
  key/value heads, each of ``head_dim`` (Qwen3-4B: q is 32 x 128 = 4096 wide on a hidden size of 2560). Qwen3 applies
  an RMSNorm over each head of q and of k (``q_norm``, ``k_norm``, one ``head_dim`` weight shared by the heads)
  before the rotary embedding; Qwen2 / 2.5 have biases on q, k and v instead. Causal, with a padding mask on the keys;
  scaled by ``1 / sqrt(head_dim)``; PyTorch's ``scaled_dot_product_attention``.
* **RoPE** (Su et al. 2021) in the "rotate half" convention: the head's first and second halves are the two parts
  of each rotated pair, ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``; frequencies
  ``theta ** (-2i / head_dim)``, position ``p`` the token's index in the row (0, 1, ...; pads included).
* **MLP**: SwiGLU, ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

Qwen2.5-VL's language model uses a multimodal RoPE ("mrope"): the rotary pairs are split into three sections
(16, 24, 24 of the 64 pairs) rotated by a temporal, a height and a width position. For text every token's three
positions are the same number, its index, so each section rotates by the same angle as plain 1-D RoPE does and the
result is the 1-D RoPE this module computes. (Transformers gives the pads of a right-padded row another position;
no real token attends to a pad, so the real tokens' hidden states are the same.)

Images in the row (Qwen-Image-Edit): the vision tower's output (:mod:`sdlite.models.qwen_vision`), one vector per
2 x 2 merged patch, replaces the embeddings of the row's ``<|image_pad|>`` tokens in order, and those tokens take 3-D
positions (:func:`mrope_positions`, Qwen2-VL's rope index): an image's tokens all share the temporal position ``p``
(the text's next index), row ``r`` and column ``c`` of its merged grid are at ``p + r`` and ``p + c``; the text after
it resumes at ``p + max(rows, columns)``. The angles are then taken section by section from the position of that
section's axis (:func:`mrope_tables`).

Which hidden states: :meth:`QwenTextEncoder.forward`'s ``hidden_states`` numbers them as transformers'
``output_hidden_states`` does: 0 is the embeddings, ``i`` the output of layer ``i`` (1-based), and the last,
``num_hidden_layers``, the output of the final layer after the final ``norm`` (the model's ``last_hidden_state``).
Negative indices count from the end (-1 the last, -2 the second to last: layer ``L - 1``'s output, not normed).
Layers past the deepest one asked for are not run.

The attention call mirrors the one transformers makes (``sdpa``), so float32 results are bit-identical: a row
without pads (or no mask) runs with ``is_causal=True`` and the key/value heads shared through ``enable_gqa``; with
pads, a boolean (causal and padding) mask and the key/value heads repeated per query head.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from ..config.qwen import QwenConfig
from .clip import Embedding
from .layers import RMSNorm

__all__ = ["QwenTextEncoder", "QwenRMSNorm", "QwenAttention", "QwenMLP", "QwenDecoderLayer", "rotary_tables",
           "mrope_tables", "mrope_positions", "rotate_half", "apply_rotary", "causal_padding_mask"]


class QwenRMSNorm(RMSNorm):
    """RMS normalisation as transformers' Qwen computes it: statistics in float32, the result cast back to the
    *input's* dtype, then scaled. :class:`~sdlite.models.layers.RMSNorm` (diffusers', T5's) casts to the *weight's*
    dtype instead: the same bits when the input and the weight share a dtype, not when they differ."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)                        # (..., 1)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


@lru_cache(maxsize=16)
def _inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """``1 / theta ** (2i / head_dim)`` for i < head_dim / 2, float32, computed on the CPU (once per size and base)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rotary_tables(n: int, head_dim: int, theta: float, dtype: torch.dtype,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of positions 0..n-1, each (n, head_dim) in ``dtype``: angles ``p * theta ** (-2i / head_dim)``,
    the half-size table repeated twice (rotate-half layout), computed in float32 and then cast."""
    inv_freq = _inverse_frequencies(head_dim, float(theta)).to(device)
    positions = torch.arange(n, device=device, dtype=torch.long)
    angles = positions[:, None].float() * inv_freq                        # (N, D/2)
    angles = torch.cat((angles, angles), dim=-1)                          # (N, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def mrope_tables(positions: torch.Tensor, head_dim: int, theta: float, sections: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the multimodal RoPE, each (B, 1, N, head_dim) in ``dtype``, for ``positions`` (3, B, N): the
    angles of each axis's positions, then the head's rotary pairs taken in ``sections`` (temporal, height, width)
    from the axis of their section, the half-size table repeated twice; float32 until the cast."""
    inv_freq = _inverse_frequencies(head_dim, float(theta)).to(device)
    angles = positions.to(device)[..., None].float() * inv_freq          # (3, B, N, D/2)
    parts = angles.split(list(sections), dim=-1)
    angles = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)   # (B, N, D/2)
    angles = torch.cat((angles, angles), dim=-1)[:, None]                 # (B, 1, N, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def mrope_positions(ids: torch.Tensor, attention_mask: torch.Tensor | None, grids: Sequence[tuple[int, int, int]],
                    image_token_id: int, merge: int) -> torch.Tensor:
    """The (3, B, N) positions of token rows with images (Qwen2-VL's rope index): text at consecutive indices on all
    three axes; each run of ``image_token_id`` tokens is the next image of ``grids`` (its vision tower grid
    (frames, rows, columns) of patches, ``merge`` x ``merge`` patches a token), at (p + frame, p + row, p + column)
    from the run's start ``p``, the text after it from ``p + max(rows, columns) / merge`` on. Pads (mask 0) are at 0.
    The images are taken in order over the rows."""
    b, n = ids.shape
    positions = torch.zeros(3, b, n, dtype=torch.long)
    keep = torch.ones(b, n, dtype=torch.bool) if attention_mask is None else attention_mask.to("cpu", torch.bool)
    images = iter(grids)
    for row in range(b):
        where = keep[row].nonzero().flatten()
        is_image = (ids[row].to("cpu")[where] == image_token_id).tolist()
        out, start, i = [], 0, 0
        while i < len(is_image):
            j = i
            while j < len(is_image) and is_image[j] == is_image[i]:
                j += 1
            if not is_image[i]:
                out.append(torch.arange(start, start + j - i).expand(3, -1))
                start += j - i
            else:
                grid = next(images, None)
                if grid is None:
                    raise ValueError(f"Qwen text encoder: row {row} has more runs of image tokens than the "
                                     f"{len(grids)} images given")
                frames, rows, cols = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
                if frames * rows * cols != j - i:
                    raise ValueError(f"Qwen text encoder: row {row} has {j - i} image tokens in a run where the "
                                     f"image's grid {tuple(int(v) for v in grid)} makes {frames * rows * cols}")
                t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij")
                out.append(torch.stack([t, h, w]).reshape(3, -1) + start)
                start += max(rows, cols)
            i = j
        if out:
            positions[:, row, where] = torch.cat(out, dim=1)
    return positions


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` over the last dimension's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` (B, heads, N, D) with tables (N, D)."""
    return x * cos + rotate_half(x) * sin


def causal_padding_mask(attention_mask: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """(B, 1, N, N) boolean: query ``i`` may attend key ``j`` when ``j <= i`` and key ``j`` is not a pad
    (``attention_mask`` (B, N) of 1 / 0 or booleans)."""
    keep = attention_mask.to(device=device, dtype=torch.bool)              # (B, N)
    n = keep.shape[1]
    positions = torch.arange(n, device=keep.device)
    causal = positions[:, None] >= positions[None, :]                     # (N, N)
    return causal[None, None] & keep[:, None, None, :]                    # (B, 1, N, N)


class QwenAttention(nn.Module):
    """Grouped-query self-attention with RoPE; Qwen3's per-head q/k RMSNorm or Qwen2's q/k/v biases."""

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_width, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_width, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_width, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_width, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = QwenRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = QwenRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, n, self.heads, d)                      # (B, N, h, D)
        k = self.k_proj(x).view(b, n, self.kv_heads, d)                   # (B, N, hk, D)
        v = self.v_proj(x).view(b, n, self.kv_heads, d).transpose(1, 2)   # (B, hk, N, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)                     # (B, h, N, D)
        k = apply_rotary(k.transpose(1, 2), cos, sin)                     # (B, hk, N, D)
        groups = self.heads // self.kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=d ** -0.5,
                                                 enable_gqa=groups > 1)
        else:
            if groups > 1:   # each key/value head repeated for the query heads of its group
                k = k[:, :, None].expand(b, self.kv_heads, groups, n, d).reshape(b, self.heads, n, d)
                v = v[:, :, None].expand(b, self.kv_heads, groups, n, d).reshape(b, self.heads, n, d)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * d))   # (B, N, hidden)


class QwenMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj x) * up_proj x)."""

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenDecoderLayer(nn.Module):
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.input_layernorm = QwenRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QwenAttention(cfg)
        self.post_attention_layernorm = QwenRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = QwenMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenTextEncoder(nn.Module):
    """Token ids (B, N) and an optional attention mask (B, N) -> the hidden states asked for, each (B, N, hidden)
    (see the module docstring for the numbering). It runs in the dtype of its weights. With its vision tower
    (Qwen2.5-VL reading images) it is :class:`sdlite.models.qwen_vision.QwenVLEncoder`, whose tower's output the
    caller hands back as ``image_features``."""

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(QwenDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = QwenRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def num_hidden_states(self) -> int:
        """How many hidden states there are to ask for: the embeddings and one per layer (``num_hidden_layers + 1``)."""
        return self.config.num_hidden_layers + 1

    def hidden_state_index(self, index: int) -> int:
        """``index`` (negative from the end) as a number in ``0 .. num_hidden_layers``; out of range a ValueError."""
        total = self.num_hidden_states
        if not isinstance(index, int) or isinstance(index, bool) or not -total <= index < total:
            raise ValueError(f"Qwen text encoder: hidden state {index!r} does not exist; with "
                             f"{self.config.num_hidden_layers} layers there are {total}, numbered 0 (the embeddings) "
                             f"to {total - 1} (the last, normed), or -{total} to -1 from the end")
        return index % total

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                hidden_states: int | Sequence[int] = -1, *, image_features: torch.Tensor | None = None,
                image_token_id: int | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor | list[torch.Tensor]:
        """The hidden state ``hidden_states`` (an index: one tensor) or states (a sequence of indices: a list in that
        order) of ``ids``; ``attention_mask`` marks the tokens (1) and the pads (0), which no token attends to.

        With images: ``image_features`` (T, hidden), the vision tower's tokens of every image in the rows in order,
        replace the embeddings of the T tokens ``image_token_id`` of ``ids`` (row by row), and ``positions``
        (3, B, N, from :func:`mrope_positions`) turn the multimodal RoPE."""
        single = isinstance(hidden_states, int) and not isinstance(hidden_states, bool)
        wanted = [self.hidden_state_index(i) for i in ([hidden_states] if single else list(hidden_states))]
        if not wanted:
            raise ValueError("Qwen text encoder: no hidden state asked for")
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"Qwen text encoder: expected token ids of shape (batch, tokens), got {shape}")
        b, n = ids.shape
        device = self.embed_tokens.weight.device
        # moved here, not by the caller; where weights are streamed they are placeholders (meta) until a layer runs
        if device.type != "meta":
            ids = ids.to(device)
        if n:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"Qwen text encoder: token id {low if low < 0 else high} is outside its vocabulary "
                                 f"of {self.config.vocab_size}")
        mask = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (b, n):
                raise ValueError(f"Qwen text encoder: attention_mask of shape {tuple(attention_mask.shape)} does not "
                                 f"match the ids' {(b, n)}")
            if not bool(attention_mask.to(torch.bool).all()):   # without pads it is plain causal attention
                mask = causal_padding_mask(attention_mask, ids.device)      # (B, 1, N, N)
        x = self.embed_tokens(ids)                                         # (B, N, hidden)
        if image_features is not None:
            slots = ids == image_token_id                                  # (B, N)
            count = int(slots.sum())
            if tuple(image_features.shape) != (count, x.shape[-1]):
                raise ValueError(f"Qwen text encoder: {count} image tokens in the rows, but image features of shape "
                                 f"{tuple(image_features.shape)} (expected ({count}, {x.shape[-1]}))")
            x = x.masked_scatter(slots[..., None], image_features.to(x.dtype))
        if positions is not None:
            if self.config.mrope_section is None:
                raise ValueError("Qwen text encoder: 3-D positions given to a model without a multimodal RoPE "
                                 "(its config has no mrope_section)")
            if tuple(positions.shape) != (3, b, n):
                raise ValueError(f"Qwen text encoder: positions of shape {tuple(positions.shape)}, expected "
                                 f"{(3, b, n)}")
            cos, sin = mrope_tables(positions, self.config.head_dim, self.config.rope_theta,
                                    self.config.mrope_section, x.dtype, x.device)
        else:
            cos, sin = rotary_tables(n, self.config.head_dim, self.config.rope_theta, x.dtype, x.device)
        states = {0: x}
        deepest = max(wanted)
        last = self.config.num_hidden_layers
        for i, layer in enumerate(self.layers[:deepest], start=1):
            x = layer(x, cos, sin, mask)
            states[i] = x
        if deepest == last:
            states[last] = self.norm(x)   # the last hidden state is the final layer's output normed
        out = [states[i] for i in wanted]
        return out[0] if single else out
