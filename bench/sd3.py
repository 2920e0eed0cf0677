"""SD3.5 Medium and Large: sdlite's peak memory in memory mode 0, its speed and precision against diffusers.

    python bench/sd3.py [--models medium,large] [--sizes 512,1024] [--only LABEL,...] [--build-only]
                        [--report-only] [--single-file] [--smoke]

The checkpoints are built once into bench/cache/ (diffusers StableDiffusion3Pipeline folders at the real shapes of
stabilityai/stable-diffusion-3.5-medium and -large, from sdlite.config.mmdit's SD35_MEDIUM / SD35_LARGE,
sdlite.config.t5's T5_XXL, CLIP ViT-L and OpenCLIP bigG and SD3's 16-channel VAE) and reused: sd35-medium-bf16/ and
sd35-large-bf16/ hold their own transformer and hard links to the text encoders, tokenizers and VAE they share, which
are written once into sd3-shared/. Each network is built on the meta device and its tensors written one by one
(``randn * 0.02`` in bf16, norms at 1), so no full copy is ever in memory. Speed and memory do not depend on the
weights' values, only on their shapes and storage dtype. ``--single-file`` also writes sd35-medium-single/: Stability's
``sd3.5_medium.safetensors`` (MMDiT and VAE in Stability's names) with ComfyUI's ``clip_l.safetensors``,
``clip_g.safetensors`` and ``t5xxl_fp16.safetensors`` beside it, for other engines (stable-diffusion.cpp).

Every configuration runs in its own fresh process (``torch.set_num_threads(2)``), after the checkpoint's files were
read once into the page cache where they fit in the free memory, else its transformer's alone where those fit
(SD3.5 Large's 27 GB and its transformer's 16 GB do not fit on 24 GB: it reads from the disk).
Prompt, negative prompt, euler, cfg 4.5 (so CFG runs), seed 42. The configurations:

1. ``rss MODEL SIZE``: sdlite, precision ``auto``, memory mode 0: one whole generation of 1 step (load, text
   encoding with T5, one CFG step, decode); the process's peak RSS read right after it, the parts timed by
   ``Result.timings`` and the script's clocks. ``rss medium 512`` then also runs the speed measurements below.
2. Speed, SD3.5 Medium at 512^2 (``sdlite auto``: memory mode 1, the default; ``sdlite exact mode0``: fp32 compute,
   memory mode 0, as mode 1 would hold the fp32 transformer beside T5, about 21 GB; ``diffusers bf16``: the whole
   pipeline in bf16; ``diffusers fp32 no-t5``: fp32 without T5, as with it the pipeline would hold about 33 GB):
   a 1-step and a 4-step generation, each step timed, then the transformer alone (one CFG step: batch 2, random
   latents, context (2, 333, 4096), pooled (2, 2048)), a warm-up then the median of 3.
3. Precision: the 4-step images and latents of ``auto`` (modes 1 and 0) and of diffusers bf16 against ``exact``:
   PSNR and the latents' relative error.

The parent watches each child's resident memory and stops one that would take the machine's last GB, or that runs
past CHILD_TIMEOUT_S; the report says so. Raw figures go to bench/sd3.json after every child (``--only`` re-measures
some configurations and keeps the others), the report to bench/sd3.md and the section "SD3.5" of BENCHMARKS.md
between markers (``--report-only``: both again from bench/sd3.json). ``--smoke`` builds tiny SD3.5-shaped models in
a temporary folder and runs every path end to end in a minute or two; it writes nothing under bench/ but prints its
report.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))   # bench/run.py and bench/startup.py, when run from elsewhere
sys.path.insert(1, str(ROOT))   # sdlite, and tests/reference.py's tokenizer files

from sdxl import MIN_AVAILABLE_MB, _meminfo_mb, _oom_killed, _rss_mb  # noqa: E402
from startup import warm_page_cache  # noqa: E402

from sdlite.config import TextEncoderConfig, VAEConfig  # noqa: E402
from sdlite.config.mmdit import SD35_LARGE, SD35_MEDIUM, MMDiTConfig  # noqa: E402
from sdlite.config.t5 import T5_XXL, T5Config  # noqa: E402

CACHE = HERE / "cache"
FOLDERS = {"shared": "sd3-shared", "medium": "sd35-medium-bf16", "large": "sd35-large-bf16",
           "single": "sd35-medium-single"}
PROMPT, NEGATIVE = "a red circle on a blue background, highly detailed", "blurry, low quality"
THREADS, CFG, SEED = 2, 4.5, 42
SIZES, MODELS = (512, 1024), ("medium", "large")
SPEED_STEPS, STEP_REPEAT = 4, 3
CONTEXT_TOKENS = 77 + 256          # CLIP's chunk and T5's row
SHARD_BYTES = 5 * 2**30            # transformers' default shard size
MACHINE_GB = 24
CHILD_TIMEOUT_S = 45 * 60
MARK_BEGIN, MARK_END = "<!-- sd3:begin (written by bench/sd3.py) -->", "<!-- sd3:end -->"
T5_TOKENIZER = ROOT / "sdlite" / "data" / "t5" / "tokenizer.json"

# the networks: the released shapes, and a tiny SD3.5-shaped set for --smoke (CLIP heads 64 wide, as a single file's
# shapes imply them; the joint context holds both towers' 64 + 128 channels)
SD3_VAE = VAEConfig(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                    use_post_quant_conv=False, sample_size=1024)
FULL = dict(medium=SD35_MEDIUM, large=SD35_LARGE, text_l=TextEncoderConfig(),
            text_g=TextEncoderConfig(width=1280, layers=32, heads=20, mlp_width=5120, activation="gelu",
                                     pad_token_id=0, eos_token_id=2, projection_dim=1280),
            t5=T5_XXL, vae=SD3_VAE)
_TINY_MMDIT = dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=8,
                   num_attention_heads=4, joint_attention_dim=192, caption_projection_dim=32, pooled_projection_dim=56,
                   pos_embed_max_size=16, qk_norm="rms_norm")
TINY = dict(medium=MMDiTConfig(num_layers=3, dual_attention_layers=(0,), **_TINY_MMDIT),
            large=MMDiTConfig(num_layers=4, **_TINY_MMDIT),
            text_l=TextEncoderConfig(width=64, layers=2, heads=1, mlp_width=48, projection_dim=32),
            text_g=TextEncoderConfig(width=128, layers=2, heads=2, mlp_width=64, pad_token_id=0, eos_token_id=2,
                                     projection_dim=24),
            t5=T5Config(d_model=192, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
            vae=dataclasses.replace(SD3_VAE, block_channels=(32, 64, 64, 64), layers_per_block=1, sample_size=64))
SMOKE_PX = {512: 64, 1024: 128}


# --- the checkpoints --------------------------------------------------------------------------------------------

DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _meta_networks(parts: dict, which: str) -> dict:
    """``which`` ("shared", or a model: "medium", "large") as diffusers and transformers build it on the meta device:
    folder -> (module, config.json text, weight-file stem, keys not written)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5EncoderModel
    from transformers import T5Config as HFT5Config

    def hf(module):
        module.config.architectures = [type(module).__name__]
        module.config.dtype = torch.bfloat16
        return module.config.to_json_string()

    def diffusers_model(cls, cfg):
        return cls(**{k: v for k, v in cfg.to_diffusers().items() if k != "_class_name"})

    def clip(cfg):
        d = {k: v for k, v in cfg.to_diffusers().items() if k not in ("architectures", "model_type", "torch_dtype")}
        return CLIPTextModelWithProjection(CLIPTextConfig(**d))

    with torch.device("meta"):
        if which != "shared":
            model = diffusers_model(SD3Transformer2DModel, parts[which])
            return {"transformer": (model, model.to_json_string(), "diffusion_pytorch_model", ())}
        vae = diffusers_model(AutoencoderKL, parts["vae"])
        t5 = T5EncoderModel(HFT5Config(**dataclasses.asdict(parts["t5"]), is_encoder_decoder=False, use_cache=False))
        text_l, text_g = clip(parts["text_l"]), clip(parts["text_g"])
    return {"text_encoder": (text_l, hf(text_l), "model", ()), "text_encoder_2": (text_g, hf(text_g), "model", ()),
            # encoder.embed_tokens is shared.weight (tied): saved once, as transformers saves it
            "text_encoder_3": (t5, hf(t5), "model", ("encoder.embed_tokens.weight",)),
            "vae": (vae, vae.to_json_string(), "diffusion_pytorch_model", ())}


def _random_items(module: torch.nn.Module, drop=(), seed: str = "") -> list:
    """(key, shape, dtype, make) of every tensor of ``module``'s state, in key order: a norm's scale 1 and shift 0,
    everything else ``randn * 0.02`` in bf16 from a generator seeded by its name (the same files on every build)."""
    owner = {}
    for name, mod in module.named_modules():
        for leaf, _ in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            owner[f"{name}.{leaf}" if name else leaf] = (type(mod).__name__, leaf)
    items = []
    for key, t in sorted(module.state_dict().items()):
        if key in drop:
            continue
        if not t.is_floating_point():
            raise RuntimeError(f"{key}: a {t.dtype} tensor in the state dict; the builder writes bf16 only")
        cls, leaf = owner.get(key, ("", ""))
        shape = tuple(t.shape)
        if "Norm" in cls and t.dim() == 1:
            make = (lambda shape=shape, v=float(leaf == "weight"): torch.full(shape, v, dtype=torch.bfloat16))
        else:
            def make(shape=shape, name=f"{seed}/{key}"):
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                return torch.randn(shape, dtype=torch.bfloat16, generator=g).mul_(0.02)
        items.append((key, shape, torch.bfloat16, make))
    return items


def _nbytes(items) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, _ in items)


def _write_file(path: Path, items) -> None:
    """A .safetensors file written tensor by tensor: 8 bytes of the header's length, the JSON header (padded to 8
    bytes; known from the shapes alone), then each tensor's bytes as ``make()`` gives it."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape, dtype, _ in items:
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, shape, dtype, make in items:
            t = make().to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"{key}: made {tuple(t.shape)}, expected {shape}")
            f.write(t.reshape(-1).view(torch.uint8).numpy())


def _write_weights(folder: Path, stem: str, items, shard_bytes: int) -> None:
    """``stem``.safetensors, or shards of at most ``shard_bytes`` and ``stem``.safetensors.index.json, as diffusers
    and transformers name them."""
    if _nbytes(items) <= shard_bytes:
        _write_file(folder / f"{stem}.safetensors", items)
        return
    shards, size = [[]], 0
    for item in items:
        n = _nbytes([item])
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_file(folder / name, shard)
        weight_map.update({key: name for key, *_ in shard})
    index = {"metadata": {"total_size": _nbytes(items)}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


class _Files:
    """The tensors of a component folder's safetensors files (or of one file), read one at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        files = [folder] if folder.is_file() else sorted(folder.glob("*.safetensors"))   # or one file
        self.where = {k: h for p in files for h in [safe_open(str(p), "pt")] for k in h.keys()}
        self.shapes = {k: tuple(h.get_slice(k).get_shape()) for k, h in self.where.items()}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.where[key].get_tensor(key)

    def items(self, dtype: torch.dtype) -> list:
        """Every tensor as it is, to be written in ``dtype``."""
        return [(k, self.shapes[k], dtype, lambda k=k: self[k]) for k in sorted(self.where)]


def _check_disk(where: Path, need: int, what: str) -> None:
    if need + 2**30 > (free := shutil.disk_usage(where).free):
        raise SystemExit(f"building {what} needs {need / 1e9:.1f} GB of disk and 1 GB to spare; {free / 1e9:.1f} "
                         "GB is free")


def _atomic(folder: Path, fill) -> Path:
    """``folder``, filled by ``fill(tmp)`` in a temporary folder beside it and renamed: complete or absent."""
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (the same file, no second copy on disk; diffusers, transformers and sdlite
    read it as any file), or a copy where the filesystem has no hard links."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_networks(tmp: Path, networks: dict, seed: str, shard_bytes: int, what: str, log) -> dict:
    """Each network's config.json and random weights in its folder under ``tmp``: {folder: parameters}."""
    need = sum(_nbytes(_random_items(m, drop)) for m, _, _, drop in networks.values())
    _check_disk(tmp.parent, need, what)
    log(f"building {what} ({need / 1e9:.1f} GB)")
    params = {}
    for sub, (module, config, stem, drop) in networks.items():
        (tmp / sub).mkdir()
        (tmp / sub / "config.json").write_text(config + ("" if config.endswith("\n") else "\n"))
        items = _random_items(module, drop, f"{seed}/{sub}")
        t = time.perf_counter()
        _write_weights(tmp / sub, stem, items, shard_bytes)
        params[sub] = sum(math.prod(s) for _, s, _, _ in items)
        log(f"  {sub}: {len(items)} tensors, {params[sub] / 1e6:.1f}M parameters, "
            f"{_nbytes(items) / 1e9:.2f} GB ({time.perf_counter() - t:.0f} s)")
    return params


def build_shared(folder: Path, parts: dict, shard_bytes: int, log=print) -> Path:
    """CLIP-L, bigG, T5-XXL (two shards), their tokenizers, the VAE and the scheduler: what both models share."""
    def fill(tmp: Path):
        import diffusers
        from transformers import T5TokenizerFast

        from sdlite.weights.sd3 import SD3_SCHEDULER
        from tests.reference import write_hf_tokenizer_files

        params = _write_networks(tmp, _meta_networks(parts, "shared"), "shared", shard_bytes, folder.name, log)
        write_hf_tokenizer_files(tmp / "tokenizer")
        write_hf_tokenizer_files(tmp / "tokenizer_2", pad_token="!")   # bigG's tokenizer pads with "!" (id 0)
        (tok := T5TokenizerFast(tokenizer_file=str(T5_TOKENIZER))).save_pretrained(str(tmp / "tokenizer_3"))
        (tmp / "scheduler").mkdir()
        scheduler = {**SD3_SCHEDULER, "_diffusers_version": diffusers.__version__}
        (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2) + "\n")
        (tmp / "built.json").write_text(json.dumps({"parameters": params, "t5_tokenizer": type(tok).__name__}) + "\n")
    return _atomic(folder, fill)


def build_model(folder: Path, parts: dict, which: str, shared: Path, shard_bytes: int, log=print) -> Path:
    """The diffusers folder of ``which``: its own transformer, hard links to the shared parts, model_index.json."""
    def fill(tmp: Path):
        import diffusers

        params = _write_networks(tmp, _meta_networks(parts, which), which, shard_bytes,
                                 f"{folder.name} (and links to {shared.name})", log)
        for sub in ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3",
                    "vae", "scheduler"):
            for f in [f for f in (shared / sub).rglob("*") if f.is_file()]:
                _link(f, tmp / sub / f.relative_to(shared / sub))
        built = json.loads((shared / "built.json").read_text())
        clip, tok = ["transformers", "CLIPTextModelWithProjection"], ["transformers", "CLIPTokenizer"]
        index = {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": diffusers.__version__,
                 "feature_extractor": [None, None], "image_encoder": [None, None],
                 "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": clip,
                 "text_encoder_2": clip, "text_encoder_3": ["transformers", "T5EncoderModel"], "tokenizer": tok,
                 "tokenizer_2": tok, "tokenizer_3": ["transformers", built["t5_tokenizer"]],
                 "transformer": ["diffusers", "SD3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "built.json").write_text(json.dumps({"parameters": {**built["parameters"], **params}}) + "\n")
    return _atomic(folder, fill)


def build_single(folder: Path, medium: Path, log=print) -> Path:
    """Stability's sd3.5_medium.safetensors (the MMDiT under model.diffusion_model., the VAE under
    first_stage_model., in Stability's names, converted tensor by tensor from the diffusers folder) with ComfyUI's
    separate encoder files beside it: clip_l and clip_g (hard links: transformers' names, as ComfyUI's files) and
    t5xxl_fp16 (T5 converted to fp16)."""
    from sdlite.weights.mmdit_keys import mmdit_to_original
    from sdlite.weights.vae_keys import vae_to_original

    def converted(src: _Files, plan):
        if plan.missing or plan.unexpected:
            raise RuntimeError(plan.report())
        shapes = plan.shapes(src.shapes)
        view = plan.apply(src)
        return [(k, shapes[k], torch.bfloat16, lambda k=k: view[k]) for k in sorted(plan.entries)]

    def fill(tmp: Path):
        transformer, vae = _Files(medium / "transformer"), _Files(medium / "vae")
        t5 = _Files(medium / "text_encoder_3")
        items = converted(transformer, mmdit_to_original(transformer.where)) + \
            converted(vae, vae_to_original(vae.where))
        t5_items = t5.items(torch.float16)
        _check_disk(folder.parent, _nbytes(items) + _nbytes(t5_items), "the single file and its T5")
        log(f"building {folder.name} ({(_nbytes(items) + _nbytes(t5_items)) / 1e9:.1f} GB)")
        _write_file(tmp / "sd3.5_medium.safetensors", items)
        _write_file(tmp / "t5xxl_fp16.safetensors", t5_items)
        for sub, name in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
            files = sorted((medium / sub).glob("*.safetensors"))
            if len(files) == 1:
                _link(files[0], tmp / f"{name}.safetensors")
            else:   # sharded (only --smoke's tiny shards): one file
                _write_file(tmp / f"{name}.safetensors", _Files(medium / sub).items(torch.bfloat16))
    return _atomic(folder, fill)


def build(root: Path, parts: dict, models, single: bool, shard_bytes: int = SHARD_BYTES, log=print) -> dict:
    """The folders asked for (and what they need): {"medium": path, "large": path, "single": path}."""
    t0, out = time.perf_counter(), {}
    shared = build_shared(root / FOLDERS["shared"], parts, shard_bytes, log)
    for which in [m for m in MODELS if m in models or (single and m == "medium")]:
        out[which] = build_model(root / FOLDERS[which], parts, which, shared, shard_bytes, log)
    if single:
        out["single"] = build_single(root / FOLDERS["single"], out["medium"], log)
    log(f"checkpoints ready in {time.perf_counter() - t0:.0f} s: {', '.join(p.name for p in out.values())}")
    return out


# --- the measurements -------------------------------------------------------------------------------------------

CHILD = r"""
import json, os, statistics, sys, time
t_start = time.perf_counter()
cfg = json.loads(sys.argv[1])
import numpy as np
import torch
torch.set_num_threads(cfg["threads"])
out = {"notes": [], "gens": []}

now = time.perf_counter

def peak_mb():   # this process's own high-water mark: ru_maxrss would count the parent's (started by vfork, exec)
    return next(int(ln.split()[1]) / 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))

def report():
    out.update(peak_rss_mb=peak_mb(), capability=torch.backends.cpu.get_cpu_capability(),
               threads=torch.get_num_threads())
    print("RESULT " + json.dumps(out), flush=True)

def failed(what, e):
    import traceback
    frame = traceback.extract_tb(e.__traceback__)[-1]
    out["error"] = (f"{what} failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]} "
                    f"(raised in {frame.name}, {frame.filename.split('site-packages/')[-1]}:{frame.lineno})")
    report(); sys.exit(0)

def med(fn, n):
    times, cpu = [], []
    for _ in range(n):
        t, c = now(), time.process_time(); fn()
        times.append(now() - t); cpu.append(time.process_time() - c)
    return statistics.median(times), statistics.median(cpu)

durations = lambda start, ends: [b - a for a, b in zip([start, *ends], ends)]

model_cfg = {k: json.load(open(os.path.join(cfg["model"], k, "config.json"))) for k in ("transformer", "vae")}
latent_channels = model_cfg["vae"]["latent_channels"]
downscale = 2 ** (len(model_cfg["vae"]["block_out_channels"]) - 1)
scale = cfg["cfg"]
try:
    if cfg["engine"] == "diffusers":
        import diffusers, transformers
        from diffusers import StableDiffusion3Pipeline
        out["versions"] = {m.__name__: m.__version__ for m in (diffusers, transformers)}
        dt = getattr(torch, cfg["dtype"])
        kw = dict(text_encoder_3=None, tokenizer_3=None) if cfg.get("no_t5") else {}
        pipe = StableDiffusion3Pipeline.from_pretrained(cfg["model"], dtype=dt, local_files_only=True, **kw)
        pipe.set_progress_bar_config(disable=True)
        marks, encode = {}, pipe.encode_prompt
        def timed_encode(*a, **k):
            t = now(); r = encode(*a, **k); marks.update(text_end=now(), text=now() - t); return r
        pipe.encode_prompt = timed_encode
        def generate(size, steps):
            ends, held = [], {}
            def step_end(p, i, t, kw):
                ends.append(now()); held["latents"] = kw["latents"]; return kw
            t0 = now()
            img = pipe(cfg["prompt"], negative_prompt=cfg["negative"], num_inference_steps=steps, guidance_scale=scale,
                       height=size, width=size, generator=torch.Generator().manual_seed(cfg["seed"]),
                       callback_on_step_end=step_end, output_type="np").images[0]
            t1 = now()
            timing = {"text": marks["text"], "sampling": ends[-1] - marks["text_end"], "decode": t1 - ends[-1],
                      "total": t1 - t0, "steps": durations(marks["text_end"], ends)}
            return timing, np.round(np.clip(img, 0, 1) * 255).astype(np.uint8), held["latents"].float()
        def step_call(x, t, c, p):
            return pipe.transformer(hidden_states=x.to(dt), timestep=t, encoder_hidden_states=c.to(dt),
                                    pooled_projections=p.to(dt), return_dict=False)[0]
    else:
        from sdlite.pipeline import Engine, Request
        engine = Engine.load(cfg["model"], precision=cfg["precision"], memory_mode=cfg["memory_mode"])
        m = engine.models
        out["resolved"] = {"precision": engine.precision.label, "memory_mode": m.mode, "compute": str(m.dtype),
                           "text": str(m.dtype_of("text_encoder")), "vae": str(m.dtype_of("vae")),
                           "weights": str(m.weight_dtype)}
        if m.mode != 0:   # int8 layers, where the precision quantizes this network (resident: no extra work)
            with m.use("transformer") as transformer:
                out["resolved"]["int8_layers"] = sum(type(x).__name__.startswith("Int8") for x in transformer.modules())
        def generate(size, steps):
            ends = []
            t0 = now()
            res = engine.generate(Request(prompt=cfg["prompt"], negative_prompt=cfg["negative"], width=size,
                                          height=size, steps=steps, cfg_scale=scale, sampler="euler", seed=cfg["seed"]),
                                  callback=lambda i, n: ends.append(now()))
            t1 = now()
            timing = {**{k: res.timings[k] for k in ("text", "sampling", "decode")}, "total": t1 - t0,
                      "steps": durations(t0 + res.timings["text"], ends)}
            return timing, np.asarray(res.images[0].convert("RGB")), res.latents.float()
        def step_call(x, t, c, p):
            with engine.models.use("transformer") as transformer:
                return transformer(x, t, c, p)
except Exception as e:
    failed("loading", e)
out["ready_s"] = now() - t_start
out["rss_ready_mb"] = peak_mb()

with torch.no_grad():
    for i, g in enumerate(cfg["gens"]):
        c0 = time.process_time()
        try:
            timing, image, latents = generate(g["size"], g["steps"])
        except Exception as e:
            failed(f"the {g['steps']}-step {g['size']}^2 generation", e)
        timing.update(cpu=time.process_time() - c0, size=g["size"], n=g["steps"])
        out["gens"].append(timing)
        if not torch.isfinite(latents).all():
            out["notes"].append(f"the {g['steps']}-step generation's latents are not all finite")
        if i == 0:   # the peak of loading and one whole generation
            out["peak_rss_gen_mb"] = peak_mb()
            print("GEN " + json.dumps(out), flush=True)
        if g.get("save"):
            np.savez(os.path.join(cfg["artifacts"], g["save"] + ".npz"), image=image, latents=latents.numpy())
    if (s := cfg["step_size"]):   # one CFG step of the transformer alone, on random inputs
        gen, tc = torch.Generator().manual_seed(0), model_cfg["transformer"]
        x = torch.randn(2, latent_channels, s // downscale, s // downscale, generator=gen)
        c = torch.randn(2, cfg["context_tokens"], tc["joint_attention_dim"], generator=gen)
        p, t = torch.randn(2, tc["pooled_projection_dim"], generator=gen), torch.tensor([500.0, 500.0])
        try:
            step_call(x, t, c, p)   # warm-up
            out["step_s"], out["step_cpu_s"] = med(lambda: step_call(x, t, c, p), cfg["repeat"])
            out["step_size"], out["step_n"] = s, cfg["repeat"]
        except Exception as e:
            failed(f"the {s}^2 transformer step", e)
report()
"""

# the speed configurations (SD3.5 Medium, 512^2) beside "rss medium 512" (sdlite auto in memory mode 0)
SPEED = {"sdlite auto": dict(engine="sdlite", precision="auto", memory_mode=1),
         "sdlite exact mode0": dict(engine="sdlite", precision="exact", memory_mode=0),
         "diffusers bf16": dict(engine="diffusers", dtype="bfloat16"),
         "diffusers fp32 no-t5": dict(engine="diffusers", dtype="float32", no_t5=True)}
REF_EXACT = "sdlite exact mode0"
# compared with sdlite exact at 4 steps: label -> what it is
QUALITY = {"sdlite auto": "sdlite auto, memory mode 1", "rss medium 512": "sdlite auto, memory mode 0",
           "diffusers bf16": "diffusers bf16"}


def slug(label: str) -> str:
    return label.replace(" ", "_")


def plan_configs(models, sizes, px: dict) -> dict[str, dict]:
    """label -> what runs in that configuration's process, in the order they run (a model's configurations
    together, so its files stay in the page cache)."""
    speed_gens = lambda label: [dict(size=px[512], steps=1), dict(size=px[512], steps=SPEED_STEPS, save=slug(label))]
    out = {}
    for which in [m for m in MODELS if m in models]:
        for size in [s for s in SIZES if s in sizes]:
            label = f"rss {which} {size}"
            cfg = dict(engine="sdlite", which=which, precision="auto", memory_mode=0,
                       gens=[dict(size=px[size], steps=1)], step_size=None)
            if which == "medium" and size == 512:   # also the speed and precision of auto in mode 0
                cfg.update(gens=speed_gens(label), step_size=px[512])
            out[label] = cfg
        for label, kw in SPEED.items() if which == "medium" else ():
            out[label] = dict(which="medium", step_size=px[512], gens=speed_gens(label), **kw)
    return out


def run_child(cfg: dict, timeout_s: float = CHILD_TIMEOUT_S) -> dict:
    """One configuration in a fresh process, its resident memory watched: stopped before the machine runs out."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    # the files are read into the page cache first where they fit in 80% of the free memory; else the transformer's
    # alone (what memory mode 0 reads again at every step), where those fit
    t, warm, free = time.perf_counter(), "none", _meminfo_mb()["MemAvailable"] * 2**20 * 0.8
    for what, path in (("all", Path(cfg["model"])), ("transformer", Path(cfg["model"]) / "transformer")):
        if sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) < free:
            warm_page_cache(path)
            warm = what
            break
    warm_s = time.perf_counter() - t
    load_before = os.getloadavg()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdout=out, stderr=err, env=env,
                                cwd=str(ROOT))
        stopped, sampled, others = None, 0.0, 0.0
        while proc.poll() is None:
            rss, mem = _rss_mb(proc.pid), _meminfo_mb()
            sampled = max(sampled, rss)
            others = max(others, mem["MemTotal"] - mem["MemAvailable"] - rss)
            if mem["MemAvailable"] < MIN_AVAILABLE_MB:
                stopped = (f"stopped at {rss:.0f} MB resident: the machine had under {MIN_AVAILABLE_MB} MB left "
                           f"(other processes held {others:.0f} MB)")
            elif time.perf_counter() - start > timeout_s:
                stopped = f"stopped: it ran past {timeout_s:.0f} s"
            if stopped:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.5)
        wall = time.perf_counter() - start
        stdout, stderr = [(f.seek(0), f.read())[1] for f in (out, err)]
    lines = [ln for ln in stdout.splitlines() if ln.startswith(("RESULT ", "GEN "))]
    res = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}   # all, or what it had when it stopped
    if stopped:
        res["error"] = stopped
    elif proc.returncode == -9 and _oom_killed(proc.pid):
        res["error"] = (f"killed by the kernel's out-of-memory killer at about {sampled:.0f} MB resident, other "
                        f"processes holding up to {others:.0f} MB")
    elif proc.returncode or not any(ln.startswith("RESULT ") for ln in lines):
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        res["error"] = f"failed (exit {proc.returncode}): " + (tail[-1] if tail else "no output")
    if res.get("error") and stderr.strip():
        res["stderr_tail"] = stderr[-3000:]
    res.update(wall_s=wall, warm_cache=warm, warm_cache_s=warm_s, sampled_peak_rss_mb=sampled, others_peak_mb=others,
               loadavg_before=load_before, loadavg_after=os.getloadavg())
    return res


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def quality(artifacts: Path) -> dict:
    """Each 4-step result of QUALITY against sdlite exact's: PSNR of the images, relative error of the latents."""
    ref_file, out = artifacts / f"{slug(REF_EXACT)}.npz", {}
    ref = np.load(ref_file) if ref_file.is_file() else None
    for label in QUALITY:
        if ref is not None and (f := artifacts / f"{slug(label)}.npz").is_file():
            got = np.load(f)
            la, lb = got["latents"].astype(np.float64), ref["latents"].astype(np.float64)
            out[label] = {"psnr_db": psnr(got["image"], ref["image"]),
                          "latents_rel_err": float(np.linalg.norm(la - lb) / np.linalg.norm(lb)),
                          "image_max_diff": int(np.abs(got["image"].astype(int) - ref["image"].astype(int)).max())}
    return out


def measure(folders: dict, labels: list[str], configs: dict, raw: dict, artifacts: Path, raw_file: Path,
            timeout_s: float = CHILD_TIMEOUT_S, log=print) -> None:
    """Each configuration of ``labels`` in its process; ``raw`` (and ``raw_file``) updated after each."""
    from run import cpu_facts, machine

    session = {"labels": labels, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_start": os.getloadavg()}
    raw.setdefault("sessions", []).append(session)
    raw.update(machine=machine(facts := cpu_facts()), cpu=facts, prompt=PROMPT, negative=NEGATIVE, threads=THREADS,
               cfg=CFG, seed=SEED, speed_steps=SPEED_STEPS, step_repeat=STEP_REPEAT)
    artifacts.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for label in labels:
        log(f"{label}: running (load average {os.getloadavg()[0]:.2f})")
        cfg = {**configs[label], "label": label, "model": str(folders[configs[label]["which"]]), "prompt": PROMPT,
               "negative": NEGATIVE, "threads": THREADS, "cfg": CFG, "seed": SEED, "repeat": STEP_REPEAT,
               "context_tokens": CONTEXT_TOKENS, "artifacts": str(artifacts)}
        res = run_child(cfg, timeout_s)
        res["session"] = len(raw["sessions"]) - 1
        raw.setdefault("results", {})[label] = res
        shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items() if k != "stderr_tail"}
        log(f"{label}: {json.dumps(shown)}")
        session.update(loadavg_end=os.getloadavg(), wall_s=time.perf_counter() - t0)
        raw["quality"] = quality(artifacts)
        raw_file.write_text(json.dumps(raw, indent=1) + "\n")


# --- the report -------------------------------------------------------------------------------------------------

def _gen(r: dict, i: int) -> dict:
    return dict(enumerate(r.get("gens") or [])).get(i, {})


def _f(v, kind="s") -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if kind == "mb" else f"{v:.2f}" if kind == "s" else f"{v:.1f}"


def _short(text: str, n: int = 300) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= n else text[:n - 3] + "..."


def rss_table(raw: dict) -> list[str]:
    res = raw.get("results", {})
    labels = [f"rss {m} {s}" for m in MODELS for s in SIZES if f"rss {m} {s}" in res]
    lines = ["| model, size | peak RSS, MB | of 24 GB | load to ready, s | text encoding, s | step, s | decode, s | "
             "whole generation, s | process CPU, s |", "|---|---|---|---|---|---|---|---|---|"]
    for label in labels:
        r, g = res[label], _gen(res[label], 0)
        _, which, size = label.split()
        peak = r.get("peak_rss_gen_mb")
        share = f"{100 * peak / (MACHINE_GB * 1024):.0f}%" if peak else "-"
        step = (g.get("steps") or [None])[0]
        lines.append(f"| SD3.5 {which.title()}, {size}^2 | {_f(peak, 'mb')} | {share} | {_f(r.get('ready_s'))} | "
                     f"{_f(g.get('text'))} | {_f(step)} | {_f(g.get('decode'))} | {_f(g.get('total'))} | "
                     f"{_f(g.get('cpu'))} |")
    return lines


# speed table columns: (heading, result label, reference label for the ratio)
COLUMNS = (("diffusers bf16", "diffusers bf16", None), ("sdlite auto, mode 1", "sdlite auto", "diffusers bf16"),
           ("sdlite auto, mode 0", "rss medium 512", "diffusers bf16"),
           ("diffusers fp32, no T5", "diffusers fp32 no-t5", None),
           ("sdlite exact, mode 0", "sdlite exact mode0", "diffusers fp32 no-t5"))
ROWS = (("import + load to ready, s", lambda r: r.get("ready_s"), "s"),
        ("text encoding (prompt + negative), s", lambda r: _gen(r, 0).get("text"), "s"),
        ("step of the 1-step generation (the process's first), s",
         lambda r: (_gen(r, 0).get("steps") or [None])[0], "s"),
        (f"step of the {SPEED_STEPS}-step generation (median of its {SPEED_STEPS}), s",
         lambda r: statistics.median(_gen(r, 1)["steps"]) if _gen(r, 1).get("steps") else None, "s"),
        ("transformer alone, one CFG step (batch 2), s", lambda r: r.get("step_s"), "s"),
        ("VAE decode (the second), s", lambda r: _gen(r, 1).get("decode"), "s"),
        (f"whole {SPEED_STEPS}-step generation, s", lambda r: _gen(r, 1).get("total"), "s"),
        ("peak RSS, load + 1-step generation, MB", lambda r: r.get("peak_rss_gen_mb"), "mb"),
        ("process CPU time, transformer step, s", lambda r: r.get("step_cpu_s"), "s"))


def speed_table(raw: dict) -> list[str]:
    res = raw.get("results", {})
    cols = [c for c in COLUMNS if c[1] in res]
    lines = ["| measure | " + " | ".join(c[0] for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for name, get, kind in ROWS:
        cells = []
        for _, label, ref in cols:
            v = get(res[label])
            cell = _f(v, kind)
            if v is not None and ref in res and get(res[ref]):
                cell += f" ({v / get(res[ref]):.2f}x)"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def quality_table(raw: dict) -> list[str]:
    q = raw.get("quality") or {}
    lines = ["| against sdlite exact (fp32) | image PSNR, dB | largest pixel difference, /255 | latents' relative "
             "error |", "|---|---|---|---|"]
    for label, name in QUALITY.items():
        if label in q:
            e = q[label]
            resolved = raw.get("results", {}).get(label, {}).get("resolved")
            name += f" ({resolved['precision']})" if resolved else ""
            lines.append(f"| {name} | {_f(e['psnr_db'], 'db')} | {e['image_max_diff']} | "
                         f"{e['latents_rel_err']:.2e} |")
    return lines


def notes(raw: dict) -> list[str]:
    out = []
    for label, r in raw.get("results", {}).items():
        rv = r.get("resolved")
        if rv:
            n = rv.get("int8_layers")
            int8 = f"; {n} int8 layers in the transformer{'' if n else ' (sdlite quantizes a UNet only)'}" \
                if "int8" in rv["precision"] and n is not None else ""
            out.append(f"- {label}: precision {rv['precision']}, memory mode {rv['memory_mode']}; compute "
                       f"{rv['compute']}, text encoders {rv['text']}, VAE {rv['vae']}{int8}".replace("torch.", "")
                       + ".")
        if r.get("warm_cache", "all") != "all":
            what = "only its transformer's were" if r["warm_cache"] == "transformer" else "none were"
            out.append(f"- {label}: its files did not fit in the free memory: {what} read into the page cache first, "
                       "so the rest loaded from the disk (and, streamed in memory mode 0, may be read again).")
        for note in r.get("notes", []):
            out.append(f"- {label}: {_short(note)}")
        if r.get("error"):
            out.append(f"- {label}: {_short(r['error'])}")
    return out


def body(raw: dict, heading: str) -> list[str]:
    smoke, runs = raw.get("smoke"), [s for s in raw.get("sessions", []) if "loadavg_end" in s]
    fmt = lambda la: ", ".join(f"{x:.2f}" for x in la)
    load = " ".join(f"Run {i + 1} ({'; '.join(s['labels'])}): {s['wall_s'] / 60:.0f} min, load average (1, 5, 15 "
                    f"min) {fmt(s['loadavg_start'])} at the start, {fmt(s['loadavg_end'])} at the end."
                    for i, s in enumerate(runs))
    what = ("TINY random models of SD3.5's architecture (`--smoke`: this proves the script runs, its figures mean "
            "nothing; 512 and 1024 stand for 64 and 128 px)" if smoke else
            "full-size SD3.5 Medium (2.5B-parameter MMDiT-X) and SD3.5 Large (8.1B) checkpoints with CLIP-L, "
            "OpenCLIP bigG, T5-XXL (4.8B) and the 16-channel VAE, as diffusers folders of bf16 safetensors with random "
            "weights at the released shapes, built by `bench/sd3.py` into `bench/cache/`")
    lines = [
        f"{heading} SD3.5", "",
        f"sdlite on {what}. Each configuration runs in its own fresh process with {raw['threads']} torch threads, "
        "after the model's files (else its transformer's) were read once into the page cache where they fit in the "
        "free memory. Every "
        f"generation: the prompt and negative prompt of `bench/sd3.py`, euler, cfg {raw['cfg']:g} (so each step is "
        f"one transformer call on a batch of 2), seed {raw['seed']}, T5 included unless said.", "",
        f"Machine: {raw['machine']}", "",
        f"Command: `python bench/sd3.py{' --smoke' if smoke else ''}`. {load}",
        "", f"{heading}# Peak memory of a whole generation in memory mode 0", "",
        "sdlite, precision `auto` (bf16 compute on a CPU with native bf16), memory mode 0 (each network built when "
        "needed and freed after; the transformer and T5 streamed from the mapped files block by block): load, text "
        "encoding with T5, one CFG step, decode. Peak RSS is the process's, read right after that generation; the "
        "step is the process's first at that size.", "",
        *rss_table(raw), "",
        f"{heading}# Speed against diffusers: SD3.5 Medium, 512^2", "",
        f"A 1-step and a {SPEED_STEPS}-step generation per process, each step timed, then the transformer alone on "
        f"one CFG step (batch 2, random latents, context (2, {CONTEXT_TOKENS}, 4096), pooled (2, 2048)), a warm-up "
        f"then the median of {raw['step_repeat']}. Ratios are against diffusers in the same run at the same compute "
        "precision (lower is better): sdlite auto (resolved as the notes say) against diffusers bf16, sdlite exact "
        "(fp32) against diffusers fp32. diffusers runs whole (`enable_model_cpu_offload` needs an accelerator): in "
        "bf16 with T5 (about 16 GB); in fp32 only without T5 (`text_encoder_3=None, tokenizer_3=None`), as with it "
        "it would hold 10 GB of transformer, 19 GB of T5 and 3 GB of CLIP on a 24 GB machine. Without T5 diffusers "
        "puts 256 zero tokens in T5's place, so its steps run at the same shapes; its text encoding lacks T5's. "
        "sdlite exact runs in memory mode 0 for the same reason (mode 1 would hold the fp32 transformer beside T5, "
        "about 21 GB): its steps include up-casting the transformer's weights from the file block by block.", "",
        *speed_table(raw), "",
        f"{heading}# Precision of the default against exact", "",
        f"The {SPEED_STEPS}-step 512^2 generations above, same seed, against sdlite exact (fp32 compute throughout). "
        "The weights are random, so the images are noise and PSNR over them says little about what a trained model "
        "would show; the latents' relative error is the better measure here. For SD 1.x the meaningful PSNR is the "
        "one measured on the trained demo model (`bench/precision.py`); SD3 has no trained small sibling to measure "
        "so.", "",
        *quality_table(raw),
    ]
    n = notes(raw)
    if n:
        lines += ["", *n]
    return lines


def write_reports(raw: dict, md: Path, benchmarks: Path | None) -> None:
    md.write_text("\n".join(body(raw, "#")).rstrip() + "\n", encoding="utf-8")
    print(f"wrote {md.name}")
    if benchmarks is None:
        return
    section = [MARK_BEGIN, *body(raw, "##"), "", "Raw figures: `bench/sd3.json`; the report alone: `bench/sd3.md`.",
               MARK_END]
    text = benchmarks.read_text(encoding="utf-8") if benchmarks.is_file() else "# Benchmarks\n"
    begin, end = text.find(MARK_BEGIN), text.find(MARK_END)
    if begin >= 0 and end > begin:
        text = text[:begin] + "\n".join(section) + text[end + len(MARK_END):]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(section) + "\n"
    benchmarks.write_text(text, encoding="utf-8")
    print(f"wrote the SD3.5 section of {benchmarks.name}")


# --- the smoke run ----------------------------------------------------------------------------------------------

def smoke() -> int:
    """Tiny models through every path, in a temporary folder: the builder (shared parts, both models, sharded
    files, hard links, the single file), every configuration's process, the quality figures and the report. 0
    when all of it worked."""
    from sdlite.loader import open_model
    from sdlite.pipeline import Engine, Request

    torch.set_num_threads(THREADS)
    problems = []
    log = lambda m: print(m, flush=True)
    with tempfile.TemporaryDirectory(prefix="sd3-smoke-") as tmp_name:
        tmp = Path(tmp_name)
        folders = build(tmp / "cache", TINY, MODELS, True, shard_bytes=2**20, log=log)   # 1 MB: T5 is sharded
        if not list((folders["medium"] / "text_encoder_3").glob("model-0000*-of-*.safetensors")):
            problems.append("T5 was not sharded")
        if any(f.stat().st_nlink < 2 for f in (folders["large"] / "text_encoder_3").iterdir()):
            problems.append("the shared T5 was copied, not linked")
        ckpt = open_model(folders["single"] / "sd3.5_medium.safetensors")
        if ckpt.problems() or not {"text_encoder", "text_encoder_2", "text_encoder_3"} <= set(ckpt.sources):
            problems.append(f"the single file: {ckpt.problems()} {sorted(ckpt.sources)}")
        request = Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=2, cfg_scale=CFG, sampler="euler", seed=SEED,
                          width=64, height=64)
        a = Engine.load(ckpt, precision="exact").generate(request).latents
        b = Engine.load(folders["medium"], precision="exact").generate(request).latents
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
            problems.append(f"the single file differs from its folder: {float((a - b).abs().max()):.3g}")
        configs = plan_configs(MODELS, SIZES, SMOKE_PX)
        raw = {"smoke": True}
        measure(folders, list(configs), configs, raw, tmp / "out", tmp / "sd3.json", timeout_s=600, log=log)
        for label, res in raw["results"].items():
            if res.get("error"):
                problems.append(f"{label}: {res['error']}\n{res.get('stderr_tail', '')}")
            elif label in SPEED and "step_s" not in res:
                problems.append(f"{label}: no transformer step timed")
        if set(raw.get("quality") or {}) != set(QUALITY):
            problems.append(f"quality figures for {sorted(raw.get('quality') or {})} only")
        (tmp / "BENCHMARKS.md").write_text("# Benchmarks\n\nbefore\n")
        for _ in range(2):   # appended, then replaced in place
            write_reports(raw, tmp / "sd3.md", tmp / "BENCHMARKS.md")
        text = (tmp / "BENCHMARKS.md").read_text()
        if text.count(MARK_BEGIN) != 1 or "before" not in text:
            problems.append("the BENCHMARKS.md section was not written once between its markers")
        print((tmp / "sd3.md").read_text())
    for p in problems:
        print(f"SMOKE PROBLEM: {p}", file=sys.stderr)
    print("smoke: " + ("passed" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    all_labels = list(plan_configs(MODELS, SIZES, {s: s for s in SIZES}))
    ap.add_argument("--models", default="medium,large", help="medium, large or both (default)")
    ap.add_argument("--sizes", default="512,1024", help="the peak-memory sizes: 512, 1024 or both (default)")
    ap.add_argument("--only", default=None, help="configuration labels to measure, separated by ',' (the others are "
                                                 "kept from bench/sd3.json): " + ", ".join(all_labels))
    ap.add_argument("--build-only", action="store_true", help="build (or find) the checkpoints and stop")
    ap.add_argument("--report-only", action="store_true",
                    help="bench/sd3.md and the SD3.5 section of BENCHMARKS.md again from bench/sd3.json")
    ap.add_argument("--single-file", action="store_true",
                    help="also build Stability's single file of SD3.5 Medium with ComfyUI's encoder files (15 GB)")
    ap.add_argument("--smoke", action="store_true", help="tiny models, every path, in a temporary folder")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = ap.parse_args()
    if args.smoke:
        raise SystemExit(smoke())
    raw_file, md = HERE / "sd3.json", HERE / "sd3.md"
    if args.report_only:
        if not raw_file.is_file():
            raise SystemExit(f"no {raw_file.name} yet: run the benchmark first")
        return write_reports(json.loads(raw_file.read_text()), md, Path(args.out))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not models or set(models) - set(MODELS) or not sizes or set(sizes) - set(SIZES):
        raise SystemExit(f"--models takes {', '.join(MODELS)}; --sizes takes {', '.join(map(str, SIZES))}")
    configs = plan_configs(models, sizes, {s: s for s in SIZES})
    labels, raw = list(configs), {"results": {}}
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in configs]
        if unknown:
            raise SystemExit(f"unknown configuration {unknown[0]!r} for these models and sizes: expected one of "
                             f"{', '.join(configs)}")
        labels = [k for k in configs if k in wanted]
        if raw_file.is_file():
            raw = json.loads(raw_file.read_text())
    torch.set_num_threads(THREADS)
    folders = build(CACHE, FULL, models, args.single_file, log=lambda m: print(m, flush=True))
    if not args.build_only:
        measure(folders, labels, configs, raw, CACHE / "sd3-out", raw_file, log=lambda m: print(m, flush=True))
        write_reports(raw, md, Path(args.out))


if __name__ == "__main__":
    main()
