"""The one preprocessing contract: a photo file -> the float32 input a leaflens model sees.

Three steps, each implemented once, here (or, for the decode, in :mod:`leaflens.data_prep.decode`):

1. decode (:func:`decode_stored`): EXIF rotation, any mode -> RGB, JPEG DCT-scaled ("draft")
   decoding for big photos, and the antialiased resize rule ("crop": shorter side to the stored
   size, centre square; "pad": letterbox) -> a uint8 ``stored_size`` square. `leaflens preprocess`
   writes exactly this into the dataset arrays. A served teacher's contract sets ``shorter_side``
   (shorter side to it, then the centre square, as the teacher stage decoded its photos).
2. stored size -> input size (:func:`area_resize`): every input pixel is the mean of the stored
   pixels it covers (an area filter), float32, not rounded back to uint8. A student whose contract has a
   ``centre_crop`` keeps the centre square of that share of the stored side first (:func:`centre_crop`):
   students train on random crops of half to all of a photo's area, so an object looks larger to them in
   training than in a whole frame (Touvron et al. 2019); distill chooses the share on validation.
3. normalise (:func:`normalize`): ``(x / 255 - mean) / std`` per RGB channel, float32.

A model records its contract in its metadata (:class:`PreprocessContract`, inside
``leaflens.apps.model_card.ModelCard``), and every consumer calls these functions: preprocess
(step 1), the student's validation/test evaluation, export parity and INT8 calibration (steps 2-3
on the stored arrays), and the Predictor (steps 1-3 on a photo file). So the Predictor's input for
a photo equals, bit for bit, the input the engine was evaluated on for the same photo: both decode
it with the same call at the stored size, JPEG draft scale included, and go down to the input size
and normalise with the same code.

Training batches are the one place that does not call step 2: the engine's loader cuts random crops
(augmentation) from the stored image and resamples them to the input size itself (the engine may
not import data_prep). Its un-augmented whole-image output equals :func:`area_resize` exactly when
the stored size is a multiple of the input size (128 -> 64, the default; tested), and its
normalisation, fused with the colour jitter, equals :func:`normalize` with the jitter off (tested).

This module imports neither the engine nor onnxruntime: serving uses it without either.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from leaflens.data_prep.decode import DEFAULT_MAX_PIXELS, decode_image, decode_image_at
from leaflens.records import Record

__all__ = ["ContractError", "PreprocessContract", "area_resize", "at_input_size", "centre_crop", "contract_for_dataset",
           "crop_side", "decode_stored", "normalize", "rgb_floats"]

Source = str | os.PathLike | bytes


class ContractError(ValueError):
    """An impossible contract; ``field`` names the value at fault (the message says why)."""

    def __init__(self, field: str, why: str) -> None:
        self.field = field
        self.why = why
        super().__init__(f"{field} {why}")


@dataclass(frozen=True)
class PreprocessContract(Record):
    """How a photo becomes a model's input: decode to ``stored_size`` with the ``resize`` rule,
    area-average down to ``input_size``, normalise with ``mean``/``std`` (pixel/255 scale, RGB).

    ``shorter_side`` (``resize="crop"`` only; None for every student): decode with the shorter side scaled
    to it and the centre ``stored_size`` square kept, the "resize 256, centre crop 224" the ImageNet
    teacher saw in the teacher stage (:func:`leaflens.data_prep.decode.decode_image_at`), so a served
    teacher gets the very pixels it was fine-tuned and evaluated on. None: the shorter side goes straight
    to ``stored_size``, as `leaflens preprocess` stores photos.

    ``centre_crop`` (a share in (0, 1); None: the whole stored square): step 2 keeps the centre
    ``round(centre_crop * stored_size)`` square of the stored pixels before the area resize
    (:func:`centre_crop`), at least ``input_size`` wide. Applied to the stored arrays, so a photo decoded by
    step 1 and a dataset row give the same input.
    """

    # Written as contracts were before these existed when unused (older readers refuse unknown keys).
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"shorter_side", "centre_crop"})

    stored_size: int
    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resize: Literal["crop", "pad"] = "crop"
    shorter_side: int | None = None
    centre_crop: float | None = None

    def __post_init__(self) -> None:
        for name in ("stored_size", "input_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ContractError(name, f"must be an integer >= 1, got {value!r}")
        if self.input_size > self.stored_size:
            raise ContractError("input_size", f"{self.input_size} is larger than stored_size {self.stored_size} "
                                              "(images are never blown up)")
        for name, positive in (("mean", False), ("std", True)):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or len(values) != 3 or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise ContractError(name, f"must be a list of 3 numbers, got {values!r}")
            if not all(math.isfinite(v) and (v > 0 or not positive) for v in values):
                raise ContractError(name, f"must hold finite{' positive' if positive else ''} numbers, "
                                          f"got {list(values)}")
            object.__setattr__(self, name, tuple(float(v) for v in values))  # lists from callers -> tuple
        if self.resize not in ("crop", "pad"):
            raise ContractError("resize", f"must be 'crop' or 'pad', got {self.resize!r}")
        side = self.shorter_side
        if side is not None:
            if isinstance(side, bool) or not isinstance(side, int) or side < self.stored_size:
                raise ContractError("shorter_side", f"must be an integer >= stored_size {self.stored_size}, "
                                                    f"got {side!r}")
            if self.resize != "crop":
                raise ContractError("shorter_side", f"applies to resize 'crop' only, not {self.resize!r}")
        crop = self.centre_crop
        if crop is not None:
            if isinstance(crop, bool) or not isinstance(crop, (int, float)) or not 0.0 < crop < 1.0:
                raise ContractError("centre_crop", f"must be a share of the stored side in (0, 1), got {crop!r}")
            object.__setattr__(self, "centre_crop", float(crop))
            kept = crop_side(self.stored_size, crop)
            if kept < self.input_size:
                raise ContractError("centre_crop", f"{crop:g} keeps {kept} of the stored {self.stored_size} px, "
                                                   f"fewer than the input size {self.input_size} (images are never "
                                                   "blown up)")

    def decode(self, src: Source, max_pixels: int = DEFAULT_MAX_PIXELS, min_side: int = 0) -> np.ndarray:
        """Step 1: one photo (path or encoded bytes) -> uint8 ``(stored_size, stored_size, 3)``;
        ``min_side`` > 0 refuses a photo under that many pixels on a side ("too_small")."""
        if self.shorter_side is not None:
            return decode_image_at(src, self.stored_size, self.resize, shorter_side=self.shorter_side,
                                   max_pixels=max_pixels, min_side=min_side)
        return decode_stored(src, self.stored_size, self.resize, max_pixels, min_side=min_side)

    def prepare(self, images: np.ndarray) -> np.ndarray:
        """Steps 2-3: uint8 ``(N, stored_size, stored_size, 3)`` -> float32 NHWC model input."""
        images = np.asarray(images)
        s = self.stored_size
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (s, s, 3):
            raise ValueError(f"expected a uint8 array of shape [N, {s}, {s}, 3] (photos decoded at the stored "
                             f"size), got {images.dtype} {images.shape}")
        return normalize(self.to_input_size(images), self.mean, self.std)

    def to_input_size(self, images: Any) -> np.ndarray:
        """Step 2 alone: stored-size images -> float32 ``(N, input_size, input_size, C)`` on the 0-255 scale."""
        return at_input_size(images, self.input_size, self.centre_crop)


def at_input_size(images: Any, size: int, crop: float | None = None) -> np.ndarray:
    """Step 2 of the contract: the centre ``crop`` share of every stored image (None: the whole image), then
    the area resize to ``size`` px; float32 on the 0-255 scale."""
    x = np.asarray(images)
    return area_resize(x if crop is None else centre_crop(x, crop), size)


def crop_side(side: int, share: float) -> int:
    """The side of the centre square :func:`centre_crop` keeps of a ``side``-pixel square (at least 1)."""
    return max(1, int(round(share * side)))


def centre_crop(images: Any, share: float) -> np.ndarray:
    """The centre ``round(share * side)`` square of every ``(N, S, S, C)`` image (the images themselves at
    ``share`` 1); an odd margin leaves the extra pixel on the bottom and right. A view, not a copy."""
    x = np.asarray(images)
    if not 0.0 < share <= 1.0:
        raise ValueError(f"centre crop share must be in (0, 1], got {share}")
    if x.ndim != 4 or x.shape[1] != x.shape[2]:
        raise ValueError(f"centre_crop expects square (N, S, S, C) images, got shape {x.shape}")
    keep = crop_side(x.shape[1], share)
    start = (x.shape[1] - keep) // 2
    return x[:, start:start + keep, start:start + keep]


def decode_stored(src: Source, stored_size: int, resize: str, max_pixels: int = DEFAULT_MAX_PIXELS,
                  min_side: int = 0, header: dict | None = None) -> np.ndarray:
    """Step 1 of the contract: the pixels `leaflens preprocess` stores for a photo (see module docstring);
    ``min_side`` > 0 refuses a photo under that many pixels on a side (preprocess keeps the default 0);
    ``header`` receives the file's format, size and EXIF presence (see :func:`decode_image`)."""
    return decode_image(src, stored_size, resize=resize, max_pixels=max_pixels, min_side=min_side, header=header)


def _area_weights(n_in: int, n_out: int) -> np.ndarray:
    """``(n_out, n_in)`` float64 matrix: row ``i`` averages the source pixels output pixel ``i`` covers,
    each weighted by the length of its overlap (so every row sums to 1)."""
    scale = n_in / n_out
    edges = np.arange(n_out + 1) * scale
    lo, hi = edges[:-1, None], edges[1:, None]
    pixel = np.arange(n_in)[None, :]
    overlap = np.clip(np.minimum(hi, pixel + 1) - np.maximum(lo, pixel), 0.0, None)
    return overlap / scale


def area_resize(images: Any, size: int) -> np.ndarray:
    """Step 2 of the contract: ``(N, H, W, C)`` uint8 or float -> float32 ``(N, size, size, C)`` where every
    output pixel is the mean of the source area it covers.

    When ``size`` divides both sides by the same factor (128 -> 64) that is the mean of each block,
    computed in float32; otherwise the exact area weights are applied in float64 and rounded once to
    float32. Each image's result does not depend on the others in the batch. Images already at
    ``size`` come back as float32 copies; a larger ``size`` is refused (images are never blown up).
    """
    x = np.asarray(images)
    if x.ndim != 4:
        raise ValueError(f"area_resize expects an (N, H, W, C) batch, got shape {x.shape}")
    n, h, w, c = x.shape
    if size < 1 or size > min(h, w):
        raise ValueError(f"area_resize: size {size} must be in 1..{min(h, w)} for {h}x{w} images")
    if (h, w) == (size, size):
        return np.array(x, dtype=np.float32)
    if h % size == 0 and w % size == 0 and h // size == w // size:
        # Block means as f*f strided adds into one float32 buffer, then one division: for uint8 pixels
        # every partial sum is an exact integer, so this equals a float32 mean of each block bit for bit,
        # about 5x faster than reshape + mean (it runs per served photo, and cost more than the model).
        f = h // size
        out = x[:, 0::f, 0::f].astype(np.float32)
        for i in range(f):
            for j in range(f):
                if i or j:
                    out += x[:, i::f, j::f]
        out /= np.float32(f * f)
        return out
    planes = np.moveaxis(np.asarray(x, np.float64), 3, 1)  # (N, C, H, W): one matrix product per plane
    out = _area_weights(h, size) @ planes @ _area_weights(w, size).T
    return np.ascontiguousarray(np.moveaxis(out, 1, 3), dtype=np.float32)


def normalize(x: Any, mean: Any, std: Any) -> np.ndarray:
    """Step 3 of the contract: a ``[0, 255]`` NHWC batch -> float32 ``(x / 255 - mean) / std`` per channel,
    as ``x * (1 / (255 std)) - mean / std`` in float32. Never modifies ``x``."""
    out = np.array(x, dtype=np.float32, order="C")
    std32 = np.asarray(std, np.float32)
    scale = (1.0 / (255.0 * std32)).astype(np.float32)
    shift = (np.asarray(mean, np.float32) / std32).astype(np.float32)
    # Per-channel constants tiled along a whole row, so the inner loop is W*C long rather than C.
    c, w = out.shape[-1], out.shape[-2]
    rows = out.reshape(-1, w * c)
    rows *= np.tile(scale, w)
    rows -= np.tile(shift, w)
    return out


def rgb_floats(values: Any, what: str) -> tuple[float, float, float]:
    """One number per RGB channel (a sequence or an array, e.g. a dataset's float32 mean) as three Python
    floats, for the records that store them; ``what`` names the values in the error for another count."""
    floats = [float(v) for v in values]
    if len(floats) != 3:
        raise ContractError(what, f"must have one value per RGB channel (3), got {len(floats)}")
    return floats[0], floats[1], floats[2]


def contract_for_dataset(ds: Any, input_size: int, centre_crop: float | None = None) -> PreprocessContract:
    """The contract of a model that looks at ``input_size`` px (of the centre ``centre_crop`` of each photo)
    and was trained on the dataset ``ds`` (a :class:`leaflens.data_prep.manifest.Dataset`): its stored size,
    resize rule and train mean/std."""
    return PreprocessContract(
        stored_size=int(ds.image_size), input_size=int(input_size),
        mean=rgb_floats(ds.mean, f"{ds.root}: the dataset's mean"),
        std=rgb_floats(ds.std, f"{ds.root}: the dataset's std"),
        resize=ds.manifest.resize, centre_crop=centre_crop,
    )
