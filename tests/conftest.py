"""Shared fixtures. Nothing here downloads anything."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def sd15_folder(tmp_path_factory):
    """A full-size SD 1.5 diffusers folder (fp32, random weights at the real shapes), built once per session."""
    import torch

    from sdlite.config import SD15
    from sdlite.export import save_diffusers
    from sdlite.loader import StableDiffusion
    from sdlite.models.clip import CLIPTextEncoder
    from sdlite.models.unet import UNet
    from sdlite.models.vae import AutoencoderKL
    from sdlite.tokenizer import CLIPTokenizer

    folder = tmp_path_factory.mktemp("sd15") / "sd15"
    torch.manual_seed(0)
    model = StableDiffusion(spec=SD15, tokenizer=CLIPTokenizer.from_package(), text_encoder=CLIPTextEncoder(SD15.text),
                            unet=UNet(SD15.unet), vae=AutoencoderKL(SD15.vae), scheduler_config=dict(SD15.scheduler))
    save_diffusers(model, folder)
    del model
    return folder
