"""LoRA costs on the full-size SD 1.5 checkpoint (bench/checkpoint.py: random weights at the real shapes, fp16).

    python bench/lora.py [--repeat 3] [--steps 3] [--size 256] [--threads 1]

* merge and un-merge time of a rank-8 kohya LoRA on the UNet (the layers kohya trains by default: every Linear and
  1x1 convolution of the transformers) and the text encoder (attention and MLP), median of ``--repeat``: into the
  UNet as memory modes 1/2 hold it, prepacked for oneDNN (the default where this CPU gains from it) and plain
  fp32, into a resident fp32 text encoder; plus a LoCon (the same with every ResBlock convolution) into the
  prepacked UNet; the whole ``engine_with_loras`` enter/exit of the LoCon on a mode-1 engine at each precision this
  CPU runs (exact, bf16, bf16-int8: int8 layers quantized again), for a first request and for the same LoRA again
  (the merged layers kept from the request before);
* the per-step cost of on-the-fly application at ``--size`` (a UNet call on a batch of 2, as classifier-free
  guidance runs it): memory mode 0 (weights streamed from the file) and fp16 weights up-cast block by block,
  without and with the LoRA, median of ``--steps`` calls after one warm-up, the variants interleaved call by
  call; the LoRA's own work per call measured alone (its copies and addmms); the resident merged UNet for
  comparison (no per-step cost), and the alternative this design rejected, a forward hook on each touched layer
  adding ``scale * up(down(x))`` to its output.

Times are process CPU seconds with ``--threads`` threads (default 1): on a shared machine far steadier than wall
time, and equal to it on an idle one. Prints markdown tables.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ATTENTION = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
             "attn2.to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out")
CONVS = ("conv1", "conv2", "conv_shortcut", "time_emb_proj")
TEXT = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def write_lora(path: Path, unet_suffixes, rank: int = 8) -> Path:
    """A kohya LoRA with random factors (fp16, alpha = rank / 2) for the SD 1.5 layers ending in the suffixes."""
    from safetensors.torch import save_file

    from sdlite.config import SD15
    from sdlite.models.clip import CLIPTextEncoder
    from sdlite.models.unet import UNet

    with torch.device("meta"):
        nets = {"lora_unet_": (UNet(SD15.unet), unet_suffixes), "lora_te_": (CLIPTextEncoder(SD15.text), TEXT)}
    g = torch.Generator().manual_seed(0)
    state = {}
    for prefix, (net, suffixes) in nets.items():
        for name, m in net.named_modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and name.endswith(tuple("." + s for s in suffixes)):
                shape = tuple(m.weight.shape)
                key = prefix + name.replace(".", "_")
                state[f"{key}.lora_down.weight"] = (torch.randn((rank, *shape[1:]), generator=g) * 0.01).half()
                state[f"{key}.lora_up.weight"] = (torch.randn((shape[0], rank, *([1, 1] if len(shape) == 4 else [])),
                                                              generator=g) * 0.01).half()
                state[f"{key}.alpha"] = torch.tensor(rank / 2).half()
    save_file(state, str(path))
    return path


def clock() -> float:
    """Process CPU time: on a shared machine far steadier than wall time (with one thread, the same on an idle
    one)."""
    return time.process_time()


def merge_times(module, lora, component, repeat):
    """(merge, restore) medians."""
    from sdlite.adapters.lora import merge

    merges, restores = [], []
    for _ in range(repeat):
        t0 = clock()
        handle = merge(module, [(lora, 1.0)], component)
        t1 = clock()
        handle.restore()
        t2 = clock()
        merges.append(t1 - t0)
        restores.append(t2 - t1)
        gc.collect()
    return statistics.median(merges), statistics.median(restores)


class HookLora:
    """The rejected alternative: a forward hook per touched layer that adds ``scale * up(down(x))``."""

    def __init__(self, module, lora, component):
        from sdlite.adapters.lora import resolve_targets

        names = resolve_targets(module, lora, component)
        self.handles = []
        for layer in lora.layers_of(component):
            target = module.get_submodule(names[layer.key])
            down, up, scale = layer.down.float(), layer.up.float(), layer.scale(1.0)
            conv = isinstance(target, torch.nn.Conv2d)
            if conv and down.dim() == 2:
                down, up = down[:, :, None, None], up[:, :, None, None]

            def hook(mod, args, out, down=down, up=up, scale=scale, conv=conv):
                x = args[0]
                if conv:
                    h = F.conv2d(x, down, None, mod.stride, mod.padding, mod.dilation, mod.groups)
                    return out.add_(F.conv2d(h, up), alpha=scale)
                return out.add_(F.linear(F.linear(x, down), up), alpha=scale)

            self.handles.append(target.register_forward_hook(hook))

    def remove(self):
        for h in self.handles:
            h.remove()


def step_times(unet, variants: dict, size: int, steps: int) -> dict:
    """Median CPU time of one UNet call per variant (name -> (switch on, switch off)), the variants interleaved
    call by call (so drifts in the machine's load hit them alike), after one warm-up round."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, size // 8, size // 8, generator=g)
    ctx = torch.randn(2, 77, 768, generator=g)
    t = torch.tensor([500.0, 500.0])
    times = {name: [] for name in variants}
    with torch.no_grad():
        for i in range(steps + 1):
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for name in order:
                on, off = variants[name]
                on()
                t0 = clock()
                unet(x, t, ctx)
                elapsed = clock() - t0
                off()
                if i:
                    times[name].append(elapsed)
    return {name: statistics.median(ts) for name, ts in times.items()}


def lora_work(unet, lora) -> float:
    """CPU time of the work the LoRA adds to one call of a streamed UNet: its provider's copies and addmms alone."""
    from sdlite.adapters.lora import apply_on_the_fly, resolve_targets

    streamer = unet._streamer
    handle = apply_on_the_fly(unet, [(lora, 1.0)], "unet")
    wrapped = streamer.provider
    keys = [f"{name}.weight" for name in resolve_targets(unet, lora, "unet").values()]
    t0 = clock()
    for key in keys:
        wrapped(key)
    with_lora = clock() - t0
    handle.restore()
    t0 = clock()
    for key in keys:
        streamer.provider(key).to(torch.float32)   # what the streamer does for these layers anyway
    return with_lora - (clock() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from checkpoint import DEFAULT_CACHE, build

    from sdlite.engine.memory import streamed_model
    from sdlite.loader import open_model
    from sdlite.adapters.lora import engine_with_loras, merge, read_lora
    from sdlite.engine.precision import PrecisionError
    from sdlite.pipeline import Engine

    folder, _ = build()
    lora = read_lora(write_lora(DEFAULT_CACHE / "lora-r8.safetensors", ATTENTION))
    locon = read_lora(write_lora(DEFAULT_CACHE / "locon-r8.safetensors", ATTENTION + CONVS))
    n_unet, n_te = len(lora.layers_of("unet")), len(lora.layers_of("text_encoder"))
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; LoRA: rank 8, {n_unet} UNet + {n_te} "
          f"text-encoder layers; LoCon: {len(locon.layers_of('unet'))} UNet layers", flush=True)

    # --- merge / un-merge ---
    ckpt = open_model(folder)
    engine = Engine.load(folder, precision="exact")   # memory mode 1; prepacked where this CPU gains from it
    unet = engine.models.get("unet")
    packed = type(unet.conv_in).__name__ == "PackedConv2d"
    rows.append((f"merge, UNet ({'prepacked' if packed else 'plain'} fp32, mode 1 default)",
                 *merge_times(unet, lora, "unet", args.repeat)))
    rows.append((f"merge, UNet LoCon ({'prepacked' if packed else 'plain'} fp32)",
                 *merge_times(unet, locon, "unet", args.repeat)))
    if packed:
        del unet, engine
        gc.collect()
        plain = ckpt.load("unet", torch.float32)
        rows.append(("merge, UNet (plain fp32)", *merge_times(plain, lora, "unet", args.repeat)))
        del plain
        gc.collect()
    te = ckpt.load("text_encoder", torch.float32)
    rows.append(("merge, text encoder (fp32)", *merge_times(te, lora, "text_encoder", args.repeat)))
    del te
    gc.collect()
    for precision in ("exact", "bf16", "bf16-int8"):   # whole requests' LoRA work, first and again (kept)
        try:
            engine = Engine.load(folder, precision=precision)
        except PrecisionError:
            rows.append((f"engine_with_loras, mode 1, {precision}: refused on this CPU", float("nan"), float("nan")))
            continue
        engine.encode_prompt(["warm"])   # the text encoder resident (mode 1 keeps an fp16 file's as stored)
        engine.models.get("unet")
        for label, kept in (("first request", False), ("same LoRAs again (kept)", True)):
            enters, exits = [], []
            for _ in range(args.repeat):
                if not kept:
                    engine.models.kept_loras = None
                    gc.collect()
                t0 = clock()
                with engine_with_loras(engine, [(locon.path, 1.0)]):
                    t1 = clock()
                t2 = clock()
                enters.append(t1 - t0)
                exits.append(t2 - t1)
            rows.append((f"engine_with_loras (LoCon), mode 1, {precision}: {label} (enter / exit)",
                         statistics.median(enters), statistics.median(exits)))
        del engine
        gc.collect()
    print("| CPU s, median of", args.repeat, "| merge | un-merge |\n| --- | --- | --- |")
    for name, m, r in rows:
        print(f"| {name} | {m:.3f} | {r:.4f} |")
    print(flush=True)

    # --- per-step cost of on-the-fly application ---
    rows = []
    configs = [("memory mode 0 (streamed from the file)", dict(keep_pages=False)),
               ("fp16 weights, up-cast per block", dict(keep_pages=True, weight_dtype=torch.float16))]
    for name, kwargs in configs:
        unet = streamed_model(ckpt, "unet", torch.float32, **kwargs)
        state = {}

        def on_the_fly(unet=unet, state=state):
            state["h"] = merge(unet, [(lora, 1.0)], "unet")

        def hooked(unet=unet, state=state):
            state["h"] = HookLora(unet, lora, "unet")

        def off(state=state):
            h = state.pop("h", None)
            if h is not None:
                h.restore() if hasattr(h, "restore") else h.remove()

        got = step_times(unet, {"without": (lambda: None, off), "on the fly": (on_the_fly, off),
                                "hook": (hooked, off)}, args.size, args.steps)
        rows.append((name, got["without"], got["on the fly"], got["hook"], lora_work(unet, lora)))
        del unet
        gc.collect()
    unet = ckpt.load("unet", torch.float32)
    state = {}

    def merged():
        state["h"] = merge(unet, [(lora, 1.0)], "unet")

    def unmerged():
        state.pop("h").restore()

    got = step_times(unet, {"without": (lambda: None, lambda: None), "merged": (merged, unmerged)}, args.size,
                     args.steps)
    rows.append(("resident plain fp32, merged before sampling (modes 1/2)", got["without"], got["merged"],
                 float("nan"), 0.0))
    print(f"| UNet call, {args.size}x{args.size}, batch 2, CPU s | without LoRA | with LoRA | overhead | "
          "LoRA work per call | forward-hook alternative |\n| --- | --- | --- | --- | --- | --- |")
    for name, a, b, h, work in rows:
        hook = "" if h != h else f"{h:.3f} ({(h / a - 1) * 100:+.1f}%)"
        print(f"| {name} | {a:.3f} | {b:.3f} | {(b / a - 1) * 100:+.1f}% | {work:.3f} | {hook} |")


if __name__ == "__main__":
    main()
