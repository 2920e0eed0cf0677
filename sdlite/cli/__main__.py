"""``python -m sdlite.cli``: the same as ``sdlite`` (and ``python -m sdlite``)."""
import sys

from . import run

sys.exit(run())
