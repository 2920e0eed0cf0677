"""The Qwen decoder's facts, as a text encoder: a frozen config, the presets of the models image generators use, and
the token length their pipelines read.

Qwen2 / Qwen2.5 and Qwen3 (Alibaba's language models) are the same decoder-only transformer up to two switches,
which are the config's ``qk_norm`` and ``attention_bias``:

* **Qwen3** normalises each head of q and k with an RMSNorm before the rotary embedding (``q_norm``, ``k_norm``) and
  has no biases. Z-Image (-Turbo) encodes its prompt with Qwen3-4B; FLUX.2 klein with Qwen3-4B (4B) or Qwen3-8B (9B).
* **Qwen2 / Qwen2.5** have no q/k norm, and q, k and v carry biases (o does not). Qwen-Image encodes with the
  language model of Qwen2.5-VL-7B-Instruct (its vision tower is a network of its own).

The field names are those of transformers' ``Qwen3Config`` / ``Qwen2Config``, so a folder's
``text_encoder/config.json`` maps field for field (:meth:`QwenConfig.from_transformers`). Which hidden layers a
pipeline reads (Z-Image: the second to last; klein: 9, 18 and 27) is the pipeline family's fact, not the encoder's.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ConfigError

__all__ = ["QwenConfig", "QWEN3_4B", "QWEN3_8B", "QWEN2_5_VL_7B", "QWEN_PRESETS", "QWEN_MAX_LENGTH"]

# Tokens of the row a pipeline encodes: diffusers' Z-Image and FLUX.2 klein pipelines tokenize their chat-templated
# prompt with max_sequence_length=512 (padding="max_length", truncation=True) and read the attention mask.
QWEN_MAX_LENGTH = 512

_QWEN3_TYPES = ("qwen3",)
# Qwen2.5-VL's configs say "qwen2_5_vl" at the top and "qwen2_5_vl_text" for the language model (transformers 5);
# Qwen2-VL's likewise. Their language models are Qwen2 layers with a multimodal RoPE (see sdlite.models.qwen).
_QWEN2_TYPES = ("qwen2", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text")
_ROPE_TYPES = ("default", "mrope")


@dataclass(frozen=True)
class QwenConfig:
    """The decoder: ``vocab_size`` embeddings of ``hidden_size``; ``num_hidden_layers`` pre-norm blocks of grouped-query
    attention (``num_attention_heads`` query heads and ``num_key_value_heads`` key/value heads of ``head_dim``, with
    rotary position embeddings of base ``rope_theta``) and a SwiGLU MLP of ``intermediate_size``; RMSNorm with
    ``rms_norm_eps`` everywhere. ``qk_norm``: q and k normalised per head (Qwen3). ``attention_bias``: q, k and v
    carry biases (Qwen2 / 2.5; o never does here). ``max_position_embeddings`` and ``tie_word_embeddings`` describe
    the language model (its context, whether its LM head is the embedding) and change nothing in the encoder, which
    has no LM head. The defaults are Qwen3-4B."""

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    # Qwen2-VL / 2.5-VL's multimodal RoPE: how many of the head's head_dim / 2 rotary pairs turn with the temporal, the
    # height and the width position of a token ([16, 24, 24] for Qwen2.5-VL-7B); None for the text-only models. Text
    # has the same three positions, so it only matters where image tokens are in the row (Qwen-Image-Edit)
    mrope_section: tuple[int, int, int] | None = None
    # Qwen2.5-VL's vision tower (a sdlite.config.qwen_vision.QwenVisionConfig) where the encoder reads images
    # (Qwen-Image-Edit); None where it reads text only, its vision tower left in the file
    vision: object | None = None

    architecture = "qwen"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Qwen config field {name}={value!r}: expected a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"Qwen config fields num_attention_heads={self.num_attention_heads} and "
                              f"num_key_value_heads={self.num_key_value_heads}: the query heads must be a multiple "
                              "of the key/value heads")
        if self.head_dim % 2:
            raise ConfigError(f"Qwen config field head_dim={self.head_dim}: the rotary embedding needs an even size")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"Qwen config field {name}={value!r}: expected a number > 0")
        for name in ("qk_norm", "attention_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Qwen config field {name}={getattr(self, name)!r}: expected true or false")
        if self.mrope_section is not None:
            sections = self.mrope_section
            if (not isinstance(sections, tuple) or len(sections) != 3
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in sections)
                    or sum(sections) != self.head_dim // 2):
                raise ConfigError(f"Qwen config field mrope_section={sections!r}: expected three counts of rotary "
                                  f"pairs (temporal, height, width) adding up to head_dim / 2 = {self.head_dim // 2}")

    @property
    def width(self) -> int:
        """The width of its hidden states (what every text encoder config answers: the embeddings' width, which a
        textual-inversion embedding must have)."""
        return self.hidden_size

    @property
    def kind(self) -> str:
        """"qwen3" (q/k norm) or "qwen2" (Qwen2 / 2.5 layers)."""
        return "qwen3" if self.qk_norm else "qwen2"

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per key/value head (Qwen3-4B: 4)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_width(self) -> int:
        """Rows of q_proj: ``num_attention_heads * head_dim`` (Qwen3-4B: 4096, not its hidden size 2560)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Rows of k_proj and v_proj: ``num_key_value_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_transformers(cls, cfg: dict) -> "QwenConfig":
        """From a transformers config dict (a ``text_encoder/config.json``): Qwen3 (``qwen3``), Qwen2 / 2.5
        (``qwen2``) or the language model of Qwen2-VL / Qwen2.5-VL (``qwen2_5_vl`` with or without a nested
        ``text_config``). A field asking for what this decoder does not do (another activation, sliding-window
        attention, a scaled RoPE, biases on a Qwen3) is a :class:`ConfigError` naming it."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"a Qwen config is a JSON object, got {type(cfg).__name__}")
        model_type = cfg.get("model_type", "qwen3")
        if model_type not in _QWEN3_TYPES + _QWEN2_TYPES:
            raise ConfigError(f"Qwen config field model_type={model_type!r} is not supported (expected one of "
                              f"{', '.join(map(repr, _QWEN3_TYPES + _QWEN2_TYPES))})")
        text = cfg.get("text_config")
        if isinstance(text, dict) and model_type in _QWEN2_TYPES:
            cfg = {**cfg, **text}   # the language model's own fields win over the wrapper's
        qwen3 = model_type in _QWEN3_TYPES
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"Qwen config field hidden_act={act!r} is not supported (expected 'silu')")
        if cfg.get("use_sliding_window"):
            raise ConfigError("Qwen config field use_sliding_window=True: sliding-window attention is not supported")
        if qwen3 and cfg.get("attention_bias"):
            raise ConfigError("Qwen config field attention_bias=True on a Qwen3 (biases on q, k, v and o) is not "
                              "supported: no released Qwen3 has them")
        theta = _rope_theta(cfg)
        sections = _mrope_section(cfg)
        heads = cfg.get("num_attention_heads", 32)
        hidden = cfg.get("hidden_size", 4096)
        head_dim = cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                           and heads > 0 else 0)
        return cls(
            vocab_size=cfg.get("vocab_size", 151936),
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size", 22016),
            num_hidden_layers=cfg.get("num_hidden_layers", 32),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else theta,
            qk_norm=qwen3,
            attention_bias=not qwen3,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mrope_section=sections,
        )

    def to_transformers(self) -> dict:
        """A transformers config dict of this decoder: ``Qwen3Config`` (qk_norm) or ``Qwen2Config`` (bias)."""
        if self.qk_norm == self.attention_bias:
            raise ConfigError(f"Qwen config with qk_norm={self.qk_norm} and attention_bias={self.attention_bias} is "
                              "neither a Qwen3 nor a Qwen2 in transformers' terms")
        qwen3 = self.qk_norm
        out = {
            "architectures": ["Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM"],
            "model_type": "qwen3" if qwen3 else "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "torch_dtype": "bfloat16",
        }
        if self.mrope_section is not None:   # Qwen2.5-VL's language model, as its config.json states it
            out["rope_scaling"] = {"type": "mrope", "mrope_section": list(self.mrope_section)}
        if qwen3:
            out.update(head_dim=self.head_dim, attention_bias=False)
        elif self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ConfigError(f"a Qwen2 config has no head_dim field: its heads are hidden_size / heads, here "
                              f"{self.hidden_size} / {self.num_attention_heads}, not {self.head_dim}")
        return out


def _rope_theta(cfg: dict):
    """The RoPE base from ``rope_theta`` (transformers 4) or ``rope_parameters`` (5); a scaled RoPE is refused."""
    theta = cfg.get("rope_theta")
    for name in ("rope_parameters", "rope_scaling"):
        params = cfg.get(name)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ConfigError(f"Qwen config field {name}={params!r}: expected an object or null")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in _ROPE_TYPES:
            raise ConfigError(f"Qwen config field {name} with rope_type={kind!r} is not supported (expected "
                              f"{' or '.join(map(repr, _ROPE_TYPES))}: an unscaled RoPE)")
        if "rope_theta" in params:
            theta = params["rope_theta"]
    return 10000.0 if theta is None else theta


def _mrope_section(cfg: dict) -> tuple | None:
    """The multimodal RoPE's sections from ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5), if any."""
    for name in ("rope_parameters", "rope_scaling"):
        params = cfg.get(name)
        if isinstance(params, dict) and params.get("mrope_section") is not None:
            sections = params["mrope_section"]
            if not isinstance(sections, (list, tuple)):
                raise ConfigError(f"Qwen config field {name}.mrope_section={sections!r}: expected a list of three "
                                  "counts")
            return tuple(sections)
    return None


# Qwen/Qwen3-4B (config.json: hidden_size 2560, intermediate_size 9728, num_hidden_layers 36, num_attention_heads 32,
# num_key_value_heads 8, head_dim 128, rms_norm_eps 1e-06, rope_theta 1000000, vocab_size 151936,
# max_position_embeddings 40960, tie_word_embeddings true, attention_bias false). The text_encoder of
# Tongyi-MAI/Z-Image-Turbo and of black-forest-labs/FLUX.2-klein-4B states the same numbers. (Qwen3-4B-Instruct-2507
# differs: rope_theta 5000000 and 262144 positions.)
QWEN3_4B = QwenConfig(
    vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
    attention_bias=False, max_position_embeddings=40960, tie_word_embeddings=True,
)

# Qwen/Qwen3-8B (config.json: hidden_size 4096, intermediate_size 12288, num_hidden_layers 36, num_attention_heads
# 32, num_key_value_heads 8, head_dim 128, rms_norm_eps 1e-06, rope_theta 1000000, vocab_size 151936,
# max_position_embeddings 40960, tie_word_embeddings false). FLUX.2 klein 9B's text encoder.
QWEN3_8B = QwenConfig(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
    attention_bias=False, max_position_embeddings=40960, tie_word_embeddings=False,
)

# The language model of Qwen/Qwen2.5-VL-7B-Instruct (config.json: hidden_size 3584, intermediate_size 18944,
# num_hidden_layers 28, num_attention_heads 28, num_key_value_heads 4, rms_norm_eps 1e-06, rope_theta 1000000.0,
# vocab_size 152064, max_position_embeddings 128000, tie_word_embeddings false; rope_scaling {"type": "mrope",
# "mrope_section": [16, 24, 24]}; Qwen2 layers: q/k/v biases, no q/k norm, head_dim 3584 / 28 = 128). Qwen-Image's
# text_encoder (Qwen2_5_VLForConditionalGeneration), read without its vision tower.
QWEN2_5_VL_7B = QwenConfig(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=False,
    attention_bias=True, max_position_embeddings=128000, tie_word_embeddings=False, mrope_section=(16, 24, 24),
)

QWEN_PRESETS = {"qwen3-4b": QWEN3_4B, "qwen3-8b": QWEN3_8B, "qwen2.5-vl-7b": QWEN2_5_VL_7B}
