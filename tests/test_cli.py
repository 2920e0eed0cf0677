"""The CLI's bad input: one clear message each, exit code 2, no partial files. Also metadata round trips,
output naming that never overwrites, the progress bar, and `sdlite samplers`."""
from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from sdlite.cli import ProgressBar, main
from sdlite.images import infotext, output_paths, parse_infotext, read_parameters, save_image
from sdlite.pipeline import Request, validate
from tests.reference import diffusers_pipeline


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    diffusers_pipeline("sd1", tmp).save_pretrained(tmp / "model")
    return tmp / "model"


def _fails(argv, capsys, out_dir) -> str:
    before = sorted(os.listdir(out_dir)) if out_dir.exists() else None
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdlite: error: ") and "Traceback" not in err
    assert (sorted(os.listdir(out_dir)) if out_dir.exists() else None) == before  # nothing left behind
    return err


def _gen(model, out, *extra):
    return ["generate", "a red circle", "--model", str(model), "--steps", "2", "--output", str(out), *extra]


@pytest.mark.parametrize("extra,expected", [
    (["--width", "100"], "width=100 is not valid: it must be a positive multiple of 8"),
    (["--height", "60"], "height=60 is not valid"),
    (["--steps", "0"], "steps=0 is not valid: it must be between 1 and 1000"),
    (["--steps", "-3"], "steps=-3 is not valid"),
    (["--sampler", "euler_b"], "unknown sampler 'euler_b'; valid names: euler, euler_a, heun"),
    (["--cfg", "45"], "cfg scale 45.0 is out of range: it must be between 1 and 30"),
    (["--cfg", "0.5"], "cfg scale 0.5 is out of range"),
    (["--device", "cuda:3"], "device 'cuda:3' is not available"),
    (["--device", "tpu"], "device 'tpu'"),
    (["--schedule", "cosine"], "schedule 'cosine' is not valid: expected one of discrete, karras, exponential"),
    (["--format", "gif"], "format 'gif' is not valid"),
    (["--seed", "-7"], "seed -7 is not valid"),
    (["--memory-mode", "5"], "memory mode 5 is not valid: 0 = low"),
    (["--quantize", "int3"], "quantize mode 'int3' is not valid: expected one of none, int8"),
    (["--vae-tile", "100"], "VAE tile 100 is not valid: expected 0 (no tiling) or a multiple of 8"),
    (["--memory-mode", "0", "--quantize", "int8"], "quantize mode 'int8' needs the UNet loaded whole"),
    (["--timesteps", "999,abc"], "--timesteps '999,abc' is not valid: expected integers separated by commas"),
    (["--sampler", "lcm", "--timesteps", "999,749,499"], "--steps 2 disagrees with --timesteps (3 steps)"),
    (["--sampler", "euler", "--sigmas", "3,2,1"], "sigmas 3,2,1: end the list with 0"),
    (["--sampler", "lcm", "--timesteps", "999,999"], "timesteps 999,999 are not strictly descending"),
    (["--timesteps", "999,499"], "explicit timesteps replace the sigma schedule: they cannot be karras sigmas"),
])
def test_bad_generate_arguments(model, tmp_path, capsys, extra, expected):
    out = tmp_path / "out"
    out.mkdir()
    err = _fails(_gen(model, out / "x.png", *extra), capsys, out)
    assert expected in err


def test_unwritable_output_folder(model, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    # root writes through permission bits, so the folder is made unwritable in the eyes of the check itself
    real_access = os.access
    monkeypatch.setattr("sdlite.images.os.access",
                        lambda p, mode: False if os.fspath(p) == os.fspath(locked) else real_access(p, mode))
    err = _fails(_gen(model, locked / "x.png"), capsys, locked)
    assert f"output folder '{locked}' is not writable" in err


def test_output_under_a_file(model, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    err = _fails(_gen(model, tmp_path / "afile" / "sub" / "x.png"), capsys, tmp_path)
    assert "cannot be created" in err and "afile" in err


def test_missing_model_and_no_model(tmp_path, capsys):
    err = _fails(["generate", "a cat", "--model", str(tmp_path / "nope.safetensors")], capsys, tmp_path)
    assert "nope.safetensors: no such file or folder" in err


def test_long_prompt_is_not_cut(model, tmp_path, capsys):
    """Past 75 tokens a prompt goes on in a second chunk (A1111's rule; tests/test_conditioning.py checks the
    conditioning against a direct computation): no truncation warning any more."""
    prompt = "a red circle on a blue background " + " ".join(f"word{i}" for i in range(80))
    assert main(["generate", prompt, "--model", str(model), "--steps", "1", "--seed", "1",
                 "--output", str(tmp_path / "long.png")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert (tmp_path / "long.png").is_file()


def test_existing_files_are_never_overwritten(model, tmp_path, capsys):
    target = tmp_path / "img.png"
    target.write_bytes(b"precious")
    assert main(_gen(model, target, "--seed", "3")) == 0
    assert target.read_bytes() == b"precious"
    assert (tmp_path / "img-1.png").is_file()
    written = capsys.readouterr().out.strip().splitlines()
    assert written == [str(tmp_path / "img-1.png")]
    # folders: numbered after what is there
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "00007-1.png").write_bytes(b"old")
    assert main(_gen(model, f"{tmp_path / 'dir'}/", "--seed", "11", "--batch", "2")) == 0
    assert sorted(os.listdir(tmp_path / "dir")) == ["00007-1.png", "00008-11.png", "00009-12.png"]


def test_no_prepack_draws_the_same_image(model, tmp_path):
    import numpy as np
    from PIL import Image

    assert main(_gen(model, tmp_path / "packed.png", "--seed", "5", "--precision", "exact")) == 0
    assert main(_gen(model, tmp_path / "plain.png", "--seed", "5", "--no-prepack", "--precision", "exact")) == 0
    a, b = (np.asarray(Image.open(tmp_path / f"{n}.png")).astype(int) for n in ("packed", "plain"))
    assert a.shape == b.shape and np.abs(a - b).max() <= 1  # the same math; only the summation order differs


def test_seed_minus_one_is_random_and_reported(model, tmp_path, capsys):
    assert main(_gen(model, tmp_path / "r.png", "--seed", "-1")) == 0
    err = capsys.readouterr().err
    seed = int(err.split("seed ")[1].split(",")[0].split()[0])
    params = parse_infotext(read_parameters(tmp_path / "r.png"))
    assert int(params["Seed"]) == seed and seed >= 0


@pytest.mark.parametrize("fmt", ["png", "jpg"])
def test_parameters_round_trip(tmp_path, fmt):
    from PIL import Image

    req = validate(Request(prompt='a "quoted", odd: prompt\nsecond line', negative_prompt="ugly, blurry",
                           width=512, height=768, steps=30, cfg_scale=6.5, sampler="DPM++ 2M SDE Karras",
                           seed=123456, batch_size=1, clip_skip=2, eta=0.6))
    text = infotext(req, req.seed, "abcdef0123", "my model, v2")
    path = save_image(Image.new("RGB", (8, 8)), tmp_path / f"a.{fmt}", text, fmt)
    back = parse_infotext(read_parameters(path))
    assert back["prompt"] == req.prompt and back["negative_prompt"] == req.negative_prompt
    assert (back["sampler"], back["schedule"]) == ("dpmpp_2m_sde", "karras")
    assert back["Steps"] == "30" and back["CFG scale"] == "6.5" and back["Seed"] == "123456"
    assert back["Size"] == "512x768" and back["Clip skip"] == "2" and back["Eta"] == "0.6"
    assert back["Model hash"] == "abcdef0123" and back["Model"] == "my model, v2"


def test_a1111_written_text_parses():
    text = ("masterpiece, 1girl\nNegative prompt: lowres, bad anatomy\nSteps: 28, Sampler: Euler a, "
            "CFG scale: 7, Seed: 3900235, Size: 512x640, Model hash: 925997e9, Clip skip: 2")
    back = parse_infotext(text)
    assert back["prompt"] == "masterpiece, 1girl" and back["negative_prompt"] == "lowres, bad anatomy"
    assert back["sampler"] == "euler_a" and back["Seed"] == "3900235"


def test_output_paths_numbering(tmp_path):
    assert output_paths(tmp_path / "a.png", 2, "png", [5, 6]) == [tmp_path / "a-1.png", tmp_path / "a-2.png"]
    assert output_paths(f"{tmp_path}/new/", 1, "jpg", [9]) == [tmp_path / "new" / "00000-9.jpg"]


def test_progress_bar_on_a_terminal_and_quiet_otherwise():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar(stream=stream)
        for i in range(1, 5):
            bar(i, 4)
    assert "4/4" in tty.getvalue() and "it/s" in tty.getvalue() and "ETA" in tty.getvalue()
    assert pipe.getvalue() == ""


def test_samplers_command(capsys):
    assert main(["samplers"]) == 0
    out = capsys.readouterr().out
    for name in ("euler_a", "dpmpp_2m", "ddim", "pndm", "unipc", "lcm", "Euler a", "DPM++ 2M", "PLMS"):
        assert name in out


def test_the_command_freezes_the_objects_left_before_the_process_ends(monkeypatch, capsys):
    """``sdlite`` (the console script, ``python -m sdlite``) runs :func:`sdlite.cli.run`: main, then ``gc.freeze``,
    so that the interpreter's collections at exit skip every object torch and the model made (0.5-0.8 s of a
    one-image command)."""
    from importlib.metadata import entry_points

    import sdlite.cli as cli

    frozen = []
    monkeypatch.setattr(cli.gc, "freeze", lambda: frozen.append(True))
    assert cli.run(["samplers"]) == 0 and frozen == [True]
    assert "euler_a" in capsys.readouterr().out
    assert cli.run(["generate", "--steps", "0", "x"]) == 2 and frozen == [True, True]   # an error: frozen all the same
    assert [e.value for e in entry_points(group="console_scripts") if e.name == "sdlite"] == ["sdlite.cli:run"]
    here = Path(cli.__file__).parent                                     # python -m sdlite, python -m sdlite.cli
    for main_module in (here.parent / "__main__.py", here / "__main__.py"):
        assert "sys.exit(run())" in main_module.read_text()
