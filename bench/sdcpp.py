"""SD3.5 Medium: sdlite against stable-diffusion.cpp on the same files, per step and whole generation.

    python bench/sdcpp.py [--steps 1,4] [--size 512] [--only LABEL,...] [--report-only]

Needs ``make setup-sdcpp`` (``.venv-sdcpp``: PyPI's stable-diffusion-cpp-python, built from source here with
``GGML_NATIVE``, so ggml uses this CPU's AVX-512 / AMX) and Stability's single file with ComfyUI's encoder files
beside it, written by ``python bench/sd3.py --models medium --single-file --build-only`` into
``bench/cache/sd35-medium-single/`` (random bf16 weights at SD3.5 Medium's released shapes; T5 in fp16 as
``t5xxl_fp16.safetensors``). Both engines read those same four files: sd.cpp through ``model_path``,
``clip_l_path``, ``clip_g_path`` and ``t5xxl_path``; sdlite through ``Engine.load(single file, text_encoders=[...])``.

Each configuration runs in its own fresh process with 2 threads: load, then a generation of each step count (the
prompt and negative prompt below, Euler, cfg 4.5 so each step is a CFG step, seed 42, 512x512). The step times are
each engine's own progress callbacks (sdlite's ``Engine.generate(callback=)``, sd.cpp's ``progress_callback``, whose
third argument is its own time for the step); the peak RSS is the process's (``ru_maxrss``) after all of them.
Raw figures go to bench/sdcpp.json after each child, the report to bench/sdcpp.md and to the section "SD3.5 against
stable-diffusion.cpp" of BENCHMARKS.md, between markers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SINGLE = HERE / "cache" / "sd35-medium-single"
SDCPP_PYTHON = ROOT / ".venv-sdcpp" / "bin" / "python"
OUR_PYTHON = Path(sys.executable)
RAW, REPORT = HERE / "sdcpp.json", HERE / "sdcpp.md"
MARK_BEGIN, MARK_END = "<!-- sdcpp:begin (written by bench/sdcpp.py) -->", "<!-- sdcpp:end -->"
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
NEGATIVE = "blurry, low quality"
CFG, SEED, THREADS = 4.5, 42, 2
CHILD_TIMEOUT_S = 3600

# label -> (python, engine, options)
CONFIGS = {
    "sd.cpp": ("sdcpp", {}),
    "sd.cpp q8_0": ("sdcpp", {"wtype": "q8_0"}),   # weights converted to its 8-bit blocks as they load
    "sdlite auto": ("sdlite", {"precision": "auto", "memory_mode": 1}),
    "sdlite auto mode0": ("sdlite", {"precision": "auto", "memory_mode": 0}),
}

# the children: each prints one line "RESULT <json>"
_COMMON = r"""
import json, resource, sys, time
cfg = json.loads(sys.argv[1])
now = time.perf_counter
out = {"gens": [], "notes": []}
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t_start = now()
"""

SDCPP_CHILD = _COMMON + r"""
from stable_diffusion_cpp import StableDiffusion
f = cfg["files"]
sd = StableDiffusion(model_path=f["model"], clip_l_path=f["clip_l"], clip_g_path=f["clip_g"], t5xxl_path=f["t5"],
                     n_threads=cfg["threads"], verbose=False, wtype=cfg.get("wtype", "default"))
out["ready_s"] = now() - t_start
for steps in cfg["steps"]:
    calls = []
    t0 = now()
    sd.generate_image(prompt=cfg["prompt"], negative_prompt=cfg["negative"], cfg_scale=cfg["cfg"], sample_method="euler",
                      sample_steps=steps, seed=cfg["seed"], width=cfg["size"], height=cfg["size"],
                      progress_callback=lambda step, n, t: calls.append((step, n, t, now())))
    total = now() - t0
    sampling = [c for c in calls if c[1] == steps]
    out["gens"].append({"n": steps, "total": total, "steps": [c[2] for c in sampling][-steps:],
                        "callbacks": len(calls)})
out["peak_rss_mb"] = peak_mb()
print("RESULT " + json.dumps(out), flush=True)
"""

SDLITE_CHILD = _COMMON + r"""
import torch
torch.set_num_threads(cfg["threads"])
from sdlite.pipeline import Engine, Request
f = cfg["files"]
engine = Engine.load(f["model"], text_encoders=[f["clip_l"], f["clip_g"], f["t5"]], precision=cfg["precision"],
                     memory_mode=cfg["memory_mode"])
m = engine.models
out["resolved"] = {"precision": engine.precision.label, "memory_mode": m.mode,
                   **{n: str(m.dtype_of(n)).removeprefix("torch.") for n in ("transformer", "text_encoder",
                                                                            "text_encoder_3", "vae")}}
out["ready_s"] = now() - t_start
with torch.no_grad():
    for steps in cfg["steps"]:
        ends = []
        t0 = now()
        res = engine.generate(Request(prompt=cfg["prompt"], negative_prompt=cfg["negative"], width=cfg["size"],
                                      height=cfg["size"], steps=steps, cfg_scale=cfg["cfg"], sampler="euler",
                                      seed=cfg["seed"]), callback=lambda i, n: ends.append(now()))
        total = now() - t0
        start = t0 + res.timings["text"]
        marks = [start] + ends[-steps:]
        out["gens"].append({"n": steps, "total": total, "steps": [b - a for a, b in zip(marks, marks[1:])],
                            "text": res.timings["text"], "decode": res.timings["decode"]})
out["peak_rss_mb"] = peak_mb()
print("RESULT " + json.dumps(out), flush=True)
"""


def files() -> dict:
    names = {"model": "sd3.5_medium.safetensors", "clip_l": "clip_l.safetensors", "clip_g": "clip_g.safetensors",
             "t5": "t5xxl_fp16.safetensors"}
    out = {k: SINGLE / v for k, v in names.items()}
    missing = [str(p.relative_to(ROOT)) for p in out.values() if not p.is_file()]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: run python bench/sd3.py --models medium --single-file --build-only")
    return {k: str(v) for k, v in out.items()}


def run_child(label: str, args) -> dict:
    engine, options = CONFIGS[label]
    python = SDCPP_PYTHON if engine == "sdcpp" else OUR_PYTHON
    if not python.is_file():
        sys.exit(f"{python.relative_to(ROOT)} is missing: run make setup-sdcpp")
    cfg = {"files": files(), "steps": args.steps, "size": args.size, "prompt": PROMPT, "negative": NEGATIVE,
           "cfg": CFG, "seed": SEED, "threads": THREADS, **options}
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1"}
    code = SDCPP_CHILD if engine == "sdcpp" else SDLITE_CHILD
    t0 = time.monotonic()
    proc = subprocess.run([str(python), "-c", code, json.dumps(cfg)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}",
                "wall_s": time.monotonic() - t0}
    return {**json.loads(lines[-1][7:]), "wall_s": time.monotonic() - t0}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def body(raw: dict, h: str) -> list[str]:
    res, meta = raw["results"], raw["meta"]
    lines = [f"{h} SD3.5 against stable-diffusion.cpp", "",
             "SD3.5 Medium (random bf16 weights at the released shapes) from the same four files: Stability's "
             "`sd3.5_medium.safetensors` (MMDiT and VAE) with ComfyUI's `clip_l`, `clip_g` and `t5xxl_fp16` beside "
             f"it. {meta['size']}x{meta['size']}, Euler, cfg {CFG} (every step a CFG step), seed {SEED}, "
             f"{THREADS} threads, each configuration in a fresh process. stable-diffusion-cpp-python "
             f"{meta.get('sdcpp_version', '?')} built from source with `GGML_NATIVE=ON`. Step times are each "
             "engine's own per-step figures; ratios are sdlite's against sd.cpp's with the files' own types (lower is "
             "better); `sd.cpp q8_0` converts the weights to its 8-bit blocks as it loads (`wtype=q8_0`), "
             "sd.cpp's usual choice on a CPU.", "",
             f"Machine: {meta['machine']}. Command: `python bench/sdcpp.py`, run {meta['date']}."
             + (f" {meta['note']}" if meta.get("note") else ""), ""]
    labels = [k for k in CONFIGS if k in res]
    lines += ["| measure | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    base = res.get("sd.cpp", {})

    def row(name, get):
        vals = []
        for label in labels:
            try:
                v = get(res[label])
            except (KeyError, IndexError, TypeError, ValueError):
                vals.append("failed" if "error" in res[label] else "-")
                continue
            ratio = ""
            if not label.startswith("sd.cpp"):
                try:
                    ratio = f" ({v / get(base):.2f}x)"
                except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
                    pass
            vals.append(f"{v:.1f}{ratio}" if v >= 10 else f"{v:.2f}{ratio}")
        lines.append(f"| {name} | " + " | ".join(vals) + " |")

    row("load to ready, s", lambda r: r["ready_s"])
    for g in range(len(meta["steps"])):
        n = meta["steps"][g]
        row(f"step of the {n}-step generation ({'the process' + chr(39) + 's first' if n == 1 else 'median'}), s",
            lambda r, g=g: _median(r["gens"][g]["steps"]))
        row(f"whole {n}-step generation, s", lambda r, g=g: r["gens"][g]["total"])
    row("peak RSS, MB", lambda r: r["peak_rss_mb"])
    notes = []
    for label in labels:
        r = res[label]
        if "error" in r:
            notes.append(f"- {label} failed: `{r['error'][-300:].strip()}`")
        elif "resolved" in r:
            notes.append(f"- {label}: " + ", ".join(f"{k} {v}" for k, v in r["resolved"].items()))
    return lines + ([""] + notes if notes else [])


def write_reports(raw: dict) -> None:
    REPORT.write_text("\n".join(body(raw, "#")) + "\n", encoding="utf-8")
    bench = ROOT / "BENCHMARKS.md"
    section = "\n".join([MARK_BEGIN, *body(raw, "##"), "", "Raw figures: `bench/sdcpp.json`.", MARK_END])
    text = bench.read_text(encoding="utf-8")
    begin, end = text.find(MARK_BEGIN), text.find(MARK_END)
    text = text[:begin] + section + text[end + len(MARK_END):] if 0 <= begin < end else \
        text.rstrip("\n") + "\n\n" + section + "\n"
    bench.write_text(text, encoding="utf-8")
    print(f"wrote {REPORT.name} and the section of BENCHMARKS.md")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="1,4", help="the step counts of the generations, in order")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--only", default=None, help="labels to measure (the others are kept from bench/sdcpp.json)")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--note", default=None, help="a sentence the report adds after the machine (what else ran)")
    args = ap.parse_args()
    args.steps = [int(s) for s in args.steps.split(",")]
    raw = json.loads(RAW.read_text()) if RAW.is_file() else {"results": {}}
    if not args.report_only:
        version = subprocess.run([str(SDCPP_PYTHON), "-c", "from importlib.metadata import version; "
                                  "print(version('stable-diffusion-cpp-python'))"], capture_output=True, text=True)
        sys.path.insert(0, str(ROOT))
        from sdlite.machine import this_cpu

        raw["meta"] = {"steps": args.steps, "size": args.size, "date": time.strftime("%Y-%m-%d"),
                       "sdcpp_version": version.stdout.strip() or "?",
                       "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                  f"oneDNN ISA {this_cpu().isa_level}"}
        for label in (args.only.split(",") if args.only else CONFIGS):
            print(f"running {label} ...", flush=True)
            raw["results"][label] = run_child(label, args)
            print(json.dumps(raw["results"][label])[:400], flush=True)
            RAW.write_text(json.dumps(raw, indent=1))
    if args.note is not None:
        raw["meta"]["note"] = args.note
        RAW.write_text(json.dumps(raw, indent=1))
    write_reports(raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
