"""Tests for leaflens.data_prep.quality (photos refused before the model, with a reason) and for the
``min_side`` option of the decoder ("too_small"). Every image is generated here with seeded NumPy; one test
checks a sample of the real photos in /work/shared/data and is skipped where they are absent."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter

from leaflens.data_prep.contract import PreprocessContract, decode_stored
from leaflens.data_prep.decode import ImageDecodeError, decode_image, decode_image_at
from leaflens.data_prep.quality import (
    MIN_DETAIL_SHARE,
    UNIFORM_STD,
    PhotoRefused,
    check_photo,
    photo_stats,
    refusal_reason,
)
from leaflens.data_prep.synth import CLASSES, render

SIZES = (64, 128, 256)


def _encode(arr: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


def _two_colours(rng: np.random.Generator, min_diff: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Two random colours that differ by at least ``min_diff`` grey levels in some channel."""
    while True:
        a, b = rng.integers(0, 256, (2, 3))
        if np.abs(a - b).max() >= min_diff:
            return a.astype(np.float64), b.astype(np.float64)


def _solid(colour, size: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(colour, np.uint8), (size, size, 3)).copy()


def _linear_gradient(rng: np.random.Generator, size: int) -> np.ndarray:
    a, b = _two_colours(rng)
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    t = xx * np.cos(angle) + yy * np.sin(angle)
    t = (t - t.min()) / (t.max() - t.min())
    return np.clip(np.rint(a + (b - a) * t[..., None]), 0, 255).astype(np.uint8)


def _radial_gradient(rng: np.random.Generator, size: int) -> np.ndarray:
    a, b = _two_colours(rng)
    cy, cx = rng.uniform(0, size, 2)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    t = np.hypot(yy - cy, xx - cx)
    t /= t.max()
    return np.clip(np.rint(a + (b - a) * t[..., None]), 0, 255).astype(np.uint8)


def _checkerboard(a, b, size: int, square: int) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size]
    odd = ((yy // square + xx // square) % 2).astype(bool)
    return np.where(odd[..., None], np.asarray(a, np.uint8), np.asarray(b, np.uint8)).astype(np.uint8)


def _reason(pixels: np.ndarray) -> str | None:
    found = refusal_reason(pixels)
    return None if found is None else found[0]


# ----------------------------------------------------------------------------- refused: uniform
@pytest.mark.parametrize("size", SIZES)
def test_solid_colours_are_uniform(size):
    rng = np.random.default_rng(size)
    colours = [(0, 0, 0), (255, 255, 255), (128, 128, 128)] + [tuple(c) for c in rng.integers(0, 256, (20, 3))]
    for colour in colours:
        found = refusal_reason(_solid(colour, size))
        assert found is not None and found[0] == "uniform", colour
        assert found[1] == {"colour_std": 0.0, "detail_share": 0.0}


@pytest.mark.parametrize("size", SIZES)
def test_solid_colours_with_mild_noise_or_jpeg_are_uniform(size):
    rng = np.random.default_rng(100 + size)
    for sigma in (1.0, 2.0, 3.0):
        for channels in (1, 3):  # the same noise in every channel (grey) or independent per channel
            for _ in range(5):
                base = rng.integers(0, 256, 3).astype(np.float64)
                noise = rng.normal(0, sigma, (size, size, channels))
                pixels = np.clip(np.rint(base + noise), 0, 255).astype(np.uint8)
                assert _reason(pixels) == "uniform", (sigma, channels, base)
    for quality in (30, 60, 90):  # JPEG noise: a noisy flat colour photographed, saved and decoded
        base = rng.integers(0, 256, 3).astype(np.float64)
        big = np.clip(np.rint(base + rng.normal(0, 3, (300, 400, 3))), 0, 255).astype(np.uint8)
        pixels = decode_image(_encode(big, "JPEG", quality=quality), size)
        assert _reason(pixels) == "uniform", quality


# ----------------------------------------------------------------------------- refused: low texture
@pytest.mark.parametrize("size", SIZES)
def test_smooth_gradients_are_low_texture(size):
    rng = np.random.default_rng(200 + size)
    for make in (_linear_gradient, _radial_gradient):
        for _ in range(10):
            pixels = make(rng, size)
            found = refusal_reason(pixels)
            assert found is not None and found[0] == "low_texture", (make.__name__, found)
            assert found[1]["colour_std"] >= UNIFORM_STD and found[1]["detail_share"] < MIN_DETAIL_SHARE
        # The same gradient photographed large and saved as an ordinary JPEG.
        pixels = decode_image(_encode(make(rng, 400), "JPEG", quality=85), size)
        assert _reason(pixels) == "low_texture", make.__name__


@pytest.mark.parametrize("size", SIZES)
def test_tiny_images_blown_up_are_refused(size):
    rng = np.random.default_rng(300 + size)
    for _ in range(5):
        one = decode_image(_encode(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8)), size)
        assert _reason(one) == "uniform"
    for k in (2, 3, 4):
        for _ in range(5):
            a, b = _two_colours(rng)
            tiny = _checkerboard(a, b, k, 1)  # k x k pixels of two clearly different colours
            pixels = decode_image(_encode(tiny), size)
            assert _reason(pixels) == "low_texture", (k, a, b, photo_stats(pixels))


def test_heavily_blurred_leaf_is_low_texture():
    rng = np.random.default_rng(400)
    for cls in CLASSES:
        leaf = render(cls, 128, rng)
        assert _reason(leaf) is None, cls  # sharp: analysed
        blurred = np.asarray(Image.fromarray(leaf).filter(ImageFilter.GaussianBlur(8)))
        assert _reason(blurred) == "low_texture", cls


# ----------------------------------------------------------------------------- not refused
@pytest.mark.parametrize("size", SIZES)
def test_noise_and_checkerboards_are_left_to_the_model(size):
    rng = np.random.default_rng(500 + size)
    for _ in range(3):
        assert _reason(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) is None
        grey = np.clip(np.rint(128 + rng.normal(0, 40, (size, size, 3))), 0, 255).astype(np.uint8)
        assert _reason(grey) is None
    for square in (1, 2, 4, 8):
        for a, b in [((0, 0, 0), (255, 255, 255)), *(tuple(map(tuple, _two_colours(rng))) for _ in range(3))]:
            assert _reason(_checkerboard(a, b, size, square)) is None, (square, a, b)
        # Red and green of (nearly) equal luminance: detail is counted in every colour channel.
        assert _reason(_checkerboard((200, 50, 50), (50, 125, 50), size, square)) is None, square


@pytest.mark.parametrize("size", SIZES)
def test_leaf_like_textured_images_are_analysed(size):
    rng = np.random.default_rng(600 + size)
    for cls in CLASSES:
        for _ in range(2):
            leaf = render(cls, size, rng)
            assert _reason(leaf) is None, (cls, photo_stats(leaf))
            # ... also after the round trip through a JPEG file and the decoder, as served.
            assert _reason(decode_image(_encode(leaf, "JPEG", quality=80), size)) is None, cls
    for _ in range(5):  # a textured patch of leaf colour, like the data_prep test photos
        colour = np.array([40, 150, 50]) + rng.integers(-30, 31, 3)
        patch = np.clip(colour + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
        assert _reason(patch) is None


# ----------------------------------------------------------------------------- API
def test_check_photo_raises_photo_refused_with_reason_and_values():
    rng = np.random.default_rng(700)
    check_photo(render("healthy", 128, rng), "leaf.jpg")  # analysed: no exception
    with pytest.raises(PhotoRefused) as info:
        check_photo(_solid((30, 120, 40), 128), "wall.jpg")
    err = info.value
    assert isinstance(err, ImageDecodeError) and isinstance(err, ValueError)
    assert (err.reason, err.source) == ("uniform", "wall.jpg")
    assert str(err).startswith("wall.jpg: not analysed (uniform): ") and "cannot decode" not in str(err)
    assert "standard deviation 0.0" in err.detail and f"{UNIFORM_STD:g}" in err.detail
    with pytest.raises(PhotoRefused) as info:
        check_photo(_linear_gradient(rng, 128), "sky.png")
    assert info.value.reason == "low_texture" and str(info.value).startswith("sky.png: not analysed (low_texture): ")
    assert f"{MIN_DETAIL_SHARE:.0%}" in info.value.detail


def test_photo_refused_survives_pickling():
    err = PhotoRefused("low_texture", "a.jpg", "too little fine detail")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is PhotoRefused
    assert (back.reason, back.source, back.detail, str(back)) == (err.reason, err.source, err.detail, str(err))
    assert str(back) == "a.jpg: not analysed (low_texture): too little fine detail"


def test_refusal_values_are_the_photo_stats_and_bad_input_is_refused():
    pixels = _radial_gradient(np.random.default_rng(800), 128)
    found = refusal_reason(pixels)
    assert found is not None and found[1] == photo_stats(pixels)
    # Not square and not a multiple of the patch size: still measured.
    assert _reason(_solid((9, 9, 9), 100)[:, :70]) == "uniform"
    for bad in (np.zeros((64, 64, 3), np.float32), np.zeros((64, 64), np.uint8), np.zeros((64, 64, 4), np.uint8),
                np.zeros((2, 2, 3), np.uint8)):
        with pytest.raises(ValueError, match="uint8"):
            refusal_reason(bad)


SHARED = Path(os.environ.get("LEAFLENS_SHARED_DATA", "/work/shared/data"))


@pytest.mark.skipif(not (SHARED / "ibeans").is_dir() or not (SHARED / "insects").is_dir(),
                    reason=f"real photos not found under {SHARED}")
def test_a_sample_of_real_photos_is_analysed():
    """50 iBeans and 50 insect photos (evenly spaced in name order), decoded as the Predictor does."""
    contract = PreprocessContract(stored_size=128, input_size=64, mean=(0.5,) * 3, std=(0.25,) * 3)
    for folder in ("ibeans", "insects"):
        paths = sorted((SHARED / folder).rglob("*.jpg"))
        assert len(paths) >= 50, folder
        for path in paths[:: len(paths) // 50][:50]:
            assert refusal_reason(contract.decode(path)) is None, path


# ----------------------------------------------------------------------------- decode(min_side=...)
def _png(w: int, h: int, seed: int = 0) -> bytes:
    return _encode(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize(("w", "h", "refused"), [(31, 40, True), (32, 40, False), (40, 31, True), (40, 32, False),
                                                 (31, 31, True), (32, 32, False)])
def test_min_side_boundaries(w, h, refused):
    data = _png(w, h)
    if refused:
        with pytest.raises(ImageDecodeError) as info:
            decode_image(data, 16, min_side=32)
        assert info.value.reason == "too_small" and info.value.source == "<bytes>"
        assert info.value.detail == f"{w}x{h} px, smaller than 32 px on a side"
        assert "cannot decode image (too_small)" in str(info.value)
    else:
        np.testing.assert_array_equal(decode_image(data, 16, min_side=32), decode_image(data, 16))


def test_min_side_is_measured_after_exif_rotation():
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 40 wide x 31 high, shown rotated: 31 wide x 40 high
    stored = np.random.default_rng(1).integers(0, 256, (31, 40, 3), dtype=np.uint8)
    data = _encode(stored, "JPEG", quality=95, exif=exif.tobytes())
    with pytest.raises(ImageDecodeError, match=r"31x40 px, smaller than 32 px") as info:
        decode_image(data, 16, min_side=32)
    assert info.value.reason == "too_small"
    ok = _encode(np.random.default_rng(2).integers(0, 256, (32, 40, 3), dtype=np.uint8), "JPEG",
                 exif=exif.tobytes())
    assert decode_image(ok, 16, min_side=32).shape == (16, 16, 3)


def test_min_side_through_every_entry_point(tmp_path):
    small = tmp_path / "thumb.png"
    small.write_bytes(_png(20, 50))
    contract = PreprocessContract(stored_size=16, input_size=8, mean=(0.5,) * 3, std=(0.25,) * 3)
    for call in (lambda: decode_image(small, 16, min_side=21),
                 lambda: decode_image_at(small, 16, shorter_side=18, min_side=21),
                 lambda: decode_stored(small, 16, "pad", min_side=21),
                 lambda: contract.decode(small, min_side=21)):
        with pytest.raises(ImageDecodeError, match="thumb.png: cannot decode image") as info:
            call()
        assert info.value.reason == "too_small" and info.value.detail == "20x50 px, smaller than 21 px on a side"
    assert contract.decode(small, min_side=20).shape == (16, 16, 3)


def test_default_min_side_keeps_todays_behaviour(tmp_path):
    one = tmp_path / "one.png"
    one.write_bytes(_png(1, 1))
    contract = PreprocessContract(stored_size=32, input_size=16, mean=(0.5,) * 3, std=(0.25,) * 3)
    out = contract.decode(one)  # a 1x1 image still decodes without min_side (preprocess keeps every photo)
    assert out.shape == (32, 32, 3)
    np.testing.assert_array_equal(out, decode_image(one, 32))
    np.testing.assert_array_equal(out, decode_image(one, 32, min_side=0))
    np.testing.assert_array_equal(decode_image_at(one, 16, shorter_side=24), decode_image_at(one, 16, shorter_side=24,
                                                                                            min_side=0))
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="min_side"):
            decode_image(one, 32, min_side=bad)


def test_chroma_tells_photos_without_colour():
    from leaflens.data_prep.quality import GREY_CHROMA, PhotoRefused, check_colour, chroma, grey_share

    rng = np.random.default_rng(0)
    grey = np.repeat(rng.integers(0, 256, (64, 64, 1), dtype=np.uint8), 3, axis=2)
    colour = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert chroma(grey) == 0.0 and chroma(colour) > 50
    tinted = grey.copy()
    tinted[..., 0] = np.minimum(tinted[..., 0].astype(np.int16) + 1, 255)  # under one grey level of tint
    assert chroma(tinted) < GREY_CHROMA
    check_colour(colour, "c.jpg")
    with pytest.raises(PhotoRefused, match="g.jpg: not analysed \\(no_colour\\)") as refused:
        check_colour(grey, "g.jpg")
    assert refused.value.reason == "no_colour"
    stack = np.stack([grey, colour, colour, colour])
    assert grey_share(stack, chunk=3) == 0.25 and grey_share(stack[1:]) == 0.0 and grey_share(stack[:0]) == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_the_preprocess_check_gives_the_app_s_verdict_on_every_kind_of_photo(seed):
    """served_refusal's shortcut (a central patch already detailed enough) never changes the verdict of
    refusal_reason: flat, gradients, blurs, small subjects on plain ground, noise, odd sizes and aspects."""
    from leaflens.data_prep.quality import served_refusal  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    seen = set()
    for size in (16, 31, 64, 97, 128, 200, 256):
        leaf = render(str(rng.choice(CLASSES)), size, rng)
        spot = np.full((size, size, 3), 230, np.uint8)
        y, x = rng.integers(0, max(size - 12, 1), 2)
        spot[y:y + 12, x:x + 12] = rng.integers(0, 255, (min(12, size - y), min(12, size - x), 3))
        blurred = np.asarray(Image.fromarray(leaf).filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 6)))))
        tall = rng.integers(0, 255, (size, max(size // 3, 3), 3), dtype=np.uint8)
        for arr in (_solid(rng.integers(0, 255, 3), size), _linear_gradient(rng, size), _radial_gradient(rng, size),
                    leaf, spot, blurred, tall, _checkerboard(rng.integers(0, 255, 3), rng.integers(0, 255, 3), size,
                                                              int(rng.integers(1, 9)))):
            want = _reason(arr)
            assert served_refusal(arr, 500, 400) == want, (size, want)
            seen.add(want)
    assert served_refusal(_solid((9, 9, 9), 64), 31, 400) == "too_small"
    assert served_refusal(_solid((9, 9, 9), 64), 0, 0) == "uniform"  # size unknown: judged on the pixels
    assert {None, "uniform", "low_texture"} <= seen


def test_a_value_just_under_a_limit_is_not_shown_as_the_limit():
    """A dim leaf was refused with "standard deviation 5.0 grey levels, below 5": 4.96 rounded."""
    from leaflens.data_prep.quality import _below  # noqa: PLC0415

    assert _below(4.96, 5) == "4.96" and _below(4.999, 5) == "4.999" and _below(3.24, 5) == "3.2"
    assert _below(0.0996, 0.10, 0, 100, "%") == "9.96%" and _below(0.05, 0.10, 0, 100, "%") == "5%"
