"""Opening FLUX.1 checkpoints (dev and schnell): what :func:`sdlite.loader.open_model` does for this family.

**diffusers folders** (``model_index.json``: ``FluxPipeline`` and its img2img and inpaint siblings; a
``FluxKontextPipeline`` or ``FluxKontextInpaintPipeline`` folder is a FLUX.1 Kontext release, family
``flux-kontext``): ``text_encoder``
(CLIPTextModel, CLIP ViT-L: only its pooled output is read), ``text_encoder_2`` (T5-XXL), their tokenizers,
``transformer``, ``vae`` (16 channels with FLUX's shift and scale) and ``scheduler``. In sdlite T5 is the model's
``text_encoder_3`` component, as in SD3 (one T5 slot for every family); the folder's names are kept on disk.

**Single files**: Black Forest Labs' ``flux1-dev.safetensors`` / ``flux1-schnell.safetensors`` hold the transformer
alone, in BFL's names (:mod:`sdlite.weights.flux_keys`); the VAE (``ae.safetensors``, LDM names without a prefix),
CLIP-L (``clip_l.safetensors``) and T5 (``t5xxl_fp16.safetensors``, ``t5xxl_fp8_e4m3fn.safetensors``, ...) come from
files given (``text_encoders=``: the CLI's ``--text-encoder``, repeatable, which also takes the VAE file) or found
beside the model (its folder, ``text_encoders/``, ``vae/``, or ComfyUI's ``models/text_encoders``, ``models/clip`` and
``models/vae``). ComfyUI's all-in-one checkpoints hold all four: the transformer under ``model.diffusion_model.``, the
VAE under ``vae.`` (or ``first_stage_model.``), the encoders under ``text_encoders.clip_l.transformer.`` and
``text_encoders.t5xxl.transformer.``. What a separate file holds is read from its keys and shapes. fp8 weights are
converted to the compute dtype when loaded, as for SD3.

Which release a transformer is shows in its weights: dev embeds the guidance scale (``guidance_in``), schnell does not.
Kontext's weights are dev's in shape: a single file is a Kontext release when its name says so (``kontext`` in it, as in
``flux1-kontext-dev.safetensors`` or a GGUF ``flux1-kontext-dev-Q4_K_M.gguf``). A file with neither VAE nor CLIP-L found
is refused, naming what is missing; T5 is required too (FLUX's text conditioning is T5's alone).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import ConfigError, TextEncoderConfig, VAEConfig
from ..config.flux import FLUX_TEXT_L, FLUX_VAE, FluxConfig, flux_spec
from ..errors import CheckpointError
from .beside import Parts, add_parts, opened, vae_part, vae_prefix
from .convert import normalize_diffusers_keys
from .detect import Detection
from .flux_keys import flux_layout, flux_plan, infer_flux_config, is_flux, original_names
from .folders import component_store, folder_tokenizer, read_json, storage_dtype, text_architecture
from .plan import ComponentPlan
from .sd3 import CLIP_L_PREFIX
from .store import ComponentSource, TensorStore
from .t5_keys import SINGLE_FILE_PREFIX as T5_PREFIX
from .t5_keys import find_t5_prefix, infer_t5_config, t5_plan
from .text_keys import clip_from_original, infer_text_encoder

__all__ = ["FLUX_PIPELINES", "KONTEXT_PIPELINES", "is_kontext_name", "open_flux_folder", "open_flux_file",
           "is_flux_file", "flux_family"]

KONTEXT_PIPELINES = ("FluxKontextPipeline", "FluxKontextInpaintPipeline")
FLUX_PIPELINES = ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", *KONTEXT_PIPELINES)
# VAE prefixes of the all-in-one checkpoints (ComfyUI writes FLUX's under "vae.")
_VAE_PREFIXES = ("vae.", "first_stage_model.")
_NAMES = {"text_encoder": "CLIP-L", "text_encoder_3": "T5-XXL", "vae": "VAE (ae.safetensors)"}
# the names the separate files go by, tried beside a model that lacks them
_BESIDE = (("text_encoder", ("clip_l*.safetensors",)),
           ("text_encoder_3", ("t5xxl_fp16*.safetensors", "t5xxl*.safetensors", "t5*.safetensors", "t5*.gguf")),
           ("vae", ("ae.safetensors", "ae*.safetensors", "flux*vae*.safetensors")))


def is_kontext_name(path) -> bool:
    """Whether a single file's name says it is a FLUX.1 Kontext release (its weights are dev's in shape)."""
    return "kontext" in Path(path).name.lower()


def flux_family(transformer: FluxConfig) -> str:
    return "flux-dev" if transformer.guidance_embeds else "flux-schnell"


def is_flux_file(keys) -> bool:
    """Whether a single file's keys hold a FLUX transformer (BFL's names, with or without ComfyUI's prefix)."""
    keys = list(keys)
    return is_flux(keys) and flux_layout(keys)[0] == "bfl"


def _check_parts(transformer: FluxConfig, vae: VAEConfig, clip, t5, where) -> None:
    if clip.width != transformer.pooled_projection_dim:
        raise CheckpointError(f"CLIP-L's width {clip.width} is not the transformer's pooled width "
                              f"{transformer.pooled_projection_dim}", where)
    if t5.d_model != transformer.joint_attention_dim:
        raise CheckpointError(f"T5's width {t5.d_model} is not the transformer's text width "
                              f"{transformer.joint_attention_dim}", where)
    if vae.latent_channels * 4 != transformer.in_channels:
        raise CheckpointError(f"the VAE's {vae.latent_channels} latent channels do not make the transformer's "
                              f"{transformer.in_channels}-value tokens (2x2 patches)", where)


def _spec_and_detection(transformer, vae, clip, t5, scheduler, layout, where, kontext: bool = False):
    _check_parts(transformer, vae, clip, t5, where)
    try:
        spec = flux_spec(transformer, text=clip, text3=t5, vae=vae, scheduler=scheduler, kontext=kontext)
    except ConfigError as e:
        raise CheckpointError(str(e), where) from None
    return spec, Detection(layout=layout, family=spec.family, components=(*spec.text_encoders, "transformer", "vae"),
                           unet=None)


# --- folders ---------------------------------------------------------------------------------------------------


def open_flux_folder(folder: Path, index: dict, index_file: Path) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of a FLUX pipeline folder."""
    cls = index.get("_class_name")
    for needed in ("text_encoder", "text_encoder_2", "tokenizer", "transformer", "vae"):
        if not (folder / needed).is_dir() or index.get(needed, ["", ""]) == [None, None]:
            raise CheckpointError(f"the {cls} folder has no {needed}", folder)
    stores: list[TensorStore] = []
    sources: dict[str, ComponentSource] = {}
    try:
        configs = {}
        for sub, component in (("text_encoder", "text_encoder"), ("text_encoder_2", "text_encoder_3"),
                               ("transformer", "transformer"), ("vae", "vae")):
            configs[component] = read_json(folder / sub / "config.json")
            store = component_store(folder, sub)
            stores.append(store)
            keys = list(store.keys())
            if component == "transformer":
                plan = flux_plan(keys)
            elif component == "text_encoder_3":
                plan = t5_plan(keys)
            else:
                plan = normalize_diffusers_keys(keys, "vae" if component == "vae" else "text_encoder")
            sources[component] = ComponentSource.from_plan(plan, store, tuple(store.paths))
        if text_architecture(configs["text_encoder"], folder / "text_encoder" / "config.json") != "clip":
            raise CheckpointError("FLUX's first text encoder is a CLIP text tower", folder / "text_encoder")
        try:
            transformer = FluxConfig.from_diffusers(configs["transformer"])
            vae = VAEConfig.from_diffusers(configs["vae"])
            clip = TextEncoderConfig.from_diffusers(configs["text_encoder"])
            tokenizer = folder_tokenizer(folder / "tokenizer", clip)
            clip = dataclasses.replace(clip, pad_token_id=tokenizer.pad_token_id)
            t5 = infer_t5_config(sources["text_encoder_3"].shapes)
        except (ConfigError, KeyError, TypeError) as e:
            raise CheckpointError(f"unusable component config: {e}", folder) from None
        sched_file = folder / "scheduler" / "scheduler_config.json"
        scheduler = read_json(sched_file) if sched_file.is_file() else None
        spec, detection = _spec_and_detection(transformer, vae, clip, t5, scheduler, "diffusers", folder,
                                              kontext=cls in KONTEXT_PIPELINES)
    except BaseException:
        for store in stores:
            store.close()
        raise
    return dict(path=str(folder), layout="diffusers", spec=spec, detection=detection,
                storage_dtype=storage_dtype(stores[2]), prediction_source="flow matching (FLUX.1)",
                sources=sources, scheduler_config=dict(spec.scheduler),
                scheduler_source="scheduler/scheduler_config.json" if sched_file.is_file()
                else f"{spec.family}'s published scheduler (the folder has none)",
                tokenizer_dir=str(folder / "tokenizer"), notes=[], _stores=stores, _tokenizer=tokenizer)


# --- single files and the files beside them --------------------------------------------------------------------


def _clip(keys: list[str], shapes: dict, prefix: str, where) -> tuple[ComponentPlan, TextEncoderConfig]:
    """CLIP-L in transformers' names under ``prefix``; its projection, where the file has one, is not used."""
    plan = clip_from_original(keys, prefix=prefix)
    plan.unexpected = [k for k in plan.unexpected if not k.endswith("text_projection.weight")]
    info = infer_text_encoder(plan.shapes(shapes), "diffusers")
    cfg = TextEncoderConfig(**{**info.config_kwargs(), "projection_dim": FLUX_TEXT_L.projection_dim})
    return plan, dataclasses.replace(cfg, pad_token_id=FLUX_TEXT_L.pad_token_id,
                                     eos_token_id=FLUX_TEXT_L.eos_token_id)


def _file_kind(keys: list[str], shapes: dict, where) -> tuple[str, str]:
    """``(component, prefix)`` of a separate file: T5, CLIP-L or the VAE."""
    t5 = find_t5_prefix(keys)
    if t5 is not None:
        return "text_encoder_3", t5
    for prefix in ("", CLIP_L_PREFIX):
        if any(k.startswith((prefix + "text_model.", prefix + "embeddings.token_embedding.")) for k in keys):
            return "text_encoder", prefix
    prefix = vae_prefix(shapes, ("", *_VAE_PREFIXES))
    if prefix is not None:
        return "vae", prefix
    raise CheckpointError("not a file FLUX takes beside its transformer (no T5 'encoder.block.0...', CLIP "
                          "'text_model...' or VAE 'encoder.conv_in'/'decoder.conv_in' keys)"
                          + (f"; the first key is {keys[0]!r}" if keys else ""), where)


def _parts(configs: dict) -> Parts:
    """The parts FLUX takes beside its transformer; their configs go to ``configs``."""
    def source(component, keys, prefix, store, path):
        if component == "text_encoder_3":
            return ComponentSource.from_plan(t5_plan(keys, prefix=prefix), store, (str(path),))
        if component == "text_encoder":
            shapes = {k: tuple(store.shape(k)) for k in keys}
            plan, configs["text_encoder"] = _clip(keys, shapes, prefix, path)
            return ComponentSource.from_plan(plan, store, (str(path),))
        found, configs["vae"] = vae_part(keys, prefix, store, path, FLUX_VAE)
        return found

    return Parts(names=_NAMES, patterns=_BESIDE, kind=_file_kind, source=source)


def _check_complete(transformer: FluxConfig, source: ComponentSource, prefix: str, path) -> None:
    """Every tensor of the transformer its shapes describe is in the file: the missing ones are named as the file
    names them (a fused tensor by its own name)."""
    import torch

    from ..models.flux import Flux

    with torch.device("meta"):
        expected = Flux(transformer).state_dict().keys()
    missing = [k for k in expected if k not in source.shapes]
    if missing:
        names = original_names(missing, prefix)
        raise CheckpointError(f"{len(names)} FLUX transformer tensors are missing from the file, first few: "
                              + ", ".join(repr(n) for n in names[:5]), path, names[0])


def open_flux_file(path: Path, store: TensorStore, text_encoders=()) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of a FLUX single file (``store``, already open) with the parts it
    lacks from ``text_encoders`` (paths: CLIP-L, T5 and the VAE) or found beside it."""
    stores = [store]
    sources: dict[str, ComponentSource] = {}
    notes: list[str] = []
    with opened(stores, path):
        keys = list(store.keys())
        _, prefix = flux_layout(keys)
        inside = [k for k in keys if k.startswith(prefix)] if prefix else \
            [k for k in keys if not k.startswith(("text_encoders.", *_VAE_PREFIXES))]
        sources["transformer"] = ComponentSource.from_plan(flux_plan(inside), store, (str(path),))
        transformer = infer_flux_config(sources["transformer"].shapes)
        _check_complete(transformer, sources["transformer"], prefix, path)
        configs: dict = {}
        parts = _parts(configs)
        for vprefix in _VAE_PREFIXES:
            if any(k.startswith(vprefix + "decoder.") for k in keys):
                sources["vae"] = parts.source("vae", keys, vprefix, store, path)
        if any(k.startswith(CLIP_L_PREFIX) for k in keys):
            sources["text_encoder"] = parts.source("text_encoder", keys, CLIP_L_PREFIX, store, path)
        if find_t5_prefix(keys) == T5_PREFIX:
            sources["text_encoder_3"] = parts.source("text_encoder_3", keys, T5_PREFIX, store, path)
        add_parts(path, parts, sources, stores, notes, given=text_encoders,
                  needed=("text_encoder", "text_encoder_3", "vae"))
        for component in ("text_encoder", "text_encoder_3", "vae"):
            if component not in sources:
                raise CheckpointError(
                    f"the FLUX model has no {_NAMES[component]}: the file holds none and none was given "
                    "(--text-encoder PATH, repeatable: clip_l.safetensors, t5xxl_fp16.safetensors, ae.safetensors) "
                    "or found beside it", path)
        t5 = infer_t5_config(sources["text_encoder_3"].shapes)
        spec, detection = _spec_and_detection(transformer, configs["vae"], configs["text_encoder"], t5, None,
                                              "original", path, kontext=is_kontext_name(path))
        for name, source in sources.items():
            if source.unexpected:
                notes.append(f"{len(source.unexpected)} {name} keys not understood (ignored)")
    return dict(path=str(path), layout="original", spec=spec, detection=detection,
                storage_dtype=storage_dtype(store, prefix=prefix if prefix else ""),
                prediction_source="flow matching (FLUX.1)", sources=sources, scheduler_config=dict(spec.scheduler),
                scheduler_source=f"{spec.family}'s published scheduler (FlowMatchEulerDiscreteScheduler)",
                notes=notes, _stores=stores)

