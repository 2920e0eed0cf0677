"""Large images: peak RSS and time of attention and of untiled vs tiled VAE decoding, full-size SD VAE.

    python bench/tiled_vae.py [--only attention|decode|accuracy] [--out bench/out]

Every case runs in a fresh process; its peak RSS is the child's ``ru_maxrss`` (whole process: Python, torch,
the fp32 VAE's 335 MB of weights and the work), its time is measured inside the child around the call alone.
Random weights at SD 1.5's VAE shapes (``sdlite.config.SD15.vae``, fp32), seeded; time and memory do not depend
on the values. The latent has large-scale structure (smooth blobs plus noise), so that tile-local GroupNorm
statistics would differ from the whole image's.

Cases:
  attention  one single-head 512-channel self-attention (the VAE mid-block's) of 4096 and 16384 tokens (the
             latents of 512^2 and 1024^2 images): PyTorch's SDPA as dispatched, SDPA forced to its math
             kernel, and the math kernel sliced to 1024 queries (sdlite.engine.attention).
  decode     untiled decode at 512^2 and 1024^2; tiled decode (sdlite.engine.tiling) at 512^2 (tile 32 latent
             pixels: the default 64 covers 512^2 in one tile, which runs untiled), 1024^2 and 2048^2 (tile 64).
  accuracy   512^2: untiled vs tiled with tiles of 16 and 32 latent pixels: max difference in uint8 levels after
             (x/2+0.5).clamp(0,1)*255 rounding, max absolute difference, seam strength (as in
             tests/test_tiling.py), and a crop around a junction of four 16-pixel tiles (untiled | tiled |
             difference x16), enlarged 4x, written to <out>/seam_crop.png.

Writes the tables to stdout and to <out>/tiled_vae.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# --- child side ------------------------------------------------------------------------------------------------

def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _vae():
    import torch

    from sdlite.config import SD15
    from sdlite.models.vae import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(SD15.vae).eval()


def _latent(size: int, seed: int = 0):
    """(1, 4, size/8, size/8): smooth blobs an eighth of the latent across (amplitude 2) plus noise."""
    import torch
    import torch.nn.functional as F

    h = size // 8
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(1, 4, h // 8, h // 8, generator=g) * 2
    return F.interpolate(coarse, size=(h, h), mode="bilinear") + 0.5 * torch.randn(1, 4, h, h, generator=g)


def child_attention(tokens: int, mode: str) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sdlite.engine.attention import set_attention_slicing
    from sdlite.models.layers import Attention

    torch.manual_seed(0)
    attn = Attention(512, heads=1, qkv_bias=True).eval()
    x = torch.randn(1, tokens, 512)
    with torch.no_grad():
        attn(x[:, :64])  # warm up: kernels, thread pool
        base = _rss_mb()
        if mode.startswith("math"):
            if mode != "math":
                set_attention_slicing(attn, int(mode.split("-")[-1]))
            with sdpa_kernel(SDPBackend.MATH):
                t0 = time.perf_counter()
                attn(x)
        else:
            t0 = time.perf_counter()
            attn(x)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "base_mb": base}


def child_decode(size: int, tile: int | None) -> dict:
    import torch

    from sdlite.engine.tiling import tiled_decode

    vae = _vae()
    z = _latent(size)
    base = _rss_mb()
    t0 = time.perf_counter()
    with torch.no_grad():
        image = vae.decode(z) if tile is None else tiled_decode(vae, z, tile=tile)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "base_mb": base, "shape": list(image.shape)}


def child_accuracy(out_dir: str) -> dict:
    import torch

    from sdlite.engine.tiling import tiled_decode

    def uint8(x):
        return ((x / 2 + 0.5).clamp(0, 1) * 255).round()

    def seam_strength(out, ref):  # as in tests/test_tiling.py
        err, worst = (out - ref).double(), 0.0
        for dim, other in ((3, 2), (2, 3)):
            err_step = err.diff(dim=dim).abs().mean(dim=(0, 1, other))
            ref_step = ref.double().diff(dim=dim).abs().mean(dim=(0, 1, other))
            worst = max(worst, (err_step.max() / ref_step.median()).item())
        return worst

    vae = _vae()
    z = _latent(512)
    with torch.no_grad():
        ref = vae.decode(z)
    rows = []
    for tile in (16, 32):
        t0 = time.perf_counter()
        out = tiled_decode(vae, z, tile=tile)
        rows.append({"tile": tile, "tiles": (-(-64 // tile)) ** 2, "seconds": time.perf_counter() - t0,
                     "max_levels": (uint8(out) - uint8(ref)).abs().max().item(),
                     "max_abs": (out - ref).abs().max().item(),
                     "seam_strength": seam_strength(out, ref)})
        if tile == 16:
            crop = _write_crop(uint8(ref), uint8(out), 16 * 8, Path(out_dir) / "seam_crop.png")
    return {"rows": rows, "untiled_std": ref.std().item(), "crop": crop}


def _write_crop(ref, out, tile_px: int, path: Path, half: int = 48, zoom: int = 4) -> str:
    """Untiled | tiled | |difference| x16 around the junction of four tiles, enlarged ``zoom`` times; red ticks
    in the margins mark the tile edges."""
    import torch
    from PIL import Image, ImageDraw

    centre = tile_px
    lo, hi = centre - half, centre + half
    edges = [e - lo for e in range(0, ref.shape[-1] + 1, tile_px) if lo < e < hi]

    def panel(t):
        arr = t[0, :, lo:hi, lo:hi].permute(1, 2, 0).to(torch.uint8).numpy()
        return Image.fromarray(arr).resize((2 * half * zoom,) * 2, Image.NEAREST)

    diff = ((out - ref).abs() * 16).clamp(0, 255)
    panels = [panel(ref), panel(out), panel(diff)]
    margin, gap, side = 14, 10, 2 * half * zoom
    canvas = Image.new("RGB", (margin + 3 * side + 2 * gap, margin + side), "white")
    draw = ImageDraw.Draw(canvas)
    for i, p in enumerate(panels):
        x0 = margin + i * (side + gap)
        canvas.paste(p, (x0, margin))
        for e in edges:
            draw.line([(x0 + e * zoom, 0), (x0 + e * zoom, margin - 3)], fill="red", width=2)
    for e in edges:
        draw.line([(0, margin + e * zoom), (margin - 3, margin + e * zoom)], fill="red", width=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path.name
    return f"{shown} (pixels {lo}..{hi} in x and y; tile edges at {[e + lo for e in edges]})"


# --- parent side -----------------------------------------------------------------------------------------------

def run_child(args: list[str]) -> tuple[dict, float]:
    """(the child's JSON result, its peak RSS in MB)."""
    cmd = [sys.executable, __file__, "--child", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    _, status, usage = os.wait4(proc.pid, 0)
    stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()
    if status:
        raise SystemExit(f"case {' '.join(args)} failed (status {status}):\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1]), usage.ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["attention", "decode", "accuracy"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "attention":
            result = child_attention(int(rest[0]), rest[1])
        elif kind == "decode":
            result = child_decode(int(rest[0]), None if rest[1] == "none" else int(rest[1]))
        else:
            result = child_accuracy(rest[0])
        print(json.dumps(result))
        return

    import torch

    lines = [f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
             f"{torch.__version__} ({torch.get_num_threads()} threads), load average at start "
             f"{os.getloadavg()[0]:.1f}. Command: `python bench/tiled_vae.py`. fp32, batch 1.", ""]

    def emit(text=""):
        print(text, flush=True)
        lines.append(text)

    print(lines[0], flush=True)
    if args.only in (None, "attention"):
        emit("### Attention memory: one single-head 512-channel self-attention (VAE mid-block)")
        emit()
        emit("| tokens (image) | kernel | scores if materialised MB | peak RSS MB | RSS over baseline MB | s |")
        emit("|---|---|---|---|---|---|")
        for tokens, image in ((4096, "512^2"), (16384, "1024^2")):
            for mode, name in (("sdpa", "SDPA as dispatched (fused flash CPU kernel)"), ("math", "SDPA math kernel"),
                               ("math-sliced-1024", "math kernel, sliced to 1024 queries")):
                res, rss = run_child(["attention", str(tokens), mode])
                emit(f"| {tokens} ({image}) | {name} | {tokens * tokens * 4 / 2**20:.0f} | {rss:.0f} | "
                     f"{rss - res['base_mb']:.0f} | {res['seconds']:.1f} |")
        emit()
    if args.only in (None, "decode"):
        emit("### VAE decode, full-size SD VAE (fp32): peak RSS of the whole process and decode time")
        emit()
        emit("| image | decode | peak RSS MB | RSS before decode MB | s |")
        emit("|---|---|---|---|---|")
        for size, tile in ((512, None), (512, 32), (1024, None), (1024, 64), (2048, 64)):
            res, rss = run_child(["decode", str(size), str(tile).lower()])
            how = "untiled" if tile is None else f"tiled, tile {tile}"
            emit(f"| {size}^2 | {how} | {rss:.0f} | {res['base_mb']:.0f} | {res['seconds']:.0f} |")
        emit()
    if args.only in (None, "accuracy"):
        res, _ = run_child(["accuracy", args.out])
        emit("### Tiled vs untiled decode at 512^2 (latent 64x64), full-size SD VAE, random weights")
        emit()
        emit("| tile (latent px) | tiles per layer | max diff (uint8 levels) | max abs diff | seam strength | s |")
        emit("|---|---|---|---|---|---|")
        for r in res["rows"]:
            emit(f"| {r['tile']} | {r['tiles']} | {r['max_levels']:.0f} | {r['max_abs']:.2e} | "
                 f"{r['seam_strength']:.2e} | {r['seconds']:.0f} |")
        emit()
        emit(f"Crop: {res['crop']}. Untiled output std {res['untiled_std']:.3f}.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiled_vae.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
