"""The keys of FLUX.2's autoencoder in each layout, and the config its shapes show.

Two layouts exist:

- **original** (Black Forest Labs' ``flux2-vae`` file, which ComfyUI loads as ``flux2-vae.safetensors``): the LDM
  names of every KL autoencoder (``encoder.down.N.block.M``, ``mid.block_1/attn_1/block_2``, ``norm_out``, the
  decoder's ``up.N`` numbered from the lowest resolution, 1x1-conv attention projections; the table is
  :mod:`~sdlite.weights.vae_keys`'), with the 1x1 convolutions around the latent inside the halves,
  ``encoder.quant_conv`` and ``decoder.post_quant_conv``, and the latent statistics as ``bn.running_mean`` and
  ``bn.running_var``. (diffusers' ``scripts/convert_flux2_to_diffusers.py`` maps exactly these names; ComfyUI's
  ``comfy/sd.py`` moves the nested quant convs to the top, as FLUX.1-style files have them, and switches on its
  latent batch norm when it sees ``bn.running_mean``.) Both spellings of the quant convs are read; the nested one
  is written.
- **diffusers** (``vae/diffusion_pytorch_model.safetensors`` of a FLUX.2 folder): the canonical names, plus the
  batch norm's training counter ``bn.num_batches_tracked``, which is dropped.

Both may sit under a prefix (an all-in-one file); :func:`flux2_vae_layout` finds it from where ``bn.running_mean``
is. Nothing here reads a tensor: the plans are names, the config comes from shapes.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..config.flux2_vae import FLUX2_VAE, Flux2VAEConfig
from .plan import (
    COPY, ComponentPlan, Layouts, PlanEntry, UnsupportedModelError, add_entry, check_expected, listed, need_shape,
    plan_names, shape_of,
)
from .vae_keys import infer_vae, vae_from_diffusers, vae_from_original, vae_to_original

__all__ = ["FLUX2_VAE_STATS", "FLUX2_VAE_IGNORED", "flux2_vae_layout", "is_flux2_vae", "flux2_vae_from_original",
           "flux2_vae_to_original", "flux2_vae_from_diffusers", "original_names", "infer_flux2_vae", "LAYOUTS",
           "load_flux2_vae"]

COMPONENT = "FLUX.2 VAE"
#: the latent statistics, named alike in every layout
FLUX2_VAE_STATS = ("bn.running_mean", "bn.running_var")
#: known keys with no place in the model: the batch norm's training counter
FLUX2_VAE_IGNORED = ("bn.num_batches_tracked",)
# the original file's names of the 1x1 convolutions around the latent -> the canonical ones
_NESTED_QUANT = {"encoder.quant_conv": "quant_conv", "decoder.post_quant_conv": "post_quant_conv"}
_CANON_QUANT = {canon: orig for orig, canon in _NESTED_QUANT.items()}
_ORIGINAL_LEVEL = re.compile(r"(encoder\.down|decoder\.up)\.\d+\.")
_DIFFUSERS_LEVEL = re.compile(r"(encoder\.down_blocks|decoder\.up_blocks)\.\d+\.")


# --- which layout -------------------------------------------------------------------------------------------------


def flux2_vae_layout(keys: Iterable[str]) -> tuple[str, str]:
    """``(layout, prefix)`` from key names: ``("original", prefix)`` or ``("diffusers", prefix)``, the prefix being
    whatever stands before ``bn.running_mean`` (usually nothing). Keys without the latent statistics (FLUX.1's
    ``ae.safetensors``, SD's VAEs), or with them beside no autoencoder, are an :class:`UnsupportedModelError` saying
    so."""
    keys = set(keys)
    stat = FLUX2_VAE_STATS[0]
    prefixes = sorted(k[:-len(stat)] for k in keys if k.endswith(stat) and (k == stat or k[-len(stat) - 1] == "."))
    found = []
    for prefix in prefixes:
        names = [k[len(prefix):] for k in keys if k.startswith(prefix)]
        if any(_ORIGINAL_LEVEL.match(n) for n in names):
            found.append(("original", prefix))
        elif any(_DIFFUSERS_LEVEL.match(n) for n in names):
            found.append(("diffusers", prefix))
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise UnsupportedModelError(f"{COMPONENT}: latent statistics and autoencoder keys under several prefixes "
                                    f"({', '.join(repr(p) for _, p in found)}); pass one autoencoder at a time")
    if not prefixes:
        kind = "a KL autoencoder without them (FLUX.1's or SD's)" if any(
            _ORIGINAL_LEVEL.search(k) or _DIFFUSERS_LEVEL.search(k) for k in keys) else "no autoencoder"
        raise UnsupportedModelError(f"{COMPONENT}: no {stat!r} key, so not FLUX.2's autoencoder: the keys are {kind}"
                                    + listed(sorted(keys), "first: "))
    raise UnsupportedModelError(f"{COMPONENT}: {stat!r} (under {prefixes[0]!r}) but no encoder or decoder levels "
                                "('encoder.down.N' / 'encoder.down_blocks.N') beside it")


def is_flux2_vae(keys: Iterable[str]) -> bool:
    """Whether key names (or a state dict's keys) are FLUX.2's autoencoder in either layout."""
    try:
        flux2_vae_layout(keys)
    except UnsupportedModelError:
        return False
    return True


# --- the plans ----------------------------------------------------------------------------------------------------


def flux2_vae_from_original(keys: Iterable[str], num_levels: int | None = None, *, prefix: str = "",
                            expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan ``{canonical key: PlanEntry}`` for the original-layout keys under ``prefix``: the autoencoder through
    :func:`~sdlite.weights.vae_keys.vae_from_original` (``num_levels`` None: from the keys), the quant convs in
    either spelling, the statistics as they are; ``bn.num_batches_tracked`` is ignored. With ``expected`` (the
    model's keys) the plan lists ``missing`` and ``unexpected`` names."""
    keys = [k for k in keys if k.startswith(prefix)]
    network, special, ignored = [], {}, []
    for key in keys:
        name = key[len(prefix):]
        module, _, param = name.rpartition(".")
        if name in FLUX2_VAE_STATS:
            special[name] = key
        elif name in FLUX2_VAE_IGNORED:
            ignored.append(key)
        elif module in _NESTED_QUANT:
            special[f"{_NESTED_QUANT[module]}.{param}"] = key
        else:
            network.append(key)
    plan = vae_from_original(network, num_levels, prefix=prefix) if network else ComponentPlan(COMPONENT)
    plan.component = COMPONENT
    for target, key in special.items():
        add_entry(plan, target, PlanEntry((key,), COPY))
    plan.ignored.extend(ignored)
    check_expected(plan, expected)
    return plan


def flux2_vae_to_original(keys: Iterable[str], num_levels: int | None = None, *,
                          prefix: str = "") -> ComponentPlan:
    """Plan ``{original key: PlanEntry}`` from canonical keys: BFL's file as it is published (quant convs nested
    in the halves, Linear attention weights as 1x1 convs, the statistics as they are). ``bn.num_batches_tracked``
    is ignored."""
    keys = list(keys)
    network = [k for k in keys if k not in FLUX2_VAE_STATS and k not in FLUX2_VAE_IGNORED]
    plan = vae_to_original(network, num_levels, prefix=prefix) if network else ComponentPlan(COMPONENT)
    plan.component = COMPONENT
    entries, plan.entries = plan.entries, {}
    for target, entry in entries.items():
        module, _, param = target[len(prefix):].rpartition(".")
        add_entry(plan, f"{prefix}{_CANON_QUANT[module]}.{param}" if module in _CANON_QUANT else target, entry)
    for key in keys:
        if key in FLUX2_VAE_STATS:
            add_entry(plan, prefix + key, PlanEntry((key,), COPY))
        elif key in FLUX2_VAE_IGNORED:
            plan.ignored.append(key)
    return plan


def flux2_vae_from_diffusers(keys: Iterable[str], *, prefix: str = "",
                             expected: Iterable[str] | None = None) -> ComponentPlan:
    """Plan for a diffusers folder's keys under ``prefix``: the canonical names already (legacy attention names
    tolerated, as for any VAE: :func:`~sdlite.weights.vae_keys.vae_from_diffusers`); ``bn.num_batches_tracked``
    ignored."""
    return plan_names(COMPONENT, keys, lambda name: [vae_from_diffusers(name)], prefix=prefix,
                      ignored=FLUX2_VAE_IGNORED, expected=expected)


def original_names(canonical: Iterable[str], prefix: str = "", num_levels: int | None = None) -> list[str]:
    """The original-layout names of canonical keys, for error messages (a key outside the table: as it is). The
    decoder's levels are numbered backwards, so a few keys name the right level only with ``num_levels`` (None: as
    many as the keys show)."""
    canonical = list(canonical)
    plan = flux2_vae_to_original(canonical, num_levels, prefix=prefix)
    back = {entry.sources[0]: target for target, entry in plan.entries.items()}
    return list(dict.fromkeys(back.get(k, k) for k in canonical))


#: FLUX.2's autoencoder's layouts: BFL's / ComfyUI's file and diffusers' folder (the canonical names)
LAYOUTS = Layouts(flux2_vae_layout, {"original": flux2_vae_from_original, "diffusers": flux2_vae_from_diffusers},
                  original_names)


def load_flux2_vae(model, source: Mapping[str, Any]):
    """Load FLUX.2 autoencoder weights of either layout (a name -> tensor Mapping) into ``model``
    (:class:`~sdlite.models.flux2_vae.Flux2VAE`) key for key, every name and shape checked before any tensor is
    read; a missing key is named as the source's layout names it. Returns the model."""
    levels = len(model.config.block_channels)
    layouts = Layouts(LAYOUTS.find, LAYOUTS.planners,
                      lambda canonical, prefix: original_names(canonical, prefix, levels))
    return layouts.load(model, source)


# --- what the shapes say ------------------------------------------------------------------------------------------


def infer_flux2_vae(shapes: Mapping[str, Any], preset: Flux2VAEConfig = FLUX2_VAE) -> Flux2VAEConfig:
    """The config of a FLUX.2 autoencoder from its canonical keys' shapes (or tensors): widths per level of both
    halves, layers per level, channels, the quant convs; what shapes cannot show (``norm_num_groups``, the batch-norm
    eps and momentum, ``sample_size``, ``force_upcast``) from ``preset``, the release by default. Statistics that do
    not fit 4 x the latent channels are an :class:`UnsupportedModelError` naming the key and shape."""
    shapes = {k: shape_of(v) for k, v in shapes.items()}
    info = infer_vae(shapes)
    levels = len(info.block_channels)
    # the decoder's up_blocks.i works at the encoder's level levels - 1 - i; its first ResNet's conv2 is that width
    decoder = tuple(need_shape(shapes, f"decoder.up_blocks.{levels - 1 - i}.resnets.0.conv2.weight", COMPONENT)[0]
                    for i in range(levels))
    if not info.mid_attention:
        raise UnsupportedModelError(f"{COMPONENT}: no mid-block attention ('encoder.mid_block.attentions.0'); every "
                                    "FLUX.2 autoencoder has one")
    channels = 4 * info.latent_channels
    for key in FLUX2_VAE_STATS:
        shape = need_shape(shapes, key, COMPONENT)
        if tuple(shape) != (channels,):
            raise UnsupportedModelError(f"{COMPONENT}: shape {list(shape)} does not fit {info.latent_channels} latent "
                                        f"channels patchified 2 x 2 (expected [{channels}])", key=key)
    return Flux2VAEConfig(
        in_channels=info.in_channels, out_channels=info.out_channels, block_out_channels=info.block_channels,
        decoder_block_out_channels=None if decoder == info.block_channels else decoder,
        layers_per_block=info.layers_per_block, latent_channels=info.latent_channels,
        norm_num_groups=preset.norm_num_groups, sample_size=preset.sample_size, force_upcast=preset.force_upcast,
        use_quant_conv="quant_conv.weight" in shapes, use_post_quant_conv="post_quant_conv.weight" in shapes,
        batch_norm_eps=preset.batch_norm_eps, batch_norm_momentum=preset.batch_norm_momentum,
        patch_size=preset.patch_size)
