"""``sdlite mcp``: sdlite's MCP tools (generate, img2img, inpaint, upscale, list_models, list_samplers) on stdio, for an
MCP client (a chat app, an agent) that starts it. Only MCP's messages go to stdout; the log goes to stderr. The same
tools are served over HTTP under ``/mcp`` by ``sdlite serve``."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ..errors import SDLiteError
from .options import add_compile_option, add_precision_option, check_precision_option, resolve_model


def cmd_mcp(args) -> int:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise SDLiteError("sdlite mcp needs the MCP SDK (mcp is not installed): pip install 'sdlite[server]'") from None
    import anyio

    from ..server.backend import Server
    from ..server.limits import Limits, parse_size
    from ..server.mcp.server import serve_stdio

    for option, path in (("--model", args.model), ("--models-dir", args.models_dir), ("--lora-dir", args.lora_dir),
                         ("--embeddings", args.embeddings), ("--upscaler-dir", args.upscaler_dir)):
        if path is not None and not Path(path).exists() and not (option == "--model" and path in ("demo", "demo-zh")):
            raise SDLiteError(f"{option} {path}: no such file or folder")
    if args.models_dir is not None and not Path(args.models_dir).is_dir():
        raise SDLiteError(f"--models-dir {args.models_dir}: not a folder")
    if args.threads is not None:
        if args.threads < 1:
            raise SDLiteError(f"--threads {args.threads} is not valid: it must be at least 1")
        import torch

        torch.set_num_threads(args.threads)
    try:
        limits = Limits(max_pixels=parse_size(args.max_pixels), max_steps=args.max_steps, max_images=args.max_images,
                        job_timeout=args.job_timeout, max_memory_mb=args.max_memory)
    except ValueError as e:
        raise SDLiteError(str(e)) from None
    precision = check_precision_option(args, args.device)
    model = resolve_model(args.model) if args.model is not None or args.models_dir is None else None
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="sdlite mcp: %(levelname)s %(message)s")
    logging.getLogger("sdlite").setLevel(logging.INFO)
    flags = {"ckpt": model, "models_dir": args.models_dir, "lora_dir": args.lora_dir,
             "embeddings_dir": args.embeddings, "upscaler_dir": args.upscaler_dir, "device": args.device,
             "precision": precision}
    try:
        server = Server(model, args.models_dir, lora_dir=args.lora_dir, embeddings_dir=args.embeddings,
                        engine_options={"device": args.device, "precision": precision, "compile": args.compile},
                        flags=flags, limits=limits, upscaler_dir=args.upscaler_dir)
    except FileNotFoundError as e:
        raise SDLiteError(str(e)) from None
    print(f"sdlite mcp: serving MCP on stdio, model {server.checkpoints.current.name}; {limits.describe()}",
          file=sys.stderr)
    anyio.run(serve_stdio, server)
    if server.jobs.worker_alive():
        # a job still inside the engine (the client left mid-call; it was interrupted): the interpreter's own exit
        # would abort on the thread inside torch, so the process ends here, as sdlite serve's does
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def add_parser(sub) -> None:
    v = sub.add_parser("mcp", help="MCP tools (generate, img2img, inpaint, upscale, ...) on stdio, for an MCP client")
    v.add_argument("--model", "-m", default=None,
                   help="the checkpoint to start with (default: the shipped demo model, or with --models-dir the "
                        "first checkpoint there)")
    v.add_argument("--models-dir", metavar="DIR", default=None,
                   help="checkpoints the tools can list (list_models) and use (their model argument)")
    v.add_argument("--lora-dir", metavar="DIR", default=None, help="where <lora:NAME:...> prompt tags are found")
    v.add_argument("--embeddings", metavar="DIR", default=None, help="textual-inversion embeddings")
    v.add_argument("--upscaler-dir", metavar="DIR", default=None,
                   help="upscaler networks (.pth/.safetensors: ESRGAN, Real-ESRGAN, ...) for the upscale tool, by "
                        "file stem")
    v.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    add_precision_option(v)
    add_compile_option(v)
    v.add_argument("--threads", type=int, default=None,
                   help="CPU threads for generation (default: PyTorch's; 1 is fastest for the tiny demo model)")
    lim = v.add_argument_group("limits (a call over one gets an error naming it; as sdlite serve's)")
    lim.add_argument("--max-pixels", metavar="N|WxH", default="2048x2048",
                     help="width x height of one image at most (default 2048x2048)")
    lim.add_argument("--max-steps", metavar="N", type=int, default=150, help="sampler steps at most (default 150)")
    lim.add_argument("--max-images", metavar="N", type=int, default=16, help="images a call at most (default 16)")
    lim.add_argument("--job-timeout", metavar="S", type=float, default=0.0,
                     help="seconds a job may run; past it, it is interrupted and the call gets the partial image "
                          "(default 0: no limit)")
    lim.add_argument("--max-memory", metavar="MB", type=int, default=0,
                     help="the most memory the process may use (default 0: the machine's or its cgroup's)")
    v.set_defaults(func=cmd_mcp)
