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

A copy turned or mirrored (a folder augmented with flips and rotations before the split, a photo saved
rotated) changes no pixel, only their places: the hash of the picture under each of the 7 other symmetries
of a square (``TURNS``) comes from the same 8x8 DCT block (odd frequencies negated, the block transposed),
and such copies come within 2 bits (benchmarks/near_duplicates.py, 60 photos a set: mirrored, upside down,
rotated 90 degrees, rotated and re-encoded: all found on iBeans, the pest photos and the synthetic leaves).
Different photos come near far more often once turned (the synthetic leaves, drawn symmetrical: 247 pairs
within 8 bits instead of 43, two of them within the colour threshold), so a pair found only turned counts
within ``TURN_THRESHOLD`` (4) bits: 50 pairs within 8 bits, every one a look-alike (colour 5.5 and above).
The turned hashes are of the whole picture, so a copy both turned and cropped is found less often (iBeans:
mirrored + 2 % crop 75 %, rotated + 3 % crop 27 %). Each link is confirmed by colour the way the hash made
it (:func:`_linked_colour`): two different leaves linked as they are are not made a copy by colours that
match once one is turned.

Grey shapes alone also link different photos framed alike: of the 1,200 labelled photos of the demo's
synthetic leaves (`make data`: one leaf, centred, on a plain or textured ground), 43 pairs of different
leaves were within 8 bits, so the demo's first preprocess warned of 24 label conflicts and 7 groups of
copies that were not there. Every pair the hash links is therefore confirmed by colour (:func:`colour_signatures`:
the photo's mean colour in a 3x3 grid, and of the same two centre crops): the mean absolute difference
of the 27 values, after taking out the pair's mean difference (a brightened copy), is at most
``COLOUR_THRESHOLD`` grey levels for a copy. Measured (benchmarks/near_duplicates.py --sample 60 at
128 px): the altered copies above, centre crops up to 8 %, have a colour distance of at most 2.6 on
iBeans, 3.2 on the synthetic leaves, 4.1 on pest photos, and the same bean leaf photographed twice 3.5;
the pairs of different synthetic leaves the hash links 5.7 and above (all 43 become look-alikes), the pest
set's two moth pairs and two slug shots 9.0 to 15.3. What the colour check costs: a 5 % strip cut off
one side moves the grid, so 90, 87 and 83 % of those copies are found (93, 87, 93 % by the hash alone),
every other alteration up to 8 % crops as before. A pair within 8 bits whose colours differ is a
*look-alike*: reported for a look, never counted as a copy, but kept in one split by the automatic split
(:class:`Copies`). A copy edited in colour lands there (the pest set's one, its background turned grey:
29.8).

The search compares every pair with vectorised XOR + popcount over ``uint64`` in row blocks of
``_BLOCK_ELEMENTS`` pairs, and links each block's matches into groups before the next, so its memory
stays flat whatever the number of photos or of copies (3-5 s for 20,000 photos on one core with the turns;
1-2 s without).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["COLOUR_GRID", "COLOUR_THRESHOLD", "HASH_COLUMNS", "HASH_CROPS", "HASH_GRID", "NEAR_THRESHOLD",
           "TURN_THRESHOLD", "TURNS",
           "Copies", "LookAlike",
           "NearGroup", "colour_distance", "colour_signatures", "find_copies", "hamming",
           "near_pairs", "photo_hashes"]

HASH_GRID = 32  # grey grid the DCT is taken on
HASH_CROPS = (0.0, 0.03, 0.06)  # centre crops (fraction cut per side) hashed for every photo
# The whole picture turned and mirrored (the 7 other symmetries of a square), hashed too: a copy flipped or
# rotated before the split (augmenting a folder, a phone's rotation saved into the pixels) is still a copy.
# Each as (transposed first, rows reversed, columns reversed): the one definition both the DCT block and the
# colour grid are turned by.
_TURN_STEPS = {"mirror": (False, False, True), "flip": (False, True, False), "rot180": (False, True, True),
               "transpose": (True, False, False), "rot90": (True, False, True), "rot270": (True, True, False),
               "antitranspose": (True, True, True)}
TURNS = tuple(_TURN_STEPS)
HASH_COLUMNS = len(HASH_CROPS) + len(TURNS)  # photo_hashes' hashes per photo
NEAR_THRESHOLD = 8  # bits; see the module docstring for the measurements behind it
# bits for a copy found turned or mirrored: such copies come within 2 (a whole picture turned or mirrored
# changes no pixel), while different photos come within 8 of each other far more often once turned (the
# demo's symmetrical leaves: 247 pairs instead of 43)
TURN_THRESHOLD = 4
COLOUR_GRID = 3  # cells per side of the colour signature
COLOUR_THRESHOLD = 5.0  # grey levels; see the module docstring for the measurements behind it
_LOOK_ALIKES_KEPT = 1000  # look-alike pairs listed (all are counted)
_COLOUR_PAIRS = 1 << 14  # pairs whose colours are compared at once (a few MB)
_FREQS = 8  # 8x8 lowest frequencies -> 64 bits
_BLOCK_ELEMENTS = 1 << 18  # pairs compared at once (2 MB of XOR, fits a CPU cache)

_k = np.arange(HASH_GRID)
# Rows of the orthogonal DCT-II basis (unnormalised: only signs relative to the median matter).
_DCT = np.cos(np.pi * (2 * _k[None, :] + 1) * _k[:HASH_GRID, None] / (2 * HASH_GRID))[:_FREQS].astype(np.float32)
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R 601 grey, as Pillow's "L"
_BIT_WEIGHTS = (np.uint64(1) << np.arange(64, dtype=np.uint64)).astype(np.uint64)


@functools.lru_cache(maxsize=16)
def _area_matrices(side: int, cells: int) -> np.ndarray:
    """``(len(HASH_CROPS), cells, side)`` float64: per crop, the area average of a ``side``-pixel axis
    (cropped by the crop's fraction on both ends) into ``cells`` cells, as a matrix."""
    pixel = np.arange(side, dtype=np.float64)[None, :]
    out = []
    for frac in HASH_CROPS:
        lo, hi = side * frac, side * (1.0 - frac)
        edges = lo + (hi - lo) * np.arange(cells + 1) / cells
        overlap = np.clip(np.minimum(edges[1:, None], pixel + 1) - np.maximum(edges[:-1, None], pixel), 0.0, None)
        out.append(overlap / overlap.sum(axis=1, keepdims=True))
    return np.stack(out)


@functools.lru_cache(maxsize=8)
def _projections(side: int) -> np.ndarray:
    """``(len(HASH_CROPS), 8, side)`` float32: per crop, the area average of a ``side``-pixel axis into
    ``HASH_GRID`` cells followed by the 8 lowest DCT rows, so that ``P @ grey @ P.T`` is the crop's
    8x8 low-frequency block (one small matrix product instead of a resize per crop)."""
    return (_DCT.astype(np.float64) @ _area_matrices(side, HASH_GRID)).astype(np.float32)


def _turned(block: np.ndarray, turn: str) -> np.ndarray:
    """The 8x8 DCT block (rows: vertical frequency u, columns: horizontal v) of the picture turned or mirrored:
    a DCT-II of a reversed sequence is the same with odd frequencies negated, and a transposed picture has the
    transposed block (exact on the area-averaged grid, whose cells are symmetric)."""
    transpose, rows, cols = _TURN_STEPS[turn]
    odd = (-1.0) ** np.arange(_FREQS, dtype=np.float32)
    out = block.T if transpose else block
    return out * (odd[:, None] if rows else 1.0) * (odd[None, :] if cols else 1.0)


def photo_hashes(pixels: np.ndarray) -> np.ndarray:
    """``(HASH_COLUMNS,)`` uint64: the pHash of a decoded ``(S, S, 3)`` uint8 square, then of its centre cropped
    by 3 % and 6 % per side (``HASH_CROPS``), then of the whole square turned and mirrored (``TURNS``)."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.shape[0] != pixels.shape[1]:
        raise ValueError(f"photo_hashes expects an (S, S, 3) uint8 square, got shape {pixels.shape}")
    side = pixels.shape[0]
    grey = (pixels.reshape(-1, 3) @ _LUMA).reshape(side, side)
    proj = _projections(side)
    n_crops = len(HASH_CROPS)
    rows = (proj.reshape(n_crops * _FREQS, side) @ grey).reshape(n_crops, _FREQS, side)
    blocks = rows @ proj.transpose(0, 2, 1)
    turned = np.stack([_turned(blocks[0], turn) for turn in TURNS])
    coeffs = np.concatenate([blocks, turned]).reshape(HASH_COLUMNS, _FREQS * _FREQS)
    mid = (_FREQS * _FREQS - 1) // 2  # median of the 63 terms after the DC one
    median = np.partition(coeffs[:, 1:], mid, axis=1)[:, mid]
    bits = coeffs > median[:, None]
    return (bits.astype(np.uint64) * _BIT_WEIGHTS).sum(axis=1, dtype=np.uint64)


def colour_signatures(pixels: np.ndarray) -> np.ndarray:
    """``(len(HASH_CROPS), COLOUR_GRID**2 * 3)`` uint8: the mean colour of a decoded ``(S, S, 3)`` uint8
    square in a ``COLOUR_GRID`` x ``COLOUR_GRID`` grid, then of its centre crops (``HASH_CROPS``)."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.shape[0] != pixels.shape[1]:
        raise ValueError(f"colour_signatures expects an (S, S, 3) uint8 square, got shape {pixels.shape}")
    area = _area_matrices(pixels.shape[0], COLOUR_GRID).astype(np.float32)
    # area @ channel @ area.T for every crop and channel at once
    cells = np.einsum("kas,stc,kbt->kabc", area, pixels.astype(np.float32), area, optimize=True)
    return np.clip(np.rint(cells), 0, 255).astype(np.uint8).reshape(len(HASH_CROPS), -1)


def _turn_cells(sig: np.ndarray, turn: str) -> np.ndarray:
    """A plain colour signature (``(..., COLOUR_GRID**2 * 3)``) of the picture turned or mirrored."""
    transpose, rows, cols = _TURN_STEPS[turn]
    cells = sig.reshape(*sig.shape[:-1], COLOUR_GRID, COLOUR_GRID, 3)
    out = np.swapaxes(cells, -3, -2) if transpose else cells
    flips = tuple(axis for axis, flip in ((-3, rows), (-2, cols)) if flip)
    return (np.flip(out, flips) if flips else out).reshape(sig.shape)


def colour_distance(a: np.ndarray, b: np.ndarray, pairings: str = "all") -> np.ndarray:
    """Colour distance of signature rows ``a`` and ``b`` (``(..., len(HASH_CROPS), n)``, broadcast): the
    smallest, over one photo's plain signature against the other's plain or cropped ones either way
    round (``pairings="crops"``), or against the other's plain one turned or mirrored (``"turns"``: ``TURNS``),
    or both (``"all"``), of the mean absolute difference after the mean difference is taken out (grey levels)."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    pairs = []
    if pairings in ("all", "crops"):
        pairs += [(a[..., 0, :], b[..., k, :]) for k in range(len(HASH_CROPS))]
        pairs += [(a[..., k, :], b[..., 0, :]) for k in range(1, len(HASH_CROPS))]
    if pairings in ("all", "turns"):
        pairs += [(a[..., 0, :], _turn_cells(b[..., 0, :], turn)) for turn in TURNS]
    if not pairs:
        raise ValueError(f"pairings must be 'all', 'crops' or 'turns', got {pairings!r}")
    dists = []
    for x, y in pairs:
        d = x - y
        dists.append(np.abs(d - d.mean(axis=-1, keepdims=True)).mean(axis=-1))
    return np.min(np.stack(dists), axis=0)


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
    if h.ndim != 2 or h.shape[1] != HASH_COLUMNS:
        raise ValueError(f"expected (n, {HASH_COLUMNS}) uint64 hashes from photo_hashes, got shape {h.shape}")
    return h


def _near_blocks(h: np.ndarray, threshold: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The pairs ``i < j`` within ``threshold`` bits, one block of rows at a time: ``(i, j, distance)``; a pair
    found only turned or mirrored counts when within ``TURN_THRESHOLD`` bits."""
    turn_threshold = min(threshold, TURN_THRESHOLD)
    n = h.shape[0]
    block = max(1, _BLOCK_ELEMENTS // max(n, 1))
    plain = np.ascontiguousarray(h[:, 0])
    crops = [np.ascontiguousarray(h[:, k]) for k in range(1, len(HASH_CROPS))]
    turns = [np.ascontiguousarray(h[:, k]) for k in range(len(HASH_CROPS), HASH_COLUMNS)]
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
        turned = np.full_like(d, 255)
        for turn in turns:  # either way round, as the crops: a turned hash is not exactly the inverse turn's
            np.bitwise_xor(rows, turn[None, start:], out=x)
            np.minimum(turned, _popcount(x), out=turned)
            np.bitwise_xor(turn[start:stop, None], plain[None, start:], out=x)
            np.minimum(turned, _popcount(x), out=turned)
        turned[turned > turn_threshold] = 255
        np.minimum(d, turned, out=d)
        d[np.tril_indices(stop - start)] = 255  # a photo and itself, and pairs already seen (i > j)
        i, j = np.nonzero(d <= threshold)
        yield i + start, j + start, d[i, j]


def near_pairs(hashes: np.ndarray, threshold: int = NEAR_THRESHOLD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair ``i < j`` of photos within ``threshold`` bits: arrays ``(i, j, distance)``.

    ``hashes`` is ``(n, len(HASH_CROPS))`` from :func:`photo_hashes`; the distance is the smallest of
    plain-vs-plain and plain-vs-cropped either way round. All pairs are returned at once (a folder of
    many copies of one photo has many): :func:`find_copies` is the flat-memory way to group them.
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


@dataclass(frozen=True)
class LookAlike:
    """Two photos the hash links (``bits`` apart) whose colours differ (``colour`` grey levels, above
    ``COLOUR_THRESHOLD``): alike in grey shapes, counted as different photos."""

    a: int
    b: int
    bits: int
    colour: float


@dataclass(frozen=True)
class Copies:
    """What :func:`find_copies` found: the groups of copies, the look-alike pairs (the first
    ``_LOOK_ALIKES_KEPT``, ordered by photo), how many look-alike pairs there are in all, and the groups
    by grey shapes alone (copies and look-alikes linked: the automatic split keeps each in one split,
    which costs nothing and keeps a copy edited in colour out of the other splits)."""

    groups: list[NearGroup]
    look_alikes: list[LookAlike]
    look_alike_pairs: int
    shape_groups: list[NearGroup]


def find_copies(hashes: np.ndarray, colours: np.ndarray | None = None, threshold: int = NEAR_THRESHOLD,
                colour_threshold: float = COLOUR_THRESHOLD) -> Copies:
    """The groups (of 2 or more) of photos linked as copies, ordered by first member.

    Two photos are linked when their hashes are within ``threshold`` bits and (``colours`` given, from
    :func:`colour_signatures`, row-aligned) their colours within ``colour_threshold``; a pair within the
    bits but not the colours is a look-alike. Photos with identical hashes and signatures (the same
    picture, whatever its bytes) are merged before the search, and the pairs of each block are linked into
    groups as they are found, so neither the search nor a folder of a thousand copies of one photo holds
    more than one block's pairs in memory.
    """
    h = _check_hashes(hashes)
    if colours is not None:
        colours = np.asarray(colours, np.uint8)
        if colours.ndim != 3 or colours.shape[:2] != (len(h), len(HASH_CROPS)):
            raise ValueError(f"expected ({len(h)}, {len(HASH_CROPS)}, n) uint8 colour signatures, got shape "
                             f"{colours.shape}")
    if not len(h):
        return Copies([], [], 0, [])
    keys = h if colours is None else np.concatenate([h.view(np.uint8).reshape(len(h), -1),
                                                     colours.reshape(len(h), -1)], axis=1)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    inverse = np.asarray(inverse).reshape(-1)
    unique = h[first]
    unique_colours = None if colours is None else colours[first]
    copies, shapes = _Links(len(unique)), _Links(len(unique))
    look_alikes: list[LookAlike] = []
    look_alike_pairs = 0
    for block_i, block_j, block_d in _near_blocks(unique, threshold):
        shapes.link(block_i, block_j, block_d)
        if unique_colours is not None and len(block_i):
            colour = _linked_colour(unique, unique_colours, block_i, block_j, threshold)
            alike = colour > colour_threshold
            look_alike_pairs += int(alike.sum())
            for a, b, d, c in zip(block_i[alike].tolist(), block_j[alike].tolist(), block_d[alike].tolist(),
                                  colour[alike].tolist()):
                if len(look_alikes) < _LOOK_ALIKES_KEPT:
                    look_alikes.append(LookAlike(int(first[a]), int(first[b]), int(d), round(float(c), 1)))
            block_i, block_j, block_d = block_i[~alike], block_j[~alike], block_d[~alike]
        copies.link(block_i, block_j, block_d)
    look_alikes.sort(key=lambda p: (min(p.a, p.b), max(p.a, p.b)))
    return Copies(copies.groups(inverse),
                  [LookAlike(min(p.a, p.b), max(p.a, p.b), p.bits, p.colour) for p in look_alikes],
                  look_alike_pairs, shapes.groups(inverse))


def _linked_colour(h: np.ndarray, colours: np.ndarray, i: np.ndarray, j: np.ndarray, threshold: int) -> np.ndarray:
    """The colour distance of each pair the hash linked, compared the way the hash linked it: plain and cropped
    where those hashes are within ``threshold``, turned where the turned ones are within ``TURN_THRESHOLD``
    (a pair linked unturned is not made a copy by colours that match once turned)."""
    crops = len(HASH_CROPS)
    out = np.full(len(i), np.inf, np.float32)
    for k in range(0, len(i), _COLOUR_PAIRS):  # a folder of re-encoded copies links all their pairs
        a, b = i[k:k + _COLOUR_PAIRS], j[k:k + _COLOUR_PAIRS]
        plain = np.minimum(hamming(h[a, :1], h[b, :crops]).min(axis=1), hamming(h[a, :crops], h[b, :1]).min(axis=1))
        turned = np.minimum(hamming(h[a, :1], h[b, crops:]).min(axis=1), hamming(h[a, crops:], h[b, :1]).min(axis=1))
        part = np.full(len(a), np.inf, np.float32)
        by_crops = plain <= threshold
        if by_crops.any():
            part[by_crops] = colour_distance(colours[a[by_crops]], colours[b[by_crops]], "crops")
        by_turns = turned <= min(threshold, TURN_THRESHOLD)
        if by_turns.any():
            part[by_turns] = np.minimum(part[by_turns],
                                        colour_distance(colours[a[by_turns]], colours[b[by_turns]], "turns"))
        out[k:k + _COLOUR_PAIRS] = part
    return out


class _Links:
    """Union-find over the unique pictures, with the largest distance of a link in each group."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))
        self.largest = [0] * n

    def root(self, a: int) -> int:
        parent = self.parent
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def link(self, block_i: np.ndarray, block_j: np.ndarray, block_d: np.ndarray) -> None:
        for a, b, d in zip(block_i.tolist(), block_j.tolist(), block_d.tolist()):
            ra, rb = self.root(a), self.root(b)
            if ra != rb:
                self.parent[rb] = ra
            self.largest[ra] = max(self.largest[ra], self.largest[rb], d)

    def groups(self, inverse: np.ndarray) -> list[NearGroup]:
        """The groups of 2 or more photos (``inverse``: photo -> unique picture), ordered by first member."""
        members: dict[int, list[int]] = {}
        for photo, u in enumerate(inverse.tolist()):
            members.setdefault(self.root(u), []).append(photo)
        return [NearGroup(tuple(m), self.largest[r]) for r, m in members.items() if len(m) > 1]
