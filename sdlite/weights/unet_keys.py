"""The keys of the UNet-shaped networks (the UNet, and the ControlNet that copies its encoder side): their names in
each layout, the block structure the names show and the config the shapes show (:class:`UNetInfo`).

The original single-file layout (LDM / CompVis / A1111) names the UNet, under ``model.diffusion_model.``, as
``input_blocks`` / ``middle_block`` / ``output_blocks``, ``time_embed`` and ``out``; the canonical names are
diffusers' ``UNet2DConditionModel`` ones. The block numbering follows from a :class:`UNetStructure` (number of
levels, resnets per level, which levels have attention), read from the key names when not given, so any config
works, not only SD 1.5's. SDXL's added-conditioning MLP is ``label_emb.0.0`` / ``label_emb.0.2`` (diffusers'
``add_embedding.linear_1/2``); a class-conditioned UNet's table (the x4 upscaler's noise-level embedding) is
``label_emb.weight`` (``class_embedding.weight``).

A ControlNet in lllyasviel's layout (``control_model.``) has the UNet's encoder-side names plus its own: the hint
encoder ``input_hint_block``, the zero convolutions ``zero_convs.N.0`` and ``middle_block_out.0``.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .plan import (
    ComponentPlan, ConversionError, PlanEntry, Rule, RuleSet, Shapes, UnsupportedModelError, build_plan, need_shape,
    shape_of,
)

__all__ = [
    "UNET_PREFIX", "EMA_PREFIX", "CONTROLNET_PREFIX", "UNetStructure", "unet_structure_from_keys", "ema_key",
    "unet_from_original", "unet_to_original", "controlnet_rules", "controlnet_from_original",
    "controlnet_to_original", "UNetInfo", "infer_unet", "script_aliases", "SD1_UNET_HEADS", "SD2_UNET_HEAD_DIM",
    "SDXL_TIME_EMBED_DIM",
]

UNET_PREFIX = "model.diffusion_model."
EMA_PREFIX = "model_ema."
# SD 1.x UNets use 8 heads at every level; SD 2.x UNets use 64-channel heads.
SD1_UNET_HEADS = 8
SD2_UNET_HEAD_DIM = 64
# SDXL embeds each time id (sizes and crop; the refiner: an aesthetic score) sinusoidally in this many channels; the
# shapes show it only beside the pooled text width (sdlite.weights.detect), so this is the default
SDXL_TIME_EMBED_DIM = 256

# --- the UNet's table --------------------------------------------------------------------------------------

_UNET_RESNET = (
    ("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("emb_layers.1", "time_emb_proj"),
    ("out_layers.0", "norm2"), ("out_layers.3", "conv2"), ("skip_connection", "conv_shortcut"),
)


@dataclass(frozen=True)
class UNetStructure:
    """What the UNet's block numbering depends on.

    ``down_attention[i]``: level i of the down path (highest resolution first) has spatial transformers;
    ``up_attention[i]``: ``up_blocks.i`` (lowest resolution first) has them; ``mid_block``: the middle block is
    resnet-attention-resnet (``"cross_attn"``), one resnet (``"resnet"``: SSD-1B, Vega) or absent (None: BK-SDM
    Small/Tiny, SDXS).

    ``stride``: block numbers per level in ``input_blocks`` / ``output_blocks``; 0 is the LDM numbering,
    ``layers_per_block + 1``. The distilled one-layer UNets' single files (written by diffusers' conversion script,
    which stable-diffusion.cpp reads) keep SD 1.x's numbering, stride 3, with gaps: the resnets of level i at
    ``input_blocks.{1 + 3i}`` and ``output_blocks.{3u}, {3u + 1}``, a downsampler at ``input_blocks.{3i + 3}.0.op``
    and an upsampler alone at ``output_blocks.{3u + 2}.1`` for ``up_blocks.0`` and ``.2`` after it.
    """

    num_levels: int
    layers_per_block: int
    down_attention: tuple[bool, ...]
    up_attention: tuple[bool, ...]
    mid_block: str | None = "cross_attn"
    stride: int = 0

    def __post_init__(self):
        if self.num_levels < 1 or self.layers_per_block < 1:
            raise ConversionError(f"UNet structure: {self.num_levels} levels, {self.layers_per_block} layers per "
                                  "block (both must be >= 1)")
        if len(self.down_attention) != self.num_levels or len(self.up_attention) != self.num_levels:
            raise ConversionError(f"UNet structure: {self.num_levels} levels but {len(self.down_attention)} down "
                                  f"and {len(self.up_attention)} up attention flags")
        if self.mid_block not in ("cross_attn", "resnet", None):
            raise ConversionError(f"UNet structure: middle block {self.mid_block!r} (expected 'cross_attn', "
                                  "'resnet' or None)")
        if self.stride and self.stride < self.layers_per_block + 1:
            raise ConversionError(f"UNet structure: stride {self.stride} below layers_per_block + 1 "
                                  f"({self.layers_per_block + 1})")

    @property
    def mid_attention(self) -> bool:
        return self.mid_block == "cross_attn"

    @property
    def step(self) -> int:
        """Block numbers per level (``stride``, or the LDM numbering's ``layers_per_block + 1``)."""
        return self.stride or self.layers_per_block + 1

    @classmethod
    def from_diffusers_config(cls, cfg: Mapping | Any) -> "UNetStructure":
        """From a diffusers ``UNet2DConditionModel`` config (a dict or an object with attributes), or from an
        object/dict with sdlite ``UNetConfig`` fields (``attention``, ``layers_per_block``)."""
        def get(name, default=None):
            return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)

        if get("down_block_types") is None and get("attention") is not None:  # sdlite's own UNetConfig
            return cls.from_attention(get("attention"), get("layers_per_block", 2), get("mid_block", "cross_attn"))
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
        mids = {"UNetMidBlock2DCrossAttn": "cross_attn", "UNetMidBlock2D": "resnet", None: None}
        if mid not in mids:
            raise ConversionError(f"UNet config: mid_block_type={mid!r} has no original-layout mapping")
        return cls(len(down_types), int(lpb), tuple(kinds[t] for t in down_types),
                   tuple(kinds[t] for t in up_types), mids[mid])

    @classmethod
    def from_attention(cls, attention: Sequence[bool], layers_per_block: int,
                       mid_block: str | None = "cross_attn") -> "UNetStructure":
        """From per-level attention flags (down path) with a mirrored up path, as sdlite's UNetConfig has."""
        attention = tuple(bool(a) for a in attention)
        return cls(len(attention), layers_per_block, attention, attention[::-1], mid_block)

    def rules(self) -> RuleSet:
        """The full name table, derived from the structure."""
        lpb, step = self.layers_per_block, self.step
        rules = [
            Rule("time_embed.0", "time_embedding.linear_1"),
            Rule("time_embed.2", "time_embedding.linear_2"),
            # SDXL's added conditioning (pooled text + size/crop ids): an MLP like the time embedding's
            Rule("label_emb.0.0", "add_embedding.linear_1"),
            Rule("label_emb.0.2", "add_embedding.linear_2"),
            # a class-conditioned UNet's embedding table (the x4 upscaler's noise level): nn.Embedding in both
            Rule("label_emb", "class_embedding"),
            Rule("input_blocks.0.0", "conv_in"),
            Rule("out.0", "conv_norm_out"),
            Rule("out.2", "conv_out"),
        ]
        for i in range(self.num_levels):
            for j in range(lpb):
                n = 1 + i * step + j
                rules.append(Rule(f"input_blocks.{n}.0", f"down_blocks.{i}.resnets.{j}", "table", _UNET_RESNET))
                if self.down_attention[i]:
                    rules.append(Rule(f"input_blocks.{n}.1", f"down_blocks.{i}.attentions.{j}", "subtree"))
            if i < self.num_levels - 1:
                n = (i + 1) * step
                rules.append(Rule(f"input_blocks.{n}.0.op", f"down_blocks.{i}.downsamplers.0.conv"))
        if self.mid_block is not None:
            rules.append(Rule("middle_block.0", "mid_block.resnets.0", "table", _UNET_RESNET))
        if self.mid_block == "cross_attn":
            rules.append(Rule("middle_block.1", "mid_block.attentions.0", "subtree"))
            rules.append(Rule("middle_block.2", "mid_block.resnets.1", "table", _UNET_RESNET))
        for u in range(self.num_levels):
            for j in range(lpb + 1):
                n = u * step + j
                rules.append(Rule(f"output_blocks.{n}.0", f"up_blocks.{u}.resnets.{j}", "table", _UNET_RESNET))
                if self.up_attention[u]:
                    rules.append(Rule(f"output_blocks.{n}.1", f"up_blocks.{u}.attentions.{j}", "subtree"))
            if u < self.num_levels - 1:
                if step == lpb + 1:   # after the last resnet (and its attention), in its block
                    where = f"{u * step + lpb}.{2 if self.up_attention[u] else 1}"
                else:                 # a block of its own, numbered as diffusers' conversion script does
                    where = f"{u * step + step - 1}.{1 if u == 0 else 2}"
                rules.append(Rule(f"output_blocks.{where}.conv", f"up_blocks.{u}.upsamplers.0.conv"))
        return RuleSet(rules)


def ema_key(original_key: str) -> str:
    """The EMA copy's name of a UNet key: ``model.diffusion_model.a.b`` -> ``model_ema.diffusion_modelab``."""
    return EMA_PREFIX + original_key.split(".", 1)[1].replace(".", "")


# --- the structure shown by key names ----------------------------------------------------------------------

# diffusers' conversion script (scripts/convert_diffusers_to_original_stable_diffusion.py) renames attentions from a
# table written for SD 1.5: down levels 0-2 and up levels 1-3 only. A UNet with attention elsewhere (BK-SDM-Tiny's
# and SDXS's lowest level, up_blocks.0) keeps those keys under their diffusers names in the file it writes, beside
# the original-layout ones; their place in its numbering (three blocks per level) follows from the names
_STRAY_ATTENTION = re.compile(r"(down|up)_blocks\.(\d+)\.attentions\.(\d+)\.(.+)")
SCRIPT_STEP = 3


def script_aliases(keys: Iterable[str], prefix: str = UNET_PREFIX) -> dict[str, str]:
    """``{original-layout name: file key}`` for the attention keys under ``prefix`` that diffusers' conversion script
    left in diffusers naming (``up_blocks.0.attentions.1.proj_in.weight`` -> ``output_blocks.1.1.proj_in.weight``),
    in a file that otherwise has the original layout; empty for any other file."""
    keys = list(keys)
    if not any(k.startswith(prefix + "input_blocks.") for k in keys):
        return {}
    present = set(keys)
    out: dict[str, str] = {}
    for key in keys:
        m = _STRAY_ATTENTION.fullmatch(key[len(prefix):]) if key.startswith(prefix) else None
        if m is None:
            continue
        level, layer = int(m.group(2)), int(m.group(3))
        name = (f"input_blocks.{SCRIPT_STEP * level + layer + 1}" if m.group(1) == "down"
                else f"output_blocks.{SCRIPT_STEP * level + layer}")
        alias = f"{prefix}{name}.1.{m.group(4)}"
        if alias in present:
            raise ConversionError(f"UNet key {key!r} and {alias!r} name the same tensor (diffusers' conversion "
                                  "script leaves such an attention under its diffusers name only)", key=key)
        out[alias] = key
    return out


def _aliased(keys: Sequence[str], aliases: Mapping[str, str]) -> list[str]:
    strays = set(aliases.values())
    return [k for k in keys if k not in strays] + list(aliases)


_IN = re.compile(r"input_blocks\.(\d+)\.(\d+)\.(.+)")
_OUT = re.compile(r"output_blocks\.(\d+)\.(\d+)\.(.+)")
_DOWN = re.compile(r"down_blocks\.(\d+)\.(resnets|attentions|downsamplers)\.(\d+)\.")
_UP = re.compile(r"up_blocks\.(\d+)\.(resnets|attentions|upsamplers)\.(\d+)\.")


def unet_structure_from_keys(keys: Iterable[str], layout: str = "original",
                             prefix: str = UNET_PREFIX, encoder_only: bool = False) -> UNetStructure:
    """The block structure (levels, resnets per level, attention levels) shown by UNet key names.

    ``layout="original"``: keys under ``prefix`` numbered ``input_blocks.N``/``output_blocks.N``;
    ``layout="diffusers"``: canonical keys (``prefix`` is stripped first when given). ``encoder_only``: the keys
    have no up path (a ControlNet's); the structure's up path is then taken as the mirror of the down path.
    """
    keys = list(keys)
    if layout == "original":
        keys = _aliased(keys, script_aliases(keys, prefix))
    names = [k[len(prefix):] for k in keys if k.startswith(prefix)]
    if layout == "diffusers":
        return _structure_diffusers(names)
    if layout != "original":
        raise ValueError(f"layout={layout!r}: expected 'original' or 'diffusers'")
    inputs: dict[int, set[int]] = {}
    ops: set[int] = set()
    for name in names:
        m = _IN.match(name)
        if m:
            n, slot, rest = int(m.group(1)), int(m.group(2)), m.group(3)
            inputs.setdefault(n, set()).add(slot)
            if slot == 0 and rest.startswith("op."):
                ops.add(n)
    if not inputs:
        raise UnsupportedModelError(f"no UNet 'input_blocks' keys under {prefix!r}")
    last = max(inputs)
    step = min(ops) if ops else last + 1
    lpb = len([n for n in inputs if 0 < n < step])   # the resnets of the first level
    levels = len(ops) + 1
    resnets = {1 + i * step + j for i in range(levels) for j in range(lpb)}
    if (lpb < 1 or ops != {(i + 1) * step for i in range(levels - 1)}
            or set(inputs) - {0} != resnets | ops):
        raise UnsupportedModelError(
            f"UNet input_blocks 0..{last} with downsamplers at {sorted(ops)} do not form a regular "
            "levels x layers_per_block layout")
    down = tuple(1 in inputs.get(1 + i * step, set()) for i in range(levels))
    mid = _mid_block_from_keys(names)
    stride = 0 if step == lpb + 1 else step
    if encoder_only:
        return UNetStructure(levels, lpb, down, down[::-1], mid, stride)
    up_attention = []
    out_last = -1
    for u in range(levels):
        n = u * step
        up_attention.append(any((m := _OUT.match(name)) and int(m.group(1)) == n and m.group(2) == "1"
                                and not m.group(3).startswith("conv.") for name in names))
    for name in names:
        m = _OUT.match(name)
        if m:
            out_last = max(out_last, int(m.group(1)))
    if out_last != (levels - 1) * step + lpb:
        raise UnsupportedModelError(f"UNet has output_blocks 0..{out_last}, expected 0..{(levels - 1) * step + lpb} "
                                    f"for {levels} levels of {lpb} layers")
    return UNetStructure(levels, lpb, down, tuple(up_attention), mid, stride)


def _mid_block_from_keys(names: Sequence[str]) -> str | None:
    """The middle block the original names show: resnet-transformer-resnet, one resnet, or none."""
    slots = {name.split(".")[1] for name in names if name.startswith("middle_block.")}
    if not slots:
        return None
    if slots == {"0"}:
        return "resnet"
    if slots == {"0", "1", "2"}:
        return "cross_attn"
    raise UnsupportedModelError(f"UNet middle_block has parts {sorted(slots)}: expected 0 (one resnet) or 0, 1, 2 "
                                "(resnet, transformer, resnet)")


def _structure_diffusers(names: Sequence[str]) -> UNetStructure:
    down: dict[int, dict[str, set[int]]] = {}
    up: dict[int, dict[str, set[int]]] = {}
    for name in names:
        for pattern, table in ((_DOWN, down), (_UP, up)):
            m = pattern.match(name)
            if m:
                table.setdefault(int(m.group(1)), {}).setdefault(m.group(2), set()).add(int(m.group(3)))
    if not down:
        raise UnsupportedModelError("no UNet 'down_blocks' keys")
    levels = max(down) + 1
    lpb = len(down.get(0, {}).get("resnets", ()))
    if lpb < 1:
        raise UnsupportedModelError("UNet down_blocks.0 has no resnets")
    if any(n.startswith("mid_block.attentions.") for n in names):
        mid = "cross_attn"
    else:
        mid = "resnet" if any(n.startswith("mid_block.resnets.") for n in names) else None
    return UNetStructure(levels, lpb, tuple("attentions" in down.get(i, {}) for i in range(levels)),
                         tuple("attentions" in up.get(i, {}) for i in range(levels)), mid)


# --- what the shapes say -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class UNetInfo:
    """UNet hyper-parameters read from shapes (canonical names). ``heads`` follows the family convention
    (SD 1.x: 8 per level, SD 2.x and SDXL: width / 64) because head counts leave no trace in the shapes.
    ``add_embed_in``: the input width of SDXL's added-conditioning MLP (0: none); ``addition_time_embed_dim`` is
    only known once the family (its number of time ids) and the pooled text width are."""

    in_channels: int
    out_channels: int
    block_channels: tuple[int, ...]
    layers_per_block: int
    attention: tuple[bool, ...]          # down path, highest resolution first
    up_attention: tuple[bool, ...]       # up_blocks order, lowest resolution first
    mid_attention: bool
    context_dim: int | None
    linear_projection: bool
    transformer_depth: tuple             # per level, 0 where the level has no attention; a tuple per layer where
                                         # a level's layers differ
    time_embed_dim: int
    heads: tuple[int, ...] | None = None
    mid_transformer_depth: int = 0       # blocks in the middle block's transformer (0: read nothing)
    add_embed_in: int = 0
    addition_time_embed_dim: int = SDXL_TIME_EMBED_DIM
    num_class_embeds: int = 0            # rows of the class-embedding table (``class_embedding.weight``; 0: none)
    cross_only: tuple[bool, ...] = ()    # per level: attn1 attends to the context (its to_k is context-wide)
    mid_block: str | None = "cross_attn"  # "cross_attn", "resnet" (one resnet) or None (no middle block)
    up_transformer_depth: tuple = ()     # per level (highest resolution first), as transformer_depth; () mirrors
    stride: int = 0                      # the single file's block numbering (UNetStructure.stride)

    @property
    def model_channels(self) -> int:
        return self.block_channels[0]

    @property
    def channel_mult(self) -> tuple[int, ...]:
        return tuple(c // self.block_channels[0] for c in self.block_channels)

    @property
    def structure(self) -> UNetStructure:
        return UNetStructure(len(self.block_channels), self.layers_per_block, self.attention, self.up_attention,
                             self.mid_block, self.stride)

    def config_kwargs(self) -> dict:
        """Keyword arguments with sdlite ``UNetConfig`` field names (``heads`` left out when unknown).

        One depth for every transformer becomes one number; else a depth per level, 1 at levels without
        attention, except the last level, which carries the middle block's depth (``UNetConfig.depth_at(-1)``).
        """
        def flat(d):
            return set(d) if isinstance(d, tuple) else {d}

        depths = sorted(set().union(*(flat(d) for d in self.transformer_depth + self.up_transformer_depth))
                        - {0} | ({self.mid_transformer_depth} - {0}))
        per_layer = any(isinstance(d, tuple) for d in self.transformer_depth + self.up_transformer_depth)
        if len(depths) <= 1 and not per_layer:
            depth, up = (depths[0] if depths else 1), ()
        else:
            depth = tuple(d or 1 for d in self.transformer_depth)
            if self.mid_transformer_depth and not self.attention[-1]:
                depth = depth[:-1] + (self.mid_transformer_depth,)
            up = tuple(d or 1 for d in self.up_transformer_depth)
        out = dict(in_channels=self.in_channels, out_channels=self.out_channels,
                   block_channels=self.block_channels, layers_per_block=self.layers_per_block,
                   attention=self.attention, context_dim=self.context_dim,
                   linear_projection=self.linear_projection, transformer_depth=depth, up_transformer_depth=up,
                   mid_block=self.mid_block)
        if self.heads is not None:
            out["heads"] = self.heads
        if self.add_embed_in:
            out.update(addition_embed="text_time", add_embed_in=self.add_embed_in,
                       addition_time_embed_dim=self.addition_time_embed_dim)
        if self.num_class_embeds:
            out["num_class_embeds"] = self.num_class_embeds
        if any(self.cross_only):
            out["cross_only"] = self.cross_only
        return out


def infer_unet(shapes: Shapes, encoder_only: bool = False) -> UNetInfo:
    """UNet config from canonical (diffusers) UNet key shapes. ``encoder_only``: the keys have no up path and no
    output layers (a ControlNet's): the output width is taken as the input's, the up path as the down path's mirror."""
    shapes = {k: shape_of(v) for k, v in shapes.items()}
    st = _structure_diffusers(list(shapes))
    conv_in = need_shape(shapes, "conv_in.weight", "UNet")
    conv_out = conv_in[1:] if encoder_only else need_shape(shapes, "conv_out.weight", "UNet")
    if encoder_only:
        st = replace(st, up_attention=st.down_attention[::-1])
    channels = tuple(need_shape(shapes, f"down_blocks.{i}.resnets.0.conv1.weight", "UNet")[0]
                     for i in range(st.num_levels))
    context = None
    linear = False
    depth = tuple(_depths(shapes, f"down_blocks.{i}", st.layers_per_block) for i in range(st.num_levels))
    up_depth = () if encoder_only else tuple(
        _depths(shapes, f"up_blocks.{st.num_levels - 1 - level}", st.layers_per_block + 1)
        for level in range(st.num_levels))
    mid_depth = len({int(m.group(1)) for k in shapes
                     if (m := re.match(r"mid_block\.attentions\.0\.transformer_blocks\.(\d+)\.", k))})
    add = shapes.get("add_embedding.linear_1.weight")
    classes = shapes.get("class_embedding.weight")
    # attn1 reads the context where its key projection's input is context-wide rather than the level's width (not
    # visible at a level whose width is the context's: taken as self-attention there, as the x4 upscaler has it)
    cross_only = []
    for i, ch in enumerate(channels):
        k1 = shapes.get(f"down_blocks.{i}.attentions.0.transformer_blocks.0.attn1.to_k.weight")
        cross_only.append(k1 is not None and len(k1) == 2 and k1[1] != ch)
    for k, s in shapes.items():
        if context is None and k.endswith("attn2.to_k.weight"):
            context = s[1]
        if k.endswith("proj_in.weight") and len(s) == 2:
            linear = True
    if context is not None and (linear or context == 1024):
        heads = tuple(c // SD2_UNET_HEAD_DIM for c in channels)
        heads = heads if all(h and c % SD2_UNET_HEAD_DIM == 0 for h, c in zip(heads, channels)) else None
    else:
        heads = tuple(SD1_UNET_HEADS for _ in channels) if all(c % SD1_UNET_HEADS == 0 for c in channels) else None
    return UNetInfo(
        in_channels=conv_in[1], out_channels=conv_out[0], block_channels=channels,
        layers_per_block=st.layers_per_block, attention=st.down_attention, up_attention=st.up_attention,
        mid_attention=st.mid_attention, context_dim=context, linear_projection=linear,
        transformer_depth=depth, time_embed_dim=need_shape(shapes, "time_embedding.linear_1.weight", "UNet")[0],
        heads=heads, mid_transformer_depth=mid_depth, add_embed_in=add[1] if add is not None and len(add) == 2 else 0,
        num_class_embeds=classes[0] if classes is not None and len(classes) == 2 else 0,
        cross_only=tuple(cross_only) if any(cross_only) else (), mid_block=st.mid_block,
        up_transformer_depth=up_depth if any(up_depth) else ())


def _depths(shapes: Mapping, block: str, layers: int) -> int | tuple[int, ...]:
    """Transformer blocks in each layer's spatial transformer of ``block`` (0 where it has none): one number when
    every layer has the same."""
    pattern = re.compile(re.escape(block) + r"\.attentions\.(\d+)\.transformer_blocks\.(\d+)\.")
    found: dict[int, set[int]] = {}
    for k in shapes:
        if m := pattern.match(k):
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    each = tuple(len(found.get(j, ())) for j in range(layers))
    return each[0] if len(set(each)) == 1 else each


# --- UNet plans --------------------------------------------------------------------------------------------


def _unet_structure(keys: Sequence[str], structure, *, original: bool, prefix: str) -> UNetStructure:
    if isinstance(structure, UNetStructure):
        return structure
    if structure is None:
        return unet_structure_from_keys(keys, layout="original" if original else "diffusers", prefix=prefix)
    structure = UNetStructure.from_diffusers_config(structure)
    if original and any(k.startswith(prefix + "input_blocks.") for k in keys):
        # a config says what the network is; the file's numbering (stride) only its keys say
        structure = replace(structure, stride=unet_structure_from_keys(keys, prefix=prefix).stride)
    return structure


def unet_from_original(keys: Iterable[str], structure: UNetStructure | Mapping | None = None, *,
                       prefix: str = UNET_PREFIX, use_ema: bool = False,
                       expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical UNet key: PlanEntry}`` for the original-layout UNet keys under ``prefix``.

    ``structure``: a :class:`UNetStructure`, a diffusers UNet config dict, or None to infer it from the keys.
    ``use_ema``: take each tensor from its ``model_ema.`` copy when the file has one (EMA keys are otherwise
    ignored). ``expected``: the model's canonical keys, to report missing / unknown names.
    """
    keys = list(keys)
    aliases = script_aliases(keys, prefix)
    keys = _aliased(keys, aliases)
    structure = _unet_structure(keys, structure, original=True, prefix=prefix)
    if aliases and structure.step != SCRIPT_STEP:
        raise ConversionError(f"UNet key {next(iter(aliases.values()))!r} is in diffusers naming, as diffusers' "
                              f"conversion script leaves some, but the file's blocks are numbered {structure.step} "
                              f"per level, not the script's {SCRIPT_STEP}", key=next(iter(aliases.values())))
    plan = build_plan("unet", keys, structure.rules(), to_canon=True, src_prefix=prefix, dst_prefix="",
                  expected=expected)
    if aliases:   # the tensors are read under the names the file has
        plan.entries = {target: PlanEntry(tuple(aliases.get(s, s) for s in entry.sources), entry.transform)
                        for target, entry in plan.entries.items()}
        plan.unexpected = [aliases.get(k, k) for k in plan.unexpected]
        plan.notes.append(f"{len(aliases)} UNet keys in diffusers naming (e.g. {next(iter(aliases.values()))!r}), "
                          "as diffusers' conversion script leaves a one-layer UNet's attentions outside SD 1.5's "
                          "places: read as the original-layout blocks they are")
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
    return build_plan("unet", keys, structure.rules(), to_canon=False, src_prefix="", dst_prefix=prefix)


# --- ControlNet --------------------------------------------------------------------------------------------

CONTROLNET_PREFIX = "control_model."   # lllyasviel's files (the SD 2.1 ControlNets have no prefix)


def controlnet_rules(structure: UNetStructure, hint_convs: int) -> RuleSet:
    """The UNet's encoder-side names (:meth:`UNetStructure.rules`) plus the ControlNet's own: the hint encoder's
    ``hint_convs`` convolutions (``input_hint_block.0, .2, ...``, SiLUs between them; the first is ``conv_in``, the
    last ``conv_out``), the zero convolutions ``zero_convs.N.0`` and ``middle_block_out.0``."""
    rules = list(structure.rules().fwd.values())
    for j in range(hint_convs):
        canon = ("controlnet_cond_embedding.conv_in" if j == 0 else "controlnet_cond_embedding.conv_out"
                 if j == hint_convs - 1 else f"controlnet_cond_embedding.blocks.{j - 1}")
        rules.append(Rule(f"input_hint_block.{2 * j}", canon))
    skips = 1 + structure.num_levels * structure.layers_per_block + structure.num_levels - 1
    rules += [Rule(f"zero_convs.{n}.0", f"controlnet_down_blocks.{n}") for n in range(skips)]
    rules.append(Rule("middle_block_out.0", "controlnet_mid_block"))
    return RuleSet(rules)


def controlnet_from_original(keys: Iterable[str], structure: UNetStructure, hint_convs: int, *,
                             prefix: str = CONTROLNET_PREFIX, expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical ControlNet key: PlanEntry}`` for original-layout ControlNet keys under ``prefix``."""
    return build_plan("controlnet", list(keys), controlnet_rules(structure, hint_convs), to_canon=True,
                  src_prefix=prefix, dst_prefix="", expected=expected)


def controlnet_to_original(keys: Iterable[str], structure: UNetStructure, hint_convs: int, *,
                           prefix: str = CONTROLNET_PREFIX) -> ComponentPlan:
    """Plan ``{original key (with prefix): PlanEntry}`` from canonical ControlNet keys (lllyasviel's layout)."""
    return build_plan("controlnet", list(keys), controlnet_rules(structure, hint_convs), to_canon=False, src_prefix="",
                  dst_prefix=prefix)

