"""The keys of the text encoders, OpenAI CLIP, OpenCLIP (SD 2.x's ViT-H, SDXL's bigG) and BERT (Taiyi): their names
in each layout, and the config the shapes show (:class:`TextEncoderInfo`).

The canonical names are transformers' ``CLIPTextModel`` ones (``text_model.``-prefixed; SDXL's bigG a
``CLIPTextModelWithProjection``) and ``BertModel``'s. The original single-file layouts:

* SD 1.x text encoder, prefix ``cond_stage_model.transformer.``: transformers names, with or without the
  ``text_model.`` level.
* SD 2.x OpenCLIP text encoder, prefix ``cond_stage_model.model.``: fused ``in_proj`` split into q/k/v; the
  last residual block is dropped by default, because SD 2.x conditions on the penultimate layer.
* SDXL (Stability's SGM layout): the text encoders are ``conditioner.embedders.N.``, ``transformer.`` (CLIP ViT-L,
  transformers names: ``text_encoder``) or ``model.`` (OpenCLIP bigG: ``text_encoder_2``, all layers, and
  ``text_projection`` stored as the matrix of ``x @ text_projection``, the transpose of a Linear weight).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .plan import (
    CAT, COPY, TRANSPOSE, ComponentPlan, ConversionError, PlanEntry, Rule, RuleSet, Shapes, Transform, add_entry,
    build_plan, check_expected, need_shape, shape_of,
)

__all__ = [
    "CLIP_PREFIX", "OPENCLIP_PREFIX", "EMBEDDERS_PREFIX", "SDXL_CLIP_PREFIX", "SDXL_OPENCLIP_PREFIX",
    "clip_from_original", "clip_to_original", "openclip_from_original", "openclip_to_original",
    "sgm_text_prefixes", "is_position_ids", "text_from_diffusers", "normalize_bert_keys", "TextEncoderInfo",
    "infer_text_encoder", "TEXT_HEAD_DIM",
]

CLIP_PREFIX = "cond_stage_model.transformer."
OPENCLIP_PREFIX = "cond_stage_model.model."
# SDXL's conditioner (SGM layout): one embedder per text encoder, numbered in the order of the model's config
EMBEDDERS_PREFIX = "conditioner.embedders."
SDXL_CLIP_PREFIX = EMBEDDERS_PREFIX + "0.transformer."      # CLIP ViT-L of the base model
SDXL_OPENCLIP_PREFIX = EMBEDDERS_PREFIX + "1.model."        # OpenCLIP bigG of the base model (the refiner: 0)
# Head width of the standard text towers: CLIP ViT-L/14 (768 = 12 x 64) and OpenCLIP ViT-H/14 (1024 = 16 x 64).
TEXT_HEAD_DIM = 64

# --- CLIP and OpenCLIP -------------------------------------------------------------------------------------

_CLIP_RULES = RuleSet([
    Rule("text_model", "text_model", "subtree"),
    # older files lack the text_model level
    Rule("embeddings", "text_model.embeddings", "subtree", reverse=False),
    Rule("encoder", "text_model.encoder", "subtree", reverse=False),
    Rule("final_layer_norm", "text_model.final_layer_norm", "subtree", reverse=False),
])


def is_position_ids(name: str) -> bool:
    return name.endswith("embeddings.position_ids")


def clip_from_original(keys: Iterable[str], *, prefix: str = CLIP_PREFIX,
                       expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan for the SD 1.x (OpenAI CLIP, transformers names) text encoder under ``prefix``.

    Keys with or without the ``text_model.`` level are accepted; ``position_ids`` buffers are ignored.
    """
    return build_plan("text_encoder", keys, _CLIP_RULES, to_canon=True, src_prefix=prefix, dst_prefix="",
                  ignore=is_position_ids, expected=expected)


def clip_to_original(keys: Iterable[str], *, prefix: str = CLIP_PREFIX) -> ComponentPlan:
    """Plan ``{original key: PlanEntry}`` for an SD 1.x text encoder (``...transformer.text_model.*``)."""
    return build_plan("text_encoder", keys, _CLIP_RULES, to_canon=False, src_prefix="", dst_prefix=prefix,
                  ignore=is_position_ids)


_OPENCLIP_LAYER = (("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("mlp.c_fc", "mlp.fc1"),
                   ("mlp.c_proj", "mlp.fc2"), ("attn.out_proj", "self_attn.out_proj"))
_OPENCLIP_RULES = RuleSet([
    Rule("token_embedding", "text_model.embeddings.token_embedding"),
    Rule("positional_embedding", "text_model.embeddings.position_embedding.weight", "exact"),
    Rule("ln_final", "text_model.final_layer_norm"),
    Rule("transformer.resblocks", "text_model.encoder.layers", "table", _OPENCLIP_LAYER, indexed=True),
])
# Parts of the OpenCLIP model that a CLIPTextModel has no place for.
_OPENCLIP_UNUSED = frozenset({"text_projection", "logit_scale", "attn_mask"})
_OPENCLIP_IN_PROJ = re.compile(r"transformer\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)")
_OPENCLIP_BLOCK = re.compile(r"transformer\.resblocks\.(\d+)\.")
_CANON_QKV = re.compile(r"text_model\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")
_CANON_LAYER = re.compile(r"text_model\.encoder\.layers\.(\d+)\.")


def openclip_from_original(keys: Iterable[str], *, num_layers: int | None = None, prefix: str = OPENCLIP_PREFIX,
                           expected: Iterable[str] | None = None, component: str = "text_encoder",
                           projection: bool = False) -> ComponentPlan:
    """Plan for an OpenCLIP text tower under ``prefix`` -> transformers ``CLIPTextModel`` names.

    ``in_proj_weight/bias`` are split into q/k/v. Only the first ``num_layers`` residual blocks are used;
    the default is the number of layers in ``expected`` when given, else the file's count minus one (SD 2.x
    conditions on the penultimate layer, so diffusers' text encoder has 23 of ViT-H's 24 layers), or all of
    them with ``projection``. ``projection`` (SDXL's bigG, a ``CLIPTextModelWithProjection``): the pooled output
    is needed, so every layer is kept, and ``text_projection`` (the ``(width, proj)`` matrix OpenCLIP multiplies
    by) becomes the Linear weight ``text_projection.weight``, its transpose. Later blocks, ``logit_scale``,
    ``attn_mask`` (and ``text_projection`` without ``projection``) are ignored. ``component`` names the plan.
    """
    keys = list(keys)
    expected = None if expected is None else list(expected)
    blocks = {int(m.group(1)) for k in keys if k.startswith(prefix) and (m := _OPENCLIP_BLOCK.match(k[len(prefix):]))}
    if num_layers is None:
        if expected is not None:
            num_layers = len({int(m.group(1)) for k in expected if (m := _CANON_LAYER.match(k))})
        else:
            num_layers = len(blocks) if projection else max(len(blocks) - 1, 0)
    plan = ComponentPlan(component)
    if blocks and num_layers > len(blocks):
        plan.notes.append(f"OpenCLIP: {num_layers} layers wanted but the file has only {len(blocks)}")
    unused = _OPENCLIP_UNUSED - {"text_projection"} if projection else _OPENCLIP_UNUSED

    def ignore(name: str) -> bool:
        m = _OPENCLIP_BLOCK.match(name)
        return name in unused or (m is not None and int(m.group(1)) >= num_layers)

    rest = []
    for key in keys:
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        m = _OPENCLIP_IN_PROJ.fullmatch(name)
        if m and not ignore(name):
            layer, param = m.groups()
            for i, part in enumerate("qkv"):
                add_entry(plan, f"text_model.encoder.layers.{layer}.self_attn.{part}_proj.{param}",
                     PlanEntry((key,), Transform("chunk", (i, 3))))
        elif projection and name == "text_projection":
            add_entry(plan, "text_projection.weight", PlanEntry((key,), TRANSPOSE))
        elif projection and name == "text_projection.weight":  # towers built with a Linear projection
            add_entry(plan, "text_projection.weight", PlanEntry((key,), COPY))
        else:
            rest.append(key)
    sub = build_plan(component, rest, _OPENCLIP_RULES, to_canon=True, src_prefix=prefix, dst_prefix="",
                 ignore=ignore)
    for target, entry in sub.entries.items():
        add_entry(plan, target, entry)
    plan.unexpected += sub.unexpected
    plan.ignored += sub.ignored
    check_expected(plan, expected)
    return plan


def openclip_to_original(keys: Iterable[str], *, prefix: str = OPENCLIP_PREFIX,
                         component: str = "text_encoder") -> ComponentPlan:
    """Plan ``{original key: PlanEntry}`` writing a canonical text encoder back as an OpenCLIP tower.

    q/k/v projections are concatenated into ``in_proj_weight/bias``. Only the layers present are written;
    a ``text_projection.weight`` (SDXL's bigG) is written as OpenCLIP's ``text_projection`` matrix, its transpose
    (no ``logit_scale``, which a text encoder does not have).
    """
    plan = ComponentPlan(component)
    keys = list(keys)
    present = set(keys)
    rest = []
    for key in keys:
        if key == "text_projection.weight":
            add_entry(plan, f"{prefix}text_projection", PlanEntry((key,), TRANSPOSE))
            continue
        m = _CANON_QKV.fullmatch(key)
        if not m:
            rest.append(key)
            continue
        layer, part, param = m.groups()
        if part != "q" and f"text_model.encoder.layers.{layer}.self_attn.q_proj.{param}" in present:
            continue  # written with its q
        group = tuple(f"text_model.encoder.layers.{layer}.self_attn.{p}_proj.{param}" for p in "qkv")
        absent = [g for g in group if g not in present]
        if absent:
            plan.missing.extend(absent)
            plan.unexpected.extend(g for g in group if g in present)
            continue
        add_entry(plan, f"{prefix}transformer.resblocks.{layer}.attn.in_proj_{param}", PlanEntry(group, CAT))
    sub = build_plan(component, rest, _OPENCLIP_RULES, to_canon=False, src_prefix="", dst_prefix=prefix,
                 ignore=is_position_ids)
    for target, entry in sub.entries.items():
        add_entry(plan, target, entry)
    plan.unexpected += sub.unexpected
    plan.ignored += sub.ignored
    return plan


_EMBEDDER = re.compile(re.escape(EMBEDDERS_PREFIX) + r"(\d+)\.(transformer|model)\.")
_EMBEDDER_KINDS = {"transformer": "text_encoder", "model": "text_encoder_2"}


def sgm_text_prefixes(keys: Iterable[str]) -> dict[str, str]:
    """``{component: key prefix}`` of the text encoders of an SGM-layout (SDXL) file.

    ``conditioner.embedders.N.transformer.`` is a CLIP ViT-L in transformers' layout (``text_encoder``) and
    ``conditioner.embedders.N.model.`` an OpenCLIP tower (``text_encoder_2``, SDXL's bigG): the base model has
    both (0 and 1), the refiner only bigG (0). Empty for files of any other layout.
    """
    found: dict[str, set[str]] = {}
    for key in keys:
        m = _EMBEDDER.match(key)
        if m:
            found.setdefault(_EMBEDDER_KINDS[m.group(2)], set()).add(m.group(0))
    for component, prefixes in found.items():
        if len(prefixes) > 1:
            raise ConversionError(f"the file has {len(prefixes)} text encoders of one kind ({sorted(prefixes)}); "
                                  f"SDXL has one CLIP ViT-L and one OpenCLIP bigG")
    return {component: prefixes.pop() for component, prefixes in sorted(found.items())}


_TEXT_TOP = ("embeddings.", "encoder.", "final_layer_norm.")


def text_from_diffusers(key: str) -> str:
    """The canonical name of a diffusers-folder text-encoder key: keys saved without the ``text_model.`` level
    get it."""
    return "text_model." + key if key.startswith(_TEXT_TOP) else key


# --- what the shapes say -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextEncoderInfo:
    """``layers`` counts the layers the canonical model has (for OpenCLIP: the file's count minus the unused
    last one, ``source_layers``); ``heads`` assumes the standard 64-dim heads (None when the width is not a
    multiple of 64); ``activation`` follows the tower kind."""

    kind: str                      # "clip" (OpenAI CLIP-L style) | "openclip" | "diffusers" (kind not visible)
    vocab_size: int
    max_positions: int
    width: int
    layers: int
    heads: int | None
    mlp_width: int
    activation: str
    source_layers: int
    projection_dim: int | None = None  # the width of ``text_projection.weight`` where the tower has one (bigG)

    def config_kwargs(self) -> dict:
        """Keyword arguments with sdlite ``TextEncoderConfig`` field names (``heads`` and ``projection_dim`` left
        out when unknown)."""
        out = dict(vocab_size=self.vocab_size, max_positions=self.max_positions, width=self.width,
                   layers=self.layers, mlp_width=self.mlp_width, activation=self.activation)
        if self.heads is not None:
            out["heads"] = self.heads
        if self.projection_dim is not None:
            out["projection_dim"] = self.projection_dim
        return out


def infer_text_encoder(shapes: Shapes, kind: str = "diffusers", source_layers: int | None = None) -> TextEncoderInfo:
    """Text encoder config from canonical (transformers ``CLIPTextModel``) key shapes.

    ``kind``: ``clip`` / ``openclip`` when the original layout showed it (sets the activation), else
    ``diffusers`` (then a 1024- or 1280-wide tower is taken for SD 2.x's or SDXL's OpenCLIP, which use GELU).
    """
    shapes = {k: shape_of(v) for k, v in shapes.items()}
    tok = need_shape(shapes, "text_model.embeddings.token_embedding.weight", "text encoder")
    pos = need_shape(shapes, "text_model.embeddings.position_embedding.weight", "text encoder")
    layers = len({int(m.group(1)) for k in shapes if (m := re.match(r"text_model\.encoder\.layers\.(\d+)\.", k))})
    width = tok[1]
    mlp = need_shape(shapes, "text_model.encoder.layers.0.mlp.fc1.weight", "text encoder")[0] if layers else 4 * width
    openclip = kind == "openclip" or (kind == "diffusers" and width in (1024, 1280))
    projection = shapes.get("text_projection.weight")
    return TextEncoderInfo(
        kind=kind, vocab_size=tok[0], max_positions=pos[0], width=width, layers=layers,
        heads=width // TEXT_HEAD_DIM if width % TEXT_HEAD_DIM == 0 else None, mlp_width=mlp,
        activation="gelu" if openclip else "quick_gelu",
        source_layers=layers if source_layers is None else source_layers,
        projection_dim=projection[0] if projection is not None else None)


# --- BERT --------------------------------------------------------------------------------------------------

# A BERT text encoder (Taiyi): transformers' ``BertModel`` names are the canonical ones. A model saved from a wrapper
# (``BertForMaskedLM`` and the like) has them under ``bert.``; its heads (``cls.``) and BertModel's pooler are not
# part of a Stable Diffusion text tower, nor are the ``position_ids`` / ``token_type_ids`` buffers.
_BERT_WRAPPER = "bert."
_BERT_UNUSED = ("pooler.", "cls.")
_BERT_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def normalize_bert_keys(keys: Iterable[str], *, expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan from the keys of a BERT text encoder (a Taiyi folder's ``text_encoder``) to canonical names
    (:class:`sdlite.models.bert.BertTextEncoder`): a ``bert.`` prefix is removed; the pooler, any task head and
    the index buffers are ignored (listed in ``ignored``)."""
    plan = ComponentPlan("text_encoder")
    for key in keys:
        target = key[len(_BERT_WRAPPER):] if key.startswith(_BERT_WRAPPER) else key
        if target.startswith(_BERT_UNUSED) or target in _BERT_BUFFERS or key.startswith(_BERT_UNUSED):
            plan.ignored.append(key)
            continue
        add_entry(plan, target, PlanEntry((key,), COPY))
    check_expected(plan, expected)
    return plan

