"""The keys of the autoencoders, the VAE (KL autoencoder) and TAESD (the tiny one): their names in each layout,
and the VAE config the shapes show (:class:`VAEInfo`).

The original single-file layout names the VAE, under ``first_stage_model.``, as ``encoder.down.N.block.M``,
``mid.block_1/attn_1/block_2``, the decoder's ``up.N`` numbered in reverse, ``nin_shortcut``, with 1x1-conv
attention projections; the canonical names are diffusers' ``AutoencoderKL`` ones with modern attention
(``to_q/to_k/to_v/to_out.0``, Linear weights). Older diffusers folders still use the legacy attention names
``query/key/value/proj_attn``, see :func:`vae_from_diffusers`.

TAESD halves come in madebyollin's layout (bare ``nn.Sequential`` indices), see :func:`taesd_from_original`.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .plan import (
    COPY, TO_LINEAR, ComponentPlan, ConversionError, Rule, RuleSet, Shapes, Transform, UnsupportedModelError,
    build_plan, need_shape, shape_of,
)

__all__ = [
    "VAE_PREFIX", "vae_from_original", "vae_to_original", "vae_from_diffusers", "VAEInfo", "infer_vae",
    "TAESD_PARTS", "TAESD_INDEX_SHIFT", "taesd_from_original",
]

VAE_PREFIX = "first_stage_model."

# --- VAE ---------------------------------------------------------------------------------------------------

_VAE_RESNET = (("norm1", "norm1"), ("conv1", "conv1"), ("norm2", "norm2"), ("conv2", "conv2"),
               ("nin_shortcut", "conv_shortcut"))
_VAE_ATTENTION = (("norm", "group_norm"), ("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0"))
_VAE_LINEAR = frozenset({"to_q", "to_k", "to_v", "to_out.0"})


def _vae_rules(num_levels: int) -> RuleSet:
    rules = [Rule("quant_conv", "quant_conv"), Rule("post_quant_conv", "post_quant_conv")]
    for part in ("encoder", "decoder"):
        rules += [
            Rule(f"{part}.conv_in", f"{part}.conv_in"),
            Rule(f"{part}.conv_out", f"{part}.conv_out"),
            Rule(f"{part}.norm_out", f"{part}.conv_norm_out"),
            Rule(f"{part}.mid.block_1", f"{part}.mid_block.resnets.0", "table", _VAE_RESNET),
            Rule(f"{part}.mid.block_2", f"{part}.mid_block.resnets.1", "table", _VAE_RESNET),
            Rule(f"{part}.mid.attn_1", f"{part}.mid_block.attentions.0", "table", _VAE_ATTENTION,
                  linear=_VAE_LINEAR),
        ]
    for i in range(num_levels):
        rules.append(Rule(f"encoder.down.{i}.block", f"encoder.down_blocks.{i}.resnets", "table", _VAE_RESNET,
                           indexed=True))
        rules.append(Rule(f"encoder.down.{i}.downsample.conv", f"encoder.down_blocks.{i}.downsamplers.0.conv"))
        u = num_levels - 1 - i  # the decoder's up.N counts from the lowest resolution, up_blocks.N from the top
        rules.append(Rule(f"decoder.up.{i}.block", f"decoder.up_blocks.{u}.resnets", "table", _VAE_RESNET,
                           indexed=True))
        rules.append(Rule(f"decoder.up.{i}.upsample.conv", f"decoder.up_blocks.{u}.upsamplers.0.conv"))
    return RuleSet(rules)


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
    return build_plan("vae", keys, _vae_rules(n), to_canon=True, src_prefix=prefix, dst_prefix="", expected=expected)


def vae_to_original(keys: Iterable[str], num_levels: int | None = None, *,
                    prefix: str = VAE_PREFIX) -> ComponentPlan:
    """Plan ``{original key: PlanEntry}`` from canonical VAE keys (Linear attention weights -> 1x1 convs)."""
    keys = list(keys)
    n = num_levels or _vae_levels(keys, "", original=False)
    return build_plan("vae", keys, _vae_rules(n), to_canon=False, src_prefix="", dst_prefix=prefix)


_LEGACY_VAE_ATTENTION = re.compile(r"(.*\.attentions\.\d+)\.(query|key|value|proj_attn)\.(weight|bias)")
_LEGACY_VAE_NAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def vae_from_diffusers(key: str) -> tuple[str, Transform]:
    """The canonical name of a diffusers-folder VAE key, and how its tensor is made: the legacy attention names
    ``query/key/value/proj_attn`` become ``to_q/to_k/to_v/to_out.0`` and conv-shaped attention weights become
    Linear ones; every other key is canonical already."""
    m = _LEGACY_VAE_ATTENTION.fullmatch(key)
    if m:
        target = f"{m.group(1)}.{_LEGACY_VAE_NAMES[m.group(2)]}.{m.group(3)}"
        return target, TO_LINEAR if m.group(3) == "weight" else COPY
    if key.endswith(".weight") and re.search(r"\.attentions\.\d+\.to_(q|k|v|out\.0)\.weight$", key):
        return key, TO_LINEAR  # tolerate conv-shaped modern names too
    return key, COPY


# --- what the shapes say -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VAEInfo:
    in_channels: int
    out_channels: int
    latent_channels: int
    block_channels: tuple[int, ...]
    layers_per_block: int
    mid_attention: bool

    def config_kwargs(self) -> dict:
        """Keyword arguments with sdlite ``VAEConfig`` field names."""
        return dict(in_channels=self.in_channels, out_channels=self.out_channels,
                    latent_channels=self.latent_channels, block_channels=self.block_channels,
                    layers_per_block=self.layers_per_block)


def infer_vae(shapes: Shapes) -> VAEInfo:
    """VAE config from canonical (diffusers) VAE key shapes."""
    shapes = {k: shape_of(v) for k, v in shapes.items()}
    levels = {int(m.group(1)) for k in shapes if (m := re.match(r"encoder\.down_blocks\.(\d+)\.", k))}
    if not levels:
        raise UnsupportedModelError("VAE: no 'encoder.down_blocks' keys")
    channels = tuple(need_shape(shapes, f"encoder.down_blocks.{i}.resnets.0.conv1.weight", "VAE")[0]
                     for i in range(max(levels) + 1))
    lpb = len({int(m.group(1)) for k in shapes if (m := re.match(r"encoder\.down_blocks\.0\.resnets\.(\d+)\.", k))})
    return VAEInfo(
        in_channels=need_shape(shapes, "encoder.conv_in.weight", "VAE")[1],
        out_channels=need_shape(shapes, "decoder.conv_out.weight", "VAE")[0],
        latent_channels=need_shape(shapes, "decoder.conv_in.weight", "VAE")[1],
        block_channels=channels, layers_per_block=lpb,
        mid_attention=any(k.startswith("encoder.mid_block.attentions.") for k in shapes))


# --- TAESD -------------------------------------------------------------------------------------------------

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
    rules = RuleSet(Rule(str(n), f"{part}.layers.{n - shift}", "subtree") for n in layers if n >= shift)
    return build_plan(f"TAESD {part}", keys, rules, to_canon=True, src_prefix=prefix, dst_prefix="", expected=expected)

