"""Helpers for the tests that run a server or a Ray instance on this machine: a free loopback port, polling until a
condition holds, ``sdlite serve`` as a subprocess, and the browser the page tests drive."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

# Debian's chromium (make setup installs it where it is missing: Playwright's own browser download cannot work
# offline), and the flags it runs headless with here
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, every: float):
    """``predicate()``'s first truthy value, polled every ``every`` s; an AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out waiting")


@contextmanager
def serve(args: list[str], log_path: Path, ready: str, timeout: float = 120, headers: dict | None = None):
    """``sdlite serve --host 127.0.0.1 --port <free> *args`` as a subprocess on one torch thread (the demo model is
    tiny, and two threads stall on a busy machine), its output in ``log_path``; yields its base URL once ``GET
    url + ready`` answers 200 (the test fails, showing the log, if the process exits or ``timeout`` s pass first).
    Stopped at the end: SIGTERM, then SIGKILL after 15 s. ``headers``: sent with the readiness request (a server
    behind auth)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sdlite", "serve", "--host", "127.0.0.1", "--port", str(port),
                                 *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"sdlite serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(urllib.request.Request(url + ready, headers=headers or {}), timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"sdlite serve did not answer within {timeout:g} s:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
