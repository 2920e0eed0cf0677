"""LoRA files' key layouts, told apart and parsed into one form (:class:`Lora`, a list of :class:`LoraLayer`).

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
  ``text_encoder``) and ``lora_te2_`` (OpenCLIP bigG, in transformers' names: ``text_encoder_2``). The few-step
  LoRAs (LCM-LoRA, SDXL-Lightning, DMD2) spell SD 1.x's and SDXL's UNet layers by diffusers' paths instead
  (``lora_unet_down_blocks_1_attentions_0_proj_in``), LoCon on the ResBlocks and samplers, an alpha per layer.
* diffusers / PEFT: ``unet.<module>.lora_A.weight`` / ``.lora_B.weight``, ``text_encoder.<module>...`` and (SDXL)
  ``text_encoder_2.<module>...``, the text encoders' modules with or without transformers' ``text_model.``
  (transformers 5 dropped it); alpha from the ``lora_adapter_metadata`` JSON that diffusers writes
  (``unet.lora_alpha``, ``unet.alpha_pattern``, ``use_rslora``; per component), from ``<module>.alpha`` keys, or
  else equal to the rank (scale 1). The older diffusers spellings (``...attn1.processor.to_q_lora.down.weight``,
  ``...lora.down.weight``, ``...lora_linear_layer.down.weight``) are read too, also mixed with ``lora_A`` / ``lora_B``
  in one file (diffusers' training scripts rename only the attention projections).

* SD3 / SD3.5 (transformer): diffusers / PEFT ``transformer.<module>`` (diffusers' ``SD3Transformer2DModel`` paths,
  ``transformer_blocks.0.attn.to_q``), the same paths underscored after ``lora_transformer_``, and kohya's
  sd-scripts ``lora_unet_`` over the original MMDiT layout (``lora_unet_joint_blocks_0_x_block_attn_qkv``: q, k and
  v in one layer, split to the model's three by :mod:`sdlite.adapters.lora_targets`); text encoders
  ``text_encoder`` / ``lora_te1_`` (CLIP-L), ``text_encoder_2`` / ``lora_te2_`` (bigG), ``text_encoder_3`` /
  ``lora_te3_`` (T5, in transformers' names).
* FLUX.1 (transformer): the same three layouts over FLUX's names: diffusers / PEFT ``transformer.<module>`` (also
  what ai-toolkit writes), ``lora_transformer_``, and kohya's sd-scripts ``lora_unet_`` over BFL's layout
  (``lora_unet_double_blocks_0_img_attn_qkv``, ``lora_unet_single_blocks_0_linear1``: q, k, v (and the single blocks'
  MLP input) in one layer, split to the model's by :mod:`sdlite.adapters.lora_targets`); CLIP-L as ``text_encoder`` /
  ``lora_te1_``, T5 as ``lora_te3_``. And XLabs': ``double_blocks.N.processor.qkv_lora1`` / ``proj_lora1`` (the image
  stream), ``qkv_lora2`` / ``proj_lora2`` (the text stream), ``single_blocks.N.processor.qkv_lora`` / ``proj_lora``,
  ``.down.weight`` / ``.up.weight``, no alpha (scale 1), stacked q/k/v split in three as diffusers' converter does.
* Z-Image (transformer): diffusers / PEFT ``transformer.<module>`` (``ZImageTransformer2DModel``'s paths,
  ``layers.0.attention.to_q``; what ``ZImagePipeline.load_lora_weights`` takes), the same under ComfyUI's and
  ai-toolkit's ``diffusion_model.`` (``lora_A`` / ``lora_B`` or kohya's ``lora_down`` / ``lora_up``, ``.alpha`` keys),
  on diffusers' names or on the original code's (ComfyUI's: ``layers.0.attention.qkv`` with q, k and v stacked,
  ``attention.out``, ``x_embedder``, ``final_layer.linear``; :mod:`sdlite.weights.zimage_keys`), and kohya's
  ``lora_unet_`` over either (``lora_unet_layers_0_attention_qkv``). Its Qwen3 text encoder takes none
  (:func:`sdlite.adapters.lora_targets.check_text_encoders`).
* Qwen-Image (transformer): diffusers / PEFT ``transformer.<module>`` (``QwenImageTransformer2DModel``'s paths, which
  are ComfyUI's too: ``transformer_blocks.0.attn.to_q``, ``img_mod.1``, ``img_mlp.net.0.proj``), the same under
  ``diffusion_model.`` or bare (lightx2v's Lightning files: ``lora_down`` / ``lora_up`` with ``.alpha``), and kohya's
  ``lora_unet_`` over the underscored names. Its Qwen2.5-VL text encoder takes none.

Scale of one layer: ``multiplier * alpha / rank`` (``alpha / sqrt(rank)`` for rsLoRA; 1 without alpha), as
A1111, kohya and PEFT compute it.

Network types other than LoRA and LoCon are refused here, by the key parts that give them away; whether the layers
fit a model is :mod:`sdlite.adapters.lora_targets`'s question. Reading a file is
:func:`sdlite.adapters.lora_files.read_lora`; everything is re-exported by :mod:`sdlite.adapters.lora`.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from ..errors import SDLiteError

COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
TEXT_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
DENOISERS = ("unet", "transformer")
# the module paths of a UNet (diffusers' and the original LDM / SGM ones), told apart from a transformer's
_UNET_PATH = re.compile(r"^(down_blocks|mid_block|up_blocks|input_blocks|middle_block|output_blocks)[._]")
_MAX_LISTED = 5

# widths that tell the family a LoRA was made for (SDXL's first text encoder is as wide as SD 1.x's)
_CROSS_ATTENTION_FAMILY = {768: "SD 1.x", 1024: "SD 2.x", 2048: "SDXL", 1280: "the SDXL refiner"}
_TEXT_WIDTH_FAMILY = {768: "SD 1.x", 1024: "SD 2.x", 1280: "SDXL"}

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

_KOHYA = re.compile(r"^lora_(unet|transformer|te|te1|te2|te3)_([^.]+)\.(.+)$")
# dotted (diffusers / PEFT) keys: module path, then the LoRA part
_DOTTED_PARTS = (
    (re.compile(r"^(.+)\.lora_A(?:\.[^.]+)?\.weight$"), "down"),
    (re.compile(r"^(.+)\.lora_B(?:\.[^.]+)?\.weight$"), "up"),
    (re.compile(r"^(.+)\.lora_down\.weight$"), "down"),       # kohya's parts on dotted names (ComfyUI, ai-toolkit)
    (re.compile(r"^(.+)\.lora_up\.weight$"), "up"),
    (re.compile(r"^(.+)\.lora(?:_linear_layer)?\.down\.weight$"), "down"),
    (re.compile(r"^(.+)\.lora(?:_linear_layer)?\.up\.weight$"), "up"),
    (re.compile(r"^(.+)_lora\.down\.weight$"), "down"),      # attention processors: to_q_lora.down.weight
    (re.compile(r"^(.+)_lora\.up\.weight$"), "up"),
    (re.compile(r"^(.+)\.alpha$"), "alpha"),
)
# XLabs' FLUX LoRAs: (diffusion_model.)double_blocks.N.processor.qkv_lora1.down.weight ...
_XLABS = re.compile(r"^(?:diffusion_model\.)?(double_blocks|single_blocks)\.(\d+)\.processor\.(qkv|proj)_lora(1|2)?"
                    r"\.(down|up)\.weight$")
# (block kind, qkv | proj, stream) -> the model's (diffusers') layers, as diffusers' converter maps them
_XLABS_TARGETS = {
    ("double_blocks", "qkv", "1"): ("attn.to_q", "attn.to_k", "attn.to_v"),
    ("double_blocks", "qkv", "2"): ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ("double_blocks", "proj", "1"): ("attn.to_out.0",),
    ("double_blocks", "proj", "2"): ("attn.to_add_out",),
    ("single_blocks", "qkv", None): ("attn.to_q", "attn.to_k", "attn.to_v"),
    ("single_blocks", "proj", None): ("proj_out",),
}
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
                  "text_encoder_3": "text_encoder_3", "transformer": "transformer",
                  # ComfyUI's and ai-toolkit's name for the denoiser (a UNet or a transformer: Lora.for_denoiser)
                  "diffusion_model": "unet"}
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

    component: str                 # "unet" | "transformer" | "text_encoder" | "text_encoder_2" | "text_encoder_3"
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
    format: str                    # "kohya" | "peft" | "diffusers-legacy" | "comfy" | "xlabs"
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

    @property
    def made_for_unet(self) -> bool:
        """Whether its denoiser layers are a UNet's (they name UNet blocks, in diffusers' or the LDM layout)."""
        return any(layer.component == "unet" and _UNET_PATH.match(layer.target) for layer in self.layers)

    def for_denoiser(self, denoiser: str) -> "Lora":
        """This LoRA with its denoiser's layers under ``denoiser`` ("unet" or "transformer"): kohya's sd-scripts
        call an SD3 or FLUX transformer's layers ``lora_unet_`` too, and PEFT's bare saves carry no prefix. Whether
        the layers fit that denoiser is checked where they are matched to it."""
        if denoiser == "unet" or not self.layers_of("unet"):
            return self
        layers = [replace(layer, component=denoiser) if layer.component == "unet" else layer
                  for layer in self.layers]
        return Lora(self.path, self.format, sorted(layers, key=lambda layer: (layer.component, layer.target)),
                    self.metadata)

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


# --- parsing ----------------------------------------------------------------------------------------------------


def parse_lora(path: str, keys: list[str], tensors: dict, metadata: dict) -> Lora:
    """The :class:`Lora` of a file's ``keys`` (in the file's order), ``tensors`` (key -> tensor) and ``metadata``;
    ``path`` names the file in messages. Refuses unsupported network types with a :class:`LoraError`."""
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
    if any(_XLABS.match(k) for k in keys):
        return Lora(path, "xlabs", _xlabs_layers(path, tensors), metadata)
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


def _xlabs_layers(path: str, tensors: dict) -> list[LoraLayer]:
    """XLabs' FLUX LoRAs: their attention processors' ``qkv_lora`` / ``proj_lora`` (1: the image stream, 2: the
    text stream of a double block; a single block's without a digit), ``down`` / ``up``, no alpha (scale 1). A
    ``qkv`` update's ``up`` stacks q, k and v: split into the model's three projections, the same ``down`` for each."""
    groups: dict = {}
    unknown = []
    for key, tensor in tensors.items():
        m = _XLABS.match(key)
        if m is None:
            unknown.append(key)
            continue
        kind, block, which, stream, role = m.groups()
        targets = _XLABS_TARGETS.get((kind, which, stream))
        if targets is None:
            unknown.append(key)
            continue
        groups.setdefault((kind, block, which, stream), {})[role] = (key, tensor)
    if unknown:
        raise LoraError(f"{len(unknown)} keys are not XLabs FLUX LoRA weights "
                        f"(double_blocks.N.processor.qkv_lora1.down.weight ...): {_listing(unknown)}", path)
    stacked: dict = {}
    for (kind, block, which, stream), parts in groups.items():
        prefix = f"{'transformer_blocks' if kind == 'double_blocks' else 'single_transformer_blocks'}.{block}."
        targets = [prefix + t for t in _XLABS_TARGETS[(kind, which, stream)]]
        if "up" in parts and len(targets) > 1:
            key, up = parts["up"]
            if up.shape[0] % len(targets):
                raise LoraError(f"{key!r} {list(up.shape)}: q, k and v stacked need a row count divisible by 3",
                                path)
            for target, rows in zip(targets, up.chunk(len(targets))):   # one key per layer, as split_fused gives
                split = {role: (f"{k} ({target})", t) for role, (k, t) in parts.items()}
                stacked[("transformer", target)] = {**split, "up": (f"{key} ({target})", rows)}
        else:
            stacked[("transformer", targets[0])] = parts
    return _assemble(path, stacked)


def _kohya_layers(path: str, tensors: dict) -> list[LoraLayer]:
    groups: dict = {}
    unknown = []
    for key, tensor in tensors.items():
        prefix, target, part = _KOHYA.match(key).groups()
        role = _KOHYA_PARTS.get(part)
        if role is None:
            unknown.append(key)
            continue
        component = {"unet": "unet", "transformer": "transformer", "te": "text_encoder", "te1": "text_encoder",
                     "te2": "text_encoder_2", "te3": "text_encoder_3"}[prefix]
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
    unknown, legacy, comfy = [], False, False
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
        if head == "diffusion_model" or (role != "alpha" and key.endswith((".lora_down.weight", ".lora_up.weight"))):
            comfy = True
        elif "lora_A" not in key and "lora_B" not in key and role != "alpha":
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
    return Lora(path, "comfy" if comfy else "diffusers-legacy" if legacy else "peft",
                _assemble(path, groups, _peft_alphas(path, metadata)), metadata)
