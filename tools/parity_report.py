"""Print sdlite's parity figures against transformers/diffusers (max relative error, fp32, same random weights).

    python tools/parity_report.py [--full]     (--full adds the full-size SD 1.5 and SD 2.1 UNets)

The same comparisons are asserted (<= 1e-4) in tests/test_models_parity.py and tests/test_unet_fullsize.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sdlite.config import SD15, SD21_V  # noqa: E402
from sdlite.models.clip import CLIPTextEncoder  # noqa: E402
from sdlite.models.unet import UNet  # noqa: E402
from sdlite.models.vae import AutoencoderKL  # noqa: E402
from tests.reference import (TINY_TEXT_SD1, TINY_TEXT_SD2, TINY_UNET_INPAINT, TINY_UNET_SD1,  # noqa: E402
                             TINY_UNET_SD2, TINY_VAE, diffusers_unet, diffusers_vae, max_rel_err, seed_all,
                             transformers_text)


def same(ours, ref):
    sd = {k: v for k, v in ref.state_dict().items() if not k.endswith("position_ids")}
    if isinstance(ours, CLIPTextEncoder) and not any(k.startswith("text_model.") for k in sd):
        sd = {f"text_model.{k}": v for k, v in sd.items()}
    ours.load_state_dict(sd, strict=True, assign=True)
    return ours.eval()


@torch.no_grad()
def main():
    g = torch.Generator().manual_seed(0)
    for name, cfg in (("text encoder sd1 (tiny)", TINY_TEXT_SD1), ("text encoder sd2 (tiny)", TINY_TEXT_SD2)):
        ref = seed_all(transformers_text(cfg))
        ids = torch.randint(0, cfg.vocab_size, (2, 77), generator=g)
        print(f"{name:<28} {max_rel_err(same(CLIPTextEncoder(cfg), ref)(ids), ref(ids).last_hidden_state):.2e}")
    for name, cfg in (("unet sd1 (tiny)", TINY_UNET_SD1), ("unet sd2 (tiny)", TINY_UNET_SD2),
                      ("unet inpaint (tiny)", TINY_UNET_INPAINT)):
        ref = seed_all(diffusers_unet(cfg), scale=0.05)
        x = torch.randn(2, cfg.in_channels, 16, 16, generator=g)
        ctx, t = torch.randn(2, 77, cfg.context_dim, generator=g), torch.tensor([999.0, 17.5])
        err = max_rel_err(same(UNet(cfg), ref)(x, t, ctx), ref(x, t, encoder_hidden_states=ctx).sample)
        print(f"{name:<28} {err:.2e}")
    ref = seed_all(diffusers_vae(TINY_VAE), scale=0.05)
    ours = same(AutoencoderKL(TINY_VAE), ref)
    img, z = torch.rand(1, 3, 32, 32, generator=g) * 2 - 1, torch.randn(1, 4, 8, 8, generator=g)
    print(f"{'vae encode mean (tiny)':<28} {max_rel_err(ours.encode_moments(img)[0], ref.encode(img).latent_dist.mean):.2e}")
    print(f"{'vae decode (tiny)':<28} {max_rel_err(ours.decode(z), ref.decode(z).sample):.2e}")
    if "--full" in sys.argv:
        for name, spec in (("unet SD 1.5 (full size)", SD15), ("unet SD 2.1 (full size)", SD21_V)):
            torch.manual_seed(0)
            ref = diffusers_unet(spec.unet)
            with torch.device("meta"):
                ours = UNet(spec.unet)
            ours = same(ours, ref)
            x, ctx = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, spec.unet.context_dim, generator=g)
            t = torch.tensor([981.0, 1.0])
            print(f"{name:<28} {max_rel_err(ours(x, t, ctx), ref(x, t, encoder_hidden_states=ctx).sample):.2e}")
            del ref, ours


if __name__ == "__main__":
    main()
