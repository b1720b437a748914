"""Shared helpers for data_prep tests: tiny photo folders built with Pillow in tmp_path.

(A uniquely named module rather than conftest.py, so test folders cannot shadow each other.)
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def encode(im: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def photo(seed: int, colour: tuple[int, int, int], w: int = 48, h: int = 40) -> Image.Image:
    """A small textured image around ``colour`` (unique per seed, so no accidental duplicates)."""
    rng = np.random.default_rng(seed)
    arr = np.clip(np.array(colour)[None, None, :] + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr)


def png_bomb(w: int = 30_000, h: int = 30_000) -> bytes:
    """A tiny PNG whose header declares w x h pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


COLOURS = {"blight": (140, 90, 40), "healthy": (40, 150, 50), "rust": (200, 120, 30)}


def make_class_folders(root: Path, per_class: int = 20, seed: int = 0) -> Path:
    """ROOT/<class>/img_XX.{jpg,png} with distinct textured images."""
    for c, (name, colour) in enumerate(COLOURS.items()):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            fmt, ext = ("PNG", "png") if i % 4 == 0 else ("JPEG", "JPG" if i % 3 == 0 else "jpg")
            (d / f"img_{i:02d}.{ext}").write_bytes(encode(photo(seed * 1000 + c * 100 + i, colour), fmt))
    return root
