"""LowBitLinear (dequantise a GGUF weight per call, then F.linear) against torch's weight-only int8 kernel.

    python bench/lowbit.py [--tokens 4096] [--inputs 3072] [--outputs 12288] [--repeat 3] [--int8pack-tokens 4096]
                          [--threads N]

At FLUX's MLP shape (4096 image tokens x 3072 -> 12288) and for bf16 and fp32 activations: the time to dequantise a
Q8_0 (and a Q4_K) weight, the dense F.linear, LowBitLinear's whole call, and ``torch._weight_int8pack_mm`` with the
same int8 values and one scale per output channel (the kernel's only form; Q8_0's per-32 scales would need one call
per block of 32 inputs, so this is the kernel's best case). The int8 kernel is slow on the CPU, so it can be run on
fewer tokens (``--int8pack-tokens``) and its time scaled to ``--tokens`` linearly (its cost is per token row).
Random weights; times are medians. The numbers are written into ``sdlite/engine/lowbit.py``'s docstring.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from sdlite.engine.lowbit import LowBitLinear
from sdlite.weights.quants import QuantizedTensor


def q8_0(out_features: int, in_features: int, gen: torch.Generator) -> tuple[QuantizedTensor, torch.Tensor]:
    """A random Q8_0 weight, and its int8 values (out, in)."""
    blocks = out_features * in_features // 32
    q = torch.randint(-127, 128, (blocks, 32), dtype=torch.int8, generator=gen)
    d = (torch.rand(blocks, 1, generator=gen) * 0.002 + 0.001).half()
    raw = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=1)
    return QuantizedTensor(raw, "Q8_0", (out_features, in_features)), q.view(out_features, in_features)


def random_k(name: str, out_features: int, in_features: int, gen: torch.Generator) -> QuantizedTensor:
    """Random bytes of a K type with finite fp16 scales (its d and dmin at bytes 0-3)."""
    size = {"Q4_K": 144}[name]
    raw = torch.randint(0, 256, (out_features * in_features // 256, size), dtype=torch.uint8, generator=gen)
    raw[:, 0:4] = torch.full((raw.shape[0], 2), 0.001).half().view(torch.uint8)
    return QuantizedTensor(raw, name, (out_features, in_features))


def timed(fn, repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--inputs", type=int, default=3072)
    ap.add_argument("--outputs", type=int, default=12288)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--int8pack-tokens", type=int, default=4096)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weight, q = q8_0(args.outputs, args.inputs, gen)
    q4k = random_k("Q4_K", args.outputs, args.inputs, gen)
    layer = LowBitLinear(weight)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; x {args.tokens} x {args.inputs}, "
          f"weight {args.outputs} x {args.inputs} (Q8_0 {weight.nbytes / 2**20:.1f} MiB)")
    for label in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[label]
        x = torch.randn(args.tokens, args.inputs, generator=gen).to(dtype)
        dense = weight.dequantize(dtype)
        t_deq = timed(lambda: weight.dequantize(dtype), args.repeat)
        t_deq4 = timed(lambda: q4k.dequantize(dtype), args.repeat)
        t_mm = timed(lambda: F.linear(x, dense), args.repeat)
        t_layer = timed(lambda: layer(x), args.repeat)
        print(f"{label}: dequantise Q8_0 {t_deq:.3f} s, Q4_K {t_deq4:.3f} s; F.linear {t_mm:.3f} s; "
              f"LowBitLinear {t_layer:.3f} s")
        # the int8 kernel: the same int8 values, one scale per output channel (its best case)
        n = min(args.int8pack_tokens, args.tokens)
        xs = x[:n].contiguous()
        scales = weight.dequantize(torch.float32).abs().amax(1) / 127
        per_channel = torch.clamp(torch.round(dense.float() / scales[:, None]), -127, 127).to(torch.int8)
        s = scales.to(dtype)
        t_pack = timed(lambda: torch._weight_int8pack_mm(xs, per_channel, s), 1) * args.tokens / n
        got = torch._weight_int8pack_mm(xs, per_channel, s).float()
        want = F.linear(xs, dense).float()
        err = ((got - want).norm() / want.norm()).item()
        scaled = f" (run on {n} tokens, scaled)" if n < args.tokens else ""
        print(f"{label}: _weight_int8pack_mm per-channel {t_pack:.2f} s{scaled}; relative error against the Q8_0 "
              f"product {err:.2e} (per-channel int8 cannot hold Q8_0's per-32 scales)")
    del q


if __name__ == "__main__":
    main()
