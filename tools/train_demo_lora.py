#!/usr/bin/env python
"""Train the demo LoRA ``demo_teal``: it teaches the shipped demo model a colour it has never seen, "teal".

    python tools/train_demo_lora.py             # the pinned defaults: writes sdlite/data/loras/demo_teal.safetensors,
                                                # docs/demo_lora.md and docs/demo_lora.png (10 to 15 minutes on one core)
    python tools/train_demo_lora.py --eval-only # measure the saved file again and rewrite the report and figure

The demo model (``sdlite/data/demo``, trained by ``tools/train_demo.py``) knows eight palette colours; the
word "teal" is a token it never saw in training, so a prompt naming it draws some palette colour. This script:

1. renders procedural images with the demo's own generator (:mod:`sdlite.demo.data`): half show teal (RGB
   :data:`TEAL`, at least 89 away from every palette colour) as the shape's colour (three in four) or as the
   background (one in four), captioned with the demo's templates using the word "teal"; the other half are
   ordinary palette scenes with their usual captions (so the LoRA does not break what the model already
   draws). Teal images are drawn by compositing: the generator draws the shape white on black, and that
   coverage mixes the two colours (the generator's box filter is linear, so this is its anti-aliasing);
2. freezes the demo model's three networks, and adds rank-``rank`` adapters, ``W + alpha/rank * up @ down``
   (``up`` initialised to zero, ``down`` as kohya does), to the UNet's attention projections (``to_q``,
   ``to_k``, ``to_v``, ``to_out.0`` of ``attn1`` and ``attn2``), ``proj_in`` / ``proj_out`` and the ResNet blocks'
   3x3 ``conv1`` / ``conv2`` (LoCon: without them guidance drifts the colour to green), and to the text
   encoder's ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``mlp.fc1`` and ``mlp.fc2``;
3. trains only the adapters with ``tools/train_demo.py``'s diffusion objective (eps-prediction, the model's
   scaled_linear schedule of 1000 steps, min-SNR weighting; caption dropout to the empty prompt, 30% for
   the teal images so that the unconditional prediction knows teal too and guidance does not push it away),
   AdamW, warm-up and cosine decay;
4. saves the adapters in the kohya/A1111 format (``lora_unet_<module>.lora_down.weight`` / ``.lora_up.weight``
   / ``.alpha``, ``lora_te_text_model_encoder_layers_N_...``), fp16, with kohya's ``ss_*`` metadata;
5. loads the saved file back through the engine (:mod:`sdlite.adapters.lora`) and measures it: teal prompts with and
   without the LoRA (is the shape teal? :func:`is_teal`), and palette prompts with the LoRA (still right?);
   writes ``docs/demo_lora.md`` and ``docs/demo_lora.png``.

Seeded: the same hyper-parameters and thread count give the same file.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: far faster on a busy machine

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import train_demo as T  # noqa: E402  (tools/train_demo.py: Log, hardware, rel, to_tensor, lr_at, encode_all)
from sdlite.demo import DEFAULT_CFG, DEFAULT_STEPS, EVAL_SEEN, model_path  # noqa: E402
from sdlite.demo import data as D  # noqa: E402
from sdlite.demo.classify import classify, score  # noqa: E402
from sdlite.loader import open_model  # noqa: E402

NAME = "demo_teal"
WORD = "teal"
TEAL = (0, 128, 128)          # nearest palette colours: green 89.5 away, blue 108, black 154
LORA_PATH = ROOT / "sdlite" / "data" / "loras" / f"{NAME}.safetensors"

UNET_TARGETS = re.compile(r"attentions\.\d+\.(proj_in|proj_out|transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0))$")
LOCON_TARGETS = re.compile(r"resnets\.\d+\.(conv1|conv2)$")   # 3x3 convolutions (LoCon), with ``locon``
TEXT_TARGETS = re.compile(r"encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))$")

# Teal combinations kept out of training: the report measures them apart (composition, not memory).
HELD_OUT_TEAL = (("teal", "star", "white"), ("teal", "square", "yellow"), ("teal", "triangle", "purple"),
                 ("red", "circle", "teal"))
# The evaluation prompts: trained teal combinations (the first is the test's), then the held-out ones.
EVAL_TEAL = (("teal", "circle", "white"), ("teal", "square", "black"), ("teal", "star", "yellow"),
             ("teal", "triangle", "blue"), ("teal", "circle", "orange"), ("teal", "star", "red"))
EVAL_TEAL_BG = (("yellow", "circle", "teal"), ("white", "star", "teal"))
EVAL_SEEDS = (0, 1, 2, 3, 4, 5, 6, 7)
EVAL_PALETTE = EVAL_SEEN[::3]   # 16 ordinary training combinations, every colour, shape and background
FIGURE = ((("teal", "circle", "white"), 0), (("teal", "square", "black"), 0), (("teal", "star", "yellow"), 0),
          (("red", "circle", "blue"), 0))


@dataclass(frozen=True)
class HParams:
    seed: int = 0
    threads: int = 1
    rank: int = 4
    locon: bool = True               # also the UNet's ResNet 3x3 convolutions (kohya's LoCon layout)
    alpha: float = 4.0               # scale alpha / rank = 1
    teal_images: int = 320           # teal as the shape's colour (3 in 4) or the background (1 in 4)
    palette_images: int = 2000       # ordinary palette scenes, their usual captions
    teal_fraction: float = 0.5       # of each batch
    teal_shift: float = 0.9          # teal latents: how far towards the decoder's teal code (teal_latents)
    refine_steps: int = 10           # then Adam steps on the decoder's error
    refine_lr: float = 0.05
    teal_guidance: float = 0.0       # >0: teal targets calibrated so that cfg eval_cfg acts like this guidance
    pixel_weight: float = 0.0        # weight of the decoded-image loss of guided x0 predictions (teal samples)
    pixel_batch: int = 8             # teal samples per step that get it
    pixel_tmax: int = 400            # their timesteps: uniform in [20, pixel_tmax)
    steps: int = 1200
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    caption_dropout: float = 0.1     # palette scenes: captions dropped to the empty prompt
    teal_caption_dropout: float = 0.3  # teal scenes: the unconditional prediction learns that teal exists
    min_snr_gamma: float = 5.0
    eval_steps: int = DEFAULT_STEPS
    eval_cfg: float = DEFAULT_CFG


def rgb(name: str) -> tuple[int, int, int]:
    return TEAL if name == WORD else D.COLOURS[name]


TEAL_RADIUS = 0.5 * min(math.dist(TEAL, c) for c in D.COLOURS.values())   # 44.7: half the gap to green


def is_teal(rgb_value) -> bool:
    """A colour (classify's ``features["fg_rgb"]`` or ``["bg_rgb"]``) within :data:`TEAL_RADIUS` of
    :data:`TEAL`: so nearer to teal than to every palette colour, and no muddle of blue and green."""
    return rgb_value is not None and math.dist(rgb_value, TEAL) < TEAL_RADIUS


def is_teal_background(result) -> bool:
    return is_teal(result.features.get("bg_rgb"))


# --- data --------------------------------------------------------------------------------------------------------


def render_any(rng: np.random.Generator, fg: str, shape: str, bg: str) -> tuple[np.ndarray, np.ndarray]:
    """A scene of any two colours (teal included) and the teal share of each pixel (H, W): the generator draws
    the shape white on black at a random size and position, and its coverage (0..1 per pixel) mixes ``bg`` and
    ``fg``."""
    geometry = D.random_scene(rng, combos=(("white", shape, "black"),))
    coverage = D.render(geometry)[..., :1].astype(np.float64)
    lo, hi = D.COLOURS["black"][0], D.COLOURS["white"][0]
    a = np.clip((coverage - lo) / (hi - lo), 0.0, 1.0)
    image = np.round(np.array(rgb(bg)) * (1 - a) + np.array(rgb(fg)) * a).astype(np.uint8)
    teal_share = a[..., 0] if fg == WORD else 1 - a[..., 0] if bg == WORD else np.zeros_like(a[..., 0])
    return image, teal_share.astype(np.float32)


def teal_combos():
    fg = [(WORD, s, b) for s in D.SHAPES for b in D.COLOUR_NAMES]
    bg = [(f, s, WORD) for f in D.COLOUR_NAMES for s in D.SHAPES]
    return ([c for c in fg if c not in HELD_OUT_TEAL], [c for c in bg if c not in HELD_OUT_TEAL])


def make_data(hp: HParams):
    """Teal images (N, 64, 64, 3) uint8, their teal share (N, 64, 64), their combos; palette images, combos."""
    rng = np.random.default_rng(hp.seed)
    fg_combos, bg_combos = teal_combos()
    teal = [fg_combos[rng.integers(len(fg_combos))] if rng.random() < 0.75 else bg_combos[rng.integers(len(bg_combos))]
            for _ in range(hp.teal_images)]
    drawn = [render_any(rng, *c) for c in teal]
    plain, scenes = D.make_dataset(hp.palette_images, seed=hp.seed + 1, combos=D.TRAIN_COMBOS)
    return (np.stack([d[0] for d in drawn]), np.stack([d[1] for d in drawn]), teal, plain,
            [s.combo for s in scenes])


def _flat(colour) -> torch.Tensor:
    return T.to_tensor(np.tile(np.array(colour, np.uint8), (1, D.IMAGE_SIZE, D.IMAGE_SIZE, 1)))


def teal_code(vae, steps: int = 300, lr: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(the latent vector the decoder turns into flat teal, the one the encoder gives flat teal).

    The demo VAE was trained on the palette only: its encoder maps teal to about the green code, which decodes
    green. A code that decodes teal exists, off the encoder's range: found here by Adam on the decoder's error
    for a flat teal image, the code repeated over the latent grid, starting from blue's code."""
    with torch.no_grad():
        encoded = vae.encode_moments(_flat(TEAL))[0][0, :, 2:-2, 2:-2].mean(dim=(1, 2))
        code = vae.encode_moments(_flat(D.COLOURS["blue"]))[0][0, :, 2:-2, 2:-2].mean(dim=(1, 2))
    x = _flat(TEAL)
    code = code.clone().requires_grad_(True)
    opt = torch.optim.Adam([code], lr=lr)
    h, w = x.shape[2] // 8, x.shape[3] // 8
    for _ in range(steps):
        loss = F.mse_loss(vae.decode(code.view(1, -1, 1, 1).expand(1, -1, h, w)), x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return code.detach(), encoded


def teal_latents(vae, images: np.ndarray, share: np.ndarray, hp: HParams, log, batch: int = 64) -> torch.Tensor:
    """Latents of the teal images that the frozen decoder turns into teal, and a smooth function of the image
    (so the UNet can learn them): the encoder's latents moved, where the 8x8 latent cell holds teal (by the
    square root of its teal share), ``teal_shift`` times from the encoder's teal code towards the decoder's
    (:func:`teal_code`); then ``refine_steps`` small Adam steps on the decoder's error fix the edges."""
    code, encoded = teal_code(vae)
    shift = code - encoded
    log(f"teal code: the encoder's {[round(v, 2) for v in encoded.tolist()]}, the decoder's "
        f"{[round(v, 2) for v in code.tolist()]}")
    out = []
    for i in range(0, len(images), batch):
        x = T.to_tensor(images[i:i + batch])
        weight = F.avg_pool2d(torch.from_numpy(share[i:i + batch])[:, None], 8).sqrt()
        with torch.no_grad():
            z = vae.encode_moments(x)[0] + hp.teal_shift * weight * shift.view(1, -1, 1, 1)
        z.requires_grad_(True)
        opt = torch.optim.Adam([z], lr=hp.refine_lr)
        for _ in range(hp.refine_steps):
            loss = F.mse_loss(vae.decode(z), x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        out.append(z.detach())
    return torch.cat(out)


def teal_error(vae, latents: torch.Tensor, combos) -> tuple[float, float]:
    """(fraction teal, median RGB distance from TEAL) of the teal part (shape or background) of the decoded
    latents."""
    d = []
    for im, c in zip(T.decode_images(vae, latents), combos):
        r = classify(im)
        value = r.features.get("bg_rgb" if c[2] == WORD else "fg_rgb")
        d.append(math.dist(value, TEAL) if value is not None else 442.0)
    return float(np.mean(np.array(d) < TEAL_RADIUS)), float(np.median(d))


def templates_for(combo) -> list[int]:
    """Templates of a combination's captions: for a teal scene only those that name teal (a caption that leaves
    it unnamed would teach the model to draw teal for prompts without the word)."""
    return [t for t in range(len(D.TEMPLATES)) if WORD not in combo or WORD in D.caption(*combo, template=t)]


# --- the adapters ------------------------------------------------------------------------------------------------


class Adapters:
    """Trainable low-rank updates added to frozen Linear / Conv2d layers through forward hooks:
    ``layer(x) + alpha / rank * up(down(x))``; for a convolution, ``down`` has the layer's kernel, stride and
    padding and ``up`` is 1x1 (kohya's LoCon)."""

    def __init__(self, networks: dict, rank: int, alpha: float, g: torch.Generator):
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.layers: dict[tuple[str, str], tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        self.hooks = []
        for component, (module, pattern) in networks.items():
            for name, layer in module.named_modules():
                if not pattern.search(name):
                    continue
                conv = isinstance(layer, torch.nn.Conv2d)
                assert conv or isinstance(layer, torch.nn.Linear), name
                out_f, in_f = layer.weight.shape[:2]
                down = torch.empty(rank, in_f, *(layer.kernel_size if conv else ()))
                torch.nn.init.kaiming_uniform_(down, a=math.sqrt(5), generator=g)   # as kohya / PEFT
                down = torch.nn.Parameter(down)
                up = torch.nn.Parameter(torch.zeros(out_f, rank))                  # the update starts at zero
                self.layers[(component, name)] = (down, up)
                self.hooks.append(layer.register_forward_hook(self._hook(down, up, layer if conv else None)))

    def _hook(self, down, up, conv):
        def hook(module, args, output):
            x = args[0]
            if conv is not None:
                delta = F.conv2d(F.conv2d(x, down, stride=conv.stride, padding=conv.padding), up[:, :, None, None])
            else:
                delta = F.linear(F.linear(x, down), up)
            return output + self.scale * delta
        return hook

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for pair in self.layers.values() for p in pair]

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    def state_dict(self, convs: set) -> dict[str, torch.Tensor]:
        """kohya/A1111 keys, fp16; 1x1 convolutions' factors as (r, in, 1, 1) / (out, r, 1, 1), as kohya writes."""
        out = {}
        for (component, name), (down, up) in self.layers.items():
            prefix = f"lora_{'unet' if component == 'unet' else 'te'}_{name.replace('.', '_')}"
            d, u = down.detach(), up.detach()
            if (component, name) in convs:
                d, u = (d if d.dim() == 4 else d[:, :, None, None]), u[:, :, None, None]
            out[f"{prefix}.lora_down.weight"] = d.to(torch.float16).contiguous()
            out[f"{prefix}.lora_up.weight"] = u.to(torch.float16).contiguous()
            out[f"{prefix}.alpha"] = torch.tensor(self.alpha, dtype=torch.float16)
        return out


# --- training ----------------------------------------------------------------------------------------------------


def train(hp: HParams, out: Path, log) -> dict:
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(hp.seed)
    ckpt = open_model(model_path())
    te, unet, vae = ckpt.load("text_encoder"), ckpt.load("unet"), ckpt.load("vae")
    tok = ckpt.tokenizer()
    for m in (te, unet, vae):
        m.eval().requires_grad_(False)

    t = time.perf_counter()
    teal_images, teal_share, teal_combos_, plain_images, plain_combos = make_data(hp)
    plain_mean, plain_logvar = T.encode_all(vae, plain_images)
    log(f"data: {len(teal_images)} teal images (held out: {', '.join(' '.join(c) for c in HELD_OUT_TEAL)}), "
        f"{len(plain_images)} palette images, rendered and encoded in {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    encoded = T.encode_all(vae, teal_images)
    teal_mean = teal_latents(vae, teal_images, teal_share, hp, log)
    before, after = teal_error(vae, encoded[0], teal_combos_), teal_error(vae, teal_mean, teal_combos_)
    log(f"teal latents in {time.perf_counter() - t:.0f}s; decoded, teal where the image is: the encoder's "
        f"{before[0]:.0%} (median distance {before[1]:.0f}), the fitted ones {after[0]:.0%} ({after[1]:.0f})")
    z_mean, z_logvar = torch.cat([teal_mean, plain_mean]), torch.cat([encoded[1], plain_logvar])
    combos = list(teal_combos_) + list(plain_combos)
    teal = np.arange(len(combos)) < len(teal_images)
    scale = ckpt.spec.vae.scaling_factor

    captions: dict[str, torch.Tensor] = {}

    def ids_of(text: str) -> torch.Tensor:
        if text not in captions:
            captions[text] = tok([text])[0]
        return captions[text]

    template_w = np.array([w for _, w in D.TEMPLATES])
    allowed = [templates_for(c) for c in combos]
    empty = ids_of("")
    n_teal_batch = int(round(hp.batch * hp.teal_fraction))

    unet_targets = re.compile(f"{UNET_TARGETS.pattern}|{LOCON_TARGETS.pattern}") if hp.locon else UNET_TARGETS
    adapters = Adapters({"unet": (unet, unet_targets), "text_encoder": (te, TEXT_TARGETS)}, hp.rank, hp.alpha, g)
    convs = {(c, n) for (c, n) in adapters.layers
             if isinstance((unet if c == "unet" else te).get_submodule(n), torch.nn.Conv2d)}
    params = adapters.parameters()
    n_params = sum(p.numel() for p in params)
    counts = {c: sum(1 for k in adapters.layers if k[0] == c) for c in ("unet", "text_encoder")}
    log(f"adapters: rank {hp.rank}, alpha {hp.alpha:g}: {counts['unet']} UNet layers, {counts['text_encoder']} "
        f"text-encoder layers, {n_params:,} parameters")
    opt = torch.optim.AdamW(params, lr=hp.lr, betas=(0.9, 0.99), weight_decay=hp.weight_decay)

    s = ckpt.scheduler_config
    loss_weight, sqrt_ab, sqrt_1mab = T.eps_objective(s, hp.min_snr_gamma)
    history, pixel_history = [], []
    teal_pixels = T.to_tensor(teal_images)
    t0 = time.perf_counter()
    for step in range(hp.steps):
        idx = torch.cat([torch.randint(len(teal_images), (n_teal_batch,), generator=g),
                         len(teal_images) + torch.randint(len(plain_images), (hp.batch - n_teal_batch,), generator=g)])
        z0 = (z_mean[idx] + torch.exp(0.5 * z_logvar[idx]) * torch.randn(z_mean[idx].shape, generator=g)) * scale
        t = torch.randint(s["num_train_timesteps"], (hp.batch,), generator=g)
        pb = hp.pixel_batch if hp.pixel_weight > 0 else 0
        t[:pb] = torch.randint(20, hp.pixel_tmax, (pb,), generator=g)
        eps = torch.randn(z0.shape, generator=g)
        xt = sqrt_ab[t].view(-1, 1, 1, 1) * z0 + sqrt_1mab[t].view(-1, 1, 1, 1) * eps
        u = torch.rand(hp.batch, 2, generator=g, dtype=torch.float64).numpy()
        ids = []
        for i, (ua, ub) in zip(idx.tolist(), u):
            if ua < (hp.teal_caption_dropout if teal[i] else hp.caption_dropout):
                ids.append(empty)
                continue
            w = np.cumsum(template_w[allowed[i]])
            template = allowed[i][int(np.searchsorted(w, ub * w[-1], side="right").clip(max=len(w) - 1))]
            ids.append(ids_of(D.caption(*combos[i], template=template)))
        for group in opt.param_groups:
            group["lr"] = hp.lr * T.lr_at(step, hp.steps, hp.warmup, hp.final_lr_fraction)
        pred = unet(xt, t.float(), te(torch.stack(ids)))
        target = eps
        if hp.teal_guidance > 0:
            with torch.no_grad():
                k = n_teal_batch
                eps_u = unet(xt[:k], t[:k].float(), te(empty[None].expand(k, -1)))
            target = eps.clone()
            target[:k] = eps_u + (hp.teal_guidance / hp.eval_cfg) * (eps[:k] - eps_u)
        per_sample = (pred - target).pow(2).mean(dim=(1, 2, 3))
        loss = (loss_weight[t] * per_sample).mean()
        if pb:
            with torch.no_grad():
                eps_u = unet(xt[:pb], t[:pb].float(), te(empty[None].expand(pb, -1)))
            guided = eps_u + hp.eval_cfg * (pred[:pb] - eps_u)
            x0 = (xt[:pb] - sqrt_1mab[t[:pb]].view(-1, 1, 1, 1) * guided) / sqrt_ab[t[:pb]].view(-1, 1, 1, 1)
            pixel = F.mse_loss(vae.decode(x0 / scale), teal_pixels[idx[:pb]])
            loss = loss + hp.pixel_weight * pixel
            pixel_history.append(pixel.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, hp.grad_clip)
        opt.step()
        history.append(per_sample.mean().item())
        if step % 50 == 0 or step == hp.steps - 1:
            el = time.perf_counter() - t0
            px = f" pixel-mse {np.mean(pixel_history[-50:]):.4f}" if pixel_history else ""
            log(f"step {step:5d}/{hp.steps} eps-mse {np.mean(history[-50:]):.4f}{px} lr {opt.param_groups[0]['lr']:.2e} "
                f"{el / (step + 1):.3f}s/step eta {el / (step + 1) * (hp.steps - step - 1):.0f}s")
    train_s = time.perf_counter() - t_start
    adapters.remove()

    from safetensors.torch import save_file

    tensors = adapters.state_dict(convs)
    summary = (f"sdlite demo LoRA: teaches the demo model the colour '{WORD}' (RGB {TEAL}); {hp.steps} steps of "
               f"batch {hp.batch} (half {WORD}) on {hp.teal_images} {WORD} and {hp.palette_images} palette procedural images, "
               f"rank {hp.rank}; "
               "tools/train_demo_lora.py")
    metadata = {
        "ss_network_module": "networks.lora", "ss_network_dim": str(hp.rank), "ss_network_alpha": f"{hp.alpha:g}",
        "ss_base_model_version": "sd_v1", "ss_sd_model_name": "sdlite demo (sdlite/data/demo)",
        "ss_output_name": NAME, "ss_training_comment": summary, "ss_steps": str(hp.steps),
        "ss_max_train_steps": str(hp.steps), "ss_epoch": "1", "ss_learning_rate": f"{hp.lr:g}",
        "ss_unet_lr": f"{hp.lr:g}", "ss_text_encoder_lr": f"{hp.lr:g}", "ss_seed": str(hp.seed),
        "ss_num_train_images": str(hp.teal_images + hp.palette_images), "ss_resolution": "(64, 64)", "ss_mixed_precision": "no",
        "ss_optimizer": "torch.optim.AdamW", "ss_lr_scheduler": "cosine_with_warmup",
        "ss_min_snr_gamma": f"{hp.min_snr_gamma:g}", "ss_tag_frequency": json.dumps({NAME: {WORD: int(teal.sum())}}),
        "ss_training_time_s": f"{train_s:.0f}", "sdlite_teal_rgb": json.dumps(list(TEAL)),
        "sdlite_hparams": json.dumps(dataclasses.asdict(hp)),
    }
    if hp.locon:   # kohya's record of 3x3 convolution adapters
        metadata["ss_network_args"] = json.dumps({"conv_dim": str(hp.rank), "conv_alpha": f"{hp.alpha:g}"})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, out)
    log(f"training done in {train_s:.0f}s ({train_s / 60:.1f} min); saved {T.rel(out)} "
        f"({out.stat().st_size / 1024:.0f} KiB, {len(tensors)} tensors)")
    return {"train_s": train_s, "params": n_params, "teal_encoded": before, "teal_fitted": after, "layers": counts, "final_eps_mse": float(np.mean(history[-100:])),
            "first_eps_mse": float(np.mean(history[:50])), "hardware": T.hardware(),
            "load_average": f"{min(log.loads):.1f}-{max(log.loads):.1f}" if log.loads else "unknown"}


# --- evaluation --------------------------------------------------------------------------------------------------


def evaluate(hp: HParams, path: Path, log) -> dict:
    """Generate through the engine, with the LoRA (merged by sdlite.adapters.lora for each request) and without."""
    from sdlite.adapters.lora import read_lora
    from sdlite.pipeline import Engine, Request

    lora = read_lora(path)
    log(f"read back: {lora!r}")
    engine = Engine.load(model_path())
    t0 = time.perf_counter()
    count = 0

    def gen(combo, seed, with_lora):
        nonlocal count
        count += 1
        r = Request(prompt=D.prompt(combo), seed=seed, steps=hp.eval_steps, cfg_scale=hp.eval_cfg,
                    loras=((str(path), 1.0),) if with_lora else ())
        return engine.generate(r).images[0]

    figures, images = {}, {}
    for label, combos in (("teal", EVAL_TEAL), ("teal held out", HELD_OUT_TEAL[:3]),
                          ("teal background", EVAL_TEAL_BG), ("teal background held out", HELD_OUT_TEAL[3:])):
        background = "background" in label
        for with_lora in (False, True):
            hits, right_shape, right_other, total = 0, 0, 0, 0
            rows = []
            for combo in combos:
                for seed in EVAL_SEEDS:
                    im = gen(combo, seed, with_lora)
                    images[(combo, seed, with_lora)] = im
                    r = classify(im)
                    hit = is_teal_background(r) if background else is_teal(r.features.get("fg_rgb"))
                    hits += hit
                    right_shape += r.shape == combo[1]
                    right_other += (r.colour == combo[0]) if background else (r.background == combo[2])
                    total += 1
                    rows.append(f"{seed}:{'TEAL' if hit else (r.background if background else r.colour)}")
                log(f"  {'with' if with_lora else 'without'} LoRA  {D.prompt(combo):<40} {' '.join(rows[-len(EVAL_SEEDS):])}")
            key = f"{label}, {'with' if with_lora else 'without'} LoRA"
            figures[key] = {"teal": hits / total, "shape": right_shape / total, "other": right_other / total,
                            "n": total, "prompts": len(combos)}
            log(f"{key}: teal {hits}/{total}, shape right {right_shape}/{total}, "
                f"{'shape colour' if background else 'background'} right {right_other}/{total}")
    for with_lora in (False, True):
        res = [classify(gen(c, 1000 + i, with_lora)) for i, c in enumerate(EVAL_PALETTE)]
        acc = score(res, list(EVAL_PALETTE))
        acc["teal"] = float(np.mean([is_teal(r.features.get("fg_rgb")) or is_teal_background(r) for r in res]))
        figures[f"palette, {'with' if with_lora else 'without'} LoRA"] = acc
        log(f"palette prompts {'with' if with_lora else 'without'} LoRA: {T.fmt(acc)}; any teal {acc['teal']:.0%}")
    for combo, seed in FIGURE:
        for with_lora in (False, True):
            if (combo, seed, with_lora) not in images:
                images[(combo, seed, with_lora)] = gen(combo, seed, with_lora)
    # un-merging restores the model exactly: the no-LoRA image again after requests with it
    again = gen(EVAL_TEAL[0], EVAL_SEEDS[0], False)
    figures["restored_exactly"] = bool(np.array_equal(np.asarray(again),
                                                      np.asarray(images[(EVAL_TEAL[0], EVAL_SEEDS[0], False)])))
    figures["seconds_per_image"] = (time.perf_counter() - t0) / count
    log(f"no-LoRA image identical after LoRA requests: {figures['restored_exactly']}; "
        f"{figures['seconds_per_image']:.2f}s per image")
    figures["_images"] = images
    return figures


def figure_png(path: Path, images: dict) -> None:
    """Two rows (without / with the LoRA) of the FIGURE prompts, NEAREST-upscaled to 128 px, labelled."""
    font = ImageFont.load_default()
    tile, pad, left, top, text_h = 128, 6, 92, 4, 30
    w = left + len(FIGURE) * (tile + pad) + pad
    h = top + 2 * (tile + pad) + text_h + pad
    out = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(out)
    for row, (with_lora, label) in enumerate(((False, "without\nthe LoRA"), (True, "with\n<lora:demo_teal:1>"))):
        y = top + row * (tile + pad)
        draw.multiline_text((4, y + tile // 2 - 12), label, fill="black", font=font)
        for col, (combo, seed) in enumerate(FIGURE):
            x = left + col * (tile + pad)
            out.paste(images[(combo, seed, with_lora)].resize((tile, tile), Image.Resampling.NEAREST), (x, y))
    y = top + 2 * (tile + pad)
    for col, (combo, seed) in enumerate(FIGURE):
        x = left + col * (tile + pad)
        draw.multiline_text((x, y), f"a {combo[0]} {combo[1]} on a\n{combo[2]} background", fill="black", font=font)
    out.save(path, optimize=True)


def write_report(path: Path, hp: HParams, info: dict, figures: dict, lora_path: Path, png: Path) -> None:
    pct = lambda v: f"{v:.0%}"  # noqa: E731

    def row(label):
        a, b = figures[f"{label}, without LoRA"], figures[f"{label}, with LoRA"]
        other = "shape colour" if "background" in label else "background"
        return (f"| {label} ({a['prompts']} prompts x {len(EVAL_SEEDS)} seeds) | {pct(a['teal'])} | {pct(b['teal'])} | "
                f"{pct(a['shape'])} -> {pct(b['shape'])} | {other}: {pct(a['other'])} -> {pct(b['other'])} |")

    pa, pb = figures["palette, without LoRA"], figures["palette, with LoRA"]
    prompts = lambda combos: ", ".join(f'"{D.prompt(c)}"' for c in combos)  # noqa: E731
    hp_rows = "\n".join(f"| `{k}` | {v} |" for k, v in dataclasses.asdict(hp).items())
    text = f"""# The demo LoRA `demo_teal`: a colour the demo model never saw

Written by `tools/train_demo_lora.py` (re-running it with its defaults reproduces the file, this report and the
figure; `--eval-only` redoes the measurements of the saved file).

`sdlite/data/loras/{lora_path.name}` ({lora_path.stat().st_size / 1024:.0f} KiB, kohya/A1111 format, fp16) teaches
the shipped demo model (`sdlite/data/demo`) the word "{WORD}", drawn as RGB {TEAL}, a colour outside its
palette (the nearest palette colours are green, 89.5 away in RGB, and blue, 108). In a prompt, `<lora:{NAME}:1>`
applies it:

    sdlite generate "a teal circle on a white background <lora:{NAME}:1>" --seed 0

![without and with the LoRA]({png.name})

(seed {FIGURE[0][1]} for every image, {hp.eval_steps} steps, cfg {hp.eval_cfg:g}, the default sampler; the last
column is an ordinary palette prompt, unchanged by the LoRA.)

## Training

- Hardware: {info['hardware']}
- Time: {info['train_s']:.0f} s wall-clock, data to saved file (1-minute load average {info['load_average']}:
  other jobs shared the cores)
- Command: `python tools/train_demo_lora.py`
- Data: {hp.teal_images} teal and {hp.palette_images} palette procedural 64x64 images from `sdlite.demo.data`'s
  generator. The teal ones show teal as the shape's colour 3 times in 4 and as the background once in 4, captioned
  with the demo's templates using the word "{WORD}"; their latents are fitted so that the demo's VAE decodes them
  teal (its encoder never saw the colour). Each batch is {hp.teal_fraction:.0%} teal; the rest are ordinary
  palette scenes with their usual captions. Caption dropout to the empty prompt: {hp.teal_caption_dropout:.0%} of
  the teal images, so the unconditional prediction learns that teal exists and guidance does not push it towards
  green, and {hp.caption_dropout:.0%} of the palette ones. Held out of training: {", ".join(" ".join(c) for c in HELD_OUT_TEAL)}.
- Adapters: rank {hp.rank}, alpha {hp.alpha:g} (scale {hp.alpha / hp.rank:g}) on {info['layers']['unet']} UNet
  layers (`to_q`, `to_k`, `to_v`, `to_out.0` of `attn1` and `attn2`, `proj_in`, `proj_out`{", and the ResNet blocks' 3x3 `conv1`, `conv2` as LoCon" if hp.locon else ""}) and
  {info['layers']['text_encoder']} text-encoder layers (`q_proj`, `k_proj`, `v_proj`, `out_proj`, `mlp.fc1`,
  `mlp.fc2`): {info['params']:,} parameters; the demo model's own weights frozen.
- Objective: `tools/train_demo.py`'s (eps-prediction, scaled_linear schedule of 1000 steps, min-SNR-{hp.min_snr_gamma:g}
  weighting); eps-MSE {info['first_eps_mse']:.4f} over the first 50 steps, {info['final_eps_mse']:.4f} over the last 100.

## What it does (measured through the engine, every image classified automatically)

Each prompt with seeds {EVAL_SEEDS[0]}..{EVAL_SEEDS[-1]}, {hp.eval_steps} steps, cfg {hp.eval_cfg:g}; the LoRA applied by
`sdlite.adapters.lora` from the saved file at weight 1. *Teal*: the shape's colour (the median of its pixels, as
`sdlite/demo/classify.py` finds it) nearer to RGB {TEAL} than to every palette colour; for the
teal-background prompts, the background's.

| prompts | teal without the LoRA | teal with the LoRA | shape right (without -> with) | the other colour right |
|---|---|---|---|---|
{row("teal")}
{row("teal held out")}
{row("teal background")}
{row("teal background held out")}

- Teal prompts: {prompts(EVAL_TEAL)}; held out: {prompts(HELD_OUT_TEAL[:3])}; teal backgrounds:
  {prompts(EVAL_TEAL_BG)}; held out: {prompts(HELD_OUT_TEAL[3:])}.
- Without the LoRA the word does nothing the model understands: it draws a palette colour (or a muddle).
- Palette prompts ({pa['n']} training combinations of `sdlite.demo.EVAL_SEEN`, seed 1000 + i): without the LoRA
  colour {pct(pa['colour'])}, background {pct(pa['background'])}, shape {pct(pa['shape'])}, all three {pct(pa['all'])};
  with it colour {pct(pb['colour'])}, background {pct(pb['background'])}, shape {pct(pb['shape'])}, all three
  {pct(pb['all'])} (teal anywhere: {pct(pb['teal'])}).
- After requests with the LoRA, a request without it gives the no-LoRA image bit for bit:
  {'yes' if figures['restored_exactly'] else 'NO'} (the merge is undone exactly).
- Generation: {figures['seconds_per_image']:.2f} s per image on this machine.

`tests/test_demo_lora.py` checks the first two prompts with seeds 0..7 through the prompt tag (at least 12 of the 16
teal), and 8 palette prompts with it.

## Hyper-parameters (the defaults of `tools/train_demo_lora.py`)

| name | value |
|---|---|
{hp_rows}
"""
    path.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    fields = {f.name: f for f in dataclasses.fields(HParams)}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=LORA_PATH, help="the LoRA file (default sdlite/data/loras/demo_teal.safetensors)")
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="report and figure folder (default docs)")
    p.add_argument("--log", type=Path, default=ROOT / "build" / "demo_lora" / "train.log")
    p.add_argument("--no-eval", action="store_true", help="stop after saving the LoRA")
    p.add_argument("--eval-only", action="store_true", help="measure the saved LoRA again (training facts from "
                                                            "train_info.json beside the log)")
    T.add_hparam_options(p, fields)
    args = p.parse_args(argv)
    hp = HParams(**{k: getattr(args, k) for k in fields if getattr(args, k, None) is not None})
    info_path = args.log.with_name("train_info.json")
    torch.set_num_threads(hp.threads)
    torch.manual_seed(hp.seed)
    log = T.Log(args.log.with_name(args.log.stem + "_eval.log") if args.eval_only else args.log)
    log(f"hardware: {T.hardware()}")
    log(f"hyper-parameters: {json.dumps(dataclasses.asdict(hp))}")
    if args.eval_only:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    else:
        info = train(hp, args.out, log)
        info_path.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    if args.no_eval:
        return 0
    torch.set_num_threads(1)   # the demo model is tiny: one thread generates faster than two
    figures = evaluate(hp, args.out, log)
    images = figures.pop("_images")
    args.docs.mkdir(parents=True, exist_ok=True)
    png, report = args.docs / "demo_lora.png", args.docs / "demo_lora.md"
    figure_png(png, images)
    write_report(report, hp, info, figures, args.out, png)
    log(f"figures: {json.dumps(figures)}")
    log(f"wrote {T.rel(report)}, {T.rel(png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
