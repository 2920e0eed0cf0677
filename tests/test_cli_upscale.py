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


@pytest.fixture
def network(tmp_path):
    """A small SRVGGNetCompact 2x with random weights, saved as .safetensors in its own folder."""
    import torch
    from safetensors.torch import save_file

    from sdlite.upscalers.nets import SRVGGConfig, SRVGGNetCompact

    torch.manual_seed(0)
    net = SRVGGNetCompact(SRVGGConfig(num_feat=8, num_conv=2, scale=2))
    folder = tmp_path / "upscalers"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, folder / "tiny-2x.safetensors")
    return folder / "tiny-2x.safetensors"


def test_a_network_by_name_and_by_file(source, network, tmp_path):
    from sdlite.upscalers.files import load_upscaler
    from sdlite.upscalers.tiling import upscale

    out = tmp_path / "o"
    assert main(["upscale", str(source), "--upscaler", "tiny-2x", "--upscaler-dir", str(network.parent),
                 "-o", str(out) + "/"]) == 0
    image = Image.open(out / "src-upscaled.png")
    assert image.size == (80, 48)   # the network's own scale by default
    expected = upscale(load_upscaler(network), Image.open(source).convert("RGB"))
    assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(expected))
    assert read_parameters(out / "src-upscaled.png").endswith("Postprocess upscale by: 2, Postprocess upscaler: tiny-2x")
    # by file, to 4x: the network twice (A1111's loop), then Lanczos to the exact size
    assert main(["upscale", str(source), "--upscaler", str(network), "--scale", "3", "-o", str(out / "b.png")]) == 0
    assert Image.open(out / "b.png").size == (120, 72)


def test_hires_with_a_network_upscaler(network):
    from sdlite.cli import demo_model_path
    from sdlite.hires import Hires
    from sdlite.pipeline import Engine, Request

    engine = Engine.load(demo_model_path())
    engine.upscaler_dir = str(network.parent)
    result = engine.generate(Request("a red circle on a blue background", seed=1, steps=6,
                                     hires=Hires(upscaler="tiny-2x", denoise=0.5)))
    assert result.images[0].size == (128, 128) and result.infotext["Hires upscaler"] == "tiny-2x"
