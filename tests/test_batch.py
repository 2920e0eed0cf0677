"""`sdlite batch`: bulk generation from a JSONL file, locally and over Ray actors (a local Ray instance: 2 CPUs,
loopback only), with the demo model.

Checks: the local run writes every image with its parameters and a complete manifest; bad job files are refused
naming the line and the field; a run stopped part-way (Ctrl-C) resumes without duplicates; 40 jobs over 2 Ray
workers give the local run's images byte for byte; a worker killed mid-batch (plus the driver stopped) loses
nothing: re-running finishes the remaining jobs, with no duplicates in the manifest. Shutdown on signals (`sdlite
batch` as a subprocess, and in this process): SIGTERM stops the run with exit status 0 and a manifest of complete
lines, and the same command resumes it to the images of an uninterrupted run, locally and over Ray; the running job
finishes within --shutdown-grace and nothing new starts; past the grace (0 here) the running job is interrupted and
not written, and Ray's actors are killed; a second signal exits at once; signal handlers are installed only in the
main thread and are restored after the run.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import ray
from sdlite import cli
from sdlite.images import parse_infotext
from sdlite.scale import loopback_only
from sdlite.scale.batch import BatchError, read_jobs, run_batch
from tests.loopback import wait_for

PROMPTS = ["a red circle on a blue background", "a yellow star on a black background",
           "a green triangle on a white background", "a purple square on an orange background"]
N_JOBS = 40


def write_jobs(path: Path) -> Path:
    """38 jobs in the API's txt2img vocabulary (the last 8 a seed sweep of one prompt, which runs in batches of 4)
    and 2 in the Python Request's, 4 steps each."""
    with open(path, "w") as f:
        for i in range(N_JOBS - 2):
            sweep = i >= 30
            f.write(json.dumps({"id": f"job-{i:02d}", "prompt": PROMPTS[0 if sweep else i % 4], "steps": 4,
                                "seed": 1000 + i, "cfg_scale": 7,
                                "sampler_name": "Euler a" if i % 3 == 0 and not sweep else "DPM++ 2M"}) + "\n")
        f.write("\n# a comment line, and two jobs in the Python Request's fields without ids\n")
        f.write(json.dumps({"prompt": PROMPTS[0], "steps": 4, "seed": 7, "sampler": "dpmpp_2m_karras"}) + "\n")
        f.write(json.dumps({"prompt": PROMPTS[1], "steps": 4, "seed": 8, "schedule": "karras",
                            "sampler": "euler"}) + "\n")
    return path


def manifest(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]


def check_complete(folder: Path, jobs: list) -> dict[str, str]:
    """Every job once in the manifest, each file there with the recorded hash and seed; returns id -> sha256."""
    entries = manifest(folder)
    ids = [e["id"] for e in entries]
    assert len(ids) == len(set(ids)), "duplicates in the manifest"
    assert sorted(ids) == sorted(j.id for j in jobs)
    for e in entries:
        data = (folder / e["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
        assert str(parse_infotext(Image.open(folder / e["file"]).info["parameters"])["Seed"]) == str(e["seed"])
        assert e["timings"]["total"] > 0 and e["timings"]["sampling"] > 0
    return {e["id"]: e["sha256"] for e in entries}


@pytest.fixture(scope="module")
def jobs_file(tmp_path_factory) -> Path:
    return write_jobs(tmp_path_factory.mktemp("jobs") / "jobs.jsonl")


@pytest.fixture(scope="module")
def local_run(jobs_file, tmp_path_factory):
    """The reference: `sdlite batch` without --ray, in this process, on 1 thread (as each Ray worker runs)."""
    out = tmp_path_factory.mktemp("local")
    threads = torch.get_num_threads()
    try:
        assert cli.main(["batch", str(jobs_file), "--output", str(out), "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    return out, check_complete(out, read_jobs(jobs_file))


@pytest.fixture(scope="module")
def local_ray():
    loopback_only()   # every Ray address on 127.0.0.1, no usage reports: nothing leaves this machine
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_local_run_writes_images_and_a_complete_manifest(jobs_file, local_run):
    out, hashes = local_run
    assert len(hashes) == N_JOBS
    by_id = {e["id"]: e for e in manifest(out)}
    assert by_id["job-00"]["file"] == "job-00.png" and by_id["job-00"]["seed"] == 1000
    text = Image.open(out / "job-03.png").info["parameters"]
    assert "Sampler: Euler a" in text and "Steps: 4" in text and text.startswith(PROMPTS[3])
    # the lines in the Request's vocabulary got line-number ids and that vocabulary's sampler
    assert "Sampler: DPM++ 2M, Schedule type: Karras" in Image.open(out / f"{by_id['00041']['file']}").info["parameters"]
    assert by_id["00042"]["seed"] == 8
    # the seed sweep ran in 2 batches of 4, the other jobs alone
    assert [by_id[f"job-{i:02d}"]["timings"].get("batch", 1) for i in range(28, 38)] == [1, 1] + [4] * 8
    # re-running skips everything
    summary = run_batch(jobs_file, out, threads=1, progress=False)
    assert (summary.skipped, summary.done) == (N_JOBS, 0) and len(manifest(out)) == N_JOBS


def test_batched_jobs_match_jobs_run_alone(jobs_file, local_run, tmp_path):
    sweep = tmp_path / "sweep.jsonl"
    sweep.write_text("".join(line for line in jobs_file.read_text().splitlines(keepends=True)
                             if '"job-3' in line))
    summary = run_batch(sweep, tmp_path / "alone", threads=1, progress=False, max_batch=1)
    assert summary.done == 8 and all("batch" not in e["timings"] for e in manifest(tmp_path / "alone"))
    # a batched image may differ from the same image made alone by float summation order: at most one level in a
    # few values; its parameters are the same
    out = local_run[0]
    for e in manifest(tmp_path / "alone"):
        a, b = Image.open(tmp_path / "alone" / e["file"]), Image.open(out / e["file"])
        assert a.info["parameters"] == b.info["parameters"]
        diff = np.abs(np.asarray(a.convert("RGB"), dtype=np.int16) - np.asarray(b.convert("RGB"), dtype=np.int16))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (e["id"], diff.max(), (diff > 0).sum())


@pytest.mark.parametrize("line, words", [
    ('{"prompt": "x", "stepz": 4}', ["line 1", "unknown field stepz"]),
    ('{"prompt": "x", "sampler": "euler", "sampler_name": "Euler"}', ["line 1", "mixes", "sampler_name", "sampler"]),
    ('{"prompt": "x", "steps": "many"}', ["line 1", "steps"]),
    ('{"prompt": "x", "width": 65}', ["line 1", "width"]),
    ('{"prompt": "x", "sampler_name": "Nope"}', ["line 1", "sampler 'Nope' is not known"]),
    ('{"prompt": "x", "id": "../up"}', ["line 1", "id '../up' is not valid"]),
    ('{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a"}', ["line 2", "already used on line 1"]),
    ('{"prompt": "x"', ["line 1", "not valid JSON"]),
    ('["x"]', ["line 1", "expected a JSON object"]),
    ('{"prompt": "x", "refiner_checkpoint": "sdxl-refiner"}', ["line 1", "refiner_checkpoint is not supported"]),
])
def test_bad_jobs_are_refused_naming_the_line_and_field(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(BatchError) as e:
        read_jobs(path)
    for word in words:
        assert word in str(e.value), str(e.value)
    assert cli.main(["batch", str(path), "--output", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out" / "manifest.jsonl").exists()


def test_local_run_stopped_with_ctrl_c_resumes_without_duplicates(jobs_file, local_run, tmp_path):
    done = []

    def stop_after_5(entry):
        done.append(entry["id"])
        if len(done) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch(jobs_file, tmp_path, threads=1, progress=False, on_result=stop_after_5)
    assert len(manifest(tmp_path)) == 5
    with open(tmp_path / "manifest.jsonl", "a") as f:   # a crash while writing a line: cut short
        f.write('{"id": "job-3')
    summary = run_batch(jobs_file, tmp_path, threads=1, progress=False)
    assert (summary.skipped, summary.done) == (5, N_JOBS - 5)
    assert check_complete(tmp_path, read_jobs(jobs_file)) == local_run[1]


def test_ray_batch_with_2_workers_equals_the_local_run(jobs_file, local_run, local_ray, tmp_path):
    summary = run_batch(jobs_file, tmp_path, use_ray=True, workers=2, threads=1, progress=False)
    assert (summary.done, summary.failed, summary.workers) == (N_JOBS, {}, 2)
    assert check_complete(tmp_path, read_jobs(jobs_file)) == local_run[1]   # byte for byte, image for image
    assert len({e["worker"] for e in manifest(tmp_path)}) == 2


def test_killed_worker_then_rerun_finishes_without_duplicates(jobs_file, local_run, local_ray, tmp_path):
    seen = []

    def kill_then_stop(entry):
        seen.append(entry)
        if len(seen) == 4:      # a worker dies mid-batch: its jobs in flight go to its replacement
            ray.kill(ray.get_actor("sdlite-batch-killtest-w0", namespace="sdlite"), no_restart=True)
        if len(seen) == 20:     # then the driver is stopped (Ctrl-C)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch(jobs_file, tmp_path, use_ray=True, workers=2, threads=1, progress=False, run_id="killtest",
                  on_result=kill_then_stop)
    first = manifest(tmp_path)
    assert len(first) == 20
    after_kill = {e["worker"] for e in first[4:]}
    assert "sdlite-batch-killtest-w0" not in {e["worker"] for e in first[6:]} and after_kill, after_kill
    summary = run_batch(jobs_file, tmp_path, use_ray=True, workers=2, threads=1, progress=False, run_id="resume")
    assert (summary.skipped, summary.done, summary.failed) == (20, N_JOBS - 20, {})
    assert check_complete(tmp_path, read_jobs(jobs_file)) == local_run[1]


# --- shutdown on signals (issue 23) ---------------------------------------------------------------------------------

SIGNAL_JOBS = 20
STARTUP_S = 120      # a subprocess loading torch and the model, or starting Ray, on a loaded machine: a bound, not a wait
EXIT_S = 5           # after the grace: the time the process may take to exit (Ray's own shutdown: more)
RAY_EXIT_S = 30


def write_signal_jobs(path: Path) -> Path:
    """20 jobs of 16 steps (about 0.1 s each on one thread), no seed sweep: several seconds of work in all."""
    with open(path, "w") as f:
        for i in range(SIGNAL_JOBS):
            f.write(json.dumps({"id": f"sig-{i:02d}", "prompt": PROMPTS[i % 4], "steps": 16, "seed": 500 + 2 * i,
                                "cfg_scale": 7, "sampler_name": "Euler a" if i % 2 else "DPM++ 2M"}) + "\n")
    return path


def write_long_jobs(path: Path, order=("short", "long", "after"), steps: int = 1000) -> Path:
    """Short jobs (4 steps) and a long one (1000 steps at 256x256: about 15 s on one thread here, far past any wait
    of these tests; fewer steps for one that should finish), in the order given."""
    with open(path, "w") as f:
        for seed, name in enumerate(order, 1):
            size = {"steps": steps, "width": 256, "height": 256} if name == "long" else {"steps": 4}
            f.write(json.dumps({"id": name, "prompt": PROMPTS[seed % 4], "seed": seed, **size}) + "\n")
    return path


class Batch:
    """``python -m sdlite batch`` in a subprocess, its stderr in a file."""

    def __init__(self, jobs: Path, out: Path, *extra: str):
        self.out, self.log = out, out.parent / f"{out.name}.log"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "sdlite", "batch", str(jobs), "--output", str(out),
                                          "--threads", "1", "--max-batch", "1", *extra],
                                         stdout=subprocess.DEVNULL, stderr=log, env=env)

    def lines(self) -> int:
        path = self.out / "manifest.jsonl"
        return path.read_bytes().count(b"\n") if path.is_file() else 0

    def stderr(self) -> str:
        return self.log.read_text()

    def signal_when(self, predicate, sig=signal.SIGTERM, after: float = 0.0) -> float:
        """Send ``sig`` ``after`` s after ``predicate()`` holds (while the process runs); the time it was sent."""
        wait_for(lambda: predicate() or self.proc.poll() is not None, timeout=STARTUP_S, every=0.02)
        time.sleep(after)
        assert self.proc.poll() is None, f"exited before the signal:\n{self.stderr()}"
        self.proc.send_signal(sig)
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running {timeout:.0f} s after the signal:\n{self.stderr()}") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def check_stopped(folder: Path) -> dict[str, str]:
    """After a stop: only complete manifest lines, each file there with its hash, no temporary file left."""
    data = (folder / "manifest.jsonl").read_bytes()
    assert data.endswith(b"\n")
    entries = [json.loads(line) for line in data.splitlines()]
    for e in entries:
        assert hashlib.sha256((folder / e["file"]).read_bytes()).hexdigest() == e["sha256"]
    pngs = {p.name for p in folder.iterdir() if p.suffix == ".png"}
    assert pngs == {e["file"] for e in entries}, "an image without its manifest line"
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    return {e["id"]: e["sha256"] for e in entries}


@pytest.fixture(scope="module")
def signal_jobs(tmp_path_factory) -> Path:
    return write_signal_jobs(tmp_path_factory.mktemp("signal-jobs") / "jobs.jsonl")


@pytest.fixture(scope="module")
def signal_reference(signal_jobs, tmp_path_factory) -> dict[str, str]:
    """An uninterrupted run of the signal jobs, in this process, 1 thread, no batching: id -> sha256."""
    out = tmp_path_factory.mktemp("signal-reference")
    threads = torch.get_num_threads()
    try:
        summary = run_batch(signal_jobs, out, threads=1, progress=False, max_batch=1)
    finally:
        torch.set_num_threads(threads)
    assert summary.done == SIGNAL_JOBS
    return check_complete(out, read_jobs(signal_jobs))


def test_sigterm_stops_a_local_batch_and_the_same_command_resumes_it(signal_jobs, signal_reference, tmp_path):
    grace = 30
    out = tmp_path / "out"
    with Batch(signal_jobs, out, "--shutdown-grace", str(grace)) as run:
        run.signal_when(lambda: run.lines() >= 1)
        assert run.wait(grace + EXIT_S) == 0, run.stderr()
    first = check_stopped(out)
    assert 1 <= len(first) < SIGNAL_JOBS
    text = run.stderr()
    assert "sdlite: stopped by SIGTERM" in text and "run the same command again" in text, text
    assert "interrupted after the grace" not in text, text    # the running job (0.1 s) finished within 30 s
    with Batch(signal_jobs, out) as again:
        assert again.wait(STARTUP_S) == 0, again.stderr()
    assert f"{SIGNAL_JOBS - len(first)} done now" in again.stderr() and \
        f"{len(first)} already in the manifest" in again.stderr(), again.stderr()
    assert check_complete(out, read_jobs(signal_jobs)) == signal_reference   # byte for byte, job for job


def test_past_the_grace_the_running_job_is_interrupted_and_not_written(tmp_path):
    out = tmp_path / "out"
    with Batch(write_long_jobs(tmp_path / "jobs.jsonl"), out, "--shutdown-grace", "0") as run:
        sent = run.signal_when(lambda: run.lines() >= 1, after=1.0)     # "long" is running by then
        assert run.wait(0 + EXIT_S) == 0, run.stderr()
        elapsed = time.monotonic() - sent
    assert list(check_stopped(out)) == ["short"]          # "long" stopped at its next step, "after" never started
    assert not (out / "long.png").exists()
    assert "1 interrupted after the grace and not written" in run.stderr(), run.stderr()
    assert elapsed < EXIT_S


def test_a_second_signal_exits_at_once(tmp_path):
    out = tmp_path / "out"
    with Batch(write_long_jobs(tmp_path / "jobs.jsonl"), out, "--shutdown-grace", "60") as run:
        run.signal_when(lambda: run.lines() >= 1, after=1.0)     # "long" is running by then
        sent = run.signal_when(lambda: "SIGTERM: stopping" in run.stderr(), signal.SIGINT)
        assert run.wait(EXIT_S) == 0, run.stderr()      # not the 60 s grace, nor the rest of the 15 s job
        elapsed = time.monotonic() - sent
    assert list(check_stopped(out)) == ["short"]
    assert "SIGINT again: exiting at once" in run.stderr(), run.stderr()
    assert elapsed < EXIT_S


def test_the_running_job_finishes_within_the_grace_and_nothing_new_starts(tmp_path):
    """In this process (the handlers are installed in the main thread, and restored after): SIGTERM to itself half a
    second after the first job is written; the second (200 steps at 256x256, about 3 s) finishes, the third never
    starts."""
    jobs = write_long_jobs(tmp_path / "jobs.jsonl", steps=200)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    during = []

    def stop(entry):
        during.append(signal.getsignal(signal.SIGTERM))
        if entry["id"] == "short":
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()

    threads = torch.get_num_threads()
    try:
        summary = run_batch(jobs, tmp_path / "out", threads=1, progress=False, on_result=stop, shutdown_grace=60)
    finally:
        torch.set_num_threads(threads)
    assert (summary.stopped, summary.done, summary.interrupted, summary.remaining) == ("SIGTERM", 2, 0, 1)
    assert list(check_stopped(tmp_path / "out")) == ["short", "long"]
    assert during[0] not in before
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_no_handlers_outside_the_main_thread_and_a_negative_grace_is_refused(tmp_path, capsys):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"prompt": PROMPTS[0], "steps": 2, "seed": 1}) + "\n")
    before = signal.getsignal(signal.SIGTERM)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(run_batch(
        jobs, tmp_path / "out", threads=1, progress=False, on_result=lambda e: seen.append(signal.getsignal(
            signal.SIGTERM)))))
    threads = torch.get_num_threads()
    try:
        worker.start()
        worker.join(STARTUP_S)
    finally:
        torch.set_num_threads(threads)
    assert seen[0] is before and seen[1].done == 1
    assert cli.main(["batch", str(jobs), "--output", str(tmp_path / "out2"), "--shutdown-grace", "-1"]) == 2
    assert "--shutdown-grace -1 is not valid" in capsys.readouterr().err and not (tmp_path / "out2").exists()


def test_sigterm_stops_a_ray_batch_and_it_resumes(signal_jobs, signal_reference, local_ray, tmp_path):
    """`sdlite batch --ray` with a Ray instance of its own (which sets its own SIGTERM handler, replaced), then the
    rest in this process's Ray instance."""
    grace = 30
    out = tmp_path / "out"
    with Batch(signal_jobs, out, "--ray", "--workers", "2", "--shutdown-grace", str(grace)) as run:
        run.signal_when(lambda: run.lines() >= 1)
        assert run.wait(grace + RAY_EXIT_S) == 0, run.stderr()
    first = check_stopped(out)
    assert 1 <= len(first) < SIGNAL_JOBS and "sdlite: stopped by SIGTERM" in run.stderr(), run.stderr()
    summary = run_batch(signal_jobs, out, use_ray=True, workers=2, threads=1, progress=False, max_batch=1)
    assert (summary.skipped, summary.done, summary.failed) == (len(first), SIGNAL_JOBS - len(first), {})
    assert check_complete(out, read_jobs(signal_jobs)) == signal_reference


def test_past_the_grace_ray_actors_are_killed_and_their_jobs_not_written(local_ray, tmp_path):
    """Worker 0 gets "long" and "queued" (sent ahead), worker 1 "short": SIGTERM as "short" is written; "queued" is
    cancelled, "long" is still running 1 s later and its actor is killed."""
    jobs = write_long_jobs(tmp_path / "jobs.jsonl", order=("long", "queued", "short"))
    start = []

    def stop(entry):
        if entry["id"] == "short":
            start.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)

    summary = run_batch(jobs, tmp_path / "out", use_ray=True, workers=2, threads=1, progress=False, on_result=stop,
                        shutdown_grace=1, run_id="gracetest")
    elapsed = time.monotonic() - start[0]
    assert (summary.stopped, summary.done, summary.interrupted, summary.remaining) == ("SIGTERM", 1, 1, 2)
    assert list(check_stopped(tmp_path / "out")) == ["short"]
    assert elapsed < 1 + EXIT_S     # not the 15 s of the long job


def test_hires_jobs_in_both_vocabularies(tmp_path):
    """A1111's enable_hr / hr_* fields and the Request vocabulary's ``hires`` both run the hires fix in a batch."""
    jobs = tmp_path / "hires.jsonl"
    jobs.write_text("\n".join(json.dumps(j) for j in (
        {"id": "a1111", "prompt": "a red circle on a blue background", "steps": 4, "seed": 1, "enable_hr": True,
         "hr_scale": 2, "hr_upscaler": "Lanczos", "denoising_strength": 0.5},
        {"id": "ours", "prompt": "a red circle on a blue background", "steps": 4, "seed": 1,
         "hires": {"scale": 1.5, "upscaler": "Latent", "denoise": 0.5}},
        {"id": "hr-model", "prompt": "x", "steps": 4, "enable_hr": True, "hr_checkpoint_name": "other"})) + "\n")
    with pytest.raises(BatchError, match="hr_checkpoint_name is not supported in a batch"):
        run_batch(jobs, tmp_path / "out", threads=1, progress=False)
    jobs.write_text("\n".join(jobs.read_text().splitlines()[:2]) + "\n")
    summary = run_batch(jobs, tmp_path / "out", threads=1, progress=False)
    assert summary.done == 2
    a = Image.open(tmp_path / "out" / "a1111.png")
    b = Image.open(tmp_path / "out" / "ours.png")
    assert a.size == (128, 128) and b.size == (96, 96)
    assert "Hires upscaler: Lanczos" in a.info["parameters"] and "Hires upscale: 1.5" in b.info["parameters"]


def test_controlnet_units_in_both_vocabularies(tmp_path, local_ray):
    """A1111's alwayson_scripts units (a model by --controlnet-dir name, a base64 image) and the Request vocabulary's
    controls (a model path, an image path) give the engine's image for the same ControlUnit, locally and over Ray;
    bad units are refused naming the line and the unit."""
    import base64
    import io

    from sdlite.control import ControlUnit
    from sdlite.demo import model_path
    from sdlite.pipeline import Engine, Request
    from tests import demo_controlnet as D

    models = D.write(tmp_path / "controlnets")
    image = D.shape_image()
    image.save(tmp_path / "control.png")
    data = io.BytesIO()
    image.save(data, format="PNG")
    unit = {"enabled": True, "module": "canny", "model": "demo-control", "weight": 0.9,
            "image": base64.b64encode(data.getvalue()).decode("ascii"), "control_mode": 1}
    prompt = "a red circle on a blue background"
    jobs = tmp_path / "control.jsonl"
    jobs.write_text("\n".join(json.dumps(j) for j in (
        {"id": "a1111", "prompt": prompt, "steps": 4, "seed": 5, "cfg_scale": 7,
         "alwayson_scripts": {"ControlNet": {"args": [unit]}}},
        {"id": "ours", "prompt": prompt, "steps": 4, "seed": 5, "sampler": "euler", "cfg_scale": 7,
         "controls": [{"model": str(models["demo-control"]), "image": str(tmp_path / "control.png"),
                       "preprocessor": "canny", "weight": 0.9, "mode": "prompt"}]},
        {"id": "named", "prompt": prompt, "steps": 4, "seed": 5, "sampler": "euler",
         "controls": [{"model": "control_demo_edges", "image": str(tmp_path / "control.png")}]})) + "\n")
    folder = str(tmp_path / "controlnets")
    summary = run_batch(jobs, tmp_path / "out", threads=1, progress=False, controlnet_dir=folder)
    assert summary.done == 3, summary.failed
    expected = Engine.load(model_path()).generate(Request(prompt, steps=4, seed=5, cfg_scale=7, sampler="euler",
                                                          controls=(ControlUnit(model=str(models["demo-control"]),
                                                                                image=image, preprocessor="canny",
                                                                                weight=0.9, mode="prompt"),)))
    want = np.asarray(expected.images[0].convert("RGB"))
    for name in ("a1111", "ours"):
        got = Image.open(tmp_path / "out" / f"{name}.png")
        assert np.array_equal(np.asarray(got.convert("RGB")), want), name
        assert 'ControlNet 0: "Module: canny, Model: demo-control [' in got.info["parameters"]
    assert "Model: control_demo_edges [" in Image.open(tmp_path / "out" / "named.png").info["parameters"]
    # over Ray: the same files, byte for byte
    summary = run_batch(jobs, tmp_path / "ray", use_ray=True, workers=1, threads=1, progress=False,
                        controlnet_dir=folder, run_id="controltest")
    assert summary.done == 3, summary.failed
    for name in ("a1111", "ours", "named"):
        assert (tmp_path / "ray" / f"{name}.png").read_bytes() == (tmp_path / "out" / f"{name}.png").read_bytes()
    # the command line's --controlnet-dir: the same files
    from sdlite import cli

    assert cli.main(["batch", str(jobs), "--output", str(tmp_path / "cli"), "--threads", "1",
                     "--controlnet-dir", folder]) == 0
    for name in ("a1111", "ours", "named"):
        assert (tmp_path / "cli" / f"{name}.png").read_bytes() == (tmp_path / "out" / f"{name}.png").read_bytes()

    for job, words in (
            ({"prompt": "x", "alwayson_scripts": {"controlnet": {"args": [{**unit, "model": "depth"}]}}},
             ["line 1", "alwayson_scripts.controlnet.args[0]", "'depth' not found", "demo-control ["]),
            ({"prompt": "x", "alwayson_scripts": {"controlnet": {"args": [{**unit, "weight": 5}]}}},
             ["line 1", "args[0]", "weight=5"]),
            ({"prompt": "x", "sampler": "euler", "controls": [{"model": "demo-control", "image": "missing.png"}]},
             ["line 1", "controls[0]", "'missing.png': no such file"]),
            ({"prompt": "x", "sampler": "euler", "controls": [{"model": "demo-control", "imag": "x.png"}]},
             ["line 1", "controls[0]", "imag"]),
            ({"prompt": "x", "sampler": "euler", "controls": [{"model": "nope", "image": str(tmp_path / "control.png")}]},
             ["line 1", "controls[0]", "'nope' not found"])):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(job) + "\n")
        with pytest.raises(BatchError) as e:
            read_jobs(bad, controlnet_dir=folder)
        for word in words:
            assert word in str(e.value), str(e.value)
