"""``sdlite generate``'s ControlNet options (A1111's ControlNet extension): their argument group, and the
:class:`~sdlite.control.ControlUnit` of each ``--controlnet``, checked before the model load."""
from __future__ import annotations

from pathlib import Path

from ..errors import SDLiteError


# the per-unit flags: (args attribute, flag, the ControlUnit field it sets)
_CONTROL_FLAGS = (("control_image", "--control-image", "image"), ("control_weight", "--control-weight", "weight"),
                  ("control_start", "--control-start", "guidance_start"),
                  ("control_end", "--control-end", "guidance_end"),
                  ("control_preprocessor", "--control-preprocessor", "preprocessor"),
                  ("control_mode", "--control-mode", "mode"), ("control_resize", "--control-resize", "resize_mode"),
                  ("control_threshold_a", "--control-threshold-a", "threshold_a"),
                  ("control_threshold_b", "--control-threshold-b", "threshold_b"),
                  ("control_processor_res", "--control-processor-res", "processor_res"),
                  ("control_hr_option", "--control-hr-option", "hr_option"))


def resolve_controlnet(path: str) -> str:
    """``--controlnet`` as given, where ``demo-position`` names the shipped demo ControlNet (unless a file or folder
    of that name exists)."""
    from ..control import DEMO_CONTROLNETS, SHIPPED

    if path in DEMO_CONTROLNETS and not Path(path).exists():
        folder = SHIPPED / path
        if not folder.joinpath("config.json").is_file():
            raise SDLiteError(f"--controlnet {path}: the demo ControlNet is not installed")
        return str(folder)
    return path


def control_units(args) -> tuple:
    """The :class:`~sdlite.control.ControlUnit` of each ``--controlnet``, the n-th value of every ``--control-*``
    flag going to the n-th (a value given once goes to all). Each value is checked here, so that a bad one is named
    by its flag before the model load; files must exist."""
    from ..control import CONTROL_MODES, HR_OPTIONS, RESIZE_MODES, ControlError, ControlUnit
    from .. import sources
    from ..control import preprocess
    from ..control.units import MAX_WEIGHT
    from ..pipeline import RequestError

    n = len(args.controlnet)
    if n == 0:
        stray = [flag for dest, flag, _ in _CONTROL_FLAGS if getattr(args, dest)]
        stray += ["--control-pixel-perfect"] if args.control_pixel_perfect else []
        if stray:
            raise RequestError(f"{', '.join(stray)} need{'s' if len(stray) == 1 else ''} a ControlNet: add "
                               "--controlnet PATH")
        return ()
    per_unit: list[dict] = [{} for _ in range(n)]
    for dest, flag, field in _CONTROL_FLAGS:
        values = getattr(args, dest)
        if len(values) not in (0, 1, n):
            raise RequestError(f"{flag} is given {len(values)} times for {n} --controlnet: give it once (for every "
                               f"ControlNet) or once per --controlnet, in the same order")
        for i in range(n if values else 0):
            per_unit[i][field] = values[i if len(values) == n else 0]

    def choice(value, table: dict, flag: str) -> str:
        v = str(value).strip().lower()
        for ours, theirs in table.items():
            if v in (ours, theirs.lower()):
                return ours
        raise RequestError(f"{flag} {value!r} is not valid: expected one of {', '.join(table)}")

    units, checked_images = [], set()
    for path, fields in zip(args.controlnet, per_unit):
        path = resolve_controlnet(path)
        if not Path(path).exists():
            raise RequestError(f"--controlnet {path}: no such file or folder")
        image = fields.get("image")
        if image is None and args.init_image is None:
            raise RequestError(f"--controlnet {path} needs a control image: add --control-image PATH (or "
                               "--init-image, which a ControlNet without one uses)")
        if image is not None and image not in checked_images:
            try:   # read once before the model load (the engine reads it again)
                sources.load_image(image, "--control-image")
            except sources.ImageInputError as e:
                raise RequestError(str(e)) from None
            checked_images.add(image)
        weight = fields.get("weight", 1.0)
        if not 0.0 <= weight <= MAX_WEIGHT:   # also NaN
            raise RequestError(f"--control-weight {weight:g} is not valid: expected 0 to {MAX_WEIGHT:g}")
        start, end = fields.get("guidance_start", 0.0), fields.get("guidance_end", 1.0)
        for value, flag in ((start, "--control-start"), (end, "--control-end")):
            if not 0.0 <= value <= 1.0:
                raise RequestError(f"{flag} {value:g} is not valid: expected a fraction of the steps, 0 to 1")
        if start > end:
            raise RequestError(f"--control-start {start:g} is after --control-end {end:g}")
        res = fields.get("processor_res", 512)
        if not 64 <= res <= 4096:
            raise RequestError(f"--control-processor-res {res} is not valid: expected 64 to 4096 pixels")
        for field, flag in (("threshold_a", "--control-threshold-a"), ("threshold_b", "--control-threshold-b")):
            if field in fields and fields[field] != fields[field]:   # NaN
                raise RequestError(f"{flag} {fields[field]} is not a number")
        name = fields.get("preprocessor", "none")
        try:
            name = preprocess.find(name).name
        except ControlError as e:
            raise RequestError(f"--control-preprocessor: {e}") from None
        unit = ControlUnit(path, image, weight=weight, guidance_start=start, guidance_end=end, preprocessor=name,
                           mode=choice(fields.get("mode", "balanced"), CONTROL_MODES, "--control-mode"),
                           resize_mode=choice(fields.get("resize_mode", "crop-and-resize"), RESIZE_MODES,
                                              "--control-resize"),
                           hr_option=choice(fields.get("hr_option", "both"), HR_OPTIONS, "--control-hr-option"),
                           pixel_perfect=args.control_pixel_perfect, processor_res=res,
                           threshold_a=fields.get("threshold_a"), threshold_b=fields.get("threshold_b"))
        units.append(unit)
    return tuple(units)


def add_controlnet_arguments(g) -> None:
    """The "ControlNet" argument group of ``sdlite generate``."""
    c = g.add_argument_group("ControlNet (A1111's ControlNet extension; defaults: its own)",
                             "The n-th of each --control-* flag goes with the n-th --controlnet; a flag given once "
                             "applies to every --controlnet.")
    c.add_argument("--controlnet", metavar="PATH", action="append", default=[],
                   help="a ControlNet: lllyasviel's .pth/.safetensors, a bare or diffusers-keyed file, or a diffusers "
                        "folder; demo-position: the shipped demo model's; repeatable (their residuals are summed)")
    c.add_argument("--control-image", metavar="PATH", action="append", default=[],
                   help="the control image (default: the --init-image)")
    c.add_argument("--control-weight", metavar="W", type=float, action="append", default=[],
                   help="the ControlNet's weight, 0 to 10 (default 1)")
    c.add_argument("--control-start", metavar="F", type=float, action="append", default=[],
                   help="the fraction of the steps where the control begins (default 0)")
    c.add_argument("--control-end", metavar="F", type=float, action="append", default=[],
                   help="the fraction of the steps where it ends (default 1)")
    c.add_argument("--control-preprocessor", metavar="NAME", action="append", default=[],
                   help="run on the control image first: none (default: the image is the control map), canny, "
                        "invert, threshold, scribble_xdog, tile_resample, blur_gaussian, inpaint")
    c.add_argument("--control-mode", metavar="MODE", action="append", default=[],
                   help="balanced (default); prompt: \"My prompt is more important\"; control: \"ControlNet is more "
                        "important\"")
    c.add_argument("--control-resize", metavar="MODE", action="append", default=[],
                   help="fitting the control image to the output: just-resize, crop-and-resize (default), "
                        "resize-and-fill")
    c.add_argument("--control-threshold-a", metavar="X", type=float, action="append", default=[],
                   help="the preprocessor's first parameter (canny: low threshold, 100; default: the preprocessor's)")
    c.add_argument("--control-threshold-b", metavar="X", type=float, action="append", default=[],
                   help="its second parameter (canny: high threshold, 200)")
    c.add_argument("--control-processor-res", metavar="PX", type=int, action="append", default=[],
                   help="the short side the preprocessor works at (default 512)")
    c.add_argument("--control-pixel-perfect", action="store_true",
                   help="every preprocessor works at the output's resolution instead of --control-processor-res")
    c.add_argument("--control-hr-option", metavar="WHICH", action="append", default=[],
                   help="with --hires: both (default), low-res-only or high-res-only passes are controlled")
