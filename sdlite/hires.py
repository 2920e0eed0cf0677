"""The hires fix: A1111's two-pass text to image.

A first pass at the requested size, an upscale to the target size, and a second pass that is image to image at
``denoise`` on the upscaled result. The rule the second pass follows, so that it can be checked against the
reference composition of diffusers' pipelines:

- a latent upscaler interpolates the first pass's latents (the sampler's, in the UNet's scaling) to the target's
  latent size, ``torch.nn.functional.interpolate(latents, size=(H/8, W/8), mode=..., antialias=...)``
  (A1111's six "Latent ..." modes, :data:`LATENT_MODES`);
- an image upscaler ("None", "Lanczos", "Nearest", an upscaler network) decodes the first pass, upscales the images
  to the target size and encodes them again, drawing each latent sample from the image's generator;
- the second pass then runs diffusers' image to image on those latents: the last ``int(steps x denoise)`` steps of
  a ``steps``-step schedule, its noise drawn at the new shape from a generator seeded with the image's seed (after
  the encoder's draw, for an image upscaler).

The target size follows A1111's ``calculate_target_resolution``: ``scale`` x the first pass's size, or
``resize_x`` / ``resize_y`` with the aspect kept when one of them is 0, and when both are set, the image fitted
over the target and the latents cropped to it (centred). Sizes are rounded down to a multiple of 8.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import SDLiteError

# A1111's latent upscale modes (shared.latent_upscale_modes): name -> (interpolation mode, antialias)
LATENT_MODES = {
    "Latent": ("bilinear", False),
    "Latent (antialiased)": ("bilinear", True),
    "Latent (bicubic)": ("bicubic", False),
    "Latent (bicubic antialiased)": ("bicubic", True),
    "Latent (nearest)": ("nearest", False),
    "Latent (nearest-exact)": ("nearest-exact", False),
}
DEFAULT_UPSCALER = "Latent"      # A1111's latent_upscale_default_mode, used when a request names none
DEFAULT_DENOISE = 0.7            # A1111's hires fix "Denoising strength" default in its UI
MAX_SCALE = 8.0
# the names A1111 clients send for "the same as the first pass"
SAME = {"": None, "use same checkpoint": None, "use same sampler": None, "use same scheduler": None}


class HiresError(SDLiteError, ValueError):
    """A hires-fix option is out of range; the message names it and its value."""


@dataclass(frozen=True)
class Hires:
    """The second pass of a text-to-image request (``Request.hires``). None fields: the first pass's value."""

    scale: float = 2.0               # A1111's hr_scale; ignored when resize_x or resize_y is set
    resize_x: int = 0                # hr_resize_x / hr_resize_y: a target size in pixels (0: from the other side)
    resize_y: int = 0
    upscaler: str = DEFAULT_UPSCALER  # a LATENT_MODES name, "None", "Lanczos", "Nearest" or an upscaler's name/path
    steps: int = 0                   # hr_second_pass_steps: 0 = the first pass's steps
    denoise: float = DEFAULT_DENOISE  # denoising_strength of the second pass, (0, 1]
    sampler: str | None = None       # hr_sampler_name
    schedule: str | None = None      # hr_scheduler (sdlite's schedule names)
    cfg_scale: float | None = None   # hr_cfg
    prompt: str | None = None        # hr_prompt
    negative_prompt: str | None = None  # hr_negative_prompt
    checkpoint: str | None = None    # hr_checkpoint_name: a model path for the second pass

    @property
    def is_latent(self) -> bool:
        return self.upscaler in LATENT_MODES


@dataclass(frozen=True)
class Target:
    """Where the second pass runs: the size the first pass is upscaled to (``upscale_width`` x
    ``upscale_height``), then cropped by ``truncate_x`` / ``truncate_y`` latent pixels (A1111's truncation, when
    both hr_resize_x and hr_resize_y are set) to ``width`` x ``height``."""

    upscale_width: int
    upscale_height: int
    truncate_x: int
    truncate_y: int
    width: int
    height: int

    def crop_box(self, scale: int = 8) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of the crop in pixels of the upscaled image (``scale``: latent to pixel)."""
        left, top = self.truncate_x // 2 * scale, self.truncate_y // 2 * scale
        return left, top, left + self.width, top + self.height


def target_size(width: int, height: int, hires: Hires, scale: int = 8) -> Target:
    """A1111's target resolution of the second pass for a ``width`` x ``height`` first pass (``scale``: the VAE's
    downscale). Raises :class:`HiresError` for a target smaller than one latent pixel or larger than
    :data:`MAX_SCALE` times the first pass."""
    rx, ry = hires.resize_x, hires.resize_y
    truncate_x = truncate_y = 0
    if rx == 0 and ry == 0:
        up_x, up_y = int(width * hires.scale), int(height * hires.scale)
    elif ry == 0:
        up_x, up_y = rx, rx * height // width
    elif rx == 0:
        up_x, up_y = ry * width // height, ry
    else:
        if width / height < rx / ry:
            up_x, up_y = rx, rx * height // width
        else:
            up_x, up_y = ry * width // height, ry
        truncate_x, truncate_y = (up_x - rx) // scale, (up_y - ry) // scale
    up_x, up_y = up_x // scale * scale, up_y // scale * scale
    out_w, out_h = up_x - truncate_x * scale, up_y - truncate_y * scale
    if out_w < scale or out_h < scale:
        raise HiresError(f"the hires target {out_w}x{out_h} (from {width}x{height}) is smaller than {scale} pixels: "
                         "give a larger hires scale or size")
    if max(up_x / width, up_y / height) > MAX_SCALE:
        raise HiresError(f"the hires target {up_x}x{up_y} is more than {MAX_SCALE:g}x the first pass's "
                         f"{width}x{height}")
    return Target(up_x, up_y, truncate_x, truncate_y, out_w, out_h)


def validate(hires: Hires, steps: int) -> Hires:
    """Check each field of ``hires`` (``steps``: the first pass's); returns it with the "same as" names resolved."""
    h = hires
    scale = h.scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or not 1.0 <= scale <= MAX_SCALE:
        raise HiresError(f"hires scale {scale!r} is not valid: it must be between 1 and {MAX_SCALE:g}")
    for name, value in (("hires resize x", h.resize_x), ("hires resize y", h.resize_y)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 16384:
            raise HiresError(f"{name} {value!r} is not valid: it must be 0 (from the scale or the other side) or a "
                             "width/height in pixels up to 16384")
    if isinstance(h.steps, bool) or not isinstance(h.steps, int) or not 0 <= h.steps <= 1000:
        raise HiresError(f"hires steps {h.steps!r} is not valid: it must be 0 (the first pass's steps) to 1000")
    denoise = h.denoise
    if isinstance(denoise, bool) or not isinstance(denoise, (int, float)) or not 0.0 < denoise <= 1.0:
        raise HiresError(f"hires denoising strength {denoise!r} is not valid: it must be above 0 and at most 1")
    total = h.steps or steps
    if int(total * denoise) < 1:
        raise HiresError(f"hires denoising strength {denoise:g} with {total} second-pass steps runs "
                         f"int({total} x {denoise:g}) = 0 steps: raise the strength or the hires steps")
    if h.cfg_scale is not None and (isinstance(h.cfg_scale, bool) or not isinstance(h.cfg_scale, (int, float))
                                    or not 1.0 <= h.cfg_scale <= 30.0):
        raise HiresError(f"hires cfg scale {h.cfg_scale!r} is out of range: it must be between 1 and 30")
    if not isinstance(h.upscaler, str) or not h.upscaler.strip():
        raise HiresError(f"hires upscaler {h.upscaler!r} is not valid: give a name (e.g. Latent, Lanczos) or a file")

    def same(value):
        return SAME.get(value.strip().lower(), value) if isinstance(value, str) else value

    return Hires(scale=float(scale), resize_x=h.resize_x, resize_y=h.resize_y, upscaler=h.upscaler.strip(),
                 steps=h.steps, denoise=float(denoise), sampler=same(h.sampler), schedule=same(h.schedule),
                 cfg_scale=None if h.cfg_scale is None else float(h.cfg_scale),
                 prompt=h.prompt or None, negative_prompt=h.negative_prompt or None,
                 checkpoint=same(h.checkpoint))


def second_pass_steps(hires: Hires, steps: int, schedule=None) -> int:
    """The sampler steps the second pass runs: the last ``int(N x denoise)`` of its ``N`` planned steps (``N``:
    ``hires.steps``, or the first pass's ``steps`` when 0), as diffusers' image to image runs them; with the second
    pass's noise ``schedule``, its own pipelines' rule (``img2img_start``: a flow model's may run one more)."""
    total = hires.steps or steps
    if schedule is not None:
        return total - schedule.img2img_start(total, hires.denoise)
    return min(int(total * hires.denoise), total)


def upscale_latents(latents, target: Target, upscaler: str, scale: int = 8):
    """A latent upscaler: the first pass's latents (B, C, h, w) -> the second pass's start (B, C, H/8, W/8)
    (``scale``: the VAE's downscale, A1111's opt_f)."""
    import torch

    mode, antialias = LATENT_MODES[upscaler]
    size = (target.upscale_height // scale, target.upscale_width // scale)
    out = torch.nn.functional.interpolate(latents, size=size, mode=mode, antialias=antialias)
    ty, tx = target.truncate_y, target.truncate_x
    if tx or ty:
        out = out[:, :, ty // 2:out.shape[2] - (ty + 1) // 2, tx // 2:out.shape[3] - (tx + 1) // 2]
    return out


def infotext(hires: Hires, cfg_scale: float) -> dict:
    """A1111's parameters of a hires-fix image: "Denoising strength", "Hires upscale" or "Hires resize",
    "Hires steps" (when set), "Hires upscaler", and "Hires CFG Scale" and "Hires checkpoint" when they differ from
    the first pass (the caller adds the sampler, schedule and prompts of the second pass when they differ)."""
    out = {"Denoising strength": _g(hires.denoise)}
    if hires.resize_x == 0 and hires.resize_y == 0:
        out["Hires upscale"] = _g(hires.scale)
    else:
        out["Hires resize"] = f"{hires.resize_x}x{hires.resize_y}"
    if hires.steps:
        out["Hires steps"] = hires.steps
    out["Hires upscaler"] = hires.upscaler
    if hires.cfg_scale is not None and hires.cfg_scale != cfg_scale:
        out["Hires CFG Scale"] = _g(hires.cfg_scale)
    if hires.checkpoint:
        from pathlib import Path

        out["Hires checkpoint"] = Path(hires.checkpoint).stem
    return out


def _g(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(float(value), 4)
