"""SD3 in the files people have, against diffusers' StableDiffusion3Pipeline on the same tiny random weights: Stability's
single file with the text encoders inside, the same without them beside ComfyUI's separate encoder files (given, or
found beside the model), a T5 stored in fp8 (e4m3fn, and ComfyUI's "scaled fp8"), and the errors for what is missing
or wrong."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sdlite.config import TextEncoderConfig
from sdlite.errors import CheckpointError
from sdlite.loader import open_model
from sdlite.pipeline import Engine, Request
from sdlite.weights.mmdit_keys import mmdit_to_original
from sdlite.weights.vae_keys import vae_to_original
from tests.test_sd3_pipeline import MAX_PIXEL_DIFF, NEGATIVE, PROMPT, SIZE, _pipeline, _pixels, _reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the towers of a single file must have heads 64 wide (the shapes imply them, as for every real CLIP); bigG's GELU is
# told by its 1280 width, so this small one keeps CLIP-L's activation
TEXT_L = TextEncoderConfig(width=64, layers=2, heads=1, mlp_width=48, projection_dim=32)
TEXT_G = TextEncoderConfig(width=128, layers=2, heads=2, mlp_width=64, pad_token_id=0, eos_token_id=2,
                           projection_dim=24)
T5_WIDTH = 192   # the joint context holds both towers' 64 + 128 channels

CLIP_L, CLIP_G, T5 = "text_encoders.clip_l.transformer.", "text_encoders.clip_g.transformer.", \
    "text_encoders.t5xxl.transformer."


def _state(module) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}


def _converted(plan, state: dict) -> dict:
    return {k: v.clone().contiguous() for k, v in plan.materialize(state).items()}


def _t5_state(t5) -> dict:
    return {k: v for k, v in _state(t5).items() if k != "encoder.embed_tokens.weight"}   # tied to shared.weight


def _single_file_parts(pipe) -> dict:
    """The pipeline's networks in Stability's single-file names, each part under its prefix."""
    transformer = _state(pipe.transformer)
    vae = _state(pipe.vae)
    return {
        "transformer": _converted(mmdit_to_original(transformer), transformer),
        "vae": _converted(vae_to_original(vae), vae),
        "clip_l": {CLIP_L + k: v for k, v in _state(pipe.text_encoder).items()},
        "clip_g": {CLIP_G + k: v for k, v in _state(pipe.text_encoder_2).items()},
        "t5": {T5 + k: v for k, v in _t5_state(pipe.text_encoder_3).items()},
    }


def _fp8(t5: dict, scaled: bool) -> dict:
    """A T5 state as an fp8 file stores it: each matrix in float8_e4m3fn, as it is (``scaled=False``) or divided by a
    per-tensor scale kept beside it as ``<name>.scale_weight`` (ComfyUI's "scaled fp8", with its ``scaled_fp8``
    marker); the norms' vectors as they were."""
    out = {}
    for k, v in t5.items():
        if v.ndim != 2 or (scaled and k == "shared.weight"):
            out[k] = v
        elif scaled:
            scale = v.abs().max() / 448.0
            out[k] = (v / scale).to(torch.float8_e4m3fn)
            out[k.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
        else:
            out[k] = v.to(torch.float8_e4m3fn)
    if scaled:
        out["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    return out


def _as_stored(pipe, stored: dict):
    """``pipe`` with its T5 weights replaced by what ``stored`` (an fp8 T5 state) holds, in float32."""
    with torch.no_grad():
        for k, p in pipe.text_encoder_3.named_parameters():
            v = stored[k]
            scale = stored.get(k.removesuffix(".weight") + ".scale_weight")
            p.copy_(v.float() * scale.float() if scale is not None else v.float())
    return pipe


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd3-files")
    pipe = _pipeline(tmp, text_l=TEXT_L, text_g=TEXT_G, t5_width=T5_WIDTH)
    parts = _single_file_parts(pipe)
    save_file({**parts["transformer"], **parts["vae"], **parts["clip_l"], **parts["clip_g"], **parts["t5"]},
              str(tmp / "sd3.5_medium_incl_clips_t5.safetensors"))
    alone = tmp / "checkpoints"
    alone.mkdir()
    save_file({**parts["transformer"], **parts["vae"]}, str(alone / "sd3.5_medium.safetensors"))
    encoders = tmp / "text_encoders"   # ComfyUI's models/text_encoders beside models/checkpoints
    encoders.mkdir()
    save_file({k[len(CLIP_L):]: v for k, v in parts["clip_l"].items()}, str(encoders / "clip_l.safetensors"))
    save_file({k[len(CLIP_G):]: v for k, v in parts["clip_g"].items()}, str(encoders / "clip_g.safetensors"))
    t5 = {k[len(T5):]: v for k, v in parts["t5"].items()}
    save_file(t5, str(encoders / "t5xxl_fp16.safetensors"))
    fp8 = tmp / "fp8"
    fp8.mkdir()
    save_file(_fp8(t5, scaled=False), str(fp8 / "t5xxl_fp8_e4m3fn.safetensors"))
    save_file(_fp8(t5, scaled=True), str(fp8 / "t5xxl_fp8_e4m3fn_scaled.safetensors"))
    return pipe, tmp, alone, encoders, fp8


def _generate(engine, seed=4):
    return engine.generate(Request(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, cfg_scale=4.0, sampler="euler",
                                   seed=seed, width=SIZE, height=SIZE))


def _expected(pipe, seed=4):
    return _reference(pipe, prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=3, guidance_scale=4.0,
                      generator=torch.Generator().manual_seed(seed))


def test_single_file_with_the_encoders_inside(files):
    pipe, tmp, _, _, _ = files
    ckpt = open_model(tmp / "sd3.5_medium_incl_clips_t5.safetensors")
    assert ckpt.spec.family == "sd3.5-medium" and ckpt.layout == "original" and not ckpt.problems()
    assert set(ckpt.sources) == {"text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"}
    engine = Engine.load(ckpt, precision="exact")
    assert np.abs(_pixels(_generate(engine).images) - _expected(pipe)).max() <= MAX_PIXEL_DIFF


def test_single_file_with_separate_encoders_given_or_beside(files):
    pipe, _, alone, encoders, _ = files
    expected = _expected(pipe)
    given = Engine.load(alone / "sd3.5_medium.safetensors", precision="exact",
                        text_encoders=[encoders / "clip_g.safetensors", encoders / "t5xxl_fp16.safetensors",
                                       encoders / "clip_l.safetensors"])
    assert np.abs(_pixels(_generate(given).images) - expected).max() <= MAX_PIXEL_DIFF
    beside = open_model(alone / "sd3.5_medium.safetensors")   # ComfyUI's models/text_encoders
    assert {"text_encoder", "text_encoder_2", "text_encoder_3"} <= set(beside.sources)
    assert any("found beside the model" in n for n in beside.notes)


@pytest.mark.parametrize("name", ["t5xxl_fp8_e4m3fn.safetensors", "t5xxl_fp8_e4m3fn_scaled.safetensors"])
def test_an_fp8_t5(files, name, tmp_path):
    """An fp8 T5 computes in the compute dtype from its stored values (times the scales of a scaled file): the
    reference is diffusers' pipeline with its T5 weights set to those values."""
    from safetensors.torch import load_file

    _, _, alone, encoders, fp8 = files
    engine = Engine.load(alone / "sd3.5_medium.safetensors", precision="exact",
                         text_encoders=[encoders / "clip_l.safetensors", encoders / "clip_g.safetensors", fp8 / name])
    got = _pixels(_generate(engine, seed=6).images)
    reference = _as_stored(_pipeline(tmp_path, text_l=TEXT_L, text_g=TEXT_G, t5_width=T5_WIDTH),
                           load_file(str(fp8 / name)))
    assert np.abs(got - _expected(reference, seed=6)).max() <= MAX_PIXEL_DIFF


def test_what_is_missing_or_wrong_is_named(files, tmp_path):
    _, tmp, alone, encoders, _ = files
    lonely = tmp_path / "sd3.5_medium.safetensors"
    lonely.write_bytes((alone / "sd3.5_medium.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="no CLIP-L text encoder.*--text-encoder"):
        open_model(lonely)
    with pytest.raises(CheckpointError, match="no such file"):
        open_model(lonely, text_encoders=[tmp_path / "clip_l.safetensors"])
    with pytest.raises(CheckpointError, match="CLIP-L .* given twice"):
        open_model(tmp / "sd3.5_medium_incl_clips_t5.safetensors", text_encoders=[encoders / "clip_l.safetensors"])
    # only T5 given: the CLIP towers are still missing
    with pytest.raises(CheckpointError, match="no CLIP-L"):
        open_model(lonely, text_encoders=[encoders / "t5xxl_fp16.safetensors"])
