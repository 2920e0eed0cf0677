"""User-facing error types.

Every error that a user can cause (a bad file, a bad option) is an :class:`SDLiteError`; the
command line prints its message and exits with status 2 instead of showing a traceback.
"""

from __future__ import annotations

import os
import sys
import threading

_notice_lock = threading.Lock()
_noticed: set[str] = set()


def notice_once(line: str) -> None:
    """Print ``line`` on stderr, once per process (a fallback's reason, not an error)."""
    with _notice_lock:
        if line in _noticed:
            return
        _noticed.add(line)
    print(line, file=sys.stderr, flush=True)


class SDLiteError(Exception):
    """Base class of every user-facing sdlite error."""


class CheckpointError(SDLiteError):
    """A checkpoint (weights) file cannot be read, written or used.

    ``str(err)`` names the file and, when given, the tensor key at fault, e.g.
    ``model.safetensors: tensor 'unet.conv_in.weight': data [0, 4096) lies past the end ...``.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None, key: str | None = None):
        super().__init__(message, path, key)
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.key = key

    def __str__(self) -> str:
        text = self.message
        if self.key is not None:
            text = f"tensor {self.key!r}: {text}"
        if self.path is not None:
            text = f"{self.path}: {text}"
        return text


class ConfigError(SDLiteError):
    """A config file asks for something sdlite does not implement (the message names the field)."""


class RequestError(SDLiteError, ValueError):
    """A request parameter is out of range; the message names it, its value and what is valid."""


class StopSampling(Exception):
    """Raised by a step callback (``callback`` or ``on_latents`` of :meth:`sdlite.pipeline.Engine.generate`) to end
    sampling after the current step: the result then holds the images decoded from the latest estimate of the final
    latents (``Result.interrupted`` is True). A server's interrupt and skip use it."""
