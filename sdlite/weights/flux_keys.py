"""The keys of FLUX.1's transformer (:mod:`sdlite.models.flux`): their names in each layout, the config the shapes show
(:func:`infer_flux_config`) and a checked key-for-key load (:func:`load_flux`).

The canonical names are diffusers' ``FluxTransformer2DModel`` ones, which a diffusers folder's ``transformer/`` weights
carry as they are. Black Forest Labs' single files (``flux1-dev.safetensors``, ``flux1-schnell.safetensors``; city96's
GGUF files keep these names) use their reference code's, with no prefix; ComfyUI's all-in-one checkpoints put the same
names under ``model.diffusion_model.``:

* ``img_in`` / ``txt_in`` (the image and text token projections), ``time_in``, ``vector_in`` and (dev)
  ``guidance_in``, each ``in_layer`` / ``out_layer`` (the timestep, pooled-text and guidance MLPs);
* per double block ``double_blocks.N.``: ``img_mod.lin`` / ``txt_mod.lin`` (the six-part modulations),
  ``img_attn.qkv`` / ``txt_attn.qkv`` (q, k and v stacked along dim 0: split into ``to_q/to_k/to_v`` and
  ``add_q_proj/add_k_proj/add_v_proj``), ``img_attn.proj`` / ``txt_attn.proj``, ``*_attn.norm.query_norm.scale`` /
  ``key_norm.scale`` (the RMS norms' weights), ``img_mlp.0/2`` / ``txt_mlp.0/2``;
* per single block ``single_blocks.N.``: ``linear1`` (q, k, v and the MLP's input stacked along dim 0 in the
  proportions 1:1:1:4, split into ``attn.to_q/to_k/to_v`` and ``proj_mlp``), ``linear2`` (``proj_out``),
  ``modulation.lin`` (``norm.linear``), ``norm.query_norm.scale`` / ``key_norm.scale``;
* ``final_layer.linear`` and ``final_layer.adaLN_modulation.1``, whose (shift, scale) halves diffusers stores as
  (scale, shift): swapped, both ways.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..config import ConfigError
from ..config.flux import FluxConfig
from .mmdit_keys import SWAP_HALVES
from .plan import (
    COPY, ComponentPlan, Layouts, Transform, UnsupportedModelError, block_counts, block_key, names_back, need_shape,
    plan_fused, plan_names, same_names, split_param,
)

__all__ = ["FLUX_PREFIX", "flux_layout", "flux_from_original", "flux_to_original", "flux_from_diffusers",
           "flux_plan", "canonical_shapes", "infer_flux_config", "load_flux", "is_flux",
           "original_names"]

FLUX_PREFIX = "model.diffusion_model."   # ComfyUI's all-in-one checkpoints; BFL's files have none
COMPONENT = "transformer"
# the axes' split of a 128-wide head in every release (the shapes do not show it)
RELEASE_AXES = {128: (16, 56, 56)}

# whole modules renamed (the parameters keep their names)
_TOP = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
_DOUBLE = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
}
_SINGLE = {"linear2": "proj_out", "modulation.lin": "norm.linear"}
# RMS norms: BFL's ``<module>.scale`` -> diffusers' ``<module>.weight``
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
}
_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}
# fused projections: BFL module -> (diffusers parts, proportions)
_DOUBLE_FUSED = {"img_attn.qkv": (("attn.to_q", "attn.to_k", "attn.to_v"), (1, 1, 1)),
                 "txt_attn.qkv": (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), (1, 1, 1))}
_SINGLE_FUSED = {"linear1": (("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), (1, 1, 1, 4))}
_SWAPPED = ("final_layer.adaLN_modulation.1", "norm_out.linear")

_BLOCK = re.compile(r"(double_blocks|single_blocks)\.(\d+)\.(.+)")
_CANON_BLOCK = re.compile(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)")
_KIND = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks"}
_KIND_BACK = {v: k for k, v in _KIND.items()}


def _tables(kind: str):
    """(renames, norms, fused) of a block kind (BFL's name)."""
    if kind == "double_blocks":
        return _DOUBLE, _DOUBLE_NORMS, _DOUBLE_FUSED
    return _SINGLE, _SINGLE_NORMS, _SINGLE_FUSED


def _from_original_name(name: str) -> list[tuple[str, Transform]] | None:
    """The canonical key(s) one BFL key (without prefix) makes, with how; None for a name outside the table."""
    module, param = split_param(name)
    if module in _TOP:
        return [(f"{_TOP[module]}.{param}", COPY)]
    if module == _SWAPPED[0]:
        return [(f"{_SWAPPED[1]}.{param}", SWAP_HALVES)]
    block = block_key(_BLOCK, name)
    if block is None:
        return None
    kind, index, module, param = block
    base = f"{_KIND[kind]}.{index}."
    renames, norms, fused = _tables(kind)
    if module in renames:
        return [(f"{base}{renames[module]}.{param}", COPY)]
    if module in norms and param == "scale":
        return [(f"{base}{norms[module]}.weight", COPY)]
    if module in fused:
        parts, sizes = fused[module]
        return [(f"{base}{part}.{param}", Transform("split", (i, sizes))) for i, part in enumerate(parts)]
    return None


def flux_from_original(keys: Iterable[str], *, prefix: str = "",
                       expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical key: PlanEntry}`` for BFL's names under ``prefix`` (``""``: BFL's and city96's files,
    ``model.diffusion_model.``: ComfyUI's checkpoints). ``expected``: the model's canonical keys, to report missing
    and unknown names."""
    return plan_names(COMPONENT, keys, _from_original_name, prefix=prefix, expected=expected)


def _to_original_name(key: str) -> tuple[str, Transform | None] | None:
    """(BFL name without prefix, how its tensor is made: COPY, SWAP_HALVES, or None for a part of a fused tensor,
    which gives the fused tensor's name) of one canonical key; None outside the table."""
    module, param = split_param(key)
    top = {v: k for k, v in _TOP.items()}
    if module in top:
        return f"{top[module]}.{param}", COPY
    if module == _SWAPPED[1]:
        return f"{_SWAPPED[0]}.{param}", SWAP_HALVES
    block = block_key(_CANON_BLOCK, key)
    if block is None:
        return None
    kind, index, module, param = block
    kind = _KIND_BACK[kind]
    renames, norms, fused = _tables(kind)
    base = f"{kind}.{index}."
    back = {v: k for k, v in renames.items()}
    back_norms = {v: k for k, v in norms.items()}
    if module in back:
        return f"{base}{back[module]}.{param}", COPY
    if module in back_norms and param == "weight":
        return f"{base}{back_norms[module]}.scale", COPY
    owner = next((f for f, (parts, _) in fused.items() if module in parts), None)
    return (f"{base}{owner}.{param}", None) if owner is not None else None


def _fused_parts(key: str) -> tuple[str, ...]:
    """The canonical keys (in order) that the BFL fused tensor ``key`` (without prefix) holds."""
    kind, index, module, param = block_key(_BLOCK, key)
    return tuple(f"{_KIND[kind]}.{index}.{p}.{param}" for p in _tables(kind)[2][module][0])


def flux_to_original(keys: Iterable[str], *, prefix: str = "") -> ComponentPlan:
    """Plan ``{BFL key (with prefix): PlanEntry}`` from canonical keys: each fused group's parts concatenated (a group
    with a part absent lists the absent parts in ``missing``, the others in ``unexpected``), the output norm's
    modulation halves swapped back."""
    return plan_fused(COMPONENT, keys, _to_original_name, _fused_parts, prefix=prefix)


def flux_from_diffusers(keys: Iterable[str], *, prefix: str = "",
                        expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan for diffusers' names (a ``transformer`` folder's weights, possibly sharded): each key as it is."""
    return same_names(COMPONENT, keys, prefix=prefix, expected=expected)


def is_flux(keys: Iterable[str]) -> bool:
    """Whether key names are a FLUX transformer's, in any layout (BFL's with or without ComfyUI's prefix, or
    diffusers')."""
    try:
        flux_layout(keys)
    except UnsupportedModelError:
        return False
    return True


def flux_layout(keys: Iterable[str]) -> tuple[str, str]:
    """``(layout, prefix)`` from key names: ``("bfl", "")``, ``("bfl", "model.diffusion_model.")`` or
    ``("diffusers", "")``."""
    keys = list(keys)
    for layout, prefix, marker in (("bfl", "", "double_blocks."), ("bfl", FLUX_PREFIX, "double_blocks."),
                                   ("diffusers", "", "single_transformer_blocks.")):
        if any(k.startswith(prefix + marker) for k in keys) and (
                layout == "diffusers" or any(k.startswith(prefix + "img_in.") for k in keys)):
            return layout, prefix
    raise UnsupportedModelError(
        f"no FLUX transformer keys among {len(keys)}: expected BFL's 'double_blocks.N...' with 'img_in' (or under "
        f"'{FLUX_PREFIX}') or diffusers' 'single_transformer_blocks.N...'" + (f"; the first is {keys[0]!r}" if keys
                                                                               else ""))


def flux_plan(keys: Iterable[str], *, expected: Iterable[str] | None = None) -> ComponentPlan:
    """The plan to canonical names for FLUX weights of either layout (:func:`flux_layout` decides)."""
    return LAYOUTS.plan(keys, expected)


# --- what the shapes say -----------------------------------------------------------------------------------


def canonical_shapes(shapes) -> dict[str, tuple[int, ...]]:
    """The canonical keys' shapes from the shapes (or tensors) of either layout, without reading data."""
    return LAYOUTS.shapes(shapes)


def infer_flux_config(shapes, axes_dims_rope: tuple[int, ...] | None = None) -> FluxConfig:
    """The :class:`FluxConfig` that FLUX weights of either layout show (shapes or tensors, by name): width and token
    values from ``x_embedder``, text width from ``context_embedder``, pooled width from the pooled-text MLP, head
    width from the qk norms, block counts, guidance embedding present or not. The rotary axes leave no trace in the
    shapes: ``axes_dims_rope``, else the releases' (16, 56, 56) for 128-wide heads."""
    s = canonical_shapes(shapes)
    what = "FLUX transformer"
    x_in = need_shape(s, "x_embedder.weight", what)
    ctx = need_shape(s, "context_embedder.weight", what)
    pooled = need_shape(s, "time_text_embed.text_embedder.linear_1.weight", what)
    out = need_shape(s, "proj_out.weight", what)
    norm = need_shape(s, "transformer_blocks.0.attn.norm_q.weight", what)
    hidden, head_dim = x_in[0], norm[0]
    counts = block_counts(s, _CANON_BLOCK, ("transformer_blocks", "single_transformer_blocks"), what)
    if hidden % head_dim:
        raise UnsupportedModelError(f"{what}: width {hidden} is not a multiple of the {head_dim}-wide heads")
    axes = axes_dims_rope or RELEASE_AXES.get(head_dim)
    if axes is None:
        raise UnsupportedModelError(f"{what}: heads {head_dim} wide, which no release has; the rotary axes' split "
                                    "cannot be read from the weights (a diffusers folder's config.json gives it)")
    try:
        return FluxConfig(in_channels=x_in[1], out_channels=out[0], num_layers=counts["transformer_blocks"],
                          num_single_layers=counts["single_transformer_blocks"], attention_head_dim=head_dim,
                          num_attention_heads=hidden // head_dim, joint_attention_dim=ctx[1],
                          pooled_projection_dim=pooled[1],
                          guidance_embeds="time_text_embed.guidance_embedder.linear_1.weight" in s,
                          axes_dims_rope=tuple(axes))
    except ConfigError as e:
        raise UnsupportedModelError(f"{what}: {e}") from None


# --- loading -----------------------------------------------------------------------------------------------


def load_flux(model, source: Mapping[str, Any]):
    """Load FLUX weights of either layout (a name -> tensor Mapping) into ``model``, a :class:`sdlite.models.flux.Flux`,
    key for key (:func:`~sdlite.weights.plan.load_planned`: every check before any tensor is read, a missing key
    named in the source's own layout). Returns the model."""
    return LAYOUTS.load(model, source)


def original_names(canonical: list[str], prefix: str) -> list[str]:
    """The BFL names that canonical keys have (a fused part: the fused tensor's), for error messages."""
    return names_back(canonical, _to_original_name, prefix)


#: FLUX's two layouts: BFL's (also ComfyUI's, under its prefix) and diffusers' (the canonical names)
LAYOUTS = Layouts(flux_layout, {"bfl": flux_from_original, "diffusers": flux_from_diffusers}, original_names)
