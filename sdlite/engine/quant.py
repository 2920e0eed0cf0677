"""Low precision on the CPU: int8 weights on PyTorch's own oneDNN kernels, and bf16.

``quantize_model(unet, "int8")`` replaces, in place, the ``nn.Linear`` and ``nn.Conv2d`` layers of a network
by int8 versions (:class:`Int8Linear`, :class:`Int8Conv2d`) and returns the same module, whose ``forward``
signature does not change. The scheme is W8A8 with *dynamic* activation scales:

* weights: symmetric int8, one scale per output channel (``max |w| / 127``), reordered once into oneDNN's
  blocked layout (``torch.ops.onednn.qlinear_prepack`` / ``qconv_prepack``);
* activations: asymmetric uint8, one scale and zero point per call from the tensor's own min and max, so there
  is nothing to calibrate and no range to overflow. 8 bits (0..255) where the CPU has VNNI or AMX, 7 bits
  (0..127, scale = range / 127) elsewhere, as :func:`sdlite.engine.cpu.int8_activation_bits` decides (below);
* compute: ``torch.ops.onednn.qlinear_pointwise`` / ``qconv_pointwise``: u8 x s8 products summed in int32
  (AVX512-VNNI ``vpdpbusd`` or AVX-VNNI, AMX where a CPU has it), scaled back and biased on the way out. These are
  the kernels that ``torch.compile``'s x86 int8 path (Inductor with ``X86InductorQuantizer``) emits. They
  take plain ``uint8``/``int8`` tensors. ``torch.ao.nn.quantized.dynamic`` is measured too (same speed for
  Linear), but it builds on the quantized tensor types whose creation functions torch 2.13 deprecates, and its
  only dynamic convolution (oneDNN engine) lost accuracy in our tests (one layer's output cosine 0.96-0.99,
  against 0.9999 here). ``torch._weight_int8pack_mm`` (weight-only int8) is a GEMV kernel: 30-100x slower than
  fp32 at these shapes.

Left in fp32 (:data:`KEEP_FP32` and :data:`MIN_CHANNELS`): the UNet's first and last convolutions (4 latent
channels: too few for int8 to pay, and the last one writes the prediction itself), the timestep-embedding MLP and
SDXL's added-conditioning MLP (``add_embedding``: pooled text and size/crop ids), and everything that is not a
Linear or a Conv2d: GroupNorm, LayerNorm, attention (softmax included), SiLU/GELU and the residual adds. The two
MLPs run on one vector per sample, so int8 would save no time, and their output reaches every ResBlock. On the
tiny SDXL test UNet, moving the crop ids by 8 px changes an int8 ``add_embedding``'s output at cosine 0.997
(8-bit activations) or 0.989 (7-bit) to the fp32 change: the fine size/crop conditioning would be blurred.

The modes (:data:`QUANTIZE_MODES`) were chosen by ``bench/quant.py`` (SD 1.5 UNet, batch 2, PyTorch default
init, 2-core Zen 4 with AVX512-VNNI/BF16, 1 thread; step time as a fraction of fp32, which equals diffusers'):

============  ========  ========  ==========  ===================  ==================================
mode          256²      512²      weights     UNet output cosine   final latent cosine, 8 DPM++ steps
============  ========  ========  ==========  ===================  ==================================
int8          0.47x     0.52x     828 MB      0.9995               0.9993
int8-bf16     0.51x     0.59x     1389 MB     0.99993              0.99990
bf16          0.56x     0.64x     1644 MB     0.99997              0.99997
(fp32)        1         1         3279 MB     1                    1
============  ========  ========  ==========  ===================  ==================================

Per CPU. Without VNNI (an AVX2-only CPU, or this one under ``ONEDNN_MAX_CPU_ISA=AVX2``) oneDNN multiplies with
``vpmaddubsw``, which adds each pair of adjacent u8 x s8 products into a saturating int16: 255 * 127 * 2 = 64770
becomes 32767 (measured: the kernel returns exactly 32767 per pair of all-255 x all-127 inputs, and differs
from exact integer arithmetic by 1-2% on random activations). fbgemm's remedy is used: 7-bit activations, whose
pair sums (at most 127 * 127 * 2 = 32258) always fit, so the kernel equals exact integer arithmetic again. The
7-bit step is twice as coarse, so its error (1 - cosine) is about 4x the 8-bit one; at the tests' tiny configs
(output cosine against fp32):

==================  ===============  ===============  ===============  ================
activations         UNet sd1         UNet sd2         text encoder     int8-bf16 UNet sd2
==================  ===============  ===============  ===============  ================
8-bit, VNNI         0.99991          0.99988          0.99997          0.99996
8-bit, AVX2         0.99961          0.99833          0.98993          0.99845
7-bit, either       0.99966          0.99957          0.99993          0.99987
==================  ===============  ===============  ===============  ================

7 bits give the same values on every CPU, and int8 stays faster than fp32 without VNNI. bf16 (``int8-bf16``'s
convolutions, ``bf16``) has the same accuracy everywhere, but not the same speed. UNet-shaped layers (3x3
convolutions 640 ch at 16x16 and 320 ch at 32x32, a 320->1280 Linear on 2048 tokens; batch 2, 1 thread, CPU
time, time as a fraction of fp32):

===============================================  ============  ============  ============
oneDNN ISA                                       int8          bf16 conv     bf16 linear
===============================================  ============  ============  ============
AVX512_CORE_BF16 (native: VNNI, avx512_bf16)     0.31-0.34x    0.50-0.52x    0.53x
AVX512_CORE (``ONEDNN_MAX_CPU_ISA=AVX512_CORE``)  0.51-0.60x    2.6-2.9x      2.5x
AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``)                0.53-0.74x    66-120x       5.9x
===============================================  ============  ============  ============

So (:func:`check_quantize_supported`): with native bf16 the bf16 modes run as designed; with AVX-512 but no
bf16 they run with a :class:`BF16Warning`; below AVX-512 they are refused with a message pointing to ``int8``.
``sdlite info --system`` shows what this CPU gets.

``bf16-int8`` (the ``bf16-int8`` precision; :func:`bf16_int8_targets`) is the other way round: a bf16 model whose
heaviest layers are int8. Its int8 layers take bf16 in and give bf16 out (channels-last kept), and quantize their
input with sdlite's range and code kernels (two passes instead of PyTorch's six; the same codes); an input read by
several layers (an attention's to_q, to_k, to_v) is quantized once. On SD 1.5 at 512x512 (batch 2) int8 runs the
ResNet 3x3 convolutions at ~2000 GOP/s against bf16's ~1050 GFLOP/s; the 1x1 convolutions (shortcuts, proj_in/out)
measured no faster in int8 and stay bf16.

On a diffusion transformer (:func:`transformer_int8_targets`) the activations get one scale per token instead
(:func:`quantize_rows`, ``Int8Linear(per_token=True)``): symmetric codes around the zero point 128 that every token
shares, so oneDNN's GEMM (which takes one zero point and one input scale) runs as before with the input scale 1, and
each row of its bf16 product is then multiplied by its token's scale and biased in one more pass
(:func:`scale_rows`; sdlite's kernels make both passes, with PyTorch's arithmetic and so its bits). A DiT's joint
sequence holds tokens of very different sizes (FLUX's and SD3's text tokens beside the image's; the few tokens with
very large activations that trained transformers have): one scale per call is set by the largest and leaves the rest
a few of its 256 steps. This is the scheme of torchao's ``int8_dynamic_activation_int8_weight`` (per-token symmetric
activations, per-channel symmetric weights), which diffusers documents on FLUX.1. It costs what one scale per call
costs (a Zen 4, 2 threads, bf16 in and out, against bf16 ``F.linear``: 1280 x 3072 -> 3072 0.51x both; 1280 x 3072
-> 12288 0.53x against 0.50x; 1280 x 15360 -> 3072 0.46x against 0.45x) and is closer: a random 3072-wide layer's
output 0.95 % from exact against 1.51 % per call.

int8 Linear layers with fp32 convolutions only reach 0.8x: the convolutions are most of the work. At 512² the
fp32 attention (untouched by int8; bf16 attention is no faster on this CPU) is about 40% of the int8 step.
The int8 error is spread over all layer kinds: keeping any one kind in fp32 removes at most about a quarter
of it (the transformers' 1x1 projections: 28%; the skip 1x1 convolutions, conv1, conv2: 18-25% each).
"""
from __future__ import annotations

import copy
import math
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SDLiteError
from ..kernels import bf16 as kernels
from ..loader import RELEASE_EVERY
from ..machine import this_cpu
from .cpu import bf16_int8_problem, bf16_support, int8_activation_bits

QUANTIZE_MODES = {
    "none": "fp32 weights and compute (no change)",
    "int8": "int8 weights (per output channel) and int8 activations (dynamic, per tensor; 8-bit with VNNI/AMX, "
            "7-bit without) for the Linear and Conv2d layers, on oneDNN's kernels; norms, attention and the "
            "timestep (and SDXL's added-conditioning) embeddings in fp32",
    "int8-bf16": "int8 Linear layers as in int8, convolutions with bf16 weights computed in bf16 "
                 "(closer to fp32, a little slower)",
    "bf16": "bf16 weights and bf16 compute for the Linear and Conv2d layers; norms and attention in fp32 (slower "
            "than fp32 on CPUs without native bf16)",
    "bf16-int8": "a bf16 model (activations bf16 end to end) whose 3x3 convolutions (ResNet blocks, down/upsamplers) "
                 "and transformer Linear layers (but the cross-attention's key and value, on the 77 text tokens) are "
                 "int8: per-channel weights, 8-bit activations scaled per call (needs native bf16 and VNNI or AMX)",
}
QUANTIZE_CHOICES = tuple(QUANTIZE_MODES)
# what each mode makes of a Linear and of a Conv2d
_PLAN = {"int8": ("int8", "int8"), "int8-bf16": ("int8", "bf16"), "bf16": ("bf16", "bf16"),
         "bf16-int8": ("int8", "int8")}

# Submodule names (relative to the model given) left in fp32: the UNet's stem, head, timestep MLP and (SDXL) the
# added-conditioning MLP.
KEEP_FP32 = ("conv_in", "conv_out", "time_embedding", "add_embedding")
# A layer with fewer input or output channels than this stays fp32 (int8 would save nothing and cost accuracy).
MIN_CHANNELS = 16
# the containers of a transformer block's modulation Linears that are not an AdaNorm (transformer_int8_targets)
MODULATION_NAMES = ("img_mod", "txt_mod", "adaLN_modulation")
# bf16-int8 on T5: input columns peaking over OUTLIER_RATIO x the median column's computed apart in float, at most 1 in
# OUTLIER_SHARE (LLM.int8()'s decomposition, Dettmers et al. 2022, relative: T5's activations have no set scale)
OUTLIER_RATIO = 6.0
OUTLIER_SHARE = 64
# int8 activation ranges: 0..255, or 0..127 where u8 x s8 pairs are summed in a saturating int16 (no VNNI)
ACTIVATION_BITS = (8, 7)
# input shapes an int8 1x1 convolution keeps a weight packed for (Int8Conv2d._packed_for)
PER_SHAPE_PACKS = 4
# The weights are symmetric, so their zero point is 0; oneDNN takes it as a tensor.
_ZERO_POINT = torch.zeros((), dtype=torch.int64)


class QuantizeError(SDLiteError, ValueError):
    """A bad quantization mode, or a model that cannot be quantized (the message says which and why)."""


class BF16Warning(UserWarning):
    """A bf16 mode on a CPU that has no native bf16: it works, slowly."""


def check_quantize_mode(mode) -> str:
    """``mode`` if it is one of :data:`QUANTIZE_CHOICES`, else a :class:`QuantizeError` listing them."""
    if not isinstance(mode, str) or mode not in QUANTIZE_MODES:
        described = "; ".join(f"{name}: {what}" for name, what in QUANTIZE_MODES.items())
        raise QuantizeError(f"quantize mode {mode!r} is not valid: expected one of {', '.join(QUANTIZE_CHOICES)} "
                            f"({described})")
    return mode


def check_quantize_supported(mode) -> str:
    """``mode`` checked (:func:`check_quantize_mode`) and whether this CPU can run it at a useful speed; returns
    how it runs bf16 (:func:`sdlite.engine.cpu.bf16_support`, "" for modes without bf16). A bf16 mode on a CPU
    without bf16 kernels (x86 below AVX-512) is a :class:`QuantizeError` saying why and what to use."""
    check_quantize_mode(mode)
    if mode == "bf16-int8":
        return _check_bf16_int8()
    if mode == "none" or "bf16" not in _PLAN[mode]:
        return ""
    support = bf16_support()
    if support == "none":
        cpu = this_cpu()
        capped = f" under ONEDNN_MAX_CPU_ISA={cpu.onednn_cap}" if cpu.onednn_cap else ""
        raise QuantizeError(
            f"quantize mode {mode!r} needs bf16 kernels, and this CPU{capped} has neither native bf16 (avx512_bf16, "
            f"amx_bf16, avx_ne_convert) nor AVX-512 to emulate it (oneDNN ISA {cpu.isa_level}): oneDNN falls back "
            "to a reference kernel, 6-120x slower than fp32 for the UNet's layers. Use --quantize int8 (int8 "
            f"weights and {int8_activation_bits()}-bit activations, faster than fp32 here) or none")
    return support


def _check_bf16_int8() -> str:
    problem = bf16_int8_problem()
    if problem:
        raise QuantizeError(f"bf16-int8 {problem}")
    return "native"


# --- int8 -------------------------------------------------------------------------------------------------


QUANTIZE_CHUNK = 1 << 22   # weights quantized this many at a time, through one reused float32 buffer


def quantize_weight(w: torch.Tensor, stored_as: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8, ``w ~= q * scale[:, None, ...]``, ``q = round(w / scale)`` in float32
    (half to even). Returns (int8 q, fp32 scale). ``stored_as``: the codes of ``w.to(stored_as)`` (a weight as the
    model would hold it, e.g. a file's fp16 weight in a bf16 model), without converting the whole tensor.

    Run in blocks of rows (:data:`QUANTIZE_CHUNK` values) through one float32 buffer, in place: a whole UNet's
    weights pass through here at every load, and whole-tensor temporaries (the float32 copy, the quotient, the
    rounding) cost fresh pages each. Blocks of 4M values: smaller ones (cache-sized, 64K) were 3x faster on a quiet
    2-core machine but 3-4x slower than whole tensors on a busy one, where each of their many small parallel
    operations waits for a descheduled thread. The codes are the same either way (the same operations on each
    value)."""
    w = w.detach()
    flat = w.reshape(w.shape[0], -1)
    amax = torch.maximum(flat.amax(dim=1), -flat.amin(dim=1))                  # exact: max |w| per row (one
    # reduction each: torch.aminmax is 3x slower on bf16 here); rounding is monotonic and symmetric, so the max of
    # the values as stored_as holds them is this max in stored_as
    amax = (amax if stored_as is None else amax.to(stored_as)).float()
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))          # an all-zero row: any scale
    q = torch.empty(flat.shape, dtype=torch.int8)
    rows = max(1, QUANTIZE_CHUNK // max(1, flat.shape[1]))
    buffer = torch.empty(min(rows, flat.shape[0]), flat.shape[1])
    for start in range(0, flat.shape[0], rows):
        stop = min(start + rows, flat.shape[0])
        t = buffer[:stop - start]
        rows_in = flat[start:stop] if stored_as is None else flat[start:stop].to(stored_as)
        t.copy_(rows_in).div_(scale[start:stop, None]).round_().clamp_(-127, 127)
        q[start:stop].copy_(t)
    return q.reshape(w.shape), scale


def check_activation_bits(bits) -> int:
    if bits not in ACTIVATION_BITS:
        raise QuantizeError(f"int8 activation bits must be 8 (0..255, needs VNNI/AMX) or 7 (0..127), not {bits!r}")
    return bits


# the last activation quantized in this thread, with its codes, as .entry = (tensor, version, key, result): an
# attention's to_q, to_k and to_v read the same input, which is then quantized once. The tensor itself is held (so its
# memory cannot be reused by another) and its version counter compared (so an in-place change is seen); never with
# autograd, nor for an inference-mode tensor, which has no version counter
_LAST = threading.local()


def _recall(x: torch.Tensor, key):
    """What :func:`_remember` kept for ``x`` under ``key``, where ``x`` is the last input quantized here, unchanged."""
    if torch.is_grad_enabled() or x.is_inference():
        return None
    last = getattr(_LAST, "entry", None)
    if last is not None and last[0] is x and last[1] == x._version and last[2] == key:
        return last[3]
    return None


def _remember(x: torch.Tensor, key, result) -> None:
    if not torch.is_grad_enabled() and not x.is_inference():
        _LAST.entry = (x, x._version, key, result)


def quantize_activation(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, float, int]:
    """Asymmetric per-tensor uint8 over ``[min(x, 0), max(x, 0)]``, ``x ~= (q - zero_point) * scale``.

    ``bits`` 8 uses 0..255, 7 uses 0..127 (scale = range / 127: for CPUs without VNNI, see the module
    docstring). The range always holds 0, so zero padding stays exact. Returns (uint8 q, scale, zero_point).
    """
    top = float((1 << check_activation_bits(bits)) - 1)
    kept = _recall(x, bits)
    if kept is not None:
        return kept
    source = x
    found = kernels.activation_range(x)                                     # bf16: sdlite's kernel, else None
    if found is None:
        if x.dtype is not torch.float32:
            x = x.float()                                                   # bf16 would round x / scale
        lo, hi = (v.item() for v in torch.aminmax(x))
    else:
        lo, hi = found
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise FloatingPointError(f"an int8 layer's input holds non-finite values (min {lo}, max {hi})")
    scale = (hi - lo) / top or 1.0                                          # all zeros: any scale
    zero_point = min(max(round(-lo / scale), 0), int(top))
    # x / scale + zero_point, rounded half up (the +0.5, then truncation by the cast) into 0..top
    q = kernels.activation_codes(x, 1.0 / scale, zero_point + 0.5, top)
    if q is None:
        q = (x * (1.0 / scale)).add_(zero_point + 0.5).clamp_(0.0, top).to(torch.uint8)
    _remember(source, bits, (q, scale, zero_point))
    return q, scale, zero_point


def quantize_rows(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Symmetric uint8 codes with one scale per row of the last dimension (a transformer's tokens), around one zero
    point that every row shares: ``x ~= (q - zero_point) * scale[row]``.

    ``bits`` 8: zero point 128, codes 1..255, ``scale = max|x| / 127``; 7 (no VNNI): zero point 64, codes 1..127,
    ``scale = max|x| / 63``. An all-zero row has scale 1. Returns (uint8 q in x's shape, fp32 scales shaped as x
    without its last dimension, zero point). A token far larger than the rest (FLUX's and SD3's joint sequences hold
    text and image tokens of different magnitudes) then costs only its own precision, not every other token's, as
    one scale per tensor would; the product's rows are scaled back by :func:`scale_rows`."""
    zero_point = 1 << (check_activation_bits(bits) - 1)
    half = float(zero_point - 1)
    kept = _recall(x, (bits, "rows"))
    if kept is not None:
        return kept
    found = kernels.row_codes(x, half, float(zero_point))               # bf16: sdlite's kernel, else None
    if found is None:
        xf = x.float()
        if not bool(torch.isfinite(xf).all()):
            raise FloatingPointError(f"an int8 layer's input {tuple(x.shape)} holds non-finite values")
        amax = xf.abs().amax(dim=-1)
        scales = torch.where(amax > 0, amax / half, torch.ones_like(amax))
        q = (xf * (1.0 / scales).unsqueeze(-1)).add_(zero_point + 0.5).clamp_(0.0, 2.0 * zero_point - 1)
        found = q.to(torch.uint8), scales
    result = (*found, zero_point)
    _remember(x, (bits, "rows"), result)
    return result


def outlier_columns(x: torch.Tensor, ratio: float) -> torch.Tensor | None:
    """The indices of ``x``'s columns (its last dimension) whose largest magnitude over the rows is over ``ratio``
    times the median column's (the largest :data:`OUTLIER_SHARE`-th of the columns where more are), or None. A few
    hidden features far above the rest (trained T5s carry them) would set every token's one scale."""
    peak = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
    if not bool(torch.isfinite(peak).all()):
        raise FloatingPointError(f"an int8 layer's input {tuple(x.shape)} holds non-finite values")
    apart = torch.nonzero(peak > ratio * peak.median()).squeeze(1)
    most = max(1, x.shape[-1] // OUTLIER_SHARE)
    if apart.numel() > most:
        apart = torch.topk(peak, most).indices
    return apart if apart.numel() else None


def quantize_rows_apart(x: torch.Tensor, bits: int, ratio: float):
    """:func:`quantize_rows` of ``x`` with its :func:`outlier_columns` zeroed, and their indices (None where there is
    none, and then ``x``'s own codes): (q, scales, zero point, indices). An input several layers read (T5's q, k and v;
    wi_0 and wi_1) is searched and quantized once."""
    key = (bits, "rows apart", ratio)
    kept = _recall(x, key)
    if kept is not None:
        return kept
    apart = outlier_columns(x, ratio)
    result = (*quantize_rows(x if apart is None else x.index_fill(-1, apart, 0), bits), apart)
    _remember(x, key, result)
    return result


def scale_rows(y: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y * scales[row] + bias`` (``y`` an int8 product of :func:`quantize_rows`' codes, in place where sdlite's
    kernel runs: bf16), computed in fp32 and rounded once into y's dtype."""
    if kernels.scale_rows(y, scales, bias):
        return y
    out = y.float() * scales.unsqueeze(-1)
    if bias is not None:
        out.add_(bias)
    return out.to(y.dtype)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights on oneDNN's u8 x s8 GEMM; the output has the input's dtype (fp32/bf16)."""

    def __init__(self, linear: nn.Linear, activation_bits: int = 8, split: bool = False,
                 stored_as: torch.dtype | None = None, per_token: bool = False, outliers: float | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.activation_bits = check_activation_bits(activation_bits)
        self.per_token = per_token   # activations: one scale per token (quantize_rows), else one per call
        if outliers is not None and (not per_token or split or not outliers > 0):
            raise QuantizeError(f"outlier columns ({outliers!r}) need a positive threshold, per-token activations "
                                "and an unsplit layer")
        self.outliers = outliers     # the ratio over the typical column that sets a column apart (outlier_columns)
        q, scale = quantize_weight(linear.weight, stored_as)
        # the outlier columns' weights are read from the codes (the packed layout below is opaque), kept transposed
        # so that a column's weights are one row
        self.register_buffer("codes", q.t().contiguous() if outliers is not None else None, persistent=False)
        self.held_as = stored_as or linear.weight.dtype    # the float dtype the codes were made from (requantize)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())
        # oneDNN's blocked int8 layout is an opaque tensor (no storage to save or copy): a plain attribute
        self.packed_nbytes = q.numel()
        self.split = split
        if split:   # a GEGLU's projection: its two halves packed apart (halves()), no whole weight
            if self.out_features % 2:
                raise QuantizeError(f"an int8 Linear with {self.out_features} output features has no halves")
            half = self.out_features // 2
            self.packed_halves = tuple(torch.ops.onednn.qlinear_prepack(part.contiguous(), None)
                                       for part in (q[:half], q[half:]))
            self.half_scales = (scale[:half].contiguous(), scale[half:].contiguous())
        else:
            self.packed_weight = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split:
            out = torch.cat(self.halves(x), dim=-1)
            return out if self.bias is None else out.add_(self.bias)
        if self.per_token:
            if self.outliers is None:
                (q, scales, zero_point), apart = quantize_rows(x, self.activation_bits), None
            else:
                q, scales, zero_point, apart = quantize_rows_apart(x, self.activation_bits, self.outliers)
            y = torch.ops.onednn.qlinear_pointwise(q, 1.0, zero_point, self.packed_weight, self.weight_scale,
                                                   _ZERO_POINT, None, 1.0, 0, _out_dtype(x), "none", [], "")
            if apart is None:
                return scale_rows(y, scales, self.bias)
            # the outlier columns' share in fp32: their inputs as they are, their weights from the codes
            columns = self.codes.index_select(0, apart).float().mul_(self.weight_scale)
            extra = x.index_select(-1, apart).float() @ columns
            return y.float().mul_(scales.unsqueeze(-1)).add_(extra if self.bias is None else extra.add_(self.bias)) \
                .to(y.dtype)
        q, scale, zero_point = quantize_activation(x, self.activation_bits)
        return torch.ops.onednn.qlinear_pointwise(q, scale, zero_point, self.packed_weight, self.weight_scale,
                                                  _ZERO_POINT, self.bias, 1.0, 0, _out_dtype(x), "none", [], "")

    def halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The products with the first and the second half of the output features, without the bias, each
        contiguous (a GEGLU's value and gate: :class:`sdlite.models.unet.GEGLU` adds the biases in its epilogue);
        ``x`` is quantized once."""
        if not self.split:
            raise QuantizeError("this int8 Linear was not built with split=True: it has no halves")
        if self.per_token:
            q, scales, zero_point = quantize_rows(x, self.activation_bits)
            return tuple(scale_rows(torch.ops.onednn.qlinear_pointwise(q, 1.0, zero_point, packed, ws, _ZERO_POINT,
                                                                       None, 1.0, 0, _out_dtype(x), "none", [], ""),
                                    scales, None)
                         for packed, ws in zip(self.packed_halves, self.half_scales))
        q, scale, zero_point = quantize_activation(x, self.activation_bits)
        return tuple(torch.ops.onednn.qlinear_pointwise(q, scale, zero_point, packed, ws, _ZERO_POINT, None, 1.0, 0,
                                                        _out_dtype(x), "none", [], "")
                     for packed, ws in zip(self.packed_halves, self.half_scales))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, "
                f"{self.activation_bits}-bit activations{' per token' if self.per_token else ''} (oneDNN)"
                + (f", outlier columns (over {self.outliers:g}x the median peak) in float" if self.outliers is not None
                   else ""))


class Int8Conv2d(nn.Module):
    """``nn.Conv2d`` (zero padding, groups 1) with int8 weights on oneDNN's u8 x s8 convolution.

    The input's zero point is not handed to oneDNN: with one, oneDNN wants its weights packed with their sums beside
    them, in a layout it picks by the input's shape, and reorders them into it at every call (a weight packed for
    no shape: 153 ms of a 0.85 s SD 1.5 UNet call at 512^2; packing for the shape instead costs about 50 ms a layer
    whenever the shape changes). So the convolution sums the codes as they are, over an input padded by hand with
    the zero point's code (real zeros at the borders), and the zero point's share, ``zp x`` the weights' sums, comes
    off through the bias: the same integer sums, one fp32 rounding apart.

    oneDNN writes NHWC; the output is made NCHW-contiguous again, since model code may ``view`` it.
    """

    def __init__(self, conv: nn.Conv2d, activation_bits: int = 8, stored_as: torch.dtype | None = None):
        super().__init__()
        if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise QuantizeError(f"int8 convolutions need groups=1 and numeric zero padding; this one has "
                                f"groups={conv.groups}, padding={conv.padding!r}, padding_mode={conv.padding_mode!r}")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.activation_bits = check_activation_bits(activation_bits)
        self.kernel_size, self.stride = tuple(conv.kernel_size), list(conv.stride)
        self.padding, self.dilation = list(conv.padding), list(conv.dilation)
        q, scale = quantize_weight(conv.weight, stored_as)
        self.held_as = stored_as or conv.weight.dtype      # the float dtype the codes were made from (requantize)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().float().contiguous())
        # per output channel, what one unit of input code adds to the output: weight scale x the weights' sum
        self.register_buffer("code_weight", scale * q.sum(dim=(1, 2, 3), dtype=torch.int32).float())
        self.per_shape = self.kernel_size == (1, 1)
        if self.per_shape:
            self.codes = q                                  # packed at each new input shape (_packed_for)
            self.packs: dict[tuple, torch.Tensor] = {}
        else:
            self.packed_weight = self._pack(None, q)
        self.packed_nbytes = q.numel()

    def _pack(self, shape: list[int] | None, q: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.onednn.qconv_prepack(self.codes if q is None else q, self.weight_scale, 1.0, 0, self.stride,
                                              [0, 0], self.dilation, 1, shape)

    def _packed_for(self, q: torch.Tensor) -> torch.Tensor:
        """The packed weight: for a 1x1 convolution, the one packed for this input shape. A 1x1 weight packed for no
        shape is reordered by oneDNN at every call in a slow generic reorder (SD 1.5's 1280x1280 at 16x16: 32 ms a
        call against 0.46 ms), and one packed for a shape is reordered for other shapes; packing one takes 1-3 ms.
        The last :data:`PER_SHAPE_PACKS` shapes' packs are kept."""
        if not self.per_shape:
            return self.packed_weight
        key = tuple(q.shape)
        packed = self.packs.pop(key, None)
        if packed is None:
            packed = self._pack(list(key))
            while len(self.packs) >= PER_SHAPE_PACKS:
                self.packs.pop(next(iter(self.packs)))
        self.packs[key] = packed                                            # most recent last
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale, zero_point = quantize_activation(x, self.activation_bits)
        if any(self.padding):
            ph, pw = self.padding
            q = F.pad(q, (pw, pw, ph, ph), value=zero_point)                # keeps a channels-last layout
        bias = self.code_weight * (-scale * zero_point) if self.bias is None else \
            torch.add(self.bias, self.code_weight, alpha=-scale * zero_point)
        out = torch.ops.onednn.qconv_pointwise(q, scale, 0, self._packed_for(q), self.weight_scale, _ZERO_POINT,
                                               bias, self.stride, [0, 0], self.dilation, 1, 1.0, 0,
                                               _out_dtype(x), "none", [], "")
        # oneDNN writes NHWC: kept for a channels-last input (the bf16 path), made NCHW again for a plain one
        return out.contiguous() if x.is_contiguous() else out

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={tuple(self.stride)}, padding={tuple(self.padding)}, int8 per channel, "
                f"{self.activation_bits}-bit activations (oneDNN)")


def requantize(layer: nn.Module, weight: torch.Tensor) -> nn.Module:
    """A new :class:`Int8Linear` / :class:`Int8Conv2d` like ``layer`` (its bias, activation bits, halves, kernel
    geometry) whose codes are made from ``weight`` (float, ``layer``'s shape) as ``layer``'s were made from its own:
    ``weight`` held in ``layer.held_as`` first (a bf16 model's weight is rounded to bf16), so the result is the
    layer that quantizing a float model holding ``weight`` gives, bit for bit. How a LoRA reaches int8 layers
    (:mod:`sdlite.adapters.lora`): the stored weight plus the update, quantized again; ``layer`` is left as it is."""
    if isinstance(layer, Int8Linear):
        shape = (layer.out_features, layer.in_features)
        with torch.device("meta"):
            shell = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    elif isinstance(layer, Int8Conv2d):
        shape = (layer.out_channels, layer.in_channels, *layer.kernel_size)
        with torch.device("meta"):
            shell = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                              layer.padding, layer.dilation, bias=layer.bias is not None)
    else:
        raise QuantizeError(f"requantize takes an Int8Linear or Int8Conv2d, not a {type(layer).__name__}")
    if tuple(weight.shape) != shape:
        raise QuantizeError(f"requantize: the weight's shape {tuple(weight.shape)} is not the layer's {shape}")
    shell.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if layer.bias is not None:
        shell.bias = nn.Parameter(layer.bias, requires_grad=False)   # already fp32: taken as it is
    held = None if layer.held_as == torch.float32 else layer.held_as
    if isinstance(layer, Int8Linear):
        return Int8Linear(shell, layer.activation_bits, split=layer.split, stored_as=held, per_token=layer.per_token,
                          outliers=layer.outliers)
    return Int8Conv2d(shell, layer.activation_bits, stored_as=held)


# --- bf16 -------------------------------------------------------------------------------------------------


class BF16Linear(nn.Module):
    """bf16 weights and compute (oneDNN ``vdpbf16ps``); the input is cast in, the output back to its dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16"


class BF16Conv2d(nn.Module):
    """bf16 weights and compute for a convolution; the input is cast in, the output back to its dtype."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        if conv.padding_mode != "zeros":
            raise QuantizeError(f"bf16 convolutions need zero padding; this one has padding_mode={conv.padding_mode!r}")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.weight = nn.Parameter(conv.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = (None if conv.bias is None
                     else nn.Parameter(conv.bias.detach().to(torch.bfloat16), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.conv2d(x.to(torch.bfloat16), self.weight, self.bias, self.stride, self.padding, self.dilation,
                       self.groups)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={tuple(self.weight.shape[2:])}, bf16"


_CONVERTERS = {("int8", nn.Linear): Int8Linear, ("int8", nn.Conv2d): Int8Conv2d,
               ("bf16", nn.Linear): BF16Linear, ("bf16", nn.Conv2d): BF16Conv2d}


# --- whole models -----------------------------------------------------------------------------------------


def _kept(name: str, layer: nn.Module, keep: tuple[str, ...]) -> bool:
    if any(name == k or name.startswith(k + ".") for k in keep):
        return True
    if isinstance(layer, nn.Linear):
        return min(layer.in_features, layer.out_features) < MIN_CHANNELS
    return min(layer.in_channels, layer.out_channels) < MIN_CHANNELS


def quantize_model(module: nn.Module, mode: str, keep: tuple[str, ...] = KEEP_FP32,
                   activation_bits: int | None = None) -> nn.Module:
    """Convert ``module``'s Linear and Conv2d layers in place as ``mode`` says, and return it.

    ``keep`` names submodules (relative to ``module``) left in fp32; layers with fewer than
    :data:`MIN_CHANNELS` input or output channels stay fp32 too. ``"none"`` changes nothing. The model must be on
    the CPU; whatever float dtype it has, everything not converted is made fp32 (the int8/bf16 layers return
    their input's dtype, and the norms and attention compute in fp32). Quantized layers hold packed weights that
    ``state_dict``, ``copy.deepcopy`` and ``.to()`` do not carry: quantize after loading, on the final device.

    ``activation_bits`` (int8 layers): 8 or 7; None: what :func:`sdlite.engine.cpu.int8_activation_bits` says
    for this CPU (8 with VNNI/AMX, else 7).
    """
    check_quantize_mode(mode)
    if mode == "none":
        return module
    if activation_bits is None:
        activation_bits = int8_activation_bits() if "int8" in _PLAN[mode] else 8
    check_activation_bits(activation_bits)
    if check_quantize_supported(mode) == "emulated":
        warnings.warn(f"quantize mode {mode!r}: this CPU has no native bf16 (avx512_bf16, amx_bf16), so oneDNN emulates "
                      "bf16 with AVX-512: same accuracy, but about 2.5-3x slower than fp32. Use 'int8' for speed and "
                      "memory, or 'none'.", BF16Warning, stacklevel=2)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.device.type != "cpu":
            raise QuantizeError(f"quantize mode {mode!r} runs on the CPU only, but {name or 'the model'} is on "
                                f"{t.device} (load the model on the CPU, with its weights, before quantizing)")
    if mode == "bf16-int8":
        per_token, outliers = _activation_scheme(module)
        targets = bf16_int8_targets(module)
        targets.reverse()
        while targets:   # each float layer let go as its int8 one takes its place (T5-XXL's are 9.5 GB in bf16)
            name, layer, split = targets.pop()
            module.set_submodule(name, _bf16_int8_layer(layer, split, per_token=per_token, outliers=outliers))
            del layer
        return module
    _rest_to_fp32(module)
    linear_as, conv_as = _PLAN[mode]
    targets = [(name, layer) for name, layer in module.named_modules()
               if type(layer) in (nn.Linear, nn.Conv2d) and not _kept(name, layer, keep)]
    for name, layer in targets:
        kind = linear_as if isinstance(layer, nn.Linear) else conv_as
        convert = _CONVERTERS[kind, type(layer)]
        module.set_submodule(name, convert(layer, activation_bits) if kind == "int8" else convert(layer))
    return module


def bf16_int8_targets(module: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """The layers ``bf16-int8`` makes int8, as (name, layer, split): the 3x3 convolutions of the ResNet blocks
    (``conv1``, ``conv2``: half the UNet's work, int8 1.7-1.9x bf16 at 320-640 channels) and of the down- and
    upsamplers, and the Linear layers of the transformer blocks but the cross-attention's ``to_k``/``to_v`` (77
    tokens: too small to gain); the GEGLU's projection split in two (its value and gate halves, for the fused
    epilogue). Left bf16: the 1x1 convolutions (shortcuts, ``proj_in``/``proj_out``: int8 measured no faster there),
    stem and head, embeddings. A transformer network (FLUX.1, SD3, Z-Image, FLUX.2 [klein], Qwen-Image) gets
    :func:`transformer_int8_targets` instead."""
    from ..models.layers import Downsample, ResnetBlock, Upsample
    from ..models.unet import GEGLU, TransformerBlock

    if is_transformer(module):
        return transformer_int8_targets(module)
    if is_t5(module):
        return t5_int8_targets(module)
    found = []
    for owner_name, owner in module.named_modules():
        prefix = owner_name + "." if owner_name else ""
        if isinstance(owner, (ResnetBlock, Downsample, Upsample)):
            for leaf in ("conv1", "conv2", "conv"):
                conv = getattr(owner, leaf, None)
                if type(conv) is nn.Conv2d and tuple(conv.kernel_size) == (3, 3) and conv.groups == 1 \
                        and conv.padding_mode == "zeros" and not isinstance(conv.padding, str) \
                        and min(conv.in_channels, conv.out_channels) >= MIN_CHANNELS:
                    found.append((prefix + leaf, conv, False))
        elif isinstance(owner, TransformerBlock):
            for name, layer in owner.named_modules():
                if type(layer) is not nn.Linear or name in ("attn2.to_k", "attn2.to_v") \
                        or min(layer.in_features, layer.out_features) < MIN_CHANNELS:
                    continue
                parent = owner.get_submodule(name.rpartition(".")[0]) if "." in name else owner
                found.append((prefix + name, layer, isinstance(parent, GEGLU) and layer.out_features % 2 == 0))
    return found


def is_transformer(module: nn.Module) -> bool:
    """Whether ``module`` is one of sdlite's diffusion transformers (SD3's MMDiT, FLUX.1, Z-Image, FLUX.2 [klein],
    Qwen-Image): networks whose repeated blocks sit in top-level ``nn.ModuleList`` s."""
    from ..models.flux import Flux
    from ..models.flux2 import Flux2
    from ..models.mmdit import MMDiT
    from ..models.qwenimage import QwenImage
    from ..models.zimage import ZImage

    return isinstance(module, (MMDiT, Flux, ZImage, Flux2, QwenImage))


def is_t5(module: nn.Module) -> bool:
    """Whether ``module`` is sdlite's T5 encoder (SD3's and FLUX.1's third / second text encoder)."""
    from ..models.t5 import T5Encoder

    return isinstance(module, T5Encoder)


def t5_int8_targets(module: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """The layers ``bf16-int8`` makes int8 in a T5 encoder, as (name, layer, False): every ``nn.Linear`` of its blocks
    (q, k, v, o, wi_0, wi_1 / wi, wo: all of its products but the attention's own)."""
    return [(f"encoder.block.{name}", layer, False) for name, layer in module.encoder.block.named_modules()
            if type(layer) is nn.Linear and min(layer.in_features, layer.out_features) >= MIN_CHANNELS]


def _activation_scheme(module: nn.Module) -> tuple[bool, float | None]:
    """How ``bf16-int8`` scales the activations of ``module``'s int8 Linears: (per token, outlier threshold). A
    diffusion transformer's per token; T5's per token with its outlier columns apart; a UNet's per call."""
    if is_t5(module):
        return True, OUTLIER_RATIO
    return is_transformer(module), None


def _modulates(name: str, parent: nn.Module) -> bool:
    """Whether the Linear ``name`` (inside a block; ``parent`` holds it) maps the per-sample conditioning vector to
    a block's shifts, scales and gates: an ``AdaNorm``'s (SD3, FLUX.1), Qwen-Image's ``img_mod`` / ``txt_mod``,
    Z-Image's ``adaLN_modulation``. (FLUX.2's modulations are outside its blocks.)"""
    from ..models.mmdit import AdaNorm

    return isinstance(parent, AdaNorm) or any(part in MODULATION_NAMES for part in name.split("."))


def transformer_int8_targets(module: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """The layers ``bf16-int8`` makes int8 in a diffusion transformer, as (name, layer, False): every ``nn.Linear``
    inside the network's block lists (its top-level ``nn.ModuleList`` s: FLUX's double and single blocks, SD3's joint
    blocks, Z-Image's refiners and layers, FLUX.2's, Qwen-Image's blocks), at least :data:`MIN_CHANNELS` wide: the
    attention's q/k/v and output projections of both streams and the MLPs, over 97 % of a step's products. Left bf16:
    the per-block modulation Linears (:func:`_modulates`: one row per sample, where int8 saves at most 16 ms of a
    FLUX double block's ~1.5 s and rounds the shifts, scales and gates that every token of the block is multiplied
    by), and everything outside the blocks (embedders, the final norm's modulation, the output projection)."""
    found = []
    for list_name, blocks in module.named_children():
        if not isinstance(blocks, nn.ModuleList):
            continue
        for name, layer in blocks.named_modules():
            if type(layer) is not nn.Linear or min(layer.in_features, layer.out_features) < MIN_CHANNELS:
                continue
            parent = blocks.get_submodule(name.rpartition(".")[0]) if "." in name else blocks
            if not _modulates(name, parent):
                found.append((f"{list_name}.{name}", layer, False))
    return found


def _bf16_int8_layer(layer: nn.Module, split: bool, stored_as: torch.dtype | None = None,
                     per_token: bool = False, outliers: float | None = None) -> nn.Module:
    """One of :func:`bf16_int8_targets`' layers made int8 (8-bit activations; a GEGLU projection split in halves;
    ``per_token``: a transformer's Linear, its activations scaled per token; ``outliers``: the threshold above which
    an input column is computed apart in float)."""
    if split or per_token:
        return Int8Linear(layer, 8, split=split, stored_as=stored_as, per_token=per_token, outliers=outliers)
    return _CONVERTERS["int8", type(layer)](layer, 8, stored_as=stored_as)


def load_bf16_int8(ckpt, component: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``quantize_model(ckpt.load(component, dtype), "bf16-int8")`` in one pass: the same module, bit for bit.

    The two-step way converts every weight into ``dtype`` (a fresh copy of the network) and then quantizes it. Here
    the layers :func:`bf16_int8_targets` names are quantized straight from the file's tensors, as ``dtype`` would
    hold them (:func:`quantize_weight`'s ``stored_as``), so their ``dtype`` copy never exists; the file's pages are
    handed back as they are read, as :meth:`~sdlite.loader.Checkpoint.load` does. On the CPU only."""
    _check_bf16_int8()
    module = ckpt.build_empty(component)
    targets = bf16_int8_targets(module)
    per_token, outliers = _activation_scheme(module)
    deferred = frozenset(f"{name}.weight" for name, _, _ in targets)
    module = ckpt.load_into(module, component, dtype, "cpu", defer=deferred)
    read = 0
    targets.reverse()
    while targets:   # each layer let go once quantised (a GGUF or fp8 file's weights are converted copies)
        name, layer, split = targets.pop()
        stored = ckpt.tensor(component, f"{name}.weight")
        if not torch.is_tensor(stored):                        # a GGUF block format: dequantised into dtype
            stored = stored.dequantize(dtype)
        elif stored.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):   # exact in dtype (torch has no fp8 maxima)
            stored = stored.to(dtype)
        layer.weight = nn.Parameter(stored, requires_grad=False)
        module.set_submodule(name, _bf16_int8_layer(layer, split, stored_as=dtype, per_token=per_token,
                                                    outliers=outliers))
        read += stored.numel() * stored.element_size()
        del layer, stored
        if read > RELEASE_EVERY:
            ckpt.release_pages()
            read = 0
    ckpt.release_pages()
    return module


def _rest_to_fp32(module: nn.Module) -> None:
    """Make every floating-point tensor fp32, except in layers already converted (a second call keeps them)."""
    converted = tuple(_CONVERTERS.values())
    for layer in module.modules():
        if isinstance(layer, converted):
            continue
        for name, p in layer.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        for name, b in layer.named_buffers(recurse=False):
            if b.is_floating_point() and b.dtype != torch.float32:
                layer._buffers[name] = b.float()


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the weights: parameters and buffers (each tensor once) plus the packed int8 weights."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total + sum(getattr(m, "packed_nbytes", 0) for m in module.modules())


def layer_counts(module: nn.Module) -> dict[str, int]:
    """How many layers of each kind: ``{"Int8Conv2d": 96, "Int8Linear": 182, "Conv2d": 2, "Linear": 2}``."""
    kinds = (Int8Linear, Int8Conv2d, BF16Linear, BF16Conv2d, nn.Linear, nn.Conv2d)
    counts: dict[str, int] = {}
    for layer in module.modules():
        if isinstance(layer, kinds):
            counts[type(layer).__name__] = counts.get(type(layer).__name__, 0) + 1
    return counts


# --- image quality ----------------------------------------------------------------------------------------


def psnr(a: torch.Tensor, b: torch.Tensor, peak: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB of ``a`` against ``b`` (same shape); ``inf`` when they are equal."""
    if a.shape != b.shape:
        raise ValueError(f"psnr of tensors of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10.0 * math.log10(peak * peak / mse)


@dataclass
class QualityReport:
    """How a quantized model's images compare with the fp32 model's, same prompt, seed and sampler."""

    mode: str
    psnr_db: float            # decoded 8-bit images, quantized against fp32
    latent_cosine: float      # final latents (cosine similarity, 1 = same direction)
    max_pixel_diff: int       # largest difference of an 8-bit channel value
    image_std: float          # spread of the fp32 image's 8-bit values (a flat image makes any PSNR meaningless)
    size: int
    steps: int

    def __str__(self) -> str:
        return (f"{self.mode}: PSNR {self.psnr_db:.2f} dB, latent cosine {self.latent_cosine:.6f}, largest pixel "
                f"difference {self.max_pixel_diff}/255, fp32 image std {self.image_std:.1f} ({self.size}x{self.size}, "
                f"{self.steps} steps)")


def compare_quality(model, mode: str, prompt: str = "a red circle on a blue background",
                    negative_prompt: str = "", size: int | None = None, steps: int = 20, cfg_scale: float = 7.5,
                    sampler: str = "dpmpp_2m_karras", seed: int = 0, text_encoder: bool = False) -> QualityReport:
    """Generate one image with ``model`` (a :class:`sdlite.loader.StableDiffusion` with fp32 weights) as it is and
    with a quantized copy of its UNet (and of its text encoder when ``text_encoder``), and compare them.

    ``model`` is left as it was. Both runs use the same noise, prompt, sampler and CFG; the images are compared
    as the 8-bit images the pipeline would save.
    """
    from ..sampling.denoisers import CFGDenoiser, Denoiser
    from ..sampling.samplers import sample
    from ..sampling.schedules import NoiseSchedule

    check_quantize_mode(mode)
    spec = model.spec
    size = size or spec.default_size
    multiple = spec.vae.downscale * 2 ** (len(spec.unet.block_channels) - 1)
    if size % multiple:
        raise ValueError(f"size {size} is not valid for this model: it must be a multiple of {multiple}")
    schedule = NoiseSchedule.from_config(model.scheduler_config)
    ids = model.tokenizer([prompt, negative_prompt])
    latent_shape = (1, spec.vae.latent_channels, size // spec.vae.downscale, size // spec.vae.downscale)

    def generate(unet, text):
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(latent_shape, generator=generator)
        with torch.no_grad():
            ctx = text(ids).float()                                     # (2, 77, width)
            denoiser = CFGDenoiser(Denoiser(unet, schedule, spec.prediction_type), cfg_scale)
            latents = sample(sampler, denoiser, noise, schedule, steps, generator=[generator],
                             extra_args={"context": ctx[0:1], "uncond": ctx[1:2]})
            image = model.vae.decode(latents / spec.vae.scaling_factor)
        return latents, ((image.float() / 2 + 0.5).clamp(0, 1) * 255).round()

    ref_latents, ref_image = generate(model.unet, model.text_encoder)
    unet = quantize_model(copy.deepcopy(model.unet), mode)
    text = quantize_model(copy.deepcopy(model.text_encoder), mode) if text_encoder else model.text_encoder
    latents, image = generate(unet, text)
    cosine = F.cosine_similarity(latents.double().flatten(), ref_latents.double().flatten(), dim=0).item()
    return QualityReport(mode=mode, psnr_db=psnr(image, ref_image), latent_cosine=cosine,
                         max_pixel_diff=int((image - ref_image).abs().max().item()),
                         image_std=ref_image.std().item(), size=size, steps=steps)
