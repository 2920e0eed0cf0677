"""The parts a transformer's single file lacks (text encoders, the VAE), from files given or found beside it.

SD3, FLUX.1 and Z-Image are published as one file for the transformer and separate files for the rest: ComfyUI keeps
them in ``models/diffusion_models``, ``models/text_encoders`` (or the older ``models/clip``) and ``models/vae``. A
family's opener says which parts it needs, the file names each part goes by, and how to tell what a file holds from
its keys; :func:`add_parts` opens the files given (the CLI's ``--text-encoder``, repeatable, which also takes a VAE)
and, for what is still missing, the ones found beside the model (:func:`find_beside`), and names every mistake: a
file that does not exist, one that holds nothing the family takes, a part given twice. :func:`open_transformer_file`
is the whole opener of such a file, given the family's pieces (:class:`TransformerFile`: its key plan, its parts,
its messages); FLUX.2 [klein] and Z-Image open theirs with it.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import VAEConfig
from ..errors import CheckpointError
from .folders import storage_dtype
from .io import open_checkpoint
from .plan import UnsupportedModelError
from .store import ComponentSource, TensorStore
from .vae_keys import infer_vae, vae_from_original

__all__ = ["Parts", "beside_places", "find_beside", "add_parts", "vae_part", "vae_prefix", "opened", "TransformerFile",
           "unexpected_notes", "open_transformer_file"]


@dataclass(frozen=True)
class Parts:
    """What a family takes beside its transformer: ``names`` (component -> how messages name it), ``patterns``
    ((component, file-name globs) in order of preference, tried beside the model), ``kind`` (a file's keys and
    shapes -> (component, key prefix), or a :class:`~sdlite.errors.CheckpointError` saying it is none of them),
    ``source`` ((component, keys, prefix, store, path) -> the component's source; it may record the part's config)
    ``vae_folder`` (whether ComfyUI's ``vae`` folders are searched too) and ``optional`` (named parts that are not
    required)."""

    names: dict[str, str]
    patterns: tuple[tuple[str, tuple[str, ...]], ...]
    kind: Callable[[list[str], dict, Path], tuple[str, str]]
    source: Callable[[str, list[str], str, TensorStore, Path], ComponentSource]
    vae_folder: bool = True
    optional: tuple[str, ...] = ()   # parts of ``names`` taken when found, not required (a family's last look decides)


def beside_places(model: Path, vae_folder: bool = True) -> list[Path]:
    """Where the parts of ``model`` are looked for: its folder, ``text_encoders/`` (and ``vae/``) in it, and
    ComfyUI's ``models/text_encoders``, ``models/clip`` (and ``models/vae``) when it sits in ``models/...``."""
    folder = model.parent
    places = [folder, folder / "text_encoders"] + ([folder / "vae"] if vae_folder else [])
    places += [folder.parent / "text_encoders", folder.parent / "clip"] + ([folder.parent / "vae"] if vae_folder else [])
    return places


def find_beside(model: Path, missing: list[str], patterns, vae_folder: bool = True) -> dict[str, Path]:
    """A file for each ``missing`` component whose name matches its ``patterns`` (the first place that has one,
    the first pattern's files first, in name order), beside ``model`` (:func:`beside_places`)."""
    found = {}
    for component, globs in patterns:
        if component not in missing:
            continue
        for place in beside_places(model, vae_folder):
            hits = sorted(p for pattern in globs for p in place.glob(pattern) if p.is_file() and p != model)
            if hits:
                found[component] = hits[0]
                break
    return found


def add_parts(path: Path, parts: Parts, sources: dict[str, ComponentSource], stores: list[TensorStore],
              notes: list[str], given=(), needed=(), search_beside: bool = True) -> None:
    """Add to ``sources`` the ``needed`` components the model file ``path`` lacks: each file of ``given`` (paths),
    then for what is still missing the files found beside the model (unless ``search_beside`` is False). Opened
    stores go to ``stores`` (the caller closes them on an error); a part found beside is noted in ``notes``."""
    given = [Path(p) for p in given]
    for extra in given:
        if not extra.is_file():
            raise CheckpointError("no such file (given with --text-encoder, or text_encoders=)", extra)
    missing = [c for c in needed if c not in sources]
    beside = find_beside(path, missing, parts.patterns, parts.vae_folder) if search_beside else {}
    resolved = {p.resolve() for p in given}
    for extra in [*given, *(p for p in beside.values() if p.resolve() not in resolved)]:
        store = open_checkpoint(extra)
        stores.append(store)
        keys = list(store.keys())
        shapes = {k: tuple(store.shape(k)) for k in keys}
        component, prefix = parts.kind(keys, shapes, extra)
        if component in sources:
            if extra not in given:
                continue                      # found beside, but a given file already has it
            where = "the model file" if str(path) in sources[component].files else sources[component].files[0]
            raise CheckpointError(f"{parts.names[component]} is given twice (also in {where})", extra)
        sources[component] = parts.source(component, keys, prefix, store, extra)
        if extra not in given:
            notes.append(f"{parts.names[component]} from {extra.name}, found beside the model")


def vae_part(keys: list[str], prefix: str, store: TensorStore, path, preset: VAEConfig,
             sample_size: int | None = None) -> tuple[ComponentSource, VAEConfig]:
    """A VAE in LDM names under ``prefix`` (``ae.safetensors``, or inside an all-in-one file) and its config: the
    shapes' widths, ``preset``'s scaling and shift factors (the file cannot say them), ``sample_size`` (default:
    the preset's)."""
    plan = vae_from_original(keys, prefix=prefix)
    source = ComponentSource.from_plan(plan, store, (str(path),))
    info = infer_vae(source.shapes)
    vae = VAEConfig(**info.config_kwargs(), scaling_factor=preset.scaling_factor, shift_factor=preset.shift_factor,
                    use_quant_conv="quant_conv.weight" in source.shapes,
                    use_post_quant_conv="post_quant_conv.weight" in source.shapes,
                    sample_size=preset.sample_size if sample_size is None else sample_size)
    return source, vae


def vae_prefix(shapes, prefixes=("",)) -> str | None:
    """The first of ``prefixes`` under which ``shapes`` (a file's keys) hold a VAE in LDM names (its encoder's and
    decoder's ``conv_in``); None when under none."""
    return next((prefix for prefix in prefixes if f"{prefix}decoder.conv_in.weight" in shapes
                 and f"{prefix}encoder.conv_in.weight" in shapes), None)


@contextmanager
def opened(stores: list[TensorStore], where):
    """The body of an opener: on any error the ``stores`` it opened are closed, and a model it cannot run
    (:class:`~sdlite.weights.plan.UnsupportedModelError`) is a :class:`~sdlite.errors.CheckpointError` naming
    ``where`` (the file or folder opened)."""
    try:
        yield
    except UnsupportedModelError as e:
        for store in stores:
            store.close()
        raise CheckpointError(str(e), where) from None
    except BaseException:
        for store in stores:
            store.close()
        raise


@dataclass(frozen=True)
class TransformerFile:
    """A family's pieces for :func:`open_transformer_file`, the opener of a file that holds its transformer (and
    perhaps its VAE) and lacks the rest:

    * ``model``: how messages name the model (``the {model} model has no ...``);
    * ``layout``: the file's keys -> (layout, key prefix of the transformer);
    * ``transformer``: (the transformer's keys, layout, prefix, store, path) -> (its source, its config), every
      tensor its config describes there (the family's refusals and completeness check);
    * ``parts``: (the transformer's config, configs, notes) -> the :class:`Parts` it takes beside it, whose
      ``source`` records each part's config in ``configs`` (and may add to ``notes``); ``Parts.names`` lists the
      parts needed, in the order a missing one is named;
    * ``vae_prefixes`` (where a VAE inside the file may sit; keys under them are not the transformer's) and
      ``vae_keys``: (the file's keys, one prefix) -> the keys the VAE's ``source`` reads, or None when none is there;
    * ``given``: what to give for the parts, in the missing-part message (``--text-encoder PATH, repeatable: ...``);
    * ``last_look``: (path, parts, sources, stores, notes) -> {component: words added to its missing-part message},
      a last place to look for parts still missing (FLUX.2's ``ae.safetensors``), or None;
    * ``spec``: (path, transformer config, configs, files, notes) -> (spec, detection), where ``files`` maps a part
      from a separate file to that file (a part inside the model's file is not in it);
    * ``prediction_source``, ``scheduler_source`` and ``tokenizer`` (a callable: the tokenizer to run with) for the
      :class:`~sdlite.loader.Checkpoint`.
    """

    model: str
    layout: Callable[[list[str]], tuple[str, str]]
    transformer: Callable[[list[str], str, str, TensorStore, Path], tuple[ComponentSource, Any]]
    parts: Callable[[Any, dict, list[str]], Parts]
    vae_prefixes: tuple[str, ...]
    vae_keys: Callable[[list[str], str], list[str] | None]
    given: Callable[[Any], str]
    spec: Callable[[Path, Any, dict, dict[str, Path], list[str]], tuple[Any, Any]]
    prediction_source: str
    scheduler_source: str
    tokenizer: Callable[[], Any]
    last_look: Callable[[Path, Parts, dict, list, list], dict[str, str]] | None = None


def unexpected_notes(sources: dict[str, ComponentSource], notes: list[str]) -> None:
    """A note for each component whose file has keys its plan did not understand (they are not read)."""
    for name, source in sources.items():
        if source.unexpected:
            notes.append(f"{len(source.unexpected)} {name} keys not understood (ignored)")


def open_transformer_file(path: Path, store: TensorStore, family: TransformerFile, text_encoders=()) -> dict:
    """The :class:`~sdlite.loader.Checkpoint` fields of ``family``'s transformer file (``store``, already open) with
    the parts it lacks from ``text_encoders`` (paths) or found beside it (:func:`add_parts`): the transformer under
    the layout's prefix (or, without one, every key outside ``text_encoders.`` and the VAE prefixes), a VAE inside the
    file, the parts given or found, a part still missing named, then the spec and a note of the keys not understood."""
    stores = [store]
    sources: dict[str, ComponentSource] = {}
    notes: list[str] = []
    with opened(stores, path):
        keys = list(store.keys())
        layout, prefix = family.layout(keys)
        inside = [k for k in keys if k.startswith(prefix)] if prefix else \
            [k for k in keys if not k.startswith(("text_encoders.", *family.vae_prefixes))]
        sources["transformer"], transformer = family.transformer(inside, layout, prefix, store, path)
        configs: dict = {}
        parts = family.parts(transformer, configs, notes)
        for vprefix in family.vae_prefixes:
            vae_keys = family.vae_keys(keys, vprefix)
            if vae_keys is not None:
                sources["vae"] = parts.source("vae", vae_keys, vprefix, store, path)
        needed = tuple(c for c in parts.names if c not in parts.optional)
        add_parts(path, parts, sources, stores, notes, given=text_encoders, needed=needed)
        more = family.last_look(path, parts, sources, stores, notes) if family.last_look else {}
        for component in needed:
            if component not in sources:
                raise CheckpointError(
                    f"the {family.model} model has no {parts.names[component]}: the file holds none and none was given "
                    f"(--text-encoder PATH, repeatable: {family.given(transformer)}) or found beside it"
                    f"{more.get(component, '')}", path)
        files = {c: Path(sources[c].files[0]) for c in needed if sources[c].files[0] != str(path)}
        spec, detection = family.spec(path, transformer, configs, files, notes)
        unexpected_notes(sources, notes)
    return dict(path=str(path), layout="original", spec=spec, detection=detection,
                storage_dtype=storage_dtype(store, prefix=prefix), prediction_source=family.prediction_source,
                sources=sources, scheduler_config=dict(spec.scheduler), scheduler_source=family.scheduler_source,
                notes=notes, _stores=stores, _tokenizer=family.tokenizer())
