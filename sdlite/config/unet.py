"""The conditional denoising UNet's config (SD 1.x/2.x, SDXL and the distilled UNets: BK-SDM, SDXS, SSD-1B, Vega),
read from and written as diffusers' ``UNet2DConditionModel`` config."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


def _tuple(value) -> tuple:
    """A config value that is one item or a list of them, as a tuple."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


# diffusers' mid_block_type of a UNet2DConditionModel -> UNetConfig.mid_block
_MID_BLOCKS = {"UNetMidBlock2DCrossAttn": "cross_attn", "UNetMidBlock2D": "resnet", None: None}


@dataclass(frozen=True)
class UNetConfig:
    """The conditional denoising UNet of SD 1.x/2.x.

    ``block_channels[i]`` is the width of level i; ``attention[i]`` says whether level i has spatial
    transformers (the up path mirrors the down path); ``heads[i]`` is the number of attention heads at level i
    (SD 1.x: 8 everywhere; SD 2.x: width / 64).
    """

    in_channels: int = 4
    out_channels: int = 4
    block_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    attention: tuple[bool, ...] = (True, True, True, False)
    heads: tuple[int, ...] = (8, 8, 8, 8)
    context_dim: int = 768
    linear_projection: bool = False  # SD 2.x: Linear proj_in/proj_out; SD 1.x: 1x1 convolutions
    transformer_depth: int | tuple[int, ...] = 1   # blocks per spatial transformer: one for all, or per level
                                                   # (SDXL: (1, 2, 10); the middle block takes the last level's)
    # SDXL's added conditioning (diffusers' addition_embed_type "text_time"): the pooled text embedding and the
    # sinusoidal embeddings (addition_time_embed_dim each) of the size/crop ids, through an MLP, added to the
    # time embedding; add_embed_in is the MLP's input width (base 2816 = 1280 + 6 * 256, refiner 2560)
    addition_embed: str | None = None
    addition_time_embed_dim: int = 256
    add_embed_in: int = 0
    norm_groups: int = 32
    norm_eps: float = 1e-5
    flip_sin_to_cos: bool = True
    freq_shift: float = 0.0
    sample_size: int = 64
    # A class-conditioned UNet (diffusers' num_class_embeds with class_embed_type None; the original's num_classes):
    # a table of this many time-embedding-wide vectors (``class_embedding``), the row of each sample's label added to
    # its time embedding. The x4 upscaler's label is the noise level of its low-resolution input. 0: none.
    num_class_embeds: int = 0
    # Per level: the first attention of each transformer block attends to the text context instead of the image
    # (diffusers' only_cross_attention, the original's disable_self_attentions); () for none. Only levels with
    # attention keep a True (the x4 upscaler: (False, True, True, False)); the middle block never has it.
    cross_only: tuple[bool, ...] = ()
    # The middle block: "cross_attn" (resnet, spatial transformer, resnet: diffusers' UNetMidBlock2DCrossAttn),
    # "resnet" (one resnet: UNetMidBlock2D as UNet2DConditionModel builds it; SSD-1B, Vega) or None (none: BK-SDM
    # Small/Tiny, SDXS)
    mid_block: str | None = "cross_attn"
    # transformer_depth[i] may also be a tuple with one depth per layer of level i (SSD-1B). The up path's depths
    # per level (highest resolution first), each an int or a tuple of layers_per_block + 1; () mirrors the down path.
    # diffusers lists them lowest resolution first (reverse_transformer_layers_per_block).
    up_transformer_depth: tuple = ()

    def __post_init__(self):
        n = len(self.block_channels)
        self._check_depths()
        if self.cross_only:
            if len(self.cross_only) != n:
                raise ConfigError(f"UNet config: {n} levels in block_channels but cross_only {self.cross_only} has "
                                  f"{len(self.cross_only)}")
            only = tuple(bool(c) and a for c, a in zip(self.cross_only, self.attention))
            object.__setattr__(self, "cross_only", only if any(only) else ())
        if self.num_class_embeds < 0:
            raise ConfigError(f"UNet config: num_class_embeds {self.num_class_embeds} must be 0 (none) or more")
        if len(self.attention) != n or len(self.heads) != n:
            raise ConfigError(
                f"UNet config: {n} levels in block_channels but {len(self.attention)} attention flags "
                f"and {len(self.heads)} head counts"
            )
        if self.addition_embed not in (None, "text_time"):
            raise ConfigError(f"UNet config: addition_embed_type {self.addition_embed!r} is not supported "
                              "(SDXL's 'text_time' is)")
        if self.addition_embed == "text_time" and self.add_embed_in <= 0:
            raise ConfigError("UNet config: addition_embed_type 'text_time' needs "
                              "projection_class_embeddings_input_dim")
        for ch, h in zip(self.block_channels, self.heads):
            if ch % h:
                raise ConfigError(f"UNet config: width {ch} is not divisible by {h} heads")
            if ch % self.norm_groups:
                raise ConfigError(f"UNet config: width {ch} is not divisible by {self.norm_groups} norm groups")

    @property
    def time_embed_dim(self) -> int:
        return self.block_channels[0] * 4

    def cross_only_at(self, level: int) -> bool:
        """Whether the transformers of ``level`` attend to the text in place of their self-attention."""
        return bool(self.cross_only) and self.cross_only[level]

    def depth_at(self, level: int, layer: int = 0) -> int:
        """Transformer blocks in the spatial transformer of ``layer`` at ``level`` of the down path (level -1: the
        middle block, which takes the last level's first depth, as diffusers builds it)."""
        d = self.transformer_depth
        d = d[level] if isinstance(d, tuple) else d
        return d[0 if level == -1 else layer] if isinstance(d, tuple) else d

    def up_depth_at(self, level: int, layer: int) -> int:
        """Transformer blocks in the spatial transformer of ``layer`` at ``level`` of the up path."""
        if not self.up_transformer_depth:
            return self.depth_at(level)
        d = self.up_transformer_depth[level]
        return d[layer] if isinstance(d, tuple) else d

    def _check_depths(self) -> None:
        """Per-layer depths as tuples of the right lengths; an up path equal to the down path's mirror is ()."""
        if self.mid_block not in ("cross_attn", "resnet", None):
            raise ConfigError(f"UNet config: mid_block {self.mid_block!r} (expected 'cross_attn', 'resnet' or None)")
        n, lpb = len(self.block_channels), self.layers_per_block

        def norm(value, layers: int, what: str):
            if isinstance(value, (list, tuple)):
                value = tuple(int(v) for v in value)
                if len(value) != layers:
                    raise ConfigError(f"UNet config: {what} {list(value)} has {len(value)} depths for {layers} layers")
                return value[0] if len(set(value)) == 1 else value
            return int(value)

        depth = self.transformer_depth
        if isinstance(depth, (list, tuple)):
            if len(depth) != n:
                raise ConfigError(f"UNet config: {n} levels in block_channels but transformer_depth {depth} has "
                                  f"{len(depth)}")
            depth = tuple(norm(d, lpb, f"transformer_depth at level {i}") for i, d in enumerate(depth))
            object.__setattr__(self, "transformer_depth", depth)
        up = self.up_transformer_depth
        if up:
            if len(up) != n:
                raise ConfigError(f"UNet config: {n} levels in block_channels but up_transformer_depth {up} has "
                                  f"{len(up)}")
            up = tuple(norm(d, lpb + 1, f"up_transformer_depth at level {i}") for i, d in enumerate(up))
            if all(isinstance(d, int) for d in up) and up == tuple(self.depth_at(i) for i in range(n)) and not any(
                    isinstance(d, tuple) for d in (depth if isinstance(depth, tuple) else ())):
                up = ()
            object.__setattr__(self, "up_transformer_depth", up)
        elif isinstance(depth, tuple) and any(isinstance(d, tuple) for d in depth):
            raise ConfigError("UNet config: per-layer transformer depths on the down path need the up path's "
                              "(up_transformer_depth; diffusers' reverse_transformer_layers_per_block)")

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "UNetConfig":
        """From a diffusers ``UNet2DConditionModel`` config dict (``unet/config.json``)."""
        unsupported = {
            "class_embed_type": None, "encoder_hid_dim": None,
            "time_embedding_type": "positional", "resnet_time_scale_shift": "default",
            "dual_cross_attention": False,
            "center_input_sample": False,
            "conv_in_kernel": 3, "conv_out_kernel": 3, "act_fn": "silu", "downsample_padding": 1,
            "mid_block_scale_factor": 1, "time_cond_proj_dim": None, "class_embeddings_concat": False,
            "attention_type": "default", "resnet_skip_time_act": False, "resnet_out_scale_factor": 1.0,
        }
        for key, default in unsupported.items():
            value = cfg.get(key, default)
            if value != default:
                raise ConfigError(f"UNet config field {key}={value!r} is not supported (expected {default!r})")
        down = list(cfg.get("down_block_types", []))
        up = list(cfg.get("up_block_types", []))
        channels = _tuple(cfg.get("block_out_channels", (320, 640, 1280, 1280)))
        known_down = {"CrossAttnDownBlock2D": True, "DownBlock2D": False}
        known_up = {"CrossAttnUpBlock2D": True, "UpBlock2D": False}
        for name in down:
            if name not in known_down:
                raise ConfigError(f"UNet config: down block type {name!r} is not supported")
        for name in up:
            if name not in known_up:
                raise ConfigError(f"UNet config: up block type {name!r} is not supported")
        attention = tuple(known_down[n] for n in down)
        if tuple(known_up[n] for n in reversed(up)) != attention:
            raise ConfigError(f"UNet config: up_block_types {up} do not mirror down_block_types {down}")
        # diffusers' historical naming: ``attention_head_dim`` holds the number of heads for SD 1.x/2.x
        heads = cfg.get("num_attention_heads") or cfg.get("attention_head_dim", 8)
        heads = _tuple(heads)
        if len(heads) == 1:
            heads = heads * len(channels)
        mid = cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn")
        if mid not in _MID_BLOCKS:
            raise ConfigError(f"UNet config field mid_block_type={mid!r} is not supported (expected one of "
                              f"{', '.join(repr(m) for m in _MID_BLOCKS)})")
        depth = cfg.get("transformer_layers_per_block", 1)
        if isinstance(depth, (list, tuple)):
            depth = tuple(tuple(d) if isinstance(d, (list, tuple)) else d for d in depth)
            depth = depth[0] if len(set(depth)) == 1 and not isinstance(depth[0], tuple) else depth
        up_depth = cfg.get("reverse_transformer_layers_per_block")
        if up_depth is not None:   # up_blocks order (lowest resolution first) -> levels
            if not isinstance(up_depth, (list, tuple)) or len(up_depth) != len(up):
                raise ConfigError(f"UNet config: reverse_transformer_layers_per_block={up_depth} needs one entry per "
                                  f"up block ({len(up)})")
            up_depth = tuple(tuple(d) if isinstance(d, (list, tuple)) else d for d in reversed(up_depth))
        addition = cfg.get("addition_embed_type")
        if addition is not None and addition != "text_time":
            raise ConfigError(f"UNet config field addition_embed_type={addition!r} is not supported "
                              "(expected None or 'text_time')")
        layers = cfg.get("layers_per_block", 2)
        if isinstance(layers, (list, tuple)):
            raise ConfigError(f"UNet config: layers_per_block={layers} must be one integer")
        # one flag for every block (the middle block's attention ignores it in diffusers' UNetMidBlock2DCrossAttn),
        # or one per down block, the up path taking them reversed: per level
        only = cfg.get("only_cross_attention", False)
        only = [only] * len(down) if isinstance(only, bool) else list(only)
        if len(only) != len(down):
            raise ConfigError(f"UNet config: only_cross_attention {only} has {len(only)} flags for "
                              f"{len(down)} down blocks")
        classes = cfg.get("num_class_embeds") or 0
        return cls(
            in_channels=cfg.get("in_channels", 4),
            out_channels=cfg.get("out_channels", 4),
            block_channels=channels,
            layers_per_block=layers,
            attention=attention,
            heads=heads,
            context_dim=cfg.get("cross_attention_dim", 768),
            linear_projection=bool(cfg.get("use_linear_projection", False)),
            transformer_depth=depth,
            addition_embed=addition,
            addition_time_embed_dim=cfg.get("addition_time_embed_dim") or 256,
            add_embed_in=cfg.get("projection_class_embeddings_input_dim") or 0,
            norm_groups=cfg.get("norm_num_groups", 32),
            norm_eps=cfg.get("norm_eps", 1e-5),
            flip_sin_to_cos=cfg.get("flip_sin_to_cos", True),
            freq_shift=cfg.get("freq_shift", 0),
            sample_size=cfg.get("sample_size", 64),
            num_class_embeds=int(classes),
            cross_only=tuple(bool(o) for o in only) if any(only) else (),
            mid_block=_MID_BLOCKS[mid],
            up_transformer_depth=up_depth or (),
        )

    def to_diffusers(self) -> dict:
        down = ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in self.attention]
        up = ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(self.attention)]

        def listed(d):
            return list(d) if isinstance(d, tuple) else d

        depth = self.transformer_depth
        return {
            "_class_name": "UNet2DConditionModel",
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "block_out_channels": list(self.block_channels),
            "layers_per_block": self.layers_per_block,
            "down_block_types": down,
            "up_block_types": up,
            "mid_block_type": {v: k for k, v in _MID_BLOCKS.items()}[self.mid_block],
            "attention_head_dim": list(self.heads),
            "cross_attention_dim": self.context_dim,
            "use_linear_projection": self.linear_projection,
            "transformer_layers_per_block": [listed(d) for d in depth] if isinstance(depth, tuple) else depth,
            **({"reverse_transformer_layers_per_block": [listed(d) for d in reversed(self.up_transformer_depth)]}
               if self.up_transformer_depth else {}),
            **({"addition_embed_type": self.addition_embed, "addition_time_embed_dim": self.addition_time_embed_dim,
                "projection_class_embeddings_input_dim": self.add_embed_in} if self.addition_embed else {}),
            **({"num_class_embeds": self.num_class_embeds} if self.num_class_embeds else {}),
            **({"only_cross_attention": list(self.cross_only)} if self.cross_only else {}),
            "norm_num_groups": self.norm_groups,
            "norm_eps": self.norm_eps,
            "flip_sin_to_cos": self.flip_sin_to_cos,
            "freq_shift": self.freq_shift,
            "sample_size": self.sample_size,
            "act_fn": "silu",
            "center_input_sample": False,
            "downsample_padding": 1,
            "mid_block_scale_factor": 1,
        }
