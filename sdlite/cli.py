"""The ``sdlite`` command: a thin adapter over the library, with no model logic of its own.

Every user-facing failure is an :class:`~sdlite.errors.SDLiteError`; it is printed as one line and the
command exits with status 2.
"""
from __future__ import annotations

import argparse
import sys

from .errors import SDLiteError

FAMILY_NAMES = {
    "sd1": "Stable Diffusion 1.x",
    "sd2": "Stable Diffusion 2.x",
    "sd1-inpaint": "Stable Diffusion 1.x inpainting",
    "sd2-inpaint": "Stable Diffusion 2.x inpainting",
}


def _describe_component(name: str, spec) -> str:
    if name == "text_encoder":
        t = spec.text
        kind = "OpenCLIP ViT-H text tower" if spec.family.startswith("sd2") else "CLIP ViT-L/14 text tower"
        return f"{kind}: {t.layers} layers, width {t.width}, {t.heads} heads, {t.activation}"
    if name == "unet":
        u = spec.unet
        return (f"UNet: {u.in_channels} in-channels, widths {list(u.block_channels)}, {u.layers_per_block} "
                f"res blocks/level, heads {list(u.heads)}, context {u.context_dim}, "
                f"{'linear' if u.linear_projection else 'conv'} projections")
    v = spec.vae
    return f"AutoencoderKL: widths {list(v.block_channels)}, {v.latent_channels} latent channels, " \
           f"{v.downscale}x downsampling, scaling factor {v.scaling_factor}"


def cmd_info(args) -> int:
    from .loader import open_model, resolve_prediction_type

    with open_model(args.path, prediction_type=args.prediction_type) as ckpt:
        if ckpt.prediction_source == "unresolved":
            resolve_prediction_type(ckpt)
        spec = ckpt.spec
        layout = "diffusers folder" if ckpt.layout == "diffusers" else \
            f"original single file ({ckpt._stores[0].container})"
        print(f"path:        {ckpt.path}")
        print(f"layout:      {layout}")
        print(f"family:      {spec.family} ({FAMILY_NAMES.get(spec.family, spec.family)})")
        print(f"prediction:  {spec.prediction_type} ({ckpt.prediction_source})")
        print(f"storage:     {str(ckpt.storage_dtype).replace('torch.', '')}")
        print(f"image size:  {spec.default_size}x{spec.default_size} (native)")
        counts = ckpt.parameter_counts()
        print("components:")
        for name in ("text_encoder", "unet", "vae"):
            if name in counts:
                print(f"  {name:<13}{counts[name]:>14,} params  {_describe_component(name, spec)}")
        print(f"  {'total':<13}{sum(counts.values()):>14,} params")
        unusual = ckpt.problems() + ckpt.notes
        if ckpt.detection.has_ema:
            unusual.append("the file carries EMA copies of the UNet weights (model_ema.*); the non-EMA ones are used")
        ignored = sum(len(s.ignored) for s in ckpt.sources.values())
        if ignored:
            unusual.append(f"{ignored} buffers ignored (e.g. position_ids, schedule tensors)")
        print("unusual:" if unusual else "unusual:     nothing")
        for line in unusual:
            print(f"  - {line}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdlite", description="Stable Diffusion inference, offline and lean.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="describe a checkpoint (family, layout, dtype, parameters, anything unusual)")
    p.add_argument("path", help="a diffusers folder or a .safetensors/.ckpt single file")
    p.add_argument("--prediction-type", choices=["epsilon", "v_prediction"], default=None,
                   help="override what the checkpoint says (SD 2.x single files)")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SDLiteError as e:
        print(f"sdlite: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sdlite: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
