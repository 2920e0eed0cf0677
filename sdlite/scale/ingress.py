"""``sdlite serve --ray``'s ingress: the FastAPI app of :mod:`sdlite.server.app` (same routes, A1111 mapping,
options, checkpoint list) over a :class:`ClusterServer`, which admits each job in the ClusterJobs actor, sends it to a
Generator replica through Serve's handle, retries it once on another replica if its replica dies, and answers the
clients of jobs a shutdown refused.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any

import ray

from ..server.a1111 import api as a1111
from ..server.app import build_app
from ..server.backend import ServerBase
from ..server.checkpoints import Checkpoint
from ..server.jobs import QueueFull, ShuttingDown, Unavailable
from .cluster import ClusterConfig, ensure_jobs_actor

log = logging.getLogger("sdlite.scale")

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


class ClusterServer(ServerBase):
    """The routes' server on the ingress replica: jobs go to the Generator replicas through Serve's handle."""

    def __init__(self, config: ClusterConfig, generator):
        super().__init__(config.model, config.models_dir, config.api_auth, lora_dir=config.lora_dir,
                         embeddings_dir=config.embeddings_dir, flags=config.flags, limits=config.limits,
                         upscaler_dir=config.upscaler_dir, controlnet_dir=config.controlnet_dir,
                         api_key=config.api_key, vae_dir=config.vae_dir, comfy_dir=config.comfy_dir)
        self.config = config
        self.generator = generator
        self.jobs = ensure_jobs_actor(config)
        self._widths: dict = {}
        self._preview: tuple[Any, Any] = (None, None)
        self._refusals_query: asyncio.Future | None = None
        self._refusals_asked = -math.inf

    def _work(self, plan: a1111.Plan, checkpoint: Checkpoint) -> dict:
        options = self.options_snapshot()
        return {"plan": plan, "checkpoint": dataclasses.replace(checkpoint), "limit": options["sd_checkpoints_limit"],
                "preview": (options["live_previews_enable"], options["show_progress_every_n_steps"])}

    async def generate(self, plan: a1111.Plan, request, progress=None) -> a1111.Outcome | None:
        # progress: step progress is not carried back from the replicas (the job's /progress is)
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

    def comfy_queue(self, dirs):
        """ComfyUI's prompt queue here: its prompts run on the replicas (:mod:`.comfy`)."""
        from .comfy import ClusterPrompts

        return ClusterPrompts(self, dirs)

    def text_width(self) -> int | None:
        from ..loader import open_model

        path = self.checkpoints.current.path
        if path not in self._widths:
            try:
                with open_model(path) as ckpt:   # the encoder prompts are read by: CLIP, BERT, or an LLM (Z-Image)
                    self._widths[path] = ckpt.spec.context_text.width
            except Exception:  # noqa: BLE001 - unknown: every embedding is listed as loaded
                self._widths[path] = None
        return self._widths[path]


class Ingress:
    """The HTTP ingress deployment: sdlite.server.app's FastAPI app over a :class:`ClusterServer`."""

    def __init__(self, generator, config: ClusterConfig):
        self.server = ClusterServer(config, generator)

    def __serve_build_asgi_app__(self):
        return build_app(self.server)
