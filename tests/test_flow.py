"""Flow matching (SD3 / SD3.5, FLUX): the flow schedule's sigmas, the flow denoiser and the samplers on flow
against diffusers' schedulers, plus the invariants of the samplers diffusers has no flow counterpart of.

The parity tests drive each diffusers scheduler as the SD3 (or FLUX) pipeline does -- the scheduler's timesteps
expanded to the batch go to the network, its output to ``scheduler.step`` -- and run ``sample()`` with a
:class:`FlowDenoiser` on the same deterministic fake network, the same initial noise (batch 2) and the same
generator seed.

Measured (CPU, float32, final latents of magnitude up to 1.9): Heun against FlowMatchHeunDiscreteScheduler is
bit-exact, and so are the sigmas, the network's timesteps and image to image's noised latent. Euler against
FlowMatchEulerDiscreteScheduler is within float32 rounding, not bit-exact (our step goes through ``denoised = x -
sigma * v`` and back through ``(x - denoised) / sigma``): max abs difference 2.4e-7 (Karras, exponential and FLUX's
dynamic shift alike). DPM-Solver++(2M), its SDE form and UniPC against the multistep schedulers with
``use_flow_sigmas`` are within float32 rounding (``expm1`` against ``exp - 1`` and the order of their algebra):
max abs differences 7.2e-7, 5.4e-7 and 1.2e-7.
"""
from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import diffusers
import numpy as np
import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as reference_calculate_shift
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img import \
    StableDiffusion3Img2ImgPipeline

from sdlite.sampling import (SAMPLERS, CFGDenoiser, FlowDenoiser, FlowSchedule, NoiseSchedule, ScheduleError,
                             calculate_shift, img2img_start, plan, sample, sample_euler, sample_euler_ancestral,
                             schedule_from_config)
from sdlite.sampling.denoisers import Recorded

# diffusers' schedulers call np.array on torch tensors, which numpy 2 flags; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")

SEED = 1234
SHAPE = (2, 4, 8, 8)
# stabilityai/stable-diffusion-3.5-large scheduler/scheduler_config.json (SD3 medium's is the same)
SD3 = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
# black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json
FLUX = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
        "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
        "use_dynamic_shifting": True}
FLOW_SAMPLERS = ["euler", "euler_a", "heun", "dpmpp_2m", "dpmpp_2m_sde", "unipc", "res_multistep",
                 "res_multistep_ancestral"]
# float32 rounding on latents of magnitude up to ~2 (the largest difference measured is 7.2e-7)
ROUNDING = 2e-6


class FakeFlowNet:
    """A fixed nonlinear function of x and t standing in for the transformer (a velocity ``v(x, t)``); the
    conditioning enters as a per-item offset. Records the timesteps it is given. ``t_scale``: what one unit of
    sigma is in the timesteps it is given (1000 for SD3's transformer, 1 for FLUX's)."""

    def __init__(self, t_scale: float = 1000.0):
        self.t_scale = t_scale
        self.timesteps: list[torch.Tensor] = []

    def __call__(self, x, t, context=None):
        t = torch.as_tensor(t).to(torch.float32).reshape(-1)
        assert t.shape == (x.shape[0],)
        self.timesteps.append(t.clone())
        s = t.reshape(-1, 1, 1, 1) / self.t_scale
        v = 0.9 * x - 0.6 * torch.tanh(1.3 * x) * (1 - 0.4 * s) + 0.15 * torch.sin(4 * s) * x.roll(1, -1)
        if context is not None:
            v = v + context.mean(dim=(1, 2)).reshape(-1, 1, 1, 1)
        return v


def _noise(seed=0):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _reference_loop(sched, x, set_kwargs, *, t_divisor=None, timesteps=None):
    """The SD3 pipeline's denoising loop (FLUX's with ``t_divisor=1000``: its transformer gets t / 1000)."""
    if timesteps is None:
        sched.set_timesteps(**set_kwargs)
        timesteps = sched.timesteps
    net = FakeFlowNet(1000.0 if t_divisor is None else 1.0)
    generator = torch.Generator().manual_seed(SEED)
    takes_generator = "generator" in inspect.signature(sched.step).parameters
    for t in timesteps:
        timestep = t.expand(x.shape[0])
        v = net(x, timestep if t_divisor is None else timestep / t_divisor)
        x = sched.step(v, t, x, **({"generator": generator} if takes_generator else {})).prev_sample
    return x, net.timesteps


def _ours(name, schedule, steps, noise, kind=None, eta=None, multiplier=None, **kwargs):
    net = FakeFlowNet(1000.0 if multiplier is None else multiplier)
    denoiser = FlowDenoiser(net, schedule, multiplier=multiplier)
    x = sample(name, denoiser, noise, schedule, steps, kind, generator=torch.Generator().manual_seed(SEED),
               eta=eta, **kwargs)
    return x, net.timesteps


def _max_abs(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _same_timesteps(ours, ref):
    assert len(ours) == len(ref)
    assert all(torch.equal(a, b.to(torch.float32)) for a, b in zip(ours, ref))


# --- the schedule's sigmas: bit-equal to each scheduler's set_timesteps ---------------------------------------

@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 20, 28])
def test_euler_placement_is_flow_match_euler_bit_for_bit(steps, shift):
    schedule = FlowSchedule.from_config(dict(SD3, shift=shift))
    for kind, flag in [("discrete", {}), ("karras", {"use_karras_sigmas": True}),
                       ("exponential", {"use_exponential_sigmas": True})]:
        for terminal in (None, 0.1) if steps > 1 else (None,):   # one step: 0 / 0 (refused, see below)
            ref = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift, shift_terminal=terminal, **flag)
            ref.set_timesteps(steps)
            sigmas, timesteps = dataclasses.replace(schedule, shift_terminal=terminal).make_sigmas(steps, kind)
            assert torch.equal(sigmas, ref.sigmas) and torch.equal(timesteps, ref.timesteps), (kind, terminal)
    heun = diffusers.FlowMatchHeunDiscreteScheduler(shift=shift)
    heun.set_timesteps(steps)   # lists each inner sigma twice
    sigmas, timesteps = schedule.make_sigmas(steps)
    assert torch.equal(sigmas, torch.unique_consecutive(heun.sigmas))
    assert torch.equal(timesteps, torch.unique_consecutive(heun.timesteps))
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 20, 28])
def test_multistep_placements_are_the_flow_sigma_schedulers_bit_for_bit(steps, shift):
    schedule = FlowSchedule.from_config(dict(SD3, shift=shift))
    dpm = diffusers.DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=shift,
                                                prediction_type="flow_prediction")
    dpm.set_timesteps(steps)
    sigmas, timesteps = schedule.make_sigmas(steps, family="dpmsolver")
    assert torch.equal(sigmas, dpm.sigmas) and torch.equal(timesteps, dpm.timesteps.float())
    assert sigmas[0] < 1  # it starts just below 1, where VE sigma / (1 - sigma) is finite
    for terminal in (None, 0.1) if steps > 1 else (None,):   # one step with a terminal stretch: 0 / 0
        unipc = diffusers.UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=shift, shift_terminal=terminal,
                                                  prediction_type="flow_prediction")
        unipc.set_timesteps(steps)
        sigmas, timesteps = dataclasses.replace(schedule, shift_terminal=terminal).make_sigmas(steps, family="unipc")
        assert torch.equal(sigmas, unipc.sigmas) and torch.equal(timesteps, unipc.timesteps.float())


@pytest.mark.parametrize("time_shift_type", ["exponential", "linear"])
@pytest.mark.parametrize("image_seq_len", [256, 1024, 4096, 777])
def test_dynamic_shifting_with_mu_bit_for_bit(image_seq_len, time_shift_type):
    cfg = dict(FLUX, time_shift_type=time_shift_type)
    mu = reference_calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15)
    assert calculate_shift(image_seq_len) == mu
    schedule = FlowSchedule.from_config(cfg).for_image(image_seq_len)
    assert schedule.mu == mu
    flux = dataclasses.replace(schedule, sigma_spacing="linear")   # what FLUX's pipeline passes as sigmas
    for steps in (1, 4, 28):
        for kind, flag in [("discrete", {}), ("karras", {"use_karras_sigmas": True})]:
            ref = diffusers.FlowMatchEulerDiscreteScheduler.from_config({**cfg, **flag})
            ref.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
            sigmas, timesteps = flux.make_sigmas(steps, kind)
            assert torch.equal(sigmas, ref.sigmas) and torch.equal(timesteps, ref.timesteps)
        ref = diffusers.FlowMatchEulerDiscreteScheduler.from_config(cfg)
        ref.set_timesteps(steps, mu=mu)   # the scheduler's own spacing (SD3's pipeline with a dynamic config)
        sigmas, timesteps = schedule.make_sigmas(steps)
        assert torch.equal(sigmas, ref.sigmas) and torch.equal(timesteps, ref.timesteps)
        unipc = diffusers.UniPCMultistepScheduler(use_flow_sigmas=True, use_dynamic_shifting=True,
                                                  time_shift_type=time_shift_type, prediction_type="flow_prediction")
        unipc.set_timesteps(steps, mu=mu)
        sigmas, timesteps = schedule.make_sigmas(steps, family="unipc")
        assert torch.equal(sigmas, unipc.sigmas) and torch.equal(timesteps, unipc.timesteps.float())
        if time_shift_type == "exponential":
            dpm = diffusers.DPMSolverMultistepScheduler(use_flow_sigmas=True, use_dynamic_shifting=True,
                                                        prediction_type="flow_prediction")
            dpm.set_timesteps(steps, mu=mu)
            sigmas, timesteps = schedule.make_sigmas(steps, family="dpmsolver")
            assert torch.equal(sigmas, dpm.sigmas) and torch.equal(timesteps, dpm.timesteps.float())


@pytest.mark.parametrize("steps", [1, 4, 20])
def test_explicit_sigmas_bit_for_bit(steps):
    custom = np.linspace(0.95, 0.05, steps)
    schedule = FlowSchedule.from_config(SD3).with_sigmas(list(custom))
    ref = diffusers.FlowMatchEulerDiscreteScheduler.from_config(SD3)
    ref.set_timesteps(sigmas=list(custom))
    sigmas, timesteps = schedule.make_sigmas(steps)
    assert torch.equal(sigmas, ref.sigmas) and torch.equal(timesteps, ref.timesteps)
    unipc = diffusers.UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    unipc.set_timesteps(sigmas=custom.copy())
    sigmas, timesteps = schedule.make_sigmas(steps, family="unipc")
    assert torch.equal(sigmas, unipc.sigmas) and torch.equal(timesteps, unipc.timesteps.float())
    with pytest.raises(ScheduleError, match=f"steps={steps + 1}"):
        schedule.make_sigmas(steps + 1)


# --- samplers against diffusers' flow schedulers ---------------------------------------------------------------

@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 20, 28])
def test_euler_matches_flow_match_euler(steps, shift):
    """Within float32 rounding: the Euler step through the denoiser, ``x + (s' - s) (x - (x - s v)) / s``, is
    the scheduler's ``x + (s' - s) v`` up to the rounding of the round trip."""
    noise = _noise()
    ref, ref_t = _reference_loop(diffusers.FlowMatchEulerDiscreteScheduler(shift=shift), noise,
                                 {"num_inference_steps": steps})
    ours, our_t = _ours("euler", FlowSchedule.from_config(dict(SD3, shift=shift)), steps, noise)
    _same_timesteps(our_t, ref_t)
    assert _max_abs(ours, ref) <= ROUNDING


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 20, 28])
def test_heun_matches_flow_match_heun_bit_for_bit(steps, shift):
    noise = _noise(1)
    ref, ref_t = _reference_loop(diffusers.FlowMatchHeunDiscreteScheduler(shift=shift), noise,
                                 {"num_inference_steps": steps})
    ours, our_t = _ours("heun", FlowSchedule.from_config(dict(SD3, shift=shift)), steps, noise)
    _same_timesteps(our_t, ref_t)   # 2 * steps - 1 network calls, the step to 0 an Euler step
    assert len(our_t) == 2 * steps - 1
    assert torch.equal(ours, ref)


MULTISTEP = [
    ("dpmpp_2m", "DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    ("dpmpp_2m_sde", "DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    ("unipc", "UniPCMultistepScheduler", {}),
]


@pytest.mark.parametrize("name,cls_name,kwargs", MULTISTEP, ids=[m[0] for m in MULTISTEP])
@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 20, 28])
def test_multistep_samplers_match_flow_sigma_schedulers(name, cls_name, kwargs, steps, shift):
    """DPM-Solver++ and UniPC in log-SNR time lambda = log((1 - sigma) / sigma), as the schedulers compute them
    with ``use_flow_sigmas`` (k-diffusion's lambda = -log(sigma) would differ by far more than rounding)."""
    noise = _noise(2)
    sched = getattr(diffusers, cls_name)(use_flow_sigmas=True, flow_shift=shift, prediction_type="flow_prediction",
                                         **kwargs)
    ref, ref_t = _reference_loop(sched, noise, {"num_inference_steps": steps})
    schedule = FlowSchedule.from_config(dict(SD3, shift=shift))
    ours, our_t = _ours(name, schedule, steps, noise)
    _same_timesteps(our_t, ref_t)   # the schedulers' truncated integer timesteps
    assert _max_abs(ours, ref) <= ROUNDING
    if steps >= 4 and name != "dpmpp_2m_sde":   # the log-SNR time matters: k-diffusion's is measurably off
        info = SAMPLERS[name]
        sigmas, timesteps = schedule.make_sigmas(steps, family=info.flow_family)
        ve_lambda = info.fn(FlowDenoiser(FakeFlowNet(), schedule).with_timesteps(sigmas, timesteps), noise,
                            sigmas)   # no schedule: alpha = 1, lambda = -log(sigma)
        assert _max_abs(ve_lambda, ref) > 10 * max(_max_abs(ours, ref), 1e-6)


@pytest.mark.parametrize("name", ["dpmpp_2m", "dpmpp_2m_sde", "unipc"])
def test_exponential_integrators_start_from_sigma_1(name):
    """At sigma 1 (alpha 0) lambda is -inf: the first step is then the exact first-order step from pure noise,
    ``sigma' x + (1 - sigma') D``, and nothing turns infinite or NaN later."""
    schedule = FlowSchedule.from_config(SD3)
    sigmas, _ = schedule.make_sigmas(12)   # the Euler placement starts at exactly 1
    assert sigmas[0] == 1.0
    denoiser = FlowDenoiser(FakeFlowNet(), schedule)
    noise = _noise(19)
    out = SAMPLERS[name].fn(denoiser, noise, sigmas, schedule=schedule, generator=torch.Generator().manual_seed(SEED))
    assert torch.isfinite(out).all()
    first = SAMPLERS[name].fn(denoiser, noise, sigmas[:2], schedule=schedule)   # one step, to sigmas[1] > 0
    if name != "dpmpp_2m_sde":
        expected = sigmas[1] * noise + (1 - sigmas[1]) * denoiser(noise, torch.ones(2))
        assert _max_abs(first, expected) <= ROUNDING


def test_euler_karras_and_exponential_match_flow_match_euler():
    noise = _noise(3)
    schedule = FlowSchedule.from_config(SD3)
    for kind, flag in [("karras", {"use_karras_sigmas": True}), ("exponential", {"use_exponential_sigmas": True})]:
        ref, ref_t = _reference_loop(diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, **flag), noise,
                                     {"num_inference_steps": 12})
        ours, our_t = _ours(f"euler_{kind}", schedule, 12, noise)
        _same_timesteps(our_t, ref_t)
        assert _max_abs(ours, ref) <= ROUNDING


@pytest.mark.parametrize("name", ["euler", "unipc"])
def test_flux_dynamic_shift_with_its_timestep_scale(name):
    """FLUX: sigmas linspace(1, 1/n, n) time-shifted at mu, and the transformer given t / 1000 (multiplier 1)."""
    noise, steps, seq_len = _noise(4), 20, 1024
    mu = reference_calculate_shift(seq_len, 256, 4096, 0.5, 1.15)
    schedule = dataclasses.replace(FlowSchedule.from_config(FLUX).for_image(seq_len), sigma_spacing="linear")
    if name == "euler":
        sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(FLUX)
        set_kwargs = {"num_inference_steps": steps, "sigmas": np.linspace(1.0, 1 / steps, steps), "mu": mu}
    else:   # FLUX's pipeline passes no sigmas to a scheduler with use_flow_sigmas
        sched = diffusers.UniPCMultistepScheduler(use_flow_sigmas=True, use_dynamic_shifting=True,
                                                  prediction_type="flow_prediction")
        set_kwargs = {"num_inference_steps": steps, "mu": mu}
    ref, ref_t = _reference_loop(sched, noise, set_kwargs, t_divisor=1000)
    ours, our_t = _ours(name, schedule, steps, noise, multiplier=1.0)
    _same_timesteps(our_t, ref_t)
    assert _max_abs(ours, ref) <= ROUNDING


def test_cfg_on_flow_matches_the_sd3_pipelines_guidance():
    """SD3's pipeline guides the velocity ([uncond, cond] batch); guiding the denoised estimate is the same affine
    combination. Recorded keeps the last estimate and changes nothing."""
    schedule = FlowSchedule.from_config(SD3)
    cond, uncond = torch.full((2, 77, 8), 0.3), torch.full((2, 77, 8), -0.2)
    noise, scale, steps = _noise(5), 7.0, 10
    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(SD3)
    sched.set_timesteps(steps)
    net = FakeFlowNet()
    x = noise
    for t in sched.timesteps:
        v_u, v_c = net(torch.cat([x, x]), t.expand(2 * x.shape[0]), torch.cat([uncond, cond])).chunk(2)
        x = sched.step(v_u + scale * (v_c - v_u), t, x).prev_sample
    ours_net = FakeFlowNet()
    recorded = Recorded(CFGDenoiser(FlowDenoiser(ours_net, schedule), scale))
    ours = sample("euler", recorded, noise, schedule, steps, extra_args={"context": cond, "uncond": uncond})
    _same_timesteps(ours_net.timesteps, net.timesteps)
    # the guidance scale multiplies the rounding of the two estimates' difference: measured 2.1e-6 at scale 7
    assert _max_abs(ours, x) <= scale * ROUNDING
    assert recorded.value is not None and _max_abs(recorded.value, ours) <= ROUNDING  # the last step goes to 0


def test_hand_off_at_a_step_continues_the_same_run():
    schedule = FlowSchedule.from_config(SD3)
    noise = _noise(6)
    whole, _ = _ours("euler", schedule, 12, noise)
    first, _ = _ours("euler", schedule, 12, noise, end=5)
    second, _ = _ours("euler", schedule, 12, first, start=5, noised=True)
    assert torch.equal(second, whole)


# --- image to image ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps,strength", [(28, 0.6), (20, 0.75), (4, 0.5), (10, 0.33), (28, 1.0), (7, 0.9)])
def test_img2img_start_and_noised_latent_as_sd3_img2img(steps, strength):
    schedule = FlowSchedule.from_config(SD3)
    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(SD3)
    sched.set_timesteps(steps)
    pipe = SimpleNamespace(scheduler=sched)
    timesteps, remaining = StableDiffusion3Img2ImgPipeline.get_timesteps(pipe, steps, strength, "cpu")
    start = img2img_start(steps, strength, schedule)
    assert start == steps - remaining
    x0, noise = _noise(7) * 0.8 + 0.1, _noise(8)
    latent_timestep = timesteps[:1].repeat(x0.shape[0])
    reference_noised = sched.scale_noise(x0, latent_timestep, noise)
    p = plan("euler", schedule, steps)
    ours_noised = schedule.noised(x0, noise, p.sigmas[start])
    assert torch.equal(ours_noised, reference_noised)
    # the rest of the run, from the noised latent over the remaining timesteps
    ref, ref_t = _reference_loop(sched, reference_noised, {}, timesteps=timesteps)
    ours, our_t = _ours("euler", schedule, steps, ours_noised, start=start, noised=True)
    _same_timesteps(our_t, ref_t)
    assert _max_abs(ours, ref) <= ROUNDING


def test_img2img_start_rules_differ_between_sd_and_sd3():
    """SD3's pipeline truncates the steps it skips, StableDiffusion's the steps it runs."""
    flow, ddpm = FlowSchedule.from_config(SD3), NoiseSchedule.from_config({"beta_schedule": "scaled_linear"})
    assert img2img_start(28, 0.6, flow) == 11 and img2img_start(28, 0.6, ddpm) == img2img_start(28, 0.6) == 12


def test_noising_hooks_of_both_schedules():
    x0, noise, sigma = _noise(9), _noise(10), torch.tensor(0.37)
    flow, ddpm = FlowSchedule.from_config(SD3), NoiseSchedule.from_config({"beta_schedule": "scaled_linear"})
    assert torch.equal(flow.noised(x0, noise, sigma), sigma * noise + (1 - sigma) * x0)
    assert torch.equal(ddpm.noised(x0, noise, sigma), x0 + noise * sigma)
    assert torch.equal(flow.to_sampler(x0, sigma), x0) and torch.equal(flow.from_sampler(x0, sigma), x0)
    assert torch.allclose(ddpm.from_sampler(ddpm.to_sampler(x0, sigma), sigma), x0, rtol=1e-6, atol=0)
    assert float(plan("euler", flow, 10).init_scale) == 1.0
    assert torch.equal(flow.alphas(torch.tensor([1.0, 0.25, 0.0])), torch.tensor([0.0, 0.75, 1.0]))


# --- Euler ancestral on flow: no diffusers reference; its invariants -----------------------------------------

@pytest.mark.parametrize("steps", [1, 4, 28])
def test_euler_ancestral_with_eta_0_is_euler(steps):
    schedule = FlowSchedule.from_config(SD3)
    noise = _noise(11)
    euler, _ = _ours("euler", schedule, steps, noise)
    ancestral, _ = _ours("euler_a", schedule, steps, noise, eta=0.0)
    assert torch.equal(ancestral, euler)


def _flow_to_ve(denoiser):
    """A denoiser on k-diffusion's latent y = x / (1 - sigma) at s = sigma / (1 - sigma), from a flow one."""
    def ve(y, s, **extra):
        sigma = s / (1 + s)
        return denoiser(y / (1 + s).reshape(-1, 1, 1, 1), sigma, **extra)
    return ve


@pytest.mark.parametrize("eta", [1.0, 0.6])
def test_euler_ancestral_is_k_diffusions_in_ve_coordinates(eta):
    """Derived from k-diffusion's ancestral step in the VE coordinates of the flow latent: the same run there, from
    sigma < 1 where those are finite, with the same noise draws, ends at the same latent."""
    schedule = FlowSchedule.from_config(SD3)
    sigmas, _ = schedule.make_sigmas(16, family="dpmsolver")   # starts at 0.99967 < 1
    flow_denoiser = FlowDenoiser(FakeFlowNet(), schedule)
    x = _noise(12)
    ours = sample_euler_ancestral(flow_denoiser, x, sigmas, eta=eta, schedule=schedule,
                                  generator=torch.Generator().manual_seed(SEED))
    ve_sigmas = (sigmas.double() / (1 - sigmas.double())).float()
    ve = sample_euler_ancestral(_flow_to_ve(flow_denoiser), x / (1 - sigmas[0]), ve_sigmas, eta=eta,
                                generator=torch.Generator().manual_seed(SEED))
    # the VE run's first sigma is 3000 and its latent 3000 times the flow one: measured 3.9e-6 (eta 0.6)
    assert _max_abs(ours, ve) <= 2e-5


def test_euler_ancestral_keeps_the_noise_variance_sigma_squared():
    """With a denoiser that returns the true x0, every step's latent is (1 - sigma') x0 + sigma' eps with eps
    standard normal; eta = 1 replaces the fraction u = sqrt(1 - r^2) of it with fresh noise (r the step's ratio
    of VE sigmas), so consecutive eps correlate by sqrt(1 - u^2) = r; the first step from sigma 1 renoises
    fully."""
    schedule = FlowSchedule.from_config(SD3)
    sigmas, _ = schedule.make_sigmas(8)
    assert sigmas[0] == 1.0
    x0 = torch.linspace(-1.5, 1.5, 4 * 128 * 128).reshape(1, 4, 128, 128).repeat(2, 1, 1, 1)
    eps0 = torch.randn(x0.shape, generator=torch.Generator().manual_seed(13))
    seen = [eps0]

    def residual(i, n, x):
        s = sigmas[i + 1]
        if s > 0:
            seen.append((x - (1 - s) * x0) / s)

    sample_euler_ancestral(lambda x, s: x0, eps0, sigmas, schedule=schedule, callback=residual,
                           generator=torch.Generator().manual_seed(14))
    assert len(seen) == len(sigmas) - 1
    for i, eps in enumerate(seen[1:]):
        s, s_next = sigmas[i].double(), sigmas[i + 1].double()
        r = (s_next * (1 - s) / (s * (1 - s_next))).item()
        assert abs(eps.mean().item()) < 0.01
        assert abs(eps.std().item() - 1) < 0.01, (i, eps.std().item())
        corr = (eps * seen[i]).mean().item()
        assert abs(corr - r) < 0.01, (i, corr, r)
    assert abs((seen[1] * eps0).mean().item()) < 0.01   # r = 0 at sigma 1


# --- convergence and sampling on Gaussian data (exact denoiser and ODE) --------------------------------------

MU, S = 0.5, 0.8   # data ~ N(MU, S^2) per element


def gaussian_flow_denoiser(x, sigma, **_):
    """E[x0 | x] for x = (1 - sigma) x0 + sigma noise and Gaussian data."""
    s = sigma.reshape(-1, 1, 1, 1).double()
    a = 1 - s
    return (MU + a * S**2 / (a**2 * S**2 + s**2) * (x.double() - a * MU)).to(x.dtype)


def exact_flow_ode(x, s0, s1):
    """The probability-flow ODE's solution: (x - (1 - s) MU) / sqrt((1 - s)^2 S^2 + s^2) is constant."""
    def std(s):
        return ((1 - s) ** 2 * S**2 + s**2) ** 0.5
    return (1 - s1) * MU + std(s1) * (x - (1 - s0) * MU) / std(s0)


def _smooth_grid(steps):
    """SD3's shift of evenly spaced sigmas from 0.99 to 0.02 (float64; the step to 0, first order in every
    sampler, left out)."""
    t = torch.linspace(0.99, 0.02, steps + 1, dtype=torch.float64)
    return 3 * t / (1 + 2 * t)


# measured from 32 to 128 steps: Euler 3.9x, Heun 17x, DPM++(2M) 17x, UniPC 7x, RES multistep 20x; errors at 128
# steps 0.035, 1.5e-4, 3.3e-3, 5.6e-4, 4.7e-3
CONVERGENCE = {"euler": (3.5, 0.05), "heun": (12, 3e-4), "dpmpp_2m": (12, 5e-3), "unipc": (6, 1e-3),
               "res_multistep": (12, 7e-3)}


@pytest.mark.parametrize("name", list(CONVERGENCE))
def test_deterministic_samplers_converge_on_flow(name):
    """Against the exact ODE solution the error falls with the method's order: 4x per 4x steps for Euler, about
    16x for the second-order ones."""
    schedule = FlowSchedule.from_config(SD3)
    fn = SAMPLERS[name].fn
    x = torch.randn(1, 1, 32, 32, generator=torch.Generator().manual_seed(15)).double()
    errors = []
    for steps in (8, 32, 128):
        sigmas = _smooth_grid(steps)
        kwargs = {"schedule": schedule} if "schedule" in inspect.signature(fn).parameters else {}
        out = fn(gaussian_flow_denoiser, x, sigmas, **kwargs)
        errors.append((out - exact_flow_ode(x, sigmas[0], sigmas[-1])).abs().max().item())
    min_ratio, max_error = CONVERGENCE[name]
    assert errors[2] < errors[1] < errors[0], errors
    assert errors[1] / errors[2] > min_ratio, errors
    assert errors[2] < max_error, errors


@pytest.mark.parametrize("name", ["dpmpp_2m", "unipc"])
def test_exponential_integrators_on_flow_are_k_diffusions_in_ve_coordinates(name):
    """DPM-Solver++ and UniPC depend on the latent only through log-SNR: on the flow latent with alpha = 1 - sigma
    they equal k-diffusion's run on y = x / (1 - sigma) at sigma / (1 - sigma) (where that is finite)."""
    schedule = FlowSchedule.from_config(SD3)
    fn = SAMPLERS[name].fn
    x = torch.randn(1, 1, 32, 32, generator=torch.Generator().manual_seed(18)).double()
    sigmas = _smooth_grid(32)
    flow = fn(gaussian_flow_denoiser, x, sigmas, schedule=schedule)
    ve = fn(_flow_to_ve(gaussian_flow_denoiser), x / (1 - sigmas[0]), sigmas / (1 - sigmas))
    assert _max_abs(ve * (1 - sigmas[-1]), flow) < 1e-6


@pytest.mark.parametrize("name", ["euler_a", "dpmpp_2m_sde"])
def test_stochastic_samplers_sample_the_data_distribution_on_flow(name):
    schedule = FlowSchedule.from_config(SD3)
    generator = torch.Generator().manual_seed(16)
    x = torch.randn(1, 1, 96, 96, generator=generator)
    p = plan(name, schedule, 400)   # ancestral Euler's first-order bias: std 0.76 S at 100 steps, 0.79 S at 400
    x = SAMPLERS[name].fn(gaussian_flow_denoiser, x, p.sigmas, generator=generator, schedule=schedule)
    assert abs(x.mean().item() - MU) < 0.05
    assert abs(x.std().item() / S - 1) < 0.03


# --- what is refused -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ddim", "pndm", "lcm", "ddpm", "dpmpp_sde", "lms", "PLMS", "DPM++ SDE Karras"])
def test_samplers_without_a_flow_form_are_refused_by_name(name):
    schedule = FlowSchedule.from_config(SD3)
    with pytest.raises(ScheduleError) as err:
        plan(name, schedule, 10)
    message = str(err.value)
    assert "flow-matching" in message
    for ok in FLOW_SAMPLERS:
        assert ok in message
    with pytest.raises(ScheduleError):
        sample(name, FlowDenoiser(FakeFlowNet(), schedule), _noise(), schedule, 10)


def test_the_flow_samplers_are_the_ones_registered():
    assert [n for n, info in SAMPLERS.items() if info.flow_family is not None] == FLOW_SAMPLERS
    for name in FLOW_SAMPLERS:
        assert SAMPLERS[name].flow_reference


@pytest.mark.parametrize("field,value", [("invert_sigmas", True), ("stochastic_sampling", True),
                                         ("use_beta_sigmas", True), ("time_shift_type", "cosine"),
                                         ("_class_name", "FlowMatchLCMScheduler"), ("shift", -1.0),
                                         ("shift_terminal", 1.5)])
def test_flow_config_refuses_what_it_does_not_implement(field, value):
    with pytest.raises(ScheduleError, match=field if not field.startswith("_") else "FlowMatchLCMScheduler"):
        FlowSchedule.from_config({**SD3, field: value})


def test_flow_schedule_refusals_name_the_bad_value():
    schedule = FlowSchedule.from_config(SD3)
    with pytest.raises(ScheduleError, match="mu"):
        FlowSchedule.from_config(FLUX).make_sigmas(10)
    with pytest.raises(ScheduleError, match="karras"):
        plan("DPM++ 2M Karras", schedule, 10)
    with pytest.raises(ScheduleError, match="'trailing'"):
        plan("euler", schedule, 10, spacing="trailing")
    with pytest.raises(ScheduleError, match="steps=0"):
        schedule.make_sigmas(0)
    with pytest.raises(ScheduleError, match="shift_terminal"):
        dataclasses.replace(schedule, shift_terminal=0.1).make_sigmas(1)
    with pytest.raises(ScheduleError, match="custom sigmas"):
        schedule.with_sigmas([0.9, 0.5]).make_sigmas(2, family="dpmsolver")
    with pytest.raises(ScheduleError, match=r"custom sigmas \[0.5, 1.5\]"):
        schedule.with_sigmas([0.5, 1.5])
    with pytest.raises(ScheduleError, match="'cosine'"):
        dataclasses.replace(schedule, sigma_spacing="cosine")


def test_schedule_from_config_picks_the_kind():
    assert isinstance(schedule_from_config(SD3), FlowSchedule)
    assert isinstance(schedule_from_config(FLUX), FlowSchedule)
    ddpm = {"_class_name": "EulerDiscreteScheduler", "beta_schedule": "scaled_linear", "beta_start": 0.00085,
            "beta_end": 0.012}
    assert isinstance(schedule_from_config(ddpm), NoiseSchedule)
    with pytest.raises(ScheduleError, match="FlowMatchEulerDiscreteScheduler.*flow-matching"):
        NoiseSchedule.from_config(SD3)


def test_flow_denoiser_timesteps_and_dtype():
    schedule = FlowSchedule.from_config(SD3)
    net = FakeFlowNet()
    x = _noise(17)
    sigma = torch.tensor([0.25, 0.8])
    out = FlowDenoiser(net, schedule)(x, sigma)
    assert torch.equal(net.timesteps[-1], sigma * 1000)
    v = FakeFlowNet()(x, sigma * 1000)
    assert torch.equal(out, x - sigma.reshape(-1, 1, 1, 1) * v)
    flux_net = FakeFlowNet(1.0)
    FlowDenoiser(flux_net, schedule, multiplier=1.0)(x, sigma)
    assert torch.equal(flux_net.timesteps[-1], sigma * 1000 / 1000)
    half = FlowDenoiser(lambda x_in, t: (x_in.float() * 0 + 1).to(x_in.dtype), schedule, dtype=torch.float16)
    out = half(x, sigma)
    assert out.dtype == torch.float32 and torch.equal(out, x - sigma.reshape(-1, 1, 1, 1))
    ones = torch.ones(2, 1, 8, 8)
    seen = []
    FlowDenoiser(lambda x_in, t: seen.append(x_in) or x_in[:, :4], schedule)(x, sigma, concat=ones)
    assert seen[0].shape == (2, 5, 8, 8) and torch.equal(seen[0][:, 4:], ones)
    # one Euler step from pure noise to 0 lands on the estimate x - v(x, t = 1000)
    one_step = sample_euler(FlowDenoiser(FakeFlowNet(), schedule), x, torch.tensor([1.0, 0.0]))
    assert _max_abs(one_step, x - FakeFlowNet()(x, torch.full((2,), 1000.0))) <= ROUNDING
