"""``sdlite generate``'s image-to-image, inpainting and outpainting options: their argument group, and the checks of
the source image, the mask and the options that need them, made before the model load."""
from __future__ import annotations

import os


# options that mean nothing without a source image, and those that mean nothing without a mask (argparse dest, flag)
_SOURCE_OPTIONS = (("strength", "--strength"), ("resize_mode", "--resize-mode"))
_MASK_OPTIONS = (("mask_blur", "--mask-blur"), ("inpaint_fill", "--inpaint-fill"), ("inpaint_area", "--inpaint-area"),
                 ("inpaint_padding", "--inpaint-padding"), ("no_overlay", "--no-overlay"))


def parse_outpaint(text: str | None) -> tuple[int, int, int, int] | None:
    """``--outpaint "L,T,R,B"``: four whole numbers of pixels; whether they are multiples of 8 is
    :func:`~sdlite.pipeline.validate`'s to check."""
    from ..pipeline import RequestError

    if text is None:
        return None
    parts = text.split(",")
    try:
        if len(parts) == 4:
            left, top, right, bottom = (int(part) for part in parts)
            return left, top, right, bottom
    except ValueError:
        pass
    raise RequestError(f"outpaint {text!r} is not valid: expected four whole numbers of pixels LEFT,TOP,RIGHT,BOTTOM, "
                       "multiples of 8 (e.g. 64,0,64,0)")


def check_stray_options(args) -> None:
    """Image-to-image options given where they would be ignored: without a source image, or without a mask."""
    from ..pipeline import RequestError

    def given(options) -> str:
        flags = [flag for dest, flag in options if getattr(args, dest) not in (None, False)]
        return f"{', '.join(flags)} need{'s' if len(flags) == 1 else ''}" if flags else ""

    if args.init_image is None:
        stray = given(_SOURCE_OPTIONS + _MASK_OPTIONS + (("invert_mask", "--invert-mask"),))
        if stray:
            raise RequestError(f"{stray} a source image: add --init-image PATH")
        return
    if args.invert_mask and args.mask is None and not args.mask_from_alpha:
        raise RequestError("--invert-mask needs a mask to invert: add --mask PATH or --mask-from-alpha")
    stray = given(_MASK_OPTIONS)
    if stray and args.mask is None and not args.mask_from_alpha and args.outpaint is None:
        raise RequestError(f"{stray} a mask: add --mask PATH, --mask-from-alpha or --outpaint L,T,R,B")


def check_sources(request) -> None:
    """Read the source image and mask once before the model load, so that a missing, unreadable or oversized file,
    or a mask that leaves nothing to repaint, fails fast with the file named (the engine reads them again)."""
    from .. import sources
    from ..pipeline import RequestError

    references = [(ref, f"reference image {i + 1}") for i, ref in enumerate(request.reference_images)]
    for path, what in ((request.init_image, "init image"), (request.mask, "mask"), *references):
        if path is None:
            continue
        if not os.path.exists(path):
            raise RequestError(f"{what} {path}: no such file")
        if os.path.isdir(path):
            raise RequestError(f"{what} {path}: is a directory, not an image file")
        if not os.path.isfile(path):
            raise RequestError(f"{what} {path}: is not a regular file (a device, pipe or socket?)")
    try:
        for ref, what in references:
            sources.load_image(ref, what)
        if request.init_image is None:
            return
        image = sources.load_image(request.init_image, "init image")
        if request.mask_from_alpha:
            mask = sources.load_mask(image, f"init image {request.init_image}", from_alpha=True)
        elif request.mask is not None:
            mask = sources.load_mask(request.mask, "mask")
        else:
            return
    except sources.ImageInputError as e:
        raise RequestError(str(e)) from None
    repainted = sources.invert_mask(mask) if request.invert_mask else mask
    if request.outpaint is not None or repainted.getbbox() is not None:  # outpainting repaints the new border
        return
    if request.mask_from_alpha:
        which, where = ("opaque", "at least half") if request.invert_mask else ("transparent", "below half")
        raise RequestError(f"init image {request.init_image} has no {which} pixels to repaint (--mask-from-alpha"
                           f"{' --invert-mask' if request.invert_mask else ''} repaints where its alpha is {where})")
    if request.invert_mask:
        raise RequestError(f"mask {request.mask} is all white: inverted (--invert-mask), it leaves nothing to repaint")
    raise RequestError(f"mask {request.mask} is all black: nothing to repaint (white marks the area to repaint)")


def add_reference_argument(g, help: str) -> None:
    """``--ref-image PATH`` (repeatable): the reference images of FLUX.2 [klein] and FLUX.1 dev / Kontext,
    ``generate``'s and ``edit``'s; ``--no-ref-resize``: FLUX.1 Kontext's references keep their own size."""
    g.add_argument("--ref-image", metavar="PATH", action="append", default=[], help=help)
    g.add_argument("--no-ref-resize", action="store_true",
                   help="FLUX.1 Kontext: keep each reference image's own size (rounded down to multiples of 16) "
                        "instead of resizing it to the nearest of the resolutions Kontext was trained at")


def add_img2img_arguments(g) -> None:
    """The "image to image, inpainting, outpainting" argument group of ``sdlite generate``."""
    i = g.add_argument_group("image to image, inpainting, outpainting (defaults: A1111's)")
    i.add_argument("--init-image", metavar="PATH", default=None,
                   help="source image: image to image, or inpainting with a mask")
    add_reference_argument(i, "a reference image the model edits from or draws after (FLUX.2 klein, FLUX.1 dev / "
                              "Kontext; repeatable, in "
                              "order: image 1, image 2, ...); without --width/--height the output takes the first "
                              "one's size")
    i.add_argument("--strength", metavar="S", type=float, default=None,
                   help="how much of the source is repainted, above 0 up to 1 (runs int(steps x S) of the steps; "
                        "default 0.75)")
    i.add_argument("--mask", metavar="PATH", default=None,
                   help="inpainting mask: white = repaint, black = keep (a mask with transparency: opaque = repaint)")
    i.add_argument("--mask-from-alpha", action="store_true",
                   help="the init image's transparent pixels are the mask (repainted)")
    i.add_argument("--invert-mask", action="store_true", help="repaint what the mask leaves black instead")
    i.add_argument("--mask-blur", metavar="PX", type=int, default=None,
                   help="Gaussian blur of the mask's edge: its standard deviation in pixels (default 4)")
    i.add_argument("--inpaint-fill", metavar="FILL", default=None,
                   help="what the masked area starts from: original, fill (colours from around it), latent-noise, "
                        "latent-nothing (default: original; fill when outpainting)")
    i.add_argument("--inpaint-area", metavar="AREA", default=None,
                   help="whole: generate the whole picture; masked: only a crop around the mask, at the full size, "
                        "pasted back (default whole)")
    i.add_argument("--inpaint-padding", metavar="PX", type=int, default=None,
                   help="pixels kept around the mask's box with --inpaint-area masked (default 32)")
    i.add_argument("--no-overlay", action="store_true",
                   help="keep the generated pixels outside the mask too (default: the source is pasted back there)")
    i.add_argument("--outpaint", metavar="L,T,R,B", default=None,
                   help="extend the canvas by these many pixels left, top, right, bottom (multiples of 8, e.g. "
                        "64,0,64,0) and paint the new border")
    i.add_argument("--resize-mode", metavar="MODE", default=None,
                   help="fitting a source to another --width/--height: just-resize (stretch), crop (cover, crop the "
                        "overflow), fill (fit, fill the bands with the edge pixels) (default just-resize)")
