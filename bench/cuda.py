"""sdlite against diffusers on a CUDA GPU, on the same full-size SD 1.5 checkpoint (random weights).

    python bench/cuda.py [--size 512] [--steps 20] [--repeats 3] [--json bench/results-cuda.json]
    python bench/cuda.py --device cpu --size 64 --steps 2 --repeats 1 --json <scratch>   (a smoke run of the script)

The checkpoint is bench/checkpoint.py's diffusers folder (fp16 safetensors at the real SD 1.5 shapes), built where
it is missing. Four configurations, one after the other in this process, each loaded, run once to warm up (cuDNN's
algorithm search, the allocator's pools) and then timed over ``--repeats`` whole generations (median): sdlite
``exact`` (fp32), diffusers fp32, sdlite's default (``auto``: fp16 on a GPU) and diffusers fp16. A generation is
one 512^2 image, 20 steps of DPM++ 2M Karras (diffusers: DPMSolverMultistepScheduler with Karras sigmas), cfg 7.5,
a prompt and a negative prompt, seed 1, timed from the call to the image with the device synchronised. Peak GPU
memory is PyTorch's ``max_memory_allocated`` over the load and the generations.

Quality: 8-bit RGB PSNR of sdlite exact's image against diffusers fp32's (both draw their initial noise on the
CPU from the same seed, so the same image is expected; the GPU's kernels and their TF32 defaults are the same for
both), and of each engine's fp16 image against its own fp32 one.

Prints a markdown section (BENCHMARKS.md's CUDA section is this output) and writes the raw figures to ``--json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PROMPT, NEGATIVE = "a red circle on a blue background, highly detailed", "blurry, low quality"
SEED, CFG_SCALE = 1, 7.5
CONFIGS = (("sdlite exact", "sdlite", "exact"), ("diffusers fp32", "diffusers", torch.float32),
           ("sdlite default", "sdlite", None), ("diffusers fp16", "diffusers", torch.float16))
QUALITY = (("sdlite exact", "diffusers fp32"), ("sdlite default", "sdlite exact"),
           ("diffusers fp16", "diffusers fp32"))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def sdlite_runner(folder: Path, precision: str | None, size: int, steps: int, device: str):
    from sdlite.pipeline import Engine, Request

    engine = Engine.load(str(folder), device=device, **({} if precision is None else {"precision": precision}))
    request = Request(prompt=PROMPT, negative_prompt=NEGATIVE, width=size, height=size, steps=steps,
                      cfg_scale=CFG_SCALE, sampler="dpmpp_2m_karras", seed=SEED)
    used = engine.precision
    return (lambda: engine.generate(request).images[0]), f"{used.name} ({used.requested})", engine


def diffusers_runner(folder: Path, dtype: torch.dtype, size: int, steps: int, device: str):
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(folder, dtype=dtype, local_files_only=True, safety_checker=None,
                                                   requires_safety_checker=False).to(device)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(PROMPT, negative_prompt=NEGATIVE, num_inference_steps=steps, guidance_scale=CFG_SCALE,
                    height=size, width=size, generator=torch.Generator().manual_seed(SEED)).images[0]
    return generate, str(dtype).removeprefix("torch."), pipe


def measure(label: str, engine: str, setting, args) -> tuple[dict, np.ndarray]:
    gc.collect()
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync(args.device)
    t = time.perf_counter()
    runner = sdlite_runner if engine == "sdlite" else diffusers_runner
    generate, precision, holder = runner(args.folder, setting, args.size, args.steps, args.device)
    sync(args.device)
    ready = time.perf_counter() - t
    t = time.perf_counter()
    image = generate()
    sync(args.device)
    first = time.perf_counter() - t
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        image = generate()
        sync(args.device)
        times.append(time.perf_counter() - t)
    out = {"precision": precision, "ready_s": ready, "first_s": first, "generation_s": statistics.median(times),
           "all_s": times, "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2 ** 20 if on_gpu else float("nan")}
    print(f"{label}: {json.dumps(out)}", file=sys.stderr, flush=True)
    del generate, holder
    return out, np.asarray(image.convert("RGB"))


def report(results: dict, quality: dict, facts: dict, args) -> str:
    lines = ["## On a CUDA GPU (`python bench/cuda.py`)", "",
             f"Device: {facts['gpu']}, torch {facts['torch']} (CUDA {facts['cuda']}), diffusers {facts['diffusers']}, "
             f"Python {facts['python']}. The full-size SD 1.5 checkpoint of `bench/checkpoint.py` (random weights). "
             f"One {args.size}^2 image, {args.steps} steps of DPM++ 2M Karras, cfg {CFG_SCALE}, seed {SEED}; all "
             f"four configurations in one process, each warmed up once, then the median of {args.repeats} "
             "generations (device synchronised). Peak GPU memory: PyTorch's `max_memory_allocated` over the "
             "load and the generations.", "",
             "| configuration | precision | ready, s | first generation, s | generation, s | peak GPU memory, MB |",
             "|---|---|---|---|---|---|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['precision']} | {r['ready_s']:.2f} | {r['first_s']:.2f} | "
                     f"**{r['generation_s']:.3f}** | {r['peak_gpu_mb']:.0f} |")
    ratio = lambda a, b, k: results[a][k] / results[b][k]
    lines += ["", "| sdlite / diffusers | generation | peak GPU memory |", "|---|---|---|"]
    for a, b in (("sdlite exact", "diffusers fp32"), ("sdlite default", "diffusers fp16")):
        lines.append(f"| {a} / {b} | {ratio(a, b, 'generation_s'):.2f}x | {ratio(a, b, 'peak_gpu_mb'):.2f}x |")
    lines += ["", "Quality, 8-bit RGB PSNR:"]
    lines += [f"- {a} against {b}: {'identical' if v == float('inf') else f'{v:.1f} dB'}"
              for (a, b), v in quality.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=HERE / "cache", help="where bench/checkpoint.py's folder is")
    ap.add_argument("--json", type=Path, default=HERE / "results-cuda.json")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of the script")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/cuda.py needs a CUDA device: torch.cuda.is_available() is False here")
    sys.path.insert(0, str(HERE))
    from checkpoint import build

    from sdlite.engine.quant import psnr

    args.folder, _ = build(args.cache)
    import diffusers

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "CPU"
    facts = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
             "python": platform.python_version()}
    results, images = {}, {}
    with torch.no_grad():
        for label, engine, setting in CONFIGS:
            results[label], images[label] = measure(label, engine, setting, args)
    quality = {(a, b): psnr(torch.from_numpy(images[a]), torch.from_numpy(images[b])) for a, b in QUALITY}
    args.json.write_text(json.dumps({"facts": facts, "results": results,
                                     "quality": {f"{a} vs {b}": v for (a, b), v in quality.items()}}, indent=1))
    print(report(results, quality, facts, args))


if __name__ == "__main__":
    main()
