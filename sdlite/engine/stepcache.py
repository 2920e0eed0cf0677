"""The step cache: DeepCache (Ma, Fang and Wang 2023, "DeepCache: Accelerating Diffusion Models for Free") on the
UNet of a sampling run.

A UNet's deep features change slowly from one sampling step to the next; its shallow ones (the skip connections
from the first down layers to the last up layers) carry the detail that does change. On a *full* step the whole
UNet runs and the up path's activation at the branch point is kept; on a *cached* step only the shallow branch
runs: the down layers that make the first ``branch + 1`` skip activations, then the up layers that take them in,
starting from the kept activation. Skip branch ``b`` (DeepCache's ``cache_branch_id``; 0 is the shallowest: the
stem's output feeding the last up layer) recomputes ``b + 1`` skips; the cache ``interval`` N is how many steps share
one full step.

The policy here (:meth:`StepCache.is_full`): a run's steps ``s = 0, 1, ...`` are full where ``s % N == 0`` (the first
step always), and the final step is full too (``final=True``, the default): the last step's estimate is the image,
and a full final step costs one UNet call for a measurably closer image (bench/stepcache.py). Every denoiser call
within a step (a second-order sampler's two, a batch cut into pieces, each its own call) is full or cached as the
step is, and a cached call reuses the activation kept by the call of the same rank in the last full step, so each
piece and each evaluation of a step keep their own; classifier-free guidance's two halves are one batch and so one
call, cached together. A call with nothing of its shape kept runs in full.

One :class:`StepCache` serves one stage of one run (a hires fix's second pass and a refiner's steps get their own):
nothing is carried from one request or pass to the next. The engine advances :attr:`StepCache.step` after each
sampler step.
"""
from __future__ import annotations

import torch

DEFAULT_INTERVAL = 3   # DeepCache's own default for Stable Diffusion (cache_interval=3)
DEFAULT_BRANCH = 0     # the shallowest branch: the fastest cached step (DeepCache's default cache_branch_id=0)
MAX_INTERVAL = 50


class StepCacheError(ValueError):
    """A step cache option that is not valid."""


def check_options(interval, branch) -> None:
    """Refuse an interval or branch that is not one (the model's own limit on the branch is checked at run time)."""
    if isinstance(interval, bool) or not isinstance(interval, int) or not 0 <= interval <= MAX_INTERVAL:
        raise StepCacheError(f"step cache interval {interval!r} is not valid: expected 0 (off), 1 (every step full) "
                             f"or up to {MAX_INTERVAL} steps per full UNet run (e.g. {DEFAULT_INTERVAL})")
    if isinstance(branch, bool) or not isinstance(branch, int) or branch < 0:
        raise StepCacheError(f"step cache branch {branch!r} is not valid: expected 0 (the shallowest skip branch, "
                             "the fastest) or more")


def parse(text: str) -> tuple[int, int]:
    """``"N"`` or ``"N:B"`` (the CLI's ``--cache``; ``"off"`` is 0) -> ``(interval, branch)``."""
    value = str(text).strip().lower()
    if value in ("off", "none", "0"):
        return 0, DEFAULT_BRANCH
    if value in ("on", "deepcache"):
        return DEFAULT_INTERVAL, DEFAULT_BRANCH
    interval, _, branch = value.partition(":")
    try:
        parsed = int(interval), int(branch) if branch else DEFAULT_BRANCH
    except ValueError:
        raise StepCacheError(f"step cache {text!r} is not valid: expected N or N:B (the interval N, e.g. "
                             f"{DEFAULT_INTERVAL}; the skip branch B, 0 the shallowest), or off") from None
    check_options(*parsed)
    return parsed


def cache_infotext(interval: int | None, branch: int | None) -> dict:
    """The A1111-style parameter a step cache of ``interval`` and ``branch`` (a request's ``cache_interval`` and
    ``cache_branch``) adds to its images' infotext (none when it is off: no interval)."""
    if not interval:
        return {}
    return {"Step cache": f"DeepCache interval {interval} branch {branch}"}


def branches(unet) -> int:
    """How many skip branches ``unet`` has (its skip connections): branch ids run from 0 to this minus 1."""
    return sum(len(block.resnets) for block in unet.up_blocks)


class _Branch:
    """What one UNet call is told (``UNet.forward``'s ``cache``): the skips recomputed, the kept feature or None."""

    __slots__ = ("skips", "feature", "kept", "shape")

    def __init__(self, skips: int, feature: torch.Tensor | None, shape):
        # shape: the input's, where this call keeps its feature for later steps (None: it keeps none)
        self.skips, self.feature, self.kept, self.shape = skips, feature, None, shape

    def keep(self, x: torch.Tensor) -> None:
        self.kept = x


class StepCache:
    """DeepCache's schedule and store for one stage of a run of ``steps`` sampler steps (see the module's text).

    ``full_calls`` and ``cached_calls`` count the UNet calls of each kind."""

    def __init__(self, interval: int, branch: int, steps: int, final: bool = True):
        check_options(interval, branch)
        if interval < 1:
            raise StepCacheError("a step cache needs an interval of 1 or more (0 is off)")
        self.interval, self.branch, self.steps, self.final = interval, branch, steps, final
        self.step = 0                  # the stage's current step, 0-based; the loop advances it
        self._kept: list[tuple] = []   # the last full step's (input shape, feature), by call rank
        self._kept_step = -1
        self._rank = 0                 # calls made so far in the current step
        self._rank_step = -1
        self.full_calls = self.cached_calls = 0

    def is_full(self, step: int) -> bool:
        """Whether ``step`` runs the whole UNet: every ``interval``-th from the first, and the last with ``final``."""
        return step % self.interval == 0 or (self.final and step == self.steps - 1)

    def checked(self, unet) -> "StepCache":
        """This cache, its branch checked against ``unet``'s skip branches."""
        n = branches(unet)
        if self.branch >= n:
            raise StepCacheError(f"step cache branch {self.branch} is not valid for this UNet: it has {n} skip "
                                 f"branches (0 to {n - 1})")
        return self

    def wrap(self, model) -> "CachedUNet":
        """``model`` (a UNet, called as one) with this cache."""
        return CachedUNet(model, self)

    def branch_for(self, x: torch.Tensor) -> _Branch:
        """The branch to hand to the UNet call about to run on ``x`` at :attr:`step`."""
        if self._rank_step != self.step:
            self._rank_step, self._rank = self.step, 0
        rank = self._rank
        self._rank += 1
        if self.is_full(self.step) or self._kept_step < 0:
            if self._kept_step != self.step:
                self._kept, self._kept_step = [], self.step
            self.full_calls += 1
            return _Branch(self.branch + 1, None, x.shape)
        shape, kept = self._kept[rank] if rank < len(self._kept) else (None, None)
        if shape != x.shape:   # nothing kept for a call like this one: it runs in full, and keeps nothing
            self.full_calls += 1
            return _Branch(self.branch + 1, None, None)
        self.cached_calls += 1
        return _Branch(self.branch + 1, kept, None)

    def record(self, branch: _Branch) -> None:
        """After a full call of the step that keeps features: its feature, at its rank."""
        if branch.shape is not None and branch.kept is not None and self._kept_step == self.step:
            self._kept.append((branch.shape, branch.kept))


class CachedUNet:
    """``model`` (the UNet, or its runner) with a :class:`StepCache`: called as the UNet is."""

    def __init__(self, model, cache: StepCache):
        self.model, self.cache = model, cache

    def __call__(self, x, t, context=None, **extra):
        branch = self.cache.branch_for(x)
        out = self.model(x, t, context=context, cache=branch, **extra)
        self.cache.record(branch)
        return out
