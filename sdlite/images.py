"""Writing images with their generation parameters, in the format the AUTOMATIC1111 web UI writes and reads.

PNGs carry a ``parameters`` text chunk; JPEGs the same text as the EXIF UserComment. The text is:

    a red circle on a blue background
    Negative prompt: blurry
    Steps: 20, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7.5, Seed: 42, Size: 512x512, Model hash: ...

Image to image adds A1111's ``Denoising strength`` (and ``Resize mode`` when not "Just resize"); inpainting its
``Mask blur``, ``Masked content``, and when they differ from the defaults ``Mask mode``, ``Inpaint area`` with
``Masked area padding``; two fields are ours: ``Outpaint`` (the borders, "L,T,R,B") and ``Overlay: off``.
Explicit noise levels add ``Timesteps`` ("999,749,499,249") or ``Sigmas``, ours too, only when given.

Files are created exclusively: an existing file is never overwritten, the next free numbered name is used.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Callable

from PIL import Image, PngImagePlugin

from . import __version__
from .errors import SDLiteError
from .sampling.samplers import A1111_NAMES, resolve_sampler

FORMATS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG"}
_A1111_BY_SAMPLER = {v: k for k, v in A1111_NAMES.items()}
_SCHEDULE_NAMES = {"karras": "Karras", "exponential": "Exponential", "discrete": "Normal"}
_RESIZE_NAMES = {"just-resize": "Just resize", "crop": "Crop and resize", "fill": "Resize and fill"}
_FILL_NAMES = {"original": "original", "fill": "fill", "latent-noise": "latent noise",
               "latent-nothing": "latent nothing"}
_AREA_NAMES = {"whole": "Whole picture", "masked": "Only masked"}
_MASK_MODES = {False: "Inpaint masked", True: "Inpaint not masked"}
_OVERLAY_NAMES = {True: "on", False: "off"}
_USER_COMMENT, _EXIF_IFD = 0x9286, 0x8769


def sampler_label(sampler: str) -> str:
    """A1111's name of one of our samplers ("dpmpp_2m" -> "DPM++ 2M")."""
    return _A1111_BY_SAMPLER.get(sampler, sampler)


def schedule_label(schedule: str) -> str:
    """A1111's "Schedule type" of one of our schedules ("karras" -> "Karras")."""
    return _SCHEDULE_NAMES.get(schedule, schedule)


class OutputError(SDLiteError):
    """The output location cannot be written; the message names it."""


def quote_value(value) -> str:
    """A1111's quoting: values holding a comma, colon or quote are written as JSON strings."""
    text = str(value)
    if "," not in text and "\n" not in text and ":" not in text and '"' not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def infotext(request, seed: int, model_hash: str | None = None, model_name: str | None = None,
             extra: dict | None = None) -> str:
    """The A1111 ``parameters`` text for one image of a resolved request (:func:`sdlite.pipeline.validate`, sizes
    and inpainting fill resolved: ``Result.request``). ``extra``: more fields (``Result.infotext``: "Lora hashes",
    "TI hashes"), written before the version as A1111 writes them."""
    img2img, inpaint = request.is_img2img, request.is_inpaint
    masked_area = inpaint and request.inpaint_area == "masked"
    fields = {
        "Steps": request.steps,
        "Sampler": _A1111_BY_SAMPLER.get(request.sampler, request.sampler),
        "Schedule type": _SCHEDULE_NAMES.get(request.schedule, request.schedule),
        "CFG scale": f"{request.cfg_scale:g}",
        "Distilled CFG Scale": None if getattr(request, "guidance", None) is None else f"{request.guidance:g}",
        "Seed": seed,
        "Size": f"{request.width}x{request.height}",
        "Model hash": model_hash,
        "Model": model_name,
        "Denoising strength": float(request.strength) if img2img else None,  # str(): the shortest exact form
        "Clip skip": request.clip_skip if request.clip_skip > 1 else None,
        "Eta": request.eta,
        "Timestep spacing": getattr(request, "timestep_spacing", None),  # only when the request overrides it
        "Timesteps": _numbers(getattr(request, "timesteps", None)),   # explicit lists, only when given
        "Sigmas": _numbers(getattr(request, "sigmas", None)),
        "Resize mode": _RESIZE_NAMES[request.resize_mode] if img2img and request.resize_mode != "just-resize"
        else None,
        "Mask blur": request.mask_blur if inpaint else None,
        "Mask mode": _MASK_MODES[True] if inpaint and request.invert_mask else None,
        "Masked content": _FILL_NAMES.get(request.inpaint_fill) if inpaint else None,
        "Inpaint area": _AREA_NAMES["masked"] if masked_area else None,
        "Masked area padding": request.inpaint_padding if masked_area else None,
        "Outpaint": ",".join(str(v) for v in request.outpaint) if img2img and request.outpaint else None,
        "Overlay": _OVERLAY_NAMES[False] if inpaint and not request.overlay else None,
        **(extra or {}),
        "Version": f"sdlite {__version__}",
    }
    line = ", ".join(f"{k}: {quote_value(v)}" for k, v in fields.items() if v is not None)
    lines = [request.prompt]
    if request.negative_prompt:
        lines.append(f"Negative prompt: {request.negative_prompt}")
    lines.append(line)
    return "\n".join(lines)


def _numbers(values) -> str | None:
    return None if values is None else ",".join(str(v) for v in values)   # str: the shortest exact form


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


_FIELD = re.compile(r'\s*(\w[\w \-/]*):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def _reverse(names: dict) -> Callable[[str], object]:
    return {text: value for value, text in names.items()}.__getitem__


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


# infotext field -> (Request field, reader); a reader raises KeyError or ValueError on a value it does not know
_IMAGE_FIELDS: dict[str, tuple[str, Callable[[str], object]]] = {
    "Denoising strength": ("strength", float),
    "Resize mode": ("resize_mode", _reverse(_RESIZE_NAMES)),
    "Mask blur": ("mask_blur", int),
    "Mask mode": ("invert_mask", _reverse(_MASK_MODES)),
    "Masked content": ("inpaint_fill", _reverse(_FILL_NAMES)),
    "Inpaint area": ("inpaint_area", _reverse(_AREA_NAMES)),
    "Masked area padding": ("inpaint_padding", int),
    "Outpaint": ("outpaint", _int_list),
    "Timesteps": ("timesteps", _int_list),
    "Sigmas": ("sigmas", _floats),
    "Overlay": ("overlay", _reverse(_OVERLAY_NAMES)),
}


def parse_infotext(text: str) -> dict:
    """Read an A1111 ``parameters`` text back: prompt, negative prompt and every ``Key: value`` field,
    with the sampler mapped back to our name and schedule (keys ``sampler`` and ``schedule``) and each
    image-to-image field and explicit noise-level list present also under its :class:`~sdlite.pipeline.Request`
    name and in its type (``strength``, ``resize_mode``, ``mask_blur``, ``invert_mask``, ``inpaint_fill``,
    ``inpaint_area``, ``inpaint_padding``, ``outpaint``, ``overlay``, ``timesteps``, ``sigmas``); a field left out means the Request's default. A value this
    module does not write (another tool's) stays under its own key only."""
    lines = text.strip().split("\n")
    last = lines[-1] if lines and len(_FIELD.findall(lines[-1])) >= 3 else None
    body = lines[:-1] if last is not None else lines
    prompt, negative, in_negative = [], [], False
    for line in body:
        if line.startswith("Negative prompt:"):
            in_negative = True
            line = line[len("Negative prompt:"):].strip()
        (negative if in_negative else prompt).append(line)
    out = {"prompt": "\n".join(prompt), "negative_prompt": "\n".join(negative)}
    for key, value in _FIELD.findall(last or ""):
        value = value.strip()
        if value.startswith('"') and value.endswith('"'):
            value = json.loads(value)
        out[key] = value
    if "Sampler" in out:
        name = out["Sampler"]
        schedule = out.get("Schedule type")
        if schedule and schedule not in ("Automatic", "Normal"):
            name = f"{name} {schedule}"
        out["sampler"], out["schedule"] = resolve_sampler(name)
    for key, (name, read) in _IMAGE_FIELDS.items():
        if key in out:
            try:
                out[name] = read(out[key])
            except (KeyError, ValueError):
                pass  # another tool's value: kept under its own key only
    return out


def model_hash(path: str | os.PathLike) -> str:
    """A1111's "AutoV2" model hash: the first 10 hex digits of the SHA-256 of the weights file (for a diffusers
    folder, of its UNet weights). Cached by path, size and modification time in the user's cache folder."""
    path = Path(path)
    if path.is_dir():
        unet = sorted((path / "unet").glob("diffusion_pytorch_model*.safetensors")) or \
            sorted((path / "unet").glob("*.bin"))
        if not unet:
            return "unknown"
        path = unet[0]
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    cache_file = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sdlite" / "hashes.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    value = h.hexdigest()[:10]
    cache[key] = value
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)
    except OSError:
        pass  # a read-only home only costs the hash being computed again
    return value


def _names_folder(output: str | os.PathLike) -> bool:
    """An existing folder, or a path written with a trailing slash (``Path`` would drop it)."""
    return Path(output).is_dir() or os.fspath(output).endswith(("/", os.sep))


def output_paths(output: str | os.PathLike, count: int, fmt: str, seeds: list[int]) -> list[Path]:
    """Where ``count`` images go. A directory (existing, or given with a trailing slash) gets
    ``NNNNN-SEED.ext`` names numbered after the highest already there; a file name is used as is for one image
    and numbered ``name-1.ext``, ``name-2.ext`` ... for several. Names already taken are skipped."""
    ext = "jpg" if FORMATS[fmt] == "JPEG" else "png"
    as_folder = _names_folder(output)
    output = Path(output)
    if as_folder:
        used = [int(m.group(1)) for p in (output.iterdir() if output.is_dir() else [])
                if (m := re.match(r"(\d{5})-", p.name))]
        start = max(used, default=-1) + 1
        return [output / f"{start + i:05d}-{seed}.{ext}" for i, seed in enumerate(seeds)]
    stem, suffix = (output.stem, output.suffix) if output.suffix else (output.name, f".{ext}")
    names = [output.with_name(f"{stem}{suffix}")] if count == 1 else \
        [output.with_name(f"{stem}-{i + 1}{suffix}") for i in range(count)]
    out, n = [], 1
    for name in names:
        candidate = name
        while candidate.exists() or candidate in out:
            candidate = name.with_name(f"{name.stem}-{n}{name.suffix}")
            n += 1
        out.append(candidate)
    return out


def check_writable(output: str | os.PathLike) -> None:
    """Fail early, before any work, when the output location cannot be written."""
    folder = Path(output) if _names_folder(output) else Path(output).parent
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"output folder {str(folder)!r} cannot be created: {str(probe)!r} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"output folder {str(probe)!r} is not writable")


def save_image(image: Image.Image, path: Path, parameters: str, fmt: str = "png", quality: int = 95) -> Path:
    """Write one image with its ``parameters`` text; never replaces an existing file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = FORMATS[fmt]
    try:
        with open(path, "xb") as f:
            try:
                if kind == "PNG":
                    info = PngImagePlugin.PngInfo()
                    info.add_text("parameters", parameters)
                    image.save(f, format="PNG", pnginfo=info)
                else:
                    exif = Image.Exif()
                    exif.get_ifd(_EXIF_IFD)[_USER_COMMENT] = b"UNICODE\0" + parameters.encode("utf-16-be")
                    image.convert("RGB").save(f, format="JPEG", quality=quality, exif=exif.tobytes())
            except BaseException:
                f.close()
                path.unlink(missing_ok=True)
                raise
    except FileExistsError:
        raise OutputError(f"{str(path)!r} appeared while writing; not overwriting it") from None
    except OSError as e:
        raise OutputError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    return path


def png_bytes(image: Image.Image, parameters: str | None = None) -> bytes:
    """One image as PNG file bytes, with its ``parameters`` text chunk when given (what :func:`save_image` writes,
    in memory: a server's response)."""
    info = None
    if parameters is not None:
        info = PngImagePlugin.PngInfo()
        info.add_text("parameters", parameters)
    out = io.BytesIO()
    image.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def parameters_of(image: Image.Image) -> str | None:
    """The ``parameters`` text of an opened image: its PNG text chunk, or its EXIF UserComment (JPEG, WebP)."""
    if isinstance(image.info.get("parameters"), str):
        return image.info["parameters"]
    try:
        raw = image.getexif().get_ifd(_EXIF_IFD).get(_USER_COMMENT)
    except Exception:  # noqa: BLE001 - Pillow raises assorted errors on malformed EXIF data: no parameters then
        return None
    if isinstance(raw, bytes) and raw.startswith(b"UNICODE\0"):
        return raw[8:].decode("utf-16-be")
    return raw


def read_parameters(path: str | os.PathLike) -> str | None:
    """The ``parameters`` text of a PNG (text chunk) or JPEG (EXIF UserComment) written by sdlite or A1111."""
    with Image.open(path) as im:
        return parameters_of(im)
