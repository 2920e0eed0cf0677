"""Hand-written CPU kernels for what PyTorch runs slowly, built on first use and cached.

Each kernel is one C++ file in this package, compiled with the system's C++ compiler into the user's cache folder
(``kernels/`` under :func:`sdlite.engine.cpu.cache_dir`) the first time a process needs it, and loaded with ctypes
(plain C entry points over tensor pointers: no Python headers, no PyTorch headers). Without a compiler, or on a
CPU without the instructions a kernel needs, PyTorch's own kernel runs instead and one line on stderr says why.

``SDLITE_KERNELS=off`` turns them all off (PyTorch's kernels everywhere), e.g. to measure what they gain.

* :mod:`sdlite.kernels.bf16` (``avx512_bf16.cpp``): fused attention and the GEGLU epilogue for AVX512-BF16 CPUs,
  used by every attention layer and GEGLU that computes in bf16 (the ``bf16`` precision; ``auto`` on such CPUs).
  Never on the ``exact`` (fp32) path.
* :mod:`sdlite.kernels.dequant` (``dequant.cpp``): GGUF's block types and sdlite's int8 / int4 ones decoded in one
  pass, for AVX2 CPUs; the same bits as the PyTorch decoders, so every precision (``exact`` too) uses it.
"""
