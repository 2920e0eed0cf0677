"""Noise schedules: the training schedule of a model and the sigmas a sampler walks through.

Conventions (k-diffusion's, Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative
Models"): a latent at noise level ``sigma`` is ``x = x0 + sigma * eps``; a DDPM timestep ``t`` with cumulative
product ``alpha_bar_t`` has ``sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t)``, and the DDPM ("variance
preserving") latent is ``x / sqrt(1 + sigma^2)``.

The training schedule is a :class:`NoiseSchedule`, built from a diffusers ``scheduler_config.json`` dict.
:func:`make_sigmas` turns it into a descending sigma tensor for ``steps`` steps (plus a final sigma) and the
timestep the UNet sees at each sigma. Where the timesteps fall follows the diffusers scheduler each sampler
mirrors, because the schedulers disagree (``family``):

``"k"``          the k-diffusion ports (Euler, Euler a, Heun, LMS, DPM++ SDE): ``steps`` timesteps, linspace
                 ones fractional; Karras/exponential sigmas span the chosen timesteps' sigmas; fractional
                 timesteps from log-sigma interpolation.
``"multistep"``  DPM-Solver multistep and UniPC: leading/linspace spacing place ``steps + 1`` points and drop
                 the last; Karras/exponential sigmas span the whole training range; integer timesteps (Karras
                 ones rounded, exponential ones truncated; the reference's DPM-Solver truncates Karras ones
                 too for the squaredcos_cap_v2 schedule, its UniPC rounds them: we round).
``"ddim"``       DDIM, PNDM/PLMS: integer timesteps; the last step goes to ``alpha_bar = 1`` when the config
                 has ``set_alpha_to_one``, else to ``alpha_bar_0`` (so the final sigma may be non-zero).
``"ddpm"``       DDPM: as ``"ddim"`` but the last step always goes to ``alpha_bar = 1``.
``"lcm"``        LCM: ``steps`` timesteps picked from the ``original_steps``-step skipping schedule.
``"tcd"``        TCD: LCM's timesteps; the last step ends at timestep 0 (sigma_min), not at sigma 0.

Explicit timesteps or sigmas (a pipeline's ``timesteps=`` / ``sigmas=``) replace the placement:
:meth:`NoiseSchedule.with_custom` returns the schedule carrying them, and :func:`make_sigmas` then takes the
timesteps (integers, descending, the model's sigma at each) or the sigmas (``steps + 1`` of them, the last where
sampling ends) as the reference schedulers' ``set_timesteps`` take them; which samplers accept which is the
sampler's (:attr:`.samplers.SamplerInfo.custom`).

What the samplers' entry points ask of a schedule (:func:`.samplers.plan`, :func:`.samplers.sample`, and the
engine's image to image) is a small protocol that :class:`NoiseSchedule` and the flow-matching
:class:`.flow.FlowSchedule` both answer, each for its own latent: which sigma placement a sampler uses
(``family_for``), the sigmas (``make_sigmas``), the initial noise's scale, a clean latent noised to a sigma
(``noised``), the conversions between the sampler's latent and the model's own scaling, the signal scale ``alpha``
of ``x = alpha * x0 + sigma * noise`` at each sigma (1 here: k-diffusion's latent), the ancestral step, and where
image to image starts. No sampler tests which kind of schedule it runs on.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import SDLiteError

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
SPACINGS = ("leading", "trailing", "linspace")
SIGMA_KINDS = ("discrete", "karras", "exponential")
FAMILIES = ("k", "multistep", "ddim", "ddpm", "lcm", "tcd")
CUSTOM_KINDS = ("timesteps", "sigmas")


class ScheduleError(SDLiteError, ValueError):
    """A scheduler config or a schedule request sdlite cannot honour (the message names the field)."""


def _choose(what: str, value, allowed) -> None:
    if value not in allowed:
        raise ScheduleError(f"{what} {value!r} is not supported; expected one of {', '.join(map(repr, allowed))}")


# --- training schedule ---------------------------------------------------------------------------------------

def betas_for(beta_schedule: str, beta_start: float, beta_end: float, num_train_timesteps: int) -> torch.Tensor:
    """The DDPM betas (float32, as the reference computes them)."""
    _choose("beta_schedule", beta_schedule, BETA_SCHEDULES)
    n = num_train_timesteps
    if beta_schedule == "linear":  # Ho et al. 2020
        return torch.linspace(beta_start, beta_end, n, dtype=torch.float32)
    if beta_schedule == "scaled_linear":  # latent diffusion: linear in sqrt(beta)
        return torch.linspace(beta_start**0.5, beta_end**0.5, n, dtype=torch.float32) ** 2

    # squaredcos_cap_v2: Nichol & Dhariwal 2021 ("Improved DDPM"), alpha_bar(t) = cos^2((t + s)/(1 + s) * pi/2),
    # s = 0.008, betas capped at 0.999
    def alpha_bar(u: float) -> float:
        return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2

    return torch.tensor([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), 0.999) for i in range(n)],
                        dtype=torch.float32)


# scheduler_config.json fields that change the training schedule or what the model's outputs mean; sdlite does
# not implement them
_UNSUPPORTED = {
    "rescale_betas_zero_snr": False, "timestep_type": "discrete", "use_flow_sigmas": False, "variance_type": None,
}


@dataclass(frozen=True, eq=False)
class NoiseSchedule:
    """The DDPM training schedule of a model: ``alphas_cumprod`` over ``num_train_timesteps`` timesteps.

    ``timestep_spacing`` and ``steps_offset`` say where the inference timesteps fall by default;
    ``set_alpha_to_one`` where DDIM/PLMS end. Build it with :meth:`from_config`.
    """

    alphas_cumprod: torch.Tensor  # (N,) float32
    timestep_spacing: str | None = None  # None: the spacing the sampler's reference scheduler defaults to
    steps_offset: int = 0
    set_alpha_to_one: bool = False
    custom_timesteps: tuple | None = None  # explicit timesteps replacing the spacing (with_custom)
    custom_sigmas: tuple | None = None     # explicit sigmas, steps + 1 of them (with_custom)
    _log_sigmas: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        if self.timestep_spacing is not None:
            _choose("timestep_spacing", self.timestep_spacing, SPACINGS)
        object.__setattr__(self, "alphas_cumprod", self.alphas_cumprod.detach().to("cpu", torch.float32))
        object.__setattr__(self, "_log_sigmas", self.sigmas.double().log())

    @classmethod
    def from_config(cls, cfg: dict) -> "NoiseSchedule":
        """From a diffusers scheduler config dict (``scheduler/scheduler_config.json``; any scheduler class).

        Missing fields: ``timestep_spacing`` stays unset, so each sampler uses the spacing its reference
        scheduler class defaults to ("linspace" for the Euler family and the multistep solvers, "leading" for
        DDIM/PNDM/DDPM/LCM). The loader states the spacing before it gets here: a model's config that names a
        scheduler class gets that class's default (:func:`sdlite.config.explicit_spacing`); ``steps_offset`` 0,
        ``set_alpha_to_one`` False. Sampler choices
        in the config (solver order, Karras sigmas, DDIM's ``clip_sample``/``thresholding``, ...) are ignored:
        sdlite picks the sampler separately.
        """
        cls_name = str(cfg.get("_class_name") or "")
        if cls_name.startswith("FlowMatch") or "use_dynamic_shifting" in cfg or "shift_terminal" in cfg:
            raise ScheduleError(f"scheduler config {cls_name or '(no _class_name)'} is a flow-matching schedule, "
                                "not a DDPM one: build it with FlowSchedule.from_config (or schedule_from_config)")
        for key, ok in _UNSUPPORTED.items():
            value = cfg.get(key, ok)
            if value != ok and not (key == "variance_type" and value in ("fixed_small", None)):
                raise ScheduleError(f"scheduler config field {key}={value!r} is not supported (expected {ok!r})")
        n = int(cfg.get("num_train_timesteps", 1000))
        if cfg.get("trained_betas") is not None:
            betas = torch.tensor(cfg["trained_betas"], dtype=torch.float32)
            if betas.numel() != n:
                raise ScheduleError(f"scheduler config: trained_betas has {betas.numel()} values, "
                                    f"num_train_timesteps is {n}")
        else:
            betas = betas_for(cfg.get("beta_schedule", "linear"), float(cfg.get("beta_start", 0.0001)),
                              float(cfg.get("beta_end", 0.02)), n)
        return cls(
            alphas_cumprod=torch.cumprod(1.0 - betas, dim=0),
            timestep_spacing=cfg.get("timestep_spacing") or None,
            steps_offset=int(cfg.get("steps_offset", 0)),
            set_alpha_to_one=bool(cfg.get("set_alpha_to_one", False)),
        )

    @property
    def num_train_timesteps(self) -> int:
        return self.alphas_cumprod.numel()

    @property
    def sigmas(self) -> torch.Tensor:
        """(N,) float32, ascending in t: sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t)."""
        return ((1 - self.alphas_cumprod) / self.alphas_cumprod) ** 0.5

    @property
    def sigma_min(self) -> float:
        return self.sigmas[0].item()

    @property
    def sigma_max(self) -> float:
        return self.sigmas[-1].item()

    @property
    def final_sigma(self) -> float:
        """Where DDIM/PLMS end: alpha_bar = 1 (sigma 0) with ``set_alpha_to_one``, else alpha_bar_0."""
        return 0.0 if self.set_alpha_to_one else self.sigma_min

    def sigma_to_t(self, sigma) -> torch.Tensor:
        """Fractional timestep of ``sigma`` by linear interpolation in log sigma (float64, clamped to [0, N-1]).

        Exact (integer) for the training sigmas themselves.
        """
        return _log_interp_t(self._log_sigmas, sigma)

    def t_to_sigma(self, t) -> torch.Tensor:
        """Sigma at a (possibly fractional) timestep by linear interpolation of the training sigmas (float64)."""
        t = torch.as_tensor(t, dtype=torch.float64).clamp(0, self.num_train_timesteps - 1)
        sigmas = self.sigmas.double()
        low = t.floor().long().clamp(max=self.num_train_timesteps - 2)
        return sigmas[low] + (sigmas[low + 1] - sigmas[low]) * (t - low)

    def with_custom(self, timesteps=None, sigmas=None) -> "NoiseSchedule":
        """This schedule with explicit ``timesteps`` (integers, descending, one per step) or ``sigmas`` (descending,
        ``steps + 1`` of them: the last, 0, is where sampling ends), as EulerDiscreteScheduler's
        ``set_timesteps(timesteps=...)`` / ``set_timesteps(sigmas=...)`` take them; both None: the placement again.
        Checked here (:class:`ScheduleError` naming the value at fault)."""
        if timesteps is not None and sigmas is not None:
            raise ScheduleError("give explicit timesteps or explicit sigmas, not both")
        if timesteps is not None:
            timesteps = check_custom_timesteps(timesteps, self.num_train_timesteps)
        if sigmas is not None:
            sigmas = check_custom_sigmas(sigmas)
        return dataclasses.replace(self, custom_timesteps=timesteps, custom_sigmas=sigmas)

    @property
    def custom(self) -> str | None:
        """Which explicit list the schedule carries: "timesteps", "sigmas" or None."""
        return "timesteps" if self.custom_timesteps is not None else "sigmas" if self.custom_sigmas is not None \
            else None

    # -- what the samplers' entry points ask of a schedule (FlowSchedule answers the same) --------------------

    latent_form = "ve"  # samplers run on k-diffusion's latent x = x0 + sigma * noise

    @property
    def describe(self) -> str:
        return "a DDPM-trained (eps / v) model" + (f" with explicit {self.custom}" if self.custom else "")

    def family_for(self, info) -> str | None:
        """The sigma placement (``FAMILIES``) sampler ``info`` (a ``SamplerInfo``) uses; every sampler runs here,
        except that with explicit timesteps or sigmas only those whose reference takes them (``info.custom``)."""
        if self.custom is not None and self.custom not in info.custom:
            return None
        return info.family

    def make_sigmas(self, steps: int, kind: str = "discrete", family: str = "k", spacing: str | None = None,
                    original_steps: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`make_sigmas` on this schedule."""
        return make_sigmas(self, steps, kind, family, spacing, original_steps)  # the module-level function

    def init_noise_scale(self, sigmas: torch.Tensor, family: str, spacing: str | None = None) -> torch.Tensor:
        """What unit-variance noise is multiplied by to start at ``sigmas[0]``, as the reference scheduler does:
        ``sqrt(sigma_0^2 + 1)`` (the DDPM latent's unit variance; Euler-family schedulers with leading spacing
        and all DDPM-parameterised ones) or ``sigma_0`` (Euler-family schedulers with linspace/trailing
        spacing)."""
        if family == "k" and resolve_spacing(self, family, spacing) in ("linspace", "trailing"):
            return sigmas[0]
        return (sigmas[0] ** 2 + 1) ** 0.5

    def noised(self, x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
        """The sampler's latent at ``sigma`` for clean latents ``x0`` and unit noise: ``x0 + sigma * noise``."""
        return x0 + noise * sigma

    def to_sampler(self, latent: torch.Tensor, sigma) -> torch.Tensor:
        """A latent in the model's own (DDPM) scaling at ``sigma`` as the sampler's: ``latent * sqrt(1 + sigma^2)``."""
        return latent * (sigma**2 + 1) ** 0.5

    def from_sampler(self, x: torch.Tensor, sigma) -> torch.Tensor:
        """The sampler's latent at ``sigma`` in the model's own (DDPM) scaling: ``x / sqrt(1 + sigma^2)`` (``x``
        itself at sigma 0)."""
        return x / (sigma**2 + 1) ** 0.5 if sigma > 0 else x

    def alphas(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The signal scale of the sampler's latent at each sigma: 1 (``x = x0 + sigma * noise``)."""
        return torch.ones_like(sigmas)

    def ancestral_step(self, sigma, sigma_next, eta: float = 1.0):
        """``(sigma_down, sigma_up, scale)`` of an ancestral step (:func:`ancestral_step`; scale 1: the latent
        needs no rescaling after the deterministic step)."""
        return (*ancestral_step(sigma, sigma_next, eta), 1.0)

    def img2img_start(self, steps: int, strength: float) -> int:
        """How many of ``steps`` planned steps image to image skips at ``strength``: it runs the last
        ``int(steps * strength)`` of them, as diffusers' StableDiffusion img2img and inpainting pipelines do
        (truncating, so at least ``1 / steps`` of strength is needed for one step)."""
        return steps - min(int(steps * strength), steps)


def _log_interp_t(log_sigmas: torch.Tensor, sigma) -> torch.Tensor:
    sigma = torch.as_tensor(sigma, dtype=torch.float64)
    log_sigma = sigma.clamp(min=1e-10).log().reshape(-1)
    log_sigmas = log_sigmas.double()
    low = (torch.searchsorted(log_sigmas, log_sigma, right=True) - 1).clamp(0, len(log_sigmas) - 2)
    lo, hi = log_sigmas[low], log_sigmas[low + 1]
    w = ((lo - log_sigma) / (lo - hi)).clamp(0, 1)
    return ((1 - w) * low + w * (low + 1)).reshape(sigma.shape)


def ancestral_step(sigma_from, sigma_to, eta: float = 1.0):
    """(sigma_down, sigma_up) of an ancestral step on k-diffusion's latent (Song et al. 2021 / k-diffusion): the
    deterministic step goes to sigma_down, then fresh noise of std sigma_up brings the latent back up to sigma_to;
    ``eta`` scales the DDPM posterior's noise (1: ancestral sampling, 0: none)."""
    if not eta:
        return sigma_to, torch.zeros_like(sigma_to)
    sigma_up = torch.minimum(sigma_to, eta * (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5)
    return (sigma_to**2 - sigma_up**2) ** 0.5, sigma_up


def check_custom_timesteps(timesteps, num_train_timesteps: int | None = None) -> tuple[int, ...]:
    """Explicit timesteps as a tuple of ints: integers from 0 (to ``num_train_timesteps - 1`` where given), strictly
    descending, at least one. Raises :class:`ScheduleError` naming the value at fault."""
    values = _as_list(timesteps, "timesteps")
    for i, t in enumerate(values):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) and not (isinstance(t, float) and t.is_integer()):
            raise ScheduleError(f"timesteps[{i}]={t!r} is not valid: timesteps are integers (e.g. 999,749,499,249)")
        top = "" if num_train_timesteps is None else f" to {num_train_timesteps - 1}"
        if t < 0 or num_train_timesteps is not None and t >= num_train_timesteps:
            raise ScheduleError(f"timesteps[{i}]={int(t)} is out of range: expected 0{top} (the model's training "
                                "timesteps)")
        if i and t >= values[i - 1]:
            raise ScheduleError(f"timesteps {_text(values)} are not strictly descending (timesteps[{i}]={int(t)} "
                                f"after {int(values[i - 1])})")
    return tuple(int(t) for t in values)


def check_custom_sigmas(sigmas) -> tuple[float, ...]:
    """Explicit sigmas as a tuple of floats: finite, strictly descending, at least two (the start of the first step
    and the end of the last), every one above 0 but the last, which is 0: sampling ends on the clean image (a
    reference scheduler given a last sigma above 0 hands that noisy latent to the decoder in its own scaling, which
    is not an image sdlite writes). Raises :class:`ScheduleError`."""
    values = _as_list(sigmas, "sigmas")
    if len(values) < 2:
        raise ScheduleError(f"sigmas {_text(values)}: give at least two, the start of the first step and the end of "
                            "the last (e.g. 14.6,2.5,0.9,0: three steps ending at 0)")
    for i, s in enumerate(values):
        if isinstance(s, bool) or not isinstance(s, (int, float, np.floating, np.integer)) or not math.isfinite(s):
            raise ScheduleError(f"sigmas[{i}]={s!r} is not valid: expected a finite number")
        if s < 0 or s == 0 and i < len(values) - 1:
            raise ScheduleError(f"sigmas[{i}]={s!r} is out of range: sigmas are above 0 (the last is 0)")
        if i and s >= values[i - 1]:
            raise ScheduleError(f"sigmas {_text(values)} are not strictly descending (sigmas[{i}]={s:g} after "
                                f"{values[i - 1]:g})")
    if values[-1] != 0:
        raise ScheduleError(f"sigmas {_text(values)}: end the list with 0, where sampling ends (the steps are one "
                            "fewer than the values)")
    return tuple(float(s) for s in values)


def _as_list(values, what: str) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ScheduleError(f"{what} {values!r} are not valid: expected a list of numbers")
    values = list(values.tolist() if hasattr(values, "tolist") else values)
    if not values:
        raise ScheduleError(f"{what}: the list is empty")
    return values


def _text(values) -> str:
    return ",".join(f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)
                    for v in values)


# --- sigma sequences -----------------------------------------------------------------------------------------

def karras_sigmas(sigma_min: float, sigma_max: float, steps: int, rho: float = 7.0) -> torch.Tensor:
    """Karras et al. 2022, eq. (5): sigma_i = (max^(1/rho) + i/(n-1) (min^(1/rho) - max^(1/rho)))^rho (float64)."""
    ramp = torch.linspace(0, 1, steps, dtype=torch.float64)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


def exponential_sigmas(sigma_min: float, sigma_max: float, steps: int) -> torch.Tensor:
    """Sigmas evenly spaced in log sigma, from sigma_max down to sigma_min (float64)."""
    return torch.linspace(math.log(sigma_max), math.log(sigma_min), steps, dtype=torch.float64).exp()


# the timestep spacing each family's diffusers scheduler classes default to when the config does not say
DEFAULT_SPACING = {"k": "linspace", "multistep": "linspace", "ddim": "leading", "ddpm": "leading", "lcm": "leading",
                   "tcd": "leading"}


def resolve_spacing(schedule: NoiseSchedule, family: str, spacing: str | None = None) -> str:
    """The spacing used: the caller's, else the model's scheduler config's, else the family's default."""
    _choose("schedule family", family, FAMILIES)
    spacing = spacing or schedule.timestep_spacing or DEFAULT_SPACING[family]
    _choose("timestep spacing", spacing, SPACINGS)
    return spacing


def spaced_timesteps(schedule: NoiseSchedule, steps: int, spacing: str | None = None, family: str = "k",
                     original_steps: int = 50) -> np.ndarray:
    """The ``steps`` inference timesteps (descending, float64) where the ``family``'s diffusers scheduler puts them.

    Spacings (Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps are Flawed", table 2):
    leading ``i * (N // steps) + steps_offset``; trailing ``round(N - i * N / steps) - 1``; linspace evenly from
    N - 1 to 0.
    """
    spacing = resolve_spacing(schedule, family, spacing)
    n_train = schedule.num_train_timesteps
    if not 1 <= steps <= n_train:
        raise ScheduleError(f"steps={steps}: expected 1 to {n_train}")
    if family in ("lcm", "tcd"):  # Luo et al. 2023: every (N // original_steps)-th timestep, `steps` of them
        # picked evenly (TCDScheduler places them as LCMScheduler does unless set_timesteps is given its own
        # original_inference_steps, which no pipeline passes)
        if steps > original_steps:
            raise ScheduleError(f"{family.upper()}: steps={steps} exceeds its original_steps={original_steps}")
        k = n_train // original_steps
        origin = (np.arange(1, original_steps + 1) * k - 1)[::-1]
        picked = np.floor(np.linspace(0, original_steps, steps, endpoint=False)).astype(np.int64)
        return origin[picked].astype(np.float64)
    if spacing == "trailing":
        return np.arange(n_train, 0, -n_train / steps).round() - 1.0
    if family == "multistep":  # places steps + 1 points and drops the last
        if spacing == "leading":
            return (np.arange(0, steps + 1) * (n_train // (steps + 1))).round()[::-1][:-1] + schedule.steps_offset
        return np.linspace(0, n_train - 1, steps + 1).round()[::-1][:-1].copy()
    if spacing == "leading":
        return (np.arange(0, steps) * (n_train // steps)).round()[::-1] + float(schedule.steps_offset)
    if family == "k":  # fractional, computed in float32 as the reference does
        return np.linspace(0, n_train - 1, steps, dtype=np.float32)[::-1].astype(np.float64)
    return np.linspace(0, n_train - 1, steps).round()[::-1].copy()


def make_sigmas(schedule: NoiseSchedule, steps: int, kind: str = "discrete", family: str = "k",
                spacing: str | None = None, original_steps: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigmas, timesteps)``: ``steps + 1`` descending float32 sigmas (the last the family's end point, usually
    0) and the ``steps`` float32 timesteps the UNet is given at ``sigmas[:-1]``.

    ``kind``: "discrete" (the model's own sigmas at the spaced timesteps, interpolated linearly in sigma for
    fractional ones), "karras" (rho = 7) or "exponential".

    A schedule carrying explicit timesteps or sigmas (:meth:`NoiseSchedule.with_custom`) gives those instead, as
    the reference's ``set_timesteps(timesteps=...)`` / ``set_timesteps(sigmas=...)`` do: the model's sigma at each
    timestep and the family's end point; or the sigmas as given (float32), at the timesteps log-interpolated from
    them. ``steps`` must then be their count (the sigmas': one less) and ``kind`` "discrete".
    """
    _choose("sigma schedule", kind, SIGMA_KINDS)
    if schedule.custom is not None:
        return _explicit(schedule, steps, kind, family)
    timesteps = spaced_timesteps(schedule, steps, spacing, family, original_steps)
    sigmas = schedule.t_to_sigma(torch.from_numpy(timesteps.copy()))
    if kind != "discrete":
        if family == "k":  # spans the spaced timesteps' sigmas
            lo, hi = sigmas[-1].item(), sigmas[0].item()
        else:  # spans the training sigmas
            lo, hi = schedule.sigma_min, schedule.sigma_max
        sigmas = karras_sigmas(lo, hi, steps) if kind == "karras" else exponential_sigmas(lo, hi, steps)
        # the reference interpolates against float32 logs of the sigma table, and its integer timesteps
        # (rounded or truncated below) depend on that last bit: interpolate as it does
        t = _log_interp_t(schedule.sigmas.log(), sigmas)
        if family == "multistep":  # integer timesteps there: Karras ones rounded, exponential ones truncated
            t = t.round() if kind == "karras" else t.trunc()
        timesteps = t.numpy()
    # DDIM/PLMS end at final_sigma; TCD's last step at timestep 0; the others at sigma 0
    final = {"ddim": schedule.final_sigma, "tcd": schedule.sigma_min}.get(family, 0.0)
    sigmas = torch.cat([sigmas, torch.tensor([final], dtype=torch.float64)]).float()
    return sigmas, torch.from_numpy(np.ascontiguousarray(timesteps)).float()


def _explicit(schedule: NoiseSchedule, steps: int, kind: str, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    what = schedule.custom
    given = schedule.custom_timesteps if what == "timesteps" else schedule.custom_sigmas
    count = len(given) if what == "timesteps" else len(given) - 1
    if steps != count:
        raise ScheduleError(f"steps={steps}, but the explicit {what} give {count} steps (the steps are set by the "
                            f"list: {'one per timestep' if what == 'timesteps' else 'one less than the sigmas'})")
    if kind != "discrete":
        raise ScheduleError(f"explicit {what} replace the sigma schedule: they cannot be {kind} sigmas (choose the "
                            "discrete schedule, or a sampler name without Karras / Exponential)")
    if what == "sigmas":
        sigmas = torch.tensor(given, dtype=torch.float32)
        # as the reference: the steps' timesteps log-interpolated against the float32 log-sigma table
        timesteps = _log_interp_t(schedule.sigmas.log(), sigmas[:-1]).float()
        return sigmas, timesteps
    check_custom_timesteps(given, schedule.num_train_timesteps)
    timesteps = torch.tensor(given, dtype=torch.float64)
    final = {"ddim": schedule.final_sigma, "tcd": schedule.sigma_min}.get(family, 0.0)
    sigmas = torch.cat([schedule.t_to_sigma(timesteps), torch.tensor([final], dtype=torch.float64)]).float()
    return sigmas, timesteps.float()
