"""`sdlite serve --ray`: the A1111 API on Ray Serve, on a local Ray instance (2 CPUs, loopback only) with the demo
model and 2 generator replicas (1 torch thread each).

Checks: SIGTERM to `sdlite serve --ray` (a process with its own Ray instance) answers the running job's client with
the partial image and the queued ones 503, and exits 0 within the grace + 5 s; 12 concurrent txt2img requests give
`sdlite generate`'s pixels for their seeds and are spread over both replicas; the queue limit and /progress count
across the cluster; interrupt and previews reach the replica running the job; killing a replica's actor mid-run
loses no request (each completes or gets a clear 503, which then succeeds on retry) and Ray Serve restores the
replica; a job past the job time limit is interrupted in its replica and answered with a warning; a ControlNet unit
and an SD3 model run on replicas as in one process; a ComfyUI workflow queued on the ingress runs on a replica (its image,
its /ws events, /history and /view as in one process) and /interrupt stops it there.

Timeouts: a wait for generation work is derived from the work (the duration of one job, measured on the cluster just
before, times the jobs ahead), with a wide margin, so that a machine busy with other work slows the test down
rather than failing it; a wait for Ray to start is STARTUP_S, and one for a state change that needs no generation
(a job admitted, started, answered after an interrupt) is REACT_S.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from PIL import Image

import ray  # noqa: E402 - the ray extra, which make setup installs
from ray import serve  # noqa: E402

from sdlite import cli  # noqa: E402
from sdlite.demo import model_path  # noqa: E402
from sdlite.pipeline import Engine, Request  # noqa: E402
from sdlite.scale import loopback_only  # noqa: E402
from sdlite.scale.ray_serve import EXIT_SLACK_S, ClusterConfig, application, jobs_actor, shutdown  # noqa: E402
from sdlite.server.limits import Limits  # noqa: E402
from tests import loopback  # noqa: E402
from tests.loopback import free_port  # noqa: E402

PROMPT = "a red circle on a blue background"
ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 300     # Ray starting, a replica loading the demo model: seconds alone, much longer on a busy machine
REACT_S = 60        # a state change that needs no generation work
MARGIN, SLACK_S = 10, 30
# a job that runs until it is interrupted: about 46 s alone on a 2-core machine
LONG = {"steps": 1000, "width": 256, "height": 256}
# the same, quicker to stop (an interrupted job decodes its image before it answers: 16x less work at 64x64): 4
# iterations of 1000 steps, about 26 s alone
LONG_LIGHT = {"steps": 1000, "n_iter": 4}


def budget(work_s: float) -> float:
    """How long to wait for generation work that took ``work_s`` seconds when measured just before."""
    return SLACK_S + MARGIN * work_s


wait_for = functools.partial(loopback.wait_for, timeout=REACT_S, every=0.05)


def pixels(b64_or_image) -> np.ndarray:
    image = b64_or_image if isinstance(b64_or_image, Image.Image) else \
        Image.open(io.BytesIO(base64.b64decode(b64_or_image)))
    return np.asarray(image.convert("RGB"), dtype=np.int16)


class Cluster:
    def __init__(self, port: int, config: ClusterConfig):
        self.api = f"http://127.0.0.1:{port}/sdapi/v1"
        self.config = config
        self.jobs = jobs_actor(config)

    def post(self, path, payload=None, timeout=REACT_S):
        return requests.post(f"{self.api}/{path}", json=payload, timeout=timeout)

    def job_s(self, steps: int) -> float:
        """Seconds one txt2img request of ``steps`` steps takes now, end to end (the cluster otherwise idle)."""
        t0 = time.monotonic()
        r = self.post("txt2img", {"prompt": PROMPT, "steps": steps, "seed": 1}, timeout=STARTUP_S)
        assert r.status_code == 200, r.text
        return time.monotonic() - t0

    def rounds(self, jobs: int) -> int:
        """How many jobs in a row each replica runs when ``jobs`` arrive together."""
        return math.ceil(jobs / len(self.replicas()))

    def progress(self):
        return requests.get(f"{self.api}/progress", params={"skip_current_image": "true"}, timeout=30).json()

    def replicas(self) -> dict:
        return ray.get(self.jobs.replica_handles.remote())


def stopped_at(response) -> int:
    """The step an interrupted job stopped at (its "stopped after step N" warning)."""
    stopped = [w for w in json.loads(response.json()["info"])["warnings"] if w.startswith("stopped after step ")]
    assert stopped, json.loads(response.json()["info"])["warnings"]
    return int(stopped[0].split()[3])


def test_sigterm_answers_every_client_and_exits_0_within_the_grace(tmp_path):
    """`sdlite serve --ray --shutdown-grace 3` (its own Ray instance; first in the module, before the shared cluster
    starts): a long job runs and two wait; SIGTERM. New requests get 503 at once, the two waiting ones get 503 with
    Retry-After before the running one is answered; past the grace the running one is interrupted and its client
    gets the partial image with the shutdown warning; the process exits 0 within the grace + 5 s of the signal."""
    from tests.test_comfy_api import workflow as comfy_workflow

    grace = 3
    port = free_port()
    api = f"http://127.0.0.1:{port}/sdapi/v1"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}   # a Ray instance of its own
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sdlite", "serve", "--ray", "--port", str(port), "--threads",
                                 "1", "--max-steps", "1000", "--shutdown-grace", str(grace),
                                 "--comfy-dir", str(tmp_path / "comfy")],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def tail() -> str:
        return log.read_text(errors="replace")[-3000:]

    def progress():
        return requests.get(f"{api}/progress", params={"skip_current_image": "true"}, timeout=30).json()

    answers: dict = {}

    def send(name, payload):
        # answered within the grace + 5 s of the signal, which is sent once the jobs are in
        r = requests.post(f"{api}/txt2img", json=payload, timeout=3 * REACT_S + grace + EXIT_SLACK_S)
        answers[name] = (r, time.monotonic())

    try:
        def ready():
            try:   # while Ray Serve starts, the port may refuse, hold the request or answer 404 / 503
                return requests.get(f"{api}/options", timeout=REACT_S).json()["sd_checkpoint_hash"]
            except (requests.RequestException, ValueError, KeyError):
                return None if proc.poll() is None else "exited"

        assert wait_for(ready, timeout=STARTUP_S, every=0.2) != "exited", tail()
        # --comfy-dir with --ray: ComfyUI's API is served, and a workflow runs on the replica, which writes its image
        # into the folder given (the ingress's prompt thread and the stream of events, as deployed)
        root = f"http://127.0.0.1:{port}"
        assert requests.get(f"{root}/prompt", timeout=REACT_S).json() == {"exec_info": {"queue_remaining": 0}}
        pid = requests.post(f"{root}/prompt", json={"prompt": comfy_workflow(steps=2)}, timeout=REACT_S).json()
        done = wait_for(lambda: requests.get(f"{root}/history/{pid['prompt_id']}", timeout=30).json(),
                        timeout=STARTUP_S)[pid["prompt_id"]]
        assert done["status"]["completed"], done["status"]
        assert (tmp_path / "comfy" / "output" / done["outputs"]["9"]["images"][0]["filename"]).is_file()
        clients = [threading.Thread(target=send, args=("running", {"prompt": PROMPT, **LONG_LIGHT, "seed": 5}))]
        clients[0].start()
        wait_for(lambda: progress()["state"]["sampling_step"] > 0)
        for seed in (6, 7):
            clients.append(threading.Thread(target=send, args=(f"queued-{seed}", {"prompt": PROMPT, "steps": 5,
                                                                                  "seed": seed})))
            clients[-1].start()
        waiting = wait_for(lambda: (b := progress())["state"]["job_count"] == 3 and b)
        assert "1 running on 1 replica, 2 waiting" in waiting["textinfo"], waiting["textinfo"]

        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        refused = requests.post(f"{api}/txt2img", json={"prompt": PROMPT, "steps": 2}, timeout=REACT_S)
        assert refused.status_code == 503 and refused.json()["error"] == "ShuttingDown", refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        status = proc.wait(timeout=grace + EXIT_SLACK_S + REACT_S)
        exited = time.monotonic() - signalled
        for client in clients:
            client.join(REACT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert status == 0, tail()
    assert exited <= grace + 5, f"exited {exited:.1f} s after SIGTERM\n{tail()}"
    r, answered = answers["running"]
    assert r.status_code == 200, r.text[:500]
    assert len(r.json()["images"]) < LONG_LIGHT["n_iter"] and stopped_at(r) < LONG_LIGHT["steps"]
    warnings = json.loads(r.json()["info"])["warnings"]
    assert any(w.startswith("the server is shutting down") and f"grace of {grace} s" in w for w in warnings), warnings
    assert answered - signalled >= grace - 0.5     # it had its grace
    for name in ("queued-6", "queued-7"):
        q, at = answers[name]
        assert q.status_code == 503 and q.json()["error"] == "ShuttingDown", q.text
        assert "shutting down" in q.json()["detail"] and int(q.headers["Retry-After"]) >= 1
        assert at < answered, f"{name} was answered {at - signalled:.1f} s after SIGTERM, not before the running job"
    print(f"SIGTERM under Ray: queued answered after "
          f"{max(answers[n][1] for n in ('queued-6', 'queued-7')) - signalled:.2f} s, the running job after "
          f"{answered - signalled:.2f} s, exit 0 after {exited:.2f} s (grace {grace} s)")


@pytest.fixture(scope="module")
def cluster():
    loopback_only()   # every Ray address on 127.0.0.1, no usage reports: nothing leaves this machine
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    config = ClusterConfig(replicas=2, threads=1, queue_size=10, app_name="sdlite-test",
                           limits=Limits(max_steps=1000))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(config), name=config.app_name, route_prefix="/")
        c = Cluster(port, config)
        assert len(c.replicas()) == 2
        # as on one machine, the model's hash is known once it is loaded, before any request
        wait_for(lambda: requests.get(f"{c.api}/options", timeout=30).json()["sd_checkpoint_hash"], timeout=STARTUP_S)
        yield c
    finally:
        try:
            shutdown(config)
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def engine():
    """The engine `sdlite generate` uses, on 1 thread as the replicas run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.load(model_path())
    torch.set_num_threads(threads)


def test_12_concurrent_requests_equal_sdlite_generate(cluster, tmp_path):
    seeds = list(range(40, 52))
    payload = {"prompt": PROMPT, "steps": 6, "cfg_scale": 7.5, "sampler_name": "DPM++ 2M", "scheduler": "Karras"}
    timeout = budget(cluster.rounds(len(seeds)) * cluster.job_s(6))
    before = ray.get(cluster.jobs.finished_per_replica.remote())
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda s: cluster.post("txt2img", {**payload, "seed": s}, timeout=timeout), seeds))
    assert [r.status_code for r in responses] == [200] * 12, [r.text[:200] for r in responses if r.status_code != 200]
    # the same seeds through `sdlite generate` (its defaults: DPM++ 2M Karras, cfg 7.5), on 1 thread as the replicas
    threads = torch.get_num_threads()
    try:
        for seed, r in zip(seeds, responses):
            out = tmp_path / f"{seed}.png"
            # --width 64: the demo's own size (with no size given, generate upscales its image 4x)
            assert cli.main(["generate", PROMPT, "--steps", "6", "--seed", str(seed), "--threads", "1",
                             "--width", "64", "--output", str(out)]) == 0
            assert np.array_equal(pixels(r.json()["images"][0]), pixels(Image.open(out))), f"seed {seed} differs"
            info = json.loads(r.json()["info"])
            assert info["seed"] == seed and f"Seed: {seed}," in info["infotexts"][0]
    finally:
        torch.set_num_threads(threads)
    after = ray.get(cluster.jobs.finished_per_replica.remote())
    served = {replica: after[replica] - before.get(replica, 0) for replica in after}
    assert sum(served.values()) == 12
    assert len([n for n in served.values() if n > 0]) == 2, f"both replicas should take requests: {served}"


def test_queue_limit_and_progress_count_across_the_cluster(cluster):
    """queue_size 10 behind 2 running jobs: while two long jobs run on the 2 replicas, of 12 concurrent requests 10
    are taken and 2 get 503 with Retry-After; /progress counts the jobs of both replicas (12) and reports the oldest
    running one. The long jobs run until they are interrupted (so that no job ends before all requests are in,
    however slow the machine), then the 10 taken run."""
    short = 20
    one = cluster.job_s(short)
    samples, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            samples.append(cluster.progress())
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    pool = ThreadPoolExecutor(14)
    try:
        # the long jobs, were they not interrupted: 1000 steps of a 4x4 times larger image than `short` steps
        long_timeout = budget(LONG["steps"] / short * 16 * one)
        blockers = [pool.submit(cluster.post, "txt2img", {"prompt": PROMPT, **LONG, "seed": s}, timeout=long_timeout)
                    for s in (200, 201)]
        wait_for(lambda: len(ray.get(cluster.jobs.running.remote())) == 2)
        # each waits for the long jobs to be interrupted (REACT_S), then for the 10 taken ones ahead of it
        timeout = REACT_S + budget((cluster.rounds(10) + 1) * one)
        shorts = [pool.submit(cluster.post, "txt2img", {"prompt": PROMPT, "steps": short, "seed": s}, timeout=timeout)
                  for s in range(202, 214)]
        wait_for(lambda: sum(1 for f in shorts if f.done()) == 2 and cluster.progress()["state"]["job_count"] == 12)
        assert all(not b.done() for b in blockers)
        # /interrupt stops the oldest running job: one long job, then the other (the oldest once the first is gone)
        for n in (1, 2):
            assert cluster.post("interrupt").json() == {}
            wait_for(lambda: sum(1 for b in blockers if b.done()) == n)
        responses = [f.result() for f in blockers + shorts]
    finally:
        if not all(b.done() for b in blockers):   # failed: stop them rather than wait for them
            ray.get(cluster.jobs.interrupt_all.remote(None))
        pool.shutdown(wait=True)
        stop.set()
        poller.join(30)
    for b in responses[:2]:
        assert b.status_code == 200 and stopped_at(b) < LONG["steps"], b.text[:300]
    statuses = sorted(r.status_code for r in responses[2:])
    assert statuses == [200] * 10 + [503] * 2, statuses
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"] == "QueueFull" and "queue is full" in r.json()["detail"]
    busiest = max(samples, key=lambda b: b["state"]["job_count"])
    assert busiest["state"]["job_count"] == 12, [b["state"]["job_count"] for b in samples]
    running = [b for b in samples if b["textinfo"] and "2 running on 2 replicas, 10 waiting" in b["textinfo"]]
    assert running, [b["textinfo"] for b in samples[:20]]
    stepping = [b for b in samples if b["state"]["sampling_step"] > 0]
    assert stepping and all(b["state"]["sampling_steps"] in (LONG["steps"], short) and 0 < b["progress"] <= 1
                            for b in stepping)
    idle = wait_for(lambda: (b := cluster.progress())["state"]["job_count"] == 0 and b)
    assert idle["progress"] == 0


def test_interrupt_and_previews_reach_the_replica(cluster):
    one = cluster.job_s(20)
    assert cluster.post("options", {"show_progress_every_n_steps": 1}).json() == {}
    try:
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            r=cluster.post("txt2img", {"prompt": PROMPT, "steps": 1000, "seed": 7}, timeout=budget(50 * one))))
        worker.start()

        def previewing():
            body = requests.get(f"{cluster.api}/progress", timeout=30).json()
            return body if body["current_image"] and body["state"]["sampling_step"] >= 2 else None

        body = wait_for(previewing, timeout=REACT_S + budget(one))
        assert body["state"]["sampling_steps"] == 1000 and body["state"]["job_count"] == 1
        assert Image.open(io.BytesIO(base64.b64decode(body["current_image"]))).size == (64, 64)
        assert cluster.post("interrupt").json() == {}
        worker.join(REACT_S)
        r = result["r"]
        assert r.status_code == 200 and len(r.json()["images"]) == 1
        assert stopped_at(r) < 1000
        # a client's interrupt is not the server's own: no warning about a time limit or a shutdown
        assert not [w for w in json.loads(r.json()["info"])["warnings"] if "server" in w]
    finally:
        cluster.post("options", {"show_progress_every_n_steps": 10})


def test_killed_replica_loses_no_request(cluster, engine):
    """A replica's actor killed mid-run: every request completes (retried on the other replica) or gets a clear
    503, which succeeds when sent again; each image is the engine's for its seed; Ray Serve restores the replica."""
    seeds = list(range(300, 304))
    one = cluster.job_s(100)
    # on the surviving replica: its own job, the victim's sent again and the rest
    timeout = budget((len(seeds) + 1) * one)
    outcome: dict = {}

    def send(seed):
        outcome[seed] = cluster.post("txt2img", {"prompt": PROMPT, "steps": 100, "seed": seed}, timeout=timeout)

    threads = [threading.Thread(target=send, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    running = wait_for(lambda: (r := ray.get(cluster.jobs.running.remote())) and len(r) == 2 and r)
    victim = sorted(running)[0]
    wait_for(lambda: cluster.progress()["state"]["sampling_step"] > 0)
    ray.kill(cluster.replicas()[victim], no_restart=True)
    for t in threads:
        t.join(timeout)
    assert ray.get(cluster.jobs.requeues.remote()) >= 1   # the victim's job was sent again
    statuses = {s: r.status_code for s, r in outcome.items()}
    assert set(statuses.values()) <= {200, 503}, {s: outcome[s].text[:300] for s in seeds}
    for seed, r in outcome.items():
        if r.status_code == 503:
            assert "died" in r.json()["detail"] and int(r.headers["Retry-After"]) >= 1, r.text
            outcome[seed] = wait_for(lambda: (again := cluster.post("txt2img", {"prompt": PROMPT, "steps": 100,
                                                                                "seed": seed}, timeout=timeout))
                                     .status_code == 200 and again, timeout=STARTUP_S, every=1)
    for seed in seeds:
        expected = engine.generate(Request(PROMPT, steps=100, seed=seed, sampler="euler", cfg_scale=7.0))
        assert np.array_equal(pixels(outcome[seed].json()["images"][0]), pixels(expected.images[0])), seed
    # Ray Serve starts a replacement, which registers with the job table
    wait_for(lambda: len(cluster.replicas()) == 2 and victim not in cluster.replicas(), timeout=STARTUP_S, every=0.5)
    assert cluster.post("txt2img", {"prompt": PROMPT, "steps": 2, "seed": 1}, timeout=budget(one)).status_code == 200


def test_job_timeout_interrupts_the_job_in_its_replica(cluster):
    """A ClusterConfig with --job-timeout 1 (its limits travel with each job to the replica that runs it): a job that
    would run for a minute is interrupted by its replica after 1 s; its client gets 200 with the partial image and
    the time-limit warning, and the job table recorded the interrupt (/progress, once idle, reports the last job's
    flags). The ingress is a ClusterServer in this process, over the module's Generator replicas (no second
    application to start)."""
    from fastapi.testclient import TestClient

    from sdlite.scale.ray_serve import ClusterServer
    from sdlite.server.app import build_app

    config = dataclasses.replace(cluster.config, limits=Limits(max_steps=1000, job_timeout=1.0))
    server = ClusterServer(config, serve.get_deployment_handle("Generator", app_name=config.app_name))
    with TestClient(build_app(server)) as client:
        t0 = time.monotonic()
        r = client.post("/sdapi/v1/txt2img", json={"prompt": PROMPT, **LONG, "seed": 3}, timeout=REACT_S)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text[:500]
        assert Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))).size == (256, 256)
        assert stopped_at(r) < LONG["steps"]
        warnings = json.loads(r.json()["info"])["warnings"]
        assert any("time limit of 1 s (--job-timeout)" in w for w in warnings), warnings
    body = cluster.progress()
    assert body["state"]["job_count"] == 0 and body["state"]["interrupted"] is True, body
    print(f"job timeout 1 s under Ray: answered after {took:.2f} s")


def test_controlnet_unit_runs_on_a_replica(cluster, engine, tmp_path):
    """A ClusterConfig with a ControlNet folder (ClusterConfig.controlnet_dir, what serve --ray --controlnet-dir
    sets): the ingress lists its models and resolves a unit's model by name; the unit travels with the job to a
    replica, whose image is the engine's for the same ControlUnit. The ingress is a ClusterServer in this process,
    over the module's Generator replicas."""
    from fastapi.testclient import TestClient

    from sdlite.control import ControlUnit
    from sdlite.scale.ray_serve import ClusterServer
    from sdlite.server.app import build_app
    from tests import demo_controlnet as D

    models = D.write(tmp_path / "controlnets")
    config = dataclasses.replace(cluster.config, controlnet_dir=str(tmp_path / "controlnets"))
    server = ClusterServer(config, serve.get_deployment_handle("Generator", app_name=config.app_name))
    data = io.BytesIO()
    D.shape_image().save(data, format="PNG")
    unit = {"enabled": True, "module": "canny", "model": "demo-control", "weight": 0.7,
            "image": base64.b64encode(data.getvalue()).decode("ascii"), "control_mode": "ControlNet is more important"}
    with TestClient(build_app(server)) as client:
        names = client.get("/controlnet/model_list").json()["model_list"]
        assert [n.split(" [")[0] for n in names][:2] == ["control_demo_edges", "demo-control"]
        r = client.post("/sdapi/v1/txt2img", json={"prompt": PROMPT, "steps": 4, "seed": 9, "cfg_scale": 7,
                                                   "alwayson_scripts": {"ControlNet": {"args": [unit]}}})
        assert r.status_code == 200, r.text[:500]
    expected = engine.generate(Request(PROMPT, steps=4, seed=9, cfg_scale=7, sampler="euler", controls=(
        ControlUnit(model=str(models["demo-control"]), image=D.shape_image(), preprocessor="canny", weight=0.7,
                    mode="control"),)))
    assert np.array_equal(pixels(r.json()["images"][0]), pixels(expected.images[0]))
    assert "Control Mode: ControlNet is more important" in json.loads(r.json()["info"])["infotexts"][0]
    assert len(r.json()["images"]) == 2   # and the control map, made at the ingress


def test_sd3_model_runs_on_a_replica(cluster, tmp_path):
    """A second application on the same Ray instance whose replica serves a (tiny, random) SD3.5 folder: its
    txt2img under A1111's sampler name is the image the engine gives in this process (flow matching, the three text
    encoders and the transformer behind the same ingress). Its replica takes no CPU reservation, as the module's
    two replicas hold the instance's 2 CPUs."""
    from tests.test_sd3_pipeline import NEGATIVE as SD3_NEGATIVE, SIZE, _pipeline

    _pipeline(tmp_path).save_pretrained(tmp_path / "sd3")
    config = ClusterConfig(model=str(tmp_path / "sd3"), replicas=1, threads=1, replica_cpus=0.0,
                           app_name="sdlite-test-sd3", engine_options={"precision": "exact"})
    payload = {"prompt": PROMPT, "negative_prompt": SD3_NEGATIVE, "steps": 3, "seed": 8, "cfg_scale": 4.0,
               "sampler_name": "Euler", "width": SIZE, "height": SIZE}
    try:
        serve.run(application(config), name=config.app_name, route_prefix="/sd3")
        api = cluster.api.replace("/sdapi/v1", "/sd3/sdapi/v1")
        r = requests.post(f"{api}/txt2img", json=payload, timeout=STARTUP_S)
        assert r.status_code == 200, r.text[:500]
        assert "Steps: 3, Sampler: Euler" in json.loads(r.json()["info"])["infotexts"][0]
    finally:
        shutdown(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = Engine.load(tmp_path / "sd3", precision="exact").generate(
            Request(prompt=PROMPT, negative_prompt=SD3_NEGATIVE, steps=3, seed=8, cfg_scale=4.0, sampler="euler",
                    width=SIZE, height=SIZE))
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(pixels(r.json()["images"][0]), pixels(expected.images[0]))


def test_comfy_prompt_runs_on_a_replica(cluster, engine, tmp_path):
    """ComfyUI's /prompt on a ClusterServer (config.comfy_dir, what serve --ray --comfy-dir sets) in this process,
    over the module's Generator replicas: the workflow runs on a replica, which writes the image into the ingress's
    output folder; its image (by /view) is the engine's for the same settings; the /ws events are those of one
    process, previews included; a second, long prompt shows in /queue and in A1111's /progress (one job table) and
    /interrupt with its prompt_id stops it on its replica; front is refused with the reason."""
    from fastapi.testclient import TestClient

    from sdlite.scale.ray_serve import ClusterServer
    from sdlite.server.app import build_app
    from tests.test_comfy_api import post_prompt, receive_until_done, wait_history, workflow

    config = dataclasses.replace(cluster.config, comfy_dir=str(tmp_path / "comfy"))
    server = ClusterServer(config, serve.get_deployment_handle("Generator", app_name=config.app_name))
    server.set_options({"show_progress_every_n_steps": 1})
    with TestClient(build_app(server)) as client, client.websocket_connect("/ws?clientId=me") as ws:
        assert ws.receive_json()["data"]["status"]["exec_info"]["queue_remaining"] == 0
        pid = post_prompt(client, workflow(seed=3), client_id="me", extra_data={"preview_method": "auto"})["prompt_id"]
        messages, frames = receive_until_done(ws, pid)
        run = [m["type"] for m in messages if m["type"] != "status"]
        assert run[:2] == ["execution_start", "execution_cached"] and run[-3:] == ["executed", "execution_success",
                                                                                   "executing"], run
        assert [m["data"]["value"] for m in messages if m["type"] == "progress"] == [1, 2, 3, 4]
        executing = [m["data"]["node"] for m in messages if m["type"] == "executing"]
        assert executing[-1] is None and set(executing[:-1]) == set(workflow())
        assert ws.receive_json()["data"]["status"]["exec_info"]["queue_remaining"] == 0   # after the final executing
        assert frames and all(f[:8] == bytes([0, 0, 0, 1, 0, 0, 0, 1]) for f in frames)   # JPEG previews
        saved = wait_history(client, pid)["outputs"]["9"]["images"][0]
        view = client.get("/view", params={"filename": saved["filename"], "type": "output"})
        assert view.status_code == 200 and (tmp_path / "comfy" / "output" / saved["filename"]).is_file()
        expected = engine.generate(Request(PROMPT, negative_prompt="", steps=4, seed=3, cfg_scale=7.0,
                                           sampler="euler", schedule="normal", noise="comfy"))
        assert np.array_equal(pixels(Image.open(io.BytesIO(view.content))), pixels(expected.images[0]))

        refused = client.post("/prompt", json={"prompt": workflow(), "front": True})
        assert refused.status_code == 400 and "Ray" in refused.json()["error"]["message"]

        # two long prompts, one per replica (the second's events go to a client that is not connected), and a third
        # that waits for a replica until it is deleted
        long = post_prompt(client, workflow(seed=4, steps=1000), client_id="me")["prompt_id"]
        other = post_prompt(client, workflow(seed=5, steps=1000), client_id="elsewhere")["prompt_id"]
        while ws.receive_json()["type"] != "progress":
            pass
        wait_for(lambda: len(client.get("/queue").json()["queue_running"]) == 2)
        waiting = post_prompt(client, workflow(seed=6), client_id="me")["prompt_id"]
        queue = client.get("/queue").json()
        assert {item[1] for item in queue["queue_running"]} == {long, other}
        assert [item[1] for item in queue["queue_pending"]] == [waiting]
        assert cluster.progress()["state"]["job_count"] == 3   # A1111's /progress: the cluster's one job table
        assert client.post("/queue", json={"delete": [waiting]}).status_code == 200
        assert client.get("/queue").json()["queue_pending"] == []
        for prompt_id in (long, other):   # each stopped on its own replica
            assert client.post("/interrupt", json={"prompt_id": prompt_id}).status_code == 200
        messages, _ = receive_until_done(ws, long)
        assert "execution_interrupted" in [m["type"] for m in messages]
        assert not [m for m in messages if m["data"].get("prompt_id") == waiting]
        for prompt_id in (long, other):
            assert wait_history(client, prompt_id)["status"]["completed"] is False
        # the deleted prompt reached a replica, which found it gone: it leaves the job table and no history
        wait_for(lambda: cluster.progress()["state"]["job_count"] == 0)
        assert client.get(f"/history/{waiting}").json() == {}
