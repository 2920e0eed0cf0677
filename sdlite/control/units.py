"""ControlNet units as A1111's ControlNet extension defines them: what a unit is, its values checked, and the rules
that turn it into per-step residual scales.

* The guidance window follows diffusers' per-step keep rule: step ``i`` of ``n`` is controlled unless
  ``i / n < start`` or ``(i + 1) / n > end``.
* The control modes are the extension's: "Balanced" scales every residual by the weight; "My prompt is more
  important" is soft injection, the i-th of the residuals (the middle block's last, 13 for SD 1.x/2.x) scaled by
  ``weight * 0.825 ** (12 - i)``; "ControlNet is more important" is soft injection with the control given to the
  conditional half of classifier-free guidance only.
* ``hr_option`` says which passes of a hires fix it controls.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import SDLiteError

# our names -> A1111's (the extension's enum strings; its integer forms are the positions)
CONTROL_MODES = {"balanced": "Balanced", "prompt": "My prompt is more important",
                 "control": "ControlNet is more important"}
RESIZE_MODES = {"just-resize": "Just Resize", "crop-and-resize": "Crop and Resize",
                "resize-and-fill": "Resize and Fill"}
HR_OPTIONS = {"both": "Both", "low-res-only": "Low res only", "high-res-only": "High res only"}
SOFT_BASE = 0.825          # the extension's soft-injection factor per residual, from the middle block outwards
SOFT_RESIDUALS = 13        # ...defined over SD 1.x/2.x's 13 residuals (12 skips + the middle block)
MAX_WEIGHT = 10.0


class ControlError(SDLiteError, ValueError):
    """A ControlNet unit's value is out of range or unknown; the message names the unit, the field and the value."""


def _choice(value, table: dict, what: str, unit: int) -> str:
    """Our name for ``value``: one of ours, an A1111 enum string (any case) or its integer position."""
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, int):
        names = list(table)
        if 0 <= value < len(names):
            return names[value]
    elif isinstance(value, str):
        v = value.strip()
        for ours, theirs in table.items():
            if v.lower() in (ours, theirs.lower(), ours.replace("-", " "), ours.replace("-", "_")):
                return ours
        if v.isdigit() and int(v) < len(table):
            return list(table)[int(v)]
    raise ControlError(f"ControlNet unit {unit}: {what} {value!r} is not one of "
                       f"{', '.join(repr(n) for n in table)} (or A1111's {', '.join(repr(n) for n in table.values())})")


@dataclass
class ControlUnit:
    """One ControlNet applied to a generation.

    ``model``: the ControlNet's path (a file or a diffusers folder). ``image``: the control image (a path or a PIL
    image; None: the request's init image, as A1111 uses the img2img input then). ``preprocessor``: a name of
    :mod:`sdlite.control.preprocess` run on the image first (``none``: the image is the control map).
    ``threshold_a`` / ``threshold_b``: the preprocessor's two parameters (None: its defaults). ``processor_res``:
    the short side the preprocessor works at (``pixel_perfect``: the one matching the output size instead).
    ``mask``: the inpaint preprocessor's mask (None: the request's).
    """

    model: object
    image: object = None
    weight: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0
    preprocessor: str = "none"
    mode: str = "balanced"
    resize_mode: str = "crop-and-resize"
    pixel_perfect: bool = False
    processor_res: int = 512
    threshold_a: float | None = None
    threshold_b: float | None = None
    hr_option: str = "both"
    mask: object = None

    def replace(self, **changes) -> "ControlUnit":
        return dataclasses.replace(self, **changes)

    def checked(self, index: int = 0) -> "ControlUnit":
        """The unit with its names made ours and every value checked (:class:`ControlError` names the first bad
        one)."""
        if self.model is None or str(self.model).strip() in ("", "None"):
            raise ControlError(f"ControlNet unit {index}: no model given")
        for name in ("weight", "guidance_start", "guidance_end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ControlError(f"ControlNet unit {index}: {name} {value!r} is not a number")
        if not 0.0 <= self.weight <= MAX_WEIGHT:
            raise ControlError(f"ControlNet unit {index}: weight {self.weight} is outside 0 to {MAX_WEIGHT:g}")
        if not 0.0 <= self.guidance_start <= self.guidance_end <= 1.0:
            raise ControlError(f"ControlNet unit {index}: guidance start {self.guidance_start} and end "
                               f"{self.guidance_end} must satisfy 0 <= start <= end <= 1")
        res = self.processor_res
        if isinstance(res, bool) or not isinstance(res, int) or not (64 <= res <= 4096 or res == -1):
            raise ControlError(f"ControlNet unit {index}: processor_res {res!r} must be an integer from 64 to 4096 "
                               "(-1: the default, 512)")
        for name in ("threshold_a", "threshold_b"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ControlError(f"ControlNet unit {index}: {name} {value!r} is not a number")
        return self.replace(mode=_choice(self.mode, CONTROL_MODES, "control mode", index),
                            resize_mode=_choice(self.resize_mode, RESIZE_MODES, "resize mode", index),
                            hr_option=_choice(self.hr_option, HR_OPTIONS, "hr_option", index),
                            processor_res=512 if res == -1 else res,
                            weight=float(self.weight), guidance_start=float(self.guidance_start),
                            guidance_end=float(self.guidance_end), preprocessor=str(self.preprocessor).strip())

    @property
    def soft(self) -> bool:
        """Soft injection (either "... is more important" mode)."""
        return self.mode != "balanced"

    @property
    def cond_only(self) -> bool:
        """The control goes to the conditional half of classifier-free guidance only."""
        return self.mode == "control"

    def applies_to(self, hires_pass: int | None) -> bool:
        """Whether the unit controls pass ``hires_pass`` (1: a hires fix's first pass, 2: its second; None: no
        hires fix)."""
        if hires_pass is None or self.hr_option == "both":
            return True
        return (hires_pass == 1) == (self.hr_option == "low-res-only")


def keep(step: int, steps: int, start: float, end: float) -> bool:
    """diffusers' rule: whether step ``step`` (0-based) of a run of ``steps`` is inside the guidance window."""
    return not (step / steps < start or (step + 1) / steps > end)


def residual_scales(unit: ControlUnit, residuals: int) -> list[float]:
    """The factor of each of a ControlNet's ``residuals`` (the middle block's last) for ``unit``: its weight, or
    with soft injection A1111's ``weight * 0.825 ** (12 - i)`` (over the first 13 residuals, as the extension pairs
    them: an SDXL ControlNet's 10 take the first 10 factors)."""
    if not unit.soft:
        return [unit.weight] * residuals
    factors = [unit.weight * SOFT_BASE ** float(SOFT_RESIDUALS - 1 - i) for i in range(SOFT_RESIDUALS)]
    if residuals > SOFT_RESIDUALS:
        raise ControlError(f"soft injection is defined over {SOFT_RESIDUALS} residuals; this ControlNet gives "
                           f"{residuals}")
    return factors[:residuals]


def infotext(unit: ControlUnit, model_label: str) -> str:
    """A1111's ``ControlNet N`` value for ``unit`` (``model_label``: "name [hash]")."""
    fields = {
        "Module": unit.preprocessor, "Model": model_label, "Weight": _num(unit.weight),
        "Resize Mode": RESIZE_MODES[unit.resize_mode], "Processor Res": unit.processor_res,
        "Threshold A": _num(unit.threshold_a) if unit.threshold_a is not None else None,
        "Threshold B": _num(unit.threshold_b) if unit.threshold_b is not None else None,
        "Guidance Start": _num(unit.guidance_start), "Guidance End": _num(unit.guidance_end),
        "Pixel Perfect": unit.pixel_perfect, "Control Mode": CONTROL_MODES[unit.mode],
        "Hr Option": HR_OPTIONS[unit.hr_option] if unit.hr_option != "both" else None,
    }
    return ", ".join(f"{k}: {v}" for k, v in fields.items() if v is not None)


def _num(value: float) -> str:
    return f"{float(value):g}"   # 1.0 -> "1", 0.25 -> "0.25", as A1111 writes them
