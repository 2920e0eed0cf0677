"""`sdlite serve --ray`: the A1111 API on Ray Serve, on a local Ray instance (2 CPUs, loopback only) with the demo
model and 2 generator replicas (1 torch thread each).

Checks: 12 concurrent txt2img requests give `sdlite generate`'s pixels for their seeds and are spread over both
replicas; the queue limit and /progress count across the cluster; interrupt and previews reach the replica running
the job; killing a replica's actor mid-run loses no request (each completes or gets a clear 503, which then succeeds
on retry) and Ray Serve restores the replica.
"""
from __future__ import annotations

import base64
import functools
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

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
from sdlite.scale.ray_serve import ClusterConfig, application, jobs_actor, shutdown  # noqa: E402
from sdlite.server.limits import Limits  # noqa: E402
from tests import loopback  # noqa: E402
from tests.loopback import free_port  # noqa: E402

PROMPT = "a red circle on a blue background"
TIMEOUT = 180


wait_for = functools.partial(loopback.wait_for, timeout=TIMEOUT, every=0.05)


def pixels(b64_or_image) -> np.ndarray:
    image = b64_or_image if isinstance(b64_or_image, Image.Image) else \
        Image.open(io.BytesIO(base64.b64decode(b64_or_image)))
    return np.asarray(image.convert("RGB"), dtype=np.int16)


class Cluster:
    def __init__(self, port: int, config: ClusterConfig):
        self.api = f"http://127.0.0.1:{port}/sdapi/v1"
        self.config = config
        self.jobs = jobs_actor(config)

    def post(self, path, payload=None, timeout=TIMEOUT):
        return requests.post(f"{self.api}/{path}", json=payload, timeout=timeout)

    def progress(self):
        return requests.get(f"{self.api}/progress", params={"skip_current_image": "true"}, timeout=30).json()

    def replicas(self) -> dict:
        return ray.get(self.jobs.replica_handles.remote())


@pytest.fixture(scope="module")
def cluster():
    loopback_only()   # every Ray address on 127.0.0.1, no usage reports: nothing leaves this machine
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    # 1000-step jobs (interrupt, previews): over the default limit of 150 steps
    config = ClusterConfig(replicas=2, threads=1, queue_size=10, app_name="sdlite-test", limits=Limits(max_steps=1000))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(config), name=config.app_name, route_prefix="/")
        c = Cluster(port, config)
        assert len(c.replicas()) == 2
        # as on one machine, the model's hash is known once it is loaded, before any request
        wait_for(lambda: requests.get(f"{c.api}/options", timeout=30).json()["sd_checkpoint_hash"], timeout=60)
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
    before = ray.get(cluster.jobs.finished_per_replica.remote())
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda s: cluster.post("txt2img", {**payload, "seed": s}), seeds))
    assert [r.status_code for r in responses] == [200] * 12, [r.text[:200] for r in responses if r.status_code != 200]
    # the same seeds through `sdlite generate` (its defaults: DPM++ 2M Karras, cfg 7.5), on 1 thread as the replicas
    threads = torch.get_num_threads()
    try:
        for seed, r in zip(seeds, responses):
            out = tmp_path / f"{seed}.png"
            assert cli.main(["generate", PROMPT, "--steps", "6", "--seed", str(seed), "--threads", "1",
                             "--output", str(out)]) == 0
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
    """queue_size 10 behind 2 running jobs: of 14 concurrent requests 12 are taken and 2 get 503 with Retry-After;
    /progress counts the jobs of both replicas and reports the oldest running one."""
    samples, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            samples.append(cluster.progress())
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with ThreadPoolExecutor(14) as pool:
            responses = list(pool.map(lambda s: cluster.post("txt2img", {"prompt": PROMPT, "steps": 100, "seed": s}),
                                      range(200, 214)))
    finally:
        stop.set()
        poller.join(30)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 12 + [503] * 2, statuses
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"] == "QueueFull" and "queue is full" in r.json()["detail"]
    busiest = max(samples, key=lambda b: b["state"]["job_count"])
    assert busiest["state"]["job_count"] == 12, [b["state"]["job_count"] for b in samples]
    running = [b for b in samples if b["textinfo"] and "2 running on 2 replicas" in b["textinfo"]]
    assert running, [b["textinfo"] for b in samples[:20]]
    stepping = [b for b in samples if b["state"]["sampling_step"] > 0]
    assert stepping and all(b["state"]["sampling_steps"] == 100 and 0 < b["progress"] <= 1 for b in stepping)
    idle = wait_for(lambda: (b := cluster.progress())["state"]["job_count"] == 0 and b)
    assert idle["progress"] == 0


def test_interrupt_and_previews_reach_the_replica(cluster):
    assert cluster.post("options", {"show_progress_every_n_steps": 1}).json() == {}
    try:
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            r=cluster.post("txt2img", {"prompt": PROMPT, "steps": 1000, "seed": 7})))
        worker.start()

        def previewing():
            body = requests.get(f"{cluster.api}/progress", timeout=30).json()
            return body if body["current_image"] and body["state"]["sampling_step"] >= 2 else None

        body = wait_for(previewing)
        assert body["state"]["sampling_steps"] == 1000 and body["state"]["job_count"] == 1
        assert Image.open(io.BytesIO(base64.b64decode(body["current_image"]))).size == (64, 64)
        assert cluster.post("interrupt").json() == {}
        worker.join(120)
        r = result["r"]
        assert r.status_code == 200 and len(r.json()["images"]) == 1
        stopped = [w for w in json.loads(r.json()["info"])["warnings"] if w.startswith("stopped after step ")]
        assert stopped and int(stopped[0].split()[3]) < 1000, stopped
    finally:
        cluster.post("options", {"show_progress_every_n_steps": 10})


def test_killed_replica_loses_no_request(cluster, engine):
    """A replica's actor killed mid-run: every request completes (retried on the other replica) or gets a clear
    503, which succeeds when sent again; each image is the engine's for its seed; Ray Serve restores the replica."""
    seeds = list(range(300, 304))
    outcome: dict = {}

    def send(seed):
        outcome[seed] = cluster.post("txt2img", {"prompt": PROMPT, "steps": 100, "seed": seed})

    threads = [threading.Thread(target=send, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    running = wait_for(lambda: (r := ray.get(cluster.jobs.running.remote())) and len(r) == 2 and r)
    victim = sorted(running)[0]
    wait_for(lambda: cluster.progress()["state"]["sampling_step"] > 0)
    ray.kill(cluster.replicas()[victim], no_restart=True)
    for t in threads:
        t.join(TIMEOUT)
    assert ray.get(cluster.jobs.requeues.remote()) >= 1   # the victim's job was sent again
    statuses = {s: r.status_code for s, r in outcome.items()}
    assert set(statuses.values()) <= {200, 503}, {s: outcome[s].text[:300] for s in seeds}
    for seed, r in outcome.items():
        if r.status_code == 503:
            assert "died" in r.json()["detail"] and int(r.headers["Retry-After"]) >= 1, r.text
            outcome[seed] = wait_for(lambda: (again := cluster.post("txt2img", {"prompt": PROMPT, "steps": 100,
                                                                                "seed": seed})).status_code == 200
                                     and again, every=1)
    for seed in seeds:
        expected = engine.generate(Request(PROMPT, steps=100, seed=seed, sampler="euler", cfg_scale=7.0))
        assert np.array_equal(pixels(outcome[seed].json()["images"][0]), pixels(expected.images[0])), seed
    # Ray Serve starts a replacement, which registers with the job table
    wait_for(lambda: len(cluster.replicas()) == 2 and victim not in cluster.replicas(), every=0.5)
    assert cluster.post("txt2img", {"prompt": PROMPT, "steps": 2, "seed": 1}).status_code == 200
