"""The T5 text encoder's weights in the files people have: their key names, the config their shapes show, scaled-fp8
dequantisation, and the encoder built from them.

The canonical names are transformers' ``T5EncoderModel`` ones (:class:`sdlite.models.t5.T5Encoder` has the same),
and every layout uses them, under a prefix or none:

* **diffusers / transformers folders**: SD3's ``text_encoder_3/``, FLUX's ``text_encoder_2/``: ``model.safetensors``
  or shards with ``model.safetensors.index.json``. Some also hold ``encoder.embed_tokens.weight``, transformers' tied
  copy of ``shared.weight``: ignored when ``shared.weight`` is there, taken as it when it is not.
* **ComfyUI's separate files**: ``t5xxl_fp16.safetensors``, ``t5xxl_fp8_e4m3fn.safetensors`` (the weights cast to
  fp8), and "scaled fp8" files (``t5xxl_fp8_e4m3fn_scaled.safetensors``): a ``scaled_fp8`` marker tensor, and
  next to a weight ``X.weight`` stored as fp8 its per-tensor ``X.scale_weight`` (the value is
  ``X.weight * X.scale_weight``; the newer spelling ``X.weight_scale`` is read the same way) and often an
  ``X.scale_input`` / ``X.input_scale``, the input scale of fp8 matrix products. Here a scaled weight is
  dequantised, the product formed in float32 (:func:`dequantize`), and the layer runs in the compute dtype, so
  input scales and the marker are ignored.
* **Stability's SD3 / 3.5 single files** (and ComfyUI's SD3 and FLUX checkpoints): under
  ``text_encoders.t5xxl.transformer.`` (:data:`SINGLE_FILE_PREFIX`).
* **GGUF encoders** (city96's ``t5-v1_1-xxl-encoder-Q8_0.gguf`` and the like, read by ComfyUI-GGUF and
  stable-diffusion.cpp) in llama.cpp's names: ``token_embd`` (``shared``), ``enc.blk.N.attn_norm`` /
  ``attn_q`` / ``attn_k`` / ``attn_v`` / ``attn_o`` / ``attn_rel_b`` (the relative-position bias), ``ffn_norm``,
  ``ffn_gate`` / ``ffn_up`` / ``ffn_down`` (``wi_0`` / ``wi_1`` / ``wo``) and ``enc.output_norm``.

The decoder of a whole T5 (``decoder.*``, ``lm_head.weight``) is ignored, as transformers' ``T5EncoderModel`` does.
fp8 tensors (``float8_e4m3fn``, ``float8_e5m2``) convert to bf16, fp16 and fp32 exactly; :func:`dequantize` is
the one conversion of a stored tensor to the compute dtype, for other networks' fp8 files too.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ..config.t5 import T5Config
from ..models.t5 import T5Encoder, param_dtype
from .plan import (
    COPY, ComponentPlan, ConversionError, ConvertedMapping, PlanEntry, Shapes, Transform, UnsupportedModelError,
    add_entry, check_expected, need_shape, shape_of,
)

__all__ = [
    "SINGLE_FILE_PREFIX", "SD3_COMPONENT", "FLUX_COMPONENT", "SCALED_FP8_MARKER", "DEQUANTIZE", "dequantize",
    "find_t5_prefix", "t5_plan", "t5_state_from", "infer_t5_config", "t5_shapes", "load_t5",
]

SINGLE_FILE_PREFIX = "text_encoders.t5xxl.transformer."
SD3_COMPONENT = "text_encoder_3"      # the diffusers folder of SD3 / 3.5
FLUX_COMPONENT = "text_encoder_2"     # and of FLUX.1
SCALED_FP8_MARKER = "scaled_fp8"
_EMBED_COPY = "encoder.embed_tokens.weight"
_WEIGHT_SCALES = (".scale_weight", ".weight_scale")
_INPUT_SCALES = (".scale_input", ".input_scale")
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
_LLAMA = re.compile(r"enc\.blk\.(\d+)\.(\w+)\.weight")


def _from_llama(name: str) -> str | None:
    """transformers' name of a llama.cpp T5 tensor name (None: not one)."""
    if name in _LLAMA_TOP:
        return _LLAMA_TOP[name]
    m = _LLAMA.fullmatch(name)
    if m and m.group(2) in _LLAMA_BLOCK:
        return f"encoder.block.{m.group(1)}.{_LLAMA_BLOCK[m.group(2)]}.weight"
    return None
_COMPONENT = "T5 text encoder"


def dequantize(tensor: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A stored tensor (fp8, fp16, bf16, fp32 ...) in the compute ``dtype``. With a per-tensor ``scale`` (a scaled
    fp8 file's ``scale_weight``) the value is ``tensor * scale``, the product formed in float32 and rounded once
    to ``dtype``. Without one, a plain conversion (exact from fp8 to bf16, fp16 or fp32)."""
    if scale is None:
        return tensor.to(dtype)
    if scale.numel() != 1:
        raise ConversionError(f"a per-tensor scale has one value, this one has shape {list(scale.shape)}")
    return (tensor.to(torch.float32) * scale.to(device=tensor.device, dtype=torch.float32)).to(dtype)


@dataclass(frozen=True)
class _Dequantize(Transform):
    """A plan step from (weight, per-tensor scale) to the dequantised weight in float32; the loader then converts
    it to the compute dtype like any tensor."""

    op: str = "dequantize"

    def __post_init__(self):
        pass

    def apply(self, tensors, key: str = "?"):
        self.shape([tuple(t.shape) for t in tensors], key)
        return dequantize(tensors[0], torch.float32, tensors[1])

    def shape(self, shapes, key: str = "?") -> tuple[int, ...]:
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if len(shapes) != 2:
            raise ConversionError(f"dequantizing takes a weight and its scale, got {len(shapes)} tensors", key=key)
        if int(torch.Size(shapes[1]).numel()) != 1:
            raise ConversionError(f"its scale has shape {list(shapes[1])}; only per-tensor scales (one value) are "
                                  "supported", key=key)
        return shapes[0]


DEQUANTIZE = _Dequantize()


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
    names = {key[len(prefix):]: key for key in keys if key.startswith(prefix)}
    plan = ComponentPlan(component)
    scales = {}
    for name, key in names.items():
        suffix = next((s for s in _WEIGHT_SCALES if name.endswith(s)), None)
        if suffix is not None:
            scales[name[:-len(suffix)] + ".weight"] = key
    for name, key in names.items():
        if (name == SCALED_FP8_MARKER or name.endswith(_INPUT_SCALES) or name.startswith("decoder.")
                or name == "lm_head.weight" or (name == _EMBED_COPY and "shared.weight" in names)):
            plan.ignored.append(key)
            continue
        if name.endswith(_WEIGHT_SCALES):
            weight = next(name[:-len(s)] + ".weight" for s in _WEIGHT_SCALES if name.endswith(s))
            if weight not in names:
                plan.unexpected.append(key)   # a scale without its weight
            continue
        target = "shared.weight" if name == _EMBED_COPY else (_from_llama(name) or name)
        if not _CANONICAL.fullmatch(target):
            plan.unexpected.append(key)
            continue
        scale = scales.get(name)
        add_entry(plan, target, PlanEntry((key, scale), DEQUANTIZE) if scale else PlanEntry((key,), COPY))
    check_expected(plan, expected)
    return plan


def infer_t5_config(shapes: Shapes) -> T5Config:
    """The T5 config that canonical key shapes show: ``vocab_size`` and ``d_model`` from ``shared.weight``, the
    layers from the block numbers, ``num_heads`` and the buckets from the relative-attention-bias table, ``d_kv``
    from q's width, ``d_ff`` and the feed-forward kind from ``wi_0`` (gated-gelu) or ``wi`` (relu). The maximum
    distance and epsilon are not in any shape: T5's 128 and 1e-6 (pass a config when a config.json says more)."""
    shapes = {k: shape_of(v) for k, v in shapes.items()}
    vocab, d_model = _matrix(shapes, "shared.weight")
    buckets, heads = _matrix(shapes, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    inner, _ = _matrix(shapes, "encoder.block.0.layer.0.SelfAttention.q.weight")
    if inner % heads:
        raise UnsupportedModelError(f"{_COMPONENT}: q's width {inner} is not a multiple of the {heads} heads of the "
                                    "relative attention bias", key="encoder.block.0.layer.0.SelfAttention.q.weight")
    gated_key = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight"
    relu_key = "encoder.block.0.layer.1.DenseReluDense.wi.weight"
    d_ff, _ = _matrix(shapes, gated_key if gated_key in shapes or relu_key not in shapes else relu_key)
    layers = 1 + max(int(m.group(1)) for k in shapes if (m := _BLOCK.match(k)))
    return T5Config(vocab_size=vocab, d_model=d_model, d_kv=inner // heads, d_ff=d_ff, num_layers=layers,
                    num_heads=heads, relative_attention_num_buckets=buckets,
                    feed_forward_proj="relu" if gated_key not in shapes else "gated-gelu")


def _matrix(shapes: dict[str, tuple[int, ...]], key: str) -> tuple[int, int]:
    shape = need_shape(shapes, key, _COMPONENT)
    if len(shape) != 2:
        raise UnsupportedModelError(f"{_COMPONENT}: expected a matrix, got shape {list(shape)}", key=key)
    return shape


def t5_shapes(config: T5Config) -> dict[str, tuple[int, ...]]:
    """Every canonical key of a T5 encoder of ``config`` and its shape (from the model built on the meta device)."""
    with torch.device("meta"):
        model = T5Encoder(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _source_shapes(tensors: Mapping, keys: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Shapes without reading tensor data where the mapping can tell them (a TensorStore)."""
    shape = getattr(tensors, "shape", None)
    return {k: tuple(shape(k)) if callable(shape) else tuple(tensors[k].shape) for k in keys}


def _checked_plan(tensors: Mapping, prefix: str, config: T5Config | None) -> tuple[ComponentPlan, T5Config]:
    plan = t5_plan(tensors.keys(), prefix=prefix)
    canonical = plan.shapes(_source_shapes(tensors, plan.source_keys))
    config = infer_t5_config(canonical) if config is None else config
    expected = t5_shapes(config)
    check_expected(plan, expected)
    if plan.unexpected:
        raise ConversionError(f"{len(plan.unexpected)} key(s) that are not a T5 encoder weight"
                              f"{_listing(plan.unexpected, 'first few: ')}", key=plan.unexpected[0])
    if plan.missing:
        where = f" under {prefix!r}" if prefix else ""
        raise ConversionError(f"missing from the T5 weights{where}; {len(plan.missing)} key(s) missing"
                              f"{_listing(plan.missing, 'first few: ')}", key=prefix + plan.missing[0])
    for key, want in expected.items():
        got = canonical[key]
        if got != want:
            source = plan.entries[key].sources[0]
            raise ConversionError(f"shape {list(got)}, but a T5 encoder of d_model {config.d_model}, d_ff "
                                  f"{config.d_ff}, {config.num_heads} heads of {config.d_kv}, vocabulary "
                                  f"{config.vocab_size} needs {list(want)}", key=source)
    return plan, config


def _listing(keys: list[str], lead: str) -> str:
    return f" ({lead}{', '.join(repr(k) for k in keys[:5])}{', ...' if len(keys) > 5 else ''})" if keys else ""


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
    view = plan.apply(tensors)
    with torch.device("meta"):
        model = T5Encoder(config)
    state = {key: dequantize(view[key], param_dtype(key, dtype)).to(device) for key in model.state_dict()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
