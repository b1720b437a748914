"""Generated negatives: images that are certainly not the user's photos, made from the batch itself.

Outlier exposure (Hendrycks et al. 2019) trains a classifier to spread its probability evenly over the
classes on images from outside its task, so that what it has never seen stops getting confident
answers. The negatives here are generated, never collected: no one has to gather "everything that is
not a bean leaf", and no benchmark's out-of-domain photos leak into training. From a normalised NHWC
batch, each negative is one of:

- the photo cut into a 4x4 or 8x8 grid and its tiles shuffled (its colours and textures, not its shape);
- the photo with its colour channels permuted (its shapes, not its colours);
- smooth random blobs: coarse noise blown up to the image size, in the batch's own range of values.
"""

from __future__ import annotations

import numpy as np

__all__ = ["make_negatives"]

_KINDS = 3


def _shuffle_tiles(img: np.ndarray, grid: int, rng: np.random.Generator) -> np.ndarray:
    h, w, c = img.shape
    th, tw = h // grid, w // grid
    core = img[: th * grid, : tw * grid]
    tiles = core.reshape(grid, th, grid, tw, c).transpose(0, 2, 1, 3, 4).reshape(grid * grid, th, tw, c)
    tiles = tiles[rng.permutation(grid * grid)]
    out = img.copy()
    out[: th * grid, : tw * grid] = tiles.reshape(grid, grid, th, tw, c).transpose(0, 2, 1, 3, 4).reshape(
        th * grid, tw * grid, c)
    return out


def _blobs(shape: tuple[int, int, int], scale: float, rng: np.random.Generator) -> np.ndarray:
    h, w, c = shape
    cells = int(rng.choice([2, 4, 8]))
    coarse = rng.standard_normal((cells, cells, c)).astype(np.float32) * scale
    big = np.repeat(np.repeat(coarse, -(-h // cells), axis=0), -(-w // cells), axis=1)[:h, :w]
    return big + rng.standard_normal((h, w, c)).astype(np.float32) * (0.1 * scale)


def make_negatives(x: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` generated negatives (float32 NHWC, same size and value range as ``x``, a normalised batch)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 4 or len(x) == 0:
        raise ValueError(f"expected a non-empty NHWC batch, got shape {x.shape}")
    scale = float(x.std()) or 1.0
    out = np.empty((count, *x.shape[1:]), np.float32)
    perms = [p for p in ((0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))]
    for i in range(count):
        src = x[int(rng.integers(len(x)))]
        kind = i % _KINDS
        if kind == 0:
            out[i] = _shuffle_tiles(src, int(rng.choice([4, 8])), rng)
        elif kind == 1:
            out[i] = src[..., list(perms[int(rng.integers(len(perms)))])]
        else:
            out[i] = _blobs(src.shape, scale, rng)
    return out
