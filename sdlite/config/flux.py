"""FLUX.1 (Black Forest Labs, 2024): the config of its denoising transformer and the released models as whole specs.

One frozen :class:`FluxConfig` holds every fact the network (:mod:`sdlite.models.flux`) is built from. Its field
names are those of diffusers' ``FluxTransformer2DModel`` config (``transformer/config.json``), so a published folder's
config reads in one call (:meth:`FluxConfig.from_diffusers`).

The network: the 16-channel latent is cut into 2 x 2 patches, each a token of 64 values (``in_channels``), and the
T5 hidden states are the text tokens; ``num_layers`` double-stream blocks (each stream its own weights, one joint
attention) are followed by ``num_single_layers`` single-stream blocks over the joined sequence (attention and MLP in
parallel). Positions enter as rotary embeddings over three axes of ids (``axes_dims_rope``: 16 channels for an axis
that is 0 everywhere, 56 for the row, 56 for the column of each head's 128). The conditioning vector is the timestep's
embedding, plus the pooled CLIP-L text's, plus (dev, ``guidance_embeds``) the embedding of the distilled guidance
scale.

The releases (black-forest-labs/FLUX.1-dev and FLUX.1-schnell, diffusers folders): 19 double and 38 single blocks of
24 heads of 128 (3072 wide), 11.9B parameters; dev with guidance embedding, schnell without. Their scheduler is
FlowMatchEulerDiscreteScheduler: dev with the resolution-dependent shift (``use_dynamic_shifting``: mu from the image's
token count, 0.5 at 256 tokens to 1.15 at 4096), schnell with none (shift 1). The VAE is SD3's kind with FLUX's own
factors (scaling 0.3611, shift 0.1159). CLIP-L gives only its pooled output; T5-XXL reads 512 tokens (dev) or 256
(schnell).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ConfigError, ModelSpec, TextEncoderConfig, VAEConfig
from .t5 import T5_XXL

__all__ = ["FluxConfig", "FLUX_DEV", "FLUX_SCHNELL", "FLUX_VAE", "FLUX_TEXT_L", "FLUX_DEV_SCHEDULER",
           "FLUX_SCHNELL_SCHEDULER", "FLUX_DEV_MODEL", "FLUX_SCHNELL_MODEL", "FLUX_FAMILIES", "FLUX_PRESETS",
           "flux_spec"]

_DIFFUSERS_FIELDS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers",
                     "attention_head_dim", "num_attention_heads", "joint_attention_dim", "pooled_projection_dim",
                     "guidance_embeds", "axes_dims_rope")
_CLASS_NAME = "FluxTransformer2DModel"
FLUX_FAMILIES = ("flux-dev", "flux-schnell", "flux-kontext")   # Kontext: dev's network, an editing release


@dataclass(frozen=True)
class FluxConfig:
    """FLUX.1's transformer. ``hidden = num_attention_heads * attention_head_dim`` is the width of both streams;
    ``axes_dims_rope`` splits each head's channels among the three id axes and must add up to
    ``attention_head_dim``. ``in_channels`` counts a token's values (latent channels x patch area: 16 x 2 x 2);
    ``patch_size`` is diffusers' (1: the pipeline packs the 2 x 2 patches itself)."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int = 64
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(int(a) for a in self.axes_dims_rope))
        for name in ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                     "num_attention_heads", "joint_attention_dim", "pooled_projection_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"FLUX config field {name}={value!r} must be a positive integer")
        if isinstance(self.num_single_layers, bool) or not isinstance(self.num_single_layers, int) \
                or self.num_single_layers < 0:
            raise ConfigError(f"FLUX config field num_single_layers={self.num_single_layers!r} must be an integer >= 0")
        if not isinstance(self.guidance_embeds, bool):
            raise ConfigError(f"FLUX config field guidance_embeds={self.guidance_embeds!r} must be true or false")
        if self.patch_size != 1:
            raise ConfigError(f"FLUX config field patch_size={self.patch_size} is not supported: every release packs "
                              "2x2 latent patches in the pipeline and has patch_size 1")
        if sum(self.axes_dims_rope) != self.attention_head_dim or any(a < 2 or a % 2 for a in self.axes_dims_rope):
            raise ConfigError(f"FLUX config field axes_dims_rope={list(self.axes_dims_rope)} must be even sizes "
                              f"adding up to attention_head_dim={self.attention_head_dim}")

    @property
    def hidden(self) -> int:
        """The token width of both streams."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def latent_channels(self) -> int:
        """The VAE latent's channels (a token holds 2 x 2 of them)."""
        return self.in_channels // 4

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "FluxConfig":
        """From a diffusers ``FluxTransformer2DModel`` config dict. Entries starting with ``_`` are bookkeeping; any
        other field this class does not know is a :class:`ConfigError` naming it. Fields the file leaves out take
        diffusers' defaults (those of the releases)."""
        name = cfg.get("_class_name", _CLASS_NAME)
        if name != _CLASS_NAME:
            raise ConfigError(f"transformer config _class_name={name!r}: expected {_CLASS_NAME!r}")
        unknown = sorted(k for k in cfg if not k.startswith("_") and k not in _DIFFUSERS_FIELDS)
        if unknown:
            raise ConfigError(f"transformer config fields {unknown} are not supported by sdlite's FLUX transformer")
        known = {k: cfg[k] for k in _DIFFUSERS_FIELDS if k in cfg}
        if known.get("out_channels", 0) is None:
            known["out_channels"] = known.get("in_channels", cls.in_channels)
        if "axes_dims_rope" in known:
            known["axes_dims_rope"] = tuple(known["axes_dims_rope"])
        return cls(**known)

    def to_diffusers(self) -> dict:
        """The diffusers ``FluxTransformer2DModel`` config of this network."""
        out = {k: getattr(self, k) for k in _DIFFUSERS_FIELDS}
        out["axes_dims_rope"] = list(self.axes_dims_rope)
        return {"_class_name": _CLASS_NAME, **out}


# black-forest-labs/FLUX.1-dev and FLUX.1-schnell, transformer/config.json
FLUX_DEV = FluxConfig(guidance_embeds=True)
FLUX_SCHNELL = FluxConfig(guidance_embeds=False)

# text_encoder: CLIPTextModel (CLIP ViT-L/14), only its pooled output is read; no projection
FLUX_TEXT_L = TextEncoderConfig()
# vae/config.json: SD3's 16-channel AutoencoderKL with FLUX's factors
FLUX_VAE = VAEConfig(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                     use_post_quant_conv=False, sample_size=1024)
# scheduler/scheduler_config.json of each release
FLUX_DEV_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                      "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                      "max_image_seq_len": 4096}
FLUX_SCHNELL_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
                          "shift": 1.0, "use_dynamic_shifting": False, "base_shift": 0.5, "max_shift": 1.15,
                          "base_image_seq_len": 256, "max_image_seq_len": 4096}


def flux_spec(transformer: FluxConfig, *, text=FLUX_TEXT_L, text3=T5_XXL, vae: VAEConfig = FLUX_VAE,
              scheduler: dict | None = None, kontext: bool = False) -> ModelSpec:
    """A FLUX.1 model: dev when its transformer embeds the guidance scale, else schnell. ``kontext``: a FLUX.1
    Kontext release (dev's network trained to edit from a reference image; family ``flux-kontext``), known only from
    its folder's pipeline class or its file's name. The scheduler defaults to the release's."""
    family = "flux-dev" if transformer.guidance_embeds else "flux-schnell"
    if kontext:
        if not transformer.guidance_embeds:
            raise ConfigError("a FLUX.1 Kontext model embeds the guidance scale (dev's network); this transformer "
                              "has no guidance embedding")
        family = "flux-kontext"
    if scheduler is None:
        scheduler = FLUX_DEV_SCHEDULER if transformer.guidance_embeds else FLUX_SCHNELL_SCHEDULER
    return ModelSpec(family=family, text=text, text2=None, text3=text3, unet=None, transformer=transformer,
                     vae=vae, prediction_type="flow", default_size=1024, scheduler=dict(scheduler))


FLUX_DEV_MODEL = flux_spec(FLUX_DEV)
FLUX_SCHNELL_MODEL = flux_spec(FLUX_SCHNELL)
FLUX_PRESETS = {"flux-dev": FLUX_DEV_MODEL, "flux-schnell": FLUX_SCHNELL_MODEL}
