"""The TAESDs users have, read into :class:`~sdlite.models.taesd.TinyAutoencoder`.

Three forms are read:

* a diffusers ``AutoencoderTiny`` folder: ``config.json`` and ``diffusion_pytorch_model.safetensors`` (or ``.bin``,
  or their ``.fp16`` variants), with the canonical keys ``decoder.layers.N...`` / ``encoder.layers.N...``;
* one file per half, as A1111 keeps them for its live previews and as madebyollin publishes them
  (``taesd_decoder.pth``, ``taesdxl_decoder.pth``, ``taesd_encoder.safetensors`` ...): a bare ``nn.Sequential``
  state dict (``3.conv.0.weight``), at times under a ``decoder.`` / ``encoder.`` (``taesd_decoder.`` ...) prefix, or
  the canonical keys; ``.pth`` files are read by :mod:`sdlite.weights.io`, which never runs pickled code;
* a folder of such files (A1111's ``models/VAE-approx``), from which the variant asked for is taken.

The variant (the latent space a TAESD decodes: ``sd`` for SD 1.x/2.x, ``sdxl``, ``sd3``, ``flux``) is not in the
weights -- SD's and SDXL's have the same shapes -- so it comes from the file or folder name (``taesdxl`` -> sdxl) or
a diffusers config's ``_name_or_path``; None when nothing says. Every problem is a :class:`TAESDError` naming the
file and, where one is at fault, the key and its shape.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..config import TAESD_VARIANTS, ConfigError, TAESDConfig
from ..errors import CheckpointError
from ..models.taesd import TinyAutoencoder
from .io import open_checkpoint
from .plan import ComponentPlan, PlanEntry
from .store import TensorStore
from .vae_keys import TAESD_PARTS, taesd_from_original

__all__ = ["TAESDError", "TAESDNotFound", "MODEL_SUBFOLDERS", "load_taesd", "variant_from_name", "model_variant",
           "model_taesd", "resolve_taesd"]

EXTENSIONS = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")   # in order of preference
DIFFUSERS_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors",
                     "diffusion_pytorch_model.bin", "diffusion_pytorch_model.fp16.bin")
MODEL_SUBFOLDERS = ("vae_tiny", "taesd")   # where ``--vae-decoder taesd`` looks, in the model's folder
# ComfyUI keeps a whole TAESD in one file with these two scalars beside the halves (unused here)
_SIDE_KEYS = frozenset({"vae_scale", "vae_shift"})
_HALF_FILE = re.compile(r"(%s)_(decoder|encoder)" % "|".join(sorted(TAESD_VARIANTS.values(), key=len, reverse=True)))
_BARE_LAYER = re.compile(r"\d+\.")
_MAX_LISTED = 5


class TAESDError(CheckpointError):
    """A TAESD file or folder that cannot be used (the message names the file and the key or shape at fault)."""


class TAESDNotFound(TAESDError):
    """No TAESD (of the variant asked for) where one was looked for."""


def variant_from_name(name: str) -> str | None:
    """The variant a file or folder name says (``taesdxl_decoder.pth`` -> ``sdxl``), None when it says none."""
    lower = name.lower()
    for variant, stem in sorted(TAESD_VARIANTS.items(), key=lambda item: -len(item[1])):   # taesdxl before taesd
        if stem in lower:
            return variant
    return None


def model_variant(spec) -> str:
    """The TAESD variant a model's latents need: ``sdxl`` for SDXL models, ``sd`` for SD 1.x/2.x ones."""
    return "sdxl" if spec.is_sdxl else "sd"


def model_taesd(model: str | os.PathLike) -> Path:
    """The TAESD kept with a model: the first of its folder's ``vae_tiny`` and ``taesd`` subfolders (for a
    single-file model, those beside the file), else its ``vae`` where that is an AutoencoderTiny (SDXS folders)."""
    base = Path(model)
    folder = base if base.is_dir() else base.parent
    for sub in MODEL_SUBFOLDERS:
        if (folder / sub).is_dir():
            return folder / sub
    if _is_autoencoder_tiny(folder / "vae"):
        return folder / "vae"
    raise TAESDNotFound(f"no TAESD kept with the model: none of the folders {', '.join(MODEL_SUBFOLDERS)} exists "
                        "there (either holds a diffusers AutoencoderTiny folder's files, or taesd_decoder / "
                        "taesdxl_decoder files) and its vae/ is no AutoencoderTiny; give the TAESD's file or folder "
                        "instead", folder)


def _is_autoencoder_tiny(folder: Path) -> bool:
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("_class_name") == "AutoencoderTiny"


def resolve_taesd(value: str | os.PathLike, model: str | os.PathLike) -> Path:
    """What ``--vae-decoder VALUE`` names: the word ``taesd`` is :func:`model_taesd` of ``model``; anything else is
    the path of a TAESD file or folder, which must exist."""
    if os.fspath(value) == "taesd":
        return model_taesd(model)
    path = Path(value)
    if not path.exists():
        raise TAESDNotFound("no such file or folder (expected a TAESD file or folder, or the word taesd)", path)
    return path


def load_taesd(path: str | os.PathLike, variant: str | None = None, parts: tuple[str, ...] = ("decoder",),
               device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> TinyAutoencoder:
    """The TAESD at ``path`` (a file, a diffusers folder or a folder of A1111's files) with the halves ``parts``.

    ``variant``: the latent space wanted (``sd``, ``sdxl`` ...): a folder of files gives that variant's, and a
    file or folder whose name says another is refused (:class:`TAESDNotFound`); None takes what is there (a
    folder holding several variants is then an error). The module is returned in eval mode, without gradients.
    """
    if variant is not None and variant not in TAESD_VARIANTS:
        raise ValueError(f"unknown TAESD variant {variant!r} (expected one of {', '.join(TAESD_VARIANTS)})")
    for part in parts:
        if part not in TAESD_PARTS:
            raise ValueError(f"unknown TAESD part {part!r} (expected decoder or encoder)")
    p = Path(path)
    if not p.exists():
        raise TAESDNotFound("no such file or folder", p)
    if p.is_dir() and (p / "config.json").is_file():
        config, files, named = _diffusers_folder(p)
        name = p.name
    elif p.is_dir():
        files, named = _files_in_folder(p, variant, parts)
        config, name = None, "+".join(f.name for f in files)
    else:
        files, named, config, name = [p], variant_from_name(p.name), None, p.name
    if variant is not None and named is not None and named != variant:
        raise TAESDNotFound(f"is a TAESD for {named} latents (its name says so); this model needs one for {variant} "
                            f"({TAESD_VARIANTS[variant]}_decoder)", p)
    stores = []
    try:
        for f in files:
            stores.append(open_checkpoint(f))
        module = _assemble(stores, config, named, parts)
    finally:
        for store in stores:
            store.close()
    module.name = name
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


# --- where the files are -----------------------------------------------------------------------------------------


def _diffusers_folder(folder: Path) -> tuple[TAESDConfig, list[Path], str | None]:
    config_file = folder / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TAESDError(f"is not a readable JSON config ({e})", config_file) from None
    if not isinstance(raw, dict):
        raise TAESDError("is not a JSON object", config_file)
    kind = raw.get("_class_name", "AutoencoderTiny")
    if kind != "AutoencoderTiny":
        raise TAESDError(f"describes a {kind}, not a TAESD (AutoencoderTiny)", config_file)
    named = variant_from_name(folder.name) or variant_from_name(str(raw.get("_name_or_path", "")))
    try:
        config = TAESDConfig.from_diffusers(raw, named)
    except ConfigError as e:
        raise TAESDError(str(e), config_file) from None
    for weights in DIFFUSERS_WEIGHTS:
        if (folder / weights).is_file():
            return config, [folder / weights], named
    raise TAESDError(f"has a config.json but no weights ({DIFFUSERS_WEIGHTS[0]})", folder)


def _files_in_folder(folder: Path, variant: str | None, parts: tuple[str, ...]) -> tuple[list[Path], str]:
    """A folder of A1111's half files: the files of ``parts`` for ``variant`` (or the only variant there)."""
    found: dict[str, dict[str, Path]] = {}   # variant -> part -> file (the preferred extension)
    for f in sorted(folder.iterdir(), key=lambda f: (EXTENSIONS.index(f.suffix.lower())
                                                     if f.suffix.lower() in EXTENSIONS else len(EXTENSIONS), f.name)):
        m = _HALF_FILE.fullmatch(f.stem.lower())
        if m and f.suffix.lower() in EXTENSIONS and f.is_file():
            v = variant_from_name(m.group(1))
            found.setdefault(v, {}).setdefault(m.group(2), f)
    complete = sorted(v for v, halves in found.items() if all(part in halves for part in parts))
    if variant is None:
        if len(complete) > 1:
            raise TAESDError(f"holds TAESDs for several latent spaces ({', '.join(complete)}); say which", folder)
        variant = complete[0] if complete else None
    if variant is None or variant not in complete:
        stem = TAESD_VARIANTS[variant] if variant else "taesd"
        have = ", ".join(sorted(f.name for halves in found.values() for f in halves.values())) or "no TAESD files"
        raise TAESDNotFound(f"has no {' and '.join(f'{stem}_{part}' for part in parts)} file "
                            f"({', '.join(EXTENSIONS)}); it has: {have}", folder)
    return [found[variant][part] for part in parts], variant


# --- from stores to the module -----------------------------------------------------------------------------------


def _listing(keys) -> str:
    keys = list(keys)
    return ", ".join(repr(k) for k in keys[:_MAX_LISTED]) + (", ..." if len(keys) > _MAX_LISTED else "")


def _halves(store: TensorStore) -> dict[str, str | None]:
    """``{part: prefix}`` of the halves a file holds: prefix None for canonical keys (``decoder.layers.N``), else
    the prefix of madebyollin's bare layer indices ("" when there is none)."""
    keys = list(store)
    found: dict[str, str | None] = {}
    for part in TAESD_PARTS:
        if any(k.startswith(f"{part}.layers.") for k in keys):
            found[part] = None
            continue
        for prefix in (f"{part}.", f"taesd_{part}."):
            if any(k.startswith(prefix) and _BARE_LAYER.match(k[len(prefix):]) for k in keys):
                found[part] = prefix
                break
    if not found and any(_BARE_LAYER.match(k) for k in keys):
        # one bare half: the decoder's layer 0 is a parameterless clamp, the encoder's a convolution from RGB
        part = "encoder" if any(k.startswith("0.") for k in keys) else "decoder"
        name = os.path.basename(store.path).lower()
        said = [p for p in TAESD_PARTS if p in name]
        if len(said) == 1 and said[0] != part:
            raise TAESDError(f"is named as a TAESD {said[0]} but holds the layers of a TAESD {part} (it has "
                             f"{'a' if part == 'encoder' else 'no'} layer 0)", store.path)
        found[part] = ""
    if not found:
        raise TAESDError(f"is not a TAESD: none of its {len(keys)} keys is a TAESD layer (first few: "
                         f"{_listing(keys)}; expected e.g. '1.weight', '3.conv.0.weight' or "
                         "'decoder.layers.0.weight')", store.path)
    return found


def _plan(store: TensorStore, part: str, prefix: str | None, expected=None) -> ComponentPlan:
    if prefix is not None:
        return taesd_from_original(store.keys(), part, prefix=prefix, expected=expected)
    plan = ComponentPlan(f"TAESD {part}")
    wanted = None if expected is None else set(expected)
    for key in store:
        if key.startswith(f"{part}."):
            if wanted is None or key in wanted:
                plan.entries[key] = PlanEntry((key,))
            else:
                plan.unexpected.append(key)
    if expected is not None:
        plan.missing.extend(k for k in expected if k not in plan.entries)
    return plan


def _conv_shape(store: TensorStore, plan: ComponentPlan, key: str) -> tuple[int, ...]:
    entry = plan.entries.get(key)
    if entry is None:
        raise TAESDError(f"has no {key!r} (the {plan.component}'s first or last convolution); its keys: "
                         f"{_listing(store.keys())}", store.path)
    shape = tuple(store.shape(entry.sources[0]))
    if len(shape) != 4:
        raise TAESDError(f"has shape {list(shape)}, not that of a convolution weight [out, in, kh, kw]", store.path,
                         entry.sources[0])
    return shape


def _config_from_shapes(found: dict[str, tuple[TensorStore, str | None]], variant: str | None) -> TAESDConfig:
    """madebyollin's TAESD at the latent width (4 channels for SD/SDXL, 16 for SD3/FLUX) and layer width its
    first and last convolutions show; every other shape is then checked against it."""
    latent, width = {}, {}
    for part, (store, prefix) in found.items():
        plan = _plan(store, part, prefix)
        first = _conv_shape(store, plan, f"{part}.layers.0.weight")
        width[part] = first[0]
        if part == "decoder":
            latent[part] = first[1]
        else:
            layers = [int(m.group(1)) for k in plan.entries
                      if (m := re.fullmatch(r"encoder\.layers\.(\d+)\.weight", k))]
            latent[part] = _conv_shape(store, plan, f"encoder.layers.{max(layers)}.weight")[0]
    if len(set(latent.values())) > 1:
        raise TAESDError(f"the TAESD halves disagree on the latent channels: decoder {latent['decoder']}, encoder "
                         f"{latent['encoder']}", found["encoder"][0].path)
    defaults = TAESDConfig()
    return TAESDConfig(latent_channels=next(iter(latent.values())),
                       encoder_channels=(width.get("encoder", 64),) * len(defaults.encoder_blocks),
                       decoder_channels=(width.get("decoder", 64),) * len(defaults.decoder_blocks), variant=variant)


def _assemble(stores: list[TensorStore], config: TAESDConfig | None, variant: str | None,
              parts: tuple[str, ...]) -> TinyAutoencoder:
    found: dict[str, tuple[TensorStore, str | None]] = {}
    for store in stores:
        halves = _halves(store)
        for part, prefix in halves.items():
            if part in found:
                raise TAESDError(f"holds a TAESD {part}, and so does {found[part][0].path}", store.path)
            found[part] = (store, prefix)
        stray = [k for k in store if k not in _SIDE_KEYS and not any(
            k.startswith(f"{part}.") if prefix is None else k.startswith(prefix) for part, prefix in halves.items())]
        if stray:
            raise TAESDError(f"has {len(stray)} keys outside its TAESD halves: {_listing(stray)}", store.path)
    missing = [part for part in parts if part not in found]
    if missing:
        where = stores[0].path if len(stores) == 1 else ", ".join(s.path for s in stores)
        raise TAESDError(f"has no TAESD {' or '.join(missing)} (it holds the {' and '.join(found)})", where)
    found = {part: found[part] for part in parts}
    if config is None:
        config = _config_from_shapes(found, variant)
    module = TinyAutoencoder(config, encoder="encoder" in parts, decoder="decoder" in parts)
    state = module.state_dict()
    for part, (store, prefix) in found.items():
        expected = [k for k in state if k.startswith(f"{part}.")]
        plan = _plan(store, part, prefix, expected)
        if plan.unexpected or plan.missing:
            problems = []
            if plan.missing:
                problems.append(f"{len(plan.missing)} missing keys (first few: {_listing(plan.missing)})")
            if plan.unexpected:
                problems.append(f"{len(plan.unexpected)} unexpected keys (first few: {_listing(plan.unexpected)})")
            raise TAESDError(f"is not a TAESD {part} of the known architecture: " + "; ".join(problems), store.path)
        with torch.no_grad():
            for target, entry in plan.entries.items():
                source = entry.sources[0]
                have, need = tuple(store.shape(source)), tuple(state[target].shape)
                if have != need:
                    raise TAESDError(f"has shape {list(have)}, but the TAESD {part} needs {list(need)} there "
                                     f"({target})", store.path, source)
                state[target].copy_(store.load(source, dtype=torch.float32))
    return module
