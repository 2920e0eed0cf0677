"""How far each transformer precision moves the image from exact, beside how far diffusers' own bf16 moves it
(issue 55: "the default's error is within diffusers bf16's own error against fp32").

    python bench/dit_quality.py [--family flux|sd3] [--seeds 4] [--steps 4] [--size 256] [--blocks 2,4]
                                [--precisions exact,bf16,bf16-int8,...] [--t5-layers N] [--work DIR] [--json PATH]
                                [--md PATH]

The model is bench/lowbit_precision.py's: a diffusers folder whose transformer has the released widths and few blocks
(FLUX.1-schnell 3072 wide, 24 heads, 2 double + 4 single blocks by default; SD3.5 Large 2432 wide, 38 heads, 4 joint
blocks), PyTorch's default initialisation, the tests' tiny text encoders and VAE, saved in bf16. Each row runs in its
own process: one batch of ``--seeds`` images (seeds 0..n-1; FLUX 4 Euler steps without CFG, SD3.5 at cfg 1).

Rows (``--precisions``):

* ``exact``, ``bf16``, ``bf16-int8``: ``sdlite.Engine.load(folder, precision=...)``;
* ``bf16-int8-per-call``: bf16-int8 with one activation scale per call instead of per token (what bf16-int8 was before
  per-token scales; kept here to measure what they changed);
* ``bf16-int8-t5-bf16``: bf16-int8 with T5 left in bf16 (what bf16-int8 was before T5's block Linears took int8: the
  difference is T5's int8 share); with ``--t5-layers N`` the T5 is one at T5-XXL's widths with N layers, so its int8
  error is that of a real width;
* ``diffusers-fp32``, ``diffusers-bf16``: diffusers' pipeline from the same folder in that dtype, one generator per
  image seeded 0..n-1 (sdlite's seeds). ``diffusers-fp32`` against sdlite's ``exact`` checks the comparison itself
  (the same bits, so +inf dB); ``diffusers-bf16`` against it is the bar a faster default is held to.

Against exact: each image's PSNR (8-bit pixels decoded by the tiny random VAE) and the relative L2 error of its final
latents. Random weights: the images are noise-like, so this measures how far the arithmetic moved, not how an image
looks; and random weights have no outlier channels, which trained ones have.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from lowbit_precision import _load_average, against, bench_folder  # noqa: E402
from parity import cpu_name  # noqa: E402

ROWS = ("exact", "diffusers-fp32", "diffusers-bf16", "bf16", "bf16-int8", "bf16-int8-per-call", "bf16-int8-t5-bf16")
PROMPT = "a lighthouse on a cliff at dawn"


def run_sdlite(folder: Path, precision: str, seeds: int, steps: int, size: int, out: Path) -> None:
    import numpy as np
    import resource
    import time

    from sdlite.engine import quant
    from sdlite.pipeline import Engine, Request

    if precision == "bf16-int8-per-call":
        plain = quant._bf16_int8_layer
        quant._bf16_int8_layer = lambda layer, split, stored_as=None, per_token=False, outliers=None: \
            plain(layer, split, stored_as)
    if precision == "bf16-int8-t5-bf16":
        from sdlite.engine.memory import ModelManager
        ModelManager._t5_int8 = lambda self, name: False
    engine = Engine.load(folder, precision=precision.removesuffix("-per-call").removesuffix("-t5-bf16"))
    start = time.perf_counter()
    result = engine.generate(Request(prompt=PROMPT, steps=steps, cfg_scale=1.0, sampler="euler", seed=0, width=size,
                                     height=size, batch_size=seeds))
    pixels = np.stack([np.asarray(im, dtype=np.uint8) for im in result.images])
    np.savez(out, pixels=pixels, latents=result.latents.float().numpy(),
             meta=json.dumps({"label": engine.precision.label, "generate_s": time.perf_counter() - start,
                              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def run_diffusers(folder: Path, dtype_name: str, seeds: int, steps: int, size: int, out: Path) -> None:
    import numpy as np
    import resource
    import time

    import torch
    from diffusers import DiffusionPipeline

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
    flux = type(pipe).__name__.startswith("Flux")
    kw = dict(max_sequence_length=256) if flux else {}
    generators = [torch.Generator().manual_seed(s) for s in range(seeds)]
    start = time.perf_counter()
    with torch.no_grad():
        latents = pipe([PROMPT] * seeds, num_inference_steps=steps, guidance_scale=1.0, height=size, width=size,
                       generator=generators, output_type="latent", **kw).images
        if flux:
            latents = pipe._unpack_latents(latents, size, size, pipe.vae_scale_factor)
        vae = pipe.vae
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        image = vae.decode(latents / vae.config.scaling_factor + shift).sample
    pixels = ((image.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    np.savez(out, pixels=pixels, latents=latents.float().numpy(),
             meta=json.dumps({"label": f"diffusers {dtype_name}", "generate_s": time.perf_counter() - start,
                              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def quality(family: str, rows: list[str], seeds: int, steps: int, size: int, work: Path,
            blocks: tuple[int, ...], t5_layers: int = 0) -> dict:
    import numpy as np

    folder, blocks, _ = bench_folder(family, work, blocks, t5_layers)
    runs = {}
    for row in rows:
        out = work / f"{family}-{row}-{seeds}x{size}-{steps}.npz"
        subprocess.run([sys.executable, __file__, "run", "--row", row, "--folder", str(folder), "--seeds", str(seeds),
                        "--steps", str(steps), "--size", str(size), "--out", str(out)], check=True)
        data = np.load(out)
        runs[row] = {"pixels": data["pixels"], "latents": data["latents"], **json.loads(str(data["meta"]))}
        print(f"{family} {row}: {seeds} images in {runs[row]['generate_s']:.1f} s", flush=True)
    exact = runs["exact"]
    result = {"family": family, "seeds": seeds, "steps": steps, "size": size, "blocks": list(blocks),
              "t5_layers": t5_layers, "load_average": _load_average(), "rows": {}}
    for row, m in runs.items():
        entry = {"label": m["label"], "generate_s": m["generate_s"], "peak_rss": m["peak_rss"]}
        if row != "exact":
            entry.update(against(m, exact, seeds))
            print(f"{family} {row}: PSNR against exact min {entry['psnr_min']:.2f} dB, mean {entry['psnr_mean']:.2f} "
                  f"dB; latents relative error mean {entry['latent_rel_mean']:.4f}, max {entry['latent_rel_max']:.4f}",
                  flush=True)
            if row.startswith("bf16-int8") and "bf16" in runs:   # what int8 adds to bf16's own rounding
                vs = against(m, runs["bf16"], seeds)
                entry.update(latent_rel_vs_bf16_mean=vs["latent_rel_mean"], psnr_vs_bf16_min=vs["psnr_min"])
                print(f"{family} {row} against sdlite bf16: latents {vs['latent_rel_mean']:.4f}, PSNR min "
                      f"{vs['psnr_min']:.2f} dB", flush=True)
        result["rows"][row] = entry
    return result


def markdown(result: dict) -> str:
    q = result
    t5 = f", T5 {q['t5_layers']} layers at T5-XXL's widths" if q.get("t5_layers") else ""
    lines = [f"## {q['family']}: blocks {q['blocks']}{t5}, {q['seeds']} seeds, {q['size']}x{q['size']}, {q['steps']} "
             f"steps (load average {q.get('load_average')})", "",
             "| row | PSNR vs exact, min / mean (dB) | latents rel. error, mean / max | generate |", "|---|---|---|---|"]
    for row, e in q["rows"].items():
        cells = "-- | --" if row == "exact" else (f"{e['psnr_min']:.2f} / {e['psnr_mean']:.2f} | "
                                                  f"{e['latent_rel_mean']:.4f} / {e['latent_rel_max']:.4f}")
        lines.append(f"| {row} | {cells} | {e['generate_s']:.1f} s |")
    int8 = [(row, e) for row, e in q["rows"].items() if "latent_rel_vs_bf16_mean" in e]
    if int8:
        lines += ["", "Against sdlite's bf16 (what int8 adds to bf16's rounding): " + "; ".join(
            f"{row} latents {e['latent_rel_vs_bf16_mean']:.4f} relative, PSNR min {e['psnr_vs_bf16_min']:.2f} dB"
            for row, e in int8) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", nargs="?", default="quality", choices=["quality", "run"])
    ap.add_argument("--family", choices=["flux", "sd3"], default="flux")
    ap.add_argument("--precisions", default=",".join(ROWS))
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--blocks", default=None, help="FLUX: double,single (default 2,4); SD3.5: joint (default 4)")
    ap.add_argument("--t5-layers", type=int, default=0,
                    help="a T5 at T5-XXL's widths with this many layers (default: the tests' tiny T5)")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=HERE / "dit_quality.json")
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--row")
    ap.add_argument("--folder", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.what == "run":
        if args.row.startswith("diffusers-"):
            run_diffusers(args.folder, args.row.removeprefix("diffusers-"), args.seeds, args.steps, args.size, args.out)
        else:
            run_sdlite(args.folder, args.row, args.seeds, args.steps, args.size, args.out)
        return
    rows = [r.strip() for r in args.precisions.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or "exact" not in rows:
        sys.exit(f"--precisions: {unknown or 'exact'} {'unknown' if unknown else 'is needed'} (rows: {', '.join(ROWS)})")
    work = args.work or Path(tempfile.mkdtemp(prefix="dit-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    blocks = tuple(int(b) for b in args.blocks.split(",")) if args.blocks else None
    result = quality(args.family, rows, args.seeds, args.steps, args.size, work, blocks, args.t5_layers)
    result["machine"] = f"{platform.processor() or platform.machine()}, {cpu_name()}"
    results = json.loads(args.json.read_text()) if args.json.exists() else {}
    results[f"{args.family}-{args.size}" + (f"-t5x{args.t5_layers}" if args.t5_layers else "")] = result
    args.json.write_text(json.dumps(results, indent=1))
    text = markdown(result)
    if args.md:
        args.md.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
