"""The few-step table: 1 and 4 steps, warm and cold, TAESD and VAE, for sdlite, OpenVINO and stable-diffusion.cpp.

    python bench/fewstep.py [--rounds 1] [--size 512] [--steps 1,4] [--modes warm,cold] [--configs ...]
    python bench/fewstep.py --quick          (256^2, 1 and 2 steps, 1 round, 2 warm images: a smoke run)
    python bench/fewstep.py --report-only    (the section again from bench/fewstep.json)

The workload FastSD CPU's users run: one 512^2 image, no classifier-free guidance (sdlite cfg 1; OpenVINO
guidance_scale 1, so its pipeline makes no negative pass; sd.cpp cfg_scale 1), Euler a with trailing timestep spacing
(sdlite ``euler_a`` + ``timestep_spacing="trailing"``; OpenVINO diffusers' EulerAncestralDiscreteScheduler with
``timestep_spacing="trailing"``; sd.cpp ``euler_a`` with its ``sgm_uniform`` schedule, which puts the steps at the
same trailing timesteps to within a fraction of one), seed 1, no negative prompt, and bench/openvino.py's prompt with
", image N" after it for a process's N-th image (sdlite's warm engine remembers the text encodings of recent prompts: a
re-queued prompt would skip its text encoder).

All three engines read the same weights: the full-size random SD 1.5 of bench/checkpoint.py (sdlite its diffusers
folder; OpenVINO that folder exported once to IR by bench/openvino.py; sd.cpp its original-layout single file, in the
file's fp16 -- sd.cpp's default ``wtype``), and one TAESD: a random diffusers ``AutoencoderTiny`` (seed 0) saved once
to bench/cache/taesd-sd/. sdlite decodes with it through ``Engine.set_vae_decoder(load_taesd(folder))`` (in its
precision policy); sd.cpp takes that folder's safetensors file as ``taesd_path`` (sd.cpp reads a TAESD in the diffusers
``AutoencoderTiny`` key layout, ``decoder.layers.N``); OpenVINO gets its decoder converted once with
``ov.convert_model`` (bench/cache/taesd-sd-openvino/, reshaped to the static latent size and compiled like the
pipeline's parts, OpenVINO choosing the precision) and runs it on the latents its pipeline returns
(``output_type="latent"``), then the pipeline's own ``image_processor.postprocess``.

Configurations: engine x decoder (``sdlite TAESD`` ... ``sd.cpp VAE``), each in fresh processes, alternating.
* warm (a server): one process per configuration loads once, makes one untimed image (1 step), then
  ``--warm-images - 1`` timed images of each step count; the medians. Each image's time is split into text encoding,
  the denoising steps and decode; "fixed" is the image's time less its steps, the per-image cost a few-step model
  cannot amortise. sdlite's steps are its step callbacks' intervals (the first from the end of the text encoding);
  OpenVINO's the same intervals from its scheduler's ``step``; sd.cpp's its own "sampling completed" figure (its log
  gives text, sampling and decode; the log is read through its log callback).
* cold (one image per process): the whole process's wall time as the parent sees it (interpreter start to exit),
  and the time to ready (sdlite ``Engine.load`` + the TAESD; OpenVINO load + reshape + compile, the TAESD's compile
  included; sd.cpp its constructor). sdlite's cold process is its ``sdlite generate`` command (``sdlite.cli.run``
  with the same options; times from the line it prints, to 10 ms; it also writes the PNG with its infotext), as a
  user runs one image; OpenVINO's and sd.cpp's are their Python APIs (neither has a command of its own).
sdlite runs in its default precision (auto), OpenVINO in its default (it picks bf16 on a CPU with native bf16), with
static shapes at batch 1 (``reshape(1, size, size, 1)`` as bench/openvino.py does, then the UNet's batch halved back
to 1: optimum-intel doubles it for guidance); sd.cpp with its default thread count set to the cores.

The files of every process are read once before it starts (the page cache). Raw figures go to bench/fewstep.json
after every process; the report is the "Few steps" section of BENCHMARKS.md between markers. The standard 20-step CFG
row is bench/openvino.py's (its section), cited here from bench/results-openvino.json or the run ``--standard`` names.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# bench/openvino.py is a script of the package's name: keep bench/ off the import path (see that file)
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != HERE]

SEED = 1
CACHE = HERE / "cache"
TAESD_DIR = CACHE / "taesd-sd"
TAESD_OV_DIR = CACHE / "taesd-sd-openvino"
TAESD_OV_FILE = "taesd_decoder.xml"
TAESD_FILE = "diffusion_pytorch_model.safetensors"
SDCPP_PYTHON = ROOT / ".venv-sdcpp" / "bin" / "python"
RESULTS = HERE / "fewstep.json"
MARK_BEGIN, MARK_END = "<!-- fewstep:begin (written by bench/fewstep.py) -->", "<!-- fewstep:end -->"
ENGINES = ("sdlite", "OpenVINO", "sd.cpp")
DECODERS = ("TAESD", "VAE")
CONFIGS = [f"{engine} {decoder}" for decoder in DECODERS for engine in ENGINES]   # the order of each round
ENGINE_KEYS = {"sdlite": "sdlite", "OpenVINO": "openvino", "sd.cpp": "sdcpp"}
# the targets (issue 38): sdlite over OpenVINO, and sdlite's fixed cost per image at 512^2
TARGET_RATIO_WARM, TARGET_RATIO_COLD, TARGET_FIXED_S = 0.7, 0.5, 0.25

now = time.perf_counter


@functools.lru_cache(maxsize=None)
def ov_bench():
    """bench/openvino.py, imported by its path: its helpers (children, export, machine facts) are reused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_openvino", HERE / "openvino.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the children: each prints one line "RESULT <json>" --------------------------------------------------------

def _prompt(cfg: dict, i: int) -> str:
    """Image ``i``'s prompt: with ``per_image``, one of its own (a warm engine that remembers the text encodings of
    recent prompts -- sdlite's does -- would otherwise skip the text encoder from the second image on)."""
    return f"{cfg['prompt']}, image {i + 1}" if cfg.get("per_image") else cfg["prompt"]


def _image_record(steps: int, generation: float, text, sampling, decode, step_s) -> dict:
    return {"steps": steps, "generation_s": generation, "text_s": text, "sampling_s": sampling, "decode_s": decode,
            "step_s": step_s, "steps_s": sum(step_s) if step_s is not None else None}


def child_sdlite(cfg: dict) -> dict:
    t_start = now()
    import torch

    from sdlite.pipeline import Engine, Request

    out = {"import_s": now() - t_start, "threads": torch.get_num_threads(), "images": []}
    t = now()
    engine = Engine.load(cfg["model"])
    if cfg["decoder"] == "TAESD":
        from sdlite.weights.taesd import load_taesd, model_variant

        engine.set_vae_decoder(load_taesd(cfg["taesd"], model_variant(engine.spec)))
    out["ready_s"] = now() - t
    out["precision"] = engine.precision.label
    size = cfg["size"]
    for i, steps in enumerate(cfg["plan"]):
        ends = []
        request = Request(prompt=_prompt(cfg, i), width=size, height=size, steps=steps, cfg_scale=1.0,
                          sampler="euler_a", timestep_spacing="trailing", seed=SEED)
        t = now()
        result = engine.generate(request, callback=lambda k, n: ends.append(now()))
        generation = now() - t
        tm = result.timings
        marks = [t + tm["text"]] + ends[-steps:]
        out["images"].append(_image_record(steps, generation, tm["text"], tm["sampling"], tm["decode"],
                                           [b - a for a, b in zip(marks, marks[1:])]))
        if i == len(cfg["plan"]) - 1:
            result.images[0].save(cfg["image"])
    return out


# the timings `sdlite generate` prints on its last stderr line
CLI_TIMINGS = re.compile(r"load ([\d.]+)s, text ([\d.]+)s, sampling ([\d.]+)s, decode ([\d.]+)s")


def child_sdlite_cli(cfg: dict) -> dict:
    """A cold sdlite image as a user makes one: the ``sdlite generate`` command itself (``sdlite.cli.run``, what the
    console script and ``python -m sdlite`` run), in this fresh process; its times read from the line it prints
    (load, text, sampling, decode; the one step is the sampling)."""
    import contextlib
    import io

    from sdlite.cli import run

    steps = cfg["plan"][0]
    argv = ["generate", "--model", cfg["model"], "--steps", str(steps), "--cfg", "1", "--sampler", "euler_a",
            "--timestep-spacing", "trailing", "--seed", str(SEED), "--width", str(cfg["size"]),
            "--height", str(cfg["size"]), "--output", cfg["image"], _prompt(cfg, 0)]
    if cfg["decoder"] == "TAESD":
        argv[1:1] = ["--vae-decoder", cfg["taesd"]]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(argv)
    found = CLI_TIMINGS.findall(err.getvalue())
    if code != 0 or not found:
        raise SystemExit(f"sdlite generate exited {code}: {err.getvalue()[-2000:]}")
    load, text, sampling, decode = (float(v) for v in found[-1])
    from sdlite.engine.precision import choose_precision

    return {"cli": True, "ready_s": load, "precision": choose_precision("auto").label,
            "images": [_image_record(steps, text + sampling + decode, text, sampling, decode, [sampling])]}


def child_export_taesd(cfg: dict) -> dict:
    """The TAESD's decoder converted to OpenVINO IR once (``ov.convert_model`` on an example latent)."""
    import openvino as ov

    dest = Path(cfg["dest"])
    key = {"source_files": cfg["source_key"], "openvino": ov.__version__}
    info_file = dest / "sdlite-export.json"
    if info_file.is_file() and json.loads(info_file.read_text()) == key:
        return {**key, "cached": True}
    ov_bench()._hide_torchvision()
    import torch
    from diffusers import AutoencoderTiny

    vae = AutoencoderTiny.from_pretrained(cfg["source"]).eval()

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vae = vae

        def forward(self, latents):
            return self.vae.decode(latents, return_dict=False)[0]   # [-1, 1], as diffusers' pipelines take it

    with torch.no_grad():
        model = ov.convert_model(Decode().eval(), example_input=torch.zeros(1, 4, 64, 64))
    dest.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(dest / TAESD_OV_FILE))
    info_file.write_text(json.dumps(key))
    return {**key, "cached": False}


def child_openvino(cfg: dict) -> dict:
    t_start = now()
    ovb = ov_bench()
    ovb._hide_torchvision()
    import openvino
    import torch
    from diffusers import EulerAncestralDiscreteScheduler
    from optimum.intel import OVStableDiffusionPipeline

    out = {"import_s": now() - t_start, "openvino": openvino.__version__,
           "optimum_intel": ovb._version("optimum-intel"), "images": []}
    size, taesd = cfg["size"], cfg["decoder"] == "TAESD"
    t = now()
    pipe = OVStableDiffusionPipeline.from_pretrained(cfg["model"], compile=False, local_files_only=True)
    pipe.reshape(batch_size=1, height=size, width=size, num_images_per_prompt=1)
    # optimum-intel doubles the UNet's batch for guidance; without guidance the UNet runs at batch 1
    shapes = {}
    for inp in pipe.unet.model.inputs:
        shape = inp.get_partial_shape()
        if inp.get_any_name() in ("sample", "encoder_hidden_states"):
            shape[0] = 1
        shapes[inp] = shape
    pipe.unet.model.reshape(shapes)
    pipe.compile()
    decoder = None
    if taesd:
        core = openvino.Core()
        model = core.read_model(cfg["taesd_ir"])
        model.reshape([1, 4, size // 8, size // 8])
        decoder = core.compile_model(model, "CPU")
    out["ready_s"] = now() - t
    pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")
    pipe.set_progress_bar_config(disable=True)
    parts = ("text_encoder", "unet") + (() if taesd else ("vae_decoder",))
    prec = {part: getattr(pipe, part).request.get_property("INFERENCE_PRECISION_HINT").to_string() for part in parts}
    if decoder is not None:
        prec["taesd_decoder"] = decoder.get_property("INFERENCE_PRECISION_HINT").to_string()
    out["precision"] = prec
    out["threads"] = int(pipe.unet.request.get_property("INFERENCE_NUM_THREADS"))

    marks: dict = {}

    def wrap(obj, name, before=None, after=None):
        fn = getattr(obj, name)

        def call(*args, **kwargs):
            if before:
                marks.setdefault(before, now())
            result = fn(*args, **kwargs)
            if after:
                marks.setdefault(after, []).append(now())
            return result
        setattr(obj, name, call)

    wrap(pipe.text_encoder, "forward", after="text_end")
    wrap(pipe.scheduler, "step", after="step_end")
    if not taesd:
        wrap(pipe.vae_decoder, "forward", before="decode_start")
    for i, steps in enumerate(cfg["plan"]):
        marks.clear()
        t = now()
        output = pipe(_prompt(cfg, i), num_inference_steps=steps, guidance_scale=1.0, height=size, width=size,
                      generator=torch.Generator().manual_seed(SEED), output_type="latent" if taesd else "pil")
        if taesd:
            marks["decode_start"] = now()
            latents = output.images
            decoded = decoder(latents.numpy() if hasattr(latents, "numpy") else latents)[0]
            image = pipe.image_processor.postprocess(torch.from_numpy(decoded), output_type="pil")[0]
        else:
            image = output.images[0]
        end = now()
        text_end = marks["text_end"][-1]
        ends = marks["step_end"][-steps:]
        out["images"].append(_image_record(steps, end - t, text_end - t, marks["decode_start"] - text_end,
                                           end - marks["decode_start"],
                                           [b - a for a, b in zip([text_end] + ends, ends)]))
        if i == len(cfg["plan"]) - 1:
            image.save(cfg["image"])
    return out


_SDCPP_TIMES = {"text_s": re.compile(r"get_learned_condition completed, taking ([\d.]+)(m?s)"),
                "sampling_s": re.compile(r"sampling completed, taking ([\d.]+)(m?s)"),
                "decode_s": re.compile(r"decode_first_stage completed, taking ([\d.]+)(m?s)")}


def child_sdcpp(cfg: dict) -> dict:
    """stable-diffusion.cpp through stable-diffusion-cpp-python; its log lines (read through its log callback,
    which replaces the package's printing one) give its own text / sampling / decode times."""
    t_start = now()
    import stable_diffusion_cpp as sdc
    from stable_diffusion_cpp import StableDiffusion

    log: list = []

    @sdc.sd_log_callback
    def on_log(level, text, data):
        log.append(text.decode("utf-8", errors="replace"))

    sdc.sd_set_log_callback(on_log, ctypes.c_void_p(0))
    out = {"import_s": now() - t_start, "threads": cfg["threads"], "images": [], "_keep": on_log}
    kwargs = {"model_path": cfg["single"], "n_threads": cfg["threads"], "verbose": True, "vae_decode_only": True}
    if cfg["decoder"] == "TAESD":
        kwargs["taesd_path"] = cfg["taesd_file"]
    t = now()
    try:
        sd = StableDiffusion(**kwargs)
    except Exception as e:
        raise SystemExit(f"sd.cpp failed to load: {e}\n" + "".join(log[-20:]))
    out["ready_s"] = now() - t
    out["precision"] = "the file's (f16)"
    size = cfg["size"]
    for i, steps in enumerate(cfg["plan"]):
        log.clear()
        t = now()
        try:
            images = sd.generate_image(prompt=_prompt(cfg, i), cfg_scale=1.0, sample_method="euler_a",
                                       scheduler="sgm_uniform", sample_steps=steps, seed=SEED, width=size,
                                       height=size)
        except Exception as e:
            raise SystemExit(f"sd.cpp failed to generate: {e}\n" + "".join(log[-20:]))
        generation = now() - t
        times = {}
        for key, pattern in _SDCPP_TIMES.items():
            found = [m for line in log if (m := pattern.search(line))]
            if not found:
                raise SystemExit(f"sd.cpp's log has no {key[:-2]} time (looked for {pattern.pattern!r}):\n"
                                 + "".join(log[-20:]))
            value, unit = found[-1].groups()
            times[key] = float(value) / (1000 if unit == "ms" else 1)
        # sd.cpp's sampling figure covers its steps only: one interval for all of them
        out["images"].append(_image_record(steps, generation, times["text_s"], times["sampling_s"],
                                           times["decode_s"], [times["sampling_s"]]))
        if i == len(cfg["plan"]) - 1:
            images[0].save(cfg["image"])
    del out["_keep"]
    return out


def child_main(arg: str) -> None:
    cfg = json.loads(arg)
    run = {"sdlite": child_sdlite_cli if cfg.get("cold") else child_sdlite, "openvino": child_openvino,
           "sdcpp": child_sdcpp, "export_taesd": child_export_taesd}[cfg["engine"]]
    out = run(cfg)
    out["peak_rss_mb"] = ov_bench()._peak_rss_mb()
    print("RESULT " + json.dumps(out), flush=True)


# --- the parent -------------------------------------------------------------------------------------------------

def build_taesd() -> Path:
    """The random TAESD all three engines decode with (a diffusers AutoencoderTiny, seed 0), saved once."""
    if (TAESD_DIR / "config.json").is_file() and (TAESD_DIR / TAESD_FILE).is_file():
        return TAESD_DIR
    import torch
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    model = AutoencoderTiny()   # SD's TAESD: 4 latent channels, scaling factor 1
    tmp = TAESD_DIR.with_name(TAESD_DIR.name + ".partial")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tmp.rename(TAESD_DIR)
    return TAESD_DIR


def export_taesd(python: str) -> dict:
    ovb = ov_bench()
    cfg = {"engine": "export_taesd", "source": str(TAESD_DIR), "dest": str(TAESD_OV_DIR),
           "source_key": ovb._source_key(TAESD_DIR)}
    info, wall = ovb.run_child(cfg, python, script=Path(__file__).resolve())
    print(f"TAESD IR: {'cached' if info['cached'] else f'converted in {wall:.0f} s'}", flush=True)
    return info


def plan_for(mode: str, steps: list[int], warm_images: int) -> list[int]:
    """The step counts of a process's images: warm, one untimed image then warm_images - 1 of each step count."""
    if mode == "cold":
        return steps[:1]
    return [steps[0]] + [n for n in steps for _ in range(warm_images - 1)]


def run_one(args, label: str, mode: str, plan: list[int], folder: Path, single: Path, images: Path) -> dict:
    ovb = ov_bench()
    engine, decoder = label.split(" ")
    key = ENGINE_KEYS[engine]
    image = images / f"{label.replace(' ', '-')}-{mode}-{plan[-1]}.png"
    cfg = {"engine": key, "decoder": decoder, "size": args.size, "prompt": ovb.PROMPT, "plan": plan,
           "image": str(image), "model": str(ovb.IR_DIR if key == "openvino" else folder),
           "taesd": str(TAESD_DIR), "taesd_ir": str(TAESD_OV_DIR / TAESD_OV_FILE),
           "single": str(single), "taesd_file": str(TAESD_DIR / TAESD_FILE), "threads": args.threads,
           "per_image": True, "cold": mode == "cold"}
    python = {"sdlite": sys.executable, "openvino": args.ov_python, "sdcpp": args.sdcpp_python}[key]
    warm = {"sdlite": folder, "openvino": ovb.IR_DIR, "sdcpp": single}[key]
    if decoder == "TAESD":
        ovb._bench_module("startup").warm_page_cache(TAESD_OV_DIR if key == "openvino" else TAESD_DIR)
    try:
        res, wall = ovb.run_child(cfg, python, warm=warm, script=Path(__file__).resolve())
    except SystemExit as e:   # recorded, and the run goes on
        return {"error": str(e)[-2000:]}
    res["process_s"] = wall
    res["load_average"] = os.getloadavg()
    return res


def summarise(res: dict, mode: str, steps: int) -> dict | None:
    """One process's figures for ``steps``: warm, the medians of its timed images of that count; cold, its image."""
    if "error" in res:
        return None
    imgs = res["images"][1:] if mode == "warm" else res["images"]
    imgs = [im for im in imgs if im["steps"] == steps]
    if not imgs:
        return None
    out = {k: statistics.median(im[k] for im in imgs) for k in ("generation_s", "text_s", "sampling_s",
                                                                   "decode_s", "steps_s")}
    out["fixed_s"] = statistics.median(im["generation_s"] - im["steps_s"] for im in imgs)
    out["step_s"] = out["steps_s"] / steps
    if mode == "cold":
        out.update(ready_s=res["ready_s"], process_s=res["process_s"], peak_rss_mb=res["peak_rss_mb"])
    return out


def measure(args, folder: Path, single: Path) -> dict:
    ovb = ov_bench()
    raw = {"settings": {"size": args.size, "steps": args.steps, "rounds": args.rounds, "seed": SEED,
                        "warm_images": args.warm_images, "modes": args.modes, "quick": args.quick,
                        "threads": args.threads, "prompt": ovb.PROMPT, "prompt_per_image": True},
           "command": command_line(args), "cpu": ovb.cpu_facts(), "load_average_start": os.getloadavg(),
           "note": args.note, "date": time.strftime("%Y-%m-%d"), "versions": {}, "runs": {}}
    if args.standard is not None:
        raw["standard_json"] = _standard_arg(args.standard)
    engines = {label.split(" ")[0] for label in args.configs}
    if "OpenVINO" in engines:
        raw["export"] = ovb.export(folder, args.ov_python)
        if any(c == "OpenVINO TAESD" for c in args.configs):
            raw["export_taesd"] = export_taesd(args.ov_python)
    if "sd.cpp" in engines:
        import subprocess

        v = subprocess.run([str(args.sdcpp_python), "-c", "from importlib.metadata import version; "
                            "print(version('stable-diffusion-cpp-python'))"], capture_output=True, text=True)
        raw["versions"]["stable-diffusion-cpp-python"] = v.stdout.strip() or "?"
    images = Path(tempfile.mkdtemp(prefix="sdlite-fewstep-"))
    jobs = []   # (mode, label, plan): warm processes first, then the cold ones, each set alternating the engines
    if "warm" in args.modes:
        jobs += [("warm", label, plan_for("warm", args.steps, args.warm_images)) for label in args.configs]
    if "cold" in args.modes:
        jobs += [("cold", label, [n]) for n in args.steps for label in args.configs]
    for r in range(args.rounds):
        for mode, label, plan in jobs:
            key = f"{label} {mode}" + (f" {plan[0]}" if mode == "cold" else "")
            print(f"round {r + 1}/{args.rounds} {key} ({len(plan)} image{'s' if len(plan) > 1 else ''}) ...",
                  flush=True)
            res = run_one(args, label, mode, plan, folder, single, images)
            raw["runs"].setdefault(key, []).append(res)
            if "error" in res:
                print(f"  FAILED: {res['error'][-600:]}", flush=True)
            else:
                for n in args.steps:
                    s = summarise(res, mode, n)
                    if s:
                        extra = (f", ready {s['ready_s']:.2f} s, process {s['process_s']:.2f} s"
                                 if mode == "cold" else "")
                        print(f"  {n} step{'s' if n > 1 else ''}: {s['generation_s']:.2f} s (text "
                              f"{s['text_s']:.2f}, steps {s['steps_s']:.2f}, decode {s['decode_s']:.2f}, fixed "
                              f"{s['fixed_s']:.2f}){extra}; precision {res['precision']}", flush=True)
            RESULTS_FILE.write_text(json.dumps(raw, indent=1))
    raw["load_average_end"] = os.getloadavg()
    for f in images.iterdir():
        f.unlink()
    images.rmdir()
    RESULTS_FILE.write_text(json.dumps(raw, indent=1))
    return raw


def command_line(args) -> str:
    if args.quick:
        return "python bench/fewstep.py --quick"
    parts = ["python bench/fewstep.py"]
    for flag, value, default in (("--rounds", args.rounds, 3), ("--size", args.size, 512),
                                 ("--warm-images", args.warm_images, 4)):
        if value != default:
            parts.append(f"{flag} {value}")
    if args.steps != [1, 4]:
        parts.append("--steps " + ",".join(map(str, args.steps)))
    if args.modes != ["warm", "cold"]:
        parts.append("--modes " + ",".join(args.modes))
    if args.configs != CONFIGS:
        parts.append("--configs '" + ",".join(args.configs) + "'")
    return " ".join(parts)


# --- the report -------------------------------------------------------------------------------------------------

def table(raw: dict) -> dict:
    """{(mode, steps, decoder, engine): medians over the rounds of each process's figures}."""
    out = {}
    for key, runs in raw["runs"].items():
        parts = key.split(" ")
        engine, decoder, mode = parts[0], parts[1], parts[2]
        for n in raw["settings"]["steps"]:
            if mode == "cold" and int(parts[3]) != n:
                continue
            per = [s for res in runs if (s := summarise(res, mode, n))]
            if per:
                out[(mode, n, decoder, engine)] = {k: statistics.median(p[k] for p in per) for k in per[0]}
                out[(mode, n, decoder, engine)]["rounds"] = len(per)
            elif any("error" in res for res in runs):
                out[(mode, n, decoder, engine)] = {"error": next(res["error"] for res in runs if "error" in res)}
    return out


def _s(v):
    return "-" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def _cell(t: dict, key, measure):
    m = t.get(key)
    if m is None:
        return "-"
    return "failed" if "error" in m else _s(m.get(measure))


def _ratio(t: dict, a, b, measure):
    ma, mb = t.get(a) or {}, t.get(b) or {}
    va, vb = ma.get(measure), mb.get(measure)
    return f"{va / vb:.2f}x" if va is not None and vb else "-"


def section(raw: dict) -> list[str]:
    s, cpu = raw["settings"], raw["cpu"]
    t = table(raw)
    flags = "unknown" if cpu["flags"] is None else (", ".join(cpu["flags"]) or "none of the AVX2 / AVX-512 ones")
    ov_run = next((res for key, runs in raw["runs"].items() if key.startswith("OpenVINO") for res in runs
                   if "error" not in res), None)
    versions = f"torch {cpu['torch']} (CPU capability {cpu['capability']})"
    if ov_run:
        versions += f", OpenVINO {ov_run['openvino'].split('-')[0]} through optimum-intel {ov_run['optimum_intel']}"
    if raw["versions"].get("stable-diffusion-cpp-python"):
        versions += f", stable-diffusion-cpp-python {raw['versions']['stable-diffusion-cpp-python']} (built here " \
                    "with GGML_NATIVE)"
    precisions = {}
    for key, runs in raw["runs"].items():
        for res in runs:
            if "error" not in res:
                p = res["precision"]
                if isinstance(p, dict):
                    p = ", ".join(f"{k} {v}" for k, v in p.items())
                precisions.setdefault(" ".join(key.split(" ")[:2]), p)
    prompts = ("each image's prompt its own (bench/openvino.py's + \", image N\"), so no engine reuses a text "
               "encoding" if s.get("prompt_per_image") else "the same prompt for every image (sdlite's warm engine "
               "then reuses its text encoding: its warm text time is 0)")
    lines = [MARK_BEGIN, "## Few steps: 1 and 4 steps, warm and cold, TAESD and VAE", ""]
    if s.get("quick"):
        lines += [f"**A quick run ({s['size']}^2, steps {', '.join(map(str, s['steps']))}, {s['rounds']} round, "
                  f"{s['warm_images']} warm images): a check of the script, not the benchmark.**", ""]
    steps_word = " and ".join(map(str, s["steps"])) + (" steps" if s["steps"] != [1] else " step")
    lines += [
        f"FastSD CPU's workload: one {s['size']}^2 image in {steps_word}, no CFG (guidance off), Euler a with "
        f"trailing timestep spacing, seed {s['seed']}, {prompts}, on the full-size random SD 1.5 of "
        "`bench/checkpoint.py` "
        "(OpenVINO: its IR export; sd.cpp: its single file, fp16) and one random TAESD (a diffusers "
        "`AutoencoderTiny`, `bench/cache/taesd-sd/`: sdlite's `set_vae_decoder`, sd.cpp's `taesd_path`, and for "
        "OpenVINO converted with `ov.convert_model` and run on its pipeline's latents). sdlite in its default "
        "precision (auto), OpenVINO in its default with static shapes at batch 1, sd.cpp in the file's fp16. "
        f"**Warm**: one process per engine and decoder loads once, makes one untimed image, then "
        f"{s['warm_images'] - 1} timed image{'s' if s['warm_images'] > 2 else ''} of each step count (medians). **Cold**: one fresh process per image; "
        "the whole process's wall time, interpreter start to exit (sdlite's: its `sdlite generate` command; "
        "OpenVINO's and sd.cpp's: their Python APIs). Processes alternate between the engines; "
        f"{s['rounds']} round{'s' if s['rounds'] != 1 else ''}, medians over them. Details: `bench/fewstep.py`.", "",
        f"Machine: {cpu['model']}, {cpu['cores']} cores, {cpu['memory_gib']} GiB RAM, {cpu['system']}, {versions}; "
        f"ISA flags: {flags}.", ""]
    if raw.get("note"):
        lines += [f"**{raw['note']}**", ""]
    made = " (what `make bench` runs)" if raw["command"] == "python bench/fewstep.py" else ""
    lines += [f"Command: `{raw['command']}`{made}, run {raw.get('date', '?')}.", "",
              "| steps | decoder | | sdlite, s | OpenVINO, s | sd.cpp, s | sdlite / OpenVINO | sdlite / sd.cpp |",
              "|---|---|---|---|---|---|---|---|"]
    for mode, measure, what in (("warm", "generation_s", "warm image"), ("cold", "process_s", "cold, whole process")):
        for n in s["steps"]:
            for dec in DECODERS:
                keys = {e: (mode, n, dec, e) for e in ENGINES}
                if not any(k in t for k in keys.values()):
                    continue
                lines.append(f"| {n} | {dec} | {what} | " + " | ".join(_cell(t, keys[e], measure) for e in ENGINES)
                             + f" | {_ratio(t, keys['sdlite'], keys['OpenVINO'], measure)} | "
                             f"{_ratio(t, keys['sdlite'], keys['sd.cpp'], measure)} |")
    lines += ["", "Ratios of the medians, measured in the same run (lower is better for sdlite)."]
    warm = [(n, dec, e) for n in s["steps"] for dec in DECODERS for e in ENGINES
            if (m := t.get(("warm", n, dec, e))) and "error" not in m]
    if warm:
        lines += ["", "Where the time goes (warm images; cold processes add their time to ready): text encoding, "
                  "the denoising steps, the decode, and the fixed cost per image (the image's time less its steps), "
                  "seconds:", "",
                  "| steps | decoder | engine | image | text | steps (per step) | decode | fixed |",
                  "|---|---|---|---|---|---|---|---|"]
        for n, dec, e in warm:
            m = t[("warm", n, dec, e)]
            lines.append(f"| {n} | {dec} | {e} | {_s(m['generation_s'])} | {_s(m['text_s'])} | "
                         f"{_s(m['steps_s'])} ({_s(m['step_s'])}) | {_s(m['decode_s'])} | "
                         f"**{_s(m['fixed_s'])}** |")
    cold = [(n, dec, e) for n in s["steps"] for dec in DECODERS for e in ENGINES
            if (m := t.get(("cold", n, dec, e))) and "error" not in m]
    if cold:
        lines += ["", "Cold processes: time to ready, the image, the whole process, peak RSS:", "",
                  "| steps | decoder | engine | ready, s | image, s | whole process, s | peak RSS, MB |",
                  "|---|---|---|---|---|---|---|"]
        for n, dec, e in cold:
            m = t[("cold", n, dec, e)]
            lines.append(f"| {n} | {dec} | {e} | {_s(m['ready_s'])} | {_s(m['generation_s'])} | "
                         f"{_s(m['process_s'])} | {m['peak_rss_mb']:.0f} |")
    if precisions:
        lines += ["", "Precisions used: " + "; ".join(f"{k}: {v}" for k, v in precisions.items()) + "."]
    failed = sorted({f"{k[3]} {k[2]} {k[0]} {k[1]}" for k, m in t.items() if "error" in m})
    if failed:
        lines += ["", "Failed: " + ", ".join(failed) + " (the error is in `bench/fewstep.json`)."]
    targets = []
    for label, key, measure, wanted in (
            ("warm 1-step + TAESD, sdlite / OpenVINO", ("warm", 1, "TAESD"), "generation_s", TARGET_RATIO_WARM),
            ("warm 4-step + TAESD, sdlite / OpenVINO", ("warm", 4, "TAESD"), "generation_s", TARGET_RATIO_WARM),
            ("cold 1-step + TAESD, whole process, sdlite / OpenVINO", ("cold", 1, "TAESD"), "process_s",
             TARGET_RATIO_COLD)):
        a, b = t.get((*key, "sdlite")) or {}, t.get((*key, "OpenVINO")) or {}
        if a.get(measure) and b.get(measure):
            r = a[measure] / b[measure]
            targets.append(f"| {label} | <= {wanted:.2f}x | {r:.2f}x | {'met' if r <= wanted else 'not met'} |")
    fixed = (t.get(("warm", 1, "TAESD", "sdlite")) or {}).get("fixed_s")
    if fixed is not None:
        targets.append(f"| sdlite's fixed cost per image (warm, TAESD, {s['size']}^2) | <= {TARGET_FIXED_S:.2f} s "
                       f"| {fixed:.2f} s | {'met' if fixed <= TARGET_FIXED_S else 'not met'} |")
    std = _standard_row(ROOT / raw.get("standard_json", str(ov_bench().RESULTS.relative_to(ROOT))))
    if std:
        targets.append(std)
    if targets and not s.get("quick"):
        lines += ["", "| target (issue 38) | wanted | measured | |", "|---|---|---|---|", *targets]
    start, end = raw.get("load_average_start"), raw.get("load_average_end")
    if start and end:
        lines += ["", "Load average (1, 5, 15 min): " + ", ".join(f"{v:.2f}" for v in start) + " at the start, "
                  + ", ".join(f"{v:.2f}" for v in end) + " at the end. Raw figures, every process: "
                  f"`{_shown(RESULTS_FILE)}`."]
    lines.append(MARK_END)
    return lines


def _shown(path: Path) -> str:
    """``path`` as the report names it: relative to the repository where it lies inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _standard_row(path: Path) -> str | None:
    """The 20-step CFG row of the issue's targets, from a bench/openvino.py run's raw figures (``--standard``: by
    default its last run, bench/results-openvino.json; its own section has the rest)."""
    try:
        med = json.loads(Path(path).read_text())["medians"]
        r = med["sdlite default"]["generation_s"] / med["OpenVINO default"]["generation_s"]
    except (OSError, ValueError, KeyError, ZeroDivisionError):
        return None
    return (f"| the standard 20-step CFG generation, sdlite default / OpenVINO default (`bench/openvino.py`, "
            f"`{_shown(path)}`) | <= 0.70x | {r:.2f}x | {'met' if r <= 0.70 else 'not met'} |")


def _standard_arg(path: str | None) -> str | None:
    """``--standard`` as the JSON keeps it: relative to the repository (None: not given)."""
    if path is None:
        return None
    found = Path(path).resolve()
    if not found.is_file():
        raise SystemExit(f"--standard {path}: no such file (a bench/openvino.py --json output)")
    return _shown(found)


def write_section(path: Path, raw: dict) -> None:
    ov_bench().replace_section(path, "\n".join(section(raw)), MARK_BEGIN, MARK_END, "Few steps")


def main() -> None:
    global RESULTS_FILE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="processes per configuration and mode (default 3)")
    ap.add_argument("--size", type=int, default=512, help="image side, px (default 512)")
    ap.add_argument("--steps", default="1,4", help="the step counts (default 1,4)")
    ap.add_argument("--modes", default="warm,cold", help="warm, cold or both (default both)")
    ap.add_argument("--warm-images", type=int, default=4,
                    help="a warm process's images per step count, the first untimed (default 4: images 2..4 timed)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated engine + decoder configurations (default all: {', '.join(CONFIGS)})")
    ap.add_argument("--quick", action="store_true", help="256^2, 1 and 2 steps, 1 round, 2 warm images: a smoke run")
    ap.add_argument("--threads", type=int, default=None, help="sd.cpp's threads (default: the CPU's cores)")
    ap.add_argument("--ov-python", default=None, help="the OpenVINO virtualenv's Python (`make setup-openvino`)")
    ap.add_argument("--sdcpp-python", default=str(SDCPP_PYTHON),
                    help="the stable-diffusion.cpp virtualenv's Python (`make setup-sdcpp`)")
    ap.add_argument("--note", default=None, help="a sentence the report shows (what else ran on the machine)")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"), help="the markdown file to put the section in")
    ap.add_argument("--json", default=str(RESULTS), help="the raw results (default bench/fewstep.json)")
    ap.add_argument("--standard", default=None,
                    help="the bench/openvino.py raw figures whose 20-step CFG ratio the targets cite (default "
                         "bench/results-openvino.json, its last run; kept in the JSON)")
    ap.add_argument("--report-only", action="store_true", help="the section again from the JSON, measuring nothing")
    args = ap.parse_args()
    RESULTS_FILE = Path(args.json)
    if args.report_only:
        raw = json.loads(RESULTS_FILE.read_text())
        if args.note is not None or args.standard is not None:
            raw.update({k: v for k, v in (("note", args.note), ("standard_json", _standard_arg(args.standard)))
                        if v is not None})
            RESULTS_FILE.write_text(json.dumps(raw, indent=1))
        write_section(Path(args.out), raw)
        return
    sys.path.insert(0, str(ROOT))
    ovb = ov_bench()
    args.ov_python = args.ov_python or str(ovb.OV_PYTHON)
    args.steps = [int(n) for n in args.steps.split(",") if n.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.quick:
        args.size, args.steps, args.rounds, args.warm_images = 256, [1, 2], 1, 2
    for c in args.configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown configuration {c!r}: expected one of {', '.join(CONFIGS)}")
    for m in args.modes:
        if m not in ("warm", "cold"):
            raise SystemExit(f"unknown mode {m!r}: expected warm or cold")
    if not args.steps or min(args.steps) < 1:
        raise SystemExit(f"--steps must be positive step counts, got {args.steps}")
    if args.warm_images < 2:
        raise SystemExit(f"--warm-images must be at least 2 (the first is not timed), got {args.warm_images}")
    engines = {c.split(" ")[0] for c in args.configs}
    if "OpenVINO" in engines and not Path(args.ov_python).is_file():
        raise SystemExit(f"no OpenVINO virtualenv at {args.ov_python}: `make setup-openvino` creates it")
    if "sd.cpp" in engines and not Path(args.sdcpp_python).is_file():
        raise SystemExit(f"no stable-diffusion.cpp virtualenv at {args.sdcpp_python}: `make setup-sdcpp` creates it")
    if args.threads is None:
        args.threads = ovb.cpu_facts()["cores"]
    folder, single = ovb._bench_module("checkpoint").build()
    build_taesd()
    raw = measure(args, Path(folder), Path(single))
    write_section(Path(args.out), raw)


RESULTS_FILE = RESULTS

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
    else:
        main()
