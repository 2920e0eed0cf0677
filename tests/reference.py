"""Builders of the reference implementations (diffusers / transformers) from our configs, random weights.

Nothing here downloads anything: every reference model is constructed from a config dict.
"""
from __future__ import annotations

import torch

from sdlite.config import TextEncoderConfig, UNetConfig, VAEConfig

# Tiny configs for every variant (channels like 32/64), as diffusers' own tests use.
TINY_TEXT_SD1 = TextEncoderConfig(vocab_size=1000, width=32, layers=3, heads=4, mlp_width=37)
TINY_TEXT_SD2 = TextEncoderConfig(vocab_size=1000, width=32, layers=3, heads=4, mlp_width=64,
                                  activation="gelu", pad_token_id=0)
TINY_UNET_SD1 = UNetConfig(block_channels=(32, 64), layers_per_block=2, attention=(True, False),
                           heads=(2, 2), context_dim=32, sample_size=16)
TINY_UNET_SD2 = UNetConfig(block_channels=(32, 64), layers_per_block=2, attention=(True, True),
                           heads=(2, 4), context_dim=32, linear_projection=True, sample_size=16)
TINY_UNET_INPAINT = UNetConfig(in_channels=9, block_channels=(32, 64), layers_per_block=1,
                               attention=(False, True), heads=(2, 2), context_dim=32, sample_size=16)
TINY_VAE = VAEConfig(block_channels=(32, 64), layers_per_block=1, sample_size=32)


def seed_all(module: torch.nn.Module, seed: int = 0, scale: float = 0.2) -> torch.nn.Module:
    """Deterministic random weights, biases and norms included (so nothing sits at its neutral init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.state_dict().items()):
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    return module


def diffusers_unet(cfg: UNetConfig):
    from diffusers import UNet2DConditionModel

    d = cfg.to_diffusers()
    d.pop("_class_name")
    return UNet2DConditionModel(**d).eval()


def diffusers_vae(cfg: VAEConfig):
    from diffusers import AutoencoderKL

    d = cfg.to_diffusers()
    d.pop("_class_name")
    return AutoencoderKL(**d).eval()


def transformers_text(cfg: TextEncoderConfig):
    from transformers import CLIPTextConfig, CLIPTextModel

    d = cfg.to_diffusers()
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k)
    model = CLIPTextModel(CLIPTextConfig(**d, attn_implementation="eager")).eval()
    return model


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|: the figure the issues hold us to."""
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
