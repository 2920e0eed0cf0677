"""sdlite's hand-written CPU kernels (sdlite/kernels): the fused bf16 attention against fp32 attention and against
PyTorch's own bf16 kernel, where it is used and where not, its build cache, and the fallback without a compiler."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sdlite.machine import this_cpu
from sdlite.kernels import bf16 as kattn
from sdlite.kernels import build
from sdlite.models.layers import Attention

RUNS_HERE = kattn.cpu_problem() is None and build.compiler() is not None and not build.disabled()
# the AMX attention (amx_bf16.cpp) runs here: a CPU with AMX tiles, Linux granting them
AMX_HERE = RUNS_HERE and kattn.amx_problem() is None
# the attention kernels: "amx" where the CPU has tiles, "avx512" (AVX512-BF16 dot products) on every CPU that runs
# the kernels; on an AMX CPU the tests check both (kattn.use_amx picks)
KERNELS = ["avx512", "amx"]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Which attention kernel the test runs: "avx512", or "amx", which on a CPU without tiles checks that the
    AVX512-BF16 kernel runs instead and the reason names what is missing."""
    monkeypatch.setattr(kattn, "use_amx", request.param == "amx")
    if request.param == "amx" and RUNS_HERE and not AMX_HERE:
        assert "amx" in kattn.amx_problem().lower() or "tile" in kattn.amx_problem(), kattn.amx_problem()
        assert "AVX512-BF16" in kattn._attention_kernel()[2]
    return request.param
# (batch, heads, queries, keys, head dim): SD 1.x's three levels (head dims 40, 80, 160), self and cross
# (77 keys), SD 2.x/SDXL's 64, the VAE's single 512-wide head, and odd sizes (tails of every block; a last query block
# of 4 rows past the 8-row tiles; head dims whose last 16 columns hold at most 8, which two rows share, and more)
SHAPES = [(2, 8, 1024, 1024, 40), (2, 8, 1024, 77, 40), (2, 8, 256, 256, 80), (2, 8, 256, 77, 160),
          (2, 10, 256, 256, 64), (1, 1, 256, 256, 512), (2, 9, 277, 277, 13), (1, 5, 1000, 333, 40),
          (2, 2, 503, 1029, 33), (1, 8, 99, 1030, 40), (1, 8, 67, 1000, 8)]


def _qkv(b, h, n, m, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (B, tokens, h, D) transposed, as Attention lays them out
    q = (torch.randn(b, n, h, d, generator=g) * 2).bfloat16().transpose(1, 2)
    k = (torch.randn(b, m, h, d, generator=g) * 2).bfloat16().transpose(1, 2)
    v = torch.randn(b, m, h, d, generator=g).bfloat16().transpose(1, 2)
    return q, k, v


def _snr(x, ref):
    return 10 * math.log10(ref.pow(2).mean() / (x.float() - ref).pow(2).mean())


def test_cpu_problem_names_what_is_missing():
    flags = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})
    cpu = this_cpu().__class__(model="x", arch="x86_64", cores=2, flags=flags)
    assert "avx512_bf16" in kattn.cpu_problem(cpu)
    capped = this_cpu().__class__(model="x", arch="x86_64", cores=2, flags=flags | {"avx512_bf16"},
                                  onednn_cap="AVX2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in kattn.cpu_problem(capped)
    full = this_cpu().__class__(model="x", arch="x86_64", cores=2, flags=flags | {"avx512_bf16"})
    assert kattn.cpu_problem(full) is None
    # the AMX attention needs the tiles too; without them the AVX512-BF16 kernel runs
    assert "amx_tile" in build.cpu_problem(kattn.AMX_REQUIRED, "AMX-BF16", full)
    tiles = this_cpu().__class__(model="x", arch="x86_64", cores=2,
                                 flags=flags | {"avx512_bf16", "amx_tile", "amx_bf16"})
    assert build.cpu_problem(kattn.AMX_REQUIRED, "AMX-BF16", tiles) is None
    arm = this_cpu().__class__(model="x", arch="aarch64", cores=2, flags=frozenset({"asimd"}))
    assert "x86" in kattn.cpu_problem(arm)


def test_used_exactly_where_it_applies():
    """bf16 on a CPU with AVX512-BF16 (not capped): the kernel; fp32 (the exact path), problems too small to gain
    (the demo's at its default size), or a CPU without it: None."""
    q, k, v = _qkv(2, 8, 256, 77, 40)
    assert kattn.attend(q.float(), k.float(), v.float()) is None          # exact stays on PyTorch's kernel
    assert kattn.attend(*_qkv(2, 4, 64, 77, 16)) is None                  # the demo's attention at 64x64 px
    out = kattn.attend(q, k, v)
    assert (out is not None) == RUNS_HERE, kattn.status()
    assert ("GEGLU: sdlite's kernel" in kattn.status()) == RUNS_HERE
    if not RUNS_HERE:  # under ONEDNN_MAX_CPU_ISA=AVX2 (make test's second pass) the reason names the cap
        assert this_cpu().onednn_cap is None or "ONEDNN_MAX_CPU_ISA" in kattn.status() or \
            "avx512" in kattn.status()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_matches_fp32_as_closely_as_pytorchs_bf16_kernel(shape, kernel):
    b, h, n, m, d = shape
    q, k, v = _qkv(*shape)
    if not RUNS_HERE:  # e.g. under ONEDNN_MAX_CPU_ISA=AVX2: PyTorch's kernel, never a half-supported one
        assert kattn.attend(q, k, v) is None
        return
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).transpose(1, 2).reshape(b, n, h * d)
    torch_bf16 = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, h * d)
    ours = kattn.attend(q, k, v)
    assert ours.dtype == torch.bfloat16 and ours.shape == (b, n, h * d)
    # the same roundings as PyTorch's flash kernel (bf16 inputs, fp32 sums, bf16 probabilities and output):
    # ~55 dB against fp32 on these inputs, and within 0.5 dB of PyTorch's
    assert _snr(ours, ref) >= min(50.0, _snr(torch_bf16, ref) - 0.5), (_snr(ours, ref), _snr(torch_bf16, ref))
    assert (ours.float() - ref).abs().max() <= 2 * (torch_bf16.float() - ref).abs().max() + 1e-3


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_thread_counts_do_not_change_any_kernels_result(threads, kernel):
    """Every kernel splits its work over PyTorch's OpenMP threads (torch.set_num_threads); 1, 2, an odd 3 and more
    threads than cores give the same bits as one thread: each query row, GEGLU row and value is computed by one
    thread the same way, and every part of the work is done once (the min/max of a split is merged)."""
    q, k, v = _qkv(2, 3, 300, 200, 40)
    g = torch.Generator().manual_seed(3)
    value, gate = torch.randn(3001, 320, generator=g).bfloat16(), torch.randn(3001, 320, generator=g).bfloat16()
    x = (torch.randn(2, 64, 33, 31, generator=g) * 3).bfloat16().contiguous(memory_format=torch.channels_last)
    x[1, 5, 30, 30] = 40.0                                        # the maximum, in the last thread's part

    def results():
        return (kattn.attend(q, k, v), kattn.geglu_epilogue(value.clone(), gate, None), kattn.activation_range(x),
                kattn.activation_codes(x, 2.5, 128.5, 255.0))

    if not RUNS_HERE:
        assert results()[0] is None and results()[2] is None
        return
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = results()
        torch.set_num_threads(threads)
        more = results()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], more[0]) and torch.equal(one[1], more[1]) and torch.equal(one[3], more[3])
    assert one[2] == more[2] == (x.min().item(), 40.0)


def test_attention_layer_in_bf16_uses_it_and_stays_close_to_fp32(monkeypatch):
    from sdlite.models import layers

    monkeypatch.setenv(kattn.CHOICE_ENV, "kernel")   # the layer takes the kernel where it pays: here, by fiat
    used = []

    def counting(q, k, v):
        out = kattn.attend(q, k, v)
        used.append(out is not None)
        return out

    monkeypatch.setattr(layers, "attend", counting)
    torch.manual_seed(0)
    self_attn, cross = Attention(320, 8).eval(), Attention(320, 8, context_dim=768).eval()
    x, ctx = torch.randn(2, 256, 320), torch.randn(2, 77, 768)
    with torch.no_grad():
        ref = self_attn(x), cross(x, ctx)
        self_attn, cross, x, ctx = self_attn.bfloat16(), cross.bfloat16(), x.bfloat16(), ctx.bfloat16()
        got = self_attn(x), cross(x, ctx)
        kattn.enabled = False
        try:
            torch_path = self_attn(x), cross(x, ctx)
        finally:
            kattn.enabled = True
    # fp32: the layer does not ask; bf16: where the CPU runs it (without it the layer does not ask either)
    assert used[:2] == ([True, True] if RUNS_HERE else [])
    for g, t, r in zip(got, torch_path, ref):
        assert _snr(g, r) >= _snr(t, r) - 1.0 and _snr(g, r) > 35
    if not RUNS_HERE:
        assert all(torch.equal(g, t) for g, t in zip(got, torch_path))


def test_under_torch_compile_the_kernel_is_one_operator():
    """torch.compile keeps the kernel whole (a custom operator, no graph break)."""
    q, k, v = _qkv(1, 2, 256, 256, 40)
    assert kattn.prepare() == RUNS_HERE
    if not RUNS_HERE:
        return
    explained = torch._dynamo.explain(lambda a, b, c: kattn.attend(a, b, c) * 2)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert "attention_bf16" in str(explained.graphs[0].graph)
    x, w = torch.randn(2048, 64).bfloat16(), torch.randn(512, 64).bfloat16()
    explained = torch._dynamo.explain(lambda a, b: kattn.geglu(a, b, None) + 1)(x, w)
    assert explained.graph_break_count == 0 and "geglu_bf16" in str(explained.graphs[0].graph)


def test_eager_calls_skip_the_operator_and_torch_dynamo():
    """Outside torch.compile and the profiler a kernel is called directly: a custom operator's first call imports
    torch._dynamo (0.9 s that every cold process paid in its first image). Under the profiler the operator runs, so
    that it is named."""
    got = _run("""
        import sys, torch
        from sdlite.kernels import bf16 as kattn, build

        @build.operator("test_twice")
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @twice.register_fake
        def _(x):
            return torch.empty_like(x)

        x = torch.arange(4.0)
        q = torch.randn(1, 2, 256, 40).bfloat16()
        print("TWICE", twice(x).tolist())
        print("USED", kattn.attend(q, q, q) is not None)
        print("DYNAMO", "torch._dynamo" in sys.modules)
        with torch.profiler.profile() as p:
            twice(x)
            kattn.attend(q, q, q)
        print("PROFILED", sorted({e.name for e in p.events() if e.name.startswith("sdlite::")}))
    """, {})
    assert got.returncode == 0, got.stderr
    lines = dict(line.split(" ", 1) for line in got.stdout.splitlines() if " " in line)
    assert lines["TWICE"] == "[0.0, 2.0, 4.0, 6.0]" and lines["DYNAMO"] == "False", got.stdout
    used = lines["USED"] == "True"
    assert used == (RUNS_HERE and kattn.attention_pays()), got.stdout
    assert lines["PROFILED"] == str(sorted(["sdlite::test_twice"] + ["sdlite::attention_bf16"] * used)), got.stdout


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


PROBE = """
    import torch, torch.nn.functional as F
    from sdlite.kernels import bf16 as kattn, build
    q = torch.randn(1, 2, 256, 40).bfloat16()
    out = kattn.attend(q, q, q)
    print("USED" if out is not None else "FALLBACK", kattn.status())
    print("COMPILED", build.COMPILES)
"""


def test_kernels_share_pytorchs_openmp_runtime():
    """The kernel library binds to the OpenMP runtime PyTorch loaded (libgomp.so.1) rather than loading a second
    one whose threads would compete with PyTorch's (which spin for a while after every operator)."""
    got = _run("""
        import torch
        def gomp():
            return sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})
        before = gomp()
        from sdlite.kernels import bf16 as kattn
        q = torch.randn(2, 2, 512, 40).bfloat16()
        print("USED" if kattn.attend(q, q, q) is not None else "FALLBACK")
        print("BEFORE", before)
        print("AFTER", gomp())
        library = [line.split()[-1] for line in open("/proc/self/maps") if "avx512_bf16-" in line]
        data = open(library[0], "rb").read() if library else b""
        print("LINKED", b"libgomp.so.1" in data and b"GOMP_parallel" in data)
    """, {})
    assert got.returncode == 0, got.stderr
    lines = dict(line.split(" ", 1) for line in got.stdout.splitlines() if " " in line)
    assert ("USED" in got.stdout) == RUNS_HERE, got.stdout
    assert "libgomp" in lines["BEFORE"], got.stdout              # this project's PyTorch (the pip CPU build) uses it
    assert lines["AFTER"] == lines["BEFORE"], got.stdout
    assert lines["LINKED"] == str(RUNS_HERE), got.stdout          # the kernels' threads are OpenMP's, not their own


def test_build_is_cached_across_processes(tmp_path):
    env = {"SDLITE_CACHE_DIR": str(tmp_path)}
    first, second = _run(PROBE, env), _run(PROBE, env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    if not RUNS_HERE:  # nothing is built for a CPU that cannot run it
        assert "FALLBACK" in first.stdout and "COMPILED 0" in first.stdout
        assert not (tmp_path / build.KERNEL_DIR).exists()
        return
    # the AVX512-BF16 library, and where the CPU has AMX tiles the AMX attention's too
    assert "USED" in first.stdout and f"COMPILED {1 + AMX_HERE}" in first.stdout, first.stdout
    assert "USED" in second.stdout and "COMPILED 0" in second.stdout, second.stdout   # loaded from the cache
    assert ("sdlite's (AMX)" in first.stdout) == (AMX_HERE and "sdlite's" in first.stdout), first.stdout
    libraries = list((tmp_path / build.KERNEL_DIR).glob("avx512_bf16-*.so"))
    amx = list((tmp_path / build.KERNEL_DIR).glob("amx_bf16-*.so"))
    assert len(libraries) == 1 and len(amx) == AMX_HERE
    assert not list((tmp_path / build.KERNEL_DIR).glob(".*"))   # no temporaries left


def test_without_a_compiler_pytorchs_kernel_runs_and_one_line_says_why(tmp_path):
    env = {"SDLITE_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler"), "PATH": str(tmp_path)}
    got = _run(PROBE, env)
    assert got.returncode == 0, got.stderr
    assert "FALLBACK" in got.stdout
    if kattn.cpu_problem() is None:
        lines = [line for line in got.stderr.splitlines() if line.startswith(build.PREFIX)]
        assert len(lines) == 1 and "no C++ compiler" in lines[0], got.stderr


def test_turned_off_by_the_environment(tmp_path):
    got = _run(PROBE, {"SDLITE_CACHE_DIR": str(tmp_path), "SDLITE_KERNELS": "off"})
    assert got.returncode == 0 and "FALLBACK" in got.stdout and "SDLITE_KERNELS" in got.stdout, got.stdout
    assert not (tmp_path / build.KERNEL_DIR).exists()


def test_a_broken_build_names_the_compiler_error(tmp_path, monkeypatch):
    bad = tmp_path / "cxx"
    bad.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                   "echo 'attention_bf16.cpp:1: error: something went wrong' >&2; exit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    monkeypatch.setenv("SDLITE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(build.KernelUnavailable, match="something went wrong"):
        build.build(kattn.NAME, kattn.ISA_FLAGS)
    assert not list((tmp_path / "cache" / build.KERNEL_DIR).iterdir())   # nothing half-written left behind


# --- GEGLU --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,dim,bias", [(4096, 320, True), (1024, 640, True), (1500, 72, False),
                                             (1024, 40, True)], ids=str)
def test_geglu_matches_fp32_at_least_as_closely_as_pytorchs_bf16(tokens, dim, bias):
    from sdlite.models.unet import GEGLU

    torch.manual_seed(0)
    layer = GEGLU(dim, 4 * dim).eval()
    if not bias:
        layer.proj.bias = None
    x = torch.randn(2, tokens // 2, dim)
    with torch.no_grad():
        ref = layer(x)
        assert kattn.geglu(x, layer.proj.weight, layer.proj.bias) is None       # fp32 (exact): PyTorch's
        layer, xb = layer.bfloat16(), x.bfloat16()
        ours = kattn.geglu(xb, layer.proj.weight, layer.proj.bias)
        kattn.enabled = False
        try:
            torch_path = layer(xb)
        finally:
            kattn.enabled = True
    if not RUNS_HERE:
        assert ours is None
        return
    assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
    # one rounding instead of PyTorch's two (gelu's output, then the product): never worse than PyTorch's bf16
    assert _snr(ours, ref) >= _snr(torch_path, ref) - 0.1 and _snr(ours, ref) > 40, (_snr(ours, ref),
                                                                                     _snr(torch_path, ref))
    with torch.no_grad():
        assert torch.equal(layer(xb), ours)   # the layer takes this path


def test_geglu_gelu_is_the_exact_erf_form():
    """The epilogue's GELU against float64's erf GELU over the whole bf16 range that matters (|x| <= 12)."""
    if not RUNS_HERE:
        assert kattn.geglu(torch.randn(4096, 2).bfloat16(), torch.eye(2).bfloat16(), None) is None
        return
    gate = torch.linspace(-12, 12, 1024 * 16).bfloat16()
    x = torch.stack([torch.ones_like(gate), gate], dim=1)                            # (tokens, 2): [1, gate]
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).bfloat16()
    got = torch.ops.sdlite.geglu_bf16(x, weight, None).float().squeeze(1)
    want = F.gelu(gate.double()).float()
    # rounded once to bf16: within half a bf16 step (2^-9 relative) plus the erf approximation's 1.5e-7
    assert ((got - want).abs() <= want.abs() * 2 ** -8 + 1e-6).all()


def test_geglu_small_problems_stay_on_pytorch():
    w = torch.randn(2560, 320).bfloat16()
    assert kattn.geglu(torch.randn(2, 256, 320).bfloat16(), w, None) is None          # 512 tokens
    assert kattn.geglu(torch.randn(2, 64, 320).bfloat16(), w, None) is None


# --- int8 activations (the bf16-int8 precision) -------------------------------------------------------------------


def _reference_codes(x, bits):
    """sdlite.engine.quant.quantize_activation on PyTorch's operations alone (the kernels turned off)."""
    from sdlite.engine import quant

    kattn.enabled = False
    try:
        return quant.quantize_activation(x, bits)
    finally:
        kattn.enabled = True


@pytest.mark.parametrize("shape,channels_last", [((2, 320, 64, 64), True), ((2, 4096, 320), False), ((3, 17), False),
                                                  ((1, 5, 7, 9), True), ((1000003,), False), ((1, 1), False)],
                         ids=str)
@pytest.mark.parametrize("bits", [8, 7])
def test_activation_quantization_equals_pytorchs_arithmetic(shape, channels_last, bits):
    """The range and codes kernels give the same scale, zero point and codes (every one) as PyTorch's six passes in
    fp32, keep the input's memory format, and are used where they apply."""
    from sdlite.engine import quant

    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).bfloat16()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    quant._LAST.entry = None
    q, scale, zero_point = quant.quantize_activation(x, bits)
    ref_q, ref_scale, ref_zero_point = _reference_codes(x, bits)
    assert (scale, zero_point) == (ref_scale, ref_zero_point)
    assert torch.equal(q, ref_q) and q.stride() == x.stride() and q.dtype == torch.uint8
    assert (kattn.activation_range(x) is not None) == RUNS_HERE
    if RUNS_HERE:
        assert kattn.activation_range(x) == (x.min().item(), x.max().item())
    assert kattn.activation_range(x.float()) is None                          # fp32 (the int8 precision): PyTorch's


def test_activation_quantization_refuses_non_finite_input():
    from sdlite.engine import quant

    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(2, 64, 8, 8).bfloat16().contiguous(memory_format=torch.channels_last)
        x[1, 63, 7, 7] = bad
        with pytest.raises(FloatingPointError, match="non-finite"):
            quant.quantize_activation(x)


def test_an_input_read_twice_is_quantized_once_and_a_changed_one_again():
    """to_q, to_k and to_v of a self-attention read one tensor: the second call returns the first's codes; after an
    in-place change (or for another tensor) the codes are computed again."""
    from sdlite.engine import quant

    x = torch.randn(2, 256, 64).bfloat16()
    with torch.no_grad():
        first = quant.quantize_activation(x)
        assert quant.quantize_activation(x)[0] is first[0]
        x.mul_(2)
        again = quant.quantize_activation(x)
        assert again[0] is not first[0] and again[1] == pytest.approx(2 * first[1], rel=1e-6)
        assert quant.quantize_activation(x.clone())[0] is not again[0]


def test_geglu_epilogue_for_int8_halves_matches_pytorch():
    """GEGLU's epilogue on two separate products (the int8 projection's halves) against (value + b) * gelu(gate +
    b) in fp32."""
    torch.manual_seed(0)
    value, gate = torch.randn(2048, 320).bfloat16(), torch.randn(2048, 320).bfloat16()
    bias = torch.randn(640)
    want = (value.float() + bias[:320].bfloat16().float()) * F.gelu(gate.float() + bias[320:].bfloat16().float())
    got = kattn.geglu_epilogue(value.clone(), gate, bias)
    assert got.dtype == torch.bfloat16 and _snr(got, want) > 40


def test_geglu_epilogue_hands_its_range_to_the_next_int8_layer():
    """The epilogue finds the range of what it writes (the stored bf16 values): the int8 layer that reads the result
    skips its min/max pass and gets the same scale and codes; a non-finite output is still refused; once the tensor
    changes, or another one comes, the range is found again."""
    from sdlite.engine import quant

    torch.manual_seed(1)
    value, gate = torch.randn(2048, 320).bfloat16(), torch.randn(2048, 320).bfloat16()
    out = kattn.geglu_epilogue(value, gate, torch.randn(640))
    if not RUNS_HERE:
        assert getattr(kattn._KNOWN, "entry", None) is None and kattn.activation_range(out) is None
        return
    known = kattn._KNOWN.entry
    assert known[0] is out and list(known[2:4]) == [out.min().item(), out.max().item()]
    quant._LAST.entry = None
    codes = quant.quantize_activation(out)
    assert kattn._KNOWN.entry is None                                           # used once
    ref = _reference_codes(out, 8)
    assert codes[1:] == ref[1:] and torch.equal(codes[0], ref[0])
    value[0, 0], gate[0, 0] = float("inf"), 1.0
    bad = kattn.geglu_epilogue(value, gate, None)
    quant._LAST.entry = None
    with pytest.raises(FloatingPointError, match="non-finite"):
        quant.quantize_activation(bad)
    fine = kattn.geglu_epilogue(torch.randn(2048, 320).bfloat16(), gate, None)
    fine.mul_(3)                                                                # changed after the epilogue
    assert kattn.activation_range(fine) == (fine.min().item(), fine.max().item())


def test_the_layer_takes_the_attention_measured_faster_here(monkeypatch, tmp_path):
    """Whether the kernel or PyTorch's SDPA runs a bf16 attention layer is measured once per machine and kept in
    the kernel cache folder; the environment variable settles it without measuring."""
    from sdlite.models import layers

    measure = kattn.measure_attention
    monkeypatch.setattr(build, "kernel_dir", lambda: tmp_path)
    monkeypatch.setattr(kattn, "_CHOICES", {})
    calls = []
    monkeypatch.setattr(kattn, "measure_attention", lambda: calls.append(1) or (10.0, 20.0))
    monkeypatch.delenv(kattn.CHOICE_ENV, raising=False)
    assert kattn.attention_pays() == RUNS_HERE
    if not RUNS_HERE:
        assert calls == [] and not (tmp_path / kattn.CHOICE_FILE).exists()
        return
    assert calls == [1] and "10.0 ms against PyTorch's 20.0 ms" in kattn.status()
    monkeypatch.setattr(kattn, "_CHOICES", {})            # a new process reads the measurement kept on disk
    monkeypatch.setattr(kattn, "measure_attention", lambda: calls.append(2) or (30.0, 20.0))
    assert kattn.attention_pays() and calls == [1] and "measured before" in kattn.status()
    (tmp_path / kattn.CHOICE_FILE).write_text("not json")  # a damaged cache: measured again, and rewritten
    monkeypatch.setattr(kattn, "_CHOICES", {})
    assert not kattn.attention_pays() and calls == [1, 2]
    assert "30.0" in (tmp_path / kattn.CHOICE_FILE).read_text()
    used = []
    monkeypatch.setattr(layers, "attend", lambda q, k, v: used.append(1) or kattn.attend(q, k, v))
    layer = Attention(320, 8).eval().bfloat16()
    x = torch.randn(2, 256, 320).bfloat16()
    with torch.no_grad():
        sdpa = layer(x)
        assert used == []                                  # measured slower here: PyTorch's SDPA
        monkeypatch.setenv(kattn.CHOICE_ENV, "kernel")
        kernel = layer(x)
    assert used == [1] and "SDLITE_BF16_ATTENTION=kernel" in kattn.status()
    assert _snr(kernel, sdpa.float()) > 35
    kernel_ms, pytorch_ms = measure(repeats=1)   # the real measurement runs and times both
    assert kernel_ms > 0 and pytorch_ms > 0


def test_transformers_attention_is_chosen_apart(monkeypatch, tmp_path):
    """A transformer's joint attention (sdlite.models.mmdit.attention: FLUX.1, SD3, FLUX.2, Qwen-Image) takes the
    kernel or PyTorch's SDPA by its own measurement, at a transformer's shape and kept under its own key, not the
    UNet's; fp32 and the exact path never take the bf16 kernel."""
    from sdlite.models import mmdit

    monkeypatch.setattr(build, "kernel_dir", lambda: tmp_path)
    monkeypatch.setattr(kattn, "_CHOICES", {})
    monkeypatch.delenv(kattn.CHOICE_ENV, raising=False)
    shapes = []

    def measure(repeats=5, shape=kattn.CHOICE_SHAPE):
        shapes.append(shape)
        return (10.0, 20.0) if shape == kattn.CHOICE_SHAPES["dit"] else (30.0, 20.0)   # faster for DiTs only

    monkeypatch.setattr(kattn, "measure_attention", measure)
    assert kattn.attention_pays("dit") == RUNS_HERE and not kattn.attention_pays("unet")
    if not RUNS_HERE:
        assert shapes == []
        return
    assert shapes == [kattn.CHOICE_SHAPES["dit"], kattn.CHOICE_SHAPE]
    assert "transformers' attention: sdlite's (measured now: 10.0 ms" in kattn.status()
    kept = (tmp_path / kattn.CHOICE_FILE).read_text()
    assert "dit (1, 24, 1024, 128)" in kept
    with pytest.raises(ValueError, match="attention kind 'vit'"):
        kattn.attention_choice("vit")
    used = []
    monkeypatch.setattr(kattn, "attend", lambda q, k, v: used.append(q.dtype) or kattn.attention_bf16(q, k, v))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 3, 64, generator=g).transpose(1, 2) for _ in range(3))   # strided, as FLUX's
    want = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 40, 192)
    assert torch.equal(mmdit.attention(q, k, v, False), want) and used == []          # fp32: PyTorch's
    got = mmdit.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), False)
    assert used == [torch.bfloat16] and got.shape == (2, 40, 192) and _snr(got, want) > 35
