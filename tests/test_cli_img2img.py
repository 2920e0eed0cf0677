"""`sdlite generate` with a source image: image to image, inpainting (4- and 9-channel models), outpainting, the
A1111 parameters they write, and bad input failing with one clear message, exit code 2 and no file left behind
(before the model load wherever the model is not needed to tell)."""
from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image, ImageDraw

from sdlite import __version__
from sdlite.cli import main
from sdlite.images import infotext, parse_infotext, read_parameters
from sdlite.pipeline import Engine, Request, validate
from sdlite.sources import blur_mask
from tests.reference import diffusers_pipeline

REQUEST_IMAGE_FIELDS = ("strength", "resize_mode", "mask_blur", "invert_mask", "inpaint_fill", "inpaint_area",
                        "inpaint_padding", "outpaint", "overlay")


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_img2img")
    diffusers_pipeline("sd1", tmp).save_pretrained(tmp / "model")
    return tmp / "model"


@pytest.fixture(scope="module")
def inpaint_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_inpaint")
    diffusers_pipeline("sd1-inpaint", tmp).save_pretrained(tmp / "model")
    return tmp / "model"


def _source(path, width: int, height: int, mode: str = "RGB"):
    """A gradient with a disc: every pixel differs from its neighbours, so a pasted-back region is recognisable."""
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), (x + y) * 127 // (width + height)], -1)
    image = Image.fromarray(arr.astype(np.uint8))
    ImageDraw.Draw(image).ellipse([width // 4, height // 4, 3 * width // 4, 3 * height // 4], fill=(220, 30, 40))
    if mode == "RGBA":  # a transparent square in the top-left quarter
        alpha = Image.new("L", (width, height), 255)
        ImageDraw.Draw(alpha).rectangle([4, 4, width // 2, height // 2], fill=0)
        image.putalpha(alpha)
    image.save(path)
    return path


def _mask(path, width: int, height: int, box=None):
    """White (repaint) over ``box`` (default: a square left of the centre), black elsewhere."""
    mask = Image.new("L", (width, height), 0)
    if box != ():
        ImageDraw.Draw(mask).rectangle(box or [width // 8, height // 4, width // 2, 3 * height // 4], fill=255)
    mask.save(path)
    return path


def _gen(model, out, *extra, steps: int = 3):
    return ["generate", "a red circle", "--model", str(model), "--steps", str(steps), "--seed", "7",
            "--output", str(out), "--precision", "exact", *extra]


def _run(argv, capsys) -> tuple[np.ndarray, dict, str]:
    """Run the CLI successfully: the written image's pixels, its parsed parameters and the stderr summary."""
    assert main(argv) == 0
    captured = capsys.readouterr()
    (written,) = captured.out.split()
    with Image.open(written) as im:
        pixels = np.asarray(im.convert("RGB")).astype(int)
    return pixels, parse_infotext(read_parameters(written)), captured.err


def _rgb(path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB")).astype(int)


def _fails(argv, capsys, out_dir) -> str:
    before = sorted(os.listdir(out_dir)) if out_dir.exists() else None
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdlite: error: ") and "Traceback" not in err
    assert (sorted(os.listdir(out_dir)) if out_dir.exists() else None) == before  # nothing left behind
    return err


# ---------------------------------------------------------------------------------------------- image to image

def test_img2img_takes_the_source_size(model, tmp_path, capsys):
    src = _source(tmp_path / "src.png", 72, 56)
    pixels, params, err = _run(_gen(model, tmp_path / "out.png", "--init-image", str(src), "--strength", "0.5",
                                    steps=4), capsys)
    assert pixels.shape == (56, 72, 3)
    assert params["Size"] == "72x56" and params["Denoising strength"] == "0.5" and params["strength"] == 0.5
    assert "Mask blur" not in params and "Masked content" not in params and "Resize mode" not in params
    assert "72x56" in err and "img2img strength 0.5 (2 steps run)" in err


@pytest.mark.parametrize("mode,name", [("just-resize", None), ("crop", "Crop and resize"), ("fill", "Resize and fill")])
def test_img2img_given_size_and_resize_modes(model, tmp_path, capsys, mode, name):
    src = _source(tmp_path / "src.png", 72, 56)
    pixels, params, _ = _run(_gen(model, tmp_path / "out.png", "--init-image", str(src), "--width", "48",
                                  "--height", "64", "--resize-mode", mode), capsys)
    assert pixels.shape == (64, 48, 3) and params["Size"] == "48x64"
    if name is None:
        assert "Resize mode" not in params and "resize_mode" not in params
    else:
        assert params["Resize mode"] == name and params["resize_mode"] == mode


# ---------------------------------------------------------------------------------------------- inpainting

def test_inpainting_pastes_the_source_back_outside_the_mask(model, tmp_path, capsys):
    src, mask = _source(tmp_path / "src.png", 64, 48), _mask(tmp_path / "mask.png", 64, 48)
    pixels, params, err = _run(_gen(model, tmp_path / "out.png", "--init-image", str(src), "--mask", str(mask)),
                               capsys)
    assert pixels.shape == (48, 64, 3)
    outside = np.asarray(blur_mask(Image.open(mask), 4)) == 0
    assert 0.3 < outside.mean() < 0.9
    assert np.abs(pixels - _rgb(src))[outside].max() <= 2
    inside = np.asarray(Image.open(mask)) == 255
    assert np.abs(pixels - _rgb(src))[inside].max() > 2  # repainted
    assert params["Denoising strength"] == "0.75" and params["Mask blur"] == "4"
    assert params["Masked content"] == "original"
    for absent in ("Mask mode", "Inpaint area", "Masked area padding", "Overlay", "Outpaint"):
        assert absent not in params
    assert "inpainting strength 0.75" in err


def test_inpainting_options_and_their_parameters(model, tmp_path, capsys):
    src, mask = _source(tmp_path / "src.png", 64, 48), _mask(tmp_path / "mask.png", 64, 48)
    _, params, _ = _run(_gen(model, tmp_path / "out.png", "--init-image", str(src), "--mask", str(mask),
                             "--no-overlay", "--mask-blur", "2", "--inpaint-fill", "latent-noise",
                             "--resize-mode", "crop", "--strength", "1"), capsys)
    assert params["Overlay"] == "off" and params["Mask blur"] == "2" and params["Masked content"] == "latent noise"
    assert params["Resize mode"] == "Crop and resize" and params["Denoising strength"] == "1.0"
    assert (params["overlay"], params["mask_blur"], params["inpaint_fill"], params["strength"]) == \
        (False, 2, "latent-noise", 1.0)


def test_no_overlay_keeps_the_generated_pixels(model, tmp_path, capsys):
    src, mask = _source(tmp_path / "src.png", 64, 48), _mask(tmp_path / "mask.png", 64, 48)
    pixels, params, _ = _run(_gen(model, tmp_path / "out.png", "--init-image", str(src), "--mask", str(mask),
                                  "--no-overlay"), capsys)
    outside = np.asarray(blur_mask(Image.open(mask), 4)) == 0
    assert np.abs(pixels - _rgb(src))[outside].max() > 2  # the VAE's pixels, not the source's
    assert params["Overlay"] == "off"


def test_inpaint_area_masked(model, tmp_path, capsys):
    src = _source(tmp_path / "src.png", 80, 64)
    mask = _mask(tmp_path / "mask.png", 80, 64, box=[8, 8, 23, 23])
    pixels, params, err = _run(_gen(model, tmp_path / "out.png", "--init-image", str(src), "--mask", str(mask),
                                    "--inpaint-area", "masked", "--inpaint-padding", "8"), capsys)
    assert pixels.shape == (64, 80, 3) and params["Size"] == "80x64"
    outside = np.asarray(blur_mask(Image.open(mask), 4)) == 0
    assert np.abs(pixels - _rgb(src))[outside].max() <= 2
    assert params["Inpaint area"] == "Only masked" and params["Masked area padding"] == "8"
    assert (params["inpaint_area"], params["inpaint_padding"]) == ("masked", 8)


def test_mask_from_alpha(model, tmp_path, capsys):
    src = _source(tmp_path / "src.png", 64, 48, mode="RGBA")
    pixels, params, _ = _run(_gen(model, tmp_path / "out.png", "--init-image", str(src), "--mask-from-alpha"),
                             capsys)
    alpha = Image.open(src).getchannel("A")
    outside = np.asarray(blur_mask(Image.fromarray(255 - np.asarray(alpha)), 4)) == 0
    assert np.abs(pixels - _rgb(src))[outside].max() <= 2
    assert np.abs(pixels - _rgb(src))[np.asarray(alpha) == 0].max() > 2
    assert params["Mask blur"] == "4"


def test_invert_mask_repaints_the_black_part(model, tmp_path, capsys):
    src, mask = _source(tmp_path / "src.png", 64, 48), _mask(tmp_path / "mask.png", 64, 48)
    pixels, params, _ = _run(_gen(model, tmp_path / "out.png", "--init-image", str(src), "--mask", str(mask),
                                  "--invert-mask"), capsys)
    kept = np.asarray(blur_mask(Image.open(mask).point(lambda v: 255 - v), 4)) == 0
    assert kept.any() and np.abs(pixels - _rgb(src))[kept].max() <= 2
    assert params["Mask mode"] == "Inpaint not masked" and params["invert_mask"] is True


def test_outpainting_keeps_the_source_in_the_centre(model, tmp_path, capsys):
    src = _source(tmp_path / "src.png", 32, 32)
    pixels, params, err = _run(_gen(model, tmp_path / "out.png", "--init-image", str(src), "--outpaint",
                                    "16,0,16,0", "--mask-blur", "0"), capsys)
    assert pixels.shape == (32, 64, 3)
    assert np.abs(pixels[:, 16:48] - _rgb(src)).max() <= 2
    assert params["Outpaint"] == "16,0,16,0" and params["outpaint"] == (16, 0, 16, 0)
    assert params["Masked content"] == "fill" and params["Size"] == "64x32"
    assert "outpainting strength 0.75" in err
    # with the default blur, the source comes back exactly where the blurred border mask does not reach
    pixels, _, _ = _run(_gen(model, tmp_path / "blurred.png", "--init-image", str(src), "--outpaint", "16,0,16,0"),
                        capsys)
    assert np.abs(pixels[:, 16 + 10:48 - 10] - _rgb(src)[:, 10:-10]).max() <= 2


# ---------------------------------------------------------------------------------------------- 9-channel models

def test_inpainting_model(inpaint_model, tmp_path, capsys):
    src, mask = _source(tmp_path / "src.png", 48, 32), _mask(tmp_path / "mask.png", 48, 32)
    pixels, params, _ = _run(_gen(inpaint_model, tmp_path / "out.png", "--init-image", str(src), "--mask",
                                  str(mask)), capsys)
    outside = np.asarray(blur_mask(Image.open(mask), 4)) == 0
    assert pixels.shape == (32, 48, 3) and np.abs(pixels - _rgb(src))[outside].max() <= 2
    assert params["Masked content"] == "original"


def test_inpainting_model_without_a_source_is_text_to_image(inpaint_model, tmp_path, capsys):
    pixels, params, err = _run(_gen(inpaint_model, tmp_path / "out.png", "--width", "40", "--height", "24"), capsys)
    assert pixels.shape == (24, 40, 3) and pixels.std() > 0
    assert "Denoising strength" not in params and "Mask blur" not in params and "strength" not in err


def test_inpainting_model_needs_a_mask(inpaint_model, tmp_path, capsys):
    src = _source(tmp_path / "src.png", 32, 32)
    out = tmp_path / "out"
    out.mkdir()
    err = _fails(_gen(inpaint_model, out / "x.png", "--init-image", str(src)), capsys, out)
    assert "is an inpainting model: image to image needs a mask (--mask, --mask-from-alpha or --outpaint)" in err


# ---------------------------------------------------------------------------------------------- bad input

def _bomb(path):
    Image.new("L", (8193, 8193)).save(path)  # all black: about 70 kB on disk, 67 megapixels when decoded
    return path


# (arguments built from the folder of input files, what the message must say)
BAD_INPUT = [
    (lambda d: ["--init-image", str(d / "nope.png")], "init image {d}/nope.png: no such file"),
    (lambda d: ["--init-image", str(d)], "init image {d}: is a directory, not an image file"),
    (lambda d: ["--init-image", str(d / "text.png")], "init image {d}/text.png: not an image file"),
    (lambda d: ["--init-image", os.devnull], f"init image {os.devnull}: is not a regular file"),
    (lambda d: ["--init-image", str(_bomb(d / "bomb.png"))],
     "init image {d}/bomb.png: 8193x8193 is 67125249 pixels, more than the cap"),
    (lambda d: ["--init-image", str(d / "src.png"), "--mask", str(d / "nope.png")], "mask {d}/nope.png: no such file"),
    (lambda d: ["--init-image", str(d / "src.png"), "--strength", "0"],
     "strength 0.0 is not valid: it must be above 0 and at most 1"),
    (lambda d: ["--init-image", str(d / "src.png"), "--strength", "1.5"], "strength 1.5 is not valid"),
    (lambda d: ["--init-image", str(d / "src.png"), "--strength", "0.01", "--steps", "20"],
     "strength 0.01 with 20 steps runs int(20 x 0.01) = 0 steps"),
    (lambda d: ["--init-image", str(d / "src.png"), "--mask", str(d / "black.png")],
     "mask {d}/black.png is all black: nothing to repaint (white marks the area to repaint)"),
    (lambda d: ["--init-image", str(d / "src.png"), "--mask", str(d / "white.png"), "--invert-mask"],
     "mask {d}/white.png is all white: inverted (--invert-mask), it leaves nothing to repaint"),
    (lambda d: ["--init-image", str(d / "src.png"), "--mask-from-alpha"],
     "init image {d}/src.png: the image has no transparency (alpha channel) to use as a mask"),
    (lambda d: ["--init-image", str(d / "opaque.png"), "--mask-from-alpha"],
     "init image {d}/opaque.png has no transparent pixels to repaint (--mask-from-alpha repaints where its alpha"),
    (lambda d: ["--init-image", str(d / "src.png"), "--mask", str(d / "mask.png"), "--mask-from-alpha"],
     "give either a mask or mask_from_alpha (--mask-from-alpha), not both"),
    (lambda d: ["--init-image", str(d / "src.png"), "--outpaint", "12,0,0,0"],
     "outpaint left=12 is not valid: it must be a multiple of 8"),
    (lambda d: ["--init-image", str(d / "src.png"), "--outpaint", "1,2"],
     "outpaint '1,2' is not valid: expected four whole numbers of pixels LEFT,TOP,RIGHT,BOTTOM"),
    (lambda d: ["--init-image", str(d / "src.png"), "--outpaint", "8,x,8,0"], "outpaint '8,x,8,0' is not valid"),
    (lambda d: ["--mask", str(d / "mask.png")], "mask needs a source image (init_image / --init-image)"),
    (lambda d: ["--init-image", str(d / "src.png"), "--mask", str(d / "mask.png"), "--inpaint-fill", "bogus"],
     "inpaint fill 'bogus' is not valid: expected one of fill, original, latent-noise, latent-nothing"),
    (lambda d: ["--init-image", str(d / "src.png"), "--resize-mode", "bogus"],
     "resize mode 'bogus' is not valid: expected one of just-resize, crop, fill"),
    (lambda d: ["--init-image", str(d / "src.png"), "--mask", str(d / "mask.png"), "--inpaint-area", "crop"],
     "inpaint area 'crop' is not valid: expected one of whole, masked"),
    (lambda d: ["--init-image", str(d / "src.png"), "--mask", str(d / "mask.png"), "--mask-blur", "-1"],
     "mask blur -1 is not valid"),
    (lambda d: ["--strength", "0.5", "--no-overlay"], "--strength, --no-overlay need a source image"),
    (lambda d: ["--init-image", str(d / "src.png"), "--mask-blur", "8"],
     "--mask-blur needs a mask: add --mask PATH, --mask-from-alpha or --outpaint L,T,R,B"),
    (lambda d: ["--init-image", str(d / "src.png"), "--invert-mask"], "--invert-mask needs a mask to invert"),
]


@pytest.mark.parametrize("build,expected", BAD_INPUT, ids=[f"bad{i}" for i in range(len(BAD_INPUT))])
def test_bad_input_fails_before_the_model_load(model, tmp_path, capsys, monkeypatch, build, expected):
    inputs = tmp_path / "in"
    inputs.mkdir()
    _source(inputs / "src.png", 32, 32)
    _mask(inputs / "mask.png", 32, 32)
    _mask(inputs / "black.png", 32, 32, box=())
    _mask(inputs / "white.png", 32, 32, box=[0, 0, 31, 31])
    (inputs / "text.png").write_text("not a picture")
    Image.new("RGBA", (32, 32), (9, 9, 9, 200)).save(inputs / "opaque.png")
    out = tmp_path / "out"
    out.mkdir()

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was noticed")

    monkeypatch.setattr(Engine, "load", no_load)
    err = _fails(_gen(model, out / "x.png", *build(inputs)), capsys, out)
    assert expected.format(d=inputs) in err


# ---------------------------------------------------------------------------------------------- parameters text

def test_text_to_image_parameters_are_unchanged():
    req = validate(Request(prompt="a cat", width=512, height=512, steps=20, sampler="DPM++ 2M Karras", seed=42))
    assert infotext(req, 42, "abcdef0123", "m") == (
        "a cat\nSteps: 20, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7.5, Seed: 42, Size: 512x512, "
        f"Model hash: abcdef0123, Model: m, Version: sdlite {__version__}")


@pytest.mark.parametrize("options", [
    {"strength": 0.3, "resize_mode": "fill"},
    {"mask": "m.png", "strength": 0.55, "mask_blur": 0, "inpaint_fill": "latent-nothing", "invert_mask": True,
     "inpaint_area": "masked", "inpaint_padding": 12, "overlay": False, "resize_mode": "crop"},
    {"outpaint": (64, 0, 8, 16)},
    {"mask_from_alpha": True, "inpaint_fill": "fill"},
])
def test_image_parameters_round_trip(options):
    req = validate(Request(prompt="a cat", width=64, height=64, seed=1, init_image="src.png", **options))
    back = parse_infotext(infotext(req, 1, "abcdef0123", "m"))
    defaults = Request(prompt="")
    assert {name: back.get(name, getattr(defaults, name)) for name in REQUEST_IMAGE_FIELDS} == \
        {name: getattr(req, name) for name in REQUEST_IMAGE_FIELDS}


def test_a1111_image_parameters_parse():
    text = ("a cat\nSteps: 20, Sampler: Euler a, CFG scale: 7, Seed: 1, Size: 512x512, Denoising strength: 0.6, "
            "Mask blur: 4, Mask mode: Inpaint not masked, Masked content: lama cleaner, Inpaint area: Only masked, "
            "Masked area padding: 32")
    back = parse_infotext(text)
    assert (back["strength"], back["mask_blur"], back["invert_mask"], back["inpaint_area"]) == \
        (0.6, 4, True, "masked")
    assert "inpaint_fill" not in back and back["Masked content"] == "lama cleaner"
