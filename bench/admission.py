"""Memory admission: the estimated peak of a generation (sdlite.engine.budget.estimate) beside the measured one.

Each configuration runs in a fresh process: the engine is loaded and warmed on a tiny request, then one generation
runs while a thread samples the process's RSS every 2 ms; the measured peak is the highest RSS above the RSS before
the generation. The estimate must not be below it (admission would let a job through that does not fit), and should
not be far above it (it would refuse jobs that fit).

    python bench/admission.py [--model PATH] [--config WxH:BATCH[:MODE]] ...     # prints a Markdown table
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

MB = 1 << 20
DEFAULT_CONFIGS = ["64x64:1", "256x256:2", "512x512:1", "512x512:4", "1024x1024:1", "512x512:1:0"]


def measure(model: str, width: int, height: int, batch: int, mode: int = 1, steps: int = 2) -> dict:
    """In this process: the estimate and the measured peak (bytes above the RSS before) of one generation."""
    import torch  # noqa: F401

    from sdlite.engine import budget
    from sdlite.engine.memory import trim_heap
    from sdlite.pipeline import Engine, Request, validate

    engine = Engine.load(model, memory_mode=mode)
    request = Request("a red circle on a blue background", width=width, height=height, batch_size=batch,
                      steps=steps, seed=1, cfg_scale=7.0, sampler="euler")
    engine.generate(request.replace(width=64, height=64, batch_size=1, steps=1))   # builds every network
    sized = validate(request, engine.spec.default_size)
    estimate = budget.estimate(engine, sized.height, sized.width, sized.batch_size, cfg=sized.cfg_scale > 1.0)
    trim_heap()
    base = budget.process_rss()
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], budget.process_rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        engine.generate(request)
    finally:
        stop.set()
        thread.join()
    return {"width": width, "height": height, "batch": batch, "mode": mode, "estimate": estimate.peak,
            "phase": estimate.peak_phase, "measured": peak[0] - base, "pieces": [estimate.unet_piece,
                                                                                 estimate.decode_piece]}


def measure_in_fresh_process(model: str, width: int, height: int, batch: int, mode: int = 1, timeout: float = 1800):
    code = (f"import json, sys; sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r}); import admission; "
            f"print(json.dumps(admission.measure({model!r}, {width}, {height}, {batch}, {mode})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the shipped demo model")
    parser.add_argument("--config", action="append", default=None, metavar="WxH:BATCH[:MODE]")
    args = parser.parse_args(argv)
    if args.model is None:
        from sdlite.demo import model_path

        args.model = str(model_path())
    print("| size | batch | mode | pieces (UNet, decode) | estimate, MB | measured, MB | estimate / measured |")
    print("|---|---|---|---|---|---|---|")
    for config in args.config or DEFAULT_CONFIGS:
        size, batch, *mode = config.split(":")
        width, height = (int(v) for v in size.split("x"))
        r = measure_in_fresh_process(args.model, width, height, int(batch), int(mode[0]) if mode else 1)
        print(f"| {width}x{height} | {r['batch']} | {r['mode']} | {r['pieces'][0]}, {r['pieces'][1]} | "
              f"{r['estimate'] / MB:.0f} ({r['phase']}) | {r['measured'] / MB:.0f} | "
              f"{r['estimate'] / max(r['measured'], 1):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
