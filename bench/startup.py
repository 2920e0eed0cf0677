"""Start-up latency, sdlite against diffusers: everything before the first UNet step, each run in a fresh process.

    python bench/startup.py [--repeat 5] [--model PATH | --demo] [--isa avx2] [--json FILE]

Phases, timed by the wall clock from the moment the parent starts the child process (so the interpreter's own
start-up counts, the same for both engines):

* ``import``: until ``from sdlite.pipeline import Engine`` / ``from diffusers import StableDiffusionPipeline``
  has returned (torch included);
* ``load``: ``Engine.load(model)`` (memory mode 1, fp32: the UNet resident and ready) /
  ``StableDiffusionPipeline.from_pretrained(model, dtype=torch.float32, local_files_only=True,
  safety_checker=None, requires_safety_checker=False)``;
* ``text1``: the first text encoding of a prompt and a negative prompt (as a cfg generation does):
  ``engine.encode_prompt([prompt, negative])`` / ``pipe.encode_prompt(prompt, "cpu", 1, True, negative)``.
  sdlite builds its text encoder here, on first use; diffusers built it in ``from_pretrained``;
* ``text2``: the same encoding again (the steady-state cost);
* ``vae``: sdlite only: building the VAE, which sdlite does when it first decodes (after sampling, so not before
  the first UNet step); diffusers built it in ``from_pretrained``. Reported apart, so the totals can be compared
  with and without it.

The checkpoint's files are read once before every process, so both engines load from the page cache. Engines
alternate (sdlite, diffusers, sdlite, ...) so a noisy spell of the shared machine hits both alike; medians are
reported. ``--isa avx2`` runs the children with ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``.

``measure(model, repeat, env)`` is what ``bench/run.py`` calls.
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT, NEGATIVE = "a red circle on a blue background, highly detailed", "blurry, low quality"
PHASES = ("import", "load", "text1", "text2", "vae")
ISA_ENV = {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}

CHILD = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
marks = {}
if cfg["engine"] == "sdlite":
    from sdlite.pipeline import Engine
    import torch
    marks["import"] = time.time()
    engine = Engine.load(cfg["model"])
    marks["load"] = time.time()
    encode = lambda: engine.encode_prompt([cfg["prompt"], cfg["negative"]])[0]
else:
    import torch
    from diffusers import StableDiffusionPipeline
    marks["import"] = time.time()
    pipe = StableDiffusionPipeline.from_pretrained(cfg["model"], dtype=torch.float32, local_files_only=True,
                                                   safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    marks["load"] = time.time()
    encode = lambda: pipe.encode_prompt(cfg["prompt"], "cpu", 1, True, cfg["negative"])
with torch.no_grad():
    encode()
    marks["text1"] = time.time()
    encode()
    marks["text2"] = time.time()
    if cfg["engine"] == "sdlite":
        engine.models.get("vae")
    marks["vae"] = time.time()
print("RESULT " + json.dumps({"marks": marks, "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def warm_page_cache(path: str | Path) -> None:
    """Read the checkpoint's files once, so that every engine loads from the page cache (not the disk)."""
    p = Path(path)
    for f in sorted(p.rglob("*") if p.is_dir() else [p]):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def run_once(engine: str, model: str | Path, env: dict | None = None) -> dict:
    """One fresh process: seconds per phase."""
    cfg = {"engine": engine, "model": str(model), "prompt": PROMPT, "negative": NEGATIVE}
    child_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT),
                 **(env or {})}
    warm_page_cache(model)
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True,
                          env=child_env, cwd=str(ROOT))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"start-up child failed ({engine}):\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    out, prev = {}, start
    for phase in PHASES:
        out[phase] = res["marks"][phase] - prev
        prev = res["marks"][phase]
    out["capability"] = res["capability"]
    return out


def measure(model: str | Path, repeat: int = 5, env: dict | None = None, engines=("sdlite", "diffusers"),
            log=None) -> dict:
    """Per engine: the median seconds of each phase over ``repeat`` fresh processes (engines interleaved), the
    totals, every run, and the CPU capability torch reported in the child."""
    # an installed package has its bytecode compiled; a source tree run with PYTHONDONTWRITEBYTECODE would
    # compile sdlite's modules again in every process (diffusers' are compiled by pip)
    compileall.compile_dir(str(ROOT / "sdlite"), quiet=1)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for i in range(repeat):
        for engine in engines:
            r = run_once(engine, model, env)
            runs[engine].append(r)
            if log:
                log(f"  {engine} run {i + 1}: " + ", ".join(f"{p} {r[p]:.2f}" for p in PHASES))
    result = {}
    for engine, rs in runs.items():
        med = {p: statistics.median(r[p] for r in rs) for p in PHASES}
        # totals are medians of each run's sum, not sums of medians
        med["before_unet"] = statistics.median(r["import"] + r["load"] + r["text1"] for r in rs)
        med["with_vae"] = statistics.median(r["import"] + r["load"] + r["text1"] + r["vae"] for r in rs)
        result[engine] = {"median": med, "runs": [{p: r[p] for p in PHASES} for r in rs],
                          "capability": rs[0]["capability"]}
    return result


def table(result: dict) -> list[str]:
    """Markdown rows: one line per phase, sdlite and diffusers, and the ratio."""
    s, d = result["sdlite"]["median"], result["diffusers"]["median"]
    names = {"import": "import (interpreter start included)", "load": "load to ready",
             "text1": "first text encoding (prompt + negative)", "text2": "second text encoding",
             "vae": "VAE load (sdlite: at the first decode, after sampling)",
             "before_unet": "**import + load + first text encoding**",
             "with_vae": "the same plus sdlite's VAE load"}
    rows = ["| phase, s | sdlite mode 1 fp32 | diffusers fp32 | ratio |", "|---|---|---|---|"]
    for key in ("import", "load", "text1", "text2", "vae", "before_unet", "with_vae"):
        dv = d[key] if key != "with_vae" else d["before_unet"]
        ratio = f"{s[key] / dv:.2f}x" if dv > 0.005 else "-"
        rows.append(f"| {names[key]} | {s[key]:.2f} | {dv:.2f} | {ratio} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model", default=None, help="a diffusers folder (default: the full-size bench checkpoint)")
    ap.add_argument("--demo", action="store_true", help="the demo model shipped in the package")
    ap.add_argument("--isa", choices=sorted(ISA_ENV), default=None, help="cap the CPU ISA in the children")
    ap.add_argument("--engines", default="sdlite,diffusers")
    ap.add_argument("--json", default=None, help="also write the raw results to this file")
    args = ap.parse_args()
    if args.demo:
        model = ROOT / "sdlite" / "data" / "demo"
    elif args.model:
        model = Path(args.model)
    else:
        sys.path.insert(0, str(HERE))
        from checkpoint import build

        model = build()[0]
    result = measure(model, args.repeat, ISA_ENV.get(args.isa), tuple(args.engines.split(",")),
                     log=lambda s: print(s, flush=True))
    print(f"\n{model.name}, median of {args.repeat} fresh processes each, ISA "
          f"{args.isa or 'native'} (torch CPU capability: {result[next(iter(result))]['capability']})")
    if "sdlite" in result and "diffusers" in result:
        print("\n".join(table(result)))
    else:
        for engine, r in result.items():
            print(engine, {k: round(v, 3) for k, v in r["median"].items()})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
