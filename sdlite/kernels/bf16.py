"""bf16 kernels for AVX512-BF16 CPUs (``avx512_bf16.cpp``): fused attention and the GEGLU epilogue, with PyTorch's
own operations as the fallback.

:func:`attend` is what :class:`sdlite.models.layers.Attention` calls for bf16 tensors on a CPU; it returns None
(the caller runs ``F.scaled_dot_product_attention``) wherever the kernel does not apply: another dtype or device,
a head dim over 512, problems too small to gain (under :data:`MIN_WORK`), strides it does not take, kernels turned
off, a CPU without AVX512-BF16 (or ``ONEDNN_MAX_CPU_ISA`` capping below it), or no compiler to build it. On CPUs with
AMX tiles the same attention runs with both products on the tiles (``amx_bf16.cpp``, its own library; the same
roundings). Outputs agree with PyTorch's
flash kernel to bf16 rounding (both sum bf16 products in fp32 and round the probabilities to bf16):
``tests/test_kernels.py``.

:func:`geglu` is what :class:`sdlite.models.unet.GEGLU` calls for bf16 on a CPU: the two halves of the projection as
two plain products (no bias), then one pass for ``(value + b) * gelu(gate + b)``; None where it does not apply.
:func:`geglu_epilogue` is that pass alone, for the int8 projection's two halves (the ``bf16-int8`` precision).

:func:`activation_range` and :func:`activation_codes` quantize a bf16 activation for an int8 layer
(:func:`sdlite.engine.quant.quantize_activation`): one pass for min/max, one for the uint8 codes, with the same
arithmetic (and so the same codes) as PyTorch's fp32 operations; None where they do not apply. :func:`row_codes` and
:func:`scale_rows` do the same with one scale per row (a transformer's tokens): the codes in one pass, and the int8
product's rows scaled back (and biased) in place in one more.

:func:`rope` is the rotary embedding of the transformers' queries and keys (:func:`sdlite.models.layers.rotate_pairs`'s
arithmetic) in one pass, written into a strided output (a slice of the joint sequence). :func:`rms_scale` is an RMS
norm's last three passes in one (:class:`sdlite.models.layers.RMSNorm`'s roundings).
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
import time

import torch
import torch.nn.functional as F

from . import build

NAME = "avx512_bf16"
# -fopenmp: the kernels run on PyTorch's OpenMP threads (see parallel() in the source)
ISA_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp")
MAX_HEAD_DIM = 512
REQUIRED = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
# the same attention with both products on AMX tiles (``amx_bf16.cpp``), where the CPU has them: AVX512-BF16's dot
# products are 16 times slower than the tiles, so there the kernel above loses to PyTorch's (which runs oneDNN's AMX
# GEMMs) and this one wins
AMX_NAME = "amx_bf16"
AMX_ISA_FLAGS = ISA_FLAGS + ("-mamx-tile", "-mamx-bf16")
AMX_REQUIRED = REQUIRED + ("amx_tile", "amx_bf16")
# below this much work (batch x heads x queries x keys x head dim) PyTorch's kernel is as fast or faster (the call and
# the threads cost ~0.1 ms): measured on a 2-core Zen 4, (2, 8, 64, 77, 40) = 3.2M breaks even, (2, 4, 128, 128, 16) =
# 2.1M runs 0.17 ms here against SDPA's 0.11 ms, (2, 8, 128, 128, 40) = 10.5M 0.26 against 0.36 ms
MIN_WORK = 1 << 22
# GEGLU: from this many tokens the split products and the fused epilogue win (SD 1.5, batch 2, ms: 4096 x 320 ->
# 2x1280 17 against PyTorch's 44; 1024 x 640 16.0 against 17.9; at 256 x 1280 even, at 64 x 1280 slower)
MIN_GEGLU_TOKENS = 1024
# set False to run PyTorch's SDPA instead in this process (bench/profile_unet.py measures both this way)
enabled = True
# set False to run the AVX512-BF16 attention on a CPU with AMX too (the tests check both kernels this way)
use_amx = True
# Whether the attention kernel beats PyTorch's own flash kernel depends on the CPU: on a 2-core Zen 4 it is ~3x
# faster at SD 1.x's 64x64-latent self-attention, on a 2-core Xeon with AMX (Sapphire Rapids class) ~2.5x slower
# (PyTorch's flash kernel computes its blocks with oneDNN's brgemm there). So the layers ask :func:`attention_pays`,
# measured once per CPU, thread count, torch version and kernel build at this shape (B, heads, tokens, head dim) and
# kept in the kernel cache folder; SDLITE_BF16_ATTENTION=kernel|pytorch settles it without measuring.
CHOICE_SHAPE = (1, 8, 2048, 40)
# the same choice for the diffusion transformers' attention (FLUX.1, SD3, FLUX.2, Qwen-Image, Z-Image: 64-128 wide
# heads over one joint sequence), measured apart: at these shapes the kernel and PyTorch's flash attention rank
# otherwise than at a UNet's 40-wide heads (a 2-core Zen 4: 59 ms against PyTorch's 140 ms at (1, 24, 1280, 128))
CHOICE_SHAPES = {"unet": CHOICE_SHAPE, "dit": (1, 24, 1024, 128)}
CHOICE_FILE = "attention-choice.json"
CHOICE_ENV = "SDLITE_BF16_ATTENTION"
CHOICE_MIN_GAIN = 0.05   # the kernel must be this much faster than PyTorch's to be chosen


def cpu_problem(cpu=None) -> str | None:
    """Why this CPU cannot run the kernel (None: it can)."""
    return build.cpu_problem(REQUIRED, "AVX512-BF16", cpu)


@functools.cache
def _function():
    """The kernel's entry point, or the reason there is none (a string), once per process."""
    lib = build.library(NAME, ISA_FLAGS, cpu_problem(), "bf16 attention and GEGLU run on PyTorch's kernels")
    if isinstance(lib, str):
        return lib
    fn = lib.sdl_attention_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = build.ATTENTION_ARGTYPES
    epilogue = lib.sdl_geglu_bf16
    epilogue.restype = ctypes.c_int
    epilogue.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int]
    _GEGLU[0] = epilogue
    minmax = lib.sdl_minmax_bf16
    minmax.restype = ctypes.c_int
    minmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    codes = lib.sdl_quantize_u8_bf16
    codes.restype = ctypes.c_int
    codes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_float,
                      ctypes.c_int]
    rows = lib.sdl_quantize_rows_u8_bf16
    rows.restype = ctypes.c_int
    rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 2 + [ctypes.c_int]
    scale_rows = lib.sdl_scale_rows_bf16
    scale_rows.restype = ctypes.c_int
    scale_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    _QUANT[:] = [minmax, codes, rows, scale_rows]
    rope = lib.sdl_rope_bf16
    rope.restype = ctypes.c_int
    rope.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    _ROW_OPS[0] = rope
    rms = lib.sdl_rms_scale_bf16
    rms.restype = ctypes.c_int
    rms.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    _ROW_OPS[1] = rms
    return fn


@functools.cache
def _amx_attention():
    """The AMX attention's entry point, or the reason there is none (a string), once per process."""
    base = _function()
    if isinstance(base, str):
        return base
    lib = build.library(AMX_NAME, AMX_ISA_FLAGS, build.cpu_problem(AMX_REQUIRED, "AMX-BF16"),
                        "bf16 attention runs without AMX tiles")
    if isinstance(lib, str):
        return lib
    if not lib.sdl_amx_permitted():
        return "Linux did not grant this process the AMX tile state"
    fn = lib.sdl_attention_amx
    fn.restype = ctypes.c_int
    fn.argtypes = build.ATTENTION_ARGTYPES
    return fn


@functools.cache
def _library_name(name: str, flags: tuple[str, ...]) -> str:
    return build.library_path(name, flags, build.compiler() or "").name


def amx_problem() -> str | None:
    """Why the AMX attention does not run here (None: it does, unless :data:`use_amx` is False)."""
    got = _amx_attention()
    return got if isinstance(got, str) else None


def _attention_kernel():
    """(entry point or why none, library name, in words) of the attention kernel this process runs: AMX's where it
    runs (and :data:`use_amx`), else AVX512-BF16's."""
    if use_amx and amx_problem() is None:
        return _amx_attention(), _library_name(AMX_NAME, AMX_ISA_FLAGS), "AMX"
    return _function(), _library_name(NAME, ISA_FLAGS), "AVX512-BF16"


def status() -> str:
    """For ``sdlite info --system``: whether bf16 attention and GEGLU run on sdlite's kernels here, and if not why."""
    got = _function()
    if isinstance(got, str):
        return f"PyTorch's ({got})"
    choice = attention_choice()
    attention = f"sdlite's ({_attention_kernel()[2]})" if choice["kernel"] else "PyTorch's SDPA"
    dit = _CHOICES.get(_choice_key("dit"))   # made by a transformer's first bf16 attention in this process
    dit_text = "" if dit is None else (f"; transformers' attention: {'sdlite' if dit['kernel'] else 'PyTorch'}'s "
                                       f"({dit['why']})")
    return f"attention: {attention} ({choice['why']}){dit_text}; GEGLU: sdlite's kernel (AVX512-BF16)"


_READY = False
_GEGLU: list = [None]
_QUANT: list = [None, None, None, None]
_ROW_OPS: list = [None, None]   # the transformers' row kernels: the rotary embedding, the RMS norm's scaling
# the range of the last tensor a kernel wrote in this thread, found while writing it, as .entry = (tensor, its
# version, min, max, non-finite)
_KNOWN = threading.local()


def available() -> bool:
    global _READY
    _READY = not isinstance(_function(), str)
    return _READY


def _usable() -> bool:
    """Whether the kernels run: found available (under torch.compile: already found so, by an eager call or
    :func:`prepare`; tracing does not build them)."""
    return _READY if torch.compiler.is_compiling() else available()


def _strides(t: torch.Tensor):
    return (ctypes.c_int64 * 3)(t.stride(0), t.stride(1), t.stride(2))


@build.operator("attention_bf16")
def attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The kernel as a PyTorch operator (so that torch.compile keeps it whole): q (B, h, N, D), k and v
    (B, h, M, D), bf16, contiguous along D -> (B, N, h*D)."""
    fn = _attention_kernel()[0]
    if isinstance(fn, str):
        raise RuntimeError(f"sdlite's bf16 attention kernel is not available: {fn}")
    b, h, n, d = q.shape
    out = torch.empty(b, n, h, d, dtype=q.dtype)                       # (B, N, h, D): the caller's layout
    view = out.transpose(1, 2)                                          # (B, h, N, D)
    code = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), b, h, n, k.shape[2], d, _strides(q),
              _strides(k), _strides(v), _strides(view), 1.0 / math.sqrt(d), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's bf16 attention kernel failed (code {code}) on q {tuple(q.shape)}, "
                           f"k {tuple(k.shape)}" + (": out of memory" if code == 2 else ""))
    return out.view(b, n, h * d)


@attention_bf16.register_fake
def _(q, k, v):
    b, h, n, d = q.shape
    return q.new_empty(b, n, h * d)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(D)) v for q (B, h, N, D), k and v (B, h, M, D), returned as (B, N, h*D); None where
    the kernel does not apply (see the module's text). Under torch.compile the kernel is used when an eager call
    or :func:`prepare` has already found it available."""
    if not enabled or q.dtype is not torch.bfloat16 or q.device.type != "cpu" or (q.requires_grad and torch.is_grad_enabled()):
        return None
    b, h, n, d = q.shape
    m = k.shape[2]
    if d > MAX_HEAD_DIM or b * h * n * m * d < MIN_WORK or min(b, h, n, m) < 1 or k.dtype is not q.dtype or v.dtype is not q.dtype \
            or k.shape != (b, h, m, d) or v.shape != k.shape \
            or q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        return None
    if not _usable():
        return None
    return attention_bf16(q, k, v)


def prepare(kind: str = "unet") -> bool:
    """Build and load the kernel now, if it applies here, and settle :func:`attention_pays` for ``kind`` (before
    torch.compile traces a model that uses it)."""
    if not available():
        return False
    attention_pays(kind)
    return True


def attention_pays(kind: str = "unet") -> bool:
    """Whether an attention layer of ``kind`` (:data:`CHOICE_SHAPES`: "unet" for
    :class:`sdlite.models.layers.Attention`, "dit" for the transformers' joint attention) should run this kernel
    rather than PyTorch's SDPA on this machine; False where the kernel is not available. Under torch.compile only a
    choice already made counts (tracing measures nothing)."""
    if torch.compiler.is_compiling():
        return _LAST.get(kind, False)
    key = _choice_key(kind)
    if key not in _CHOICES and not _usable():
        return False
    _LAST[kind] = attention_choice(kind)["kernel"] if key not in _CHOICES else _CHOICES[key]["kernel"]
    return _LAST[kind]


_CHOICES: dict = {}
_LAST: dict = {}   # the choice last made in this process, per kind: what a torch.compile trace takes


def _choice_key(kind: str = "unet") -> tuple[int, str, bool, str]:
    """What the choice depends on within one process (called on every bf16 attention layer, so kept cheap): the
    thread count, the override, which kernel (:data:`use_amx`) and the kind of layer; the CPU and torch are this
    process's (the cached measurement's key names them)."""
    return torch.get_num_threads(), os.environ.get(CHOICE_ENV, ""), use_amx, kind


def attention_choice(kind: str = "unet") -> dict:
    """``{"kernel": bool, "why": str}`` (with ``kernel_ms`` and ``pytorch_ms`` when measured): which attention
    :func:`attention_pays` takes here for layers of ``kind``, once per process and thread count."""
    if kind not in CHOICE_SHAPES:
        raise ValueError(f"attention kind {kind!r} is not one of {', '.join(CHOICE_SHAPES)}")
    key = _choice_key(kind)
    if key in _CHOICES:
        return _CHOICES[key]
    forced = os.environ.get(CHOICE_ENV, "").strip().lower()
    if isinstance(_function(), str):
        choice = {"kernel": False, "why": str(_function())}
    elif forced in ("kernel", "pytorch"):
        choice = {"kernel": forced == "kernel", "why": f"{CHOICE_ENV}={forced}"}
    else:
        if forced:
            build.notice(f"{CHOICE_ENV}={forced!r} is not one of kernel, pytorch: measuring instead")
        choice = _cached_measurement(kind)
    _CHOICES[key] = choice
    return choice


def _cached_measurement(kind: str = "unet") -> dict:
    from ..machine import read_measurements, record_measurement, this_cpu

    path = build.kernel_dir() / CHOICE_FILE
    shape = CHOICE_SHAPES[kind]
    entry_key = f"{this_cpu().key} | {_attention_kernel()[1]}" + ("" if kind == "unet" else f" | {kind} {shape}")
    entry = read_measurements(path).get("attention", {}).get(entry_key)
    source = "measured before"
    if not (isinstance(entry, dict) and all(isinstance(entry.get(f), (int, float)) for f in ("kernel_ms", "pytorch_ms"))):
        kernel_ms, pytorch_ms = measure_attention() if kind == "unet" else measure_attention(shape=shape)
        entry = {"kernel_ms": round(kernel_ms, 3), "pytorch_ms": round(pytorch_ms, 3), "measured": time.time()}
        record_measurement(path, "attention", entry_key, entry)
        source = "measured now"
    kernel_ms, pytorch_ms = float(entry["kernel_ms"]), float(entry["pytorch_ms"])
    wins = kernel_ms < pytorch_ms * (1.0 - CHOICE_MIN_GAIN)
    return {"kernel": wins, "kernel_ms": kernel_ms, "pytorch_ms": pytorch_ms,
            "why": f"{source}: {kernel_ms:.1f} ms against PyTorch's {pytorch_ms:.1f} ms at (B, heads, tokens, "
                   f"head dim) {shape}"}


def measure_attention(repeats: int = 5, shape: tuple[int, int, int, int] = CHOICE_SHAPE) -> tuple[float, float]:
    """Median ms of this kernel and of PyTorch's SDPA (with the layer's transposes) on one self-attention of
    ``shape`` (B, heads, tokens, head dim), alternating, after one call of each."""
    b, h, n, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, generator=g).bfloat16().transpose(1, 2) for _ in range(3))
    calls = (lambda: attention_bf16(q, k, v),
             lambda: F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, h * d))
    times: tuple[list, list] = ([], [])
    with torch.no_grad():
        for fn in calls:
            fn()
        for _ in range(repeats):
            for fn, got in zip(calls, times):
                t = time.perf_counter()
                fn()
                got.append(time.perf_counter() - t)
    return tuple(1000.0 * sorted(t)[len(t) // 2] for t in times)


@build.operator("geglu_bf16")
def geglu_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``value * gelu(gate)`` of ``F.linear(x, weight, bias).chunk(2, -1)`` for 2-d bf16 ``x`` (tokens, in):
    (tokens, out / 2)."""
    if not available():
        raise RuntimeError(f"sdlite's bf16 GEGLU kernel is not available: {_function()}")
    half = weight.shape[0] // 2
    value = torch.mm(x, weight[:half].t())
    gate = torch.mm(x, weight[half:].t())
    bv, bg = (None, None) if bias is None else (bias[:half].contiguous(), bias[half:].contiguous())
    code = _GEGLU[0](value.data_ptr(), gate.data_ptr(), None if bv is None else bv.data_ptr(),
                     None if bg is None else bg.data_ptr(), value.shape[0], half, value.stride(0), gate.stride(0),
                     None, torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's bf16 GEGLU kernel failed (code {code}) on x {tuple(x.shape)}, "
                           f"weight {tuple(weight.shape)}")
    return value


@geglu_bf16.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def geglu_epilogue(value: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(value + bias[:F]) * gelu(gate + bias[F:])`` of two contiguous (..., F) products, written into ``value``
    (bf16 on a CPU with the kernel), else computed by PyTorch; returns the result."""
    half = value.shape[-1]
    if enabled and value.dtype is torch.bfloat16 and gate.dtype is torch.bfloat16 and value.device.type == "cpu" \
            and value.is_contiguous() and gate.is_contiguous() and gate.shape == value.shape and value.numel() \
            and not torch.compiler.is_compiling() and available():
        bv, bg = (None, None) if bias is None else (b.to(torch.bfloat16).contiguous()
                                                    for b in (bias[:half], bias[half:]))
        seen = (ctypes.c_float * 3)()
        code = _GEGLU[0](value.data_ptr(), gate.data_ptr(), None if bv is None else bv.data_ptr(),
                         None if bg is None else bg.data_ptr(), value.numel() // half, half, half, half, seen,
                         torch.get_num_threads())
        if code != 0:
            raise RuntimeError(f"sdlite's bf16 GEGLU kernel failed (code {code}) on {tuple(value.shape)}")
        # the int8 layer that reads it next (the feed-forward's output projection) skips its min/max pass
        _KNOWN.entry = (value, value._version, float(seen[0]), float(seen[1]), bool(seen[2]))
        return value
    if bias is not None:
        value, gate = value + bias[:half].to(value.dtype), gate + bias[half:].to(gate.dtype)
    return value * torch.nn.functional.gelu(gate)


def geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``value * gelu(gate)`` of a GEGLU projection (``weight`` (2F, C), ``bias`` (2F) or None) of ``x`` (..., C),
    as (..., F); None where the kernel does not apply (not bf16 on a CPU that runs it, gradients, small problems)."""
    if not enabled or x.dtype is not torch.bfloat16 or x.device.type != "cpu" or weight.dtype is not x.dtype \
            or (bias is not None and bias.dtype is not x.dtype) or weight.shape[0] % 2 \
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) \
            or x.numel() < MIN_GEGLU_TOKENS * x.shape[-1] or not weight.is_contiguous():
        return None
    if not _usable():
        return None
    lead = x.shape[:-1]
    out = geglu_bf16(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*lead, weight.shape[0] // 2)


# --- int8 activations -------------------------------------------------------------------------------------------


def _quantizes(x: torch.Tensor) -> bool:
    """Whether the range and code kernels take ``x``: a non-empty dense (contiguous or channels-last) bf16 CPU tensor,
    eager, on a CPU that runs them."""
    return enabled and x.dtype is torch.bfloat16 and x.device.type == "cpu" and x.numel() > 0 \
        and (x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))) \
        and not torch.compiler.is_compiling() and available()


def activation_range(x: torch.Tensor) -> tuple[float, float] | None:
    """(min, max) of a dense bf16 CPU tensor in one pass; None where the kernel does not apply. A non-finite value
    is a FloatingPointError, as in :func:`sdlite.engine.quant.quantize_activation`."""
    if not _quantizes(x):
        return None
    known = getattr(_KNOWN, "entry", None)
    if known is not None and known[0] is x and known[1] == x._version:
        code, out = (3 if known[4] else 0), known[2:4]
        _KNOWN.entry = None
    else:
        out = (ctypes.c_float * 2)()
        code = _QUANT[0](x.data_ptr(), x.numel(), out, torch.get_num_threads())
    if code == 3:
        raise FloatingPointError(f"an int8 layer's input {tuple(x.shape)} holds non-finite values")
    if code != 0:
        raise RuntimeError(f"sdlite's bf16 min/max kernel failed (code {code}) on {tuple(x.shape)}")
    return float(out[0]), float(out[1])


def activation_codes(x: torch.Tensor, inv_scale: float, add: float, top: float) -> torch.Tensor | None:
    """``uint8(clamp(x * inv_scale + add, 0, top))`` (truncated) of a dense bf16 CPU tensor, in ``x``'s memory format;
    None where the kernel does not apply."""
    if not _quantizes(x):
        return None
    q = torch.empty_like(x, dtype=torch.uint8)
    code = _QUANT[1](x.data_ptr(), q.data_ptr(), x.numel(), inv_scale, add, top, torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's bf16 quantize kernel failed (code {code}) on {tuple(x.shape)}")
    return q


def _rows_of(x: torch.Tensor) -> bool:
    """Whether the per-row kernels take ``x``: as :func:`_quantizes`, and contiguous (rows of its last dimension)."""
    return _quantizes(x) and x.is_contiguous() and x.shape[-1] > 0


def row_codes(x: torch.Tensor, half: float, zero_point: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row symmetric codes of a contiguous bf16 CPU tensor (rows: its last dimension): ``scales = max|x| / half``
    per row (1 where a row is all zeros), fp32, shaped as x without its last dimension, and
    ``uint8(clamp(x / scale + zero_point + 0.5, 0, 2 zero_point - 1))`` (truncated) in x's shape; None where the
    kernel does not apply. A strided input (a slice of a transformer's joint sequence at batch > 1) is copied once for
    the kernel: one pass where PyTorch's arithmetic takes six. A non-finite value is a FloatingPointError."""
    if not x.is_contiguous() and x.dtype is torch.bfloat16 and x.device.type == "cpu" and enabled and _usable():
        x = x.contiguous()
    if not _rows_of(x):
        return None
    cols = x.shape[-1]
    q = torch.empty_like(x, dtype=torch.uint8)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32)
    code = _QUANT[2](x.data_ptr(), q.data_ptr(), scales.data_ptr(), x.numel() // cols, cols, half, zero_point,
                     torch.get_num_threads())
    if code == 3:
        raise FloatingPointError(f"an int8 layer's input {tuple(x.shape)} holds non-finite values")
    if code != 0:
        raise RuntimeError(f"sdlite's bf16 per-row quantize kernel failed (code {code}) on {tuple(x.shape)}")
    return q, scales


def scale_rows(y: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """``y = bf16(y * scales[row] + bias)`` in place, for a contiguous bf16 CPU ``y``, fp32 ``scales`` (one per
    row) and fp32 ``bias`` (one per column, or None); False (``y`` untouched) where the kernel does not apply."""
    if not _rows_of(y) or scales.dtype is not torch.float32 or not scales.is_contiguous() \
            or (bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous())):
        return False
    cols = y.shape[-1]
    code = _QUANT[3](y.data_ptr(), scales.data_ptr(), None if bias is None else bias.data_ptr(), y.numel() // cols,
                     cols, torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's bf16 row-scale kernel failed (code {code}) on {tuple(y.shape)}")
    return True


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The rotary embedding of x (B, S, h, D) bf16 on the CPU: each channel pair (x0, x1) ->
    (x0 cos - x1 sin, x1 cos + x0 sin), in fp32 and rounded to bf16 once, with ``cos`` and ``sin`` (S, D) or (B, S, D)
    fp32 repeating each pair's value twice; written into ``out`` (x's shape, any strides along B, S, h; may be x
    itself) or a new tensor, which is returned. None (nothing written) where the kernel does not apply: another dtype
    or device, strides it does not take, autograd, kernels off or unavailable here."""
    if not enabled or x.dtype is not torch.bfloat16 or x.device.type != "cpu" or x.dim() != 4 \
            or (x.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return None
    b, s, h, d = x.shape
    tables = []
    for t in (cos, sin):
        if t.dtype is not torch.float32 or t.device.type != "cpu" or t.shape[-2:] != (s, d) or t.dim() not in (2, 3) \
                or (t.dim() == 3 and t.shape[0] not in (1, b)) or t.stride(-1) != 1:
            return None
        tables.append(t if t.dim() == 3 else t.unsqueeze(0))
    if cos.stride() != sin.stride() or d % 2 or d > 1024 or x.stride(3) != 1 or min(b, s, h) < 1:
        return None
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype is not x.dtype or out.device != x.device or out.stride(3) != 1:
        return None
    if not _usable():
        return None
    c, sn = tables
    table_strides = (ctypes.c_int64 * 2)(0 if c.shape[0] == 1 else c.stride(0), c.stride(1))
    code = _ROW_OPS[0](x.data_ptr(), c.data_ptr(), sn.data_ptr(), out.data_ptr(), b, s, h, d, _strides(x), table_strides,
                    _strides(out), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's bf16 rotary-embedding kernel failed (code {code}) on {tuple(x.shape)}")
    return out


def _leading3(t: torch.Tensor) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """``t``'s sizes and strides over all but its last dimension as three (leading ones of size 1 added); None for
    more than three."""
    if t.dim() > 4:
        return None
    sizes, strides = [1, 1, 1] + list(t.shape[:-1]), [0, 0, 0] + list(t.stride()[:-1])
    return tuple(sizes[-3:]), tuple(strides[-3:])


def rms_scale(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``(x * r).to(bf16) * weight`` for x (..., D) bf16 (up to 4 dimensions, D contiguous), r (..., 1) fp32 (one
    factor per row: an RMS norm's ``rsqrt(variance + eps)``) and weight (D,) bf16, as PyTorch's three operations round
    it, in one pass; the result has x's strides. None where the kernel does not apply."""
    if not enabled or x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.device.type != "cpu" \
            or r.dtype is not torch.float32 or x.dim() < 1 or x.stride(-1) != 1 or weight.shape != x.shape[-1:] \
            or not weight.is_contiguous() or r.shape != x.shape[:-1] + (1,) or torch.compiler.is_compiling() \
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return None
    lead, lead_r = _leading3(x), _leading3(r)
    if lead is None or lead_r is None or x.numel() == 0 or not _usable():
        return None
    out = torch.empty_like(x)                                  # x's strides where x is dense, else contiguous
    if out.stride(-1) != 1:
        return None
    (n0, n1, n2), xs = lead
    os_ = _leading3(out)[1]
    code = _ROW_OPS[1](x.data_ptr(), r.data_ptr(), weight.data_ptr(), out.data_ptr(), n0, n1, n2, x.shape[-1],
                    (ctypes.c_int64 * 3)(*xs), (ctypes.c_int64 * 3)(*lead_r[1]), (ctypes.c_int64 * 3)(*os_),
                    torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"sdlite's bf16 RMS-scale kernel failed (code {code}) on {tuple(x.shape)}")
    return out
