"""Editing from reference images on the A1111 plan's road: a FLUX.2 [klein] model (a family whose
``edits_from_images`` is true) takes an img2img request's init images as its reference images, in the way of the
front-end that built the plan (:attr:`~.api.Plan.reference_mode`):

* ``"a1111"`` (``/sdapi/v1/img2img``, Forge's way with editing models): ``init_images[0]`` stays the init image (image
  to image at ``denoising_strength``; at 1.0 editing from noise) and is the first reference; ``init_images[1:]``
  follow it as references.
* ``"edit"`` (OpenAI's ``/v1/images/edits`` without a mask): every image a reference, the output drawn from noise (at
  the first image's size where none is asked). A model without reference editing edits one image (image to image);
  several are refused.
* ``"required"`` (MCP's ``edit_image``; ``/sdapi/v1/img2img`` with sdlite's ``sdlite_edit``, the web page's Edit
  tab): as ``"edit"``; a model without reference editing refuses the call.

A request with a mask stays inpainting (klein's inpainting already conditions on the source). The family is known
only when the job runs on its engine, so the backend applies this there (:func:`~sdlite.server.backend.run_plan`).
"""
from __future__ import annotations

from ...pipeline import Request, RequestError
from .api import Plan


def with_references(plan: Plan, requests: list[Request], edits_from_images: bool) -> list[Request]:
    """The plan's requests with its init images as reference images where the model edits from them
    (``edits_from_images``: FLUX.2 [klein], FLUX.1 Kontext, Qwen-Image-Edit) and no mask marks an area to repaint.
    ``plan.reference_mode`` "a1111": ``init_images[0]`` stays the init image (image to image at the denoising
    strength; 1.0: editing from noise) and is the first reference, the others follow (Forge's way with editing models); "edit" and "required": the images are
    references only and the output starts from noise (OpenAI's and MCP's instruction editing). A model without
    reference editing keeps image to image on the first image; "required" refuses it, and so does "edit" given several
    images. Raises :class:`RequestError`."""
    refs = plan.references
    if not refs or not requests or requests[0].mask is not None:
        return requests
    if not edits_from_images:
        if plan.reference_mode == "required":
            raise RequestError("editing from reference images (an instruction edit) needs a model that edits from "
                               "them (FLUX.2 [klein], FLUX.1 Kontext, Qwen-Image-Edit); this model does not: switch to one, or redraw "
                               "the image with image to image")
        if plan.reference_mode == "edit" and len(refs) > 1:
            raise RequestError(f"init_images: {len(refs)} images were sent; this model edits one image at a time "
                               "(several are reference images for a model that edits from them: FLUX.2 [klein], FLUX.1 Kontext, "
                               "Qwen-Image-Edit)")
        return requests
    plan.warnings[:] = [w for w in plan.warnings if not w.startswith("init_images:")]
    if plan.reference_mode == "a1111":
        return [r.replace(reference_images=tuple(refs)) for r in requests]
    return [r.replace(reference_images=tuple(refs), init_image=None, strength=1.0) for r in requests]


__all__ = ["with_references"]
