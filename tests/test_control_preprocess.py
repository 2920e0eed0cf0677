"""ControlNet preprocessors and control-map fitting, against OpenCV and numpy computations of the extension's rules."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
from PIL import Image

from sdlite.control import ControlError
from sdlite.control import preprocess as P
from sdlite.control.apply import fit_control, hint_tensor


def photo(w: int = 96, h: int = 64, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:h, :w]
    img = np.stack([(xx * 255 // w), (yy * 255 // h), ((xx - w / 2) ** 2 + (yy - h / 2) ** 2 < (h / 3) ** 2) * 200],
                   axis=2) + rng.integers(0, 30, (h, w, 3))
    return Image.fromarray(img.clip(0, 255).astype(np.uint8))


def padded_run(img: np.ndarray, res: int, fn) -> np.ndarray:
    """The extension's resize_image_with_pad, written out: short side to res (area down, cubic up), edge-pad to 64."""
    h, w = img.shape[:2]
    k = res / min(h, w)
    th, tw = int(np.round(h * k)), int(np.round(w * k))
    img = cv2.resize(img, (tw, th), interpolation=cv2.INTER_CUBIC if k > 1 else cv2.INTER_AREA)
    ph, pw = -th % 64, -tw % 64
    out = fn(np.pad(img, [[0, ph], [0, pw], [0, 0]], mode="edge"))
    return out[:th, :tw]


@pytest.mark.parametrize("res,low,high", [(512, 100, 200), (64, 50, 120), (128, 1, 255)])
def test_canny_is_opencvs(res, low, high):
    image = photo()
    got = np.asarray(P.run("canny", image, res, low, high))
    want = padded_run(np.asarray(image), res, lambda x: cv2.Canny(x, low, high))
    assert got.shape == (*want.shape, 3) and np.array_equal(got[:, :, 0], want)
    assert np.array_equal(got[:, :, 0], got[:, :, 2]) and 0 < (want > 0).mean() < 0.5


def test_canny_defaults_are_a1111s():
    image = photo(seed=1)
    assert np.array_equal(np.asarray(P.run("canny", image)), np.asarray(P.run("canny", image, 512, 100, 200)))
    assert P.find("canny").defaults == (100, 200)


def test_invert_threshold_tile_blur():
    image = photo(seed=2)
    x = np.asarray(image)
    assert np.array_equal(np.asarray(P.run("invert (from white bg & black line)", image)), 255 - x)
    thr = np.asarray(P.run("threshold", image, 64, 127))
    want = padded_run(x, 64, lambda y: (np.min(y, axis=2) > 127).astype(np.uint8) * 255)
    assert np.array_equal(thr[:, :, 0], want)
    tile = np.asarray(P.run("tile_resample", image, 512, 2.0))
    assert tile.shape == (32, 48, 3)
    assert np.array_equal(np.asarray(P.run("tile_resample", image, 512, 1.0)), x)   # below 1.1: unchanged
    blur = np.asarray(P.run("blur_gaussian", image, 64, 3.0))
    assert np.array_equal(blur, padded_run(x, 64, lambda y: cv2.GaussianBlur(y, (0, 0), 3.0)))


def test_scribble_xdog_marks_edges():
    image = photo(seed=3)
    out = np.asarray(P.run("scribble_xdog", image, 64, 32))
    x = np.asarray(image).astype(np.float32)

    def xdog(y):
        y = y.astype(np.float32)
        dog = np.min(cv2.GaussianBlur(y, (0, 0), 5.0) - cv2.GaussianBlur(y, (0, 0), 0.5), axis=2)
        dog = (255 - dog).clip(0, 255).astype(np.uint8)
        return ((2 * (255 - dog.astype(np.int32))) > 32).astype(np.uint8) * 255
    assert np.array_equal(out[:, :, 0], padded_run(x.astype(np.uint8), 64, xdog))
    assert set(np.unique(out)) <= {0, 255}


def test_unknown_and_unavailable_are_named():
    with pytest.raises(ControlError, match="unknown ControlNet preprocessor 'sharpen'.*canny"):
        P.find("sharpen")
    with pytest.raises(ControlError, match="'openpose_full' needs an annotator network"):
        P.find("openpose_full")
    assert P.find("None").name == "none" and P.find("inpaint_only").name == "inpaint"


def test_pixel_perfect_resolution():
    # the extension's estimate: the short side scaled as the resize mode scales the image
    assert P.pixel_perfect_resolution((1024, 768), 512, 512, "crop-and-resize") == 512   # max(0.5, 0.667) * 768
    assert P.pixel_perfect_resolution((1024, 768), 512, 512, "resize-and-fill") == 384   # min(...) * 768
    assert P.pixel_perfect_resolution((300, 200), 768, 512, "just-resize") == 512


def test_fit_control_modes():
    image = photo(96, 64, seed=4)            # 3:2
    just = fit_control(image, 64, 64, "just-resize")
    assert just.size == (64, 64)
    crop = np.asarray(fit_control(image, 64, 64, "crop-and-resize"))
    # covering scale 1: the 64-px-high image keeps its pixels, the centre 64 columns cropped
    assert np.array_equal(crop, np.asarray(image)[:, 16:80])
    fill = np.asarray(fit_control(image, 96, 96, "resize-and-fill"))
    assert fill.shape == (96, 96, 3)
    assert np.array_equal(fill[16:80], np.asarray(image))       # fitted at scale 1, centred
    x = np.asarray(image)
    border = np.concatenate([x[0], x[-1], x[:, 0], x[:, -1]], axis=0)
    assert np.array_equal(fill[0, 0], np.median(border, axis=0).astype(np.uint8))   # the rest: the border's median


def test_binary_maps_stay_binary_when_resized():
    edges = np.zeros((64, 64, 3), np.uint8)
    edges[10:54, 31:33] = 255
    big = np.asarray(fit_control(Image.fromarray(edges), 128, 128, "just-resize"))
    assert set(np.unique(big)) <= {0, 255} and big[40, 64, 0] == 255


def test_hint_tensor_range_and_mask():
    image = photo(64, 64, seed=5)
    hint = hint_tensor(image)
    assert hint.shape == (1, 3, 64, 64) and float(hint.min()) >= 0 and float(hint.max()) <= 1
    assert np.allclose(hint[0].permute(1, 2, 0).numpy() * 255, np.asarray(image), atol=1e-3)
