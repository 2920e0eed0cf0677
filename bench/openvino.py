"""OpenVINO as a standing speed anchor: sdlite against OpenVINO (optimum-intel) on the same full-size SD 1.5 checkpoint.

    python bench/openvino.py [--rounds 3] [--size 512] [--steps 20]      (what `make bench` runs, in .venv)
    python bench/openvino.py --quick                                     (256^2, 2 steps, 1 round: a smoke run)
    python bench/openvino.py --report-only                               (the section again from the JSON)

optimum-intel cannot share the project's virtualenv (it pins an older transformers than the tests do), so it lives
in .venv-openvino (`make setup-openvino`); this script runs in .venv and starts itself with ``--child`` in whichever
of the two virtualenvs a configuration needs.

The checkpoint is the cached diffusers folder of bench/checkpoint.py (fp16 safetensors, random weights at the real
SD 1.5 shapes). It is exported once to OpenVINO IR, ``OVStableDiffusionPipeline.from_pretrained(folder,
export=True)`` then ``save_pretrained``, into bench/cache/sd15-fp16-openvino/ (exported again when the checkpoint,
OpenVINO or optimum-intel changes); the export is not timed. Configurations, each process a fresh one:

* ``sdlite default``: ``Engine.load(folder)`` (precision ``auto``: bf16 on a CPU with native bf16 dot products);
* ``sdlite exact``: ``Engine.load(folder, precision="exact")`` (fp32, the diffusers-exact path);
* ``OpenVINO default``: the saved IR loaded, ``reshape(batch_size=1, height, width, num_images_per_prompt=1)`` and
  ``compile()``, as FastSD CPU does; OpenVINO picks its inference precision itself (bf16 on a CPU with native
  bf16); the precision it picked is read back from the compiled models;
* ``OpenVINO f32``: the same with ``ov_config={"INFERENCE_PRECISION_HINT": "f32"}``.

Per process: "ready" (sdlite: import done to engine loaded; OpenVINO: load + reshape + compile), one whole generation
(512^2, 20 steps, DPM++ 2M Karras -- diffusers' DPMSolverMultistepScheduler with Karras sigmas for OpenVINO --, cfg
7.5, the prompt and negative prompt below, seed 1), timed from the call to the image, and split into text encoding,
sampling and decode; the whole process's wall time as the parent sees it (interpreter start to exit); the process's
peak RSS (``ru_maxrss``). The checkpoint's (or the IR's) files are read once before every process, so each engine
loads from the page cache. The configurations alternate (A B C D A B C D ...) for ``--rounds`` rounds; the report
has the medians. Quality: the PSNR (8-bit RGB, peak 255) of sdlite's default image against sdlite exact's (same
seed), and of OpenVINO's default against its f32 (OpenVINO's pipeline draws its noise apart from sdlite's, so the
two engines' pixels are not compared).

Raw figures go to bench/results-openvino.json (after every process), the table to an "OpenVINO" section of
BENCHMARKS.md between markers (replaced in place; appended where absent). bench/run.py rewrites BENCHMARKS.md whole,
so `make bench` runs this script after it.

Under the AVX2 caps (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``, which OpenVINO honours too) the same
script measures a CPU without native bf16: `make bench` runs it so with ``--configs 'sdlite default,sdlite
exact,OpenVINO f32' --json bench/results-openvino-avx2.json``, and the report goes to a section of its own, with the
default (fp32-fast there) against OpenVINO f32 as its target.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# This file has the name of the package it measures. Keep bench/ off the import path, so that `import openvino`
# (here, or a library probing whether OpenVINO is installed) finds the real package, not this script.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != HERE]

PROMPT, NEGATIVE = "a red circle on a blue background, highly detailed", "blurry, low quality"
SEED, CFG_SCALE = 1, 7.5
OV_PYTHON = ROOT / ".venv-openvino" / "bin" / "python"
IR_DIR = HERE / "cache" / "sd15-fp16-openvino"
EXPORT_INFO = "sdlite-export.json"
RESULTS = HERE / "results-openvino.json"
# the section's markers and heading: one section as the CPU runs, one under the AVX2 caps (ISA_CAPS set)
SECTIONS = {False: ("openvino", "## Against OpenVINO"),
            True: ("openvino-avx2", "### Against OpenVINO under the AVX2 cap (CPUs without native bf16)")}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}

# label -> (engine, settings); the order is the order of the processes in each round
CONFIGS = {
    "sdlite default": ("sdlite", {"precision": None}),
    "OpenVINO default": ("openvino", {"ov_config": {}}),
    "sdlite exact": ("sdlite", {"precision": "exact"}),
    "OpenVINO f32": ("openvino", {"ov_config": {"INFERENCE_PRECISION_HINT": "f32"}}),
}
# the pairs the report compares: (sdlite, OpenVINO); the default against OpenVINO f32 is the target on CPUs
# without native bf16, where sdlite's default is fp32 (fp32-fast)
PAIRS = (("sdlite default", "OpenVINO default"), ("sdlite exact", "OpenVINO f32"), ("sdlite default", "OpenVINO f32"))
# the environment variables that cap both engines' ISA, named in the report's command line when set
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
# the pairs whose images are compared: (tested, reference)
QUALITY = (("sdlite default", "sdlite exact"), ("OpenVINO default", "OpenVINO f32"))
MEASURES = ("import_s", "ready_s", "generation_s", "text_s", "sampling_s", "decode_s", "process_s", "peak_rss_mb")


def marks(raw: dict) -> tuple[str, str, str]:
    """The section's begin and end markers and its heading, by whether the run was capped."""
    key, heading = SECTIONS[bool(raw.get("isa_caps"))]
    return f"<!-- {key}:begin (written by bench/openvino.py) -->", f"<!-- {key}:end -->", heading


# --- the children ---------------------------------------------------------------------------------------------

def _hide_torchvision() -> None:
    """optimum-intel requires torchvision at install time (for vision-language models only). The torchvision
    wheel pip finds for Linux is the CUDA build, whose operators do not load against the CPU build of torch, and
    transformers then fails while importing its image processors. Hidden, it is simply not used."""
    sys.modules["torchvision"] = None


def _version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def child_export(cfg: dict) -> dict:
    """Export the diffusers folder to OpenVINO IR once (into a temporary folder, renamed when complete)."""
    import openvino

    source, dest = Path(cfg["source"]), Path(cfg["dest"])
    key = {"source": source.name, "source_files": cfg["source_key"], "openvino": openvino.__version__,
           "optimum_intel": _version("optimum-intel")}
    info_file = dest / EXPORT_INFO
    if info_file.is_file():
        info = json.loads(info_file.read_text())
        if all(info.get(k) == v for k, v in key.items()):
            return {**info, "cached": True}
    _hide_torchvision()
    from optimum.intel import OVStableDiffusionPipeline

    t = time.perf_counter()
    pipe = OVStableDiffusionPipeline.from_pretrained(str(source), export=True, compile=False, local_files_only=True)
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    pipe.save_pretrained(str(tmp))
    seconds = time.perf_counter() - t
    info = {**key, "export_s": seconds,
            "peak_rss_mb": _peak_rss_mb()}
    (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    tmp.rename(dest)
    return {**info, "cached": False}


def child_openvino(cfg: dict) -> dict:
    t_start = time.perf_counter()
    _hide_torchvision()
    import openvino
    import torch
    from diffusers import DPMSolverMultistepScheduler
    from optimum.intel import OVStableDiffusionPipeline

    out = {"import_s": time.perf_counter() - t_start, "openvino": openvino.__version__,
           "optimum_intel": _version("optimum-intel")}
    size = cfg["size"]
    t = time.perf_counter()
    pipe = OVStableDiffusionPipeline.from_pretrained(cfg["model"], ov_config=dict(cfg["ov_config"]), compile=False,
                                                     local_files_only=True)
    out["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    pipe.reshape(batch_size=1, height=size, width=size, num_images_per_prompt=1)
    pipe.compile()
    out["compile_s"] = time.perf_counter() - t
    out["ready_s"] = out["load_s"] + out["compile_s"]
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)
    pipe.set_progress_bar_config(disable=True)
    # what OpenVINO picked: the CPU plugin's default, and what each compiled network runs in
    out["device_default_precision"] = openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string()
    out["precision"] = {part: getattr(pipe, part).request.get_property("INFERENCE_PRECISION_HINT").to_string()
                        for part in ("text_encoder", "unet", "vae_decoder")}
    out["threads"] = int(pipe.unet.request.get_property("INFERENCE_NUM_THREADS"))

    marks = {}   # the end of the text encoding, the start of the decode: the generation's three parts

    def timed(part, fn, mark):
        def call(*args, **kwargs):
            if mark == "decode_start":
                marks.setdefault(mark, time.perf_counter())
            result = fn(*args, **kwargs)
            if mark == "text_end":
                marks[mark] = time.perf_counter()
            return result
        setattr(getattr(pipe, part), "forward", call)

    timed("text_encoder", pipe.text_encoder.forward, "text_end")
    timed("vae_decoder", pipe.vae_decoder.forward, "decode_start")
    t = time.perf_counter()
    image = pipe(cfg["prompt"], negative_prompt=cfg["negative"], num_inference_steps=cfg["steps"],
                 guidance_scale=CFG_SCALE, height=size, width=size,
                 generator=torch.Generator().manual_seed(cfg["seed"])).images[0]
    end = time.perf_counter()
    out["generation_s"] = end - t
    out["text_s"] = marks["text_end"] - t
    out["sampling_s"] = marks["decode_start"] - marks["text_end"]
    out["decode_s"] = end - marks["decode_start"]
    image.save(cfg["image"])
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def child_sdlite(cfg: dict) -> dict:
    t_start = time.perf_counter()
    import torch
    from sdlite.pipeline import Engine, Request

    out = {"import_s": time.perf_counter() - t_start, "threads": torch.get_num_threads()}
    t = time.perf_counter()
    kwargs = {} if cfg["precision"] is None else {"precision": cfg["precision"]}
    engine = Engine.load(cfg["model"], **kwargs)
    out["ready_s"] = time.perf_counter() - t
    used = getattr(engine, "precision", None)
    out["precision"] = getattr(used, "label", None) or getattr(used, "name", None) or "fp32"
    request = Request(prompt=cfg["prompt"], negative_prompt=cfg["negative"], width=cfg["size"], height=cfg["size"],
                      steps=cfg["steps"], cfg_scale=CFG_SCALE, sampler="dpmpp_2m_karras", seed=cfg["seed"])
    t = time.perf_counter()
    result = engine.generate(request)
    out["generation_s"] = time.perf_counter() - t
    for part in ("text", "sampling", "decode"):
        out[f"{part}_s"] = result.timings.get(part)
    result.images[0].save(cfg["image"])
    out["peak_rss_mb"] = _peak_rss_mb()
    out["capability"] = torch.backends.cpu.get_cpu_capability()
    return out


def child_main(arg: str) -> None:
    cfg = json.loads(arg)
    run = {"export": child_export, "openvino": child_openvino, "sdlite": child_sdlite}[cfg["engine"]]
    print("RESULT " + json.dumps(run(cfg)), flush=True)


# --- the parent -----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _bench_module(name: str):
    """bench/<name>.py, imported by its path (bench/ is kept off sys.path, see above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source_key(folder: Path) -> list:
    """What identifies the checkpoint's weights: each weights file's name, size and modification time."""
    return [[str(f.relative_to(folder)), f.stat().st_size, int(f.stat().st_mtime)]
            for f in sorted(folder.rglob("*.safetensors"))]


def run_child(cfg: dict, python: Path | str, warm: Path | None = None,
              script: Path | None = None) -> tuple[dict, float]:
    """One fresh process (``script``, this file by default, with ``--child``); returns its RESULT and its wall time
    from start to exit, as this process sees it."""
    env = {**os.environ, **OFFLINE}
    if cfg["engine"] == "sdlite":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if warm is not None:
        _bench_module("startup").warm_page_cache(warm)
    t = time.perf_counter()
    proc = subprocess.run([str(python), str(script or Path(__file__).resolve()), "--child", json.dumps(cfg)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT))
    wall = time.perf_counter() - t
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"benchmark child failed ({cfg.get('label', cfg['engine'])}, exit {proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):]), wall


def export(source: Path, python: Path | str) -> dict:
    """The IR folder, exported from ``source`` where it is missing or stale."""
    print(f"OpenVINO IR: {IR_DIR.relative_to(ROOT)} (exported once from {source.relative_to(ROOT)}) ...", flush=True)
    cfg = {"engine": "export", "source": str(source), "dest": str(IR_DIR), "source_key": _source_key(source)}
    info, wall = run_child(cfg, python)
    print(f"  {'cached' if info['cached'] else f'exported in {wall:.0f} s'}", flush=True)
    return info


def psnr(a_path: Path, b_path: Path) -> float:
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(a_path).convert("RGB"), dtype=np.float64)
    b = np.asarray(Image.open(b_path).convert("RGB"), dtype=np.float64)
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def cpu_facts() -> dict:
    """The machine as sdlite sees it (sdlite.engine.cpu), and the versions of what is measured."""
    import torch

    from sdlite.engine.cpu import system_report
    from sdlite.machine import SHOWN_FLAGS, this_cpu

    cpu = this_cpu()
    return {"model": cpu.model, "cores": cpu.cores, "arch": cpu.arch,
            "flags": None if cpu.flags is None else [f for f in SHOWN_FLAGS if f in cpu.flags],
            "native_bf16": cpu.native_bf16, "torch": torch.__version__, "capability": cpu.torch_capability,
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "system": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
            "system_report": system_report(cpu)}


def medians(runs: list[dict]) -> dict:
    out = {}
    for key in MEASURES:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    return out


def measure(args, folder: Path) -> dict:
    raw = {"settings": {"size": args.size, "steps": args.steps, "rounds": args.rounds, "seed": SEED,
                        "cfg_scale": CFG_SCALE, "sampler": "DPM++ 2M Karras", "prompt": PROMPT,
                        "negative": NEGATIVE, "quick": args.quick},
           "command": command_line(args), "cpu": cpu_facts(), "load_average_start": os.getloadavg(),
           "isa_caps": {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)},
           "export": None, "runs": {label: [] for label in args.configs}, "psnr": {}}
    if any(CONFIGS[label][0] == "openvino" for label in args.configs):
        raw["export"] = export(folder, args.ov_python)
    images = Path(tempfile.mkdtemp(prefix="sdlite-openvino-"))
    psnr_runs: dict[str, list] = {}
    for i in range(args.rounds):
        for label in args.configs:
            engine, settings = CONFIGS[label]
            image = images / f"{label.replace(' ', '-')}-{i}.png"
            cfg = {"engine": engine, "label": label, "size": args.size, "steps": args.steps, "seed": SEED,
                   "prompt": PROMPT, "negative": NEGATIVE, "image": str(image), **settings,
                   "model": str(IR_DIR if engine == "openvino" else folder)}
            res, wall = run_child(cfg, args.ov_python if engine == "openvino" else sys.executable,
                                  warm=IR_DIR if engine == "openvino" else folder)
            res["process_s"] = wall
            res["load_average"] = os.getloadavg()
            raw["runs"][label].append(res)
            print(f"round {i + 1}/{args.rounds} {label}: ready {res['ready_s']:.2f} s, generation "
                  f"{res['generation_s']:.2f} s (text {res['text_s']:.2f} + sampling {res['sampling_s']:.2f} + "
                  f"decode {res['decode_s']:.2f}), process {wall:.2f} s, peak RSS {res['peak_rss_mb']:.0f} MB, "
                  f"precision {res['precision']}", flush=True)
            RESULTS_FILE.write_text(json.dumps(raw, indent=1))
        for tested, reference in QUALITY:
            if tested in args.configs and reference in args.configs:
                value = psnr(images / f"{tested.replace(' ', '-')}-{i}.png",
                             images / f"{reference.replace(' ', '-')}-{i}.png")
                psnr_runs.setdefault(f"{tested} vs {reference}", []).append(value)
                print(f"round {i + 1}: PSNR {tested} against {reference}: {value:.2f} dB", flush=True)
    # the lowest of the rounds (the same seed each round: they differ only where a kernel is not deterministic)
    raw["psnr"] = {k: {"min_db": min(v), "runs_db": v} for k, v in psnr_runs.items()}
    raw["medians"] = {label: medians(runs) for label, runs in raw["runs"].items()}
    raw["load_average_end"] = os.getloadavg()
    for f in images.iterdir():
        f.unlink()
    images.rmdir()
    RESULTS_FILE.write_text(json.dumps(raw, indent=1))
    return raw


def command_line(args) -> str:
    if args.quick:
        return "python bench/openvino.py --quick"
    parts = ["python bench/openvino.py"]
    for flag, value, default in (("--rounds", args.rounds, 3), ("--size", args.size, 512), ("--steps", args.steps, 20)):
        if value != default:
            parts.append(f"{flag} {value}")
    if args.configs != list(CONFIGS):
        parts.append("--configs '" + ",".join(args.configs) + "'")
    if Path(args.json).resolve() != RESULTS:
        parts.append(f"--json {_shown(Path(args.json))}")
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    return " ".join(caps + parts)


def _shown(path: Path) -> str:
    """``path`` as the report names it: relative to the repository where it is inside, else its file name."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


# --- the report -----------------------------------------------------------------------------------------------

def _fmt(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _db(v):
    return "identical" if v == math.inf else f"{v:.1f} dB"


def section(raw: dict) -> list[str]:
    s, cpu, med = raw["settings"], raw["cpu"], raw["medians"]
    runs = raw["runs"]
    labels = [label for label in CONFIGS if runs.get(label)]
    n = min(len(runs[label]) for label in labels)
    flags = "unknown" if cpu["flags"] is None else (", ".join(cpu["flags"]) or "none of the AVX2 / AVX-512 ones")
    ov = next((runs[label][0] for label in labels if CONFIGS[label][0] == "openvino"), None)
    versions = f"torch {cpu['torch']} (CPU capability {cpu['capability']})"
    if ov:
        versions += f", OpenVINO {ov['openvino'].split('-')[0]} through optimum-intel {ov['optimum_intel']}"
    threads = {label: runs[label][0].get("threads") for label in labels}
    threads = ", ".join(f"{label} {n}" for label, n in threads.items() if n)
    mark_begin, mark_end, heading = marks(raw)
    lines = [mark_begin, heading, ""]
    if s.get("quick"):
        lines += [f"**A quick run ({s['size']}^2, {s['steps']} steps, {s['rounds']} round): a check of the script, "
                  "not the benchmark.**", ""]
    lines += [
        "sdlite against OpenVINO (optimum-intel's `OVStableDiffusionPipeline`, as FastSD CPU runs it) on the same "
        "full-size SD 1.5 checkpoint (`bench/checkpoint.py`: fp16 safetensors, random weights at the real shapes), "
        "exported once to OpenVINO IR (not timed). Each configuration in its own fresh process, after its files "
        "were read once into the page cache; the configurations alternate "
        f"({' / '.join(labels)}), {n} round{'s' if n != 1 else ''}; medians. One whole {s['size']}^2 generation per "
        f"process: {s['steps']} steps, DPM++ 2M Karras (OpenVINO: diffusers' DPMSolverMultistepScheduler with Karras "
        f"sigmas), cfg {s['cfg_scale']:g}, prompt and negative prompt as in `bench/openvino.py`, seed {s['seed']}; "
        "timed from the call to the image. \"Ready\": sdlite's `Engine.load`; OpenVINO's load of the IR, "
        f"`reshape` to static {s['size']}x{s['size']} (batch 1) and `compile()`. \"Whole process\": interpreter "
        "start to exit, as the parent process sees it. Peak RSS: the process's `ru_maxrss`.", "",
        f"Machine: {cpu['model']}, {cpu['cores']} cores, {cpu['memory_gib']} GiB RAM, {cpu['system']}, {versions}; "
        f"ISA flags: {flags}; threads: {threads}", "",
        f"Command: `make bench` (`{raw['command']}`)", "",
        "| configuration | precision used | ready, s | generation, s | text + sampling + decode, s | "
        "whole process, s | peak RSS, MB |", "|---|---|---|---|---|---|---|"]
    for label in labels:
        m, first = med[label], runs[label][0]
        if CONFIGS[label][0] == "openvino":
            prec = first["precision"]
            picked = sorted(set(prec.values()))
            used = picked[0] if len(picked) == 1 else ", ".join(f"{k} {v}" for k, v in prec.items())
            used += " (hint: f32)" if CONFIGS[label][1]["ov_config"] else " (OpenVINO's choice)"
            ready = f"{_fmt(m.get('ready_s'))} (compile {_fmt(statistics.median(r['compile_s'] for r in runs[label]))})"
        else:
            used = first["precision"]   # the engine's own label: "bf16 (auto)" where auto chose bf16
            ready = _fmt(m.get("ready_s"))
        parts = " + ".join(_fmt(m.get(k)) for k in ("text_s", "sampling_s", "decode_s"))
        lines.append(f"| {label} | {used} | {ready} | **{_fmt(m.get('generation_s'))}** | {parts} | "
                     f"{_fmt(m.get('process_s'))} | {_fmt(m.get('peak_rss_mb'), 0)} |")
    lines += ["", "| sdlite / OpenVINO | ready | generation | whole process | peak RSS |", "|---|---|---|---|---|"]
    for mine, theirs in PAIRS:
        if mine in med and theirs in med:
            a, b = med[mine], med[theirs]
            lines.append(f"| {mine} / {theirs} | " + " | ".join(
                _ratio(a.get(k), b.get(k)) for k in ("ready_s", "generation_s", "process_s", "peak_rss_mb")) + " |")
    lines += ["", "Ratios of the medians, measured in the same run (lower is better for sdlite). OpenVINO's "
              "sampling is the time from the end of its text encoding to the start of its VAE decode."]
    if raw["psnr"]:
        lines += ["", f"Quality, seed {s['seed']} (lowest over the rounds), 8-bit RGB PSNR:"]
        for key, v in raw["psnr"].items():
            lines.append(f"- {key}: {_db(v['min_db'])}")
        lines += ["", "OpenVINO's pipeline draws its initial noise apart from sdlite's, so the two engines' images "
                  "are compared each with its own exact configuration only."]
    targets = []
    d, o = med.get("sdlite default", {}), med.get("OpenVINO default", {})
    if d.get("generation_s") and o.get("generation_s"):
        r = d["generation_s"] / o["generation_s"]
        targets.append(f"| sdlite default generation / OpenVINO default's | <= 0.80x | {r:.2f}x | "
                       f"{'met' if r <= 0.80 else 'not met'} |")
    f32 = med.get("OpenVINO f32", {})
    if not raw["cpu"]["native_bf16"] and d.get("generation_s") and f32.get("generation_s"):
        r = d["generation_s"] / f32["generation_s"]
        targets.append(f"| without native bf16: sdlite default (fp32) generation / OpenVINO f32's | <= 0.90x | "
                       f"{r:.2f}x | {'met' if r <= 0.90 else 'not met'} |")
    if d.get("peak_rss_mb") and o.get("peak_rss_mb"):
        r = d["peak_rss_mb"] / o["peak_rss_mb"]
        targets.append(f"| sdlite default peak RSS / OpenVINO default's | < 1.0x | {r:.2f}x | "
                       f"{'met' if r < 1.0 else 'not met'} |")
    q = raw["psnr"].get("sdlite default vs sdlite exact")
    if q:
        targets.append(f"| sdlite default against sdlite exact, PSNR (seed {s['seed']} only) | >= 40 dB | "
                       f"{_db(q['min_db'])} | {'met' if q['min_db'] >= 40 else 'not met'} |")
    if targets and not s.get("quick"):
        lines += ["", "| target (issue 25) | wanted | measured | |", "|---|---|---|---|", *targets]
    if raw["export"]:
        e = raw["export"]
        lines += ["", f"The IR (`bench/cache/{IR_DIR.name}/`, exported by `from_pretrained(folder, export=True)` "
                  f"and `save_pretrained`, no weight compression below 1B parameters) took {e['export_s']:.0f} s to "
                  f"export, peak RSS {e['peak_rss_mb']:.0f} MB, the first time."]
    start, end = raw.get("load_average_start"), raw.get("load_average_end")
    if start and end:
        lines += ["", "Load average (1, 5, 15 min): " + ", ".join(f"{v:.2f}" for v in start) + " at the start, "
                  + ", ".join(f"{v:.2f}" for v in end) + " at the end. Raw figures, every process: "
                  f"`{_shown(RESULTS_FILE)}`."]
    lines.append(mark_end)
    return lines


def replace_section(path: Path, new: str, mark_begin: str, mark_end: str, name: str) -> None:
    """Put ``new`` (which begins with ``mark_begin`` and ends with ``mark_end``) in the markdown file ``path`` in
    place of the text between those marks, or at its end where they are absent."""
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n"
    begin, end = text.find(mark_begin), text.find(mark_end)
    if begin >= 0 and end > begin:
        text = text[:begin] + new + text[end + len(mark_end):]
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    path.write_text(text, encoding="utf-8")
    print(f"wrote the {name} section of {path}")


def write_section(path: Path, raw: dict) -> None:
    mark_begin, mark_end, _ = marks(raw)
    replace_section(path, "\n".join(section(raw)), mark_begin, mark_end, "OpenVINO")


def main() -> None:
    global RESULTS_FILE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="processes per configuration, alternating (default 3)")
    ap.add_argument("--size", type=int, default=512, help="image side, px (default 512)")
    ap.add_argument("--steps", type=int, default=20, help="sampling steps (default 20)")
    ap.add_argument("--quick", action="store_true", help="256^2, 2 steps, 1 round: checks the script end to end")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated configurations, in the order each round runs them (default: all four)")
    ap.add_argument("--ov-python", default=str(OV_PYTHON),
                    help="the Python of the OpenVINO virtualenv (default: .venv-openvino, `make setup-openvino`)")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"), help="the markdown file to put the section in")
    ap.add_argument("--json", default=str(RESULTS), help="the raw results (default bench/results-openvino.json)")
    ap.add_argument("--report-only", action="store_true", help="the section again from the JSON, measuring nothing")
    args = ap.parse_args()
    RESULTS_FILE = Path(args.json)
    if args.report_only:
        write_section(Path(args.out), json.loads(RESULTS_FILE.read_text()))
        return
    if args.quick:
        args.size, args.steps, args.rounds = 256, 2, 1
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration {unknown[0]!r}: expected one of {', '.join(CONFIGS)}")
    if any(CONFIGS[c][0] == "openvino" for c in args.configs) and not Path(args.ov_python).is_file():
        raise SystemExit(f"no OpenVINO virtualenv at {args.ov_python}: `make setup-openvino` creates it")
    folder, _ = _bench_module("checkpoint").build()
    raw = measure(args, Path(folder))
    write_section(Path(args.out), raw)


RESULTS_FILE = RESULTS

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
    else:
        main()
