"""How far each precision moves T5-XXL's conditioning from fp32 (issue 55: "text encoders ... int8 compute where it
pays, each with a bound on the conditioning's error against fp32").

    python bench/t5_quality.py [--layers 4] [--tokens 256] [--plant 30] [--json PATH] [--md PATH]

The encoder: T5-XXL's widths (4096 wide, 64 heads of 64, feed-forward 10240, gated GELU) with ``--layers`` of its 24
layers, built by transformers' ``T5EncoderModel`` from its config, so its weights are transformers' own
initialisation for T5 (each projection scaled to its fan-in: activations of a sane size, where ``randn * 0.02`` at
these widths makes a chaotic network whose bf16 output is already 27 % from fp32's). The reference is that model in
fp32; sdlite's T5Encoder gets the same weights. One row of ``--tokens`` random ids (a FLUX.1-schnell row is 256).

Rows:

* ``transformers bf16``: transformers' model in bf16, as diffusers' pipelines run T5 with ``torch_dtype=bfloat16``;
* ``sdlite bf16``: sdlite's encoder in bf16 (``auto`` before T5 took int8);
* ``sdlite bf16-int8``: its blocks' Linears in int8, per-token activations, outlier columns apart (``auto`` now, on
  CPUs with native bf16 and VNNI/AMX);
* ``sdlite bf16-int8, no outlier columns``: the same with per-token codes alone;
* ``fp8 e4m3fn Linear weights, bf16 compute``: sdlite bf16 with the blocks' Linear weights rounded through
  float8_e4m3fn, as ComfyUI's ``t5xxl_fp8_e4m3fn.safetensors`` holds them (the T5 many FLUX.1 users run; unscaled,
  so T5's small weights sit low in fp8's range): a yardstick of what people already accept.

Two models: as built, and with planted outlier features (``--plant``: 6 hidden channels of the token embedding that
many times larger, so the residual stream carries a few features far above the rest, as trained T5s do: the reason
T5 v1.1 overflows fp16). Random weights cannot say how large a trained T5's outliers are; the planted model shows
what the outlier columns are for. Each cell: the relative L2 distance of the last hidden state from fp32's, and the
lowest cosine similarity of a token's state to fp32's.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from parity import cpu_name  # noqa: E402

ROWS = ("transformers bf16", "sdlite bf16", "sdlite bf16-int8", "sdlite bf16-int8, no outlier columns",
        "fp8 e4m3fn Linear weights, bf16 compute")
PLANTED_CHANNELS = 6


def models(layers: int, plant: float, seed: int = 0):
    """(transformers' T5EncoderModel in fp32, sdlite's T5Encoder with its weights in fp32); ``plant`` > 0 scales
    :data:`PLANTED_CHANNELS` embedding channels by it."""
    from transformers import T5Config, T5EncoderModel

    from sdlite.config.t5 import T5_XXL
    from sdlite.models.t5 import T5Encoder

    cfg = dataclasses.replace(T5_XXL, num_layers=layers)
    torch.manual_seed(seed)
    hf = T5EncoderModel(T5Config(**{k: v for k, v in cfg.to_transformers().items()
                                    if k not in ("architectures", "torch_dtype")})).eval()
    if plant:
        channels = torch.randperm(cfg.d_model, generator=torch.Generator().manual_seed(seed + 1))[:PLANTED_CHANNELS]
        with torch.no_grad():
            hf.shared.weight[:, channels] *= plant
    ours = T5Encoder(cfg).eval()
    ours.load_state_dict({k: v for k, v in hf.state_dict().items() if k != "encoder.embed_tokens.weight"}, strict=True,
                         assign=True)   # the same tensors: one fp32 copy
    return hf, ours


def distances(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.float(), want.float()
    cos = torch.nn.functional.cosine_similarity(got.flatten(0, -2), want.flatten(0, -2), dim=-1)
    return {"relative": ((got - want).norm() / want.norm()).item(), "cosine_min": cos.min().item()}


def measure(layers: int, tokens: int, plant: float) -> dict:
    from sdlite.engine import quant

    hf, ours = models(layers, plant)
    ids = torch.randint(0, hf.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
    out = {}
    with torch.no_grad():
        want = hf(ids).last_hidden_state
        out["transformers bf16"] = distances(copy.deepcopy(hf).bfloat16()(ids).last_hidden_state, want)
        del hf
        out["sdlite bf16"] = distances(copy.deepcopy(ours).bfloat16()(ids), want)
        int8 = quant.quantize_model(copy.deepcopy(ours).bfloat16(), "bf16-int8")
        taken = []
        plain = quant.quantize_rows_apart

        def counted(x, bits, ratio):   # once per layer call (a shared input's second reader gets the first's)
            found = plain(x, bits, ratio)
            taken.append(0 if found[3] is None else found[3].numel())
            return found

        quant.quantize_rows_apart = counted
        try:
            out["sdlite bf16-int8"] = distances(int8(ids), want)
        finally:
            quant.quantize_rows_apart = plain
        out["sdlite bf16-int8"]["outlier_columns_mean"] = sum(taken) / max(1, len(taken))
        for layer in int8.modules():
            if isinstance(layer, quant.Int8Linear):
                layer.outliers = None
        out["sdlite bf16-int8, no outlier columns"] = distances(int8(ids), want)
        del int8
        fp8 = copy.deepcopy(ours)
        for layer in fp8.encoder.block.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.weight.copy_(layer.weight.to(torch.float8_e4m3fn).float())
        out["fp8 e4m3fn Linear weights, bf16 compute"] = distances(fp8.bfloat16()(ids), want)
    return out


def markdown(result: dict) -> str:
    lines = [f"Machine: {result['machine']}. T5-XXL widths, {result['layers']} of 24 layers, transformers' own "
             f"initialisation, {result['tokens']} tokens; the command: `{result['command']}`.", "",
             "| row | as built: rel. L2 / min cosine | planted outliers (x{:g}): rel. L2 / min cosine |".format(
                 result["plant"]), "|---|---|---|"]
    for row in ROWS:
        cells = []
        for model in ("built", "planted"):
            d = result[model][row]
            cells.append(f"{d['relative']:.4f} / {d['cosine_min']:.5f}")
        lines.append(f"| {row} | {cells[0]} | {cells[1]} |")
    taken = [result[m]["sdlite bf16-int8"]["outlier_columns_mean"] for m in ("built", "planted")]
    lines += ["", f"Outlier columns computed apart, per int8 layer call: {taken[0]:.1f} (as built), {taken[1]:.1f} "
                  "(planted)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--plant", type=float, default=30.0)
    ap.add_argument("--json", type=Path, default=HERE / "t5_quality.json")
    ap.add_argument("--md", type=Path, default=HERE / "t5_quality.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    result = {"layers": args.layers, "tokens": args.tokens, "plant": args.plant,
              "machine": f"{platform.processor() or platform.machine()}, {cpu_name()}",
              "command": "python bench/t5_quality.py " + " ".join(sys.argv[1:])}
    for model, plant in (("built", 0.0), ("planted", args.plant)):
        result[model] = measure(args.layers, args.tokens, plant)
        print(model, json.dumps(result[model]), flush=True)
    args.json.write_text(json.dumps(result, indent=1))
    text = markdown(result)
    args.md.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
