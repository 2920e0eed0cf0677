"""What every config module shares: the error a config that sdlite does not implement raises, and list-or-one
values read as tuples."""
from __future__ import annotations

from ..errors import SDLiteError


class ConfigError(SDLiteError):
    """A config file asks for something sdlite does not implement (the message names the field)."""


def _tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)
