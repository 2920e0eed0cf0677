"""The step cache (DeepCache, ``sdlite.engine.stepcache``): the UNet's partial forward, the schedule of full and cached
steps, a fresh cache for every run and pass, ControlNet, batches and CFG, the front-ends' options, and the cached image
against the uncached one on the demo model.

The partial forward is checked against the UNet's own full forward: a cached step whose input equals the full step's
must give the full step's output exactly, at every skip branch (on an odd latent size too, so the upsamplers' target
sizes come from the shallow path), with and without ControlNet residuals; with interval 1 (no reuse) a run is the
uncached run exactly.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from sdlite.control import ControlUnit
from sdlite.demo import DEFAULT_PROMPT, model_path
from sdlite.engine.stepcache import StepCache, StepCacheError, branches, parse
from sdlite.hires import Hires
from sdlite.models.unet import UNet
from sdlite.pipeline import Engine, Request, RequestError, validate
from tests.reference import TINY_UNET_SD1, seed_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py

# the demo model, 20 steps, 8 seeds (1000..1007), interval 2, branch 5 (its deepest): measured by bench/stepcache.py
# here (the lowest PSNR of the 8 against the uncached images; DEFAULT_PROMPT, no negative) at 38.4 dB, mean 42.3;
# asserted with a margin
DEMO_CONFIG = (2, 5)
DEMO_MIN_PSNR = 36.0


@pytest.fixture(scope="module")
def unet():
    torch.manual_seed(0)
    return seed_all(UNet(TINY_UNET_SD1)).eval()


@pytest.fixture(scope="module")
def engine():
    return Engine.load(model_path())


def _inputs(batch=2, h=16, w=14, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, h, w, generator=g), torch.full((batch,), 500.0),
            torch.randn(batch, 77, 32, generator=g))


def psnr(a, b) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0 ** 2 / mse))


# --- the UNet's partial forward --------------------------------------------------------------------------------


def test_cached_step_on_the_same_input_is_the_full_step_at_every_branch(unet):
    x, t, c = _inputs()
    g = torch.Generator().manual_seed(2)
    n = branches(unet)
    assert n == 6   # 2 levels x (2 layers + 1)
    down = [torch.randn(s, generator=g) for s in _skip_shapes(unet, x)]
    mid = torch.randn(2, 64, 8, 7, generator=g)
    with torch.no_grad():
        for control in (None, (down, mid)):
            ref = unet(x, t, c, control=control)
            for b in range(n):
                cache = StepCache(2, b, 4, final=False).checked(unet)
                model = cache.wrap(unet)
                full = model(x, t, c, control=control)
                cache.step = 1
                cached = model(x, t, c, control=control)
                assert (cache.full_calls, cache.cached_calls) == (1, 1)
                assert torch.equal(full, ref) and torch.equal(cached, ref), (b, control is None)


def _skip_shapes(unet, x):
    shapes = []
    hook = unet.conv_in.register_forward_hook(lambda m, a, out: shapes.append(out.shape))
    handles = [hook]
    for block in unet.down_blocks:
        for i, r in enumerate(block.resnets):
            handles.append((block.attentions[i] if hasattr(block, "attentions") else r).register_forward_hook(
                lambda m, a, out: shapes.append(out.shape)))
        if hasattr(block, "downsamplers"):
            handles.append(block.downsamplers[0].register_forward_hook(lambda m, a, out: shapes.append(out.shape)))
    with torch.no_grad():
        unet(x, torch.full((x.shape[0],), 500.0), torch.zeros(x.shape[0], 77, 32))
    for h in handles:
        h.remove()
    return shapes


def test_a_cached_step_runs_only_the_shallow_branch(unet):
    x, t, c = _inputs()
    calls = []
    layers = [("mid", unet.mid_block)]
    for name, blocks in (("down", unet.down_blocks), ("up", unet.up_blocks)):
        layers += [(f"{name}{i}.{j}", r) for i, block in enumerate(blocks) for j, r in enumerate(block.resnets)]
    handles = [m.register_forward_pre_hook(lambda m, a, name=name: calls.append(name)) for name, m in layers]
    try:
        for branch, shallow in ((0, ["up1.2"]), (1, ["down0.0", "up1.1", "up1.2"]),
                                (3, ["down0.0", "down0.1", "up0.2", "up1.0", "up1.1", "up1.2"])):   # skip 3: the downsampler's
            cache = StepCache(3, branch, 3, final=False)
            model = cache.wrap(unet)
            calls.clear()
            with torch.no_grad():
                model(x, t, c)
                assert len(calls) == len(layers)   # a full step: every layer once
                calls.clear()
                cache.step = 1
                model(x + 0.1, t * 0.9, c)
            assert calls == shallow, branch
    finally:
        for h in handles:
            h.remove()


def test_interval_one_is_the_uncached_run(engine):
    base = Request(DEFAULT_PROMPT, seed=5, steps=6, batch_size=2)
    plain = engine.generate(base)
    for branch in (0, 3):
        cached = engine.generate(base.replace(cache_interval=1, cache_branch=branch))
        assert torch.equal(cached.latents, plain.latents)
    assert cached.infotext["Step cache"] == "DeepCache interval 1 branch 3"
    assert "Step cache" not in plain.infotext


# --- the schedule, per run and pass -----------------------------------------------------------------------------


def _counting(engine, monkeypatch):
    """Every step cache the engine makes, kept; and the demo UNet's middle-block runs (one per full call)."""
    made = []
    original = engine.step_cache
    monkeypatch.setattr(engine, "step_cache", lambda r, unet, steps: made.append(original(r, unet, steps))
                        or made[-1])
    mids = []
    with engine.models.use("unet") as unet:
        handle = unet.mid_block.register_forward_pre_hook(lambda m, a: mids.append(a[0].shape[0]))
    return made, mids, handle


def test_full_steps_follow_the_policy_and_each_request_starts_afresh(engine, monkeypatch):
    made, mids, handle = _counting(engine, monkeypatch)
    try:
        r = Request(DEFAULT_PROMPT, seed=3, steps=8, cache_interval=3, cache_branch=1)
        first = engine.generate(r)
        assert StepCache(3, 1, 8).is_full(7) and [s for s in range(8) if StepCache(3, 1, 8).is_full(s)] == [0, 3, 6, 7]
        assert len(made) == 1 and (made[0].full_calls, made[0].cached_calls) == (4, 4)
        assert mids == [2] * 4   # CFG's two halves in one call: both full, or both cached
        second = engine.generate(r)   # nothing carried over: the same image, the same calls
        assert torch.equal(first.latents, second.latents)
        assert len(made) == 2 and (made[1].full_calls, made[1].cached_calls) == (4, 4) and len(mids) == 8
        # a second-order sampler calls twice a step (but once on the last): each call of a cached step is cached
        mids.clear()
        engine.generate(r.replace(sampler="heun", steps=4, cache_interval=2))
        assert (made[2].full_calls, made[2].cached_calls) == (5, 2) and len(mids) == 5   # steps 0, 2, 3 full
    finally:
        handle.remove()


def test_hires_and_img2img_passes_each_get_a_fresh_cache(engine, monkeypatch):
    made, mids, handle = _counting(engine, monkeypatch)
    try:
        r = Request(DEFAULT_PROMPT, seed=4, steps=6, width=64, height=64, cache_interval=2,
                    hires=Hires(scale=1.5, upscaler="Latent", denoise=0.5))
        result = engine.generate(r)
        assert result.images[0].size == (96, 96)
        # pass 1: 6 steps, full 0, 2, 4, 5; pass 2 (img2img at 0.5): its 3 steps, full 0, 2 (the last)
        assert [(c.steps, c.full_calls, c.cached_calls) for c in made] == [(6, 4, 2), (3, 2, 1)]
        source = result.images[0].resize((64, 64))
        made.clear()
        engine.generate(Request(DEFAULT_PROMPT, seed=4, steps=8, init_image=source, strength=0.5, cache_interval=3))
        assert [(c.steps, c.full_calls, c.cached_calls) for c in made] == [(4, 2, 2)]   # steps 0 and 3 full
    finally:
        handle.remove()


def test_a_batch_is_each_image_cached_alone(engine):
    r = Request(DEFAULT_PROMPT, seed=20, steps=8, batch_size=2, cache_interval=3, cache_branch=2)
    both = engine.generate(r)
    for i in range(2):
        alone = engine.generate(r.replace(seed=20 + i, batch_size=1))
        assert torch.allclose(both.latents[i], alone.latents[0], atol=1e-4)


def test_controlnet_runs_with_the_cache(engine):
    control = Image.new("RGB", (64, 64))
    ImageDraw.Draw(control).ellipse((8, 8, 38, 38), fill="white")
    unit = ControlUnit(model_path().parent / "controlnets" / "demo-position", control)
    r = Request(DEFAULT_PROMPT, seed=9, steps=8, controls=(unit,))
    plain = engine.generate(r)
    assert torch.equal(engine.generate(r.replace(cache_interval=1)).latents, plain.latents)
    cached = engine.generate(r.replace(cache_interval=2, cache_branch=5))
    uncontrolled = engine.generate(r.replace(controls=(), cache_interval=2, cache_branch=5))
    # the cached run follows the control: nearer the controlled image than the uncontrolled cached run is
    assert psnr(cached.images[0], plain.images[0]) > psnr(uncontrolled.images[0], plain.images[0]) + 3


# --- quality -----------------------------------------------------------------------------------------------------


def test_cached_demo_images_stay_near_the_uncached_ones(engine):
    r = Request(DEFAULT_PROMPT, seed=1000, steps=20, batch_size=8)
    plain = engine.generate(r).images
    interval, branch = DEMO_CONFIG
    cached = engine.generate(r.replace(cache_interval=interval, cache_branch=branch)).images
    scores = [psnr(a, b) for a, b in zip(cached, plain)]
    assert min(scores) >= DEMO_MIN_PSNR, scores
    assert max(scores) < 80   # and it is not the uncached run


# --- options and refusals ----------------------------------------------------------------------------------------


def test_options_are_checked():
    assert parse("3") == (3, 0) and parse("5:2") == (5, 2) and parse("on") == (3, 0) and parse("off")[0] == 0
    for bad in ("x", "3:y", "-1", "3:-1", "99"):
        with pytest.raises(StepCacheError, match="step cache"):
            parse(bad)
    for fields in ({"cache_interval": -1}, {"cache_interval": 2.5}, {"cache_interval": 3, "cache_branch": -2}):
        with pytest.raises(RequestError, match="step cache"):
            validate(Request("x", **fields))
    assert validate(Request("x")).cache_interval == 0   # off by default


def test_the_engine_refuses_what_it_cannot_cache(engine, monkeypatch):
    with pytest.raises(RequestError, match="branch 6 is not valid.*6 skip branches"):
        engine.generate(Request("x", steps=2, cache_interval=2, cache_branch=6))
    monkeypatch.setattr(engine.models, "compile", True)
    with pytest.raises(RequestError, match="compiled UNet"):
        engine.generate(Request("x", steps=2, cache_interval=2))


def test_the_front_ends_take_the_cache():
    from sdlite.cli import build_parser
    from sdlite.cli.generate import _cache_option
    from sdlite.server.a1111.api import Txt2ImgRequest, build_plan, default_options

    args = build_parser().parse_args(["generate", "x", "--cache"])
    assert _cache_option(args.cache) == {"cache_interval": 3, "cache_branch": 0}
    assert _cache_option(build_parser().parse_args(["generate", "x", "--cache", "4:2"]).cache) == {
        "cache_interval": 4, "cache_branch": 2}
    assert _cache_option(build_parser().parse_args(["generate", "x"]).cache) == {}
    plan = build_plan(Txt2ImgRequest(prompt="x", sdlite_cache="2:3"), default_options(), max_image_bytes=2**20)
    assert (plan.requests[0].cache_interval, plan.requests[0].cache_branch) == (2, 3)
    plan = build_plan(Txt2ImgRequest(prompt="x", sdlite_cache=4), default_options(), max_image_bytes=2**20)
    assert (plan.requests[0].cache_interval, plan.requests[0].cache_branch) == (4, 0)
    assert build_plan(Txt2ImgRequest(prompt="x"), default_options(), max_image_bytes=2**20).requests[0].cache_interval == 0
    with pytest.raises(RequestError, match="sdlite_cache"):
        build_plan(Txt2ImgRequest(prompt="x", sdlite_cache="fast"), default_options(), max_image_bytes=2**20)
