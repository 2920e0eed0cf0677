"""LoRA: low-rank weight updates of the UNet and the text encoder(s), read from the files people have.

    lora = read_lora("style.safetensors")                    # kohya/A1111 or diffusers/PEFT, parsed once
    handle = merge(unet, [(lora, 0.8)], "unet")               # W += 0.8 * alpha / rank * up @ down
    ...                                                       # sample: no per-step cost
    handle.restore()                                          # the saved originals back, bit for bit

    with engine_with_loras(engine, [("style.safetensors", 0.8)]) as loras:   # every memory mode
        result = engine.generate(request)

Formats (told apart by their keys, whatever the file's extension; safetensors or a PyTorch pickle):

* kohya / A1111: ``lora_unet_<module>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha`` and ``lora_te_``
  (``lora_te1_``) for the text encoder. ``<module>`` is the diffusers module path with ``_`` for ``.``
  (``lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q``) or the original LDM one
  (``lora_unet_input_blocks_1_1_proj_in``, ``lora_unet_middle_block_1_...``, ``lora_unet_output_blocks_...``),
  mapped through the checkpoint converter's own UNet table (:func:`sdlite.weights.convert.unet_to_original`).
  Text-encoder names are transformers' (``lora_te_text_model_encoder_layers_0_self_attn_q_proj``), for SD 2.x
  as well: kohya trains both on transformers' CLIPTextModel. Linear layers, 1x1 and kxk convolutions (LoCon:
  ``lora_down`` is a kxk convolution with the layer's stride and padding, ``lora_up`` a 1x1 one).
  SDXL files (kohya's sd-scripts train SDXL on Stability's SGM UNet) name the UNet's layers in the original layout
  at SDXL's structure (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``, ``lora_unet_label_emb_0_0``
  for the added-conditioning MLP, ``lora_unet_time_embed_0``; resolved through the same converter table, which
  derives the block numbering from the model's config) and the two text encoders ``lora_te1_`` (CLIP ViT-L:
  ``text_encoder``) and ``lora_te2_`` (OpenCLIP bigG, in transformers' names: ``text_encoder_2``).
* diffusers / PEFT: ``unet.<module>.lora_A.weight`` / ``.lora_B.weight``, ``text_encoder.<module>...`` and (SDXL)
  ``text_encoder_2.<module>...``, the text encoders' modules with or without transformers' ``text_model.``
  (transformers 5 dropped it); alpha from the ``lora_adapter_metadata`` JSON that diffusers writes
  (``unet.lora_alpha``, ``unet.alpha_pattern``, ``use_rslora``; per component), from ``<module>.alpha`` keys, or
  else equal to the rank (scale 1). The older diffusers spellings (``...attn1.processor.to_q_lora.down.weight``,
  ``...lora.down.weight``, ``...lora_linear_layer.down.weight``) are read too.

Scale of one layer: ``multiplier * alpha / rank`` (``alpha / sqrt(rank)`` for rsLoRA; 1 without alpha), as
A1111, kohya and PEFT compute it.

Refused, with a :class:`LoraError` naming the file and the reason: the LyCORIS types other than LoCon (LoHa,
LoKr, (IA)^3, full weight differences, GLoRA, norm, OFT/BOFT; also LoCon's CP-decomposed ``lora_mid`` and DoRA),
a LoRA made for another family (SD 1.x, SD 2.x, SDXL, the SDXL refiner: told from its cross-attention or
text-encoder width), one with layers of a network the model lacks (a second text encoder on SD 1.x/2.x, a first one
on the SDXL refiner), layers that match no layer of the model (how many, and a few of them) or whose shapes do not
fit. An SD 1.x LoRA's text-encoder layers alone fit SDXL's first text encoder (the same CLIP ViT-L shapes) and are
applied there, as diffusers does.

Application (:func:`merge`), chosen by how the network holds its weights:

* resident weights (memory modes 1 and 2, fp32 or the compute dtype): each touched layer gets a new weight,
  ``W + sum(scale * up @ down)`` computed in fp32 (one ``addmm`` per LoRA into a copy), and the original
  tensor object is kept until :meth:`MergeHandle.restore` puts it back. Nothing is subtracted, so un-merging is
  exact, and a long-lived engine can serve each request with other LoRAs. While merged, the originals of the
  touched layers stay in memory beside the merged copies (none where they are views of an fp32 file).
* prepacked layers (:mod:`sdlite.engine.packing`): the packed weight is unpacked (``to_dense()`` returns the
  exact fp32 weight it was packed from), merged as above and packed again; the original packed tensor is kept
  and put back by ``restore()``.
* streamed weights (memory mode 0's UNet and SDXL text encoders, ``weight_dtype`` fp16 -- SDXL's default on the
  CPU for half-precision files --, text encoders kept as stored): the network's
  :class:`~sdlite.engine.memory.WeightStreamer` materialises each block's weights just before the block runs;
  the touched layers' weights are merged there, with the same arithmetic as above, so the result is bit for bit
  the one a resident merge gives, and nothing is kept but the LoRA's own factors. The per-step cost is one
  fp32 copy and one rank-r ``addmm`` per touched layer, independent of the image size (``bench/lora.py``).

Quantized layers (``--quantize``) keep no float weight to merge into: refused.

A 4-input-channel LoRA of ``conv_in`` on an inpainting UNet (9 channels) covers the first 4, as A1111 pads it.

For prompts and infotexts: :func:`find_lora` finds the file a ``<lora:NAME:W>`` tag means (by stem in a LoRA
folder and its sub-folders, then by kohya's ``ss_output_name``), :func:`lora_name` and :func:`lora_hash` give
the ``Lora hashes`` entry: A1111's short hash, the first 12 hex digits of kohya's "addnet" hash (the sha256 of
a safetensors file's bytes after its header) or of the whole file's sha256 for other formats; a
``sshs_model_hash`` in the file's metadata takes precedence, as in A1111 (``extensions-builtin/Lora/network.py``,
``modules/hashes.py``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence, Union

import torch
from torch import nn

from .engine.packing import PackedConv2d, PackedLinear
from .errors import CheckpointError, SDLiteError

COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
TEXT_COMPONENTS = ("text_encoder", "text_encoder_2")
_MAX_LISTED = 5
_DENSE = (nn.Linear, nn.Conv2d)
_PACKED = (PackedLinear, PackedConv2d)

# widths that tell the family a LoRA was made for (SDXL's first text encoder is as wide as SD 1.x's)
_CROSS_ATTENTION_FAMILY = {768: "SD 1.x", 1024: "SD 2.x", 2048: "SDXL", 1280: "the SDXL refiner"}
_TEXT_WIDTH_FAMILY = {768: "SD 1.x", 1024: "SD 2.x", 1280: "SDXL"}
# a model's family (ModelSpec.family, "-inpaint" removed) as messages name it
_SPEC_FAMILY = {"sd1": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL", "sdxl-refiner": "the SDXL refiner"}
# what a layer of each component is called in the two file formats (for messages)
_COMPONENT_KEYS = {"unet": "lora_unet_ / unet.", "text_encoder": "lora_te_ or lora_te1_ / text_encoder.",
                   "text_encoder_2": "lora_te2_ / text_encoder_2."}

# LyCORIS and other network types, by the key parts that give them away
_UNSUPPORTED = (
    (("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"), "LyCORIS LoHa (hada_*)"),
    (("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
     "LyCORIS LoKr (lokr_*)"),
    (("on_input",), "LyCORIS (IA)^3 (weight + on_input)"),
    (("diff", "diff_b"), "a full weight difference (LyCORIS 'full': diff)"),
    (("a1.weight", "a2.weight", "b1.weight", "b2.weight"), "LyCORIS GLoRA (a1/a2/b1/b2)"),
    (("w_norm", "b_norm"), "LyCORIS norm-layer weights (w_norm/b_norm)"),
    (("oft_blocks", "oft_diag", "oft_R.weight", "rescale"), "OFT/BOFT (oft_*)"),
    (("lora_mid.weight",), "LoCon with a CP-decomposed kernel (lora_mid)"),
    (("dora_scale", "lora_magnitude_vector"), "DoRA (dora_scale / lora_magnitude_vector)"),
    (("lora_B.bias", "lora_up.bias"), "LoRA with a bias (lora_B.bias)"),
    (("lora_embedding_A", "lora_embedding_B"), "an embedding LoRA (lora_embedding_*)"),
)
_UNSUPPORTED_PART = {part: name for parts, name in _UNSUPPORTED for part in parts}

_KOHYA = re.compile(r"^lora_(unet|te|te1|te2)_([^.]+)\.(.+)$")
# dotted (diffusers / PEFT) keys: module path, then the LoRA part
_DOTTED_PARTS = (
    (re.compile(r"^(.+)\.lora_A(?:\.[^.]+)?\.weight$"), "down"),
    (re.compile(r"^(.+)\.lora_B(?:\.[^.]+)?\.weight$"), "up"),
    (re.compile(r"^(.+)\.lora(?:_linear_layer)?\.down\.weight$"), "down"),
    (re.compile(r"^(.+)\.lora(?:_linear_layer)?\.up\.weight$"), "up"),
    (re.compile(r"^(.+)_lora\.down\.weight$"), "down"),      # attention processors: to_q_lora.down.weight
    (re.compile(r"^(.+)_lora\.up\.weight$"), "up"),
    (re.compile(r"^(.+)\.alpha$"), "alpha"),
)
_KOHYA_PARTS = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}
# the old attention-processor names: (component, name) -> module
_PROCESSOR_NAMES = {
    ("unet", "to_q"): "to_q", ("unet", "to_k"): "to_k", ("unet", "to_v"): "to_v", ("unet", "to_out"): "to_out.0",
    ("text_encoder", "to_q"): "q_proj", ("text_encoder", "to_k"): "k_proj", ("text_encoder", "to_v"): "v_proj",
    ("text_encoder", "to_out"): "out_proj",
    ("text_encoder_2", "to_q"): "q_proj", ("text_encoder_2", "to_k"): "k_proj", ("text_encoder_2", "to_v"): "v_proj",
    ("text_encoder_2", "to_out"): "out_proj",
}
_PEFT_PREFIXES = {"unet": "unet", "text_encoder": "text_encoder", "text_encoder_2": "text_encoder_2",
                  "transformer": "transformer"}
METADATA_KEY = "lora_adapter_metadata"   # diffusers' JSON of each component's peft LoraConfig


class LoraError(SDLiteError, ValueError):
    """A LoRA file that cannot be used; ``str(err)`` names the file and the reason."""

    def __init__(self, message: str, path: str | os.PathLike | None = None):
        super().__init__(message, path)
        self.message = message
        self.path = os.fspath(path) if path is not None else None

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def _listing(items: Sequence[str], n: int = _MAX_LISTED) -> str:
    items = list(items)
    return ", ".join(repr(k) for k in items[:n]) + (", ..." if len(items) > n else "")


@dataclass
class LoraLayer:
    """One low-rank update: ``delta W = scale * up @ down`` of one layer.

    ``target`` names the layer as the file does: a dotted module path (diffusers / PEFT, e.g.
    ``down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q``) or kohya's underscored one (without the
    ``lora_unet_`` / ``lora_te_`` prefix, e.g. ``input_blocks_1_1_proj_in``); :func:`merge` finds the module.
    ``down``: (r, in) or (r, in, kh, kw); ``up``: (out, r) or (out, r, 1, 1).
    """

    component: str                 # "unet" | "text_encoder" (| "text_encoder_2": an SDXL file)
    target: str
    key: str                       # the file's key of ``down`` (for messages)
    down: torch.Tensor
    up: torch.Tensor
    alpha: float | None = None     # None: scale 1 (alpha = rank)
    rslora: bool = False           # scale alpha / sqrt(rank) (PEFT's use_rslora)

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def kind(self) -> str:
        """``linear`` (2-D factors) or ``conv`` (4-D: 1x1, or kxk for LoCon; ``kernel`` tells which)."""
        return "conv" if self.down.dim() == 4 else "linear"

    @property
    def kernel(self) -> tuple[int, int]:
        return tuple(self.down.shape[2:]) if self.down.dim() == 4 else (1, 1)

    @property
    def in_features(self) -> int:
        return self.down.shape[1]

    @property
    def out_features(self) -> int:
        return self.up.shape[0]

    def scale(self, multiplier: float = 1.0) -> float:
        if self.alpha is None:
            return float(multiplier)
        return float(multiplier) * self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass
class Lora:
    """A parsed LoRA file, independent of its format."""

    path: str
    format: str                    # "kohya" | "peft" | "diffusers-legacy"
    layers: list[LoraLayer]
    metadata: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The name A1111 shows (its training's ``ss_output_name``, else the file's stem)."""
        return self.metadata.get("ss_output_name") or Path(self.path).stem

    def components(self) -> list[str]:
        return sorted({layer.component for layer in self.layers})

    def layers_of(self, component: str) -> list[LoraLayer]:
        return [layer for layer in self.layers if layer.component == component]

    def _widths(self, component: str) -> list[int]:
        """The in-features of the layers that tell ``component``'s family: the UNet's ``attn2.to_k`` / ``to_v``
        (the cross-attention width), a text encoder's q/k/v projections and first MLP layer (its width)."""
        if component == "unet":
            pattern = re.compile(r"attn2[._]to_[kv]$")
        else:
            pattern = re.compile(r"(self_attn[._][qkv]_proj|mlp[._]fc1)$")
        return [layer.in_features for layer in self.layers_of(component) if pattern.search(layer.target)]

    @property
    def made_for_sdxl(self) -> bool:
        """Whether the file shows it was made for SDXL: layers of a second text encoder, kohya's SDXL prefixes
        (``lora_te1_`` / ``lora_te2_``), layers of the added-conditioning MLP, or SDXL's cross-attention widths."""
        return (any(layer.component == "text_encoder_2" or layer.key.startswith(("lora_te1_", "lora_te2_"))
                    or re.match(r"(add_embedding|label_emb)[._]", layer.target) for layer in self.layers)
                or any(width in (2048, 1280) for width in self._widths("unet")))

    def implied_family(self, component: str) -> tuple[str | None, int] | None:
        """(family, width) the LoRA's shapes imply for ``component``: the cross-attention width (UNet: the
        in-features of ``attn2.to_k`` / ``to_v``) or the text encoder's width; None where it has no such layer.
        The family is None for widths of no released model (a LoRA for a model of another size)."""
        widths = self._widths(component)
        if not widths:
            return None
        width = max(set(widths), key=widths.count)
        if component == "unet":
            return _CROSS_ATTENTION_FAMILY.get(width), width
        if component == "text_encoder" and width == 768 and self.made_for_sdxl:
            return "SDXL", width           # SDXL's CLIP ViT-L is as wide as SD 1.x's
        return _TEXT_WIDTH_FAMILY.get(width), width

    def __repr__(self) -> str:
        ranks = sorted({layer.rank for layer in self.layers})
        return (f"Lora({self.path!r}, format={self.format!r}, layers={len(self.layers)}, ranks={ranks}, "
                f"components={self.components()})")


# --- reading ----------------------------------------------------------------------------------------------------


def read_lora(path: str | os.PathLike) -> Lora:
    """Parse a LoRA file (kohya/A1111 or diffusers/PEFT; see the module doc). Refuses unsupported network types
    with a :class:`LoraError`; whether the layers fit a model is checked by :func:`merge`."""
    from .weights.io import open_checkpoint

    path = os.fspath(path)
    try:
        store = open_checkpoint(path)
    except CheckpointError as e:
        raise LoraError(e.message if e.key is None else f"tensor {e.key!r}: {e.message}", path) from None
    try:
        keys = list(store.keys())
        metadata = dict(store.metadata)
        tensors = {}
        for key in keys:
            try:
                tensors[key] = store[key].clone()
            except CheckpointError as e:
                raise LoraError(f"tensor {key!r}: {e.message}", path) from None
    finally:
        store.close()
    if not keys:
        raise LoraError("the file holds no tensors", path)
    _refuse_unsupported(path, keys)
    kohya = [k for k in keys if _KOHYA.match(k)]
    if kohya and len(kohya) == len(keys):
        return Lora(path, "kohya", _kohya_layers(path, tensors), metadata)
    if kohya:
        others = [k for k in keys if not _KOHYA.match(k)]
        raise LoraError(f"mixes kohya keys (lora_unet_/lora_te_) with {len(others)} others: {_listing(others)}",
                        path)
    return _dotted_lora(path, tensors, metadata)


def _refuse_unsupported(path: str, keys: list[str]) -> None:
    found: dict[str, list[str]] = {}
    for key in keys:
        dotted = f".{key}."
        name = next((kind for part, kind in _UNSUPPORTED_PART.items() if f".{part}." in dotted), None)
        if name is None and key.startswith("bundle_emb."):
            name = "bundled textual-inversion embeddings (bundle_emb.*)"
        if name is not None:
            found.setdefault(name, []).append(key)
    if not found:
        return
    kinds = "; ".join(f"{name}: {len(ks)} keys, e.g. {ks[0]!r}" for name, ks in found.items())
    raise LoraError(f"not a plain LoRA: {kinds}. sdlite applies LoRA and LoCon (lora_down/lora_up, lora_A/lora_B) "
                    "only", path)


def _scalar(path: str, key: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise LoraError(f"{key!r} should be a single number (alpha), not a tensor of shape {list(tensor.shape)}",
                        path)
    return float(tensor.float().item())


def _assemble(path: str, groups: dict, alpha_for=None) -> list[LoraLayer]:
    """``groups``: (component, target) -> {"down": (key, tensor), "up": ..., "alpha": ...}."""
    layers = []
    for (component, target), parts in groups.items():
        if "down" not in parts or "up" not in parts:
            if "down" in parts or "up" in parts:
                have, lack = ("down", "up") if "down" in parts else ("up", "down")
                raise LoraError(f"{parts[have][0]!r} has no matching {lack} weight", path)
            raise LoraError(f"{parts['alpha'][0]!r} has no matching down/up weights", path)
        (down_key, down), (up_key, up) = parts["down"], parts["up"]
        if down.dim() not in (2, 4) or up.dim() not in (2, 4) or (up.dim() == 4 and tuple(up.shape[2:]) != (1, 1)):
            raise LoraError(f"{down_key!r} {list(down.shape)} and {up_key!r} {list(up.shape)} are not the shapes "
                            "of a LoRA (down: (r, in) or (r, in, kh, kw); up: (out, r) or (out, r, 1, 1))", path)
        if up.shape[1] != down.shape[0]:
            raise LoraError(f"{up_key!r} {list(up.shape)} does not match {down_key!r} {list(down.shape)}: ranks "
                            f"{up.shape[1]} and {down.shape[0]}", path)
        alpha, rslora = None, False
        if "alpha" in parts:
            alpha = _scalar(path, *parts["alpha"])
        elif alpha_for is not None:
            alpha, rslora = alpha_for(component, target, down.shape[0])
        layers.append(LoraLayer(component, target, down_key, down, up, alpha, rslora))
    layers.sort(key=lambda layer: (layer.component, layer.target))
    return layers


def _kohya_layers(path: str, tensors: dict) -> list[LoraLayer]:
    groups: dict = {}
    unknown = []
    for key, tensor in tensors.items():
        prefix, target, part = _KOHYA.match(key).groups()
        role = _KOHYA_PARTS.get(part)
        if role is None:
            unknown.append(key)
            continue
        component = {"unet": "unet", "te": "text_encoder", "te1": "text_encoder", "te2": "text_encoder_2"}[prefix]
        groups.setdefault((component, target), {})[role] = (key, tensor)
    if unknown:
        raise LoraError(f"{len(unknown)} keys are not LoRA weights (lora_down/lora_up/alpha): {_listing(unknown)}",
                        path)
    return _assemble(path, groups)


def _peft_alphas(path: str, metadata: dict):
    """alpha_for(component, target, rank) from diffusers' ``lora_adapter_metadata`` (peft LoraConfig fields)."""
    raw = metadata.get(METADATA_KEY)
    if not raw:
        return None
    try:
        config = json.loads(raw)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise LoraError(f"metadata {METADATA_KEY!r} is not usable JSON ({e})", path) from None
    for key, value in config.items():
        if key.endswith((".use_dora",)) and value:
            raise LoraError(f"DoRA ({key} = true) is not supported: sdlite applies LoRA and LoCon only", path)

    def alpha_for(component: str, target: str, rank: int):
        get = lambda name, default=None: config.get(f"{component}.{name}", default)   # noqa: E731
        alpha = get("lora_alpha")
        for pattern, value in (get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", target):
                alpha = value
                break
        if alpha is None:
            return None, False
        return float(alpha), bool(get("use_rslora", False))

    return alpha_for


def _dotted_lora(path: str, tensors: dict, metadata: dict) -> Lora:
    groups: dict = {}
    unknown, legacy = [], False
    for key, tensor in tensors.items():
        name = key.removeprefix("base_model.model.")
        head, _, rest = name.partition(".")
        component = _PEFT_PREFIXES.get(head)
        if component is None:   # a bare network's keys (peft's own save of one model)
            component, rest = ("text_encoder" if head == "text_model" else "unet"), name
        for pattern, role in _DOTTED_PARTS:
            match = pattern.match(rest)
            if match:
                break
        else:
            unknown.append(key)
            continue
        target = match.group(1)
        if "lora_A" not in key and "lora_B" not in key and role != "alpha":
            legacy = True
        target = target.replace(".processor.", ".")
        if pattern.pattern.startswith(r"^(.+)_lora"):   # attention processors: ...attn1.processor.to_q_lora
            module, _, proc = target.rpartition(".")
            mapped = _PROCESSOR_NAMES.get((component, proc))
            if mapped is None:
                unknown.append(key)
                continue
            target = f"{module}.{mapped}"
        if role == "alpha":   # <module>.alpha, or the alpha of its down weight
            target = re.sub(r"(_lora|\.lora|\.lora_linear_layer)?\.(down|lora_A)\.weight$", "", target)
        groups.setdefault((component, target), {})[role] = (key, tensor)
    if unknown:
        raise LoraError(f"{len(unknown)} keys are neither kohya (lora_unet_*/lora_te_*) nor diffusers/PEFT "
                        f"(*.lora_A.weight/*.lora_B.weight) LoRA weights: {_listing(unknown)}", path)
    return Lora(path, "diffusers-legacy" if legacy else "peft",
                _assemble(path, groups, _peft_alphas(path, metadata)), metadata)


# --- finding LoRAs by name -------------------------------------------------------------------------------------

EXTENSIONS = (".safetensors", ".pt", ".ckpt")
SHIPPED_DIR = Path(__file__).resolve().parent / "data" / "loras"   # LoRAs that come with sdlite (the demo's)


def _candidates(folders: Iterable[Path]) -> list[Path]:
    files = []
    for folder in folders:
        if folder.is_dir():
            files += sorted(p for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS and p.is_file())
    return files


def _alias(path: Path) -> str | None:
    """A safetensors file's ``ss_output_name`` (kohya's training name), read from its header only."""
    if path.suffix.lower() != ".safetensors":
        return None
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 100 << 20:
                return None
            return (json.loads(f.read(n)).get("__metadata__") or {}).get("ss_output_name")
    except (OSError, ValueError, AttributeError):
        return None


def find_lora(name: str, lora_dir: str | os.PathLike | None = None) -> str:
    """The file a ``<lora:NAME:...>`` prompt tag means, as A1111 finds it: a file whose stem is ``name`` (``.safetensors``,
    ``.pt`` or ``.ckpt``, in ``lora_dir`` and its sub-folders, then among the LoRAs shipped with sdlite), else one
    whose training name (``ss_output_name`` metadata) is ``name``. Not found: a :class:`LoraError` listing what
    is there."""
    folders = ([Path(lora_dir)] if lora_dir is not None else []) + [SHIPPED_DIR]
    files = _candidates(folders)
    for match in (lambda p: p.stem == name, lambda p: p.stem.lower() == name.lower(), lambda p: _alias(p) == name):
        found = [p for p in files if match(p)]
        if found:
            return str(found[0])
    where = " or ".join(str(f) for f in folders if f.is_dir()) or "no LoRA folder (give one with --lora-dir)"
    names = sorted({p.stem for p in files})
    have = f"; there: {_listing(names, 10)}" if names else "; there is none there"
    raise LoraError(f"<lora:{name}:...>: no LoRA named {name!r} (NAME.safetensors, .pt or .ckpt) in {where}{have}")


def list_loras(lora_dir: str | os.PathLike | None = None) -> list[Path]:
    """Every LoRA file a ``<lora:NAME:...>`` tag can name: those in ``lora_dir`` (and its sub-folders), then the
    ones shipped with sdlite, in the order :func:`find_lora` searches them."""
    return _candidates(([Path(lora_dir)] if lora_dir is not None else []) + [SHIPPED_DIR])


def lora_alias(path: str | os.PathLike) -> str:
    """The name A1111 shows a LoRA under: its training name (``ss_output_name`` metadata), else its stem."""
    return _alias(Path(path)) or Path(path).stem


def lora_name(path: str | os.PathLike) -> str:
    """The name A1111 writes for a LoRA in ``Lora hashes``: the file's stem (the name its prompt tag uses)."""
    return Path(path).stem


# --- hashes -----------------------------------------------------------------------------------------------------


def lora_hash(path: str | os.PathLike, short: bool = True) -> str:
    """A1111's LoRA hash (``Lora hashes`` infotext): a safetensors file's ``sshs_model_hash`` metadata, else
    kohya's "addnet" hash (sha256 of the bytes after the safetensors header); the file's sha256 for other
    formats. ``short``: the first 12 hex digits, as A1111 writes it."""
    path = os.fspath(path)
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            is_safetensors = path.lower().endswith(".safetensors") and len(head) == 8
            if is_safetensors:
                n = int.from_bytes(head, "little")
                try:
                    header = json.loads(f.read(n))
                    stored = (header.get("__metadata__") or {}).get("sshs_model_hash")
                except ValueError:
                    stored = None
                if stored:
                    return stored[:12] if short else stored
                f.seek(8 + n)
            else:
                f.seek(0)
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as e:
        raise LoraError(f"cannot read the file ({e.strerror or e})", path) from None
    value = digest.hexdigest()
    return value[:12] if short else value


def lora_hashes_infotext(named: Iterable[tuple[str, str | os.PathLike]]) -> str:
    """The value of A1111's ``Lora hashes`` infotext field for ``(name, path)`` pairs: ``name: hash, ...``
    (``:`` and ``,`` dropped from the names, as A1111 does)."""
    return ", ".join(f"{name.replace(':', '').replace(',', '')}: {lora_hash(path)}" for name, path in named)


# --- applying ---------------------------------------------------------------------------------------------------

LoraSource = Union[Lora, str, os.PathLike]
Weight = Union[float, Mapping[str, float]]


def _as_lora(source: LoraSource) -> Lora:
    return source if isinstance(source, Lora) else read_lora(source)


def _multiplier(weight: Weight, component: str) -> float:
    """The multiplier of ``component``; a mapping without ``text_encoder_2`` gives SDXL's second text encoder the
    first one's (A1111's text-encoder multiplier applies to both)."""
    if isinstance(weight, Mapping):
        if component == "text_encoder_2" and component not in weight:
            component = "text_encoder"
        return float(weight.get(component, 1.0))
    return float(weight)


def _layer_shape(layer: nn.Module) -> tuple[int, ...] | None:
    """(out, in) or (out, in/groups, kh, kw) of a Linear/Conv2d, plain or prepacked; None for other modules."""
    if isinstance(layer, PackedLinear):
        return (layer.out_features, layer.in_features)
    if isinstance(layer, PackedConv2d):
        return (layer.out_channels, layer.in_channels // layer.groups, *layer.kernel_size)
    if isinstance(layer, _DENSE):
        return tuple(layer.weight.shape)
    return None


def _lookup(module: nn.Module, component: str) -> dict[str, str]:
    """Every name a file may give a layer -> its module path: dotted and underscored (kohya), the text encoder's
    without ``text_model.`` (transformers 5's naming), the UNet's in the original LDM layout."""
    table: dict[str, str] = {}
    leaves = [(name, layer) for name, layer in module.named_modules()
              if name and not any(True for _ in layer.children())]
    for name, _ in leaves:
        aliases = [name]
        if component in TEXT_COMPONENTS and name.startswith("text_model."):
            aliases.append(name.removeprefix("text_model."))
        for alias in aliases:
            table.setdefault(alias, name)
            table.setdefault(alias.replace(".", "_"), name)
    config = getattr(module, "config", None)
    if component == "unet" and config is not None and hasattr(config, "attention"):
        from .weights.convert import unet_to_original

        try:
            plan = unet_to_original([f"{name}.weight" for name, _ in leaves], config, prefix="")
        except SDLiteError:
            plan = None
        if plan is not None:
            for original, entry in plan.entries.items():
                table.setdefault(original.removesuffix(".weight").replace(".", "_"), entry.sources[0][:-7])
    return table


def _spec_family(spec) -> str | None:
    """How messages name the family of the model ``spec`` describes (None: no spec, or a family without a name)."""
    if spec is None:
        return None
    family = getattr(spec, "family", "")
    return _SPEC_FAMILY.get(family) or _SPEC_FAMILY.get(family.removesuffix("-inpaint"))


def _model_family(component: str, module: nn.Module, spec=None) -> tuple[str | None, int] | None:
    """(family name, width) of ``module``: its cross-attention width (UNet) or its width (a text encoder); the
    name from ``spec`` where given, else from the width."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    width = getattr(config, "context_dim" if component == "unet" else "width", None)
    if width is None:
        return None
    if spec is not None:
        return _spec_family(spec), width
    return (_CROSS_ATTENTION_FAMILY if component == "unet" else _TEXT_WIDTH_FAMILY).get(width), width


def _model_components(spec) -> tuple[str, ...]:
    return ("unet", *spec.text_encoders)


def check_components(lora: Lora, spec) -> None:
    """Refuse a LoRA with layers of a network the model of ``spec`` does not have: a second text encoder (an SDXL
    LoRA on SD 1.x/2.x), a first one (an SDXL base LoRA on the refiner, which has only the second)."""
    have = _model_components(spec)
    name = _spec_family(spec)
    this = f", this model is {name}" if name else ""
    if lora.layers_of("text_encoder_2") and "text_encoder_2" not in have:
        raise LoraError(f"made for SDXL (it has layers of a second text encoder: {_COMPONENT_KEYS['text_encoder_2']})"
                        f"{this}, which has one text encoder", lora.path)
    if lora.layers_of("text_encoder") and "text_encoder" not in have:
        made = ("made for the SDXL base model" if lora.made_for_sdxl
                else "made for a model with a CLIP ViT-L text encoder")
        raise LoraError(f"{made} (it has layers of a first text encoder: {_COMPONENT_KEYS['text_encoder']}){this}, "
                        f"whose only text encoder is {', '.join(c for c in have if c != 'unet')}", lora.path)


def check_family(lora: Lora, component: str, module: nn.Module, spec=None) -> None:
    """Refuse a LoRA whose shapes imply another family than ``module``'s (the ``component`` network of the model
    ``spec`` describes, where given), saying which. Without ``spec`` a LoRA with layers of a second text encoder
    is refused for a ``text_encoder``: nothing tells that the model has a second one (SDXL's first text encoder
    has SD 1.x's shapes); ``engine_with_loras`` passes the engine's spec."""
    if component == "text_encoder" and lora.layers_of("text_encoder_2") and (
            spec is None or "text_encoder_2" not in spec.text_encoders):
        model = _model_family("text_encoder", module, spec)
        this = f", this model is {model[0]}" if model and model[0] else ""
        hint = "" if spec is not None else " (for SDXL's first text encoder, pass the model's spec)"
        raise LoraError(f"made for SDXL (it has layers of a second text encoder: lora_te2_ / text_encoder_2){this}"
                        f"{hint}", lora.path)
    implied = lora.implied_family(component)
    model = _model_family(component, module, spec)
    if implied is None or model is None or implied[1] == model[1]:
        return
    what = "cross-attention width" if component == "unet" else "text-encoder width"
    made = f"{implied[0]} ({what} {implied[1]})" if implied[0] else f"a model of {what} {implied[1]}"
    this = f"this model is {model[0]} ({model[1]})" if model[0] else f"this model's {what} is {model[1]}"
    raise LoraError(f"made for {made}, {this}", lora.path)


def resolve_targets(module: nn.Module, lora: Lora, component: str, _table: dict | None = None,
                    spec=None) -> dict[str, str]:
    """The module path in ``module`` (the ``component`` network) of each of ``lora``'s layers, by the file's key of
    its down weight. Refuses a LoRA made for another family and one with layers that match nothing."""
    table = _lookup(module, component) if _table is None else _table
    check_family(lora, component, module, spec)
    layers = lora.layers_of(component)
    unmatched = [layer.key for layer in layers if table.get(layer.target) is None]
    if unmatched:
        raise LoraError(f"{len(unmatched)} of its {len(layers)} {component.replace('_', ' ')} layers match no "
                        f"layer of this model: {_listing(unmatched)}", lora.path)
    return {layer.key: table[layer.target] for layer in layers}


@dataclass
class _Update:
    """One LoRA's factors for one layer, ready to add: ``weight.view(out, -1) += scale * up @ down``."""

    up: torch.Tensor        # (out, r) fp32 on the layer's device
    down: torch.Tensor      # (r, in * kh * kw)
    scale: float
    pad_in: int = 0         # input channels to zero-pad (a 4-channel LoRA on an inpainting UNet's conv_in)


def _plan(module: nn.Module, loras: Sequence[tuple[Lora, Weight]], component: str,
          device: torch.device | None = None, materialise: bool = True, spec=None) -> dict[str, list[_Update]]:
    """Module path -> updates; every check done before anything is changed."""
    if component not in COMPONENTS:
        raise ValueError(f"component {component!r}: expected one of {', '.join(COMPONENTS)}")
    table = _lookup(module, component)
    plan: dict[str, list[_Update]] = {}
    for lora, weight in loras:
        names = resolve_targets(module, lora, component, table, spec)
        multiplier = _multiplier(weight, component)
        for layer in lora.layers_of(component):
            name = names[layer.key]
            target = module.get_submodule(name)
            shape = _layer_shape(target)
            if shape is None:
                kind = type(target).__name__
                if type(target).__module__.endswith(".quant"):
                    raise LoraError(f"{layer.key!r}: layer {name!r} is quantized ({kind}) and keeps no float weight "
                                    "to merge into: run without --quantize to use LoRAs", lora.path)
                raise LoraError(f"{layer.key!r}: layer {name!r} is a {kind}, not a Linear or Conv2d layer",
                                lora.path)
            _check_shapes(lora.path, layer, name, shape)
            pad = shape[1] - layer.in_features if len(shape) == 4 else 0
            if not materialise:
                continue
            dev = device or _device_of(target)
            up = layer.up.reshape(layer.out_features, layer.rank).to(dev, torch.float32)
            down = layer.down.reshape(layer.rank, -1).to(dev, torch.float32)
            plan.setdefault(name, []).append(_Update(up, down, layer.scale(multiplier), pad))
    return plan


def _device_of(layer: nn.Module) -> torch.device:
    if isinstance(layer, _PACKED):
        return torch.device("cpu")
    return layer.weight.device if layer.weight.device.type != "meta" else torch.device("cpu")


def _check_shapes(path: str, layer: LoraLayer, name: str, shape: tuple[int, ...]) -> None:
    out, inp = shape[0], shape[1]
    kernel = tuple(shape[2:]) if len(shape) == 4 else (1, 1)
    down_kernel = tuple(layer.down.shape[2:]) if layer.down.dim() == 4 else (1, 1)
    problem = None
    if layer.out_features != out:
        problem = f"{layer.out_features} outputs, the layer has {out}"
    elif layer.in_features != inp and not (len(shape) == 4 and name == "conv_in" and layer.in_features < inp):
        problem = f"{layer.in_features} inputs, the layer has {inp}"
    elif down_kernel != kernel:
        problem = f"a {down_kernel[0]}x{down_kernel[1]} kernel, the layer has {kernel[0]}x{kernel[1]}"
    if problem:
        raise LoraError(f"{layer.key!r} does not fit {name!r}: the LoRA has {problem}", path)


def _add_updates(weight: torch.Tensor, updates: Sequence[_Update]) -> torch.Tensor:
    """``weight`` (a fresh fp32 tensor, changed in place) plus each update, in order. The one function that
    merges, for resident and streamed weights alike, so both give the same bits."""
    weight = weight.contiguous()   # a channels-last copy (the bf16 precision's convolutions): made plain
    flat = weight.view(weight.shape[0], -1)
    for u in updates:
        if u.pad_in:   # conv_in of an inpainting UNet: the LoRA covers the first input channels only
            delta = (u.up @ u.down).view(weight.shape[0], -1, *weight.shape[2:])
            weight[:, :delta.shape[1]].add_(delta, alpha=u.scale)
        else:
            flat.addmm_(u.up, u.down, alpha=u.scale)
    return weight


def _repack(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered as :class:`~sdlite.engine.packing.PackedConv2d` / ``PackedLinear`` pack theirs."""
    weight = weight.contiguous()
    if isinstance(layer, PackedConv2d):
        return torch.ops.mkldnn._reorder_convolution_weight(weight, list(layer.padding), list(layer.stride),
                                                            list(layer.dilation), layer.groups, None)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


class MergeHandle:
    """What :func:`merge` changed, and how to undo it: :meth:`restore` puts the saved originals back."""

    def __init__(self, module: nn.Module, component: str, mode: str):
        self.module, self.component, self.mode = module, component, mode   # mode: "merged" | "on the fly"
        self.layers = 0
        self._undo: list = []
        self.keeps_originals = True

    @property
    def active(self) -> bool:
        return bool(self._undo)

    def restore(self) -> None:
        """Undo, last change first. Several handles on one network are restored last first (as
        :func:`engine_with_loras` does): each puts back what was there before it."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "MergeHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"MergeHandle({self.component}, {self.mode}, {self.layers} layers, active={self.active})"


def merge(module: nn.Module, loras: Sequence[tuple[LoraSource, Weight]], component: str,
          keep_originals: bool = True, spec=None) -> MergeHandle:
    """Apply ``loras`` (``(Lora or path, multiplier)``; a multiplier may be ``{"unet": a, "text_encoder": b}``,
    SDXL's ``text_encoder_2`` taking ``b`` unless given its own) to ``module``, the ``component`` network
    (``unet``, ``text_encoder`` or ``text_encoder_2``), and return the handle that undoes it.

    Resident weights are merged now; a streamed network's (:func:`sdlite.engine.memory.streamed_model`) are
    merged block by block as they are materialised (:func:`apply_on_the_fly`). Everything is checked first: a
    :class:`LoraError` leaves the module as it was. ``keep_originals=False`` keeps nothing to restore (for a
    network that is discarded after use). ``spec``: the :class:`~sdlite.config.ModelSpec` of the model
    ``module`` belongs to, for the family checks (needed to merge an SDXL LoRA into SDXL's first text encoder)."""
    loaded = [(_as_lora(source), weight) for source, weight in loras]
    if getattr(module, "_streamer", None) is not None:
        return apply_on_the_fly(module, loaded, component, spec=spec)
    plan = _plan(module, loaded, component, spec=spec)
    handle = MergeHandle(module, component, "merged")
    handle.keeps_originals = keep_originals
    try:
        with torch.no_grad():
            for name, updates in plan.items():
                _merge_layer(module.get_submodule(name), updates, handle, keep_originals)
                handle.layers += 1
    except BaseException:
        handle.restore()
        raise
    return handle


def _merge_layer(layer: nn.Module, updates: Sequence[_Update], handle: MergeHandle, keep: bool) -> None:
    if isinstance(layer, _PACKED):
        original = layer.packed
        layer.packed = _repack(layer, _add_updates(original.to_dense(), updates))   # to_dense(): a fresh copy
        if keep:
            handle._undo.append(lambda: setattr(layer, "packed", original))
        return
    original = layer._parameters["weight"]
    merged = _add_updates(original.detach().to(torch.float32, copy=True), updates).to(original.dtype)
    if original.dim() == 4 and not original.is_contiguous() and \
            original.is_contiguous(memory_format=torch.channels_last):
        merged = merged.contiguous(memory_format=torch.channels_last)   # the layer keeps its layout
    layer._parameters["weight"] = nn.Parameter(merged, requires_grad=False)
    if keep:
        handle._undo.append(lambda: layer._parameters.__setitem__("weight", original))


def apply_on_the_fly(module: nn.Module, loras: Sequence[tuple[LoraSource, Weight]], component: str,
                     spec=None) -> MergeHandle:
    """Apply ``loras`` to a streamed network: each touched layer's weight is merged when its block's weights are
    materialised (its ``WeightStreamer`` provider is wrapped), with :func:`merge`'s arithmetic; ``restore()``
    unwraps it. Costs one fp32 copy and one rank-r ``addmm`` per touched layer and forward pass."""
    streamer = getattr(module, "_streamer", None)
    if streamer is None:
        raise ValueError("apply_on_the_fly needs a streamed network (sdlite.engine.memory.streamed_model); "
                         "use merge() for resident weights")
    loaded = [(_as_lora(source), weight) for source, weight in loras]
    plan = _plan(module, loaded, component, device=torch.device(streamer.device), spec=spec)
    by_key = {f"{name}.weight": updates for name, updates in plan.items()}
    base = streamer.provider
    device = streamer.device

    def provider(key: str) -> torch.Tensor:
        stored = base(key)
        updates = by_key.get(key)
        if updates is None:
            return stored
        with torch.no_grad():
            return _add_updates(stored.to(device=device, dtype=torch.float32, copy=True), updates)

    streamer.provider = provider
    handle = MergeHandle(module, component, "on the fly")
    handle.layers = len(by_key)

    def undo():
        streamer.provider = base

    handle._undo.append(undo)
    return handle


# --- the engine -------------------------------------------------------------------------------------------------


def _meta_network(spec, component: str) -> nn.Module:
    from .loader import build_network

    with torch.device("meta"):
        return build_network(component, spec)


@contextlib.contextmanager
def engine_with_loras(engine, loras: Sequence[tuple[LoraSource, Weight]]):
    """Within the block, ``engine`` generates with ``loras`` (``(Lora or path, multiplier)``) applied to its UNet
    and text encoder(s) (SDXL: both); on leaving, every touched weight is restored exactly. Yields the parsed
    :class:`Lora` list.

    Works in every memory mode: resident networks are merged now (prepacked layers re-packed), streamed ones
    (memory mode 0's UNet and SDXL text encoders, ``weight_dtype`` fp16, text encoders kept as stored) per block as
    they run, and the networks the :class:`~sdlite.engine.memory.ModelManager` builds while the block runs (the
    text encoders of modes 0 and 2, loaded for each prompt and freed after) as it builds them, without keeping
    originals of those it frees. All files are read and checked against the model first (a network the model lacks,
    another family, layers that match nothing or do not fit); an error changes nothing."""
    loaded = [(_as_lora(source), weight) for source, weight in loras]
    if not loaded:
        yield []
        return
    spec = engine.spec
    components = _model_components(spec)
    touched = [c for c in components if any(lora.layers_of(c) for lora, _ in loaded)]
    manager = engine.models
    resident = dict(manager._resident)
    for component in touched:   # check every layer against the model before touching anything
        module = resident.get(component) or _meta_network(spec, component)
        _plan(module, loaded, component, materialise=False, spec=spec)
    for lora, _ in loaded:
        check_components(lora, spec)
    handles: list[MergeHandle] = []

    def adapt(name: str, module: nn.Module, keep: bool) -> None:
        if name in touched:
            handle = merge(module, loaded, name, keep_originals=keep, spec=spec)
            if keep:
                handles.append(handle)

    # networks the manager builds while the block runs (the text encoders of modes 0 and 2, per use) get the
    # LoRAs through its adapter hook
    try:
        for component in touched:
            if component in resident:
                adapt(component, resident[component], True)
        manager.adapters.append(adapt)
        yield [lora for lora, _ in loaded]
    finally:
        if adapt in manager.adapters:
            manager.adapters.remove(adapt)
        for handle in reversed(handles):
            handle.restore()
        handles.clear()


__all__ = ["Lora", "LoraLayer", "LoraError", "MergeHandle", "read_lora", "merge", "apply_on_the_fly",
           "engine_with_loras", "lora_hash", "lora_hashes_infotext", "check_family", "check_components",
           "resolve_targets", "find_lora", "lora_name"]
