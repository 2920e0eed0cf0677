"""Area conditioning as ComfyUI samples it (its ConditioningSetArea, ConditioningSetAreaPercentage and
ConditioningSetAreaStrength nodes): each conditioning of a guidance half may apply to an area of the latent only, at
a strength.

At each model call every conditioning of a half is run on its area's crop of the latent (the network sees the
smaller latent), and its prediction is weighted by its strength, with the area's edges feathered where they are not
the latent's own: a linear ramp over at most 8 latent pixels (a quarter of the area's side for a small area), the
outermost row or column at 1/r of the weight, the r-th at the full weight. The half's prediction is the sum of the
weighted predictions over the sum of the weights, which starts at ComfyUI's 1e-37: where no conditioning of the half
applies (or only ones of strength 0) the prediction is 0. Classifier-free guidance then combines the two halves'
predictions, ``uncond + scale * (cond - uncond)``. Without areas and strengths this is the mean of the combined
conditionings' predictions (:class:`~sdlite.sampling.denoisers.Averaged`).

Before sampling, as ComfyUI does, an area of one half that the other half has no conditioning for gets one there
(:func:`plan`): the same area and strength, with the conditioning of the other half's smallest conditioning whose area
holds it (a whole-image one if none does). An area is given in latent pixels (ConditioningSetArea's pixels divided by
8) or as fractions of the latent's sides (ConditioningSetAreaPercentage: a side of at least one pixel, each rounded to
the nearest pixel); an area reaching past the latent's right or bottom edge is cut there, and one whose corner lies
outside the latent is an error naming the node and the values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import RequestError

FEATHER = 8          # ComfyUI's edge ramp: at most this many latent pixels
EMPTY_WEIGHT = 1e-37   # where ComfyUI's sum of weights starts: a prediction with no conditioning is 0


@dataclass(frozen=True)
class Region:
    """Where one conditioning applies: ``area`` (height, width, y, x) in latent pixels, or with ``percentage`` as
    fractions of the latent's height and width (None: the whole latent), and its ``strength``. ``origin`` names the
    node that set it, for errors."""

    area: tuple | None = None
    percentage: bool = False
    strength: float = 1.0
    origin: str = ""

    def resolved(self, height: int, width: int) -> tuple[int, int, int, int] | None:
        """The area in latent pixels on a ``height`` x ``width`` latent, before it is cut at the latent's edges."""
        if self.area is None:
            return None
        if not self.percentage:
            return tuple(int(v) for v in self.area)
        h, w, y, x = self.area
        return max(1, round(h * height)), max(1, round(w * width)), round(y * height), round(x * width)

    def corner(self) -> str:
        """The node's values that place the area's corner, as the node takes them."""
        y, x = self.area[2], self.area[3]
        return f"x {x:g}, y {y:g}" if self.percentage else f"x {int(x) * 8}, y {int(y) * 8}"


WHOLE = Region()


@dataclass(frozen=True)
class Part:
    """One conditioning of a guidance half as the sampler runs it: ``index`` of its denoiser arguments, its ``area``
    (height, width, y, x) in latent pixels (None: the whole latent), and the ``region`` that gave that area and its
    strength."""

    index: int
    area: tuple | None
    region: Region

    @property
    def strength(self) -> float:
        return float(self.region.strength)


def _inside(area: tuple, outer: tuple) -> bool:
    return (area[2] >= outer[2] and area[3] >= outer[3] and area[0] + area[2] <= outer[0] + outer[2]
            and area[1] + area[3] <= outer[1] + outer[3])


def _mirror(half: list[Part], part: Part) -> None:
    """ComfyUI's opposite area: ``half`` gets ``part``'s area and strength with the arguments of its smallest
    conditioning whose area holds that area (its first whole-image one if none does), unless that one has the very
    area already."""
    if part.area is None:
        return
    smallest = None
    for other in half:
        if other.area is None:
            smallest = other if smallest is None else smallest
        elif _inside(part.area, other.area) and (smallest is None or smallest.area is None
                                                 or smallest.area[0] * smallest.area[1] > other.area[0] * other.area[1]):
            smallest = other
    if smallest is None or smallest.area == part.area:
        return
    half.append(Part(smallest.index, part.area, part.region))


def _cut(part: Part, height: int, width: int) -> Part:
    if part.area is None:
        return part
    h, w, y, x = part.area
    if y >= height or x >= width:
        raise RequestError(f"{part.region.origin or 'area conditioning'}: the area's corner ({part.region.corner()}) "
                           f"lies outside the {width * 8}x{height * 8} image ({width}x{height} latent pixels)")
    return Part(part.index, (min(h, height - y), min(w, width - x), y, x), part.region)


def plan(positive: list[tuple[int, Region]], negative: list[tuple[int, Region]], height: int,
         width: int) -> tuple[list[Part], list[Part]]:
    """The parts of each half on a ``height`` x ``width`` latent: each conditioning (its denoiser arguments' index
    and its region), then the opposite areas ComfyUI adds (the positive half's areas to the negative half first),
    each area cut at the latent's edges."""
    pos = [Part(index, region.resolved(height, width), region) for index, region in positive]
    neg = [Part(index, region.resolved(height, width), region) for index, region in negative]
    for part in list(pos):
        _mirror(neg, part)
    for part in list(neg):
        _mirror(pos, part)
    return [_cut(p, height, width) for p in pos], [_cut(p, height, width) for p in neg]


def feather(area: tuple, height: int, width: int, strength: float = 1.0) -> torch.Tensor:
    """(h, w) float32 weights of an area (height, width, y, x) cut to a ``height`` x ``width`` latent: ``strength``,
    ramped over min(8, side // 4) pixels at each edge that is not the latent's."""
    h, w, y, x = area
    weights = torch.full((h, w), float(strength))
    for dim, (size, start, full) in enumerate(((h, y, height), (w, x, width))):
        r = min(FEATHER, size // 4)
        for t in range(r):
            factor = (1.0 / r) * (t + 1)
            if start != 0:
                weights.narrow(dim, t, 1).mul_(factor)
            if start + size < full:
                weights.narrow(dim, size - 1 - t, 1).mul_(factor)
    return weights


def refuse(regions, flow: bool, controls: bool) -> None:
    """What sdlite does not honour of area conditioning: an area on a flow-matching model (SD3, FLUX: their
    transformers take latents in patches; sdlite does not pad a crop to them), any area or strength with ControlNets
    (ComfyUI scales the control image to each area's crop)."""
    for region in regions:
        if region == WHOLE:
            continue
        name = region.origin or "area conditioning"
        if controls:
            raise RequestError(f"{name}: areas and strengths with a ControlNet are not supported (ComfyUI scales the "
                               "control image to each area's crop; sdlite applies a ControlNet to the whole latent)")
        if flow and region.area is not None:
            raise RequestError(f"{name}: areas on a flow-matching model (SD3, FLUX) are not supported: sdlite runs "
                               "only UNet models (SD 1.x, 2.x, SDXL) on an area's crop")


class Regional:
    """The guided estimate of area conditioning (see the module): ``denoiser(x, sigma, context=..., **added)`` is the
    unguided denoiser, ``extras`` the conditionings' arguments (a positive part reads ``context`` and ``added`` of its
    index, a negative one ``uncond`` and ``uncond_added``), ``negative`` None without guidance. The arguments the
    sampler passes are the first conditioning's, and are not used."""

    def __init__(self, denoiser, extras: list[dict], positive: list[Part], negative: list[Part] | None,
                 scale: float, height: int, width: int):
        self.denoiser, self.extras, self.scale = denoiser, extras, scale
        self.positive, self.negative, self.height, self.width = positive, negative, height, width
        self._weights = {}

    def _weight(self, part: Part, like: torch.Tensor) -> torch.Tensor:
        key = (part.area, part.strength)
        if key not in self._weights:
            self._weights[key] = feather(part.area, self.height, self.width, part.strength).to(like)
        return self._weights[key]

    def _half(self, x: torch.Tensor, sigma: torch.Tensor, parts: list[Part], context: str, added: str):
        out = torch.zeros_like(x)
        count = torch.full_like(x, EMPTY_WEIGHT)
        for part in parts:
            extra = self.extras[part.index]
            args = {"context": extra[context], **(extra.get(added) or {})}
            if part.area is None:
                weight = torch.full_like(x, part.strength)
                out += self.denoiser(x, sigma, **args) * weight
                count += weight
                continue
            h, w, y, left = part.area
            weight = self._weight(part, x)
            out[:, :, y:y + h, left:left + w] += self.denoiser(x[:, :, y:y + h, left:left + w], sigma, **args) * weight
            count[:, :, y:y + h, left:left + w] += weight
        return out / count

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, **_) -> torch.Tensor:
        cond = self._half(x, sigma, self.positive, "context", "added")
        if self.negative is None:
            return cond
        uncond = self._half(x, sigma, self.negative, "uncond", "uncond_added")
        return uncond + (cond - uncond) * self.scale
