"""The UNet at the real SD 1.5 and SD 2.1 shapes against diffusers, with the same (random) weights.

Weights are shared, not copied (ours is built on the meta device and takes the reference's tensors), so
one full-size model costs ~3.4 GB; a small latent keeps the forward pass to seconds.
"""
from __future__ import annotations

import pytest
import torch

from sdlite.config import SD15, SD21_V
from sdlite.models.unet import UNet
from tests.reference import diffusers_unet, max_rel_err

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("spec", [SD15, SD21_V], ids=["sd15", "sd21"])
def test_full_size_unet_matches_diffusers(spec):
    torch.manual_seed(0)
    ref = diffusers_unet(spec.unet)
    with torch.device("meta"):
        ours = UNet(spec.unet)
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    ours.eval()
    n_params = sum(p.numel() for p in ours.parameters())
    assert n_params == sum(p.numel() for p in ref.parameters())
    assert 859e6 < n_params < 866e6  # SD 1.5: 859.5M, SD 2.1: 865.9M

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 16, 16, generator=g)
    ctx = torch.randn(2, 77, spec.unet.context_dim, generator=g)
    t = torch.tensor([981.0, 1.0])
    with torch.no_grad():
        expected = ref(x, t, encoder_hidden_states=ctx).sample
        got = ours(x, t, ctx)
    err = max_rel_err(got, expected)
    print(f"{spec.family} full-size UNet max rel err {err:.2e}")
    assert err <= 1e-4
