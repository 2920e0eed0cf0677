"""`sdlite edit IMAGE "instruction"` on a tiny random FLUX.2 [klein] (tests/test_flux2_pipeline.py's): its PNG is
the engine's image of ``Request(reference_images=(IMAGE, *--ref-image))`` with the same seed, at the image's size
and the model's sampling defaults (4 steps of Euler at cfg 1) where the command line leaves them out; a second image
is image 2; a model without reference images (the demo model) refuses the command in one line, exit status 2, and
so does a missing image, before the model loads."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from sdlite.cli import main
from sdlite.pipeline import Engine, Request
from tests.test_flux2_pipeline import _image, _pipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py

PROMPT = "make the sky purple"


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    """The tiny distilled klein as a diffusers folder, its engine, and two source images as PNG files."""
    tmp = tmp_path_factory.mktemp("cli_edit")
    folder = tmp / "klein"
    _pipeline(folder)
    first, second = tmp / "photo.png", tmp / "hat.png"
    _image(80, 72, 1).save(first)
    _image(112, 80, 3).save(second)
    return folder, Engine.load(folder, precision="exact"), first, second


def _edit(argv, capsys) -> tuple[np.ndarray, str]:
    """The CLI run to success: the one written image's pixels and the stderr summary."""
    assert main(argv) == 0
    captured = capsys.readouterr()
    (written,) = captured.out.split()
    with Image.open(written) as im:
        return np.asarray(im.convert("RGB")), captured.err


def _engine_image(engine, refs, **kw) -> np.ndarray:
    result = engine.generate(Request(prompt=PROMPT, reference_images=tuple(str(r) for r in refs), sampler="euler",
                                     **kw))
    return np.asarray(result.images[0].convert("RGB"))


def test_edit_is_generate_with_the_image_as_reference_1(klein, tmp_path, capsys):
    """No --steps, --cfg, --sampler, --width, --height: the model's 4 steps of Euler at cfg 1, the image's size
    (80x72 cropped to multiples of 16: 80x64); the PNG is the engine's image of the same request."""
    folder, engine, photo, _ = klein
    got, summary = _edit(["edit", str(photo), PROMPT, "--model", str(folder), "--seed", "5", "--precision", "exact",
                          "--output", str(tmp_path / "edited.png")], capsys)
    want = _engine_image(engine, [photo], steps=4, cfg_scale=1.0, seed=5)
    assert got.shape == (64, 80, 3) and np.array_equal(got, want) and got.std() > 5
    assert "80x64, 4 steps, euler" in summary and "cfg 1;" in summary
    plain = engine.generate(Request(prompt=PROMPT, steps=4, cfg_scale=1.0, seed=5, width=80, height=64,
                                    sampler="euler")).images[0]
    assert not np.array_equal(got, np.asarray(plain.convert("RGB"))), "the image should change the result"


def test_edit_with_a_second_image(klein, tmp_path, capsys):
    """--ref-image is image 2 after the positional image; --width, --height, --steps and --cfg are taken."""
    folder, engine, photo, hat = klein
    argv = ["edit", str(photo), PROMPT, "--model", str(folder), "--ref-image", str(hat), "--width", "64",
            "--height", "64", "--steps", "2", "--cfg", "1", "--seed", "9", "--precision", "exact"]
    got, summary = _edit([*argv, "--output", str(tmp_path / "two.png")], capsys)
    want = _engine_image(engine, [photo, hat], steps=2, cfg_scale=1.0, seed=9, width=64, height=64)
    assert np.array_equal(got, want) and "64x64, 2 steps" in summary
    one = _engine_image(engine, [photo], steps=2, cfg_scale=1.0, seed=9, width=64, height=64)
    assert not np.array_equal(got, one), "the second image should change the result"


def test_a_model_without_references_refuses_it(klein, tmp_path, capsys):
    """The demo model (SD 1.x) refuses reference images with the engine's error: one line, exit status 2, no file.
    A missing image is named before any model loads."""
    _, _, photo, _ = klein
    out = tmp_path / "out"
    assert main(["edit", str(photo), PROMPT, "--model", "demo", "--steps", "1", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdlite: error: reference images (editing from images) are for "
                                               "FLUX.2 [klein], FLUX.1 dev / Kontext and Qwen-Image-Edit models; this "
                                               "model (sd")
    assert not out.exists() or not any(out.iterdir())
    missing = tmp_path / "missing.png"
    assert main(["edit", str(missing), PROMPT, "--model", "demo", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"sdlite: error: reference image 1 {missing}: no such file"]
