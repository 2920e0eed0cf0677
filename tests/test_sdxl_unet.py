"""SDXL's UNet (the same UNet class, driven by its config) against diffusers' UNet2DConditionModel: a level without
attention, transformer depth per level, Linear projections, and the "text_time" added conditioning."""
from __future__ import annotations

import pytest
import torch

from sdlite.config import ConfigError, UNetConfig
from sdlite.models.unet import UNet
from tests.reference import diffusers_unet, max_rel_err, seed_all
from tests.test_models_parity import _load_same

TOL = 1e-4

# SDXL base in small: levels (no attention, depth 2, depth 3), heads of width 8, 6 size/crop ids of width 8
TINY_SDXL = UNetConfig(block_channels=(32, 64, 64), layers_per_block=2, attention=(False, True, True),
                       heads=(4, 8, 8), context_dim=48, linear_projection=True, transformer_depth=(1, 2, 3),
                       addition_embed="text_time", addition_time_embed_dim=8, add_embed_in=24 + 6 * 8,
                       sample_size=16)
# the refiner's shape: 5 ids (aesthetic score instead of the target size), attention at the middle levels only
TINY_REFINER = UNetConfig(block_channels=(32, 64, 64, 64), layers_per_block=1, attention=(False, True, True, False),
                          heads=(4, 8, 8, 8), context_dim=40, linear_projection=True, transformer_depth=2,
                          addition_embed="text_time", addition_time_embed_dim=8, add_embed_in=40 + 5 * 8,
                          sample_size=16)


@pytest.mark.parametrize("cfg, pooled, n_ids", [(TINY_SDXL, 24, 6), (TINY_REFINER, 40, 5)], ids=["base", "refiner"])
def test_sdxl_unet_matches_diffusers(cfg, pooled, n_ids):
    ref = seed_all(diffusers_unet(cfg), scale=0.05)
    assert ref.config.addition_embed_type == "text_time"
    ours = _load_same(UNet(cfg), ref)
    assert UNetConfig.from_diffusers(dict(ref.config)) == cfg      # the config round-trips through diffusers'
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 16, 24, generator=g)
    ctx = torch.randn(2, 11, cfg.context_dim, generator=g)
    text_embeds = torch.randn(2, pooled, generator=g)
    ids = [1024.0, 768.0, 0.0, 64.0, 1024.0, 1024.0][:n_ids] if n_ids == 6 else [1024.0, 1024.0, 0.0, 0.0, 6.0]
    time_ids = torch.tensor([ids, ids[::-1]])
    t = torch.tensor([999.0, 17.5])
    with torch.no_grad():
        expected = ref(x, t, encoder_hidden_states=ctx,
                       added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids}).sample
        got = ours(x, t, ctx, text_embeds=text_embeds, time_ids=time_ids)
        # the added conditioning matters: other ids give another output
        other = ours(x, t, ctx, text_embeds=text_embeds, time_ids=time_ids + 128)
    assert max_rel_err(got, expected) <= TOL
    assert max_rel_err(other, expected) > 10 * TOL


def test_sdxl_unet_needs_its_added_conditioning():
    unet = UNet(TINY_SDXL).eval()
    x, t, ctx = torch.zeros(1, 4, 8, 8), torch.tensor([1.0]), torch.zeros(1, 5, 48)
    with pytest.raises(ValueError, match="text_embeds and time_ids"):
        unet(x, t, ctx)
    with pytest.raises(ValueError, match="5 ids of 8 do not make the 72 inputs"):
        unet(x, t, ctx, text_embeds=torch.zeros(1, 24), time_ids=torch.zeros(1, 5))


def test_sdxl_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="transformer_depth"):
        UNetConfig(block_channels=(32, 64), attention=(True, True), heads=(2, 2), transformer_depth=(1, 2, 3))
    with pytest.raises(ConfigError, match="projection_class_embeddings_input_dim"):
        UNetConfig(block_channels=(32, 64), attention=(True, True), heads=(2, 2), addition_embed="text_time")
    d = TINY_SDXL.to_diffusers()
    with pytest.raises(ConfigError, match="addition_embed_type='image'"):
        UNetConfig.from_diffusers({**d, "addition_embed_type": "image"})
