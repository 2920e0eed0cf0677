"""Does ``torch.compile`` pay for the transformers (issue 55)? sdlite's eager step against its compiled one, and the
compile's cost in a first and a second process, for FLUX.1-schnell and SD3.5 Medium at the released widths.

    python bench/compile_dit.py [--models flux-schnell,sd35-medium] [--precisions bf16-int8,bf16] [--sizes 512,1024]
                                [--depth 1] [--repeat 3] [--json bench/compile_dit.json] [--md bench/compile_dit.md]

The networks are bench/dit.py's (random weights at the released widths, ``--depth`` as there: FLUX.1 N double and 2N
single blocks, SD3.5 N joint blocks), prepared as the engine prepares them for the precision (``bf16-int8``: the
blocks' Linears as oneDNN int8 layers with per-token activations, what ``auto`` is on CPUs with native bf16 and
VNNI/AMX; ``bf16``) and compiled as the engine compiles them with ``--compile`` (:func:`sdlite.engine.compile.compiled`:
the int8 layers eager between the compiled pieces, bf16 rounded as eager rounds it). Each model, precision and size
runs in two fresh processes with 2 threads that share one new Inductor cache folder:

1. ``cold``: an eager warm-up step, the first compiled call (Dynamo, Inductor, the C++ build and the step), then
   ``--repeat`` eager and compiled steps alternating (so that a change in the machine's load falls on both alike);
2. ``warm``: the same in a new process, whose first compiled call finds Inductor's artifacts in the cache.

The step is one denoiser call (FLUX.1-schnell: batch 1; SD3.5: the CFG batch of 2). Its accuracy: the compiled
output against eager's and both against the same network in fp32 (relative L2). Medians of both processes' steps;
the report gives the compile's cost and how many steps a warm compile needs to pay back.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

THREADS = 2
# the step's sigma: 0.5, so that the timestep (sigma * 1000) is the same in bf16 and fp32; at 0.75 bf16 rounds 750 to
# 752 (as diffusers' bf16 does), which alone puts a random network's bf16 output 22 % away from its fp32 one
SIGMA = 0.5


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def child(cfg: dict) -> dict:
    torch.set_num_threads(THREADS)
    import dit
    from torch._dynamo.utils import counters

    from sdlite.engine.compile import Compiled, compiled

    m = dit.configs(cfg["model"], cfg["depth"], 1)
    nets = dit.Networks(cfg["model"], m, "sdlite", cfg["precision"])
    out = {"precision": nets.label}
    with torch.inference_mode():
        nets.load("transformer")
        reference = None
        if cfg["phase"] == "cold":   # the same weights in fp32 (dit.fill draws each tensor from its key)
            reference = dit.build_transformer(cfg["model"], m["transformer"], "sdlite", torch.float32)
        nets.settle()
        inp = nets.inputs(cfg["size"])
        eager = nets.transformer
        fn = compiled(eager, "transformer")
        out["compiled"] = isinstance(fn, Compiled)

        def step(net):
            nets.transformer = net
            try:
                return nets.step(inp["x"], SIGMA, inp["context"], inp["pooled"])
            finally:
                nets.transformer = eager

        first_eager = step(eager)
        out["first_call"] = _timed(lambda: out.__setitem__("_y", step(fn)))
        y = out.pop("_y")
        out["failed"] = getattr(fn, "failed", "not compiled")
        out["compiled_vs_eager"] = _relative(y, first_eager)
        if reference is not None:
            ref = step(reference)
            out["eager_vs_fp32"], out["compiled_vs_fp32"] = _relative(first_eager, ref), _relative(y, ref)
            del reference, ref
        eager_steps, compiled_steps = [], []
        for _ in range(cfg["repeat"]):
            eager_steps.append(_timed(lambda: step(eager)))
            compiled_steps.append(_timed(lambda: step(fn)))
    out.update(eager_steps=eager_steps, compiled_steps=compiled_steps, eager_step=statistics.median(eager_steps),
               compiled_step=statistics.median(compiled_steps), graphs=counters["stats"]["unique_graphs"],
               cache_hits=counters["inductor"]["fxgraph_cache_hit"],
               cache_misses=counters["inductor"]["fxgraph_cache_miss"])
    out["compile_overhead"] = out["first_call"] - out["compiled_step"]
    return out


def run_child(cfg: dict, cache: Path, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    t = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t
    result["loadavg"] = os.getloadavg()
    return result


def summarize(cold: dict, warm: dict) -> dict:
    eager = statistics.median(cold["eager_steps"] + warm["eager_steps"])
    comp = statistics.median(cold["compiled_steps"] + warm["compiled_steps"])
    saved = eager - comp
    return {"eager_step": eager, "compiled_step": comp, "ratio": comp / eager,
            "cold_overhead": cold["compile_overhead"], "warm_overhead": warm["compile_overhead"],
            "payback_steps": warm["compile_overhead"] / saved if saved > 0 else None}


def report(raw: dict) -> list[str]:
    lines = [f"Command: `{raw['command']}`, run {raw['date']}; load average {raw['loadavg_start']} at the start, "
             f"{raw['loadavg_end']} at the end. {raw['machine']}", "",
             "| model, size | precision | eager step, s | compiled step, s | ratio "
             "| compile: first process / second, s | steps to pay back a warm compile | compiled vs eager / eager vs fp32 / compiled vs fp32 (rel. L2) "
             "| graphs |", "|---|---|---|---|---|---|---|---|---|"]
    for row in raw["rows"]:
        cold, warm = row["cold"], row["warm"]
        head = f"| {row['model']}, {row['size']}^2 | {row['precision']} |"
        if "error" in cold or "error" in warm:
            lines.append(f"{head} failed: {cold.get('error') or warm.get('error')} | | | | | | |")
            continue
        s = summarize(cold, warm)
        pay = "never (not faster)" if s["payback_steps"] is None else f"{s['payback_steps']:.0f}"
        lines.append(f"{head} {s['eager_step']:.2f} | {s['compiled_step']:.2f} | {s['ratio']:.2f}x | "
                     f"{s['cold_overhead']:.1f} / {s['warm_overhead']:.1f} | {pay} | "
                     f"{cold['compiled_vs_eager']:.1e} / {cold['eager_vs_fp32']:.1e} / {cold['compiled_vs_fp32']:.1e} "
                     f"| {cold['graphs']} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="flux-schnell,sd35-medium")
    ap.add_argument("--precisions", default="bf16-int8,bf16")
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default=str(HERE / "compile_dit.json"))
    ap.add_argument("--md", default=str(HERE / "compile_dit.md"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    from run import machine
    raw = {"command": ("python bench/compile_dit.py " + shlex.join(sys.argv[1:])).strip(),
           "date": time.strftime("%Y-%m-%d"), "loadavg_start": [round(v, 2) for v in os.getloadavg()],
           "machine": f"Machine: {machine()}", "rows": []}
    for model in args.models.split(","):
        for precision in args.precisions.split(","):
            for size in (int(s) for s in args.sizes.split(",")):
                cfg = dict(model=model, precision=precision, size=size, depth=args.depth, repeat=args.repeat)
                with tempfile.TemporaryDirectory(prefix="sdlite-inductor-") as cache:
                    row = dict(cfg, cold=run_child(dict(cfg, phase="cold"), Path(cache), args.timeout))
                    row["warm"] = run_child(dict(cfg, phase="warm"), Path(cache), args.timeout)
                print(json.dumps(row), file=sys.stderr, flush=True)
                raw["rows"].append(row)
                Path(args.json).write_text(json.dumps(raw, indent=1))
    raw["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    Path(args.json).write_text(json.dumps(raw, indent=1))
    text = "\n".join(report(raw)) + "\n"
    Path(args.md).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
