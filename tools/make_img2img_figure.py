#!/usr/bin/env python
"""Draw docs/img2img_demo.png: image to image, inpainting and outpainting with the shipped demo model.

    python tools/make_img2img_figure.py            # writes docs/img2img_demo.png (same pixels on every run)
    python tools/make_img2img_figure.py --out x.png
    python tools/make_img2img_figure.py --sources DIR   # also writes the sources and the mask there, for the CLI

One row per capability, each from a source drawn by the demo model's own training-data renderer and a fixed
seed; every 64x64 pixel is shown as a 3x3 block (NEAREST), so all panels share one scale. The script prints
what the automatic classifier (sdlite.demo.classify) makes of each result, for the figure's caption.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sdlite.demo import model_path  # noqa: E402
from sdlite.demo import data as D  # noqa: E402
from sdlite.demo.classify import classify, nearest_colour  # noqa: E402
from sdlite.pipeline import Engine, Request  # noqa: E402
from sdlite.sources import outpaint_canvas  # noqa: E402

SCALE = 3                      # 64 px -> 192 px panels, the 128 px outpainting -> 384 px
GAP, LABEL_H, MARGIN, FONT_SIZE = 12, 36, 12, 13
BACKGROUND, INK = (255, 255, 255), (0, 0, 0)

# the settings drawn (and tested in tests/test_demo_img2img.py); every other Request field at its default
IMG2IMG = dict(scene=D.Scene("red", "circle", "blue", 32, 32, 36), prompt="a blue circle on a yellow background",
               strengths=(0.5, 0.8), seed=0)
INPAINT = dict(scene=D.Scene("red", "circle", "blue", 32, 32, 28), box=(16, 16, 48, 48),
               prompt="a yellow star on a blue background", seed=0)
OUTPAINT = dict(scene=D.Scene("red", "circle", "blue", 32, 32, 36), outpaint=(32, 32, 32, 32),
                prompt="a red circle on a blue background", seed=0)


def square_mask(box, size: int = D.IMAGE_SIZE) -> Image.Image:
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=255)
    return mask


def panels(engine: Engine) -> list[list[tuple[Image.Image, str]]]:
    """The rows: (image, two-line label) each."""
    rows = []

    src = Image.fromarray(D.render(IMG2IMG["scene"]))
    row = [(src, "image to image\nsource")]
    for strength in IMG2IMG["strengths"]:
        out = engine.generate(Request(IMG2IMG["prompt"], init_image=src, strength=strength,
                                      seed=IMG2IMG["seed"])).images[0]
        row.append((out, f"strength {strength:g}\n{describe(out)}"))
    rows.append(row)

    src = Image.fromarray(D.render(INPAINT["scene"]))
    mask = square_mask(INPAINT["box"])
    out = engine.generate(Request(INPAINT["prompt"], init_image=src, mask=mask, seed=INPAINT["seed"])).images[0]
    rows.append([(src, "inpainting\nsource"), (mask.convert("RGB"), "mask (white = repaint)\n32x32, blur 4"),
                 (out, f"result\n{describe(out)}")])

    src = Image.fromarray(D.render(OUTPAINT["scene"]))
    out = engine.generate(Request(OUTPAINT["prompt"], init_image=src, outpaint=OUTPAINT["outpaint"],
                                  seed=OUTPAINT["seed"])).images[0]
    sides = ",".join(map(str, OUTPAINT["outpaint"]))
    rows.append([(src, "outpainting\nsource 64x64"),
                 (out, f"outpaint {sides}: {out.width}x{out.height}\nnew border's median: {border_colour(out)}")])
    return rows


def describe(image: Image.Image) -> str:
    c = classify(image)
    return f"= {c.colour} {c.shape} on {c.background}"


def border_colour(image: Image.Image) -> str:
    """The palette colour nearest the median of the outpainted border's pixels."""
    _, border = outpaint_canvas(Image.fromarray(D.render(OUTPAINT["scene"])), *OUTPAINT["outpaint"])
    ring = np.asarray(image.convert("RGB"))[np.asarray(border) == 255]
    return nearest_colour(np.median(ring, axis=0))


def compose(rows) -> Image.Image:
    heights = [max(im.height for im, _ in row) * SCALE + LABEL_H for row in rows]
    widths = [sum(im.width * SCALE for im, _ in row) + GAP * (len(row) - 1) for row in rows]
    sheet = Image.new("RGB", (max(widths) + 2 * MARGIN, sum(heights) + GAP * (len(rows) - 1) + 2 * MARGIN),
                      BACKGROUND)
    try:
        font = ImageFont.load_default(size=FONT_SIZE)   # Pillow >= 10.1: the default font, scalable
    except TypeError:
        font = ImageFont.load_default()
    draw = ImageDraw.Draw(sheet)
    y = MARGIN
    for row, height in zip(rows, heights):
        x = MARGIN
        for image, label in row:
            draw.multiline_text((x, y), label, fill=INK, font=font, spacing=2)
            big = image.resize((image.width * SCALE, image.height * SCALE), Image.Resampling.NEAREST)
            sheet.paste(big, (x, y + LABEL_H))
            x += big.width + GAP
        y += height + GAP
    return sheet


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img2img_demo.png")
    p.add_argument("--sources", type=Path, default=None,
                   help="also write circle.png (rows 1 and 3), small-circle.png and square.png (row 2) here")
    args = p.parse_args(argv)
    if args.sources is not None:
        args.sources.mkdir(parents=True, exist_ok=True)
        assert IMG2IMG["scene"] == OUTPAINT["scene"]
        Image.fromarray(D.render(IMG2IMG["scene"])).save(args.sources / "circle.png")
        Image.fromarray(D.render(INPAINT["scene"])).save(args.sources / "small-circle.png")
        square_mask(INPAINT["box"]).save(args.sources / "square.png")
    torch.set_num_threads(1)   # the demo model is tiny: one thread is as fast, and the same on every machine
    engine = Engine.load(model_path())
    rows = panels(engine)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    compose(rows).save(args.out, optimize=True)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    print(f"image to image: {IMG2IMG['prompt']!r}, strengths {IMG2IMG['strengths']}, seed {IMG2IMG['seed']}")
    print(f"inpainting: {INPAINT['prompt']!r}, mask box {INPAINT['box']}, seed {INPAINT['seed']}")
    print(f"outpainting: {OUTPAINT['prompt']!r}, outpaint {OUTPAINT['outpaint']}, seed {OUTPAINT['seed']}")
    for row in rows:
        print(" | ".join(label.replace("\n", " ") for _, label in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
