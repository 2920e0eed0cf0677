"""GGUF files and weights that stay quantised: sdlite's torch dequantisation of every ggml type it reads against the
``gguf`` package's numpy reference, row splits, a FLUX-shaped file written by ``gguf.GGUFWriter`` and read back,
LowBitLinear, and the errors (unsupported type, truncated file, not a GGUF file). Tiny shapes throughout."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from sdlite.engine.lowbit import LowBitLinear, lowbit_bytes, replace_linears  # noqa: E402
from sdlite.errors import CheckpointError  # noqa: E402
from sdlite.weights.gguf import GGUFStore, open_gguf  # noqa: E402
from sdlite.weights.plan import Transform  # noqa: E402
from sdlite.weights.quants import GGML_TYPES, SUPPORTED_TYPES, QuantizedTensor, QuantizedTensorError  # noqa: E402

#: byte offsets of each type's fp16 scales within a block: random blocks get finite values there
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _can_quantize(name: str) -> bool:
    """Whether the gguf package implements quantisation for this type (it does for F32/F16/BF16 and the 32-value
    types, not for the K types)."""
    try:
        gguf.quants.quantize(np.zeros((1, GGML_TYPES[name].block_size), np.float32), T[name])
        return True
    except NotImplementedError:
        return False


def quantized_bytes(name: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Random data of ggml type ``name`` as the gguf package lays it out (uint8, shape (rows, bytes per row)):
    quantised by the package where it can, else random blocks with random finite fp16 scales."""
    rng = np.random.default_rng(seed)
    t = GGML_TYPES[name]
    if _can_quantize(name):
        q = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), T[name])
        return np.ascontiguousarray(q).view(np.uint8).reshape(shape[0], -1)
    blocks = rng.integers(0, 256, size=(shape[0] * shape[1] // t.block_size, t.type_size), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        scale = (rng.uniform(-2.0, 2.0, size=blocks.shape[0]) * 10.0 ** rng.integers(-4, 1, blocks.shape[0]))
        blocks[:, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1)


def reference(raw: np.ndarray, name: str, shape) -> torch.Tensor:
    """The gguf package's numpy dequantisation (the independent reference), as float32 of ``shape``."""
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, T[name]), np.float32)).reshape(shape)


def ours(raw: np.ndarray, name: str, shape) -> QuantizedTensor:
    return QuantizedTensor(torch.from_numpy(raw.copy()), name, shape)


# --- dequantisation against the reference ----------------------------------------------------------------------

@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_dequantize_equals_the_gguf_reference(name):
    """Bit for bit in float32 (tolerance 0): both sides decode the same integers and fp16 scales exactly and do
    the same float32 multiplications and additions in the same order (ggml's), each rounded once, so there is
    nothing for the results to differ by. Other dtypes are that float32 result rounded once."""
    shape = (6, 512)  # two 256-value super-blocks per row
    raw = quantized_bytes(name, shape)
    want = reference(raw, name, shape)
    assert torch.isfinite(want).all()
    qt = ours(raw, name, shape)
    got = qt.dequantize()
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, want), f"{name}: max difference {(got - want).abs().max().item()}"
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(qt.dequantize(dtype), want.to(dtype))
    assert qt.nbytes == raw.nbytes and qt.qtype == name


def test_dequantize_in_chunks_equals_at_once(monkeypatch):
    """A tensor larger than one decoding chunk gives the same values as a one-chunk decode."""
    import sdlite.weights.quants as quants

    raw = quantized_bytes("Q4_K", (16, 1024), seed=3)
    want = ours(raw, "Q4_K", (16, 1024)).dequantize()
    monkeypatch.setattr(quants, "CHUNK_VALUES", 1000)  # 3 blocks of 256 per chunk, the last chunk partial
    assert torch.equal(ours(raw, "Q4_K", (16, 1024)).dequantize(), want)


def test_the_type_table_agrees_with_ggml():
    """Numbers, values per block and bytes per block of every type listed, as the gguf package has them."""
    for name, t in GGML_TYPES.items():
        assert T[name].value == t.code and gguf.GGML_QUANT_SIZES[T[name]] == (t.block_size, t.type_size), name
    assert set(SUPPORTED_TYPES) == {"F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q4_K", "Q5_K",
                                    "Q6_K", "Q3_K", "Q2_K"}


def test_repr_names_type_shape_and_size():
    qt = ours(quantized_bytes("Q8_0", (4, 64)), "Q8_0", (4, 64))
    assert repr(qt) == "QuantizedTensor(Q8_0, shape=[4, 64], 272 bytes, 8.5 bits/value, device=cpu)"
    assert qt.shape == torch.Size([4, 64]) and qt.ndim == 2 and qt.numel() == 256


# --- row splits ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_row_splits_equal_the_dequantized_slice(name):
    shape = (9, 256)
    qt = ours(quantized_bytes(name, shape, seed=1), name, shape)
    dense = qt.dequantize()
    for start, stop in ((0, 3), (3, 6), (6, 9), (2, 7), (4, 4)):
        part = qt.rows(start, stop)
        assert part.shape == (stop - start, 256)
        assert part.data.data_ptr() == qt.data.data_ptr() + start * qt.nbytes // 9 or stop == start  # a view
        assert torch.equal(part.dequantize(), dense[start:stop])
    assert torch.equal(qt[3:6].dequantize(), dense[3:6])


def test_a_fused_qkv_splits_through_a_plan_transform():
    """Key tables split fused qkv weights with Transform("chunk"): it slices the QuantizedTensor by rows."""
    qkv = ours(quantized_bytes("Q8_0", (3 * 8, 64)), "Q8_0", (24, 64))
    dense = qkv.dequantize()
    for i in range(3):
        part = Transform("chunk", (i, 3)).apply([qkv], "double_blocks.0.img_attn.qkv.weight")
        assert isinstance(part, QuantizedTensor) and part.shape == (8, 64)
        assert torch.equal(part.dequantize(), dense[8 * i:8 * (i + 1)])


def test_a_split_off_block_boundaries_is_refused():
    """A tensor whose rows are shorter than a block (here a Q8_0 tensor of 32 values a block, viewed as rows of
    16) splits only where whole blocks begin and end."""
    qt = ours(quantized_bytes("Q8_0", (4, 64)), "Q8_0", (4, 64)).reshape(16, 16)
    assert torch.equal(qt.rows(2, 6).dequantize(), qt.dequantize()[2:6])
    with pytest.raises(QuantizedTensorError, match=r"rows \[1, 2\) of Q8_0 tensor of shape \[16, 16\] do not fall "
                                                   r"on block boundaries"):
        qt.rows(1, 2)
    with pytest.raises(QuantizedTensorError, match=r"rows \[3, 20\) are not a slice of the 16 rows"):
        qt.rows(3, 20)
    with pytest.raises(QuantizedTensorError, match="only be sliced by whole rows"):
        qt[0:4:2]
    with pytest.raises(QuantizedTensorError, match="use .dequantize"):
        qt.to(torch.float16)


def test_wrong_byte_counts_and_types_are_refused():
    with pytest.raises(QuantizedTensorError, match="Q8_0 tensor of shape \\[2, 64\\] needs 136 bytes, got 100"):
        QuantizedTensor(torch.zeros(100, dtype=torch.uint8), "Q8_0", (2, 64))
    with pytest.raises(QuantizedTensorError, match="not a whole number of Q4_K blocks of 256"):
        QuantizedTensor(torch.zeros(144, dtype=torch.uint8), "Q4_K", (2, 64))
    with pytest.raises(QuantizedTensorError, match="ggml type IQ2_XXS is not supported"):
        QuantizedTensor(torch.zeros(66, dtype=torch.uint8), "IQ2_XXS", (256,))


# --- GGUF files ----------------------------------------------------------------------------------------------

def write_gguf(path, tensors: dict, arch: str = "flux", extra=None):
    """Write ``tensors`` (name -> float array, or (raw bytes, ggml type)) with gguf.GGUFWriter."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in (extra or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_string(key, value)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            raw, qtype = value
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def flux_file(tmp_path):
    """A few tensors named and typed as in city96's FLUX GGUFs (tiny: hidden 64 instead of 3072)."""
    rng = np.random.default_rng(7)
    tensors = {
        "double_blocks.0.img_attn.qkv.weight": (quantized_bytes("Q8_0", (3 * 64, 64)), T.Q8_0),
        "double_blocks.0.img_mlp.0.weight": (quantized_bytes("Q4_K", (32, 256), seed=2), T.Q4_K),
        "double_blocks.0.img_mod.lin.weight": (quantized_bytes("BF16", (12, 64), seed=4), T.BF16),
        "img_in.bias": rng.standard_normal(64).astype(np.float32),
        "final_layer.linear.weight": rng.standard_normal((16, 64)).astype(np.float16),
        "time_in.in_layer.weight": (quantized_bytes("Q5_0", (64, 256), seed=5), T.Q5_0),
    }
    return write_gguf(tmp_path / "flux1-dev-Q8_0.gguf", tensors), tensors


def test_a_flux_file_reads_back_tensor_by_tensor(flux_file):
    path, written = flux_file
    with open_gguf(path) as store:
        assert isinstance(store, GGUFStore) and store.format == "gguf"
        assert store.architecture == "flux" and store.metadata["general.architecture"] == "flux"
        assert list(store.keys()) == list(written)
        assert store.shape("double_blocks.0.img_attn.qkv.weight") == (192, 64)  # PyTorch's order
        assert store.shape("double_blocks.0.img_mlp.0.weight") == (32, 256)
        assert store.shape("final_layer.linear.weight") == (16, 64)
        assert store.qtype("double_blocks.0.img_attn.qkv.weight") == "Q8_0"
        assert store.dtype("double_blocks.0.img_attn.qkv.weight") == torch.uint8
        assert store.dtype("img_in.bias") == torch.float32
        assert store.dtype("double_blocks.0.img_mod.lin.weight") == torch.bfloat16
        for name, value in written.items():
            got = store[name]
            if isinstance(value, tuple):
                raw, qtype = value
                want = reference(raw, qtype.name, store.shape(name))
                if qtype.name == "BF16":  # a plain tensor, in the file's dtype
                    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
                    assert torch.equal(got.float(), want)
                    continue
                assert isinstance(got, QuantizedTensor) and got.qtype == qtype.name
                assert store.nbytes(name) == got.nbytes == raw.nbytes
                assert torch.equal(got.dequantize(), want)
                assert torch.equal(store.load(name, dtype=torch.bfloat16), want.to(torch.bfloat16))
            else:
                assert got.dtype == torch.from_numpy(value).dtype
                assert torch.equal(got, torch.from_numpy(value))
        qkv = store["double_blocks.0.img_attn.qkv.weight"]
        dense = qkv.dequantize()
        assert torch.equal(qkv.rows(64, 128).dequantize(), dense[64:128])
        assert "Q8_0" in repr(store)


def test_tensors_view_the_mapped_file_and_outlive_close(flux_file):
    path, written = flux_file
    store = open_gguf(path)
    bias = store["img_in.bias"]
    qkv = store["double_blocks.0.img_attn.qkv.weight"]
    bias.add_(1)  # copy-on-write: the file does not change
    store.close()
    assert torch.equal(bias, torch.from_numpy(written["img_in.bias"]) + 1)
    assert qkv.dequantize().shape == (192, 64)
    with pytest.raises(CheckpointError, match="closed"):
        store["img_in.bias"]
    with open_gguf(path) as again:
        assert torch.equal(again["img_in.bias"], torch.from_numpy(written["img_in.bias"]))


def test_a_recorded_original_shape_is_the_tensors_shape(tmp_path):
    """ComfyUI-GGUF's converter records reshaped tensors' shapes as comfy.gguf.orig_shape.<name>."""
    values = np.arange(24, dtype=np.float16)
    path = write_gguf(tmp_path / "m.gguf", {"conv.weight": values},
                      extra={"comfy.gguf.orig_shape.conv.weight": [2, 3, 2, 2]})
    with open_gguf(path) as store:
        assert store.shape("conv.weight") == (2, 3, 2, 2)
        assert torch.equal(store["conv.weight"], torch.from_numpy(values).view(2, 3, 2, 2))


# --- LowBitLinear ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q5_1"])
def test_lowbit_linear_equals_f_linear_with_the_dequantized_weight(name):
    weight = ours(quantized_bytes(name, (24, 256), seed=8), name, (24, 256))
    bias = torch.randn(24)
    layer = LowBitLinear(weight, bias)
    x = torch.randn(2, 5, 256)
    assert torch.equal(layer(x), F.linear(x, weight.dequantize(), bias))
    xb = x.bfloat16()
    assert torch.equal(layer(xb), F.linear(xb, weight.dequantize(torch.bfloat16), bias.bfloat16()))
    assert torch.equal(LowBitLinear(weight)(x), F.linear(x, weight.dequantize()))


def test_lowbit_linear_memory_stays_quantized():
    """The module holds the quantised bytes and nothing else for its weight, through .to(dtype) and state_dict."""
    weight = ours(quantized_bytes("Q4_K", (64, 512)), "Q4_K", (64, 512))
    layer = LowBitLinear(weight, torch.zeros(64))
    storage = sum(t.untyped_storage().nbytes() for t in layer.buffers())
    assert storage == weight.nbytes == 64 * 512 // 256 * 144  # 4.5 bits a value, not 32
    assert [n for n, _ in layer.named_parameters()] == ["bias"]
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == weight.nbytes
    assert layer.bias.dtype == torch.bfloat16
    state = layer.state_dict()
    assert state["weight"].dtype == torch.uint8 and state["weight"].numel() == weight.nbytes
    assert torch.equal(layer.quantized.dequantize(), weight.dequantize())
    assert "qtype=Q4_K" in repr(layer)


def test_replace_linears_swaps_named_layers_in_place():
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("qkv", nn.Linear(64, 96))
    net.add_module("proj", nn.Linear(96, 32, bias=False))
    net.add_module("norm", nn.LayerNorm(32))
    bias = net.qkv.bias
    weights = {"qkv.weight": ours(quantized_bytes("Q8_0", (96, 64)), "Q8_0", (96, 64)),
               "proj": ours(quantized_bytes("Q4_0", (32, 96), seed=1), "Q4_0", (32, 96))}
    assert replace_linears(net, weights) == ["qkv", "proj"]
    assert isinstance(net.qkv, LowBitLinear) and net.qkv.bias is bias and net.proj.bias is None
    assert lowbit_bytes(net) == weights["qkv.weight"].nbytes + weights["proj"].nbytes
    x = torch.randn(3, 64)
    want = net.norm(F.linear(F.linear(x, weights["qkv.weight"].dequantize(), bias), weights["proj"].dequantize()))
    assert torch.equal(net(x), want)
    assert set(net.state_dict()) == {"qkv.weight", "qkv.bias", "proj.weight", "norm.weight", "norm.bias"}
    with pytest.raises(QuantizedTensorError, match="'norm' is a LayerNorm, not an nn.Linear"):
        replace_linears(net, {"norm": weights["proj"]})
    with pytest.raises(QuantizedTensorError, match="'missing' is not a module"):
        replace_linears(net, {"missing.weight": weights["proj"]})
    other = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(QuantizedTensorError, match=r"'0': quantised weight of shape \[96, 64\] does not fit"):
        replace_linears(other, {"0.weight": weights["qkv.weight"]})


# --- errors ----------------------------------------------------------------------------------------------------

def test_an_unsupported_type_is_refused_naming_file_tensor_and_type(tmp_path):
    path = write_gguf(tmp_path / "iq.gguf", {
        "img_in.bias": np.zeros(8, np.float32),
        "double_blocks.0.img_attn.qkv.weight": (np.zeros((4, 66), np.uint8), T.IQ2_XXS),
    })
    with pytest.raises(CheckpointError) as err:
        open_gguf(path)
    message = str(err.value)
    assert str(path) in message and "'double_blocks.0.img_attn.qkv.weight'" in message and "IQ2_XXS" in message
    assert "not supported" in message and "Q4_K" in message


def test_a_truncated_file_is_named(flux_file, tmp_path):
    path, _ = flux_file
    data = path.read_bytes()
    for cut in (len(data) - 300, 200, 20):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated") as err:
            open_gguf(short)
        assert str(short) in str(err.value)


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    from sdlite.weights.safetensors import save_safetensors

    st = tmp_path / "model.safetensors"
    save_safetensors({"w": torch.zeros(2)}, st)
    with pytest.raises(CheckpointError, match="is not a GGUF file: it starts with bytes") as err:
        open_gguf(st)
    assert str(st) in str(err.value)
    with pytest.raises(CheckpointError, match="no such file"):
        open_gguf(tmp_path / "absent.gguf")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="is empty"):
        open_gguf(empty)
