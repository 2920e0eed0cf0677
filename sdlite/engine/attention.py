"""Sliced attention: bound the memory of the attention scores by processing the queries in slices.

Unsliced, one attention call of N query and M key tokens may hold ``B x heads x N x M`` scores at once: PyTorch's
math kernel does (about twice that, scores and softmax); its fused (flash) CPU kernel, which
``F.scaled_dot_product_attention`` picks for fp32/bf16/fp16 here, does not (``bench/tiled_vae.py --attention``
measures both). So slicing matters where SDPA falls back to the math kernel. Sliced,
:class:`sdlite.models.layers.Attention` runs one (batch, head) and at most ``max_tokens`` queries per call, so
at most ``max_tokens x M`` scores exist at a time. The technique is the one MNN and diffusers call attention
slicing; results equal the unsliced ones up to fp32 rounding.
"""
from __future__ import annotations

from torch import nn

from ..errors import SDLiteError
from ..models.layers import Attention


class AttentionSlicingError(SDLiteError, ValueError):
    """A bad attention slice size (the message names it and what is valid)."""


def set_attention_slicing(module: nn.Module, max_tokens: int | None) -> int:
    """Slice every :class:`Attention` in ``module`` (the module itself included) into query slices of at most
    ``max_tokens`` tokens, or turn slicing off with ``None``. Returns how many attention layers were set.

    Raises ValueError when ``max_tokens`` is neither None nor a positive integer.
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise AttentionSlicingError(f"attention slice size max_tokens={max_tokens!r} is not valid: expected a "
                                    "positive integer (the most query tokens per slice, e.g. 1024) or None (no slicing)")
    count = 0
    for layer in module.modules():
        if isinstance(layer, Attention):
            layer.slice_tokens = max_tokens
            count += 1
    return count
