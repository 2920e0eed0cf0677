"""Automatic classification of demo images: foreground colour, background colour and shape.

Written from geometry alone (it does not use the generator's drawing code), so it can judge the model's
outputs:

* **background**: the median colour of the 2-pixel image border, named by the nearest palette colour;
* **foreground colour**: the median of the pixels far from the background colour (more than half the way to
  the palette colour nearest the background), eroded by one pixel when enough remain, named likewise;
* **mask**: each pixel's position along the segment background -> foreground colour (above one half is
  foreground), keeping the largest 4-connected component;
* **shape**, from two scale-free numbers of the mask: its *solidity* (area / convex-hull area; a five-pointed
  star is far from convex, about 0.55) and its *extent* (area / bounding-box area: square 1, circle pi/4,
  upright triangle 1/2).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .data import COLOUR_NAMES, COLOURS

_PALETTE = np.array([COLOURS[n] for n in COLOUR_NAMES], dtype=np.float64)   # (8, 3)
BORDER = 2
MIN_PIXELS = 12          # fewer foreground pixels than this: no shape found
# Thresholds half-way between the clusters of softened shapes (blurred edges, rounded corners): solidity of
# stars about 0.5-0.7, of the convex shapes 0.88 and more; extent of triangles 0.5-0.65, of circles 0.75-0.8,
# of squares 0.92 and more.
STAR_SOLIDITY = 0.80     # below: star
SQUARE_EXTENT = 0.87     # convex shapes: above this extent a square, ...
CIRCLE_EXTENT = 0.70     # ... above this a circle, else a triangle
NONE = "none"


@dataclass
class Classification:
    colour: str
    shape: str
    background: str
    features: dict = field(default_factory=dict)

    @property
    def combo(self) -> tuple[str, str, str]:
        return (self.colour, self.shape, self.background)


def nearest_colour(rgb) -> str:
    d = ((_PALETTE - np.asarray(rgb, dtype=np.float64)) ** 2).sum(axis=1)
    return COLOUR_NAMES[int(d.argmin())]


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask (flood fill; images here are small)."""
    h, w = mask.shape
    labels = np.zeros((h, w), dtype=np.int32)
    best, best_size, current = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if labels[y0, x0]:
            continue
        current += 1
        labels[y0, x0] = current
        stack, size = [(y0, x0)], 0
        while stack:
            y, x = stack.pop()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = current
                    stack.append((ny, nx))
        if size > best_size:
            best, best_size = current, size
    return labels == best if best else np.zeros_like(mask)


def _hull_area(mask: np.ndarray) -> float:
    """Area of the convex hull of the mask's pixel squares (monotone chain over each row's end corners)."""
    pts = set()
    for y in np.nonzero(mask.any(axis=1))[0]:
        xs = np.nonzero(mask[y])[0]
        for x in (xs[0], xs[-1] + 1):
            pts.add((int(x), int(y)))
            pts.add((int(x), int(y) + 1))
    pts = sorted(pts)
    if len(pts) < 3:
        return 0.0

    def cross(o, a, b):
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    lower, upper = [], []
    for p in pts:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], p) <= 0:
            lower.pop()
        lower.append(p)
    for p in reversed(pts):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], p) <= 0:
            upper.pop()
        upper.append(p)
    hull = lower[:-1] + upper[:-1]
    area = 0.0
    for (x1, y1), (x2, y2) in zip(hull, hull[1:] + hull[:1]):
        area += x1 * y2 - x2 * y1
    return abs(area) / 2


def _erode(mask: np.ndarray) -> np.ndarray:
    m = mask.copy()
    m[1:] &= mask[:-1]
    m[:-1] &= mask[1:]
    m[:, 1:] &= mask[:, :-1]
    m[:, :-1] &= mask[:, 1:]
    return m


def shape_from_mask(mask: np.ndarray) -> tuple[str, dict]:
    """Name the shape of a boolean mask; also return the features used."""
    area = int(mask.sum())
    if area < MIN_PIXELS:
        return NONE, {"area": area}
    ys, xs = np.nonzero(mask)
    box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
    extent = area / box
    solidity = area / max(_hull_area(mask), 1.0)
    feats = {"area": area, "extent": round(float(extent), 3), "solidity": round(float(solidity), 3)}
    if solidity < STAR_SOLIDITY:
        return "star", feats
    if extent >= SQUARE_EXTENT:
        return "square", feats
    if extent >= CIRCLE_EXTENT:
        return "circle", feats
    return "triangle", feats


def classify(image) -> Classification:
    """Classify one RGB image (PIL image or (H, W, 3) uint8 array)."""
    img = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, dtype=np.float64)
    border = np.concatenate([img[:BORDER].reshape(-1, 3), img[-BORDER:].reshape(-1, 3),
                             img[:, :BORDER].reshape(-1, 3), img[:, -BORDER:].reshape(-1, 3)])
    bg_rgb = np.median(border, axis=0)
    background = nearest_colour(bg_rgb)
    others = _PALETTE[[i for i, n in enumerate(COLOUR_NAMES) if n != background]]
    threshold = 0.5 * np.sqrt(((others - bg_rgb) ** 2).sum(axis=1)).min()
    far = np.sqrt(((img - bg_rgb) ** 2).sum(axis=2)) > threshold
    if far.sum() < MIN_PIXELS:
        return Classification(NONE, NONE, background, {"area": int(far.sum())})
    core = _erode(far)
    core = core if core.sum() >= MIN_PIXELS else far
    fg_rgb = np.median(img[core], axis=0)
    colour = nearest_colour(fg_rgb)
    # position of every pixel along background -> foreground: above one half is foreground
    axis = fg_rgb - bg_rgb
    alpha = ((img - bg_rgb) @ axis) / max(float(axis @ axis), 1e-6)
    mask = _largest_component(alpha > 0.5)
    shape, feats = shape_from_mask(mask)
    feats.update(bg_rgb=[round(float(v), 1) for v in bg_rgb], fg_rgb=[round(float(v), 1) for v in fg_rgb])
    return Classification(colour, shape, background, feats)


def score(results: list[Classification], combos: list[tuple[str, str, str]]) -> dict[str, float]:
    """Fractions right: colour, shape, background, and all three at once."""
    n = len(combos)
    if n == 0:
        return {"colour": float("nan"), "shape": float("nan"), "background": float("nan"), "all": float("nan"), "n": 0}
    right = np.array([[r.colour == c[0], r.shape == c[1], r.background == c[2]] for r, c in zip(results, combos)])
    return {"colour": float(right[:, 0].mean()), "shape": float(right[:, 1].mean()),
            "background": float(right[:, 2].mean()), "all": float(right.all(axis=1).mean()), "n": n}
