"""The config of SD3's denoiser, the MMDiT (Esser et al. 2024, "Scaling Rectified Flow Transformers for
High-Resolution Image Synthesis"), and its presets.

One frozen :class:`MMDiTConfig` holds every fact the network (:mod:`sdlite.models.mmdit`) is built from. The field
names are those of diffusers' ``SD3Transformer2DModel`` config (``transformer/config.json``), so a published folder's
config reads in one call (:meth:`MMDiTConfig.from_diffusers`) and the presets below are those files' numbers.

The three released architectures:

* SD3 Medium: 24 joint blocks of 24 heads (1536 wide), a 192 x 192 positional grid, no qk normalisation.
* SD3.5 Medium ("MMDiT-X"): as wide, a 384 x 384 grid, RMS-normalised queries and keys, and in blocks 0-12 a second
  self-attention over the image tokens alone (``dual_attention_layers``).
* SD3.5 Large (and Large Turbo, the same network distilled for few steps): 38 blocks of 38 heads (2432 wide), a
  192 x 192 grid, RMS-normalised queries and keys.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ConfigError

__all__ = ["MMDiTConfig", "SD3_MEDIUM", "SD35_MEDIUM", "SD35_LARGE", "SD35_LARGE_TURBO", "MMDIT_PRESETS",
           "TIME_EMBED_CHANNELS", "QK_NORMS"]

# the timestep is embedded in this many sinusoidal channels (cos first, no frequency shift) before its MLP
TIME_EMBED_CHANNELS = 256
# the query/key normalisations the network implements: None, or an RMSNorm over each head (with a learned scale)
QK_NORMS = (None, "rms_norm")
# the fields of a diffusers SD3Transformer2DModel config, in its order
_DIFFUSERS_FIELDS = ("sample_size", "patch_size", "in_channels", "num_layers", "attention_head_dim",
                     "num_attention_heads", "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim",
                     "out_channels", "pos_embed_max_size", "dual_attention_layers", "qk_norm")
_CLASS_NAME = "SD3Transformer2DModel"


@dataclass(frozen=True)
class MMDiTConfig:
    """SD3's multimodal diffusion transformer.

    The latent (``in_channels`` x H x W) is cut into ``patch_size``-square patches, each one token of width
    ``hidden = num_attention_heads * attention_head_dim``, to which a 2-D sin-cos positional embedding is added,
    cropped from the centre of a ``pos_embed_max_size``-square grid of them. The text tokens (``joint_attention_dim``
    wide, CLIP-L and CLIP-G beside T5-XXL) are projected to ``caption_projection_dim``, which must equal ``hidden``:
    both streams run through every block, which attend to the joined sequence. ``pooled_projection_dim`` is the
    pooled CLIP width that, with the timestep, modulates every block. ``sample_size`` (latent pixels) is the size
    the model was trained at; with ``patch_size`` it fixes the positions' scale in the grid (``sample_size //
    patch_size`` patches span the positions 0 .. grid size).

    ``qk_norm``: None, or ``"rms_norm"`` (SD3.5). ``dual_attention_layers``: the blocks that run a second
    self-attention over the image tokens (SD3.5 Medium's MMDiT-X). The last block only reads the text tokens (its
    context branch has no output, "context_pre_only").
    """

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    out_channels: int = 16
    num_layers: int = 24
    attention_head_dim: int = 64
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1536
    pooled_projection_dim: int = 2048
    pos_embed_max_size: int = 192
    qk_norm: str | None = None
    dual_attention_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "dual_attention_layers", tuple(sorted({int(i) for i in self.dual_attention_layers})))
        for name in ("sample_size", "patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                     "num_attention_heads", "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim",
                     "pos_embed_max_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"MMDiT config field {name}={value!r} must be a positive integer")
        if self.caption_projection_dim != self.hidden:
            raise ConfigError(f"MMDiT caption_projection_dim={self.caption_projection_dim} must equal the width "
                              f"num_attention_heads x attention_head_dim = {self.hidden}: the text tokens run through "
                              "the same blocks as the image tokens")
        if self.hidden % 4:
            raise ConfigError(f"MMDiT width {self.hidden} must be a multiple of 4 (the 2-D sin-cos positional "
                              "embedding gives each axis a sine and a cosine half)")
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"MMDiT qk_norm={self.qk_norm!r} is not supported (expected one of {list(QK_NORMS)})")
        outside = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ConfigError(f"MMDiT dual_attention_layers {outside} lie outside the blocks 0..{self.num_layers - 1}")

    @property
    def hidden(self) -> int:
        """The token width of both streams."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def base_size(self) -> int:
        """The patches per side the model was trained at (the positional grid's scale)."""
        return self.sample_size // self.patch_size

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "MMDiTConfig":
        """From a diffusers ``SD3Transformer2DModel`` config dict (``transformer/config.json``). Entries starting
        with ``_`` (the class name, the version) are bookkeeping; any other field this class does not know is a
        :class:`ConfigError` naming it."""
        name = cfg.get("_class_name", _CLASS_NAME)
        if name != _CLASS_NAME:
            raise ConfigError(f"transformer config _class_name={name!r}: expected {_CLASS_NAME!r}")
        unknown = sorted(k for k in cfg if not k.startswith("_") and k not in _DIFFUSERS_FIELDS)
        if unknown:
            raise ConfigError(f"transformer config fields {unknown} are not supported by sdlite's MMDiT")
        known = {k: cfg[k] for k in _DIFFUSERS_FIELDS if k in cfg}
        if known.get("out_channels", 0) is None:   # diffusers: the input's channels
            known["out_channels"] = known.get("in_channels", cls.in_channels)
        if known.get("pos_embed_max_size", 0) is None:
            raise ConfigError("transformer config pos_embed_max_size=None (a grid fixed at sample_size) is not "
                              "supported: every SD3 model crops its positions from a larger grid")
        if "dual_attention_layers" in known:
            known["dual_attention_layers"] = tuple(known["dual_attention_layers"] or ())
        # the diffusers defaults, where the file leaves a field out, are the class's: SD3Transformer2DModel defaults
        # to an 18-layer, 96-grid model that no release uses, so the fields a release always writes are required
        missing = [k for k in ("num_layers", "num_attention_heads", "caption_projection_dim", "pos_embed_max_size")
                   if k not in known]
        if missing:
            raise ConfigError(f"transformer config lacks the fields {missing}")
        return cls(**known)

    def to_diffusers(self) -> dict:
        """The diffusers ``SD3Transformer2DModel`` config of this network."""
        out = {k: getattr(self, k) for k in _DIFFUSERS_FIELDS}
        out["dual_attention_layers"] = list(self.dual_attention_layers)
        return {"_class_name": _CLASS_NAME, **out}


# stabilityai/stable-diffusion-3-medium-diffusers, transformer/config.json
SD3_MEDIUM = MMDiTConfig(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=192)

# stabilityai/stable-diffusion-3.5-medium, transformer/config.json (MMDiT-X: dual attention in blocks 0-12)
SD35_MEDIUM = MMDiTConfig(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, qk_norm="rms_norm", dual_attention_layers=tuple(range(13)))

# stabilityai/stable-diffusion-3.5-large, transformer/config.json
SD35_LARGE = MMDiTConfig(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
    pos_embed_max_size=192, qk_norm="rms_norm")

# stabilityai/stable-diffusion-3.5-large-turbo, transformer/config.json: the same network as SD3.5 Large (distilled
# for few steps without guidance; its weights differ, its architecture does not)
SD35_LARGE_TURBO = SD35_LARGE

MMDIT_PRESETS: dict[str, MMDiTConfig] = {
    "sd3-medium": SD3_MEDIUM,
    "sd3.5-medium": SD35_MEDIUM,
    "sd3.5-large": SD35_LARGE,
    "sd3.5-large-turbo": SD35_LARGE_TURBO,
}
