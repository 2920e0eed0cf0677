"""Qwen-Image's VAE (``AutoencoderKLQwenImage``): the facts of the causal 3D autoencoder (Wan-2.1's design) that
Qwen-Image and every Qwen-Image-Edit release share, run by sdlite on single frames only.

One frozen :class:`QwenImageVAEConfig` holds them under diffusers' field names (``vae/config.json``), so a folder's
config reads in one call (:meth:`QwenImageVAEConfig.from_diffusers`).

The network (:mod:`sdlite.models.qwenimage_vae`): causal 3D convolutions (padded in time on the past side only), RMS
norms over the channels (``F.normalize`` times sqrt(C) and a learned ``gamma``), residual blocks, one single-head
attention in the middle of each half, ``base_dim * dim_mult`` channels per level, three 2x spatial down / up samplings
(``temperal_downsample`` marks those that would also halve / double time on video), ``z_dim`` = 16 latent channels at
1/8 of the image. The encoder ends in 2 x z_dim channels (mean and log-variance) through ``quant_conv``; the decoder
starts with ``post_quant_conv``. For one frame every causal convolution sees its frame and two zero frames before it,
and the temporal resamplers' own convolutions (``time_conv``) are not run: the single-frame network is a 2D one with
each 3D kernel's last temporal tap.

The pipelines normalise the latent per channel: the sampler's latent is ``(z - latents_mean) / latents_std`` (the edit
pipelines' encoding) and the decoder gets ``z / (1 / latents_std) + latents_mean`` (the pipelines' decoding).

Where the numbers come from: Qwen/Qwen-Image ``vae/config.json`` (base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4],
num_res_blocks 2, attn_scales [], temperal_downsample [false, true, true], dropout 0.0 and the two 16-value
statistics below), which are also diffusers' class defaults; the Qwen-Image-Edit releases' ``vae`` folders hold the
same file, and ComfyUI's ``qwen_image_vae.safetensors`` is the same network (Wan 2.1's VAE in its original names).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ConfigError

__all__ = ["QwenImageVAEConfig", "QWEN_IMAGE_VAE", "QWEN_IMAGE_LATENTS_MEAN", "QWEN_IMAGE_LATENTS_STD"]

_CLASS_NAME = "AutoencoderKLQwenImage"
_FIELDS = ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales", "temperal_downsample", "dropout",
           "input_channels", "latents_mean", "latents_std")

# Qwen/Qwen-Image vae/config.json (and diffusers' class defaults)
QWEN_IMAGE_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715,
                           0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
QWEN_IMAGE_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652,
                          1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


def _numbers(value, name: str) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"Qwen-Image VAE config field {name}={value!r} must be a list")
    return tuple(value)


@dataclass(frozen=True)
class QwenImageVAEConfig:
    """The VAE: ``base_dim * m`` channels for each ``m`` of ``dim_mult`` (one level each, a 2x spatial resampling
    between levels), ``num_res_blocks`` residual blocks a level (the decoder one more), ``attn_scales`` empty (no
    attention outside the middle blocks, as in the release), ``z_dim`` latent
    channels and their per-channel statistics. ``temperal_downsample`` changes nothing on one frame but is kept for the
    weights' shapes (the temporal resamplers' ``time_conv``)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    input_channels: int = 3
    latents_mean: tuple[float, ...] = QWEN_IMAGE_LATENTS_MEAN
    latents_std: tuple[float, ...] = QWEN_IMAGE_LATENTS_STD

    def __post_init__(self):
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            object.__setattr__(self, name, _numbers(getattr(self, name), name))
        for name in ("base_dim", "z_dim", "num_res_blocks", "input_channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Qwen-Image VAE config field {name}={value!r} must be a positive integer")
        if not self.dim_mult or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.dim_mult):
            raise ConfigError(f"Qwen-Image VAE config field dim_mult={list(self.dim_mult)} must be positive integers")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1 \
                or not all(isinstance(v, bool) for v in self.temperal_downsample):
            raise ConfigError(f"Qwen-Image VAE config field temperal_downsample={list(self.temperal_downsample)} must "
                              f"be {len(self.dim_mult) - 1} true/false values (one per resampling)")
        for m in self.dim_mult[1:]:
            if (self.base_dim * m) % 2:
                raise ConfigError(f"Qwen-Image VAE config: {self.base_dim * m} channels cannot be halved by the "
                                  "decoder's upsamplers")
        for name in ("latents_mean", "latents_std"):
            values = getattr(self, name)
            if len(values) != self.z_dim or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
                raise ConfigError(f"Qwen-Image VAE config field {name} has {len(values)} values: expected {self.z_dim} "
                                  "numbers (one per latent channel)")
        if any(not v > 0 for v in self.latents_std):
            raise ConfigError(f"Qwen-Image VAE config field latents_std={list(self.latents_std)} must be positive")
        if self.attn_scales:
            raise ConfigError(f"Qwen-Image VAE config field attn_scales={list(self.attn_scales)} is not supported: no "
                              "release has attention outside the middle blocks (and diffusers' encoder cannot run it)")
        if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool):
            raise ConfigError(f"Qwen-Image VAE config field dropout={self.dropout!r} must be a number")

    @property
    def scale_factor(self) -> int:
        """Image pixels per latent position along each side (8)."""
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def latent_channels(self) -> int:
        return self.z_dim

    @property
    def downscale(self) -> int:
        """The same as :attr:`scale_factor` under the name the engine's budget reads for every VAE."""
        return self.scale_factor

    @property
    def block_channels(self) -> tuple[int, ...]:
        """Each level's channels (``base_dim * m``), for the engine's memory estimates."""
        return tuple(self.base_dim * m for m in self.dim_mult)

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "QwenImageVAEConfig":
        """From a diffusers ``AutoencoderKLQwenImage`` config dict; entries starting with ``_`` are bookkeeping, any
        other unknown field is a :class:`ConfigError` naming it; fields left out take diffusers' class defaults."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"a Qwen-Image VAE config is a JSON object, got {type(cfg).__name__}")
        name = cfg.get("_class_name", _CLASS_NAME)
        if name != _CLASS_NAME:
            raise ConfigError(f"VAE config _class_name={name!r}: expected {_CLASS_NAME!r}")
        unknown = sorted(k for k in cfg if not k.startswith("_") and k not in _FIELDS)
        if unknown:
            raise ConfigError(f"VAE config fields {unknown} are not supported by sdlite's Qwen-Image VAE")
        return cls(**{k: cfg[k] for k in _FIELDS if k in cfg})

    def to_diffusers(self) -> dict:
        """The diffusers ``AutoencoderKLQwenImage`` config (lists where diffusers writes lists)."""
        out = {k: getattr(self, k) for k in _FIELDS}
        for k in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            out[k] = list(out[k])
        return {"_class_name": _CLASS_NAME, **out}


# Qwen/Qwen-Image vae/config.json: diffusers' class defaults
QWEN_IMAGE_VAE = QwenImageVAEConfig()
