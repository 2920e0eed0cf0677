"""FLUX.2 [klein] from GGUF files against diffusers' Flux2KleinPipeline (issue 53): the transformer as city96's tools
write it (BFL's names; the blocks' matrices Q8_0, other matrices BF16, vectors F32), Qwen3 as llama.cpp writes a Q8_0
(llama.cpp's names; every matrix Q8_0, the token embedding included), the VAE as ``flux2-vae.safetensors``, opened
with ``Engine.load(model, text_encoders=[qwen, vae], precision="exact")``. The reference is the same tiny pipeline
with the values the files hold (the gguf package's own dequantisation, mapped back to diffusers' names) loaded into
its transformer and text encoder.

Shapes: a single file implies the releases' 128-wide heads (their rotary split leaves no trace in the weights) and
the VAE's 32 norm groups, so the tiny model is tests/test_flux2_files.py's (1 double and 1 single block, one head of
128; Qwen3 32 wide with 28 layers, its MLP 256 wide) with test_flux2_pipeline.py's sharpened attention and
high-contrast VAE (here four levels 32 wide, for the 16x downscale of the releases). ``--compile`` on the same files
runs each quantized Linear eager between the compiled pieces and gives eager's latents to fp32 rounding."""
from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdlite.engine import compile as compile_module
from sdlite.pipeline import Engine, Request
from sdlite.weights.qwen_keys import llama_cpp_name
from tests.test_flux2_files import (QWEN, TRANSFORMER, _bf16, _bfl, _canonical, _city96, _original_vae, _qwen3_fields,
                                    _rounded, _state)
from tests.test_flux2_pipeline import MAX_PIXEL_DIFF, PROMPT, _image, _pipeline, _pixels, _reference
from tests.test_zimage_files import _write_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VAE = dict(in_channels=3, out_channels=3, block_out_channels=(32, 32, 32, 32), layers_per_block=1,
           latent_channels=8, norm_num_groups=32, sample_size=64, use_quant_conv=True, use_post_quant_conv=True,
           batch_norm_eps=1e-4)
MODEL_FILE, QWEN_FILE, VAE_FILE = "flux-2-klein-4b-Q8_0.gguf", "Qwen3-4B-Q8_0.gguf", "flux2-vae.safetensors"


def _llama_cpp_q8_0(name: str, t: torch.Tensor) -> str:
    """llama.cpp's Q8_0 of Qwen3: vectors F32, every matrix (the token embedding too) Q8_0."""
    return "F32" if t.ndim == 1 else "Q8_0"


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    """From the tiny pipeline (fp32), its GGUF files and VAE file: the pipeline with the files' values (bf16 rounding
    and Q8_0 included), the pipeline with the files' bf16 source (bf16 rounding alone), the engine on the files, and
    the files' paths (transformer, Qwen3, VAE)."""
    from diffusers import Flux2KleinPipeline

    tmp = tmp_path_factory.mktemp("flux2-gguf")
    transformer = {k: v for k, v in TRANSFORMER.to_diffusers().items() if not k.startswith("_")}
    pipe = _pipeline(tmp / "klein", transformer=transformer, qwen=QWEN, vae=VAE)
    (tmp / "unet").mkdir()
    (tmp / "parts").mkdir()
    model, text, vae = tmp / "unet" / MODEL_FILE, tmp / "parts" / QWEN_FILE, tmp / "parts" / VAE_FILE
    stored = _write_gguf(model, _bf16(_bfl(_state(pipe.transformer))), "flux2", _city96,
                         lambda w: w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0))
    names = {k: llama_cpp_name(k) for k in pipe.text_encoder.model.state_dict()}
    held = _write_gguf(text, {names[k]: v for k, v in _bf16(_state(pipe.text_encoder.model)).items()}, "qwen3",
                       _llama_cpp_q8_0, lambda w: (_qwen3_fields(w), w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)))
    save_file(_original_vae(_state(pipe.vae)), vae)

    def with_values(transformer_state: dict, text_state: dict):
        network, encoder = copy.deepcopy(pipe.transformer), copy.deepcopy(pipe.text_encoder)
        network.load_state_dict(transformer_state, strict=True)
        encoder.model.load_state_dict(text_state, strict=True)
        out = Flux2KleinPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=encoder,
                                 tokenizer=pipe.tokenizer, transformer=network, is_distilled=True)
        out.set_progress_bar_config(disable=True)
        return out

    quantized = with_values(_canonical(stored), {k: held[names[k]] for k in names})
    source = with_values(_rounded(_state(pipe.transformer)), _rounded(_state(pipe.text_encoder.model)))
    engine = Engine.load(model, text_encoders=[text, vae], precision="exact")
    return quantized, source, engine, (model, text, vae)


def test_gguf_q8_0_txt2img_matches_pipeline_on_the_files_values(klein):
    """Batch 2 at 64 x 64, 4 steps without guidance: within 2/255 of diffusers run on the dequantised values. Q8_0
    itself moves the tiny model's image far past that bar (measured: 162/255 at most, 19 on average, against the
    bf16 weights it was quantised from), so an engine that ran the un-quantised weights would fail it."""
    quantized, source, engine, _ = klein
    assert engine.spec.family == "flux2-klein"
    kw = dict(prompt=PROMPT, height=64, width=64, num_inference_steps=4, num_images_per_prompt=2)
    expected = _reference(quantized, generator=[torch.Generator().manual_seed(s) for s in (7, 8)], **kw)
    got = _pixels(engine.generate(Request(prompt=PROMPT, steps=4, cfg_scale=1.0, seed=7, batch_size=2, width=64,
                                          height=64, sampler="euler")).images)
    assert got.shape == expected.shape == (2, 64, 64, 3)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert got.std() > 10, "the images should not be flat"
    unquantized = _reference(source, generator=[torch.Generator().manual_seed(s) for s in (7, 8)], **kw)
    assert np.abs(got - unquantized).max() > 10 * MAX_PIXEL_DIFF, "Q8_0 should change the image"


def test_gguf_q8_0_edit_matches_pipeline(klein):
    """One reference image of another size than the output; the reference changes the image (so a run that dropped
    it would fail the bar)."""
    quantized, _, engine, _ = klein
    ref = _image(80, 72, 1)
    expected = _reference(quantized, prompt=PROMPT, image=[ref], height=64, width=96, num_inference_steps=3,
                          generator=torch.Generator().manual_seed(5))
    got = _pixels(engine.generate(Request(prompt=PROMPT, reference_images=(ref,), steps=3, cfg_scale=1.0, seed=5,
                                          width=96, height=64, sampler="euler")).images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    plain = _pixels(engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, seed=5, width=96, height=64,
                                            sampler="euler")).images)
    assert np.abs(got - plain).max() > 2 * MAX_PIXEL_DIFF, "the reference should change the image"


def test_the_engine_keeps_the_linears_quantized(klein):
    """The transformer's block Linears and every Linear of Qwen3 stay Q8_0 in memory."""
    from sdlite.engine.lowbit import LowBitLinear

    _, _, engine, _ = klein
    for name, count in (("transformer", 14), ("text_encoder", 28 * 7)):
        with engine.models.use(name) as network:
            low = [m for m in network.modules() if isinstance(m, LowBitLinear)]
            assert len(low) == count and {m.qtype for m in low} == {"Q8_0"}, name


@pytest.mark.skipif(compile_module.unavailable() is not None, reason="no C++ compiler for Inductor here")
def test_compiled_gguf_transformer_runs_its_quantized_layers_eager(klein, tmp_path, monkeypatch):
    """``--compile`` on the GGUF transformer: each LowBitLinear runs eager between the compiled pieces (Dynamo breaks
    the graph around it), and the latents are eager's to fp32 rounding (exact: fp32 compute; the bound as
    tests/test_compile.py's, 1e-4 of the largest magnitude)."""
    from sdlite.engine.lowbit import LowBitLinear

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _, _, eager, (model, text, vae) = klein
    compiled = Engine.load(model, text_encoders=[text, vae], precision="exact", compile=True)
    request = Request(prompt=PROMPT, steps=2, cfg_scale=1.0, seed=3, width=64, height=64, sampler="euler")
    got, ref = compiled.generate(request).latents, eager.generate(request).latents
    transformer = compiled.models.get("transformer")
    runner = compiled.models.runner("transformer", transformer)
    assert isinstance(runner, compile_module.Compiled) and runner.failed is None
    low = [m for m in transformer.modules() if isinstance(m, LowBitLinear)]
    assert len(low) == 14 and all("forward" in vars(m) for m in low)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
