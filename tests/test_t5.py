"""The T5 text encoder of SD3 / FLUX and its tokenizer, against transformers 5 (the independent reference).

* Tokenizer: ids equal ``transformers.T5TokenizerFast(tokenizer_file=...)`` (``add_special_tokens=True``) on long,
  Unicode, whitespace, empty, digit and punctuation prompts; rows equal diffusers' SD3 / FLUX tokenization
  (``padding="max_length", truncation=True``); weighted prompts keep the plain prompt's ids.
* Encoder: a tiny config loaded key for key from a random ``T5EncoderModel`` gives bit-identical outputs in float32
  (with and without an attention mask, gated-gelu and relu), bfloat16 and float16 (transformers' own fp16 load,
  ``wo`` kept in fp32, and its inf clamp); full-size T5-XXL on the meta device has transformers' keys and shapes.
* Key tables: the tiny model saved in each layout people have (a sharded folder, ComfyUI's fp16, fp8 and scaled-fp8
  files, Stability's prefixed single file) loads to the same outputs; bad weights give errors naming the key.

The tiny model's weights are rounded to values float8_e4m3fn holds exactly, so that every layout stores them
without loss and all of them must give the reference's outputs to the bit.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil  # noqa: E402
from importlib import resources  # noqa: E402

import pytest  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from sdlite.config import ConfigError  # noqa: E402
from sdlite.config.t5 import (  # noqa: E402
    FLUX_DEV_T5_MAX_LENGTH, SD3_T5_MAX_LENGTH, T5_XXL, T5Config,
)
from sdlite.models.t5 import T5Encoder, relative_position_buckets  # noqa: E402
from sdlite.prompts import parse_attention  # noqa: E402
from sdlite.tokenizers import T5Tokenizer, load_tokenizer, tokenizer_kind  # noqa: E402
from sdlite.weights import open_checkpoint, open_sharded  # noqa: E402
from sdlite.weights.plan import ConversionError, UnsupportedModelError  # noqa: E402
from sdlite.weights.t5_keys import (  # noqa: E402
    SINGLE_FILE_PREFIX, dequantize, find_t5_prefix, infer_t5_config, load_t5, t5_plan, t5_state_from,
)

TOKENIZER_JSON = resources.files("sdlite").joinpath("data", "t5", "tokenizer.json")
LONG = ("a highly detailed photograph of an astronaut riding a horse on mars, dramatic lighting, volumetric "
        "clouds, 8k, trending on artstation, by greg rutkowski and alphonse mucha, " * 14)
PROMPTS = [
    "a photo of an astronaut riding a horse on mars",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tnew\nlines\r\nand  double  spaces",
    "\u00a0no-break\u3000ideographic\u2003em spaces",
    "café naïve Ærøskøbing Straße façade",
    "e\u0301 decomposed accents, ﬁ ligature, ｆｕｌｌｗｉｄｔｈ, ①②, ℃",
    "一只猫在月球上 日本語のテキスト 한국어",
    "emoji 🐱🚀👩‍🚀 and flags 🇫🇷",
    "digits 0123456789 3.14159 1,000,000 2024-05-01 x=42",
    "punctuation!!! ?? ... (a:1.2) [b] {c} <d> \"e\" 'f' #g @h $i %j ^k &l *m _n +o =p |q \\r /s ~t `u",
    "special tokens written out: </s> <pad> <unk> <extra_id_0> x</s>y",
    LONG,
]
TINY = dict(vocab_size=1000, d_model=32, d_kv=6, d_ff=64, num_layers=3, num_heads=4)   # q/k/v 24 wide, not 32
SCALE = 0.25   # the scaled-fp8 file's per-tensor scale (a power of two: storing the weights / SCALE is exact)


# ------------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok():
    return T5Tokenizer.from_package()


@pytest.fixture(scope="module")
def ref_tok():
    return transformers.T5TokenizerFast(tokenizer_file=str(TOKENIZER_JSON))


def test_ids_equal_transformers(tok, ref_tok):
    for prompt in PROMPTS:
        assert tok.encode(prompt) == ref_tok(prompt, add_special_tokens=True).input_ids, prompt
    assert len(tok.encode(LONG)) > 600   # well past SD3's 256 and FLUX's 512


def test_known_ids(tok):
    # the example the shipped tokenizer's README gives; "</s>" = 1, "<pad>" = 0
    assert tok.encode("a photo of an astronaut riding a horse on mars") == \
        [3, 9, 1202, 13, 46, 30059, 7494, 3, 9, 4952, 30, 8113, 1]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.vocab_size) == (1, 0, None, 32100)
    assert tok.encode("") == [1]


@pytest.mark.parametrize("length", [SD3_T5_MAX_LENGTH, FLUX_DEV_T5_MAX_LENGTH, 8])
def test_rows_equal_diffusers(tok, ref_tok, length):
    ours = T5Tokenizer.from_package(max_length=length)
    # diffusers' _get_t5_prompt_embeds (SD3, FLUX): padding="max_length", truncation=True, add_special_tokens=True
    ref = ref_tok(PROMPTS, padding="max_length", max_length=length, truncation=True, add_special_tokens=True,
                  return_tensors="pt").input_ids
    rows = ours(PROMPTS)
    assert rows.dtype == torch.long and rows.shape == (len(PROMPTS), length)
    assert torch.equal(rows, ref)
    assert torch.equal(ours(PROMPTS[0]), ref[:1])
    for i, prompt in enumerate(PROMPTS):
        assert tok.pad(tok.encode(prompt), length) == ref[i].tolist()


def test_truncation_report(tok, ref_tok):
    words = ["cat", "dog", "on", "mars"]
    for word in words:   # each word one token, so the cut falls between words
        assert len(ref_tok(word, add_special_tokens=False).input_ids) == 1
    prompt = " ".join(words[i % 4] + str(i % 10) for i in range(200))
    untruncated = ref_tok(prompt, add_special_tokens=True).input_ids
    info = tok.tokenize_with_info(prompt)
    assert info.input_ids == ref_tok(prompt, padding="max_length", max_length=256, truncation=True).input_ids
    assert info.input_ids[-1] == 1 and len(info.input_ids) == 256
    assert info.num_tokens == len(untruncated) - 1 and info.num_kept == 255
    # diffusers warns with the decoded ids untruncated[max_length - 1:-1]: the same tokens
    assert info.num_dropped == len(untruncated[255:-1])
    assert prompt.endswith(info.dropped_text) and info.dropped_text and not info.dropped_text[0].isspace()
    kept = prompt[:len(prompt) - len(info.dropped_text)]
    assert ref_tok(kept, add_special_tokens=True).input_ids == info.input_ids
    short = tok.tokenize_with_info("a cat")
    assert (short.num_tokens, short.num_kept, short.dropped_text, short.truncated) == (3, 3, "", False)
    assert short.input_ids == [3, 9, 1712, 1] + [0] * 252


def test_pad_and_weights(tok):
    assert tok.pad([5, 6, 7, 1], 3) == [5, 6, 1]
    assert tok.pad([5, 1], 4) == [5, 1, 0, 0]
    assert tok.pad([1], 1) == [1] and tok.pad([5, 6, 1], 1) == [1]
    assert tok.pad_weights([1.1, 1.2, 1.3, 1.0], 3) == [1.1, 1.2, 1.0]
    assert tok.pad_weights([0.5, 1.0], 4) == [0.5, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="must end with </s>.*last id 7"):
        tok.pad([5, 7], 4)
    with pytest.raises(ValueError, match="no ids"):
        tok.pad([], 4)
    with pytest.raises(ValueError, match="max_length must be an integer >= 1.*0"):
        tok.pad([1], 0)


def test_weighted_keeps_the_plain_ids(tok):
    for prompt in PROMPTS:
        ids, weights = tok.encode_weighted([(prompt, 1.0)])
        assert ids == tok.encode(prompt) and weights == [1.0] * len(ids)
    prompt = "a photo of (cat:1.5) on [mars], ((glowing)) BREAK detailed"
    pieces = parse_attention(prompt)
    ids, weights = tok.encode_weighted(pieces)
    # the same ids as the prompt without its syntax (BREAK is a word break: T5 reads one row)
    assert ids == tok.encode("a photo of cat on mars, glowing detailed")
    assert len(weights) == len(ids) and weights[-1] == 1.0 and ids[-1] == 1
    by_token = dict(zip(tok._tokenizer.encode("a photo of cat on mars, glowing detailed",
                                              add_special_tokens=False).tokens, weights))
    assert by_token["▁cat"] == 1.5 and by_token["▁photo"] == 1.0 and by_token["▁detailed"] == 1.0
    assert by_token["▁mars"] == pytest.approx(1 / 1.1) and by_token["▁glowing"] == pytest.approx(1.21)
    # a word that is only "▁" + an unknown character takes the word's weight
    ids, weights = tok.encode_weighted([("café ", 1.0), ("猫", 1.5)])
    assert ids == tok.encode("café 猫") == [11949, 3, 2, 1] and weights == [1.0, 1.5, 1.5, 1.0]
    assert tok.encode_weighted(parse_attention("")) == ([1], [1.0])
    # the row form: cut and padded as diffusers' rows are, and how many tokens were cut
    row, row_weights, cut = tok.encode_weighted(parse_attention(f"(cat:1.5) {LONG}"), max_length=256)
    plain = tok.encode(f"cat {LONG}")
    assert row == tok.pad(plain, 256) and cut == len(plain) - 256 > 0
    assert row_weights[0] == 1.5 and set(row_weights[1:]) == {1.0} and len(row_weights) == 256
    assert tok.encode_weighted([("a cat", 0.5)], max_length=6) == ([3, 9, 1712, 1, 0, 0], [0.5] * 3 + [1.0] * 3, 0)
    with pytest.raises(TypeError, match="fragments"):
        tok.encode_weighted([("a", "heavy")])


def test_tokenizer_folders(tok, tmp_path):
    folder = tmp_path / "tokenizer_3"
    folder.mkdir()
    shutil.copyfile(str(TOKENIZER_JSON), folder / "tokenizer.json")
    assert tokenizer_kind(folder) == "t5"
    loaded = load_tokenizer(folder)
    assert isinstance(loaded, T5Tokenizer) and loaded.max_length == SD3_T5_MAX_LENGTH
    assert load_tokenizer(folder, max_length=512).max_length == 512
    assert all(loaded.encode(p) == tok.encode(p) for p in PROMPTS)
    only_spm = tmp_path / "spm"
    only_spm.mkdir()
    (only_spm / "spiece.model").write_bytes(b"\0")
    assert tokenizer_kind(only_spm) == "t5"
    with pytest.raises(FileNotFoundError, match="spiece.model but no tokenizer.json"):
        load_tokenizer(only_spm)
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.save(str(tmp_path / "bpe.json"))
    with pytest.raises(ValueError, match="Unigram.*this one is BPE"):
        T5Tokenizer.from_file(tmp_path / "bpe.json")


# ------------------------------------------------------------------------------------------- encoder


def _hf_config(**changes) -> transformers.T5Config:
    cfg = dict(TINY, relative_attention_num_buckets=32, relative_attention_max_distance=128,
               feed_forward_proj="gated-gelu", dropout_rate=0.0, layer_norm_epsilon=1e-6)
    return transformers.T5Config(**{**cfg, **changes})


def _reference(seed: int, **changes) -> transformers.T5EncoderModel:
    torch.manual_seed(seed)
    model = transformers.T5EncoderModel(_hf_config(**changes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.float8_e4m3fn).float())
    return model


def _ours(**changes) -> T5Config:
    proj = changes.get("feed_forward_proj", "gated-gelu")
    return T5Config(**TINY, feed_forward_proj=proj)


@pytest.fixture(scope="module")
def ref_model():
    return _reference(0)


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, TINY["vocab_size"], (2, 200), generator=g)   # past the 128 of the farthest bucket


@pytest.fixture(scope="module")
def ref_out(ref_model, ids):
    with torch.no_grad():
        return ref_model(ids).last_hidden_state


@pytest.fixture(scope="module")
def folder(ref_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("t5") / "text_encoder_3"
    ref_model.save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def test_float32_bit_exact(ref_model, ids, ref_out):
    model = load_t5(ref_model.state_dict())
    assert model.config == _ours()
    with torch.no_grad():
        assert torch.equal(model(ids), ref_out)
        mask = torch.ones_like(ids)
        mask[1, 120:] = 0
        assert torch.equal(model(ids, attention_mask=mask), ref_model(ids, attention_mask=mask).last_hidden_state)
        with pytest.raises(ValueError, match="token id 1000 is outside its vocabulary of 1000"):
            model(torch.tensor([[1, 1000]]))


def test_relu_feed_forward_bit_exact(ids):
    ref = _reference(2, feed_forward_proj="relu")
    model = load_t5(ref.state_dict())
    assert model.config == _ours(feed_forward_proj="relu")
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids).last_hidden_state)


def test_position_buckets():
    reference = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    for n_query, n_key, buckets, distance in [(300, 300, 32, 128), (40, 70, 8, 20), (5, 9, 4, 3)]:
        relative = torch.arange(n_key)[None, :] - torch.arange(n_query)[:, None]
        want = reference(relative, bidirectional=True, num_buckets=buckets, max_distance=distance)
        assert torch.equal(relative_position_buckets(n_query, n_key, buckets, distance), want)
    b = relative_position_buckets(1, 300, 32, 128)[0]   # keys after the query: the upper half, the far ones shared
    assert b[:8].tolist() == [0, *range(17, 24)] and b[128:].eq(31).all()


def test_bfloat16_bit_exact(folder, ids):
    ref = transformers.T5EncoderModel.from_pretrained(folder, dtype=torch.bfloat16).eval()
    model = load_t5(open_sharded(folder / "model.safetensors.index.json"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        out = model(ids)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref(ids).last_hidden_state)


def test_float16_as_transformers(folder, ids):
    ref = transformers.T5EncoderModel.from_pretrained(folder, dtype=torch.float16).eval()
    assert ref.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32   # its fp16 rule
    model = load_t5(open_sharded(folder / "model.safetensors.index.json"), dtype=torch.float16)
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert kept == {f"encoder.block.{i}.layer.1.DenseReluDense.wo.weight" for i in range(TINY["num_layers"])}
    with torch.no_grad():
        out = model(ids)
        assert out.dtype == torch.float16 and torch.equal(out, ref(ids).last_hidden_state)
        # values past fp16's range: the first block's attention output overflows and is clamped, as transformers does
        for m in (ref, model):
            m.shared.weight.fill_(65504.0)
            m.encoder.block[0].layer[0].SelfAttention.o.weight.mul_(64.0)
        x = model.shared(ids)
        bias = model.encoder.block[0].layer[0].SelfAttention.position_bias(ids.shape[1])
        assert torch.isinf(model.encoder.block[0].layer[0](x, bias)).any()
        out = model(ids)
        assert torch.isfinite(out).all() and torch.equal(out, ref(ids).last_hidden_state)


def test_cast_and_dtype(ref_model):
    model = load_t5(ref_model.state_dict())
    assert model.dtype == torch.float32
    model.cast(torch.float16)
    assert model.dtype == torch.float16
    assert model.encoder.block[1].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    model.cast(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_xxl_keys_and_shapes_on_meta():
    hf = transformers.T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                               relative_attention_num_buckets=32, relative_attention_max_distance=128,
                               layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu")
    with torch.device("meta"):
        ref = transformers.T5EncoderModel(hf)
        ours = T5Encoder(T5_XXL)
    tied = set(transformers.T5EncoderModel._tied_weights_keys)   # encoder.embed_tokens.weight: shared.weight itself
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items() if k not in tied}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want and len(got) == 2 + 24 * 9 + 1
    assert T5Config.from_transformers(hf.to_dict()) == T5_XXL
    assert infer_t5_config(got) == T5_XXL
    assert sum(v.numel() for v in ours.state_dict().values()) == 4_762_310_656


def test_config_checks():
    assert T5Config.from_transformers(T5_XXL.to_transformers()) == T5_XXL
    with pytest.raises(ConfigError, match="feed_forward_proj='gated-silu'"):
        T5Config(feed_forward_proj="gated-silu")
    with pytest.raises(ConfigError, match="model_type='umt5'"):
        T5Config.from_transformers({"model_type": "umt5"})
    with pytest.raises(ConfigError, match="dense_act_fn='gelu'"):
        T5Config.from_transformers({"feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu"})
    with pytest.raises(ConfigError, match="num_heads=0"):
        T5Config(num_heads=0)


# ------------------------------------------------------------------------------------------- key tables


def _canonical(ref_model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ref_model.state_dict().items()}


@pytest.fixture(scope="module")
def layouts(ref_model, folder, tmp_path_factory):
    """{layout: (path, prefix)}: the tiny model in each file layout."""
    root = tmp_path_factory.mktemp("layouts")
    state = _canonical(ref_model)   # holds encoder.embed_tokens.weight too, as some folders do
    out = {"folder": (folder / "model.safetensors.index.json", "")}
    single = folder.parent / "single_folder"
    ref_model.save_pretrained(single)
    out["folder-one-file"] = (single / "model.safetensors", "")
    save_file({k: v.half() for k, v in state.items()}, root / "t5xxl_fp16.safetensors")
    out["comfy-fp16"] = (root / "t5xxl_fp16.safetensors", "")
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in state.items() if k != "encoder.embed_tokens.weight"},
              root / "t5xxl_fp8_e4m3fn.safetensors")
    out["comfy-fp8"] = (root / "t5xxl_fp8_e4m3fn.safetensors", "")
    scaled = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for k, v in state.items():
        if k.endswith(("q.weight", "k.weight", "v.weight", "o.weight", "wi_0.weight", "wi_1.weight", "wo.weight")):
            scaled[k] = (v / SCALE).to(torch.float8_e4m3fn)
            scaled[k.replace(".weight", ".scale_weight")] = torch.tensor(SCALE)
            scaled[k.replace(".weight", ".scale_input")] = torch.tensor(1.0)
        elif k != "encoder.embed_tokens.weight":
            scaled[k] = v.half()
    save_file(scaled, root / "t5xxl_fp8_e4m3fn_scaled.safetensors")
    out["comfy-scaled-fp8"] = (root / "t5xxl_fp8_e4m3fn_scaled.safetensors", "")
    sd3 = {SINGLE_FILE_PREFIX + k: v.half() for k, v in state.items() if k != "encoder.embed_tokens.weight"}
    sd3["model.diffusion_model.x_embedder.proj.weight"] = torch.zeros(4, 16, 2, 2)
    sd3["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"] = torch.ones(8)
    save_file(sd3, root / "sd3.5_medium.safetensors")
    out["sd3-single-file"] = (root / "sd3.5_medium.safetensors", SINGLE_FILE_PREFIX)
    return out


def _open(path):
    return open_sharded(path) if path.name.endswith(".index.json") else open_checkpoint(path)


@pytest.mark.parametrize("layout", ["folder", "folder-one-file", "comfy-fp16", "comfy-fp8", "comfy-scaled-fp8",
                                    "sd3-single-file"])
def test_layouts_load_to_the_same_outputs(layouts, layout, ref_model, ids, ref_out):
    path, prefix = layouts[layout]
    with _open(path) as store:
        assert find_t5_prefix(store.keys()) == prefix
        view = t5_state_from(store, prefix)
        assert set(view) == set(_canonical(ref_model)) - {"encoder.embed_tokens.weight"}
        model = load_t5(store, prefix)
    with torch.no_grad():
        assert torch.equal(model(ids), ref_out)


def test_plans_name_what_they_skip(layouts):
    with _open(layouts["comfy-fp16"][0]) as store:
        assert t5_plan(store.keys()).ignored == ["encoder.embed_tokens.weight"]
    with _open(layouts["comfy-scaled-fp8"][0]) as store:
        plan = t5_plan(store.keys())
        assert "scaled_fp8" in plan.ignored and "encoder.block.0.layer.0.SelfAttention.q.scale_input" in plan.ignored
        assert plan.entries["encoder.block.0.layer.0.SelfAttention.q.weight"].sources == (
            "encoder.block.0.layer.0.SelfAttention.q.weight", "encoder.block.0.layer.0.SelfAttention.q.scale_weight")
        assert t5_state_from(store)["encoder.block.0.layer.1.DenseReluDense.wo.weight"].dtype == torch.float32
    with _open(layouts["comfy-fp8"][0]) as store:   # plain fp8 comes as stored; load_t5 converts it
        assert t5_state_from(store)["shared.weight"].dtype == torch.float8_e4m3fn
    with _open(layouts["sd3-single-file"][0]) as store:
        plan = t5_plan(store.keys(), prefix=SINGLE_FILE_PREFIX)
        assert not plan.unexpected and not plan.ignored and len(plan.entries) == 2 + 3 * 9 + 1
    # only an embed_tokens copy: it is shared.weight
    only_copy = {("encoder.embed_tokens.weight" if k == "shared.weight" else k): k for k in
                 ["shared.weight", "encoder.final_layer_norm.weight"]}
    assert t5_plan(only_copy).entries["shared.weight"].sources == ("encoder.embed_tokens.weight",)


def test_dequantize():
    w = torch.randn(64, 32).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.3)
    assert torch.equal(dequantize(w, torch.bfloat16, scale), (w.float() * 0.3).to(torch.bfloat16))
    assert torch.equal(dequantize(w, torch.float16).float(), w.float())
    assert torch.equal(dequantize(w, torch.bfloat16).float(), w.float())   # fp8 -> bf16 is exact
    w5 = torch.randn(8).to(torch.float8_e5m2)
    assert torch.equal(dequantize(w5, torch.float16).float(), w5.float())
    with pytest.raises(ConversionError, match=r"one value, this one has shape \[2\]"):
        dequantize(w, torch.float32, torch.ones(2))


def test_bad_weights_name_the_key(ref_model):
    state = {k: v for k, v in _canonical(ref_model).items() if k != "encoder.embed_tokens.weight"}
    key = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
    with pytest.raises(ConversionError, match=f"tensor '{key}': missing"):
        t5_state_from({k: v for k, v in state.items() if k != key})
    prefixed = {SINGLE_FILE_PREFIX + k: v for k, v in state.items() if k != key}
    with pytest.raises(ConversionError, match=f"'{SINGLE_FILE_PREFIX}{key}': missing"):
        load_t5(prefixed, SINGLE_FILE_PREFIX)
    key = "encoder.block.2.layer.0.SelfAttention.k.weight"
    with pytest.raises(ConversionError, match=rf"'{key}': shape \[24, 31\], .* needs \[24, 32\]"):
        t5_state_from({**state, key: torch.zeros(24, 31)})
    extra = "encoder.block.0.layer.0.SelfAttention.q.bias"
    with pytest.raises(ConversionError, match=f"'{extra}': 1 key"):
        t5_state_from({**state, extra: torch.zeros(24)})
    beyond = "encoder.block.3.layer.0.layer_norm.weight"   # a fourth block for a three-block config
    with pytest.raises(ConversionError, match=f"'{beyond}'"):
        t5_state_from({**state, beyond: torch.ones(32)}, config=_ours())
    scale = "encoder.block.0.layer.0.SelfAttention.q.scale_weight"
    with pytest.raises(ConversionError, match=r"'encoder.block.0.layer.0.SelfAttention.q.weight': its scale has "
                                              r"shape \[2\]"):
        t5_state_from({**state, scale: torch.ones(2)})
    with pytest.raises(UnsupportedModelError, match="'shared.weight' is missing"):
        t5_state_from({k: v for k, v in state.items() if k != "shared.weight"})


def test_infer_config(ref_model):
    shapes = {k: tuple(v.shape) for k, v in ref_model.state_dict().items()}
    assert infer_t5_config(shapes) == _ours()
    relu = _reference(3, feed_forward_proj="relu")
    assert infer_t5_config(relu.state_dict()) == _ours(feed_forward_proj="relu")
