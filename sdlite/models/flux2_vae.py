"""FLUX.2's autoencoder (diffusers' ``AutoencoderKLFlux2``) and the latent maths of the FLUX.2 pipelines around it.

The network is sdlite's :class:`~sdlite.models.vae.AutoencoderKL` (encoder, decoder, ``quant_conv`` and
``post_quant_conv``; module names = diffusers' keys) built from :class:`~sdlite.config.flux2_vae.Flux2VAEConfig`, with
32 latent channels, a decoder that may be narrower than the encoder, and one more part, ``bn``: the running statistics
of a ``BatchNorm2d`` over the patchified latent. ``encode`` / ``decode`` work on the VAE's own latent,
(B, 32, H/8, W/8), exactly as ``AutoencoderKLFlux2.encode(x).latent_dist.mode()`` and ``.decode(z)`` do.

What the transformer sees is that latent cut into 2 x 2 patches and normalised, as the FLUX.2 pipelines
(``Flux2Pipeline``, ``Flux2KleinPipeline``) do it::

    image ──encode (mean)──> z (B, 32, h, w) ──patchify──> (B, 128, h/2, w/2) ──normalize──> transformer latents
    transformer latents ──denormalize──> (B, 128, h/2, w/2) ──unpatchify──> z ──decode──> image

:func:`patchify_latents` puts latent channel ``c``'s 2 x 2 patch at channels ``4c .. 4c + 3`` (row-major within the
patch); :func:`normalize_latents` is ``(x - mean) / sqrt(var + eps)`` per channel with the stored statistics and
:func:`denormalize_latents` its inverse, computed in the pipelines' order (the square root in the statistics' dtype,
then both cast to the latents' dtype), so the results are bit for bit theirs. :meth:`Flux2VAE.encode_latents` and
:meth:`Flux2VAE.decode_latents` chain them with the network. Packing the (B, 128, h', w') latent into tokens is the
transformer's business, not the autoencoder's.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config.flux2_vae import Flux2VAEConfig
from .vae import AutoencoderKL, Decoder

__all__ = ["Flux2VAE", "LatentBatchNorm", "patchify_latents", "unpatchify_latents", "normalize_latents",
           "denormalize_latents"]

_PATCH = 2   # the pipelines' 2 x 2 patches (Flux2VAEConfig refuses any other patch_size)


def patchify_latents(z: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2): the 2 x 2 patch at (2y, 2x) of channel c becomes channels 4c + 2i + j
    (i the row, j the column within the patch) at (y, x). ``h`` and ``w`` must be even."""
    if z.ndim != 4 or z.shape[2] % _PATCH or z.shape[3] % _PATCH:
        raise ValueError(f"FLUX.2 latent of shape {tuple(z.shape)} cannot be patchified: expected (batch, channels, "
                         "height, width) with an even height and width")
    b, c, h, w = z.shape
    z = z.reshape(b, c, h // _PATCH, _PATCH, w // _PATCH, _PATCH)      # (B, C, h/2, i, w/2, j)
    z = z.permute(0, 1, 3, 5, 2, 4)                                     # (B, C, i, j, h/2, w/2)
    return z.reshape(b, c * _PATCH * _PATCH, h // _PATCH, w // _PATCH)  # (B, 4C, h/2, w/2)


def unpatchify_latents(x: torch.Tensor) -> torch.Tensor:
    """(B, 4C, h, w) -> (B, C, 2h, 2w), the inverse of :func:`patchify_latents`."""
    if x.ndim != 4 or x.shape[1] % (_PATCH * _PATCH):
        raise ValueError(f"FLUX.2 patchified latent of shape {tuple(x.shape)} cannot be unpatchified: expected "
                         "(batch, channels, height, width) with channels a multiple of 4")
    b, c4, h, w = x.shape
    c = c4 // (_PATCH * _PATCH)
    x = x.reshape(b, c, _PATCH, _PATCH, h, w)                           # (B, C, i, j, h, w)
    x = x.permute(0, 1, 4, 2, 5, 3)                                     # (B, C, h, i, w, j)
    return x.reshape(b, c, h * _PATCH, w * _PATCH)                      # (B, C, 2h, 2w)


def _statistics(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std), each (1, C, 1, 1) in ``x``'s dtype and device: std = sqrt(var + eps) taken in the statistics'
    own dtype before the cast, as the pipelines take it."""
    channels = x.shape[1] if x.ndim == 4 else None
    if channels is None or tuple(running_mean.shape) != (channels,) or tuple(running_var.shape) != (channels,):
        raise ValueError(f"FLUX.2 latent of shape {tuple(x.shape)} does not fit the batch-norm statistics "
                         f"(running_mean {list(running_mean.shape)}, running_var {list(running_var.shape)}): expected "
                         "a patchified (batch, channels, height, width) latent with one statistic per channel")
    mean = running_mean.view(1, -1, 1, 1).to(x.device, x.dtype)
    std = torch.sqrt(running_var.view(1, -1, 1, 1) + eps).to(x.device, x.dtype)
    return mean, std


def normalize_latents(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """Patchified VAE latents (B, 4C, h, w) -> the transformer's: ``(x - mean) / sqrt(var + eps)`` per channel."""
    mean, std = _statistics(x, running_mean, running_var, eps)
    return (x - mean) / std


def denormalize_latents(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """The transformer's latents (B, 4C, h, w) -> patchified VAE latents: ``x * sqrt(var + eps) + mean``."""
    mean, std = _statistics(x, running_mean, running_var, eps)
    return x * std + mean


class LatentBatchNorm(nn.Module):
    """The statistics of the ``BatchNorm2d`` (no affine part) that FLUX.2's autoencoder keeps over its patchified
    latent: the buffers ``running_mean`` and ``running_var``, ``channels`` each, and ``eps``. Only the statistics:
    the pipelines never run the batch norm itself, they normalise with them (:meth:`normalize`, :meth:`denormalize`).
    The training counter ``num_batches_tracked`` that diffusers' module also saves is nothing inference reads; the
    key tables drop it (:mod:`sdlite.weights.flux2_vae_keys`)."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.eps = float(eps)
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return normalize_latents(x, self.running_mean, self.running_var, self.eps)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return denormalize_latents(x, self.running_mean, self.running_var, self.eps)

    def extra_repr(self) -> str:
        return f"{self.running_mean.shape[0]}, eps={self.eps}"


class Flux2VAE(AutoencoderKL):
    """FLUX.2's autoencoder: sdlite's AutoencoderKL on :attr:`Flux2VAEConfig.vae_config` (so ``config``, ``encode``,
    ``encode_moments``, ``decode`` and the engine's tiling work as for any VAE, on the 32-channel latent), with the
    decoder built from the decoder's own widths and ``bn``, the latent statistics. ``flux2_config`` is the
    :class:`Flux2VAEConfig` it was built from."""

    def __init__(self, cfg: Flux2VAEConfig):
        super().__init__(cfg.vae_config)
        if cfg.decoder_widths != cfg.block_out_channels:
            # AutoencoderKL builds its decoder from the encoder's widths; a narrower decoder replaces it
            self.decoder = Decoder(cfg.decoder_vae_config)
        self.flux2_config = cfg
        self.bn = LatentBatchNorm(cfg.patched_channels, cfg.batch_norm_eps)

    def encode_latents(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Image (B, 3, H, W) in [-1, 1], H and W multiples of 16 -> the transformer's latents (B, 128, H/16, W/16):
        the posterior's mean (a sample with ``generator``), patchified and normalised. The pipelines encode reference
        and init images with the mean."""
        return self.bn.normalize(patchify_latents(self.encode(x, generator)))

    def decode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """The transformer's latents (B, 128, h, w) -> image (B, 3, 16h, 16w), roughly in [-1, 1]."""
        return self.decode(unpatchify_latents(self.bn.denormalize(x)))
