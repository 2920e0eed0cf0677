"""``sdlite serve``: the HTTP server with AUTOMATIC1111's /sdapi/v1 API (and a web page), or the same on a Ray
cluster; on SIGTERM it drains, on SIGINT or a second SIGTERM it stops at once."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import SDLiteError
from .options import add_compile_option, add_precision_option, check_precision_option

PREVIEW_METHODS = ("none", "auto", "latent2rgb", "taesd")   # ComfyUI's --preview-method choices


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise SDLiteError(f"sdlite serve needs FastAPI and uvicorn ({e.name} is not installed): "
                          "pip install 'sdlite[server]'") from None
    from ..server.app import create_app, parse_auth
    from ..server.limits import Limits, parse_size

    host = "0.0.0.0" if args.listen else args.host
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and (not args.api_key.strip() or any(c.isspace() for c in args.api_key)):
        raise SDLiteError("--api-key is not valid: a key must be non-empty and hold no spaces")
    if not _is_loopback(host) and not args.api_auth and not args.api_key and not args.insecure:
        raise SDLiteError(f"refusing to serve on {host} without authentication: give --api-auth USER:PASS "
                          "(HTTP Basic, as A1111) or --api-key KEY (Bearer), or --insecure to serve it open to the "
                          "network anyway")
    if not 0 < args.port < 65536:
        raise SDLiteError(f"port {args.port} is not valid: expected 1..65535")
    if args.queue_size < 1:
        raise SDLiteError(f"queue size {args.queue_size} is not valid: it must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            raise SDLiteError(f"--threads {args.threads} is not valid: it must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    if args.api_auth:
        try:
            parse_auth(args.api_auth)
        except ValueError as e:
            raise SDLiteError(str(e)) from None
    for option, path in (("--model", args.model), ("--models-dir", args.models_dir), ("--lora-dir", args.lora_dir),
                         ("--embeddings", args.embeddings), ("--taesd", args.taesd),
                         ("--upscaler-dir", args.upscaler_dir), ("--controlnet-dir", args.controlnet_dir),
                         ("--vae-dir", args.vae_dir)):
        if path is not None and not Path(path).exists():
            raise SDLiteError(f"{option} {path}: no such file or folder")
    if args.models_dir is not None and not Path(args.models_dir).is_dir():
        raise SDLiteError(f"--models-dir {args.models_dir}: not a folder")
    try:
        limits = Limits(max_pixels=parse_size(args.max_pixels), max_steps=args.max_steps, max_images=args.max_images,
                        max_prompt_chars=args.max_prompt_chars, job_timeout=args.job_timeout,
                        shutdown_grace=args.shutdown_grace, max_memory_mb=args.max_memory,
                        memory_margin_mb=args.memory_margin)
    except ValueError as e:
        raise SDLiteError(str(e)) from None
    precision = check_precision_option(args, args.device)
    flags = {"listen": args.listen, "host": host, "port": args.port, "ckpt": args.model, "models_dir": args.models_dir,
             "lora_dir": args.lora_dir, "embeddings_dir": args.embeddings, "upscaler_dir": args.upscaler_dir,
             "controlnet_dir": args.controlnet_dir, "vae_dir": args.vae_dir, "queue_size": args.queue_size,
             "device": args.device, "precision": precision, "nowebui": False,
             "preview_method": args.preview_method}
    ray_options = [flag for flag, value in (("--address", args.address), ("--replicas", args.replicas),
                                            ("--autoscale", args.autoscale), ("--replica-cpus", args.replica_cpus),
                                            ("--replica-gpus", args.replica_gpus)) if value is not None]
    if ray_options and not args.ray:
        raise SDLiteError(f"{', '.join(ray_options)} need{'s' if len(ray_options) == 1 else ''} --ray")
    if args.ray:
        from ..scale.ray_serve import serve_cli

        return serve_cli(args, host, flags, limits)
    try:
        app = create_app(model=args.model, models_dir=args.models_dir, api_auth=args.api_auth,
                         queue_size=args.queue_size, lora_dir=args.lora_dir, embeddings_dir=args.embeddings,
                         engine_options={"device": args.device, "precision": precision, "taesd": args.taesd,
                                         "compile": args.compile},
                         flags=flags, limits=limits, upscaler_dir=args.upscaler_dir,
                         controlnet_dir=args.controlnet_dir, api_key=args.api_key, comfy_dir=args.comfy_dir,
                         vae_dir=args.vae_dir)
    except FileNotFoundError as e:
        raise SDLiteError(str(e)) from None
    jobs = app.state.server.jobs
    GracefulServer = graceful_server_class()
    print(f"sdlite: serving the A1111 API on http://{host}:{args.port}/sdapi/v1, OpenAI's Images API on "
          f"http://{host}:{args.port}/v1, MCP on http://{host}:{args.port}/mcp and ComfyUI's API on "
          f"http://{host}:{args.port}/ (web pages: http://{host}:{args.port}/, ComfyUI's "
          f"http://{host}:{args.port}/comfy/); {limits.describe()}", file=sys.stderr)
    server = GracefulServer(uvicorn.Config(app, host=host, port=args.port, log_level=args.log_level,
                                           access_log=args.log_level == "debug",
                                           timeout_graceful_shutdown=CONNECTIONS_WAIT_S),
                            drain=lambda: _drain(app, jobs, limits.shutdown_grace),
                            stop_now=lambda: (jobs.close(), jobs.interrupt("stop")))
    server.run()
    status = 0 if server.started else 1
    if jobs.worker_alive():
        # a job still inside the engine (a shutdown at once, or one abandoned): the interpreter's own exit would
        # abort on the thread inside torch, so the process ends here, its answers sent and its output flushed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _drain(app, jobs, grace: float) -> str:
    """A SIGTERM's drain: the running job finishes (or is interrupted after ``grace``), then the MCP calls being
    answered are answered (their answers pass through the MCP SDK's tasks after the job) before uvicorn closes the
    connections. Returns the job's outcome (:data:`SHUTDOWN_OUTCOMES`)."""
    from ..server.mcp import server as mcp_server

    outcome = jobs.drain(grace)
    mcp_server.wait_answered(app)
    return outcome


API_KEY_ENV = "SDLITE_API_KEY"   # --api-key's default, so that the key need not show in the process list

CONNECTIONS_WAIT_S = 1.0   # after the jobs are answered: how long a shutdown waits for open connections to close


def graceful_server_class():
    """A uvicorn server that drains on SIGTERM. The first SIGTERM: new requests get 503 (``Retry-After``) and so do
    the queued ones, ``drain()`` gives the running job its grace and then interrupts it (its client gets the
    partial image), then the server stops with exit status 0. A second SIGTERM, or SIGINT at any time: queued
    jobs get 503, ``stop_now()`` interrupts the running one, and the process exits at once (status 0)."""
    import signal
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        def __init__(self, config, drain, stop_now):
            super().__init__(config)
            self._drain, self._stop_now, self.draining = drain, stop_now, False

        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and not self.draining:
                self.draining = True
                threading.Thread(target=self._drain_then_exit, name="sdlite-drain", daemon=True).start()
                return
            # at once: no waiting for the job, the connections or the app's shutdown
            self._stop_now()
            self.should_exit = self.force_exit = True
            threading.Thread(target=_exit_soon, args=(EXIT_AT_ONCE_S,), daemon=True).start()

        def _drain_then_exit(self):
            print(f"sdlite: {SHUTDOWN_OUTCOMES[self._drain()]}; stopping", file=sys.stderr)
            self.should_exit = True

    # handle_exit records no signal, so uvicorn does not raise it again when it is done (which would end the
    # process with SIGTERM's status, or a KeyboardInterrupt, instead of 0)
    return GracefulServer


SHUTDOWN_OUTCOMES = {"idle": "shutting down: no job was running",
                     "interrupted": "shutting down: the running job was interrupted after the grace",
                     "abandoned": "shutting down: the running job did not stop in time; its client got a 503"}

EXIT_AT_ONCE_S = 2.0   # SIGINT / a second SIGTERM: the process ends within this, whatever is still running


def _exit_soon(seconds: float) -> None:
    import time

    time.sleep(seconds)
    sys.stderr.flush()
    os._exit(0)


def add_parser(sub) -> None:
    v = sub.add_parser("serve", help="an HTTP server with AUTOMATIC1111's /sdapi/v1 API (and a web page)")
    v.add_argument("--model", "-m", default=None,
                   help="the checkpoint to start with (default: the shipped demo model, or with --models-dir the "
                        "first checkpoint there)")
    v.add_argument("--models-dir", metavar="DIR", default=None,
                   help="checkpoints a client can list (/sd-models) and switch to (options sd_model_checkpoint)")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=7860)
    v.add_argument("--listen", action="store_true",
                   help="bind 0.0.0.0 (every interface); needs --api-auth, --api-key or --insecure")
    v.add_argument("--api-auth", metavar="USER:PASS", default=None,
                   help="HTTP Basic credentials for the API (several: USER:PASS,USER2:PASS2)")
    v.add_argument("--api-key", metavar="KEY", default=None,
                   help="a key every API route takes as 'Authorization: Bearer KEY' (what OpenAI's clients send); "
                        "with --api-auth either credential passes (default: $SDLITE_API_KEY)")
    v.add_argument("--insecure", action="store_true",
                   help="allow serving beyond this machine without --api-auth or --api-key")
    v.add_argument("--queue-size", type=int, default=32,
                   help="jobs that may wait behind the running one; more get 503 with Retry-After (default 32)")
    v.add_argument("--lora-dir", metavar="DIR", default=None, help="where <lora:NAME:...> prompt tags are found")
    v.add_argument("--embeddings", metavar="DIR", default=None, help="textual-inversion embeddings")
    v.add_argument("--upscaler-dir", metavar="DIR", default=None,
                   help="upscaler networks (.pth/.safetensors: ESRGAN, Real-ESRGAN, ...) for the hires fix and the "
                        "extras, by file stem")
    v.add_argument("--controlnet-dir", metavar="DIR", default=None,
                   help="ControlNet models (files and diffusers folders) for A1111's ControlNet units "
                        "(alwayson_scripts), named by file stem or folder name, as /controlnet/model_list lists them")
    v.add_argument("--comfy-dir", metavar="DIR", default=None,
                   help="ComfyUI's folders for its API and web page (/comfy/): input/ (uploads, LoadImage), output/ "
                        "(SaveImage), temp/ (PreviewImage) and user/ (the page's settings and workflows); made where "
                        "missing (default: comfyui in sdlite's cache folder, ~/.cache/sdlite/comfyui)")
    v.add_argument("--preview-method", choices=PREVIEW_METHODS, default="none",
                   help="live previews of ComfyUI prompts on /ws, as ComfyUI's flag: none (ComfyUI's default: API "
                        "clients that take binary frames for images get only the images), or auto / latent2rgb / "
                        "taesd (each sends sdlite's preview, as A1111's live-preview options make it); a prompt's "
                        "extra_data.preview_method overrides it (the web page's 'Live preview method')")
    v.add_argument("--vae-dir", metavar="DIR", default=None,
                   help="VAE files a request may take in place of the model's own (A1111's models/VAE): by name in "
                        "the option sd_vae or Forge's forge_additional_modules, as /sdapi/v1/sd-vae lists them")
    v.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    add_precision_option(v)
    add_compile_option(v)
    v.add_argument("--taesd", metavar="PATH", default=None,
                   help="TAESDs for the 'TAESD' live previews (option show_progress_type): a folder of "
                        "taesd_decoder / taesdxl_decoder files (A1111's models/VAE-approx), one such file, or a "
                        "diffusers AutoencoderTiny folder; each model uses the one for its latents")
    v.add_argument("--threads", type=int, default=None,
                   help="CPU threads for generation (default: PyTorch's; 1 is fastest for the tiny demo model)")
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (debug also logs every request)")
    lim = v.add_argument_group("limits (each refusal is a 422 naming the field, its value and the limit; see "
                               "docs/server/README.md)")
    lim.add_argument("--max-pixels", metavar="N|WxH", default="2048x2048",
                     help="width x height of one image at most (default 2048x2048)")
    lim.add_argument("--max-steps", metavar="N", type=int, default=150, help="sampler steps at most (default 150)")
    lim.add_argument("--max-images", metavar="N", type=int, default=16,
                     help="images a request at most, batch_size x n_iter (default 16)")
    lim.add_argument("--max-prompt-chars", metavar="N", type=int, default=10_000,
                     help="characters of a prompt or negative prompt at most (default 10000)")
    lim.add_argument("--job-timeout", metavar="S", type=float, default=0.0,
                     help="seconds a job may run; past it, it is interrupted and its client gets the partial image "
                          "with a warning (default 0: no limit)")
    lim.add_argument("--max-memory", metavar="MB", type=int, default=0,
                     help="the most memory the server may use; a job whose estimated peak does not fit in what is "
                          "free now gets 503, one that never could 422 (default 0: the machine's or its cgroup's)")
    lim.add_argument("--memory-margin", metavar="MB", type=int, default=0,
                     help="memory kept free beside every job (default 0: 5%% of the memory, at least 256 MB)")
    lim.add_argument("--shutdown-grace", metavar="S", type=float, default=30.0,
                     help="on SIGTERM, seconds the running job has to finish before it is interrupted (default 30)")
    r = v.add_argument_group("on a Ray cluster (the ray extra; see docs/scaling.md)")
    r.add_argument("--ray", action="store_true", help="serve with Ray Serve: the same API, one engine per replica")
    r.add_argument("--address", default=None,
                   help="the Ray cluster: auto (the one this machine belongs to), HOST:PORT or ray://HOST:PORT "
                        "(default: start a Ray instance on this machine)")
    r.add_argument("--replicas", type=int, default=None, help="generator replicas, one engine each (default 1)")
    r.add_argument("--autoscale", metavar="MIN,MAX", default=None,
                   help="let Ray Serve scale the replicas between MIN and MAX with the load (instead of --replicas)")
    r.add_argument("--replica-cpus", type=float, default=None, help="CPUs reserved per replica (default 1)")
    r.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (default 0); above 0 the replicas run on CUDA in fp16")
    v.set_defaults(func=cmd_serve)
