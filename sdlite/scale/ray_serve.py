"""``sdlite serve --ray``: the same FastAPI app and A1111 API as the single-machine server, on Ray Serve.

    app = application(ClusterConfig(replicas=2))          # a Ray Serve application
    serve.run(app, name="sdlite", route_prefix="/")

Where things live::

    HTTP --> Serve proxy --> Ingress (1 replica, no model): the FastAPI app of sdlite.server.app, A1111 mapping,
                 |            options, checkpoint list; it turns a request into a Plan and sends it on
                 |      handle.run(job, plan)   one running job per replica (max_ongoing_requests=1)
                 v
             Generator replicas (N, or MIN..MAX autoscaled): each holds one Engine, built once
                 ^      step / preview / flags (fire and forget; the reply carries interrupt and skip)
                 v
             ClusterJobs actor (one, named): every queued and running job of the cluster, their progress,
                          interrupt and skip flags, the replicas alive; it counts the queue limit

* **Queue limit**: a job is refused (503 with ``Retry-After``) when ``queue_size`` jobs already wait behind the
  running ones, counted across the cluster by :class:`ClusterJobs`.
* **Progress**: ``job_count`` is every queued and running job of the cluster; the rest of the progress is that of
  the oldest running job. Interrupt and skip act on that job (wherever it runs); a client that goes away
  interrupts its own.
* **Options and model switches** apply to every replica: each job carries its checkpoint and the options the
  replica needs, so a replica loads the current model before its next job (never during one). ``POST /options``
  answers once one replica has loaded it.
* **A replica that dies** is restarted by Ray Serve; its in-flight request is sent once more to another replica
  (same seeds, so the same pixels), and if that fails too the client gets a ``503`` saying so.
* **Limits** (``ClusterConfig.limits``): the ingress checks each request's; a replica interrupts a job that runs
  past ``job_timeout`` (its client gets the partial image, with a warning), as the single-machine server does.
* **Shutdown** (:func:`drain`, what ``sdlite serve --ray`` does on SIGTERM): :meth:`ClusterJobs.close` refuses new
  jobs and drops the waiting ones (the ingress answers their clients ``503`` with ``Retry-After``), the running jobs
  get the grace, then are interrupted (their clients get the partial images), and a job that still does not stop
  is abandoned (its client gets a ``503``); then the application is deleted.

The model path must be readable at the same path on every node (a shared folder, or the same copy).
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from ..server import a1111
from ..server.app import ServerBase, build_app, run_plan
from ..server.checkpoints import Checkpoint, Checkpoints, Engines
from ..server.jobs import PREVIEW_WANTED_S, QueueFull, ShuttingDown, Unavailable, _State, progress_body
from ..server.limits import Limits

log = logging.getLogger("sdlite.scale")

NAMESPACE = "sdlite"
SHUTDOWN_CHECK_S = 0.2    # a replica being stopped checks this often whether its requests are done
DISCONNECT_POLL_S = 0.5   # how often the ingress checks, for each request, whether its client left or a shutdown
                          # refused its job
# what a replica that died mid-request raises at the ingress
_REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class ReplicaLost(Unavailable):
    """The replica running a job died, and so did the one it was retried on (HTTP 503)."""

    retry_after = 5

    def __init__(self, attempts: int):
        super().__init__(f"the replica running this job died ({attempts} attempts, on different replicas); "
                         "Ray Serve is starting a new one: retry the request")


@dataclass
class ClusterConfig:
    """Everything the ingress and the replicas need to build themselves (plain data: it travels to each)."""

    model: str | None = None          # default: the shipped demo model, or the first one in models_dir
    models_dir: str | None = None
    api_auth: str | None = None
    queue_size: int = 32
    lora_dir: str | None = None
    embeddings_dir: str | None = None
    upscaler_dir: str | None = None
    controlnet_dir: str | None = None   # ControlNet models by name, at the same path on every node
    engine_options: dict = field(default_factory=dict)   # Engine.load's: device, dtype, memory_mode, ...
    threads: int | None = None        # torch threads in each replica (1 is fastest for the demo model)
    replicas: int = 1
    autoscale: tuple[int, int] | None = None   # (min, max) replicas
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    app_name: str = "sdlite"
    flags: dict = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)   # what one request may ask for, job timeout, shutdown grace

    def check(self) -> "ClusterConfig":
        if self.queue_size < 1:
            raise ValueError(f"queue size {self.queue_size} is not valid: it must be at least 1")
        if self.autoscale is None and self.replicas < 1:
            raise ValueError(f"--replicas {self.replicas} is not valid: it must be at least 1")
        if self.autoscale is not None:
            low, high = self.autoscale
            if not 1 <= low <= high:
                raise ValueError(f"--autoscale {low},{high} is not valid: expected MIN,MAX with 1 <= MIN <= MAX")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("--replica-cpus and --replica-gpus must not be negative")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads {self.threads} is not valid: it must be at least 1")
        return self

    @property
    def jobs_actor_name(self) -> str:
        return f"sdlite-jobs-{self.app_name}"


def parse_autoscale(text: str) -> tuple[int, int]:
    """``--autoscale MIN,MAX`` -> (min, max)."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--autoscale {text!r} is not valid: expected MIN,MAX replicas, e.g. 1,4") from None
    if not 1 <= low <= high:
        raise ValueError(f"--autoscale {text!r} is not valid: expected 1 <= MIN <= MAX")
    return low, high


# --- the cluster's job table ---------------------------------------------------------------------------------------

@dataclass
class _ClusterJob:
    label: str
    submitted: float
    replica: str | None = None        # None: waiting
    state: _State = field(default_factory=_State)
    interrupted: bool = False
    skipped: bool = False
    preview_key: int = 0
    stop_reason: str | None = None    # why it was interrupted: None (/interrupt, its client gone), "timeout",
                                      # "shutdown" (after the grace), "stop" (a shutdown at once)


class ClusterJobs:
    """Every queued and running job of the cluster (a Ray actor; one per application). The ingress admits and
    finishes jobs; replicas report their steps and read the interrupt and skip flags in the replies."""

    def __init__(self, queue_size: int):
        self.queue_size = queue_size
        self.jobs: dict[int, _ClusterJob] = {}           # in submission order
        self.ids = itertools.count(1)
        self.replicas: dict[str, Any] = {}               # replica id -> actor handle (those alive)
        self.done: dict[str, int] = {}                   # replica id -> jobs finished
        self.preview_wanted = -math.inf
        self.mean_job_s = 5.0
        self.last = _State()
        self.requeued = 0                                # jobs sent again after their replica died
        self.closed = False                              # shutting down: no new jobs
        self.refused: dict[int, str] = {}                # job id -> "dropped" (it waited) or "abandoned" (it ran
                                                         # past the grace and the interrupt), by a shutdown

    # replicas
    def register(self, replica: str, handle) -> None:
        self.replicas[replica] = handle
        self.done.setdefault(replica, 0)

    def replica_handles(self) -> dict:
        return dict(self.replicas)

    def running(self) -> dict[str, int]:
        """replica id -> the job it runs."""
        return {j.replica: i for i, j in self.jobs.items() if j.replica is not None}

    def finished_per_replica(self) -> dict[str, int]:
        return dict(self.done)

    def requeues(self) -> int:
        return self.requeued

    # the ingress
    def admit(self, label: str) -> tuple:
        """("ok", job id), ("full", waiting, retry_after) when queue_size jobs already wait behind the running
        ones (one per replica alive), or ("closed",) once a shutdown began."""
        if self.closed:
            return ("closed",)
        capacity = self.queue_size + max(len(self.replicas), 1)
        if len(self.jobs) >= capacity:
            waiting = sum(1 for j in self.jobs.values() if j.replica is None)
            per_replica = self.mean_job_s / max(len(self.replicas), 1)
            return "full", waiting, int(min(max(math.ceil(per_replica * (waiting + 1)), 1), 3600))
        job_id = next(self.ids)
        self.jobs[job_id] = _ClusterJob(label, time.monotonic())
        return "ok", job_id

    def finish(self, job_id: int, seconds: float | None = None) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        if job.replica is not None:
            self.done[job.replica] = self.done.get(job.replica, 0) + 1
            self.last = _State(interrupted=job.state.interrupted, skipped=job.state.skipped,
                               job_timestamp=job.state.job_timestamp)
        if seconds is not None:
            self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * seconds

    def requeue(self, job_id: int) -> str | None:
        """The replica running ``job_id`` died: forget it, and the job waits again. Returns the dead replica."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        dead, job.replica, job.state = job.replica, None, _State()
        self.requeued += 1
        if dead is not None:
            self.replicas.pop(dead, None)
        return dead

    def cancel(self, job_id: int) -> bool:
        """The client went away: a waiting job is dropped (False), a running one interrupted (True)."""
        job = self.jobs.get(job_id)
        if job is None:
            return False
        if job.replica is None:
            del self.jobs[job_id]
            return False
        job.interrupted = True
        return True

    def _oldest_running(self) -> _ClusterJob | None:
        return next((j for j in self.jobs.values() if j.replica is not None), None)

    def interrupt(self) -> None:
        job = self._oldest_running()
        if job is not None:
            job.interrupted = job.state.interrupted = True

    def stop_job(self, job_id: int, reason: str) -> None:
        """Interrupt one job for ``reason`` (a replica's job past the time limit: "timeout")."""
        job = self.jobs.get(job_id)
        if job is not None:
            self._stop(job, reason)

    @staticmethod
    def _stop(job: _ClusterJob, reason: str | None) -> None:
        if not job.interrupted:   # the first reason stays: a client's /interrupt is not reported as a shutdown
            job.stop_reason = reason
        job.interrupted = job.state.interrupted = True

    # a shutdown
    def close(self) -> tuple[int, int]:
        """Take no new jobs (admit answers "closed") and drop the waiting ones (the ingress answers their clients
        503, see :meth:`refusals`). Returns (jobs dropped, jobs running)."""
        self.closed = True
        waiting = [i for i, j in self.jobs.items() if j.replica is None]
        for job_id in waiting:
            del self.jobs[job_id]
            self.refused[job_id] = "dropped"
        return len(waiting), len(self.jobs)

    def interrupt_all(self, reason: str | None) -> int:
        """Interrupt every job for ``reason`` ("shutdown", "stop"); returns how many there were."""
        for job in self.jobs.values():
            self._stop(job, reason)
        return len(self.jobs)

    def abandon(self) -> int:
        """The jobs still running after the grace and the interrupt: forgotten here, and their clients answered
        503 by the ingress. Returns how many."""
        n = len(self.jobs)
        for job_id in list(self.jobs):
            del self.jobs[job_id]
            self.refused[job_id] = "abandoned"
        return n

    def pending(self) -> int:
        """Jobs admitted and not finished (waiting or running)."""
        return len(self.jobs)

    def refusals(self) -> dict[int, str]:
        """The jobs a shutdown refused: job id -> "dropped" or "abandoned" (empty while no shutdown began)."""
        return dict(self.refused)

    def skip(self) -> None:
        job = self._oldest_running()
        if job is not None:
            job.skipped = job.state.skipped = True

    def progress(self, want_image: bool) -> tuple[dict, Any, Any]:
        """(body, preview image, preview key): ``job_count`` counts every queued and running job; the progress
        is the oldest running job's."""
        if want_image:
            self.preview_wanted = time.monotonic()
        job = self._oldest_running()
        total = len(self.jobs)
        running = sum(1 for j in self.jobs.values() if j.replica is not None)
        waiting = total - running
        text = None
        if total:
            text = f"{running} running on {len(self.replicas)} replica{'s' if len(self.replicas) != 1 else ''}" \
                   + (f", {waiting} waiting" if waiting else "")
            if job is not None and job.state.textinfo:
                text = f"{job.state.textinfo}; {text}"
        state = job.state if job is not None else (self.last if not total else _State(job="waiting"))
        body, image = progress_body(state, waiting, want_image, job_count=total, textinfo=text)
        return body, image, (id(job), job.preview_key) if job is not None and image is not None else None

    # replicas reporting
    def _flags(self, job: _ClusterJob | None) -> tuple[bool, bool, bool, str | None]:
        """What a replica's report is answered: (interrupted, skipped, previews wanted, stop reason)."""
        if job is None:      # dropped meanwhile (its client went away, or a shutdown abandoned it): stop
            return True, False, False, None
        wanted = time.monotonic() - self.preview_wanted < PREVIEW_WANTED_S
        return job.interrupted, job.skipped, wanted, job.stop_reason

    def start(self, job_id: int, replica: str) -> tuple | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        job.replica = replica
        job.state = _State(job=job.label, job_count=1, time_start=time.time(), interrupted=job.interrupted,
                           job_timestamp=datetime.datetime.now().strftime("%Y%m%d%H%M%S"),
                           textinfo=f"{job.label}: starting")
        return self._flags(job)

    def begin(self, job_id: int, job_count: int, textinfo: str | None) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            job.state.job_count = max(job_count, 1)
            if textinfo is not None:
                job.state.textinfo = textinfo

    def info(self, job_id: int, textinfo: str) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            job.state.textinfo = textinfo

    def iteration(self, job_id: int, job_no: int, steps: int) -> tuple:
        job = self.jobs.get(job_id)
        if job is not None:
            s = job.state
            job.skipped = s.skipped = False
            s.job_no, s.sampling_step, s.sampling_steps = job_no, 0, steps
            s.current_image, s.preview_step = None, 0
            s.textinfo = f"{job.label}: image {job_no + 1} of {s.job_count}"
        return self._flags(job)

    def step(self, job_id: int, step: int, total: int) -> tuple:
        job = self.jobs.get(job_id)
        if job is not None:
            s = job.state
            s.sampling_step, s.sampling_steps = step, total
            s.textinfo = f"{job.label}: image {s.job_no + 1} of {s.job_count}, step {step} of {total}"
        return self._flags(job)

    def preview(self, job_id: int, image, step: int) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            job.state.current_image, job.state.preview_step = image, step
            job.preview_key += 1


def _jobs_actor(config: ClusterConfig):
    """The application's ClusterJobs actor, created by whichever of the ingress and the replicas comes first."""
    return ray.remote(ClusterJobs).options(name=config.jobs_actor_name, namespace=NAMESPACE, get_if_exists=True,
                                           lifetime="detached", num_cpus=0).remote(config.queue_size)


# --- the replicas --------------------------------------------------------------------------------------------------

REPORT_EVERY_S = 0.05    # a replica reports its steps at most this often (and always the last one)


class RemoteControl:
    """What :func:`~sdlite.server.app.run_plan` reports through, in a replica: the same methods as
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

    def preview_due(self, step: int, total: int) -> bool:
        if not (self._wanted and self._preview_enabled):
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
        self.checkpoints = Checkpoints(model_path, None)
        self.engines = Engines(self.checkpoints, limit=1, **config.engine_options)
        self.engines.get(self.checkpoints.current)   # the model is loaded before the replica takes requests
        self.jobs = _jobs_actor(config)
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

    def _run(self, work: dict, control: RemoteControl) -> a1111.Outcome:
        self.engines.limit = work["limit"]
        return run_plan(self.engines, work["checkpoint"], work["plan"], control)

    async def load(self, checkpoint: Checkpoint) -> str:
        """Load ``checkpoint`` (a model switch); returns its short hash."""
        def load():
            self.engines.get(checkpoint)
            return self.checkpoints.hash_of(checkpoint)
        return await asyncio.to_thread(load)


# --- the ingress ---------------------------------------------------------------------------------------------------

class ClusterServer(ServerBase):
    """The routes' server on the ingress replica: jobs go to the Generator replicas through Serve's handle."""

    def __init__(self, config: ClusterConfig, generator):
        super().__init__(config.model, config.models_dir, config.api_auth, lora_dir=config.lora_dir,
                         embeddings_dir=config.embeddings_dir, flags=config.flags, limits=config.limits,
                         upscaler_dir=config.upscaler_dir, controlnet_dir=config.controlnet_dir)
        self.config = config
        self.generator = generator
        self.jobs = _jobs_actor(config)
        self._widths: dict = {}
        self._preview: tuple[Any, Any] = (None, None)
        self._refusals_query: asyncio.Future | None = None
        self._refusals_asked = -math.inf

    def _work(self, plan: a1111.Plan, checkpoint: Checkpoint) -> dict:
        options = self.options_snapshot()
        return {"plan": plan, "checkpoint": dataclasses.replace(checkpoint), "limit": options["sd_checkpoints_limit"],
                "preview": (options["live_previews_enable"], options["show_progress_every_n_steps"])}

    async def generate(self, plan: a1111.Plan, request) -> a1111.Outcome | None:
        checkpoint = self.checkpoints.current if plan.checkpoint is None else self.find_checkpoint(plan.checkpoint)
        admitted = await self.jobs.admit.remote(plan.kind)
        if admitted[0] == "closed":
            raise ShuttingDown()
        if admitted[0] == "full":
            raise QueueFull(admitted[1], admitted[2])
        job_id = admitted[1]
        work = self._work(plan, checkpoint)
        t0 = time.monotonic()
        try:
            outcome = await self._dispatch(job_id, work, request)
        finally:
            self.jobs.finish.remote(job_id, time.monotonic() - t0)
        if outcome is None:
            return None
        self.checkpoints.remember_hash(checkpoint, outcome.model_hash)
        self.keep_overrides(plan, checkpoint)
        return outcome

    async def _dispatch(self, job_id: int, work: dict, request) -> a1111.Outcome | None:
        attempts = 2   # the first, and one retry on another replica
        for attempt in range(1, attempts + 1):
            response = self.generator.run.remote(job_id, work)
            try:
                return await self._await(response, job_id, request)
            except _REPLICA_GONE as e:
                dead = await self.jobs.requeue.remote(job_id)
                log.warning("job %d: replica %s died (%s); attempt %d of %d", job_id, dead, type(e).__name__,
                            attempt, attempts)
            except ray.exceptions.RayTaskError as e:   # the job raised: the error the local server would give
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise cause from None
        raise ReplicaLost(attempts)

    async def _await(self, response, job_id: int, request):
        async def result():
            return await response

        task = asyncio.ensure_future(result())
        # a response cancelled below (a client gone, a job refused) raises in the task, which nobody reads then
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    outcome = task.result()
                    if outcome is None:   # the replica found the job gone: its client left, or a shutdown dropped it
                        self._raise_refused(job_id, await self._ask_refusals())
                    return outcome
                if await request.is_disconnected():
                    running = await self.jobs.cancel.remote(job_id)
                    if not running:
                        response.cancel()
                    log.info("client went away: job %d %s", job_id, "interrupted" if running else "dropped")
                    return None
                refusals = await self._refusals()
                if job_id in refusals:
                    response.cancel()
                    self._raise_refused(job_id, refusals)
        except asyncio.CancelledError:
            self.jobs.cancel.remote(job_id)
            raise

    @staticmethod
    def _raise_refused(job_id: int, refusals: dict) -> None:
        how = refusals.get(job_id)
        if how is not None:
            log.info("shutting down: job %d %s, its client is answered 503", job_id, how)
            raise ShuttingDown(running=how == "abandoned")

    async def _refusals(self) -> dict[int, str]:
        """The jobs a shutdown refused (:meth:`ClusterJobs.refusals`), asked of the actor at most every half
        DISCONNECT_POLL_S however many requests wait, and answered from that."""
        query = self._refusals_query
        if query is None or (query.done() and time.monotonic() - self._refusals_asked >= DISCONNECT_POLL_S / 2):
            self._refusals_asked = time.monotonic()
            self._refusals_query = query = asyncio.ensure_future(self._ask_refusals())
        return await asyncio.shield(query)

    async def _ask_refusals(self) -> dict[int, str]:
        try:
            return await self.jobs.refusals.remote()
        except Exception as e:  # noqa: BLE001 - the actor is gone (the application is being deleted)
            log.debug("no refusals known: %s", e)
            return {}

    async def progress(self, want_image: bool) -> tuple[dict, Any]:
        body, image, key = await self.jobs.progress.remote(want_image)
        if image is not None:
            if key is not None and key == self._preview[0]:
                image = self._preview[1]   # the same preview object: preview_b64 reuses its encoding
            self._preview = (key, image)
        return body, image

    async def interrupt(self) -> None:
        await self.jobs.interrupt.remote()

    async def skip(self) -> None:
        await self.jobs.skip.remote()

    async def switch_model(self, target: Checkpoint, request) -> None:
        # one replica loads it now; every job after this carries it, so each replica loads it before its next job
        value = await self.generator.load.remote(dataclasses.replace(target))
        self.checkpoints.remember_hash(target, value)
        self.checkpoints.current = target

    def start(self) -> None:
        # the current model's hash, as the single-machine server knows it once it has loaded the model: a replica
        # (which loaded it when it started) reports it
        self._hash_task = asyncio.get_running_loop().create_task(self._learn_hash())

    async def _learn_hash(self) -> None:
        current = self.checkpoints.current
        try:
            self.checkpoints.remember_hash(current, await self.generator.load.remote(dataclasses.replace(current)))
        except Exception as e:  # noqa: BLE001 - the first job will tell it
            log.warning("the model's hash is not known yet: %s", e)

    def text_width(self) -> int | None:
        from ..loader import open_model

        path = self.checkpoints.current.path
        if path not in self._widths:
            try:
                with open_model(path) as ckpt:
                    self._widths[path] = ckpt.spec.text.width
            except Exception:  # noqa: BLE001 - unknown: every embedding is listed as loaded
                self._widths[path] = None
        return self._widths[path]


class Ingress:
    """The HTTP ingress deployment: sdlite.server.app's FastAPI app over a :class:`ClusterServer`."""

    def __init__(self, generator, config: ClusterConfig):
        self.server = ClusterServer(config, generator)

    def __serve_build_asgi_app__(self):
        return build_app(self.server)


def application(config: ClusterConfig) -> "serve.Application":
    """The Ray Serve application: the ingress bound to the Generator deployment."""
    config.check()
    model_path = str(Checkpoints(config.model, config.models_dir).current.path) if (config.model or config.models_dir) \
        else _demo_path()
    # graceful_shutdown_wait_loop_s: how often a replica being stopped checks for requests still running (Serve's
    # default, 2 s, made deleting the application take 3 s instead of 1)
    options: dict = dict(name="Generator", max_ongoing_requests=1, graceful_shutdown_timeout_s=60,
                         graceful_shutdown_wait_loop_s=SHUTDOWN_CHECK_S,
                         ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus})
    if config.autoscale is not None:
        low, high = config.autoscale
        options["autoscaling_config"] = {"min_replicas": low, "initial_replicas": low, "max_replicas": high,
                                         "target_ongoing_requests": 1}
    else:
        options["num_replicas"] = config.replicas
    generator = serve.deployment(Generator, **options).bind(config, model_path)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", num_replicas=1,
                               max_ongoing_requests=config.queue_size + 1000,
                               graceful_shutdown_wait_loop_s=SHUTDOWN_CHECK_S,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(generator, config)


def _demo_path() -> str:
    from ..demo import model_path

    return str(model_path())


def jobs_actor(config: ClusterConfig):
    """The running application's ClusterJobs actor (for tests and tools: replicas, running jobs)."""
    return ray.get_actor(config.jobs_actor_name, namespace=NAMESPACE)


def shutdown(config: ClusterConfig) -> None:
    """Delete the application and its ClusterJobs actor."""
    try:
        serve.delete(config.app_name)
    finally:
        try:
            ray.kill(jobs_actor(config))
        except ValueError:
            pass


# --- stopping ------------------------------------------------------------------------------------------------------

# SIGTERM: the process ends within --shutdown-grace + EXIT_SLACK_S whatever is still running (a watchdog), so
# within the grace + 5 s. Of the slack, ANSWER_S is for the interrupted jobs to return their partial images (a step,
# then the VAE decode); the rest is for the ingress to answer and for the application and Ray to be shut down, which
# the watchdog cuts short when they are slow (a busy machine): the answers come first.
EXIT_SLACK_S = 4.5
ANSWER_S = 3.0
EXIT_AT_ONCE_S = 2.0    # SIGINT / a second SIGTERM: the process ends within this
_POLL_S = 0.05

DRAIN_OUTCOMES = {"done": "no job was running, or the running jobs finished within the grace",
                  "interrupted": "the running jobs were interrupted after the grace; their clients got the partial "
                                 "images",
                  "abandoned": "a job did not stop in time after the interrupt; its client got a 503"}


def _wait_until_done(jobs, seconds: float) -> bool:
    """Wait (at most ``seconds``) until the ClusterJobs actor ``jobs`` holds no job; False when time ran out."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if ray.get(jobs.pending.remote(), timeout=max(left, _POLL_S) + 1.0) == 0:
            return True
        if left <= 0:
            return False
        time.sleep(min(_POLL_S, left))


def drain(config: ClusterConfig, grace: float, answer_s: float = ANSWER_S) -> str:
    """A graceful shutdown's work on the running application's jobs: take no new jobs and drop the waiting ones
    (the ingress answers both 503 with ``Retry-After``); give the running jobs ``grace`` seconds to finish, then
    interrupt them (reason ``"shutdown"``: their clients get the partial images, with a warning) and give them
    ``answer_s`` seconds to return; a job still running then is abandoned (its client gets a 503 within
    DISCONNECT_POLL_S). Returns ``"done"``, ``"interrupted"`` or ``"abandoned"`` (:data:`DRAIN_OUTCOMES`). The
    answers are on their way, not necessarily sent: deleting the application (:func:`shutdown`) waits for them."""
    jobs = jobs_actor(config)
    dropped, running = ray.get(jobs.close.remote())
    log.info("shutting down: %d waiting jobs dropped, %d running", dropped, running)
    if _wait_until_done(jobs, grace):
        return "done"
    ray.get(jobs.interrupt_all.remote("shutdown"))
    if _wait_until_done(jobs, answer_s):
        return "interrupted"
    ray.get(jobs.abandon.remote())
    return "abandoned"


def _exit_now(message: str | None = None) -> None:
    """End the process with status 0 now (the threads and the interpreter's teardown are not waited for)."""
    if message:
        print(f"sdlite: {message}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _exit_after(seconds: float, message: str) -> None:
    time.sleep(seconds)
    _exit_now(message)


def _stop_at_once(config: ClusterConfig, own: bool) -> None:
    """SIGINT or a second SIGTERM: waiting jobs get 503, running ones are interrupted (reason ``"stop"``), and the
    process exits within EXIT_AT_ONCE_S (status 0), whatever is still running; answers that are ready by then are
    sent. A Ray instance of our own ends with the process; on a cluster the application is deleted."""
    threading.Thread(target=_exit_after, daemon=True, args=(EXIT_AT_ONCE_S, "exiting now")).start()
    print("sdlite: stopping at once: waiting jobs are answered 503, running ones interrupted", file=sys.stderr)
    try:
        jobs = jobs_actor(config)
        ray.get([jobs.close.remote(), jobs.interrupt_all.remote("stop")], timeout=EXIT_AT_ONCE_S / 4)
        _wait_until_done(jobs, EXIT_AT_ONCE_S / 4)
        time.sleep(DISCONNECT_POLL_S)    # the ingress answers the dropped jobs at its next poll
        if not own:
            serve.delete(config.app_name, _blocking=False)
            ray.kill(jobs)
    except Exception as e:  # noqa: BLE001 - stopping at once: whatever failed, the process ends
        log.debug("stopping at once: %s", e)
    finally:
        _exit_now()


class _Signals:
    """``sdlite serve --ray``'s SIGTERM and SIGINT: the first SIGTERM sets :attr:`requested` (serve_cli then
    drains) and starts a watchdog that ends the process ``grace + EXIT_SLACK_S`` seconds later in any case; SIGINT,
    or a second SIGTERM, stops at once (:func:`_stop_at_once`). Both exit with status 0."""

    def __init__(self, config: ClusterConfig, own: bool):
        import signal

        self.config, self.own = config, own
        self.requested = threading.Event()
        self.draining = self.at_once = False
        self._sigterm = signal.SIGTERM
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, sig, frame) -> None:
        if sig == self._sigterm and not (self.draining or self.at_once):
            self.draining = True
            deadline = self.config.limits.shutdown_grace + EXIT_SLACK_S
            threading.Thread(target=_exit_after, daemon=True, args=(
                deadline, f"the shutdown took {deadline:g} s (--shutdown-grace + {EXIT_SLACK_S:g}): exiting now")
            ).start()
            self.requested.set()
            return
        if not self.at_once:
            self.at_once = True
            self.requested.set()
            threading.Thread(target=_stop_at_once, args=(self.config, self.own), daemon=True).start()


def serve_cli(args, host: str, flags: dict, limits: Limits | None = None) -> int:
    """``sdlite serve --ray``: deploy on the cluster at ``args.address`` (or a Ray instance started here) and serve
    HTTP on ``host:args.port``. SIGTERM: no new jobs, waiting ones answered 503, the running ones get
    ``--shutdown-grace`` and are then interrupted (:func:`drain`), the application is deleted and Ray shut down, and
    the process ends with status 0 within the grace + EXIT_SLACK_S: it ends itself (``os._exit``) once Ray is down,
    as the interpreter's own teardown after Ray's takes most of a second more, during which no watchdog can act.
    SIGINT or a second SIGTERM: the same at once (:func:`_stop_at_once`)."""
    from ..errors import SDLiteError

    try:
        autoscale = parse_autoscale(args.autoscale) if args.autoscale else None
        if autoscale is not None and args.replicas is not None:
            raise ValueError("--replicas and --autoscale exclude each other: give one")
        gpus = args.replica_gpus or 0.0
        engine_options = {"device": "cuda" if gpus > 0 and args.device == "cpu" else args.device,
                          "precision": flags.get("precision") or "auto", "taesd": getattr(args, "taesd", None),
                          "compile": bool(getattr(args, "compile", False))}
        config = ClusterConfig(model=args.model, models_dir=args.models_dir, api_auth=args.api_auth,
                               queue_size=args.queue_size, lora_dir=args.lora_dir, embeddings_dir=args.embeddings,
                               upscaler_dir=getattr(args, "upscaler_dir", None),
                               controlnet_dir=getattr(args, "controlnet_dir", None), engine_options=engine_options,
                               threads=args.threads,
                               replicas=args.replicas if args.replicas is not None else 1, autoscale=autoscale,
                               replica_cpus=args.replica_cpus if args.replica_cpus is not None else 1.0,
                               replica_gpus=gpus, flags={**flags, "ray": True, "address": args.address},
                               limits=limits if limits is not None else Limits()).check()
    except ValueError as e:
        raise SDLiteError(str(e)) from None
    own = args.address is None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # sdlite works offline: no usage reports to Ray's makers
    if own:
        from . import loopback_only

        loopback_only()
    try:
        # a Ray instance of our own stays on loopback; a cluster's addresses are its own business
        ray.init(address=args.address, configure_logging=False,
                 **({"include_dashboard": False, "_node_ip_address": "127.0.0.1"} if own else {}))
    except ConnectionError as e:
        raise SDLiteError(f"--address {args.address}: cannot reach a Ray cluster there ({e})") from None
    # after ray.init, which sets a SIGTERM handler of its own; a SIGTERM while the application deploys is answered
    # once it is deployed (there is no job to wait for then)
    signals = _Signals(config, own)
    drained = False
    try:
        if not own:   # a job table left by an earlier run that did not end cleanly would refuse every job
            try:
                ray.kill(jobs_actor(config))
            except ValueError:
                pass
        serve.start(http_options={"host": host, "port": args.port})
        try:
            app = application(config)
        except FileNotFoundError as e:
            raise SDLiteError(str(e)) from None
        serve.run(app, name=config.app_name, route_prefix="/", blocking=False)
        replicas = f"{autoscale[0]}..{autoscale[1]} (autoscaled)" if autoscale else str(config.replicas)
        print(f"sdlite: serving the A1111 API on http://{host}:{args.port}/sdapi/v1 with Ray Serve, {replicas} "
              f"replica(s); {config.limits.describe()}; Ctrl-C stops it", file=sys.stderr)
        signals.requested.wait()
        outcome = None
        if not signals.at_once:
            grace = config.limits.shutdown_grace
            print(f"sdlite: SIGTERM: no new jobs, waiting ones are answered 503; the running jobs get {grace:g} s "
                  "(--shutdown-grace)", file=sys.stderr)
            try:
                outcome = drain(config, grace)
            except Exception:
                if not signals.at_once:
                    raise
        if signals.at_once:   # SIGINT, or a second SIGTERM during the drain: _stop_at_once ends the process
            threading.Event().wait()
        print(f"sdlite: shutting down: {DRAIN_OUTCOMES[outcome]}; stopping", file=sys.stderr)
        drained = True
        return 0
    finally:
        if not signals.at_once:
            try:
                shutdown(config)   # the ingress's requests still being answered are waited for
            finally:
                if own:
                    ray.shutdown()
                if drained and not signals.at_once:
                    _exit_now()
