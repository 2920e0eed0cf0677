"""A BERT encoder (Devlin et al. 2018) as a Stable Diffusion text tower: Taiyi's Chinese RoBERTa-wwm, which keeps
BERT's architecture.

Token ids (B, N) -> last hidden state (B, N, width), the UNet's cross-attention context. Module names follow the
transformers ``BertModel`` layout (``embeddings.word_embeddings``, ``encoder.layer.{i}.attention.self.query``
...), so a Taiyi folder's ``text_encoder`` loads key for key; its pooler is not part of this module (Stable
Diffusion never uses it; the loader lists its keys as ignored).

**No attention mask.** diffusers' ``StableDiffusionPipeline`` passes a mask to the text encoder only when its
config says ``use_attention_mask``, which a BERT config does not; so with Taiyi every token, the ``[PAD]`` tokens
up to the 512th included, attends to every other and conditions the UNet. This module does exactly that (the
reference's behaviour, which the model was trained with), and so has no mask argument.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BertTextConfig
from .clip import Embedding


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertTextConfig):
        super().__init__()
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.width)
        self.position_embeddings = Embedding(cfg.max_positions, cfg.width)
        self.token_type_embeddings = Embedding(cfg.type_vocab_size, cfg.width)
        self.LayerNorm = nn.LayerNorm(cfg.width, eps=cfg.eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        # moved here, not by the caller: where weights are streamed, they reach their device only when this runs
        ids = ids.to(self.word_embeddings.weight.device)
        x = self.word_embeddings(ids)                                   # (B, N, C)
        x = x + self.position_embeddings.weight[:n] + self.token_type_embeddings.weight[0]  # one segment: type 0
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertTextConfig):
        super().__init__()
        self.heads = cfg.heads
        self.query = nn.Linear(cfg.width, cfg.width)
        self.key = nn.Linear(cfg.width, cfg.width)
        self.value = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        h = self.heads
        q = self.query(x).view(b, n, h, c // h).transpose(1, 2)       # (B, h, N, D)
        k = self.key(x).view(b, n, h, c // h).transpose(1, 2)
        v = self.value(x).view(b, n, h, c // h).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)                   # every token sees every token
        return out.transpose(1, 2).reshape(b, n, c)                     # (B, N, C)


class BertProjection(nn.Module):
    """``dense`` then dropout (none at inference) then the residual add and ``LayerNorm``: BERT's post-norm."""

    def __init__(self, width_in: int, cfg: BertTextConfig):
        super().__init__()
        self.dense = nn.Linear(width_in, cfg.width)
        self.LayerNorm = nn.LayerNorm(cfg.width, eps=cfg.eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertTextConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertProjection(cfg.width, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertTextConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.width, cfg.mlp_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))                                    # (B, N, mlp_width), exact (erf) GELU


class BertLayer(nn.Module):
    def __init__(self, cfg: BertTextConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertProjection(cfg.mlp_width, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertTextConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.layers))


class BertTextEncoder(nn.Module):
    """Token ids (B, N), N <= max_positions -> context (B, N, width): BERT's last hidden state."""

    def __init__(self, cfg: BertTextConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.LayerNorm.weight.dtype

    def forward(self, ids: torch.Tensor, clip_skip: int = 1, replace=None) -> torch.Tensor:
        """``clip_skip`` and ``replace`` exist for the text-encoder interface the conditioning code calls; clip
        skip is a CLIP option (only 1, no skip, is valid here) and textual-inversion vectors are CLIP embeddings
        (none can be given)."""
        if clip_skip != 1:
            raise ValueError(f"clip skip {clip_skip} is a CLIP text-encoder option: this model's text encoder is "
                             "BERT, whose last hidden state the UNet was trained on (use clip skip 1)")
        if replace:
            raise ValueError("textual-inversion embeddings are made for CLIP text encoders: this model's text "
                             "encoder is BERT")
        n = ids.shape[1]
        if n > self.config.max_positions:
            raise ValueError(f"{n} tokens is more than this BERT text encoder's {self.config.max_positions} "
                             "positions")
        x = self.embeddings(ids)
        for layer in self.encoder.layer:
            x = layer(x)
        return x
