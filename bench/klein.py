"""FLUX.2 [klein]: sdlite against diffusers bf16 (``Flux2KleinPipeline``) and stable-diffusion.cpp on the same files:
load, text encoding, per step, decode, the whole image and peak RSS; and sdlite's image against diffusers' (PSNR).
The klein counterpart of bench/zimage.py, whose file writing, child processes, memory watch and tables it reuses.

    python bench/klein.py [--model 4b|9b] [--double-layers 5] [--single-layers 20] [--text-layers 36]
                          [--sizes 512[,1024]] [--steps 4] [--exact] [--only LABEL,...] [--build-only]
                          [--report-only] [--note TEXT] [--tiny]

The files (random weights at the released widths, built once into ``bench/cache/klein/``, bf16): the transformer
(``sdlite.config.flux2.FLUX2_KLEIN_4B``: 3072 wide, 5 double and 20 single blocks, text input 7680; or
``FLUX2_KLEIN_9B`` with ``--model 9b``), its Qwen3 (``QWEN3_4B``, or ``QWEN3_8B`` for 9B) and FLUX.2's VAE
(``FLUX2_VAE``: ``AutoencoderKLFlux2``, 32 latent channels, batch-norm statistics mean 0, variance 1), each other
tensor ``randn * 0.02`` (norms at 1) from a generator seeded by its name. Laid out twice, hard links where the bytes
are the same:

* a diffusers ``Flux2KleinPipeline`` folder (``is_distilled: true``; transformer in diffusers' names in 5 GiB shards,
  ``text_encoder/model.safetensors`` (a ``Qwen3ForCausalLM`` in transformers' names under ``model.``), the VAE,
  Qwen's tokenizer with Qwen3's chat template, klein's scheduler), read by diffusers and sdlite;
* ComfyUI's split files (``flux-2-klein-4b.safetensors`` in BFL's names via
  ``sdlite.weights.flux2_keys.flux2_to_original``, ``qwen_3_4b.safetensors`` (the folder's text encoder file) and
  ``flux2-vae.safetensors`` in BFL's / LDM names via ``sdlite.weights.flux2_vae_keys.flux2_vae_to_original``), read
  by sdlite (``Engine.load(transformer, text_encoders=[qwen, vae])``) and by stable-diffusion.cpp
  (``diffusion_model_path``, ``llm_path``, ``vae_path``: stable-diffusion-cpp-python from ``make setup-sdcpp``);
* GGUF (``gguf-<tag>/``: the transformer in BFL's names as city96's tools lay out a Q4_K file, arch ``flux2``, the
  blocks' matrices Q4_K, other matrices F16, vectors F32; Qwen3 in llama.cpp's names, every matrix Q4_K; the same
  VAE file), read by sdlite and stable-diffusion.cpp alike; the Q4_K blocks are random codes (bench/ggufs.py).

klein reads Qwen3's hidden states 9, 18 and 27, so ``--text-layers`` is at least 27 (the release has 36);
``--double-layers`` / ``--single-layers`` keep fewer transformer blocks at the released widths. Every engine runs
the same depth and the report says which; the sd.cpp rows need Qwen3 whole (stable-diffusion.cpp builds it as
released; the transformer's blocks it counts from the file). Each configuration runs in its own fresh process with 2
threads (bench/zimage.py's ``run_child``): load, then one generation (the prompt,
Euler, ``--steps`` steps (4, the distilled model's), cfg 1: klein is guidance-distilled, seed 42) at each size.
Raw figures to bench/klein.json, the report to bench/klein.md and the section "FLUX.2 [klein]" of BENCHMARKS.md
between its markers. OpenVINO GenAI has no FLUX.2 pipeline here (it is not installed in this project), so it has no
row.

``--tiny`` builds a tiny random model of the same structure in a temporary folder and runs every path end to end; it
writes nothing under bench/ and prints its report (512 and 1024 stand for 64 and 128 px).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))   # bench/zimage.py, bench/sd3.py, bench/sdxl.py, bench/run.py
sys.path.insert(1, str(ROOT))   # sdlite, tests/

import zimage  # noqa: E402
from ggufs import city96_q4_k, quantisable, qwen3_fields, write_gguf  # noqa: E402
from sd3 import (  # noqa: E402,F401 (psnr: quality's global)
    SHARD_BYTES, _atomic, _check_disk, _Files, _link, _nbytes, _random_items, _write_file, _write_weights, psnr,
)
from sdxl import MIN_AVAILABLE_MB, _meminfo_mb, _oom_killed, _rss_mb  # noqa: E402,F401 (the rebound functions' globals)
from zimage import (  # noqa: E402,F401 (the rebound functions' globals)
    _converted, _fmt, _median, _short, _single, _warm, sdcpp_log_times, slug,
)

from sdlite.config.flux2 import FLUX2_KLEIN_4B, FLUX2_KLEIN_9B, FLUX2_KLEIN_SCHEDULER, Flux2Config  # noqa: E402
from sdlite.config.flux2_vae import FLUX2_VAE  # noqa: E402
from sdlite.config.qwen import QWEN3_4B, QWEN3_8B, QwenConfig  # noqa: E402

CACHE = HERE / "cache" / "klein"
RAW, REPORT = HERE / "klein.json", HERE / "klein.md"
MARK_BEGIN, MARK_END = "<!-- klein:begin (written by bench/klein.py) -->", "<!-- klein:end -->"
SDCPP_PYTHON = zimage.SDCPP_PYTHON
QWEN_JSON = zimage.QWEN_JSON
PROMPT = zimage.PROMPT
SEED, THREADS, STEPS = zimage.SEED, zimage.THREADS, 4
SIZES, TINY_PX = zimage.SIZES, zimage.TINY_PX
CHILD_TIMEOUT_S = zimage.CHILD_TIMEOUT_S
HIDDEN_LAYERS = (9, 18, 27)   # the Qwen3 hidden states klein reads
MODELS = {"4b": dict(transformer=FLUX2_KLEIN_4B, text=QWEN3_4B, name="FLUX.2 [klein] 4B",
                     split={"transformer": "flux-2-klein-4b.safetensors", "text": "qwen_3_4b.safetensors",
                            "vae": "flux2-vae.safetensors"}),
          "9b": dict(transformer=FLUX2_KLEIN_9B, text=QWEN3_8B, name="FLUX.2 [klein] 9B",
                     split={"transformer": "flux-2-klein-9b.safetensors", "text": "qwen_3_8b.safetensors",
                            "vae": "flux2-vae.safetensors"})}
REF = "diffusers bf16"
EXACT = "sdlite exact mode0"

CONFIGS = {
    REF: dict(engine="diffusers", files="folder"),
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
DEFAULT = [k for k in CONFIGS if k != EXACT]
LAYOUTS = ("folder", "split", "gguf")   # what build writes: all three, or those the chosen rows read

# the tiny model of --tiny: 128-wide heads and 32 latent channels as released (a BFL file cannot say its rotary
# axes: sdlite takes the release's, which need those heads), Qwen3 32 wide with 28 layers (hidden states 9, 18, 27),
# a VAE with the release's 32 norm groups
TINY = dict(
    transformer=Flux2Config(num_layers=1, num_single_layers=2, attention_head_dim=128, num_attention_heads=2,
                            joint_attention_dim=3 * 32, timestep_guidance_channels=32, in_channels=128,
                            out_channels=128, guidance_embeds=False),
    text=QwenConfig(vocab_size=151936, hidden_size=32, intermediate_size=48, num_hidden_layers=28,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                    tie_word_embeddings=True),
    vae=dataclasses.replace(FLUX2_VAE, block_out_channels=(32, 64, 64, 64), layers_per_block=1, sample_size=64))


def _here(f):
    """bench/zimage.py's function ``f`` reading this module's globals (CONFIGS, REF, EXACT, the children, the
    sd.cpp skip, run_child): the same code, klein's configurations."""
    return types.FunctionType(f.__code__, globals(), f.__name__, f.__defaults__, f.__closure__)


def networks(model: str, double: int | None, single: int | None, text_layers: int | None, tiny: bool = False) -> dict:
    m = MODELS[model]
    base = TINY if tiny else dict(transformer=m["transformer"], text=m["text"], vae=FLUX2_VAE)
    transformer, text = base["transformer"], base["text"]
    if double is not None:
        transformer = dataclasses.replace(transformer, num_layers=double)
    if single is not None:
        transformer = dataclasses.replace(transformer, num_single_layers=single)
    if text_layers is not None:
        if text_layers < max(HIDDEN_LAYERS):
            raise SystemExit(f"--text-layers must be {max(HIDDEN_LAYERS)} or more: klein reads Qwen3's hidden states "
                             + ", ".join(map(str, HIDDEN_LAYERS)))
        text = dataclasses.replace(text, num_hidden_layers=text_layers)
    return dict(transformer=transformer, text=text, vae=base["vae"], model=model)


def released(nets: dict) -> bool:
    m = MODELS[nets["model"]]
    return nets["transformer"] == m["transformer"] and nets["text"] == m["text"]


# --- the files ---------------------------------------------------------------------------------------------------

def _meta(nets: dict) -> dict:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    text_cfg = {k: v for k, v in nets["text"].to_transformers().items()
                if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        transformer = Flux2Transformer2DModel(**{k: v for k, v in nets["transformer"].to_diffusers().items()
                                                 if not k.startswith("_")})
        vae = AutoencoderKLFlux2.from_config(nets["vae"].to_diffusers())
        text = Qwen3Model(Qwen3Config(**text_cfg))
    text.config.architectures = ["Qwen3ForCausalLM"]   # the decoder under model.; the LM head is not read
    text.config.dtype = torch.bfloat16
    return {"transformer": (transformer, transformer.to_json_string()), "vae": (vae, vae.to_json_string()),
            "text_encoder": (text, text.config.to_json_string())}


def _vae_items(module) -> list:
    """The VAE's tensors: batch-norm statistics of a unit normal (mean 0, variance 1), its step count left out."""
    items = _random_items(module, drop=("bn.num_batches_tracked",), seed="klein/vae")
    return [(k, s, d, (lambda s=s: torch.ones(s, dtype=torch.bfloat16)) if k == "bn.running_var" else make)
            for k, s, d, make in items]


def build(root: Path, nets: dict, shard_bytes: int = SHARD_BYTES, log=print, layouts=LAYOUTS) -> dict:
    """The diffusers folder, the split files and the GGUF files of ``nets`` under ``root``, those of ``layouts``
    alone (each part written once, per depth): {"folder": path, "split" | "gguf": {"transformer"|"text"|"vae":
    path}, "params": {part: count}}."""
    import diffusers
    from transformers import Qwen2TokenizerFast

    from sdlite.weights.flux2_keys import flux2_to_original
    from sdlite.weights.flux2_vae_keys import flux2_vae_to_original
    from sdlite.weights.qwen_keys import llama_cpp_name
    from tests.test_qwen import QWEN3_CHAT_TEMPLATE

    t0 = time.perf_counter()
    t, model = nets["transformer"], nets["model"]
    split_names = MODELS[model]["split"]
    tag = f"{model}-D{t.num_layers}-S{t.num_single_layers}-T{nets['text'].num_hidden_layers}"
    parts_dir = root / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    meta = _meta(nets)
    params = {name: sum(math.prod(v.shape) for k, v in module.state_dict().items() if k != "bn.num_batches_tracked")
              for name, (module, _) in meta.items()}
    names = {"transformer": f"transformer-{model}-D{t.num_layers}-S{t.num_single_layers}",
             "text_encoder": f"text_encoder-{nets['text'].hidden_size}-T{nets['text'].num_hidden_layers}",
             "vae": "vae"}

    def part(name: str) -> Path:
        module, config = meta[name]
        items = _vae_items(module) if name == "vae" else _random_items(module, seed=f"klein/{name}")
        if name == "text_encoder":   # transformers' causal-LM names, as ComfyUI's qwen_3_4b.safetensors has them
            items = [("model." + k, *rest) for k, *rest in items]

        def fill(tmp: Path):
            _check_disk(tmp.parent, _nbytes(items), names[name])
            t1 = time.perf_counter()
            log(f"writing {names[name]} ({params[name] / 1e9:.2f}B parameters, {_nbytes(items) / 1e9:.2f} GB)")
            (tmp / "config.json").write_text(config + ("" if config.endswith("\n") else "\n"))
            if name == "text_encoder":   # one file, so the split layout's qwen_3_4b.safetensors is the same file
                _write_file(tmp / "model.safetensors", items)
            else:
                _write_weights(tmp, "diffusion_pytorch_model", items, shard_bytes)
            log(f"  {names[name]}: {time.perf_counter() - t1:.0f} s")
        return _atomic(parts_dir / names[name], fill)

    stores = {name: part(name) for name in ("transformer", "text_encoder", "vae")}
    bfl = parts_dir / f"{names['transformer']}-bfl.safetensors"   # the split layout's transformer file
    originals = bool({"split", "gguf"} & set(layouts))

    def bfl_items() -> list:
        """The transformer's tensors in BFL's names: the file where it was written, else converted as they are read
        (the GGUF layout alone needs no copy: at the 9B's size it would be 18 GB more of disk)."""
        if bfl.is_file():
            return _Files(bfl).items(None)
        src = _Files(stores["transformer"])
        return _converted(src, flux2_to_original(src.where))

    if not bfl.is_file() and "split" in layouts:
        items = bfl_items()
        _check_disk(parts_dir, _nbytes(items), bfl.name)
        log(f"writing {bfl.name} (BFL's names, {_nbytes(items) / 1e9:.2f} GB)")
        _single(bfl, items)
    vae = _Files(stores["vae"])
    vae_file = _single(parts_dir / "flux2-vae.safetensors", _converted(vae, flux2_vae_to_original(vae.where))) \
        if originals else None

    def fill_folder(tmp: Path):
        for sub, store in (("transformer", stores["transformer"]), ("text_encoder", stores["text_encoder"]),
                           ("vae", stores["vae"])):
            for f in sorted(p for p in store.iterdir() if p.is_file()):
                _link(f, tmp / sub / f.name)
        tokenizer = Qwen2TokenizerFast(tokenizer_file=str(QWEN_JSON))
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        (tmp / "scheduler").mkdir()
        scheduler = {**FLUX2_KLEIN_SCHEDULER, "_diffusers_version": diffusers.__version__}
        (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2) + "\n")
        index = {"_class_name": "Flux2KleinPipeline", "_diffusers_version": diffusers.__version__,
                 "is_distilled": True, "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                 "text_encoder": ["transformers", "Qwen3ForCausalLM"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
                 "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"]}
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")

    def fill_split(tmp: Path):
        _link(bfl, tmp / split_names["transformer"])
        _link(stores["text_encoder"] / "model.safetensors", tmp / split_names["text"])
        _link(vae_file, tmp / split_names["vae"])

    def fill_gguf(tmp: Path):   # as bench/zimage.py's: city96's layout (arch flux2), llama.cpp's Qwen3, random Q4_K
        t1 = time.perf_counter()
        log(f"writing {gguf_names['transformer']} and {gguf_names['text']} ({tag})")
        write_gguf(tmp / gguf_names["transformer"], "flux2", [(k, s, m) for k, s, _, m in bfl_items()],
                   lambda n, s: city96_q4_k(n, s, ("double_blocks.", "single_blocks.")))
        write_gguf(tmp / gguf_names["text"], "qwen3",
                   [(llama_cpp_name(k.removeprefix("model.")), s, m)
                    for k, s, _, m in _Files(stores["text_encoder"] / "model.safetensors").items(None)],
                   lambda n, s: "Q4_K" if quantisable(s, "Q4_K") else "F32", qwen3_fields(nets["text"]))
        _link(vae_file, tmp / gguf_names["vae"])
        log(f"  GGUF files: {time.perf_counter() - t1:.0f} s")

    gguf_names = {"transformer": split_names["transformer"].replace(".safetensors", "-Q4_K.gguf"),
                  "text": f"Qwen3-{'8B' if model == '9b' else '4B'}-Q4_K.gguf", "vae": split_names["vae"]}
    files, made = {"params": params}, []
    if "folder" in layouts:
        files["folder"] = _atomic(root / f"flux2-klein-{tag}", fill_folder)
        made.append(files["folder"])
    for layout, fill, file_names in (("split", fill_split, split_names), ("gguf", fill_gguf, gguf_names)):
        if layout in layouts:
            made.append(_atomic(root / f"{layout}-{tag}", fill))
            files[layout] = {k: made[-1] / v for k, v in file_names.items()}
    log(f"files ready in {time.perf_counter() - t0:.0f} s: " + ", ".join(f"{p.name}/" for p in made))
    return files


# --- the runs: bench/zimage.py's children with klein's pipeline ----------------------------------------------------

def _klein_child(text: str) -> str:
    """bench/zimage.py's torch child with diffusers' Flux2KleinPipeline (guidance ignored: distilled)."""
    for old, new in (("from diffusers import ZImagePipeline", "from diffusers import Flux2KleinPipeline"),
                     ("pipe = ZImagePipeline.from_pretrained", "pipe = Flux2KleinPipeline.from_pretrained"),
                     ("guidance_scale=0.0", "guidance_scale=1.0")):
        if text.count(old) != 1:
            raise RuntimeError(f"bench/zimage.py's torch child no longer has {old!r}")
        text = text.replace(old, new)
    return text


TORCH_CHILD = _klein_child(zimage.TORCH_CHILD)
SDCPP_CHILD = zimage.SDCPP_CHILD.replace("(Z-Image's Qwen3 text encoder)", "(klein's Qwen3 text encoder)")


def sdcpp_skip(nets: dict, tiny: bool) -> str | None:
    """Why the sd.cpp rows cannot run here, or None."""
    if tiny or nets["text"] != MODELS[nets["model"]]["text"]:
        return ("stable-diffusion.cpp builds Qwen3 with the released layer count and widths whatever the file holds "
                "(the transformer's block counts it reads from the file): the sd.cpp rows need Qwen3 whole "
                "(--text-layers unset) and the released widths")
    if not SDCPP_PYTHON.is_file():
        return f"{SDCPP_PYTHON.relative_to(ROOT)} is missing (make setup-sdcpp builds it)"
    return None


run_child = _here(zimage.run_child)
quality = _here(zimage.quality)
measure = _here(zimage.measure)


# --- the report --------------------------------------------------------------------------------------------------

size_table = _here(zimage.size_table)
quality_table = _here(zimage.quality_table)
notes = _here(zimage.notes)


def _depth(meta: dict) -> str:
    d, p = meta["depth"], meta["params"]
    b = lambda n: f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    name = MODELS[d["model"]]["name"]
    what = (f"the transformer with {d['double']} double and {d['single']} single blocks, {d['width']} wide "
            f"({b(p['transformer'])} parameters), Qwen3 with {d['text_layers']} layers ({b(p['text_encoder'])}), "
            f"the VAE ({b(p['vae'])})")
    if meta.get("tiny"):
        return f"TINY random models of {name}'s structure (`--tiny`: {what})"
    if d["released"]:
        return f"{name} at its released depth and widths: {what}"
    m = MODELS[d["model"]]
    return (f"{name} at a REDUCED depth, the released widths: {what}, against the release's "
            f"{m['transformer'].num_layers} double and {m['transformer'].num_single_layers} single blocks and "
            f"Qwen3's {m['text'].num_hidden_layers} layers")


def body(raw: dict, h: str) -> list[str]:
    meta = raw["meta"]
    px = (lambda s: TINY_PX[int(s)]) if meta.get("tiny") else int
    la = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
    split = MODELS[meta["depth"]["model"]]["split"]
    lines = [
        f"{h} FLUX.2 [klein]", "",
        f"{_depth(meta)}; random bf16 weights built by `bench/klein.py` into "
        f"{'a temporary folder' if meta.get('tiny') else '`bench/cache/klein/`'} as a diffusers "
        "`Flux2KleinPipeline` folder (read by diffusers and by sdlite) and as ComfyUI's split files "
        f"(`{'`, `'.join(v.removesuffix('.safetensors') for v in split.values())}`: read by sdlite's `split` row and "
        "by stable-diffusion.cpp), and as GGUF (the blocks' matrices Q4_K, the rest F16/F32, arch `flux2`; Qwen3 in "
        "llama.cpp's names, every matrix Q4_K; random Q4_K codes, not a quantisation of the bf16 weights: read by "
        f"sdlite's `gguf` rows and sd.cpp's `q4_k` row). {meta['steps']} Euler steps, cfg 1 (klein is guidance-distilled), seed {SEED}, "
        f"{THREADS} threads, each configuration and size in a fresh process, after its files were read into the page "
        "cache where they fit. Step times are each engine's own per-step callbacks (medians); stable-diffusion.cpp's "
        "text encoding and decode are its log's. Ratios are against diffusers bf16 in the same run and, `x sd.cpp`, "
        "for sdlite on the split or GGUF files against stable-diffusion.cpp on the same files (lower is better). "
        f"stable-diffusion-cpp-python {meta.get('sdcpp_version') or 'not installed'}; OpenVINO GenAI: not installed "
        "in this project (no row).", "",
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
                  "PSNR over them says less than it would for a trained model. diffusers' callback latents are "
                  "packed tokens, sdlite's are not, so the latents' error is '-' where the shapes differ. sd.cpp "
                  "draws its noise with its own generator, so its image is not compared.", "",
                  *q, ""]
    n = notes(raw, px)
    return lines + n if n else lines[:-1]


def write_reports(raw: dict, md: Path, benchmarks: Path) -> None:
    md.write_text("\n".join(body(raw, "#")).rstrip() + "\n", encoding="utf-8")
    section = "\n".join([MARK_BEGIN, *body(raw, "##"), "", "Raw figures: `bench/klein.json`; the report alone: "
                         "`bench/klein.md`.", MARK_END])
    text = benchmarks.read_text(encoding="utf-8") if benchmarks.is_file() else "# Benchmarks\n"
    begin, end = text.find(MARK_BEGIN), text.find(MARK_END)
    text = text[:begin] + section + text[end + len(MARK_END):] if 0 <= begin < end else \
        text.rstrip("\n") + "\n\n" + section + "\n"
    benchmarks.write_text(text, encoding="utf-8")
    print(f"wrote {md.name} and the FLUX.2 [klein] section of {benchmarks.name}")


# --- the tiny run ------------------------------------------------------------------------------------------------

def _check_tiny_files(files: dict, problems: list[str]) -> None:
    """What the engines will read is what was written: diffusers' networks load the files' tensors, the split files
    are the folder's bytes or their conversion, sdlite opens both layouts as klein."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Model

    from sdlite.loader import open_model

    folder, split = files["folder"], files["split"]
    for sub, cls in (("text_encoder", Qwen3Model), ("transformer", Flux2Transformer2DModel),
                     ("vae", AutoencoderKLFlux2)):
        src = _Files(folder / sub)
        loaded = {k: v for k, v in cls.from_pretrained(str(folder / sub)).state_dict().items()
                  if k != "bn.num_batches_tracked"}
        bad = [k for k, v in loaded.items()
               if not torch.equal(v.to(torch.bfloat16), src[("model." if sub == "text_encoder" else "") + k])]
        if bad or len(loaded) != len(src.where):
            problems.append(f"{sub}: diffusers/transformers loaded {len(loaded)} tensors of {len(src.where)}, "
                            f"{len(bad)} differ from the file (first {bad[:2]})")
    if len(list((folder / "transformer").glob("diffusion_pytorch_model-*-of-*.safetensors"))) < 2:
        problems.append("the transformer was not sharded")
    if os.stat(split["text"]).st_ino != os.stat(folder / "text_encoder" / "model.safetensors").st_ino:
        problems.append(f"{split['text'].name} is not the folder's text encoder file (a copy, not a link)")
    for ckpt in (open_model(folder), open_model(split["transformer"], text_encoders=[split["text"], split["vae"]])):
        if ckpt.problems() or {"text_encoder", "transformer", "vae"} - set(ckpt.sources):
            problems.append(f"sdlite opens {ckpt.path} with problems {ckpt.problems()}, parts {sorted(ckpt.sources)}")
        if ckpt.spec.family != "flux2-klein":
            problems.append(f"sdlite opens {ckpt.path} as {ckpt.spec.family}, not flux2-klein")


def tiny_run(args) -> int:
    problems: list[str] = []
    log = lambda m: print(m, flush=True)
    nets = networks(args.model, args.double_layers, args.single_layers, args.text_layers, tiny=True)
    compile(SDCPP_CHILD, "sd.cpp child", "exec")
    compile(TORCH_CHILD, "torch child", "exec")
    labels = [k for k in CONFIGS if k in (args.only.split(",") if args.only else CONFIGS)]
    with tempfile.TemporaryDirectory(prefix="klein-tiny-") as name:
        tmp = Path(name)
        files = build(tmp / "cache", nets, shard_bytes=2**20, log=log)
        _check_tiny_files(files, problems)
        raw = {"meta": _meta_record(args, nets, files, tiny=True), "results": {}}
        measure(files, nets, labels, args.sizes, raw, args, tmp / "out", tmp / "klein.json", tiny=True, log=log)
        for size, results in raw["results"].items():
            for label, r in results.items():
                if r.get("error"):
                    problems.append(f"{label} {size}^2: {r['error']}\n{r.get('stderr_tail', '')}")
                elif "skipped" not in r and len(r.get("steps", [])) != args.steps:
                    problems.append(f"{label} {size}^2: {len(r.get('steps', []))} step times for {args.steps} steps")
            q = raw.get("quality", {}).get(size, {})
            if REF in results and "sdlite auto mode1" in results and "sdlite auto mode1" not in q:
                problems.append(f"no PSNR against diffusers at {size}^2")
        for size in raw["results"]:   # the split files against the folder: the same weights, so the same image
            a, b = (tmp / "out" / f"{slug(k, int(size))}.npz" for k in ("sdlite auto mode1", "sdlite auto mode1 split"))
            if a.is_file() and b.is_file() and not np.array_equal(np.load(a)["image"], np.load(b)["image"]):
                problems.append(f"{size}^2: the split files' image differs from the folder's")
        (tmp / "BENCHMARKS.md").write_text("# Benchmarks\n\nbefore\n")
        for _ in range(2):   # appended, then replaced in place
            write_reports(raw, tmp / "klein.md", tmp / "BENCHMARKS.md")
        text = (tmp / "BENCHMARKS.md").read_text()
        if text.count(MARK_BEGIN) != 1 or text.count(MARK_END) != 1 or "before" not in text:
            problems.append("the BENCHMARKS.md section was not written once between its markers")
        print((tmp / "klein.md").read_text())
    for p in problems:
        print(f"TINY PROBLEM: {p}", file=sys.stderr)
    print("tiny: " + ("passed" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


# --- main --------------------------------------------------------------------------------------------------------

def _meta_record(args, nets: dict, files: dict, tiny: bool = False) -> dict:
    from run import cpu_facts, machine

    version = subprocess.run([str(SDCPP_PYTHON), "-c", "from importlib.metadata import version; "
                              "print(version('stable-diffusion-cpp-python'))"], capture_output=True, text=True) \
        if SDCPP_PYTHON.is_file() else None
    t = nets["transformer"]
    script = Path(sys.argv[0]).resolve()
    script = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(cpu_facts()), "steps": args.steps,
            "sizes": args.sizes, "tiny": tiny, "note": args.note,
            "command": "python " + shlex.join([script, *sys.argv[1:]]),
            "depth": {"model": nets["model"], "double": t.num_layers, "single": t.num_single_layers,
                      "width": t.hidden, "text_layers": nets["text"].num_hidden_layers, "released": released(nets)},
            "params": files["params"], "sdcpp_version": version.stdout.strip() if version else None,
            "loadavg_start": os.getloadavg(), "prompt": PROMPT, "seed": SEED, "threads": THREADS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="4b", help="klein 4B (Qwen3-4B) or 9B (Qwen3-8B)")
    ap.add_argument("--double-layers", type=int, default=None, help="double blocks (default: the release's)")
    ap.add_argument("--single-layers", type=int, default=None, help="single blocks (default: the release's)")
    ap.add_argument("--text-layers", type=int, default=None,
                    help="Qwen3's layers, 27 or more (default: the release's 36)")
    ap.add_argument("--sizes", default="512", help="512, 1024 or both (512,1024); 1024^2 is slow")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--exact", action="store_true", help=f"also measure '{EXACT}' (fp32 compute, memory mode 0)")
    ap.add_argument("--only", default=None, help="configuration labels to measure, separated by ',' (the others are "
                                                 "kept from bench/klein.json): " + ", ".join(CONFIGS))
    ap.add_argument("--build-only", action="store_true", help="build (or find) the files and stop")
    ap.add_argument("--report-only", action="store_true", help="bench/klein.md and the section again from the json")
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
    for name in ("double_layers", "text_layers", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.single_layers is not None and args.single_layers < 0:
        raise SystemExit("--single-layers must be 0 or more")
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
    nets = networks(args.model, args.double_layers, args.single_layers, args.text_layers)
    labels = [k for k in CONFIGS if (k in wanted if wanted else (k in DEFAULT or (args.exact and k == EXACT)))]
    # klein 9B's three layouts are about 60 GB: only those the chosen rows read are written (all with --build-only
    # unless --only names rows)
    layouts = tuple(x for x in LAYOUTS if any(CONFIGS[k]["files"] == x for k in labels)) \
        if wanted or not args.build_only else LAYOUTS
    files = build(CACHE, nets, log=lambda m: print(m, flush=True), layouts=layouts)
    if args.build_only:
        return 0
    meta = _meta_record(args, nets, files)
    raw = {"results": {}}
    if wanted and RAW.is_file():
        raw = json.loads(RAW.read_text())
        if raw.get("meta", {}).get("depth") != meta["depth"] or raw["meta"].get("steps") != args.steps:
            raise SystemExit(f"{RAW.name} holds another model, depth or step count: run without --only, or with "
                             "the same --model, --double-layers, --single-layers, --text-layers and --steps")
        meta["sizes"] = sorted(set(raw["meta"].get("sizes", [])) | set(args.sizes))
    raw["meta"] = meta
    measure(files, nets, labels, args.sizes, raw, args, CACHE / "out", RAW, log=lambda m: print(m, flush=True))
    write_reports(raw, REPORT, ROOT / "BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
