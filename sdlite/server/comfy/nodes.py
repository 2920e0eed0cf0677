"""ComfyUI's stock nodes on sdlite: each node's inputs and outputs as ``/object_info`` describes them, what sdlite
refuses of it at validation, and what it does when it runs.

Values flowing between nodes: a MODEL, CLIP or VAE is a reference to a checkpoint (with the LoRAs and clip skip
applied to it by LoraLoader / CLIPSetLastLayer); the engine itself comes from the server's engine cache when a node
needs it. CONDITIONING is a list of :class:`Cond` (a prompt's text with the CLIP that encodes it, FLUX's distilled
guidance, ControlNet units); the sampler encodes it. A LATENT is ComfyUI's dict: ``samples`` (B, C, h, w) in the
sampler's scaling (the VAE's latents times the family's scale) and an optional ``noise_mask``. IMAGE and MASK are
ComfyUI's tensors (:mod:`.images`).

The separate-file loaders (UNETLoader, CLIPLoader, DualCLIPLoader, TripleCLIPLoader, VAELoader, city96's GGUF
loaders) are :mod:`.loaders`'; a MODEL, CLIP or VAE from them names its files instead of a checkpoint.

LoraLoader puts a LoRA on the MODEL at ``strength_model`` and on the CLIP at ``strength_clip``, LoraLoaderModelOnly
on the MODEL only; the sampler gives each file a weight per network (:func:`lora_weights`).

ConditioningCombine's conditionings reach the sampler as more prompts of a guidance half, whose predictions it
averages (:class:`~sdlite.pipeline.latents.LatentRun`); ConditioningSetArea, ConditioningSetAreaPercentage and
ConditioningSetAreaStrength give a conditioning its :class:`~sdlite.sampling.regions.Region`, and the sampler blends
the predictions as ComfyUI does.

Refused at validation (a ``custom_validation_failed`` error naming the node's input and value): the ``bislerp`` latent
upscale. At run time: a ModelSampling node on a model it does not fit (checked by the sampler, on its engine:
:func:`.modelsampling.check_sampling`), a sampler whose conditionings come from another checkpoint's CLIP, or
whose positive and negative were encoded by CLIPs with other LoRAs; an area outside the latent, an area on a flow
model, areas with ControlNets (:func:`sdlite.sampling.regions.refuse`). ConditioningZeroOut's zeros are what ComfyUI makes (.zimage).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...config import CFG_RANGE, MAX_BATCH, MAX_STEPS
from ...engine import budget
from ...engine.memory import MemoryModeError
from ...engine.precision import PrecisionError
from ...errors import CheckpointError, ConfigError, RequestError, StopSampling
from ...pipeline import Request
from ...pipeline.latents import LatentRun
from ...pipeline.request import COMFY_MAX_SEED, COMFY_NOISE_SAMPLERS
from ...sampling.comfy import (COMFY_SAMPLERS, COMFY_SAMPLERS_MISSING, COMFY_SCHEDULERS, COMFY_SCHEDULERS_MISSING,
                              flux_shift)
from ...sampling.regions import WHOLE, Region
from . import images
from .modelsampling import check_sampling, sampler_shift
from ..limits import admit, check_size

MAX_RESOLUTION = 16384   # ComfyUI's MAX_RESOLUTION (the server's --max-pixels limits what a sampler runs)
LORA_SUFFIXES = (".safetensors", ".pt", ".ckpt")
UPSCALE_SUFFIXES = (".safetensors", ".pth", ".pt", ".ckpt", ".bin")


class Refused(Exception):
    """What sdlite cannot honour of a node, found at validation: ``input`` names the input at fault."""

    def __init__(self, input: str, message: str):
        super().__init__(message)
        self.input = input


# --- what the combo lists hold -------------------------------------------------------------------------------

class Lists:
    """The combo lists of one server (read once per validation or ``/object_info``)."""

    def __init__(self, server, dirs):
        self.server, self.dirs = server, dirs
        self._memo: dict[str, list] = {}

    def _get(self, key: str, make: Callable[[], list]) -> list:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def checkpoints(self) -> list[str]:
        return self._get("checkpoints", lambda: [c.name for c in self.server.checkpoints.list()])

    def loras(self) -> list[str]:
        def make():
            from ...adapters.lora_files import SHIPPED_DIR

            found = []
            for folder in [self.server.lora_dir, SHIPPED_DIR]:
                if folder is not None and Path(folder).is_dir():
                    found += sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*")
                                    if p.is_file() and p.suffix.lower() in LORA_SUFFIXES)
            return list(dict.fromkeys(found))
        return self._get("loras", make)

    def lora_path(self, name: str) -> str:
        from ...adapters.lora_files import SHIPPED_DIR

        for folder in [self.server.lora_dir, SHIPPED_DIR]:
            if folder is not None and (Path(folder) / name).is_file():
                return str(Path(folder) / name)
        raise RequestError(f"LoRA {name!r} not found")

    def upscalers(self) -> dict[str, Path]:
        def make():
            from ...upscalers.registry import available

            return {(p.name if p.is_file() else name): p for name, p in available(self.server.upscaler_dir).items()}
        return self._get("upscalers", make)

    def controlnets(self) -> list[str]:
        return self._get("controlnets", lambda: [m.name for m in self.server.controlnets.list()])

    def images(self) -> list[str]:
        return self._get("images", lambda: images.input_images(getattr(self.dirs, "input", None)))


# --- inputs --------------------------------------------------------------------------------------------------

VALUE_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")


@dataclass
class Input:
    """One input of a node: a widget value (INT, FLOAT, STRING, BOOLEAN, or a combo whose ``choices`` are a tuple or
    a :class:`Lists` method) or a link type (MODEL, LATENT, ...); ``options`` as ``/object_info`` shows them."""

    type: str
    options: dict = field(default_factory=dict)
    choices: Any = None
    required: bool = True
    missing: tuple = ()   # names ComfyUI has that sdlite refuses (a clearer error than "not in list")

    @property
    def is_value(self) -> bool:
        return self.type in VALUE_TYPES or self.choices is not None

    @property
    def default(self):
        return self.options.get("default")

    def values(self, lists: Lists) -> list:
        choices = self.choices
        if callable(choices):
            choices = choices(lists)
        return list(choices)

    def info(self, lists: Lists) -> list:
        if self.choices is not None:
            return [self.values(lists), dict(self.options)] if self.options else [self.values(lists)]
        return [self.type, dict(self.options)] if self.options else [self.type]

    def convert(self, value):
        if self.type == "INT":
            return int(value)
        if self.type == "FLOAT":
            return float(value)
        if self.type == "STRING":
            return str(value)
        if self.type == "BOOLEAN":
            return bool(value)
        return value

    def check(self, value, lists: Lists) -> tuple[str, str, str] | None:
        """``(type, message, details)`` of ComfyUI's error for a bad value, or None."""
        if self.choices is not None:
            allowed = self.values(lists)
            if value not in allowed:
                note = (f" ({value!r} is a ComfyUI name sdlite does not have)" if value in self.missing else "")
                return ("value_not_in_list", "Value not in list", f"'{value}' not in {allowed}{note}")
            return None
        try:
            if self.type in ("INT", "FLOAT") and (isinstance(value, (list, dict)) or value is None):
                raise TypeError(f"a {type(value).__name__} is not a number")
            converted = self.convert(value)
            if self.type == "FLOAT" and not math.isfinite(converted):
                raise ValueError("not a finite number")
        except (TypeError, ValueError, OverflowError) as e:
            return ("invalid_input_type", f"Failed to convert an input value to a {self.type} value",
                    f"{value!r}, {e}")
        low, high = self.options.get("min"), self.options.get("max")
        if low is not None and converted < low:
            return ("value_smaller_than_min", f"Value {converted} smaller than min of {low}", "")
        if high is not None and converted > high:
            return ("value_bigger_than_max", f"Value {converted} bigger than max of {high}", "")
        return None


def INT(default, lo, hi, step=1, **more) -> Input:
    return Input("INT", {"default": default, "min": lo, "max": hi, "step": step, **more})


def FLOAT(default, lo, hi, step=0.01, **more) -> Input:
    return Input("FLOAT", {"default": default, "min": lo, "max": hi, "step": step, **more})


def COMBO(choices, default=None, missing=(), **more) -> Input:
    options = ({"default": default} if default is not None else {}) | more
    return Input("COMBO", options, choices=choices, missing=missing)


def LINK(kind: str, required: bool = True) -> Input:
    return Input(kind, required=required)


# --- the values between nodes ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelRef:
    checkpoint: Any             # a server Checkpoint (UNETLoader's: the transformer file)
    loras: tuple = ()           # (path, weight) pairs
    shift: float | None = None  # a flow model's: ModelSamplingSD3's shift or ModelSamplingFlux's mu
    sampling: str = ""          # the ModelSampling node that set the shift, checked against the model by the sampler
    origin: str = ""            # the separate-file loader node that gave it, for errors
    weight_storage: str = "default"   # UNETLoader's fp8 weight_dtype: the engine's (Engine.load's weight_storage)
    cfg_norm: float | None = None     # CFGNorm's strength (.qwenimage), checked against the model by the sampler


@dataclass(frozen=True)
class ClipRef:
    checkpoint: Any             # None for a CLIP loader's
    loras: tuple = ()
    clip_skip: int = 1          # A1111's numbering: 1 = the last layer
    files: tuple = ()           # a CLIP loader's text-encoder files
    origin: str = ""


@dataclass(frozen=True)
class VaeRef:
    checkpoint: Any             # None for VAELoader's
    file: str | None = None     # VAELoader's file
    origin: str = ""


@dataclass(frozen=True)
class Cond:
    text: str
    clip: ClipRef
    guidance: float | None = None
    controls: tuple = ()        # sdlite ControlUnits
    region: Region = WHOLE      # ConditioningSetArea's area and strength
    zeroed: str = ""            # the ConditioningZeroOut node that zeroed it (.zimage): zeros of its text's encoding
    references: tuple = ()      # ReferenceLatent's latents (.flux2), each (1, C, h, w): FLUX.2 [klein]'s references


@dataclass
class Context:
    """What a running node sees: the server, ComfyUI's folders, the job's control, the prompt and its id, the
    ``extra_pnginfo`` to save, ``emit`` and the running node's id."""

    server: Any
    dirs: Any
    control: Any
    prompt: dict
    prompt_id: str
    extra_pnginfo: dict | None
    emit: Callable[[str, dict], None]
    node_id: str = ""
    sampled: tuple | None = None   # (ModelRef, ClipRef) of the last sampler run in this prompt

    def engine(self, checkpoint):
        if self.server.engines.loaded(checkpoint) is None:
            self.control.info(f"ComfyUI workflow: loading {checkpoint.name}")
        return self.server.engines.get(checkpoint)


@dataclass
class NodeDef:
    name: str
    display_name: str
    category: str
    inputs: dict[str, Input]
    outputs: tuple[str, ...]
    run: Callable
    output_names: tuple[str, ...] | None = None
    output_node: bool = False
    description: str = ""
    refuse: Callable[[dict, Lists], None] | None = None       # raises Refused
    changed: Callable[[dict, Lists], Any] | None = None       # what else says its output changed (a file's stamp)
    hidden: dict | None = None

    def info(self, lists: Lists) -> dict:
        required = {n: i.info(lists) for n, i in self.inputs.items() if i.required}
        optional = {n: i.info(lists) for n, i in self.inputs.items() if not i.required}
        spec = {"required": required}
        if optional:
            spec["optional"] = optional
        if self.hidden:
            spec["hidden"] = dict(self.hidden)
        order = {"required": list(required)}
        if optional:
            order["optional"] = list(optional)
        return {"input": spec, "input_order": order, "output": list(self.outputs),
                "output_is_list": [False] * len(self.outputs),
                "output_name": list(self.output_names or self.outputs), "name": self.name,
                "display_name": self.display_name, "description": self.description, "python_module": "nodes",
                "category": self.category, "output_node": self.output_node, "deprecated": False,
                "experimental": False}


NODES: dict[str, NodeDef] = {}


def node(name, display_name, category, inputs, outputs, output_names=None, output_node=False, description="",
         refuse=None, changed=None, hidden=None):
    def register(fn):
        NODES[name] = NodeDef(name, display_name, category, inputs, tuple(outputs), fn,
                              None if output_names is None else tuple(output_names), output_node, description, refuse,
                              changed, hidden)
        return fn
    return register


def refuse_always(input_name: str, why: str):
    def refuse(values: dict, lists: Lists) -> None:
        raise Refused(input_name, f"{values.get(input_name)!r}: {why}")
    return refuse


MODEL_LOADERS = ("CheckpointLoaderSimple", "UNETLoader", "UnetLoaderGGUF")
CLIP_LOADERS = ("CLIPLoader", "DualCLIPLoader", "TripleCLIPLoader", "CLIPLoaderGGUF", "DualCLIPLoaderGGUF",
                "TripleCLIPLoaderGGUF")


# --- engines: a checkpoint's, or a combination of separate files' (.loaders' nodes) ---------------------

def engine_for(ctx, model: ModelRef, clip: ClipRef | None = None, vae: VaeRef | None = None):
    """The engine of ``model``'s file (its transformer's weights stored as its ``weight_storage``) with ``clip``'s
    text-encoder files and ``vae``'s VAE file (each optional), from the server's engine cache; a combination that does
    not make a model is a :class:`RequestError` naming the nodes that gave the files."""
    texts = clip.files if clip is not None else ()
    vae_file = vae.file if vae is not None else None
    storage = model.weight_storage
    if not texts and vae_file is None and storage == "default":
        return ctx.engine(model.checkpoint)
    engines = ctx.server.engines
    parts = [model.origin or f"CheckpointLoaderSimple ({model.checkpoint.name})",
             *(c.origin for c in (clip, vae) if c is not None and c.origin)]
    if engines.loaded(model.checkpoint, vae_file, texts, storage) is None:
        ctx.control.info("ComfyUI workflow: loading " + " + ".join(parts))
    try:
        return engines.get(model.checkpoint, vae_file, texts, storage)
    except (CheckpointError, ConfigError, RequestError) as e:
        raise RequestError(f"{' + '.join(parts)}: these files do not make one model: {e}") from None
    except (PrecisionError, MemoryModeError) as e:   # an fp8 weight_dtype this server's engines cannot hold
        raise RequestError(f"{parts[0]}: {e}") from None


def _loaders(prompt: dict, classes: tuple[str, ...]) -> list[str]:
    return [node_id for node_id, n in prompt.items() if isinstance(n, dict) and n.get("class_type") in classes]


def _run_loader(ctx, node_id: str) -> tuple:
    spec = NODES[ctx.prompt[node_id]["class_type"]]
    inputs = ctx.prompt[node_id].get("inputs", {})
    args = {n: i.convert(inputs[n]) if n in inputs else i.default for n, i in spec.inputs.items()}
    return spec.run(dataclasses.replace(ctx, node_id=node_id), **args)


def prompt_vae(ctx) -> VaeRef | None:
    """The VAE file the prompt decodes with, for its sampler's engine: when the prompt loads one model and every VAE
    input in it comes from VAELoaders naming one file (else None: the model's own VAE, or one found beside it)."""
    prompt = ctx.prompt
    if len(_loaders(prompt, MODEL_LOADERS)) != 1:
        return None
    sources = {v[0] for n in prompt.values() if isinstance(n, dict)
               for name, v in n.get("inputs", {}).items() if name == "vae" and isinstance(v, list) and v}
    if not sources or any(prompt.get(s, {}).get("class_type") != "VAELoader" for s in sources):
        return None
    if len({prompt[s]["inputs"].get("vae_name") for s in sources}) != 1:
        return None
    return _run_loader(ctx, sorted(sources)[0])[0]


def vae_engine(ctx, vae: VaeRef):
    """The engine that encodes and decodes with ``vae``: a checkpoint's own VAE is its engine's (the one the
    sampler ran, when that model is the checkpoint with text-encoder files); a VAELoader's file goes with the model
    a sampler of this prompt ran, else with the prompt's one model loader (and its one CLIP loader, if any)."""
    sampled = ctx.sampled
    if vae.file is None:
        if sampled is not None and sampled[0].checkpoint.path == vae.checkpoint.path:
            return engine_for(ctx, sampled[0], sampled[1], None)
        return ctx.engine(vae.checkpoint)
    if sampled is not None:
        return engine_for(ctx, sampled[0], sampled[1], vae)
    models, clips = _loaders(ctx.prompt, MODEL_LOADERS), _loaders(ctx.prompt, CLIP_LOADERS)
    if len(models) != 1 or len(clips) > 1:
        raise RequestError(f"{vae.origin}: sdlite encodes and decodes with a whole model's engine, and cannot tell "
                           f"which model this VAE goes with: no sampler ran before it, and the prompt has "
                           f"{len(models)} model loaders and {len(clips)} CLIP loaders (one of each at most)")
    model = _run_loader(ctx, models[0])[0]
    clip = _run_loader(ctx, clips[0])[0] if clips else None
    return engine_for(ctx, model, clip, vae)


def has_clip_loaders(prompt: dict) -> bool:
    return bool(_loaders(prompt, CLIP_LOADERS))


# --- loaders -------------------------------------------------------------------------------------------------

def _checkpoint(ctx: Context, name: str):
    found = ctx.server.checkpoints.find(name)
    if found is None:
        raise RequestError(f"checkpoint {name!r} not found")
    return found


@node("CheckpointLoaderSimple", "Load Checkpoint", "loaders", {"ckpt_name": COMBO(Lists.checkpoints)},
      ("MODEL", "CLIP", "VAE"))
def checkpoint_loader(ctx, ckpt_name):
    ckpt = _checkpoint(ctx, ckpt_name)
    if not has_clip_loaders(ctx.prompt):   # else loaded with their files by the sampler
        ctx.engine(ckpt)   # loaded here, as ComfyUI loads it in this node
    return ModelRef(ckpt), ClipRef(ckpt), VaeRef(ckpt)


@node("LoraLoader", "Load LoRA", "loaders",
      {"model": LINK("MODEL"), "clip": LINK("CLIP"), "lora_name": COMBO(Lists.loras),
       "strength_model": FLOAT(1.0, -100.0, 100.0), "strength_clip": FLOAT(1.0, -100.0, 100.0)},
      ("MODEL", "CLIP"))
def lora_loader(ctx, model, clip, lora_name, strength_model, strength_clip):
    path = Lists(ctx.server, ctx.dirs).lora_path(lora_name)
    if strength_model != 0:
        model = dataclasses.replace(model, loras=model.loras + ((path, float(strength_model)),))
    if strength_clip != 0:
        clip = dataclasses.replace(clip, loras=clip.loras + ((path, float(strength_clip)),))
    return model, clip


@node("LoraLoaderModelOnly", "LoraLoaderModelOnly", "loaders",
      {"model": LINK("MODEL"), "lora_name": COMBO(Lists.loras), "strength_model": FLOAT(1.0, -100.0, 100.0)},
      ("MODEL",))
def lora_model_only(ctx, model, lora_name, strength_model):
    if strength_model == 0:
        return (model,)
    path = Lists(ctx.server, ctx.dirs).lora_path(lora_name)
    return (dataclasses.replace(model, loras=model.loras + ((path, float(strength_model)),)),)


def lora_weights(model_loras: tuple, clip_loras: tuple) -> tuple:
    """``Request.loras`` of a MODEL's and a CLIP's LoRAs: a file on both, paired in order, at one weight when the
    strengths are equal, else ``{"unet": strength_model, "text_encoder": strength_clip}``; a file on one of them
    at weight 0 on the other."""
    left = list(clip_loras)
    out = []
    for path, weight in model_loras:
        match = next((i for i, (p, _) in enumerate(left) if p == path), None)
        clip_weight = left.pop(match)[1] if match is not None else 0.0
        out.append((path, weight if weight == clip_weight else {"unet": weight, "text_encoder": clip_weight}))
    out += [(path, {"unet": 0.0, "text_encoder": weight}) for path, weight in left]
    return tuple(out)


@node("ControlNetLoader", "Load ControlNet Model", "loaders", {"control_net_name": COMBO(Lists.controlnets)},
      ("CONTROL_NET",))
def controlnet_loader(ctx, control_net_name):
    return (ctx.server.controlnets.resolve(control_net_name, "ControlNetLoader"),)


@node("UpscaleModelLoader", "Load Upscale Model", "loaders",
      {"model_name": COMBO(lambda lists: list(lists.upscalers()))}, ("UPSCALE_MODEL",))
def upscale_model_loader(ctx, model_name):
    return (Lists(ctx.server, ctx.dirs).upscalers()[model_name],)


@node("CLIPSetLastLayer", "CLIP Set Last Layer", "conditioning",
      {"clip": LINK("CLIP"), "stop_at_clip_layer": INT(-1, -24, -1)}, ("CLIP",))
def clip_set_last_layer(ctx, clip, stop_at_clip_layer):
    return (dataclasses.replace(clip, clip_skip=-stop_at_clip_layer),)


# --- conditioning --------------------------------------------------------------------------------------------

@node("CLIPTextEncode", "CLIP Text Encode (Prompt)", "conditioning",
      {"text": Input("STRING", {"multiline": True, "dynamicPrompts": True}), "clip": LINK("CLIP")},
      ("CONDITIONING",))
def clip_text_encode(ctx, text, clip):
    return ([Cond(text, clip)],)


@node("ConditioningCombine", "Conditioning (Combine)", "conditioning",
      {"conditioning_1": LINK("CONDITIONING"), "conditioning_2": LINK("CONDITIONING")}, ("CONDITIONING",),
      description="The sampler averages the predictions of the combined conditionings.")
def conditioning_combine(ctx, conditioning_1, conditioning_2):
    return (conditioning_1 + conditioning_2,)


def _set_region(conditioning: list, **values) -> list:
    return [dataclasses.replace(c, region=dataclasses.replace(c.region, **values)) for c in conditioning]


@node("ConditioningSetArea", "Conditioning (Set Area)", "conditioning",
      {"conditioning": LINK("CONDITIONING"), "width": INT(64, 64, MAX_RESOLUTION, 8),
       "height": INT(64, 64, MAX_RESOLUTION, 8), "x": INT(0, 0, MAX_RESOLUTION, 8), "y": INT(0, 0, MAX_RESOLUTION, 8),
       "strength": FLOAT(1.0, 0.0, 10.0)}, ("CONDITIONING",))
def conditioning_set_area(ctx, conditioning, width, height, x, y, strength):
    return (_set_region(conditioning, area=(height // 8, width // 8, y // 8, x // 8), percentage=False,
                        strength=float(strength), origin=f"ConditioningSetArea (node #{ctx.node_id})"),)


@node("ConditioningSetAreaPercentage", "Conditioning (Set Area with Percentage)", "conditioning",
      {"conditioning": LINK("CONDITIONING"), "width": FLOAT(1.0, 0, 1.0), "height": FLOAT(1.0, 0, 1.0),
       "x": FLOAT(0, 0, 1.0), "y": FLOAT(0, 0, 1.0), "strength": FLOAT(1.0, 0.0, 10.0)}, ("CONDITIONING",))
def conditioning_set_area_percentage(ctx, conditioning, width, height, x, y, strength):
    return (_set_region(conditioning, area=(height, width, y, x), percentage=True, strength=float(strength),
                        origin=f"ConditioningSetAreaPercentage (node #{ctx.node_id})"),)


@node("ConditioningSetAreaStrength", "ConditioningSetAreaStrength", "conditioning",
      {"conditioning": LINK("CONDITIONING"), "strength": FLOAT(1.0, 0.0, 10.0)}, ("CONDITIONING",))
def conditioning_set_area_strength(ctx, conditioning, strength):
    name = f"ConditioningSetAreaStrength (node #{ctx.node_id})"
    return ([dataclasses.replace(c, region=dataclasses.replace(c.region, strength=float(strength),
                                                               origin=c.region.origin or name))
             for c in conditioning],)


@node("ControlNetApplyAdvanced", "Apply ControlNet", "conditioning/controlnet",
      {"positive": LINK("CONDITIONING"), "negative": LINK("CONDITIONING"), "control_net": LINK("CONTROL_NET"),
       "image": LINK("IMAGE"), "strength": FLOAT(1.0, 0.0, 10.0), "start_percent": FLOAT(0.0, 0.0, 1.0, 0.001),
       "end_percent": FLOAT(1.0, 0.0, 1.0, 0.001), "vae": LINK("VAE", required=False)},
      ("CONDITIONING", "CONDITIONING"), output_names=("positive", "negative"))
def controlnet_apply(ctx, positive, negative, control_net, image, strength, start_percent, end_percent, vae=None):
    if strength == 0:
        return positive, negative
    from ...control import ControlUnit

    unit = ControlUnit(model=control_net, image=images.to_pil(image[:1])[0], weight=float(strength),
                       guidance_start=float(start_percent), guidance_end=float(end_percent), preprocessor="none",
                       resize_mode="crop-and-resize")
    add = lambda conds: [dataclasses.replace(c, controls=c.controls + (unit,)) for c in conds]  # noqa: E731
    return add(positive), add(negative)


@node("FluxGuidance", "FluxGuidance", "advanced/conditioning/flux",
      {"conditioning": LINK("CONDITIONING"), "guidance": FLOAT(3.5, 0.0, 100.0, 0.1)}, ("CONDITIONING",))
def flux_guidance(ctx, conditioning, guidance):
    return ([dataclasses.replace(c, guidance=float(guidance)) for c in conditioning],)


@node("ModelSamplingSD3", "ModelSamplingSD3", "advanced/model",
      {"model": LINK("MODEL"), "shift": FLOAT(3.0, 0.0, 100.0, 0.01)}, ("MODEL",))
def model_sampling_sd3(ctx, model, shift):
    return (dataclasses.replace(model, shift=float(shift), sampling="ModelSamplingSD3"),)


@node("ModelSamplingFlux", "ModelSamplingFlux", "advanced/model",
      {"model": LINK("MODEL"), "max_shift": FLOAT(1.15, 0.0, 100.0), "base_shift": FLOAT(0.5, 0.0, 100.0),
       "width": INT(1024, 16, MAX_RESOLUTION, 8), "height": INT(1024, 16, MAX_RESOLUTION, 8)}, ("MODEL",))
def model_sampling_flux(ctx, model, max_shift, base_shift, width, height):
    return (dataclasses.replace(model, shift=flux_shift(width, height, base_shift, max_shift),
                                sampling="ModelSamplingFlux"),)


# --- latents -------------------------------------------------------------------------------------------------

@node("EmptyLatentImage", "Empty Latent Image", "latent",
      {"width": INT(512, 16, MAX_RESOLUTION, 8), "height": INT(512, 16, MAX_RESOLUTION, 8),
       "batch_size": INT(1, 1, MAX_BATCH)}, ("LATENT",))
def empty_latent(ctx, width, height, batch_size):
    return ({"samples": torch.zeros(batch_size, 4, height // 8, width // 8)},)


@node("EmptySD3LatentImage", "EmptySD3LatentImage", "latent/sd3",
      {"width": INT(1024, 16, MAX_RESOLUTION, 16), "height": INT(1024, 16, MAX_RESOLUTION, 16),
       "batch_size": INT(1, 1, MAX_BATCH)}, ("LATENT",))
def empty_sd3_latent(ctx, width, height, batch_size):
    return ({"samples": torch.zeros(batch_size, 16, height // 8, width // 8)},)


_NO_BISLERP = "sdlite has no bislerp resampling: choose nearest-exact, bilinear, area or bicubic"


def _refuse_bislerp(values: dict, lists: Lists) -> None:
    if values.get("upscale_method") == "bislerp":
        raise Refused("upscale_method", f"'bislerp': {_NO_BISLERP}")


def _upscaled_latent(ctx, samples: dict, method: str, width: int, height: int, crop: str) -> dict:
    check_size(width * 8, height * 8, ctx.server.limits, "the upscaled latent's width x height (x 8)")
    out = dict(samples)
    s = samples["samples"]
    out["samples"] = images.common_upscale(s, width, height, method, crop)
    return out


@node("LatentUpscale", "Upscale Latent", "latent",
      {"samples": LINK("LATENT"), "upscale_method": COMBO(images.LATENT_UPSCALE_METHODS),
       "width": INT(512, 0, MAX_RESOLUTION, 8), "height": INT(512, 0, MAX_RESOLUTION, 8),
       "crop": COMBO(images.CROP_METHODS)}, ("LATENT",), refuse=_refuse_bislerp)
def latent_upscale(ctx, samples, upscale_method, width, height, crop):
    s = samples["samples"]
    if width == 0 and height == 0:
        return (samples,)
    if width == 0:
        height = max(64, height)
        width = max(64, round(s.shape[3] * height / s.shape[2]))
    elif height == 0:
        width = max(64, width)
        height = max(64, round(s.shape[2] * width / s.shape[3]))
    return (_upscaled_latent(ctx, samples, upscale_method, width // 8, height // 8, crop),)


@node("LatentUpscaleBy", "Upscale Latent By", "latent",
      {"samples": LINK("LATENT"), "upscale_method": COMBO(images.LATENT_UPSCALE_METHODS),
       "scale_by": FLOAT(1.5, 0.01, 8.0)}, ("LATENT",), refuse=_refuse_bislerp)
def latent_upscale_by(ctx, samples, upscale_method, scale_by):
    s = samples["samples"]
    width, height = round(s.shape[3] * scale_by), round(s.shape[2] * scale_by)
    return (_upscaled_latent(ctx, samples, upscale_method, width, height, "disabled"),)


@node("SetLatentNoiseMask", "Set Latent Noise Mask", "latent/inpaint",
      {"samples": LINK("LATENT"), "mask": LINK("MASK")}, ("LATENT",))
def set_latent_noise_mask(ctx, samples, mask):
    out = dict(samples)
    out["noise_mask"] = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1])
    return (out,)


# --- sampling ------------------------------------------------------------------------------------------------

# the sampler names KSampler offers: those whose sdlite sampler runs with ComfyUI's noise (Request(noise="comfy"));
# the others are refused by name at validation, before any model is loaded
_SAMPLERS = tuple(name for name, sampler in COMFY_SAMPLERS.items() if sampler in COMFY_NOISE_SAMPLERS)
_SAMPLERS_MISSING = (*(name for name in COMFY_SAMPLERS if name not in _SAMPLERS), *COMFY_SAMPLERS_MISSING)


def _sampler_inputs(advanced: bool) -> dict[str, Input]:
    seed = INT(0, 0, COMFY_MAX_SEED, control_after_generate=True)
    inputs = {"model": LINK("MODEL")}
    if advanced:
        inputs["add_noise"] = COMBO(("enable", "disable"))
    inputs["noise_seed" if advanced else "seed"] = seed
    inputs.update({"steps": INT(20, 1, MAX_STEPS), "cfg": FLOAT(8.0, CFG_RANGE[0], CFG_RANGE[1], 0.1, round=0.01),
                   "sampler_name": COMBO(_SAMPLERS, missing=_SAMPLERS_MISSING),
                   "scheduler": COMBO(COMFY_SCHEDULERS, missing=COMFY_SCHEDULERS_MISSING),
                   "positive": LINK("CONDITIONING"), "negative": LINK("CONDITIONING"),
                   "latent_image": LINK("LATENT")})
    if advanced:
        inputs.update({"start_at_step": INT(0, 0, 10000), "end_at_step": INT(10000, 0, 10000),
                       "return_with_leftover_noise": COMBO(("disable", "enable"))})
    else:
        inputs["denoise"] = FLOAT(1.0, 0.0, 1.0)
    return inputs


def _first(conds: list, what: str) -> Cond:
    """The first of a guidance half's conditionings; the others (ConditioningCombine's) must differ from it in
    their text and region only."""
    if not conds:
        raise RequestError(f"{what}: no conditioning")
    first = conds[0]
    for c in conds[1:]:
        if c.clip != first.clip:
            raise RequestError(f"{what}: combined conditionings encoded by other CLIPs (other LoRAs, CLIP layers or "
                               "files): sdlite encodes a guidance half's prompts with one text encoder")
        if c.guidance != first.guidance or [u.model for u in c.controls] != [u.model for u in first.controls]:
            raise RequestError(f"{what}: combined conditionings with other FluxGuidance or ControlNets: sdlite "
                               "applies one guidance and one set of ControlNets to a guidance half")
    return first


def _combined(positive: list, negative: list) -> dict:
    """The LatentRun fields of ConditioningCombine's further prompts, and of the areas and strengths if any."""
    fields = {"prompts": tuple(c.text for c in positive[1:]), "negative_prompts": tuple(c.text for c in negative[1:]),
              "zeroed": tuple(i for i, c in enumerate(positive) if c.zeroed),
              "negative_zeroed": tuple(i for i, c in enumerate(negative) if c.zeroed)}
    if any(c.region != WHOLE for c in positive + negative):
        fields.update(regions=tuple(c.region for c in positive), negative_regions=tuple(c.region for c in negative))
    return fields


def _request(ctx, model: ModelRef, seed, steps, cfg, sampler_name, scheduler, positive, negative) -> Request:
    pos, neg = _first(positive, "positive"), _first(negative, "negative")
    for what, c in (("positive", pos), ("negative", neg)):
        if not c.clip.files and model.origin:
            raise RequestError(f"{what}: its CLIP is {c.clip.checkpoint.name}'s, the model {model.origin}'s: a "
                               "diffusion model takes its text encoders from a CLIP loader (DualCLIPLoader, ...)")
        if not c.clip.files and c.clip.checkpoint.path != model.checkpoint.path:
            raise RequestError(f"{what}: its CLIP is {c.clip.checkpoint.name}'s, the model {model.checkpoint.name}: "
                               "sdlite encodes the prompts with the sampled model's own text encoders")
    if neg.clip.files != pos.clip.files:
        raise RequestError(f"positive and negative: encoded by other CLIP loaders ({pos.clip.origin} against "
                           f"{neg.clip.origin}): sdlite encodes both halves with one model's text encoders")
    if neg.clip.loras != pos.clip.loras:
        raise RequestError(f"positive and negative: their CLIPs carry other LoRAs ({list(pos.clip.loras)} against "
                           f"{list(neg.clip.loras)}): sdlite encodes both halves with one text encoder")
    if neg.clip.clip_skip != pos.clip.clip_skip:
        raise RequestError("positive and negative: encoded at different CLIP layers (CLIPSetLastLayer)")
    if [u.model for u in pos.controls] != [u.model for u in neg.controls]:
        raise RequestError("positive and negative: other ControlNets (sdlite applies a ControlNet to both halves)")
    server = ctx.server
    # a zeroed conditioning (ConditioningZeroOut) keeps its text: its zeros take that encoding's shape (_combined);
    # a negative at cfg 1 is never evaluated
    negative_text = "" if neg.zeroed and cfg <= 1.0 else neg.text
    return Request(prompt=pos.text, negative_prompt=negative_text, steps=steps, cfg_scale=cfg,
                   sampler=COMFY_SAMPLERS[sampler_name], schedule=scheduler, seed=seed, clip_skip=pos.clip.clip_skip,
                   loras=lora_weights(model.loras, pos.clip.loras), guidance=pos.guidance, controls=pos.controls,
                   lora_dir=server.lora_dir, embeddings_dir=server.embeddings_dir, noise="comfy",
                   reference_images=pos.references)


def _sample(ctx: Context, model: ModelRef, clip: ClipRef, request: Request, latent: dict, denoised=None,
            **run) -> tuple:
    engine = engine_for(ctx, model, clip, prompt_vae(ctx))
    check_sampling(engine, model)
    ctx.sampled = (model, clip)
    samples = latent["samples"]
    channels = engine.family.latent.channels
    if samples.shape[1] != channels and not samples.any():   # ComfyUI's fix_empty_latent_channels
        samples = torch.zeros(samples.shape[0], channels, *samples.shape[2:])
    scale = engine.family.latent.downscale
    width, height = samples.shape[3] * scale, samples.shape[2] * scale
    limits = ctx.server.limits
    check_size(width, height, limits, "the latent's width x height")
    admit(engine, request.replace(width=width, height=height, batch_size=samples.shape[0]), limits)
    control, emit = ctx.control, ctx.emit
    control.begin(1)
    control.iteration(0, request.steps)
    previews = ctx.server.options_snapshot().get("live_previews_enable", True)

    def on_step(step, total):
        emit("progress", {"value": step, "max": total, "prompt_id": ctx.prompt_id, "node": ctx.node_id})
        control.step(step, total)

    def on_latents(step, total, estimate):   # a preview only when someone would see it (control.preview_wanted)
        if denoised is not None:   # the custom samplers' denoised_output: the last step's estimate (.custom)
            denoised["x0"] = estimate
        if previews and estimate is not None and control.preview_wanted():
            image = engine.preview(estimate[:1])[0]
            control.set_preview(image, step)
            emit("preview", {"image": image})

    run = LatentRun(samples, mask=latent.get("noise_mask"), shift=sampler_shift(engine, model), **run)
    result = engine.sample_latents(request, run, callback=on_step, on_latents=on_latents)
    if result.interrupted or control.interrupted:
        raise StopSampling()
    out = dict(latent)
    out["samples"] = result.latents
    return (out,)


@node("KSampler", "KSampler", "sampling", _sampler_inputs(False), ("LATENT",))
def ksampler(ctx, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise=1.0):
    request = _request(ctx, model, seed, steps, cfg, sampler_name, scheduler, positive, negative)
    return _sample(ctx, model, positive[0].clip, request, latent_image, denoise=denoise,
                   **_combined(positive, negative))


@node("KSamplerAdvanced", "KSampler (Advanced)", "sampling", _sampler_inputs(True), ("LATENT",))
def ksampler_advanced(ctx, model, add_noise, noise_seed, steps, cfg, sampler_name, scheduler, positive, negative,
                      latent_image, start_at_step, end_at_step, return_with_leftover_noise):
    request = _request(ctx, model, noise_seed, steps, cfg, sampler_name, scheduler, positive, negative)
    return _sample(ctx, model, positive[0].clip, request, latent_image, start_step=start_at_step, last_step=end_at_step,
                   add_noise=add_noise == "enable", force_full_denoise=return_with_leftover_noise != "enable",
                   **_combined(positive, negative))


# --- images --------------------------------------------------------------------------------------------------

@node("VAEDecode", "VAE Decode", "latent", {"samples": LINK("LATENT"), "vae": LINK("VAE")}, ("IMAGE",))
def vae_decode(ctx, samples, vae):
    engine = vae_engine(ctx, vae)
    latents = samples["samples"]
    if latents.shape[1] != engine.family.latent.channels:
        raise RequestError(f"VAEDecode: {latents.shape[1]}-channel latents; {vae.origin or vae.checkpoint.name}'s "
                           f"VAE decodes {engine.family.latent.channels}")
    scale = engine.family.latent.downscale
    piece = budget.pieces(engine, latents.shape[2] * scale, latents.shape[3] * scale, latents.shape[0])[1]
    return (images.decoded_to_image(engine.decode_scaled(latents, piece=piece)),)


def _encode(ctx, vae: VaeRef, pixels: torch.Tensor) -> torch.Tensor:
    engine = vae_engine(ctx, vae)
    vae_in = images.image_to_vae(pixels)
    return torch.cat([engine.encode_image(vae_in[i:i + 1], None) for i in range(vae_in.shape[0])]).cpu().float()


@node("VAEEncode", "VAE Encode", "latent", {"pixels": LINK("IMAGE"), "vae": LINK("VAE")}, ("LATENT",))
def vae_encode(ctx, pixels, vae):
    return ({"samples": _encode(ctx, vae, images.crop_to_multiple(pixels))},)


@node("VAEEncodeForInpaint", "VAE Encode (for Inpainting)", "latent/inpaint",
      {"pixels": LINK("IMAGE"), "vae": LINK("VAE"), "mask": LINK("MASK"), "grow_mask_by": INT(6, 0, 64)},
      ("LATENT",))
def vae_encode_inpaint(ctx, pixels, vae, mask, grow_mask_by):
    h, w = pixels.shape[1] // 8 * 8, pixels.shape[2] // 8 * 8
    mask = F.interpolate(mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1]).float(),
                         size=(pixels.shape[1], pixels.shape[2]), mode="bilinear")
    pixels = pixels.clone()
    if (pixels.shape[1], pixels.shape[2]) != (h, w):
        top, left = (pixels.shape[1] % 8) // 2, (pixels.shape[2] % 8) // 2
        pixels = pixels[:, top:top + h, left:left + w, :]
        mask = mask[:, :, top:top + h, left:left + w]
    if grow_mask_by == 0:
        grown = mask
    else:
        kernel = torch.ones(1, 1, grow_mask_by, grow_mask_by)
        grown = torch.clamp(F.conv2d(mask.round(), kernel, padding=math.ceil((grow_mask_by - 1) / 2)), 0, 1)
    keep = (1.0 - mask.round()).squeeze(1)
    pixels = (pixels - 0.5) * keep[..., None] + 0.5
    return ({"samples": _encode(ctx, vae, pixels), "noise_mask": grown[:, :, :h, :w].round()},)


@node("LoadImage", "Load Image", "image", {"image": COMBO(Lists.images, image_upload=True)}, ("IMAGE", "MASK"),
      changed=lambda inputs, lists: images.file_stamp(getattr(lists.dirs, "input", None), inputs.get("image")))
def load_image(ctx, image):
    pixels, mask = images.load_image(ctx.dirs.input, image)
    check_size(pixels.shape[2], pixels.shape[1], ctx.server.limits, f"image {image!r}'s width x height")
    return pixels, mask


@node("LoadImageMask", "Load Image (as Mask)", "mask",
      {"image": COMBO(Lists.images, image_upload=True), "channel": COMBO(("alpha", "red", "green", "blue"))},
      ("MASK",),
      changed=lambda inputs, lists: images.file_stamp(getattr(lists.dirs, "input", None), inputs.get("image")))
def load_image_mask(ctx, image, channel):
    return (images.load_mask(ctx.dirs.input, image, channel),)


def _scaled_image(image: torch.Tensor, method: str, width: int, height: int, crop: str, limits) -> torch.Tensor:
    check_size(width, height, limits, "the scaled image's width x height")
    return images.common_upscale(image.permute(0, 3, 1, 2), width, height, method, crop).permute(0, 2, 3, 1)


@node("ImageScale", "Upscale Image", "image/upscaling",
      {"image": LINK("IMAGE"), "upscale_method": COMBO(images.UPSCALE_METHODS),
       "width": INT(512, 0, MAX_RESOLUTION), "height": INT(512, 0, MAX_RESOLUTION),
       "crop": COMBO(images.CROP_METHODS)}, ("IMAGE",))
def image_scale(ctx, image, upscale_method, width, height, crop):
    if width == 0 and height == 0:
        return (image,)
    width, height = images.scaled_size(width, height, image.shape[2], image.shape[1], 1)
    return (_scaled_image(image, upscale_method, width, height, crop, ctx.server.limits),)


@node("ImageScaleBy", "Upscale Image By", "image/upscaling",
      {"image": LINK("IMAGE"), "upscale_method": COMBO(images.UPSCALE_METHODS), "scale_by": FLOAT(1.0, 0.01, 8.0)},
      ("IMAGE",))
def image_scale_by(ctx, image, upscale_method, scale_by):
    width, height = round(image.shape[2] * scale_by), round(image.shape[1] * scale_by)
    return (_scaled_image(image, upscale_method, width, height, "disabled", ctx.server.limits),)


@node("ImageUpscaleWithModel", "Upscale Image (using Model)", "image/upscaling",
      {"upscale_model": LINK("UPSCALE_MODEL"), "image": LINK("IMAGE")}, ("IMAGE",))
def image_upscale_with_model(ctx, upscale_model, image):
    from ...upscalers.registry import network_scale, upscale_by

    scale = network_scale(upscale_model) or 4
    check_size(image.shape[2] * scale, image.shape[1] * scale, ctx.server.limits, "the upscaled width x height")
    out = [upscale_by(im, upscale_model, scale) for im in images.to_pil(image)]
    return (images.from_pil(out),)


_SAVE_HIDDEN = {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}


@node("SaveImage", "Save Image", "image", {"images": LINK("IMAGE"), "filename_prefix": Input(
    "STRING", {"default": "ComfyUI"})}, (), output_node=True, hidden=_SAVE_HIDDEN,
      description="Saves the input images to your ComfyUI output directory.")
def save_image(ctx, filename_prefix="ComfyUI", **kw):
    entries = images.save_images(kw["images"], ctx.dirs.output, filename_prefix, "output", ctx.prompt,
                                 ctx.extra_pnginfo)
    return {"images": entries}, ()


@node("PreviewImage", "Preview Image", "image", {"images": LINK("IMAGE")}, (), output_node=True,
      hidden=_SAVE_HIDDEN, description="Saves the input images to your ComfyUI temp directory.")
def preview_image(ctx, **kw):
    entries = images.save_images(kw["images"], ctx.dirs.temp, images.temp_prefix(), "temp", ctx.prompt,
                                 ctx.extra_pnginfo, compress_level=1)
    return {"images": entries}, ()

