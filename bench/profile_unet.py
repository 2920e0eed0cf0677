"""Where the UNet's time goes on this CPU, and how close each kind of work comes to the machine's peak.

    python bench/profile_unet.py [--size 512] [--out PATH]        (`make bench` runs it and embeds the result)

1. Layers alone: the SD 1.5 UNet's convolution and linear shapes, PyTorch's plain layers against the same
   layers with oneDNN-prepacked weights (sdlite.engine.packing), in GFLOP/s (median of 5). The best figure is
   taken as this machine's attainable fp32 peak.
2. One UNet step (batch 2, cfg on) on the full-size checkpoint of bench/checkpoint.py, profiled with plain and
   with prepacked weights, and (on CPUs with native bf16) in bf16 with PyTorch's and with sdlite's attention kernel,
   and (where it runs: native bf16 and VNNI/AMX) in bf16-int8: time, FLOPs and GFLOP/s per kind of work (convolution,
   linear, attention, the rest). bf16-int8's int8 layers are measured against the bf16 peak too, so they can pass
   100%; its activation quantization and GEGLU epilogue are sdlite's kernels called outside PyTorch's dispatcher, in
   the wall time but not in the table.
Prints markdown.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from sdlite.engine.cpu import bf16_int8_problem  # noqa: E402
from sdlite.machine import this_cpu  # noqa: E402
from sdlite.engine.packing import PackedConv2d, PackedLinear, prepack_model  # noqa: E402
from sdlite.engine.quant import quantize_model  # noqa: E402
from sdlite.kernels import bf16 as attention_kernel  # noqa: E402

KINDS = {
    "convolution": ("aten::mkldnn_convolution", "mkldnn::_convolution_pointwise", "aten::convolution_overrideable",
                    "onednn::qconv_pointwise"),
    "linear": ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise", "onednn::qlinear_pointwise"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm", "aten::baddbmm",
                  "aten::_softmax", "sdlite::attention_bf16"),
}
CONVS = [(320, 320, 64), (640, 640, 32), (1280, 1280, 16), (1280, 1280, 8)]  # (in, out, side), batch 2, 3x3
LINEARS = [(8192, 320, 320), (8192, 320, 2560), (8192, 1280, 320), (2048, 640, 640), (512, 1280, 1280)]


def _median_time(fn, n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def layer_table() -> tuple[list[str], float]:
    rows, best = [], 0.0
    torch.manual_seed(0)
    with torch.no_grad():
        for cin, cout, side in CONVS:
            conv = nn.Conv2d(cin, cout, 3, padding=1)
            x = torch.randn(2, cin, side, side)
            flops = 2 * 2 * cout * cin * 9 * side * side
            plain = flops / _median_time(lambda: conv(x)) / 1e9
            packed_conv = PackedConv2d(conv)
            xc = x.contiguous(memory_format=torch.channels_last)
            packed = flops / _median_time(lambda: packed_conv(xc)) / 1e9
            best = max(best, plain, packed)
            rows.append(f"| 3x3 conv {cin}->{cout}, {side}x{side} | {plain:.0f} | {packed:.0f} |")
        for m, k, n in LINEARS:
            linear = nn.Linear(k, n)
            x = torch.randn(m, k)
            flops = 2 * m * n * k
            plain = flops / _median_time(lambda: linear(x)) / 1e9
            packed_linear = PackedLinear(linear)
            packed = flops / _median_time(lambda: packed_linear(x)) / 1e9
            best = max(best, plain, packed)
            rows.append(f"| linear {k}->{n}, {m} tokens | {plain:.0f} | {packed:.0f} |")
    return rows, best


def _attention_flops(prof) -> float:
    total = 0.0
    for evt in prof.events():
        if evt.name in ("aten::_scaled_dot_product_flash_attention_for_cpu", "sdlite::attention_bf16") \
                and evt.input_shapes:
            q, k = evt.input_shapes[0], evt.input_shapes[1]
            b, h, lq, d = q
            total += 4 * b * h * lq * k[2] * d  # QK^T and PV, a multiply-add each
    return total


def bf16_peak() -> float:
    """GFLOP/s of the best of 5 2048^2 bf16 matmuls (this CPU's attainable bf16 peak, as the issue measured it)."""
    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    return 2 * 2048 ** 3 / _median_time(lambda: a @ b) / 1e9


def unet_profile(size: int, peak: float) -> list[str]:
    from checkpoint import build
    from sdlite.loader import open_model

    folder, _ = build()
    ckpt = open_model(folder)
    torch.manual_seed(0)
    x = torch.randn(2, 4, size // 8, size // 8)
    t = torch.tensor([500.0, 500.0])
    ctx = torch.randn(2, 77, ckpt.spec.unet.context_dim)
    lines = []
    with torch.no_grad():
        unet = ckpt.load("unet", torch.float32, "cpu")
        with FlopCounterMode(display=False) as counter:
            unet(x, t, ctx)
        counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
        flops = {"convolution": counts.get("aten.convolution", 0),
                 "linear": counts.get("aten.addmm", 0) + counts.get("aten.mm", 0)}
        configs = [("plain fp32 weights (as diffusers runs them)", None, peak),
                   ("prepacked fp32 weights (sdlite exact)", "prepack", peak)]
        bf16 = bf16_peak() if this_cpu().native_bf16 else None
        if bf16:
            configs.append((f"bf16 channels-last, attention in PyTorch's flash kernel (as a share of the bf16 peak, "
                            f"{bf16:.0f} GFLOP/s: the best 2048^2 bf16 matmul)", "bf16-sdpa", bf16))
            if attention_kernel.available():
                int8 = bf16_int8_problem() is None
                configs.append(("bf16 channels-last, attention in sdlite's kernel"
                                + ("" if int8 else " (sdlite auto here)"), "bf16", bf16))
                if int8:
                    configs.append(("bf16-int8, the 3x3 convolutions and transformer Linears in int8 (sdlite auto "
                                    "here; shares of the bf16 peak)", "bf16-int8", bf16))
        for label, change, peak in configs:
            if change == "prepack":
                unet = prepack_model(unet)
            elif change == "bf16-sdpa":
                unet = ckpt.load("unet", torch.bfloat16, "cpu").to(memory_format=torch.channels_last)
                x, ctx = x.to(torch.bfloat16), ctx.to(torch.bfloat16)
            elif change == "bf16-int8":
                unet = quantize_model(unet, "bf16-int8")
            attention_kernel.enabled = change != "bf16-sdpa"
            unet(x, t, ctx)  # warm-up
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                start = time.perf_counter()
                unet(x, t, ctx)
                wall = time.perf_counter() - start
            flops["attention"] = _attention_flops(prof)
            spent = {kind: 0.0 for kind in (*KINDS, "everything else")}
            for avg in prof.key_averages():
                kind = next((k for k, names in KINDS.items() if avg.key in names), "everything else")
                spent[kind] += avg.self_cpu_time_total / 1e6
            total = sum(spent.values())
            lines += ["", f"UNet step at {size}^2, batch 2, {label}: {wall:.2f} s wall "
                          f"({sum(flops.values()) / 1e9:.0f} GFLOP, {sum(flops.values()) / wall / 1e9:.0f} GFLOP/s, "
                          f"{sum(flops.values()) / wall / 1e9 / peak:.0%} of the peak above)", "",
                      "| work | time, s | share | GFLOP | GFLOP/s | of peak |", "|---|---|---|---|---|---|"]
            for kind, seconds in spent.items():
                f = flops.get(kind)
                rate = f"{f / seconds / 1e9:.0f} | {f / seconds / 1e9 / peak:.0%}" if f and seconds else "- | -"
                lines.append(f"| {kind} | {seconds:.2f} | {seconds / total:.0%} | "
                             f"{f / 1e9 if f else 0:.0f} | {rate} |")
    return lines


def report(size: int = 512) -> str:
    rows, peak = layer_table()
    lines = ["## Profile: where the UNet's time goes (`python bench/profile_unet.py`)", "",
             f"fp32, torch threads: {torch.get_num_threads()}. Layers alone, GFLOP/s (median of 5):", "",
             "| layer (batch 2) | plain | prepacked |", "|---|---|---|", *rows, "",
             f"Peak taken as the best of these: {peak:.0f} GFLOP/s."]
    lines += unet_profile(size, peak)
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    text = report(args.size)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
