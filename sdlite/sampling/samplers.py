"""Samplers: plain functions that walk a latent down a sigma schedule with a denoiser.

Every sampler is ``sample_<name>(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None, ...)``:
``x`` is the start latent at ``sigmas[0]`` in k-diffusion's scaling (``x = x0 + sigma * eps``), ``sigmas`` a
descending 1-D tensor of ``steps + 1`` noise levels (the last usually 0), ``denoiser(x, sigma, **extra_args)``
the model's estimate of x0 (see :mod:`.denoisers`), ``callback(step_index, total, x)`` is called after every
step (a tensor it returns replaces ``x``: inpainting uses that) and ``generator`` (a ``torch.Generator`` or one per batch item) feeds every random draw. Samplers keep no
state between calls and never see eps/v.

Samplers first published on the DDPM parameterisation (DDIM, PLMS, DDPM, UniPC, LCM) are written here in the
same sigma form; their updates are the reference's, rewritten with ``alpha_bar = 1 / (1 + sigma^2)``. Random
draws happen in the reference's order and shapes, so a seed gives the reference's image.

The same functions run on a flow-matching latent ``x = (1 - sigma) x0 + sigma noise`` (:mod:`.flow`): its
probability-flow ODE ``dx/dsigma = (x - x0_hat) / sigma`` has k-diffusion's form, so Euler and Heun need nothing
else. The samplers whose steps depend on how the latent scales the signal (the exponential integrators and the
ancestral step) take the ``schedule`` and ask it: ``schedule.alphas(sigmas)`` for ``alpha`` in
``x = alpha x0 + sigma noise`` (their log-SNR is ``lambda = log(alpha / sigma)``) and ``schedule.ancestral_step``.
Without a schedule they assume k-diffusion's latent (alpha = 1).

:func:`sample` is the single entry point: it resolves a sampler name (ours or the A1111 one), builds the
sigmas and timesteps, scales the initial noise, runs the sampler and returns the latent in the model's own
scaling (the reference's DDPM latent; the flow latent as it is).
"""
from __future__ import annotations

import bisect
import inspect
import math
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .schedules import SIGMA_KINDS, NoiseSchedule, ScheduleError
from .schedules import ancestral_step as _ancestral_step

# --- helpers -------------------------------------------------------------------------------------------------


def _noise(like: torch.Tensor, generator=None) -> torch.Tensor:
    """Standard normal noise shaped like ``like``, drawn as the reference draws it: on the generator's device
    (then moved), one draw of the whole batch, or one draw per batch item from a list of generators."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != like.shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {like.shape[0]}")
        return torch.cat([_noise(like[i:i + 1], g) for i, g in enumerate(generator)])
    device = generator.device if generator is not None else like.device
    return torch.randn(like.shape, generator=generator, device=device, dtype=like.dtype).to(like.device)


def _alphas(schedule, sigmas: torch.Tensor) -> torch.Tensor:
    """The signal scale alpha of the latent at each sigma: the schedule's, or 1 (k-diffusion's latent)."""
    return torch.ones_like(sigmas) if schedule is None else schedule.alphas(sigmas).to(sigmas)


def _ve_ancestral_step(sigma, sigma_next, eta):
    return (*_ancestral_step(sigma, sigma_next, eta), 1.0)


def _sigma_in(sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The step's sigma as a (B,) float32 vector (kept in float32 even for half-precision latents)."""
    return sigma.to(device=x.device, dtype=torch.float32).expand(x.shape[0])


def _setup(x, sigmas, extra_args):
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32)
    if sigmas.ndim != 1 or len(sigmas) < 2:
        raise ValueError(f"sigmas must be a 1-D tensor of steps + 1 noise levels, got shape {tuple(sigmas.shape)}")
    return sigmas.cpu(), extra_args or {}, len(sigmas) - 1


def _report(callback, i, n, x):
    """Call ``callback(i, n, x)``; a tensor it returns replaces ``x`` (inpainting re-imposes the unmasked region
    this way), anything else leaves ``x`` as it is."""
    if callback is not None:
        out = callback(i, n, x)
        if isinstance(out, torch.Tensor):
            return out
    return x


# --- samplers on sigmas --------------------------------------------------------------------------------------

@torch.no_grad()
def sample_euler(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None):
    """Euler's method on the probability-flow ODE dx/dsigma = (x - D(x, sigma)) / sigma (Karras et al. 2022,
    algorithm 2 without churn)."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        d = (x - denoised) / sigmas[i]
        x = x + d * (sigmas[i + 1] - sigmas[i])
        x = _report(callback, i, n, x)
    return x


@torch.no_grad()
def sample_euler_ancestral(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None, eta=1.0,
                           schedule=None):
    """Ancestral Euler: an Euler step down to sigma_down, then fresh noise up to the next sigma (k-diffusion's
    ``sample_euler_ancestral``; one noise draw per step, the last step included). ``eta`` scales the DDPM
    posterior's noise (0: Euler).

    ``schedule.ancestral_step(sigma, sigma_next, eta)`` gives ``(sigma_down, sigma_up, scale)``: after the Euler
    step to sigma_down the latent is multiplied by ``scale`` (1 on k-diffusion's latent, ``(1 - sigma_next) /
    (1 - sigma_down)`` on a flow latent) before the noise; without a schedule, k-diffusion's latent."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    step = _ve_ancestral_step if schedule is None else schedule.ancestral_step
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        sigma_down, sigma_up, scale = step(sigmas[i], sigmas[i + 1], eta)
        d = (x - denoised) / sigmas[i]
        x = x + d * (sigma_down - sigmas[i])
        x = x * scale + _noise(x, generator) * sigma_up
        x = _report(callback, i, n, x)
    return x


@torch.no_grad()
def sample_heun(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None):
    """Heun's second-order method (Karras et al. 2022, algorithm 1); the step to sigma = 0 is an Euler step."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        d = (x - denoised) / sigmas[i]
        dt = sigmas[i + 1] - sigmas[i]
        if sigmas[i + 1] == 0:
            x = x + d * dt
        else:
            x_2 = x + d * dt
            denoised_2 = denoiser(x_2, _sigma_in(sigmas[i + 1], x), **extra)
            d_2 = (x_2 - denoised_2) / sigmas[i + 1]
            x = x + (d + d_2) / 2 * dt
        x = _report(callback, i, n, x)
    return x


def _lms_coefficient(sigmas: np.ndarray, i: int, j: int, order: int) -> float:
    """Integral from sigma_i to sigma_{i+1} of the Lagrange basis polynomial through sigma_i .. sigma_{i-order+1}
    that is 1 at sigma_{i-j} (exact: the polynomial is integrated symbolically)."""
    poly = np.polynomial.Polynomial([1.0])
    for k in range(order):
        if k != j:
            poly = poly * np.polynomial.Polynomial([-sigmas[i - k], 1.0]) / (sigmas[i - j] - sigmas[i - k])
    antiderivative = poly.integ()
    return float(antiderivative(sigmas[i + 1]) - antiderivative(sigmas[i]))


@torch.no_grad()
def sample_lms(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None, order=4):
    """Linear multistep (Adams-Bashforth on the sigma axis, up to ``order`` past derivatives; k-diffusion's
    ``sample_lms``)."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    sigmas_np = sigmas.double().numpy()
    ds = []
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        ds = (ds + [(x - denoised) / sigmas[i]])[-order:]
        cur_order = min(i + 1, order)
        coeffs = [_lms_coefficient(sigmas_np, i, j, cur_order) for j in range(cur_order)]
        x = x + sum(c * d for c, d in zip(coeffs, reversed(ds)))
        x = _report(callback, i, n, x)
    return x


def _lambda(alphas: torch.Tensor, sigmas: torch.Tensor, i: int) -> torch.Tensor:
    """Log-SNR time ``lambda = log(alpha) - log(sigma)`` at sigma ``i`` (-log(sigma) on k-diffusion's latent)."""
    return alphas[i].log() - sigmas[i].log()


@torch.no_grad()
def sample_dpmpp_2m(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None, schedule=None):
    """DPM-Solver++(2M) (Lu et al. 2022, "DPM-Solver++", algorithm 2) in log-SNR time ``lambda = log(alpha /
    sigma)`` for a latent ``x = alpha x0 + sigma noise``: ``x' = (sigma'/sigma) x - alpha' expm1(-h) D`` with
    ``h = lambda' - lambda`` and D the second-order combination of the last two estimates. ``alpha`` comes from
    ``schedule.alphas`` (1 without a schedule: lambda = -log(sigma), k-diffusion's form). First order on the first
    step and on the step to sigma = 0."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    alphas = _alphas(schedule, sigmas)
    old_denoised, h_last = None, None
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            h = _lambda(alphas, sigmas, i + 1) - _lambda(alphas, sigmas, i)
            if old_denoised is None:
                denoised_d = denoised
            else:
                r = h_last / h
                denoised_d = denoised + (denoised - old_denoised) / (2 * r)
            x = (sigmas[i + 1] / sigmas[i]) * x - alphas[i + 1] * torch.expm1(-h) * denoised_d
            h_last = h
        old_denoised = denoised
        x = _report(callback, i, n, x)
    return x


@torch.no_grad()
def sample_dpmpp_2m_sde(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None, eta=1.0,
                        schedule=None):
    """SDE-DPM-Solver++(2M) (Lu et al. 2022, section 5 / appendix; the "midpoint" second-order form), with noise
    strength ``eta`` (1 = the reverse SDE), in log-SNR time ``lambda = log(alpha / sigma)`` with ``alpha`` from
    ``schedule.alphas`` (1 without a schedule), as :func:`sample_dpmpp_2m`. One noise draw per step, the last step
    included."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    alphas = _alphas(schedule, sigmas)
    old_denoised, h_last = None, None
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        noise = _noise(x, generator)
        if sigmas[i + 1] == 0:
            x = denoised
        else:
            h = _lambda(alphas, sigmas, i + 1) - _lambda(alphas, sigmas, i)
            eta_h = eta * h
            x = (sigmas[i + 1] / sigmas[i]) * torch.exp(-eta_h) * x \
                - alphas[i + 1] * torch.expm1(-h - eta_h) * denoised
            if old_denoised is not None:
                r = h_last / h
                x = x - 0.5 * (alphas[i + 1] * torch.expm1(-h - eta_h)) * (denoised - old_denoised) / r
            x = x + noise * sigmas[i + 1] * (-torch.expm1(-2 * eta_h)) ** 0.5
            h_last = h
        old_denoised = denoised
        x = _report(callback, i, n, x)
    return x


def _res_multistep(denoiser, x, sigmas, generator, callback, extra_args, eta: float):
    """The RES second-order multistep step (Zhang et al. 2023, "Improved Order Analysis and Design of Exponential
    Integrator for Diffusion Models", the "Refined Exponential Solver"), as ComfyUI's ``sample_res_multistep`` runs
    it: in time ``t = -log(sigma)`` the probability-flow ODE is ``dx/dt = D - x`` (on k-diffusion's latent and on the
    flow latent alike: both have ``dx/dsigma = (x - D) / sigma``), so a step of ``h = t' - t`` is exactly
    ``x' = e^-h x + integral of e^-(t' - s) D(s) ds``. The estimate D is taken linear in t through the last two
    estimates: ``x' = e^-h x + h (b1 D + b2 D_old)`` with ``b2 = phi2(-h) / c2``, ``b1 = phi1(-h) - b2``,
    ``phi1(z) = (e^z - 1) / z``, ``phi2(z) = (phi1(z) - 1) / z``, ``c2 = (t_prev - t_old) / h`` (``t_prev``: the
    last step's start, ``t_old``: where its deterministic part ended; the same point without noise). The first step,
    and the step to sigma = 0, are Euler steps. ``eta`` > 0: ancestral, k-diffusion's step to ``sigma_down`` then
    fresh noise of std ``sigma_up`` (ComfyUI's ``res_multistep_ancestral``, on every model as ComfyUI runs it)."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    old_denoised, old_down = None, None
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        down, up = _ancestral_step(sigmas[i], sigmas[i + 1], eta)
        if down == 0 or old_denoised is None:
            x = x + (x - denoised) / sigmas[i] * (down - sigmas[i])
        else:
            s, s_down, s_prev, s_old = (float(v) for v in (sigmas[i], down, sigmas[i - 1], old_down))
            h = math.log(s) - math.log(s_down)                    # t' - t, t = -log(sigma)
            c2 = (math.log(s_old) - math.log(s_prev)) / h         # (t_prev - t_old) / h
            phi1 = math.expm1(-h) / -h if h else 1.0
            phi2 = (phi1 - 1.0) / -h if h else 0.5
            b2 = phi2 / c2 if c2 else 0.0
            b1 = phi1 - b2
            x = (s_down / s) * x + h * (b1 * denoised + b2 * old_denoised)
        if eta and sigmas[i + 1] > 0:   # ComfyUI draws a step's noise whenever the step does not end at 0
            x = x + _noise(x, generator) * up
        old_denoised, old_down = denoised, down
        x = _report(callback, i, n, x)
    return x


@torch.no_grad()
def sample_res_multistep(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None):
    """RES multistep (ComfyUI's ``res_multistep``): the second-order exponential integrator on the data
    prediction of :func:`_res_multistep`, deterministic; its first step is Euler's. One model call per step."""
    return _res_multistep(denoiser, x, sigmas, generator, callback, extra_args, 0.0)


@torch.no_grad()
def sample_res_multistep_ancestral(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None,
                                   eta=1.0):
    """Ancestral RES multistep (ComfyUI's ``res_multistep_ancestral``): :func:`sample_res_multistep` to
    k-diffusion's ``sigma_down``, then fresh noise of std ``sigma_up`` (``eta`` scales it; 0 is
    :func:`sample_res_multistep`). On a flow-matching latent the noise step is k-diffusion's too, as ComfyUI runs
    this sampler (ComfyUI's and sdlite's ``euler_a`` take the flow latent's own ancestral step there)."""
    return _res_multistep(denoiser, x, sigmas, generator, callback, extra_args, eta)


class BrownianNoise:
    """Noise for SDE steps taken from one Brownian path W(sigma), sampled lazily from ``generator``.

    ``noise(sigma, sigma_next) = (W(sigma_next) - W(sigma)) / sqrt(|sigma_next - sigma|)``: standard normal for
    each interval, and correlated between overlapping intervals as increments of one path are (what
    DPM++ SDE's two queries per step need). New points are drawn as Brownian bridges between the known ones
    (or as independent increments beyond them), so the result depends only on the generator and the query
    order. Same law as the reference's torchsde Brownian tree, not the same numbers.
    """

    def __init__(self, x: torch.Tensor, generator=None):
        self.like = torch.empty_like(x)
        self.generator = generator
        self.times: list[float] = []
        self.values: list[torch.Tensor] = []

    def _at(self, t: float) -> torch.Tensor:
        if t in self.times:
            return self.values[self.times.index(t)]
        k = bisect.bisect(self.times, t)
        if not self.times:
            w = torch.zeros_like(self.like)
        elif k == 0:
            w = self.values[0] + _noise(self.like, self.generator) * math.sqrt(self.times[0] - t)
        elif k == len(self.times):
            w = self.values[-1] + _noise(self.like, self.generator) * math.sqrt(t - self.times[-1])
        else:
            (a, wa), (b, wb) = (self.times[k - 1], self.values[k - 1]), (self.times[k], self.values[k])
            mean = wa + (wb - wa) * ((t - a) / (b - a))
            w = mean + _noise(self.like, self.generator) * math.sqrt((t - a) * (b - t) / (b - a))
        self.times.insert(k, t)
        self.values.insert(k, w)
        return w

    def __call__(self, sigma, sigma_next) -> torch.Tensor:
        t0, t1 = float(sigma), float(sigma_next)
        return (self._at(t1) - self._at(t0)) / math.sqrt(abs(t1 - t0))


@torch.no_grad()
def sample_dpmpp_sde(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None, eta=1.0,
                     noise_sampler: Callable | None = None):
    """DPM-Solver++ SDE: a stochastic second-order singlestep solver (Lu et al. 2022; k-diffusion's
    ``sample_dpmpp_sde`` with r = 1/2): an ancestral half step to the log-sigma midpoint, a second model call
    there, then an ancestral full step with the midpoint's estimate. Two model calls per step (one on the step
    to sigma = 0, which is an Euler step).

    ``noise_sampler(sigma, sigma_next)`` gives the noise of each ancestral step; by default a
    :class:`BrownianNoise` path drawn from ``generator``.
    """
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    if noise_sampler is None:
        noise_sampler = BrownianNoise(x, generator)

    def sigma_fn(t):
        return t.neg().exp()

    def t_fn(sigma):
        return sigma.log().neg()

    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        if sigmas[i + 1] == 0:
            x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
        else:
            t, t_next = t_fn(sigmas[i]), t_fn(sigmas[i + 1])
            s = t + (t_next - t) * 0.5
            sigma_down, sigma_up = _ancestral_step(sigma_fn(t), sigma_fn(s), eta)
            s_ = t_fn(sigma_down)
            x_2 = (sigma_fn(s_) / sigma_fn(t)) * x - torch.expm1(t - s_) * denoised
            x_2 = x_2 + noise_sampler(sigma_fn(t), sigma_fn(s)) * sigma_up
            denoised_2 = denoiser(x_2, _sigma_in(sigma_fn(s), x), **extra)
            sigma_down, sigma_up = _ancestral_step(sigma_fn(t), sigma_fn(t_next), eta)
            t_next_ = t_fn(sigma_down)
            x = (sigma_fn(t_next_) / sigma_fn(t)) * x - torch.expm1(t - t_next_) * denoised_2
            x = x + noise_sampler(sigma_fn(t), sigma_fn(t_next)) * sigma_up
        x = _report(callback, i, n, x)
    return x


# --- samplers first published on the DDPM parameterisation ---------------------------------------------------

@torch.no_grad()
def sample_ddim(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None, eta=0.0):
    """DDIM (Song et al. 2021, eq. 12). With alpha_bar = 1/(1 + sigma^2) its update is
    ``x' = x0 + sigma_down * eps + sigma_up * noise`` with the ancestral (sigma_down, sigma_up) scaled by
    ``eta``: eta = 0 is Euler's method, eta = 1 the DDPM posterior. Noise is drawn only when eta > 0."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        sigma_down, sigma_up = _ancestral_step(sigmas[i], sigmas[i + 1], eta)
        x = denoised + (x - denoised) / sigmas[i] * sigma_down
        if eta > 0:
            x = x + _noise(x, generator) * sigma_up
        x = _report(callback, i, n, x)
    return x


@torch.no_grad()
def sample_pndm(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None):
    """PLMS, the pseudo linear multistep method of Liu et al. 2022 ("Pseudo Numerical Methods for Diffusion
    Models on Manifolds"), started as the reference's PNDM scheduler does with ``skip_prk_steps``: the first step
    is a Heun (pseudo improved Euler) step, then Adams-Bashforth of orders 2, 3, 4 on eps; the transfer
    ``x' = x + (sigma' - sigma) * eps`` is their eq. (9) in sigma form. The derivative of the Heun step's
    second call is not kept in the history. n + 1 model calls for n steps.

    The history holds eps estimates, for v-prediction models too (each converted at its own sample and
    noise level); the reference's PNDM scheduler instead combines the raw v outputs, so for v models its
    PLMS differs from this one (and from eps-PLMS) by more than rounding."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    ets = []
    for i in range(n):
        dt = sigmas[i + 1] - sigmas[i]
        eps = (x - denoiser(x, _sigma_in(sigmas[i], x), **extra)) / sigmas[i]
        ets = (ets + [eps])[-4:]
        if len(ets) == 1 and n > 1:
            x_2 = x + eps * dt
            eps_2 = (x_2 - denoiser(x_2, _sigma_in(sigmas[i + 1], x), **extra)) / sigmas[i + 1]
            e = (eps + eps_2) / 2
        elif len(ets) == 1:
            e = eps
        elif len(ets) == 2:
            e = (3 * ets[-1] - ets[-2]) / 2
        elif len(ets) == 3:
            e = (23 * ets[-1] - 16 * ets[-2] + 5 * ets[-3]) / 12
        else:
            e = (55 * ets[-1] - 59 * ets[-2] + 37 * ets[-3] - 9 * ets[-4]) / 24
        x = x + e * dt
        x = _report(callback, i, n, x)
    return x


@torch.no_grad()
def sample_ddpm(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None,
                schedule: NoiseSchedule | None = None):
    """Ancestral sampling from the DDPM posterior q(x_{t'} | x_t, x0) (Ho et al. 2020, eqs. 6-7) between the
    given noise levels ("fixed_small" variance). In sigma form, with r = sigma'^2 / sigma^2:
    ``x' = r x + (1 - r) x0 + sigma' sqrt(1 - r) noise``. As the reference does, no noise is drawn at timestep
    0 (which needs ``schedule`` to know; without it noise is drawn on every step)."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        r = (sigmas[i + 1] / sigmas[i]) ** 2
        x = r * x + (1 - r) * denoised
        if schedule is None or schedule.sigma_to_t(sigmas[i]) > 0:
            x = x + _noise(x, generator) * sigmas[i + 1] * (1 - r) ** 0.5
        x = _report(callback, i, n, x)
    return x


@torch.no_grad()
def sample_unipc(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None, schedule=None):
    """UniPC (Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework"), data prediction, B(h) =
    e^h - 1 ("bh2"), order 2: after each model call the UniC corrector refines the current latent with the new
    estimate, then the UniP predictor steps on. Order 1 on the first and the last step. Log-SNR time
    ``lambda = log(alpha / sigma)`` with ``alpha`` from ``schedule.alphas`` (1 without a schedule), and the
    updates' x0 terms scaled by the target's alpha, as :func:`sample_dpmpp_2m`."""
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    alphas = _alphas(schedule, sigmas)
    # log-SNR time; +inf-free because the sigma-0 step is special-cased
    lam = alphas.log() - sigmas.clamp(min=1e-30).log()
    ms = []  # past denoised estimates, newest last
    x_last, order_last = None, 0
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        if x_last is not None:  # UniC: refine x at sigma_i from the last step's start x_last at sigma_{i-1}
            h = lam[i] - lam[i - 1]
            h_phi_1 = torch.expm1(-h)
            b_h = h_phi_1
            m0 = ms[-1]
            if order_last == 1:
                corr = 0.5 * (denoised - m0)
            else:
                r = (lam[i - 2] - lam[i - 1]) / h
                b1 = (h_phi_1 / -h - 1) / b_h
                b2 = ((h_phi_1 / -h - 1) / -h - 0.5) * 2 / b_h
                rho0 = (b1 - b2) / (1 - r)
                corr = rho0 * (ms[-2] - m0) / r + (b1 - rho0) * (denoised - m0)
            x = (sigmas[i] / sigmas[i - 1]) * x_last - alphas[i] * h_phi_1 * m0 - alphas[i] * b_h * corr
        ms = (ms + [denoised])[-2:]
        order = min(2, n - i, i + 1)
        x_last, order_last = x, order
        if sigmas[i + 1] == 0:
            x = denoised
        else:  # UniP
            h = lam[i + 1] - lam[i]
            h_phi_1 = torch.expm1(-h)
            x = (sigmas[i + 1] / sigmas[i]) * x - alphas[i + 1] * h_phi_1 * denoised
            if order == 2:
                r = (lam[i - 1] - lam[i]) / h
                x = x - alphas[i + 1] * h_phi_1 * 0.5 * (ms[-2] - denoised) / r
        x = _report(callback, i, n, x)
    return x


@torch.no_grad()
def sample_lcm(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None,
               schedule: NoiseSchedule | None = None, timestep_scaling: float = 10.0, sigma_data: float = 0.5):
    """Latent consistency model multistep sampling (Luo et al. 2023, algorithm 3): each step takes the
    consistency function's estimate ``c_skip(t) x_t + c_out(t) x0`` (Song et al. 2023, "Consistency Models",
    with the timestep scaled by ``timestep_scaling``) and re-noises it to the next level; the last step returns
    the estimate. ``schedule`` gives the timesteps of ``c_skip``/``c_out`` (required)."""
    if schedule is None:
        raise ValueError("sample_lcm needs the model's NoiseSchedule (schedule=...)")
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        t = schedule.sigma_to_t(sigmas[i]).float() * timestep_scaling
        c_skip = sigma_data**2 / (t**2 + sigma_data**2)
        c_out = t / (t**2 + sigma_data**2) ** 0.5
        denoised = c_out * denoised + c_skip * x / (sigmas[i] ** 2 + 1) ** 0.5  # the skip acts on the DDPM latent
        if i < n - 1:
            x = denoised + _noise(denoised, generator) * sigmas[i + 1]
        else:
            x = denoised
        x = _report(callback, i, n, x)
    return x


@torch.no_grad()
def sample_tcd(denoiser, x, sigmas, *, generator=None, callback=None, extra_args=None,
               schedule: NoiseSchedule | None = None, eta: float = 0.3):
    """Trajectory consistency distillation's strategic stochastic sampling (Zheng et al. 2024, "Trajectory
    Consistency Distillation", algorithm 4; diffusers' ``TCDScheduler``). ``eta`` is the paper's gamma (0:
    deterministic, 1: every step re-noised from its x0 estimate; 0.3 is the scheduler's default).

    Each step goes from timestep t to the next planned t' by way of ``s = floor((1 - gamma) t')``: a DDIM step with
    the model's estimate to the training sigma at s, then (gamma > 0, all but the last step) fresh noise from
    sigma_s up to sigma_t', ``x' = x_s + sqrt(sigma_t'^2 - sigma_s^2) noise``. The last step goes to s = 0 and
    returns x_s there (the reference's final latent is at timestep 0, not sigma 0: ``sigmas[-1]`` is the training
    sigma_min). Timesteps are the schedule's integer ones (``schedule`` required)."""
    if schedule is None:
        raise ValueError("sample_tcd needs the model's NoiseSchedule (schedule=...)")
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"TCD: gamma (eta) {eta!r} is not valid: it must be between 0 and 1")
    sigmas, extra, n = _setup(x, sigmas, extra_args)
    table = schedule.sigmas
    for i in range(n):
        denoised = denoiser(x, _sigma_in(sigmas[i], x), **extra)
        t_next = schedule.sigma_to_t(sigmas[i + 1]).round().long()
        s = torch.floor((1 - eta) * t_next).long()   # the reference's arithmetic (float32), so s is its integer
        sigma_s = table[s]
        x = denoised + (x - denoised) * (sigma_s / sigmas[i])
        if eta > 0 and i < n - 1:
            x = x + _noise(x, generator) * (sigmas[i + 1] ** 2 - sigma_s**2).clamp(min=0) ** 0.5
        x = _report(callback, i, n, x)
    return x


# --- registry and entry point --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplerInfo:
    """How to run a sampler: its function, default sigma schedule, the diffusers scheduler whose timestep
    placement it follows (``schedules.FAMILIES``), whether it takes the NoiseSchedule, and the reference.

    ``flow_family``: on a flow-matching model, the diffusers scheduler whose sigma placement it follows
    (``flow.FLOW_FAMILIES``; ``flow_reference`` names it); None: the sampler does not run on flow matching.

    ``custom``: the explicit lists (``schedules.CUSTOM_KINDS``: "timesteps", "sigmas") its reference scheduler's
    ``set_timesteps`` takes on a DDPM schedule (on flow matching the placement decides: :mod:`.flow`)."""

    fn: Callable
    schedule: str = "discrete"
    family: str = "k"
    needs_schedule: bool = False
    stochastic: bool = False
    reference: str = ""
    flow_family: str | None = None
    flow_reference: str = ""
    custom: tuple = ()


SAMPLERS: dict[str, SamplerInfo] = {
    "euler": SamplerInfo(sample_euler, reference="EulerDiscreteScheduler", flow_family="euler",
                         flow_reference="FlowMatchEulerDiscreteScheduler", custom=("timesteps", "sigmas")),
    "euler_a": SamplerInfo(sample_euler_ancestral, stochastic=True, reference="EulerAncestralDiscreteScheduler",
                           flow_family="euler", flow_reference="none (FlowMatchEulerDiscreteScheduler's sigmas)"),
    "heun": SamplerInfo(sample_heun, reference="HeunDiscreteScheduler", flow_family="euler",
                        flow_reference="FlowMatchHeunDiscreteScheduler", custom=("timesteps",)),
    "lms": SamplerInfo(sample_lms, reference="LMSDiscreteScheduler"),
    "dpmpp_2m": SamplerInfo(sample_dpmpp_2m, family="multistep",
                            reference="DPMSolverMultistepScheduler(algorithm_type='dpmsolver++')",
                            flow_family="dpmsolver", flow_reference="DPMSolverMultistepScheduler(use_flow_sigmas=True, "
                            "prediction_type='flow_prediction', algorithm_type='dpmsolver++')", custom=("timesteps",)),
    "dpmpp_2m_sde": SamplerInfo(sample_dpmpp_2m_sde, family="multistep", stochastic=True,
                                reference="DPMSolverMultistepScheduler(algorithm_type='sde-dpmsolver++')",
                                flow_family="dpmsolver", flow_reference="DPMSolverMultistepScheduler("
                                "use_flow_sigmas=True, prediction_type='flow_prediction', "
                                "algorithm_type='sde-dpmsolver++')", custom=("timesteps",)),
    "dpmpp_sde": SamplerInfo(sample_dpmpp_sde, stochastic=True, reference="DPMSolverSDEScheduler"),
    "ddim": SamplerInfo(sample_ddim, family="ddim", reference="DDIMScheduler"),
    "pndm": SamplerInfo(sample_pndm, family="ddim", reference="PNDMScheduler(skip_prk_steps=True)"),
    "ddpm": SamplerInfo(sample_ddpm, family="ddpm", needs_schedule=True, stochastic=True,
                        reference="DDPMScheduler", custom=("timesteps",)),
    "unipc": SamplerInfo(sample_unipc, family="multistep", reference="UniPCMultistepScheduler(solver_type='bh2')",
                         flow_family="unipc", flow_reference="UniPCMultistepScheduler(use_flow_sigmas=True, "
                         "prediction_type='flow_prediction')"),
    "lcm": SamplerInfo(sample_lcm, family="lcm", needs_schedule=True, stochastic=True, reference="LCMScheduler",
                       custom=("timesteps",)),
    "tcd": SamplerInfo(sample_tcd, family="tcd", needs_schedule=True, stochastic=True, reference="TCDScheduler",
                       custom=("timesteps",)),
    # ComfyUI's (no diffusers scheduler): the sigmas are placed as Euler's, on flow matching as FlowMatch Euler's
    "res_multistep": SamplerInfo(sample_res_multistep, reference="ComfyUI's sample_res_multistep (no diffusers "
                                 "scheduler; Euler's sigmas)", flow_family="euler",
                                 flow_reference="ComfyUI's sample_res_multistep (FlowMatchEulerDiscreteScheduler's "
                                 "sigmas)"),
    "res_multistep_ancestral": SamplerInfo(sample_res_multistep_ancestral, stochastic=True,
                                           reference="ComfyUI's sample_res_multistep_ancestral (no diffusers "
                                           "scheduler; Euler's sigmas)", flow_family="euler",
                                           flow_reference="ComfyUI's sample_res_multistep_ancestral "
                                           "(FlowMatchEulerDiscreteScheduler's sigmas)"),
}

# the names the AUTOMATIC1111 web UI shows (a " Karras" / " Exponential" suffix picks the sigma schedule)
A1111_NAMES = {
    "Euler a": "euler_a", "Euler": "euler", "Heun": "heun", "LMS": "lms", "DPM++ 2M": "dpmpp_2m",
    "DPM++ 2M SDE": "dpmpp_2m_sde", "DPM++ SDE": "dpmpp_sde", "DDIM": "ddim", "PLMS": "pndm", "UniPC": "unipc",
    "LCM": "lcm", "DDPM": "ddpm", "TCD": "tcd",
    # ComfyUI's RES samplers, under names of sdlite's (A1111 has neither)
    "Res Multistep": "res_multistep", "Res Multistep Ancestral": "res_multistep_ancestral",
}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower().replace("++", "pp"))


_ALIASES = {_key(k): v for k, v in {**{n: n for n in SAMPLERS}, **A1111_NAMES,
                                     "euler_ancestral": "euler_a", "plms": "pndm"}.items()}


def resolve_sampler(name: str) -> tuple[str, str]:
    """``(sampler_name, schedule_name)`` for one of our names (``"dpmpp_2m"``) or an A1111 one
    (``"DPM++ 2M Karras"``), case-, space-, ``_``- and ``-``-insensitively."""
    key = _key(name)
    kind = None
    for k in SIGMA_KINDS:
        if key.endswith(k) and key[: -len(k)] in _ALIASES:
            key, kind = key[: -len(k)], k
            break
    if key not in _ALIASES:
        a1111 = sorted({*A1111_NAMES, "LMS Karras", "DPM++ 2M Karras", "DPM++ 2M SDE Karras", "DPM++ SDE Karras"})
        raise ValueError(f"unknown sampler {name!r}; valid names: {', '.join(SAMPLERS)} "
                         f"(optionally with a _karras or _exponential suffix), or the A1111 names "
                         f"{', '.join(a1111)}")
    sampler = _ALIASES[key]
    return sampler, kind or SAMPLERS[sampler].schedule


@dataclass(frozen=True)
class Plan:
    """Where a sampling run's noise levels fall: ``sigmas`` (steps + 1, descending), the model's ``timesteps`` at
    ``sigmas[:-1]``, and ``init_scale``, what unit-variance noise is multiplied by to start at ``sigmas[0]``."""

    sampler: str
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    init_scale: torch.Tensor


def plan(name: str, schedule, steps: int, schedule_kind: str | None = None,
         spacing: str | None = None) -> Plan:
    """The :class:`Plan` of sampler ``name`` over ``steps`` steps on ``schedule`` (a :class:`NoiseSchedule` or a
    flow-matching :class:`~.flow.FlowSchedule`; see :func:`sample` for the arguments).

    The schedule places the sigmas where the sampler's reference scheduler does (``schedule.family_for``) and says
    how the initial noise is scaled (:meth:`NoiseSchedule.init_noise_scale`: as the reference scheduler does;
    1 on flow matching). A sampler that does not run on the schedule's model is refused (:class:`ScheduleError`,
    naming the samplers that do).
    """
    sampler, default_kind = resolve_sampler(name)
    info = SAMPLERS[sampler]
    family = schedule.family_for(info)
    if family is None:
        usable = [n for n, i in SAMPLERS.items() if schedule.family_for(i) is not None]
        raise ScheduleError(f"sampler {sampler!r} does not run on {schedule.describe}; the samplers that do: "
                            f"{', '.join(usable)}")
    sigmas, timesteps = schedule.make_sigmas(steps, schedule_kind or default_kind, family, spacing)
    return Plan(sampler, sigmas, timesteps, schedule.init_noise_scale(sigmas, family, spacing))


def img2img_start(steps: int, strength: float, schedule=None) -> int:
    """How many of ``steps`` planned steps image to image skips at ``strength``, as the reference pipeline of
    ``schedule``'s models does (:meth:`NoiseSchedule.img2img_start`: diffusers' StableDiffusion img2img and
    inpainting pipelines run the last ``int(steps * strength)`` steps; :meth:`~.flow.FlowSchedule.img2img_start`:
    StableDiffusion3Img2ImgPipeline's rule). Without a schedule, the StableDiffusion rule."""
    if schedule is None:
        return steps - min(int(steps * strength), steps)
    return schedule.img2img_start(steps, strength)


def sample(name: str, denoiser, x_T: torch.Tensor, schedule, steps: int,
           schedule_kind: str | None = None, generator=None, eta: float | None = None, callback=None, *,
           spacing: str | None = None, extra_args: dict | None = None, start: int = 0, noised: bool = False,
           end: int | None = None, **options) -> torch.Tensor:
    """Run sampler ``name`` for ``steps`` steps from unit-variance noise ``x_T``; returns the final latent.

    ``schedule_kind`` ("discrete" | "karras" | "exponential") overrides the one the name implies; ``spacing``
    the schedule's timestep spacing; ``eta`` goes to the samplers that take one (DDIM's defaults to 0, the
    ancestral ones' to 1); ``extra_args`` (e.g. ``context``/``uncond``) to the denoiser; ``options`` to the
    sampler function (e.g. ``noise_sampler`` for dpmpp_sde).

    ``schedule`` is the model's :class:`NoiseSchedule` or flow-matching :class:`~.flow.FlowSchedule` (then
    ``denoiser`` is a :class:`~.denoisers.FlowDenoiser` and ``x_T`` unit noise, the flow latent at sigma 1): it
    places the sigmas, and the samplers that need to know how the latent carries the signal get it
    (``schedule=``).

    Image to image: ``start`` skips the first planned steps (the sampler runs ``sigmas[start:]``, as the
    reference slices its scheduler's timesteps), and ``noised=True`` says ``x_T`` is already the sampler's latent
    at ``sigmas[start]`` (``schedule.noised(x0, noise, sigma)``: ``x0 + sigma * noise`` for a DDPM schedule,
    ``(1 - sigma) * x0 + sigma * noise`` for flow matching) rather than noise to scale by the plan's
    ``init_scale``.

    The result is the latent in the model's own scaling (``schedule.from_sampler``): for a DDPM schedule
    ``x / sqrt(1 + sigma_last^2)``, which is ``x`` itself whenever the last sigma is 0; the flow latent as it is.

    A hand-off (SDXL base to refiner): ``end`` stops after the planned step ``end`` (the sampler runs
    ``sigmas[start:end + 1]``) and returns the latent at ``sigmas[end]`` in the k-diffusion scaling, as it is, for
    another call with ``start=end, noised=True`` (a sampler with history starts that call afresh, as a second
    reference scheduler does).
    """
    p = plan(name, schedule, steps, schedule_kind, spacing)
    info = SAMPLERS[p.sampler]
    if not 0 <= start < steps:
        raise ValueError(f"start={start}: expected 0 to {steps - 1} (steps={steps})")
    if end is not None and not start < end <= steps:
        raise ValueError(f"end={end}: expected {start + 1} to {steps} (start={start}, steps={steps})")
    stop = None if end is None or end == steps else end
    sigmas = p.sigmas[start:None if stop is None else stop + 1]
    timesteps = p.timesteps[start:stop]
    if hasattr(denoiser, "with_timesteps"):
        denoiser = denoiser.with_timesteps(sigmas, timesteps)
    kwargs = dict(options)
    params = inspect.signature(info.fn).parameters
    if eta is not None and "eta" in params:
        kwargs["eta"] = eta
    if "schedule" in params:
        kwargs["schedule"] = schedule
    x = x_T if noised else x_T * p.init_scale.to(x_T.device)
    x = info.fn(denoiser, x, sigmas, generator=generator, callback=callback, extra_args=extra_args, **kwargs)
    if stop is not None:
        return x
    return schedule.from_sampler(x, sigmas[-1])
