"""What every diffusers folder has, for the openers of each family (:mod:`sdlite.loader`, :mod:`sdlite.weights.sd3`):
its JSON files, a component's weight files (plain, fp16/bf16 variants, sharded, ``.bin``), its tokenizers, what its
text encoder's config declares, the dtype its weights are stored in, and where each part is (a folder may share
parts from another)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..tokenizers import WordPieceTokenizer, load_tokenizer
from ..tokenizers.clip_bpe import CLIPTokenizer
from .io import open_checkpoint, open_sharded
from .store import TensorStore

__all__ = ["read_json", "component_store", "text_architecture", "folder_tokenizer", "storage_dtype", "vae_folders",
           "WEIGHT_NAMES", "LARGE_VAE", "SHARED_FROM_KEY", "component_folders"]

# weight files of a diffusers component, in order of preference (a variant such as fp16 is tried after)
WEIGHT_NAMES = {
    "unet": "diffusion_pytorch_model", "vae": "diffusion_pytorch_model", "text_encoder": "model",
    "text_encoder_2": "model", "text_encoder_3": "model", "transformer": "diffusion_pytorch_model",
}

# where a folder whose vae/ is an AutoencoderTiny keeps the full AutoencoderKL (IDKiro's SDXS folders)
LARGE_VAE = "vae_large"
# model_index.json key of a folder that holds only some components and takes the others from another folder (a
# path relative to it): the shipped ``demo-zh`` has its own text encoder and tokenizer and shares the demo's UNet,
# VAE and scheduler. diffusers ignores keys that start with "_".
SHARED_FROM_KEY = "_sdlite_shared_from"

# text-encoder architectures a folder's text_encoder/config.json can declare
_CLIP_ARCHITECTURES = {"CLIPTextModel", "CLIPTextModelWithProjection"}
_BERT_ARCHITECTURES = {"BertModel", "BertForMaskedLM", "BertForPreTraining"}

def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError("file is missing", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"not valid JSON ({e})", path) from None
    if not isinstance(data, dict):
        raise CheckpointError("expected a JSON object", path)
    return data


def component_store(folder: Path, component: str, sub: Path | None = None) -> TensorStore:
    """The weights of one diffusers component (in ``folder / component``, or ``sub`` when given): plain file, then
    the fp16 variant, sharded or ``.bin``."""
    sub = folder / component if sub is None else sub
    base = WEIGHT_NAMES[component]
    bin_base = "pytorch_model" if component.startswith("text_encoder") else base
    candidates = [f"{base}.safetensors", f"{base}.fp16.safetensors", f"{base}.bf16.safetensors",
                  f"{base}.safetensors.index.json", f"{base}.fp16.safetensors.index.json",
                  f"{bin_base}.bin", f"{bin_base}.fp16.bin", f"{bin_base}.bin.index.json"]
    for name in candidates:
        file = sub / name
        if file.is_file():
            return open_sharded(file) if name.endswith(".index.json") else open_checkpoint(file)
    raise CheckpointError(f"no weights for the {component}: expected one of {', '.join(candidates[:3])}, ...",
                          sub)



def vae_folders(vae_dir: Path) -> tuple[Path | None, Path | None]:
    """(the AutoencoderKL's folder, the AutoencoderTiny's folder) of a diffusers folder whose ``vae`` is ``vae_dir``.

    ``vae/config.json`` says which ``_class_name`` it holds: an AutoencoderKL (or no class: older folders) is the
    VAE, and there is no tiny one; an AutoencoderTiny (a TAESD, as IDKiro's SDXS folders ship the decoder SDXS was
    trained with) comes with the full AutoencoderKL in ``vae_large/`` beside it, or alone (None for the first).
    Any other class is an error naming the file."""
    config_file = vae_dir / "config.json"
    kind = read_json(config_file).get("_class_name", "AutoencoderKL")
    if kind == "AutoencoderKL":
        return vae_dir, None
    if kind != "AutoencoderTiny":
        raise CheckpointError(f"vae/config.json names the class {kind}: sdlite reads an AutoencoderKL there, or an "
                              f"AutoencoderTiny (TAESD) with the AutoencoderKL in {LARGE_VAE}/ beside it or none",
                              config_file)
    large = vae_dir.parent / LARGE_VAE
    if not large.is_dir():
        return None, vae_dir
    large_kind = read_json(large / "config.json").get("_class_name", "AutoencoderKL")
    if large_kind != "AutoencoderKL":
        raise CheckpointError(f"{LARGE_VAE}/config.json names the class {large_kind}: the full VAE beside a tiny "
                              "one must be an AutoencoderKL", large / "config.json")
    return large, vae_dir


def text_architecture(config: dict, config_file: Path) -> str:
    """"bert" or "clip", from what text_encoder/config.json declares (``architectures``, else ``model_type``)."""
    declared = config.get("architectures") or []
    if isinstance(declared, str):
        declared = [declared]
    names = set(declared)
    if names & _BERT_ARCHITECTURES or (not names and config.get("model_type") == "bert"):
        return "bert"
    if names & _CLIP_ARCHITECTURES or any("CLIP" in n for n in names) or (
            not names and config.get("model_type", "clip_text_model") in ("clip_text_model", "clip")):
        return "clip"
    kind = ", ".join(sorted(names)) or config.get("model_type")
    raise CheckpointError(f"the text encoder is a {kind}: sdlite runs CLIP text towers (CLIPTextModel) and BERT "
                          "encoders (BertModel, as Taiyi uses)", config_file)



def folder_tokenizer(folder: Path, text=None) -> CLIPTokenizer | WordPieceTokenizer:
    """The folder's tokenizer. A WordPiece one is limited to the text encoder's positions when its config names
    no length (transformers' "no limit") or a longer one."""
    try:
        tok = load_tokenizer(folder)
        if isinstance(tok, WordPieceTokenizer) and text is not None and tok.max_length > text.max_positions:
            tok = load_tokenizer(folder, max_length=text.max_positions)
        return tok
    except (OSError, ValueError) as e:
        raise CheckpointError(f"unusable tokenizer: {e}", folder) from None



def storage_dtype(store: TensorStore, prefix: str = "") -> torch.dtype:
    """The dtype most floating-point bytes are stored in (of keys under ``prefix``)."""
    sizes: Counter = Counter()
    for key in store.keys():
        if key.startswith(prefix) and store.dtype(key).is_floating_point:
            sizes[store.dtype(key)] += store.nbytes(key)
    return sizes.most_common(1)[0][0] if sizes else torch.float32


def component_folders(folder: Path, index: dict, index_file: Path) -> dict[str, Path]:
    """Where each part (``text_encoder``, ``unet``, ``vae``, ``tokenizer``, ``scheduler``) of a folder is: in the
    folder itself, or, for a part it lacks, in the folder its model_index.json names under ``_sdlite_shared_from``
    (relative to it)."""
    parts = ("text_encoder", "unet", "vae", "tokenizer", "scheduler")
    where = {p: folder / p for p in parts}
    shared = index.get(SHARED_FROM_KEY)
    if shared is None:
        return where
    if not isinstance(shared, str) or not shared:
        raise CheckpointError(f"{SHARED_FROM_KEY} must be a folder path (relative to the model folder), got "
                              f"{shared!r}", index_file)
    base = (folder / shared).resolve()
    if not (base / "model_index.json").is_file():
        raise CheckpointError(f"{SHARED_FROM_KEY} names {shared!r}, which is not a diffusers folder ({base})",
                              index_file)
    for p in parts:
        if not where[p].is_dir():
            where[p] = base / p
    return where
