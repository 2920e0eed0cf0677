"""Sampling: noise schedules, the eps/v denoiser wrappers with classifier-free guidance, and the samplers.

    schedule = NoiseSchedule.from_config(spec.scheduler)
    denoiser = CFGDenoiser(Denoiser(unet, schedule, spec.prediction_type), scale=7.5)
    latent = sample("DPM++ 2M Karras", denoiser, noise, schedule, steps=20, generator=gen,
                    extra_args={"context": cond, "uncond": uncond})
"""
from .denoisers import CFGDenoiser, Denoiser
from .samplers import (A1111_NAMES, SAMPLERS, BrownianNoise, Plan, SamplerInfo, img2img_start, plan,
                       resolve_sampler, sample,
                       sample_ddim, sample_ddpm, sample_dpmpp_2m, sample_dpmpp_2m_sde, sample_dpmpp_sde,
                       sample_euler, sample_euler_ancestral, sample_heun, sample_lcm, sample_lms, sample_pndm,
                       sample_unipc)
from .schedules import (NoiseSchedule, ScheduleError, betas_for, exponential_sigmas, karras_sigmas, make_sigmas,
                        spaced_timesteps)

__all__ = [
    "A1111_NAMES", "SAMPLERS", "BrownianNoise", "CFGDenoiser", "Denoiser", "NoiseSchedule", "Plan", "SamplerInfo",
    "img2img_start", "plan",
    "ScheduleError", "betas_for", "exponential_sigmas", "karras_sigmas", "make_sigmas", "resolve_sampler",
    "sample", "sample_ddim", "sample_ddpm", "sample_dpmpp_2m", "sample_dpmpp_2m_sde", "sample_dpmpp_sde",
    "sample_euler", "sample_euler_ancestral", "sample_heun", "sample_lcm", "sample_lms", "sample_pndm",
    "sample_unipc", "spaced_timesteps",
]
