"""Wall time and peak RSS of one whole text-to-image run, sdlite's CLI against diffusers, same checkpoint.

    python bench/e2e.py [--size 256] [--steps 20] [--repeat 3] [--layout folder|single]

Each run is a fresh process (import, load, encode, sample, decode, write the PNG). Medians are reported.
Random weights at the real SD 1.5 shapes (bench/checkpoint.py): speed and memory do not depend on the values.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DIFFUSERS = r"""
import sys, torch
from diffusers import StableDiffusionPipeline, DPMSolverMultistepScheduler
path, size, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pipe = StableDiffusionPipeline.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                               safety_checker=None, requires_safety_checker=False)
pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)
pipe.set_progress_bar_config(disable=True)
image = pipe("a red circle on a blue background", negative_prompt="blurry", num_inference_steps=steps,
             guidance_scale=7.5, generator=torch.Generator().manual_seed(42), height=size, width=size).images[0]
image.save(out)
"""


def measure(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MB) of one child process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t0 = time.perf_counter()
    pid = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(pid.pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{pid.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from checkpoint import build

    folder, single = build()
    tmp = Path(tempfile.mkdtemp())
    sdlite = [sys.executable, "-m", "sdlite", "generate", "a red circle on a blue background", "--negative",
              "blurry", "--steps", str(args.steps), "--cfg", "7.5", "--sampler", "dpmpp_2m_karras", "--seed", "42",
              "--width", str(args.size), "--height", str(args.size), "--output", f"{tmp}/"]
    cases = {
        "sdlite, diffusers folder": sdlite + ["--model", str(folder)],
        "sdlite, single file": sdlite + ["--model", str(single)],
        "diffusers, diffusers folder": [sys.executable, "-c", DIFFUSERS, str(folder), str(args.size),
                                        str(args.steps), str(tmp / "d.png")],
    }
    print(f"{args.size}x{args.size}, {args.steps} steps, DPM++ 2M Karras, cfg 7.5, fp16 checkpoint computed in fp32, "
          f"median of {args.repeat}")
    print("| run | wall s | peak RSS MB |\n|---|---|---|")
    runs = {name: [] for name in cases}
    for _ in range(args.repeat):  # interleaved, so that a noisy spell of the machine hits every case alike
        for name, cmd in cases.items():
            runs[name].append(measure(cmd))
    results = {}
    for name, r in runs.items():
        results[name] = (statistics.median(x[0] for x in r), statistics.median(x[1] for x in r))
        print(f"| {name} | {results[name][0]:.1f} | {results[name][1]:.0f} |", flush=True)
    ref = results["diffusers, diffusers folder"]
    for name, (wall, rss) in results.items():
        print(f"{name}: {wall / ref[0]:.2f}x diffusers' wall time, {rss / ref[1]:.2f}x its peak RSS")


if __name__ == "__main__":
    main()
