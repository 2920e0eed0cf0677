"""The T5 encoder (Raffel et al. 2020; v1.1's gated-GELU feed-forward) as the text encoder of SD3 / 3.5 and FLUX.1.

Token ids (B, N) -> last hidden state (B, N, d_model). Module names follow transformers' ``T5EncoderModel``
(``shared``, ``encoder.block.{i}.layer.0.SelfAttention.q``, ``encoder.block.{i}.layer.1.DenseReluDense.wi_0``,
``encoder.final_layer_norm`` ...), so a checkpoint loads key for key; transformers' ``encoder.embed_tokens`` is
the same tensor as ``shared`` and is not a second parameter here.

What makes T5 unlike the CLIP and BERT towers:

* **RMS LayerNorm**: ``x / sqrt(mean(x^2) + eps) * weight``, no mean subtracted, no bias; the statistics in fp32,
  the result cast back to the weight's dtype when that is fp16 or bf16 (as transformers computes it;
  :class:`sdlite.models.layers.RMSNorm`).
* **Attention**: q.k is not scaled by 1/sqrt(d); a learned bias per head and relative-position bucket is added to
  the scores. Only block 0 holds the bias table; the bias it gives is shared by every block. Relative distances
  are bucketed by direction, exactly up to ``buckets / 4`` and logarithmically up to
  ``relative_attention_max_distance`` (Mesh TensorFlow's bucketing, as transformers has it).
  The additive bias rules out :func:`sdlite.kernels.bf16.attend` (plain scaled attention); attention is PyTorch's
  ``scaled_dot_product_attention`` with the bias as its float mask and ``scale=1.0``, as transformers' "sdpa"
  attention calls it (the same call, so float32 results are bit-identical).
* **No attention mask by default**: diffusers' SD3 and FLUX pipelines (``_get_t5_prompt_embeds``) give the
  encoder the whole padded row (256 or 512 tokens) without a mask, so the pads take part in attention; the models
  were trained so. ``attention_mask`` (B, N) of 1/0 is accepted for other uses and masks keys as transformers does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config.t5 import T5Config
from .clip import Embedding
from .layers import RMSNorm

__all__ = ["T5Encoder", "relative_position_buckets", "gelu_tanh", "FP16_FP32_KEYS",
           "param_dtype"]

# In float16 these weights stay float32: transformers' ``_keep_in_fp32_modules = ["wo"]`` (applied when a T5 is
# loaded in fp16, not in bf16), so the product of the feed-forward's halves reaches ``wo`` upcast to fp32.
FP16_FP32_KEYS = ("DenseReluDense.wo.weight",)


def param_dtype(key: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a T5 weight ``key`` is kept in when the encoder runs in ``dtype`` (fp16: ``wo`` stays fp32)."""
    if dtype == torch.float16 and key.endswith(FP16_FP32_KEYS):
        return torch.float32
    return dtype


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU in its tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), written out term by term
    in the order transformers' ``gelu_new`` computes it (``F.gelu(approximate="tanh")`` rounds differently)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def relative_position_buckets(n_query: int, n_key: int, num_buckets: int, max_distance: int,
                              device: torch.device | str | None = None) -> torch.Tensor:
    """Bucket of each (query, key) pair's distance ``key - query`` for a bidirectional (encoder) attention:
    (n_query, n_key) int64 in [0, num_buckets). Half the buckets are for keys after the query; within a half, the
    first quarter of all buckets holds distances 0, 1, ... exactly, the rest logarithmically larger bins up to
    ``max_distance``, beyond which every distance shares the last bucket."""
    distance = (torch.arange(n_key, dtype=torch.long, device=device)[None, :]
                - torch.arange(n_query, dtype=torch.long, device=device)[:, None])        # (Nq, Nk)
    half = num_buckets // 2
    buckets = (distance > 0).to(torch.long) * half
    distance = torch.abs(distance)
    exact = half // 2
    far = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                   * (half - exact)).to(torch.long)
    far = torch.clamp(far, max=half - 1)
    return buckets + torch.where(distance < exact, distance, far)


def clamp_fp16(x: torch.Tensor) -> torch.Tensor:
    """In fp16, values past the largest finite one are clamped to it (to 1000 below it when any was inf), as
    transformers does after each sub-layer of a T5 block; other dtypes pass unchanged."""
    if x.dtype != torch.float16:
        return x
    big = torch.finfo(x.dtype).max
    limit = torch.where(torch.isinf(x).any(), big - 1000, big)
    return torch.clamp(x, min=-limit, max=limit)


class T5Attention(nn.Module):
    """Multi-head self-attention without 1/sqrt(d) scaling and with an additive bias; block 0's also holds the
    relative-position bias table (``relative_attention_bias``: buckets x heads)."""

    def __init__(self, cfg: T5Config, has_relative_bias: bool):
        super().__init__()
        self.heads, self.d_kv = cfg.num_heads, cfg.d_kv
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance
        self.q = nn.Linear(cfg.d_model, cfg.inner_dim, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.inner_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.inner_dim, bias=False)
        self.o = nn.Linear(cfg.inner_dim, cfg.d_model, bias=False)
        if has_relative_bias:
            self.relative_attention_bias = Embedding(self.num_buckets, cfg.num_heads)

    def position_bias(self, n: int, device: torch.device | None = None) -> torch.Tensor:
        """(1, heads, N, N) bias of every query-key pair, in the table's dtype, on ``device`` (None: the table's;
        give it where the table's weights are streamed, placeholders until the table runs)."""
        table = self.relative_attention_bias
        device = table.weight.device if device is None else device
        buckets = relative_position_buckets(n, n, self.num_buckets, self.max_distance, device)
        return table(buckets).permute(2, 0, 1).unsqueeze(0).contiguous()  # (N, N, h) -> (1, h, N, N)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h, d = self.heads, self.d_kv
        q = self.q(x).view(b, n, h, d).transpose(1, 2)                    # (B, h, N, D)
        k = self.k(x).view(b, n, h, d).transpose(1, 2)
        v = self.v(x).view(b, n, h, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)   # (B, h, N, D)
        return self.o(out.transpose(1, 2).reshape(b, n, h * d))           # (B, N, d_model)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, cfg: T5Config, has_relative_bias: bool):
        super().__init__()
        self.SelfAttention = T5Attention(cfg, has_relative_bias)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + self.SelfAttention(self.layer_norm(x), bias)


class T5DenseGatedGelu(nn.Module):
    """T5 v1.1: gelu(wi_0 x) * wi_1 x, then wo (whose dtype the product is cast to: fp32 in an fp16 model)."""

    def __init__(self, cfg: T5Config):
        super().__init__()
        self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gelu_tanh(self.wi_0(x)) * self.wi_1(x)                        # (B, N, d_ff)
        return self.wo(h.to(_wo_dtype(self.wo, h)))                        # (B, N, d_model)


def _wo_dtype(wo: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The dtype ``wo`` takes its input in: its weight's (float32 under fp16, :func:`param_dtype`); for a weight kept
    in a GGUF block format (dequantised per call into its input's dtype) the same rule, float32 under fp16."""
    weight = getattr(wo, "weight", None)     # an int8 layer (bf16-int8) has none: it takes its input's dtype
    if weight is not None and weight.is_floating_point():
        return weight.dtype
    return torch.float32 if h.dtype == torch.float16 else h.dtype


class T5DenseRelu(nn.Module):
    """The original T5: relu(wi x), then wo."""

    def __init__(self, cfg: T5Config):
        super().__init__()
        self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.wi(x))                                            # (B, N, d_ff)
        return self.wo(h.to(_wo_dtype(self.wo, h)))


class T5LayerFF(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.DenseReluDense = T5DenseGatedGelu(cfg) if cfg.gated else T5DenseRelu(cfg)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Module):
    def __init__(self, cfg: T5Config, has_relative_bias: bool):
        super().__init__()
        self.layer = nn.ModuleList([T5LayerSelfAttention(cfg, has_relative_bias), T5LayerFF(cfg)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = clamp_fp16(self.layer[0](x, bias))
        return clamp_fp16(self.layer[1](x))


class T5Stack(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.block = nn.ModuleList(T5Block(cfg, has_relative_bias=i == 0) for i in range(cfg.num_layers))
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)


class T5Encoder(nn.Module):
    """Token ids (B, N) -> last hidden state (B, N, d_model), transformers' ``T5EncoderModel(...).last_hidden_state``.

    Precision: it runs in the dtype of its weights. float32 and bfloat16 need nothing more. In **float16** T5's
    activations overflow (T5 v1.1 was trained in bf16); this does what transformers does to stay finite: the
    ``wo`` weights are kept in float32 (:meth:`cast`, :func:`param_dtype`), so the feed-forward's output and from
    then on the residual stream are float32 (each sub-layer's input is normalised and cast back to fp16), and
    after each sub-layer an fp16 hidden state is clamped to the largest finite fp16 value (to 1000 below it when
    any value was already inf). The result is then cast to fp16 by the final LayerNorm. A float16 model built
    with ``wo`` in fp16 also runs, with the clamping alone, as transformers would.
    """

    def __init__(self, cfg: T5Config):
        super().__init__()
        self.config = cfg
        self.shared = Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = T5Stack(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.shared.weight.dtype

    def cast(self, dtype: torch.dtype) -> "T5Encoder":
        """Convert the weights to ``dtype`` in place; in float16, ``wo`` is kept in float32 (:func:`param_dtype`)."""
        for name, param in self.named_parameters():
            param.data = param.data.to(param_dtype(name, dtype))
        return self

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if ids.ndim != 2:
            raise ValueError(f"T5 encoder: expected token ids of shape (batch, tokens), got {tuple(ids.shape)}")
        b, n = ids.shape
        # moved here, not by the caller; where weights are streamed they are placeholders (meta) until a block runs,
        # and the ids stay where the caller has them
        if self.shared.weight.device.type != "meta":
            ids = ids.to(self.shared.weight.device)
        if n:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"T5 encoder: token id {low if low < 0 else high} is outside its vocabulary of "
                                 f"{self.config.vocab_size}")
        x = self.shared(ids)                                              # (B, N, d_model)
        attention = self.encoder.block[0].layer[0].SelfAttention
        bias = attention.position_bias(n, x.device)                     # (1, h, N, N), shared by all blocks
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (b, n):
                raise ValueError(f"T5 encoder: attention_mask of shape {tuple(attention_mask.shape)} does not match "
                                 f"the ids' {(b, n)}")
            keep = attention_mask.to(device=bias.device, dtype=torch.bool)[:, None, None, :]   # (B, 1, 1, N)
            bias = torch.where(keep, bias, torch.finfo(bias.dtype).min).contiguous()         # (B, h, N, N)
        for block in self.encoder.block:
            x = block(x, bias)
        return self.encoder.final_layer_norm(x)
