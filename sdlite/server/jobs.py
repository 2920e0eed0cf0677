"""The job queue: generation jobs run one at a time, first in first out, in one worker thread.

This is the only place where the server's concurrency lives. HTTP handlers :meth:`Jobs.submit` a job (a function
of a :class:`JobControl`) and await its ``future``; the worker thread runs the jobs in order. Everything a
client may ask while a job runs (progress, interrupt, skip, the live preview) reads or sets a few fields under
a lock that the worker holds only for a moment at each step, so none of it waits on the engine.

    jobs = Jobs(queue_size=32)
    job = jobs.submit(lambda control: run(control), label="txt2img")    # QueueFull / ShuttingDown when refused
    result = await asyncio.wrap_future(job.future)

A job reports through its :class:`JobControl`: how many iterations it runs (A1111's ``job_count``, the batch
count), which one is running (``job_no``), each sampler step, and previews. :meth:`JobControl.step` raises
:class:`~sdlite.pipeline.StopSampling` once the job is interrupted or the iteration skipped, which the engine
turns into the partial image of that step.

Progress follows the AUTOMATIC1111 web UI's ``/sdapi/v1/progress`` (its ``shared.state`` fields and its
progress and ETA formula); idle means ``progress`` 0 and ``job_count`` 0.
"""
from __future__ import annotations

import collections
import concurrent.futures
import datetime
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..pipeline import StopSampling

PREVIEW_WANTED_S = 10.0   # previews are made only while a client asked for one this recently
ANSWER_S = 3.0            # after a shutdown's interrupt: how long the running job has to return its partial image


class Unavailable(Exception):
    """A job refused for now (HTTP 503 with a ``Retry-After`` of ``retry_after`` seconds)."""

    retry_after = 30


class QueueFull(Unavailable):
    """The queue holds its maximum of waiting jobs; ``retry_after`` (seconds) estimates when there is room."""

    def __init__(self, queued: int, retry_after: int):
        super().__init__(f"the queue is full ({queued} jobs waiting); retry in about {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Unavailable):
    """The server is stopping: it finishes the running job and takes no new ones."""

    retry_after = 30

    def __init__(self, running: bool = False):
        super().__init__("the server is shutting down: this job was still running when the shutdown grace and "
                         "the interrupt had passed" if running else
                         "the server is shutting down: it finishes the running job and accepts no new ones")


@dataclass(eq=False)
class Job:
    """One queued unit of work. ``future`` resolves to what ``fn`` returns (or raises)."""

    fn: Callable[["JobControl"], Any]
    label: str
    id: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    interrupted: bool = False     # the whole job stops at its next step
    skipped: bool = False         # the current iteration stops at its next step; the job goes on
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # monotonic time the worker took it
    stop_reason: str | None = None   # why it was interrupted: None (/interrupt, a client gone), "timeout",
                                     # "shutdown" (after the grace), "stop" (a shutdown at once)
    on_step: Callable[[int, int, int, int], None] | None = None   # (iteration, iterations, step, steps) after each
                                     # sampler step, called in the worker thread (MCP's progress notifications)


@dataclass
class _State:
    """A1111's ``shared.state`` fields, as ``/progress`` reports them."""

    job: str = ""
    job_count: int = 0
    job_no: int = 0
    sampling_step: int = 0
    sampling_steps: int = 0
    skipped: bool = False
    interrupted: bool = False
    job_timestamp: str = "0"
    time_start: float = 0.0
    textinfo: str | None = None
    current_image: Any = None          # PIL image of the latest preview
    preview_step: int = 0              # the step the preview shows


def progress_body(s: "_State", waiting: int, want_image: bool, job_count: int | None = None,
                  textinfo: str | None = None) -> tuple[dict, Any]:
    """A1111's progress JSON for the job whose state is ``s`` (its ``job_count`` iterations; idle when 0) with
    ``waiting`` jobs behind it, and its preview when ``want_image``. ``job_count`` replaces the reported
    ``state.job_count`` (a cluster reports all its queued and running jobs there), ``textinfo`` the text."""
    state = {"skipped": s.skipped, "interrupted": s.interrupted, "stopping_generation": False,
             "job": s.job, "job_count": s.job_count if job_count is None else job_count,
             "job_timestamp": s.job_timestamp, "job_no": s.job_no,
             "sampling_step": s.sampling_step, "sampling_steps": s.sampling_steps}
    if textinfo is None:
        textinfo = s.textinfo
        if waiting:
            text = f"{waiting} job{'s' if waiting > 1 else ''} waiting"
            textinfo = f"{textinfo}; {text}" if textinfo else text
    if s.job_count == 0:
        return {"progress": 0, "eta_relative": 0, "state": state, "textinfo": textinfo}, None
    # A1111's formula: a small head start (no division by zero), whole iterations, then this one's steps
    progress = 0.01 + s.job_no / s.job_count
    if s.sampling_steps > 0:
        progress += s.sampling_step / s.sampling_steps / s.job_count
    elapsed = time.time() - s.time_start
    eta_relative = max(elapsed / progress - elapsed, 0.0)
    image = s.current_image if want_image else None
    return ({"progress": min(progress, 1.0), "eta_relative": eta_relative, "state": state,
             "textinfo": textinfo}, image)


class Jobs:
    """A FIFO of at most ``queue_size`` waiting jobs and the worker thread that runs them.

    ``preview_every(step)`` -> bool says when a running job's preview is due (the server's
    ``show_progress_every_n_steps`` option); previews are made only while clients ask for them.
    """

    def __init__(self, queue_size: int = 32, preview_every: Callable[[int, int], bool] | None = None,
                 job_timeout: float = 0.0):
        if queue_size < 1:
            raise ValueError(f"queue size {queue_size} is not valid: it must be at least 1")
        self.queue_size = queue_size
        self.job_timeout = job_timeout     # seconds a job may run before it is interrupted; 0: no limit
        self.preview_every = preview_every or (lambda step, total: step % 10 == 0 or step == total)
        self._cv = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._current: Job | None = None
        self._state = _State()
        self._ids = itertools.count(1)
        self._closed = False
        self._stopping = False
        self._preview_wanted = -math.inf
        self._mean_job_s = 5.0             # running estimate of a job's duration, for Retry-After
        self._worker = threading.Thread(target=self._run, name="sdlite-jobs", daemon=True)
        self._worker.start()

    # --- submitting and controlling -------------------------------------------------------------------------

    def submit(self, fn: Callable[["JobControl"], Any], label: str,
               ahead_of: Callable[[Job], bool] | None = None,
               on_step: Callable[[int, int, int, int], None] | None = None) -> Job:
        """Queue ``fn`` to run after the jobs already queued, or, with ``ahead_of``, before the first waiting job for
        which ``ahead_of(job)`` holds (ComfyUI's prompt numbers); ``on_step``: see :attr:`Job.on_step`. Raises
        :class:`QueueFull` or :class:`ShuttingDown`."""
        with self._cv:
            if self._closed:
                raise ShuttingDown()
            if len(self._queue) >= self.queue_size:
                raise QueueFull(len(self._queue), self._retry_after())
            job = Job(fn, label, next(self._ids), on_step=on_step)
            place = next((i for i, waiting in enumerate(self._queue) if ahead_of(waiting)), None) \
                if ahead_of is not None else None
            if place is None:
                self._queue.append(job)
            else:
                self._queue.insert(place, job)
            self._cv.notify_all()
            return job

    def cancel(self, job: Job) -> None:
        """The client of ``job`` went away: a queued job is dropped, a running one interrupted."""
        with self._cv:
            if job.future.cancel():        # still queued: the worker skips it
                try:
                    self._queue.remove(job)
                except ValueError:
                    pass
            elif job is self._current:
                job.interrupted = True

    def interrupt(self, reason: str | None = None) -> None:
        """Stop the running job at its next step (it returns what it has); queued jobs still run. ``reason``
        (``"timeout"``, ``"shutdown"``) is reported with the partial image; None is a client's interrupt."""
        with self._cv:
            if self._current is not None:
                if not self._current.interrupted:
                    self._current.stop_reason = reason
                self._current.interrupted = True
                self._state.interrupted = True

    def skip(self) -> None:
        """Stop the running job's current iteration at its next step; the job goes on with the next one."""
        with self._cv:
            if self._current is not None:
                self._current.skipped = True
                self._state.skipped = True

    def call(self, fn: Callable[[], Any], label: str) -> Job:
        """Queue a job that needs no progress reporting (e.g. loading a model)."""
        return self.submit(lambda control: fn(), label)

    # --- reading ---------------------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._queue)

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._current is not None or bool(self._queue)

    def progress(self, want_image: bool = False) -> tuple[dict, Any]:
        """``(body, preview)``: A1111's progress JSON (without ``current_image``) and the latest preview image
        (None unless ``want_image`` and one was made for the running job)."""
        with self._cv:
            if want_image:
                self._preview_wanted = time.monotonic()
            return progress_body(self._state, len(self._queue), want_image)

    # --- lifetime --------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the queue takes no new jobs (the server is stopping)."""
        return self._closed

    def close(self) -> None:
        """Take no new jobs (:class:`ShuttingDown`) and answer the queued ones the same; the running job finishes."""
        with self._cv:
            self._closed = True
            while self._queue:
                job = self._queue.popleft()
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(ShuttingDown())
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job runs or waits; False when ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._current is None and not self._queue, timeout)

    def stop(self, timeout: float | None = None) -> None:
        """:meth:`close`, let the running job finish (at most ``timeout`` seconds), and end the worker thread."""
        self.close()
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._worker.join(timeout)

    def worker_alive(self) -> bool:
        """Whether the worker thread still runs (a job abandoned by a shutdown, still inside the engine)."""
        return self._worker.is_alive()

    def drain(self, grace: float, answer_s: float = ANSWER_S) -> str:
        """A graceful shutdown's work: take no new jobs and answer the queued ones 503 (:meth:`close`); give the
        running job ``grace`` seconds to finish, then interrupt it (its client gets the partial image) and give it
        ``answer_s`` seconds to return; a job still running then (one step longer than that) is abandoned: its
        client gets a 503 at once, and the worker thread, a daemon, ends with the process. Returns what happened:
        ``"idle"``, ``"interrupted"`` or ``"abandoned"``."""
        self.close()
        if self.wait_idle(grace):
            return "idle"
        self.interrupt("shutdown")
        if self.wait_idle(answer_s):
            return "interrupted"
        with self._cv:
            job = self._current
        if job is not None and not job.future.done():
            try:
                job.future.set_exception(ShuttingDown(running=True))
            except concurrent.futures.InvalidStateError:   # it returned just now
                pass
        return "abandoned"

    # --- the worker ------------------------------------------------------------------------------------------

    def _retry_after(self) -> int:
        return int(min(max(math.ceil(self._mean_job_s * (len(self._queue) + 1)), 1), 3600))

    def _next(self) -> Job | None:
        with self._cv:
            while True:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return None
                job = self._queue.popleft()
                if job.future.set_running_or_notify_cancel():   # False: cancelled while it waited
                    self._current = job
                    job.started = time.monotonic()
                    self._state = _State(job=job.label, job_count=1, time_start=time.time(),
                                         job_timestamp=datetime.datetime.now().strftime("%Y%m%d%H%M%S"),
                                         textinfo=f"{job.label}: starting")
                    return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            t0 = time.monotonic()
            result, error = None, None
            try:
                result = job.fn(JobControl(self, job))
            except BaseException as e:  # noqa: BLE001 - handed to whoever awaits the job
                error = e
            with self._cv:
                self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * (time.monotonic() - t0)
                # as A1111's state.end(): idle, but whether the last job was interrupted stays readable
                self._state = _State(interrupted=self._state.interrupted, skipped=self._state.skipped,
                                     job_timestamp=self._state.job_timestamp)
            # answered once /progress reports idle (A1111 ends its state before it answers), so that a client that
            # reads /progress right after its response sees no job; idle for wait_idle once answered
            try:
                if error is not None:
                    job.future.set_exception(error)
                else:
                    job.future.set_result(result)
            except concurrent.futures.InvalidStateError:   # abandoned by a shutdown (drain): answered already
                pass
            del result, error
            with self._cv:
                self._current = None
                self._cv.notify_all()


class JobControl:
    """What a running job reports through, and how it learns that it should stop."""

    def __init__(self, jobs: Jobs, job: Job):
        self._jobs, self._job = jobs, job

    @property
    def interrupted(self) -> bool:
        self._check_time()
        return self._job.interrupted

    @property
    def stop_reason(self) -> str | None:
        """Why the job was interrupted: None (a client's /interrupt, or the client went away), ``"timeout"``
        (the server's job time limit) or ``"shutdown"``."""
        return self._job.stop_reason if self._job.interrupted else None

    @property
    def job_timeout(self) -> float:
        return self._jobs.job_timeout

    def _check_time(self) -> None:
        limit = self._jobs.job_timeout
        job = self._job
        if limit and not job.interrupted and job.started is not None and time.monotonic() - job.started > limit:
            with self._jobs._cv:
                if not job.interrupted:
                    job.stop_reason, job.interrupted = "timeout", True
                    if self._jobs._current is job:
                        self._jobs._state.interrupted = True

    def begin(self, job_count: int, textinfo: str | None = None) -> None:
        """The job runs ``job_count`` iterations (A1111's batch count)."""
        with self._jobs._cv:
            self._jobs._state.job_count = max(job_count, 1)
            if textinfo is not None:
                self._jobs._state.textinfo = textinfo

    def info(self, textinfo: str) -> None:
        with self._jobs._cv:
            self._jobs._state.textinfo = textinfo

    def iteration(self, job_no: int, sampling_steps: int) -> None:
        """Iteration ``job_no`` (from 0) starts; it will run ``sampling_steps`` sampler steps."""
        with self._jobs._cv:
            s = self._jobs._state
            self._job.skipped = False
            s.job_no, s.sampling_step, s.sampling_steps, s.skipped = job_no, 0, sampling_steps, False
            s.current_image, s.preview_step = None, 0
            s.textinfo = f"{self._job.label}: image {job_no + 1} of {s.job_count}"

    def step(self, step: int, total: int) -> None:
        """Sampler step ``step`` of ``total`` is done; raises StopSampling when the job or iteration must stop (an
        interrupt, a skip, or the job past the server's time limit)."""
        self._check_time()
        with self._jobs._cv:
            s = self._jobs._state
            s.sampling_step, s.sampling_steps = step, total
            s.textinfo = f"{self._job.label}: image {s.job_no + 1} of {s.job_count}, step {step} of {total}"
            stop = self._job.interrupted or self._job.skipped
            iteration, iterations = s.job_no, s.job_count
        if self._job.on_step is not None:
            self._job.on_step(iteration, iterations, step, total)
        if stop and step < total:
            raise StopSampling()

    def preview_wanted(self) -> bool:
        """Whether a client asked for a preview lately (A1111's ``/progress`` with ``current_image``)."""
        with self._jobs._cv:
            return time.monotonic() - self._jobs._preview_wanted < PREVIEW_WANTED_S

    def preview_due(self, step: int, total: int) -> bool:
        """Whether a preview should be made now: one is due at this step and a client asked for one lately."""
        return self.preview_wanted() and self._jobs.preview_every(step, total)

    def set_preview(self, image, step: int) -> None:
        with self._jobs._cv:
            self._jobs._state.current_image, self._jobs._state.preview_step = image, step
