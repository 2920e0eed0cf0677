"""Past one machine: ``sdlite serve --ray`` (:mod:`.ray_serve`, the A1111 and ComfyUI APIs on Ray Serve replicas) and
``sdlite batch`` (:mod:`.batch`, bulk generation from a JSONL file, locally or over a pool of Ray actors).

Ray is optional (the ``ray`` extra: ``pip install 'sdlite[ray]'``); this package imports it only when it is used.
"""
from __future__ import annotations

import os


def loopback_only() -> None:
    """Make the Ray instance this process starts next use 127.0.0.1 for all its addresses, so that nothing of it
    listens on another interface (Ray otherwise turns 127.0.0.1 into this machine's network address). For a Ray
    instance on this machine alone: the tests, and ``--ray`` without ``--address``. Also turns off Ray's usage
    reports. Call it before ``ray.init``."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"     # read by the processes Ray starts
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False                  # read by this one (services.get_node_ip_address)
