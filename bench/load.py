"""Time and peak RSS of opening and loading a full-size SD 1.5 fp16 checkpoint, each run in a fresh process.

    python bench/load.py [--repeat N]

Reports medians of: import, open (headers, detection), load of all three networks into fp16 and into
fp32, and the process's peak RSS, for the diffusers folder and the single file; diffusers'
``from_pretrained`` on the same folder is measured alongside as the reference.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
engine, path, dtype_name = sys.argv[1:4]
import torch
dtype = getattr(torch, dtype_name)
if engine == "sdlite":
    from sdlite.loader import open_model, load_model
    t1 = time.perf_counter()
    ckpt = open_model(path); ckpt.close()
    t2 = time.perf_counter()
    model = load_model(path, dtype=dtype)
else:
    from diffusers import StableDiffusionPipeline
    t1 = time.perf_counter(); t2 = t1
    model = StableDiffusionPipeline.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                    safety_checker=None, requires_safety_checker=False)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "open": t2 - t1, "load": t3 - t2, "ready": t3 - t0,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(engine: str, path: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, engine, str(path), dtype], capture_output=True, text=True,
                         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    if out.returncode:
        raise SystemExit(f"{engine} {path} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from checkpoint import build

    folder, single = build()
    cases = [("sdlite", folder, "float16"), ("sdlite", single, "float16"),
             ("sdlite", folder, "float32"), ("sdlite", single, "float32"),
             ("diffusers", folder, "float16"), ("diffusers", folder, "float32")]
    print("| engine | layout | into | import s | open s | load s | import+load s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for engine, path, dtype in cases:
        runs = [run(engine, path, dtype) for _ in range(args.repeat)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        layout = "diffusers folder" if path.is_dir() else "single file"
        print(f"| {engine} | {layout} | {dtype} | {med['import']:.2f} | {med['open']:.2f} | {med['load']:.2f} | "
              f"{med['ready']:.2f} | {med['peak_rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
