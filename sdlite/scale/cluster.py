"""``sdlite serve --ray``'s cluster-wide state: :class:`ClusterConfig` (what the ingress and the replicas build
themselves from) and :class:`ClusterJobs`, the one named Ray actor that holds every queued and running job of the
cluster, their progress, their interrupt and skip flags and the replicas alive, and counts the queue limit.
"""
from __future__ import annotations

import datetime
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from ..server.jobs import PREVIEW_WANTED_S, _State, progress_body
from ..server.limits import Limits

NAMESPACE = "sdlite"


@dataclass
class ClusterConfig:
    """Everything the ingress and the replicas need to build themselves (plain data: it travels to each)."""

    model: str | None = None          # default: the shipped demo model, or the first one in models_dir
    models_dir: str | None = None
    api_auth: str | None = None
    api_key: str | None = None        # --api-key: Bearer auth beside (or instead of) api_auth
    queue_size: int = 32
    lora_dir: str | None = None
    embeddings_dir: str | None = None
    upscaler_dir: str | None = None
    vae_dir: str | None = None        # VAE files by name (sd_vae), at the same path on every node
    controlnet_dir: str | None = None   # ControlNet models by name, at the same path on every node
    comfy_dir: str | None = None      # ComfyUI's folders (input/, output/, temp/, user/): one folder at the same path
                                      # on every node (default: comfyui in the ingress's cache folder)
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


def ensure_jobs_actor(config: ClusterConfig):
    """The application's ClusterJobs actor, created by whichever of the ingress and the replicas comes first."""
    return ray.remote(ClusterJobs).options(name=config.jobs_actor_name, namespace=NAMESPACE, get_if_exists=True,
                                           lifetime="detached", num_cpus=0).remote(config.queue_size)


def jobs_actor(config: ClusterConfig):
    """The running application's ClusterJobs actor (for tests and tools: replicas, running jobs)."""
    return ray.get_actor(config.jobs_actor_name, namespace=NAMESPACE)
