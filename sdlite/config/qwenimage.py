"""Qwen-Image (Alibaba's Qwen team, 2025): the config of its denoising transformer, shared by Qwen-Image and the
Qwen-Image-Edit releases.

One frozen :class:`QwenImageConfig` holds every fact the network (:mod:`sdlite.models.qwenimage`) is built from. Its
field names are those of diffusers' ``QwenImageTransformer2DModel`` config (``transformer/config.json``), so a published
folder's config reads in one call (:meth:`QwenImageConfig.from_diffusers`); a field the file leaves out gets diffusers'
class default, which are Qwen-Image's numbers.

The network (the same class for every release; only ``zero_cond_t`` differs):

* The VAE (``AutoencoderKLQwenImage``, :mod:`sdlite.config.qwenimage_vae`) has 16 latent channels at 1/8 of the image.
  The transformer cuts the latent into 2 x 2 patches (``patch_size``) of 64 values (``in_channels``, channels
  outermost, as FLUX.1 packs them) and predicts 16 x 2 x 2 values a patch (``out_channels`` 16).
* The text is the last hidden state of Qwen2.5-VL-7B's language model (``joint_attention_dim`` 3584), RMS-normalised
  (``txt_norm``, eps 1e-6) and projected to the width. There is no pooled text vector and no guidance embedding.
* The conditioning vector is an MLP on the timestep's 256-channel sinusoidal embedding (the timestep / 1000 scaled
  back by 1000). Every block computes its own modulations from it (``img_mod`` and ``txt_mod``: shift, scale and gate
  of the attention and of the MLP, 6 x width each, with biases).
* ``num_layers`` double-stream blocks (MMDiT: each stream its own weights, one joint attention over [text, image]),
  then the output norm and projection of the image stream. q, k, v and the outputs have biases; the qk norms are RMS
  norms with a learned scale; the MLPs are GELU (tanh) 4 x width; the block norms LayerNorms without affine (eps 1e-6).
* Positions are rotary over three axes (frame, row, column; ``axes_dims_rope`` channels each, base 10000, complex
  pairs): image ``i`` of a sample's list (the generated image first, then the edit's source images) at frame ``i``, its
  rows and columns centred (row ``r`` of ``h`` at ``r - ceil(h / 2)``); text token ``j`` at ``(p, p, p)`` with
  ``p = j + max over the images of max(h // 2, w // 2)``.
* ``zero_cond_t`` (Qwen-Image-Edit-2511): the source images' tokens are modulated as at timestep 0, the generated
  image's and the text's at the step's timestep; the output norm takes the step's.

Where each release's numbers come from:

* Qwen/Qwen-Image, ``transformer/config.json``: patch_size 2, in_channels 64, out_channels 16, num_layers 60,
  attention_head_dim 128, num_attention_heads 24, joint_attention_dim 3584, axes_dims_rope [16, 56, 56],
  guidance_embeds false, and ``pooled_projection_dim`` 768, which neither diffusers' class nor the network uses (read
  and ignored). These are diffusers' class defaults; ComfyUI's ``comfy/ldm/qwen_image/model.py`` has the same defaults.
  Qwen/Qwen-Image-2512 is reported the same transformer.
* Qwen/Qwen-Image-Edit and Qwen/Qwen-Image-Edit-2509, ``transformer/config.json``: the same numbers (2509 takes up to
  three source images through the same network).
* Qwen/Qwen-Image-Edit-2511, ``transformer/config.json``: the same numbers and ``zero_cond_t`` true (several
  third-party readers of that file; the published file itself not read here).

Not supported (a :class:`ConfigError` names them): ``use_layer3d_rope`` and ``use_additional_t_cond``
(Qwen-Image-Layered's), a ``patch_size`` other than 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import ConfigError

__all__ = ["QwenImageConfig", "QWEN_IMAGE", "QWEN_IMAGE_EDIT", "QWEN_IMAGE_EDIT_2509", "QWEN_IMAGE_EDIT_2511",
           "QWEN_IMAGE_PRESETS", "QWEN_IMAGE_ROPE_THETA", "QWEN_IMAGE_EPS", "QWEN_IMAGE_TIME_CHANNELS",
           "QWEN_IMAGE_FAMILY", "QWEN_IMAGE_SCHEDULER", "QWEN_IMAGE_LIGHTNING_SCHEDULER", "qwenimage_spec",
           "QWEN_IMAGE_EDIT_FAMILY", "QWEN_IMAGE_EDIT_PLUS_FAMILY", "QWEN_IMAGE_EDIT_FAMILIES"]

_CLASS_NAME = "QwenImageTransformer2DModel"
_DIFFUSERS_FIELDS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                     "num_attention_heads", "joint_attention_dim", "guidance_embeds", "axes_dims_rope", "zero_cond_t")
# fields a published config may carry that change nothing in the network (Qwen-Image's pooled_projection_dim)
_IGNORED_FIELDS = ("pooled_projection_dim",)
# fields of variants sdlite does not run: a true value is refused
_REFUSED_FIELDS = ("use_additional_t_cond", "use_layer3d_rope")
_INTEGER_FIELDS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                   "num_attention_heads", "joint_attention_dim")

QWEN_IMAGE_ROPE_THETA = 10000.0   # QwenEmbedRope(theta=10000), fixed in diffusers' class
QWEN_IMAGE_EPS = 1e-6             # the block norms, qk norms, txt_norm and norm_out
QWEN_IMAGE_TIME_CHANNELS = 256    # the timestep's sinusoid


@dataclass(frozen=True)
class QwenImageConfig:
    """Qwen-Image's transformer. ``hidden = num_attention_heads * attention_head_dim`` is the width of both streams;
    ``axes_dims_rope`` splits each head's channels among the (frame, row, column) axes and must add up to
    ``attention_head_dim``. ``in_channels`` counts a patch's values (16 latent channels x 2 x 2); ``out_channels`` the
    latent channels a patch predicts (diffusers' ``proj_out`` makes ``patch_size ** 2 * out_channels``). The defaults
    are diffusers' class defaults, i.e. Qwen-Image."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    zero_cond_t: bool = False

    def __post_init__(self):
        axes = self.axes_dims_rope
        if isinstance(axes, (str, bytes)) or not hasattr(axes, "__iter__"):
            raise ConfigError(f"Qwen-Image config field axes_dims_rope={axes!r} must be a list of three even sizes")
        object.__setattr__(self, "axes_dims_rope", tuple(axes))
        for name in _INTEGER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Qwen-Image config field {name}={value!r} must be a positive integer")
        for name in ("guidance_embeds", "zero_cond_t"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Qwen-Image config field {name}={getattr(self, name)!r} must be true or false")
        if self.guidance_embeds:
            raise ConfigError("Qwen-Image config field guidance_embeds=true is not supported: no release embeds a "
                              "guidance scale (diffusers' class has no guidance embedder either)")
        if self.patch_size != 2:
            raise ConfigError(f"Qwen-Image config field patch_size={self.patch_size} is not supported: every release "
                              "has 2 x 2 patches")
        if self.in_channels != self.patch_size ** 2 * self.out_channels:
            raise ConfigError(f"Qwen-Image config fields in_channels={self.in_channels} and out_channels="
                              f"{self.out_channels}: a patch of {self.patch_size} x {self.patch_size} latent "
                              f"positions has {self.patch_size ** 2 * self.out_channels} values")
        if len(self.axes_dims_rope) != 3 or any(isinstance(a, bool) or not isinstance(a, int) or a < 2 or a % 2
                                                for a in self.axes_dims_rope) \
                or sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ConfigError(f"Qwen-Image config field axes_dims_rope={list(self.axes_dims_rope)} must be three even "
                              f"sizes adding up to attention_head_dim={self.attention_head_dim}")

    @property
    def hidden(self) -> int:
        """The token width of both streams (3072)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def latent_channels(self) -> int:
        """The VAE latent's channels (16)."""
        return self.out_channels

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "QwenImageConfig":
        """From a diffusers ``QwenImageTransformer2DModel`` config dict. Entries starting with ``_`` are bookkeeping,
        ``pooled_projection_dim`` is ignored (no network uses it); any other field this class does not know, and
        Qwen-Image-Layered's switches set true, are a :class:`ConfigError` naming them. Fields the file leaves out take
        diffusers' class defaults (Qwen-Image's); ``out_channels`` null means ``in_channels``, as in diffusers."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"a Qwen-Image transformer config is a JSON object, got {type(cfg).__name__}")
        name = cfg.get("_class_name", _CLASS_NAME)
        if name != _CLASS_NAME:
            raise ConfigError(f"transformer config _class_name={name!r}: expected {_CLASS_NAME!r}")
        unknown = sorted(k for k in cfg if not k.startswith("_") and k not in _DIFFUSERS_FIELDS + _IGNORED_FIELDS
                         + _REFUSED_FIELDS)
        if unknown:
            raise ConfigError(f"transformer config fields {unknown} are not supported by sdlite's Qwen-Image "
                              "transformer")
        refused = sorted(k for k in _REFUSED_FIELDS if cfg.get(k))
        if refused:
            raise ConfigError(f"transformer config fields {refused} are set: that is Qwen-Image-Layered's transformer, "
                              "which sdlite does not run")
        known = {k: cfg[k] for k in _DIFFUSERS_FIELDS if k in cfg}
        if known.get("out_channels", 0) is None:
            known["out_channels"] = known.get("in_channels", cls.in_channels)
        return cls(**known)

    def to_diffusers(self) -> dict:
        """The diffusers ``QwenImageTransformer2DModel`` config of this network (lists where diffusers writes lists)."""
        out = {k: getattr(self, k) for k in _DIFFUSERS_FIELDS}
        out["axes_dims_rope"] = list(self.axes_dims_rope)
        return {"_class_name": _CLASS_NAME, **out}


# Qwen/Qwen-Image, transformer/config.json: diffusers' class defaults (see the module's notes)
QWEN_IMAGE = QwenImageConfig()
# Qwen/Qwen-Image-Edit and Qwen/Qwen-Image-Edit-2509, transformer/config.json: the same network
QWEN_IMAGE_EDIT = QwenImageConfig()
QWEN_IMAGE_EDIT_2509 = QwenImageConfig()
# Qwen/Qwen-Image-Edit-2511, transformer/config.json: the source images modulated at timestep 0
QWEN_IMAGE_EDIT_2511 = QwenImageConfig(zero_cond_t=True)

QWEN_IMAGE_PRESETS = {"qwen-image": QWEN_IMAGE, "qwen-image-edit": QWEN_IMAGE_EDIT,
                      "qwen-image-edit-2509": QWEN_IMAGE_EDIT_2509, "qwen-image-edit-2511": QWEN_IMAGE_EDIT_2511}


QWEN_IMAGE_FAMILY = "qwen-image"
# the editing releases by how they prepare their source images (sdlite.families.qwenimage_edit): Qwen-Image-Edit (one
# image, QwenImageEditPipeline) and Edit-2509 / 2511 (up to three, QwenImageEditPlusPipeline)
QWEN_IMAGE_EDIT_FAMILY = "qwen-image-edit"
QWEN_IMAGE_EDIT_PLUS_FAMILY = "qwen-image-edit-plus"
QWEN_IMAGE_EDIT_FAMILIES = (QWEN_IMAGE_EDIT_FAMILY, QWEN_IMAGE_EDIT_PLUS_FAMILY)
# Qwen/Qwen-Image, scheduler/scheduler_config.json: FLUX.1's dynamic shifting (the pipeline sets mu from the image's
# token count with calculate_shift) over a longer range of token counts, to a smaller top shift, the sigmas stretched
# to end at 0.02
QWEN_IMAGE_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
                        "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
                        "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential"}

# lightx2v's Qwen-Image-Lightning LoRAs (ModelTC/Qwen-Image-Lightning, its model card and generate_with_diffusers.py):
# distilled at shift 3, they run on this config in place of the model's (sdlite.families.qwenimage's lora_sampling):
# base_shift = max_shift = log 3 (mu = log 3 at every size: the exponential time shift e^mu s / (1 + (e^mu - 1) s) is
# SD3's shift 3), no stretch to a shift_terminal
QWEN_IMAGE_LIGHTNING_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
    "use_dynamic_shifting": True, "base_shift": math.log(3), "max_shift": math.log(3), "base_image_seq_len": 256,
    "max_image_seq_len": 8192, "shift_terminal": None, "time_shift_type": "exponential", "invert_sigmas": False,
    "stochastic_sampling": False, "use_beta_sigmas": False, "use_exponential_sigmas": False,
    "use_karras_sigmas": False}


def qwenimage_spec(transformer: QwenImageConfig, *, text, vae, scheduler: dict | None = None,
                   family: str = QWEN_IMAGE_FAMILY):
    """A Qwen-Image model (:class:`~sdlite.config.ModelSpec`): the transformer, the Qwen2.5-VL language model ``text``
    (a :class:`~sdlite.config.qwen.QwenConfig`), the VAE (a :class:`~sdlite.config.qwenimage_vae.QwenImageVAEConfig`
    with its latent statistics) and Qwen-Image's scheduler unless a folder gives its own. The native size is the model
    card's 1328 x 1328 (the pipeline's own default, 1024, is what it draws when no size is given)."""
    from . import ModelSpec

    return ModelSpec(family=family, text=text, text2=None, text3=None, unet=None, transformer=transformer,
                     vae=vae, prediction_type="flow", default_size=1328,
                     scheduler=dict(QWEN_IMAGE_SCHEDULER if scheduler is None else scheduler))
