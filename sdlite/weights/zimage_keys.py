"""The keys of Z-Image's transformer (:mod:`sdlite.models.zimage`): their names in each layout, whether a state dict is
one (:func:`is_zimage`), the config its shapes show (:func:`infer_zimage_config`) and a checked key-for-key load
(:func:`load_zimage`).

The canonical names are diffusers' ``ZImageTransformer2DModel`` ones, which a diffusers folder's ``transformer/``
weights (``diffusion_pytorch_model-0000N-of-0000M.safetensors``) carry as they are. ComfyUI's single file
(Comfy-Org's ``z_image_turbo_bf16.safetensors``, loaded by ComfyUI's Lumina 2 "NextDiT" with Z-Image's modulation)
uses the names of Tongyi-MAI's original code, without a prefix or under ``model.diffusion_model.`` (both are read):

* ``x_embedder`` -> ``all_x_embedder.2-1``; ``final_layer`` (``linear``, ``adaLN_modulation.1``) ->
  ``all_final_layer.2-1`` (diffusers keeps one embedder and one output layer per patch size, keyed
  "patch-frame patch"; every release has only 2-1). Patch values are ordered (row, column, channel) in both.
* per block (``noise_refiner.N``, ``context_refiner.N``, ``layers.N``): ``attention.qkv`` (q, k and v stacked along
  dim 0, no bias) -> ``attention.to_q/to_k/to_v``; ``attention.out`` -> ``attention.to_out.0``;
  ``attention.q_norm`` / ``k_norm`` -> ``attention.norm_q`` / ``norm_k``. The rest of a block (``attention_norm1/2``,
  ``ffn_norm1/2``, ``feed_forward.w1/w2/w3``, ``adaLN_modulation.0``) has the same names in both.
* the same names in both: ``t_embedder.mlp.0/2``, ``cap_embedder.0/1``, ``x_pad_token``, ``cap_pad_token``.
* ``norm_final.weight``, which Lumina 2's code builds and never uses (diffusers' converter drops it), is ignored.

Lumina-Image 2.0's NextDiT has the same names but modulates through ``adaLN_modulation.1`` (a SiLU first) and 1024-wide
timestep embeddings; Z-Image's blocks have ``adaLN_modulation.0`` fed 256 wide. That, and the shapes, tell them apart.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..config import ConfigError
from ..config.zimage import ZIMAGE_TURBO, ZImageConfig
from .plan import (
    COPY, ComponentPlan, ConversionError, Layouts, Transform, UnsupportedModelError, block_counts, block_key,
    names_back, need_shape, plan_fused, plan_names, same_names, split_param,
)

__all__ = ["ZIMAGE_PREFIX", "zimage_layout", "zimage_from_comfy", "zimage_to_comfy", "zimage_from_diffusers",
           "zimage_plan", "is_zimage", "canonical_shapes", "infer_zimage_config", "load_zimage", "comfy_names"]

ZIMAGE_PREFIX = "model.diffusion_model."   # ComfyUI's all-in-one form; the split diffusion-model file may have none
COMPONENT = "transformer"
PATCH_KEY = ZIMAGE_TURBO.patch_key         # "2-1"

# whole modules renamed (the parameters keep their names)
_TOP = {"x_embedder": f"all_x_embedder.{PATCH_KEY}",
        "final_layer.linear": f"all_final_layer.{PATCH_KEY}.linear",
        "final_layer.adaLN_modulation.1": f"all_final_layer.{PATCH_KEY}.adaLN_modulation.1"}
_SAME_TOP = ("t_embedder.mlp.0", "t_embedder.mlp.2", "cap_embedder.0", "cap_embedder.1")
_PAD_TOKENS = ("x_pad_token", "cap_pad_token")
_BLOCK_RENAMES = {"attention.out": "attention.to_out.0", "attention.q_norm": "attention.norm_q",
                  "attention.k_norm": "attention.norm_k"}
_BLOCK_SAME = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2", "feed_forward.w1", "feed_forward.w2",
               "feed_forward.w3", "adaLN_modulation.0")
_FUSED = ("attention.qkv", ("attention.to_q", "attention.to_k", "attention.to_v"))
_IGNORED = ("norm_final.weight",)

_BLOCK = re.compile(r"(noise_refiner|context_refiner|layers)\.(\d+)\.(.+)")


def _from_comfy_name(name: str) -> list[tuple[str, Transform]] | None:
    """The canonical key(s) one ComfyUI key (without prefix) makes, with how; None for a name outside the table."""
    if name in _PAD_TOKENS:
        return [(name, COPY)]
    module, param = split_param(name)
    if module in _TOP:
        return [(f"{_TOP[module]}.{param}", COPY)]
    if module in _SAME_TOP:
        return [(name, COPY)]
    block = block_key(_BLOCK, name)
    if block is None:
        return None
    kind, index, module, param = block
    base = f"{kind}.{index}."
    if module in _BLOCK_RENAMES:
        return [(f"{base}{_BLOCK_RENAMES[module]}.{param}", COPY)]
    if module in _BLOCK_SAME:
        return [(name, COPY)]
    if module == _FUSED[0] and param == "weight":
        return [(f"{base}{part}.weight", Transform("chunk", (i, 3))) for i, part in enumerate(_FUSED[1])]
    return None


def zimage_from_comfy(keys: Iterable[str], *, prefix: str = "",
                      expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical key: PlanEntry}`` for ComfyUI's names under ``prefix`` (``""``: the split diffusion-model
    file; ``model.diffusion_model.``: an all-in-one checkpoint). ``expected``: the model's canonical keys, to report
    missing and unknown names."""
    return plan_names(COMPONENT, keys, _from_comfy_name, prefix=prefix, ignored=_IGNORED, expected=expected)


def _to_comfy_name(key: str) -> tuple[str, Transform | None] | None:
    """(ComfyUI name without prefix, COPY; or None for a part of the fused qkv, with the qkv's name) of one canonical
    key; None outside the table."""
    if key in _PAD_TOKENS:
        return key, COPY
    module, param = split_param(key)
    top = {v: k for k, v in _TOP.items()}
    if module in top:
        return f"{top[module]}.{param}", COPY
    if module in _SAME_TOP:
        return key, COPY
    block = block_key(_BLOCK, key)
    if block is None:
        return None
    kind, index, module, param = block
    base = f"{kind}.{index}."
    back = {v: k for k, v in _BLOCK_RENAMES.items()}
    if module in back:
        return f"{base}{back[module]}.{param}", COPY
    if module in _BLOCK_SAME:
        return key, COPY
    if module in _FUSED[1] and param == "weight":
        return f"{base}{_FUSED[0]}.weight", None
    return None


def _qkv_parts(name: str) -> tuple[str, ...]:
    """The canonical keys (q, k, v) that the ComfyUI ``...attention.qkv.weight`` ``name`` (without prefix) holds."""
    base = name[:-len(f"{_FUSED[0]}.weight")]
    return tuple(f"{base}{part}.weight" for part in _FUSED[1])


def zimage_to_comfy(keys: Iterable[str], *, prefix: str = "") -> ComponentPlan:
    """Plan ``{ComfyUI key (with prefix): PlanEntry}`` from canonical keys: each block's q, k and v concatenated into
    ``attention.qkv`` (a block with a part absent lists the absent parts in ``missing``, the others in
    ``unexpected``)."""
    return plan_fused(COMPONENT, keys, _to_comfy_name, _qkv_parts, prefix=prefix)


def zimage_from_diffusers(keys: Iterable[str], *, prefix: str = "",
                          expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan for diffusers' names (a ``transformer`` folder's weights, possibly sharded): each key as it is."""
    return same_names(COMPONENT, keys, prefix=prefix, expected=expected)


# --- which layout, and whether it is Z-Image at all ---------------------------------------------------------


def zimage_layout(keys: Iterable[str]) -> tuple[str, str]:
    """``(layout, prefix)`` from key names: ``("comfy", "")``, ``("comfy", "model.diffusion_model.")`` or
    ``("diffusers", "")``. A Lumina 2 NextDiT, Z-Image's Omni variant (SigLIP features) or keys of neither kind are an
    :class:`UnsupportedModelError` saying what they look like."""
    keys = set(keys)
    for prefix in ("", ZIMAGE_PREFIX):
        if prefix + "cap_embedder.0.weight" not in keys:
            continue
        if any(k.startswith(prefix + "siglip_") for k in keys):
            raise UnsupportedModelError("Z-Image Omni transformer (it has 'siglip_embedder' / 'siglip_refiner' "
                                        "keys): only the text-to-image Z-Image transformer is supported")
        if f"{prefix}all_x_embedder.{PATCH_KEY}.weight" in keys:
            return "diffusers", prefix
        if prefix + "x_embedder.weight" in keys:
            if any(_BLOCK.fullmatch(k[len(prefix):]) and k.endswith(".adaLN_modulation.1.weight")
                   for k in keys if k.startswith(prefix)):
                raise UnsupportedModelError("a Lumina-Image 2.0 NextDiT (its blocks modulate through "
                                            "'adaLN_modulation.1'), not Z-Image (whose blocks have "
                                            "'adaLN_modulation.0')")
            return "comfy", prefix
    listed = sorted(keys)
    raise UnsupportedModelError(
        f"no Z-Image transformer keys among {len(listed)}: expected 'cap_embedder.0.weight' with ComfyUI's "
        f"'x_embedder.weight' (bare or under '{ZIMAGE_PREFIX}') or diffusers' 'all_x_embedder.{PATCH_KEY}.weight'"
        + (f"; the first is {listed[0]!r}" if listed else ""))


def is_zimage(state) -> bool:
    """Whether a state dict (names -> tensors or shapes), or bare key names, is a Z-Image transformer in any layout.
    With shapes the widths must agree as well: the patch embedder's output is the width C, a modulated block's
    ``adaLN_modulation.0`` is (4C, min(C, 256)) and the timestep MLP ends min(C, 256) wide."""
    keys = list(state.keys()) if isinstance(state, Mapping) else list(state)
    try:
        zimage_layout(keys)
    except UnsupportedModelError:
        return False
    if not isinstance(state, Mapping):
        return True
    try:
        s = canonical_shapes(state)
        dim = need_shape(s, f"all_x_embedder.{PATCH_KEY}.weight", "Z-Image")[0]
        adaln = min(dim, ZImageConfig.ADALN_EMBED_DIM)
        t_out = need_shape(s, "t_embedder.mlp.2.weight", "Z-Image")
        blocks = [k for k in s if k.endswith(".adaLN_modulation.0.weight")]
    except (UnsupportedModelError, ConversionError, TypeError, ValueError):
        return False
    return t_out[0] == adaln and all(s[k] == (4 * dim, adaln) for k in blocks)


def zimage_plan(keys: Iterable[str], *, expected: Iterable[str] | None = None) -> ComponentPlan:
    """The plan to canonical names for Z-Image weights of either layout (:func:`zimage_layout` decides)."""
    return LAYOUTS.plan(keys, expected)


# --- what the shapes say -----------------------------------------------------------------------------------


def canonical_shapes(shapes) -> dict[str, tuple[int, ...]]:
    """The canonical keys' shapes from the shapes (or tensors) of either layout, without reading data."""
    return LAYOUTS.shapes(shapes)


def infer_zimage_config(shapes, release: ZImageConfig = ZIMAGE_TURBO) -> ZImageConfig:
    """The :class:`ZImageConfig` that Z-Image weights of either layout show (shapes or tensors, by name): width and
    latent channels from the patch embedder, caption width from ``cap_embedder``, head width from the qk norms
    (absent: no qk norm, and the release's head width), block counts. The rotary axes, their lengths, theta, the
    timestep scale and the norms' epsilon leave no trace in the shapes: they are ``release``'s (Z-Image-Turbo's)."""
    s = canonical_shapes(shapes)
    what = "Z-Image transformer"
    x_in = need_shape(s, f"all_x_embedder.{PATCH_KEY}.weight", what)
    cap = need_shape(s, "cap_embedder.1.weight", what)
    dim = x_in[0]
    counts = block_counts(s, _BLOCK, ("noise_refiner", "context_refiner", "layers"), what)
    if counts["noise_refiner"] != counts["context_refiner"]:
        raise UnsupportedModelError(f"{what}: {counts['noise_refiner']} noise refiner blocks but "
                                    f"{counts['context_refiner']} context refiner blocks (a release has as many)")
    norm = next((v for k, v in s.items() if k.endswith(".attention.norm_q.weight")), None)
    head_dim = norm[0] if norm is not None else release.head_dim
    if dim % head_dim:
        raise UnsupportedModelError(f"{what}: width {dim} is not a multiple of the {head_dim}-wide heads")
    patch = release.patch_size
    try:
        return ZImageConfig(in_channels=x_in[1] // (patch * patch), dim=dim, n_layers=counts["layers"],
                            n_refiner_layers=counts["noise_refiner"], n_heads=dim // head_dim,
                            n_kv_heads=dim // head_dim, norm_eps=release.norm_eps, qk_norm=norm is not None,
                            cap_feat_dim=cap[1], rope_theta=release.rope_theta, t_scale=release.t_scale,
                            axes_dims=release.axes_dims, axes_lens=release.axes_lens)
    except ConfigError as e:
        raise UnsupportedModelError(f"{what}: {e}") from None


# --- loading -----------------------------------------------------------------------------------------------


def load_zimage(model, source: Mapping[str, Any]):
    """Load Z-Image weights of either layout (a name -> tensor Mapping) into ``model``, a
    :class:`sdlite.models.zimage.ZImage`, key for key (:func:`~sdlite.weights.plan.load_planned`: every check before
    any tensor is read, a missing key named in the source's own layout, a wrong shape named by its source key).
    Returns the model."""
    return LAYOUTS.load(model, source)


def comfy_names(canonical: list[str], prefix: str) -> list[str]:
    """The ComfyUI names that canonical keys have (q, k or v: the fused ``attention.qkv``'s), for error messages."""
    return names_back(canonical, _to_comfy_name, prefix)


#: Z-Image's two layouts: ComfyUI's (Tongyi-MAI's names) and diffusers' (the canonical ones)
LAYOUTS = Layouts(zimage_layout, {"comfy": zimage_from_comfy, "diffusers": zimage_from_diffusers}, comfy_names)
