"""The checkpoints a server offers, named as the AUTOMATIC1111 web UI names them, and the engines loaded for them.

A checkpoint is a ``.safetensors`` / ``.ckpt`` file or a diffusers folder (one holding ``model_index.json``), found
in ``--models-dir`` (and its sub-folders), plus the ``--model`` the server started with. As in A1111 its *title*
is its path relative to the models folder followed by its short hash in brackets (``v1-5.safetensors
[6ce0161689]``) once the hash is known (it is computed when the model is first loaded), its *model name* the
path without extension (sub-folders joined with ``_``), and a client may name it by title, file name, model
name or hash (:meth:`Checkpoints.find`).

:class:`Engines` keeps one :class:`~sdlite.pipeline.Engine` per checkpoint, at most ``limit`` of them (A1111's
``sd_checkpoints_limit``), plus one SDXL refiner (:meth:`Engines.refiner`); only the job worker calls it, so a
model is never loaded or dropped mid-job. With ``taesd`` (``sdlite serve --taesd PATH``) each engine gets the TAESD
there for its latents as its "TAESD" live-preview decoder, when PATH has one for them.
"""
from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ..images import model_hash

CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt")


@dataclass
class Checkpoint:
    path: Path
    name: str                 # A1111's "name": the path relative to the models folder, extension kept
    hash: str | None = None   # first 10 hex digits of the weights' SHA-256 (A1111's "AutoV2" short hash)

    @property
    def title(self) -> str:
        return f"{self.name} [{self.hash}]" if self.hash else self.name

    @property
    def model_name(self) -> str:
        """The name without extension, sub-folders joined with ``_`` (A1111's ``model_name``)."""
        stem = self.name[: -len(Path(self.name).suffix)] if Path(self.name).suffix in CHECKPOINT_SUFFIXES \
            else self.name
        return stem.replace("/", "_").replace("\\", "_")

    @property
    def short_name(self) -> str:
        """The stem alone: what the infotext's ``Model:`` field and ``sdlite generate`` call it."""
        return Path(self.name).stem if self.path.is_file() else Path(self.name).name

    def describe(self) -> dict:
        """The ``/sdapi/v1/sd-models`` entry."""
        return {"title": self.title, "model_name": self.model_name, "hash": self.hash, "sha256": None,
                "filename": str(self.path), "config": None}


def _is_diffusers_folder(path: Path) -> bool:
    return path.is_dir() and (path / "model_index.json").is_file()


def scan(models_dir: Path) -> list[Checkpoint]:
    """The checkpoints in ``models_dir`` and below, sorted by name; a diffusers folder is not searched further."""
    found = []
    for root, dirs, files in os.walk(models_dir, followlinks=True):
        root_path = Path(root)
        if root_path != models_dir and _is_diffusers_folder(root_path):
            found.append(Checkpoint(root_path, root_path.relative_to(models_dir).as_posix()))
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in files:
            if Path(f).suffix.lower() in CHECKPOINT_SUFFIXES:
                path = root_path / f
                found.append(Checkpoint(path, path.relative_to(models_dir).as_posix()))
    return sorted(found, key=lambda c: c.name.lower())


class Checkpoints:
    """The list of checkpoints (``--model`` first, then ``--models-dir``) and which one is current."""

    def __init__(self, model: str | os.PathLike | None, models_dir: str | os.PathLike | None):
        self.models_dir = Path(models_dir) if models_dir is not None else None
        self._default = Path(model) if model is not None else None
        self._lock = threading.Lock()
        self._hashes: dict[Path, str] = {}
        self._items: list[Checkpoint] = []
        self.refresh()
        if not self._items:
            raise FileNotFoundError(f"no checkpoints in {self.models_dir}: expected .safetensors or .ckpt files or "
                                    "diffusers folders (holding model_index.json)")
        self.current: Checkpoint = self._items[0]

    def refresh(self) -> None:
        """Scan the models folder again (A1111's refresh-checkpoints)."""
        items = scan(self.models_dir) if self.models_dir is not None else []
        if self._default is not None:  # listed first; under its name in the models folder when it is there
            there = [c for c in items if c.path.absolute() == self._default.absolute()]
            if there:
                items.remove(there[0])
            items.insert(0, there[0] if there else Checkpoint(self._default, self._default.name))
        with self._lock:
            for c in items:
                c.hash = self._hashes.get(c.path)
            self._items = items
            current = getattr(self, "current", None)
            if current is not None:
                self.current = next((c for c in items if c.path == current.path), current)

    def list(self) -> list[Checkpoint]:
        with self._lock:
            return list(self._items)

    def find(self, name: str) -> Checkpoint | None:
        """The checkpoint a client means by ``name``: its title, name, name without extension, model name, file
        name or short hash (as A1111's ``checkpoint_aliases``), compared without case; None if there is none."""
        wanted = name.strip().lower()
        for key in (lambda c: c.title, lambda c: c.name, lambda c: c.model_name, lambda c: c.short_name,
                    lambda c: c.path.name, lambda c: c.hash or "", lambda c: str(c.path)):
            for c in self.list():
                if key(c).lower() == wanted:
                    return c
        # "name [hash]" with a hash we have not computed yet, or another hash: match the name part
        if wanted.endswith("]") and " [" in wanted:
            return self.find(wanted.rsplit(" [", 1)[0])
        return None

    def names(self) -> list[str]:
        return [c.title for c in self.list()]

    def hash_of(self, checkpoint: Checkpoint) -> str:
        """Compute (once) and remember the checkpoint's short hash."""
        with self._lock:
            known = self._hashes.get(checkpoint.path)
        if known is None:
            known = model_hash(checkpoint.path)
            with self._lock:
                self._hashes[checkpoint.path] = known
        for c in self.list():
            if c.path == checkpoint.path:
                c.hash = known
        checkpoint.hash = known
        return known

    def remember_hash(self, checkpoint: Checkpoint, value: str) -> None:
        """Record a short hash computed elsewhere (by a Ray replica that loaded the model)."""
        with self._lock:
            self._hashes[checkpoint.path] = value
        for c in self.list():
            if c.path == checkpoint.path:
                c.hash = value


class Engines:
    """One loaded engine per checkpoint (and VAE file in place of its own, A1111's ``sd_vae``: a model with another
    VAE is another engine), the ``limit`` most recently used kept. Called by the job worker only."""

    def __init__(self, checkpoints: Checkpoints, limit: int = 1, *, taesd=None, **load_options):
        self.checkpoints = checkpoints
        self.limit = limit
        self.load_options = load_options
        self.taesd = taesd                  # a TAESD file or folder for the "TAESD" live previews, or None
        self._taesds: dict[str, object] = {}   # variant -> the TAESD loaded from it (None: it has none)
        self._loaded: collections.OrderedDict[tuple, object] = collections.OrderedDict()   # (path, VAE file)
        self._refiner: tuple[Path, object] | None = None   # (path, engine) of the refiner last asked for

    def get(self, checkpoint: Checkpoint, vae: str | None = None, text_encoders: tuple = (),
            weight_storage: str = "default"):
        """The engine of ``checkpoint`` (with the VAE file ``vae`` in place of its own, the text-encoder files
        ``text_encoders`` a bare SD3, FLUX or Z-Image transformer file lacks, and its transformer's weights kept as
        ``weight_storage`` says: ComfyUI's fp8 ``weight_dtype``, :meth:`Engine.load <sdlite.pipeline.Engine.load>`),
        loaded if needed (dropping the least recently used beyond the limit)."""
        key = _key(checkpoint, vae, text_encoders, weight_storage)
        engine = self._loaded.get(key)
        if engine is None:
            while len(self._loaded) >= max(self.limit, 1):
                self._loaded.popitem(last=False)
            engine = self._load(checkpoint, vae, tuple(text_encoders), weight_storage)
            self._loaded[key] = engine
        self._loaded.move_to_end(key)
        return engine

    def loaded(self, checkpoint: Checkpoint, vae: str | None = None, text_encoders: tuple = (),
               weight_storage: str = "default"):
        """The engine of ``checkpoint`` (with ``vae``, ``text_encoders`` and ``weight_storage``) if it is loaded, else
        None (never loads)."""
        engine = self._loaded.get(_key(checkpoint, vae, text_encoders, weight_storage))
        if engine is None and self._refiner is not None and self._refiner[0] == checkpoint.path:
            engine = self._refiner[1]
        return engine

    def forget_kept_loras(self) -> None:
        """Every loaded engine (the refiner too) lets go of the merged LoRA layers it keeps for the next request with
        the same LoRAs (:func:`sdlite.adapters.lora.engine_with_loras`): their memory is freed."""
        engines = [*self._loaded.values(), *([self._refiner[1]] if self._refiner is not None else [])]
        for engine in engines:
            engine.models.kept_loras = None

    def refiner(self, checkpoint: Checkpoint):
        """The engine of ``checkpoint`` as an SDXL refiner: loaded on first use and kept, one refiner at a time (a
        request naming another refiner replaces it; the old one is dropped before the new one loads). It is kept
        apart from the ``limit`` base models, so a model switch does not drop it, nor a request without refiner."""
        if self._refiner is not None and self._refiner[0] == checkpoint.path:
            return self._refiner[1]
        self._refiner = None
        engine = self._loaded.get(_key(checkpoint))
        if engine is None:
            engine = self._load(checkpoint)
        self._refiner = (checkpoint.path, engine)
        return engine

    def _load(self, checkpoint: Checkpoint, vae: str | None = None, text_encoders: tuple = (),
              weight_storage: str = "default"):
        """A new engine for ``checkpoint`` (the refiner's, when it is asked for as a base model: never two)."""
        from ..errors import CheckpointError, RequestError
        from ..loader import open_model
        from ..pipeline import Engine

        if vae is None and not text_encoders and weight_storage == "default" and self._refiner is not None \
                and self._refiner[0] == checkpoint.path:
            return self._refiner[1]
        source = checkpoint.path
        if text_encoders:
            # a bare FLUX or Z-Image transformer takes its VAE with its other parts when it is opened
            files = [*text_encoders, *([vae] if vae is not None and _takes_vae_with_parts(checkpoint.path) else [])]
            source = open_model(checkpoint.path, text_encoders=files)
            if vae in files:
                vae = None
        if vae is not None:
            source = open_model(source) if isinstance(source, Path) else source
            try:
                source.use_vae(vae)
            except CheckpointError as e:   # the client's choice of VAE, not the server's model, is at fault
                source.close()
                raise RequestError(f"the VAE {Path(vae).name} cannot be used with {checkpoint.name}: {e}") from None
            except BaseException:
                source.close()
                raise
        storage = {} if weight_storage == "default" else {"weight_storage": weight_storage}
        engine = Engine.load(source, **self.load_options, **storage)
        self.checkpoints.hash_of(checkpoint)
        if self.taesd is not None:
            engine.set_preview_decoder(self._preview_taesd(engine))
        return engine

    def _preview_taesd(self, engine):
        """The TAESD of ``self.taesd`` for ``engine``'s latents (loaded once per variant), or None when it has none;
        a damaged one is an error."""
        from ..weights.taesd import TAESDNotFound, load_taesd, model_variant

        variant = model_variant(engine.spec)
        if variant not in self._taesds:
            try:
                self._taesds[variant] = load_taesd(self.taesd, variant, device=engine.device)
            except TAESDNotFound:
                self._taesds[variant] = None
        return self._taesds[variant]


def _key(checkpoint: Checkpoint, vae: str | None = None, text_encoders: tuple = (),
         weight_storage: str = "default") -> tuple:
    """An engine's key in the cache: the model's path, the VAE file, the text-encoder files, and the transformer's
    weight storage where it is not the default (so a default engine's key is the three)."""
    key = (checkpoint.path, vae, tuple(text_encoders))
    return key if weight_storage == "default" else (*key, weight_storage)


def _takes_vae_with_parts(path: Path) -> bool:
    """Whether the single file ``path`` holds a FLUX, Z-Image or Qwen-Image transformer (read from its keys), whose
    opener takes the VAE file with the text encoders (:func:`sdlite.weights.flux.open_flux_file`,
    :func:`sdlite.weights.zimage.open_zimage_file`, :mod:`sdlite.weights.qwenimage`)."""
    from ..weights.flux import is_flux_file
    from ..weights.io import open_checkpoint
    from ..weights.qwenimage import is_qwenimage_file
    from ..weights.zimage import is_zimage_file

    if not Path(path).is_file():
        return False
    with open_checkpoint(path) as store:
        keys = list(store.keys())
        return is_flux_file(keys) or is_zimage_file(keys) or is_qwenimage_file(keys)
