"""ControlNet preprocessors ("modules" in A1111's ControlNet extension): an image in, the control map out.

The ones that need no annotator network are here, with the extension's names, parameters and defaults: ``none``,
``canny`` (OpenCV's Canny, thresholds 100/200), ``invert``, ``threshold``, ``scribble_xdog``, ``tile_resample``,
``blur_gaussian`` and ``inpaint``. Each that works at a resolution first scales the image so its short side is
``processor_res`` (OpenCV's area filter to shrink, bicubic to enlarge), pads it to a multiple of 64 with its edge
pixels, runs, and removes the padding, as the extension does. The ones that need an annotator model (depth, pose,
line art, soft edge, segmentation ...) are listed as unavailable: their names are known and refused with a message
that says why. OpenCV comes from PyPI (``opencv-python-headless``, the ``control`` extra).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from PIL import Image

from .units import ControlError


@dataclass(frozen=True)
class Slider:
    """A preprocessor parameter as the extension describes it to clients (``/controlnet/module_list``)."""

    name: str
    value: float
    min: float
    max: float
    step: float = 1.0

    def as_json(self) -> dict:
        return {"name": self.name, "value": self.value, "min": self.min, "max": self.max, "step": self.step}


@dataclass(frozen=True)
class Preprocessor:
    name: str
    run: Callable | None          # (rgb uint8 HxWx3, res, a, b) -> uint8 HxWx3
    aliases: tuple[str, ...] = ()
    sliders: tuple[Slider, ...] = ()   # threshold_a's, then threshold_b's
    uses_resolution: bool = True
    unavailable: str | None = None   # why it cannot run here
    control_types: tuple[str, ...] = ()

    @property
    def defaults(self) -> tuple[float | None, float | None]:
        a = self.sliders[0].value if len(self.sliders) > 0 else None
        b = self.sliders[1].value if len(self.sliders) > 1 else None
        return a, b


def _cv2():
    try:
        import cv2
    except ImportError:
        raise ControlError("the ControlNet preprocessors need OpenCV: pip install 'sdlite[control]' "
                           "(opencv-python-headless)") from None
    return cv2


def _hwc3(img: np.ndarray) -> np.ndarray:
    if img.ndim == 2:
        img = img[:, :, None]
    if img.shape[2] == 1:
        return np.concatenate([img] * 3, axis=2)
    return img[:, :, :3]


def with_resolution(img: np.ndarray, res: int, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``fn`` run on ``img`` scaled so its short side is ``res``, padded (edge pixels) to multiples of 64, and the
    padding removed from its output: the extension's ``resize_image_with_pad``."""
    cv2 = _cv2()
    h, w = img.shape[:2]
    k = float(res) / float(min(h, w))
    th, tw = int(np.round(h * k)), int(np.round(w * k))
    img = cv2.resize(img, (tw, th), interpolation=cv2.INTER_CUBIC if k > 1 else cv2.INTER_AREA)
    ph, pw = int(math.ceil(th / 64.0) * 64 - th), int(math.ceil(tw / 64.0) * 64 - tw)
    padded = np.pad(img, [[0, ph], [0, pw], [0, 0]], mode="edge")
    out = fn(np.ascontiguousarray(padded))
    return np.ascontiguousarray(_hwc3(out)[:th, :tw])


def _canny(img, res, low, high):
    cv2 = _cv2()
    return with_resolution(img, res, lambda x: cv2.Canny(x, int(low), int(high)))


def _invert(img, res, a, b):
    return 255 - img


def _threshold(img, res, a, b):
    def run(x):
        out = np.zeros(x.shape[:2], np.uint8)
        out[np.min(x, axis=2) > a] = 255
        return out
    return with_resolution(img, res, run)


def _scribble_xdog(img, res, a, b):
    cv2 = _cv2()

    def run(x):
        x = x.astype(np.float32)
        dog = np.min(cv2.GaussianBlur(x, (0, 0), 5.0) - cv2.GaussianBlur(x, (0, 0), 0.5), axis=2)
        dog = (255 - dog).clip(0, 255).astype(np.uint8)
        out = np.zeros(x.shape[:2], np.uint8)
        out[2 * (255 - dog.astype(np.int32)) > a] = 255
        return out
    return with_resolution(img, res, run)


def _tile_resample(img, res, rate, b):
    cv2 = _cv2()
    if rate < 1.1:
        return img
    h, w = img.shape[:2]
    return cv2.resize(img, (int(w / rate), int(h / rate)), interpolation=cv2.INTER_AREA)


def _blur_gaussian(img, res, sigma, b):
    cv2 = _cv2()
    return with_resolution(img, res, lambda x: cv2.GaussianBlur(x, (0, 0), float(sigma)))


def _identity(img, res, a, b):
    return img


_RES = Slider("Resolution", 512, 64, 2048, 8)
_NEEDS_MODEL = "needs an annotator network that sdlite does not ship; run it elsewhere and pass its output as the " \
               "control image with preprocessor none"
PREPROCESSORS: dict[str, Preprocessor] = {p.name: p for p in [
    Preprocessor("none", _identity, ("None",), uses_resolution=False, control_types=("All",)),
    Preprocessor("canny", _canny, (), (Slider("Low Threshold", 100, 1, 255),
                                       Slider("High Threshold", 200, 1, 255)), control_types=("Canny",)),
    Preprocessor("invert", _invert, ("invert (from white bg & black line)",), uses_resolution=False,
                 control_types=("Canny", "Lineart", "Scribble/Sketch", "MLSD")),
    Preprocessor("threshold", _threshold, ("binary",), (Slider("Binary threshold", 127, 0, 255),),
                 control_types=("Scribble/Sketch",)),
    Preprocessor("scribble_xdog", _scribble_xdog, (), (Slider("XDoG Threshold", 32, 1, 64),),
                 control_types=("Scribble/Sketch",)),
    Preprocessor("tile_resample", _tile_resample, ("tile",), (Slider("Down Sampling Rate", 1.0, 1.0, 8.0, 0.01),),
                 uses_resolution=False, control_types=("Tile/Blur",)),
    Preprocessor("blur_gaussian", _blur_gaussian, (), (Slider("Sigma", 9.0, 0.01, 64.0, 0.01),),
                 control_types=("Tile/Blur",)),
    Preprocessor("inpaint", _identity, ("inpaint_global_harmonious", "inpaint_only"), uses_resolution=False,
                 control_types=("Inpaint",)),
] + [Preprocessor(name, None, unavailable=_NEEDS_MODEL, control_types=(kind,)) for name, kind in [
    ("depth_midas", "Depth"), ("depth_leres", "Depth"), ("depth_leres++", "Depth"), ("depth_zoe", "Depth"),
    ("depth_anything", "Depth"), ("normal_bae", "NormalMap"), ("normal_midas", "NormalMap"),
    ("openpose", "OpenPose"), ("openpose_face", "OpenPose"), ("openpose_faceonly", "OpenPose"),
    ("openpose_full", "OpenPose"), ("openpose_hand", "OpenPose"), ("dw_openpose_full", "OpenPose"),
    ("lineart_realistic", "Lineart"), ("lineart_coarse", "Lineart"), ("lineart_anime", "Lineart"),
    ("lineart_anime_denoise", "Lineart"), ("mlsd", "MLSD"), ("softedge_hed", "SoftEdge"),
    ("softedge_hedsafe", "SoftEdge"), ("softedge_pidinet", "SoftEdge"), ("softedge_pidisafe", "SoftEdge"),
    ("scribble_hed", "Scribble/Sketch"), ("scribble_pidinet", "Scribble/Sketch"), ("seg_ofade20k", "Segmentation"),
    ("seg_ofcoco", "Segmentation"), ("seg_ufade20k", "Segmentation"), ("shuffle", "Shuffle"),
    ("reference_only", "Reference"), ("inpaint_only+lama", "Inpaint"), ("ip-adapter_clip_sd15", "IP-Adapter"),
]]}
_ALIASES = {alias.lower(): p.name for p in PREPROCESSORS.values() for alias in (p.name, *p.aliases)}


def find(name: str) -> Preprocessor:
    """The preprocessor called ``name`` (ours or an A1111 alias, any case); unknown and unavailable ones are a
    :class:`ControlError` that says so."""
    key = _ALIASES.get(str(name).strip().lower())
    if key is None:
        available = [p.name for p in PREPROCESSORS.values() if p.unavailable is None]
        raise ControlError(f"unknown ControlNet preprocessor {name!r}; available: {', '.join(available)}")
    p = PREPROCESSORS[key]
    if p.unavailable:
        raise ControlError(f"ControlNet preprocessor {p.name!r} {p.unavailable}")
    return p


def pixel_perfect_resolution(image_size: tuple[int, int], width: int, height: int, resize_mode: str) -> int:
    """The extension's "pixel perfect" preprocessor resolution for an image of ``image_size`` (w, h) going to a
    ``width`` x ``height`` output: the short side scaled as the resize mode scales the image."""
    raw_w, raw_h = image_size
    k0, k1 = height / raw_h, width / raw_w
    k = min(k0, k1) if resize_mode == "resize-and-fill" else max(k0, k1)
    return int(np.round(k * min(raw_h, raw_w)))


def run(name: str, image: Image.Image, res: int = 512, threshold_a: float | None = None,
        threshold_b: float | None = None) -> Image.Image:
    """The control map of ``image`` by preprocessor ``name`` (an RGB image; the thresholds None: its defaults)."""
    p = find(name)
    a, b = p.defaults
    a = a if threshold_a is None else threshold_a
    b = b if threshold_b is None else threshold_b
    rgb = np.asarray(image.convert("RGB"))
    out = p.run(rgb, int(res), a, b)
    return Image.fromarray(_hwc3(np.asarray(out, dtype=np.uint8)))
