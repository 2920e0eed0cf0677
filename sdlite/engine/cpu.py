"""What the engine makes of this CPU (:mod:`sdlite.machine` says what it is): prepacked fp32 weights or not, the
int8 activation range, how bf16 runs, and the ``sdlite info --system`` report.

The decisions (measured on a 2-core Zen 4, natively and under ``ONEDNN_MAX_CPU_ISA=AVX2``; figures in the
docstrings of :mod:`.packing` and :mod:`.quant`):

* **int8 activation range** (:func:`int8_activation_bits`). With VNNI (``avx512_vnni``, ``avx_vnni``) or AMX,
  oneDNN multiplies u8 x s8 and sums in int32 exactly: activations use 8 bits (0..255). Without them it uses
  ``vpmaddubsw``, which adds two adjacent u8 x s8 products into a *saturating* int16: 255 * 127 * 2 = 64770 does
  not fit in 32767, and on real activations about 2% of a layer's output is lost (measured: the kernel returns
  exactly 32767 per saturated pair). There activations use 7 bits (0..127, scale = range / 127), as fbgemm
  does: 127 * 127 * 2 = 32258 always fits, and the kernel then equals exact integer arithmetic. A tiny kernel
  probe (:func:`int8_saturates`) backs the flags up: where it sees saturation, 7 bits are used whatever the
  flags say.
* **prepacked fp32 weights** (:func:`prepack_choice`). Settled by the flags on x86: with AVX-512 (effective)
  oneDNN's blocked weights are faster (a UNet step about 5-10%), on an AVX2-only CPU they are slower (its
  channels-last convolutions at 16-32 px latents are 2-4x slower than PyTorch's plain path; a full-size SD 1.5
  run 25.7 s against 18.2 s). Elsewhere (ARM, unknown flags) a short measurement of UNet-shaped layers, plain
  against prepacked, decides once; it is cached as JSON in the user's cache folder (``$SDLITE_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/sdlite``, else ``~/.cache/sdlite``), keyed by CPU model, effective ISA, torch version and
  thread count. Prepacking is used only where it measured faster than plain PyTorch.
* **bf16** (``--quantize int8-bf16`` and ``bf16``, :func:`bf16_support`): the results are the same to rounding
  on every CPU, the speed is not. With native bf16 (``avx512_bf16``, ``amx_bf16``, ``avx_ne_convert``) it is
  faster than fp32; with AVX-512 but no bf16, oneDNN emulates it (2.5-2.9x the fp32 time: allowed, with a
  warning); below AVX-512 oneDNN has no bf16 kernel at all and falls back to a reference one (6-120x the fp32
  time under ``ONEDNN_MAX_CPU_ISA=AVX2``): refused, with a message pointing to ``int8`` (faster than fp32
  there too: 0.5-0.75x per layer with 7-bit activations) or ``none``.
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..machine import CACHE_FILE, SHOWN_FLAGS, CPUInfo, cache_dir, read_measurements, record_measurement, this_cpu

# --- int8 -------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def int8_saturates() -> bool | None:
    """Whether oneDNN's u8 x s8 kernels saturate here: one small Linear and one 3x3 convolution of all-255
    activations by all-127 weights, whose exact sums a saturating int16 pair sum cannot reach. None where the
    kernels are missing."""
    try:
        zero = torch.zeros((), dtype=torch.int64)
        q = torch.full((4, 64), 255, dtype=torch.uint8)
        w = torch.ops.onednn.qlinear_prepack(torch.full((16, 64), 127, dtype=torch.int8), None)
        out = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, w, torch.ones(16), zero, None, 1.0, 0,
                                                 torch.float32, "none", [], "")
        linear_ok = bool((out == 255 * 127 * 64).all())
        q = torch.full((1, 32, 6, 6), 255, dtype=torch.uint8)
        w = torch.ops.onednn.qconv_prepack(torch.full((16, 32, 3, 3), 127, dtype=torch.int8), torch.ones(16),
                                           1.0, 0, [1, 1], [0, 0], [1, 1], 1, None)
        out = torch.ops.onednn.qconv_pointwise(q, 1.0, 0, w, torch.ones(16), zero, None, [1, 1], [0, 0], [1, 1],
                                               1, 1.0, 0, torch.float32, "none", [], "")
        conv_ok = bool((out == 255 * 127 * 32 * 9).all())
    except (AttributeError, RuntimeError):
        return None
    return not (linear_ok and conv_ok)


def int8_activation_bits(cpu: CPUInfo | None = None, saturates: bool | None = None) -> int:
    """8 where oneDNN sums u8 x s8 products exactly (VNNI or AMX usable), else 7.

    ``cpu`` None: this machine, and the kernel probe (:func:`int8_saturates`) runs too; for another ``cpu``,
    ``saturates`` is what a probe said (None: no probe). A probe that saw saturation means 7 bits whatever the
    flags say; where the flags are unknown (or not x86) a probe without saturation means 8.
    """
    if cpu is None:
        cpu, saturates = this_cpu(), int8_saturates()
    if saturates is True:
        return 7
    if cpu.flags is not None and cpu.is_x86:
        return 8 if cpu.vnni else 7
    if saturates is False:
        return 8
    return 7 if cpu.is_x86 else 8


def int8_bits_reason(cpu: CPUInfo | None = None, saturates: bool | None = None) -> str:
    """:func:`int8_activation_bits` and why, in words."""
    if cpu is None:
        cpu, saturates = this_cpu(), int8_saturates()
    if int8_activation_bits(cpu, saturates) == 8:
        return "8-bit activations (0..255): u8 x s8 products summed exactly in int32 (VNNI/AMX)"
    if cpu.flags is not None and cpu.is_x86 and not cpu.vnni:
        why = "no VNNI/AMX usable" + (f" under ONEDNN_MAX_CPU_ISA={cpu.onednn_cap}" if cpu.onednn_cap else "")
        why += " (the kernel probe confirms int16 saturation)" if saturates is True else ""
    elif saturates is True:
        why = "the kernel probe saw int16 saturation"
    else:
        why = "CPU flags unknown"
    return f"7-bit activations (0..127): {why}; without VNNI oneDNN adds u8 x s8 pairs in a saturating int16"


def bf16_support(cpu: CPUInfo | None = None) -> str:
    """How oneDNN runs bf16 here: "native" (avx512_bf16, AMX, avx_ne_convert), "emulated" (AVX-512 without bf16:
    measured 2.5-2.9x the fp32 time of UNet-shaped layers), "none" (x86 without AVX-512: a reference kernel,
    measured 6-120x the fp32 time under ONEDNN_MAX_CPU_ISA=AVX2), or "unknown" (flags unknown, or not x86)."""
    cpu = this_cpu() if cpu is None else cpu
    if cpu.native_bf16:
        return "native"
    if cpu.flags is None or not cpu.is_x86:
        return "unknown"
    return "emulated" if cpu.avx512 else "none"


def bf16_int8_problem(cpu: CPUInfo | None = None) -> str | None:
    """Why the bf16-int8 precision cannot run on ``cpu`` (None: this machine, its int8 kernels probed too), ending
    with what to use instead; None where it can: it needs native bf16 and exact 8-bit int8 products (VNNI or AMX)."""
    bits = int8_activation_bits(None if cpu is None or cpu is this_cpu() else cpu)
    cpu = this_cpu() if cpu is None else cpu
    capped = f" under ONEDNN_MAX_CPU_ISA={cpu.onednn_cap}" if cpu.onednn_cap else ""
    if bf16_support(cpu) != "native":
        return (f"needs native bf16 dot products (avx512_bf16, amx_bf16), and this CPU{capped} has none: use int8 or "
                "exact")
    if bits != 8:
        return f"needs exact 8-bit int8 products (VNNI or AMX), and this CPU{capped} has neither: use bf16 or exact"
    return None


def quantize_notes(cpu: CPUInfo | None = None, saturates: bool | None = None) -> dict[str, str]:
    """mode -> how it runs on this CPU (for ``sdlite info --system``)."""
    if cpu is None:
        cpu, saturates = this_cpu(), int8_saturates()
    bits = int8_activation_bits(cpu, saturates)
    int8 = f"int8 weights, {bits}-bit activations" + ("" if bits == 8 else " (no VNNI: avoids int16 saturation)")
    bf16 = {"native": "native bf16 dot products",
            "emulated": "no native bf16: emulated with AVX-512, slower than fp32 (a warning says so)",
            "none": "REFUSED: no bf16 kernels for this ISA (6-120x slower than fp32); use int8 or none",
            "unknown": "bf16 (speed unknown on this CPU)"}[bf16_support(cpu)]
    both = bf16_support(cpu) == "native" and bits == 8
    return {"none": "fp32", "int8": int8, "int8-bf16": f"{int8}; convolutions: {bf16}", "bf16": bf16,
            "bf16-int8": ("native bf16 and 8-bit int8 products" if both else
                          "REFUSED: needs native bf16 and VNNI/AMX (8-bit int8 products)")}


# --- prepacking -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrepackChoice:
    use: bool
    source: str                    # "unavailable", "flags", "measured" or "cached"
    reason: str
    plain_ms: float | None = None  # the measurement (measured or cached)
    packed_ms: float | None = None

    def __str__(self) -> str:
        return f"{'yes' if self.use else 'no'} ({self.source}: {self.reason})"


# Needed gain before prepacking is used by measurement: a tie keeps PyTorch's plain path.
MIN_GAIN = 0.03


def measure_prepack(repeat: int = 3) -> tuple[float, float]:
    """Milliseconds of a few UNet-shaped fp32 layers (SD 1.5 widths at a 256 px image), plain PyTorch against
    prepacked (channels-last activations, as the packed UNet runs them): (plain, packed), each the sum over the
    layers of the median of ``repeat`` interleaved calls. About a second on 2 cores."""
    from torch import nn

    from .packing import PackedConv2d, PackedLinear

    gen = torch.Generator().manual_seed(0)
    layers = []
    for c, side, k in ((320, 32, 3), (640, 16, 3), (1280, 8, 3), (320, 32, 1)):
        conv = nn.Conv2d(c, c, k, padding=k // 2)
        x = torch.randn(1, c, side, side, generator=gen)
        layers.append((conv, PackedConv2d(conv), x, x.contiguous(memory_format=torch.channels_last)))
    for cin, cout, tokens in ((320, 1280, 1024), (1280, 1280, 64)):
        linear = nn.Linear(cin, cout)
        x = torch.randn(tokens, cin, generator=gen)
        layers.append((linear, PackedLinear(linear), x, x))
    plain_total = packed_total = 0.0
    with torch.no_grad():
        for plain, packed, x, xp in layers:
            plain(x), packed(xp)                                     # warm-up: oneDNN builds its kernels
            tp, tk = [], []
            for _ in range(repeat):
                t = time.perf_counter()
                plain(x)
                tp.append(time.perf_counter() - t)
                t = time.perf_counter()
                packed(xp)
                tk.append(time.perf_counter() - t)
            plain_total += statistics.median(tp)
            packed_total += statistics.median(tk)
    return plain_total * 1e3, packed_total * 1e3


def _flags_decide(cpu: CPUInfo) -> PrepackChoice | None:
    if cpu.flags is None or not cpu.is_x86:
        return None
    if cpu.avx512:
        return PrepackChoice(True, "flags", "AVX-512: oneDNN's blocked weights beat PyTorch's per-call reorder")
    if cpu.avx2:
        capped = f" (ONEDNN_MAX_CPU_ISA={cpu.onednn_cap})" if cpu.onednn_cap else ""
        return PrepackChoice(False, "flags", f"AVX2 without AVX-512{capped}: oneDNN's channels-last convolutions "
                                             "are slower than PyTorch's plain path")
    return None


def prepack_choice(cpu: CPUInfo | None = None, cache: Path | None = None, measure=measure_prepack) -> PrepackChoice:
    """Whether fp32 CPU weights are prepacked by default (see the module docstring).

    ``cpu`` defaults to this machine, ``cache`` to ``cache_dir() / CACHE_FILE``; ``measure()`` returns
    (plain ms, packed ms) and runs only where the flags do not settle it and the cache has no entry for
    ``cpu.key``.
    """
    from .packing import prepack_available

    cpu = this_cpu() if cpu is None else cpu
    if not (cpu.onednn and prepack_available()):
        return PrepackChoice(False, "unavailable", "this PyTorch build has no oneDNN kernels")
    decided = _flags_decide(cpu)
    if decided is not None:
        return decided
    path = cache_dir() / CACHE_FILE if cache is None else cache
    entry = read_measurements(path).get("prepack", {}).get(cpu.key)
    source = "cached"
    if not (isinstance(entry, dict) and isinstance(entry.get("plain_ms"), (int, float))
            and isinstance(entry.get("packed_ms"), (int, float))):
        plain_ms, packed_ms = measure()
        entry = {"plain_ms": round(plain_ms, 3), "packed_ms": round(packed_ms, 3), "measured": time.time()}
        record_measurement(path, "prepack", cpu.key, entry)
        source = "measured"
    plain_ms, packed_ms = float(entry["plain_ms"]), float(entry["packed_ms"])
    use = packed_ms < plain_ms * (1.0 - MIN_GAIN)
    reason = (f"UNet-shaped layers {plain_ms:.1f} ms plain, {packed_ms:.1f} ms prepacked "
              f"({packed_ms / plain_ms:.2f}x)" if plain_ms > 0 else "no usable measurement")
    return PrepackChoice(use, source, reason, plain_ms, packed_ms)


@functools.lru_cache(maxsize=None)
def _default_prepack(key: str) -> PrepackChoice:
    return prepack_choice()


def default_prepack() -> PrepackChoice:
    """:func:`prepack_choice` for this machine, once per process (and thread count)."""
    return _default_prepack(this_cpu().key)


# --- report -----------------------------------------------------------------------------------------------


def system_report(cpu: CPUInfo | None = None) -> list[str]:
    """The lines of ``sdlite info --system``: what this CPU has and what the engine chose."""
    from .packing import prepack_available

    cpu = this_cpu() if cpu is None else cpu
    eff = cpu.effective_flags
    lines = [f"cpu:         {cpu.model} ({cpu.arch}, {cpu.cores} logical cores)"]
    if cpu.flags is None:
        lines.append("isa flags:   unknown on this OS")
    else:
        shown = [f if f in eff else f"{f} (capped)" for f in SHOWN_FLAGS if f in cpu.flags]
        lines.append(f"isa flags:   {', '.join(shown) or 'none of ' + ', '.join(SHOWN_FLAGS)}")
        lines.append(f"onednn isa:  {cpu.isa_level} (effective)")
    caps = [f"{name}={value}" for name, value in (("ONEDNN_MAX_CPU_ISA", cpu.onednn_cap),
                                                  ("ATEN_CPU_CAPABILITY", cpu.aten_cap)) if value]
    lines.append(f"isa caps:    {', '.join(caps) if caps else 'none set'}")
    lines.append(f"torch:       {cpu.torch_version}, CPU capability {cpu.torch_capability}, oneDNN "
                 f"{'available' if cpu.onednn else 'not available'}, {cpu.threads} threads")
    packed = False
    if prepack_available():
        choice = default_prepack() if cpu is this_cpu() else prepack_choice(cpu)
        packed = choice.use
        lines.append(f"prepack:     {choice}")
    else:
        lines.append("prepack:     no (this PyTorch build has no oneDNN kernels)")
    here = (("prepacked", "the 320-640-channel ones (the UNet's first two levels, the VAE's 512-channel layers)")
            if packed else ("plain", "the UNet's 320-1280-channel ones and the VAE's 256- and 512-channel ones"))
    lines.append(f"winograd:    yes: fp32 3x3 convolutions by F(2x2,3x3) (--no-winograd: off); with {here[0]} weights, "
                 f"as here, {here[1]}")
    saturates = int8_saturates() if cpu is this_cpu() else None
    lines.append(f"int8:        {int8_bits_reason(cpu, saturates)}")
    notes = quantize_notes(cpu, saturates)     # every quantize mode, in engine.quant.QUANTIZE_MODES' order
    usable = [m for m in notes if ("bf16" not in m or bf16_support(cpu) != "none")
              and not (m == "bf16-int8" and "REFUSED" in notes[m])]
    lines.append("quantize:    " + ", ".join(usable) + " available")
    for mode, note in notes.items():
        lines.append(f"  {mode:<11}{note}")
    return lines
