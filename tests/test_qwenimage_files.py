"""Qwen-Image in the files ComfyUI and GGUF users have, opened without a diffusers folder:

* the transformer ``qwen_image_bf16.safetensors`` (diffusers' names, bare or under ``model.diffusion_model.``), its
  fp8 form (float8_e4m3fn as stored, and ComfyUI's scaled fp8 with per-tensor ``weight_scale``) and a city96-style
  GGUF (``qwen-image-Q8_0.gguf``: the blocks' matrices Q8_0, the rest F32);
* the text encoder ``qwen_2.5_vl_7b.safetensors`` (the language model under ``model.``, a vision tower under
  ``visual.`` and the LM head beside it) or llama.cpp's GGUF of Qwen2.5-VL (``qwen2vl``, ``blk.N`` names);
* the VAE ``qwen_image_vae.safetensors`` in Wan 2.1's names, or in diffusers';
* found in ComfyUI's ``models/`` folders or given (``text_encoders=``), and the errors, each naming its file.

Every tensor opened must equal the value its file holds. The weights are tiny and random, written by sdlite's own
networks: 128-wide heads (the release's; the rotary split leaves no trace in the shapes), a 128-wide Qwen2 (Qwen2's
head size is in no shape either), an MLP of 256 (whole Q4_K super-blocks are not needed here: Q8_0 throughout)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdlite.config.qwen import QwenConfig
from sdlite.config.qwen_vision import QwenVisionConfig
from sdlite.config.qwenimage import QwenImageConfig
from sdlite.config.qwenimage_vae import QwenImageVAEConfig
from sdlite.errors import CheckpointError
from sdlite.loader import open_model
from sdlite.models.qwen import QwenTextEncoder
from sdlite.models.qwen_vision import QwenVisionTower
from sdlite.models.qwenimage import QwenImage
from sdlite.models.qwenimage_vae import QwenImageVAE
from sdlite.weights.qwen_keys import llama_cpp_name
from sdlite.weights.qwenimage_vae_keys import wan_names

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRANSFORMER = QwenImageConfig(num_layers=1, attention_head_dim=128, num_attention_heads=1, joint_attention_dim=128)
VAE = QwenImageVAEConfig(base_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1)
TEXT = QwenConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=1,
                  num_key_value_heads=1, head_dim=128, qk_norm=False, attention_bias=True,
                  max_position_embeddings=128, tie_word_embeddings=False)
BF16, TEXT_FILE, VAE_FILE = "qwen_image_bf16.safetensors", "qwen_2.5_vl_7b.safetensors", "qwen_image_vae.safetensors"


def _state(module: torch.nn.Module, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) * 0.1).contiguous() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def states():
    return SimpleNamespace(transformer=_state(QwenImage(TRANSFORMER), 1), vae=_state(QwenImageVAE(VAE), 2),
                           text=_state(QwenTextEncoder(TEXT), 3))


def _wan(vae: dict) -> dict:
    """A diffusers-named VAE state in Wan 2.1's names, as ComfyUI's qwen_image_vae.safetensors has it."""
    return dict(zip(wan_names(list(vae), vae), vae.values()))


def _comfy_text(text: dict) -> dict:
    """ComfyUI's Qwen2.5-VL file: the language model under ``model.``, a vision tower and the LM head beside it."""
    out = {f"model.{k}": v for k, v in text.items()}
    out["visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2, 2)
    out["visual.blocks.0.attn.qkv.weight"] = torch.zeros(24, 8)
    out["lm_head.weight"] = torch.zeros(TEXT.vocab_size, TEXT.hidden_size)
    return out


def _bf16(state: dict) -> dict:
    return {k: v.to(torch.bfloat16) for k, v in state.items()}


def _write(path: Path, state: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def _value(tensor) -> torch.Tensor:
    return (tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize(torch.float32)).float()


def _same(ckpt, component: str, expected: dict) -> None:
    """The component opens with exactly the network's keys, each equal to the value the file holds."""
    assert set(ckpt.sources[component].shapes) == set(expected), component
    for key, value in expected.items():
        got = _value(ckpt.tensor(component, key))
        assert torch.equal(got, value.float()), f"{component}: {key}"


def _comfyui(root: Path, transformer: dict, name: str = BF16, text: dict | None = None, vae: dict | None = None):
    models = root / "models"
    model = _write(models / "diffusion_models" / name, transformer)
    if text is not None:
        _write(models / "text_encoders" / TEXT_FILE, text)
    if vae is not None:
        _write(models / "vae" / VAE_FILE, vae)
    return model


def test_comfyui_bf16_files_found_in_their_folders(states, tmp_path):
    """Bare diffusers names in bf16, the encoder (with its vision tower) and the Wan-named VAE found beside it."""
    model = _comfyui(tmp_path, _bf16(states.transformer), text=_bf16(_comfy_text(states.text)),
                     vae=_wan(states.vae))
    with open_model(model) as ckpt:
        assert ckpt.spec.family == "qwen-image" and ckpt.layout == "original"
        assert ckpt.spec.transformer == TRANSFORMER and ckpt.spec.vae == VAE
        assert ckpt.spec.text.hidden_size == 128 and ckpt.spec.text.kind == "qwen2"
        assert ckpt.storage_dtype == torch.bfloat16
        _same(ckpt, "transformer", _bf16(states.transformer))
        _same(ckpt, "text_encoder", _bf16(states.text))
        _same(ckpt, "vae", states.vae)
        notes = " ".join(ckpt.notes)
        assert "vision tower's 2 tensors are not read" in notes
        assert TEXT_FILE in notes and VAE_FILE in notes and "found beside the model" in notes
        loaded = ckpt.load("vae")
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in states.vae.items())
        transformer = ckpt.load("transformer")
        assert all(torch.equal(transformer.state_dict()[k], v.to(torch.bfloat16).float())
                   for k, v in states.transformer.items())


def test_comfyui_prefix_with_the_parts_given(states, tmp_path):
    """An all-in-one style file (``model.diffusion_model.``), the parts given, the VAE in diffusers' names."""
    model = _write(tmp_path / "ckpt" / "qwen_image.safetensors",
                   {f"model.diffusion_model.{k}": v for k, v in states.transformer.items()})
    text = _write(tmp_path / "elsewhere" / "encoder.safetensors", _comfy_text(states.text))
    vae = _write(tmp_path / "elsewhere" / "decoder.safetensors", states.vae)
    with open_model(model, text_encoders=[text, vae]) as ckpt:
        _same(ckpt, "transformer", states.transformer)
        _same(ckpt, "text_encoder", states.text)
        _same(ckpt, "vae", states.vae)
        assert ckpt.sources["text_encoder"].files == (str(text),)
        assert not any("found beside" in n for n in ckpt.notes)


def _fp8(state: dict) -> dict:
    return {k: v.to(torch.float8_e4m3fn) if v.ndim == 2 else v.to(torch.bfloat16) for k, v in state.items()}


def test_fp8_and_scaled_fp8_transformer(states, tmp_path):
    """qwen_image_fp8_e4m3fn.safetensors as stored; ComfyUI's scaled fp8 (``weight_scale``, ``input_scale`` and a
    ``comfy_quant`` record beside each matrix) read times its scale."""
    fp8 = _fp8(states.transformer)
    model = _comfyui(tmp_path / "plain", fp8, name="qwen_image_fp8_e4m3fn.safetensors",
                     text=_comfy_text(states.text), vae=_wan(states.vae))
    with open_model(model) as ckpt:
        assert ckpt.storage_dtype == torch.float8_e4m3fn
        _same(ckpt, "transformer", {k: v.float() for k, v in fp8.items()})
    scaled = dict(fp8)
    expected = {k: v.float() for k, v in fp8.items()}
    for i, key in enumerate(k for k, v in fp8.items() if v.ndim == 2):
        layer = key[:-len(".weight")]
        scale = torch.tensor(0.5 + i / 64, dtype=torch.float32)
        scaled[f"{layer}.weight_scale"] = scale
        scaled[f"{layer}.input_scale"] = torch.tensor(1.0)
        scaled[f"{layer}.comfy_quant"] = torch.tensor([1, 2], dtype=torch.uint8)
        expected[key] = fp8[key].float() * scale
    model = _comfyui(tmp_path / "scaled", scaled, name="qwen_image_fp8_scaled.safetensors",
                     text=_comfy_text(states.text), vae=_wan(states.vae))
    with open_model(model) as ckpt:
        _same(ckpt, "transformer", expected)
        assert not any("not understood" in n for n in ckpt.notes)


# --- GGUF --------------------------------------------------------------------------------------------------------


def _write_gguf(path: Path, tensors: dict, arch: str, qtype, fields=None) -> dict:
    """``tensors`` written with gguf.GGUFWriter in the ggml type ``qtype(name, tensor)`` names; returns the float32
    values the file holds (the gguf package's own dequantisation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if fields is not None:
        fields(writer)
    stored = {}
    for name, t in tensors.items():
        kind = gguf.GGMLQuantizationType[qtype(name, t)]
        a = t.float().numpy()
        raw = gguf.quants.quantize(a, kind)
        writer.add_tensor(name, raw, raw_dtype=kind)
        stored[name] = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, kind), np.float32)) \
            .reshape(a.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _q8_0_matrices(name: str, t: torch.Tensor) -> str:
    return "Q8_0" if t.ndim == 2 and t.shape[1] % 32 == 0 else "F32"


def _qwen2vl_fields(writer) -> None:
    """The ``qwen2vl.*`` metadata llama.cpp's converter writes for Qwen2.5-VL's language model."""
    writer.add_context_length(TEXT.max_position_embeddings)
    writer.add_embedding_length(TEXT.hidden_size)
    writer.add_block_count(TEXT.num_hidden_layers)
    writer.add_feed_forward_length(TEXT.intermediate_size)
    writer.add_head_count(TEXT.num_attention_heads)
    writer.add_head_count_kv(TEXT.num_key_value_heads)
    writer.add_layer_norm_rms_eps(TEXT.rms_norm_eps)
    writer.add_rope_freq_base(TEXT.rope_theta)


def test_gguf_transformer_and_qwen2vl_encoder(states, tmp_path):
    """city96's qwen_image GGUF (Q8_0 matrices) with llama.cpp's Qwen2.5-VL GGUF found in models/clip and the VAE in
    models/vae: each tensor the value the file holds, the transformer's matrices still quantised."""
    models = tmp_path / "models"
    stored = _write_gguf(models / "diffusion_models" / "qwen-image-Q8_0.gguf", states.transformer, "qwen_image",
                         _q8_0_matrices)
    llama = {llama_cpp_name(k): v for k, v in states.text.items()}
    text = _write_gguf(models / "clip" / "Qwen2.5-VL-7B-Instruct-Q8_0.gguf", llama, "qwen2vl", _q8_0_matrices,
                       _qwen2vl_fields)
    _write(models / "vae" / VAE_FILE, _wan(states.vae))
    with open_model(models / "diffusion_models" / "qwen-image-Q8_0.gguf") as ckpt:
        _same(ckpt, "transformer", stored)
        assert not isinstance(ckpt.tensor("transformer", "transformer_blocks.0.attn.to_q.weight"), torch.Tensor)
        _same(ckpt, "text_encoder", {k: text[llama_cpp_name(k)] for k in states.text})
        assert ckpt.spec.text.kind == "qwen2" and ckpt.spec.text.hidden_size == 128
        _same(ckpt, "vae", states.vae)


# --- errors ------------------------------------------------------------------------------------------------------


def _message(excinfo) -> str:
    return str(excinfo.value)


# --- Qwen-Image-Edit's files: the text encoder's vision tower read too -----------------------------------------

TOWER = QwenVisionConfig(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, window_size=56,
                         fullatt_block_indexes=(0,), out_hidden_size=128)


def _tower_state() -> dict:
    return _state(QwenVisionTower(TOWER), 4)


def _reads_an_image(ckpt) -> None:
    """The text encoder built from the files (its tower included) reads an image into a row of tokens: the tower's
    tokens spliced in with 3-D positions (the tiny vocabulary stands a token id in for ``<|image_pad|>``)."""
    from PIL import Image

    from sdlite.models.qwen import mrope_positions
    from sdlite.models.qwen_vision import QwenVLEncoder
    from sdlite.tokenizers.qwen_images import image_tokens, vision_patches

    encoder = ckpt.load("text_encoder")
    assert isinstance(encoder, QwenVLEncoder)
    pixels, grids = vision_patches([Image.new("RGB", (60, 40), (9, 99, 199))])
    pad = 200
    ids = torch.tensor([[1, 2, *[pad] * image_tokens(grids)[0], 3]])
    with torch.no_grad():
        features = encoder.visual(pixels, grids)
        states = encoder(ids, image_features=features, image_token_id=pad,
                         positions=mrope_positions(ids, None, grids.tolist(), pad, TOWER.spatial_merge_size))
    assert states.shape == (1, ids.shape[1], 128) and bool(torch.isfinite(states).all())


def test_comfyui_split_files_of_an_edit_release(states, tmp_path, monkeypatch):
    """ComfyUI's files of Qwen-Image-Edit-2509 found beside the transformer (named by its file): the encoder's vision
    tower under ``visual.`` read with the language model, as the released tower, whose config the shapes identify
    (the test's tiny tower stands in for it); every tensor the file's."""
    import sdlite.weights.qwen_vision_keys as vision_keys

    monkeypatch.setattr(vision_keys, "QWEN25_VL_7B_VISION", TOWER)
    tower = _tower_state()
    text = {**{k: v for k, v in _comfy_text(states.text).items() if not k.startswith("visual.")},
            **{f"visual.{k}": v for k, v in tower.items()}}
    model = _comfyui(tmp_path, states.transformer, name="qwen_image_edit_2509_bf16.safetensors", text=text,
                     vae=_wan(states.vae))
    with open_model(model) as ckpt:
        assert ckpt.spec.family == "qwen-image-edit-plus" and not ckpt.spec.transformer.zero_cond_t
        assert ckpt.spec.text.vision == TOWER and ckpt.spec.text.mrope_section == (16, 24, 24)
        _same(ckpt, "text_encoder", {**states.text, **{f"visual.{k}": v for k, v in tower.items()}})
        _same(ckpt, "transformer", states.transformer)
        _reads_an_image(ckpt)
    plain = _comfyui(tmp_path / "edit", states.transformer, name="qwen_image_edit_fp8_e4m3fn.safetensors", text=text,
                     vae=_wan(states.vae))
    with open_model(plain) as ckpt:
        assert ckpt.spec.family == "qwen-image-edit"


def test_gguf_encoder_takes_the_mmproj_beside_it(states, tmp_path):
    """A llama.cpp GGUF encoder has no vision tower: an editing release (2511 by its name: its transformer modulates
    the sources as at timestep 0) takes it from the mmproj GGUF found beside it, its config from the file's
    metadata; without that file the error says what to give."""
    from sdlite.weights.qwen_vision_keys import llama_cpp_vision_tensors
    from tests.test_qwen_vision import mmproj_fields

    models = tmp_path / "models"
    model = _write(models / "diffusion_models" / "qwen_image_edit_2511_bf16.safetensors", states.transformer)
    _write(models / "vae" / VAE_FILE, _wan(states.vae))
    llama = {llama_cpp_name(k): v for k, v in states.text.items()}
    text = _write_gguf(models / "text_encoders" / "Qwen2.5-VL-7B-Instruct-Q8_0.gguf", llama, "qwen2vl",
                       _q8_0_matrices, _qwen2vl_fields)
    with pytest.raises(CheckpointError, match="has none: llama.cpp keeps it in a separate mmproj GGUF") as e:
        open_model(model)
    assert e.value.path.endswith("Qwen2.5-VL-7B-Instruct-Q8_0.gguf")
    tower = _tower_state()
    stored = _write_gguf(models / "text_encoders" / "mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf",
                         llama_cpp_vision_tensors(tower), "clip", lambda n, t: "F32",
                         lambda writer: mmproj_fields(writer, TOWER))
    with open_model(model) as ckpt:
        assert ckpt.spec.family == "qwen-image-edit-plus" and ckpt.spec.transformer.zero_cond_t
        assert ckpt.spec.text.vision == TOWER
        assert "mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf, found beside the model" in " ".join(ckpt.notes)
        _same(ckpt, "text_encoder", {**{k: text[llama_cpp_name(k)] for k in states.text},
                                     **{f"visual.{k}": v for k, v in tower.items()}})
        assert all(torch.equal(stored[n], t) for n, t in llama_cpp_vision_tensors(tower).items())
        _reads_an_image(ckpt)


def test_a_missing_part_names_itself_and_the_flag(states, tmp_path):
    model = _comfyui(tmp_path, states.transformer, vae=_wan(states.vae))
    with pytest.raises(CheckpointError, match=r"no Qwen2\.5-VL text encoder .*--text-encoder") as e:
        open_model(model)
    assert e.value.path == str(model)


def test_a_missing_transformer_tensor_is_named(states, tmp_path):
    state = {f"model.diffusion_model.{k}": v for k, v in states.transformer.items() if k != "proj_out.bias"}
    model = _comfyui(tmp_path, state, text=_comfy_text(states.text), vae=_wan(states.vae))
    with pytest.raises(CheckpointError, match="model.diffusion_model.proj_out.bias"):
        open_model(model)


def test_a_missing_vae_tensor_is_named_as_the_file_names_it(states, tmp_path):
    vae = _wan(states.vae)
    del vae["decoder.head.2.bias"]
    model = _comfyui(tmp_path, states.transformer, text=_comfy_text(states.text), vae=vae)
    with pytest.raises(CheckpointError, match="decoder.head.2.bias") as e:
        open_model(model)
    assert e.value.path.endswith(VAE_FILE)


def test_a_narrow_or_qwen3_text_encoder_is_named(states, tmp_path):
    model = _comfyui(tmp_path, states.transformer, vae=_wan(states.vae))
    narrow = QwenConfig(**{**TEXT.__dict__, "hidden_size": 256})
    wrong = _write(tmp_path / "wide.safetensors",
                   {f"model.{k}": v for k, v in _state(QwenTextEncoder(narrow), 4).items()})
    with pytest.raises(CheckpointError, match="width 256 is not the text width 128") as e:
        open_model(model, text_encoders=[wrong])
    assert e.value.path == str(wrong)
    qwen3 = QwenConfig(**{**TEXT.__dict__, "qk_norm": True, "attention_bias": False})
    wrong = _write(tmp_path / "qwen_3_4b.safetensors",
                   {f"model.{k}": v for k, v in _state(QwenTextEncoder(qwen3), 5).items()})
    with pytest.raises(CheckpointError, match="is a qwen3") as e:
        open_model(model, text_encoders=[wrong])
    assert e.value.path == str(wrong)


def test_another_vae_is_refused_by_name(states, tmp_path):
    """FLUX.1's ae.safetensors (LDM names) and Wan 2.2's 48-channel VAE, each named with its file."""
    model = _comfyui(tmp_path, states.transformer, text=_comfy_text(states.text))
    flux = _write(tmp_path / "ae.safetensors", {"encoder.conv_in.weight": torch.zeros(8, 3, 3, 3),
                                                "decoder.conv_in.weight": torch.zeros(8, 16, 3, 3),
                                                "decoder.up.0.block.0.conv1.weight": torch.zeros(8, 8, 3, 3)})
    with pytest.raises(CheckpointError, match="FLUX.1's ae.safetensors") as e:
        open_model(model, text_encoders=[flux])
    assert e.value.path == str(flux)
    wide = QwenImageVAEConfig(base_dim=8, z_dim=48, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
                              latents_mean=(0.0,) * 48, latents_std=(1.0,) * 48)
    wan22 = _write(tmp_path / "wan2.2_vae.safetensors", _wan(_state(QwenImageVAE(wide), 6)))
    with pytest.raises(CheckpointError, match="48 latent channels.*Wan 2.2") as e:
        open_model(model, text_encoders=[wan22])
    assert e.value.path == str(wan22)
