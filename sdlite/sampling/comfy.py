"""ComfyUI's sampling conventions, as facts: its scheduler formulas, its sampler names, and how its KSampler scales
the start latent and draws its noise.

A DDPM-trained model's sampling in ComfyUI (``ModelSamplingDiscrete``) keeps the training sigmas as a float32
table; ``sigma(t)`` at a fractional timestep interpolates *log* sigma linearly, and ``timestep(sigma)`` is the
nearest table index (the UNet gets that integer). Its schedulers:

* ``normal``: timesteps evenly spaced from ``timestep(sigma_max)`` to ``timestep(sigma_min)`` (``steps`` of them;
  ``sgm_uniform``: ``steps + 1`` and the last dropped), ``sigma(t)`` of each, then 0;
* ``simple``: every ``N / steps``-th table sigma from the top (``sigmas[-(1 + int(i * N / steps))]``), then 0;
* ``ddim_uniform``: every ``N // steps``-th table sigma from index 1 upwards, reversed, with 0 at the end;
* ``karras`` (rho 7) and ``exponential``: between the table's sigma_min and sigma_max, then 0;
* ``beta``: the table sigmas at ``rint(beta.ppf(1 - i / steps, 0.6, 0.6) * (N - 1))``, repeats dropped, then 0.

The same formulas run on a flow-matching model's table (:class:`FlowTable`: ComfyUI's ``ModelSamplingDiscreteFlow``
for SD3, ``ModelSamplingFlux`` for FLUX.1 dev), whose ``timestep(sigma)`` is continuous.

KSampler's start latent (``noise_scaling``): an eps / v model's ``latent + sigma * noise``, where noise is scaled by
``sqrt(1 + sigma^2)`` instead when the run starts at the schedule's top (``sigma >= sigma_max``); a flow model's
``sigma * noise + (1 - sigma) * latent``. What it returns (``inverse_noise_scaling``): the eps / v latent as it is,
the flow latent divided by ``1 - sigma`` of the last sigma.

Its initial noise is one ``randn`` of the whole latent batch from a CPU generator seeded with the seed; the
ancestral and DDPM-style samplers draw their per-step noise (the whole batch at once) from another generator on the
latent's device, seeded with ``seed + 1`` on a CPU and ``seed`` elsewhere (``default_noise_sampler``). The SDE
samplers (``dpmpp_sde``, ``dpmpp_2m_sde``) draw theirs from torchsde's Brownian tree seeded with the seed: sdlite
draws the same law from its own Brownian path (:class:`~.samplers.BrownianNoise`), not the same numbers.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .schedules import NoiseSchedule, ScheduleError

# ComfyUI's scheduler names that sdlite computes (on a DDPM-trained model by ComfyUI's formulas above)
COMFY_SCHEDULERS = ("normal", "karras", "exponential", "sgm_uniform", "simple", "ddim_uniform", "beta")
# ComfyUI scheduler names sdlite does not compute (refused by name)
COMFY_SCHEDULERS_MISSING = ("linear_quadratic", "kl_optimal")

# ComfyUI's sampler names -> sdlite's samplers (sdlite.sampling.samplers.SAMPLERS). ComfyUI's "ddim" is its Euler
# sampler; "uni_pc_bh2" is UniPC with the B(h) = expm1(h) variant, sdlite's UniPC
COMFY_SAMPLERS = {
    "euler": "euler", "euler_ancestral": "euler_a", "heun": "heun", "lms": "lms", "dpmpp_2m": "dpmpp_2m",
    "dpmpp_2m_sde": "dpmpp_2m_sde", "dpmpp_sde": "dpmpp_sde", "ddim": "euler", "ddpm": "ddpm", "lcm": "lcm",
    "uni_pc_bh2": "unipc", "res_multistep": "res_multistep", "res_multistep_ancestral": "res_multistep_ancestral",
}
# ComfyUI's sampler names sdlite has no sampler for (refused by name)
COMFY_SAMPLERS_MISSING = (
    "euler_cfg_pp", "euler_ancestral_cfg_pp", "heunpp2", "dpm_2", "dpm_2_ancestral", "dpm_fast", "dpm_adaptive",
    "dpmpp_2s_ancestral", "dpmpp_2s_ancestral_cfg_pp", "dpmpp_sde_gpu", "dpmpp_2m_sde_gpu", "dpmpp_2m_cfg_pp",
    "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ipndm", "ipndm_v", "deis", "res_multistep_cfg_pp",
    "res_multistep_ancestral_cfg_pp", "gradient_estimation",
    "er_sde", "seeds_2", "seeds_3", "sa_solver", "uni_pc",
)


class _SigmaTable:
    """A ComfyUI model-sampling table: ``sigmas`` ascending in the timestep, and ``timestep`` / ``sigma`` mapping
    between them (the subclasses)."""

    sigmas: torch.Tensor

    @property
    def sigma_min(self) -> float:
        return float(self.sigmas[0])

    @property
    def sigma_max(self) -> float:
        return float(self.sigmas[-1])


class ComfyTable(_SigmaTable):
    """ComfyUI's ``ModelSamplingDiscrete`` of a DDPM schedule: the float32 sigma table and its two maps."""

    def __init__(self, schedule: NoiseSchedule):
        ac = schedule.alphas_cumprod.float()   # as ComfyUI keeps it: float32, the sigmas computed from it so
        self.sigmas = ((1 - ac) / ac) ** 0.5    # ascending in t
        self.log_sigmas = self.sigmas.log()

    def timestep(self, sigma) -> torch.Tensor:
        """The nearest table index of each sigma (in log sigma)."""
        log_sigma = torch.as_tensor(sigma, dtype=torch.float32).log()
        return (log_sigma.reshape(-1)[None, :] - self.log_sigmas[:, None]).abs().argmin(dim=0).reshape(
            log_sigma.shape)

    def sigma(self, t) -> torch.Tensor:
        """Sigma at a (fractional) timestep: log sigma interpolated linearly between the table's neighbours."""
        t = torch.as_tensor(t, dtype=torch.float32).clamp(0, len(self.sigmas) - 1)
        low, high, w = t.floor().long(), t.ceil().long(), t.frac()
        return ((1 - w) * self.log_sigmas[low] + w * self.log_sigmas[high]).exp()


COMFY_FLUX_SHIFT = 1.15   # ComfyUI's ModelSamplingFlux shift (its mu) unless a ModelSamplingFlux node sets one


class DiscreteFlowShift(float):
    """A shift for ``ModelSamplingDiscreteFlow``'s table whatever the model's own schedule: ComfyUI samples some models
    whose pipelines shift by image size with a fixed shift (Qwen-Image: 1.15, or ModelSamplingAuraFlow's), and a
    shift of this type says so to :class:`FlowTable`."""


class FlowTable(_SigmaTable):
    """ComfyUI's sampling of a flow-matching model: ``ModelSamplingDiscreteFlow`` (SD3: 1000 timesteps,
    ``sigma(t) = shift s / (1 + (shift - 1) s)`` with ``s = t / 1000``, ``timestep(sigma) = 1000 sigma``) or, for a
    model with dynamic shifting (FLUX.1 dev), ``ModelSamplingFlux`` (10000 timesteps, ``sigma(t) = e^mu / (e^mu +
    1/t - 1)``, ``timestep(sigma) = sigma``, mu = ``shift``, 1.15 unless given), unless the shift is a
    :class:`DiscreteFlowShift`: that model's ComfyUI table is ``ModelSamplingDiscreteFlow``'s (Qwen-Image's). The
    table holds ``sigma`` of the timesteps 1..N (float32, ascending)."""

    def __init__(self, schedule, shift: float | None = None):
        self.flux = bool(schedule.use_dynamic_shifting) and not isinstance(shift, DiscreteFlowShift)
        if self.flux:
            self.shift, self.multiplier, n = COMFY_FLUX_SHIFT if shift is None else shift, 1.0, 10000
        else:
            self.shift, self.multiplier, n = schedule.shift if shift is None else shift, 1000.0, 1000
        self.sigmas = self.sigma(torch.arange(1, n + 1, dtype=torch.float32) / n * self.multiplier)

    def timestep(self, sigma) -> torch.Tensor:
        return torch.as_tensor(sigma, dtype=torch.float32) * self.multiplier

    def sigma(self, t) -> torch.Tensor:
        s = torch.as_tensor(t, dtype=torch.float32) / self.multiplier
        if self.flux:
            return math.exp(self.shift) / (math.exp(self.shift) + (1 / s - 1))
        if self.shift == 1.0:
            return s
        return self.shift * s / (1 + (self.shift - 1) * s)


def comfy_table(schedule, shift: float | None = None):
    """ComfyUI's sigma table of ``schedule``: :class:`ComfyTable` (DDPM) or :class:`FlowTable` (flow matching, with
    ``shift``: ModelSamplingSD3's shift or ModelSamplingFlux's mu; None: the model's, ComfyUI's 1.15 for FLUX; a
    :class:`DiscreteFlowShift`: ModelSamplingDiscreteFlow's at that shift, whatever the schedule)."""
    return ComfyTable(schedule) if isinstance(schedule, NoiseSchedule) else FlowTable(schedule, shift)


def flux_shift(width: int, height: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """ModelSamplingFlux's shift (mu) for an image of ``width`` x ``height``: linear in its 2x2 latent patches,
    ``base_shift`` at 256 of them and ``max_shift`` at 4096."""
    slope = (max_shift - base_shift) / (4096 - 256)
    return width * height / (8 * 8 * 2 * 2) * slope + (base_shift - slope * 256)


def _normal(table: ComfyTable, steps: int, sgm: bool) -> list[float]:
    start = float(table.timestep(torch.tensor(table.sigma_max)))
    end = float(table.timestep(torch.tensor(table.sigma_min)))
    append_zero = True
    if sgm:
        timesteps = torch.linspace(start, end, steps + 1)[:-1]
    else:
        if math.isclose(float(table.sigma(torch.tensor(end))), 0, abs_tol=1e-5):
            steps, append_zero = steps + 1, False
        timesteps = torch.linspace(start, end, steps)
    sigmas = [float(table.sigma(t)) for t in timesteps]
    return sigmas + [0.0] if append_zero else sigmas


def _simple(table: ComfyTable, steps: int) -> list[float]:
    stride = len(table.sigmas) / steps
    return [float(table.sigmas[-(1 + int(i * stride))]) for i in range(steps)] + [0.0]


def _ddim_uniform(table: ComfyTable, steps: int) -> list[float]:
    x = 1
    if math.isclose(float(table.sigmas[x]), 0, abs_tol=1e-5):
        steps, sigmas = steps + 1, []
    else:
        sigmas = [0.0]
    stride = max(len(table.sigmas) // steps, 1)
    while x < len(table.sigmas):
        sigmas.append(float(table.sigmas[x]))
        x += stride
    return sigmas[::-1]


def _beta(table: ComfyTable, steps: int, alpha: float = 0.6, beta: float = 0.6) -> list[float]:
    from scipy.stats import beta as beta_distribution

    total = len(table.sigmas) - 1
    ts = np.rint(beta_distribution.ppf(1 - np.linspace(0, 1, steps, endpoint=False), alpha, beta) * total)
    sigmas, last = [], -1
    for t in ts:
        if t != last:
            sigmas.append(float(table.sigmas[int(t)]))
        last = t
    return sigmas + [0.0]


def comfy_sigmas(schedule, name: str, steps: int, shift: float | None = None) -> torch.Tensor:
    """The float32 sigmas (descending, the last 0) of ComfyUI's scheduler ``name`` over ``steps`` steps on
    ``schedule`` (a DDPM :class:`~.schedules.NoiseSchedule` or a flow-matching one; ``shift``: see
    :func:`comfy_table`)."""
    if name not in COMFY_SCHEDULERS:
        raise ScheduleError(f"ComfyUI scheduler {name!r} is not one sdlite computes: expected one of "
                            f"{', '.join(COMFY_SCHEDULERS)}")
    if not isinstance(steps, int) or steps < 1:
        raise ScheduleError(f"steps={steps!r}: expected 1 or more")
    table = comfy_table(schedule, shift)
    if name in ("normal", "sgm_uniform"):
        sigmas = _normal(table, steps, sgm=name == "sgm_uniform")
    elif name == "simple":
        sigmas = _simple(table, steps)
    elif name == "ddim_uniform":
        sigmas = _ddim_uniform(table, steps)
    elif name == "beta":
        sigmas = _beta(table, steps)
    else:
        lo, hi = table.sigma_min, table.sigma_max
        if name == "karras":
            ramp = torch.linspace(0, 1, steps)
            sigmas = ((hi ** (1 / 7) + ramp * (lo ** (1 / 7) - hi ** (1 / 7))) ** 7).tolist()
        else:
            sigmas = torch.linspace(math.log(hi), math.log(lo), steps).exp().tolist()
        sigmas = sigmas + [0.0]
    return torch.tensor(sigmas, dtype=torch.float32)


def denoise_sigmas(full, steps: int, denoise: float) -> torch.Tensor:
    """KSampler's sigmas at ``denoise`` < 1: ``full(int(steps / denoise))``'s last ``steps + 1``; empty at 0."""
    if denoise > 0.9999:
        return full(steps)
    if denoise <= 0.0:
        return torch.zeros(0)
    return full(int(steps / denoise))[-(steps + 1):]


def advanced_sigmas(sigmas: torch.Tensor, start_step: int, last_step: int, force_full_denoise: bool):
    """KSamplerAdvanced's cut of ``sigmas``: up to ``last_step`` (its last sigma set to 0 when
    ``force_full_denoise``), then from ``start_step``. None when the start is at or past the end (ComfyUI then
    returns the latent untouched)."""
    sigmas = sigmas.clone()
    if last_step < len(sigmas) - 1:
        sigmas = sigmas[:last_step + 1]
        if force_full_denoise:
            sigmas[-1] = 0
    if start_step >= len(sigmas) - 1:
        return None
    return sigmas[start_step:]


def comfy_timesteps(schedule, sigmas: torch.Tensor) -> torch.Tensor | None:
    """The UNet timesteps ComfyUI gives at ``sigmas`` (the nearest table index, as float32) on a DDPM schedule;
    None on a flow schedule (the denoiser's own map then)."""
    if not isinstance(schedule, NoiseSchedule):
        return None
    return ComfyTable(schedule).timestep(sigmas.float()).float()


def starts_at_top(schedule, sigma: float) -> bool:
    """ComfyUI's ``max_denoise``: the run starts at (or above) the schedule's largest sigma."""
    top = comfy_table(schedule).sigma_max
    return math.isclose(top, sigma, rel_tol=1e-5) or sigma > top


def noise_scaling(schedule, sigma: float, noise: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """KSampler's start latent at ``sigma`` from unit ``noise`` and the (model-scaled) ``latent``."""
    if schedule.latent_form == "flow":
        return noise * sigma + latent * (1.0 - sigma)
    scale = math.sqrt(1.0 + sigma**2) if starts_at_top(schedule, sigma) else sigma
    return latent + noise * scale


def inverse_noise_scaling(schedule, sigma: float, x: torch.Tensor) -> torch.Tensor:
    """What KSampler returns for the sampler's final ``x`` at ``sigma`` (the last sigma of its run)."""
    if schedule.latent_form == "flow":
        return x / (1.0 - sigma)
    return x


def comfy_noise(seed: int, shape: tuple) -> torch.Tensor:
    """KSampler's initial noise: one CPU generator seeded with ``seed``, the whole latent batch in one draw."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def step_generator(seed: int, device="cpu") -> torch.Generator:
    """The generator of the samplers' per-step noise (ComfyUI's ``default_noise_sampler``), drawing the whole batch at
    once on the latent's device: on a CPU one seeded with ``seed + 1`` (so it does not repeat the initial noise), on
    another device that device's generator seeded with ``seed``."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.Generator().manual_seed((seed + 1) % 2**64)
    return torch.Generator(device=device).manual_seed(seed)
