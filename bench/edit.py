"""Qwen-Image-Edit-2509 (Edit Plus): sdlite's memory and speed against diffusers bf16 (``QwenImageEditPlusPipeline``)
on the same random weights at the released widths, from three kinds of files: a diffusers folder (bf16), ComfyUI's
fp8 split files and GGUF (a city96-style transformer, a llama.cpp Qwen2.5-VL encoder and its mmproj vision tower);
and against stable-diffusion.cpp on the GGUF files (``sd.cpp q4_k``: stable-diffusion-cpp-python from ``make
setup-sdcpp``, which counts the transformer's blocks and the encoder's layers from the files).

    python bench/edit.py [--blocks 2] [--text-layers 2] [--depths 2:2,4:4] [--only LABEL,...] [--repeat 1]
                         [--build-only] [--report-only] [--clean] [--note TEXT]

The networks (random weights, built once into ``bench/cache/edit/``):

* the transformer: ``QWEN_IMAGE_EDIT_2509`` (3072 wide, 24 heads of 128, joint dim 3584) with ``--blocks`` of its 60
  blocks;
* the text encoder: Qwen2.5-VL-7B's language model (``QWEN2_5_VL_7B``: 3584 wide, 28 heads, 4 kv heads, mlp 18944,
  vocab 152064) with ``--text-layers`` of its 28 layers, and its WHOLE vision tower (``QWEN25_VL_7B_VISION``: 32
  blocks, 1280 wide, 16 heads, window 112, full attention in 7/15/23/31, out 3584; kept whole because ComfyUI's and
  llama.cpp's files are recognised as the released tower by its shapes);
* the VAE at its released config (``QWEN_IMAGE_VAE``).

Each matrix is ``randn * 0.02`` (bench/sd3.py's ``_random_items``: norms 1 and 0), written as

* ``folder``: a diffusers ``QwenImageEditPlusPipeline`` folder in bf16 (the text encoder in transformers 5's names,
  without the LM head, which neither engine reads; transformers initialises it), read by diffusers and sdlite;
* ``fp8``: ComfyUI's ``qwen_image_edit_2509_fp8_e4m3fn.safetensors`` (every matrix float8_e4m3fn as stored, the rest
  bf16), ``qwen_2.5_vl_7b_fp8_scaled.safetensors`` (scaled fp8: each matrix but the embedding over a per-tensor
  ``scale_weight``, the ``scaled_fp8`` marker; the tower under ``visual.``) and ``qwen_image_vae.safetensors`` (Wan
  names);
* ``gguf``: ``qwen-image-edit-2509-Q4_K_M.gguf`` (the blocks' matrices Q4_K, other matrices F16, vectors F32),
  ``Qwen2.5-VL-7B-Instruct-Q4_K_M.gguf`` (every matrix Q4_K, the token embedding included, vectors F32) and
  ``mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf`` (F16 matrices). The gguf package has no numpy Q4_K quantiser
  (``gguf.quants.quantize`` raises NotImplementedError for Q4_K), so the Q4_K tensors are random Q4_K blocks
  (bench/ggufs.py's ``q4_k_blocks``: random nibbles, 6-bit scales and mins, fp16 super-block scales of about 6e-5), not a
  quantisation of the bf16 weights: the same shapes and storage, other values.

The run: one 1024^2 source picture (a drawn landscape: sky, clouds, sun, hills, a lake, trees, a house), the
instruction "make the sky purple", a negative prompt, cfg 4 (true CFG: two transformer passes a step), 2 Euler
steps, seed 42, 1024^2 output, 2 threads. Each configuration in a fresh process; text encoding, source VAE encode,
per-step times, decode, the whole call and the process's own peak RSS (VmHWM). ``--depths`` adds mode-0 runs from
the fp8 and GGUF files at further depths (``blocks:text-layers``), to show whether the mode-0 peak grows with depth.
Raw figures to bench/edit.json, the report to bench/edit.md and the section "Qwen-Image-Edit" of BENCHMARKS.md
between its markers. ``--clean`` deletes bench/cache/edit/.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

from ggufs import write_gguf  # noqa: E402
from sd3 import _atomic, _link, _random_items  # noqa: E402
from zimage import SDCPP_PYTHON, sdcpp_log_times  # noqa: E402

from sdlite.config.qwen import QWEN2_5_VL_7B  # noqa: E402
from sdlite.config.qwen_vision import QWEN25_VL_7B_VISION  # noqa: E402
from sdlite.config.qwenimage import QWEN_IMAGE_EDIT_2509, QWEN_IMAGE_SCHEDULER  # noqa: E402
from sdlite.config.qwenimage_vae import QWEN_IMAGE_VAE  # noqa: E402

CACHE = HERE / "cache" / "edit"
RAW, REPORT = HERE / "edit.json", HERE / "edit.md"
MARK_BEGIN, MARK_END = "<!-- edit:begin (written by bench/edit.py) -->", "<!-- edit:end -->"
QWEN_JSON = ROOT / "sdlite" / "data" / "qwen" / "tokenizer.json"
INSTRUCTION, NEGATIVE = "make the sky purple", "blurry, distorted, low quality"
SEED, THREADS, STEPS, CFG, SIZE = 42, 2, 2, 4.0, 1024
CHILD_TIMEOUT_S = 40 * 60
IMAGE_PAD = 151655
PROCESSOR = dict(min_pixels=3136, max_pixels=12845056)   # Qwen/Qwen-Image-Edit-2509's processor/preprocessor_config
FP8 = {"transformer": "qwen_image_edit_2509_fp8_e4m3fn.safetensors", "text": "qwen_2.5_vl_7b_fp8_scaled.safetensors",
       "vae": "qwen_image_vae.safetensors"}
GGUF = {"transformer": "qwen-image-edit-2509-Q4_K_M.gguf", "text": "Qwen2.5-VL-7B-Instruct-Q4_K_M.gguf",
        "mmproj": "mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf", "vae": "qwen_image_vae.safetensors"}
REF, SDCPP = "diffusers bf16", "sd.cpp q4_k"
CONFIGS = {
    REF: dict(engine="diffusers", files="folder"),
    "sdlite folder mode1": dict(engine="sdlite", files="folder", memory_mode=1),
    "sdlite folder mode0": dict(engine="sdlite", files="folder", memory_mode=0),
    "sdlite fp8 mode1": dict(engine="sdlite", files="fp8", memory_mode=1),
    "sdlite fp8 mode0": dict(engine="sdlite", files="fp8", memory_mode=0),
    "sdlite gguf mode1": dict(engine="sdlite", files="gguf", memory_mode=1),
    "sdlite gguf mode0": dict(engine="sdlite", files="gguf", memory_mode=0),
    SDCPP: dict(engine="sdcpp", files="gguf"),
}
DEPTH_CONFIGS = ("sdlite fp8 mode0", "sdlite gguf mode0")


# --- the networks ------------------------------------------------------------------------------------------------

def networks(blocks: int, text_layers: int) -> dict:
    return dict(transformer=dataclasses.replace(QWEN_IMAGE_EDIT_2509, num_layers=blocks),
                text=dataclasses.replace(QWEN2_5_VL_7B, num_hidden_layers=text_layers),
                vision=QWEN25_VL_7B_VISION, vae=QWEN_IMAGE_VAE)


def _text_config(nets: dict) -> dict:
    """text_encoder/config.json as Qwen/Qwen-Image-Edit-2509 ships it (Qwen2_5_VLForConditionalGeneration), the
    language model's depth reduced."""
    t = {k: v for k, v in nets["text"].to_transformers().items() if k not in ("architectures", "model_type")}
    t.update(model_type="qwen2_5_vl_text", rope_scaling={"type": "mrope", "rope_type": "default",
                                                          "mrope_section": list(nets["text"].mrope_section)})
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "text_config": t, "vision_config": {**nets["vision"].to_hf(), "model_type": "qwen2_5_vl"},
            "image_token_id": IMAGE_PAD, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "dtype": "bfloat16"}


def _modules(nets: dict) -> dict:
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("_")}
    cfg = _text_config(nets)
    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel(**strip(nets["transformer"].to_diffusers()))
        vae = AutoencoderKLQwenImage(**strip(nets["vae"].to_diffusers()))
        text = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**{k: v for k, v in cfg.items()
                                                                       if k not in ("architectures", "model_type")}))
    return {"transformer": transformer, "vae": vae, "text_encoder": text, "text_config": cfg}


# --- the writers -------------------------------------------------------------------------------------------------

ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def _write_st(path: Path, items) -> None:
    """A .safetensors file written tensor by tensor from (key, shape, dtype, make) items (fp8 included)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape, dtype, _ in items:
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, shape, dtype, make in items:
            t = make().to(dtype).contiguous()
            assert tuple(t.shape) == tuple(shape), key
            f.write(t.reshape(-1).view(torch.uint8).numpy())


def _gguf_fields_text(text):
    def fields(writer):
        writer.add_context_length(text.max_position_embeddings)
        writer.add_embedding_length(text.hidden_size)
        writer.add_block_count(text.num_hidden_layers)
        writer.add_feed_forward_length(text.intermediate_size)
        writer.add_head_count(text.num_attention_heads)
        writer.add_head_count_kv(text.num_key_value_heads)
        writer.add_layer_norm_rms_eps(text.rms_norm_eps)
        writer.add_rope_freq_base(text.rope_theta)
        writer.add_rope_dimension_sections([*text.mrope_section, 0])
    return fields


def _gguf_fields_tower(tower):
    """The mmproj GGUF's metadata for ``tower``, as llama.cpp's converter writes it (the tests' writer)."""
    from tests.test_qwen_vision import mmproj_fields

    return lambda writer: mmproj_fields(writer, tower)


# --- the files ---------------------------------------------------------------------------------------------------

def _source_image():
    """A 1024^2 landscape: a sky gradient with a sun and soft clouds, hills, a lake reflecting the sky, trees and a
    house, with fine noise (detail for the VAE and the vision tower)."""
    from PIL import Image, ImageDraw, ImageFilter

    g = np.random.default_rng(7)
    y = np.linspace(0, 1, SIZE)[:, None, None]
    sky = (np.array([60, 110, 200]) * (1 - y) + np.array([190, 215, 240]) * y) * np.ones((1, SIZE, 1))
    img = Image.fromarray(np.clip(sky, 0, 255).astype(np.uint8))
    clouds = Image.new("L", (SIZE, SIZE), 0)
    d = ImageDraw.Draw(clouds)
    for _ in range(14):
        x0, y0 = g.integers(0, SIZE), g.integers(40, 380)
        d.ellipse([x0, y0, x0 + g.integers(120, 320), y0 + g.integers(40, 90)], fill=int(g.integers(150, 230)))
    img.paste(Image.new("RGB", (SIZE, SIZE), (250, 250, 252)), mask=clouds.filter(ImageFilter.GaussianBlur(18)))
    d = ImageDraw.Draw(img)
    d.ellipse([760, 120, 860, 220], fill=(255, 236, 160))
    for i, (color, base) in enumerate((((90, 120, 150), 560), ((70, 110, 80), 620))):
        xs = np.arange(0, SIZE + 16, 16)
        ys = base - 80 * np.sin(xs / (180 + 60 * i) + i) - 40 * np.sin(xs / 57 + 2 * i)
        d.polygon([(0, SIZE), *zip(xs.tolist(), ys.tolist()), (SIZE, SIZE)], fill=color)
    lake = img.crop((0, 0, SIZE, 300)).transpose(Image.FLIP_TOP_BOTTOM).resize((SIZE, 260))
    img.paste(Image.blend(lake, Image.new("RGB", lake.size, (40, 70, 90)), 0.45), (0, 764))
    for x in range(40, SIZE, 70):
        h = int(g.integers(60, 130))
        top = 700 - int(g.integers(0, 40))
        d.rectangle([x + 8, top, x + 14, top + 30], fill=(80, 55, 35))
        d.polygon([(x, top + 5), (x + 11, top - h), (x + 22, top + 5)], fill=(30, 80 + int(g.integers(0, 40)), 40))
    d.rectangle([430, 620, 560, 720], fill=(200, 170, 130))
    d.polygon([(420, 625), (495, 560), (570, 625)], fill=(150, 50, 40))
    d.rectangle([480, 670, 510, 720], fill=(90, 60, 40))
    a = np.asarray(img).astype(np.float32) + g.normal(0, 4, (SIZE, SIZE, 3))
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def build(nets: dict, log=print) -> dict:
    """The folder (bf16), the fp8 split files and the GGUF files of ``nets`` under bench/cache/edit/, each written once
    per depth; the VAE, the tower and the source picture shared between depths."""
    import diffusers
    from transformers import Qwen2TokenizerFast

    from sdlite.weights.qwen_keys import llama_cpp_name
    from sdlite.weights.qwen_vision_keys import llama_cpp_vision_tensors
    from sdlite.weights.qwenimage_vae_keys import wan_names

    CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tr, text = nets["transformer"], nets["text"]
    tag = f"B{tr.num_layers}-T{text.num_hidden_layers}"
    mods = _modules(nets)
    source = CACHE / "source-1024.png"
    if not source.is_file():
        _source_image().save(source)
    shared = CACHE / "shared"
    shared.mkdir(exist_ok=True)

    t_items = _random_items(mods["transformer"], seed="edit/transformer")
    v_items = _random_items(mods["vae"], seed="edit/vae")
    x_items = _random_items(mods["text_encoder"], drop=("lm_head.weight",), seed="edit/text")
    lm = [i for i in x_items if i[0].startswith("model.language_model.")]
    vis = [i for i in x_items if i[0].startswith("model.visual.")]
    assert len(lm) + len(vis) == len(x_items), "unexpected text-encoder keys"

    # shared across depths: the VAE (diffusers names and Wan names), the tower's mmproj
    vae_dir = shared / "vae"
    if not vae_dir.is_dir():
        log("writing the VAE")
        tmp = shared / ".vae"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        (tmp / "config.json").write_text(mods["vae"].to_json_string())
        _write_st(tmp / "diffusion_pytorch_model.safetensors", v_items)
        os.rename(tmp, vae_dir)
    wan_vae = shared / "qwen_image_vae.safetensors"
    if not wan_vae.is_file():
        keys = [k for k, *_ in v_items]
        names = wan_names(keys, {k: torch.empty(s, device="meta") for k, s, *_ in v_items})
        _write_st(wan_vae.with_suffix(".tmp"), [(n, *rest) for n, (_, *rest) in zip(names, v_items)])
        os.rename(wan_vae.with_suffix(".tmp"), wan_vae)
    mmproj = shared / GGUF["mmproj"]
    if not mmproj.is_file():
        log("writing the mmproj GGUF (the whole tower, F16)")
        t1 = time.perf_counter()
        state = {k.removeprefix("model.visual."): make() for k, _, _, make in vis}
        tensors = llama_cpp_vision_tensors(state)
        del state
        write_gguf(mmproj.with_suffix(".tmp"), "clip", [(n, tuple(t.shape), (lambda t=t: t)) for n, t in
                                                        tensors.items()],
                    lambda n, s: "F16" if len(s) > 1 else "F32", _gguf_fields_tower(nets["vision"]))
        os.rename(mmproj.with_suffix(".tmp"), mmproj)
        del tensors
        log(f"  {time.perf_counter() - t1:.0f} s")

    def fill_folder(tmp: Path):
        log(f"writing the diffusers folder ({tag})")
        t1 = time.perf_counter()
        (tmp / "transformer").mkdir(parents=True)
        (tmp / "transformer" / "config.json").write_text(mods["transformer"].to_json_string())
        _write_st(tmp / "transformer" / "diffusion_pytorch_model.safetensors", t_items)
        (tmp / "text_encoder").mkdir()
        (tmp / "text_encoder" / "config.json").write_text(json.dumps(mods["text_config"], indent=2) + "\n")
        _write_st(tmp / "text_encoder" / "model.safetensors", x_items)
        for f in vae_dir.iterdir():
            _link(f, tmp / "vae" / f.name)
        tok = Qwen2TokenizerFast(tokenizer_file=str(QWEN_JSON))
        tok.save_pretrained(str(tmp / "tokenizer"))
        (tmp / "processor").mkdir()
        (tmp / "processor" / "preprocessor_config.json").write_text(json.dumps({
            **PROCESSOR, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}))
        (tmp / "scheduler").mkdir()
        (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(
            {**QWEN_IMAGE_SCHEDULER, "_diffusers_version": diffusers.__version__}, indent=2))
        index = {"_class_name": "QwenImageEditPlusPipeline", "_diffusers_version": diffusers.__version__,
                 "processor": ["transformers", "Qwen2VLProcessor"],
                 "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                 "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
                 "tokenizer": ["transformers", "Qwen2Tokenizer"],
                 "transformer": ["diffusers", "QwenImageTransformer2DModel"],
                 "vae": ["diffusers", "AutoencoderKLQwenImage"]}
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        log(f"  {time.perf_counter() - t1:.0f} s")

    def comfy_text(key: str) -> str:   # ComfyUI's Qwen2.5-VL file: the language model under model., tower under visual.
        return "model." + key.removeprefix("model.language_model.") if key.startswith("model.language_model.") \
            else key.removeprefix("model.")

    def fill_fp8(tmp: Path):
        log(f"writing the fp8 split files ({tag})")
        t1 = time.perf_counter()
        _write_st(tmp / "diffusion_models" / FP8["transformer"],
                  [(k, s, torch.float8_e4m3fn if len(s) == 2 and k.endswith(".weight") else d, m)
                   for k, s, d, m in t_items])
        items = []
        for k, s, d, m in x_items:
            name = comfy_text(k)
            if len(s) != 2 or name.endswith("embed_tokens.weight"):
                items.append((name, s, d, m))
                continue
            scale = 0.02 * 4.5 / 448.0   # about the largest of randn * 0.02 over e4m3's largest value
            items.append((name, s, torch.float8_e4m3fn, lambda m=m, scale=scale: m().float() / scale))
            items.append((name.removesuffix(".weight") + ".scale_weight", (), torch.float32,
                          lambda scale=scale: torch.tensor(scale)))
        items.append(("scaled_fp8", (0,), torch.float8_e4m3fn, lambda: torch.zeros(0)))
        _write_st(tmp / "text_encoders" / FP8["text"], items)
        _link(wan_vae, tmp / "vae" / FP8["vae"])
        log(f"  {time.perf_counter() - t1:.0f} s")

    def fill_gguf(tmp: Path):
        log(f"writing the GGUF files ({tag})")
        t1 = time.perf_counter()
        write_gguf(tmp / "diffusion_models" / GGUF["transformer"], "qwen_image",
                    [(k, s, m) for k, s, _, m in t_items],
                    lambda n, s: "F32" if len(s) == 1 else
                    ("Q4_K" if n.startswith("transformer_blocks.") and len(s) == 2 and s[1] % 256 == 0 else "F16"))
        items = []
        for k, s, _, m in lm:
            name = llama_cpp_name(k.removeprefix("model.language_model."))
            assert name, k
            items.append((name, s, m))
        write_gguf(tmp / "text_encoders" / GGUF["text"], "qwen2vl", items,
                    lambda n, s: "Q4_K" if len(s) == 2 and s[1] % 256 == 0 else "F32", _gguf_fields_text(text))
        _link(mmproj, tmp / "text_encoders" / GGUF["mmproj"])
        _link(wan_vae, tmp / "vae" / GGUF["vae"])
        log(f"  {time.perf_counter() - t1:.0f} s")

    folder = _atomic(CACHE / f"Qwen-Image-Edit-2509-{tag}", fill_folder) if nets.get("with_folder", True) else None
    fp8 = _atomic(CACHE / f"comfy-fp8-{tag}", fill_fp8)
    gg = _atomic(CACHE / f"gguf-{tag}", fill_gguf)
    log(f"files ready in {time.perf_counter() - t0:.0f} s")
    params = {"transformer": sum(math.prod(s) for _, s, *_ in t_items), "text": sum(math.prod(s) for _, s, *_ in lm),
              "vision": sum(math.prod(s) for _, s, *_ in vis), "vae": sum(math.prod(s) for _, s, *_ in v_items)}
    return {"tag": tag, "source": source, "folder": folder, "params": params,
            "fp8": {"transformer": fp8 / "diffusion_models" / FP8["transformer"],
                    "text": [fp8 / "text_encoders" / FP8["text"], fp8 / "vae" / FP8["vae"]]},
            "gguf": {"transformer": gg / "diffusion_models" / GGUF["transformer"],
                     "text": [gg / "text_encoders" / GGUF["text"], gg / "text_encoders" / GGUF["mmproj"],
                              gg / "vae" / GGUF["vae"]]}}


# --- the child -----------------------------------------------------------------------------------------------------

_PRELUDE = r"""
import json, os, sys, time
cfg = json.loads(sys.argv[1])
now = time.perf_counter
t_start = now()
out = {"notes": []}

def peak_mb():
    return next(int(ln.split()[1]) / 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))

def report():
    out["peak_rss_mb"] = peak_mb()
    print("RESULT " + json.dumps(out), flush=True)

def failed(what, e):
    import traceback
    traceback.print_exc()
    out["error"] = f"{what} failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    report(); sys.exit(0)
"""

CHILD = _PRELUDE + r"""
import numpy as np
import torch
from PIL import Image
torch.set_num_threads(cfg["threads"])
source = Image.open(cfg["source"]).convert("RGB")
marks = {"text": 0.0, "vae_encode": 0.0}
def timed(obj, name, key):
    f = getattr(obj, name)
    def wrapper(*a, **k):
        t = now(); r = f(*a, **k); marks[key] += now() - t; marks[key + "_end"] = now(); return r
    setattr(obj, name, wrapper)
try:
    if cfg["engine"] == "diffusers":
        import diffusers, transformers
        from diffusers import QwenImageEditPlusPipeline
        from transformers import Qwen2_5_VLForConditionalGeneration
        from tests.test_qwenimage_instruct import _processor
        out["versions"] = {m.__name__: m.__version__ for m in (diffusers, transformers, torch)}
        te = Qwen2_5_VLForConditionalGeneration.from_pretrained(os.path.join(cfg["folder"], "text_encoder"),
                                                                dtype=torch.bfloat16)
        forward = te.forward
        def with_token_types(*args, input_ids=None, **kw):   # tests/test_qwenimage_instruct.py's wrapper
            if input_ids is not None and kw.get("pixel_values") is not None:
                kw.setdefault("mm_token_type_ids", (input_ids == 151655).int())
            return forward(*args, input_ids=input_ids, **kw)
        te.forward = with_token_types
        pipe = QwenImageEditPlusPipeline.from_pretrained(cfg["folder"], processor=_processor(), text_encoder=te,
                                                         dtype=torch.bfloat16, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        timed(pipe, "encode_prompt", "text")
        timed(pipe.vae, "encode", "vae_encode")
        def generate():
            ends = []
            def step_end(p, i, t, kw):
                ends.append(now()); return kw
            t0 = now()
            img = pipe(image=[source], prompt=cfg["prompt"], negative_prompt=cfg["negative"],
                       true_cfg_scale=cfg["cfg"], height=cfg["size"], width=cfg["size"],
                       num_inference_steps=cfg["steps"], generator=torch.Generator().manual_seed(cfg["seed"]),
                       callback_on_step_end=step_end, output_type="np").images[0]
            t1 = now()
            first = max(marks.get("text_end", t0), marks.get("vae_encode_end", t0))
            return {"text": marks["text"], "vae_encode": marks["vae_encode"],
                    "steps": [b - a for a, b in zip([first, *ends], ends)], "decode": t1 - ends[-1],
                    "total": t1 - t0}, np.round(np.clip(img, 0, 1) * 255).astype(np.uint8)
    else:
        from sdlite.families.qwenimage_edit import QwenImageEditFamily
        from sdlite.pipeline import Engine, Request
        if cfg["files"] == "folder":
            engine = Engine.load(cfg["folder"], memory_mode=cfg["memory_mode"])
        else:
            f = cfg["split"]
            engine = Engine.load(f["transformer"], text_encoders=f["text"], memory_mode=cfg["memory_mode"])
        m = engine.models
        out["resolved"] = {"precision": engine.precision.label, "memory_mode": m.mode, "family": engine.spec.family,
                           **{n: str(m.dtype_of(n)).removeprefix("torch.") for n in ("transformer", "text_encoder", "vae")}}
        timed(QwenImageEditFamily, "encode_with_images", "text")
        timed(QwenImageEditFamily, "encode_sources", "vae_encode")
        def generate():
            ends = []
            t0 = now()
            with torch.no_grad():
                res = engine.generate(Request(prompt=cfg["prompt"], negative_prompt=cfg["negative"],
                                              reference_images=(source,), width=cfg["size"], height=cfg["size"],
                                              steps=cfg["steps"], cfg_scale=cfg["cfg"], sampler="euler",
                                              seed=cfg["seed"]),
                                      callback=lambda i, n: ends.append(now()))
            t1 = now()
            start = t0 + res.timings["text"]
            ends = ends[-cfg["steps"]:]
            out["notes"] += [w for w in res.warnings if w not in out["notes"]]
            return {"text": marks["text"], "vae_encode": marks["vae_encode"], "conditioning": res.timings["text"],
                    "steps": [b - a for a, b in zip([start, *ends], ends)], "decode": res.timings["decode"],
                    "total": t1 - t0}, np.asarray(res.images[0].convert("RGB"))
except Exception as e:
    failed("loading", e)
out["ready_s"] = now() - t_start
out["rss_ready_mb"] = peak_mb()
try:
    timing, image = generate()
except Exception as e:
    failed("the generation", e)
out.update(timing)
Image.fromarray(image).save(os.path.join(cfg["artifacts"], cfg["slug"] + ".png"))
report()
"""

# stable-diffusion.cpp on the GGUF files: its log's text, source-encode and decode times replace the estimates here
SDCPP_CHILD = _PRELUDE + r"""
from importlib.metadata import version
from PIL import Image
from stable_diffusion_cpp import StableDiffusion
out["versions"] = {"stable-diffusion-cpp-python": version("stable-diffusion-cpp-python")}
f = cfg["sdcpp"]
try:
    sd = StableDiffusion(diffusion_model_path=f["transformer"], llm_path=f["text"], llm_vision_path=f["mmproj"],
                         vae_path=f["vae"], n_threads=cfg["threads"], verbose=True)
except Exception as e:
    failed("loading", e)
out["ready_s"] = now() - t_start
out["rss_ready_mb"] = peak_mb()
calls = []
t0 = now()
try:
    images = sd.generate_image(prompt=cfg["prompt"], negative_prompt=cfg["negative"],
                               ref_images=[Image.open(cfg["source"]).convert("RGB")], cfg_scale=cfg["cfg"],
                               sample_method="euler", sample_steps=cfg["steps"], seed=cfg["seed"],
                               width=cfg["size"], height=cfg["size"],
                               progress_callback=lambda step, n, t: calls.append((step, n, t, now())))
except Exception as e:
    failed("the generation", e)
t1 = now()
sampling = [c for c in calls if c[1] == cfg["steps"]][-cfg["steps"]:]
out.update(total=t1 - t0, steps=[c[2] for c in sampling])
if sampling:
    out["text"] = sampling[0][3] - sampling[0][2] - t0   # all before the first step, until the log says better
    out["decode"] = t1 - sampling[-1][3]
if not images:
    failed("the generation", RuntimeError("generate_image returned no image"))
images[0].save(os.path.join(cfg["artifacts"], cfg["slug"] + ".png"))
report()
"""


def _meminfo_mb() -> dict:
    return {ln.split(":")[0]: int(ln.split()[1]) / 1024 for ln in open("/proc/meminfo")}


def run_child(label: str, files: dict, artifacts: Path, timeout_s: float, log=print) -> dict:
    c = CONFIGS[label]
    cfg = {**c, "label": label, "size": SIZE, "steps": STEPS, "cfg": CFG, "prompt": INSTRUCTION, "negative": NEGATIVE,
           "seed": SEED, "threads": THREADS, "source": str(files["source"]), "artifacts": str(artifacts),
           "slug": f"{label.replace(' ', '-')}-{files['tag']}",
           "folder": str(files["folder"]) if files["folder"] else None}
    if c["files"] in ("fp8", "gguf"):
        f = files[c["files"]]
        cfg["split"] = {"transformer": str(f["transformer"]), "text": [str(p) for p in f["text"]]}
    sdcpp = c["engine"] == "sdcpp"
    if sdcpp:
        text, mmproj, vae = files["gguf"]["text"]
        cfg["sdcpp"] = {"transformer": str(files["gguf"]["transformer"]), "text": str(text), "mmproj": str(mmproj),
                        "vae": str(vae)}
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    load_before = os.getloadavg()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([str(SDCPP_PYTHON) if sdcpp else sys.executable, "-c", SDCPP_CHILD if sdcpp else CHILD,
                                 json.dumps(cfg)], stdout=out, stderr=err, env=env, cwd=str(ROOT))
        stopped = None
        while proc.poll() is None:
            mem = _meminfo_mb()
            if mem["MemAvailable"] < 1500:
                stopped = "stopped: the machine had under 1.5 GB left"
            elif time.perf_counter() - start > timeout_s:
                stopped = f"stopped: it ran past {timeout_s:.0f} s"
            if stopped:
                proc.kill()
                proc.wait()
                break
            time.sleep(1.0)
        wall = time.perf_counter() - start
        stdout, stderr = [(f.seek(0), f.read())[1] for f in (out, err)]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
    if sdcpp:
        res.update(sdcpp_log_times(stderr))
    if stopped:
        res["error"] = stopped
    elif proc.returncode or not lines:
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        res["error"] = f"failed (exit {proc.returncode}): " + (tail[-1] if tail else "no output")
    if res.get("error"):
        res["stderr_tail"] = stderr[-3000:]
    res.update(wall_s=wall, loadavg_before=load_before, loadavg_after=os.getloadavg())
    return res


# --- the report ----------------------------------------------------------------------------------------------------

def _med(runs: list[dict], get) -> float | None:
    xs = [v for r in runs if not r.get("error") for v in [get(r)] if v is not None]
    return statistics.median(xs) if xs else None


def _summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if not r.get("error")]
    return {"runs": len(runs), "ok": len(ok),
            "text": _med(ok, lambda r: r.get("text")), "vae_encode": _med(ok, lambda r: r.get("vae_encode")),
            "step1": _med(ok, lambda r: r["steps"][0] if r.get("steps") else None),
            "step": _med(ok, lambda r: statistics.median(r["steps"][1:]) if len(r.get("steps", [])) > 1 else None),
            "decode": _med(ok, lambda r: r.get("decode")), "total": _med(ok, lambda r: r.get("total")),
            "ready": _med(ok, lambda r: r.get("ready_s")), "peak": _med(ok, lambda r: r.get("peak_rss_mb")),
            "rss_ready": _med(ok, lambda r: r.get("rss_ready_mb")),
            "error": next((r["error"] for r in runs if r.get("error")), None),
            "resolved": next((r.get("resolved") for r in ok if r.get("resolved")), None)}


def body(raw: dict, h: str) -> list[str]:
    meta = raw["meta"]
    main = meta["main_tag"]
    p = meta["params"][main]
    b = lambda n: f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.0f}M"
    res = raw["results"].get(main, {})
    labels = [k for k in CONFIGS if k in res]
    s = {k: _summary(res[k]) for k in labels}
    ref = s.get(REF, {})
    fmt = lambda v, kind: "-" if v is None else (f"{v / 1024:.2f}" if kind == "gb" else f"{v:.1f}")

    sdcpp = s.get(SDCPP, {})

    def cell(k, key, kind="s"):
        v = s[k].get(key)
        txt = fmt(v, kind)
        ratios = []
        if k != REF and v is not None and ref.get(key):
            ratios.append(f"{v / ref[key]:.2f}x")
        if CONFIGS[k]["files"] == "gguf" and k != SDCPP and v is not None and sdcpp.get(key):
            ratios.append(f"{v / sdcpp[key]:.2f}x sd.cpp")   # the same files
        return txt + (f" ({', '.join(ratios)})" if ratios else "")

    lines = [f"{h} Qwen-Image-Edit", "",
             f"Qwen-Image-Edit-2509 (Edit Plus) at a REDUCED depth, the released widths: the transformer with "
             f"{meta['depth'][main]['blocks']} of its 60 blocks ({b(p['transformer'])} parameters), Qwen2.5-VL-7B's "
             f"language model with {meta['depth'][main]['text_layers']} of its 28 layers ({b(p['text'])}: the "
             f"152064 x 3584 embedding is 0.55B of it), its whole vision tower (32 blocks, {b(p['vision'])}), the VAE "
             f"at its released config ({b(p['vae'])}). Random weights built by `bench/edit.py` into "
             "`bench/cache/edit/` as a diffusers `QwenImageEditPlusPipeline` folder (bf16), ComfyUI's fp8 split files "
             "(fp8 e4m3 transformer, scaled-fp8 encoder with the tower under `visual.`, Wan-named VAE) and GGUF "
             "(Q4_K transformer blocks, Q4_K llama.cpp encoder, F16 mmproj tower; the Q4_K blocks are random bytes: "
             "the gguf package has no numpy Q4_K quantiser). One 1024^2 source picture (a drawn landscape), "
             f"\"{INSTRUCTION}\" with a negative prompt, cfg {CFG:g} (true CFG: two transformer passes a step), "
             f"{STEPS} Euler steps, seed {SEED}, 1024^2 output, {THREADS} threads, each configuration in a fresh "
             "process; sdlite at its automatic precision. Times are medians over the runs; the step is the "
             "median of the steps after the first (the first has one-off costs). \"text\" is the vision tower and "
             "the encoder over the prompt and the negative prompt; \"source encode\" the VAE over the source.", "",
             f"Machine: {meta['machine']}", "",
             f"Command: `{meta['command']}`, run {meta['date']}: {meta.get('wall_s', 0) / 60:.0f} min; load average "
             f"(1, 5, 15 min) {', '.join(f'{x:.2f}' for x in meta['loadavg_start'])} at the start, "
             f"{', '.join(f'{x:.2f}' for x in meta.get('loadavg_end', meta['loadavg_start']))} at the end"
             + ("; the load was above the 2 cores (other work on the machine), so the times are noisy."
                if max(meta['loadavg_start'][0], meta.get('loadavg_end', meta['loadavg_start'])[0]) > 2.5 else ".")
             + (f" {meta['note']}" if meta.get("note") else ""), "",
             "| measure | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name, key, kind in (("runs (ok / run)", None, None), ("import + load to ready, s", "ready", "s"),
                            ("text encoding (tower + encoder, cfg pair), s", "text", "s"),
                            ("source VAE encode, s", "vae_encode", "s"), ("first step (cfg: 2 passes), s", "step1", "s"),
                            ("step after the first (cfg: 2 passes), s", "step", "s"),
                            ("VAE decode 1024^2, s", "decode", "s"), ("whole generation, s", "total", "s"),
                            ("RSS at ready, GB", "rss_ready", "gb"), ("peak RSS, GB", "peak", "gb")):
        if key is None:
            lines.append(f"| {name} | " + " | ".join(f"{s[k]['ok']} / {s[k]['runs']}" for k in labels) + " |")
        else:
            lines.append(f"| {name} | " + " | ".join(cell(k, key, kind) for k in labels) + " |")
    if SDCPP in s:
        version = next((r["versions"]["stable-diffusion-cpp-python"] for r in res[SDCPP] if r.get("versions")), "?")
        lines += ["", f"{SDCPP}: stable-diffusion.cpp (stable-diffusion-cpp-python {version}, "
                  "built from source with GGML_NATIVE by `make setup-sdcpp`) on the same GGUF files (transformer, "
                  "encoder, mmproj tower, VAE), Euler, the same cfg, steps and size; its text, source-encode and "
                  "decode times are its log's. It runs the Edit Plus prompt, but gives the vision tower the source at "
                  "up to 560^2 pixels where the pipeline (and sdlite) give 384^2, about twice the tower's tokens; its "
                  "CFG has no norm rescale (the same two passes a step). It draws its noise with its own generator."]
    lines += ["", "Ratios in parentheses are against diffusers bf16 and, `x sd.cpp`, for the GGUF rows against "
              "stable-diffusion.cpp on the same files (lower is better). Resolved: " + "; ".join(
        f"{k}: {', '.join(f'{a}={v}' for a, v in s[k]['resolved'].items())}" for k in labels if s[k]["resolved"])
        + "."]
    errors = [f"- {k}: {s[k]['error']}" for k in labels if s[k]["error"]]
    if errors:
        lines += ["", "Failures:", "", *errors]
    # the depths
    tags = [t for t in meta["depth"] if t in raw["results"]]
    if len(tags) > 1:
        lines += ["", f"{h}# The mode-0 peak against depth", "",
                  "Memory mode 0 streams the transformer and the encoder layer by layer, so its peak should not grow "
                  "with the number of layers. The same files' kinds at more depths (mode 0, one fresh process each):",
                  "", "| files | " + " | ".join(f"{meta['depth'][t]['blocks']} blocks, {meta['depth'][t]['text_layers']} "
                                                 "encoder layers" for t in tags) + " |",
                  "|---|" + "---|" * len(tags)]
        for k in DEPTH_CONFIGS:
            cells = []
            for t in tags:
                runs = raw["results"][t].get(k)
                cells.append("-" if not runs else fmt(_summary(runs)["peak"], "gb") + " GB")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines += ["", "The released depth (60 blocks, 28 encoder layers): " + "; ".join(
            f"{k}: measured at depth {', '.join(str(meta['depth'][t]['blocks']) + '/' + str(meta['depth'][t]['text_layers']) for t in tags)}: "
            + " and ".join(fmt(_summary(raw['results'][t][k])['peak'], 'gb') + ' GB' for t in tags
                           if raw['results'][t].get(k))
            for k in DEPTH_CONFIGS) + ". The issue's targets: <= 6 GB from Q4_K GGUFs, <= 8 GB from fp8 files."]
    if meta.get("notes"):
        lines += ["", *meta["notes"]]
    return lines


def write_reports(raw: dict) -> None:
    REPORT.write_text("\n".join(body(raw, "#")).rstrip() + "\n", encoding="utf-8")
    section = "\n".join([MARK_BEGIN, *body(raw, "##"), "", "Raw figures: `bench/edit.json`; the report alone: "
                         "`bench/edit.md`.", MARK_END])
    bm = ROOT / "BENCHMARKS.md"
    text = bm.read_text(encoding="utf-8")
    begin, end = text.find(MARK_BEGIN), text.find(MARK_END)
    text = text[:begin] + section + text[end + len(MARK_END):] if 0 <= begin < end else \
        text.rstrip("\n") + "\n\n" + section + "\n"
    bm.write_text(text, encoding="utf-8")
    print(f"wrote {REPORT.name} and the Qwen-Image-Edit section of BENCHMARKS.md")


# --- main ----------------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2, help="transformer blocks (the release has 60)")
    ap.add_argument("--text-layers", type=int, default=2, help="encoder layers (the release has 28)")
    ap.add_argument("--depths", default="4:4", help="further blocks:text-layers for the mode-0 depth runs ('' none)")
    ap.add_argument("--only", default=None, help="labels to run at the main depth: " + ", ".join(CONFIGS))
    ap.add_argument("--repeat", type=int, default=1, help="fresh processes per configuration (alternating)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--skip-depths", action="store_true", help="run the main depth only")
    ap.add_argument("--depths-only", action="store_true", help="run the further depths only")
    ap.add_argument("--clean", action="store_true", help="delete bench/cache/edit/ and stop")
    ap.add_argument("--note", default=None)
    args = ap.parse_args()
    if args.clean:
        shutil.rmtree(CACHE, ignore_errors=True)
        return 0
    if args.report_only:
        raw = json.loads(RAW.read_text())
        if args.note is not None:
            raw["meta"]["note"] = args.note
            RAW.write_text(json.dumps(raw, indent=1) + "\n")
        write_reports(raw)
        return 0
    from run import cpu_facts, machine

    log = lambda m: print(m, flush=True)
    main_nets = networks(args.blocks, args.text_layers)
    depth_nets = [networks(*map(int, d.split(":"))) for d in args.depths.split(",") if d.strip()]
    for n in depth_nets:
        n["with_folder"] = False
    main_files = build(main_nets, log)
    depth_files = [build(n, log) for n in depth_nets]
    if args.build_only:
        return 0
    raw = json.loads(RAW.read_text()) if RAW.is_file() else {"results": {}}
    script = "bench/edit.py"
    meta = raw.get("meta", {})
    meta.update(date=time.strftime("%Y-%m-%d"), machine=machine(cpu_facts()), main_tag=main_files["tag"],
                command="python " + shlex.join([script, *sys.argv[1:]]), loadavg_start=os.getloadavg(), note=args.note)
    meta.setdefault("depth", {}).update({f["tag"]: {"blocks": n["transformer"].num_layers,
                                                   "text_layers": n["text"].num_hidden_layers}
                                         for f, n in [(main_files, main_nets), *zip(depth_files, depth_nets)]})
    meta.setdefault("params", {}).update({f["tag"]: f["params"] for f in [main_files, *depth_files]})
    raw["meta"] = meta
    artifacts = CACHE / "out"
    artifacts.mkdir(parents=True, exist_ok=True)
    labels = [k for k in CONFIGS if (k in args.only.split(",") if args.only else True)]
    plan = []
    for _ in range(args.repeat):
        # the targets' runs first (mode 0 at both depths, diffusers, sdlite's default mode), the rest after
        first = [k for k in (*DEPTH_CONFIGS, REF, "sdlite folder mode1") if k in labels]
        if not args.depths_only:
            plan += [(main_files, k) for k in first]
        if not args.skip_depths:
            plan += [(f, k) for f in depth_files for k in DEPTH_CONFIGS]
        if not args.depths_only:
            plan += [(main_files, k) for k in labels if k not in first]
    t0 = time.perf_counter()
    for files, label in plan:
        log(f"{label} [{files['tag']}] (load {os.getloadavg()[0]:.2f}) ...")
        r = run_child(label, files, artifacts, CHILD_TIMEOUT_S, log)
        raw["results"].setdefault(files["tag"], {}).setdefault(label, []).append(r)
        log(f"  {r.get('error') or ''} total {r.get('total', 0):.1f} s, steps "
            f"{[round(x, 1) for x in r.get('steps', [])]}, text {r.get('text', 0):.1f}, decode "
            f"{r.get('decode', 0):.1f}, peak {r.get('peak_rss_mb', 0) / 1024:.2f} GB, wall {r['wall_s']:.0f} s")
        meta["loadavg_end"] = os.getloadavg()
        meta["wall_s"] = meta.get("wall_s", 0) + 0
        RAW.write_text(json.dumps(raw, indent=1) + "\n")
    meta["wall_s"] = time.perf_counter() - t0
    RAW.write_text(json.dumps(raw, indent=1) + "\n")
    write_reports(raw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
