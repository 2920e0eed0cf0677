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

* **ComfyUI prompts** (``/prompt``, ``/ws``, ``/history``, ``/view``): admitted and ordered as the other jobs, run on
  a replica (``handle.run_comfy``, a stream of ComfyUI's events back to the ingress's websocket clients); see
  :mod:`.comfy` for what differs from one machine.

The model path must be readable at the same path on every node (a shared folder, or the same copy).

The modules: :mod:`.cluster` (:class:`ClusterConfig`, the :class:`ClusterJobs` actor), :mod:`.replica` (the
:class:`Generator` replicas and their :class:`RemoteControl`), :mod:`.ingress` (:class:`ClusterServer` and the
:class:`Ingress` deployment), :mod:`.comfy` (ComfyUI's ``/prompt``: the queue and history on the ingress, the
workflows run on the replicas); this one builds and deletes the application and stops it (:func:`drain`,
:func:`serve_cli`). Their names stay importable from here.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import ray
from ray import serve

from ..server.checkpoints import Checkpoints
from ..server.limits import Limits
from .cluster import NAMESPACE, ClusterConfig, ClusterJobs, jobs_actor, parse_autoscale
from .ingress import DISCONNECT_POLL_S, ClusterServer, Ingress, ReplicaLost
from .replica import REPORT_EVERY_S, Generator, RemoteControl

__all__ = ["application", "shutdown", "drain", "serve_cli", "SHUTDOWN_CHECK_S", "EXIT_SLACK_S", "ANSWER_S",
           "EXIT_AT_ONCE_S", "DRAIN_OUTCOMES",
           # re-exported from where they live now
           "NAMESPACE", "ClusterConfig", "ClusterJobs", "jobs_actor", "parse_autoscale", "DISCONNECT_POLL_S",
           "ClusterServer", "Ingress", "ReplicaLost", "REPORT_EVERY_S", "Generator", "RemoteControl"]

log = logging.getLogger("sdlite.scale")

SHUTDOWN_CHECK_S = 0.2    # a replica being stopped checks this often whether its requests are done


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
                               api_key=getattr(args, "api_key", None), queue_size=args.queue_size,
                               lora_dir=args.lora_dir, embeddings_dir=args.embeddings,
                               upscaler_dir=getattr(args, "upscaler_dir", None), vae_dir=getattr(args, "vae_dir", None),
                               controlnet_dir=getattr(args, "controlnet_dir", None), engine_options=engine_options,
                               comfy_dir=str(Path(args.comfy_dir).resolve()) if getattr(args, "comfy_dir", None)
                               else None,   # the ingress and the replicas run elsewhere than this folder
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
        print(f"sdlite: serving the A1111 API on http://{host}:{args.port}/sdapi/v1 and ComfyUI's on "
              f"http://{host}:{args.port}/ with Ray Serve, {replicas} replica(s); {config.limits.describe()}; "
              "Ctrl-C stops it", file=sys.stderr)
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
