"""Chinese captions of the demo scenes, for the ``demo-zh`` text encoder (trained by ``tools/train_demo_zh.py``).

The same scenes as :mod:`sdlite.demo.data`, described in Chinese: eight colour names (红色 ... 黑色, and their
one-character forms 红 ... 黑), four shapes with a few names each (圆形/圆/圆圈, 正方形/方形/方块, 三角形/三角,
星星/星形/五角星), and paraphrase templates. Each Chinese caption is paired with the English caption whose meaning
it has: a full caption with the canonical English one (``a red circle on a blue background``), a partial one with
the English partial caption (``a red circle``, ``a circle on a blue background``).
"""
from __future__ import annotations

import numpy as np

from .data import COLOUR_NAMES, SHAPES, caption

COLOURS_ZH: dict[str, str] = {
    "red": "红色", "orange": "橙色", "yellow": "黄色", "green": "绿色",
    "blue": "蓝色", "purple": "紫色", "white": "白色", "black": "黑色",
}
SHAPES_ZH: dict[str, tuple[str, ...]] = {   # the first name is the canonical one
    "circle": ("圆形", "圆", "圆圈"),
    "square": ("正方形", "方形", "方块"),
    "triangle": ("三角形", "三角"),
    "star": ("星星", "星形", "五角星"),
}
assert set(COLOURS_ZH) == set(COLOUR_NAMES) and set(SHAPES_ZH) == set(SHAPES)

# (template, English template index it means, weight). {fg}/{bg}: colour names (红色, or 红 where {fgs}/{bgs});
# {shape}: a name of the shape. The first is the canonical caption.
TEMPLATES_ZH: tuple[tuple[str, int, float], ...] = (
    ("{bg}背景上的{fg}{shape}", 0, 0.22),
    ("{bg}背景上有一个{fg}的{shape}", 0, 0.10),
    ("一个{fg}{shape}，{bg}背景", 0, 0.10),
    ("在{bg}的背景上画一个{fg}{shape}", 0, 0.10),
    ("{fg}的{shape}，背景是{bg}", 0, 0.10),
    ("一张{bg}底的图片，上面是{fg}{shape}", 0, 0.08),
    ("{bgs}底{fgs}{shape}", 0, 0.08),
    ("一个{fg}的{shape}", 5, 0.11),            # partial: background unnamed
    ("{bg}背景上的{shape}", 6, 0.11),           # partial: shape colour unnamed
)
FULL_TEMPLATES = tuple(i for i, (_, en, _) in enumerate(TEMPLATES_ZH) if en == 0)


def caption_zh(colour: str, shape: str, background: str, template: int = 0, shape_name: int = 0) -> str:
    """The Chinese caption of a scene: ``template`` of :data:`TEMPLATES_ZH`, the shape's ``shape_name``-th name."""
    text, _, _ = TEMPLATES_ZH[template]
    fg, bg = COLOURS_ZH[colour], COLOURS_ZH[background]
    names = SHAPES_ZH[shape]
    return text.format(fg=fg, bg=bg, fgs=fg[0], bgs=bg[0], shape=names[shape_name % len(names)])


def prompt_zh(combo: tuple[str, str, str]) -> str:
    """The canonical Chinese caption: ``蓝色背景上的红色圆形`` for (red, circle, blue)."""
    return caption_zh(*combo)


def english_for(combo: tuple[str, str, str], template: int) -> str:
    """The English caption a Chinese caption (of ``template``) means."""
    return caption(*combo, template=TEMPLATES_ZH[template][1])


def paraphrase_zh(combo: tuple[str, str, str], rng: np.random.Generator) -> str:
    """A random full Chinese caption of ``combo`` (any full template, any shape name)."""
    template = int(rng.choice(FULL_TEMPLATES))
    return caption_zh(*combo, template=template, shape_name=int(rng.integers(len(SHAPES_ZH[combo[1]]))))


def random_template_zh(rng: np.random.Generator) -> int:
    weights = np.array([w for _, _, w in TEMPLATES_ZH])
    return int(rng.choice(len(TEMPLATES_ZH), p=weights / weights.sum()))


def all_captions_zh() -> list[str]:
    """Every Chinese caption the templates make (for building the vocabulary)."""
    out = []
    for fg in COLOUR_NAMES:
        for shape in SHAPES:
            for bg in COLOUR_NAMES:
                for t in range(len(TEMPLATES_ZH)):
                    for n in range(len(SHAPES_ZH[shape])):
                        out.append(caption_zh(fg, shape, bg, t, n))
    return out
