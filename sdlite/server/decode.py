"""Images in: a base64 image of a request (raw, or a ``data:`` URI) -> a decoded PIL image, with its bytes and pixels
capped before any pixel is decoded. Shared by every front-end that takes base64 images (:mod:`.a1111.api`,
:mod:`.a1111.controlnet`)."""
from __future__ import annotations

import base64
import binascii
import io
import warnings as _warnings
from typing import Any

from PIL import Image, UnidentifiedImageError

from ..errors import SDLiteError
from ..pipeline import RequestError
from ..sources import MAX_PIXELS


class ImageTooLarge(SDLiteError):
    """An input image is over the byte or pixel cap (HTTP 413)."""


def decode_image(data: Any, what: str, max_bytes: int) -> Image.Image:
    """A base64 image (raw, or a ``data:image/...;base64,`` URI) -> a decoded PIL image. The pixel count is checked
    from the header before any pixel is decoded (:data:`sdlite.sources.MAX_PIXELS`)."""
    if not isinstance(data, str) or not data.strip():
        raise RequestError(f"{what}: expected a base64-encoded image, got {type(data).__name__ if data else 'nothing'}")
    text = data.strip()
    if text.startswith(("http://", "https://")):
        raise RequestError(f"{what}: URLs are not fetched; send the image itself, base64-encoded")
    if text.startswith("data:"):
        header, comma, text = text.partition(",")
        if not comma or ";base64" not in header:
            raise RequestError(f"{what}: a data URI must be data:image/...;base64,<data>")
    if len(text) * 3 // 4 > max_bytes:
        raise ImageTooLarge(f"{what}: about {len(text) * 3 // 4} bytes, more than the cap of {max_bytes}")
    try:
        raw = base64.b64decode(text)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{what}: not valid base64 ({e})") from None
    try:
        with _warnings.catch_warnings():
            _warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise ImageTooLarge(f"{what}: {width}x{height} is {width * height} pixels, more than the cap of "
                                    f"{MAX_PIXELS} (8192x8192)")
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageTooLarge(f"{what}: refused as a possible decompression bomb ({e})") from None
    except UnidentifiedImageError:
        raise RequestError(f"{what}: the data is not an image (PNG, JPEG, WebP ...) that Pillow can read") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise RequestError(f"{what}: the image cannot be decoded: {e}") from None
    return image
