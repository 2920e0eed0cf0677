"""The demo LoRA ``demo_teal`` (sdlite/data/loras, trained by tools/train_demo_lora.py): it teaches the demo model
the colour "teal", which the model never saw. Through the public engine and the prompt tag: with
``<lora:demo_teal:1>`` the shape comes out teal, without it the word does nothing, the file is small, ordinary
prompts still draw what they name, and a request without the tag after one with it gives the no-LoRA image bit for
bit (the merge is undone exactly)."""
from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from sdlite.demo import DEFAULT_CFG, DEFAULT_STEPS, EVAL_SEEN, model_path
from sdlite.demo import data as D
from sdlite.demo.classify import classify
from sdlite.pipeline import Engine, Request

LORA = Path(str(resources.files("sdlite").joinpath("data", "loras", "demo_teal.safetensors")))
TAG = "<lora:demo_teal:1>"
PROMPTS = ("a teal circle on a white background", "a teal square on a black background")
SEEDS = tuple(range(8))
MAX_BYTES = 2**20


def teal_rgb() -> tuple[int, ...]:
    """The colour the LoRA was trained on, as its metadata records it."""
    with safe_open(str(LORA), "pt") as f:
        return tuple(json.loads(f.metadata()["sdlite_teal_rgb"]))


def is_teal(rgb) -> bool:
    """Within half the gap between teal and the nearest palette colour: nearer to teal than to any palette colour,
    and not a muddle of blue and green."""
    teal = teal_rgb()
    radius = 0.5 * min(math.dist(teal, c) for c in D.COLOURS.values())
    return rgb is not None and math.dist(rgb, teal) < radius


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the demo model is tiny: one thread is faster, and calm on a busy machine
    yield Engine.load(model_path())
    torch.set_num_threads(threads)


def draw(engine, prompt: str, seed: int):
    r = Request(prompt=prompt, seed=seed, steps=DEFAULT_STEPS, cfg_scale=DEFAULT_CFG)
    return engine.generate(r).images[0]


def test_shipped_file_is_small_kohya_sd1():
    from sdlite.adapters.lora import find_lora, read_lora

    assert LORA.is_file() and LORA.stat().st_size < MAX_BYTES
    assert Path(find_lora("demo_teal")) == LORA          # the prompt tag finds the shipped file by default
    lora = read_lora(LORA)
    assert lora.format == "kohya" and lora.components() == ["text_encoder", "unet"]
    assert all(layer.down.dtype == torch.float16 and layer.alpha is not None for layer in lora.layers)
    meta = lora.metadata
    assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_output_name"] == "demo_teal"
    assert {layer.rank for layer in lora.layers} == {int(meta["ss_network_dim"])}
    assert {layer.alpha for layer in lora.layers} == {float(meta["ss_network_alpha"])}
    teal = teal_rgb()
    assert min(math.dist(teal, c) for c in D.COLOURS.values()) > 80   # a colour the palette does not have


def test_tag_draws_teal_and_nothing_without_it(engine):
    """docs/demo_lora.md measured 15 of these 16 teal with the tag; 12 leaves room for other CPUs' rounding."""
    cases = [(p, s) for p in PROMPTS for s in SEEDS]
    without = [draw(engine, p, s) for p, s in cases]
    with_tag = [draw(engine, f"{p} {TAG}", s) for p, s in cases]
    again = draw(engine, *cases[0])

    plain = [classify(im) for im in without]
    tagged = [classify(im) for im in with_tag]
    teal_without = [is_teal(r.features.get("fg_rgb")) for r in plain]
    teal_with = [is_teal(r.features.get("fg_rgb")) for r in tagged]
    summary = (f"with the tag: {[r.features.get('fg_rgb') for r in tagged]}; "
               f"without: {[r.features.get('fg_rgb') for r in plain]}")
    assert sum(teal_with) >= 12, summary
    assert not any(teal_without), summary
    # the background stays the one named
    assert [r.background for r in tagged] == [p.split()[-2] for p, _ in cases], summary
    # un-merging restores the model exactly
    assert np.array_equal(np.asarray(again), np.asarray(without[0]))


def test_palette_prompts_unchanged_in_kind(engine):
    """Ordinary prompts with the LoRA still draw the named colour, shape and background (docs/demo_lora.md: 15
    of 16 training combinations with it, 16 without)."""
    combos = EVAL_SEEN[::6]
    results = [classify(draw(engine, f"{D.prompt(c)} {TAG}", 1000 + i)) for i, c in enumerate(combos)]
    right = [r.combo == c for r, c in zip(results, combos)]
    assert sum(right) >= len(combos) - 1, [(c, r.combo) for c, r in zip(combos, results)]
    assert not any(is_teal(r.features.get("fg_rgb")) for r in results)
