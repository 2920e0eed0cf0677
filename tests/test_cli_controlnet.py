"""`sdlite generate --controlnet`: the command line's units are the ones the engine is given (the CLI's image equals
``Engine.generate`` with the same units), the n-th of each ``--control-*`` flag pairs with the n-th ``--controlnet``
(once: for all), every bad value is one error naming its flag and value (exit 2, before the model load, no file
written), and the PNG carries A1111's ``ControlNet N`` parameters. Tiny random models, as in test_controlnet.py."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

from sdlite.cli import build_parser, control_units, main
from sdlite.control import ControlUnit
from sdlite.images import parse_infotext, read_parameters
from sdlite.pipeline import Engine, Request, RequestError
from tests.reference import diffusers_pipeline, saved_pipeline, with_contrast
from tests.test_controlnet import control_image, diffusers_controlnet

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py

PROMPT = "a red circle on a blue background"
SIZE = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_controlnet")
    pipe = with_contrast(diffusers_pipeline("sd1", tmp))
    with torch.no_grad():   # a UNet whose prediction matters to the image, so that the control's share shows
        pipe.unet.conv_out.weight.mul_(8)
    pipe = saved_pipeline(pipe, tmp / "model")
    folders = []
    for i in range(2):
        diffusers_controlnet(pipe.unet, 40 + i).save_pretrained(tmp / f"cn{i}")
        folders.append(tmp / f"cn{i}")
    images = []
    for i, size in enumerate((SIZE, 96)):   # the second is larger than the output: the resize mode matters
        control_image(i + 1, size).save(tmp / f"control{i}.png")
        images.append(tmp / f"control{i}.png")
    return {"model": tmp / "model", "folders": folders, "images": images, "tmp": tmp,
            "engine": Engine.load(tmp / "model", precision="exact")}


def cli(tiny, out, *extra, steps: int = 4):
    return ["generate", PROMPT, "--model", str(tiny["model"]), "--steps", str(steps), "--seed", "5", "--sampler",
            "euler", "--width", str(SIZE), "--height", str(SIZE), "--output", str(out), "--precision", "exact",
            *extra]


def run_ok(argv, capsys) -> tuple[np.ndarray, dict]:
    assert main(argv) == 0, capsys.readouterr().err
    (written,) = capsys.readouterr().out.split()
    with Image.open(written) as im:
        pixels = np.asarray(im.convert("RGB")).astype(int)
    return pixels, parse_infotext(read_parameters(written))


def units_of(*argv) -> tuple:
    return control_units(build_parser().parse_args(["generate", PROMPT, *argv]))


# --- the image and its parameters ----------------------------------------------------------------------------------

def test_one_controlnet_gives_the_engines_image(tiny, capsys, tmp_path):
    folder, image = tiny["folders"][0], tiny["images"][0]
    pixels, info = run_ok(cli(tiny, tmp_path / "a.png", "--controlnet", str(folder), "--control-image", str(image),
                              "--control-weight", "0.7", "--control-start", "0.25", "--control-mode", "prompt"),
                          capsys)
    unit = ControlUnit(folder, Image.open(image), weight=0.7, guidance_start=0.25, mode="prompt")
    result = tiny["engine"].generate(Request(PROMPT, width=SIZE, height=SIZE, steps=4, seed=5, sampler="euler",
                                             controls=(unit,)))
    assert np.array_equal(pixels, np.asarray(result.images[0]).astype(int))
    plain, _ = run_ok(cli(tiny, tmp_path / "plain.png"), capsys)
    assert np.abs(plain - pixels).max() > 8            # the control changed the image
    assert info["ControlNet 0"] == result.infotext["ControlNet 0"]
    assert info["ControlNet 0"] == ("Module: none, Model: cn0 [{}], Weight: 0.7, Resize Mode: Crop and Resize, "
                                    "Processor Res: 512, Guidance Start: 0.25, Guidance End: 1, Pixel Perfect: False, "
                                    "Control Mode: My prompt is more important").format(
                                        result.infotext["ControlNet 0"].split("[")[1].split("]")[0])
    assert "ControlNet 1" not in info and "ControlNet 0" not in parse_infotext(
        read_parameters(tmp_path / "plain.png"))


def test_two_controlnets_pair_their_flags_in_order(tiny, capsys, tmp_path):
    """Weight and resize given per ControlNet, the end once (for both), a preprocessor with a threshold for the
    second: the same image as the engine given the two units, and both in the PNG's parameters."""
    (f0, f1), (i0, i1) = tiny["folders"], tiny["images"]
    pixels, info = run_ok(cli(tiny, tmp_path / "two.png",
                              "--controlnet", str(f0), "--control-image", str(i0),
                              "--controlnet", str(f1), "--control-image", str(i1),
                              "--control-weight", "0.8", "--control-weight", "1.2", "--control-end", "0.75",
                              "--control-resize", "just-resize", "--control-resize", "resize-and-fill",
                              "--control-preprocessor", "none", "--control-preprocessor", "threshold",
                              "--control-threshold-a", "100", "--control-threshold-a", "90",
                              "--control-mode", "balanced", "--control-mode", "control"), capsys)
    units = (ControlUnit(f0, i0, weight=0.8, guidance_end=0.75, resize_mode="just-resize", threshold_a=100),
             ControlUnit(f1, i1, weight=1.2, guidance_end=0.75, resize_mode="resize-and-fill", preprocessor="threshold",
                         threshold_a=90, mode="control"))
    result = tiny["engine"].generate(Request(PROMPT, width=SIZE, height=SIZE, steps=4, seed=5, sampler="euler",
                                             controls=units))
    assert np.array_equal(pixels, np.asarray(result.images[0]).astype(int))
    for k in ("ControlNet 0", "ControlNet 1"):
        assert info[k] == result.infotext[k]
    assert info["ControlNet 1"].startswith("Module: threshold, Model: cn1 [") and "Threshold A: 90" in info[
        "ControlNet 1"] and "Control Mode: ControlNet is more important" in info["ControlNet 1"]
    # the second unit alone differs: each unit took its own values
    alone, _ = run_ok(cli(tiny, tmp_path / "one.png", "--controlnet", str(f0), "--control-image", str(i0),
                          "--control-weight", "0.8", "--control-end", "0.75", "--control-resize", "just-resize"),
                      capsys)
    assert np.abs(alone - pixels).max() > 4


def test_the_init_image_is_the_control_image_when_none_is_given(tiny, capsys, tmp_path):
    folder, image = tiny["folders"][0], tiny["images"][0]
    a, _ = run_ok(cli(tiny, tmp_path / "a.png", "--init-image", str(image), "--strength", "0.6",
                      "--controlnet", str(folder)), capsys)
    b, _ = run_ok(cli(tiny, tmp_path / "b.png", "--init-image", str(image), "--strength", "0.6",
                      "--controlnet", str(folder), "--control-image", str(image)), capsys)
    assert np.array_equal(a, b)


# --- pairing (no model needed) -------------------------------------------------------------------------------------

def test_nth_flag_goes_with_nth_controlnet(tiny):
    (f0, f1), (i0, i1) = tiny["folders"], tiny["images"]
    u0, u1 = units_of("--controlnet", str(f0), "--controlnet", str(f1), "--control-image", str(i0),
                      "--control-image", str(i1), "--control-weight", "0.5", "--control-start", "0.1",
                      "--control-start", "0.3", "--control-processor-res", "256", "--control-pixel-perfect",
                      "--control-hr-option", "low-res-only", "--control-hr-option", "Both",
                      "--control-mode", "My prompt is more important")
    assert (u0.model, u0.image, u0.guidance_start, u0.hr_option) == (str(f0), str(i0), 0.1, "low-res-only")
    assert (u1.model, u1.image, u1.guidance_start, u1.hr_option) == (str(f1), str(i1), 0.3, "both")
    for u in (u0, u1):   # given once: for both
        assert (u.weight, u.processor_res, u.pixel_perfect, u.mode) == (0.5, 256, True, "prompt")
        assert (u.guidance_end, u.preprocessor, u.resize_mode, u.threshold_a) == (1.0, "none", "crop-and-resize",
                                                                                 None)
    assert units_of() == ()
    (only,) = units_of("--controlnet", str(f0), "--control-image", str(i0))
    assert only == ControlUnit(str(f0), str(i0))   # the extension's defaults, crop-and-resize included


@pytest.mark.parametrize("argv,message", [
    (["--control-weight", "0.5", "--control-weight", "0.6", "--control-weight", "0.7"],
     "--control-weight is given 3 times for 2 --controlnet"),
    (["--control-image", "{i0}", "--control-image", "{i0}"],   # with the one below: 3
     "--control-image is given 3 times for 2 --controlnet"),
    (["--control-mode", "prompt", "--control-mode", "control", "--control-mode", "balanced"],
     "--control-mode is given 3 times"),
])
def test_a_count_mismatch_names_the_flag(tiny, argv, message):
    argv = [a.format(i0=tiny["images"][0]) for a in argv]
    with pytest.raises(RequestError, match=message):
        units_of("--controlnet", str(tiny["folders"][0]), "--controlnet", str(tiny["folders"][1]),
                 "--control-image", str(tiny["images"][0]), *argv)


# --- errors ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,message", [
    (["--control-weight", "11"], "--control-weight 11 is not valid: expected 0 to 10"),
    (["--control-weight", "nan"], "--control-weight nan is not valid"),
    (["--control-start", "1.5"], "--control-start 1.5 is not valid"),
    (["--control-end", "-0.1"], "--control-end -0.1 is not valid"),
    (["--control-start", "0.8", "--control-end", "0.2"], "--control-start 0.8 is after --control-end 0.2"),
    (["--control-mode", "louder"], "--control-mode 'louder' is not valid: expected one of balanced, prompt, control"),
    (["--control-resize", "stretch"], "--control-resize 'stretch' is not valid: expected one of just-resize"),
    (["--control-hr-option", "second"], "--control-hr-option 'second' is not valid"),
    (["--control-preprocessor", "sharpen"], "--control-preprocessor: unknown ControlNet preprocessor 'sharpen'"),
    (["--control-preprocessor", "depth_midas"], "--control-preprocessor: .*'depth_midas' needs an annotator"),
    (["--control-processor-res", "32"], "--control-processor-res 32 is not valid"),
    (["--control-threshold-b", "nan"], "--control-threshold-b nan is not a number"),
])
def test_bad_values_name_the_flag(tiny, capsys, tmp_path, extra, message):
    out = tmp_path / "x.png"
    argv = cli(tiny, out, "--controlnet", str(tiny["folders"][0]), "--control-image", str(tiny["images"][0]), *extra)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdlite: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not out.exists()


def test_missing_things_are_named(tiny, capsys, tmp_path):
    folder, image = str(tiny["folders"][0]), str(tiny["images"][0])
    out = tmp_path / "x.png"
    for extra, message in (
            (["--controlnet", str(tmp_path / "nope"), "--control-image", image],
             f"--controlnet {tmp_path / 'nope'}: no such file or folder"),
            (["--controlnet", folder], f"--controlnet {folder} needs a control image: add --control-image PATH"),
            (["--controlnet", folder, "--control-image", str(tmp_path / "none.png")],
             f"--control-image {tmp_path / 'none.png'}"),
            (["--controlnet", folder, "--control-image", str(tmp_path)], f"--control-image {tmp_path}"),
            (["--control-weight", "0.5", "--control-pixel-perfect"],
             "--control-weight, --control-pixel-perfect need a ControlNet: add --controlnet PATH"),
            (["--control-image", image], "--control-image needs a ControlNet")):
        assert main(cli(tiny, out, *extra)) == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert not out.exists()


def test_an_argparse_number_error_names_the_flag(tiny, capsys):
    with pytest.raises(SystemExit) as e:
        main(cli(tiny, "x.png", "--controlnet", str(tiny["folders"][0]), "--control-weight", "heavy"))
    assert e.value.code == 2 and "--control-weight: invalid float value: 'heavy'" in capsys.readouterr().err
