"""sdlite's bf16 kernels for the transformers' elementwise work, against diffusers' own functions bit for bit:

* the rotary embedding (``sdl_rope_bf16``, ``sdlite.kernels.bf16.rope``) and the helpers the transformers call
  (``sdlite.models.layers.rotate_pairs``, ``rotate_joined``, ``pair_tables``) against diffusers' ``apply_rotary_emb``
  (FLUX.1's real form), wherever the output lands (strided, a slice of the joined sequence, in place);
* the RMS norm's scaling (``sdl_rms_scale_bf16``, ``sdlite.kernels.bf16.rms_scale``) through
  ``sdlite.models.layers.RMSNorm`` against diffusers' ``RMSNorm``;
* the attention of a batch of captions of different lengths (``sdlite.models.mmdit.padded_attention``: each sample's
  own keys on the attention kernel) against PyTorch's masked SDPA;

each used exactly where it applies. The transformers' bf16 forward through it is checked against
diffusers' bit for bit by test_flux_model, test_zimage_model and test_qwenimage_model (``test_bf16_is_bit_exact_too``
and the like)."""
from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

from sdlite.kernels import bf16 as kernels
from sdlite.kernels import build
from sdlite.models.layers import RMSNorm, pair_tables, rotate_joined, rotate_pairs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RUNS_HERE = kernels.cpu_problem() is None and build.compiler() is not None and not build.disabled()


def _tables(s: int, d: int, batch: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (S, D) or (B, S, D), each pair's value repeated, of random angles up to a few thousand radians
    (FLUX.1's positions times its frequencies)."""
    g = torch.Generator().manual_seed(seed)
    shape = (s, d // 2) if batch is None else (batch, s, d // 2)
    angles = torch.rand(shape, generator=g) * torch.logspace(0, -3.5, d // 2) * 3000
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


def _tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).bfloat16()


def _diffusers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' FLUX.1 rotation of x (B, S, h, D) (its ``sequence_dim=1`` layout), per sample for (B, S, D)
    tables."""
    if cos.dim() == 2:
        return apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1, sequence_dim=1)
    return torch.cat([_diffusers(x[i:i + 1], cos[i], sin[i]) for i in range(x.shape[0])])


# (B, S, h, D): FLUX.1's joint sequence at 512^2, SD3-wide heads, a head dim with a 16-lane tail (56), the smallest pair
SHAPES = [(1, 1280, 24, 128), (2, 333, 3, 64), (2, 77, 5, 56), (3, 9, 1, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("batch_tables", [False, True])
def test_rotation_equals_diffusers_bit_for_bit(shape, batch_tables):
    b, s, h, d = shape
    x = _tokens(*shape)
    cos, sin = _tables(s, d, b if batch_tables else None)
    got = rotate_pairs(x, cos, sin)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.equal(got, _diffusers(x, cos, sin))
    assert (kernels.rope(x, cos, sin) is not None) == RUNS_HERE, kernels.status()


def test_fp32_and_the_pytorch_path_match_diffusers_too(monkeypatch):
    """fp32 (the exact path) never reaches the kernel; with the kernel off, bf16's PyTorch operations give the same
    bits as the kernel does."""
    x = _tokens(2, 50, 3, 64)
    cos, sin = _tables(50, 64)
    assert kernels.rope(x.float(), cos, sin) is None
    assert torch.equal(rotate_pairs(x.float(), cos, sin), _diffusers(x.float(), cos, sin))
    with_kernel = rotate_pairs(x, cos, sin)
    monkeypatch.setattr(kernels, "enabled", False)
    assert kernels.rope(x, cos, sin) is None
    assert torch.equal(rotate_pairs(x, cos, sin), with_kernel)


def test_threads_split_the_rows_without_changing_a_bit():
    x = _tokens(2, 700, 6, 128)
    cos, sin = _tables(700, 128)
    one = rotate_pairs(x, cos, sin)
    torch.set_num_threads(2)
    try:
        two = rotate_pairs(x, cos, sin)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two) and torch.equal(one, _diffusers(x, cos, sin))


def test_output_lands_where_its_strides_say():
    """A transposed input, an output that is a slice of a longer sequence, the input itself: each the same bits."""
    x = _tokens(2, 100, 4, 64)
    cos, sin = _tables(100, 64)
    want = _diffusers(x, cos, sin)
    strided = x.transpose(1, 2).contiguous().transpose(1, 2)               # (B, S, h, D) viewed from (B, h, S, D)
    assert not strided.is_contiguous() and torch.equal(rotate_pairs(strided, cos, sin), want)
    if RUNS_HERE:
        joined = torch.full((2, 130, 4, 64), 7.0, dtype=torch.bfloat16)
        assert kernels.rope(x, cos, sin, joined[:, 30:]) is not None
        assert torch.equal(joined[:, 30:], want) and joined[:, :30].eq(7).all()   # the rest untouched
        same = x.clone()
        assert kernels.rope(same, cos, sin, same) is same and torch.equal(same, want)


def test_joined_parts_equal_the_joined_sequence_rotated():
    """FLUX.1's double block: the text and image parts rotated into one (B, S, h, D) tensor, as the joined sequence
    rotated whole (and the same through PyTorch for fp32)."""
    text, image = _tokens(2, 40, 3, 64, seed=2), _tokens(2, 90, 3, 64, seed=3)
    cos, sin = _tables(130, 64)
    for dtype in (torch.bfloat16, torch.float32):
        parts = [text.to(dtype), image.to(dtype)]
        got = rotate_joined(parts, cos, sin)
        assert got.dtype == dtype and torch.equal(got, _diffusers(torch.cat(parts, dim=1), cos, sin))


def test_complex_factors_as_pair_tables_match_the_complex_product():
    """Z-Image's and Qwen-Image's complex factors as pair tables: the rotation equals the complex product (their
    fp32 references' form) to within the bf16 rounding of the result."""
    g = torch.Generator().manual_seed(4)
    angles = torch.rand(2, 60, 32, generator=g) * 200
    factors = torch.polar(torch.ones_like(angles), angles)                 # (B, S, D/2) complex64
    x = _tokens(2, 60, 3, 64)
    got = rotate_pairs(x, *pair_tables(factors))
    exact = torch.view_as_real(torch.view_as_complex(x.double().reshape(2, 60, 3, 32, 2))
                               * factors.to(torch.complex128)[:, :, None]).flatten(3)
    step = exact.abs().clamp_min(1e-30) * 2.0 ** -8                        # bf16's spacing, relative
    assert ((got.double() - exact).abs() <= step).all()


def test_refused_where_it_does_not_apply():
    x = _tokens(1, 8, 2, 16)
    cos, sin = _tables(8, 16)
    assert kernels.rope(x, cos.double(), sin.double()) is None             # tables not fp32
    assert kernels.rope(x, cos[:4], sin[:4]) is None                        # tables for another length
    assert kernels.rope(_tokens(1, 8, 2, 15), cos[:, :15], sin[:, :15]) is None   # no whole pairs
    assert kernels.rope(x, cos, sin, torch.empty(1, 8, 2, 16)) is None      # an fp32 output
    graded = x.float().requires_grad_()
    assert kernels.rope(graded.bfloat16(), cos, sin) is None                # autograd: PyTorch's


def test_flux_bf16_velocity_is_the_same_with_the_kernel_as_without(monkeypatch):
    """FLUX.1 in bf16 (its double blocks rotating text and image into one tensor, its single blocks in place): the
    same velocity bit for bit with the kernel as with PyTorch's operations (FLUX.1's bf16 differs from diffusers'
    elsewhere, its attention kernel: test_flux_model checks that it stays close)."""
    from sdlite.config.flux import FluxConfig
    from sdlite.models.flux import Flux

    torch.manual_seed(0)
    net = Flux(FluxConfig(num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=2,
                          joint_attention_dim=32, pooled_projection_dim=24, axes_dims_rope=(8, 12, 12),
                          guidance_embeds=True)).eval().bfloat16()
    g = torch.Generator().manual_seed(2)
    x, ctx, pooled = torch.randn(1, 16, 8, 10, generator=g), torch.randn(1, 5, 32, generator=g), \
        torch.randn(1, 24, generator=g)
    with torch.no_grad():
        on = net(x, torch.tensor([0.5]), ctx, pooled, 3.5)
        monkeypatch.setattr(kernels, "enabled", False)
        off = net(x, torch.tensor([0.5]), ctx, pooled, 3.5)
    assert on.dtype == torch.bfloat16 and torch.equal(on, off)



def _norms(dim: int, eps: float = 1e-6, seed: int = 6) -> tuple[RMSNorm, DiffusersRMSNorm]:
    """sdlite's and diffusers' RMS norm with the same random bf16 weight."""
    g = torch.Generator().manual_seed(seed)
    ours, ref = RMSNorm(dim, eps), DiffusersRMSNorm(dim, eps)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(dim, generator=g) * 0.5 + 1)
        ref.weight.copy_(ours.weight)
    return ours.bfloat16().eval(), ref.bfloat16().eval()


# SD3's per-head q/k norm on the heads' transposed view, Z-Image's 3840-wide tokens, a tail of 8, one row
NORM_INPUTS = [((2, 300, 24, 64), (1, 2)), ((1, 130, 3840), None), ((3, 7, 5, 56), (1, 2)), ((1, 40), None)]


@pytest.mark.parametrize("shape,swap", NORM_INPUTS, ids=lambda v: "x".join(map(str, v)) if v else "plain")
def test_rms_norm_equals_diffusers_bit_for_bit(shape, swap):
    ours, ref = _norms(shape[-1])
    x = _tokens(*shape, seed=7)
    if swap:
        x = x.transpose(*swap)
    with torch.no_grad():
        got, want = ours(x), ref(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want) and got.stride() == want.stride()
    r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (kernels.rms_scale(x, r, ours.weight.detach()) is not None) == RUNS_HERE, kernels.status()


def test_rms_norm_threads_and_other_dtypes(monkeypatch):
    """Two threads give one thread's bits; fp32 (exact) and an fp32 weight under a bf16 input (promoted to fp32, as
    diffusers promotes it) stay on PyTorch's operations; with the kernel off, the same bits."""
    ours, ref = _norms(128)
    x = _tokens(4, 500, 128, seed=8)
    with torch.no_grad():
        one = ours(x)
        torch.set_num_threads(2)
        try:
            two = ours(x)
        finally:
            torch.set_num_threads(1)
        assert torch.equal(one, two)
        r = torch.ones(4, 500, 1)
        assert kernels.rms_scale(x.float(), r, ours.weight) is None
        assert kernels.rms_scale(x, r, ours.weight.float()) is None
        wide = RMSNorm(128, 1e-6)                                            # fp32 weight, bf16 input
        wide.weight.data.copy_(ours.weight.float())
        ref_wide = DiffusersRMSNorm(128, 1e-6)
        ref_wide.weight.data.copy_(ours.weight.float())
        assert wide(x).dtype == torch.float32 and torch.equal(wide(x), ref_wide(x))
        monkeypatch.setattr(kernels, "enabled", False)
        assert torch.equal(ours(x), one) and torch.equal(ref(x), one)


@pytest.mark.parametrize("pays", [True, False], ids=["kernel", "pytorch"])
def test_padded_attention_is_masked_attention(monkeypatch, pays):
    """Captions of different lengths in one batch (Qwen-Image's true CFG, Z-Image's): ``mmdit.padded_attention``
    gives each sample its own real keys. Where sdlite's kernel runs (bf16, measured to pay) that is the masked
    softmax's arithmetic without the mask: as near fp32's masked attention as PyTorch's masked SDPA is, and the pad
    keys' values change nothing (with them unmasked the output moves far). Elsewhere it is PyTorch's masked SDPA,
    bit for bit."""
    import torch.nn.functional as F

    from sdlite.models.mmdit import padded_attention

    monkeypatch.setattr(kernels, "attention_pays", lambda kind="unet": pays)
    b, h, s, d = 2, 4, 700, 64
    q, k, v = (_tokens(b, s, h, d, seed=i).transpose(1, 2) for i in range(3))   # (B, h, S, D) views, as the models'
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, 40:52] = False                                                        # the second caption's pads

    def masked(dtype, k=k, v=v, mask=keep):
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask[:, None, None, :])
        return out.transpose(1, 2).reshape(b, s, h * d)

    got = padded_attention(q, k, v, keep)
    if not (pays and RUNS_HERE):
        assert torch.equal(got, masked(torch.bfloat16))
        return
    exact = masked(torch.float32)
    rel = lambda x: ((x.float() - exact).norm() / exact.norm()).item()   # noqa: E731
    assert rel(got) <= 1.5 * rel(masked(torch.bfloat16)) and rel(got) < 1e-2, (rel(got), rel(masked(torch.bfloat16)))
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 40:52], v2[1, :, 40:52] = 30.0, 100.0
    assert torch.equal(padded_attention(q, k2, v2, keep), got)
    unmasked = masked(torch.float32, k2, v2, torch.ones_like(keep))
    assert ((unmasked - exact).norm() / exact.norm()).item() > 0.1
