"""``sdlite upscale``: A1111's extras upscale (Lanczos, Nearest, an upscaler network) or the SD x4 upscaler, each
output keeping its source's generation parameters."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..errors import SDLiteError
from .options import add_precision_option, check_precision_option
from .progress import ProgressBar


def _upscale_output(output: str, source: Path, count: int) -> Path:
    """Where the upscale of ``source`` goes: into a folder (existing, or given with a trailing slash) as
    ``STEM-upscaled.png``, or to the file given (one input only); a name already taken gets ``-1``, ``-2`` ..."""
    from ..images import _names_folder

    if _names_folder(output):
        target = Path(output) / f"{source.stem}-upscaled.png"
    elif count > 1:
        raise SDLiteError(f"--output {output} names one file, but {count} images were given: give a folder "
                          "(e.g. upscaled/)")
    else:
        target = Path(output) if Path(output).suffix else Path(output).with_suffix(".png")
    candidate, n = target, 1
    while candidate.exists():
        candidate = target.with_name(f"{target.stem}-{n}{target.suffix}")
        n += 1
    return candidate


def cmd_upscale(args) -> int:
    """``sdlite upscale``: A1111's extras upscale (an image upscaler: Lanczos, Nearest, an upscaler network), or the
    SD x4 upscaler with ``--model``; each output keeps the source's generation parameters and adds the
    "Postprocess ..." fields."""
    from ..pipeline import RequestError, check_device  # first: it imports torch fastest

    from ..images import check_writable, parameters_of, save_image
    from ..sources import ImageInputError, load_image, to_rgb
    from ..upscalers.extras import Extras, check, parameters_after, postprocess
    from ..upscalers.registry import UpscalerError, network_scale

    device = check_device(args.device)
    precision = check_precision_option(args, str(device))
    x4_flags = [flag for dest, flag in (("prompt", "--prompt"), ("negative", "--negative"),
                                        ("noise_level", "--noise-level"), ("steps", "--steps"), ("cfg", "--cfg"),
                                        ("sampler", "--sampler"), ("seed", "--seed"))
                if getattr(args, dest) is not None]
    if args.model is None and x4_flags:
        raise RequestError(f"{', '.join(x4_flags)} need{'s' if len(x4_flags) == 1 else ''} the SD x4 upscaler: "
                           "add --model X4_FOLDER")
    if args.model is not None and args.upscaler is not None:
        raise RequestError("give either --upscaler (an image upscaler) or --model (the SD x4 upscaler), not both")
    sources = []
    for name in args.images:
        try:
            sources.append((Path(name), load_image(name, "image")))
        except ImageInputError as e:
            raise RequestError(str(e)) from None
    check_writable(args.output)
    outputs = []
    if args.model is None:
        upscaler = args.upscaler or "Lanczos"
        try:
            scale = args.scale if args.scale is not None else (network_scale(upscaler, args.upscaler_dir) or 2.0)
            extras = check(Extras(upscaler_1=upscaler, scale=float(scale)), args.upscaler_dir)
        except UpscalerError as e:
            raise RequestError(f"--upscaler: {e}" if "upscaling_resize" not in str(e) else
                               f"--scale {args.scale}: a factor from 1 to 8") from None
        for path, image in sources:
            t0 = time.perf_counter()
            out, info = postprocess(image, extras, args.upscaler_dir, str(device))
            target = save_image(out, _upscale_output(args.output, path, len(sources)),
                                parameters_after(parameters_of(image), info))
            outputs.append(target)
            print(f"{path.name}: {image.width}x{image.height} -> {out.width}x{out.height} by "
                  f"{info['Postprocess upscaler']} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    else:
        from PIL.Image import Resampling

        from ..upscalers.x4 import X4Upscaler

        LANCZOS = Resampling.LANCZOS
        if not Path(args.model).exists():
            raise RequestError(f"--model {args.model}: no such file or folder")
        t0 = time.perf_counter()
        model = X4Upscaler.load(args.model, device=str(device), precision=precision)
        print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s ({model.precision.label})", file=sys.stderr)
        x4_options = {k: v for k, v in (("prompt", args.prompt), ("negative_prompt", args.negative),
                                         ("noise_level", args.noise_level), ("steps", args.steps),
                                         ("cfg_scale", args.cfg), ("sampler", args.sampler), ("seed", args.seed))
                      if v is not None}
        for path, image in sources:
            result = model.upscale(to_rgb(image), callback=ProgressBar(), **x4_options)
            for w in result.warnings:
                print(f"sdlite: warning: {w}", file=sys.stderr)
            out = result.image
            info = {"Postprocess upscaler": f"SD x4 ({Path(args.model).name})", "Postprocess upscale by": 4,
                    **{f"x4 {k}": v for k, v in result.parameters().items() if k not in ("Size",)}}
            if result.prompt:
                info["x4 prompt"] = result.prompt
            if args.scale is not None and args.scale != 4:
                size = (int(image.width * args.scale), int(image.height * args.scale))
                out = out.resize(size, LANCZOS)
                info["Postprocess upscale by"] = args.scale
            target = save_image(out, _upscale_output(args.output, path, len(sources)),
                                parameters_after(parameters_of(image), info))
            outputs.append(target)
            print(f"{path.name}: {image.width}x{image.height} -> {out.width}x{out.height}, seed {result.seed}, "
                  f"{result.steps} steps, noise level {result.noise_level}; {result.timings.get('total', 0):.1f}s",
                  file=sys.stderr)
    for path in outputs:
        print(path)
    return 0


def add_parser(sub) -> None:
    u = sub.add_parser("upscale", help="upscale images: Lanczos, Nearest, an upscaler network (ESRGAN, Real-ESRGAN, "
                                       "the demo's), or the SD x4 upscaler (--model)")
    u.add_argument("images", nargs="+", metavar="IMAGE")
    u.add_argument("--upscaler", metavar="NAME|PATH", default=None,
                   help="Lanczos (default), Nearest, an upscaler network's name (--upscaler-dir; demo-4x: the shipped "
                        "demo's) or its .pth/.safetensors file")
    u.add_argument("--scale", metavar="F", type=float, default=None,
                   help="upscale by F (default: the network's own scale; 2 for Lanczos/Nearest; 4 for --model)")
    u.add_argument("--upscaler-dir", metavar="DIR", default=None, help="where upscaler networks are found by name")
    u.add_argument("--output", "-o", default="outputs/",
                   help="a folder (STEM-upscaled.png in it) or, for one image, a file name")
    u.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    add_precision_option(u)
    x4 = u.add_argument_group("the SD x4 upscaler (defaults: diffusers' for its pipeline)")
    x4.add_argument("--model", metavar="X4_FOLDER", default=None,
                    help="a stable-diffusion-x4-upscaler diffusers folder or x4-upscaler-ema.safetensors")
    x4.add_argument("--prompt", default=None, help="what the image shows (default: empty)")
    x4.add_argument("--negative", "-n", default=None, help="negative prompt")
    x4.add_argument("--noise-level", type=int, default=None, help="noise added to the input (default 20)")
    x4.add_argument("--steps", type=int, default=None, help="sampler steps (default 20)")
    x4.add_argument("--cfg", type=float, default=None, help="guidance scale (default 9)")
    x4.add_argument("--sampler", default=None, help="default: the model's scheduler (DDIM for the published folder)")
    x4.add_argument("--seed", type=int, default=None, help="-1 (default) = random; the seed used is printed")
    u.set_defaults(func=cmd_upscale)
