"""Prepacked oneDNN weights (engine.packing): the same outputs as PyTorch's plain layers, to fp32 rounding."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sdlite.engine.memory import MemoryModeError, ModelManager
from sdlite.engine.packing import (
    PackedConv2d, PackedLinear, conv2d, load_prepacked, prepack_available, prepack_model, release_packed,
)
from sdlite.engine.tiling import tiled_decode
from sdlite.loader import open_model
from tests.reference import diffusers_pipeline



def test_prepacking_applies_on_this_cpu():
    """The supported install (CPU torch from the Makefile) has oneDNN: prepacking can be used (whether it is by
    default depends on the CPU: tests/test_cpu.py)."""
    assert prepack_available()
    assert not prepack_available("cpu", torch.float16) and not prepack_available("meta")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pack")
    diffusers_pipeline("sd1", tmp).save_pretrained(tmp / "model")
    return tmp / "model"


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("cin,cout,k,stride,padding,bias", [
    (8, 16, 3, 1, 1, True), (16, 8, 1, 1, 0, True), (8, 8, 3, 2, 0, True), (8, 12, 3, 2, 1, False),
    (4, 320, 3, 1, 1, True)])
def test_conv_equals_plain(cin, cout, k, stride, padding, bias):
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, k, stride=stride, padding=padding, bias=bias)
    x = torch.randn(2, cin, 13, 10)
    expected = conv(x)
    packed = PackedConv2d(conv)
    got = packed(x)
    assert got.shape == expected.shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert _rel(got, expected) < 1e-5
    # a padding override, as tiled decoding uses it, and a channels-last input
    assert _rel(conv2d(packed, x.contiguous(memory_format=torch.channels_last), (0, 0)),
                nn.functional.conv2d(x, conv.weight, conv.bias, stride, 0)) < 1e-5


@pytest.mark.parametrize("shape", [(5, 32), (2, 7, 32), (2, 3, 4, 32)])
def test_linear_equals_plain(shape):
    torch.manual_seed(0)
    for bias in (True, False):
        linear = nn.Linear(32, 48, bias=bias)
        x = torch.randn(*shape)
        assert _rel(PackedLinear(linear)(x), linear(x)) < 1e-5
    # a strided (non-contiguous) input
    x = torch.randn(3, 32, 7).transpose(1, 2)
    assert _rel(PackedLinear(linear)(x), linear(x)) < 1e-5


def test_whole_networks_equal_plain(model_dir):
    ckpt = open_model(model_dir)
    torch.manual_seed(0)
    x, t, ctx = torch.randn(2, 4, 16, 16), torch.tensor([10.0, 900.0]), torch.randn(2, 77, 32)
    z, ids = torch.randn(1, 4, 16, 16), torch.randint(0, 1000, (2, 77))
    with torch.no_grad():
        for name, run in (("unet", lambda m: m(x, t, ctx)), ("vae", lambda m: m.decode(z)),
                          ("text_encoder", lambda m: m(ids))):
            plain = ckpt.load(name, torch.float32, "cpu")
            expected = run(plain)
            packed = prepack_model(ckpt.load(name, torch.float32, "cpu"))
            kinds = {type(m) for m in packed.modules()}
            assert nn.Conv2d not in kinds and nn.Linear not in kinds, name
            assert _rel(run(packed), expected) < 1e-5, name
    assert packed.dtype == torch.float32


@pytest.mark.parametrize("stored", [torch.float16, torch.float32])
def test_one_pass_load_equals_load_then_prepack(model_dir, tmp_path, stored):
    """load_prepacked converts each weight straight into oneDNN's layout: the very same network as loading it
    plain and prepacking it, from an fp16 file (converted through the shared buffer) and an fp32 one."""
    from sdlite.export import save_diffusers
    from sdlite.loader import load_model

    folder = tmp_path / "copy"
    save_diffusers(load_model(model_dir), folder, dtype=stored)
    ckpt = open_model(folder)
    torch.manual_seed(0)
    x, t, ctx = torch.randn(2, 4, 16, 16), torch.tensor([10.0, 900.0]), torch.randn(2, 77, 32)
    z = torch.randn(1, 4, 16, 16)
    with torch.no_grad():
        for name, run in (("unet", lambda m: m(x, t, ctx)), ("vae", lambda m: m.decode(z))):
            two_step = prepack_model(ckpt.load(name, torch.float32, "cpu"))
            one_pass = load_prepacked(ckpt, name)
            assert [type(m) for m in one_pass.modules()] == [type(m) for m in two_step.modules()], name
            assert not any(p.is_meta for p in [*one_pass.parameters(), *one_pass.buffers()]), name
            assert torch.equal(run(one_pass), run(two_step)), name
    # the memory manager uses it for the prepacked networks
    with ModelManager(ckpt, mode=1, prepack=True).use("unet") as unet:
        assert isinstance(unet.conv_in, PackedConv2d) and isinstance(unet.time_embedding.linear_1, PackedLinear)


def test_tiled_decode_with_packed_vae(model_dir):
    """Tiling calls the convolutions with its own padding: prepacked layers give the untiled image too."""
    vae = prepack_model(open_model(model_dir).load("vae", torch.float32, "cpu"))
    torch.manual_seed(1)
    z = torch.randn(1, 4, 24, 20)
    with torch.no_grad():
        assert (tiled_decode(vae, z, 8) - vae.decode(z)).abs().max().item() < 1e-4


def test_manager_packs_and_frees(model_dir):
    ckpt = open_model(model_dir)
    manager = ModelManager(ckpt, mode=0, prepack=True)
    assert manager.prepack
    with manager.use("vae") as vae:
        layer = vae.decoder.conv_in
        assert isinstance(layer, PackedConv2d) and layer.packed is not None
    assert layer.packed is None  # freed with the sub-model even though this test still holds the layer
    assert not any(isinstance(m, (PackedConv2d, PackedLinear)) for m in manager.get("unet").modules())  # streamed
    assert not ModelManager(ckpt, mode=1, prepack=False).prepack
    # the text encoder runs once per prompt: prepacking it would only delay the first encoding
    with ModelManager(ckpt, mode=1, prepack=True).use("text_encoder") as text:
        kinds = {type(m) for m in text.modules()}
        assert nn.Linear in kinds and PackedLinear not in kinds


def test_prepack_refused_where_it_does_not_apply(model_dir):
    with pytest.raises(MemoryModeError, match=r"prepacked weights need fp32 compute on a CPU.*torch.bfloat16"):
        ModelManager(open_model(model_dir), mode=1, dtype=torch.bfloat16, prepack=True)
    assert not ModelManager(open_model(model_dir), mode=1, dtype=torch.bfloat16).prepack  # automatic: off


def test_release_packed():
    module = nn.Sequential(PackedLinear(nn.Linear(4, 4)), nn.ReLU())
    release_packed(module)
    assert module[0].packed is None


@pytest.mark.parametrize("cpu_says", [True, False])
def test_manager_default_comes_from_the_cpu_and_explicit_choices_win(model_dir, monkeypatch, cpu_says):
    from sdlite.engine import memory
    from sdlite.engine.cpu import PrepackChoice

    monkeypatch.setattr(memory, "default_prepack", lambda: PrepackChoice(cpu_says, "flags", "injected"))
    ckpt = open_model(model_dir)
    assert ModelManager(ckpt, mode=1).prepack is cpu_says
    assert ModelManager(ckpt, mode=1, prepack=True).prepack is True
    assert ModelManager(ckpt, mode=1, prepack=False).prepack is False
    unet = ModelManager(ckpt, mode=1).get("unet")
    assert any(isinstance(m, PackedConv2d) for m in unet.modules()) is cpu_says


def test_manager_default_on_this_cpu(model_dir):
    from sdlite.engine.cpu import default_prepack
    from sdlite.machine import this_cpu

    manager = ModelManager(open_model(model_dir), mode=1)
    assert manager.prepack == default_prepack().use == this_cpu().avx512   # AVX2 (or capped to it): plain


def _plain_conv(layer: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.conv2d(x, layer.weight, layer.bias, layer.stride, layer.padding, layer.dilation,
                                layer.groups)


@pytest.mark.parametrize("cin,cout,bias", [(320, 320, True), (64, 48, False), (96, 40, True)])
def test_shape_packed_conv_gives_the_plain_bits(cin, cout, bias):
    """A bf16 channels-last 1x1 convolution packed per input shape gives PyTorch's own bits at every shape met, keeps
    the last SHAPE_PACKS shapes' packs, and follows its weight: a new tensor (a LoRA's merge) or one changed in place
    is packed again. Other inputs (fp32, a plain layout, autograd) take nn.Conv2d's path."""
    from sdlite.engine.packing import SHAPE_PACKS, ShapePackedConv2d, shape_packs

    if not shape_packs("cpu", torch.bfloat16):   # oneDNN packs no bf16 weight under the AVX2 cap (nor on such CPUs)
        assert torch.backends.mkldnn.is_available() and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return
    torch.manual_seed(0)
    layer = nn.Conv2d(cin, cout, 1, bias=bias).to(torch.bfloat16)
    layer.weight.data = layer.weight.data.contiguous(memory_format=torch.channels_last)
    shapes = [(1, cin, 16, 16), (2, cin, 16, 16), (1, cin, 9, 13), (1, cin, 16, 16)]
    inputs = [torch.randn(s).to(torch.bfloat16).contiguous(memory_format=torch.channels_last) for s in shapes]
    want = [_plain_conv(layer, x) for x in inputs]
    packed = ShapePackedConv2d.convert(layer)
    with torch.no_grad():
        for x, expected in zip(inputs, want):
            got = packed(x)
            assert torch.equal(got, expected) and got.is_contiguous(memory_format=torch.channels_last)
    assert len(packed.packs) == SHAPE_PACKS and list(packed.packs)[-1] == shapes[-1]
    packed.weight = nn.Parameter(torch.randn_like(packed.weight) * 0.05, requires_grad=False)
    with torch.no_grad():
        assert torch.equal(packed(inputs[0]), _plain_conv(packed, inputs[0]))
        packed.weight.mul_(2)
        assert torch.equal(packed(inputs[0]), _plain_conv(packed, inputs[0]))
        fp32 = torch.randn(1, cin, 5, 5)
        assert torch.equal(packed.float()(fp32), _plain_conv(packed, fp32))
        packed.to(torch.bfloat16)
        plain_layout = inputs[1].contiguous()
        assert torch.equal(packed(plain_layout), _plain_conv(packed, plain_layout))
    assert packed(inputs[0].requires_grad_()).requires_grad


def test_shape_pack_model_takes_the_1x1_convolutions_and_the_bf16_unet_has_them(model_dir):
    """Only plain 1x1 convolutions (stride 1, no padding, one group) are converted; the bf16 precisions' UNet gets
    them (where this CPU runs bf16), and its output is the one of the same UNet without them, bit for bit."""
    from sdlite.engine.packing import ShapePackedConv2d, shape_pack_model
    from sdlite.engine.precision import PrecisionError
    from sdlite.pipeline import Engine

    net = nn.Sequential(nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1, stride=2),
                        nn.Conv2d(8, 8, 1, groups=2), nn.Conv2d(8, 8, 1))
    shape_pack_model(net)
    assert [type(m) is ShapePackedConv2d for m in net] == [True, False, False, False, True]
    try:
        engine = Engine.load(model_dir, precision="bf16")
    except PrecisionError:
        return   # a CPU without native bf16 refuses the bf16 precisions (tests/test_precision.py)
    unet = engine.models.get("unet")
    convs = [m for m in unet.modules() if isinstance(m, ShapePackedConv2d)]
    assert convs and all(m.kernel_size == (1, 1) for m in convs)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 16, 16, generator=g).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    ctx = torch.randn(1, 77, unet.config.context_dim, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        got = unet(x, torch.tensor([500.0]), ctx)
        for m in convs:
            m.__class__ = nn.Conv2d
        want = unet(x, torch.tensor([500.0]), ctx)
    assert torch.equal(got, want)
