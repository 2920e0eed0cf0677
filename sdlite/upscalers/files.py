"""The upscaler files people have, read into :class:`~sdlite.upscalers.nets.RRDBNet` or
:class:`~sdlite.upscalers.nets.SRVGGNetCompact`.

Files are ``.pth`` (read by :mod:`sdlite.weights.io`, which never runs pickled code) or ``.safetensors``; what is
inside is recognised from the key names, never from the file name. Wrappers are unwrapped: basicsr's
``params_ema`` (preferred when both are there) / ``params``, and a ``state_dict``, ``model`` or DataParallel
``module`` level. Four key layouts are read; the table :data:`LAYOUTS` and :func:`canonical_keys` rename them to
the modules' names:

* ``ESRGAN (old)`` -- the original ESRGAN repository's ``nn.Sequential``: ``model.0`` (first conv),
  ``model.1.sub.N.RDB1.conv1.0`` (the trunk), ``model.1.sub.{num_block}`` (trunk conv), then per x2 upsampling
  an (Upsample, conv, LeakyReLU) triple and last (conv, LeakyReLU, conv). The indices after ``model.1`` depend on
  the scale (x4: 3, 6, 8, 10; x2: 3, 5, 7; x8: 3, 6, 9, 11, 13; x1: 2, 4), so they are read in order: the last is
  the output conv, the one before it the HR conv, the rest upsampling convs -- the scale is 2 ** their count.
* ``ESRGAN`` -- the same net with the names ESRGAN (and BSRGAN) used later: ``conv_first``,
  ``RRDB_trunk.N.RDB1.conv1``, ``trunk_conv``, ``upconv1``, ``upconv2``, ``HRconv``, ``conv_last``.
* ``Real-ESRGAN`` -- basicsr's names, which are ours: ``conv_first``, ``body.N.rdb1.conv1``, ``conv_body``,
  ``conv_up1``, ``conv_up2``, ``conv_hr``, ``conv_last``.
* ``SRVGG`` -- Real-ESRGAN's compact net, ``body.N`` (convolutions at even N, PReLU slopes at odd N), ours too.

Every fact of the net is read from the shapes: the number of blocks, ``num_feat``, the growth channels, the input
and output channels, and the scale (from the number of upsampling convs and, for Real-ESRGAN's x2/x1 models,
from the first conv's input channels, 4 or 16 times the output's: a pixel unshuffle by 2 or 4; for SRVGG from
its last conv's output channels, ``out * scale**2``). Files of other architectures that can be recognised from
their keys (SwinIR, HAT, DAT, Real-CUGAN, GFPGAN ...) are refused by name. Every problem is an
:class:`UpscalerError` naming the file and, where one is at fault, the key and its shape.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from ..weights.io import TensorStore, open_checkpoint
from .nets import RRDBConfig, RRDBNet, SRVGGConfig, SRVGGNetCompact

__all__ = ["Upscaler", "UpscalerError", "load_upscaler", "canonical_keys", "read_config", "LAYOUTS", "ARCHS",
           "SUPPORTED"]

ARCHS = ("RRDBNet", "SRVGGNetCompact")
SUPPORTED = "sdlite runs RRDBNet (ESRGAN, Real-ESRGAN) and SRVGGNetCompact upscalers"
_MAX_LISTED = 5

# layout -> (the keys that identify it, the renaming rules: (pattern, canonical template) applied in order).
# The old sequential layout's tail (model.2 ...) is positional and renamed by _old_tail, not by a rule.
LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = {
    "ESRGAN (old)": (
        ("model.0.weight", "model.1.sub.0.RDB1.conv1.0.weight"),
        ((r"model\.0\.(weight|bias)", r"conv_first.\1"),
         (r"model\.1\.sub\.(\d+)\.RDB(\d)\.conv(\d)\.0\.(weight|bias)", r"body.\1.rdb\2.conv\3.\4")),
    ),
    "ESRGAN": (
        ("conv_first.weight", "RRDB_trunk.0.RDB1.conv1.weight", "trunk_conv.weight"),
        ((r"conv_first\.(weight|bias)", r"conv_first.\1"),
         (r"RRDB_trunk\.(\d+)\.RDB(\d)\.conv(\d)\.(weight|bias)", r"body.\1.rdb\2.conv\3.\4"),
         (r"trunk_conv\.(weight|bias)", r"conv_body.\1"),
         (r"upconv(\d)\.(weight|bias)", r"conv_up\1.\2"),
         (r"HRconv\.(weight|bias)", r"conv_hr.\1"),
         (r"conv_last\.(weight|bias)", r"conv_last.\1")),
    ),
    "Real-ESRGAN": (
        ("conv_first.weight", "body.0.rdb1.conv1.weight", "conv_body.weight"),
        ((r"(conv_first|conv_body|conv_up\d|conv_hr|conv_last)\.(weight|bias)", r"\1.\2"),
         (r"body\.(\d+)\.rdb(\d)\.conv(\d)\.(weight|bias)", r"body.\1.rdb\2.conv\3.\4")),
    ),
    "SRVGG": (
        ("body.0.weight", "body.1.weight"),
        ((r"body\.(\d+)\.(weight|bias)", r"body.\1.\2"),),
    ),
}
_ARCH_OF_LAYOUT = {"ESRGAN (old)": "RRDBNet", "ESRGAN": "RRDBNet", "Real-ESRGAN": "RRDBNet",
                   "SRVGG": "SRVGGNetCompact"}

# Architectures refused by name: (what the file is, key fragments of which any one identifies it), checked in this
# order (HAT, ATD, DRCT and Swin2SR files also hold SwinIR-like keys; RGT ones DAT-like keys). A fragment is
# looked for in "." + key, so a leading dot anchors it at a name's start.
_FOREIGN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("an ESRGAN+ upscaler (RRDB with 1x1 convolutions)", (".conv1x1.",)),
    ("a HAT upscaler", (".overlap_attn.", ".conv_block.cab.")),
    ("an ATD upscaler", (".residual_group.td", "relative_position_index_SA")),
    ("a DRCT upscaler", (".swin1.",)),
    ("a Swin2SR upscaler", (".attn.cpb_mlp.", ".attn.logit_scale")),
    ("a SwinIR upscaler", (".residual_group.blocks.",)),
    ("an RGT upscaler", (".attn.attns.0.rpe_biases",)),
    ("a DAT upscaler", (".ffn.sg.", ".before_RG.")),
    ("a GRL upscaler", (".norm_start.", ".stripe_attn.")),
    ("an OmniSR upscaler", (".residual_layer.0.residual_layer.",)),
    ("a SPAN upscaler", (".block_1.c1_r.",)),
    ("a Real-CUGAN upscaler", (".unet1.conv1.conv.",)),
    ("a SCUNet restorer", (".m_head.", ".m_tail.")),
    ("a PLKSR upscaler", (".lk.conv.", ".lk.convs.")),
    ("an RCAN upscaler", (".body.3.conv_du.",)),
    ("a DITN upscaler", (".UFONE.",)),
    ("a GFPGAN face restorer", (".stylegan_decoder.", ".conv_body_first.")),
    ("a CodeFormer face restorer", (".ft_layers.", ".idx_pred_layer.", ".position_emb")),
    ("a RestoreFormer face restorer", (".quantize.embedding.",)),
    ("a latent diffusion model (LDSR, or a Stable Diffusion checkpoint)", (".diffusion_model.",
                                                                           ".first_stage_model.")),
    ("a GAN discriminator (a training file's net_d, not the generator)", (".weight_orig",)),
)


class UpscalerError(CheckpointError):
    """An upscaler file that cannot be used (the message names the file and the key or shape at fault)."""


@dataclass
class Upscaler:
    """A loaded upscaler: ``net`` maps (B, C, H, W) images in [0, 1] to (B, C, scale*H, scale*W).

    ``arch``: ``"RRDBNet"`` or ``"SRVGGNetCompact"``; ``layout``: the key layout the file had (a key of
    :data:`LAYOUTS`); ``name``: the file's stem; ``metadata``: the file's safetensors metadata (or a pickle's
    top-level scalars).
    """

    net: nn.Module
    arch: str
    scale: int
    name: str
    path: Path
    layout: str
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> RRDBConfig | SRVGGConfig:
        return self.net.config

    @property
    def channels(self) -> int:
        """The image channels the net takes and gives (3: RGB; 1: grey)."""
        return self.net.config.in_channels

    @property
    def dtype(self) -> torch.dtype:
        return next(self.net.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    def __repr__(self) -> str:
        return (f"Upscaler({self.name!r}, {self.arch} x{self.scale}, {self.layout} layout, "
                f"{self.config}, {self.dtype})")


def load_upscaler(path: str | os.PathLike, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> Upscaler:
    """The upscaler in the ``.pth`` or ``.safetensors`` file ``path``, in eval mode, without gradients."""
    p = Path(path)
    if p.is_dir():
        raise UpscalerError("is a folder; give an upscaler file (.pth or .safetensors)", p)
    if not p.exists():
        raise UpscalerError("no such file (expected an upscaler .pth or .safetensors)", p)
    with open_checkpoint(p) as store:
        keys = _unwrap(store)
        layout, mapping = canonical_keys(list(keys), store.path)
        shapes = {target: tuple(store.shape(keys[source])) for target, source in mapping.items()}
        cfg = read_config(layout, shapes, {target: keys[source] for target, source in mapping.items()}, store.path)
        net = RRDBNet(cfg) if isinstance(cfg, RRDBConfig) else SRVGGNetCompact(cfg)
        state = net.state_dict()
        missing = [k for k in state if k not in mapping]
        unexpected = [keys[s] for t, s in mapping.items() if t not in state]
        if missing or unexpected:
            problems = []
            if missing:
                problems.append(f"{len(missing)} missing keys (first few, in our names: {_listing(missing)})")
            if unexpected:
                problems.append(f"{len(unexpected)} unexpected keys (first few: {_listing(unexpected)})")
            raise UpscalerError(f"is not a complete {_ARCH_OF_LAYOUT[layout]} ({layout} layout): "
                                + "; ".join(problems), store.path)
        with torch.no_grad():
            for target, tensor in state.items():
                source = keys[mapping[target]]
                have = tuple(store.shape(source))
                if have != tuple(tensor.shape):
                    raise UpscalerError(f"has shape {list(have)}, but this {cfg} needs {list(tensor.shape)} there "
                                        f"({target})", store.path, source)
                tensor.copy_(store.load(source, dtype=torch.float32))
        metadata = dict(store.metadata)
    net = net.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return Upscaler(net=net, arch=_ARCH_OF_LAYOUT[layout], scale=cfg.scale, name=p.stem, path=p, layout=layout,
                    metadata=metadata)


# --- keys ----------------------------------------------------------------------------------------------------------


def _listing(keys) -> str:
    keys = list(keys)
    return ", ".join(repr(k) for k in keys[:_MAX_LISTED]) + (", ..." if len(keys) > _MAX_LISTED else "")


_BARE_INDEX = re.compile(r"\d+\.")


def _unwrap(store: TensorStore) -> dict[str, str]:
    """``{unwrapped key: key in the file}``: basicsr's ``params_ema.`` (else ``params.``) keys, then a
    ``state_dict.`` / ``module.`` / ``model.`` level that every key has (``model.`` only when what is under it is
    not the old ESRGAN sequential, whose own keys are ``model.0.weight`` ...)."""
    keys = {k: k for k in store}
    for wrapper in ("params_ema.", "params."):
        inner = {k[len(wrapper):]: k for k in keys if k.startswith(wrapper)}
        if inner:
            keys = inner
            break
    while keys:
        for wrapper in ("state_dict.", "module.", "model."):
            if all(k.startswith(wrapper) for k in keys):
                inner = {k[len(wrapper):]: v for k, v in keys.items()}
                if wrapper == "model." and any(_BARE_INDEX.match(k) for k in inner):
                    continue
                keys = inner
                break
        else:
            break
    if not keys:
        raise UpscalerError("holds no tensors", store.path)
    return keys


def _foreign(keys: list[str]) -> str | None:
    for name, fragments in _FOREIGN:
        if any(fragment in "." + key for key in keys for fragment in fragments):
            return name
    return None


def canonical_keys(keys: list[str], path: str | os.PathLike | None = None) -> tuple[str, dict[str, str]]:
    """The layout of ``keys`` (unwrapped names) and ``{our name: its key}`` for each of them.

    Raises :class:`UpscalerError` for another architecture (by name), an unrecognised key set, or keys of a
    recognised layout that no rule renames.
    """
    have = set(keys)
    foreign = _foreign(keys)
    if foreign is not None:
        raise UpscalerError(f"is {foreign}; {SUPPORTED}", path)
    for layout, (identifying, rules) in LAYOUTS.items():
        if all(k in have for k in identifying):
            break
    else:
        raise UpscalerError(f"is not an upscaler sdlite knows: none of its key layouts matches its {len(keys)} "
                            f"keys (first few: {_listing(sorted(keys))}); {SUPPORTED}", path)
    mapping: dict[str, str] = {}
    rest = []
    for key in keys:
        for pattern, template in rules:
            m = re.fullmatch(pattern, key)
            if m:
                mapping[m.expand(template)] = key
                break
        else:
            rest.append(key)
    if layout == "ESRGAN (old)":
        rest = _old_tail(rest, mapping, path)
    if rest:
        raise UpscalerError(f"has {len(rest)} keys that are not part of an {_ARCH_OF_LAYOUT[layout]} in the "
                            f"{layout} layout (first few: {_listing(sorted(rest))})", path)
    return layout, mapping


def _old_tail(rest: list[str], mapping: dict[str, str], path) -> list[str]:
    """The old sequential's positional keys: ``model.1.sub.{num_block}`` is the trunk conv; of the
    ``model.{i}`` with i >= 2, the last is conv_last, the one before it conv_hr and the others (in order) the
    upsampling convs."""
    left = []
    tail: dict[int, list[str]] = {}
    for key in rest:
        if m := re.fullmatch(r"model\.1\.sub\.(\d+)\.(weight|bias)", key):
            mapping[f"conv_body.{m.group(2)}"] = key
        elif m := re.fullmatch(r"model\.(\d+)\.(weight|bias)", key):
            tail.setdefault(int(m.group(1)), []).append(key)
        else:
            left.append(key)
    indices = sorted(i for i in tail if i >= 2)
    if len(indices) < 2:
        raise UpscalerError(f"has {len(indices)} convolutions after the trunk (model.2 and on); an ESRGAN has at "
                            "least two (the HR conv and the output conv)", path)
    names = [f"conv_up{n + 1}" for n in range(len(indices) - 2)] + ["conv_hr", "conv_last"]
    for index, name in zip(indices, names):
        for key in tail[index]:
            mapping[f"{name}.{key.rsplit('.', 1)[1]}"] = key
    return left


# --- the config from the shapes ----------------------------------------------------------------------------------


def read_config(layout: str, shapes: dict[str, tuple[int, ...]], sources: dict[str, str],
                path=None) -> RRDBConfig | SRVGGConfig:
    """The net's config from the shapes of its tensors, in our names (``sources``: our name -> the file's key,
    for the messages)."""

    def conv(name: str) -> tuple[int, int]:
        key = f"{name}.weight"
        if key not in shapes:
            raise UpscalerError(f"has no tensor for {key!r} (in our names) in its {layout} layout; its keys: "
                                f"{_listing(sorted(sources.values()))}", path)
        shape = shapes[key]
        if len(shape) != 4 or shape[2:] != (3, 3):
            raise UpscalerError(f"has shape {list(shape)}, not that of a 3x3 convolution weight [out, in, 3, 3]",
                                path, sources[key])
        return shape[0], shape[1]

    if _ARCH_OF_LAYOUT[layout] == "SRVGGNetCompact":
        return _srvgg_config(shapes, sources, conv, path)
    feat, first_in = conv("conv_first")
    grow, _ = conv("body.0.rdb1.conv1")
    out, _ = conv("conv_last")
    blocks = {int(m.group(1)) for k in shapes if (m := re.match(r"body\.(\d+)\.", k))}
    ups = sorted(int(m.group(1)) for k in shapes if (m := re.fullmatch(r"conv_up(\d+)\.weight", k)))
    if ups != list(range(1, len(ups) + 1)):
        raise UpscalerError(f"has upsampling convs {ups}; expected them numbered from 1 without gaps", path)
    if blocks != set(range(len(blocks))):
        raise UpscalerError(f"has RRDB blocks numbered {sorted(blocks)[:8]}...; expected 0 to {len(blocks) - 1}",
                            path)
    unshuffle = 1
    for factor in (4, 2):      # Real-ESRGAN's x1 / x2: the input folded into 16 / 4 times the channels
        if first_in == out * factor ** 2 and 2 ** len(ups) >= factor:
            unshuffle = factor
            break
    if first_in % unshuffle ** 2:
        raise UpscalerError(f"has {first_in} input channels", path, sources["conv_first.weight"])
    try:
        return RRDBConfig(in_channels=first_in // unshuffle ** 2, out_channels=out, num_feat=feat,
                          num_block=len(blocks), num_grow=grow, upsamples=len(ups), unshuffle=unshuffle)
    except ValueError as e:
        raise UpscalerError(str(e), path) from None


def _srvgg_config(shapes, sources, conv, path) -> SRVGGConfig:
    indices = sorted({int(m.group(1)) for k in shapes if (m := re.fullmatch(r"body\.(\d+)\.weight", k))})
    last = indices[-1]
    if indices != list(range(last + 1)) or last % 2:
        raise UpscalerError(f"has body layers {_listing(indices)} ... {last}; an SRVGGNetCompact with PReLU "
                            "activations has weights at every index, convolutions at the even ones and the last "
                            "(a file without PReLU slopes at the odd indices uses another activation, which sdlite "
                            "does not run)", path)
    feat, channels = conv("body.0")
    for i in range(1, last, 2):
        shape = shapes[f"body.{i}.weight"]
        if shape != (feat,):
            raise UpscalerError(f"has shape {list(shape)}, but a PReLU of this SRVGGNetCompact has {feat} slopes "
                                f"there ([{feat}])", path, sources[f"body.{i}.weight"])
    last_out, _ = conv(f"body.{last}")
    scale = math.isqrt(last_out // channels) if last_out % channels == 0 else 0
    if scale < 1 or channels * scale ** 2 != last_out:
        raise UpscalerError(f"has {last_out} output channels, not {channels} (the image channels) times a "
                            "square scale factor", path, sources[f"body.{last}.weight"])
    return SRVGGConfig(in_channels=channels, out_channels=channels, num_feat=feat, num_conv=(last - 2) // 2,
                       scale=scale)
