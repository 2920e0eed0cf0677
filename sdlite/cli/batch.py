"""``sdlite batch``: generate every job of a JSONL file into a folder, resumably, locally or on a Ray cluster."""
from __future__ import annotations

import sys
from pathlib import Path

from ..errors import SDLiteError
from .options import add_compile_option, add_precision_option, check_precision_option


def cmd_batch(args) -> int:
    from ..scale.batch import run_batch

    ray_only = [flag for flag, value in (("--address", args.address), ("--workers", args.workers),
                                         ("--worker-cpus", args.worker_cpus), ("--worker-gpus", args.worker_gpus))
                if value is not None]
    if ray_only and not args.ray:
        raise SDLiteError(f"{', '.join(ray_only)} need{'s' if len(ray_only) == 1 else ''} --ray")
    engine_options = {"device": args.device} if args.device else {}
    engine_options["precision"] = check_precision_option(args, args.device or "cpu")
    engine_options["compile"] = args.compile
    summary = run_batch(args.jobs, args.output, model=args.model, use_ray=args.ray, address=args.address,
                        workers=args.workers, threads=args.threads, engine_options=engine_options,
                        worker_cpus=args.worker_cpus if args.worker_cpus is not None else 1.0,
                        worker_gpus=args.worker_gpus or 0.0, lora_dir=args.lora_dir, embeddings_dir=args.embeddings,
                        controlnet_dir=args.controlnet_dir, max_batch=args.max_batch,
                        shutdown_grace=args.shutdown_grace)
    for job_id, message in summary.failed.items():
        print(f"sdlite: job {job_id} failed: {message}", file=sys.stderr)
    where = f"{summary.workers} Ray worker{'s' if summary.workers != 1 else ''}" if args.ray else "locally"
    print(f"{summary.total} jobs: {summary.done} done now ({summary.images} images, {summary.images_per_min:.1f} "
          f"images/min, {where}), {summary.skipped} already in the manifest, {len(summary.failed)} failed; "
          f"manifest: {Path(args.output) / 'manifest.jsonl'}", file=sys.stderr)
    if summary.stopped:   # SIGTERM / SIGINT: a clean stop, exit status 0
        def jobs(n):
            return f"{n} job{'s' if n != 1 else ''}"

        interrupted = (f"; {summary.interrupted} interrupted after the grace and not written" if summary.interrupted
                       else "")
        print(f"sdlite: stopped by {summary.stopped}: {jobs(summary.done)} done by this run, "
              f"{summary.skipped + summary.done} of {summary.total} in the manifest{interrupted}; run the same "
              f"command again to resume (the {jobs(summary.remaining)} left)", file=sys.stderr)
    return 1 if summary.failed else 0


def add_parser(sub) -> None:
    b = sub.add_parser("batch", help="generate every job of a JSONL file into a folder, resumably (locally or "
                                     "on a Ray cluster)")
    b.add_argument("jobs", metavar="JOBS.jsonl",
                   help="one job per line: the API's txt2img fields or the Python Request's, plus an optional id")
    b.add_argument("--output", "-o", required=True, metavar="DIR",
                   help="where the images and manifest.jsonl go; jobs already in the manifest are skipped")
    b.add_argument("--model", "-m", default=None, help="the checkpoint for every job (default: the demo model)")
    b.add_argument("--ray", action="store_true", help="run over a pool of Ray actors, each loading the model once")
    b.add_argument("--address", default=None,
                   help="with --ray: auto, HOST:PORT or ray://HOST:PORT (default: a Ray instance on this machine)")
    b.add_argument("--workers", type=int, default=None,
                   help="with --ray: actors (default: the cluster's CPUs / --worker-cpus)")
    b.add_argument("--worker-cpus", type=float, default=None, help="with --ray: CPUs per actor (default 1)")
    b.add_argument("--worker-gpus", type=float, default=None,
                   help="with --ray: GPUs per actor (default 0); above 0 the actors run on CUDA in fp16")
    b.add_argument("--max-batch", type=int, default=4,
                   help="jobs differing only in consecutive seeds run as one batch of up to this many (default 4; "
                        "1: never)")
    b.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C no new job starts and the running ones get this long to finish before "
                        "they are interrupted (not written: they run again on resume); then exit 0 (default 30; "
                        "0: interrupt at once). A second signal exits at once")
    b.add_argument("--threads", type=int, default=None,
                   help="torch threads per process / actor (default: PyTorch's locally, --worker-cpus with --ray)")
    b.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default cpu)")
    add_precision_option(b)
    add_compile_option(b)
    b.add_argument("--lora-dir", metavar="DIR", default=None, help="where <lora:NAME:...> prompt tags are found")
    b.add_argument("--embeddings", metavar="DIR", default=None, help="textual-inversion embeddings")
    b.add_argument("--controlnet-dir", metavar="DIR", default=None,
                   help="where ControlNet models named in the jobs' units are found (else they name paths)")
    b.set_defaults(func=cmd_batch)
