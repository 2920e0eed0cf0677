"""The UNet at the real SD 1.5 and SD 2.1 shapes, on the meta device: sdlite's network has diffusers'
UNet2DConditionModel's every key and shape (built from the same config), so the one takes the other's weights
strictly, and the published parameter counts.

Their outputs with the same (random) weights at these shapes are compared by bench/parity.py; the forward pass
is held to diffusers' on tiny configs of both families by tests/test_models_parity.py, and at SDXL's full size by
tests/test_sdxl_fullsize.py."""
from __future__ import annotations

import pytest
import torch

from sdlite.config import SD15, SD21_V
from sdlite.models.unet import UNet
from tests.reference import diffusers_unet


@pytest.mark.parametrize("spec,parameters", [(SD15, 859_520_964), (SD21_V, 865_910_724)], ids=["sd15", "sd21"])
def test_full_size_unet_has_diffusers_keys_and_shapes(spec, parameters):
    """Same keys and shapes as diffusers' network; a strict load of its state; 859.5M (SD 1.5) and 865.9M (SD 2.1)
    parameters."""
    with torch.device("meta"):
        ref = diffusers_unet(spec.unet)
        ours = UNet(spec.unet)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    n_params = sum(p.numel() for p in ours.parameters())
    assert n_params == sum(p.numel() for p in ref.parameters()) == parameters
