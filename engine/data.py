"""Batches for training: a dataset over (memory-mapped) uint8 image arrays and a prefetching loader.

``ArrayDataset`` wraps an ``(N, H, W, 3)`` uint8 array (a read-only memmap from a dataset folder
is fine: rows are read per batch, the file is never loaded whole) and optional int64 labels.
``DataLoader`` yields :class:`Batch` tuples ``(images, labels, indices, number)``: ``images`` float32
NHWC normalised with the dataset's per-channel mean/std (given on the [0, 1] scale), ``labels`` int64
(-1 where there are no labels), ``indices`` the dataset rows the batch holds, in its row order, and
``number`` the batch's position in its epoch. Callers look per-sample side data (teacher targets, ...)
up by ``indices``, so they never need to know or recompute the loader's shuffle order. The engine
wraps the arrays in tensors itself.

Augmentation is vectorised over the whole batch: random horizontal (and optionally vertical) flip,
random resized crop (bilinear) or pad-and-crop, then brightness/contrast jitter fused with the
normalisation in one float pass. ``Augment.out_size`` lets the stored images be larger than the
network's input: crops are then cut from the sharper stored image and brought down to the input
size with an area filter, instead of being cut from a thumbnail and blown back up. (Evaluation and
serving bring whole stored images to the input size with the preprocessing contract's own area
filter, which the pipeline applies; at a whole-number ratio such as 128 -> 64, the crop-free output
here equals it exactly.)

Reproducibility and resume: the shuffle order of epoch ``e`` comes from ``default_rng([seed, e])``
and the augmentation of batch ``b`` of epoch ``e`` from ``default_rng([seed, e, b, 1])``. Batches are
prepared ahead by background threads (a bounded queue of ``prefetch`` batches), so a single
sequential generator's live state would run ahead of what training has consumed; deriving every
generator from (seed, epoch, batch) instead makes the order and the augmentation identical however
many threads run and wherever a run is resumed. ``state_dict()`` therefore records the seed, the
epoch and how many batches of it were consumed, plus the shuffle generator's state for the epoch
(JSON-able, checked on load).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Augment", "ArrayDataset", "Batch", "DataLoader", "apply_view_boxes", "augment_batch", "normalize",
           "sample_view_boxes"]

STATE_VERSION = 1


class ArrayDataset:
    """Images ``(N, H, W, C)`` uint8 and labels ``(N,)`` int64 (or None: unlabelled)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray | None = None) -> None:
        if images.ndim != 4 or images.dtype != np.uint8:
            raise ValueError(f"images must be a (N, H, W, C) uint8 array, got {images.shape} {images.dtype}")
        if labels is not None:
            if labels.shape != (images.shape[0],):
                raise ValueError(f"labels shape {labels.shape} does not match {images.shape[0]} images")
            if not np.issubdtype(labels.dtype, np.integer):
                raise ValueError(f"labels must be integers, got {labels.dtype}")
        self.images = images
        self.labels = labels

    @classmethod
    def from_split(cls, split: Any) -> ArrayDataset:
        """From any object with ``.images`` and ``.labels`` (e.g. a dataset folder's split)."""
        return cls(split.images, split.labels)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uint8 images and int64 labels for ``indices``, in that order.

        Rows are read in ascending file order (memmap-friendly) and put back in the asked order.
        """
        idx = np.asarray(indices, np.int64)
        perm = np.argsort(idx, kind="stable")
        x = np.empty((len(idx), *self.images.shape[1:]), np.uint8)
        x[perm] = self.images[idx[perm]]
        y = (np.asarray(self.labels[idx], np.int64) if self.labels is not None
             else np.full(len(idx), -1, np.int64))
        return x, y


MAX_ZOOM_OUT = 4.0  # largest crop area as a multiple of the photo's: the photo then fills half of each side


@dataclass(frozen=True)
class Augment:
    """Training augmentation. ``crop``: "resized" (random resized crop), "pad" (pad-and-crop) or None."""

    hflip: bool = True
    vflip: bool = False
    crop: str | None = "resized"
    # area fraction of the random resized crop; above 1 the box is larger than the photo (zoomed out), the
    # frame filled by mirroring the photo at its edges
    scale: tuple[float, float] = (0.6, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # aspect ratio range of the crop
    pad: int = 4  # pixels of edge padding for crop="pad"
    brightness: float = 0.2  # multiplicative factor in [1 - b, 1 + b]
    contrast: float = 0.2  # factor in [1 - c, 1 + c] around each image's mean
    out_size: int | None = None  # side of the output in pixels (None: the input's own)

    def __post_init__(self) -> None:
        if self.crop not in (None, "resized", "pad"):
            raise ValueError(f"Augment.crop must be 'resized', 'pad' or None, got {self.crop!r}")
        if not 0 < self.scale[0] <= self.scale[1] <= MAX_ZOOM_OUT:
            raise ValueError(f"Augment.scale must satisfy 0 < lo <= hi <= {MAX_ZOOM_OUT}, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"Augment.ratio must satisfy 0 < lo <= hi, got {self.ratio}")
        if self.pad < 0 or self.brightness < 0 or self.contrast < 0:
            raise ValueError("Augment.pad, brightness and contrast must be >= 0")
        if self.out_size is not None and self.out_size < 1:
            raise ValueError(f"Augment.out_size must be >= 1 or None, got {self.out_size}")


def _gather_bilinear(x: np.ndarray, sy: np.ndarray, sx: np.ndarray) -> np.ndarray:
    """Sample each image n at rows ``sy[n]`` and columns ``sx[n]`` (float source coords), bilinear.

    ``x`` (N, H, W, C) uint8; ``sy`` (N, Ho); ``sx`` (N, Wo). Returns float32 (N, Ho, Wo, C).
    Columns are gathered per image with ``np.take`` on uint8, rows for the whole batch at once
    (whole-row copies): both avoid element-wise fancy indexing over three axes, several times slower.
    """
    n, h, w, c = x.shape
    sy = np.clip(sy, 0, h - 1)
    sx = np.clip(sx, 0, w - 1)
    y0 = np.floor(sy).astype(np.intp)
    x0 = np.floor(sx).astype(np.intp)
    y1 = np.minimum(y0 + 1, h - 1)
    x1 = np.minimum(x0 + 1, w - 1)
    ho, wo = sy.shape[1], sx.shape[1]
    # Weights shaped so the innermost loop runs over whole rows (W*C values), not over C=3.
    wy = (sy - y0).astype(np.float32)[:, :, None]  # (N, Ho, 1)
    wx = np.repeat((sx - x0).astype(np.float32), c, axis=1)[:, None, :]  # (N, 1, Wo*C)
    # Columns first, per image on uint8 (a quarter of the bytes of float32) ...
    left = np.empty((n, h, wo, c), np.uint8)
    right = np.empty((n, h, wo, c), np.uint8)
    for i in range(n):
        np.take(x[i], x0[i], axis=1, out=left[i])
        np.take(x[i], x1[i], axis=1, out=right[i])
    cols = left.astype(np.float32)
    cflat = cols.reshape(n, h, wo * c)
    cflat += (right.reshape(n, h, wo * c) - cflat) * wx
    # ... then rows for the whole batch at once (whole-row copies).
    b = np.arange(n)[:, None]
    out = cols[b, y0]
    lower = cols[b, y1]
    oflat, lflat = out.reshape(n, ho, wo * c), lower.reshape(n, ho, wo * c)
    lflat -= oflat
    lflat *= wy
    oflat += lflat
    return out


def _gather_int(x: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``out[n, i, j] = x[n, rows[n, i], cols[n, j]]`` for integer index arrays (uint8 stays uint8)."""
    r = x[np.arange(x.shape[0])[:, None], rows]
    out = np.empty((x.shape[0], rows.shape[1], cols.shape[1], x.shape[3]), x.dtype)
    for i in range(x.shape[0]):
        np.take(r[i], cols[i], axis=1, out=out[i])
    return out


def _supersampling(h: int, w: int, out: int) -> int:
    """Samples per output pixel and axis: enough that a downsampling resize averages its source
    pixels (an area filter) rather than picking a few of them (aliasing)."""
    return max(1, math.ceil(max(h, w) / out - 1e-9))


def _box_supersampling(h: int, w: int, bh: np.ndarray, bw: np.ndarray, out: int) -> int:
    """:func:`_supersampling` for boxes of ``bh`` x ``bw`` source pixels cut from an ``h`` x ``w`` image: a box
    larger than the image (zoomed out) covers more source pixels per output pixel and needs as many more samples."""
    return _supersampling(max(h, math.ceil(float(np.max(bh, initial=0)))),
                          max(w, math.ceil(float(np.max(bw, initial=0)))), out)


def _block_mean(x: np.ndarray, f: int) -> np.ndarray:
    """Average ``f`` x ``f`` blocks of an (N, f*H, f*W, C) float32 batch."""
    if f == 1:
        return x
    n, h, w, c = x.shape
    return np.ascontiguousarray(x.reshape(n, h // f, f, w // f, f, c).mean(axis=(2, 4), dtype=np.float32))


def _box_grid(top: np.ndarray, left: np.ndarray, bh: np.ndarray, bw: np.ndarray, out_h: int, out_w: int,
              f: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Source coordinates of an ``out_h`` x ``out_w`` grid (``f`` samples per pixel and axis) covering
    each box (top, left, height, width in source pixels); the +/-0.5 align pixel centres."""
    sh, sw = out_h * f, out_w * f
    sy = top[:, None] + (np.arange(sh)[None, :] + 0.5) * (bh / sh)[:, None] - 0.5
    sx = left[:, None] + (np.arange(sw)[None, :] + 0.5) * (bw / sw)[:, None] - 0.5
    return sy, sx


def _mirror(c: np.ndarray, n: int) -> np.ndarray:
    """Coordinates beyond the image's outer pixel edges (-0.5 and ``n`` - 0.5) reflected back inside, so a
    box larger than the image (zoomed out) shows the photo mirrored around it rather than its edge pixels
    smeared; coordinates between the edge and the outer pixel centre stay as they are (clamped later)."""
    if c.size == 0 or (c.min() >= -0.5 and c.max() <= n - 0.5):
        return c
    period = 2 * n
    m = np.mod(c + 0.5, period)  # position along a mirrored tiling of the image, edges at 0 and n
    return np.where(m < n, m, period - m) - 0.5


def _resample(x: np.ndarray, sy: np.ndarray, sx: np.ndarray, f: int) -> np.ndarray:
    """Bilinear samples of ``x`` (uint8 or float) at the grid ``sy``/``sx``, ``f`` x ``f`` blocks averaged."""
    sy, sx = _mirror(sy, x.shape[1]), _mirror(sx, x.shape[2])
    sampled = _gather_bilinear(x, sy, sx) if x.dtype == np.uint8 else _gather_float(np.asarray(x, np.float32), sy, sx)
    return _block_mean(sampled, f)


def _crop_sides(aug: Augment, rng: np.random.Generator, shape: int | tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Heights and widths of random resized crops as fractions of the photo's: an area drawn from
    ``aug.scale``, an aspect ratio from ``aug.ratio`` (log-uniform). A side may exceed the photo's only when the
    crops may zoom out (area above 1), and then by what the largest area allows."""
    area = rng.uniform(aug.scale[0], aug.scale[1], shape)
    r = np.exp(rng.uniform(math.log(aug.ratio[0]), math.log(aug.ratio[1]), shape))
    top = 1.0 if aug.scale[1] <= 1 else math.sqrt(aug.scale[1])
    return np.clip(np.sqrt(area / r), 0.05, top), np.clip(np.sqrt(area * r), 0.05, top)


def augment_batch(x: np.ndarray, aug: Augment, rng: np.random.Generator) -> np.ndarray:
    """Geometric augmentation of a uint8 batch -> float32 batch in [0, 255] (``out_size`` or same H, W)."""
    n, h, w, _ = (int(d) for d in x.shape)
    out_h, out_w = (aug.out_size, aug.out_size) if aug.out_size else (h, w)
    if aug.hflip:
        m = rng.random(n) < 0.5
        x = x.copy() if m.any() else x
        x[m] = x[m, :, ::-1]
    if aug.vflip:
        m = rng.random(n) < 0.5
        x = x.copy() if m.any() else x
        x[m] = x[m, ::-1]
    if aug.crop == "resized":
        ch, cw = _crop_sides(aug, rng, n)
        ch, cw = ch * h, cw * w  # in source pixels
        oy = rng.random(n) * (h - ch)  # a box larger than the photo starts above / left of it
        ox = rng.random(n) * (w - cw)
        f = _box_supersampling(h, w, ch, cw, aug.out_size) if aug.out_size else 1
        return _resample(x, *_box_grid(oy, ox, ch, cw, out_h, out_w, f), f)
    if aug.crop == "pad" and aug.pad > 0:
        dy = rng.integers(0, 2 * aug.pad + 1, n)
        dx = rng.integers(0, 2 * aug.pad + 1, n)
        rows = np.clip(np.arange(h)[None, :] + dy[:, None] - aug.pad, 0, h - 1)  # edge padding
        cols = np.clip(np.arange(w)[None, :] + dx[:, None] - aug.pad, 0, w - 1)
        x = _gather_int(x, rows, cols)
    if not aug.out_size or (out_h, out_w) == (h, w):
        return x.astype(np.float32)
    # Nothing cropped: the whole image is the box, resampled like a crop (block means at 128 -> 64).
    f = _supersampling(h, w, aug.out_size)
    zeros = np.zeros(n)
    return _resample(x, *_box_grid(zeros, zeros, np.full(n, float(h)), np.full(n, float(w)), out_h, out_w, f), f)


VIEW_FIELDS = ("top", "left", "height", "width", "hflip", "vflip")


def sample_view_boxes(n: int, k: int, aug: Augment, rng: np.random.Generator) -> np.ndarray:
    """``k`` augmented views per image as resolution-free boxes, ``(n, k, 6)`` float32.

    A view is a crop (top, left, height, width as fractions of the image) followed by optional
    flips, drawn like ``augment_batch`` draws them; with ``aug.scale`` above 1 a box may be larger than the
    image (sides above 1, top and left at or below 0: the image lies inside it, mirrored around itself by
    :func:`apply_view_boxes`). View 0 is always the plain image. Because the
    boxes are fractions, the same view can be cut from the teacher's 224x224 image and from the
    student's 64x64 one: that is what lets a teacher's targets be computed once per view and match
    exactly what the student is shown ("function matching").
    """
    boxes = np.zeros((n, k, 6), np.float32)
    boxes[:, :, 2:4] = 1.0
    m = (n, k - 1)
    if k > 1:
        if aug.crop == "resized":
            ch, cw = _crop_sides(aug, rng, m)
            boxes[:, 1:, 0] = rng.random(m) * (1 - ch)
            boxes[:, 1:, 1] = rng.random(m) * (1 - cw)
            boxes[:, 1:, 2], boxes[:, 1:, 3] = ch, cw
        if aug.hflip:
            boxes[:, 1:, 4] = rng.random(m) < 0.5
        if aug.vflip:
            boxes[:, 1:, 5] = rng.random(m) < 0.5
    return boxes


def apply_view_boxes(x: np.ndarray, boxes: np.ndarray, out_size: int | None = None) -> np.ndarray:
    """Cut view ``boxes[i]`` (one row of :func:`sample_view_boxes`) out of image ``x[i]``, bilinear.

    ``x`` (N, H, W, C) uint8 or float; returns float32 (N, S, S, C) with S = ``out_size`` (area-filtered
    when that is smaller than the image), or the input's own H, W. Bilinear resampling is linear with
    weights summing to one, so it commutes with per-channel normalisation: views may be cut before or
    after ``normalize`` with the same result.
    """
    n, h, w, _ = x.shape
    boxes = np.asarray(boxes, np.float32)
    if boxes.shape != (n, 6):
        raise ValueError(f"apply_view_boxes: boxes must be ({n}, 6), got {boxes.shape}")
    top, left, bh, bw = (boxes[:, i].astype(np.float64) for i in range(4))
    out_h, out_w = (out_size, out_size) if out_size else (h, w)
    f = _box_supersampling(h, w, bh * h, bw * w, out_size) if out_size else 1
    sy, sx = _box_grid(top * h, left * w, bh * h, bw * w, out_h, out_w, f)
    vf, hf = boxes[:, 5] > 0.5, boxes[:, 4] > 0.5
    sy[vf] = sy[vf, ::-1]
    sx[hf] = sx[hf, ::-1]
    return _resample(x, sy, sx, f)


def _gather_float(xf: np.ndarray, sy: np.ndarray, sx: np.ndarray) -> np.ndarray:
    """:func:`_gather_bilinear` for a float32 batch (values may be negative: normalised images)."""
    h, w = xf.shape[1:3]
    sy, sx = np.clip(sy, 0, h - 1), np.clip(sx, 0, w - 1)
    y0, x0 = np.floor(sy).astype(np.intp), np.floor(sx).astype(np.intp)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy = (sy - y0).astype(np.float32)[:, :, None, None]
    wx = (sx - x0).astype(np.float32)[:, None, :, None]
    b = np.arange(xf.shape[0])[:, None]
    top_rows, bottom_rows = xf[b, y0], xf[b, y1]  # (N, Ho, W, C)
    rows = top_rows + (bottom_rows - top_rows) * wy
    left_cols = np.take_along_axis(rows, x0[:, None, :, None], axis=2)
    right_cols = np.take_along_axis(rows, x1[:, None, :, None], axis=2)
    return np.ascontiguousarray(left_cols + (right_cols - left_cols) * wx, dtype=np.float32)


def normalize(x: np.ndarray, mean: np.ndarray, std: np.ndarray, aug: Augment | None = None,
              rng: np.random.Generator | None = None, *, inplace: bool = False) -> np.ndarray:
    """[0, 255] batch -> float32 ``(x / 255 - mean) / std``, with brightness/contrast jitter first.

    ``mean``/``std`` are per channel on the [0, 1] scale (as in a dataset manifest). The input is
    left untouched unless ``inplace`` is set and it is already a contiguous float32 array.
    """
    reuse = inplace and x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable
    x = x if reuse else np.array(x, dtype=np.float32, order="C")
    n = int(x.shape[0])
    if aug is not None and rng is not None and (aug.brightness > 0 or aug.contrast > 0):
        c = rng.uniform(1 - aug.contrast, 1 + aug.contrast, n).astype(np.float32)
        b = rng.uniform(1 - aug.brightness, 1 + aug.brightness, n).astype(np.float32)
        m = x.mean(axis=(1, 2, 3), dtype=np.float32)
        # ((x - m) * c + m) * b  ==  x * (c * b) + m * (1 - c) * b
        x *= (c * b)[:, None, None, None]
        x += (m * (1 - c) * b)[:, None, None, None]
        np.clip(x, 0.0, 255.0, out=x)
    scale = (1.0 / (255.0 * np.asarray(std, np.float32))).astype(np.float32)
    shift = (np.asarray(mean, np.float32) / np.asarray(std, np.float32)).astype(np.float32)
    # Per-channel constants tiled along a whole row, so the inner loop is W*C long rather than C.
    c, w = x.shape[-1], x.shape[-2]
    rows = x.reshape(-1, w * c)
    rows *= np.tile(scale, w)
    rows -= np.tile(shift, w)
    return x


class Batch(NamedTuple):
    """One batch of a :class:`DataLoader`: row ``i`` of ``images`` and ``labels`` is dataset row ``indices[i]``."""

    images: np.ndarray   # (B, H, W, C) float32, normalised (and augmented)
    labels: np.ndarray   # (B,) int64, -1 = unlabelled
    indices: np.ndarray  # (B,) int64 dataset rows
    number: int          # position of the batch in its epoch (0-based)


class DataLoader:
    """Seeded, shuffled, augmented, prefetched batches over an :class:`ArrayDataset`.

    Iterating runs one epoch (``len(loader)`` batches); after a complete pass the epoch counter
    advances by itself, and ``set_epoch(n)`` sets it explicitly. Breaking out of an epoch and
    iterating again restarts that epoch; ``load_state_dict`` resumes mid-epoch exactly.
    """

    def __init__(self, dataset: ArrayDataset, batch_size: int, *, shuffle: bool = True,
                 drop_last: bool = False, seed: int = 0, mean: Sequence[float] | np.ndarray = (0.0, 0.0, 0.0),
                 std: Sequence[float] | np.ndarray = (1.0, 1.0, 1.0), augment: Augment | None = None,
                 prefetch: int = 4, num_threads: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefetch < 0 or num_threads < 0:
            raise ValueError("prefetch and num_threads must be >= 0 (0 threads: prepare batches inline)")
        channels = dataset.image_shape[-1]
        self.mean = np.asarray(mean, np.float32).reshape(-1)
        self.std = np.asarray(std, np.float32).reshape(-1)
        if self.mean.shape != (channels,) or self.std.shape != (channels,) or not np.all(self.std > 0):
            raise ValueError(f"mean/std need {channels} values each with std > 0, got {mean}, {std}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = int(seed)
        self.augment = augment
        self.prefetch = prefetch
        self.num_threads = num_threads
        self.epoch = 0
        self.batches_done = 0  # consumed batches of the current epoch
        self._resume_at = 0

    # -- sizes and order -------------------------------------------------------------------------
    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _order_rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch])

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """The sample order of ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else epoch
        n = len(self.dataset)
        return self._order_rng(e).permutation(n) if self.shuffle else np.arange(n)

    def set_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)
        self.batches_done = 0
        self._resume_at = 0

    # -- one batch ---------------------------------------------------------------------------------
    def make_batch(self, order: np.ndarray, epoch: int, b: int) -> Batch:
        """Batch ``b`` of ``epoch`` given that epoch's order (deterministic, thread-safe); its
        ``indices`` are ``order[b * batch_size:(b + 1) * batch_size]``."""
        idx = np.asarray(order[b * self.batch_size:(b + 1) * self.batch_size], np.int64)
        x, y = self.dataset.get_batch(idx)
        if self.augment is not None:
            rng = np.random.default_rng([self.seed, epoch, b, 1])
            xf = augment_batch(x, self.augment, rng)
            return Batch(normalize(xf, self.mean, self.std, self.augment, rng, inplace=True), y, idx, b)
        return Batch(normalize(x, self.mean, self.std), y, idx, b)

    # -- iteration -----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        epoch, start = self.epoch, self._resume_at
        self._resume_at = 0
        self.batches_done = start
        order = self.epoch_order(epoch)
        total = len(self)
        if self.num_threads == 0 or self.prefetch == 0:
            for b in range(start, total):
                batch = self.make_batch(order, epoch, b)
                self.batches_done = b + 1
                yield batch
        else:
            pool = ThreadPoolExecutor(max_workers=self.num_threads, thread_name_prefix="leaflens-loader")
            pending: deque[Future] = deque()
            nxt = start
            try:
                for b in range(start, total):
                    while nxt < total and len(pending) < max(self.prefetch, 1):
                        pending.append(pool.submit(self.make_batch, order, epoch, nxt))
                        nxt += 1
                    batch = pending.popleft().result()
                    self.batches_done = b + 1
                    yield batch
            finally:
                for f in pending:
                    f.cancel()
                pool.shutdown(wait=True, cancel_futures=True)
        if self.batches_done == total and self.epoch == epoch:
            self.epoch = epoch + 1
            self.batches_done = 0

    # -- resume ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: seed, epoch, batches consumed, and the epoch's shuffle generator state."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "num_samples": len(self.dataset),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "augment": asdict(self.augment) if self.augment is not None else None,
            "rng": self._order_rng(self.epoch).bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the recorded position; refuses a state from a different dataset or setup."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        for key, mine in (("num_samples", len(self.dataset)), ("batch_size", self.batch_size),
                          ("shuffle", self.shuffle), ("drop_last", self.drop_last)):
            if state.get(key) != mine:
                raise ValueError(f"loader state has {key}={state.get(key)!r}, this loader has {mine!r}")
        mine_aug = _jsonish(asdict(self.augment)) if self.augment is not None else None
        if "augment" in state and _jsonish(state["augment"]) != mine_aug:
            raise ValueError(f"loader state was saved with augment={state['augment']!r}, this loader has "
                             f"{mine_aug!r}: resuming would change the training data mid-run")
        seed, epoch, done = int(state["seed"]), int(state["epoch"]), int(state["batches_done"])
        if not 0 <= done <= len(self):
            raise ValueError(f"loader state batches_done={done} is outside 0..{len(self)}")
        expected = np.random.default_rng([seed, epoch]).bit_generator.state
        if "rng" in state and _jsonish(state["rng"]) != _jsonish(expected):
            raise ValueError("loader state 'rng' does not match its seed and epoch (corrupt state?)")
        self.seed, self.epoch, self.batches_done, self._resume_at = seed, epoch, done, done


def _jsonish(obj: Any) -> Any:
    """Normalise ints/dicts so a state that went through JSON compares equal to a live one."""
    if isinstance(obj, dict):
        return {str(k): _jsonish(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonish(v) for v in obj]
    if isinstance(obj, np.integer):
        return int(obj)
    return obj
