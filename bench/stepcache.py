"""The step cache (DeepCache, ``--cache``) measured: its images against the uncached ones, and its speed.

    python bench/stepcache.py [--size 512] [--seeds 8] [--steps 20,8] [--sd15-configs 3:0,3:2]
                              [--demo-configs 3:0,3:2,3:5,2:5] [--models sd15,demo] [--out BENCHMARKS.md]

For each model (the full-size SD 1.5 with random weights of bench/checkpoint.py, built once into bench/cache; the
embedded demo model) and each step count: per seed, the uncached image and then each cache configuration's
(``N:B``: interval N, skip branch B), in turn, so that whatever else loads the machine weighs on all of them alike.
Each image is one whole generation (text, sampling, decode; DPM++ 2M Karras, cfg 7.5, the precision ``auto``
gives), timed as wall time; the model is loaded once and warmed up by a one-step generation. Reported: PSNR of the
8-bit cached image against the uncached one (peak 255; the lowest and the mean over the seeds), the median wall time
per image and its ratio to the uncached median of the same run, and the UNet calls of each kind.

Writes bench/stepcache.json, bench/stepcache.md and the section between the ``stepcache`` markers of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
PROMPT, NEGATIVE = "a red circle on a blue background, highly detailed", "blurry, low quality"
BEGIN, END = "<!-- stepcache:begin -->", "<!-- stepcache:end -->"


def psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0 ** 2 / mse))


def counting(engine, tally: dict):
    """Wrap ``engine.step_cache`` so each run's caches report their full and cached UNet calls into ``tally``."""
    made = []
    original = engine.step_cache

    def step_cache(r, unet, steps):
        cache = original(r, unet, steps)
        made.append(cache)
        return cache

    engine.step_cache = step_cache

    def collect():
        tally["full"] = sum(c.full_calls for c in made)
        tally["cached"] = sum(c.cached_calls for c in made)
        made.clear()
    return collect


def measure(name: str, model: str, size: int, steps_list: list[int], seeds: int, configs: list[str]) -> dict:
    from sdlite.engine.stepcache import parse
    from sdlite.pipeline import Engine, Request

    engine = Engine.load(model)
    tally: dict = {}
    collect = counting(engine, tally)
    base = dict(prompt=PROMPT, negative_prompt=NEGATIVE, width=size, height=size, cfg_scale=7.5)
    engine.generate(Request(**base, steps=1, seed=0))   # warm-up
    out = {"model": name, "size": size, "precision": engine.precision.label, "runs": []}
    for steps in steps_list:
        walls = {c: [] for c in ["off"] + configs}
        scores = {c: [] for c in configs}
        calls = {}
        for seed in range(1, seeds + 1):
            start = time.perf_counter()
            ref = engine.generate(Request(**base, steps=steps, seed=seed)).images[0]
            walls["off"].append(time.perf_counter() - start)
            for c in configs:
                interval, branch = parse(c)
                start = time.perf_counter()
                img = engine.generate(Request(**base, steps=steps, seed=seed, cache_interval=interval,
                                              cache_branch=branch)).images[0]
                walls[c].append(time.perf_counter() - start)
                collect()
                calls[c] = dict(tally)
                scores[c].append(psnr(img, ref))
            print(f"{name} {steps} steps seed {seed}: "
                  + ", ".join(f"{c} {walls[c][-1]:.2f} s" + (f" {scores[c][-1]:.1f} dB" if c in scores else "")
                              for c in walls), file=sys.stderr, flush=True)
        off = statistics.median(walls["off"])
        rows = [{"config": "off", "median_s": off, "ratio": 1.0}]
        for c in configs:
            med = statistics.median(walls[c])
            rows.append({"config": c, "median_s": med, "ratio": med / off, "psnr_min": min(scores[c]),
                         "psnr_mean": statistics.fmean(scores[c]), "psnr": scores[c], "calls": calls[c]})
        out["runs"].append({"steps": steps, "seeds": seeds, "rows": rows, "walls": walls})
    return out


def fmt_db(v: float) -> str:
    return "identical" if v == float("inf") else f"{v:.1f}"


def previous_results() -> list[dict]:
    """The results of the last runs (bench/stepcache.json), each with the command and load it was measured with."""
    try:
        raw = json.loads((HERE / "stepcache.json").read_text())
    except (OSError, ValueError):
        return []
    return [{"command": raw.get("command", "?"), "load": raw.get("load", "?"), **res} for res in raw["results"]]


def markdown(results: list[dict]) -> str:
    runs = list(dict.fromkeys((res["command"], res["load"]) for res in results))
    lines = [BEGIN, "## The step cache (`--cache`, DeepCache)", "",
             *(f"- `{command}`: load average at the start {load}." for command, load in runs), "",
             "Compare wall times only as the ratios within one run: a load average well above 2 (two cores) means "
             "the machine was shared with other work.", "",
             "Each image one whole generation (DPM++ 2M Karras, cfg 7.5, precision auto), cached (`N:B`: the whole "
             "UNet every N-th step and the last, skip branch B on the others) against uncached, same seed; PSNR of "
             "the 8-bit images (peak 255), lowest and mean over the seeds; wall time the median per image.", "",
             "| model | size, steps | cache | UNet calls full / cached | PSNR lowest / mean, dB | median s per image "
             "| vs uncached |",
             "|---|---|---|---|---|---|---|"]
    for res in results:
        for run in res["runs"]:
            for row in run["rows"]:
                if row["config"] == "off":
                    lines.append(f"| {res['model']} ({res['precision']}) | {res['size']}^2, {run['steps']} | off "
                                 f"| {run['steps']} / 0 | (reference) | {row['median_s']:.2f} | 1.00x |")
                    continue
                calls = row["calls"]
                lines.append(f"| {res['model']} ({res['precision']}) | {res['size']}^2, {run['steps']} | "
                             f"{row['config']} | {calls['full']} / {calls['cached']} | {fmt_db(row['psnr_min'])} / "
                             f"{fmt_db(row['psnr_mean'])} | {row['median_s']:.2f} | {row['ratio']:.2f}x |")
    lines += ["", END]
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + text + old[old.index(END) + len(END) + 1:]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=512, help="SD 1.5 image side (the demo runs at its own 64)")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--steps", default="20,8")
    p.add_argument("--sd15-configs", default="3:0,3:2")
    p.add_argument("--demo-configs", default="3:0,3:2,3:5,2:5")
    p.add_argument("--models", default="sd15,demo")
    p.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    a = p.parse_args(argv)
    steps = [int(s) for s in a.steps.split(",")]
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    results = []
    for name in a.models.split(","):
        if name == "sd15":
            sys.path.insert(0, str(HERE))
            from checkpoint import build

            folder, _ = build()
            results.append(measure("sd15-fp16", str(folder), a.size, steps, a.seeds, a.sd15_configs.split(",")))
        elif name == "demo":
            from sdlite.demo import model_path

            results.append(measure("demo", str(model_path()), 64, steps, a.seeds, a.demo_configs.split(",")))
        else:
            raise SystemExit(f"unknown model {name!r}: expected sd15 or demo")
    command = ("python bench/stepcache.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    for res in results:
        res.update(command=command, load=load)
    # the models not measured in this run keep their last results (each row says which command made it)
    results += [res for res in previous_results() if res["model"] not in {r["model"] for r in results}]
    (HERE / "stepcache.json").write_text(json.dumps({"results": results}, indent=1))
    text = markdown(results)
    (HERE / "stepcache.md").write_text(text)
    write_section(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
