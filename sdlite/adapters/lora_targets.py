"""Which layer of a model each of a LoRA's layers names, and whether the LoRA fits that model.

A file names a layer by its diffusers module path, dotted or with ``_`` for ``.`` (kohya), a text encoder's with or
without transformers' ``text_model.``, or a UNet's by the original LDM / SGM layout (mapped through the checkpoint
converter's own table, :func:`sdlite.weights.convert.unet_to_original`), an SD3 transformer's by Stability's MMDiT
layout (:func:`sdlite.weights.mmdit_keys.mmdit_to_original`; its stacked q/k/v layers split into the model's three
by :func:`split_fused`), a FLUX transformer's by BFL's (:func:`sdlite.weights.flux_keys.flux_to_original`, split
likewise), a FLUX.2 transformer's by BFL's too (:func:`sdlite.weights.flux2_keys.flux2_to_original`), a Z-Image transformer's by the original code's, as ComfyUI names it
(:func:`sdlite.weights.zimage_keys.zimage_to_comfy`: ``attention.qkv`` split likewise). A Qwen-Image transformer has
one layout: diffusers' names are ComfyUI's and the original code's.

Refused, with a :class:`LoraError`: a LoRA made for another family (SD 1.x, SD 2.x, SDXL, the SDXL refiner: told from
its cross-attention or text-encoder width), a UNet's LoRA on a transformer and the other way round, one with layers of
a network the model lacks or of a text encoder that takes none (Z-Image's Qwen3), layers that match no layer of the
model or whose shapes do not fit. Everything is re-exported by :mod:`sdlite.adapters.lora`.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..engine.lowbit import LowBitLinear
from ..engine.packing import PackedConv2d, PackedLinear
from ..engine.quant import BF16Conv2d, BF16Linear, Int8Conv2d, Int8Linear
from ..errors import SDLiteError
from .lora_keys import (
    _CROSS_ATTENTION_FAMILY,
    _TEXT_WIDTH_FAMILY,
    TEXT_COMPONENTS,
    _UNET_PATH,
    Lora,
    LoraError,
    LoraLayer,
    _listing,
)

_DENSE = (nn.Linear, nn.Conv2d, BF16Linear, BF16Conv2d)   # a float weight of their own

# a model's family (ModelSpec.family, "-inpaint" removed) as messages name it
_SPEC_FAMILY = {"sd1": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL", "sdxl-refiner": "the SDXL refiner", "sd3": "SD3",
                "sd3.5-medium": "SD3.5 Medium", "sd3.5-large": "SD3.5 Large", "flux-dev": "FLUX.1 dev",
                "flux-schnell": "FLUX.1 schnell", "flux-kontext": "FLUX.1 Kontext",
                "z-image-turbo": "Z-Image-Turbo", "flux2-klein": "FLUX.2 [klein]",
                "flux2-klein-base": "FLUX.2 [klein] base", "qwen-image": "Qwen-Image"}
# the LLM a family reads as its text encoder (for messages; an LLM takes no LoRA)
_LLM_NAMES = {"z-image-turbo": "Qwen3", "qwen-image": "Qwen2.5-VL's language model"}
# what a layer of each component is called in the two file formats (for messages)
_COMPONENT_KEYS = {"unet": "lora_unet_ / unet.", "transformer": "lora_transformer_ / transformer.",
                   "text_encoder": "lora_te_ or lora_te1_ / text_encoder.",
                   "text_encoder_2": "lora_te2_ / text_encoder_2.", "text_encoder_3": "lora_te3_ / text_encoder_3."}


def _layer_shape(layer: nn.Module) -> tuple[int, ...] | None:
    """(out, in) or (out, in/groups, kh, kw) of a Linear/Conv2d, plain, prepacked or int8; None for other modules."""
    if isinstance(layer, (PackedLinear, LowBitLinear, Int8Linear)):
        return (layer.out_features, layer.in_features)
    if isinstance(layer, (PackedConv2d, Int8Conv2d)):
        return (layer.out_channels, layer.in_channels // getattr(layer, "groups", 1), *layer.kernel_size)
    if isinstance(layer, _DENSE):
        return tuple(layer.weight.shape)
    return None


class _Fused(tuple):
    """A layer of an original layout that is several of the model's, or one stored in another row order: ``(op,
    module paths)``, op "cat" (the paths' rows stacked: SD3's ``attn.qkv``) or "swap_halves" (one path, its two
    halves exchanged: SD3's (shift, scale) modulations)."""


def _original_plan(module: nn.Module, component: str, weights: list[str]):
    """The checkpoint converter's table from the model's names to the original layout's (LDM / SGM UNets, SD3's
    MMDiT), or None where the network has no other layout."""
    config = getattr(module, "config", None)
    try:
        if component == "unet" and config is not None and hasattr(config, "attention"):
            from ..weights.convert import unet_to_original

            return unet_to_original(weights, config, prefix="")
        if component == "transformer" and type(config).__name__ == "MMDiTConfig":
            from ..weights.mmdit_keys import mmdit_to_original

            return mmdit_to_original(weights, prefix="")
        if component == "transformer" and type(config).__name__ == "FluxConfig":
            from ..weights.flux_keys import flux_to_original

            return flux_to_original(weights, prefix="")
        if component == "transformer" and type(config).__name__ == "Flux2Config":
            from ..weights.flux2_keys import flux2_to_original

            return flux2_to_original(weights, prefix="")
        if component == "transformer" and type(config).__name__ == "ZImageConfig":
            from ..weights.zimage_keys import zimage_to_comfy

            return zimage_to_comfy(weights, prefix="")
    except SDLiteError:
        return None
    return None


def _lookup(module: nn.Module, component: str) -> dict[str, str]:
    """Every name a file may give a layer -> its module path: dotted and underscored (kohya), the text encoder's
    without ``text_model.`` (transformers 5's naming), the UNet's in the original LDM layout and the transformer's
    in its original one (Stability's, BFL's, Z-Image's as ComfyUI names it), dotted and underscored (a fused or
    reordered layer there -> a :class:`_Fused`). The model's own names come first."""
    table: dict[str, str] = {}
    leaves = [(name, layer) for name, layer in module.named_modules()
              if name and not any(True for _ in layer.children())]
    for name, _ in leaves:
        aliases = [name]
        if component in TEXT_COMPONENTS and name.startswith("text_model."):
            aliases.append(name.removeprefix("text_model."))
        for alias in aliases:
            table.setdefault(alias, name)
            table.setdefault(alias.replace(".", "_"), name)
    plan = _original_plan(module, component, [f"{name}.weight" for name, _ in leaves])
    if plan is not None:
        for original, entry in plan.entries.items():
            if not original.endswith(".weight"):
                continue
            dotted = original.removesuffix(".weight")
            paths = tuple(source.removesuffix(".weight") for source in entry.sources)
            op = entry.transform.op
            for alias in (dotted, dotted.replace(".", "_")):
                table.setdefault(alias, paths[0] if op == "copy" else _Fused((op, paths)))
    return table


def split_fused(lora: Lora, component: str, table: dict, module: nn.Module) -> Lora:
    """``lora`` with each of its ``component`` layers that names a fused or reordered layer of an original layout
    (``table`` from :func:`_lookup`) given as the model's layers: a stacked q/k/v layer's ``up`` split by rows
    into the three projections (the same ``down``, rank and alpha), a swapped modulation's halves exchanged. A
    layer whose rows do not add up is refused, naming the layers."""
    layers, changed = [], False
    for layer in lora.layers:
        fused = table.get(layer.target) if layer.component == component else None
        if not isinstance(fused, _Fused):
            layers.append(layer)
            continue
        op, paths = fused
        changed = True
        up = layer.up
        if op == "swap_halves":
            half = up.shape[0] // 2
            layers.append(replace(layer, target=paths[0], up=torch.cat([up[half:], up[:half]])))
            continue
        rows = [_layer_shape(module.get_submodule(path))[0] for path in paths]
        if sum(rows) != up.shape[0]:
            raise LoraError(f"{layer.key!r} does not fit {' + '.join(repr(p) for p in paths)}: the LoRA has "
                            f"{up.shape[0]} outputs, the layers have {' + '.join(map(str, rows))}", lora.path)
        layers.extend(replace(layer, target=path, up=part, key=f"{layer.key} ({path})")   # one key per layer
                      for path, part in zip(paths, up.split(rows)))
    return Lora(lora.path, lora.format, layers, lora.metadata) if changed else lora


def _spec_family(spec) -> str | None:
    """How messages name the family of the model ``spec`` describes (None: no spec, or a family without a name)."""
    if spec is None:
        return None
    family = getattr(spec, "family", "")
    return _SPEC_FAMILY.get(family) or _SPEC_FAMILY.get(family.removesuffix("-inpaint"))


def _model_family(component: str, module: nn.Module, spec=None) -> tuple[str | None, int] | None:
    """(family name, width) of ``module``: its cross-attention width (UNet) or its width (a text encoder); the
    name from ``spec`` where given, else from the width."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    width = getattr(config, "context_dim" if component == "unet" else "width", None)
    if width is None:
        return None
    if spec is not None:
        return _spec_family(spec), width
    return (_CROSS_ATTENTION_FAMILY if component == "unet" else _TEXT_WIDTH_FAMILY).get(width), width


def _model_components(spec) -> tuple[str, ...]:
    return (getattr(spec, "denoiser", "unet"), *spec.text_encoders)


def check_denoiser(lora: Lora, spec) -> None:
    """Refuse a UNet's LoRA on a model whose denoiser is a transformer (SD3), and a transformer's on a UNet model,
    saying which (before the layers are matched: they would only "match nothing")."""
    have = _model_components(spec)
    name = _spec_family(spec)
    this = f", this model is {name}" if name else ""
    if have[0] == "unet" and lora.layers_of("transformer"):
        raise LoraError(f"made for a transformer model such as SD3 (it has transformer layers: "
                        f"{_COMPONENT_KEYS['transformer']}){this}, whose denoiser is a UNet", lora.path)
    if have[0] == "transformer" and lora.made_for_unet:
        implied = lora.implied_family("unet")
        made = implied[0] if implied and implied[0] else "a UNet model"
        raise LoraError(f"made for {made} (it has layers of UNet blocks: "
                        f"{_listing([layer.key for layer in lora.layers_of('unet')], 2)}){this}, whose denoiser is "
                        "a transformer", lora.path)


def check_text_encoders(lora: Lora, spec) -> None:
    """Refuse layers of a text encoder that takes no LoRA here: an LLM's (the Qwen3 decoder of Z-Image, Qwen2.5-VL's
    language model for Qwen-Image), which diffusers' loaders leave alone too (``ZImagePipeline.load_lora_weights`` and
    ``QwenImagePipeline.load_lora_weights`` load the transformer's layers only). The message names one of the file's
    keys."""
    for component in TEXT_COMPONENTS:
        config = getattr(spec, {"text_encoder": "text", "text_encoder_2": "text2",
                                "text_encoder_3": "text3"}[component], None)
        layers = lora.layers_of(component)
        if layers and type(config).__name__ == "QwenConfig":
            name = _spec_family(spec)
            this = f"this model ({name})" if name else "this model"
            llm = _LLM_NAMES.get(getattr(spec, "family", ""), "Qwen")
            raise LoraError(f"has {len(layers)} layers of a text encoder (e.g. {layers[0].key!r}); {this} reads an "
                            f"LLM ({llm}) as its text encoder, which takes no LoRA in sdlite: only the transformer's "
                            "layers (transformer. / diffusion_model. / lora_unet_) are applied. Remove the text "
                            "encoder's keys from the file", lora.path)


def check_components(lora: Lora, spec) -> None:
    """Refuse a LoRA with layers of a network the model of ``spec`` does not have: a second text encoder (an SDXL
    LoRA on SD 1.x/2.x), a first one (an SDXL base LoRA on the refiner, which has only the second)."""
    have = _model_components(spec)
    name = _spec_family(spec)
    this = f", this model is {name}" if name else ""
    for component in ("text_encoder_3",):
        if lora.layers_of(component) and component not in have:
            raise LoraError(f"has layers of a third text encoder (T5: {_COMPONENT_KEYS[component]}){this}, which "
                            "has none", lora.path)
    if lora.layers_of("text_encoder_2") and "text_encoder_2" not in have:
        raise LoraError(f"made for SDXL (it has layers of a second text encoder: {_COMPONENT_KEYS['text_encoder_2']})"
                        f"{this}, which has one text encoder", lora.path)
    if lora.layers_of("text_encoder") and "text_encoder" not in have:
        made = ("made for the SDXL base model" if lora.made_for_sdxl
                else "made for a model with a CLIP ViT-L text encoder")
        raise LoraError(f"{made} (it has layers of a first text encoder: {_COMPONENT_KEYS['text_encoder']}){this}, "
                        f"whose only text encoder is {', '.join(c for c in have if c != 'unet')}", lora.path)


def check_family(lora: Lora, component: str, module: nn.Module, spec=None) -> None:
    """Refuse a LoRA whose shapes imply another family than ``module``'s (the ``component`` network of the model
    ``spec`` describes, where given), saying which. Without ``spec`` a LoRA with layers of a second text encoder
    is refused for a ``text_encoder``: nothing tells that the model has a second one (SDXL's first text encoder
    has SD 1.x's shapes); ``engine_with_loras`` passes the engine's spec."""
    if component == "text_encoder" and lora.layers_of("text_encoder_2") and (
            spec is None or "text_encoder_2" not in spec.text_encoders):
        model = _model_family("text_encoder", module, spec)
        this = f", this model is {model[0]}" if model and model[0] else ""
        hint = "" if spec is not None else " (for SDXL's first text encoder, pass the model's spec)"
        raise LoraError(f"made for SDXL (it has layers of a second text encoder: lora_te2_ / text_encoder_2){this}"
                        f"{hint}", lora.path)
    implied = lora.implied_family(component)
    model = _model_family(component, module, spec)
    if implied is None or model is None or implied[1] == model[1]:
        return
    what = "cross-attention width" if component == "unet" else "text-encoder width"
    made = f"{implied[0]} ({what} {implied[1]})" if implied[0] else f"a model of {what} {implied[1]}"
    this = f"this model is {model[0]} ({model[1]})" if model[0] else f"this model's {what} is {model[1]}"
    raise LoraError(f"made for {made}, {this}", lora.path)


def resolve_targets(module: nn.Module, lora: Lora, component: str, _table: dict | None = None,
                    spec=None) -> dict[str, str]:
    """The module path in ``module`` (the ``component`` network) of each of ``lora``'s layers, by the file's key of
    its down weight. Refuses a LoRA made for another family and one with layers that match nothing."""
    table = _lookup(module, component) if _table is None else _table
    check_family(lora, component, module, spec)
    layers = lora.layers_of(component)
    unmatched = [layer.key for layer in layers if table.get(layer.target) is None]
    if unmatched:
        raise LoraError(f"{len(unmatched)} of its {len(layers)} {component.replace('_', ' ')} layers match no "
                        f"layer of this model: {_listing(unmatched)}", lora.path)
    return {layer.key: table[layer.target] for layer in layers}


def _check_shapes(path: str, layer: LoraLayer, name: str, shape: tuple[int, ...]) -> None:
    out, inp = shape[0], shape[1]
    kernel = tuple(shape[2:]) if len(shape) == 4 else (1, 1)
    down_kernel = tuple(layer.down.shape[2:]) if layer.down.dim() == 4 else (1, 1)
    problem = None
    if layer.out_features != out:
        problem = f"{layer.out_features} outputs, the layer has {out}"
    elif layer.in_features != inp and not (len(shape) == 4 and name == "conv_in" and layer.in_features < inp):
        problem = f"{layer.in_features} inputs, the layer has {inp}"
    elif down_kernel != kernel:
        problem = f"a {down_kernel[0]}x{down_kernel[1]} kernel, the layer has {kernel[0]}x{kernel[1]}"
    if problem:
        raise LoraError(f"{layer.key!r} does not fit {name!r}: the LoRA has {problem}", path)
