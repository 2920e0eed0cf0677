"""The ``sdlite`` command: a thin adapter over the library, with no model logic of its own.

Every user-facing failure is an :class:`~sdlite.errors.SDLiteError`; it is printed as one line and the
command exits with status 2.

One module a sub-command (``info``, ``generate``, ``edit``, ``upscale``, ``samplers``, ``serve``, ``mcp``,
``batch``, ``tokens``), each with its ``add_parser(sub)`` and its ``cmd_*`` (``edit`` is ``generate`` with its image
as the first reference image); ``generate``'s option groups for image to image (``img2img``), the hires fix
(``hires``) and ControlNets (``controlnet``) have modules of their own; ``options`` holds
the options several sub-commands share and ``progress`` the progress line. Heavy modules (torch, the engine) are
imported inside the commands, so that ``sdlite --help`` starts fast.
"""
from __future__ import annotations

import argparse
import gc
import sys

from ..errors import SDLiteError
from . import batch, edit, generate, info, mcp, samplers, serve, tokens, upscale
# the names this module held before it became a package (tests and scripts import them from sdlite.cli)
from .batch import cmd_batch
from .controlnet import control_units, resolve_controlnet
from .generate import DEFAULT_REFINER_SWITCH, check_addons, cmd_generate, parse_lora
from .hires import check_upscaler_name, hires_option, parse_wxh
from .img2img import check_sources, parse_outpaint
from .info import cmd_info
from .options import (DEMO_MODELS, PLAIN_DEFAULTS, TURBO_DEFAULTS, TURBO_DEFAULTS_TEXT, add_compile_option,
                      add_precision_option, demo_model_path, resolve_model)
from .progress import ProgressBar
from .samplers import cmd_samplers
from .serve import CONNECTIONS_WAIT_S, EXIT_AT_ONCE_S, SHUTDOWN_OUTCOMES, cmd_serve, graceful_server_class
from .tokens import cmd_tokens
from .upscale import cmd_upscale

__all__ = ["main", "run", "build_parser", "cmd_batch", "control_units", "resolve_controlnet", "DEFAULT_REFINER_SWITCH",
           "check_addons", "cmd_generate", "parse_lora", "check_upscaler_name", "hires_option", "parse_wxh",
           "check_sources", "parse_outpaint", "cmd_info", "DEMO_MODELS",
           "PLAIN_DEFAULTS", "TURBO_DEFAULTS", "TURBO_DEFAULTS_TEXT", "add_compile_option", "add_precision_option",
           "demo_model_path", "resolve_model", "ProgressBar", "cmd_samplers", "CONNECTIONS_WAIT_S", "EXIT_AT_ONCE_S",
           "SHUTDOWN_OUTCOMES", "cmd_serve", "graceful_server_class", "cmd_tokens", "cmd_upscale"]

# in the order `sdlite --help` lists them
COMMANDS = (info, generate, edit, upscale, samplers, serve, mcp, batch, tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdlite", description="Stable Diffusion inference, offline and lean.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SDLiteError as e:
        print(f"sdlite: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sdlite: interrupted", file=sys.stderr)
        return 130


def run(argv: list[str] | None = None) -> int:
    """The ``sdlite`` command (and ``python -m sdlite``): :func:`main`, after which the process ends.

    Before it ends, every object left is frozen out of the cyclic garbage collector (``gc.freeze``): the interpreter's
    last collections at exit walk every object that torch and a loaded model made, 0.5-0.8 s on a 2-core machine that
    a one-image command paid after its image was written. Exit handlers and finalizers still run."""
    code = main(argv)
    gc.freeze()
    return code
