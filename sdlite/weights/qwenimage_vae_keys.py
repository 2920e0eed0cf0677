"""The keys of Qwen-Image's VAE (:mod:`sdlite.models.qwenimage_vae`) in the two layouts its files come in: whether a
file holds it (:func:`is_qwenimage_vae`), in which names (:func:`qwenimage_vae_layout`), the plan to the model's names
(:func:`qwenimage_vae_plan`), the names back (:func:`wan_names`) and the config its shapes show
(:func:`infer_qwenimage_vae`).

**diffusers' names** (``AutoencoderKLQwenImage``, Qwen/Qwen-Image's ``vae/``): the model's own.

**Wan 2.1's original names** (ComfyUI's ``qwen_image_vae.safetensors``, the same network as ``Wan2.1_VAE.pth``). The
table (the facts of diffusers' Wan converter, ``scripts/convert_wan_to_diffusers.py``):

* ``encoder.conv1`` / ``decoder.conv1`` are ``conv_in``; ``encoder.head.0.gamma`` / ``head.2`` are ``norm_out.gamma``
  / ``conv_out`` (the head is RMS norm, SiLU, conv); the top-level ``conv1`` is ``quant_conv``, ``conv2``
  ``post_quant_conv``;
* a residual block's ``residual.0.gamma``, ``residual.2``, ``residual.3.gamma``, ``residual.6`` (norm, SiLU, conv,
  norm, SiLU, dropout, conv) are ``norm1.gamma``, ``conv1``, ``norm2.gamma``, ``conv2``; its ``shortcut`` is
  ``conv_shortcut``;
* ``middle.0`` / ``middle.2`` are ``mid_block.resnets.0`` / ``.1``, ``middle.1`` (``norm.gamma``, ``to_qkv``,
  ``proj``) ``mid_block.attentions.0``;
* ``encoder.downsamples.N`` is diffusers' flat ``encoder.down_blocks.N`` (each level's residual blocks, then a
  resampler with ``resample.1`` and, where it halves time, ``time_conv``), the same numbers;
* ``decoder.upsamples.N`` is one flat list too: each level's ``num_res_blocks + 1`` residual blocks, then (not after
  the last level) an upsampler; diffusers groups it as ``decoder.up_blocks.L.resnets.J`` and
  ``decoder.up_blocks.L.upsamplers.0``. Which entries are upsamplers the keys show (``resample`` / ``time_conv``).

Wan 2.2's VAE (48 latent channels, ``wan2.2_vae.safetensors``) has the same top-level names and is refused by its
channels; an LDM-named autoencoder (FLUX.1's ``ae.safetensors``, SD's) is not this network.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ..config import ConfigError
from ..config.qwenimage_vae import QwenImageVAEConfig
from .plan import (
    COPY, ComponentPlan, PlanEntry, UnsupportedModelError, add_entry, check_expected, need_shape, shape_of,
)

__all__ = ["QWENIMAGE_VAE_PREFIXES", "is_qwenimage_vae", "qwenimage_vae_layout", "qwenimage_vae_plan", "wan_names",
           "infer_qwenimage_vae"]

COMPONENT = "vae"
WHAT = "Qwen-Image VAE"
#: where a VAE's keys may sit: bare (its own file, a diffusers folder) or under ``vae.``
QWENIMAGE_VAE_PREFIXES = ("", "vae.")
_MARKS = {"diffusers": ("decoder.norm_out.gamma", "decoder.mid_block.attentions.0.to_qkv.weight"),
          "wan": ("decoder.head.0.gamma", "decoder.middle.1.to_qkv.weight")}
_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
             "residual.3.gamma": "norm2.gamma", "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
             "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_RESIDUAL_BACK = {v: k for k, v in _RESIDUAL.items()}
_TOP = {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias",
        "conv2.weight": "post_quant_conv.weight", "conv2.bias": "post_quant_conv.bias"}
_HALF = {"conv1.weight": "conv_in.weight", "conv1.bias": "conv_in.bias", "head.0.gamma": "norm_out.gamma",
         "head.2.weight": "conv_out.weight", "head.2.bias": "conv_out.bias"}
_MIDDLE = {"0": "mid_block.resnets.0", "1": "mid_block.attentions.0", "2": "mid_block.resnets.1"}
_RESAMPLER = ("resample.", "time_conv.")
_WAN_LIST = re.compile(r"(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(.+)")
_UP = re.compile(r"decoder\.up_blocks\.(\d+)\.(resnets|upsamplers)\.(\d+)\.(.+)")
_DOWN = re.compile(r"encoder\.down_blocks\.(\d+)\.(.+)")


def qwenimage_vae_layout(keys: Iterable[str]) -> tuple[str, str]:
    """``(layout, prefix)``: ``"diffusers"`` or ``"wan"``, under ``""`` or ``"vae."``. Keys of neither are an
    :class:`UnsupportedModelError` saying what was looked for."""
    keys = set(keys)
    for prefix in QWENIMAGE_VAE_PREFIXES:
        for layout, marks in _MARKS.items():
            if all(prefix + m in keys for m in marks):
                return layout, prefix
    listed = sorted(keys)
    raise UnsupportedModelError(
        f"no {WHAT} keys among {len(listed)}: expected {' and '.join(map(repr, _MARKS['wan']))} (Wan 2.1's names) or "
        f"{' and '.join(map(repr, _MARKS['diffusers']))} (diffusers')" + (f"; the first is {listed[0]!r}" if listed
                                                                            else ""))


def is_qwenimage_vae(keys: Iterable[str]) -> bool:
    """Whether ``keys`` hold a Wan-2.1-style causal VAE (Qwen-Image's, or Wan 2.2's, refused later by its channels)
    in either layout."""
    try:
        qwenimage_vae_layout(keys)
    except UnsupportedModelError:
        return False
    return True


def _upsamplers(names: Iterable[str]) -> list[int]:
    """The entries of Wan's flat ``decoder.upsamples`` list that are upsamplers, in order."""
    found = set()
    for name in names:
        m = _WAN_LIST.fullmatch(name)
        if m and m.group(1) == "decoder.upsamples" and m.group(3).startswith(_RESAMPLER):
            found.add(int(m.group(2)))
    return sorted(found)


def _from_wan(name: str, upsamplers: list[int]) -> str | None:
    """diffusers' name of a Wan-named key (without prefix); None for a name outside the table."""
    if name in _TOP:
        return _TOP[name]
    half, _, rest = name.partition(".")
    if half not in ("encoder", "decoder"):
        return None
    if rest in _HALF:
        return f"{half}.{_HALF[rest]}"
    m = re.fullmatch(r"middle\.(\d)\.(.+)", rest)
    if m and m.group(1) in _MIDDLE:
        inner = m.group(2) if m.group(1) == "1" else _RESIDUAL.get(m.group(2))
        return f"{half}.{_MIDDLE[m.group(1)]}.{inner}" if inner else None
    m = _WAN_LIST.fullmatch(name)
    if not m:
        return None
    index, inner = int(m.group(2)), m.group(3)
    if not inner.startswith(_RESAMPLER):
        inner = _RESIDUAL.get(inner)
        if inner is None:
            return None
    if half == "encoder":
        return f"encoder.down_blocks.{index}.{inner}"
    level = sum(1 for u in upsamplers if u < index)
    if index in upsamplers:
        return f"decoder.up_blocks.{level}.upsamplers.0.{inner}"
    start = upsamplers[level - 1] + 1 if level else 0
    return f"decoder.up_blocks.{level}.resnets.{index - start}.{inner}"


def qwenimage_vae_plan(keys: Iterable[str], *, expected: Iterable[str] | None = None) -> ComponentPlan:
    """The plan to diffusers' names of a Qwen-Image VAE's keys in either layout and prefix (keys outside the prefix
    are not looked at; a name outside the table is ``unexpected``)."""
    keys = list(keys)
    layout, prefix = qwenimage_vae_layout(keys)
    names = {k[len(prefix):]: k for k in keys if k.startswith(prefix)}
    upsamplers = _upsamplers(names) if layout == "wan" else []
    plan = ComponentPlan(COMPONENT)
    for name, key in names.items():
        target = name if layout == "diffusers" else _from_wan(name, upsamplers)
        if target is None:
            plan.unexpected.append(key)
        else:
            add_entry(plan, target, PlanEntry((key,), COPY))
    check_expected(plan, expected)
    return plan


def wan_names(canonical: Iterable[str], shapes: Mapping) -> list[str]:
    """Wan 2.1's names of diffusers-named keys (for messages and for writing a file as ComfyUI has it); ``shapes``
    (the canonical keys, at least the decoder's) tells how many residual blocks a decoder level has."""
    per_level = 1 + max((int(m.group(3)) for k in shapes if (m := _UP.fullmatch(k)) and m.group(2) == "resnets"),
                        default=0)
    back_half = {v: k for k, v in _HALF.items()}
    back_top = {v: k for k, v in _TOP.items()}
    back_middle = {v: k for k, v in _MIDDLE.items()}
    out = []
    for key in canonical:
        if key in back_top:
            out.append(back_top[key])
            continue
        half, _, rest = key.partition(".")
        if rest in back_half:
            out.append(f"{half}.{back_half[rest]}")
            continue
        m = re.fullmatch(r"(mid_block\.(?:resnets|attentions)\.\d)\.(.+)", rest)
        if m and m.group(1) in back_middle:
            inner = m.group(2) if "attentions" in m.group(1) else _RESIDUAL_BACK.get(m.group(2), m.group(2))
            out.append(f"{half}.middle.{back_middle[m.group(1)]}.{inner}")
            continue
        m = _DOWN.fullmatch(key)
        if m:
            inner = m.group(2) if m.group(2).startswith(_RESAMPLER) else _RESIDUAL_BACK.get(m.group(2), m.group(2))
            out.append(f"encoder.downsamples.{m.group(1)}.{inner}")
            continue
        m = _UP.fullmatch(key)
        if m:
            level, kind, j, inner = int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)
            start = level * (per_level + 1)
            if kind == "upsamplers":
                out.append(f"decoder.upsamples.{start + per_level}.{inner}")
            else:
                out.append(f"decoder.upsamples.{start + j}.{_RESIDUAL_BACK.get(inner, inner)}")
            continue
        out.append(key)
    return out


def infer_qwenimage_vae(shapes) -> QwenImageVAEConfig:
    """The :class:`QwenImageVAEConfig` that diffusers-named shapes show: ``base_dim`` and the input channels from
    ``encoder.conv_in``, ``z_dim`` from ``decoder.conv_in``, the levels and ``num_res_blocks`` from where the
    encoder's resamplers sit, each level's width from its first residual block, ``temperal_downsample`` from which
    resamplers have a ``time_conv``. The latents' statistics are Qwen-Image's (no file holds them): a VAE of other
    than 16 latent channels is refused (Wan 2.2's has 48)."""
    s = {k: shape_of(v) for k, v in shapes.items()}
    conv_in = need_shape(s, "encoder.conv_in.weight", WHAT)
    z_dim = need_shape(s, "decoder.conv_in.weight", WHAT)[1]
    if z_dim != 16:
        wan22 = " (Wan 2.2's VAE, wan2.2_vae.safetensors, has 48)" if z_dim == 48 else ""
        raise UnsupportedModelError(f"a VAE with {z_dim} latent channels{wan22}: Qwen-Image decodes with its own "
                                    "16-channel VAE (qwen_image_vae.safetensors, Wan 2.1's)",
                                    key="decoder.conv_in.weight")
    blocks = sorted({int(m.group(1)) for k in s if (m := _DOWN.fullmatch(k))})
    resamplers = [i for i in blocks if f"encoder.down_blocks.{i}.resample.1.weight" in s]
    per_level = resamplers[0] if resamplers else len(blocks)
    levels = len(resamplers) + 1
    base = conv_in[0]
    try:
        widths = [need_shape(s, f"encoder.down_blocks.{level * (per_level + 1)}.conv1.weight", WHAT)[0]
                  for level in range(levels)]
        if per_level < 1 or any(w % base for w in widths):
            raise UnsupportedModelError(f"{WHAT}: encoder levels {widths} wide are not multiples of its first "
                                        f"convolution's {base} channels", key="encoder.conv_in.weight")
        return QwenImageVAEConfig(base_dim=base, z_dim=z_dim, dim_mult=tuple(w // base for w in widths),
                                  num_res_blocks=per_level, input_channels=conv_in[1],
                                  temperal_downsample=tuple(f"encoder.down_blocks.{i}.time_conv.weight" in s
                                                            for i in resamplers))
    except ConfigError as e:
        raise UnsupportedModelError(f"{WHAT}: {e}") from None
