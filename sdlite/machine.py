"""What this machine is: the CPU's model and ISA flags, the caps a user set on them, PyTorch's view of it, the
devices there are, and the user's cache folder. The ground floor of the house: it imports nothing from sdlite but
its errors, and everything that decides something from these facts (prepacking, int8 ranges, precisions, kernels)
sits above it.

:func:`detect` reads the CPU's model name and ISA flags (``/proc/cpuinfo`` on Linux, ``sysctl`` on macOS; elsewhere
"unknown", which is never an error), PyTorch's CPU capability, and the caps a user may set before torch is
imported: ``ONEDNN_MAX_CPU_ISA`` (oneDNN's kernels) and ``ATEN_CPU_CAPABILITY`` (PyTorch's own vectorised
kernels). The *effective* flags are those the caps leave usable: a CPU with AVX512-VNNI under
``ONEDNN_MAX_CPU_ISA=AVX2`` computes int8 exactly as an AVX2-only CPU does.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import RequestError

# oneDNN's ISA levels on x86 (the values ONEDNN_MAX_CPU_ISA takes), in order, with the CPU flags each adds.
# AVX2_VNNI and AVX2_VNNI_2 are a side branch: only a cap naming them (or none) leaves avx_vnni usable.
_MAIN_CHAIN = (
    ("SSE41", ("sse4_1",)),
    ("AVX", ("avx",)),
    ("AVX2", ("avx2", "fma")),
    ("AVX512_CORE", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    ("AVX512_CORE_VNNI", ("avx512_vnni",)),
    ("AVX512_CORE_BF16", ("avx512_bf16",)),
    ("AVX512_CORE_FP16", ("avx512_fp16",)),
    ("AVX512_CORE_AMX", ("amx_tile", "amx_int8", "amx_bf16")),
    ("AVX512_CORE_AMX_FP16", ("amx_fp16",)),
)
_SIDE_CHAIN = (("AVX2_VNNI", ("avx_vnni",)), ("AVX2_VNNI_2", ("avx_vnni_int8", "avx_ne_convert")))
_ALIASES = {"AVX10_1_512": "AVX512_CORE_FP16", "AVX10_1_512_AMX": "AVX512_CORE_AMX",
            "AVX10_1_512_AMX_FP16": "AVX512_CORE_AMX_FP16", "DEFAULT": "ALL"}
ISA_FLAGS = tuple(f for _, flags in (*_MAIN_CHAIN, *_SIDE_CHAIN) for f in flags)
# the flags `sdlite info --system` shows
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8",
               "amx_bf16")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")
ONEDNN_CAP_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ATEN_CAP_VAR = "ATEN_CPU_CAPABILITY"
CACHE_FILE = "cpu.json"


def permitted_flags(cap: str | None) -> frozenset[str] | None:
    """The ISA flags oneDNN may use under ``ONEDNN_MAX_CPU_ISA=cap``; None: no cap (everything)."""
    if cap is None:
        return None
    name = _ALIASES.get(cap.strip().upper(), cap.strip().upper())
    if name in ("", "ALL"):
        return None
    allowed: set[str] = set()
    for level, flags in _MAIN_CHAIN:
        allowed.update(flags)
        if level == name:
            return frozenset(allowed)
    base = {f for level, flags in _MAIN_CHAIN[:3] for f in flags}       # up to AVX2
    for level, flags in _SIDE_CHAIN:
        base.update(flags)
        if level == name:
            return frozenset(base)
    return None  # a value oneDNN does not know: it ignores it


@dataclass(frozen=True)
class CPUInfo:
    model: str                        # "unknown" where the OS does not say
    arch: str                         # platform.machine(): x86_64, aarch64, arm64 ...
    cores: int                        # logical CPUs the OS reports
    flags: frozenset[str] | None      # ISA flags as the OS reports them; None: unknown on this OS
    onednn_cap: str | None = None     # ONEDNN_MAX_CPU_ISA as set
    aten_cap: str | None = None       # ATEN_CPU_CAPABILITY as set
    torch_version: str = torch.__version__
    torch_capability: str = "unknown"
    onednn: bool = False
    threads: int = 1
    notes: tuple[str, ...] = field(default=())

    @property
    def is_x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64", "i386", "i686", "x86")

    @property
    def effective_flags(self) -> frozenset[str] | None:
        """The ISA flags oneDNN may use: the CPU's, less what ``ONEDNN_MAX_CPU_ISA`` excludes."""
        if self.flags is None:
            return None
        allowed = permitted_flags(self.onednn_cap)
        return self.flags if allowed is None else frozenset(f for f in self.flags if f in allowed)

    def has(self, flag: str) -> bool:
        eff = self.effective_flags
        return eff is not None and flag in eff

    @property
    def avx512(self) -> bool:
        return all(self.has(f) for f in _MAIN_CHAIN[3][1])

    @property
    def avx2(self) -> bool:
        return self.has("avx2") and self.has("fma")

    @property
    def vnni(self) -> bool:
        """u8 x s8 dot products into int32 without saturation (VNNI or AMX), usable by oneDNN."""
        return (self.avx512 and self.has("avx512_vnni")) or (self.avx2 and self.has("avx_vnni")) or \
            (self.avx512 and self.has("amx_int8") and self.has("amx_tile"))

    @property
    def native_bf16(self) -> bool:
        return (self.avx512 and (self.has("avx512_bf16") or self.has("amx_bf16"))) or \
            (self.avx2 and self.has("avx_ne_convert"))

    @property
    def isa_level(self) -> str:
        """The highest oneDNN ISA level the effective flags reach on x86 ("unknown" elsewhere)."""
        eff = self.effective_flags
        if eff is None or not self.is_x86:
            return "unknown"
        reached = "none"
        for level, flags in _MAIN_CHAIN:
            if not all(f in eff for f in flags):
                break
            reached = level
        if reached == "AVX2":
            for level, flags in _SIDE_CHAIN:
                if not all(f in eff for f in flags):
                    break
                reached = level
        return reached

    @property
    def key(self) -> str:
        """What a measurement depends on: CPU model, effective ISA, torch version and thread count."""
        eff = self.effective_flags
        isa = ",".join(sorted(f for f in eff if f in ISA_FLAGS)) if eff is not None else "flags unknown"
        return (f"{self.model} | {self.arch} | isa {self.isa_level} [{isa}] | aten {self.torch_capability} | "
                f"torch {self.torch_version} | {self.threads} threads")


# --- detection --------------------------------------------------------------------------------------------


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str] | None]:
    """Model name and flags from the text of Linux's /proc/cpuinfo (x86 ``flags``, ARM ``Features``)."""
    model, flags = None, None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if model is None and key in ("model name", "hardware", "cpu model", "processor") and \
                not value.strip().isdigit():
            model = value.strip() or None
        elif flags is None and key in ("flags", "features"):
            flags = frozenset(value.split())
    return model, flags


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _os_cpu() -> tuple[str, frozenset[str] | None]:
    """(model name, flags or None) from the OS, without ever failing."""
    if sys.platform.startswith("linux"):
        try:
            model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text(errors="replace"))
            return model or platform.processor() or "unknown", flags
        except OSError:
            pass
    elif sys.platform == "darwin":
        model = _sysctl("machdep.cpu.brand_string") or platform.processor() or "unknown"
        features = " ".join(filter(None, (_sysctl("machdep.cpu.features"), _sysctl("machdep.cpu.leaf7_features"))))
        if features:   # Intel Macs: names such as AVX2 FMA AVX512F AVX512VNNI
            names = {f.lower().replace(".", "_") for f in features.split()}
            rename = {"avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "avx1_0": "avx"}
            return model, frozenset(rename.get(n, n) for n in names)
        return model, None
    return platform.processor() or "unknown", None


def _torch_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older or unusual builds
        return "unknown"


def detect(environ=None) -> CPUInfo:
    """This machine, as the engine sees it now (threads as ``torch.get_num_threads()`` says)."""
    environ = os.environ if environ is None else environ
    model, flags = _os_cpu()
    onednn_cap = next((environ[v] for v in ONEDNN_CAP_VARS if environ.get(v)), None)
    return CPUInfo(model=model, arch=platform.machine() or "unknown", cores=os.cpu_count() or 1, flags=flags,
                   onednn_cap=onednn_cap, aten_cap=environ.get(ATEN_CAP_VAR) or None,
                   torch_capability=_torch_capability(), onednn=torch.backends.mkldnn.is_available(),
                   threads=torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _detect_cached(threads: int) -> CPUInfo:
    return detect()


def this_cpu() -> CPUInfo:
    """:func:`detect`, once per process and thread count."""
    return _detect_cached(torch.get_num_threads())


def cache_dir(environ=None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get("SDLITE_CACHE_DIR"):
        return Path(environ["SDLITE_CACHE_DIR"])
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]) / "sdlite"
    return Path.home() / ".cache" / "sdlite"


def read_measurements(path: Path) -> dict:
    """A file of measurements kept per machine (a JSON object of sections, each keyed by what a measurement depends
    on, e.g. :attr:`CPUInfo.key`); {} where it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_measurement(path: Path, section: str, key: str, entry: dict) -> None:
    """Put ``entry`` under ``section`` / ``key`` in the measurements file ``path`` (replaced whole, atomically); a file
    that cannot be written is left alone (the measurement still holds in this process)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_measurements(path)
        table = data.get(section) if isinstance(data.get(section), dict) else {}
        table[key] = entry
        data[section] = table
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def check_device(device: str | torch.device) -> torch.device:
    """The device, or a clear :class:`~sdlite.errors.RequestError` when it is not there."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise RequestError(f"device {device!r} is not a device name (try cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RequestError(f"device {device!r} is not available: no CUDA GPU is visible to PyTorch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RequestError(f"device {device!r} is not available: {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise RequestError(f"device {device!r} is not available: Apple MPS is not available here")
    elif dev.type != "cpu":
        raise RequestError(f"device {device!r} is not supported: use cpu, cuda or mps")
    return dev
