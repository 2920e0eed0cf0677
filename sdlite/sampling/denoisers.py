"""Denoisers: the one place that knows how the UNet is parameterised.

A denoiser is any callable ``denoiser(x, sigma, **extra) -> denoised`` with ``x`` a latent at noise level
``sigma`` (``x = x0 + sigma * eps``, shape (B, C, h, w)), ``sigma`` of shape (B,), and ``denoised`` the
estimate of ``x0``. Samplers only ever see this interface.

:class:`Denoiser` wraps a raw UNet ``model(x, t, **extra) -> eps | v`` trained on a DDPM schedule with the
preconditioning of Karras et al. 2022 (table 1, "VP"/"DDPM" rows, as in k-diffusion): the UNet is given
``c_in * x`` with ``c_in = 1 / sqrt(sigma^2 + 1)`` (the DDPM latent) at the timestep ``t(sigma)``, and

* eps-prediction: ``denoised = x - sigma * eps``
* v-prediction (Salimans & Ho 2022): ``denoised = c_skip * x + c_out * v`` with ``c_skip = 1 / (sigma^2 + 1)``,
  ``c_out = -sigma / sqrt(sigma^2 + 1)``.

:class:`FlowDenoiser` wraps a flow-matching network ``model(x, t, **extra) -> v`` (SD3, FLUX; rectified flow, see
:mod:`.flow`): the latent is ``x = (1 - sigma) * x0 + sigma * noise``, the network predicts the velocity ``v =
noise - x0`` at timestep ``t = sigma * 1000`` and ``denoised = x - sigma * v``. The samplers then run on the flow
latent itself.

:class:`CFGDenoiser` adds classifier-free guidance (Ho & Salimans 2022) in one doubled batch, on either.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from .schedules import NoiseSchedule, ScheduleError

PREDICTION_TYPES = ("epsilon", "v_prediction")


@dataclass(frozen=True, eq=False)
class Denoiser:
    """``Denoiser(model, schedule, prediction_type)(x, sigma, **extra) -> denoised``.

    The UNet's timestep for a sigma is the schedule's log-sigma interpolation (exact for its own sigmas);
    :meth:`with_timesteps` pins the timesteps of a sampling run's sigmas to the ones the schedule builder
    chose (e.g. linspace-spaced fractional timesteps, or rounded Karras ones), so the UNet sees exactly what
    the reference scheduler gives it.
    """

    model: Callable
    schedule: NoiseSchedule
    prediction_type: str = "epsilon"
    dtype: torch.dtype | None = None  # the UNet's input dtype (e.g. float16); None: the latent's
    timestep_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (sigmas, timesteps), float32

    def __post_init__(self):
        if self.prediction_type not in PREDICTION_TYPES:
            raise ScheduleError(f"prediction_type {self.prediction_type!r} is not supported; "
                                f"expected one of {', '.join(PREDICTION_TYPES)}")

    def with_timesteps(self, sigmas: torch.Tensor, timesteps: torch.Tensor) -> "Denoiser":
        sigmas = sigmas[: len(timesteps)].detach().to("cpu", torch.float32)
        return dataclasses.replace(self, timestep_table=(sigmas, timesteps.detach().to("cpu", torch.float32)))

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """(B,) float32 UNet timesteps for (B,) sigmas."""
        s = sigma.detach().to("cpu", torch.float32).reshape(-1)
        t = self.schedule.sigma_to_t(s).float()
        if self.timestep_table is not None:
            t = _timestep_lookup(self.timestep_table, s, t)
        return t.to(sigma.device)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, *, concat: torch.Tensor | None = None,
                 **extra) -> torch.Tensor:
        """``concat`` (B, C', h, w): channels appended to the scaled latent before the UNet sees it (an
        inpainting UNet's mask and masked-image latents, which are not scaled by ``c_in``)."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(x.shape[0])
        s = sigma.reshape(-1, *([1] * (x.ndim - 1)))                            # (B, 1, 1, 1)
        x_in = x / (s**2 + 1) ** 0.5
        if concat is not None:
            x_in = torch.cat([x_in, concat.to(x_in)], dim=1)
        out = self.model(x_in.to(self.dtype or x.dtype), self.timestep(sigma), **extra)
        out = out.to(x.dtype)
        if self.prediction_type == "epsilon":
            return (x - s * out).to(x.dtype)
        return (out * (-s / (s**2 + 1) ** 0.5) + x / (s**2 + 1)).to(x.dtype)


def _timestep_lookup(table, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` with the timesteps a table pins (exact float32 sigma matches) put in."""
    table_sigmas, table_t = table
    hit = s[:, None] == table_sigmas[None, :]  # (B, steps)
    return torch.where(hit.any(1), table_t[hit.float().argmax(1)], t)


@dataclass(frozen=True, eq=False)
class FlowDenoiser:
    """``FlowDenoiser(model, schedule)(x, sigma, **extra) -> denoised`` for a flow-matching network
    ``model(x, t, **extra) -> v``: ``denoised = x - sigma * v``.

    The network's timestep is the training timestep ``sigma * N`` (float32, N = ``schedule.num_train_timesteps``:
    the value diffusers' flow-matching schedulers give SD3's transformer), divided by ``N / multiplier`` when
    ``multiplier`` (the network's timestep per unit sigma) is not N: FLUX's transformer takes ``t / 1000``, so
    ``multiplier=1.0``. :meth:`with_timesteps` pins the training timesteps of a run's sigmas where the sigma
    placement chose others (the multistep schedulers' truncated integer timesteps). ``dtype``: the network's input
    dtype (None: the latent's); the network's output is taken back to the latent's dtype.
    """

    model: Callable
    schedule: object  # a FlowSchedule (only num_train_timesteps is read)
    dtype: torch.dtype | None = None
    multiplier: float | None = None  # the network's timestep per unit sigma; None: num_train_timesteps (SD3)
    timestep_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (sigmas, training timesteps), float32

    def with_timesteps(self, sigmas: torch.Tensor, timesteps: torch.Tensor) -> "FlowDenoiser":
        sigmas = sigmas[: len(timesteps)].detach().to("cpu", torch.float32)
        return dataclasses.replace(self, timestep_table=(sigmas, timesteps.detach().to("cpu", torch.float32)))

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """(B,) float32 network timesteps for (B,) sigmas."""
        n_train = self.schedule.num_train_timesteps
        s = sigma.detach().to("cpu", torch.float32).reshape(-1)
        t = s * n_train
        if self.timestep_table is not None:
            t = _timestep_lookup(self.timestep_table, s, t)
        if self.multiplier is not None and self.multiplier != n_train:
            t = t / (n_train / self.multiplier)
        return t.to(sigma.device)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, *, concat: torch.Tensor | None = None,
                 **extra) -> torch.Tensor:
        """``concat`` (B, C', h, w): channels appended to the latent before the network sees it (a fill model's
        mask and masked-image latents)."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(x.shape[0])
        s = sigma.reshape(-1, *([1] * (x.ndim - 1)))                            # (B, 1, 1, 1)
        x_in = x if concat is None else torch.cat([x, concat.to(x)], dim=1)
        v = self.model(x_in.to(self.dtype or x.dtype), self.timestep(sigma), **extra).to(x.dtype)
        return (x - s * v).to(x.dtype)


@dataclass(frozen=True, eq=False)
class CFGDenoiser:
    """Classifier-free guidance: ``uncond + scale * (cond - uncond)``.

    ``CFGDenoiser(denoiser, scale)(x, sigma, context=cond, uncond=uncond_context)`` runs both halves as one
    batch of 2B, unconditional first (the order the reference concatenates them in); with ``scale == 1`` (or
    no ``uncond``) the unconditional half is not run at all. Guidance on the denoised estimate equals guidance
    on the UNet output, since both halves share x and sigma and the wrapper is affine in the output (so does
    skip-layer guidance's term, which diffusers adds to the velocity).
    """

    denoiser: Callable
    scale: float = 7.5
    # skip-layer guidance (SD3.5; diffusers' skip_guidance_layers): at the noise levels in ``skip_sigmas`` the prompt
    # runs once more with the network's blocks ``skip_layers`` skipped, and (prompt - skipped) x ``skip_scale`` is
    # added to the guided output
    skip_layers: tuple = ()
    skip_scale: float = 0.0
    skip_sigmas: frozenset = frozenset()
    # a family's own guidance in place of ``uncond + scale * (cond - uncond)``: ``combine(x, sigma, uncond, cond,
    # scale) -> guided`` on the two halves' denoised estimates, sigma (B,) (Qwen-Image's norm-preserving true CFG)
    combine: Callable | None = None

    def with_timesteps(self, sigmas: torch.Tensor, timesteps: torch.Tensor) -> "CFGDenoiser":
        inner = self.denoiser
        if hasattr(inner, "with_timesteps"):
            inner = inner.with_timesteps(sigmas, timesteps)
        return dataclasses.replace(self, denoiser=inner)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, *, context: torch.Tensor,
                 uncond: torch.Tensor | None = None, added: dict | None = None, uncond_added: dict | None = None,
                 **extra) -> torch.Tensor:
        """``added`` / ``uncond_added``: keyword arguments for the UNet that belong to the prompt / the negative
        prompt (SDXL's ``text_embeds`` and ``time_ids``), batched the same way as ``context`` / ``uncond``."""
        if uncond is None or self.scale == 1.0:
            return self.denoiser(x, sigma, context=context, **(added or {}), **extra)
        cond_extra = {**extra, **(added or {})}   # the prompt's half alone (skip-layer guidance's extra pass)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(x.shape[0])
        if uncond.shape[0] != context.shape[0]:
            uncond = uncond.expand(context.shape[0], *uncond.shape[1:])
        if extra.get("concat") is not None:
            extra["concat"] = torch.cat([extra["concat"]] * 2)
        for key, value in (added or {}).items():
            extra[key] = torch.cat([uncond_added[key], value])
        out = self.denoiser(torch.cat([x, x]), torch.cat([sigma, sigma]),              # (2B, C, h, w)
                            context=torch.cat([uncond, context]), **extra)
        out_uncond, out_cond = out.chunk(2)
        guided = out_uncond + self.scale * (out_cond - out_uncond) if self.combine is None else \
            self.combine(x, sigma, out_uncond, out_cond, self.scale)
        if self.skip_layers and float(sigma[0]) in self.skip_sigmas:
            skipped = self.denoiser(x, sigma, context=context, skip_layers=self.skip_layers, **cond_extra)
            guided = guided + (out_cond - skipped) * self.skip_scale
        return guided


class Averaged:
    """The mean of a denoiser's outputs over several conditionings (ComfyUI's ConditioningCombine: each one's
    prediction, summed and divided by their count): ``extras`` are the keyword arguments of each (dicts a run may
    update between steps); the ones the sampler passes are the first's, and are not used."""

    def __init__(self, denoiser, extras: list[dict]):
        self.denoiser, self.extras = denoiser, extras

    def with_timesteps(self, sigmas: torch.Tensor, timesteps: torch.Tensor) -> "Averaged":
        return Averaged(self.denoiser.with_timesteps(sigmas, timesteps), self.extras)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **_) -> torch.Tensor:
        total = None
        for extra in self.extras:
            out = self.denoiser(x, sigma, **extra)
            total = out if total is None else total + out
        return total / len(self.extras)


@dataclass(frozen=True, eq=False)
class Recorded:
    """A denoiser that keeps its latest output (the estimate of the final latents) in ``value``, for step
    callbacks (previews) and for the images of a run stopped early. It computes exactly what it wraps."""

    denoiser: Callable
    _last: list = field(default_factory=lambda: [None])

    @property
    def value(self) -> torch.Tensor | None:
        return self._last[0]

    def with_timesteps(self, sigmas: torch.Tensor, timesteps: torch.Tensor) -> "Recorded":
        return dataclasses.replace(self, denoiser=self.denoiser.with_timesteps(sigmas, timesteps))

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra) -> torch.Tensor:
        out = self.denoiser(x, sigma, **extra)
        self._last[0] = out
        return out


class Pieces:
    """A denoiser over a batch of ``batch`` images run ``piece`` images at a time: each argument whose first
    dimension is the batch is cut along it (a (1, ...) tensor, broadcast to every image, is passed whole), and the
    pieces' outputs are put back together. Each piece is computed as a batch of ``piece`` images would be."""

    def __init__(self, denoiser, piece: int, batch: int):
        self.denoiser, self.piece, self.batch = denoiser, piece, batch

    def with_timesteps(self, sigmas: torch.Tensor, timesteps: torch.Tensor) -> "Pieces":
        inner = self.denoiser
        if hasattr(inner, "with_timesteps"):
            inner = inner.with_timesteps(sigmas, timesteps)
        return Pieces(inner, self.piece, self.batch)

    def _cut(self, value, lo: int, hi: int):
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == self.batch:
            return value[lo:hi]
        if isinstance(value, dict):
            return {k: self._cut(v, lo, hi) for k, v in value.items()}
        return value

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **extra) -> torch.Tensor:
        outs = []
        for lo in range(0, self.batch, self.piece):
            hi = min(lo + self.piece, self.batch)
            outs.append(self.denoiser(x[lo:hi], self._cut(sigma, lo, hi),
                                      **{k: self._cut(v, lo, hi) for k, v in extra.items()}))
        return torch.cat(outs)
