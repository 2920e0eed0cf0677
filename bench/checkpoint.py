"""Build (once) and cache a full-size SD 1.5 checkpoint with random weights, fp16, in both layouts.

Real weights cannot be downloaded here; speed and memory do not depend on the values, only on the shapes
and the storage dtype, so random weights at the real SD 1.5 shapes measure the same thing.

    python bench/checkpoint.py [CACHE_DIR]     -> CACHE_DIR/sd15-fp16/ (diffusers) and CACHE_DIR/sd15-fp16.safetensors
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

DEFAULT_CACHE = Path(__file__).resolve().parent / "cache"


def build(cache: Path = DEFAULT_CACHE) -> tuple[Path, Path]:
    from sdlite.config import SD15
    from sdlite.export import save_diffusers, save_single_file
    from sdlite.loader import StableDiffusion
    from sdlite.models.clip import CLIPTextEncoder
    from sdlite.models.unet import UNet
    from sdlite.models.vae import AutoencoderKL
    from sdlite.tokenizers.clip_bpe import CLIPTokenizer

    folder, single = cache / "sd15-fp16", cache / "sd15-fp16.safetensors"
    if folder.is_dir() and single.is_file():
        return folder, single
    cache.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    with torch.no_grad():  # PyTorch's default initialisation: activations stay in a realistic range
        model = StableDiffusion(spec=SD15, tokenizer=CLIPTokenizer.from_package(),
                                text_encoder=CLIPTextEncoder(SD15.text), unet=UNet(SD15.unet),
                                vae=AutoencoderKL(SD15.vae), scheduler_config=dict(SD15.scheduler))
    if not folder.is_dir():
        save_diffusers(model, folder, dtype=torch.float16)
    if not single.is_file():
        save_single_file(model, single, dtype=torch.float16)
    return folder, single


if __name__ == "__main__":
    for p in build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE):
        print(p)
