"""ControlNet units applied to a sampling run: the control images made ready, and a UNet wrapper that adds the
ControlNets' residuals at each step.

:class:`ControlledUNet` stands where the UNet runner stands in the denoiser (``model(x, t, context=..., ...)``), so
samplers and classifier-free guidance never know about it. Per step it runs each unit whose guidance window covers
the step (diffusers' keep rule; a unit outside it adds nothing, which is what diffusers' zero scale gives), scales
its residuals (the weight, or A1111's soft injection), sums them over the units in order, and hands the sum to the
UNet's ``control`` argument. A "ControlNet is more important" unit runs on the conditional half of the batch only and
gives the unconditional half nothing.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .units import ControlUnit, keep, residual_scales


def legacy_hash(path: str | Path) -> str:
    """A1111's short model hash, as its ControlNet extension shows beside each model ("name [hash]"): the first 8
    hex digits of the SHA-256 of the 64 KiB at offset 1 MiB of the weights file (a folder: its weights file)."""
    p = Path(path)
    if p.is_dir():
        from ..weights.controlnet import DIFFUSERS_WEIGHTS

        files = [p / n for n in DIFFUSERS_WEIGHTS if (p / n).is_file()]
        if not files:
            return "NOFILE"
        p = files[0]
    with open(p, "rb") as f:
        f.seek(0x100000)
        return hashlib.sha256(f.read(0x10000)).hexdigest()[:8]


# --- control images --------------------------------------------------------------------------------------------


def _resize_map(x: np.ndarray, width: int, height: int) -> np.ndarray:
    """A control map to ``width`` x ``height`` the way the extension's ``high_quality_resize`` chooses its filter:
    nearest for maps of a few flat colours (segmentation-like, 3 to 199 colours), area to shrink, bicubic to enlarge;
    a black-and-white map (edges, scribbles) is made black-and-white again after (Otsu's threshold)."""
    import cv2

    if x.shape[:2] == (height, width):
        return x
    colours = len(np.unique(x.reshape(-1, x.shape[2]), axis=0))
    smaller = width * height < x.shape[0] * x.shape[1]
    binary = colours == 2 and x.min() < 16 and x.max() > 240
    if 2 < colours < 200:
        interpolation = cv2.INTER_NEAREST
    else:
        interpolation = cv2.INTER_AREA if smaller else cv2.INTER_CUBIC
    y = cv2.resize(x, (width, height), interpolation=interpolation)
    if binary:
        grey = np.mean(y.astype(np.float32), axis=2).clip(0, 255).astype(np.uint8)
        _, grey = cv2.threshold(grey, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
        y = np.stack([grey] * 3, axis=2)
    return y


def fit_control(image: Image.Image, width: int, height: int, resize_mode: str) -> Image.Image:
    """The control map fitted to the output size by the extension's resize modes: "just-resize" stretches;
    "crop-and-resize" scales to cover and crops the centre; "resize-and-fill" scales to fit and fills the rest with
    the median colour of the map's border."""
    x = np.asarray(image.convert("RGB"))
    h, w = x.shape[:2]
    if resize_mode == "just-resize":
        return Image.fromarray(_resize_map(x, width, height))
    k0, k1 = height / h, width / w
    if resize_mode == "resize-and-fill":
        k = min(k0, k1)
        border = np.concatenate([x[0], x[-1], x[:, 0], x[:, -1]], axis=0)
        canvas = np.tile(np.median(border, axis=0).astype(np.uint8)[None, None], (height, width, 1))
        nw, nh = max(1, int(round(w * k))), max(1, int(round(h * k)))
        y = _resize_map(x, min(nw, width), min(nh, height))
        top, left = (height - y.shape[0]) // 2, (width - y.shape[1]) // 2
        canvas[top:top + y.shape[0], left:left + y.shape[1]] = y
        return Image.fromarray(canvas)
    k = max(k0, k1)   # crop-and-resize
    nw, nh = max(width, int(round(w * k))), max(height, int(round(h * k)))
    y = _resize_map(x, nw, nh)
    top, left = (nh - height) // 2, (nw - width) // 2
    return Image.fromarray(np.ascontiguousarray(y[top:top + height, left:left + width]))


def hint_tensor(image: Image.Image, mask: Image.Image | None = None) -> torch.Tensor:
    """(1, 3, H, W) float32 in [0, 1], as diffusers' pipelines give a ControlNet its image; with ``mask`` (the inpaint
    ControlNet's input) the masked pixels (mask >= 0.5) are -1."""
    x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
    if mask is not None:
        m = torch.from_numpy(np.asarray(mask.convert("L").resize(image.size), dtype=np.float32) / 255.0)
        x = torch.where(m[None, None] >= 0.5, torch.tensor(-1.0), x)
    return x.contiguous()


# --- the run ---------------------------------------------------------------------------------------------------


@dataclass
class ActiveControl:
    """One unit ready for a run: its network, its control image at the output size, and its residual factors."""

    unit: ControlUnit
    net: torch.nn.Module          # a ControlNet (or one streaming its weights, memory mode 0)
    hint: torch.Tensor            # (1, 3, H, W)
    label: str                    # "name [hash]"
    map: tuple = ()               # (unit index, the control map image, its mask or None), for callers to show
    _encoded: dict = field(default_factory=dict, repr=False)   # (device, dtype) -> the hint encoder's output

    def encoded(self, x: torch.Tensor) -> torch.Tensor:
        """The hint encoder's output (1, C0, h, w) for inputs like ``x``: it depends on the image alone, so it is
        computed once per run rather than at every step."""
        key = (x.device, x.dtype)
        if key not in self._encoded:
            self._encoded[key] = self.net.encode_hint(self.hint.to(x.device), x.dtype)
        return self._encoded[key]

    @property
    def scales(self) -> list[float]:
        return residual_scales(self.unit, self.net.control_config.residuals)


class ControlledUNet:
    """``unet`` with ``controls`` added: called as the UNet is. ``cfg``: the batch is the doubled batch of
    classifier-free guidance (unconditional half first). ``step`` / ``steps``: the run's current step (0-based) and
    its length, for the guidance windows; the sampling loop advances ``step``."""

    def __init__(self, unet, controls: list[ActiveControl], cfg: bool, steps: int, step: int = 0):
        self.unet, self.controls, self.cfg, self.steps, self.step = unet, controls, cfg, steps, step

    def residuals(self, x, t, context, added: dict):
        down = mid = None
        batch = x.shape[0]
        half = batch // 2 if self.cfg and batch % 2 == 0 else 0
        for c in self.controls:
            u = c.unit
            if not keep(self.step, self.steps, u.guidance_start, u.guidance_end):
                continue
            rows = slice(half, batch) if (u.cond_only and half) else slice(0, batch)
            n = rows.stop - rows.start
            xin = x[rows, :c.net.control_config.unet.in_channels]
            tt = t.reshape(-1)
            tt = tt[rows] if tt.numel() == batch else tt
            extra = {k: (v[rows] if isinstance(v, torch.Tensor) and v.shape[0] == batch else v)
                     for k, v in added.items()}
            hint = c.encoded(xin).expand(n, -1, -1, -1)
            d, m = c.net(xin, tt, context[rows], hint, c.scales, encoded=True, **extra)
            if n != batch:   # the unconditional half gets nothing
                d = [torch.cat([torch.zeros_like(r), r]) for r in d]
                m = torch.cat([torch.zeros_like(m), m])
            if down is None:
                down, mid = d, m
            else:
                down = [a + b for a, b in zip(down, d)]
                mid = mid + m
        return None if down is None else (down, mid)

    def __call__(self, x, t, context=None, **extra):
        added = {k: extra[k] for k in ("text_embeds", "time_ids", "class_labels") if extra.get(k) is not None}
        control = self.residuals(x, t, context, added)
        return self.unet(x, t, context=context, control=control, **extra)
