"""A1111's "Extras" upscale (``scripts/postprocessing_upscale.py``), shared by ``sdlite upscale`` and the server's
``/sdapi/v1/extra-single-image`` and ``/extra-batch-images``.

An image is upscaled by ``upscaler_1`` either by a factor ("Scale by", ``mode="by"``) or to a size ("Scale to",
``mode="to"``: the factor that covers the size, then, with ``crop``, the centre cut to it); a second upscaler may be
blended in at ``visibility_2``. The target of a factor is rounded down to a multiple of 8, as A1111's
``Upscaler.upscale`` does. The fields it records ("Postprocess upscale by" or "Postprocess upscale to",
"Postprocess crop to", "Postprocess upscaler", "Postprocess upscaler 2") are A1111's; an image's own generation
parameters are kept and the fields added to them.
"""
from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from ..images import quote_value
from .registry import UpscalerError, resolve, upscale_to

MAX_SCALE = 8.0


@dataclass(frozen=True)
class Extras:
    upscaler_1: str = "None"
    upscaler_2: str = "None"
    visibility_2: float = 0.0        # extras_upscaler_2_visibility
    mode: str = "by"                 # by (upscaling_resize) | to (upscaling_resize_w/_h)
    scale: float = 2.0               # upscaling_resize
    width: int = 512                 # upscaling_resize_w
    height: int = 512                # upscaling_resize_h
    crop: bool = True                # upscaling_crop


def check(extras: Extras, folder=None) -> Extras:
    """Each option checked (an :class:`UpscalerError` names the bad one); the upscaler names resolved."""
    e = extras
    if e.mode not in ("by", "to"):
        raise UpscalerError(f"resize mode {e.mode!r} is not valid: 0 (scale by) or 1 (scale to)")
    if e.mode == "by" and (isinstance(e.scale, bool) or not isinstance(e.scale, (int, float))
                           or not 1.0 <= e.scale <= MAX_SCALE):
        raise UpscalerError(f"upscaling_resize {e.scale!r} is not valid: a factor from 1 to {MAX_SCALE:g}")
    if e.mode == "to":
        for name, value in (("upscaling_resize_w", e.width), ("upscaling_resize_h", e.height)):
            if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= 8192:
                raise UpscalerError(f"{name} {value!r} is not valid: pixels from 8 to 8192")
    if isinstance(e.visibility_2, bool) or not isinstance(e.visibility_2, (int, float)) \
            or not 0.0 <= e.visibility_2 <= 1.0:
        raise UpscalerError(f"extras_upscaler_2_visibility {e.visibility_2!r} is not valid: from 0 to 1")
    for value in (e.upscaler_1, e.upscaler_2):
        resolve(value, folder)
    return e


def _name(value, folder) -> str:
    found = resolve(value, folder)
    return found if isinstance(found, str) else found.stem if found.is_file() else found.name


def _one(image: Image.Image, upscaler: str, e: Extras, info: dict, folder, device) -> Image.Image:
    if e.mode == "to":
        scale = max(e.width / image.width, e.height / image.height)
        info["Postprocess upscale to"] = f"{e.width}x{e.height}"
    else:
        scale = e.scale
        info["Postprocess upscale by"] = int(scale) if float(scale).is_integer() else scale
    width, height = int(image.width * scale // 8 * 8), int(image.height * scale // 8 * 8)
    out = upscale_to(image, upscaler, max(width, 8), max(height, 8), folder=folder, device=device)
    if e.mode == "to" and e.crop:
        cropped = Image.new(out.mode, (e.width, e.height))
        cropped.paste(out, (e.width // 2 - out.width // 2, e.height // 2 - out.height // 2))
        out = cropped
        info["Postprocess crop to"] = f"{out.width}x{out.height}"
    return out


def postprocess(image: Image.Image, extras: Extras, folder=None, device="cpu") -> tuple[Image.Image, dict]:
    """``image`` upscaled as ``extras`` says, and the fields that record it (in A1111's order)."""
    info: dict = {}
    rgb = image if image.mode in ("RGB", "RGBA", "L") else image.convert("RGB")
    out = _one(rgb, extras.upscaler_1, extras, info, folder, device)
    info["Postprocess upscaler"] = _name(extras.upscaler_1, folder)
    if extras.visibility_2 > 0 and resolve(extras.upscaler_2, folder) != "None":
        second = _one(rgb, extras.upscaler_2, extras, {}, folder, device)
        if second.mode != out.mode:
            second = second.convert(out.mode)
        if second.size != out.size:
            second = second.resize(out.size, Image.Resampling.LANCZOS)
        out = Image.blend(out, second, extras.visibility_2)
        info["Postprocess upscaler 2"] = _name(extras.upscaler_2, folder)
    return out, info


def fields_text(info: dict) -> str:
    """The fields as A1111 writes them: ``Key: value, ...`` (values with a comma or colon quoted)."""
    return ", ".join(f"{k}: {quote_value(v)}" for k, v in info.items())


def parameters_after(existing: str | None, info: dict) -> str:
    """The ``parameters`` of an upscaled image: the source's own, with the postprocess fields added to its last
    line (alone when the source had none)."""
    added = fields_text(info)
    if not existing:
        return added
    return f"{existing.rstrip()}, {added}"
