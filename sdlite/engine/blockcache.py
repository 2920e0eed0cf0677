"""The step cache of a transformer: First-Block Cache (FBCache; ParaAttention's, and diffusers' ``FirstBlockCacheConfig``,
a TeaCache-class reuse of the blocks' work from one sampling step to the next) on FLUX.1, SD3/SD3.5 and Z-Image.

A transformer's blocks change what they add to the tokens slowly from one step to the next, and the first block's
change tells how fast. On every call the first block runs; its residual ``r = first(x) - x`` (of the image stream,
the first of the state's streams) is compared with the one kept from the last *fully computed* call of the same rank:
the relative L1 change ``mean(|r - r_kept|) / mean(|r_kept|)``. Below the threshold, the blocks after the first are
skipped and their kept residual (what they added to each stream at that full call: ``rest(first(x)) - first(x)``) is
added to the first block's output instead; at or above it, they all run and the kept residuals are refreshed. The
comparison is with the last full call, not the previous step, as the references do: a run of skipped steps drifts
from a fixed point and ends when the drift passes the threshold, so skips cannot chain past it.

A threshold of 0 skips nothing (the change is never below 0: the image is the uncached one exactly). FLUX's default
is ParaAttention's for FLUX.1 (``residual_diff_threshold=0.08``, the value diffusers' ParaAttention guide names as
the FLUX default); the same serves SD3 and Z-Image (bench/blockcache.py measures each family's tiny model).

The networks expose their blocks through one hook (:func:`sdlite.models.layers.run_blocks`: ``forward(..., cache=)``
calls ``cache(first, rest, state)``); nothing here knows a network. Every call is decided as a whole: classifier-free
guidance's two halves are one batch and skip or run together, as FBCache decides per call. Within a step, calls are
ranked as the DeepCache step cache ranks them (:mod:`sdlite.engine.stepcache`): a second-order sampler's evaluations
and a large batch's pieces each compare with the call of the same rank, and a call whose shapes differ from what its
rank kept runs in full and keeps its own. One :class:`BlockCache` serves one stage of one run; nothing is carried
from one request or pass to the next. The engine advances :attr:`BlockCache.step` after each sampler step.
"""
from __future__ import annotations

import torch

DEFAULT_THRESHOLD = 0.08   # ParaAttention's default residual_diff_threshold for FLUX.1
MAX_THRESHOLD = 1.0        # ComfyUI-WaveSpeed's FBCache node tops out here too: past it nearly every step is skipped


class BlockCacheError(ValueError):
    """A block cache option that is not valid."""


def check_threshold(threshold) -> None:
    """Refuse a threshold that is not a number from 0 to :data:`MAX_THRESHOLD` (None: not given, the default)."""
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not 0.0 <= float(threshold) <= MAX_THRESHOLD:
        raise BlockCacheError(f"first-block cache threshold {threshold!r} is not valid: expected a number from 0 "
                              f"(nothing skipped) to {MAX_THRESHOLD:g} (e.g. {DEFAULT_THRESHOLD}, the default)")


def parse_threshold(text: str) -> float:
    """``"T"`` (the CLI's ``--cache 0.08``) -> the threshold, checked."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise BlockCacheError(f"first-block cache threshold {text!r} is not valid: expected a number such as "
                              f"{DEFAULT_THRESHOLD}") from None
    check_threshold(value)
    return value


def cache_infotext(threshold: float | None) -> dict:
    """The A1111-style parameter a first-block cache at ``threshold`` adds to its images' infotext (none: off)."""
    if threshold is None:
        return {}
    return {"Step cache": f"first-block {float(threshold):g}"}


def relative_change(now: torch.Tensor, kept: torch.Tensor) -> float:
    """``mean(|now - kept|) / mean(|kept|)``, in fp32 (infinite where ``kept`` is all zeros)."""
    now, kept = now.float(), kept.float()
    scale = float(kept.abs().mean())
    diff = float((now - kept).abs().mean())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


class _Kept:
    """What one full call left for the calls of its rank: the first block's residual and the rest's, per stream."""

    __slots__ = ("shapes", "signal", "residuals")

    def __init__(self, shapes, signal: torch.Tensor, residuals: tuple):
        self.shapes, self.signal, self.residuals = shapes, signal, residuals


class BlockCache:
    """FBCache's store for one stage of a run (see the module's text): ``threshold`` the relative change of the first
    block's residual below which the other blocks are skipped.

    ``full_calls`` and ``skipped_calls`` count the network calls of each kind; ``changes`` records each compared
    call's (step, relative change)."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD):
        check_threshold(threshold)
        self.threshold = float(threshold)
        self.step = 0                     # the stage's current step, 0-based; the loop advances it
        self._kept: dict[int, _Kept] = {}
        self._rank = 0
        self._rank_step = -1
        self.full_calls = self.skipped_calls = 0
        self.changes: list[tuple[int, float]] = []

    def wrap(self, model) -> "CachedTransformer":
        """``model`` (a transformer whose forward takes ``cache=``) with this cache."""
        return CachedTransformer(model, self)

    def next_rank(self) -> int:
        """The rank of the call about to run within :attr:`step`."""
        if self._rank_step != self.step:
            self._rank_step, self._rank = self.step, 0
        rank = self._rank
        self._rank += 1
        return rank

    def run(self, rank: int, first, rest, state: tuple) -> tuple:
        """One call's blocks (:func:`sdlite.models.layers.run_blocks`'s ``cache``): the first, then the rest or the
        kept residuals."""
        out = first(state)
        signal = out[0] - state[0]                                        # the first block's residual
        del state
        shapes = tuple(None if o is None else o.shape for o in out)
        kept = self._kept.get(rank)
        if kept is not None and kept.shapes == shapes:
            change = relative_change(signal, kept.signal)
            self.changes.append((self.step, change))
            if change < self.threshold:
                self.skipped_calls += 1
                return tuple(None if r is None else o + r for o, r in zip(out, kept.residuals))
        self.full_calls += 1
        full = rest(out)
        residuals = tuple(None if f is None or o is None else f - o for f, o in zip(full, out))
        self._kept[rank] = _Kept(shapes, signal, residuals)
        return full


class CachedTransformer:
    """``model`` (a transformer, called as one) with a :class:`BlockCache`: its forward gets the cache's hook."""

    def __init__(self, model, cache: BlockCache):
        self.model, self.cache = model, cache

    def __call__(self, x, t, *args, **extra):
        rank = self.cache.next_rank()

        def hook(first, rest, state):
            return self.cache.run(rank, first, rest, state)

        return self.model(x, t, *args, cache=hook, **extra)
