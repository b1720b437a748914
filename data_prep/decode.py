"""The one image-decoding path of leaflens: any user photo -> uint8 RGB square.

Preprocessing, the teacher stage and the inference app all call :func:`decode_image`, so a photo is
turned into pixels the same way at training and at serving time. The function accepts what phones
and scanners produce (EXIF-rotated JPEGs, PNGs with alpha, grayscale, 16-bit, palette and CMYK
files) and refuses, with :class:`ImageDecodeError` and a short machine-readable ``reason``, what
cannot be read (empty, truncated, not an image, too many pixels) and, when the caller asks for a
``min_side``, a photo too small to show a leaf ("too_small", measured after EXIF rotation).

Speed: for JPEGs the decoder's DCT scaling (``Image.draft``) decodes a 4000x3000 photo directly
at 1/2, 1/4 or 1/8 scale, keeping at least twice the wanted output size so the final antialiased
resize still has real detail to average. The declared pixel count is checked against
``max_pixels`` before any pixel is decoded (decompression-bomb guard).

This module must not import the engine or onnxruntime: serving uses it without either.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import threading
import warnings
import zlib
from collections.abc import Iterator

import numpy as np
from PIL import Image, UnidentifiedImageError

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "TIFF_REVISION",
    "PAD_VALUE",
    "RESAMPLE",
    "ImageDecodeError",
    "decode_image",
    "decode_image_at",
    "read_source",
]

# Bumped when the pixels decoded from TIFF files change (2: an orientation tag applied once, not twice; 32-bit
# photos scaled by their 99.9th percentile): a dataset holding TIFFs is built again once (data_prep.ingest).
TIFF_REVISION = 2
# 120 megapixels: admits 108 MP phone sensors, refuses absurd declared sizes before decoding.
DEFAULT_MAX_PIXELS = 120_000_000
# the most bytes read from one file: 120 M pixels of 16-bit RGB uncompressed is 720 MB, far beyond any photo
MAX_FILE_BYTES = 1 << 30
# Letterbox fill for resize="pad" (black, like the borders of a photo print scan).
PAD_VALUE = 0
# Antialiasing filter for the final resize. BOX (exact area average) and LANCZOS differ by well
# under one grey level on downscaled photos (see benchmarks/preprocess.py); BOX is faster.
RESAMPLE = Image.Resampling.BOX
# The JPEG draft scale keeps at least this many times the wanted size on the shorter side.
DRAFT_MARGIN = 2

_RESIZE_MODES = ("crop", "pad")
_ORIENTATION_TAG = 0x0112
_TRANSPOSE = {
    2: (Image.Transpose.FLIP_LEFT_RIGHT,),
    3: (Image.Transpose.ROTATE_180,),
    4: (Image.Transpose.FLIP_TOP_BOTTOM,),
    5: (Image.Transpose.TRANSPOSE,),
    6: (Image.Transpose.ROTATE_270,),
    7: (Image.Transpose.TRANSVERSE,),
    8: (Image.Transpose.ROTATE_90,),
}
# ISO base media "ftyp" brands used by HEIC/HEIF/AVIF phone photos.
_HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1", b"avif")

Source = str | os.PathLike | bytes


class ImageDecodeError(ValueError):
    """An image that cannot be turned into pixels.

    ``reason`` is a short machine-readable code ("empty", "truncated", "corrupt", "not_an_image",
    "too_large", "unsupported_mode", "heic_unsupported", "unreadable", "too_small"); ``source`` names the file
    (or "<bytes>"); the message is for people and names the file too.
    """

    def __init__(self, reason: str, source: str, detail: str) -> None:
        self.reason = reason
        self.source = source
        self.detail = detail
        super().__init__(f"{source}: cannot decode image ({reason}): {detail}")

    def __reduce__(self):  # keep reason/source when sent back from a worker process
        return (type(self), (self.reason, self.source, self.detail))


def _source_name(src: Source) -> str:
    return "<bytes>" if isinstance(src, (bytes, bytearray, memoryview)) else os.fspath(src)


def read_source(src: Source, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """Return the encoded bytes of ``src`` (a path or bytes); refuse empty or unreadable files, anything but a
    regular file (a pipe would wait for a writer forever, /dev/zero never ends) and files over ``max_bytes``."""
    name = _source_name(src)
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    else:
        try:
            # non-blocking, so that opening a named pipe returns at once and can be refused
            fd = os.open(src, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
            with open(fd, "rb", closefd=True) as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ImageDecodeError("unreadable", name, "not a regular file (a pipe, device or socket)")
                data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise ImageDecodeError("unreadable", name, exc.strerror or str(exc)) from exc
        if len(data) > max_bytes:
            raise ImageDecodeError("too_large", name, f"the file is over {max_bytes / 2**20:.0f} MB")
    if not data:
        raise ImageDecodeError("empty", name, "the file has 0 bytes")
    return data


def _is_heif(data: bytes) -> bool:
    return len(data) >= 12 and data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS


def _register_heif() -> bool:
    """Register the optional pillow-heif opener; False when it is not installed."""
    try:
        import pillow_heif
    except ImportError:
        return False
    pillow_heif.register_heif_opener()
    return True


# Pillow refuses, in Image.open, any image over twice its own MAX_IMAGE_PIXELS (179 M by default), whatever
# limit the caller chose; a larger ``max_pixels`` opens such a file with Pillow's limit lifted for that open only
# (the lock keeps two threads from restoring each other's value).
_PILLOW_LIMIT_LOCK = threading.Lock()
_PILLOW_SIZE = re.compile(r"\((\d+) pixels\)")


@contextlib.contextmanager
def _pillow_limits(lift: bool) -> Iterator[None]:
    """Pillow's pixel checks as ours allow: its warning (above its default limit) swallowed, and with ``lift``
    its hard limit off. Note: catch_warnings touches the process-wide filter list while it lasts."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        if not lift:
            yield
            return
        with _PILLOW_LIMIT_LOCK:
            before, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
            try:
                yield
            finally:
                Image.MAX_IMAGE_PIXELS = before


def _above_pillows_limit(pixels: int) -> bool:
    """Whether Pillow would refuse ``pixels`` itself (over twice its MAX_IMAGE_PIXELS, when it has one)."""
    limit = Image.MAX_IMAGE_PIXELS
    return limit is not None and pixels > 2 * limit


def _open(data: bytes, name: str, max_pixels: int) -> Image.Image:
    """Open (header only) and apply the pixel limit before any pixel data is decoded."""
    if _is_heif(data) and not _register_heif():
        raise ImageDecodeError(
            "heic_unsupported", name, "HEIC/HEIF photo; install the 'heic' extra (pillow-heif) or convert"
        )
    lift = False
    while True:
        try:
            with _pillow_limits(lift):
                im = Image.open(io.BytesIO(data))
            break
        except Image.DecompressionBombError as exc:
            found = _PILLOW_SIZE.search(str(exc))
            if lift or found is None:
                raise ImageDecodeError("too_large", name, str(exc)) from exc
            if int(found.group(1)) > max_pixels:
                raise ImageDecodeError("too_large", name, f"declared size {found.group(1)} pixels exceeds the limit "
                                                          f"of {max_pixels}") from exc
            lift = True  # within the caller's limit: Pillow's is not ours (TIFF's loader checks again: _load)
        except UnidentifiedImageError as exc:
            raise ImageDecodeError("not_an_image", name, "not a recognised image format") from exc
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise ImageDecodeError("corrupt", name, f"header unreadable: {exc}") from exc
    w, h = im.size
    if w <= 0 or h <= 0:
        raise ImageDecodeError("corrupt", name, f"declared size {w}x{h}")
    if w * h > max_pixels:
        raise ImageDecodeError(
            "too_large", name, f"declared size {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels}"
        )
    if im.format == "PNG":
        _check_png_ratio(data, w, h, name)
    elif im.format not in _DRAFT_FORMATS and im.mode != "1":  # bilevel scans: 1 byte a pixel, and CCITT packs
        _check_pixels_per_byte(data, w, h, name, im.format or "image")  # them far tighter than any photo
    return im


# Deflate cannot compress better than 1032:1 (a 258-byte match in 2 bits), so a PNG declaring more pixel
# bytes than that many times its own size cannot hold its image: a few-KB file claiming 100 MP would
# otherwise cost a 100 MP allocation and seconds of work before failing (or decoding to black rows).
_DEFLATE_MAX_RATIO = 1032
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # IHDR colour type -> samples per pixel


def _check_png_ratio(data: bytes, w: int, h: int, name: str) -> None:
    if len(data) < 29 or data[12:16] != b"IHDR":
        return
    depth, colour = data[24], data[25]
    raw = h * (1 + -(-w * _PNG_CHANNELS.get(colour, 1) * depth // 8))  # filter byte + packed row
    if raw > _DEFLATE_MAX_RATIO * len(data):
        raise ImageDecodeError(
            "truncated", name, f"declares {w}x{h} pixels ({raw} bytes of image data) but the file has only "
                               f"{len(data)} bytes, beyond deflate's {_DEFLATE_MAX_RATIO}:1 limit"
        )


# A file far smaller than the pixels it declares is a decompression bomb, not a photo: a 38-byte lossless WebP can
# declare 115 M pixels and cost 2 GB to decode (PNG has the exact bound above; a JPEG is decoded at a reduced
# scale). Photos hold a few pixels per byte and even flat drawings a few hundred, while an image this flat would be
# refused as "uniform" anyway; small images are let through whatever their size.
_MAX_PIXELS_PER_BYTE = 1024
_RATIO_FROM_PIXELS = 4_000_000
_DRAFT_FORMATS = frozenset({"JPEG", "MPO"})


def _check_pixels_per_byte(data: bytes, w: int, h: int, name: str, fmt: str) -> None:
    if w * h > _RATIO_FROM_PIXELS and w * h > _MAX_PIXELS_PER_BYTE * len(data):
        raise ImageDecodeError(
            "too_large", name, f"a {fmt} file of {len(data)} bytes declaring {w}x{h} = {w * h} pixels (more than "
                               f"{_MAX_PIXELS_PER_BYTE} pixels per byte): a decompression bomb, not a photo; if it "
                               "is a photo, save it again as JPEG"
        )


def _orientation(im: Image.Image) -> int:
    try:
        value = im.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # malformed EXIF is common on edited photos: keep the pixels, skip rotation
        return 1
    return value if isinstance(value, int) else 1


def _camera(im: Image.Image) -> str:
    """The EXIF Make and Model ("" without them): photos of a class from one phone share them."""
    try:
        exif = im.getexif()
        return " ".join(str(exif.get(tag, "")).strip("\x00 ") for tag in (0x010F, 0x0110)).strip()[:64]
    except Exception:  # malformed EXIF: as if absent
        return ""


def _jpeg_quantisation(im: Image.Image) -> int:
    """Mean of a JPEG's luminance quantisation table (0 for other formats): lower is a higher quality."""
    tables = getattr(im, "quantization", None) or {}
    table = tables.get(0) if isinstance(tables, dict) else None
    return int(round(sum(table) / len(table))) if table else 0


def _load(im: Image.Image, name: str) -> None:
    try:  # Pillow's TIFF loader checks the size again; _open has applied our own limit already
        with _pillow_limits(_above_pillows_limit(im.size[0] * im.size[1])):
            im.load()
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError("too_large", name, str(exc)) from exc
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error) as exc:
        text = str(exc)
        reason = "truncated" if isinstance(exc, EOFError) or "truncat" in text.lower() else "corrupt"
        raise ImageDecodeError(reason, name, text or type(exc).__name__) from exc


def _peak(arr: np.ndarray) -> float:
    """The level nearly all pixels stay under (99.9th percentile): a few stray pixels above an 8-bit or 0-1
    range must not rescale, and black out, the whole photo; they are clipped instead."""
    finite = arr[np.isfinite(arr)] if arr.dtype.kind == "f" else arr.ravel()
    return float(np.percentile(finite, 99.9)) if finite.size else 0.0


def _int_to_l(im: Image.Image, fmt: str | None = None) -> Image.Image:
    """16/32-bit integer or float grayscale -> 8-bit L, scaling the range instead of clipping."""
    arr = np.asarray(im)
    if im.mode.startswith("I;16"):
        out = arr.astype(np.float32) / 257.0
    elif im.mode == "F":
        out = arr * 255.0 if _peak(arr) <= 1.0 else arr
    elif fmt == "PNG":  # "I" from a 16-bit grey PNG (some Pillow versions): as "I;16", whatever its values
        out = arr.astype(np.float32) / 257.0
    else:  # "I": 32-bit ints (TIFF)
        out = arr.astype(np.float32) / 257.0 if _peak(arr) > 255 else arr
    out = np.nan_to_num(np.asarray(out, dtype=np.float32), nan=0.0)
    return Image.fromarray(np.clip(np.rint(out), 0, 255).astype(np.uint8), "L")


def _int_to_rgb(im: Image.Image, fmt: str | None = None) -> Image.Image:
    """:func:`_int_to_l` as RGB, with the pixels of a transparency key (a 16-bit PNG's tRNS) on white."""
    rgb = _int_to_l(im, fmt).convert("RGB")
    key = im.info.get("transparency")
    if not isinstance(key, (int, float)) or isinstance(key, bool):
        return rgb
    out = np.array(rgb)
    out[np.asarray(im) == key] = 255
    return Image.fromarray(out, "RGB")


def _to_rgb(im: Image.Image, name: str, fmt: str | None = None) -> Image.Image:
    """Any Pillow mode -> RGB; transparency is composited on white. ``fmt``: the file's format (a transposed
    image has none)."""
    mode = im.mode
    if mode == "RGB":
        if "transparency" in im.info:
            im = im.convert("RGBA")
        else:
            return im
    elif mode in ("P", "PA"):
        im = im.convert("RGBA")
    elif mode in ("I", "I;16", "I;16L", "I;16B", "I;16N", "F"):
        return _int_to_rgb(im, fmt)
    try:
        if im.mode in ("RGBA", "LA", "La", "RGBa", "PA") or "transparency" in im.info:
            rgba = im.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return im.convert("RGB")
    except (ValueError, OSError) as exc:
        raise ImageDecodeError("unsupported_mode", name, f"mode {mode!r}: {exc}") from exc


def _crop_box(w: int, h: int, size: int, shorter_side: int) -> tuple[float, float, float, float]:
    """Source box whose resize to size x size equals 'shorter side -> shorter_side, centre crop'."""
    side = min(w, h) * size / shorter_side
    left, top = (w - side) / 2.0, (h - side) / 2.0
    return (left, top, left + side, top + side)


def _check_min_side(im: Image.Image, orientation: int, min_side: int, name: str) -> None:
    """Refuse ("too_small") an image whose displayed size (after EXIF rotation) is under ``min_side``
    on either side; checked on the header, before any pixel is decoded or the JPEG draft shrinks it."""
    w, h = im.size
    if orientation in (5, 6, 7, 8):  # these EXIF orientations swap width and height
        w, h = h, w
    if min(w, h) < min_side:
        raise ImageDecodeError("too_small", name, f"{w}x{h} px, smaller than {min_side} px on a side")


def _decode(src: Source, size: int, resize: str, max_pixels: int, shorter_side: int,
            min_side: int = 0, header: dict | None = None) -> np.ndarray:
    if resize not in _RESIZE_MODES:
        raise ValueError(f"resize must be one of {_RESIZE_MODES}, got {resize!r}")
    if size < 1 or shorter_side < size:
        raise ValueError(f"need 1 <= size <= shorter_side, got size={size}, shorter_side={shorter_side}")
    if isinstance(min_side, bool) or not isinstance(min_side, (int, np.integer)) or min_side < 0:
        raise ValueError(f"min_side must be an integer >= 0, got {min_side!r}")
    name = _source_name(src)
    data = read_source(src)
    im = _open(data, name, max_pixels)
    orientation = _orientation(im)
    if header is not None:  # what the file says about itself, read from the header already parsed
        header.update(format=im.format or "unknown", width=im.size[0], height=im.size[1],
                      exif=bool(im.info.get("exif")), mode=im.mode, camera=_camera(im), orientation=orientation,
                      jpeg_q=_jpeg_quantisation(im))
    if min_side:
        _check_min_side(im, orientation, min_side, name)
    if im.format == "JPEG":
        # DCT scaling: both sides stay >= DRAFT_MARGIN * target, so the shorter side does too.
        target = DRAFT_MARGIN * (shorter_side if resize == "crop" else size)
        im.draft(im.mode, (target, target))
    _load(im, name)
    # Pillow's TIFF loader turns the image upright itself and drops the tag: the orientation left after loading
    # is what remains to be done (the same as before for every other format)
    orientation = _orientation(im)
    fmt = im.format
    for op in _TRANSPOSE.get(orientation, ()):
        im = im.transpose(op)
    im = _to_rgb(im, name, fmt)
    w, h = im.size
    try:
        if resize == "crop":
            out = im.resize((size, size), RESAMPLE, box=_crop_box(w, h, size, shorter_side))
        else:
            scale = size / max(w, h)
            nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
            canvas = Image.new("RGB", (size, size), (PAD_VALUE,) * 3)
            canvas.paste(im.resize((nw, nh), RESAMPLE), ((size - nw) // 2, (size - nh) // 2))
            out = canvas
    except (OSError, ValueError) as exc:
        raise ImageDecodeError("corrupt", name, f"resize failed: {exc}") from exc
    arr = np.asarray(out, dtype=np.uint8)
    if arr.shape != (size, size, 3):  # defensive: a Pillow surprise must not corrupt a dataset
        raise ImageDecodeError("unsupported_mode", name, f"decoded to shape {arr.shape}")
    return np.ascontiguousarray(arr)


def decode_image(
    src: Source, size: int, resize: str = "crop", max_pixels: int = DEFAULT_MAX_PIXELS, *, min_side: int = 0,
    header: dict | None = None,
) -> np.ndarray:
    """Decode ``src`` (path or encoded bytes) to a ``(size, size, 3)`` uint8 RGB array.

    EXIF orientation is applied, every mode is converted to RGB (alpha on white), JPEGs are
    decoded at reduced DCT scale when a small output is wanted, and the image is resized with
    antialiasing: ``resize="crop"`` scales the shorter side to ``size`` and crops the centre;
    ``resize="pad"`` scales the longer side to ``size`` and letterboxes with ``PAD_VALUE``.
    ``min_side`` > 0 refuses (reason "too_small") an image whose width or height after EXIF rotation
    is under ``min_side`` pixels; the default 0 accepts any size. A ``header`` dict receives the file's
    real ``format``, declared ``width`` and ``height`` (before EXIF rotation), whether it carries ``exif``, its
    colour ``mode``, EXIF ``camera`` (make and model) and ``orientation``, and ``jpeg_q``, the mean of a JPEG's
    luminance quantisation table (preprocess's data checks; no second parse of the file).
    Raises :class:`ImageDecodeError` (with ``reason``) for files that cannot be decoded and
    ``ValueError`` for bad arguments.
    """
    return _decode(src, size, resize, max_pixels, shorter_side=size, min_side=min_side, header=header)


def decode_image_at(
    src: Source, size: int, resize: str = "crop", shorter_side: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS, *, min_side: int = 0,
) -> np.ndarray:
    """Like :func:`decode_image` (``min_side`` included), but with ``resize="crop"`` the shorter side is first scaled to
    ``shorter_side`` (>= size) and the centre ``size`` square kept: the classic "resize 256, centre
    crop 224" of ImageNet-trained teachers. ``shorter_side`` is ignored for ``resize="pad"``."""
    return _decode(src, size, resize, max_pixels, shorter_side=shorter_side or size, min_side=min_side)
