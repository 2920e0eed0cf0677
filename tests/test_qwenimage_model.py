"""Qwen-Image's transformer (sdlite.models.qwenimage) against diffusers' QwenImageTransformer2DModel built from the same
config with random weights: tiny configs bit for bit (text to image, padded text, edit sequences of several images,
Qwen-Image-Edit-2511's zero_cond_t), the released architecture on the meta device; its key table
(sdlite.weights.qwenimage_keys: diffusers' names, bare or under ComfyUI's prefix)."""
from __future__ import annotations

import json

import pytest
import torch

from sdlite.config import ConfigError
from sdlite.config.qwenimage import QWEN_IMAGE, QWEN_IMAGE_EDIT_2511, QWEN_IMAGE_PRESETS, QwenImageConfig
from sdlite.errors import RequestError
from sdlite.models.qwenimage import QwenImage
from sdlite.weights.plan import ConversionError, UnsupportedModelError
from sdlite.weights.qwenimage_keys import (
    QWENIMAGE_PREFIX, infer_qwenimage_config, is_qwenimage, load_qwenimage, qwenimage_layout,
)
from tests.reference import comfy_wrapped

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 2 heads of 16 (rotary axes 4, 6, 6), 2 blocks, text 24 wide, 16 values a patch (4 latent channels)
TINY = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
            axes_dims_rope=(4, 6, 6), in_channels=16, out_channels=4)

# Qwen/Qwen-Image transformer/config.json as the hub serves it (less the bookkeeping)
PUBLISHED = """{"_class_name": "QwenImageTransformer2DModel", "_diffusers_version": "0.34.0.dev0",
    "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56], "guidance_embeds": false, "in_channels": 64,
    "joint_attention_dim": 3584, "num_attention_heads": 24, "num_layers": 60, "out_channels": 16, "patch_size": 2,
    "pooled_projection_dim": 768}"""


def _diffusers(cfg: QwenImageConfig):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(**{k: v for k, v in cfg.to_diffusers().items()
                                          if not k.startswith("_")}).eval()


def _pair(cfg: QwenImageConfig, seed: int = 0):
    """diffusers' model with every tensor random (norm scales around 1, the rest N(0, 0.3)) and sdlite's loaded from
    it."""
    ref = _diffusers(cfg)
    g = torch.Generator().manual_seed(seed)
    ref.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.3 + (1.0 if "norm" in k else 0.0)
                         for k, v in ref.state_dict().items()})
    ours = QwenImage(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _reference(ref, x, t, ctx, mask=None, references=()):
    """diffusers' forward as QwenImagePipeline / QwenImageEditPlusPipeline call it: packed latents, the source latents
    packed and appended with their shapes in img_shapes, the timestep / 1000; the output cut to the image's tokens and
    unpacked."""
    from diffusers import QwenImagePipeline as P

    b, c, h, w = x.shape
    tokens = [P._pack_latents(x, b, c, h, w)]
    shapes = [(1, h // 2, w // 2)]
    for r in references:
        tokens.append(P._pack_latents(r[None], 1, c, r.shape[1], r.shape[2]).expand(b, -1, -1))
        shapes.append((1, r.shape[1] // 2, r.shape[2] // 2))
    out = ref(torch.cat(tokens, dim=1), ctx, mask, t, [shapes] * b, return_dict=False)[0][:, :(h // 2) * (w // 2)]
    return P._unpack_latents(out, h * 8, w * 8, 8)[:, :, 0]


@pytest.mark.parametrize("zero_cond_t", [False, True], ids=["qwen-image", "edit-2511"])
def test_tiny_transformer_is_bit_exact(zero_cond_t):
    """Batch 2, two timesteps, a 6x10 latent (rectangular, odd patch counts: the centring rounds), 7 text tokens with
    and without pads; then an edit with two source latents of their own sizes: diffusers' bits in each case."""
    cfg = QwenImageConfig(**TINY, zero_cond_t=zero_cond_t)
    ref, ours = _pair(cfg)
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 4, 6, 10, generator=g), torch.randn(2, 7, 24, generator=g)
    refs = [torch.randn(4, 4, 6, generator=g), torch.randn(4, 2, 8, generator=g)]
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    t = torch.tensor([0.9815, 0.423])
    with torch.no_grad():
        for m in (None, mask):
            assert torch.equal(ours(x, t, ctx, m), _reference(ref, x, t, ctx, m))
        edit = ours(x, t, ctx, mask, refs)
        assert torch.equal(edit, _reference(ref, x, t, ctx, mask, refs))
        assert not torch.equal(edit, ours(x, t, ctx, mask))
        assert torch.equal(ours(x, t, ctx, torch.ones(2, 7)), ours(x, t, ctx))
        assert not torch.equal(ours(x, t * 0.5, ctx), ours(x, t, ctx))


def test_odd_latents_are_padded_as_comfyui_pads_them():
    """A latent of odd sides (ComfyUI's, from a size that is a multiple of 8 pixels but not of 16), a source latent's
    too: ComfyUI's ``pad_to_patch_size`` (circular, at the bottom and the right) before the 2 x 2 patches, the output
    cropped back; diffusers' bits on the padded latents. Zero padding would give other values."""
    import torch.nn.functional as F

    ref, ours = _pair(QwenImageConfig(**TINY), seed=4)
    g = torch.Generator().manual_seed(5)
    x, ctx = torch.randn(2, 4, 5, 7, generator=g), torch.randn(2, 3, 24, generator=g)
    source = torch.randn(4, 3, 4, generator=g)
    t = torch.tensor([0.8, 0.3])
    wrapped = comfy_wrapped(x)                                            # (2, 4, 6, 8): row 0 again, column 0
    wrapped_source = comfy_wrapped(source)                                # (4, 4, 4)
    with torch.no_grad():
        got = ours(x, t, ctx)
        assert got.shape == x.shape
        assert torch.equal(got, _reference(ref, wrapped, t, ctx)[:, :, :5, :7])
        zeros = _reference(ref, F.pad(x, (0, 1, 0, 1)), t, ctx)[:, :, :5, :7]
        assert (got - zeros).abs().max() > 1e-3
        edit = ours(x, t, ctx, references=[source])
        assert torch.equal(edit, _reference(ref, wrapped, t, ctx, references=[wrapped_source])[:, :, :5, :7])


def test_zero_cond_t_modulates_the_sources_at_timestep_0():
    """With zero_cond_t and no source image the network is Qwen-Image's (up to rounding: the modulations' Linear runs
    on twice the rows); with one it is not."""
    plain, zero = QwenImage(QwenImageConfig(**TINY)).eval(), QwenImage(QwenImageConfig(**TINY, zero_cond_t=True)).eval()
    zero.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(2)
    x, ctx, ref = torch.randn(1, 4, 4, 4, generator=g), torch.randn(1, 3, 24, generator=g), torch.randn(4, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(plain(x, 0.6, ctx), zero(x, 0.6, ctx), rtol=1e-5, atol=1e-5)
        diff = plain(x, 0.6, ctx, references=[ref]) - zero(x, 0.6, ctx, references=[ref])
        assert diff.abs().max() > 1e-3


def test_bf16_is_bit_exact_too():
    ref, ours = _pair(QwenImageConfig(**TINY))
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    x, ctx = torch.randn(1, 4, 4, 6, generator=g), torch.randn(1, 5, 24, generator=g)
    with torch.no_grad():
        expected = _reference(ref, x.bfloat16(), torch.tensor([0.5]).bfloat16(), ctx.bfloat16())
        got = ours(x, torch.tensor([0.5]), ctx)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


@pytest.mark.parametrize("cfg", [QWEN_IMAGE, QWEN_IMAGE_EDIT_2511], ids=["qwen-image", "edit-2511"])
def test_full_size_architecture_on_meta(cfg):
    """The releases' transformer: diffusers' every key and shape, a strict load, 20.43 B parameters; the config read
    back from the shapes (bare and under ComfyUI's prefix) is the preset's."""
    with torch.device("meta"):
        ref = _diffusers(cfg)
        ours = QwenImage(cfg)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    assert sum(p.numel() for p in ours.parameters()) == 20_430_401_088
    assert infer_qwenimage_config(theirs, zero_cond_t=cfg.zero_cond_t) == cfg
    comfy = {QWENIMAGE_PREFIX + k: s for k, s in theirs.items()}
    assert infer_qwenimage_config(comfy, zero_cond_t=cfg.zero_cond_t) == cfg
    assert is_qwenimage(theirs) and is_qwenimage(comfy) and is_qwenimage(list(comfy))


def test_layouts_load_and_detection():
    """diffusers' names bare (folders, ComfyUI's split files) or under ComfyUI's prefix load to the same weights; FLUX.1
    and SD3 transformers are not Qwen-Image; bad weights are named by their source key."""
    from sdlite.config.flux import FluxConfig
    from sdlite.models.flux import Flux

    cfg = QwenImageConfig(**TINY)
    _, ours = _pair(cfg)
    state = ours.state_dict()
    for prefix in ("", QWENIMAGE_PREFIX):
        source = {prefix + k: v for k, v in state.items()}
        assert qwenimage_layout(source) == ("diffusers", prefix)
        loaded = load_qwenimage(QwenImage(cfg), source).state_dict()
        assert all(torch.equal(v, state[k]) for k, v in loaded.items())
    with torch.device("meta"):
        flux = Flux(FluxConfig(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                               joint_attention_dim=32, pooled_projection_dim=24, axes_dims_rope=(4, 6, 6),
                               guidance_embeds=False)).state_dict()
    assert not is_qwenimage(flux) and not is_qwenimage(list(flux))
    with pytest.raises(UnsupportedModelError, match="no Qwen-Image transformer keys"):
        load_qwenimage(QwenImage(cfg), flux)
    assert not is_qwenimage({**state, "norm_out.linear.weight": torch.zeros(48, 32)})
    missing = {QWENIMAGE_PREFIX + k: v for k, v in state.items() if k != "transformer_blocks.1.attn.to_q.bias"}
    with pytest.raises(ConversionError, match=r"model\.diffusion_model\.transformer_blocks\.1\.attn\.to_q\.bias"):
        load_qwenimage(QwenImage(cfg), missing)
    wrong = {**state, "txt_in.weight": torch.zeros(32, 25)}
    with pytest.raises(ConversionError, match=r"txt_in\.weight"):
        load_qwenimage(QwenImage(cfg), wrong)
    with pytest.raises(ConversionError, match="bogus"):
        load_qwenimage(QwenImage(cfg), {**state, "transformer_blocks.0.bogus.weight": torch.zeros(1)})
    with pytest.raises(UnsupportedModelError, match="rotary axes"):
        infer_qwenimage_config(state)


def test_bad_inputs_are_named():
    model = QwenImage(QwenImageConfig(**TINY)).eval()
    x, ctx = torch.zeros(1, 4, 4, 4), torch.zeros(1, 3, 24)
    with torch.no_grad():
        with pytest.raises(RequestError, match="latent"):
            model(torch.zeros(1, 3, 4, 4), 0.5, ctx)
        with pytest.raises(RequestError, match="context has shape"):
            model(x, 0.5, torch.zeros(1, 3, 32))
        with pytest.raises(RequestError, match="context mask"):
            model(x, 0.5, ctx, torch.tensor([[1, 0]]))
        with pytest.raises(RequestError, match="timesteps"):
            model(x, torch.tensor([0.5, 0.5]), ctx)
        with pytest.raises(RequestError, match="reference 0"):
            model(x, 0.5, ctx, references=[torch.zeros(3, 4, 4)])
        tokens = torch.zeros(2, 4, 16)
        with pytest.raises(RequestError, match="make 6 tokens"):
            model.tokens(tokens, ctx.expand(2, -1, -1), 0.5, [[(1, 2, 3)]] * 2)
        with pytest.raises(RequestError, match="differ between the samples"):
            model.tokens(tokens, ctx.expand(2, -1, -1), 0.5, [[(1, 2, 2)], [(1, 1, 4)]])


def test_config():
    """The published Qwen-Image config reads to the preset (pooled_projection_dim ignored), every preset back from its
    own diffusers form, 2511's zero_cond_t; Qwen-Image-Layered's switches and inconsistent sizes are named."""
    assert QwenImageConfig.from_diffusers(json.loads(PUBLISHED)) == QWEN_IMAGE
    for cfg in QWEN_IMAGE_PRESETS.values():
        assert QwenImageConfig.from_diffusers(cfg.to_diffusers()) == cfg
    assert QwenImageConfig.from_diffusers({"zero_cond_t": True}) == QWEN_IMAGE_EDIT_2511
    assert (QWEN_IMAGE.hidden, QWEN_IMAGE.latent_channels) == (3072, 16)
    with pytest.raises(ConfigError, match=r"\['bogus'\] are not supported"):
        QwenImageConfig.from_diffusers({"bogus": 1})
    with pytest.raises(ConfigError, match="Qwen-Image-Layered"):
        QwenImageConfig.from_diffusers({"use_layer3d_rope": True, "use_additional_t_cond": True})
    with pytest.raises(ConfigError, match="_class_name"):
        QwenImageConfig.from_diffusers({"_class_name": "FluxTransformer2DModel"})
    with pytest.raises(ConfigError, match="axes_dims_rope"):
        QwenImageConfig(axes_dims_rope=(16, 56, 54))
    with pytest.raises(ConfigError, match="patch_size"):
        QwenImageConfig(patch_size=1)
    with pytest.raises(ConfigError, match="in_channels"):
        QwenImageConfig(in_channels=32)
    with pytest.raises(ConfigError, match="guidance_embeds"):
        QwenImageConfig(guidance_embeds=True)
