"""The first-block cache (``--cache`` on a transformer) measured on the tests' tiny FLUX.1, SD3 and Z-Image models
(random weights, built as in tests/test_*_pipeline.py): skipped calls, wall time and the image against the uncached
one, per threshold.

    python bench/blockcache.py [--steps 28] [--seeds 4] [--thresholds 0,0.05,0.08,0.12,0.3] [--families flux,sd3,zimage]

Per family and seed: the uncached image, then each threshold's, in turn. Reported per threshold: the network calls
skipped of all calls, the median sampling wall time and its ratio to the uncached one, and the largest pixel
difference (of 255) and lowest PSNR against the uncached images. Tiny networks: two or three blocks, so a skipped
call saves a smaller share of the work than on a full-size model (57 blocks in FLUX.1, 24-38 in SD3, 30 in Z-Image),
and random weights change from step to step otherwise than trained ones; the timings are a floor, the errors a guide.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PROMPT = "a red circle on a blue background"


def build(family: str, tmp: Path):
    """The tiny model of ``family``, saved in ``tmp`` and loaded (fp32, exact), with its request's fields."""
    from sdlite.pipeline import Engine

    if family == "flux":
        from tests.test_flux_pipeline import _pipeline
        _pipeline(tmp, "dev")
        return Engine.load(tmp / "dev", precision="exact"), dict(width=64, height=64, cfg_scale=1.0)
    if family == "sd3":
        from tests.test_sd3_pipeline import _pipeline
        _pipeline(tmp).save_pretrained(tmp / "sd3")
        return Engine.load(tmp / "sd3", precision="exact"), dict(width=64, height=64, cfg_scale=5.0, negative_prompt="")
    from tests.test_zimage_pipeline import _pipeline
    _pipeline(tmp / "zimage")
    return Engine.load(tmp / "zimage", precision="exact"), dict(width=64, height=64, cfg_scale=1.0)


def psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0 ** 2 / mse))


def run(engine, fields, steps, seed, threshold):
    """One generation: (image, sampling seconds, skipped calls, all calls)."""
    from sdlite.pipeline import Request

    caches = []
    original = type(engine).step_cache

    def recording(self, r, unet, n):
        cache = original(self, r, unet, n)
        caches.append(cache)
        return cache

    type(engine).step_cache = recording
    try:
        extra = {} if threshold is None else {"cache_threshold": threshold}
        result = engine.generate(Request(PROMPT, steps=steps, seed=seed, sampler="euler", **fields, **extra))
    finally:
        type(engine).step_cache = original
    skipped = sum(c.skipped_calls for c in caches)
    calls = sum(c.skipped_calls + c.full_calls for c in caches)
    return result.images[0], result.timings["sampling"], skipped, calls


def main() -> None:
    import numpy as np
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--thresholds", default="0,0.05,0.08,0.12,0.3")
    ap.add_argument("--families", default="flux,sd3,zimage")
    args = ap.parse_args()
    torch.set_num_threads(1)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            engine, fields = build(family, Path(tmp))
            run(engine, fields, 2, 0, None)   # warm-up
            rows = {t: [] for t in [None, *thresholds]}
            for seed in range(args.seeds):
                for t in rows:
                    rows[t].append(run(engine, fields, args.steps, 1000 + seed, t))
            base = statistics.median(r[1] for r in rows[None])
            print(f"\n{family}: {args.steps} steps, {args.seeds} seeds, 64x64, sampling wall time (median) "
                  f"{base * 1000:.0f} ms uncached")
            print("threshold | skipped calls | time ratio | max |diff| /255 | lowest PSNR dB")
            for t in thresholds:
                skipped, calls = sum(r[2] for r in rows[t]), sum(r[3] for r in rows[t])
                ratio = statistics.median(r[1] for r in rows[t]) / base
                diff = max(int(np.abs(np.asarray(a, np.int16) - np.asarray(b[0], np.int16)).max())
                           for (a, *_), b in zip(rows[None], rows[t]))
                low = min(psnr(a, b[0]) for (a, *_), b in zip(rows[None], rows[t]))
                print(f"{t:g} | {skipped}/{calls} | {ratio:.2f} | {diff} | {low:.1f}")


if __name__ == "__main__":
    main()
