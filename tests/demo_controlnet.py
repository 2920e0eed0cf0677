"""A tiny ControlNet for the shipped demo model, for the server, batch and web-page tests: diffusers'
``ControlNetModel.from_unet`` of the demo UNet (its hint encoder's four widths give the demo VAE's 8x), with seeded
random weights and output convolutions strong enough that the control shows in the image. Nothing is downloaded."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file

from sdlite.demo import model_path
from tests.reference import seed_all


def build(seed: int = 40):
    from diffusers import ControlNetModel, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(model_path() / "unet")
    cn = seed_all(ControlNetModel.from_unet(unet), seed, scale=0.05)
    with torch.no_grad():
        for conv in [*cn.controlnet_down_blocks, cn.controlnet_mid_block]:
            conv.weight.mul_(40)
    return cn.eval()


def write(folder: Path, seed: int = 40) -> dict[str, Path]:
    """Two ControlNets in ``folder``: ``demo-control`` (a diffusers folder) and ``control_demo_edges.safetensors``
    (one file, diffusers keys, another seed). Returns their paths by A1111 name."""
    folder.mkdir(parents=True, exist_ok=True)
    one = build(seed)
    one.save_pretrained(folder / "demo-control")
    two = build(seed + 1)
    save_file({k: v.contiguous() for k, v in two.state_dict().items()}, folder / "control_demo_edges.safetensors")
    return {"demo-control": folder / "demo-control", "control_demo_edges": folder / "control_demo_edges.safetensors"}


def shape_image(size: int = 64, box=(16, 12, 50, 44)) -> Image.Image:
    """A control image with edges: a light square and a dark disc on grey."""
    image = Image.new("RGB", (size, size), (120, 120, 120))
    draw = ImageDraw.Draw(image)
    draw.rectangle(box, fill=(240, 240, 240))
    draw.ellipse((box[0] + 6, box[1] + 6, box[2] - 6, box[3] - 6), fill=(20, 30, 40))
    return image


def noise_image(size: int = 64, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
