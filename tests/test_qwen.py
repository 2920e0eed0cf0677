"""The Qwen tokenizer and the Qwen3 / Qwen2.5 decoder as a text encoder, against transformers 5 and diffusers (the
independent references).

* Tokenizer: ids equal ``transformers.Qwen2TokenizerFast(tokenizer_file=...)`` on English, long (> 512 tokens),
  Unicode, emoji, CJK, whitespace, empty prompts and special tokens written in the text; the README's known ids;
  rows and masks equal diffusers' ``tokenizer(..., padding="max_length", truncation=True)``; the chat template equals
  transformers' ``apply_chat_template`` over Qwen3's template and the strings the pipelines use.
* The pipelines' own code: diffusers' ``ZImagePipeline._encode_prompt`` and ``Flux2KleinPipeline.
  _get_qwen3_prompt_embeds`` run on a tiny random ``Qwen3Model`` give bit-identical embeddings to ours (template, rows,
  mask, hidden-state selection and the network together).
* Decoder: tiny ``Qwen3Model``, ``Qwen2Model`` and ``Qwen2_5_VLTextModel`` (multimodal RoPE) with random weights,
  loaded key for key: every hidden state of ``output_hidden_states=True`` equal to the bit in float32, batch 2, with a
  right-padded row, a left-padded row and none; bfloat16 equal to transformers' own bf16 load. The released sizes
  (Qwen3-4B, Qwen3-8B, Qwen2.5-VL-7B's language model) on the meta device have transformers' keys and shapes.
* Key tables: a transformers folder, ComfyUI-style files (prefixed, scaled fp8), Qwen2.5-VL's layout and llama.cpp
  GGUF files (qwen3 and qwen2, F32 / F16 / Q8_0 tensors, metadata config) load to the reference's outputs; errors
  name the file and key.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ast  # noqa: E402
import importlib.util  # noqa: E402
import shutil  # noqa: E402
import types  # noqa: E402
from importlib import resources  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

gguf = pytest.importorskip("gguf")

from sdlite.config import ConfigError  # noqa: E402
from sdlite.config.qwen import QWEN2_5_VL_7B, QWEN3_4B, QWEN3_8B, QwenConfig  # noqa: E402
from sdlite.errors import CheckpointError  # noqa: E402
from sdlite.models.qwen import QwenTextEncoder  # noqa: E402
from sdlite.tokenizers.qwen import QwenTokenizer, is_qwen_tokenizer_json  # noqa: E402
from sdlite.weights import open_checkpoint, open_sharded  # noqa: E402
from sdlite.weights.gguf import open_gguf  # noqa: E402
from sdlite.weights.plan import ConversionError, UnsupportedModelError  # noqa: E402
from sdlite.weights.qwen_keys import (  # noqa: E402
    find_qwen_prefix, infer_qwen_config, llama_cpp_name, load_qwen, qwen_config_from_gguf, qwen_plan,
    qwen_preset_name, qwen_shapes, qwen_state_from,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKENIZER_JSON = resources.files("sdlite").joinpath("data", "qwen", "tokenizer.json")
LONG = ("a highly detailed photograph of an astronaut riding a horse on mars, dramatic lighting, volumetric "
        "clouds, 8k, trending on artstation, by greg rutkowski and alphonse mucha, " * 20)
PROMPTS = [
    "a photo of an astronaut riding a horse on mars",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tnew\nlines\r\nand  double  spaces\n\n\n",
    "café naïve Ærøskøbing Straße façade, e\u0301 decomposed",
    "ﬁ ligature, ｆｕｌｌｗｉｄｔｈ, ①②, ℃, Ω ≠ Ω",
    "一只猫在月球上 日本語のテキスト 한국어 繁體中文，標點符號。",
    "emoji 🐱🚀👩‍🚀 and flags 🇫🇷 and skin tones 👍🏽",
    "digits 0123456789 3.14159 1,000,000 2024-05-01 x=42",
    "punctuation!!! ?? ... (a:1.2) [b] {c} <d> \"e\" 'f' #g @h $i %j ^k &l *m _n +o =p |q \\r /s ~t `u",
    "contractions: it's they're we've I'm you'll he'd DON'T",
    "special tokens written out: <|im_start|>user\nhi<|im_end|> <|endoftext|> <think>x</think> <|vision_pad|>",
    "half a special token: <|im_start and <|im_end| and <think",
    LONG,
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
            "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
            "</tool_response>", "<think>", "</think>"]

# Qwen3's chat template (the "chat_template" of Qwen/Qwen3-4B's tokenizer_config.json, which Z-Image's and FLUX.2
# klein's tokenizer/ folders carry), the branches a conversation of a system and a user message reaches, verbatim:
# the tool-calling preamble and the assistant / tool turns are left out (a prompt never reaches them).
QWEN3_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)

# a tiny Qwen3 (heads 24 wide: q is 96 wide on a hidden size of 64, as Qwen3-4B's q is wider than its hidden size)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, max_position_embeddings=512)
TINY2 = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512)


# ------------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok():
    return QwenTokenizer.from_package()


@pytest.fixture(scope="module")
def ref_tok():
    ref = transformers.Qwen2TokenizerFast(tokenizer_file=str(TOKENIZER_JSON))
    ref.chat_template = QWEN3_CHAT_TEMPLATE
    return ref


def test_ids_equal_transformers(tok, ref_tok):
    for prompt in PROMPTS:
        assert tok.encode(prompt) == ref_tok(prompt).input_ids, prompt
    assert len(tok.encode(LONG)) > 512 + 100   # well past the pipelines' 512
    assert tok.vocab_size == len(ref_tok) == 151669


def test_known_ids(tok):
    # the shipped tokenizer's README
    assert tok.encode("Hello, world") == [9707, 11, 1879]
    assert tok.encode("a photo of an astronaut riding a horse on mars") == \
        [64, 6548, 315, 458, 46633, 19837, 264, 15223, 389, 47349]
    assert tok.encode("一只猫") == [102292, 100472]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    assert [tok.token_to_id(t) for t in SPECIALS] == list(range(151643, 151669))
    assert tok.encode("".join(SPECIALS)) == list(range(151643, 151669))
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.im_start_id, tok.im_end_id) == \
        (None, 151643, 151643, 151644, 151645)
    assert tok.encode("") == []
    assert tok.decode(tok.encode(PROMPTS[0])) == PROMPTS[0]
    assert tok.decode([151644, 872, 198, 6023, 151645], skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    with pytest.raises(ValueError, match="id 151669 is not in the Qwen vocabulary"):
        tok.decode([151669])


@pytest.mark.parametrize("length", [512, 16])
def test_rows_equal_diffusers(tok, ref_tok, length):
    # diffusers' Z-Image and FLUX.2 klein: tokenizer(texts, padding="max_length", max_length=..., truncation=True)
    ref = ref_tok(PROMPTS, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    ids, mask = tok.rows(PROMPTS, length)
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape == (len(PROMPTS), length)
    assert torch.equal(ids, ref.input_ids) and torch.equal(mask, ref.attention_mask)
    short = QwenTokenizer.from_package(max_length=length)
    assert torch.equal(short(PROMPTS), ref.input_ids) and torch.equal(short(PROMPTS[0]), ref.input_ids[:1])
    for i, prompt in enumerate(PROMPTS):
        assert short.pad(short.encode(prompt)) == (ref.input_ids[i].tolist(), ref.attention_mask[i].tolist())


def test_pad_and_truncation_report(tok):
    assert tok.pad([5, 6, 7], 2) == ([5, 6], [1, 1])
    assert tok.pad([5], 3) == ([5, 151643, 151643], [1, 0, 0])
    assert tok.pad([], 2) == ([151643, 151643], [0, 0])
    with pytest.raises(ValueError, match="max_length must be an integer >= 1, got 0"):
        tok.pad([1], 0)
    with pytest.raises(TypeError, match="a string or a list of strings"):
        tok.rows([1, 2])
    info = tok.tokenize_with_info(LONG)
    ids = tok.encode(LONG)
    assert info.input_ids == ids[:512] and info.num_tokens == len(ids) and info.num_kept == 512 and info.truncated
    assert LONG.endswith(info.dropped_text) and info.dropped_text and not info.dropped_text[0].isspace()
    assert tok.encode(LONG[:len(LONG) - len(info.dropped_text)])[:512] == ids[:512]
    short = tok.tokenize_with_info("a cat")
    assert (short.num_tokens, short.num_kept, short.dropped_text, short.truncated) == (2, 2, "", False)
    assert short.input_ids == [64, 8251] + [151643] * 510


def test_chat_template(tok, ref_tok):
    for prompt in ["a cat", "", "一只猫 🐱", "two\nlines  ", "<|im_end|> inside"]:
        messages = [{"role": "user", "content": prompt}]
        for thinking in (True, False):
            # the call of diffusers' Z-Image (enable_thinking=True) and FLUX.2 klein (False) pipelines
            want = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               enable_thinking=thinking)
            assert tok.chat_prompt(prompt, enable_thinking=thinking) == want
        system = [{"role": "system", "content": "Be brief."}, *messages]
        assert tok.chat_prompt(prompt, system="Be brief.") == ref_tok.apply_chat_template(
            system, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    # the strings themselves (ComfyUI's Z-Image template is the first; klein's adds the empty think block)
    assert tok.chat_prompt("a cat") == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_prompt("a cat", enable_thinking=False) == \
        "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids, mask = tok.chat_rows(["a cat", "a dog"], enable_thinking=False, max_length=20)
    row = tok.encode(tok.chat_prompt("a cat", enable_thinking=False))
    assert ids[0].tolist() == row + [151643] * (20 - len(row)) and mask.sum(1).tolist() == [len(row)] * 2
    # Qwen-Image's fixed template (diffusers' QwenImagePipeline) is a system turn in the same format; it drops the
    # first 34 tokens, the system turn and "<|im_start|>user\n"
    source = Path(importlib.util.find_spec("diffusers").origin).parent / "pipelines/qwenimage/pipeline_qwenimage.py"
    found = {node.targets[0].attr: ast.literal_eval(node.value) for node in ast.walk(ast.parse(source.read_text()))
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
             and node.targets[0].attr.startswith("prompt_template_encode")}
    template, drop = found["prompt_template_encode"], found["prompt_template_encode_start_idx"]
    system = template.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
    assert template.format("a cat") == tok.chat_prompt("a cat", system=system)
    assert len(tok.encode(template.split("{}")[0])) == drop == 34


def test_tokenizer_files_and_errors(tok, tmp_path):
    folder = tmp_path / "Z-Image-Turbo" / "tokenizer"
    folder.mkdir(parents=True)
    shutil.copyfile(str(TOKENIZER_JSON), folder / "tokenizer.json")
    assert is_qwen_tokenizer_json(folder / "tokenizer.json")
    for path in (folder, folder.parent):   # the tokenizer folder, or the model folder holding it
        loaded = QwenTokenizer.from_pretrained_dir(path)
        assert loaded.max_length == 512 and all(loaded.encode(p) == tok.encode(p) for p in PROMPTS[:6])
    assert QwenTokenizer.from_pretrained_dir(folder, max_length=64).max_length == 64
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match=f"Qwen tokenizer file not found: '{missing}'"):
        QwenTokenizer.from_file(missing)
    with pytest.raises(FileNotFoundError, match="no Qwen tokenizer.json in"):
        QwenTokenizer.from_pretrained_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="Qwen tokenizer folder not found"):
        QwenTokenizer.from_pretrained_dir(tmp_path / "nowhere")
    only_vocab = tmp_path / "vocab_only"
    only_vocab.mkdir()
    (only_vocab / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="has vocab.json but no tokenizer.json"):
        QwenTokenizer.from_pretrained_dir(only_vocab)
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=f"'{bad}' is not a tokenizers JSON file"):
        QwenTokenizer.from_file(bad)
    plain = tmp_path / "plain_bpe.json"
    tokenizers.Tokenizer(tokenizers.models.BPE()).save(str(plain))
    with pytest.raises(ValueError, match=rf"{plain}: not a Qwen tokenizer, its vocabulary lacks the token\(s\) "
                                         r"'<\|endoftext\|>', '<\|im_start\|>', '<\|im_end\|>'"):
        QwenTokenizer.from_file(plain)
    assert not is_qwen_tokenizer_json(plain) and not is_qwen_tokenizer_json(missing)
    unigram = tmp_path / "unigram.json"
    tokenizers.Tokenizer(tokenizers.models.Unigram()).save(str(unigram))
    with pytest.raises(ValueError, match="model is BPE, this one is Unigram"):
        QwenTokenizer.from_file(unigram)


# ------------------------------------------------------------------------------------------- the pipelines' code


@pytest.fixture(scope="module")
def pipeline_encoder():
    """A tiny random Qwen3Model with the real vocabulary (the chat tokens' ids are past 151643), and ours from it."""
    torch.manual_seed(5)
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=1e6)
    ref = transformers.Qwen3Model(cfg).eval()
    _randomize_norms(ref)
    return ref, load_qwen(ref.state_dict())


def test_z_image_encoding_equals_diffusers(tok, ref_tok, pipeline_encoder):
    from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline

    ref_model, model = pipeline_encoder
    prompts = ["a cat on the moon", "一只猫 🐱", ""]
    with torch.no_grad():
        # the pipeline's own method: chat template, 512-token rows, the mask, hidden_states[-2] at the real tokens
        want = ZImagePipeline._encode_prompt(types.SimpleNamespace(tokenizer=ref_tok, text_encoder=ref_model),
                                             list(prompts), device="cpu")
        ids, mask = tok.chat_rows(prompts)
        states = model(ids, mask, hidden_states=-2)
    assert ids.shape == (3, 512)
    got = [states[i][mask[i].bool()] for i in range(len(prompts))]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_klein_encoding_equals_diffusers(tok, ref_tok, pipeline_encoder):
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    ref_model, model = pipeline_encoder
    prompts = ["a red fox in the snow", "a cat"]
    layers = (1, 2, 3)   # klein reads (9, 18, 27) of 36; the tiny model has 3
    with torch.no_grad():
        want = Flux2KleinPipeline._get_qwen3_prompt_embeds(ref_model, ref_tok, prompts, max_sequence_length=64,
                                                           hidden_states_layers=layers)
        ids, mask = tok.chat_rows(prompts, enable_thinking=False, max_length=64)
        states = torch.stack(model(ids, mask, hidden_states=list(layers)), dim=1)   # (B, 3, N, D)
    got = states.permute(0, 2, 1, 3).reshape(2, 64, 3 * 32)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------- the decoder


def _randomize_norms(model, seed: int = 0) -> None:
    """Norm weights and biases away from their initial ones and zeros, so that a misplaced one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _qwen3_reference(seed: int = 0) -> transformers.Qwen3Model:
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(transformers.Qwen3Config(**TINY, rope_theta=1e6)).eval()
    _randomize_norms(model, seed)
    return model


@pytest.fixture(scope="module")
def ref3():
    return _qwen3_reference()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))


def _masks(ids):
    right = torch.ones_like(ids)
    right[1, 25:] = 0   # the pipelines' right padding
    left = torch.ones_like(ids)
    left[1, :9] = 0
    return {"none": None, "right": right, "left": left, "all-ones": torch.ones_like(ids)}


def _assert_all_states_equal(ref, model, ids, layers: int) -> None:
    for name, mask in _masks(ids).items():
        want = ref(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = model(ids, mask, hidden_states=list(range(layers + 1)))
        assert len(want) == len(got) == layers + 1
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"mask {name}, hidden state {i}: max difference {(a - b).abs().max()}"


def test_qwen3_bit_exact(ref3, ids):
    model = load_qwen(ref3.state_dict(), config=QwenConfig(**TINY))
    assert model.layers[0].self_attn.q_proj.weight.shape == (96, 64) and model.layers[0].self_attn.q_proj.bias is None
    with torch.no_grad():
        _assert_all_states_equal(ref3, model, ids, 4)
        mask = _masks(ids)["right"]
        want = ref3(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        assert torch.equal(model(ids, mask), want[-1]) and torch.equal(model(ids, mask), ref3(ids, mask)[0])
        assert [torch.equal(a, b) for a, b in zip(model(ids, mask, hidden_states=[-2, 1, -5, 4]),
                                                  [want[3], want[1], want[0], want[4]])] == [True] * 4
        with pytest.raises(ValueError, match="hidden state 5 does not exist; with 4 layers there are 5"):
            model(ids, hidden_states=5)
        with pytest.raises(ValueError, match="token id 320 is outside its vocabulary of 320"):
            model(torch.tensor([[1, 320]]))
        with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 3\) does not match the ids' \(2, 40\)"):
            model(ids, torch.ones(2, 3))


def test_layers_past_the_deepest_do_not_run(ref3, ids):
    model = load_qwen(ref3.state_dict(), config=QwenConfig(**TINY))
    ran = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda module, args, out, i=i: ran.append(i))
    norm_ran = []
    model.norm.register_forward_hook(lambda *_: norm_ran.append(True))
    with torch.no_grad():
        model(ids, hidden_states=[2, 1])
        assert ran == [0, 1] and not norm_ran
        ran.clear()
        model(ids, hidden_states=-2)   # Z-Image's: layer 3's output, the fourth layer and the norm not run
        assert ran == [0, 1, 2] and not norm_ran
        ran.clear()
        model(ids, hidden_states=0)
        assert ran == [] and not norm_ran


def test_bfloat16_bit_exact(ref3, ids, tmp_path):
    ref3.save_pretrained(tmp_path)
    ref = transformers.Qwen3Model.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    model = load_qwen(open_checkpoint(tmp_path / "model.safetensors"), config=QwenConfig(**TINY),
                      dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.dtype == torch.bfloat16
    with torch.no_grad():
        _assert_all_states_equal(ref, model, ids, 4)


@pytest.mark.parametrize("kind", ["qwen2", "qwen2.5-vl-text"])
def test_qwen2_layers_bit_exact(kind, ids):
    torch.manual_seed(3)
    if kind == "qwen2":
        ref = transformers.Qwen2Model(transformers.Qwen2Config(**TINY2, rope_theta=1e6))
    else:   # the multimodal RoPE of Qwen2.5-VL's language model, its 8 rotary pairs in sections of 2, 3, 3
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        ref = transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(**TINY2, rope_parameters=rope))
    ref.eval()
    _randomize_norms(ref, 3)
    config = QwenConfig(**TINY2, head_dim=16, qk_norm=False, attention_bias=True, tie_word_embeddings=False,
                        mrope_section=None if kind == "qwen2" else (2, 3, 3))
    assert QwenConfig.from_transformers(ref.config.to_dict()) == config
    model = load_qwen(ref.state_dict(), config=config)
    attn = model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None and attn.q_norm is None
    with torch.no_grad():
        _assert_all_states_equal(ref, model, ids, 3)


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-8b", "qwen2.5-vl-7b"])
def test_full_sizes_on_meta(name):
    preset = {"qwen3-4b": QWEN3_4B, "qwen3-8b": QWEN3_8B, "qwen2.5-vl-7b": QWEN2_5_VL_7B}[name]
    with torch.device("meta"):
        if name == "qwen2.5-vl-7b":
            # Qwen/Qwen2.5-VL-7B-Instruct's config.json, its language model's fields
            hf = transformers.Qwen2_5_VLTextConfig(
                vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128000,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
            ref = transformers.Qwen2_5_VLTextModel(hf)
        else:
            hf = transformers.Qwen3Config(**preset.to_transformers())
            ref = transformers.Qwen3Model(hf)
        ours = QwenTextEncoder(preset)
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want and got == qwen_shapes(preset)
    assert QwenConfig.from_transformers(hf.to_dict()) == preset
    assert infer_qwen_config(got) == preset and qwen_preset_name(preset) == name
    params = {"qwen3-4b": 4_022_468_096, "qwen3-8b": 7_568_405_504, "qwen2.5-vl-7b": 7_070_619_136}[name]
    assert sum(v.numel() for v in ours.state_dict().values()) == params   # without the LM head


def test_config_checks():
    assert QwenConfig.from_transformers(QWEN3_4B.to_transformers()) == QWEN3_4B
    assert QwenConfig.from_transformers(QWEN2_5_VL_7B.to_transformers()) == QWEN2_5_VL_7B
    # Qwen-Image's text_encoder/config.json: a Qwen2_5_VLForConditionalGeneration, the language model's fields nested
    vl = {"model_type": "qwen2_5_vl", "vision_config": {"depth": 32}, "rope_scaling": {"type": "mrope",
          "mrope_section": [16, 24, 24]}, "text_config": {
              "model_type": "qwen2_5_vl_text", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 128000, "tie_word_embeddings": False}}
    assert QwenConfig.from_transformers(vl) == QWEN2_5_VL_7B
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        QwenConfig.from_transformers({**QWEN3_4B.to_transformers(), "rope_scaling": {"rope_type": "yarn",
                                                                                      "factor": 4.0}})
    with pytest.raises(ConfigError, match="model_type='llama'"):
        QwenConfig.from_transformers({"model_type": "llama"})
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        QwenConfig.from_transformers({**QWEN3_4B.to_transformers(), "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="use_sliding_window=True"):
        QwenConfig.from_transformers({**QWEN3_4B.to_transformers(), "use_sliding_window": True})
    with pytest.raises(ConfigError, match="num_key_value_heads=5"):
        QwenConfig(num_key_value_heads=5)
    with pytest.raises(ConfigError, match="head_dim=0"):
        QwenConfig(head_dim=0)
    with pytest.raises(ConfigError, match="rope_theta=-1"):
        QwenConfig(rope_theta=-1)
    assert (QWEN3_4B.kind, QWEN2_5_VL_7B.kind, QWEN3_4B.q_width, QWEN3_4B.kv_width, QWEN3_4B.num_key_value_groups) \
        == ("qwen3", "qwen2", 4096, 1024, 4)


# ------------------------------------------------------------------------------------------- key tables


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ref3_out(ref3, ids):
    with torch.no_grad():
        return ref3(ids, attention_mask=_masks(ids)["right"], output_hidden_states=True).hidden_states


def _check_outputs(model, ids, want) -> None:
    with torch.no_grad():
        got = model(ids, _masks(ids)["right"], hidden_states=list(range(len(want))))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_transformers_folder_and_comfy_files(ref3, ids, ref3_out, tmp_path):
    # a Qwen3ForCausalLM folder, sharded (keys under "model.", the LM head tied and not saved)
    lm = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, rope_theta=1e6, tie_word_embeddings=True))
    lm.model.load_state_dict(ref3.state_dict())
    lm.save_pretrained(tmp_path / "text_encoder", max_shard_size="60KB")
    with open_sharded(tmp_path / "text_encoder" / "model.safetensors.index.json") as store:
        assert find_qwen_prefix(store.keys()) == "model."
        _check_outputs(load_qwen(store, config=QwenConfig(**TINY)), ids, ref3_out)
    # ComfyUI's qwen_3_4b.safetensors layout: "model." names, here with an LM head beside and one weight in scaled
    # fp8 (a power-of-two scale: the reference holds the fp8 value times the scale exactly)
    state = {f"model.{k}": v for k, v in _state(ref3).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    key = "model.layers.1.mlp.down_proj.weight"
    fp8 = (state[key] / 0.25).to(torch.float8_e4m3fn)
    state[key] = fp8
    state[key.replace(".weight", ".scale_weight")] = torch.tensor(0.25)
    state[key.replace(".weight", ".scale_input")] = torch.tensor(1.0)
    save_file(state, tmp_path / "qwen_3_4b_fp8_scaled.safetensors")
    exact = _qwen3_reference()
    with torch.no_grad():
        exact.layers[1].mlp.down_proj.weight.copy_(fp8.float() * 0.25)
        want = exact(ids, attention_mask=_masks(ids)["right"], output_hidden_states=True).hidden_states
    with open_checkpoint(tmp_path / "qwen_3_4b_fp8_scaled.safetensors") as store:
        plan = qwen_plan(store.keys(), prefix="model.")
        assert plan.ignored == [key.replace(".weight", ".scale_input")] and not plan.unexpected
        assert plan.entries["layers.1.mlp.down_proj.weight"].sources == (key, key.replace(".weight", ".scale_weight"))
        assert qwen_state_from(store, "model.", config=QwenConfig(**TINY))["layers.1.mlp.down_proj.weight"].dtype == \
            torch.float32
        _check_outputs(load_qwen(store, config=QwenConfig(**TINY)), ids, want)


def test_qwen2_5_vl_layouts(ids, tmp_path):
    torch.manual_seed(4)
    ref = transformers.Qwen2Model(transformers.Qwen2Config(**TINY2, rope_theta=1e6)).eval()
    _randomize_norms(ref, 4)
    with torch.no_grad():
        want = ref(ids, attention_mask=_masks(ids)["right"], output_hidden_states=True).hidden_states
    state = _state(ref)
    vision = {"visual.blocks.0.attn.qkv.weight": torch.zeros(6, 2), "visual.merger.mlp.0.weight": torch.zeros(2, 2)}
    # Qwen-Image's text_encoder as saved before transformers 4.52 ("model.", "visual.") and after
    # ("model.language_model.", "model.visual."), each with the LM head
    for prefix, vis in [("model.", ""), ("model.language_model.", "model.")]:
        layout = {f"{prefix}{k}": v for k, v in state.items()}
        layout.update({vis + k: v for k, v in vision.items()})
        layout["lm_head.weight"] = torch.zeros(320, 64)
        assert find_qwen_prefix(layout) == prefix
        with pytest.raises(UnsupportedModelError, match="not made of 128-wide heads"):
            load_qwen(layout)   # a Qwen2's head size is in no shape: 128 is taken, which this tiny one has not
        model = load_qwen(layout, config=QwenConfig(**TINY2, head_dim=16, qk_norm=False, attention_bias=True))
        _check_outputs(model, ids, want)


def _write_gguf(path, state: dict[str, torch.Tensor], config: QwenConfig, arch: str, *, q8: tuple[str, ...] = (),
                f16: tuple[str, ...] = (), drop: tuple[str, ...] = (), metadata: bool = True):
    """The canonical ``state`` as llama.cpp's converter writes it: its tensor names, unpermuted q and k (the qwen2 and
    qwen3 architectures use the rotate-half RoPE), the config as ``{arch}.*`` metadata."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    if metadata:
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(config.rope_theta)
    for key, value in state.items():
        name = llama_cpp_name(key)
        if name in drop:
            continue
        array = value.float().numpy()
        if name in q8:
            raw = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array.astype(np.float16) if name in f16 else array)
    writer.add_tensor("output.weight", state["embed_tokens.weight"].float().numpy())   # an untied LM head
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_qwen3(ref3, ids, tmp_path):
    config = QwenConfig(**TINY)
    state = _state(ref3)
    norms = tuple(llama_cpp_name(k) for k in state if "norm" in k)
    exact = _qwen3_reference()   # the norms stored as F16: the reference holds their F16 values
    with torch.no_grad():
        for name, p in exact.named_parameters():
            if "norm" in name:
                p.copy_(p.half().float())
        want = exact(ids, attention_mask=_masks(ids)["right"], output_hidden_states=True).hidden_states
    path = _write_gguf(tmp_path / "qwen3-tiny-f32.gguf", state, config, "qwen3", f16=norms)
    with open_gguf(path) as store:
        assert store.architecture == "qwen3" and find_qwen_prefix(store.keys()) == ""
        assert qwen_config_from_gguf(store) == QwenConfig(**{**TINY, "rms_norm_eps": 1e-6}, tie_word_embeddings=False)
        plan = qwen_plan(store.keys())
        assert plan.ignored == ["output.weight"] and not plan.unexpected
        assert plan.entries["layers.2.self_attn.k_norm.weight"].sources == ("blk.2.attn_k_norm.weight",)
        model = load_qwen(store)   # the config from the metadata
        _check_outputs(model, ids, want)
    # block-quantised tensors are dequantised as the gguf package does
    up = tuple(f"blk.{i}.ffn_up.weight" for i in range(4))
    path = _write_gguf(tmp_path / "qwen3-tiny-q8.gguf", state, config, "qwen3", q8=up)
    with open_gguf(path) as store:
        assert store.qtype("blk.1.ffn_up.weight") == "Q8_0"
        model = load_qwen(store)
        raw = gguf.quants.quantize(state["layers.1.mlp.up_proj.weight"].numpy(), gguf.GGMLQuantizationType.Q8_0)
        reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)).reshape(96, 64)
        assert torch.equal(model.layers[1].mlp.up_proj.weight, reference)
        assert torch.equal(model.layers[1].mlp.gate_proj.weight, state["layers.1.mlp.gate_proj.weight"])


def test_gguf_qwen2(ids, tmp_path):
    torch.manual_seed(6)
    ref = transformers.Qwen2Model(transformers.Qwen2Config(**TINY2, rope_theta=1e6)).eval()
    _randomize_norms(ref, 6)
    with torch.no_grad():
        want = ref(ids, attention_mask=_masks(ids)["right"], output_hidden_states=True).hidden_states
    config = QwenConfig(**TINY2, head_dim=16, qk_norm=False, attention_bias=True)
    path = _write_gguf(tmp_path / "qwen2-tiny.gguf", _state(ref), config, "qwen2")
    with open_gguf(path) as store:
        assert "blk.0.attn_q.bias" in store and qwen_config_from_gguf(store) == QwenConfig(
            **TINY2, head_dim=16, qk_norm=False, attention_bias=True, tie_word_embeddings=False)
        _check_outputs(load_qwen(store), ids, want)


def test_missing_and_wrong_keys_are_named(ref3, tmp_path):
    state = _state(ref3)
    config = QwenConfig(**TINY)
    key = "layers.1.mlp.up_proj.weight"
    with pytest.raises(ConversionError, match=f"tensor '{key}': missing from the Qwen weights"):
        qwen_state_from({k: v for k, v in state.items() if k != key}, config=config)
    prefixed = {f"model.{k}": v for k, v in state.items() if k != key}
    save_file(prefixed, tmp_path / "qwen_3_4b.safetensors")
    with open_checkpoint(tmp_path / "qwen_3_4b.safetensors") as store:
        with pytest.raises(ConversionError, match=rf"qwen_3_4b.safetensors: tensor 'model.{key}': missing from the "
                                                  r"Qwen weights under 'model.' \(qwen3, 4 layers\); 1 key"):
            load_qwen(store)
    path = _write_gguf(tmp_path / "broken.gguf", state, config, "qwen3", drop=("blk.1.ffn_up.weight",))
    with open_gguf(path) as store, pytest.raises(ConversionError, match=r"broken.gguf: tensor 'blk.1.ffn_up.weight': "
                                                                        "missing from the Qwen weights"):
        load_qwen(store)
    path = _write_gguf(tmp_path / "no-metadata.gguf", state, config, "qwen3", metadata=False)
    with open_gguf(path) as store, pytest.raises(ConversionError, match=r"no-metadata.gguf: GGUF metadata entry "
                                                                        "'qwen3.embedding_length' is missing"):
        load_qwen(store)
    bad = "layers.2.self_attn.k_proj.weight"
    with pytest.raises(ConversionError, match=rf"tensor '{bad}': shape \[48, 63\], but a qwen3 text encoder .* needs "
                                              r"\[48, 64\]"):
        qwen_state_from({**state, bad: torch.zeros(48, 63)}, config=config)
    extra = "layers.0.self_attn.q_proj.bias"   # a bias on a Qwen3
    with pytest.raises(ConversionError, match=f"tensor '{extra}': 1 key"):
        qwen_state_from({**state, extra: torch.zeros(96)}, config=config)
    with pytest.raises(ConversionError, match="tensor 'layers.0.self_attn.rotary.weight': 1 key"):
        qwen_state_from({**state, "layers.0.self_attn.rotary.weight": torch.zeros(1)}, config=config)
    with pytest.raises(UnsupportedModelError, match="'embed_tokens.weight' is missing"):
        infer_qwen_config({k: v for k, v in state.items() if k != "embed_tokens.weight"})
    with pytest.raises(UnsupportedModelError, match="no Qwen decoder in these weights"):
        load_qwen({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(1)})
    assert isinstance(ConversionError("x"), CheckpointError)


def test_detection_from_shapes(ref3):
    # what no shape says is Qwen3-4B's: RoPE base 1e6, epsilon 1e-6, 40960 positions
    assert infer_qwen_config(_state(ref3)) == QwenConfig(**{**TINY, "max_position_embeddings": 40960},
                                                         tie_word_embeddings=False)
    shapes = qwen_shapes(QWEN2_5_VL_7B)
    assert infer_qwen_config(shapes) == QWEN2_5_VL_7B and infer_qwen_config(qwen_shapes(QWEN3_8B)) == QWEN3_8B
    # a Qwen3-4B file in ComfyUI's names, then in llama.cpp's: the prefix and the preset from names and shapes alone
    assert find_qwen_prefix(f"model.{k}" for k in qwen_shapes(QWEN3_4B)) == "model."
    llama = {llama_cpp_name(k): v for k, v in qwen_shapes(QWEN3_4B).items()}
    assert find_qwen_prefix(llama) == "" and infer_qwen_config(qwen_plan(llama).shapes(llama)) == QWEN3_4B
    assert find_qwen_prefix(["text_model.encoder.layers.0.mlp.fc1.weight"]) is None
    assert llama_cpp_name("layers.3.self_attn.o_proj.weight") == "blk.3.attn_output.weight"
    assert llama_cpp_name("norm.weight") == "output_norm.weight" and llama_cpp_name("lm_head.weight") is None


def test_qwen2_5_vl_model_text_only(ids):
    """The whole Qwen2_5_VLModel (vision tower present, unused) on text-only rows, as Qwen-Image's text prompts reach
    it: it builds its 3-section multimodal positions itself (get_rope_index: for text, three equal ids), so the
    language model's states equal sdlite's plain-RoPE encoder bit for bit on the real tokens, with and without
    right padding (transformers gives the pads other positions; no real token sees a pad)."""
    torch.manual_seed(4)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
              "fullatt_block_indexes": [0], "patch_size": 2, "spatial_merge_size": 1, "temporal_patch_size": 1}
    ref = transformers.Qwen2_5_VLModel(transformers.Qwen2_5_VLConfig(
        text_config={**TINY2, "rope_parameters": rope}, vision_config=vision)).eval()
    _randomize_norms(ref, 4)
    lm = {k[len("language_model."):]: v for k, v in ref.state_dict().items() if k.startswith("language_model.")}
    model = load_qwen(lm, config=QwenConfig(**TINY2, head_dim=16, qk_norm=False, attention_bias=True,
                                            tie_word_embeddings=False))
    right = torch.ones_like(ids)
    right[1, 25:] = 0
    with torch.no_grad():
        for mask in (None, right):
            want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
            got = model(ids, mask)
            keep = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
            assert torch.equal(got[keep], want[keep])


def test_qwen2_5_vl_rows_with_images_bit_exact():
    """Rows with images, as Qwen-Image-Edit's prompts reach the encoder: the vision tower's tokens (transformers' own,
    for this test) spliced in place of each image's <|image_pad|> tokens and the 3-D multimodal positions
    (mrope_positions) give the language model's last state bit for bit, two images of different grids in a row and a
    right-padded second row with one image. The reference is handed the token types (mm_token_type_ids) so that it
    builds its 3-D rope index, as transformers 4 did from the ids."""
    from sdlite.models.qwen import mrope_positions

    torch.manual_seed(5)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
              "fullatt_block_indexes": [0], "patch_size": 2, "spatial_merge_size": 2, "temporal_patch_size": 2}
    image_id = 300
    ref = transformers.Qwen2_5_VLModel(transformers.Qwen2_5_VLConfig(
        text_config={**TINY2, "rope_parameters": rope}, vision_config=vision, image_token_id=image_id,
        video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)).eval()
    _randomize_norms(ref, 5)
    lm = {k[len("language_model."):]: v for k, v in ref.state_dict().items() if k.startswith("language_model.")}
    config = QwenConfig(**TINY2, head_dim=16, qk_norm=False, attention_bias=True, tie_word_embeddings=False,
                        mrope_section=(2, 3, 3))
    model = load_qwen(lm, config=config)
    grids = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])              # patches; tokens: 6, 1 and 6
    tokens = [int(g.prod()) // 4 for g in grids]
    g = torch.Generator().manual_seed(1)
    text = lambda n: torch.randint(0, 290, (n,), generator=g).tolist()   # noqa: E731
    row0 = text(3) + [302] + [image_id] * tokens[0] + [303] + text(2) + [302] + [image_id] * tokens[1] + [303] \
        + text(4)
    row1 = text(5) + [302] + [image_id] * tokens[2] + [303] + text(1)
    n = len(row0)
    ids = torch.tensor([row0, row1 + [0] * (n - len(row1))])
    mask = torch.tensor([[1] * n, [1] * len(row1) + [0] * (n - len(row1))])
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 2 * 2, generator=g)
    with torch.no_grad():
        features = torch.cat(ref.get_image_features(pixels, grids).pooler_output)
        want = ref(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
                   mm_token_type_ids=(ids == image_id).int()).last_hidden_state
        positions = mrope_positions(ids, mask, grids.tolist(), image_id, merge=2)
        got = model(ids, mask, image_features=features, image_token_id=image_id, positions=positions)
        plain = model(ids, mask, image_features=features, image_token_id=image_id)
    keep = mask.bool()
    assert torch.equal(got[keep], want[keep])
    assert not torch.equal(plain[keep], want[keep])   # the 3-D positions matter
    assert positions[:, 0, 4:10].tolist() == [[4] * 6, [4, 4, 4, 5, 5, 5], [4, 5, 6, 4, 5, 6]]
    assert positions[:, 0, 10].tolist() == [7, 7, 7]   # the text after an image of 2 x 3 tokens resumes at 4 + 3
    with pytest.raises(ValueError, match="image features of shape"):
        model(ids, mask, image_features=features[1:], image_token_id=image_id, positions=positions)
    with pytest.raises(ValueError, match="more runs of image tokens"):
        mrope_positions(ids, mask, grids[:2].tolist(), image_id, merge=2)
