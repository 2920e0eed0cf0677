"""A1111's ControlNet extension (Mikubill/sd-webui-controlnet) over sdlite: its units as
:class:`~sdlite.control.ControlUnit` s, its ControlNet models by name, and the answers of its ``/controlnet/*`` routes.

Translation only: the units go into :attr:`sdlite.pipeline.Request.controls`, and the engine does the rest.

**Units.** ``alwayson_scripts`` holds them under a script name matched without regard to case (``ControlNet``,
``controlnet``), as A1111 matches script titles; ``args`` is a list of unit objects, and an empty list (which some
clients send with every request) means no control. A unit takes the extension's fields and defaults:

====================  =====================================================================================
``enabled``           units with ``false`` are skipped. Left out: enabled (the extension's default up to its API
                      version 2 and what clients that leave it out mean; version 3's pydantic unit made it false)
``module``            the preprocessor, by the extension's name or UI label (``none``, ``canny`` ...); those that
                      need an annotator network are refused by name
``model``             ``"name [hash]"``, ``"name"`` (any case), or a part of a name, as the extension finds them
                      (shortest match); the models are those of ``--controlnet-dir``
``weight``            0 to 2 (1)
``image``             base64 (raw or a data URI), ``{"image": b64, "mask": b64}`` or ``[image, mask]``; ``""`` or
                      none: the img2img init image, then with the img2img ``resize_mode``, as the extension does
``mask`` (``mask_image``)  the inpaint preprocessor's mask; with another module a mask that is not blank is
                      the control image itself (the extension's canvas scribble)
``resize_mode``       "Just Resize", "Crop and Resize" (default), "Resize and Fill", the old "Inner Fit (Scale to
                      Fit)" / "Outer Fit (Shrink to Fit)" names, or 0, 1, 2 (3, latent upscale: Just Resize)
``processor_res``, ``threshold_a``, ``threshold_b``  -1 or outside the preprocessor's slider: its default
``guidance_start``, ``guidance_end``  0 to 1, start <= end
``control_mode``      "Balanced", "My prompt is more important", "ControlNet is more important", or 0, 1, 2
``pixel_perfect``     the preprocessor resolution from the output size
``hr_option``         "Both", "Low res only", "High res only" (or 0, 1, 2)
``low_vram``          accepted (the server's memory mode decides)
====================  =====================================================================================

The old names clients still send are read as the extension read them: ``input_image`` (image), ``mask_image``
(mask), ``lowvram`` (low_vram), ``guidance`` (guidance_end); ``guessmode: true``, from before control modes, is
"ControlNet is more important" (its successor) with a warning. A name and its old name both given are refused.
"""
from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ...control import RESIZE_MODES, SHIPPED, ControlError, ControlUnit
from ...control import preprocess
from ...pipeline import RequestError
from ..decode import decode_image

API_VERSION = 3            # /controlnet/version: the extension's API version (an integer)
UNIT_COUNT = 3             # /controlnet/settings' control_net_unit_count (the extension's default)
MAX_UNITS = 8              # enabled units a request may have: each loads a ControlNet
SCRIPT = "controlnet"      # its alwayson_scripts name, compared without case
MAX_WEIGHT = 2.0           # the extension's bound on a unit's weight

# the extension's ResizeMode aliases (deforum and older clients send them)
RESIZE_ALIASES = {"inner fit (scale to fit)": "crop-and-resize", "scale to fit (inner fit)": "crop-and-resize",
                  "outer fit (shrink to fit)": "resize-and-fill", "envelope (outer fit)": "resize-and-fill"}
# old field name -> the field it stands for
OLD_NAMES = {"input_image": "image", "mask_image": "mask", "lowvram": "low_vram", "guidance": "guidance_end"}
# A1111's img2img resize_mode -> a unit's, for a unit that uses the init image
IMG2IMG_RESIZE = {0: "just-resize", 1: "crop-and-resize", 2: "resize-and-fill", 3: "just-resize"}
# the extension's filter aliases for /controlnet/control_types, by lower-cased control type
TYPE_FILTERS = {"segmentation": ["seg"], "normalmap": ["normal"], "openpose": ["openpose", "densepose"],
                "scribble/sketch": ["scribble", "sketch"], "tile/blur": ["tile", "blur"], "ip-adapter": ["ip_adapter",
                                                                                                  "ipadapter"]}


class ControlNetNotFound(RequestError):
    """A unit names a ControlNet model the server does not have (HTTP 404 from the server; a RequestError
    elsewhere)."""


# --- the models of --controlnet-dir --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ControlNetModel:
    path: Path
    name: str           # the file's stem, or the diffusers folder's name
    hash: str           # A1111's legacy short hash (8 hex digits)

    @property
    def title(self) -> str:
        return f"{self.name} [{self.hash}]"


def _is_diffusers_folder(path: Path) -> bool:
    from ...weights.controlnet import DIFFUSERS_WEIGHTS

    return (path / "config.json").is_file() and any((path / n).is_file() for n in DIFFUSERS_WEIGHTS)


def scan(folder: Path) -> list[tuple[Path, str]]:
    """``(path, name)`` of every ControlNet in ``folder`` and below: weights files (their stem) and diffusers
    folders (their name; not searched further), sorted by name as the extension sorts them."""
    from ...weights.controlnet import EXTENSIONS

    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        here = Path(root)
        if here != folder and _is_diffusers_folder(here):
            found.append((here, here.name))
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in files:
            path = here / f
            if path.suffix.lower() in EXTENSIONS and path.stem != "None":
                found.append((path, path.stem))
    if _is_diffusers_folder(folder):
        found.append((folder, folder.name))
    return sorted(found, key=lambda item: (item[1], str(item[0])))


def _weights_file(path: Path) -> Path:
    """The file whose hash names ``path``: itself, or a diffusers folder's weights file."""
    from ...weights.controlnet import DIFFUSERS_WEIGHTS

    if path.is_dir():
        return next((path / n for n in DIFFUSERS_WEIGHTS if (path / n).is_file()), path / "config.json")
    return path


class ControlNets:
    """The ControlNet models a server offers, named as the extension names them: those of ``--controlnet-dir``,
    then the demo ControlNets the package ships (as the upscalers list the shipped demo upscaler), one per name. The
    list is read again on :meth:`refresh` (``/controlnet/model_list?update=true``, and a name not found); hashes are
    kept per file while its size and time are unchanged. ``allow_paths`` (``sdlite batch``, whose job file is the
    user's own): a model may also be named by its path."""

    def __init__(self, folder=None, allow_paths: bool = False):
        self.folder = Path(folder) if folder is not None else None
        self.allow_paths = allow_paths
        self._lock = threading.Lock()
        self._hashes: dict[tuple, str] = {}
        self._items: list[ControlNetModel] = []
        self.refresh()

    def refresh(self) -> None:
        from ...control.apply import legacy_hash

        items, names = [], set()
        roots = [self.folder] if self.folder is not None else []
        for root in [r for r in (*roots, SHIPPED) if r.is_dir()]:
            for path, name in scan(root):
                if name in names:
                    continue   # the folder's own comes first
                try:
                    st = _weights_file(path).stat()
                    key = (str(path), st.st_size, st.st_mtime_ns)
                    if key not in self._hashes:
                        self._hashes[key] = legacy_hash(path)
                except OSError:
                    continue   # gone since it was listed, or unreadable: not offered
                items.append(ControlNetModel(path, name, self._hashes[key]))
                names.add(name)
        with self._lock:
            self._items = items

    def list(self) -> list[ControlNetModel]:
        with self._lock:
            return list(self._items)

    def titles(self) -> list[str]:
        return [m.title for m in self.list()]

    def find(self, name: str) -> ControlNetModel | None:
        """The model ``name`` means, by the extension's rule: its title exactly, else its name without case (the
        part before `` [hash]`` too), else the shortest name that contains it; None when there is none."""
        items = self.list()
        text = name.strip()
        for m in items:
            if m.title == text:
                return m
        wanted = text.lower()
        bare = wanted.rsplit(" [", 1)[0] if wanted.endswith("]") and " [" in wanted else wanted
        for key in (wanted, bare):
            for m in items:
                if m.name.lower() == key:
                    return m
        if bare:
            containing = sorted((m for m in items if bare in m.name.lower()), key=lambda m: len(m.name))
            if containing:
                return containing[0]
        return None

    def resolve(self, name: Any, what: str) -> str:
        """The path of the model ``name`` (a :class:`ControlNetNotFound` naming ``what`` and the models on offer
        when there is none)."""
        if not isinstance(name, str) or name.strip() in ("", "None"):
            raise RequestError(f"{what}: model {name!r}: an enabled unit needs a ControlNet model "
                               f"({self._offer()})")
        if self.allow_paths and Path(name).exists():
            return str(name)
        found = self.find(name)
        if found is None:
            self.refresh()   # a file added since the list was read
            found = self.find(name)
        if found is None:
            raise ControlNetNotFound(f"{what}: ControlNet model {name!r} not found ({self._offer()})")
        return str(found.path)

    def _offer(self) -> str:
        titles = self.titles()
        if titles:
            return "available: " + ", ".join(titles) + ("" if self.folder is not None else
                                                        "; more with --controlnet-dir DIR")
        if self.folder is None:
            return "no ControlNet models are offered: give a folder of them with --controlnet-dir DIR"
        return (f"the ControlNet folder {self.folder.name!r} (--controlnet-dir) has none: expected weights files "
                "or diffusers ControlNetModel folders")


# --- units -----------------------------------------------------------------------------------------------------

def is_controlnet(script_name: str) -> bool:
    return isinstance(script_name, str) and script_name.strip().lower() == SCRIPT


def units_from_scripts(scripts: dict | None, *, controlnets: ControlNets | None, img2img: bool,
                       img2img_resize_mode: int = 0, max_image_bytes: int, warnings: list[str],
                       saves: list | None = None) -> tuple:
    """The :class:`ControlUnit` s of a request's ``alwayson_scripts`` (enabled units only, in order), checked. A bad
    field is a :class:`RequestError` (422) naming the unit's place (``alwayson_scripts.ControlNet.args[1]``), the
    field and the value; an unknown model a :class:`ControlNetNotFound` (404). ``saves``, when given, gets each
    unit's ``save_detected_map`` (whether its control map goes back with the images; default true)."""
    units = []
    for script_name, value in (scripts or {}).items():
        if not is_controlnet(script_name):
            continue
        where = f"alwayson_scripts.{script_name}"
        if value is None:
            continue
        if not isinstance(value, dict):
            raise RequestError(f"{where}: expected an object with \"args\" (a list of ControlNet units), got "
                               f"{type(value).__name__}")
        args = value.get("args")
        if args is None:
            continue
        if not isinstance(args, list):
            raise RequestError(f"{where}.args: expected a list of ControlNet units, got {type(args).__name__}")
        for i, arg in enumerate(args):
            what = f"{where}.args[{i}]"
            if arg is None:
                continue
            if not isinstance(arg, dict):
                warnings.append(f"{what}: {type(arg).__name__} {_short(arg)} was ignored: a ControlNet unit is an "
                                "object")
                continue
            unit = unit_from_dict(arg, what, controlnets=controlnets, img2img=img2img,
                                  img2img_resize_mode=img2img_resize_mode, max_image_bytes=max_image_bytes,
                                  warnings=warnings, index=len(units))
            if unit is not None:
                units.append(unit)
                if saves is not None:
                    saves.append(arg.get("save_detected_map") is not False)
    if len(units) > MAX_UNITS:
        raise RequestError(f"alwayson_scripts: {len(units)} enabled ControlNet units; this server takes at most "
                           f"{MAX_UNITS} a request")
    return tuple(units)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def unit_from_dict(raw: dict, what: str, *, controlnets: ControlNets | None, img2img: bool,
                   img2img_resize_mode: int = 0, max_image_bytes: int, warnings: list[str],
                   index: int = 0) -> ControlUnit | None:
    """One unit object -> a checked :class:`ControlUnit`, or None when it is disabled."""
    d = dict(raw)
    for old, new in OLD_NAMES.items():
        if old in d:
            if new in d and d[new] is not None and d[old] is not None:
                raise RequestError(f"{what}: both {old!r} and {new!r} are given; {old!r} is the old name of {new!r}: "
                                   "send one")
            value = d.pop(old)
            if d.get(new) is None:
                d[new] = value
    enabled = d.get("enabled", True)
    if enabled is None:
        enabled = True
    if not isinstance(enabled, bool):
        raise RequestError(f"{what}: enabled={enabled!r} is not valid: expected true or false")
    if not enabled:
        return None

    # the preprocessor ("module") and its sliders
    module = d.get("module")
    module = "none" if module is None else module
    if not isinstance(module, str):
        raise RequestError(f"{what}: module={module!r} is not valid: expected a preprocessor name")
    try:
        pre = preprocess.find(module)
    except ControlError as e:
        raise RequestError(f"{what}: module: {e}") from None
    processor_res = _slider_value(d.get("processor_res"), _resolution_slider(pre), what, "processor_res")
    threshold_a = _slider_value(d.get("threshold_a"), pre.sliders[0] if pre.sliders else None, what, "threshold_a")
    threshold_b = _slider_value(d.get("threshold_b"), pre.sliders[1] if len(pre.sliders) > 1 else None, what,
                                "threshold_b")

    model = d.get("model", "None")
    path = (controlnets or ControlNets()).resolve(model, what)

    weight = _number(d.get("weight"), 1.0, what, "weight")
    if not 0.0 <= weight <= MAX_WEIGHT:
        raise RequestError(f"{what}: weight={weight!r} is not valid: it must be from 0 to {MAX_WEIGHT:g}")
    start = _number(d.get("guidance_start"), 0.0, what, "guidance_start")
    end = _number(d.get("guidance_end"), 1.0, what, "guidance_end")
    for name, value in (("guidance_start", start), ("guidance_end", end)):
        if not 0.0 <= value <= 1.0:
            raise RequestError(f"{what}: {name}={value!r} is not valid: it must be from 0 to 1")
    if start > end:
        raise RequestError(f"{what}: guidance_start ({start:g}) is after guidance_end ({end:g})")

    for name in ("pixel_perfect", "low_vram"):
        if d.get(name) is not None and not isinstance(d.get(name), bool):
            raise RequestError(f"{what}: {name}={d.get(name)!r} is not valid: expected true or false")
    if d.get("low_vram"):
        warnings.append(f"{what}: low_vram was ignored: the server's memory mode (--memory-mode) applies to every "
                        "ControlNet")
    for name in ("advanced_weighting", "effective_region_mask", "ipadapter_input"):
        if d.get(name) not in (None, [], ""):
            warnings.append(f"{what}: {name} was ignored: sdlite does not support it")

    control_mode = d.get("control_mode")
    guessmode = d.get("guessmode", d.get("guess_mode"))
    if guessmode:
        if control_mode is None:
            control_mode = "control"
            warnings.append(f"{what}: guessmode is the extension's old name for \"ControlNet is more important\"; "
                            "send control_mode instead")
        else:
            warnings.append(f"{what}: guessmode was ignored: control_mode is given")
    control_mode = "balanced" if control_mode is None else control_mode

    image, mask = _images(d, what, max_image_bytes, decode_image)
    resize_mode = _resize_mode(d.get("resize_mode"), what, warnings)
    if image is None:
        if not img2img:
            raise RequestError(f"{what}: no control image (image, or the older input_image); a unit without one "
                               "uses the init image, which only img2img has")
        resize_mode = IMG2IMG_RESIZE.get(img2img_resize_mode, "just-resize")
    if mask is not None and image is not None and pre.name != "inpaint":
        image, mask = _canvas_scribble(image, mask, what)

    unit = ControlUnit(model=path, image=image, weight=weight, guidance_start=start, guidance_end=end,
                       preprocessor=pre.name, mode=control_mode, resize_mode=resize_mode,
                       pixel_perfect=bool(d.get("pixel_perfect") or False), processor_res=processor_res,
                       threshold_a=threshold_a, threshold_b=threshold_b,
                       hr_option="both" if d.get("hr_option") is None else d.get("hr_option"), mask=mask)
    try:
        return unit.checked(index)
    except ControlError as e:
        message = str(e)
        prefix = f"ControlNet unit {index}: "
        raise RequestError(f"{what}: {message[len(prefix):] if message.startswith(prefix) else message}") from None


def _number(value, default: float, what: str, name: str) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{what}: {name}={value!r} is not valid: expected a number")
    return float(value)


def _resolution_slider(pre) -> preprocess.Slider | None:
    return preprocess.Slider("Resolution", 512, 64, 2048, 8) if pre.uses_resolution else None


def _slider_value(value, slider, what: str, name: str):
    """The extension's rule: -1, or a value outside the slider's range, means the slider's default. For
    ``processor_res`` the result is an integer (512 where the preprocessor has no resolution); for the thresholds
    None means the default."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value)):
        raise RequestError(f"{what}: {name}={value!r} is not valid: expected a number")
    if name == "processor_res":
        if slider is None or value is None or not slider.min <= value <= slider.max:
            return 512
        return int(round(value))
    if slider is None or value is None or not slider.min <= value <= slider.max:
        return None
    return float(value)


def _resize_mode(value, what: str, warnings: list[str]):
    if value is None:
        return "crop-and-resize"
    if isinstance(value, bool):
        raise RequestError(f"{what}: resize_mode={value!r} is not valid: expected a name or 0, 1, 2")
    if isinstance(value, int):
        if value < 0:
            raise RequestError(f"{what}: resize_mode={value!r} is not valid: 0 Just Resize, 1 Crop and Resize, "
                               "2 Resize and Fill")
        if value >= 3:
            if value > 3:   # the extension falls back to Just Resize too
                warnings.append(f"{what}: resize_mode={value} is not known: used 0 (Just Resize)")
            return "just-resize"
        return list(RESIZE_MODES)[value]
    if isinstance(value, str):
        return RESIZE_ALIASES.get(value.strip().lower(), value)
    raise RequestError(f"{what}: resize_mode={value!r} is not valid: expected one of "
                       f"{', '.join(repr(v) for v in RESIZE_MODES.values())} or 0, 1, 2")


def _images(d: dict, what: str, max_bytes: int, decode):
    """``(image, mask)`` PIL images (or None) from the unit's ``image`` and ``mask`` in the forms the extension
    reads: a base64 string, {"image", "mask"}, [image, mask], or a one-item list of {"image", "mask"}."""
    image, mask = d.get("image"), d.get("mask")
    where_image, where_mask = f"{what}.image", f"{what}.mask"
    if isinstance(image, list):
        if len(image) == 1 and isinstance(image[0], dict):
            image = image[0]
            where_image = f"{what}.image[0]"
        elif len(image) == 2 and all(isinstance(x, (str, type(None))) for x in image):
            image, mask = image
            where_image, where_mask = f"{what}.image[0]", f"{what}.image[1]"
        elif len(image) == 0:
            image = None
        else:
            raise RequestError(f"{what}.image: a list of {len(image)} images; a unit takes one image (and its mask) "
                               "here: several input images are for IP-Adapter units, which sdlite does not support")
    if isinstance(image, dict):
        where_image, where_mask = f"{where_image}.image", f"{where_image}.mask"
        image, mask = image.get("image"), image.get("mask") if image.get("mask") is not None else mask
    if image is not None and not isinstance(image, str):
        raise RequestError(f"{where_image}: expected a base64-encoded image, got {type(image).__name__}")
    if mask is not None and not isinstance(mask, str):
        raise RequestError(f"{where_mask}: expected a base64-encoded image, got {type(mask).__name__}")
    image = decode(image, where_image, max_bytes) if image and image.strip() else None
    mask = decode(mask, where_mask, max_bytes) if mask and mask.strip() else None
    if image is None and mask is not None:
        raise RequestError(f"{where_mask}: a mask without an image: send the image too")
    if image is not None and mask is not None and image.size != mask.size:
        raise RequestError(f"{where_mask}: the mask is {mask.width}x{mask.height}, the image "
                           f"{image.width}x{image.height}: they must be the same size")
    return image, mask


def _canvas_scribble(image, mask, what: str):
    """The extension's rule for a mask sent with a unit whose preprocessor is not inpaint: a blank mask (all at
    most 5, or all at least 250) is ignored; any other mask is the control image (a scribble drawn on the
    canvas)."""
    import numpy as np
    from PIL import Image

    m = np.asarray(mask.convert("RGB"))[:, :, 0]
    if (m <= 5).all() or (m >= 250).all():
        return image, None
    return Image.fromarray(np.stack([m] * 3, axis=2)), None


# --- the /controlnet routes' answers ---------------------------------------------------------------------------------

def _sliders(pre) -> list[dict]:
    resolution = _resolution_slider(pre)
    return [s.as_json() for s in ((resolution,) if resolution else ()) + tuple(pre.sliders)]


def _label(pre) -> str:
    """The preprocessor's name in the extension's UI (its "alias name")."""
    long = [a for a in pre.aliases if a.lower().startswith(pre.name.lower() + " ")]
    return long[0] if long else pre.name


def module_list(alias_names: bool = False) -> dict:
    """``/controlnet/module_list``: ``none`` first, then the others; each with its sliders (resolution first)."""
    items = list(preprocess.PREPROCESSORS.values())
    items = [p for p in items if p.name == "none"] + [p for p in items if p.name != "none"]
    names = [_label(p) if alias_names else p.name for p in items]
    detail = {name: {"model_free": p.unavailable is None, "sliders": _sliders(p)} for name, p in zip(names, items)}
    return {"module_list": names, "module_detail": detail}


def control_types(controlnets: ControlNets) -> dict:
    """``/controlnet/control_types``: per control type its preprocessors, the models whose names suggest it, and the
    defaults the extension's UI picks."""
    items = list(preprocess.PREPROCESSORS.values())
    items = [p for p in items if p.name == "none"] + [p for p in items if p.name != "none"]
    models = ["None"] + controlnets.titles()
    tags = sorted({t for p in items for t in p.control_types if t != "All"})
    out = {"All": {"module_list": [_label(p) for p in items], "model_list": models, "default_option": "none",
                   "default_model": "None"}}
    for tag in tags:
        modules = [_label(p) for p in items if tag in p.control_types or p.name == "none"]
        pattern = tag.lower()
        filters = [pattern, *TYPE_FILTERS.get(pattern, [])]
        chosen = [m for m in models if m == "None" or any(f in m.split(" [")[0].lower() for f in filters)]
        default_model = "None"
        if len(chosen) > 1:
            default_model = next((m for m in chosen if "11" in m.split("[")[0]), chosen[1])
        out[tag] = {"module_list": modules, "model_list": chosen,
                    "default_option": modules[0] if len(modules) == 1 else modules[1], "default_model": default_model}
    return {"control_types": out}


class DetectRequest(BaseModel):
    """``POST /controlnet/detect``: the extension's fields (``controlnet_images`` is the older name of
    ``controlnet_input_images``, which clients such as webuiapi still send)."""

    model_config = ConfigDict(extra="ignore")

    controlnet_module: str | None = "none"
    controlnet_input_images: list[str] | None = None
    controlnet_images: list[str] | None = None
    controlnet_processor_res: float | None = -1
    controlnet_threshold_a: float | None = -1
    controlnet_threshold_b: float | None = -1
    controlnet_masks: list[str] | None = None
    low_vram: bool | None = False


def detect(module: str, images: list, res, threshold_a, threshold_b, max_image_bytes: int) -> list:
    """``/controlnet/detect``: each image's control map by ``module`` (PIL images). Raises RequestError naming the
    module (unknown, or one that needs an annotator model) or the image at fault."""
    try:
        pre = preprocess.find(module if module is not None else "none")
    except ControlError as e:
        raise RequestError(f"controlnet_module: {e}") from None
    what = "controlnet detect"
    res = _slider_value(res, _resolution_slider(pre), what, "controlnet_processor_res")
    res = 512 if res is None else res
    a = _slider_value(threshold_a, pre.sliders[0] if pre.sliders else None, what, "controlnet_threshold_a")
    b = _slider_value(threshold_b, pre.sliders[1] if len(pre.sliders) > 1 else None, what, "controlnet_threshold_b")
    out = []
    for i, data in enumerate(images):
        image = decode_image(data, f"controlnet_input_images[{i}]", max_image_bytes)
        try:
            out.append(preprocess.run(pre.name, image, int(res), a, b))
        except ControlError as e:
            raise RequestError(f"controlnet_input_images[{i}]: {e}") from None
    return out


def control_maps(result, saves) -> list:
    """The control maps the extension sends back after the images (its "detected maps"): for each unit whose
    ``save_detected_map`` is true, its control image as the network got it (``Result.control_maps``: with the hires
    fix, at the target size, then at the first pass's). An inpaint unit's map shows its mask as transparency, as the
    extension's does."""
    import numpy as np
    from PIL import Image

    out = []
    for index, image, mask in getattr(result, "control_maps", ()):
        if index < len(saves) and saves[index]:
            if mask is not None:
                alpha = 255 - (np.asarray(mask.convert("L")) >= 128).astype(np.uint8) * 127
                image = Image.fromarray(np.dstack([np.asarray(image.convert("RGB")), alpha.astype(np.uint8)]), "RGBA")
            out.append(image)
    return out
