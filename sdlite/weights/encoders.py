"""What the text encoders' key tables (:mod:`~sdlite.weights.t5_keys`, :mod:`~sdlite.weights.qwen_keys`) share: weights
stored as scaled fp8 and their per-tensor scales, the plan that pairs them, the checks made before any tensor is read,
and the encoder built on the meta device from the checked view.

Scaled fp8 files (ComfyUI's ``t5xxl_fp8_e4m3fn_scaled.safetensors``, ``qwen_3_4b_fp8_scaled.safetensors`` ...) hold a
``scaled_fp8`` marker tensor and, next to a weight ``X.weight`` stored as fp8, its per-tensor ``X.scale_weight`` (the
value is ``X.weight * X.scale_weight``; the newer spelling ``X.weight_scale`` is read the same way), often with an
``X.scale_input`` / ``X.input_scale``, the input scale of fp8 matrix products. A scaled weight is dequantised, the
product formed in float32 (:func:`dequantize`), and the layer runs in the compute dtype, so input scales and the marker
are ignored. fp8 tensors (``float8_e4m3fn``, ``float8_e5m2``) convert to bf16, fp16 and fp32 exactly;
:func:`dequantize` is the one conversion of a stored tensor to the compute dtype, for other networks' fp8 files too.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from .plan import (
    COPY, ComponentPlan, ConversionError, PlanEntry, Transform, add_entry, check_expected, listed,
)

__all__ = ["SCALED_FP8_MARKER", "WEIGHT_SCALES", "INPUT_SCALES", "DEQUANTIZE", "dequantize", "llama_rename",
           "scaled_plan", "model_shapes", "check_loadable", "build_encoder"]

SCALED_FP8_MARKER = "scaled_fp8"
WEIGHT_SCALES = (".scale_weight", ".weight_scale")
INPUT_SCALES = (".scale_input", ".input_scale")


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


def llama_rename(name: str, top: Mapping[str, str], pattern: re.Pattern, block: Mapping[str, str],
                 layers: str) -> str | None:
    """A name in llama.cpp's GGUF spelling as transformers spells it, or the way back; None for a name of neither
    kind. ``top`` renames whole names (``token_embd.weight``); ``pattern`` fullmatches a numbered block's names as
    (number, tensor, parameter), ``block`` renames the tensor, and ``layers`` is the other spelling's prefix of the
    blocks (``blk.3.ffn_up.weight`` -> ``layers.3.mlp.up_proj.weight`` with ``layers="layers"``)."""
    if name in top:
        return top[name]
    m = pattern.fullmatch(name)
    if m and m.group(2) in block:
        return f"{layers}.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    return None


def scaled_plan(component: str, keys: Iterable[str], *, prefix: str, canonical: re.Pattern,
                rename: Callable[[str], str], ignore: Callable[[str, Mapping[str, str]], bool],
                expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical key: PlanEntry}`` for an encoder's keys under ``prefix`` (keys outside it are not looked
    at), in a file that may be scaled fp8.

    ``rename(name)`` is a name's canonical key (a name without the prefix; the encoder's own names as they are);
    one that ``canonical`` does not fullmatch is ``unexpected``. A weight with a ``scale_weight`` / ``weight_scale``
    is made by :data:`DEQUANTIZE` from both; a scale without its weight is ``unexpected``. ``ignored`` lists the
    ``scaled_fp8`` marker, input scales and the names ``ignore(name, names)`` says (``names``: every name under the
    prefix, to the key). ``expected``: the model's keys, to report ``missing`` and unknown names."""
    names = {key[len(prefix):]: key for key in keys if key.startswith(prefix)}
    plan = ComponentPlan(component)
    scales = {}
    for name, key in names.items():
        suffix = next((s for s in WEIGHT_SCALES if name.endswith(s)), None)
        if suffix is not None:
            scales[name[:-len(suffix)] + ".weight"] = key
    for name, key in names.items():
        if name == SCALED_FP8_MARKER or name.endswith(INPUT_SCALES) or ignore(name, names):
            plan.ignored.append(key)
            continue
        if name.endswith(WEIGHT_SCALES):
            weight = next(name[:-len(s)] + ".weight" for s in WEIGHT_SCALES if name.endswith(s))
            if weight not in names:
                plan.unexpected.append(key)   # a scale without its weight
            continue
        target = rename(name)
        if not canonical.fullmatch(target):
            plan.unexpected.append(key)
            continue
        scale = scales.get(name)
        add_entry(plan, target, PlanEntry((key, scale), DEQUANTIZE) if scale else PlanEntry((key,), COPY))
    check_expected(plan, expected)
    return plan


def model_shapes(network: Callable, config) -> dict[str, tuple[int, ...]]:
    """Every key of ``network(config)``'s state dict and its shape (the model built on the meta device)."""
    with torch.device("meta"):
        model = network(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_loadable(plan: ComponentPlan, canonical: Mapping[str, tuple[int, ...]],
                   expected: Mapping[str, tuple[int, ...]], *, path: str | None, weight_of: str, missing_from: str,
                   needs: str, named: Callable[[str], str]) -> None:
    """The checks made before any tensor of ``plan`` is read, against the ``expected`` keys and shapes of the model to
    load (``canonical``: the shapes the plan gives): a key that is not the model's (``"... that are not a <weight_of>
    weight"``), a missing key (``"missing from the <missing_from>"``, named by ``named(canonical key)`` as the file
    would name it) or a wrong shape (``"..., but a <needs> needs ..."``) is a :class:`ConversionError` naming the
    key and ``path``."""
    check_expected(plan, expected)
    if plan.unexpected:
        raise ConversionError(f"{len(plan.unexpected)} key(s) that are not a {weight_of} weight"
                              f"{listed(plan.unexpected, 'first few: ')}", path, key=plan.unexpected[0])
    if plan.missing:
        names = [named(k) for k in plan.missing]
        raise ConversionError(f"missing from the {missing_from}; {len(plan.missing)} key(s) missing"
                              f"{listed(names, 'first few: ')}", path, key=names[0])
    for key, want in expected.items():
        got = canonical[key]
        if got != want:
            raise ConversionError(f"shape {list(got)}, but a {needs} needs {list(want)}", path,
                                  key=plan.entries[key].sources[0])


def build_encoder(network: Callable, config, view: Mapping, convert: Callable[[object, str], torch.Tensor],
                  device: torch.device | str):
    """``network(config)`` built on the meta device and given the tensors of ``view`` (a checked plan's lazy view),
    each converted by ``convert(tensor, key)`` and moved to ``device`` one at a time; in eval mode, no gradients."""
    with torch.device("meta"):
        model = network(config)
    state = {key: convert(view[key], key).to(device) for key in model.state_dict()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
