"""The hires fix and the upscalers measured: time and peak memory, each case in a fresh process.

    python bench/hires.py hires [--model FOLDER] [--rounds 3] [--steps 20] [--hires-steps 20] [--denoise 0.5]
    python bench/hires.py esrgan [--size 512]
    python bench/hires.py lowmem [--model FOLDER]
    python bench/hires.py all [--out BENCHMARKS.md]          (what `make bench` runs; writes the hires section)

`hires`: a 512 -> 1024 hires generation (Latent upscaler, DPM++ 2M Karras first pass and second pass, cfg 7.5) on
the cached full-size SD 1.5 (random weights), sdlite default (auto precision), sdlite exact and diffusers' composition
of StableDiffusionPipeline (latents) + interpolate + StableDiffusionImg2ImgPipeline, fp32, in alternating processes;
medians of the rounds; whole-process peak RSS (``ru_maxrss``); PSNR of sdlite exact against diffusers.
`esrgan`: a full-size RRDBNet 4x (23 blocks, 64 features, random weights) on a 512x512 image, tiled as sdlite
upscales by default: time and peak RSS of the whole process.
`lowmem`: the 512 -> 1024 hires generation in memory mode 0: peak RSS.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = HERE / "cache" / "sd15-fp16"
PROMPT, NEGATIVE = "a castle on a hill, highly detailed", "blurry, low quality"
BEGIN, END = "<!-- hires:begin -->", "<!-- hires:end -->"


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(cfg: dict) -> dict:
    import numpy as np
    import torch

    kind = cfg["kind"]
    t0 = time.perf_counter()
    if kind == "esrgan":
        from sdlite.upscalers.files import Upscaler
        from sdlite.upscalers.nets import RRDBConfig, RRDBNet
        from sdlite.upscalers.tiling import upscale
        from PIL import Image

        torch.manual_seed(0)
        net = RRDBNet(RRDBConfig()).eval().requires_grad_(False)
        up = Upscaler(net=net, arch="RRDBNet", scale=4, name="rrdb-4x", path=Path("rrdb-4x"), layout="random")
        image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (cfg["size"], cfg["size"], 3), np.uint8))
        t1 = time.perf_counter()
        out = upscale(up, image)
        return {"seconds": time.perf_counter() - t1, "size": list(out.size), "peak_rss_mb": _peak_mb()}
    from sdlite.hires import Hires
    from sdlite.pipeline import Engine, Request

    if kind == "diffusers":
        from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionPipeline, DPMSolverMultistepScheduler

        txt = StableDiffusionPipeline.from_pretrained(cfg["model"], dtype=torch.float32, local_files_only=True,
                                                      safety_checker=None, requires_safety_checker=False)
        txt.scheduler = DPMSolverMultistepScheduler.from_config(txt.scheduler.config, use_karras_sigmas=True)
        txt.set_progress_bar_config(disable=True)
        img = StableDiffusionImg2ImgPipeline(**txt.components)
        img.set_progress_bar_config(disable=True)
        load = time.perf_counter() - t0
        t1 = time.perf_counter()
        g = torch.Generator().manual_seed(1)
        lat = txt(PROMPT, negative_prompt=NEGATIVE, height=512, width=512, num_inference_steps=cfg["steps"],
                  guidance_scale=7.5, generator=g, output_type="latent").images
        up = torch.nn.functional.interpolate(lat, size=(128, 128), mode="bilinear", antialias=False)
        g = torch.Generator().manual_seed(1)
        out = img(PROMPT, negative_prompt=NEGATIVE, image=up, strength=cfg["denoise"],
                  num_inference_steps=cfg["hires_steps"], guidance_scale=7.5, generator=g, output_type="np").images
        pixels = (np.clip(out[0], 0, 1) * 255).round().astype(np.uint8)
    else:
        engine = Engine.load(cfg["model"], precision=cfg["precision"], memory_mode=cfg.get("memory_mode", 1))
        load = time.perf_counter() - t0
        t1 = time.perf_counter()
        result = engine.generate(Request(PROMPT, NEGATIVE, width=512, height=512, steps=cfg["steps"], seed=1,
                                         sampler="dpmpp_2m_karras", cfg_scale=7.5,
                                         hires=Hires(scale=2, upscaler="Latent", steps=cfg["hires_steps"],
                                                     denoise=cfg["denoise"])))
        pixels = np.asarray(result.images[0])
    seconds = time.perf_counter() - t1
    if cfg.get("save"):
        np.save(cfg["save"], pixels)
    return {"load_s": load, "seconds": seconds, "peak_rss_mb": _peak_mb(), "size": list(pixels.shape[:2])}


def run_child(cfg: dict, script: str = __file__) -> dict:
    """``script child CFG`` in a fresh process (the benches' children print one JSON line last): that line, plus the
    process's wall time."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, script, "child", json.dumps(cfg)], capture_output=True, text=True,
                         cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"child {cfg} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0
    return result


def psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return None if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse))   # None: identical


def bench_hires(args) -> dict:
    import numpy as np

    cases = {"sdlite default": {"kind": "sdlite", "precision": "auto"},
             "sdlite exact": {"kind": "sdlite", "precision": "exact"},
             "diffusers fp32": {"kind": "diffusers"}}
    common = {"model": str(args.model), "steps": args.steps, "hires_steps": args.hires_steps, "denoise": args.denoise}
    runs = {name: [] for name in cases}
    tmp = ROOT / "build"
    tmp.mkdir(exist_ok=True)
    for r in range(args.rounds):
        for name, cfg in cases.items():
            save = str(tmp / f"hires-{name.replace(' ', '-')}.npy") if r == 0 else None
            runs[name].append(run_child({**common, **cfg, "save": save}))
            print(name, runs[name][-1], file=sys.stderr)
    exact = np.load(tmp / "hires-sdlite-exact.npy")
    out = {"config": {**common, "model": str(Path(args.model).relative_to(ROOT)) if Path(args.model).is_relative_to(ROOT)
                      else Path(args.model).name, "rounds": args.rounds}, "cases": {}}
    for name, rs in runs.items():
        pixels = np.load(tmp / f"hires-{name.replace(' ', '-')}.npy")
        out["cases"][name] = {"seconds": statistics.median(r["seconds"] for r in rs),
                              "process_s": statistics.median(r["process_s"] for r in rs),
                              "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
                              "psnr_vs_sdlite_exact": psnr(pixels, exact)}
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["hires", "esrgan", "lowmem", "all"])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hires-steps", type=int, default=20)
    ap.add_argument("--denoise", type=float, default=0.5)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--json", default=str(HERE / "results-hires.json"))
    args = ap.parse_args()
    results = json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else {}
    if args.what in ("hires", "all"):
        results["hires"] = bench_hires(args)
    if args.what in ("esrgan", "all"):
        results["esrgan"] = run_child({"kind": "esrgan", "size": args.size})
    if args.what in ("lowmem", "all"):
        results["lowmem"] = run_child({"kind": "sdlite", "precision": "auto", "memory_mode": 0, "model": args.model,
                                       "steps": args.steps, "hires_steps": args.hires_steps, "denoise": args.denoise})
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
