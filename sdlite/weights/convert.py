"""Key conversion between the original single-file layout (LDM / CompVis / A1111) and sdlite's canonical names.

sdlite's canonical parameter names are those of a diffusers folder: ``UNet2DConditionModel`` keys for the
UNet, ``AutoencoderKL`` keys (modern ``to_q/to_k/to_v/to_out.0`` attention) for the VAE and transformers
``CLIPTextModel`` keys (``text_model.``-prefixed) for the text encoder. Every other layout comes in, and goes
out, through the key tables, one module per network:

* :mod:`~sdlite.weights.unet_keys` -- the UNet (``model.diffusion_model.``) and ControlNets;
* :mod:`~sdlite.weights.vae_keys` -- the VAE (``first_stage_model.``) and TAESD;
* :mod:`~sdlite.weights.text_keys` -- the text encoders: SD 1.x's CLIP (``cond_stage_model.transformer.``), SD 2.x's
  OpenCLIP (``cond_stage_model.model.``), SDXL's pair (``conditioner.embedders.N.``) and Taiyi's BERT.

Conversion works on key NAMES, through the plans of :mod:`~sdlite.weights.plan`: no tensor is read until a
converted mapping is indexed. This module plans whole checkpoints: a single file in (:func:`plan_from_original`)
or out (:func:`plan_to_original`), and the components of a diffusers folder (:func:`normalize_diffusers_keys`).
It is also where the conversion API is imported from.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from .plan import (
    COPY, CheckpointPlan, ComponentPlan, ConversionError, ConvertedMapping, PlanEntry, Transform, add_entry,
    apply_plan, check_expected,
)
from .text_keys import (
    CLIP_PREFIX, EMBEDDERS_PREFIX, OPENCLIP_PREFIX, SDXL_CLIP_PREFIX, SDXL_OPENCLIP_PREFIX, clip_from_original,
    clip_to_original, is_position_ids, normalize_bert_keys, openclip_from_original, openclip_to_original,
    sgm_text_prefixes, text_from_diffusers,
)
from .unet_keys import EMA_PREFIX, UNET_PREFIX, UNetStructure, ema_key, unet_from_original, unet_to_original
from .vae_keys import (
    TAESD_INDEX_SHIFT, TAESD_PARTS, VAE_PREFIX, taesd_from_original, vae_from_diffusers, vae_from_original,
    vae_to_original,
)

__all__ = [
    "UNET_PREFIX", "VAE_PREFIX", "CLIP_PREFIX", "OPENCLIP_PREFIX", "EMA_PREFIX", "SCHEDULE_BUFFERS",
    "EMBEDDERS_PREFIX", "SDXL_CLIP_PREFIX", "SDXL_OPENCLIP_PREFIX", "sgm_text_prefixes",
    "ConversionError", "Transform", "COPY", "PlanEntry", "ComponentPlan", "CheckpointPlan",
    "ConvertedMapping", "UNetStructure", "ema_key",
    "unet_from_original", "unet_to_original", "vae_from_original", "vae_to_original",
    "clip_from_original", "clip_to_original", "openclip_from_original", "openclip_to_original",
    "plan_from_original", "plan_to_original", "normalize_diffusers_keys", "normalize_bert_keys", "apply_plan",
    "TAESD_PARTS", "TAESD_INDEX_SHIFT", "taesd_from_original",
]

# Training-time buffers of the LDM wrapper: present in most single files, never needed for inference.
SCHEDULE_BUFFERS = frozenset({
    "betas", "alphas_cumprod", "alphas_cumprod_prev", "sqrt_alphas_cumprod", "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod", "sqrt_recip_alphas_cumprod", "sqrt_recipm1_alphas_cumprod",
    "posterior_variance", "posterior_log_variance_clipped", "posterior_mean_coef1", "posterior_mean_coef2",
    "logvar", "lvlb_weights",
    "denoiser.sigmas",  # SGM's discrete denoiser keeps its sigma table as a buffer
})
# The x4 upscaler's noise augmentation (LatentUpscaleDiffusion.low_scale_model) keeps the low-resolution image's DDPM
# schedule as buffers; sdlite takes that schedule from the published low_res_scheduler config.
LOW_SCALE_PREFIX = "low_scale_model."
# Marker tensors some tools add to say how the model was trained (read by detect, dropped here).
MARKER_KEYS = frozenset({"v_pred", "ztsnr"})


# --- diffusers folders -------------------------------------------------------------------------------------


def normalize_diffusers_keys(keys: Iterable[str], component: str, *,
                             expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan from the keys of a diffusers-folder component to canonical names.

    ``component``: ``unet``, ``vae``, ``text_encoder`` or ``text_encoder_2``. Canonical keys map to themselves;
    the legacy VAE attention names ``query/key/value/proj_attn`` become ``to_q/to_k/to_v/to_out.0`` (1x1
    conv-shaped weights made Linear); text-encoder keys saved without the ``text_model.`` level get it;
    ``position_ids`` buffers are ignored.
    """
    if component not in ("unet", "vae", "text_encoder", "text_encoder_2"):
        raise ConversionError(f"unknown component {component!r} (expected unet, vae, text_encoder or "
                              "text_encoder_2)")
    plan = ComponentPlan(component)
    for key in keys:
        target, transform = key, COPY
        if component == "vae":
            target, transform = vae_from_diffusers(key)
        elif component in ("text_encoder", "text_encoder_2"):
            if is_position_ids(key):
                plan.ignored.append(key)
                continue
            target = text_from_diffusers(key)
        add_entry(plan, target, PlanEntry((key,), transform))
    check_expected(plan, expected)
    return plan


# --- whole files -------------------------------------------------------------------------------------------


def _is_file_buffer(key: str) -> bool:
    return key in SCHEDULE_BUFFERS or key in MARKER_KEYS or key.startswith((EMA_PREFIX, LOW_SCALE_PREFIX))


def plan_from_original(keys: Iterable[str], *, unet_structure: UNetStructure | Mapping | None = None,
                       vae_levels: int | None = None, text_encoder_layers: int | None = None,
                       use_ema: bool = False,
                       expected: Mapping[str, Iterable[str]] | None = None) -> CheckpointPlan:
    """Plan the import of a whole original-layout single file (UNet, VAE, text encoder(s), whichever are there).

    An SD 1.x/2.x file has one text encoder (``cond_stage_model.``), an SDXL file (SGM layout) ``text_encoder``
    and/or ``text_encoder_2`` (:func:`sgm_text_prefixes`; bigG keeps all its layers and its projection).
    Structure arguments default to what the keys show. ``expected``: ``{component: canonical keys}`` of the
    models to load, for missing/unexpected reporting (and the OpenCLIP layer count). Schedule buffers
    (``betas``, ``alphas_cumprod`` ...), markers and ``model_ema.*`` copies are ignored and listed in
    ``ignored``; keys outside every known prefix are listed in ``unexpected``.
    """
    keys = list(keys)
    expected = expected or {}
    plan = CheckpointPlan()
    if any(k.startswith(UNET_PREFIX) for k in keys):
        plan.components["unet"] = unet_from_original(keys, unet_structure, use_ema=use_ema,
                                                     expected=expected.get("unet"))
    if any(k.startswith(VAE_PREFIX) for k in keys):
        plan.components["vae"] = vae_from_original(keys, vae_levels, expected=expected.get("vae"))
    has_clip = any(k.startswith(CLIP_PREFIX) for k in keys)
    has_openclip = any(k.startswith(OPENCLIP_PREFIX) for k in keys)
    sgm = sgm_text_prefixes(keys)
    if has_clip and has_openclip:
        raise ConversionError(f"the file has both an OpenAI CLIP ({CLIP_PREFIX!r}) and an OpenCLIP "
                              f"({OPENCLIP_PREFIX!r}) text encoder")
    if sgm and (has_clip or has_openclip):
        raise ConversionError(f"the file has both SD 1.x/2.x ('cond_stage_model.') and SDXL ({EMBEDDERS_PREFIX!r}) "
                              "text encoders")
    if has_clip:
        plan.components["text_encoder"] = clip_from_original(keys, expected=expected.get("text_encoder"))
    elif has_openclip:
        plan.components["text_encoder"] = openclip_from_original(
            keys, num_layers=text_encoder_layers, expected=expected.get("text_encoder"))
    if "text_encoder" in sgm:
        plan.components["text_encoder"] = clip_from_original(keys, prefix=sgm["text_encoder"],
                                                             expected=expected.get("text_encoder"))
    if "text_encoder_2" in sgm:
        plan.components["text_encoder_2"] = openclip_from_original(
            keys, prefix=sgm["text_encoder_2"], component="text_encoder_2", projection=True,
            expected=expected.get("text_encoder_2"))
    prefixes = (UNET_PREFIX, VAE_PREFIX, CLIP_PREFIX, OPENCLIP_PREFIX, *sgm.values())
    for key in keys:
        if key.startswith(prefixes):
            continue
        (plan.ignored if _is_file_buffer(key) else plan.unexpected).append(key)
    for name in expected:
        if name not in plan.components:
            plan.notes.append(f"the file has no {name} (expected by the caller)")
    return plan


def plan_to_original(components: Mapping[str, Iterable[str]], *, text_encoder: str = "clip",
                     unet_structure: UNetStructure | Mapping | None = None,
                     vae_levels: int | None = None) -> CheckpointPlan:
    """Plan the export of canonical components to one original-layout single file.

    ``components``: ``{"unet"|"vae"|"text_encoder"|"text_encoder_2": canonical keys}``. ``text_encoder``:
    ``"clip"`` (SD 1.x, ``cond_stage_model.transformer.``) or ``"openclip"`` (SD 2.x, ``cond_stage_model.model.``).
    With a ``text_encoder_2`` the file is an SDXL one in the SGM layout: ``text_encoder`` (CLIP ViT-L) is
    ``conditioner.embedders.0.transformer.`` and ``text_encoder_2`` (bigG, with its projection) the next embedder,
    ``conditioner.embedders.1.model.`` (``0`` when there is no ``text_encoder``: the refiner). Use
    :meth:`CheckpointPlan.merge` with the components' state dicts to get the lazy original-layout mapping.
    """
    plan = CheckpointPlan()
    sdxl = "text_encoder_2" in components
    for name, keys in components.items():
        if name == "unet":
            plan.components[name] = unet_to_original(keys, unet_structure)
        elif name == "vae":
            plan.components[name] = vae_to_original(keys, vae_levels)
        elif name == "text_encoder" and sdxl:
            plan.components[name] = clip_to_original(keys, prefix=SDXL_CLIP_PREFIX)
        elif name == "text_encoder_2":
            prefix = SDXL_OPENCLIP_PREFIX if "text_encoder" in components else EMBEDDERS_PREFIX + "0.model."
            plan.components[name] = openclip_to_original(keys, prefix=prefix, component=name)
        elif name == "text_encoder":
            if text_encoder == "clip":
                plan.components[name] = clip_to_original(keys)
            elif text_encoder == "openclip":
                plan.components[name] = openclip_to_original(keys)
            else:
                raise ConversionError(f"text_encoder={text_encoder!r}: expected 'clip' or 'openclip'")
        else:
            raise ConversionError(f"unknown component {name!r} (expected unet, vae, text_encoder or text_encoder_2)")
    return plan
