"""ComfyUI's images and masks, as its nodes pass them: an IMAGE is a float tensor (B, H, W, 3) in [0, 1], a MASK a
float tensor (B, H, W) (1 = the masked area). Loading from the input folder, saving with ComfyUI's counter names and
PNG text chunks, and ComfyUI's resampling (``common_upscale``) for latents and images.
"""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, ImageSequence
from PIL.PngImagePlugin import PngInfo

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
UPSCALE_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")
LATENT_UPSCALE_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "bislerp")
CROP_METHODS = ("disabled", "center")


class ImageFileError(ValueError):
    """An image a node names cannot be read or written where it says."""


# --- the input folder ----------------------------------------------------------------------------------------

def input_images(folder: Path | None) -> list[str]:
    """The image files of ``folder`` (sub-folders included, as ``sub/name.png``), sorted, as LoadImage lists them."""
    if folder is None or not Path(folder).is_dir():
        return []
    root = Path(folder)
    found = [p.relative_to(root).as_posix() for p in root.rglob("*")
             if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
    return sorted(found)


def input_path(folder: Path, name: str) -> Path:
    """The file LoadImage's ``name`` means in ``folder`` (ComfyUI's ``"name [input]"`` annotation accepted); a
    name that leaves the folder is refused."""
    name = re.sub(r"\s*\[input\]$", "", name)
    root = Path(folder).resolve()
    path = (root / name).resolve()
    if root not in path.parents:
        raise ImageFileError(f"image {name!r} is not inside the input folder")
    if not path.is_file():
        raise ImageFileError(f"image {name!r} is not in the input folder (upload it first: POST /upload/image)")
    return path


def file_stamp(folder: Path | None, name: str):
    """What says a LoadImage file changed (ComfyUI hashes the file): its size and modification time."""
    try:
        st = input_path(folder, name).stat()
        return (st.st_size, st.st_mtime_ns)
    except (ImageFileError, OSError, TypeError):
        return None


def load_image(folder: Path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """LoadImage: the image (B, H, W, 3) and its mask (B, H, W): 1 - alpha where it has transparency, else a 64 x 64
    zero mask (ComfyUI's). The EXIF orientation is applied; the frames of an animation are the batch (those of
    another size than the first left out, as ComfyUI does; an MPO's first image only)."""
    path = input_path(folder, name)
    frames, masks = [], []
    try:
        with Image.open(path) as im:
            for frame in ImageSequence.Iterator(im):
                frame = ImageOps.exif_transpose(frame)
                if frames and frame.size != (frames[0].shape[1], frames[0].shape[0]):
                    continue
                frames.append(np.asarray(frame.convert("RGB"), dtype=np.float32) / 255.0)
                if "A" in frame.getbands() or (frame.mode == "P" and "transparency" in frame.info):
                    alpha = np.asarray(frame.convert("RGBA").getchannel("A"), dtype=np.float32) / 255.0
                    masks.append(1.0 - torch.from_numpy(alpha))
                else:
                    masks.append(torch.zeros(64, 64))
                if im.format == "MPO":
                    break
    except OSError as e:
        raise ImageFileError(f"image {name!r} cannot be read: {e}") from None
    if len({tuple(m.shape) for m in masks}) > 1:   # some frames transparent, some not: each its own mask
        masks = [m if m.shape[0] == frames[0].shape[0] else torch.zeros(frames[0].shape[:2]) for m in masks]
    return torch.from_numpy(np.stack(frames)), torch.stack(masks)


def load_mask(folder: Path, name: str, channel: str) -> torch.Tensor:
    """LoadImageMask: one channel of the image as a mask (1, H, W); ``alpha`` inverted (1 - alpha), as ComfyUI."""
    path = input_path(folder, name)
    try:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im)
            band = {"alpha": "A", "red": "R", "green": "G", "blue": "B"}[channel]
            if band not in im.getbands():
                return torch.zeros(1, 64, 64)
            values = torch.from_numpy(np.asarray(im.getchannel(band), dtype=np.float32) / 255.0)
    except OSError as e:
        raise ImageFileError(f"image {name!r} cannot be read: {e}") from None
    return (1.0 - values if band == "A" else values)[None]


# --- images and PIL ------------------------------------------------------------------------------------------

def to_pil(image: torch.Tensor) -> list[Image.Image]:
    """IMAGE (B, H, W, 3) -> PIL images, rounded to 8 bits (sdlite's rounding, which its own images use; ComfyUI's
    SaveImage truncates, so its PNGs can be one level darker in places)."""
    arr = (image.detach().float().clamp(0, 1).cpu().numpy() * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in arr]


def from_pil(images: list[Image.Image]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0) for im in images])


def decoded_to_image(decoded: torch.Tensor) -> torch.Tensor:
    """A VAE's output (B, 3, H, W) in [-1, 1] -> IMAGE (B, H, W, 3) in [0, 1]."""
    return (decoded.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()


def image_to_vae(image: torch.Tensor) -> torch.Tensor:
    """IMAGE (B, H, W, 3) -> the VAE's input (B, 3, H, W) in [-1, 1]."""
    return image.float().permute(0, 3, 1, 2) * 2.0 - 1.0


def crop_to_multiple(image: torch.Tensor, multiple: int = 8) -> torch.Tensor:
    """ComfyUI's ``vae_encode_crop_pixels``: an IMAGE whose sides are not multiples of 8 is cropped to them, the
    offset half the remainder."""
    h, w = image.shape[1] // multiple * multiple, image.shape[2] // multiple * multiple
    if (h, w) == tuple(image.shape[1:3]):
        return image
    top, left = (image.shape[1] % multiple) // 2, (image.shape[2] % multiple) // 2
    return image[:, top:top + h, left:left + w, :]


# --- resampling (ComfyUI's common_upscale) ---------------------------------------------------------------------

def common_upscale(samples: torch.Tensor, width: int, height: int, method: str, crop: str) -> torch.Tensor:
    """(B, C, H, W) resized to ``height`` x ``width`` by ``method`` (nearest-exact, bilinear, area, bicubic:
    torch's, corners not aligned; lanczos: PIL's, on 8-bit images); ``crop`` "center" first crops to the target's
    aspect ratio."""
    if crop == "center":
        old_w, old_h = samples.shape[3], samples.shape[2]
        old_aspect, new_aspect = old_w / old_h, width / height
        x = y = 0
        if old_aspect > new_aspect:
            x = round((old_w - old_w * (new_aspect / old_aspect)) / 2)
        elif old_aspect < new_aspect:
            y = round((old_h - old_h * (old_aspect / new_aspect)) / 2)
        samples = samples[:, :, y:old_h - y, x:old_w - x]
    if method == "lanczos":
        images = to_pil(samples.permute(0, 2, 3, 1))
        return from_pil([im.resize((width, height), Image.LANCZOS) for im in images]).permute(0, 3, 1, 2)
    return F.interpolate(samples, size=(height, width), mode=method)


def scaled_size(width: int, height: int, old_w: int, old_h: int, least: int) -> tuple[int, int]:
    """ImageScale's / LatentUpscale's target: a 0 side keeps the aspect ratio (at least ``least``)."""
    if width == 0 and height == 0:
        return old_w, old_h
    if width == 0:
        width = max(least, round(old_w * height / old_h))
    elif height == 0:
        height = max(least, round(old_h * width / old_w))
    return width, height


# --- saving --------------------------------------------------------------------------------------------------

def save_path(folder: Path, prefix: str, width: int, height: int) -> tuple[Path, str, str, int]:
    """ComfyUI's ``get_save_image_path``: ``(full folder, file name stem, subfolder, counter)`` for ``prefix``
    (which may hold a subfolder, and ``%width%`` / ``%height%``); the counter is one past the highest of the
    existing ``<stem>_NNNNN_`` files, so nothing is overwritten. A prefix leaving the folder is refused."""
    prefix = prefix.replace("%width%", str(width)).replace("%height%", str(height))
    subfolder, stem = os.path.split(os.path.normpath(prefix))
    root = Path(folder).resolve()
    full = (root / subfolder).resolve()
    if full != root and root not in full.parents:
        raise ImageFileError(f"filename_prefix {prefix!r} leaves the output folder")
    if not stem or stem in (".", ".."):
        raise ImageFileError(f"filename_prefix {prefix!r} names no file")
    counter = 1
    if full.is_dir():
        pattern = re.compile(re.escape(stem) + r"_(\d+)_?\.")
        taken = [int(m.group(1)) for p in full.iterdir() if (m := pattern.match(p.name))]
        counter = max(taken, default=0) + 1
    return full, stem, "" if full == root else full.relative_to(root).as_posix(), counter


def png_info(prompt: dict | None, extra_pnginfo: dict | None) -> PngInfo:
    """The text chunks ComfyUI's SaveImage writes: ``prompt`` (the API workflow as JSON) and each key of the
    request's ``extra_pnginfo`` (the UI's ``workflow``) as JSON."""
    info = PngInfo()
    if prompt is not None:
        info.add_text("prompt", json.dumps(prompt))
    for key, value in (extra_pnginfo or {}).items():
        info.add_text(str(key), json.dumps(value))
    return info


def save_images(images: torch.Tensor, folder: Path, prefix: str, kind: str, prompt: dict | None = None,
                extra_pnginfo: dict | None = None, compress_level: int = 4) -> list[dict]:
    """Write each image of an IMAGE batch as ``<prefix>_<counter:05>_.png`` and return ComfyUI's UI entries
    (``filename``, ``subfolder``, ``type``)."""
    pil = to_pil(images)
    full, stem, subfolder, counter = save_path(folder, prefix, pil[0].width, pil[0].height)
    full.mkdir(parents=True, exist_ok=True)
    info = png_info(prompt, extra_pnginfo)
    entries = []
    for im in pil:
        name = f"{stem}_{counter:05}_.png"
        while (full / name).exists():   # written meanwhile: never overwrite
            counter += 1
            name = f"{stem}_{counter:05}_.png"
        im.save(full / name, pnginfo=info, compress_level=compress_level)
        entries.append({"filename": name, "subfolder": subfolder, "type": kind})
        counter += 1
    return entries


def temp_prefix() -> str:
    """PreviewImage's prefix: ``ComfyUI_temp_`` and five random letters, as ComfyUI names its previews."""
    return "ComfyUI_temp_" + "".join(random.choice("abcdefghijklmnopqrstupvxyz") for _ in range(5))
