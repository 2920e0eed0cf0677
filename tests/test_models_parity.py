"""Our text encoder, UNet and VAE against transformers'/diffusers' implementations with the same weights."""
from __future__ import annotations

import pytest
import torch

from sdlite.models.clip import CLIPTextEncoder
from sdlite.models.unet import UNet
from sdlite.models.vae import AutoencoderKL
from tests.reference import (TINY_TEXT_SD1, TINY_TEXT_SD2, TINY_UNET_INPAINT, TINY_UNET_SD1, TINY_UNET_SD2,
                             TINY_VAE, diffusers_unet, diffusers_vae, max_rel_err, seed_all, transformers_text)

TOL = 1e-4


def _load_same(ours: torch.nn.Module, ref: torch.nn.Module):
    """Copy the reference's weights into ours key for key (strict: the names are the contract)."""
    ref_sd = {k: v for k, v in ref.state_dict().items() if not k.endswith("position_ids")}
    if isinstance(ours, CLIPTextEncoder) and not any(k.startswith("text_model.") for k in ref_sd):
        # transformers 5 names CLIPTextModel's parameters without the ``text_model.`` prefix that the
        # folders people have (written by transformers 4) carry; ours keep the prefix
        ref_sd = {f"text_model.{k}": v for k, v in ref_sd.items()}
    ours.load_state_dict(ref_sd, strict=True)
    return ours.eval()


@pytest.mark.parametrize("cfg", [TINY_TEXT_SD1, TINY_TEXT_SD2], ids=["sd1", "sd2"])
def test_text_encoder_matches_transformers(cfg):
    ref = seed_all(transformers_text(cfg))
    ours = _load_same(CLIPTextEncoder(cfg), ref)
    ids = torch.randint(0, cfg.vocab_size, (2, 77), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
        assert max_rel_err(ours(ids), out.last_hidden_state) <= TOL
        # clip skip 2 (A1111 numbering) = penultimate hidden state through the final LayerNorm
        penult = ref.final_layer_norm(out.hidden_states[-2])
        assert max_rel_err(ours(ids, clip_skip=2), penult) <= TOL


def test_text_encoder_clip_skip_out_of_range():
    enc = CLIPTextEncoder(TINY_TEXT_SD1)
    with pytest.raises(ValueError, match=r"clip_skip=4 .* 1\.\.3"):
        enc(torch.zeros(1, 77, dtype=torch.long), clip_skip=4)


@pytest.mark.parametrize("cfg", [TINY_UNET_SD1, TINY_UNET_SD2, TINY_UNET_INPAINT], ids=["sd1", "sd2", "inpaint"])
@pytest.mark.parametrize("size", [(16, 16), (12, 20)], ids=["square", "odd-levels"])
def test_unet_matches_diffusers(cfg, size):
    ref = seed_all(diffusers_unet(cfg), scale=0.05)
    ours = _load_same(UNet(cfg), ref)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, cfg.in_channels, *size, generator=g)
    ctx = torch.randn(2, 77, cfg.context_dim, generator=g)
    t = torch.tensor([999.0, 17.5])
    with torch.no_grad():
        expected = ref(x, t, encoder_hidden_states=ctx).sample
        got = ours(x, t, ctx)
    assert got.shape == expected.shape
    assert max_rel_err(got, expected) <= TOL


def test_vae_matches_diffusers():
    ref = seed_all(diffusers_vae(TINY_VAE), scale=0.05)
    ours = _load_same(AutoencoderKL(TINY_VAE), ref)
    g = torch.Generator().manual_seed(3)
    img = torch.rand(2, 3, 32, 48, generator=g) * 2 - 1
    z = torch.randn(2, 4, 8, 6, generator=g)
    with torch.no_grad():
        dist = ref.encode(img).latent_dist
        mean, logvar = ours.encode_moments(img)
        assert max_rel_err(mean, dist.mean) <= TOL
        assert max_rel_err(logvar, dist.logvar) <= TOL
        assert max_rel_err(ours.decode(z), ref.decode(z).sample) <= TOL
