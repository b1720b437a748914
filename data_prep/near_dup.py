"""Near-duplicate photos: a perceptual hash of the decoded pixels, a fast pairwise search, and groups.

Hash (:func:`photo_hashes`): the grey version of a decoded square is area-averaged to 32x32, its 8x8
lowest 2-D DCT frequencies are compared with their median (the DC term left out of the median), giving 64
bits with 32 set (a pHash). Re-encoding, resizing, format changes and small colour changes move a few
low frequencies a little; different photos differ in about half the bits. A crop, though, rescales
the whole picture and moves every frequency, so each photo also gets the hashes of its centre cropped
by 3 % and 6 % per side: a copy cropped by c per side is compared with the original cropped near c.

Distance of two photos (:func:`near_pairs`): the smallest Hamming distance between one photo's plain
hash and the other's plain or cropped hashes, either way round. Measured on iBeans at the stored 128 px
(benchmarks/near_duplicates.py, 150 photos altered): resized (x0.5, x2), re-encoded (JPEG quality 20-40,
PNG) and brightened copies are within 2 bits; centre crops of 1-6 % per side within 8 (7 %: 99 % of them,
8 %: 94 %, 10 %: 21 %); a 5 % strip cut off one side: 89 %. Of the 837,865 pairs of different iBeans
photos, none is within 8 bits but one, which is the same leaf photographed twice (train/healthy_train_244
and val/healthy_val_31); the next are at 10. Hence ``NEAR_THRESHOLD`` 8. The hash sees grey shapes only:
on a pest set (1,920 photos, 1.8 million pairs) two pairs of different moths, each on a plain white wall,
come within 8 bits, beside an edited copy and two shots of one slug, so the report lists every group's
files to look at.
``--check`` hashes a 64 px decode: within 2 bits of the stored size's hashes on iBeans.

The search compares every pair with vectorised XOR + popcount over ``uint64`` in row blocks of
``_BLOCK_ELEMENTS`` pairs, and links each block's matches into groups before the next, so its memory
stays flat whatever the number of photos or of copies (1-2 s for 20,000 photos on one core).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["HASH_CROPS", "HASH_GRID", "NEAR_THRESHOLD", "NearGroup", "hamming", "near_duplicate_groups",
           "near_pairs", "photo_hashes"]

HASH_GRID = 32  # grey grid the DCT is taken on
HASH_CROPS = (0.0, 0.03, 0.06)  # centre crops (fraction cut per side) hashed for every photo
NEAR_THRESHOLD = 8  # bits; see the module docstring for the measurements behind it
_FREQS = 8  # 8x8 lowest frequencies -> 64 bits
_BLOCK_ELEMENTS = 1 << 18  # pairs compared at once (2 MB of XOR, fits a CPU cache)

_k = np.arange(HASH_GRID)
# Rows of the orthogonal DCT-II basis (unnormalised: only signs relative to the median matter).
_DCT = np.cos(np.pi * (2 * _k[None, :] + 1) * _k[:HASH_GRID, None] / (2 * HASH_GRID))[:_FREQS].astype(np.float32)
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R 601 grey, as Pillow's "L"
_BIT_WEIGHTS = (np.uint64(1) << np.arange(64, dtype=np.uint64)).astype(np.uint64)


@functools.lru_cache(maxsize=8)
def _projections(side: int) -> np.ndarray:
    """``(len(HASH_CROPS), 8, side)`` float32: per crop, the area average of a ``side``-pixel axis into
    ``HASH_GRID`` cells followed by the 8 lowest DCT rows, so that ``P @ grey @ P.T`` is the crop's
    8x8 low-frequency block (one small matrix product instead of a resize per crop)."""
    pixel = np.arange(side, dtype=np.float64)[None, :]
    out = []
    for frac in HASH_CROPS:
        lo, hi = side * frac, side * (1.0 - frac)
        edges = lo + (hi - lo) * np.arange(HASH_GRID + 1) / HASH_GRID
        overlap = np.clip(np.minimum(edges[1:, None], pixel + 1) - np.maximum(edges[:-1, None], pixel), 0.0, None)
        out.append(_DCT.astype(np.float64) @ (overlap / overlap.sum(axis=1, keepdims=True)))
    return np.stack(out).astype(np.float32)


def photo_hashes(pixels: np.ndarray) -> np.ndarray:
    """``(3,)`` uint64: the pHash of a decoded ``(S, S, 3)`` uint8 square, then of its centre cropped by
    3 % and 6 % per side (``HASH_CROPS``)."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.shape[0] != pixels.shape[1]:
        raise ValueError(f"photo_hashes expects an (S, S, 3) uint8 square, got shape {pixels.shape}")
    side = pixels.shape[0]
    grey = (pixels.reshape(-1, 3) @ _LUMA).reshape(side, side)
    proj = _projections(side)
    n_crops = len(HASH_CROPS)
    rows = (proj.reshape(n_crops * _FREQS, side) @ grey).reshape(n_crops, _FREQS, side)
    coeffs = (rows @ proj.transpose(0, 2, 1)).reshape(n_crops, _FREQS * _FREQS)
    mid = (_FREQS * _FREQS - 1) // 2  # median of the 63 terms after the DC one
    median = np.partition(coeffs[:, 1:], mid, axis=1)[:, mid]
    bits = coeffs > median[:, None]
    return (bits.astype(np.uint64) * _BIT_WEIGHTS).sum(axis=1, dtype=np.uint64)


if hasattr(np, "bitwise_count"):  # NumPy 2
    def _popcount(x: np.ndarray) -> np.ndarray:
        return np.bitwise_count(x)
else:  # pragma: no cover - NumPy 1.x
    _BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], np.uint8)

    def _popcount(x: np.ndarray) -> np.ndarray:
        b = np.ascontiguousarray(x, np.uint64).view(np.uint8).reshape(*x.shape, 8)
        return _BYTE_BITS[b].sum(axis=-1, dtype=np.uint8)


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bitwise Hamming distance of uint64 hashes (broadcast)."""
    return _popcount(np.bitwise_xor(np.asarray(a, np.uint64), np.asarray(b, np.uint64)))


def _check_hashes(hashes: np.ndarray) -> np.ndarray:
    h = np.asarray(hashes, np.uint64)
    if h.ndim != 2 or h.shape[1] != len(HASH_CROPS):
        raise ValueError(f"expected (n, {len(HASH_CROPS)}) uint64 hashes from photo_hashes, got shape {h.shape}")
    return h


def _near_blocks(h: np.ndarray, threshold: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The pairs ``i < j`` within ``threshold`` bits, one block of rows at a time: ``(i, j, distance)``."""
    n = h.shape[0]
    block = max(1, _BLOCK_ELEMENTS // max(n, 1))
    plain = np.ascontiguousarray(h[:, 0])
    crops = [np.ascontiguousarray(h[:, k]) for k in range(1, h.shape[1])]
    for start in range(0, n, block):
        stop = min(n, start + block)
        rows = plain[start:stop, None]
        x = np.bitwise_xor(rows, plain[None, start:])  # this block against the photos from it on
        d = _popcount(x)
        for crop in crops:  # in place: one temporary of the block's size
            np.bitwise_xor(rows, crop[None, start:], out=x)
            np.minimum(d, _popcount(x), out=d)
            np.bitwise_xor(crop[start:stop, None], plain[None, start:], out=x)
            np.minimum(d, _popcount(x), out=d)
        d[np.tril_indices(stop - start)] = 255  # a photo and itself, and pairs already seen (i > j)
        i, j = np.nonzero(d <= threshold)
        yield i + start, j + start, d[i, j]


def near_pairs(hashes: np.ndarray, threshold: int = NEAR_THRESHOLD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair ``i < j`` of photos within ``threshold`` bits: arrays ``(i, j, distance)``.

    ``hashes`` is ``(n, len(HASH_CROPS))`` from :func:`photo_hashes`; the distance is the smallest of
    plain-vs-plain and plain-vs-cropped either way round. All pairs are returned at once (a folder of
    many copies of one photo has many): :func:`near_duplicate_groups` is the flat-memory way to group them.
    """
    found = list(_near_blocks(_check_hashes(hashes), threshold))
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint8)
    return (np.concatenate([f[0] for f in found]).astype(np.int64),
            np.concatenate([f[1] for f in found]).astype(np.int64),
            np.concatenate([f[2] for f in found]).astype(np.uint8))


@dataclass(frozen=True)
class NearGroup:
    """Photos linked as copies (directly or through others): their indices, ascending, and the largest
    distance of a link (0: identical hashes)."""

    members: tuple[int, ...]
    distance: int


def near_duplicate_groups(hashes: np.ndarray, threshold: int = NEAR_THRESHOLD) -> list[NearGroup]:
    """The groups (of 2 or more) of photos within ``threshold`` bits of another one, ordered by first member.

    Photos with identical hashes (the same picture, whatever its bytes) are merged before the search, and
    the pairs of each block are linked into groups as they are found, so neither the search nor a folder
    of a thousand copies of one photo holds more than one block's pairs in memory.
    """
    h = _check_hashes(hashes)
    if not len(h):
        return []
    unique, inverse = np.unique(h, axis=0, return_inverse=True)
    inverse = np.asarray(inverse).reshape(-1)
    parent = list(range(len(unique)))
    largest = [0] * len(unique)

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for block_i, block_j, block_d in _near_blocks(unique, threshold):
        for a, b, d in zip(block_i.tolist(), block_j.tolist(), block_d.tolist()):
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[rb] = ra
            largest[ra] = max(largest[ra], largest[rb], d)
    members: dict[int, list[int]] = {}
    for photo, u in enumerate(inverse.tolist()):
        members.setdefault(root(u), []).append(photo)
    return [NearGroup(tuple(m), largest[r]) for r, m in members.items() if len(m) > 1]
