"""Writing a loaded model in either layout: a diffusers folder or an original single ``.safetensors`` file.

Both writers refuse to replace anything that exists; tensors are written one at a time from the loaded
modules (converted lazily through the key tables for the single-file layout).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .config import explicit_spacing, is_bert
from .errors import CheckpointError
from .loader import META_CONFIG, META_PREDICTION, StableDiffusion
from .weights.convert import plan_to_original
from .weights.detect import META_TURBO
from .weights.safetensors import save_safetensors

DIFFUSERS_VERSION = "0.30.0"  # the folder format written (readable by diffusers >= 0.21)


def _state(module: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in module.state_dict().items():
        v = v.detach().cpu()
        out[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_diffusers(model: StableDiffusion, folder: str | os.PathLike, dtype: torch.dtype | None = None,
                   variant: str | None = None) -> Path:
    """Write ``model`` as a diffusers folder (``model_index.json``, ``unet/``, ``vae/``, ``text_encoder/``,
    ``tokenizer/``, ``scheduler/``). ``variant="fp16"`` names the weight files ``*.fp16.safetensors``."""
    folder = Path(folder)
    if folder.exists():
        raise CheckpointError("refusing to write a diffusers folder over something that exists", folder)
    suffix = f".{variant}.safetensors" if variant else ".safetensors"
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        spec = model.spec
        for sub, module, config, base in (
            ("unet", model.unet, spec.unet.to_diffusers(), "diffusion_pytorch_model"),
            ("vae", model.vae, spec.vae.to_diffusers(), "diffusion_pytorch_model"),
            ("text_encoder", model.text_encoder, spec.text.to_diffusers(), "model"),
        ):
            (tmp / sub).mkdir()
            config = {**config, "_diffusers_version": DIFFUSERS_VERSION} if sub != "text_encoder" else config
            _write_json(tmp / sub / "config.json", config)
            save_safetensors(_state(module, dtype), tmp / sub / f"{base}{suffix}", metadata={"format": "pt"})
        _write_tokenizer(model, tmp / "tokenizer")
        (tmp / "scheduler").mkdir()
        # the spacing is written out, resolved from the class the model's config names (PNDM by default), so
        # that the folder means the same to any reader whatever scheduler class it is later given
        scheduler, _ = explicit_spacing({"_class_name": "PNDMScheduler", **spec.scheduler})
        _write_json(tmp / "scheduler" / "scheduler_config.json", {
            "_class_name": "PNDMScheduler", "_diffusers_version": DIFFUSERS_VERSION, "skip_prk_steps": True,
            **{k: v for k, v in scheduler.items() if not k.startswith("_")},
            "prediction_type": spec.prediction_type,
        })
        _write_json(tmp / "model_index.json", {
            "_class_name": "StableDiffusionInpaintPipeline" if spec.unet.in_channels == 9
            else "StableDiffusionPipeline",
            "_diffusers_version": DIFFUSERS_VERSION,
            "feature_extractor": [None, None], "safety_checker": [None, None], "requires_safety_checker": False,
            "scheduler": ["diffusers", "PNDMScheduler"],
            "text_encoder": ["transformers", "BertModel" if is_bert(spec.text) else "CLIPTextModel"],
            "tokenizer": ["transformers", "BertTokenizer" if model.tokenizer.kind == "wordpiece"
                          else "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        })
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the folder gets the usual permissions
        os.rename(tmp, folder)  # fails rather than replaces if the folder appeared meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _write_tokenizer(model: StableDiffusion, folder: Path) -> None:
    tok = model.tokenizer
    folder.mkdir()
    if tok.kind == "wordpiece":   # BERT's files: vocab.txt (one token a line, in id order) and the settings
        (folder / "vocab.txt").write_text("\n".join(tok.vocab) + "\n", encoding="utf-8")
        special = dict(tok.special_tokens)
        _write_json(folder / "special_tokens_map.json", special)
        _write_json(folder / "tokenizer_config.json", {
            **special, "tokenizer_class": "BertTokenizer", "model_max_length": tok.max_length,
            "do_lower_case": tok.do_lower_case, "strip_accents": tok.strip_accents,
            "tokenize_chinese_chars": tok.tokenize_chinese_chars})
        return
    (folder / "vocab.json").write_text(json.dumps(tok.encoder, ensure_ascii=False), encoding="utf-8")
    merges = "\n".join(f"{a} {b}" for a, b in tok.merges)
    (folder / "merges.txt").write_text(f"#version: 0.2\n{merges}\n", encoding="utf-8")
    pad = tok.decoder[tok.pad_token_id]
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "pad_token": pad}
    _write_json(folder / "special_tokens_map.json", special)
    _write_json(folder / "tokenizer_config.json", {
        **special, "tokenizer_class": "CLIPTokenizer", "model_max_length": tok.max_length,
        "do_lower_case": True, "errors": "replace", "add_prefix_space": False,
    })


def save_single_file(model: StableDiffusion, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` as one original-layout ``.safetensors`` file (``model.diffusion_model.*``,
    ``first_stage_model.*``, ``cond_stage_model.*``; SDXL: ``conditioner.embedders.*``, as Stability publishes
    it), as A1111, ComfyUI and diffusers' single-file loader read."""
    path = Path(path)
    spec = model.spec
    if is_bert(spec.text):
        raise CheckpointError("a model with a BERT text encoder (Taiyi) has no original single-file layout that "
                              "other tools read; save it as a diffusers folder", path)
    states = {name: _state(module, dtype) for name, module in model.networks().items()}
    plan = plan_to_original({name: list(sd) for name, sd in states.items()},
                            text_encoder="openclip" if spec.family.startswith("sd2") else "clip",
                            unet_structure=spec.unet, vae_levels=len(spec.vae.block_channels))
    merged = plan.merge(states)
    tensors = {k: merged[k].contiguous() for k in merged}
    configs = {"unet": spec.unet.to_diffusers(), "vae": spec.vae.to_diffusers()}
    for name, cfg in (("text_encoder", spec.text), ("text_encoder_2", spec.text2)):
        if cfg is not None:
            configs[name] = cfg.to_diffusers()
    metadata = {META_PREDICTION: spec.prediction_type, META_CONFIG: json.dumps(configs), "sdlite.family": spec.family}
    if spec.turbo:
        metadata[META_TURBO] = "true"
    save_safetensors(tensors, path, metadata=metadata)
    return path
