"""``sdlite generate``'s hires fix (A1111's two-pass text to image): its argument group, and the
:class:`~sdlite.hires.Hires` its flags make, checked before the model load."""
from __future__ import annotations

from pathlib import Path


_HIRES_FLAGS = (("hires_upscaler", "--hires-upscaler"), ("hires_denoise", "--hires-denoise"),
                ("hires_steps", "--hires-steps"), ("hires_sampler", "--hires-sampler"), ("hires_cfg", "--hires-cfg"),
                ("hires_prompt", "--hires-prompt"), ("hires_negative", "--hires-negative"),
                ("hires_checkpoint", "--hires-checkpoint"))


def parse_wxh(text: str, flag: str) -> tuple[int, int]:
    """``WxH`` (either may be 0) -> (W, H)."""
    from ..pipeline import RequestError

    try:
        w, h = (int(v) for v in text.lower().split("x"))
        if w >= 0 and h >= 0 and (w or h):
            return w, h
    except ValueError:
        pass
    raise RequestError(f"{flag} {text!r} is not valid: expected WIDTHxHEIGHT in pixels, e.g. 1024x768 (0 on one "
                       "side keeps the aspect)")


def hires_option(args):
    """The :class:`~sdlite.hires.Hires` of ``--hires`` / ``--hires-size`` and the other ``--hires-*`` flags."""
    from ..hires import DEFAULT_DENOISE, DEFAULT_UPSCALER, Hires
    from ..pipeline import RequestError

    if args.hires is None and args.hires_size is None:
        stray = [flag for dest, flag in _HIRES_FLAGS if getattr(args, dest) is not None]
        if stray:
            raise RequestError(f"{', '.join(stray)} need{'s' if len(stray) == 1 else ''} the hires fix: add --hires "
                               "SCALE or --hires-size WxH")
        return None
    if args.hires is not None and args.hires_size is not None:
        raise RequestError("give either --hires SCALE or --hires-size WxH, not both")
    if args.hires_checkpoint is not None and not Path(args.hires_checkpoint).exists():
        raise RequestError(f"--hires-checkpoint {args.hires_checkpoint}: no such file or folder")
    resize = parse_wxh(args.hires_size, "--hires-size") if args.hires_size else (0, 0)
    return Hires(scale=args.hires if args.hires is not None else 2.0, resize_x=resize[0], resize_y=resize[1],
                 upscaler=args.hires_upscaler or DEFAULT_UPSCALER, steps=args.hires_steps or 0,
                 denoise=DEFAULT_DENOISE if args.hires_denoise is None else args.hires_denoise,
                 sampler=args.hires_sampler, cfg_scale=args.hires_cfg, prompt=args.hires_prompt,
                 negative_prompt=args.hires_negative, checkpoint=args.hires_checkpoint)


def check_upscaler_name(name: str, folder, latent_ok: bool = False) -> None:
    """An upscaler name or file that cannot be found fails before the model load, naming what is available."""
    from ..hires import LATENT_MODES
    from ..pipeline import RequestError
    from ..upscalers.registry import UpscalerError, resolve

    if latent_ok and name in LATENT_MODES:
        return
    try:
        resolve(name, folder)
    except UpscalerError as e:
        more = f" (or a latent mode: {', '.join(LATENT_MODES)})" if latent_ok else ""
        raise RequestError(f"{e}{more}") from None


def add_hires_arguments(g) -> None:
    """The "hires fix" argument group of ``sdlite generate``."""
    h = g.add_argument_group("hires fix (A1111's two-pass text to image)")
    h.add_argument("--hires", metavar="SCALE", type=float, default=None,
                   help="generate at the size asked, upscale by SCALE (e.g. 2), then repaint at that size")
    h.add_argument("--hires-size", metavar="WxH", default=None,
                   help="upscale to this size instead (A1111's hr_resize_x/y: 0 on one side keeps the aspect; both "
                        "set: fitted, then cropped)")
    h.add_argument("--hires-upscaler", metavar="NAME", default=None,
                   help="Latent (default), Latent (antialiased), Latent (bicubic), Latent (bicubic antialiased), "
                        "Latent (nearest), Latent (nearest-exact), None, Lanczos, Nearest, an upscaler network's name "
                        "(--upscaler-dir) or file")
    h.add_argument("--hires-denoise", metavar="F", type=float, default=None,
                   help="denoising strength of the second pass (default 0.7)")
    h.add_argument("--hires-steps", metavar="N", type=int, default=None,
                   help="second-pass steps (default: the first pass's); int(N x denoise) of them run")
    h.add_argument("--hires-sampler", metavar="NAME", default=None, help="second-pass sampler (default: the same)")
    h.add_argument("--hires-cfg", metavar="X", type=float, default=None, help="second-pass CFG scale (default: the same)")
    h.add_argument("--hires-prompt", metavar="TEXT", default=None, help="second-pass prompt (default: the same)")
    h.add_argument("--hires-negative", metavar="TEXT", default=None,
                   help="second-pass negative prompt (default: the same)")
    h.add_argument("--hires-checkpoint", metavar="PATH", default=None,
                   help="another model of the same family for the second pass")
    h.add_argument("--upscaler-dir", metavar="DIR", default=None,
                   help="where upscaler networks (.pth/.safetensors: ESRGAN, Real-ESRGAN, ...) are found by name")
