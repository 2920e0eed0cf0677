"""Qwen-Image's VAE on one frame (sdlite.models.qwenimage_vae) against diffusers' AutoencoderKLQwenImage built from the
same config with random weights: encode and decode of a tiny config within fp32 rounding (diffusers runs the causal 3D
convolutions over zero frames; sdlite the last temporal tap in 2D), the pipelines' latent normalisation, the
released architecture on the meta device, errors."""
from __future__ import annotations

import pytest
import torch

from sdlite.config import ConfigError
from sdlite.config.qwenimage_vae import QWEN_IMAGE_VAE, QwenImageVAEConfig
from sdlite.errors import RequestError
from sdlite.models.qwenimage_vae import QwenImageVAE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(base_dim=8, z_dim=4, dim_mult=(1, 2, 2, 2), latents_mean=(0.1, -0.2, 0.3, 0.0),
            latents_std=(1.5, 2.0, 0.5, 1.0))


def _diffusers(cfg: QwenImageVAEConfig):
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(**{k: v for k, v in cfg.to_diffusers().items() if not k.startswith("_")}).eval()


@pytest.fixture(scope="module")
def pair():
    cfg = QwenImageVAEConfig(**TINY)
    ref = _diffusers(cfg)
    g = torch.Generator().manual_seed(0)
    ref.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.2 + (1.0 if "gamma" in k else 0.0)
                         for k, v in ref.state_dict().items()})
    ours = QwenImageVAE(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def test_encode_matches_diffusers(pair):
    """A 32x48 image, batch 2: the posterior's mean and log-variance, and the edit pipelines' normalised latent."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import retrieve_latents

    ref, ours = pair
    image = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        dist = ref.encode(image[:, :, None]).latent_dist
        mean, logvar = ours.moments(image)
        want = retrieve_latents(ref.encode(image[:, :, None]), sample_mode="argmax")[:, :, 0]
        got = ours.encode(image)
    assert got.shape == (2, 4, 4, 6)
    torch.testing.assert_close(mean, dist.mean[:, :, 0], rtol=0, atol=2e-6)
    torch.testing.assert_close(logvar, dist.logvar[:, :, 0], rtol=0, atol=2e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    stats = [torch.tensor(v).view(1, 4, 1, 1) for v in (TINY["latents_mean"], TINY["latents_std"])]
    torch.testing.assert_close(ours.normalize(got), (want - stats[0]) / stats[1], rtol=0, atol=1e-5)


def test_decode_matches_diffusers(pair):
    """A 5x7 latent (odd sizes), batch 2, through the pipelines' denormalisation: the image within fp32 rounding,
    clamped to [-1, 1]."""
    ref, ours = pair
    z = torch.randn(2, 4, 5, 7, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        latent = ours.denormalize(z)
        std = 1.0 / torch.tensor(TINY["latents_std"]).view(1, 4, 1, 1)
        assert torch.equal(latent, z / std + torch.tensor(TINY["latents_mean"]).view(1, 4, 1, 1))
        want = ref.decode(latent[:, :, None]).sample[:, :, 0]
        got = ours.decode(latent)
    assert got.shape == (2, 3, 40, 56) and got.abs().max() <= 1
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_released_architecture_on_meta():
    """Qwen-Image's VAE: diffusers' every key and shape (the temporal convolutions' 5-D weights included), a strict
    load, the parameter count."""
    with torch.device("meta"):
        ref = _diffusers(QWEN_IMAGE_VAE)
        ours = QwenImageVAE(QWEN_IMAGE_VAE)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    assert sum(p.numel() for p in ours.parameters()) == 126_892_531
    assert QWEN_IMAGE_VAE.scale_factor == 8 and QWEN_IMAGE_VAE.latent_channels == 16


def test_config_and_errors(pair):
    _, ours = pair
    assert QwenImageVAEConfig.from_diffusers(QWEN_IMAGE_VAE.to_diffusers()) == QWEN_IMAGE_VAE
    assert QwenImageVAEConfig.from_diffusers({"_class_name": "AutoencoderKLQwenImage"}) == QWEN_IMAGE_VAE
    with pytest.raises(ConfigError, match=r"\['bogus'\]"):
        QwenImageVAEConfig.from_diffusers({"bogus": 1})
    with pytest.raises(ConfigError, match="_class_name"):
        QwenImageVAEConfig.from_diffusers({"_class_name": "AutoencoderKLWan"})
    with pytest.raises(ConfigError, match="latents_std has 3 values"):
        QwenImageVAEConfig(latents_std=(1.0, 1.0, 1.0))
    with pytest.raises(ConfigError, match="attn_scales"):
        QwenImageVAEConfig(attn_scales=(0.5,))
    with pytest.raises(ConfigError, match="temperal_downsample"):
        QwenImageVAEConfig(temperal_downsample=(True,))
    with pytest.raises(RequestError, match="multiples of 8"):
        ours.encode(torch.zeros(1, 3, 30, 32))
    with pytest.raises(RequestError, match="latent has shape"):
        ours.decode(torch.zeros(1, 16, 4, 4))
