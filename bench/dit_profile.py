"""Where a DiT step's time goes: sdlite's step (``--precision auto``) and diffusers' bf16 step side by side, in one
process, under torch.profiler with record_shapes; and why the int8 precision does not speed the blocks up.

    python bench/dit.py --profile [--models flux-schnell,sd35-medium] [--depth N] [--sizes 512]
    python bench/dit_profile.py int8                        (the int8 layer breakdown alone)

Both transformers are bench/dit.py's (random weights, released widths, ``--depth``), built in bf16 in the same
process, each warmed up, then profiled alternately (sdlite, diffusers, sdlite, diffusers); the second profile of each
is reported. Ops are grouped by name into GEMM, attention, norms, dtype conversions and copies, and the rest; a range
is pushed around every nn.Linear, every attention module and the rotary embedding (sdlite's ``rotate``, diffusers'
``apply_rotary_emb``: the functions are wrapped in this process only) so their inclusive times show. The wall time
minus the ops' self time on the main thread is the time spent outside ATen ops (Python, module calls, dispatch).
Writes bench/dit_profile.md and the raw tables to bench/dit_profile.txt.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

GROUPS = (("GEMM", ("aten::addmm", "aten::mm", "aten::bmm", "aten::_int_mm", "aten::matmul", "mkldnn", "aten::linear",
                    "aten::baddbmm", "aten::convolution", "aten::_convolution", "aten::mkldnn_convolution")),
          ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
          ("norms", ("layer_norm", "rms_norm", "aten::rsqrt", "aten::pow", "aten::mean", "aten::var")),
          ("conversions/copies", ("aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous",
                                  "reorder")),
          ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::gelu", "aten::silu",
                           "aten::neg", "aten::tanh", "aten::cos", "aten::sin", "aten::exp", "aten::clamp")),
          ("layout (cat/stack/views)", ("aten::cat", "aten::stack", "aten::view", "aten::reshape", "aten::permute",
                                        "aten::transpose", "aten::unbind", "aten::flatten", "aten::chunk",
                                        "aten::split", "aten::slice", "aten::select", "aten::expand",
                                        "aten::unsqueeze", "aten::empty", "aten::as_strided", "aten::t",
                                        "aten::_unsafe_view", "aten::narrow", "aten::squeeze", "aten::alias",
                                        "aten::resolve", "aten::detach", "aten::lift", "aten::zeros", "aten::fill_",
                                        "aten::zero_", "aten::ones", "aten::full", "aten::arange", "aten::item",
                                        "aten::_local_scalar_dense", "aten::result_type")))


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def _ranges(module: torch.nn.Module, label: str) -> list:
    """A profiler range around each nn.Linear (``L``) and each attention module (``A``) of ``module``."""
    handles = []

    def enter(name):
        def pre(mod, args):
            rf = record_function(name)
            rf.__enter__()
            mod.__dict__.setdefault("_rf", []).append(rf)
        return pre

    def leave(mod, args, out):
        mod.__dict__["_rf"].pop().__exit__(None, None, None)

    for name, sub in module.named_modules():
        cls = type(sub).__name__
        tag = None
        if isinstance(sub, torch.nn.Linear) or cls == "LowBitLinear":
            tag = f"{label}/linear {sub.in_features}->{sub.out_features}"
        elif cls in ("FluxAttention", "JointAttention", "Attention") and hasattr(sub, "to_q"):
            tag = f"{label}/attention module (with q/k/v/out Linears)"
        elif cls in ("AdaNorm", "AdaLayerNormZero", "AdaLayerNormZeroSingle", "SD35AdaLayerNormZeroX",
                     "AdaLayerNormContinuous"):
            tag = f"{label}/adaLN modulation Linear (+ diffusers: its norm and modulate)"
        if tag:
            handles += [sub.register_forward_pre_hook(enter(tag)), sub.register_forward_hook(leave)]
    return handles


def _wrap_rope():
    """The rotary embedding functions wrapped in a profiler range (this process only)."""
    import diffusers.models.transformers.transformer_flux as dflux
    import sdlite.models.flux as sflux

    def wrapped(fn, name):
        def inner(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        return inner
    sflux.rotate = wrapped(sflux.rotate, "sdlite/rope (rotate, fp32)")
    sflux.rotate_joined = wrapped(sflux.rotate_joined, "sdlite/rope (rotate_joined: [text, image] rotated into one)")
    dflux.apply_rotary_emb = wrapped(dflux.apply_rotary_emb, "diffusers/rope (apply_rotary_emb)")


def _profile_step(nets, inp) -> tuple[float, object]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t = time.perf_counter()
        nets.step(inp["x"], 0.75, inp["context"], inp["pooled"])
        wall = time.perf_counter() - t
    return wall, prof


def _tables(wall: float, prof, label: str) -> dict:
    events = prof.key_averages(group_by_input_shape=True)
    by_group, self_total = defaultdict(float), 0.0
    ranges, ops = {}, []
    for e in events:
        if e.key.startswith(("sdlite/", "diffusers/")):
            ranges[e.key] = (e.cpu_time_total / 1e6, e.count)
            continue
        if e.key.startswith("ProfilerStep") or e.key.startswith("## "):
            continue
        s = e.self_cpu_time_total / 1e6
        self_total += s
        by_group[group_of(e.key)] += s
        ops.append((s, e.key, str(e.input_shapes)[:110], e.count))
    ops.sort(reverse=True)
    return dict(wall=wall, self_total=self_total, groups=dict(by_group), ranges=ranges, ops=ops[:25])


def profile_pair(model: str, depth: int, size: int, log, sdlite_precision: str = "auto") -> dict:
    from dit import Networks, configs

    m = configs(model, depth, 1)
    pair = {}
    for engine, precision in (("sdlite", sdlite_precision), ("diffusers", "bf16")):
        nets = Networks(model, m, engine, precision)
        nets.load("transformer")
        nets.settle()
        _ranges(nets.transformer, engine)
        pair[engine] = nets
    inp = pair["sdlite"].inputs(size)
    out = {}
    with torch.inference_mode():
        for nets in pair.values():
            nets.step(inp["x"], 0.75, inp["context"], inp["pooled"])
        walls = defaultdict(list)
        for _ in range(2):
            for engine, nets in pair.items():
                wall, prof = _profile_step(nets, inp)
                walls[engine].append(wall)
                out[engine] = _tables(wall, prof, engine)
                log(f"{model} {engine}: {wall:.2f} s profiled")
        # unprofiled, alternating, to see the profiler's own overhead
        for _ in range(2):
            for engine, nets in pair.items():
                t = time.perf_counter()
                nets.step(inp["x"], 0.75, inp["context"], inp["pooled"])
                walls[engine + " plain"].append(time.perf_counter() - t)
    out["walls"] = dict(walls)
    return out


def int8_breakdown(log=print) -> list[str]:
    """One Linear at the DiT blocks' shapes, bf16 against sdlite's int8 (LowBitLinear, I8_ROW: dequantise, then bf16
    F.linear) and against what a W8A8 layer would do (per-token int8 activations, torch._int_mm, rescale)."""
    from sdlite.engine.lowbit import LowBitLinear
    from sdlite.engine.quant import quantize_activation
    from sdlite.weights.quants import quantize_int8_rows

    def med(fn, n=5):
        fn()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    rows = ["| shape (tokens x in -> out) | bf16 F.linear | LowBitLinear int8 (sdlite's int8) | of which dequantise "
            "| per-tensor quantize_activation (sdlite.engine.quant) | per-token int8 quantise (torch ops) | "
            "torch._int_mm | W8A8 total (quantise + _int_mm + rescale to bf16) | W8A8 / bf16 |",
            "|---|---|---|---|---|---|---|---|---|"]
    for m, k, n in ((1280, 3072, 3072), (1536, 3072, 3072), (1280, 3072, 12288), (1280, 12288, 3072),
                    (2 * 1357, 1536, 1536), (2 * 1357, 1536, 6144)):
        x = torch.randn(m, k).bfloat16()
        w = (torch.randn(n, k) * 0.02).bfloat16()
        bias = torch.zeros(n, dtype=torch.bfloat16)
        q = quantize_int8_rows(w)
        low = LowBitLinear(q, torch.nn.Parameter(bias.clone(), requires_grad=False))
        wq = q.dequantize(torch.float32)
        scale_w = wq.abs().amax(1) / 127
        wi8_t = (wq / scale_w[:, None]).round().clamp(-127, 127).to(torch.int8).t().contiguous()   # (K, N)

        def quant_tok():
            xf = x.float()
            s = xf.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
            return (xf / s).round_().clamp_(-127, 127).to(torch.int8), s

        def w8a8():
            xi, s = quant_tok()
            acc = torch._int_mm(xi, wi8_t)                        # (M, N) int32
            return (acc.float().mul_(s).mul_(scale_w)).to(torch.bfloat16).add_(bias)

        xi, _ = quant_tok()
        with torch.inference_mode():
            t_bf = med(lambda: F.linear(x, w, bias))
            t_low = med(lambda: low(x))
            t_deq = med(lambda: q.dequantize(torch.bfloat16))
            t_qa = med(lambda: quantize_activation(x))
            t_qt = med(quant_tok)
            t_mm = med(lambda: torch._int_mm(xi, wi8_t))
            t_w8 = med(w8a8)
        rows.append(f"| {m} x {k} -> {n} | {t_bf * 1e3:.1f} ms | {t_low * 1e3:.1f} ms ({t_low / t_bf:.2f}x) | "
                    f"{t_deq * 1e3:.1f} ms | {t_qa * 1e3:.1f} ms | {t_qt * 1e3:.1f} ms | {t_mm * 1e3:.1f} ms "
                    f"({t_mm / t_bf:.2f}x) | {t_w8 * 1e3:.1f} ms | {t_w8 / t_bf:.2f}x |")
        log(rows[-1])
    return rows


def render(results: dict, int8_rows: list[str]) -> list[str]:
    lines = []
    for model, r in results.items():
        walls = r["walls"]
        lines += [f"### {model}: one step, profiled", "",
                  "Wall times (s), each call: " + "; ".join(f"{k}: {', '.join(f'{v:.2f}' for v in vs)}"
                                                           for k, vs in walls.items()), "",
                  "| group (ops' self CPU time on the main thread), s | sdlite auto (bf16) | diffusers bf16 |",
                  "|---|---|---|"]
        s, d = r["sdlite"], r["diffusers"]
        for g in [gr for gr, _ in GROUPS] + ["other"]:
            lines.append(f"| {g} | {s['groups'].get(g, 0):.3f} | {d['groups'].get(g, 0):.3f} |")
        lines += [f"| all ops | {s['self_total']:.3f} | {d['self_total']:.3f} |",
                  f"| wall | {s['wall']:.3f} | {d['wall']:.3f} |",
                  f"| outside ATen ops (wall - ops; Python, hooks, dispatch) | {s['wall'] - s['self_total']:.3f} | "
                  f"{d['wall'] - d['self_total']:.3f} |", "",
                  "Ranges (inclusive CPU time, s, and calls):", "", "| range | s | calls |", "|---|---|---|"]
        for eng in ("sdlite", "diffusers"):
            for k, (t, c) in sorted(r[eng]["ranges"].items(), key=lambda kv: -kv[1][0]):
                lines.append(f"| {k} | {t:.3f} | {c} |")
        for eng in ("sdlite", "diffusers"):
            lines += ["", f"Top ops by self time, {eng} (s, op, input shapes, calls):", "", "```"]
            lines += [f"{t:7.3f}  {name:<45} {shapes}  x{c}" for t, name, shapes, c in r[eng]["ops"][:18]]
            lines += ["```"]
        lines.append("")
    if int8_rows:
        lines += ["### int8 layers against bf16 (one Linear, 2 threads, median of 5)", "", *int8_rows, ""]
    return lines


def profile_main(models, depth: int, sizes: str, precision: str = "auto") -> int:
    torch.set_num_threads(2)
    _wrap_rope()
    size = int(sizes.split(",")[0])
    log = lambda msg: print(msg, flush=True)
    import os
    load0 = os.getloadavg()
    results = {m: profile_pair(m, depth, size, log, precision) for m in models}
    int8_rows = int8_breakdown(log) if precision == "auto" else []   # why weight-only int8 did not pay
    option = "" if precision == "auto" else f" --profile-precision {precision}"
    text = [f"Profile: `python bench/dit.py --profile{option} --models {','.join(models)} --depth {depth} "
            f"--sizes {size}`, sdlite at --precision {precision}, "
            f"{size}^2, load average {', '.join(f'{x:.2f}' for x in load0)} at the start, "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} at the end.", "", *render(results, int8_rows)]
    name = "dit_profile.md" if precision == "auto" else f"dit_profile-{precision}.md"
    (HERE / name).write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["int8"]:
        torch.set_num_threads(2)
        print("\n".join(int8_breakdown()))
    else:
        raise SystemExit(__doc__)
