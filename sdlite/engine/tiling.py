"""Tiled VAE decode and encode: large images in bounded memory, equal to the untiled result.

An untiled decode at 2048x2048 holds several full-resolution activations at once, the largest 256 channels wide
(4 GiB each in fp32). Simple tiled VAEs decode overlapping tiles independently and blend them, which changes the
result: each tile's GroupNorms normalise with the tile's own statistics (colour and contrast shift from tile to
tile) and the mid-block attention sees only its tile. Estimating whole-image statistics in a first pass over such
tiles and decoding the tiles with them is not a reliable cure: the first pass still normalises tile-locally, so
every GroupNorm after the first gets an estimate from inputs that were computed wrongly, and iterating can
diverge. (On SD-VAE-shaped decoders with PyTorch's default random initialisation we measured 50 to 300 uint8
levels of error after one estimating pass, and more passes did not converge; the same overlapping tiles with
exact statistics and 12 latent pixels of overlap were within a fraction of a level.)

So this tiling is exact:

* The latent-resolution part runs once on the whole latent with the model's own modules: the decoder's
  ``conv_in``, mid-block (global attention) and first up level; the encoder's last level, mid-block and output
  layers. Those activations are small (0.125 GiB at 2048x2048; the decoder's first level ends at 2x: 0.5 GiB).
* The higher-resolution levels run layer by layer over the whole image, each layer in tiles: a tile reads its
  input window plus the one-pixel halo its 3x3 convolution needs (zeros beyond the image, as the convolution's
  padding gives), so each tile is exactly what the untiled layer computes there. Each GroupNorm first gathers
  its per-(sample, group) mean and variance over the whole input, tile by tile, then normalises every tile with
  them. Nothing is blended, so nothing can show a seam; the result equals the untiled one up to fp32 rounding.
* An input no larger than one tile is simply run untiled.

Memory: a ResBlock holds its input (which becomes its output in place when the shortcut is the identity), its
inner activation and, when the width changes, a new output: two or three full-size activations of the level's
width. The upsampled input of a decoder level (256 channels at full resolution: 4 GiB at 2048x2048) is never
stored: it is recomputed tile by tile from the half-resolution activation, so its 3x3 convolution runs twice
(for the statistics, then for use). Each layer's temporaries are one tile's. Time: about the untiled decode's
plus those repeated convolutions.

The layer sequence mirrors ``ResnetBlock.forward``, ``Upsample``/``Downsample`` and the encoder/decoder
``forward`` in ``sdlite.models``; the tests hold the tiled result to the untiled one, so a change there that is
not made here fails them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SDLiteError
from ..models.layers import Downsample, ResnetBlock, Upsample
from ..models.vae import AutoencoderKL
from .packing import conv2d


class TilingError(SDLiteError, ValueError):
    """A tile size or input shape that tiling cannot use (the message names it and what is valid)."""


# --- activations as canvases ---------------------------------------------------------------------------------

class _Stored:
    """A whole activation (B, C, H, W) held in memory."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.shape = tuple(t.shape)

    def region(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        return self.t[:, :, r0:r1, c0:c1]


class _Upsampled:
    """``upsample(src)`` -- nearest 2x, then its 3x3 convolution -- computed region by region, never stored."""

    def __init__(self, up: Upsample, src: _Stored):
        self.up, self.src = up, src
        b, _, h, w = src.shape
        self.shape = (b, up.conv.out_channels, 2 * h, 2 * w)

    def region(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        _, _, h, w = self.shape
        # The convolution needs upsampled rows [r0 - 1, r1 + 1); whole source rows [s0, s1) give upsampled rows
        # [2 s0, 2 s1), which may hold one more row at either end: its output row is computed and dropped.
        s0, s1 = max(r0 - 1, 0) // 2, (min(r1 + 1, h) + 1) // 2
        t0, t1 = max(c0 - 1, 0) // 2, (min(c1 + 1, w) + 1) // 2
        top, bottom, left, right = int(r0 == 0), int(r1 == h), int(c0 == 0), int(c1 == w)
        src = self.src.region(s0, s1, t0, t1)
        b, c, n, m = src.shape
        x = src.new_empty(b, c, top + 2 * n + bottom, left + 2 * m + right)
        for border in (x[:, :, :top], x[:, :, top + 2 * n:], x[:, :, :, :left], x[:, :, :, left + 2 * m:]):
            border.zero_()
        # nearest 2x, written straight into the padded buffer
        x[:, :, top:top + 2 * n, left:left + 2 * m].view(b, c, n, 2, m, 2).copy_(
            src[:, :, :, None, :, None].expand(b, c, n, 2, m, 2))
        y = _conv(self.up.conv, x, (0, 0, 0, 0))                   # rows from 2 s0 - top + 1, columns likewise
        dr, dc = r0 - (2 * s0 - top + 1), c0 - (2 * t0 - left + 1)
        return y[:, :, dr:dr + r1 - r0, dc:dc + c1 - c0]


def _tiles(h: int, w: int, step: int):
    for r0 in range(0, h, step):
        for c0 in range(0, w, step):
            yield r0, min(r0 + step, h), c0, min(c0 + step, w)


def _conv(conv: nn.Conv2d, x: torch.Tensor, pad: tuple[int, int, int, int]) -> torch.Tensor:
    """``conv`` on a window that already holds its halo, zero-padded by ``pad`` = (top, bottom, left, right)
    where the window met the image edge."""
    top, bottom, left, right = pad
    if top or bottom or left or right:
        x = F.pad(x, (left, right, top, bottom))
    return conv2d(conv, x, (0, 0))


def _act(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, pad: tuple[int, int, int, int]) -> torch.Tensor:
    """``F.pad(silu(x * scale + shift), pad)`` (pad = top, bottom, left, right) in one new tensor."""
    top, bottom, left, right = pad
    b, c, h, w = x.shape
    out = x.new_empty(b, c, top + h + bottom, left + w + right)
    for border in (out[:, :, :top], out[:, :, top + h:], out[:, :, :, :left], out[:, :, :, left + w:]):
        border.zero_()
    inner = out[:, :, top:top + h, left:left + w]
    torch.addcmul(shift, x, scale, out=inner)
    F.silu(inner, inplace=True)
    return out


def _window(src, r0: int, r1: int, c0: int, c1: int, halo: int):
    """Rows [r0 - halo, r1 + halo) and columns likewise of ``src``, clipped to the image, and the zero padding
    (top, bottom, left, right) that restores the clipped parts."""
    _, _, h, w = src.shape
    lo_r, hi_r, lo_c, hi_c = max(r0 - halo, 0), min(r1 + halo, h), max(c0 - halo, 0), min(c1 + halo, w)
    return src.region(lo_r, hi_r, lo_c, hi_c), (lo_r - (r0 - halo), r1 + halo - hi_r, lo_c - (c0 - halo),
                                                c1 + halo - hi_c)


# --- GroupNorm over the whole image ----------------------------------------------------------------------------

def _norm_affine(norm: nn.GroupNorm, src, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm`` over the whole of ``src`` as a per-(sample, channel) affine map ``x * scale + shift``: the
    statistics are gathered tile by tile (per-tile mean and variance, combined in float64)."""
    b, c, h, w = src.shape
    g = norm.num_groups
    total = torch.zeros(b, c, dtype=torch.float64)
    total_sq = torch.zeros(b, c, dtype=torch.float64)
    for r0, r1, c0, c1 in _tiles(h, w, step):
        var, mean = torch.var_mean(src.region(r0, r1, c0, c1).float(), dim=(2, 3), correction=0)   # (B, C)
        n = (r1 - r0) * (c1 - c0)
        mean, var = mean.double().cpu(), var.double().cpu()
        total += mean * n
        total_sq += (var + mean * mean) * n
    count = h * w * (c // g)
    mean = total.view(b, g, -1).sum(-1) / count                                          # (B, G)
    var = (total_sq.view(b, g, -1).sum(-1) / count - mean * mean).clamp_min(0.0)
    per = c // g
    scale = torch.rsqrt(var + norm.eps).repeat_interleave(per, dim=1) * norm.weight.detach().double().cpu()
    shift = norm.bias.detach().double().cpu() - mean.repeat_interleave(per, dim=1) * scale
    like = norm.weight
    return (scale.to(like.device, like.dtype)[:, :, None, None], shift.to(like.device, like.dtype)[:, :, None, None])


def _norm_act_conv(norm: nn.GroupNorm, conv: nn.Conv2d, src, step: int, out: torch.Tensor | None = None,
                   residual_into: bool = False) -> torch.Tensor:
    """``conv(silu(norm(src)))`` over the whole image, tile by tile; written into ``out`` (added to it when
    ``residual_into``), or into a new tensor."""
    scale, shift = _norm_affine(norm, src, step)
    b, _, h, w = src.shape
    halo = conv.padding[0]
    if out is None:
        out = scale.new_empty(b, conv.out_channels, h, w)
    for r0, r1, c0, c1 in _tiles(h, w, step):
        x, pad = _window(src, r0, r1, c0, c1, halo)
        y = _conv(conv, _act(x, scale, shift, pad), (0, 0, 0, 0))  # the zeros go in after the activation
        if residual_into:
            out[:, :, r0:r1, c0:c1] += y
        else:
            out[:, :, r0:r1, c0:c1] = y
    return out


# --- the blocks, layer by layer ----------------------------------------------------------------------------------

class _LayerByLayer:
    """Runs blocks over the whole image, one layer at a time, each in tiles of ``tile`` pixels per ``ref``
    pixels of the current activation's height (so a tile covers the same part of the image at every level).

    ``src`` is the current activation; each step takes it out of ``self`` and drops it as soon as it has been
    read, so that no more than the stated full-size activations are alive at once.
    """

    def __init__(self, src, tile: int, ref: int):
        self.src, self.tile, self.ref = src, tile, ref

    def step(self, src) -> int:
        return max(self.tile * src.shape[2] // self.ref, 1)

    def level(self, stack: nn.Module):
        """One ``ResnetStack``: its ResBlocks, then its resampler (an upsampler's result stays uncomputed)."""
        for block in stack.resnets:
            self.resnet(block)
        for up in getattr(stack, "upsamplers", ()):
            self.src = _Upsampled(up, self.src)
        for down in getattr(stack, "downsamplers", ()):
            self.downsample(down)

    def resnet(self, block: ResnetBlock):
        """``ResnetBlock.forward`` (no time embedding): h = conv1(silu(norm1(x))), out = shortcut(x) +
        conv2(silu(norm2(h))). A stored input with an identity shortcut becomes the output in place; otherwise
        the shortcut is written to a new output while h is computed, and the input is dropped."""
        src, self.src = self.src, None
        step = self.step(src)
        scale, shift = _norm_affine(block.norm1, src, step)
        b, _, h, w = src.shape
        shortcut = getattr(block, "conv_shortcut", None)
        in_place = shortcut is None and isinstance(src, _Stored)
        out = src.t if in_place else scale.new_empty(b, block.conv2.out_channels, h, w)
        inner = scale.new_empty(b, block.conv1.out_channels, h, w)
        for r0, r1, c0, c1 in _tiles(h, w, step):
            x, pad = _window(src, r0, r1, c0, c1, 1)
            if not in_place:
                core = x[:, :, 1 - pad[0]:1 - pad[0] + r1 - r0, 1 - pad[2]:1 - pad[2] + c1 - c0]  # the tile itself
                out[:, :, r0:r1, c0:c1] = core if shortcut is None else _conv(shortcut, core, (0, 0, 0, 0))
                del core
            x = _act(x, scale, shift, pad)
            inner[:, :, r0:r1, c0:c1] = _conv(block.conv1, x, (0, 0, 0, 0))
        del src, x  # (a window of a stored input is a view: it too would keep the input alive)
        _norm_act_conv(block.norm2, block.conv2, _Stored(inner), step, out=out, residual_into=True)
        self.src = _Stored(out)

    def downsample(self, down: Downsample):
        """``Downsample.forward`` with the VAE's padding (one zero row and column after the image, then a 3x3
        stride-2 convolution), output tile by output tile."""
        if down.padding != 0:
            raise TilingError(f"tiled encode: Downsample with padding={down.padding} is not supported (the VAE's "
                              f"Downsample pads by hand: padding=0)")
        src, self.src = self.src, None
        b, _, h, w = src.shape
        oh, ow = (h - 2) // 2 + 1, (w - 2) // 2 + 1
        out = src.t.new_empty(b, down.conv.out_channels, oh, ow)
        for r0, r1, c0, c1 in _tiles(oh, ow, max(self.step(src) // 2, 1)):
            hi_r, hi_c = min(2 * r1 + 1, h), min(2 * c1 + 1, w)
            x = src.region(2 * r0, hi_r, 2 * c0, hi_c)
            out[:, :, r0:r1, c0:c1] = _conv(down.conv, x, (0, 2 * r1 + 1 - hi_r, 0, 2 * c1 + 1 - hi_c))
        self.src = _Stored(out)

    def norm_act_conv(self, norm: nn.GroupNorm, conv: nn.Conv2d) -> torch.Tensor:
        src, self.src = self.src, None
        return _norm_act_conv(norm, conv, src, self.step(src))


# --- argument checks ---------------------------------------------------------------------------------------------

def _check_tile(what: str, tile, unit: int, px: str, example: int):
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < unit or tile % unit:
        kind = f"multiple of {unit} (the VAE's downscale)" if unit > 1 else "integer"
        raise TilingError(f"{what}: tile={tile!r} is not valid: expected a positive {kind} in {px}, e.g. {example}")


def _check_input(t, channels: int, name: str, unit: int = 1):
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != channels:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise TilingError(f"{name} of shape {shape} is not valid: expected (batch, {channels}, height, width)")
    if t.shape[2] % unit or t.shape[3] % unit:
        raise TilingError(f"{name} of size {t.shape[3]}x{t.shape[2]} (width x height) is not valid for tiled "
                          f"encoding: both must be multiples of {unit}, the VAE's downscale")


# --- decode and encode -------------------------------------------------------------------------------------------

@torch.no_grad()
def tiled_decode(vae: AutoencoderKL, z: torch.Tensor, tile: int = 64) -> torch.Tensor:
    """``vae.decode(z)`` with every layer above latent resolution computed in tiles of ``tile`` x ``tile`` latent
    pixels (``8 * tile`` image pixels at full resolution): unscaled latent (B, 4, h, w) -> image (B, 3, 8h, 8w),
    equal to the untiled decode up to fp32 rounding (a latent no larger than one tile: exactly ``vae.decode``).
    ``tile`` sets the size of each layer's temporaries (about 0.5 GB at the default 64 with SD's VAE), not of the
    full-size activations. Raises :class:`TilingError` (a ValueError) for a tile that is not a positive integer
    or a latent of the wrong shape.
    """
    cfg = vae.config
    _check_tile("tiled decode", tile, 1, "latent pixels", 64)
    _check_input(z, cfg.latent_channels, "latent")
    if z.shape[2] <= tile and z.shape[3] <= tile:
        return vae.decode(z)
    dec = vae.decoder
    # latent resolution, whole, with the model's own modules: conv_in, mid-block (global attention), level 0
    x = dec.mid_block(dec.conv_in(vae.post_quantize(z)))
    levels = list(dec.up_blocks)
    if levels:
        x = levels[0](x)
    run = _LayerByLayer(_Stored(x), tile, z.shape[2])
    del x
    for stack in levels[1:]:
        run.level(stack)
    return run.norm_act_conv(dec.conv_norm_out, dec.conv_out)


@torch.no_grad()
def tiled_encode_moments(vae: AutoencoderKL, x: torch.Tensor, tile: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``vae.encode_moments(x)`` with every layer above latent resolution computed in tiles of ``tile`` x ``tile``
    image pixels (a multiple of the VAE's downscale, 8): image (B, 3, H, W) in [-1, 1], H and W multiples of 8 ->
    (mean, logvar), each (B, 4, H/8, W/8), equal to the untiled result up to fp32 rounding (an image no larger
    than one tile: exactly ``vae.encode_moments``). Raises :class:`TilingError` (a ValueError) for a bad tile or
    image shape.
    """
    cfg = vae.config
    _check_tile("tiled encode", tile, cfg.downscale, "image pixels", 512)
    _check_input(x, cfg.in_channels, "image", unit=cfg.downscale)
    if x.shape[2] <= tile and x.shape[3] <= tile:
        return vae.encode_moments(x)
    enc = vae.encoder
    conv_in = enc.conv_in
    image = _Stored(x)
    feats = x.new_empty(x.shape[0], conv_in.out_channels, x.shape[2], x.shape[3])
    for r0, r1, c0, c1 in _tiles(x.shape[2], x.shape[3], tile):
        window, pad = _window(image, r0, r1, c0, c1, conv_in.padding[0])
        feats[:, :, r0:r1, c0:c1] = _conv(conv_in, window, pad)
    run = _LayerByLayer(_Stored(feats), tile, x.shape[2])
    del feats
    for stack in list(enc.down_blocks)[:-1]:
        run.level(stack)
    feats, run.src = run.src.t, None
    # latent resolution, whole, with the model's own modules: last level, mid-block, output layers
    feats = enc.mid_block(enc.down_blocks[-1](feats))
    moments = vae.quantize(enc.conv_out(F.silu(enc.conv_norm_out(feats))))
    mean, logvar = moments.chunk(2, dim=1)
    return mean, logvar.clamp(-30.0, 20.0)


def tiled_encode(vae: AutoencoderKL, x: torch.Tensor, tile: int = 512,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """``vae.encode(x, generator)`` through :func:`tiled_encode_moments`: the mean latent when no generator is
    given, else a sample from the posterior; unscaled."""
    mean, logvar = tiled_encode_moments(vae, x, tile)
    if generator is None:
        return mean
    noise = torch.randn(mean.shape, generator=generator, device=generator.device, dtype=mean.dtype)
    return mean + torch.exp(0.5 * logvar) * noise.to(mean.device)
