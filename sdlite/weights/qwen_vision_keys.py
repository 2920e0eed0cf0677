"""Qwen2.5-VL's vision tower in the files people have: which layout a file's keys are in, the tower's tensors under
our names (:class:`sdlite.models.qwen_vision.QwenVisionTower`'s, which are transformers'), the config, the tower built.

The canonical names are transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` ones: ``patch_embed.proj.weight``
(a Conv3d (hidden, C, 2, 14, 14), no bias), ``blocks.N.norm1.weight``, ``blocks.N.attn.qkv.{weight,bias}`` (q, k and v
rows stacked), ``blocks.N.attn.proj.{weight,bias}``, ``blocks.N.norm2.weight``,
``blocks.N.mlp.{gate,up,down}_proj.{weight,bias}``, ``merger.ln_q.weight``, ``merger.mlp.{0,2}.{weight,bias}``.
The layouts (:func:`vision_prefix` tells them apart):

* ``visual.``: Hugging Face's Qwen2.5-VL checkpoints as released (``Qwen2_5_VLForConditionalGeneration`` saved by
  transformers before 4.52), diffusers' ``text_encoder/`` folders of Qwen-Image(-Edit), ComfyUI's
  ``qwen_2.5_vl_7b*.safetensors`` (in its ``*_fp8_scaled`` files a weight's per-tensor ``scale_weight`` /
  ``weight_scale`` multiplies it, as for the language model; input scales and ``comfy_quant`` records are skipped);
* ``model.visual.``: the same model saved by transformers 4.52 and later (5 included);
* ``""``: a tower saved on its own, bare names;
* ``"v."``: llama.cpp's mmproj GGUF (``mmproj-Qwen2.5-VL-7B-Instruct-*.gguf``, ``general.architecture`` ``clip``,
  ``clip.projector_type`` ``qwen2.5vl_merger``). ``convert_hf_to_gguf.py`` (``Qwen2VLVisionModel``) writes each
  ``visual.`` tensor under gguf's names with these changes: the fused ``qkv`` weight and bias are split in three
  equal row blocks, ``v.blk.N.attn_q`` / ``attn_k`` / ``attn_v``; the Conv3d is split along its temporal axis into two
  2-D convolutions, ``v.patch_embd.weight`` (``[:, :, 0]``) and ``v.patch_embd.weight.1`` (``[:, :, 1]``); the rest is
  renamed only: ``attn.proj`` -> ``attn_out``, ``norm1`` / ``norm2`` -> ``ln1`` / ``ln2``, ``mlp.gate_proj`` /
  ``up_proj`` / ``down_proj`` -> ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, ``merger.ln_q`` -> ``v.post_ln``,
  ``merger.mlp.0`` / ``.2`` -> ``mm.0`` / ``mm.2``. Here the parts are joined back (q, k, v concatenated along the
  rows; the two slices stacked on a new temporal axis). GGUF shapes come in PyTorch's order from the reader
  (:mod:`sdlite.weights.gguf`); a quantised tensor is dequantised (to float32) as it is read.

:func:`vision_state_dict` makes the canonical state dict of any layout; :func:`llama_cpp_vision_tensors` is the way
back to llama.cpp's names (what the converter writes); :func:`vision_config_from_gguf` reads a mmproj file's config,
:func:`infer_vision_config` recognises the released tower from shapes; :func:`load_qwen_vision` builds the tower.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..config.qwen_vision import QWEN25_VL_7B_VISION, QwenVisionConfig
from ..errors import ConfigError
from ..models.qwen_vision import QwenVisionTower
from .encoders import INPUT_SCALES, WEIGHT_SCALES, dequantize
from .plan import ConversionError, UnsupportedModelError, shape_of

__all__ = ["VISION_PREFIXES", "GGUF_PREFIX", "vision_prefix", "vision_sources", "vision_state_dict", "VisionView",
           "llama_cpp_vision_tensors", "vision_shapes", "infer_vision_config", "vision_config_from_gguf",
           "load_qwen_vision"]

WHAT = "Qwen2.5-VL vision tower"
#: the prefixes of the safetensors layouts, in the order they are looked for
VISION_PREFIXES = ("visual.", "model.visual.", "")
#: what :func:`vision_prefix` answers for llama.cpp's mmproj names (``v.*`` and ``mm.*``)
GGUF_PREFIX = "v."
_ANCHORS = ("patch_embed.proj.weight", "blocks.0.mlp.gate_proj.weight")
_GGUF_ANCHORS = ("v.patch_embd.weight", "v.blk.0.ffn_gate.weight")
# beside a tower's tensors and not its weights: per-tensor scales (read with their weight), fp8 input scales, ComfyUI's
# quantisation records, old saves' rotary buffers
_SKIPPED = WEIGHT_SCALES + INPUT_SCALES + (".comfy_quant", ".inv_freq")
_CANONICAL = re.compile(
    r"patch_embed\.proj\.weight|merger\.ln_q\.weight|merger\.mlp\.[02]\.(weight|bias)"
    r"|blocks\.\d+\.(norm1|norm2)\.weight"
    r"|blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.gate_proj|mlp\.up_proj|mlp\.down_proj)\.(weight|bias)")
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_GGUF_BLOCK = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's block tensor names <-> ours (qkv's three parts apart)
_TO_GGUF_BLOCK = {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "mlp.gate_proj": "ffn_gate",
                  "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_FROM_GGUF_BLOCK = {v: k for k, v in _TO_GGUF_BLOCK.items()}
_QKV = ("attn_q", "attn_k", "attn_v")
_TO_GGUF_TOP = {"merger.ln_q.weight": "v.post_ln.weight", "merger.mlp.0.weight": "mm.0.weight",
                "merger.mlp.0.bias": "mm.0.bias", "merger.mlp.2.weight": "mm.2.weight",
                "merger.mlp.2.bias": "mm.2.bias"}
_FROM_GGUF_TOP = {v: k for k, v in _TO_GGUF_TOP.items()}
_PATCH = "patch_embed.proj.weight"
_GGUF_PATCH = ("v.patch_embd.weight", "v.patch_embd.weight.1")
_BLOCK_PARAMS = ("norm1.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
                 "norm2.weight", "mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight",
                 "mlp.up_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")
_TOP_PARAMS = (_PATCH, "merger.ln_q.weight", "merger.mlp.0.weight", "merger.mlp.0.bias", "merger.mlp.2.weight",
               "merger.mlp.2.bias")


def vision_prefix(keys: Iterable[str]) -> str | None:
    """Where ``keys`` hold a Qwen2.5-VL vision tower: ``"visual."``, ``"model.visual."``, ``""`` (bare names) or
    :data:`GGUF_PREFIX` (``"v."``: llama.cpp's mmproj names); None when they hold none. Qwen2-VL's tower (LayerNorm
    blocks, a GELU MLP ``mlp.fc1``) is an :class:`UnsupportedModelError`."""
    keys = set(keys)
    for prefix in VISION_PREFIXES:
        if all(prefix + anchor in keys for anchor in _ANCHORS):
            return prefix
    if all(anchor in keys for anchor in _GGUF_ANCHORS):
        return GGUF_PREFIX
    for prefix in VISION_PREFIXES:
        if prefix + _PATCH in keys and prefix + "blocks.0.mlp.fc1.weight" in keys:
            raise UnsupportedModelError(f"a Qwen2-VL vision tower (under {prefix!r}: blocks with mlp.fc1), not "
                                        "Qwen2.5-VL's, which sdlite runs", key=prefix + "blocks.0.mlp.fc1.weight")
    return None


def _gguf_sources(name: str) -> tuple[str, ...] | None:
    """llama.cpp's tensors that a canonical key is made of (None: not a tower key)."""
    if name == _PATCH:
        return _GGUF_PATCH
    if name in _TO_GGUF_TOP:
        return (_TO_GGUF_TOP[name],)
    m = _BLOCK.fullmatch(name)
    if m is None:
        return None
    index, rest = m.groups()
    module, _, param = rest.rpartition(".")
    if module == "attn.qkv":
        return tuple(f"v.blk.{index}.{part}.{param}" for part in _QKV)
    if module in _TO_GGUF_BLOCK:
        return (f"v.blk.{index}.{_TO_GGUF_BLOCK[module]}.{param}",)
    return None


def _from_gguf(key: str) -> str | None:
    """The canonical key a llama.cpp tensor is (part of); None for a name outside the table."""
    if key in _GGUF_PATCH:
        return _PATCH
    if key in _FROM_GGUF_TOP:
        return _FROM_GGUF_TOP[key]
    m = _GGUF_BLOCK.fullmatch(key)
    if m is None:
        return None
    index, module, param = m.groups()
    if module in _QKV:
        return f"blocks.{index}.attn.qkv.{param}"
    return f"blocks.{index}.{_FROM_GGUF_BLOCK[module]}.{param}" if module in _FROM_GGUF_BLOCK else None


def _depth(canonical: Iterable[str]) -> int:
    found = sorted({int(m.group(1)) for k in canonical if (m := _BLOCK.fullmatch(k))})
    if found != list(range(len(found))):
        raise UnsupportedModelError(f"{WHAT}: blocks {found[:8]} are not numbered 0..n-1")
    return len(found)


def _expected(depth: int) -> list[str]:
    return [*_TOP_PARAMS, *(f"blocks.{i}.{p}" for i in range(depth) for p in _BLOCK_PARAMS)]


def vision_sources(keys: Iterable[str], prefix: str | None = None, *,
                   source_name: str | None = None, depth: int | None = None) -> dict[str, tuple[str, ...]]:
    """``{canonical key: the source keys it is made of}`` for the tower in ``keys`` (``prefix`` as
    :func:`vision_prefix` answers, found when not given), every key of a ``depth``-block tower (the file's own block
    count when not given) present. A key under the tower's prefix that is no tower key, and a missing key (named as
    the file names it), are a :class:`ConversionError` naming ``source_name``."""
    keys = list(keys)
    if prefix is None:
        prefix = vision_prefix(keys)
        if prefix is None:
            raise ConversionError(f"no {WHAT} in it: expected 'visual.{_ANCHORS[0]}', 'model.visual.{_ANCHORS[0]}' "
                                  f"or llama.cpp's {_GGUF_ANCHORS[0]!r}", source_name)
    present = set(keys)
    found: set[str] = set()
    for key in keys:
        if prefix == GGUF_PREFIX:
            if not key.startswith(("v.", "mm.")):
                continue
            name = _from_gguf(key)
        elif key.startswith(prefix):
            name = key[len(prefix):]
            if name.endswith(_SKIPPED):
                continue
            if prefix == "" and not _CANONICAL.fullmatch(name):
                continue   # bare names beside other networks' (a language model's) are not the tower's
            name = name if _CANONICAL.fullmatch(name) else None
        else:
            continue
        if name is None:
            raise ConversionError(f"is not a {WHAT} tensor, yet it sits among the tower's ({prefix!r})", source_name,
                                  key=key)
        found.add(name)
    depth = _depth(found) if depth is None else depth
    out = {}
    for name in _expected(depth):
        sources = _gguf_sources(name) if prefix == GGUF_PREFIX else (prefix + name,)
        for s in sources:
            if s not in present:
                raise ConversionError(f"missing from the {WHAT} ({depth} blocks) in {prefix!r} names", source_name,
                                      key=s)
        out[name] = sources
    extra = sorted(found - set(out))
    if extra:
        raise ConversionError(f"the {WHAT} has {depth} blocks, this tensor is not one of theirs", source_name,
                              key=(_gguf_sources(extra[0]) or (extra[0],))[0] if prefix == GGUF_PREFIX
                              else prefix + extra[0])
    return out


def _read(tensors: Mapping, key: str, keys: set[str], source_name: str | None) -> torch.Tensor:
    """A source tensor as a plain tensor: a GGUF block-quantised one dequantised to float32, a scaled fp8 weight
    (ComfyUI's ``*_fp8_scaled`` files: ``X.scale_weight`` / ``X.weight_scale`` beside it) times its scale, in
    float32."""
    t = tensors[key]
    if not isinstance(t, torch.Tensor):
        if not callable(getattr(t, "dequantize", None)):
            raise ConversionError(f"is a {type(t).__name__}, not a tensor", source_name, key=key)
        return t.dequantize(torch.float32)
    if key.endswith(".weight"):
        scale = next((key[:-len(".weight")] + s for s in WEIGHT_SCALES if key[:-len(".weight")] + s in keys), None)
        if scale is not None:
            try:
                return dequantize(t, torch.float32, tensors[scale])
            except ConversionError as e:
                raise ConversionError(e.message, source_name, key=scale) from None
    return t


def _join(name: str, sources: tuple[str, ...], parts: list[torch.Tensor], source_name: str | None) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    shapes = [tuple(p.shape) for p in parts]
    if any(s != shapes[0] for s in shapes):
        raise ConversionError(f"the parts of {name!r} have shapes {[list(s) for s in shapes]}; they must agree",
                              source_name, key=sources[0])
    dtype = torch.promote_types(*(p.dtype for p in parts)) if len({p.dtype for p in parts}) > 1 else parts[0].dtype
    parts = [p.to(dtype) for p in parts]
    if name == _PATCH:
        if len(shapes[0]) != 4:
            raise ConversionError(f"expected a 2-D convolution weight (out, in, kh, kw), got {list(shapes[0])}",
                                  source_name, key=sources[0])
        return torch.stack(parts, dim=2)                                     # (out, in, 2, kh, kw)
    return torch.cat(parts, dim=0)                                           # q, k, v rows


def vision_state_dict(tensors: Mapping[str, Any], source_name: str | None = None, *,
                      prefix: str | None = None, depth: int | None = None) -> dict[str, torch.Tensor]:
    """The tower's canonical state dict from ``tensors`` (a name -> tensor Mapping: a state dict, a safetensors or
    GGUF store) in any layout. Plain tensors keep their dtype; GGUF-quantised ones and scaled fp8 weights are
    dequantised to float32; the parts llama.cpp splits are joined. Errors name ``source_name`` (the file) and the
    key at fault."""
    keys = set(tensors.keys())
    plan = vision_sources(keys, prefix, source_name=source_name, depth=depth)
    out = {}
    for name, sources in plan.items():
        out[name] = _join(name, sources, [_read(tensors, s, keys, source_name) for s in sources], source_name)
    return out


class VisionView(Mapping):
    """The tower's canonical tensors as a lazy view of ``tensors`` (each read, joined or dequantised when asked for,
    as :func:`vision_state_dict` makes them all at once): what a model's streamed loading reads from. ``shapes``
    gives each canonical key's shape without reading a tensor; ``origin`` the file's keys it is made of."""

    def __init__(self, tensors: Mapping[str, Any], source_name: str | None = None, *, prefix: str | None = None,
                 depth: int | None = None, add: str = ""):
        self.tensors, self.source_name, self.add = tensors, source_name, add
        self.keys_present = set(tensors.keys())
        self.origin = {add + k: v for k, v in
                       vision_sources(self.keys_present, prefix, source_name=source_name, depth=depth).items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        sources = self.origin[name]
        parts = [_read(self.tensors, s, self.keys_present, self.source_name) for s in sources]
        return _join(name[len(self.add):], sources, parts, self.source_name)

    def __iter__(self):
        return iter(self.origin)

    def __len__(self) -> int:
        return len(self.origin)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each canonical key's shape, from the source keys' (the parts llama.cpp splits joined)."""
        shape = getattr(self.tensors, "shape", None)
        out = {}
        for name, sources in self.origin.items():
            parts = [tuple(shape(s)) if callable(shape) else shape_of(self.tensors[s]) for s in sources]
            if len(parts) == 1:
                out[name] = parts[0]
            elif name.endswith(_PATCH):
                out[name] = (parts[0][0], parts[0][1], len(parts), *parts[0][2:])
            else:
                out[name] = (sum(p[0] for p in parts), *parts[0][1:])
        return out


def llama_cpp_vision_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors ``convert_hf_to_gguf.py`` writes into a mmproj GGUF for a canonical state dict (names and the
    qkv and Conv3d splits, as the module's notes say); the way back of :func:`vision_state_dict`."""
    out = {}
    for name, t in state.items():
        sources = _gguf_sources(name)
        if sources is None:
            raise ConversionError(f"is not a {WHAT} key", key=name)
        if name == _PATCH:
            if t.ndim != 5 or t.shape[2] != 2:
                raise ConversionError(f"llama.cpp splits a Conv3d of temporal size 2, this one is {list(t.shape)}",
                                      key=name)
            out.update(zip(sources, (t[:, :, 0], t[:, :, 1])))
        elif len(sources) == 3:
            out.update(zip(sources, t.chunk(3, dim=0)))
        else:
            out[sources[0]] = t
    return out


def vision_shapes(config: QwenVisionConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical key of a tower of ``config`` and its shape (the tower built on the meta device)."""
    with torch.device("meta"):
        tower = QwenVisionTower(config)
    return {k: tuple(v.shape) for k, v in tower.state_dict().items()}


def infer_vision_config(shapes: Mapping[str, Any]) -> QwenVisionConfig:
    """The config of canonical key shapes (or tensors): Qwen2.5-VL-7B's when they are its shapes. Another tower's
    heads, windows and full-attention blocks are in no shape: an :class:`UnsupportedModelError` asks for its
    config (a ``config.json``'s ``vision_config``, :meth:`QwenVisionConfig.from_hf`)."""
    shapes = {k: shape_of(v) for k, v in shapes.items()}
    released = vision_shapes(QWEN25_VL_7B_VISION)
    if shapes == released:
        return QWEN25_VL_7B_VISION
    differ = sorted(k for k in set(shapes) | set(released) if shapes.get(k) != released.get(k))
    raise UnsupportedModelError(f"{WHAT}: not Qwen2.5-VL-7B's tower (first difference: {differ[0]!r}, "
                                f"{list(shapes[differ[0]]) if differ[0] in shapes else 'absent'} here, "
                                f"{list(released[differ[0]]) if differ[0] in released else 'absent'} in the 7B); "
                                "its heads and windows are in no shape: give its config.json's vision_config",
                                key=differ[0])


def _field(fields: Mapping, key: str, path: str | None, default=None):
    value = fields.get(key, default)
    if value is None:
        raise ConversionError(f"GGUF metadata entry {key!r} is missing; a Qwen2.5-VL mmproj file states it", path)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConversionError(f"GGUF metadata entry {key!r} is {value!r}, not a positive integer", path)
    return value


def vision_config_from_gguf(store) -> QwenVisionConfig:
    """The config of a llama.cpp mmproj GGUF (a :class:`~sdlite.weights.gguf.GGUFStore`) of Qwen2.5-VL, from its
    metadata: ``clip.projector_type`` (``qwen2.5vl_merger``), ``clip.vision.block_count``, ``.embedding_length``,
    ``.feed_forward_length``, ``.attention.head_count``, ``.patch_size``, ``.projection_dim`` (the language model's
    width), ``.spatial_merge_size`` (2 when absent), ``.window_size`` (112 when absent: the converter does not write
    it) and ``.n_wa_pattern`` (every n-th block attends fully: n - 1, 2n - 1, ...). The temporal patch is 2 (two conv
    slices), the epsilon ``clip.vision.attention.layer_norm_epsilon``."""
    fields = getattr(store, "fields", None)
    path = getattr(store, "path", None)
    if not isinstance(fields, Mapping):
        raise ConversionError("not a GGUF file: no metadata to read a Qwen2.5-VL vision config from", path)
    kind = fields.get("clip.projector_type", fields.get("clip.vision.projector_type"))
    if kind != "qwen2.5vl_merger":
        raise UnsupportedModelError(f"GGUF clip.projector_type is {kind!r}, not Qwen2.5-VL's 'qwen2.5vl_merger'",
                                    path)
    depth = _field(fields, "clip.vision.block_count", path)
    pattern = _field(fields, "clip.vision.n_wa_pattern", path)
    eps = fields.get("clip.vision.attention.layer_norm_epsilon", 1e-6)
    try:
        return QwenVisionConfig(
            depth=depth, hidden_size=_field(fields, "clip.vision.embedding_length", path),
            intermediate_size=_field(fields, "clip.vision.feed_forward_length", path),
            num_heads=_field(fields, "clip.vision.attention.head_count", path),
            patch_size=_field(fields, "clip.vision.patch_size", path), temporal_patch_size=2,
            spatial_merge_size=_field(fields, "clip.vision.spatial_merge_size", path, 2),
            window_size=_field(fields, "clip.vision.window_size", path, 112),
            fullatt_block_indexes=tuple(range(pattern - 1, depth, pattern)),
            out_hidden_size=_field(fields, "clip.vision.projection_dim", path),
            rms_norm_eps=float(f"{eps:.7g}") if isinstance(eps, float) else eps,
        )
    except ConfigError as e:
        raise UnsupportedModelError(f"GGUF metadata: {e}", path) from None


def load_qwen_vision(tensors: Mapping[str, Any], source_name: str | None = None, *,
                     config: QwenVisionConfig | None = None, dtype: torch.dtype = torch.float32,
                     device: Any = None) -> QwenVisionTower:
    """The tower of ``tensors`` (any layout) in ``dtype`` on ``device``: ``config`` when given, else a mmproj GGUF's
    metadata config, else the released 7B's when the shapes are its. Every key and shape is checked before the tower
    is filled; a wrong shape is a :class:`ConversionError` naming the file and the key."""
    prefix = vision_prefix(tensors.keys())
    if config is None and prefix == GGUF_PREFIX and isinstance(getattr(tensors, "fields", None), Mapping):
        config = vision_config_from_gguf(tensors)
    state = vision_state_dict(tensors, source_name, prefix=prefix, depth=config.depth if config else None)
    if config is None:
        config = infer_vision_config(state)
    expected = vision_shapes(config)
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise ConversionError(f"shape {list(state[key].shape)} where the {WHAT}'s {key!r} needs {list(shape)}",
                                  source_name, key=key)
    with torch.device("meta"):
        tower = QwenVisionTower(config)
    tower.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    return tower.eval()
