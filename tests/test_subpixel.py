"""Decoders' nearest-2x upsampling and the 3x3 convolution after it as four 2x2 convolutions of the small image
(sdlite/engine/subpixel.py): the same function as the upsampled convolution, used by the VAE and a TAESD under the
bf16 precisions and never on the exact path."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sdlite.config import TAESDConfig
from sdlite.demo import model_path
from sdlite.engine.precision import PrecisionError
from sdlite.engine.quant import BF16Warning
from sdlite.engine.subpixel import PhaseUpsample, PhaseUpsampleConv, interleave, phase_conv, phase_upsample_model
from sdlite.engine.tiling import tiled_decode
from sdlite.models.layers import Upsample
from sdlite.models.taesd import TinyAutoencoder
from sdlite.models.vae import AutoencoderKL
from sdlite.pipeline import Engine
from tests.reference import TINY_VAE, diffusers_vae, seed_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("batch,cin,cout,h,w,bias,channels_last", [
    (1, 8, 6, 5, 7, True, False), (2, 16, 16, 9, 4, False, True), (1, 3, 5, 1, 1, True, False),
    (2, 32, 8, 6, 6, True, True)])
def test_phases_equal_the_upsampled_convolution(batch, cin, cout, h, w, bias, channels_last):
    """In float64 the four 2x2 convolutions give the upsampled 3x3 convolution's values to rounding, in the input's
    memory format, every border and odd size included."""
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=bias).double()
    x = torch.randn(batch, cin, h, w, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    want = conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
    with torch.no_grad():
        got = interleave(phase_conv(conv)(x), x)
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-12
    if h * w > 1:
        assert got.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_a_layer_keeps_its_convolution_for_other_sizes():
    """Upsampling to a size other than 2x (a UNet's odd latent) runs the upsampled convolution, as before."""
    torch.manual_seed(1)
    up = Upsample(8).double()
    phases = PhaseUpsample(up)
    x = torch.randn(1, 8, 5, 6, dtype=torch.float64)
    with torch.no_grad():
        assert (phases(x) - up(x)).abs().max().item() < 1e-12
        assert torch.equal(phases(x, size=(11, 13)), up(x, size=(11, 13)))
    assert phases.conv is up.conv and phases.phases.weight.shape == (32, 8, 2, 2)
    with pytest.raises(ValueError, match="3x3 convolution with padding 1"):
        PhaseUpsampleConv(nn.Conv2d(8, 8, 3, padding=0))


def _vae():
    ref = seed_all(diffusers_vae(TINY_VAE), scale=0.05)
    ours = AutoencoderKL(TINY_VAE)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours.eval()


def test_vae_and_taesd_in_bf16_decode_as_near_fp32_as_without_it():
    """A VAE's and a TAESD's decoders in bf16 (channels-last, as the engine runs them) with their upsamplers by phases:
    every upsampler replaced, and the images as near the fp32 decoders' as the bf16 decoders' without them."""
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(2)
    taesd = TinyAutoencoder(TAESDConfig()).eval()
    for p in taesd.parameters():
        p.data.mul_(0.6)
    for model, z, decode in ((_vae(), torch.randn(2, 4, 8, 6, generator=g), "decode"),
                             (taesd, torch.randn(1, 4, 8, 8, generator=g), "decode")):
        with torch.no_grad():
            want = getattr(model, decode)(z).double()
            plain = copy.deepcopy(model).to(torch.bfloat16).to(memory_format=torch.channels_last)
            phased = phase_upsample_model(copy.deepcopy(plain))
            ups = [m for m in phased.modules() if isinstance(m, (PhaseUpsample, PhaseUpsampleConv))]
            assert len(ups) == (len(TINY_VAE.block_channels) - 1 if isinstance(model, AutoencoderKL)
                                else len(TAESDConfig().decoder_blocks) - 1)
            assert not [m for m in phased.modules() if type(m) in (Upsample, nn.Upsample)]
            zb = z.to(torch.bfloat16)
            got, base = getattr(phased, decode)(zb).double(), getattr(plain, decode)(zb).double()
        scale = want.abs().max().item()
        assert scale > 0.05 and (got - want).abs().max().item() <= 0.04 * scale
        assert (got - want).abs().mean().item() <= (base - want).abs().mean().item() * 1.25 + 1e-6


def test_tiled_decode_runs_the_kept_convolution():
    """The tiled decode computes each upsampled convolution region by region (its own path, with the layer's kept
    convolution): with phase upsamplers it gives what it gave without them, to float64 rounding."""
    vae = _vae().double()
    z = torch.randn(1, 4, 12, 10, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        before = tiled_decode(vae, z, tile=4)
        after = tiled_decode(phase_upsample_model(vae), z, tile=4)
    assert (before - after).abs().max().item() < 1e-12 * before.abs().max().item()


def test_the_engine_upsamples_by_phases_under_bf16_only():
    """Under bf16 the VAE and a TAESD set as its decoder run their upsamplers by phases; exact keeps every
    upsampler as diffusers runs it."""
    exact = Engine.load(model_path(), precision="exact")
    taesd = TinyAutoencoder(TAESDConfig(latent_channels=exact.spec.vae.latent_channels))
    exact.set_vae_decoder(taesd)
    kinds = {type(m) for net in (exact.models.get("vae"), exact.vae_decoder) for m in net.modules()}
    assert PhaseUpsample not in kinds and PhaseUpsampleConv not in kinds and Upsample in kinds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BF16Warning)
        try:
            bf16 = Engine.load(model_path(), precision="bf16")
        except PrecisionError:
            return   # a CPU without bf16 (checked in test_precision.py)
    bf16.set_vae_decoder(taesd)
    vae = bf16.models.get("vae")
    assert [type(m) for m in vae.modules() if isinstance(m, Upsample)] == \
        [PhaseUpsample] * sum(isinstance(m, Upsample) for m in exact.models.get("vae").modules())
    assert sum(isinstance(m, PhaseUpsampleConv) for m in bf16.vae_decoder.modules()) == \
        len(TAESDConfig().decoder_blocks) - 1
    assert all(m.phases.weight.is_contiguous(memory_format=torch.channels_last)
               for m in vae.modules() if isinstance(m, PhaseUpsample))
    assert not [m for m in taesd.modules() if isinstance(m, PhaseUpsampleConv)]   # the TAESD given: left as it was
