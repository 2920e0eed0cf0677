"""Linear layers whose weights stay in a block format (GGUF files' ggml types, or sdlite's int8 / int4 ones) and are
dequantised at call time.

:class:`LowBitLinear` holds a :class:`~sdlite.weights.quants.QuantizedTensor` weight (Q8_0, Q4_K, ...) as its raw
bytes and, on each call, dequantises it into the input's dtype and runs ``F.linear``: one layer's dense weight
exists at a time, for the duration of its matmul, as city96's ComfyUI-GGUF ``ops.py`` does. The network code
does not change: :func:`replace_linears` swaps a network's ``nn.Linear`` layers for LowBitLinears in place, under
the same names, so the module's ``state_dict`` keys stay the canonical checkpoint keys.

The bytes are a ``uint8`` buffer named ``weight`` (1-D, :attr:`LowBitLinear.nbytes` long), so ``module.to(dtype)``,
``.half()`` and ``.float()`` leave it as it is (they convert floating-point tensors only), ``.to(device)`` moves it,
and ``state_dict`` holds the quantised bytes, never a dequantised copy. The bias is an ordinary parameter.

Why not a fused int8 kernel for Q8_0: ``torch._weight_int8pack_mm(x, w_int8, scales)`` multiplies by an int8
weight with one scale per *output channel*, while Q8_0 has one fp16 scale per 32 inputs of each output. It cannot
compute the Q8_0 product exactly (one call per block of 32 inputs would: 96 calls for 3072 inputs); requantised to
per-channel scales its result is 6e-3 (relative) off the Q8_0 product. And even in that best case it is slower:
measured by ``bench/lowbit.py`` at FLUX's MLP shape (x: 4096 tokens x 3072, weight 12288 x 3072 in Q8_0, random
values; median of 3, the int8 kernel one run after a warm-up; a 2-core Xeon with AVX512-BF16 and AMX, torch 2.13 CPU):

=======================================  ===============  ===============  ===============  ===============
                                          bf16, 2 threads  bf16, 1 thread   fp32, 2 threads  fp32, 1 thread
=======================================  ===============  ===============  ===============  ===============
dequantise Q8_0 weight (37.7 M values)    0.30 s           0.08 s           0.08 s           0.13 s
dequantise Q4_K weight                    0.99 s           0.16 s           0.21 s           0.19 s
F.linear with the dense weight            0.48 s           0.43 s           2.79 s           2.20 s
LowBitLinear (dequantise + F.linear)      0.88 s           0.50 s           3.63 s           2.27 s
_weight_int8pack_mm, per-channel int8     7.95 s           5.4 s (*)        197 s (*)        200 s (*)
=======================================  ===============  ===============  ===============  ===============

(*) run on 512, 256 and 128 tokens and scaled to 4096 (the kernel works a token row at a time: its time is linear
in the tokens). The 2-thread columns ran while a test suite used both cores (load average 3): the short
multi-threaded dequantising ops suffer most from that, hence 1 thread's lower numbers. The int8 kernel is 9-90x
slower than dequantise-then-matmul, so it is not used; dequantising is a small part of a layer's time in fp32 and
15-50 % of it in bf16, whose AMX matmul is fast. (Those dequantising times are the PyTorch decoders'; the weight is
now decoded by :mod:`sdlite.kernels.dequant` in one pass where it runs, the same bits several times faster:
``bench/dequant.py``.)

The ``int8`` and ``int4`` precisions of a transformer (:func:`load_quantized`) use the same layer over weights
quantised as a dense file loads, in sdlite's two types (:mod:`sdlite.weights.quants`): I8_ROW (int8, one fp32 scale
per output channel: the form ``_weight_int8pack_mm`` takes) and I4_G64 (4 bits, groups of 64 with an fp16 scale and
minimum: the form of ``_weight_int4pack_mm_for_cpu``, which takes bf16 scales and zeros per group). Both torch kernels
were measured again against dequantise-then-``F.linear`` by ``bench/lowbit_precision.py kernels`` (BENCHMARKS.md,
"int8 / int4 transformers"): at FLUX's shapes on 1536 tokens they are an order of magnitude slower than LowBitLinear,
so LowBitLinear dequantises here too.

ComfyUI's UNETLoader ``weight_dtype`` (``fp8_e4m3fn``, ``fp8_e5m2``) is a third such storage of a transformer
(:data:`FP8_MODES`): every Linear weight of the network cast to that fp8 type as it loads (as ComfyUI's
``manual_cast`` layers hold the whole diffusion model in it), one byte a value, converted exactly into the compute
dtype per call. Biases, norms, SD3's patch-embedding convolution and position table stay in the compute dtype (under
0.1 % of the bytes; ComfyUI casts them too). T5 and the other networks are not touched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..weights.quants import (INT4_GROUP, QuantizedTensor, QuantizedTensorError, cast_fp8, quantize_int4_groups,
                              quantize_int8_rows)

__all__ = ["LowBitLinear", "replace_linears", "lowbit_bytes", "in_gguf", "quantized_linears", "load_low_bit",
           "LOW_BIT_MODES", "FP8_MODES", "quantize_weight", "lowbit_targets", "load_quantized"]


class LowBitLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` kept quantised (``weight``: its raw bytes) and dequantised per call into
    ``x``'s dtype."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(weight, QuantizedTensor) or weight.ndim != 2:
            raise QuantizedTensorError(f"a LowBitLinear needs a 2-D quantised weight (out_features, in_features), "
                                       f"got {weight!r}")
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        self.type = weight.type   # the block type (a ggml one, or sdlite's I8_ROW / I4_G64)
        # a LoRA's change to the weight (sdlite.adapters.lora): a function of the dequantised fp32 weight, applied
        # per call before the weight is rounded to the input's dtype (None: none)
        self.weight_update = None
        self.register_buffer("weight", weight.data)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise QuantizedTensorError(f"bias of shape {list(bias.shape)} does not fit {self.out_features} outputs")
        if bias is None or isinstance(bias, nn.Parameter):
            self.bias = bias
        else:
            self.bias = nn.Parameter(bias, requires_grad=False)

    @property
    def qtype(self) -> str:
        """The block type's name: ``"Q8_0"``, ``"I8_ROW"``, ..."""
        return self.type.name

    @property
    def quantized(self) -> QuantizedTensor:
        """The weight as a QuantizedTensor over this module's bytes (wherever ``.to()`` moved them)."""
        return QuantizedTensor(self.weight, self.type, (self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        """The weight's bytes in memory (the quantised size)."""
        return self.weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_update is None:
            w = self.quantized.dequantize(x.dtype)  # (out, in): this call's only dense copy
        else:   # a LoRA: merged in fp32 as a resident weight would be, then rounded once
            w = self.weight_update(self.quantized.dequantize(torch.float32)).to(x.dtype)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return F.linear(x, w, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, "
                f"bias={self.bias is not None}")


def replace_linears(module: nn.Module, weights: dict[str, QuantizedTensor]) -> list[str]:
    """Swap, in place, each ``nn.Linear`` of ``module`` named in ``weights`` for a :class:`LowBitLinear` over its
    quantised weight; returns the names swapped.

    A name is a module path (``double_blocks.0.img_attn.qkv``) or its weight's key
    (``double_blocks.0.img_attn.qkv.weight``). The Linear's bias (parameter or meta tensor) is kept as it is, for
    the loader to fill like any other key. A name that is not a Linear of ``module``, or whose weight has another
    shape, is a :class:`QuantizedTensorError` naming it.
    """
    swapped = []
    for name, weight in weights.items():
        path = name[:-len(".weight")] if name.endswith(".weight") else name
        try:
            layer = module.get_submodule(path)
        except AttributeError:
            raise QuantizedTensorError(f"{path!r} is not a module of the {type(module).__name__}") from None
        if not isinstance(layer, nn.Linear):
            raise QuantizedTensorError(f"{path!r} is a {type(layer).__name__}, not an nn.Linear")
        if tuple(weight.shape) != (layer.out_features, layer.in_features):
            raise QuantizedTensorError(f"{path!r}: quantised weight of shape {list(weight.shape)} does not fit a "
                                       f"Linear of shape {[layer.out_features, layer.in_features]}")
        new = LowBitLinear(weight, layer.bias)
        parent, _, child = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, new)
        swapped.append(path)
    return swapped


def lowbit_bytes(module: nn.Module) -> int:
    """The bytes of all LowBitLinear weights in ``module`` (quantised, as held in memory)."""
    return sum(m.nbytes for m in module.modules() if isinstance(m, LowBitLinear))


def in_gguf(ckpt, component: str) -> bool:
    """Whether ``component``'s weights come from a GGUF file (which may keep them in ggml's block formats)."""
    source = ckpt.sources.get(component)
    return source is not None and hasattr(getattr(source.view, "source", None), "is_quantized")


def quantized_linears(ckpt, component: str) -> dict[str, QuantizedTensor]:
    """``{weight key: QuantizedTensor}`` of the ``nn.Linear`` layers of ``component`` whose weights the checkpoint
    stores in a ggml block format (a GGUF file; empty for every other file), read from the names and headers only."""
    if not in_gguf(ckpt, component):
        return {}
    module = ckpt.build_empty(component)
    linears = {name for name, layer in module.named_modules() if isinstance(layer, nn.Linear)}
    found = {}
    for key in module.state_dict():
        if key.endswith(".weight") and key[:-len(".weight")] in linears:
            tensor = ckpt.tensor(component, key)
            if isinstance(tensor, QuantizedTensor):
                found[key] = tensor
    return found


def load_low_bit(ckpt, component: str, dtype: torch.dtype, device, weights: dict[str, QuantizedTensor]):
    """``component`` loaded with the Linear layers of ``weights`` (:func:`quantized_linears`) as
    :class:`LowBitLinear` over the file's quantised bytes, everything else converted to ``dtype`` as usual."""
    module = ckpt.build_empty(component)
    module = ckpt.load_into(module, component, dtype, device, defer=frozenset(weights))
    replace_linears(module, {k: w.to(device) for k, w in weights.items()})
    return module.eval().requires_grad_(False)


# --- the int8 and int4 precisions of a transformer: dense weights quantised at load --------------------------------

#: how each weight-only precision stores a dense Linear weight (sdlite.engine.precision; the block types are
#: sdlite.weights.quants')
LOW_BIT_MODES = {
    "int8": "int8, one fp32 scale per output channel (I8_ROW: 8 bits a value and 4 bytes a row)",
    "int4": f"4 bits in groups of {INT4_GROUP} values with an fp16 scale and minimum (I4_G{INT4_GROUP}: 4.5 bits a "
            "value)",
    "fp8_e4m3fn": "every Linear weight cast to float8_e4m3fn (ComfyUI's UNETLoader weight_dtype): 8 bits a value",
    "fp8_e5m2": "every Linear weight cast to float8_e5m2 (ComfyUI's UNETLoader weight_dtype): 8 bits a value",
}
#: the fp8 storages: their torch dtype (ComfyUI's names for them)
FP8_MODES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: the Linear layers quantised: those of the repeated blocks (FLUX's double and single blocks, SD3's joint blocks, T5's
#: encoder blocks, Z-Image's joint and refiner blocks), over 97 % of each network's weights. The embedders (of the latent patches, the text, the timestep
#: and guidance, the pooled text), the final norm's modulation and the output projection stay in the compute dtype:
#: they are small, and each feeds every block or writes the prediction itself
BLOCK_PREFIXES = ("transformer_blocks.", "single_transformer_blocks.", "encoder.block.", "layers.", "noise_refiner.",
                  "context_refiner.")
#: bytes of dense weights read from the file between two hand-backs of its pages while quantising
_RELEASE_EVERY = 1 << 28


def check_low_bit_mode(mode: str) -> str:
    if mode not in LOW_BIT_MODES:
        raise QuantizedTensorError(f"low-bit mode {mode!r} is not valid: expected one of {', '.join(LOW_BIT_MODES)}")
    return mode


def quantize_weight(weight: torch.Tensor, mode: str) -> QuantizedTensor:
    """A dense Linear weight (out, in) quantised as ``mode`` (:data:`LOW_BIT_MODES`) asks."""
    if check_low_bit_mode(mode) == "int8":
        return quantize_int8_rows(weight)
    if mode in FP8_MODES:
        return cast_fp8(weight, FP8_MODES[mode])
    return quantize_int4_groups(weight, INT4_GROUP)


def lowbit_targets(module: nn.Module, mode: str) -> list[str]:
    """The weight keys of ``module``'s Linear layers that ``mode`` quantises: those under :data:`BLOCK_PREFIXES`
    (for int4, whose inputs are a whole number of groups: every layer of the released FLUX, SD3(.5) and T5-XXL); for
    the fp8 modes every Linear, as ComfyUI casts the whole network."""
    check_low_bit_mode(mode)
    return [f"{name}.weight" for name, layer in module.named_modules()
            if isinstance(layer, nn.Linear) and (mode in FP8_MODES or name.startswith(BLOCK_PREFIXES))
            and (mode != "int4" or layer.in_features % INT4_GROUP == 0)]


def load_quantized(ckpt, component: str, dtype: torch.dtype, device, mode: str) -> nn.Module:
    """``component`` loaded with the Linear layers of its blocks (:func:`lowbit_targets`) as :class:`LowBitLinear`
    over weights quantised here as ``mode`` asks, layer by layer from the file: memory holds the quantised weights
    and one dense layer at a time (the file's pages handed back as it goes). Layers a GGUF file already stores in a
    block format keep it; everything else is converted to ``dtype`` as usual."""
    module = ckpt.build_empty(component)
    weights = dict(quantized_linears(ckpt, component))
    read = 0
    for key in lowbit_targets(module, mode):
        if key in weights:
            continue
        dense = ckpt.tensor(component, key)
        try:
            weights[key] = quantize_weight(dense, mode).to(device)
        except QuantizedTensorError as e:
            raise QuantizedTensorError(f"{component} weight {key!r} cannot be stored as {mode}: {e}") from None
        read += dense.numel() * dense.element_size()
        del dense
        if read > _RELEASE_EVERY:
            ckpt.release_pages()
            read = 0
    ckpt.release_pages()
    return load_low_bit(ckpt, component, dtype, device, weights)
