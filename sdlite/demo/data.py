"""The demo model's training data: a seeded, procedural generator of small captioned images.

Each image is one flat-coloured shape (circle, square, triangle pointing up, five-pointed star) on a flat
background of another colour, at a random position and size, drawn anti-aliased (4x supersampled, then
box-filtered down). Every caption names the shape, its colour and the background colour; a few paraphrases
and partial captions (no background / no shape colour) teach the text encoder the words, not one sentence.

Sixteen (colour, shape, background) combinations are held out of training (:data:`HELD_OUT`): every colour
pair, colour/shape pair and background/shape pair of a held-out combination still occurs in training with
other shapes or colours, so the held-out figures measure composition, not unseen words.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 64
SUPERSAMPLE = 4
# sRGB values chosen far apart (closest pair: orange/yellow, about 100 apart in RGB)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (250, 140, 0),
    "yellow": (250, 230, 40),
    "green": (30, 160, 50),
    "blue": (30, 80, 220),
    "purple": (150, 40, 190),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
COLOUR_NAMES = tuple(COLOURS)
SHAPES = ("circle", "square", "triangle", "star")
STAR_INNER_RATIO = 0.40          # inner / outer radius of the star
SIZE_RANGE = (28, 48)            # side of the shape's bounding square, pixels of a 64x64 image
MARGIN = 3                       # pixels kept free at the image border (the border is all background)

# Held out of training: two per foreground colour, two per background colour, four per shape, every
# (colour, background) pair at most once. Built as colour i on colour i+3 / i+5 with shapes i and i+2 (mod 4).
HELD_OUT: tuple[tuple[str, str, str], ...] = (
    ("red", "circle", "green"), ("red", "triangle", "purple"),
    ("orange", "square", "blue"), ("orange", "star", "white"),
    ("yellow", "triangle", "purple"), ("yellow", "circle", "black"),
    ("green", "star", "white"), ("green", "square", "red"),
    ("blue", "circle", "black"), ("blue", "triangle", "orange"),
    ("purple", "square", "red"), ("purple", "star", "yellow"),
    ("white", "triangle", "orange"), ("white", "circle", "green"),
    ("black", "star", "yellow"), ("black", "square", "blue"),
)
ALL_COMBOS: tuple[tuple[str, str, str], ...] = tuple(
    (fg, shape, bg) for fg in COLOUR_NAMES for shape in SHAPES for bg in COLOUR_NAMES if bg != fg)
TRAIN_COMBOS: tuple[tuple[str, str, str], ...] = tuple(c for c in ALL_COMBOS if c not in set(HELD_OUT))

# Caption templates and their sampling weights. The first is the canonical caption.
TEMPLATES: tuple[tuple[str, float], ...] = (
    ("a {fg} {shape} on a {bg} background", 0.40),
    ("a {bg} background with a {fg} {shape}", 0.12),
    ("{fg} {shape}, {bg} background", 0.12),
    ("a {fg} {shape} against a {bg} background", 0.08),
    ("a picture of a {fg} {shape} on {bg}", 0.08),
    ("a {fg} {shape}", 0.10),                      # partial: background unnamed
    ("a {shape} on a {bg} background", 0.10),      # partial: shape colour unnamed
)


@dataclass(frozen=True)
class Scene:
    """What one image shows: ``size`` is the side of the shape's bounding square, (cx, cy) its centre."""

    colour: str
    shape: str
    background: str
    cx: float
    cy: float
    size: float

    @property
    def combo(self) -> tuple[str, str, str]:
        return (self.colour, self.shape, self.background)


def caption(colour: str, shape: str, background: str, template: int = 0) -> str:
    return TEMPLATES[template][0].format(fg=colour, shape=shape, bg=background)


def prompt(combo: tuple[str, str, str]) -> str:
    """The canonical caption of a (colour, shape, background) combination."""
    return caption(*combo)


def shape_polygon(shape: str, cx: float, cy: float, size: float) -> list[tuple[float, float]] | None:
    """The outline of a polygonal shape in its bounding square (None for the circle)."""
    r = size / 2
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":  # equilateral, pointing up, centred vertically in the square
        h = size * math.sqrt(3) / 2
        top, bottom = cy - h / 2, cy + h / 2
        return [(cx, top), (cx + r, bottom), (cx - r, bottom)]
    if shape == "star":  # five points, one pointing up; centred on the middle of its own height
        inner = r * STAR_INNER_RATIO
        height = r * (1 + math.cos(math.pi / 5))
        oy = cy - height / 2 + r            # the centre of the circumscribed circle
        pts = []
        for k in range(10):
            a = -math.pi / 2 + k * math.pi / 5
            rad = r if k % 2 == 0 else inner
            pts.append((cx + rad * math.cos(a), oy + rad * math.sin(a)))
        return pts
    if shape == "circle":
        return None
    raise ValueError(f"unknown shape {shape!r}: expected one of {', '.join(SHAPES)}")


def render(scene: Scene, image_size: int = IMAGE_SIZE) -> np.ndarray:
    """(H, W, 3) uint8 image of ``scene`` (coordinates in units of a 64-pixel image, scaled to ``image_size``)."""
    k = SUPERSAMPLE * image_size / IMAGE_SIZE
    big = image_size * SUPERSAMPLE
    img = Image.new("RGB", (big, big), COLOURS[scene.background])
    draw = ImageDraw.Draw(img)
    fill = COLOURS[scene.colour]
    cx, cy, size = scene.cx * k, scene.cy * k, scene.size * k
    poly = shape_polygon(scene.shape, cx, cy, size)
    if poly is None:
        r = size / 2
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon(poly, fill=fill)
    return np.asarray(img.resize((image_size, image_size), Image.Resampling.BOX))


def random_scene(rng: np.random.Generator, combos=TRAIN_COMBOS) -> Scene:
    """A random combination from ``combos`` at a random size and position fully inside the image."""
    colour, shape, background = combos[rng.integers(len(combos))]
    size = float(rng.uniform(*SIZE_RANGE))
    lo, hi = MARGIN + size / 2, IMAGE_SIZE - MARGIN - size / 2
    cx, cy = float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi))
    return Scene(colour, shape, background, cx, cy, size)


def random_template(rng: np.random.Generator) -> int:
    weights = np.array([w for _, w in TEMPLATES])
    return int(rng.choice(len(TEMPLATES), p=weights / weights.sum()))


def make_dataset(n: int, seed: int, combos=TRAIN_COMBOS, image_size: int = IMAGE_SIZE):
    """``n`` images (n, H, W, 3) uint8 and their scenes, the same for the same (n, seed, combos)."""
    rng = np.random.default_rng(seed)
    scenes = [random_scene(rng, combos) for _ in range(n)]
    images = np.stack([render(s, image_size) for s in scenes]) if scenes else \
        np.zeros((0, image_size, image_size, 3), np.uint8)
    return images, scenes
