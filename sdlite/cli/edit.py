"""``sdlite edit IMAGE "instruction"``: instruction editing, the shared interface of the models that edit from reference
images (FLUX.2 [klein], FLUX.1 Kontext and dev, Qwen-Image-Edit). It is ``sdlite generate`` with ``IMAGE`` as reference
image 1 (then any ``--ref-image``: image 2, 3, ...) and no init image: the drawing starts from noise, looking at the
images, and takes the first one's size unless ``--width`` / ``--height`` are given. With ``--mask`` it inpaints
instead: ``IMAGE`` is the init image (the source the editing model inpaints, as diffusers' edit-inpaint pipelines
take it), the ``--ref-image`` files the reference images, the strength 1 unless ``--strength`` is given (the masked
area drawn anew, as an edit without a mask draws from noise). The options are generate's shared ones
(:func:`~.generate.add_shared_arguments`); a model without reference images refuses them as the engine does (one line,
exit status 2)."""
from __future__ import annotations

from .generate import add_shared_arguments, cmd_generate, image_option_defaults
from .img2img import add_reference_argument

EDIT_INPAINT_STRENGTH = 1.0   # sdlite edit --mask without --strength: the masked area from pure noise


def cmd_edit(args) -> int:
    """``generate`` with the image in front of the reference images, or (``--mask``) as the init image."""
    if args.mask is not None:
        args.init_image = args.image
        if args.strength is None:
            args.strength = EDIT_INPAINT_STRENGTH
    else:
        if args.strength is not None:
            from ..pipeline import RequestError

            raise RequestError("--strength needs --mask: sdlite edit without a mask draws from noise, looking at "
                               "the image")
        args.ref_image = [args.image, *args.ref_image]
    return cmd_generate(args)


def add_parser(sub) -> None:
    e = sub.add_parser("edit", help="edit an image by an instruction (FLUX.2 klein, FLUX.1 Kontext, Qwen-Image-Edit: "
                                    "reference images; with --mask, inpainting)")
    e.add_argument("image", help="the image to edit: reference image 1 (the output takes its size unless "
                                 "--width/--height are given); with --mask, the source inpainted")
    e.add_argument("prompt", help='the instruction, e.g. "make the sky purple"')
    add_shared_arguments(e)
    add_reference_argument(e.add_argument_group("more images"),
                           "another image the instruction may name (repeatable, in order: image 2, image 3, ...)")
    m = e.add_argument_group("inpainting")
    m.add_argument("--mask", metavar="PATH", default=None,
                   help="repaint only where this mask is white (IMAGE becomes the init image: inpainting, as "
                        "--init-image IMAGE --mask PATH with generate)")
    m.add_argument("--strength", metavar="S", type=float, default=None,
                   help="with --mask: how much of the masked area is repainted, above 0 up to 1 (default 1)")
    # generate's other options edit does not offer (init image, mask options, refiner, hires fix, ControlNets): off
    defaults = {k: v for k, v in image_option_defaults().items() if k not in ("mask", "strength")}
    e.set_defaults(func=cmd_edit, **defaults)
