"""FLUX.2's autoencoder (sdlite.models.flux2_vae) against diffusers' AutoencoderKLFlux2 and the FLUX.2 pipelines' own
latent maths, its config against the published config files, and its key tables (sdlite.weights.flux2_vae_keys)
against diffusers' LDM converter: tiny configs with random weights bit for bit (torch.equal: the same operations in
the same order, so no tolerance), the released sizes on the meta device."""
from __future__ import annotations

import inspect
import json
import textwrap
from types import SimpleNamespace

import pytest
import torch

from sdlite.config import ConfigError
from sdlite.config.flux2_vae import FLUX2_SMALL_DECODER_VAE, FLUX2_VAE, Flux2VAEConfig
from sdlite.models.flux2_vae import (
    Flux2VAE, denormalize_latents, normalize_latents, patchify_latents, unpatchify_latents,
)
from sdlite.weights.flux2_vae_keys import (
    LAYOUTS, flux2_vae_from_diffusers, flux2_vae_from_original, flux2_vae_layout, flux2_vae_to_original,
    infer_flux2_vae, is_flux2_vae, load_flux2_vae, original_names,
)
from sdlite.weights.plan import ConversionError, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# two levels (downscale 2, patchified 4), 8 latent channels (32 patchified), GroupNorm of 8
TINY = Flux2VAEConfig(block_out_channels=(16, 32), layers_per_block=1, latent_channels=8, norm_num_groups=8,
                      sample_size=32)
TINY_NARROW = Flux2VAEConfig(block_out_channels=(16, 32), decoder_block_out_channels=(8, 24), layers_per_block=1,
                             latent_channels=8, norm_num_groups=8, sample_size=32)

# black-forest-labs/FLUX.2-dev vae/config.json's entries (the klein folders' vae/config.json: the same values)
PUBLISHED = """{"_class_name": "AutoencoderKLFlux2", "act_fn": "silu",
    "batch_norm_eps": 0.0001, "batch_norm_momentum": 0.1, "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
    "force_upcast": true, "in_channels": 3, "latent_channels": 32, "layers_per_block": 2,
    "mid_block_add_attention": true, "norm_num_groups": 32, "out_channels": 3, "patch_size": [2, 2],
    "sample_size": 1024, "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D",
    "UpDecoderBlock2D"], "use_post_quant_conv": true, "use_quant_conv": true}"""
# black-forest-labs/FLUX.2-small-decoder config.json
PUBLISHED_SMALL_DECODER = """{"_class_name": "AutoencoderKLFlux2", "_diffusers_version": "0.32.0.dev0",
    "in_channels": 3, "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"],
    "block_out_channels": [128, 256, 512, 512], "decoder_block_out_channels": [96, 192, 384, 384],
    "layers_per_block": 2, "act_fn": "silu", "latent_channels": 32, "norm_num_groups": 32, "sample_size": 1024,
    "force_upcast": true, "use_quant_conv": true, "use_post_quant_conv": true, "mid_block_add_attention": true,
    "batch_norm_eps": 0.0001, "batch_norm_momentum": 0.1, "patch_size": [2, 2]}"""


def _diffusers(cfg: Flux2VAEConfig):
    from diffusers import AutoencoderKLFlux2

    # from_config: force_upcast is in the published config.json but not a constructor argument
    return AutoencoderKLFlux2.from_config(cfg.to_diffusers()).eval()


def _random_state(model, seed: int = 0) -> dict:
    """Every float tensor random (diffusers starts norms at one and the statistics at 0 / 1, which would hide a swap):
    norm scales around 1, variances in (0.5, 1.5), the rest N(0, 0.2); the counter as it is."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in model.state_dict().items():
        if not v.is_floating_point():
            state[k] = v
        elif k.endswith("running_var"):
            state[k] = torch.rand(v.shape, generator=g) + 0.5
        else:
            state[k] = torch.randn(v.shape, generator=g) * 0.2 + (1.0 if "norm" in k and k.endswith("weight") else 0.0)
    return state


def _pair(cfg: Flux2VAEConfig = TINY):
    ref = _diffusers(cfg)
    ref.load_state_dict(_random_state(ref))
    return ref, load_flux2_vae(Flux2VAE(cfg).eval(), ref.state_dict())


def _pipelines():
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    return Flux2Pipeline, Flux2KleinPipeline


def _pipeline_code(function, first: str, last: str) -> str:
    """The lines of a pipeline method from the one holding ``first`` to the next holding ``last``, dedented: the
    pipelines write their batch-norm arithmetic inline, so the test runs their own lines rather than a copy."""
    lines = inspect.getsource(function).splitlines()
    start = next((i for i, line in enumerate(lines) if first in line), None)
    assert start is not None, f"{function.__qualname__} no longer has a line with {first!r}"
    end = next((i for i in range(start, len(lines)) if last in lines[i]), None)
    assert end is not None, f"{function.__qualname__} has no {last!r} after {first!r}"
    return textwrap.dedent("\n".join(lines[start:end + 1]))


# --- config -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("published, preset",
                         [(PUBLISHED, FLUX2_VAE), (PUBLISHED_SMALL_DECODER, FLUX2_SMALL_DECODER_VAE)],
                         ids=["released", "small-decoder"])
def test_published_configs(published, preset):
    cfg = json.loads(published)
    assert Flux2VAEConfig.from_diffusers(cfg) == preset
    written = preset.to_diffusers()
    assert {k: v for k, v in cfg.items() if not k.startswith("_")} == \
        {k: v for k, v in written.items() if not k.startswith("_") and k in cfg}
    assert Flux2VAEConfig.from_diffusers(written) == preset
    assert (preset.downscale, preset.patched_channels, preset.patched_downscale) == (8, 128, 16)
    assert preset.vae_config.latent_channels == 32 and preset.vae_config.downscale == 8
    assert preset.decoder_vae_config.block_channels == preset.decoder_widths


@pytest.mark.parametrize("change, match", [
    ({"_class_name": "AutoencoderKL"}, "_class_name='AutoencoderKL'"),
    ({"scaling_factor": 0.3611}, r"\['scaling_factor'\] are not supported"),
    ({"patch_size": [1, 1]}, r"patch_size=\[1, 1\]"),
    ({"mid_block_add_attention": False}, "mid_block_add_attention=False"),
    ({"act_fn": "gelu"}, "act_fn='gelu'"),
    ({"up_block_types": ["AttnUpDecoderBlock2D"] * 4}, "block type 'AttnUpDecoderBlock2D'"),
    ({"down_block_types": ["DownEncoderBlock2D"] * 3}, "3 entries for 4 levels"),
    ({"block_out_channels": [128, 256, 500, 512]}, "width 500 is not divisible by norm_num_groups=32"),
    ({"decoder_block_out_channels": [96, 192]}, "one width per level"),
    ({"batch_norm_eps": 0}, "batch_norm_eps=0 must be > 0"),
    ({"latent_channels": 0}, "latent_channels=0 must be a positive integer"),
])
def test_config_errors_name_the_field(change, match):
    with pytest.raises(ConfigError, match=match):
        Flux2VAEConfig.from_diffusers({**json.loads(PUBLISHED), **change})


# --- the network --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [TINY, TINY_NARROW], ids=["tiny", "narrow-decoder"])
def test_network_matches_diffusers_bit_for_bit(cfg):
    ref, ours = _pair(cfg)
    g = torch.Generator().manual_seed(1)
    image = torch.rand(2, 3, 16, 24, generator=g) * 2 - 1
    z = torch.randn(2, cfg.latent_channels, 8, 12, generator=g)
    with torch.no_grad():
        dist = ref.encode(image).latent_dist
        mean, logvar = ours.encode_moments(image)
        assert torch.equal(mean, dist.mode()) and torch.equal(logvar, dist.logvar)
        assert torch.equal(ours.encode(image), dist.mode())
        sample = ours.encode(image, torch.Generator().manual_seed(5))
        assert torch.equal(sample, dist.sample(torch.Generator().manual_seed(5)))
        assert torch.equal(ours.decode(z), ref.decode(z).sample)
    assert ours.config == cfg.vae_config and ours.flux2_config == cfg


# --- the pipelines' latent maths ----------------------------------------------------------------------------------


def test_patchify_matches_the_pipelines():
    z = torch.randn(2, 8, 6, 10, generator=torch.Generator().manual_seed(2))
    patched = patchify_latents(z)
    assert patched.shape == (2, 32, 3, 5)
    # channel 4c + 2i + j at (y, x) is channel c at (2y + i, 2x + j)
    assert torch.equal(patched[:, 4 * 3 + 2 * 1 + 0], z[:, 3, 1::2, 0::2])
    for pipeline in _pipelines():
        assert torch.equal(patched, pipeline._patchify_latents(z))
        assert torch.equal(unpatchify_latents(patched), pipeline._unpatchify_latents(patched))
    assert torch.equal(unpatchify_latents(patched), z)
    with pytest.raises(ValueError, match=r"\(2, 8, 5, 10\) cannot be patchified"):
        patchify_latents(z[:, :, :5])
    with pytest.raises(ValueError, match=r"\(2, 30, 3, 5\) cannot be unpatchified"):
        unpatchify_latents(patched[:, :30])


def test_encoding_matches_the_pipelines():
    """An image to the transformer's latents: the pipelines' ``_encode_vae_image`` (encode, mode, patchify,
    normalise) run on diffusers' VAE, against ``encode_latents``."""
    ref, ours = _pair()
    image = torch.rand(1, 3, 16, 24, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        got = ours.encode_latents(image)
        assert got.shape == (1, 32, 4, 6)
        for pipeline in _pipelines():
            this = SimpleNamespace(vae=ref, _patchify_latents=pipeline._patchify_latents)
            assert torch.equal(got, pipeline._encode_vae_image(this, image, generator=None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-latents"])
def test_normalisation_matches_the_pipelines(dtype):
    """The batch-norm arithmetic as the pipelines write it inline (their own lines, run here), with latents in fp32
    and in bf16 beside fp32 statistics (the square root is taken before the cast)."""
    ref, ours = _pair()
    x = torch.randn(2, 32, 4, 6, generator=torch.Generator().manual_seed(4)).to(dtype)
    stats = (ours.bn.running_mean, ours.bn.running_var, ours.bn.eps)
    flux2, klein = _pipelines()
    encode = _pipeline_code(flux2._encode_vae_image, "latents_bn_mean =", "image_latents = (image_latents")
    scope = {"self": SimpleNamespace(vae=ref), "image_latents": x}
    exec(encode, {"torch": torch}, scope)
    assert torch.equal(normalize_latents(x, *stats), scope["image_latents"])
    assert torch.equal(ours.bn.normalize(x), scope["image_latents"])
    for pipeline in (flux2, klein):
        decode = _pipeline_code(pipeline.__call__, "latents_bn_mean =", "latents = self._unpatchify_latents(latents)")
        scope = {"self": SimpleNamespace(vae=ref, _unpatchify_latents=pipeline._unpatchify_latents), "latents": x}
        exec(decode, {"torch": torch}, scope)
        assert scope["latents"].dtype == dtype
        assert torch.equal(unpatchify_latents(denormalize_latents(x, *stats)), scope["latents"])
        if dtype == torch.float32:
            with torch.no_grad():
                assert torch.equal(ours.decode_latents(x), ref.decode(scope["latents"]).sample)
    with pytest.raises(ValueError, match=r"\(2, 16, 4, 6\) does not fit the batch-norm statistics"):
        normalize_latents(x[:, :16], *stats)


# --- the released sizes and the file layouts ----------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [FLUX2_VAE, FLUX2_SMALL_DECODER_VAE], ids=["released", "small-decoder"])
def test_released_architecture_on_meta(cfg):
    with torch.device("meta"):
        theirs = {k: tuple(v.shape) for k, v in _diffusers(cfg).state_dict().items()}
        ours = {k: tuple(v.shape) for k, v in Flux2VAE(cfg).state_dict().items()}
    assert set(theirs) - set(ours) == {"bn.num_batches_tracked"}   # the training counter, dropped by the tables
    assert ours == {k: v for k, v in theirs.items() if k in ours}
    assert ours["bn.running_mean"] == (128,) and ours["decoder.conv_in.weight"][1] == 32
    assert flux2_vae_layout(theirs) == ("diffusers", "") and infer_flux2_vae(theirs) == cfg
    original = flux2_vae_to_original(ours).shapes(ours)
    assert flux2_vae_layout(original) == ("original", "")
    assert LAYOUTS.shapes(original) == ours and infer_flux2_vae(LAYOUTS.shapes(original)) == cfg
    assert is_flux2_vae(original) and is_flux2_vae(theirs)


def _original_file(ref) -> dict:
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return {k: v.clone().contiguous() for k, v in flux2_vae_to_original(state).materialize(state).items()}


@pytest.mark.parametrize("cfg", [TINY, TINY_NARROW], ids=["tiny", "narrow-decoder"])
def test_single_file_round_trip(cfg):
    """BFL's file layout: names checked against diffusers' own LDM converter, back to the canonical names, and the
    file loaded into the network gives diffusers' outputs bit for bit."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    ref, _ = _pair(cfg)
    state = {k: v for k, v in ref.state_dict().items() if k != "bn.num_batches_tracked"}
    original = _original_file(ref)
    n = len(cfg.block_out_channels)
    assert {"encoder.quant_conv.weight", "decoder.post_quant_conv.bias", "bn.running_mean", "bn.running_var",
            "encoder.norm_out.weight", "decoder.mid.attn_1.q.weight"} <= set(original)
    assert original["decoder.mid.attn_1.q.weight"].shape[2:] == (1, 1)
    assert torch.equal(original[f"decoder.up.{n - 1}.block.0.conv1.weight"],
                       state["decoder.up_blocks.0.resnets.0.conv1.weight"])
    # diffusers' converter reads the quant convs at the top (FLUX.1's files) and knows no statistics
    flat = {k.replace("encoder.quant_conv", "quant_conv").replace("decoder.post_quant_conv", "post_quant_conv"): v
            for k, v in original.items() if not k.startswith("bn.")}
    converted = convert_ldm_vae_checkpoint(flat, cfg.to_diffusers())
    assert set(converted) == {k for k in state if not k.startswith("bn.")}
    assert all(torch.equal(converted[k], state[k]) for k in converted)
    model = Flux2VAE(cfg).eval()
    plan = flux2_vae_from_original(original, expected=model.state_dict().keys())
    assert not plan.missing and not plan.unexpected and not plan.ignored
    back = plan.materialize(original)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    # ComfyUI's spelling (quant convs at the top), under a prefix, with the counter: the same model
    comfy = {("vae." + k): v for k, v in flat.items()} | {"vae.bn.running_mean": original["bn.running_mean"],
                                                         "vae.bn.running_var": original["bn.running_var"],
                                                         "vae.bn.num_batches_tracked": torch.tensor(7)}
    assert flux2_vae_layout(comfy) == ("original", "vae.")
    g = torch.Generator().manual_seed(6)
    image = torch.rand(1, 3, 16, 24, generator=g) * 2 - 1
    z = torch.randn(1, 8, 8, 12, generator=g)
    with torch.no_grad():
        for source in (original, comfy, ref.state_dict()):
            loaded = load_flux2_vae(Flux2VAE(cfg).eval(), source)
            assert torch.equal(loaded.encode(image), ref.encode(image).latent_dist.mode())
            assert torch.equal(loaded.decode(z), ref.decode(z).sample)
            assert torch.equal(loaded.bn.running_var, ref.bn.running_var)


def test_layout_and_load_errors_name_the_key():
    ref, _ = _pair()
    original = _original_file(ref)
    model = Flux2VAE(TINY).eval()
    missing = {k: v for k, v in original.items() if k != "bn.running_var"}
    with pytest.raises(ConversionError, match="1 FLUX.2 VAE keys are missing.*'bn.running_var'"):
        load_flux2_vae(model, missing)
    no_quant = {k: v for k, v in original.items() if not k.startswith("encoder.quant_conv")}
    with pytest.raises(ConversionError, match="'encoder.quant_conv.weight'"):   # named as the file names it
        load_flux2_vae(model, no_quant)
    wrong = {**original, "bn.running_mean": torch.zeros(16)}
    with pytest.raises(ConversionError, match=r"shape \[16\] .* 'bn.running_mean', which needs \[32\]"):
        load_flux2_vae(model, wrong)
    with pytest.raises(UnsupportedModelError, match=r"shape \[16\] does not fit 8 latent channels"):
        infer_flux2_vae(LAYOUTS.shapes(wrong))
    both = {**original, "quant_conv.weight": original["encoder.quant_conv.weight"]}
    with pytest.raises(ConversionError, match="both map to 'quant_conv.weight'"):
        flux2_vae_from_original(both)
    flux1 = {k: v for k, v in original.items() if not k.startswith("bn.")}
    with pytest.raises(UnsupportedModelError, match="no 'bn.running_mean' key.*without them"):
        flux2_vae_layout(flux1)
    assert not is_flux2_vae(flux1) and not is_flux2_vae(["bn.running_mean", "bn.running_var"])
    twice = {**original, **{"vae." + k: v for k, v in original.items()}}
    with pytest.raises(UnsupportedModelError, match="several prefixes"):
        flux2_vae_layout(twice)
    canonical = ["quant_conv.weight", "decoder.up_blocks.0.upsamplers.0.conv.bias", "bn.running_var"]
    assert original_names(canonical, num_levels=2) == \
        ["encoder.quant_conv.weight", "decoder.up.1.upsample.conv.bias", "bn.running_var"]
    no_upsampler = {k: v for k, v in original.items() if not k.startswith("decoder.up.1.upsample.")}
    with pytest.raises(ConversionError, match="'decoder.up.1.upsample.conv.weight'"):   # the level counted back
        load_flux2_vae(model, no_upsampler)
    plan = flux2_vae_from_diffusers(ref.state_dict(), expected=model.state_dict().keys())
    assert plan.ignored == ["bn.num_batches_tracked"] and not plan.missing and not plan.unexpected
