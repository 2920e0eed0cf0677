"""sdlite against diffusers, side by side, on the same full-size SD 1.5 fp16 checkpoint (random weights).

    python bench/run.py [--quick] [--out BENCHMARKS.md]        (what `make bench` runs)
    python bench/run.py --isa-only [--isa native,avx2]         (only the per-ISA rows; the rest kept)
    python bench/run.py --startup-only [--isa native,avx2]     (only the per-ISA start-up breakdown)
    python bench/run.py --report-only                          (BENCHMARKS.md again from bench/results.json)

Every configuration runs in its own fresh process, so import time, load time and peak RSS are each engine's own;
the checkpoint's files are read once before each process starts, so every engine loads from the page cache.
Per process: import + load to ready, text encoding (prompt + negative), one UNet step with cfg on (batch 2) at
256^2 and 512^2, VAE decode at 512^2, a whole 512^2 20-step generation (DPM++ 2M Karras, cfg 7.5), and the
process's peak RSS. Timed sections are repeated and the median is kept (the whole generation runs once: it is
20 steps). A second sweep measures UNet step time, VAE decode time and peak RSS against resolution (one process
per engine and resolution) and is plotted. Then, for sdlite alone: the peak RSS of a whole 1024^2 generation and
of a 2048^2 tiled decode; the image quality of the quantized UNet (PSNR on the demo model, final-latent cosine on
the full-size checkpoint); and the profile of bench/profile_unet.py. Last, the key rows natively and with the CPU
capped to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` in the child processes): a whole 20-step 512^2
generation and peak RSS, sdlite mode 1 fp32 against diffusers fp32 under the same cap, and the start-up breakdown of
bench/startup.py (import, load, first and second text encoding, each engine in fresh processes). BENCHMARKS.md gets
the tables, ratios, the targets with the measured figures, the machine (CPU model, ISA flags, torch's CPU
capability) and the command.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from startup import warm_page_cache  # bench/ is this script's folder, first on sys.path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT, NEGATIVE = "a red circle on a blue background, highly detailed", "blurry, low quality"

CHILD = r"""
import json, os, resource, statistics, sys, time
t_start = time.perf_counter()
cfg = json.loads(sys.argv[1])
import torch
if cfg.get("threads"):
    torch.set_num_threads(cfg["threads"])
out = {}

def med(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return statistics.median(times)

sizes = cfg["unet_sizes"]
if cfg["engine"] == "diffusers":
    from diffusers import StableDiffusionPipeline, DPMSolverMultistepScheduler
    pipe = StableDiffusionPipeline.from_pretrained(cfg["model"], dtype=torch.float32, local_files_only=True,
                                                   safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)
    pipe.set_progress_bar_config(disable=True)
    out["ready_s"] = time.perf_counter() - t_start
    encode = lambda: pipe.encode_prompt(cfg["prompt"], "cpu", 1, True, cfg["negative"])
    unet_call = lambda x, t, c: pipe.unet(x, t, encoder_hidden_states=c).sample
    decode = lambda z: pipe.vae.decode(z).sample
    def generate(size):
        pipe(cfg["prompt"], negative_prompt=cfg["negative"], num_inference_steps=cfg["steps"], guidance_scale=7.5,
             generator=torch.Generator().manual_seed(42), height=size, width=size)
    ctx_dim = pipe.unet.config.cross_attention_dim
else:
    from sdlite.pipeline import Engine, Request
    kw = {k: cfg[k] for k in ("memory_mode", "quantize", "vae_tile") if cfg.get(k) is not None}
    if cfg.get("weight_dtype"):
        kw["weight_dtype"] = getattr(torch, cfg["weight_dtype"])
    engine = Engine.load(cfg["model"], **kw)
    out["ready_s"] = time.perf_counter() - t_start
    encode = lambda: engine.encode_prompt([cfg["prompt"], cfg["negative"]])
    def unet_call(x, t, c):
        with engine.models.use("unet") as unet:
            return unet(x, t, c)
    def decode(z):
        return engine.decode_latents(z)
    def generate(size):
        engine.generate(Request(prompt=cfg["prompt"], negative_prompt=cfg["negative"], steps=cfg["steps"],
                                cfg_scale=7.5, sampler="dpmpp_2m_karras", seed=42, width=size, height=size))
    ctx_dim = engine.spec.unet.context_dim

with torch.no_grad():
    if cfg.get("text"):
        out["text_s"] = med(encode, 3)
    g = torch.Generator().manual_seed(0)
    for size in sizes:
        x = torch.randn(2, 4, size // 8, size // 8, generator=g)
        c = torch.randn(2, 77, ctx_dim, generator=g)
        t = torch.tensor([500.0, 500.0])
        if cfg.get("warmup"):
            unet_call(x, t, c)
        out[f"unet_{size}_s"] = med(lambda: unet_call(x, t, c), cfg["repeat"])
    for size in cfg["decode_sizes"]:
        z = torch.randn(1, 4, size // 8, size // 8, generator=g)
        out[f"decode_{size}_s"] = med(lambda: decode(z), cfg["decode_repeat"])
    if cfg.get("e2e"):
        t = time.perf_counter(); generate(cfg["e2e"]); out["e2e_s"] = time.perf_counter() - t
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out["capability"] = torch.backends.cpu.get_cpu_capability()
print("RESULT " + json.dumps(out))
"""


QUALITY = r"""
import json, statistics, sys
import torch
from sdlite.demo import model_path
from sdlite.engine.quant import compare_quality
from sdlite.loader import load_model
cfg = json.loads(sys.argv[1])
out = {"demo": {}, "full": {}}
demo = load_model(model_path())
prompts = ["a red circle on a blue background", "a yellow star on a black background",
           "a green triangle on a white background", "a purple square on an orange background"]
for mode in cfg["modes"]:
    reports = [compare_quality(demo, mode, prompt=p, seed=seed) for p in prompts for seed in (1, 2)]
    out["demo"][mode] = {"psnr_median": statistics.median(r.psnr_db for r in reports),
                         "psnr_min": min(r.psnr_db for r in reports),
                         "max_pixel_diff": max(r.max_pixel_diff for r in reports), "images": len(reports)}
full = load_model(cfg["model"])
for mode in cfg["full_modes"]:
    r = compare_quality(full, mode, prompt=cfg["prompt"], negative_prompt=cfg["negative"], size=256, steps=8, seed=42)
    out["full"][mode] = {"latent_cosine": r.latent_cosine, "psnr": r.psnr_db}
print("RESULT " + json.dumps(out))
"""


def run_child(cfg: dict, code: str = CHILD, env: dict | None = None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    if cfg.get("model"):
        warm_page_cache(cfg["model"])
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"benchmark child failed ({cfg['engine']} {cfg.get('label')}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# the ISA flags BENCHMARKS.md names (sdlite.engine.cpu.SHOWN_FLAGS where that module exists)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_int8", "amx_bf16")
# the ISA caps the per-ISA mode runs under, set in the child processes' environment
ISAS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def cpu_facts() -> dict:
    """CPU model, its ISA flags (those of ISA_FLAGS it has) and torch's CPU capability, natively."""
    import torch

    try:
        from sdlite.machine import detect

        info = detect(environ={})
        model, flags = info.model, info.flags
        capability = info.torch_capability
    except ImportError:  # an older tree without sdlite.engine.cpu: read /proc/cpuinfo here
        model, flags = "unknown CPU", None
        try:
            for line in open("/proc/cpuinfo"):
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and flags is None:
                    flags = frozenset(value.split())
        except OSError:
            pass
        capability = torch.backends.cpu.get_cpu_capability()
    return {"model": model, "flags": None if flags is None else [f for f in ISA_FLAGS if f in flags],
            "capability": capability}


def machine(facts: dict | None = None) -> str:
    import torch

    facts = facts or cpu_facts()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    flags = "unknown" if facts["flags"] is None else (", ".join(facts["flags"]) or "none of " + ", ".join(ISA_FLAGS))
    return (f"{facts['model']}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, torch threads {torch.get_num_threads()}"
            f"; ISA flags: {flags}; torch CPU capability: {facts['capability']}")


def measure_isas(isas: list[str], base: dict, results: dict, startup_only: bool, repeat: int,
                 startup_rows: bool = True, generation_repeat: int = 1) -> dict:
    """The key rows under each ISA cap: mode 1 fp32 20-step 512^2 generation and peak RSS, sdlite and diffusers
    (each in its own process: load, generate), and the start-up breakdown of bench/startup.py. Natively, a full
    run's own rows are reused. ``startup_rows=False`` (--no-startup) leaves the start-up rows as last measured;
    ``generation_repeat`` processes per engine (alternating) give the generation rows' medians."""
    import startup

    out = {}
    for isa in isas:
        env = ISAS[isa]
        row = {"env": env}
        runs: dict[str, list] = {}
        for _ in range(generation_repeat):   # the engines alternate, so slow spells of the machine hit both
            for label, engine in (("diffusers fp32", "diffusers"), ("sdlite mode 1 fp32", "sdlite")):
                if startup_only:
                    continue
                if isa == "native" and label in results:
                    row[label] = results[label]
                    continue
                cfg = {**base, "engine": engine, "text": False, "unet_sizes": [], "decode_sizes": [],
                       "label": f"{label} {isa}", **({"memory_mode": 1} if engine == "sdlite" else {})}
                runs.setdefault(label, []).append(run_child(cfg, env=env))
                print(f"{isa}: {label}: {runs[label][-1]}", flush=True)
        for label, got in runs.items():
            row[label] = {**got[0], **{key: statistics.median(r[key] for r in got)
                                       for key in ("ready_s", "e2e_s", "peak_rss_mb")}, "runs": got}
        if startup_rows:
            row["startup"] = startup.measure(base["model"], repeat=repeat, env=env,
                                             log=lambda m: print(m, flush=True))
            row["capability"] = row["startup"]["sdlite"]["capability"]
            print(f"{isa}: start-up: " + json.dumps({e: r["median"] for e, r in row["startup"].items()}), flush=True)
        out[isa] = row
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no resolution sweep (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--only", default=None, help="comma-separated configuration labels to run")
    ap.add_argument("--report-only", action="store_true",
                    help="write BENCHMARKS.md again from bench/results.json, measuring nothing")
    ap.add_argument("--isa", default="native,avx2",
                    help="ISA caps for the per-ISA rows: native and/or avx2 (ONEDNN_MAX_CPU_ISA=AVX2 "
                         "ATEN_CPU_CAPABILITY=avx2 in the child processes); empty: none")
    ap.add_argument("--isa-only", action="store_true",
                    help="measure only the per-ISA rows (20-step 512^2 generation, peak RSS, start-up breakdown), "
                         "keep the rest of bench/results.json")
    ap.add_argument("--startup-only", action="store_true",
                    help="measure only the per-ISA start-up breakdown (bench/startup.py), keep the rest")
    ap.add_argument("--startup-repeat", type=int, default=5, help="fresh processes per engine for the start-up rows")
    ap.add_argument("--generation-repeat", type=int, default=1,
                    help="with --isa-only: processes per engine (alternating) for the generation rows' medians")
    ap.add_argument("--no-startup", action="store_true",
                    help="with --isa-only: measure the generation rows only, keep the start-up rows")
    args = ap.parse_args()
    raw_file = HERE / "results.json"
    if args.report_only:
        raw = json.loads(raw_file.read_text())
        sweep = {(k.split()[0], int(k.split()[1])): v for k, v in raw["sweep"].items()}
        write_report(Path(args.out), raw["results"], sweep, raw["large"], quick=raw["quick"], isa=raw.get("isa"),
                     facts=raw.get("cpu"))
        return
    sys.path.insert(0, str(HERE))
    from checkpoint import build

    folder, single = build()
    base = dict(model=str(folder), prompt=PROMPT, negative=NEGATIVE, steps=20, text=True, warmup=True,
                unet_sizes=[256, 512], decode_sizes=[512], repeat=1 if args.quick else 3,
                decode_repeat=1 if args.quick else 2, e2e=512)
    isas = [i for i in args.isa.split(",") if i]
    unknown = [i for i in isas if i not in ISAS]
    if unknown:
        raise SystemExit(f"unknown ISA {unknown[0]!r}: expected {', '.join(ISAS)}")
    if args.isa_only or args.startup_only:  # the other rows stay as the last full run measured them
        raw = json.loads(raw_file.read_text()) if raw_file.is_file() else \
            {"results": {}, "sweep": {}, "large": {}, "quick": args.quick}
        measured = measure_isas(isas, base, {}, args.startup_only, args.startup_repeat,
                                startup_rows=not args.no_startup, generation_repeat=args.generation_repeat)
        merged = raw.get("isa") or {}
        for isa, row in measured.items():
            merged[isa] = {**merged.get(isa, {}), **row}  # --startup-only keeps that ISA's generation rows
        raw["isa"], raw["cpu"] = merged, cpu_facts()
        raw_file.write_text(json.dumps(raw, indent=1))
        sweep = {(k.split()[0], int(k.split()[1])): v for k, v in raw["sweep"].items()}
        write_report(Path(args.out), raw["results"], sweep, raw["large"], quick=raw["quick"], isa=merged,
                     facts=raw["cpu"])
        return
    configs = [
        ("diffusers fp32", dict(engine="diffusers")),
        ("sdlite mode 1 fp32", dict(engine="sdlite", memory_mode=1)),
        ("sdlite mode 1 fp32, single file", dict(engine="sdlite", memory_mode=1, model=str(single))),
        ("sdlite mode 1, fp16 weights", dict(engine="sdlite", memory_mode=1, weight_dtype="float16")),
        ("sdlite mode 2 fp32", dict(engine="sdlite", memory_mode=2)),
        ("sdlite mode 0 fp32", dict(engine="sdlite", memory_mode=0)),
        ("sdlite mode 1 int8", dict(engine="sdlite", memory_mode=1, quantize="int8")),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        configs = [c for c in configs if c[0] in wanted or c[0] == "diffusers fp32"]
    results = {}
    for label, extra in configs:
        t = time.perf_counter()
        results[label] = run_child({**base, **extra, "label": label})
        print(f"{label}: {results[label]}  ({time.perf_counter() - t:.0f}s)", flush=True)

    sweep, large = {}, {}
    if not args.quick:
        for engine in ("diffusers", "sdlite"):
            for size in (256, 512, 768, 1024):
                cfg = {**base, "engine": engine, "text": False, "warmup": False, "unet_sizes": [size],
                       "decode_sizes": [size], "repeat": 1, "decode_repeat": 1, "e2e": None,
                       "label": f"{engine} {size}"}
                sweep[(engine, size)] = run_child(cfg)
                print(f"sweep {engine} {size}: {sweep[(engine, size)]}", flush=True)
        # peak memory of a whole 1024^2 generation (2 steps: the peak does not grow with the step count; the
        # decode is tiled automatically above 768 px) and of a 2048^2 tiled decode, each in its own process
        large["e2e_1024"] = run_child({**base, "engine": "sdlite", "memory_mode": 1, "text": False, "unet_sizes": [],
                                       "decode_sizes": [], "e2e": 1024, "steps": 2, "label": "sdlite 1024 e2e"})
        print(f"sdlite 1024^2 generation: {large['e2e_1024']}", flush=True)
        large["e2e_1024_fp16"] = run_child({**base, "engine": "sdlite", "memory_mode": 1, "weight_dtype": "float16",
                                            "text": False, "unet_sizes": [], "decode_sizes": [], "e2e": 1024,
                                            "steps": 2, "label": "sdlite 1024 e2e fp16 weights"})
        print(f"sdlite 1024^2 generation, fp16 weights: {large['e2e_1024_fp16']}", flush=True)
        # the decode by itself: memory mode 0 keeps no UNet resident; tiles of 512 px as in modes 1 and 2
        large["decode_2048"] = run_child({**base, "engine": "sdlite", "memory_mode": 0, "vae_tile": 64,
                                          "text": False, "unet_sizes": [], "decode_sizes": [2048],
                                          "decode_repeat": 1, "e2e": None, "label": "sdlite 2048 decode"})
        print(f"sdlite 2048^2 tiled decode: {large['decode_2048']}", flush=True)
        large["quality"] = run_child({"model": base["model"], "prompt": PROMPT, "negative": NEGATIVE,
                                      "modes": ["int8", "int8-bf16", "bf16"], "full_modes": ["int8"]}, QUALITY)
        print(f"quality: {large['quality']}", flush=True)
        tiles = subprocess.run([sys.executable, str(HERE / "tiled_vae.py"), "--only", "accuracy", "--out", str(HERE)],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if tiles.returncode:
            raise SystemExit(f"bench/tiled_vae.py failed:\n{tiles.stderr[-3000:]}")
        large["tiles"] = (HERE / "tiled_vae.md").read_text(encoding="utf-8").split("\n", 2)[2]
        print(large["tiles"], flush=True)
        prof = subprocess.run([sys.executable, str(HERE / "profile_unet.py")], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if prof.returncode:
            raise SystemExit(f"bench/profile_unet.py failed:\n{prof.stderr[-3000:]}")
        large["profile"] = prof.stdout
        # the transformer families (issue 55): sdlite against diffusers bf16 at reduced depth, bench/dit.md
        dit = subprocess.run([sys.executable, str(HERE / "dit.py"), "--md", str(HERE / "dit_table.md")],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if dit.returncode:
            raise SystemExit(f"bench/dit.py failed:\n{dit.stderr[-3000:]}")
        large["dit"] = (HERE / "dit_table.md").read_text(encoding="utf-8")
    isa = measure_isas(isas, base, results, False, args.startup_repeat) if isas else {}
    facts = cpu_facts()
    raw_file.write_text(json.dumps({"results": results, "sweep": {f"{e} {s}": v for (e, s), v in sweep.items()},
                                    "large": large, "quick": args.quick, "isa": isa, "cpu": facts}, indent=1))
    write_report(Path(args.out), results, sweep, large, quick=args.quick, isa=isa, facts=facts)


def _ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def write_report(path: Path, results: dict, sweep: dict, large: dict, quick: bool, isa: dict | None = None,
                 facts: dict | None = None) -> None:
    ref = results.get("diffusers fp32", {})
    rows = [("import + load to ready, s", "ready_s"), ("text encoding, s", "text_s"),
            ("UNet step 256^2 (cfg, batch 2), s", "unet_256_s"), ("UNet step 512^2 (cfg, batch 2), s", "unet_512_s"),
            ("VAE decode 512^2, s", "decode_512_s"), ("end to end 512^2, 20 steps, s", "e2e_s"),
            ("peak RSS, MB", "peak_rss_mb")]
    labels = list(results)
    lines = ["# Benchmarks", "",
             "sdlite against diffusers on the same full-size SD 1.5 checkpoint (fp16 safetensors, random weights at "
             "the real shapes, built by `bench/checkpoint.py`), each configuration in its own process. "
             "Prompt and negative prompt as in `bench/run.py`, DPM++ 2M Karras, cfg 7.5, seed 42, fp32 compute "
             "unless stated. Medians of repeated runs inside each process (the 20-step generation runs once).", "",
             f"Machine: {machine(facts)}", "", f"Command: `make bench` (`python bench/run.py{' --quick' if quick else ''}`)",
             "", "| measure | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name, key in rows:
        cells = []
        for label in labels:
            v = results[label].get(key)
            cell = "-" if v is None else (f"{v:.0f}" if key == "peak_rss_mb" else f"{v:.2f}")
            if label != "diffusers fp32" and v is not None:
                cell += f" ({_ratio(v, ref.get(key))})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios in parentheses are against diffusers fp32 in the same run (lower is better)."]
    lines += targets(results, large, isa or {})
    lines += isa_section(isa or {})
    if sweep:
        lines += ["", "## Against resolution", "",
                  "One process per engine and resolution: one UNet step (cfg, batch 2), one VAE decode, peak RSS.",
                  "", "| resolution | diffusers UNet s | sdlite UNet s | diffusers decode s | sdlite decode s | "
                  "diffusers peak MB | sdlite peak MB |", "|---|---|---|---|---|---|---|"]
        for size in sorted({s for _, s in sweep}):
            d, s = sweep.get(("diffusers", size), {}), sweep.get(("sdlite", size), {})
            lines.append(f"| {size}^2 | {d.get(f'unet_{size}_s', 0):.2f} | {s.get(f'unet_{size}_s', 0):.2f} | "
                         f"{d.get(f'decode_{size}_s', 0):.2f} | {s.get(f'decode_{size}_s', 0):.2f} | "
                         f"{d.get('peak_rss_mb', 0):.0f} | {s.get('peak_rss_mb', 0):.0f} |")
        plot = path.parent / "bench" / "resolution.png"
        if _plot(sweep, plot) or plot.is_file():  # --report-only without matplotlib keeps the last plot
            lines += ["", f"![time and peak memory against resolution]({plot.relative_to(path.parent)})"]
    if large:
        e2e, dec = large["e2e_1024"], large["decode_2048"]
        lines += ["", "## Large images (sdlite, fp32 compute)", "",
                  "| run | time, s | peak RSS, MB |", "|---|---|---|",
                  f"| whole 1024^2 generation, mode 1, 2 steps (tiled decode, automatic above 768 px) | "
                  f"{e2e['e2e_s']:.1f} | {e2e['peak_rss_mb']:.0f} |"]
        if "e2e_1024_fp16" in large:
            e16 = large["e2e_1024_fp16"]
            lines.append(f"| the same with fp16 weights (`--weight-dtype fp16`) | {e16['e2e_s']:.1f} | "
                         f"{e16['peak_rss_mb']:.0f} |")
        lines += [f"| 2048^2 tiled decode (tiles of 512 px), the VAE alone (memory mode 0: no UNet resident) | "
                  f"{dec['decode_2048_s']:.1f} | {dec['peak_rss_mb']:.0f} |"]
        if "decode_2048_mode1_unet_resident" in large:  # measured by an earlier form of this harness
            d1 = large["decode_2048_mode1_unet_resident"]
            lines.append(f"| 2048^2 tiled decode in mode 1, the fp32 UNet (3.4 GB) resident beside it | "
                         f"{d1['decode_2048_s']:.1f} | {d1['peak_rss_mb']:.0f} |")
        lines += ["",
                  "The 1024^2 generation's peak does not grow with the step count: every step reuses the same "
                  "buffers.", "", large["tiles"].strip().replace("###", "##", 1), "",
                  "![untiled | tiled | difference x16, around a junction of four tiles](bench/seam_crop.png)"]
        q = large["quality"]
        lines += ["", "## Quantized UNet: image quality against our fp32 output", "",
                  f"Demo model (`sdlite/data/demo`), 20 steps DPM++ 2M Karras, cfg 7.5, "
                  f"{q['demo']['int8']['images']} images (4 prompts x 2 seeds), 8-bit PSNR of each image against the "
                  f"fp32 image:", "", "| mode | median PSNR, dB | lowest PSNR, dB | largest pixel difference |",
                  "|---|---|---|---|"]
        for mode, r in q["demo"].items():
            lines.append(f"| {mode} | {r['psnr_median']:.1f} | {r['psnr_min']:.1f} | {r['max_pixel_diff']}/255 |")
        for mode, r in q["full"].items():
            lines += ["", f"Full-size random checkpoint, {mode}, 256^2, 8 steps, cfg 7.5: cosine similarity of the "
                          f"final latent against fp32: {r['latent_cosine']:.5f}."]
        lines += ["", large["profile"].strip()]
        if large.get("dit"):
            lines += ["", "## Transformer families against diffusers bf16 (`python bench/dit.py`)", "",
                      large["dit"].strip().replace("### ", "### DiT: ")]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {path}")


STARTUP_ROWS = (("import (interpreter start included), s", "import"), ("load to ready, s", "load"),
                ("first text encoding (prompt + negative), s", "text1"), ("second text encoding, s", "text2"),
                ("import + load + first text encoding, s", "before_unet"),
                ("sdlite's VAE load (at its first decode, after sampling), s", "vae"))


def isa_section(isa: dict) -> list[str]:
    """Natively and under each ISA cap, side by side: the key rows, sdlite mode 1 fp32 against diffusers fp32
    measured under the same cap."""
    if not isa:
        return []
    names = list(isa)
    counts = {n: len(isa[n].get("sdlite mode 1 fp32", {}).get("runs", [])) for n in names}
    gen_runs = max(counts.values(), default=0)
    if len(set(counts.values())) > 1:   # measured at different times with different repeats
        gen_runs = " / ".join(f"{c} ({n})" for n, c in counts.items())
    lines = ["", "## Per ISA", "",
             "The key rows natively and with the CPU capped to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2 "
             "ATEN_CPU_CAPABILITY=avx2` in each child process's environment): sdlite mode 1 fp32 against diffusers "
             "fp32, each ratio against diffusers under the same cap. The generation rows: one process per engine "
             "that loads and runs one 20-step 512^2 generation (DPM++ 2M Karras, cfg 7.5), timed from the call "
             "to the images" + (f", the median of {gen_runs} such processes per engine, the engines alternating"
                                if gen_runs not in (0, 1) else "") + "; in a full run the "
             "native ones are the main table's, with `--isa-only` they are measured here (and may then differ "
             "from the main table, which is not re-measured). The start-up rows: `bench/startup.py`, medians over fresh processes, "
             "engines alternating.", "",
             "torch CPU capability: " + ", ".join(f"{n}: {isa[n].get('capability', '?')}" for n in names), "",
             "| measure | " + " | ".join(f"{n}: sdlite | {n}: diffusers | {n}: ratio" for n in names) + " |",
             "|---|" + "---|---|---|" * len(names)]

    def cells(get, fmt, own):
        out = []
        for n in names:
            s, d = get(isa[n], "sdlite"), get(isa[n], "diffusers")
            if own:  # sdlite's alone: diffusers did it inside its load
                out += [fmt(s), "(in load)", "-"]
            else:
                out += [fmt(s), fmt(d), _ratio(s, d) if s is not None and d else "-"]
        return out

    def gen(key):
        return lambda row, e: row.get("sdlite mode 1 fp32" if e == "sdlite" else "diffusers fp32", {}).get(key)

    def start(key):
        return lambda row, e: row.get("startup", {}).get(e, {}).get("median", {}).get(key)

    fmt_s = lambda v: "-" if v is None else f"{v:.2f}"
    rows = [("whole 512^2 generation, 20 steps, s", gen("e2e_s"), fmt_s),
            ("peak RSS, MB", gen("peak_rss_mb"), lambda v: "-" if v is None else f"{v:.0f}")]
    rows += [(name, start(key), fmt_s) for name, key in STARTUP_ROWS]
    for name, get, fmt in rows:
        lines.append(f"| {name} | " + " | ".join(cells(get, fmt, name.startswith("sdlite's"))) + " |")
    runs = {n: len(isa[n]["startup"]["sdlite"]["runs"]) for n in names if "startup" in isa[n]}
    if runs:
        lines += ["", "Start-up: " + ", ".join(f"{n} median of {k} processes per engine" for n, k in runs.items())
                  + ". sdlite builds its text encoder at the first encoding and its VAE at the first decode; "
                  "diffusers builds all three networks in `from_pretrained`. Command: "
                  "`python bench/run.py --startup-only` (or `python bench/startup.py [--isa avx2]`)."]
    return lines


def targets(results: dict, large: dict, isa: dict | None = None) -> list[str]:
    """The issue's targets, each with the measured figure and whether it is met."""
    ref = results.get("diffusers fp32", {})
    m1, m0, q8 = (results.get(k, {}) for k in ("sdlite mode 1 fp32", "sdlite mode 0 fp32", "sdlite mode 1 int8"))
    rows = []

    def ratio(a, b, key, limit, what):
        if a.get(key) and b.get(key):
            r = a[key] / b[key]
            rows.append(f"| {what} | <= {limit}x | {r:.2f}x | {'met' if r <= limit else 'not met'} |")

    ratio(m1, ref, "unet_512_s", 1.0, "mode 1 fp32: UNet step 512^2 / diffusers'")
    ratio(m1, ref, "e2e_s", 0.95, "mode 1 fp32: 20-step 512^2 generation / diffusers'")
    ratio(m1, ref, "peak_rss_mb", 0.6, "mode 1 fp32: peak RSS / diffusers'")
    ratio(results.get("sdlite mode 1, fp16 weights", {}), ref, "peak_rss_mb", 0.6,
          "mode 1, fp16 weights: peak RSS / diffusers'")
    ratio(m1, ref, "ready_s", 0.25, "mode 1 fp32: import + load / diffusers'")
    ratio(results.get("sdlite mode 1, fp16 weights", {}), ref, "ready_s", 0.25,
          "mode 1, fp16 weights: import + load / diffusers'")
    if m0.get("peak_rss_mb"):
        v = m0["peak_rss_mb"]
        rows.append(f"| mode 0: peak RSS, whole 512^2 generation | <= 1536 MB | {v:.0f} MB | "
                    f"{'met' if v <= 1536 else 'not met'} |")
    ratio(m0, m1, "e2e_s", 1.5, "mode 0: 20-step generation / mode 1's")
    ratio(q8, ref, "unet_512_s", 0.6, "int8: UNet step 512^2 / diffusers' fp32")
    if large:
        psnr = large["quality"]["demo"]["int8"]["psnr_min"]
        rows.append(f"| int8: demo-model PSNR against fp32 (lowest of 8 images) | >= 30 dB | {psnr:.1f} dB | "
                    f"{'met' if psnr >= 30 else 'not met'} |")
        for key, limit, what in (("e2e_1024", 6144, "1024^2 generation, mode 1, tiled decode: peak RSS"),
                                 ("e2e_1024_fp16", 6144, "the same with fp16 weights: peak RSS"),
                                 ("decode_2048", 8192, "2048^2 tiled decode (VAE alone): peak RSS")):
            if key not in large:
                continue
            v = large[key]["peak_rss_mb"]
            rows.append(f"| {what} | <= {limit} MB | {v:.0f} MB | {'met' if v <= limit else 'not met'} |")
        levels = [int(float(cells[3])) for cells in (line.split("|") for line in large.get("tiles", "").splitlines())
                  if len(cells) > 4 and cells[1].strip().isdigit()]
        if levels:
            v = max(levels)
            rows.append(f"| tiled vs untiled decode at 512^2: max difference | <= 3/255 | {v}/255 | "
                        f"{'met' if v <= 3 else 'not met'} |")
    for name, row in (isa or {}).items():
        m1i, refi = row.get("sdlite mode 1 fp32", {}), row.get("diffusers fp32", {})
        ratio(m1i, refi, "e2e_s", 0.90, f"{name}: mode 1 fp32 20-step 512^2 generation / diffusers' (same ISA)")
        ratio(m1i, refi, "peak_rss_mb", 0.90, f"{name}: mode 1 fp32 peak RSS / diffusers' (same ISA)")
        st = row.get("startup", {})
        if "sdlite" in st and "diffusers" in st:
            ratio(st["sdlite"]["median"], st["diffusers"]["median"], "before_unet", 0.5,
                  f"{name}: import + load + first text encoding / diffusers' (same ISA)")
    return ["", "## Targets", "", "| target | wanted | measured | |", "|---|---|---|---|", *rows]


def _plot(sweep: dict, dest: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot", file=sys.stderr)
        return False
    sizes = sorted({s for _, s in sweep})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for engine, style in (("diffusers", "o--"), ("sdlite", "s-")):
        axes[0].plot(sizes, [sweep[(engine, s)][f"unet_{s}_s"] for s in sizes], style, label=engine)
        axes[1].plot(sizes, [sweep[(engine, s)][f"decode_{s}_s"] for s in sizes], style, label=engine)
        axes[2].plot(sizes, [sweep[(engine, s)]["peak_rss_mb"] / 1024 for s in sizes], style, label=engine)
    for ax, title in zip(axes, ("UNet step (cfg), s", "VAE decode, s", "peak RSS, GiB")):
        ax.set_title(title)
        ax.set_xlabel("image side, px")
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    dest.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dest, dpi=110)
    return True


if __name__ == "__main__":
    main()
