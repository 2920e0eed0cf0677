"""Opening Z-Image checkpoints (Z-Image-Turbo): what :func:`sdlite.loader.open_model` does for this family.

**diffusers folders** (``model_index.json``: ``ZImagePipeline`` and its img2img and inpaint siblings): ``text_encoder``
(Qwen3-4B, a ``Qwen3Model``: :mod:`sdlite.weights.qwen_keys`), ``tokenizer`` (Qwen's ``tokenizer.json``),
``transformer`` (diffusers' names, sharded), ``vae`` (FLUX.1's 16-channel autoencoder) and ``scheduler``.

**ComfyUI's split files**: ``z_image_turbo_bf16.safetensors`` (the transformer in the original code's names, bare or
under ``model.diffusion_model.``: :mod:`sdlite.weights.zimage_keys`; fp8 versions too), the text encoder
``qwen_3_4b.safetensors`` (transformers' names under ``model.``, fp8 with its scales as ComfyUI writes it) or a GGUF
of Qwen3-4B in llama.cpp's names (``Qwen3-4B-Q4_K_M.gguf``), and the VAE ``ae.safetensors`` (LDM names). The parts
the transformer's file lacks come from files given (``text_encoders=``: the CLI's ``--text-encoder``, repeatable,
which also takes the VAE file) or found beside the model (its folder, ``text_encoders/``, ``vae/``, or ComfyUI's
``models/text_encoders``, ``models/clip`` and ``models/vae``). What a separate file holds is read from its keys and
shapes. A city96-style GGUF transformer (ComfyUI's names) opens as the safetensors file does. The tokenizer is the
package's (:mod:`sdlite.tokenizers.qwen`): one vocabulary for every Qwen3.
"""
from __future__ import annotations

from pathlib import Path

from ..config import ConfigError, VAEConfig
from ..config.qwen import QwenConfig
from ..config.zimage import ZIMAGE_VAE, ZImageConfig, zimage_spec
from ..errors import CheckpointError
from ..tokenizers.qwen import QwenTokenizer
from .beside import Parts, TransformerFile, open_transformer_file, opened, vae_part, vae_prefix
from .convert import normalize_diffusers_keys
from .detect import Detection
from .folders import component_store, read_json, storage_dtype
from .qwen_keys import find_qwen_prefix, infer_qwen_config, qwen_config_from_gguf, qwen_plan
from .store import ComponentSource, TensorStore
from .zimage_keys import ZIMAGE_PREFIX, comfy_names, infer_zimage_config, zimage_layout, zimage_plan

__all__ = ["ZIMAGE_PIPELINES", "open_zimage_folder", "open_zimage_file", "is_zimage_file"]

ZIMAGE_PIPELINES = ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline")
_VAE_PREFIXES = ("vae.", "first_stage_model.")
_NAMES = {"text_encoder": "Qwen3 text encoder (qwen_3_4b.safetensors)", "vae": "VAE (ae.safetensors)"}
# the names the separate files go by, tried beside a model that lacks them
_BESIDE = (("text_encoder", ("qwen_3_4b*.safetensors", "qwen3*4b*.safetensors", "qwen*.safetensors",
                             "Qwen3-4B*.gguf", "qwen3*4b*.gguf", "qwen*.gguf")),
           ("vae", ("ae.safetensors", "ae*.safetensors", "flux*vae*.safetensors", "z_image*vae*.safetensors")))
PREDICTION_SOURCE = "flow matching (Z-Image)"


def is_zimage_file(keys) -> bool:
    """Whether a single file's keys hold a Z-Image transformer (either layout, with or without ComfyUI's prefix), or
    one of its kin that share its caption embedder (Lumina-Image 2.0's NextDiT, Z-Image Omni): those open here too, to
    be refused by name (:func:`~sdlite.weights.zimage_keys.zimage_layout`) rather than as no Stable Diffusion model."""
    keys = set(keys)
    return any(prefix + "cap_embedder.0.weight" in keys for prefix in ("", ZIMAGE_PREFIX))


def _check_parts(transformer: ZImageConfig, vae: VAEConfig, text: QwenConfig, where, files=None) -> None:
    """The parts fit the transformer; ``files`` (component -> the separate file it came from, if any) says which file
    is at fault."""
    files = files or {}
    model = Path(where).name
    if text.hidden_size != transformer.cap_feat_dim:
        raise CheckpointError(f"the text encoder's width {text.hidden_size} is not the caption width "
                              f"{transformer.cap_feat_dim} of the transformer ({model}): Z-Image-Turbo reads "
                              "Qwen3-4B (2560 wide, qwen_3_4b.safetensors)", files.get("text_encoder", where))
    if vae.latent_channels != transformer.in_channels:
        raise CheckpointError(f"the VAE's {vae.latent_channels} latent channels are not the {transformer.in_channels} "
                              f"of the transformer ({model}): Z-Image decodes with FLUX.1's 16-channel VAE "
                              "(ae.safetensors)", files.get("vae", where))


def _spec_and_detection(transformer, vae, text, scheduler, layout, where, files=None):
    _check_parts(transformer, vae, text, where, files)
    spec = zimage_spec(transformer, text=text, vae=vae, scheduler=scheduler)
    return spec, Detection(layout=layout, family=spec.family, components=("text_encoder", "transformer", "vae"),
                           unet=None)


# --- folders ---------------------------------------------------------------------------------------------------


def open_zimage_folder(folder: Path, index: dict, index_file: Path) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of a Z-Image pipeline folder."""
    cls = index.get("_class_name")
    for needed in ("text_encoder", "transformer", "vae"):
        if not (folder / needed).is_dir() or index.get(needed, ["", ""]) == [None, None]:
            raise CheckpointError(f"the {cls} folder has no {needed}", folder)
    stores: list[TensorStore] = []
    sources: dict[str, ComponentSource] = {}
    with opened(stores, folder):
        configs = {}
        for component in ("text_encoder", "transformer", "vae"):
            configs[component] = read_json(folder / component / "config.json")
            store = component_store(folder, component)
            stores.append(store)
            keys = list(store.keys())
            if component == "transformer":
                plan = zimage_plan(keys)
            elif component == "text_encoder":
                prefix = find_qwen_prefix(keys)
                if prefix is None:
                    raise CheckpointError("no Qwen decoder weights (no 'layers.0.self_attn.q_proj.weight', bare or "
                                          "under a prefix)", folder / "text_encoder")
                plan = qwen_plan(keys, prefix=prefix)
            else:
                plan = normalize_diffusers_keys(keys, "vae")
            sources[component] = ComponentSource.from_plan(plan, store, tuple(store.paths))
        try:
            transformer = ZImageConfig.from_diffusers(configs["transformer"])
            vae = VAEConfig.from_diffusers(configs["vae"])
            text = QwenConfig.from_transformers(configs["text_encoder"])
        except (ConfigError, KeyError, TypeError) as e:
            raise CheckpointError(f"unusable component config: {e}", folder) from None
        tokenizer_dir = folder / "tokenizer"
        try:
            tokenizer = QwenTokenizer.from_pretrained_dir(tokenizer_dir) if tokenizer_dir.is_dir() else \
                QwenTokenizer.from_package()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"unusable tokenizer: {e}", tokenizer_dir) from None
        sched_file = folder / "scheduler" / "scheduler_config.json"
        scheduler = read_json(sched_file) if sched_file.is_file() else None
        spec, detection = _spec_and_detection(transformer, vae, text, scheduler, "diffusers", folder)
    return dict(path=str(folder), layout="diffusers", spec=spec, detection=detection,
                storage_dtype=storage_dtype(stores[1]), prediction_source=PREDICTION_SOURCE,
                sources=sources, scheduler_config=dict(spec.scheduler),
                scheduler_source="scheduler/scheduler_config.json" if sched_file.is_file()
                else "Z-Image-Turbo's published scheduler (the folder has none)",
                tokenizer_dir=str(tokenizer_dir) if tokenizer_dir.is_dir() else None, notes=[], _stores=stores,
                _tokenizer=tokenizer)


# --- single files and the files beside them --------------------------------------------------------------------


def _file_kind(keys: list[str], shapes: dict, where) -> tuple[str, str]:
    """``(component, prefix)`` of a separate file: the Qwen3 text encoder or the VAE."""
    prefix = find_qwen_prefix(keys)
    if prefix is not None:
        return "text_encoder", prefix
    prefix = vae_prefix(shapes, ("", *_VAE_PREFIXES))
    if prefix is not None:
        return "vae", prefix
    raise CheckpointError("not a file Z-Image takes beside its transformer (no Qwen3 'model.layers.0...' / GGUF "
                          "'blk.0...' or VAE 'encoder.conv_in'/'decoder.conv_in' keys)"
                          + (f"; the first key is {keys[0]!r}" if keys else ""), where)


def _parts(configs: dict) -> Parts:
    """The parts Z-Image takes beside its transformer; their configs go to ``configs``."""
    def source(component, keys, prefix, store, path):
        if component == "vae":
            found, configs["vae"] = vae_part(keys, prefix, store, path, ZIMAGE_VAE)
            return found
        found = ComponentSource.from_plan(qwen_plan(keys, prefix=prefix), store, (str(path),))
        configs["text_encoder"] = qwen_config_from_gguf(store) if getattr(store, "fields", None) is not None \
            else infer_qwen_config(found.shapes)
        return found

    return Parts(names=_NAMES, patterns=_BESIDE, kind=_file_kind, source=source)


def _check_complete(transformer: ZImageConfig, source: ComponentSource, prefix: str, layout: str, path) -> None:
    """Every tensor of the transformer its shapes describe is in the file: the missing ones are named as the file
    names them (a fused tensor by its own name)."""
    import torch

    from ..models.zimage import ZImage

    with torch.device("meta"):
        expected = ZImage(transformer).state_dict().keys()
    missing = [k for k in expected if k not in source.shapes]
    if missing:
        names = comfy_names(missing, prefix) if layout == "comfy" else [prefix + k for k in missing]
        raise CheckpointError(f"{len(names)} Z-Image transformer tensors are missing from the file, first few: "
                              + ", ".join(repr(n) for n in names[:5]), path, names[0])


def _transformer(keys: list[str], layout: str, prefix: str, store: TensorStore, path: Path):
    """The transformer's source and config, every tensor of it there."""
    source = ComponentSource.from_plan(zimage_plan(keys), store, (str(path),))
    transformer = infer_zimage_config(source.shapes)
    _check_complete(transformer, source, prefix, layout, path)
    return source, transformer


def _file_spec(path: Path, transformer: ZImageConfig, configs: dict, files: dict, notes: list):
    return _spec_and_detection(transformer, configs["vae"], configs["text_encoder"], None, "original", path, files)


_FILE = TransformerFile(
    model="Z-Image", layout=zimage_layout, transformer=_transformer,
    parts=lambda transformer, configs, notes: _parts(configs), vae_prefixes=_VAE_PREFIXES,
    vae_keys=lambda keys, prefix: keys if any(k.startswith(prefix + "decoder.") for k in keys) else None,
    given=lambda transformer: "qwen_3_4b.safetensors or a Qwen3-4B GGUF, ae.safetensors",
    spec=_file_spec, prediction_source=PREDICTION_SOURCE,
    scheduler_source="Z-Image-Turbo's published scheduler (FlowMatchEulerDiscreteScheduler, shift 3)",
    tokenizer=QwenTokenizer.from_package)


def open_zimage_file(path: Path, store: TensorStore, text_encoders=()) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of a Z-Image transformer file (``store``, already open) with the
    parts it lacks from ``text_encoders`` (paths: the Qwen3 encoder and the VAE) or found beside it."""
    return open_transformer_file(path, store, _FILE, text_encoders)
