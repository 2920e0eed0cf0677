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
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from ..server import a1111
from ..server.app import ServerBase, build_app, run_plan
from ..server.checkpoints import Checkpoint, Checkpoints, Engines
from ..server.jobs import PREVIEW_WANTED_S, QueueFull, Unavailable, _State, progress_body
from ..server.limits import Limits

log = logging.getLogger("sdlite.scale")

NAMESPACE = "sdlite"
DISCONNECT_POLL_S = 0.5
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
        """("ok", job id), or ("full", waiting, retry_after) when queue_size jobs already wait behind the running
        ones (one per replica alive)."""
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
    def _flags(self, job: _ClusterJob | None) -> tuple[bool, bool, bool]:
        if job is None:      # dropped meanwhile: stop
            return True, False, False
        wanted = time.monotonic() - self.preview_wanted < PREVIEW_WANTED_S
        return job.interrupted, job.skipped, wanted

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
    cost more than the step."""

    def __init__(self, jobs, job_id: int, flags: tuple, preview: tuple[bool, int]):
        self._jobs, self._id = jobs, job_id
        self._interrupted, self._skipped, self._wanted = flags
        self._preview_enabled, self._preview_every = preview
        self._pending: list = []
        self._sent = -math.inf

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
        interrupted, skipped, self._wanted = flags
        self._interrupted = self._interrupted or interrupted
        self._skipped = skipped

    @property
    def interrupted(self) -> bool:
        self._poll()
        return self._interrupted

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
        control = RemoteControl(self.jobs, job_id, flags, work["preview"])
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
                         embeddings_dir=config.embeddings_dir, flags=config.flags, limits=config.limits)
        self.config = config
        self.generator = generator
        self.jobs = _jobs_actor(config)
        self._widths: dict = {}
        self._preview: tuple[Any, Any] = (None, None)

    def _work(self, plan: a1111.Plan, checkpoint: Checkpoint) -> dict:
        options = self.options_snapshot()
        return {"plan": plan, "checkpoint": dataclasses.replace(checkpoint), "limit": options["sd_checkpoints_limit"],
                "preview": (options["live_previews_enable"], options["show_progress_every_n_steps"])}

    async def generate(self, plan: a1111.Plan, request) -> a1111.Outcome | None:
        checkpoint = self.checkpoints.current if plan.checkpoint is None else self.find_checkpoint(plan.checkpoint)
        admitted = await self.jobs.admit.remote(plan.kind)
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
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    running = await self.jobs.cancel.remote(job_id)
                    if not running:
                        response.cancel()
                    log.info("client went away: job %d %s", job_id, "interrupted" if running else "dropped")
                    return None
        except asyncio.CancelledError:
            self.jobs.cancel.remote(job_id)
            raise

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
    options: dict = dict(name="Generator", max_ongoing_requests=1, graceful_shutdown_timeout_s=60,
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


def serve_cli(args, host: str, flags: dict, limits: Limits | None = None) -> int:
    """``sdlite serve --ray``: deploy on the cluster at ``args.address`` (or a Ray instance started here) and serve
    HTTP on ``host:args.port`` until SIGINT / SIGTERM, then delete the application."""
    import signal
    import sys
    import threading

    from ..errors import SDLiteError

    try:
        autoscale = parse_autoscale(args.autoscale) if args.autoscale else None
        if autoscale is not None and args.replicas is not None:
            raise ValueError("--replicas and --autoscale exclude each other: give one")
        gpus = args.replica_gpus or 0.0
        engine_options = {"device": "cuda" if gpus > 0 and args.device == "cpu" else args.device}
        config = ClusterConfig(model=args.model, models_dir=args.models_dir, api_auth=args.api_auth,
                               queue_size=args.queue_size, lora_dir=args.lora_dir, embeddings_dir=args.embeddings,
                               engine_options=engine_options, threads=args.threads,
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
    try:
        serve.start(http_options={"host": host, "port": args.port})
        try:
            app = application(config)
        except FileNotFoundError as e:
            raise SDLiteError(str(e)) from None
        serve.run(app, name=config.app_name, route_prefix="/", blocking=False)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        replicas = f"{autoscale[0]}..{autoscale[1]} (autoscaled)" if autoscale else str(config.replicas)
        print(f"sdlite: serving the A1111 API on http://{host}:{args.port}/sdapi/v1 with Ray Serve, {replicas} "
              "replica(s); Ctrl-C stops it", file=sys.stderr)
        stop.wait()
        return 0
    finally:
        try:
            shutdown(config)
        finally:
            if own:
                ray.shutdown()
