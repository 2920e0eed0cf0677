"""Opening Qwen-Image checkpoints: what :func:`sdlite.loader.open_model` does for this family.

**diffusers folders** (``model_index.json``: ``QwenImagePipeline``), as the Qwen team publishes Qwen/Qwen-Image:

* ``text_encoder``: a ``Qwen2_5_VLForConditionalGeneration``. Only its language model is read (the decoder under
  ``model.`` in the published files, under ``model.language_model.`` as transformers 4.52+ saves it:
  :mod:`sdlite.weights.qwen_keys`); the vision tower (``visual.`` / ``model.visual.``) and the LM head are left in the
  file, since text to image never runs them. Its config's language-model fields (nested ``text_config`` or not) make
  the :class:`~sdlite.config.qwen.QwenConfig`;
* ``tokenizer``: Qwen2's tokenizer; the folder's ``tokenizer.json`` where it has one, else the package's
  (:mod:`sdlite.tokenizers.qwen`: Qwen2, 2.5 and 3 share the vocabulary and the special tokens). A folder with only
  ``vocab.json`` and ``merges.txt`` (as Qwen/Qwen-Image ships) reads with the package's, the same vocabulary;
* ``transformer``: ``QwenImageTransformer2DModel`` in diffusers' names, sharded or not (:mod:`.qwenimage_keys`);
* ``vae``: ``AutoencoderKLQwenImage`` in diffusers' names (the model's own), its config with the latents' per-channel
  ``latents_mean`` and ``latents_std``, which the family normalises the sampler's latents with;
* ``scheduler``: FlowMatchEulerDiscreteScheduler's config (Qwen-Image's published one where the folder has none).

**ComfyUI's split files**: the transformer ``qwen_image_bf16.safetensors`` / ``qwen_image_fp8_e4m3fn.safetensors``
(diffusers' names, bare or under ``model.diffusion_model.``; fp8 as stored, ComfyUI's scaled fp8 too: a per-tensor
``scale_weight`` / ``weight_scale`` beside a weight is applied as it is read, input scales and ``comfy_quant`` records
ignored) and the city96 / QuantStack GGUF files (``qwen-image-Q8_0.gguf``: the same names, block formats kept). The
parts the transformer's file lacks come from files given (``text_encoders=``: the CLI's ``--text-encoder``,
repeatable, which also takes the VAE) or found beside the model (its folder, ``text_encoders/``, ``vae/``, ComfyUI's
``models/text_encoders``, ``models/clip`` and ``models/vae``):

* the text encoder ``qwen_2.5_vl_7b.safetensors`` / ``qwen_2.5_vl_7b_fp8_scaled.safetensors`` (the language model in
  transformers' names under ``model.``; the vision tower under ``visual.`` is not read) or a llama.cpp GGUF of
  Qwen2.5-VL-7B (``Qwen2.5-VL-7B-Instruct-Q4_K_M.gguf``, architecture ``qwen2vl``; its ``mmproj`` file, the vision
  tower, is not needed);
* the VAE ``qwen_image_vae.safetensors`` in Wan 2.1's names, or in diffusers' (:mod:`.qwenimage_vae_keys`).

What a separate file holds is read from its keys and shapes; the text encoder must be a Qwen2 / 2.5 as wide as the
transformer's text input (3584), the VAE have 16 latent channels (Wan 2.2's 48-channel VAE and LDM-named autoencoders
such as FLUX.1's ``ae.safetensors`` are refused by name). The Qwen-Image-Edit releases' files (``qwen_image_edit*``)
are refused by name, as their folders are. The tokenizer is the package's (:mod:`sdlite.tokenizers.qwen`).
"""
from __future__ import annotations

import re
from collections import ChainMap
from dataclasses import replace
from pathlib import Path

from ..config import ConfigError
from ..config.qwen import QwenConfig
from ..config.qwen_vision import QwenVisionConfig
from ..config.qwenimage import (QWEN_IMAGE_EDIT_FAMILY, QWEN_IMAGE_EDIT_PLUS_FAMILY, QWEN_IMAGE_FAMILY, QwenImageConfig,
                                qwenimage_spec)
from ..config.qwenimage_vae import QwenImageVAEConfig
from ..errors import CheckpointError
from ..tokenizers.qwen import QwenTokenizer
from ..tokenizers.qwen_images import processor_settings
from .beside import Parts, TransformerFile, add_parts, open_transformer_file, opened, vae_prefix
from .detect import Detection
from .encoders import scaled_plan
from .folders import component_store, read_json, storage_dtype
from .plan import ConversionError, UnsupportedModelError, same_names
from .qwen_keys import find_qwen_prefix, infer_qwen_config, qwen_config_from_gguf, qwen_plan
from .qwenimage_keys import infer_qwenimage_config, is_qwenimage, qwenimage_layout, qwenimage_plan
from .qwen_vision_keys import GGUF_PREFIX, VisionView, infer_vision_config, vision_config_from_gguf, vision_prefix
from .qwenimage_vae_keys import infer_qwenimage_vae, is_qwenimage_vae, qwenimage_vae_plan, wan_names
from .store import ComponentSource, TensorStore

__all__ = ["QWENIMAGE_PIPELINES", "open_qwenimage_folder", "is_qwenimage_file", "open_qwenimage_file"]

QWENIMAGE_PIPELINES = ("QwenImagePipeline",)
#: the editing releases' folders and their families: Qwen-Image-Edit, Edit-2509 / 2511
EDIT_FAMILIES = {"QwenImageEditPipeline": QWEN_IMAGE_EDIT_FAMILY, "QwenImageEditInpaintPipeline": QWEN_IMAGE_EDIT_FAMILY,
                 "QwenImageEditPlusPipeline": QWEN_IMAGE_EDIT_PLUS_FAMILY}
QWENIMAGE_EDIT_PIPELINES = tuple(EDIT_FAMILIES)
PREDICTION_SOURCE = "flow matching (Qwen-Image)"


def _check_parts(transformer: QwenImageConfig, vae: QwenImageVAEConfig, text: QwenConfig, text_at, vae_at) -> None:
    """The parts fit the transformer; the message names the file or folder at fault (``text_at``, ``vae_at``)."""
    if text.kind != "qwen2":
        raise CheckpointError(f"the text encoder is a {text.kind} (q/k norms, no q/k/v biases): Qwen-Image reads "
                              "Qwen2.5-VL-7B's language model (qwen_2.5_vl_7b.safetensors)", text_at)
    if text.hidden_size != transformer.joint_attention_dim:
        raise CheckpointError(f"the text encoder's width {text.hidden_size} is not the text width "
                              f"{transformer.joint_attention_dim} of the transformer: Qwen-Image reads Qwen2.5-VL-7B's "
                              "language model (3584 wide)", text_at)
    if vae.z_dim != transformer.latent_channels:
        raise CheckpointError(f"the VAE's {vae.z_dim} latent channels are not the {transformer.latent_channels} of "
                              "the transformer: Qwen-Image decodes with its own 16-channel VAE "
                              "(AutoencoderKLQwenImage)", vae_at)


def _plan(component: str, keys: list[str], folder: Path):
    if component == "transformer":
        return qwenimage_plan(keys)
    if component == "text_encoder":
        prefix = find_qwen_prefix(keys)
        if prefix is None:
            raise CheckpointError("no Qwen2.5-VL language model weights (no 'layers.0.self_attn.q_proj.weight', bare "
                                  "or under a prefix such as 'model.' or 'model.language_model.')",
                                  folder / "text_encoder")
        return qwen_plan(keys, prefix=prefix)
    return same_names("vae", keys)


def with_vision(text: ComponentSource, view: VisionView) -> ComponentSource:
    """The text encoder's source with its vision tower's tensors beside the language model's (``visual.*``)."""
    return ComponentSource(view=ChainMap(text.view, view),
                           shapes={**text.shapes, **view.shapes}, files=tuple(dict.fromkeys(text.files)),
                           unexpected=list(text.unexpected), ignored=list(text.ignored),
                           origin={**text.origin, **view.origin})


def vision_config(text: QwenConfig, vision: QwenVisionConfig, processor: dict | None, where) -> QwenConfig:
    """The language model's config with the vision tower's (and the image processor's pixel limits, from a
    ``preprocessor_config.json`` where there is one): Qwen2.5-VL's multimodal RoPE sections where the config had
    none."""
    if processor is not None:
        try:
            settings = processor_settings(processor)
        except ValueError as e:
            raise CheckpointError(f"unusable image processor config: {e}", where) from None
        if (settings["patch_size"], settings["merge_size"], settings["temporal_patch_size"]) != \
                (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise CheckpointError(f"the image processor's patches ({settings['patch_size']} pixels, merged "
                                  f"{settings['merge_size']} x {settings['merge_size']}) are not the vision tower's "
                                  f"({vision.patch_size}, {vision.spatial_merge_size})", where)
        vision = replace(vision, min_pixels=settings["min_pixels"], max_pixels=settings["max_pixels"])
    if vision.out_hidden_size != text.hidden_size:
        raise CheckpointError(f"the vision tower's output width {vision.out_hidden_size} is not the language model's "
                              f"{text.hidden_size}", where)
    return replace(text, vision=vision, mrope_section=text.mrope_section or mrope_sections(text.head_dim))


def mrope_sections(head_dim: int) -> tuple[int, int, int]:
    """Qwen2.5-VL's multimodal RoPE sections for a head of ``head_dim`` where a file does not state them: a quarter of
    the rotary pairs for the temporal position and three eighths each for the row and the column ((16, 24, 24) for
    its heads of 128, as every Qwen2.5-VL config states)."""
    pairs = head_dim // 2
    t = pairs // 4
    return t, (pairs - t) // 2, pairs - t - (pairs - t) // 2


def open_qwenimage_folder(folder: Path, index: dict, index_file: Path) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of a ``QwenImagePipeline`` folder, or of a Qwen-Image-Edit
    release's (``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``: the text encoder's vision tower read too,
    and the processor's pixel limits)."""
    cls = index.get("_class_name")
    family = EDIT_FAMILIES.get(cls, QWEN_IMAGE_FAMILY)
    for needed in ("text_encoder", "transformer", "vae"):
        if not (folder / needed).is_dir() or index.get(needed, ["", ""]) == [None, None]:
            raise CheckpointError(f"the {cls} folder has no {needed}", folder)
    stores: list[TensorStore] = []
    sources: dict[str, ComponentSource] = {}
    with opened(stores, folder):
        configs, keys = {}, {}
        for component in ("text_encoder", "transformer", "vae"):
            configs[component] = read_json(folder / component / "config.json")
            store = component_store(folder, component)
            stores.append(store)
            keys[component] = list(store.keys())
            plan = _plan(component, keys[component], folder)
            sources[component] = ComponentSource.from_plan(plan, store, tuple(store.paths))
        parsers = {"text_encoder": QwenConfig.from_transformers, "transformer": QwenImageConfig.from_diffusers,
                   "vae": QwenImageVAEConfig.from_diffusers}
        parsed = {}
        for component, parse in parsers.items():
            try:
                parsed[component] = parse(configs[component])
            except (ConfigError, KeyError, TypeError) as e:
                raise CheckpointError(f"unusable {component} config: {e}", folder / component / "config.json") \
                    from None
        text, transformer, vae = parsed["text_encoder"], parsed["transformer"], parsed["vae"]
        _check_parts(transformer, vae, text, folder / "text_encoder", folder / "vae")
        if family != QWEN_IMAGE_FAMILY:   # the editing releases read their source images with the vision tower
            try:
                tower = QwenVisionConfig.from_hf(configs["text_encoder"])
                view = VisionView(stores[0], str(folder / "text_encoder"), add="visual.")
            except (ConfigError, ConversionError) as e:
                raise CheckpointError(f"the text encoder's vision tower: {e}", folder / "text_encoder") from None
            processor_file = folder / "processor" / "preprocessor_config.json"
            text = vision_config(text, tower, read_json(processor_file) if processor_file.is_file() else None,
                                 processor_file)
            sources["text_encoder"] = with_vision(sources["text_encoder"], view)
        tokenizer_dir = folder / "tokenizer"
        own = (tokenizer_dir / "tokenizer.json").is_file()
        try:
            tokenizer = QwenTokenizer.from_pretrained_dir(tokenizer_dir) if own else QwenTokenizer.from_package()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"unusable tokenizer: {e}", tokenizer_dir) from None
        sched_file = folder / "scheduler" / "scheduler_config.json"
        scheduler = read_json(sched_file) if sched_file.is_file() else None
        spec = qwenimage_spec(transformer, text=text, vae=vae, scheduler=scheduler, family=family)
        detection = Detection(layout="diffusers", family=spec.family,
                              components=("text_encoder", "transformer", "vae"), unet=None)
        notes = []
        if not own:
            notes.append("tokenizer: the package's Qwen tokenizer (the folder has no tokenizer.json; the same "
                         "vocabulary)")
        vision = [k for k in keys["text_encoder"] if k.startswith(("visual.", "model.visual."))]
        if vision and family == QWEN_IMAGE_FAMILY:
            notes.append(f"text encoder: the vision tower's {len(vision)} tensors are not read (text to image)")
    return dict(path=str(folder), layout="diffusers", spec=spec, detection=detection,
                storage_dtype=storage_dtype(stores[1]), prediction_source=PREDICTION_SOURCE,
                sources=sources, scheduler_config=dict(spec.scheduler),
                scheduler_source="scheduler/scheduler_config.json" if sched_file.is_file()
                else "Qwen-Image's published scheduler (the folder has none)",
                tokenizer_dir=str(tokenizer_dir) if own else None, notes=notes, _stores=stores,
                _tokenizer=tokenizer)


# --- single files and the files beside them --------------------------------------------------------------------

_VAE_PREFIXES = ("vae.", "first_stage_model.")
_NAMES = {"text_encoder": "Qwen2.5-VL text encoder (qwen_2.5_vl_7b.safetensors)",
          "vae": "VAE (qwen_image_vae.safetensors)",
          "vision": "Qwen2.5-VL vision tower (mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf)"}
# the names the separate files go by, tried beside a model that lacks them
_BESIDE = (("text_encoder", ("qwen_2.5_vl_7b*.safetensors", "qwen_2.5_vl*.safetensors", "qwen2.5*vl*.safetensors",
                             "Qwen2.5-VL-7B*.gguf", "qwen2.5-vl-7b*.gguf", "Qwen2.5-VL*.gguf", "qwen2.5-vl*.gguf")),
           ("vae", ("qwen_image_vae*.safetensors", "qwen_image*vae*.safetensors", "qwen-image*vae*.safetensors")),
           ("vision", ("mmproj*Qwen2.5-VL*.gguf", "*Qwen2.5-VL*mmproj*.gguf", "mmproj*qwen2.5*vl*.gguf",
                       "*qwen2.5*vl*mmproj*.gguf", "mmproj*.gguf")))
_EDIT_FILE = re.compile(r"qwen[-_ ]?image[-_ ]?edit", re.IGNORECASE)
_PLUS_FILE = re.compile(r"2509|2511|plus", re.IGNORECASE)
_IGNORED = (".comfy_quant",)   # besides the scaled fp8 marker and input scales (scaled_plan's)


def is_qwenimage_file(keys) -> bool:
    """Whether a single file's keys hold a Qwen-Image transformer (bare or under ComfyUI's prefix)."""
    return is_qwenimage(list(keys))


def _transformer_plan(keys: list[str], prefix: str, expected=None):
    """The transformer's keys under ``prefix`` as they are, a scaled fp8 weight times its per-tensor scale."""
    return scaled_plan("transformer", keys, prefix=prefix, canonical=re.compile(r".+"), rename=lambda name: name,
                       ignore=lambda name, names: name.endswith(_IGNORED), expected=expected)


def _check_complete(transformer: QwenImageConfig, keys: list[str], prefix: str, store, path) -> ComponentSource:
    """The transformer's source, every tensor its shapes describe there (the missing ones named as the file names
    them)."""
    import torch

    from ..models.qwenimage import QwenImage

    with torch.device("meta"):
        expected = list(QwenImage(transformer).state_dict().keys())
    plan = _transformer_plan(keys, prefix, expected)
    if plan.missing:
        names = [prefix + k for k in plan.missing]
        raise CheckpointError(f"{len(names)} Qwen-Image transformer tensors are missing from the file, first few: "
                              + ", ".join(repr(n) for n in names[:5]), path, names[0])
    return ComponentSource.from_plan(plan, store, (str(path),))


def _file_kind(keys: list[str], shapes: dict, where) -> tuple[str, str]:
    """``(component, prefix)`` of a separate file: the Qwen2.5-VL text encoder or the VAE. An LDM-named autoencoder
    (FLUX.1's, SD's) is refused naming its latent channels."""
    prefix = find_qwen_prefix(keys)
    if prefix is not None:
        return "text_encoder", prefix
    if vision_prefix(keys) == GGUF_PREFIX:   # llama.cpp's mmproj GGUF: Qwen2.5-VL's vision tower alone
        return "vision", GGUF_PREFIX
    if is_qwenimage_vae(keys):
        return "vae", ""
    prefix = vae_prefix(shapes, ("", *_VAE_PREFIXES))
    if prefix is not None:
        channels = shapes[f"{prefix}decoder.conv_in.weight"][1]
        raise CheckpointError(f"a VAE in LDM names ('decoder.conv_in', 'decoder.up.N') with {channels} latent "
                              "channels: FLUX.1's ae.safetensors or SD's autoencoder, not Qwen-Image's. Qwen-Image "
                              "decodes with its own 16-channel VAE (qwen_image_vae.safetensors)", where)
    raise CheckpointError("not a file Qwen-Image takes beside its transformer (no Qwen2.5-VL 'model.layers.0...' / "
                          "GGUF 'blk.0...' or Qwen-Image VAE 'decoder.head.0.gamma' / 'decoder.norm_out.gamma' keys)"
                          + (f"; the first key is {keys[0]!r}" if keys else ""), where)


def _vae_part(keys: list[str], store: TensorStore, path) -> tuple[ComponentSource, QwenImageVAEConfig]:
    """A Qwen-Image VAE file in either layout: its source and config (from the shapes; a missing tensor named as the
    file names it)."""
    import torch

    from ..models.qwenimage_vae import QwenImageVAE

    plan = qwenimage_vae_plan(keys)
    source = ComponentSource.from_plan(plan, store, (str(path),))
    vae = infer_qwenimage_vae(source.shapes)
    with torch.device("meta"):
        expected = list(QwenImageVAE(vae).state_dict().keys())
    missing = [k for k in expected if k not in source.shapes]
    if missing:
        wan = any(k.startswith("decoder.upsamples.") for k in keys)
        names = wan_names(missing, {**source.shapes, **dict.fromkeys(missing)}) if wan else missing
        raise CheckpointError(f"{len(names)} Qwen-Image VAE tensors are missing from the file, first few: "
                              + ", ".join(repr(n) for n in names[:5]), path, names[0])
    return source, vae


def _tower_part(keys: list[str], store: TensorStore, path, prefix: str, configs: dict) -> VisionView:
    """The vision tower in a text encoder's file (``visual.``: ComfyUI's qwen_2.5_vl_7b) or in llama.cpp's mmproj
    GGUF (``v.``), as the text encoder's ``visual.*``; its config goes to ``configs["vision"]``."""
    try:
        view = VisionView(store, str(path), prefix=prefix, add="visual.")
        shapes = {k[len("visual."):]: v for k, v in view.shapes.items()}
        configs["vision"] = vision_config_from_gguf(store) if prefix == GGUF_PREFIX else infer_vision_config(shapes)
    except (ConversionError, UnsupportedModelError, ConfigError) as e:
        message = getattr(e, "message", str(e))
        raise CheckpointError(f"the Qwen2.5-VL vision tower: {message}", getattr(e, "path", None) or path,
                              getattr(e, "key", None)) from None
    return view


def _parts(configs: dict, notes: list, edit: bool) -> Parts:
    """The parts Qwen-Image takes beside its transformer; their configs go to ``configs``. An editing release reads
    the text encoder's vision tower too (in its file, or llama.cpp's mmproj GGUF beside a GGUF encoder)."""
    def source(component, keys, prefix, store, path):
        try:
            if component == "vae":
                found, configs["vae"] = _vae_part(keys, store, path)
                return found
            if component == "vision":
                view = _tower_part(keys, store, path, prefix, configs)
                return ComponentSource(view=view, shapes=view.shapes, files=(str(path),), origin=view.origin)
            found = ComponentSource.from_plan(qwen_plan(keys, prefix=prefix), store, (str(path),))
            configs["text_encoder"] = qwen_config_from_gguf(store) if getattr(store, "fields", None) is not None \
                else infer_qwen_config(found.shapes)
        except UnsupportedModelError as e:   # named with the part's file, not the transformer's
            raise CheckpointError(e.message, e.path or path, e.key) from None
        vision = [k for k in keys if k.startswith(("visual.", "model.visual."))]
        if vision and edit:
            prefix = "model.visual." if vision[0].startswith("model.") else "visual."
            return with_vision(found, _tower_part(keys, store, path, prefix, configs))
        if vision:
            notes.append(f"text encoder: the vision tower's {len(vision)} tensors are not read (text to image)")
        return found

    return Parts(names=_NAMES, patterns=_BESIDE, kind=_file_kind, source=source, optional=("vision",))


def _edit_release(name: str) -> tuple[str, bool]:
    """(family, zero_cond_t) of a transformer file by its name: Qwen-Image, Qwen-Image-Edit, or Edit-2509 / 2511 (the
    Plus pipeline's; 2511's transformer modulates the source images as at timestep 0, which its file cannot show)."""
    if not _EDIT_FILE.search(name):
        return QWEN_IMAGE_FAMILY, False
    if _PLUS_FILE.search(name):
        return QWEN_IMAGE_EDIT_PLUS_FAMILY, "2511" in name
    return QWEN_IMAGE_EDIT_FAMILY, False


def _transformer(keys: list[str], layout: str, prefix: str, store, path):
    transformer = infer_qwenimage_config(_transformer_plan(keys, prefix).shapes(
        {k: tuple(store.shape(k)) for k in keys if k.startswith(prefix)}))
    transformer = replace(transformer, zero_cond_t=_edit_release(Path(path).name)[1])
    return _check_complete(transformer, keys, prefix, store, path), transformer


def _last_look(path: Path, parts: Parts, sources: dict, stores: list, notes: list) -> dict:
    """An editing release's vision tower: from the text encoder's file, else from a llama.cpp mmproj GGUF given or
    found beside, joined to the text encoder; none is an error naming what to give."""
    family = _edit_release(path.name)[0]
    tower = sources.pop("vision", None)
    text = sources.get("text_encoder")
    if family == QWEN_IMAGE_FAMILY or text is None or any(k.startswith("visual.") for k in text.shapes):
        return {}
    if tower is None:
        add_parts(path, parts, sources, stores, notes, needed=("vision",))
        tower = sources.pop("vision", None)
    if tower is None:
        raise CheckpointError("Qwen-Image-Edit reads its source images with Qwen2.5-VL's vision tower, and the text "
                              f"encoder ({Path(text.files[0]).name}) has none: llama.cpp keeps it in a separate mmproj "
                              "GGUF (mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf): give it with --text-encoder or put it "
                              "beside the encoder", text.files[0])
    sources["text_encoder"] = with_vision(text, tower.view)
    return {}


def _file_spec(path: Path, transformer: QwenImageConfig, configs: dict, files: dict, notes: list):
    at = {c: files.get(c, path) for c in ("text_encoder", "vae")}
    text, vae = configs["text_encoder"], configs["vae"]
    _check_parts(transformer, vae, text, at["text_encoder"], at["vae"])
    family = _edit_release(path.name)[0]
    if family != QWEN_IMAGE_FAMILY:
        text = vision_config(text, configs["vision"], None, at["text_encoder"])
    spec = qwenimage_spec(transformer, text=text, vae=vae, scheduler=None, family=family)
    return spec, Detection(layout="original", family=spec.family, components=("text_encoder", "transformer", "vae"),
                           unet=None)


def open_qwenimage_file(path: Path, store: TensorStore, text_encoders=()) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of a Qwen-Image or Qwen-Image-Edit transformer file (``store``,
    already open; an editing release by its file name) with the parts it lacks from ``text_encoders`` (paths: the
    Qwen2.5-VL encoder, its mmproj vision tower, the VAE) or found beside it."""
    edit = _edit_release(path.name)[0] != QWEN_IMAGE_FAMILY
    release = TransformerFile(
        model="Qwen-Image-Edit" if edit else "Qwen-Image", layout=qwenimage_layout, transformer=_transformer,
        parts=lambda transformer, configs, notes: _parts(configs, notes, edit), vae_prefixes=("vae.",),
        vae_keys=lambda keys, p: vk if (vk := [k for k in keys if k.startswith(p)]) and is_qwenimage_vae(vk) else None,
        given=lambda transformer: "qwen_2.5_vl_7b.safetensors or a Qwen2.5-VL-7B GGUF, qwen_image_vae.safetensors",
        spec=_file_spec, last_look=_last_look, prediction_source=PREDICTION_SOURCE,
        scheduler_source="Qwen-Image's published scheduler (FlowMatchEulerDiscreteScheduler, dynamic shifting)",
        tokenizer=QwenTokenizer.from_package)
    return open_transformer_file(path, store, release, text_encoders)
