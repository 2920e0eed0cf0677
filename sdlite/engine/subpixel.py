"""A decoder's nearest-2x upsampling and the 3x3 convolution after it, as four 2x2 convolutions of the small image.

An upsampler repeats each pixel 2x2 and convolves the result with a 3x3 kernel (the VAE's ``Upsample``, the TAESD's
``nn.Upsample`` and the convolution after it). Each of the four phases of the output (even or odd row, even or odd
column) then reads only 2x2 distinct pixels of the small image, and the kernel taps that land on the same pixel can be
summed first: phase (py, px)'s 2x2 kernel is ``A[py] W A[px]^T`` with ``A[0] = [[1, 0, 0], [0, 1, 1]]`` and
``A[1] = [[1, 1, 0], [0, 0, 1]]``. The four kernels run as one convolution of four times the output channels with
padding 1 over the small image, (H + 1) x (W + 1) outputs, of which phase (py, px) takes the H x W window at (py, px),
written interleaved into the big image. That is 16 products per small pixel and output channel against the 36 of the
upsampled convolution, and the upsampled image (4x the input) is never written.

The summed taps round differently from the upsampled convolution's sums (the kernels are summed in fp32 and rounded
once into the compute dtype), so the engine uses this for decoders in bf16 only (the VAE, and a TAESD decoding in
its place), never on the exact path. A replaced ``Upsample`` keeps its convolution (``conv``), which a size other than
2x and the tiled decode (:mod:`sdlite.engine.tiling`, which computes the upsampled convolution region by region) run.

Measured on a 2-core AMD EPYC with AVX512-BF16 (SD 1.5 at 512^2, random weights): the bf16 VAE's decode 2.78 ->
2.46 s, the bf16 TAESD's 0.165 -> 0.155 s; the images of 3 seeds against exact (bf16-int8, 8 steps, CFG 7.5, the
VAE): 45.59-45.64 dB, against 45.64-45.70 dB before. The bf16-int8 UNet's upsamplers by int8 phases (the phase kernels
quantized per output channel) made its step 0.720 -> 0.697 s, but the demo model's images (real weights) moved: the
lowest PSNR of 8 seeds against exact fell from 32.3 to 29.8 dB, under its 30 dB bound; they stay as they were.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import Upsample


def applies(conv: nn.Module) -> bool:
    """Whether ``conv`` is a plain 3x3 convolution that can run by phases (stride 1, padding 1, zero padding, no
    dilation, one group)."""
    return (type(conv) is nn.Conv2d and tuple(conv.kernel_size) == (3, 3) and tuple(conv.stride) == (1, 1)
            and tuple(conv.padding) == (1, 1) and tuple(conv.dilation) == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros")


def phase_kernels(weight: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """The four phases' 2x2 kernels of a 3x3 ``weight`` (O, I, 3, 3), stacked as (4 O, I, 2, 2) in phase order (0, 0),
    (0, 1), (1, 0), (1, 1), in ``weight``'s dtype. The taps are summed in fp32 (float64 for a float64 weight) and
    rounded once, ``chunk`` output channels at a time, so a large weight is never copied whole in fp32."""
    o = weight.shape[0]
    out = torch.empty((2, 2, o, weight.shape[1], 2, 2), dtype=weight.dtype, device=weight.device)
    sums = torch.float64 if weight.dtype == torch.float64 else torch.float32
    for c0 in range(0, o, chunk):
        w = weight[c0:c0 + chunk].detach().to(sums)                                   # (o', I, 3, 3)
        for py, rows in enumerate(((w[:, :, :1], w[:, :, 1:].sum(2, keepdim=True)),
                                   (w[:, :, :2].sum(2, keepdim=True), w[:, :, 2:]))):
            r = torch.cat(rows, 2)                                                    # (o', I, 2, 3)
            out[py, 0, c0:c0 + chunk] = torch.cat((r[..., :1], r[..., 1:].sum(-1, keepdim=True)), -1)
            out[py, 1, c0:c0 + chunk] = torch.cat((r[..., :2].sum(-1, keepdim=True), r[..., 2:]), -1)
    return out.view(4 * o, weight.shape[1], 2, 2)


def phase_conv(conv: nn.Conv2d) -> nn.Conv2d:
    """The one convolution of the four phases of 3x3 ``conv`` (:func:`applies`; else a ValueError): (4 O, I, 2, 2)
    kernels (:func:`phase_kernels`), the bias four times, padding 1."""
    if not applies(conv):
        raise ValueError(f"the phase upsampler needs a plain 3x3 convolution with padding 1, not {conv}")
    layer = nn.Conv2d(conv.in_channels, 4 * conv.out_channels, 2, padding=1, bias=conv.bias is not None,
                      device="meta")
    layer.weight = nn.Parameter(phase_kernels(conv.weight), requires_grad=False)
    if conv.bias is not None:
        layer.bias = nn.Parameter(conv.bias.detach().repeat(4), requires_grad=False)
    return layer


def interleave(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The big image from the phase convolution's output ``out`` (B, 4 O, H + 1, W + 1) of the small image ``like``
    (B, C, H, W): (B, O, 2H, 2W), in ``like``'s memory format."""
    b, _, h, w = like.shape
    oc = out.shape[1] // 4
    phases = out.view(b, 2, 2, oc, h + 1, w + 1)
    layout = torch.channels_last if like.is_contiguous(memory_format=torch.channels_last) and not like.is_contiguous() \
        else torch.contiguous_format
    y = torch.empty((b, oc, 2 * h, 2 * w), dtype=out.dtype, device=out.device, memory_format=layout)
    grid = y.view(b, oc, h, 2, w, 2)
    for py in (0, 1):
        for px in (0, 1):
            grid[:, :, :, py, :, px].copy_(phases[:, py, px, :, py:py + h, px:px + w])
    return y


class PhaseUpsample(Upsample):
    """An :class:`~sdlite.models.layers.Upsample` (nearest 2x, then its 3x3 ``conv``) that runs 2x by its ``phases``
    convolution (:func:`phase_conv`), other sizes by the upsampled convolution."""

    def __init__(self, up: Upsample):
        nn.Module.__init__(self)
        self.conv, self.phases = up.conv, phase_conv(up.conv)

    def forward(self, x, size: tuple[int, int] | None = None):
        if size is not None and tuple(size) != (2 * x.shape[-2], 2 * x.shape[-1]):
            return super().forward(x, size)
        return interleave(self.phases(x), x)


class PhaseUpsampleConv(nn.Module):
    """A TAESD's ``nn.Upsample(2)`` and the 3x3 convolution after it, as one layer (:func:`phase_conv`)."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.phases = phase_conv(conv)

    def forward(self, x):
        return interleave(self.phases(x), x)


def phase_upsample_model(module: nn.Module) -> nn.Module:
    """``module`` with each 2x nearest upsampling that a plain 3x3 convolution follows computed by phases, in place:
    :class:`~sdlite.models.layers.Upsample` layers (a VAE's decoder) become :class:`PhaseUpsample`, and in an
    ``nn.Sequential`` (a TAESD's decoder) an ``nn.Upsample(scale_factor=2, mode="nearest")`` followed by such a
    convolution becomes ``nn.Identity`` and :class:`PhaseUpsampleConv`. Returns ``module``."""
    for name, layer in list(module.named_modules()):
        if type(layer) is Upsample and applies(layer.conv):
            module.set_submodule(name, PhaseUpsample(layer))
        elif isinstance(layer, nn.Sequential):
            items = list(layer)
            for i in range(len(items) - 1):
                up, conv = items[i], items[i + 1]
                if type(up) is nn.Upsample and up.mode == "nearest" and up.size is None \
                        and up.scale_factor in (2, 2.0, (2, 2), (2.0, 2.0)) and applies(conv):
                    layer[i] = nn.Identity()
                    layer[i + 1] = PhaseUpsampleConv(conv)
    return module
