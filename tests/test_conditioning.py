"""Prompts as A1111 reads them, against independent computations: long prompts (chunks of 75 tokens, the comma
rule, BREAK, weights with the mean restored) from transformers' CLIPTextModel and tokenizer; textual-inversion
embeddings against diffusers' ``load_textual_inversion``; prompt editing against diffusers with the prompt
embeddings swapped at the step A1111 swaps them."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sdlite.cli import main
from sdlite.pipeline import Engine, Request
from tests.reference import diffusers_pipeline, saved_pipeline, use_scheduler, with_contrast

# 26 segments of 6-8 tokens with their weights: 160+ tokens, three chunks, commas between segments
SEGMENTS = [(f"{colour} {thing} with a little {extra}", weight) for colour, thing, extra, weight in [
    ("red", "circle", "shadow", 1.0), ("blue", "square", "glow", 1.3), ("green", "star", "outline", 1.0),
    ("yellow", "triangle", "texture", 0.8), ("purple", "hexagon", "noise", 1.0), ("orange", "ring", "blur", 1.1),
    ("white", "cross", "shine", 1.0), ("black", "arrow", "gradient", 1.5), ("grey", "heart", "shade", 1.0),
    ("pink", "moon", "sparkle", 0.9), ("brown", "cloud", "rim", 1.0), ("cyan", "drop", "edge", 1.2),
    ("teal", "leaf", "pattern", 1.0), ("gold", "crown", "light", 1.0), ("silver", "key", "mist", 0.7),
    ("navy", "boat", "wave", 1.0), ("olive", "tree", "bark", 1.0), ("maroon", "door", "frame", 1.25),
    ("lime", "kite", "tail", 1.0), ("amber", "lamp", "flame", 1.0), ("violet", "bell", "ribbon", 1.0),
    ("coral", "fish", "fin", 1.0), ("ivory", "tower", "window", 1.0), ("beige", "chair", "leg", 1.0),
    ("indigo", "bird", "wing", 1.4), ("scarlet", "rose", "petal", 1.0)]]


def a1111_prompt(segments) -> str:
    return ", ".join(text if w == 1.0 else f"({text}:{w})" for text, w in segments)


def reference_conditioning(tokenizer, text_encoder, segments, breaks=(), clip_skip=1) -> torch.Tensor:
    """A1111's rules computed directly: each piece tokenized alone (its weight on every token), ", " between
    pieces, chunks of 75 moved back to a comma within the last 20 tokens, BREAK before the pieces in ``breaks``,
    framed start + 75 + end (padded with the end token), encoded by transformers' CLIPTextModel, each hidden
    state times its weight, the chunk's mean restored."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    comma = tokenizer.convert_tokens_to_ids(",</w>")
    pieces = []
    for i, (text, w) in enumerate(segments):
        if i in breaks:
            pieces.append(None)
        elif i:
            pieces.append(([comma], 1.0))
        pieces.append((tokenizer(text, add_special_tokens=False).input_ids, w))
    chunks, tokens, weights = [], [], []

    def close():
        nonlocal tokens, weights
        pad = 75 - len(tokens)
        chunks.append(([bos, *tokens, *[eos] * pad, eos], [1.0, *weights, *[1.0] * pad, 1.0]))
        tokens, weights = [], []

    for piece in pieces:
        if piece is None:
            close()
            continue
        ids, w = piece
        for t in ids:
            if len(tokens) == 75:
                last = max((j for j, u in enumerate(tokens) if u == comma), default=-1)
                if last != -1 and 75 - last <= 20 and t != comma:
                    moved = (tokens[last + 1:], weights[last + 1:])
                    tokens, weights = tokens[:last + 1], weights[:last + 1]
                    close()
                    tokens, weights = list(moved[0]), list(moved[1])
                if len(tokens) == 75:
                    close()
            tokens.append(t)
            weights.append(w)
    close()
    out = []
    with torch.no_grad():
        for ids, w in chunks:
            if clip_skip == 1:
                z = text_encoder(torch.tensor([ids])).last_hidden_state
            else:  # A1111: hidden state -clip_skip, through the final LayerNorm
                hidden = text_encoder(torch.tensor([ids]), output_hidden_states=True).hidden_states[-clip_skip]
                z = text_encoder.final_layer_norm(hidden)
            mean = z.mean()
            z = z * torch.tensor(w)[None, :, None]
            out.append(z * (mean / z.mean()))
    return torch.cat(out, dim=1), len(chunks)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cond")
    pipe = diffusers_pipeline("sd1", tmp)
    with torch.no_grad():  # cross-attention strong enough that the prompt visibly steers this random model
        for name, p in pipe.unet.named_parameters():
            if ".attn2.to_v." in name or ".attn2.to_out." in name:
                p.mul_(8.0)
    pipe = saved_pipeline(with_contrast(pipe), tmp / "model")
    return pipe, tmp / "model", Engine.load(tmp / "model", precision="exact")


def test_long_weighted_prompt_matches_a1111_rules(tiny):
    pipe, _, engine = tiny
    prompt = a1111_prompt(SEGMENTS)
    expected, n_chunks = reference_conditioning(pipe.tokenizer, pipe.text_encoder, SEGMENTS)
    assert n_chunks == 3
    got, warnings = engine.encode_prompt([prompt])
    assert not warnings and got.shape == expected.shape == (1, 77 * 3, expected.shape[-1])
    assert (got - expected).abs().max().item() <= 1e-4


def test_long_weighted_prompt_with_clip_skip(tiny):
    pipe, _, engine = tiny
    expected, _ = reference_conditioning(pipe.tokenizer, pipe.text_encoder, SEGMENTS[:14], clip_skip=2)
    got, _ = engine.encode_prompt([a1111_prompt(SEGMENTS[:14])], clip_skip=2)
    assert got.shape == expected.shape and (got - expected).abs().max().item() <= 1e-4


def test_break_starts_a_new_chunk(tiny):
    pipe, _, engine = tiny
    segments = SEGMENTS[:6]
    prompt = ", ".join(t if i != 3 else f"BREAK {t}" for i, (t, _) in enumerate(segments)).replace(", BREAK", " BREAK")
    expected, n_chunks = reference_conditioning(pipe.tokenizer, pipe.text_encoder, [(t, 1.0) for t, _ in segments],
                                                breaks=(3,))
    got, _ = engine.encode_prompt([prompt])
    assert n_chunks == 2 and got.shape[1] == 154
    assert (got - expected).abs().max().item() <= 1e-4


def test_plain_prompt_is_one_chunk_as_before(tiny):
    """No special syntax: the 77 tokens diffusers encodes, so the same conditioning as diffusers'."""
    pipe, _, engine = tiny
    prompt = "a red circle on a blue background"
    ids = pipe.tokenizer(prompt, padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = pipe.text_encoder(ids).last_hidden_state
    got, _ = engine.encode_prompt([prompt])
    assert got.shape == expected.shape and (got - expected).abs().max().item() <= 1e-5


def test_prompt_and_negative_of_different_lengths_are_padded_with_the_empty_prompt(tiny):
    pipe, _, engine = tiny
    long_prompt = a1111_prompt(SEGMENTS[:12])   # 2 chunks
    got, _ = engine.encode_prompt([long_prompt, "blurry"])
    assert got.shape[1] == 154
    empty, _ = engine.encode_prompt([""])
    short, _ = engine.encode_prompt(["blurry"])
    # to fp32 rounding, not bit for bit: the chunks are encoded in one batch of three here and alone below, and
    # a matrix product's summation order may depend on the batch (it does in oneDNN's AVX2 kernels)
    assert (got[1, :77] - short[0]).abs().max().item() <= 1e-5
    assert (got[1, 77:] - empty[0]).abs().max().item() <= 1e-5
    assert (got[1, 77:] - short[0]).abs().max().item() > 1e-2    # the padding chunk is not the prompt's


def test_long_prompt_image_is_deterministic_and_not_cut(tiny):
    _, _, engine = tiny
    request = Request(prompt=a1111_prompt(SEGMENTS), negative_prompt="blurry", steps=3, seed=5, width=64,
                      height=64, sampler="euler")
    a, b = engine.generate(request), engine.generate(request)
    assert not a.warnings
    assert np.array_equal(np.asarray(a.images[0]), np.asarray(b.images[0]))
    cut = engine.generate(request.replace(prompt=a1111_prompt(SEGMENTS[:9])))
    assert not np.array_equal(np.asarray(a.images[0]), np.asarray(cut.images[0]))


def test_prompt_editing_matches_diffusers_with_embeddings_swapped(tiny):
    """``[A:B:1]`` over 5 steps: A1111 uses A up to and including step 1 (0-based sampler steps 0 and 1) and B
    after. diffusers given the same switch through its step-end callback is the
    reference."""
    pipe, _, engine = tiny
    use_scheduler(pipe, "euler")
    negative = "blurry"

    def embeds(text):
        ids = pipe.tokenizer(text, padding="max_length", max_length=77, return_tensors="pt").input_ids
        with torch.no_grad():
            return pipe.text_encoder(ids).last_hidden_state

    neg = embeds(negative)
    first, second = embeds("a red circle on a blue background"), embeds("seven tall trees beside an old mill")

    def swap(p, step, timestep, kwargs):   # called after step `step`; the next step is step + 1
        if step + 1 == 2:
            return {"prompt_embeds": torch.cat([neg, second])}
        return {}

    out = pipe(prompt_embeds=first, negative_prompt_embeds=neg, num_inference_steps=5, guidance_scale=7.5,
               generator=[torch.Generator().manual_seed(4)], height=64, width=64, output_type="latent",
               callback_on_step_end=swap, callback_on_step_end_tensor_inputs=["prompt_embeds"]).images
    expected = out / pipe.vae.config.scaling_factor
    result = engine.generate(Request(prompt="[a red circle on a blue background:seven tall trees beside an old mill:1]",
                                     negative_prompt=negative, steps=5, seed=4, width=64, height=64, sampler="euler"))
    plain = engine.generate(Request(prompt="a red circle on a blue background", negative_prompt=negative, steps=5,
                                    seed=4, width=64, height=64, sampler="euler"))
    # compared as latents: this tiny random model's text conditioning moves its pixels by about one level only
    got = result.latents / engine.spec.vae.scaling_factor
    err = (got - expected).abs().max().item()
    assert err <= 1e-5 * expected.abs().max().item()   # fp32 rounding, relative to this random model's large latents
    # and the edit is seen: the unedited prompt lands far further away than our rounding
    assert (plain.latents / engine.spec.vae.scaling_factor - expected).abs().max().item() > 10 * err


def test_each_distinct_conditioning_is_encoded_once(tiny):
    _, _, engine = tiny
    calls = []
    with engine.models.use("text_encoder") as te:
        handle = te.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
        try:
            cond = engine.conditioning(Request(prompt="a [red|blue] circle", negative_prompt="[x:y:3]", steps=8),
                                       use_cfg=True)
        finally:
            handle.remove()
    # one pass: "a red circle", "a blue circle", "x", "y" and the empty prompt (padding), one chunk each
    assert calls == [5]
    # A1111's alternation: entry k ends at step k + 1 and step s takes the first entry with s <= its end, so
    # steps 0 and 1 both get the first alternative
    assert [cond.at(k, 1)[0].data_ptr() == cond.encoded["a red circle"].data_ptr() for k in range(4)] == \
        [True, True, False, True]


# --- textual inversion -------------------------------------------------------------------------------------

def _write_a1111_pt(path, vectors):
    torch.save({"string_to_token": {"*": 265}, "string_to_param": {"*": torch.nn.Parameter(vectors)},
                "name": path.stem, "step": 100}, path)


@pytest.mark.parametrize("fmt", ["a1111-pt", "a1111-safetensors", "diffusers", "emb_params"])
def test_embedding_matches_diffusers_load_textual_inversion(tiny, tmp_path, fmt):
    from safetensors.torch import save_file

    from diffusers import StableDiffusionPipeline

    pipe, folder, _ = tiny
    width = pipe.text_encoder.config.hidden_size
    vectors = torch.randn(3, width, generator=torch.Generator().manual_seed(1))
    emb_dir = tmp_path / "embeddings"
    emb_dir.mkdir()
    if fmt == "a1111-pt":
        path = emb_dir / "zorblax.pt"
        _write_a1111_pt(path, vectors)
    elif fmt == "a1111-safetensors":
        path = emb_dir / "zorblax.safetensors"
        save_file({"string_to_param.*": vectors}, path)
    elif fmt == "emb_params":
        path = emb_dir / "zorblax.pt"
        torch.save({"emb_params": vectors}, path)
    else:
        (emb_dir / "zorblax").mkdir()
        path = emb_dir / "zorblax" / "learned_embeds.safetensors"
        save_file({"<zorblax>": vectors}, path)
    ref = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True, safety_checker=None,
                                                  requires_safety_checker=False)
    if fmt == "diffusers":
        ref.load_textual_inversion(str(path), token="zorblax")
    else:
        ref.load_textual_inversion(str(path), token="zorblax")
    prompt = "a photo of zorblax on a blue background"
    with torch.no_grad():
        expected = ref.encode_prompt(prompt, "cpu", 1, False)[0]
    engine = Engine.load(folder, precision="exact")
    from sdlite.adapters.embeddings import EmbeddingDB

    db = EmbeddingDB.from_dir(emb_dir, engine.tokenizer, width)
    got, _ = engine.encode_prompt([prompt], embeddings=db)
    assert got.shape == expected.shape and (got - expected).abs().max().item() <= 1e-5
    tagged, _ = engine.encode_prompt([db.rewrite_tags("a photo of <embedding:zorblax> on a blue background")],
                                     embeddings=db)
    assert torch.equal(tagged, got)


def test_embedding_of_another_width_is_refused(tiny, tmp_path):
    from sdlite.adapters.embeddings import EmbeddingDB, EmbeddingError

    _, _, engine = tiny
    _write_a1111_pt(tmp_path / "wide.pt", torch.randn(2, 1024))
    with pytest.raises(EmbeddingError, match=r"wide.pt: embedding 'wide' has vectors of width 1024, but this "
                                             r"model's text encoder has width \d+"):
        EmbeddingDB.from_dir(tmp_path, engine.tokenizer, engine.spec.text.width)


def test_tokens_command_prints_chunks_and_schedule(tiny, capsys):
    _, folder, _ = tiny
    prompt = a1111_prompt(SEGMENTS) + ", [day:night:0.5] <lora:style:0.7>"
    assert main(["tokens", prompt, "--model", str(folder), "--steps", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["networks"] == [{"kind": "lora", "name": "style", "weight": 0.7, "args": ["0.7"]}]
    assert "<lora" not in out["text"]
    assert [s["end_at_step"] for s in out["schedule"]] == [5, 10]
    first = out["schedule"][0]
    assert len(first["chunks"]) == 3 and all(len(c["tokens"]) == 77 for c in first["chunks"])
    # A1111 counts 75 for every chunk but the last, even one cut short at a comma
    assert first["token_count"] == 75 * 2 + first["chunks"][-1]["prompt_tokens"]
    assert all(c["prompt_tokens"] <= 75 for c in first["chunks"])
    assert ["blue square with a little glow", 1.3] in [[t.strip(", "), round(w, 6)] for t, w in first["parsed"]]
