"""3x3 convolutions by Winograd's minimal filtering, F(2x2, 3x3), for fp32 on the CPU.

A 3x3, stride-1 convolution computes each 2x2 block of outputs from a 4x4 tile of its input. Winograd's
algorithm (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2015) transforms each input tile
(``V = B^T d B``) and each filter (``U = G g G^T``) into 16 values, multiplies them element by element -- which
over the channels is 16 independent matrix products, ``M[s] = V[s] @ U[s]`` -- and transforms back
(``Y = A^T M A``). That is 16 multiplications per 4 outputs and channel pair instead of 36: 2.25x fewer, paid for
with the transforms, which read and write memory but multiply little. The matrices (Lavin & Gray, section 4.1)::

    B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
    G   = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]]
    A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]

Their entries are 0, +-1 and 1/2, so the transforms round no more than a direct convolution does: on the UNet's
and the VAE's shapes the result differs from PyTorch's convolution by about 3e-7 of its largest value, the same
as PyTorch's own convolution differs from a float64 one (``tests/test_winograd.py`` asserts 2e-6).

How it runs here (activations channels-last, as the prepacked layers keep them):

* the input is cut into rows of tiles, a few tile rows at a time (about 512 tiles); each chunk's rows are
  copied, zero-padded and channels-last, into a small buffer (the whole padded input never exists: at the VAE's
  largest layer it would be another 268 MB), so the transformed tiles of one chunk stay small and in cache; the
  input transform is eight element-wise passes over strided views (its coefficients are +-1: additions only);
* the filter transform is one matrix product per call (16x9 by 9 x in*out), from the layer's ordinary weight:
  the layer keeps nothing but that weight, so it costs no memory, and LoRA merges into it as into any Conv2d;
* the 16 products are one batched matrix multiply; the output transform is one small matrix product, written
  with the bias straight into the channels-last output;
* the buffers are reused from call to call (a per-thread workspace, :func:`release_workspace` frees it):
  freshly allocated, each would be paged in anew on every call.

Where it pays (``python bench/winograd.py``; 2-core Zen 4, 2 threads, ms per call, median of 7; batch 2 for the
UNet's shapes, 1 for the VAE's; "packed" is :class:`~sdlite.engine.packing.PackedConv2d`, the default with
AVX-512; "plain" is PyTorch's convolution, the default with AVX2 only, measured under
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``):

=====================================  =========================  =========================
layer (input)                          AVX-512: packed, Winograd  AVX2 cap: plain, Winograd
=====================================  =========================  =========================
320 -> 320 (64x64)                     71.2, 64.4 (1.11x)         86.6, 54.8 (1.58x)
960 -> 320 (64x64)                     270.4, 224.8 (1.20x)       276.2, 222.0 (1.24x)
640 -> 640 (32x32)                     76.8, 56.6 (1.36x)         86.9, 49.0 (1.77x)
1920 -> 640 (32x32)                    204.3, 132.9 (1.54x)       291.1, 159.3 (1.83x)
640 -> 640 (16x16)                     18.0, 17.0 (1.06x)         24.1, 17.1 (1.41x)
VAE 512 -> 512 (128x128)               422.0, 289.1 (1.46x)       457.9, 279.2 (1.64x)
VAE 512 -> 512 (256x256)               1468.6, 996.3 (1.47x)      1743.4, 1248.6 (1.40x)
1280 -> 1280 (16x16)                   63.5, 63.6 (1.00x)         140.7, 63.5 (2.21x)
2560 -> 1280 (8x8)                     31.0, 59.8 (0.52x)         152.9, 65.5 (2.33x)
VAE 256 -> 256 (256x256)               380.9, 393.5 (0.96x)       572.2, 332.6 (1.72x)
VAE 256 -> 256 (512x512)               1489.9, 1351.8 (1.10x)     1742.2, 1289.9 (1.35x)
=====================================  =========================  =========================

Against the prepacked layers it gains where the spatial size is large against the channel count, and loses on
small maps of many channels (the UNet's 1280-channel layers at 8x8 for a 512 px image) and on few channels (the
VAE's 256- and 128-channel layers). So :func:`eligible` takes 3x3 stride-1 layers with 320 to 640 output
channels, at least 320 input channels and at most 1.25M channel pairs: in SD 1.x/2.x and SDXL the UNet's first
two levels, and the VAE's 512-channel layers. PyTorch's plain convolution (the default where prepacking does
not pay, as on AVX2-only CPUs) is slower than the prepacked one on exactly those small maps, so against it
(``wide=True``) the rule also takes the UNet's 1280-channel layers and the VAE's layers with 256 channels in
and out. Inputs under 8x8 go to the direct convolution. The layers whose transformed filter would exceed
``FILTER_BUDGET`` (1920x640 channel pairs, 79 MB) run in slices of output channels. The rule does not look at
the input size, which is not known when the model loads: at 16x16 (the second level for a 256 px image) a
640-channel layer is about as fast as the prepacked one natively.

F(4x4, 3x3), for ``fp32-fast`` only (:func:`winograd43_conv2d`): 6x6 input tiles, 36 products per 16 outputs and
channel pair (2.25x fewer than F(2x2, 3x3)), with the input and output transforms in sdlite's AVX2 kernels
(``sdlite/kernels/avx2_fp32.cpp``: one pass each, channels along the vector lanes, the bias added as the blocks are
written) and the products as one batched matrix multiply. Its filter transform has 1/6, 1/12 and 1/24 in it, which
round: about 1e-5 of the output's largest value against float64, where F(2x2, 3x3) stays at PyTorch's 3e-7. So
``exact`` never runs it. Layers marked by :func:`sdlite.kernels.fp32.use_fp32_kernels` run it on inputs of at least
``FAST_MIN_SIDE`` (32) on both sides, with channels in multiples of 8; on smaller maps F(2x2, 3x3), which is as fast
there (its 36-value filter transform, redone per call, costs as much as its products save). fp32-fast's rule also
takes the VAE's 128-channel layers (``eligible(..., fast=True)``). Measured under the AVX2 cap (ms per call, median
of 7, 2 threads; F(2x2, 3x3) / F(4x4, 3x3)): 320 -> 320 at 64x64, batch 2: 36.5 / 23.6; 1920 -> 640 at 32x32:
99.3 / 69.3; 1280 -> 1280 at 16x16: 43.7 / 39.9; VAE 512 -> 512 at 128x128: 182.5 / 106.7; VAE 128 -> 128 at
512x512: PyTorch's 274.8 / 139.4. The SD 1.5 512x512 UNet step went from about 6.1 to 5.6-5.9 s, the VAE decode
from 7.1 to 4.4 s.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.build import operator

_G = torch.tensor([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], dtype=torch.float64)
_AT = torch.tensor([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=torch.float64)
# the 2-D transforms as matrices over a tile's values in row-major order: U = G16 @ g (9 -> 16), Y = A16 @ M
_G16 = torch.einsum("xa,yb->xyab", _G, _G).reshape(16, 9).float()
_A16 = torch.einsum("xa,yb->xyab", _AT, _AT).reshape(4, 16).float()
# F(4x4, 3x3)'s filter transform (Lavin & Gray, section 5), as a matrix over a filter's 9 values (9 -> 36)
_G6 = torch.tensor([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],
                    [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], dtype=torch.float64)
_G36 = torch.einsum("xa,yb->xyab", _G6, _G6).reshape(36, 9).float()

MIN_CHANNELS = 320
MAX_OUT_CHANNELS = 640
MAX_PAIRS = 1920 * 640          # in * out, against prepacked layers (its transformed filter: a 79 MB workspace)
WIDE_MIN_CHANNELS = 256         # against plain PyTorch convolutions: the VAE's 256-channel layers,
WIDE_MAX_OUT_CHANNELS = 1280    # and the UNet's 1280-channel ones
FILTER_BUDGET = 16 * MAX_PAIRS  # floats of transformed filter at once: wider layers go by output-channel slices
MIN_SIDE = 8                    # smaller inputs (either side) run the direct convolution
TILES_PER_CHUNK = 512
FAST_MIN_SIDE = 32              # F(4x4, 3x3) (fp32-fast) from this input size (either side); F(2x2, 3x3) below
FAST_TILES_PER_CHUNK = 256
FAST_MIN_CHANNELS = 64          # fp32-fast also takes narrower layers (the VAE's 128-channel ones): F(4x4, 3x3) pays

_workspace = threading.local()


def _buffer(key: str, numel: int) -> torch.Tensor:
    """A flat fp32 buffer of at least ``numel`` elements, kept for the next call on this thread."""
    buffers = _workspace.__dict__.setdefault("buffers", {})
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buffers[key] = buf = None   # the old one goes before the larger one is allocated
        buffers[key] = buf = torch.empty(numel)
    return buf[:numel]


def release_workspace() -> None:
    """Free this thread's buffers (they are rebuilt at the next call)."""
    _workspace.__dict__.pop("buffers", None)


def winograd_available(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`winograd_model` applies: fp32 on a CPU (on a GPU, cuDNN picks its own algorithms)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def eligible(conv: nn.Module, wide: bool = False, fast: bool = False) -> bool:
    """Whether ``conv`` (an ``nn.Conv2d``) runs faster as :class:`WinogradConv2d` (see the module docstring):
    against a prepacked layer, or with ``wide`` against PyTorch's plain convolution, which leaves more to gain.
    ``fast`` (fp32-fast, where the layers run F(4x4, 3x3) on large maps) also takes layers from
    ``FAST_MIN_CHANNELS`` channels in and out (multiples of 8) up to the wide rule's widest."""
    if not (type(conv) is nn.Conv2d and conv.kernel_size == (3, 3) and conv.stride == (1, 1)
            and conv.dilation == (1, 1) and conv.groups == 1 and conv.padding_mode == "zeros"
            and conv.padding == (1, 1)):
        return False
    if (fast and min(conv.in_channels, conv.out_channels) >= FAST_MIN_CHANNELS and conv.in_channels % 8 == 0
            and conv.out_channels % 8 == 0 and conv.out_channels <= WIDE_MAX_OUT_CHANNELS):
        return True
    return (conv.in_channels >= (WIDE_MIN_CHANNELS if wide else MIN_CHANNELS)
            and (WIDE_MIN_CHANNELS if wide else MIN_CHANNELS) <= conv.out_channels
            and conv.out_channels <= (WIDE_MAX_OUT_CHANNELS if wide else MAX_OUT_CHANNELS)
            and (wide or conv.in_channels * conv.out_channels <= MAX_PAIRS))


def filter_transform(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``U = G g G^T`` of every (out, in) filter of ``weight`` (out, in, 3, 3): shape (16, out, in)."""
    k, c = weight.shape[:2]
    u = torch.mm(_G16, weight.reshape(k * c, 9).t(), out=None if out is None else out.view(16, k * c))
    return u.view(16, k, c)


def winograd_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    padding: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, padding=padding)`` for a 3x3 fp32 ``weight``, stride 1, by F(2x2, 3x3).

    ``x``: (N, C, H, W) in any memory format. Returns (N, K, Ho, Wo) in channels-last memory."""
    n, c, h, w = x.shape
    k = weight.shape[0]
    ph, pw = padding
    ho, wo = h + 2 * ph - 2, w + 2 * pw - 2
    th, tw = (ho + 1) // 2, (wo + 1) // 2          # tile rows and columns (an odd size is padded by one)
    xh = x.permute(0, 2, 3, 1)                      # (N, H, W, C): a view, channels-last or not
    out = torch.empty(n, 2 * th, 2 * tw, k)
    rows = max(1, min(th, -(-TILES_PER_CHUNK // (n * tw))))
    # the output channels in slices whose transformed filters fit the budget (one slice up to 1920x640)
    ks = min(k, max(16, FILTER_BUDGET // (16 * c) // 16 * 16))
    chunks = [(r0, min(rows, th - r0)) for r0 in range(0, th, rows)]
    # one chunk: each slice's filter is transformed once against the chunk's tiles; several chunks and several
    # slices: slice by slice over all chunks (the input transform is redone per slice, the filter's is not)
    order = [(k0, chunk) for k0 in range(0, k, ks) for chunk in chunks]
    pad_buf = _buffer("padded", n * (2 * rows + 2) * (2 * tw + 2) * c)
    row_buf = _buffer("rows", 4 * n * rows * (2 * tw + 2) * c)
    tile_buf = _buffer("tiles", 16 * n * rows * tw * c)
    prod_buf = _buffer("products", 16 * n * rows * tw * ks)
    u_buf = _buffer("u", 16 * ks * c)
    u_for = v_for = None
    for k0, (r0, m) in order:
        kk = min(ks, k - k0)
        p = n * m * tw
        if u_for != k0:
            u = filter_transform(weight[k0:k0 + kk], out=u_buf[:16 * kk * c]).transpose(1, 2)   # (16, C, kk)
            u_for = k0
        if v_for != r0:
            # the chunk's rows of the zero-padded input, channels-last (padded row i is input row i - ph): only
            # these are copied, never the whole padded input
            xp = pad_buf[:n * (2 * m + 2) * (2 * tw + 2) * c].view(n, 2 * m + 2, 2 * tw + 2, c)
            lo = 2 * r0 - ph
            a0, b0 = max(lo, 0), min(lo + 2 * m + 2, h)
            xp[:, :a0 - lo].zero_()
            xp[:, b0 - lo:].zero_()
            xp[:, :, :pw].zero_()
            xp[:, :, pw + w:].zero_()
            xp[:, a0 - lo:b0 - lo, pw:pw + w].copy_(xh[:, a0:b0])
            # B^T d: the tile rows' four input rows combined (rows 2i .. 2i+3 of the padded chunk)
            d = [xp[:, a: a + 2 * m: 2] for a in range(4)]                          # (N, m, 2tw+2, C) each
            r = row_buf[:4 * n * m * (2 * tw + 2) * c].view(4, n, m, 2 * tw + 2, c)
            torch.sub(d[0], d[2], out=r[0])
            torch.add(d[1], d[2], out=r[1])
            torch.sub(d[2], d[1], out=r[2])
            torch.sub(d[1], d[3], out=r[3])
            # (B^T d) B: the same over the columns, into (4, 4, N, m, tw, C) = 16 matrices of (tiles, C)
            e = [r[:, :, :, b: b + 2 * tw: 2] for b in range(4)]
            v = tile_buf[:16 * p * c].view(4, 4, n, m, tw, c)
            torch.sub(e[0], e[2], out=v[:, 0])
            torch.add(e[1], e[2], out=v[:, 1])
            torch.sub(e[2], e[1], out=v[:, 2])
            torch.sub(e[1], e[3], out=v[:, 3])
            v_for = r0
        prod = torch.bmm(v.view(16, p, c), u, out=prod_buf[:16 * p * kk].view(16, p, kk))
        y = torch.mm(_A16, prod.view(16, p * kk)).view(2, 2, n, m, tw, kk)        # A^T M A
        dst = out[:, 2 * r0: 2 * (r0 + m), :, k0:k0 + kk].unflatten(2, (tw, 2)).unflatten(1, (m, 2))
        src = y.permute(2, 3, 0, 4, 1, 5)                                         # (N, m, 2, tw, 2, kk)
        if bias is None:
            dst.copy_(src)
        else:
            torch.add(src, bias[k0:k0 + kk], out=dst)
    if (ho, wo) != (2 * th, 2 * tw):
        out = out[:, :ho, :wo].contiguous()      # an odd size: the extra row/column goes
    return out.permute(0, 3, 1, 2)


def fast_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`winograd43_conv2d` takes this input and weight: fp32 on the CPU, channels in and out in
    multiples of 8, both sides of the input at least ``FAST_MIN_SIDE``, and sdlite's fp32 kernels here."""
    from ..kernels import fp32
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0 and min(x.shape[-2:]) >= FAST_MIN_SIDE
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) and fp32.available())


@operator("winograd43_f32")
def winograd43_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ph: int, pw: int) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, padding=(ph, pw))`` for a 3x3 fp32 ``weight``, stride 1, by F(4x4, 3x3) with
    sdlite's AVX2 transforms (the ``fp32-fast`` precision; :func:`fast_applies` says where). Not PyTorch's bits: the
    filter transform's 1/6, 1/12 and 1/24 round, and the products are summed in another order (about 1e-5 of the
    output's largest value; ``tests/test_kernels_fp32.py``).

    ``x``: (N, C, H, W), channels-last or not. Returns (N, K, Ho, Wo) in channels-last memory."""
    from ..kernels import fp32
    n, c, h, w = x.shape
    k = weight.shape[0]
    ho, wo = h + 2 * ph - 2, w + 2 * pw - 2
    th, tw = (ho + 3) // 4, (wo + 3) // 4
    x = x.contiguous(memory_format=torch.channels_last)
    out = torch.empty(n, 4 * th, 4 * tw, k)
    rows = max(1, min(th, -(-FAST_TILES_PER_CHUNK // (n * tw))))
    ks = min(k, max(8, FILTER_BUDGET // (36 * c) // 8 * 8))
    chunks = [(r0, min(rows, th - r0)) for r0 in range(0, th, rows)]
    v_buf = _buffer("v43", 36 * n * rows * tw * c)
    m_buf = _buffer("m43", 36 * n * rows * tw * ks)
    u_buf = _buffer("u43", 36 * ks * c)
    v_for = None
    for k0 in range(0, k, ks):
        kk = min(ks, k - k0)
        u = torch.mm(_G36, weight[k0:k0 + kk].reshape(kk * c, 9).t(), out=u_buf[:36 * kk * c].view(36, kk * c))
        u = u.view(36, kk, c).transpose(1, 2)                                       # (36, C, kk)
        for r0, m in chunks:
            p = n * m * tw
            v = v_buf[:36 * p * c].view(36, p, c)
            if v_for != r0:
                fp32.wino43_input(x, (ph, pw), r0, m, tw, v)
                v_for = r0
            prod = torch.bmm(v, u, out=m_buf[:36 * p * kk].view(36, p, kk))
            fp32.wino43_output(prod, None if bias is None else bias, out, r0, k0)
    if (ho, wo) != (4 * th, 4 * tw):
        out = out[:, :ho, :wo].contiguous()      # the blocks' extra rows and columns go
    return out.permute(0, 3, 1, 2)


@winograd43_conv2d.register_fake
def _(x, weight, bias, ph, pw):
    n, _, h, w = x.shape
    return x.new_empty(n, weight.shape[0], h + 2 * ph - 2, w + 2 * pw - 2).contiguous(memory_format=torch.channels_last)


class WinogradConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` (3x3, stride 1, fp32 on the CPU) that runs by :func:`winograd_conv2d`. It keeps the
    ordinary weight and bias, so loading, LoRA merging and saving see a plain Conv2d."""

    compute_dtype = torch.float32
    fp32_kernels = False   # F(4x4, 3x3) with sdlite's transforms where it applies (fp32-fast; kernels.fp32)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, weight: torch.Tensor | None = None) -> "WinogradConv2d":
        """The same layer, sharing ``conv``'s parameters (or taking ``weight``): nothing is copied."""
        layer = cls(conv.in_channels, conv.out_channels, 3, padding=conv.padding, bias=conv.bias is not None,
                    device="meta")
        layer.weight = nn.Parameter(conv.weight.detach() if weight is None else weight, requires_grad=False)
        if conv.bias is not None:
            layer.bias = nn.Parameter(conv.bias.detach(), requires_grad=False)
        return layer

    def forward(self, x: torch.Tensor, padding: tuple[int, int] | None = None) -> torch.Tensor:
        """``padding`` overrides the layer's own (tiled decoding pads by hand and passes 0)."""
        pad = tuple(self.padding if padding is None else padding)
        if self.fp32_kernels and fast_applies(x, self.weight):
            return winograd43_conv2d(x, self.weight, self.bias, pad[0], pad[1])
        if (x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.dtype != torch.float32
                or min(x.shape[-2:]) < MIN_SIDE):
            return F.conv2d(x, self.weight, self.bias, 1, pad)
        return winograd_conv2d(x, self.weight, self.bias, pad)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", winograd F(2x2,3x3)"


def winograd_model(module: nn.Module, wide: bool = False, fast: bool = False) -> nn.Module:
    """Replace, in place, every :func:`eligible` Conv2d of ``module`` (fp32, CPU) by a :class:`WinogradConv2d`
    sharing its weights; returns ``module``. ``wide``: the layers stay unpacked (PyTorch's plain convolution is
    the alternative), so the 1280-channel ones are taken too. ``fast``: the model runs fp32-fast (see
    :func:`eligible`)."""
    for name, layer in list(module.named_modules()):
        if eligible(layer, wide, fast) and layer.weight.dtype == torch.float32 and layer.weight.device.type == "cpu":
            module.set_submodule(name, WinogradConv2d.from_conv(layer))
    return module
