"""Model families: each says how a prompt becomes conditioning, what its latents are, how its network is
parameterised, its default schedule and sizes (:class:`~sdlite.families.base.Family`). :func:`family_for` finds a
spec's family; adding one is a module here, listed in :data:`FAMILIES`."""
from __future__ import annotations

from .base import Family
from .flux import FluxFamily
from .flux2 import Flux2Family
from .qwenimage import QwenImageFamily
from .qwenimage_edit import QwenImageEditFamily
from .sd import SDFamily
from .sd3 import SD3Family
from .sdxl import SDXLFamily
from .x4 import X4Family
from .zimage import ZImageFamily

# most specific first: the first family that takes a spec runs it
FAMILIES: tuple[type[Family], ...] = (QwenImageEditFamily, QwenImageFamily, Flux2Family, ZImageFamily, FluxFamily, SD3Family, X4Family,
                                      SDXLFamily, SDFamily)


def family_for(spec) -> Family:
    """The family object for a model of ``spec`` (a :class:`~sdlite.config.ModelSpec`)."""
    for family in FAMILIES:
        if family.takes(spec):
            return family(spec)
    raise ValueError(f"no sdlite family runs a {spec.family} model (known: "
                     f"{', '.join(f.name for f in FAMILIES)})")


__all__ = ["FAMILIES", "Family", "Flux2Family", "FluxFamily", "QwenImageEditFamily", "QwenImageFamily", "SD3Family", "SDFamily", "SDXLFamily", "X4Family", "ZImageFamily", "family_for"]
