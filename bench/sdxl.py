"""SDXL: sdlite against diffusers on a cached full-size SDXL base checkpoint (fp16 safetensors, random weights).

    python bench/sdxl.py [--only LABEL,...] [--warm-1024] [--build-only] [--report-only]   (the last step of `make bench`)

The checkpoint is built once into bench/cache/sdxl-fp16/ (a diffusers StableDiffusionXLPipeline folder at the real
shapes of stabilityai/stable-diffusion-xl-base-1.0, from sdlite.config.SDXL_BASE) and reused. Speed and memory do
not depend on the weights' values, only on their shapes and storage dtype, so random weights measure the same thing.

Every configuration runs in its own fresh process (`torch.set_num_threads(2)`, fp32 compute), after the
checkpoint's files have been read once, so that every engine loads from the page cache. In each process, in order:

1. import + load to ready;
2. one whole 1024^2 generation of 1 step (euler, cfg 5, seed 42: text encoding, one CFG step, the VAE decode),
   timed by parts: its CFG step and its decode are the table's 1024^2 figures; the process's peak RSS is read right
   after it, so it is the peak of loading plus that generation;
3. where the configuration has it: one UNet step with CFG (batch 2, random context, pooled text embedding and size
   ids) at 512^2, a warm-up then the median of 2; with ``--warm-1024``, also a second (warm) 1024^2 UNet step and
   1024^2 VAE decode (diffusers untiled, as its pipeline decodes; sdlite its default, tiled above 768 px).

Wall times and process CPU times are both kept: on a shared machine the first run long, the second less so.
The parent watches each child's resident memory and stops one that would take the machine's last GB (sdlite with
fp32 weights already above FP32_RSS_LIMIT_MB), and one that runs past CHILD_TIMEOUT_S; the table then says so.
Raw figures go to bench/sdxl.json after every child (``--only`` re-measures some configurations and keeps the
others), the report to bench/sdxl.md, and the table to an "SDXL" section of BENCHMARKS.md between markers: bench/run.py
rewrites that file whole (dropping the section), and this script, run after it, puts the section back
(``--report-only`` does only that, from bench/sdxl.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))   # bench/run.py and bench/startup.py, when run from elsewhere
sys.path.insert(1, str(ROOT))   # sdlite, and tests/reference.py's tokenizer files

from startup import warm_page_cache  # noqa: E402

CACHE = HERE / "cache" / "sdxl-fp16"
PROMPT, NEGATIVE = "a red circle on a blue background, highly detailed", "blurry, low quality"
THREADS = 2
GEN_SIZE, GEN_STEPS, GEN_CFG = 1024, 1, 5.0
FP32_RSS_LIMIT_MB = 20 * 1024     # sdlite with fp32 weights (about 14 GB of them) is stopped above this
CHILD_TIMEOUT_S = 20 * 60
MODE0_TARGET_MB = 3072
MARK_BEGIN, MARK_END = "<!-- sdxl:begin (written by bench/sdxl.py) -->", "<!-- sdxl:end -->"


# --- the checkpoint ---------------------------------------------------------------------------------------------

def _meta_modules():
    """The four networks as diffusers and transformers build them, on the meta device (no memory): their key names,
    shapes and the module each tensor belongs to."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from sdlite.config import SDXL_BASE as spec

    def text_config(cfg):
        d = cfg.to_diffusers()
        for k in ("architectures", "model_type", "torch_dtype"):
            d.pop(k)
        return CLIPTextConfig(**d)

    unet_cfg, vae_cfg = spec.unet.to_diffusers(), spec.vae.to_diffusers()
    with torch.device("meta"):
        unet = UNet2DConditionModel(**{k: v for k, v in unet_cfg.items() if k != "_class_name"})
        vae = AutoencoderKL(**{k: v for k, v in vae_cfg.items() if k != "_class_name"})
        text = CLIPTextModel(text_config(spec.text))
        text2 = CLIPTextModelWithProjection(text_config(spec.text2))
    text2_cfg = {**spec.text2.to_diffusers(), "architectures": ["CLIPTextModelWithProjection"]}
    return {  # folder: (module, config.json, weight file)
        "unet": (unet, unet_cfg, "diffusion_pytorch_model.safetensors"),
        "vae": (vae, vae_cfg, "diffusion_pytorch_model.safetensors"),
        "text_encoder": (text, spec.text.to_diffusers(), "model.safetensors"),
        "text_encoder_2": (text2, text2_cfg, "model.safetensors"),
    }


def _init_plan(module: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], str, float]]:
    """key -> (shape, how to fill it, scale), as PyTorch initialises each layer by default: Linear and Conv weights
    and biases uniform in +-1/sqrt(fan in), embeddings standard normal, norms' scales 1 and shifts 0."""
    norms = (torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.BatchNorm2d)
    state = set(module.state_dict())   # persistent tensors only, as a saved model holds them
    plan = {}
    for mod_name, mod in module.named_modules():
        for leaf, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            key = f"{mod_name}.{leaf}" if mod_name else leaf
            if key not in state:
                continue
            shape = tuple(t.shape)
            if not t.is_floating_point():
                raise RuntimeError(f"{key}: a {t.dtype} tensor in the state dict; the builder writes fp16 only")
            if isinstance(mod, norms):
                plan[key] = (shape, "const", 1.0 if leaf == "weight" else 0.0)
            elif isinstance(mod, torch.nn.Embedding):
                plan[key] = (shape, "normal", 1.0)
            elif isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d)):
                fan_in = math.prod(mod.weight.shape[1:])
                plan[key] = (shape, "uniform", fan_in ** -0.5)
            elif t.dim() >= 2:
                plan[key] = (shape, "uniform", math.prod(shape[1:]) ** -0.5)
            else:
                plan[key] = (shape, "const", 0.0)
    missing = state - set(plan)
    if missing:
        raise RuntimeError(f"tensors the builder has no rule for: {sorted(missing)[:5]}")
    return plan


def _fill(key: str, shape: tuple[int, ...], kind: str, scale: float) -> torch.Tensor:
    """The tensor's values, fp16, from a generator seeded by its name (the same checkpoint on every build)."""
    if kind == "const":
        return torch.full(shape, scale, dtype=torch.float16)
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    t = torch.empty(shape, dtype=torch.float32)
    if kind == "normal":
        t.normal_(0.0, scale, generator=g)
    else:
        t.uniform_(-scale, scale, generator=g)
    return t.to(torch.float16)


def _write_safetensors_streaming(path: Path, plan: dict, prefix: str) -> int:
    """A .safetensors file of fp16 tensors, each made and written in turn, so no more than one is in memory. The
    header is known from the shapes alone: 8 bytes of its length, the JSON (padded to 8 bytes), then the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key in sorted(plan):
        n = math.prod(plan[key][0]) * 2
        header[key] = {"dtype": "F16", "shape": list(plan[key][0]), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key in sorted(plan):
            shape, kind, scale = plan[key]
            f.write(_fill(f"{prefix}/{key}", shape, kind, scale).numpy().tobytes())
    return offset


def build(folder: Path = CACHE, log=print) -> Path:
    """The full-size SDXL base checkpoint as a diffusers folder, fp16, built once (about 7 GB) and reused."""
    if (folder / "model_index.json").is_file():
        return folder
    from sdlite.config import PUBLISHED_SCHEDULERS
    from sdlite.export import DIFFUSERS_VERSION
    from tests.reference import write_hf_tokenizer_files

    folder.parent.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(folder.parent).free / 2**30
    if free_gb < 8:
        raise SystemExit(f"building the SDXL checkpoint needs about 7 GB of disk; {free_gb:.1f} GB is free")
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        total = 0
        for sub, (module, config, filename) in _meta_modules().items():
            (tmp / sub).mkdir()
            config = {**config, "_diffusers_version": DIFFUSERS_VERSION} if sub in ("unet", "vae") else config
            (tmp / sub / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            plan = _init_plan(module)
            t = time.perf_counter()
            total += _write_safetensors_streaming(tmp / sub / filename, plan, sub)
            log(f"  built {sub}: {len(plan)} tensors, {sum(math.prod(s) for s, _, _ in plan.values()) / 1e6:.1f}M "
                f"parameters ({time.perf_counter() - t:.0f}s)")
        write_hf_tokenizer_files(tmp / "tokenizer")
        write_hf_tokenizer_files(tmp / "tokenizer_2", pad_token="!")   # bigG's tokenizer pads with "!" (id 0)
        (tmp / "scheduler").mkdir()
        scheduler = {**PUBLISHED_SCHEDULERS["sdxl"][1], "_diffusers_version": DIFFUSERS_VERSION}
        (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2) + "\n")
        index = {
            "_class_name": "StableDiffusionXLPipeline", "_diffusers_version": DIFFUSERS_VERSION,
            "feature_extractor": [None, None], "image_encoder": [None, None], "force_zeros_for_empty_prompt": True,
            "scheduler": ["diffusers", scheduler["_class_name"]],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
        }
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"built {folder.name}: {total / 2**30:.2f} GiB of fp16 weights in {time.perf_counter() - t0:.0f}s")
    return folder


# --- the measurements -------------------------------------------------------------------------------------------

CHILD = r"""
import json, os, resource, statistics, sys, time
t_start = time.perf_counter()
cfg = json.loads(sys.argv[1])
import torch
torch.set_num_threads(cfg["threads"])
out = {"notes": []}
peak_mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def report():
    out["peak_rss_mb"] = peak_mb()
    out["capability"] = torch.backends.cpu.get_cpu_capability()
    out["threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(out), flush=True)

def med(fn, n):
    # (median wall seconds, median process CPU seconds) of n runs
    times, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time(); fn()
        times.append(time.perf_counter() - t); cpu.append(time.process_time() - c)
    return statistics.median(times), statistics.median(cpu)

size, steps, scale = cfg["gen_size"], cfg["gen_steps"], cfg["gen_cfg"]
if cfg["engine"] == "diffusers":
    import accelerate, diffusers, transformers
    from diffusers import StableDiffusionXLPipeline
    out["versions"] = {m.__name__: m.__version__ for m in (diffusers, transformers, accelerate)}
    pipe = StableDiffusionXLPipeline.from_pretrained(cfg["model"], dtype=torch.float32, local_files_only=True)
    if cfg.get("offload"):
        try:
            pipe.enable_sequential_cpu_offload()
            out["offload"] = "enable_sequential_cpu_offload()"
        except Exception as e:
            out["notes"].append(f"enable_sequential_cpu_offload(): {type(e).__name__}: {e}")
            try:
                pipe.enable_sequential_cpu_offload(device="cpu")
                out["offload"] = 'enable_sequential_cpu_offload(device="cpu")'
            except Exception as e2:
                out["error"] = f'enable_sequential_cpu_offload(device="cpu"): {type(e2).__name__}: {e2}'
                report(); sys.exit(0)
    pipe.set_progress_bar_config(disable=True)
    out["ready_s"] = time.perf_counter() - t_start
    out["rss_ready_mb"] = peak_mb()
    marks = {}
    encode = pipe.encode_prompt
    def timed_encode(*a, **k):
        t = time.perf_counter(); r = encode(*a, **k); marks["text"] = time.perf_counter() - t
        marks["text_end"] = time.perf_counter(); return r
    pipe.encode_prompt = timed_encode
    def step_end(p, i, t, kw):
        marks["steps_end"] = time.perf_counter(); return kw
    def generate():
        t0 = time.perf_counter()
        pipe(cfg["prompt"], negative_prompt=cfg["negative"], num_inference_steps=steps, guidance_scale=scale,
             height=size, width=size, generator=torch.Generator().manual_seed(42), callback_on_step_end=step_end)
        t1 = time.perf_counter()
        return {"text": marks["text"], "sampling": marks["steps_end"] - marks["text_end"],
                "decode": t1 - marks["steps_end"], "total": t1 - t0}
    def unet_call(x, t, c, te, ids):
        return pipe.unet(x, t, encoder_hidden_states=c, added_cond_kwargs={"text_embeds": te, "time_ids": ids}).sample
    decode = lambda z: pipe.vae.decode(z).sample
else:
    from sdlite.pipeline import Engine, Request
    kw = {"memory_mode": cfg["memory_mode"]}
    if cfg.get("quantize"):
        kw["quantize"] = cfg["quantize"]
    if cfg.get("weight_dtype"):
        kw["weight_dtype"] = getattr(torch, cfg["weight_dtype"])
    engine = Engine.load(cfg["model"], **kw)
    out["ready_s"] = time.perf_counter() - t_start
    out["rss_ready_mb"] = peak_mb()
    m = engine.models
    out["resolved"] = {"memory_mode": m.mode, "weight_dtype": str(m.weight_dtype), "compute_dtype": str(m.dtype),
                       "quantize": m.quantize, "prepack": m.prepack}
    def generate():
        t0 = time.perf_counter()
        res = engine.generate(Request(prompt=cfg["prompt"], negative_prompt=cfg["negative"], width=size, height=size,
                                      steps=steps, cfg_scale=scale, sampler="euler", seed=42))
        t1 = time.perf_counter()
        if not torch.isfinite(res.latents).all():
            out["notes"].append("the generation's latents are not all finite")
        return {**{k: res.timings[k] for k in ("text", "sampling", "decode")}, "total": t1 - t0}
    def unet_call(x, t, c, te, ids):
        with engine.models.use("unet") as unet:
            return unet(x, t, c, text_embeds=te, time_ids=ids)
    decode = engine.decode_latents

with torch.no_grad():
    c0 = time.process_time()
    try:
        out["gen"] = generate()
    except Exception as e:   # recorded, with where it happened, for the report
        import traceback
        frame = traceback.extract_tb(e.__traceback__)[-1]
        out["error"] = (f"the generation failed: {type(e).__name__}: {str(e).strip().splitlines()[0]} "
                        f"(raised in {frame.name}, {frame.filename.split('site-packages/')[-1]}:{frame.lineno})")
        report()
        sys.exit(0)
    out["gen"]["cpu"] = time.process_time() - c0
    out["peak_rss_gen_mb"] = peak_mb()
    print("GEN " + json.dumps(out), flush=True)
    g = torch.Generator().manual_seed(0)
    for s in cfg["unet_sizes"]:
        x = torch.randn(2, 4, s // 8, s // 8, generator=g)
        c = torch.randn(2, 77, 2048, generator=g)
        te = torch.randn(2, 1280, generator=g)
        ids = torch.tensor([[s, s, 0, 0, s, s]] * 2, dtype=torch.float32)
        t = torch.tensor([500.0, 500.0])
        n = cfg["repeat"][str(s)]
        if cfg["warmup"][str(s)]:
            unet_call(x, t, c, te, ids)
        out[f"unet_{s}_s"], out[f"unet_{s}_cpu_s"] = med(lambda: unet_call(x, t, c, te, ids), n)
        out[f"unet_{s}_n"] = n
    for s in cfg["decode_sizes"]:
        z = torch.randn(1, 4, s // 8, s // 8, generator=g)
        holder = {}
        out[f"decode_{s}_s"], out[f"decode_{s}_cpu_s"] = med(lambda: holder.update(img=decode(z)), 1)
        if not torch.isfinite(holder["img"]).all():
            out["notes"].append(f"the {s}^2 decode is not all finite")
report()
"""

# label -> what runs in that configuration's process (the UNet and decode timings after the generation)
# (``--warm-1024`` adds a second, warm, 1024^2 UNet step and decode to the processes that time the 512^2 step)
CONFIGS: dict[str, dict] = {
    "diffusers fp32": dict(engine="diffusers", unet_sizes=[512]),
    "diffusers, sequential CPU offload": dict(engine="diffusers", offload=True, unet_sizes=[]),
    "sdlite mode 1, fp16 weights (default)": dict(engine="sdlite", memory_mode=1, unet_sizes=[512]),
    "sdlite mode 1, fp32 weights": dict(engine="sdlite", memory_mode=1, weight_dtype="float32", unet_sizes=[512],
                                        rss_limit_mb=FP32_RSS_LIMIT_MB),
    "sdlite mode 0": dict(engine="sdlite", memory_mode=0, unet_sizes=[]),
    "sdlite mode 1, int8": dict(engine="sdlite", memory_mode=1, quantize="int8", unet_sizes=[512]),
}
# the order they run in: the reference and the default first, the optional ones last
RUN_ORDER = ("diffusers fp32", "sdlite mode 1, fp16 weights (default)", "sdlite mode 0", "sdlite mode 1, int8",
             "sdlite mode 1, fp32 weights", "diffusers, sequential CPU offload")
REF = "diffusers fp32"
DEFAULT = "sdlite mode 1, fp16 weights (default)"


MIN_AVAILABLE_MB = 768           # a child is stopped before the machine runs out (the OOM killer could pick anyone)


def _meminfo_mb() -> dict[str, float]:
    out = {}
    for line in open("/proc/meminfo"):
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _oom_killed(pid: int) -> bool:
    """Whether the kernel log says the out-of-memory killer took ``pid`` (False where the log cannot be read)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return f"Killed process {pid} " in log


def _rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_child(label: str, cfg: dict, log=print) -> dict:
    """One configuration in a fresh process, its resident memory watched: stopped above the limit or the time."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    warm_page_cache(cfg["model"])
    warm_s = time.perf_counter() - t
    limit = cfg.get("rss_limit_mb", float("inf"))
    load_before = os.getloadavg()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdout=out, stderr=err, env=env,
                                cwd=str(ROOT))
        stopped, sampled, others = None, 0.0, 0.0
        while proc.poll() is None:
            rss, mem = _rss_mb(proc.pid), _meminfo_mb()
            sampled = max(sampled, rss)
            # what everything else on the machine held (page cache aside): other work sharing it
            others = max(others, mem["MemTotal"] - mem["MemAvailable"] - rss)
            if rss > limit:
                stopped = f"stopped: its resident memory passed {limit:.0f} MB"
            elif mem["MemAvailable"] < MIN_AVAILABLE_MB:
                stopped = (f"stopped at {rss:.0f} MB resident: the machine had under {MIN_AVAILABLE_MB} MB left "
                           f"(other processes held {others:.0f} MB)")
            elif time.perf_counter() - start > CHILD_TIMEOUT_S:
                stopped = f"stopped: it ran past {CHILD_TIMEOUT_S} s"
            if stopped:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.5)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    res: dict = {}
    lines = [ln for ln in stdout.splitlines() if ln.startswith(("RESULT ", "GEN "))]
    if lines:  # the full result, or what the child had measured when it stopped (its generation)
        res = json.loads(lines[-1].split(" ", 1)[1])
    if stopped:
        res["error"] = stopped
    elif proc.returncode == -9 and _oom_killed(proc.pid):
        res["error"] = (f"killed by the kernel's out-of-memory killer at about {sampled:.0f} MB resident, other "
                        f"processes on the machine holding up to {others:.0f} MB")
    elif proc.returncode or not any(ln.startswith("RESULT ") for ln in lines):
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        res["error"] = f"failed (exit {proc.returncode}): " + (tail[-1] if tail else "no output")
        res["stderr_tail"] = stderr[-3000:]
    res.update(wall_s=wall, warm_cache_s=warm_s, sampled_peak_rss_mb=sampled, others_peak_mb=others,
               loadavg_before=load_before, loadavg_after=os.getloadavg(),
               **({"rss_limit_mb": limit} if limit != float("inf") else {}))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="configuration labels to measure, separated by ';' (the others "
                                                 "are kept from bench/sdxl.json): " + "; ".join(CONFIGS))
    ap.add_argument("--build-only", action="store_true", help="build (or find) the checkpoint and stop")
    ap.add_argument("--warm-1024", action="store_true",
                    help="also time a second (warm) 1024^2 UNet step and VAE decode where the 512^2 step is timed "
                         "(about 5 more minutes per configuration on 2 cores)")
    ap.add_argument("--report-only", action="store_true",
                    help="bench/sdxl.md and the SDXL section of BENCHMARKS.md again from bench/sdxl.json")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = ap.parse_args()
    raw_file = HERE / "sdxl.json"
    if args.report_only:
        raw = json.loads(raw_file.read_text())
        write_reports(raw, Path(args.out))
        return
    torch.set_num_threads(THREADS)
    t0 = time.perf_counter()
    folder = build(log=lambda m: print(m, flush=True))
    if args.build_only:
        print(folder)
        return
    labels = list(RUN_ORDER)
    raw = {"results": {}}
    if args.only:
        wanted = [s.strip() for s in args.only.split(";") if s.strip()]
        unknown = [w for w in wanted if w not in CONFIGS]
        if unknown:
            raise SystemExit(f"unknown configuration {unknown[0]!r}: expected one of {'; '.join(CONFIGS)}")
        labels = [k for k in RUN_ORDER if k in wanted]
        if raw_file.is_file():
            raw = json.loads(raw_file.read_text())
    from run import cpu_facts, machine

    facts = cpu_facts()
    # one entry per invocation (a full run, or a --only one that re-measured some configurations)
    session = {"labels": labels, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_start": os.getloadavg()}
    raw.setdefault("sessions", []).append(session)
    raw.update(machine=machine(facts), cpu=facts, gen=dict(size=GEN_SIZE, steps=GEN_STEPS, cfg=GEN_CFG),
               prompt=PROMPT, negative=NEGATIVE, threads=THREADS)
    base = dict(model=str(folder), prompt=PROMPT, negative=NEGATIVE, threads=THREADS, gen_size=GEN_SIZE,
                gen_steps=GEN_STEPS, gen_cfg=GEN_CFG, repeat={"512": 2, "1024": 1},
                warmup={"512": True, "1024": False})
    for label in labels:
        print(f"{label}: running (load average {os.getloadavg()[0]:.2f})", flush=True)
        cfg = {**base, "decode_sizes": [], **CONFIGS[label], "label": label}
        if args.warm_1024 and cfg["unet_sizes"]:
            cfg.update(unet_sizes=cfg["unet_sizes"] + [1024], decode_sizes=[1024])
        res = run_child(label, cfg)
        res["session"] = len(raw["sessions"]) - 1
        raw["results"][label] = res
        shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items() if k != "stderr_tail"}
        print(f"{label}: {json.dumps(shown)}", flush=True)
        session.update(loadavg_end=os.getloadavg(), wall_s=time.perf_counter() - t0)
        raw_file.write_text(json.dumps(raw, indent=1) + "\n")
    session.update(loadavg_end=os.getloadavg(), wall_s=time.perf_counter() - t0)
    raw_file.write_text(json.dumps(raw, indent=1) + "\n")
    write_reports(raw, Path(args.out))
    print(f"done in {session['wall_s'] / 60:.1f} min; load average {session['loadavg_start'][0]:.2f} at the start, "
          f"{session['loadavg_end'][0]:.2f} at the end", flush=True)


# --- the report -------------------------------------------------------------------------------------------------

def unet_1024(res: dict):
    """The 1024^2 UNet step: the warm one where measured (``--warm-1024``), else the generation's (its first)."""
    return res.get("unet_1024_s") or (res.get("gen") or {}).get("sampling")


def decode_1024(res: dict):
    return res.get("decode_1024_s") or (res.get("gen") or {}).get("decode")


ROWS = (("import + load to ready, s", lambda r: r.get("ready_s"), "s"),
        ("UNet step 512^2 (cfg, batch 2), s", lambda r: r.get("unet_512_s"), "s"),
        ("UNet step 1024^2 (cfg, batch 2), s", unet_1024, "s"),
        ("VAE decode 1024^2, s", decode_1024, "s"),
        ("text encoding (prompt + negative), s", lambda r: (r.get("gen") or {}).get("text"), "s"),
        ("whole 1024^2 generation, 1 step, s", lambda r: (r.get("gen") or {}).get("total"), "s"),
        ("peak RSS, whole 1024^2 generation (load included), MB", lambda r: r.get("peak_rss_gen_mb"), "mb"),
        ("process CPU time: UNet step 512^2, s", lambda r: r.get("unet_512_cpu_s"), "s"),
        ("process CPU time: whole 1024^2 generation, s", lambda r: (r.get("gen") or {}).get("cpu"), "s"))


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _short(text: str, n: int = 110) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= n else text[:n - 3] + "..."


def table(raw: dict) -> list[str]:
    results = raw["results"]
    labels = [k for k in CONFIGS if k in results]
    ref = results.get(REF, {})
    lines = ["| measure | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name, get, kind in ROWS:
        cells = []
        for label in labels:
            v = get(results[label])
            if v is None:
                cells.append("-" if not results[label].get("error") or results[label].get("gen") else "(see below)")
                continue
            cell = f"{v:.0f}" if kind == "mb" else f"{v:.2f}"
            if label != REF:
                cell += f" ({_ratio(v, get(ref))})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def notes(raw: dict) -> list[str]:
    out = []
    for label in [k for k in CONFIGS if k in raw["results"]]:
        res = raw["results"][label]
        r = res.get("resolved")
        if r:
            weights = {"torch.float16": "kept in fp16 (zero-copy views of the file), up-cast block by block",
                       "torch.float32": "converted to fp32 at load"}.get(r["weight_dtype"], "")
            if r["memory_mode"] == 0:
                weights = "streamed from the mapped file block by block (UNet and text encoders), freed after each"
            elif r["quantize"] != "none":
                weights = f"fp32 except the UNet's, quantized to {r['quantize']} at load"
            out.append(f"- {label}: memory mode {r['memory_mode']}, weights {weights}, compute "
                       f"{r['compute_dtype'].replace('torch.', '')}.")
        ready, peak = res.get("rss_ready_mb"), res.get("peak_rss_gen_mb")
        if ready and peak and ready >= 0.95 * peak:
            out.append(f"- {label}: its peak RSS was reached while loading ({ready:.0f} MB when ready).")
        for note in res.get("notes", []):
            out.append(f"- {label}: {_short(note, 300)}")
        if res.get("offload"):
            versions = ", ".join(f"{k} {v}" for k, v in res.get("versions", {}).items())
            out.append(f"- {label}: set up with `{res['offload']}`. With no accelerator the execution device is the "
                       "CPU itself: accelerate's hooks move the parameters to `meta`, keep them in a CPU state dict "
                       "and put them back for each submodule's forward pass, so every weight stays in memory "
                       f"({res.get('rss_ready_mb', 0):.0f} MB at ready){f' ({versions})' if versions else ''}.")
        if res.get("error"):
            out.append(f"- {label}: {_short(res['error'], 300)}")
    return out


def targets(raw: dict) -> list[str]:
    results = raw["results"]
    ref = results.get(REF, {})
    rows = []
    for label in (DEFAULT, "sdlite mode 1, fp32 weights", "sdlite mode 1, int8"):
        res = results.get(label, {})
        for size, get in ((512, lambda r: r.get("unet_512_s")), (1024, unet_1024)):
            a, b = get(res), get(ref)
            if a and b:
                r = a / b
                rows.append(f"| {label}: UNet step {size}^2 / diffusers fp32's | <= 1.0x | {r:.2f}x | "
                            f"{'met' if r <= 1.0 else 'not met'} |")
    m0 = results.get("sdlite mode 0", {})
    v = m0.get("peak_rss_gen_mb")
    if v:
        rows.append(f"| sdlite mode 0: peak RSS, whole 1024^2 generation | <= {MODE0_TARGET_MB} MB | {v:.0f} MB | "
                    f"{'met' if v <= MODE0_TARGET_MB else 'not met'} |")
    elif m0.get("error"):
        rows.append(f"| sdlite mode 0: peak RSS, whole 1024^2 generation | <= {MODE0_TARGET_MB} MB | "
                    f"{_short(m0['error'], 80)} | not measured |")
    return ["| target | wanted | measured | |", "|---|---|---|---|", *rows]


def _method(raw: dict) -> str:
    warm = any(res.get("unet_1024_s") for res in raw["results"].values())
    n512 = next((res["unet_512_n"] for res in raw["results"].values() if res.get("unet_512_n")), None)
    parts = []
    if n512:
        parts.append(f"the 512^2 UNet step (cfg, batch 2, random inputs) is a warm-up then the median of {n512}, "
                     "after the generation, in the columns that have it")
    if warm:
        parts.append("the 1024^2 UNet step and the 1024^2 decode are a second run after the generation (warm)")
    else:
        parts.append("the 1024^2 UNet step and VAE decode are the generation's own (one run each, the process's "
                     "first at that size; sdlite's decode includes building its VAE, about half a second), to keep the "
                     "run to about 45 minutes on 2 cores")
    return "; ".join(parts)


def body(raw: dict, heading: str) -> list[str]:
    sessions = raw.get("sessions", [])
    shown = {}   # session -> the configurations whose figures come from it
    for label in [k for k in CONFIGS if k in raw["results"]]:
        shown.setdefault(raw["results"][label].get("session", len(sessions) - 1), []).append(label)
    runs = [(sessions[i], labels) for i, labels in sorted(shown.items()) if "loadavg_end" in sessions[i]]
    fmt = lambda la: ", ".join(f"{x:.2f}" for x in la)
    parts = []
    for i, (run, labels) in enumerate(runs):
        name = "Run" if len(runs) == 1 else f"Run {i + 1} ({'; '.join(labels)})"
        parts.append(f"{name}: {run['wall_s'] / 60:.0f} min, load average (1, 5, 15 min) {fmt(run['loadavg_start'])} "
                     f"at the start, {fmt(run['loadavg_end'])} at the end.")
    load = " ".join(parts)
    if runs:
        load += (" Other work shared the machine's 2 cores and memory meanwhile: the wall times run long, the process "
                 "CPU times less so; `bench/sdxl.json` has each process's load averages and how much memory the "
                 "other processes held.")
    g = raw["gen"]
    lines = [
        f"{heading} SDXL", "",
        "sdlite against diffusers on the same full-size SDXL base checkpoint (a diffusers folder, fp16 safetensors, "
        "random weights at the real shapes of stabilityai/stable-diffusion-xl-base-1.0, built by `bench/sdxl.py` into "
        "`bench/cache/sdxl-fp16/`), each configuration in its own fresh process after the files were read once into "
        f"the page cache; {raw['threads']} torch threads; fp32 compute everywhere (sdlite's fp16-weights and int8 "
        "configurations keep their weights so and compute in fp32).", "",
        f"Per process: load; one whole {g['size']}^2 generation of {g['steps']} step (euler, cfg {g['cfg']:g}, seed "
        "42, the prompt and negative prompt of `bench/sdxl.py`: text encoding, one CFG step, the VAE decode), timed "
        "by parts, the process's peak RSS read right after it (so it covers the load and the generation); "
        f"{_method(raw)}. diffusers decodes untiled (as its pipeline does); sdlite tiles automatically above "
        "768 px. A '-' was not measured in that process.", "",
        f"Machine: {raw['machine']}", "",
        f"Command: `make bench` (`python bench/sdxl.py`{'; then `--only` for some configurations' if len(runs) > 1 else ''}). {load}",
        "", *table(raw), "",
        "Ratios in parentheses are against diffusers fp32 (lower is better).",
    ]
    n = notes(raw)
    if n:
        lines += ["", *n]
    lines += ["", f"{heading}# Targets", "", *targets(raw)]
    return lines


def write_reports(raw: dict, benchmarks: Path) -> None:
    md = HERE / "sdxl.md"
    md.write_text("\n".join(body(raw, "#")).rstrip() + "\n", encoding="utf-8")
    print(f"wrote {md.relative_to(ROOT)}")
    section = [MARK_BEGIN, *body(raw, "##"), "", "Raw figures: `bench/sdxl.json`; the report alone: `bench/sdxl.md`.",
               MARK_END]
    text = benchmarks.read_text(encoding="utf-8") if benchmarks.is_file() else "# Benchmarks\n"
    begin, end = text.find(MARK_BEGIN), text.find(MARK_END)
    if begin >= 0 and end > begin:
        text = text[:begin] + "\n".join(section) + text[end + len(MARK_END):]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(section) + "\n"
    benchmarks.write_text(text, encoding="utf-8")
    print(f"wrote the SDXL section of {benchmarks.name}")


if __name__ == "__main__":
    main()
