"""The work a request may ask of the server, and how long a job and a shutdown may take.

One :class:`Limits` holds them, for ``sdlite serve`` (its flags), ``create_app`` and the Ray cluster
(``ClusterConfig.limits``). :func:`check_request` applies the per-request ones to an A1111 request after its
defaults are filled in and before anything costly is done, so that a request for a 20000x20000 image or 6,400
images is answered at once with a 422 that names the field, its value and the limit (and the flag that sets it).

    limits = Limits(max_pixels=1024 * 1024)
    check_request(fields, limits)        # LimitExceeded (422) naming e.g. "width x height"

The defaults suit a CPU server: one image of at most 2048x2048 (4.2 megapixels, a 16x upscale of SD 1.5's 512x512
area), 150 steps (the A1111 UI's slider maximum), 16 images a request (batch_size x n_iter) and prompts of 10,000
characters (about 30 chunks of 75 tokens, far more than any prompt people write).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..engine import budget
from ..pipeline import MAX_STEPS, RequestError, validate
from .jobs import Unavailable

DEFAULT_MAX_PIXELS = 2048 * 2048
DEFAULT_MAX_STEPS = 150
DEFAULT_MAX_IMAGES = 16
DEFAULT_MAX_PROMPT_CHARS = 10_000
DEFAULT_JOB_TIMEOUT_S = 0.0          # 0: no time limit
DEFAULT_SHUTDOWN_GRACE_S = 30.0
# the text fields a prompt-length bound applies to
PROMPT_FIELDS = ("prompt", "negative_prompt", "hr_prompt", "hr_negative_prompt")


class LimitExceeded(RequestError):
    """A request asks for more than the server's limits allow (HTTP 422); the message names the field, the value,
    the limit and the flag that sets it."""


class NeverFits(LimitExceeded):
    """A job whose estimated peak memory exceeds what this server could ever give it (HTTP 422)."""


class NotEnoughMemoryNow(Unavailable):
    """A job whose estimated peak memory exceeds the memory available now, less the margin (HTTP 503)."""

    retry_after = 10


@dataclass(frozen=True)
class Limits:
    """Per-request bounds (``max_*``), the job time limit and the shutdown grace. ``job_timeout`` 0 means none."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_steps: int = DEFAULT_MAX_STEPS
    max_images: int = DEFAULT_MAX_IMAGES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    job_timeout: float = DEFAULT_JOB_TIMEOUT_S
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_S
    max_memory_mb: int = 0            # the most memory this server may use; 0: the machine's (or its cgroup's)
    memory_margin_mb: int = 0         # kept free beside every job; 0: 5% of the memory, at least 256 MB

    def __post_init__(self):
        for name in ("max_pixels", "max_steps", "max_images", "max_prompt_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is not valid: it must be a whole number of "
                                 "at least 1")
        if self.max_steps > MAX_STEPS:
            raise ValueError(f"--max-steps {self.max_steps} is not valid: the engine runs at most {MAX_STEPS} steps")
        for name in ("max_memory_mb", "memory_margin_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"--{name[:-3].replace('_', '-')} {value!r} is not valid: it must be 0 (automatic) "
                                 "or more megabytes")
        for name in ("job_timeout", "shutdown_grace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is not valid: it must be 0 or more seconds")

    def flags(self) -> dict:
        """The limits as ``/sdapi/v1/cmd-flags`` reports them (the flag names, with underscores)."""
        return asdict(self)

    def describe(self) -> str:
        side = int(self.max_pixels ** 0.5)
        timeout = f"{self.job_timeout:g} s" if self.job_timeout else "none"
        memory = f"{self.max_memory_mb} MB" if self.max_memory_mb else "the machine's"
        return (f"limits: {self.max_pixels} pixels an image (about {side}x{side}), {self.max_steps} steps, "
                f"{self.max_images} images a request, {self.max_prompt_chars} prompt characters; memory {memory}; "
                f"job timeout {timeout}; shutdown grace {self.shutdown_grace:g} s")


def parse_size(text: str) -> int:
    """``--max-pixels``: a pixel count (``4194304``) or a size (``2048x2048``) -> pixels."""
    t = str(text).strip().lower()
    try:
        if "x" in t:
            w, h = (int(part) for part in t.split("x"))
            value = w * h
        else:
            value = int(t)
    except ValueError:
        raise ValueError(f"--max-pixels {text!r} is not valid: give a pixel count (4194304) or a size "
                         "(2048x2048)") from None
    if value < 1:
        raise ValueError(f"--max-pixels {text!r} is not valid: it must be at least 1 pixel")
    return value


def _side(pixels: int) -> str:
    side = int(round(pixels ** 0.5))
    return f" ({side}x{side})" if side * side == pixels else ""


def check_size(width, height, limits: Limits, what: str = "width x height") -> None:
    """One image of ``width`` x ``height`` pixels must be within ``max_pixels``."""
    if isinstance(width, int) and isinstance(height, int) and not isinstance(width, bool) \
            and not isinstance(height, bool) and width > 0 and height > 0 and width * height > limits.max_pixels:
        raise LimitExceeded(f"{what} = {width} x {height} = {width * height} pixels is over this server's limit of "
                            f"{limits.max_pixels} pixels an image{_side(limits.max_pixels)} (--max-pixels)")


def check_hires_size(width, height, p: dict, limits: Limits) -> None:
    """The hires fix's target (``hr_scale`` or ``hr_resize_x``/``_y`` of a ``width`` x ``height`` first pass) must
    be within ``max_pixels`` too. Values that are not valid are left to the request's own checks."""
    from ..hires import Hires, HiresError, target_size

    if p.get("firstphase_width") or p.get("firstphase_height"):
        return   # the legacy form: width x height is the target, checked as the size
    try:
        hires = Hires(scale=float(p.get("hr_scale") or 2.0), resize_x=int(p.get("hr_resize_x") or 0),
                      resize_y=int(p.get("hr_resize_y") or 0))
        target = target_size(int(width), int(height), hires)
    except (HiresError, TypeError, ValueError, ZeroDivisionError):
        return
    check_size(target.upscale_width, target.upscale_height, limits,
               "the hires fix's target (hr_scale, or hr_resize_x x hr_resize_y, of width x height)")


def check_steps(steps, limits: Limits, what: str = "steps={steps}") -> None:
    """``steps`` must be within ``max_steps``; ``what`` names them in the message (``{steps}``: their number). Values
    that are not valid are left to the request's own checks."""
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > limits.max_steps:
        raise LimitExceeded(f"{what.format(steps=steps)} is over this server's limit of {limits.max_steps} steps "
                            "(--max-steps)")


def check_request(p: dict, limits: Limits) -> None:
    """The per-request limits on an A1111 request's fields (defaults filled in, as :func:`.a1111.with_defaults`
    gives them). Only the limits are checked here; the fields' own validity is checked where they are used."""
    for name in PROMPT_FIELDS:
        text = p.get(name)
        if isinstance(text, str) and len(text) > limits.max_prompt_chars:
            raise LimitExceeded(f"{name} has {len(text)} characters, over this server's limit of "
                                f"{limits.max_prompt_chars} (--max-prompt-chars)")
    check_steps(p.get("steps"), limits)
    for name, fewer in (("sdlite_timesteps", 0), ("sdlite_sigmas", 1)):   # an explicit list sets the steps
        values = p.get(name)
        if isinstance(values, list) and len(values) - fewer > limits.max_steps:
            raise LimitExceeded(f"{name} gives {len(values) - fewer} steps, over this server's limit of "
                                f"{limits.max_steps} steps (--max-steps)")
    check_size(p.get("width"), p.get("height"), limits)
    hr_steps = p.get("hr_second_pass_steps")
    if p.get("enable_hr") and isinstance(hr_steps, int) and not isinstance(hr_steps, bool) \
            and hr_steps > limits.max_steps:
        raise LimitExceeded(f"hr_second_pass_steps={hr_steps} is over this server's limit of {limits.max_steps} "
                            "steps (--max-steps)")
    if p.get("enable_hr") and "init_images" not in p:
        check_hires_size(p.get("width"), p.get("height"), p, limits)
    batch, n_iter = p.get("batch_size"), p.get("n_iter")
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (batch, n_iter)) \
            and batch * n_iter > limits.max_images:
        raise LimitExceeded(f"batch_size x n_iter = {batch} x {n_iter} = {batch * n_iter} images is over this "
                            f"server's limit of {limits.max_images} images a request (--max-images)")


def _sized(engine, request):
    """``request`` validated against ``engine``'s model, with the size an image-to-image source gives it."""
    r = validate(request, engine.spec.default_size)
    if r.width is None or r.height is None:
        source = r.init_image
        width = r.width or max(8, getattr(source, "width", 512) // 8 * 8)
        height = r.height or max(8, getattr(source, "height", 512) // 8 * 8)
        r = r.replace(width=width, height=height)
    return r


def admit(engine, request, limits: Limits, memory: "budget.Memory | None" = None, rss: int | None = None):
    """Memory admission, before a job starts: its estimated peak (:func:`sdlite.engine.budget.estimate`, with the
    pieces a large batch runs in) must fit in the memory available now less the margin, or the job is refused with
    :class:`NotEnoughMemoryNow` (503), or :class:`NeverFits` (422) when it exceeds all the memory this server could
    have. ``memory`` and ``rss`` (bytes) default to what the machine and this process have now. Returns the
    estimate (None when the machine's memory cannot be read)."""
    memory = memory if memory is not None else budget.memory_now()
    if memory is None:
        return None
    rss = budget.process_rss() if rss is None else rss
    mb = budget.MB
    total, available = memory.total, memory.available
    if limits.max_memory_mb:
        cap = limits.max_memory_mb * mb
        total, available = min(total, cap), min(available, max(cap - rss, 0))
    margin = limits.memory_margin_mb * mb if limits.memory_margin_mb else max(256 * mb, total // 20)
    r = _sized(engine, request)
    estimate = budget.estimate(engine, r.height, r.width, r.batch_size, cfg=r.cfg_scale > 1.0,
                               encode=r.init_image is not None, refiner=r.refiner_switch_at is not None)
    need = estimate.peak
    what = (f"{r.width}x{r.height}, batch {r.batch_size}" + (f" (in pieces of {estimate.unet_piece})"
                                                             if estimate.unet_piece < r.batch_size else ""))
    flag = " (--max-memory)" if limits.max_memory_mb else ""
    if need > total - rss - margin:
        raise NeverFits(f"this job ({what}) needs about {need // mb} MB above the {rss // mb} MB the server holds "
                        f"({estimate.describe()}), and this server can never give it that: {total // mb} MB in "
                        f"all{flag}, less a margin of {margin // mb} MB. Ask for a smaller size or batch")
    if need > available - margin:
        raise NotEnoughMemoryNow(f"not enough memory for this job now: it needs about {need // mb} MB "
                                 f"({estimate.describe()}), {max(available, 0) // mb} MB are available{flag}, less a "
                                 f"margin of {margin // mb} MB; retry later, or ask for a smaller size or batch")
    return estimate
