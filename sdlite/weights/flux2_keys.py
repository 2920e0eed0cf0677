"""The keys of FLUX.2's transformer (:mod:`sdlite.models.flux2`): their names in each layout, whether a state dict is
one (:func:`is_flux2`, which tells it from FLUX.1), the config its shapes show (:func:`infer_flux2_config`) and a
checked key-for-key load (:func:`load_flux2`).

The canonical names are diffusers' ``Flux2Transformer2DModel`` ones, which a diffusers folder's ``transformer/`` weights
carry as they are. Black Forest Labs' single files (``flux-2-klein-4b.safetensors``, ``flux-2-klein-9b.safetensors``,
``flux2-dev.safetensors``, their fp8 forms; the GGUF files keep these names) use their reference code's, with no
prefix; ComfyUI's all-in-one checkpoints put the same names under ``model.diffusion_model.``. Every tensor is a weight
(no Linear has a bias):

* ``img_in`` / ``txt_in`` (the image and text token projections), ``time_in`` and ([dev]) ``guidance_in``, each
  ``in_layer`` / ``out_layer``; the three shared modulations ``double_stream_modulation_img.lin``,
  ``double_stream_modulation_txt.lin`` and ``single_stream_modulation.lin`` (diffusers' ``.linear``);
* per double block ``double_blocks.N.``: ``img_attn.qkv`` / ``txt_attn.qkv`` (q, k and v stacked along dim 0: split
  into ``attn.to_q/to_k/to_v`` and ``attn.add_q_proj/add_k_proj/add_v_proj``), ``img_attn.proj`` / ``txt_attn.proj``,
  ``*_attn.norm.query_norm.scale`` / ``key_norm.scale`` (the qk RMS norms' weights), ``img_mlp.0/2`` / ``txt_mlp.0/2``
  (the SwiGLU MLPs' ``linear_in`` / ``linear_out``);
* per single block ``single_blocks.N.``: ``linear1`` and ``linear2``, which diffusers keeps fused as well
  (``attn.to_qkv_mlp_proj`` and ``attn.to_out``: renamed, not split), ``norm.query_norm.scale`` / ``key_norm.scale``;
* ``final_layer.linear`` and ``final_layer.adaLN_modulation.1``, whose (shift, scale) halves diffusers stores as
  (scale, shift): swapped, both ways.

FLUX.1's files share the block names (``double_blocks``, ``img_in``); a FLUX.2 file is told apart by its shared
modulations (``double_stream_modulation_img``), which FLUX.1's per-block ``img_mod`` / ``norm1`` replace, as ComfyUI's
and diffusers' own detection do.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..config import ConfigError
from ..config.flux2 import FLUX2_RELEASE_AXES, FLUX2_RELEASE_EPS, FLUX2_RELEASE_THETA, Flux2Config
from .mmdit_keys import SWAP_HALVES
from .plan import (
    COPY, ComponentPlan, ConversionError, Layouts, Transform, UnsupportedModelError, block_counts, block_key,
    names_back, need_matrix, need_shape, plan_fused, plan_names, same_names, split_param,
)

__all__ = ["FLUX2_PREFIX", "flux2_layout", "flux2_from_original", "flux2_to_original", "flux2_from_diffusers",
           "flux2_plan", "is_flux2", "canonical_shapes", "infer_flux2_config", "load_flux2", "original_names"]

FLUX2_PREFIX = "model.diffusion_model."   # ComfyUI's all-in-one checkpoints; BFL's files have none
COMPONENT = "transformer"
# the rotary split of a 128-wide head in every release (the shapes do not show it)
RELEASE_AXES = {sum(FLUX2_RELEASE_AXES): FLUX2_RELEASE_AXES}

# whole modules renamed (the parameters keep their names)
_TOP = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out",
}
_DOUBLE = {
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.linear_in", "img_mlp.2": "ff.linear_out",
    "txt_mlp.0": "ff_context.linear_in", "txt_mlp.2": "ff_context.linear_out",
}
_SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}
# RMS norms: BFL's ``<module>.scale`` -> diffusers' ``<module>.weight``
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
# fused q, k, v of the double blocks: BFL module -> diffusers' parts (equal thirds)
_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SWAPPED = ("final_layer.adaLN_modulation.1", "norm_out.linear")

_BLOCK = re.compile(r"(double_blocks|single_blocks)\.(\d+)\.(.+)")
_CANON_BLOCK = re.compile(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)")
_KIND = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks"}
_KIND_BACK = {v: k for k, v in _KIND.items()}
# what a FLUX.2 transformer has and FLUX.1's has not, in each layout
_MARKS = {"bfl": "double_stream_modulation_img.lin.weight", "diffusers": "double_stream_modulation_img.linear.weight"}


def _tables(kind: str):
    """(renames, norms, fused) of a block kind (BFL's name)."""
    if kind == "double_blocks":
        return _DOUBLE, _DOUBLE_NORMS, _DOUBLE_FUSED
    return _SINGLE, _SINGLE_NORMS, {}


def _from_original_name(name: str) -> list[tuple[str, Transform]] | None:
    """The canonical key(s) one BFL key (without prefix) makes, with how; None for a name outside the table."""
    module, param = split_param(name)
    if param != "weight" and param != "scale":
        return None
    if module in _TOP and param == "weight":
        return [(f"{_TOP[module]}.weight", COPY)]
    if module == _SWAPPED[0] and param == "weight":
        return [(f"{_SWAPPED[1]}.weight", SWAP_HALVES)]
    block = block_key(_BLOCK, name)
    if block is None:
        return None
    kind, index, module, param = block
    base = f"{_KIND[kind]}.{index}."
    renames, norms, fused = _tables(kind)
    if module in renames and param == "weight":
        return [(f"{base}{renames[module]}.weight", COPY)]
    if module in norms and param == "scale":
        return [(f"{base}{norms[module]}.weight", COPY)]
    if module in fused and param == "weight":
        return [(f"{base}{part}.weight", Transform("chunk", (i, 3))) for i, part in enumerate(fused[module])]
    return None


def flux2_from_original(keys: Iterable[str], *, prefix: str = "",
                        expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical key: PlanEntry}`` for BFL's names under ``prefix`` (``""``: BFL's files, city96's GGUF files;
    ``model.diffusion_model.``: ComfyUI's checkpoints). ``expected``: the model's canonical keys, to report missing and
    unknown names."""
    return plan_names(COMPONENT, keys, _from_original_name, prefix=prefix, expected=expected)


def _to_original_name(key: str) -> tuple[str, Transform | None] | None:
    """(BFL name without prefix, how its tensor is made: COPY, SWAP_HALVES, or None for a part of a fused qkv, which
    gives the fused tensor's name) of one canonical key; None outside the table."""
    module, param = split_param(key)
    if param != "weight":
        return None
    top = {v: k for k, v in _TOP.items()}
    if module in top:
        return f"{top[module]}.weight", COPY
    if module == _SWAPPED[1]:
        return f"{_SWAPPED[0]}.weight", SWAP_HALVES
    block = block_key(_CANON_BLOCK, key)
    if block is None:
        return None
    kind, index, module, _ = block
    kind = _KIND_BACK[kind]
    renames, norms, fused = _tables(kind)
    base = f"{kind}.{index}."
    back = {v: k for k, v in renames.items()}
    back_norms = {v: k for k, v in norms.items()}
    if module in back:
        return f"{base}{back[module]}.weight", COPY
    if module in back_norms:
        return f"{base}{back_norms[module]}.scale", COPY
    owner = next((f for f, parts in fused.items() if module in parts), None)
    return (f"{base}{owner}.weight", None) if owner is not None else None


def _fused_parts(key: str) -> tuple[str, ...]:
    """The canonical keys (q, k, v) that the BFL fused tensor ``key`` (without prefix) holds."""
    kind, index, module, _ = block_key(_BLOCK, key)
    return tuple(f"{_KIND[kind]}.{index}.{p}.weight" for p in _tables(kind)[2][module])


def flux2_to_original(keys: Iterable[str], *, prefix: str = "") -> ComponentPlan:
    """Plan ``{BFL key (with prefix): PlanEntry}`` from canonical keys: each double block's q, k and v concatenated
    into its ``qkv`` (a group with a part absent lists the absent parts in ``missing``, the others in
    ``unexpected``), the output norm's modulation halves swapped back."""
    return plan_fused(COMPONENT, keys, _to_original_name, _fused_parts, prefix=prefix)


def flux2_from_diffusers(keys: Iterable[str], *, prefix: str = "",
                         expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan for diffusers' names (a ``transformer`` folder's weights, possibly sharded): each key as it is."""
    return same_names(COMPONENT, keys, prefix=prefix, expected=expected)


# --- which layout, and whether it is FLUX.2 at all ------------------------------------------------------------


def flux2_layout(keys: Iterable[str]) -> tuple[str, str]:
    """``(layout, prefix)`` from key names: ``("bfl", "")``, ``("bfl", "model.diffusion_model.")`` or
    ``("diffusers", "")``. FLUX.1 weights (the same block names, per-block modulations) and keys of neither kind are an
    :class:`UnsupportedModelError` saying what they look like."""
    keys = set(keys)
    for layout, prefix in (("bfl", ""), ("bfl", FLUX2_PREFIX), ("diffusers", "")):
        if prefix + _MARKS[layout] in keys:
            return layout, prefix
    for prefix in ("", FLUX2_PREFIX):
        if any(k.startswith(prefix + "double_blocks.") for k in keys) and prefix + "img_in.weight" in keys:
            raise UnsupportedModelError(
                "a FLUX.1 transformer (BFL's names with per-block modulations 'img_mod' / 'txt_mod'), not FLUX.2 "
                "(whose blocks share 'double_stream_modulation_img')")
    if "x_embedder.weight" in keys and any(k.startswith("single_transformer_blocks.") for k in keys):
        raise UnsupportedModelError("a FLUX.1 transformer (diffusers' names with per-block 'norm1.linear'), not "
                                    "FLUX.2 (whose blocks share 'double_stream_modulation_img.linear')")
    listed = sorted(keys)
    raise UnsupportedModelError(
        f"no FLUX.2 transformer keys among {len(listed)}: expected BFL's '{_MARKS['bfl']}' (bare or under "
        f"'{FLUX2_PREFIX}') or diffusers' '{_MARKS['diffusers']}'"
        + (f"; the first is {listed[0]!r}" if listed else ""))


def is_flux2(state) -> bool:
    """Whether a state dict (names -> tensors or shapes), or bare key names, is a FLUX.2 transformer in any layout.
    With shapes the widths must agree as well: the image projection's output is the width C, the double-stream
    modulations are (6C, C), the single-stream one (3C, C), the output modulation (2C, C)."""
    keys = list(state.keys()) if isinstance(state, Mapping) else list(state)
    try:
        flux2_layout(keys)
    except UnsupportedModelError:
        return False
    if not isinstance(state, Mapping):
        return True
    try:
        s = canonical_shapes(state)
        dim = need_matrix(s, "x_embedder.weight", "FLUX.2")[0]
        wanted = {"double_stream_modulation_img.linear.weight": (6 * dim, dim),
                  "double_stream_modulation_txt.linear.weight": (6 * dim, dim),
                  "single_stream_modulation.linear.weight": (3 * dim, dim), "norm_out.linear.weight": (2 * dim, dim)}
        return all(need_shape(s, k, "FLUX.2") == shape for k, shape in wanted.items())
    except (UnsupportedModelError, ConversionError, TypeError, ValueError):
        return False


def flux2_plan(keys: Iterable[str], *, expected: Iterable[str] | None = None) -> ComponentPlan:
    """The plan to canonical names for FLUX.2 weights of either layout (:func:`flux2_layout` decides)."""
    return LAYOUTS.plan(keys, expected)


# --- what the shapes say -----------------------------------------------------------------------------------


def canonical_shapes(shapes) -> dict[str, tuple[int, ...]]:
    """The canonical keys' shapes from the shapes (or tensors) of either layout, without reading data."""
    return LAYOUTS.shapes(shapes)


def infer_flux2_config(shapes, axes_dims_rope: tuple[int, ...] | None = None) -> Flux2Config:
    """The :class:`Flux2Config` that FLUX.2 weights of either layout show (shapes or tensors, by name): width and token
    values from ``x_embedder``, text width from ``context_embedder``, output values from ``proj_out``, the sinusoid's
    channels from the timestep MLP, head width from the qk norms, the MLP ratio from the first double block's SwiGLU,
    block counts, guidance embedding present or not. The rotary axes, their base (theta) and the norms' epsilon leave
    no trace in the shapes: ``axes_dims_rope``, else the releases' (32, 32, 32, 32) for 128-wide heads; theta 2000 and
    eps 1e-6 (every release's)."""
    s = canonical_shapes(shapes)
    what = "FLUX.2 transformer"
    x_in = need_matrix(s, "x_embedder.weight", what)
    ctx = need_matrix(s, "context_embedder.weight", what)
    out = need_matrix(s, "proj_out.weight", what)
    time = need_matrix(s, "time_guidance_embed.timestep_embedder.linear_1.weight", what)
    norm = need_shape(s, "transformer_blocks.0.attn.norm_q.weight", what)
    ff = need_matrix(s, "transformer_blocks.0.ff.linear_in.weight", what)
    hidden, head_dim = x_in[0], norm[0]
    counts = block_counts(s, _CANON_BLOCK, ("transformer_blocks", "single_transformer_blocks"), what)
    if hidden % head_dim:
        raise UnsupportedModelError(f"{what}: width {hidden} is not a multiple of the {head_dim}-wide heads")
    if ff[0] % 2:
        raise UnsupportedModelError(f"{what}: the SwiGLU input has {ff[0]} rows, not two equal halves",
                                    key="transformer_blocks.0.ff.linear_in.weight")
    ratio = (ff[0] // 2) / hidden
    if int(hidden * ratio) != ff[0] // 2:
        raise UnsupportedModelError(f"{what}: an MLP {ff[0] // 2} wide is no ratio of the width {hidden}")
    axes = axes_dims_rope or RELEASE_AXES.get(head_dim)
    if axes is None:
        raise UnsupportedModelError(f"{what}: heads {head_dim} wide, which no release has; the rotary axes' split "
                                    "cannot be read from the weights (a diffusers folder's config.json gives it)")
    try:
        return Flux2Config(in_channels=x_in[1], out_channels=out[0], num_layers=counts["transformer_blocks"],
                           num_single_layers=counts["single_transformer_blocks"], attention_head_dim=head_dim,
                           num_attention_heads=hidden // head_dim, joint_attention_dim=ctx[1],
                           timestep_guidance_channels=time[1], mlp_ratio=ratio, axes_dims_rope=tuple(axes),
                           rope_theta=FLUX2_RELEASE_THETA, eps=FLUX2_RELEASE_EPS,
                           guidance_embeds="time_guidance_embed.guidance_embedder.linear_1.weight" in s)
    except ConfigError as e:
        raise UnsupportedModelError(f"{what}: {e}") from None


# --- loading -----------------------------------------------------------------------------------------------


def load_flux2(model, source: Mapping[str, Any]):
    """Load FLUX.2 weights of either layout (a name -> tensor Mapping) into ``model``, a
    :class:`sdlite.models.flux2.Flux2`, key for key (:func:`~sdlite.weights.plan.load_planned`: every check before any
    tensor is read, a missing key named in the source's own layout, a wrong shape named by its source key). Returns the
    model."""
    return LAYOUTS.load(model, source)


def original_names(canonical: list[str], prefix: str) -> list[str]:
    """The BFL names that canonical keys have (q, k or v: the fused qkv's), for error messages."""
    return names_back(canonical, _to_original_name, prefix)


#: FLUX.2's two layouts: BFL's (also ComfyUI's, under its prefix) and diffusers' (the canonical names)
LAYOUTS = Layouts(flux2_layout, {"bfl": flux2_from_original, "diffusers": flux2_from_diffusers}, original_names)
