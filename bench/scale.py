"""Throughput of `sdlite serve --ray` and `sdlite batch --ray` against the single-process server, on this machine.

    python bench/scale.py [--full | --no-full] [--images N] [--out bench/scale.md]     (part of `make bench`)

For the demo model (64x64, 20 steps, 1 torch thread per worker) and, when the full-size SD 1.5 checkpoint of
bench/checkpoint.py is there (``--full``: build it if not), the full-size model at 256x256, 4 steps (torch threads =
cores / workers):

* **images/min**: the single-process server (`sdlite serve`, its own process), Ray Serve with 1 and 2 replicas,
  each fed by enough concurrent clients to keep every replica busy; for the demo model also `sdlite batch` locally
  and over 1 and 2 Ray workers;
* **scaling efficiency**: the 2-replica rate over twice the 1-replica rate;
* **overhead per request**: sequential 1-step requests (demo model) through each server, minus the engine's own
  time for the same request measured in this process: what HTTP + the queue cost on one machine, and what the Serve
  proxy, the ingress, the handle call to a replica and the job-table actor add;
* **projection for N machines**: N x the measured per-machine rate, capped by what one ingress can route (one
  request costs it about the measured overhead; see docs/scaling.md).

Ray runs on this machine only (loopback). Writes bench/scale.md and bench/scale.json and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

PROMPT = "a red circle on a blue background"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(api: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{api}/progress", timeout=5).json()["state"]["job_count"] == 0 and \
                    requests.get(f"{api}/options", timeout=5).json()["sd_checkpoint_hash"]:
                return
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {api} did not become ready")


def throughput(api: str, payload: dict, images: int, clients: int) -> dict:
    """images/min with ``clients`` concurrent clients sending ``images`` requests in all (after 1 warm-up each)."""
    def one(seed):
        t0 = time.perf_counter()
        r = requests.post(f"{api}/txt2img", json={**payload, "seed": seed}, timeout=3600)
        if r.status_code != 200:
            raise SystemExit(f"{api}: {r.status_code} {r.text[:300]}")
        return time.perf_counter() - t0

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(clients)))                     # warm-up: every replica has run once
        t0 = time.perf_counter()
        latencies = list(pool.map(one, range(1000, 1000 + images)))
        wall = time.perf_counter() - t0
    return {"images": images, "wall_s": round(wall, 2), "images_per_min": round(images / wall * 60, 2),
            "latency_p50_s": round(statistics.median(latencies), 3)}


def sequential_latency(api: str, payload: dict, n: int) -> float:
    times = []
    session = requests.Session()
    for i in range(n + 3):
        t0 = time.perf_counter()
        r = session.post(f"{api}/txt2img", json={**payload, "seed": i}, timeout=600)
        assert r.status_code == 200, r.text[:300]
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def engine_time(model: str, request: dict, threads: int, n: int) -> float:
    """Median seconds of Engine.generate for the request (A1111's defaults as the server resolves them)."""
    code = f"""
import json, statistics, time, torch
torch.set_num_threads({threads})
from sdlite.pipeline import Engine, Request
e = Engine.load({model!r})
r = Request(**json.loads({json.dumps(json.dumps(request))}))
times = []
for i in range({n} + 2):
    t = time.perf_counter(); e.generate(r.replace(seed=i)); times.append(time.perf_counter() - t)
print("RESULT", statistics.median(times[2:]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"engine timing failed:\n{out.stderr[-2000:]}")
    return float(lines[0].split()[1])


def batching_gain(model: str, n: int = 8) -> dict:
    """images/min of n single-image jobs against n/4 jobs of 4 images (same prompt), demo model, 1 thread."""
    code = f"""
import time, torch
torch.set_num_threads(1)
from sdlite.pipeline import Engine, Request
e = Engine.load({model!r})
r = Request({PROMPT!r}, steps=20)
e.generate(r.replace(seed=0)); e.generate(r.replace(seed=0, batch_size=4))
t = time.perf_counter()
for i in range({n}): e.generate(r.replace(seed=i))
single = time.perf_counter() - t
t = time.perf_counter()
for i in range({n} // 4): e.generate(r.replace(seed=4 * i, batch_size=4))
batched = time.perf_counter() - t
print("RESULT", {n} / single * 60, {n} / batched * 60)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"batching timing failed:\n{out.stderr[-2000:]}")
    single, batched = map(float, lines[0].split()[1:])
    return {"single_images_per_min": round(single, 1), "batch4_images_per_min": round(batched, 1)}


class LocalServer:
    """`sdlite serve` in its own process."""

    def __init__(self, model: str | None, threads: int):
        self.port = free_port()
        cmd = [sys.executable, "-m", "sdlite", "serve", "--port", str(self.port), "--threads", str(threads),
               "--log-level", "warning"] + (["--model", model] if model else [])
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.api = f"http://127.0.0.1:{self.port}/sdapi/v1"
        wait_ready(self.api)

    def close(self):
        self.proc.terminate()
        self.proc.wait(120)


class RayServer:
    """`sdlite serve --ray` with ``replicas`` replicas, deployed on this process's Ray instance."""

    def __init__(self, model: str | None, replicas: int, threads: int, name: str):
        from ray import serve

        from sdlite.scale.ray_serve import ClusterConfig, application

        self.config = ClusterConfig(model=model, replicas=replicas, threads=threads, app_name=name, queue_size=64)
        serve.run(application(self.config), name=name, route_prefix=f"/{name}")
        self.api = f"http://127.0.0.1:{SERVE_PORT}/{name}/sdapi/v1"
        wait_ready(self.api)

    def close(self):
        from sdlite.scale.ray_serve import shutdown

        shutdown(self.config)


SERVE_PORT = 0


def batch_rates(model: str, images: int) -> dict:
    """`sdlite batch` images/min: locally, and over 1 and 2 Ray workers (model loading excluded: the rate is
    taken over the jobs after each worker's first)."""
    from sdlite.scale.batch import run_batch

    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = Path(tmp) / "jobs.jsonl"
        jobs.write_text("".join(json.dumps({"prompt": PROMPT, "steps": 20, "seed": i}) + "\n" for i in range(images)))
        for label, kw in (("local", {}), ("ray, 1 worker", {"use_ray": True, "workers": 1}),
                          ("ray, 2 workers", {"use_ray": True, "workers": 2})):
            stamps = []
            run_batch(jobs, Path(tmp) / label.replace(" ", "").replace(",", "_"), model=model, threads=1,
                      progress=False, on_result=lambda e: stamps.append(time.perf_counter()), **kw)
            skip = kw.get("workers", 1)      # the first result of each worker includes its start
            span = stamps[-1] - stamps[skip - 1]
            rates[label] = round((len(stamps) - skip) / span * 60, 1)
    return rates


def measure(model: str | None, label: str, payload: dict, images: int, threads_for, cores: int) -> dict:
    rows = {}
    server = LocalServer(model, threads_for(1))
    try:
        rows["single-process server"] = throughput(server.api, payload, images, clients=3)
        if label == "demo":
            rows["_overhead_server_s"] = sequential_latency(server.api, {"prompt": PROMPT, "steps": 1}, 30)
    finally:
        server.close()
    for replicas in (1, 2):
        ray_server = RayServer(model, replicas, threads_for(replicas), f"{label}{replicas}")
        try:
            rows[f"Ray Serve, {replicas} replica{'s' if replicas > 1 else ''}"] = \
                throughput(ray_server.api, payload, images, clients=2 * replicas + 1)
            if label == "demo" and replicas == 1:
                rows["_overhead_ray_s"] = sequential_latency(ray_server.api, {"prompt": PROMPT, "steps": 1}, 30)
        finally:
            ray_server.close()
    return rows


def main():
    global SERVE_PORT
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", dest="full", action="store_true", default=None,
                    help="also the full-size SD 1.5 (bench/checkpoint.py; built if missing)")
    ap.add_argument("--no-full", dest="full", action="store_false")
    ap.add_argument("--images", type=int, default=40, help="images per demo-model measurement")
    ap.add_argument("--full-images", type=int, default=6, help="images per full-size measurement")
    ap.add_argument("--out", default=str(HERE / "scale.md"))
    ap.add_argument("--report-only", action="store_true", help="write the report again from bench/scale.json")
    args = ap.parse_args()
    raw_file = HERE / "scale.json"
    previous = json.loads(raw_file.read_text()) if raw_file.is_file() else {}
    if args.report_only:
        Path(args.out).write_text(render(previous))
        return
    import ray
    from ray import serve

    cores = os.cpu_count() or 1
    from checkpoint import DEFAULT_CACHE, build

    full = args.full if args.full is not None else (DEFAULT_CACHE / "sd15-fp16").is_dir()
    results: dict = {"cores": cores}
    from sdlite.demo import model_path

    demo = str(model_path())
    results["engine_demo_1step_s"] = engine_time(demo, {"prompt": PROMPT, "steps": 1, "sampler": "euler",
                                                        "cfg_scale": 7.0}, 1, 30)
    results["engine_demo_20step_s"] = engine_time(demo, {"prompt": PROMPT, "steps": 20, "sampler": "euler",
                                                         "cfg_scale": 7.0}, 1, 10)
    results["batching"] = batching_gain(demo)
    print(json.dumps(results), flush=True)

    from sdlite.scale import loopback_only

    loopback_only()
    ray.init(num_cpus=cores, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    try:
        SERVE_PORT = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
        results["demo"] = measure(None, "demo", {"prompt": PROMPT, "steps": 20}, args.images, lambda w: 1, cores)
        print(json.dumps(results["demo"]), flush=True)
        results["batch_demo"] = batch_rates(demo, args.images)
        print(json.dumps(results["batch_demo"]), flush=True)
        if full:
            folder, _ = build()
            results["full"] = measure(str(folder), "full", {"prompt": PROMPT, "steps": 4, "width": 256,
                                                            "height": 256}, args.full_images,
                                      lambda w: max(1, cores // w), cores)
            print(json.dumps(results["full"]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    if "full" not in results and "full" in previous:   # not measured this time: the last full-size figures stay
        results["full"] = previous["full"]
        results["full_when"] = previous.get("full_when", previous.get("when"))
    results["when"] = time.strftime("%Y-%m-%d %H:%M")
    if "full" in results and "full_when" not in results:
        results["full_when"] = results["when"]
    raw_file.write_text(json.dumps(results, indent=1) + "\n")
    report = render(results)
    Path(args.out).write_text(report)
    print(report)


def render(results: dict) -> str:
    cores = results["cores"]
    demo = results["demo"]
    engine1 = results["engine_demo_1step_s"]
    over_server = (demo["_overhead_server_s"] - engine1) * 1000
    over_ray = (demo["_overhead_ray_s"] - engine1) * 1000
    lines = ["# Scaling out: throughput on this machine", "",
             f"`python bench/scale.py` on {cores} cores; Ray on this machine only (loopback). Each row: concurrent "
             "clients keep every worker busy; the rate excludes model loading and a warm-up request per client.", ""]

    def table(rows: dict, title: str, ideal_note: str):
        out = [f"## {title}", "", "| setup | images/min | p50 latency | vs server | scaling efficiency |",
               "|---|---:|---:|---:|---:|"]
        base = rows["single-process server"]["images_per_min"]
        one = rows.get("Ray Serve, 1 replica", {}).get("images_per_min")
        for name, row in rows.items():
            if name.startswith("_"):
                continue
            eff = ""
            if name == "Ray Serve, 2 replicas" and one:
                eff = f"{row['images_per_min'] / (2 * one):.0%}"
            out.append(f"| {name} | {row['images_per_min']:.1f} | {row['latency_p50_s']:.2f} s | "
                       f"{row['images_per_min'] / base:.2f}x | {eff} |")
        return out + ["", ideal_note, ""]

    lines += table(demo, "Demo model, 64x64, 20 steps, 1 torch thread per worker",
                   f"Engine alone, 1 thread: {60 / results['engine_demo_20step_s']:.1f} images/min per worker.")
    b = results.get("batch_demo")
    if b:
        lines += ["## `sdlite batch`, demo model, 20 steps", "", "| setup | images/min |", "|---|---:|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in b.items()]
        lines += ["", f"Scaling efficiency of 2 workers: {b['ray, 2 workers'] / (2 * b['ray, 1 worker']):.0%}.", ""]
    g = results["batching"]
    lines += [f"Batching jobs together (demo model, 1 thread): {g['single_images_per_min']:.0f} images/min one at a "
              f"time, {g['batch4_images_per_min']:.0f} in batches of 4.", ""]
    if "full" in results:
        when = f" (measured {results['full_when']})" if results.get("full_when") != results.get("when") else ""
        lines += table(results["full"], f"Full-size SD 1.5 (random weights), 256x256, 4 steps{when}",
                       f"Torch threads: {cores} for the server and 1 replica, {max(1, cores // 2)} per replica for 2, "
                       "so on this machine 2 replicas share the cores 1 replica already used: their ideal is 1x the "
                       "1-replica rate (50% efficiency), not 2x.")
    lines += ["## Overhead per request", "",
              f"Sequential 1-step requests, demo model (engine alone: {engine1 * 1000:.0f} ms):", "",
              "| path | latency | overhead |", "|---|---:|---:|",
              f"| single-process server (HTTP + queue) | {demo['_overhead_server_s'] * 1000:.0f} ms | "
              f"{over_server:.0f} ms |",
              f"| Ray Serve (proxy, ingress, handle, job table) | {demo['_overhead_ray_s'] * 1000:.0f} ms | "
              f"{over_ray:.0f} ms |", "",
              f"Ray Serve adds {over_ray - over_server:.0f} ms per request over the single-process server.", ""]
    # projection: N machines like this one, each running replicas on all its cores
    rows = results.get("full", demo)
    per_machine = rows["Ray Serve, 2 replicas"]["images_per_min"]
    cap = 60 / max(over_ray / 1000, 1e-3)
    which = "full-size 256x256 4-step" if "full" in results else "demo-model"
    lines += ["## Projection for N machines", "",
              f"From the measured {which} rate of one {cores}-core machine ({per_machine:.1f} images/min with "
              f"2 replicas) and Ray's measured overhead ({over_ray:.0f} ms a request, spent in the one ingress "
              f"and job-table actor, so at most about {cap:.0f} requests/min through one ingress):", "",
              "| machines | images/min | limited by |", "|---:|---:|---|"]
    for n in (1, 2, 4, 8, 16, 32, 64):
        rate = min(n * per_machine, cap)
        lines.append(f"| {n} | {rate:.0f} | {'the ingress' if n * per_machine > cap else 'the replicas'} |")
    lines += ["", "The projection assumes machines like this one and a network that adds little to the measured "
              "loopback overhead (a request and its PNG are a few kB for these sizes)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
