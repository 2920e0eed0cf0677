"""The AUTOMATIC1111 web UI's API contract (``/sdapi/v1``), mapped onto sdlite's :class:`~sdlite.pipeline.Request`.

Everything here is translation, with no model logic: the request schemas and their defaults (A1111's
``StableDiffusionProcessing`` fields and the API's extras), sampler and scheduler names, the options a client can
read and set, base64 images in, and :class:`~sdlite.pipeline.Result` s out as A1111's response JSON (``images``,
``parameters``, and ``info``, a JSON *string*).

Every field accepts ``null`` (meaning its default) and unknown fields are ignored, as A1111's pydantic models do.
Fields sdlite cannot honour are ignored with a warning in ``info["warnings"]`` when they are set to anything but
their default, never silently. ``refiner_checkpoint`` names an SDXL refiner (a checkpoint of ``/sd-models``) that
takes the latents over at ``refiner_switch_at`` (A1111's default 0.8), in text to image only. Two defaults differ
from A1111's on purpose: ``width``/``height`` left out mean the model's native size (A1111: 512, which is SD 1.x's
native size) and, for img2img, the source image's size.
"""
from __future__ import annotations

import base64
import inspect
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import HTTPException
from PIL import Image
from pydantic import BaseModel, ConfigDict

from ... import __version__
from ...images import infotext, parameters_of, parse_infotext, png_bytes
from ...pipeline import MAX_BATCH, MAX_SEED, Request, RequestError, Result, validate
from ...sampling.samplers import SAMPLERS, resolve_sampler
from .controlnet import control_maps, is_controlnet, units_from_scripts
from ..decode import ImageTooLarge, decode_image  # noqa: F401 (re-exported: a1111.decode_image)
from ..limits import Limits, check_request, check_size

# --- requests ----------------------------------------------------------------------------------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class Txt2ImgRequest(_Lenient):
    """``POST /sdapi/v1/txt2img``: A1111's fields; ``None`` (or leaving one out) means the default in DEFAULTS."""

    prompt: str | None = None
    negative_prompt: str | None = None
    styles: list[str] | None = None
    seed: int | None = None
    subseed: int | None = None
    subseed_strength: float | None = None
    seed_resize_from_h: int | None = None
    seed_resize_from_w: int | None = None
    sampler_name: str | None = None
    sampler_index: str | None = None
    scheduler: str | None = None
    batch_size: int | None = None
    n_iter: int | None = None
    steps: int | None = None
    cfg_scale: float | None = None
    # Forge's FLUX.1 dev field (its UI sends it for every model; other models ignore it with a warning)
    distilled_cfg_scale: float | None = None
    width: int | None = None
    height: int | None = None
    restore_faces: bool | None = None
    tiling: bool | None = None
    do_not_save_samples: bool | None = None
    do_not_save_grid: bool | None = None
    eta: float | None = None
    denoising_strength: float | None = None
    s_min_uncond: float | None = None
    s_churn: float | None = None
    s_tmax: float | None = None
    s_tmin: float | None = None
    s_noise: float | None = None
    override_settings: dict[str, Any] | None = None
    override_settings_restore_afterwards: bool | None = None
    refiner_checkpoint: str | None = None
    refiner_switch_at: float | None = None
    disable_extra_networks: bool | None = None
    firstpass_image: str | None = None
    comments: dict | None = None
    enable_hr: bool | None = None
    firstphase_width: int | None = None
    firstphase_height: int | None = None
    hr_scale: float | None = None
    hr_upscaler: str | None = None
    hr_second_pass_steps: int | None = None
    hr_resize_x: int | None = None
    hr_resize_y: int | None = None
    hr_checkpoint_name: str | None = None
    hr_sampler_name: str | None = None
    hr_scheduler: str | None = None
    hr_prompt: str | None = None
    hr_negative_prompt: str | None = None
    hr_cfg: float | None = None
    force_task_id: str | None = None
    script_name: str | None = None
    script_args: list | None = None
    send_images: bool | None = None
    save_images: bool | None = None
    alwayson_scripts: dict | None = None
    infotext: str | None = None
    # sdlite's own extension fields (A1111 has none such): explicit noise levels replacing the sampler's schedule,
    # one list or the other, which sets the steps (Request.timesteps / Request.sigmas)
    sdlite_timesteps: list[float] | None = None
    sdlite_sigmas: list[float] | None = None
    # the step cache (DeepCache; Request.cache_interval / cache_branch): "N" or "N:B" as the CLI's --cache takes it,
    # "on" (3:0), or the interval N as a number; left out or "off": off
    sdlite_cache: str | int | None = None


class Img2ImgRequest(Txt2ImgRequest):
    """``POST /sdapi/v1/img2img``: the txt2img fields plus the source image, mask and inpainting settings."""

    init_images: list[str] | None = None
    resize_mode: int | None = None
    image_cfg_scale: float | None = None
    mask: str | None = None
    mask_blur_x: int | None = None
    mask_blur_y: int | None = None
    mask_blur: int | None = None
    mask_round: bool | None = None
    inpainting_fill: int | None = None
    inpaint_full_res: bool | None = None
    inpaint_full_res_padding: int | None = None
    inpainting_mask_invert: int | None = None
    initial_noise_multiplier: float | None = None
    latent_mask: str | None = None
    include_init_images: bool | None = None
    sdlite_edit: bool | None = None   # sdlite's: an instruction edit, init images as references only (.references)


class ExtrasSingleImageRequest(_Lenient):
    """``POST /sdapi/v1/extra-single-image`` (A1111's ExtrasSingleImageRequest)."""

    image: str | None = None
    resize_mode: int | None = None             # 0: scale by upscaling_resize, 1: to upscaling_resize_w x _h
    show_extras_results: bool | None = None
    gfpgan_visibility: float | None = None
    codeformer_visibility: float | None = None
    codeformer_weight: float | None = None
    upscaling_resize: float | None = None
    upscaling_resize_w: int | None = None
    upscaling_resize_h: int | None = None
    upscaling_crop: bool | None = None
    upscaler_1: str | None = None
    upscaler_2: str | None = None
    extras_upscaler_2_visibility: float | None = None
    upscale_first: bool | None = None


class ExtrasImage(_Lenient):
    data: str | None = None
    name: str | None = None


class ExtrasBatchImagesRequest(ExtrasSingleImageRequest):
    """``POST /sdapi/v1/extra-batch-images``: ``imageList`` of {data, name}."""

    imageList: list[ExtrasImage] | None = None


EXTRAS_DEFAULTS = {"resize_mode": 0, "show_extras_results": True, "gfpgan_visibility": 0.0,
                   "codeformer_visibility": 0.0, "codeformer_weight": 0.0, "upscaling_resize": 2.0,
                   "upscaling_resize_w": 512, "upscaling_resize_h": 512, "upscaling_crop": True,
                   "upscaler_1": "None", "upscaler_2": "None", "extras_upscaler_2_visibility": 0.0,
                   "upscale_first": False}


def extras_plan(req: ExtrasSingleImageRequest, upscaler_dir=None, limits: Limits | None = None):
    """``(Extras, warnings)`` of an extras request, checked (422 on a bad field, the output size within the limits
    when the images are known: :func:`check_extras_size`)."""
    from ...upscalers.extras import Extras, check
    from ...upscalers.registry import UpscalerError

    p = {k: (v if v is not None else EXTRAS_DEFAULTS.get(k)) for k, v in req.model_dump().items()}
    warnings = []
    for name in ("gfpgan_visibility", "codeformer_visibility"):
        if p[name]:
            warnings.append(f"{name}={p[name]!r} was ignored: sdlite has no face restoration")
    if p["resize_mode"] not in (0, 1):
        raise RequestError(f"resize_mode={p['resize_mode']!r} is not valid: 0 (scale by) or 1 (scale to)")
    extras = Extras(upscaler_1=p["upscaler_1"] or "None", upscaler_2=p["upscaler_2"] or "None",
                    visibility_2=p["extras_upscaler_2_visibility"], mode="to" if p["resize_mode"] == 1 else "by",
                    scale=p["upscaling_resize"], width=p["upscaling_resize_w"], height=p["upscaling_resize_h"],
                    crop=bool(p["upscaling_crop"]))
    try:
        return check(extras, upscaler_dir), warnings
    except UpscalerError as e:
        raise RequestError(str(e)) from None


def check_extras_size(image: Image.Image, extras, limits: Limits | None, what: str) -> None:
    """The upscaled image must be within the server's ``max_pixels``."""
    if limits is None:
        return
    if extras.mode == "to":
        width, height = extras.width, extras.height
    else:
        width, height = int(image.width * extras.scale), int(image.height * extras.scale)
    check_size(width, height, limits, f"the upscaled {what}")


class PngInfoRequest(_Lenient):
    image: str | None = None


DEFAULT_REFINER_SWITCH = 0.8   # A1111's "Refiner switch at" when a refiner is named and the switch is not
NO_REFINER = ("", "none")      # refiner_checkpoint values that mean no refiner, compared without case

# A1111's defaults (modules/processing.py and modules/api/models.py). width/height None: see the module docstring.
DEFAULTS: dict[str, Any] = {
    "prompt": "", "negative_prompt": "", "styles": [], "seed": -1, "subseed": -1, "subseed_strength": 0.0,
    "seed_resize_from_h": -1, "seed_resize_from_w": -1, "sampler_name": None, "sampler_index": "Euler",
    "scheduler": None, "batch_size": 1, "n_iter": 1, "steps": 50, "cfg_scale": 7.0, "distilled_cfg_scale": None,
    "width": None, "height": None,
    "restore_faces": False, "tiling": False, "do_not_save_samples": False, "do_not_save_grid": False, "eta": None,
    "denoising_strength": 0.75, "s_min_uncond": 0.0, "s_churn": 0.0, "s_tmax": None, "s_tmin": 0.0,
    "s_noise": 1.0, "override_settings": {}, "override_settings_restore_afterwards": True,
    "refiner_checkpoint": None, "refiner_switch_at": None, "disable_extra_networks": False,
    "firstpass_image": None, "comments": None, "enable_hr": False, "firstphase_width": 0,
    "firstphase_height": 0, "hr_scale": 2.0, "hr_upscaler": None, "hr_second_pass_steps": 0, "hr_resize_x": 0,
    "hr_resize_y": 0, "hr_checkpoint_name": None, "hr_sampler_name": None, "hr_scheduler": None, "hr_prompt": "",
    "hr_negative_prompt": "", "hr_cfg": None, "force_task_id": None, "script_name": None, "script_args": [], "send_images": True,
    "save_images": False, "alwayson_scripts": {}, "infotext": None,
    # img2img
    "init_images": None, "resize_mode": 0, "image_cfg_scale": None, "mask": None, "mask_blur_x": 4,
    "mask_blur_y": 4, "mask_blur": None, "mask_round": True, "inpainting_fill": 0, "inpaint_full_res": True,
    "inpaint_full_res_padding": 0, "inpainting_mask_invert": 0, "initial_noise_multiplier": 1.0,
    "latent_mask": None, "include_init_images": False,
}


def with_defaults(req: Txt2ImgRequest, defaults: dict | None = None) -> dict:
    """The request's fields, each ``None`` replaced by its default: ``defaults``' (a front-end's own, OpenAI's and
    MCP's) where it has one, else A1111's (:data:`DEFAULTS`)."""
    chosen = {**DEFAULTS, **(defaults or {})}
    return {name: (value if value is not None else chosen.get(name)) for name, value in req.model_dump().items()}


# the sampling fields a model family may have settings of its own for (Family.sampling_defaults: FLUX.1's, SD3's and
# Z-Image's model cards): left out of a request, they take the model's, where it has them, when the job runs
FAMILY_FIELDS = ("steps", "cfg_scale", "sampler_name")


def left_out(req: Txt2ImgRequest) -> tuple[str, ...]:
    """Which of :data:`FAMILY_FIELDS` the request leaves out (steps given by ``sdlite_timesteps`` / ``_sigmas`` are
    given; a sampler by ``sampler_name`` or ``sampler_index``)."""
    given = {"steps": req.steps is not None or req.sdlite_timesteps is not None or req.sdlite_sigmas is not None,
             "cfg_scale": req.cfg_scale is not None, "sampler_name": bool(req.sampler_name or req.sampler_index)}
    return tuple(name for name in FAMILY_FIELDS if not given[name])


def model_defaults(plan: "Plan", defaults: dict | None) -> tuple[list[Request], dict]:
    """The plan's requests with the fields its client left out (``plan.unset``) set to the model family's own
    settings ``defaults`` (:attr:`Family.sampling_defaults <sdlite.families.base.Family.sampling_defaults>`; None:
    the family has none, and the plan's, A1111's or the front-end's, stay), and those fields as A1111 names them with
    the values they took (for the response). A sampler left out is the family's with the request's scheduler."""
    if not defaults or not plan.unset:
        return plan.requests, {}
    fields, changes = {}, {}
    if "steps" in plan.unset:
        fields["steps"] = changes["steps"] = int(defaults["steps"])
    if "cfg_scale" in plan.unset:
        fields["cfg_scale"] = changes["cfg_scale"] = float(defaults["cfg"])
    if "sampler_name" in plan.unset:
        choice = resolve_sampler_a1111(defaults["sampler"], plan.parameters.get("scheduler"), [])
        fields["sampler_name"] = choice.name
        changes.update(sampler=choice.sampler, schedule=choice.schedule)
    return [r.replace(**changes) for r in plan.requests], fields


# --- samplers and schedulers -------------------------------------------------------------------------------------

# A1111 sampler name -> (sdlite sampler, aliases, the schedule A1111's "Automatic" scheduler gives it). The
# schedules follow A1111 1.9+ (DPM++ 2M and DPM++ SDE: Karras; DPM++ 2M SDE: Exponential); the others use the
# model's discrete sigmas.
SAMPLERS_A1111: dict[str, tuple[str, list[str], str | None]] = {
    "DPM++ 2M": ("dpmpp_2m", ["k_dpmpp_2m"], "karras"),
    "DPM++ SDE": ("dpmpp_sde", ["k_dpmpp_sde"], "karras"),
    "DPM++ 2M SDE": ("dpmpp_2m_sde", ["k_dpmpp_2m_sde"], "exponential"),
    "Euler a": ("euler_a", ["k_euler_a", "k_euler_ancestral"], None),
    "Euler": ("euler", ["k_euler"], None),
    "LMS": ("lms", ["k_lms"], None),
    "Heun": ("heun", ["k_heun"], None),
    "DDIM": ("ddim", ["ddim"], None),
    "PLMS": ("pndm", ["plms"], None),
    "UniPC": ("unipc", ["unipc"], None),
    "LCM": ("lcm", ["k_lcm"], None),
    "DDPM": ("ddpm", ["ddpm"], None),   # sdlite's own; A1111 has no DDPM sampler
    "TCD": ("tcd", ["tcd"], None),      # the name A1111's and Forge's TCD sampler extensions give it
    "Res Multistep": ("res_multistep", ["res_multistep"], None),   # ComfyUI's samplers; A1111 has neither
    "Res Multistep Ancestral": ("res_multistep_ancestral", ["res_multistep_ancestral"], None),
}
_A1111_BY_SDLITE = {sampler: name for name, (sampler, _, _) in SAMPLERS_A1111.items()}

# A1111 scheduler name -> (label, sdlite schedule); None: the sampler's automatic choice. "uniform" and "normal"
# are both timesteps spread evenly over the training range: sdlite's discrete sigmas (the model's own spacing).
SCHEDULERS_A1111: dict[str, tuple[str, str | None]] = {
    "automatic": ("Automatic", None),
    "uniform": ("Uniform", "discrete"),
    "karras": ("Karras", "karras"),
    "exponential": ("Exponential", "exponential"),
    "normal": ("Normal", "discrete"),
}
# A1111 schedulers sdlite does not have: asked for, they fall back to Automatic with a warning
OTHER_A1111_SCHEDULERS = {"polyexponential": "Polyexponential", "sgm_uniform": "SGM Uniform",
                          "kl_optimal": "KL Optimal", "align_your_steps": "Align Your Steps", "simple": "Simple",
                          "ddim": "DDIM", "beta": "Beta"}


def samplers_list() -> list[dict]:
    """``/sdapi/v1/samplers``."""
    return [{"name": name, "aliases": aliases, "options": {"scheduler": default} if default else {}}
            for name, (_, aliases, default) in SAMPLERS_A1111.items()]


def schedulers_list() -> list[dict]:
    """``/sdapi/v1/schedulers``."""
    return [{"name": name, "label": label, "aliases": None, "default_rho": 7.0 if name == "karras" else None,
             "need_inner_model": False} for name, (label, _) in SCHEDULERS_A1111.items()]


@dataclass(frozen=True)
class SamplerChoice:
    sampler: str           # sdlite's name
    schedule: str          # sdlite's sigma schedule
    name: str              # A1111's sampler name
    scheduler: str         # A1111's scheduler label


def _scheduler_key(text: str) -> str | None:
    t = text.strip().lower().replace(" ", "_")
    for name, (label, _) in SCHEDULERS_A1111.items():
        if t in (name, label.lower().replace(" ", "_")):
            return name
    for name, label in OTHER_A1111_SCHEDULERS.items():
        if t in (name, label.lower().replace(" ", "_"), "sgmuniform"):
            return name
    return None


def _valid_samplers() -> str:
    return (f"{', '.join(SAMPLERS_A1111)} (optionally followed by a scheduler: ' Karras', ' Exponential'), "
            f"or sdlite's names {', '.join(SAMPLERS)}")


def resolve_sampler_a1111(name: str, scheduler: str | None, warnings: list[str]) -> SamplerChoice:
    """A1111's rule (``sd_samplers.get_sampler_and_scheduler``): a scheduler named at the end of the sampler name
    (``"DPM++ 2M Karras"``) wins over the ``scheduler`` field; "Automatic" is the sampler's own default. sdlite's
    names (``dpmpp_2m_karras``) work too. An unknown sampler or scheduler raises :class:`RequestError`."""
    text = name.strip()
    chosen = None
    if scheduler not in (None, ""):
        chosen = _scheduler_key(scheduler)
        if chosen is None:
            raise RequestError(f"scheduler {scheduler!r} is not known; valid: "
                               f"{', '.join(label for label, _ in SCHEDULERS_A1111.values())}")
    lowered = {n.lower(): n for n in SAMPLERS_A1111}
    for alias_name, (_, aliases, _) in SAMPLERS_A1111.items():
        lowered.update({a.lower(): alias_name for a in aliases})
    base = lowered.get(text.lower())
    if base is None:   # a scheduler at the end of the name
        for key, label in [(k, lb) for k, (lb, _) in SCHEDULERS_A1111.items()] + list(OTHER_A1111_SCHEDULERS.items()):
            for suffix in {label, key}:
                if text.lower().endswith(" " + suffix.lower()) and text[: -len(suffix) - 1].lower() in lowered:
                    base, chosen = lowered[text[: -len(suffix) - 1].lower()], key
                    break
            if base is not None:
                break
    if base is None:   # sdlite's own names
        try:
            sampler, implied = resolve_sampler(text)
        except ValueError:
            raise RequestError(f"sampler {name!r} is not known; valid: {_valid_samplers()}") from None
        base = _A1111_BY_SDLITE[sampler]
        if chosen is None and implied != SAMPLERS[sampler].schedule:
            chosen = implied
    sampler, _, automatic = SAMPLERS_A1111[base]
    if chosen in OTHER_A1111_SCHEDULERS:
        warnings.append(f"scheduler {OTHER_A1111_SCHEDULERS[chosen]!r} is not available in sdlite: used Automatic "
                        f"(available: {', '.join(label for label, _ in SCHEDULERS_A1111.values())})")
        chosen = None
    if chosen in (None, "automatic") or chosen == automatic:   # A1111 reports a sampler's own default as Automatic
        return SamplerChoice(sampler, automatic or SAMPLERS[sampler].schedule, base, "Automatic")
    label, schedule = SCHEDULERS_A1111[chosen]
    return SamplerChoice(sampler, schedule, base, label)


def _eta_default(sampler: str) -> float | None:
    param = inspect.signature(SAMPLERS[sampler].fn).parameters.get("eta")
    return None if param is None else float(param.default)


# --- options -----------------------------------------------------------------------------------------------------

PREVIEW_TYPES = ("Auto", "Full", "Approx cheap", "TAESD")   # "TAESD": the server's --taesd decoder, else Approx cheap
AUTO_FULL_PREVIEW_PIXELS = 256 * 256   # "Auto": a VAE decode up to this size, the cheap approximation above


def default_options() -> dict:
    """The options ``/sdapi/v1/options`` reports before a client changes any (``sd_model_checkpoint`` and
    ``sd_checkpoint_hash`` are filled in by the server)."""
    return {"sd_model_checkpoint": None, "sd_checkpoint_hash": None, "CLIP_stop_at_last_layers": 1,
            "eta_ddim": 0.0, "eta_ancestral": 1.0, "show_progress_every_n_steps": 10,
            "show_progress_type": "Auto", "live_previews_enable": True, "sd_checkpoints_limit": 1,
            "samples_format": "png", "sd_vae": "Automatic", "face_restoration": False, "randn_source": "CPU",
            "control_net_no_detectmap": False,
            # Forge's: clients (SillyTavern) tell Forge by forge_preset; its additional modules are VAE files here
            "forge_preset": "all", "forge_additional_modules": []}


def _int_at_least(low: int):
    def check(key, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise RequestError(f"option {key}={value!r} is not valid: it must be an integer of at least {low}")
        return value
    return check


def _unit_float(key, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise RequestError(f"option {key}={value!r} is not valid: it must be a number from 0 to 1")
    return float(value)


def _one_of(*choices):
    def check(key, value):
        if value not in choices:
            raise RequestError(f"option {key}={value!r} is not supported: expected one of "
                               f"{', '.join(map(repr, choices))}")
        return value
    return check


def _steps_period(key, value):
    if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1:
        raise RequestError(f"option {key}={value!r} is not valid: a number of steps of at least 1, or -1 "
                           "(a preview only at the end)")
    return value


def _text(key, value):
    if not isinstance(value, str):
        raise RequestError(f"option {key}={value!r} is not valid: expected a string")
    return value


def _texts(key, value):
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(f"option {key}={value!r} is not valid: expected a list of strings (file names)")
    return value


def _bool(key, value):
    if not isinstance(value, bool):
        raise RequestError(f"option {key}={value!r} is not valid: expected true or false")
    return value


# the options sdlite acts on, each with its check; any other option is stored and reported back, nothing more
OPTION_CHECKS = {
    "CLIP_stop_at_last_layers": _int_at_least(1), "eta_ddim": _unit_float, "eta_ancestral": _unit_float,
    "show_progress_every_n_steps": _steps_period, "show_progress_type": _one_of(*PREVIEW_TYPES),
    "live_previews_enable": _bool, "sd_checkpoints_limit": _int_at_least(1), "samples_format": _one_of("png"),
    "sd_vae": _text, "face_restoration": _one_of(False), "control_net_no_detectmap": _bool,
    "forge_preset": _text, "forge_additional_modules": _texts,
}
REQUEST_OPTIONS = ("sd_model_checkpoint", "CLIP_stop_at_last_layers", "eta_ddim", "eta_ancestral", "sd_vae",
                   "forge_additional_modules")


def check_options(changes: dict) -> dict:
    """Checked option values (``sd_model_checkpoint`` is the server's to check)."""
    return {k: OPTION_CHECKS[k](k, v) if k in OPTION_CHECKS else v for k, v in changes.items()}


# --- VAE files (sd_vae, Forge's additional modules) ---------------------------------------------------------------

VAE_SUFFIXES = (".safetensors", ".sft", ".pt", ".ckpt", ".bin", ".gguf")
OWN_VAE = ("automatic", "none", "")   # sd_vae values meaning the checkpoint's own VAE


def list_vaes(vae_dir) -> list[dict]:
    """The VAE files of ``vae_dir`` (and below) as A1111's ``/sd-vae`` lists them: ``model_name`` the path relative
    to the folder, ``filename`` the full path."""
    if vae_dir is None or not Path(vae_dir).is_dir():
        return []
    root = Path(vae_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in VAE_SUFFIXES)
    return [{"model_name": p.relative_to(root).as_posix(), "filename": str(p)} for p in files]


def find_vae(name: str, vae_dir, field: str = "sd_vae") -> str | None:
    """The VAE file ``name`` means (its relative path, file name, stem or full path, without case); None for the
    model's own ("Automatic", "None"). Raises RequestError naming the field when there is none such."""
    if name.strip().lower() in OWN_VAE:
        return None
    wanted = name.strip().lower()
    vaes = list_vaes(vae_dir)
    for vae in vaes:
        path = Path(vae["filename"])
        if wanted in (vae["model_name"].lower(), path.name.lower(), path.stem.lower(), vae["filename"].lower()):
            return vae["filename"]
    where = "no VAE folder (sdlite serve --vae-dir DIR)" if vae_dir is None else \
        f"available: {', '.join(v['model_name'] for v in vaes) or 'none'} (in {vae_dir})"
    raise RequestError(f"{field}={name!r}: no such VAE file; \"Automatic\" or \"None\" is the model's own; {where}")


def chosen_vae(opts: dict, vae_dir) -> str | None:
    """The VAE file the options choose: Forge's ``forge_additional_modules`` (when not empty: one VAE file) or
    else ``sd_vae``; None for the model's own."""
    modules = opts.get("forge_additional_modules") or []
    if modules:
        found = [find_vae(m, vae_dir, "forge_additional_modules") for m in modules]
        vaes = sorted({f for f in found if f is not None})
        if len(vaes) > 1:
            raise RequestError(f"forge_additional_modules names {len(vaes)} VAE files: a model takes one")
        return vaes[0] if vaes else None
    return find_vae(str(opts.get("sd_vae") or "Automatic"), vae_dir)


# --- A1111 request -> sdlite requests ----------------------------------------------------------------------------

RESIZE_MODES = {0: "just-resize", 1: "crop", 2: "fill"}
INPAINT_FILLS = {0: "fill", 1: "original", 2: "latent-noise", 3: "latent-nothing"}


@dataclass
class Plan:
    """One A1111 request, ready for the queue: ``requests`` holds one sdlite Request per iteration (``n_iter``),
    each of ``batch_size`` images, with consecutive seeds across them, as A1111 numbers them."""

    kind: str                          # txt2img | img2img
    requests: list[Request]
    parameters: dict                   # the A1111 request after defaults: the response's "parameters"
    sampler: SamplerChoice
    checkpoint: str | None             # override_settings' sd_model_checkpoint; None: the current model
    refiner_name: str | None = None    # refiner_checkpoint as the client named it; None: no refiner
    refiner: Any = None                # the Checkpoint it names, resolved by the routes (ServerBase.find_checkpoint)
    refiner_switch_at: float | None = None
    hr_checkpoint_name: str | None = None  # hr_checkpoint_name as the client named it; None: the same model
    hr_checkpoint: Any = None          # the Checkpoint it names, resolved by the routes
    upscaler_dir: Any = None           # where the hires fix finds upscaler networks by name
    limits: Limits | None = None       # the server's, for what only the model tells (its native size)
    keep_overrides: dict = field(default_factory=dict)  # override_settings to keep (restore_afterwards false)
    warnings: list[str] = field(default_factory=list)
    send_images: bool = True
    preview: str = "Auto"
    control_maps: tuple = ()           # per ControlNet unit: its control map goes back after the images
    vae: str | None = None             # a VAE file in place of the model's own (sd_vae); None: its own
    unset: tuple = ()                  # FAMILY_FIELDS the client left out: the model family's own where it has them
    # every init image (img2img): reference images where the model edits from them (.references); the
    # front-end's way: "a1111" (init_images[0] also the init image), "edit" (references only, from noise),
    # "required" (references only; a model without reference editing is refused)
    references: tuple = ()
    reference_mode: str = "a1111"


def _ignored(p: dict, img2img: bool) -> list[str]:
    """Warnings for fields sdlite does not honour, each set to something else than its default."""
    out = []

    def off(name, what, *defaults):
        value = p.get(name)
        if value not in (None, *defaults):
            out.append(f"{name}={value!r} was ignored: {what}")

    off("restore_faces", "sdlite has no face restoration", False)
    off("tiling", "sdlite has no seamless tiling", False)
    off("subseed_strength", "variation seeds are not supported", 0, 0.0)
    if p["seed_resize_from_w"] > 0 or p["seed_resize_from_h"] > 0:
        out.append("seed_resize_from_w/h were ignored: seed resizing is not supported")
    off("styles", "sdlite has no prompt styles (/sdapi/v1/prompt-styles is empty)", [])
    off("s_churn", "sampler churn is not supported", 0, 0.0)
    off("s_tmin", "sampler churn is not supported", 0, 0.0)
    off("s_tmax", "sampler churn is not supported", 0, 0.0, float("inf"))
    off("s_noise", "sampler noise scaling is not supported", 1, 1.0)
    off("s_min_uncond", "negative-guidance skipping is not supported", 0, 0.0)
    off("firstpass_image", "hires fix first-pass images are not supported")
    off("disable_extra_networks", "<lora:...> tags are always applied", False)
    off("infotext", "filling fields from an infotext is not supported")
    off("save_images", "the server does not save images; they are returned in the response", False)
    others = [name for name in (p["alwayson_scripts"] or {}) if not is_controlnet(name)]
    if others:   # ControlNet's units are read by build_plan (.controlnet)
        out.append(f"alwayson_scripts {', '.join(others)} {'was' if len(others) == 1 else 'were'} ignored: sdlite "
                   "runs no scripts; of the extensions' arguments it takes ControlNet units only")
    if img2img:
        off("initial_noise_multiplier", "the noise multiplier is not supported", 1, 1.0)
        off("latent_mask", "separate latent masks are not supported")
        off("mask_round", "masks are always thresholded", True)
        if p["resize_mode"] == 3:
            out.append("resize_mode=3 (latent upscale) is not supported: used 0 (just resize)")
        if p["mask_blur"] is None and p["mask_blur_x"] != p["mask_blur_y"]:
            out.append(f"mask_blur_y={p['mask_blur_y']} was ignored: one blur radius is used "
                       f"(mask_blur_x={p['mask_blur_x']})")
    return out


def hires_fields(p: dict, sampler: SamplerChoice, warnings: list[str], upscaler_dir=None):
    """The :class:`~sdlite.hires.Hires` of ``enable_hr`` and the ``hr_*`` fields (A1111's rules: the second pass's
    sampler and scheduler default to the first's, "Use same ..." and empty names mean the same; the legacy
    ``firstphase_width``/``_height`` make width/height the target). None without ``enable_hr``."""
    from ...hires import DEFAULT_UPSCALER, LATENT_MODES, SAME, Hires
    from ...upscalers.registry import UpscalerError, resolve

    if not p["enable_hr"]:
        return None
    upscaler = p["hr_upscaler"] or DEFAULT_UPSCALER
    if upscaler not in LATENT_MODES:
        try:
            resolve(upscaler, upscaler_dir)
        except UpscalerError as e:
            raise RequestError(f"hr_upscaler: {e}; latent modes: {', '.join(LATENT_MODES)}") from None

    def named(value):
        return None if value is None or (isinstance(value, str) and value.strip().lower() in SAME) else value

    hr_sampler, hr_scheduler = named(p["hr_sampler_name"]), named(p["hr_scheduler"])
    choice = None
    if hr_sampler is not None or hr_scheduler is not None:
        choice = resolve_sampler_a1111(hr_sampler or p["sampler_name"] or p["sampler_index"] or "Euler",
                                       hr_scheduler if hr_scheduler is not None else p["scheduler"], warnings)
    for name in ("hr_scale", "denoising_strength"):
        if not isinstance(p[name], (int, float)) or isinstance(p[name], bool):
            raise RequestError(f"{name}={p[name]!r} is not valid: expected a number")
    resize_x, resize_y = p["hr_resize_x"], p["hr_resize_y"]
    if p["firstphase_width"] or p["firstphase_height"]:   # A1111's old hires fix: width/height are the target
        resize_x, resize_y = p["width"] or 0, p["height"] or 0
    return Hires(scale=float(p["hr_scale"]), resize_x=resize_x, resize_y=resize_y, upscaler=upscaler,
                 steps=p["hr_second_pass_steps"], denoise=p["denoising_strength"],
                 sampler=None if choice is None else choice.sampler,
                 schedule=None if choice is None else choice.schedule, cfg_scale=p["hr_cfg"],
                 prompt=p["hr_prompt"] or None, negative_prompt=p["hr_negative_prompt"] or None)


def _int_field(p: dict, name: str, low: int, high: int | None = None) -> int:
    value = p[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise RequestError(f"{name}={value!r} is not valid: it must be an integer {span}")
    return value


def _cache_fields(value) -> dict:
    """``sdlite_cache`` as the Request's step cache fields (nothing when it is left out)."""
    from ...engine.stepcache import StepCacheError, parse

    if value is None:
        return {}
    if isinstance(value, bool):
        raise RequestError(f"sdlite_cache={value!r} is not valid: expected \"N\" or \"N:B\" (e.g. \"3:0\"), "
                           "a number N, \"on\" or \"off\"")
    try:
        interval, branch = parse(str(value))
    except StepCacheError as e:
        raise RequestError(f"sdlite_cache: {e}") from None
    return {"cache_interval": interval, "cache_branch": branch}


def build_plan(req: Txt2ImgRequest, options: dict, *, max_image_bytes: int, lora_dir=None,
               embeddings_dir=None, limits: Limits | None = None, upscaler_dir=None, controlnets=None,
               vae_dir=None, defaults: dict | None = None) -> Plan:
    """Check an A1111 request and turn it into sdlite Requests (images decoded, names resolved). ``limits`` (the
    server's; None: none, as for ``sdlite batch``) are checked first, before anything costly. ``controlnets``: the
    :class:`~.controlnet.ControlNets` that ``alwayson_scripts`` ControlNet units name (None: none); ``vae_dir``: the
    VAE files ``sd_vae`` names (:func:`chosen_vae`; None: none, only the model's own); ``defaults``: a front-end's own
    defaults for fields left out, in place of A1111's (:func:`with_defaults`). Of :data:`FAMILY_FIELDS` those left
    out are recorded (``Plan.unset``): a model family with settings of its own replaces them when the job runs
    (:func:`model_defaults`). Raises
    :class:`RequestError` (422; :class:`~.limits.LimitExceeded` over a limit, :class:`~.controlnet.ControlNetNotFound`
    404), :class:`ImageTooLarge` (413) or HTTPException (404: no init image, 422: unknown script)."""
    img2img = isinstance(req, Img2ImgRequest)
    p = with_defaults(req, defaults)
    if limits is not None:   # steps left out are the model family's where it has some: checked when the job runs
        check_request({**p, "steps": None} if "steps" in left_out(req) else p, limits)
    warnings = _ignored(p, img2img)
    if p["script_name"] not in (None, ""):
        raise HTTPException(422, f"Script '{p['script_name']}' not found: sdlite has no scripts")
    overrides = dict(p["override_settings"] or {})
    ignored = sorted(k for k in overrides if k not in REQUEST_OPTIONS and overrides[k] != options.get(k))
    if ignored:
        warnings.append(f"override_settings {', '.join(ignored)} were ignored: per request sdlite applies "
                        f"{', '.join(REQUEST_OPTIONS)}")
    for key in REQUEST_OPTIONS[1:]:
        if key in overrides:
            overrides[key] = OPTION_CHECKS[key](key, overrides[key])
    opts = {**options, **{k: v for k, v in overrides.items() if k in REQUEST_OPTIONS}}
    vae = chosen_vae(opts, vae_dir)

    sampler = resolve_sampler_a1111(p["sampler_name"] or p["sampler_index"] or "Euler", p["scheduler"], warnings)
    # TCD's gamma is no A1111 option: the request's eta, else the sampler's own default
    eta_option = {"ddim": "eta_ddim", "tcd": None}.get(sampler.sampler, "eta_ancestral")
    eta = p["eta"] if p["eta"] is not None else opts[eta_option] if eta_option else None
    default_eta = _eta_default(sampler.sampler)
    eta = None if default_eta is None or eta is None or float(eta) == default_eta else float(eta)

    batch = _int_field(p, "batch_size", 1, MAX_BATCH)
    n_iter = _int_field(p, "n_iter", 1, 100)
    seed = p["seed"]
    if seed == -1:
        seed = random.SystemRandom().randrange(0, MAX_SEED - batch * n_iter)
    elif isinstance(seed, int) and (seed < 0 or seed + batch * n_iter - 1 > MAX_SEED):
        raise RequestError(f"seed {seed} is not valid: it must be -1 (random) or 0..{MAX_SEED} with room for the "
                           f"{batch * n_iter} images")
    common = dict(prompt=p["prompt"], negative_prompt=p["negative_prompt"], width=p["width"], height=p["height"],
                  steps=p["steps"], cfg_scale=p["cfg_scale"], guidance=p["distilled_cfg_scale"],
                  sampler=sampler.sampler, schedule=sampler.schedule,
                  timesteps=p["sdlite_timesteps"], sigmas=p["sdlite_sigmas"],
                  batch_size=batch, clip_skip=opts["CLIP_stop_at_last_layers"], eta=eta, lora_dir=lora_dir,
                  embeddings_dir=embeddings_dir, **_cache_fields(p["sdlite_cache"]))
    refiner, switch = _refiner_fields(p, img2img)
    hr_checkpoint = None
    if img2img:
        if p["enable_hr"]:
            warnings.append("enable_hr=True was ignored: the hires fix is a txt2img option")
    else:
        common["hires"] = hires_fields(p, sampler, warnings, upscaler_dir)
        if common["hires"] is not None and (p["firstphase_width"] or p["firstphase_height"]):
            common["width"], common["height"] = p["firstphase_width"] or None, p["firstphase_height"] or None
        if common["hires"] is not None:
            hr_checkpoint = named_checkpoint(p["hr_checkpoint_name"])
    if img2img:
        common.update(_image_fields(p, max_image_bytes, warnings))
        references = (common["init_image"], *(decode_image(b, f"init_images[{i}]", max_image_bytes)
                                                for i, b in enumerate(p["init_images"][1:], 1)))
        source = common["init_image"]   # no size given: the source's, rounded down to a multiple of 8
        if limits is not None:
            check_size(p["width"] or max(8, source.width // 8 * 8), p["height"] or max(8, source.height // 8 * 8),
                       limits, "width x height (of init_images[0] where not given)")
    references = () if not img2img else references
    saves: list[bool] = []
    common["controls"] = units_from_scripts(p["alwayson_scripts"], controlnets=controlnets, img2img=img2img,
                                            img2img_resize_mode=p.get("resize_mode", 0),
                                            max_image_bytes=max_image_bytes, warnings=warnings, saves=saves)
    if opts.get("control_net_no_detectmap"):
        saves = [False] * len(saves)
    requests = [Request(seed=seed + i * batch, refiner_switch_at=switch, **common) for i in range(n_iter)]
    validate(requests[0])   # everything that can be checked without the model, before the job is queued

    parameters = dict(p, **({"refiner_switch_at": switch} if refiner else {}))
    if img2img and not p["include_init_images"]:
        parameters["init_images"], parameters["mask"] = None, None
    return Plan(kind="img2img" if img2img else "txt2img", requests=requests, parameters=parameters,
                sampler=sampler, checkpoint=overrides.get("sd_model_checkpoint"), refiner_name=refiner,
                refiner_switch_at=switch, hr_checkpoint_name=hr_checkpoint, upscaler_dir=upscaler_dir, limits=limits,
                keep_overrides={} if p["override_settings_restore_afterwards"] else overrides,
                warnings=warnings, send_images=bool(p["send_images"]), preview=opts["show_progress_type"],
                control_maps=tuple(saves), vae=vae, unset=left_out(req), references=references,
                reference_mode="required" if img2img and p.get("sdlite_edit") else "a1111")


def named_checkpoint(name) -> str | None:
    """``hr_checkpoint_name``: None for "Use same checkpoint", "" and None, else the name."""
    if name is None or (isinstance(name, str) and name.strip().lower() in ("", "use same checkpoint")):
        return None
    return name


def _refiner_fields(p: dict, img2img: bool) -> tuple[str | None, float | None]:
    """``(refiner name, switch)`` of ``refiner_checkpoint`` and ``refiner_switch_at``; ``(None, None)`` without a
    refiner ("None" or "" name none, as in A1111; the switch alone then does nothing, as in A1111)."""
    name = p["refiner_checkpoint"]
    if name is None or name.strip().lower() in NO_REFINER:
        return None, None
    if img2img:
        raise RequestError(f"refiner_checkpoint={name!r} is not supported for img2img: sdlite hands the latents "
                           "over to a refiner in text to image only. To refine an image, run img2img with the "
                           "refiner as the model (override_settings: {\"sd_model_checkpoint\": ...})")
    switch = p["refiner_switch_at"]
    if switch is None:
        switch = DEFAULT_REFINER_SWITCH
    if not (math.isfinite(switch) and 0.0 < switch < 1.0):
        raise RequestError(f"refiner_switch_at={switch!r} is not valid: it must be above 0 and below 1 (the fraction "
                           f"of the steps the base model runs before {name!r} takes over; A1111's default "
                           f"{DEFAULT_REFINER_SWITCH})")
    return name, float(switch)


def _image_fields(p: dict, max_bytes: int, warnings: list[str]) -> dict:
    if not p["init_images"]:
        raise HTTPException(404, "Init image not found")
    if len(p["init_images"]) > 1:
        warnings.append(f"init_images: {len(p['init_images'])} images were sent; sdlite uses the first for the "
                        "whole batch")
    image = decode_image(p["init_images"][0], "init_images[0]", max_bytes)
    mask = decode_image(p["mask"], "mask", max_bytes) if p["mask"] else None
    if p["resize_mode"] not in (*RESIZE_MODES, 3):
        raise RequestError(f"resize_mode={p['resize_mode']!r} is not valid: 0 just resize, 1 crop and resize, "
                           "2 resize and fill")
    if p["inpainting_fill"] not in INPAINT_FILLS:
        raise RequestError(f"inpainting_fill={p['inpainting_fill']!r} is not valid: 0 fill, 1 original, "
                           "2 latent noise, 3 latent nothing")
    if p["inpainting_mask_invert"] not in (0, 1, False, True):
        raise RequestError(f"inpainting_mask_invert={p['inpainting_mask_invert']!r} is not valid: 0 or 1")
    strength = p["denoising_strength"]
    return dict(init_image=image, mask=mask, strength=strength,
                mask_blur=p["mask_blur"] if p["mask_blur"] is not None else p["mask_blur_x"],
                inpaint_fill=INPAINT_FILLS[p["inpainting_fill"]] if mask is not None else None,
                invert_mask=bool(p["inpainting_mask_invert"]),
                inpaint_area="masked" if p["inpaint_full_res"] else "whole",
                inpaint_padding=p["inpaint_full_res_padding"], resize_mode=RESIZE_MODES.get(p["resize_mode"],
                                                                                           "just-resize"))


# --- sdlite results -> A1111 response ----------------------------------------------------------------------------

# infotext fields A1111 keeps outside extra_generation_params
_MAIN_FIELDS = {"Steps", "Sampler", "CFG scale", "Seed", "Size", "Model hash", "Model", "Clip skip", "Version"}


@dataclass
class Outcome:
    """What a finished job hands back: the results of the iterations run and the model that ran them."""

    results: list[Result]
    model_name: str            # the infotext's "Model" (file stem or folder name)
    model_hash: str
    inpainting_model: bool
    job_timestamp: str = ""
    interrupted: bool = False
    infotext: dict = field(default_factory=dict)   # more fields for every image ("Refiner", "Refiner switch at")
    warnings: list = field(default_factory=list)   # the server's own (a job time limit, a shutdown)
    defaulted: dict = field(default_factory=dict)  # A1111 fields the model family set (model_defaults)


def response(plan: Plan, outcome: Outcome) -> dict:
    """A1111's txt2img / img2img response: ``images`` (base64 PNGs, each with its ``parameters`` chunk),
    ``parameters`` and ``info`` (a JSON string)."""
    images, infotexts, seeds, warnings = [], [], [], list(plan.warnings)
    for result in outcome.results:
        for image, seed in zip(result.images, result.seeds):
            text = infotext(result.request, seed, outcome.model_hash, outcome.model_name,
                            {**result.infotext, **outcome.infotext})
            infotexts.append(text)
            seeds.append(seed)
            if plan.send_images:
                images.append(base64.b64encode(png_bytes(image, text)).decode("ascii"))
        warnings += [w for w in result.warnings if w not in warnings]
    warnings += [w for w in outcome.warnings if w not in warnings]
    if plan.send_images and outcome.results and any(plan.control_maps):   # after the images, as the extension
        for image in control_maps(outcome.results[0], plan.control_maps):
            images.append(base64.b64encode(png_bytes(image)).decode("ascii"))
    if outcome.interrupted and len(outcome.results) < len(plan.requests):
        warnings.append(f"interrupted: {len(outcome.results)} of {len(plan.requests)} iterations were run")
    used = outcome.results[0].request if outcome.results else plan.requests[0]
    if not seeds:
        seeds = [r.seed + i for r in plan.requests for i in range(r.batch_size)]
    extra = {}
    if infotexts:
        extra = {k: v for k, v in parse_infotext(infotexts[0]).items() if k[:1].isupper() and k not in _MAIN_FIELDS}
        extra.update(outcome.infotext)   # as A1111 holds them: "Refiner switch at" a number
    parameters = dict(plan.parameters, width=used.width, height=used.height, **outcome.defaulted)
    count = len(seeds)
    p = plan.parameters
    sampler = plan.sampler if "sampler_name" not in outcome.defaulted else \
        resolve_sampler_a1111(outcome.defaulted["sampler_name"], p["scheduler"], [])
    info = {
        "prompt": p["prompt"], "all_prompts": [p["prompt"]] * count,
        "negative_prompt": p["negative_prompt"], "all_negative_prompts": [p["negative_prompt"]] * count,
        "seed": seeds[0], "all_seeds": seeds, "subseed": p["subseed"], "all_subseeds": [p["subseed"]] * count,
        "subseed_strength": p["subseed_strength"], "width": used.width, "height": used.height,
        "sampler_name": sampler.name, "scheduler": sampler.scheduler, "cfg_scale": used.cfg_scale,
        "steps": used.steps, "batch_size": used.batch_size, "restore_faces": False, "face_restoration_model": None,
        "sd_model_name": outcome.model_name, "sd_model_hash": outcome.model_hash,
        "sd_vae_name": Path(plan.vae).name if plan.vae else None,
        "sd_vae_hash": None, "seed_resize_from_w": p["seed_resize_from_w"], "seed_resize_from_h": p["seed_resize_from_h"],
        "denoising_strength": p["denoising_strength"], "extra_generation_params": extra, "index_of_first_image": 0,
        "infotexts": infotexts, "styles": p["styles"], "job_timestamp": outcome.job_timestamp,
        "clip_skip": used.clip_skip,
        "is_using_inpainting_conditioning": outcome.inpainting_model, "version": f"sdlite {__version__}",
        "warnings": warnings,
    }
    return {"images": images, "parameters": parameters, "info": json.dumps(info, ensure_ascii=False)}


def png_info(image: Image.Image) -> dict:
    """``/sdapi/v1/png-info``: the ``parameters`` text, the image's other text items, and the parsed fields."""
    text = parameters_of(image) or ""
    items = {k: v for k, v in image.info.items() if isinstance(k, str) and isinstance(v, (str, int, float))
             and k != "parameters"}
    parameters = {}
    if text:
        parsed = parse_infotext(text)
        parameters = {"Prompt": parsed["prompt"], "Negative prompt": parsed["negative_prompt"],
                      **{k: v for k, v in parsed.items() if k[:1].isupper()}}
    return {"info": text, "items": items, "parameters": parameters}
