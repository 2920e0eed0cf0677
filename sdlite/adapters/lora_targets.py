"""Which layer of a model each of a LoRA's layers names, and whether the LoRA fits that model.

A file names a layer by its diffusers module path, dotted or with ``_`` for ``.`` (kohya), a text encoder's with or
without transformers' ``text_model.``, or a UNet's by the original LDM / SGM layout (mapped through the checkpoint
converter's own table, :func:`sdlite.weights.convert.unet_to_original`). Refused, with a :class:`LoraError`: a LoRA
made for another family (SD 1.x, SD 2.x, SDXL, the SDXL refiner: told from its cross-attention or text-encoder
width), one with layers of a network the model lacks, layers that match no layer of the model or whose shapes do
not fit. Everything is re-exported by :mod:`sdlite.adapters.lora`.
"""
from __future__ import annotations

from torch import nn

from ..engine.packing import PackedConv2d, PackedLinear
from ..errors import SDLiteError
from .lora_keys import (
    _CROSS_ATTENTION_FAMILY,
    _TEXT_WIDTH_FAMILY,
    TEXT_COMPONENTS,
    Lora,
    LoraError,
    LoraLayer,
    _listing,
)

_DENSE = (nn.Linear, nn.Conv2d)

# a model's family (ModelSpec.family, "-inpaint" removed) as messages name it
_SPEC_FAMILY = {"sd1": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL", "sdxl-refiner": "the SDXL refiner"}
# what a layer of each component is called in the two file formats (for messages)
_COMPONENT_KEYS = {"unet": "lora_unet_ / unet.", "text_encoder": "lora_te_ or lora_te1_ / text_encoder.",
                   "text_encoder_2": "lora_te2_ / text_encoder_2."}


def _layer_shape(layer: nn.Module) -> tuple[int, ...] | None:
    """(out, in) or (out, in/groups, kh, kw) of a Linear/Conv2d, plain or prepacked; None for other modules."""
    if isinstance(layer, PackedLinear):
        return (layer.out_features, layer.in_features)
    if isinstance(layer, PackedConv2d):
        return (layer.out_channels, layer.in_channels // layer.groups, *layer.kernel_size)
    if isinstance(layer, _DENSE):
        return tuple(layer.weight.shape)
    return None


def _lookup(module: nn.Module, component: str) -> dict[str, str]:
    """Every name a file may give a layer -> its module path: dotted and underscored (kohya), the text encoder's
    without ``text_model.`` (transformers 5's naming), the UNet's in the original LDM layout."""
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
    config = getattr(module, "config", None)
    if component == "unet" and config is not None and hasattr(config, "attention"):
        from ..weights.convert import unet_to_original

        try:
            plan = unet_to_original([f"{name}.weight" for name, _ in leaves], config, prefix="")
        except SDLiteError:
            plan = None
        if plan is not None:
            for original, entry in plan.entries.items():
                table.setdefault(original.removesuffix(".weight").replace(".", "_"), entry.sources[0][:-7])
    return table


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
    return ("unet", *spec.text_encoders)


def check_components(lora: Lora, spec) -> None:
    """Refuse a LoRA with layers of a network the model of ``spec`` does not have: a second text encoder (an SDXL
    LoRA on SD 1.x/2.x), a first one (an SDXL base LoRA on the refiner, which has only the second)."""
    have = _model_components(spec)
    name = _spec_family(spec)
    this = f", this model is {name}" if name else ""
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
