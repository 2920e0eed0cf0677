"""``sdlite batch JOBS.jsonl --output DIR [--ray [--address A] [--workers N]]``: bulk generation from a JSONL file.

Each line of ``JOBS.jsonl`` is one job, a JSON object with either vocabulary:

* the API's txt2img fields (``/sdapi/v1/txt2img``, A1111's names and defaults: ``sampler_name``, ``n_iter``,
  ``scheduler``, ``override_settings`` ...), or
* the Python :class:`~sdlite.pipeline.Request`'s fields (``sampler``, ``schedule``, ``clip_skip``, ``loras`` ...,
  with its defaults: those of ``sdlite generate``),

plus an optional ``"id"`` (letters, digits, ``.``, ``_``, ``-``; default: the line number, ``00007``). Steps, cfg
and sampler a line leaves out are the model's own where its family has settings of its own (FLUX.1's, SD3's and
Z-Image's model cards), as ``sdlite generate`` and the servers fill them (:func:`family_requests`). A line with
only the fields both share (``prompt``, ``seed``, ``steps``, ``cfg_scale``, ``width`` ...) is read as txt2img; a
line that mixes the two vocabularies is refused, naming the fields. Every line is checked before anything runs.
ControlNet units come in either vocabulary: A1111's ``alwayson_scripts`` ``{"controlnet": {"args": [unit, ...]}}``
(the extension's fields, base64 images; :mod:`sdlite.server.a1111.controlnet`) or the Request's ``controls``, a list of
:class:`~sdlite.control.ControlUnit` field objects (image and mask paths). A unit's model is a path or a name of
``controlnet_dir`` (:func:`run_batch`).

Images are written to ``DIR/<id>.png`` (``<id>-<k>.png`` when a job makes several), each with its ``parameters``
chunk, and ``DIR/manifest.jsonl`` gets one line per finished job (``id``, ``seed``, ``file``, ``sha256``,
``timings``; ``images`` lists every image of a job that made several). Only this process writes them, after each
job, so a crash, a killed worker or Ctrl-C loses at most the jobs in flight; running the same command again skips
the jobs already in the manifest.

Locally the jobs run one after another in this process. With Ray they run over a pool of actors, each of which
loads the model once and takes jobs in the order they come; results come back to this process, which writes them
(workers need no shared filesystem for outputs).

Jobs that differ only in their seed, and whose seeds follow one another (``seed``, ``seed + 1`` ...: a seed sweep),
are run together as one batch of up to ``max_batch`` images (one engine call; each image still has its own noise
generator, so its seed gives it; a batched image can differ from the same image made alone by one level in a few
pixel values, float sums being taken in another order). That is faster where per-call costs dominate (2.5x for the
demo model, bench/scale.py). The groups are made from the whole file, before the manifest is read, so the local run,
the Ray run and a resumed run batch the same jobs and give the same images, byte for byte; ``max_batch=1`` turns
batching off.

SIGTERM or SIGINT (Ctrl-C) stops a run cleanly (:class:`Shutdown`): no new job starts, the running ones get
``shutdown_grace`` seconds (``--shutdown-grace``, default 30) to finish and be written, then they are interrupted
(locally at the engine's next sampler step; with Ray the actors are killed) and not written, so that running the
same command again runs them anew and gives the images an uninterrupted run gives. The run then returns (``sdlite
batch`` exits 0). A second SIGTERM or SIGINT exits at once.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import re
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

from ..errors import SDLiteError

MANIFEST = "manifest.jsonl"
ID_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
NAMESPACE = "sdlite"


class BatchError(SDLiteError):
    """A jobs file, output folder or batch run that cannot go on; the message names the line and field."""


class JobInterrupted(Exception):
    """A job's sampling was stopped part-way (a shutdown's grace ran out): its images are not the job's, so they are
    not written."""


class Shutdown:
    """SIGTERM and SIGINT during a run. The first one asks the run to stop: no new job starts, and after ``grace``
    seconds :meth:`step` (the engine's step callback) stops the running job's sampling. A second one exits the process
    at once (status 0, as ``sdlite serve`` does): the manifest is append-only and fsync'd, a cut last line is dropped
    on the next run, and images are written under a temporary name and then renamed, so nothing half-written counts.

    Handlers are installed only in the main thread (:func:`run_batch` also runs from other threads, as a library
    call); :meth:`restore` puts back the ones found. :meth:`request` asks for a stop without a signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace: float):
        self.grace = grace
        self.signal: str | None = None        # the name of the signal that asked for the stop
        self.deadline: float | None = None    # time.monotonic() past which running jobs are interrupted
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic()) if self.deadline is not None else float("inf")

    def request(self, name: str = "stop") -> None:
        if self.signal is None:
            self.signal, self.deadline = name, time.monotonic() + self.grace

    def step(self, step: int, total: int) -> None:
        """The engine's step callback: past the grace, stop sampling (the job is then not written)."""
        if self.expired():
            from ..pipeline import StopSampling

            raise StopSampling

    def install(self) -> None:
        """Handle SIGTERM and SIGINT (again after ``ray.init``, which sets its own SIGTERM handler)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            self._previous.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        # os.write, not print: the handler may run while the main thread is inside a write to stderr
        if self.requested:
            os.write(2, f"\nsdlite: {name} again: exiting at once; the jobs not in the manifest run when the same "
                        "command is run again\n".encode())
            os._exit(0)
        self.request(name)
        if self.grace > 0:
            then = (f"the running jobs get up to {self.grace:g} s to finish, then they are interrupted and not "
                    "written")
        else:
            then = "the running jobs are interrupted and not written"
        os.write(2, f"\nsdlite: {name}: stopping: no new job starts; {then} (send SIGTERM or Ctrl-C again to exit "
                    "at once)\n".encode())


@dataclass
class Job:
    id: str
    line: int
    kind: str                  # "txt2img" (the API's fields) or "request" (the Python Request's)
    requests: list             # sdlite Requests, one per iteration (A1111's n_iter)
    # the sampling fields the line leaves out (A1111's names: steps, cfg_scale, sampler_name): the model family's own
    # settings where it has them (FLUX.1's, SD3's, Z-Image's), filled in when the job runs (:func:`family_requests`)
    unset: tuple = ()
    scheduler: str | None = None   # the API line's scheduler, which a family's sampler takes (txt2img)


# a Request-vocabulary line's fields -> the A1111 names of the sampling fields a model family may set
_REQUEST_FIELDS = {"steps": "steps", "cfg_scale": "cfg_scale", "sampler": "sampler_name"}


def family_requests(job: Job, defaults: dict | None) -> list:
    """``job``'s requests with the sampling fields its line leaves out set to the model family's own settings
    ``defaults`` (:attr:`Family.sampling_defaults <sdlite.families.base.Family.sampling_defaults>`; None: the family
    has none, and the vocabulary's defaults stay), as ``sdlite generate`` and the servers fill them. A sampler left
    out is the family's: with an API line's scheduler as the server resolves it, with a Request line's schedule as
    given."""
    if not defaults or not job.unset:
        return job.requests
    from ..server.a1111.api import resolve_sampler_a1111

    changes = {}
    if "steps" in job.unset:
        changes["steps"] = int(defaults["steps"])
    if "cfg_scale" in job.unset:
        changes["cfg_scale"] = float(defaults["cfg"])
    if "sampler_name" in job.unset:
        if job.kind == "txt2img":
            choice = resolve_sampler_a1111(defaults["sampler"], job.scheduler, [])
            changes.update(sampler=choice.sampler, schedule=choice.schedule)
        else:
            changes["sampler"] = defaults["sampler"]
    return [r.replace(**changes) for r in job.requests]


# --- reading the jobs ---------------------------------------------------------------------------------------------

def _vocabularies():
    from ..pipeline import Request
    from ..server.a1111.api import Txt2ImgRequest

    request_fields = {f.name for f in fields(Request)}
    api_fields = set(Txt2ImgRequest.model_fields)
    return request_fields, api_fields


def _parse_line(obj: dict, where: str, options: dict) -> tuple[str, list, tuple, str | None]:
    from pydantic import ValidationError

    from ..pipeline import MAX_SEED, Request, RequestError, validate
    from ..server.a1111 import api as a1111

    request_fields, api_fields = _vocabularies()
    keys = set(obj)
    unknown = sorted(keys - request_fields - api_fields)
    if unknown:
        raise BatchError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; a job takes "
                         "the API's txt2img fields or the Python Request's (see docs/scaling.md)")
    api_only, request_only = sorted(keys - request_fields), sorted(keys - api_fields)
    if api_only and request_only:
        raise BatchError(f"{where}: mixes the API's txt2img fields ({', '.join(api_only)}) with the Python "
                         f"Request's ({', '.join(request_only)}); use one or the other")
    if request_only:
        values = dict(obj)
        for name in ("loras", "outpaint"):
            if isinstance(values.get(name), list):
                values[name] = tuple(tuple(v) if isinstance(v, list) else v for v in values[name])
        if values.get("seed", -1) == -1:
            values["seed"] = random.SystemRandom().randrange(0, MAX_SEED)
        values.setdefault("lora_dir", options.get("lora_dir"))
        values.setdefault("embeddings_dir", options.get("embeddings_dir"))
        try:
            if "controls" in values:   # ControlNet units: sdlite.control.ControlUnit's fields
                values["controls"] = _control_units(values["controls"], where, options)
            if isinstance(values.get("hires"), dict):   # the hires fix: sdlite.hires.Hires's fields
                from ..hires import Hires

                values["hires"] = Hires(**values["hires"])
            request = Request(**values)
            validate(request)
        except (RequestError, TypeError) as e:
            raise BatchError(f"{where}: {e}") from None
        given = set(keys) | ({"steps"} if values.get("timesteps") is not None or values.get("sigmas") is not None
                             else set())
        return "request", [request], tuple(a for name, a in _REQUEST_FIELDS.items() if name not in given), None
    if "init_images" in keys or "mask" in keys:
        raise BatchError(f"{where}: batch jobs are txt2img (init_images is an img2img field)")
    try:
        req = a1111.Txt2ImgRequest.model_validate(obj)
        plan = a1111.build_plan(req, a1111.default_options(), max_image_bytes=64 << 20,
                                lora_dir=options.get("lora_dir"), embeddings_dir=options.get("embeddings_dir"),
                                controlnets=_controlnets(options))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise BatchError(f"{where}: {problems}") from None
    except SDLiteError as e:
        raise BatchError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - FastAPI's HTTPException (an unknown script)
        raise BatchError(f"{where}: {getattr(e, 'detail', e)}") from None
    if plan.checkpoint is not None:
        raise BatchError(f"{where}: override_settings sd_model_checkpoint is not supported in a batch: one model "
                         "(--model) runs every job")
    if plan.hr_checkpoint_name is not None:
        raise BatchError(f"{where}: hr_checkpoint_name is not supported in a batch: one model (--model) runs every "
                         "job")
    if plan.refiner_name is not None:
        raise BatchError(f"{where}: refiner_checkpoint is not supported in a batch yet: one model (--model) runs "
                         "every job; use sdlite generate --refiner or the server for a base-to-refiner hand-off")
    return "txt2img", plan.requests, plan.unset, plan.parameters.get("scheduler")


def _controlnets(options: dict):
    """The ControlNet models jobs name (``controlnet_dir``; a path names one too: the job file is the user's own),
    read once for the file."""
    from ..server.a1111.controlnet import ControlNets

    if options.get("controlnets") is None:
        options["controlnets"] = ControlNets(options.get("controlnet_dir"), allow_paths=True)
    return options["controlnets"]


def _control_units(items, where: str, options: dict) -> tuple:
    """The Request vocabulary's ``controls``: a list of :class:`~sdlite.control.ControlUnit` field objects. ``model``
    is a path or a name of ``controlnet_dir``; ``image`` and ``mask`` are paths (checked now, so that a missing file
    stops the run before it starts)."""
    from ..control import ControlUnit
    from ..pipeline import RequestError

    if not isinstance(items, list):
        raise RequestError(f"controls: expected a list of ControlNet units, got {type(items).__name__}")
    units = []
    for i, item in enumerate(items):
        what = f"controls[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{what}: expected an object of ControlUnit's fields, got {type(item).__name__}")
        try:
            unit = ControlUnit(**item)
        except TypeError as e:
            raise RequestError(f"{what}: {e}") from None
        for name in ("image", "mask"):
            value = getattr(unit, name)
            if value is not None and not (isinstance(value, str) and Path(value).is_file()):
                raise RequestError(f"{what}: {name} {value!r}: no such file (a unit's image and mask are paths)")
        units.append(unit.replace(model=_controlnets(options).resolve(unit.model, what)))
    return tuple(units)


def read_jobs(path: str | os.PathLike, *, lora_dir=None, embeddings_dir=None, controlnet_dir=None) -> list[Job]:
    """Every job of ``path``, checked (a :class:`BatchError` names the first bad line). ``controlnet_dir``: where
    ControlNet units' models are found by name."""
    path = Path(path)
    if not path.is_file():
        raise BatchError(f"jobs file {path}: " + ("is a folder" if path.is_dir() else "no such file"))
    jobs, seen = [], {}
    options = {"lora_dir": lora_dir, "embeddings_dir": embeddings_dir, "controlnet_dir": controlnet_dir}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            text = text.strip()
            if not text or text.startswith("#"):
                continue
            where = f"{path.name} line {number}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise BatchError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise BatchError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            job_id = obj.pop("id", None)
            job_id = f"{number:05d}" if job_id is None else str(job_id)
            if not ID_PATTERN.match(job_id):
                raise BatchError(f"{where}: id {job_id!r} is not valid: 1 to 128 letters, digits, '.', '_' or '-', "
                                 "not starting with '.' or '-' (it names the image files)")
            if job_id in seen:
                raise BatchError(f"{where}: id {job_id!r} is already used on line {seen[job_id]}")
            seen[job_id] = number
            kind, requests, unset, scheduler = _parse_line(obj, f"{where} (id {job_id})", options)
            jobs.append(Job(job_id, number, kind, requests, unset, scheduler))
    if not jobs:
        raise BatchError(f"jobs file {path}: no jobs (one JSON object per line)")
    return jobs


def group_jobs(jobs: list[Job], max_batch: int) -> list[list[Job]]:
    """Consecutive jobs that differ only in consecutive seeds (one image each), in groups of up to ``max_batch``."""
    groups: list[list[Job]] = []
    for job in jobs:
        last = groups[-1] if groups else None
        if last is not None and len(last) < max_batch and _joins(last[-1], job):
            last.append(job)
        else:
            groups.append([job])
    return groups


def _joins(prev: Job, job: Job) -> bool:
    if len(prev.requests) != 1 or len(job.requests) != 1:
        return False
    a, b = prev.requests[0], job.requests[0]
    return (a.batch_size == b.batch_size == 1 and b.seed == a.seed + 1 and a.replace(seed=0) == b.replace(seed=0)
            and a.init_image is None and (prev.unset, prev.scheduler) == (job.unset, job.scheduler))


# --- the manifest ---------------------------------------------------------------------------------------------------

def read_manifest(path: Path) -> dict[str, dict]:
    """The jobs already done: id -> manifest entry. A last line cut short by a crash is dropped from the file."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    data = path.read_bytes()
    good = 0
    for raw in data.splitlines(keepends=True):
        try:
            entry = json.loads(raw)
            if not raw.endswith(b"\n") or not isinstance(entry, dict) or "id" not in entry:
                raise ValueError
        except ValueError:
            break
        done[str(entry["id"])] = entry
        good += len(raw)
    if good < len(data):
        print(f"sdlite: warning: {path}: dropped an incomplete last line (a run was stopped while writing it)",
              file=sys.stderr)
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


class Writer:
    """Writes each finished job's images and its manifest line (this process alone writes them)."""

    def __init__(self, output: Path):
        self.output = output
        self.manifest = output / MANIFEST
        self.written: set[str] = set()

    def write(self, job: Job, done: dict) -> dict:
        if job.id in self.written:        # a job run twice (a worker died after finishing it): keep the first
            return {}
        images = done["images"]
        entries = []
        for k, (seed, png) in enumerate(images):
            name = f"{job.id}.png" if len(images) == 1 else f"{job.id}-{k + 1}.png"
            target = self.output / name
            tmp = target.with_name(f".{name}.tmp")
            tmp.write_bytes(png)
            os.replace(tmp, target)
            entries.append({"seed": seed, "file": name, "sha256": hashlib.sha256(png).hexdigest()})
        entry = {"id": job.id, "seed": entries[0]["seed"], "file": entries[0]["file"], "sha256": entries[0]["sha256"],
                 "timings": done["timings"], "worker": done.get("worker", "local"), "line": job.line}
        if len(entries) > 1:
            entry["images"] = entries
        if done.get("warnings"):
            entry["warnings"] = done["warnings"]
        with open(self.manifest, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.written.add(job.id)
        return entry


# --- running one job (in this process or in an actor) ---------------------------------------------------------------

def run_job(engine, model_hash: str, model_name: str, job: Job, worker: str = "local", callback=None) -> dict:
    """Generate a job's images: {"images": [(seed, png bytes)], "timings", "warnings", "worker"}. ``callback`` is
    the engine's step callback; a run it stops raises :class:`JobInterrupted`."""
    from ..images import infotext, png_bytes

    t0 = time.perf_counter()
    images, timings, warnings = [], collections.Counter(), []
    for request in family_requests(job, engine.sampling_defaults_for(job.requests[0] if job.requests else None)):
        result = engine.generate(request, callback)
        if result.interrupted:
            raise JobInterrupted(job.id)
        for image, seed in zip(result.images, result.seeds):
            text = infotext(result.request, seed, model_hash, model_name, result.infotext)
            images.append((seed, png_bytes(image, text)))
        timings.update({k: v for k, v in result.timings.items() if isinstance(v, (int, float))})
        warnings += [w for w in result.warnings if w not in warnings]
    timings = {k: round(v, 4) for k, v in timings.items()}
    timings["total"] = round(time.perf_counter() - t0, 4)
    return {"images": images, "timings": timings, "warnings": warnings, "worker": worker}


def run_group(engine, model_hash: str, model_name: str, group: list[Job], worker: str = "local",
              callback=None) -> list[dict]:
    """A group of :func:`group_jobs` as one engine call (alone: :func:`run_job`); one result per job."""
    if len(group) == 1:
        return [run_job(engine, model_hash, model_name, group[0], worker, callback)]
    from ..images import infotext, png_bytes

    t0 = time.perf_counter()
    first = family_requests(group[0], engine.sampling_defaults_for(group[0].requests[0]))[0]
    result = engine.generate(first.replace(batch_size=len(group)), callback)
    if result.interrupted:
        raise JobInterrupted(", ".join(job.id for job in group))
    share = {k: round(v / len(group), 4) for k, v in result.timings.items() if isinstance(v, (int, float))}
    share["total"] = round((time.perf_counter() - t0) / len(group), 4)
    share["batch"] = len(group)
    out = []
    for image, seed in zip(result.images, result.seeds):
        text = infotext(result.request.replace(batch_size=1, seed=seed), seed, model_hash, model_name,
                        result.infotext)
        out.append({"images": [(seed, png_bytes(image, text))], "timings": share, "warnings": result.warnings,
                    "worker": worker})
    return out


def model_identity(model: str) -> tuple[str, str]:
    """(short hash, name) as the PNG parameters and the server name a model."""
    from ..images import model_hash

    path = Path(model)
    return model_hash(path), (path.stem if path.is_file() else path.name)


class BatchWorker:
    """A Ray actor: one engine, loaded once; jobs run in the order they are sent."""

    def __init__(self, model: str, engine_options: dict, threads: int | None, identity: tuple[str, str], name: str):
        import torch

        from ..pipeline import Engine

        if threads:
            torch.set_num_threads(threads)
        self.engine = Engine.load(model, **engine_options)
        self.identity, self.name = identity, name

    def ready(self) -> str:
        return self.name

    def run(self, group: list[Job]) -> list[dict]:
        return run_group(self.engine, *self.identity, group, worker=self.name)


# --- progress ---------------------------------------------------------------------------------------------------

class Progress:
    """Jobs done, images a minute and the ETA on one self-rewriting line of a terminal (silent otherwise)."""

    def __init__(self, total: int, stream=None, width: int = 28):
        self.stream = stream or sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total, self.width, self.done, self.images = total, width, 0, 0
        self.start = time.perf_counter()

    def update(self, images: int) -> None:
        self.done += 1
        self.images += images
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        filled = int(self.width * self.done / max(self.total, 1))
        self.stream.write(f"\rjobs {self.done:>5}/{self.total} [{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.images / elapsed * 60 if elapsed > 0 else 0:7.1f} img/min  ETA {eta:6.1f}s")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


# --- the runs -------------------------------------------------------------------------------------------------------

@dataclass
class Summary:
    total: int                         # jobs in the file
    skipped: int                       # already in the manifest
    done: int = 0                      # finished by this run
    images: int = 0
    failed: dict = field(default_factory=dict)   # id -> message
    seconds: float = 0.0
    workers: int = 1
    replaced_workers: int = 0
    stopped: str | None = None         # the signal that stopped the run early (SIGTERM, SIGINT), if one did
    interrupted: int = 0               # jobs running when the grace ran out: interrupted, not written

    @property
    def remaining(self) -> int:
        """Jobs neither in the manifest nor failed: a resumed run runs them."""
        return self.total - self.skipped - self.done - len(self.failed)

    @property
    def images_per_min(self) -> float:
        return self.images / self.seconds * 60 if self.seconds > 0 else 0.0


def run_batch(jobs_file, output, *, model=None, use_ray: bool = False, address: str | None = None,
              workers: int | None = None, threads: int | None = None, engine_options: dict | None = None,
              worker_cpus: float = 1.0, worker_gpus: float = 0.0, lora_dir=None, embeddings_dir=None,
              controlnet_dir=None,
              run_id: str | None = None, progress: bool = True, max_batch: int = 4,
              on_result: Callable[[dict], None] | None = None, shutdown_grace: float = 30.0) -> Summary:
    """Run the jobs of ``jobs_file`` not yet in ``output``'s manifest; see the module docstring. In the main thread,
    SIGTERM and SIGINT stop the run as :class:`Shutdown` says (``summary.stopped`` names the signal); the previous
    handlers are back when it returns."""
    jobs = read_jobs(jobs_file, lora_dir=lora_dir, embeddings_dir=embeddings_dir, controlnet_dir=controlnet_dir)
    if not shutdown_grace >= 0:   # NaN too
        raise BatchError(f"--shutdown-grace {shutdown_grace:g} is not valid: it must be 0 or more seconds "
                         "(0: interrupt the running job at once)")
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise BatchError(f"--output {output}: exists and is not a folder")
    output.mkdir(parents=True, exist_ok=True)
    if not os.access(output, os.W_OK):
        raise BatchError(f"--output {output}: not writable")
    if model is None:
        from ..demo import model_path

        model = str(model_path())
    elif not Path(model).exists():
        raise BatchError(f"--model {model}: no such file or folder")
    if workers is not None and workers < 1:
        raise BatchError(f"--workers {workers} is not valid: it must be at least 1")
    if threads is not None and threads < 1:
        raise BatchError(f"--threads {threads} is not valid: it must be at least 1")
    if max_batch < 1:
        raise BatchError(f"--max-batch {max_batch} is not valid: it must be at least 1 (1: no batching)")
    done = read_manifest(output / MANIFEST)
    pending = [j for j in jobs if j.id not in done]
    summary = Summary(total=len(jobs), skipped=len(jobs) - len(pending))
    if not pending:
        return summary
    # groups are made over the whole file, so that a resumed run batches as the first one did
    groups = [g for g in group_jobs(jobs, max_batch) if any(j.id not in done for j in g)]
    writer = Writer(output)
    writer.written.update(done)
    bar = Progress(len(pending)) if progress else None
    identity = model_identity(model)

    def finished(job: Job, result: dict) -> None:
        entry = writer.write(job, result)
        if entry:
            summary.done += 1
            summary.images += len(result["images"])
            if bar is not None:
                bar.update(len(result["images"]))
            if on_result is not None:
                on_result(entry)

    t0 = time.perf_counter()
    shutdown = Shutdown(shutdown_grace)
    shutdown.install()
    try:
        if use_ray:
            _run_ray(groups, model, identity, finished, summary, shutdown, address=address, workers=workers,
                     threads=threads, engine_options=engine_options or {}, worker_cpus=worker_cpus,
                     worker_gpus=worker_gpus, run_id=run_id or uuid.uuid4().hex[:8])
        else:
            _run_local(groups, model, identity, finished, summary, shutdown, threads, engine_options or {})
    finally:
        shutdown.restore()
        summary.seconds = time.perf_counter() - t0
        summary.stopped = shutdown.signal
        if bar is not None and bar.enabled and 0 < bar.done < bar.total:
            bar.stream.write("\n")      # end the progress line the run left part-way
            bar.stream.flush()
    return summary


def _run_local(groups, model, identity, finished, summary, shutdown, threads, engine_options) -> None:
    import torch

    from ..pipeline import Engine

    if threads:
        torch.set_num_threads(threads)
    engine = Engine.load(model, **engine_options)
    for group in groups:
        if shutdown.requested:       # no new group starts
            break
        try:
            results = run_group(engine, *identity, group, callback=shutdown.step)
        except JobInterrupted:
            summary.interrupted += len(group)
            break
        except SDLiteError as e:
            summary.failed.update({job.id: str(e) for job in group})
            continue
        for job, result in zip(group, results):
            finished(job, result)


MAX_REPLACEMENTS = 3      # per worker slot: a worker that keeps dying is not replaced forever
PREFETCH = 2              # jobs sent to each worker ahead: the next one is there when one finishes
POLL = 1.0                # seconds between looks at the shutdown flag while waiting on the workers


def _running(inflight: dict) -> list:
    """The refs of the groups the workers are running (or about to): an actor runs its tasks in the order they were
    sent, so the oldest in flight on each actor; the others wait behind it."""
    first: dict = {}
    for ref, (group, slot, actor) in inflight.items():    # in the order they were sent
        first.setdefault(id(actor), ref)
    return list(first.values())


def _cancel_queued(ray, inflight: dict) -> None:
    """Cancel the groups sent ahead, waiting behind each worker's running one, so that they never start (Ray answers
    TaskCancelledError for them once the running one is done). The running ones are left to finish: a running
    actor task cannot be stopped, and a cancelled one may lose its result."""
    running = set(_running(inflight))
    for ref in list(inflight):
        if ref not in running:
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - already done, or a Ray without actor-task cancellation
                pass


def _run_ray(groups, model, identity, finished, summary, shutdown, *, address, workers, threads, engine_options,
             worker_cpus, worker_gpus, run_id) -> None:
    try:
        import ray
    except ImportError:
        raise BatchError("sdlite batch --ray needs Ray: pip install 'sdlite[ray]'") from None
    own = not ray.is_initialized()
    slots: dict = {}                            # worker slot -> its actor
    if own:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # offline: no usage reports to Ray's makers
        local = {}
        if address is None:   # a Ray instance of our own, on loopback only
            from . import loopback_only

            loopback_only()
            local = {"include_dashboard": False, "_node_ip_address": "127.0.0.1"}
        try:
            ray.init(address=address, namespace=NAMESPACE, configure_logging=False, log_to_driver=False, **local)
        except ConnectionError as e:
            raise BatchError(f"--address {address}: cannot reach a Ray cluster there ({e})") from None
        shutdown.install()      # ray.init set its own SIGTERM handler
    try:
        if workers is None:
            cpus = ray.cluster_resources().get("CPU", 1)
            workers = max(1, int(cpus // worker_cpus)) if worker_cpus else 1
        summary.workers = workers
        if worker_gpus > 0:
            engine_options = {"device": "cuda", **engine_options}
        actor_class = ray.remote(BatchWorker)
        threads = threads or (max(1, int(worker_cpus)) if worker_cpus else None)

        def start(slot: int, generation: int):
            name = f"sdlite-batch-{run_id}-w{slot}" + (f".{generation}" if generation else "")
            return actor_class.options(name=name, namespace=NAMESPACE, num_cpus=worker_cpus,
                                       num_gpus=worker_gpus, max_restarts=0).remote(
                model, engine_options, threads, identity, name)

        slots.update({i: start(i, 0) for i in range(workers)})
        generations = {i: 0 for i in range(workers)}
        queue = collections.deque(groups)
        inflight: dict = {}                     # ref -> (group, slot, actor), in the order they were sent
        load: dict[int, int] = {i: 0 for i in slots}
        cancelled = False
        while (queue and not shutdown.requested) or inflight:
            if not shutdown.requested:
                for slot, actor in list(slots.items()):
                    while queue and load[slot] < PREFETCH:
                        group = queue.popleft()
                        inflight[actor.run.remote(group)] = (group, slot, actor)
                        load[slot] += 1
            elif not cancelled:                 # a shutdown: nothing more is sent, and what waits is dropped
                cancelled = True
                _cancel_queued(ray, inflight)
            if not inflight:
                if shutdown.requested:
                    break
                raise BatchError(f"every worker died; {sum(map(len, queue))} jobs were not run (run the command "
                                 "again to resume)")
            if shutdown.expired():              # the grace is over: the actors are killed below, unwritten
                summary.interrupted += sum(len(inflight[ref][0]) for ref in _running(inflight))
                break
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=min(POLL, shutdown.remaining()))
            for ref in ready:
                group, slot, actor = inflight.pop(ref)
                if slots.get(slot) is actor:
                    load[slot] -= 1
                try:
                    result = ray.get(ref)
                except ray.exceptions.TaskCancelledError:
                    continue                     # sent ahead, cancelled by a shutdown before it started
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    if shutdown.requested:
                        continue                 # no replacement while stopping: it runs on resume
                    queue.appendleft(group)      # in flight on a worker that died: run it again
                    if slots.get(slot) is actor:
                        generations[slot] += 1
                        if generations[slot] > MAX_REPLACEMENTS:
                            del slots[slot]
                            print(f"sdlite: warning: worker {slot} died {MAX_REPLACEMENTS + 1} times; not replaced",
                                  file=sys.stderr)
                        else:
                            print(f"sdlite: warning: worker {slot} died; starting another, its jobs run again",
                                  file=sys.stderr)
                            slots[slot] = start(slot, generations[slot])
                            summary.replaced_workers += 1
                        load[slot] = 0
                    continue
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    message = str(cause) if isinstance(cause, SDLiteError) else repr(cause or e)
                    summary.failed.update({job.id: message for job in group})
                    continue
                for job, one in zip(group, result):
                    finished(job, one)
    finally:
        for actor in list(slots.values()):
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if own:
            ray.shutdown()
