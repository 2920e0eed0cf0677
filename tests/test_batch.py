"""`sdlite batch`: bulk generation from a JSONL file, locally and over Ray actors (a local Ray instance: 2 CPUs,
loopback only), with the demo model.

Checks: the local run writes every image with its parameters and a complete manifest; bad job files are refused
naming the line and the field; a run stopped part-way (Ctrl-C) resumes without duplicates; 40 jobs over 2 Ray
workers give the local run's images byte for byte; a worker killed mid-batch (plus the driver stopped) loses
nothing: re-running finishes the remaining jobs, with no duplicates in the manifest.
"""
from __future__ import annotations

import hashlib
import json
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
