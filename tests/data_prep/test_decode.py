"""Tests for leaflens.data_prep.decode: every mode to RGB, EXIF rotation, draft mode, broken-file reasons."""

from __future__ import annotations

import io
import os
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from leaflens.data_prep.decode import ImageDecodeError, decode_image, decode_image_at


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _halves(w: int = 40, h: int = 20) -> Image.Image:
    """Left half red, right half blue."""
    arr = np.zeros((h, w, 3), np.uint8)
    arr[:, : w // 2] = (255, 0, 0)
    arr[:, w // 2 :] = (0, 0, 255)
    return Image.fromarray(arr)


def test_plain_rgb_shape_and_colour():
    out = decode_image(_encode(Image.new("RGB", (30, 50), (10, 200, 30)), "PNG"), 16)
    assert out.shape == (16, 16, 3) and out.dtype == np.uint8
    assert np.all(out == (10, 200, 30))


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, displayed rotated 90 degrees clockwise
    data = _encode(_halves(), "JPEG", quality=95, exif=exif.tobytes())
    out = decode_image(data, 20).astype(int)
    top, bottom = out[:8].mean(axis=(0, 1)), out[-8:].mean(axis=(0, 1))
    assert top[0] > 200 and top[2] < 60, f"top should be red after rotation, got {top}"
    assert bottom[2] > 200 and bottom[0] < 60, f"bottom should be blue, got {bottom}"
    # Without the tag the same pixels stay left/right.
    plain = decode_image(_encode(_halves(), "JPEG", quality=95), 20).astype(int)
    assert plain[:, :8].mean(axis=(0, 1))[0] > 200 and plain[:, -8:].mean(axis=(0, 1))[2] > 200


def test_alpha_is_composited_on_white():
    rgba = Image.new("RGBA", (20, 20), (0, 0, 0, 0))  # fully transparent black
    out = decode_image(_encode(rgba, "PNG"), 8)
    assert np.all(out == 255)
    half = Image.new("RGBA", (20, 20), (0, 0, 0, 128))
    v = decode_image(_encode(half, "PNG"), 8)
    assert np.all(np.abs(v.astype(int) - 127) <= 2)
    la = Image.new("LA", (20, 20), (0, 0))
    assert np.all(decode_image(_encode(la, "PNG"), 8) == 255)


def test_palette_with_transparency():
    p = Image.new("P", (20, 20), 1)
    p.putpalette([0, 255, 0, 255, 0, 0] + [0] * 762)
    out = decode_image(_encode(p, "PNG", transparency=1), 8)
    assert np.all(out == 255)  # index 1 is transparent -> white
    out = decode_image(_encode(p, "PNG"), 8)
    assert np.all(out == (255, 0, 0))


def test_grayscale_and_16bit_are_scaled_not_clipped():
    grey = decode_image(_encode(Image.new("L", (20, 20), 77), "PNG"), 8)
    assert np.all(grey == 77)
    arr16 = np.full((20, 20), 40000, np.uint16)
    out = decode_image(_encode(Image.fromarray(arr16), "PNG"), 8)
    assert np.all(np.abs(out.astype(int) - round(40000 / 257)) <= 1), out[0, 0]


def test_cmyk_jpeg_and_tiff():
    cmyk = Image.new("CMYK", (24, 24), (0, 255, 255, 0))  # pure red in CMYK
    for fmt in ("JPEG", "TIFF"):
        out = decode_image(_encode(cmyk, fmt), 8).astype(int)
        assert out[..., 0].mean() > 200 and out[..., 1].mean() < 60 and out[..., 2].mean() < 60, fmt


def test_pad_mode_letterboxes_and_crop_mode_crops():
    im = Image.new("RGB", (80, 40), (200, 200, 200))
    pad = decode_image(_encode(im, "PNG"), 20, resize="pad")
    assert np.all(pad[:5] == 0) and np.all(pad[-5:] == 0) and np.all(pad[6:14] == 200)
    crop = decode_image(_encode(im, "PNG"), 20, resize="crop")
    assert np.all(crop == 200)


def test_decode_image_at_crops_from_larger_shorter_side():
    arr = np.zeros((100, 100, 3), np.uint8)
    arr[:10] = 255  # a white band along the top edge
    data = _encode(Image.fromarray(arr), "PNG")
    assert decode_image(data, 50)[:4].mean() > 200  # band visible without extra margin
    assert decode_image_at(data, 50, shorter_side=100)[:4].mean() < 1  # cropped away


def test_large_jpeg_uses_draft_and_matches_full_decode():
    """A 4000x3000 photo-like JPEG decodes at reduced scale yet matches a full decode closely."""
    yy, xx = np.mgrid[0:3000, 0:4000].astype(np.float32)
    arr = np.stack([128 + 100 * np.sin(xx / 300), 128 + 100 * np.cos(yy / 250),
                    128 + 80 * np.sin((xx + yy) / 400)], -1).astype(np.uint8)
    data = _encode(Image.fromarray(arr), "JPEG", quality=90)
    t0 = time.perf_counter()
    fast = decode_image(data, 64)
    t_fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = Image.open(io.BytesIO(data)).convert("RGB")
    ref = np.asarray(full.resize((64, 64), Image.Resampling.BOX, box=(500, 0, 3500, 3000)))
    t_full = time.perf_counter() - t0
    assert np.abs(fast.astype(int) - ref.astype(int)).mean() < 2.0
    assert t_fast < t_full, f"draft decode {t_fast:.3f}s not faster than full {t_full:.3f}s"


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_header_only(w: int, h: int) -> bytes:
    """A tiny PNG that declares w x h pixels but carries almost no data (a decompression bomb shape)."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _chunk(b"IEND", b""))


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "empty"),
        (b"this is a text file, not a picture\n" * 4, "not_an_image"),
        (_png_header_only(50_000, 50_000), "too_large"),  # bomb: refused from the header alone
        (_png_header_only(200_000, 200_000), "too_large"),  # beyond PIL's own hard limit
        (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", "heic_unsupported"),
    ],
)
def test_broken_inputs_have_reasons(data, reason):
    if reason == "heic_unsupported":
        try:
            import pillow_heif  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.skip("pillow-heif is installed, so HEIC is supported here")
    with pytest.raises(ImageDecodeError) as info:
        decode_image(data, 32)
    assert info.value.reason == reason


def test_truncated_jpeg_and_png(tmp_path):
    rng = np.random.default_rng(0)
    im = Image.fromarray(rng.integers(0, 255, (200, 200, 3), dtype=np.uint8))
    for fmt in ("JPEG", "PNG"):
        data = _encode(im, fmt)
        path = tmp_path / f"cut.{fmt.lower()}"
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(ImageDecodeError) as info:
            decode_image(path, 32)
        assert info.value.reason == "truncated", (fmt, info.value)
        assert str(path) in str(info.value)  # the message names the file


def test_missing_file_and_bad_arguments(tmp_path):
    with pytest.raises(ImageDecodeError) as info:
        decode_image(tmp_path / "nope.jpg", 32)
    assert info.value.reason == "unreadable"
    data = _encode(Image.new("RGB", (10, 10)), "PNG")
    with pytest.raises(ValueError):
        decode_image(data, 32, resize="stretch")
    with pytest.raises(ValueError):
        decode_image(data, 0)


def test_error_survives_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(ImageDecodeError("truncated", "a.jpg", "cut")))
    assert err.reason == "truncated" and "a.jpg" in str(err)


def test_the_header_says_mode_camera_orientation_and_jpeg_quality(tmp_path):
    """What preprocess's shortcut check reads about a file, from the parse the decode makes anyway."""
    exif = Image.Exif()
    exif[0x010F], exif[0x0110], exif[0x0112] = "Acme", "PhoneX", 6
    fine, coarse, grey = tmp_path / "fine.jpg", tmp_path / "coarse.jpg", tmp_path / "grey.png"
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    rgb.save(fine, quality=95, exif=exif)
    rgb.save(coarse, quality=40)
    rgb.convert("L").save(grey)
    headers = []
    for path in (fine, coarse, grey):
        header: dict = {}
        decode_image(path, 16, header=header)
        headers.append(header)
    assert headers[0]["camera"] == "Acme PhoneX" and headers[0]["orientation"] == 6 and headers[0]["mode"] == "RGB"
    assert 0 < headers[0]["jpeg_q"] < headers[1]["jpeg_q"]  # quality 95 quantises finer than 40
    assert headers[1]["camera"] == "" and headers[1]["orientation"] == 1
    assert headers[2]["mode"] == "L" and headers[2]["jpeg_q"] == 0


def test_read_source_refuses_what_is_not_a_regular_file_and_caps_the_bytes(tmp_path):
    from leaflens.data_prep.decode import read_source

    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    for special in (fifo, os.devnull, "/dev/zero"):  # a pipe would wait for a writer forever, /dev/zero never ends
        with pytest.raises(ImageDecodeError, match="not a regular file") as refused:
            read_source(special)
        assert refused.value.reason == "unreadable"
    big = tmp_path / "big.jpg"
    big.write_bytes(b"\xff\xd8\xff" + bytes(2000))
    assert len(read_source(big, max_bytes=2003)) == 2003
    with pytest.raises(ImageDecodeError, match="over") as refused:
        read_source(big, max_bytes=2002)
    assert refused.value.reason == "too_large"


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_tiff_orientation_is_applied_once_as_for_jpeg(orientation):
    """Pillow's TIFF loader turns the image upright itself: the decoder rotated it a second time (upside down
    for 3, the wrong quarter turn for 6 and 8), in preprocess, predict and the app alike."""
    upright = np.full((80, 120, 3), 255, np.uint8)
    upright[:20, :20] = (255, 0, 0)
    upright[:20, -20:] = (0, 255, 0)
    upright[-20:, :20] = (0, 0, 255)
    undo = {1: None, 3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}
    stored = Image.fromarray(upright)
    if undo[orientation] is not None:
        stored = stored.transpose(undo[orientation])  # what the camera wrote, to be turned upright by the tag
    exif = Image.Exif()
    exif[0x0112] = orientation
    tiff = decode_image(_encode(stored, "TIFF", exif=exif), 60, resize="pad")
    jpeg = decode_image(_encode(stored, "JPEG", quality=95, exif=exif.tobytes()), 60, resize="pad")
    want = decode_image(_encode(Image.fromarray(upright), "PNG"), 60, resize="pad")
    assert np.abs(tiff.astype(int) - want.astype(int)).max() <= 2
    assert np.abs(jpeg.astype(int) - want.astype(int)).mean() < 8


def test_a_tiny_file_declaring_a_huge_image_is_refused_in_any_format():
    """A 38-byte lossless WebP declaring 115 M pixels cost 1.9 GB to decode; only PNG was checked."""
    big = Image.new("L", (4000, 3000), 90)
    for fmt, kw in (("WEBP", {"lossless": True}), ("GIF", {})):  # a flat deflate TIFF stays under 1032:1
        data = _encode(big, fmt, **kw)
        assert len(data) * 1024 < 4000 * 3000, (fmt, len(data))  # the premise: far more pixels than bytes
        with pytest.raises(ImageDecodeError, match="decompression bomb") as err:
            decode_image(data, 16)
        assert err.value.reason == "too_large"
    noise = np.random.default_rng(0).integers(0, 255, (1500, 3000), np.uint8)  # 4.5 M pixels of real content
    assert decode_image(_encode(Image.fromarray(noise), "WEBP", lossless=True), 16).shape == (16, 16, 3)
    assert decode_image(_encode(Image.new("L", (1000, 1000), 90), "WEBP", lossless=True), 16).shape == (16, 16, 3)


def test_a_pixel_limit_above_pillows_own_is_honoured_and_the_message_is_ours(monkeypatch):
    """Pillow refuses images over twice its MAX_IMAGE_PIXELS in Image.open, whatever --max-pixels says, and its
    message quoted its own limit (178956970) where ours is 120 M."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # Pillow's refusal from 20,000 pixels: a small test
    data = _encode(Image.new("RGB", (200, 150), (10, 200, 30)), "JPEG")  # 30,000 pixels
    assert np.all(np.abs(decode_image(data, 8, max_pixels=50_000).astype(int) - (10, 200, 30)) <= 3)
    assert Image.MAX_IMAGE_PIXELS == 10_000  # put back
    with pytest.raises(ImageDecodeError, match="declared size 30000 pixels exceeds the limit of 25000"):
        decode_image(data, 8, max_pixels=25_000)


def test_16_bit_grey_with_a_transparency_key_is_white_there():
    arr = np.full((20, 20), 40000, np.uint16)
    arr[:10] = 0
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG", transparency=0)
    out = decode_image(buf.getvalue(), 20)
    assert np.all(out[:9] == 255) and np.all(np.abs(out[11:].astype(int) - round(40000 / 257)) <= 1)


@pytest.mark.parametrize("mode", ["I", "F"])
def test_one_stray_pixel_does_not_rescale_a_32_bit_photo(mode):
    """The scale of a 32-bit integer or float photo was chosen by its single highest pixel: one pixel at 256
    (or 1.02) turned a 0-255 (0-1) gradient black."""
    ramp = np.tile(np.linspace(0, 1, 64, dtype=np.float32), (64, 1))
    arr = (ramp * 255).astype(np.int32) if mode == "I" else ramp
    arr[0, 0] = 256 if mode == "I" else 1.02
    out = decode_image(_encode(Image.fromarray(arr, mode), "TIFF"), 64)
    assert 110 < out.mean() < 145


def test_a_tiff_above_pillows_limit_loads_when_the_callers_limit_allows_it(monkeypatch):
    """The limit was lifted around Image.open only; Pillow's TIFF loader checks again while loading."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # Pillow refuses from 20,000 pixels
    data = _encode(Image.new("L", (200, 150), 90), "TIFF")  # 30,000 pixels
    assert np.all(decode_image(data, 8, max_pixels=50_000) == 90)
    assert Image.MAX_IMAGE_PIXELS == 10_000


def test_a_bilevel_scan_is_not_taken_for_a_bomb():
    """A black-and-white leaf scan saved with CCITT Group 4 packs thousands of pixels in a byte."""
    scan = Image.new("1", (2600, 2000), 1)
    scan.paste(0, (800, 600, 1800, 1400))
    data = _encode(scan, "TIFF", compression="group4")
    assert 2600 * 2000 > 1024 * len(data)  # what the ratio check refuses for other modes
    out = decode_image(data, 16)
    assert out[8, 8].tolist() == [0, 0, 0] and out[0, 0].tolist() == [255, 255, 255]


def test_a_16_bit_png_read_as_mode_i_is_scaled_as_16_bit(monkeypatch):
    """Some Pillow versions load 16-bit grey PNGs as mode "I"; the percentile rule for 32-bit TIFFs would then
    decode the same file differently on two machines."""
    from leaflens.data_prep import decode as dec

    arr = np.full((100, 100), 200, np.uint16)
    arr[0, 0] = 65535
    img = Image.fromarray(arr.astype(np.int32), "I")
    assert dec._int_to_l(img, "PNG").getpixel((5, 5)) == round(200 / 257)
    assert dec._int_to_l(img, "TIFF").getpixel((5, 5)) == 200
