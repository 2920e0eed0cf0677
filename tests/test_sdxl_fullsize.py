"""SDXL base's UNet at its published size (2,567.5M parameters) against diffusers, with the same weights.

The two modules share every weight tensor: diffusers' model is built on the meta device and given its weights
as views, and ours takes the very same tensors. The weights are windows of a few seeded random pools, one per
fan-in (each window at its own offset, scaled like PyTorch's default initialisation), so every parameter holds
its own values while the pools take about 0.7 GB, instead of 10.3 GB of fp32 weights that would take tens of
seconds to fill on two cores. A 16x16 latent at batch 2 (as classifier-free guidance runs it) keeps each forward
pass to seconds.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

from sdlite.config import SDXL_BASE
from sdlite.models.unet import UNet
from tests.reference import max_rel_err

pytestmark = pytest.mark.slow

TOL = 1e-4
N_PARAMS = 2_567_463_684     # stabilityai/stable-diffusion-xl-base-1.0's unet


def pooled_weights(state: dict[str, torch.Tensor], norms: set[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random values for every tensor of ``state`` (shapes only, e.g. on the meta device), as views.

    Weights of fan-in n are uniform in +-1/sqrt(n), like PyTorch's default init, so activations keep their scale;
    norm scales are 1 + U(-0.1, 0.1), biases U(-0.05, 0.05). Each group of tensors draws from one pool, each
    tensor from a window at a seeded random offset: same-shaped tensors hold different values."""
    g = torch.Generator().manual_seed(seed)

    def group(name: str, t: torch.Tensor):
        if t.dim() >= 2:
            return ("weight", t[0].numel())
        return ("norm", 0) if name.rpartition(".")[0] in norms and name.endswith(".weight") else ("bias", 0)

    largest: dict[tuple, int] = defaultdict(int)
    for name, t in state.items():
        largest[group(name, t)] = max(largest[group(name, t)], t.numel())
    pools = {}
    for (kind, fan_in), n in sorted(largest.items()):
        pool = torch.empty(n + max(n // 2, 1 << 16)).uniform_(-1.0, 1.0, generator=g)
        if kind == "weight":
            pool.mul_(fan_in ** -0.5)
        elif kind == "norm":
            pool.mul_(0.1).add_(1.0)
        else:
            pool.mul_(0.05)
        pools[kind, fan_in] = pool
    views = {}
    for name, t in sorted(state.items()):
        pool = pools[group(name, t)]
        offset = int(torch.randint(0, pool.numel() - t.numel() + 1, (), generator=g))
        views[name] = pool[offset:offset + t.numel()].view(t.shape)
    return views


@pytest.fixture(scope="module")
def models():
    from diffusers import UNet2DConditionModel

    cfg = SDXL_BASE.unet
    d = cfg.to_diffusers()
    d.pop("_class_name")
    with torch.device("meta"):
        ref = UNet2DConditionModel(**d)
        ours = UNet(cfg)
    norms = {name for name, m in ref.named_modules() if isinstance(m, (nn.GroupNorm, nn.LayerNorm))}
    ref.load_state_dict(pooled_weights(ref.state_dict(), norms), strict=True, assign=True)
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    yield ref.eval().requires_grad_(False), ours.eval().requires_grad_(False)


def inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 16, 16, generator=g)
    ctx = torch.randn(2, 77, SDXL_BASE.unet.context_dim, generator=g)
    pooled = torch.randn(2, 1280, generator=g)
    # original size, crop top-left, target size: as the pipeline sends them (the same for both halves of CFG
    # there; different here, so each row of the batch is checked with its own)
    time_ids = torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0], [768.0, 1152.0, 64.0, 32.0, 1024.0, 1024.0]])
    return x, torch.tensor([981.0, 1.0]), ctx, pooled, time_ids


def test_weights_are_shared_and_counted(models):
    ref, ours = models
    n_params = sum(p.numel() for p in ref.parameters())
    assert n_params == N_PARAMS
    assert sum(p.numel() for p in ours.parameters()) == n_params
    theirs = ref.state_dict()
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys()
    for name, p in mine.items():
        assert p.device.type == "cpu", name
        assert (p.data_ptr(), p.shape, p.stride()) == (theirs[name].data_ptr(), theirs[name].shape,
                                                       theirs[name].stride()), name
    # one storage for many tensors: the pools, far smaller than the 10.3 GB the weights would take
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in ours.parameters()}
    assert sum(storages.values()) < 1e9


def test_full_size_sdxl_unet_matches_diffusers(models):
    ref, ours = models
    x, t, ctx, pooled, time_ids = inputs()
    with torch.no_grad():
        expected = ref(x, t, encoder_hidden_states=ctx,
                       added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
        got = ours(x, t, ctx, text_embeds=pooled, time_ids=time_ids)
        other = ours(x, t, ctx, text_embeds=pooled, time_ids=time_ids.flip(0))
    assert got.shape == expected.shape == x.shape
    assert max_rel_err(got, expected) <= TOL
    # not a degenerate output: finite, spread out, each sample its own, and the size/crop ids matter
    assert torch.isfinite(got).all()
    assert got.std().item() > 0.05
    assert max_rel_err(got[0], got[1]) > 0.05
    assert max_rel_err(other, got) > 1e-3
