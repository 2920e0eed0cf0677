#!/usr/bin/env python
"""Train the demo model's Chinese text encoder (``demo-zh``) and write the shipped folder, its report and figure.

    python tools/train_demo_zh.py            # pinned defaults: writes sdlite/data/demo-zh and docs/demo_zh.*
    python tools/train_demo_zh.py --quick    # a short run for checking the script, written under build/

The shipped demo model (``sdlite/data/demo``) reads English through a tiny CLIP text tower. ``demo-zh`` gives the
same UNet and VAE a second text encoder: a tiny BERT (the architecture Taiyi uses, sdlite.models.bert) with a
WordPiece vocabulary built here from the caption data (every Chinese character of the captions, the English
words, punctuation). It is trained by **distillation**: for a caption of a scene, Chinese or English, it learns
to output the demo CLIP encoder's hidden states (all 77 positions) for the English caption of the same scene
(for an English caption: for that caption itself). The UNet, which only ever sees those hidden states, then
draws from Chinese what it draws from English; it is not retrained, and not copied: the demo-zh folder holds only
text_encoder/ and tokenizer/ and names the demo folder for the rest (model_index.json ``_sdlite_shared_from``).

Stages, all seeded (same hyper-parameters, same thread count -> the same model):

1. vocabulary from the captions (sdlite.demo.zh for Chinese, sdlite.demo.data for English);
2. teacher states: the demo CLIP text encoder on every English caption and on the empty prompt (the negative
   prompt of guidance), once;
3. distillation: batches of random captions (Chinese paraphrases and partial captions, English captions, the
   empty prompt; light noise: trailing punctuation, a comma written otherwise, an unknown character), MSE between
   the student's (77, 64) states and the teacher's, AdamW with warm-up and cosine decay;
4. save the folder (fp32: it is small), load it back with the engine, and measure every colour/shape/background
   combination with the automatic classifier (sdlite.demo.classify): canonical Chinese captions, paraphrases,
   English through demo-zh, and English through the demo model for comparison; report and figure.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: far faster on a busy machine

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sdlite.config import BertTextConfig  # noqa: E402
from sdlite.demo import DEFAULT_CFG, DEFAULT_STEPS, EVAL_SEED, generate, model_path  # noqa: E402
from sdlite.demo import data as D  # noqa: E402
from sdlite.demo import zh as Z  # noqa: E402
from sdlite.demo.classify import classify, score  # noqa: E402
from sdlite.loader import open_model  # noqa: E402
from sdlite.models.bert import BertTextEncoder  # noqa: E402
from sdlite.pipeline import Engine  # noqa: E402
from sdlite.tokenizers import WordPieceTokenizer  # noqa: E402
from sdlite.weights.safetensors import save_safetensors  # noqa: E402

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PUNCTUATION = list(",.!?;:'\"()-") + list("，。！？；：、“”（）")
UNKNOWN_CHARS = "很大小漂亮可爱的简单"      # noise: characters outside the vocabulary ([UNK]) in some captions
SHARED_FROM = "../demo"


@dataclass(frozen=True)
class HParams:
    seed: int = 0
    threads: int = 2
    layers: int = 4
    heads: int = 4
    mlp_width: int = 256
    steps: int = 3000
    batch: int = 64
    lr: float = 2e-3
    warmup: int = 200
    final_lr_fraction: float = 0.02
    weight_decay: float = 0.01
    english_fraction: float = 0.25   # of each batch: English captions (their own teacher states)
    empty_fraction: float = 0.04     # the empty prompt (the negative half of guidance)
    noise_prob: float = 0.15         # per Chinese caption: one of the noises above


def lr_at(step: int, total: int, warmup: int, final: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * p))


# --- 1. vocabulary ---------------------------------------------------------------------------------------------


def english_captions() -> list[str]:
    return sorted({D.caption(*c, template=t) for c in D.ALL_COMBOS for t in range(len(D.TEMPLATES))})


def build_vocab() -> list[str]:
    """Special tokens, punctuation, every character of the Chinese captions, every English caption word."""
    chars = sorted({ch for text in Z.all_captions_zh() for ch in text if ch not in PUNCTUATION})
    words = sorted({w for text in english_captions() for w in re.findall(r"[a-z]+", text)})
    return SPECIALS + PUNCTUATION + chars + words


# --- 2./3. distillation ----------------------------------------------------------------------------------------


class Teacher:
    """The demo CLIP text encoder's states for English captions, computed once per caption."""

    def __init__(self):
        ckpt = open_model(model_path())
        self.tok, self.te = ckpt.tokenizer(), ckpt.load("text_encoder", torch.float32)
        texts = [""] + english_captions()
        with torch.no_grad():
            states = torch.cat([self.te(self.tok(texts[i:i + 256])) for i in range(0, len(texts), 256)])
        self.index = {t: i for i, t in enumerate(texts)}
        self.states = states                                        # (captions, 77, 64)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return self.states[[self.index[t] for t in texts]]


def noisy(text: str, rng: np.random.Generator) -> str:
    kind = int(rng.integers(4))
    if kind == 0:
        return text + str(rng.choice(["。", "！", ".", "!"]))
    if kind == 1 and "，" in text:
        return text.replace("，", str(rng.choice([",", " ", "、"])))
    if kind == 2:
        pos = int(rng.integers(len(text) + 1))
        return text[:pos] + str(rng.choice(list(UNKNOWN_CHARS))) + text[pos:]
    return " " + text + " "


def sample_batch(hp: HParams, rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """(student captions, the English captions whose teacher states they learn)."""
    students, targets = [], []
    for _ in range(hp.batch):
        r = rng.random()
        combo = D.ALL_COMBOS[int(rng.integers(len(D.ALL_COMBOS)))]
        if r < hp.empty_fraction:
            students.append("")
            targets.append("")
        elif r < hp.empty_fraction + hp.english_fraction:
            text = D.caption(*combo, template=D.random_template(rng))
            students.append(text)
            targets.append(text)
        else:
            template = Z.random_template_zh(rng)
            text = Z.caption_zh(*combo, template=template, shape_name=int(rng.integers(len(Z.SHAPES_ZH[combo[1]]))))
            students.append(noisy(text, rng) if rng.random() < hp.noise_prob else text)
            targets.append(Z.english_for(combo, template))
    return students, targets


def distill(hp: HParams, tok: WordPieceTokenizer, teacher: Teacher, log) -> tuple[BertTextEncoder, list]:
    cfg = BertTextConfig(vocab_size=tok.vocab_size, max_positions=tok.max_length, width=teacher.te.config.width,
                         layers=hp.layers, heads=hp.heads, mlp_width=hp.mlp_width)
    student = BertTextEncoder(cfg)
    g = torch.Generator().manual_seed(hp.seed)
    with torch.no_grad():   # BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms
        for name, p in student.named_parameters():
            if name.endswith("LayerNorm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    student.train()
    opt = torch.optim.AdamW(student.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.99))
    rng = np.random.default_rng(hp.seed)
    history = []
    t0 = time.perf_counter()
    for step in range(hp.steps):
        texts, targets = sample_batch(hp, rng)
        for group in opt.param_groups:
            group["lr"] = hp.lr * lr_at(step, hp.steps, hp.warmup, hp.final_lr_fraction)
        loss = (student(tok(texts)) - teacher(targets)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        history.append(loss.item())
        if step % 500 == 0 or step == hp.steps - 1:
            log(f"step {step:5d}  loss {np.mean(history[-100:]):.5f}  {time.perf_counter() - t0:.0f} s")
    return student.eval().requires_grad_(False), history


def distillation_error(student, tok, teacher) -> dict[str, float]:
    """Relative error of the student's states (|student - teacher| / |teacher|, Frobenius, mean over captions):
    canonical Chinese captions, every full Chinese paraphrase, English captions."""
    sets = {
        "Chinese, canonical": [(Z.prompt_zh(c), D.prompt(c)) for c in D.ALL_COMBOS],
        "Chinese, all templates and shape names": [
            (Z.caption_zh(*c, template=t, shape_name=n), Z.english_for(c, t)) for c in D.ALL_COMBOS
            for t in range(len(Z.TEMPLATES_ZH)) for n in range(len(Z.SHAPES_ZH[c[1]]))],
        "English, all templates": [(D.caption(*c, template=t),) * 2 for c in D.ALL_COMBOS
                                   for t in range(len(D.TEMPLATES))],
        "empty prompt": [("", "")],
    }
    out = {}
    with torch.no_grad():
        for name, pairs in sets.items():
            errs = []
            for i in range(0, len(pairs), 256):
                chunk = pairs[i:i + 256]
                s = student(tok([p[0] for p in chunk]))
                t = teacher([p[1] for p in chunk])
                errs += ((s - t).flatten(1).norm(dim=1) / t.flatten(1).norm(dim=1)).tolist()
            out[name] = float(np.mean(errs))
    return out


# --- 4. the folder ---------------------------------------------------------------------------------------------


def write_folder(folder: Path, student: BertTextEncoder, vocab: list[str], max_length: int) -> None:
    """demo-zh: text_encoder/ and tokenizer/ of its own; UNet, VAE and scheduler shared from ../demo."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "text_encoder").mkdir(parents=True)
    (tmp / "tokenizer").mkdir()
    index = json.loads((model_path() / "model_index.json").read_text())
    index.update({"_sdlite_shared_from": SHARED_FROM, "text_encoder": ["transformers", "BertModel"],
                  "tokenizer": ["transformers", "BertTokenizer"]})
    write = lambda path, data: path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n",  # noqa: E731
                                               encoding="utf-8")
    write(tmp / "model_index.json", index)
    write(tmp / "text_encoder" / "config.json", student.config.to_diffusers())
    save_safetensors({k: v.contiguous() for k, v in student.state_dict().items()},
                     tmp / "text_encoder" / "model.safetensors", metadata={"format": "pt"})
    (tmp / "tokenizer" / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    special = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
               "mask_token": "[MASK]"}
    write(tmp / "tokenizer" / "special_tokens_map.json", special)
    write(tmp / "tokenizer" / "tokenizer_config.json", {
        **special, "tokenizer_class": "BertTokenizer", "do_lower_case": True, "tokenize_chinese_chars": True,
        "strip_accents": None, "model_max_length": max_length})
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def evaluate_all(folder: Path, log) -> tuple[dict, dict]:
    """Every combination (224) with each prompt set; returns (scores, per-set classifications and prompts)."""
    zh = Engine.load(folder)
    en = Engine.load(model_path())
    rng = np.random.default_rng(1)
    paraphrases = {c: Z.paraphrase_zh(c, rng) for c in D.ALL_COMBOS}
    sets = {
        "Chinese, canonical (demo-zh)": (zh, Z.prompt_zh),
        "Chinese, random paraphrase (demo-zh)": (zh, paraphrases.__getitem__),
        "English, canonical (demo-zh)": (zh, D.prompt),
        "English, canonical (demo, for comparison)": (en, D.prompt),
    }
    scores, details = {}, {}
    combos = list(D.ALL_COMBOS)
    for name, (engine, prompts) in sets.items():
        t0 = time.perf_counter()
        images = generate(engine, combos, prompts=prompts)
        results = [classify(im) for im in images]
        scores[name] = score(results, combos)
        details[name] = {"images": images, "results": results, "prompts": [prompts(c) for c in combos]}
        held = [i for i, c in enumerate(combos) if c in set(D.HELD_OUT)]
        scores[name]["held_out"] = score([results[i] for i in held], [combos[i] for i in held])
        log(f"{name}: colour {scores[name]['colour']:.1%} shape {scores[name]['shape']:.1%} background "
            f"{scores[name]['background']:.1%} all {scores[name]['all']:.1%} ({time.perf_counter() - t0:.0f} s)")
    return scores, details


# --- report and figure -----------------------------------------------------------------------------------------

FONT_PATHS = ("/usr/share/fonts/truetype/wqy/wqy-microhei.ttc", "/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc",
              "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",
              "/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf")


def cjk_font(size: int):
    for path in FONT_PATHS:
        if Path(path).is_file():
            return ImageFont.truetype(path, size)
    return None


def figure(details: dict, path: Path, picks: list[tuple[str, str, str]]) -> bool:
    """A grid: for each picked combination, the Chinese prompt, its image from demo-zh, and the English prompt's
    image from demo. False (no figure) when no font with Chinese characters is installed."""
    font = cjk_font(13)
    if font is None:
        return False
    combos = list(D.ALL_COMBOS)
    zh, en = details["Chinese, canonical (demo-zh)"], details["English, canonical (demo, for comparison)"]
    cell, scale, cols = 150, 2, 4
    rows = math.ceil(len(picks) / cols)
    canvas = Image.new("RGB", (cols * cell * 2, rows * (cell + 44)), "white")
    draw = ImageDraw.Draw(canvas)
    for k, combo in enumerate(picks):
        i = combos.index(combo)
        x, y = (k % cols) * cell * 2, (k // cols) * (cell + 44)
        for j, (det, label) in enumerate(((zh, zh["prompts"][i]), (en, "English: demo"))):
            im = det["images"][i].resize((64 * scale, 64 * scale), Image.Resampling.NEAREST)
            canvas.paste(im, (x + j * cell + 11, y + 4))
            ok = det["results"][i].combo == combo
            draw.text((x + j * cell + 11, y + 64 * scale + 6), label if j == 0 else D.prompt(combo)[:24],
                      fill="black" if ok else "red", font=font)
        draw.text((x + 11, y + 64 * scale + 24), "demo-zh  |  demo", fill="gray", font=font)
    canvas.save(path)
    return True


def readme_picture(path: Path, engine_folder: Path) -> str | None:
    """The picture of docs/chinese.md and docs/models/taiyi.md: the default Chinese prompt's image, with the prompt
    written under it."""
    font = cjk_font(16)
    if font is None:
        return None
    from sdlite.pipeline import Request

    prompt = "蓝色背景上的红色圆形"
    image = Engine.load(engine_folder).generate(Request(prompt=prompt, seed=1)).images[0]
    canvas = Image.new("RGB", (256, 290), "white")
    canvas.paste(image.resize((256, 256), Image.Resampling.NEAREST), (0, 0))
    ImageDraw.Draw(canvas).text((8, 264), f"{prompt}  (seed 1)", fill="black", font=font)
    canvas.save(path)
    return prompt


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def write_report(path: Path, hp: HParams, vocab, errors, scores, timings, figure_ok: bool, size: int,
                 params: int) -> None:
    lines = [
        "# demo-zh: the demo model reads Chinese",
        "",
        "Written by `tools/train_demo_zh.py` (seeded: the same hyper-parameters and thread count give the same "
        "model). `sdlite generate \"蓝色背景上的红色圆形\"` uses it without `--model`; `--model demo-zh` names it.",
        "",
        "**What it is.** A second text encoder for the shipped demo model: a tiny BERT (the architecture of Taiyi's "
        f"text encoder, `sdlite/models/bert.py`: {hp.layers} layers, width 64, {hp.heads} heads, {params:,} "
        f"parameters) with a WordPiece vocabulary of {len(vocab)} tokens built from the caption data (every "
        "Chinese character of the captions, one token each, the English caption words, punctuation, the five "
        "special tokens). The folder `sdlite/data/demo-zh` holds only `text_encoder/` and `tokenizer/` "
        f"({size / 1024:.0f} KiB); its `model_index.json` names `{SHARED_FROM}` (`_sdlite_shared_from`) for the "
        "UNet, VAE and scheduler, which are shared, not copied.",
        "",
        "**Why a second encoder rather than one bilingual model.** The demo UNet was trained on the CLIP encoder's "
        "states, so a new encoder that reproduces those states needs no change to the UNet, the VAE or the English "
        "demo (whose figures and tests stay as they are), costs a few minutes of CPU instead of the demo's hour, "
        "and adds well under 1 MB to the package. It also exercises the Taiyi path end to end: a BERT text encoder "
        "with a WordPiece tokenizer in a diffusers folder. It reads English too (its captions are in the "
        "distillation), so `--model demo-zh` also takes English prompts.",
        "",
        "**How it is trained: distillation.** For a caption of a scene, the student learns to output, at all 77 "
        "positions, the demo CLIP encoder's hidden states for the English caption of that scene: a full Chinese "
        "caption (7 paraphrase templates, several names per shape, e.g. 圆形/圆/圆圈) the canonical English "
        "caption's, a partial one (一个红色的圆形, 蓝色背景上的圆形) the English partial caption's, an English "
        "caption its own, the empty prompt (the negative half of guidance) the empty prompt's. The student's "
        "length is 77 tokens (`model_max_length` 77), as the teacher's. Loss: mean squared error over the states; "
        f"{hp.steps} steps of {hp.batch} captions, AdamW, lr {hp.lr} with warm-up and cosine decay; light noise "
        "on some Chinese captions (trailing punctuation, a comma written otherwise, an unknown character).",
        "",
        "## Distillation error",
        "",
        "|student's states vs the teacher's| / |teacher's|, mean over captions:",
        "",
        "| captions | relative error |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value:.4f} |" for name, value in errors.items()]
    lines += [
        "",
        "## What it draws: all 224 combinations",
        "",
        f"One image per combination of 8 colours x 4 shapes x 7 background colours ({DEFAULT_STEPS} steps, cfg "
        f"{DEFAULT_CFG}, the default sampler, seed {EVAL_SEED} + i), classified by `sdlite.demo.classify`. The "
        "16 combinations held out of the demo UNet's training are included (and shown apart). The paraphrase of "
        "each combination is drawn at random (seeded) from the full templates and shape names.",
        "",
        "| prompts | colour | shape | background | all three | held out: colour | held out: shape |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in scores.items():
        h = s["held_out"]
        lines.append(f"| {name} | {pct(s['colour'])} | {pct(s['shape'])} | {pct(s['background'])} | "
                     f"{pct(s['all'])} | {pct(h['colour'])} | {pct(h['shape'])} |")
    lines += ["", "The shape figures are bounded by the demo UNet itself (its English row): the Chinese encoder "
              "only has to say what the English one says."]
    if figure_ok:
        lines += ["", "![demo-zh outputs](demo_zh.png)", "",
                  "Left of each pair: the canonical Chinese prompt through demo-zh; right: the English prompt "
                  "through the demo model (same seed). A label in red: the classifier disagrees with the prompt."]
    lines += ["", "## Run", "", "| stage | time |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} s |" for k, v in timings.items()]
    lines += ["", "| hyper-parameter | value |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in dataclasses.asdict(hp).items()]
    lines += ["", f"torch {torch.__version__}, {platform.machine()}, {hp.threads} threads.", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run written under build/demo_zh_quick/")
    ap.add_argument("--no-eval", action="store_true", help="skip the image evaluation")
    args = ap.parse_args(argv)
    hp = HParams()
    if args.quick:
        hp = dataclasses.replace(hp, steps=300)
    out_dir = ROOT / "build" / "demo_zh_quick" if args.quick else ROOT
    folder = out_dir / "sdlite" / "data" / "demo-zh" if args.quick else ROOT / "sdlite" / "data" / "demo-zh"
    docs = out_dir / "docs"
    folder.parent.mkdir(parents=True, exist_ok=True)
    docs.mkdir(parents=True, exist_ok=True)
    if args.quick:   # the shared parts, reached through the same relative path
        link = folder.parent / "demo"
        if not link.exists():
            link.symlink_to(model_path(), target_is_directory=True)
    torch.manual_seed(hp.seed)
    torch.set_num_threads(hp.threads)
    log = print
    timings = {}
    t = time.perf_counter()
    vocab = build_vocab()
    tok = WordPieceTokenizer(vocab, max_length=77)
    teacher = Teacher()
    timings["vocabulary and teacher states"] = time.perf_counter() - t
    log(f"vocabulary: {len(vocab)} tokens; teacher states: {tuple(teacher.states.shape)}")
    t = time.perf_counter()
    student, history = distill(hp, tok, teacher, log)
    timings["distillation"] = time.perf_counter() - t
    errors = distillation_error(student, tok, teacher)
    for k, v in errors.items():
        log(f"relative error, {k}: {v:.4f}")
    write_folder(folder, student, vocab, tok.max_length)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    params = sum(p.numel() for p in student.parameters())
    if args.no_eval:
        return 0
    torch.set_num_threads(1)   # the demo model is tiny: one thread is faster
    t = time.perf_counter()
    scores, details = evaluate_all(folder, log)
    timings["evaluation (4 x 224 images)"] = time.perf_counter() - t
    picks = [("red", "circle", "blue"), ("green", "star", "yellow"), ("yellow", "triangle", "black"),
             ("white", "square", "purple"), ("orange", "star", "green"), ("purple", "circle", "white"),
             ("blue", "square", "orange"), ("black", "triangle", "red")]
    figure_ok = figure(details, docs / "demo_zh.png", picks)
    readme_picture(docs / "chinese_demo.png", folder)
    write_report(docs / "demo_zh.md", hp, vocab, errors, scores, timings, figure_ok, size, params)
    (out_dir / "build").mkdir(exist_ok=True)
    (out_dir / "build" / "demo_zh_scores.json").write_text(json.dumps(
        {"errors": errors, "scores": scores, "loss": history[::50]}, indent=1), encoding="utf-8")
    log(f"wrote {folder} ({size / 1024:.0f} KiB) and {docs / 'demo_zh.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
