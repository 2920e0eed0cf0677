"""machine and engine.cpu: what the CPU has (flags, caps) and the choices made from it, with injected CPUs and
caches."""
from __future__ import annotations

import json

import pytest
import torch

from sdlite import machine
from sdlite.engine import cpu as cpumod
from sdlite.engine.cpu import (
    PrepackChoice, bf16_support, int8_activation_bits, int8_bits_reason, int8_saturates, prepack_choice,
    quantize_notes, system_report,
)
from sdlite.machine import CPUInfo, cache_dir, detect, parse_cpuinfo, permitted_flags, this_cpu
from sdlite.engine.packing import prepack_available

ZEN4 = frozenset("fpu sse sse2 sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl "
                 "avx512_bf16 avx512vbmi avx512_vnni".split())
HASWELL = frozenset("fpu sse sse2 sse4_1 sse4_2 avx avx2 fma f16c".split())
ALDER_LAKE = HASWELL | {"avx_vnni"}
SKYLAKE_X = HASWELL | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
SAPPHIRE = ZEN4 | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "avx512_fp16"}
ARM = frozenset("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp".split())

CPUINFO_X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512_vnni
"""
CPUINFO_ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull asimddp
CPU implementer\t: 0x41
"""


def fake(flags, cap=None, arch="x86_64", model="Test CPU", threads=2, onednn=True) -> CPUInfo:
    return CPUInfo(model=model, arch=arch, cores=4, flags=flags, onednn_cap=cap, torch_version="2.13.0",
                   torch_capability="AVX2", onednn=onednn, threads=threads)


# --- flags and caps ---------------------------------------------------------------------------------------


def test_parse_cpuinfo():
    assert parse_cpuinfo(CPUINFO_X86) == ("AMD EPYC 9654 96-Core Processor",
                                          frozenset("fpu sse sse2 avx avx2 fma avx512f avx512_vnni".split()))
    model, flags = parse_cpuinfo(CPUINFO_ARM)
    assert model is None and "asimd" in flags
    assert parse_cpuinfo("") == (None, None) and parse_cpuinfo("garbage\n\x00::\n") == (None, None)


def test_caps_restrict_the_flags():
    assert permitted_flags(None) is None and permitted_flags("ALL") is None and permitted_flags("default") is None
    avx2 = permitted_flags("AVX2")
    assert {"avx2", "fma", "avx"} <= avx2 and not avx2 & {"avx512f", "avx512_vnni", "avx_vnni", "amx_int8"}
    assert "avx512_vnni" in permitted_flags("avx512_core_vnni") and "avx512_bf16" not in permitted_flags(
        "AVX512_CORE_VNNI")
    assert "avx_vnni" in permitted_flags("AVX2_VNNI") and "avx512f" not in permitted_flags("AVX2_VNNI")
    assert "amx_int8" in permitted_flags("AVX10_1_512_AMX")
    assert permitted_flags("NOT_A_LEVEL") is None                     # oneDNN ignores values it does not know


@pytest.mark.parametrize("flags, cap, level, vnni, bf16, bits, prepack", [
    (ZEN4, None, "AVX512_CORE_BF16", True, "native", 8, True),
    (ZEN4, "AVX2", "AVX2", False, "none", 7, False),
    (ZEN4, "AVX512_CORE", "AVX512_CORE", False, "emulated", 7, True),
    (ZEN4, "AVX512_CORE_VNNI", "AVX512_CORE_VNNI", True, "emulated", 8, True),
    (HASWELL, None, "AVX2", False, "none", 7, False),
    (ALDER_LAKE, None, "AVX2_VNNI", True, "none", 8, False),
    (ALDER_LAKE, "AVX2", "AVX2", False, "none", 7, False),
    (SKYLAKE_X, None, "AVX512_CORE", False, "emulated", 7, True),
    (SAPPHIRE, None, "AVX512_CORE_AMX", True, "native", 8, True),
    (SAPPHIRE, "AVX512_CORE", "AVX512_CORE", False, "emulated", 7, True),  # avx_vnni: a side branch, left out
])
def test_decisions_from_flags(flags, cap, level, vnni, bf16, bits, prepack, tmp_path):
    cpu = fake(flags, cap)
    assert cpu.isa_level == level and cpu.vnni == vnni and bf16_support(cpu) == bf16
    assert cpu.native_bf16 == (bf16 == "native")
    assert int8_activation_bits(cpu) == bits
    assert int8_activation_bits(cpu, saturates=True) == 7              # a probe that saw saturation always wins
    assert f"{bits}-bit" in int8_bits_reason(cpu)

    def measure():
        raise AssertionError("the flags settle it: nothing to measure")

    choice = prepack_choice(cpu, cache=tmp_path / "cpu.json", measure=measure)
    assert choice.use == prepack and choice.source == "flags"
    assert not (tmp_path / "cpu.json").exists()
    notes = quantize_notes(cpu)
    assert set(notes) == {"none", "int8", "int8-bf16", "bf16", "bf16-int8"} and f"{bits}-bit" in notes["int8"]
    assert ("REFUSED" in notes["bf16"]) == (bf16 == "none") and ("emulated" in notes["bf16"]) == (bf16 == "emulated")
    mixed = bf16 == "native" and bits == 8                                # bf16-int8: native bf16 and 8-bit int8
    assert ("REFUSED" in notes["bf16-int8"]) == (not mixed)
    report = system_report(cpu)
    assert f"{bits}-bit" in "\n".join(report)
    listed = next(line for line in report if line.startswith("quantize:")).removeprefix("quantize:").strip()
    usable = listed.removesuffix(" available").split(", ")
    assert ("bf16" in usable) == (bf16 != "none") and ("bf16-int8" in usable) == mixed


def test_unknown_flags_and_other_architectures():
    unknown = fake(None)
    assert unknown.effective_flags is None and unknown.isa_level == "unknown" and not unknown.vnni
    assert int8_activation_bits(unknown) == 7                          # x86 without a probe: the safe range
    assert int8_activation_bits(unknown, saturates=False) == 8
    arm = fake(ARM, arch="aarch64")
    assert arm.isa_level == "unknown" and int8_activation_bits(arm) == 8
    assert int8_activation_bits(arm, saturates=True) == 7
    assert bf16_support(unknown) == bf16_support(arm) == "unknown"           # allowed: nothing says otherwise
    assert "unknown" in system_report(fake(None, arch="arm64"))[1]


def test_detect_reads_the_caps_from_the_environment(monkeypatch):
    monkeypatch.setattr(machine, "_os_cpu", lambda: ("Fake Zen 4", ZEN4))
    native = detect({})
    capped = detect({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"})
    assert native.model == capped.model == "Fake Zen 4"
    assert native.onednn_cap is None and capped.onednn_cap == "AVX2" and capped.aten_cap == "avx2"
    assert capped.flags == native.flags and "avx512_vnni" not in capped.effective_flags
    # the decisions differ as designed: 8 -> 7 activation bits, prepacking on -> off
    assert (int8_activation_bits(native), int8_activation_bits(capped)) == (8, 7)
    assert prepack_choice(native).use and not prepack_choice(capped).use
    assert native.key != capped.key
    assert detect({"DNNL_MAX_CPU_ISA": "AVX2"}).onednn_cap == "AVX2"        # oneDNN's older variable name


def test_detect_never_fails(monkeypatch):
    monkeypatch.setattr(machine.sys, "platform", "win32")
    cpu = detect({})
    assert cpu.flags is None and cpu.model and cpu.cores >= 1
    assert int8_activation_bits(cpu, saturates=False) in (7, 8)
    monkeypatch.setattr(machine.sys, "platform", "darwin")
    monkeypatch.setattr(machine, "_sysctl", lambda name: None)         # sysctl missing or silent
    assert detect({}).flags is None


def test_this_machine_flags_match_its_int8_kernels():
    """The flags' verdict on VNNI agrees with what oneDNN's kernels do here (natively and under
    ONEDNN_MAX_CPU_ISA=AVX2, which make test runs too): saturation exactly where there is no VNNI/AMX."""
    cpu = this_cpu()
    assert cpu.flags is not None and cpu.is_x86             # the supported machines are x86 Linux
    assert int8_saturates() is (not cpu.vnni)
    assert int8_activation_bits() == (8 if cpu.vnni else 7)


# --- the prepack measurement and its cache ----------------------------------------------------------------


class Counter:
    def __init__(self, plain=10.0, packed=8.0):
        self.calls, self.result = 0, (plain, packed)

    def __call__(self):
        self.calls += 1
        return self.result


def test_measurement_is_cached_once_per_key(tmp_path):
    path = tmp_path / "sub" / "cpu.json"
    arm = fake(ARM, arch="aarch64")
    measure = Counter(10.0, 8.0)
    first = prepack_choice(arm, cache=path, measure=measure)
    assert first.use and first.source == "measured" and (first.plain_ms, first.packed_ms) == (10.0, 8.0)
    assert "10.0 ms plain" in first.reason and "8.0 ms prepacked" in first.reason
    stored = json.loads(path.read_text())["prepack"]
    assert list(stored) == [arm.key] and stored[arm.key]["plain_ms"] == 10.0
    again = prepack_choice(arm, cache=path, measure=measure)
    assert measure.calls == 1 and again.source == "cached" and again.use and again.packed_ms == 8.0
    # another thread count, torch version or CPU is another key: measured again, kept beside the first
    other = fake(ARM, arch="aarch64", threads=8)
    assert other.key != arm.key
    slower = Counter(10.0, 12.0)
    assert not prepack_choice(other, cache=path, measure=slower).use and slower.calls == 1
    assert set(json.loads(path.read_text())["prepack"]) == {arm.key, other.key}
    assert prepack_choice(arm, cache=path, measure=slower).use and slower.calls == 1


@pytest.mark.parametrize("plain, packed, use", [(10.0, 12.0, False), (10.0, 10.0, False), (10.0, 9.8, False),
                                                (10.0, 9.0, True)])
def test_measured_choice_never_slower_than_plain(plain, packed, use, tmp_path):
    assert prepack_choice(fake(None), cache=tmp_path / "c.json", measure=Counter(plain, packed)).use == use


def test_unwritable_or_corrupt_cache_is_tolerated(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    path = blocker / "cpu.json"                                       # its parent is a file: cannot be written
    measure = Counter(10.0, 5.0)
    assert prepack_choice(fake(None), cache=path, measure=measure).use
    assert prepack_choice(fake(None), cache=path, measure=measure).source == "measured" and measure.calls == 2
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{ not json")
    assert prepack_choice(fake(None), cache=corrupt, measure=measure).source == "measured"
    assert fake(None).key in json.loads(corrupt.read_text())["prepack"]   # replaced by a good file
    corrupt.write_text(json.dumps({"prepack": {fake(None).key: {"plain_ms": "x"}}}))
    assert prepack_choice(fake(None), cache=corrupt, measure=measure).source == "measured"


def test_no_onednn_means_no_prepacking(tmp_path):
    choice = prepack_choice(fake(ZEN4, onednn=False), cache=tmp_path / "c.json", measure=Counter())
    assert choice == PrepackChoice(False, "unavailable", choice.reason) and "oneDNN" in choice.reason


def test_cache_dir():
    assert str(cache_dir({"SDLITE_CACHE_DIR": "/a/b", "XDG_CACHE_HOME": "/x"})) == "/a/b"
    assert cache_dir({"XDG_CACHE_HOME": "/x"}).parts[-2:] == ("x", "sdlite")
    assert cache_dir({}).parts[-2:] == (".cache", "sdlite")


def test_real_measurement_is_short_and_positive():
    import time

    t = time.perf_counter()
    plain, packed = cpumod.measure_prepack(repeat=1)
    assert plain > 0 and packed > 0
    assert time.perf_counter() - t < 30                 # about a second on 2 idle cores; generous for busy ones


def test_default_prepack_follows_the_flags_here():
    choice = cpumod.default_prepack()
    cpu = this_cpu()
    assert prepack_available() and choice.source == "flags"
    assert choice.use == cpu.avx512                     # AVX-512: yes; AVX2 only (or capped to it): no


# --- sdlite info --system ---------------------------------------------------------------------------------


def test_info_system(capsys):
    from sdlite.cli import main

    assert main(["info", "--system"]) == 0
    out = capsys.readouterr().out
    cpu = this_cpu()
    for text in ("cpu:", cpu.model, "isa flags:", "torch:", torch.__version__, cpu.torch_capability, "prepack:",
                 f"int8:        {int8_activation_bits()}-bit", "int8-bf16", "threads"):
        assert text in out, text
    assert ("yes" if cpumod.default_prepack().use else "no") in out.split("prepack:")[1].split("\n")[0]
    assert "path:" not in out                                     # no checkpoint asked for


def test_info_system_with_a_checkpoint(capsys):
    from sdlite.cli import demo_model_path, main

    assert main(["info", "--system", demo_model_path()]) == 0
    out = capsys.readouterr().out
    assert "prepack:" in out and "family:" in out


def test_manager_refuses_bf16_without_bf16_kernels_before_loading(monkeypatch):
    from sdlite.engine import quant
    from sdlite.engine.memory import ModelManager
    from sdlite.engine.quant import QuantizeError

    monkeypatch.setattr(quant, "bf16_support", lambda: "none")
    with pytest.raises(QuantizeError, match="needs bf16 kernels"):
        ModelManager(None, mode=1, quantize="int8-bf16")
    assert ModelManager(None, mode=1, quantize="int8").quantize == "int8"


def test_quantize_notes_name_every_quantize_mode_in_order():
    """system_report lists the usable modes in quantize_notes' order, which must be engine.quant's."""
    from sdlite.engine.quant import QUANTIZE_MODES

    assert list(quantize_notes(this_cpu())) == list(QUANTIZE_MODES)
