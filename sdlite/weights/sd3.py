"""Opening Stable Diffusion 3 / 3.5 checkpoints: what :func:`sdlite.loader.open_model` does for this family.

**diffusers folders** (``model_index.json``: ``StableDiffusion3Pipeline`` and its img2img and inpaint siblings):
``text_encoder`` (CLIP ViT-L with its projection), ``text_encoder_2`` (OpenCLIP bigG with its projection),
``text_encoder_3`` (T5-XXL; a folder saved without it, ``[null, null]`` in model_index.json, runs without T5), their
tokenizers, ``transformer`` (the MMDiT), ``vae`` (16 channels, shift and scale) and ``scheduler``
(FlowMatchEulerDiscreteScheduler). Weights in any of a component's files (plain, fp16/bf16 variants, sharded).

**Single files** (Stability's ``sd3.5_large.safetensors``, ``sd3.5_medium.safetensors``, ``sd3_medium*.safetensors``;
ComfyUI's all-in-one checkpoints): the MMDiT under ``model.diffusion_model.`` in Stability's names, the VAE under
``first_stage_model.`` in LDM names, and the text encoders, where the file has them, under
``text_encoders.{clip_l,clip_g,t5xxl}.transformer.`` in transformers' names. Text encoders the file lacks come from
**separate files** (ComfyUI's ``clip_l.safetensors``, ``clip_g.safetensors``, ``t5xxl_fp16.safetensors``,
``t5xxl_fp8_e4m3fn.safetensors``): given (``text_encoders=``, the CLI's ``--text-encoder``, repeatable), else found
beside the model (its folder, its ``text_encoders/`` subfolder, or ComfyUI's ``models/text_encoders`` and
``models/clip``). Which encoder a file holds is read from its shapes. CLIP-L and bigG are required; T5 is optional
(without it, its conditioning is zeros and a warning says so). fp8 weights (e4m3fn, e5m2, and "scaled fp8" files
with per-tensor scales) are converted to the compute dtype when loaded.

The family name says which transformer it is: ``sd3`` (SD3 Medium), ``sd3.5-medium`` (MMDiT-X, dual attention),
``sd3.5-large``. The opener returns the fields of a :class:`sdlite.loader.Checkpoint`, which the loader builds.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import SD3_FAMILIES, ConfigError, ModelSpec, TextEncoderConfig, VAEConfig
from ..config.mmdit import MMDiTConfig
from ..config.sd3 import SD3_SCHEDULER, SD3_TEXT_G, SD3_TEXT_L, SD3_VAE
from ..errors import CheckpointError
from . import beside
from .convert import normalize_diffusers_keys
from .detect import Detection
from .folders import component_store, folder_tokenizer, read_json, storage_dtype, text_architecture
from .mmdit_keys import MMDIT_PREFIX, infer_mmdit_config, mmdit_plan
from .plan import COPY, ComponentPlan, PlanEntry, add_entry
from .store import ComponentSource, TensorStore
from .t5_keys import SINGLE_FILE_PREFIX as T5_PREFIX
from .t5_keys import find_t5_prefix, infer_t5_config, t5_plan
from .text_keys import clip_from_original, infer_text_encoder
from .vae_keys import VAE_PREFIX

SD3_PIPELINES = ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline")
_CLIP_TOWERS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))


def sd3_family(transformer: MMDiTConfig) -> str:
    """Which SD3 release a transformer config is: ``sd3.5-medium`` (dual attention), ``sd3.5-large`` (qk norm
    without it), ``sd3`` (SD3 Medium)."""
    if transformer.dual_attention_layers:
        return "sd3.5-medium"
    return "sd3.5-large" if transformer.qk_norm else "sd3"


def _present(folder: Path, index: dict) -> set[str]:
    """The parts a folder has: a folder of that name that model_index.json does not mark absent (``[null, null]``)."""
    names = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3",
             "transformer", "vae", "scheduler")
    return {n for n in names if (folder / n).is_dir() and index.get(n, ["", ""]) != [None, None]}


def open_sd3_folder(folder: Path, index: dict, index_file: Path) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of an SD3 pipeline folder."""
    cls = index.get("_class_name")
    present = _present(folder, index)
    for needed in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "transformer", "vae"):
        if needed not in present:
            raise CheckpointError(f"the {cls} folder has no {needed}", folder)
    with_t5 = "text_encoder_3" in present
    stores: list[TensorStore] = []
    sources: dict[str, ComponentSource] = {}
    try:
        configs = {}
        for component in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"):
            if component == "text_encoder_3" and not with_t5:
                continue
            configs[component] = read_json(folder / component / "config.json")
            store = component_store(folder, component)
            stores.append(store)
            keys = list(store.keys())
            if component == "transformer":
                plan = mmdit_plan(keys)
            elif component == "text_encoder_3":
                plan = t5_plan(keys)
            else:
                plan = normalize_diffusers_keys(keys, "vae" if component == "vae" else "text_encoder")
            sources[component] = ComponentSource.from_plan(plan, store, tuple(store.paths))
        for component, _ in _CLIP_TOWERS:
            if text_architecture(configs[component], folder / component / "config.json") != "clip":
                raise CheckpointError("SD3's first two text encoders are CLIP text towers",
                                      folder / component / "config.json")
        try:
            transformer = MMDiTConfig.from_diffusers(configs["transformer"])
            vae = VAEConfig.from_diffusers(configs["vae"])
            tokenizers, texts = {}, {}
            for component, tok in _CLIP_TOWERS:
                text = TextEncoderConfig.from_diffusers(configs[component])
                tokenizers[component] = folder_tokenizer(folder / tok, text)
                texts[component] = dataclasses.replace(text, pad_token_id=tokenizers[component].pad_token_id)
            t5 = infer_t5_config(sources["text_encoder_3"].shapes) if with_t5 else None
        except (ConfigError, KeyError, TypeError) as e:
            raise CheckpointError(f"unusable component config: {e}", folder) from None
        sched_file = folder / "scheduler" / "scheduler_config.json"
        scheduler = read_json(sched_file) if sched_file.is_file() else dict(SD3_SCHEDULER)
        spec, detection = _spec(texts, transformer, vae, t5, scheduler, "diffusers", folder)
    except BaseException:
        for store in stores:
            store.close()
        raise
    notes = [] if with_t5 else ["saved without T5 (text_encoder_3): its conditioning is zeros"]
    return dict(path=str(folder), layout="diffusers", spec=spec, detection=detection,
                storage_dtype=storage_dtype(stores[[*sources].index("transformer")]),
                prediction_source="flow matching (SD3)", sources=sources, scheduler_config=dict(spec.scheduler),
                scheduler_source="scheduler/scheduler_config.json" if sched_file.is_file()
                else "SD3's published scheduler (the folder has none)",
                tokenizer_dir=str(folder / "tokenizer"), tokenizer_2_dir=str(folder / "tokenizer_2"), notes=notes,
                _stores=stores, _tokenizer=tokenizers["text_encoder"], _tokenizer_2=tokenizers["text_encoder_2"])


def _spec(texts: dict, transformer: MMDiTConfig, vae: VAEConfig, t5, scheduler: dict, layout: str,
          where) -> tuple[ModelSpec, Detection]:
    """The spec and detection of an SD3 model from its parts, once they are checked to fit together."""
    check_sd3_parts(transformer, vae, texts["text_encoder"], texts["text_encoder_2"], t5, where)
    family = sd3_family(transformer)
    # SD3.5 Large Turbo is Large's network distilled for 4 steps without guidance; nothing in its files says so but
    # the name it is published under (stable-diffusion-3.5-large-turbo, sd3.5_large_turbo.safetensors)
    turbo = family == "sd3.5-large" and "turbo" in Path(where).name.lower()
    spec = ModelSpec(family=family, text=texts["text_encoder"], text2=texts["text_encoder_2"], unet=None,
                     transformer=transformer, text3=t5, vae=vae, prediction_type="flow",
                     default_size=transformer.sample_size * vae.downscale, scheduler=dict(scheduler), turbo=turbo)
    return spec, Detection(layout=layout, family=family, components=(*spec.text_encoders, "transformer", "vae"),
                           unet=None)


def check_sd3_parts(transformer: MMDiTConfig, vae: VAEConfig, clip_l, clip_g, t5, where) -> None:
    """The parts of an SD3 model fit together: the CLIP widths make the pooled width and fit in the joint context,
    T5's width is the joint context's, the VAE's latent is the transformer's input."""
    pooled = clip_l.projection_dim + clip_g.projection_dim
    if pooled != transformer.pooled_projection_dim:
        raise CheckpointError(f"the CLIP towers' projections ({clip_l.projection_dim} + {clip_g.projection_dim}) "
                              f"do not "
                              f"make the transformer's pooled width {transformer.pooled_projection_dim}", where)
    if clip_l.width + clip_g.width > transformer.joint_attention_dim:
        raise CheckpointError(f"the CLIP towers' widths ({clip_l.width} + {clip_g.width}) exceed the transformer's "
                              f"joint context width {transformer.joint_attention_dim}", where)
    if t5 is not None and t5.d_model != transformer.joint_attention_dim:
        raise CheckpointError(f"T5's width {t5.d_model} is not the transformer's joint context width "
                              f"{transformer.joint_attention_dim}", where)
    if vae.latent_channels != transformer.in_channels:
        raise CheckpointError(f"the VAE's {vae.latent_channels} latent channels are not the transformer's "
                              f"{transformer.in_channels} input channels", where)


# --- single files and separate text encoders ----------------------------------------------------------------

# where Stability's single files (and ComfyUI's all-in-one checkpoints) keep the text encoders
CLIP_L_PREFIX = "text_encoders.clip_l.transformer."
CLIP_G_PREFIX = "text_encoders.clip_g.transformer."
# widths that tell CLIP ViT-L from OpenCLIP bigG in a file of their own
_CLIP_WIDTHS = {768: "text_encoder", 1280: "text_encoder_2"}
_ENCODER_NAMES = {"text_encoder": "CLIP-L", "text_encoder_2": "CLIP-G (OpenCLIP bigG)", "text_encoder_3": "T5-XXL"}
# the names ComfyUI and Stability give the separate files, tried beside a model that lacks its encoders
_BESIDE = (("text_encoder", ("clip_l*.safetensors",)), ("text_encoder_2", ("clip_g*.safetensors",)),
           ("text_encoder_3", ("t5xxl_fp16*.safetensors", "t5xxl*.safetensors", "t5*.safetensors", "t5*.gguf")))


def is_sd3_file(keys) -> bool:
    """Whether a single file's keys hold an SD3 MMDiT (Stability's names, with or without the prefix)."""
    return any(k.startswith((MMDIT_PREFIX + "joint_blocks.", "joint_blocks.")) for k in keys)


def _clip_part(keys: list[str], shapes: dict, prefix: str, where) -> tuple[ComponentPlan, TextEncoderConfig]:
    """The plan and config of a CLIP tower in transformers' names under ``prefix``, with its projection."""
    plan = clip_from_original(keys, prefix=prefix)
    projection = f"{prefix}text_projection.weight"
    if projection in shapes and "text_projection.weight" not in plan.entries:
        add_entry(plan, "text_projection.weight", PlanEntry((projection,), COPY))
        if projection in plan.unexpected:
            plan.unexpected.remove(projection)
    info = infer_text_encoder(plan.shapes(shapes), "diffusers")
    if info.projection_dim is None:
        raise CheckpointError(f"the CLIP text encoder under {prefix or 'the file root'!r} has no text_projection, "
                              "which makes SD3's pooled embedding", where)
    return plan, TextEncoderConfig(**info.config_kwargs())


def encoder_kind(keys, shapes: dict, where) -> tuple[str, str]:
    """``(component, prefix)`` of a separate text-encoder file: T5 (``text_encoder_3``), or CLIP-L / bigG by width."""
    keys = list(keys)
    t5 = find_t5_prefix(keys)
    if t5 is not None:
        return "text_encoder_3", t5
    for prefix in ("", "text_model.", CLIP_L_PREFIX, CLIP_G_PREFIX):
        embed = f"{prefix}text_model.embeddings.token_embedding.weight" if not prefix.endswith("text_model.") else \
            f"{prefix}embeddings.token_embedding.weight"
        if embed in shapes:
            width = shapes[embed][1]
            base = prefix if not prefix.endswith("text_model.") else prefix[:-len("text_model.")]
            if width in _CLIP_WIDTHS:
                return _CLIP_WIDTHS[width], base
            name = Path(str(where)).name.lower()   # a tower of another width: the name ComfyUI gives it decides
            for component, marks in (("text_encoder", ("clip_l", "clip-l")), ("text_encoder_2", ("clip_g", "clip-g"))):
                if any(m in name for m in marks):
                    return component, base
            raise CheckpointError(f"a CLIP text encoder {width} wide: SD3 takes CLIP-L (768) and bigG (1280); "
                                  "name the file clip_l... or clip_g... to say which this is", where)
    raise CheckpointError("not a text encoder sdlite knows (no T5 'encoder.block.0...' nor CLIP "
                          "'text_model.embeddings...' keys)" + (f"; the first key is {keys[0]!r}" if keys else ""),
                          where)


def find_beside(model: Path, missing: list[str]) -> dict[str, Path]:
    """Separate text-encoder files for the ``missing`` components, by ComfyUI's and Stability's names, beside
    ``model``: its folder, ``text_encoders/`` in it, or ComfyUI's ``models/text_encoders`` and ``models/clip``."""
    return beside.find_beside(model, missing, _BESIDE, vae_folder=False)


def _parts(texts: dict) -> beside.Parts:
    """The text encoders SD3 takes beside its file; CLIP towers' configs go to ``texts``."""
    def source(component, keys, prefix, store, path):
        if component == "text_encoder_3":
            return ComponentSource.from_plan(t5_plan(keys, prefix=prefix), store, (str(path),))
        shapes = {k: tuple(store.shape(k)) for k in keys}
        plan, texts[component] = _clip_part(keys, shapes, prefix, path)
        return ComponentSource.from_plan(plan, store, (str(path),))

    return beside.Parts(names=_ENCODER_NAMES, patterns=_BESIDE, kind=encoder_kind, source=source, vae_folder=False)


def open_sd3_file(path: Path, store: TensorStore, text_encoders=()) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of an SD3 single file (``store``, already open) with the text
    encoders it lacks from ``text_encoders`` (paths) or found beside it."""
    stores = [store]
    sources: dict[str, ComponentSource] = {}
    notes: list[str] = []
    texts: dict = {}
    with beside.opened(stores, path):
        keys = list(store.keys())
        plan = mmdit_plan([k for k in keys if k.startswith((MMDIT_PREFIX, "joint_blocks.", "x_embedder.", "t_embedder.",
                                                            "y_embedder.", "context_embedder.", "pos_embed",
                                                            "final_layer."))])
        sources["transformer"] = ComponentSource.from_plan(plan, store, (str(path),))
        transformer = infer_mmdit_config(sources["transformer"].shapes)
        if not any(k.startswith(VAE_PREFIX) for k in keys):
            raise CheckpointError(f"the file has no VAE ({VAE_PREFIX}*): sdlite reads SD3 single files with their "
                                  "VAE, as Stability publishes them", path)
        sources["vae"], vae = beside.vae_part(keys, VAE_PREFIX, store, path, SD3_VAE)
        vae = dataclasses.replace(vae, sample_size=transformer.sample_size * vae.downscale)
        parts = _parts(texts)
        for component, prefix in (("text_encoder", CLIP_L_PREFIX), ("text_encoder_2", CLIP_G_PREFIX)):
            if any(k.startswith(prefix) for k in keys):
                sources[component] = parts.source(component, keys, prefix, store, path)
        if find_t5_prefix(keys) == T5_PREFIX:
            sources["text_encoder_3"] = parts.source("text_encoder_3", keys, T5_PREFIX, store, path)
        # the parts given; only where none is given, those found beside the model
        beside.add_parts(path, parts, sources, stores, notes, given=text_encoders,
                         needed=("text_encoder", "text_encoder_2", "text_encoder_3"), search_beside=not text_encoders)
        for component in ("text_encoder", "text_encoder_2"):
            if component not in sources:
                raise CheckpointError(
                    f"the model has no {_ENCODER_NAMES[component]} text encoder: the file holds none and none was "
                    "given (--text-encoder PATH, repeatable: clip_l.safetensors, clip_g.safetensors, and "
                    "optionally t5xxl_fp16.safetensors) or found beside it", path)
            if component in texts:   # as the released towers' configs say: CLIP-L pads with its end token, bigG "!"
                known = SD3_TEXT_L if component == "text_encoder" else SD3_TEXT_G
                texts[component] = dataclasses.replace(texts[component], pad_token_id=known.pad_token_id,
                                                       eos_token_id=known.eos_token_id)
        t5 = infer_t5_config(sources["text_encoder_3"].shapes) if "text_encoder_3" in sources else None
        if t5 is None:
            notes.append("no T5 (text_encoder_3) in the file, given or beside it: its conditioning is zeros")
        spec, detection = _spec(texts, transformer, vae, t5, SD3_SCHEDULER, "original", path)
        for name, source in sources.items():
            if source.unexpected:
                notes.append(f"{len(source.unexpected)} {name} keys not understood (ignored)")
    return dict(path=str(path), layout="original", spec=spec, detection=detection,
                storage_dtype=storage_dtype(store, prefix=MMDIT_PREFIX), prediction_source="flow matching (SD3)",
                sources=sources, scheduler_config=dict(spec.scheduler),
                scheduler_source="SD3's published scheduler (FlowMatchEulerDiscreteScheduler, shift 3.0)",
                notes=notes, _stores=stores)


__all__ = ["SD3_PIPELINES", "SD3_SCHEDULER", "SD3_FAMILIES", "sd3_family", "open_sd3_folder", "open_sd3_file",
           "is_sd3_file", "encoder_kind", "find_beside", "check_sd3_parts"]
