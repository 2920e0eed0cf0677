"""SD3's MMDiT (sdlite.models.mmdit) against diffusers' SD3Transformer2DModel built from the same config with random
weights, and its key tables (sdlite.weights.mmdit_keys): Stability's single-file names both ways, the config the
shapes show, and the errors of weights that do not fit.

Tiny configs run the numbers: SD3 Medium's kind (no qk norm), SD3.5 Large's (RMS qk norm) and SD3.5 Medium's (MMDiT-X:
dual attention in the first blocks), plus dual attention in every block, the last (pre-only) one included. The
released sizes are checked on the meta device only: every key and shape.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from sdlite.config import ConfigError
from sdlite.config.mmdit import MMDIT_PRESETS, SD3_MEDIUM, SD35_LARGE, SD35_MEDIUM, MMDiTConfig
from sdlite.errors import RequestError
from sdlite.kernels import bf16 as bf16_kernels
from sdlite.models.mmdit import MMDiT, sincos_grid
from sdlite.weights.mmdit_keys import (
    MMDIT_PREFIX, SWAP_HALVES, canonical_shapes, infer_mmdit_config, load_mmdit, mmdit_from_original, mmdit_layout,
    mmdit_plan, mmdit_to_original,
)
from sdlite.weights.plan import ConversionError, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 2 heads of 8, patches of 2 over 16 latent channels, a 16 x 16 grid of positions, text 32 wide, pooled 16
TINY = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=3, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=16,
            pos_embed_max_size=16)
CASES = {
    "sd3-medium": MMDiTConfig(**TINY),
    "sd3.5-large": MMDiTConfig(**TINY, qk_norm="rms_norm"),
    "sd3.5-medium": MMDiTConfig(**{**TINY, "num_layers": 4}, qk_norm="rms_norm", dual_attention_layers=(0, 1)),
    "dual-everywhere": MMDiTConfig(**{**TINY, "num_layers": 2}, qk_norm="rms_norm", dual_attention_layers=(0, 1)),
}
PRESETS = {"sd3-medium": SD3_MEDIUM, "sd3.5-medium": SD35_MEDIUM, "sd3.5-large": SD35_LARGE}

# the published transformer/config.json files (stabilityai/stable-diffusion-3-medium-diffusers,
# stabilityai/stable-diffusion-3.5-medium, stabilityai/stable-diffusion-3.5-large), as the hub serves them
PUBLISHED = {
    "sd3-medium": """{"_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.29.0.dev0",
        "attention_head_dim": 64, "caption_projection_dim": 1536, "in_channels": 16, "joint_attention_dim": 4096,
        "num_attention_heads": 24, "num_layers": 24, "out_channels": 16, "patch_size": 2,
        "pooled_projection_dim": 2048, "pos_embed_max_size": 192, "sample_size": 128}""",
    "sd3.5-medium": """{"_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.31.0.dev0",
        "attention_head_dim": 64, "caption_projection_dim": 1536,
        "dual_attention_layers": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "in_channels": 16,
        "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 24, "out_channels": 16,
        "patch_size": 2, "pooled_projection_dim": 2048, "pos_embed_max_size": 384, "qk_norm": "rms_norm",
        "sample_size": 128}""",
    "sd3.5-large": """{"_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.31.0.dev0",
        "attention_head_dim": 64, "caption_projection_dim": 2432, "in_channels": 16, "joint_attention_dim": 4096,
        "num_attention_heads": 38, "num_layers": 38, "out_channels": 16, "patch_size": 2,
        "pooled_projection_dim": 2048, "pos_embed_max_size": 192, "qk_norm": "rms_norm", "sample_size": 128}""",
}


def diffusers_mmdit(cfg: MMDiTConfig):
    from diffusers import SD3Transformer2DModel

    d = cfg.to_diffusers()
    d.pop("_class_name")
    return SD3Transformer2DModel(**d).eval()


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere, with a 1/sqrt(fan-in) spread for matrices (so 4 blocks keep sane magnitudes) and
    biases, norm scales and modulations far from their neutral init: nothing is trivially zero or one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            fan_in = math.prod(p.shape[1:]) if p.ndim > 1 else 4
            scale = name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight"))
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in) + (1.0 if scale else 0.0))


@pytest.fixture(scope="module")
def pairs():
    """Per case: diffusers' model with random weights and ours with the same state dict, copied key for key."""
    out = {}
    for i, (name, cfg) in enumerate(CASES.items()):
        ref = diffusers_mmdit(cfg)
        randomize(ref, i)
        ours = MMDiT(cfg).eval()
        ours.load_state_dict(ref.state_dict(), strict=True)
        out[name] = ref, ours
    return out


def inputs(cfg: MMDiTConfig, h: int = 12, w: int = 20, batch: int = 2, tokens: int = 7, seed: int = 1):
    """A non-square latent (6 x 10 patches, off-centre in the grid), distinct timesteps per sample."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, cfg.in_channels, h, w, generator=g), torch.tensor([981.25, 37.5, 500.0][:batch]),
            torch.randn(batch, tokens, cfg.joint_attention_dim, generator=g),
            torch.randn(batch, cfg.pooled_projection_dim, generator=g))


def reference(ref, x, t, c, pooled, skip_layers=None, dtype=torch.float32):
    return ref(x.to(dtype), c.to(dtype), pooled.to(dtype), t, skip_layers=skip_layers, return_dict=False)[0]


# --- numbers -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_float32_bit_exact(pairs, case):
    """The same operations in the same order as diffusers: the velocity is bit for bit the same."""
    ref, ours = pairs[case]
    x, t, c, pooled = inputs(ours.config)
    with torch.no_grad():
        want = reference(ref, x, t, c, pooled)
        got = ours(x, t, c, pooled)
    assert got.shape == x.shape and got.abs().max() > 0.1
    assert torch.equal(got, want)
    with torch.no_grad():   # the two samples are independent: alone, each gives its row of the batch
        single = ours(x[1:], t[1:], c[1:], pooled[1:])
    assert torch.allclose(single, got[1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["sd3-medium", "sd3.5-medium"])
def test_skip_layers(pairs, case):
    """Skip-layer guidance: the skipped blocks are not run, as with diffusers' ``skip_layers``."""
    ref, ours = pairs[case]
    x, t, c, pooled = inputs(ours.config)
    with torch.no_grad():
        full = ours(x, t, c, pooled)
        got = ours(x, t, c, pooled, skip_layers=[1])
        want = reference(ref, x, t, c, pooled, skip_layers=[1])
        last = ours(x, t, c, pooled, skip_layers=(0, ours.config.num_layers - 1))
        want_last = reference(ref, x, t, c, pooled, skip_layers=[0, ours.config.num_layers - 1])
    assert torch.equal(got, want) and not torch.equal(got, full)
    assert torch.equal(last, want_last)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_bit_exact(pairs, dtype, monkeypatch):
    """bf16 and fp16 (which diffusers also runs on the CPU) give diffusers' result bit for bit where both run
    PyTorch's attention. sdlite's own bf16 attention kernel (AVX512-BF16 CPUs, large problems only) is turned off
    here: it agrees with PyTorch's to bf16 rounding, not bit for bit (tests/test_kernels.py holds it)."""
    monkeypatch.setattr(bf16_kernels, "enabled", False)
    ref, ours = pairs["sd3.5-medium"]
    cfg = ours.config
    ref_h, ours_h = diffusers_mmdit(cfg).to(dtype), MMDiT(cfg).eval().to(dtype)
    ref_h.load_state_dict(ref.state_dict())
    ours_h.load_state_dict(ours.state_dict())
    x, t, c, pooled = inputs(cfg)
    with torch.no_grad():
        want = reference(ref_h, x, t, c, pooled, dtype=dtype)
        got = ours_h(x, t, c, pooled)       # float32 inputs are cast to the weights' dtype
        exact = ours(x, t, c, pooled)
    assert got.dtype == dtype and torch.equal(got, want)
    # and half precision stays near the float32 result: within 5% of its largest value
    assert (got.float() - exact).abs().max() <= 0.05 * exact.abs().max()


def test_grad_mode_same_values(pairs):
    """With gradients on, the in-place shortcuts are off; the values are the same and backward runs."""
    ref, ours = pairs["sd3.5-large"]
    x, t, c, pooled = inputs(ours.config)
    with torch.no_grad():
        want = ours(x, t, c, pooled)
    x = x.clone().requires_grad_(True)
    got = ours(x, t, c, pooled)
    got.square().mean().backward()
    assert torch.equal(got.detach(), want)
    assert x.grad is not None and x.grad.abs().max() > 0


def test_latent_sizes_and_timesteps(pairs):
    """The whole positional grid (16 x 16 patches) crops to the full table; a square latent and a one-sample batch
    agree with diffusers; a single timestep serves the batch."""
    ref, ours = pairs["sd3-medium"]
    for h, w, batch in ((32, 32, 1), (2, 32, 2), (16, 16, 2)):
        x, t, c, pooled = inputs(ours.config, h, w, batch)
        with torch.no_grad():
            assert torch.equal(ours(x, t, c, pooled), reference(ref, x, t, c, pooled)), (h, w, batch)
    x, t, c, pooled = inputs(ours.config)
    with torch.no_grad():
        assert torch.equal(ours(x, 250.0, c, pooled), ours(x, torch.tensor([250.0, 250.0]), c, pooled))


def test_positional_table_matches_diffusers():
    """The sin-cos table (a buffer the checkpoints carry, so the model built without weights has the same)."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    for dim, grid, base in ((96, 40, 16), (16, 16, 16), (64, 24, 48)):
        want = get_2d_sincos_pos_embed(dim, grid, base_size=base, output_type="pt").float().unsqueeze(0)
        assert torch.equal(sincos_grid(dim, grid, base), want), (dim, grid, base)


def test_bad_inputs_are_named(pairs):
    _, ours = pairs["sd3-medium"]
    x, t, c, pooled = inputs(ours.config)
    with pytest.raises(RequestError, match=r"34x20 \(17x10 patches of 2\), larger than the positional grid of "
                                           r"16x16 patches \(pos_embed_max_size\): at most 32x32"):
        ours(torch.randn(2, 16, 34, 20), t, c, pooled)
    with pytest.raises(RequestError, match="13x20: height and width must be multiples of the patch size 2"):
        ours(torch.randn(2, 16, 13, 20), t, c, pooled)
    with pytest.raises(RequestError, match=r"latent has shape \[2, 4, 12, 20\]: expected \(batch, 16"):
        ours(torch.randn(2, 4, 12, 20), t, c, pooled)
    with pytest.raises(RequestError, match=r"context has shape \[2, 7, 31\]: expected \(2, tokens, 32\)"):
        ours(x, t, c[..., :31], pooled)
    with pytest.raises(RequestError, match=r"pooled_projections has shape \[1, 16\]: expected \(2, 16\)"):
        ours(x, t, c, pooled[:1])
    with pytest.raises(RequestError, match=r"timesteps have shape \[3\]"):
        ours(x, torch.ones(3), c, pooled)
    with pytest.raises(RequestError, match=r"skip_layers \[3\]: the MMDiT has blocks 0..2"):
        ours(x, t, c, pooled, skip_layers=[0, 3])
    with pytest.raises(RequestError, match=r"skip_layers \[1.5\]: expected block indices"):
        ours(x, t, c, pooled, skip_layers=[1.5])


# --- configs -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_presets_are_the_published_configs(name):
    assert MMDiTConfig.from_diffusers(json.loads(PUBLISHED[name])) == PRESETS[name] == MMDIT_PRESETS[name]


def test_config_round_trips_and_errors(pairs):
    for ref, ours in pairs.values():
        assert MMDiTConfig.from_diffusers(dict(ref.config)) == ours.config
        assert MMDiTConfig.from_diffusers(ours.config.to_diffusers()) == ours.config
    good = SD3_MEDIUM.to_diffusers()
    for change, message in (({"qk_norm": "layer_norm"}, "qk_norm='layer_norm' is not supported"),
                            ({"caption_projection_dim": 1152}, "caption_projection_dim=1152 must equal the width"),
                            ({"dual_attention_layers": [24]}, r"dual_attention_layers \[24\] lie outside"),
                            ({"patch_size": 0}, "patch_size=0 must be a positive integer"),
                            ({"use_pos_embed": True}, r"fields \['use_pos_embed'\] are not supported"),
                            ({"pos_embed_max_size": None}, "pos_embed_max_size=None"),
                            ({"_class_name": "FluxTransformer2DModel"}, "_class_name='FluxTransformer2DModel'")):
        with pytest.raises(ConfigError, match=message):
            MMDiTConfig.from_diffusers({**good, **change})
    with pytest.raises(ConfigError, match=r"lacks the fields \['num_layers'\]"):
        MMDiTConfig.from_diffusers({k: v for k, v in good.items() if k != "num_layers"})


@pytest.fixture(scope="module")
def meta_models():
    """The released sizes on the meta device: ours and diffusers' from the same config."""
    out = {}
    for name, cfg in PRESETS.items():
        with torch.device("meta"):
            out[name] = MMDiT(cfg), diffusers_mmdit(cfg)
    return out


@pytest.mark.parametrize("name", PRESETS)
def test_full_size_keys_and_shapes(meta_models, name):
    ours, ref = meta_models[name]
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert mine == theirs
    cfg = PRESETS[name]
    assert mine["pos_embed.pos_embed"] == (1, cfg.pos_embed_max_size ** 2, cfg.hidden)
    assert sum(k.endswith("attn2.to_q.weight") for k in mine) == len(cfg.dual_attention_layers)


# --- Stability's single-file names ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_stability_names_round_trip(pairs, case):
    """canonical -> Stability -> canonical is the identity, and diffusers' own single-file converter reads our
    Stability-named state back to the same tensors (the qkv split, the swapped (shift, scale) halves)."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    ref, _ = pairs[case]
    state = ref.state_dict()
    to_orig = mmdit_to_original(state)
    assert not to_orig.missing and not to_orig.unexpected
    orig = to_orig.materialize(state)
    assert all(k.startswith(MMDIT_PREFIX) for k in orig)
    assert f"{MMDIT_PREFIX}joint_blocks.0.x_block.attn.qkv.weight" in orig
    back = mmdit_from_original(orig, expected=state)
    assert not back.missing and not back.unexpected
    again = back.materialize(orig)
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
    theirs = convert_sd3_transformer_checkpoint_to_diffusers(dict(orig))
    assert theirs.keys() == state.keys() and all(torch.equal(theirs[k], state[k]) for k in state)


def test_swapped_modulations():
    """Only the output norm and the last block's text modulation are stored (shift, scale)."""
    keys = [f"{MMDIT_PREFIX}joint_blocks.{i}.context_block.adaLN_modulation.1.weight" for i in range(3)]
    keys.append(f"{MMDIT_PREFIX}final_layer.adaLN_modulation.1.bias")
    plan = mmdit_from_original(keys)
    swapped = sorted(k for k, e in plan.entries.items() if e.transform is SWAP_HALVES)
    assert swapped == ["norm_out.linear.bias", "transformer_blocks.2.norm1_context.linear.weight"]
    t = torch.arange(6.0)
    assert SWAP_HALVES.apply([t]).tolist() == [3.0, 4.0, 5.0, 0.0, 1.0, 2.0]


@pytest.mark.parametrize("case", ["sd3.5-medium", "sd3-medium"])
def test_stability_state_loads_and_runs(pairs, case):
    """A Stability-named state dict (with and without the prefix) loads key for key and gives diffusers' output."""
    ref, _ = pairs[case]
    cfg = CASES[case]
    state = ref.state_dict()
    x, t, c, pooled = inputs(cfg)
    with torch.no_grad():
        want = reference(ref, x, t, c, pooled)
    for prefix in (MMDIT_PREFIX, ""):
        orig = mmdit_to_original(state, prefix=prefix).materialize(state)
        assert mmdit_layout(orig) == ("stability", prefix)
        model = load_mmdit(MMDiT(cfg).eval(), orig)
        with torch.no_grad():
            assert torch.equal(model(x, t, c, pooled), want)
    with torch.device("meta"):
        empty = MMDiT(cfg)
    model = load_mmdit(empty.to(torch.bfloat16), mmdit_to_original(state).materialize(state)).eval()
    assert model.proj_out.weight.dtype == torch.bfloat16 and not model.proj_out.weight.is_meta
    assert torch.equal(model.pos_embed.pos_embed, state["pos_embed.pos_embed"].bfloat16())


def test_files_single_and_sharded(pairs, tmp_path):
    """From files: a Stability single file, and a diffusers transformer folder's weights in two shards."""
    from sdlite.weights import open_checkpoint, open_sharded, save_safetensors

    ref, _ = pairs["sd3.5-large"]
    cfg = CASES["sd3.5-large"]
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    orig = {k: v.contiguous() for k, v in mmdit_to_original(state).materialize(state).items()}
    save_safetensors(orig, tmp_path / "sd3.safetensors")
    names = sorted(state)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file, keys in shards.items():
        save_safetensors({k: state[k] for k in keys}, tmp_path / file)
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    x, t, c, pooled = inputs(cfg)
    with torch.no_grad():
        want = reference(ref, x, t, c, pooled)
    for store in (open_checkpoint(tmp_path / "sd3.safetensors"),
                  open_sharded(tmp_path / "diffusion_pytorch_model.safetensors.index.json")):
        with store:
            assert infer_mmdit_config({k: store.shape(k) for k in store}, sample_size=32, head_dim=8) == cfg
            model = load_mmdit(MMDiT(cfg).eval(), store)
            with torch.no_grad():
                assert torch.equal(model(x, t, c, pooled), want)


@pytest.mark.parametrize("name", PRESETS)
def test_infer_config_from_full_size_shapes(meta_models, name):
    """The config read back from the released shapes, in Stability's names and in diffusers'."""
    ours, _ = meta_models[name]
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    orig = mmdit_to_original(shapes).shapes(shapes)
    assert f"{MMDIT_PREFIX}pos_embed" in orig and f"{MMDIT_PREFIX}x_embedder.proj.weight" in orig
    assert infer_mmdit_config(orig) == PRESETS[name]
    assert infer_mmdit_config(shapes) == PRESETS[name]
    assert canonical_shapes(orig) == shapes


def test_tiny_configs_inferred(pairs):
    for name, (ref, _) in pairs.items():
        assert infer_mmdit_config(ref.state_dict(), sample_size=32, head_dim=8) == CASES[name], name


def test_weights_that_do_not_fit_are_named(pairs):
    ref, _ = pairs["sd3.5-medium"]
    cfg = CASES["sd3.5-medium"]
    state = ref.state_dict()
    orig = mmdit_to_original(state).materialize(state)
    qkv = f"{MMDIT_PREFIX}joint_blocks.1.x_block.attn2.qkv.weight"
    with pytest.raises(ConversionError, match="1 transformer keys are missing") as e:
        load_mmdit(MMDiT(cfg), {k: v for k, v in orig.items() if k != qkv})
    assert e.value.key == qkv
    ctx = f"{MMDIT_PREFIX}context_embedder.weight"
    with pytest.raises(ConversionError, match=r"shape \[16, 31\] gives \[16, 31\] for the transformer's "
                                              r"'context_embedder.weight', which needs \[16, 32\]") as e:
        load_mmdit(MMDiT(cfg), {**orig, ctx: torch.zeros(16, 31)})
    assert e.value.key == ctx
    qkv0 = f"{MMDIT_PREFIX}joint_blocks.0.context_block.attn.qkv.bias"
    with pytest.raises(ConversionError, match="which needs") as e:
        load_mmdit(MMDiT(cfg), {**orig, qkv0: torch.zeros(45)})
    assert e.value.key == qkv0
    extra = f"{MMDIT_PREFIX}joint_blocks.9.x_block.mlp.fc1.weight"
    with pytest.raises(ConversionError, match="have no place in the transformer") as e:
        load_mmdit(MMDiT(cfg), {**orig, extra: torch.zeros(64, 16)})
    assert e.value.key == extra
    with pytest.raises(ConversionError, match="missing") as e:   # diffusers' names are named as they are
        load_mmdit(MMDiT(cfg), {k: v for k, v in state.items() if k != "transformer_blocks.0.attn2.to_k.bias"})
    assert e.value.key == "transformer_blocks.0.attn2.to_k.bias"
    with pytest.raises(UnsupportedModelError, match="key 'pos_embed.pos_embed' is missing"):
        infer_mmdit_config({k: v for k, v in state.items() if k != "pos_embed.pos_embed"})
    with pytest.raises(UnsupportedModelError, match="no SD3 MMDiT keys among 2"):
        mmdit_plan(["model.diffusion_model.input_blocks.0.0.weight", "first_stage_model.decoder.conv_in.weight"])
    with pytest.raises(UnsupportedModelError, match="qk norms have a bias"):
        infer_mmdit_config({**state, "transformer_blocks.0.attn.norm_q.bias": torch.zeros(8)},
                           sample_size=32, head_dim=8)
