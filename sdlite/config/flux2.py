"""FLUX.2 (Black Forest Labs, 2025-2026): the config of its denoising transformer, shared by [klein] and [dev].

One frozen :class:`Flux2Config` holds every fact the network (:mod:`sdlite.models.flux2`) is built from. Its field
names are those of diffusers' ``Flux2Transformer2DModel`` config (``transformer/config.json``), so a published folder's
config reads in one call (:meth:`Flux2Config.from_diffusers`), and a file that leaves a field out gets diffusers' class
default, which are FLUX.2 [dev]'s numbers.

The network (the same class for every release; only the sizes differ):

* The VAE (``AutoencoderKLFlux2``) has 32 latent channels. The pipeline cuts its latent into 2 x 2 patches of
  128 values (channels outermost), normalises them with the VAE's batch-norm statistics, and the transformer sees one
  token of ``in_channels`` = 128 values per patch (``patch_size`` 1: the patching is the pipeline's). The sampler's
  latent is therefore (B, 128, H/16, W/16).
* The text is the stacked hidden states of an LLM: Qwen3's layers 9, 18 and 27 for [klein] (3 x 2560 = 7680 wide for
  Qwen3-4B, 3 x 4096 = 12288 for Qwen3-8B), Mistral Small 3.2's layers 10, 20 and 30 for [dev] (3 x 5120 = 15360):
  ``joint_attention_dim``. There is no pooled text vector.
* The conditioning vector is an MLP on the timestep's sinusoidal embedding (``timestep_guidance_channels`` wide), plus
  (``guidance_embeds``: [dev] only) one on the distilled guidance scale's. Three modulations are computed from it once
  and shared by every block: one for the image stream and one for the text stream of all double-stream blocks (shift,
  scale, gate of the attention and of the MLP: 6 x width), one for all single-stream blocks (3 x width). No Linear of
  the network has a bias.
* ``num_layers`` double-stream blocks (each stream its own weights, one joint attention over [text, image]), then
  ``num_single_layers`` single-stream blocks (attention and MLP side by side from one fused projection). The MLPs are
  SwiGLU with an inner width ``int(width * mlp_ratio)``. Every norm is a LayerNorm without affine (``eps``), the qk
  norms RMS norms with a learned scale.
* Positions are rotary over four axes of ids (t, h, w, l) (``axes_dims_rope`` channels each, ``rope_theta``): an image
  token at (0, row, column, 0), text token j at (0, 0, 0, j), the patches of reference image i (editing) at
  (10 + 10 i, row, column, 0).

Where each release's numbers come from (diffusers' own converter of BFL's files,
``scripts/convert_flux2_to_diffusers.py`` in huggingface/diffusers, ``get_flux2_transformer_config``, agrees with each;
ComfyUI's ``comfy/model_detection.py`` and stable-diffusion.cpp's ``flux.hpp`` read the same sizes from the weights'
shapes and fix the rest: axes (32, 32, 32, 32), theta 2000, MLP ratio 3, 128 values in and out, no biases):

* black-forest-labs/FLUX.2-klein-4B, ``transformer/config.json``: 5 double and 20 single blocks, 24 heads of 128 (3072
  wide), joint_attention_dim 7680, no guidance embedding, ``out_channels`` null. FLUX.2-klein-base-4B's file is
  reported identical (a third-party copy of both files; the base model differs only in the pipeline's
  ``is_distilled``).
* black-forest-labs/FLUX.2-klein-9B, ``transformer/config.json``: 8 double and 24 single blocks, 32 heads of 128 (4096
  wide), joint_attention_dim 12288, no guidance embedding. Not checked against the (gated) published file itself:
  the numbers are diffusers' converter's, the same in two third-party configs and in a listing of the released file's
  201 tensors (9 global + 8 x 12 double + 24 x 4 single). FLUX.2-klein-base-9B and the 9B KV variant are assumed to
  have the same transformer (unverified).
* black-forest-labs/FLUX.2-dev, ``transformer/config.json``: 8 double and 48 single blocks, 48 heads of 128 (6144
  wide), joint_attention_dim 15360, with the guidance embedding: diffusers' class defaults, which its converter uses
  for dev.

All three: in_channels 128, patch_size 1, attention_head_dim 128, timestep_guidance_channels 256, mlp_ratio 3.0,
axes_dims_rope (32, 32, 32, 32), rope_theta 2000, eps 1e-6 (diffusers' converter and class defaults).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ConfigError

__all__ = ["Flux2Config", "FLUX2_FAMILIES", "FLUX2_KLEIN_SCHEDULER", "flux2_spec", "FLUX2_KLEIN_4B", "FLUX2_KLEIN_9B", "FLUX2_DEV", "FLUX2_PRESETS", "FLUX2_RELEASE_AXES",
           "FLUX2_RELEASE_THETA", "FLUX2_RELEASE_EPS", "REFERENCE_TIME_STEP"]

_CLASS_NAME = "Flux2Transformer2DModel"
_DIFFUSERS_FIELDS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers",
                     "attention_head_dim", "num_attention_heads", "joint_attention_dim", "timestep_guidance_channels",
                     "mlp_ratio", "axes_dims_rope", "rope_theta", "eps", "guidance_embeds")
_INTEGER_FIELDS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                   "num_attention_heads", "joint_attention_dim", "timestep_guidance_channels")
_NUMBER_FIELDS = ("mlp_ratio", "rope_theta", "eps")

# what every release has and the weights' shapes do not show (the rotary split, its base, the norms' epsilon)
FLUX2_RELEASE_AXES = (32, 32, 32, 32)
FLUX2_RELEASE_THETA = 2000.0
FLUX2_RELEASE_EPS = 1e-6
# the t id of reference image i is REFERENCE_TIME_STEP * (i + 1) (diffusers' Flux2Pipeline._prepare_image_ids "scale",
# ComfyUI's "ref_index_scale", stable-diffusion.cpp's "ref_index_scale")
REFERENCE_TIME_STEP = 10


@dataclass(frozen=True)
class Flux2Config:
    """FLUX.2's transformer. ``hidden = num_attention_heads * attention_head_dim`` is the width of both streams;
    ``axes_dims_rope`` splits each head's channels among the four id axes (t, h, w, l) and must add up to
    ``attention_head_dim``. ``in_channels`` counts a token's values (32 latent channels x a 2 x 2 patch);
    ``patch_size`` is diffusers' (1: the pipeline packs the patches itself). The defaults are diffusers' class
    defaults, i.e. FLUX.2 [dev]."""

    patch_size: int = 1
    in_channels: int = 128
    out_channels: int = 128
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = FLUX2_RELEASE_AXES
    rope_theta: float = FLUX2_RELEASE_THETA
    eps: float = FLUX2_RELEASE_EPS
    guidance_embeds: bool = True

    def __post_init__(self):
        axes = self.axes_dims_rope
        if isinstance(axes, (str, bytes)) or not hasattr(axes, "__iter__"):
            raise ConfigError(f"FLUX.2 config field axes_dims_rope={axes!r} must be a list of even sizes")
        object.__setattr__(self, "axes_dims_rope", tuple(axes))
        for name in _INTEGER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"FLUX.2 config field {name}={value!r} must be a positive integer")
        single = self.num_single_layers
        if isinstance(single, bool) or not isinstance(single, int) or single < 0:
            raise ConfigError(f"FLUX.2 config field num_single_layers={single!r} must be an integer >= 0")
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"FLUX.2 config field {name}={value!r} must be a positive number")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.guidance_embeds, bool):
            raise ConfigError(f"FLUX.2 config field guidance_embeds={self.guidance_embeds!r} must be true or false")
        if self.patch_size != 1:
            raise ConfigError(f"FLUX.2 config field patch_size={self.patch_size} is not supported: every release "
                              "packs 2x2 latent patches in the pipeline and has patch_size 1")
        if any(isinstance(a, bool) or not isinstance(a, int) or a < 2 or a % 2 for a in self.axes_dims_rope) \
                or sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ConfigError(f"FLUX.2 config field axes_dims_rope={list(self.axes_dims_rope)} must be even sizes "
                              f"adding up to attention_head_dim={self.attention_head_dim}")
        if self.mlp_hidden < 1:
            raise ConfigError(f"FLUX.2 config field mlp_ratio={self.mlp_ratio} leaves no MLP channels "
                              f"(int({self.hidden} * {self.mlp_ratio}) = {self.mlp_hidden})")

    @property
    def hidden(self) -> int:
        """The token width of both streams."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        """The SwiGLU MLPs' inner width: ``int(hidden * mlp_ratio)`` (9216 for klein-4B)."""
        return int(self.hidden * self.mlp_ratio)

    @property
    def latent_channels(self) -> int:
        """The VAE latent's channels, as the pipeline reads them: ``in_channels // 4`` (32)."""
        return self.in_channels // 4

    @property
    def axes(self) -> int:
        """How many id axes the rotary positions have (4: t, h, w, l)."""
        return len(self.axes_dims_rope)

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "Flux2Config":
        """From a diffusers ``Flux2Transformer2DModel`` config dict. Entries starting with ``_`` are bookkeeping; any
        other field this class does not know is a :class:`ConfigError` naming it. Fields the file leaves out take
        diffusers' class defaults (FLUX.2 [dev]'s); ``out_channels`` null means ``in_channels``."""
        name = cfg.get("_class_name", _CLASS_NAME)
        if name != _CLASS_NAME:
            raise ConfigError(f"transformer config _class_name={name!r}: expected {_CLASS_NAME!r}")
        unknown = sorted(k for k in cfg if not k.startswith("_") and k not in _DIFFUSERS_FIELDS)
        if unknown:
            raise ConfigError(f"transformer config fields {unknown} are not supported by sdlite's FLUX.2 transformer")
        known = {k: cfg[k] for k in _DIFFUSERS_FIELDS if k in cfg}
        if known.get("out_channels", 0) is None:
            known["out_channels"] = known.get("in_channels", cls.in_channels)
        elif "out_channels" not in known and "in_channels" in known:
            known["out_channels"] = known["in_channels"]      # diffusers: out_channels or in_channels
        return cls(**known)

    def to_diffusers(self) -> dict:
        """The diffusers ``Flux2Transformer2DModel`` config of this network (lists where diffusers writes lists)."""
        out = {k: getattr(self, k) for k in _DIFFUSERS_FIELDS}
        out["axes_dims_rope"] = list(self.axes_dims_rope)
        return {"_class_name": _CLASS_NAME, **out}


# black-forest-labs/FLUX.2-klein-4B (and FLUX.2-klein-base-4B), transformer/config.json: Qwen3-4B's three layers
FLUX2_KLEIN_4B = Flux2Config(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                             guidance_embeds=False)
# black-forest-labs/FLUX.2-klein-9B (and, unverified, FLUX.2-klein-base-9B), transformer/config.json: Qwen3-8B's three
# layers; the numbers of diffusers' converter (the published file is gated, see the module's notes)
FLUX2_KLEIN_9B = Flux2Config(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                             guidance_embeds=False)
# black-forest-labs/FLUX.2-dev, transformer/config.json: diffusers' class defaults; Mistral Small 3.2's three layers
FLUX2_DEV = Flux2Config()

FLUX2_PRESETS = {"flux2-klein-4b": FLUX2_KLEIN_4B, "flux2-klein-9b": FLUX2_KLEIN_9B, "flux2-dev": FLUX2_DEV}


# the model families: a step-distilled klein (4 steps, no CFG) and a klein base model (CFG, 50 steps); the two have
# the same transformer shapes, told apart by the pipeline's ``is_distilled`` (model_index.json) or a file's name
FLUX2_FAMILIES = ("flux2-klein", "flux2-klein-base")
# black-forest-labs/FLUX.2-klein-4B, scheduler/scheduler_config.json: FLUX.1's dynamic shifting; the pipeline sets mu
# itself from the image's token count and the step count (Flux2KleinPipeline's compute_empirical_mu)
FLUX2_KLEIN_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                         "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                         "base_image_seq_len": 256, "max_image_seq_len": 4096, "time_shift_type": "exponential"}


def flux2_spec(transformer: Flux2Config, *, text, vae, distilled: bool = True, scheduler: dict | None = None):
    """A FLUX.2 [klein] model (:class:`~sdlite.config.ModelSpec`): the transformer, its Qwen3 text encoder ``text``
    (a :class:`~sdlite.config.qwen.QwenConfig`), the VAE (a :class:`~sdlite.config.flux2_vae.Flux2VAEConfig` with its
    latent statistics), ``distilled`` (the 4-step models) or a base model, and klein's scheduler unless a folder gives
    its own."""
    from . import ModelSpec

    return ModelSpec(family=FLUX2_FAMILIES[0 if distilled else 1], text=text, text2=None, text3=None, unet=None,
                     transformer=transformer, vae=vae, prediction_type="flow", default_size=1024,
                     scheduler=dict(FLUX2_KLEIN_SCHEDULER if scheduler is None else scheduler))
