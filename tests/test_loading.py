"""Loading real layouts: diffusers folders written by diffusers itself (fp32 and the fp16 variant), and our
single-file export read back by diffusers' own single-file loader. Outputs are compared with the reference."""
from __future__ import annotations

import os

import pytest
import torch

from sdlite.export import save_diffusers, save_single_file
from sdlite.loader import load_model, open_model
from tests.reference import diffusers_pipeline, max_rel_err

TOL = 1e-4
PROMPTS = ["a red circle on a blue background", "", "an astronaut riding a horse, (masterpiece:1.2), 8k"]


def _inputs(unet_cfg, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, unet_cfg.in_channels, 8, 8, generator=g)
    ctx = torch.randn(2, 77, unet_cfg.context_dim, generator=g)
    z = torch.randn(1, 4, 8, 8, generator=g)
    return x, torch.tensor([999.0, 250.0]), ctx, z


def assert_same_outputs(ours, pipe, tol=TOL):
    """Each of our components gives the reference component's output on the same inputs."""
    ids = pipe.tokenizer(PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    assert torch.equal(ours.tokenizer(PROMPTS), ids)
    x, t, ctx, z = _inputs(ours.spec.unet)
    with torch.no_grad():
        assert max_rel_err(ours.text_encoder(ids), pipe.text_encoder(ids).last_hidden_state) <= tol
        assert max_rel_err(ours.unet(x, t, ctx), pipe.unet(x, t, encoder_hidden_states=ctx).sample) <= tol
        assert max_rel_err(ours.vae.decode(z), pipe.vae.decode(z).sample) <= tol


@pytest.mark.parametrize("family", ["sd1", "sd2", "sd1-inpaint"])
def test_diffusers_folder_fp32(tmp_path, family):
    pipe = diffusers_pipeline(family, tmp_path)
    pipe.save_pretrained(tmp_path / "model")
    before = sorted(os.listdir(tmp_path / "model"))
    ours = load_model(tmp_path / "model")
    assert ours.spec.family == family
    assert ours.checkpoint.layout == "diffusers"
    assert ours.checkpoint.storage_dtype == torch.float32
    assert ours.checkpoint.tokenizer_dir is not None  # the folder's own tokenizer files are used
    assert ours.tokenizer.pad_token_id == (0 if family == "sd2" else 49407)
    assert_same_outputs(ours, pipe)
    assert sorted(os.listdir(tmp_path / "model")) == before  # nothing written next to the user's model


def test_diffusers_folder_fp16_variant(tmp_path):
    from diffusers import StableDiffusionPipeline

    diffusers_pipeline("sd1", tmp_path).to(torch.float16).save_pretrained(tmp_path / "model", variant="fp16")
    assert (tmp_path / "model" / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    ref = StableDiffusionPipeline.from_pretrained(tmp_path / "model", variant="fp16", dtype=torch.float32,
                                                  local_files_only=True)
    ckpt = open_model(tmp_path / "model")
    assert ckpt.storage_dtype == torch.float16
    ours = load_model(tmp_path / "model", dtype=torch.float32)
    assert ours.unet.dtype == torch.float32
    assert_same_outputs(ours, ref)
    # straight into half precision: the weights are the stored ones, bit for bit
    half = load_model(tmp_path / "model", dtype=torch.float16)
    key = "down_blocks.0.resnets.0.conv1.weight"
    assert half.unet.state_dict()[key].dtype == torch.float16
    assert torch.equal(half.unet.state_dict()[key], ref.unet.state_dict()[key].half())


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_single_file_export_read_by_diffusers(tmp_path, family):
    """Our original-layout export, converted by diffusers' own single-file loader, gives the same outputs."""
    from diffusers import StableDiffusionPipeline

    pipe = diffusers_pipeline(family, tmp_path)
    pipe.save_pretrained(tmp_path / "model")
    ours = load_model(tmp_path / "model")
    path = save_single_file(ours, tmp_path / "model.safetensors")
    ref = StableDiffusionPipeline.from_single_file(str(path), config=str(tmp_path / "model"),
                                                   local_files_only=True, dtype=torch.float32)
    assert_same_outputs(ours, ref)
    # and we read our own export back to the same model
    again = load_model(path)
    assert again.spec.family == family and again.checkpoint.layout == "original"
    assert_same_outputs(again, pipe)


def test_diffusers_folder_roundtrip_through_our_writer(tmp_path):
    from diffusers import StableDiffusionPipeline

    pipe = diffusers_pipeline("sd2", tmp_path, prediction_type="v_prediction")
    pipe.save_pretrained(tmp_path / "model")
    ours = load_model(tmp_path / "model")
    assert ours.spec.prediction_type == "v_prediction"
    save_diffusers(ours, tmp_path / "copy", dtype=torch.float16, variant="fp16")
    ref = StableDiffusionPipeline.from_pretrained(tmp_path / "copy", variant="fp16", dtype=torch.float32,
                                                  local_files_only=True)
    assert ref.scheduler.config.prediction_type == "v_prediction"
    assert_same_outputs(load_model(tmp_path / "copy"), ref)
    with pytest.raises(Exception, match="refusing to write"):
        save_diffusers(ours, tmp_path / "copy")
