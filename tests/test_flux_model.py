"""FLUX.1's transformer (sdlite.models.flux) against diffusers' FluxTransformer2DModel, and its key table
(sdlite.weights.flux_keys) against diffusers' converter of BFL's single files: tiny configs bit for bit, the full-size
dev and schnell architectures on the meta device."""
from __future__ import annotations

import pytest
import torch

from sdlite.config import ConfigError
from sdlite.config.flux import FLUX_DEV, FLUX_SCHNELL, FluxConfig
from sdlite.models.flux import Flux
from sdlite.weights.flux_keys import (
    flux_from_original, flux_layout, flux_plan, flux_to_original, infer_flux_config, load_flux,
)
from sdlite.weights.plan import ConversionError, UnsupportedModelError
from tests.reference import comfy_wrapped

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=24, axes_dims_rope=(4, 6, 6))


def _diffusers(cfg: FluxConfig):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(**{k: v for k, v in cfg.to_diffusers().items() if not k.startswith("_")}).eval()


def _reference(ref, x, t, ctx, pooled, guidance):
    """diffusers' forward as FluxPipeline calls it: packed latents, ids, the timestep / 1000."""
    from diffusers import FluxPipeline

    b, c, h, w = x.shape
    packed = FluxPipeline._pack_latents(x, b, c, h, w)
    ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype)
    out = ref(packed, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t, img_ids=ids,
              txt_ids=torch.zeros(ctx.shape[1], 3), guidance=guidance).sample
    return FluxPipeline._unpack_latents(out, h * 8, w * 8, 8)


def _pair(guidance: bool):
    """diffusers' tiny FLUX transformer (dev: with the guidance embedding) from seed 0 and sdlite's with its weights."""
    torch.manual_seed(0)
    cfg = FluxConfig(**TINY, guidance_embeds=guidance)
    ref = _diffusers(cfg)
    ours = Flux(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_tiny_transformer_is_bit_exact(guidance):
    """Batch 2, two timesteps, a 8x12 latent (rectangular: rows and columns have their own ids), 7 text tokens."""
    ref, ours = _pair(guidance)
    g = torch.Generator().manual_seed(1)
    x, ctx, pooled = torch.randn(2, 16, 8, 12, generator=g), torch.randn(2, 7, 32, generator=g), \
        torch.randn(2, 24, generator=g)
    t = torch.tensor([0.9815, 0.423])
    gd = torch.tensor([3.5, 3.5]) if guidance else None
    with torch.no_grad():
        expected = _reference(ref, x, t, ctx, pooled, gd)
        got = ours(x, t, ctx, pooled, gd)
        other_t = ours(x, t * 0.5, ctx, pooled, gd)
    assert torch.equal(got, expected)
    assert not torch.equal(got, other_t)


def test_odd_latents_are_padded_as_comfyui_pads_them():
    """A latent of odd sides (ComfyUI's, from a size that is a multiple of 8 pixels but not of 16): ComfyUI's
    ``pad_to_patch_size`` (circular, at the bottom and the right) before the 2 x 2 patches, the ids those of the
    padded grid, the output cropped back: diffusers' bits on the padded latent. Kontext's references too, placed as
    ComfyUI's "offset" method places them: the region they cover counted in latent rows and columns as they are, the
    grid and the offset in patches rounded up (a 5x7 reference at (1, 0, 0); a 4x3 one below it, from row
    ceil(5 / 2) = 3; floor would give 2). Zero padding would give other values."""
    import torch.nn.functional as F
    from diffusers import FluxPipeline

    ref, ours = _pair(True)
    g = torch.Generator().manual_seed(3)
    x, ctx, pooled = torch.randn(2, 16, 5, 7, generator=g), torch.randn(2, 4, 32, generator=g), \
        torch.randn(2, 24, generator=g)
    sources = (torch.randn(1, 16, 5, 7, generator=g), torch.randn(1, 16, 4, 3, generator=g))
    t, gd = torch.tensor([0.8, 0.3]), torch.tensor([3.5, 3.5])
    wrapped = comfy_wrapped(x)                                            # (2, 16, 6, 8): row 0 again, column 0

    def packed(latent):
        b, c, h, w = latent.shape
        return FluxPipeline._pack_latents(latent, b, c, h, w)

    def ids(h, w, first=0.0, down=0):
        grid = FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32)
        grid[:, 0] = first
        grid[:, 1] += down
        return grid

    def diffusers_edit(latent, refs, img_ids):
        tokens = torch.cat([packed(latent), *(packed(r).expand(2, -1, -1) for r in refs)], dim=1)
        out = ref(tokens, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t, img_ids=img_ids,
                  txt_ids=torch.zeros(ctx.shape[1], 3), guidance=gd).sample[:, :12]
        return FluxPipeline._unpack_latents(out, 48, 64, 8)[:, :, :5, :7]

    with torch.no_grad():
        got = ours(x, t, ctx, pooled, gd)
        assert got.shape == x.shape
        assert torch.equal(got, _reference(ref, wrapped, t, ctx, pooled, gd)[:, :, :5, :7])
        zeros = _reference(ref, F.pad(x, (0, 1, 0, 1)), t, ctx, pooled, gd)[:, :, :5, :7]
        assert (got - zeros).abs().max() > 1e-3
        edit = ours(x, t, ctx, pooled, gd, references=sources)
        padded = tuple(comfy_wrapped(source) for source in sources)           # 6 x 8 and 4 x 4
        want = diffusers_edit(wrapped, padded, torch.cat([ids(3, 4), ids(3, 4, 1.0), ids(2, 2, 1.0, down=3)]))
        assert torch.equal(edit, want)
        floor = diffusers_edit(wrapped, padded, torch.cat([ids(3, 4), ids(3, 4, 1.0), ids(2, 2, 1.0, down=2)]))
        assert (edit - floor).abs().max() > 1e-4


def test_bf16_stays_close():
    torch.manual_seed(0)
    cfg = FluxConfig(**TINY, guidance_embeds=True)
    ours = Flux(cfg).eval()
    half = Flux(cfg).eval()
    half.load_state_dict(ours.state_dict())
    half.to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x, ctx, pooled = torch.randn(1, 16, 8, 8, generator=g), torch.randn(1, 5, 32, generator=g), \
        torch.randn(1, 24, generator=g)
    with torch.no_grad():
        a = ours(x, torch.tensor([0.5]), ctx, pooled, 3.5)
        b = half(x, torch.tensor([0.5]), ctx, pooled, 3.5).float()
    assert b.dtype == torch.float32 and ((a - b).norm() / a.norm()).item() < 0.05


def _bfl(state: dict) -> dict:
    plan = flux_to_original(state.keys())
    assert not plan.missing and not plan.unexpected
    return plan.materialize(state)


def test_bfl_layout_round_trip_and_loads():
    """diffusers' names -> BFL's (fused qkv and single-block linear1, swapped output modulation) -> back, bit for bit;
    a model loads either layout (BFL's with or without ComfyUI's prefix) to the same weights; the config read from
    the shapes is the model's."""
    torch.manual_seed(0)
    cfg = FluxConfig(**TINY, guidance_embeds=True)
    ref = _diffusers(cfg).state_dict()
    bfl = _bfl(ref)
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and bfl["single_blocks.1.linear1.weight"].shape == (224, 32)
    back = flux_from_original(bfl.keys(), expected=ref.keys())
    assert not back.missing and not back.unexpected
    assert all(torch.equal(back.materialize(bfl)[k], ref[k]) for k in ref)
    for prefix in ("", "model.diffusion_model."):
        source = {prefix + k: v for k, v in bfl.items()}
        assert flux_layout(source) == ("bfl", prefix)
        assert infer_flux_config(source, axes_dims_rope=(4, 6, 6)) == cfg
        model = load_flux(Flux(cfg), source)
        assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)
    assert infer_flux_config(ref, axes_dims_rope=(4, 6, 6)) == cfg
    with pytest.raises(UnsupportedModelError, match="rotary axes"):
        infer_flux_config(bfl)


def test_bfl_names_agree_with_diffusers_converter():
    """BFL's names, the splits and the swapped halves as diffusers' own single-file converter reads them, at the
    released width (3072, one block of each kind; its converter assumes that width), on values."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    cfg = FluxConfig(num_layers=1, num_single_layers=1, guidance_embeds=True, joint_attention_dim=64,
                     pooled_projection_dim=32)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Flux(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(3)
    ref = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}
    bfl = _bfl(ref)
    converted = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    assert set(converted) == set(ref)
    assert all(torch.equal(converted[k], ref[k]) for k in ref)


@pytest.mark.parametrize("cfg,params", [(FLUX_DEV, 11_901_408_320), (FLUX_SCHNELL, 11_891_178_560)],
                         ids=["dev", "schnell"])
def test_full_size_architecture_on_meta(cfg, params):
    """The releases' transformers: diffusers' every key and shape, a strict load, 11.9B parameters; BFL's names for
    them are those diffusers' converter reads (keys and shapes)."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        ref = _diffusers(cfg)
        ours = Flux(cfg)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    assert sum(p.numel() for p in ours.parameters()) == params
    bfl = flux_to_original(theirs).shapes(theirs)
    with torch.device("meta"):
        converted = convert_flux_transformer_checkpoint_to_diffusers({k: torch.empty(s) for k, s in bfl.items()})
    assert {k: tuple(v.shape) for k, v in converted.items()} == theirs
    assert infer_flux_config(bfl) == cfg


def test_bad_weights_are_named():
    torch.manual_seed(0)
    cfg = FluxConfig(**TINY, guidance_embeds=False)
    bfl = _bfl(_diffusers(cfg).state_dict())
    missing = {k: v for k, v in bfl.items() if k != "double_blocks.1.txt_attn.qkv.weight"}
    with pytest.raises(ConversionError, match=r"double_blocks\.1\.txt_attn\.qkv\.weight"):
        load_flux(Flux(cfg), missing)
    extra = {**bfl, "double_blocks.0.img_attn.bogus.weight": torch.zeros(1)}
    with pytest.raises(ConversionError, match="bogus"):
        load_flux(Flux(cfg), extra)
    wrong = {**bfl, "single_blocks.0.linear1.weight": torch.zeros(223, 32)}
    with pytest.raises(ConversionError, match=r"single_blocks\.0\.linear1\.weight"):
        load_flux(Flux(cfg), wrong)
    with pytest.raises(UnsupportedModelError, match="no FLUX transformer keys"):
        flux_plan(["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"])


def test_bad_configs_are_named():
    with pytest.raises(ConfigError, match="axes_dims_rope"):
        FluxConfig(attention_head_dim=128, axes_dims_rope=(16, 56, 54))
    with pytest.raises(ConfigError, match="not supported"):
        FluxConfig.from_diffusers({"_class_name": "FluxTransformer2DModel", "bogus": 1})
    with pytest.raises(ConfigError, match="patch_size"):
        FluxConfig(patch_size=2)
