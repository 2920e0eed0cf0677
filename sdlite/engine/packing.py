"""fp32 on the CPU: weights reordered once into oneDNN's blocked layout, activations kept channels-last.

``nn.Conv2d`` and ``nn.Linear`` on the CPU hand plain (OIHW / row-major) weights to oneDNN, which reorders them
into its blocked layout on *every* call. For the large, low-resolution layers of the UNet that reorder costs
more than the convolution itself. ``prepack_model(module)`` replaces, in place, each Conv2d by
:class:`PackedConv2d` and each Linear by :class:`PackedLinear`: the weight is reordered once
(``torch.ops.mkldnn._reorder_convolution_weight`` / ``_reorder_linear_weight``) and each call goes straight to
the kernel (``torch.ops.mkldnn._convolution_pointwise`` / ``_linear_pointwise``), the same kernels that
``torch.compile``'s CPU "freezing" path emits, without a compile step. Convolutions take and return
channels-last activations, the layout oneDNN's direct convolutions want, so no activation is reordered either;
GroupNorm, SiLU, the residual adds and the attention's token reshapes all accept that layout.

Measured by ``bench/profile_unet.py`` in ``make bench`` (BENCHMARKS.md; 2-core Zen 4, fp32, batch 2, GFLOP/s;
the best layer reaches about 228):

=========================================  =========  ===========
layer (input)                              plain      prepacked
=========================================  =========  ===========
3x3 conv 320->320 (64x64)                  184        198
3x3 conv 1280->1280 (16x16)                157        200
3x3 conv 1280->1280 (8x8)                  102        228
linear 320->320 (8192 tokens)              163        204
linear 1280->320 (8192 tokens)             175        215
=========================================  =========  ===========

A whole UNet step at 512^2 in the same run: 10.9 s plain, 9.9 s prepacked (the linear layers gain most).

Per CPU, on by default only where it is faster (:func:`sdlite.engine.cpu.prepack_choice`). With AVX-512 it
is (above). On an AVX2-only CPU it is slower: oneDNN's AVX2 channels-last convolutions with weights packed for
no particular input size lose to PyTorch's plain path at the 16-32 px latents of a 256-512 px image. UNet-shaped
layers (:func:`sdlite.engine.cpu.measure_prepack`, sum of medians, busy 2-core Zen 4): prepacked 0.38-0.54x the
plain time natively, 1.22-1.64x under ``ONEDNN_MAX_CPU_ISA=AVX2``. A full-size SD 1.5 UNet step (256^2, batch 2,
1 thread, CPU time, median of 2): 5.94 s plain, 5.36 s prepacked natively (0.90x); 6.16 s against 6.72 s under
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` (1.09x); a whole run on a real AVX2 machine sampled in 25.7 s
prepacked against 18.2 s plain. So the ISA flags decide on x86 (AVX-512: on; AVX2: off),
and elsewhere a short measurement, cached per CPU, torch version and thread count. ``--no-prepack`` /
``prepack=False`` and ``prepack=True`` override it.

The results equal the plain layers' to fp32 rounding (a different summation order: about 1e-6 relative).
Only fp32 on the CPU is prepacked so; other dtypes and devices are left as they are, but for the bf16 precisions'
1x1 convolutions (:class:`ShapePackedConv2d`): their weights packed per input shape, the same bits as plain.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..loader import RELEASE_EVERY
from .winograd import WinogradConv2d, eligible as winograd_eligible, winograd_model


def prepack_available(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`prepack_model` applies here: fp32 on a CPU whose PyTorch build has the oneDNN kernels."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedConv2d(nn.Module):
    """A Conv2d whose weight lives in oneDNN's blocked layout; takes and returns channels-last tensors."""

    compute_dtype = torch.float32

    def __init__(self, conv: nn.Conv2d, weight: torch.Tensor | None = None):
        """``weight``: the fp32 weight to pack, when ``conv``'s own is not loaded (on the meta device)."""
        super().__init__()
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(f"prepacking supports zero padding given in pixels, not {conv.padding_mode!r} "
                             f"padding={conv.padding!r}")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups
        weight = (conv.weight if weight is None else weight).detach().float().contiguous()
        self.packed = torch.ops.mkldnn._reorder_convolution_weight(
            weight, list(self.padding), list(self.stride), list(self.dilation), self.groups, None)
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().float().clone())

    def forward(self, x: torch.Tensor, padding: tuple[int, int] | None = None) -> torch.Tensor:
        """``padding`` overrides the layer's own (tiled decoding pads by hand and passes 0)."""
        x = x.contiguous(memory_format=torch.channels_last)
        pad = list(self.padding if padding is None else padding)
        return torch.ops.mkldnn._convolution_pointwise(x, self.packed, self.bias, pad, list(self.stride),
                                                       list(self.dilation), self.groups, "none", [], "")

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, prepacked")


class PackedLinear(nn.Module):
    """A Linear whose weight lives in oneDNN's blocked layout."""

    compute_dtype = torch.float32

    def __init__(self, linear: nn.Linear, weight: torch.Tensor | None = None):
        """``weight``: the fp32 weight to pack, when ``linear``'s own is not loaded (on the meta device)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = (linear.weight if weight is None else weight).detach().float().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def prepack_model(module: nn.Module) -> nn.Module:
    """Replace every Conv2d and Linear of ``module`` (fp32, CPU) by its prepacked version, in place, layer by
    layer (so memory grows by one layer at most); returns ``module``."""
    for name, layer in list(module.named_modules()):
        if type(layer) is nn.Conv2d:  # exact types: quantized and other subclasses are left alone
            module.set_submodule(name, PackedConv2d(layer))
        elif type(layer) is nn.Linear:
            module.set_submodule(name, PackedLinear(layer))
        else:
            continue
        layer.to(device="meta")  # the plain weights go now, even if someone still holds the old layer
    return module


def load_prepacked(ckpt, component: str, winograd: bool = False) -> nn.Module:
    """``prepack_model(ckpt.load(component, torch.float32))`` in one pass: the same module, bit for bit.
    ``winograd``: the layers :func:`sdlite.engine.winograd.eligible` takes become
    :class:`~sdlite.engine.winograd.WinogradConv2d` (plain fp32 weights) instead, as
    ``prepack_model(winograd_model(...))`` would make them.

    The two-step way converts every weight into a plain fp32 tensor and then reorders it into a second one.
    Here each Conv2d/Linear weight goes from the file through one reusable fp32 buffer straight into oneDNN's
    layout, so the plain fp32 copy of the network never exists: half the fresh memory to fault in, and on a
    full-size SD 1.5 UNet (fp16 file, 2-core Zen 4) about 1.7 s instead of 5-6 s. The file's pages are handed
    back as they are read, as :meth:`~sdlite.loader.Checkpoint.load` does.
    """
    module = ckpt.build_empty(component)
    layers = [(name, layer) for name, layer in module.named_modules() if type(layer) in (nn.Conv2d, nn.Linear)
              and not (winograd and winograd_eligible(layer))]
    module = ckpt.load_into(module, component, torch.float32, "cpu",
                            defer=frozenset(f"{name}.weight" for name, _ in layers))
    largest = max((layer.weight.numel() for _, layer in layers), default=0)
    buffer = torch.empty(largest)       # each weight is converted into this, then reordered out of it
    read = 0
    for name, layer in layers:
        stored = ckpt.tensor(component, f"{name}.weight")
        if hasattr(stored, "dequantize") and not torch.is_tensor(stored):   # a GGUF block format
            stored = stored.dequantize(torch.float32)
        weight = buffer[:stored.numel()].view(stored.shape).copy_(stored)
        module.set_submodule(name, (PackedConv2d if type(layer) is nn.Conv2d else PackedLinear)(layer, weight))
        read += stored.numel() * stored.element_size()
        if read > RELEASE_EVERY:
            ckpt.release_pages()
            read = 0
    ckpt.release_pages()
    if winograd:
        winograd_model(module)
    return module


# the input shapes a ShapePackedConv2d keeps packs for (the last ones met: a server's one or two image sizes)
SHAPE_PACKS = 2


class ShapePackedConv2d(nn.Conv2d):
    """A 1x1 ``nn.Conv2d`` of a bf16 channels-last network (the bf16 precisions' UNet) whose weight oneDNN gets packed
    for the input's shape, once per shape, instead of reordered at every call.

    Given the plain weight, oneDNN reorders it at each call (SD 1.5's 1280x1280 at 16x16: 0.29 ms of a 1.1 ms
    convolution; about 9 ms of a 512^2 UNet call, a 2-core AMD EPYC); a weight packed for no input shape is worse
    still (a generic reorder at every call: 39 ms). Packed for the input's shape, the convolution runs as it is (0.87
    ms) and gives the same bits. The last :data:`SHAPE_PACKS` shapes' packs are kept (SD 1.5's 1x1 weights: 96 MB
    in bf16, packed once for each shape kept). The weight stays the layer's parameter, as a plain Conv2d's: a LoRA
    merges into it, and a weight that is not the one packed (another tensor, or changed in place) drops the packs.
    Other inputs (another dtype or layout, autograd, torch.compile's tracing) take ``nn.Conv2d``'s own path."""

    @classmethod
    def convert(cls, conv: nn.Conv2d) -> "ShapePackedConv2d":
        """``conv`` itself, made a ShapePackedConv2d (its parameters unchanged)."""
        conv.__class__ = cls
        conv.packs = {}
        conv.packed_from = None
        return conv

    def _packed_for(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.packed_from is None or self.packed_from[0] is not weight or self.packed_from[1] != weight._version:
            self.packs.clear()
            self.packed_from = (weight, weight._version)
        key = tuple(x.shape)
        packed = self.packs.pop(key, None)
        if packed is None:
            packed = torch.ops.mkldnn._reorder_convolution_weight(weight.detach(), list(self.padding),
                                                                  list(self.stride), list(self.dilation),
                                                                  self.groups, list(key))
            while len(self.packs) >= SHAPE_PACKS:
                self.packs.pop(next(iter(self.packs)))
        self.packs[key] = packed                                            # most recent last
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or x.dim() != 4 or torch.is_grad_enabled() \
                or not x.is_contiguous(memory_format=torch.channels_last) or torch.compiler.is_compiling():
            return super().forward(x)
        return torch.ops.mkldnn._convolution_pointwise(x, self._packed_for(x), self.bias, list(self.padding),
                                                       list(self.stride), list(self.dilation), self.groups, "none",
                                                       [], "")


def shape_pack_model(module: nn.Module) -> nn.Module:
    """``module``'s plain 1x1 convolutions (stride 1, no padding, groups 1) made :class:`ShapePackedConv2d`, in place;
    returns ``module``. For a bf16 channels-last network on a CPU with oneDNN's kernels (:func:`shape_packs`)."""
    for layer in module.modules():
        if type(layer) is nn.Conv2d and tuple(layer.kernel_size) == (1, 1) and tuple(layer.stride) == (1, 1) \
                and tuple(layer.padding) == (0, 0) and layer.groups == 1 and layer.padding_mode == "zeros":
            ShapePackedConv2d.convert(layer)
    return module


def shape_packs(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :func:`shape_pack_model` applies: bf16 on a CPU whose PyTorch build has oneDNN's kernels and whose
    oneDNN packs bf16 weights (AVX-512 BW/VL/DQ or AVX-NE-CONVERT, under any ``ONEDNN_MAX_CPU_ISA`` cap)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def release_packed(module: nn.Module) -> None:
    """Drop the packed weights (``Module.to`` cannot move oneDNN's opaque tensors): used when a sub-model is
    freed while a caller may still hold it."""
    for layer in module.modules():
        if isinstance(layer, (PackedConv2d, PackedLinear)):
            layer.packed = None
        elif isinstance(layer, ShapePackedConv2d):
            layer.packs.clear()


def conv2d(conv: nn.Module, x: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
    """``conv`` (plain or prepacked) applied to ``x`` with ``padding`` instead of its own."""
    if isinstance(conv, (PackedConv2d, WinogradConv2d)):
        return conv(x, padding)
    return F.conv2d(x, conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)
