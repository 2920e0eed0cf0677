"""The keys of Qwen-Image's transformer (:mod:`sdlite.models.qwenimage`): whether a state dict is one
(:func:`is_qwenimage`), under which prefix (:func:`qwenimage_layout`), the config its shapes show
(:func:`infer_qwenimage_config`) and a checked key-for-key load (:func:`load_qwenimage`).

There is one set of names. The Qwen team published Qwen-Image in diffusers' layout (``QwenImageTransformer2DModel``),
and ComfyUI's model (``comfy/ldm/qwen_image/model.py``) keeps those module names, so its split files
(``qwen_image_fp8_e4m3fn.safetensors``, ``qwen_image_edit_2509_fp8_e4m3fn.safetensors``; the city96 / QuantStack GGUF
files likewise) carry them bare, and its all-in-one checkpoints under ``model.diffusion_model.``. The table is
therefore the identity under a prefix:

* ``img_in``, ``txt_norm`` (an RMS norm's weight), ``txt_in``,
  ``time_text_embed.timestep_embedder.linear_1`` / ``linear_2``;
* per block ``transformer_blocks.N.``: ``img_mod.1`` / ``txt_mod.1`` (the modulations, 6 x width),
  ``attn.to_q/to_k/to_v``, ``attn.to_out.0``, ``attn.add_q_proj/add_k_proj/add_v_proj``, ``attn.to_add_out``,
  ``attn.norm_q/norm_k/norm_added_q/norm_added_k`` (RMS norms' weights), ``img_mlp.net.0.proj`` / ``img_mlp.net.2``
  and ``txt_mlp.…`` (the GELU MLPs);
* ``norm_out.linear`` (scale then shift in both layouts: ComfyUI's ``LastLayer`` splits it as diffusers does) and
  ``proj_out``. Every Linear has a bias.

What tells Qwen-Image from the other MMDiTs: per-block ``img_mod.1`` together with ``txt_norm`` (FLUX.1's diffusers
blocks have ``norm1.linear``, SD3's ``norm1.linear`` and ``pos_embed``; BFL's FLUX names ``double_blocks``).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..config import ConfigError
from ..config.qwenimage import QwenImageConfig
from .plan import (
    ComponentPlan, ConversionError, Layouts, UnsupportedModelError, block_counts, load_planned, need_matrix, need_shape,
    same_names,
)

__all__ = ["QWENIMAGE_PREFIX", "QWENIMAGE_PREFIXES", "qwenimage_layout", "qwenimage_plan", "is_qwenimage",
           "canonical_shapes", "infer_qwenimage_config", "load_qwenimage"]

QWENIMAGE_PREFIX = "model.diffusion_model."   # ComfyUI's all-in-one checkpoints; diffusers' and split files: none
QWENIMAGE_PREFIXES = ("", QWENIMAGE_PREFIX)
COMPONENT = "transformer"
WHAT = "Qwen-Image transformer"
# what a Qwen-Image transformer has in every layout (under its prefix)
_MARKS = ("txt_norm.weight", "transformer_blocks.0.img_mod.1.weight")
_BLOCK = re.compile(r"(transformer_blocks)\.(\d+)\.(.+)")


# the rotary axes' split (frame, row, column) of the released transformers' heads, by head width
RELEASED_AXES = {128: (16, 56, 56)}

def qwenimage_layout(keys: Iterable[str]) -> tuple[str, str]:
    """``("diffusers", prefix)`` from key names, the prefix ``""`` (diffusers folders, ComfyUI's split and GGUF files)
    or ``"model.diffusion_model."`` (ComfyUI's all-in-one checkpoints). Keys of no Qwen-Image transformer are an
    :class:`UnsupportedModelError` saying what was looked for."""
    keys = set(keys)
    for prefix in QWENIMAGE_PREFIXES:
        if all(prefix + mark in keys for mark in _MARKS):
            return "diffusers", prefix
    listed = sorted(keys)
    raise UnsupportedModelError(
        f"no {WHAT} keys among {len(listed)}: expected {' and '.join(map(repr, _MARKS))} (bare or under "
        f"'{QWENIMAGE_PREFIX}')" + (f"; the first is {listed[0]!r}" if listed else ""))


def _plan(keys: Iterable[str], *, prefix: str = "", expected: Iterable[str] | None = None) -> ComponentPlan:
    """Each key under ``prefix`` as it is, without the prefix (the names are the model's)."""
    return same_names(COMPONENT, keys, prefix=prefix, expected=expected)


def _names(canonical: list[str], prefix: str) -> list[str]:
    """The names canonical keys have under ``prefix``, for error messages."""
    return [prefix + k for k in canonical]


class _PrefixedLayouts(Layouts):
    """One layout whose keys may sit under ComfyUI's prefix: a missing key is named with the source's prefix."""

    def load(self, model, source: Mapping[str, Any]):
        keys = list(source.keys())
        _, prefix = self.find(keys)
        plan = self.plan(keys, expected=model.state_dict().keys())
        return load_planned(model, source, plan, lambda missing: self.names(missing, prefix))


#: Qwen-Image's one layout (diffusers' names), bare or under ComfyUI's prefix
LAYOUTS = _PrefixedLayouts(qwenimage_layout, {"diffusers": _plan}, _names)


def qwenimage_plan(keys: Iterable[str], *, expected: Iterable[str] | None = None) -> ComponentPlan:
    """The plan to canonical names for Qwen-Image weights under either prefix."""
    return LAYOUTS.plan(keys, expected)


def canonical_shapes(shapes) -> dict[str, tuple[int, ...]]:
    """The canonical keys' shapes from the shapes (or tensors) of either prefix, without reading data."""
    return LAYOUTS.shapes(shapes)


def is_qwenimage(state) -> bool:
    """Whether a state dict (names -> tensors or shapes), or bare key names, is a Qwen-Image transformer. With shapes
    the widths must agree as well: the image projection's output is the width C, the modulations are (6C, C), the
    output modulation (2C, C), the text norm as wide as the text projection's input."""
    keys = list(state.keys()) if isinstance(state, Mapping) else list(state)
    try:
        qwenimage_layout(keys)
    except UnsupportedModelError:
        return False
    if not isinstance(state, Mapping):
        return True
    try:
        s = canonical_shapes(state)
        dim = need_matrix(s, "img_in.weight", WHAT)[0]
        text = need_matrix(s, "txt_in.weight", WHAT)
        wanted = {"transformer_blocks.0.img_mod.1.weight": (6 * dim, dim),
                  "transformer_blocks.0.txt_mod.1.weight": (6 * dim, dim),
                  "norm_out.linear.weight": (2 * dim, dim), "txt_norm.weight": (text[1],)}
        return text[0] == dim and all(need_shape(s, k, WHAT) == shape for k, shape in wanted.items())
    except (UnsupportedModelError, ConversionError, TypeError, ValueError):
        return False


def infer_qwenimage_config(shapes, axes_dims_rope: tuple[int, ...] | None = None,
                           zero_cond_t: bool = False) -> QwenImageConfig:
    """The :class:`QwenImageConfig` that Qwen-Image weights show (shapes or tensors, by name, under either prefix):
    width and patch values from ``img_in``, text width from ``txt_in``, output values from ``proj_out``, head width
    from the qk norms, the block count. The rotary split (``axes_dims_rope``, else the releases' (16, 56, 56) for
    128-wide heads) and ``zero_cond_t`` (Qwen-Image-Edit-2511's, which only its config or file name tells) leave no
    trace in the shapes."""
    s = canonical_shapes(shapes)
    x_in = need_matrix(s, "img_in.weight", WHAT)
    ctx = need_matrix(s, "txt_in.weight", WHAT)
    out = need_matrix(s, "proj_out.weight", WHAT)
    head_dim = need_shape(s, "transformer_blocks.0.attn.norm_q.weight", WHAT)[0]
    hidden = x_in[0]
    if hidden % head_dim:
        raise UnsupportedModelError(f"{WHAT}: width {hidden} is not a multiple of the {head_dim}-wide heads")
    if out[0] % 4:
        raise UnsupportedModelError(f"{WHAT}: an output of {out[0]} values is no 2 x 2 patch of latent channels",
                                    key="proj_out.weight")
    axes = axes_dims_rope or RELEASED_AXES.get(head_dim)
    if axes is None:
        raise UnsupportedModelError(f"{WHAT}: heads {head_dim} wide, which no release has; the rotary axes' split "
                                    "cannot be read from the weights (a diffusers folder's config.json gives it)")
    counts = block_counts(s, _BLOCK, ("transformer_blocks",), WHAT)
    try:
        return QwenImageConfig(in_channels=x_in[1], out_channels=out[0] // 4, num_layers=counts["transformer_blocks"],
                               attention_head_dim=head_dim, num_attention_heads=hidden // head_dim,
                               joint_attention_dim=ctx[1], axes_dims_rope=tuple(axes), zero_cond_t=zero_cond_t)
    except ConfigError as e:
        raise UnsupportedModelError(f"{WHAT}: {e}") from None


def load_qwenimage(model, source: Mapping[str, Any]):
    """Load Qwen-Image weights (a name -> tensor Mapping, bare or under ComfyUI's prefix) into ``model``, a
    :class:`sdlite.models.qwenimage.QwenImage`, key for key (:func:`~sdlite.weights.plan.load_planned`: every check
    before any tensor is read, a missing key named with the source's prefix, a wrong shape by its source key). Returns
    the model."""
    return LAYOUTS.load(model, source)
