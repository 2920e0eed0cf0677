"""Opening FLUX.2 [klein] checkpoints (4B and 9B, step-distilled and base): what :func:`sdlite.loader.open_model` does
for this family.

**diffusers folders** (``model_index.json``: ``Flux2KleinPipeline`` and its inpaint and KV siblings): ``text_encoder``
(a ``Qwen3ForCausalLM``: the decoder under ``model.``, its LM head ``lm_head.weight`` not read;
:mod:`sdlite.weights.qwen_keys`), ``tokenizer`` (Qwen's ``tokenizer.json``), ``transformer`` (diffusers' names,
sharded or not), ``vae`` (``AutoencoderKLFlux2``: 32 latent channels and their batch-norm statistics) and
``scheduler``. ``is_distilled`` in model_index.json tells the 4-step distilled model from the base model (the two have
the same shapes); where it is missing, the pipeline class's own default says (diffusers': False for the klein and
inpaint pipelines, True for the KV one). A ``Flux2Pipeline`` folder is FLUX.2 [dev], whose text encoder (Mistral Small
3.1) sdlite does not run: refused by name.

**single files**: Black Forest Labs' ``flux-2-klein-4b.safetensors``, ``flux-2-klein-base-4b.safetensors``,
``flux-2-klein-9b.safetensors`` (the transformer alone in BFL's names: :mod:`sdlite.weights.flux2_keys`), ComfyUI's
copies (bare or under ``model.diffusion_model.``), their fp8 forms (float8_e4m3fn weights, also ComfyUI's scaled fp8:
a per-tensor ``<layer>.weight_scale`` / ``scale_weight`` beside each fp8 weight, applied as the tensor is read; input
scales and ``comfy_quant`` records are ignored) and city96-style GGUF files (BFL's names, block formats kept). The
transformer's config comes from the shapes; a file is the distilled model unless its name says ``base``. FLUX.2
[dev]'s transformer (the guidance embedding, a 15360-wide text input) is refused by name.

**the parts a transformer's file lacks**: the Qwen3 text encoder (``qwen_3_4b.safetensors`` for 4B,
``qwen_3_8b*.safetensors`` for 9B: transformers' names under ``model.``, plain or scaled fp8; or a llama.cpp GGUF,
``Qwen3-4B-Q4_K_M.gguf``, ``Qwen3-8B-*.gguf``) and the VAE (``flux2-vae.safetensors``: BFL's / ComfyUI's LDM names, or
diffusers' names), given (``text_encoders=``: the CLI's ``--text-encoder``, repeatable, which also takes the VAE) or
found beside the model (its folder, ``text_encoders/``, ``vae/``, ComfyUI's ``models/text_encoders``, ``models/clip``
and ``models/vae``; BFL's ``ae.safetensors`` too when it is FLUX.2's). What a file holds is read from its keys. The
encoder must be three times narrower than the transformer's text input (it reads three of Qwen3's hidden states), and
the VAE's 32 latent channels x 4 must be the transformer's token values; FLUX.1's 16-channel ``ae.safetensors`` is
refused by name.

Opening reads headers, except two vectors: the VAE's latent statistics (``bn.running_mean`` / ``bn.running_var``), which
go into the :class:`~sdlite.config.flux2_vae.Flux2VAEConfig` of the spec (the family normalises the sampler's latents
with them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError
from ..config.flux2 import Flux2Config, flux2_spec
from ..config.flux2_vae import Flux2VAEConfig
from ..config.qwen import QwenConfig
from ..errors import CheckpointError
from ..tokenizers.qwen import QwenTokenizer
from .beside import (Parts, TransformerFile, beside_places, open_transformer_file, opened, unexpected_notes,
                     vae_prefix)
from .detect import Detection
from .encoders import INPUT_SCALES, SCALED_FP8_MARKER, WEIGHT_SCALES, dequantize
from .flux2_keys import flux2_layout, flux2_plan, infer_flux2_config, is_flux2, original_names
from .flux2_vae_keys import FLUX2_VAE_STATS, flux2_vae_layout, infer_flux2_vae, is_flux2_vae
from .flux2_vae_keys import LAYOUTS as VAE_LAYOUTS
from .folders import component_store, read_json, storage_dtype
from .io import open_checkpoint
from .plan import COPY, ComponentPlan, ConversionError, PlanEntry, Transform, UnsupportedModelError
from .qwen_keys import find_qwen_prefix, infer_qwen_config, qwen_config_from_gguf, qwen_plan
from .store import ComponentSource, TensorStore

__all__ = ["KLEIN_PIPELINES", "FLUX2_PIPELINES", "open_flux2_folder", "open_flux2_file", "is_flux2_file",
           "flux2_transformer_plan"]

KLEIN_PIPELINES = ("Flux2KleinPipeline", "Flux2KleinInpaintPipeline", "Flux2KleinKVPipeline")
#: the folders this module answers for: klein's, and FLUX.2 [dev]'s (refused by name)
FLUX2_PIPELINES = (*KLEIN_PIPELINES, "Flux2Pipeline")
# is_distilled where model_index.json does not say it: each pipeline class's default (diffusers)
_DISTILLED_DEFAULT = {"Flux2KleinPipeline": False, "Flux2KleinInpaintPipeline": False, "Flux2KleinKVPipeline": True}
PREDICTION_SOURCE = "flow matching (FLUX.2 [klein])"
_DEV = ("FLUX.2 [dev] needs the Mistral Small 3.1 text encoder, which sdlite does not run; sdlite runs FLUX.2 [klein] "
        "(4B and 9B, with Qwen3)")
_VAE_PREFIXES = ("vae.", "first_stage_model.")
_VAE_NAME = "VAE (flux2-vae.safetensors)"
_FLUX2_VAE = "FLUX.2 decodes with its own 32-channel VAE (flux2-vae.safetensors)"
# the releases by the transformer's text width (3 x the encoder's): their name, their Qwen3, its file
_RELEASES = {7680: ("FLUX.2 [klein] 4B", "Qwen3-4B (2560 wide)", "qwen_3_4b.safetensors"),
             12288: ("FLUX.2 [klein] 9B", "Qwen3-8B (4096 wide)", "qwen_3_8b.safetensors")}
# the names the encoder files go by, by release (a 9B model must not pick up the 4B's encoder beside it); any Qwen
# file for a transformer of no release's width
_QWEN_FILES = {7680: ("qwen_3_4b*.safetensors", "qwen3_4b*.safetensors", "qwen3-4b*.safetensors", "Qwen3-4B*.gguf",
                      "qwen3-4b*.gguf", "Qwen3-4B*.safetensors"),
               12288: ("qwen_3_8b*.safetensors", "qwen3_8b*.safetensors", "qwen3-8b*.safetensors", "Qwen3-8B*.gguf",
                       "qwen3-8b*.gguf", "Qwen3-8B*.safetensors")}
_ANY_QWEN = ("qwen*.safetensors", "Qwen*.safetensors", "qwen*.gguf", "Qwen*.gguf")
# ComfyUI's name and its variants; BFL's "ae.safetensors" (FLUX.1's name too) is looked at separately (_ae_beside)
_VAE_FILES = ("flux2-vae*.safetensors", "flux2_vae*.safetensors", "flux-2-vae*.safetensors", "flux2*vae*.safetensors",
              "flux-2*vae*.safetensors")


def is_flux2_file(keys) -> bool:
    """Whether a single file's keys hold a FLUX.2 transformer (any layout, with or without ComfyUI's prefix)."""
    return is_flux2(list(keys))


def _release(transformer: Flux2Config) -> tuple[str, str, str | None]:
    """(the model's name, the Qwen3 it reads, that encoder's file or None) for messages."""
    width = transformer.joint_attention_dim
    return _RELEASES.get(width, ("this FLUX.2 [klein] transformer", f"a Qwen3 {width // 3} wide", None))


def _refuse_dev(transformer: Flux2Config, where) -> None:
    """FLUX.2 [dev]'s transformer (the guidance embedding; Mistral's 3 x 5120-wide states) is named, not run."""
    if transformer.guidance_embeds or transformer.joint_attention_dim == 15360:
        what = "a guidance embedding" if transformer.guidance_embeds else "a 15360-wide text input"
        raise CheckpointError(f"a FLUX.2 [dev] transformer ({what}): {_DEV}", where)


# --- scaled fp8 ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Scaled(Transform):
    """A weight stored with a per-tensor scale (ComfyUI's scaled fp8): ``inner``, the layout's own step (a copy, a third
    of a fused qkv, the swapped halves of the output modulation), on the stored tensor, then times the scale, formed
    in float32. One scale covers a fused tensor whole, so it applies to each part alike. ``scale`` names the scale's
    key in the file, for messages."""

    op: str = "scaled"
    inner: Transform = COPY
    scale: str = ""

    def __post_init__(self):
        pass

    def apply(self, tensors, key: str = "?"):
        self.shape([tuple(t.shape) for t in tensors], key)
        return dequantize(self.inner.apply(tensors[:1], key), torch.float32, tensors[1])

    def shape(self, shapes, key: str = "?") -> tuple[int, ...]:
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if len(shapes) != 2:
            raise ConversionError(f"a scaled weight takes the weight and its scale, got {len(shapes)} tensors", key=key)
        if int(torch.Size(shapes[1]).numel()) != 1:
            raise ConversionError(f"a weight scale of shape {list(shapes[1])}: only per-tensor scales (one value) are "
                                  "supported", key=self.scale or key)
        return self.inner.shape(shapes[:1], key)


def flux2_transformer_plan(keys) -> ComponentPlan:
    """The plan to canonical names of a FLUX.2 transformer's keys (any layout and prefix: :func:`flux2_plan`), in a
    file that may be scaled fp8: a weight with a ``weight_scale`` / ``scale_weight`` beside it is read times that
    scale; input scales, ``comfy_quant`` records and the ``scaled_fp8`` marker are ignored; a scale without its
    weight is unexpected."""
    scales, weights, ignored = {}, [], []
    for key in keys:
        suffix = next((s for s in WEIGHT_SCALES if key.endswith(s)), None)
        if suffix is not None:
            scales[key[:-len(suffix)] + ".weight"] = key
        elif key.endswith((*INPUT_SCALES, ".comfy_quant")) or key.rpartition(".")[2] == SCALED_FP8_MARKER:
            ignored.append(key)
        else:
            weights.append(key)
    plan = flux2_plan(weights)
    used = set()
    for target, entry in list(plan.entries.items()):
        scale = scales.get(entry.sources[0])
        if scale is not None and len(entry.sources) == 1:
            plan.entries[target] = PlanEntry((entry.sources[0], scale), _Scaled(inner=entry.transform, scale=scale))
            used.add(scale)
    plan.unexpected.extend(s for s in scales.values() if s not in used)
    plan.ignored.extend(ignored)
    return plan


def _check_complete(transformer: Flux2Config, source: ComponentSource, layout: str, prefix: str, where) -> None:
    """Every tensor of the transformer its shapes describe is there: the missing ones are named as the file names them
    (a part of a fused qkv by the fused tensor's name)."""
    from ..models.flux2 import Flux2

    with torch.device("meta"):
        expected = Flux2(transformer).state_dict().keys()
    missing = [k for k in expected if k not in source.shapes]
    if missing:
        names = original_names(missing, prefix) if layout == "bfl" else [prefix + k for k in missing]
        count = "1 FLUX.2 transformer tensor is" if len(names) == 1 else f"{len(names)} FLUX.2 transformer tensors are"
        raise CheckpointError(f"{count} missing: " + ", ".join(repr(n) for n in names[:5])
                              + (", ..." if len(names) > 5 else ""), where, names[0])


# --- the parts -------------------------------------------------------------------------------------------------


def _with_statistics(vae: Flux2VAEConfig, source: ComponentSource, where) -> Flux2VAEConfig:
    """``vae`` with the latent statistics read from the weights (the only tensors read when a model is opened)."""
    values = {}
    for key in FLUX2_VAE_STATS:
        if key not in source.shapes:
            raise CheckpointError(f"the FLUX.2 VAE has no {key!r}: its latent statistics are part of FLUX.2's "
                                  "autoencoder (AutoencoderKLFlux2)", where, key)
        try:
            tensor = source.view[key]
            if not isinstance(tensor, torch.Tensor):    # a GGUF block format
                tensor = tensor.dequantize(torch.float32)
            values[key] = tuple(tensor.float().reshape(-1).tolist())
        except CheckpointError:
            raise
        except Exception as e:   # a damaged tensor: name it rather than show torch internals
            raise CheckpointError(f"cannot read the VAE's latent statistics: {e}", where,
                                  source.file_key(key)) from None
    if any(not v >= 0 for v in values["bn.running_var"]):
        raise CheckpointError("the VAE's latent variances are not all >= 0 (a damaged file?)", where,
                              source.file_key("bn.running_var"))
    try:
        return dataclasses.replace(vae, latents_mean=values["bn.running_mean"], latents_var=values["bn.running_var"])
    except ConfigError as e:
        raise CheckpointError(str(e), where, source.file_key("bn.running_mean")) from None


def _vae_part(keys: list[str], store: TensorStore, path) -> tuple[ComponentSource, Flux2VAEConfig]:
    """A FLUX.2 VAE file (or the VAE inside one) in either layout: its source and config (widths from the shapes, the
    statistics from the weights)."""
    source = ComponentSource.from_plan(VAE_LAYOUTS.plan(keys), store, (str(path),))
    try:
        vae = infer_flux2_vae(source.shapes)
    except ConfigError as e:   # shapes no FLUX.2 autoencoder has (the release's 32 norm groups assumed)
        raise CheckpointError(f"the VAE's shapes do not make a FLUX.2 autoencoder: {e}", path) from None
    return source, _with_statistics(vae, source, path)


def _file_kind(keys: list[str], shapes: dict, where) -> tuple[str, str]:
    """``(component, prefix)`` of a separate file: the Qwen3 text encoder or FLUX.2's VAE. Another autoencoder (FLUX.1's
    ``ae.safetensors``, SD's) is refused naming its latent channels."""
    prefix = find_qwen_prefix(keys)
    if prefix is not None:
        return "text_encoder", prefix
    if is_flux2_vae(keys):
        return "vae", flux2_vae_layout(keys)[1]
    prefix = vae_prefix(shapes, ("", *_VAE_PREFIXES))
    if prefix is not None:
        channels = shapes[f"{prefix}decoder.conv_in.weight"][1]
        raise CheckpointError(f"a VAE with {channels} latent channels and no latent statistics ('bn.running_mean'): "
                              f"FLUX.1's or SD's autoencoder, not FLUX.2's. {_FLUX2_VAE}", where)
    raise CheckpointError("not a file FLUX.2 [klein] takes beside its transformer (no Qwen3 'model.layers.0...' / GGUF "
                          "'blk.0...' or FLUX.2 VAE 'bn.running_mean' keys)"
                          + (f"; the first key is {keys[0]!r}" if keys else ""), where)


def _parts(transformer: Flux2Config, configs: dict) -> Parts:
    """The parts klein takes beside its transformer; their configs go to ``configs``."""
    def source(component, keys, prefix, store, path):
        if component == "vae":
            found, configs["vae"] = _vae_part(keys, store, path)
            return found
        found = ComponentSource.from_plan(qwen_plan(keys, prefix=prefix), store, (str(path),))
        configs["text_encoder"] = qwen_config_from_gguf(store) if getattr(store, "fields", None) is not None \
            else infer_qwen_config(found.shapes)
        return found

    encoder = _release(transformer)[2]
    names = {"text_encoder": f"Qwen3 text encoder ({encoder})" if encoder else "Qwen3 text encoder", "vae": _VAE_NAME}
    patterns = (("text_encoder", _QWEN_FILES.get(transformer.joint_attention_dim, _ANY_QWEN)), ("vae", _VAE_FILES))
    return Parts(names=names, patterns=patterns, kind=_file_kind, source=source)


def _ae_beside(path: Path, parts: Parts, sources: dict, stores: list, notes: list) -> Path | None:
    """BFL's FLUX.2 repositories name the autoencoder ``ae.safetensors``, as FLUX.1's do: the first one beside the
    model is taken when it is FLUX.2's, passed over (and returned, for the message) when it is not."""
    for place in beside_places(path):
        candidate = place / "ae.safetensors"
        if not candidate.is_file():
            continue
        store = open_checkpoint(candidate)
        keys = list(store.keys())
        if not is_flux2_vae(keys):
            store.close()
            return candidate
        stores.append(store)
        sources["vae"] = parts.source("vae", keys, "", store, candidate)
        notes.append(f"{_VAE_NAME} from {candidate.name}, found beside the model")
        return None
    return None


def _check_parts(transformer: Flux2Config, vae: Flux2VAEConfig, text: QwenConfig, where, files=None) -> None:
    """The parts fit the transformer; ``files`` (component -> the separate file it came from) says which is at
    fault."""
    files = files or {}
    model = Path(where).name
    name, qwen, encoder = _release(transformer)
    at = files.get("text_encoder", where)
    if text.kind != "qwen3":
        raise CheckpointError(f"the text encoder is a {text.kind} (q/k/v biases, no q/k norms): {name} ({model}) reads "
                              f"{qwen}" + (f", {encoder}" if encoder else ""), at)
    if 3 * text.hidden_size != transformer.joint_attention_dim:
        raise CheckpointError(f"the text encoder's width {text.hidden_size} (x 3 hidden states = "
                              f"{3 * text.hidden_size}) is not the text width {transformer.joint_attention_dim} of the "
                              f"transformer ({model}): {name} reads {qwen}" + (f", {encoder}" if encoder else ""), at)
    if 4 * vae.latent_channels != transformer.in_channels:
        raise CheckpointError(f"the VAE's {vae.latent_channels} latent channels (x 4 in a 2x2 patch) are not the "
                              f"{transformer.in_channels} token values of the transformer ({model}): {_FLUX2_VAE}",
                              files.get("vae", where))


def _spec_and_detection(transformer, vae, text, scheduler, distilled, layout, where, files=None):
    _check_parts(transformer, vae, text, where, files)
    spec = flux2_spec(transformer, text=text, vae=vae, distilled=distilled, scheduler=scheduler)
    return spec, Detection(layout=layout, family=spec.family, components=("text_encoder", "transformer", "vae"),
                           unet=None)


# --- folders ---------------------------------------------------------------------------------------------------


def _distilled(index: dict, index_file: Path) -> bool:
    cls = index.get("_class_name")
    value = index.get("is_distilled", _DISTILLED_DEFAULT[cls])
    if not isinstance(value, bool):
        raise CheckpointError(f"is_distilled is {value!r}: expected true (the 4-step distilled model) or false (the "
                              "base model)", index_file)
    return value


def open_flux2_folder(folder: Path, index: dict, index_file: Path) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of a FLUX.2 [klein] pipeline folder (a ``Flux2Pipeline`` one,
    FLUX.2 [dev], is refused by name)."""
    cls = index.get("_class_name")
    if cls not in KLEIN_PIPELINES:
        raise CheckpointError(f"{cls} is FLUX.2 [dev]: {_DEV}", index_file)
    for needed in ("text_encoder", "transformer", "vae"):
        if not (folder / needed).is_dir() or index.get(needed, ["", ""]) == [None, None]:
            raise CheckpointError(f"the {cls} folder has no {needed}", folder)
    distilled = _distilled(index, index_file)
    stores: list[TensorStore] = []
    sources: dict[str, ComponentSource] = {}
    with opened(stores, folder):
        configs = {}
        for component in ("text_encoder", "transformer", "vae"):
            configs[component] = read_json(folder / component / "config.json")
            store = component_store(folder, component)
            stores.append(store)
            keys = list(store.keys())
            where = folder / component
            if component == "transformer":
                plan = flux2_transformer_plan(keys)
            elif component == "text_encoder":
                prefix = find_qwen_prefix(keys)
                if prefix is None:
                    raise CheckpointError("no Qwen3 decoder weights (no 'layers.0.self_attn.q_proj.weight', bare or "
                                          "under a prefix such as 'model.')", where)
                plan = qwen_plan(keys, prefix=prefix)
            else:
                try:
                    plan = VAE_LAYOUTS.plan(keys)
                except UnsupportedModelError as e:
                    raise CheckpointError(f"{e}. {_FLUX2_VAE}", where) from None
            sources[component] = ComponentSource.from_plan(plan, store, tuple(store.paths))
        try:
            transformer = Flux2Config.from_diffusers(configs["transformer"])
        except (ConfigError, TypeError) as e:
            raise CheckpointError(f"unusable transformer config: {e}", folder / "transformer" / "config.json") from None
        _refuse_dev(transformer, folder / "transformer")
        _check_complete(transformer, sources["transformer"], "diffusers", "", folder / "transformer")
        try:
            vae = Flux2VAEConfig.from_diffusers(configs["vae"])
        except (ConfigError, TypeError) as e:
            raise CheckpointError(f"unusable VAE config: {e}. {_FLUX2_VAE}", folder / "vae" / "config.json") from None
        vae = _with_statistics(vae, sources["vae"], folder / "vae")
        try:
            text = QwenConfig.from_transformers(configs["text_encoder"])
        except (ConfigError, TypeError) as e:
            raise CheckpointError(f"unusable text encoder config: {e}",
                                  folder / "text_encoder" / "config.json") from None
        tokenizer_dir = folder / "tokenizer"
        try:
            tokenizer = QwenTokenizer.from_pretrained_dir(tokenizer_dir) if tokenizer_dir.is_dir() else \
                QwenTokenizer.from_package()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"unusable tokenizer: {e}", tokenizer_dir) from None
        sched_file = folder / "scheduler" / "scheduler_config.json"
        scheduler = read_json(sched_file) if sched_file.is_file() else None
        spec, detection = _spec_and_detection(transformer, vae, text, scheduler, distilled, "diffusers", folder,
                                              {"text_encoder": folder / "text_encoder", "vae": folder / "vae"})
        notes: list[str] = []
        unexpected_notes(sources, notes)
    return dict(path=str(folder), layout="diffusers", spec=spec, detection=detection,
                storage_dtype=storage_dtype(stores[1]), prediction_source=PREDICTION_SOURCE, sources=sources,
                scheduler_config=dict(spec.scheduler),
                scheduler_source="scheduler/scheduler_config.json" if sched_file.is_file()
                else "FLUX.2 [klein]'s published scheduler (the folder has none)",
                tokenizer_dir=str(tokenizer_dir) if tokenizer_dir.is_dir() else None, notes=notes, _stores=stores,
                _tokenizer=tokenizer)


# --- single files and the files beside them --------------------------------------------------------------------


def _transformer(keys: list[str], layout: str, prefix: str, store: TensorStore, path: Path):
    """The transformer's source and config: FLUX.2 [dev]'s refused, every tensor of klein's there."""
    source = ComponentSource.from_plan(flux2_transformer_plan(keys), store, (str(path),))
    transformer = infer_flux2_config(source.shapes)
    _refuse_dev(transformer, path)
    _check_complete(transformer, source, layout, prefix, path)
    return source, transformer


def _vae_inside(keys: list[str], prefix: str) -> list[str] | None:
    """The keys of a FLUX.2 VAE under ``prefix`` in the transformer's file (its latent statistics there), or None."""
    return [k for k in keys if k.startswith(prefix)] if prefix + FLUX2_VAE_STATS[0] in keys else None


def _last_look(path: Path, parts: Parts, sources: dict, stores: list, notes: list) -> dict[str, str]:
    """BFL's ``ae.safetensors`` beside the model when no VAE was found yet; one that is not FLUX.2's is named in the
    missing VAE's message."""
    passed_over = _ae_beside(path, parts, sources, stores, notes) if "vae" not in sources else None
    return {"vae": f"; {passed_over} beside it is not FLUX.2's"} if passed_over else {}


def _file_spec(path: Path, transformer: Flux2Config, configs: dict, files: dict, notes: list):
    """The spec of a transformer file: the distilled model unless its name says ``base`` (noted)."""
    distilled = "base" not in path.name.lower()
    found = _spec_and_detection(transformer, configs["vae"], configs["text_encoder"], None, distilled, "original",
                                path, files)
    notes.append(f"the {'base' if not distilled else 'step-distilled'} model: its file name "
                 f"{'says' if not distilled else 'does not say'} 'base'")
    return found


_FILE = TransformerFile(
    model="FLUX.2 [klein]", layout=flux2_layout, transformer=_transformer,
    parts=lambda transformer, configs, notes: _parts(transformer, configs), vae_prefixes=_VAE_PREFIXES,
    vae_keys=_vae_inside,
    given=lambda transformer: f"{_release(transformer)[2] or 'a Qwen3'} or a Qwen3 GGUF, flux2-vae.safetensors",
    spec=_file_spec, prediction_source=PREDICTION_SOURCE,
    scheduler_source="FLUX.2 [klein]'s published scheduler (FlowMatchEulerDiscreteScheduler, dynamic shifting)",
    tokenizer=QwenTokenizer.from_package, last_look=_last_look)


def open_flux2_file(path: Path, store: TensorStore, text_encoders=()) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of a FLUX.2 [klein] transformer file (``store``, already open) with
    the parts it lacks from ``text_encoders`` (paths: the Qwen3 encoder and the VAE) or found beside it."""
    return open_transformer_file(path, store, _FILE, text_encoders)
