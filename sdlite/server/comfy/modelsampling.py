"""How ComfyUI samples each model, for the sampler nodes: which ModelSampling node fits a model, the shift its sigma
table gets, and the model patches the sampler honours (CFGNorm, :mod:`.qwenimage`).

**The table.** ComfyUI's KSampler takes its sigmas from the model's sampling table (:mod:`sdlite.sampling.comfy`):
``ModelSamplingDiscreteFlow`` at a fixed shift for SD3, Z-Image and Qwen-Image, ``ModelSamplingFlux`` (a shift by
image size, its mu) for FLUX.1 dev and FLUX.2. Qwen-Image's pipelines shift by image size, but ComfyUI samples it
with ``ModelSamplingDiscreteFlow`` at shift 1.15 (its ``supported_models.QwenImage``: multiplier 1, shift 1.15), and
ModelSamplingAuraFlow (the stock templates' shift 3) or ModelSamplingSD3 set that shift: the sampler hands the shift
on as a :class:`~sdlite.sampling.comfy.DiscreteFlowShift` (:func:`sampler_shift`). The family declares its ComfyUI
default (``Family.comfy_shift``: Qwen-Image's ``DiscreteFlowShift(1.15)``).

**Checks** (:func:`check_sampling`, run by the sampler on the engine it samples with: the nodes themselves load
nothing): a ModelSampling node on a model without flow matching, ModelSamplingSD3 / ModelSamplingAuraFlow on a model
ComfyUI shifts by image size (FLUX.1 dev), ModelSamplingFlux on one with a fixed shift, and CFGNorm on a model other
than Qwen-Image are refused, naming the node.
"""
from __future__ import annotations

from ...config.qwenimage import QWEN_IMAGE_EDIT_FAMILIES, QWEN_IMAGE_FAMILY
from ...errors import RequestError
from ...pipeline import Request
from ...sampling.comfy import DiscreteFlowShift

__all__ = ["check_sampling", "sampler_shift", "discrete_flow_default", "CFG_NORM_FAMILIES"]

QWEN_IMAGE_FAMILIES = (QWEN_IMAGE_FAMILY, *QWEN_IMAGE_EDIT_FAMILIES)
# the families whose guidance rescales the result to the prompt's own prediction's norm (Qwen-Image's true CFG):
# what ComfyUI's CFGNorm adds to its plain CFG
CFG_NORM_FAMILIES = QWEN_IMAGE_FAMILIES


def discrete_flow_default(engine) -> DiscreteFlowShift | None:
    """The engine's ComfyUI ``ModelSamplingDiscreteFlow`` shift where its own schedule shifts by image size but ComfyUI
    samples it at a fixed shift (Qwen-Image's 1.15); None for every other model."""
    declared = getattr(engine.family, "comfy_shift", None)
    return declared if isinstance(declared, DiscreteFlowShift) else None


def sampler_shift(engine, model) -> float | None:
    """The shift the sampler's ComfyUI table takes for ``model`` (a :class:`~.nodes.ModelRef`) on ``engine``: its
    ModelSampling node's, else the model's default (None: the family's own ``comfy_shift`` or schedule); on a model
    ComfyUI samples with ``ModelSamplingDiscreteFlow`` though its pipeline shifts by size, a DiscreteFlowShift."""
    fixed = discrete_flow_default(engine)
    if fixed is None:
        return model.shift
    return fixed if model.shift is None else DiscreteFlowShift(model.shift)


def check_sampling(engine, model) -> None:
    """That the ModelSampling node which set ``model``'s shift fits the model the sampler runs: a flow-matching model
    (SD3, FLUX, Z-Image, Qwen-Image), with a fixed shift for ModelSamplingSD3 and ModelSamplingAuraFlow (.zimage) and
    one by image size for ModelSamplingFlux; and that CFGNorm is on a Qwen-Image. Checked by the sampler, on the engine
    it samples with: the nodes themselves load nothing (after a UNETLoader the bare file's engine would be one more
    engine than the sampler's)."""
    from ...sampling.flow import FlowSchedule

    name = model.origin or model.checkpoint.name
    if model.cfg_norm is not None and engine.spec.family not in CFG_NORM_FAMILIES:
        raise RequestError(f"CFGNorm: {name} ({engine.spec.family}) is no Qwen-Image: sdlite rescales the guided "
                           "prediction to the prompt's own norm for Qwen-Image's true CFG only; leave the node out")
    if not model.sampling:
        return
    schedule = engine.schedule_for(Request(prompt="", width=1024, height=1024))   # its kind, whatever the size
    if not isinstance(schedule, FlowSchedule):
        raise RequestError(f"{model.sampling}: {name} ({engine.spec.family}) is no flow-matching model (SD3, FLUX, "
                           "Z-Image, Qwen-Image): leave the node out")
    by_size = schedule.use_dynamic_shifting and discrete_flow_default(engine) is None
    if model.sampling != "ModelSamplingFlux" and by_size:
        raise RequestError(f"{model.sampling}: {name} shifts its schedule by image size (FLUX.1 dev): use "
                           "ModelSamplingFlux")
    if model.sampling == "ModelSamplingFlux" and not by_size:
        shift = discrete_flow_default(engine) or schedule.shift
        raise RequestError(f"ModelSamplingFlux: {name} has a fixed shift ({shift:g}), no shift by image size: use "
                           "ModelSamplingSD3 (ModelSamplingAuraFlow for Z-Image and Qwen-Image)")
