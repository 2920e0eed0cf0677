"""FLUX.2 [klein] in the files people have (issue 53): each opened by ``open_model``, and every network it loads equal,
tensor for tensor, to what the files hold (diffusers' own classes wrote the weights: Flux2Transformer2DModel,
AutoencoderKLFlux2, transformers' Qwen3ForCausalLM, saved by Flux2KleinPipeline).

* the diffusers folder (``is_distilled`` picking the distilled or the base model, the KV pipeline's default);
* BFL's single file (``flux-2-klein-4b.safetensors``: BFL's names) with ComfyUI's ``qwen_3_4b.safetensors`` and
  ``flux2-vae.safetensors`` found in ComfyUI's ``models/`` folders, ComfyUI's copy under ``model.diffusion_model.``
  with its parts given, BFL's ``ae.safetensors`` beside it, the VAE in diffusers' names;
* fp8: float8_e4m3fn weights, ComfyUI's scaled fp8 in both spellings (``scale_weight`` with the ``scaled_fp8`` marker;
  ``weight_scale`` with ``input_scale`` and ``comfy_quant`` records), for the transformer and for Qwen3;
* GGUF: the transformer as city96's tools write it (BFL's names, the blocks' matrices in Q8_0) and Qwen3 as llama.cpp
  writes it (Q8_0 and Q4_K), their block-format Linears kept quantised; memory mode 0 streaming FLUX.2's blocks;
* the errors, each naming the file (and key) at fault.

Shapes: what a file's shapes must show as the releases have them (128-wide heads: their rotary split leaves no trace
in the weights), else as small as they go: 1 double and 1 single block, text 3 x 32 wide (Qwen3 32 wide, 28 layers, so
that klein's hidden states 9, 18 and 27 exist; its MLP 256 wide so that ``ffn_down`` fills Q4_K's super-blocks), a
two-level VAE (32 wide: the release's 32 norm groups, which no shape shows) with 8 latent channels (32 token values)."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch
from safetensors.torch import save_file

from sdlite.config import VAEConfig
from sdlite.config.flux2 import FLUX2_KLEIN_4B, FLUX2_KLEIN_SCHEDULER, Flux2Config
from sdlite.config.flux2_vae import Flux2VAEConfig
from sdlite.config.qwen import QWEN3_8B
from sdlite.errors import CheckpointError
from sdlite.loader import open_model
from sdlite.weights.flux2_keys import FLUX2_PREFIX, flux2_plan, flux2_to_original
from sdlite.weights.flux2_vae_keys import flux2_vae_to_original
from sdlite.weights.qwen_keys import llama_cpp_name
from sdlite.weights.vae_keys import vae_to_original
from tests.reference import diffusers_vae, seed_all
from tests.test_zimage_files import _fp8, _llama_cpp_q4_k_m, _scaled_fp8, _write_gguf
from tests.test_zimage_pipeline import QWEN_JSON

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT_WIDTH = 32
QWEN = dict(vocab_size=151936, hidden_size=TEXT_WIDTH, intermediate_size=256, num_hidden_layers=28,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            max_position_embeddings=1024, tie_word_embeddings=True)
TRANSFORMER = Flux2Config(num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=1,
                          joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32, in_channels=32,
                          out_channels=32, guidance_embeds=False)
VAE = Flux2VAEConfig(block_out_channels=(32, 32), layers_per_block=1, latent_channels=8, sample_size=32)
BFL_FILE, QWEN_FILE, VAE_FILE = "flux-2-klein-4b.safetensors", "qwen_3_4b.safetensors", "flux2-vae.safetensors"


# --- the weights ---------------------------------------------------------------------------------------------------

def _transformer(cfg: Flux2Config = TRANSFORMER, seed: int = 4):
    from diffusers import Flux2Transformer2DModel

    kwargs = {k: v for k, v in cfg.to_diffusers().items() if not k.startswith("_")}
    return seed_all(Flux2Transformer2DModel(**kwargs).eval(), seed, scale=0.15)


def _vae(cfg: Flux2VAEConfig = VAE, seed: int = 1):
    """AutoencoderKLFlux2 with random weights and latent statistics (variances in (0.5, 1.5))."""
    from diffusers import AutoencoderKLFlux2

    vae = seed_all(AutoencoderKLFlux2.from_config(cfg.to_diffusers()).eval(), seed, scale=0.05)
    with torch.no_grad():
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=torch.Generator().manual_seed(seed))
                                 + 0.5)
    return vae


def _qwen(seed: int = 2, **config):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return seed_all(Qwen3ForCausalLM(Qwen3Config(**{**QWEN, **config})).eval(), seed, scale=0.2)


def _state(module) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}


def _bf16(state: dict) -> dict:
    return {k: v.to(torch.bfloat16) for k, v in state.items()}


def _rounded(state: dict) -> dict:
    """The values a bf16 file holds, in float32."""
    return {k: v.to(torch.bfloat16).float() for k, v in state.items()}


def _bfl(transformer: dict) -> dict:
    """diffusers' transformer state in BFL's names (each double block's q, k and v fused into its qkv)."""
    return {k: v.clone().contiguous() for k, v in flux2_to_original(transformer).materialize(transformer).items()}


def _canonical(bfl: dict) -> dict:
    """BFL's names (or city96's GGUF names, the same) back to diffusers', values as they are, in float32."""
    return {k: v.float().contiguous() for k, v in flux2_plan(list(bfl)).materialize(bfl).items()}


def _original_vae(vae: dict) -> dict:
    """diffusers' AutoencoderKLFlux2 state in BFL's / ComfyUI's names (flux2-vae.safetensors)."""
    return {k: v.clone().contiguous() for k, v in flux2_vae_to_original(vae).materialize(vae).items()}


def _pipeline_folder(folder: Path, transformer, vae, text, **index) -> Path:
    """A Flux2KleinPipeline saved by diffusers, with ``index`` changed in its model_index.json."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen2TokenizerFast

    scheduler = FlowMatchEulerDiscreteScheduler(**{k: v for k, v in FLUX2_KLEIN_SCHEDULER.items()
                                                   if not k.startswith("_")})
    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(QWEN_JSON))
    Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text, tokenizer=tokenizer, transformer=transformer,
                       is_distilled=True).save_pretrained(folder)
    if index:
        _edit_index(folder, **index)
    return folder


def _edit_index(folder: Path, **changes) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    for key, value in changes.items():
        if value is None:
            index.pop(key, None)
        else:
            index[key] = value
    (folder / "model_index.json").write_text(json.dumps(index))


def _sibling(folder: Path, where: Path, **changes) -> Path:
    """``folder``'s components (linked) under another model_index.json."""
    where.mkdir()
    for sub in folder.iterdir():
        if sub.is_dir():
            (where / sub.name).symlink_to(sub)
    shutil.copy(folder / "model_index.json", where / "model_index.json")
    _edit_index(where, **changes)
    return where


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The networks (diffusers' classes), their diffusers folder, and ComfyUI's split files in its models/ folders:
    the transformer in BFL's names (bf16), Qwen3 under ``model.`` (bf16), the VAE in BFL's names (fp32); the
    transformer under ComfyUI's prefix alone in a folder (the base model's name)."""
    tmp = tmp_path_factory.mktemp("flux2-files")
    transformer, vae, text = _transformer(), _vae(), _qwen()
    folder = _pipeline_folder(tmp / "FLUX.2-klein-4B", transformer, vae, text)
    state = _rounded(_state(transformer))
    qwen = _rounded(_state(text.model))
    vae_state = _state(vae)
    bfl = _bfl(state)
    models = tmp / "ComfyUI" / "models"
    for sub in ("diffusion_models", "text_encoders", "vae"):
        (models / sub).mkdir(parents=True)
    save_file(_bf16(bfl), models / "diffusion_models" / BFL_FILE)
    save_file(_bf16({"model." + k: v for k, v in qwen.items()}), models / "text_encoders" / QWEN_FILE)
    save_file(_original_vae(vae_state), models / "vae" / VAE_FILE)
    alone = tmp / "alone"
    alone.mkdir()
    save_file(_bf16({FLUX2_PREFIX + k: v for k, v in bfl.items()}), alone / "flux-2-klein-base-4b.safetensors")
    return SimpleNamespace(tmp=tmp, folder=folder, transformer=state, bfl=bfl, qwen=qwen, vae=vae_state,
                           raw=_state(transformer), raw_qwen=_state(text.model), models=models,
                           model=models / "diffusion_models" / BFL_FILE,
                           alone=alone / "flux-2-klein-base-4b.safetensors",
                           qwen_file=models / "text_encoders" / QWEN_FILE, vae_file=models / "vae" / VAE_FILE)


def _same(got: dict, expected: dict, what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for key, value in expected.items():
        assert torch.equal(got[key], value.to(got[key].dtype)), f"{what}: {key}"


def _check_loaded(ckpt, transformer: dict, qwen: dict, vae: dict) -> None:
    """Every network the checkpoint loads (in float32) holds exactly the expected tensors (diffusers' names; Qwen3's
    without ``model.``; the VAE's batch norm without its counter), and the spec carries the VAE's statistics."""
    _same(ckpt.load("transformer").state_dict(), transformer, "transformer")
    _same(ckpt.load("text_encoder").state_dict(), qwen, "text_encoder")
    vae = {k: v for k, v in vae.items() if k != "bn.num_batches_tracked"}
    _same(ckpt.load("vae").state_dict(), vae, "vae")
    assert ckpt.spec.vae.latents_mean == tuple(vae["bn.running_mean"].float().tolist())
    assert ckpt.spec.vae.latents_var == tuple(vae["bn.running_var"].float().tolist())
    assert ckpt.spec.vae.latent_channels == VAE.latent_channels and ckpt.spec.transformer.in_channels == 32


# --- diffusers folders ---------------------------------------------------------------------------------------------

def test_diffusers_folder(made):
    """Flux2KleinPipeline.save_pretrained's folder: the configs as saved, the tokenizer's, the folder's scheduler; every
    tensor as diffusers saved it (Qwen3ForCausalLM's decoder without its LM head)."""
    with open_model(made.folder) as ckpt:
        assert ckpt.spec.family == "flux2-klein" and ckpt.layout == "diffusers" and not ckpt.notes
        assert ckpt.spec.transformer == TRANSFORMER and ckpt.spec.text.hidden_size == TEXT_WIDTH
        assert ckpt.spec.text.num_hidden_layers == 28 and ckpt.spec.denoiser == "transformer"
        assert ckpt.spec.scheduler["use_dynamic_shifting"] and ckpt.scheduler_source.startswith("scheduler/")
        assert ckpt.tokenizer().__class__.__name__ == "QwenTokenizer"
        assert ckpt.storage_dtype == torch.float32
        _check_loaded(ckpt, made.raw, made.raw_qwen, _state(_vae()))


def test_is_distilled_picks_the_model(made, tmp_path):
    """model_index.json's is_distilled: true the distilled model, false or missing the base model (diffusers'
    Flux2KleinPipeline default); the KV pipeline's default is the distilled model. A value that is no boolean is
    named."""
    for name, changes, family in (("base", {"is_distilled": False}, "flux2-klein-base"),
                                  ("unsaid", {"is_distilled": None}, "flux2-klein-base"),
                                  ("inpaint", {"_class_name": "Flux2KleinInpaintPipeline"}, "flux2-klein"),
                                  ("kv", {"_class_name": "Flux2KleinKVPipeline", "is_distilled": None}, "flux2-klein")):
        with open_model(_sibling(made.folder, tmp_path / name, **changes)) as ckpt:
            assert ckpt.spec.family == family, name
    odd = _sibling(made.folder, tmp_path / "odd", is_distilled="yes")
    with pytest.raises(CheckpointError, match=r"odd/model_index\.json: is_distilled is 'yes'"):
        open_model(odd)


def test_flux2_dev_folder_is_refused(made, tmp_path):
    """FLUX.2 [dev]'s pipeline (Mistral Small 3.1 as its text encoder) is named, not taken for klein."""
    dev = _sibling(made.folder, tmp_path / "FLUX.2-dev", _class_name="Flux2Pipeline")
    with pytest.raises(CheckpointError, match=r"model_index\.json: Flux2Pipeline is FLUX\.2 \[dev\]: FLUX\.2 \[dev\] "
                                              r"needs the Mistral Small 3\.1 text encoder, which sdlite does not run"):
        open_model(dev)


def test_folder_with_an_untied_lm_head_and_a_flux1_vae(made, tmp_path):
    """A Qwen3ForCausalLM with its own LM head (lm_head.weight, not read); a FLUX.1 autoencoder in vae/ is named."""
    text = _qwen(seed=3, tie_word_embeddings=False)
    folder = _pipeline_folder(tmp_path / "untied", _transformer(), _vae(), text)
    with open_model(folder) as ckpt:
        assert not ckpt.notes
        _same(ckpt.load("text_encoder").state_dict(), _state(text.model), "text_encoder")
    flux1 = diffusers_vae(VAEConfig(latent_channels=16, block_channels=(16, 32), layers_per_block=1, norm_groups=8,
                                    sample_size=32))
    shutil.rmtree(folder / "vae")
    flux1.save_pretrained(folder / "vae")
    with pytest.raises(CheckpointError, match=r"untied/vae: FLUX\.2 VAE: no 'bn\.running_mean' key.*FLUX\.2 decodes "
                                              r"with its own 32-channel VAE \(flux2-vae\.safetensors\)"):
        open_model(folder)


# --- single files and their parts ----------------------------------------------------------------------------------

def test_bfl_file_with_comfyui_parts_beside(made):
    """models/diffusion_models/flux-2-klein-4b.safetensors alone: Qwen3 and the VAE found in models/text_encoders and
    models/vae, each noted; the distilled model (the name does not say base); the bf16 values, exactly."""
    with open_model(made.model) as ckpt:
        assert ckpt.spec.family == "flux2-klein" and ckpt.layout == "original"
        assert ckpt.spec.transformer == TRANSFORMER and ckpt.storage_dtype == torch.bfloat16
        assert sorted(n for n in ckpt.notes if "found beside" in n) == [
            f"Qwen3 text encoder from {QWEN_FILE}, found beside the model",
            f"VAE (flux2-vae.safetensors) from {VAE_FILE}, found beside the model"]
        assert ckpt.detection.family == "flux2-klein" and ckpt.tokenizer().__class__.__name__ == "QwenTokenizer"
        _check_loaded(ckpt, made.transformer, made.qwen, made.vae)


def test_comfyui_prefixed_base_file_with_parts_given(made):
    """ComfyUI's copy (under model.diffusion_model.) of the base model in a folder of its own, its parts given in
    either order: the base model, the same tensors."""
    with open_model(made.alone, text_encoders=[made.vae_file, made.qwen_file]) as ckpt:
        assert ckpt.spec.family == "flux2-klein-base"
        assert not [n for n in ckpt.notes if "found beside" in n]
        assert ckpt.sources["vae"].files == (str(made.vae_file),)
        _check_loaded(ckpt, made.transformer, made.qwen, made.vae)


def test_vae_in_diffusers_names_and_bfls_ae_beside(made, tmp_path):
    """The VAE as diffusers' vae/ holds it (with the batch norm's counter) given as a file; BFL's FLUX.2 repositories'
    ae.safetensors (BFL's names) found beside the model; a FLUX.1 ae.safetensors beside it passed over and named."""
    save_file(made.vae, tmp_path / "diffusion_pytorch_model.safetensors")
    with open_model(made.alone, text_encoders=[made.qwen_file, tmp_path / "diffusion_pytorch_model.safetensors"]) as c:
        _check_loaded(c, made.transformer, made.qwen, made.vae)
    beside = tmp_path / "bfl"
    beside.mkdir()
    (beside / BFL_FILE).symlink_to(made.model)
    save_file(_original_vae(made.vae), beside / "ae.safetensors")
    with open_model(beside / BFL_FILE, text_encoders=[made.qwen_file]) as ckpt:
        assert "VAE (flux2-vae.safetensors) from ae.safetensors, found beside the model" in ckpt.notes
        _check_loaded(ckpt, made.transformer, made.qwen, made.vae)
    save_file(_flux1_vae(), beside / "ae.safetensors")
    with pytest.raises(CheckpointError, match=rf"{BFL_FILE}: the FLUX\.2 \[klein\] model has no VAE "
                                              r"\(flux2-vae\.safetensors\).*ae\.safetensors beside it is not "
                                              r"FLUX\.2's"):
        open_model(beside / BFL_FILE, text_encoders=[made.qwen_file])


def _flux1_vae() -> dict:
    """FLUX.1's ae.safetensors in small: 16 latent channels, LDM names, no latent statistics."""
    vae = _state(diffusers_vae(VAEConfig(latent_channels=16, block_channels=(16, 32), layers_per_block=1,
                                         norm_groups=8, sample_size=32, use_quant_conv=False,
                                         use_post_quant_conv=False)))
    return {k: v.contiguous() for k, v in vae_to_original(vae, prefix="").materialize(vae).items()}


# --- fp8 -----------------------------------------------------------------------------------------------------------

def _dequantized(stored: dict) -> dict:
    """What each tensor of an fp8 file is, in float32: a scaled weight times its scale; scales, input scales, records
    and the marker dropped."""
    out = {}
    for k, v in stored.items():
        if k.endswith((".scale_weight", ".weight_scale", ".input_scale", ".comfy_quant")) or k == "scaled_fp8":
            continue
        layer = k.removesuffix(".weight")
        scale = stored.get(layer + ".scale_weight", stored.get(layer + ".weight_scale"))
        out[k] = v.float() * scale.float() if scale is not None and k.endswith(".weight") else v.float()
    return out


def _with_input_scales(stored: dict) -> dict:
    """ComfyUI's newer scaled files also carry each layer's activation scale (not read)."""
    return {**stored, **{k.removesuffix(".weight_scale") + ".input_scale": torch.ones(()) for k in stored
                         if k.endswith(".weight_scale")}}


@pytest.fixture(scope="module")
def fp8_files(made):
    folder = made.tmp / "fp8"
    folder.mkdir()
    made_files = {"flux-2-klein-4b-fp8.safetensors": _fp8(made.bfl),
                  "flux-2-klein-4b-fp8-scaled.safetensors": _scaled_fp8(made.bfl, mixed=False),
                  "flux-2-klein-4b-fp8-mixed.safetensors": {
                      FLUX2_PREFIX + k: v for k, v in _with_input_scales(_scaled_fp8(made.bfl, mixed=True)).items()}}
    expected = {}
    for name, state in made_files.items():
        save_file(state, folder / name)
        bare = {k.removeprefix(FLUX2_PREFIX): v for k, v in state.items()}
        expected[name] = _canonical(_dequantized(bare))
    qwen = {"model." + k: v for k, v in made.qwen.items()}
    encoders = {"qwen_3_4b_fp8_scaled.safetensors": _scaled_fp8(qwen, mixed=False),
                "qwen_3_4b_fp8_mixed.safetensors": _scaled_fp8(qwen, mixed=True)}
    for name, state in encoders.items():
        save_file(state, folder / name)
        expected[name] = {k.removeprefix("model."): v for k, v in _dequantized(state).items()}
    return SimpleNamespace(folder=folder, expected=expected)


@pytest.mark.parametrize("model,encoder", [
    ("flux-2-klein-4b-fp8.safetensors", "qwen_3_4b_fp8_scaled.safetensors"),
    ("flux-2-klein-4b-fp8-scaled.safetensors", "qwen_3_4b_fp8_mixed.safetensors"),
    ("flux-2-klein-4b-fp8-mixed.safetensors", "qwen_3_4b_fp8_scaled.safetensors")])
def test_fp8_transformer_and_encoder(made, fp8_files, model, encoder):
    """fp8 weights as they are, and ComfyUI's scaled fp8 (a fused qkv's one scale applied to each of q, k and v):
    every tensor the fp8 value times its scale, nothing unexplained left over."""
    assert fp8_files.expected[model]["transformer_blocks.0.attn.to_q.weight"].unique().numel() <= 256
    with open_model(fp8_files.folder / model, text_encoders=[fp8_files.folder / encoder, made.vae_file]) as ckpt:
        assert ckpt.storage_dtype == torch.float8_e4m3fn
        assert not [n for n in ckpt.notes if "not understood" in n]
        _check_loaded(ckpt, fp8_files.expected[model], fp8_files.expected[encoder], made.vae)


def test_a_per_channel_scale_is_named(made, tmp_path):
    state = _scaled_fp8(made.bfl, mixed=True)
    state["single_blocks.0.linear2.weight_scale"] = torch.ones(128)
    save_file(state, tmp_path / "per-channel.safetensors")
    with pytest.raises(CheckpointError, match=r"per-channel\.safetensors: tensor 'single_blocks\.0\.linear2\."
                                              r"weight_scale': a weight scale of shape \[128\]: only per-tensor "
                                              r"scales"):
        open_model(tmp_path / "per-channel.safetensors", text_encoders=[made.qwen_file, made.vae_file])


# --- GGUF ----------------------------------------------------------------------------------------------------------

def _city96(name: str, t: torch.Tensor) -> str:
    """city96's tools on a FLUX.2 file: vectors and small tensors F32, the blocks' matrices Q8_0, the rest BF16."""
    if t.ndim == 1 or t.numel() <= 1024:
        return "F32"
    return "Q8_0" if name.startswith(("double_blocks.", "single_blocks.")) and t.ndim == 2 else "BF16"


def _qwen3_fields(writer) -> None:
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


@pytest.fixture(scope="module")
def gguf_files(made):
    """models/diffusion_models/flux-2-klein-4b-Q8_0.gguf and models/clip/Qwen3-4B-Q4_K_M.gguf (ComfyUI's older folder
    for text encoders), the VAE in models/vae."""
    models = made.tmp / "gguf" / "models"
    for sub in ("diffusion_models", "clip", "vae"):
        (models / sub).mkdir(parents=True)
    (models / "vae" / VAE_FILE).symlink_to(made.vae_file)
    stored = _write_gguf(models / "diffusion_models" / "flux-2-klein-4b-Q8_0.gguf", _bf16(made.bfl), "flux2", _city96,
                         lambda w: w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0))
    names = {k: llama_cpp_name(k) for k in made.qwen}
    text = _write_gguf(models / "clip" / "Qwen3-4B-Q4_K_M.gguf", {names[k]: v for k, v in made.qwen.items()}, "qwen3",
                       _llama_cpp_q4_k_m, _qwen3_fields)
    return SimpleNamespace(model=models / "diffusion_models" / "flux-2-klein-4b-Q8_0.gguf",
                           transformer=_canonical(stored), qwen={k: text[names[k]] for k in made.qwen})


def test_gguf_transformer_and_encoder(made, gguf_files):
    """city96's GGUF with llama.cpp's Qwen3 GGUF found beside it: dequantised, the values the files hold; kept in
    memory, the transformer's block Linears (q, k and v cut from the fused Q8_0 qkv by whole rows) and every Linear of
    the encoder stay in their block formats."""
    from sdlite.engine.lowbit import LowBitLinear
    from sdlite.engine.memory import ModelManager

    ckpt = open_model(gguf_files.model)
    assert sum("found beside" in n for n in ckpt.notes) == 2 and ckpt.spec.family == "flux2-klein"
    _check_loaded(ckpt, gguf_files.transformer, gguf_files.qwen, made.vae)
    manager = ModelManager(ckpt, mode=1)
    for name, count, qtypes in (("transformer", 14, {"Q8_0"}), ("text_encoder", 28 * 7, {"Q8_0", "Q4_K"})):
        with manager.use(name) as network:
            low = [m for m in network.modules() if isinstance(m, LowBitLinear)]
            assert len(low) == count and {m.qtype for m in low} == qtypes, name
    ckpt.close()


def test_memory_mode_0_streams_flux2_blocks(made):
    """Memory mode 0 builds the transformer with no resident block weights and materialises one double or single block
    at a time; the output is the whole network's."""
    from sdlite.engine.memory import ModelManager, stream_units
    from sdlite.models.flux2 import DoubleBlock, SingleBlock

    with open_model(made.model) as ckpt:
        whole = ckpt.load("transformer")
        units = dict(stream_units(whole))
        assert isinstance(units["transformer_blocks.0"], DoubleBlock)
        assert isinstance(units["single_transformer_blocks.0"], SingleBlock)
        g = torch.Generator().manual_seed(0)
        x, ctx = torch.randn(1, 32, 2, 4, generator=g), torch.randn(1, 3, 3 * TEXT_WIDTH, generator=g)
        with torch.no_grad():
            expected = whole(x, torch.tensor([0.5]), ctx)
            with ModelManager(ckpt, mode=0).use("transformer") as streamed:
                assert all(p.is_meta for p in streamed.transformer_blocks.parameters())
                got = streamed(x, torch.tensor([0.5]), ctx)
        assert torch.equal(got, expected)


# --- what is missing or wrong, named -------------------------------------------------------------------------------

def _qwen_file(path: Path, **config) -> Path:
    """A Qwen3 text encoder file in ComfyUI's form (bf16, under ``model.``) of another config than the model's."""
    save_file(_bf16({"model." + k: v for k, v in _state(_qwen(seed=5, **config).model).items()}), path)
    return path


def test_a_missing_part_is_named(made):
    with pytest.raises(CheckpointError, match=r"flux-2-klein-base-4b\.safetensors: the FLUX\.2 \[klein\] model has no "
                                              r"VAE \(flux2-vae\.safetensors\): the file holds none and none was given "
                                              r"\(--text-encoder PATH"):
        open_model(made.alone, text_encoders=[made.qwen_file])
    with pytest.raises(CheckpointError, match=r"has no Qwen3 text encoder: the file holds none"):
        open_model(made.alone, text_encoders=[made.vae_file])


def test_a_qwen3_of_another_width_is_named(made, tmp_path):
    wide = _qwen_file(tmp_path / "qwen_3_8b.safetensors", hidden_size=64, vocab_size=1000)
    with pytest.raises(CheckpointError, match=r"qwen_3_8b\.safetensors: the text encoder's width 64 \(x 3 hidden "
                                              r"states = 192\) is not the text width 96 of the transformer "
                                              r"\(flux-2-klein-base-4b\.safetensors\)"):
        open_model(made.alone, text_encoders=[wide, made.vae_file])


def test_release_widths_name_their_qwen3(made, tmp_path):
    """At a release's width the message names the Qwen3 the model reads and its file: klein 9B's encoder given to
    a 4B."""
    from sdlite.weights.flux2 import _check_parts

    text = QWEN3_8B
    with pytest.raises(CheckpointError, match=r"qwen_3_8b\.safetensors: the text encoder's width 4096 .* FLUX\.2 "
                                              r"\[klein\] 4B reads Qwen3-4B \(2560 wide\), qwen_3_4b\.safetensors"):
        _check_parts(FLUX2_KLEIN_4B, Flux2VAEConfig(), text, tmp_path / BFL_FILE,
                     {"text_encoder": tmp_path / "qwen_3_8b.safetensors"})


def test_a_flux1_vae_given_is_refused(made, tmp_path):
    save_file(_flux1_vae(), tmp_path / "ae.safetensors")
    with pytest.raises(CheckpointError, match=r"ae\.safetensors: a VAE with 16 latent channels and no latent "
                                              r"statistics \('bn\.running_mean'\): FLUX\.1's or SD's autoencoder, not "
                                              r"FLUX\.2's\. FLUX\.2 decodes with its own 32-channel VAE "
                                              r"\(flux2-vae\.safetensors\)"):
        open_model(made.alone, text_encoders=[made.qwen_file, tmp_path / "ae.safetensors"])


def test_a_flux2_vae_of_other_channels_is_named(made, tmp_path):
    other = dataclasses.replace(VAE, latent_channels=16)
    save_file(_original_vae(_state(_vae(other))), tmp_path / "flux2-vae-16.safetensors")
    with pytest.raises(CheckpointError, match=r"flux2-vae-16\.safetensors: the VAE's 16 latent channels \(x 4 in a 2x2 "
                                              r"patch\) are not the 32 token values"):
        open_model(made.alone, text_encoders=[made.qwen_file, tmp_path / "flux2-vae-16.safetensors"])


def test_flux2_dev_file_is_refused(made, tmp_path):
    """FLUX.2 [dev]'s transformer (its guidance embedding), with or without parts given, is named."""
    dev = dataclasses.replace(TRANSFORMER, guidance_embeds=True)
    save_file(_bf16(_bfl(_state(_transformer(dev)))), tmp_path / "flux2-dev.safetensors")
    for given in ((), (made.qwen_file, made.vae_file)):
        with pytest.raises(CheckpointError, match=r"flux2-dev\.safetensors: a FLUX\.2 \[dev\] transformer \(a guidance "
                                                  r"embedding\): FLUX\.2 \[dev\] needs the Mistral Small 3\.1 text "
                                                  r"encoder, which sdlite does not run"):
            open_model(tmp_path / "flux2-dev.safetensors", text_encoders=given)


def test_a_missing_transformer_tensor_is_named_as_the_file_names_it(made, tmp_path):
    """q, k and v are one fused tensor in BFL's file: a missing one is named so, bare and under ComfyUI's prefix."""
    for prefix in ("", FLUX2_PREFIX):
        path = tmp_path / f"broken{len(prefix)}.safetensors"
        save_file({prefix + k: v for k, v in _bf16(made.bfl).items() if k != "double_blocks.0.img_attn.qkv.weight"},
                  path)
        with pytest.raises(CheckpointError, match=rf"{path.name}: tensor '{prefix}double_blocks\.0\.img_attn\.qkv"
                                                  r"\.weight': 1 FLUX\.2 transformer tensor is missing"):
            open_model(path, text_encoders=[made.qwen_file, made.vae_file])


def test_a_file_of_no_part_is_named(made, tmp_path):
    """The transformer itself, or FLUX.1's T5, given as a part: named, with its first key."""
    t5 = tmp_path / "t5xxl.safetensors"
    save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(8, 8)}, t5)
    for wrong, first in ((made.model, ""), (t5, "encoder.block.0.layer.0.SelfAttention.q.weight")):
        with pytest.raises(CheckpointError, match=rf"{wrong.name}: not a file FLUX\.2 \[klein\] takes beside its "
                                                  rf"transformer .*; the first key is '{first}"):
            open_model(made.alone, text_encoders=[made.qwen_file, made.vae_file, wrong])
