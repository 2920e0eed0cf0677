"""LoRA: low-rank weight updates of the UNet and the text encoder(s), read from the files people have.

    lora = read_lora("style.safetensors")                    # kohya/A1111 or diffusers/PEFT, parsed once
    handle = merge(unet, [(lora, 0.8)], "unet")               # W += 0.8 * alpha / rank * up @ down
    ...                                                       # sample: no per-step cost
    handle.restore()                                          # the saved originals back, bit for bit

    with engine_with_loras(engine, [("style.safetensors", 0.8)]) as loras:   # every memory mode
        result = engine.generate(request)

The parts: :mod:`~sdlite.adapters.lora_keys` (the file layouts, parsed into a :class:`Lora`),
:mod:`~sdlite.adapters.lora_files` (reading, finding by name, hashes), :mod:`~sdlite.adapters.lora_targets` (the
model layer each LoRA layer names, the family and shape checks) and this module (merging, applying on the fly, the
engine), which re-exports the others' public names.

Refused, with a :class:`LoraError` naming the file and the reason: the LyCORIS types other than LoCon (LoHa,
LoKr, (IA)^3, full weight differences, GLoRA, norm, OFT/BOFT; also LoCon's CP-decomposed ``lora_mid`` and DoRA),
a LoRA made for another family (SD 1.x, SD 2.x, SDXL, the SDXL refiner: told from its cross-attention or
text-encoder width), one with layers of a network the model lacks (a second text encoder on SD 1.x/2.x, a first one
on the SDXL refiner) or of a text encoder that takes none (Z-Image's Qwen3 LLM), layers that match no layer of the
model (how many, and a few of them) or whose shapes do not fit. An SD 1.x LoRA's text-encoder layers alone fit
SDXL's first text encoder (the same CLIP ViT-L shapes) and are applied there, as diffusers does.

Application (:func:`merge`), chosen by how the network holds its weights:

* resident weights (memory modes 1 and 2, fp32 or the compute dtype): each touched layer gets a new weight,
  ``W + sum(scale * up @ down)`` computed in fp32 (one ``addmm`` per LoRA into a copy), and the original
  tensor object is kept until :meth:`MergeHandle.restore` puts it back. Nothing is subtracted, so un-merging is
  exact, and a long-lived engine can serve each request with other LoRAs. While merged, the originals of the
  touched layers stay in memory beside the merged copies (none where they are views of an fp32 file).
* prepacked layers (:mod:`sdlite.engine.packing`): the packed weight is unpacked (``to_dense()`` returns the
  exact fp32 weight it was packed from), merged as above and packed again; the original packed tensor is kept
  and put back by ``restore()``.
* streamed weights (memory mode 0's UNet and SDXL text encoders, ``weight_dtype`` fp16 -- SDXL's default on the
  CPU for half-precision files --, text encoders kept as stored): the network's
  :class:`~sdlite.engine.memory.WeightStreamer` materialises each block's weights just before the block runs;
  the touched layers' weights are merged there, with the same arithmetic as above, so the result is bit for bit
  the one a resident merge gives, and nothing is kept but the LoRA's own factors. The per-step cost is one
  fp32 copy and one rank-r ``addmm`` per touched layer, independent of the image size (``bench/lora.py``).

* int8 layers (the int8 precisions, ``bf16-int8`` among them: what ``auto`` picks for full-size models on CPUs with
  native bf16 and VNNI) keep only their codes: the layer's weight is read again from the checkpoint (``stored``),
  held in the dtype the codes were made from, merged as above and quantized again into a new layer
  (:func:`~sdlite.engine.quant.requantize`), which takes the old layer's place until ``restore()`` puts it back.
  The result is, bit for bit, the layer that quantizing the float model with the LoRA merged gives.

A 4-input-channel LoRA of ``conv_in`` on an inpainting UNet (9 channels) covers the first 4, as A1111 pads it.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, Union

import torch
from torch import nn

from ..engine.lowbit import LowBitLinear
from ..engine.packing import PackedConv2d, PackedLinear
from ..engine.quant import Int8Conv2d, Int8Linear, requantize
from ..weights.quants import QuantizedTensor
from .lora_files import (  # noqa: F401  (the public names of lora_files, lora_keys and lora_targets are re-exported)
    EXTENSIONS,
    SHIPPED_DIR,
    find_lora,
    list_loras,
    lora_alias,
    lora_hash,
    lora_hashes_infotext,
    lora_name,
    lora_names,
    read_lora,
)
from .lora_keys import COMPONENTS, METADATA_KEY, TEXT_COMPONENTS, Lora, LoraError, LoraLayer  # noqa: F401
from .lora_targets import (  # noqa: F401
    _check_shapes,
    _layer_shape,
    _lookup,
    _model_components,
    check_components,
    check_denoiser,
    check_family,
    check_text_encoders,
    resolve_targets,
    split_fused,
)

_PACKED = (PackedLinear, PackedConv2d)
_INT8 = (Int8Linear, Int8Conv2d)

# --- applying ---------------------------------------------------------------------------------------------------

LoraSource = Union[Lora, str, os.PathLike]
Weight = Union[float, Mapping[str, float]]
# a network's stored weights by key (``"down_blocks.0.resnets.0.conv1.weight"``): a tensor as the file holds it (any
# float dtype, or a GGUF block format's QuantizedTensor), e.g. ``lambda key: ckpt.tensor("unet", key)``
StoredWeights = Callable[[str], object]


def _as_lora(source: LoraSource) -> Lora:
    return source if isinstance(source, Lora) else read_lora(source)


def _multiplier(weight: Weight, component: str) -> float:
    """The multiplier of ``component``; a mapping without ``text_encoder_2`` gives SDXL's second text encoder the
    first one's (A1111's text-encoder multiplier applies to both)."""
    if isinstance(weight, Mapping):
        if component in ("text_encoder_2", "text_encoder_3") and component not in weight:
            component = "text_encoder"
        if component == "transformer" and component not in weight:
            component = "unet"
        return float(weight.get(component, 1.0))
    return float(weight)


@dataclass
class _Update:
    """One LoRA's factors for one layer, ready to add: ``weight.view(out, -1) += scale * up @ down``."""

    up: torch.Tensor        # (out, r) fp32 on the layer's device
    down: torch.Tensor      # (r, in * kh * kw)
    scale: float
    pad_in: int = 0         # input channels to zero-pad (a 4-channel LoRA on an inpainting UNet's conv_in)


def _plan(module: nn.Module, loras: Sequence[tuple[Lora, Weight]], component: str,
          device: torch.device | None = None, materialise: bool = True, spec=None,
          stored: StoredWeights | None = None) -> dict[str, list[_Update]]:
    """Module path -> updates; every check done before anything is changed. ``stored``: the network's stored
    weights, which int8 layers need (their merged weight is quantized again from the stored one)."""
    if component not in COMPONENTS:
        raise ValueError(f"component {component!r}: expected one of {', '.join(COMPONENTS)}")
    table = _lookup(module, component)
    plan: dict[str, list[_Update]] = {}
    for lora, weight in loras:
        lora = split_fused(lora, component, table, module)
        names = resolve_targets(module, lora, component, table, spec)
        multiplier = _multiplier(weight, component)
        for layer in lora.layers_of(component):
            name = names[layer.key]
            target = module.get_submodule(name)
            shape = _layer_shape(target)
            if isinstance(target, _INT8) and stored is None:
                raise LoraError(f"{layer.key!r}: layer {name!r} is quantized ({type(target).__name__}) and keeps no "
                                "float weight to merge into; merging into it needs the network's stored weights "
                                "(merge(..., stored=lambda key: checkpoint.tensor(component, key))), from which "
                                "the merged weight is quantized again", lora.path)
            if shape is None:
                kind = type(target).__name__
                raise LoraError(f"{layer.key!r}: layer {name!r} is a {kind}, not a Linear or Conv2d layer",
                                lora.path)
            _check_shapes(lora.path, layer, name, shape)
            pad = shape[1] - layer.in_features if len(shape) == 4 else 0
            if not materialise or multiplier == 0:   # a network at weight 0 (e.g. ComfyUI's strength_clip 0) is left
                continue
            dev = device or _device_of(target)
            up = layer.up.reshape(layer.out_features, layer.rank).to(dev, torch.float32)
            down = layer.down.reshape(layer.rank, -1).to(dev, torch.float32)
            plan.setdefault(name, []).append(_Update(up, down, layer.scale(multiplier), pad))
    return plan


def _device_of(layer: nn.Module) -> torch.device:
    if isinstance(layer, (*_PACKED, *_INT8)):
        return torch.device("cpu")
    return layer.weight.device if layer.weight.device.type != "meta" else torch.device("cpu")


def _add_updates(weight: torch.Tensor, updates: Sequence[_Update]) -> torch.Tensor:
    """``weight`` (a fresh fp32 tensor, changed in place) plus each update, in order. The one function that
    merges, for resident and streamed weights alike, so both give the same bits."""
    weight = weight.contiguous()   # a channels-last copy (the bf16 precision's convolutions): made plain
    flat = weight.view(weight.shape[0], -1)
    for u in updates:
        if u.pad_in:   # conv_in of an inpainting UNet: the LoRA covers the first input channels only
            delta = (u.up @ u.down).view(weight.shape[0], -1, *weight.shape[2:])
            weight[:, :delta.shape[1]].add_(delta, alpha=u.scale)
        else:
            flat.addmm_(u.up, u.down, alpha=u.scale)
    return weight


def _repack(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered as :class:`~sdlite.engine.packing.PackedConv2d` / ``PackedLinear`` pack theirs."""
    weight = weight.contiguous()
    if isinstance(layer, PackedConv2d):
        return torch.ops.mkldnn._reorder_convolution_weight(weight, list(layer.padding), list(layer.stride),
                                                            list(layer.dilation), layer.groups, None)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


class MergeHandle:
    """What :func:`merge` changed, and how to undo it: :meth:`restore` puts the saved originals back, and
    :meth:`reapply` the merged layers again (both only swap objects: nothing is computed)."""

    def __init__(self, module: nn.Module, component: str, mode: str):
        self.module, self.component, self.mode = module, component, mode   # mode: "merged" | "on the fly"
        self.layers = 0
        self._changes: list[tuple[Callable[[], None], Callable[[], None]]] = []   # (apply, undo), in order
        self._applied = False
        self.keeps_originals = True

    def _record(self, apply: Callable[[], None], undo: Callable[[], None]) -> None:
        """One change, already made: ``apply`` makes it, ``undo`` puts back what was there before."""
        self._changes.append((apply, undo))
        self._applied = True

    @property
    def active(self) -> bool:
        return self._applied and bool(self._changes)

    def restore(self) -> None:
        """Undo, last change first. Several handles on one network are restored last first (as
        :func:`engine_with_loras` does): each puts back what was there before it. The merged layers are kept for
        :meth:`reapply` as long as the handle is."""
        if self._applied:
            for _, undo in reversed(self._changes):
                undo()
            self._applied = False

    def reapply(self) -> None:
        """Make the changes again after :meth:`restore` (the same merged objects, first change first), where the
        network holds what it held when they were first made."""
        if not self._applied:
            for apply, _ in self._changes:
                apply()
            self._applied = True

    def __enter__(self) -> "MergeHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"MergeHandle({self.component}, {self.mode}, {self.layers} layers, active={self.active})"


def merge(module: nn.Module, loras: Sequence[tuple[LoraSource, Weight]], component: str,
          keep_originals: bool = True, spec=None, stored: StoredWeights | None = None) -> MergeHandle:
    """Apply ``loras`` (``(Lora or path, multiplier)``; a multiplier may be ``{"unet": a, "text_encoder": b}``,
    SDXL's ``text_encoder_2`` taking ``b`` unless given its own) to ``module``, the ``component`` network
    (``unet``, ``text_encoder`` or ``text_encoder_2``), and return the handle that undoes it.

    Resident weights are merged now; a streamed network's (:func:`sdlite.engine.memory.streamed_model`) are
    merged block by block as they are materialised (:func:`apply_on_the_fly`). Everything is checked first: a
    :class:`LoraError` leaves the module as it was. ``keep_originals=False`` keeps nothing to restore (for a
    network that is discarded after use). ``spec``: the :class:`~sdlite.config.ModelSpec` of the model
    ``module`` belongs to, for the family checks (needed to merge an SDXL LoRA into SDXL's first text encoder).
    ``stored``: the network's weights as stored (key -> tensor), needed where touched layers are int8
    (:func:`_requantize_layer`)."""
    loaded = [(_as_lora(source), weight) for source, weight in loras]
    if getattr(module, "_streamer", None) is not None:
        return apply_on_the_fly(module, loaded, component, spec=spec)
    plan = _plan(module, loaded, component, spec=spec, stored=stored)
    handle = MergeHandle(module, component, "merged")
    handle.keeps_originals = keep_originals
    try:
        with torch.no_grad():
            for name, updates in plan.items():
                layer = module.get_submodule(name)
                if isinstance(layer, _INT8):
                    _requantize_layer(module, name, stored(f"{name}.weight"), updates, handle, keep_originals)
                else:
                    _merge_layer(layer, updates, handle, keep_originals)
                handle.layers += 1
    except BaseException:
        handle.restore()
        raise
    return handle


def _merge_layer(layer: nn.Module, updates: Sequence[_Update], handle: MergeHandle, keep: bool) -> None:
    if isinstance(layer, LowBitLinear):   # weights kept in a GGUF block format: merged per call, as they are read
        previous = layer.weight_update
        update = lambda w: _add_updates(w if previous is None else previous(w), updates)   # noqa: E731
        layer.weight_update = update
        if keep:
            handle._record(lambda: setattr(layer, "weight_update", update),
                           lambda: setattr(layer, "weight_update", previous))
        return
    if isinstance(layer, _PACKED):
        original = layer.packed
        packed = _repack(layer, _add_updates(original.to_dense(), updates))   # to_dense(): a fresh copy
        layer.packed = packed
        if keep:
            handle._record(lambda: setattr(layer, "packed", packed), lambda: setattr(layer, "packed", original))
        return
    original = layer._parameters["weight"]
    merged = _add_updates(original.detach().to(torch.float32, copy=True), updates).to(original.dtype)
    if original.dim() == 4 and not original.is_contiguous() and \
            original.is_contiguous(memory_format=torch.channels_last):
        merged = merged.contiguous(memory_format=torch.channels_last)   # the layer keeps its layout
    merged = nn.Parameter(merged, requires_grad=False)
    layer._parameters["weight"] = merged
    if keep:
        handle._record(lambda: layer._parameters.__setitem__("weight", merged),
                       lambda: layer._parameters.__setitem__("weight", original))


def _requantize_layer(module: nn.Module, name: str, weight, updates: Sequence[_Update], handle: MergeHandle,
                      keep: bool) -> None:
    """An int8 layer keeps only its codes: the stored ``weight`` (as the file holds it), held in the dtype the
    layer's codes were made from, plus the updates in fp32, is quantized again into a new layer
    (:func:`~sdlite.engine.quant.requantize`) that takes the old one's place; ``restore()`` puts the old one
    back. The result is the layer a float model with the LoRA merged would quantize to, bit for bit."""
    layer = module.get_submodule(name)
    held = layer.held_as
    if not torch.is_tensor(weight):                        # a GGUF block format
        weight = weight.dequantize(held)
    merged = _add_updates(weight.to(held).to(torch.float32, copy=True), updates)
    new = requantize(layer, merged.reshape(_layer_shape(layer)))
    module.set_submodule(name, new)
    if keep:
        handle._record(lambda: module.set_submodule(name, new), lambda: module.set_submodule(name, layer))


def apply_on_the_fly(module: nn.Module, loras: Sequence[tuple[LoraSource, Weight]], component: str,
                     spec=None) -> MergeHandle:
    """Apply ``loras`` to a streamed network: each touched layer's weight is merged when its block's weights are
    materialised (its ``WeightStreamer`` provider is wrapped), with :func:`merge`'s arithmetic; ``restore()``
    unwraps it. Costs one fp32 copy and one rank-r ``addmm`` per touched layer and forward pass."""
    streamer = getattr(module, "_streamer", None)
    if streamer is None:
        raise ValueError("apply_on_the_fly needs a streamed network (sdlite.engine.memory.streamed_model); "
                         "use merge() for resident weights")
    loaded = [(_as_lora(source), weight) for source, weight in loras]
    plan = _plan(module, loaded, component, device=torch.device(streamer.device), spec=spec)
    by_key = {f"{name}.weight": updates for name, updates in plan.items()}
    base = streamer.provider
    device = streamer.device

    def provider(key: str) -> torch.Tensor:
        stored = base(key)
        updates = by_key.get(key)
        if updates is None:
            return stored
        if isinstance(stored, QuantizedTensor):   # a GGUF block format
            stored = stored.dequantize(torch.float32)
        with torch.no_grad():
            return _add_updates(stored.to(device=device, dtype=torch.float32, copy=True), updates)

    streamer.provider = provider
    handle = MergeHandle(module, component, "on the fly")
    handle.layers = len(by_key)

    def apply():
        streamer.provider = provider

    def undo():
        streamer.provider = base

    handle._record(apply, undo)
    return handle


# --- the engine -------------------------------------------------------------------------------------------------


def _meta_network(spec, component: str) -> nn.Module:
    from ..loader import build_network

    with torch.device("meta"):
        return build_network(component, spec)


@dataclass
class _Kept:
    """The merged layers of the last request with LoRAs, kept (restored, ready to :meth:`~MergeHandle.reapply`) on
    an engine in memory mode 1: ``key`` names the request's files (path, size, modification time) or parsed
    :class:`Lora` objects, and weights."""

    key: tuple
    sources: list            # the request's sources, held: a parsed Lora is named by its id in the key
    loaded: list             # (Lora, weight), as the networks took them
    touched: list[str]
    handles: list[MergeHandle]


def _request_key(loras: Sequence[tuple[LoraSource, Weight]]) -> tuple | None:
    """What makes a request's LoRAs the same as another's: each file by its path, size and modification time (or a
    parsed :class:`Lora` by identity) with its weight; None where a file cannot be read (the read says why)."""
    parts = []
    for source, weight in loras:
        if isinstance(source, Lora):
            ident: tuple = ("parsed", id(source))
        else:
            try:
                found = os.stat(source)
            except OSError:
                return None
            ident = (os.path.realpath(source), found.st_size, found.st_mtime_ns)
        if isinstance(weight, Mapping):
            weight = tuple(sorted((str(k), float(v)) for k, v in weight.items()))
        else:
            weight = float(weight)
        parts.append((ident, weight))
    return tuple(parts)


@contextlib.contextmanager
def engine_with_loras(engine, loras: Sequence[tuple[LoraSource, Weight]]):
    """Within the block, ``engine`` generates with ``loras`` (``(Lora or path, multiplier)``) applied to its UNet
    and text encoder(s) (SDXL: both); on leaving, every touched weight is restored exactly. Yields the parsed
    :class:`Lora` list.

    Works in every memory mode: resident networks are merged now (prepacked layers re-packed, int8 layers quantized
    again), streamed ones (memory mode 0's UNet and SDXL text encoders, ``weight_dtype`` fp16, text encoders kept as
    stored) per block as they run, and the networks the :class:`~sdlite.engine.memory.ModelManager` builds while
    the block runs (the text encoders of modes 0 and 2, loaded for each prompt and freed after) as it builds them,
    without keeping originals of those it frees. All files are read and checked against the model first (a network
    the model lacks, another family, layers that match nothing or do not fit); an error changes nothing.

    In memory mode 1 (every network resident) the merged layers of the last request with LoRAs stay in memory
    beside the originals after it (``manager.kept_loras``): the next request with the same files, unchanged, at the
    same weights swaps them in again without reading or merging anything (``bench/lora.py``: a rank-8 LoCon of every
    SD 1.5 attention and ResBlock layer takes 1.2 s of merging in bf16 and 3.1 s in bf16-int8 on one thread, and
    3 ms kept). Other LoRAs or weights drop them first. Modes 0 and 2, which trade time for memory, keep nothing."""
    manager = engine.models
    key = _request_key(loras) if loras and manager.mode == 1 else None
    kept: _Kept | None = manager.kept_loras
    resident = dict(manager._resident)
    if kept is not None and (key != kept.key or any(resident.get(h.component) is not h.module
                                                    for h in kept.handles)):
        manager.kept_loras = kept = None   # dropped before anything is merged: never two sets in memory
    if not loras:
        yield []
        return
    spec = engine.spec
    ckpt = manager.ckpt

    def stored(component: str) -> StoredWeights | None:   # int8 layers are quantized again from the file's weights
        return None if ckpt is None else (lambda key: ckpt.tensor(component, key))

    if kept is not None:
        loaded, touched, handles = kept.loaded, kept.touched, kept.handles
        for handle in handles:
            handle.reapply()
    else:
        loaded = [(_as_lora(source), weight) for source, weight in loras]
        components = _model_components(spec)
        for lora, _ in loaded:
            check_denoiser(lora, spec)
            check_text_encoders(lora, spec)
        loaded = [(lora.for_denoiser(components[0]), weight) for lora, weight in loaded]
        touched = [c for c in components if any(lora.layers_of(c) for lora, _ in loaded)]
        for component in touched:   # check every layer against the model before touching anything
            module = resident.get(component) or _meta_network(spec, component)
            _plan(module, loaded, component, materialise=False, spec=spec, stored=stored(component))
        for lora, _ in loaded:
            check_components(lora, spec)
        handles = []

    def adapt(name: str, module: nn.Module, keep: bool) -> None:
        if name in touched:
            handle = merge(module, loaded, name, keep_originals=keep, spec=spec, stored=stored(name))
            if keep:
                handles.append(handle)

    adapt.components = frozenset(touched)   # the networks it changes (ModelManager.adapted)

    # networks the manager builds while the block runs (the text encoders of modes 0 and 2, per use) get the
    # LoRAs through its adapter hook
    complete = False
    try:
        covered = {h.component for h in handles}
        for component in touched:
            if component in resident and component not in covered:
                adapt(component, resident[component], True)
        manager.adapters.append(adapt)
        complete = True
        yield [lora for lora, _ in loaded]
    finally:
        if adapt in manager.adapters:
            manager.adapters.remove(adapt)
        for handle in reversed(handles):
            handle.restore()
        if complete and key is not None:
            manager.kept_loras = _Kept(key, list(loras), loaded, touched, handles)


__all__ = ["Lora", "LoraLayer", "LoraError", "MergeHandle", "read_lora", "merge", "apply_on_the_fly",
           "engine_with_loras", "lora_hash", "lora_hashes_infotext", "check_family", "check_components",
           "check_denoiser", "check_text_encoders", "resolve_targets", "find_lora", "lora_name"]
