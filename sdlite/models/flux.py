"""FLUX.1's denoiser (Black Forest Labs 2024): a rectified-flow transformer with double-stream blocks (image and text
tokens each with their own weights, one joint attention) followed by single-stream blocks (one sequence, attention and
an MLP side by side), rotary positions over three axes of token ids, and a conditioning vector of the timestep, the
pooled CLIP text and, in dev, the distilled guidance scale. Module names are those of diffusers'
``FluxTransformer2DModel`` state dict, so loading is a key-for-key copy; BFL's original names (fused qkv, fused
single-block projections) are mapped by :mod:`sdlite.weights.flux_keys`.

The network takes the VAE latent (B, 16, H, W) and packs it itself: 2 x 2 patches become tokens of 64 values, with
ids (0, row, column) per patch, the text tokens ids of zeros (as FluxPipeline builds them). A latent of an odd side
(ComfyUI's, of a side that is a multiple of 8 pixels but not of 16; the pipelines draw none) is padded as ComfyUI's
FLUX pads it (:func:`~sdlite.models.layers.pad_to_patches`), its ids those of the padded grid, the output cropped back;
a reference latent's too (:func:`reference_ids`). Shapes are written where
they change: B batch, N image tokens, M text tokens, S = M + N, C width, h heads, D head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.flux import FluxConfig
from ..errors import RequestError
from .layers import (TimestepEmbedding, pad_to_patches, per_sample, residual, rotate_joined, rotate_pairs, run_blocks,
                     timestep_embedding)
from .mmdit import NORM_EPS, AdaNorm, FeedForward, attention, gated, layer_norm, modulate

__all__ = ["Flux", "pack_latents", "unpack_latents", "image_ids", "reference_ids", "rope_tables"]

TIME_EMBED_CHANNELS = 256     # sinusoidal channels of the timestep and of the guidance scale
ROPE_THETA = 10000.0


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """(B, c, H, W) -> (B, H/2 * W/2, 4c): each 2 x 2 patch a token, channels outermost, rows of patches in order."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack_latents` for an H x W latent."""
    b, _, cc = x.shape
    c = cc // 4
    return x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def image_ids(h: int, w: int, device=None) -> torch.Tensor:
    """The ids of an (h, w) grid of patches, row by row: (h*w, 3) of (0, row, column), float32."""
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(h * w, 3)


def _patches(n: int) -> int:
    """Latent rows (columns) in 2 x 2 patches, a last half patch counted (ComfyUI's ``(n + 1) // 2``)."""
    return (n + 1) // 2


def reference_ids(sizes: list[tuple[int, int]], device=None) -> list[torch.Tensor]:
    """The ids of reference latents of ``sizes`` (h, w) (FLUX.1 Kontext's source images), each (h/2 * w/2, 3):
    first axis 1, then the patch's row and column. The first starts at (0, 0), as FluxKontextPipeline places its one
    image; each further one beside the region the earlier ones cover, as ComfyUI's chained ReferenceLatents are
    placed (its "offset" method): to the right of it where that keeps the region squarer, else below it. An odd side
    (a ComfyUI latent) counts as ComfyUI counts it: the region in latent rows and columns as they are, the grid and
    the offset in patches rounded up (its padded size)."""
    out, covered_h, covered_w = [], 0, 0
    for h, w in sizes:
        down, right = (0, covered_w) if h + covered_h > w + covered_w else (covered_h, 0)
        covered_h, covered_w = max(covered_h, h + down), max(covered_w, w + right)
        ids = image_ids(_patches(h), _patches(w), device)
        ids[:, 0] = 1
        ids[:, 1] += _patches(down)
        ids[:, 2] += _patches(right)
        out.append(ids)
    return out


def rope_tables(ids: torch.Tensor, axes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (S, D) of the rotary embedding for ``ids`` (S, len(axes)): axis ``a`` takes ``axes[a]``
    channels, frequencies ``theta ** (-2i / axes[a])`` computed in float64, each angle's cos and sin repeated for the
    channel pair it rotates; float32."""
    cos, sin = [], []
    pos = ids.float()
    for a, dim in enumerate(axes):
        freqs = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles = torch.outer(pos[:, a], freqs)                                       # (S, dim/2), float64
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


rotate = rotate_pairs   # the rotary embedding on x (B, S, h, D) with rope_tables' (cos, sin)


class QKNorm(nn.Module):
    """RMS normalisation of each head's queries or keys with a learned scale (PyTorch's ``rms_norm``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, NORM_EPS)


class FluxAttention(nn.Module):
    """q/k/v of the image stream (``to_*``) and, in a double block, of the text stream (``add_*_proj``), each
    RMS-normalised per head; rotary positions on the joined sequence [text, image]; one attention over it. A double
    block's output is projected per stream (``to_out``, ``to_add_out``); a single block's is returned as is.
    ``fp32_kernels``: as in :class:`sdlite.models.layers.Attention`."""
    fp32_kernels = False

    def __init__(self, dim: int, heads: int, double: bool):
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.norm_q = QKNorm(head_dim)
        self.norm_k = QKNorm(head_dim)
        if double:
            self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
            self.add_q_proj = nn.Linear(dim, dim)
            self.add_k_proj = nn.Linear(dim, dim)
            self.add_v_proj = nn.Linear(dim, dim)
            self.norm_added_q = QKNorm(head_dim)
            self.norm_added_k = QKNorm(head_dim)
            self.to_add_out = nn.Linear(dim, dim)

    def _split(self, proj: nn.Linear, x: torch.Tensor, norm: QKNorm | None) -> torch.Tensor:
        b, n, c = x.shape
        y = proj(x).view(b, n, self.heads, c // self.heads)                          # (B, L, h, D)
        return norm(y) if norm is not None else y

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                c: torch.Tensor | None = None):
        """x (B, N, C) image tokens (a single block: the whole sequence), c (B, M, C) text tokens (double blocks).
        Returns the attended tokens (B, S, C), or (image (B, N, C), text (B, M, C)) projected in a double block."""
        q = self._split(self.to_q, x, self.norm_q)
        k = self._split(self.to_k, x, self.norm_k)
        v = self._split(self.to_v, x, None)
        if c is None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        else:                                                                       # (B, S, h, D): [text, image]
            q = rotate_joined([self._split(self.add_q_proj, c, self.norm_added_q), q], *rope)
            k = rotate_joined([self._split(self.add_k_proj, c, self.norm_added_k), k], *rope)
            v = torch.cat([self._split(self.add_v_proj, c, None), v], dim=1)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.fp32_kernels)  # (B, S, C)
        del q, k, v
        if c is None:
            return out
        m = c.shape[1]
        return self.to_out[0](out[:, m:].contiguous()), self.to_add_out(out[:, :m].contiguous())


def _clip_half(x: torch.Tensor) -> torch.Tensor:
    """fp16 activations held inside fp16's range, as the reference does after each block."""
    return x.clamp_(-65504, 65504) if x.dtype == torch.float16 else x


class DoubleBlock(nn.Module):
    """Both streams modulated (adaLN-Zero: shift, scale, gate of the attention; of the MLP), one joint attention,
    then an MLP on each; every branch gated."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        dim = cfg.hidden
        self.norm1 = AdaNorm(dim, 6)
        self.norm1_context = AdaNorm(dim, 6)
        self.attn = FluxAttention(dim, cfg.num_attention_heads, double=True)
        self.ff = FeedForward(dim)
        self.ff_context = FeedForward(dim)

    def forward(self, x, c, emb, rope):
        """x (B, N, C), c (B, M, C), emb (B, C) the SiLU'd conditioning."""
        shift, scale, gate, shift_ff, scale_ff, gate_ff = self.norm1(emb)
        c_shift, c_scale, c_gate, c_shift_ff, c_scale_ff, c_gate_ff = self.norm1_context(emb)
        a, ca = self.attn(modulate(layer_norm(x), shift, scale), rope, modulate(layer_norm(c), c_shift, c_scale))
        x = residual(x, gated(a, gate))
        x = residual(x, gated(self.ff(modulate(layer_norm(x), shift_ff, scale_ff)), gate_ff))
        c = residual(c, gated(ca, c_gate))
        c = residual(c, gated(self.ff_context(modulate(layer_norm(c), c_shift_ff, c_scale_ff)), c_gate_ff))
        return _clip_half(x), _clip_half(c)


class SingleBlock(nn.Module):
    """One sequence (text then image tokens), modulated once (shift, scale, gate); attention and a tanh-GELU MLP
    from the same normalised tokens, their outputs joined and projected back, gated."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        dim = cfg.hidden
        self.norm = AdaNorm(dim, 3)
        self.proj_mlp = nn.Linear(dim, 4 * dim)
        self.attn = FluxAttention(dim, cfg.num_attention_heads, double=False)
        self.proj_out = nn.Linear(5 * dim, dim)

    def forward(self, h, emb, rope):
        """h (B, S, C)."""
        shift, scale, gate = self.norm(emb)
        hn = modulate(layer_norm(h), shift, scale)
        mlp = self.proj_mlp(hn)                                                     # (B, S, 4C)
        mlp = F.gelu(mlp, approximate="tanh") if torch.is_grad_enabled() else \
            torch.ops.aten.gelu_(mlp, approximate="tanh")                           # the same values, in place
        a = self.attn(hn, rope)                                                     # (B, S, C)
        del hn
        out = self.proj_out(torch.cat([a, mlp], dim=2))
        del a, mlp
        return _clip_half(residual(h, gated(out, gate)))


class TimeTextEmbed(nn.Module):
    """The conditioning vector: MLPs on the timestep's and (dev) the guidance scale's sinusoidal embeddings, plus an
    MLP on the pooled CLIP text."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIME_EMBED_CHANNELS, cfg.hidden)
        if cfg.guidance_embeds:
            self.guidance_embedder = TimestepEmbedding(TIME_EMBED_CHANNELS, cfg.hidden)
        self.text_embedder = TimestepEmbedding(cfg.pooled_projection_dim, cfg.hidden)

    def forward(self, t, guidance, pooled):
        emb = self.timestep_embedder(timestep_embedding(t, TIME_EMBED_CHANNELS, True, 0.0).to(pooled.dtype))
        if guidance is not None:
            emb = emb + self.guidance_embedder(
                timestep_embedding(guidance, TIME_EMBED_CHANNELS, True, 0.0).to(pooled.dtype))
        return emb + self.text_embedder(pooled)                                     # (B, C)


class Flux(nn.Module):
    """FLUX.1's transformer: ``forward(x, t, context, pooled_projections, guidance=None)`` -> the velocity.

    Build it from a :class:`~sdlite.config.flux.FluxConfig` and load a canonical (diffusers) state dict key for key.
    Inputs are cast to the weights' dtype; the output is in it."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        self.config = cfg
        dim = cfg.hidden
        self.time_text_embed = TimeTextEmbed(cfg)
        self.context_embedder = nn.Linear(cfg.joint_attention_dim, dim)
        self.x_embedder = nn.Linear(cfg.in_channels, dim)
        self.transformer_blocks = nn.ModuleList(DoubleBlock(cfg) for _ in range(cfg.num_layers))
        self.single_transformer_blocks = nn.ModuleList(SingleBlock(cfg) for _ in range(cfg.num_single_layers))
        self.norm_out = AdaNorm(dim, 2)
        self.proj_out = nn.Linear(dim, cfg.out_channels)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of its weights; of the output layer's bias, which a weight kept in a GGUF block
        format leaves in it)."""
        return self.proj_out.bias.dtype

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, pooled_projections: torch.Tensor,
                guidance: torch.Tensor | float | None = None, references=(), cache=None) -> torch.Tensor:
        """x (B, 16, H, W) latent (an odd H or W padded as ComfyUI pads it, the output cropped back); t (B,)
        timesteps as the reference pipeline hands them to the network: the training timestep / 1000, i.e. sigma (one
        value serves the batch); context (B, M, joint_attention_dim) T5 states; pooled_projections (B,
        pooled_projection_dim) CLIP's pooled output; ``guidance`` the distilled guidance scale (dev: required;
        schnell: none); ``references`` latents (1 or B, 16, h_i, w_i) of source images (Kontext's editing): their
        tokens follow the image's in the sequence with the ids of :func:`reference_ids`, and their outputs are
        dropped; ``cache`` a step cache's hook on the blocks (:func:`~sdlite.models.layers.run_blocks`; None: none).
        Returns (B, 16, H, W)."""
        cfg = self.config
        dtype = self.dtype
        t, guidance = self._check(x, t, context, pooled_projections, guidance)
        b, _, hgt, wid = x.shape
        self._check_references(references, b)
        t = t.to(dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(dtype) * 1000
        rows, cols = _patches(hgt), _patches(wid)
        tokens = pack_latents(pad_to_patches(x.to(dtype)))                            # (B, N, 64)
        n = tokens.shape[1]
        if references:   # (B, N + R, 64): the image's tokens, then each reference's
            tokens = torch.cat([tokens, *(pack_latents(pad_to_patches(ref.to(dtype))).expand(b, -1, -1)
                                          for ref in references)], 1)
        h = self.x_embedder(tokens)                                                   # (B, N (+ R), C)
        del tokens
        emb = F.silu(self.time_text_embed(t, guidance, pooled_projections.to(dtype)))  # (B, C)
        c = self.context_embedder(context.to(dtype))                                 # (B, M, C)
        m = c.shape[1]
        ref_ids = reference_ids([tuple(ref.shape[2:]) for ref in references], x.device)
        ids = torch.cat([torch.zeros(m, 3, device=x.device), image_ids(rows, cols, x.device), *ref_ids])
        rope = rope_tables(ids, cfg.axes_dims_rope)                                  # 2 x (S, D)

        def first(state):
            return self.transformer_blocks[0](*state, emb, rope)

        def rest(state):
            h, c = state
            del state
            for block in self.transformer_blocks[1:]:
                h, c = block(h, c, emb, rope)
            h = torch.cat([c, h], dim=1)                                             # (B, S, C)
            del c
            for block in self.single_transformer_blocks:
                h = block(h, emb, rope)
            return h[:, m:], h[:, :m]                                                # the streams again

        h, _ = run_blocks(first, rest, (h, c), cache)
        h = h[:, :n]                                                                  # (B, N, C): the image's
        scale, shift = self.norm_out(emb)
        h = self.proj_out(modulate(layer_norm(h), shift, scale))                    # (B, N, 64)
        out = unpack_latents(h, 2 * rows, 2 * cols)                                  # (B, 16, H or H + 1, ...)
        return out if (2 * rows, 2 * cols) == (hgt, wid) else out[:, :, :hgt, :wid]

    def _check_references(self, references, b: int) -> None:
        """Each reference a (1 or B, 16, h, w) latent (a clear error naming the reference)."""
        for i, ref in enumerate(references):
            if not isinstance(ref, torch.Tensor) or ref.ndim != 4 or ref.shape[0] not in (1, b) \
                    or ref.shape[1] != self.config.latent_channels:
                shape = list(ref.shape) if isinstance(ref, torch.Tensor) else type(ref).__name__
                raise RequestError(f"FLUX reference {i + 1} is {shape}: expected a latent (1 or {b}, "
                                   f"{self.config.latent_channels}, height, width)")

    def _check(self, x, t, context, pooled, guidance):
        """The inputs' shapes against the config (a clear error naming the input); timesteps and guidance, one per
        sample."""
        cfg = self.config
        if x.ndim != 4 or x.shape[1] != cfg.latent_channels:
            raise RequestError(f"FLUX latent has shape {list(x.shape)}: expected (batch, {cfg.latent_channels}, "
                               "height, width)")
        b = x.shape[0]
        if context.ndim != 3 or context.shape[0] != b or context.shape[2] != cfg.joint_attention_dim:
            raise RequestError(f"FLUX context has shape {list(context.shape)}: expected ({b}, tokens, "
                               f"{cfg.joint_attention_dim})")
        if tuple(pooled.shape) != (b, cfg.pooled_projection_dim):
            raise RequestError(f"FLUX pooled_projections has shape {list(pooled.shape)}: expected "
                               f"({b}, {cfg.pooled_projection_dim})")
        t = per_sample(t, b, x.device, "FLUX timesteps")
        if cfg.guidance_embeds:
            if guidance is None:
                raise RequestError("this FLUX transformer embeds the guidance scale (FLUX.1 dev): give guidance")
            guidance = per_sample(guidance, b, x.device, "FLUX guidance")
        elif guidance is not None:
            raise RequestError("this FLUX transformer has no guidance embedding (FLUX.1 schnell): it takes no "
                               "guidance scale")
        return t, guidance
