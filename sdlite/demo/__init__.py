"""The embedded demo model: a toy Stable Diffusion that draws coloured shapes, shipped as package data.

    from sdlite.demo import model_path, DEFAULT_PROMPT
    engine = Engine.load(model_path())
    engine.generate(Request(DEFAULT_PROMPT, seed=1)).images[0]

It is the SD 1.x architecture at toy size (``sdlite.config.DEMO``), trained by ``tools/train_demo.py`` on the
procedural images of :mod:`sdlite.demo.data`; :mod:`sdlite.demo.classify` names what an image shows, so the
model's outputs can be checked automatically (:func:`evaluate`).
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import math

from .data import COLOUR_NAMES, COLOURS, HELD_OUT, SHAPES, caption, prompt

DEFAULT_PROMPT = "a red circle on a blue background"
DEFAULT_CFG = 7.5          # guidance scale the quality figures are measured at (the engine's default)
DEFAULT_STEPS = 20
EVAL_SEED = 1000           # image i of an evaluation set uses seed EVAL_SEED + i


DEFAULT_PROMPT_ZH = "蓝色背景上的红色圆形"   # the default prompt in Chinese (sdlite.demo.zh)


def model_path(name: str = "demo") -> Path:
    """A shipped diffusers folder (inside the installed package): ``demo``, or ``demo-zh``, the demo model with a
    Chinese text encoder (tiny BERT; its UNet, VAE and scheduler are the demo's, shared)."""
    if name not in ("demo", "demo-zh"):
        raise ValueError(f"unknown demo model {name!r}: expected 'demo' or 'demo-zh'")
    return Path(str(resources.files("sdlite").joinpath("data", name)))


def _eval_seen() -> tuple[tuple[str, str, str], ...]:
    """48 training combinations: colour i on colour i+1+k with shape i+k (k = 0..5), so every colour is the
    shape's colour 6 times and the background 6 times, every shape appears 12 times, no pair twice."""
    out = []
    for k in range(6):
        for i, fg in enumerate(COLOUR_NAMES):
            combo = (fg, SHAPES[(i + k) % len(SHAPES)], COLOUR_NAMES[(i + 1 + k) % len(COLOUR_NAMES)])
            assert combo not in HELD_OUT
            out.append(combo)
    return tuple(out)


EVAL_SEEN = _eval_seen()
EVAL_HELD_OUT = HELD_OUT
NEGATIVE_SET = EVAL_SEEN[:16]   # the negative-prompt check: these shapes and backgrounds, colour unnamed
_FARTHEST = math.dist((0, 0, 0), (255, 255, 255))


def colourless_prompt(combo) -> str:
    """A prompt naming the shape and the background but not the shape's colour (a trained partial caption)."""
    return caption(*combo, template=6)


def colour_error(results, combos) -> float:
    """Mean RGB distance between each image's foreground colour (median of its pixels) and the palette colour
    the prompt names; an image with no foreground counts as the largest possible distance."""
    dists = [math.dist(r.features["fg_rgb"], COLOURS[c[0]]) if "fg_rgb" in r.features else _FARTHEST
             for r, c in zip(results, combos)]
    return sum(dists) / len(dists)


def star_solidity(results, combos) -> float:
    """Mean solidity (area / convex-hull area) of the images asked for a star: 0.5 for the generator's crisp
    stars, higher as the points blur into a pentagon (1 when there is no foreground)."""
    values = [r.features.get("solidity", 1.0) for r, c in zip(results, combos) if c[1] == "star"]
    return sum(values) / len(values)


def generate(engine, combos, *, cfg: float = DEFAULT_CFG, steps: int = DEFAULT_STEPS, seed: int = EVAL_SEED,
             negative=None, sampler: str | None = None, prompts=prompt):
    """One image per combination (``prompts(combo)``: the canonical caption), image i with seed ``seed + i``.

    ``negative``: None, one negative prompt for all, or a function (i, combo) -> negative prompt.
    """
    from ..pipeline import DEFAULT_SAMPLER, Request

    images = []
    for i, combo in enumerate(combos):
        neg = negative(i, combo) if callable(negative) else (negative or "")
        r = Request(prompt=prompts(combo), negative_prompt=neg, steps=steps, cfg_scale=cfg, seed=seed + i,
                    sampler=sampler or DEFAULT_SAMPLER)
        images.append(engine.generate(r).images[0])
    return images


def evaluate(engine, combos, **kwargs) -> tuple[dict, list]:
    """Generate and classify: (accuracy figures, classifications)."""
    from .classify import classify, score

    results = [classify(im) for im in generate(engine, combos, **kwargs)]
    return score(results, list(combos)), results


__all__ = ["model_path", "DEFAULT_PROMPT", "DEFAULT_PROMPT_ZH", "DEFAULT_CFG", "DEFAULT_STEPS", "EVAL_SEEN", "EVAL_HELD_OUT",
           "EVAL_SEED", "NEGATIVE_SET", "colourless_prompt", "colour_error", "star_solidity", "generate",
           "evaluate"]
