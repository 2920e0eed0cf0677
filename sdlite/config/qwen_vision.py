"""Qwen2.5-VL's vision tower and its image processor: the facts, a frozen config, the released 7B config.

Qwen-Image-Edit (diffusers' ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline``) shows its source images to
Qwen2.5-VL-7B: the image processor cuts each image into 14 x 14 patches (:mod:`sdlite.tokenizers.qwen_images`), the
vision tower (:mod:`sdlite.models.qwen_vision`) turns them into one token per 2 x 2 patches, as wide as the language
model's hidden states, and those tokens take the places of the ``<|image_pad|>`` tokens in the prompt.

The tower, as transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` builds it from ``Qwen2_5_VLVisionConfig``:

* a patch embedding: a Conv3d of kernel and stride ``(temporal_patch_size, patch_size, patch_size)`` from
  ``in_channels`` to ``hidden_size``, without bias (an image is its frame repeated ``temporal_patch_size`` times);
* ``depth`` pre-norm blocks (RMSNorm, eps 1e-6) of multi-head attention (``num_heads`` heads of ``hidden_size /
  num_heads``, a fused ``qkv`` projection with bias, a 2-D rotary embedding of base ``rope_theta`` over the patch's
  row and column) and a SwiGLU MLP of ``intermediate_size`` with biases (``hidden_act`` silu). The blocks listed in
  ``fullatt_block_indexes`` attend over the whole image; the others within windows of ``window_size`` pixels
  (``window_size / patch_size / spatial_merge_size`` merged units a side);
* a patch merger: RMSNorm, each ``spatial_merge_size`` x ``spatial_merge_size`` patches concatenated, and an MLP
  (Linear, GELU, Linear) to ``out_hidden_size``, the language model's width.

The field names are transformers' (``Qwen2_5_VLVisionConfig``), so a ``config.json``'s ``vision_config`` maps field
for field (:meth:`QwenVisionConfig.from_hf`); the released files say ``in_chans`` where transformers says
``in_channels``, and both are read.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = [
    "QwenVisionConfig", "QwenVisionConfigError", "QWEN25_VL_7B_VISION", "VISION_PATCH_SIZE", "VISION_MERGE_SIZE",
    "VISION_TEMPORAL_PATCH_SIZE", "VISION_MIN_PIXELS", "VISION_MAX_PIXELS", "VISION_IMAGE_MEAN", "VISION_IMAGE_STD",
    "IMAGE_PAD_TOKEN", "VISION_START_TOKEN", "VISION_END_TOKEN",
]

# --- the image processor -----------------------------------------------------------------------------------------
# Qwen/Qwen2.5-VL-7B-Instruct's preprocessor_config.json, which Qwen/Qwen-Image-Edit(-2509)'s processor/ repeats
# (Qwen2VLImageProcessor): patch_size 14, merge_size 2, temporal_patch_size 2, min_pixels 3136 (56 * 56),
# max_pixels 12845056 (28 * 28 * 16384), resample bicubic, rescale 1/255, image_mean / image_std OpenAI CLIP's.
# (transformers' class defaults differ in one number: max_pixels 28 * 28 * 1280 = 1003520.)
VISION_PATCH_SIZE = 14
VISION_MERGE_SIZE = 2
VISION_TEMPORAL_PATCH_SIZE = 2
VISION_MIN_PIXELS = 3136
VISION_MAX_PIXELS = 12845056
VISION_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
VISION_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

# Qwen2.5-VL's tokens around an image in the prompt (config.json: vision_start_token_id 151652, vision_end_token_id
# 151653, image_token_id 151655); Qwen2VLProcessor repeats <|image_pad|> once per merged unit of the image.
VISION_START_TOKEN = 151652
VISION_END_TOKEN = 151653
IMAGE_PAD_TOKEN = 151655

# model_type values a vision_config may carry: transformers' own, and the older checkpoints' (the whole model's)
_MODEL_TYPES = ("qwen2_5_vl_vision", "qwen2_5_vl")
_ACTIVATIONS = ("silu",)


class QwenVisionConfigError(ConfigError, ValueError):
    """A vision config field with a value the tower cannot have (the message names the field); a ValueError too."""


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise QwenVisionConfigError(f"Qwen vision config field {name}={value!r}: expected a positive integer")


@dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision tower (see the module's notes). The defaults are Qwen2.5-VL-7B's released values (which
    transformers' class defaults are not: its ``hidden_size`` default is 3584, the 7B's tower is 1280 wide)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 3584
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # the image processor's pixel limits (a folder's processor/preprocessor_config.json; the released ones by default):
    # each image is fitted to multiples of patch_size x spatial_merge_size pixels within them
    min_pixels: int = VISION_MIN_PIXELS
    max_pixels: int = VISION_MAX_PIXELS

    architecture = "qwen2.5-vl-vision"

    def __post_init__(self):
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                     "temporal_patch_size", "spatial_merge_size", "window_size", "out_hidden_size", "min_pixels",
                     "max_pixels"):
            _positive(name, getattr(self, name))
        if self.min_pixels > self.max_pixels:
            raise QwenVisionConfigError(f"Qwen vision config fields min_pixels={self.min_pixels} and max_pixels="
                                        f"{self.max_pixels}: the least is more than the most")
        if self.hidden_size % self.num_heads:
            raise QwenVisionConfigError(f"Qwen vision config fields hidden_size={self.hidden_size} and num_heads="
                                        f"{self.num_heads}: the width is not a whole number of heads")
        if self.head_dim % 4:
            raise QwenVisionConfigError(f"Qwen vision config fields hidden_size={self.hidden_size} and num_heads="
                                        f"{self.num_heads}: heads of {self.head_dim} values; the 2-D rotary embedding "
                                        "needs a multiple of 4 (a rotated pair each for the row and the column)")
        if self.window_size < self.patch_size * self.spatial_merge_size:
            raise QwenVisionConfigError(
                f"Qwen vision config field window_size={self.window_size}: smaller than one merged unit of "
                f"{self.patch_size * self.spatial_merge_size} pixels (patch_size x spatial_merge_size)")
        indexes = self.fullatt_block_indexes
        if not isinstance(indexes, tuple) or any(not isinstance(i, int) or isinstance(i, bool)
                                                 or not 0 <= i < self.depth for i in indexes):
            raise QwenVisionConfigError(f"Qwen vision config field fullatt_block_indexes={indexes!r}: expected a "
                                        f"tuple of block numbers from 0 to {self.depth - 1}")
        if self.hidden_act not in _ACTIVATIONS:
            raise QwenVisionConfigError(f"Qwen vision config field hidden_act={self.hidden_act!r} is not supported "
                                        f"(expected {' or '.join(map(repr, _ACTIVATIONS))})")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise QwenVisionConfigError(f"Qwen vision config field {name}={value!r}: expected a number > 0")

    @property
    def head_dim(self) -> int:
        """Values per head (7B: 1280 / 16 = 80)."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row of ``pixel_values``: ``in_channels * temporal_patch_size * patch_size ** 2`` (1176)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per merged unit (output token): ``spatial_merge_size ** 2``."""
        return self.spatial_merge_size ** 2

    @property
    def window_units(self) -> int:
        """A window's side in merged units: ``window_size // spatial_merge_size // patch_size`` (7B: 4)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf(cls, cfg: dict) -> "QwenVisionConfig":
        """From the ``vision_config`` object of a Qwen2.5-VL ``config.json`` (or the whole config holding one, as
        transformers 4 and 5 save it). Missing fields take the 7B's values; a field this tower cannot honour (a
        Qwen2-VL tower, another activation, an axial RoPE of another kind) is a :class:`QwenVisionConfigError`."""
        if not isinstance(cfg, dict):
            raise QwenVisionConfigError(f"a Qwen vision config is a JSON object, got {type(cfg).__name__}")
        if isinstance(cfg.get("vision_config"), dict):
            cfg = cfg["vision_config"]
        model_type = cfg.get("model_type", "qwen2_5_vl_vision")
        if model_type not in _MODEL_TYPES:
            raise QwenVisionConfigError(f"Qwen vision config field model_type={model_type!r} is not supported "
                                        f"(expected one of {', '.join(map(repr, _MODEL_TYPES))})")
        if "embed_dim" in cfg or "mlp_ratio" in cfg:
            raise QwenVisionConfigError("Qwen vision config field embed_dim / mlp_ratio: that is Qwen2-VL's tower "
                                        "(LayerNorm, a GELU MLP, no windows), not Qwen2.5-VL's")
        if "patch_size" in cfg and "spatial_patch_size" in cfg and cfg["patch_size"] != cfg["spatial_patch_size"]:
            raise QwenVisionConfigError(f"Qwen vision config fields patch_size={cfg['patch_size']!r} and "
                                        f"spatial_patch_size={cfg['spatial_patch_size']!r} disagree")
        default = cls()
        indexes = cfg.get("fullatt_block_indexes", default.fullatt_block_indexes)
        if isinstance(indexes, list):
            indexes = tuple(indexes)
        return cls(
            depth=cfg.get("depth", cfg.get("num_hidden_layers", default.depth)),
            hidden_size=cfg.get("hidden_size", default.hidden_size),
            intermediate_size=cfg.get("intermediate_size", default.intermediate_size),
            num_heads=cfg.get("num_heads", cfg.get("num_attention_heads", default.num_heads)),
            in_channels=cfg.get("in_channels", cfg.get("in_chans", default.in_channels)),
            patch_size=cfg.get("patch_size", cfg.get("spatial_patch_size", default.patch_size)),
            temporal_patch_size=cfg.get("temporal_patch_size", default.temporal_patch_size),
            spatial_merge_size=cfg.get("spatial_merge_size", default.spatial_merge_size),
            window_size=cfg.get("window_size", default.window_size),
            fullatt_block_indexes=indexes,
            out_hidden_size=cfg.get("out_hidden_size", default.out_hidden_size),
            hidden_act=cfg.get("hidden_act", default.hidden_act),
            rope_theta=_rope_theta(cfg, default.rope_theta),
        )

    def to_hf(self) -> dict:
        """A transformers ``Qwen2_5_VLVisionConfig`` dict of this tower."""
        if self.rms_norm_eps != 1e-6:
            raise QwenVisionConfigError(f"Qwen vision config field rms_norm_eps={self.rms_norm_eps!r}: transformers' "
                                        "tower fixes it at 1e-6 and has no field for another")
        return {
            "model_type": "qwen2_5_vl_vision", "depth": self.depth, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_heads": self.num_heads,
            "in_channels": self.in_channels, "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size, "spatial_merge_size": self.spatial_merge_size,
            "window_size": self.window_size, "fullatt_block_indexes": list(self.fullatt_block_indexes),
            "out_hidden_size": self.out_hidden_size, "hidden_act": self.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }


def _rope_theta(cfg: dict, default: float):
    """The rotary base from ``rope_theta`` or ``rope_parameters`` (transformers 5: ``{"rope_type": "axial",
    "rope_theta": ...}``); released files state neither and mean 10000."""
    theta = cfg.get("rope_theta", default)
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise QwenVisionConfigError(f"Qwen vision config field rope_parameters={params!r}: expected an object")
        kind = params.get("rope_type", "axial")
        if kind not in ("axial", "default"):
            raise QwenVisionConfigError(f"Qwen vision config field rope_parameters with rope_type={kind!r} is not "
                                        "supported (expected 'axial': the plain 2-D rotary embedding)")
        theta = params.get("rope_theta", theta)
    return float(theta) if isinstance(theta, int) and not isinstance(theta, bool) else theta


# Qwen/Qwen2.5-VL-7B-Instruct config.json, "vision_config": depth 32, hidden_size 1280, intermediate_size 3420,
# num_heads 16, in_chans 3, patch_size 14 (spatial_patch_size 14), temporal_patch_size 2, spatial_merge_size 2,
# window_size 112, fullatt_block_indexes [7, 15, 23, 31], out_hidden_size 3584, hidden_act "silu" (and
# tokens_per_second 2, which concerns video positions in the language model, not the tower). Qwen-Image-Edit's
# text_encoder/config.json states the same.
QWEN25_VL_7B_VISION = QwenVisionConfig(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
    temporal_patch_size=2, spatial_merge_size=2, window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
    out_hidden_size=3584, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
)
