"""Shared fixtures. Nothing here downloads anything."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny models (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): one torch
    thread runs them faster than two, and a second thread's spin-waits and barriers cost seconds on a busy
    machine. The thread count is restored after the module."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    from sdlite.tokenizers.clip_bpe import CLIPTokenizer

    folder = tmp_path_factory.mktemp("sd15") / "sd15"
    torch.manual_seed(0)
    model = StableDiffusion(spec=SD15, tokenizer=CLIPTokenizer.from_package(), text_encoder=CLIPTextEncoder(SD15.text),
                            unet=UNet(SD15.unet), vae=AutoencoderKL(SD15.vae), scheduler_config=dict(SD15.scheduler))
    save_diffusers(model, folder)
    del model
    return folder


@pytest.fixture(scope="session")
def sd15_inpaint_folder(sd15_folder, tmp_path_factory):
    """A full-size SD 1.5 inpainting diffusers folder (9-channel UNet), built once per session from
    ``sd15_folder``: its text encoder, VAE, tokenizer and scheduler are shared through symlinks, and its UNet is
    the same but for a 9-channel ``conv_in``, stored in fp16 (half the size to write; both readers up-cast)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("sd15_inpaint") / "sd15-inpaint"
    folder.mkdir()
    for sub in ("text_encoder", "vae", "tokenizer", "scheduler"):
        (folder / sub).symlink_to(sd15_folder / sub, target_is_directory=True)
    (folder / "model_index.json").write_text((sd15_folder / "model_index.json").read_text())
    (folder / "unet").mkdir()
    config = json.loads((sd15_folder / "unet" / "config.json").read_text())
    (folder / "unet" / "config.json").write_text(json.dumps({**config, "in_channels": 9}))
    state = load_file(sd15_folder / "unet" / "diffusion_pytorch_model.safetensors")
    weight = state["conv_in.weight"]
    extra = torch.randn(weight.shape[0], 5, *weight.shape[2:], generator=torch.Generator().manual_seed(9))
    state["conv_in.weight"] = torch.cat([weight, extra * weight.std()], dim=1)
    save_file({k: v.half().contiguous() for k, v in state.items()},
              folder / "unet" / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    del state
    return folder
