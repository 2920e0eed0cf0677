#!/usr/bin/env python
"""Train sdlite's embedded demo model (issue 5) and write the shipped folder, its log, figures and report.

    python tools/train_demo.py            # the pinned defaults: writes sdlite/data/demo and docs/demo_*
    python tools/train_demo.py --quick    # a few minutes, end-to-end check, writes under build/demo_quick/

Stages, all seeded (same hyper-parameters, same thread count -> the same model):

1. data: ``train_images`` procedural images of the training combinations (sdlite.demo.data; the held-out
   combinations never appear);
2. VAE (sdlite.config.DEMO.vae): MSE reconstruction + a small KL term, on random crops then full images;
   the latent scaling factor is 1 / std of the training latents, written into the VAE config;
3. text encoder + UNet together on the VAE's latents: eps-prediction, SD's scaled_linear schedule (1000
   steps), min-SNR loss weighting, caption dropout to the empty prompt (for classifier-free guidance), AdamW
   with warm-up and cosine decay, an EMA of the weights (what ships);
4. save with sdlite.export.save_diffusers in fp16;
5. load the saved folder back with the engine and measure it with the automatic classifier
   (sdlite.demo.classify): the figures the quality test checks, a guidance sweep, the negative-prompt effect,
   plus the loss curve and a grid of outputs.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: far faster on a busy machine

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sdlite.config import DEMO  # noqa: E402
from sdlite.demo import (  # noqa: E402
    DEFAULT_CFG, DEFAULT_STEPS, EVAL_HELD_OUT, EVAL_SEED, EVAL_SEEN, NEGATIVE_SET, colour_error, colourless_prompt,
    generate, star_solidity,
)
from sdlite.demo import data as D  # noqa: E402
from sdlite.demo.classify import classify, score  # noqa: E402
from sdlite.export import save_diffusers  # noqa: E402
from sdlite.loader import StableDiffusion  # noqa: E402
from sdlite.models.clip import CLIPTextEncoder  # noqa: E402
from sdlite.models.unet import UNet  # noqa: E402
from sdlite.models.vae import AutoencoderKL  # noqa: E402
from sdlite.tokenizers.clip_bpe import CLIPTokenizer  # noqa: E402


@dataclass(frozen=True)
class HParams:
    seed: int = 0
    threads: int = 2
    train_images: int = 20000
    # VAE
    vae_steps: int = 1400            # on vae_crop x vae_crop random crops, batch vae_batch
    vae_full_steps: int = 300        # then on whole images, batch vae_batch // 4 (the same pixels per step)
    vae_batch: int = 32
    vae_crop: int = 32
    vae_lr: float = 1e-3
    kl_weight: float = 1e-5          # per latent element, against the per-pixel MSE
    # text encoder + UNet
    steps: int = 3500
    batch: int = 64
    lr: float = 1.5e-3
    warmup: int = 200
    final_lr_fraction: float = 0.1   # cosine decay to lr * this
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    min_snr_gamma: float = 5.0
    # evaluation
    eval_steps: int = DEFAULT_STEPS
    eval_cfg: float = DEFAULT_CFG
    cfg_sweep: tuple = (1.0, 3.0, 5.0, 7.5)


QUICK = dict(train_images=4000, vae_steps=600, vae_full_steps=100, steps=500, warmup=50, cfg_sweep=(1.0, 7.5))


class Log:
    """Everything printed goes to the terminal and the log file, flushed at once (the run is polled).
    Each line also samples the machine's load average (how shared the machine was)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", encoding="utf-8")
        self.t0 = time.perf_counter()
        self.loads: list[float] = []

    def __call__(self, msg: str = "") -> None:
        if hasattr(os, "getloadavg"):
            self.loads.append(os.getloadavg()[0])
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def rel(path: Path) -> str:
    """Paths in logs and reports relative to the repository (never a machine path)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return Path(path).name


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPU cores visible, torch {torch.__version__} with {torch.get_num_threads()} threads"


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def lr_at(step: int, total: int, warmup: int, final_fraction: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    p = (step - warmup) / max(total - warmup, 1)
    return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * p))



def eps_objective(scheduler: dict, min_snr_gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per training timestep of the scaled-linear schedule ``scheduler`` describes: the min-SNR-gamma loss weight for
    eps-prediction (Hang et al. 2023), sqrt(alpha_bar) and sqrt(1 - alpha_bar), float32. What every demo trainer
    (the model, the LoRA, the ControlNet) noises and weighs by."""
    s = scheduler
    betas = torch.linspace(s["beta_start"] ** 0.5, s["beta_end"] ** 0.5, s["num_train_timesteps"],
                           dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    snr = alphas_cumprod / (1 - alphas_cumprod)
    loss_weight = (snr.clamp(max=min_snr_gamma) / snr).float()
    return loss_weight, alphas_cumprod.sqrt().float(), (1 - alphas_cumprod).sqrt().float()

# --- the VAE ---------------------------------------------------------------------------------------------------


def train_vae(hp: HParams, images: np.ndarray, g: torch.Generator, log: Log):
    vae = AutoencoderKL(DEMO.vae)
    opt = torch.optim.AdamW(vae.parameters(), lr=hp.vae_lr, weight_decay=0.0, fused=True)
    n, size = len(images), images.shape[1]
    total = hp.vae_steps + hp.vae_full_steps
    history = []
    t0 = time.perf_counter()
    for step in range(total):
        full = step >= hp.vae_steps
        b = max(hp.vae_batch // 4, 1) if full else hp.vae_batch
        crop = size if full else hp.vae_crop
        idx = torch.randint(n, (b,), generator=g).numpy()
        oy = torch.randint(size - crop + 1, (b,), generator=g).numpy()
        ox = torch.randint(size - crop + 1, (b,), generator=g).numpy()
        x = to_tensor(np.stack([images[i, y:y + crop, x_:x_ + crop] for i, y, x_ in zip(idx, oy, ox)]))
        for group in opt.param_groups:
            group["lr"] = hp.vae_lr * lr_at(step, total, min(100, total // 10), hp.final_lr_fraction)
        mean, logvar = vae.encode_moments(x)
        z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=g)
        rec = vae.decode(z)
        mse = F.mse_loss(rec, x)
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        loss = mse + hp.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), hp.grad_clip)
        opt.step()
        history.append(mse.item())
        if step % 50 == 0 or step == total - 1:
            el = time.perf_counter() - t0
            log(f"vae step {step:5d}/{total} mse {np.mean(history[-50:]):.5f} kl {kl.item():.3f} "
                f"{'full' if full else f'crop {crop}'} {el / (step + 1):.2f}s/step eta {el / (step + 1) * (total - step - 1):.0f}s")
    return vae.eval().requires_grad_(False), history


@torch.no_grad()
def encode_all(vae: AutoencoderKL, images: np.ndarray, batch: int = 256):
    means, logvars = [], []
    for i in range(0, len(images), batch):
        m, lv = vae.encode_moments(to_tensor(images[i:i + batch]))
        means.append(m)
        logvars.append(lv)
    return torch.cat(means), torch.cat(logvars)


@torch.no_grad()
def decode_images(vae: AutoencoderKL, latents: torch.Tensor, batch: int = 256) -> np.ndarray:
    out = []
    for i in range(0, len(latents), batch):
        x = vae.decode(latents[i:i + batch])
        out.append(((x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy())
    return np.concatenate(out)


# --- text encoder + UNet ----------------------------------------------------------------------------------------


def init_text_encoder(te: CLIPTextEncoder, g: torch.Generator) -> None:
    """CLIP's initialisation of the embeddings (the module default, N(0, 1), is far too large)."""
    with torch.no_grad():
        emb = te.text_model.embeddings
        emb.token_embedding.weight.copy_(torch.randn(emb.token_embedding.weight.shape, generator=g) * 0.02)
        emb.position_embedding.weight.copy_(torch.randn(emb.position_embedding.weight.shape, generator=g) * 0.01)


def caption_table(tok: CLIPTokenizer):
    """Token ids of every training caption: (combos, templates, 77), and of the empty prompt (77,)."""
    ids = torch.stack([torch.stack([tok([D.caption(*combo, template=t)])[0] for t in range(len(D.TEMPLATES))])
                       for combo in D.TRAIN_COMBOS])
    return ids, tok([""])[0]


def train_diffusion(hp: HParams, z_mean, z_logvar, combo_index, scale: float, g: torch.Generator, log: Log):
    tok = CLIPTokenizer.from_package()
    captions, empty = caption_table(tok)
    template_p = torch.tensor([w for _, w in D.TEMPLATES], dtype=torch.float64)
    te = CLIPTextEncoder(DEMO.text)
    init_text_encoder(te, g)
    unet = UNet(DEMO.unet)
    params = list(te.parameters()) + list(unet.parameters())
    opt = torch.optim.AdamW(params, lr=hp.lr, betas=(0.9, 0.99), weight_decay=hp.weight_decay, fused=True)
    ema_te, ema_unet = copy.deepcopy(te).requires_grad_(False), copy.deepcopy(unet).requires_grad_(False)
    ema_params = list(ema_te.parameters()) + list(ema_unet.parameters())

    s = DEMO.scheduler
    loss_weight, sqrt_ab, sqrt_1mab = eps_objective(s, hp.min_snr_gamma)
    n = len(z_mean)
    history = []
    t0 = time.perf_counter()
    for step in range(hp.steps):
        idx = torch.randint(n, (hp.batch,), generator=g)
        z0 = (z_mean[idx] + torch.exp(0.5 * z_logvar[idx]) * torch.randn(z_mean[idx].shape, generator=g)) * scale
        t = torch.randint(s["num_train_timesteps"], (hp.batch,), generator=g)
        eps = torch.randn(z0.shape, generator=g)
        xt = sqrt_ab[t].view(-1, 1, 1, 1) * z0 + sqrt_1mab[t].view(-1, 1, 1, 1) * eps
        templ = torch.multinomial(template_p, hp.batch, replacement=True, generator=g)
        ids = captions[combo_index[idx], templ]
        drop = torch.rand(hp.batch, generator=g) < hp.caption_dropout
        ids[drop] = empty
        for group in opt.param_groups:
            group["lr"] = hp.lr * lr_at(step, hp.steps, hp.warmup, hp.final_lr_fraction)
        pred = unet(xt, t.float(), te(ids))
        per_sample = (pred - eps).pow(2).mean(dim=(1, 2, 3))
        loss = (loss_weight[t] * per_sample).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, hp.grad_clip)
        opt.step()
        decay = min(hp.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        history.append(per_sample.mean().item())
        if step % 50 == 0 or step == hp.steps - 1:
            el = time.perf_counter() - t0
            log(f"unet step {step:5d}/{hp.steps} eps-mse {np.mean(history[-50:]):.4f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {el / (step + 1):.2f}s/step "
                f"eta {el / (step + 1) * (hp.steps - step - 1):.0f}s")
    return ema_te.eval(), ema_unet.eval(), tok, history


# --- figures -----------------------------------------------------------------------------------------------------


def smooth(values, k: int) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return v
    k = max(1, min(k, len(v)))
    c = np.cumsum(np.insert(v, 0, 0.0))
    out = (c[k:] - c[:-k]) / k
    return np.concatenate([np.cumsum(v[:k - 1]) / np.arange(1, k), out])


def loss_curve_png(path: Path, panels) -> None:
    """Loss curves on a log scale, one panel per stage, drawn with PIL: [(title, values, smoothing), ...]."""
    w, h, pad_l, pad_r, pad_t, pad_b = 520, 300, 64, 16, 28, 40
    img = Image.new("RGB", (w * len(panels), h), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    for p, (title, values, k) in enumerate(panels):
        x0 = p * w
        raw = np.maximum(np.asarray(values, dtype=np.float64), 1e-8)
        sm = np.maximum(smooth(raw, k), 1e-8)
        lo, hi = math.floor(math.log10(raw.min())), math.ceil(math.log10(raw.max()))
        hi = max(hi, lo + 1)
        left, right, top, bottom = x0 + pad_l, x0 + w - pad_r, pad_t, h - pad_b

        def xy(i, v):
            return (left + (right - left) * i / max(len(raw) - 1, 1),
                    bottom - (bottom - top) * (math.log10(v) - lo) / (hi - lo))

        for e in range(lo, hi + 1):  # decade grid lines and labels
            y = xy(0, 10.0 ** e)[1]
            draw.line([(left, y), (right, y)], fill=(225, 225, 225))
            draw.text((x0 + 6, y - 6), f"1e{e}", fill="black", font=font)
        for frac in (0, 0.25, 0.5, 0.75, 1.0):
            i = int(round(frac * (len(raw) - 1)))
            x = xy(i, 10.0 ** lo)[0]
            draw.line([(x, bottom), (x, bottom + 4)], fill="black")
            draw.text((x - 10, bottom + 8), str(i), fill="black", font=font)
        draw.rectangle([left, top, right, bottom], outline="black")
        step = max(1, len(raw) // 1500)
        draw.line([xy(i, raw[i]) for i in range(0, len(raw), step)], fill=(170, 200, 240))
        draw.line([xy(i, sm[i]) for i in range(len(sm))], fill=(20, 60, 180), width=2)
        draw.text((left, 8), title, fill="black", font=font)
        draw.text((right - 60, h - 16), "step", fill="black", font=font)
    img.save(path)


def grid_png(path: Path, images, captions, labels, cols: int = 8, scale: int = 2) -> None:
    """Generated images with their prompts underneath."""
    font = ImageFont.load_default()
    tile = images[0].width * scale
    text_h = 40
    rows = math.ceil(len(images) / cols)
    out = Image.new("RGB", (cols * (tile + 8) + 8, rows * (tile + text_h + 8) + 8), "white")
    draw = ImageDraw.Draw(out)
    for i, (im, cap, lab) in enumerate(zip(images, captions, labels)):
        x, y = 8 + (i % cols) * (tile + 8), 8 + (i // cols) * (tile + text_h + 8)
        out.paste(im.resize((tile, tile), Image.Resampling.NEAREST), (x, y))
        words, lines = cap.split(), [""]
        for word in words:
            if len(lines[-1]) + len(word) + 1 > tile // 6:
                lines.append(word)
            else:
                lines[-1] = (lines[-1] + " " + word).strip()
        for j, line in enumerate(lines[:2] + ([lab] if lab else [])):
            draw.text((x, y + tile + 2 + 12 * j), line, fill=(120, 0, 0) if j == 2 else "black", font=font)
    out.save(path)


# --- evaluation --------------------------------------------------------------------------------------------------


def fmt(acc: dict) -> str:
    return (f"colour {acc['colour']:.1%}, background {acc['background']:.1%}, shape {acc['shape']:.1%}, "
            f"all three {acc['all']:.1%} (n={acc['n']})")


def run_evaluation(hp: HParams, folder: Path, log: Log) -> dict:
    """The figures tests/test_demo.py checks (same prompts, seeds and statistics), and a guidance sweep."""
    from sdlite.pipeline import Engine

    engine = Engine.load(folder)
    figures = {}
    t0 = time.perf_counter()
    seen_images = generate(engine, EVAL_SEEN, cfg=hp.eval_cfg, steps=hp.eval_steps)
    held_images = generate(engine, EVAL_HELD_OUT, cfg=hp.eval_cfg, steps=hp.eval_steps, seed=EVAL_SEED + 100)
    figures["seconds_per_image"] = (time.perf_counter() - t0) / (len(EVAL_SEEN) + len(EVAL_HELD_OUT))
    seen_res = [classify(im) for im in seen_images]
    held_res = [classify(im) for im in held_images]
    figures["seen"] = score(seen_res, list(EVAL_SEEN))
    figures["held_out"] = score(held_res, list(EVAL_HELD_OUT))
    log(f"eval cfg {hp.eval_cfg:g}, seen combos:     {fmt(figures['seen'])}")
    log(f"eval cfg {hp.eval_cfg:g}, held-out combos: {fmt(figures['held_out'])}")
    for combo, r in zip(EVAL_HELD_OUT, held_res):
        log(f"  held-out {' '.join(combo):<28} -> {' '.join(r.combo):<28} {r.features}")
    sweep = {}
    for cfg in hp.cfg_sweep:
        res = seen_res if cfg == hp.eval_cfg else \
            [classify(im) for im in generate(engine, EVAL_SEEN, cfg=cfg, steps=hp.eval_steps)]
        sweep[f"{cfg:g}"] = {**score(res, list(EVAL_SEEN)), "colour_error": colour_error(res, EVAL_SEEN),
                             "star_solidity": star_solidity(res, EVAL_SEEN)}
        log(f"eval cfg {cfg:g} (seen): {fmt(sweep[f'{cfg:g}'])}; colour error "
            f"{sweep[f'{cfg:g}']['colour_error']:.2f}, star solidity {sweep[f'{cfg:g}']['star_solidity']:.3f}")
    figures["cfg_sweep"] = sweep
    # negative prompts naming the shape's colour: prompts that leave the colour open, then prompts naming it
    combos = list(NEGATIVE_SET)
    first = [classify(im) for im in generate(engine, combos, steps=hp.eval_steps, cfg=hp.eval_cfg,
                                             prompts=colourless_prompt)]
    again = [classify(im) for im in generate(engine, combos, steps=hp.eval_steps, cfg=hp.eval_cfg,
                                             prompts=colourless_prompt, negative=lambda i, c: first[i].colour)]
    named_neg = [classify(im) for im in generate(engine, combos, steps=hp.eval_steps, cfg=hp.eval_cfg,
                                                 negative=lambda i, c: c[0])]
    named = seen_res[:len(combos)]
    figures["negative"] = {
        "n": len(combos),
        "open_kept": float(np.mean([a.colour == b.colour for a, b in zip(first, again)])),
        "open_none": float(np.mean([b.colour == "none" for b in again])),
        "named_error_before": colour_error(named, combos), "named_error_after": colour_error(named_neg, combos),
        "named_kept": float(np.mean([r.colour == c[0] for r, c in zip(named_neg, combos)])),
    }
    neg = figures["negative"]
    log(f"negative = the colour drawn for a colour-free prompt: {neg['open_kept']:.1%} keep it "
        f"({neg['open_none']:.1%} draw no shape); colours now {[r.colour for r in again]}")
    log(f"negative = the colour named in the prompt: still that colour {neg['named_kept']:.1%}, distance from it "
        f"{neg['named_error_before']:.2f} -> {neg['named_error_after']:.2f}")
    figures["_images"] = (seen_images, held_images, seen_res, held_res)
    return figures


# --- the run -------------------------------------------------------------------------------------------------


def replace_folder(tmp: Path, out: Path) -> None:
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def write_report(path: Path, hp: HParams, info: dict, figures: dict, curve: Path, grid: Path) -> None:
    seen, held = figures["seen"], figures["held_out"]
    pct = lambda v: f"{v:.1%}"  # noqa: E731
    sweep_rows = "\n".join(f"| {cfg} | {pct(a['colour'])} | {pct(a['background'])} | {pct(a['shape'])} | "
                           f"{pct(a['all'])} | {a['colour_error']:.1f} | {a['star_solidity']:.3f} |"
                           for cfg, a in figures["cfg_sweep"].items())
    held_list = "\n".join(f"- {c} {s} on {b}" for c, s, b in D.HELD_OUT)
    neg = figures["negative"]
    hp_rows = "\n".join(f"| `{k}` | {v} |" for k, v in dataclasses.asdict(hp).items())
    stage_rows = "\n".join(f"| {k} | {v:.0f} s |" for k, v in info["times"].items())
    p = info["params"]
    source = f"\n- Training facts {info['_source']}" if "_source" in info else ""
    unguided, guided = figures["cfg_sweep"].get("1"), figures["cfg_sweep"][f"{hp.eval_cfg:g}"]
    if unguided is None:
        guidance = ""
    elif unguided["all"] >= guided["all"] - 0.05:
        guidance = ("Without guidance (cfg 1) the classes are about as often right: this model's conditional "
                    "prediction alone is already accurate on these prompts. What guidance adds is fidelity: "
                    f"colour error {unguided['colour_error']:.1f} -> {guided['colour_error']:.1f}, star solidity "
                    f"{unguided['star_solidity']:.3f} -> {guided['star_solidity']:.3f} at cfg {hp.eval_cfg:g}.")
    else:
        guidance = (f"Without guidance (cfg 1) fewer images are right in all three respects: {pct(unguided['all'])} "
                    f"against {pct(guided['all'])} at cfg {hp.eval_cfg:g}.")
    text = f"""# The demo model: training log summary

Written by `tools/train_demo.py` (re-running it with its defaults reproduces this file, the model in
`sdlite/data/demo/` and the figures below; `--eval-only` redoes only the evaluation of the saved model).

- Hardware: {info['hardware']}
- Training time, data to saved model: {info['train_s'] / 60:.1f} min wall-clock (1-minute load average
  {info['load_average']} during training: other jobs shared the cores); evaluation {figures['eval_s'] / 60:.1f} min.{source}
- Model: {p['text_encoder']:,} + {p['unet']:,} + {p['vae']:,} = {sum(p.values()):,} parameters (text encoder,
  UNet, VAE); stored in fp16: {info['size_bytes'] / 2**20:.1f} MiB on disk, tokenizer files included
- VAE latent scaling factor (1 / std of the training latents): {info['scaling_factor']}
- Final losses: VAE reconstruction MSE {info['final_vae_mse']:.5f} (images in [-1, 1]); diffusion eps-MSE
  {info['final_eps_mse']:.4f} (mean of the last 200 steps)
- VAE round trip of {info['vae_roundtrip']['n']} fresh images (all combinations), classified:
  {fmt(info['vae_roundtrip'])}

![loss curves]({curve.name})

| stage | time |
|---|---|
{stage_rows}

## Quality (what `tests/test_demo.py` asserts)

{hp.eval_steps} steps, the default sampler (dpmpp_2m_karras), cfg {hp.eval_cfg:g}, canonical prompts
("a red circle on a blue background"), image i of a set with seed {EVAL_SEED} + i (held-out set:
{EVAL_SEED + 100} + i); every image classified automatically by `sdlite/demo/classify.py`.

| set | colour | background | shape | all three |
|---|---|---|---|---|
| {seen['n']} training combinations | {pct(seen['colour'])} | {pct(seen['background'])} | {pct(seen['shape'])} | {pct(seen['all'])} |
| {held['n']} held-out combinations | {pct(held['colour'])} | {pct(held['background'])} | {pct(held['shape'])} | {pct(held['all'])} |

Guidance (the {seen['n']} training combinations, same seeds). *Colour error*: mean RGB distance between the
shape's colour and the named palette colour. *Star solidity*: area / convex-hull area of the stars drawn
(0.5 for the generator's crisp stars, higher as the points blur).

| cfg | colour | background | shape | all three | colour error | star solidity |
|---|---|---|---|---|---|---|
{sweep_rows}

{guidance}

Negative prompts ({neg['n']} shapes and backgrounds):

- prompts leaving the colour open ("a circle on a blue background"), drawn again with the same seed and the
  colour the model had chosen as the negative prompt: {pct(neg['open_kept'])} keep that colour
  ({pct(neg['open_none'])} draw no visible shape);
- prompts naming the colour, with the same colour as the negative prompt: {pct(neg['named_kept'])} stay that
  colour (the two cancel, leaving the colour unguided), but the distance from the palette colour grows from
  {neg['named_error_before']:.1f} to {neg['named_error_after']:.1f}.

Generation on this machine: {figures['seconds_per_image']:.2f} s per image ({hp.eval_steps} steps, 64x64).

![demo outputs]({grid.name})

## Held-out combinations (never in the training data)

{held_list}

## Hyper-parameters (the defaults of `tools/train_demo.py`)

| name | value |
|---|---|
{hp_rows}
"""
    path.write_text(text, encoding="utf-8")


def add_hparam_options(parser: argparse.ArgumentParser, fields: dict) -> None:
    """One ``--name`` option per scalar hyper-parameter (default None: keep the dataclass default); booleans
    read 1/true/yes."""
    for name, f in fields.items():
        if isinstance(f.default, tuple):
            continue
        kind = (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(f.default, bool) else type(f.default)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)


def main(argv=None) -> int:
    fields = {f.name: f for f in dataclasses.fields(HParams)}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few-minute run for checking the pipeline end to end")
    p.add_argument("--out", type=Path, default=None, help="model folder (default sdlite/data/demo)")
    p.add_argument("--docs", type=Path, default=None, help="report/figures folder (default docs)")
    p.add_argument("--log", type=Path, default=None, help="log file (default build/demo/train.log)")
    p.add_argument("--no-eval", action="store_true", help="stop after saving the model")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the saved model again and rewrite the report (training facts are read from "
                        "train_info.json beside the log)")
    add_hparam_options(p, fields)
    args = p.parse_args(argv)
    overrides = dict(QUICK) if args.quick else {}
    overrides.update({k: getattr(args, k) for k in fields if getattr(args, k, None) is not None})
    hp = HParams(**overrides)
    base = ROOT / "build" / "demo_quick" if args.quick else None
    out = args.out or (base / "model" if base else ROOT / "sdlite" / "data" / "demo")
    docs = args.docs or (base / "docs" if base else ROOT / "docs")
    log_path = args.log or (base / "train.log" if base else ROOT / "build" / "demo" / "train.log")
    info_path = log_path.with_name("train_info.json")
    docs.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(hp.threads)
    torch.manual_seed(hp.seed)
    g = torch.Generator().manual_seed(hp.seed)
    log = Log(log_path.with_name(log_path.stem + "_eval.log") if args.eval_only else log_path)
    log(f"hardware: {hardware()}")
    log(f"hyper-parameters: {json.dumps(dataclasses.asdict(hp))}")
    curve = docs / "demo_training_loss.png"
    if args.eval_only:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    else:
        info = train(hp, out, g, log, curve)
        info_path.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    if args.no_eval:
        return 0
    t = time.perf_counter()
    figures = run_evaluation(hp, out, log)
    figures["eval_s"] = time.perf_counter() - t
    seen_images, held_images, seen_res, held_res = figures.pop("_images")
    grid = docs / "demo_grid.png"
    picks = list(range(0, 24))
    grid_png(grid, [seen_images[i] for i in picks] + held_images[:8],
             [D.prompt(EVAL_SEEN[i]) for i in picks] + [D.prompt(c) for c in EVAL_HELD_OUT[:8]],
             [""] * len(picks) + ["(held out)"] * 8)
    report = docs / "demo_training.md"
    write_report(report, hp, info, figures, curve, grid)
    log(f"figures: {json.dumps(figures)}")
    log(f"wrote {rel(report)}, {rel(curve)}, {rel(grid)}; evaluation {figures['eval_s'] / 60:.1f} min")
    return 0


def train(hp: HParams, out: Path, g: torch.Generator, log: Log, curve: Path) -> dict:
    """Data, VAE, latents, text encoder + UNet, saved folder and loss curve; returns the training facts."""
    times = {}
    t_start = time.perf_counter()
    t = time.perf_counter()
    images, scenes = D.make_dataset(hp.train_images, seed=hp.seed, combos=D.TRAIN_COMBOS)
    combo_of = {c: i for i, c in enumerate(D.TRAIN_COMBOS)}
    combo_index = torch.tensor([combo_of[s.combo] for s in scenes])
    times["data"] = time.perf_counter() - t
    log(f"data: {len(images)} images of {len(D.TRAIN_COMBOS)} combinations ({len(D.HELD_OUT)} held out)")

    t = time.perf_counter()
    vae, vae_hist = train_vae(hp, images, g, log)
    times["VAE training"] = time.perf_counter() - t

    t = time.perf_counter()
    z_mean, z_logvar = encode_all(vae, images)
    latents = z_mean + torch.exp(0.5 * z_logvar) * torch.randn(z_mean.shape, generator=g)
    scale = round(1.0 / latents.std().item(), 5)
    log(f"latents: mean {latents.mean():.3f} std {latents.std():.3f} posterior std {z_logvar.mul(0.5).exp().mean():.4f}"
        f" -> scaling factor {scale}")
    if scale != DEMO.vae.scaling_factor:
        log(f"note: sdlite/config.py's DEMO preset says scaling_factor={DEMO.vae.scaling_factor}; the model "
            f"written now has {scale}: update the preset")
    check_images, check_scenes = D.make_dataset(448, seed=hp.seed + 1, combos=D.ALL_COMBOS)
    rt = decode_images(vae, encode_all(vae, check_images)[0])
    roundtrip = score([classify(im) for im in rt], [s.combo for s in check_scenes])
    log(f"VAE round trip: {fmt(roundtrip)}")
    times["encoding"] = time.perf_counter() - t

    t = time.perf_counter()
    te, unet, tok, unet_hist = train_diffusion(hp, z_mean, z_logvar, combo_index, scale, g, log)
    times["text encoder + UNet training"] = time.perf_counter() - t

    spec = DEMO.replace(vae=dataclasses.replace(DEMO.vae, scaling_factor=scale))
    model = StableDiffusion(spec=spec, tokenizer=tok, text_encoder=te, unet=unet, vae=vae,
                            scheduler_config=dict(spec.scheduler))
    tmp = out.with_name(out.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    save_diffusers(model, tmp, dtype=torch.float16)
    replace_folder(tmp, out)
    size = folder_size(out)
    log(f"saved {rel(out)} ({size / 2**20:.2f} MiB)")
    train_s = time.perf_counter() - t_start
    log(f"training done in {train_s / 60:.1f} min")
    loss_curve_png(curve, [("VAE reconstruction MSE", vae_hist, 25), ("diffusion eps-MSE", unet_hist, 50)])
    return {
        "hardware": hardware(), "times": times, "train_s": train_s, "size_bytes": size, "scaling_factor": scale,
        "final_vae_mse": float(np.mean(vae_hist[-50:])), "final_eps_mse": float(np.mean(unet_hist[-200:])),
        "vae_roundtrip": roundtrip,
        "load_average": f"{min(log.loads):.1f}-{max(log.loads):.1f}" if log.loads else "unknown",
        "params": {"text_encoder": sum(p.numel() for p in te.parameters()),
                   "unet": sum(p.numel() for p in unet.parameters()),
                   "vae": sum(p.numel() for p in vae.parameters())},
    }


if __name__ == "__main__":
    sys.exit(main())
