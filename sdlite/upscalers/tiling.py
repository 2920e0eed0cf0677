"""Running an upscaler over an image of any size in bounded memory: overlapping tiles, of which only the centres
are kept.

The image is cut into a grid of near-equal *cores* of at most ``tile`` x ``tile`` input pixels. Each core is run
through the net together with ``overlap`` pixels of its surroundings on every side (fewer at the image's edges:
there the tile's edge is the image's, as in an untiled run), and only the core's part of the output is kept.
Nothing is blended: every output pixel comes from a window in which it has at least ``overlap`` input pixels of
real image around it in every direction the image extends.

Why that is (nearly) the untiled result: each 3x3 convolution pads its input with zeros at the window's edge, so a
tile's features go wrong one pixel further inwards per convolution. An output pixel whose window holds everything
it depends on is exact.

* :class:`~sdlite.upscalers.nets.SRVGGNetCompact` depends on ``num_conv + 2`` input pixels around it (34 for
  realesr-general-x4v3, 18 for animevideov3): its default overlap is exactly that, and the tiled result equals the
  untiled one up to float rounding (bit for bit in our tests).
* :class:`~sdlite.upscalers.nets.RRDBNet` depends, in principle, on ``2 + 15 * num_block`` input pixels around it
  (347 for the 23-block ESRGAN: a dense block's longest path is 5 convolutions, an RRDB chains 3) -- a window of
  700 pixels around every tile would be an untiled run. But its influence falls off fast: every dense block and
  every RRDB adds its branch scaled by 0.2, so what reaches far must pass many scaled branches in a row. Measured
  on the full-size net (96x96 input, 32-pixel tiles, random weights), the largest tiled-untiled difference falls to
  fp32 rounding (1e-6 of the output's range) at 8 pixels of overlap with PyTorch's default initialisation, and at
  16 pixels with weights of unit gain (He initialisation, whose activations grow a hundredfold through the trunk:
  far livelier than a trained net's). :data:`RRDB_OVERLAP` is twice that, 32 pixels, as margin for trained
  weights, which we could not measure here; 8-bit outputs then agree within 1/255 (an exact .5 may round either
  way). For an interior tile it costs (256 + 64)^2 / 256^2 = 1.56 times the trunk's work; ``overlap=`` trades
  that back. Real-ESRGAN x2plus / x1 models work on 2x2 / 4x4 folded pixels, so their overlap is 2 / 4 times as
  many input pixels.
* RRDBNet's upsampling tail (conv_up1, conv_up2, conv_hr, conv_last) sees at most two trunk pixels around its own,
  so it runs over each tile's core in blocks of :data:`TAIL_BLOCK` trunk pixels with that halo: exact, and its
  64-channel activations at 16 times the area (x4) are one block's, not the whole window's.

Memory: what a tile holds is its window's trunk activations at the input's resolution (a dense block's input,
four 32-channel outputs and their concatenation) and one tail block. Measured: a 512x512 x4 upscale by the
full-size 23-block RRDBNet with the defaults peaked at 671 MB resident (the process and the model: 298 MB), in
62 s on a 2-core CPU. An input no larger than one tile's core runs as one window.

Images: RGB as they are; L through a colour net as grey RGB (the result's luma kept), RGB through a grey net
channel by channel; the alpha of RGBA / LA images is scaled by Lanczos (not by the net: upscalers are trained on
colour photographs and drawings, not on masks), and P images become RGB(A) first.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ..errors import SDLiteError
from .files import Upscaler
from .nets import RRDBNet

__all__ = ["upscale", "upscale_tensor", "default_overlap", "tile_windows", "DEFAULT_TILE", "RRDB_OVERLAP",
           "PRECISIONS"]

DEFAULT_TILE = 256        # input pixels per tile core: see the module docstring for the memory it takes
RRDB_OVERLAP = 32         # input pixels of context around each RRDBNet tile core: see the module docstring
TAIL_BLOCK = 128          # RRDBNet's upsampling tail runs in blocks of this many feature pixels
PRECISIONS = (torch.float32, torch.bfloat16, torch.float16)


def default_overlap(upscaler: Upscaler) -> int:
    """The context (in input pixels) kept around each tile: SRVGGNetCompact's whole receptive field (exact), or
    :data:`RRDB_OVERLAP` for RRDBNet (within 1/255; its receptive field is far larger than any tile)."""
    cfg = upscaler.net.config
    if isinstance(upscaler.net, RRDBNet):
        return RRDB_OVERLAP * cfg.unshuffle   # the trunk works on unshuffled pixels, u input pixels each
    return int(cfg.receptive_radius)


def _splits(size: int, tile: int, align: int) -> list[tuple[int, int]]:
    """``size`` cut into ceil(size / tile) near-equal pieces whose bounds are multiples of ``align``."""
    n = max(1, -(-size // tile))
    bounds = sorted({min(size, round(size * i / n / align) * align) for i in range(n + 1)} | {0, size})
    return list(zip(bounds[:-1], bounds[1:]))


def tile_windows(height: int, width: int, tile: int, overlap: int, align: int = 1):
    """The tiles of a (height, width) image: ``(core, window)`` pairs of (top, bottom, left, right) boxes, the
    window being the core grown by ``overlap`` on every side within the image (all bounds multiples of ``align``
    when height and width are)."""
    out = []
    grow = -(-overlap // align) * align
    for top, bottom in _splits(height, tile, align):
        for left, right in _splits(width, tile, align):
            window = (max(0, top - grow), min(height, bottom + grow), max(0, left - grow), min(width, right + grow))
            out.append(((top, bottom, left, right), window))
    return out


def _net_for(upscaler: Upscaler, dtype: torch.dtype | None) -> torch.nn.Module:
    if dtype is None or dtype == upscaler.dtype:
        return upscaler.net
    if dtype not in PRECISIONS:
        raise SDLiteError(f"an upscaler runs in float32, bfloat16 or float16, not {dtype}")
    return copy.deepcopy(upscaler.net).to(dtype)


def _pieces(upscaler: Upscaler, x: torch.Tensor, tile: int, overlap: int | None, dtype: torch.dtype | None,
            progress: Callable[[int, int], None] | None) -> Iterator[tuple[tuple[int, int, int, int], torch.Tensor]]:
    """The output of ``upscaler`` on ``x`` (B, C, H, W) in pieces: ``((top, bottom, left, right), (B, C, h, w))``
    in output pixels, covering the (scale H, scale W) output once."""
    if x.ndim != 4 or x.shape[1] != upscaler.channels:
        raise SDLiteError(f"{upscaler.name} upscales (B, {upscaler.channels}, H, W) images, not a tensor of shape "
                          f"{list(x.shape)}")
    if tile < 1:
        raise SDLiteError(f"the tile size must be a positive number of pixels, not {tile}")
    overlap = default_overlap(upscaler) if overlap is None else overlap
    if overlap < 0:
        raise SDLiteError(f"the tile overlap must be 0 or more pixels, not {overlap}")
    net = _net_for(upscaler, dtype)
    compute = next(net.parameters()).dtype
    s = upscaler.scale
    u = getattr(net.config, "unshuffle", 1)
    h, w = x.shape[2:]
    ph, pw = -h % u, -w % u
    if ph or pw:   # Real-ESRGAN's x2/x1 fold 2x2 / 4x4 pixels into channels: mirror the image to a multiple of that
        x = F.pad(x, (0, pw, 0, ph), mode="reflect" if ph < h and pw < w else "replicate")
    windows = tile_windows(x.shape[2], x.shape[3], tile, overlap, u)
    with torch.inference_mode():
        for i, ((t, b, le, r), (wt, wb, wl, wr)) in enumerate(windows):
            piece = x[:, :, wt:wb, wl:wr].to(device=upscaler.device, dtype=compute)
            if isinstance(net, RRDBNet):
                for box, y in _rrdb_tail(net, net.features(piece), ((t - wt) // u, (b - wt) // u,
                                                                    (le - wl) // u, (r - wl) // u)):
                    f = 2 ** net.config.upsamples     # output pixels per feature pixel
                    yield _clip((s * wt + f * box[0], s * wt + f * box[1], s * wl + f * box[2], s * wl + f * box[3]),
                                y, s * h, s * w)
            else:
                y = net(piece)                                                # (B, C, s(wb-wt), s(wr-wl))
                yield _clip((s * t, s * b, s * le, s * r),
                            y[:, :, s * (t - wt):s * (b - wt), s * (le - wl):s * (r - wl)], s * h, s * w)
            del piece
            if progress is not None:
                progress(i + 1, len(windows))


def _clip(box, y, height, width):
    """A piece cut back to the unpadded output."""
    t, b, le, r = box
    b2, r2 = min(b, height), min(r, width)
    return (t, b2, le, r2), y[:, :, :b2 - t, :r2 - le]


def _rrdb_tail(net: RRDBNet, feat: torch.Tensor, core: tuple[int, int, int, int]):
    """RRDBNet's upsampling tail over the ``core`` box of its trunk features ``feat`` (B, F, h, w), in blocks of
    :data:`TAIL_BLOCK` feature pixels, each with the tail's halo around it: ``(box in feature pixels, output)``.
    Exact, because the halo covers everything the tail's convolutions see; it keeps the 64-channel activations at
    16 times the area (x4) to one block's."""
    t, b, le, r = core
    f = 2 ** net.config.upsamples
    halo = net.TAIL_HALO
    fh, fw = feat.shape[2:]
    for bt, bb in _splits_from(t, b, TAIL_BLOCK):
        for bl, br in _splits_from(le, r, TAIL_BLOCK):
            st, sb, sl, sr = max(0, bt - halo), min(fh, bb + halo), max(0, bl - halo), min(fw, br + halo)
            y = net.upsample(feat[:, :, st:sb, sl:sr])                       # (B, C, f(sb-st), f(sr-sl))
            yield (bt, bb, bl, br), y[:, :, f * (bt - st):f * (bb - st), f * (bl - sl):f * (br - sl)]


def _splits_from(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    return [(a, b) for a, b in ((start + lo, start + hi) for lo, hi in _splits(stop - start, size, 1))]


def upscale_tensor(upscaler: Upscaler, x: torch.Tensor, tile: int = DEFAULT_TILE, overlap: int | None = None,
                   dtype: torch.dtype | None = None,
                   progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Images (B, C, H, W) in [0, 1] -> (B, C, scale*H, scale*W) float32 on x's device, not clamped.

    ``tile``: the largest core (input pixels); ``overlap``: the context around each core (None:
    :func:`default_overlap`); ``dtype``: what the net computes in (None: the upscaler's own; float32, bfloat16 or
    float16 -- another than the upscaler's runs on a converted copy of its net); ``progress(done, total)`` is
    called after each tile.
    """
    s = upscaler.scale
    out = torch.empty(x.shape[0], x.shape[1], s * x.shape[2], s * x.shape[3], dtype=torch.float32, device=x.device)
    for (t, b, le, r), y in _pieces(upscaler, x, tile, overlap, dtype, progress):
        out[:, :, t:b, le:r] = y
    return out


# --- PIL images ----------------------------------------------------------------------------------------------------


def _to_tensor(image: Image.Image) -> torch.Tensor:
    a = np.asarray(image, dtype=np.float32) / 255.0
    a = a[:, :, None] if a.ndim == 2 else a
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))[None]      # (1, C, H, W)


def _split_alpha(image: Image.Image) -> tuple[Image.Image, Image.Image | None]:
    """The colour part of ``image`` (RGB or L) and its alpha (None when it has none)."""
    mode = image.mode
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        raise SDLiteError(f"a {mode} image (16-bit or float) cannot be upscaled here; convert it to 8-bit RGB or L")
    if mode in ("RGBA", "RGBa", "LA", "La", "PA"):
        base = "L" if mode in ("LA", "La") else "RGB"
        image = image.convert("RGBA" if base == "RGB" else "LA")
        return image.convert(base), image.getchannel("A")
    if mode in ("L", "RGB"):
        return image, None
    return image.convert("L" if mode == "1" else "RGB"), None


def upscale(upscaler: Upscaler, image: Image.Image, tile: int = DEFAULT_TILE, overlap: int | None = None,
            dtype: torch.dtype | None = None, progress: Callable[[int, int], None] | None = None) -> Image.Image:
    """``image`` upscaled by the net: an image ``upscaler.scale`` times as wide and high.

    The result's mode is the input's for RGB, RGBA, L and LA (P images give RGB or RGBA; other modes RGB or L).
    ``tile``, ``overlap``, ``dtype`` and ``progress`` as for :func:`upscale_tensor`.
    """
    colour, alpha = _split_alpha(image)
    x = _to_tensor(colour)                                                  # (1, 1 or 3, H, W)
    grey = colour.mode == "L"
    if upscaler.channels == 3 and grey:
        x = x.expand(1, 3, *x.shape[2:])
    elif upscaler.channels == 1 and not grey:
        x = x.transpose(0, 1)                                               # the channels as a batch of grey
    elif upscaler.channels not in (1, 3):
        raise SDLiteError(f"{upscaler.name} upscales {upscaler.channels}-channel images; only 1 (grey) and 3 (RGB) "
                          "channel upscalers take pictures")
    s = upscaler.scale
    out = np.empty((s * x.shape[2], s * x.shape[3], x.shape[0] * x.shape[1]), np.uint8)   # 8 bits: the result's size
    for (t, b, le, r), y in _pieces(upscaler, x, tile, overlap, dtype, progress):
        y = y.float().clamp(0, 1).mul(255).round().to(torch.uint8).cpu()                   # (B, C, h, w)
        out[t:b, le:r] = y.reshape(-1, *y.shape[2:]).permute(1, 2, 0).numpy()
    result = Image.fromarray(out[:, :, 0] if out.shape[2] == 1 else out, "L" if out.shape[2] == 1 else "RGB")
    if grey and result.mode != "L":
        result = result.convert("L")
    if alpha is not None:
        result.putalpha(alpha.resize(result.size, Image.Resampling.LANCZOS))
    return result
