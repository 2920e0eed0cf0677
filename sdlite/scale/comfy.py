"""ComfyUI's ``/prompt`` on ``sdlite serve --ray``: the prompt queue and history stay on the ingress, the workflow
runs on a Generator replica, and its events come back as a stream.

    POST /prompt --> ingress: validate, admit in the ClusterJobs actor (queue limit, shutdown), answer prompt_id
                     a thread per prompt: handle.options(stream=True).run_comfy(job, work) --> a free replica
    replica:         ComfyUI's Executor over the replica's engines, its emit() yielded as ("event", name, data),
                     then ("end", outputs, error, interrupted)
    ingress:         PromptQueue.run turns the events into /ws messages and the /history entry, as in one process

:class:`ClusterPrompts` is the ingress's :class:`~sdlite.server.comfy.queue.PromptQueue`: it keeps the queue, the
history and the websocket hub of the single-machine server and sends each prompt's execution to the cluster
(:class:`_ClusterQueue` in place of the in-process job queue). :class:`ReplicaPrompts` runs them in a replica.

What holds as in one process: the queue limit, the admission and the shutdown are the ClusterJobs actor's, shared
with the A1111 jobs, which reach the replicas through the same Serve handle in arrival order; ``/interrupt`` (with a
``prompt_id``: that prompt, wherever it runs; without: the cluster's oldest running job) and the job time limit
stop a prompt at its next step; ``/queue`` ``delete`` drops a prompt that waits for a replica. What differs: the
prompts run in arrival order, so ``front`` and ``number`` are refused (:data:`NO_REORDERING`); several prompts run at
once, one per replica; each replica keeps its own node-output cache (``POST /free`` empties each before its next
prompt); a replica that dies before it starts a prompt hands it to another, one that dies while running it ends it
with an ``execution_error``.

ComfyUI's folders: the replicas read and write the ingress's ``--comfy-dir`` at the same path (LoadImage reads
``input/``, SaveImage writes ``output/`` that ``/view`` then serves), so that path must be the same folder on every
node: one machine, or a shared file system.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import pickle
import threading
import time
import traceback
from dataclasses import dataclass, field

import ray

from ..server.backend import ServerBase
from ..server.comfy.queue import PromptError, PromptQueue, preview_method
from ..server.comfy.workflow import ComfyDirs, Executor
from ..server.jobs import QueueFull, ShuttingDown
from .cluster import ClusterConfig

log = logging.getLogger("sdlite.scale")

NO_REORDERING = ("on a Ray cluster (sdlite serve --ray) ComfyUI prompts run in the order they arrive, beside the "
                 "other front-ends' jobs: 'front' and 'number' cannot reorder them; leave them out")
ATTEMPTS = 2   # a prompt whose replica dies before it starts is sent once more


# --- the ingress -----------------------------------------------------------------------------------------------------

class _Dropped(Exception):
    """The prompt left the queue before a replica ran it (``/queue`` delete, a shutdown): no history."""


class ReplicaDied(Exception):
    """The replica running a prompt died; its ``execution_error``."""


@dataclass(eq=False)
class _PromptJob:
    """What PromptQueue keeps of a job: the ClusterJobs id and a future that is done when the prompt is."""

    id: int
    label: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class _Control:
    """The ingress's view of a prompt's job, as PromptQueue.run reads it: whether the replica's run was
    interrupted (set from its last message)."""

    def __init__(self, job: _PromptJob):
        self.job = job
        self.interrupted = False

    def ended(self, interrupted: bool) -> None:
        """The replica's run is over; it was ``interrupted`` (by /interrupt, the time limit, a shutdown) or not."""
        self.interrupted = interrupted


class _ClusterQueue:
    """What PromptQueue asks of the server's job queue, on a Ray cluster: admission, drops and interrupts in the
    ClusterJobs actor; each admitted prompt is sent to a replica from a thread of its own, which waits there as long
    as Serve keeps it waiting."""

    def __init__(self, server):
        self.server, self.actor = server, server.jobs

    def submit(self, fn, label: str, ahead_of=None) -> _PromptJob:
        admitted = ray.get(self.actor.admit.remote(label))
        if admitted[0] == "closed":
            raise ShuttingDown()
        if admitted[0] == "full":
            raise QueueFull(admitted[1], admitted[2])
        job = _PromptJob(admitted[1], label)
        threading.Thread(target=self._run, args=(job, fn), name=f"sdlite-comfy-{job.id}", daemon=True).start()
        return job

    def _run(self, job: _PromptJob, fn) -> None:
        t0 = time.monotonic()
        try:
            result = fn(_Control(job))
        except BaseException as e:  # noqa: BLE001 - handed to the job's future
            _settle(job.future.set_exception, e)
        else:
            _settle(job.future.set_result, result)
        finally:
            self.actor.finish.remote(job.id, time.monotonic() - t0)

    def cancel(self, job: _PromptJob) -> None:
        """A waiting prompt deleted (its future cancelled): the ClusterJobs actor drops it, so the replica that takes
        it finds it gone (one that took it just now is interrupted)."""
        self.actor.cancel.remote(job.id)

    def stop(self, job: _PromptJob) -> None:
        """Interrupt this prompt's job, wherever it runs (a client's interrupt: no warning). Not waited for (the
        route runs on the event loop), as a replica reads the flag at its next step report anyway."""
        self.actor.stop_job.remote(job.id, None)

    def interrupt(self) -> None:
        self.actor.interrupt.remote()

    def preview_every(self, step: int, total: int) -> bool:
        return self.server._preview_due(step, total)

    def call(self, fn, label: str):
        return fn()


def _settle(setter, value) -> None:
    try:
        setter(value)
    except concurrent.futures.InvalidStateError:   # deleted while it waited: cancelled already
        pass


class _RemoteExecutor:
    """The executor PromptQueue.run calls on the ingress: it sends the workflow to a replica and emits the events
    that come back."""

    def __init__(self, prompts: "ClusterPrompts"):
        self.prompts = prompts
        self.freed = 0    # POST /free's count: a replica that saw fewer empties its node-output cache first

    def free(self, unload_models: bool, free_memory: bool) -> None:
        if unload_models or free_memory:
            self.freed += 1

    def run(self, prompt_id: str, prompt: dict, outputs: list, control, emit, extra_data=None) -> dict:
        server = self.prompts.server
        job = control.job
        options = server.options_snapshot()
        previews = preview_method(extra_data or {}, server.flags) != "none" and options["live_previews_enable"]
        work = {"prompt_id": prompt_id, "prompt": prompt, "outputs": outputs, "extra_data": extra_data,
                "dirs": self.prompts.dirs, "options": options, "limit": options["sd_checkpoints_limit"],
                "limits": server.limits, "previews": bool(previews), "freed": self.freed}
        stream, first = self._dispatch(job, work, emit)
        try:
            item = first
            while True:
                if item[0] == "event":
                    emit(item[1], item[2])
                elif item[0] == "end":
                    _, results, error, interrupted = item
                    control.ended(interrupted)   # control: PromptQueue's wrapper around the _Control
                    if error is not None:
                        raise error
                    return results
                item = next(stream)
        except _GONE as e:
            raise ReplicaDied(f"the replica running this prompt died ({type(e).__name__}); Ray Serve starts a new "
                              "one: queue the prompt again") from None

    def _dispatch(self, job: _PromptJob, work: dict, emit):
        """Send the prompt to a replica: (the stream, its first message), once a replica took it; raises _Dropped
        when it left the queue meanwhile."""
        actor = self.prompts.jobs.actor
        for attempt in range(1, ATTEMPTS + 1):
            stream = self.prompts.server.generator.options(stream=True).run_comfy.remote(job.id, work)
            try:
                first = next(stream)
            except _GONE as e:
                dead = ray.get(actor.requeue.remote(job.id))
                log.warning("ComfyUI prompt %s: replica %s died before it started (%s); attempt %d of %d",
                            work["prompt_id"], dead, type(e).__name__, attempt, ATTEMPTS)
                continue
            except Exception as e:  # noqa: BLE001 - the replica failed before it ran the prompt: an execution_error
                emit("execution_start", {"prompt_id": work["prompt_id"], "timestamp": int(time.time() * 1000)})
                cause = getattr(e, "cause", None)
                raise (cause if isinstance(cause, Exception) else e) from None
            if first[0] == "gone":
                raise _Dropped(f"prompt {work['prompt_id']} left the queue before it ran")
            if not job.future.set_running_or_notify_cancel():   # deleted just as a replica took it
                stream.cancel()   # the replica stops the job (the delete interrupted it) before it takes another
                raise _Dropped(f"prompt {work['prompt_id']} was deleted as it started")
            return stream, first
        emit("execution_start", {"prompt_id": work["prompt_id"], "timestamp": int(time.time() * 1000)})
        raise ReplicaDied(f"the replicas this prompt was sent to died before they ran it ({ATTEMPTS} attempts); Ray "
                          "Serve starts new ones: queue the prompt again")


_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class ClusterPrompts(PromptQueue):
    """ComfyUI's queue, history and websocket hub on the ingress of a Ray cluster; the prompts run on replicas."""

    def __init__(self, server, dirs: ComfyDirs):
        super().__init__(server, _RemoteExecutor(self))
        self.jobs = _ClusterQueue(server)
        self.dirs = dirs
        server.comfy_dirs = dirs   # validation and /object_info list the input folder's images

    def submit(self, prompt: dict, outputs: list, *, prompt_id: str | None = None, number=None, front: bool = False,
               client_id: str | None = None, extra_data: dict | None = None):
        if front or number is not None:
            raise PromptError("invalid_prompt", NO_REORDERING,
                              f"front={front!r}, number={number!r}")
        return super().submit(prompt, outputs, prompt_id=prompt_id, client_id=client_id, extra_data=extra_data)

    def interrupt(self, prompt_id: str | None = None) -> bool:
        """Without ``prompt_id``: the cluster's oldest running job (what /interrupt stops for every front-end);
        with it: that prompt, on whichever replica runs it (False when it does not run)."""
        if prompt_id is None:
            self.jobs.interrupt()
            return True
        entry = self.status_of(prompt_id)
        if entry is None or entry.started is None:
            return False
        self.jobs.stop(entry.job)
        return True


# --- a replica ---------------------------------------------------------------------------------------------------------

class _PromptControl:
    """A replica's RemoteControl as the workflow's nodes see it: a preview is made when the prompt's client takes
    previews or an A1111 client asks ``/progress`` for one, and reaches the job table only when due there."""

    def __init__(self, control, previews: bool):
        self._control, self._previews, self._total = control, previews, 0

    def __getattr__(self, name):
        return getattr(self._control, name)

    def iteration(self, job_no: int, sampling_steps: int) -> None:
        self._total = sampling_steps
        self._control.iteration(job_no, sampling_steps)

    def step(self, step: int, total: int) -> None:
        self._total = total
        self._control.step(step, total)

    def preview_wanted(self) -> bool:
        return self._previews or self._control.preview_wanted()

    def set_preview(self, image, step: int) -> None:
        if self._control.preview_due(step, self._total):
            self._control.set_preview(image, step)


class ReplicaPrompts:
    """A replica's ComfyUI executor: over the replica's engines, with the server's folders, limits and options as
    each prompt's work brings them."""

    def __init__(self, config: ClusterConfig, model_path: str, engines):
        self.server = ServerBase(model_path, config.models_dir, lora_dir=config.lora_dir,
                                 embeddings_dir=config.embeddings_dir, flags=config.flags, limits=config.limits,
                                 upscaler_dir=config.upscaler_dir, controlnet_dir=config.controlnet_dir,
                                 vae_dir=config.vae_dir)
        self.server.engines = engines
        self.executor: Executor | None = None
        self.freed = 0

    def _prepare(self, work: dict) -> Executor:
        server = self.server
        if self.executor is None or self.executor.dirs != work["dirs"]:
            self.executor = Executor(server, work["dirs"])
        if work["freed"] > self.freed:
            self.executor.free(True, True)
            self.freed = work["freed"]
        server.set_options({k: v for k, v in work["options"].items() if k in server.options})
        server.limits = work["limits"]
        server.engines.limit = work["limit"]
        return self.executor

    async def events(self, work: dict, control):
        """Run the work's workflow in a thread; yields ("event", name, data) as the executor emits them, then
        ("end", outputs, error or None, interrupted)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        executor = self._prepare(work)
        seen = {"step": (0, 0)}
        nodes = _PromptControl(control, work["previews"])

        def emit(event: str, data: dict) -> None:
            if event == "progress":
                seen["step"] = (data.get("value", 0), data.get("max", 0))
            if event == "preview" and not (work["previews"] and self.server._preview_due(*seen["step"])):
                return   # not sent on: the ingress would not show it
            loop.call_soon_threadsafe(queue.put_nowait, ("event", event, data))

        def run():
            try:
                outputs = executor.run(work["prompt_id"], work["prompt"], work["outputs"], nodes, emit,
                                       extra_data=work["extra_data"])
                end = ("end", outputs, None, control.interrupted)
            except BaseException as e:  # noqa: BLE001 - the ingress reports it
                end = ("end", getattr(e, "outputs", None) or {}, portable(e), control.interrupted)
            loop.call_soon_threadsafe(queue.put_nowait, end)

        task = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            while True:
                item = await queue.get()
                yield item
                if item[0] == "end":
                    break
        finally:
            if not task.done():   # the ingress let go of the stream: the job stops, and the replica waits for it
                control.stop()
                await asyncio.shield(task)


def portable(error: BaseException) -> BaseException:
    """``error`` as it can travel to the ingress, with its type's name and its traceback from here
    (``remote_error``, which PromptQueue reports); one that does not pickle becomes a RuntimeError saying what it
    was."""
    lines = traceback.format_exception(error)
    try:
        pickle.loads(pickle.dumps(error))
        out = error
    except Exception:  # noqa: BLE001 - any failure to pickle or unpickle
        out = RuntimeError(f"{type(error).__name__}: {error}")
        for name in ("node_id", "current_inputs", "current_outputs"):
            if hasattr(error, name):
                setattr(out, name, getattr(error, name))
    out.remote_error = (type(error).__name__, lines)
    out.__traceback__ = None
    return out
