"""fp32 kernels for CPUs with AVX2 and FMA (``avx2_fp32.cpp``): fused attention and the GEGLU epilogue, for the
``fp32-fast`` precision only (:mod:`sdlite.engine.precision`). The ``exact`` path never calls them: they sum in
another order and compute exp and erf by their own polynomials, so they do not give PyTorch's bits (their outputs
agree with float64 attention and GELU to fp32 rounding: ``tests/test_kernels_fp32.py``).

The third is the pair of transforms of Winograd's F(4x4, 3x3) convolution (:func:`wino43_input`,
:func:`wino43_output`; :mod:`sdlite.engine.winograd` runs the convolution).

A model runs them where :func:`use_fp32_kernels` has marked its attention, GEGLU and Winograd layers (the engine does so
for ``fp32-fast``); :func:`attend` and :func:`geglu` return None (the caller runs PyTorch's operations) wherever they do
not apply: another dtype or device, gradients, a head dim over 512, problems too small to gain, strides they do not
take, kernels turned off (``SDLITE_KERNELS=off``), a CPU without AVX2 and FMA (or capped below them), or no compiler.
"""
from __future__ import annotations

import ctypes
import functools
import math
import threading

import torch
from torch import nn

from . import build
from .bf16 import MAX_HEAD_DIM, _strides

NAME = "avx2_fp32"
# -fopenmp: the kernels run on PyTorch's OpenMP threads (parallel.h)
ISA_FLAGS = ("-mavx2", "-mfma", "-fopenmp")
REQUIRED = ("avx2", "fma")
# below this much work (batch x heads x queries x keys x head dim) PyTorch's kernel is about as fast
MIN_WORK = 1 << 22
# GEGLU: from this many tokens the split products and the fused epilogue win
MIN_GEGLU_TOKENS = 1024


def cpu_problem(cpu=None) -> str | None:
    """Why this CPU cannot run the kernels (None: it can)."""
    return build.cpu_problem(REQUIRED, "AVX2 and FMA", cpu)


@functools.cache
def _library():
    """The loaded library, or the reason there is none (a string), once per process."""
    lib = build.library(NAME, ISA_FLAGS, cpu_problem(), "fp32-fast attention and GEGLU run on PyTorch's kernels")
    if isinstance(lib, str):
        return lib
    lib.sdl_attention_f32.restype = ctypes.c_int
    lib.sdl_attention_f32.argtypes = build.ATTENTION_ARGTYPES
    lib.sdl_geglu_f32.restype = ctypes.c_int
    lib.sdl_geglu_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    lib.sdl_wino43_input.restype = lib.sdl_wino43_output.restype = ctypes.c_int
    lib.sdl_wino43_input.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int] * 9 + \
        [ctypes.c_void_p, ctypes.c_int]
    lib.sdl_wino43_output.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
        [ctypes.c_int] * 9
    return lib


def available() -> bool:
    return not isinstance(_library(), str)


def status() -> str:
    """For ``sdlite info --system``: whether fp32-fast's attention and GEGLU run on sdlite's kernels here."""
    got = _library()
    return "sdlite's kernels (AVX2, FMA)" if not isinstance(got, str) else f"PyTorch's ({got})"


def _lib():
    got = _library()
    if isinstance(got, str):
        raise RuntimeError(f"sdlite's fp32 kernels are not available: {got}")
    return got


@build.operator("attention_f32")
def attention_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The kernel as a PyTorch operator (torch.compile keeps it whole): q (B, h, N, D), k and v (B, h, M, D), fp32,
    contiguous along D -> (B, N, h*D)."""
    b, h, n, d = q.shape
    out = torch.empty(b, n, h, d, dtype=q.dtype)                       # (B, N, h, D): the caller's layout
    view = out.transpose(1, 2)                                          # (B, h, N, D)
    code = _lib().sdl_attention_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), b, h, n, k.shape[2],
                                    d, _strides(q), _strides(k), _strides(v), _strides(view), 1.0 / math.sqrt(d),
                                    torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's fp32 attention kernel failed (code {code}) on q {tuple(q.shape)}, "
                           f"k {tuple(k.shape)}" + (": out of memory" if code == 2 else ""))
    return out.view(b, n, h * d)


@attention_f32.register_fake
def _(q, k, v):
    b, h, n, d = q.shape
    return q.new_empty(b, n, h * d)


def _applies(*tensors: torch.Tensor) -> bool:
    """fp32 CPU tensors without gradients, and the kernels here."""
    return all(t.dtype is torch.float32 and t.device.type == "cpu" and not (t.requires_grad and torch.is_grad_enabled())
               for t in tensors) and available()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(D)) v for fp32 q (B, h, N, D), k and v (B, h, M, D), as (B, N, h*D); None where the
    kernel does not apply (see the module's text)."""
    b, h, n, d = q.shape
    m = k.shape[2]
    if d > MAX_HEAD_DIM or b * h * n * m * d < MIN_WORK or min(b, h, n, m) < 1 \
            or k.shape != (b, h, m, d) or v.shape != k.shape \
            or q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or not _applies(q, k, v):
        return None
    return attention_f32(q, k, v)


_workspace = threading.local()


def _gate_buffer(numel: int) -> torch.Tensor:
    """This thread's buffer for the gate half, reused from call to call: the gate never leaves the kernel, and a
    fresh tensor of its size (42 MB at SD 1.5's 64x64 latents) would be a fresh mmap, faulted in page by page."""
    buf = getattr(_workspace, "gate", None)
    if buf is None or buf.numel() < numel:
        _workspace.gate = None
        _workspace.gate = buf = torch.empty(numel)
    return buf[:numel]


def release_workspace() -> None:
    """Frees this thread's gate buffer (the next GEGLU call allocates it again)."""
    _workspace.gate = None


@build.operator("geglu_f32")
def geglu_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``value * gelu(gate)`` of ``F.linear(x, weight, bias).chunk(2, -1)`` for 2-d fp32 ``x`` (tokens, in):
    the two halves' products without bias, then one in-place pass -> (tokens, out / 2)."""
    half = weight.shape[0] // 2
    value = torch.mm(x, weight[:half].t())
    gate = torch.mm(x, weight[half:].t(), out=_gate_buffer(x.shape[0] * half).view(x.shape[0], half))
    bv, bg = (None, None) if bias is None else (bias[:half].contiguous(), bias[half:].contiguous())
    code = _lib().sdl_geglu_f32(value.data_ptr(), gate.data_ptr(), None if bv is None else bv.data_ptr(),
                                None if bg is None else bg.data_ptr(), value.shape[0], half, value.stride(0),
                                gate.stride(0), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's fp32 GEGLU kernel failed (code {code}) on x {tuple(x.shape)}, "
                           f"weight {tuple(weight.shape)}")
    return value


@geglu_f32.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``value * gelu(gate)`` of a GEGLU projection (``weight`` (2F, C), ``bias`` (2F) or None) of ``x`` (..., C),
    as (..., F); None where the kernel does not apply."""
    if weight.shape[0] % 2 or x.numel() < MIN_GEGLU_TOKENS * x.shape[-1] or not weight.is_contiguous() \
            or not _applies(x, weight, *(() if bias is None else (bias,))):
        return None
    lead = x.shape[:-1]
    out = geglu_f32(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*lead, weight.shape[0] // 2)


def wino43_input(x: torch.Tensor, padding: tuple[int, int], r0: int, rows: int, tw: int, out: torch.Tensor) -> None:
    """F(4x4, 3x3)'s input transform ``V = B^T d B`` of the 6x6 tiles of tile rows ``[r0, r0 + rows)`` (``tw`` tiles
    across) of ``x`` (N, C, H, W) fp32 with channels-last strides, zero-padded by ``padding`` at the top and left, into
    ``out`` (36, N * rows * tw, C), contiguous. C is a multiple of 8."""
    n, c, h, w = x.shape
    code = _lib().sdl_wino43_input(x.data_ptr(), x.stride(0), x.stride(2), x.stride(3), n, h, w, c, padding[0],
                                   padding[1], r0, rows, tw, out.data_ptr(), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's Winograd input transform failed (code {code}) on x {tuple(x.shape)}")


def wino43_output(m: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, r0: int, k0: int) -> None:
    """F(4x4, 3x3)'s output transform ``Y = A^T M A`` of ``m`` (36, N * rows * tw, kk) (rows contiguous) into the
    4x4 blocks of tile rows ``[r0, r0 + rows)`` and channels ``[k0, k0 + kk)`` of ``out`` (N, 4 th, 4 tw, K), contiguous,
    plus ``bias`` (K) (or None). kk is a multiple of 8."""
    n, h4, w4, k = out.shape
    kk = m.shape[2]
    rows = m.shape[1] // (n * (w4 // 4))
    code = _lib().sdl_wino43_output(m.data_ptr(), m.stride(1), None if bias is None else bias.data_ptr(),
                                    out.data_ptr(), n, h4 // 4, w4 // 4, k, r0, rows, k0, kk, torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's Winograd output transform failed (code {code}) into {tuple(out.shape)}")


def use_fp32_kernels(model: nn.Module, on: bool = True) -> nn.Module:
    """Marks ``model``'s layers that can run these kernels -- those whose class declares ``fp32_kernels`` (attention
    and GEGLU in :mod:`sdlite.models`, :class:`sdlite.engine.winograd.WinogradConv2d`) -- to run them (``on``) or
    PyTorch's (the ``exact`` path); returns the model. The kernels know no layer classes: a layer opts in."""
    for module in model.modules():
        if isinstance(getattr(type(module), "fp32_kernels", None), bool):
            module.fp32_kernels = on
    return model
