"""The T5 text encoder's weights in the files people have: their key names, the config their shapes show, scaled-fp8
dequantisation, and the encoder built from them.

The canonical names are transformers' ``T5EncoderModel`` ones (:class:`sdlite.models.t5.T5Encoder` has the same),
and every layout uses them, under a prefix or none:

* **diffusers / transformers folders**: SD3's ``text_encoder_3/``, FLUX's ``text_encoder_2/``: ``model.safetensors``
  or shards with ``model.safetensors.index.json``. Some also hold ``encoder.embed_tokens.weight``, transformers' tied
  copy of ``shared.weight``: ignored when ``shared.weight`` is there, taken as it when it is not.
* **ComfyUI's separate files**: ``t5xxl_fp16.safetensors``, ``t5xxl_fp8_e4m3fn.safetensors`` (the weights cast to
  fp8), and "scaled fp8" files (``t5xxl_fp8_e4m3fn_scaled.safetensors``): a ``scaled_fp8`` marker tensor, and
  next to a weight ``X.weight`` stored as fp8 its per-tensor ``X.scale_weight`` / ``X.weight_scale`` and often an
  input scale. A scaled weight is dequantised (:mod:`sdlite.weights.encoders`: :func:`dequantize`), and the layer
  runs in the compute dtype, so input scales and the marker are ignored.
* **Stability's SD3 / 3.5 single files** (and ComfyUI's SD3 and FLUX checkpoints): under
  ``text_encoders.t5xxl.transformer.`` (:data:`SINGLE_FILE_PREFIX`).
* **GGUF encoders** (city96's ``t5-v1_1-xxl-encoder-Q8_0.gguf`` and the like, read by ComfyUI-GGUF and
  stable-diffusion.cpp) in llama.cpp's names: ``token_embd`` (``shared``), ``enc.blk.N.attn_norm`` /
  ``attn_q`` / ``attn_k`` / ``attn_v`` / ``attn_o`` / ``attn_rel_b`` (the relative-position bias), ``ffn_norm``,
  ``ffn_gate`` / ``ffn_up`` / ``ffn_down`` (``wi_0`` / ``wi_1`` / ``wo``) and ``enc.output_norm``.

The decoder of a whole T5 (``decoder.*``, ``lm_head.weight``) is ignored, as transformers' ``T5EncoderModel`` does.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from ..config.t5 import T5Config
from ..models.t5 import T5Encoder, param_dtype
from .encoders import (
    DEQUANTIZE, SCALED_FP8_MARKER, build_encoder, check_loadable, dequantize, llama_rename, model_shapes, scaled_plan,
)
from .plan import (
    ComponentPlan, ConvertedMapping, Shapes, UnsupportedModelError, need_matrix, shape_of, source_shapes,
)

__all__ = [
    "SINGLE_FILE_PREFIX", "SD3_COMPONENT", "FLUX_COMPONENT", "SCALED_FP8_MARKER", "DEQUANTIZE", "dequantize",
    "find_t5_prefix", "t5_plan", "t5_state_from", "infer_t5_config", "t5_shapes", "load_t5",
]

SINGLE_FILE_PREFIX = "text_encoders.t5xxl.transformer."
SD3_COMPONENT = "text_encoder_3"      # the diffusers folder of SD3 / 3.5
FLUX_COMPONENT = "text_encoder_2"     # and of FLUX.1
_EMBED_COPY = "encoder.embed_tokens.weight"
_CANONICAL = re.compile(
    r"shared\.weight"
    r"|encoder\.final_layer_norm\.weight"
    r"|encoder\.block\.\d+\.layer\.0\.(SelfAttention\.[qkvo]|layer_norm)\.weight"
    r"|encoder\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias\.weight"
    r"|encoder\.block\.\d+\.layer\.1\.(DenseReluDense\.(wi_0|wi_1|wi|wo)|layer_norm)\.weight")
_BLOCK = re.compile(r"encoder\.block\.(\d+)\.")
# llama.cpp's T5 encoder names (GGUF files) -> transformers'
_LLAMA_TOP = {"token_embd.weight": "shared.weight", "enc.output_norm.weight": "encoder.final_layer_norm.weight"}
_LLAMA_BLOCK = {"attn_norm": "layer.0.layer_norm", "attn_q": "layer.0.SelfAttention.q",
                "attn_k": "layer.0.SelfAttention.k", "attn_v": "layer.0.SelfAttention.v",
                "attn_o": "layer.0.SelfAttention.o", "attn_rel_b": "layer.0.SelfAttention.relative_attention_bias",
                "ffn_norm": "layer.1.layer_norm", "ffn_gate": "layer.1.DenseReluDense.wi_0",
                "ffn_up": "layer.1.DenseReluDense.wi_1", "ffn_down": "layer.1.DenseReluDense.wo"}
_LLAMA = re.compile(r"enc\.blk\.(\d+)\.(\w+)\.(weight)")
_COMPONENT = "T5 text encoder"


def find_t5_prefix(keys: Iterable[str]) -> str | None:
    """The prefix under which ``keys`` hold a T5 encoder: "" (a separate file or a folder's), the single-file
    :data:`SINGLE_FILE_PREFIX`, or None."""
    keys = set(keys)
    for prefix in ("", SINGLE_FILE_PREFIX):
        if f"{prefix}encoder.block.0.layer.0.SelfAttention.q.weight" in keys:
            return prefix
    if "enc.blk.0.attn_q.weight" in keys:   # a GGUF encoder in llama.cpp's names
        return ""
    return None


def t5_plan(keys: Iterable[str], *, prefix: str = "", expected: Iterable[str] | None = None,
            component: str = _COMPONENT) -> ComponentPlan:
    """Plan ``{canonical key: PlanEntry}`` for the T5 keys under ``prefix`` (keys outside it are not looked at).

    A weight with a ``scale_weight`` / ``weight_scale`` is made by :data:`DEQUANTIZE` from both; ``ignored`` lists
    the ``scaled_fp8`` marker, input scales, the tied ``encoder.embed_tokens.weight`` next to ``shared.weight``
    and a decoder's keys; ``unexpected`` every other key that is not a T5 encoder weight (and, with ``expected``,
    one the model has no place for); ``missing`` (with ``expected``) what nothing provides.
    """
    return scaled_plan(component, keys, prefix=prefix, canonical=_CANONICAL, rename=_rename, ignore=_ignored,
                       expected=expected)


def _rename(name: str) -> str:
    """transformers' name of a T5 key name: the tied embedding copy as ``shared``, llama.cpp's names translated."""
    if name == _EMBED_COPY:
        return "shared.weight"
    return llama_rename(name, _LLAMA_TOP, _LLAMA, _LLAMA_BLOCK, "encoder.block") or name


def _ignored(name: str, names: Mapping[str, str]) -> bool:
    """A whole T5's decoder and LM head, and the tied embedding copy when ``shared.weight`` is there."""
    return (name.startswith("decoder.") or name == "lm_head.weight"
            or (name == _EMBED_COPY and "shared.weight" in names))


def infer_t5_config(shapes: Shapes) -> T5Config:
    """The T5 config that canonical key shapes show: ``vocab_size`` and ``d_model`` from ``shared.weight``, the
    layers from the block numbers, ``num_heads`` and the buckets from the relative-attention-bias table, ``d_kv``
    from q's width, ``d_ff`` and the feed-forward kind from ``wi_0`` (gated-gelu) or ``wi`` (relu). The maximum
    distance and epsilon are not in any shape: T5's 128 and 1e-6 (pass a config when a config.json says more)."""
    shapes = {k: shape_of(v) for k, v in shapes.items()}
    vocab, d_model = need_matrix(shapes, "shared.weight", _COMPONENT)
    buckets, heads = need_matrix(shapes, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                                 _COMPONENT)
    inner, _ = need_matrix(shapes, "encoder.block.0.layer.0.SelfAttention.q.weight", _COMPONENT)
    if inner % heads:
        raise UnsupportedModelError(f"{_COMPONENT}: q's width {inner} is not a multiple of the {heads} heads of the "
                                    "relative attention bias", key="encoder.block.0.layer.0.SelfAttention.q.weight")
    gated_key = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight"
    relu_key = "encoder.block.0.layer.1.DenseReluDense.wi.weight"
    d_ff, _ = need_matrix(shapes, gated_key if gated_key in shapes or relu_key not in shapes else relu_key, _COMPONENT)
    layers = 1 + max(int(m.group(1)) for k in shapes if (m := _BLOCK.match(k)))
    return T5Config(vocab_size=vocab, d_model=d_model, d_kv=inner // heads, d_ff=d_ff, num_layers=layers,
                    num_heads=heads, relative_attention_num_buckets=buckets,
                    feed_forward_proj="relu" if gated_key not in shapes else "gated-gelu")


def t5_shapes(config: T5Config) -> dict[str, tuple[int, ...]]:
    """Every canonical key of a T5 encoder of ``config`` and its shape (from the model built on the meta device)."""
    return model_shapes(T5Encoder, config)


def _checked_plan(tensors: Mapping, prefix: str, config: T5Config | None) -> tuple[ComponentPlan, T5Config]:
    plan = t5_plan(tensors.keys(), prefix=prefix)
    canonical = plan.shapes(source_shapes(tensors, plan.source_keys))
    config = infer_t5_config(canonical) if config is None else config
    where = f" under {prefix!r}" if prefix else ""
    check_loadable(plan, canonical, t5_shapes(config), path=None, weight_of="T5 encoder",
                   missing_from=f"T5 weights{where}",
                   needs=f"T5 encoder of d_model {config.d_model}, d_ff {config.d_ff}, {config.num_heads} heads of "
                         f"{config.d_kv}, vocabulary {config.vocab_size}",
                   named=lambda key: prefix + key)
    return plan, config


def t5_state_from(tensors: Mapping, prefix: str = "", *, config: T5Config | None = None) -> ConvertedMapping:
    """A lazy ``{canonical key: tensor}`` view of the T5 encoder in ``tensors`` (a TensorStore or any mapping) under
    ``prefix``, checked against ``config`` (by default the one the shapes show, :func:`infer_t5_config`) before
    any tensor is read: a key that is not a T5 weight, a missing key or a wrong shape is a
    :class:`~sdlite.weights.plan.ConversionError` naming the key. Tensors come as stored (fp8 included), scaled
    fp8 weights dequantised to float32."""
    return _checked_plan(tensors, prefix, config)[0].apply(tensors)


def load_t5(tensors: Mapping, prefix: str = "", *, config: T5Config | None = None,
            dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> T5Encoder:
    """The T5 encoder of ``tensors`` (see :func:`t5_state_from`), its weights converted to ``dtype`` on ``device``
    one tensor at a time (:func:`dequantize`; in float16 ``wo`` stays float32, :func:`sdlite.models.t5.param_dtype`)."""
    plan, config = _checked_plan(tensors, prefix, config)
    return build_encoder(T5Encoder, config, plan.apply(tensors),
                         lambda tensor, key: dequantize(tensor, param_dtype(key, dtype)), device)
