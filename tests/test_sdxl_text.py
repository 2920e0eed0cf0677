"""SDXL's text side against transformers: the penultimate hidden state without the final LayerNorm, and the pooled,
projected output of the second encoder (CLIPTextModelWithProjection)."""
from __future__ import annotations

import pytest
import torch

from sdlite.config import TextEncoderConfig
from sdlite.models.clip import CLIPTextEncoder
from tests.reference import max_rel_err, seed_all

TOL = 1e-4

# OpenCLIP bigG in small (GELU, pads with id 0, projection) and the OpenAI ViT-L one (quick-GELU, pads with EOS)
TINY_G = TextEncoderConfig(vocab_size=1000, width=40, layers=4, heads=4, mlp_width=64, activation="gelu",
                           pad_token_id=0, eos_token_id=999, projection_dim=24)
TINY_L = TextEncoderConfig(vocab_size=1000, width=32, layers=3, heads=4, mlp_width=37, pad_token_id=999,
                           eos_token_id=999, projection_dim=32)


def reference(cfg: TextEncoderConfig, eos_token_id: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    d = cfg.to_diffusers()
    for k in ("architectures", "model_type", "torch_dtype"):
        d.pop(k, None)
    d["eos_token_id"] = eos_token_id
    return CLIPTextModelWithProjection(CLIPTextConfig(**d, attn_implementation="eager")).eval()


def ids_with_eos(eos: int, pad: int, lengths=(5, 12)) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    rows = []
    for n in lengths:
        body = torch.randint(1, 990, (n,), generator=g).tolist()
        rows.append([998] + body + [eos] + [pad] * (77 - n - 2))   # BOS, words, EOS, padding
    return torch.tensor(rows)


@pytest.mark.parametrize("eos_in_config", [999, 2], ids=["eos-id", "legacy-argmax"])
@pytest.mark.parametrize("cfg", [TINY_G, TINY_L], ids=["bigG-like", "L-like"])
def test_penultimate_and_pooled_match_transformers(cfg, eos_in_config):
    cfg = TextEncoderConfig(**{**cfg.__dict__, "eos_token_id": eos_in_config})
    ref = seed_all(reference(cfg, eos_in_config))
    ours = CLIPTextEncoder(cfg, projection=True).eval()
    sd = {k if k.startswith(("text_model.", "text_projection")) else f"text_model.{k}": v
          for k, v in ref.state_dict().items() if not k.endswith("position_ids")}
    ours.load_state_dict(sd, strict=True)
    ids = ids_with_eos(999, cfg.pad_token_id)
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
        hidden, pooled = ours.encode(ids, clip_skip=2, final_norm=False, pooled=True)
        assert max_rel_err(hidden, out.hidden_states[-2]) <= TOL
        assert max_rel_err(pooled, out.text_embeds) <= TOL
        # the plain path is unchanged: last layer through the final LayerNorm
        assert max_rel_err(ours(ids), out.last_hidden_state) <= TOL
        assert max_rel_err(ours.encode(ids), out.last_hidden_state) <= TOL


def test_encode_clip_skip_out_of_range():
    with pytest.raises(ValueError, match=r"clip_skip=5 .* 1\.\.4"):
        CLIPTextEncoder(TINY_G).encode(torch.zeros(1, 77, dtype=torch.long), clip_skip=5)
