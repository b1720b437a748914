"""The README's recipe for feeding an exported model without leaflens ("To feed it as leaflens does") gives
exactly the pixels leaflens stores: written here from the README's words with Pillow alone."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from leaflens.data_prep.decode import decode_image


def readme_recipe(data: bytes, stored: int) -> np.ndarray:
    im = Image.open(io.BytesIO(data))
    if im.format == "JPEG":  # the draft scale: no less than twice the size it is scaled to
        im.draft(im.mode, (2 * stored, 2 * stored))
    im = ImageOps.exif_transpose(im)
    if im.mode in ("RGBA", "LA", "P", "PA"):
        rgba = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    im = im.convert("RGB")
    w, h = im.size
    side = min(w, h) * stored / stored  # no leaflens.shorter_side: R = T
    left, top = (w - side) / 2, (h - side) / 2  # fractional edges, one resize
    return np.asarray(im.resize((stored, stored), Image.Resampling.BOX, box=(left, top, left + side, top + side)))


def _photo(w: int, h: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR))


@pytest.mark.parametrize("w,h,fmt,orientation", [(4000, 3000, "JPEG", 1), (3000, 4000, "JPEG", 6),
                                                 (1001, 677, "JPEG", 8), (333, 517, "PNG", 1)])
def test_the_readme_recipe_gives_the_stored_pixels(w, h, fmt, orientation):
    buf = io.BytesIO()
    im = Image.fromarray(_photo(w, h, w + h))
    if fmt == "JPEG":
        exif = Image.Exif()
        exif[0x0112] = orientation
        im.save(buf, "JPEG", quality=90, exif=exif.tobytes())
    else:
        im.save(buf, "PNG")
    data = buf.getvalue()
    for stored in (64, 128):
        assert np.array_equal(readme_recipe(data, stored), decode_image(data, stored)), (stored, w, h)
