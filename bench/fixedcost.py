"""Where a warm engine's fixed cost per image goes: everything but the denoising steps, for a one-step 512^2 image
with a TAESD decoder (the real-time CPU workload of issue 38), split into text encoding and decode.

    python bench/fixedcost.py [--size 512] [--images 4]

One process, one engine (precision auto) on the full-size random SD 1.5 of bench/checkpoint.py, a random diffusers
``AutoencoderTiny`` (bench/cache/taesd-sd, as bench/fewstep.py makes it) as the decoder. Three ways, each ``--images``
images (the first untimed), medians:

* ``TAESD fp32, text encoded``: the TAESD as loaded (fp32, contiguous), every prompt encoded -- what the engine did
  before the TAESD followed the VAE's precision (``ModelManager.adapt_like_vae``);
* ``TAESD as the VAE, text encoded``: the TAESD in the VAE's dtype and memory format, a new prompt each image;
* ``TAESD as the VAE, text remembered``: the same prompt each image, whose encoding the warm engine keeps
  (``LoadedModel.encoded_texts``).

Euler a, trailing spacing, cfg 1 (no guidance), seeds 1, 2, ... Writes bench/fixedcost.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def taesd_folder() -> Path:
    folder = HERE / "cache" / "taesd-sd"
    if not (folder / "config.json").is_file():
        import torch
        from diffusers import AutoencoderTiny

        torch.manual_seed(0)
        AutoencoderTiny().save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--images", type=int, default=4)
    args = ap.parse_args()

    import checkpoint

    from sdlite.engine.memory import ModelManager
    from sdlite.pipeline import Engine, Request
    from sdlite.weights.taesd import load_taesd

    engine = Engine.load(checkpoint.build()[0])
    taesd = load_taesd(taesd_folder(), "sd")
    as_vae = ModelManager.adapt_like_vae
    rows = {}
    for label, adapt, same_prompt in (("TAESD fp32, text encoded", False, False),
                                      ("TAESD as the VAE, text encoded", True, False),
                                      ("TAESD as the VAE, text remembered", True, True)):
        ModelManager.adapt_like_vae = as_vae if adapt else (lambda self, module: module.to(self.device))
        engine.set_vae_decoder(taesd)
        runs = []
        for i in range(args.images):
            # a new prompt for every image of the ways that encode (none the engine has seen), one for all otherwise
            prompt = "a photo of a cat" + ("" if same_prompt else f", {label}, image {i}")
            r = Request(prompt, steps=1, cfg_scale=1.0, sampler="euler_a", timestep_spacing="trailing", seed=1 + i,
                        width=args.size, height=args.size)
            t = time.perf_counter()
            result = engine.generate(r)
            wall = time.perf_counter() - t
            runs.append({**result.timings, "wall": wall, "fixed": wall - result.timings["sampling"]})
        rows[label] = {k: statistics.median(run[k] for run in runs[1:]) for k in runs[1]}
        rows[label]["taesd dtype"] = str(engine.vae_decoder.dtype)
    ModelManager.adapt_like_vae = as_vae
    raw = {"size": args.size, "images": args.images, "precision": engine.precision.label,
           "machine": platform.processor() or platform.machine(), "rows": rows}
    (HERE / "fixedcost.json").write_text(json.dumps(raw, indent=1))
    print(f"precision {engine.precision.label}, {args.size}^2, 1 step, medians of {args.images - 1} images")
    print("| way | text, s | decode, s | fixed (all but the step), s | the step, s | TAESD dtype |")
    print("|---|---|---|---|---|---|")
    for label, row in rows.items():
        print(f"| {label} | {row['text']:.3f} | {row['decode']:.3f} | {row['fixed']:.3f} | {row['sampling']:.3f} "
              f"| {row['taesd dtype']} |")


if __name__ == "__main__":
    main()
