#!/usr/bin/env python
"""Train the demo upscaler: a small 4x SRVGGNetCompact for the shipped demo model's 64x64 pictures.

    python tools/train_demo_upscaler.py      # the pinned defaults: writes sdlite/data/upscalers/demo-4x.safetensors
    python tools/train_demo_upscaler.py --steps 50 --out build/demo-4x.safetensors   # a quick check

The demo model (``sdlite/data/demo``) draws one flat-coloured shape on a flat background at 64x64, as its training
images do (:mod:`sdlite.demo.data`). This script:

1. renders scenes of every (colour, shape, background) combination with the demo's own renderer at 256x256
   (anti-aliased: drawn at 4x and box-filtered down) and takes the 64x64 input by box-filtering (area averaging)
   that render, or -- for one input in three -- renders the scene at 64x64 directly, as the demo's training
   images were drawn (4x supersampled only, so its edges are slightly coarser); either is what the demo model's
   outputs look like, not a Lanczos or bicubic downscale. Each scene gives two 32x32 input crops (with their
   128x128 targets): one centred on a point of the shape's outline, one anywhere, since flat colour is easy and
   the edges are what there is to learn;
2. trains an SRVGGNetCompact (x4, 32 features, 8 convolutions: 89 k parameters; He-initialised for its PReLUs,
   the last convolution scaled by 0.1 so that it starts near the nearest-neighbour upscale it adds to) on the
   mean squared error, Adam at 2e-3 with a cosine decay, batches of 16 scenes (32 crops), all seeded. (L1, with
   or without a gradient term, and PyTorch's default initialisation both left the net at the nearest-neighbour
   upscale for hundreds of steps here: most pixels are flat, and L1's constant pull to zero there won.)
3. saves it in the canonical SRVGG layout (``body.N.weight`` / ``.bias``) in fp16 with safetensors metadata that
   names it, and reports its PSNR against the 256x256 renders next to Lanczos' on 16 scenes the training never
   saw.

Seeded: the same steps and thread count (2 by default) give the same file. On a 2-core CPU the default 1500 steps
take about 5 minutes (294 s when the shipped file was trained, on a busy machine). The shipped file (181 KB)
reported 36.28 dB against Lanczos' 32.72 dB (+3.56 dB); tests/test_demo_upscaler.py checks it on other scenes.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: far faster on a busy machine

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sdlite.demo import data as D  # noqa: E402
from sdlite.upscalers import DEMO_UPSCALER, SRVGGConfig, SRVGGNetCompact, load_upscaler, upscale  # noqa: E402
from sdlite.weights.safetensors import save_safetensors  # noqa: E402

CONFIG = SRVGGConfig(num_feat=32, num_conv=8, scale=4)
HR, LR = 256, 64
CROP = 32                    # input pixels per training crop
TRAIN_SEED = 20240601        # scenes for training; the report and the test use other seeds
REPORT_SEED = 7              # the scenes the closing report measures (tests/test_demo_upscaler.py uses its own)
DIRECT_SHARE = 1 / 3         # inputs rendered at 64x64 directly instead of box-filtered from the 256x256 render


def render_pair(scene: D.Scene, direct: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(256x256 target, 64x64 input) uint8 RGB of ``scene``."""
    hr = D.render(scene, HR)
    lr = D.render(scene, LR) if direct else np.asarray(Image.fromarray(hr).resize((LR, LR), Image.Resampling.BOX))
    return hr, lr


def batch(rng: np.random.Generator, scenes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (2 scenes, 3, CROP, CROP) and targets (2 scenes, 3, 4 CROP, 4 CROP) in [0, 1]."""
    inputs, targets = [], []
    for _ in range(scenes):
        hr, lr = render_pair(D.random_scene(rng, D.ALL_COMBOS), bool(rng.random() < DIRECT_SHARE))
        ys, xs = np.nonzero(np.abs(np.diff(lr.astype(np.int16), axis=0)).sum(2))   # where the colour changes
        for edge in (True, False):
            if edge and len(ys):
                i = rng.integers(len(ys))
                cy, cx = int(ys[i]), int(xs[i])
            else:
                cy, cx = (int(v) for v in rng.integers(LR, size=2))
            top, left = (min(max(c - CROP // 2, 0), LR - CROP) for c in (cy, cx))
            inputs.append(lr[top:top + CROP, left:left + CROP])
            targets.append(hr[4 * top:4 * (top + CROP), 4 * left:4 * (left + CROP)])

    def tensor(images):
        return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255

    return tensor(inputs), tensor(targets)


def init_weights(net: SRVGGNetCompact) -> None:
    """He initialisation for the PReLUs (slope 0.25 at the start); the last convolution 10 times smaller."""
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(m.weight, a=0.25, nonlinearity="leaky_relu")
                m.bias.zero_()
        net.body[-1].weight.mul_(0.1)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * math.log10(255 ** 2 / mse)


def report(path: Path, n: int = 16) -> tuple[float, float]:
    """Mean PSNR (dB) of the saved upscaler and of Lanczos against the 256x256 renders of ``n`` unseen scenes."""
    up = load_upscaler(path)
    rng = np.random.default_rng(REPORT_SEED)
    ours, lanczos = [], []
    for _ in range(n):
        hr, lr = render_pair(D.random_scene(rng, D.ALL_COMBOS))
        image = Image.fromarray(lr)
        ours.append(psnr(np.asarray(upscale(up, image)), hr))
        lanczos.append(psnr(np.asarray(image.resize((HR, HR), Image.Resampling.LANCZOS)), hr))
    return float(np.mean(ours)), float(np.mean(lanczos))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--scenes", type=int, default=16, help="scenes per batch (two crops each)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=TRAIN_SEED)
    p.add_argument("--out", type=Path, default=DEMO_UPSCALER)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    net = SRVGGNetCompact(CONFIG)
    init_weights(net)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.steps)
                                                                                  / args.steps)))
    params = sum(t.numel() for t in net.parameters())
    print(f"SRVGGNetCompact {CONFIG}: {params} parameters; {args.steps} steps of {args.scenes} scenes", flush=True)
    start = time.time()
    running = None
    for step in range(1, args.steps + 1):
        inputs, targets = batch(rng, args.scenes)
        loss = F.mse_loss(net(inputs), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == args.steps:
            print(f"step {step:5d}  loss {running:.6f}  {time.time() - start:6.1f} s", flush=True)
    seconds = time.time() - start

    args.out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().half().contiguous() for k, v in net.state_dict().items()}
    metadata = {
        "name": "sdlite demo 4x",
        "description": "4x upscaler for the sdlite demo model's 64x64 pictures of flat shapes; trained by "
                       "tools/train_demo_upscaler.py on the demo's own renderer",
        "architecture": "SRVGGNetCompact",
        "scale": str(CONFIG.scale),
        "num_feat": str(CONFIG.num_feat),
        "num_conv": str(CONFIG.num_conv),
        "steps": str(args.steps),
        "scenes_per_step": str(args.scenes),
        "seed": str(args.seed),
    }
    save_safetensors(state, args.out, metadata, overwrite=True)
    ours, lanczos = report(args.out)
    print(f"trained in {seconds:.0f} s; wrote {args.out} ({args.out.stat().st_size} bytes)")
    print(f"PSNR against the 256x256 renders, 16 unseen scenes: demo 4x {ours:.2f} dB, Lanczos {lanczos:.2f} dB "
          f"({ours - lanczos:+.2f} dB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
