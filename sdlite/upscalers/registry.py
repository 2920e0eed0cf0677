"""Image upscalers by name, as A1111 names and lists them: "None", "Lanczos", "Nearest", the upscaler network files of
an upscaler folder (by file stem: ``4x-UltraSharp.pth`` is "4x-UltraSharp"), SD x4 upscaler folders there (by
folder name) and the shipped demo upscaler ("demo-4x").

:func:`upscale_to` follows A1111's rule (``images.resize_image`` with "Just resize", ``Upscaler.upscale``): a network
is applied until the image reaches the target size (at most three times), then the result is resized to the exact
target by Lanczos; "Lanczos" and "Nearest" resize by the scale that reaches the target, then to the target; "None"
resizes to the target by Lanczos.
"""
from __future__ import annotations

import os
from pathlib import Path

from PIL import Image

from ..errors import SDLiteError

BUILTIN = ("None", "Lanczos", "Nearest")
NETWORK_SUFFIXES = (".pth", ".pt", ".safetensors")
MAX_PASSES = 3        # A1111 applies a network at most three times to reach a size
MAX_OUTPUT_PIXELS = 8192 * 8192


class UpscalerError(SDLiteError, ValueError):
    """An upscaler name or file that cannot be used; the message names it and what is available."""


def demo_upscaler() -> Path | None:
    """The shipped demo upscaler (a small 4x network trained on the demo model's shapes), when the package has it."""
    path = Path(__file__).resolve().parent.parent / "data" / "upscalers" / "demo-4x.safetensors"
    return path if path.is_file() else None


def _is_x4_folder(path: Path) -> bool:
    index = path / "model_index.json"
    if not index.is_file():
        return False
    try:
        return "Upscale" in index.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def available(folder: str | os.PathLike | None = None) -> dict[str, Path]:
    """Name -> file (or x4 upscaler folder) of every network upscaler: the demo's, then ``folder``'s (sorted)."""
    found: dict[str, Path] = {}
    demo = demo_upscaler()
    if demo is not None:
        found[demo.stem] = demo
    if folder is not None:
        root = Path(folder)
        if not root.is_dir():
            raise UpscalerError(f"upscaler folder {str(root)!r} does not exist or is not a folder")
        for path in sorted(root.iterdir(), key=lambda p: p.name.lower()):
            if path.is_file() and path.suffix.lower() in NETWORK_SUFFIXES:
                found[path.stem] = path
            elif path.is_dir() and _is_x4_folder(path):
                found[path.name] = path
    return found


def listing(folder: str | os.PathLike | None = None) -> list[dict]:
    """``/sdapi/v1/upscalers``: A1111's fields for the built-in upscalers and each network (scale: the network's,
    read from its weights; 4 for the built-ins, as A1111 reports them)."""
    out = [{"name": name, "model_name": None, "model_path": None, "model_url": None, "scale": 4}
           for name in BUILTIN]
    for name, path in available(folder).items():
        scale = 4
        if path.is_file():
            try:
                scale = _load(path).scale
            except SDLiteError:
                continue   # a file that is not an upscaler sdlite runs is not listed
        out.append({"name": name, "model_name": name, "model_path": str(path), "model_url": None, "scale": scale})
    return out


def resolve(name: str, folder: str | os.PathLike | None = None) -> str | Path:
    """A built-in name (returned as it is, in A1111's spelling) or the file / folder of a network upscaler: a
    path, or a name of :func:`available` (case-insensitive)."""
    if not isinstance(name, str) or not name.strip():
        raise UpscalerError(f"upscaler {name!r} is not valid: give a name ({', '.join(BUILTIN)}, a network's) or a "
                            "file")
    name = name.strip()
    for builtin in BUILTIN:
        if name.lower() == builtin.lower():
            return builtin
    found = available(folder)
    for known, path in found.items():
        if known.lower() == name.lower():
            return path
    path = Path(name)
    if path.suffix.lower() in NETWORK_SUFFIXES or os.sep in name or "/" in name:
        if path.is_file() or (path.is_dir() and _is_x4_folder(path)):
            return path
        raise UpscalerError(f"upscaler file {name!r} was not found")
    names = [*BUILTIN, *found]
    raise UpscalerError(f"upscaler {name!r} is not known; available: {', '.join(names)}"
                        + ("" if folder is not None else " (network upscalers: --upscaler-dir DIR or a file path)"))


_CACHE: dict[str, object] = {}


def _cached(path: Path, device, load):
    """``load(path, device=device)``, once per file or folder and device (the last two kept)."""
    key = f"{os.path.realpath(path)}@{device}"
    if key not in _CACHE:
        if len(_CACHE) >= 2:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = load(path, device=device)
    return _CACHE[key]


def _load(path: Path, device="cpu"):
    """A network upscaler, loaded once per file and device."""
    from .files import load_upscaler

    return _cached(path, device, load_upscaler)


def network_scale(name: str | Path, folder=None) -> int | None:
    """The scale of a network upscaler (None for a built-in)."""
    found = resolve(name, folder) if isinstance(name, str) else name
    if isinstance(found, str):
        return None
    return 4 if found.is_dir() else _load(found).scale


def upscale_to(image: Image.Image, name: str | Path, width: int, height: int, *, folder=None, device="cpu",
               upscale_fn=None) -> Image.Image:
    """``image`` brought to ``width`` x ``height`` by upscaler ``name`` (A1111's rule, module docstring).
    ``upscale_fn(image) -> image``: the network's one pass, when the caller has its own (the SD x4 upscaler's)."""
    if width * height > MAX_OUTPUT_PIXELS:
        raise UpscalerError(f"an upscale to {width}x{height} is larger than {MAX_OUTPUT_PIXELS} pixels")
    chosen = resolve(name, folder) if isinstance(name, str) else Path(name)
    if chosen == "None":
        return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.LANCZOS)
    if (image.width, image.height) == (width, height):
        return image
    scale = max(width / image.width, height / image.height)
    if chosen in ("Lanczos", "Nearest"):
        resample = Image.Resampling.LANCZOS if chosen == "Lanczos" else Image.Resampling.NEAREST
        image = image.resize((int(image.width * scale), int(image.height * scale)), resample)
    else:
        one_pass = upscale_fn or _network_pass(chosen, device)
        for _ in range(MAX_PASSES):
            if image.width >= width and image.height >= height:
                break
            image = one_pass(image)
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    return image


def _network_pass(path: Path, device):
    if path.is_dir():
        from .x4 import X4Upscaler   # the SD x4 upscaler, with an empty prompt, its defaults and seed 0

        model = _cached(path, device, X4Upscaler.load)
        return lambda image: model.upscale(image.convert("RGB"), seed=0).images[0]
    from .tiling import upscale

    net = _load(path, device)
    return lambda image: upscale(net, image)


def upscale_by(image: Image.Image, name: str | Path, scale: float, *, folder=None, device="cpu") -> Image.Image:
    """``image`` upscaled by ``scale`` (A1111's extras "Scale by"): the target is ``int(size x scale)``."""
    return upscale_to(image, name, int(image.width * scale), int(image.height * scale), folder=folder, device=device)
