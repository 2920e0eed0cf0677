"""Key conversion between the original single-file layout (LDM / CompVis / A1111) and sdlite's canonical names.

sdlite's canonical parameter names are those of a diffusers folder: ``UNet2DConditionModel`` keys for the
UNet, ``AutoencoderKL`` keys (modern ``to_q/to_k/to_v/to_out.0`` attention) for the VAE and transformers
``CLIPTextModel`` keys (``text_model.``-prefixed) for the text encoder. Every other layout comes in, and goes
out, through the tables in this module.

Conversion works on key NAMES. Each direction produces a plan, ``{target_key: PlanEntry(source_keys,
transform)}``, without reading any tensor; applying a plan to a ``Mapping`` gives a lazy view that reads
and transforms one tensor at a time (so a multi-GB file never has to be materialised as a whole).

Layouts handled here:

* UNet, prefix ``model.diffusion_model.``: ``input_blocks`` / ``middle_block`` / ``output_blocks``,
  ``time_embed``, ``out``. The block numbering is derived from a :class:`UNetStructure` (number of levels,
  resnets per level, which levels have attention), so any config works, not only SD 1.5's.
* VAE, prefix ``first_stage_model.``: ``encoder.down.N.block.M``, ``mid.block_1/attn_1/block_2``, the
  decoder's ``up.N`` numbered in reverse, ``nin_shortcut``, and 1x1-conv attention projections that become
  Linear weights.
* SD 1.x text encoder, prefix ``cond_stage_model.transformer.``: transformers names, with or without the
  ``text_model.`` level.
* SD 2.x OpenCLIP text encoder, prefix ``cond_stage_model.model.``: fused ``in_proj`` split into q/k/v; the
  last residual block is dropped by default, because SD 2.x conditions on the penultimate layer.
* SDXL (Stability's SGM layout): the text encoders are ``conditioner.embedders.N.``, ``transformer.`` (CLIP ViT-L,
  transformers names: ``text_encoder``) or ``model.`` (OpenCLIP bigG: ``text_encoder_2``, all layers, and
  ``text_projection`` stored as the matrix of ``x @ text_projection``, the transpose of a Linear weight); the UNet's
  added-conditioning MLP is ``label_emb.0.0`` / ``label_emb.0.2`` (diffusers' ``add_embedding.linear_1/2``); a
  class-conditioned UNet's table (the x4 upscaler's noise-level embedding) is ``label_emb.weight``
  (``class_embedding.weight``).
* Legacy diffusers VAE attention names (``query/key/value/proj_attn``), see :func:`normalize_diffusers_keys`.
* TAESD halves in madebyollin's layout (bare ``nn.Sequential`` indices), see :func:`taesd_from_original`.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from ..errors import CheckpointError

__all__ = [
    "UNET_PREFIX", "VAE_PREFIX", "CLIP_PREFIX", "OPENCLIP_PREFIX", "EMA_PREFIX", "SCHEDULE_BUFFERS",
    "EMBEDDERS_PREFIX", "SDXL_CLIP_PREFIX", "SDXL_OPENCLIP_PREFIX", "sgm_text_prefixes",
    "ConversionError", "Transform", "COPY", "PlanEntry", "ComponentPlan", "CheckpointPlan",
    "ConvertedMapping", "UNetStructure", "ema_key",
    "unet_from_original", "unet_to_original", "vae_from_original", "vae_to_original",
    "clip_from_original", "clip_to_original", "openclip_from_original", "openclip_to_original",
    "plan_from_original", "plan_to_original", "normalize_diffusers_keys", "normalize_bert_keys", "apply_plan",
    "TAESD_PARTS", "TAESD_INDEX_SHIFT", "taesd_from_original",
]

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_PREFIX = "cond_stage_model.transformer."
OPENCLIP_PREFIX = "cond_stage_model.model."
EMA_PREFIX = "model_ema."
# SDXL's conditioner (SGM layout): one embedder per text encoder, numbered in the order of the model's config
EMBEDDERS_PREFIX = "conditioner.embedders."
SDXL_CLIP_PREFIX = EMBEDDERS_PREFIX + "0.transformer."      # CLIP ViT-L of the base model
SDXL_OPENCLIP_PREFIX = EMBEDDERS_PREFIX + "1.model."        # OpenCLIP bigG of the base model (the refiner: 0)

# Training-time buffers of the LDM wrapper: present in most single files, never needed for inference.
SCHEDULE_BUFFERS = frozenset({
    "betas", "alphas_cumprod", "alphas_cumprod_prev", "sqrt_alphas_cumprod", "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
    "posterior_variance", "posterior_log_variance_clipped", "posterior_mean_coef1", "posterior_mean_coef2",
    "logvar", "lvlb_weights",
    "denoiser.sigmas",  # SGM's discrete denoiser keeps its sigma table as a buffer
})
# The x4 upscaler's noise augmentation (LatentUpscaleDiffusion.low_scale_model) keeps the low-resolution image's DDPM
# schedule as buffers; sdlite takes that schedule from the published low_res_scheduler config.
LOW_SCALE_PREFIX = "low_scale_model."
# Marker tensors some tools add to say how the model was trained (read by detect, dropped here).
MARKER_KEYS = frozenset({"v_pred", "ztsnr"})

_MAX_LISTED = 5


class ConversionError(CheckpointError):
    """Keys or tensors that cannot be converted (the message names the key, shape or value at fault)."""


# --- per-key transforms ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transform:
    """How a target tensor is made from its source tensor(s).

    ``op`` is one of ``copy`` (one source, unchanged), ``to_linear`` (1x1 conv weight ``[O, I, 1, 1]`` ->
    Linear ``[O, I]``; a 2-D source passes unchanged), ``to_conv`` (Linear ``[O, I]`` -> ``[O, I, 1, 1]``),
    ``chunk`` (``args=(index, parts)``: part ``index`` of ``parts`` equal slices along dim 0), ``cat``
    (the sources concatenated along dim 0) and ``transpose`` (a 2-D matrix transposed, as a view).
    """

    op: str = "copy"
    args: tuple = ()

    def __post_init__(self):
        if self.op not in ("copy", "to_linear", "to_conv", "chunk", "cat", "transpose"):
            raise ValueError(f"unknown transform {self.op!r}")

    def apply(self, tensors: Sequence[Any], key: str = "?") -> Any:
        """The target tensor ``key`` from its source tensors (views where possible, no copies)."""
        self._check_shapes([tuple(t.shape) for t in tensors], key)
        if self.op == "copy":
            return tensors[0]
        t = tensors[0]
        if self.op == "to_linear":
            return t.reshape(t.shape[0], t.shape[1]) if t.ndim != 2 else t
        if self.op == "to_conv":
            return t.reshape(t.shape[0], t.shape[1], 1, 1) if t.ndim == 2 else t
        if self.op == "chunk":
            index, parts = self.args
            n = t.shape[0] // parts
            return t[index * n:(index + 1) * n]
        if self.op == "transpose":
            return t.t()
        import torch

        return torch.cat(list(tensors), dim=0)

    def shape(self, shapes: Sequence[Sequence[int]], key: str = "?") -> tuple[int, ...]:
        """The target shape from the source shapes, without touching any tensor."""
        shapes = [tuple(int(d) for d in s) for s in shapes]
        self._check_shapes(shapes, key)
        s = shapes[0]
        if self.op == "copy":
            return s
        if self.op == "to_linear":
            return s[:2]
        if self.op == "to_conv":
            return s + (1, 1) if len(s) == 2 else s
        if self.op == "chunk":
            return (s[0] // self.args[1],) + s[1:]
        if self.op == "transpose":
            return s[::-1]
        return (sum(x[0] for x in shapes),) + s[1:]

    def _check_shapes(self, shapes: list[tuple[int, ...]], key: str) -> None:
        if not shapes or (self.op != "cat" and len(shapes) != 1):
            raise ConversionError(f"transform {self.op} got {len(shapes)} source tensors", key=key)
        s = shapes[0]
        if self.op == "to_linear" and (len(s) < 2 or any(d != 1 for d in s[2:])):
            raise ConversionError(
                f"expected a 1x1 convolution or Linear weight [out, in(, 1, 1)], got shape {list(s)}", key=key)
        if self.op == "to_conv" and len(s) != 2 and not (len(s) == 4 and s[2:] == (1, 1)):
            raise ConversionError(f"expected a Linear weight [out, in], got shape {list(s)}", key=key)
        if self.op == "chunk" and (not s or s[0] % self.args[1]):
            raise ConversionError(
                f"cannot split shape {list(s)} into {self.args[1]} equal parts along dim 0", key=key)
        if self.op == "transpose" and len(s) != 2:
            raise ConversionError(f"expected a 2-D matrix to transpose, got shape {list(s)}", key=key)
        if self.op == "cat" and any(x[1:] != s[1:] for x in shapes):
            raise ConversionError(
                f"cannot concatenate shapes {[list(x) for x in shapes]} along dim 0", key=key)


COPY = Transform("copy")
_TO_LINEAR = Transform("to_linear")
_TO_CONV = Transform("to_conv")
_CAT = Transform("cat")
_TRANSPOSE = Transform("transpose")


class PlanEntry(NamedTuple):
    """One target key: the source key(s) it is made from and how."""

    sources: tuple[str, ...]
    transform: Transform = COPY


class ConvertedMapping(Mapping):
    """A lazy, read-only view of ``source`` under a plan: each access reads and transforms one tensor."""

    def __init__(self, entries: Mapping[str, PlanEntry], source: Mapping):
        self._entries = entries
        self._source = source

    def __getitem__(self, key: str):
        entry = self._entries[key]
        try:
            tensors = [self._source[s] for s in entry.sources]
        except KeyError as e:
            raise ConversionError(f"source key {e.args[0]!r} is not in the checkpoint", key=key) from None
        return entry.transform.apply(tensors, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries


def apply_plan(entries: Mapping[str, PlanEntry], source: Mapping) -> ConvertedMapping:
    """The lazy view of ``source`` under ``entries`` (a plan's ``entries`` dict or a whole plan)."""
    if isinstance(entries, ComponentPlan):
        entries = entries.entries
    return ConvertedMapping(entries, source)


def _listing(keys: Sequence[str]) -> str:
    first = ", ".join(repr(k) for k in keys[:_MAX_LISTED])
    return first + (", ..." if len(keys) > _MAX_LISTED else "")


@dataclass
class ComponentPlan:
    """The conversion of one component (or of a whole exported file).

    ``entries``: ``{target_key: PlanEntry}``. ``unexpected``: source keys nothing understood (or that map to
    names the model does not have). ``ignored``: source keys known and deliberately dropped (buffers, EMA
    copies, the unused OpenCLIP layer ...). ``missing``: expected target keys nothing maps to (only when the
    plan was built with ``expected``). ``notes``: anything else worth telling the user.
    """

    component: str
    entries: dict[str, PlanEntry] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def apply(self, source: Mapping) -> ConvertedMapping:
        """Lazy view of ``source`` (a name->tensor Mapping holding the source keys) under this plan."""
        return ConvertedMapping(self.entries, source)

    def materialize(self, source: Mapping) -> dict:
        """All target tensors at once (for small models and tests)."""
        view = self.apply(source)
        return {k: view[k] for k in view}

    def shapes(self, source_shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """Target shapes from source shapes (values may be shapes or anything with ``.shape``)."""
        return {k: e.transform.shape([_shape_of(source_shapes[s]) for s in e.sources], k)
                for k, e in self.entries.items()}

    @property
    def source_keys(self) -> set[str]:
        return {s for e in self.entries.values() for s in e.sources}

    def report(self) -> str:
        """One line per problem: "N missing keys, first few: ..." and "N unexpected keys: ..."."""
        lines = []
        if self.missing:
            lines.append(f"{self.component}: {len(self.missing)} missing keys, first few: {_listing(self.missing)}")
        if self.unexpected:
            lines.append(f"{self.component}: {len(self.unexpected)} unexpected keys, first few: "
                         f"{_listing(self.unexpected)}")
        lines.extend(f"{self.component}: {n}" for n in self.notes)
        return "\n".join(lines)


def _shape_of(value) -> tuple[int, ...]:
    shape = getattr(value, "shape", value)
    return tuple(int(d) for d in shape)


@dataclass
class CheckpointPlan:
    """The conversion of a whole single file: one :class:`ComponentPlan` per component found.

    For an import (``plan_from_original``) the components are ``unet``, ``vae`` and ``text_encoder`` and
    their sources are keys of the file; ``unexpected``/``ignored`` hold file keys outside every component.
    For an export (``plan_to_original``) each component's targets are original keys and its sources are
    canonical keys of that component.
    """

    components: dict[str, ComponentPlan] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def split(self, source: Mapping) -> dict[str, ConvertedMapping]:
        """Import: lazy canonical views per component of one original-layout Mapping."""
        return {name: plan.apply(source) for name, plan in self.components.items()}

    def merge(self, sources: Mapping[str, Mapping]) -> "_MergedMapping":
        """Export: one lazy original-layout Mapping from per-component canonical Mappings."""
        missing = [name for name in self.components if name not in sources]
        if missing:
            raise ConversionError(f"export needs the state dict of component(s) {missing}")
        return _MergedMapping([(p.entries, sources[n]) for n, p in self.components.items()])

    def report(self) -> str:
        lines = [p.report() for p in self.components.values()]
        if self.unexpected:
            lines.append(f"{len(self.unexpected)} unexpected keys outside the known components, first few: "
                         f"{_listing(self.unexpected)}")
        lines.extend(self.notes)
        return "\n".join(line for line in lines if line)


class _MergedMapping(Mapping):
    def __init__(self, parts: list[tuple[Mapping[str, PlanEntry], Mapping]]):
        self._where: dict[str, tuple[Mapping[str, PlanEntry], Mapping]] = {}
        for entries, source in parts:
            for k in entries:
                if k in self._where:
                    raise ConversionError(f"two components export the same key {k!r}", key=k)
                self._where[k] = (entries, source)

    def __getitem__(self, key):
        entries, source = self._where[key]
        return ConvertedMapping(entries, source)[key]

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)

    def __contains__(self, key):
        return key in self._where


# --- renaming rules ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    """Maps the module prefix ``orig`` (original layout) to ``canon`` (canonical layout).

    ``kind``: ``leaf`` (the rest of the key is one parameter name), ``subtree`` (the rest is copied as is),
    ``table`` (the rest is ``module.param`` with ``module`` renamed by ``table``) or ``exact`` (the whole key).
    ``indexed``: one numeric level (``.N``) follows the prefix and is kept. ``linear``: canonical modules
    (of a table) whose ``weight`` is Linear in canonical and a 1x1 conv in the original layout.
    ``reverse``: used for canonical->original (False for tolerated alternative spellings).
    """

    orig: str
    canon: str
    kind: str = "leaf"
    table: tuple[tuple[str, str], ...] = ()
    indexed: bool = False
    linear: frozenset = frozenset()
    reverse: bool = True

    @cached_property
    def _to_canon(self) -> dict[str, str]:
        return dict(self.table)

    @cached_property
    def _to_orig(self) -> dict[str, str]:
        return {c: o for o, c in self.table}

    def rename(self, rest: str, to_canon: bool) -> tuple[str, Transform] | None:
        index = ""
        if self.indexed:
            head, _, rest = rest.partition(".")
            if not head.isdigit() or not rest:
                return None
            index = head + "."
        if self.kind == "exact":
            return ("", COPY) if rest == "" and not index else None
        if self.kind == "subtree":
            return (index + rest, COPY) if rest else None
        if self.kind == "leaf":
            return (index + rest, COPY) if rest and "." not in rest else None
        module, _, param = rest.rpartition(".")
        if not module:
            return None
        new = (self._to_canon if to_canon else self._to_orig).get(module)
        if new is None:
            return None
        canon_module = new if to_canon else module
        transform = COPY
        if param == "weight" and canon_module in self.linear:
            transform = _TO_LINEAR if to_canon else _TO_CONV
        return f"{index}{new}.{param}", transform


class _RuleSet:
    def __init__(self, rules: Iterable[_Rule]):
        self.fwd: dict[str, _Rule] = {}
        self.bwd: dict[str, _Rule] = {}
        for r in rules:
            if r.orig in self.fwd:
                raise AssertionError(f"duplicate original prefix {r.orig!r}")
            self.fwd[r.orig] = r
            if r.reverse:
                if r.canon in self.bwd:
                    raise AssertionError(f"duplicate canonical prefix {r.canon!r}")
                self.bwd[r.canon] = r

    def map(self, key: str, to_canon: bool) -> tuple[str, Transform] | None:
        """The other layout's name (and transform) for ``key`` (prefix-free), by longest matching prefix."""
        index = self.fwd if to_canon else self.bwd
        prefix = key
        while True:
            rule = index.get(prefix)
            if rule is not None:
                rest = key[len(prefix) + 1:]
                out = rule.rename(rest, to_canon)
                if out is not None:
                    new_rest, transform = out
                    base = rule.canon if to_canon else rule.orig
                    return (f"{base}.{new_rest}" if new_rest else base), transform
            cut = prefix.rfind(".")
            if cut < 0:
                return None
            prefix = prefix[:cut]


def _build(component: str, keys: Iterable[str], rules: _RuleSet, *, to_canon: bool, src_prefix: str,
           dst_prefix: str, ignore=None, expected: Iterable[str] | None = None) -> ComponentPlan:
    plan = ComponentPlan(component)
    for key in keys:
        if not key.startswith(src_prefix):
            continue
        name = key[len(src_prefix):]
        if ignore is not None and ignore(name):
            plan.ignored.append(key)
            continue
        out = rules.map(name, to_canon)
        if out is None:
            plan.unexpected.append(key)
            continue
        target = dst_prefix + out[0]
        _add(plan, target, PlanEntry((key,), out[1]))
    _check_expected(plan, expected)
    return plan


def _add(plan: ComponentPlan, target: str, entry: PlanEntry) -> None:
    old = plan.entries.get(target)
    if old is not None:
        raise ConversionError(
            f"{plan.component}: keys {old.sources[0]!r} and {entry.sources[0]!r} both map to {target!r}", key=target)
    plan.entries[target] = entry


def _check_expected(plan: ComponentPlan, expected: Iterable[str] | None) -> None:
    if expected is None:
        return
    expected = list(expected)
    wanted = set(expected)
    for target in [t for t in plan.entries if t not in wanted]:
        for source in plan.entries.pop(target).sources:
            if source not in plan.unexpected:
                plan.unexpected.append(source)
    plan.missing.extend(k for k in expected if k not in plan.entries)


# --- UNet --------------------------------------------------------------------------------------------------

_UNET_RESNET = (
    ("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("emb_layers.1", "time_emb_proj"),
    ("out_layers.0", "norm2"), ("out_layers.3", "conv2"), ("skip_connection", "conv_shortcut"),
)


@dataclass(frozen=True)
class UNetStructure:
    """What the UNet's block numbering depends on.

    ``down_attention[i]``: level i of the down path (highest resolution first) has spatial transformers;
    ``up_attention[i]``: ``up_blocks.i`` (lowest resolution first) has them; ``mid_attention``: the middle
    block is resnet-attention-resnet (else resnet-resnet).
    """

    num_levels: int
    layers_per_block: int
    down_attention: tuple[bool, ...]
    up_attention: tuple[bool, ...]
    mid_attention: bool = True

    def __post_init__(self):
        if self.num_levels < 1 or self.layers_per_block < 1:
            raise ConversionError(f"UNet structure: {self.num_levels} levels, {self.layers_per_block} layers per "
                                  "block (both must be >= 1)")
        if len(self.down_attention) != self.num_levels or len(self.up_attention) != self.num_levels:
            raise ConversionError(f"UNet structure: {self.num_levels} levels but {len(self.down_attention)} down "
                                  f"and {len(self.up_attention)} up attention flags")

    @classmethod
    def from_diffusers_config(cls, cfg: Mapping | Any) -> "UNetStructure":
        """From a diffusers ``UNet2DConditionModel`` config (a dict or an object with attributes), or from an
        object/dict with sdlite ``UNetConfig`` fields (``attention``, ``layers_per_block``)."""
        def get(name, default=None):
            return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)

        if get("down_block_types") is None and get("attention") is not None:  # sdlite's own UNetConfig
            return cls.from_attention(get("attention"), get("layers_per_block", 2))
        down_types = list(get("down_block_types"))
        up_types = list(get("up_block_types"))
        kinds = {"CrossAttnDownBlock2D": True, "DownBlock2D": False, "CrossAttnUpBlock2D": True, "UpBlock2D": False}
        for t in down_types + up_types:
            if t not in kinds:
                raise ConversionError(f"UNet config: block type {t!r} has no original-layout mapping")
        lpb = get("layers_per_block", 2)
        if isinstance(lpb, (list, tuple)):
            if len(set(lpb)) != 1:
                raise ConversionError(f"UNet config: layers_per_block={list(lpb)} must be the same at every level")
            lpb = lpb[0]
        mid = get("mid_block_type", "UNetMidBlock2DCrossAttn")
        if mid not in ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D"):
            raise ConversionError(f"UNet config: mid_block_type={mid!r} has no original-layout mapping")
        return cls(len(down_types), int(lpb), tuple(kinds[t] for t in down_types),
                   tuple(kinds[t] for t in up_types), mid == "UNetMidBlock2DCrossAttn")

    @classmethod
    def from_attention(cls, attention: Sequence[bool], layers_per_block: int) -> "UNetStructure":
        """From per-level attention flags (down path) with a mirrored up path, as sdlite's UNetConfig has."""
        attention = tuple(bool(a) for a in attention)
        return cls(len(attention), layers_per_block, attention, attention[::-1], True)

    def rules(self) -> _RuleSet:
        """The full name table, derived from the structure."""
        lpb = self.layers_per_block
        rules = [
            _Rule("time_embed.0", "time_embedding.linear_1"),
            _Rule("time_embed.2", "time_embedding.linear_2"),
            # SDXL's added conditioning (pooled text + size/crop ids): an MLP like the time embedding's
            _Rule("label_emb.0.0", "add_embedding.linear_1"),
            _Rule("label_emb.0.2", "add_embedding.linear_2"),
            # a class-conditioned UNet's embedding table (the x4 upscaler's noise level): nn.Embedding in both
            _Rule("label_emb", "class_embedding"),
            _Rule("input_blocks.0.0", "conv_in"),
            _Rule("out.0", "conv_norm_out"),
            _Rule("out.2", "conv_out"),
        ]
        for i in range(self.num_levels):
            for j in range(lpb):
                n = 1 + i * (lpb + 1) + j
                rules.append(_Rule(f"input_blocks.{n}.0", f"down_blocks.{i}.resnets.{j}", "table", _UNET_RESNET))
                if self.down_attention[i]:
                    rules.append(_Rule(f"input_blocks.{n}.1", f"down_blocks.{i}.attentions.{j}", "subtree"))
            if i < self.num_levels - 1:
                n = (i + 1) * (lpb + 1)
                rules.append(_Rule(f"input_blocks.{n}.0.op", f"down_blocks.{i}.downsamplers.0.conv"))
        rules.append(_Rule("middle_block.0", "mid_block.resnets.0", "table", _UNET_RESNET))
        if self.mid_attention:
            rules.append(_Rule("middle_block.1", "mid_block.attentions.0", "subtree"))
            rules.append(_Rule("middle_block.2", "mid_block.resnets.1", "table", _UNET_RESNET))
        else:
            rules.append(_Rule("middle_block.1", "mid_block.resnets.1", "table", _UNET_RESNET))
        for u in range(self.num_levels):
            for j in range(lpb + 1):
                n = u * (lpb + 1) + j
                rules.append(_Rule(f"output_blocks.{n}.0", f"up_blocks.{u}.resnets.{j}", "table", _UNET_RESNET))
                if self.up_attention[u]:
                    rules.append(_Rule(f"output_blocks.{n}.1", f"up_blocks.{u}.attentions.{j}", "subtree"))
                if j == lpb and u < self.num_levels - 1:
                    slot = 2 if self.up_attention[u] else 1
                    rules.append(_Rule(f"output_blocks.{n}.{slot}.conv", f"up_blocks.{u}.upsamplers.0.conv"))
        return _RuleSet(rules)


def ema_key(original_key: str) -> str:
    """The EMA copy's name of a UNet key: ``model.diffusion_model.a.b`` -> ``model_ema.diffusion_modelab``."""
    return EMA_PREFIX + original_key.split(".", 1)[1].replace(".", "")


def _unet_structure(keys: Sequence[str], structure, *, original: bool, prefix: str) -> UNetStructure:
    if isinstance(structure, UNetStructure):
        return structure
    if structure is not None:
        return UNetStructure.from_diffusers_config(structure)
    from .detect import unet_structure_from_keys

    return unet_structure_from_keys(keys, layout="original" if original else "diffusers", prefix=prefix)


def unet_from_original(keys: Iterable[str], structure: UNetStructure | Mapping | None = None, *,
                       prefix: str = UNET_PREFIX, use_ema: bool = False,
                       expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical UNet key: PlanEntry}`` for the original-layout UNet keys under ``prefix``.

    ``structure``: a :class:`UNetStructure`, a diffusers UNet config dict, or None to infer it from the keys.
    ``use_ema``: take each tensor from its ``model_ema.`` copy when the file has one (EMA keys are otherwise
    ignored). ``expected``: the model's canonical keys, to report missing / unknown names.
    """
    keys = list(keys)
    structure = _unet_structure(keys, structure, original=True, prefix=prefix)
    plan = _build("unet", keys, structure.rules(), to_canon=True, src_prefix=prefix, dst_prefix="",
                  expected=expected)
    if use_ema:
        present = set(keys)
        swapped = 0
        for target, entry in plan.entries.items():
            src = entry.sources[0]
            if src.startswith(UNET_PREFIX) and ema_key(src) in present:
                plan.entries[target] = PlanEntry((ema_key(src),), entry.transform)
                plan.ignored.append(src)
                swapped += 1
        if swapped < len(plan.entries):
            plan.notes.append(f"use_ema: {swapped} of {len(plan.entries)} UNet tensors have an EMA copy; "
                              "the others use the regular weights")
    return plan


def unet_to_original(keys: Iterable[str], structure: UNetStructure | Mapping | None = None, *,
                     prefix: str = UNET_PREFIX) -> ComponentPlan:
    """Plan ``{original key: PlanEntry}`` (with ``prefix``) from canonical UNet keys."""
    keys = list(keys)
    structure = _unet_structure(keys, structure, original=False, prefix="")
    return _build("unet", keys, structure.rules(), to_canon=False, src_prefix="", dst_prefix=prefix)


# --- ControlNet ---------------------------------------------------------------------------------------------

CONTROLNET_PREFIX = "control_model."   # lllyasviel's files (the SD 2.1 ControlNets have no prefix)


def controlnet_rules(structure: UNetStructure, hint_convs: int) -> _RuleSet:
    """The UNet's encoder-side names (:meth:`UNetStructure.rules`) plus the ControlNet's own: the hint encoder's
    ``hint_convs`` convolutions (``input_hint_block.0, .2, ...``, SiLUs between them; the first is ``conv_in``, the
    last ``conv_out``), the zero convolutions ``zero_convs.N.0`` and ``middle_block_out.0``."""
    rules = list(structure.rules().fwd.values())
    for j in range(hint_convs):
        canon = ("controlnet_cond_embedding.conv_in" if j == 0 else "controlnet_cond_embedding.conv_out"
                 if j == hint_convs - 1 else f"controlnet_cond_embedding.blocks.{j - 1}")
        rules.append(_Rule(f"input_hint_block.{2 * j}", canon))
    skips = 1 + structure.num_levels * structure.layers_per_block + structure.num_levels - 1
    rules += [_Rule(f"zero_convs.{n}.0", f"controlnet_down_blocks.{n}") for n in range(skips)]
    rules.append(_Rule("middle_block_out.0", "controlnet_mid_block"))
    return _RuleSet(rules)


def controlnet_from_original(keys: Iterable[str], structure: UNetStructure, hint_convs: int, *,
                             prefix: str = CONTROLNET_PREFIX, expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical ControlNet key: PlanEntry}`` for original-layout ControlNet keys under ``prefix``."""
    return _build("controlnet", list(keys), controlnet_rules(structure, hint_convs), to_canon=True,
                  src_prefix=prefix, dst_prefix="", expected=expected)


def controlnet_to_original(keys: Iterable[str], structure: UNetStructure, hint_convs: int, *,
                           prefix: str = CONTROLNET_PREFIX) -> ComponentPlan:
    """Plan ``{original key (with prefix): PlanEntry}`` from canonical ControlNet keys (lllyasviel's layout)."""
    return _build("controlnet", list(keys), controlnet_rules(structure, hint_convs), to_canon=False, src_prefix="",
                  dst_prefix=prefix)


# --- VAE ---------------------------------------------------------------------------------------------------

_VAE_RESNET = (("norm1", "norm1"), ("conv1", "conv1"), ("norm2", "norm2"), ("conv2", "conv2"),
               ("nin_shortcut", "conv_shortcut"))
_VAE_ATTENTION = (("norm", "group_norm"), ("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0"))
_VAE_LINEAR = frozenset({"to_q", "to_k", "to_v", "to_out.0"})


def _vae_rules(num_levels: int) -> _RuleSet:
    rules = [_Rule("quant_conv", "quant_conv"), _Rule("post_quant_conv", "post_quant_conv")]
    for part in ("encoder", "decoder"):
        rules += [
            _Rule(f"{part}.conv_in", f"{part}.conv_in"),
            _Rule(f"{part}.conv_out", f"{part}.conv_out"),
            _Rule(f"{part}.norm_out", f"{part}.conv_norm_out"),
            _Rule(f"{part}.mid.block_1", f"{part}.mid_block.resnets.0", "table", _VAE_RESNET),
            _Rule(f"{part}.mid.block_2", f"{part}.mid_block.resnets.1", "table", _VAE_RESNET),
            _Rule(f"{part}.mid.attn_1", f"{part}.mid_block.attentions.0", "table", _VAE_ATTENTION,
                  linear=_VAE_LINEAR),
        ]
    for i in range(num_levels):
        rules.append(_Rule(f"encoder.down.{i}.block", f"encoder.down_blocks.{i}.resnets", "table", _VAE_RESNET,
                           indexed=True))
        rules.append(_Rule(f"encoder.down.{i}.downsample.conv", f"encoder.down_blocks.{i}.downsamplers.0.conv"))
        u = num_levels - 1 - i  # the decoder's up.N counts from the lowest resolution, up_blocks.N from the top
        rules.append(_Rule(f"decoder.up.{i}.block", f"decoder.up_blocks.{u}.resnets", "table", _VAE_RESNET,
                           indexed=True))
        rules.append(_Rule(f"decoder.up.{i}.upsample.conv", f"decoder.up_blocks.{u}.upsamplers.0.conv"))
    return _RuleSet(rules)


def _vae_levels(keys: Sequence[str], prefix: str, original: bool) -> int:
    pattern = re.compile(re.escape(prefix) + (r"encoder\.down\.(\d+)\." if original else
                                              r"encoder\.down_blocks\.(\d+)\."))
    levels = {int(m.group(1)) for k in keys if (m := pattern.match(k))}
    if not levels:
        pattern = re.compile(re.escape(prefix) + (r"decoder\.up\.(\d+)\." if original else
                                                  r"decoder\.up_blocks\.(\d+)\."))
        levels = {int(m.group(1)) for k in keys if (m := pattern.match(k))}
    if not levels:
        raise ConversionError(f"VAE: no encoder/decoder level keys under {prefix!r}; cannot tell the number of "
                              "levels (pass num_levels)")
    return max(levels) + 1


def vae_from_original(keys: Iterable[str], num_levels: int | None = None, *, prefix: str = VAE_PREFIX,
                      expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical VAE key: PlanEntry}`` for the original-layout VAE keys under ``prefix``.

    ``num_levels`` (``len(block_out_channels)``) is needed for the decoder's reversed numbering; None infers
    it from the keys. Attention q/k/v/proj_out 1x1 conv weights become Linear weights.
    """
    keys = list(keys)
    n = num_levels or _vae_levels(keys, prefix, original=True)
    return _build("vae", keys, _vae_rules(n), to_canon=True, src_prefix=prefix, dst_prefix="", expected=expected)


def vae_to_original(keys: Iterable[str], num_levels: int | None = None, *,
                    prefix: str = VAE_PREFIX) -> ComponentPlan:
    """Plan ``{original key: PlanEntry}`` from canonical VAE keys (Linear attention weights -> 1x1 convs)."""
    keys = list(keys)
    n = num_levels or _vae_levels(keys, "", original=False)
    return _build("vae", keys, _vae_rules(n), to_canon=False, src_prefix="", dst_prefix=prefix)


# --- text encoders -----------------------------------------------------------------------------------------

_CLIP_RULES = _RuleSet([
    _Rule("text_model", "text_model", "subtree"),
    # older files lack the text_model level
    _Rule("embeddings", "text_model.embeddings", "subtree", reverse=False),
    _Rule("encoder", "text_model.encoder", "subtree", reverse=False),
    _Rule("final_layer_norm", "text_model.final_layer_norm", "subtree", reverse=False),
])


def _is_position_ids(name: str) -> bool:
    return name.endswith("embeddings.position_ids")


def clip_from_original(keys: Iterable[str], *, prefix: str = CLIP_PREFIX,
                       expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan for the SD 1.x (OpenAI CLIP, transformers names) text encoder under ``prefix``.

    Keys with or without the ``text_model.`` level are accepted; ``position_ids`` buffers are ignored.
    """
    return _build("text_encoder", keys, _CLIP_RULES, to_canon=True, src_prefix=prefix, dst_prefix="",
                  ignore=_is_position_ids, expected=expected)


def clip_to_original(keys: Iterable[str], *, prefix: str = CLIP_PREFIX) -> ComponentPlan:
    """Plan ``{original key: PlanEntry}`` for an SD 1.x text encoder (``...transformer.text_model.*``)."""
    return _build("text_encoder", keys, _CLIP_RULES, to_canon=False, src_prefix="", dst_prefix=prefix,
                  ignore=_is_position_ids)


_OPENCLIP_LAYER = (("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("mlp.c_fc", "mlp.fc1"),
                   ("mlp.c_proj", "mlp.fc2"), ("attn.out_proj", "self_attn.out_proj"))
_OPENCLIP_RULES = _RuleSet([
    _Rule("token_embedding", "text_model.embeddings.token_embedding"),
    _Rule("positional_embedding", "text_model.embeddings.position_embedding.weight", "exact"),
    _Rule("ln_final", "text_model.final_layer_norm"),
    _Rule("transformer.resblocks", "text_model.encoder.layers", "table", _OPENCLIP_LAYER, indexed=True),
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
                _add(plan, f"text_model.encoder.layers.{layer}.self_attn.{part}_proj.{param}",
                     PlanEntry((key,), Transform("chunk", (i, 3))))
        elif projection and name == "text_projection":
            _add(plan, "text_projection.weight", PlanEntry((key,), _TRANSPOSE))
        elif projection and name == "text_projection.weight":  # towers built with a Linear projection
            _add(plan, "text_projection.weight", PlanEntry((key,), COPY))
        else:
            rest.append(key)
    sub = _build(component, rest, _OPENCLIP_RULES, to_canon=True, src_prefix=prefix, dst_prefix="",
                 ignore=ignore)
    for target, entry in sub.entries.items():
        _add(plan, target, entry)
    plan.unexpected += sub.unexpected
    plan.ignored += sub.ignored
    _check_expected(plan, expected)
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
            _add(plan, f"{prefix}text_projection", PlanEntry((key,), _TRANSPOSE))
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
        _add(plan, f"{prefix}transformer.resblocks.{layer}.attn.in_proj_{param}", PlanEntry(group, _CAT))
    sub = _build(component, rest, _OPENCLIP_RULES, to_canon=False, src_prefix="", dst_prefix=prefix,
                 ignore=_is_position_ids)
    for target, entry in sub.entries.items():
        _add(plan, target, entry)
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


# --- diffusers folders -------------------------------------------------------------------------------------

_LEGACY_VAE_ATTENTION = re.compile(r"(.*\.attentions\.\d+)\.(query|key|value|proj_attn)\.(weight|bias)")
_LEGACY_VAE_NAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_TEXT_TOP = ("embeddings.", "encoder.", "final_layer_norm.")


def normalize_diffusers_keys(keys: Iterable[str], component: str, *,
                             expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan from the keys of a diffusers-folder component to canonical names.

    ``component``: ``unet``, ``vae``, ``text_encoder`` or ``text_encoder_2``. Canonical keys map to themselves;
    the legacy VAE attention names ``query/key/value/proj_attn`` become ``to_q/to_k/to_v/to_out.0`` (1x1
    conv-shaped weights made Linear); text-encoder keys saved without the ``text_model.`` level get it;
    ``position_ids`` buffers are ignored.
    """
    if component not in ("unet", "vae", "text_encoder", "text_encoder_2"):
        raise ConversionError(f"unknown component {component!r} (expected unet, vae, text_encoder or "
                              "text_encoder_2)")
    plan = ComponentPlan(component)
    for key in keys:
        target, transform = key, COPY
        if component == "vae":
            m = _LEGACY_VAE_ATTENTION.fullmatch(key)
            if m:
                target = f"{m.group(1)}.{_LEGACY_VAE_NAMES[m.group(2)]}.{m.group(3)}"
                if m.group(3) == "weight":
                    transform = _TO_LINEAR
            elif key.endswith(".weight") and re.search(r"\.attentions\.\d+\.to_(q|k|v|out\.0)\.weight$", key):
                transform = _TO_LINEAR  # tolerate conv-shaped modern names too
        elif component in ("text_encoder", "text_encoder_2"):
            if _is_position_ids(key):
                plan.ignored.append(key)
                continue
            if key.startswith(_TEXT_TOP):
                target = "text_model." + key
        _add(plan, target, PlanEntry((key,), transform))
    _check_expected(plan, expected)
    return plan


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
        _add(plan, target, PlanEntry((key,), COPY))
    _check_expected(plan, expected)
    return plan


# --- TAESD ------------------------------------------------------------------------------------------------

# madebyollin/taesd saves each half of a TAESD as a bare ``nn.Sequential`` state dict (``N.weight``,
# ``N.conv.M.weight``; A1111's taesd_decoder.pth / taesdxl_decoder.pth), at times under a prefix. Its decoder starts
# with a parameterless Clamp module, so its layer N is the canonical (diffusers ``AutoencoderTiny``)
# ``decoder.layers.{N-1}``; the encoder is numbered alike in both. The canonical layout needs no table.
TAESD_PARTS = ("decoder", "encoder")
TAESD_INDEX_SHIFT = {"decoder": 1, "encoder": 0}
_TAESD_LAYER = re.compile(r"(\d+)\.")


def taesd_from_original(keys: Iterable[str], part: str, *, prefix: str = "",
                        expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical key: PlanEntry}`` for one TAESD half (``part``: decoder or encoder) in madebyollin's
    layout under ``prefix``; keys outside ``prefix`` are not looked at. With ``expected`` (the canonical keys of the
    module to load), keys it does not have are listed in ``unexpected`` and those nothing maps to in ``missing``."""
    if part not in TAESD_INDEX_SHIFT:
        raise ConversionError(f"unknown TAESD part {part!r} (expected decoder or encoder)")
    keys = list(keys)
    shift = TAESD_INDEX_SHIFT[part]
    layers = sorted({int(m.group(1)) for k in keys
                     if k.startswith(prefix) and (m := _TAESD_LAYER.match(k[len(prefix):]))})
    rules = _RuleSet(_Rule(str(n), f"{part}.layers.{n - shift}", "subtree") for n in layers if n >= shift)
    return _build(f"TAESD {part}", keys, rules, to_canon=True, src_prefix=prefix, dst_prefix="", expected=expected)


# --- whole files -------------------------------------------------------------------------------------------


def _is_file_buffer(key: str) -> bool:
    return key in SCHEDULE_BUFFERS or key in MARKER_KEYS or key.startswith((EMA_PREFIX, LOW_SCALE_PREFIX))


def plan_from_original(keys: Iterable[str], *, unet_structure: UNetStructure | Mapping | None = None,
                       vae_levels: int | None = None, text_encoder_layers: int | None = None,
                       use_ema: bool = False,
                       expected: Mapping[str, Iterable[str]] | None = None) -> CheckpointPlan:
    """Plan the import of a whole original-layout single file (UNet, VAE, text encoder(s), whichever are there).

    An SD 1.x/2.x file has one text encoder (``cond_stage_model.``), an SDXL file (SGM layout) ``text_encoder``
    and/or ``text_encoder_2`` (:func:`sgm_text_prefixes`; bigG keeps all its layers and its projection).
    Structure arguments default to what the keys show. ``expected``: ``{component: canonical keys}`` of the
    models to load, for missing/unexpected reporting (and the OpenCLIP layer count). Schedule buffers
    (``betas``, ``alphas_cumprod`` ...), markers and ``model_ema.*`` copies are ignored and listed in
    ``ignored``; keys outside every known prefix are listed in ``unexpected``.
    """
    keys = list(keys)
    expected = expected or {}
    plan = CheckpointPlan()
    if any(k.startswith(UNET_PREFIX) for k in keys):
        plan.components["unet"] = unet_from_original(keys, unet_structure, use_ema=use_ema,
                                                     expected=expected.get("unet"))
    if any(k.startswith(VAE_PREFIX) for k in keys):
        plan.components["vae"] = vae_from_original(keys, vae_levels, expected=expected.get("vae"))
    has_clip = any(k.startswith(CLIP_PREFIX) for k in keys)
    has_openclip = any(k.startswith(OPENCLIP_PREFIX) for k in keys)
    sgm = sgm_text_prefixes(keys)
    if has_clip and has_openclip:
        raise ConversionError(f"the file has both an OpenAI CLIP ({CLIP_PREFIX!r}) and an OpenCLIP "
                              f"({OPENCLIP_PREFIX!r}) text encoder")
    if sgm and (has_clip or has_openclip):
        raise ConversionError(f"the file has both SD 1.x/2.x ('cond_stage_model.') and SDXL ({EMBEDDERS_PREFIX!r}) "
                              "text encoders")
    if has_clip:
        plan.components["text_encoder"] = clip_from_original(keys, expected=expected.get("text_encoder"))
    elif has_openclip:
        plan.components["text_encoder"] = openclip_from_original(
            keys, num_layers=text_encoder_layers, expected=expected.get("text_encoder"))
    if "text_encoder" in sgm:
        plan.components["text_encoder"] = clip_from_original(keys, prefix=sgm["text_encoder"],
                                                             expected=expected.get("text_encoder"))
    if "text_encoder_2" in sgm:
        plan.components["text_encoder_2"] = openclip_from_original(
            keys, prefix=sgm["text_encoder_2"], component="text_encoder_2", projection=True,
            expected=expected.get("text_encoder_2"))
    prefixes = (UNET_PREFIX, VAE_PREFIX, CLIP_PREFIX, OPENCLIP_PREFIX, *sgm.values())
    for key in keys:
        if key.startswith(prefixes):
            continue
        (plan.ignored if _is_file_buffer(key) else plan.unexpected).append(key)
    for name in expected:
        if name not in plan.components:
            plan.notes.append(f"the file has no {name} (expected by the caller)")
    return plan


def plan_to_original(components: Mapping[str, Iterable[str]], *, text_encoder: str = "clip",
                     unet_structure: UNetStructure | Mapping | None = None,
                     vae_levels: int | None = None) -> CheckpointPlan:
    """Plan the export of canonical components to one original-layout single file.

    ``components``: ``{"unet"|"vae"|"text_encoder"|"text_encoder_2": canonical keys}``. ``text_encoder``:
    ``"clip"`` (SD 1.x, ``cond_stage_model.transformer.``) or ``"openclip"`` (SD 2.x, ``cond_stage_model.model.``).
    With a ``text_encoder_2`` the file is an SDXL one in the SGM layout: ``text_encoder`` (CLIP ViT-L) is
    ``conditioner.embedders.0.transformer.`` and ``text_encoder_2`` (bigG, with its projection) the next embedder,
    ``conditioner.embedders.1.model.`` (``0`` when there is no ``text_encoder``: the refiner). Use
    :meth:`CheckpointPlan.merge` with the components' state dicts to get the lazy original-layout mapping.
    """
    plan = CheckpointPlan()
    sdxl = "text_encoder_2" in components
    for name, keys in components.items():
        if name == "unet":
            plan.components[name] = unet_to_original(keys, unet_structure)
        elif name == "vae":
            plan.components[name] = vae_to_original(keys, vae_levels)
        elif name == "text_encoder" and sdxl:
            plan.components[name] = clip_to_original(keys, prefix=SDXL_CLIP_PREFIX)
        elif name == "text_encoder_2":
            prefix = SDXL_OPENCLIP_PREFIX if "text_encoder" in components else EMBEDDERS_PREFIX + "0.model."
            plan.components[name] = openclip_to_original(keys, prefix=prefix, component=name)
        elif name == "text_encoder":
            if text_encoder == "clip":
                plan.components[name] = clip_to_original(keys)
            elif text_encoder == "openclip":
                plan.components[name] = openclip_to_original(keys)
            else:
                raise ConversionError(f"text_encoder={text_encoder!r}: expected 'clip' or 'openclip'")
        else:
            raise ConversionError(f"unknown component {name!r} (expected unet, vae, text_encoder or text_encoder_2)")
    return plan
