"""Z-Image-Turbo: sdlite against diffusers bf16 (``ZImagePipeline``) and stable-diffusion.cpp on the same files: load,
text encoding, per step, decode, the whole image and peak RSS; and sdlite's image against diffusers' (PSNR).

    python bench/zimage.py [--layers 30] [--text-layers 36] [--sizes 512[,1024]] [--steps 8] [--exact]
                           [--only LABEL,...] [--build-only] [--report-only] [--note TEXT] [--tiny]

The files (random weights at the released widths, built once by this script into ``bench/cache/zimage/``, bf16):
the transformer (``sdlite.config.zimage.ZIMAGE_TURBO``: 3840 wide, 30 joint blocks and 2 + 2 refiners, 6.15B
parameters), Qwen3-4B (``sdlite.config.qwen.QWEN3_4B``: 36 layers, 4.02B) and FLUX.1's VAE, each tensor ``randn *
0.02`` (norms at 1) from a generator seeded by its name, written tensor by tensor. They are laid out twice, hard
links wherever the bytes are the same:

* a diffusers ``ZImagePipeline`` folder (``z-image-turbo-L<n>-T<m>/``: the transformer in diffusers' names in 5 GiB
  shards, ``text_encoder/model.safetensors`` in transformers' names under ``model.``, the VAE, Qwen's tokenizer with
  Qwen3's chat template, the Turbo's scheduler), read by diffusers and sdlite;
* ComfyUI's split files (``split-L<n>-T<m>/``: ``z_image_turbo_bf16.safetensors`` in the original code's names via
  ``sdlite.weights.zimage_keys.zimage_to_comfy``, ``qwen_3_4b.safetensors`` (the same file as the folder's text
  encoder) and ``ae.safetensors`` in LDM names), read by sdlite (``Engine.load(transformer, text_encoders=[qwen,
  ae])``) and by stable-diffusion.cpp (``diffusion_model_path``, ``llm_path``, ``vae_path``: stable-diffusion-cpp-python
  from ``make setup-sdcpp``);
* GGUF (``gguf-L<n>-T<m>/``: ``z_image_turbo-Q4_K.gguf`` as city96's tools lay out a Q4_K file, arch ``lumina2``, the
  joint blocks' matrices Q4_K, other matrices F16, vectors F32; ``Qwen3-4B-Q4_K.gguf`` in llama.cpp's names, every
  matrix Q4_K, the token embedding included; the same ``ae.safetensors``), read by sdlite and stable-diffusion.cpp
  alike. The Q4_K blocks are random codes (bench/ggufs.py: the gguf package cannot quantise to Q4_K), not a
  quantisation of the bf16 weights: the shapes and bytes of a Q4_K file, other values.

The released model in bf16 is 12.3 GB of transformer and 8.0 GB of Qwen3: on a 24 GB machine a whole pipeline held in
memory (diffusers, sdlite memory mode 1, sd.cpp) does not fit beside anything. ``--layers N`` keeps N of the 30 joint
blocks (the widths and the 2 + 2 refiners as released), ``--text-layers M`` M of Qwen3's 36 layers; every engine runs
the same depth and the report says which. stable-diffusion.cpp builds Z-Image's transformer at the released depth
(``ZImageParams`` in its ``z_image.hpp``) and reads Qwen3's hidden layer 35 (``conditioner.hpp``), so its rows run at
the released depth only and say so otherwise.

Each configuration runs in its own fresh process with 2 threads, after its files were read into the page cache where
they fit in the free memory (else its transformer's alone): load, then one generation (the prompt below, Euler,
``--steps`` steps, cfg 1 (diffusers' ``guidance_scale`` 0) as the Turbo runs, seed 42) at each size. Step times are
each engine's own per-step callbacks (sd.cpp's text encoding and decode from its log); peak RSS the child's
``VmHWM``. The parent watches each child's memory and stops one that would take the machine's last
MIN_AVAILABLE_MB, or that runs past ``--timeout``. Raw figures to bench/zimage.json (after every child; ``--only``
re-measures some configurations and keeps the others), the report to bench/zimage.md and the section "Z-Image-Turbo"
of BENCHMARKS.md between its markers (``--report-only``: both again from bench/zimage.json).

``--tiny`` builds a tiny random model of the same structure in a temporary folder (the layout, the shards, the links,
the ComfyUI conversion) and runs every path end to end in a minute or two; it writes nothing under bench/ and prints
its report (512 and 1024 stand for 64 and 128 px).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))   # bench/sd3.py, bench/sdxl.py, bench/startup.py, bench/run.py
sys.path.insert(1, str(ROOT))   # sdlite, tests/

from ggufs import city96_q4_k, quantisable, qwen3_fields, write_gguf  # noqa: E402
from sd3 import (  # noqa: E402
    SHARD_BYTES, _atomic, _check_disk, _Files, _link, _nbytes, _random_items, _write_file, _write_weights, psnr,
)
from sdxl import MIN_AVAILABLE_MB, _meminfo_mb, _oom_killed, _rss_mb  # noqa: E402
from startup import warm_page_cache  # noqa: E402

from sdlite.config.qwen import QWEN3_4B, QwenConfig  # noqa: E402
from sdlite.config.zimage import ZIMAGE_TURBO, ZIMAGE_TURBO_SCHEDULER, ZIMAGE_VAE  # noqa: E402

CACHE = HERE / "cache" / "zimage"
RAW, REPORT = HERE / "zimage.json", HERE / "zimage.md"
MARK_BEGIN, MARK_END = "<!-- zimage:begin (written by bench/zimage.py) -->", "<!-- zimage:end -->"
SDCPP_PYTHON = ROOT / ".venv-sdcpp" / "bin" / "python"
QWEN_JSON = ROOT / "sdlite" / "data" / "qwen" / "tokenizer.json"
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED, THREADS, STEPS = 42, 2, 8
SIZES = (512, 1024)
TINY_PX = {512: 64, 1024: 128}
CHILD_TIMEOUT_S = 3 * 3600
SPLIT = {"transformer": "z_image_turbo_bf16.safetensors", "text": "qwen_3_4b.safetensors", "vae": "ae.safetensors"}
GGUF = {"transformer": "z_image_turbo-Q4_K.gguf", "text": "Qwen3-4B-Q4_K.gguf", "vae": "ae.safetensors"}
REF = "diffusers bf16"
EXACT = "sdlite exact mode0"

# label -> what runs: the engine, the files it reads ("folder": the diffusers folder, "split": ComfyUI's files)
CONFIGS = {
    REF: dict(engine="diffusers", files="folder"),
    "diffusers bf16 text first": dict(engine="diffusers", files="folder", text_first=True),
    "sdlite auto mode1": dict(engine="sdlite", files="folder", precision="auto", memory_mode=1),
    "sdlite auto mode0": dict(engine="sdlite", files="folder", precision="auto", memory_mode=0),
    "sdlite auto mode1 split": dict(engine="sdlite", files="split", precision="auto", memory_mode=1),
    "sdlite int8 mode1": dict(engine="sdlite", files="folder", precision="int8", memory_mode=1),   # weight-only
    "sdlite bf16-int8 mode1": dict(engine="sdlite", files="folder", precision="bf16-int8", memory_mode=1),  # W8A8
    EXACT: dict(engine="sdlite", files="folder", precision="exact", memory_mode=0),   # with --exact
    "sd.cpp bf16": dict(engine="sdcpp", files="split"),
    "sdlite gguf mode1": dict(engine="sdlite", files="gguf", precision="auto", memory_mode=1),
    "sdlite gguf mode0": dict(engine="sdlite", files="gguf", precision="auto", memory_mode=0),
    "sd.cpp q4_k": dict(engine="sdcpp", files="gguf"),
}
DEFAULT = [k for k in CONFIGS if k != EXACT and not CONFIGS[k].get("text_first")]   # text first: by --only

# the tiny model of --tiny: tests/test_zimage_pipeline.py's structure, with 2 + 2 refiners and heads 128 wide as
# released (a ComfyUI file cannot say its rotary axes: sdlite takes the release's, which need those heads)
TINY = dict(
    transformer=dataclasses.replace(ZIMAGE_TURBO, dim=256, n_layers=2, n_refiner_layers=2, n_heads=2, n_kv_heads=2,
                                    cap_feat_dim=32),
    text=QwenConfig(vocab_size=151936, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024),
    vae=dataclasses.replace(ZIMAGE_VAE, block_channels=(32, 64, 64, 64), layers_per_block=1, sample_size=64))


def networks(layers: int | None, text_layers: int | None, tiny: bool = False) -> dict:
    """The three networks' configs at the depth asked for (None: as released, or as the tiny model has it)."""
    base = TINY if tiny else dict(transformer=ZIMAGE_TURBO, text=QWEN3_4B, vae=ZIMAGE_VAE)
    transformer, text = base["transformer"], base["text"]
    if layers is not None:
        transformer = dataclasses.replace(transformer, n_layers=layers)
    if text_layers is not None:
        if text_layers < 2:
            raise SystemExit("--text-layers must be 2 or more: Z-Image reads the second-to-last hidden state")
        text = dataclasses.replace(text, num_hidden_layers=text_layers)
    return dict(transformer=transformer, text=text, vae=base["vae"])


def released(nets: dict) -> bool:
    return nets["transformer"] == ZIMAGE_TURBO and nets["text"] == QWEN3_4B


# --- the files ---------------------------------------------------------------------------------------------------

def _meta(nets: dict) -> dict:
    """Each network as diffusers / transformers build it, on the meta device: part -> (module, config.json text)."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    text_cfg = {k: v for k, v in nets["text"].to_transformers().items()
                if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        transformer = ZImageTransformer2DModel(**{k: v for k, v in nets["transformer"].to_diffusers().items()
                                                  if k != "_class_name"})
        vae = AutoencoderKL(**{k: v for k, v in nets["vae"].to_diffusers().items() if k != "_class_name"})
        text = Qwen3Model(Qwen3Config(**text_cfg))
    text.config.architectures = ["Qwen3Model"]
    text.config.dtype = torch.bfloat16
    return {"transformer": (transformer, transformer.to_json_string()), "vae": (vae, vae.to_json_string()),
            "text_encoder": (text, text.config.to_json_string())}


def _converted(src: _Files, plan) -> list:
    """``src``'s tensors as ``plan`` names them (tensor by tensor, bf16)."""
    if plan.missing or plan.unexpected:
        raise RuntimeError(plan.report())
    shapes, view = plan.shapes(src.shapes), plan.apply(src)
    return [(k, shapes[k], torch.bfloat16, lambda k=k: view[k]) for k in sorted(plan.entries)]


def _single(path: Path, items) -> Path:
    """One .safetensors file, written beside its final name and renamed: complete or absent."""
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            _write_file(tmp, items)
            os.rename(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def build(root: Path, nets: dict, shard_bytes: int = SHARD_BYTES, log=print) -> dict:
    """The diffusers folder and the split files of ``nets`` under ``root`` (each part written once, per depth):
    {"folder": path, "split": {"transformer"|"text"|"vae": path}, "params": {part: count}}."""
    import diffusers
    from transformers import Qwen2TokenizerFast

    from sdlite.weights.qwen_keys import llama_cpp_name
    from sdlite.weights.vae_keys import vae_to_original
    from sdlite.weights.zimage_keys import zimage_to_comfy
    from tests.test_qwen import QWEN3_CHAT_TEMPLATE

    t0 = time.perf_counter()
    tag = f"L{nets['transformer'].n_layers}-T{nets['text'].num_hidden_layers}"
    parts_dir = root / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    meta = _meta(nets)
    params = {name: sum(math.prod(v.shape) for v in module.state_dict().values())
              for name, (module, _) in meta.items()}
    names = {"transformer": f"transformer-L{nets['transformer'].n_layers}",
             "text_encoder": f"text_encoder-T{nets['text'].num_hidden_layers}", "vae": "vae"}

    def part(name: str) -> Path:
        module, config = meta[name]
        items = _random_items(module, seed=f"zimage/{name}")
        if name == "text_encoder":   # transformers' causal-LM names, as ComfyUI's qwen_3_4b.safetensors has them
            items = [("model." + k, *rest) for k, *rest in items]

        def fill(tmp: Path):
            _check_disk(tmp.parent, _nbytes(items), names[name])
            t = time.perf_counter()
            log(f"writing {names[name]} ({params[name] / 1e9:.2f}B parameters, {_nbytes(items) / 1e9:.2f} GB)")
            (tmp / "config.json").write_text(config + ("" if config.endswith("\n") else "\n"))
            if name == "text_encoder":   # one file, so the split layout's qwen_3_4b.safetensors is the same file
                _write_file(tmp / "model.safetensors", items)
            else:
                _write_weights(tmp, "diffusion_pytorch_model", items, shard_bytes)
            log(f"  {names[name]}: {time.perf_counter() - t:.0f} s")
        return _atomic(parts_dir / names[name], fill)

    stores = {name: part(name) for name in ("transformer", "text_encoder", "vae")}
    comfy = parts_dir / f"z_image_turbo-L{nets['transformer'].n_layers}_bf16.safetensors"
    if not comfy.is_file():
        src = _Files(stores["transformer"])
        items = _converted(src, zimage_to_comfy(src.where))
        _check_disk(parts_dir, _nbytes(items), comfy.name)
        log(f"writing {comfy.name} (ComfyUI's names, {_nbytes(items) / 1e9:.2f} GB)")
        _single(comfy, items)
    vae = _Files(stores["vae"])
    # BFL's ae.safetensors as published: LDM names without a prefix (sd.cpp adds its own first_stage_model.)
    ae = _single(parts_dir / "ae.safetensors", _converted(vae, vae_to_original(vae.where, prefix="")))

    def fill_folder(tmp: Path):
        for sub, store in (("transformer", stores["transformer"]), ("text_encoder", stores["text_encoder"]),
                           ("vae", stores["vae"])):
            for f in sorted(p for p in store.iterdir() if p.is_file()):
                _link(f, tmp / sub / f.name)
        tokenizer = Qwen2TokenizerFast(tokenizer_file=str(QWEN_JSON))
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        (tmp / "scheduler").mkdir()
        scheduler = {**ZIMAGE_TURBO_SCHEDULER, "_diffusers_version": diffusers.__version__}
        (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2) + "\n")
        index = {"_class_name": "ZImagePipeline", "_diffusers_version": diffusers.__version__,
                 "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                 "text_encoder": ["transformers", "Qwen3Model"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
                 "transformer": ["diffusers", "ZImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")

    def fill_split(tmp: Path):
        _link(comfy, tmp / SPLIT["transformer"])
        _link(stores["text_encoder"] / "model.safetensors", tmp / SPLIT["text"])
        _link(ae, tmp / SPLIT["vae"])

    def fill_gguf(tmp: Path):
        t = time.perf_counter()
        log(f"writing {GGUF['transformer']} and {GGUF['text']} ({tag})")
        write_gguf(tmp / GGUF["transformer"], "lumina2", [(k, s, m) for k, s, _, m in _Files(comfy).items(None)],
                   lambda n, s: city96_q4_k(n, s, ("layers.",)))   # the joint blocks
        write_gguf(tmp / GGUF["text"], "qwen3",
                   [(llama_cpp_name(k.removeprefix("model.")), s, m)
                    for k, s, _, m in _Files(stores["text_encoder"] / "model.safetensors").items(None)],
                   lambda n, s: "Q4_K" if quantisable(s, "Q4_K") else "F32", qwen3_fields(nets["text"]))
        _link(ae, tmp / GGUF["vae"])
        log(f"  GGUF files: {time.perf_counter() - t:.0f} s")

    folder = _atomic(root / f"z-image-turbo-{tag}", fill_folder)
    split = _atomic(root / f"split-{tag}", fill_split)
    gguf = _atomic(root / f"gguf-{tag}", fill_gguf)
    log(f"files ready in {time.perf_counter() - t0:.0f} s: {folder.name}/, {split.name}/, {gguf.name}/")
    return {"folder": folder, "split": {k: split / v for k, v in SPLIT.items()},
            "gguf": {k: gguf / v for k, v in GGUF.items()}, "params": params}


# --- the runs ----------------------------------------------------------------------------------------------------

_COMMON = r"""
import json, sys, time
t_start = time.perf_counter()
cfg = json.loads(sys.argv[1])
now = time.perf_counter
out = {"notes": []}

def peak_mb():   # this process's own high-water mark (ru_maxrss can carry the parent's across vfork and exec)
    return next(int(ln.split()[1]) / 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))

def report():
    out["peak_rss_mb"] = peak_mb()
    print("RESULT " + json.dumps(out), flush=True)

def failed(what, e):
    import traceback
    frame = traceback.extract_tb(e.__traceback__)[-1]
    out["error"] = (f"{what} failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]} "
                    f"(raised in {frame.name}, {frame.filename.split('site-packages/')[-1]}:{frame.lineno})")
    report(); sys.exit(0)

durations = lambda start, ends: [b - a for a, b in zip([start, *ends], ends)]
size, steps = cfg["size"], cfg["steps"]
"""

TORCH_CHILD = _COMMON + r"""
import os
import numpy as np
import torch
torch.set_num_threads(cfg["threads"])
out["threads"] = torch.get_num_threads()
try:
    if cfg["engine"] == "diffusers":
        import diffusers, transformers
        from diffusers import ZImagePipeline
        out["versions"] = {m.__name__: m.__version__ for m in (diffusers, transformers, torch)}
        # text_first: the text encoder alone (no transformer, no VAE), then freed and the rest loaded, as a whole
        # released pipeline (12.3 GB of transformer beside 8 GB of Qwen3) does not fit in 24 GB with its activations
        first = dict(transformer=None, vae=None) if cfg.get("text_first") else {}
        pipe = ZImagePipeline.from_pretrained(cfg["folder"], dtype=torch.bfloat16, local_files_only=True, **first)
        pipe.set_progress_bar_config(disable=True)
        out["resolved"] = {n: str(getattr(pipe, n).dtype).removeprefix("torch.")
                           for n in ("transformer", "text_encoder", "vae") if getattr(pipe, n) is not None}
        marks, encode = {}, pipe.encode_prompt
        def timed_encode(*a, **k):
            t = now(); r = encode(*a, **k); marks.update(text_end=now(), text=now() - t); return r
        pipe.encode_prompt = timed_encode
        def generate():
            ends, held = [], {}
            def step_end(p, i, t, kw):
                ends.append(now()); held["latents"] = kw["latents"]; return kw
            t0 = now()
            call, reload_s = pipe, 0.0
            if first:
                import gc
                embeds, _ = pipe.encode_prompt(cfg["prompt"], do_classifier_free_guidance=False)
                pipe.text_encoder = None
                gc.collect()
                t = now()
                call = type(pipe).from_pretrained(cfg["folder"], text_encoder=None, tokenizer=None,
                                                  dtype=torch.bfloat16, local_files_only=True)
                call.set_progress_bar_config(disable=True)
                reload_s = now() - t
                out["ready_s"] += reload_s   # loading, not generating
                out["resolved"].update({n: str(getattr(call, n).dtype).removeprefix("torch.")
                                        for n in ("transformer", "vae")})
                marks["text_end"] = now()
            args = dict(prompt=cfg["prompt"]) if not first else dict(prompt=None, prompt_embeds=embeds)
            img = call(**args, height=size, width=size, num_inference_steps=steps, guidance_scale=0.0,
                       generator=torch.Generator().manual_seed(cfg["seed"]), callback_on_step_end=step_end,
                       output_type="np").images[0]
            t1 = now()
            timing = {"text": marks["text"], "steps": durations(marks["text_end"], ends), "decode": t1 - ends[-1],
                      "total": t1 - t0 - reload_s}
            return timing, np.round(np.clip(img, 0, 1) * 255).astype(np.uint8), held["latents"].float()
    else:
        from sdlite.pipeline import Engine, Request
        if cfg["files"] == "folder":
            engine = Engine.load(cfg["folder"], precision=cfg["precision"], memory_mode=cfg["memory_mode"])
        else:
            f = cfg[cfg["files"]]
            engine = Engine.load(f["transformer"], text_encoders=[f["text"], f["vae"]], precision=cfg["precision"],
                                 memory_mode=cfg["memory_mode"])
        m = engine.models
        out["resolved"] = {"precision": engine.precision.label, "memory_mode": m.mode,
                           **{n: str(m.dtype_of(n)).removeprefix("torch.")
                              for n in ("transformer", "text_encoder", "vae")}}
        def generate():
            ends = []
            t0 = now()
            with torch.no_grad():
                res = engine.generate(Request(prompt=cfg["prompt"], width=size, height=size, steps=steps,
                                              cfg_scale=1.0, sampler="euler", seed=cfg["seed"]),
                                      callback=lambda i, n: ends.append(now()))
            t1 = now()
            timing = {"text": res.timings["text"], "steps": durations(t0 + res.timings["text"], ends[-steps:]),
                      "decode": res.timings["decode"], "total": t1 - t0}
            out["notes"] += [w for w in res.warnings if w not in out["notes"]]
            return timing, np.asarray(res.images[0].convert("RGB")), res.latents.float()
except Exception as e:
    failed("loading", e)
out["ready_s"] = now() - t_start
out["rss_ready_mb"] = peak_mb()
try:
    timing, image, latents = generate()
except Exception as e:
    failed(f"the {steps}-step {size}^2 generation", e)
out.update(timing)
if not torch.isfinite(latents).all():
    out["notes"].append("the latents are not all finite")
np.savez(os.path.join(cfg["artifacts"], cfg["slug"] + ".npz"), image=image, latents=latents.numpy())
report()
"""

SDCPP_CHILD = _COMMON + r"""
import inspect
from importlib.metadata import version
from stable_diffusion_cpp import StableDiffusion
out["versions"] = {"stable-diffusion-cpp-python": version("stable-diffusion-cpp-python")}
if "llm_path" not in inspect.signature(StableDiffusion.__init__).parameters:
    out["skipped"] = (f"stable-diffusion-cpp-python {out['versions']['stable-diffusion-cpp-python']} takes no "
                      "llm_path (Z-Image's Qwen3 text encoder)")
    report(); sys.exit(0)
f = cfg[cfg["files"]]
try:
    sd = StableDiffusion(diffusion_model_path=f["transformer"], llm_path=f["text"], vae_path=f["vae"],
                         n_threads=cfg["threads"], verbose=True)   # verbose: its log gives text and decode times
except Exception as e:
    failed("loading", e)
out["ready_s"] = now() - t_start
out["rss_ready_mb"] = peak_mb()
calls = []
t0 = now()
try:
    images = sd.generate_image(prompt=cfg["prompt"], cfg_scale=1.0, sample_method="euler", sample_steps=steps,
                               seed=cfg["seed"], width=size, height=size,
                               progress_callback=lambda step, n, t: calls.append((step, n, t, now())))
except Exception as e:
    failed(f"the {steps}-step {size}^2 generation", e)
t1 = now()
sampling = [c for c in calls if c[1] == steps][-steps:]
out["total"] = t1 - t0
out["steps"] = [c[2] for c in sampling]
if sampling:   # estimates, replaced by the parent with the log's figures where it has them
    out["text"] = sampling[0][3] - sampling[0][2] - t0
    out["decode"] = t1 - sampling[-1][3]
if not images:
    out["error"] = "generate_image returned no image"
report()
"""

# its log gives "taking 1234 ms" in some versions and "taking 1.23s" in others (0.4.7)
_SDCPP_LOG = {"text": "get_learned_condition", "vae_encode": "encode_first_stage", "decode": "decode_first_stage"}


def sdcpp_log_times(stderr: str) -> dict:
    """stable-diffusion.cpp's own text-encoding, VAE-encode and decode times from its log (the last of each)."""
    out = {}
    for key, stage in _SDCPP_LOG.items():
        found = re.findall(stage + r" completed, taking ([\d.]+)\s*(ms|s)\b", stderr)
        if found:
            value, unit = found[-1]
            out[key] = float(value) * (1e-3 if unit == "ms" else 1.0)
    return out


def sdcpp_skip(nets: dict, tiny: bool) -> str | None:
    """Why the sd.cpp rows cannot run here, or None."""
    if tiny or not released(nets):
        return ("stable-diffusion.cpp builds Z-Image's transformer at the released shapes (30 joint blocks 3840 wide: "
                "ZImageParams in z_image.hpp) and reads Qwen3's hidden layer 35 (conditioner.hpp): it runs the "
                "released depth only (--layers 30 --text-layers 36)")
    if not SDCPP_PYTHON.is_file():
        return f"{SDCPP_PYTHON.relative_to(ROOT)} is missing (make setup-sdcpp builds it)"
    return None


def _warm(paths: list[Path], transformer: Path) -> str:
    """Read the files into the page cache where they fit in 80% of the free memory, else the transformer's alone."""
    free = _meminfo_mb()["MemAvailable"] * 2**20 * 0.8
    size = lambda ps: sum(f.stat().st_size for p in ps for f in ([p] if p.is_file() else p.rglob("*"))
                          if f.is_file())
    for what, ps in (("all", paths), ("transformer", [transformer])):
        if size(ps) < free:
            for p in ps:
                warm_page_cache(p)
            return what
    return "none"


def run_child(label: str, size: int, px: int, files: dict, steps: int, artifacts: Path, timeout_s: float) -> dict:
    """One configuration at one size in a fresh process, its resident memory watched."""
    c = CONFIGS[label]
    python = SDCPP_PYTHON if c["engine"] == "sdcpp" else Path(sys.executable)
    cfg = {**c, "label": label, "size": px, "steps": steps, "prompt": PROMPT, "seed": SEED, "threads": THREADS,
           "folder": str(files.get("folder", "")), "artifacts": str(artifacts), "slug": slug(label, size),
           **{layout: {k: str(v) for k, v in files[layout].items()} for layout in ("split", "gguf") if layout in files}}
    if c["files"] == "folder":
        paths, transformer = [files["folder"]], files["folder"] / "transformer"
    else:
        paths, transformer = list(files[c["files"]].values()), files[c["files"]]["transformer"]
    t = time.perf_counter()
    warm = _warm(paths, transformer)
    warm_s = time.perf_counter() - t
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    load_before = os.getloadavg()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([str(python), "-c", SDCPP_CHILD if c["engine"] == "sdcpp" else TORCH_CHILD,
                                 json.dumps(cfg)], stdout=out, stderr=err, env=env, cwd=str(ROOT))
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
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
    if c["engine"] == "sdcpp":
        res.update(sdcpp_log_times(stderr))
    if stopped:
        res["error"] = stopped
    elif proc.returncode == -9 and _oom_killed(proc.pid):
        res["error"] = (f"killed by the kernel's out-of-memory killer at about {sampled:.0f} MB resident, other "
                        f"processes holding up to {others:.0f} MB")
    elif proc.returncode or not lines:
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        res["error"] = f"failed (exit {proc.returncode}): " + (tail[-1] if tail else "no output")
    if res.get("error") and stderr.strip():
        res["stderr_tail"] = stderr[-3000:]
    res.update(wall_s=wall, warm_cache=warm, warm_cache_s=warm_s, sampled_peak_rss_mb=sampled,
               others_peak_mb=others, loadavg_before=load_before, loadavg_after=os.getloadavg())
    return res


def slug(label: str, size: int) -> str:
    return f"{label.replace(' ', '_')}-{size}"


def quality(artifacts: Path, sizes) -> dict:
    """Per size, each sdlite image against diffusers' (and sdlite exact's, where it ran): PSNR, the largest pixel
    difference, the latents' relative error."""
    out = {}
    for size in sizes:
        names = [k for k in CONFIGS if CONFIGS[k]["engine"] == "diffusers"] + [EXACT]
        refs = {name: np.load(f) for name in names if (f := artifacts / f"{slug(name, size)}.npz").is_file()}
        # not the GGUF rows: their Q4_K codes are random, other weights than the bf16 files' (bench/ggufs.py)
        for label in [k for k in CONFIGS if CONFIGS[k]["engine"] == "sdlite" and CONFIGS[k]["files"] != "gguf"]:
            f = artifacts / f"{slug(label, size)}.npz"
            if not f.is_file():
                continue
            got = np.load(f)
            for name, ref in refs.items():
                if name == label or got["image"].shape != ref["image"].shape:
                    continue
                la, lb = got["latents"].astype(np.float64), ref["latents"].astype(np.float64)
                diff = np.abs(got["image"].astype(int) - ref["image"].astype(int))
                out.setdefault(str(size), {}).setdefault(label, {})[name] = {
                    "psnr_db": psnr(got["image"], ref["image"]), "image_max_diff": int(diff.max()),
                    "latents_rel_err": float(np.linalg.norm(la - lb) / np.linalg.norm(lb))
                    if la.shape == lb.shape and np.linalg.norm(lb) > 0 else None}
    return out


def measure(files: dict, nets: dict, labels: list[str], sizes: list[int], raw: dict, args, artifacts: Path,
            raw_file: Path | None, tiny: bool = False, log=print) -> None:
    """Each configuration of ``labels`` at each size in its own process; ``raw`` (and ``raw_file``) after each."""
    artifacts.mkdir(parents=True, exist_ok=True)
    skip = sdcpp_skip(nets, tiny)
    t0 = time.perf_counter()
    for size in sizes:
        px = TINY_PX[size] if tiny else size
        for label in labels:
            results = raw.setdefault("results", {}).setdefault(str(size), {})
            if CONFIGS[label]["engine"] == "sdcpp" and skip:
                results[label] = {"skipped": skip}
                log(f"{label} {size}^2: skipped: {skip}")
                continue
            (artifacts / f"{slug(label, size)}.npz").unlink(missing_ok=True)
            log(f"{label} {size}^2: running (load average {os.getloadavg()[0]:.2f})")
            res = run_child(label, size, px, files, args.steps, artifacts, args.timeout)
            results[label] = res
            shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()
                     if k not in ("stderr_tail", "steps")}
            log(f"{label} {size}^2: {json.dumps(shown)[:600]}")
            raw["quality"] = {**raw.get("quality", {}), **quality(artifacts, [size])}
            raw["meta"]["wall_s"] = time.perf_counter() - t0
            raw["meta"]["loadavg_end"] = os.getloadavg()
            if raw_file is not None:
                raw_file.write_text(json.dumps(raw, indent=1) + "\n")


# --- the report --------------------------------------------------------------------------------------------------

def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _fmt(v: float, kind: str = "s") -> str:
    return f"{v:.0f}" if kind == "mb" else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _short(text: str, n: int = 300) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= n else text[:n - 3] + "..."


def _depth(meta: dict) -> str:
    d, p = meta["depth"], meta["params"]
    b = lambda n: f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    what = (f"the transformer with {d['layers']} joint blocks and {d['refiner_layers']} + {d['refiner_layers']} "
            f"refiners, {d['width']} wide ({b(p['transformer'])} parameters), Qwen3 with {d['text_layers']} layers "
            f"({b(p['text_encoder'])}), the VAE ({b(p['vae'])})")
    if meta.get("tiny"):
        return f"TINY random models of Z-Image-Turbo's structure (`--tiny`: {what})"
    if d["released"]:
        return f"Z-Image-Turbo at its released depth and widths: {what}"
    return (f"Z-Image-Turbo at a REDUCED depth, the released widths: {what}, against the release's 30 joint blocks "
            "(6.15B) and Qwen3-4B's 36 layers (4.02B)")


def size_table(raw: dict, size: str) -> list[str]:
    res = raw["results"].get(size, {})
    labels = [k for k in CONFIGS if k in res and "skipped" not in res[k]]
    if not labels:
        return []
    steps = raw["meta"]["steps"]
    lines = ["| measure | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    rows = (("load to ready, s", lambda r: r["ready_s"], "s"),
            ("text encoding, s", lambda r: r["text"], "s"),
            (f"step (median of {steps}), s", lambda r: _median(r["steps"]), "s"),
            ("decode, s", lambda r: r["decode"], "s"),
            (f"whole {steps}-step image, s", lambda r: r["total"], "s"),
            ("peak RSS, MB", lambda r: r["peak_rss_mb"], "mb"))
    # ratios against diffusers (its whole pipeline, else its text-first row) and, for sdlite on the split or GGUF
    # files, against stable-diffusion.cpp on the same files
    ref = next((k for k in CONFIGS if CONFIGS[k]["engine"] == "diffusers" and "error" not in res.get(k, {"error": 1})),
               None)
    sdcpp = {CONFIGS[k]["files"]: k for k in labels if CONFIGS[k]["engine"] == "sdcpp" and "error" not in res[k]}

    def ratio(v, other, get, what=""):
        try:
            return f"{v / get(res[other]):.2f}x{what}"
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
            return None

    for name, get, kind in rows:
        cells = []
        for label in labels:
            try:
                v = get(res[label])
            except (KeyError, IndexError, TypeError, ValueError):
                cells.append("failed" if "error" in res[label] else "-")
                continue
            ratios = [ratio(v, ref, get) if ref and label != ref else None]
            if CONFIGS[label]["engine"] == "sdlite" and CONFIGS[label]["files"] in sdcpp:
                ratios.append(ratio(v, sdcpp[CONFIGS[label]["files"]], get, " sd.cpp"))
            ratios = [r for r in ratios if r]
            cells.append(_fmt(v, kind) + (f" ({', '.join(ratios)})" if ratios else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def quality_table(raw: dict, px) -> list[str]:
    q = raw.get("quality") or {}
    lines = ["| image, size | against | PSNR, dB | largest pixel difference, /255 | latents' relative error |",
             "|---|---|---|---|---|"]
    for size in sorted(q, key=int):
        for label in [k for k in CONFIGS if k in q[size]]:
            resolved = raw["results"].get(size, {}).get(label, {}).get("resolved", {})
            name = label + (f" ({resolved['precision']})" if resolved.get("precision") else "")
            for ref, e in q[size][label].items():
                err = "-" if e["latents_rel_err"] is None else f"{e['latents_rel_err']:.2e}"
                lines.append(f"| {name}, {px(size)}^2 | {ref} | {e['psnr_db']:.1f} | {e['image_max_diff']} | "
                             f"{err} |")
    return lines if len(lines) > 2 else []


def notes(raw: dict, px) -> list[str]:
    out = []
    for size in sorted(raw.get("results", {}), key=int):
        for label, r in raw["results"][size].items():
            where = f"{label}, {px(size)}^2"
            if "skipped" in r:
                line = f"- {label}: skipped: {_short(r['skipped'])}."
                out += [] if line in out else [line]
                continue
            if r.get("resolved"):
                out.append(f"- {where}: " + ", ".join(f"{k} {v}" for k, v in r["resolved"].items()) + ".")
            if r.get("warm_cache", "all") != "all":
                what = "only its transformer's were" if r["warm_cache"] == "transformer" else "none were"
                out.append(f"- {where}: its files did not fit in the free memory: {what} read into the page cache "
                           "first, so the rest loaded from the disk.")
            out += [f"- {where}: {_short(n)}" for n in r.get("notes", [])]
            if r.get("error"):
                out.append(f"- {where}: {_short(r['error'])}")
    return out


def body(raw: dict, h: str) -> list[str]:
    meta = raw["meta"]
    px = (lambda s: TINY_PX[int(s)]) if meta.get("tiny") else int
    la = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
    lines = [
        f"{h} Z-Image-Turbo", "",
        f"{_depth(meta)}; random bf16 weights built by `bench/zimage.py` into "
        f"{'a temporary folder' if meta.get('tiny') else '`bench/cache/zimage/`'} as a diffusers "
        "`ZImagePipeline` folder (read by diffusers and by sdlite) and as ComfyUI's split files "
        "(`z_image_turbo_bf16`, `qwen_3_4b`, `ae`: read by sdlite's `split` row and by stable-diffusion.cpp), and "
        "as GGUF (`z_image_turbo-Q4_K.gguf`: the joint blocks' matrices Q4_K, the rest F16/F32; `Qwen3-4B-Q4_K.gguf` "
        "in llama.cpp's names, every matrix Q4_K; random Q4_K codes, not a quantisation of the bf16 weights: read "
        "by sdlite's `gguf` rows and by sd.cpp's `q4_k` row). "
        f"{meta['steps']} Euler steps, cfg 1 (diffusers' `guidance_scale` 0) as the Turbo runs, seed {SEED}, "
        f"{THREADS} threads, each configuration and size in a fresh process, after its files were read into the page "
        "cache where they fit. Step times are each engine's own per-step callbacks (medians); stable-diffusion.cpp's "
        "text encoding and decode are its log's. Ratios are against diffusers bf16 in the same run (its whole "
        "pipeline, else its `text first` row: the text encoder loaded alone and freed before the transformer and the "
        "VAE are), and for sdlite on the split or GGUF files `x sd.cpp` against stable-diffusion.cpp on the same files "
        "(lower is better). "
        f"stable-diffusion-cpp-python {meta.get('sdcpp_version') or 'not installed'}.", "",
        f"Machine: {meta['machine']}", "",
        f"Command: `{meta['command']}`, run {meta['date']}: {meta.get('wall_s', 0) / 60:.0f} min, load average "
        f"{la(meta['loadavg_start'])} at the start, {la(meta.get('loadavg_end', meta['loadavg_start']))} at the end."
        + (f" {meta['note']}" if meta.get("note") else ""), ""]
    for size in sorted(raw.get("results", {}), key=int):
        table = size_table(raw, size)
        if table:
            lines += [f"{h}# {px(size)}x{px(size)}", "", *table, ""]
    q = quality_table(raw, px)
    if q:
        lines += [f"{h}# sdlite's image against diffusers'", "",
                  "The same seed's images and final latents. The weights are random, so the images are noise and "
                  "PSNR over them says less than it would for a trained model; the latents' relative error is the "
                  "steadier figure. sd.cpp draws its noise with its own generator, so its image is not compared.", "",
                  *q, ""]
    n = notes(raw, px)
    return lines + n if n else lines[:-1]


def write_reports(raw: dict, md: Path, benchmarks: Path) -> None:
    md.write_text("\n".join(body(raw, "#")).rstrip() + "\n", encoding="utf-8")
    section = "\n".join([MARK_BEGIN, *body(raw, "##"), "", "Raw figures: `bench/zimage.json`; the report alone: "
                         "`bench/zimage.md`.", MARK_END])
    text = benchmarks.read_text(encoding="utf-8") if benchmarks.is_file() else "# Benchmarks\n"
    begin, end = text.find(MARK_BEGIN), text.find(MARK_END)
    text = text[:begin] + section + text[end + len(MARK_END):] if 0 <= begin < end else \
        text.rstrip("\n") + "\n\n" + section + "\n"
    benchmarks.write_text(text, encoding="utf-8")
    print(f"wrote {md.name} and the Z-Image-Turbo section of {benchmarks.name}")


# --- the tiny run ------------------------------------------------------------------------------------------------

def _check_tiny_files(files: dict, problems: list[str]) -> None:
    """What the engines will read is what was written: diffusers' networks load the files' tensors (the text
    encoder from names under ``model.``), the split files are the folder's bytes or their conversion, sdlite opens
    both layouts."""
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Model

    from sdlite.loader import open_model

    folder, split = files["folder"], files["split"]
    for sub, cls in (("text_encoder", Qwen3Model), ("transformer", ZImageTransformer2DModel)):
        src = _Files(folder / sub)
        loaded = cls.from_pretrained(str(folder / sub)).state_dict()
        bad = [k for k, v in loaded.items()
               if not torch.equal(v.to(torch.bfloat16), src[("model." if sub == "text_encoder" else "") + k])]
        if bad or len(loaded) != len(src.where):
            problems.append(f"{sub}: diffusers/transformers loaded {len(loaded)} tensors of {len(src.where)}, "
                            f"{len(bad)} differ from the file (first {bad[:2]})")
    if len(list((folder / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))) < 2:
        problems.append("the transformer was not sharded")
    if os.stat(split["text"]).st_ino != os.stat(folder / "text_encoder" / "model.safetensors").st_ino:
        problems.append("qwen_3_4b.safetensors is not the folder's text encoder file (a copy, not a link)")
    for ckpt in (open_model(folder), open_model(split["transformer"], text_encoders=[split["text"], split["vae"]])):
        if ckpt.problems() or {"text_encoder", "transformer", "vae"} - set(ckpt.sources):
            problems.append(f"sdlite opens {ckpt.path} with problems {ckpt.problems()}, parts {sorted(ckpt.sources)}")


def tiny_run(args) -> int:
    problems: list[str] = []
    log = lambda m: print(m, flush=True)
    nets = networks(args.layers, args.text_layers, tiny=True)
    compile(SDCPP_CHILD, "sd.cpp child", "exec")
    times = sdcpp_log_times("[INFO ] get_learned_condition completed, taking 1234 ms\n"
                            "[INFO ] decode_first_stage completed, taking 5.50s\n")
    if times != {"text": 1.234, "decode": 5.5}:
        problems.append(f"sd.cpp's log read as {times}")
    labels = [k for k in CONFIGS if k in (args.only.split(",") if args.only else CONFIGS)]
    with tempfile.TemporaryDirectory(prefix="zimage-tiny-") as name:
        tmp = Path(name)
        files = build(tmp / "cache", nets, shard_bytes=2**20, log=log)
        _check_tiny_files(files, problems)
        raw = {"meta": _meta_record(args, nets, files, tiny=True), "results": {}}
        measure(files, nets, labels, args.sizes, raw, args, tmp / "out", tmp / "zimage.json", tiny=True, log=log)
        for size, results in raw["results"].items():
            for label, r in results.items():
                if r.get("error"):
                    problems.append(f"{label} {size}^2: {r['error']}\n{r.get('stderr_tail', '')}")
                elif "skipped" not in r and len(r.get("steps", [])) != args.steps:
                    problems.append(f"{label} {size}^2: {len(r.get('steps', []))} step times for {args.steps} steps")
            q = raw.get("quality", {}).get(size, {})
            if REF in results and "sdlite auto mode1" in results and "sdlite auto mode1" not in q:
                problems.append(f"no PSNR against diffusers at {size}^2")
        # the split files against the folder: the same weights, the same precision, so the same image
        for size in raw["results"]:
            a, b = (tmp / "out" / f"{slug(k, int(size))}.npz" for k in ("sdlite auto mode1", "sdlite auto mode1 split"))
            if a.is_file() and b.is_file() and not np.array_equal(np.load(a)["image"], np.load(b)["image"]):
                problems.append(f"{size}^2: the split files' image differs from the folder's")
        (tmp / "BENCHMARKS.md").write_text("# Benchmarks\n\nbefore\n")
        for _ in range(2):   # appended, then replaced in place
            write_reports(raw, tmp / "zimage.md", tmp / "BENCHMARKS.md")
        text = (tmp / "BENCHMARKS.md").read_text()
        if text.count(MARK_BEGIN) != 1 or text.count(MARK_END) != 1 or "before" not in text:
            problems.append("the BENCHMARKS.md section was not written once between its markers")
        print((tmp / "zimage.md").read_text())
    for p in problems:
        print(f"TINY PROBLEM: {p}", file=sys.stderr)
    print("tiny: " + ("passed" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


# --- main --------------------------------------------------------------------------------------------------------

def _script_name() -> str:
    script = Path(sys.argv[0]).resolve()
    return str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]


def _meta_record(args, nets: dict, files: dict, tiny: bool = False) -> dict:
    from run import cpu_facts, machine

    version = subprocess.run([str(SDCPP_PYTHON), "-c", "from importlib.metadata import version; "
                              "print(version('stable-diffusion-cpp-python'))"], capture_output=True, text=True) \
        if SDCPP_PYTHON.is_file() else None
    t = nets["transformer"]
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(cpu_facts()), "steps": args.steps,
            "sizes": args.sizes, "tiny": tiny, "note": args.note,
            "command": "python " + shlex.join([_script_name(), *sys.argv[1:]]),
            "depth": {"layers": t.n_layers, "refiner_layers": t.n_refiner_layers, "width": t.dim,
                      "text_layers": nets["text"].num_hidden_layers, "released": released(nets)},
            "params": files["params"], "sdcpp_version": version.stdout.strip() if version else None,
            "loadavg_start": os.getloadavg(), "prompt": PROMPT, "seed": SEED, "threads": THREADS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None,
                    help="joint blocks of the transformer (default: the release's 30; the refiners stay 2 + 2)")
    ap.add_argument("--text-layers", type=int, default=None, help="Qwen3's layers (default: the release's 36)")
    ap.add_argument("--sizes", default="512", help="512, 1024 or both (512,1024); 1024^2 is slow")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--exact", action="store_true", help=f"also measure '{EXACT}' (fp32 compute, memory mode 0)")
    ap.add_argument("--only", default=None, help="configuration labels to measure, separated by ',' (the others are "
                                                 "kept from bench/zimage.json): " + ", ".join(CONFIGS))
    ap.add_argument("--build-only", action="store_true", help="build (or find) the files and stop")
    ap.add_argument("--report-only", action="store_true", help="bench/zimage.md and the section again from the json")
    ap.add_argument("--timeout", type=int, default=CHILD_TIMEOUT_S, help="seconds one configuration may take")
    ap.add_argument("--note", default=None, help="a sentence the report adds after the command (what else ran)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, every path, in a temporary folder")
    args = ap.parse_args()
    try:
        args.sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        args.sizes = []
    if not args.sizes or set(args.sizes) - set(SIZES):
        raise SystemExit(f"--sizes takes {', '.join(map(str, SIZES))}")
    wanted = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    if wanted and (unknown := [w for w in wanted if w not in CONFIGS]):
        raise SystemExit(f"unknown configuration {unknown[0]!r}: expected one of {', '.join(CONFIGS)}")
    for name in ("layers", "text_layers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    torch.set_num_threads(THREADS)
    if args.tiny:
        return tiny_run(args)
    if args.report_only:
        if not RAW.is_file():
            raise SystemExit(f"no {RAW.name} yet: run the benchmark first")
        raw = json.loads(RAW.read_text())
        if args.note is not None:
            raw["meta"]["note"] = args.note
            RAW.write_text(json.dumps(raw, indent=1) + "\n")
        write_reports(raw, REPORT, ROOT / "BENCHMARKS.md")
        return 0
    nets = networks(args.layers, args.text_layers)
    files = build(CACHE, nets, log=lambda m: print(m, flush=True))
    if args.build_only:
        return 0
    labels = [k for k in CONFIGS if (k in wanted if wanted else (k in DEFAULT or (args.exact and k == EXACT)))]
    meta = _meta_record(args, nets, files)
    raw = {"results": {}}
    if wanted and RAW.is_file():
        raw = json.loads(RAW.read_text())
        if raw.get("meta", {}).get("depth") != meta["depth"] or raw["meta"].get("steps") != args.steps:
            raise SystemExit(f"{RAW.name} holds another depth or step count ({raw.get('meta', {}).get('depth')}, "
                             f"{raw.get('meta', {}).get('steps')} steps): run without --only, or with the same "
                             "--layers, --text-layers and --steps")
        meta["sizes"] = sorted(set(raw["meta"].get("sizes", [])) | set(args.sizes))
    raw["meta"] = meta
    measure(files, nets, labels, args.sizes, raw, args, CACHE / "out", RAW, log=lambda m: print(m, flush=True))
    write_reports(raw, REPORT, ROOT / "BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
