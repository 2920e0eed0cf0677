"""FLUX.2's denoiser (Black Forest Labs 2025, FLUX.2 [dev] and [klein]): a rectified-flow transformer of double-stream
blocks (image and text tokens each with their own weights, one joint attention) followed by single-stream blocks (one
sequence, attention and a SwiGLU MLP from one fused projection), rotary positions over four axes of token ids
(t, h, w, l), and one conditioning vector (the timestep's embedding, plus in [dev] the distilled guidance scale's) from
which three modulations are computed once and shared by all blocks. No Linear has a bias. Module names are those of
diffusers' ``Flux2Transformer2DModel`` state dict, so loading is a key-for-key copy; BFL's names (fused qkv of the
double blocks, ``linear1`` / ``linear2`` of the single blocks) are mapped by :mod:`sdlite.weights.flux2_keys`.

Two entry points:

* :meth:`Flux2.forward` takes the sampler's latent: the VAE's 32-channel latent cut into 2 x 2 patches of 128 values
  (channels outermost) and normalised by the VAE's batch-norm statistics, i.e. (B, 128, H/16, W/16) for an H x W
  image, as diffusers' Flux2 pipelines hold it between steps (the patching and the normalisation are the VAE's side:
  :mod:`sdlite.models.flux2_vae`). It packs the tokens and builds the ids as the pipelines do (text token j at
  (0, 0, 0, j), the patch at row r, column c at (0, r, c, 0), reference image i's patches at (10 (i + 1), r, c, 0)),
  and returns the velocity in the latent's shape.
* :meth:`Flux2.tokens` is diffusers' forward contract: packed tokens (B, N, 128), text states, the timestep / 1000,
  the ids (S, 4) or (B, S, 4), the guidance scale; returns (B, N, 128).

The order of operations is diffusers', so fp32 results are the same bits. Shapes are written where they change: B batch,
N image tokens, M text tokens, S = M + N, C width, h heads, D head dim, F the MLP's inner width.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config.flux2 import REFERENCE_TIME_STEP, Flux2Config
from ..errors import RequestError
from .flux import rotate
from .layers import per_sample, residual, rotate_joined, run_blocks, timestep_embedding
from .mmdit import attention, gated, modulate

__all__ = ["Flux2", "pack", "unpack", "image_ids", "text_ids", "rope_tables"]


# --- latents, tokens and ids ---------------------------------------------------------------------------------


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C): one token per position, rows in order."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of :func:`pack` for an h x w grid: (B, h*w, C) -> (B, C, h, w)."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, h, w)


def image_ids(h: int, w: int, t: int = 0, device=None) -> torch.Tensor:
    """The ids (h*w, 4) of an h x w grid of tokens, row by row: (t, row, column, 0), int64."""
    ids = torch.zeros(h, w, 4, dtype=torch.int64, device=device)
    ids[..., 0] = t
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(h * w, 4)


def text_ids(m: int, device=None) -> torch.Tensor:
    """The ids (m, 4) of m text tokens: token j at (0, 0, 0, j), int64."""
    ids = torch.zeros(m, 4, dtype=torch.int64, device=device)
    ids[:, 3] = torch.arange(m, device=device)
    return ids


def rope_tables(ids: torch.Tensor, axes: Sequence[int], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (S, D) of the rotary embedding for ``ids`` (S, len(axes)): axis ``a`` takes ``axes[a]``
    channels, frequencies ``theta ** (-2i / axes[a])`` and angles in float64 (positions float32 first), each angle's
    cos and sin repeated for the channel pair it rotates; float32."""
    cos, sin = [], []
    pos = ids.float()
    for a, dim in enumerate(axes):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles = torch.outer(pos[:, a], freqs)                                       # (S, dim/2), float64
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


# --- layers --------------------------------------------------------------------------------------------------


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the channels without a learned scale or shift (the modulations give them)."""
    return F.layer_norm(x, x.shape[-1:], eps=eps)


def _clip_half(x: torch.Tensor) -> torch.Tensor:
    """fp16 activations held inside fp16's range, where the reference clips them."""
    return x.clamp_(-65504, 65504) if x.dtype == torch.float16 else x


class QKNorm(nn.Module):
    """RMS normalisation of each head's queries or keys with a learned scale (PyTorch's ``rms_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Embedder(nn.Module):
    """Linear -> SiLU -> Linear, no biases: the timestep's and the guidance scale's MLPs."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeGuidanceEmbed(nn.Module):
    """The conditioning vector: the timestep's sinusoidal embedding through its MLP, plus ([dev]) the guidance
    scale's through its own."""

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        self.channels = cfg.timestep_guidance_channels
        self.timestep_embedder = Embedder(self.channels, cfg.hidden)
        if cfg.guidance_embeds:
            self.guidance_embedder = Embedder(self.channels, cfg.hidden)

    def forward(self, t: torch.Tensor, guidance: torch.Tensor | None) -> torch.Tensor:
        """t (B,) and guidance (B,), both already x 1000 in the compute dtype -> (B, C)."""
        emb = self.timestep_embedder(timestep_embedding(t, self.channels, True, 0.0).to(t.dtype))
        if guidance is not None:
            emb = emb + self.guidance_embedder(timestep_embedding(guidance, self.channels, True, 0.0).to(t.dtype))
        return emb


class Modulation(nn.Module):
    """One shared modulation: ``sets`` x (shift, scale, gate) from the SiLU'd conditioning vector, (B, 3 sets C)."""

    def __init__(self, dim: int, sets: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * 3 * sets, bias=False)

    def forward(self, emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """emb (B, C), SiLU'd -> 3 sets tensors (B, C)."""
        out = self.linear(emb)
        return out.chunk(out.shape[-1] // emb.shape[-1], dim=-1)


class FeedForward(nn.Module):
    """SwiGLU: one Linear to 2F (the gate half first), SiLU(gate) x value, one Linear back."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * inner, bias=False)
        self.linear_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(_swiglu(self.linear_in(x)))                          # (B, L, 2F) -> (B, L, C)


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    """(..., 2F) -> (..., F): SiLU of the first half times the second."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, L, C) -> (B, L, h, D), a view."""
    return x.unflatten(-1, (-1, head_dim))


class JointAttention(nn.Module):
    """A double-stream block's attention: q/k/v of the image stream (``to_*``) and of the text stream
    (``add_*_proj``), each head's queries and keys RMS-normalised; rotary positions on the joined sequence [text,
    image]; one attention over it; each stream's part projected back by its own Linear. ``fp32_kernels``: as in
    :class:`sdlite.models.layers.Attention`."""
    fp32_kernels = False

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        dim, self.head_dim = cfg.hidden, cfg.attention_head_dim
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.norm_q = QKNorm(self.head_dim, cfg.eps)
        self.norm_k = QKNorm(self.head_dim, cfg.eps)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])
        self.add_q_proj = nn.Linear(dim, dim, bias=False)
        self.add_k_proj = nn.Linear(dim, dim, bias=False)
        self.add_v_proj = nn.Linear(dim, dim, bias=False)
        self.norm_added_q = QKNorm(self.head_dim, cfg.eps)
        self.norm_added_k = QKNorm(self.head_dim, cfg.eps)
        self.to_add_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x (B, N, C) image tokens, c (B, M, C) text tokens -> (image (B, N, C), text (B, M, C))."""
        d = self.head_dim
        q = self.norm_q(_heads(self.to_q(x), d))                                    # (B, N, h, D)
        k = self.norm_k(_heads(self.to_k(x), d))
        v = _heads(self.to_v(x), d)
        q = rotate_joined([self.norm_added_q(_heads(self.add_q_proj(c), d)), q], *rope)   # (B, S, h, D)
        k = rotate_joined([self.norm_added_k(_heads(self.add_k_proj(c), d)), k], *rope)
        v = torch.cat([_heads(self.add_v_proj(c), d), v], dim=1)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.fp32_kernels)  # (B, S, C)
        del q, k, v
        m = c.shape[1]
        return self.to_out[0](out[:, m:]), self.to_add_out(out[:, :m])


class ParallelAttention(nn.Module):
    """A single-stream block's attention and MLP side by side: one Linear makes q, k, v and the SwiGLU's input
    (``to_qkv_mlp_proj``: 3C + 2F rows), one Linear projects the attention's output and the MLP's together back
    (``to_out``: C + F columns)."""
    fp32_kernels = False

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        dim, self.head_dim, self.mlp_hidden = cfg.hidden, cfg.attention_head_dim, cfg.mlp_hidden
        self.to_qkv_mlp_proj = nn.Linear(dim, 3 * dim + 2 * self.mlp_hidden, bias=False)
        self.norm_q = QKNorm(self.head_dim, cfg.eps)
        self.norm_k = QKNorm(self.head_dim, cfg.eps)
        self.to_out = nn.Linear(dim + self.mlp_hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (B, S, C) the modulated tokens -> (B, S, C)."""
        d, width = self.head_dim, x.shape[-1]
        proj = self.to_qkv_mlp_proj(x)                                               # (B, S, 3C + 2F)
        qkv, mlp = proj.split([3 * width, proj.shape[-1] - 3 * width], dim=-1)
        q, k, v = qkv.chunk(3, dim=-1)                                              # 3 x (B, S, C)
        q, k, v = self.norm_q(_heads(q, d)), self.norm_k(_heads(k, d)), _heads(v, d)   # (B, S, h, D)
        q, k = rotate(q, *rope), rotate(k, *rope)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.fp32_kernels)  # (B, S, C)
        del q, k, v, qkv
        mlp = _swiglu(mlp)                                                           # (B, S, F)
        del proj
        return self.to_out(torch.cat([out, mlp], dim=-1))                            # (B, S, C + F) -> (B, S, C)


class DoubleBlock(nn.Module):
    """Both streams modulated by the shared modulations (shift, scale, gate of the attention; of the MLP), one joint
    attention, then a SwiGLU MLP on each; every branch gated. The norms have no weights."""

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        self.eps = cfg.eps
        self.attn = JointAttention(cfg)
        self.ff = FeedForward(cfg.hidden, cfg.mlp_hidden)
        self.ff_context = FeedForward(cfg.hidden, cfg.mlp_hidden)

    def forward(self, x, c, mod_x, mod_c, rope):
        """x (B, N, C), c (B, M, C); mod_x, mod_c six (B, C) each: the image's and the text's modulations."""
        shift, scale, gate, shift_ff, scale_ff, gate_ff = mod_x
        c_shift, c_scale, c_gate, c_shift_ff, c_scale_ff, c_gate_ff = mod_c
        eps = self.eps
        a, ca = self.attn(modulate(_layer_norm(x, eps), shift, scale),
                          modulate(_layer_norm(c, eps), c_shift, c_scale), rope)
        x = residual(x, gated(a, gate))
        x = residual(x, gated(self.ff(modulate(_layer_norm(x, eps), shift_ff, scale_ff)), gate_ff))
        c = residual(c, gated(ca, c_gate))
        c = residual(c, gated(self.ff_context(modulate(_layer_norm(c, eps), c_shift_ff, c_scale_ff)), c_gate_ff))
        return x, _clip_half(c)


class SingleBlock(nn.Module):
    """One sequence [text, image], modulated by the shared single-stream modulation (shift, scale, gate); the
    parallel attention and MLP; gated."""

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        self.eps = cfg.eps
        self.attn = ParallelAttention(cfg)

    def forward(self, h, mod, rope):
        """h (B, S, C); mod three (B, C)."""
        shift, scale, gate = mod
        out = self.attn(modulate(_layer_norm(h, self.eps), shift, scale), rope)
        return _clip_half(residual(h, gated(out, gate)))


class OutputNorm(nn.Module):
    """The output's LayerNorm, scaled and shifted by (scale, shift) from the SiLU'd conditioning vector (diffusers'
    ``AdaLayerNormContinuous`` order: scale first)."""

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        self.eps = cfg.eps
        self.linear = nn.Linear(cfg.hidden, 2 * cfg.hidden, bias=False)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(emb.to(h.dtype)).chunk(2, dim=1)
        return modulate(_layer_norm(h, self.eps), shift, scale)


# --- the network ---------------------------------------------------------------------------------------------


class Flux2(nn.Module):
    """FLUX.2's transformer: ``forward(x, t, context, guidance=None, references=())`` -> the velocity.

    Build it from a :class:`~sdlite.config.flux2.Flux2Config` and load a canonical (diffusers) state dict key for key.
    Inputs are cast to the weights' dtype; the output is in it."""

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        self.config = cfg
        dim = cfg.hidden
        self.time_guidance_embed = TimeGuidanceEmbed(cfg)
        self.double_stream_modulation_img = Modulation(dim, 2)
        self.double_stream_modulation_txt = Modulation(dim, 2)
        self.single_stream_modulation = Modulation(dim, 1)
        self.x_embedder = nn.Linear(cfg.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(cfg.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(DoubleBlock(cfg) for _ in range(cfg.num_layers))
        self.single_transformer_blocks = nn.ModuleList(SingleBlock(cfg) for _ in range(cfg.num_single_layers))
        self.norm_out = OutputNorm(cfg)
        self.proj_out = nn.Linear(dim, cfg.out_channels, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: that of the first block's query norm (a 1-D weight, which a Linear's weight kept in a
        quantized storage form leaves in the compute dtype; no Linear here has a bias)."""
        return self.transformer_blocks[0].attn.norm_q.weight.dtype

    def forward(self, x: torch.Tensor, t: torch.Tensor | float, context: torch.Tensor,
                guidance: torch.Tensor | float | None = None,
                references: Sequence[torch.Tensor] = (), cache=None) -> torch.Tensor:
        """x (B, in_channels, h, w): the sampler's latent (the VAE latent patchified, 128 values a position); t (B,)
        or one value: the timestep / 1000 (sigma) as the pipelines hand it to the network; context (B, M,
        joint_attention_dim) the stacked LLM states; ``guidance`` the distilled guidance scale ([dev]: required;
        [klein]: none); ``references`` the editing images' latents, each (in_channels, h_i, w_i) or (1 or B,
        in_channels, h_i, w_i), shared by the batch: their tokens join the image's with t ids 10, 20, ... and are
        not returned; ``cache`` a step cache's hook on the blocks (:func:`~sdlite.models.layers.run_blocks`; None:
        none). Returns (B, out_channels, h, w)."""
        cfg = self.config
        if x.ndim != 4 or x.shape[1] != cfg.in_channels:
            raise RequestError(f"FLUX.2 latent has shape {list(x.shape)}: expected (batch, {cfg.in_channels}, "
                               "height, width) (the VAE latent patchified 2x2)")
        b, _, hgt, wid = x.shape
        tokens, ids = [pack(x)], [image_ids(hgt, wid, 0, x.device)]
        for i, ref in enumerate(references):
            ref = ref[None] if ref.ndim == 3 else ref
            if ref.ndim != 4 or ref.shape[1] != cfg.in_channels or ref.shape[0] not in (1, b):
                raise RequestError(f"FLUX.2 reference {i} has shape {list(ref.shape)}: expected ({cfg.in_channels}, "
                                   f"height, width) or (1 or {b}, {cfg.in_channels}, height, width)")
            tokens.append(pack(ref.to(x.dtype)).expand(b, -1, -1))
            ids.append(image_ids(ref.shape[2], ref.shape[3], REFERENCE_TIME_STEP * (i + 1), x.device))
        if context.ndim != 3:
            raise RequestError(f"FLUX.2 context has shape {list(context.shape)}: expected ({b}, tokens, "
                               f"{cfg.joint_attention_dim})")
        out = self.tokens(torch.cat(tokens, dim=1) if len(tokens) > 1 else tokens[0], context, t, torch.cat(ids),
                          text_ids(context.shape[1], x.device), guidance, cache)     # (B, N + refs, out)
        return unpack(out[:, :hgt * wid], hgt, wid)

    def tokens(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor | float,
               img_ids: torch.Tensor, txt_ids: torch.Tensor,
               guidance: torch.Tensor | float | None = None, cache=None) -> torch.Tensor:
        """diffusers' ``Flux2Transformer2DModel.forward`` contract. hidden_states (B, N, in_channels) packed image
        tokens; encoder_hidden_states (B, M, joint_attention_dim); timestep (B,) or one value, the timestep / 1000;
        img_ids (N, 4) or (B, N, 4) and txt_ids (M, 4) or (B, M, 4), the same for every sample; guidance the scale
        ([dev] only). Returns (B, N, out_channels)."""
        dtype = self.dtype
        t, guidance, rope = self._check(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance)
        m = encoder_hidden_states.shape[1]
        t = t.to(dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(dtype) * 1000
        emb = F.silu(self.time_guidance_embed(t, guidance))                          # (B, C)
        mod_x = self.double_stream_modulation_img(emb)                               # 6 x (B, C)
        mod_c = self.double_stream_modulation_txt(emb)
        mod_s = self.single_stream_modulation(emb)                                   # 3 x (B, C)
        h = self.x_embedder(hidden_states.to(dtype))                                 # (B, N, C)
        c = self.context_embedder(encoder_hidden_states.to(dtype))                   # (B, M, C)

        def first(state):
            return self.transformer_blocks[0](*state, mod_x, mod_c, rope)

        def rest(state):
            h, c = state
            del state
            for block in self.transformer_blocks[1:]:
                h, c = block(h, c, mod_x, mod_c, rope)
            h = torch.cat([c, h], dim=1)                                             # (B, S, C)
            del c
            for block in self.single_transformer_blocks:
                h = block(h, mod_s, rope)
            return h[:, m:], h[:, :m]                                                # the streams again

        h, _ = run_blocks(first, rest, (h, c), cache)                                # (num_layers >= 1)
        h = self.norm_out(h, emb)                                                    # (B, N, C)
        return self.proj_out(h)                                                      # (B, N, out_channels)

    def _check(self, x, context, t, img_ids, txt_ids, guidance):
        """The inputs' shapes against the config (a clear error naming the input); timesteps and guidance, one per
        sample; the rotary tables of [text, image]."""
        cfg = self.config
        if x.ndim != 3 or x.shape[2] != cfg.in_channels:
            raise RequestError(f"FLUX.2 image tokens have shape {list(x.shape)}: expected (batch, tokens, "
                               f"{cfg.in_channels})")
        b, n = x.shape[:2]
        if context.ndim != 3 or context.shape[0] != b or context.shape[2] != cfg.joint_attention_dim:
            raise RequestError(f"FLUX.2 context has shape {list(context.shape)}: expected ({b}, tokens, "
                               f"{cfg.joint_attention_dim})")
        ids = torch.cat([_ids(txt_ids, context.shape[1], cfg.axes, "txt_ids"), _ids(img_ids, n, cfg.axes, "img_ids")])
        t = per_sample(t, b, x.device, "FLUX.2 timesteps")
        if cfg.guidance_embeds:
            if guidance is None:
                raise RequestError("this FLUX.2 transformer embeds the guidance scale (FLUX.2 [dev]): give guidance")
            guidance = per_sample(guidance, b, x.device, "FLUX.2 guidance")
        elif guidance is not None:
            raise RequestError("this FLUX.2 transformer has no guidance embedding (FLUX.2 [klein]): it takes no "
                               "guidance scale")
        return t, guidance, rope_tables(ids.to(x.device), cfg.axes_dims_rope, cfg.rope_theta)


def _ids(ids: torch.Tensor, length: int, axes: int, what: str) -> torch.Tensor:
    """Position ids (length, axes) from (length, axes) or (B, length, axes) the same for every sample."""
    if ids.ndim == 3:
        if ids.shape[0] > 1 and not torch.equal(ids, ids[:1].expand_as(ids)):
            raise RequestError(f"FLUX.2 {what} differ between the samples of the batch: the network takes one set")
        ids = ids[0]
    if tuple(ids.shape) != (length, axes):
        raise RequestError(f"FLUX.2 {what} have shape {list(ids.shape)}: expected ({length}, {axes})")
    return ids
