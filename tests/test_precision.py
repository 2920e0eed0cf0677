"""The precision policy (issue 25): what ``auto`` picks per device and CPU, the older options it absorbs, the
errors, and that the default stays inside its quality bound against ``exact`` on the demo model."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from sdlite.cli import main
from sdlite.config import DEMO, SD15, SDXL_BASE as SDXL
from sdlite.demo import DEFAULT_CFG, DEFAULT_PROMPT, DEFAULT_STEPS, model_path
from sdlite.machine import CPUInfo, this_cpu
from sdlite.engine.precision import (
    PrecisionError, auto_choice, check_precision, choose_precision, precision_report, resolve,
)
from sdlite.engine.quant import BF16Warning, QuantizeError
from sdlite.images import parse_infotext, read_parameters
from sdlite.pipeline import Engine, Request

AVX2 = frozenset({"sse4_1", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
ZEN4 = AVX512 | {"avx512_bf16"}
# bf16 forced on the demo, which auto keeps exact (the default there is exact: identical images, inside the issue's
# 35 dB bound for the default against exact, test_auto_keeps_small_models_exact). Its lowest PSNR of
# the 8 seeds depends on the CPU's bf16 kernels: 37.5 dB on a Zen 4 (avx512_bf16), 33.9 dB on an Intel Xeon with AMX
# (34.7 dB there with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16); its other seeds 38-49 dB there
FORCED_BF16_DEMO_DB = 32.0
FORCED_INT8_DEMO_DB = 30.0   # bf16-int8 forced on the demo, which auto keeps exact (see its test)


def cpu(flags, cap=None) -> CPUInfo:
    return CPUInfo(model="test cpu", arch="x86_64", cores=2, flags=frozenset(flags), onednn_cap=cap)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@pytest.mark.parametrize("flags,cap,expected", [
    (ZEN4, None, "bf16-int8"),                                         # native bf16, VNNI, sdlite's kernels
    (ZEN4 - {"avx512_vnni"}, None, "bf16"),                            # 7-bit int8 activations: bf16 alone
    (AVX512 | {"avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}, None, "bf16-int8"),
    (AVX512 | {"amx_tile", "amx_int8", "amx_bf16"}, None, "bf16"),     # no avx512_bf16: sdlite's kernels do not run
    (AVX2 | {"avx_vnni", "avx_vnni_int8", "avx_ne_convert"}, None, "bf16"),
    (AVX512, None, "fp32-fast"),        # bf16 would be emulated: fp32 on sdlite's AVX2 kernels
    (AVX2, None, "fp32-fast"),
    (ZEN4, "AVX2", "fp32-fast"),        # the cap leaves no bf16
    (ZEN4, "AVX512_CORE_VNNI", "fp32-fast"),
    (frozenset({"sse4_1", "avx"}), None, "exact"),                     # no AVX2: no fast path at all
    (ZEN4, "AVX512_CORE_BF16", "bf16-int8"),
])
def test_auto_per_cpu(flags, cap, expected):
    name, why = auto_choice("cpu", cpu(flags, cap))
    assert name == expected and why
    plan = resolve("auto", "cpu", cpu(flags, cap))
    assert (plan.name, plan.requested, plan.label) == (expected, "auto", f"{expected} (auto)")


def test_what_each_precision_computes_in():
    bf16 = resolve("bf16", "cpu", cpu(ZEN4))
    assert (bf16.dtype, bf16.vae_dtype, bf16.text_dtype, bf16.channels_last) == \
        (torch.bfloat16, torch.bfloat16, torch.bfloat16, True)
    exact = resolve("exact", "cpu", cpu(ZEN4))
    assert (exact.dtype, exact.vae_dtype, exact.text_dtype, exact.quantize) == (torch.float32,) * 3 + ("none",)
    assert resolve("int8", "cpu", cpu(AVX2)).quantize == "int8"
    mixed = resolve("bf16-int8", "cpu", cpu(ZEN4))
    assert (mixed.dtype, mixed.vae_dtype, mixed.text_dtype, mixed.channels_last, mixed.quantize) == \
        (torch.bfloat16, torch.bfloat16, torch.bfloat16, True, "bf16-int8")
    assert resolve("auto", "cuda").name == "fp16" and resolve("auto", "mps").dtype == torch.float16


def test_names_aliases_and_errors():
    assert check_precision("FP32") == "exact" and check_precision("bfloat16") == "bf16"
    with pytest.raises(PrecisionError, match=r"precision 'int3' is not valid: expected one of auto, exact, fp32-fast, bf16"):
        check_precision("int3")
    with pytest.raises(PrecisionError, match=r"bf16 needs bf16 kernels.*ONEDNN_MAX_CPU_ISA=AVX2.*--precision exact"):
        resolve("bf16", "cpu", cpu(ZEN4, "AVX2"))
    with pytest.raises(PrecisionError, match="'fp16' is for GPUs"):
        resolve("fp16", "cpu", cpu(ZEN4))
    with pytest.raises(PrecisionError, match="on cuda use fp16 or exact"):
        resolve("int8", "cuda")
    with pytest.warns(BF16Warning, match="no native bf16"):
        resolve("bf16", "cpu", cpu(AVX512))
    with pytest.raises(PrecisionError, match=r"'bf16-int8' needs native bf16.*ONEDNN_MAX_CPU_ISA=AVX2"):
        resolve("bf16-int8", "cpu", cpu(ZEN4, "AVX2"))
    with pytest.raises(PrecisionError, match=r"'bf16-int8' needs exact 8-bit int8 products"):
        resolve("bf16-int8", "cpu", cpu(ZEN4 - {"avx512_vnni"}))
    with pytest.raises(PrecisionError, match="on cuda use fp16 or exact"):
        resolve("bf16-int8", "cuda")


def test_older_options_name_a_precision():
    z4 = cpu(ZEN4)
    assert choose_precision(None, None, "none", "cpu", z4).name == "bf16-int8"       # nothing given: auto
    assert choose_precision(None, None, "bf16-int8", "cpu", z4).name == "bf16-int8"
    assert choose_precision(None, torch.float32, "none", "cpu", z4).name == "exact"
    assert choose_precision(None, torch.bfloat16, "none", "cpu", z4).name == "bf16"
    assert choose_precision(None, None, "int8", "cpu", z4).name == "int8"
    assert choose_precision(None, None, "bf16", "cpu", z4).name == "bf16"
    assert choose_precision("int8", None, "int8", "cpu", z4).name == "int8"           # agreeing: fine
    with pytest.raises(PrecisionError, match=r"precision 'exact' and the older dtype/quantize options .*'int8'"):
        choose_precision("exact", None, "int8", "cpu", z4)
    with pytest.raises(QuantizeError, match="quantize mode 'int3' is not valid"):
        choose_precision(None, None, "int3", "cpu", z4)


def test_info_system_says_what_auto_picks(capsys):
    assert main(["info", "--system"]) == 0
    out = capsys.readouterr().out
    chosen, why = auto_choice("cpu", this_cpu())
    assert f"precision:   auto -> {chosen} on this CPU: {why}" in out
    assert precision_report(cpu(AVX2))[0].startswith("precision:   auto -> fp32-fast")


# --- on the demo model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_engines():
    """(exact, bf16 or None where this CPU refuses bf16)"""
    exact = Engine.load(model_path(), precision="exact")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BF16Warning)
        try:
            return exact, Engine.load(model_path(), precision="bf16")
        except PrecisionError:
            return exact, None


def test_auto_keeps_small_models_exact():
    """bf16 does not pay on the demo's small UNet (32 channels): auto keeps it (and any UNet under 128) in fp32."""
    assert auto_choice("cpu", cpu(ZEN4), DEMO)[0] == "exact"
    assert auto_choice("cpu", cpu(ZEN4), SD15)[0] == "bf16-int8"
    assert auto_choice("cpu", cpu(ZEN4), SDXL)[0] == "bf16-int8"
    assert Engine.load(model_path()).precision.label == "exact (auto)"


def lowest_demo_psnr(exact: Engine, other: Engine) -> float:
    """The lowest PSNR of 8 seeds (100-107), ``other`` against ``exact``, at the demo's defaults."""
    worst = float("inf")
    for seed in range(8):
        r = Request(DEFAULT_PROMPT, seed=100 + seed, steps=DEFAULT_STEPS, cfg_scale=DEFAULT_CFG)
        a, b = (np.asarray(e.generate(r).images[0]) for e in (exact, other))
        worst = min(worst, psnr(a, b))
    return worst


def test_bf16_stays_inside_the_quality_bound_on_the_demo(demo_engines):
    """The lowest PSNR of 8 seeds, bf16 (what auto gives full-size models on CPUs with native bf16) forced on the
    demo, against exact, at the demo's defaults: at least :data:`FORCED_BF16_DEMO_DB` on every CPU measured. A CPU
    that cannot run bf16 refuses it."""
    exact, bf16 = demo_engines
    if bf16 is None:
        with pytest.raises(PrecisionError):
            Engine.load(model_path(), precision="bf16")
        return
    worst = lowest_demo_psnr(exact, bf16)
    print(f"demo, bf16 against exact: lowest PSNR of 8 seeds {worst:.1f} dB")
    assert FORCED_BF16_DEMO_DB <= worst < float("inf")


def test_bf16_int8_stays_inside_the_quality_bound_on_the_demo(demo_engines):
    """bf16-int8 (what auto gives full-size models on CPUs with native bf16, VNNI and sdlite's kernels), forced on
    the demo: the lowest PSNR of 8 seeds against exact; its int8 layers are really there. A CPU without native bf16
    and 8-bit int8 products refuses it.

    Not the demo's default (auto keeps it exact: identical images, the issue's 35 dB bound holds there), so the bound
    here is :data:`FORCED_INT8_DEMO_DB`: the 32-channel demo has int8's largest relative error (measured: 34.3 dB
    the lowest of these seeds, 40.2 dB of seeds 1-8; 32.3 dB since the text encoders compute in bf16 too; 29.8 dB
    with the UNet's upsamplers by int8 phases, not adopted; a broken quantization gives under 20 dB)."""
    from sdlite.engine.quant import Int8Conv2d, Int8Linear

    exact = demo_engines[0]
    try:
        mixed = Engine.load(model_path(), precision="bf16-int8")
    except PrecisionError as e:
        assert "bf16-int8" in str(e) and (this_cpu().onednn_cap or not this_cpu().native_bf16
                                          or not this_cpu().vnni)
        return
    unet = mixed.models.get("unet")
    assert sum(isinstance(m, (Int8Conv2d, Int8Linear)) for m in unet.modules()) > 20 and unet.dtype == torch.bfloat16
    worst = lowest_demo_psnr(exact, mixed)
    print(f"demo, bf16-int8 against exact: lowest PSNR of 8 seeds {worst:.1f} dB")
    assert FORCED_INT8_DEMO_DB <= worst < float("inf")


def test_memory_mode_0_turns_an_auto_bf16_int8_into_bf16():
    """int8 layers need the UNet whole; mode 0 streams it, so auto takes bf16 there; asked for by name, the engine
    refuses it saying why."""
    from sdlite.engine.memory import MemoryModeError
    from sdlite.engine.precision import whole_unet

    plan = resolve("auto", "cpu", cpu(ZEN4))
    assert plan.name == "bf16-int8"
    streamed = whole_unet(plan, streams=True)
    assert (streamed.name, streamed.label, streamed.quantize, streamed.dtype) == ("bf16", "bf16 (auto)", "none",
                                                                                   torch.bfloat16)
    assert "memory mode 0" in streamed.reason
    assert whole_unet(plan, streams=False) is plan
    asked = resolve("bf16-int8", "cpu", cpu(ZEN4))
    assert whole_unet(asked, streams=True) is asked
    try:
        resolve("bf16-int8", "cpu")
    except PrecisionError:
        return   # this CPU cannot run it at all
    with pytest.raises(MemoryModeError, match="needs the UNet loaded whole"):
        Engine.load(model_path(), precision="bf16-int8", memory_mode=0)


def test_bf16_engine_computes_in_bf16_channels_last(demo_engines):
    engine = demo_engines[1]
    if engine is None:
        return   # refused: checked above
    unet, vae = engine.models.get("unet"), engine.models.get("vae")
    assert unet.dtype == vae.dtype == torch.bfloat16
    assert unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert engine.models.get("text_encoder").dtype == torch.bfloat16   # the text encoders too


def test_png_parameters_record_the_precision(tmp_path):
    for precision, expected in (("exact", "exact"), (None, "exact (auto)")):   # the demo: exact under auto
        out = tmp_path / f"{precision}.png"
        argv = ["generate", "a red circle", "--steps", "2", "--seed", "1", "-o", str(out)]
        assert main(argv + (["--precision", precision] if precision else [])) == 0
        assert parse_infotext(read_parameters(out))["Precision"] == expected


def test_server_started_exact_answers_on_the_exact_path(demo_engines):
    from fastapi.testclient import TestClient

    from sdlite.server.app import create_app

    exact = demo_engines[0]
    with TestClient(create_app(engine_options={"precision": "exact"})) as c:
        body = c.post("/sdapi/v1/txt2img", json={"prompt": DEFAULT_PROMPT, "seed": 5, "steps": 4, "cfg_scale": 7.5,
                                                 "sampler_name": "Euler", "width": 64, "height": 64}).json()
        assert c.get("/sdapi/v1/cmd-flags").status_code == 200
    info = body["info"]
    assert "Precision: exact" in info
    import base64
    import io

    from PIL import Image

    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(body["images"][0]))).convert("RGB"))
    want = np.asarray(exact.generate(Request(DEFAULT_PROMPT, seed=5, steps=4, cfg_scale=7.5, sampler="euler",
                                             width=64, height=64)).images[0])
    assert np.array_equal(got, want)


def test_lora_on_bf16_channels_last_weights(demo_engines):
    """A LoRA merges into bf16 channels-last convolutions (their layout kept) and un-merges to the same bits."""
    engine = demo_engines[1]
    if engine is None:
        return   # refused here: checked above
    unet = engine.models.get("unet")
    convs = {n: m.weight.detach().clone() for n, m in unet.named_modules()
             if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)}
    r = Request(DEFAULT_PROMPT + " <lora:demo_teal:1>", seed=3, steps=DEFAULT_STEPS, cfg_scale=DEFAULT_CFG)
    with_lora = np.asarray(engine.generate(r).images[0])
    plain = np.asarray(engine.generate(r.replace(prompt=DEFAULT_PROMPT)).images[0])
    assert np.abs(with_lora.astype(int) - plain.astype(int)).mean() > 1   # the LoRA changed the picture
    after = dict(unet.named_modules())
    for name, before in convs.items():
        w = after[name].weight
        assert torch.equal(w, before) and w.is_contiguous(memory_format=torch.channels_last), name


def test_default_stays_inside_the_bound_on_full_size_sd15(sd15_folder):
    """The full-size SD 1.5 (random weights, PyTorch's default init): auto against exact, 2 seeds of a short
    generation at 128x128, PSNR >= 40 dB (the issue's bound; bench/precision.py measures 8 seeds at 256^2, 20 steps).
    Where auto is exact the images are the same. Kept at full size in the tests: what auto picks depends on the
    model's size (it keeps small models, the tiny ones and the demo, exact), and the reduced precision's error on
    the real shapes' widths and depths is the bound's subject, which no tiny model shows."""
    exact = Engine.load(sd15_folder, precision="exact")
    auto = Engine.load(sd15_folder)
    assert auto.precision.name == auto_choice("cpu")[0]
    for seed in (1, 2):
        r = Request("a red circle on a blue background", negative_prompt="blurry", width=128, height=128, steps=6,
                    seed=seed)
        a, b = (np.asarray(e.generate(r).images[0]) for e in (exact, auto))
        value = psnr(a, b)
        print(f"full-size SD 1.5, auto ({auto.precision.name}) against exact, seed {seed}: {value:.1f} dB")
        assert value >= 40.0
        if auto.precision.name == "exact":
            assert value == float("inf")


def test_loras_on_bf16_int8_are_quantized_again_and_undone(demo_engines):
    """The int8 layers of bf16-int8 (auto's choice for full-size models on CPUs with native bf16 and VNNI) keep no
    float weight: a LoRA's layers are quantized again from the file's weight plus the update for the request. The
    image with the demo's LoRA is as near the exact engine's image with it as plain images are (the demo's bf16-int8
    bound), the LoRA changed it, and after the request the engine's images are bit for bit the ones before it."""
    from sdlite.engine.quant import Int8Conv2d, Int8Linear

    try:
        mixed = Engine.load(model_path(), precision="bf16-int8")
    except PrecisionError:
        return   # a CPU that refuses bf16-int8 (checked above)
    unet = mixed.models.get("unet")
    int8 = {n: m for n, m in unet.named_modules() if isinstance(m, (Int8Conv2d, Int8Linear))}
    plain_request = Request(DEFAULT_PROMPT, seed=3, steps=DEFAULT_STEPS, cfg_scale=DEFAULT_CFG)
    lora_request = plain_request.replace(prompt=DEFAULT_PROMPT + " <lora:demo_teal:1>")
    before = np.asarray(mixed.generate(plain_request).images[0])
    with_lora = np.asarray(mixed.generate(lora_request).images[0])
    after = np.asarray(mixed.generate(plain_request).images[0])
    assert np.array_equal(before, after)
    assert all(unet.get_submodule(n) is m for n, m in int8.items())   # the original layers are back
    assert np.abs(with_lora.astype(int) - before.astype(int)).mean() > 5   # the LoRA changed the picture
    exact_lora = np.asarray(demo_engines[0].generate(lora_request).images[0])
    value = psnr(with_lora, exact_lora)
    print(f"demo with its LoRA, bf16-int8 against exact: {value:.1f} dB")
    assert FORCED_INT8_DEMO_DB <= value < float("inf")
