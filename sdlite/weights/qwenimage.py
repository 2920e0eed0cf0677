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

The Qwen-Image-Edit pipelines' folders (``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``) have the same parts
and are refused by name until their editing is built; ComfyUI's split files and GGUF transformers are not opened yet.
"""
from __future__ import annotations

from pathlib import Path

from ..config import ConfigError
from ..config.qwen import QwenConfig
from ..config.qwenimage import QwenImageConfig, qwenimage_spec
from ..config.qwenimage_vae import QwenImageVAEConfig
from ..errors import CheckpointError
from ..tokenizers.qwen import QwenTokenizer
from .beside import opened
from .detect import Detection
from .folders import component_store, read_json, storage_dtype
from .plan import same_names
from .qwen_keys import find_qwen_prefix, qwen_plan
from .qwenimage_keys import qwenimage_plan
from .store import ComponentSource, TensorStore

__all__ = ["QWENIMAGE_PIPELINES", "open_qwenimage_folder"]

QWENIMAGE_PIPELINES = ("QwenImagePipeline",)
#: the editing pipelines' folders: recognised, refused by name
QWENIMAGE_EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline")
PREDICTION_SOURCE = "flow matching (Qwen-Image)"


def _check_parts(transformer: QwenImageConfig, vae: QwenImageVAEConfig, text: QwenConfig, folder: Path) -> None:
    """The parts fit the transformer; the message names the component's folder at fault."""
    if text.hidden_size != transformer.joint_attention_dim:
        raise CheckpointError(f"the text encoder's width {text.hidden_size} is not the text width "
                              f"{transformer.joint_attention_dim} of the transformer: Qwen-Image reads Qwen2.5-VL-7B's "
                              "language model (3584 wide)", folder / "text_encoder")
    if vae.z_dim != transformer.latent_channels:
        raise CheckpointError(f"the VAE's {vae.z_dim} latent channels are not the {transformer.latent_channels} of "
                              "the transformer: Qwen-Image decodes with its own 16-channel VAE "
                              "(AutoencoderKLQwenImage)", folder / "vae")


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


def open_qwenimage_folder(folder: Path, index: dict, index_file: Path) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of a ``QwenImagePipeline`` folder."""
    cls = index.get("_class_name")
    if cls in QWENIMAGE_EDIT_PIPELINES:
        raise CheckpointError(f"{cls} folders (Qwen-Image-Edit) are not supported yet: sdlite runs Qwen-Image's text "
                              "to image (QwenImagePipeline)", index_file)
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
        _check_parts(transformer, vae, text, folder)
        tokenizer_dir = folder / "tokenizer"
        own = (tokenizer_dir / "tokenizer.json").is_file()
        try:
            tokenizer = QwenTokenizer.from_pretrained_dir(tokenizer_dir) if own else QwenTokenizer.from_package()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"unusable tokenizer: {e}", tokenizer_dir) from None
        sched_file = folder / "scheduler" / "scheduler_config.json"
        scheduler = read_json(sched_file) if sched_file.is_file() else None
        spec = qwenimage_spec(transformer, text=text, vae=vae, scheduler=scheduler)
        detection = Detection(layout="diffusers", family=spec.family,
                              components=("text_encoder", "transformer", "vae"), unet=None)
        notes = []
        if not own:
            notes.append("tokenizer: the package's Qwen tokenizer (the folder has no tokenizer.json; the same "
                         "vocabulary)")
        vision = [k for k in keys["text_encoder"] if k.startswith(("visual.", "model.visual."))]
        if vision:
            notes.append(f"text encoder: the vision tower's {len(vision)} tensors are not read (text to image)")
    return dict(path=str(folder), layout="diffusers", spec=spec, detection=detection,
                storage_dtype=storage_dtype(stores[1]), prediction_source=PREDICTION_SOURCE,
                sources=sources, scheduler_config=dict(spec.scheduler),
                scheduler_source="scheduler/scheduler_config.json" if sched_file.is_file()
                else "Qwen-Image's published scheduler (the folder has none)",
                tokenizer_dir=str(tokenizer_dir) if own else None, notes=notes, _stores=stores,
                _tokenizer=tokenizer)
