"""Image to image against text to image at the same step count, sdlite beside diffusers, same checkpoint.

    python bench/img2img.py [--size 256] [--steps 20] [--strength 0.5] [--repeat 3] [--no-diffusers]

Image to image at strength s runs the last int(steps * s) steps plus one VAE encode, so at 0.5 it should take
about half of text to image's time. Each engine loads the model once (in its own process) and then alternates
the two kinds of run; medians of the generation calls alone (no load) are reported. Random weights at the real
SD 1.5 shapes (bench/checkpoint.py), DPM++ 2M Karras, cfg 7.5, fp32.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time
import torch
from PIL import Image
engine_name, path, size, steps, strength, repeat = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:5]), \
    float(sys.argv[5]), int(sys.argv[6])
source = Image.new("RGB", (size, size), (40, 60, 200))
source.paste((220, 30, 40), (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
prompt, negative = "a red circle on a blue background", "blurry"
if engine_name == "sdlite":
    from sdlite.pipeline import Engine, Request
    engine = Engine.load(path)
    base = Request(prompt, negative_prompt=negative, steps=steps, cfg_scale=7.5, sampler="dpmpp_2m_karras",
                   seed=42, width=size, height=size)
    runs = {"txt2img": lambda: engine.generate(base),
            "img2img": lambda: engine.generate(base.replace(init_image=source, strength=strength))}
else:
    from diffusers import (DPMSolverMultistepScheduler, StableDiffusionImg2ImgPipeline,
                           StableDiffusionPipeline)
    txt = StableDiffusionPipeline.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                  safety_checker=None, requires_safety_checker=False)
    txt.scheduler = DPMSolverMultistepScheduler.from_config(txt.scheduler.config, use_karras_sigmas=True)
    txt.set_progress_bar_config(disable=True)
    img = StableDiffusionImg2ImgPipeline(**txt.components)
    img.set_progress_bar_config(disable=True)
    gen = lambda: torch.Generator().manual_seed(42)
    runs = {"txt2img": lambda: txt(prompt, negative_prompt=negative, num_inference_steps=steps, guidance_scale=7.5,
                                   generator=gen(), height=size, width=size),
            "img2img": lambda: img(prompt, negative_prompt=negative, image=source, strength=strength,
                                   num_inference_steps=steps, guidance_scale=7.5, generator=gen())}
times = {k: [] for k in runs}
with torch.no_grad():
    for _ in range(repeat):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
print(json.dumps(times))
"""


def run(engine: str, path: Path, args) -> dict[str, list[float]]:
    out = subprocess.run([sys.executable, "-c", CHILD, engine, str(path), str(args.size), str(args.steps),
                          str(args.strength), str(args.repeat)], capture_output=True, text=True,
                         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": str(HERE.parent)})
    if out.returncode:
        raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--strength", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-diffusers", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from checkpoint import build

    folder, _ = build()
    engines = ["sdlite"] + ([] if args.no_diffusers else ["diffusers"])
    print(f"{args.size}x{args.size}, {args.steps} steps, img2img strength {args.strength:g} "
          f"({int(args.steps * args.strength)} steps run), DPM++ 2M Karras, cfg 7.5, fp32; "
          f"median of {args.repeat} generation calls, model loaded once\n")
    print("| engine | text to image, s | image to image, s | img2img / txt2img |\n|---|---|---|---|")
    medians = {}
    for engine in engines:
        times = run(engine, folder, args)
        t, i = statistics.median(times["txt2img"]), statistics.median(times["img2img"])
        medians[engine] = (t, i)
        print(f"| {engine} | {t:.1f} | {i:.1f} | {i / t:.2f} |", flush=True)
    if "diffusers" in medians:
        (st, si), (dt, di) = medians["sdlite"], medians["diffusers"]
        print(f"\nsdlite / diffusers: text to image {st / dt:.2f}x, image to image {si / di:.2f}x")


if __name__ == "__main__":
    main()
