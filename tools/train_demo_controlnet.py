#!/usr/bin/env python
"""Train the demo ControlNet ``demo-position``: it puts the shipped demo model's shape where a position map says.

    python tools/train_demo_controlnet.py             # the pinned defaults: writes sdlite/data/controlnets/demo-position/
                                                      # and docs/demo_controlnet.png
    python tools/train_demo_controlnet.py --eval-only # measure the saved ControlNet again and redraw the figure
    python tools/train_demo_controlnet.py --steps 40 --out build/demo-position   # a quick check

The demo model (``sdlite/data/demo``, trained by ``tools/train_demo.py``) draws one flat-coloured shape on a flat
background at 64x64, wherever its seed happens to put it. The control image here is a **position map**: a white
disc on black, as wide as the shape's bounding square, centred on the shape's centre of mass (its area centroid,
not its bounding box's centre: the two differ by a sixth of the height for a triangle). The prompt still says what
the shape is and its colours; the map says where it goes and how big it is. This script:

1. renders procedural scenes with the demo's own generator (:mod:`sdlite.demo.data`: ``random_scene``, ``render``,
   the training combinations and caption templates), and for each its position map, the disc drawn by the same
   renderer (a white circle on black, rescaled to 0..255), at the centroid of the shape's coverage (the shape
   rendered white on black);
2. encodes the images with the demo's VAE and the captions with its text encoder, both frozen, as
   ``tools/train_demo.py`` trained the model (:func:`train_demo.encode_all`, :func:`train_demo.caption_table`);
3. builds :class:`sdlite.models.controlnet.ControlNet` for the demo's UNet config and initialises it as the paper
   does (Zhang, Rao & Agrawala 2023): its time embedding, input convolution, down blocks and middle block are
   copies of the demo UNet's; the hint encoder's last convolution and every output ("zero") convolution start at
   zero, so at step 0 the controlled UNet is exactly the demo model;
4. trains the ControlNet alone (the UNet frozen, its residuals added as the engine adds them) on
   ``tools/train_demo.py``'s objective: eps-prediction on the model's scaled_linear schedule of 1000 steps, min-SNR
   weighting, caption dropout to the empty prompt (with the map kept, so the unconditional half of guidance knows
   the position too), AdamW with warm-up and cosine decay;
5. saves a diffusers ``ControlNetModel`` folder (``config.json`` + ``diffusion_pytorch_model.safetensors`` in
   fp16; the folder's config carries the demo's norm groups and heads, which a bare file's shapes do not tell),
   then loads it back through the engine and measures it: over seeds the evaluation alone uses, the drawn shape's
   centroid against the map's, with and without the ControlNet (:func:`measure`), and draws the figure of
   docs/controlnet.md.

Seeded: the same hyper-parameters and thread count give the same weights (the metadata records the time taken).
The shipped folder (737,904 parameters, 1.4 MiB) took 13.0 minutes on 2 threads of a shared 2-core CPU (load
average 2.1-5.4): 42 s of data, then 3000 steps of batch 64 at 0.245 s each, the eps-MSE going from 0.026 to 0.019.
A second run of the defaults gave the same tensors in 10.7 minutes (load average 1.4-3.9).
Its closing report (16 off-centre cases, seeds 4242 + i): the shape's centroid within 6 px of the map's in 16
cases (mean 0.49 px, farthest 0.82), against 1 of 16 without the ControlNet (mean 15.6 px); the classifier found
the prompt's colour, shape and background in 12 of the 16 with it, 16 without. tests/test_demo_controlnet.py
checks it on maps of its own. (Pilots on 4000 images: 1000 steps put 16 of 16 within 6 px, mean 0.94 px; 400 steps
at half the learning rate, 2 of 8.)
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: far faster on a busy machine

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import train_demo as T  # noqa: E402  (tools/train_demo.py: Log, hardware, rel, to_tensor, lr_at, encode_all, ...)
from sdlite.config import ControlNetConfig  # noqa: E402
from sdlite.demo import DEFAULT_CFG, DEFAULT_STEPS, model_path  # noqa: E402
from sdlite.demo import data as D  # noqa: E402
from sdlite.loader import open_model  # noqa: E402
from sdlite.models.controlnet import ControlNet  # noqa: E402
from sdlite.weights.safetensors import save_safetensors  # noqa: E402

NAME = "demo-position"
OUT = ROOT / "sdlite" / "data" / "controlnets" / NAME
WEIGHTS = "diffusion_pytorch_model.safetensors"
HINT_WIDTHS = (16, 16, 32, 32)     # 64 px -> 8 px (the latent), three stride-2 convolutions
EVAL_SEED = 4242                   # the closing report's scenes and seeds (tests/test_demo_controlnet.py: its own)
WITHIN_PX = 6.0
OFF_CENTRE = 8.0                   # evaluation positions: each coordinate at least this far from the middle


@dataclass(frozen=True)
class HParams:
    seed: int = 0
    threads: int = 2
    train_images: int = 10000
    steps: int = 3000
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    caption_dropout: float = 0.2
    min_snr_gamma: float = 5.0
    eval_images: int = 16


# --- the position map -------------------------------------------------------------------------------------------


def coverage(scene: D.Scene, size: int = D.IMAGE_SIZE) -> np.ndarray:
    """(size, size) float in [0, 1]: how much of each pixel the scene's shape covers (the demo's renderer, the shape
    white on black; its box filter is linear, so the grey level is the coverage)."""
    lo, hi = (np.array(D.COLOURS[c], np.float64).mean() for c in ("black", "white"))
    grey = D.render(dataclasses.replace(scene, colour="white", background="black"), size).astype(np.float64).mean(2)
    return ((grey - lo) / (hi - lo)).clip(0, 1)


def centroid(weights: np.ndarray) -> tuple[float, float]:
    """(x, y) of a weighted pixel mask, pixel centres at i + 0.5 (in the mask's pixels)."""
    ys, xs = np.mgrid[:weights.shape[0], :weights.shape[1]]
    total = weights.sum()
    return float((weights * (xs + 0.5)).sum() / total), float((weights * (ys + 0.5)).sum() / total)


def position_map(scene: D.Scene, size: int = D.IMAGE_SIZE) -> np.ndarray:
    """(size, size, 3) uint8: a white disc on black, the diameter of the scene's bounding square, centred on its
    shape's area centroid (drawn by the demo's renderer, stretched to 0..255)."""
    cx, cy = centroid(coverage(scene))          # in 64-px units, as Scene coordinates are
    disc = D.Scene("white", "circle", "black", cx, cy, scene.size)
    c = coverage(disc, size)
    return np.repeat((c * 255).round().astype(np.uint8)[:, :, None], 3, axis=2)


def make_data(hp: HParams):
    """Images, position maps (N, 64, 64, 3) uint8 and scenes of the training combinations."""
    images, scenes = D.make_dataset(hp.train_images, seed=hp.seed, combos=D.TRAIN_COMBOS)
    maps = np.stack([position_map(s) for s in scenes])
    return images, maps, scenes


# --- the network ---------------------------------------------------------------------------------------------------


def controlnet_from_unet(unet) -> ControlNet:
    """The paper's initialisation: the UNet's encoder half copied, the hint encoder's last convolution and every
    output convolution zero (the rest of the hint encoder: PyTorch's default initialisation, seeded)."""
    cn = ControlNet(ControlNetConfig(unet=unet.config, hint_widths=HINT_WIDTHS))
    missing, unexpected = cn.load_state_dict(unet.state_dict(), strict=False)
    assert all(k.startswith(("controlnet_cond_embedding.", "controlnet_down_blocks.", "controlnet_mid_block."))
               for k in missing), missing
    assert all(k.startswith(("up_blocks.", "conv_norm_out.", "conv_out.")) for k in unexpected), unexpected
    with torch.no_grad():
        for conv in (cn.controlnet_cond_embedding.conv_out, *cn.controlnet_down_blocks, cn.controlnet_mid_block):
            conv.weight.zero_()
            conv.bias.zero_()
    return cn


def train(hp: HParams, out: Path, log) -> dict:
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(hp.seed)
    torch.manual_seed(hp.seed)
    ckpt = open_model(model_path())
    te, unet, vae = ckpt.load("text_encoder"), ckpt.load("unet"), ckpt.load("vae")
    for m in (te, unet, vae):
        m.eval().requires_grad_(False)

    t = time.perf_counter()
    images, maps, scenes = make_data(hp)
    z_mean, z_logvar = T.encode_all(vae, images)
    combo_of = {c: i for i, c in enumerate(D.TRAIN_COMBOS)}
    combo_index = torch.tensor([combo_of[s.combo] for s in scenes])
    captions, empty = T.caption_table(ckpt.tokenizer())
    with torch.no_grad():   # every caption's context once: (combos, templates, 77, width)
        contexts = torch.stack([te(ids) for ids in captions])
        empty_context = te(empty[None])[0]
    hints = torch.from_numpy(maps).permute(0, 3, 1, 2).float().div(255)
    del images
    log(f"data: {len(scenes)} images of {len(D.TRAIN_COMBOS)} combinations with their position maps, encoded in "
        f"{time.perf_counter() - t:.1f}s; {contexts.shape[0] * contexts.shape[1]} caption contexts")
    times = {"data": time.perf_counter() - t}

    cn = controlnet_from_unet(unet).train()
    params = list(cn.parameters())
    n_params = sum(p.numel() for p in params)
    log(f"ControlNet: {n_params:,} parameters ({cn.control_config.residuals} residuals; hint widths {HINT_WIDTHS})")
    opt = torch.optim.AdamW(params, lr=hp.lr, betas=(0.9, 0.99), weight_decay=hp.weight_decay)
    template_p = torch.tensor([w for _, w in D.TEMPLATES], dtype=torch.float64)
    scale = ckpt.spec.vae.scaling_factor
    s = ckpt.scheduler_config
    loss_weight, sqrt_ab, sqrt_1mab = T.eps_objective(s, hp.min_snr_gamma)
    n, history = len(scenes), []
    t0 = time.perf_counter()
    for step in range(hp.steps):
        idx = torch.randint(n, (hp.batch,), generator=g)
        z0 = (z_mean[idx] + torch.exp(0.5 * z_logvar[idx]) * torch.randn(z_mean[idx].shape, generator=g)) * scale
        tt = torch.randint(s["num_train_timesteps"], (hp.batch,), generator=g)
        eps = torch.randn(z0.shape, generator=g)
        xt = sqrt_ab[tt].view(-1, 1, 1, 1) * z0 + sqrt_1mab[tt].view(-1, 1, 1, 1) * eps
        templ = torch.multinomial(template_p, hp.batch, replacement=True, generator=g)
        context = contexts[combo_index[idx], templ].clone()
        context[torch.rand(hp.batch, generator=g) < hp.caption_dropout] = empty_context
        for group in opt.param_groups:
            group["lr"] = hp.lr * T.lr_at(step, hp.steps, hp.warmup, hp.final_lr_fraction)
        control = cn(xt, tt.float(), context, hints[idx])
        pred = unet(xt, tt.float(), context, control=control)
        per_sample = (pred - eps).pow(2).mean(dim=(1, 2, 3))
        loss = (loss_weight[tt] * per_sample).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, hp.grad_clip)
        opt.step()
        history.append(per_sample.mean().item())
        if step % 50 == 0 or step == hp.steps - 1:
            el = time.perf_counter() - t0
            log(f"step {step:5d}/{hp.steps} eps-mse {np.mean(history[-50:]):.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{el / (step + 1):.3f}s/step eta {el / (step + 1) * (hp.steps - step - 1):.0f}s")
    times["training"] = time.perf_counter() - t0
    save(cn.eval(), out, hp, time.perf_counter() - t_start)
    train_s = time.perf_counter() - t_start
    log(f"training done in {train_s:.0f}s ({train_s / 60:.1f} min); saved {T.rel(out)} "
        f"({sum(f.stat().st_size for f in out.iterdir()) / 1024:.0f} KiB)")
    return {"train_s": train_s, "times": times, "params": n_params, "hardware": T.hardware(),
            "first_eps_mse": float(np.mean(history[:50])), "final_eps_mse": float(np.mean(history[-100:])),
            "load_average": f"{min(log.loads):.1f}-{max(log.loads):.1f}" if log.loads else "unknown"}


def save(cn: ControlNet, out: Path, hp: HParams, seconds: float) -> None:
    """A diffusers ControlNetModel folder, fp16, written beside ``out`` and moved into place."""
    tmp = out.with_name(out.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {**cn.control_config.to_diffusers(), "_diffusers_version": "0.30.0"}
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    state = {k: v.detach().half().contiguous() for k, v in cn.state_dict().items()}
    metadata = {"name": f"sdlite {NAME}", "format": "pt",
                "description": "ControlNet for the sdlite demo model: the shape goes where a position map (a white "
                               "disc on black, centred on the shape's centroid, as wide as the shape) puts it; "
                               "trained by tools/train_demo_controlnet.py",
                "training_time_s": f"{seconds:.0f}", "hparams": json.dumps(dataclasses.asdict(hp))}
    save_safetensors(state, tmp / WEIGHTS, metadata, overwrite=True)
    T.replace_folder(tmp, out)


# --- evaluation ----------------------------------------------------------------------------------------------------


def off_centre_scene(rng: np.random.Generator, combo, off: float = OFF_CENTRE) -> D.Scene:
    """A scene of ``combo`` away from the middle, where the demo model seldom draws on its own: a side of 28 to 34
    px, each coordinate of its centre at least ``off`` px from the image's centre (any quadrant), inside the
    demo's margins."""
    size = float(rng.uniform(28, 34))
    lo, hi = D.MARGIN + size / 2, D.IMAGE_SIZE - D.MARGIN - size / 2
    middle = D.IMAGE_SIZE / 2
    cx, cy = (middle + sign * float(rng.uniform(off, middle - lo)) for sign in rng.choice([-1, 1], 2))
    assert lo <= min(cx, cy) and max(cx, cy) <= hi
    return D.Scene(*combo, cx, cy, size)


def eval_cases(n: int, seed: int = EVAL_SEED) -> list[tuple[tuple[str, str, str], D.Scene, int]]:
    """``n`` (prompt combination, scene of the position map, generation seed): a red star on blue first (the
    docs/controlnet.md's), then training combinations of every shape in turn, each placed off centre
    (:func:`off_centre_scene`).
    """
    rng = np.random.default_rng(seed)
    combos = [("red", "star", "blue")]
    while len(combos) < n:
        shape = D.SHAPES[::-1][len(combos) % len(D.SHAPES)]       # star, triangle, square, circle, star ...
        choices = [c for c in D.TRAIN_COMBOS if c[1] == shape]
        combos.append(choices[rng.integers(len(choices))])
    return [(combo, off_centre_scene(rng, combo), seed + i) for i, combo in enumerate(combos)]


def shape_centroid(image, combo) -> tuple[float, float] | None:
    """(x, y) of the drawn shape: the pixels nearer the prompt's shape colour than its background colour, their
    largest 4-connected component (None: no such pixels)."""
    from scipy import ndimage

    a = np.asarray(image.convert("RGB"), np.float64)
    fg, bg = (np.array(D.COLOURS[c], np.float64) for c in (combo[0], combo[2]))
    mask = ((a - fg) ** 2).sum(2) < ((a - bg) ** 2).sum(2)
    labels, count = ndimage.label(mask)
    if count == 0:
        return None
    sizes = ndimage.sum(mask, labels, range(1, count + 1))
    return centroid((labels == 1 + int(np.argmax(sizes))).astype(np.float64))


def map_centroid(control) -> tuple[float, float]:
    """(x, y) of a position map: its brightness-weighted centroid."""
    return centroid(np.asarray(control.convert("L"), np.float64) / 255)


def distance(a, b) -> float:
    return math.inf if a is None or b is None else math.dist(a, b)


def measure(engine, controlnet, cases, steps: int = DEFAULT_STEPS, cfg: float = DEFAULT_CFG) -> dict:
    """For each case the image with the position map as the control and without it (same seed): the shape's
    centroid's distance from the map's, and whether the classifier sees what the prompt asks for."""
    from sdlite.control import ControlUnit
    from sdlite.demo.classify import classify
    from sdlite.pipeline import Request

    rows = []
    for combo, scene, seed in cases:
        control = Image.fromarray(position_map(scene))
        target = map_centroid(control)
        request = Request(D.prompt(combo), steps=steps, cfg_scale=cfg, seed=seed)
        plain = engine.generate(request).images[0]
        controlled = engine.generate(request.replace(controls=(ControlUnit(controlnet, control),))).images[0]
        rows.append({"combo": combo, "seed": seed, "target": target, "control": control, "plain": plain,
                     "controlled": controlled,
                     "with": distance(shape_centroid(controlled, combo), target),
                     "without": distance(shape_centroid(plain, combo), target),
                     "right": classify(controlled).combo == combo, "right_without": classify(plain).combo == combo})
    return rows


def summary(rows) -> dict:
    w = np.array([r["with"] for r in rows])
    wo = np.array([r["without"] for r in rows])
    return {"n": len(rows), "within": int((w <= WITHIN_PX).sum()), "within_without": int((wo <= WITHIN_PX).sum()),
            "mean": float(np.mean(w[np.isfinite(w)])), "mean_without": float(np.mean(wo[np.isfinite(wo)])),
            "median": float(np.median(w)), "median_without": float(np.median(wo)), "max": float(w.max()),
            "right": int(sum(r["right"] for r in rows)), "right_without": int(sum(r["right_without"] for r in rows))}


def figure_png(path: Path, rows, scale: int = 2) -> None:
    """Columns of cases; rows: the control map, the demo model alone, the demo model with the ControlNet (a cross
    at the map's centroid on each)."""
    font = ImageFont.load_default()
    tile, pad, label_w, text_h = 64 * scale, 6, 112, 26
    cols = len(rows)
    out = Image.new("RGB", (label_w + cols * (tile + pad) + pad, 3 * (tile + pad) + text_h + pad), "white")
    draw = ImageDraw.Draw(out)
    for r_i, (key, label) in enumerate((("control", "control image\n(position map)"), ("plain", "demo model\nalone"),
                                        ("controlled", "with\ndemo-position"))):
        y = pad + r_i * (tile + pad)
        draw.multiline_text((6, y + tile // 2 - 12), label, fill="black", font=font)
        for c_i, row in enumerate(rows):
            x = label_w + c_i * (tile + pad)
            out.paste(row[key].resize((tile, tile), Image.Resampling.NEAREST), (x, y))
            cx, cy = (v * scale for v in row["target"])
            for dx, dy in ((1, 1), (1, -1)):
                draw.line([(x + cx - 4 * dx, y + cy - 4 * dy), (x + cx + 4 * dx, y + cy + 4 * dy)],
                          fill=(128, 128, 128) if key == "control" else (255, 255, 255), width=1)
    y = pad + 3 * (tile + pad)
    for c_i, row in enumerate(rows):
        x = label_w + c_i * (tile + pad)
        draw.multiline_text((x, y), "\n".join(textwrap_words(f"{row['combo'][0]} {row['combo'][1]} on "
                                                             f"{row['combo'][2]}", 20)), fill="black", font=font)
    out.save(path)


def textwrap_words(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]


def evaluate(hp: HParams, out: Path, docs: Path, log) -> dict:
    from sdlite.pipeline import Engine

    torch.set_num_threads(1)   # the demo model is tiny: one thread generates faster than two
    engine = Engine.load(model_path())
    t = time.perf_counter()
    rows = measure(engine, out, eval_cases(hp.eval_images))
    figures = summary(rows)
    figures["eval_s"] = time.perf_counter() - t
    for r in rows:
        log(f"  {' '.join(r['combo']):<26} seed {r['seed']}: map centroid ({r['target'][0]:.1f}, {r['target'][1]:.1f})"
            f" -> with {r['with']:.2f} px, without {r['without']:.2f} px")
    log(f"{figures['n']} cases: within {WITHIN_PX:g} px of the map's centroid {figures['within']} with the ControlNet "
        f"(mean {figures['mean']:.2f} px, median {figures['median']:.2f}, max {figures['max']:.2f}), "
        f"{figures['within_without']} without it (mean {figures['mean_without']:.2f} px, median "
        f"{figures['median_without']:.2f}); colour, shape and background as prompted (sdlite.demo.classify): "
        f"{figures['right']} with, {figures['right_without']} without")
    docs.mkdir(parents=True, exist_ok=True)
    figure_png(docs / "demo_controlnet.png", rows[:8])
    log(f"wrote {T.rel(docs / 'demo_controlnet.png')}")
    return figures


def main(argv=None) -> int:
    fields = {f.name: f for f in dataclasses.fields(HParams)}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT, help="the ControlNet folder (default sdlite/data/controlnets/"
                                                         f"{NAME})")
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="figure folder (default docs)")
    p.add_argument("--log", type=Path, default=ROOT / "build" / "demo_controlnet" / "train.log")
    p.add_argument("--no-eval", action="store_true", help="stop after saving the ControlNet")
    p.add_argument("--eval-only", action="store_true", help="measure the saved ControlNet again")
    T.add_hparam_options(p, fields)
    args = p.parse_args(argv)
    hp = HParams(**{k: getattr(args, k) for k in fields if getattr(args, k, None) is not None})
    torch.set_num_threads(hp.threads)
    log = T.Log(args.log.with_name(args.log.stem + "_eval.log") if args.eval_only else args.log)
    log(f"hardware: {T.hardware()}")
    log(f"hyper-parameters: {json.dumps(dataclasses.asdict(hp))}")
    if not args.eval_only:
        info = train(hp, args.out, log)
        args.log.with_name("train_info.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    if args.no_eval:
        return 0
    figures = evaluate(hp, args.out, args.docs, log)
    log(f"figures: {json.dumps(figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
