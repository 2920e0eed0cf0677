"""ControlNet units in a run: each unit's network loaded once for this model (and dropped when a request no longer
uses it), its image run through its preprocessor and fitted to the pass, and A1111's ``ControlNet N`` parameters.
The loop (:mod:`sdlite.pipeline.engine`) applies the ready units where its model denoises
(:class:`sdlite.control.apply.ControlledUNet`)."""
from __future__ import annotations

import os

import torch

from ..errors import RequestError
from ..sources import Source
from .request import Request


def controlnet(engine, path) -> tuple[torch.nn.Module, str]:
    """The ControlNet at ``path`` (a file or a diffusers folder) for this model, and its A1111 label ("name
    [hash]"): loaded in the UNet's compute precision and layout (Winograd, prepacked or channels-last where the
    UNet is: :meth:`~sdlite.engine.memory.ModelManager.adapt_like_unet`), or in memory mode 0 a
    network that streams its weights from the file block by block as the UNet does. Kept for the next request;
    the ones a request does not use are dropped (:meth:`prepare_controls`)."""
    from ..control.apply import legacy_hash
    from ..engine.memory import streamed_model
    from ..weights.controlnet import ControlNetError, check_compatible, open_controlnet

    key = os.path.realpath(path)
    cache = engine.__dict__.setdefault("_controlnets", {})
    if key not in cache:
        try:
            cfile = open_controlnet(path, engine.spec.unet)
            try:
                check_compatible(cfile.config, engine.spec.unet, cfile.name, engine.spec.family)
                dtype = engine.models.dtype_of("unet")
                if engine.models.mode == 0:
                    net = streamed_model(cfile, "controlnet", dtype, engine.device)
                else:
                    net = engine.models.adapt_like_unet(cfile.load(dtype, engine.device))
                    cfile.close()
            except BaseException:
                cfile.close()
                raise
        except ControlNetError as e:
            raise RequestError(f"ControlNet: {e}") from None
        cache[key] = (net, f"{cfile.name} [{legacy_hash(path)}]", cfile)
    net, label, _ = cache[key]
    return net, label


def drop_controlnets(engine, keep_paths) -> None:
    cache = engine.__dict__.get("_controlnets", {})
    wanted = {os.path.realpath(p) for p in keep_paths}
    for key in [k for k in cache if k not in wanted]:
        cache.pop(key)[2].close()


def prepare_controls(engine, r: Request, width: int, height: int, hires_pass: int | None = None,
                     source: "Source | None" = None) -> list:
    """The request's ControlNet units that apply to this pass (``hires_pass``: 1 or 2 in a hires fix), ready for
    a ``width`` x ``height`` run: each unit's image (the init image where it has none) run through its
    preprocessor and fitted by its resize mode, and its network. Inpainting only the masked area (``source``
    with a paste box), the extension's rule: the image fitted to the source canvas by the unit's resize mode,
    cropped to the same region as the source, then fitted to the run's size as "resize and fill"."""
    from .. import sources
    from ..control import ControlError, preprocess
    from ..control.apply import ActiveControl, fit_control, hint_tensor

    drop_controlnets(engine, [u.model for u in r.controls])
    out = []
    for i, u in enumerate(r.controls):
        if not u.applies_to(hires_pass):
            continue
        image = u.image if u.image is not None else r.init_image
        if image is None:
            raise RequestError(f"ControlNet unit {i}: no control image (give one, or an init image for the unit "
                               "to use)")
        mask = None
        box = source.paste_box if source is not None else None
        resize_mode = "resize-and-fill" if box is not None else u.resize_mode

        def crop(im):   # inpainting the masked area only: the source's region of the canvas
            if box is None:
                return im
            return fit_control(im, *source.overlay_source.size, u.resize_mode).crop(box)
        try:
            image = crop(sources.load_image(image, f"ControlNet unit {i}'s image"))
            p = preprocess.find(u.preprocessor)
            if p.name == "inpaint":
                where = u.mask if u.mask is not None else r.mask
                if where is None:
                    raise RequestError(f"ControlNet unit {i}: the inpaint preprocessor needs a mask (the unit's "
                                       "or the request's)")
                mask = fit_control(crop(sources.load_mask(where, f"ControlNet unit {i}'s mask")), width, height,
                                   resize_mode)
            elif p.name != "none":
                res = (preprocess.pixel_perfect_resolution(image.size, width, height, resize_mode)
                       if u.pixel_perfect else u.processor_res)
                image = preprocess.run(p.name, image, res, u.threshold_a, u.threshold_b)
        except (ControlError, sources.ImageInputError) as e:
            raise RequestError(str(e)) from None
        net, label = controlnet(engine, u.model)
        fitted = fit_control(image, width, height, resize_mode)
        out.append(ActiveControl(u, net, hint_tensor(fitted, mask), label, map=(i, fitted, mask)))
    return out


def controls_infotext(engine, r: Request) -> dict:
    """A1111's ``ControlNet N`` parameters of the request's units."""
    from ..control.units import infotext

    return {f"ControlNet {i}": infotext(u, controlnet(engine, u.model)[1]) for i, u in enumerate(r.controls)}
