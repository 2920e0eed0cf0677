"""Flow matching: the schedule of SD3 / SD3.5 and FLUX, and where each sampler's sigmas fall on it.

Convention (rectified flow: Liu et al. 2022, "Flow Straight and Fast"; Lipman et al. 2023, "Flow Matching for
Generative Modeling"; Esser et al. 2024, "Scaling Rectified Flow Transformers for High-Resolution Image
Synthesis", the SD3 paper): a latent at noise level ``sigma`` in [0, 1] is ``x = (1 - sigma) * x0 + sigma *
noise``; the network predicts the velocity ``v = noise - x0`` at timestep ``t = sigma * N`` (N =
``num_train_timesteps``, 1000), so the denoised estimate is ``x0 = x - sigma * v``
(:class:`~.denoisers.FlowDenoiser`). Sampling starts from unit noise, the flow latent at sigma 1.

The samplers run on the flow latent itself. Its probability-flow ODE ``dx/dsigma = v = (x - x0) / sigma`` has
k-diffusion's form, so Euler's step ``x + (sigma' - sigma) (x - D) / sigma`` *is* the flow-matching Euler step
(d = v), and Heun's method carries over unchanged. The exponential integrators (DPM-Solver++, UniPC) need the
signal scale ``alpha = 1 - sigma`` (:meth:`FlowSchedule.alphas`): their log-SNR time is ``lambda = log((1 -
sigma) / sigma)``, not k-diffusion's ``-log(sigma)``. The ancestral step (:meth:`FlowSchedule.ancestral_step`) is
k-diffusion's taken in the equivalent VE coordinates ``x / (1 - sigma)``, ``sigma / (1 - sigma)``, written so it
stays finite at sigma = 1.

Sigma placement (``FLOW_FAMILIES``; each sampler's ``SamplerInfo.flow_family``), as each diffusers scheduler's
``set_timesteps`` computes it, in the same dtypes and order of operations (so the sigmas are bit-equal):

``"euler"``      FlowMatchEulerDiscreteScheduler (and FlowMatchHeunDiscreteScheduler, which agrees with it):
                 ``steps`` timesteps evenly spaced from the trained sigma_max to sigma_min (or, with
                 ``sigma_spacing="linear"``, the sigmas ``linspace(1, 1/steps, steps)`` that FLUX's pipeline
                 passes; or explicit ``custom_sigmas``), then shifted: SD3's ``shift s / (1 + (shift - 1) s)``
                 (SD3 paper, eq. 23) or, with dynamic shifting, the time shift ``e^mu / (e^mu + (1/s - 1))``
                 (exponential) / ``mu / (mu + (1/s - 1))`` (linear) at a resolution-dependent ``mu``
                 (:func:`calculate_shift`); then stretched to ``shift_terminal`` where set; Karras or exponential
                 sigmas spanning the result where asked; timesteps ``sigma * N`` (float32); final sigma 0.
``"dpmsolver"``  DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=shift): ``1 - linspace(1, 1/N,
                 steps + 1)`` shifted, reversed, the 0 dropped (so it starts just below 1); with dynamic
                 shifting ``flow_shift = e^mu``; integer (truncated) timesteps.
``"unipc"``      UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=shift): ``linspace(1, 1/N, steps +
                 1)[:-1]`` (or ``custom_sigmas``) shifted as for Euler, stretched to ``shift_terminal``, a first
                 sigma of 1 lowered by 1e-6; integer (truncated) timesteps.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from .denoisers import FlowDenoiser  # noqa: F401  (re-exported: the flow-matching pieces in one place)
from .schedules import SIGMA_KINDS, NoiseSchedule, ScheduleError, check_custom_sigmas

FLOW_FAMILIES = ("euler", "dpmsolver", "unipc")
TIME_SHIFT_TYPES = ("exponential", "linear")
SIGMA_SPACINGS = ("scheduler", "linear")
FLOW_SCHEDULER_CLASSES = ("FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler")

# scheduler_config.json fields of FlowMatchEulerDiscreteScheduler that sdlite does not implement, with the value
# it requires. (use_karras_sigmas / use_exponential_sigmas are sampler choices, ignored as NoiseSchedule ignores
# them: the sigma kind is picked with the sampler, e.g. "Euler Karras".)
_UNSUPPORTED = {"invert_sigmas": False, "stochastic_sampling": False, "use_beta_sigmas": False}


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
                    max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent ``mu``: linear in the image's token count, ``base_shift`` at ``base_seq_len``
    tokens and ``max_shift`` at ``max_seq_len`` (FLUX.1; the same arithmetic as diffusers' pipelines)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return image_seq_len * slope + intercept


def _static_shift(shift, s: np.ndarray) -> np.ndarray:
    """SD3's timestep shift (Esser et al. 2024, eq. 23): ``shift s / (1 + (shift - 1) s)``, in ``s``'s dtype."""
    return shift * s / (1 + (shift - 1) * s)


def _karras(sigma_min: float, sigma_max: float, steps: int, rho: float = 7.0) -> np.ndarray:
    """Karras et al. 2022, eq. (5), over [sigma_min, sigma_max] (float64, numpy, as the reference computes it)."""
    ramp = np.linspace(0, 1, steps)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


def _exponential(sigma_min: float, sigma_max: float, steps: int) -> np.ndarray:
    """Evenly spaced in log sigma from sigma_max down to sigma_min (float64, numpy)."""
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), steps))


def _truncated_timesteps(s: np.ndarray, n_train: int) -> torch.Tensor:
    """The multistep schedulers' integer timesteps: ``sigma * N`` truncated (as float32 for the model)."""
    return torch.from_numpy(s * n_train).to(torch.int64).to(torch.float32)


@dataclass(frozen=True, eq=False)
class FlowSchedule:
    """A flow-matching training schedule (diffusers' FlowMatchEulerDiscreteScheduler config) and the per-run
    choices that shape its sigmas: ``mu`` (dynamic shifting; set it with :meth:`for_image` or :meth:`with_mu`),
    ``custom_sigmas`` (explicit sigmas, one per step, before shifting, as a pipeline's ``sigmas=``) and
    ``sigma_spacing`` ("scheduler": the scheduler's own spacing, what SD3's pipeline uses; "linear":
    ``linspace(1, 1/steps, steps)``, what FLUX's pipeline passes). Build it with :meth:`from_config`; change the
    per-run fields with ``dataclasses.replace`` (validated again).

    It answers the same protocol as :class:`~.schedules.NoiseSchedule` (``family_for``, ``make_sigmas``,
    ``init_noise_scale``, ``noised``, ``to_sampler``/``from_sampler``, ``alphas``, ``ancestral_step``,
    ``img2img_start``), so :func:`~.samplers.plan` and :func:`~.samplers.sample` take either.
    """

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    shift_terminal: float | None = None
    time_shift_type: str = "exponential"
    mu: float | None = None
    custom_sigmas: tuple[float, ...] | None = None
    sigma_spacing: str = "scheduler"

    latent_form = "flow"  # samplers run on the flow latent x = (1 - sigma) x0 + sigma noise
    describe = "a flow-matching model"

    def __post_init__(self):
        if self.time_shift_type not in TIME_SHIFT_TYPES:
            raise ScheduleError(f"time_shift_type {self.time_shift_type!r} is not supported; expected one of "
                                f"{', '.join(map(repr, TIME_SHIFT_TYPES))}")
        if self.sigma_spacing not in SIGMA_SPACINGS:
            raise ScheduleError(f"sigma_spacing {self.sigma_spacing!r} is not supported; expected one of "
                                f"{', '.join(map(repr, SIGMA_SPACINGS))}")
        if int(self.num_train_timesteps) < 2:
            raise ScheduleError(f"num_train_timesteps={self.num_train_timesteps!r}: expected at least 2")
        if not self.shift > 0:
            raise ScheduleError(f"shift={self.shift!r}: expected a positive number")
        if self.shift_terminal is not None and not 0 < self.shift_terminal < 1:
            raise ScheduleError(f"shift_terminal={self.shift_terminal!r}: expected a number between 0 and 1")
        if self.custom_sigmas is not None:
            sigmas = tuple(float(s) for s in self.custom_sigmas)
            if not sigmas or not all(0 < s <= 1 for s in sigmas):
                raise ScheduleError(f"custom sigmas {list(self.custom_sigmas)!r}: expected one or more values in "
                                    "(0, 1]")
            object.__setattr__(self, "custom_sigmas", sigmas)
        if self.mu is not None:
            object.__setattr__(self, "mu", float(self.mu))
        # the trained sigma range, as the reference scheduler's constructor computes it (float32, torch): shifted
        # by `shift` unless the shift is dynamic
        ends = torch.tensor([float(self.num_train_timesteps), 1.0], dtype=torch.float32) / self.num_train_timesteps
        if not self.use_dynamic_shifting:
            ends = self.shift * ends / (1 + (self.shift - 1) * ends)
        object.__setattr__(self, "_trained", (ends[0].item(), ends[1].item()))

    @classmethod
    def from_config(cls, cfg: dict) -> "FlowSchedule":
        """From a diffusers FlowMatchEulerDiscreteScheduler (or FlowMatchHeunDiscreteScheduler) config dict
        (``scheduler/scheduler_config.json``). Missing fields take the scheduler class's defaults. Refused by
        name: another scheduler class, ``invert_sigmas``, ``stochastic_sampling``, ``use_beta_sigmas``, an unknown
        ``time_shift_type``."""
        cls_name = cfg.get("_class_name")
        if cls_name is not None and cls_name not in FLOW_SCHEDULER_CLASSES:
            raise ScheduleError(f"scheduler class {cls_name!r} is not a flow-matching scheduler sdlite reads; "
                                f"expected one of {', '.join(FLOW_SCHEDULER_CLASSES)}")
        for key, ok in _UNSUPPORTED.items():
            if bool(cfg.get(key) or False) != ok:
                raise ScheduleError(f"scheduler config field {key}={cfg[key]!r} is not supported (expected {ok!r})")

        def get(key, default):   # a field missing or null takes the class's default
            return default if cfg.get(key) is None else cfg[key]

        return cls(
            num_train_timesteps=int(get("num_train_timesteps", 1000)),
            shift=float(get("shift", 1.0)),
            use_dynamic_shifting=bool(get("use_dynamic_shifting", False)),
            base_shift=float(get("base_shift", 0.5)),
            max_shift=float(get("max_shift", 1.15)),
            base_image_seq_len=int(get("base_image_seq_len", 256)),
            max_image_seq_len=int(get("max_image_seq_len", 4096)),
            shift_terminal=float(cfg["shift_terminal"]) if cfg.get("shift_terminal") else None,
            time_shift_type=get("time_shift_type", "exponential"),
        )

    # -- per-run choices ---------------------------------------------------------------------------------------

    def mu_for(self, image_seq_len: int) -> float:
        """:func:`calculate_shift` with this config's base/max shift and sequence lengths."""
        return calculate_shift(image_seq_len, self.base_image_seq_len, self.max_image_seq_len, self.base_shift,
                               self.max_shift)

    def with_mu(self, mu: float | None) -> "FlowSchedule":
        return dataclasses.replace(self, mu=mu)

    def for_image(self, image_seq_len: int) -> "FlowSchedule":
        """This schedule for an image of ``image_seq_len`` transformer tokens: ``mu`` set from it where the shift
        is dynamic, else unchanged."""
        return self.with_mu(self.mu_for(image_seq_len)) if self.use_dynamic_shifting else self

    def with_sigmas(self, sigmas) -> "FlowSchedule":
        """Explicit sigmas, one per step (before the shift), as a pipeline's ``sigmas=`` argument."""
        return dataclasses.replace(self, custom_sigmas=None if sigmas is None else tuple(sigmas))

    def with_custom(self, timesteps=None, sigmas=None) -> "FlowSchedule":
        """Explicit sigmas as the request gives them (the ``NoiseSchedule.with_custom`` convention: ``steps + 1``
        descending values, the last, 0, where sampling ends) held as the pipelines' ``sigmas=``
        argument: the ``steps`` values before the shift, in (0, 1]. Explicit timesteps are refused: give sigmas."""
        if timesteps is not None:
            raise ScheduleError("explicit timesteps are for DDPM-trained models; on a flow-matching model give "
                                "explicit sigmas (in (0, 1], before the shift, ending with 0)")
        if sigmas is None:
            return self.with_sigmas(None)
        sigmas = check_custom_sigmas(sigmas)
        if sigmas[0] > 1:
            raise ScheduleError(f"sigmas {','.join(f'{s:g}' for s in sigmas)}: a flow-matching model's sigmas lie in "
                                "(0, 1] (e.g. 1,0.75,0.5,0.25,0: four steps)")
        return self.with_sigmas(sigmas[:-1])

    # -- sigmas ------------------------------------------------------------------------------------------------

    @property
    def sigma_max(self) -> float:
        """The trained sigma range's top (float32 value), where the scheduler's own spacing starts."""
        return self._trained[0]

    @property
    def sigma_min(self) -> float:
        return self._trained[1]

    def _time_shift(self, s: np.ndarray) -> np.ndarray:
        if self.mu is None:
            raise ScheduleError("use_dynamic_shifting: the schedule needs mu (FlowSchedule.for_image(image_seq_len) "
                                "or with_mu(mu))")
        if self.time_shift_type == "exponential":
            return math.exp(self.mu) / (math.exp(self.mu) + (1 / s - 1) ** 1.0)
        return self.mu / (self.mu + (1 / s - 1) ** 1.0)

    def _shifted(self, s: np.ndarray) -> np.ndarray:
        s = self._time_shift(s) if self.use_dynamic_shifting else _static_shift(self.shift, s)
        if self.shift_terminal:  # stretch so the last sigma is shift_terminal (LTX-Video's rule)
            one_minus = 1 - s
            if one_minus[-1] == 0:
                raise ScheduleError(f"shift_terminal={self.shift_terminal}: the last shifted sigma is 1, which "
                                    "cannot be stretched (use more than one step)")
            s = 1 - one_minus / (one_minus[-1] / (1 - self.shift_terminal))
        return s

    def _custom(self, steps: int, dtype) -> np.ndarray:
        if len(self.custom_sigmas) != steps:
            raise ScheduleError(f"steps={steps}, but the schedule's custom sigmas are {len(self.custom_sigmas)}")
        return np.array(self.custom_sigmas, dtype=np.float64).astype(dtype)

    def _euler_sigmas(self, steps: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        n_train = self.num_train_timesteps
        if self.custom_sigmas is not None:
            s = self._custom(steps, np.float32)  # the reference takes explicit sigmas as float32
        elif self.sigma_spacing == "linear":
            s = np.linspace(1.0, 1 / steps, steps).astype(np.float32)
        else:
            s = np.linspace(self.sigma_max * n_train, self.sigma_min * n_train, steps) / n_train
        s = self._shifted(s)
        if kind == "karras":
            s = _karras(s[-1].item(), s[0].item(), steps)
        elif kind == "exponential":
            s = _exponential(s[-1].item(), s[0].item(), steps)
        sigmas = torch.from_numpy(np.ascontiguousarray(s)).to(torch.float32)
        return torch.cat([sigmas, torch.zeros(1)]), sigmas * n_train

    def _dpmsolver_sigmas(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        n_train = self.num_train_timesteps
        if self.custom_sigmas is not None:
            raise ScheduleError("custom sigmas: DPMSolverMultistepScheduler's flow sigmas take none; use a sampler "
                                "on the Euler or UniPC placement (euler, euler_a, heun, unipc)")
        if self.shift_terminal:
            raise ScheduleError(f"shift_terminal={self.shift_terminal}: DPMSolverMultistepScheduler's flow sigmas "
                                "have no terminal stretch; use a sampler on the Euler or UniPC placement")
        if self.use_dynamic_shifting:
            if self.time_shift_type != "exponential":
                raise ScheduleError(f"time_shift_type {self.time_shift_type!r}: DPMSolverMultistepScheduler's "
                                    "dynamic shifting is exponential only")
            if self.mu is None:
                self._time_shift(np.ones(1))  # raises: mu is needed
            shift = np.exp(self.mu)
        else:
            shift = self.shift
        s = 1.0 - np.linspace(1, 1 / n_train, steps + 1)
        s = np.flip(_static_shift(shift, s))[:-1].copy()
        timesteps = _truncated_timesteps(s, n_train)
        return torch.from_numpy(np.concatenate([s, [0.0]]).astype(np.float32)), timesteps

    def _unipc_sigmas(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        n_train = self.num_train_timesteps
        if self.custom_sigmas is not None:
            s = self._custom(steps, np.float64)
        else:
            s = np.linspace(1, 1 / n_train, steps + 1)[:-1]
        s = np.array(self._shifted(s), dtype=np.float64)
        if np.fabs(s[0] - 1) < 1e-6:  # lambda is -inf at sigma 1: the reference starts 1e-6 below it
            s[0] -= 1e-6
        timesteps = _truncated_timesteps(s, n_train)
        return torch.from_numpy(np.concatenate([s, [0.0]]).astype(np.float32)), timesteps

    def make_sigmas(self, steps: int, kind: str = "discrete", family: str = "euler",
                    spacing: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas, timesteps)``: ``steps + 1`` descending float32 sigmas (the last 0) where the ``family``'s
        diffusers scheduler puts them, and the ``steps`` float32 training timesteps (``sigma * N``, truncated to
        integers on the multistep placements) the model is given at ``sigmas[:-1]``.

        ``kind``: "discrete" (the scheduler's own sigmas), "karras" or "exponential" (spanning them; the Euler
        placement only). ``spacing`` (a DDPM timestep spacing) does not apply here and must be None.
        """
        if family not in FLOW_FAMILIES:
            raise ScheduleError(f"flow sigma placement {family!r} is not supported; expected one of "
                                f"{', '.join(map(repr, FLOW_FAMILIES))}")
        if kind not in SIGMA_KINDS:
            raise ScheduleError(f"sigma schedule {kind!r} is not supported; expected one of "
                                f"{', '.join(map(repr, SIGMA_KINDS))}")
        if spacing is not None:
            raise ScheduleError(f"timestep spacing {spacing!r} does not apply to a flow-matching schedule "
                                "(its sigmas are placed by the shift)")
        if not 1 <= steps <= self.num_train_timesteps:
            raise ScheduleError(f"steps={steps}: expected 1 to {self.num_train_timesteps}")
        if family == "euler":
            return self._euler_sigmas(steps, kind)
        if kind != "discrete":
            raise ScheduleError(f"{kind} sigmas: on flow matching only the Euler placement (euler, euler_a, heun) "
                                f"has them, not {family!r}")
        return self._dpmsolver_sigmas(steps) if family == "dpmsolver" else self._unipc_sigmas(steps)

    # -- the protocol the samplers' entry points use ---------------------------------------------------------

    def family_for(self, info) -> str | None:
        """The flow sigma placement of sampler ``info`` (a ``SamplerInfo``), or None where it does not run on flow
        matching."""
        return info.flow_family

    def init_noise_scale(self, sigmas: torch.Tensor, family: str, spacing: str | None = None) -> torch.Tensor:
        """1: sampling starts from unit noise as it is (the flow latent at sigma 1, whatever sigmas[0] is, as the
        reference pipelines start)."""
        return torch.ones((), dtype=torch.float32)

    def noised(self, x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
        """The flow latent at ``sigma``: ``sigma * noise + (1 - sigma) * x0`` (the forward process; the
        reference's ``scale_noise``)."""
        return sigma * noise + (1.0 - sigma) * x0

    def to_sampler(self, latent: torch.Tensor, sigma) -> torch.Tensor:
        """The samplers run on the model's own latent: unchanged."""
        return latent

    def from_sampler(self, x: torch.Tensor, sigma) -> torch.Tensor:
        return x

    def alphas(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The signal scale at each sigma: ``1 - sigma``."""
        return 1 - sigmas

    def ancestral_step(self, sigma, sigma_next, eta: float = 1.0):
        """``(sigma_down, sigma_up, scale)`` of an ancestral step on the flow latent: an Euler step to sigma_down,
        the latent multiplied by ``scale``, then fresh noise of std sigma_up. Returned as float32 scalars.

        Derivation: in the VE coordinates ``y = x / (1 - sigma)``, ``s = sigma / (1 - sigma)`` (``y = x0 + s
        noise``) the step is k-diffusion's: ``s_up = min(s', eta s' sqrt(1 - (s'/s)^2))`` (eta scales the DDPM
        posterior's noise), ``s_down = sqrt(s'^2 - s_up^2)``. With ``r = s'/s = sigma' (1 - sigma) / (sigma (1 -
        sigma'))`` (0 at sigma = 1) and ``u = min(1, eta sqrt(1 - r^2))``: ``s_down = s' sqrt(1 - u^2)``, which is
        the flow level ``sigma_down = s_down / (1 + s_down)``; back in flow coordinates the latent at sigma_down
        is scaled by ``(1 - sigma') / (1 - sigma_down) = (1 - sigma') (1 + s_down)`` and gets noise of std
        ``sigma_up = sigma' u``. The result is ``(1 - sigma') x0 + sigma' (sqrt(1 - u^2) eps + u noise)``: the
        flow latent at sigma' with a fraction u of fresh noise, whose noise part keeps variance sigma'^2. eta = 0
        is the Euler step."""
        s, s_next = float(sigma), float(sigma_next)
        if not eta or s_next >= 1.0 or s_next <= 0.0:
            down, up, scale = s_next, 0.0, 1.0
        else:
            r = s_next * (1 - s) / (s * (1 - s_next))
            u = min(1.0, eta * math.sqrt(max(0.0, 1 - r * r)))
            ve_down = s_next / (1 - s_next) * math.sqrt(1 - u * u)
            down, up, scale = ve_down / (1 + ve_down), s_next * u, (1 - s_next) * (1 + ve_down)
        return tuple(torch.tensor(v, dtype=torch.float32) for v in (down, up, scale))

    def img2img_start(self, steps: int, strength: float) -> int:
        """How many planned steps image to image skips, as StableDiffusion3Img2ImgPipeline's ``get_timesteps``
        computes it: ``int(max(steps - min(steps * strength, steps), 0))`` (it truncates the steps skipped, where
        the StableDiffusion pipelines truncate the steps run)."""
        return int(max(steps - min(steps * strength, steps), 0))


def schedule_from_config(cfg: dict):
    """The schedule a diffusers scheduler config describes: a :class:`FlowSchedule` for a flow-matching one
    (a FlowMatch* class, or flow-only fields such as ``use_dynamic_shifting``), else a
    :class:`~.schedules.NoiseSchedule`."""
    cls_name = str(cfg.get("_class_name") or "")
    if cls_name.startswith("FlowMatch") or "use_dynamic_shifting" in cfg or "shift_terminal" in cfg:
        return FlowSchedule.from_config(cfg)
    return NoiseSchedule.from_config(cfg)
