"""The keys of SD3's MMDiT (:mod:`sdlite.models.mmdit`): their names in each layout, the config the shapes show
(:func:`infer_mmdit_config`) and a checked key-for-key load (:func:`load_mmdit`).

The canonical names are diffusers' ``SD3Transformer2DModel`` ones, which a diffusers folder's
``transformer/diffusion_pytorch_model*.safetensors`` carries as they are. Stability's single files name the network
under ``model.diffusion_model.`` (some copies without that prefix) after their reference code:

* ``x_embedder.proj`` (the patch convolution), ``pos_embed`` (the positional table), ``t_embedder.mlp.0/2`` and
  ``y_embedder.mlp.0/2`` (the timestep and pooled-text MLPs), ``context_embedder``;
* per block ``joint_blocks.N.x_block`` (image stream) and ``.context_block`` (text stream): ``adaLN_modulation.1``,
  ``attn.qkv`` (q, k and v stacked along dim 0: split into ``to_q/to_k/to_v``, the text's into
  ``add_q_proj/add_k_proj/add_v_proj``), ``attn.proj``, ``attn.ln_q/ln_k`` (qk norms), ``mlp.fc1/fc2``; MMDiT-X's
  ``x_block.attn2.*`` likewise;
* ``final_layer.adaLN_modulation.1`` and ``final_layer.linear``.

Two modulations are stored as (shift, scale) by Stability and as (scale, shift) by diffusers: the output norm's
(``final_layer.adaLN_modulation.1`` -> ``norm_out.linear``) and the last block's text-stream one (its context branch
is "pre-only": two parts, no attention output and no MLP); their halves are swapped, both ways. The other blocks'
six- (or nine-) part modulations share one order.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError
from ..config.mmdit import TIME_EMBED_CHANNELS, MMDiTConfig
from .plan import (
    ComponentPlan, ConversionError, Layouts, PlanEntry, Rule, RuleSet, Shapes, Transform, UnsupportedModelError,
    add_entry, add_fused, build_plan, check_expected, need_shape, same_names,
)

__all__ = [
    "MMDIT_PREFIX", "MMDIT_HEAD_DIM", "SWAP_HALVES", "mmdit_layout", "mmdit_from_original", "mmdit_to_original",
    "mmdit_from_diffusers", "mmdit_plan", "canonical_shapes", "infer_mmdit_config", "load_mmdit",
]

MMDIT_PREFIX = "model.diffusion_model."
# SD3's heads are 64 wide in every release; the head count leaves no trace in the shapes, so it is width / 64
MMDIT_HEAD_DIM = 64
COMPONENT = "transformer"


@dataclass(frozen=True)
class _SwapHalves(Transform):
    """The two halves along dim 0 exchanged: (shift, scale) <-> (scale, shift). Its own inverse."""

    op: str = "swap_halves"

    def __post_init__(self):
        pass

    def apply(self, tensors, key: str = "?"):
        self.shape([t.shape for t in tensors], key)
        import torch

        t = tensors[0]
        if hasattr(t, "dequantize") and not torch.is_tensor(t):   # a GGUF block format: halves as float32
            t = t.dequantize(torch.float32)
        half = t.shape[0] // 2
        return torch.cat([t[half:], t[:half]], dim=0)

    def shape(self, shapes, key: str = "?") -> tuple[int, ...]:
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if len(shapes) != 1 or not shapes[0] or shapes[0][0] % 2:
            raise ConversionError(f"cannot swap the halves of shape(s) {[list(s) for s in shapes]} along dim 0",
                                  key=key)
        return shapes[0]


SWAP_HALVES = _SwapHalves()

# --- the table ---------------------------------------------------------------------------------------------

# Stability's module inside joint_blocks.N -> diffusers' inside transformer_blocks.N (q/k/v and the swapped
# modulation are written by hand: they are not renames)
_BLOCK = (
    ("x_block.adaLN_modulation.1", "norm1.linear"),
    ("x_block.attn.proj", "attn.to_out.0"),
    ("x_block.attn.ln_q", "attn.norm_q"),
    ("x_block.attn.ln_k", "attn.norm_k"),
    ("x_block.attn2.proj", "attn2.to_out.0"),
    ("x_block.attn2.ln_q", "attn2.norm_q"),
    ("x_block.attn2.ln_k", "attn2.norm_k"),
    ("x_block.mlp.fc1", "ff.net.0.proj"),
    ("x_block.mlp.fc2", "ff.net.2"),
    ("context_block.adaLN_modulation.1", "norm1_context.linear"),
    ("context_block.attn.proj", "attn.to_add_out"),
    ("context_block.attn.ln_q", "attn.norm_added_q"),
    ("context_block.attn.ln_k", "attn.norm_added_k"),
    ("context_block.mlp.fc1", "ff_context.net.0.proj"),
    ("context_block.mlp.fc2", "ff_context.net.2"),
)
_RULES = RuleSet([
    Rule("x_embedder.proj", "pos_embed.proj"),
    Rule("pos_embed", "pos_embed.pos_embed", "exact"),
    Rule("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
    Rule("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
    Rule("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
    Rule("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
    Rule("context_embedder", "context_embedder"),
    Rule("final_layer.linear", "proj_out"),
    Rule("final_layer.adaLN_modulation.1", "norm_out.linear"),   # halves swapped (see the module's text)
    Rule("joint_blocks", "transformer_blocks", "table", _BLOCK, indexed=True),
])
# the fused projections: Stability's attention module -> diffusers' module and the names of its three parts
_QKV = {
    "x_block.attn": ("attn", ("to_q", "to_k", "to_v")),
    "x_block.attn2": ("attn2", ("to_q", "to_k", "to_v")),
    "context_block.attn": ("attn", ("add_q_proj", "add_k_proj", "add_v_proj")),
}
_QKV_OF_PART = {(attn, part): orig for orig, (attn, parts) in _QKV.items() for part in parts}
_ORIG_QKV = re.compile(r"joint_blocks\.(\d+)\.(x_block\.attn2?|context_block\.attn)\.qkv\.(weight|bias)")
_CANON_QKV = re.compile(r"transformer_blocks\.(\d+)\.(attn2?)\.(to_[qkv]|add_[qkv]_proj)\.(weight|bias)")
_ORIG_BLOCK = re.compile(r"joint_blocks\.(\d+)\.")
_CANON_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")
# where the halves are swapped: the output norm, and the last block's text modulation ({} = its index)
_ORIG_SWAPPED = ("final_layer.adaLN_modulation.1", "joint_blocks.{}.context_block.adaLN_modulation.1")
_CANON_SWAPPED = ("norm_out.linear", "transformer_blocks.{}.norm1_context.linear")


def _last_block(names: Iterable[str], pattern: re.Pattern) -> int | None:
    found = {int(m.group(1)) for n in names if (m := pattern.match(n))}
    return max(found) if found else None


def _swapped(templates: tuple[str, str], last: int | None) -> set[str]:
    modules = {templates[0]} | ({templates[1].format(last)} if last is not None else set())
    return {f"{m}.{p}" for m in modules for p in ("weight", "bias")}


def _merge(plan: ComponentPlan, sub: ComponentPlan) -> None:
    for target, entry in sub.entries.items():
        add_entry(plan, target, entry)
    plan.unexpected += sub.unexpected
    plan.ignored += sub.ignored


# --- plans -------------------------------------------------------------------------------------------------


def mmdit_from_original(keys: Iterable[str], *, prefix: str = MMDIT_PREFIX,
                        expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical key: PlanEntry}`` for Stability's MMDiT keys under ``prefix`` (``""`` for a file without
    it). ``qkv`` tensors are split in three; the output norm's and the last block's text modulation have their
    halves swapped. ``expected``: the model's canonical keys, to report missing and unknown names."""
    keys = [k for k in keys if k.startswith(prefix)]
    names = [k[len(prefix):] for k in keys]
    swapped = _swapped(_ORIG_SWAPPED, _last_block(names, _ORIG_BLOCK))
    plan = ComponentPlan(COMPONENT)
    rest = []
    for key, name in zip(keys, names):
        m = _ORIG_QKV.fullmatch(name)
        if m:
            block, module, param = m.groups()
            attn, parts = _QKV[module]
            for i, part in enumerate(parts):
                add_entry(plan, f"transformer_blocks.{block}.{attn}.{part}.{param}",
                          PlanEntry((key,), Transform("chunk", (i, 3))))
        elif name in swapped:
            canon = _RULES.map(name, to_canon=True)[0]
            add_entry(plan, canon, PlanEntry((key,), SWAP_HALVES))
        else:
            rest.append(key)
    _merge(plan, build_plan(COMPONENT, rest, _RULES, to_canon=True, src_prefix=prefix, dst_prefix=""))
    check_expected(plan, expected)
    return plan


def mmdit_to_original(keys: Iterable[str], *, prefix: str = MMDIT_PREFIX) -> ComponentPlan:
    """Plan ``{Stability key (with prefix): PlanEntry}`` from canonical MMDiT keys: each q/k/v triple becomes one
    ``qkv`` (of a triple with a part absent, the absent parts are listed in ``missing``, the others in
    ``unexpected``), the two (scale, shift) modulations become (shift, scale)."""
    keys = list(keys)
    swapped = _swapped(_CANON_SWAPPED, _last_block(keys, _CANON_BLOCK))
    plan = ComponentPlan(COMPONENT)
    triples: dict[tuple[str, str, str, str], list[str]] = {}   # (block, attn, Stability module, param) -> keys
    rest = []
    for key in keys:
        m = _CANON_QKV.fullmatch(key)
        if m:
            block, attn, part, param = m.groups()
            triples.setdefault((block, attn, _QKV_OF_PART[attn, part], param), []).append(key)
        elif key in swapped:
            add_entry(plan, prefix + _RULES.map(key, to_canon=False)[0], PlanEntry((key,), SWAP_HALVES))
        else:
            rest.append(key)
    for (block, attn, orig, param), present in triples.items():
        group = tuple(f"transformer_blocks.{block}.{attn}.{p}.{param}" for p in _QKV[orig][1])
        add_fused(plan, f"{prefix}joint_blocks.{block}.{orig}.qkv.{param}", group, present)
    _merge(plan, build_plan(COMPONENT, rest, _RULES, to_canon=False, src_prefix="", dst_prefix=prefix))
    return plan


def mmdit_from_diffusers(keys: Iterable[str], *, prefix: str = "",
                         expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan for diffusers' names (a ``transformer`` folder's weights, possibly sharded): each key under ``prefix`` as
    it is."""
    return same_names(COMPONENT, keys, prefix=prefix, expected=expected)


def mmdit_layout(keys: Iterable[str]) -> tuple[str, str]:
    """``(layout, prefix)`` of MMDiT weights from their key names: ``("stability", "model.diffusion_model.")``,
    ``("stability", "")`` for Stability's names without the prefix, or ``("diffusers", "")``."""
    keys = list(keys)
    for layout, prefix, markers in (("stability", MMDIT_PREFIX, ("joint_blocks.", "x_embedder.")),
                                    ("stability", "", ("joint_blocks.", "x_embedder.")),
                                    ("diffusers", "", ("transformer_blocks.", "pos_embed.proj."))):
        if any(k.startswith(prefix + marker) for k in keys for marker in markers):
            return layout, prefix
    raise UnsupportedModelError(
        f"no SD3 MMDiT keys among {len(keys)}: expected Stability's '{MMDIT_PREFIX}joint_blocks.N...' (or without "
        f"the prefix) or diffusers' 'transformer_blocks.N...'" + (f"; the first is {keys[0]!r}" if keys else ""))


def mmdit_plan(keys: Iterable[str], *, expected: Iterable[str] | None = None) -> ComponentPlan:
    """The plan to canonical names for MMDiT weights of either layout (:func:`mmdit_layout` decides)."""
    return LAYOUTS.plan(keys, expected)


# --- what the shapes say -----------------------------------------------------------------------------------


def canonical_shapes(shapes: Shapes) -> dict[str, tuple[int, ...]]:
    """The canonical MMDiT keys' shapes from the shapes (or tensors) of either layout, without reading data."""
    return LAYOUTS.shapes(shapes)


def infer_mmdit_config(shapes: Shapes, sample_size: int = 128, head_dim: int | None = None) -> MMDiTConfig:
    """The :class:`MMDiTConfig` that MMDiT weights of either layout show (shapes or tensors, by name).

    Blocks: the ``joint_blocks`` / ``transformer_blocks`` count; width, input channels and patch size: the patch
    convolution; heads: width / 64; positional grid: the side of ``pos_embed``'s token count; text and pooled widths:
    ``context_embedder`` and the pooled-text MLP; output channels: the final Linear over the patch area; qk norm:
    ``ln_q`` / ``norm_q`` present; dual attention: the blocks with ``attn2``. ``sample_size`` leaves no trace in the
    shapes (every release: 128); ``head_dim`` (None: from the shapes) is the qk norms' width where they exist (SD3.5),
    else 64 (every release)."""
    s = canonical_shapes(shapes)
    what = "SD3 MMDiT"
    proj = need_shape(s, "pos_embed.proj.weight", what)
    if len(proj) != 4 or proj[2] != proj[3]:
        raise UnsupportedModelError(f"{what}: the patch convolution 'pos_embed.proj.weight' has shape {list(proj)}, "
                                    "not (width, channels, patch, patch)")
    hidden, in_channels, patch = proj[0], proj[1], proj[2]
    pos = need_shape(s, "pos_embed.pos_embed", what)
    grid = math.isqrt(pos[1]) if len(pos) == 3 else 0
    if len(pos) != 3 or grid * grid != pos[1] or pos[2] != hidden:
        raise UnsupportedModelError(f"{what}: the positional table 'pos_embed.pos_embed' has shape {list(pos)}, not "
                                    f"(1, side * side, {hidden})")
    ctx = need_shape(s, "context_embedder.weight", what)
    pooled = need_shape(s, "time_text_embed.text_embedder.linear_1.weight", what)
    time = need_shape(s, "time_text_embed.timestep_embedder.linear_1.weight", what)
    if time[1:] != (TIME_EMBED_CHANNELS,):
        raise UnsupportedModelError(f"{what}: the timestep MLP takes {list(time[1:])} channels, expected "
                                    f"{TIME_EMBED_CHANNELS}")
    out = need_shape(s, "proj_out.weight", what)
    if out[0] % (patch * patch):
        raise UnsupportedModelError(f"{what}: the final Linear's {out[0]} outputs are not a multiple of the patch "
                                    f"area {patch}x{patch}")
    blocks = sorted({int(m.group(1)) for k in s if (m := _CANON_BLOCK.match(k))})
    if not blocks or blocks != list(range(len(blocks))):
        raise UnsupportedModelError(f"{what}: blocks {blocks[:8]}{'...' if len(blocks) > 8 else ''} are not "
                                    "numbered 0..n-1")
    norms = [k for k in s if re.fullmatch(r"transformer_blocks\.\d+\.attn2?\.norm_(added_)?[qk]\.\w+", k)]
    biased = [k for k in norms if not k.endswith(".weight")]
    if biased:
        raise UnsupportedModelError(f"{what}: the qk norms have a bias ({biased[0]!r}): a LayerNorm, where sdlite "
                                    "implements SD3.5's RMSNorm")
    if head_dim is None:
        norm = next((k for k in sorted(norms) if k.endswith(".weight")), None)
        head_dim = s[norm][0] if norm is not None else MMDIT_HEAD_DIM
    if hidden % head_dim:
        raise UnsupportedModelError(f"{what}: width {hidden} is not a multiple of the {head_dim}-wide heads")
    try:
        return MMDiTConfig(
            sample_size=sample_size, patch_size=patch, in_channels=in_channels, out_channels=out[0] // (patch * patch),
            num_layers=len(blocks), attention_head_dim=head_dim, num_attention_heads=hidden // head_dim,
            joint_attention_dim=ctx[1], caption_projection_dim=ctx[0], pooled_projection_dim=pooled[1],
            pos_embed_max_size=grid, qk_norm="rms_norm" if norms else None,
            dual_attention_layers=tuple(i for i in blocks if f"transformer_blocks.{i}.attn2.to_q.weight" in s))
    except ConfigError as e:
        raise UnsupportedModelError(f"{what}: {e}") from None


# --- loading -----------------------------------------------------------------------------------------------


def load_mmdit(model, source: Mapping[str, Any]):
    """Load MMDiT weights of either layout (a name -> tensor Mapping: a state dict, a TensorStore) into ``model``, an
    :class:`sdlite.models.mmdit.MMDiT`, key for key; it keeps its dtype and device (a model built on the meta device
    gets the tensors, converted to its dtype). Returns the model.

    Every check comes before any tensor is read: keys the model needs and the source lacks, source keys the model
    has no place for, and shape mismatches are a :class:`~sdlite.weights.plan.ConversionError` naming the key in the
    source's own layout (:func:`~sdlite.weights.plan.load_planned`)."""
    return LAYOUTS.load(model, source)


def _original_names(canonical: list[str], prefix: str) -> list[str]:
    """The names that canonical keys have in Stability's layout under ``prefix`` (for error messages)."""
    back = {e.sources[i]: target for target, e in mmdit_to_original(canonical, prefix=prefix).entries.items()
            for i in range(len(e.sources))}
    return list(dict.fromkeys(back.get(k, k) for k in canonical))


#: SD3's two layouts: Stability's (with or without its prefix) and diffusers' (the canonical names)
LAYOUTS = Layouts(mmdit_layout, {"stability": mmdit_from_original, "diffusers": mmdit_from_diffusers},
                  _original_names)
