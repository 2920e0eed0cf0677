"""Graph compilation of the denoiser (a UNet or a transformer) with ``torch.compile`` (Inductor), per input shape,
cached on disk. Opt-in.

:class:`Compiled` runs a network's ``forward`` through ``torch.compile(..., dynamic=False)``: one graph per input
shape (a new size or batch compiles again), the network's weights graph *inputs*, not constants. Inductor's on-disk
caches -- the FX graph cache (the generated code of a graph, keyed by the graph, its inputs' shapes, strides and
dtypes, Inductor's configuration, the torch version and the CPU's ISA), the AOT autograd cache above it and the built
kernels -- go to ``inductor/`` in the user's cache folder (:func:`sdlite.engine.cpu.cache_dir`: ``$SDLITE_CACHE_DIR``,
else ``$XDG_CACHE_HOME/sdlite``, else ``~/.cache/sdlite``) unless the user set ``TORCHINDUCTOR_CACHE_DIR``. So only
the first process to meet a shape pays Inductor's compile; later ones trace the model with Dynamo again and load the
rest from the cache. Nothing in the key depends on the weights' values, so it is stable across processes (and
across checkpoints of one architecture).

Where compiling does not apply, the network runs eager, with one line on stderr that says why
(``sdlite: --compile: ...; running eager``): no C++ compiler (Inductor's CPU backend builds its kernels with its
``cpp.cxx`` setting: ``$CXX``, else ``g++``), memory mode 0 (the denoiser's weights are streamed block by block by
forward hooks, which swap its parameters while it runs), weights stored in another dtype and up-cast block by block
(the same hooks), the int8 UNet (its dynamic activation scales are read with ``.item()``: a graph break at every
layer). A compile that fails while running falls back to eager the same way, never a crash. Text encoders and VAEs
run eager. A transformer's int8 and low-bit Linears (``bf16-int8``'s oneDNN layers, a GGUF file's blocks, the ``int8``
/ ``int4`` precisions) run eager inside its graph (:func:`eager_layers`), and Inductor rounds each bf16 operation as
eager does (:data:`EMULATE_PRECISION_CASTS`). Prepacked fp32 weights
(:mod:`sdlite.engine.packing`, the ``exact`` precision's default on AVX-512 CPUs) cannot be compiled unfrozen
(Inductor's oneDNN lowering asserts that a packed weight is a graph constant): a UNet that will be compiled is built
with plain weights instead; the Winograd convolutions compile as they are.

Measured (``python bench/compile.py --freezing``; the SD 1.5 UNet of ``bench/cache/sd15-fp16`` as the bf16
precision runs it: bf16 weights, channels-last; 512x512, batch 2 (one CFG step); 2-core Zen 4 with AVX512-BF16,
torch 2.13, 2 threads; eager and compiled steps alternating in one process, median of 3 after a warm-up):

=====================================================  ====================  ====================
                                                       eager step            compiled step
=====================================================  ====================  ====================
first process (cold cache)                             3.72 s                3.70 s (0.99x)
second process (warm cache)                            3.48 s                3.45 s (0.99x)
=====================================================  ====================  ====================

* Compile time, the first call less one step: 62.5 s with a cold cache (FX graph and AOT autograd cache misses, 346
  extern calls, the C++ kernels built), 4.9 s in the next process (``fxgraph_cache_hit``, ``autograd_cache_hit``:
  Dynamo traces again, the rest comes from the cache).
* A whole 20-step sampling: 72 s eager, 134 s compiled with a cold cache, 76 s with a warm one. At the 1% measured
  (within this machine's noise) a warm compile pays back after about 115 steps. Compiling does not pay here, so it
  is **opt-in** (``--compile``) in ``generate``, ``serve`` and ``batch`` alike, long-lived or not.
* Why nothing is gained: an eager step spends 46% of its time in the flash-attention kernel, 31% in oneDNN
  convolutions and 17% in matmuls (``torch.profiler``); Inductor calls the very same kernels (``extern_kernels``)
  and fuses only what lies between them (GroupNorm + SiLU, GELU, residual adds, copies), about 5% of the step.
* Accuracy: the compiled bf16 UNet's output differs from eager bf16's by at most 0.023 at magnitude 1.66 (3 bf16
  ulp); on the demo UNet its error against fp32 is 3.8-4.5e-3 (relative, 5 inputs), eager bf16's 4.2-4.5e-3.
* The VAE decoder is not compiled: it is convolutions end to end, where Inductor has even less to fuse.
* Steps timed one run after the other misled: a first run measured 3.9 s eager, then 12 s compiled in both
  processes, because other work took the cores while the compiled steps ran (eager steps timed after the compile
  were as slow, 12.6 s). ``bench/compile.py`` alternates them for that reason.

The transformers (``python bench/compile_dit.py``; FLUX.1-schnell (1 double + 2 single blocks) and SD3.5 Medium (1
joint block) at the released widths, random weights, as ``bf16-int8`` (``auto`` on CPUs with native bf16 and
VNNI/AMX) and ``bf16`` prepare them; the same 2-core Zen 4; eager and compiled steps alternating, medians of 6 over a
first and a second process; bench/compile_dit.md):

=========================  =====================  =====================  =====================================
                           FLUX.1 512^2 / 1024^2  SD3.5 512^2 / 1024^2   compile: first / second process
=========================  =====================  =====================  =====================================
bf16-int8: compiled step   1.03x / 0.99x          0.94x / 0.93x          28-54 s / 5.6-7.1 s (17-23 graphs)
bf16: compiled step        0.99x / 1.00x          0.96x / 0.96x          28-40 s / 3.0-3.5 s (one graph)
=========================  =====================  =====================  =====================================

* FLUX.1 gains nothing: its step is the int8 or bf16 GEMMs and the attention kernel, which the graph calls as eager
  does; SD3.5's 4-7 % is its smaller products' share of norms, modulation and gates, which Inductor fuses. A warm
  compile pays back after some 25-35 steps at 1024^2, 150-270 at 512^2 (SD3.5; one block: the saving and Dynamo's
  tracing both grow with the depth). So it stays opt-in for the transformers too.
* In ``bf16-int8`` each int8 Linear is a graph break (:func:`eager_layers`): 17 graphs for one SD3.5 block, 23 for
  FLUX.1's three, each compiled once per process shape (identical blocks hit the FX graph cache).
* Accuracy, the step's output (relative L2, sigma 0.5): compiled against eager 3-6e-3 in bf16 (bf16's own distance
  from fp32: 8e-3-1.3e-2), 5e-3 (SD3.5) and 2e-2 (FLUX.1) in bf16-int8, where a changed rounding moves some
  activations' int8 codes; compiled and eager are the same distance from fp32 (to 2 digits) in every row.

Freezing (``torch._inductor.config.freezing``) is **off**, measured and checked:

* It costs the cache. The AOT autograd cache refuses any frozen graph (``autograd_cache_bypass``), so every process
  traces and lowers the graph again: in the SD 1.5 UNet's second process the first frozen call took 14.6 s more than
  a step (in the first run, on a loaded machine), an unfrozen one 4.9 s; cold, 80 s against 62 s. On fp32 weights the freezing passes also prepack them into oneDNN tensors, which the FX graph
  cache cannot pickle (``fxgraph_cache_bypass``): a tiny UNet's second process compiled in 24 s frozen against
  3.8 s unfrozen.
* It is a correctness trap for LoRAs: a weight changed in place is not seen by a frozen graph (measured: the old
  weights' output came back), and a weight replaced by a new tensor -- how :func:`sdlite.adapters.lora.merge` merges --
  recompiles the whole graph, for every LoRA applied and again when it is removed. Unfrozen, the graph takes the
  weights as inputs at every call: a merged LoRA changes the image, with no recompile (``tests/test_compile.py``).
* It gains nothing on the bf16 UNet: the frozen graph has the same fusions (960 pattern matches against 956) and no
  oneDNN weight prepacking (that pass took fp32 weights only). Its steps were timed while other work loaded the
  machine (7.3 s against 11.9 s eager, alternating), so there is no figure to set beside the idle ones above.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
from torch import nn

from ..errors import notice_once
from ..machine import cache_dir
from .packing import PackedConv2d, PackedLinear

INDUCTOR_DIR = "inductor"
# graphs kept per compiled function (one per input shape): Dynamo's default of 8 would run a long-lived server's
# ninth shape eager, silently
RECOMPILE_LIMIT = 64
FREEZING = False
# the networks that compile: the denoisers (a UNet, or a transformer: FLUX.1, SD3/3.5, Z-Image, FLUX.2, Qwen-Image)
COMPILED = ("unet", "transformer")
# Inductor keeps a fused chain of bf16 operations in fp32 unless told to round each step as eager does; with it the
# compiled transformer's bf16 output is eager's within rounding (0.6 % relative at FLUX.1's widths), without it 21 %
# away, all of it from ``t.to(bf16) * 1000`` (750 rounds to 752 in eager bf16, as in diffusers; fp32 keeps 750).
# The UNet's figures in the module's text were measured before this was set; fp32 graphs are not affected
EMULATE_PRECISION_CASTS = True
PREFIX = "sdlite: --compile:"



def notice(message: str) -> None:
    """One line on stderr, once per process for each message."""
    notice_once(f"{PREFIX} {message}")


def _inductor_default() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except Exception:
        return None
    return os.path.abspath(default_cache_dir())


def inductor_cache_dir(environ=None) -> Path:
    """Where Inductor's caches go: ``$TORCHINDUCTOR_CACHE_DIR`` when the user set it, else ``inductor/`` in the
    user's cache folder. (Inductor writes its own default, a folder in /tmp, into that variable the first time it
    looks for it: that value counts as unset.)"""
    environ = os.environ if environ is None else environ
    given = environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != _inductor_default():
        return Path(given)
    return cache_dir(environ) / INDUCTOR_DIR


def configure() -> Path:
    """Point Inductor's on-disk caches at :func:`inductor_cache_dir` (Inductor reads the variable whenever it looks
    for a cache, so this takes effect for every compile from now on), make sure the local caches are on, and raise
    Dynamo's limit of graphs per function to :data:`RECOMPILE_LIMIT`."""
    folder = inductor_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = True
    torch._inductor.config.emulate_precision_casts = EMULATE_PRECISION_CASTS
    torch._functorch.config.enable_autograd_cache = True
    dynamo = torch._dynamo.config
    if dynamo.recompile_limit < RECOMPILE_LIMIT:
        dynamo.recompile_limit = RECOMPILE_LIMIT
    if dynamo.accumulated_recompile_limit < 4 * RECOMPILE_LIMIT:
        dynamo.accumulated_recompile_limit = 4 * RECOMPILE_LIMIT
    return folder


def compiler_name() -> str:
    """The C++ compiler Inductor looks for (its ``cpp.cxx`` setting: ``$CXX`` when torch was imported, else g++)."""
    try:
        import torch._inductor.config as inductor_config

        names = [c for c in inductor_config.cpp.cxx if c] if isinstance(inductor_config.cpp.cxx, (list, tuple)) \
            else [inductor_config.cpp.cxx]
        return " or ".join(names) or "g++"
    except Exception:
        return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


@functools.cache
def compiler_problem() -> str | None:
    """Why Inductor cannot build kernels here (None: it can): no Inductor in this torch, or no C++ compiler that
    answers ``--version`` where Inductor looks for one."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    try:
        from torch._inductor import cpp_builder
    except Exception as e:  # a torch built without Inductor
        return f"Inductor is not available in torch {torch.__version__} ({type(e).__name__})"
    try:
        cpp_builder.get_cpp_compiler()
    except Exception:
        return f"no C++ compiler ({compiler_name()}) found"
    return None


def unavailable() -> str | None:
    """Why compiling cannot run in this process (None: it can): :func:`compiler_problem`, or Windows (Inductor's
    CPU backend wants a C++ toolchain set up by hand there)."""
    if sys.platform == "win32":
        return "Inductor's CPU backend needs a hand-configured C++ toolchain on Windows"
    return compiler_problem()


def _reason(error: BaseException) -> str:
    """The first line of a compile failure, short."""
    inner = error
    for _ in range(4):  # Dynamo wraps the backend's exception (BackendCompilerFailed.inner_exception)
        nxt = getattr(inner, "inner_exception", None) or inner.__cause__
        if nxt is None:
            break
        inner = nxt
    text = (str(inner).strip().splitlines() or [""])[0]
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


class Compiled:
    """``module.<method>`` through ``torch.compile`` (one graph per input shape), eager after a compile failure.

    A failure is the compiler's when the eager call with the same arguments succeeds: then one line says why and
    every later call runs eager. When eager fails too, the error is the caller's, and it is raised as eager raises
    it, compiling left on."""

    def __init__(self, module: nn.Module, name: str = "unet", method: str = "forward"):
        self.module, self.name, self.method = module, name, method
        self.failed: str | None = None
        self._fn = torch.compile(getattr(module, method), dynamic=False, fullgraph=False,
                                 options={"freezing": FREEZING})

    def __call__(self, *args, **kwargs):
        if self.failed is None:
            eager_layers(self.module)   # a LoRA may have put new int8 layers in since the last call
            try:
                return self._fn(*args, **kwargs)
            except Exception as e:
                out = getattr(self.module, self.method)(*args, **kwargs)  # raises the caller's own errors
                self.failed = _reason(e)
                notice(f"compiling the {self.name} failed ({self.failed}); running eager")
                return out
        return getattr(self.module, self.method)(*args, **kwargs)

    def __getattr__(self, name):  # dtype, config ...: the module's
        return getattr(self.module, name)


def eager_layers(module: nn.Module) -> int:
    """Mark ``module``'s int8 and low-bit Linears (:class:`~sdlite.engine.quant.Int8Linear`: oneDNN's opaque packed
    weight, per-token codes by sdlite's kernels; :class:`~sdlite.engine.lowbit.LowBitLinear`: GGUF / int8 / int4 codes
    decoded per call) to run eager inside a compiled graph: Dynamo breaks the graph around each, and Inductor compiles
    what lies between them (norms, modulation, rotary embedding, attention, gates, residuals). Traced, an Int8Linear
    fails Inductor's oneDNN lowering (an AssertionError: the packed weight is not a graph constant). Each layer is
    marked once (its ``forward`` replaced by the disabled one); returns how many were marked now."""
    from .lowbit import LowBitLinear
    from .quant import Int8Linear

    marked = 0
    for m in module.modules():
        if isinstance(m, (Int8Linear, LowBitLinear)) and "forward" not in vars(m):
            m.forward = torch.compiler.disable(m.forward, recursive=True)
            marked += 1
    return marked


def _prepare_kernels(module: nn.Module, name: str) -> None:
    """Build and load sdlite's bf16 kernels and settle the attention choice of ``name``'s kind before tracing (a
    trace measures nothing: it takes the choice already made, so a first call that is compiled would otherwise run
    PyTorch's attention where the kernel was measured faster)."""
    if any(p.dtype == torch.bfloat16 for p in module.parameters()):
        from ..kernels import bf16 as kernels
        kernels.prepare("unet" if name == "unet" else "dit")


def _start(module: nn.Module, name: str, method: str = "forward") -> Compiled:
    """A :class:`Compiled` of ``module``, after Inductor's caches are set (:func:`configure`) and sdlite's bf16
    kernels are built and loaded, so that the graphs call them (custom operators)."""
    configure()
    _prepare_kernels(module, name)
    return Compiled(module, name, method)


def compiled(module: nn.Module, name: str = "unet", method: str = "forward"):
    """``module.<method>`` compiled (a :class:`Compiled`), or the eager method where compiling is unavailable
    here (one line on stderr says why)."""
    problem = unavailable()
    if problem is not None:
        notice(f"{problem}; running eager")
        return getattr(module, method)
    return _start(module, name, method)


def blocker(manager, name: str, module: nn.Module | None = None) -> str | None:
    """Why network ``name`` of ``manager`` (a :class:`~sdlite.engine.memory.ModelManager`; ``module``: as built)
    runs eager however compiling is set (None: it can be compiled)."""
    if name not in COMPILED:
        return f"only the denoiser (a UNet or a transformer) is compiled, not the {name}"
    what = "UNet" if name == "unet" else "transformer"
    if module is not None and any(isinstance(m, (PackedConv2d, PackedLinear)) for m in module.modules()):
        return (f"the {what}'s weights are prepacked for oneDNN (prepack=True), which Inductor takes only as "
                "constants of a frozen graph")
    if manager._streams_from_file(name):
        return (f"memory mode 0 streams the {what}'s weights block by block with forward hooks, which swap its "
                "parameters while it runs: a compiled graph cannot follow them")
    if manager._streams(name):
        return (f"the {what}'s weights are kept in {manager.weight_dtype} and up-cast block by block by forward "
                "hooks, which a compiled graph cannot follow")
    if name == "unet" and manager.quantize != "none":
        return (f"the {manager.quantize} UNet reads its dynamic activation scales with .item(): a graph break at every "
                "layer")
    return None


def compiles(manager, name: str) -> bool:
    """Whether ``manager`` will run network ``name`` compiled (asked for, applicable, a compiler here): then the
    manager builds it with plain weights, not prepacked ones (which Inductor's oneDNN lowerings take only from a
    frozen graph: an unfrozen compile of them fails). The winograd convolutions compile as they are."""
    return bool(manager.compile) and blocker(manager, name) is None and unavailable() is None


def runner_for(manager, name: str, module: nn.Module):
    """What runs ``module`` for ``manager`` (see :meth:`~sdlite.engine.memory.ModelManager.runner`): its compiled
    forward, made once per module object and kept by the manager, or the module where compiling does not apply
    (then one line says why, once)."""
    held = manager._compiled.get(name)
    if held is not None and held.module is module:
        return held
    why = unavailable() or blocker(manager, name, module)
    if why is not None:
        notice(f"{why}; running eager")
        return module
    held = manager._compiled[name] = _start(module, name)
    return held
