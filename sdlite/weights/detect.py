"""What a checkpoint is, from its key names and tensor shapes only (no tensor is read).

Everything sdlite concludes about a weights file is concluded here:

* the layout: ``original`` (one LDM/CompVis/A1111 single file), ``diffusers`` (the per-component state
  dicts of a diffusers folder, or one bare diffusers UNet) or ``unknown``;
* the family: ``sd1`` / ``sd2`` (OpenAI CLIP-L vs OpenCLIP ViT-H text tower; UNet cross-attention context
  768 vs 1024) and their inpainting variants ``sd1-inpaint`` / ``sd2-inpaint`` (9 UNet input channels);
  ``sdxl`` (CLIP-L and OpenCLIP bigG, context 768 + 1280 = 2048, a UNet with added "text_time" conditioning)
  and ``sdxl-refiner`` (bigG alone, context 1280, four UNet levels); ``sd-x4-upscaler`` (SD 2.x's OpenCLIP text
  tower, a UNet of 7 input channels -- the latent and the low-resolution image -- with a class embedding for the
  image's noise level, and a 3-level VAE);
* a clear refusal, saying what the file looks like, for LoRA / LyCORIS adapters, textual-inversion
  embeddings, ControlNets, standalone VAEs or text encoders, transformer-based models and anything else;
* the UNet, VAE and text-encoder configs implied by the shapes (:class:`UNetInfo`, :class:`VAEInfo`,
  :class:`TextEncoderInfo`, read by each network's key module; ``config_kwargs()`` gives sdlite config field names);
* for single files, the prediction type when the file's own metadata (or a marker key) states it, and whether
  its metadata says it is a distilled Turbo model.
"""
from __future__ import annotations


import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from ..config import X4_FAMILY
from .convert import normalize_diffusers_keys
from .plan import UnsupportedModelError
from .text_keys import (
    CLIP_PREFIX, EMBEDDERS_PREFIX, OPENCLIP_PREFIX, TextEncoderInfo, clip_from_original, infer_text_encoder,
    openclip_from_original, sgm_text_prefixes,
)
from .unet_keys import (
    EMA_PREFIX, SDXL_TIME_EMBED_DIM, UNET_PREFIX, UNetInfo, infer_unet, unet_from_original, unet_structure_from_keys,
)
from .vae_keys import VAE_PREFIX, VAEInfo, infer_vae, vae_from_original

__all__ = [
    "UnsupportedModelError", "UNetInfo", "VAEInfo", "TextEncoderInfo", "Detection",
    "detect", "detect_layout", "describe", "unet_structure_from_keys", "infer_unet", "infer_vae",
    "infer_text_encoder", "prediction_type_from_metadata", "turbo_from_metadata", "META_TURBO",
]

CONTEXT_DIMS = {768: "sd1", 1024: "sd2"}
# SDXL: the context is CLIP-L (768) and bigG (1280) side by side; the refiner has bigG alone. The UNet's added
# conditioning is the pooled bigG embedding and this many size/crop ids (the refiner: an aesthetic score instead of
# the target size), each embedded sinusoidally in SDXL_TIME_EMBED_DIM channels
SDXL_CONTEXT_DIMS = {2048: "sdxl", 1280: "sdxl-refiner"}
SDXL_TIME_IDS = {"sdxl": 6, "sdxl-refiner": 5}
# the SD x4 upscaler (family X4_FAMILY): its UNet reads the latent and the noised low-resolution RGB image side by side
X4_IN_CHANNELS = 7
X4_UNET_HEADS = 8   # at every level, whatever its width (num_heads: 8 in x4-upscaling.yaml), unlike SD 2.x's 64-wide heads


# --- results -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Detection:
    layout: str                                  # "original" | "diffusers"
    family: str                                  # "sd1" | "sd2" | "sd1-inpaint" | "sd2-inpaint" | "sdxl" |
                                                 # "sdxl-refiner" | "sd-x4-upscaler"
    components: tuple[str, ...]                  # of "unet", "vae", "text_encoder", "text_encoder_2"
    unet: UNetInfo
    vae: VAEInfo | None = None
    text_encoder: TextEncoderInfo | None = None
    prefixes: Mapping[str, str] = field(default_factory=dict)  # original layout: component -> key prefix
    prediction_type: str | None = None           # only what the file itself states: "epsilon" | "v_prediction"
    prediction_source: str | None = None         # where that came from
    has_ema: bool = False
    notes: tuple[str, ...] = ()
    text_encoder_2: TextEncoderInfo | None = None  # SDXL's OpenCLIP bigG (with its projection)
    turbo: bool = False                          # the file's metadata says it is a distilled Turbo model
    turbo_source: str | None = None

    @property
    def base_family(self) -> str:
        return self.family.split("-")[0]

    @property
    def inpainting(self) -> bool:
        return self.family.endswith("-inpaint")


# --- helpers -----------------------------------------------------------------------------------------------


def _first(keys: Iterable[str], n: int = 3) -> str:
    keys = sorted(keys)
    return ", ".join(repr(k) for k in keys[:n]) + (", ..." if len(keys) > n else "")


# --- prediction type ---------------------------------------------------------------------------------------

_V_NAMES = {"v", "v_prediction", "v-prediction", "vpred", "v-pred", "v_pred"}
_EPS_NAMES = {"epsilon", "eps", "noise"}


def prediction_type_from_metadata(metadata: Mapping[str, str] | None,
                                  keys: Iterable[str] = ()) -> tuple[str | None, str | None]:
    """``(prediction_type, source)`` as the file itself states it, else ``(None, None)``.

    Looked at: ``modelspec.prediction_type`` / ``prediction_type`` metadata, a ``modelspec.architecture``
    ending in ``-v`` (e.g. ``stable-diffusion-v2-768-v``), kohya's ``ss_v_parameterization=True`` and a
    ``v_pred`` marker key.
    """
    metadata = metadata or {}
    for name in ("modelspec.prediction_type", "prediction_type"):
        value = str(metadata.get(name, "")).strip().lower()
        if value in _V_NAMES:
            return "v_prediction", f"metadata {name}={metadata[name]!r}"
        if value in _EPS_NAMES:
            return "epsilon", f"metadata {name}={metadata[name]!r}"
    arch = str(metadata.get("modelspec.architecture", "")).strip().lower()
    if arch.startswith("stable-diffusion") and arch.split("/")[0].endswith("-v"):
        return "v_prediction", f"metadata modelspec.architecture={metadata['modelspec.architecture']!r}"
    if str(metadata.get("ss_v_parameterization", "")).strip().lower() == "true":
        return "v_prediction", "metadata ss_v_parameterization='True'"
    if "v_pred" in set(keys):
        return "v_prediction", "marker key 'v_pred'"
    return None, None


_TURBO_WORD = re.compile(r"(^|[^a-z])turbo([^a-z]|$)")
# the modelspec keys that identify a model (the others describe it, and a description may mention Turbo in passing)
_TURBO_KEYS = ("modelspec.architecture", "modelspec.title")
META_TURBO = "sdlite.turbo"  # "true" in the single files sdlite writes of a Turbo model


def turbo_from_metadata(metadata: Mapping[str, str] | None) -> tuple[bool, str | None]:
    """``(True, source)`` when the file's SAI model-spec metadata names it a Turbo (adversarially distilled) model:
    its ``modelspec.architecture`` or ``modelspec.title`` has the word "turbo" (Stability's SDXL-Turbo and
    SD-Turbo files are SDXL / SD 2.1 by architecture, and Turbo by name), or it is a file sdlite wrote of one
    (``sdlite.turbo``). Else ``(False, None)``."""
    metadata = metadata or {}
    if str(metadata.get(META_TURBO, "")).lower() == "true":
        return True, f"metadata {META_TURBO}='true'"
    for name in _TURBO_KEYS:
        value = str(metadata.get(name, ""))
        if _TURBO_WORD.search(value.lower()):
            return True, f"metadata {name}={value!r}"
    return False, None


# --- what is it? -------------------------------------------------------------------------------------------

_LORA = re.compile(r"(^|[._])(lora_(up|down|A|B|te\d?|unet)|lora|hada_w\d|lokr_w\d|oft_blocks)([._]|$)")


def detect_layout(keys: Iterable[str]) -> str:
    """``original`` (LDM single file, or a bare original-layout UNet), ``diffusers`` (canonical names of a UNet,
    VAE or text encoder) or ``unknown``."""
    keys = list(keys)
    if any(k.startswith((UNET_PREFIX, VAE_PREFIX, CLIP_PREFIX, OPENCLIP_PREFIX, EMBEDDERS_PREFIX)) for k in keys):
        return "original"
    if any(k.startswith("input_blocks.0.0.") for k in keys) or any(k.startswith("encoder.down.0.") for k in keys):
        return "original"
    if any(k.startswith(("conv_in.", "down_blocks.", "encoder.down_blocks.", "text_model.")) for k in keys):
        return "diffusers"
    return "unknown"


def describe(keys: Iterable[str]) -> str | None:
    """What a file that is not an SD 1.x/2.x/XL model looks like (None when it looks like one)."""
    keys = list(keys)
    n = len(keys)
    if not keys:
        return "an empty file (no tensors)"
    if any(k.startswith((UNET_PREFIX + "joint_blocks.", "joint_blocks.", UNET_PREFIX + "double_blocks.",
                         "double_blocks.", "transformer_blocks.0.attn.")) for k in keys):
        return "a transformer-based diffusion model (SD3/Flux-like), not an SD 1.x/2.x UNet"
    lora = [k for k in keys if _LORA.search(k)]
    if lora:
        return (f"a LoRA/LyCORIS adapter ({n} tensors, e.g. {_first(lora, 1)}), not a full model; "
                "load it as an adapter on top of a base model")
    if any(k in ("emb_params", "clip_l", "clip_g") or k.startswith("string_to_param") for k in keys):
        return f"a textual-inversion embedding ({n} tensors), not a model"
    if any(k.startswith(("control_model.", "input_hint_block.", "controlnet_cond_embedding.")) for k in keys):
        return "a ControlNet, not a base model"
    # a class-embedding table (class_embedding.weight) is the x4 upscaler's noise level; the other kinds are MLPs
    if any(k.startswith(("class_embedding.linear_", "class_embedding_")) for k in keys):
        return "a UNet with projected class embeddings (unCLIP-like), not supported"
    has_unet = any(k.startswith((UNET_PREFIX + "input_blocks.", "input_blocks.0.0.", "conv_in.")) for k in keys)
    if has_unet:
        return None
    if any(k.startswith(("encoder.down.", VAE_PREFIX + "encoder.down.", "decoder.up.")) for k in keys):
        return f"a standalone VAE in the original layout ({n} tensors), not a full model"
    if any(k.startswith(("encoder.down_blocks.", "decoder.up_blocks.")) for k in keys):
        return f"a standalone VAE in the diffusers layout ({n} tensors), not a full model"
    if any(k.startswith(("text_model.", CLIP_PREFIX, OPENCLIP_PREFIX, EMBEDDERS_PREFIX, "transformer.resblocks."))
           for k in keys):
        return f"a standalone text encoder ({n} tensors), not a full model"
    return (f"not a Stable Diffusion checkpoint: no UNet found ({n} tensors, first keys: {_first(keys)}; expected "
            f"{UNET_PREFIX + 'input_blocks.0.0.weight'!r} or 'conv_in.weight')")


# --- detection ---------------------------------------------------------------------------------------------


def _family(unet: UNetInfo, te: TextEncoderInfo | None, notes: list[str],
            te2: TextEncoderInfo | None = None) -> str:
    context = unet.context_dim
    if context is None:
        raise UnsupportedModelError("the UNet has no cross-attention (no 'attn2.to_k.weight'); not a text-to-image "
                                    "Stable Diffusion UNet")
    if unet.add_embed_in or te2 is not None:
        return _sdxl_family(unet, te, te2, notes)
    if context in SDXL_CONTEXT_DIMS:
        raise UnsupportedModelError(f"the UNet's cross-attention context dim is {context} (SDXL's) but it has no "
                                    "added conditioning (label_emb / add_embedding), which every SDXL UNet has")
    if te is not None and te.width != context:
        raise UnsupportedModelError(f"the UNet's cross-attention context dim {context} (attn2.to_k.weight) does "
                                    f"not match the text encoder width {te.width} (token_embedding)")
    if te is not None and te.kind in ("clip", "openclip"):
        base = "sd1" if te.kind == "clip" else "sd2"
    elif context in CONTEXT_DIMS:
        base = CONTEXT_DIMS[context]
    else:
        base = "sd2" if unet.linear_projection else "sd1"
        notes.append(f"non-standard context dim {context}: family {base} guessed from "
                     f"{'linear' if unet.linear_projection else '1x1 conv'} transformer projections")
    if unet.num_class_embeds:
        if unet.in_channels == X4_IN_CHANNELS:
            return X4_FAMILY
        raise UnsupportedModelError(
            f"the UNet has {unet.num_class_embeds} class embeddings (class_embedding.weight / label_emb.weight) and "
            f"{unet.in_channels} input channels (conv_in.weight): the class-conditioned UNet sdlite runs is the SD x4 "
            f"upscaler's ({X4_IN_CHANNELS} input channels: 4 latent + 3 image)")
    if unet.in_channels == 9:
        return base + "-inpaint"
    if unet.in_channels != 4:
        kind = {8: " (instruct-pix2pix-like)",
                7: " (x4-upscaler-like, but without the noise-level class embedding the x4 upscaler has)"}
        raise UnsupportedModelError(f"the UNet has {unet.in_channels} input channels{kind.get(unet.in_channels, '')} "
                                    "(conv_in.weight); supported: 4 (text-to-image), 9 (inpainting) and the x4 "
                                    "upscaler's 7")
    return base


def _sdxl_family(unet: UNetInfo, te: TextEncoderInfo | None, te2: TextEncoderInfo | None, notes: list[str]) -> str:
    """``sdxl`` (CLIP-L + bigG) or ``sdxl-refiner`` (bigG alone), with every width checked against the UNet."""
    context = unet.context_dim
    if not unet.add_embed_in:
        raise UnsupportedModelError("the file has SDXL's OpenCLIP bigG text encoder but its UNet has no added "
                                    "conditioning (label_emb.0.0 / add_embedding.linear_1), which SDXL's has")
    if te2 is None and te is not None:
        raise UnsupportedModelError(f"the UNet has SDXL's added conditioning (context dim {context}) but the file "
                                    f"has only a {te.width}-wide {te.kind} text encoder, not SDXL's OpenCLIP bigG")
    if te2 is not None:
        widths = [t.width for t in (te, te2) if t is not None]
        if sum(widths) != context:
            raise UnsupportedModelError(
                f"the UNet's cross-attention context dim {context} (attn2.to_k.weight) is not the width of its text "
                f"encoders ({' + '.join(map(str, widths))}, token_embedding)")
        family = "sdxl" if te is not None else "sdxl-refiner"
    elif context in SDXL_CONTEXT_DIMS:
        family = SDXL_CONTEXT_DIMS[context]
    else:
        family = "sdxl-refiner" if len(unet.block_channels) == 4 else "sdxl"
        notes.append(f"non-standard context dim {context} and no text encoders: family {family} guessed from the "
                     f"UNet's {len(unet.block_channels)} levels")
    if unet.in_channels != 4:
        raise UnsupportedModelError(f"the SDXL UNet has {unet.in_channels} input channels (conv_in.weight); only "
                                    "text-to-image SDXL (4) is supported")
    return family


def _time_embed_dim(unet: UNetInfo, family: str, te2: TextEncoderInfo | None) -> UNetInfo:
    """The UNet info with the width of one sinusoidal time-id embedding, which shapes show only through the MLP's
    input width: the pooled text (bigG's projection) plus the family's number of time ids of that width."""
    if not unet.add_embed_in:
        return unet
    n = SDXL_TIME_IDS[family]
    pooled = te2.projection_dim if te2 is not None else None
    if pooled is None:
        return replace(unet, addition_time_embed_dim=SDXL_TIME_EMBED_DIM)
    extra = unet.add_embed_in - pooled
    if extra <= 0 or extra % n:
        raise UnsupportedModelError(
            f"the UNet's added-conditioning input width {unet.add_embed_in} (label_emb.0.0 / add_embedding.linear_1 "
            f"weight) is not the pooled text embedding ({pooled}, text_projection) plus {n} time ids of one width "
            f"({family})")
    return replace(unet, addition_time_embed_dim=extra // n)


def detect(shapes: Mapping, metadata: Mapping[str, str] | None = None) -> Detection:
    """Identify a checkpoint from ``{key: shape}`` (values may be shapes or tensors).

    ``shapes`` is either one flat mapping (a single file, or a bare diffusers UNet) or a diffusers folder as
    ``{"unet": {...}, "vae": {...}, "text_encoder": {...}(, "text_encoder_2": {...})}``. ``metadata``: the file's
    safetensors metadata. Raises :class:`UnsupportedModelError` saying what the weights look like when they are
    not a model sdlite runs.
    """
    values = list(shapes.values())
    if values and all(isinstance(v, Mapping) for v in values):
        return _detect_diffusers_folder(shapes)
    keys = list(shapes)
    reason = describe(keys)
    if reason is not None:
        raise UnsupportedModelError(reason)
    layout = detect_layout(keys)
    if layout == "diffusers":
        return _detect_diffusers_folder({"unet": shapes})
    if layout != "original":
        raise UnsupportedModelError(f"unknown layout ({len(keys)} tensors, first keys: {_first(keys)})")
    sdxl_marks = [k for k in keys if k.startswith((EMBEDDERS_PREFIX, UNET_PREFIX + "label_emb.0.", "label_emb.0."))]
    try:
        return _detect_original(shapes, keys, metadata)
    except UnsupportedModelError as e:
        if sdxl_marks and "SDXL" not in str(e):  # say what the file looks like, then what is wrong with it
            raise UnsupportedModelError(f"an SDXL-like checkpoint (has {_first(sdxl_marks, 1)}), but {e}") from None
        raise


def _detect_original(shapes: Mapping, keys: list[str], metadata: Mapping[str, str] | None) -> Detection:
    notes: list[str] = []
    unet_prefix = UNET_PREFIX if any(k.startswith(UNET_PREFIX) for k in keys) else ""
    prefixes = {"unet": unet_prefix}
    unet_plan = unet_from_original(keys, prefix=unet_prefix)
    unet = infer_unet(unet_plan.shapes(shapes))
    components = ["unet"]
    vae = te = te2 = None
    if any(k.startswith(VAE_PREFIX) for k in keys):
        vae = infer_vae(vae_from_original(keys).shapes(shapes))
        components.append("vae")
        prefixes["vae"] = VAE_PREFIX
    sgm = sgm_text_prefixes(keys)
    if sgm and any(k.startswith((CLIP_PREFIX, OPENCLIP_PREFIX)) for k in keys):
        raise UnsupportedModelError(f"the file has both SD 1.x/2.x ('cond_stage_model.') and SDXL "
                                    f"({EMBEDDERS_PREFIX!r}) text encoders")
    if any(k.startswith(CLIP_PREFIX) for k in keys):
        te = infer_text_encoder(clip_from_original(keys).shapes(shapes), "clip")
        prefixes["text_encoder"] = CLIP_PREFIX
    elif any(k.startswith(OPENCLIP_PREFIX) for k in keys):
        plan = openclip_from_original(keys)
        blocks = _openclip_blocks(keys, OPENCLIP_PREFIX)
        te = infer_text_encoder(plan.shapes(shapes), "openclip", source_layers=len(blocks))
        prefixes["text_encoder"] = OPENCLIP_PREFIX
    if "text_encoder" in sgm:
        te = infer_text_encoder(clip_from_original(keys, prefix=sgm["text_encoder"]).shapes(shapes), "clip")
        prefixes["text_encoder"] = sgm["text_encoder"]
    if "text_encoder_2" in sgm:
        prefix = sgm["text_encoder_2"]
        plan = openclip_from_original(keys, prefix=prefix, component="text_encoder_2", projection=True)
        te2 = infer_text_encoder(plan.shapes(shapes), "openclip", source_layers=len(_openclip_blocks(keys, prefix)))
        if te2.projection_dim is None:
            raise UnsupportedModelError(f"SDXL's OpenCLIP text encoder has no projection "
                                        f"({prefix + 'text_projection'!r} is missing), which makes its pooled text "
                                        "embedding")
        prefixes["text_encoder_2"] = prefix
    if te is not None:
        components.append("text_encoder")
    if te2 is not None:
        components.append("text_encoder_2")
    family = _family(unet, te, notes, te2)
    if sgm and not family.startswith("sdxl"):
        raise UnsupportedModelError(f"an SGM-layout file ({EMBEDDERS_PREFIX}*) whose UNet has no added conditioning: "
                                    "only SDXL files are read in that layout")
    if family.startswith("sdxl"):
        unet = _time_embed_dim(unet, family, te2)
    if family == X4_FAMILY:
        unet = replace(unet, heads=tuple(X4_UNET_HEADS for _ in unet.block_channels))
    prediction, source = prediction_type_from_metadata(metadata, keys)
    turbo, turbo_source = turbo_from_metadata(metadata)
    ema = sum(k.startswith(EMA_PREFIX) for k in keys)
    if unet_plan.unexpected:
        notes.append(f"{len(unet_plan.unexpected)} UNet keys not understood, first: {_first(unet_plan.unexpected)}")
    return Detection(layout="original", family=family, components=tuple(components), unet=unet, vae=vae,
                     text_encoder=te, prefixes=prefixes, prediction_type=prediction, prediction_source=source,
                     has_ema=ema > 0, notes=tuple(notes), text_encoder_2=te2, turbo=turbo, turbo_source=turbo_source)


def _openclip_blocks(keys: Iterable[str], prefix: str) -> set[str]:
    pattern = re.compile(re.escape(prefix) + r"transformer\.resblocks\.(\d+)\.")
    return {m.group(1) for k in keys if (m := pattern.match(k))}


_FOLDER_PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")


def _detect_diffusers_folder(parts: Mapping[str, Mapping]) -> Detection:
    unknown = [name for name in parts if name not in _FOLDER_PARTS]
    if unknown:
        raise UnsupportedModelError(f"diffusers components {unknown} are not Stable Diffusion parts "
                                    f"(expected {', '.join(_FOLDER_PARTS)})")
    if "unet" not in parts:
        raise UnsupportedModelError("the diffusers folder has no unet")
    notes: list[str] = []
    infos = {}
    for name, shapes in parts.items():
        keys = list(shapes)
        if name == "unet":
            reason = describe(keys)
            if reason is not None:
                raise UnsupportedModelError(f"unet: {reason}")
        canon = normalize_diffusers_keys(keys, name).shapes(shapes)
        if name == "unet":
            infos[name] = infer_unet(canon)
        elif name == "vae":
            infos[name] = infer_vae(canon)
        else:
            infos[name] = infer_text_encoder(canon, "diffusers")
    unet = infos["unet"]
    te = infos.get("text_encoder")
    te2 = infos.get("text_encoder_2")
    family = _family(unet, te, notes, te2)
    if family.startswith("sdxl"):
        unet = _time_embed_dim(unet, family, te2)
    elif family == X4_FAMILY:
        unet = replace(unet, heads=tuple(X4_UNET_HEADS for _ in unet.block_channels))
    elif te is not None and te.width not in CONTEXT_DIMS:
        notes.append(f"text encoder width {te.width}: activation {te.activation} assumed")
    return Detection(layout="diffusers", family=family, components=tuple(n for n in _FOLDER_PARTS if n in parts),
                     unet=unet, vae=infos.get("vae"), text_encoder=te, notes=tuple(notes), text_encoder_2=te2)
