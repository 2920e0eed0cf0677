"""Winograd F(2x2,3x3) (sdlite.engine.winograd) against the direct convolutions, layer by layer.

    python bench/winograd.py                    natively
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/winograd.py --isa-label avx2     the AVX2 paths

(`make bench` runs both into bench/winograd.md.)
For the UNet's (batch 2, cfg) and the VAE's (batch 1) 3x3 shapes that sdlite.engine.winograd.eligible takes
(against prepacked layers, and with wide=True against plain ones):
ms per call (median of 7, 2 threads) of PyTorch's convolution ("plain"), the prepacked oneDNN convolution
(sdlite.engine.packing, "packed") and Winograd, and Winograd's largest difference from a float64 convolution,
relative to the output's largest value. Prints markdown.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from profile_unet import _median_time  # noqa: E402
from sdlite.engine.winograd import eligible, winograd_conv2d  # noqa: E402

# (batch, in, out, side); the rows from (2, 1280, 1280, 16) on are taken only where the weights stay plain
# (eligible(..., wide=True)), so their figure to read there is plain / Winograd
SHAPES = [(2, 320, 320, 64), (2, 960, 320, 64), (2, 640, 640, 64), (2, 640, 640, 32), (2, 1920, 640, 32),
          (2, 640, 640, 16), (1, 512, 512, 64), (1, 512, 512, 128), (1, 512, 512, 256),
          (2, 1280, 1280, 16), (2, 2560, 1280, 16), (2, 1280, 1280, 8), (2, 2560, 1280, 8),
          (1, 512, 256, 256), (1, 256, 256, 256), (1, 256, 256, 512)]


def _median_ms(fn) -> float:
    return _median_time(fn, 7) * 1e3


def main():
    label = sys.argv[sys.argv.index("--isa-label") + 1] if "--isa-label" in sys.argv else "native"
    torch.set_num_threads(2)
    torch.manual_seed(0)
    print(f"\n### {label} (torch CPU capability {torch.backends.cpu.get_cpu_capability()}, 2 threads)\n")
    print("| layer (batch, in -> out, side) | taken | plain ms | packed ms | Winograd ms | plain / Winograd "
          "| best direct / Winograd | error |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for n, c, k, side in SHAPES:
            x = torch.randn(n, c, side, side).contiguous(memory_format=torch.channels_last)
            w, b = torch.randn(k, c, 3, 3) / (c * 9) ** 0.5, torch.randn(k)
            packed = torch.ops.mkldnn._reorder_convolution_weight(w, [1, 1], [1, 1], [1, 1], 1, None)
            ref = F.conv2d(x.double(), w.double(), b.double(), padding=1)
            err = ((winograd_conv2d(x, w, b).double() - ref).abs().max() / ref.abs().max()).item()
            plain = _median_ms(lambda: F.conv2d(x, w, b, padding=1))
            pk = _median_ms(lambda: torch.ops.mkldnn._convolution_pointwise(x, packed, b, [1, 1], [1, 1], [1, 1], 1,
                                                                             "none", [], ""))
            wino = _median_ms(lambda: winograd_conv2d(x, w, b))
            conv = torch.nn.Conv2d(c, k, 3, padding=1, device="meta")
            taken = "always" if eligible(conv) else "plain weights only"
            print(f"| {n}, {c} -> {k}, {side} | {taken} | {plain:.1f} | {pk:.1f} | {wino:.1f} | {plain / wino:.2f}x "
                  f"| {min(plain, pk) / wino:.2f}x | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
