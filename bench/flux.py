"""FLUX.1-schnell from GGUF files: sdlite against stable-diffusion.cpp on the same files, per step, whole generation
and peak RSS.

    python bench/flux.py [--build-only] [--steps 4] [--size 512] [--only LABEL,...] [--report-only] [--note TEXT]

The files (``bench/cache/flux-schnell/``, about 25 GB, built once by this script): the schnell transformer at its
released shapes (BFL's names, as city96's GGUFs) in Q8_0 (``flux1-schnell-Q8_0.gguf``) and in Q4_K
(``flux1-schnell-Q4_K.gguf``): every 2-D weight whose rows are whole blocks in that type, biases and norm scales in
F32; random values (Q8_0: int8 values with fp16 block scales around 0.02 / 127 x 3; Q4_K: random nibbles, 6-bit
scales and fp16 super-scales around 6e-5, so weights are of a trained layer's size). T5-XXL as a GGUF in
llama.cpp's names with its matrices in Q8_0 (``t5-v1_1-xxl-encoder-Q8_0.gguf``, random likewise), CLIP-L
(``clip_l.safetensors``, ComfyUI's names) and the VAE (``ae.safetensors``, LDM names) from random weights in bf16.

Both engines read those files: sd.cpp through ``diffusion_model_path``, ``t5xxl_path``, ``clip_l_path`` and
``vae_path`` (stable-diffusion-cpp-python, ``make setup-sdcpp``); sdlite through ``Engine.load(transformer,
text_encoders=[t5, clip_l, ae])``. Each configuration runs in its own fresh process with 2 threads: load, then one
generation (the prompt below, Euler, cfg 1 as schnell runs, seed 42, 512x512, 4 steps). Step times are each engine's
own progress callbacks; peak RSS the process's ``ru_maxrss``. Raw figures to bench/flux.json, the report to
bench/flux.md and the section "FLUX.1 from GGUF" of BENCHMARKS.md.
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

import numpy as np

from ggufs import write_gguf

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / "cache" / "flux-schnell"
SHARED = HERE / "cache" / "sd3-shared"      # CLIP-L comes from bench/sd3.py's shared encoders where built
SDCPP_PYTHON = ROOT / ".venv-sdcpp" / "bin" / "python"
OUR_PYTHON = Path(sys.executable)
RAW, REPORT = HERE / "flux.json", HERE / "flux.md"
MARK_BEGIN, MARK_END = "<!-- flux:begin (written by bench/flux.py) -->", "<!-- flux:end -->"
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED, THREADS = 42, 2
CHILD_TIMEOUT_S = 5400
FILES = {"q8_0": "flux1-schnell-Q8_0.gguf", "q4_k": "flux1-schnell-Q4_K.gguf",
         "t5": "t5-v1_1-xxl-encoder-Q8_0.gguf", "clip_l": "clip_l.safetensors", "vae": "ae.safetensors"}

# label -> (engine, transformer file, options)
CONFIGS = {
    "sd.cpp Q8_0": ("sdcpp", "q8_0", {}),
    "sdlite Q8_0 mode0": ("sdlite", "q8_0", {"precision": "auto", "memory_mode": 0}),
    "sdlite Q8_0 mode1": ("sdlite", "q8_0", {"precision": "auto", "memory_mode": 1}),
    "sd.cpp Q4_K": ("sdcpp", "q4_k", {}),
    "sdlite Q4_K mode0": ("sdlite", "q4_k", {"precision": "auto", "memory_mode": 0}),
}


# --- the files ---------------------------------------------------------------------------------------------------

def _kind(name: str, shape, qtype: str) -> str:
    block = {"Q8_0": 32, "Q4_K": 256}[qtype]
    return qtype if len(shape) == 2 and shape[1] % block == 0 and shape[0] > 1 else "F32"


def _plain(name: str, shape, rng) -> np.ndarray:
    if name.endswith((".scale", "norm.weight")) or "_norm" in name:
        return np.ones(shape, np.float32)
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


def build() -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    from safetensors.torch import load_file, save_file

    from sdlite.config.flux import FLUX_SCHNELL, FLUX_VAE
    from sdlite.config.t5 import T5_XXL
    from sdlite.models.flux import Flux
    from sdlite.models.t5 import T5Encoder
    from sdlite.models.vae import AutoencoderKL
    from sdlite.weights.flux_keys import flux_to_original
    from sdlite.weights.vae_keys import vae_to_original

    CACHE.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        canon = {k: tuple(v.shape) for k, v in Flux(FLUX_SCHNELL).state_dict().items()}
    bfl = flux_to_original(canon).shapes(canon)
    for qtype, key in (("Q8_0", "q8_0"), ("Q4_K", "q4_k")):
        path = CACHE / FILES[key]
        if path.is_file():
            continue
        rng = np.random.default_rng(0)
        print(f"writing {path.name} ...", flush=True)
        write_gguf(path, "flux", [(n, s, lambda n=n, s=s: _plain(n, s, rng)) for n, s in sorted(bfl.items())],
                   lambda n, s, qtype=qtype: _kind(n, s, qtype))
    t5_path = CACHE / FILES["t5"]
    if not t5_path.is_file():
        import gguf

        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.T5ENCODER, T5_XXL.num_layers)
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in T5Encoder(T5_XXL).state_dict().items()}
        rng = np.random.default_rng(1)
        tensors = []
        for k, s in sorted(shapes.items()):
            if k == "encoder.embed_tokens.weight":
                continue
            name = names.get_name(k.removesuffix(".weight")) + ".weight"
            tensors.append((name, s, lambda name=name, s=s: _plain(name, s, rng)))
        print(f"writing {t5_path.name} ...", flush=True)
        write_gguf(t5_path, "t5encoder", tensors,
                   lambda n, s: "F32" if "attn_rel_b" in n or len(s) == 1 else "Q8_0")
    clip_path = CACHE / FILES["clip_l"]
    if not clip_path.is_file():
        shared = SHARED / "text_encoder" / "model.safetensors"
        if shared.is_file():
            state = load_file(shared)
        else:
            from sdlite.config.flux import FLUX_TEXT_L
            from sdlite.models.clip import CLIPTextEncoder

            torch.manual_seed(2)
            state = CLIPTextEncoder(FLUX_TEXT_L).state_dict()
        save_file({(k if k.startswith(("text_model.", "text_projection")) else "text_model." + k):
                   v.to(torch.bfloat16).contiguous() for k, v in state.items() if not k.endswith("position_ids")},
                  clip_path)
    vae_path = CACHE / FILES["vae"]
    if not vae_path.is_file():
        torch.manual_seed(3)
        state = AutoencoderKL(FLUX_VAE).state_dict()
        save_file({k: v.to(torch.bfloat16).contiguous()
                   for k, v in vae_to_original(state.keys(), prefix="").materialize(state).items()}, vae_path)
    print("files in", CACHE.relative_to(ROOT), flush=True)


# --- the runs ----------------------------------------------------------------------------------------------------

_COMMON = r"""
import json, resource, sys, time
cfg = json.loads(sys.argv[1])
now = time.perf_counter
out = {"notes": []}
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t_start = now()
"""

SDCPP_CHILD = _COMMON + r"""
from stable_diffusion_cpp import StableDiffusion
f = cfg["files"]
sd = StableDiffusion(diffusion_model_path=f["model"], clip_l_path=f["clip_l"], t5xxl_path=f["t5"], vae_path=f["vae"],
                     n_threads=cfg["threads"], verbose=False)
out["ready_s"] = now() - t_start
calls = []
t0 = now()
sd.generate_image(prompt=cfg["prompt"], cfg_scale=1.0, sample_method="euler", sample_steps=cfg["steps"],
                  seed=cfg["seed"], width=cfg["size"], height=cfg["size"],
                  progress_callback=lambda step, n, t: calls.append((step, n, t, now())))
out["total"] = now() - t0
out["steps"] = [c[2] for c in calls if c[1] == cfg["steps"]][-cfg["steps"]:]
out["peak_rss_mb"] = peak_mb()
print("RESULT " + json.dumps(out), flush=True)
"""

SDLITE_CHILD = _COMMON + r"""
import torch
torch.set_num_threads(cfg["threads"])
from sdlite.pipeline import Engine, Request
f = cfg["files"]
engine = Engine.load(f["model"], text_encoders=[f["t5"], f["clip_l"], f["vae"]], precision=cfg["precision"],
                     memory_mode=cfg["memory_mode"])
m = engine.models
out["resolved"] = {"precision": engine.precision.label, "memory_mode": m.mode,
                   **{n: str(m.dtype_of(n)).removeprefix("torch.") for n in ("transformer", "text_encoder",
                                                                            "text_encoder_3", "vae")}}
out["ready_s"] = now() - t_start
ends = []
t0 = now()
with torch.no_grad():
    res = engine.generate(Request(prompt=cfg["prompt"], width=cfg["size"], height=cfg["size"], steps=cfg["steps"],
                                  cfg_scale=1.0, sampler="euler", seed=cfg["seed"]), callback=lambda i, n: ends.append(now()))
out["total"] = now() - t0
marks = [t0 + res.timings["text"]] + ends[-cfg["steps"]:]
out["steps"] = [b - a for a, b in zip(marks, marks[1:])]
out["text"], out["decode"] = res.timings["text"], res.timings["decode"]
out["peak_rss_mb"] = peak_mb()
print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(label: str, args) -> dict:
    engine, model, options = CONFIGS[label]
    python = SDCPP_PYTHON if engine == "sdcpp" else OUR_PYTHON
    if not python.is_file():
        sys.exit(f"{python.relative_to(ROOT)} is missing: run make setup-sdcpp")
    files = {"model": str(CACHE / FILES[model]), **{k: str(CACHE / FILES[k]) for k in ("t5", "clip_l", "vae")}}
    cfg = {"files": files, "steps": args.steps, "size": args.size, "prompt": PROMPT, "seed": SEED,
           "threads": THREADS, **options}
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([str(python), "-c", SDCPP_CHILD if engine == "sdcpp" else SDLITE_CHILD,
                               json.dumps(cfg)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {args.timeout} s", "wall_s": time.monotonic() - t0}
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
    lines = [f"{h} FLUX.1 from GGUF: sdlite against stable-diffusion.cpp", "",
             "FLUX.1-schnell at its released shapes (random weights) from the same GGUF files: the transformer in "
             "Q8_0 or Q4_K (city96's layout), T5-XXL in Q8_0 (llama.cpp's names), ComfyUI's `clip_l` and BFL's `ae` "
             f"beside it (`python bench/flux.py --build-only`). {meta['size']}x{meta['size']}, {meta['steps']} Euler "
             f"steps, cfg 1, seed {SEED}, {THREADS} threads, each configuration in a fresh process. "
             f"stable-diffusion-cpp-python {meta.get('sdcpp_version', '?')} built from source with `GGML_NATIVE=ON`. "
             "Step times are each engine's own per-step figures (medians); ratios are sdlite's against sd.cpp's on "
             "the same transformer file (lower is better).", "",
             f"Machine: {meta['machine']}. Command: `python bench/flux.py`, run {meta['date']}."
             + (f" {meta['note']}" if meta.get("note") else ""), ""]
    labels = [k for k in CONFIGS if k in res]
    lines += ["| measure | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]

    def row(name, get):
        vals = []
        for label in labels:
            try:
                v = get(res[label])
            except (KeyError, IndexError, TypeError, ValueError):
                vals.append("failed" if "error" in res[label] else "-")
                continue
            ratio = ""
            base = res.get(f"sd.cpp {CONFIGS[label][1].upper()}", {})
            if not label.startswith("sd.cpp"):
                try:
                    ratio = f" ({v / get(base):.2f}x)"
                except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
                    pass
            vals.append(f"{v:.1f}{ratio}" if v >= 10 else f"{v:.2f}{ratio}")
        lines.append(f"| {name} | " + " | ".join(vals) + " |")

    row("load to ready, s", lambda r: r["ready_s"])
    row("step (median), s", lambda r: _median(r["steps"]))
    row(f"whole {meta['steps']}-step generation, s", lambda r: r["total"])
    row("peak RSS, MB", lambda r: r["peak_rss_mb"])
    notes = []
    for label in labels:
        r = res[label]
        if "error" in r:
            notes.append(f"- {label} failed: `{r['error'][-300:].strip()}`")
        elif "resolved" in r:
            notes.append(f"- {label}: " + ", ".join(f"{k} {v}" for k, v in r["resolved"].items())
                         + f"; text {r['text']:.1f} s, decode {r['decode']:.1f} s")
    return lines + ([""] + notes if notes else [])


def write_reports(raw: dict) -> None:
    REPORT.write_text("\n".join(body(raw, "#")) + "\n", encoding="utf-8")
    bench = ROOT / "BENCHMARKS.md"
    section = "\n".join([MARK_BEGIN, *body(raw, "##"), "", "Raw figures: `bench/flux.json`.", MARK_END])
    text = bench.read_text(encoding="utf-8")
    begin, end = text.find(MARK_BEGIN), text.find(MARK_END)
    text = text[:begin] + section + text[end + len(MARK_END):] if 0 <= begin < end else \
        text.rstrip("\n") + "\n\n" + section + "\n"
    bench.write_text(text, encoding="utf-8")
    print(f"wrote {REPORT.name} and the section of BENCHMARKS.md")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--only", default=None, help="labels to measure (the others are kept from bench/flux.json)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--timeout", type=int, default=CHILD_TIMEOUT_S, help="seconds a configuration may take")
    ap.add_argument("--note", default=None, help="a sentence the report adds after the machine (what else ran)")
    args = ap.parse_args()
    if not args.report_only:
        build()
    if args.build_only:
        return 0
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
