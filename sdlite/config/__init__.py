"""Every model fact in one place: frozen configs for the three networks and the named presets.

The presets mirror the upstream configs they cite; a diffusers folder's own ``config.json`` files are
read through the ``from_diffusers`` constructors, which accept only what our classes really implement and
name anything else.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import ConfigError
from .unet import UNetConfig, _tuple


@dataclass(frozen=True)
class TextEncoderConfig:
    """CLIP text transformer (pre-LayerNorm, causal self-attention).

    ``layers`` counts the layers actually run: the OpenCLIP ViT-H text tower of SD 2.x has 24, of which the
    reference uses the penultimate one, so its preset has 23 (as diffusers' converted folders do).
    """

    vocab_size: int = 49408
    max_positions: int = 77
    width: int = 768
    layers: int = 12
    heads: int = 12
    mlp_width: int = 3072
    activation: str = "quick_gelu"  # "quick_gelu" (OpenAI CLIP) | "gelu" (OpenCLIP)
    eps: float = 1e-5
    pad_token_id: int = 49407  # SD 1.x pads with <|endoftext|>; SD 2.x (OpenCLIP) with 0
    eos_token_id: int = 49407
    projection_dim: int = 768  # text_projection width (not used to condition the UNet)

    architecture = "clip"

    def __post_init__(self):
        if self.width % self.heads:
            raise ConfigError(f"text encoder width {self.width} is not divisible by heads {self.heads}")
        if self.activation not in ("quick_gelu", "gelu"):
            raise ConfigError(f"text encoder activation {self.activation!r}: expected 'quick_gelu' or 'gelu'")

    @classmethod
    def from_diffusers(cls, cfg: dict, pad_token_id: int | None = None) -> "TextEncoderConfig":
        """From a transformers ``CLIPTextConfig`` dict (``text_encoder/config.json``)."""
        return cls(
            vocab_size=cfg.get("vocab_size", 49408),
            max_positions=cfg.get("max_position_embeddings", 77),
            width=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"],
            mlp_width=cfg["intermediate_size"],
            activation=cfg.get("hidden_act", "quick_gelu"),
            eps=cfg.get("layer_norm_eps", 1e-5),
            pad_token_id=cfg.get("pad_token_id", 49407) if pad_token_id is None else pad_token_id,
            eos_token_id=cfg.get("eos_token_id", 49407),
            projection_dim=cfg.get("projection_dim", cfg["hidden_size"]),
        )

    def to_diffusers(self) -> dict:
        return {
            "architectures": ["CLIPTextModel"],
            "model_type": "clip_text_model",
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_positions,
            "hidden_size": self.width,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "intermediate_size": self.mlp_width,
            "hidden_act": self.activation,
            "layer_norm_eps": self.eps,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": 49406,
            "eos_token_id": self.eos_token_id,
            "projection_dim": self.projection_dim,
            "torch_dtype": "float32",
        }


@dataclass(frozen=True)
class BertTextConfig:
    """A BERT encoder used as the text tower (Taiyi: a Chinese RoBERTa-wwm in BERT's architecture): learned
    word, position and token-type embeddings with a LayerNorm, post-LayerNorm blocks with bidirectional
    attention, GELU. The UNet is conditioned on its last hidden state.

    The field names match :class:`TextEncoderConfig` where they mean the same (``width``, ``layers``, ...), so
    code that only asks for the context width or the layer count takes either.
    """

    vocab_size: int = 21128
    max_positions: int = 512
    width: int = 768
    layers: int = 12
    heads: int = 12
    mlp_width: int = 3072
    type_vocab_size: int = 2
    activation: str = "gelu"
    eps: float = 1e-12
    pad_token_id: int = 0

    architecture = "bert"

    def __post_init__(self):
        if self.width % self.heads:
            raise ConfigError(f"BERT text encoder width {self.width} is not divisible by heads {self.heads}")
        if self.activation != "gelu":
            raise ConfigError(f"BERT text encoder activation {self.activation!r} is not supported (expected 'gelu')")
        if self.type_vocab_size < 1:
            raise ConfigError(f"BERT text encoder type_vocab_size {self.type_vocab_size} must be at least 1")

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "BertTextConfig":
        """From a transformers ``BertConfig`` dict (``text_encoder/config.json`` of a Taiyi folder)."""
        position = cfg.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ConfigError(f"BERT config field position_embedding_type={position!r} is not supported "
                              "(expected 'absolute')")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ConfigError("BERT config: a decoder (is_decoder / add_cross_attention) is not a text encoder")
        return cls(
            vocab_size=cfg.get("vocab_size", 21128),
            max_positions=cfg.get("max_position_embeddings", 512),
            width=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"],
            mlp_width=cfg["intermediate_size"],
            type_vocab_size=cfg.get("type_vocab_size", 2),
            activation=cfg.get("hidden_act", "gelu"),
            eps=cfg.get("layer_norm_eps", 1e-12),
            pad_token_id=cfg.get("pad_token_id", 0),
        )

    def to_diffusers(self) -> dict:
        return {
            "architectures": ["BertModel"],
            "model_type": "bert",
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_positions,
            "hidden_size": self.width,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "intermediate_size": self.mlp_width,
            "type_vocab_size": self.type_vocab_size,
            "hidden_act": self.activation,
            "layer_norm_eps": self.eps,
            "pad_token_id": self.pad_token_id,
            "position_embedding_type": "absolute",
            "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.1,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
        }


def is_bert(text_config) -> bool:
    """Whether a model's text-encoder config is a BERT (Taiyi) rather than a CLIP text tower."""
    return isinstance(text_config, BertTextConfig)


@dataclass(frozen=True)
class VAEConfig:
    """AutoencoderKL: 2**(levels-1) spatial downsampling, ``latent_channels`` latent channels."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 4
    block_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_groups: int = 32
    scaling_factor: float = 0.18215
    sample_size: int = 512
    # decode in fp32 even when the model computes in half precision (SDXL's VAE overflows in fp16); diffusers'
    # SDXL pipelines honour it, its SD 1.x/2.x pipelines do not (sdlite: the same). True is diffusers' default.
    force_upcast: bool = True
    # the sampler's latents are (VAE latent - shift_factor) * scaling_factor (SD3, FLUX: 16-channel VAEs with a
    # shift); those VAEs have no 1x1 convolutions around the latent (use_quant_conv, use_post_quant_conv False)
    shift_factor: float = 0.0
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True

    @property
    def downscale(self) -> int:
        return 2 ** (len(self.block_channels) - 1)

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "VAEConfig":
        for name in list(cfg.get("down_block_types", [])):
            if name != "DownEncoderBlock2D":
                raise ConfigError(f"VAE config: down block type {name!r} is not supported")
        for name in list(cfg.get("up_block_types", [])):
            if name != "UpDecoderBlock2D":
                raise ConfigError(f"VAE config: up block type {name!r} is not supported")
        if not cfg.get("mid_block_add_attention", True):
            raise ConfigError("VAE config field mid_block_add_attention=False is not supported")
        return cls(
            in_channels=cfg.get("in_channels", 3),
            out_channels=cfg.get("out_channels", 3),
            latent_channels=cfg.get("latent_channels", 4),
            block_channels=_tuple(cfg.get("block_out_channels", (128, 256, 512, 512))),
            layers_per_block=cfg.get("layers_per_block", 2),
            norm_groups=cfg.get("norm_num_groups", 32),
            scaling_factor=cfg.get("scaling_factor", 0.18215),
            sample_size=cfg.get("sample_size", 512),
            force_upcast=bool(cfg.get("force_upcast", True)),   # diffusers' default
            shift_factor=float(cfg.get("shift_factor") or 0.0),
            use_quant_conv=bool(cfg.get("use_quant_conv", True)),
            use_post_quant_conv=bool(cfg.get("use_post_quant_conv", True)),
        )

    def to_diffusers(self) -> dict:
        n = len(self.block_channels)
        return {
            "_class_name": "AutoencoderKL",
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "latent_channels": self.latent_channels,
            "block_out_channels": list(self.block_channels),
            "down_block_types": ["DownEncoderBlock2D"] * n,
            "up_block_types": ["UpDecoderBlock2D"] * n,
            "layers_per_block": self.layers_per_block,
            "norm_num_groups": self.norm_groups,
            "act_fn": "silu",
            "scaling_factor": self.scaling_factor,
            "sample_size": self.sample_size,
            "force_upcast": self.force_upcast,
            "shift_factor": self.shift_factor or None,
            "use_quant_conv": self.use_quant_conv,
            "use_post_quant_conv": self.use_post_quant_conv,
        }


# The latent spaces a TAESD is trained for, as madebyollin names its files (taesd_decoder.pth, taesdxl_decoder.pth,
# taesd3_decoder.pth, taef1_decoder.pth): variant -> file-name stem
TAESD_VARIANTS = {"sd": "taesd", "sdxl": "taesdxl", "sd3": "taesd3", "flux": "taef1"}


@dataclass(frozen=True)
class TAESDConfig:
    """TAESD, the tiny autoencoder (madebyollin/taesd; diffusers' ``AutoencoderTiny``, whose config.json defaults
    these are): 3x3 convolutions and ReLU blocks (``encoder_channels`` / ``decoder_channels`` wide per stage), no
    normalisation, no attention.

    Encoder stage i: a convolution (stride 2 after the first stage) and ``encoder_blocks[i]`` blocks; then a
    convolution to ``latent_channels``. Decoder: a convolution from the latents and a ReLU; stage i: its
    ``decoder_blocks[i]`` blocks then, except the last stage, a nearest-neighbour x``upsample`` and a convolution
    without bias; then a convolution to ``out_channels``. ``latent_magnitude`` / ``latent_shift`` map latents to
    [0, 1] for storing them as 8-bit images (:meth:`~sdlite.models.taesd.TinyAutoencoder.scale_latents`); they play
    no part in encoding or decoding. ``variant`` is the latent space it was trained for (a key of
    :data:`TAESD_VARIANTS`), None when nothing says.
    """

    latent_channels: int = 4
    in_channels: int = 3
    out_channels: int = 3
    encoder_channels: tuple[int, ...] = (64, 64, 64, 64)
    decoder_channels: tuple[int, ...] = (64, 64, 64, 64)
    encoder_blocks: tuple[int, ...] = (1, 3, 3, 3)
    decoder_blocks: tuple[int, ...] = (3, 3, 3, 1)
    upsample: int = 2
    latent_magnitude: float = 3.0
    latent_shift: float = 0.5
    variant: str | None = None

    def __post_init__(self):
        if len(self.encoder_channels) != len(self.encoder_blocks):
            raise ConfigError(f"TAESD config: {len(self.encoder_channels)} encoder channel counts for "
                              f"{len(self.encoder_blocks)} encoder stages")
        if len(self.decoder_channels) != len(self.decoder_blocks):
            raise ConfigError(f"TAESD config: {len(self.decoder_channels)} decoder channel counts for "
                              f"{len(self.decoder_blocks)} decoder stages")
        if self.variant is not None and self.variant not in TAESD_VARIANTS:
            raise ConfigError(f"TAESD variant {self.variant!r}: expected one of {', '.join(TAESD_VARIANTS)}")

    @property
    def downscale(self) -> int:
        """Image pixels per latent pixel, each way (8 for every published TAESD)."""
        return self.upsample ** (len(self.decoder_blocks) - 1)

    @classmethod
    def from_diffusers(cls, cfg: dict, variant: str | None = None) -> "TAESDConfig":
        """From an ``AutoencoderTiny`` config.json; fields that change the computation and that sdlite does not
        implement are named."""
        for name, supported in (("act_fn", "relu"), ("upsample_fn", "nearest")):
            if cfg.get(name, supported) != supported:
                raise ConfigError(f"TAESD config field {name}={cfg[name]!r} is not supported (only {supported!r})")
        # the pipeline's latents / scaling_factor + shift_factor, which TAESD's own latents make a no-op
        for name, neutral in (("scaling_factor", 1.0), ("shift_factor", 0.0)):
            if cfg.get(name) not in (None, neutral):
                raise ConfigError(f"TAESD config field {name}={cfg[name]!r} is not supported (only {neutral})")
        defaults = cls()
        return cls(
            latent_channels=cfg.get("latent_channels", defaults.latent_channels),
            in_channels=cfg.get("in_channels", defaults.in_channels),
            out_channels=cfg.get("out_channels", defaults.out_channels),
            encoder_channels=_tuple(cfg.get("encoder_block_out_channels", defaults.encoder_channels)),
            decoder_channels=_tuple(cfg.get("decoder_block_out_channels", defaults.decoder_channels)),
            encoder_blocks=_tuple(cfg.get("num_encoder_blocks", defaults.encoder_blocks)),
            decoder_blocks=_tuple(cfg.get("num_decoder_blocks", defaults.decoder_blocks)),
            upsample=cfg.get("upsampling_scaling_factor", defaults.upsample),
            latent_magnitude=float(cfg.get("latent_magnitude", defaults.latent_magnitude)),
            latent_shift=float(cfg.get("latent_shift", defaults.latent_shift)),
            variant=variant,
        )



@dataclass(frozen=True)
class ControlNetConfig:
    """A ControlNet (Zhang et al. 2023, "Adding Conditional Control to Text-to-Image Diffusion Models"): a trainable
    copy of a UNet's encoder and middle block (``unet``: that UNet's config; its up path and output layers are not
    built), a hint encoder from the control image to the first level's width, and a zero-initialised 1x1 convolution
    on each skip activation and on the middle block's output, whose outputs are added to the UNet's.

    Hint encoder (diffusers' ``ControlNetConditioningEmbedding``; the original's ``input_hint_block``): a convolution
    from ``hint_channels`` to ``hint_widths[0]``, then per later width a convolution and a stride-2 convolution, each
    followed by SiLU, then a convolution to the UNet's first width. ``global_pool``: the residuals are averaged over
    space (the shuffle ControlNet). ``bgr``: the control image's channels are reversed before the hint encoder
    (diffusers' ``controlnet_conditioning_channel_order``).
    """

    unet: UNetConfig = UNetConfig()
    hint_channels: int = 3
    hint_widths: tuple[int, ...] = (16, 32, 96, 256)
    global_pool: bool = False
    bgr: bool = False

    def __post_init__(self):
        if not self.hint_widths or self.hint_channels < 1:
            raise ConfigError(f"ControlNet config: hint encoder widths {self.hint_widths} from {self.hint_channels} "
                              "channels (both must be set)")

    @property
    def hint_downscale(self) -> int:
        """Control-image pixels per latent pixel, each way (8 for every published ControlNet)."""
        return 2 ** (len(self.hint_widths) - 1)

    @property
    def residuals(self) -> int:
        """How many residuals it gives: one per skip activation of the UNet's down path, plus the middle block's."""
        levels = len(self.unet.block_channels)
        return 1 + levels * self.unet.layers_per_block + (levels - 1) + 1

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "ControlNetConfig":
        """From a diffusers ``ControlNetModel`` config dict (``config.json``): the UNet fields it shares, plus the
        hint encoder's."""
        order = cfg.get("controlnet_conditioning_channel_order", "rgb")
        if order not in ("rgb", "bgr"):
            raise ConfigError(f"ControlNet config: controlnet_conditioning_channel_order {order!r} (expected 'rgb' "
                              "or 'bgr')")
        down = list(cfg.get("down_block_types", ()))
        up = ["CrossAttnUpBlock2D" if t == "CrossAttnDownBlock2D" else "UpBlock2D" for t in reversed(down)]
        unet = UNetConfig.from_diffusers({**cfg, "up_block_types": up, "out_channels": cfg.get("in_channels", 4)})
        return cls(unet=unet, hint_channels=int(cfg.get("conditioning_channels", 3)),
                   hint_widths=_tuple(cfg.get("conditioning_embedding_out_channels", (16, 32, 96, 256))),
                   global_pool=bool(cfg.get("global_pool_conditions", False)), bgr=order == "bgr")

    def to_diffusers(self) -> dict:
        unet = self.unet.to_diffusers()
        for key in ("up_block_types", "out_channels", "_class_name"):
            unet.pop(key, None)
        return {"_class_name": "ControlNetModel", **unet, "conditioning_channels": self.hint_channels,
                "conditioning_embedding_out_channels": list(self.hint_widths),
                "global_pool_conditions": self.global_pool,
                "controlnet_conditioning_channel_order": "bgr" if self.bgr else "rgb"}

# --- scheduler configs ----------------------------------------------------------------------------------

# The latent diffusion training schedule, as every SD 1.x/2.x reference repository publishes it in
# scheduler/scheduler_config.json (runwayml/stable-diffusion-v1-5, runwayml/stable-diffusion-inpainting,
# stabilityai/stable-diffusion-2-1-base, stabilityai/stable-diffusion-2-1, stabilityai/stable-diffusion-2-inpainting):
# scaled-linear betas from 0.00085 to 0.012 over 1000 training steps, inference timesteps offset by 1, no clipping.
_LDM_SCHEDULE = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                     steps_offset=1, set_alpha_to_one=False, clip_sample=False, skip_prk_steps=True,
                     trained_betas=None)

# Single files carry no scheduler. As diffusers does when it loads one, a single file gets the scheduler config
# published with its family's reference weights: key -> (repository, its scheduler_config.json). The class named
# there matters for one thing only, the timestep spacing (below); PNDM and DDIM both default to "leading".
PUBLISHED_SCHEDULERS: dict[str, tuple[str, dict]] = {
    "sd1": ("runwayml/stable-diffusion-v1-5", {"_class_name": "PNDMScheduler", **_LDM_SCHEDULE}),
    "sd1-inpaint": ("runwayml/stable-diffusion-inpainting", {"_class_name": "DDIMScheduler", **_LDM_SCHEDULE}),
    "sd2": ("stabilityai/stable-diffusion-2-1-base",
            {"_class_name": "PNDMScheduler", **_LDM_SCHEDULE, "prediction_type": "epsilon"}),
    "sd2-v": ("stabilityai/stable-diffusion-2-1",
              {"_class_name": "DDIMScheduler", **_LDM_SCHEDULE, "prediction_type": "v_prediction"}),
    "sd2-inpaint": ("stabilityai/stable-diffusion-2-inpainting",
                    {"_class_name": "DDIMScheduler", **_LDM_SCHEDULE, "prediction_type": "epsilon"}),
    # the SDXL repositories' scheduler_config.json: EulerDiscreteScheduler, the same schedule, spacing stated
    "sdxl": ("stabilityai/stable-diffusion-xl-base-1.0",
             {**_LDM_SCHEDULE, "_class_name": "EulerDiscreteScheduler", "timestep_spacing": "leading",
              "interpolation_type": "linear", "use_karras_sigmas": False, "prediction_type": "epsilon"}),
    "sdxl-refiner": ("stabilityai/stable-diffusion-xl-refiner-1.0",
                     {**_LDM_SCHEDULE, "_class_name": "EulerDiscreteScheduler", "timestep_spacing": "leading",
                      "interpolation_type": "linear", "use_karras_sigmas": False, "prediction_type": "epsilon"}),
    "sdxl-turbo": ("stabilityai/sdxl-turbo",
                   {**_LDM_SCHEDULE, "_class_name": "EulerAncestralDiscreteScheduler", "timestep_spacing": "trailing",
                    "prediction_type": "epsilon"}),
    "sd-turbo": ("stabilityai/sd-turbo",
                 {**_LDM_SCHEDULE, "_class_name": "EulerDiscreteScheduler", "timestep_spacing": "trailing",
                  "prediction_type": "epsilon"}),
    # the x4 upscaler's: its own training schedule (linear in sqrt(beta) from 0.0001 to 0.02, the original's
    # linear_start / linear_end), v-prediction, sampled by DDIM
    "sd-x4-upscaler": ("stabilityai/stable-diffusion-x4-upscaler",
                       {"_class_name": "DDIMScheduler", "beta_start": 0.0001, "beta_end": 0.02,
                        "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "steps_offset": 1,
                        "set_alpha_to_one": False, "clip_sample": False, "skip_prk_steps": True,
                        "trained_betas": None, "prediction_type": "v_prediction"}),
}

# The published files predate the ``timestep_spacing`` field. diffusers fills a missing field with the default of the
# scheduler class the file names when it builds that scheduler (the pipeline then samples with that spacing), and
# writes the filled-in value when it saves the folder again. sdlite does the same, so that a folder downloaded from
# the hub, the same folder saved again by diffusers, and the single file made from it all give one image. These are
# the defaults of diffusers' scheduler classes (``__init__`` signatures, diffusers 0.42).
SCHEDULER_CLASS_SPACING = {
    "PNDMScheduler": "leading", "DDIMScheduler": "leading", "DDPMScheduler": "leading", "LCMScheduler": "leading",
    "TCDScheduler": "leading",
    "EulerDiscreteScheduler": "linspace", "EulerAncestralDiscreteScheduler": "linspace",
    "HeunDiscreteScheduler": "linspace", "LMSDiscreteScheduler": "linspace", "KDPM2DiscreteScheduler": "linspace",
    "KDPM2AncestralDiscreteScheduler": "linspace", "DPMSolverMultistepScheduler": "linspace",
    "DPMSolverSDEScheduler": "linspace", "UniPCMultistepScheduler": "linspace", "DEISMultistepScheduler": "linspace",
}


def published_scheduler(family: str, prediction_type: str = "epsilon") -> tuple[str, dict]:
    """(repository, scheduler config) published for ``family`` ("sd1", "sd2", "sd1-inpaint", "sd2-inpaint")."""
    key = "sd2-v" if family == "sd2" and prediction_type == "v_prediction" else family
    if key not in PUBLISHED_SCHEDULERS:
        raise ConfigError(f"no published scheduler config is known for model family {family!r}")
    repo, cfg = PUBLISHED_SCHEDULERS[key]
    return repo, {**cfg, "prediction_type": prediction_type}


def explicit_spacing(cfg: dict) -> tuple[dict, str]:
    """``cfg`` with ``timestep_spacing`` stated, and where the value came from.

    A config that names its spacing keeps it. One that does not gets the default of the scheduler class it names,
    as diffusers gives it when it loads the config. With no class, or one we do not know, the spacing stays unset
    and each sampler uses the one its reference scheduler class defaults to.
    """
    if cfg.get("timestep_spacing"):
        return dict(cfg), "stated in the config"
    cls = cfg.get("_class_name")
    if cls in SCHEDULER_CLASS_SPACING:
        spacing = SCHEDULER_CLASS_SPACING[cls]
        return {**cfg, "timestep_spacing": spacing}, f"not stated: the default of the {cls} it names"
    return {k: v for k, v in cfg.items() if k != "timestep_spacing"}, \
        "not stated" + (f" and {cls} is not a known scheduler" if cls else ", no scheduler class named") + \
        ": each sampler's reference default"


@dataclass(frozen=True)
class ModelSpec:
    """A whole Stable Diffusion model: its family, its networks and how its UNet is parameterised.

    SDXL has two text encoders: ``text`` (CLIP ViT-L) and ``text2`` (OpenCLIP bigG, with the projection that
    makes the pooled text embedding). The SDXL refiner has only the second: its ``text`` is None.
    """

    family: str
    text: TextEncoderConfig | BertTextConfig | None
    unet: UNetConfig | None                 # None where a transformer denoises (SD3)
    vae: VAEConfig
    prediction_type: str = "epsilon"  # "epsilon" | "v_prediction"
    default_size: int = 512
    # The family's published scheduler config (see PUBLISHED_SCHEDULERS; the values are the same for all).
    scheduler: dict = field(default_factory=lambda: dict(_LDM_SCHEDULE))
    text2: TextEncoderConfig | None = None
    # SDXL pipelines' model_index.json: no negative prompt -> zero negative conditioning (base: yes, refiner: no);
    # the UNet's time ids hold an aesthetic score instead of the target size (refiner)
    force_zeros_for_empty_prompt: bool = False
    requires_aesthetics_score: bool = False
    turbo: bool = False               # a distilled Turbo model: trailing spacing, 1-4 steps, no guidance
    # the x4 upscaler (family X4_FAMILY): the DDPM schedule by which its low-resolution input is noised to the
    # requested noise level (low_res_scheduler/scheduler_config.json), and the highest level it accepts
    # (model_index.json max_noise_level)
    low_res_scheduler: dict | None = None
    max_noise_level: int = 0
    # the transformer generation (SD3): the denoising transformer (sdlite.config.mmdit.MMDiTConfig) in place of the
    # UNet, and a third text encoder, T5 (sdlite.config.t5.T5Config), None when the model runs without it
    transformer: object | None = None
    text3: object | None = None

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    @property
    def denoiser(self) -> str:
        """The component that denoises: ``unet``, or ``transformer`` (SD3)."""
        return "unet" if self.unet is not None else "transformer"

    @property
    def is_sdxl(self) -> bool:
        """Conditioned the SDXL way: penultimate hidden states of one or two CLIP towers, a pooled text embedding
        and size/crop (or aesthetic) time ids."""
        return self.unet is not None and self.unet.addition_embed == "text_time"

    @property
    def is_x4_upscaler(self) -> bool:
        """The SD x4 upscaler: a UNet conditioned on a noised low-resolution image (concatenated to the latent)
        and on its noise level (a class label), run by :mod:`sdlite.upscalers.x4`."""
        return self.family == X4_FAMILY

    @property
    def text_encoders(self) -> tuple[str, ...]:
        """The component names of the text encoders, in the order their states are concatenated."""
        return tuple(name for name, cfg in (("text_encoder", self.text), ("text_encoder_2", self.text2),
                                            ("text_encoder_3", self.text3)) if cfg is not None)

    @property
    def context_text(self) -> TextEncoderConfig | BertTextConfig:
        """The config of the first text encoder present (the one prompts are chunked for)."""
        return self.text if self.text is not None else self.text2


# the SD3 releases by transformer (sdlite.weights.sd3.sd3_family): SD3 Medium, SD3.5 Medium (MMDiT-X), SD3.5 Large
# (and Large Turbo)
SD3_FAMILIES = ("sd3", "sd3.5-medium", "sd3.5-large")


# --- request limits (sdlite.pipeline.request checks them; every front-end and the x4 upscaler hold to them) -------

MAX_SEED = 2**32 - 1
MAX_STEPS = 1000
MAX_BATCH = 64
CFG_RANGE = (1.0, 30.0)


# --- presets -------------------------------------------------------------------------------------------

# runwayml/stable-diffusion-v1-5 (text_encoder, unet, vae config.json): CLIP ViT-L/14 text tower
SD15 = ModelSpec(
    family="sd1",
    text=TextEncoderConfig(),
    unet=UNetConfig(),
    vae=VAEConfig(),
)

# runwayml/stable-diffusion-inpainting: 9 input channels (latent 4 + mask 1 + masked-image latent 4)
SD15_INPAINT = SD15.replace(family="sd1-inpaint", unet=dataclasses.replace(SD15.unet, in_channels=9))

# stabilityai/stable-diffusion-2-1-base: OpenCLIP ViT-H text tower (penultimate layer), head dim 64,
# linear projections in the spatial transformers
_SD2_TEXT = TextEncoderConfig(width=1024, layers=23, heads=16, mlp_width=4096, activation="gelu",
                              pad_token_id=0, projection_dim=512)
_SD2_UNET = UNetConfig(heads=(5, 10, 20, 20), context_dim=1024, linear_projection=True)
SD21_BASE = ModelSpec(family="sd2", text=_SD2_TEXT, unet=_SD2_UNET, vae=VAEConfig())

# stabilityai/stable-diffusion-2-1: the 768x768 v-prediction model
SD21_V = SD21_BASE.replace(prediction_type="v_prediction", default_size=768,
                           unet=dataclasses.replace(_SD2_UNET, sample_size=96),
                           vae=dataclasses.replace(VAEConfig(), sample_size=768))

# stabilityai/stable-diffusion-2-inpainting
SD2_INPAINT = SD21_BASE.replace(family="sd2-inpaint", unet=dataclasses.replace(_SD2_UNET, in_channels=9))

# sdlite's own demo model (sdlite/data/demo, trained by tools/train_demo.py; issue 5): the SD 1.x architecture
# at toy size for 64x64 images (8x8 latents) of coloured shapes. The real CLIP tokenizer and vocabulary, a
# 2-layer width-64 text tower; norm groups of 4+ channels (a GroupNorm over single channels would erase flat
# colours). The VAE scaling factor is measured on the training latents (1 / their std) by the training script,
# which writes it into the folder's vae/config.json; the value here is the shipped model's.
DEMO = ModelSpec(
    family="sd1",
    text=TextEncoderConfig(width=64, layers=2, heads=4, mlp_width=256, projection_dim=64),
    unet=UNetConfig(block_channels=(32, 64, 64), layers_per_block=1, attention=(False, True, True),
                    heads=(2, 4, 4), context_dim=64, norm_groups=8, sample_size=8),
    vae=VAEConfig(block_channels=(16, 32, 64, 64), layers_per_block=1, norm_groups=4, scaling_factor=0.42832,
                  sample_size=64),
    default_size=64,
)

# IDEA-CCNL/Taiyi-Stable-Diffusion-1B-Chinese-v0.1 (text_encoder/config.json: BertModel, the text tower of
# IDEA-CCNL/Taiyi-CLIP-RoBERTa-102M-ViT-L-Chinese; tokenizer: BertTokenizer, vocab.txt of 21128 tokens,
# model_max_length 512): SD 1.x's UNet and VAE conditioned on a Chinese BERT's last hidden state (512 tokens)
TAIYI = SD15.replace(text=BertTextConfig())

# stabilityai/stable-diffusion-xl-base-1.0 (model_index.json, text_encoder, text_encoder_2, unet, vae config.json):
# CLIP ViT-L and OpenCLIP bigG (32 layers of 1280, GELU, projection 1280), both read at the penultimate layer
# without the final LayerNorm and concatenated to a 2048-wide context; a three-level UNet (no attention at the
# first level, 2 and 10 transformer blocks, 64-wide heads, Linear projections) with "text_time" added conditioning:
# the pooled bigG embedding (1280) and 6 size/crop ids of 256 sinusoidal channels (2816 in all); the VAE of SDXL
# with scaling factor 0.13025 (its fp16 decode overflows: force_upcast). Native size 1024.
_SDXL_TEXT_G = TextEncoderConfig(width=1280, layers=32, heads=20, mlp_width=5120, activation="gelu", pad_token_id=0,
                                 eos_token_id=2, projection_dim=1280)
_SDXL_VAE = VAEConfig(scaling_factor=0.13025, sample_size=1024, force_upcast=True)
_SDXL_SCHEDULE = PUBLISHED_SCHEDULERS["sdxl"][1]
SDXL_BASE = ModelSpec(
    family="sdxl",
    text=TextEncoderConfig(),
    text2=_SDXL_TEXT_G,
    unet=UNetConfig(block_channels=(320, 640, 1280), attention=(False, True, True), heads=(5, 10, 20),
                    context_dim=2048, linear_projection=True, transformer_depth=(1, 2, 10), addition_embed="text_time",
                    addition_time_embed_dim=256, add_embed_in=2816, sample_size=128),
    vae=_SDXL_VAE,
    default_size=1024,
    scheduler=dict(_SDXL_SCHEDULE),
    force_zeros_for_empty_prompt=True,
)
# stabilityai/stable-diffusion-xl-refiner-1.0: bigG alone (context 1280), a four-level UNet of 384 channels (attention
# at the middle two levels, 4 transformer blocks each), time ids of 5 (the aesthetic score instead of the target
# size: 1280 + 5 * 256 = 2560); negative prompts are encoded, never zeroed
SDXL_REFINER = SDXL_BASE.replace(
    family="sdxl-refiner", text=None,
    unet=UNetConfig(block_channels=(384, 768, 1536, 1536), attention=(False, True, True, False), heads=(6, 12, 24, 24),
                    context_dim=1280, linear_projection=True, transformer_depth=4, addition_embed="text_time",
                    addition_time_embed_dim=256, add_embed_in=2560, sample_size=128),
    force_zeros_for_empty_prompt=False, requires_aesthetics_score=True,
)
# stabilityai/sdxl-turbo: SDXL base distilled (adversarial diffusion distillation) for 1-4 steps at 512x512 without
# guidance; its scheduler_config.json is EulerAncestralDiscreteScheduler with "trailing" spacing
TURBO_SPACING, TURBO_STEPS, TURBO_CFG = "trailing", 1, 1.0
SDXL_TURBO = SDXL_BASE.replace(
    unet=dataclasses.replace(SDXL_BASE.unet, sample_size=64), vae=dataclasses.replace(_SDXL_VAE, sample_size=512),
    default_size=512, turbo=True, scheduler=dict(PUBLISHED_SCHEDULERS["sdxl-turbo"][1]))
# stabilityai/sd-turbo: SD 2.1 (23-layer OpenCLIP ViT-H text tower, epsilon) distilled the same way, 512x512
SD_TURBO = SD21_BASE.replace(turbo=True, scheduler=dict(PUBLISHED_SCHEDULERS["sd-turbo"][1]))

# stabilityai/stable-diffusion-x4-upscaler (model_index.json: StableDiffusionUpscalePipeline, max_noise_level 350;
# text_encoder, unet, vae config.json; scheduler and low_res_scheduler scheduler_config.json), the diffusers form of
# Stability-AI/stablediffusion configs/stable-diffusion/x4-upscaling.yaml. SD 2.x's OpenCLIP ViT-H text tower. The
# UNet takes 7 channels (4 latent + the noised low-resolution RGB image), 256/512/512/1024 wide, attention at the
# last three levels with 8 heads each and linear projections; at the middle two levels the first attention of each
# transformer block attends to the text too (only_cross_attention); the noise level of the low-resolution image is a
# class label (1000 embeddings). A 3-level VAE (the latent is H/4 x W/4) scaled by 0.08333 (the pipeline enforces
# it). The latent has the input image's size: the output is 4x the input.
X4_FAMILY = "sd-x4-upscaler"
X4_SCALING_FACTOR = 0.08333
X4_LOW_RES_SCHEDULER = {"_class_name": "DDPMScheduler", "beta_start": 0.0001, "beta_end": 0.02,
                        "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "clip_sample": True,
                        "prediction_type": "epsilon", "trained_betas": None, "variance_type": "fixed_small"}
X4_MAX_NOISE_LEVEL = 350
SD_X4_UPSCALER = ModelSpec(
    family=X4_FAMILY,
    text=_SD2_TEXT,
    unet=UNetConfig(in_channels=7, block_channels=(256, 512, 512, 1024), attention=(False, True, True, True),
                    heads=(8, 8, 8, 8), context_dim=1024, linear_projection=True, num_class_embeds=1000,
                    cross_only=(False, True, True, False), sample_size=128),
    vae=VAEConfig(block_channels=(128, 256, 512), scaling_factor=X4_SCALING_FACTOR, sample_size=256),
    prediction_type="v_prediction",
    default_size=512,
    scheduler=dict(PUBLISHED_SCHEDULERS[X4_FAMILY][1]),
    low_res_scheduler=dict(X4_LOW_RES_SCHEDULER),
    max_noise_level=X4_MAX_NOISE_LEVEL,
)

PRESETS: dict[str, ModelSpec] = {
    "sd15": SD15,
    "sd15-inpaint": SD15_INPAINT,
    "sd21-base": SD21_BASE,
    "sd21": SD21_BASE,
    "sd21-v": SD21_V,
    "sd2-inpaint": SD2_INPAINT,
    "demo": DEMO,
    "taiyi": TAIYI,
    "sdxl": SDXL_BASE,
    "sdxl-refiner": SDXL_REFINER,
    "sdxl-turbo": SDXL_TURBO,
    "sd-turbo": SD_TURBO,
    "sd-x4-upscaler": SD_X4_UPSCALER,
}
