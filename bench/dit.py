"""The transformer (DiT) families on the CPU: sdlite against diffusers bf16, step by step, and each figure's share
of this CPU's measured bf16 and int8 GEMM peak (issue 55).

    python bench/dit.py [--models flux-schnell,sd35-medium] [--sizes 512[,1024]] [--depth N] [--text-depth N]
                        [--runs K] [--rounds R] [--configs LABEL,...] [--json PATH] [--md PATH]
    python bench/dit.py --profile [--models flux-schnell,sd35-medium] [--depth N]   (torch.profiler, both engines)
    python bench/dit.py --peak                                                      (the GEMM peaks alone)

What is measured. The networks are built in each process from random weights at the released widths with a REDUCED
depth, the same depth on both sides (``--depth N``: FLUX.1 N double and 2N single blocks, SD3.5 Medium N joint blocks
(MMDiT-X's second attention in the first min(N, 13)); T5-XXL ``--text-depth`` of its 24 layers at 4096 wide). Every
tensor is ``randn * 0.02`` from a generator seeded by its key (norm scales 1), so where the two engines' keys are the
same (sdlite's module names are diffusers'/transformers' by design) the weights are the same values. Each
configuration and size runs in its own fresh process with 2 torch threads, the configurations alternating round by
round (``--rounds``), medians over the rounds' medians:

* text encoding: T5-XXL on the family's token row (FLUX.1-schnell: 256 tokens, batch 1; SD3.5: 256 tokens, batch 2 =
  prompt and negative), a warm-up then the median of ``--runs``; CLIP is not included (under 2 % of it);
* step: one denoiser call (FLUX.1-schnell: batch 1, guidance-distilled; SD3.5 Medium: batch 2, CFG), a warm-up then
  the median of ``--runs``;
* decode: the 16-channel VAE at the size, one warm-up, then one timed run;
* whole image: text encoding, the family's steps (4, Euler on the flow) and the decode, one timed run: the networks'
  work of one image, without either pipeline's tokenizer or scheduler (a few ms);
* peak RSS: the process's high-water mark (the random weights built in place, one network at a time in its dtype).

sdlite's networks are prepared as its engine prepares them for the precision (``sdlite.engine.precision.resolve`` for
the family's spec): ``bf16`` (every network in bf16, the VAE channels-last with its upsamplers by phases),
``bf16-int8`` (bf16, with the transformer's block Linears on oneDNN's int8 GEMM, activations per token), ``auto``
(which of these this CPU takes: bf16-int8 with native bf16 and VNNI or AMX) and ``int8`` (the transformer's block
Linears and T5's in int8 per output channel, dequantised per call: ``sdlite.engine.lowbit``). diffusers' and transformers' networks run in bf16, as their pipelines do with
``torch_dtype=torch.bfloat16``.

The share of peak: the step's FLOPs (``torch.utils.flop_counter`` on the warm-up call: matmuls and attention) over
its time, against the best of ``torch.matmul`` (bf16) and ``torch._int_mm`` (int8) over 4096 x 3072 x 3072 measured
in the same run. Raw figures to bench/dit.json, the report to bench/dit.md (``--md``). ``--profile`` writes
bench/dit_profile.md: both engines' step under torch.profiler (record_shapes), op by op, grouped.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

THREADS = 2
PEAK_SHAPE = (4096, 3072, 3072)
CONFIGS = {"diffusers bf16": dict(engine="diffusers", precision="bf16"),
           # what a CPU without native bf16 runs diffusers in (its bf16 is emulated there: 5-10x slower)
           "diffusers fp32": dict(engine="diffusers", precision="fp32"),
           "sdlite auto": dict(engine="sdlite", precision="auto"),
           "sdlite bf16": dict(engine="sdlite", precision="bf16"),
           "sdlite int8": dict(engine="sdlite", precision="int8"),
           # W8A8: the transformer's block Linears on oneDNN's u8 x s8 GEMM (sdlite.engine.quant.Int8Linear)
           "sdlite bf16-int8": dict(engine="sdlite", precision="bf16-int8")}
REF = "diffusers bf16"
MODELS = ("flux-schnell", "sd35-medium")
FLUX_TEXT_TOKENS, SD3_TEXT_TOKENS, SD3_CONTEXT = 256, 256, 77 + 256


# --- the GEMM peak ---------------------------------------------------------------------------------------------------

def gemm_peak(repeat: int = 5) -> dict:
    """Best GFLOP/s of a bf16 torch.matmul and GOP/s of an int8 torch._int_mm over PEAK_SHAPE (M, K, N). Where bf16
    is not native (an AVX2 CPU, or the AVX2 cap: emulated, one thread, minutes a product) the float products are
    fp32, and ``dtype`` says so; the keys keep their names."""
    from sdlite.engine.precision import bf16_support
    from sdlite.machine import this_cpu

    m, k, n = PEAK_SHAPE
    ops = 2 * m * k * n
    dtype = torch.bfloat16 if bf16_support(this_cpu()) == "native" else torch.float32
    out = {"dtype": "bf16" if dtype is torch.bfloat16 else "fp32"}
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    qa, qb = torch.randint(-127, 127, (m, k), dtype=torch.int8), torch.randint(-127, 127, (k, n), dtype=torch.int8)
    for name, fn in (("bf16", lambda: torch.matmul(a, b)), ("int8", lambda: torch._int_mm(qa, qb))):
        fn()
        best = min(_timed(fn) for _ in range(repeat))
        out[name] = ops / best / 1e9
    # the weight as nn.Linear stores it, (N, K), as F.linear multiplies: the transposed operand
    w = torch.randn(n, k).to(dtype)
    torch.nn.functional.linear(a, w)
    out["bf16_linear"] = ops / min(_timed(lambda: torch.nn.functional.linear(a, w)) for _ in range(repeat)) / 1e9
    out["bf16_matmul"] = out["bf16"]
    out["bf16"] = max(out["bf16_matmul"], out["bf16_linear"])   # the peak: the better of the two layouts
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_flags() -> dict:
    from run import cpu_facts

    facts = cpu_facts()
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    return {"model": facts["model"], "capability": facts["capability"],
            "flags": {f: f in flags for f in wanted}}


# --- the networks ----------------------------------------------------------------------------------------------------

def random_value(key: str, shape, dtype) -> torch.Tensor:
    """The same tensor for the same key on both sides: norms' scales 1, everything else randn * 0.02."""
    leaf = key.rsplit(".", 1)[-1]
    if len(shape) == 1 and leaf == "weight" and "norm" in key.lower():
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def fill(module: torch.nn.Module, dtype) -> torch.nn.Module:
    """``module`` (built on the meta device) with random_value for each state-dict entry, in ``dtype`` (integer
    buffers keep theirs), its non-persistent buffers computed again on the CPU."""
    state = {k: (random_value(k, v.shape, dtype) if v.is_floating_point() else torch.zeros(v.shape, dtype=v.dtype))
             for k, v in module.state_dict().items()}
    module.load_state_dict(state, assign=True, strict=True)
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise SystemExit(f"{type(module).__name__}: tensors outside the state dict stay on meta: {left[:3]}")
    return module.eval().requires_grad_(False)


def configs(model: str, depth: int, text_depth: int) -> dict:
    from sdlite.config.flux import FLUX_SCHNELL, FLUX_SCHNELL_MODEL, FLUX_VAE
    from sdlite.config.mmdit import SD35_MEDIUM
    from sdlite.config.sd3 import SD35_MEDIUM_MODEL, SD3_VAE
    from sdlite.config.t5 import T5_XXL

    t5 = dataclasses.replace(T5_XXL, num_layers=text_depth)
    if model == "flux-schnell":
        return dict(transformer=dataclasses.replace(FLUX_SCHNELL, num_layers=depth, num_single_layers=2 * depth),
                    vae=FLUX_VAE, t5=t5, spec=FLUX_SCHNELL_MODEL, batch=1, tokens=FLUX_TEXT_TOKENS, steps=4,
                    released="19 double + 38 single blocks", depth_text=f"{depth} double + {2 * depth} single blocks")
    if model == "sd35-medium":
        tr = dataclasses.replace(SD35_MEDIUM, num_layers=depth,
                                 dual_attention_layers=tuple(i for i in SD35_MEDIUM.dual_attention_layers if i < depth))
        return dict(transformer=tr, vae=SD3_VAE, t5=t5, spec=SD35_MEDIUM_MODEL, batch=2, tokens=SD3_TEXT_TOKENS, steps=4,
                    released="24 joint blocks (13 with the second attention)",
                    depth_text=f"{depth} joint blocks ({len(tr.dual_attention_layers)} with the second attention)")
    raise SystemExit(f"unknown model {model!r}: expected one of {', '.join(MODELS)}")


def build_transformer(model: str, cfg, engine: str, dtype):
    if engine == "sdlite":
        from sdlite.models.flux import Flux
        from sdlite.models.mmdit import MMDiT
        cls = Flux if model == "flux-schnell" else MMDiT
        with torch.device("meta"):
            net = cls(cfg)
        return fill(net, dtype)
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
    cls = FluxTransformer2DModel if model == "flux-schnell" else SD3Transformer2DModel
    with torch.device("meta"):
        net = cls(**{k: v for k, v in cfg.to_diffusers().items() if not k.startswith("_")})
    return fill(net, dtype)


def build_t5(cfg, engine: str, dtype):
    if engine == "sdlite":
        from sdlite.models.t5 import T5Encoder
        with torch.device("meta"):
            net = T5Encoder(cfg)
        return fill(net, dtype)
    import transformers
    hf = {k: v for k, v in cfg.to_transformers().items() if k not in ("architectures", "torch_dtype")}
    with torch.device("meta"):
        net = transformers.T5EncoderModel(transformers.T5Config(**hf))
    return fill(net, dtype)


def build_vae(cfg, engine: str, dtype):
    if engine == "sdlite":
        from sdlite.models.vae import AutoencoderKL
        with torch.device("meta"):
            net = AutoencoderKL(cfg)
        return fill(net, dtype)
    from diffusers import AutoencoderKL
    with torch.device("meta"):
        net = AutoencoderKL(**{k: v for k, v in cfg.to_diffusers().items() if not k.startswith("_")})
    return fill(net, dtype)


def sdlite_int8(module: torch.nn.Module, mode: str) -> torch.nn.Module:
    """What sdlite.engine.lowbit.load_quantized makes of a dense network: its block Linears as LowBitLinears."""
    from sdlite.engine.lowbit import lowbit_targets, quantize_weight, replace_linears

    weights = {k: quantize_weight(module.get_parameter(k).detach(), mode) for k in lowbit_targets(module, mode)}
    replace_linears(module, weights)
    return module


class Networks:
    """One engine's three networks for one model, prepared as that engine runs them, with its calls."""

    def __init__(self, model: str, m: dict, engine: str, precision: str):
        self.model, self.m, self.engine = model, m, engine
        bf16 = torch.bfloat16
        if engine == "sdlite":
            from sdlite.engine.precision import resolve
            plan = resolve(precision, "cpu", spec=m["spec"])
            self.plan = plan
            self.label = plan.label
            t5_dtype = plan.t5_dtype or plan.text_dtype
            self.dtypes = dict(transformer=plan.dtype, t5=t5_dtype, vae=plan.vae_dtype)
        else:
            self.plan, self.label = None, precision
            dtype = torch.float32 if precision == "fp32" else bf16
            self.dtypes = dict(transformer=dtype, t5=dtype, vae=dtype)
        self.transformer = None
        self.t5 = None
        self.vae = None

    def load(self, which: str):
        dtype = self.dtypes[which]
        if which == "transformer":
            net = build_transformer(self.model, self.m["transformer"], self.engine, dtype)
            if self.plan is not None and self.plan.lowbit != "none":
                net = sdlite_int8(net, self.plan.lowbit)
            if self.plan is not None and self.plan.quantize == "bf16-int8":   # as engine.quant.load_bf16_int8
                from sdlite.engine.quant import quantize_model
                net = quantize_model(net, "bf16-int8")
        elif which == "t5":
            net = build_t5(self.m["t5"], self.engine, dtype)
            if self.plan is not None and self.plan.lowbit != "none":
                net = sdlite_int8(net, "int8")   # T5 in int8 under both low-bit precisions (engine/memory.py)
            if self.plan is not None and self.plan.quantize == "bf16-int8":   # as the engine loads a dense T5
                from sdlite.engine.quant import quantize_model
                net = quantize_model(net, "bf16-int8")
        else:
            net = build_vae(self.m["vae"], self.engine, dtype)
            if self.engine == "sdlite" and dtype == torch.bfloat16:
                from sdlite.engine.memory import channels_last
                from sdlite.engine.subpixel import phase_upsample_model
                net = channels_last(phase_upsample_model(net))
        if self.engine == "sdlite":
            from sdlite.engine.memory import trim_heap
            if self.plan.fp32_kernels and which != "t5":   # fp32-fast: as the engine marks its networks
                from sdlite.kernels.fp32 import use_fp32_kernels
                use_fp32_kernels(net)
            trim_heap()   # as sdlite's Engine does after loading a network (its quantising's temporaries)
        setattr(self, which, net)
        return net

    def settle(self):
        """After the networks are built: sdlite's heap tuning, as its Engine runs (activations kept in the C heap
        between steps). Not before: the engine's weights are the file's pages or its own once-made copies, while the
        random weights here, built with fp32 temporaries, would fragment a heap that never hands memory back (T5-XXL
        built so peaked at 17.9 GB against 9.4 GB held)."""
        if self.engine == "sdlite":
            from sdlite.engine.memory import trim_heap, tune_heap
            trim_heap()
            tune_heap()

    # the calls, each engine's own network and its own input layout
    def encode(self, ids):
        if self.engine == "sdlite":
            return self.t5(ids)
        return self.t5(ids).last_hidden_state

    def inputs(self, size: int, context: torch.Tensor | None = None) -> dict:
        b, lat = self.m["batch"], size // 8
        g = torch.Generator().manual_seed(0)
        x = torch.randn(b, 16, lat, lat, generator=g)
        if context is None:
            n = FLUX_TEXT_TOKENS if self.model == "flux-schnell" else SD3_CONTEXT
            context = torch.randn(b, n, 4096, generator=g)
        elif self.model == "sd35-medium":   # CLIP's 77 tokens before T5's
            context = torch.cat([torch.randn(b, 77, 4096, generator=g).to(context.dtype), context], 1)
        pooled = torch.randn(b, 768 if self.model == "flux-schnell" else 2048, generator=g)
        return dict(x=x, context=context, pooled=pooled)

    def step(self, x, sigma: float, context, pooled):
        dtype = self.dtypes["transformer"]
        b = x.shape[0]
        t = torch.full((b,), sigma)
        if self.engine == "sdlite":
            if self.model == "flux-schnell":
                return self.transformer(x, t, context, pooled)
            return self.transformer(x, t * 1000, context, pooled)
        if self.model == "flux-schnell":
            from diffusers import FluxPipeline
            from sdlite.models.flux import image_ids
            lat = x.shape[-1]
            packed = FluxPipeline._pack_latents(x, b, 16, lat, lat).to(dtype)
            img_ids = image_ids(lat // 2, lat // 2).to(dtype)
            txt_ids = torch.zeros(context.shape[1], 3, dtype=dtype)
            out = self.transformer(hidden_states=packed, encoder_hidden_states=context.to(dtype),
                                   pooled_projections=pooled.to(dtype), timestep=t.to(dtype), img_ids=img_ids,
                                   txt_ids=txt_ids, guidance=None, return_dict=False)[0]
            return FluxPipeline._unpack_latents(out, lat * 8, lat * 8, 8)
        return self.transformer(hidden_states=x.to(dtype), encoder_hidden_states=context.to(dtype),
                                pooled_projections=pooled.to(dtype), timestep=(t * 1000).to(dtype),
                                return_dict=False)[0]

    def decode(self, z):
        z = z.to(self.dtypes["vae"])
        if self.engine == "sdlite":
            if self.dtypes["vae"] == torch.bfloat16:
                z = z.contiguous(memory_format=torch.channels_last)
            return self.vae.decode(z)
        return self.vae.decode(z, return_dict=False)[0]


# --- one configuration, in its own process ---------------------------------------------------------------------------

def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _median_of(fn, runs: int) -> tuple[float, list[float]]:
    times = [_timed(fn) for _ in range(runs)]
    return statistics.median(times), times


def child(cfg: dict) -> dict:
    torch.set_num_threads(THREADS)
    from torch.utils.flop_counter import FlopCounterMode

    m = configs(cfg["model"], cfg["depth"], cfg["text_depth"])
    nets = Networks(cfg["model"], m, cfg["engine"], cfg["precision"])
    out = {"precision": nets.label, "dtypes": {k: str(v).replace("torch.", "") for k, v in nets.dtypes.items()}}
    size, runs = cfg["size"], cfg["runs"]
    ids = torch.randint(1, m["t5"].vocab_size, (m["batch"], m["tokens"]), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        t = time.perf_counter()
        for which in ("t5", "transformer", "vae"):
            nets.load(which)
        nets.settle()
        out["build_s"] = time.perf_counter() - t
        # text encoding
        nets.encode(ids)
        out["text_s"], out["text_runs"] = _median_of(lambda: nets.encode(ids), runs)
        # the step: FLOPs counted on the warm-up
        inp = nets.inputs(size)
        counter = FlopCounterMode(display=False)
        with counter:
            nets.step(inp["x"], 0.75, inp["context"], inp["pooled"])
        out["step_flops"] = counter.get_total_flops()
        out["step_s"], out["step_runs"] = _median_of(lambda: nets.step(inp["x"], 0.75, inp["context"], inp["pooled"]),
                                                     runs)
        # decode
        z = torch.randn(1, 16, size // 8, size // 8, generator=torch.Generator().manual_seed(2))
        nets.decode(z)
        out["decode_s"], out["decode_runs"] = _median_of(lambda: nets.decode(z), 1)
        # a whole image: text, the steps (Euler on the flow, sigmas 1 -> 0), the decode
        t = time.perf_counter()
        context = nets.encode(ids)
        inp = nets.inputs(size, context)
        x = inp["x"]
        sigmas = torch.linspace(1.0, 0.0, m["steps"] + 1).tolist()
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            v = nets.step(x, s, inp["context"], inp["pooled"]).float()
            if m["batch"] == 2:   # CFG 4.5 over the doubled batch
                v = (v[1:] + 4.5 * (v[:1] - v[1:])).expand(2, -1, -1, -1)
            x = x + (s_next - s) * v
        nets.decode(x[:1])
        out["image_s"] = time.perf_counter() - t
    out["peak_rss_mb"] = peak_mb()
    return out


def run_child(cfg: dict, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    load0 = os.getloadavg()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)],
                              capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
    out = json.loads(lines[-1])
    out["wall_s"], out["loadavg"] = time.perf_counter() - t, [load0, os.getloadavg()]
    return out


# --- the report ------------------------------------------------------------------------------------------------------

def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(raw: dict) -> dict:
    """{model: {size: {label: {measure: median over rounds}}}}."""
    out = {}
    for key, rounds in raw["results"].items():
        model, size, label = key.split("|")
        ok = [r for r in rounds if "error" not in r]
        row = {k: _med([r.get(k) for r in ok]) for k in ("text_s", "step_s", "decode_s", "image_s", "peak_rss_mb",
                                                           "step_flops")}
        row["n"] = len(ok)
        row["errors"] = [r["error"] + (": " + r.get("stderr_tail", "")[-300:] if r.get("stderr_tail") else "")
                         for r in rounds if "error" in r]
        row["precision"] = ok[0]["precision"] if ok else "-"
        out.setdefault(model, {}).setdefault(size, {})[label] = row
    return out


def report(raw: dict) -> list[str]:
    meta, peak = raw["meta"], raw["peak"]
    fl = peak.get("dtype", "bf16")   # the float products of the peak: fp32 where bf16 is not native
    flags = meta["cpu"]["flags"]
    has = ", ".join(f for f, v in flags.items() if v) or "none"
    lacks = ", ".join(f for f, v in flags.items() if not v) or "none"
    lines = [f"Machine: {meta['machine']}", "",
             f"CPU flags: has {has}; lacks {lacks}. Measured GEMM peak (2 threads, {'x'.join(map(str, PEAK_SHAPE))}, "
             f"best of 5): {fl} `torch.matmul` {peak['bf16_matmul']:.0f} GFLOP/s, {fl} `F.linear` (weight (N, K)) "
             f"{peak['bf16_linear']:.0f} GFLOP/s, int8 `torch._int_mm` {peak['int8']:.0f} GOP/s "
             f"({peak['int8'] / peak['bf16']:.2f}x the better {fl}, which the shares below use).", "",
             f"Command: `{meta['command']}`, run {meta['date']}, {meta['wall_s'] / 60:.0f} min; load average "
             f"(1, 5, 15 min) {', '.join(f'{x:.2f}' for x in meta['loadavg_start'])} at the start, "
             f"{', '.join(f'{x:.2f}' for x in meta['loadavg_end'])} at the end. {meta['rounds']} rounds, the "
             f"configurations alternating in each; each cell the median over rounds of each process's median of "
             f"{meta['runs']} runs (decode: one run after a warm-up).", ""]
    summary = summarize(raw)
    for model, sizes in summary.items():
        m = configs(model, meta["depth"], meta["text_depth"])
        lines += [f"### {model}", "",
                  f"Transformer at {m['depth_text']} (released: {m['released']}), T5-XXL {meta['text_depth']} of 24 "
                  f"layers; batch {m['batch']}, {m['tokens']} T5 tokens, {m['steps']} steps.", ""]
        for size, row in sizes.items():
            labels = list(row)
            # the ratios' anchor: diffusers bf16, else the other diffusers row (fp32, under the AVX2 cap)
            ref_label = REF if REF in row else next((l for l in labels if l.startswith("diffusers")), REF)
            ref = row.get(ref_label, {})
            lines += [f"{size}x{size}:", "", "| measure | " + " | ".join(f"{l} ({row[l]['precision']})" for l in labels)
                      + " |", "|---|" + "---|" * len(labels)]

            def cell(label, key, fmt="{:.2f}"):
                v = row[label].get(key)
                if v is None:
                    return "-"
                s = fmt.format(v)
                if label != ref_label and ref.get(key):
                    s += f" ({v / ref[key]:.2f}x)"
                return s

            for name, key, fmt in (("text encoding (T5), s", "text_s", "{:.2f}"), ("step, s", "step_s", "{:.2f}"),
                                   ("decode, s", "decode_s", "{:.2f}"),
                                   (f"whole {m['steps']}-step image, s", "image_s", "{:.1f}"),
                                   ("peak RSS, MB", "peak_rss_mb", "{:.0f}")):
                lines.append(f"| {name} | " + " | ".join(cell(l, key, fmt) for l in labels) + " |")
            shares_bf, shares_i8, gf = [], [], []
            # the network's work, the same for every configuration: FlopCounterMode counts bf16 matmuls and attention,
            # not oneDNN's int8 products (bf16-int8's step would count only its attention), so the largest count
            flops = max((row[l]["step_flops"] for l in labels if row[l].get("step_flops")), default=None)
            for l in labels:
                r = row[l]
                if r.get("step_s") and flops:
                    rate = flops / r["step_s"] / 1e9
                    gf.append(f"{rate:.0f}")
                    shares_bf.append(f"{rate / peak['bf16']:.0%}")
                    shares_i8.append(f"{rate / peak['int8']:.0%}")
                else:
                    gf.append("-"), shares_bf.append("-"), shares_i8.append("-")
            lines += [f"| step GFLOP/s ({flops / 1e9:.0f} GFLOP a step) | " + " | ".join(gf) + " |" if flops else
                      "| step GFLOP/s | " + " | ".join(gf) + " |",
                      f"| step, share of the {fl} peak | " + " | ".join(shares_bf) + " |",
                      "| step, share of the int8 peak | " + " | ".join(shares_i8) + " |", ""]
            errs = [f"- {l}: {e}" for l in labels for e in row[l]["errors"]]
            if errs:
                lines += ["Failures:", *errs, ""]
    return lines


# --- main ------------------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sizes", default="512", help="512 and/or 1024")
    ap.add_argument("--depth", type=int, default=2, help="FLUX.1: N double + 2N single blocks; SD3.5: N joint blocks")
    ap.add_argument("--text-depth", type=int, default=4, help="T5-XXL layers (released: 24)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per process (after a warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per configuration, alternating")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default=str(HERE / "dit.json"))
    ap.add_argument("--md", default=None, help="write the report here (default: print it)")
    ap.add_argument("--peak", action="store_true", help="measure and print the GEMM peaks alone")
    ap.add_argument("--profile", action="store_true", help="torch.profiler on both engines' step (bench/dit_profile.py)")
    ap.add_argument("--profile-precision", default="auto", help="sdlite's precision under --profile (default auto)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    torch.set_num_threads(THREADS)
    if args.peak:
        print(json.dumps({"cpu": cpu_flags(), "peak": gemm_peak()}, indent=1))
        return 0
    models = [m for m in args.models.split(",") if m]
    for m in models:
        configs(m, 1, 1)
    if args.profile:
        from dit_profile import profile_main
        return profile_main(models, args.depth, args.sizes, args.profile_precision)
    labels = [c for c in args.configs.split(",") if c]
    if unknown := [c for c in labels if c not in CONFIGS]:
        raise SystemExit(f"unknown configuration {unknown[0]!r}: expected {', '.join(CONFIGS)}")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    from run import machine

    t0 = time.perf_counter()
    raw = {"meta": {"command": "python " + shlex.join(["bench/dit.py", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d"),
                    "machine": machine(), "cpu": cpu_flags(), "loadavg_start": os.getloadavg(), "depth": args.depth,
                    "text_depth": args.text_depth, "runs": args.runs, "rounds": args.rounds},
           "peak": gemm_peak(), "results": {}}
    print(f"GEMM peak: {raw['peak']}", flush=True)
    for rnd in range(args.rounds):
        for model in models:
            for size in sizes:
                order = labels if rnd % 2 == 0 else labels[::-1]
                for label in order:
                    cfg = dict(model=model, size=size, depth=args.depth, text_depth=args.text_depth, runs=args.runs,
                               **CONFIGS[label])
                    r = run_child(cfg, args.timeout)
                    raw["results"].setdefault(f"{model}|{size}|{label}", []).append(r)
                    print(f"round {rnd + 1} {model} {size} {label}: "
                          + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                                        if not k.endswith("_runs")}), flush=True)
                    Path(args.json).write_text(json.dumps(raw, indent=1))
    raw["meta"]["loadavg_end"], raw["meta"]["wall_s"] = os.getloadavg(), time.perf_counter() - t0
    Path(args.json).write_text(json.dumps(raw, indent=1))
    text = "\n".join(report(raw)) + "\n"
    if args.md:
        Path(args.md).write_text(text)
        print(f"wrote {args.md}")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
