"""SD3's denoiser: the multimodal diffusion transformer, MMDiT (Esser et al. 2024, "Scaling Rectified Flow Transformers
for High-Resolution Image Synthesis"), with SD3.5's additions (RMS-normalised queries and keys; MMDiT-X's second
self-attention over the image tokens in the early blocks). Module names are those of diffusers'
``SD3Transformer2DModel`` state dict, so loading is a key-for-key copy (:mod:`sdlite.weights.mmdit_keys`).

The latent becomes image tokens (a strided convolution, one token per patch, plus positions cropped from the centre of
a sin-cos grid); the text embeddings become text tokens (one Linear). Each joint block modulates both streams by the
conditioning vector (timestep and pooled text), lets them attend to their joined sequence, and runs a feed-forward
on each; the last block only lends the text its keys and values. A final modulated norm and Linear give the velocity,
patch by patch. Shapes are written where they change: B batch, N image tokens, M text tokens, C width (hidden),
h heads, D head dim.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..config.mmdit import TIME_EMBED_CHANNELS, MMDiTConfig
from ..errors import RequestError
from ..kernels import bf16, fp32
from .layers import RMSNorm, TimestepEmbedding, residual, run_blocks, timestep_embedding

__all__ = ["MMDiT", "sincos_grid"]

NORM_EPS = 1e-6   # every LayerNorm and RMSNorm of the network


def sincos_grid(dim: int, grid: int, base_size: int) -> torch.Tensor:
    """The 2-D sin-cos positional table (1, grid * grid, dim), tokens row by row: the first half of the channels
    encodes the column, the second half the row, each as sines then cosines of ``dim // 4`` frequencies
    ``10000 ** (-i / (dim / 4))``. Positions are scaled so that ``base_size`` patches span 0 .. ``grid``: row ``i``
    sits at ``i / (grid / base_size)``. Positions are float32, the sines float64, the table float32."""
    pos = torch.arange(grid, dtype=torch.float32) / (grid / base_size)                # (grid,)
    omega = torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0)
    omega = 1.0 / 10000 ** omega                                                      # (dim/4,)
    angles = pos.double()[:, None] * omega[None]                                      # (grid, dim/4)
    axis = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).float()           # (grid, dim/2)
    cols = axis[None].expand(grid, grid, dim // 2)                                    # [row, col] -> col's code
    rows = axis[:, None].expand(grid, grid, dim // 2)                                 # [row, col] -> row's code
    return torch.cat([cols, rows], dim=-1).reshape(1, grid * grid, dim)


def modulate(h: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``h * (1 + scale) + shift`` per sample, for ``h`` (B, N, C) a fresh tensor nothing else holds and shift/scale
    (B, C); without gradients in place (the same two roundings, no second buffer)."""
    if torch.is_grad_enabled():
        return h * (1 + scale[:, None]) + shift[:, None]
    return h.mul_(1 + scale[:, None]).add_(shift[:, None])


def gated(branch: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``gate * branch`` per sample, for ``branch`` (B, N, C) a fresh tensor, in place without gradients."""
    return gate[:, None] * branch if torch.is_grad_enabled() else branch.mul_(gate[:, None])


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """LayerNorm over the channels without a learned scale or shift (the modulation gives them)."""
    return F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)


class PatchEmbed(nn.Module):
    """Patches to tokens (a ``patch_size``-strided convolution) plus their positions, cropped from the centre of the
    ``pos_embed_max_size``-square table ``pos_embed`` (a buffer the checkpoints carry)."""

    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.grid = cfg.pos_embed_max_size
        self.proj = nn.Conv2d(cfg.in_channels, cfg.hidden, cfg.patch_size, stride=cfg.patch_size)
        self.register_buffer("pos_embed", sincos_grid(cfg.hidden, cfg.pos_embed_max_size, cfg.base_size))

    def cropped_pos_embed(self, h: int, w: int) -> torch.Tensor:
        """The positions of an h x w grid of patches: (1, h*w, C)."""
        top, left = (self.grid - h) // 2, (self.grid - w) // 2
        table = self.pos_embed.view(1, self.grid, self.grid, -1)
        return table[:, top:top + h, left:left + w].reshape(1, h * w, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        x = self.proj(x).flatten(2).transpose(1, 2).contiguous()                     # (B, N, C)
        return x.add_(self.cropped_pos_embed(h, w))


class TimeTextEmbed(nn.Module):
    """The conditioning vector: an MLP on the timestep's sinusoidal embedding plus an MLP on the pooled text."""

    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIME_EMBED_CHANNELS, cfg.hidden)
        self.text_embedder = TimestepEmbedding(cfg.pooled_projection_dim, cfg.hidden)   # Linear, SiLU, Linear too

    def forward(self, t: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        emb = timestep_embedding(t, TIME_EMBED_CHANNELS, flip_sin_to_cos=True, shift=0.0).to(pooled.dtype)
        return self.timestep_embedder(emb) + self.text_embedder(pooled)                  # (B, C)


class AdaNorm(nn.Module):
    """The per-sample modulation of a norm: ``parts`` (B, C) vectors from a Linear on the (SiLU'd) conditioning.
    Six for a block (shift, scale, gate of the attention; of the feed-forward), nine with MMDiT-X's second
    attention, two (scale, shift) for a context-only block's text stream and for the output norm."""

    def __init__(self, dim: int, parts: int):
        super().__init__()
        self.parts = parts
        self.linear = nn.Linear(dim, parts * dim)

    def forward(self, emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(emb).chunk(self.parts, dim=1)


# fp32-fast runs a transformer's attention on sdlite's AVX2 kernel up to this head dim. Under the AVX2 cap on a 2-core
# Zen 4, medians of 5 (ms, kernel against PyTorch's SDPA): SD3.5's CFG batch (2, 24, 1357, 64) 156 against 181, at
# 1024^2 (2, 24, 4429, 64) 1713 against 2278; FLUX.1's head dim 128 (1, 24, 1536, 128) 206 against 214, at 1024^2
# (1, 24, 4352, 128) 1719 against 1602: PyTorch's keeps 128
FP32_KERNEL_MAX_HEAD_DIM = 64


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp32_kernels: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for q (B, h, L, D), k and v (B, h, L', D): (B, L, h*D). When marked, fp32 on AVX2
    runs sdlite's kernel up to :data:`FP32_KERNEL_MAX_HEAD_DIM` (:class:`sdlite.models.layers.Attention`); bf16 runs
    sdlite's bf16 kernel where it was measured faster than PyTorch's on this machine at a transformer's shape
    (:func:`sdlite.kernels.bf16.attention_pays` with ``"dit"``: on a 2-core Zen 4 59 ms against 140 ms at FLUX's
    (1, 24, 1280, 128), 71 ms against 184 ms at SD3.5's CFG batch (2, 24, 1357, 64); on a 2-core Xeon with AMX, before
    the kernel's AMX variant, PyTorch's had won at SD3's shapes, 0.15 s against 0.27 s); everything else PyTorch's."""
    out = None
    if fp32_kernels and q.shape[-1] <= FP32_KERNEL_MAX_HEAD_DIM:
        out = fp32.attend(q, k, v)
    elif q.dtype is torch.bfloat16 and bf16.attention_pays("dit"):
        out = bf16.attend(q, k, v)
    if out is None:
        b, h, n, d = q.shape
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, h * d)
    return out


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """:func:`attention` where some keys are padding (a batch of captions of different lengths: Qwen-Image's true
    CFG, Z-Image's): ``keep`` (B, L') booleans, True for a real key. In bf16, where sdlite's kernel pays, each sample
    attends to its own real keys with no mask on the kernel: the masked softmax's arithmetic (a pad's weight is
    exp(-inf) = 0) without PyTorch's masked SDPA, which ran a Qwen-Image-Edit CFG batch at 1024^2 ((2, 24, 8407, 128))
    at about 10 s a call on a 2-core Zen 4. Elsewhere (fp32: ``exact`` keeps diffusers' bits; shapes the kernel leaves)
    PyTorch's SDPA with the mask. Returns (B, L, h*D)."""
    if q.dtype is torch.bfloat16 and bf16.attention_pays("dit"):
        outs = []
        for i in range(q.shape[0]):
            real = keep[i].nonzero().squeeze(1)
            ki, vi = k[i:i + 1], v[i:i + 1]
            if len(real) < k.shape[2]:
                ki, vi = ki.index_select(2, real), vi.index_select(2, real)
            out = bf16.attend(q[i:i + 1], ki, vi)
            if out is None:
                break
            outs.append(out)
        else:
            return torch.cat(outs)
    b, h, n, d = q.shape
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :].to(torch.bool))
    return out.transpose(1, 2).reshape(b, n, h * d)


class JointAttention(nn.Module):
    """Attention over the image tokens joined by the text tokens (``context``: "joint", or "pre_only" in the last
    block, whose text tokens give keys and values only), or over the image tokens alone (MMDiT-X's ``attn2``).

    Each stream has its own q/k/v and output projections (the text's: ``add_*_proj``, ``to_add_out``) and, with
    ``qk_norm``, its own RMS norms of the queries and keys; the heads attend to the sequence [image, text].
    ``fp32_kernels``: as in :class:`sdlite.models.layers.Attention`."""
    fp32_kernels = False

    def __init__(self, dim: int, heads: int, qk_norm: bool, context: str | None):
        super().__init__()
        self.heads = heads
        self.context = context
        head_dim = dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        if qk_norm:
            self.norm_q = RMSNorm(head_dim, NORM_EPS)
            self.norm_k = RMSNorm(head_dim, NORM_EPS)
        if context is not None:
            self.add_q_proj = nn.Linear(dim, dim)
            self.add_k_proj = nn.Linear(dim, dim)
            self.add_v_proj = nn.Linear(dim, dim)
            if context == "joint":
                self.to_add_out = nn.Linear(dim, dim)
            if qk_norm:
                self.norm_added_q = RMSNorm(head_dim, NORM_EPS)
                self.norm_added_k = RMSNorm(head_dim, NORM_EPS)

    def _heads(self, proj: nn.Linear, x: torch.Tensor, norm: str | None = None) -> torch.Tensor:
        """One projection split into heads, (B, L, C) -> (B, h, L, D) (a view), RMS-normalised by the module
        ``norm`` where the block has it."""
        b, n, c = x.shape
        y = proj(x).view(b, n, self.heads, c // self.heads).transpose(1, 2)
        return getattr(self, norm)(y) if norm is not None and hasattr(self, norm) else y

    def forward(self, x: torch.Tensor, c: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = x.shape[1]
        q = self._heads(self.to_q, x, "norm_q")                                      # (B, h, N, D)
        k = self._heads(self.to_k, x, "norm_k")
        v = self._heads(self.to_v, x)
        if self.context is not None:
            # the joined sequence is the one copy (contiguous per head, which PyTorch's CPU kernel runs fastest).
            # A pre-only block's text queries give rows nobody reads, yet they are run: a query's result can differ
            # in the last bit with the number of queries beside it, and the output is to equal diffusers' bit for
            # bit; they cost M of N+M query rows in one block
            q = torch.cat([q, self._heads(self.add_q_proj, c, "norm_added_q")], dim=2)   # (B, h, N+M, D)
            k = torch.cat([k, self._heads(self.add_k_proj, c, "norm_added_k")], dim=2)
            v = torch.cat([v, self._heads(self.add_v_proj, c)], dim=2)
        out = attention(q, k, v, self.fp32_kernels)                                   # (B, N(+M), C)
        del q, k, v
        if self.context != "joint":
            return self.to_out[0](out[:, :n]), None
        return self.to_out[0](out[:, :n]), self.to_add_out(out[:, n:])                # (B, N, C), (B, M, C)


class FeedForward(nn.Module):
    """Linear to 4x the width, tanh-approximated GELU, Linear back (index 1 is the reference layout's dropout)."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.ModuleList([GELU(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x):
        return self.net[2](self.net[0](x))


class GELU(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x):
        h = self.proj(x)                                                                 # (B, L, 4C)
        if torch.is_grad_enabled():
            return F.gelu(h, approximate="tanh")
        return torch.ops.aten.gelu_(h, approximate="tanh")                              # the same values, in place


class JointBlock(nn.Module):
    """Both streams modulated (adaLN-Zero), joint attention, then a feed-forward on each, every branch gated.
    ``dual``: MMDiT-X's second self-attention over the image tokens, modulated from the same norm. ``pre_only``
    (the last block): the text stream is only read, through a two-part modulation (scale, shift)."""

    def __init__(self, cfg: MMDiTConfig, dual: bool, pre_only: bool):
        super().__init__()
        dim, heads, qk = cfg.hidden, cfg.num_attention_heads, cfg.qk_norm is not None
        self.pre_only = pre_only
        self.norm1 = AdaNorm(dim, 9 if dual else 6)
        self.norm1_context = AdaNorm(dim, 2 if pre_only else 6)
        self.attn = JointAttention(dim, heads, qk, "pre_only" if pre_only else "joint")
        if dual:
            self.attn2 = JointAttention(dim, heads, qk, None)
        self.ff = FeedForward(dim)
        if not pre_only:
            self.ff_context = FeedForward(dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, N, C) image tokens, c (B, M, C) text tokens, emb (B, C) the SiLU'd conditioning."""
        mod = self.norm1(emb)
        shift, scale, gate, shift_ff, scale_ff, gate_ff = mod[:6]
        if self.pre_only:
            c_scale, c_shift = self.norm1_context(emb)
        else:
            c_shift, c_scale, c_gate, c_shift_ff, c_scale_ff, c_gate_ff = self.norm1_context(emb)
        a, ca = self.attn(modulate(layer_norm(x), shift, scale), modulate(layer_norm(c), c_shift, c_scale))
        if hasattr(self, "attn2"):
            shift2, scale2, gate2 = mod[6:]
            h2 = modulate(layer_norm(x), shift2, scale2)     # from the block's input, as the first attention's
            x = residual(x, gated(a, gate))
            a2, _ = self.attn2(h2)
            x = residual(x, gated(a2, gate2))
        else:
            x = residual(x, gated(a, gate))
        x = residual(x, gated(self.ff(modulate(layer_norm(x), shift_ff, scale_ff)), gate_ff))
        if self.pre_only:
            return x, None
        c = residual(c, gated(ca, c_gate))
        c = residual(c, gated(self.ff_context(modulate(layer_norm(c), c_shift_ff, c_scale_ff)), c_gate_ff))
        return x, c


class MMDiT(nn.Module):
    """SD3's transformer: ``forward(x, t, context, pooled_projections, skip_layers=None)`` -> the velocity.

    Build it from a :class:`~sdlite.config.mmdit.MMDiTConfig` (``MMDiT(SD35_LARGE)``) and load a canonical state dict
    key for key (``load_state_dict``; :func:`sdlite.weights.mmdit_keys.load_mmdit` also takes Stability's single-file
    names). Inputs are cast to the weights' dtype; the output is in it."""

    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        self.config = cfg
        dim = cfg.hidden
        self.pos_embed = PatchEmbed(cfg)
        self.time_text_embed = TimeTextEmbed(cfg)
        self.context_embedder = nn.Linear(cfg.joint_attention_dim, cfg.caption_projection_dim)
        self.transformer_blocks = nn.ModuleList(
            JointBlock(cfg, dual=i in cfg.dual_attention_layers, pre_only=i == cfg.num_layers - 1)
            for i in range(cfg.num_layers))
        self.norm_out = AdaNorm(dim, 2)
        self.proj_out = nn.Linear(dim, cfg.patch_size ** 2 * cfg.out_channels)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of its weights; of the output layer's bias, which a weight kept in a GGUF block
        format leaves in it)."""
        return self.proj_out.bias.dtype

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, pooled_projections: torch.Tensor,
                skip_layers: Iterable[int] | None = None, cache=None) -> torch.Tensor:
        """x (B, in_channels, H, W) latent; t (B,) timesteps (sigma x 1000; a single value serves the batch);
        context (B, M, joint_attention_dim) text embeddings; pooled_projections (B, pooled_projection_dim).
        ``skip_layers``: indices of blocks not run (SD3.5's skip-layer guidance); ``cache`` a step cache's hook on the
        blocks (:func:`~sdlite.models.layers.run_blocks`; not used by a call that skips blocks). Returns
        (B, out_channels, H, W)."""
        dtype = self.dtype
        t = self._check(x, t, context, pooled_projections)
        skip = self._skip(skip_layers)
        b, _, hgt, wid = x.shape
        p = self.config.patch_size
        x = self.pos_embed(x.to(dtype))                                                  # (B, N, C)
        emb = F.silu(self.time_text_embed(t, pooled_projections.to(dtype)))               # (B, C)
        c = self.context_embedder(context.to(dtype))                                     # (B, M, C)
        blocks = [block for i, block in enumerate(self.transformer_blocks) if i not in skip]

        def first(state):
            return blocks[0](*state, emb) if blocks else state   # (skip-layer guidance may skip them all)

        def rest(state):
            x, c = state
            del state
            for block in blocks[1:]:
                x, c = block(x, c, emb)
            return x, c

        x, _ = run_blocks(first, rest, (x, c), None if skip else cache)
        scale, shift = self.norm_out(emb)
        x = self.proj_out(modulate(layer_norm(x), shift, scale))                         # (B, N, p*p*out)
        x = x.view(b, hgt // p, wid // p, p, p, self.config.out_channels)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(b, self.config.out_channels, hgt, wid)  # (B, out, H, W)

    def _skip(self, skip_layers: Iterable[int] | None) -> frozenset[int]:
        given = list(skip_layers or ())
        n = self.config.num_layers
        try:
            skip = frozenset(operator.index(i) for i in given)
        except TypeError:
            raise RequestError(f"skip_layers {given!r}: expected block indices (integers)") from None
        wrong = sorted(i for i in skip if not 0 <= i < n)
        if wrong:
            raise RequestError(f"skip_layers {wrong}: the MMDiT has blocks 0..{n - 1}")
        return skip

    def _check(self, x, t, context, pooled) -> torch.Tensor:
        """The inputs' shapes against the config (a clear error naming the input); the timesteps, one per sample."""
        cfg = self.config
        if x.ndim != 4 or x.shape[1] != cfg.in_channels:
            raise RequestError(f"MMDiT latent has shape {list(x.shape)}: expected (batch, {cfg.in_channels}, "
                               "height, width)")
        b, _, hgt, wid = x.shape
        p, grid = cfg.patch_size, cfg.pos_embed_max_size
        if hgt % p or wid % p:
            raise RequestError(f"MMDiT latent is {hgt}x{wid}: height and width must be multiples of the patch size "
                               f"{p}")
        if hgt // p > grid or wid // p > grid:
            raise RequestError(f"MMDiT latent is {hgt}x{wid} ({hgt // p}x{wid // p} patches of {p}), larger than "
                               f"the positional grid of {grid}x{grid} patches (pos_embed_max_size): at most "
                               f"{grid * p}x{grid * p} latent pixels")
        if context.ndim != 3 or context.shape[0] != b or context.shape[2] != cfg.joint_attention_dim:
            raise RequestError(f"MMDiT context has shape {list(context.shape)}: expected ({b}, tokens, "
                               f"{cfg.joint_attention_dim})")
        if tuple(pooled.shape) != (b, cfg.pooled_projection_dim):
            raise RequestError(f"MMDiT pooled_projections has shape {list(pooled.shape)}: expected "
                               f"({b}, {cfg.pooled_projection_dim})")
        t = torch.as_tensor(t, device=x.device)
        if t.ndim == 0:
            t = t.expand(b)
        if tuple(t.shape) != (b,):
            raise RequestError(f"MMDiT timesteps have shape {list(t.shape)}: expected ({b},) or a single value")
        return t
