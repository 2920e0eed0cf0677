"""Sampling: noise schedules, the eps/v and flow-matching denoiser wrappers with classifier-free guidance, and the
samplers.

    schedule = NoiseSchedule.from_config(spec.scheduler)
    denoiser = CFGDenoiser(Denoiser(unet, schedule, spec.prediction_type), scale=7.5)
    latent = sample("DPM++ 2M Karras", denoiser, noise, schedule, steps=20, generator=gen,
                    extra_args={"context": cond, "uncond": uncond})

Flow matching (SD3, FLUX) takes the same entry points with a :class:`FlowSchedule` and a :class:`FlowDenoiser`:

    schedule = FlowSchedule.from_config(scheduler_config)          # FLUX: .for_image(image_seq_len)
    denoiser = CFGDenoiser(FlowDenoiser(transformer, schedule), scale=7.0)
    latent = sample("euler", denoiser, noise, schedule, steps=28, generator=gen, extra_args=...)
"""
from .denoisers import CFGDenoiser, Denoiser, FlowDenoiser
from .flow import FLOW_FAMILIES, FlowSchedule, calculate_shift, schedule_from_config
from .samplers import (A1111_NAMES, SAMPLERS, BrownianNoise, Plan, SamplerInfo, img2img_start, plan,
                       resolve_sampler, sample,
                       sample_ddim, sample_ddpm, sample_dpmpp_2m, sample_dpmpp_2m_sde, sample_dpmpp_sde,
                       sample_euler, sample_euler_ancestral, sample_heun, sample_lcm, sample_lms, sample_pndm,
                       sample_tcd, sample_unipc)
from .schedules import (NoiseSchedule, ScheduleError, betas_for, exponential_sigmas, karras_sigmas, make_sigmas,
                        spaced_timesteps)

__all__ = [
    "A1111_NAMES", "FLOW_FAMILIES", "SAMPLERS", "BrownianNoise", "CFGDenoiser", "Denoiser", "FlowDenoiser",
    "FlowSchedule", "NoiseSchedule", "Plan", "SamplerInfo", "calculate_shift", "img2img_start", "plan",
    "ScheduleError", "betas_for", "exponential_sigmas", "karras_sigmas", "make_sigmas", "resolve_sampler",
    "sample", "sample_ddim", "sample_ddpm", "sample_dpmpp_2m", "sample_dpmpp_2m_sde", "sample_dpmpp_sde",
    "sample_euler", "sample_euler_ancestral", "sample_heun", "sample_lcm", "sample_lms", "sample_pndm",
    "sample_tcd", "sample_unipc", "schedule_from_config", "spaced_timesteps",
]
