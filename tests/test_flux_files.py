"""FLUX.1 in the files people have, against diffusers' FluxPipeline on the same tiny random weights: BFL's
transformer-only file with ``ae.safetensors``, ComfyUI's ``clip_l.safetensors`` and a T5 file given or found beside it,
ComfyUI's all-in-one checkpoint, a T5 stored in fp8, and the errors for what is missing or wrong."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdlite.config import TextEncoderConfig
from sdlite.errors import CheckpointError
from sdlite.loader import open_model
from sdlite.pipeline import Engine, Request
from sdlite.weights.flux_keys import flux_to_original
from sdlite.weights.vae_keys import vae_to_original
from tests.test_flux_pipeline import MAX_PIXEL_DIFF, PROMPT, SIZE, _pipeline, _pixels, _reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# what the shapes of a file must show as the releases have it: CLIP heads 64 wide, transformer heads 128 wide (their
# rotary split is the releases' 16/56/56)
TEXT_L = TextEncoderConfig(width=64, layers=2, heads=1, mlp_width=48, projection_dim=64)
TRANSFORMER = dict(attention_head_dim=128, num_attention_heads=1, pooled_projection_dim=64, axes_dims_rope=(16, 56, 56))
CLIP_L, T5 = "text_encoders.clip_l.transformer.", "text_encoders.t5xxl.transformer."


def _state(module) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}


def _converted(plan, state: dict) -> dict:
    return {k: v.clone().contiguous() for k, v in plan.materialize(state).items()}


def _parts(pipe) -> dict:
    """The pipeline's networks as the separate files hold them."""
    transformer, vae = _state(pipe.transformer), _state(pipe.vae)
    t5 = {k: v for k, v in _state(pipe.text_encoder_2).items() if k != "encoder.embed_tokens.weight"}
    return {"transformer": _converted(flux_to_original(transformer), transformer),
            "vae": _converted(vae_to_original(vae, prefix=""), vae),
            "clip_l": {k if k.startswith("text_model.") else "text_model." + k: v   # as ComfyUI's clip_l holds it
                       for k, v in _state(pipe.text_encoder).items()}, "t5": t5}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux-files")
    pipe = _pipeline(tmp, "dev", text_l=TEXT_L, save=False, **TRANSFORMER)
    parts = _parts(pipe)
    beside = tmp / "beside"
    beside.mkdir()
    save_file(parts["transformer"], beside / "flux1-dev.safetensors")
    save_file(parts["vae"], beside / "ae.safetensors")
    save_file(parts["clip_l"], beside / "clip_l.safetensors")
    save_file(parts["t5"], beside / "t5xxl_fp16.safetensors")
    aio = {**{"model.diffusion_model." + k: v for k, v in parts["transformer"].items()},
           **{"vae." + k: v for k, v in parts["vae"].items()},
           **{CLIP_L + k: v for k, v in parts["clip_l"].items()}, **{T5 + k: v for k, v in parts["t5"].items()}}
    save_file(aio, tmp / "flux1-dev-aio.safetensors")
    alone = tmp / "alone"
    alone.mkdir()
    save_file(parts["transformer"], alone / "flux1-dev.safetensors")
    expected = _reference(pipe, "dev", prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5,
                          generator=torch.Generator().manual_seed(6))
    return pipe, parts, tmp, expected


def _run(path, **kw) -> np.ndarray:
    engine = Engine.load(path, precision="exact", **kw)
    return _pixels(engine.generate(Request(prompt=PROMPT, steps=3, cfg_scale=1.0, sampler="euler", seed=6,
                                           width=SIZE, height=SIZE)).images)


def test_bfl_file_with_its_parts_beside(files):
    _, _, tmp, expected = files
    ckpt = open_model(tmp / "beside" / "flux1-dev.safetensors")
    assert ckpt.spec.family == "flux-dev" and ckpt.layout == "original"
    assert sum("found beside the model" in n for n in ckpt.notes) == 3
    assert np.abs(_run(tmp / "beside" / "flux1-dev.safetensors") - expected).max() <= MAX_PIXEL_DIFF


def test_bfl_file_with_its_parts_given(files):
    _, _, tmp, expected = files
    b = tmp / "beside"
    got = _run(tmp / "alone" / "flux1-dev.safetensors",
               text_encoders=[b / "t5xxl_fp16.safetensors", b / "clip_l.safetensors", b / "ae.safetensors"])
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


def test_comfyui_all_in_one(files):
    _, _, tmp, expected = files
    ckpt = open_model(tmp / "flux1-dev-aio.safetensors")
    assert ckpt.spec.family == "flux-dev" and not ckpt.notes
    assert np.abs(_run(tmp / "flux1-dev-aio.safetensors") - expected).max() <= MAX_PIXEL_DIFF


def test_fp8_t5(files, tmp_path):
    """T5 stored in float8_e4m3fn (ComfyUI's t5xxl_fp8_e4m3fn): computed from the fp8 values, as a pipeline with those
    values in fp32 draws."""
    pipe, parts, tmp, _ = files
    b = tmp / "beside"
    fp8 = {k: (v.to(torch.float8_e4m3fn) if v.ndim == 2 else v) for k, v in parts["t5"].items()}
    save_file(fp8, tmp_path / "t5xxl_fp8_e4m3fn.safetensors")
    with torch.no_grad():
        for k, p in pipe.text_encoder_2.named_parameters():
            if k in fp8:
                p.copy_(fp8[k].float())
    expected = _reference(pipe, "dev", prompt=PROMPT, num_inference_steps=3, guidance_scale=3.5,
                          generator=torch.Generator().manual_seed(6))
    got = _run(tmp / "alone" / "flux1-dev.safetensors",
               text_encoders=[tmp_path / "t5xxl_fp8_e4m3fn.safetensors", b / "clip_l.safetensors", b / "ae.safetensors"])
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF


def test_what_is_missing_or_wrong_is_named(files, tmp_path):
    _, parts, tmp, _ = files
    b = tmp / "beside"
    with pytest.raises(CheckpointError, match="has no CLIP-L"):
        open_model(tmp / "alone" / "flux1-dev.safetensors",
                   text_encoders=[b / "t5xxl_fp16.safetensors", b / "ae.safetensors"])
    with pytest.raises(CheckpointError, match="has no VAE"):
        open_model(tmp / "alone" / "flux1-dev.safetensors",
                   text_encoders=[b / "t5xxl_fp16.safetensors", b / "clip_l.safetensors"])
    with pytest.raises(CheckpointError, match="given twice"):
        open_model(tmp / "alone" / "flux1-dev.safetensors",
                   text_encoders=[b / "clip_l.safetensors", b / "clip_l.safetensors"])
    with pytest.raises(CheckpointError, match="no such file"):
        open_model(tmp / "alone" / "flux1-dev.safetensors", text_encoders=[tmp_path / "nope.safetensors"])
    broken = dict(parts["transformer"])
    del broken["single_blocks.0.linear1.weight"]
    save_file(broken, tmp_path / "broken.safetensors")
    for name in ("ae.safetensors", "clip_l.safetensors", "t5xxl_fp16.safetensors"):
        (tmp_path / name).symlink_to(b / name)
    with pytest.raises(CheckpointError, match=r"single_blocks\.0\.linear1\.weight"):
        Engine.load(tmp_path / "broken.safetensors", precision="exact")
