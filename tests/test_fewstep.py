"""Few-step sampling: TCD against diffusers' TCDScheduler, explicit timesteps and sigmas against the schedulers that
take them (``set_timesteps(timesteps=...)`` / ``set_timesteps(sigmas=...)``), and how requests carry them.

The parity tests drive each diffusers scheduler as ``StableDiffusionPipeline`` does (``tests/test_samplers.py``'s
loop) and run ``sample()`` on the same deterministic fake UNet, the same initial noise (batch 2) and the same
generator seed, so the stochastic samplers' noise draws (TCD with gamma > 0, LCM, DDPM) must come in the
reference's order and shapes. Measured bound: the latents agree within the suite's TOL (relative 1e-4 of the
largest value); the timesteps the UNet sees are equal.
"""
from __future__ import annotations

import pytest
import torch

from sdlite.errors import RequestError
from sdlite.pipeline import Request, validate
from sdlite.sampling import (SAMPLERS, Denoiser, FlowSchedule, NoiseSchedule, ScheduleError, make_sigmas, plan,
                             resolve_sampler, sample)
from tests.reference import max_rel_err
from tests.test_samplers import SD_SCHEDULER, SEED, SHAPE, TOL, FakeUNet, _diffusers_loop

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")

DMD2 = [999, 749, 499, 249]   # tianweiy/DMD2's 4-step SDXL timesteps, as its model card passes them


def _ours(name, schedule, steps, noise, prediction_type="epsilon", eta=None):
    model = FakeUNet(prediction_type)
    x = sample(name, Denoiser(model, schedule, prediction_type), noise, schedule, steps,
               generator=torch.Generator().manual_seed(SEED), eta=eta)
    return x, model.timesteps


def _noise(seed=0):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


# --- TCD -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("steps,eta", [(1, 0.3), (2, 0.3), (4, 0.3), (4, 0.0), (4, 1.0), (8, 0.5), (6, 0.3)])
def test_tcd_matches_diffusers(steps, eta, prediction_type):
    noise = _noise()
    ref, ref_t, _ = _diffusers_loop("TCDScheduler", SD_SCHEDULER, prediction_type, steps, noise,
                                    step_kwargs={"eta": eta})
    ours, our_t = _ours("tcd", NoiseSchedule.from_config(SD_SCHEDULER), steps, noise, prediction_type, eta)
    assert torch.isfinite(ours).all()
    assert max_rel_err(ours, ref) <= TOL
    assert our_t == ref_t


def test_tcd_default_gamma_is_the_schedulers():
    """Left unset, gamma is TCDScheduler.step's default, 0.3 (diffusers' pipelines pass their own eta, 0.0 by
    default, to it: give eta to match one of those)."""
    noise = _noise(1)
    ref, _, _ = _diffusers_loop("TCDScheduler", SD_SCHEDULER, "epsilon", 4, noise)
    ours, _ = _ours("tcd", NoiseSchedule.from_config(SD_SCHEDULER), 4, noise)
    assert max_rel_err(ours, ref) <= TOL
    zero, _ = _ours("tcd", NoiseSchedule.from_config(SD_SCHEDULER), 4, noise, eta=0.0)
    assert max_rel_err(zero, ref) > 1e-2   # gamma matters: the default is not 0


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
def test_tcd_timesteps_and_final_sigma(spacing):
    config = dict(SD_SCHEDULER, timestep_spacing=spacing)
    sched = diffusers.TCDScheduler.from_config(config)
    schedule = NoiseSchedule.from_config(config)
    for steps in (1, 3, 4, 8, 50):
        sched.set_timesteps(steps)
        sigmas, timesteps = make_sigmas(schedule, steps, "discrete", SAMPLERS["tcd"].family)
        assert torch.equal(timesteps.long(), sched.timesteps)
        # the last step ends at timestep 0, the training sigma_min, not at 0
        assert sigmas[-1].item() == pytest.approx(schedule.sigma_min, rel=1e-6)
    with pytest.raises(ScheduleError, match="original_steps=50"):
        make_sigmas(schedule, 51, "discrete", "tcd")


def test_tcd_names():
    assert resolve_sampler("TCD") == ("tcd", "discrete")
    assert resolve_sampler("tcd") == ("tcd", "discrete")
    assert SAMPLERS["tcd"].reference == "TCDScheduler"


# --- explicit timesteps and sigmas against the schedulers that take them ---------------------------------------

# (our sampler, diffusers class, scheduler kwargs, set_timesteps kwargs, step kwargs)
EXPLICIT = [
    ("lcm", "LCMScheduler", {}, {"timesteps": DMD2}, {}),
    ("lcm", "LCMScheduler", {}, {"timesteps": [999, 499]}, {}),
    ("tcd", "TCDScheduler", {}, {"timesteps": DMD2}, {"eta": 0.3}),
    ("euler", "EulerDiscreteScheduler", {}, {"sigmas": [14.6146, 4.0, 1.5, 0.6, 0.0]}, {}),
    ("euler", "EulerDiscreteScheduler", {"timestep_spacing": "trailing"}, {"sigmas": [10.0, 2.0, 0.5, 0.0]}, {}),
    ("euler", "EulerDiscreteScheduler", {}, {"timesteps": DMD2}, {}),
    ("heun", "HeunDiscreteScheduler", {}, {"timesteps": [999, 666, 333]}, {}),
    ("dpmpp_2m", "DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}, {"timesteps": [999, 800, 500, 200, 50]},
     {}),
    ("ddpm", "DDPMScheduler", {}, {"timesteps": [999, 700, 400, 100]}, {}),
]


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("name,cls_name,sched_kwargs,set_kwargs,step_kwargs", EXPLICIT,
                         ids=[f"{c[0]}-{next(iter(c[3]))}-{len(next(iter(c[3].values())))}" for c in EXPLICIT])
def test_explicit_lists_match_diffusers(name, cls_name, sched_kwargs, set_kwargs, step_kwargs, prediction_type):
    config = dict(SD_SCHEDULER, **sched_kwargs)   # NoiseSchedule reads the spacing and ignores solver options
    noise = _noise(2)
    ref, ref_t, sched = _diffusers_loop(cls_name, config, prediction_type, None, noise, step_kwargs,
                                        set_kwargs=set_kwargs)
    schedule = NoiseSchedule.from_config(config).with_custom(**set_kwargs)
    (kind, values), = set_kwargs.items()
    steps = len(values) - (kind == "sigmas")   # diffusers' count: one step per timestep, one less than the sigmas
    ours, our_t = _ours(name, schedule, steps, noise, prediction_type, step_kwargs.get("eta"))
    assert max_rel_err(ours, ref) <= TOL
    assert torch.allclose(torch.tensor(our_t), torch.tensor(ref_t), rtol=0, atol=1e-4)
    if hasattr(sched, "sigmas"):
        p = plan(name, schedule, steps)
        assert torch.allclose(p.sigmas, torch.unique_consecutive(sched.sigmas.float()), rtol=1e-6, atol=0)


def test_explicit_timesteps_refused_where_the_reference_takes_none():
    schedule = NoiseSchedule.from_config(SD_SCHEDULER).with_custom(timesteps=DMD2)
    for name in ("euler_a", "ddim", "lms", "unipc", "dpmpp_sde", "pndm"):
        with pytest.raises(ScheduleError, match=r"explicit timesteps; the samplers that do: euler, heun"):
            plan(name, schedule, 4)
    sigmas = NoiseSchedule.from_config(SD_SCHEDULER).with_custom(sigmas=[10.0, 1.0, 0.0])
    with pytest.raises(ScheduleError, match=r"explicit sigmas; the samplers that do: euler$"):
        plan("lcm", sigmas, 2)
    with pytest.raises(ScheduleError, match="cannot be karras"):
        plan("dpmpp_2m_karras", schedule, 4)
    with pytest.raises(ScheduleError, match="steps=5, but the explicit timesteps give 4 steps"):
        plan("lcm", schedule, 5)


@pytest.mark.parametrize("kwargs,match", [
    ({"timesteps": [999, 749, 749]}, r"not strictly descending \(timesteps\[2\]=749 after 749\)"),
    ({"timesteps": [249, 499]}, "not strictly descending"),
    ({"timesteps": [1000, 500]}, r"timesteps\[0\]=1000 is out of range: expected 0 to 999"),
    ({"timesteps": [999, -1]}, r"timesteps\[1\]=-1 is out of range"),
    ({"timesteps": [999, 499.5]}, r"timesteps\[1\]=499.5 is not valid: timesteps are integers"),
    ({"timesteps": []}, "timesteps: the list is empty"),
    ({"sigmas": [14.0]}, "give at least two"),
    ({"sigmas": [14.0, 3.0, 0.8]}, "end the list with 0"),
    ({"sigmas": [1.0, 2.0, 0.0]}, "not strictly descending"),
    ({"sigmas": [3.0, 0.0, 0.0]}, r"sigmas\[1\]=0.0 is out of range"),
    ({"sigmas": [3.0, float("nan"), 0.0]}, r"sigmas\[1\]=nan is not valid"),
    ({"sigmas": [3.0, 1.0], "timesteps": [999]}, "not both"),
])
def test_explicit_lists_checked(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        NoiseSchedule.from_config(SD_SCHEDULER).with_custom(**kwargs)


def test_flow_explicit_sigmas_are_the_pipelines_sigmas():
    """On a flow-matching model the request's sigmas end with 0; the others are the pipelines' ``sigmas=`` (before
    the shift), as FlowMatchEulerDiscreteScheduler takes them."""
    config = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
    given = [1.0, 0.75, 0.5, 0.25]
    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    sched.set_timesteps(sigmas=given)
    p = plan("euler", FlowSchedule.from_config(config).with_custom(sigmas=given + [0.0]), 4)
    assert torch.equal(p.sigmas, sched.sigmas)
    assert torch.allclose(p.timesteps, sched.timesteps, rtol=0, atol=1e-4)
    with pytest.raises(ScheduleError, match="end the list with 0"):
        FlowSchedule.from_config(config).with_custom(sigmas=given)
    with pytest.raises(ScheduleError, match=r"lie in \(0, 1\]"):
        FlowSchedule.from_config(config).with_custom(sigmas=[2.0, 1.0, 0.0])
    with pytest.raises(ScheduleError, match="explicit timesteps are for DDPM-trained models"):
        FlowSchedule.from_config(config).with_custom(timesteps=DMD2)


# --- requests ------------------------------------------------------------------------------------------------------

def test_request_takes_its_steps_from_the_list():
    r = validate(Request("a cat", sampler="LCM", timesteps=DMD2))
    assert (r.steps, r.timesteps, r.sigmas) == (4, tuple(DMD2), None)
    r = validate(Request("a cat", sampler="Euler", steps=30, sigmas=[14.6, 3, 1, 0]))
    assert (r.steps, r.sigmas) == (3, (14.6, 3.0, 1.0, 0.0))


@pytest.mark.parametrize("changes,match", [
    ({"timesteps": DMD2, "sigmas": [1.0, 0.0]}, "not both"),
    ({"timesteps": [499, 999]}, "timesteps 499,999 are not strictly descending"),
    ({"timesteps": "999,499"}, "expected a list"),
    ({"sigmas": [2.0, -1.0]}, "out of range"),
    ({"timesteps": DMD2, "sampler": "DPM++ 2M Karras"}, "cannot be karras sigmas"),
])
def test_request_lists_checked(changes, match):
    with pytest.raises(RequestError, match=match):
        validate(Request("a cat", **{"sampler": "lcm", **changes}))
