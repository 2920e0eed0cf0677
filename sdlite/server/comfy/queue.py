"""ComfyUI's prompt queue and history over sdlite's one job queue, and the websocket events that report them.

A workflow accepted by ``POST /prompt`` becomes a :class:`Prompt` and one job in the server's FIFO job queue
(:mod:`.jobs`), beside the A1111 requests: they share one line, its limits, its interrupt and its shutdown. ComfyUI
orders its queue by each prompt's *number* (a counter; ``front`` makes it negative, a client may give its own): a
prompt is queued before the first waiting ComfyUI prompt with a larger number (``front``: before every waiting job),
else at the end. When the worker thread takes the job, :meth:`PromptQueue.run` hands the workflow to the
:class:`~.workflow.Executor` and records what happened in the history, as ComfyUI's ``/history`` shows it.

:class:`EventHub` holds the websocket clients (``/ws?clientId=``) and sends them ComfyUI's messages: ``status``
(``exec_info.queue_remaining``) to every client whenever the queue changes, and a prompt's execution events (JSON)
and live previews (binary frames) to the client that queued it, or to every client when it gave no ``client_id``.
The executor emits from the worker thread; the hub hands each message to the event loop thread-safely, in order.
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import struct
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("sdlite.server")

MAX_HISTORY = 10_000       # ComfyUI's MAXIMUM_HISTORY_SIZE: older entries are dropped first
PREVIEW_IMAGE = 1          # ComfyUI's binary event type of a live preview (BinaryEventTypes.PREVIEW_IMAGE)
PREVIEW_JPEG, PREVIEW_PNG = 1, 2   # the image format word after the event type
PREVIEW_MAX_SIDE = 512     # ComfyUI's previews are at most this wide and high
CLIENT_BACKLOG = 1000      # messages waiting for one slow websocket client; beyond it its previews are dropped
RECORDED = ("execution_start", "execution_cached", "execution_success", "execution_error", "execution_interrupted")


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(eq=False)
class Prompt:
    """One queued workflow: what ``/queue`` lists as ``[number, prompt_id, prompt, extra_data, outputs]``."""

    prompt_id: str
    number: float
    prompt: dict
    extra_data: dict
    outputs: list
    client_id: str | None
    created: int = field(default_factory=now_ms)
    started: int | None = None
    job: Any = None

    def item(self) -> list:
        return [self.number, self.prompt_id, self.prompt, self.extra_data, self.outputs]


class EventHub:
    """The websocket clients by client id, and ComfyUI's messages to them. :meth:`send`, :meth:`status` and
    :meth:`preview` may be called from any thread; the messages reach the sockets through the event loop."""

    def __init__(self, remaining: Callable[[], int]):
        self._remaining = remaining
        self._lock = threading.Lock()
        self._clients: dict[str, set[asyncio.Queue]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the sockets live on (set by the first request that queues or connects)."""
        self._loop = loop

    def connect(self, sid: str) -> asyncio.Queue:
        """A client's outgoing messages (called on the event loop)."""
        self.attach(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._clients.setdefault(sid, set()).add(queue)
        return queue

    def disconnect(self, sid: str, queue: asyncio.Queue) -> None:
        with self._lock:
            queues = self._clients.get(sid)
            if queues is not None:
                queues.discard(queue)
                if not queues:
                    del self._clients[sid]

    def connected(self, sid: str | None) -> bool:
        """Whether a prompt's events reach someone: its client (or, without one, any client) is connected."""
        with self._lock:
            return bool(self._clients.get(sid)) if sid is not None else bool(self._clients)

    def status_message(self, sid: str | None = None) -> str:
        data: dict = {"status": {"exec_info": {"queue_remaining": self._remaining()}}}
        if sid is not None:
            data["sid"] = sid
        return json.dumps({"type": "status", "data": data})

    def send(self, event: str, data: dict, sid: str | None = None) -> None:
        """A JSON message ``{"type": event, "data": data}`` to ``sid``'s sockets, or to all when ``sid`` is None."""
        self._post(sid, json.dumps({"type": event, "data": data}, default=str), droppable=False)

    def status(self) -> None:
        """The queue changed: every client gets the new ``queue_remaining``."""
        self._post(None, self.status_message(), droppable=False)

    def preview(self, image, sid: str | None) -> None:
        """A live preview (a PIL image) as ComfyUI's binary frame: event type, format, then the JPEG bytes."""
        if not self.connected(sid):
            return
        image = image.convert("RGB")
        image.thumbnail((PREVIEW_MAX_SIDE, PREVIEW_MAX_SIDE))
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=95)
        self._post(sid, struct.pack(">II", PREVIEW_IMAGE, PREVIEW_JPEG) + out.getvalue(), droppable=True)

    def _post(self, sid: str | None, message, droppable: bool) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, sid, message, droppable)
        except RuntimeError:   # the loop closed meanwhile (the server stopped)
            pass

    def _deliver(self, sid: str | None, message, droppable: bool) -> None:
        with self._lock:
            queues = [q for qs in self._clients.values() for q in qs] if sid is None else \
                list(self._clients.get(sid, ()))
        for queue in queues:
            if droppable and queue.qsize() >= CLIENT_BACKLOG:
                continue
            queue.put_nowait(message)


def preview_method(extra_data: dict, flags: dict) -> str:
    """A prompt's live-preview method: its ``extra_data.preview_method`` (the web page's per-prompt choice) unless
    that is missing or "default", else the server's ``--preview-method`` (ComfyUI's default: "none")."""
    chosen = extra_data.get("preview_method")
    if chosen in (None, "default"):
        chosen = flags.get("preview_method") or "none"
    return chosen


class PreviewControl:
    """The job's :class:`~.jobs.JobControl` as the executor sees it: previews are due at the server's preview
    interval while the prompt's websocket client is connected (a ComfyUI client polls no ``/progress``)."""

    def __init__(self, control, jobs, hub: EventHub, sid: str | None, enabled: Callable[[], bool]):
        self._control, self._jobs, self._hub, self._sid, self._enabled = control, jobs, hub, sid, enabled

    def __getattr__(self, name):
        return getattr(self._control, name)

    def _watched(self) -> bool:
        """Previews are on for the prompt and its websocket client is connected (ComfyUI sends them to it only)."""
        return self._enabled() and self._hub.connected(self._sid)

    def preview_due(self, step: int, total: int) -> bool:
        return self._watched() and self._jobs.preview_every(step, total)

    def preview_wanted(self) -> bool:
        """Whether a preview made now would be seen: by the prompt's websocket client, or by an A1111 client polling
        ``/progress`` for one."""
        return self._watched() or self._control.preview_wanted()


class PromptError(Exception):
    """A ``/prompt`` refused before validation (no prompt, a bad field): ComfyUI's 400 ``{"error", "node_errors"}``."""

    def __init__(self, kind: str, message: str, details: str = ""):
        super().__init__(message)
        self.error = {"type": kind, "message": message, "details": details, "extra_info": {}}
        self.node_errors: dict = {}


class PromptQueue:
    """ComfyUI's queue and history over ``server.jobs``; ``executor`` runs the workflows (in the worker thread)."""

    def __init__(self, server, executor, hub: EventHub | None = None):
        self.server, self.jobs, self.executor = server, server.jobs, executor
        self.hub = hub if hub is not None else EventHub(self.remaining)
        self._lock = threading.Lock()
        self._counter = 0
        self._pending: dict[str, Prompt] = {}
        self._by_job: dict[int, Prompt] = {}
        self._running: dict[str, Prompt] = {}   # one in this process; one per busy replica on a Ray cluster
        self._history: dict[str, dict] = {}   # insertion order: oldest first
        self._times: dict[str, tuple] = {}    # prompt_id -> (queued, started, ended), ms since the epoch

    # --- queueing -------------------------------------------------------------------------------------------

    def submit(self, prompt: dict, outputs: list, *, prompt_id: str | None = None, number=None, front: bool = False,
               client_id: str | None = None, extra_data: dict | None = None) -> Prompt:
        """Queue a validated workflow (``outputs``: the output nodes to run). Raises QueueFull / ShuttingDown."""
        extra = dict(extra_data or {})
        if client_id is not None:
            extra["client_id"] = client_id
        with self._lock:
            if prompt_id is None:
                prompt_id = str(uuid.uuid4())
            elif prompt_id in self._pending or prompt_id in self._running:
                raise PromptError("invalid_prompt", f"prompt_id {prompt_id!r} is already queued",
                                  "a prompt_id must not repeat one that is queued or running")
            if number is None:
                number = -self._counter if front else self._counter
            self._counter += 1
            entry = Prompt(prompt_id, number, prompt, extra, list(outputs), client_id)
            self._pending[prompt_id] = entry

        def ahead_of(job) -> bool:   # called under the job queue's lock: reads, never takes this queue's lock
            if front:
                return True
            other = self._by_job.get(job.id)
            return other is not None and other.number > entry.number

        # submitted outside this queue's lock: the job queue calls _settled under its own lock (a shutdown's close)
        try:
            job = self.jobs.submit(lambda control: self.run(entry, control), "comfyui prompt", ahead_of=ahead_of)
        except BaseException:
            with self._lock:
                del self._pending[prompt_id]
            raise
        with self._lock:
            entry.job = job
            self._by_job[job.id] = entry
        entry.job.future.add_done_callback(lambda _: self._settled(entry))
        self.hub.status()
        return entry

    def _settled(self, entry: Prompt) -> None:
        """The job is over: ran, dropped from the queue, or refused by a shutdown."""
        with self._lock:
            self._by_job.pop(entry.job.id, None)
            dropped = self._pending.pop(entry.prompt_id, None) is entry
        if dropped:
            self.hub.status()

    def remaining(self) -> int:
        """ComfyUI's ``queue_remaining``: the ComfyUI prompts waiting or running."""
        with self._lock:
            return len(self._pending) + len(self._running)

    def queue(self) -> dict:
        with self._lock:
            running = [p.item() for p in self._running.values()]
            pending = [p.item() for p in self._pending.values() if p.started is None]
        return {"queue_running": running, "queue_pending": sorted(pending, key=lambda item: item[0])}

    def delete(self, prompt_ids) -> None:
        """Drop these waiting prompts (a running one goes on: ComfyUI's ``/interrupt`` stops that)."""
        with self._lock:
            entries = [self._pending[i] for i in prompt_ids if i in self._pending]
        for entry in entries:
            if entry.job is not None and entry.job.future.cancel():   # the worker skips it; _settled removes it
                self.jobs.cancel(entry.job)

    def clear(self) -> None:
        """Drop every waiting ComfyUI prompt (the A1111 jobs in the same line stay)."""
        with self._lock:
            ids = list(self._pending)
        self.delete(ids)

    def interrupt(self, prompt_id: str | None = None) -> bool:
        """Stop the running job at its next step: any job, or with ``prompt_id`` only that prompt (False when it is
        not the one running)."""
        if prompt_id is not None:
            with self._lock:
                if prompt_id not in self._running:
                    return False
        self.jobs.interrupt()
        return True

    def status_of(self, prompt_id: str) -> Prompt | None:
        with self._lock:
            return self._running.get(prompt_id) or self._pending.get(prompt_id)

    def pending(self) -> list[Prompt]:
        """The waiting prompts and the running ones, in queue order (the running ones first)."""
        with self._lock:
            waiting = sorted((p for p in self._pending.values() if p.started is None), key=lambda p: p.number)
            return list(self._running.values()) + waiting

    # --- history --------------------------------------------------------------------------------------------

    def history(self, max_items: int | None = None, offset: int = 0) -> dict:
        """The finished prompts, oldest first; ``max_items`` the newest that many (after skipping ``offset``)."""
        with self._lock:
            items = list(self._history.items())
        end = len(items) - max(offset, 0)
        start = 0 if max_items is None else max(end - max_items, 0)
        return dict(items[start:max(end, 0)])

    def history_item(self, prompt_id: str) -> dict:
        with self._lock:
            entry = self._history.get(prompt_id)
        return {prompt_id: entry} if entry is not None else {}

    def times(self, prompt_id: str) -> tuple:
        """When a finished prompt was queued, started and ended (ms since the epoch)."""
        with self._lock:
            return self._times.get(prompt_id, (None, None, None))

    def delete_history(self, prompt_ids) -> None:
        with self._lock:
            for prompt_id in prompt_ids:
                self._history.pop(prompt_id, None)
                self._times.pop(prompt_id, None)

    def clear_history(self) -> None:
        with self._lock:
            self._history.clear()
            self._times.clear()

    # --- running (in the worker thread) ---------------------------------------------------------------------

    def run(self, entry: Prompt, control) -> None:
        """Execute ``entry``'s workflow and record it in the history; its events go to its client. The prompt runs
        from its ``execution_start`` event on (at once in this process; when a replica takes it on a Ray cluster,
        whose executor may raise before that when the prompt was dropped while it waited: it then leaves no
        history)."""
        sid, messages, seen = entry.client_id, [], {"executing": None, "done": [], "step": (0, 0)}
        previews = preview_method(entry.extra_data, self.server.flags) != "none"
        wrapped = PreviewControl(control, self.jobs, self.hub, sid, lambda: previews and self._previews_enabled())

        def emit(event: str, data: dict) -> None:
            if event == "execution_start":
                self._start(entry)
            if event == "preview":   # sent when due (a node may make one at every step)
                if wrapped.preview_due(*seen["step"]):
                    self.hub.preview(data["image"], sid)
                return
            if event == "progress":
                seen["step"] = (data.get("value", 0), data.get("max", 0))
            if event == "executing":
                if seen["executing"] is not None and data.get("node") is not None:
                    seen["done"].append(seen["executing"])
                seen["executing"] = data.get("node")
            elif event == "execution_cached":
                seen["done"].extend(data.get("nodes", []))
            if event in RECORDED:
                messages.append([event, data])
            self.hub.send(event, data, sid)

        outputs, completed = {}, False
        try:
            outputs = self.executor.run(entry.prompt_id, entry.prompt, entry.outputs, wrapped, emit,
                                        extra_data=entry.extra_data)
            if control.interrupted:
                raise _Interrupted()
            emit("execution_success", {"prompt_id": entry.prompt_id, "timestamp": now_ms()})
            completed = True
        except BaseException as e:  # noqa: BLE001 - reported to the client and kept in the history
            if entry.started is None:   # it never ran: the job's future carries the error
                raise
            node = getattr(e, "node_id", None) or seen["executing"]
            where = {"prompt_id": entry.prompt_id, "node_id": node,
                     "node_type": _class_of(entry.prompt, node), "executed": list(dict.fromkeys(seen["done"])),
                     "timestamp": now_ms()}
            if control.interrupted:
                emit("execution_interrupted", where)
            else:
                log.warning("ComfyUI prompt %s failed at node %s: %s", entry.prompt_id, node, e)
                # a replica's error carries its type's name and its traceback from there (.remote_error)
                kind, lines = getattr(e, "remote_error", None) or (type(e).__name__, traceback.format_exception(e))
                emit("execution_error", {**where, "exception_message": str(e), "exception_type": kind,
                                         "traceback": lines,
                                         "current_inputs": getattr(e, "current_inputs", {}),
                                         "current_outputs": getattr(e, "current_outputs", {})})
            outputs = getattr(e, "outputs", None) or {}
        finally:
            if entry.started is not None:
                self._finish(entry, outputs, completed, messages)

    def _start(self, entry: Prompt) -> None:
        with self._lock:
            self._pending.pop(entry.prompt_id, None)
            entry.started = now_ms()
            self._running[entry.prompt_id] = entry
        self.hub.status()

    def _finish(self, entry: Prompt, outputs: dict, completed: bool, messages: list) -> None:
        """The prompt is over: its history entry, then the final ``executing`` (node null), and the queue's status.
        The history and the queue are updated first, so that a client acting on the final message (clients read
        ``/history`` on it) finds the prompt done."""
        record = {"prompt": entry.item(), "outputs": outputs,
                  "status": {"status_str": "success" if completed else "error", "completed": completed,
                             "messages": messages},
                  "meta": {node: {"node_id": node, "display_node": node, "parent_node": None,
                                  "real_node_id": node} for node in outputs}}
        with self._lock:
            self._history[entry.prompt_id] = record
            self._times[entry.prompt_id] = (entry.created, entry.started, now_ms())
            while len(self._history) > MAX_HISTORY:
                self._times.pop(next(iter(self._history)), None)
                del self._history[next(iter(self._history))]
            self._running.pop(entry.prompt_id, None)
        self.hub.send("executing", {"node": None, "prompt_id": entry.prompt_id}, entry.client_id)
        self.hub.status()

    def _previews_enabled(self) -> bool:
        return bool(self.server.options_snapshot().get("live_previews_enable", True))

    def free(self, unload_models: bool, free_memory: bool):
        """``POST /free``: the executor lets go of what it holds, in the queue (never during a job)."""
        return self.jobs.call(lambda: self.executor.free(unload_models, free_memory), "comfyui free")


class _Interrupted(Exception):
    pass


def _class_of(prompt: dict, node) -> str | None:
    spec = prompt.get(node) if isinstance(prompt, dict) and node is not None else None
    return spec.get("class_type") if isinstance(spec, dict) else None
