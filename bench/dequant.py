"""Quantised weights decoded by sdlite's one-pass kernel (``sdlite/kernels/dequant.cpp``) against the PyTorch decoders
it replaced, and what that does to a LowBitLinear call (a GGUF, int8 or int4 layer: decode the weight, then F.linear).

    python bench/dequant.py [--shape 9216,3072] [--tokens 1536] [--types Q8_0,Q4_K,Q5_K,Q6_K,I8_ROW,I4_G64]
                            [--dtypes bf16,fp32] [--repeat 7] [--json FILE]

For each type and output dtype, in one process, the kernel and the PyTorch decoders alternate call by call (the
kernel switched off by replacing ``sdlite.kernels.dequant.decode`` with a refusal, as on a machine without it); cells
are medians of ``--repeat`` calls after a warm-up. The C heap is tuned as the engine tunes it
(``sdlite.engine.memory.tune_heap``), so each call's fresh output comes from the heap as in a sampling loop, not from
new pages. Random weights: GGUF types as random codes with finite fp16 scales, I8_ROW and I4_G64 quantised from a
Gaussian matrix. The default shape is FLUX.1's and klein's fused q/k/v projection (3072 -> 9216); ``--tokens`` 1536
is a 512^2 FLUX.1 step's 1024 image and 512 text tokens. Both decoders give the same bits
(tests/test_dequant_kernel.py), checked again here on each weight.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from sdlite.engine.lowbit import LowBitLinear
from sdlite.engine.memory import tune_heap
from sdlite.kernels import dequant
from sdlite.weights import quants
from sdlite.weights.quants import GGML_TYPES, QuantizedTensor

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def weight(name: str, out_features: int, in_features: int, gen: torch.Generator) -> QuantizedTensor:
    """A random ``name`` weight of shape (out_features, in_features)."""
    if name == "I8_ROW":
        return quants.quantize_int8_rows(torch.randn(out_features, in_features, generator=gen) * 0.02)
    if name.startswith("I4_G"):
        return quants.quantize_int4_groups(torch.randn(out_features, in_features, generator=gen) * 0.02,
                                           int(name[4:]))
    t = GGML_TYPES[name]
    blocks = out_features * in_features // t.block_size
    raw = torch.randint(0, 256, (blocks, t.type_size), dtype=torch.uint8, generator=gen)
    # every fp16 field of the block a small finite scale: the K types keep theirs at the start, except Q2_K (80),
    # Q3_K (108) and Q6_K (208)
    at = {"Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,)}.get(name, (0, 2) if name in ("Q4_1", "Q5_1", "Q4_K",
                                                                                          "Q5_K") else (0,))
    for a in at:
        raw[:, a:a + 2] = (torch.rand(blocks, 1, generator=gen) * 1e-3 + 1e-4).half().view(torch.uint8)
    return QuantizedTensor(raw.reshape(-1), name, (out_features, in_features))


class PyTorchDecoders:
    """Within it, QuantizedTensor.dequantize runs the PyTorch decoders (the kernel refuses every call)."""

    def __enter__(self):
        self.real = dequant.decode
        dequant.decode = lambda *args: False

    def __exit__(self, *exc):
        dequant.decode = self.real


def alternate(fns: dict[str, callable], repeat: int) -> dict[str, float]:
    """Each function warmed up once, then called in turn ``repeat`` times; the median seconds of each."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(name: str, dtype: torch.dtype, shape: tuple[int, int], tokens: int, repeat: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    qt = weight(name, *shape, gen)
    with PyTorchDecoders():
        reference = qt.dequantize(dtype)
    same = torch.equal(qt.dequantize(dtype), reference)
    layer = LowBitLinear(qt, torch.zeros(shape[0], dtype=dtype))
    x = torch.randn(tokens, shape[1], generator=gen).to(dtype)

    def torch_decode():
        with PyTorchDecoders():
            qt.dequantize(dtype)

    def torch_layer():
        with PyTorchDecoders():
            layer(x)

    t = alternate({"kernel decode": lambda: qt.dequantize(dtype), "torch decode": torch_decode,
                   "kernel layer": lambda: layer(x), "torch layer": torch_layer,
                   "dense linear": lambda: F.linear(x, reference)}, repeat)
    return dict(type=name, dtype=str(dtype).replace("torch.", ""), shape=list(shape), tokens=tokens, same_bits=same,
                bytes=qt.nbytes, seconds=t)


def report(rows: list[dict], args) -> str:
    cpu = "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    out = [f"Machine: {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
           f"{platform.machine()}; decoder: {dequant.status()}",
           f"Command: `python bench/dequant.py --shape {args.shape} --tokens {args.tokens} --types {args.types} "
           f"--dtypes {args.dtypes} --repeat {args.repeat}`", "",
           "| type | output | decode: kernel | decode: PyTorch | kernel / PyTorch | LowBitLinear: kernel | "
           "LowBitLinear: PyTorch | kernel / PyTorch | dense F.linear | same bits |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = {k: v * 1000 for k, v in r["seconds"].items()}
        out.append(f"| {r['type']} | {r['dtype']} | {s['kernel decode']:.1f} ms | {s['torch decode']:.1f} ms | "
                   f"{s['kernel decode'] / s['torch decode']:.2f}x | {s['kernel layer']:.1f} ms | "
                   f"{s['torch layer']:.1f} ms | {s['kernel layer'] / s['torch layer']:.2f}x | "
                   f"{s['dense linear']:.1f} ms | {'yes' if r['same_bits'] else 'NO'} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="9216,3072", help="out_features,in_features")
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--types", default="Q8_0,Q4_K,Q5_K,Q6_K,I8_ROW,I4_G64")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    args = ap.parse_args()
    tune_heap()
    shape = tuple(int(v) for v in args.shape.split(","))
    rows = [measure(name, DTYPES[d], shape, args.tokens, args.repeat)
            for name in args.types.split(",") for d in args.dtypes.split(",")]
    text = report(rows, args)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, report=text), f, indent=1)
    if not all(r["same_bits"] for r in rows):
        raise SystemExit("the kernel's values differ from the PyTorch decoders'")


if __name__ == "__main__":
    main()
