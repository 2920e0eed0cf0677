"""Z-Image-Turbo in the files people download, against diffusers' ZImagePipeline on the same tiny random weights.

* ComfyUI's split files: ``z_image_turbo_bf16.safetensors`` (the transformer in the original code's names, bare or
  under ``model.diffusion_model.``, bf16), ``qwen_3_4b.safetensors`` (transformers' names under ``model.``, bf16) and
  ``ae.safetensors`` (the VAE in LDM names, fp32), found in ComfyUI's ``models/`` folders or given, through
  ``Engine.load`` and ``sdlite generate --text-encoder``;
* fp8: the transformer and the encoder in float8_e4m3fn, the encoder also in ComfyUI's scaled fp8 (``scale_weight``)
  and in its newer per-layer form (``weight_scale`` with a ``comfy_quant`` record);
* GGUF: the transformer as city96's converter and patched llama-quantize write it (``general.architecture``
  ``lumina2``, the joint blocks' matrices in Q8_0, the rest as the bf16 file had them) and Qwen3 as llama.cpp writes
  it (``qwen3``, ``blk.N`` names, Q8_0 and Q4_K): their block-format Linears stay quantised in memory;
* the errors, each naming the file, the part or the flag.

The images are diffusers' on the values the files hold (bf16-, fp8- or block-rounded), within 2/255. The shapes are
test_zimage_pipeline's but for two facts a file's shapes must show as the release has them: the transformer's heads
are 128 wide (its rotary split, 32/48/48, leaves no trace in the weights) and Qwen3's MLP is 256 wide (so that
``ffn_down`` fills Q4_K's 256-value super-blocks)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdlite.errors import CheckpointError
from sdlite.loader import open_model
from sdlite.pipeline import Engine, Request
from sdlite.weights.qwen_keys import llama_cpp_name
from sdlite.weights.vae_keys import vae_to_original
from sdlite.weights.zimage_keys import ZIMAGE_PREFIX, zimage_from_comfy, zimage_to_comfy
from tests.reference import diffusers_vae, seed_all
from tests.test_qwen import QWEN3_CHAT_TEMPLATE
from tests.test_zimage_pipeline import MAX_PIXEL_DIFF, PROMPT, QWEN_JSON, VAE
from tests.test_zimage_pipeline import QWEN as PIPELINE_QWEN
from tests.test_zimage_pipeline import TRANSFORMER as PIPELINE_TRANSFORMER

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRANSFORMER = {**PIPELINE_TRANSFORMER, "dim": 128, "n_heads": 1, "n_kv_heads": 1, "axes_dims": [32, 48, 48]}
QWEN = {**PIPELINE_QWEN, "intermediate_size": 256}
SIZE, STEPS, SEED = 64, 3, 5
BF16_FILE, QWEN_FILE, VAE_FILE = "z_image_turbo_bf16.safetensors", "qwen_3_4b.safetensors", "ae.safetensors"


def _pipeline():
    """A tiny ZImagePipeline (the Turbo's scheduler), not saved: the files are written from its state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen2TokenizerFast, Qwen3Config, Qwen3Model

    from sdlite.config.zimage import ZIMAGE_TURBO_SCHEDULER

    vae = seed_all(diffusers_vae(VAE), 1, scale=0.05)
    with torch.no_grad():   # contrast enough that 2/255 means something
        vae.decoder.conv_out.weight.mul_(30.0)
    transformer = seed_all(ZImageTransformer2DModel(**TRANSFORMER).eval(), 4, scale=0.15)
    text = seed_all(Qwen3Model(Qwen3Config(**QWEN, attn_implementation="eager")).eval(), 2, scale=0.2)
    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(QWEN_JSON))
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    scheduler = FlowMatchEulerDiscreteScheduler(**{k: v for k, v in ZIMAGE_TURBO_SCHEDULER.items()
                                                   if not k.startswith("_")})
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text, tokenizer=tokenizer,
                          transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _state(module) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}


def _bf16(state: dict) -> dict:
    return {k: v.to(torch.bfloat16) for k, v in state.items()}


def _comfy(transformer: dict) -> dict:
    """diffusers' transformer state in ComfyUI's names (q, k and v fused into ``attention.qkv``)."""
    return {k: v.clone().contiguous() for k, v in zimage_to_comfy(transformer).materialize(transformer).items()}


def _diffusers(comfy: dict) -> dict:
    """ComfyUI's names back to diffusers' (each fused qkv split), values as they are, in float32."""
    return {k: v.float().contiguous() for k, v in zimage_from_comfy(comfy).materialize(comfy).items()}


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(im, dtype=np.int16) for im in images])


def _request(**kw) -> Request:
    return Request(prompt=PROMPT, steps=STEPS, cfg_scale=1.0, sampler="euler", seed=SEED, width=SIZE, height=SIZE,
                   **kw)


def _run(path, **kw) -> np.ndarray:
    return _pixels(Engine.load(path, precision="exact", **kw).generate(_request()).images)


def _reference(pipe, transformer: dict, text: dict) -> np.ndarray:
    """diffusers' image with ``transformer`` and ``text`` (diffusers' / transformers' names, float32) loaded."""
    pipe.transformer.load_state_dict(transformer)
    pipe.text_encoder.load_state_dict(text)
    out = pipe(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=0.0,
               generator=torch.Generator().manual_seed(SEED), output_type="np").images
    return np.round(np.clip(out, 0, 1) * 255).astype(np.int16)


def _close(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape == (1, SIZE, SIZE, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF, f"max difference {np.abs(got - expected).max()}/255"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """ComfyUI's three files in its models/ folders, the transformer under ComfyUI's all-in-one prefix alone in a folder
    of its own, and diffusers' image on the bf16 values they hold."""
    tmp = tmp_path_factory.mktemp("zimage-files")
    pipe = _pipeline()
    transformer = {k: v.to(torch.bfloat16).float() for k, v in _state(pipe.transformer).items()}
    text = {k: v.to(torch.bfloat16).float() for k, v in _state(pipe.text_encoder).items()}
    vae = _state(pipe.vae)
    comfy = _comfy(transformer)
    models = tmp / "ComfyUI" / "models"
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (models / sub).mkdir(parents=True)
    save_file(_bf16(comfy), models / "diffusion_models" / BF16_FILE)
    save_file(_bf16({"model." + k: v for k, v in text.items()}), models / "text_encoders" / QWEN_FILE)
    save_file({k: v.clone().contiguous() for k, v in vae_to_original(vae, prefix="").materialize(vae).items()},
              models / "vae" / VAE_FILE)
    alone = tmp / "alone"
    alone.mkdir()
    save_file(_bf16({ZIMAGE_PREFIX + k: v for k, v in comfy.items()}), alone / BF16_FILE)
    return SimpleNamespace(pipe=pipe, transformer=transformer, text=text, comfy=comfy, tmp=tmp, models=models,
                           model=models / "diffusion_models" / BF16_FILE, alone=alone / BF16_FILE,
                           qwen=models / "text_encoders" / QWEN_FILE, vae=models / "vae" / VAE_FILE,
                           expected=_reference(pipe, transformer, text))


# --- ComfyUI's split files -----------------------------------------------------------------------------------------

def test_comfyui_files_found_in_its_folders(files):
    """models/diffusion_models/z_image_turbo_bf16.safetensors alone: the encoder and the VAE found in
    models/text_encoders and models/vae, each noted; diffusers' image on the bf16 values."""
    ckpt = open_model(files.model)
    assert ckpt.spec.family == "z-image-turbo" and ckpt.layout == "original"
    assert ckpt.spec.transformer.dim == 128 and ckpt.spec.text.hidden_size == 32
    assert ckpt.storage_dtype == torch.bfloat16
    assert sorted(n for n in ckpt.notes if "found beside" in n) == [
        f"Qwen3 text encoder ({QWEN_FILE}) from {QWEN_FILE}, found beside the model",
        f"VAE ({VAE_FILE}) from {VAE_FILE}, found beside the model"]
    ckpt.close()
    got = _run(files.model)
    _close(got, files.expected)
    assert got.std() > 10, "the image should not be flat"


def test_comfyui_files_given(files):
    """The transformer under model.diffusion_model. in a folder of its own, its parts given (Engine.load's
    text_encoders=, in either order): the same image as the bare file's."""
    got = _run(files.alone, text_encoders=[files.vae, files.qwen])
    _close(got, files.expected)
    given = open_model(files.model, text_encoders=[files.qwen, files.vae])   # given and beside: taken once, as given
    assert not given.notes
    given.close()
    assert np.array_equal(got, _run(files.model, text_encoders=[files.qwen, files.vae]))


def test_cli_generate_with_text_encoders(files, tmp_path):
    from PIL import Image

    from sdlite.cli import main

    out = tmp_path / "z.png"
    assert main(["generate", PROMPT, "--model", str(files.alone), "--text-encoder", str(files.qwen),
                 "--text-encoder", str(files.vae), "--steps", str(STEPS), "--cfg", "1", "--sampler", "euler",
                 "--seed", str(SEED), "--width", str(SIZE), "--height", str(SIZE), "--precision", "exact",
                 "-o", str(out)]) == 0
    _close(np.asarray(Image.open(out).convert("RGB"), np.int16)[None], files.expected)


# --- fp8 -----------------------------------------------------------------------------------------------------------

def _fp8(state: dict) -> dict:
    """ComfyUI's ``*_fp8_e4m3fn`` files: every matrix in float8_e4m3fn as it is, the rest as the bf16 file has it."""
    return {k: v.to(torch.float8_e4m3fn) if v.ndim == 2 and k.endswith(".weight") else v.to(torch.bfloat16)
            for k, v in state.items()}


def _scaled_fp8(state: dict, mixed: bool) -> dict:
    """ComfyUI's scaled fp8 encoder: each matrix but the embedding divided by a per-tensor scale (its largest value
    over e4m3's 448) and stored in float8_e4m3fn, the scale beside it as ``<layer>.scale_weight`` with the file's
    ``scaled_fp8`` marker; ``mixed``: the newer form of the same values, ``<layer>.weight_scale`` and a
    ``<layer>.comfy_quant`` record per layer."""
    out = {}
    record = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    for k, v in state.items():
        if v.ndim != 2 or k.endswith("embed_tokens.weight"):
            out[k] = v.to(torch.bfloat16)
            continue
        scale = (v.abs().max() / 448.0).float()
        out[k] = (v / scale).to(torch.float8_e4m3fn)
        layer = k.removesuffix(".weight")
        if mixed:
            out[layer + ".weight_scale"] = scale.reshape(())
            out[layer + ".comfy_quant"] = record.clone()
        else:
            out[layer + ".scale_weight"] = scale.reshape(())
    if not mixed:
        out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    return out


def _values(stored: dict) -> dict:
    """What each weight of an fp8 file (transformers' names under ``model.``) is, in float32: a scaled weight times
    its scale."""
    out = {}
    for k, v in stored.items():
        if not k.endswith(".weight"):
            continue
        layer = k.removesuffix(".weight")
        scale = stored.get(layer + ".scale_weight", stored.get(layer + ".weight_scale"))
        out[k.removeprefix("model.")] = v.float() * scale if scale is not None else v.float()
    return out


@pytest.fixture(scope="module")
def fp8_files(files):
    folder = files.tmp / "fp8"
    folder.mkdir()
    transformer = _fp8(files.comfy)
    save_file(transformer, folder / "z_image_turbo_fp8_e4m3fn.safetensors")
    qwen = {"model." + k: v for k, v in files.text.items()}
    made = {"qwen_3_4b_fp8_e4m3fn.safetensors": _fp8(qwen),
            "qwen_3_4b_fp8_scaled.safetensors": _scaled_fp8(qwen, mixed=False),
            "qwen_3_4b_fp8_mixed.safetensors": _scaled_fp8(qwen, mixed=True)}
    for name, state in made.items():
        save_file(state, folder / name)
    values = _diffusers({k: v.float() for k, v in transformer.items()})
    return SimpleNamespace(folder=folder, transformer=values, text={k: _values(v) for k, v in made.items()})


@pytest.mark.parametrize("encoder", ["qwen_3_4b_fp8_e4m3fn.safetensors", "qwen_3_4b_fp8_scaled.safetensors"])
def test_fp8_transformer_and_encoder(files, fp8_files, encoder):
    """z_image_turbo_fp8_e4m3fn with an fp8 Qwen3 (plain, or scaled): converted as they load, diffusers' image on the
    fp8 values (a scaled weight times its scale)."""
    assert fp8_files.transformer["layers.0.attention.to_q.weight"].unique().numel() <= 256   # fp8 values indeed
    expected = _reference(files.pipe, fp8_files.transformer, fp8_files.text[encoder])
    ckpt = open_model(fp8_files.folder / "z_image_turbo_fp8_e4m3fn.safetensors",
                      text_encoders=[fp8_files.folder / encoder, files.vae])
    assert ckpt.storage_dtype == torch.float8_e4m3fn and not ckpt.notes
    ckpt.close()
    ckpt = open_model(files.model, text_encoders=[fp8_files.folder / encoder])   # a given encoder over the one beside
    assert ckpt.sources["text_encoder"].files == (str(fp8_files.folder / encoder),)
    assert [n for n in ckpt.notes if "found beside" in n] == [
        f"VAE ({VAE_FILE}) from {VAE_FILE}, found beside the model"]
    ckpt.close()
    got = _run(fp8_files.folder / "z_image_turbo_fp8_e4m3fn.safetensors",
               text_encoders=[fp8_files.folder / encoder, files.vae])
    _close(got, expected)
    if encoder.endswith("_e4m3fn.safetensors"):   # kept in fp8 (ComfyUI's UNETLoader weight_dtype): the same image
        from torch import nn

        from sdlite.engine.lowbit import LowBitLinear

        kept = Engine.load(fp8_files.folder / "z_image_turbo_fp8_e4m3fn.safetensors", precision="exact",
                           weight_storage="fp8_e4m3fn", text_encoders=[fp8_files.folder / encoder, files.vae])
        assert np.array_equal(_pixels(kept.generate(_request()).images), got)
        with kept.models.use("transformer") as transformer:
            low = [m for m in transformer.modules() if isinstance(m, LowBitLinear)]
            assert len(low) == 37 and {m.qtype for m in low} == {"F8_E4M3"}   # every Linear, one byte a weight
            assert not any(type(m) is nn.Linear for m in transformer.modules())
    if encoder.endswith("_scaled.safetensors"):   # ComfyUI's newer per-layer record of the same values: the same image
        mixed = _run(fp8_files.folder / "z_image_turbo_fp8_e4m3fn.safetensors",
                     text_encoders=[fp8_files.folder / "qwen_3_4b_fp8_mixed.safetensors", files.vae])
        assert np.array_equal(mixed, got)


# --- GGUF ----------------------------------------------------------------------------------------------------------

def _write_gguf(path, tensors: dict, arch: str, qtype, fields=None) -> dict:
    """``tensors`` (name -> tensor) written with gguf.GGUFWriter, each in the ggml type ``qtype(name, tensor)`` names
    (Q4_K: random blocks with small scales, which the gguf package cannot quantise to), ``fields(writer)`` adding the
    metadata. Returns the float32 values the file holds (the gguf package's own dequantisation)."""
    from tests.test_flux_files import _k_blocks

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if fields is not None:
        fields(writer)
    stored = {}
    for i, (name, t) in enumerate(tensors.items()):
        kind = gguf.GGMLQuantizationType[qtype(name, t)]
        a = t.float().numpy()
        raw = _k_blocks(*a.shape, seed=i) if kind == gguf.GGMLQuantizationType.Q4_K else gguf.quants.quantize(a, kind)
        writer.add_tensor(name, raw, raw_dtype=kind)
        stored[name] = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, kind), np.float32)) \
            .reshape(a.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _city96_q8_0(name: str, t: torch.Tensor) -> str:
    """The type city96's tools give a Z-Image tensor in a Q8_0 file: convert.py keeps vectors and tensors of up to 1024
    values in F32 and the rest as the bf16 source (BF16); the patched llama-quantize (arch ``lumina2``) quantises the
    joint blocks' matrices only (not the refiners, embedders or final layer), where their rows are whole blocks."""
    if t.ndim == 1 or t.numel() <= 1024:
        return "F32"
    if name.startswith("layers.") and name.endswith(".weight") and t.ndim == 2 and t.shape[1] % 32 == 0:
        return "Q8_0"
    return "BF16"


def _llama_cpp_q4_k_m(name: str, t: torch.Tensor) -> str:
    """llama.cpp's Q4_K_M of a small Qwen3: vectors F32, matrices whose rows are whole 256-value super-blocks Q4_K,
    the others (rows of 32 values here) Q8_0, the token embedding included."""
    if t.ndim == 1:
        return "F32"
    return "Q4_K" if t.shape[1] % 256 == 0 else "Q8_0"


def _qwen3_fields(writer) -> None:
    """The ``qwen3.*`` metadata llama.cpp's converter writes (the tokenizer's entries are not read: one vocabulary)."""
    writer.add_context_length(QWEN["max_position_embeddings"])
    writer.add_embedding_length(QWEN["hidden_size"])
    writer.add_block_count(QWEN["num_hidden_layers"])
    writer.add_feed_forward_length(QWEN["intermediate_size"])
    writer.add_head_count(QWEN["num_attention_heads"])
    writer.add_head_count_kv(QWEN["num_key_value_heads"])
    writer.add_key_length(QWEN["head_dim"])
    writer.add_value_length(QWEN["head_dim"])
    writer.add_layer_norm_rms_eps(QWEN["rms_norm_eps"])
    writer.add_rope_freq_base(QWEN["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)


@pytest.fixture(scope="module")
def gguf_files(files):
    """models/diffusion_models/z_image_turbo-Q8_0.gguf, models/clip/Qwen3-4B-Q4_K_M.gguf (ComfyUI's older folder for
    text encoders, where ComfyUI-GGUF's CLIP loaders look too) and models/vae/ae.safetensors, and diffusers' image on
    the values they hold."""
    models = files.tmp / "gguf" / "models"
    for sub in ("diffusion_models", "clip", "vae"):
        (models / sub).mkdir(parents=True)
    (models / "vae" / VAE_FILE).symlink_to(files.vae)
    stored = _write_gguf(models / "diffusion_models" / "z_image_turbo-Q8_0.gguf", _bf16(files.comfy), "lumina2",
                         _city96_q8_0, lambda w: w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0))
    names = {k: llama_cpp_name(k) for k in files.text}
    text = _write_gguf(models / "clip" / "Qwen3-4B-Q4_K_M.gguf",
                       {names[k]: v for k, v in files.text.items()}, "qwen3", _llama_cpp_q4_k_m, _qwen3_fields)
    expected = _reference(files.pipe, _diffusers(stored), {k: text[names[k]] for k in files.text})
    return SimpleNamespace(model=models / "diffusion_models" / "z_image_turbo-Q8_0.gguf",
                           qwen=models / "clip" / "Qwen3-4B-Q4_K_M.gguf", expected=expected)


def test_gguf_transformer_and_encoder_stay_quantized(gguf_files):
    """city96's lumina2 GGUF with llama.cpp's Qwen3 GGUF found beside it: diffusers' image on the dequantised values;
    the transformer's Q8_0 Linears and the encoder's Q8_0 and Q4_K ones (every Linear it has) stay in their block
    formats in memory, dequantised as each layer runs. Memory mode 0 (the transformer streamed from the file block by
    block) draws the same image."""
    from torch import nn

    from sdlite.engine.lowbit import LowBitLinear, lowbit_bytes

    ckpt = open_model(gguf_files.model)
    assert ckpt.spec.family == "z-image-turbo" and sum("found beside" in n for n in ckpt.notes) == 2
    ckpt.close()
    engine = Engine.load(gguf_files.model, precision="exact")
    got = _pixels(engine.generate(_request()).images)
    _close(got, gguf_files.expected)
    for name, count, qtypes in (("transformer", 14, {"Q8_0"}), ("text_encoder", 21, {"Q8_0", "Q4_K"})):
        with engine.models.use(name) as network:
            low = [m for m in network.modules() if isinstance(m, LowBitLinear)]
            assert len(low) == count and {m.qtype for m in low} == qtypes, name
            dense = sum(m.in_features * m.out_features * 4 for m in low)
            assert lowbit_bytes(network) < dense / 3, name
            if name == "text_encoder":   # every Linear of the encoder: none dense
                assert not any(type(m) is nn.Linear for m in network.modules())
    low_memory = Engine.load(gguf_files.model, precision="exact", memory_mode=0)
    assert np.array_equal(_pixels(low_memory.generate(_request()).images), got)


# --- what is missing or wrong, named -------------------------------------------------------------------------------

def _qwen_file(path, **config) -> Path:
    """A Qwen3 text encoder file in ComfyUI's form (bf16, under ``model.``) of another config than the model's."""
    from transformers import Qwen3Config, Qwen3Model

    state = Qwen3Model(Qwen3Config(**{**QWEN, **config})).state_dict()
    save_file({"model." + k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, path)
    return path


def test_a_missing_transformer_tensor_is_named_as_the_file_names_it(files, tmp_path):
    """q, k and v are one fused tensor in ComfyUI's file: a missing one is named so, bare and under the prefix."""
    for prefix in ("", ZIMAGE_PREFIX):
        path = tmp_path / f"broken{len(prefix)}.safetensors"
        save_file({prefix + k: v for k, v in _bf16(files.comfy).items() if k != "layers.1.attention.qkv.weight"}, path)
        with pytest.raises(CheckpointError, match=rf"{path.name}: tensor '{prefix}layers\.1\.attention\.qkv\.weight': "
                                                  r"1 Z-Image transformer tensors are missing"):
            open_model(path, text_encoders=[files.qwen, files.vae])


def test_a_missing_part_names_itself_and_the_flag(files, tmp_path, capsys):
    """Neither given nor found beside (the model alone in its folder): the part, the file it goes by, the flag; the CLI
    says so on stderr and writes nothing."""
    from sdlite.cli import main

    with pytest.raises(CheckpointError, match=r"has no Qwen3 text encoder \(qwen_3_4b\.safetensors\): the file holds "
                                              r"none and none was given \(--text-encoder PATH"):
        open_model(files.alone, text_encoders=[files.vae])
    with pytest.raises(CheckpointError, match=r"has no VAE \(ae\.safetensors\).*--text-encoder PATH"):
        open_model(files.alone, text_encoders=[files.qwen])
    assert main(["generate", PROMPT, "--model", str(files.alone), "--steps", "1", "-o", str(tmp_path / "z.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdlite: error: ") and "Traceback" not in err
    assert "no Qwen3 text encoder" in err and "--text-encoder" in err and not (tmp_path / "z.png").exists()
    with pytest.raises(CheckpointError, match=r"nope\.safetensors: no such file \(given with --text-encoder"):
        open_model(files.alone, text_encoders=[tmp_path / "nope.safetensors", files.vae])


def test_a_part_that_does_not_fit_is_named(files, tmp_path):
    """A Qwen3 of another width (FLUX.2 klein's qwen_3_8b is 4096 wide), SD's 4-channel VAE, a file that is neither
    encoder nor VAE (the transformer itself, FLUX's T5): each names the file at fault and what Z-Image takes."""
    from tests.reference import TINY_VAE

    wide = _qwen_file(tmp_path / "qwen_3_8b.safetensors", hidden_size=64, vocab_size=1000)
    with pytest.raises(CheckpointError, match=r"qwen_3_8b\.safetensors: the text encoder's width 64 is not the caption "
                                              rf"width 32 of the transformer \({BF16_FILE}\)"):
        open_model(files.alone, text_encoders=[wide, files.vae])
    sd_vae = _state(diffusers_vae(TINY_VAE))
    save_file({k: v.contiguous() for k, v in vae_to_original(sd_vae, prefix="").materialize(sd_vae).items()},
              tmp_path / "vae-ft-mse-840000-ema-pruned.safetensors")
    with pytest.raises(CheckpointError, match=r"vae-ft-mse-840000-ema-pruned\.safetensors: the VAE's 4 latent channels "
                                              r"are not the 16 of the transformer"):
        open_model(files.alone, text_encoders=[files.qwen, tmp_path / "vae-ft-mse-840000-ema-pruned.safetensors"])
    save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(8, 8), "shared.weight": torch.zeros(9, 8)},
              tmp_path / "t5xxl_fp16.safetensors")
    for wrong, first in ((files.model, "cap_embedder.0.weight"),
                         (tmp_path / "t5xxl_fp16.safetensors", "encoder.block.0.layer.0.SelfAttention.q.weight")):
        with pytest.raises(CheckpointError, match=rf"{re.escape(wrong.name)}: not a file Z-Image takes beside its "
                                                  rf"transformer .*; the first key is '{re.escape(first)}'"):
            open_model(files.alone, text_encoders=[files.qwen, files.vae, wrong])


def test_a_part_given_twice_is_named(files, tmp_path):
    wide = _qwen_file(tmp_path / "qwen_3_8b.safetensors", hidden_size=64, vocab_size=1000)
    for twice in (files.qwen, wide):
        with pytest.raises(CheckpointError, match=rf"{re.escape(twice.name)}: Qwen3 text encoder \(qwen_3_4b"
                                                  rf"\.safetensors\) is given twice \(also in .*{QWEN_FILE}\)"):
            open_model(files.alone, text_encoders=[files.qwen, twice, files.vae])
    with pytest.raises(CheckpointError, match=r"VAE \(ae\.safetensors\) is given twice"):
        open_model(files.alone, text_encoders=[files.vae, files.qwen, files.vae])


@pytest.mark.parametrize("change,named", [
    (lambda k: k.replace("adaLN_modulation.0", "adaLN_modulation.1"), r"a Lumina-Image 2\.0 NextDiT .*not Z-Image"),
    (None, r"Z-Image Omni transformer .*only the text-to-image Z-Image transformer is supported")])
def test_a_kindred_transformer_is_named(files, tmp_path, change, named):
    """Lumina-Image 2.0's NextDiT (ComfyUI's names, its blocks modulated through adaLN_modulation.1) and Z-Image Omni
    (SigLIP image features) are named as what they are, with or without encoders given, rather than taken for some
    other model or for none."""
    state = {change(k) if change else k: v for k, v in _bf16(files.comfy).items()}
    if change is None:
        state["siglip_embedder.0.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    path = tmp_path / "model.safetensors"
    save_file(state, path)
    for given in ((), (files.qwen, files.vae)):
        with pytest.raises(CheckpointError, match=rf"model\.safetensors: {named}"):
            open_model(path, text_encoders=given)
