"""Z-Image's denoiser (Tongyi-MAI 2025, "Z-Image: An Efficient Image Generation Foundation Model with Single-Stream
Diffusion Transformer"): the S3-DiT. Image patches and caption tokens are each refined by their own blocks (the
image's modulated by the timestep, the caption's not), then run as one sequence [image, caption] through the joint
blocks; 3-axis rotary positions; every block RMS-normed before and after its attention and its SwiGLU feed-forward.
Module names are those of diffusers' ``ZImageTransformer2DModel`` state dict, so loading is a key-for-key copy;
ComfyUI's names (fused ``attention.qkv``, ``x_embedder``, ``final_layer``) are mapped by
:mod:`sdlite.weights.zimage_keys`.

The network takes the VAE latent (B, 16, H, W), a timestep per sample and the captions, and does the work that
diffusers' model does on its lists itself: 2 x 2 patches become tokens of 64 values, each sequence is padded to a
multiple of 32 tokens with its learned pad token, samples whose captions differ in length are batched with an attention
mask over the batch's padding. The order of operations is diffusers', so fp32 results are the same bits. A latent of an
odd side (ComfyUI's, of a side that is a multiple of 8 pixels but not of 16; the pipelines draw none) is padded as
ComfyUI's NextDiT pads it (:func:`~sdlite.models.layers.pad_to_patches`), its positions those of the padded grid, the
output cropped back.

Shapes are written where they change: B batch, N image tokens (Np padded), L caption tokens (Lp padded to 32, Lm the
batch's longest), S joint sequence, C width (dim), h heads, D head dim.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..config.zimage import ZImageConfig
from ..errors import RequestError
from .layers import (RMSNorm, pad_to_patches, pair_tables, per_sample, residual, rotate_pairs, run_blocks,
                     timestep_embedding)
from .mmdit import attention, padded_attention

__all__ = ["ZImage", "rope_freqs", "image_ids", "caption_ids", "padded_length"]


def padded_length(n: int, multiple: int = ZImageConfig.SEQ_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (32: how many tokens a caption or an image occupies)."""
    return n + (-n) % multiple


def caption_ids(length: int, device=None) -> torch.Tensor:
    """The position ids (length, 3) of a caption padded to ``length`` tokens: (1 + j, 0, 0), pad tokens included."""
    ids = torch.zeros(length, 3, dtype=torch.int64, device=device)
    ids[:, 0] = torch.arange(1, length + 1, device=device)
    return ids


def image_ids(rows: int, cols: int, padded: int, start: int, device=None) -> torch.Tensor:
    """The position ids (padded, 3) of a rows x cols grid of patches, row by row, after a caption of ``start - 1``
    (padded) tokens: (start, row, column); the pad tokens after the grid (0, 0, 0)."""
    ids = torch.zeros(padded, 3, dtype=torch.int64, device=device)
    n = rows * cols
    ids[:n, 0] = start
    ids[:n, 1] = torch.arange(rows, device=device).repeat_interleave(cols)
    ids[:n, 2] = torch.arange(cols, device=device).repeat(rows)
    return ids


def rope_freqs(ids: torch.Tensor, axes: Sequence[int], theta: float) -> torch.Tensor:
    """The rotary factors of positions ``ids`` (S, len(axes)): (S, sum(axes) / 2) complex64, axis ``a`` taking
    ``axes[a] / 2`` of them, ``exp(i * pos * theta ** (-2k / axes[a]))``; the angles are products in float64 rounded to
    float32 (the values of diffusers' tables, which it indexes by position)."""
    out = []
    for a, dim in enumerate(axes):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles = torch.outer(ids[:, a].to(torch.float64), freqs).float()            # (S, dim/2)
        out.append(torch.polar(torch.ones_like(angles), angles))
    return torch.cat(out, dim=-1)


def rotate(x: torch.Tensor, freqs) -> torch.Tensor:
    """The rotary embedding on x (B, S, h, D): each channel pair as a complex number times its factor (B, S, D/2),
    in fp32 and returned in x's dtype; ``freqs`` as :func:`_tables` made them for bf16 (real and imaginary parts
    repeated per pair: sdlite's kernel, the same products)."""
    if isinstance(freqs, tuple):
        return rotate_pairs(x, *freqs)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))          # (B, S, h, D/2)
    return torch.view_as_real(pairs * freqs.unsqueeze(2)).flatten(3).type_as(x)


def _tables(freqs: torch.Tensor, dtype: torch.dtype):
    """The factors as the blocks take them: for bf16 on a CPU the pair tables sdlite's rotary kernel reads
    (:func:`~sdlite.models.layers.pair_tables`), made once a call; else the complex factors as they are."""
    return pair_tables(freqs) if dtype is torch.bfloat16 and freqs.device.type == "cpu" else freqs


class Attention(nn.Module):
    """Self-attention over one sequence: q, k, v without bias, each head's queries and keys RMS-normed (``qk_norm``),
    rotary positions, attention (:func:`sdlite.models.mmdit.attention`; with a batch's padding, PyTorch's
    scaled_dot_product_attention with it masked out), an output projection without bias."""

    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        dim = cfg.dim
        self.heads = cfg.n_heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        if cfg.qk_norm:
            self.norm_q = RMSNorm(cfg.head_dim, cfg.QK_NORM_EPS)
            self.norm_k = RMSNorm(cfg.head_dim, cfg.QK_NORM_EPS)
        else:
            self.norm_q = self.norm_k = None
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, S, C); freqs (B, S, D/2) complex; mask (B, S) bool, True where a token is real (None: all are)."""
        q = self.to_q(x).unflatten(-1, (self.heads, -1))                            # (B, S, h, D)
        k = self.to_k(x).unflatten(-1, (self.heads, -1))
        v = self.to_v(x).unflatten(-1, (self.heads, -1))
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k = rotate(q, freqs), rotate(k, freqs)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)   # (B, h, S, D)
        if mask is None:   # no padding: the transformers' attention (bf16: sdlite's kernel where it was faster)
            out = attention(q, k, v, False)                                         # (B, S, C)
        else:   # captions of different lengths: each sample's own keys (mmdit.padded_attention)
            out = padded_attention(q, k, v, mask)                                   # (B, S, C)
        del q, k, v
        return self.to_out[0](out.to(x.dtype))                                      # (B, S, C)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``, no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Attention and feed-forward, each between an RMS pre-norm and an RMS post-norm, added to the residual stream.
    Modulated (the noise refiner and the joint blocks): the pre-norms scaled by ``1 + scale``, the branches gated by
    ``tanh(gate)``, four vectors from ``adaLN_modulation`` on the timestep embedding. Unmodulated: the context
    refiner."""

    def __init__(self, cfg: ZImageConfig, modulation: bool):
        super().__init__()
        dim, eps = cfg.dim, cfg.norm_eps
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(dim, cfg.ffn_hidden)
        self.attention_norm1 = RMSNorm(dim, eps)
        self.ffn_norm1 = RMSNorm(dim, eps)
        self.attention_norm2 = RMSNorm(dim, eps)
        self.ffn_norm2 = RMSNorm(dim, eps)
        self.modulation = modulation
        if modulation:
            self.adaLN_modulation = nn.Sequential(nn.Linear(cfg.adaln_dim, 4 * dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, freqs: torch.Tensor,
                emb: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, S, C); emb (B, adaln_dim) the timestep embedding (modulated blocks only)."""
        if not self.modulation:
            x = residual(x, self.attention_norm2(self.attention(self.attention_norm1(x), freqs, mask)))
            return residual(x, self.ffn_norm2(self.feed_forward(self.ffn_norm1(x))))
        scale_attn, gate_attn, scale_ffn, gate_ffn = self.adaLN_modulation(emb).unsqueeze(1).chunk(4, dim=2)
        gate_attn, gate_ffn = gate_attn.tanh(), gate_ffn.tanh()                     # (B, 1, C) each
        scale_attn, scale_ffn = 1.0 + scale_attn, 1.0 + scale_ffn
        a = self.attention(self.attention_norm1(x) * scale_attn, freqs, mask)
        x = residual(x, gate_attn * self.attention_norm2(a))
        del a
        f = self.feed_forward(self.ffn_norm1(x) * scale_ffn)
        return residual(x, gate_ffn * self.ffn_norm2(f))


class FinalLayer(nn.Module):
    """LayerNorm without affine, scaled by ``1 + adaLN_modulation(emb)`` (SiLU then Linear), then the Linear to the
    patch values."""

    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        self.eps = cfg.FINAL_NORM_EPS
        self.linear = nn.Linear(cfg.dim, cfg.token_values)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.adaln_dim, cfg.dim))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.adaLN_modulation(emb)                                    # (B, C)
        x = F.layer_norm(x, x.shape[-1:], eps=self.eps) * scale.unsqueeze(1)
        return self.linear(x)                                                       # (B, S, 64)


class TimestepEmbedder(nn.Module):
    """The timestep embedding: an MLP (Linear, SiLU, Linear) on 256 sinusoidal channels (cosines first)."""

    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(cfg.FREQ_CHANNELS, cfg.T_EMBED_MID), nn.SiLU(),
                                 nn.Linear(cfg.T_EMBED_MID, cfg.adaln_dim))

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, ZImageConfig.FREQ_CHANNELS).to(dtype))


class ZImage(nn.Module):
    """Z-Image's transformer: ``forward(x, t, context, context_lengths=None)`` -> the network's output as diffusers'
    ``ZImageTransformer2DModel`` gives it (the negated flow velocity: ZImagePipeline negates it before the scheduler).

    Build it from a :class:`~sdlite.config.zimage.ZImageConfig` and load a canonical (diffusers) state dict key for
    key. Inputs are cast to the weights' dtype; the output is in it."""

    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        self.config = cfg
        dim, key = cfg.dim, cfg.patch_key
        self.all_x_embedder = nn.ModuleDict({key: nn.Linear(cfg.token_values, dim)})
        self.all_final_layer = nn.ModuleDict({key: FinalLayer(cfg)})
        self.noise_refiner = nn.ModuleList(Block(cfg, modulation=True) for _ in range(cfg.n_refiner_layers))
        self.context_refiner = nn.ModuleList(Block(cfg, modulation=False) for _ in range(cfg.n_refiner_layers))
        self.t_embedder = TimestepEmbedder(cfg)
        self.cap_embedder = nn.Sequential(RMSNorm(cfg.cap_feat_dim, cfg.norm_eps), nn.Linear(cfg.cap_feat_dim, dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.layers = nn.ModuleList(Block(cfg, modulation=True) for _ in range(cfg.n_layers))

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of the output layer's bias, which a weight kept in a GGUF block format leaves in
        its float dtype)."""
        return self.all_final_layer[self.config.patch_key].linear.bias.dtype

    def forward(self, x: torch.Tensor, t: torch.Tensor | float, context, context_lengths=None,
                cache=None) -> torch.Tensor:
        """x (B, 16, H, W) latent (an odd H or W padded as ComfyUI pads it, the output cropped back). ``t`` (B,) or
        one value: the timestep as ZImagePipeline hands it to the network, ``1 - sigma`` (0 at pure noise, 1 at the
        clean image). ``context``: the captions, Qwen3's hidden states of each prompt's real tokens, as the pipeline
        hands them: a list of B tensors (L_i, 2560); or one padded tensor (B, L, 2560) with ``context_lengths`` (B,)
        the real tokens of each (None: all L are).
        ``cache``: a step cache's hook on the main layers (:func:`~sdlite.models.layers.run_blocks`; None: none).
        Returns (B, 16, H, W): ``x0 - noise`` (the negated velocity), as diffusers' model returns it."""
        cfg = self.config
        dtype = self.dtype
        caps = self._captions(x, context, context_lengths)
        t = per_sample(t, x.shape[0], x.device, "Z-Image timesteps")
        b, c, hgt, wid = x.shape
        p, mult = cfg.patch_size, cfg.SEQ_MULTIPLE
        x = pad_to_patches(x, p)
        rows, cols = x.shape[2] // p, x.shape[3] // p
        n = rows * cols
        n_pad = padded_length(n, mult)
        cap_lens = [len(cap) for cap in caps]
        cap_pads = [padded_length(n_cap, mult) for n_cap in cap_lens]
        self._check_positions(rows, cols, max(cap_pads))
        emb = self.t_embedder(t.float() * cfg.t_scale, dtype).to(dtype)            # (B, adaln_dim)

        # image tokens: patches (rows of patches in order, each (ph, pw, c) flattened), the last one repeated to the
        # padded length; after the embedder the repeats become the pad token
        tokens = x.to(dtype).view(b, c, rows, p, cols, p).permute(0, 2, 4, 3, 5, 1).reshape(b, n, -1)
        if n_pad > n:
            tokens = torch.cat([tokens, tokens[:, -1:].expand(b, n_pad - n, tokens.shape[2])], dim=1)
        h = self.all_x_embedder[cfg.patch_key](tokens.reshape(b * n_pad, -1))       # (B*Np, C)
        del tokens
        real = torch.arange(n_pad, device=x.device).repeat(b) < n
        h = torch.where(real[:, None], h, self.x_pad_token).view(b, n_pad, -1)     # (B, Np, C)
        x_freqs = torch.stack([rope_freqs(image_ids(rows, cols, n_pad, lp + 1, x.device), cfg.axes_dims,
                                          cfg.rope_theta) for lp in cap_pads])       # (B, Np, D/2)
        refiner_freqs = _tables(x_freqs, dtype)
        for block in self.noise_refiner:
            h = block(h, None, refiner_freqs, emb)
        del refiner_freqs

        # caption tokens: the same padding, with the caption's pad token
        padded = [torch.cat([cap, cap[-1:].repeat(lp - n_cap, 1)]) for cap, n_cap, lp in zip(caps, cap_lens, cap_pads)]
        cap = self.cap_embedder(torch.cat(padded).to(dtype))                        # (sum Lp, C)
        del padded
        real = torch.cat([torch.arange(lp, device=x.device) < n_cap for n_cap, lp in zip(cap_lens, cap_pads)])
        cap = torch.where(real[:, None], cap, self.cap_pad_token)
        cap = pad_sequence(list(cap.split(cap_pads)), batch_first=True)            # (B, Lm, C)
        # the batch's padding rows get factors 0 (diffusers gives some of them 1): masked, they never reach a real row
        cap_freqs = pad_sequence([rope_freqs(caption_ids(lp, x.device), cfg.axes_dims, cfg.rope_theta)
                                  for lp in cap_pads], batch_first=True)            # (B, Lm, D/2)
        cap_mask = _mask(cap_pads, x.device)
        refiner_freqs = _tables(cap_freqs, dtype)
        for block in self.context_refiner:
            cap = block(cap, cap_mask, refiner_freqs)
        del refiner_freqs

        # the joint sequence [image, caption] of each sample, the batch padded to the longest
        h = pad_sequence([torch.cat([h[i], cap[i, :lp]]) for i, lp in enumerate(cap_pads)], batch_first=True)
        freqs = pad_sequence([torch.cat([x_freqs[i], cap_freqs[i, :lp]]) for i, lp in enumerate(cap_pads)],
                             batch_first=True)                                       # (B, S, D/2)
        del cap, x_freqs, cap_freqs
        freqs = _tables(freqs, dtype)
        mask = _mask([n_pad + lp for lp in cap_pads], x.device)

        def first(state):
            return (self.layers[0](state[0], mask, freqs, emb),)

        def rest(state):
            h, = state
            del state
            for block in self.layers[1:]:
                h = block(h, mask, freqs, emb)                                      # (B, S, C)
            return (h,)

        h, = run_blocks(first, rest, (h,), cache)
        out = self.all_final_layer[cfg.patch_key](h, emb)[:, :n]                    # (B, N, 64)
        out = out.reshape(b, rows, cols, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, rows * p, cols * p)
        return out if (rows * p, cols * p) == (hgt, wid) else out[:, :, :hgt, :wid]

    def _captions(self, x: torch.Tensor, context, lengths) -> list[torch.Tensor]:
        """The inputs' shapes against the config (a clear error naming the input); the captions as a list of
        (L_i, cap_feat_dim) tensors."""
        cfg = self.config
        if x.ndim != 4 or x.shape[1] != cfg.in_channels:
            raise RequestError(f"Z-Image latent has shape {list(x.shape)}: expected (batch, {cfg.in_channels}, "
                               "height, width)")
        b = x.shape[0]
        if torch.is_tensor(context):
            if context.ndim != 3 or context.shape[0] != b or context.shape[2] != cfg.cap_feat_dim:
                raise RequestError(f"Z-Image context has shape {list(context.shape)}: expected ({b}, tokens, "
                                   f"{cfg.cap_feat_dim}) or a list of {b} tensors (tokens, {cfg.cap_feat_dim})")
            if lengths is None:
                lengths = [context.shape[1]] * b
            lengths = [int(n) for n in torch.as_tensor(lengths).reshape(-1).tolist()]
            if len(lengths) != b or any(n < 1 or n > context.shape[1] for n in lengths):
                raise RequestError(f"Z-Image context_lengths {lengths}: expected {b} counts of real tokens, each "
                                   f"1..{context.shape[1]}")
            return [context[i, :n] for i, n in enumerate(lengths)]
        if lengths is not None:
            raise RequestError("Z-Image context_lengths goes with a padded context tensor, not with a list of captions")
        caps = list(context)
        if len(caps) != b:
            raise RequestError(f"Z-Image got {len(caps)} captions for a batch of {b} latents")
        for i, cap in enumerate(caps):
            if not torch.is_tensor(cap) or cap.ndim != 2 or cap.shape[0] < 1 or cap.shape[1] != cfg.cap_feat_dim:
                shape = list(cap.shape) if torch.is_tensor(cap) else type(cap).__name__
                raise RequestError(f"Z-Image caption {i} has shape {shape}: expected (tokens >= 1, "
                                   f"{cfg.cap_feat_dim})")
        return caps

    def _check_positions(self, rows: int, cols: int, longest_caption: int) -> None:
        """Positions beyond ``axes_lens`` have no rotary factors in the reference (an index error there)."""
        lens = self.config.axes_lens
        for what, top, bound in (("caption (padded to 32) plus one", longest_caption + 1, lens[0]),
                                 ("rows of 2x2 patches", rows - 1, lens[1]),
                                 ("columns of 2x2 patches", cols - 1, lens[2])):
            if top >= bound:
                raise RequestError(f"Z-Image positions: the {what} reach {top}, past the model's axes_lens "
                                   f"{list(lens)} (a longer caption or a larger image than it was built for)")


def _mask(lengths: list[int], device) -> torch.Tensor | None:
    """(B, longest) True over each sample's real tokens; None when all are the same length (nothing to mask)."""
    longest = max(lengths)
    if all(n == longest for n in lengths):
        return None
    return torch.arange(longest, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
