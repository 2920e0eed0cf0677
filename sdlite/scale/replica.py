"""``sdlite serve --ray``'s Generator replicas: each holds one engine, built once, and runs one job at a time with
:func:`~sdlite.server.backend.run_plan`, reporting its steps and previews to the ClusterJobs actor
(:class:`RemoteControl`) and reading the interrupt and skip flags from the replies.
"""
from __future__ import annotations

import asyncio
import math
import time

import ray
from ray import serve

from ..server.a1111 import api as a1111
from ..server.backend import run_plan
from ..server.checkpoints import Checkpoint, Checkpoints, Engines
from .cluster import ClusterConfig, ensure_jobs_actor
from .comfy import ReplicaPrompts

REPORT_EVERY_S = 0.05    # a replica reports its steps at most this often (and always the last one)


class RemoteControl:
    """What :func:`~sdlite.server.backend.run_plan` reports through, in a replica: the same methods as
    :class:`~sdlite.server.jobs.JobControl`, sent to the ClusterJobs actor without waiting. Each reply carries the
    job's interrupt / skip flags and whether a client wants previews; the newest reply that has arrived is used,
    so an interrupt takes effect a step or two after it is asked for, and sampling never waits on the actor. Steps
    are reported at most every REPORT_EVERY_S: a small model's steps take milliseconds, and a report each would
    cost more than the step.

    ``job_timeout`` (seconds; 0: none) is the server's job time limit, counted from when the replica took the job:
    past it the job is interrupted here at once (and in the ClusterJobs actor, for /progress), and
    :attr:`stop_reason` says ``"timeout"``, so that run_plan adds the warning."""

    def __init__(self, jobs, job_id: int, flags: tuple, preview: tuple[bool, int], job_timeout: float = 0.0):
        self._jobs, self._id = jobs, job_id
        self._interrupted = self._skipped = self._wanted = False
        self._stop_reason: str | None = None
        self._apply(flags)
        self._preview_enabled, self._preview_every = preview
        self._pending: list = []
        self._sent = -math.inf
        self._timeout = job_timeout
        self._started = time.monotonic()

    def _send(self, ref) -> None:
        self._pending.append(ref)
        self._poll()

    def _poll(self) -> None:
        if not self._pending:
            return
        ready, _ = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        if ready:
            ready_set = set(ready)
            newest = max(i for i, r in enumerate(self._pending) if r in ready_set)
            self._apply(ray.get(self._pending[newest]))
            self._pending = [r for r in self._pending[newest + 1:] if r not in ready_set]

    def _apply(self, flags) -> None:
        interrupted, skipped, self._wanted, reason = flags
        if interrupted and not self._interrupted:
            self._interrupted, self._stop_reason = True, reason
        self._skipped = skipped

    def _check_time(self) -> None:
        if self._timeout and not self._interrupted and time.monotonic() - self._started > self._timeout:
            self._interrupted, self._stop_reason = True, "timeout"
            self._jobs.stop_job.remote(self._id, "timeout")

    @property
    def interrupted(self) -> bool:
        self._poll()
        self._check_time()
        return self._interrupted

    @property
    def stop_reason(self) -> str | None:
        """Why the job was interrupted: None (a client's /interrupt, or the client went away), ``"timeout"``,
        ``"shutdown"`` (after the grace) or ``"stop"`` (a shutdown at once)."""
        return self._stop_reason if self._interrupted else None

    def begin(self, job_count: int, textinfo: str | None = None) -> None:
        self._jobs.begin.remote(self._id, job_count, textinfo)

    def info(self, textinfo: str) -> None:
        self._jobs.info.remote(self._id, textinfo)

    def iteration(self, job_no: int, sampling_steps: int) -> None:
        self._pending, self._skipped = [], False    # replies sent before this iteration may carry its skip
        self._send(self._jobs.iteration.remote(self._id, job_no, sampling_steps))

    def step(self, step: int, total: int) -> None:
        from ..pipeline import StopSampling

        now = time.monotonic()
        if step >= total or now - self._sent >= REPORT_EVERY_S:
            self._sent = now
            self._send(self._jobs.step.remote(self._id, step, total))
        else:
            self._poll()
        self._check_time()
        if (self._interrupted or self._skipped) and step < total:
            raise StopSampling()

    def stop(self) -> None:
        """Stop the job at its next step (its client let go of it)."""
        self._interrupted = True

    def preview_wanted(self) -> bool:
        """Whether a client asked ``/progress`` for a preview lately (and previews are on)."""
        return self._wanted and self._preview_enabled

    def preview_due(self, step: int, total: int) -> bool:
        if not self.preview_wanted():
            return False
        return step == total if self._preview_every == -1 else step % self._preview_every == 0

    def set_preview(self, image, step: int) -> None:
        self._jobs.preview.remote(self._id, image, step)


class Generator:
    """A Ray Serve replica: one engine, built once when the replica starts, running one job at a time."""

    def __init__(self, config: ClusterConfig, model_path: str):
        if config.threads:
            import torch

            torch.set_num_threads(config.threads)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (a direct test): a name of our own
            self.replica_id = f"replica-{id(self):x}"
        self.config, self.model_path = config, model_path
        self.prompts: ReplicaPrompts | None = None   # ComfyUI's executor, made for the first prompt
        self.checkpoints = Checkpoints(model_path, None)
        self.engines = Engines(self.checkpoints, limit=1, **config.engine_options)
        self.engines.get(self.checkpoints.current)   # the model is loaded before the replica takes requests
        self.jobs = ensure_jobs_actor(config)
        ray.get(self.jobs.register.remote(self.replica_id, ray.get_runtime_context().current_actor))

    async def run(self, job_id: int, work: dict) -> a1111.Outcome | None:
        # the engine runs in a thread, so that the replica's event loop keeps answering Serve's health checks
        flags = await self.jobs.start.remote(job_id, self.replica_id)
        if flags is None:      # the client went away while the job waited
            return None
        limits = work["plan"].limits   # the ingress's: ClusterConfig.limits
        control = RemoteControl(self.jobs, job_id, flags, work["preview"],
                                job_timeout=limits.job_timeout if limits is not None else 0.0)
        return await asyncio.to_thread(self._run, work, control)

    async def run_comfy(self, job_id: int, work: dict):
        """A ComfyUI prompt (:mod:`.comfy`): a stream of its events, then its end; ("gone",) when the job left the
        queue while it waited."""
        flags = await self.jobs.start.remote(job_id, self.replica_id)
        if flags is None:
            yield ("gone",)
            return
        if self.prompts is None:
            self.prompts = ReplicaPrompts(self.config, self.model_path, self.engines)
        limits = work["limits"]
        control = RemoteControl(self.jobs, job_id, flags, (work["options"]["live_previews_enable"],
                                                           work["options"]["show_progress_every_n_steps"]),
                                job_timeout=limits.job_timeout if limits is not None else 0.0)
        async for item in self.prompts.events(work, control):
            yield item

    def _run(self, work: dict, control: RemoteControl) -> a1111.Outcome:
        self.engines.limit = work["limit"]
        return run_plan(self.engines, work["checkpoint"], work["plan"], control)

    async def load(self, checkpoint: Checkpoint) -> str:
        """Load ``checkpoint`` (a model switch); returns its short hash."""
        def load():
            self.engines.get(checkpoint)
            return self.checkpoints.hash_of(checkpoint)
        return await asyncio.to_thread(load)
