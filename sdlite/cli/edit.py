"""``sdlite edit IMAGE "instruction"``: instruction editing, the shared interface of the models that edit from reference
images (FLUX.2 [klein], FLUX.1 Kontext and dev). It is ``sdlite generate`` with ``IMAGE`` as reference image 1 (then any
``--ref-image``: image 2, 3, ...) and no init image: the drawing starts from noise, looking at the images, and takes the
first one's size unless ``--width`` / ``--height`` are given. The options are generate's shared ones
(:func:`~.generate.add_shared_arguments`); a model without reference images refuses them as the engine does (one line,
exit status 2)."""
from __future__ import annotations

from .generate import add_shared_arguments, cmd_generate, image_option_defaults
from .img2img import add_reference_argument


def cmd_edit(args) -> int:
    """``generate`` with the image in front of the reference images."""
    args.ref_image = [args.image, *args.ref_image]
    return cmd_generate(args)


def add_parser(sub) -> None:
    e = sub.add_parser("edit", help="edit an image by an instruction (FLUX.2 klein, FLUX.1 Kontext: "
                                               "reference images)")
    e.add_argument("image", help="the image to edit: reference image 1 (the output takes its size unless "
                                 "--width/--height are given)")
    e.add_argument("prompt", help='the instruction, e.g. "make the sky purple"')
    add_shared_arguments(e)
    add_reference_argument(e.add_argument_group("more images"),
                           "another image the instruction may name (repeatable, in order: image 2, image 3, ...)")
    # generate's options edit does not offer (init image, mask, refiner, hires fix, ControlNets): off
    e.set_defaults(func=cmd_edit, **image_option_defaults())
