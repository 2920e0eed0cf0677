"""FLUX.2's transformer (sdlite.models.flux2) against diffusers' Flux2Transformer2DModel built from the same config with
random weights, and its key table (sdlite.weights.flux2_keys) against diffusers' own converter of BFL's single files:
tiny configs bit for bit, the [klein] 4B / 9B and [dev] architectures on the meta device."""
from __future__ import annotations

import json

import pytest
import torch

from sdlite.config import ConfigError
from sdlite.config.flux2 import FLUX2_DEV, FLUX2_KLEIN_4B, FLUX2_KLEIN_9B, Flux2Config
from sdlite.errors import RequestError
from sdlite.models.flux2 import Flux2, image_ids, text_ids
from sdlite.weights.flux2_keys import (
    FLUX2_PREFIX, canonical_shapes, flux2_from_original, flux2_layout, flux2_plan, flux2_to_original,
    infer_flux2_config, is_flux2, load_flux2,
)
from sdlite.weights.plan import ConversionError, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 2 heads of 16 (four rotary axes of 4), 2 double and 2 single blocks, text 32 wide, 16 values a token, sinusoid 32
TINY = dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), in_channels=16, out_channels=16)

# black-forest-labs/FLUX.2-klein-4B transformer/config.json as the hub serves it (less the bookkeeping)
PUBLISHED_KLEIN_4B = """{"_class_name": "Flux2Transformer2DModel", "_diffusers_version": "0.37.0.dev0",
    "attention_head_dim": 128, "axes_dims_rope": [32, 32, 32, 32], "eps": 1e-06, "guidance_embeds": false,
    "in_channels": 128, "joint_attention_dim": 7680, "mlp_ratio": 3.0, "num_attention_heads": 24, "num_layers": 5,
    "num_single_layers": 20, "out_channels": null, "patch_size": 1, "rope_theta": 2000,
    "timestep_guidance_channels": 256}"""


def _diffusers(cfg: Flux2Config):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(**{k: v for k, v in cfg.to_diffusers().items() if not k.startswith("_")}).eval()


def _random_state(model, seed: int = 0) -> dict:
    """Every tensor random (diffusers starts its norms at one, which would hide a swap): norm scales around 1, the
    rest N(0, 0.3)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.3 + (1.0 if "norm_" in k else 0.0)
            for k, v in model.state_dict().items()}


def _pair(cfg: Flux2Config):
    ref = _diffusers(cfg)
    ref.load_state_dict(_random_state(ref))
    ours = Flux2(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _reference(ref, x, t, ctx, guidance, references=()):
    """diffusers' forward as Flux2Pipeline / Flux2KleinPipeline call it: packed latents, their ids, the text ids, the
    timestep / 1000; reference latents packed, given t ids 10, 20, ... and appended; the output cut to the image's
    tokens and scattered back by its ids."""
    from diffusers import Flux2Pipeline as P

    tokens, ids = P._pack_latents(x), P._prepare_latent_ids(x)
    if references:
        refs = [r[None] for r in references]
        ref_tokens = torch.cat([P._pack_latents(r).squeeze(0) for r in refs])[None].repeat(x.shape[0], 1, 1)
        tokens = torch.cat([tokens, ref_tokens], dim=1)
        ids = torch.cat([ids, P._prepare_image_ids(refs).repeat(x.shape[0], 1, 1)], dim=1)
    out = ref(tokens, encoder_hidden_states=ctx, timestep=t, img_ids=ids, txt_ids=P._prepare_text_ids(ctx),
              guidance=guidance, return_dict=False)[0][:, :x.shape[2] * x.shape[3]]
    return P._unpack_latents_with_ids(out, P._prepare_latent_ids(x))


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "klein"])
def test_tiny_transformer_is_bit_exact(guidance):
    """Batch 2, two timesteps, a 6x10 latent (rectangular: rows and columns have their own ids), 7 text tokens; the
    latent entry point and the token entry point (diffusers' contract, ids per sample) give diffusers' bits."""
    torch.manual_seed(0)
    cfg = Flux2Config(**TINY, guidance_embeds=guidance)
    ref, ours = _pair(cfg)
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 16, 6, 10, generator=g), torch.randn(2, 7, 32, generator=g)
    t = torch.tensor([0.9815, 0.423])
    gd = torch.tensor([4.0, 2.5]) if guidance else None
    with torch.no_grad():
        expected = _reference(ref, x, t, ctx, gd)
        got = ours(x, t, ctx, gd)
        tokens = ours.tokens(x.flatten(2).transpose(1, 2), ctx, t, image_ids(6, 10)[None].expand(2, -1, -1),
                             text_ids(7)[None].expand(2, -1, -1), gd)
        other_t = ours(x, t * 0.5, ctx, gd)
    assert got.shape == x.shape
    assert torch.equal(got, expected)
    assert torch.equal(tokens.transpose(1, 2).reshape(x.shape), expected)
    assert not torch.equal(got, other_t)


def test_reference_images_are_bit_exact():
    """Editing: two reference latents of their own sizes join the sequence with t ids 10 and 20, shared by the
    batch, as Flux2KleinPipeline places them; the output is the image's tokens only."""
    torch.manual_seed(0)
    ref, ours = _pair(Flux2Config(**TINY, guidance_embeds=False))
    g = torch.Generator().manual_seed(2)
    x, ctx = torch.randn(2, 16, 4, 6, generator=g), torch.randn(2, 5, 32, generator=g)
    refs = [torch.randn(16, 4, 4, generator=g), torch.randn(16, 2, 6, generator=g)]
    t = torch.tensor([0.7, 0.7])
    with torch.no_grad():
        expected = _reference(ref, x, t, ctx, None, refs)
        got = ours(x, t, ctx, references=refs)
        without = ours(x, t, ctx)
    assert torch.equal(got, expected)
    assert not torch.equal(got, without)


def test_bf16_is_bit_exact_too():
    """In bf16 (rotary in fp32 and back, as diffusers does) the same bits as diffusers' model cast to bf16."""
    torch.manual_seed(0)
    ref, ours = _pair(Flux2Config(**TINY, guidance_embeds=True))
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    x, ctx = torch.randn(1, 16, 4, 6, generator=g), torch.randn(1, 5, 32, generator=g)
    t = torch.tensor([0.5])
    with torch.no_grad():
        expected = _reference(ref, x.bfloat16(), t.bfloat16(), ctx.bfloat16(), torch.tensor([3.5]))
        got = ours(x, t, ctx, 3.5)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def _bfl(state: dict) -> dict:
    plan = flux2_to_original(state.keys())
    assert not plan.missing and not plan.unexpected
    return plan.materialize(state)


def test_bfl_layout_round_trip_and_loads():
    """diffusers' names -> BFL's (fused qkv of the double blocks, swapped output modulation), which diffusers' own
    single-file converter reads back to the same tensors -> back through sdlite's table, bit for bit; a model loads
    either layout (BFL's with or without ComfyUI's prefix) to the same weights; the config read from the shapes is the
    model's."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    torch.manual_seed(0)
    cfg = Flux2Config(**TINY, guidance_embeds=True)
    ref = _random_state(_diffusers(cfg))
    bfl = _bfl(ref)
    assert bfl["double_blocks.1.txt_attn.qkv.weight"].shape == (96, 32)
    assert bfl["single_blocks.1.linear1.weight"].shape == (96 + 2 * 96, 32)
    assert "double_stream_modulation_img.lin.weight" in bfl and "final_layer.adaLN_modulation.1.weight" in bfl
    converted = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    assert set(converted) == set(ref) and all(torch.equal(converted[k], ref[k]) for k in ref)
    for prefix in ("", FLUX2_PREFIX):
        source = {prefix + k: v for k, v in bfl.items()}
        assert flux2_layout(source) == ("bfl", prefix)
        back = flux2_from_original(source.keys(), prefix=prefix, expected=ref.keys())
        assert not back.missing and not back.unexpected
        assert all(torch.equal(v, ref[k]) for k, v in back.materialize(source).items())
        assert infer_flux2_config(source, axes_dims_rope=(4, 4, 4, 4)) == cfg
        model = load_flux2(Flux2(cfg), source)
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    assert flux2_layout(ref) == ("diffusers", "") and infer_flux2_config(ref, axes_dims_rope=(4, 4, 4, 4)) == cfg
    assert all(torch.equal(v, ref[k]) for k, v in load_flux2(Flux2(cfg), ref).state_dict().items())
    with pytest.raises(UnsupportedModelError, match="rotary axes"):
        infer_flux2_config(bfl)


@pytest.mark.parametrize("cfg,params", [(FLUX2_KLEIN_4B, 3_875_544_576), (FLUX2_KLEIN_9B, 9_078_581_248),
                                        (FLUX2_DEV, 32_223_281_152)], ids=["klein-4b", "klein-9b", "dev"])
def test_full_size_architecture_on_meta(cfg, params):
    """The releases' transformers: diffusers' every key and shape, a strict load, the parameter count; BFL's names
    for them are those diffusers' converter reads (keys and shapes); the config read from those shapes is the
    preset's; both layouts are FLUX.2."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        ref = _diffusers(cfg)
        ours = Flux2(cfg)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    assert sum(p.numel() for p in ours.parameters()) == params
    bfl = flux2_to_original(theirs).shapes(theirs)
    assert len(bfl) == len(theirs) - 4 * cfg.num_layers          # q, k, v fused in both streams of every double block
    with torch.device("meta"):
        converted = convert_flux2_transformer_checkpoint_to_diffusers({k: torch.empty(s) for k, s in bfl.items()})
    assert {k: tuple(v.shape) for k, v in converted.items()} == theirs
    assert canonical_shapes(bfl) == theirs
    assert infer_flux2_config(bfl) == cfg and infer_flux2_config(theirs) == cfg
    assert is_flux2(bfl) and is_flux2(theirs) and is_flux2({FLUX2_PREFIX + k: s for k, s in bfl.items()})


def test_detection():
    """FLUX.2 in each layout (names alone, or names and shapes); not FLUX.1 (the same block names, per-block
    modulations) in either of its layouts, not Z-Image, not weights whose widths disagree."""
    from sdlite.config.flux import FluxConfig
    from sdlite.models.flux import Flux
    from sdlite.weights.flux_keys import flux_to_original

    with torch.device("meta"):
        ref = {k: tuple(v.shape) for k, v in Flux2(Flux2Config(**TINY)).state_dict().items()}
        flux1 = {k: tuple(v.shape) for k, v in Flux(FluxConfig(num_layers=1, num_single_layers=1, attention_head_dim=16,
                                                               num_attention_heads=2, joint_attention_dim=32,
                                                               pooled_projection_dim=24, axes_dims_rope=(4, 6, 6),
                                                               guidance_embeds=True)).state_dict().items()}
    bfl = flux2_to_original(ref).shapes(ref)
    for state in (ref, bfl, {FLUX2_PREFIX + k: s for k, s in bfl.items()}):
        assert is_flux2(state) and is_flux2(list(state))
    flux1_bfl = flux_to_original(flux1).shapes(flux1)
    for state in (flux1, flux1_bfl, {FLUX2_PREFIX + k: s for k, s in flux1_bfl.items()}):
        assert not is_flux2(state) and not is_flux2(list(state))
        with pytest.raises(UnsupportedModelError, match="FLUX.1"):
            flux2_layout(state)
    assert not is_flux2({**bfl, "single_stream_modulation.lin.weight": (64, 32)})
    assert not is_flux2(["cap_embedder.0.weight", "layers.0.attention.qkv.weight", "x_embedder.weight"])
    with pytest.raises(UnsupportedModelError, match="no FLUX.2 transformer keys"):
        flux2_plan(["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"])


def test_bad_weights_are_named():
    """A missing key by its BFL name (the fused qkv), a key with no place, a wrong shape by its source key, a qkv that
    does not split in three."""
    torch.manual_seed(0)
    cfg = Flux2Config(**TINY, guidance_embeds=False)
    bfl = _bfl(_random_state(_diffusers(cfg)))
    missing = {k: v for k, v in bfl.items() if k != "double_blocks.1.img_attn.qkv.weight"}
    with pytest.raises(ConversionError, match=r"double_blocks\.1\.img_attn\.qkv\.weight"):
        load_flux2(Flux2(cfg), missing)
    extra = {**bfl, "double_blocks.0.img_attn.bogus.weight": torch.zeros(1)}
    with pytest.raises(ConversionError, match="bogus"):
        load_flux2(Flux2(cfg), extra)
    biased = {**bfl, "img_in.bias": torch.zeros(32)}
    with pytest.raises(ConversionError, match=r"img_in\.bias"):
        load_flux2(Flux2(cfg), biased)
    wrong = {**bfl, "single_blocks.0.linear1.weight": torch.zeros(287, 32)}
    with pytest.raises(ConversionError, match=r"single_blocks\.0\.linear1\.weight.*\[288, 32\]"):
        load_flux2(Flux2(cfg), wrong)
    uneven = {**bfl, "double_blocks.0.txt_attn.qkv.weight": torch.zeros(95, 32)}
    with pytest.raises(ConversionError, match=r"double_blocks\.0\.txt_attn\.qkv\.weight"):
        load_flux2(Flux2(cfg), uneven)
    flux1 = {"double_blocks.0.img_mod.lin.weight": torch.zeros(1), "img_in.weight": torch.zeros(1)}
    with pytest.raises(UnsupportedModelError, match="FLUX.1"):
        load_flux2(Flux2(cfg), flux1)


def test_bad_inputs_are_named():
    klein, dev = Flux2(Flux2Config(**TINY, guidance_embeds=False)).eval(), Flux2(Flux2Config(**TINY)).eval()
    x, ctx = torch.zeros(1, 16, 4, 4), torch.zeros(1, 3, 32)
    with torch.no_grad():
        with pytest.raises(RequestError, match="latent"):
            klein(torch.zeros(1, 32, 4, 4), 0.5, ctx)
        with pytest.raises(RequestError, match="context"):
            klein(x, 0.5, torch.zeros(1, 3, 48))
        with pytest.raises(RequestError, match="timesteps"):
            klein(x, torch.tensor([0.5, 0.5]), ctx)
        with pytest.raises(RequestError, match="no guidance embedding"):
            klein(x, 0.5, ctx, 3.5)
        with pytest.raises(RequestError, match="give guidance"):
            dev(x, 0.5, ctx)
        with pytest.raises(RequestError, match="reference 0"):
            klein(x, 0.5, ctx, references=[torch.zeros(32, 4, 4)])
        tokens = x.flatten(2).transpose(1, 2)
        with pytest.raises(RequestError, match=r"img_ids have shape \[16, 3\]"):
            klein.tokens(tokens, ctx, 0.5, image_ids(4, 4)[:, :3], text_ids(3))
        two = torch.stack([image_ids(4, 4), image_ids(4, 4, t=1)])
        with pytest.raises(RequestError, match="img_ids differ"):
            klein.tokens(tokens.expand(2, -1, -1), ctx.expand(2, -1, -1), 0.5, two, text_ids(3))


def test_config():
    """The published klein-4B config reads to the preset (out_channels null: in_channels) and every preset back from
    its own diffusers form; a config without a field gets diffusers' class default ([dev]'s); unsupported fields and
    inconsistent sizes are named."""
    assert Flux2Config.from_diffusers(json.loads(PUBLISHED_KLEIN_4B)) == FLUX2_KLEIN_4B
    for cfg in (FLUX2_KLEIN_4B, FLUX2_KLEIN_9B, FLUX2_DEV):
        assert Flux2Config.from_diffusers(cfg.to_diffusers()) == cfg
    assert Flux2Config.from_diffusers({"_class_name": "Flux2Transformer2DModel"}) == FLUX2_DEV
    assert Flux2Config.from_diffusers({"in_channels": 64}).out_channels == 64
    assert (FLUX2_KLEIN_4B.hidden, FLUX2_KLEIN_4B.mlp_hidden, FLUX2_KLEIN_4B.latent_channels) == (3072, 9216, 32)
    assert (FLUX2_KLEIN_9B.hidden, FLUX2_DEV.hidden) == (4096, 6144)
    with pytest.raises(ConfigError, match=r"\['bogus'\] are not supported"):
        Flux2Config.from_diffusers({"_class_name": "Flux2Transformer2DModel", "bogus": 1})
    with pytest.raises(ConfigError, match="_class_name"):
        Flux2Config.from_diffusers({"_class_name": "FluxTransformer2DModel"})
    with pytest.raises(ConfigError, match="axes_dims_rope"):
        Flux2Config(axes_dims_rope=(32, 32, 32, 30))
    with pytest.raises(ConfigError, match="patch_size"):
        Flux2Config(patch_size=2)
    with pytest.raises(ConfigError, match="mlp_ratio"):
        Flux2Config(mlp_ratio=0)
    with pytest.raises(ConfigError, match="guidance_embeds"):
        Flux2Config(guidance_embeds="yes")


def test_a_flux2_file_is_not_taken_for_flux1(tmp_path):
    """A BFL single file, which shares FLUX.1's block names, is opened as FLUX.2 (sdlite.weights.flux2), not as a
    broken FLUX.1: here its 16-wide heads, which no release has, are named as a FLUX.2 transformer's."""
    from safetensors.torch import save_file

    from sdlite.errors import CheckpointError
    from sdlite.loader import open_model

    _, ours = _pair(Flux2Config(**TINY))
    path = tmp_path / "flux-2-klein-4b.safetensors"
    save_file({k: v.contiguous() for k, v in _bfl(ours.state_dict()).items()}, str(path))
    with pytest.raises(CheckpointError, match=r"FLUX\.2 transformer: heads 16 wide, which no release has"):
        open_model(path)
