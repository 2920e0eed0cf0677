"""The first-block cache (``sdlite.engine.blockcache``, ``--cache`` on a transformer) on the tiny FLUX.1, SD3 and
Z-Image networks and end to end on the tiny FLUX.1 pipeline: off or at threshold 0 the uncached output bit for bit; a
skipped call gives the full call's output back (to rounding) on the same input; skips counted; the image of a run that
skips most of its steps stays within a stated bound; the infotext; the options and their errors.

The tiny random networks change their first block's residual by 50-150% from one step to the next (measured: the
timestep modulation of random weights is large), so the default threshold (0.08) skips nothing on them; the skipping
tests use the largest threshold, 1.0.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sdlite.config.flux import FluxConfig
from sdlite.config.mmdit import MMDiTConfig
from sdlite.engine.blockcache import (DEFAULT_THRESHOLD, BlockCache, BlockCacheError, cache_infotext,
                                      parse_threshold, relative_change)
from sdlite.models.flux import Flux
from sdlite.models.mmdit import MMDiT
from sdlite.models.zimage import ZImage
from sdlite.pipeline import Engine, Request, RequestError, validate
from tests.reference import seed_all
from tests.test_flux_model import TINY as FLUX_TINY
from tests.test_mmdit import TINY as MMDIT_TINY
from tests.test_zimage_model import TINY as ZIMAGE_TINY

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the tiny FLUX.1 dev pipeline (tests/test_flux_pipeline.py), 20 Euler steps at threshold 1.0, seed 1000: measured
# here at 29.3 dB PSNR and 39/255 largest pixel difference against the uncached image (seeds 1001-1003: 25.9, 22.5,
# 28.0 dB); asserted with a margin. The bound is loose because this tiny random network's first-block residual
# changes by 50-150% a step, so threshold 1.0 reuses residuals up to 100% stale; it guards the mechanism (the same
# picture, near), not the quality a trained model gets at the default threshold.
RUN_STEPS, RUN_MIN_PSNR, RUN_MAX_DIFF = 20, 26.0, 64


def _flux():
    torch.manual_seed(0)
    model = seed_all(Flux(FluxConfig(**FLUX_TINY)).eval(), 3, scale=0.15)
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 7, 32, generator=g), torch.randn(2, 24, generator=g))
    return model, lambda m, x, t, **kw: m(x, t, args[1], args[2], **kw), args[0]


def _mmdit():
    model = seed_all(MMDiT(MMDiTConfig(**MMDIT_TINY)).eval(), 3, scale=0.15)
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 7, 32, generator=g), torch.randn(2, 16, generator=g))
    return model, lambda m, x, t, **kw: m(x, t * 1000, args[1], args[2], **kw), args[0]


def _zimage():
    model = seed_all(ZImage(ZIMAGE_TINY).eval(), 3, scale=0.15)
    g = torch.Generator().manual_seed(1)
    x, caps = torch.randn(2, 16, 8, 8, generator=g), [torch.randn(5, 48, generator=g), torch.randn(9, 48, generator=g)]
    return model, lambda m, x, t, **kw: m(x, 1 - t, caps, **kw), x


NETWORKS = {"flux": _flux, "sd3": _mmdit, "zimage": _zimage}


def _steps(call, model, x, n=4):
    """``n`` Euler-like calls on a falling t; the outputs."""
    outs = []
    for i in range(n):
        t = torch.full((2,), 1.0 - i / (n + 1))
        out = call(model, x, t)
        outs.append(out)
        x = x - out / (n + 1)
        if isinstance(model, type(BlockCache().wrap(None))):
            model.cache.step += 1
    return outs


@pytest.mark.parametrize("name", NETWORKS)
def test_threshold_zero_is_the_uncached_network_bit_for_bit(name):
    model, call, x = NETWORKS[name]()
    with torch.no_grad():
        plain = _steps(call, model, x)
        cache = BlockCache(0.0)
        cached = _steps(call, cache.wrap(model), x)
    assert all(torch.equal(a, b) for a, b in zip(plain, cached))
    assert (cache.full_calls, cache.skipped_calls) == (4, 0) and len(cache.changes) == 3


@pytest.mark.parametrize("name", NETWORKS)
def test_a_skipped_call_on_the_same_input_gives_the_full_output(name):
    model, call, x = NETWORKS[name]()
    t = torch.full((2,), 0.7)
    with torch.no_grad():
        full = call(model, x, t)
        cache = BlockCache(0.01)
        wrapped = cache.wrap(model)
        first = call(wrapped, x, t)
        cache.step = 1
        again = call(wrapped, x, t)                  # the first block's residual unchanged: the rest skipped
        cache.step = 2
        other = call(wrapped, x, torch.full((2,), 0.2))   # changed far more than 1%: all blocks run
    assert torch.equal(first, full)
    assert (cache.full_calls, cache.skipped_calls) == (2, 1)
    assert cache.changes[0] == (1, 0.0) and cache.changes[1][1] > 0.01
    torch.testing.assert_close(again, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(other, call(model, x, torch.full((2,), 0.2)))


def test_a_call_of_another_shape_runs_in_full_and_skip_layer_calls_bypass_the_cache():
    model, call, x = _mmdit()
    t = torch.full((2,), 0.7)
    cache = BlockCache(1.0)
    wrapped = cache.wrap(model)
    with torch.no_grad():
        call(wrapped, x, t)
        cache.step = 1
        call(wrapped, x[..., :6], t)                 # fewer tokens than were kept: full
        assert (cache.full_calls, cache.skipped_calls) == (2, 0)
        cache.step = 2
        slg = call(wrapped, x, t, skip_layers=[1])   # skip-layer guidance's pass: the whole (shortened) stack
        assert torch.equal(slg, call(model, x, t, skip_layers=[1]))


def test_relative_change():
    a = torch.tensor([1.0, -2.0, 3.0])
    assert relative_change(a, a) == 0.0
    assert relative_change(a * 1.1, a) == pytest.approx(0.1)
    assert relative_change(torch.zeros(2), torch.zeros(2)) == 0.0 and relative_change(a, torch.zeros(3)) == float("inf")


# --- end to end: the tiny FLUX.1 dev pipeline ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from tests.test_flux_pipeline import _pipeline

    tmp = tmp_path_factory.mktemp("flux-cache")
    _pipeline(tmp, "dev")
    return Engine.load(tmp / "dev", precision="exact")


def _run(engine, monkeypatch=None, **fields):
    caches = []
    if monkeypatch is not None:
        original = Engine.step_cache
        monkeypatch.setattr(Engine, "step_cache", lambda self, *a: caches.append(original(self, *a)) or caches[-1])
    result = engine.generate(Request("a red circle on a blue background", steps=RUN_STEPS, seed=1000, width=64,
                                     height=64, sampler="euler", cfg_scale=1.0, **fields))
    return np.asarray(result.images[0], np.int16), result, caches


def test_engine_threshold_zero_and_off_give_the_uncached_image(flux, monkeypatch):
    plain, result, _ = _run(flux)
    assert "Step cache" not in result.infotext
    zero, result, caches = _run(flux, monkeypatch, cache_threshold=0.0)
    assert np.array_equal(plain, zero)
    assert result.infotext["Step cache"] == "first-block 0"
    assert caches[0].skipped_calls == 0 and caches[0].full_calls == RUN_STEPS


def test_engine_skips_and_stays_within_the_bound(flux, monkeypatch):
    plain, _, _ = _run(flux)
    cached, result, caches = _run(flux, monkeypatch, cache_threshold=1.0)
    skipped = caches[0].skipped_calls
    assert 0 < skipped < RUN_STEPS and caches[0].full_calls + skipped == RUN_STEPS
    diff = (plain - cached).astype(np.float64)
    assert int(np.abs(diff).max()) <= RUN_MAX_DIFF
    assert 10 * np.log10(255.0 ** 2 / np.mean(diff ** 2)) >= RUN_MIN_PSNR
    assert result.infotext["Step cache"] == "first-block 1"


def test_the_interval_turns_it_on_at_the_default_threshold(flux):
    _, result, _ = _run(flux, cache_interval=3)
    assert result.infotext["Step cache"] == f"first-block {DEFAULT_THRESHOLD:g}" == "first-block 0.08"


def test_a_threshold_is_refused_on_a_unet_and_with_compile(flux, monkeypatch):
    from sdlite.demo import model_path

    demo = Engine.load(model_path())
    with pytest.raises(RequestError, match=r"threshold 0\.1 .*UNet"):
        demo.generate(Request("x", steps=2, cache_threshold=0.1))
    monkeypatch.setattr(flux.models, "compile", True)
    with pytest.raises(RequestError, match="compiled transformer"):
        _run(flux, cache_threshold=0.1)


# --- options ---------------------------------------------------------------------------------------------------------


def test_options_and_errors_name_the_value():
    assert parse_threshold("0.08") == 0.08 and parse_threshold(" 1.0 ") == 1.0
    for bad in ("fast", "1.5", "-0.1", "nan"):
        with pytest.raises(BlockCacheError, match="threshold"):
            parse_threshold(bad)
    for value in (-0.5, 2.0, True, "0.1"):
        with pytest.raises(RequestError, match=f"threshold {value!r}"):
            validate(Request("x", cache_threshold=value))
    assert validate(Request("x")).cache_threshold is None
    with pytest.raises(RequestError, match="cache_threshold"):
        validate(Request("x", noise="comfy", sampler="euler", cache_threshold=0.1))
    assert cache_infotext(None) == {} and cache_infotext(0.12) == {"Step cache": "first-block 0.12"}


def test_the_cli_flag():
    from sdlite.cli import build_parser
    from sdlite.cli.generate import _cache_option

    def option(*argv):
        return _cache_option(build_parser().parse_args(["generate", "x", *argv]).cache)

    assert option("--cache", "0.12") == {"cache_threshold": 0.12}
    assert option("--cache", "0.") == {"cache_threshold": 0.0}
    assert option("--cache") == {"cache_interval": 3, "cache_branch": 0}   # on a transformer: the default threshold
    assert option("--cache", "2:5") == {"cache_interval": 2, "cache_branch": 5}
    with pytest.raises(RequestError, match=r"--cache: first-block cache threshold 1\.5 "):
        option("--cache", "1.5")
