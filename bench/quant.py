"""UNet step time, weight memory and accuracy of the ``--quantize`` modes, against our fp32 UNet and diffusers'.

    python bench/quant.py [--sizes 256 512] [--repeat 3] [--threads N] [--modes int8,int8-bf16,bf16]
                          [--no-diffusers] [--steps 8]

Run it under ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` to measure what an AVX2-only CPU gets (no
VNNI: 7-bit int8 activations; bf16 emulated); ``--activation-bits`` forces the int8 range.

One process: the SD 1.5 UNet (sdlite.config.SD15.unet) with PyTorch's default random init, copied into each
variant: our fp32 UNet, diffusers' UNet2DConditionModel (same weights; our UNet is numerically the same), and
our UNet quantized by each mode. Per size (batch 2 = one CFG step, 77-token context), every variant runs once
to warm up (its output is compared with our fp32 output), then ``--repeat`` rounds of one call each, the
variants interleaved round by round so that load on a shared machine hits them alike; medians are reported.

Accuracy on the full-size random model: the cosine similarity of each mode's UNet output against fp32 at
several timesteps, and of the final latent after ``--steps`` DPM++ 2M Karras steps with CFG 7.5 at 256².
Speed and memory do not depend on the weights' values; accuracy does, so images of a trained model are
measured with :func:`sdlite.engine.quant.compare_quality`.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdlite.config import SD15  # noqa: E402
from sdlite.engine.quant import QUANTIZE_CHOICES, check_quantize_mode, quantize_model, weight_bytes  # noqa: E402
from sdlite.models.unet import UNet  # noqa: E402


def cpu_description() -> str:
    """CPU model, the ISA oneDNN may use (after any ONEDNN_MAX_CPU_ISA cap) and the int8 activation range."""
    from sdlite.engine.cpu import int8_activation_bits
    from sdlite.machine import this_cpu

    cpu = this_cpu()
    caps = ", ".join(f"{k}={v}" for k, v in (("ONEDNN_MAX_CPU_ISA", cpu.onednn_cap),
                                             ("ATEN_CPU_CAPABILITY", cpu.aten_cap)) if v)
    return (f"{cpu.model}; oneDNN ISA {cpu.isa_level}{' (' + caps + ')' if caps else ''}; "
            f"int8 activations {int8_activation_bits()}-bit by default")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def build_variants(modes: list[str], with_diffusers: bool, activation_bits=None) -> tuple[dict, dict]:
    """name -> callable(x, t, ctx), name -> weight bytes."""
    torch.manual_seed(0)
    base = UNet(SD15.unet).eval().requires_grad_(False)
    variants, memory = {"fp32 (sdlite)": base}, {"fp32 (sdlite)": weight_bytes(base)}
    if with_diffusers:
        from diffusers import UNet2DConditionModel

        cfg = SD15.unet.to_diffusers()
        cfg.pop("_class_name")
        ref = UNet2DConditionModel(**cfg).eval().requires_grad_(False)
        ref.load_state_dict(base.state_dict(), strict=True)
        variants["fp32 (diffusers)"] = lambda x, t, c, m=ref: m(x, t, c, return_dict=False)[0]
        memory["fp32 (diffusers)"] = sum(p.numel() * p.element_size() for p in ref.parameters())
    for mode in modes:
        variants[mode] = quantize_model(copy.deepcopy(base), mode, activation_bits=activation_bits)
        memory[mode] = weight_bytes(variants[mode])
    return variants, memory


def time_size(variants: dict, size: int, repeat: int) -> tuple[dict, dict]:
    """name -> median seconds per call, name -> output cosine against our fp32 UNet."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, size // 8, size // 8, generator=g)
    ctx = torch.randn(2, 77, SD15.unet.context_dim, generator=g)
    t = torch.tensor([500.0, 500.0])
    times = {name: [] for name in variants}
    outputs = {}
    with torch.no_grad():
        for name, fn in variants.items():
            outputs[name] = fn(x, t, ctx)                                       # warm-up
        for _ in range(repeat):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn(x, t, ctx)
                times[name].append(time.perf_counter() - t0)
            print(f"  {size}²: " + ", ".join(f"{n} {ts[-1]:.2f}s" for n, ts in times.items()), flush=True)
    ref = outputs["fp32 (sdlite)"]
    return ({n: statistics.median(ts) for n, ts in times.items()},
            {n: cosine(o, ref) for n, o in outputs.items()})


def accuracy(variants: dict, modes: list[str], steps: int, size: int = 256) -> dict:
    """mode -> {"t=999": cos, ..., "latent": cos after ``steps`` sampler steps} against our fp32 UNet."""
    from sdlite.sampling.denoisers import CFGDenoiser, Denoiser
    from sdlite.sampling.samplers import sample
    from sdlite.sampling.schedules import NoiseSchedule

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, size // 8, size // 8, generator=g)
    ctx = torch.randn(2, 77, SD15.unet.context_dim, generator=g)
    noise = torch.randn(1, 4, size // 8, size // 8, generator=g)
    schedule = NoiseSchedule.from_config(dict(SD15.scheduler))
    timesteps = (999, 500, 20)
    results, ref = {}, {}
    with torch.no_grad():
        for name in ["fp32 (sdlite)", *modes]:
            unet = variants[name]
            row = {f"t={ts}": unet(x, torch.tensor([float(ts)] * 2), ctx) for ts in timesteps}
            denoiser = CFGDenoiser(Denoiser(unet, schedule, "epsilon"), 7.5)
            row["latent"] = sample("dpmpp_2m_karras", denoiser, noise, schedule, steps,
                                   extra_args={"context": ctx[1:], "uncond": ctx[:1]})
            if name == "fp32 (sdlite)":
                ref = row
            else:
                results[name] = {k: cosine(v, ref[k]) for k, v in row.items()}
            print(f"  accuracy: {name} done", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    ap.add_argument("--modes", default="int8,int8-bf16,bf16",
                    help=f"comma-separated quantize modes, of {', '.join(QUANTIZE_CHOICES[1:])}")
    ap.add_argument("--no-diffusers", action="store_true")
    ap.add_argument("--steps", type=int, default=8, help="sampler steps for the latent cosine (0: skip)")
    ap.add_argument("--activation-bits", type=int, choices=[7, 8], default=None,
                    help="int8 activation range (default: this CPU's, 8 with VNNI/AMX, else 7)")
    args = ap.parse_args()
    modes = [check_quantize_mode(m) for m in args.modes.split(",") if m and m != "none"]
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"machine: {cpu_description()}; {torch.get_num_threads()} torch threads; torch {torch.__version__}")
    variants, memory = build_variants(modes, not args.no_diffusers, args.activation_bits)
    timing, cos = {}, {}
    for size in args.sizes:
        timing[size], cos[size] = time_size(variants, size, args.repeat)
    acc = accuracy(variants, modes, args.steps) if args.steps else {}

    base = "fp32 (sdlite)"
    ref = "fp32 (diffusers)" if "fp32 (diffusers)" in variants else None
    head = "| variant | weights MB |"
    rule = "|---|---:|"
    for s in args.sizes:
        head += f" {s}² ms/step | vs fp32 |" + (" vs diffusers |" if ref else "") + f" cos {s}² |"
        rule += "---:|---:|" + ("---:|" if ref else "") + "---:|"
    print(f"\nSD 1.5 UNet, batch 2 (one CFG step), medians of {args.repeat} calls after a warm-up, "
          f"{torch.get_num_threads()} threads\n")
    print(head)
    print(rule)
    for name in variants:
        row = f"| {name} | {memory[name] / 2**20:.0f} |"
        for s in args.sizes:
            ms = timing[s][name]
            row += f" {ms * 1e3:.0f} | {ms / timing[s][base]:.2f} |"
            row += f" {ms / timing[s][ref]:.2f} |" if ref else ""
            row += f" {cos[s][name]:.6f} |"
        print(row)
    if acc:
        keys = list(next(iter(acc.values())))
        print(f"\nAccuracy against fp32, full-size random UNet, 256²: UNet output cosine at timesteps, and the final "
              f"latent's cosine after {args.steps} DPM++ 2M Karras steps (CFG 7.5)\n")
        print("| mode | " + " | ".join(k if k != "latent" else f"latent ({args.steps} steps)" for k in keys) + " |")
        print("|---|" + "---:|" * len(keys))
        for mode, row in acc.items():
            print(f"| {mode} | " + " | ".join(f"{row[k]:.6f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
