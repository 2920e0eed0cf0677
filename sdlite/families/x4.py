"""The SD x4 upscaler (stabilityai/stable-diffusion-x4-upscaler) as a family: text-guided latent diffusion whose UNet
reads a noised low-resolution image beside the latent and that image's noise level as a class label.

* **conditioning**: the prompt through its OpenCLIP text tower by A1111's rules, as SD 2.x; the low-resolution
  image in [-1, 1], noised to ``noise_level`` by the model's own DDPM schedule (``low_res_scheduler``:
  ``sqrt(a) x + sqrt(1 - a) n``), concatenated to the scaled latent (4 + 3 = 7 channels); ``noise_level`` as the
  UNet's class label, for both halves of the guidance batch (:meth:`X4Family.image_conditioning`);
* **latent format**: 4 channels at the input's own size (its VAE upsamples 4x), scaled by 0.08333;
* **parameterisation**: v-prediction; **default schedule**: the model's scheduler (DDIM for the published folder,
  :meth:`X4Family.default_sampler`).

It draws no images from text: the loop refuses it (:meth:`X4Family.check_generate`), and
:class:`sdlite.upscalers.x4.X4Upscaler` runs it on an image.
"""
from __future__ import annotations

import torch

from ..config import X4_FAMILY
from ..errors import RequestError
from ..sampling.samplers import resolve_sampler
from ..sampling.schedules import NoiseSchedule
from .sd import SDFamily

# the sampler that follows each diffusers scheduler class a model's scheduler_config.json may name
SCHEDULER_SAMPLERS = {
    "DDIMScheduler": "ddim", "PNDMScheduler": "pndm", "DDPMScheduler": "ddpm", "LMSDiscreteScheduler": "lms",
    "EulerDiscreteScheduler": "euler", "EulerAncestralDiscreteScheduler": "euler_a", "HeunDiscreteScheduler": "heun",
    "DPMSolverMultistepScheduler": "dpmpp_2m", "DPMSolverSDEScheduler": "dpmpp_sde",
    "UniPCMultistepScheduler": "unipc", "LCMScheduler": "lcm",
}


class X4Family(SDFamily):
    """The x4 upscaler: SD 2.x's text conditioning plus a noised low-resolution image and its noise level."""

    name = "x4-upscaler"

    @classmethod
    def takes(cls, spec) -> bool:
        return spec.family == X4_FAMILY

    def __init__(self, spec):
        super().__init__(spec)
        self.low_res_schedule = (NoiseSchedule.from_config(spec.low_res_scheduler)
                                 if spec.low_res_scheduler is not None else None)

    @property
    def inpainting(self) -> bool:
        return False   # its UNet's 3 extra input channels are the low-resolution image, not a mask

    @property
    def max_noise_level(self) -> int:
        return self.spec.max_noise_level

    def check_generate(self, request) -> None:
        raise RequestError(f"{self.spec.family} is the SD x4 upscaler: it upscales images rather than drawing "
                           "them (sdlite upscale IMAGE --model PATH, or sdlite.upscalers.x4.X4Upscaler)")

    def load_dtypes(self, ckpt, plan, device: torch.device, memory_mode: int, prepack, weight_dtype):
        # diffusers' upscale pipeline decodes in fp32 under fp16 (the VAE's force_upcast); bf16 has fp32's range
        vae_dtype = torch.float32 if plan.vae_dtype == torch.float16 and self.spec.vae.force_upcast \
            else plan.vae_dtype
        return weight_dtype, vae_dtype

    def default_sampler(self) -> tuple[str, str, list[str]]:
        """(sampler, sigma schedule, warnings): the sampler of the model's own scheduler (DDIM where sdlite has
        none for it)."""
        cfg = self.scheduler_config
        cls = cfg.get("_class_name")
        sampler = SCHEDULER_SAMPLERS.get(cls)
        if sampler is None:
            return "ddim", "discrete", [f"the model's scheduler {cls!r} has no sdlite sampler: DDIM is used"]
        if sampler == "dpmpp_2m" and "sde" in str(cfg.get("algorithm_type", "")):
            sampler = "dpmpp_2m_sde"
        kind = "karras" if cfg.get("use_karras_sigmas") else resolve_sampler(sampler)[1]
        return sampler, kind, []

    def image_conditioning(self, pixels: torch.Tensor, noise_level: int, generator: torch.Generator,
                           device) -> dict:
        """The denoiser's image conditioning for ``pixels`` (1, 3, h, w) in [-1, 1]: the image noised to
        ``noise_level`` (its noise is the generator's next draw) as ``concat``, the level as the class label of
        both guidance halves."""
        a = self.low_res_schedule.alphas_cumprod[noise_level]
        low = a ** 0.5 * pixels + (1 - a) ** 0.5 * torch.randn(pixels.shape, generator=generator)   # (1, 3, h, w)
        labels = torch.tensor([noise_level], device=device)
        return {"concat": low.to(device), "added": {"class_labels": labels}, "uncond_added": {"class_labels": labels}}
