"""The CLIP text transformer (Radford et al. 2021) that conditions Stable Diffusion.

One class serves both families through ``TextEncoderConfig``: OpenAI ViT-L/14 (SD 1.x: width 768, 12 layers,
12 heads, quick-GELU) and OpenCLIP ViT-H (SD 2.x: width 1024, 16 heads, GELU, run to its penultimate layer).
Module names follow the transformers ``CLIPTextModel`` layout (``text_model.*``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TextEncoderConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        h = self.heads
        q = self.q_proj(x).view(b, n, h, c // h).transpose(1, 2)     # (B, h, N, D)
        k = self.k_proj(x).view(b, n, h, c // h).transpose(1, 2)
        v = self.v_proj(x).view(b, n, h, c // h).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # each token sees itself and the past
        return self.out_proj(out.transpose(1, 2).reshape(b, n, c))


class MLP(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.width, cfg.mlp_width)
        self.fc2 = nn.Linear(cfg.mlp_width, cfg.width)
        self.act = quick_gelu if cfg.activation == "quick_gelu" else F.gelu

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=cfg.eps)
        self.self_attn = SelfAttention(cfg.width, cfg.heads)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Embedding(nn.Embedding):
    """``nn.Embedding`` that skips its random initialisation on the meta device.

    The loader builds every network on the meta device before it assigns the checkpoint's tensors. There,
    ``nn.Embedding``'s ``normal_`` initialisation goes through a Python reference kernel whose first call imports
    ``torch._dynamo``: more than a second for values that never exist. Elsewhere (real tensors) the
    initialisation is PyTorch's, unchanged.
    """

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


class Embeddings(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.token_embedding = Embedding(cfg.vocab_size, cfg.width)
        self.position_embedding = Embedding(cfg.max_positions, cfg.width)

    def forward(self, ids, replace=None):
        """``replace``: ``(row, position, vectors)`` triples whose (n, width) vectors stand in for the token
        embeddings of ``ids[row, position:position + n]`` (textual-inversion embeddings), before the position
        embeddings are added."""
        ids = ids.to(self.token_embedding.weight.device)
        x = self.token_embedding(ids)
        for row, position, vectors in replace or ():
            x[row, position:position + len(vectors)] = vectors.to(x)
        return x + self.position_embedding.weight[: ids.shape[1]]


class Encoder(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))


class TextTransformer(nn.Module):
    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.width, eps=cfg.eps)


class CLIPTextEncoder(nn.Module):
    """Token ids (B, 77) -> context (B, 77, width) for the UNet's cross-attention.

    ``projection``: the model has transformers' ``text_projection`` (``CLIPTextModelWithProjection``, SDXL's
    second encoder), which maps the pooled output to ``cfg.projection_dim``.
    """

    def __init__(self, cfg: TextEncoderConfig, projection: bool = False):
        super().__init__()
        self.config = cfg
        self.text_model = TextTransformer(cfg)
        if projection:
            self.text_projection = nn.Linear(cfg.width, cfg.projection_dim, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.text_model.final_layer_norm.weight.dtype

    def forward(self, ids: torch.Tensor, clip_skip: int = 1, replace=None) -> torch.Tensor:
        """``clip_skip`` counts as A1111 does: 1 = the last layer (no skip), 2 = the one before it, ...

        The chosen layer's hidden state goes through the final LayerNorm, as in A1111 and diffusers
        (diffusers numbers the same choice one lower: its ``clip_skip=1`` is our 2). ``replace``: token
        embeddings to substitute (see :meth:`Embeddings.forward`).
        """
        return self.encode(ids, clip_skip, replace=replace)

    def encode(self, ids: torch.Tensor, clip_skip: int = 1, final_norm: bool = True, pooled: bool = False,
               replace=None):
        """The hidden state after the layer ``clip_skip`` picks (A1111 numbering, as :meth:`forward`), through
        the final LayerNorm or not (SDXL conditions on the penultimate state without it: ``clip_skip=2,
        final_norm=False``). ``pooled``: also return the pooled output, the last layer's normalised state at each
        row's end-of-text token, through ``text_projection`` when the model has one (SDXL's pooled text
        embedding); all layers then run."""
        layers = self.text_model.encoder.layers
        if not 1 <= clip_skip <= len(layers):
            raise ValueError(f"clip_skip={clip_skip} is out of range: this text encoder has {len(layers)} "
                             f"layers, so 1..{len(layers)} are valid")
        keep = len(layers) - clip_skip              # index of the layer whose output is returned
        x = self.text_model.embeddings(ids, replace)
        hidden = None
        for i, layer in enumerate(layers[: len(layers) if pooled else keep + 1]):
            x = layer(x)
            if i == keep:
                hidden = x
        if final_norm:
            hidden = self.text_model.final_layer_norm(hidden)
        if not pooled:
            return hidden
        last = self.text_model.final_layer_norm(x)
        # the end-of-text position, as transformers finds it: configs written before it had eos_token_id (which
        # say 2) take the largest id, which is <|endoftext|> in CLIP's vocabulary; the others its first occurrence
        eos = self.config.eos_token_id
        where = ids.argmax(-1) if eos == 2 else (ids == eos).int().argmax(-1)
        out = last[torch.arange(last.shape[0], device=last.device), where.to(last.device)]
        if hasattr(self, "text_projection"):
            out = self.text_projection(out)
        return hidden, out
