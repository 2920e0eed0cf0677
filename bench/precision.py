"""The precision policy measured: UNet step time per precision, and the default's image quality against exact.

    python bench/precision.py step [--model FOLDER] [--size 512] [--precisions exact,bf16,bf16-int8,int8]
    python bench/precision.py quality [--model FOLDER|demo] [--size 256] [--steps 20] [--seeds 8]
    python bench/precision.py step --model bench/cache/sdxl-fp16 --size 1024 --precisions exact,bf16 --calls 1 \
        --json bench/results-precision-sdxl.json                  (SDXL, as reported in BENCHMARKS.md)
    python bench/precision.py all [--out BENCHMARKS.md]          (what `make bench` runs: both, on the cached
                                                                   full-size SD 1.5, on the demo, and quality on
                                                                   the full-size SDXL when bench/sdxl.py cached it)

`step`: one process per precision; the model loaded as ``Engine.load(folder, precision=P)`` loads it, then one
UNet call at batch 2 (cfg on) on fixed random latents and context: a warm-up, then the median of 3. The output is
compared with exact's (SNR in dB: signal power over error power; cosine).
`quality`: the default (``auto``) against ``exact``, each in its own process: N seeds (1..N) of a whole
generation (DPM++ 2M Karras, cfg 7.5, the prompt and negative prompt below), PSNR of the 8-bit images (peak 255);
the lowest of the N is the figure the issue asks for.
`all` writes the section between the ``precision`` markers of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT, NEGATIVE = "a red circle on a blue background, highly detailed", "blurry, low quality"
BEGIN, END = "<!-- precision:begin -->", "<!-- precision:end -->"
SDXL = HERE / "cache" / "sdxl-fp16"


def child_step(cfg: dict) -> dict:
    import torch

    from sdlite.pipeline import Engine

    engine = Engine.load(cfg["model"], precision=cfg["precision"])
    unet = engine.models.get("unet")
    spec = engine.spec
    g = torch.Generator().manual_seed(0)
    side = cfg["size"] // 8
    x = torch.randn(2, spec.unet.in_channels, side, side, generator=g)
    ctx = torch.randn(2, 77, spec.unet.context_dim, generator=g)
    t = torch.tensor([500.0, 500.0])
    extra = {}
    if spec.is_sdxl:
        extra = {"text_embeds": torch.randn(2, 1280, generator=g),
                 "time_ids": torch.tensor([[cfg["size"], cfg["size"], 0, 0, cfg["size"], cfg["size"]]] * 2,
                                          dtype=torch.float32)}
    with torch.no_grad():
        times = []
        for _ in range(cfg.get("calls", 4)):
            start = time.perf_counter()
            out = unet(x.to(unet.dtype), t, ctx.to(unet.dtype), **{k: v.to(unet.dtype) if k == "text_embeds" else v
                                                                  for k, v in extra.items()})
            times.append(time.perf_counter() - start)
    torch.save(out.float(), cfg["save"])
    return {"precision": engine.precision.name, "first_s": times[0],
            "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0]}


def child_quality(cfg: dict) -> dict:
    import numpy as np

    from sdlite.demo import model_path
    from sdlite.pipeline import Engine, Request

    model = str(model_path()) if cfg["model"] == "demo" else cfg["model"]
    engine = Engine.load(model, precision=cfg["precision"])
    times, images = [], []
    for seed in range(1, cfg["seeds"] + 1):
        r = Request(PROMPT, negative_prompt=NEGATIVE, width=cfg["size"], height=cfg["size"], steps=cfg["steps"],
                    cfg_scale=7.5, seed=seed)
        start = time.perf_counter()
        images.append(np.asarray(engine.generate(r).images[0]))
        times.append(time.perf_counter() - start)
    np.save(cfg["save"], np.stack(images))
    return {"precision": engine.precision.label, "generation_s": statistics.median(times)}


def run_child(kind: str, cfg: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(cfg)], capture_output=True, text=True,
                         cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{kind} child failed ({cfg}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_steps(model: str, size: int, precisions: list[str], tmp: Path, calls: int = 4) -> list[dict]:
    import torch

    rows = []
    for p in precisions:
        save = tmp / f"step-{p}.pt"
        row = run_child("step", {"model": model, "precision": p, "size": size, "save": str(save), "calls": calls})
        row["requested"] = p
        rows.append(row)
        print(f"step {size}^2 {p}: {row}", file=sys.stderr)
    ref = torch.load(tmp / "step-exact.pt") if "exact" in precisions else None
    for row in rows:
        if ref is not None:
            out = torch.load(tmp / f"step-{row['requested']}.pt")
            err = (out - ref).pow(2).mean()
            row["snr_db"] = float("inf") if err == 0 else float(10 * torch.log10(ref.pow(2).mean() / err))
            row["cosine"] = float(torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0))
    return rows


def measure_quality(model: str, size: int, steps: int, seeds: int, tmp: Path, fast: str = "auto") -> dict:
    import numpy as np

    res = {}
    for p in ("exact", fast):
        save = tmp / f"q-{p}.npy"
        res[p] = run_child("quality", {"model": model, "precision": p, "size": size, "steps": steps, "seeds": seeds,
                                       "save": str(save)})
        print(f"quality {model} {p}: {res[p]}", file=sys.stderr)
    a, b = (np.load(tmp / f"q-{p}.npy").astype(np.float64) for p in ("exact", fast))
    psnrs = []
    for x, y in zip(a, b):
        mse = np.mean((x - y) ** 2)
        psnrs.append(float("inf") if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse)))
    return {"model": model, "size": size, "steps": steps, "seeds": seeds, "default": res[fast]["precision"],
            "psnr_db": psnrs, "lowest_db": min(psnrs), "exact_s": res["exact"]["generation_s"],
            "default_s": res[fast]["generation_s"]}


def _fmt_db(v: float) -> str:
    return "identical" if v == float("inf") else f"{v:.1f}"


def report(steps: list[dict], size: int, quality: list[dict], command: str) -> str:
    from sdlite.engine.cpu import system_report

    lines = [BEGIN, "## The precision policy (`--precision`)", "",
             f"Command: `{command}`. Machine: " + "; ".join(l.strip() for l in system_report()[:4]), "",
             f"One UNet call at {size}x{size}, batch 2 (cfg on), full-size SD 1.5 (random weights), each precision in "
             "its own process (the median of 3 after a warm-up); its output against exact's:", "",
             "| precision | step, s | vs exact | output SNR against exact, dB | cosine |", "|---|---|---|---|---|"]
    base = next((r["step_s"] for r in steps if r["requested"] == "exact"), None)
    for r in steps:
        ratio = f"{r['step_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['requested']} ({r['precision']}) | {r['step_s']:.2f} | {ratio} | "
                     f"{_fmt_db(r.get('snr_db', float('nan')))} | {r.get('cosine', float('nan')):.6f} |")
    lines += ["", "The default (`auto`) against `exact`: the lowest PSNR of the seeds (8-bit images, peak 255), whole "
              "generations, DPM++ 2M Karras, cfg 7.5:", "",
              "| model | size, steps | default here (or as asked) | lowest PSNR of the seeds, dB | all seeds, dB | generation exact / default, s |",
              "|---|---|---|---|---|---|"]
    for q in quality:
        name = "demo" if q["model"] == "demo" else Path(q["model"]).name
        lines.append(f"| {name} | {q['size']}^2, {q['steps']} | {q['default']} | {_fmt_db(q['lowest_db'])} | "
                     f"{', '.join(_fmt_db(v) for v in q['psnr_db'])} | {q['exact_s']:.2f} / {q['default_s']:.2f} |")
    lines += ["", END]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + text + old[old.index(END) + len(END):]
    else:
        new = old.rstrip() + "\n\n" + text + "\n"
    path.write_text(new)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, str(ROOT))
        fn = {"step": child_step, "quality": child_quality}[sys.argv[2]]
        print(json.dumps(fn(json.loads(sys.argv[3]))))
        return 0
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["step", "quality", "all"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--precisions", default="exact,bf16,bf16-int8,int8")
    ap.add_argument("--calls", type=int, default=4, help="UNet calls per process: a warm-up, then the median of the "
                                                          "rest (1: the one call)")
    ap.add_argument("--no-sdxl", action="store_true", help="all: leave out SDXL's quality row (about 20 minutes)")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--json", default=str(HERE / "results-precision.json"))
    args = ap.parse_args()
    if args.model is None:
        from checkpoint import build

        args.model = str(build()[0])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        result = {}
        if args.what in ("step", "all"):
            result["steps"] = measure_steps(args.model, args.size or 512, args.precisions.split(","), tmp, args.calls)
            result["step_size"] = args.size or 512
        if args.what in ("quality", "all"):
            runs = [(args.model, "auto")] + ([("demo", "auto"), ("demo", "bf16"), ("demo", "bf16-int8")]
                                             if args.what == "all" else [])
            if args.what == "all" and SDXL.is_dir() and not args.no_sdxl:   # bench/sdxl.py's SDXL base, if cached
                runs.append((str(SDXL), "auto"))
            result["quality"] = [measure_quality(m, (args.size or 256) if m != "demo" else 64, args.steps,
                                                 args.seeds, tmp, fast) for m, fast in runs]
    for q in result.get("quality", []):   # the model as the repository names it, not this machine's path
        path = Path(q["model"])
        q["model"] = str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else q["model"]
    print(json.dumps(result, indent=1))
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.what == "all":
        write_section(Path(args.out), report(result["steps"], result["step_size"], result["quality"],
                                             "python bench/precision.py all"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
