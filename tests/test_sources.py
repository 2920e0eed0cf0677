"""Tests of sdlite.sources: loading source images and masks, resizing, mask blur, fill, crop region, outpainting
canvas and paste-back. Every image is made here with PIL; expected values come from independent computations
(explicit loops, hand-derived A1111 arithmetic, or PIL's own primitives), never from the code under test."""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from sdlite.errors import SDLiteError
from sdlite.sources import (
    INPAINT_AREAS, INPAINT_FILLS, LANCZOS, MAX_PIXELS, RESIZE_MODES, ImageInputError, apply_overlay, blur_mask,
    check_mask_not_empty, crop_region, fill_masked, invert_mask, load_image, load_mask, outpaint_canvas,
    resize_image, to_rgb,
)


def px(image: Image.Image) -> np.ndarray:
    return np.asarray(image).astype(np.int64)


def random_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3)).astype(np.uint8), "RGB")


def test_constants():
    assert MAX_PIXELS == 67108864
    assert RESIZE_MODES == ("just-resize", "crop", "fill")
    assert INPAINT_FILLS == ("fill", "original", "latent-noise", "latent-nothing")
    assert INPAINT_AREAS == ("whole", "masked")
    assert issubclass(ImageInputError, SDLiteError) and issubclass(ImageInputError, ValueError)


# ---------------------------------------------------------------------------------------------- load_image: modes

def test_alpha_modes_become_rgba(tmp_path):
    rgba = Image.new("RGBA", (4, 3), (10, 20, 30, 40))
    rgba.save(tmp_path / "rgba.png")
    out = load_image(tmp_path / "rgba.png")
    assert out.mode == "RGBA" and out.getpixel((0, 0)) == (10, 20, 30, 40)

    la = Image.new("LA", (4, 3), (77, 5))
    la.save(tmp_path / "la.png")
    out = load_image(str(tmp_path / "la.png"))
    assert out.mode == "RGBA" and out.getpixel((2, 1)) == (77, 77, 77, 5)

    pal = Image.new("P", (4, 3), 1)
    pal.putpalette([0, 0, 0, 200, 100, 50, 1, 2, 3] + [0] * (256 * 3 - 9))
    pal.putpixel((0, 0), 2)
    pal.save(tmp_path / "pal.png", transparency=1)
    out = load_image(tmp_path / "pal.png")
    assert out.mode == "RGBA"
    assert out.getpixel((1, 1))[3] == 0  # index 1 is the transparent one
    assert out.getpixel((0, 0)) == (1, 2, 3, 255)


def test_opaque_modes_become_rgb(tmp_path):
    pal = Image.new("P", (4, 3), 1)
    pal.putpalette([0, 0, 0, 200, 100, 50] + [0] * (256 * 3 - 6))
    pal.save(tmp_path / "pal.png")
    out = load_image(tmp_path / "pal.png")
    assert out.mode == "RGB" and out.getpixel((3, 2)) == (200, 100, 50)

    grey = Image.new("L", (4, 3), 123)
    grey.save(tmp_path / "grey.png")
    out = load_image(tmp_path / "grey.png")
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (123, 123, 123)

    bits = Image.new("1", (4, 3), 0)
    bits.putpixel((1, 2), 1)
    bits.save(tmp_path / "bits.png")
    out = px(load_image(tmp_path / "bits.png"))
    assert out.shape == (3, 4, 3)
    assert (out[2, 1] == 255).all() and out.sum() == 3 * 255


def test_16bit_greyscale_is_scaled_not_clipped(tmp_path):
    values = np.array([[65535, 32896, 32767, 0, 257, 1000]], dtype=np.uint16)
    # value / 257 rounded, computed by hand: 255, 128, 127.49 -> 127, 0, 1, 3.89 -> 4
    expected = [255, 128, 127, 0, 1, 4]
    im = Image.fromarray(values)
    assert im.mode == "I;16"
    im.save(tmp_path / "deep.png")
    for source in (tmp_path / "deep.png", im, Image.fromarray(values.astype(np.int32))):  # file, I;16, I
        out = px(load_image(source))
        assert out.shape == (1, 6, 3)
        assert out[0, :, 0].tolist() == expected and (out[..., 0] == out[..., 2]).all()
    big_endian = Image.frombytes("I;16B", (6, 1), values.astype(">u2").tobytes())
    assert px(load_image(big_endian))[0, :, 1].tolist() == expected


def test_float_greyscale():
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0, 0.25]], dtype=np.float32))
    assert unit.mode == "F"
    assert px(load_image(unit))[0, :, 0].tolist() == [0, 128, 255, 64]  # 127.5 -> 128, 63.75 -> 64
    wide = Image.fromarray(np.array([[0.0, 12.0, 200.4, 300.0]], dtype=np.float32))
    assert px(load_image(wide))[0, :, 0].tolist() == [0, 12, 200, 255]


def test_jpeg_exif_orientation_6(tmp_path):
    stored = Image.new("RGB", (48, 24), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 8, 8))  # red block at the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    stored.save(tmp_path / "rotated.jpg", quality=95, exif=exif.tobytes())
    out = load_image(tmp_path / "rotated.jpg")
    assert out.mode == "RGB" and out.size == (24, 48)
    # Turning the picture 90 degrees clockwise carries its top-left corner to the top-right.
    r, g, b = out.getpixel((20, 3))
    assert r > 200 and b < 60
    r, g, b = out.getpixel((3, 3))
    assert b > 200 and r < 60


def test_webp_round_trip(tmp_path):
    source = random_rgb(16, 12)
    source.save(tmp_path / "x.webp", lossless=True)
    out = load_image(tmp_path / "x.webp")
    assert out.mode == "RGB" and (px(out) == px(source)).all()
    rgba = Image.new("RGBA", (8, 8), (1, 2, 3, 0))
    rgba.paste((9, 8, 7, 255), (0, 0, 4, 8))
    rgba.save(tmp_path / "a.webp", lossless=True, exact=True)
    out = load_image(tmp_path / "a.webp")
    assert out.mode == "RGBA" and out.getpixel((1, 1)) == (9, 8, 7, 255) and out.getpixel((6, 6))[3] == 0


# --------------------------------------------------------------------------------------------- load_image: errors

def test_not_an_image(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("these are not pixels\n")
    with pytest.raises(ImageInputError, match="notes.png.*not an image"):
        load_image(path)


def test_truncated_image(tmp_path):
    random_rgb(64, 64).save(tmp_path / "full.png")
    data = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[:len(data) // 2])
    with pytest.raises(ImageInputError, match="cut.png"):
        load_image(tmp_path / "cut.png")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ImageInputError, match=r"init image .*nothere\.png: no such file"):
        load_image(tmp_path / "nothere.png")
    with pytest.raises(ImageInputError, match="mask .*: is a directory"):
        load_image(tmp_path, what="mask")
    with pytest.raises(ImageInputError, match="init image"):
        load_image(42)


def _png_with_declared_size(path, width: int, height: int) -> None:
    """A tiny PNG (a 1x1 picture's data) whose header declares ``width`` x ``height``: decoding it would fail,
    so an error about the size proves the size was refused from the header alone."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0\0"))
                     + chunk(b"IEND", b""))


def test_decompression_bomb_refused_from_header(tmp_path, monkeypatch):
    path = tmp_path / "bomb.png"
    _png_with_declared_size(path, 8193, 8193)
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(1))
    with pytest.raises(ImageInputError) as err:
        load_image(path)
    text = str(err.value)
    assert "bomb.png" in text and "8193x8193" in text and str(8192 * 8192) in text
    assert decoded == []
    # At the cap exactly, the size is fine (and only decoding, stubbed out here, is left).
    _png_with_declared_size(path, 8192, 8192)
    monkeypatch.undo()
    with pytest.raises(ImageInputError, match="cannot be decoded"):
        load_image(path)
    # An in-memory image is checked too (a lazily created image costs nothing here).
    monkeypatch.setattr(Image.Image, "size", property(lambda self: (9000, 9000)))
    with pytest.raises(ImageInputError, match="9000x9000"):
        load_image(Image.new("L", (1, 1)))


def test_pillow_own_bomb_check_is_reported(tmp_path, monkeypatch):
    Image.new("L", (20, 20)).save(tmp_path / "small.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 400 pixels > 2 * 100: Pillow refuses it itself
    with pytest.raises(ImageInputError, match="small.png.*decompression bomb"):
        load_image(tmp_path / "small.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)  # 400 > 300: only Pillow's warning
    with pytest.raises(ImageInputError, match="small.png.*decompression bomb"):
        load_image(tmp_path / "small.png")


def test_to_rgb_keeps_colour_under_transparency():
    rgba = Image.new("RGBA", (2, 1), (10, 20, 30, 0))
    rgba.putpixel((1, 0), (40, 50, 60, 128))
    out = to_rgb(rgba)
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (10, 20, 30) and out.getpixel((1, 0)) == (40, 50, 60)


# ------------------------------------------------------------------------------------------------------ load_mask

def test_load_mask_thresholds_greyscale(tmp_path):
    grey = Image.fromarray(np.array([[0, 128, 129, 255, 200, 3]], dtype=np.uint8), "L")
    grey.save(tmp_path / "m.png")
    for source in (tmp_path / "m.png", grey, grey.convert("RGB")):
        out = load_mask(source)
        assert out.mode == "L" and px(out)[0].tolist() == [0, 0, 255, 255, 255, 0]


def test_load_mask_alpha_rule():
    alpha = np.array([[0, 128, 129, 255]], dtype=np.uint8)
    colour = np.array([[[255, 255, 255], [255, 255, 255], [0, 0, 0], [0, 0, 0]]], dtype=np.uint8)
    rgba = Image.fromarray(np.concatenate([colour, alpha[..., None]], axis=2), "RGBA")
    # Alpha not all 255: the alpha channel is the mask (opaque = repaint), the colour is ignored.
    assert px(load_mask(rgba))[0].tolist() == [0, 0, 255, 255]
    # Alpha all 255: the greyscale is the mask.
    opaque = Image.fromarray(np.concatenate([colour, np.full_like(alpha, 255)[..., None]], axis=2), "RGBA")
    assert px(load_mask(opaque))[0].tolist() == [255, 255, 0, 0]


def test_load_mask_from_alpha(tmp_path):
    alpha = np.array([[0, 126, 127, 128, 255]], dtype=np.uint8)
    rgba = Image.fromarray(np.dstack([np.full((1, 5, 3), 255, np.uint8), alpha[..., None]]), "RGBA")
    # Inverted alpha 255, 129, 128, 127, 0; then > 128.
    assert px(load_mask(rgba, from_alpha=True))[0].tolist() == [255, 255, 0, 0, 0]
    Image.new("RGB", (3, 3)).save(tmp_path / "flat.png")
    with pytest.raises(ImageInputError, match="flat.png.*no transparency"):
        load_mask(tmp_path / "flat.png", from_alpha=True)
    with pytest.raises(ImageInputError, match="^mask: .*no transparency"):
        load_mask(Image.new("L", (3, 3)), from_alpha=True)


def test_invert_and_empty_mask():
    mask = Image.fromarray(np.array([[0, 255, 10]], dtype=np.uint8), "L")
    assert px(invert_mask(mask))[0].tolist() == [255, 0, 245]
    check_mask_not_empty(mask)
    with pytest.raises(ImageInputError, match="^inpaint mask is all black: nothing to repaint"):
        check_mask_not_empty(Image.new("L", (4, 4)), what="inpaint mask")


# --------------------------------------------------------------------------------------------------- resize_image

def _stripes(width: int, height: int, cuts: tuple[int, int]) -> Image.Image:
    """Red up to column cuts[0], green up to cuts[1], blue after."""
    data = np.zeros((height, width, 3), np.uint8)
    data[:, :cuts[0], 0] = 255
    data[:, cuts[0]:cuts[1], 1] = 255
    data[:, cuts[1]:, 2] = 255
    return Image.fromarray(data, "RGB")


def test_resize_just_resize_stretches():
    source = _stripes(200, 100, (40, 160))
    out = resize_image(source, 64, 48)
    assert out.size == (64, 48) and out.mode == "RGB"
    assert (px(out) == px(source.resize((64, 48), LANCZOS))).all()
    assert out.getpixel((2, 24))[0] > 240  # the red stripe is still there, squeezed


def test_resize_crop_keeps_the_centre():
    source = _stripes(200, 100, (40, 160))
    out = resize_image(source, 64, 64, "crop")
    assert out.size == (64, 64)
    # Scaled to 128x64, the 64 columns kept are source columns 50..150, all green and far from the stripes' edges.
    assert (np.abs(px(out) - [0, 255, 0]) <= 1).all()
    tall = resize_image(source.transpose(Image.Transpose.TRANSPOSE), 64, 64, "crop")
    assert (np.abs(px(tall) - [0, 255, 0]) <= 1).all()


def test_resize_fill_bands_copy_the_edges():
    source = random_rgb(100, 50, seed=3)
    out = px(resize_image(source, 64, 64, "fill"))
    # Fitted to 64x32 (A1111: src_h = 50 * 64 // 100), pasted at y = 32 - 16 = 16.
    fitted = px(source.resize((64, 32), LANCZOS))
    assert (out[16:48] == fitted).all()
    assert (out[:16] == fitted[0]).all() and (out[48:] == fitted[-1]).all()

    wide_target = px(resize_image(source.transpose(Image.Transpose.TRANSPOSE), 64, 64, "fill"))
    fitted = px(source.transpose(Image.Transpose.TRANSPOSE).resize((32, 64), LANCZOS))
    assert (wide_target[:, 16:48] == fitted).all()
    assert (wide_target[:, :16] == fitted[:, :1]).all() and (wide_target[:, 48:] == fitted[:, -1:]).all()

    # An odd gap: 24x10 into 24x15 fits as 24x10 at y = 7 - 5 = 2; the bands take rows 0..1 and 12..14.
    odd = px(resize_image(random_rgb(24, 10, seed=4), 24, 15, "fill"))
    assert (odd[:2] == odd[2]).all() and (odd[12:] == odd[11]).all()


def test_resize_keeps_l_masks_and_rejects_unknown_modes():
    mask = Image.new("L", (40, 20), 0)
    mask.paste(255, (0, 0, 40, 10))
    for mode in RESIZE_MODES:
        out = resize_image(mask, 32, 32, mode)
        assert out.mode == "L" and out.size == (32, 32)
    fill = px(resize_image(mask, 32, 32, "fill"))  # fitted as 32x16 at y=8: the top band is white, bottom black
    assert (fill[:8] == 255).all() and (fill[24:] == 0).all()
    with pytest.raises(ImageInputError, match="just-resize, crop, fill"):
        resize_image(mask, 32, 32, "stretch")


# ------------------------------------------------------------------------------------------------------ blur_mask

def _blur_reference(values: np.ndarray, sigma: float) -> np.ndarray:
    """Direct 2-D Gaussian (outer product of the 1-D kernel) with reflect-101 borders, by explicit loops."""
    half = int(2.5 * sigma + 0.5)
    taps = [math.exp(-(i * i) / (2 * sigma * sigma)) for i in range(-half, half + 1)]
    total = sum(taps)
    taps = [t / total for t in taps]

    def reflect(i: int, n: int) -> int:
        while i < 0 or i >= n:
            i = -i if i < 0 else 2 * (n - 1) - i
        return i

    h, w = values.shape
    out = np.zeros((h, w))
    for y in range(h):
        for x in range(w):
            acc = 0.0
            for dy in range(-half, half + 1):
                for dx in range(-half, half + 1):
                    acc += taps[dy + half] * taps[dx + half] * values[reflect(y + dy, h), reflect(x + dx, w)]
            out[y, x] = acc
    return out


def test_blur_constant_and_zero_radius():
    flat = Image.new("L", (13, 7), 173)
    assert (px(blur_mask(flat, 3.0)) == 173).all()
    mask = Image.fromarray(np.random.RandomState(1).randint(0, 256, (5, 6)).astype(np.uint8), "L")
    same = blur_mask(mask, 0)
    assert same is not mask and (px(same) == px(mask)).all()


@pytest.mark.parametrize("sigma, shape, point", [(1.0, (9, 9), (4, 4)), (1.5, (5, 7), (0, 1)), (0.7, (6, 3), (5, 2))])
def test_blur_point_matches_direct_2d(sigma, shape, point):
    values = np.zeros(shape, np.uint8)
    values[point] = 255
    values[-1, 0] = 90  # a second feature at a corner, so the border handling matters
    got = px(blur_mask(Image.fromarray(values, "L"), sigma))
    want = _blur_reference(values.astype(np.float64), sigma)
    assert np.abs(got - want).max() <= 1  # A1111 rounds to 8 bits between the horizontal and vertical passes


def test_blur_step_edge_is_symmetric():
    values = np.zeros((6, 20), np.uint8)
    values[:, 10:] = 255
    out = px(blur_mask(Image.fromarray(values, "L"), 2.0))
    row = out[0]
    assert (out == row).all()
    assert (np.diff(row) >= 0).all() and row[0] == 0 and row[-1] == 255
    assert (np.abs(row + row[::-1] - 255) <= 1).all()  # v(9 - k) + v(10 + k) = 255
    assert 0 < row[9] < 128 < row[10] < 255


# ---------------------------------------------------------------------------------------------------- fill_masked

def test_fill_masked_uniform_hole():
    image = Image.new("RGB", (64, 48), (100, 150, 200))
    image.paste((255, 0, 255), (20, 10, 44, 38))  # garbage under the hole: it must not leak into the fill
    mask = Image.new("L", (64, 48), 0)
    mask.paste(255, (20, 10, 44, 38))
    out = fill_masked(image, mask)
    assert out.mode == "RGB" and out.size == (64, 48)
    error = np.abs(px(out)[10:38, 20:44] - [100, 150, 200])
    # Premultiplied 8-bit layers of low alpha round a little: a few units at most, about 1 on average.
    assert error.max() <= 6 and error.mean() < 1.5


def test_fill_masked_keeps_unmasked_and_spreads_nearby_colour():
    image = np.array(random_rgb(64, 64, seed=7))
    image[:, :32] = (220, 30, 30)  # red left half
    image[:, 32:] = (30, 30, 220)  # blue right half
    image[50:, :] = np.array(random_rgb(64, 14, seed=8))
    source = Image.fromarray(image, "RGB")
    mask = np.zeros((64, 64), np.uint8)
    mask[20:36, 4:20] = 255  # a hole inside the red half
    out = px(fill_masked(source, Image.fromarray(mask, "L")))
    assert (out[mask == 0] == image[mask == 0]).all()
    centre = out[28, 12]
    assert centre[0] > 150 and centre[2] < 100


# ---------------------------------------------------------------------------------------------------- crop_region

def test_crop_region_padding_and_aspect():
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (10, 20, 20, 25))  # bounding box (10, 20, 20, 25)
    # Padded by 2: (8, 18, 22, 27), 14x9; for 1:1 the height grows by int(14 - 9) = 5: 2 above, 3 below.
    assert crop_region(mask, 2, 512, 512) == (8, 16, 22, 30)
    # For 768:512 (1.5) the box 14x9 (1.556) is wider: height 14 / 1.5 = 9.33, grows by int(0.33) = 0.
    assert crop_region(mask, 2, 768, 512) == (8, 18, 22, 27)
    # For 512:768 (0.667) the box is wider still: height 14 / (2/3) = 21, grows by 12: 6 above, 6 below.
    assert crop_region(mask, 2, 512, 768) == (8, 12, 22, 33)
    # A tall box 4x20 for 1:1: the width grows by 16, 8 on each side.
    tall = Image.new("L", (64, 64), 0)
    tall.paste(255, (10, 10, 14, 30))
    assert crop_region(tall, 0, 512, 512) == (2, 10, 22, 30)


def test_crop_region_at_borders_and_small_images():
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 4, 2))
    # 4x2 -> height 4: y1 = -1, y2 = 3; shifted down to (0, 4).
    assert crop_region(mask, 0, 64, 64) == (0, 0, 4, 4)
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (60, 62, 64, 64))
    # Bottom-right 4x2: y grows to 61..65, shifted up by 1 to 60..64.
    assert crop_region(mask, 0, 64, 64) == (60, 60, 64, 64)
    # An image too small for the aspect ratio: 10x4 all white, 1:1 wants 10x10; clipped to the image.
    assert crop_region(Image.new("L", (10, 4), 255), 0, 512, 512) == (0, 0, 10, 4)
    # Padding is clipped to the image.
    mask = Image.new("L", (32, 32), 0)
    mask.putpixel((16, 16), 1)
    assert crop_region(mask, 100, 64, 64) == (0, 0, 32, 32)


def test_crop_region_all_black():
    with pytest.raises(ImageInputError, match="all black: nothing to repaint"):
        crop_region(Image.new("L", (8, 8)), 4, 64, 64)


# ------------------------------------------------------------------------------------------------ outpaint_canvas

def test_outpaint_canvas():
    source = random_rgb(16, 8, seed=5)
    src = px(source)
    canvas, mask = outpaint_canvas(source, left=8, top=0, right=16, bottom=8)
    assert canvas.mode == "RGB" and mask.mode == "L"
    assert canvas.size == (40, 16) and mask.size == (40, 16)
    c, m = px(canvas), px(mask)
    assert (c[0:8, 8:24] == src).all()
    for x in range(8):  # left border: each row's first pixel
        assert (c[0:8, x] == src[:, 0]).all()
    for x in range(24, 40):  # right border: each row's last pixel
        assert (c[0:8, x] == src[:, -1]).all()
    for y in range(8, 16):  # bottom border: the last row, extended by its own corners
        assert (c[y, 8:24] == src[-1]).all()
        assert (c[y, :8] == src[-1, 0]).all() and (c[y, 24:] == src[-1, -1]).all()
    assert (m[0:8, 8:24] == 0).all() and m.sum() == 255 * (40 * 16 - 16 * 8)


def test_outpaint_canvas_rejects_bad_amounts():
    source = random_rgb(16, 8)
    with pytest.raises(ImageInputError, match="outpaint left=12 is not a multiple of 8"):
        outpaint_canvas(source, 12, 0, 0, 0)
    with pytest.raises(ImageInputError, match="outpaint bottom=-8"):
        outpaint_canvas(source, 0, 0, 0, -8)
    with pytest.raises(ImageInputError, match="all 0"):
        outpaint_canvas(source, 0, 0, 0, 0)
    with pytest.raises(ImageInputError, match="top"):
        outpaint_canvas(source, 0, 8.0, 0, 0)


# -------------------------------------------------------------------------------------------------- apply_overlay

def _mask_with_levels(width: int, height: int) -> np.ndarray:
    mask = np.zeros((height, width), np.uint8)
    mask[:, width // 4:width // 2] = 64
    mask[:, width // 2:3 * width // 4] = 128
    mask[:, 3 * width // 4:] = 255
    return mask


def test_apply_overlay_whole_image():
    source, result = random_rgb(32, 16, seed=1), random_rgb(32, 16, seed=2)
    mask = _mask_with_levels(32, 16)
    out = px(apply_overlay(result, source, Image.fromarray(mask, "L")))
    s, r = px(source), px(result)
    assert (out[mask == 0] == s[mask == 0]).all()
    assert (out[mask >= 128] == r[mask >= 128]).all()
    # 64 doubled is 128: the source comes back with alpha 255 - 128 = 127.
    blend = s * 127 / 255 + r * 128 / 255
    assert np.abs(out[mask == 64] - blend[mask == 64]).max() <= 1
    # A result of another size is resized to the source's first.
    out = px(apply_overlay(result.resize((64, 32)), source, Image.fromarray(mask, "L")))
    expected = px(result.resize((64, 32)).resize((32, 16), LANCZOS))
    assert (out[mask == 255] == expected[mask == 255]).all()


def test_apply_overlay_paste_box():
    source = random_rgb(40, 32, seed=3)
    result = random_rgb(32, 32, seed=4)  # generated at 32x32 for the 16x16 box below
    box = (8, 12, 24, 28)
    mask = np.zeros((32, 40), np.uint8)
    mask[14:26, 10:16] = 255
    mask[14:26, 16:22] = 128
    out = px(apply_overlay(result, source, Image.fromarray(mask, "L"), paste_box=box))
    s = px(source)
    pasted = s.copy()
    pasted[12:28, 8:24] = px(result.resize((16, 16), LANCZOS))
    assert (out[mask == 0] == s[mask == 0]).all()
    assert (out[mask == 255] == pasted[mask == 255]).all()
    # "Only masked" does not double the mask: 128 leaves the source at alpha 127.
    blend = s * 127 / 255 + pasted * 128 / 255
    assert np.abs(out[mask == 128] - blend[mask == 128]).max() <= 1
    doubled = px(apply_overlay(result, source, Image.fromarray(mask, "L"), paste_box=box, double_mask=True))
    assert (doubled[mask == 128] == pasted[mask == 128]).all()
    with pytest.raises(ImageInputError, match="paste box"):
        apply_overlay(result, source, Image.fromarray(mask, "L"), paste_box=(30, 0, 50, 10))
    with pytest.raises(ImageInputError, match="mask: size"):
        apply_overlay(result, source, Image.new("L", (8, 8)))
