"""The T5 text encoder's facts: a frozen config, the T5 v1.1 XXL preset and the token lengths the pipelines read.

T5 (Raffel et al. 2020) as Stable Diffusion 3 / 3.5 (its third text encoder) and FLUX.1 (its second) use it: the
encoder half of Google's T5 v1.1 XXL, run on token ids and read at its last hidden state. The field names are the
transformers ``T5Config`` ones, so a folder's ``text_encoder_3/config.json`` maps field for field
(:meth:`T5Config.from_transformers`).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ConfigError

__all__ = [
    "T5Config", "T5_XXL", "FEED_FORWARD_KINDS", "SD3_T5_MAX_LENGTH", "FLUX_DEV_T5_MAX_LENGTH",
    "FLUX_SCHNELL_T5_MAX_LENGTH",
]

# "gated-gelu": T5 v1.1 (wi_0, wi_1, wo; GELU in its tanh approximation, transformers' "gelu_new");
# "relu": the original T5 (wi, wo)
FEED_FORWARD_KINDS = ("gated-gelu", "relu")
# model types whose encoder is this architecture (mT5 is T5 v1.1 trained on more languages); UMT5, whose every
# layer has its own position bias, is not
_MODEL_TYPES = ("t5", "mt5")

# Tokens of the T5 row each pipeline encodes (diffusers' max_sequence_length defaults): SD3 / 3.5 256;
# FLUX.1 dev 512, FLUX.1 schnell 256. The row is the prompt's tokens, </s>, then <pad> up to this length, and the
# encoder reads all of it, pads included.
SD3_T5_MAX_LENGTH = 256
FLUX_DEV_T5_MAX_LENGTH = 512
FLUX_SCHNELL_T5_MAX_LENGTH = 256


@dataclass(frozen=True)
class T5Config:
    """The T5 encoder stack: ``num_layers`` pre-norm blocks of self-attention (``num_heads`` heads of ``d_kv``, no
    1/sqrt(d) scaling, a relative position bias from ``relative_attention_num_buckets`` buckets up to
    ``relative_attention_max_distance``, learned once in block 0 and shared) and a feed-forward of ``d_ff``, with
    T5's RMS LayerNorm (no mean, no bias; ``layer_norm_epsilon``). The defaults are T5 v1.1 XXL."""

    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"

    architecture = "t5"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"T5 config field {name}={value!r}: expected a positive integer")
        buckets = self.relative_attention_num_buckets
        # an encoder's buckets are split by direction, and each half into exact and logarithmic ones: 4 at least
        if not isinstance(buckets, int) or isinstance(buckets, bool) or buckets < 4:
            raise ConfigError(f"T5 config field relative_attention_num_buckets={buckets!r}: expected an integer >= 4")
        exact = buckets // 2 // 2
        distance = self.relative_attention_max_distance
        if not isinstance(distance, int) or isinstance(distance, bool) or distance <= exact:
            raise ConfigError(f"T5 config field relative_attention_max_distance={distance!r}: expected an integer "
                              f"above the {exact} exactly bucketed distances")
        if not (isinstance(self.layer_norm_epsilon, (int, float)) and self.layer_norm_epsilon > 0):
            raise ConfigError(f"T5 config field layer_norm_epsilon={self.layer_norm_epsilon!r}: expected a number > 0")
        if self.feed_forward_proj not in FEED_FORWARD_KINDS:
            raise ConfigError(f"T5 config field feed_forward_proj={self.feed_forward_proj!r} is not supported "
                              f"(expected one of {', '.join(map(repr, FEED_FORWARD_KINDS))})")

    @property
    def gated(self) -> bool:
        """T5 v1.1's gated feed-forward (``wi_0``, ``wi_1``) rather than the original's single ``wi``."""
        return self.feed_forward_proj == "gated-gelu"

    @property
    def inner_dim(self) -> int:
        """Width of q, k, v: ``num_heads * d_kv`` (XXL: 4096, equal to ``d_model``; not so in every T5)."""
        return self.num_heads * self.d_kv

    @classmethod
    def from_transformers(cls, cfg: dict) -> "T5Config":
        """From a transformers ``T5Config`` dict (a ``text_encoder_3/config.json``); anything that is not this
        encoder is named."""
        model_type = cfg.get("model_type", "t5")
        if model_type not in _MODEL_TYPES:
            raise ConfigError(f"T5 config field model_type={model_type!r} is not supported (expected 't5' or 'mt5')")
        if cfg.get("is_decoder"):
            raise ConfigError("T5 config field is_decoder=True: a decoder stack is not a text encoder")
        proj = cfg.get("feed_forward_proj", "relu")
        act = cfg.get("dense_act_fn")
        wanted = {"gated-gelu": "gelu_new", "relu": "relu"}.get(proj)
        if act is not None and wanted is not None and act != wanted:
            raise ConfigError(f"T5 config fields feed_forward_proj={proj!r} and dense_act_fn={act!r} disagree "
                              f"(transformers runs {proj!r} with {wanted!r})")
        return cls(
            vocab_size=cfg.get("vocab_size", 32128),
            d_model=cfg.get("d_model", 512),
            d_kv=cfg.get("d_kv", 64),
            d_ff=cfg.get("d_ff", 2048),
            num_layers=cfg.get("num_layers", 6),
            num_heads=cfg.get("num_heads", 8),
            relative_attention_num_buckets=cfg.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=cfg.get("relative_attention_max_distance", 128),
            layer_norm_epsilon=cfg.get("layer_norm_epsilon", 1e-6),
            feed_forward_proj=proj,
        )

    def to_transformers(self) -> dict:
        """A transformers ``T5Config`` dict of a ``T5EncoderModel`` with this config."""
        return {
            "architectures": ["T5EncoderModel"],
            "model_type": "t5",
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "d_kv": self.d_kv,
            "d_ff": self.d_ff,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "relative_attention_num_buckets": self.relative_attention_num_buckets,
            "relative_attention_max_distance": self.relative_attention_max_distance,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "feed_forward_proj": self.feed_forward_proj,
            "dense_act_fn": "gelu_new" if self.gated else "relu",
            "is_gated_act": self.gated,
            "dropout_rate": 0.1,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "decoder_start_token_id": 0,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


# google/t5-v1_1-xxl (config.json: d_model 4096, d_kv 64, d_ff 10240, num_layers 24, num_heads 64,
# relative_attention_num_buckets 32, vocab_size 32128, layer_norm_epsilon 1e-06, feed_forward_proj "gated-gelu";
# relative_attention_max_distance is not stated there and is transformers' default, 128, as the
# text_encoder_3/config.json of stabilityai/stable-diffusion-3.5-large states it). The encoder of SD3 / 3.5
# (text_encoder_3) and FLUX.1 (text_encoder_2). vocab_size counts 28 rows past the tokenizer's 32100 ids.
T5_XXL = T5Config(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
)
