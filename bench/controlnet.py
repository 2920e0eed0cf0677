"""ControlNet measured: what one ControlNet costs per step, beside diffusers, and memory mode 0's peak with one.

    python bench/controlnet.py step [--model FOLDER] [--size 512] [--rounds 3] [--calls 3]
    python bench/controlnet.py lowmem [--model FOLDER] [--size 512] [--steps 4]
    python bench/controlnet.py all [--out BENCHMARKS.md]          (what `make bench` runs; writes the section)

The ControlNet is a full-size SD 1.5 one (361M parameters, random weights: ``ControlNetModel.from_unet`` of the cached
SD 1.5's UNet, its zero convolutions given random values), built once into ``bench/cache/controlnet-sd15-fp16`` (fp16,
as the published .safetensors are).

`step`: one process per engine (sdlite default = auto precision, sdlite exact, diffusers fp32), in alternating
rounds. Each loads the model and the ControlNet, then times a denoising step's network calls at batch 2 (cfg on) on
fixed random latents, timestep, context and control image: the UNet alone, and the ControlNet followed by the UNet
given its residuals (diffusers: ``controlnet(...)`` then ``unet(..., down_block_additional_residuals=...)``, as its
pipeline calls them; sdlite: the same call its sampler makes through ``ControlledUNet``). A warm-up call of each,
then the median of ``--calls``; the figure is the median over the rounds of each ratio (with ControlNet / plain).
`lowmem`: a whole 512x512 generation with the ControlNet in memory mode 0 (UNet and ControlNet streamed from their
files block by block): the process's peak RSS.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = HERE / "cache" / "sd15-fp16"
CONTROLNET = HERE / "cache" / "controlnet-sd15-fp16"
PROMPT, NEGATIVE = "a castle on a hill, highly detailed", "blurry, low quality"
BEGIN, END = "<!-- controlnet:begin -->", "<!-- controlnet:end -->"


def _peak_mb() -> float:
    from hires import _peak_mb as peak

    return peak()


def build_controlnet(model: Path, out: Path) -> Path:
    """The random full-size ControlNet for ``model``'s UNet, written once (fp16 diffusers folder)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet", dtype=torch.float32, local_files_only=True)
    cn = ControlNetModel.from_unet(unet)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for conv in [*cn.controlnet_down_blocks, cn.controlnet_mid_block, cn.controlnet_cond_embedding.conv_out]:
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) / conv.weight[0].numel() ** 0.5)
    cn.to(torch.float16).save_pretrained(out)
    return out


def _inputs(size: int):
    import torch

    g = torch.Generator().manual_seed(0)
    side = size // 8
    return (torch.randn(2, 4, side, side, generator=g), torch.tensor([500.0, 500.0]),
            torch.randn(2, 77, 768, generator=g), torch.rand(2, 3, size, size, generator=g))


def _median_time(fn, calls: int) -> float:
    fn()   # warm-up
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(cfg: dict) -> dict:
    import torch

    torch.set_grad_enabled(False)
    x, t, ctx, hint = _inputs(cfg["size"])
    if cfg["kind"] == "diffusers":
        from diffusers import ControlNetModel, UNet2DConditionModel

        unet = UNet2DConditionModel.from_pretrained(cfg["model"], subfolder="unet", dtype=torch.float32,
                                                    local_files_only=True).eval()
        cn = ControlNetModel.from_pretrained(cfg["controlnet"], dtype=torch.float32, local_files_only=True).eval()

        def plain():
            return unet(x, t, ctx).sample

        def controlled():
            down, mid = cn(x, t, ctx, hint, conditioning_scale=1.0, return_dict=False)
            return unet(x, t, ctx, down_block_additional_residuals=down, mid_block_additional_residual=mid).sample
    else:
        from sdlite.control import ControlUnit
        from sdlite.control.apply import ActiveControl, ControlledUNet
        from sdlite.pipeline import Engine

        engine = Engine.load(cfg["model"], precision=cfg["precision"])
        unet = engine.models.get("unet")
        net, label = engine.controlnet(cfg["controlnet"])
        unit = ControlUnit(cfg["controlnet"]).checked()
        wrapped = ControlledUNet(unet, [ActiveControl(unit, net, hint[:1], label)], cfg=True, steps=1)
        xd, cd = x.to(unet.dtype), ctx.to(unet.dtype)

        def plain():
            return unet(xd, t, cd)

        def controlled():
            return wrapped(xd, t, context=cd)
    return {"plain_s": _median_time(plain, cfg["calls"]), "controlnet_s": _median_time(controlled, cfg["calls"]),
            "peak_rss_mb": _peak_mb()}


def child_lowmem(cfg: dict) -> dict:
    import numpy as np

    from sdlite.control import ControlUnit
    from sdlite.pipeline import Engine, Request
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray((rng.random((cfg["size"], cfg["size"])) > 0.97).astype(np.uint8) * 255).convert("RGB")
    engine = Engine.load(cfg["model"], precision="auto", memory_mode=0)
    start = time.perf_counter()
    result = engine.generate(Request(PROMPT, NEGATIVE, width=cfg["size"], height=cfg["size"], steps=cfg["steps"],
                                     seed=1, controls=(ControlUnit(cfg["controlnet"], image),)))
    return {"seconds": time.perf_counter() - start, "peak_rss_mb": _peak_mb(),
            "precision": result.infotext["Precision"], "size": list(result.images[0].size)}


def run_child(cfg: dict) -> dict:
    from hires import run_child as run   # the same child protocol

    return run(cfg, __file__)


def bench_step(args) -> dict:
    cases = {"sdlite default": {"kind": "sdlite", "precision": "auto"},
             "sdlite exact": {"kind": "sdlite", "precision": "exact"},
             "diffusers fp32": {"kind": "diffusers"}}
    common = {"model": str(args.model), "controlnet": str(args.controlnet), "size": args.size, "calls": args.calls}
    runs = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, cfg in cases.items():
            runs[name].append(run_child({**common, **cfg}))
            print(name, runs[name][-1], file=sys.stderr)
    out = {"config": {"size": args.size, "calls": args.calls, "rounds": args.rounds}, "cases": {}}
    for name, rs in runs.items():
        out["cases"][name] = {"plain_s": statistics.median(r["plain_s"] for r in rs),
                              "controlnet_s": statistics.median(r["controlnet_s"] for r in rs),
                              "ratio": statistics.median(r["controlnet_s"] / r["plain_s"] for r in rs),
                              "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs)}
    return out


def write_section(results: dict, out: Path) -> None:
    step, low = results.get("step"), results.get("lowmem")
    from sdlite.machine import this_cpu

    cpu = this_cpu()
    flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if cpu.has(f))
    lines = [BEGIN, "", "## ControlNet (`python bench/controlnet.py`)", "",
             "One full-size SD 1.5 ControlNet (361M parameters, random weights, fp16 file) on the cached SD 1.5; "
             f"`python bench/controlnet.py all`; {cpu.model}, {cpu.cores} threads ({flags}).", ""]
    if step:
        c = step["config"]
        lines += [f"A denoising step's network calls at {c['size']}x{c['size']}, batch 2 (cfg), medians of "
                  f"{c['calls']} calls in each of {c['rounds']} alternating processes:", "",
                  "| engine | UNet alone, s | ControlNet + UNet, s | ratio |", "|---|---|---|---|"]
        for name, r in step["cases"].items():
            lines.append(f"| {name} | {r['plain_s']:.2f} | {r['controlnet_s']:.2f} | {r['ratio']:.2f}x |")
        ref = step["cases"]["diffusers fp32"]["ratio"]
        lines.append("")
        for name in ("sdlite default", "sdlite exact"):
            ratio = step["cases"][name]["ratio"]
            met = "met" if ratio <= 1.4 and ratio <= ref else "not met"
            lines.append(f"- target, {name}: one ControlNet <= 1.4x the plain step and <= diffusers' ratio "
                         f"({ref:.2f}x): {ratio:.2f}x, {met}.")
        lines.append("")
    if low:
        met = "met" if low["peak_rss_mb"] <= 2048 else "not met"
        lines += [f"Memory mode 0, a whole {low['size'][0]}x{low['size'][1]} generation with the ControlNet "
                  f"({low['precision']}): peak RSS {low['peak_rss_mb']:.0f} MB ({low['seconds']:.0f} s); target "
                  f"<= 2 GB: {met}.", ""]
    lines.append(END)
    text = out.read_text() if out.is_file() else ""
    section = "\n".join(lines)
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "child":
        cfg = json.loads(sys.argv[2])
        print(json.dumps(child_lowmem(cfg) if cfg["kind"] == "lowmem" else child(cfg)))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["step", "lowmem", "all"])
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--controlnet", default=None)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default=str(HERE / "results-controlnet.json"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.controlnet = Path(args.controlnet) if args.controlnet else build_controlnet(Path(args.model), CONTROLNET)
    results = json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else {}
    if args.what in ("step", "all"):
        results["step"] = bench_step(args)
    if args.what in ("lowmem", "all"):
        results["lowmem"] = run_child({"kind": "lowmem", "model": str(args.model), "controlnet": str(args.controlnet),
                                       "size": args.size, "steps": args.steps})
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.what == "all" or args.out:
        write_section(results, Path(args.out or ROOT / "BENCHMARKS.md"))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
