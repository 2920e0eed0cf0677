"""Qwen-Image's denoiser (Qwen team 2025, Qwen-Image and Qwen-Image-Edit): a rectified-flow MMDiT of double-stream
blocks only (image and text tokens each with their own weights and their own per-block modulations, one joint
attention over [text, image]), rotary positions over three axes (frame, row, column) with the image's rows and
columns centred, and the text's positions after the images'. Module names are those of diffusers'
``QwenImageTransformer2DModel`` state dict (which ComfyUI's files use as well), so loading is a key-for-key copy
(:mod:`sdlite.weights.qwenimage_keys`).

Two entry points:

* :meth:`QwenImage.forward` takes the sampler's latent: the VAE's 16-channel latent, (B, 16, H/8, W/8) for an H x W
  image, normalised by the VAE's statistics (that side is :mod:`sdlite.models.qwenimage_vae`). It packs 2 x 2 patches
  into tokens as the pipelines do, appends the edit's source latents (``references``) as further images of the same
  sample, and returns the velocity of the image's own tokens in the latent's shape.
* :meth:`QwenImage.tokens` is diffusers' forward contract: packed tokens (B, N, 64), the text states and their mask,
  the timestep / 1000 and ``img_shapes`` (per sample, the (frames, rows, columns) of each image in the sequence).

The order of operations is diffusers', so fp32 results are the same bits. Shapes are written where they change: B batch,
N image tokens (all images), M text tokens, S = M + N, C width, h heads, D head dim.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config.qwenimage import QWEN_IMAGE_EPS, QWEN_IMAGE_ROPE_THETA, QWEN_IMAGE_TIME_CHANNELS, QwenImageConfig
from ..errors import RequestError
from .flux import pack_latents, unpack_latents
from .layers import (RMSNorm, TimestepEmbedding, pad_to_patches, pair_tables, per_sample, rotate_joined, rotate_pairs,
                     run_blocks)
from .mmdit import attention, padded_attention

__all__ = ["QwenImage", "rope_table", "image_positions", "timestep_sinusoid", "image_shapes"]


# --- positions -----------------------------------------------------------------------------------------------


def image_positions(index: int, frames: int, height: int, width: int, device=None) -> torch.Tensor:
    """The (frame, row, column) positions (frames*height*width, 3) of image ``index`` in a sample's sequence, frame by
    frame, row by row: frames ``index ..``, row ``r`` at ``r - ceil(height / 2)`` and column ``c`` at
    ``c - ceil(width / 2)`` (centred, as diffusers' ``scale_rope``), int64."""
    f = torch.arange(index, index + frames, device=device)
    r = torch.arange(height, device=device) - (height - height // 2)
    c = torch.arange(width, device=device) - (width - width // 2)
    grid = torch.stack(torch.meshgrid(f, r, c, indexing="ij"), dim=-1)              # (F, H, W, 3)
    return grid.reshape(-1, 3)


def _inverse_frequencies(dim: int, device=None) -> torch.Tensor:
    """``1 / theta ** (2i / dim)``, float32."""
    return 1.0 / torch.pow(QWEN_IMAGE_ROPE_THETA, torch.arange(0, dim, 2, device=device).to(torch.float32).div(dim))


def rope_table(positions: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
    """The rotary factors (S, D/2) for ``positions`` (S, 3): complex ``exp(i p_a theta_a,k)`` of each axis' channel
    pairs, axes side by side (float32 angles, complex64)."""
    parts = []
    for a, dim in enumerate(axes):
        angles = positions[:, a].to(torch.float32)[:, None] * _inverse_frequencies(dim, positions.device)
        parts.append(torch.polar(torch.ones_like(angles), angles))                   # (S, dim/2)
    return torch.cat(parts, dim=1)


def _rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The rotary embedding on x (B, S, h, D), its channel pairs (x0, x1) as complex numbers times ``table`` (S, D/2),
    in float32 and back to x's dtype."""
    if isinstance(table, tuple):
        return rotate_pairs(x, *table)
    turned = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * table[:, None]
    return torch.view_as_real(turned).flatten(3).type_as(x)


def image_shapes(img_shapes, batch: int) -> list[tuple[int, int, int]]:
    """diffusers' ``img_shapes`` (one entry per sample: a (frames, rows, columns) or a list of them, the generated
    image first) as the one list of shapes the whole batch shares; samples that differ are a RequestError."""
    if not isinstance(img_shapes, (list, tuple)) or len(img_shapes) != batch:
        raise RequestError(f"Qwen-Image img_shapes must list {batch} samples' image shapes, got {img_shapes!r}")
    samples = []
    for entry in img_shapes:
        shapes = [entry] if len(entry) == 3 and all(isinstance(v, int) for v in entry) else list(entry)
        for s in shapes:
            if len(s) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in s):
                raise RequestError(f"Qwen-Image image shape {s!r}: expected (frames, rows, columns) of patches")
        samples.append([tuple(s) for s in shapes])
    if any(s != samples[0] for s in samples[1:]):
        raise RequestError(f"Qwen-Image img_shapes differ between the samples of the batch ({samples}): the "
                           "network takes one set of image shapes for the batch")
    if not samples[0]:
        raise RequestError("Qwen-Image img_shapes name no image")
    return samples[0]


def timestep_sinusoid(t: torch.Tensor, dim: int = QWEN_IMAGE_TIME_CHANNELS) -> torch.Tensor:
    """The timestep's sinusoid (B, dim), cos then sin, for ``t`` (B,) the timestep / 1000 in the model's dtype (so
    rounded to it, as diffusers does): frequencies ``10000 ** (-i / (dim / 2))``, angles ``(t * f) * 1000``, all in
    float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t[:, None].float() * freqs[None]) * 1000                     # (B, dim/2)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


# --- the blocks ------------------------------------------------------------------------------------------------


class GeluProjection(nn.Module):
    """Linear then GELU (tanh): the MLP's first layer (diffusers' ``GELU`` module, its Linear named ``proj``)."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """The 4x GELU MLP, as ``net.0`` (projection and GELU), ``net.1`` (no parameters), ``net.2`` (back)."""

    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class JointAttention(nn.Module):
    """q/k/v of the image stream (``to_*``) and of the text stream (``add_*_proj``), all with biases; each head's
    queries and keys RMS-normalised; rotary positions; one attention over [text, image] (pads of the text masked);
    each stream's part projected back by its own Linear. ``fp32_kernels``: as in
    :class:`sdlite.models.layers.Attention` (used where there is no mask)."""
    fp32_kernels = False

    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        dim, self.head_dim = cfg.hidden, cfg.attention_head_dim
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_q = RMSNorm(self.head_dim, QWEN_IMAGE_EPS)
        self.norm_k = RMSNorm(self.head_dim, QWEN_IMAGE_EPS)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_added_q = RMSNorm(self.head_dim, QWEN_IMAGE_EPS)
        self.norm_added_k = RMSNorm(self.head_dim, QWEN_IMAGE_EPS)
        self.to_add_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None):
        """x (B, N, C) image tokens, c (B, M, C) text tokens, rope (S, D/2) complex of [text, image] (bf16: its
        (cos, sin) tables, :func:`~sdlite.models.layers.pair_tables`), mask (B, 1, 1, S)
        booleans or None -> (image (B, N, C), text (B, M, C))."""
        d = self.head_dim
        q = [self.norm_added_q(self.add_q_proj(c).unflatten(-1, (-1, d))),
             self.norm_q(self.to_q(x).unflatten(-1, (-1, d)))]                      # [text, image] (B, *, h, D)
        k = [self.norm_added_k(self.add_k_proj(c).unflatten(-1, (-1, d))),
             self.norm_k(self.to_k(x).unflatten(-1, (-1, d)))]
        if isinstance(rope, tuple):                       # bf16 tables: rotated into the joined sequence
            q, k = rotate_joined(q, *rope), rotate_joined(k, *rope)                  # (B, S, h, D)
        else:
            q, k = _rotate(torch.cat(q, dim=1), rope), _rotate(torch.cat(k, dim=1), rope)
        v = torch.cat([self.add_v_proj(c).unflatten(-1, (-1, d)), self.to_v(x).unflatten(-1, (-1, d))], dim=1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)            # (B, h, S, D)
        if mask is None:
            out = attention(q, k, v, self.fp32_kernels)                              # (B, S, C)
        else:
            out = padded_attention(q, k, v, mask[:, 0, 0])
        del q, k, v
        m = c.shape[1]
        return self.to_out[0](out[:, m:]), self.to_add_out(out[:, :m])


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=QWEN_IMAGE_EPS)


def _segments(x: torch.Tensor, split: int | None):
    """The token runs that take their own modulation: the whole sequence, or (``zero_cond_t``) the generated image's
    first ``split`` tokens and the source images' after them."""
    return (x,) if split is None else (x[:, :split], x[:, split:])


def _modulate(x: torch.Tensor, params: Sequence[torch.Tensor], split: int | None) -> torch.Tensor:
    """``x * (1 + scale) + shift`` for ``x`` (B, L, C) a fresh tensor (in place without gradients); ``params`` one
    (shift, scale) per segment (:func:`_segments`), each (B, C)."""
    if torch.is_grad_enabled():
        return torch.cat([part * (1 + scale[:, None]) + shift[:, None]
                          for part, (shift, scale) in zip(_segments(x, split), params)], dim=1)
    for part, (shift, scale) in zip(_segments(x, split), params):
        part.mul_(1 + scale[:, None]).add_(shift[:, None])
    return x


def _add_gated(x: torch.Tensor, branch: torch.Tensor, gates: Sequence[torch.Tensor], split: int | None):
    """``x + gate * branch`` per segment; ``branch`` is fresh and takes the result without gradients."""
    if torch.is_grad_enabled():
        return x + torch.cat([gate[:, None] * part for part, gate in zip(_segments(branch, split), gates)], dim=1)
    for part, gate in zip(_segments(branch, split), gates):
        part.mul_(gate[:, None])
    return branch.add_(x)


class DoubleBlock(nn.Module):
    """Each stream modulated by its own per-block modulation (shift, scale, gate of the attention; of the MLP: one
    Linear of the SiLU'd conditioning vector, ``img_mod.1`` / ``txt_mod.1``), one joint attention, then a GELU MLP on
    each; every branch gated. The norms have no weights."""

    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        dim = cfg.hidden
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.attn = JointAttention(cfg)
        self.img_mlp = FeedForward(dim)
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mlp = FeedForward(dim)

    def forward(self, x, c, temb, rope, mask, split):
        """x (B, N, C), c (B, M, C); temb (B, C), or with ``split`` (B2, C) the step's conditioning then timestep 0's
        (the image tokens past ``split`` take the second)."""
        b = c.shape[0]
        img = self.img_mod(temb).chunk(6, dim=-1)                                    # 6 x (B or 2B, C)
        txt = self.txt_mod(temb[:b] if split is not None else temb).chunk(6, dim=-1)
        img = [[p[:b] for p in img], [p[b:] for p in img]] if split is not None else [img]
        params = [[(p[0], p[1]) for p in img], [(p[3], p[4]) for p in img]]          # (shift, scale) per segment
        gates = [[p[2] for p in img], [p[5] for p in img]]
        a, ca = self.attn(_modulate(_layer_norm(x), params[0], split),
                          _modulate(_layer_norm(c), [(txt[0], txt[1])], None), rope, mask)
        x = _add_gated(x, a, gates[0], split)
        c = _add_gated(c, ca, [txt[2]], None)
        x = _add_gated(x, self.img_mlp(_modulate(_layer_norm(x), params[1], split)), gates[1], split)
        c = _add_gated(c, self.txt_mlp(_modulate(_layer_norm(c), [(txt[3], txt[4])], None)), [txt[5]], None)
        if c.dtype == torch.float16:   # as diffusers: keep fp16 finite
            c, x = c.clip(-65504, 65504), x.clip(-65504, 65504)
        return x, c


class OutputNorm(nn.Module):
    """The output's LayerNorm, scaled and shifted by (scale, shift) from the SiLU'd conditioning vector (diffusers'
    ``AdaLayerNormContinuous`` order: scale first), with a bias."""

    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        self.linear = nn.Linear(cfg.hidden, 2 * cfg.hidden)

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb).to(h.dtype)).chunk(2, dim=1)
        return _layer_norm(h) * (1 + scale)[:, None, :] + shift[:, None, :]


class TimeTextEmbed(nn.Module):
    """The conditioning vector: the timestep's sinusoid through ``timestep_embedder`` (Linear, SiLU, Linear)."""

    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(QWEN_IMAGE_TIME_CHANNELS, cfg.hidden)

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_sinusoid(t).to(dtype))


# --- the network -----------------------------------------------------------------------------------------------


class QwenImage(nn.Module):
    """Qwen-Image's transformer: ``forward(x, t, context, context_mask=None, references=())`` -> the velocity.

    Build it from a :class:`~sdlite.config.qwenimage.QwenImageConfig` and load a canonical (diffusers) state dict key
    for key. Inputs are cast to the weights' dtype; the output is in it."""

    def __init__(self, cfg: QwenImageConfig):
        super().__init__()
        self.config = cfg
        dim = cfg.hidden
        self.time_text_embed = TimeTextEmbed(cfg)
        self.txt_norm = RMSNorm(cfg.joint_attention_dim, QWEN_IMAGE_EPS)
        self.img_in = nn.Linear(cfg.in_channels, dim)
        self.txt_in = nn.Linear(cfg.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(DoubleBlock(cfg) for _ in range(cfg.num_layers))
        self.norm_out = OutputNorm(cfg)
        self.proj_out = nn.Linear(dim, cfg.patch_size ** 2 * cfg.out_channels)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: that of the first block's query norm (a 1-D weight, which a Linear's weight kept in a
        quantized storage form leaves in the compute dtype)."""
        return self.transformer_blocks[0].attn.norm_q.weight.dtype if len(self.transformer_blocks) \
            else self.txt_norm.weight.dtype

    def forward(self, x: torch.Tensor, t: torch.Tensor | float, context: torch.Tensor,
                context_mask: torch.Tensor | None = None, references: Sequence[torch.Tensor] = (),
                cache=None) -> torch.Tensor:
        """x (B, out_channels, h, w): the sampler's latent; t (B,) or one value: the timestep / 1000 (sigma); context
        (B, M, joint_attention_dim) the text encoder's last hidden states; ``context_mask`` (B, M) 1 for a token, 0 for
        a pad (None or all ones: no pads); ``references`` the edit's source latents, each (out_channels, h_i, w_i) or
        (1 or B, out_channels, h_i, w_i), shared by the batch: their tokens follow the image's as images 1, 2, ... of
        the sample and are not returned; ``cache`` a step cache's hook on the blocks
        (:func:`~sdlite.models.layers.run_blocks`). Returns (B, out_channels, h, w).

        An odd h or w (a ComfyUI latent of a side that is a multiple of 8 pixels but not of 16; the pipelines draw
        none) is padded as ComfyUI pads it (:func:`~sdlite.models.layers.pad_to_patches`), the sources' too, and the
        output cropped back."""
        cfg = self.config
        c_lat = cfg.latent_channels
        if x.ndim != 4 or x.shape[1] != c_lat:
            raise RequestError(f"Qwen-Image latent has shape {list(x.shape)}: expected (batch, {c_lat}, height, "
                               "width)")
        b, _, hgt, wid = x.shape
        x = pad_to_patches(x)
        rows, cols = x.shape[2] // 2, x.shape[3] // 2
        tokens, shapes = [pack_latents(x)], [(1, rows, cols)]
        for i, ref in enumerate(references):
            ref = ref[None] if ref.ndim == 3 else ref
            if ref.ndim != 4 or ref.shape[1] != c_lat or ref.shape[0] not in (1, b):
                raise RequestError(f"Qwen-Image reference {i} has shape {list(ref.shape)}: expected ({c_lat}, height, "
                                   f"width) or (1 or {b}, {c_lat}, height, width)")
            ref = pad_to_patches(ref)
            tokens.append(pack_latents(ref.to(x.dtype)).expand(b, -1, -1))
            shapes.append((1, ref.shape[2] // 2, ref.shape[3] // 2))
        if context_mask is not None and bool(context_mask.to(torch.bool).all()):
            context_mask = None   # as the pipelines pass it: no pads, no mask
        out = self.tokens(torch.cat(tokens, dim=1) if len(tokens) > 1 else tokens[0], context, t, [shapes] * b,
                          context_mask, cache)                                       # (B, N + refs, 4 c)
        out = unpack_latents(out[:, :rows * cols], 2 * rows, 2 * cols)               # (B, c, h or h + 1, ...)
        return out if out.shape[2:] == (hgt, wid) else out[:, :, :hgt, :wid]

    def tokens(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor | float,
               img_shapes, encoder_hidden_states_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """diffusers' ``QwenImageTransformer2DModel.forward`` contract. hidden_states (B, N, in_channels) packed tokens
        of every image of a sample; encoder_hidden_states (B, M, joint_attention_dim); timestep (B,) or one value, the
        timestep / 1000; img_shapes per sample the (frames, rows, columns) of its images, the generated one first (the
        same for every sample); encoder_hidden_states_mask (B, M) or None. Returns (B, N, 4 out_channels)."""
        dtype = self.dtype
        t, shapes, rope, mask = self._check(hidden_states, encoder_hidden_states, timestep, img_shapes,
                                            encoder_hidden_states_mask)
        h = self.img_in(hidden_states.to(dtype))                                     # (B, N, C)
        t = t.to(dtype)
        split = None
        if self.config.zero_cond_t:
            t = torch.cat([t, t * 0])                                                # (2B,): the step's, then 0
            split = math.prod(shapes[0])
        c = self.txt_in(self.txt_norm(encoder_hidden_states.to(dtype)))              # (B, M, C)
        temb = self.time_text_embed(t, dtype)                                        # (B or 2B, C)

        def first(state):
            return self.transformer_blocks[0](*state, temb, rope, mask, split)

        def rest(state):
            h, c = state
            del state
            for block in self.transformer_blocks[1:]:
                h, c = block(h, c, temb, rope, mask, split)
            return h, c

        if len(self.transformer_blocks):
            h, _ = run_blocks(first, rest, (h, c), cache)
        h = self.norm_out(h, temb[:h.shape[0]])                                      # (B, N, C)
        return self.proj_out(h)                                                      # (B, N, 4 out_channels)

    def _check(self, x, context, t, img_shapes, mask):
        """The inputs' shapes against the config (a clear error naming the input); one timestep per sample; the
        rotary table of [text, image]; the attention mask of [text, image] (None without one)."""
        cfg = self.config
        if x.ndim != 3 or x.shape[2] != cfg.in_channels:
            raise RequestError(f"Qwen-Image image tokens have shape {list(x.shape)}: expected (batch, tokens, "
                               f"{cfg.in_channels})")
        b, n = x.shape[:2]
        if context.ndim != 3 or context.shape[0] != b or context.shape[2] != cfg.joint_attention_dim:
            raise RequestError(f"Qwen-Image context has shape {list(context.shape)}: expected ({b}, tokens, "
                               f"{cfg.joint_attention_dim})")
        m = context.shape[1]
        shapes = image_shapes(img_shapes, b)
        if sum(math.prod(s) for s in shapes) != n:
            raise RequestError(f"Qwen-Image img_shapes {shapes} make {sum(math.prod(s) for s in shapes)} tokens, but "
                               f"the image tokens are {n}")
        device = x.device
        positions = [image_positions(i, *s, device=device) for i, s in enumerate(shapes)]
        start = max(max(s[1] // 2, s[2] // 2) for s in shapes)
        text = torch.arange(start, start + m, device=device)[:, None].expand(m, 3)
        rope = rope_table(torch.cat([text, *positions]), cfg.axes_dims_rope)         # (S, D/2)
        if self.dtype is torch.bfloat16 and device.type == "cpu":
            rope = pair_tables(rope)                      # sdlite's rotary kernel's (cos, sin), (S, D) each
        if mask is not None:
            if tuple(mask.shape) != (b, m):
                raise RequestError(f"Qwen-Image context mask has shape {list(mask.shape)}: expected ({b}, {m})")
            mask = torch.cat([mask.to(device=device, dtype=torch.bool),
                              torch.ones(b, n, dtype=torch.bool, device=device)], dim=1)[:, None, None, :]
        return per_sample(t, b, device, "Qwen-Image timesteps"), shapes, rope, mask
