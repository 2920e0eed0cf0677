"""Quantised weights decoded in one pass (``dequant.cpp``): ggml's block types and sdlite's I8_ROW / I4_G<n> into
float32 or bfloat16, bit for bit what the PyTorch decoders of :mod:`sdlite.weights.quants` give.

:func:`decode` is what :meth:`sdlite.weights.quants.QuantizedTensor.dequantize` tries first; it returns False (the
caller runs the PyTorch decoders) wherever the kernel does not apply: another output dtype (float16) or device, a
type it does not know (the IQ types, Q8_K; F16 / BF16 / F32 are plain casts), kernels turned off
(``SDLITE_KERNELS=off``), a CPU without AVX2, or no compiler. Since the results are the same bits, it serves every
precision, ``exact`` included (``tests/test_dequant_kernel.py`` compares every type against the PyTorch decoders).

Why: a GGUF transformer decodes every weight on every call (:class:`sdlite.engine.lowbit.LowBitLinear`), and the
PyTorch decoders make a dozen passes through memory per chunk. Measured by ``python bench/dequant.py`` (BENCHMARKS.md,
"GGUF weights decoded in one pass").
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import build

NAME = "dequant"
# no intrinsics in the source: AVX2 for the compiler's vectors; -ffp-contract=off keeps a * b - c two roundings, as
# PyTorch's separate operations round; -fopenmp: PyTorch's threads (parallel.h)
ISA_FLAGS = ("-mavx2", "-ffp-contract=off", "-fopenmp")
REQUIRED = ("avx2",)
#: the type numbers the kernel takes (GGUF's; sdlite's own types have none in files, so the kernel numbers them)
KINDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
         "Q6_K": 14, "I8_ROW": 1000}
I4_GROUP_KIND = 1001
#: threads :func:`decode` asks the kernel for. One: the caller's. A tensor decoded on more threads (OpenMP's, or
#: Python's with ctypes letting go of the GIL) was twice as fast, but left more of the C heap resident after the
#: output was freed: a GGUF FLUX.2 klein streamed in memory mode 0 peaked at 1.2-1.7 GB (eight of ten processes over
#: 1.5 GB) against 1.22 GB in each of three with one thread and 1.2-1.45 GB with the PyTorch decoders; how the other
#: threads hold the heap was not found. One thread still decodes a Q4_K weight several times faster than the PyTorch
#: decoders (bench/dequant.py).
THREADS = 1


def cpu_problem(cpu=None) -> str | None:
    """Why this CPU cannot run the decoder (None: it can)."""
    return build.cpu_problem(REQUIRED, "AVX2", cpu)


@functools.cache
def _library():
    """The loaded library, or the reason there is none (a string), once per process."""
    lib = build.library(NAME, ISA_FLAGS, cpu_problem(), "quantised weights are decoded by PyTorch's operations")
    if isinstance(lib, str):
        return lib
    lib.sdl_dequant.restype = ctypes.c_int
    lib.sdl_dequant.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 3 + \
        [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def status() -> str:
    """For ``sdlite info --system``: whether GGUF / int8 / int4 weights decode on sdlite's kernel here."""
    got = _library()
    return "sdlite's one-pass kernel (AVX2)" if not isinstance(got, str) else f"PyTorch's operations ({got})"


def kind(name: str) -> int | None:
    """The kernel's number for the block type ``name`` (None: it does not decode it)."""
    if name in KINDS:
        return KINDS[name]
    if name.startswith("I4_G") and name[4:].isdigit():
        return I4_GROUP_KIND
    return None


def decode(name: str, block_size: int, type_size: int, data: torch.Tensor, out: torch.Tensor) -> bool:
    """Decode the blocks in ``data`` (uint8, contiguous, whole blocks of type ``name``: ``block_size`` values in
    ``type_size`` bytes) into ``out`` (float32 or bfloat16, contiguous, as many values, on the CPU); True when done,
    False where the kernel does not apply (nothing written: the caller decodes)."""
    number = kind(name)
    if (number is None or out.dtype not in (torch.float32, torch.bfloat16) or data.dtype != torch.uint8
            or data.device.type != "cpu" or out.device.type != "cpu" or not data.is_contiguous()
            or not out.is_contiguous() or data.requires_grad or out.requires_grad):
        return False
    blocks = data.numel() // type_size
    if blocks * type_size != data.numel() or blocks * block_size != out.numel():
        return False
    lib = _library()
    if isinstance(lib, str):
        return False
    status = lib.sdl_dequant(data.data_ptr(), number, block_size, type_size, blocks, out.data_ptr(),
                             int(out.dtype == torch.bfloat16), THREADS)
    return status == 0
