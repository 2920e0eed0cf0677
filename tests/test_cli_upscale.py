"""``sdlite upscale``: A1111's extras upscale from the command line (Lanczos, Nearest, upscaler networks, the SD x4
upscaler), the source's parameters kept, outputs never overwriting anything, and errors that name the flag."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from sdlite.cli import main
from sdlite.images import read_parameters, save_image


@pytest.fixture
def source(tmp_path):
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (24, 40, 3), dtype=np.uint8))
    return save_image(image, tmp_path / "src.png", "a cat\nSteps: 20, Seed: 7, Size: 40x24")


def test_lanczos_keeps_the_parameters_and_never_overwrites(source, tmp_path, capsys):
    out = tmp_path / "out/"
    assert main(["upscale", str(source), "--scale", "2", "-o", str(out) + "/"]) == 0
    first = out / "src-upscaled.png"
    image = Image.open(first)
    assert image.size == (80, 48)
    expected = Image.open(source).convert("RGB").resize((80, 48), Image.Resampling.LANCZOS)
    assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(expected))
    assert read_parameters(first) == ("a cat\nSteps: 20, Seed: 7, Size: 40x24, Postprocess upscale by: 2, "
                                      "Postprocess upscaler: Lanczos")
    assert main(["upscale", str(source), "--upscaler", "Nearest", "--scale", "3", "-o", str(out) + "/"]) == 0
    second = out / "src-upscaled-1.png"
    assert Image.open(second).size == (120, 72) and Image.open(first).size == (80, 48)
    assert str(second) in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--upscaler", "4x-Missing"], "--upscaler: upscaler '4x-Missing' is not known"),
    (["--scale", "20"], "--scale 20.0: a factor from 1 to 8"),
    (["--prompt", "a cat"], "--prompt needs the SD x4 upscaler: add --model X4_FOLDER"),
    (["--model", "nowhere", "--upscaler", "Lanczos"], "either --upscaler"),
    (["--model", "nowhere"], "--model nowhere: no such file or folder"),
    (["--precision", "fast"], "precision"),
])
def test_errors_name_the_flag(source, tmp_path, capsys, args, message):
    assert main(["upscale", str(source), "-o", str(tmp_path / "o") + "/", *args]) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_missing_image_is_named(tmp_path, capsys):
    assert main(["upscale", str(tmp_path / "nope.png"), "-o", str(tmp_path) + "/"]) != 0
    assert "nope.png" in capsys.readouterr().err
