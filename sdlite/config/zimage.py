"""Z-Image (Tongyi-MAI, 2025): the config of its denoising transformer, the single-stream DiT "S3-DiT".

One frozen :class:`ZImageConfig` holds every fact the network (:mod:`sdlite.models.zimage`) is built from. Its field
names are those of diffusers' ``ZImageTransformer2DModel`` config (``transformer/config.json``), so a published
folder's config reads in one call (:meth:`ZImageConfig.from_diffusers`); the facts diffusers writes as constants in its
code (the modulation width, the timestep MLP's middle width, the token multiple, the qk-norm and output-norm epsilons)
are class constants here.

The network: the 16-channel FLUX VAE latent is cut into 2 x 2 patches, each a token of 64 values; the caption is the
Qwen3-4B hidden states of the prompt (2560 wide, the second-to-last layer). Both sequences are padded to a multiple of
32 tokens with a learned pad token each. ``n_refiner_layers`` blocks refine the image tokens (modulated by the
timestep: the "noise refiner") and as many refine the caption tokens (unmodulated: the "context refiner"); then
``n_layers`` blocks run over the joined sequence [image, caption]. Every block is pre- and post-normed (RMS) around
both its attention and its SwiGLU feed-forward; a modulated block scales the pre-norms by ``1 + scale`` and gates the
branches by ``tanh(gate)``, four vectors from one Linear on the timestep embedding (no SiLU before it). Positions are
3-axis rotary embeddings: the caption's token j at (1 + j, 0, 0), the image's patch at (caption length + 1, row,
column), a pad image token at (0, 0, 0); each head's channels split ``axes_dims`` among the axes.

The release (Tongyi-MAI/Z-Image-Turbo, ``transformer/config.json``, checked against the published file): 3840 wide,
30 heads of 128, 30 joint and 2 + 2 refiner blocks, FFN 10240, cap_feat_dim 2560, in_channels 16, axes_dims
[32, 48, 48], axes_lens [1536, 512, 512], rope_theta 256, t_scale 1000, norm_eps 1e-5, qk_norm true, patch 2 (frame
patch 1); 6.15B parameters. The base model Tongyi-MAI/Z-Image has the same transformer config. Its scheduler is
FlowMatchEulerDiscreteScheduler with shift 3 and no dynamic shifting (``scheduler/scheduler_config.json``); the VAE is
FLUX.1's (16 channels, scaling 0.3611, shift 0.1159: ``vae/config.json``). The pipeline gives the network
``t = 1 - sigma`` (1000 - timestep, over 1000) and negates its output to get the flow velocity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from . import ConfigError, ModelSpec
from .flux import FLUX_VAE

__all__ = ["ZImageConfig", "ZIMAGE_TURBO", "ZIMAGE_VAE", "ZIMAGE_TURBO_SCHEDULER", "ZIMAGE_FAMILIES", "zimage_spec"]

_CLASS_NAME = "ZImageTransformer2DModel"
_DIFFUSERS_FIELDS = ("all_patch_size", "all_f_patch_size", "in_channels", "dim", "n_layers", "n_refiner_layers",
                     "n_heads", "n_kv_heads", "norm_eps", "qk_norm", "cap_feat_dim", "siglip_feat_dim", "rope_theta",
                     "t_scale", "axes_dims", "axes_lens")
# diffusers' class defaults where they differ from the release (a config.json that leaves a field out gets these)
_DIFFUSERS_DEFAULTS = {"axes_lens": (1024, 512, 512)}
ZIMAGE_FAMILIES = ("z-image-turbo",)


@dataclass(frozen=True)
class ZImageConfig:
    """Z-Image's transformer. ``dim = n_heads * head_dim``; ``axes_dims`` splits a head's channels among the three
    position axes and must add up to ``head_dim``; ``axes_lens`` bounds each axis's positions (the rotary tables
    diffusers precomputes): the caption's length, then patch rows and columns. ``all_patch_size`` /
    ``all_f_patch_size`` are diffusers' lists of (spatial, frame) patch sizes; every release has one, (2, 1)."""

    # fixed in diffusers' code, the same for every config
    ADALN_EMBED_DIM: ClassVar[int] = 256   # the timestep embedding's width (when dim is larger): min(dim, 256)
    T_EMBED_MID: ClassVar[int] = 1024      # the timestep MLP's middle width
    FREQ_CHANNELS: ClassVar[int] = 256     # sinusoidal channels of the timestep
    SEQ_MULTIPLE: ClassVar[int] = 32       # caption and image token counts are padded to a multiple of this
    QK_NORM_EPS: ClassVar[float] = 1e-5    # the per-head RMS norms of queries and keys
    FINAL_NORM_EPS: ClassVar[float] = 1e-6  # the output layer's LayerNorm (no affine)

    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    siglip_feat_dim: int | None = None
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1536, 512, 512)

    def __post_init__(self):
        for name in ("all_patch_size", "all_f_patch_size", "axes_dims", "axes_lens"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, int) else value
            object.__setattr__(self, name, tuple(int(a) for a in value))
        for name in ("in_channels", "dim", "n_layers", "n_heads", "n_kv_heads", "cap_feat_dim"):
            _positive(name, getattr(self, name))
        if isinstance(self.n_refiner_layers, bool) or not isinstance(self.n_refiner_layers, int) \
                or self.n_refiner_layers < 0:
            raise ConfigError(f"Z-Image config field n_refiner_layers={self.n_refiner_layers!r} must be an "
                              "integer >= 0")
        for name in ("norm_eps", "rope_theta", "t_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"Z-Image config field {name}={value!r} must be a positive number")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.qk_norm, bool):
            raise ConfigError(f"Z-Image config field qk_norm={self.qk_norm!r} must be true or false")
        if (self.all_patch_size, self.all_f_patch_size) != ((2,), (1,)):
            raise ConfigError(f"Z-Image config fields all_patch_size={list(self.all_patch_size)}, all_f_patch_size="
                              f"{list(self.all_f_patch_size)} are not supported: every release has [2] and [1]")
        if self.siglip_feat_dim is not None:
            raise ConfigError(f"Z-Image config field siglip_feat_dim={self.siglip_feat_dim!r}: the Omni variant "
                              "(SigLIP image features) is not supported, only text-to-image (siglip_feat_dim null)")
        if self.n_kv_heads != self.n_heads:
            raise ConfigError(f"Z-Image config field n_kv_heads={self.n_kv_heads} differs from n_heads="
                              f"{self.n_heads}: diffusers' transformer has no grouped-query attention")
        if self.dim % self.n_heads:
            raise ConfigError(f"Z-Image config: dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if sum(self.axes_dims) != self.head_dim or any(a < 2 or a % 2 for a in self.axes_dims):
            raise ConfigError(f"Z-Image config field axes_dims={list(self.axes_dims)} must be even sizes adding up "
                              f"to the head width dim / n_heads = {self.head_dim}")
        if len(self.axes_lens) != len(self.axes_dims) or any(n < 1 for n in self.axes_lens):
            raise ConfigError(f"Z-Image config field axes_lens={list(self.axes_lens)} must hold one positive length "
                              f"for each of the {len(self.axes_dims)} axes")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_size(self) -> int:
        return self.all_patch_size[0]

    @property
    def patch_key(self) -> str:
        """The key of the (only) patch embedder and output layer in diffusers' ModuleDicts: ``"2-1"``."""
        return f"{self.all_patch_size[0]}-{self.all_f_patch_size[0]}"

    @property
    def token_values(self) -> int:
        """The values of one image token: latent channels x patch area (16 x 2 x 2 = 64)."""
        return self.in_channels * self.patch_size ** 2 * self.all_f_patch_size[0]

    @property
    def adaln_dim(self) -> int:
        """The width of the timestep embedding that every modulation reads: min(dim, 256)."""
        return min(self.dim, self.ADALN_EMBED_DIM)

    @property
    def ffn_hidden(self) -> int:
        """The SwiGLU feed-forward's inner width: int(dim / 3 * 8), 10240 for the release."""
        return int(self.dim / 3 * 8)

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "ZImageConfig":
        """From a diffusers ``ZImageTransformer2DModel`` config dict. Entries starting with ``_`` are bookkeeping;
        any other field this class does not know is a :class:`ConfigError` naming it. Fields the file leaves out take
        diffusers' class defaults (which differ from the release's in ``axes_lens``)."""
        name = cfg.get("_class_name", _CLASS_NAME)
        if name != _CLASS_NAME:
            raise ConfigError(f"transformer config _class_name={name!r}: expected {_CLASS_NAME!r}")
        unknown = sorted(k for k in cfg if not k.startswith("_") and k not in _DIFFUSERS_FIELDS)
        if unknown:
            raise ConfigError(f"transformer config fields {unknown} are not supported by sdlite's Z-Image "
                              "transformer")
        known = {**_DIFFUSERS_DEFAULTS, **{k: cfg[k] for k in _DIFFUSERS_FIELDS if k in cfg}}
        return cls(**known)

    def to_diffusers(self) -> dict:
        """The diffusers ``ZImageTransformer2DModel`` config of this network (lists where diffusers has lists)."""
        out = {k: getattr(self, k) for k in _DIFFUSERS_FIELDS}
        for k in ("all_patch_size", "all_f_patch_size", "axes_dims", "axes_lens"):
            out[k] = list(out[k])
        return {"_class_name": _CLASS_NAME, **out}


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"Z-Image config field {name}={value!r} must be a positive integer")


# Tongyi-MAI/Z-Image-Turbo, transformer/config.json (diffusers 0.36): the class's defaults, axes_lens [1536, 512, 512]
ZIMAGE_TURBO = ZImageConfig()
# vae/config.json: FLUX.1's autoencoder, the same factors
ZIMAGE_VAE = FLUX_VAE
# scheduler/scheduler_config.json
ZIMAGE_TURBO_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
                          "shift": 3.0, "use_dynamic_shifting": False}


def zimage_spec(transformer: ZImageConfig, *, text, vae=ZIMAGE_VAE, scheduler: dict | None = None):
    """A Z-Image model (:class:`~sdlite.config.ModelSpec`): the transformer, its Qwen3 text encoder ``text`` (a
    :class:`~sdlite.config.qwen.QwenConfig`), FLUX.1's VAE and the Turbo's scheduler unless a folder gives its own."""
    return ModelSpec(family=ZIMAGE_FAMILIES[0], text=text, text2=None, text3=None, unet=None, transformer=transformer,
                     vae=vae, prediction_type="flow", default_size=1024,
                     scheduler=dict(ZIMAGE_TURBO_SCHEDULER if scheduler is None else scheduler))
