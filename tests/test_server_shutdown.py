"""`sdlite serve` stopped by signals, as a real process on 127.0.0.1 with the demo model: SIGTERM during a long job
answers the queued clients 503 (Retry-After), gives the running job --shutdown-grace seconds, interrupts it (its
client gets the partial image and a warning) and exits 0 within the grace + 5 s; SIGINT exits at once.

The jobs are 10 iterations of 1000 steps of the demo model (a minute or more of work), so they are running when the signal comes;
the waits below are bounded by the server's own start (the model load) and the grace, with margins for a busy
machine."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.loopback import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
START_S = 180          # the server's start (imports, the model load) on a busy machine
GRACE_S = 2.0
LONG = {"prompt": "a red circle on a blue background", "steps": 1000, "n_iter": 10}


class Running:
    def __init__(self, tmp_path, *flags):
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/sdapi/v1"
        self.log = tmp_path / "server.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "sdlite", "serve", "--port", str(self.port),
                                          "--max-steps", "1000", *flags], stdout=out, stderr=subprocess.STDOUT,
                                         cwd=ROOT)
        self.results: dict = {}
        self.threads: list = []

    def ready(self):
        def loaded():
            try:
                return requests.get(f"{self.api}/options", timeout=10).json()["sd_checkpoint_hash"]
            except requests.RequestException:
                assert self.proc.poll() is None, self.log.read_text()
                return None
        wait_for(loaded, timeout=START_S, every=0.2)
        wait_for(lambda: self.state()["job_count"] == 0, timeout=START_S, every=0.1)

    def state(self):
        return requests.get(f"{self.api}/progress", params={"skip_current_image": "true"}, timeout=30).json()["state"]

    def send(self, key, body):
        def post():
            self.results[key] = requests.post(f"{self.api}/txt2img", json=body, timeout=START_S)
        thread = threading.Thread(target=post)
        thread.start()
        self.threads.append(thread)

    def start_long(self, seed: int) -> None:
        """A long job, running (past its first step) when this returns."""
        self.send("running", {**LONG, "seed": seed})
        wait_for(lambda: self.state()["sampling_step"] > 0, timeout=START_S, every=0.05)

    def signal_and_wait(self, sig, timeout: float) -> tuple[int, float]:
        """Send ``sig``; (exit status, seconds from the signal to the exit); the clients are joined after."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        seconds = time.monotonic() - t0
        self.join()
        return code, seconds

    def join(self):
        for thread in self.threads:
            thread.join(START_S)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def server(tmp_path):
    s = Running(tmp_path, "--shutdown-grace", str(GRACE_S))
    try:
        s.ready()
        yield s
    finally:
        s.stop()


def test_sigterm_interrupts_the_running_job_after_the_grace_and_exits_0(server):
    server.start_long(1)
    server.send("queued-1", {**LONG, "seed": 2})
    server.send("queued-2", {**LONG, "seed": 3})
    # both queued behind the running job before the signal
    wait_for(lambda: "2 jobs waiting" in (requests.get(f"{server.api}/progress", timeout=30).json()["textinfo"] or ""),
             timeout=60, every=0.05)
    # waited on generously; the bound the issue sets is checked below
    code, seconds = server.signal_and_wait(signal.SIGTERM, GRACE_S + 5 + 30)
    print(f"\nSIGTERM -> exit {code} in {seconds:.2f} s (grace {GRACE_S} s)")
    assert code == 0, server.log.read_text()[-2000:]
    assert seconds <= GRACE_S + 5, seconds
    running = server.results["running"]
    assert running.status_code == 200, running.text
    warnings = json.loads(running.json()["info"])["warnings"]
    assert 1 <= len(running.json()["images"]) < 10
    assert any("shutting down" in w and "--shutdown-grace" in w for w in warnings), warnings
    assert any(w.startswith("stopped after step") for w in warnings), warnings
    for key in ("queued-1", "queued-2"):
        r = server.results[key]
        assert r.status_code == 503 and r.json()["error"] == "ShuttingDown", r.text
        assert int(r.headers["Retry-After"]) > 0
    assert "the running job was interrupted after the grace" in server.log.read_text()


def test_sigint_exits_at_once(server):
    server.start_long(4)
    code, seconds = server.signal_and_wait(signal.SIGINT, 30)
    print(f"\nSIGINT -> exit {code} in {seconds:.2f} s")
    assert code == 0 and seconds < GRACE_S + 3, (code, seconds)
    # the running client was answered, or its connection closed: it is not left hanging
    r = server.results.get("running")
    assert r is None or r.status_code in (200, 503), server.log.read_text()[-3000:]


def test_a_second_sigterm_exits_at_once(tmp_path):
    s = Running(tmp_path, "--shutdown-grace", "600")
    try:
        s.ready()
        s.start_long(5)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert s.proc.poll() is None   # draining: the grace is 600 s
        code, seconds = s.signal_and_wait(signal.SIGTERM, 30)
        print(f"\nsecond SIGTERM -> exit {code} in {seconds:.2f} s")
        assert code == 0 and seconds < 5, (code, seconds)
    finally:
        s.stop()


# --- a request cut off by the shutdown at once, at any point: deterministic, in this process ---------------------

def _cut_off(stopping: bool, started: bool):
    """What AnswerWhenStopped sends for a handler cancelled (as a shutdown at once cancels it) after it started its
    response or before; the cancellation it lets pass is returned as "cancelled"."""
    import asyncio

    from sdlite.server.http import AnswerWhenStopped

    async def handler(scope, receive, send):
        if started:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        raise asyncio.CancelledError()   # e.g. while the finished job's images are written, off the event loop

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def main():
        try:
            await AnswerWhenStopped(handler, stopping=lambda: stopping)({"type": "http", "method": "POST",
                                                                           "path": "/sdapi/v1/txt2img",
                                                                           "headers": []}, receive, send)
        except asyncio.CancelledError:
            return "cancelled", sent
        return "answered", sent
    return asyncio.run(main())


def test_a_request_cut_off_by_the_shutdown_gets_503_not_500():
    how, sent = _cut_off(stopping=True, started=False)
    assert how == "answered"
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    assert start["status"] == 503
    assert dict(start["headers"])[b"retry-after"] == b"30"
    assert json.loads(body)["error"] == "ShuttingDown"


def test_a_cancellation_that_is_no_shutdown_or_after_the_response_started_passes_on():
    assert _cut_off(stopping=False, started=False) == ("cancelled", [])
    how, sent = _cut_off(stopping=True, started=True)
    assert how == "cancelled" and [m["status"] for m in sent] == [200]   # nothing sent after the response began
