"""The SD3 / SD3.5 releases as whole models (:class:`~sdlite.config.ModelSpec`): their three text encoders, transformer,
VAE and scheduler, from the published diffusers folders' config files.

* stabilityai/stable-diffusion-3-medium-diffusers, stabilityai/stable-diffusion-3.5-medium and
  stabilityai/stable-diffusion-3.5-large (and -large-turbo, the same networks): text_encoder (CLIPTextModelWithProjection,
  CLIP ViT-L/14: 12 layers of 768, projection 768), text_encoder_2 (OpenCLIP bigG: 32 layers of 1280, GELU, projection
  1280, pads with "!"), text_encoder_3 (T5EncoderModel, google/t5-v1_1-xxl), the transformer
  (:mod:`sdlite.config.mmdit`), the VAE (AutoencoderKL: 16 latent channels, no quant convolutions, scaling factor
  1.5305, shift factor 0.0609) and the scheduler (FlowMatchEulerDiscreteScheduler, shift 3.0).

:mod:`sdlite.weights.sd3` builds a spec like these from what a checkpoint holds; these presets are what it finds in
the released files, for benchmarks and shape checks.
"""
from __future__ import annotations

from . import ModelSpec, TextEncoderConfig, VAEConfig
from .mmdit import SD3_MEDIUM, SD35_LARGE, SD35_MEDIUM
from .t5 import T5_XXL

__all__ = ["SD3_TEXT_L", "SD3_TEXT_G", "SD3_VAE", "SD3_SCHEDULER", "SD3_MEDIUM_MODEL", "SD35_MEDIUM_MODEL",
           "SD35_LARGE_MODEL", "SD3_PRESETS"]

SD3_TEXT_L = TextEncoderConfig(projection_dim=768)
SD3_TEXT_G = TextEncoderConfig(width=1280, layers=32, heads=20, mlp_width=5120, activation="gelu", pad_token_id=0,
                               eos_token_id=2, projection_dim=1280)
SD3_VAE = VAEConfig(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                    use_post_quant_conv=False, sample_size=1024)
SD3_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def _model(family: str, transformer) -> ModelSpec:
    return ModelSpec(family=family, text=SD3_TEXT_L, text2=SD3_TEXT_G, text3=T5_XXL, unet=None,
                     transformer=transformer, vae=SD3_VAE, prediction_type="flow", default_size=1024,
                     scheduler=dict(SD3_SCHEDULER))


SD3_MEDIUM_MODEL = _model("sd3", SD3_MEDIUM)
SD35_MEDIUM_MODEL = _model("sd3.5-medium", SD35_MEDIUM)
SD35_LARGE_MODEL = _model("sd3.5-large", SD35_LARGE)
SD3_PRESETS = {"sd3-medium": SD3_MEDIUM_MODEL, "sd3.5-medium": SD35_MEDIUM_MODEL, "sd3.5-large": SD35_LARGE_MODEL}
