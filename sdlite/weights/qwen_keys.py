"""The Qwen text encoder's weights in the files people have: their key names, the config their shapes or GGUF metadata
show, and the encoder built from them.

The canonical names are transformers' ``Qwen3Model`` / ``Qwen2Model`` ones (:class:`sdlite.models.qwen.QwenTextEncoder`
has the same): ``embed_tokens.weight``, ``layers.N.self_attn.{q,k,v,o}_proj.weight`` (and ``.bias`` for q, k, v in
Qwen2 / 2.5), ``layers.N.self_attn.{q,k}_norm.weight`` (Qwen3), ``layers.N.mlp.{gate,up,down}_proj.weight``,
``layers.N.{input,post_attention}_layernorm.weight`` and ``norm.weight``. The layouts:

* **diffusers / transformers folders**: Z-Image's and FLUX.2 klein's ``text_encoder/`` (a ``Qwen3ForCausalLM`` or
  ``Qwen3Model``: keys under ``model.``, or none; ``lm_head.weight`` beside them is the LM head, not read),
  Qwen-Image's ``text_encoder/`` (``Qwen2_5_VLForConditionalGeneration``: the language model under ``model.``, or
  ``model.language_model.`` as transformers 4.52 and later save it; its vision tower under ``visual.`` /
  ``model.visual.`` is another network and is not read). Single files or shards with an index.
* **ComfyUI's text encoder files** (``qwen_3_4b.safetensors``, ``qwen_3_8b.safetensors``,
  ``qwen_2.5_vl_7b.safetensors`` and their fp8 versions): transformers' names under ``model.``; a per-tensor
  ``scale_weight`` / ``weight_scale`` next to an fp8 weight is applied as for T5 (:mod:`sdlite.weights.encoders`), the
  ``scaled_fp8`` marker, input scales and ``comfy_quant`` records are ignored.
* **llama.cpp's GGUF files** (``general.architecture`` ``qwen3``, ``qwen2`` or ``qwen2vl``): ``token_embd``,
  ``blk.N.attn_norm``, ``attn_q`` / ``attn_k`` / ``attn_v`` (weights and, in qwen2, biases), ``attn_output``,
  ``attn_q_norm`` / ``attn_k_norm`` (qwen3), ``ffn_norm``, ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, ``output_norm``;
  ``output.weight`` is the LM head, not read. llama.cpp's converter (``convert_hf_to_gguf.py``: ``Qwen2Model`` and
  ``Qwen3Model`` keep ``TextModel``'s tensor handling) does **not** permute q and k for these architectures, as it
  does for ``llama``: the Qwen graphs use the NeoX ("rotate half") RoPE that transformers uses, so the rows are
  transformers' as they are. GGUF shapes come in PyTorch's order from the reader (:mod:`sdlite.weights.gguf`), so
  every tensor is a plain copy; a quantised one (Q8_0, Q4_K ...) is dequantised when the encoder is built.
  :func:`qwen_config_from_gguf` reads the config from the file's metadata.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from ..config.qwen import QWEN_PRESETS, QwenConfig
from ..models.qwen import QwenTextEncoder
from .encoders import build_encoder, check_loadable, dequantize, llama_rename, model_shapes, scaled_plan
from .plan import (
    ComponentPlan, ConversionError, ConvertedMapping, Shapes, UnsupportedModelError, need_matrix, need_shape, shape_of,
    source_shapes,
)

__all__ = [
    "QWEN_GGUF_ARCHITECTURES", "find_qwen_prefix", "qwen_plan", "infer_qwen_config", "qwen_preset_name",
    "qwen_config_from_gguf", "qwen_shapes", "qwen_state_from", "load_qwen", "llama_cpp_name",
]

_COMPONENT = "Qwen text encoder"
#: GGUF ``general.architecture`` values whose tensors this table reads
QWEN_GGUF_ARCHITECTURES = ("qwen3", "qwen2", "qwen2vl")
_IGNORED_SUFFIXES = (".comfy_quant", ".rotary_emb.inv_freq")   # besides the scaled fp8 marker and input scales
_HEAD_KEYS = ("lm_head.weight", "output.weight")   # the LM head (transformers' and llama.cpp's names)
_CANONICAL = re.compile(
    r"embed_tokens\.weight|norm\.weight"
    r"|layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)"
    r"|layers\.\d+\.self_attn\.(o_proj|q_norm|k_norm)\.weight"
    r"|layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight")
_LAYER = re.compile(r"layers\.(\d+)\.")
# the config fields that the weights' shapes and key names show (a preset is recognised by these)
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "qk_norm", "attention_bias")
_ANCHOR = "layers.0.self_attn.q_proj.weight"
# llama.cpp's names (gguf constants MODEL_TENSOR.*) -> transformers'
_LLAMA_TOP = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LLAMA = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TO_LLAMA_BLOCK = {v: k for k, v in _LLAMA_BLOCK.items()}
_TO_LLAMA_TOP = {v: k for k, v in _LLAMA_TOP.items()}
_CANONICAL_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")


def _from_llama(name: str) -> str | None:
    """transformers' name of a llama.cpp Qwen tensor name (None: not one)."""
    return llama_rename(name, _LLAMA_TOP, _LLAMA, _LLAMA_BLOCK, "layers")


def llama_cpp_name(canonical: str) -> str | None:
    """llama.cpp's GGUF name of a canonical key (``layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``)."""
    return llama_rename(canonical, _TO_LLAMA_TOP, _CANONICAL_LAYER, _TO_LLAMA_BLOCK, "blk")


def find_qwen_prefix(keys: Iterable[str]) -> str | None:
    """The prefix under which ``keys`` hold a Qwen decoder: "" (canonical names, or a GGUF file's llama.cpp names),
    ``model.`` (transformers' ``Qwen3ForCausalLM``, ComfyUI's files), ``model.language_model.`` (Qwen2.5-VL saved by
    transformers 4.52+) or any other, found from the first layer's q_proj; the shortest when several; None when
    there is none."""
    keys = set(keys)
    found = sorted((k[:-len(_ANCHOR)] for k in keys if k.endswith(_ANCHOR)
                    and (len(k) == len(_ANCHOR) or k[-len(_ANCHOR) - 1] == ".")), key=len)
    if found:
        return found[0]
    return "" if "blk.0.attn_q.weight" in keys else None


def qwen_plan(keys: Iterable[str], *, prefix: str = "", expected: Iterable[str] | None = None,
              component: str = _COMPONENT) -> ComponentPlan:
    """Plan ``{canonical key: PlanEntry}`` for the Qwen keys under ``prefix`` (keys outside it are not looked at: an
    LM head or a vision tower beside ``model.`` is not this network).

    A weight with a ``scale_weight`` / ``weight_scale`` is made by DEQUANTIZE from both; ``ignored`` lists the LM
    head (``lm_head.weight``, GGUF ``output.weight``), the ``scaled_fp8`` marker, input scales, ``comfy_quant``
    records and old saves' ``rotary_emb.inv_freq`` buffers; ``unexpected`` every other key that is not a Qwen
    decoder weight (and, with ``expected``, one the model has no place for); ``missing`` (with ``expected``) what
    nothing provides."""
    return scaled_plan(component, keys, prefix=prefix, canonical=_CANONICAL,
                       rename=lambda name: _from_llama(name) or name,
                       ignore=lambda name, names: name in _HEAD_KEYS or name.endswith(_IGNORED_SUFFIXES),
                       expected=expected)


def infer_qwen_config(shapes: Shapes) -> QwenConfig:
    """The config that canonical key shapes show, the matching preset's when one matches (so its RoPE base, epsilon
    and context come with it): ``vocab_size`` and ``hidden_size`` from ``embed_tokens``, the layers from the layer
    numbers, ``intermediate_size`` from ``gate_proj``; Qwen3 when ``q_norm`` is there (``head_dim`` its size, the
    heads from q's and k's widths), Qwen2 / 2.5 when q has a bias. A Qwen2's head size is in no shape: 128 is taken
    (every Qwen2 / 2.5 from 1.5B up; pass a config for another). Without a preset the RoPE base is 1e6, epsilon 1e-6."""
    shapes = {k: shape_of(v) for k, v in shapes.items()}
    vocab, hidden = need_matrix(shapes, "embed_tokens.weight", _COMPONENT)
    q_width, q_in = need_matrix(shapes, "layers.0.self_attn.q_proj.weight", _COMPONENT)
    kv_width, _ = need_matrix(shapes, "layers.0.self_attn.k_proj.weight", _COMPONENT)
    intermediate, _ = need_matrix(shapes, "layers.0.mlp.gate_proj.weight", _COMPONENT)
    layers = 1 + max(int(m.group(1)) for k in shapes if (m := _LAYER.match(k)))
    qk_norm = "layers.0.self_attn.q_norm.weight" in shapes
    bias = "layers.0.self_attn.q_proj.bias" in shapes
    if qk_norm == bias:
        raise UnsupportedModelError(f"{_COMPONENT}: the first layer has {'both' if bias else 'neither'} q/k norms "
                                    f"{'and' if bias else 'nor'} q/k/v biases; a Qwen3 has the norms, a Qwen2 / "
                                    "2.5 the biases", key="layers.0.self_attn.q_proj.weight")
    head_dim = need_shape(shapes, "layers.0.self_attn.q_norm.weight", _COMPONENT)[0] if qk_norm else 128
    if q_width % head_dim or kv_width % head_dim or q_in != hidden:
        raise UnsupportedModelError(f"{_COMPONENT}: q ({q_width} x {q_in}) and k ({kv_width} rows) are not made of "
                                    f"{head_dim}-wide heads over the hidden size {hidden}",
                                    key="layers.0.self_attn.q_proj.weight")
    config = QwenConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                        num_attention_heads=q_width // head_dim, num_key_value_heads=kv_width // head_dim,
                        head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=qk_norm,
                        attention_bias=bias, max_position_embeddings=40960 if qk_norm else 32768,
                        tie_word_embeddings=False)
    name = qwen_preset_name(config)
    return QWEN_PRESETS[name] if name else config


def qwen_preset_name(config: QwenConfig) -> str | None:
    """The preset (``"qwen3-4b"``, ``"qwen3-8b"``, ``"qwen2.5-vl-7b"``) whose shapes ``config`` has, or None."""
    for name, preset in QWEN_PRESETS.items():
        if all(getattr(preset, f) == getattr(config, f) for f in _SHAPE_FIELDS):
            return name
    return None


def _gguf_value(fields: Mapping, key: str, path: str | None, kind=int, required: bool = True):
    value = fields.get(key)
    if value is None:
        if required:
            raise ConversionError(f"GGUF metadata entry {key!r} is missing; a Qwen GGUF file states it", path)
        return None
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConversionError(f"GGUF metadata entry {key!r} is {value!r}, not a positive integer", path)
    if kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ConversionError(f"GGUF metadata entry {key!r} is {value!r}, not a number > 0", path)
        # stored as float32: the shortest decimal that is that float32 (1e-06, not 9.999999974752427e-07)
        return float(str(np.float32(value)))
    return kind(value)


def qwen_config_from_gguf(store) -> QwenConfig:
    """The config of a Qwen GGUF file (a :class:`~sdlite.weights.gguf.GGUFStore`) from its metadata:
    ``{arch}.block_count``, ``.embedding_length``, ``.feed_forward_length``, ``.attention.head_count``,
    ``.attention.head_count_kv``, ``.attention.key_length`` (else hidden / heads),
    ``.attention.layer_norm_rms_epsilon``, ``.rope.freq_base`` and ``.context_length``; the vocabulary from
    ``token_embd``'s rows; a tied LM head when there is no ``output.weight``; the multimodal RoPE's sections from
    ``.rope.dimension_sections`` (Qwen2.5-VL). The architecture
    (``general.architecture``) says which layers: ``qwen3`` (q/k norms) or ``qwen2`` / ``qwen2vl`` (q/k/v biases)."""
    fields = getattr(store, "fields", None)
    path = getattr(store, "path", None)
    if not isinstance(fields, Mapping):
        raise ConversionError("not a GGUF file: no metadata to read a Qwen config from", path)
    arch = fields.get("general.architecture")
    if arch not in QWEN_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF general.architecture is {arch!r}, not a Qwen text encoder "
                                    f"({', '.join(map(repr, QWEN_GGUF_ARCHITECTURES))})", path)
    if "token_embd.weight" not in store:
        raise ConversionError("missing from the Qwen GGUF file", path, key="token_embd.weight")
    vocab = shape_of(store.shape("token_embd.weight") if callable(getattr(store, "shape", None))
                     else store["token_embd.weight"])[0]
    hidden = _gguf_value(fields, f"{arch}.embedding_length", path)
    heads = _gguf_value(fields, f"{arch}.attention.head_count", path)
    head_dim = _gguf_value(fields, f"{arch}.attention.key_length", path, required=False)
    if head_dim is None:
        if hidden % heads:
            raise ConversionError(f"GGUF metadata: {arch}.embedding_length {hidden} is not a multiple of "
                                  f"{arch}.attention.head_count {heads}, and no key_length says the head size", path)
        head_dim = hidden // heads
    qwen3 = arch == "qwen3"
    sections = fields.get(f"{arch}.rope.dimension_sections")   # qwen2vl: [16, 24, 24, 0], the multimodal RoPE's
    if sections is not None:
        sections = tuple(int(v) for v in list(sections)[:3])
    return QwenConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_gguf_value(fields, f"{arch}.feed_forward_length", path),
        num_hidden_layers=_gguf_value(fields, f"{arch}.block_count", path),
        num_attention_heads=heads,
        num_key_value_heads=_gguf_value(fields, f"{arch}.attention.head_count_kv", path, required=False) or heads,
        head_dim=head_dim,
        rms_norm_eps=_gguf_value(fields, f"{arch}.attention.layer_norm_rms_epsilon", path, float),
        rope_theta=_gguf_value(fields, f"{arch}.rope.freq_base", path, float),
        qk_norm=qwen3,
        attention_bias=not qwen3,
        max_position_embeddings=_gguf_value(fields, f"{arch}.context_length", path, required=False) or 32768,
        tie_word_embeddings="output.weight" not in store,
        mrope_section=sections,
    )


def qwen_shapes(config: QwenConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical key of a Qwen text encoder of ``config`` and its shape (the model built on the meta device)."""
    return model_shapes(QwenTextEncoder, config)


def _default_config(tensors: Mapping, canonical: dict[str, tuple[int, ...]]) -> QwenConfig:
    """A GGUF file's metadata config when it is a Qwen GGUF file, else the one the shapes show."""
    fields = getattr(tensors, "fields", None)
    if isinstance(fields, Mapping) and fields.get("general.architecture") in QWEN_GGUF_ARCHITECTURES:
        return qwen_config_from_gguf(tensors)
    return infer_qwen_config(canonical)


def _named(key: str, plan: ComponentPlan, prefix: str) -> str:
    """A canonical key as the file names it (its source key; a missing one in the file's own layout)."""
    if key in plan.entries:
        return plan.entries[key].sources[0]
    gguf = any(_LLAMA.fullmatch(s) or s in _LLAMA_TOP for e in plan.entries.values() for s in e.sources)
    return (llama_cpp_name(key) or key) if gguf else prefix + key


def _checked_plan(tensors: Mapping, prefix: str, config: QwenConfig | None) -> tuple[ComponentPlan, QwenConfig]:
    plan = qwen_plan(tensors.keys(), prefix=prefix)
    canonical = plan.shapes(source_shapes(tensors, plan.source_keys))
    config = _default_config(tensors, canonical) if config is None else config
    where = f" under {prefix!r}" if prefix else ""
    check_loadable(plan, canonical, qwen_shapes(config), path=getattr(tensors, "path", None),
                   weight_of=f"{config.kind} text encoder",
                   missing_from=f"Qwen weights{where} ({config.kind}, {config.num_hidden_layers} layers)",
                   needs=f"{config.kind} text encoder of hidden size {config.hidden_size}, "
                         f"{config.num_attention_heads} heads and {config.num_key_value_heads} key/value heads of "
                         f"{config.head_dim}, MLP {config.intermediate_size}, vocabulary {config.vocab_size}",
                   named=lambda key: _named(key, plan, prefix))
    return plan, config


def qwen_state_from(tensors: Mapping, prefix: str = "", *, config: QwenConfig | None = None) -> ConvertedMapping:
    """A lazy ``{canonical key: tensor}`` view of the Qwen decoder in ``tensors`` (a TensorStore or any mapping)
    under ``prefix``, checked against ``config`` (by default a GGUF file's metadata config, else the one the shapes
    show, :func:`infer_qwen_config`) before any tensor is read: a key that is not a Qwen weight, a missing key or a
    wrong shape is a :class:`~sdlite.weights.plan.ConversionError` naming the key (and the file, for a store).
    Tensors come as stored (fp8 and GGUF block types included), scaled fp8 weights dequantised to float32."""
    return _checked_plan(tensors, prefix, config)[0].apply(tensors)


def _to_dtype(tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stored tensor in ``dtype``: a GGUF block-quantised one dequantised, any other converted."""
    if hasattr(tensor, "dequantize") and not isinstance(tensor, torch.Tensor):
        return tensor.dequantize(dtype)
    return dequantize(tensor, dtype)


def load_qwen(tensors: Mapping, prefix: str | None = None, *, config: QwenConfig | None = None,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> QwenTextEncoder:
    """The Qwen text encoder of ``tensors`` (see :func:`qwen_state_from`; ``prefix`` None: :func:`find_qwen_prefix`),
    its weights converted to ``dtype`` on ``device`` one tensor at a time."""
    if prefix is None:
        prefix = find_qwen_prefix(tensors.keys())
        if prefix is None:
            raise UnsupportedModelError(f"no Qwen decoder in these weights (no key ending in {_ANCHOR!r} or "
                                        "'blk.0.attn_q.weight')", getattr(tensors, "path", None))
    plan, config = _checked_plan(tensors, prefix, config)
    return build_encoder(QwenTextEncoder, config, plan.apply(tensors), lambda tensor, key: _to_dtype(tensor, dtype),
                         device)
