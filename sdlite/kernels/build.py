"""Compile a kernel's C++ file once into the user's cache folder and load it with ctypes.

The shared library's name carries a hash of the source (with the package's headers), the compiler's version line
and the flags, so an edited kernel, another compiler or other flags build anew and never load a stale library. The
build writes to a temporary name and renames it into place, so processes building the same kernel at once do not see
half a file.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..errors import notice_once

KERNEL_DIR = "kernels"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-math-errno")
PREFIX = "sdlite: kernels:"
# a build is a few seconds of one compiler process; this bounds a hung one
BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | str] = {}
# libraries compiled by this process (the rest came from the cache)
COMPILES = 0


class KernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here (the message says why)."""


def notice(message: str) -> None:
    """One line on stderr, once per process for each message."""
    notice_once(f"{PREFIX} {message}")


def disabled(environ=None) -> bool:
    """True when ``SDLITE_KERNELS`` turns the hand-written kernels off (``off``, ``0``, ``false``, ``no``)."""
    environ = os.environ if environ is None else environ
    return environ.get("SDLITE_KERNELS", "").strip().lower() in ("off", "0", "false", "no")


def cpu_problem(required: tuple[str, ...], needs: str, cpu=None) -> str | None:
    """Why ``cpu`` (None: this one) cannot run a kernel that needs the flags ``required`` (``needs``: them in words,
    e.g. "AVX2 and FMA"), naming the missing flags and a oneDNN cap that hides them; None: it can."""
    from ..machine import this_cpu

    cpu = this_cpu() if cpu is None else cpu
    if not cpu.is_x86 or cpu.flags is None:
        return f"needs an x86 CPU with {needs} (this one: {cpu.arch})"
    missing = [f for f in required if not cpu.has(f)]
    if missing:
        capped = f" under ONEDNN_MAX_CPU_ISA={cpu.onednn_cap}" if cpu.onednn_cap and all(
            f in cpu.flags for f in required) else ""
        return f"this CPU has no {', '.join(missing)}{capped}"
    return None


def compiler(environ=None) -> str | None:
    """The C++ compiler to use: ``$CXX``, else ``g++``, else ``c++`` (the path found, or None)."""
    environ = os.environ if environ is None else environ
    for name in ([environ["CXX"]] if environ.get("CXX") else ["g++", "c++"]):
        found = shutil.which(name)
        if found:
            return found
    return None


def _version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"the C++ compiler {cxx} does not run ({type(e).__name__}: {e})") from e
    if out.returncode != 0:
        raise KernelUnavailable(f"the C++ compiler {cxx} does not run (`--version` exited {out.returncode})")
    return (out.stdout.splitlines() or [""])[0]


def kernel_dir() -> Path:
    from ..machine import cache_dir

    return cache_dir() / KERNEL_DIR


def library_path(name: str, isa_flags: tuple[str, ...], cxx: str) -> Path:
    """Where kernel ``name`` built with these flags by this compiler lives (whether built yet or not)."""
    here = Path(__file__).parent
    # the kernel's source and the package's headers it may include
    sources = [(here / f"{name}.cpp").read_bytes()] + [h.read_bytes() for h in sorted(here.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([*sources, _version(cxx).encode(), " ".join(FLAGS + isa_flags).encode()]))
    return kernel_dir() / f"{name}-{key.hexdigest()[:16]}.so"


def build(name: str, isa_flags: tuple[str, ...]) -> Path:
    """Compile ``name``.cpp unless its library is already in the cache; returns the library's path.

    Raises :class:`KernelUnavailable` (naming the compiler and its first error lines) when it cannot."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler found (g++ or c++ on PATH, or $CXX)")
    target = library_path(name, isa_flags, cxx)
    if target.exists():
        return target
    source = Path(__file__).parent / f"{name}.cpp"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot create the kernel cache folder {target.parent} ({e})") from e
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, *isa_flags, str(source), "-o", tmp]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"{Path(cxx).name} could not build {source.name} ({type(e).__name__}: {e})") from e
        if out.returncode != 0:
            first = " / ".join(line for line in out.stderr.splitlines() if "error" in line)[:400]
            raise KernelUnavailable(f"{Path(cxx).name} could not build {source.name}: {first or out.stderr[:400]}")
        os.replace(tmp, target)
        global COMPILES
        COMPILES += 1
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# the argument types every attention kernel's entry point takes: q, k, v, out; B, H, N, M, D; the strides of q, k, v,
# out; scale, threads
ATTENTION_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5 + [ctypes.POINTER(ctypes.c_int64)] * 4 + \
    [ctypes.c_float, ctypes.c_int]


def library(name: str, isa_flags: tuple[str, ...], problem: str | None, fallback: str) -> ctypes.CDLL | str:
    """The loaded library of kernel ``name``, or why there is none (a string): turned off by ``SDLITE_KERNELS``, the
    CPU's ``problem`` with it (from :func:`cpu_problem`; None: none), or a build or load that failed, in
    which case one line on stderr says so and what runs instead (``fallback``, e.g. "bf16 attention runs on PyTorch's
    kernels")."""
    if disabled():
        return "turned off by SDLITE_KERNELS"
    if problem:
        return problem
    try:
        return load(name, isa_flags)
    except KernelUnavailable as e:
        notice(f"{fallback}: {e}")
        return str(e)


def load(name: str, isa_flags: tuple[str, ...]) -> ctypes.CDLL:
    """The loaded library of kernel ``name`` (built first if needed), once per process.

    Raises :class:`KernelUnavailable` when it cannot be built or loaded (and again on every later call, without
    trying again)."""
    with _lock:
        got = _loaded.get(name)
        if got is None:
            try:
                got = ctypes.CDLL(str(build(name, isa_flags)))
            except KernelUnavailable as e:
                got = str(e)
            except OSError as e:
                got = f"the built {name} library does not load ({e})"
            _loaded[name] = got
    if isinstance(got, str):
        raise KernelUnavailable(got)
    return got


def operator(name: str):
    """Decorator: ``fn`` registered as the PyTorch operator ``sdlite::<name>`` (CPU, mutating nothing), and returned
    as a function that calls ``fn`` itself unless a torch.compile trace or the profiler is watching.

    torch.compile needs the operator (it keeps the call whole), and the profiler names it. Eager calls skip it: an
    operator's first call imports ``torch._dynamo`` (its kernel runs under ``torch._dynamo.disable``), 0.9 s on a
    2-core machine that every cold process paid in its first image, and each call goes through the dispatcher's
    autograd and redispatch layers. The returned function carries the operator's ``register_fake``."""
    def wrap(fn):
        op = torch.library.custom_op(f"sdlite::{name}", mutates_args=(), device_types="cpu")(fn)

        @functools.wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled:
                return getattr(torch.ops.sdlite, name)(*args)
            return fn(*args)

        call.register_fake = op.register_fake
        return call
    return wrap
