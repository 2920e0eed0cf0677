"""FLUX.2's autoencoder (Black Forest Labs, 2025): the config of diffusers' ``AutoencoderKLFlux2`` and its releases.

The network is the KL autoencoder of SD and FLUX.1 (:class:`~sdlite.config.VAEConfig`'s kind: ``block_out_channels``
levels of ResNet blocks, 8x downscale, attention in the mid-blocks) with 32 latent channels, the 1x1 ``quant_conv`` /
``post_quant_conv`` around the latent, and the decoder optionally narrower than the encoder
(``decoder_block_out_channels``: FLUX.2-small-decoder). It has no scaling or shift factor. Instead it carries the
statistics of a ``BatchNorm2d`` over the *patchified* latent (``bn.running_mean`` / ``bn.running_var``, 4 x 32 = 128
channels, ``batch_norm_eps``; no affine part): the FLUX.2 pipelines cut the (B, 32, h, w) latent into 2 x 2 patches,
(B, 128, h/2, w/2), and normalise each of the 128 channels with those statistics before the transformer sees them
(:mod:`sdlite.models.flux2_vae`). ``batch_norm_momentum`` only mattered in training; it is kept so the config
round-trips.

One frozen :class:`Flux2VAEConfig` holds every fact; its field names are those of diffusers' config
(``vae/config.json``), so a published folder's config reads in one call (:meth:`Flux2VAEConfig.from_diffusers`).
:attr:`Flux2VAEConfig.vae_config` and :attr:`~Flux2VAEConfig.decoder_vae_config` describe the encoder and the decoder
as sdlite's :class:`~sdlite.config.VAEConfig`, which the shared encoder and decoder are built from.

The releases (checked against the published files):

- black-forest-labs/FLUX.2-dev ``vae/config.json`` (copies of FLUX.2-klein-4B's and FLUX.2-klein-base-9B's
  ``vae/config.json`` hold the same values; klein uses FLUX.2-dev's autoencoder): block_out_channels
  [128, 256, 512, 512], layers_per_block 2, latent_channels 32, norm_num_groups 32, use_quant_conv and
  use_post_quant_conv true, mid_block_add_attention true, batch_norm_eps 1e-4, batch_norm_momentum 0.1,
  patch_size [2, 2], sample_size 1024, force_upcast true -> :data:`FLUX2_VAE`.
- black-forest-labs/FLUX.2-small-decoder ``config.json``: the same with decoder_block_out_channels
  [96, 192, 384, 384] -> :data:`FLUX2_SMALL_DECODER_VAE`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from . import ConfigError, VAEConfig

__all__ = ["Flux2VAEConfig", "FLUX2_VAE", "FLUX2_SMALL_DECODER_VAE", "FLUX2_VAE_CLASS"]

FLUX2_VAE_CLASS = "AutoencoderKLFlux2"
# every level of the encoder and decoder is a plain ResNet stack (the only kinds the releases use)
_DOWN_BLOCK, _UP_BLOCK, _ACT = "DownEncoderBlock2D", "UpDecoderBlock2D", "silu"
_FIELDS = ("in_channels", "out_channels", "block_out_channels", "decoder_block_out_channels", "layers_per_block",
           "latent_channels", "norm_num_groups", "sample_size", "force_upcast", "use_quant_conv", "use_post_quant_conv",
           "mid_block_add_attention", "batch_norm_eps", "batch_norm_momentum", "patch_size")
# config.json entries that are not fields: checked, then implied by the fields
_CHECKED = ("down_block_types", "up_block_types", "act_fn")


@dataclass(frozen=True)
class Flux2VAEConfig:
    """FLUX.2's ``AutoencoderKLFlux2``. The defaults are diffusers' (those of the releases).

    ``block_out_channels``: the encoder's width per level (and the decoder's, mirrored, unless
    ``decoder_block_out_channels`` gives its own). The latent is ``latent_channels`` x H/8 x W/8 for
    ``2 ** (levels - 1) = 8``; the transformer sees it patchified, ``4 * latent_channels`` x H/16 x W/16, normalised
    by the stored batch-norm statistics with ``batch_norm_eps``."""

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    decoder_block_out_channels: tuple[int, ...] | None = None
    layers_per_block: int = 2
    latent_channels: int = 32
    norm_num_groups: int = 32
    sample_size: int = 1024
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    batch_norm_eps: float = 1e-4
    batch_norm_momentum: float = 0.1
    patch_size: tuple[int, int] = (2, 2)
    # the batch-norm statistics of the patchified latent (``bn.running_mean`` / ``bn.running_var``, 128 values each),
    # read from the weights when a model is opened: the sampler's latent is normalised by them. Not diffusers config
    # fields (its config has none; they are weights); None where no weights were read (a config alone)
    latents_mean: tuple[float, ...] | None = None
    latents_var: tuple[float, ...] | None = None

    def __post_init__(self):
        for name in ("latents_mean", "latents_var"):
            value = getattr(self, name)
            if value is not None:
                value = tuple(float(v) for v in value)
                if len(value) != self.patched_channels:
                    raise ConfigError(f"FLUX.2 VAE {name} has {len(value)} values: the batch-norm statistics cover "
                                      f"the {self.patched_channels} channels of the patchified latent")
                object.__setattr__(self, name, value)
        for name in ("block_out_channels", "decoder_block_out_channels", "patch_size"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise ConfigError(f"FLUX.2 VAE config field {name}={value!r} must be a list of integers")
                object.__setattr__(self, name, tuple(value))
        for name in ("in_channels", "out_channels", "layers_per_block", "latent_channels", "norm_num_groups",
                     "sample_size"):
            _positive(name, getattr(self, name))
        for name in ("force_upcast", "use_quant_conv", "use_post_quant_conv", "mid_block_add_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"FLUX.2 VAE config field {name}={getattr(self, name)!r} must be true or false")
        if not self.mid_block_add_attention:
            raise ConfigError("FLUX.2 VAE config field mid_block_add_attention=False is not supported: sdlite's "
                              "autoencoder mid-blocks always have their attention (as every release does)")
        if self.patch_size != (2, 2):
            raise ConfigError(f"FLUX.2 VAE config field patch_size={list(self.patch_size)} is not supported: the "
                              "FLUX.2 pipelines patchify the latent 2 x 2, so the batch-norm statistics cover "
                              "4 x latent_channels channels")
        for name, value in (("batch_norm_eps", self.batch_norm_eps), ("batch_norm_momentum", self.batch_norm_momentum)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"FLUX.2 VAE config field {name}={value!r} must be a number >= 0")
        if not self.batch_norm_eps > 0:
            raise ConfigError(f"FLUX.2 VAE config field batch_norm_eps={self.batch_norm_eps!r} must be > 0: the "
                              "normalisation divides by sqrt(running_var + eps)")
        self._check_widths("block_out_channels", self.block_out_channels)
        if self.decoder_block_out_channels is not None:
            self._check_widths("decoder_block_out_channels", self.decoder_block_out_channels)
            if len(self.decoder_block_out_channels) != len(self.block_out_channels):
                raise ConfigError(f"FLUX.2 VAE config field decoder_block_out_channels="
                                  f"{list(self.decoder_block_out_channels)} must have one width per level of "
                                  f"block_out_channels={list(self.block_out_channels)}")

    def _check_widths(self, name: str, widths: tuple) -> None:
        if not widths:
            raise ConfigError(f"FLUX.2 VAE config field {name} must name at least one level")
        for w in widths:
            _positive(name, w)
            if w % self.norm_num_groups:
                raise ConfigError(f"FLUX.2 VAE config field {name}={list(widths)}: width {w} is not divisible by "
                                  f"norm_num_groups={self.norm_num_groups}")

    # --- what the fields imply --------------------------------------------------------------------------------

    @property
    def downscale(self) -> int:
        """Image pixels per VAE latent pixel (8 for the releases)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def patched_channels(self) -> int:
        """Channels of the patchified latent the transformer sees (and of the batch-norm statistics): 128."""
        return self.patch_size[0] * self.patch_size[1] * self.latent_channels

    @property
    def patched_downscale(self) -> int:
        """Image pixels per patchified latent pixel: 16 (image sizes must be multiples of it)."""
        return self.downscale * self.patch_size[0]

    # what code written for :class:`~sdlite.config.VAEConfig` reads of a model's VAE (sizes, memory estimates)

    @property
    def block_channels(self) -> tuple[int, ...]:
        return self.block_out_channels

    @property
    def norm_groups(self) -> int:
        return self.norm_num_groups

    scaling_factor = 1.0   # no scale or shift: the batch-norm statistics normalise the latent instead
    shift_factor = 0.0

    @property
    def decoder_widths(self) -> tuple[int, ...]:
        """The decoder's width per level, in the encoder's order (top resolution first)."""
        return self.decoder_block_out_channels or self.block_out_channels

    @property
    def vae_config(self) -> VAEConfig:
        """The encoder (and the latent) as sdlite's :class:`~sdlite.config.VAEConfig`: what the shared
        :class:`~sdlite.models.vae.AutoencoderKL` machinery (encoder, decoder, tiling) reads. No scaling or shift:
        FLUX.2 normalises with the batch-norm statistics instead."""
        return VAEConfig(in_channels=self.in_channels, out_channels=self.out_channels,
                         latent_channels=self.latent_channels, block_channels=self.block_out_channels,
                         layers_per_block=self.layers_per_block, norm_groups=self.norm_num_groups, scaling_factor=1.0,
                         sample_size=self.sample_size, force_upcast=self.force_upcast, shift_factor=0.0,
                         use_quant_conv=self.use_quant_conv, use_post_quant_conv=self.use_post_quant_conv)

    @property
    def decoder_vae_config(self) -> VAEConfig:
        """:attr:`vae_config` with the decoder's widths (the same config unless ``decoder_block_out_channels``)."""
        return replace(self.vae_config, block_channels=self.decoder_widths)

    # --- diffusers' config.json -------------------------------------------------------------------------------

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "Flux2VAEConfig":
        """From a diffusers ``AutoencoderKLFlux2`` config dict (``vae/config.json``). Entries starting with ``_`` are
        bookkeeping; block types and the activation are checked against the only ones the releases use; any other
        entry this class does not know is a :class:`ConfigError` naming it. Fields left out take diffusers'
        defaults."""
        name = cfg.get("_class_name", FLUX2_VAE_CLASS)
        if name != FLUX2_VAE_CLASS:
            raise ConfigError(f"VAE config _class_name={name!r}: expected {FLUX2_VAE_CLASS!r}")
        unknown = sorted(k for k in cfg if not k.startswith("_") and k not in _FIELDS and k not in _CHECKED)
        if unknown:
            raise ConfigError(f"FLUX.2 VAE config fields {unknown} are not supported by sdlite's FLUX.2 autoencoder")
        for key, kind in (("down_block_types", _DOWN_BLOCK), ("up_block_types", _UP_BLOCK)):
            for block in cfg.get(key) or ():
                if block != kind:
                    raise ConfigError(f"FLUX.2 VAE config field {key}: block type {block!r} is not supported "
                                      f"(expected {kind!r})")
        if cfg.get("act_fn", _ACT) != _ACT:
            raise ConfigError(f"FLUX.2 VAE config field act_fn={cfg['act_fn']!r} is not supported (expected 'silu')")
        out = cls(**{k: cfg[k] for k in _FIELDS if k in cfg})
        levels = len(out.block_out_channels)
        for key in ("down_block_types", "up_block_types"):
            if key in cfg and len(cfg[key]) != levels:
                raise ConfigError(f"FLUX.2 VAE config field {key} has {len(cfg[key])} entries for {levels} levels of "
                                  f"block_out_channels={list(out.block_out_channels)}")
        return out

    def to_diffusers(self) -> dict:
        """This autoencoder's ``vae/config.json`` as diffusers writes it (``AutoencoderKLFlux2.from_config`` reads
        it; ``force_upcast`` is a pipeline hint its constructor does not take)."""
        levels = len(self.block_out_channels)
        out = {"_class_name": FLUX2_VAE_CLASS, "act_fn": _ACT, "down_block_types": [_DOWN_BLOCK] * levels,
               "up_block_types": [_UP_BLOCK] * levels}
        for k in _FIELDS:
            value = getattr(self, k)
            out[k] = list(value) if isinstance(value, tuple) else value
        return out


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"FLUX.2 VAE config field {name}={value!r} must be a positive integer")


# black-forest-labs/FLUX.2-dev vae/config.json (the klein releases' vae/config.json: the same values)
FLUX2_VAE = Flux2VAEConfig()
# black-forest-labs/FLUX.2-small-decoder config.json: the released encoder with a narrower decoder
FLUX2_SMALL_DECODER_VAE = Flux2VAEConfig(decoder_block_out_channels=(96, 192, 384, 384))
