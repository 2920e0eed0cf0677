"""Does ``torch.compile`` pay for the UNet here? Eager against compiled step time, and the compile's cost cold and warm.

    python bench/compile.py [--folder bench/cache/sd15-fp16] [--size 512] [--batch 2] [--repeat 3] [--freezing]
                            [--frozen-warm] [--out build/compile.json]

One process at a time, each loading the SD 1.5 UNet as the bf16 precision does (bf16 weights, channels-last):

1. ``cold``: a fresh Inductor cache folder. One eager warm-up step, the first compiled call (Dynamo, Inductor and
   the C++ build, plus the step itself), then ``--repeat`` eager and compiled steps, alternating (so that a change in
   the machine's load falls on both alike): their medians.
2. ``warm``: a new process with the same cache folder: the first compiled call (Dynamo traces again; Inductor's
   artifacts come from the cache), then eager and compiled steps as in 1.
3. ``--freezing``: the same as 1 with ``torch._inductor.config.freezing`` on, in its own fresh cache folder; with
   ``--frozen-warm`` also the same as 2 (whether a frozen graph is found in the cache by the next process).

The inputs are those of one CFG step of a ``--batch``/2-image request: a (B, 4, size/8, size/8) latent, B
timesteps, a (B, 77, 768) fp32 context (768: the UNet's context width). Prints a markdown table, with the whole
20-step sampling time each way (the compile included), and writes the figures as JSON to ``--out``. The figures and
what they decided are in sdlite/engine/compile.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def child(args) -> dict:
    import torch

    from sdlite.engine import compile as compile_module
    from sdlite.loader import open_model

    torch.manual_seed(0)
    unet = open_model(args.folder).load("unet", torch.bfloat16).to(memory_format=torch.channels_last)
    unet = unet.eval().requires_grad_(False)
    b, side = args.batch, args.size // 8
    x = torch.randn(b, 4, side, side).to(torch.bfloat16)
    t = torch.full((b,), 999.0)
    context = torch.randn(b, 77, unet.config.context_dim)
    out: dict = {"phase": args.phase, "threads": torch.get_num_threads()}

    def steps(fn, n):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn(x, t, context)
            times.append(time.perf_counter() - t0)
        return times

    with torch.no_grad():
        reference = None
        if args.phase == "cold" and not args.freezing:
            steps(unet, 1)
            reference = unet(x, t, context).float()
        compile_module.FREEZING = args.freezing
        fn = compile_module.compiled(unet)
        t0 = time.perf_counter()
        first = fn(x, t, context)
        out["first_call"] = time.perf_counter() - t0
        if reference is not None:
            out["max_abs_diff"] = (first.float() - reference).abs().max().item()
            out["ref_max_abs"] = reference.abs().max().item()
        # eager and compiled steps alternate, so that a change in the machine's load falls on both alike
        out["eager_steps"], out["compiled_steps"] = [], []
        for _ in range(args.repeat):
            out["eager_steps"] += steps(unet, 1)
            out["compiled_steps"] += steps(fn, 1)
        out["eager_step"] = statistics.median(out["eager_steps"])
        out["compiled_step"] = statistics.median(out["compiled_steps"])
        out["compile_overhead"] = out["first_call"] - out["compiled_step"]
        out["failed"] = getattr(fn, "failed", "not compiled")
    from torch._dynamo.utils import counters

    out["counters"] = {k: dict(counters[k]) for k in ("inductor", "aot_autograd") if counters[k]}
    return out


def run_child(args, phase: str, cache: Path, freezing: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--phase", phase, "--folder", str(args.folder), "--size",
           str(args.size), "--batch", str(args.batch), "--repeat", str(args.repeat)] + (["--freezing"] if freezing
                                                                                         else [])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{phase} failed ({done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - t0
    print(f"{phase}{' (freezing)' if freezing else ''}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def report(results: dict, steps: int = 20) -> str:
    cold, warm = results["cold"], results["warm"]
    rows = []
    for label, r in (("cold cache", cold), ("warm cache (new process)", warm), ("freezing, cold cache",
                                                                            results.get("frozen")),
                     ("freezing, second process", results.get("frozen_warm"))):
        if r is None:
            continue
        rows.append((f"{label}: eager / compiled step", f"{r['eager_step']:.2f} s / {r['compiled_step']:.2f} s "
                     f"({r['compiled_step'] / r['eager_step']:.2f}x)"))
        rows.append((f"{label}: first compiled call (compile + one step)", f"{r['first_call']:.1f} s (compile "
                     f"{r['compile_overhead']:.1f} s)"))
    eager = statistics.median(cold["eager_steps"] + warm["eager_steps"])
    comp = statistics.median(cold["compiled_steps"] + warm["compiled_steps"])
    rows += [(f"{steps} steps eager", f"{steps * eager:.1f} s"),
             (f"{steps} steps compiled, cold cache", f"{cold['compile_overhead'] + steps * comp:.1f} s"),
             (f"{steps} steps compiled, warm cache", f"{warm['compile_overhead'] + steps * comp:.1f} s")]
    saved = eager - comp
    rows.append(("steps for a warm compile to pay", f"{warm['compile_overhead'] / saved:.0f}" if saved > 0
                 else "never (not faster)"))
    return "\n".join(["| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", type=Path, default=HERE / "cache" / "sd15-fp16")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--freezing", action="store_true")
    p.add_argument("--frozen-warm", action="store_true")
    p.add_argument("--out", type=Path, default=HERE.parent / "build" / "compile.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", default="cold", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if not (args.folder / "unet").is_dir():
        raise SystemExit(f"{args.folder} has no unet/: build it with python bench/checkpoint.py")
    results = {}
    with tempfile.TemporaryDirectory(prefix="sdlite-inductor-") as tmp:
        plain, frozen = Path(tmp) / "plain", Path(tmp) / "frozen"
        results["cold"] = run_child(args, "cold", plain, False)
        results["warm"] = run_child(args, "warm", plain, False)
        if args.freezing:
            results["frozen"] = run_child(args, "cold", frozen, True)
            if args.frozen_warm:
                results["frozen_warm"] = run_child(args, "warm", frozen, True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
