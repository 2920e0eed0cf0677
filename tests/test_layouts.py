"""One set of weights, four layouts, one image.

A diffusers folder (written by diffusers), the same weights as a hub-style folder (text encoder keys under
``text_model.``, the scheduler config as the v1-5 repository publishes it, without ``timestep_spacing``), as an
original single ``.safetensors`` (no sdlite metadata: read by key names, shapes and conventions, as real files are)
and as a legacy ``.ckpt``: ``sdlite generate`` gives the same PNG from each. The single file is checked first with
diffusers' own single-file loader, which must read the folder's exact tensors from it.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sdlite.cli import main
from sdlite.config import PUBLISHED_SCHEDULERS
from sdlite.export import save_single_file
from sdlite.images import parse_infotext, read_parameters
from sdlite.loader import load_model, open_model
from tests.reference import diffusers_pipeline, saved_pipeline, with_contrast
from tests.test_generate import max_pixel_diff, reference_images, run_cli

SAMPLERS = ["euler", "dpmpp_2m_karras", "ddim"]
LAYOUTS = ["folder", "hub_folder", "safetensors", "ckpt"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    pipe = saved_pipeline(with_contrast(diffusers_pipeline("sd1", tmp, conventional=True)), tmp / "folder")
    saved = json.loads((tmp / "folder" / "scheduler" / "scheduler_config.json").read_text())
    assert saved["timestep_spacing"] == "leading" and saved["steps_offset"] == 1  # what diffusers writes

    # hub-style: transformers 4's key names, and the scheduler config exactly as published (field absent)
    shutil.copytree(tmp / "folder", tmp / "hub_folder")
    te = tmp / "hub_folder" / "text_encoder" / "model.safetensors"
    state = load_file(te)
    assert not any(k.startswith("text_model.") for k in state)
    save_file({f"text_model.{k}": v for k, v in state.items()}, te, metadata={"format": "pt"})
    _, published = PUBLISHED_SCHEDULERS["sd1"]
    (tmp / "hub_folder" / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({**published, "_diffusers_version": "0.6.0"}))

    # original single file without our metadata, and the same tensors as a Lightning-style .ckpt
    model = load_model(tmp / "folder")
    save_single_file(model, tmp / "with_meta.safetensors")
    tensors = load_file(tmp / "with_meta.safetensors")
    save_file(tensors, tmp / "model.safetensors")
    torch.save({"state_dict": tensors, "global_step": 1}, tmp / "model.ckpt")
    return pipe, {"folder": tmp / "folder", "hub_folder": tmp / "hub_folder",
                  "safetensors": tmp / "model.safetensors", "ckpt": tmp / "model.ckpt"}


def test_single_file_holds_the_folders_tensors_for_diffusers(layouts):
    """diffusers' own single-file loader (an independent reader) finds the folder's weights in the file."""
    from diffusers import StableDiffusionPipeline

    pipe, paths = layouts
    ref = StableDiffusionPipeline.from_single_file(str(paths["safetensors"]), config=str(paths["folder"]),
                                                   local_files_only=True, dtype=torch.float32)
    for name in ("unet", "vae", "text_encoder"):
        want, got = getattr(pipe, name).state_dict(), getattr(ref, name).state_dict()
        for key, tensor in want.items():
            if key.endswith("position_ids"):
                continue
            assert torch.equal(got[key].reshape(tensor.shape), tensor), (name, key)


def test_every_layout_states_the_same_schedule(layouts, capsys):
    _, paths = layouts
    configs = {}
    for layout, path in paths.items():
        with open_model(path) as ckpt:
            assert ckpt.spec.family == "sd1"
            configs[layout] = {k: v for k, v in ckpt.scheduler_config.items()
                               if k in ("timestep_spacing", "steps_offset", "beta_start", "beta_end",
                                        "beta_schedule", "num_train_timesteps", "prediction_type")}
            expected_source = "stated" if layout == "folder" else ("PNDMScheduler" if layout == "hub_folder"
                                                                   else "runwayml/stable-diffusion-v1-5")
            assert expected_source in ckpt.scheduler_source
    assert all(c == configs["folder"] for c in configs.values()), configs
    assert configs["folder"]["timestep_spacing"] == "leading"
    # sdlite info says which schedule and where it came from
    assert main(["info", str(paths["safetensors"])]) == 0
    out = capsys.readouterr().out
    assert "timestep spacing leading" in out and "runwayml/stable-diffusion-v1-5" in out


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_same_png_from_every_layout(layouts, tmp_path, sampler):
    pipe, paths = layouts
    images = {}
    for layout in LAYOUTS:
        _, got = run_cli(paths[layout], tmp_path / f"{layout}.png", sampler, steps=3, seed=7, size=64)
        images[layout] = got
    assert images["folder"].std() > 30                 # not a flat image: a schedule change shows
    for layout in LAYOUTS[1:]:
        assert max_pixel_diff(images[layout], images["folder"]) <= 2, layout
    # and the folder's image is diffusers' own for the folder's scheduler (leading, offset 1)
    expected = reference_images(pipe, sampler, steps=3, seed=7, size=64)
    assert max_pixel_diff(images["folder"], expected) <= 2


def test_timestep_spacing_override(layouts, tmp_path):
    """--timestep-spacing changes the timesteps (here to linspace, what diffusers' scheduler swap gives for a
    config without the field) and is written into the PNG parameters; without it nothing is written."""
    pipe, paths = layouts
    files, default = run_cli(paths["safetensors"], tmp_path / "default.png", "euler", steps=3, seed=7, size=64)
    assert "Timestep spacing" not in parse_infotext(read_parameters(files[0]))
    out = tmp_path / "linspace.png"
    argv = ["generate", "a red circle on a blue background", "--model", str(paths["safetensors"]), "--negative",
            "blurry, green", "--steps", "3", "--sampler", "euler", "--seed", "7", "--width", "64", "--height", "64",
            "--timestep-spacing", "linspace", "--precision", "exact", "--output", str(out)]
    assert main(argv) == 0
    params = parse_infotext(read_parameters(out))
    assert params["Timestep spacing"] == "linspace"
    from PIL import Image
    got = np.asarray(Image.open(out).convert("RGB"))[None]
    assert max_pixel_diff(got, default) > 2            # a different schedule, a different image
    expected = reference_images(pipe, "euler", steps=3, seed=7, size=64, spacing="linspace")
    assert max_pixel_diff(got, expected) <= 2


def test_bad_timestep_spacing_is_refused(capsys):
    assert main(["generate", "x", "--timestep-spacing", "uniform"]) == 2
    err = capsys.readouterr().err
    assert "timestep spacing 'uniform' is not valid" in err and "leading" in err
