"""The int8 and int4 precisions of a transformer (weight-only, sdlite.engine.lowbit): their kernels, their images
against exact, their memory.

    python bench/lowbit_precision.py kernels [--tokens 1536] [--repeat 3]
    python bench/lowbit_precision.py quality --family flux|sd3 [--seeds 8] [--steps 4] [--size 256] [--work DIR]
    python bench/lowbit_precision.py memory --family flux|sd3 [--work DIR]
    python bench/lowbit_precision.py all [--work DIR]     (both, then bench/lowbit_precision.{json,md})

``kernels``: one FLUX-size Linear (3072 -> 12288 and 12288 -> 3072, on 1024 image + 512 text tokens in bf16): bf16
``F.linear`` on the dense weight; LowBitLinear over I8_ROW and I4_G64 weights (dequantise, then bf16 ``F.linear``)
and the dequantising alone; torch's weight-only kernels ``aten._weight_int8pack_mm`` (int8, one bf16 scale per output
channel; run on 128 tokens and scaled, its time being linear in the tokens) and ``aten._weight_int4pack_mm_for_cpu``
(4-bit, groups of 64 with bf16 scales and zeros, packed by ``_convert_weight_to_int4pack_for_cpu``). Medians.

``quality`` (also GGUF's Q8_0 and Q4_0, see :data:`GGUF_TYPES`): a diffusers folder whose transformer has the released widths but few blocks (``--blocks``; FLUX.1
schnell: 3072 wide, 24 heads, by default 2 double + 4 single blocks, 1.29B parameters; SD3.5 Large: 2432 wide, 38
heads, qk RMS norms, by default 4 joint blocks), PyTorch's default initialisation (uniform, 1/sqrt(fan-in)), with the tests' tiny text encoders and VAE
beside it, all saved in bf16 (so every precision reads the same values). Each precision runs in its own process
(``Engine.load(folder, precision=p)``, memory mode 1): one batch of ``--seeds`` images (seeds 0..n-1, FLUX 4 steps
without CFG, SD3.5 4 steps at cfg 1), its peak RSS, load and generation times. Against exact: each image's PSNR
(decoded by the tiny random VAE) and the relative L2 error of its final latents. Random weights give noise-like
images, so the PSNR measures how far the network's arithmetic moved, not how an image looks.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))   # sdlite, and the tests' tiny encoders and VAE
sys.path.insert(0, str(HERE))   # the other bench scripts

from lowbit import timed        # noqa: E402
from parity import cpu_name     # noqa: E402
PRECISIONS = ("exact", "bf16", "int8", "int4")
# GGUF's block types, in the quality run only: the bf16 folder's transformer with every 2-D weight of 1024 values or
# more (rows a whole number of 32-value blocks) replaced by what the type holds (the gguf package's own quantize and
# dequantize), computed as sdlite computes a GGUF transformer (bf16). A GGUF file's generation equals the one from the
# values it holds (tests/test_flux_files.py), so this is a Q8_0 / Q4_0 file's image. city96's files keep a few small
# tensors unquantised; quantizing them too makes these rows a bound from below. Q4_K has no quantizer in the package.
GGUF_TYPES = ("Q8_0", "Q4_0")
QUALITY_PRECISIONS = PRECISIONS + tuple(f"gguf-{t}" for t in GGUF_TYPES)
RESULTS = ROOT / "bench" / "lowbit_precision.json"
# blocks of the bench's transformers: FLUX (double, single), SD3.5 (joint)
DEFAULT_BLOCKS = {"flux": (2, 4), "sd3": (4,)}


# -- kernels ---------------------------------------------------------------------------------------------------------

def kernels(tokens: int, repeat: int) -> dict:
    import torch
    import torch.nn.functional as F

    from sdlite.engine.lowbit import LowBitLinear, quantize_weight
    from sdlite.engine.memory import tune_heap

    tune_heap()   # as the engine runs
    g = torch.Generator().manual_seed(0)
    out = {"tokens": tokens, "threads": torch.get_num_threads(), "torch": torch.__version__, "shapes": {}}
    for n, k in ((12288, 3072), (3072, 12288)):
        w = ((torch.rand(n, k, generator=g) * 2 - 1) / k ** 0.5).bfloat16()
        x = torch.randn(tokens, k, generator=g).bfloat16()
        row = {"bf16 F.linear": timed(lambda: F.linear(x, w), repeat)}
        for mode in ("int8", "int4"):
            q = quantize_weight(w, mode)
            layer = LowBitLinear(q)
            row[f"{mode} dequantise"] = timed(lambda: q.dequantize(torch.bfloat16), repeat)
            row[f"{mode} LowBitLinear"] = timed(lambda: layer(x), repeat)
        # torch's int8 kernel: per-channel int8 and bf16 scales
        wf = w.float()
        scale = wf.abs().amax(1) / 127
        q8 = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
        few = x[:128]
        t8 = timed(lambda: torch.ops.aten._weight_int8pack_mm(few, q8, scale.bfloat16()), 1)
        row["_weight_int8pack_mm"] = t8 * tokens / few.shape[0]
        # torch's int4 kernel: groups of 64, w = (q - 8) * scale + zero, packed for the CPU
        group = 64
        wg = wf.view(n, k // group, group)
        low, high = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        s4 = ((high - low) / 15).clamp(min=1e-8)
        q4 = torch.round((wg - low) / s4).clamp(0, 15).to(torch.int32).view(n, k)
        zeros = low + 8 * s4
        sz = torch.stack([s4.view(n, -1), zeros.view(n, -1)], -1).transpose(0, 1).contiguous().bfloat16()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 2)
        row["_weight_int4pack_mm_for_cpu"] = timed(
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz), max(1, repeat - 1))
        out["shapes"][f"{k} -> {n}"] = row
        print(f"{k} -> {n}: " + ", ".join(f"{name} {t:.3f} s" for name, t in row.items()), flush=True)
    return out


# -- quality ---------------------------------------------------------------------------------------------------------

def build(family: str, folder: Path, blocks: tuple[int, ...], t5_layers: int = 0) -> int:
    """The bench's model (module docstring) saved in bf16 at ``folder``; returns the transformer's parameters.
    ``t5_layers``: its T5 at T5-XXL's widths with that many layers (transformers' own initialisation; the
    transformer's text input 4096 wide), instead of the tests' tiny one."""
    import torch

    tmp = folder.parent / f"{folder.name}-parts"
    if family == "flux":
        from diffusers import FluxTransformer2DModel

        from tests.test_flux_pipeline import T5_WIDTH, _pipeline

        pipe = _pipeline(tmp, "schnell", save=False)
        torch.manual_seed(0)
        pipe.transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=blocks[0], num_single_layers=blocks[1], attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096 if t5_layers else T5_WIDTH, pooled_projection_dim=32,
            guidance_embeds=False,
            axes_dims_rope=(16, 56, 56)).eval()
    else:
        from diffusers import SD3Transformer2DModel

        from tests.test_sd3_pipeline import TEXT_G, TEXT_L, T5_WIDTH, _pipeline

        pipe = _pipeline(tmp)
        torch.manual_seed(0)
        pipe.transformer = SD3Transformer2DModel(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=blocks[0], attention_head_dim=64,
            num_attention_heads=38, joint_attention_dim=4096 if t5_layers else T5_WIDTH, caption_projection_dim=2432,
            pooled_projection_dim=TEXT_L.projection_dim + TEXT_G.projection_dim, pos_embed_max_size=192,
            qk_norm="rms_norm").eval()
    if t5_layers:
        import dataclasses

        from transformers import T5Config, T5EncoderModel

        from sdlite.config.t5 import T5_XXL

        cfg = dataclasses.replace(T5_XXL, num_layers=t5_layers).to_transformers()
        t5 = T5EncoderModel(T5Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}))
        setattr(pipe, "text_encoder_2" if family == "flux" else "text_encoder_3", t5.eval())
    pipe.to(torch.bfloat16).save_pretrained(folder)
    return sum(p.numel() for p in pipe.transformer.parameters())


def run_one(folder: Path, precision: str, seeds: int, steps: int, size: int, out: Path) -> None:
    """One precision, in this process: a batch of ``seeds`` images; their pixels and latents to ``out``."""
    import numpy as np
    import torch

    from sdlite.engine.lowbit import lowbit_bytes
    from sdlite.pipeline import Engine, Request

    start = time.perf_counter()
    gguf_type = precision.removeprefix("gguf-") if precision.startswith("gguf-") else None
    engine = Engine.load(folder, precision="bf16" if gguf_type else precision)
    if gguf_type:
        _hold_as_gguf(engine, gguf_type)
    loaded = time.perf_counter() - start
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with engine.models.use("transformer") as transformer:
        stored = lowbit_bytes(transformer) + sum(p.numel() * p.element_size() for p in transformer.parameters())
    resident = _resident()   # after the load: anonymous memory (the weights as held) and mapped file pages
    if seeds == 0:             # the memory run: nothing more
        out.write_text(json.dumps({"precision": engine.precision.label, "load_s": loaded, "transformer_bytes": stored,
                                   "peak_rss_after_load": rss_loaded, **resident}))
        return
    r = Request(prompt="a lighthouse on a cliff at dawn", steps=steps, cfg_scale=1.0, sampler="euler", seed=0,
                width=size, height=size, batch_size=seeds)
    start = time.perf_counter()
    result = engine.generate(r)
    generated = time.perf_counter() - start
    pixels = np.stack([np.asarray(im, dtype=np.uint8) for im in result.images])
    np.savez(out, pixels=pixels, latents=result.latents.float().numpy(),
             meta=json.dumps({"precision": engine.precision.label, "load_s": loaded, "generate_s": generated,
                              "transformer_bytes": stored, "peak_rss_after_load": rss_loaded,
                              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                              "dtype": str(engine.precision.dtype)}))


def _hold_as_gguf(engine, type_name: str) -> int:
    """Replace the engine's transformer weights by the values a GGUF file of ``type_name`` holds for them (see
    :data:`GGUF_TYPES`); returns how many tensors were replaced."""
    import gguf
    import numpy as np
    import torch

    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    count = 0
    with engine.models.use("transformer") as transformer, torch.no_grad():
        for name, p in transformer.named_parameters():
            if p.dim() == 2 and p.numel() >= 1024 and p.shape[1] % 32 == 0:
                a = p.float().numpy()
                held = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
                p.copy_(torch.from_numpy(np.ascontiguousarray(held)).reshape(p.shape))
                count += 1
    print(f"{type_name}: {count} transformer weights held as the file would hold them", flush=True)
    return count


def _resident() -> dict:
    """RssAnon and RssFile of this process now, in bytes (Linux)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def memory(family: str, work: Path, blocks: tuple[int, ...]) -> dict:
    """Each precision's process after ``Engine.load`` (memory mode 1): the transformer's bytes as held, the process's
    anonymous memory and mapped file pages, and its peak RSS so far (which counts the file pages the load touched)."""
    folder, blocks, _ = bench_folder(family, work, blocks)
    rows = {}
    for p in PRECISIONS:
        out = work / f"{family}-{p}-memory.json"
        subprocess.run([sys.executable, __file__, "run", "--folder", str(folder), "--precision", p, "--seeds", "0",
                        "--out", str(out)], check=True)
        rows[p] = json.loads(out.read_text())
        m = rows[p]
        print(f"{family} {p}: transformer {m['transformer_bytes'] / 2**30:.2f} GiB, RssAnon "
              f"{m.get('RssAnon', 0) / 2**30:.2f} GiB, RssFile {m.get('RssFile', 0) / 2**30:.2f} GiB, peak RSS "
              f"{m['peak_rss_after_load'] / 2**30:.2f} GiB, load {m['load_s']:.1f} s", flush=True)
    return {"family": family, "blocks": list(blocks), "precisions": rows}


def _psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10 * np.log10(255 ** 2 / mse) if mse else float("inf")


def bench_folder(family: str, work: Path, blocks: tuple[int, ...],
                 t5_layers: int = 0) -> tuple[Path, tuple[int, ...], int | None]:
    """(the bench model's folder under ``work``, built there unless it is already, its blocks, its transformer's
    parameters when built now); ``t5_layers`` as :func:`build`'s."""
    blocks = blocks or DEFAULT_BLOCKS[family]
    folder = work / f"{family}-{'-'.join(map(str, blocks))}{f'-t5x{t5_layers}' if t5_layers else ''}-bench"
    params = None
    if not (folder / "model_index.json").exists():
        params = build(family, folder, blocks, t5_layers)
        print(f"{family}: built {folder.name} ({params / 1e9:.2f}B transformer parameters)", flush=True)
    return folder, blocks, params


def against(run: dict, ref: dict, seeds: int) -> dict:
    """One run's images and final latents against another's, seed by seed: PSNR min and mean, the latents' relative
    L2 error mean and max."""
    import numpy as np

    psnrs = [_psnr(run["pixels"][i], ref["pixels"][i]) for i in range(seeds)]
    rel = [float(np.linalg.norm(run["latents"][i] - ref["latents"][i]) / np.linalg.norm(ref["latents"][i]))
           for i in range(seeds)]
    return dict(psnr_min=min(psnrs), psnr_mean=float(np.mean(psnrs)), latent_rel_mean=float(np.mean(rel)),
                latent_rel_max=max(rel))


def quality(family: str, seeds: int, steps: int, size: int, work: Path, blocks: tuple[int, ...]) -> dict:
    import numpy as np

    folder, blocks, params = bench_folder(family, work, blocks)
    runs = {}
    for p in QUALITY_PRECISIONS:
        out = work / f"{family}-{p}.npz"
        subprocess.run([sys.executable, __file__, "run", "--folder", str(folder), "--precision", p, "--seeds",
                        str(seeds), "--steps", str(steps), "--size", str(size), "--out", str(out)], check=True)
        data = np.load(out)
        runs[p] = {"pixels": data["pixels"], "latents": data["latents"], **json.loads(str(data["meta"]))}
        m = runs[p]
        print(f"{family} {p}: load {m['load_s']:.1f} s, {seeds} images {m['generate_s']:.1f} s, transformer "
              f"{m['transformer_bytes'] / 2**30:.2f} GiB, peak RSS {m['peak_rss'] / 2**30:.2f} GiB", flush=True)
    exact = runs["exact"]
    result = {"family": family, "seeds": seeds, "steps": steps, "size": size, "blocks": list(blocks),
              "transformer_parameters": params,
              "precisions": {}}
    for p, m in runs.items():
        row = {k: m[k] for k in ("precision", "dtype", "load_s", "generate_s", "transformer_bytes",
                                 "peak_rss_after_load", "peak_rss")}
        if p != "exact":
            row.update(against(m, exact, seeds))
            if p.startswith("gguf-"):   # against the bf16 run of the same dense values
                vs_bf16 = against(m, runs["bf16"], seeds)
                row.update(psnr_vs_bf16_min=vs_bf16["psnr_min"], psnr_vs_bf16_mean=vs_bf16["psnr_mean"])
                print(f"{family} {p}: against bf16, PSNR min {vs_bf16['psnr_min']:.2f} dB, mean "
                      f"{vs_bf16['psnr_mean']:.2f} dB", flush=True)
            print(f"{family} {p}: PSNR min {row['psnr_min']:.2f} dB, mean {row['psnr_mean']:.2f} dB; latents relative "
                  f"error mean {row['latent_rel_mean']:.4f}, max {row['latent_rel_max']:.4f}", flush=True)
        result["precisions"][p] = row
    return result


def write_markdown(results: dict, path: Path) -> None:
    lines = ["# int8 / int4 weights of a transformer against exact (bench/lowbit_precision.py)", "",
             f"Machine: {results.get('machine', '?')}.", ""]
    k = results.get("kernels")
    if k:
        lines += [f"## One FLUX Linear, {k['tokens']} tokens, bf16 activations, {k['threads']} threads "
                  f"(torch {k['torch']}; seconds, medians; load average {k.get('load_average')})", ""]
        names = list(next(iter(k["shapes"].values())))
        lines += ["| | " + " | ".join(k["shapes"]) + " |", "|---|" + "---|" * len(k["shapes"])]
        for name in names:
            lines.append(f"| {name} | " + " | ".join(f"{row[name]:.3f}" for row in k["shapes"].values()) + " |")
        lines.append("")
    for family in ("flux", "sd3"):
        q = results.get(family)
        if not q:
            continue
        params = q.get("transformer_parameters")
        lines += [f"## {family}: blocks {q.get('blocks')}" + (f" ({params / 1e9:.2f}B parameters)" if params else "")
                  + f", {q['seeds']} seeds, {q['size']}x{q['size']}, {q['steps']} steps", "",
                  "| precision | compute | PSNR vs exact, min / mean (dB) | latents rel. error, mean / max | "
                  "transformer in memory | load | generate |", "|---|---|---|---|---|---|---|"]
        for p, row in q["precisions"].items():
            quality_cells = "-- | --" if p == "exact" else (
                f"{row['psnr_min']:.2f} / {row['psnr_mean']:.2f} | {row['latent_rel_mean']:.4f} / "
                f"{row['latent_rel_max']:.4f}")
            lines.append(f"| {p} | {row['dtype'].removeprefix('torch.')} | {quality_cells} | "
                         f"{row['transformer_bytes'] / 2**30:.2f} GiB | {row['load_s']:.1f} s | "
                         f"{row['generate_s']:.1f} s |")
        lines.append("")
        ggufs = [(p, row) for p, row in q["precisions"].items() if "psnr_vs_bf16_min" in row]
        if ggufs:
            lines += ["The gguf- rows: the values a GGUF file of that type holds, computed in bf16 as sdlite computes a "
                      "GGUF transformer (held dense here, so their memory column is bf16's). Against the bf16 row, "
                      "PSNR min / mean: " + "; ".join(f"{p} {row['psnr_vs_bf16_min']:.2f} / "
                                                      f"{row['psnr_vs_bf16_mean']:.2f} dB" for p, row in ggufs) + ".",
                      ""]
    for family in ("flux", "sd3"):
        m = results.get(f"{family}_memory")
        if not m:
            continue
        lines += [f"## {family}: memory after Engine.load (mode 1), blocks {m['blocks']}", "",
                  "| precision | transformer held | RssAnon | RssFile | peak RSS during the load | load |",
                  "|---|---|---|---|---|---|"]
        for p, row in m["precisions"].items():
            lines.append(f"| {p} | {row['transformer_bytes'] / 2**30:.2f} GiB | {row.get('RssAnon', 0) / 2**30:.2f} GiB "
                         f"| {row.get('RssFile', 0) / 2**30:.2f} GiB | {row['peak_rss_after_load'] / 2**30:.2f} GiB | "
                         f"{row['load_s']:.1f} s |")
        lines.append("")
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["kernels", "quality", "memory", "all", "run"])
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for kernels (default: torch's choice)")
    ap.add_argument("--family", choices=["flux", "sd3"], default="flux")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--blocks", default=None, help="FLUX: double,single (default 2,4); SD3.5: joint (default 4)")
    ap.add_argument("--work", type=Path, default=None, help="folder for the models and runs (default: a temporary one)")
    ap.add_argument("--folder", type=Path)
    ap.add_argument("--precision")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.what == "run":
        run_one(args.folder, args.precision, args.seeds, args.steps, args.size, args.out)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="lowbit-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["machine"] = f"{platform.processor() or platform.machine()}, {cpu_name()}"
    if args.what in ("kernels", "all"):
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        results["kernels"] = kernels(args.tokens, args.repeat)
        results["kernels"]["load_average"] = _load_average()
    families = ("flux", "sd3") if args.what == "all" else (args.family,) if args.what == "quality" else ()
    for family in families:
        blocks = tuple(int(b) for b in args.blocks.split(",")) if args.blocks else None
        results[family] = quality(family, args.seeds, args.steps, args.size, work, blocks)
    if args.what == "memory":
        blocks = tuple(int(b) for b in args.blocks.split(",")) if args.blocks else None
        results[f"{args.family}_memory"] = memory(args.family, work, blocks)
    RESULTS.write_text(json.dumps(results, indent=1))
    write_markdown(results, RESULTS.with_suffix(".md"))


def _load_average() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


if __name__ == "__main__":
    main()
