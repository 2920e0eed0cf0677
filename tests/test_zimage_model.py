"""Z-Image's transformer (sdlite.models.zimage) against diffusers' ZImageTransformer2DModel built from the same config
with random weights, and its key table (sdlite.weights.zimage_keys) against ComfyUI's single-file names, checked with
diffusers' own converter of those files: tiny configs bit for bit, the released size on the meta device."""
from __future__ import annotations

import json

import pytest
import torch

from sdlite.config import ConfigError
from sdlite.config.zimage import ZIMAGE_TURBO, ZImageConfig
from sdlite.errors import RequestError
from sdlite.models.zimage import ZImage
from sdlite.weights.plan import ConversionError, UnsupportedModelError
from sdlite.weights.zimage_keys import (
    ZIMAGE_PREFIX, canonical_shapes, infer_zimage_config, is_zimage, load_zimage, zimage_from_comfy, zimage_layout,
    zimage_plan, zimage_to_comfy,
)
from tests.reference import comfy_wrapped

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 2 heads of 32 (axes 8 + 12 + 12), 2 joint blocks and 1 + 1 refiners, captions 48 wide; positions bounded small
TINY = ZImageConfig(dim=64, n_heads=2, n_kv_heads=2, n_layers=2, n_refiner_layers=1, cap_feat_dim=48,
                    axes_dims=(8, 12, 12), axes_lens=(160, 32, 32))

# Tongyi-MAI/Z-Image-Turbo transformer/config.json as the hub serves it
PUBLISHED = """{"_class_name": "ZImageTransformer2DModel", "_diffusers_version": "0.36.0.dev0",
    "all_f_patch_size": [1], "all_patch_size": [2], "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512],
    "cap_feat_dim": 2560, "dim": 3840, "in_channels": 16, "n_heads": 30, "n_kv_heads": 30, "n_layers": 30,
    "n_refiner_layers": 2, "norm_eps": 1e-05, "qk_norm": true, "rope_theta": 256.0, "t_scale": 1000.0}"""


def _diffusers(cfg: ZImageConfig):
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(**{k: v for k, v in cfg.to_diffusers().items() if not k.startswith("_")}).eval()


def _random_state(model, seed: int = 0) -> dict:
    """Every tensor random (diffusers starts its pad tokens at zero and its norms at one, which would hide a swap):
    norm scales around 1, the rest N(0, 0.3)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.3 + (1.0 if "norm" in k else 0.0)
            for k, v in model.state_dict().items()}


def _pair(cfg: ZImageConfig = TINY):
    ref = _diffusers(cfg)
    ref.load_state_dict(_random_state(ref))
    ours = ZImage(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _reference(ref, x, t, caps):
    """diffusers' forward as ZImagePipeline calls it: one (C, 1, H, W) latent per sample, a caption per sample, the
    outputs stacked."""
    out = ref(list(x.unsqueeze(2).unbind(0)), t, caps, return_dict=False)[0]
    return torch.stack(out).squeeze(2)


@pytest.mark.parametrize("latent,lengths", [((6, 10), (5, 37)), ((8, 16), (32, 32))],
                         ids=["padded-and-masked", "no-padding"])
def test_tiny_transformer_is_bit_exact(latent, lengths):
    """Batch 2, two timesteps. A 6x10 latent (15 patches: 17 image pad tokens; rows and columns have their own ids)
    with captions of 5 and 37 tokens (padded to 32 and 64: the context refiner and the joint blocks run masked), and a
    8x16 latent with two 32-token captions (no padding, no mask). The padded-tensor form of the captions gives the same
    bits as the list."""
    torch.manual_seed(0)
    ref, ours = _pair()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, *latent, generator=g)
    caps = [torch.randn(n, 48, generator=g) for n in lengths]
    t = torch.tensor([0.3, 0.85])
    padded = torch.zeros(2, max(lengths), 48)
    for i, cap in enumerate(caps):
        padded[i, :len(cap)] = cap
    with torch.no_grad():
        expected = _reference(ref, x, t, caps)
        got = ours(x, t, caps)
        from_padded = ours(x, t, padded, context_lengths=torch.tensor(lengths))
        other_t = ours(x, t * 0.5, caps)
    assert got.shape == x.shape
    assert torch.equal(got, expected)
    assert torch.equal(from_padded, expected)
    assert not torch.equal(got, other_t)


def test_odd_latents_are_padded_as_comfyui_pads_them():
    """A latent of odd sides (ComfyUI's, from a size that is a multiple of 8 pixels but not of 16): ComfyUI's
    ``pad_to_patch_size`` (circular, at the bottom and the right) before the 2 x 2 patches, the positions those of the
    padded grid, the output cropped back: diffusers' bits on the padded latent. Zero padding would give other
    values."""
    import torch.nn.functional as F

    ref, ours = _pair()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 16, 5, 7, generator=g)
    caps = [torch.randn(n, 48, generator=g) for n in (6, 33)]
    t = torch.tensor([0.3, 0.85])
    wrapped = comfy_wrapped(x)                                            # (2, 16, 6, 8): row 0 again, column 0
    with torch.no_grad():
        got = ours(x, t, caps)
        assert got.shape == x.shape
        assert torch.equal(got, _reference(ref, wrapped, t, caps)[:, :, :5, :7])
        zeros = _reference(ref, F.pad(x, (0, 1, 0, 1)), t, caps)[:, :, :5, :7]
        assert (got - zeros).abs().max() > 1e-3
        wide = ours(x[:, :, :4], t, caps)                                  # one side odd: 4 x 7
        assert torch.equal(wide, _reference(ref, comfy_wrapped(x[:, :, :4]), t, caps)[:, :, :, :7])


def test_bf16_is_bit_exact_too():
    """In bf16 (RMS norms in fp32 and back, rotary in fp32) the same bits as diffusers' model cast to bf16."""
    torch.manual_seed(0)
    ref, ours = _pair()
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, 4, 6, generator=g)
    caps = [torch.randn(n, 48, generator=g) for n in (3, 40)]
    t = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        expected = _reference(ref, x.bfloat16(), t, [c.bfloat16() for c in caps])
        got = ours(x, t, caps)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def _comfy(state: dict) -> dict:
    """ComfyUI's names for a diffusers state dict, written here from the documented mapping (independent of
    sdlite.weights.zimage_keys): q, k and v stacked into attention.qkv; attention.out, q_norm, k_norm;
    x_embedder and final_layer for the 2-1 embedder and output layer."""
    out = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            base = key.split(".attention.to_q.")[0] + ".attention."
            out[base + "qkv.weight"] = torch.cat([value, state[base + "to_k.weight"], state[base + "to_v.weight"]])
            continue
        for old, new in (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer."),
                         (".attention.to_out.0.", ".attention.out."), (".attention.norm_q.", ".attention.q_norm."),
                         (".attention.norm_k.", ".attention.k_norm.")):
            key = key.replace(old, new)
        out[key] = value
    return out


def test_comfy_layout_converts_back_exactly():
    """The tiny model's weights in ComfyUI's names (as diffusers' own converter reads them back, so the names are
    right) come back through sdlite's table bit for bit, bare and under 'model.diffusion_model.', with Lumina 2's
    unused 'norm_final.weight' ignored; a model loads them; the table's inverse writes the same names; the config
    read from the shapes is the model's."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    torch.manual_seed(0)
    ref = _random_state(_diffusers(TINY))
    comfy = _comfy(ref)
    assert comfy["layers.1.attention.qkv.weight"].shape == (192, 64) and "x_embedder.weight" in comfy
    converted = convert_z_image_transformer_checkpoint_to_diffusers(dict(comfy))
    assert set(converted) == set(ref) and all(torch.equal(converted[k], ref[k]) for k in ref)
    for prefix in ("", ZIMAGE_PREFIX):
        source = {prefix + k: v for k, v in comfy.items()}
        source[prefix + "norm_final.weight"] = torch.ones(64)
        assert zimage_layout(source) == ("comfy", prefix)
        plan = zimage_from_comfy(source.keys(), prefix=prefix, expected=ref.keys())
        assert not plan.missing and not plan.unexpected and plan.ignored == [prefix + "norm_final.weight"]
        back = plan.materialize(source)
        assert set(back) == set(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
        model = load_zimage(ZImage(TINY), source)
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
        assert infer_zimage_config(source, release=TINY) == TINY
    exported = zimage_to_comfy(ref.keys())
    assert not exported.missing and not exported.unexpected
    written = exported.materialize(ref)
    assert set(written) == set(comfy) and all(torch.equal(written[k], comfy[k]) for k in comfy)
    assert zimage_layout(ref) == ("diffusers", "") and infer_zimage_config(ref, release=TINY) == TINY


def test_full_size_architecture_on_meta():
    """Z-Image-Turbo's transformer: diffusers' every key (521) and shape, a strict load, 6.15B parameters; ComfyUI's
    names for them are those diffusers' converter reads (keys and shapes); the config read from those shapes is the
    release's."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    with torch.device("meta"):
        ref = _diffusers(ZIMAGE_TURBO)
        ours = ZImage(ZIMAGE_TURBO)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs and len(theirs) == 521
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    assert sum(p.numel() for p in ours.parameters()) == 6_154_908_736
    assert theirs["layers.0.feed_forward.w1.weight"] == (10240, 3840)
    assert theirs["layers.0.adaLN_modulation.0.weight"] == (15360, 256)
    comfy = zimage_to_comfy(theirs).shapes(theirs)
    assert comfy["layers.29.attention.qkv.weight"] == (11520, 3840)
    with torch.device("meta"):
        converted = convert_z_image_transformer_checkpoint_to_diffusers({k: torch.empty(s) for k, s in comfy.items()})
    assert {k: tuple(v.shape) for k, v in converted.items()} == theirs
    assert canonical_shapes(comfy) == theirs
    assert infer_zimage_config(comfy) == ZIMAGE_TURBO and is_zimage(comfy) and is_zimage(theirs)


def test_detection():
    """Z-Image in each layout (names alone, or names and shapes); not a Lumina 2 NextDiT (same names, modulation
    through adaLN_modulation.1), not the Omni variant, not FLUX, not a Z-Image ControlNet, not weights whose widths
    disagree."""
    ref = {k: tuple(v.shape) for k, v in ZImage(TINY).state_dict().items()}
    comfy = {k: tuple(v.shape) for k, v in _comfy({k: torch.empty(s) for k, s in ref.items()}).items()}
    prefixed = {ZIMAGE_PREFIX + k: s for k, s in comfy.items()}
    for state in (ref, comfy, prefixed):
        assert is_zimage(state) and is_zimage(list(state))
    lumina = {k.replace("adaLN_modulation.0", "adaLN_modulation.1"): s for k, s in comfy.items()}
    assert not is_zimage(lumina)
    with pytest.raises(UnsupportedModelError, match="Lumina-Image 2.0"):
        zimage_layout(lumina)
    omni = {**ref, "siglip_embedder.0.weight": (32,)}
    assert not is_zimage(omni)
    with pytest.raises(UnsupportedModelError, match="Omni"):
        zimage_plan(omni)
    assert not is_zimage({**comfy, "layers.0.adaLN_modulation.0.weight": (256, 1024)})
    assert not is_zimage(["double_blocks.0.img_attn.qkv.weight", "img_in.weight"])
    assert not is_zimage(["control_all_x_embedder.2-1.weight", "control_layers.0.adaLN_modulation.0.weight"])
    with pytest.raises(UnsupportedModelError, match="no Z-Image transformer keys"):
        zimage_plan(["model.diffusion_model.double_blocks.0.img_attn.qkv.weight"])


def test_bad_weights_are_named():
    """A missing key by its ComfyUI name (the fused qkv), a key with no place, a wrong shape by its source key."""
    torch.manual_seed(0)
    comfy = _comfy(_random_state(_diffusers(TINY)))
    missing = {k: v for k, v in comfy.items() if k != "noise_refiner.0.attention.qkv.weight"}
    with pytest.raises(ConversionError, match=r"noise_refiner\.0\.attention\.qkv\.weight"):
        load_zimage(ZImage(TINY), missing)
    extra = {**comfy, "layers.0.attention.bogus.weight": torch.zeros(1)}
    with pytest.raises(ConversionError, match="bogus"):
        load_zimage(ZImage(TINY), extra)
    wrong = {**comfy, "layers.1.feed_forward.w2.weight": torch.zeros(64, 171)}
    with pytest.raises(ConversionError, match=r"layers\.1\.feed_forward\.w2\.weight.*\[64, 170\]"):
        load_zimage(ZImage(TINY), wrong)
    uneven = {**comfy, "layers.0.attention.qkv.weight": torch.zeros(190, 64)}
    with pytest.raises(ConversionError, match=r"layers\.0\.attention\.qkv\.weight"):
        load_zimage(ZImage(TINY), uneven)


def test_bad_inputs_are_named():
    model = ZImage(TINY).eval()
    x, cap = torch.zeros(1, 16, 4, 4), [torch.zeros(3, 48)]
    with torch.no_grad():
        with pytest.raises(RequestError, match="latent"):
            model(torch.zeros(1, 4, 4, 4), 0.5, cap)
        with pytest.raises(RequestError, match="caption 0"):
            model(x, 0.5, [torch.zeros(3, 40)])
        with pytest.raises(RequestError, match="2 captions"):
            model(x, 0.5, cap * 2)
        with pytest.raises(RequestError, match="context_lengths"):
            model(x, 0.5, torch.zeros(1, 3, 48), context_lengths=[4])
        with pytest.raises(RequestError, match="timesteps"):
            model(x, torch.tensor([0.5, 0.5]), cap)
        with pytest.raises(RequestError, match="columns.*axes_lens"):
            model(torch.zeros(1, 16, 4, 66), 0.5, cap)
        with pytest.raises(RequestError, match="caption.*axes_lens"):
            model(x, 0.5, [torch.zeros(150, 48)])


def test_config():
    """The published config reads to the preset and back; a config.json without axes_lens gets diffusers' class
    default; unsupported fields and inconsistent sizes are named."""
    assert ZImageConfig.from_diffusers(json.loads(PUBLISHED)) == ZIMAGE_TURBO
    assert ZImageConfig.from_diffusers(ZIMAGE_TURBO.to_diffusers()) == ZIMAGE_TURBO
    published = {k: v for k, v in json.loads(PUBLISHED).items() if k != "axes_lens"}
    assert ZImageConfig.from_diffusers(published).axes_lens == (1024, 512, 512)
    assert (ZIMAGE_TURBO.head_dim, ZIMAGE_TURBO.ffn_hidden, ZIMAGE_TURBO.adaln_dim) == (128, 10240, 256)
    with pytest.raises(ConfigError, match="axes_dims"):
        ZImageConfig(axes_dims=(32, 48, 40))
    with pytest.raises(ConfigError, match="siglip_feat_dim"):
        ZImageConfig(siglip_feat_dim=1152)
    with pytest.raises(ConfigError, match="all_patch_size"):
        ZImageConfig(all_patch_size=(2, 4), all_f_patch_size=(1, 1))
    with pytest.raises(ConfigError, match="n_kv_heads"):
        ZImageConfig(n_kv_heads=10)
    with pytest.raises(ConfigError, match="not supported"):
        ZImageConfig.from_diffusers({"_class_name": "ZImageTransformer2DModel", "bogus": 1})
