"""Winograd F(2x2, 3x3) for 3x3, stride-1, pad-1 dense convolutions on NumPy (NHWC, OIHW weights).

Each 2x2 block of output pixels is computed from the 4x4 input tile around it through
``Y = A^T [(G g G^T) . (B^T d B)] A``: 16 element-wise products per channel pair instead of 36 (2.25x
fewer multiplies), done as 16 batched matrix products (tiles x Cin) @ (Cin x Cout). The input and output
transforms are additions and subtractions of whole arrays, no im2col.

Backward differentiates that same computation (Lavin & Gray, 2016): the output gradient is taken back
through the output transform once (``dM = A gy A^T``), then ``dU = V^T dM`` gives the weight gradient
(through the filter transform's adjoint, ``G^T dU G``) and ``dV = dM U^T`` the input gradient (through the
input transform's adjoint, an overlap-add of 4x4 tiles two pixels apart). Nothing of the size of im2col's
columns (9x the input) is kept for backward: the input is transformed again from its padded copy.

How it is laid out, and why. On two cores NumPy pays twice for many small calls: each call's fixed cost,
and the hand-over of Python's lock between the engine's threads at every call (measured here: calls of
10-20 us gain nothing from a second thread, calls of 100 us nearly 2x). It also walks a view whose inner
runs are short (every other NHWC pixel: C values) 2-4x slower than a contiguous one. So:

- the padded input is copied once into a polyphase layout, per block of images, P (H+2, 2, W/2+1, images,
  C) with P[h, q, s] = pixel (h, 2s+q): a tap of every tile of a tile row is then one slab of tw*images*C
  contiguous values;
- the 16 transformed planes are ordered (see :data:`ORDER`) so that each add or subtract of the transforms
  makes 2-8 planes at once: the input transform is 6 calls, the output transform 8, the output gradient's
  5 and the input gradient's 14 per chunk, instead of 20-40 plane-by-plane ones;
- chunks (a block of images x a few tile rows) are about CHUNK matrix rows per plane, and the products run
  in 256-row pieces, the size OpenBLAS's thin products run fastest at.

The student's two Winograd layers, forward + backward on two threads: 1.29-1.31x faster than the same
maths on NHWC views chunked by images (interleaved, README "The engine").

In exact arithmetic the result equals the direct convolution; in float32 the transforms add a few ulps
(the tests bound the difference to im2col's result).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.engine.parallel import for_chunks, for_rows, sum_in_order

# F(2x2, 3x3) matrices (Lavin & Gray): input B^T (4x4), filter G (4x3), output A^T (2x4).
BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=np.float64)
G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=np.float64)
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=np.float64)

# Plane p = 8g + 4i + k holds the transformed pair (a, b) = (A_OF[g][i], B_OF[k]): the rows a of B^T that
# share their taps (0 and 3 take differences two rows apart, 1 and 2 the sum and difference of the middle
# rows) sit side by side, and so do the columns b, so one call computes several planes.
A_OF = ((0, 3), (1, 2))
B_OF = (0, 3, 1, 2)
ORDER = np.array([4 * A_OF[g][i] + B_OF[k] for g in range(2) for i in range(2) for k in range(4)])

# Below this many input channels the products are too thin for Winograd to pay (the student's first layer,
# C = 3, measured slower than im2col); see Conv2d's dispatch.
MIN_CHANNELS = 16

# Matrix rows (tiles x images) per plane in one chunk, and per piece of the products. Chunks make calls long
# enough for both threads to gain and arrays that stay in the cache (a chunk's transformed input is 1 MB at
# C = 32): measured at the student's two Winograd layers (batch 64, forward + backward, 2 threads, median of
# 7-9), 256-1024 rows within the machine's noise (91-105 ms), 2048 125 ms, 4096 139 ms. OpenBLAS runs thin
# products ((rows, 32) @ (32, 64)) at 94 GFLOP/s in 256-row pieces on one core, 59 in 1024-row ones; the
# pieces made the two layers 2-6% faster (three interleaved runs of 11 rounds).
CHUNK = 512
PIECE = 256


def applies(x: Any, w: Any, stride: tuple[int, int], pads: tuple[int, int, int, int], groups: int) -> bool:
    """Whether the Winograd path serves this convolution: NumPy float32/64, 3x3, stride 1, pad 1 on every
    side, groups 1, an even output height and width, at least MIN_CHANNELS input channels and one image."""
    return (isinstance(x, np.ndarray) and x.dtype in (np.float32, np.float64) and x.dtype == w.dtype
            and x.shape[0] > 0
            and w.shape[2:] == (3, 3) and stride == (1, 1) and pads == (1, 1, 1, 1) and groups == 1
            and x.shape[1] % 2 == 0 and x.shape[2] % 2 == 0 and x.shape[3] >= MIN_CHANNELS)


def transform_filter(w: Any) -> Any:
    """OIHW (K, C, 3, 3) weight -> U (16, C, K), plane p = (G w G^T)[a, b] for p's (a, b) (see ORDER)."""
    u = np.einsum("ai,kcij,bj->abck", G.astype(w.dtype), w, G.astype(w.dtype), optimize=True)
    return np.ascontiguousarray(u.reshape(16, w.shape[1], w.shape[0])[ORDER])


def filter_grad(du: Any, shape: tuple[int, ...]) -> Any:
    """Adjoint of transform_filter: dU (16, C, K) -> dW (K, C, 3, 3) = G^T dU G."""
    g = G.astype(du.dtype)
    std = np.empty_like(du)
    std[ORDER] = du
    return np.ascontiguousarray(np.einsum("ai,abck,bj->kcij", g, std.reshape(4, 4, *du.shape[1:]), g,
                                          optimize=True))


def to_polyphase(x: Any) -> Any:
    """NHWC ``x`` -> its zero-padded copy as P (H+2, 2, W/2+1, N, C), P[h, q, s] = xpad[:, h, 2s+q]."""
    n, h, w, c = x.shape
    p = np.empty((h + 2, 2, w // 2 + 1, n, c), dtype=x.dtype)
    p[0] = 0
    p[h + 1] = 0
    p[1:h + 1, 0, 0] = 0  # padded column 0
    p[1:h + 1, 1, w // 2] = 0  # padded column W+1
    p[1:h + 1, 1, :w // 2] = x[:, :, 0::2].transpose(1, 2, 0, 3)  # column 2s   -> padded 2s+1
    p[1:h + 1, 0, 1:] = x[:, :, 1::2].transpose(1, 2, 0, 3)  # column 2s+1 -> padded 2s+2
    return p


def _products(a: Any, b: Any) -> Any:
    """a (tc, 16, rows, m) @ b (16, m, n) per plane, in PIECE-row pieces where rows divide into them."""
    tc, planes, rows, m = a.shape
    if rows > PIECE and rows % PIECE == 0 and a.flags.c_contiguous:
        out = np.matmul(a.reshape(tc, planes, rows // PIECE, PIECE, m), b[:, None])
        return out.reshape(tc, planes, rows, b.shape[-1])
    return np.matmul(a, b)


def _weight_products(v: Any, dm: Any) -> Any:
    """sum over tile rows and tiles of v^T dm per plane: (tc, 16, rows, C), (tc, 16, rows, K) -> (16, C, K),
    in PIECE-row pieces where rows divide into them."""
    tc, planes, rows, c = v.shape
    pieces = rows // PIECE if rows > PIECE and rows % PIECE == 0 else 1
    k = dm.shape[-1]
    out = np.matmul(v.reshape(tc, planes, pieces, rows // pieces, c).transpose(0, 1, 2, 4, 3),
                    dm.reshape(tc, planes, pieces, rows // pieces, k))
    return out.sum(axis=(0, 2)) if tc * pieces > 1 else out.reshape(planes, c, k)


def _input_transform(p: Any, t0: int, t1: int) -> Any:
    """V (tc, 16, tw*images, C) = B^T d B for every 4x4 tile d (stride 2) of tile rows t0..t1 of the
    polyphase input p, planes in ORDER."""
    hp, _, wh, n, c = p.shape
    tc, tw = t1 - t0, wh - 1
    # rows (over the tile's rows i -> a): a=0: r0 - r2, a=3: r1 - r3 (one subtract of two row-pair slabs);
    # a=1: r1 + r2, a=2: r2 - r1
    r = np.empty((tc, 2, 2, 2, wh, n, c), dtype=p.dtype)  # (t, g, i of the group, column phase, ...)
    np.subtract(p[2 * t0:2 * t1].reshape(tc, 2, 2, wh, n, c), p[2 * t0 + 2:2 * t1 + 2].reshape(tc, 2, 2, wh, n, c),
                out=r[:, 0])
    mid1, mid2 = p[2 * t0 + 1:2 * t1 + 1:2], p[2 * t0 + 2:2 * t1 + 2:2]
    np.add(mid1, mid2, out=r[:, 1, 0])
    np.subtract(mid2, mid1, out=r[:, 1, 1])
    # columns (over taps j -> b), tap j = phase j % 2, pair s + j // 2: b=0: c0 - c2, b=3: c1 - c3 (one
    # subtract over both phases); b=1: c1 + c2; b=2: c2 - c1
    v = np.empty((tc, 2, 2, 4, tw, n, c), dtype=p.dtype)
    np.subtract(r[..., 0:tw, :, :], r[..., 1:, :, :], out=v[:, :, :, 0:2])
    np.add(r[:, :, :, 1, 0:tw], r[:, :, :, 0, 1:], out=v[:, :, :, 2])
    np.subtract(r[:, :, :, 0, 1:], r[:, :, :, 1, 0:tw], out=v[:, :, :, 3])
    return v.reshape(tc, 16, tw * n, c)


def _out_view(y: Any, t0: int, t1: int, q: int) -> Any:
    """Output pixels (2t + r, 2s + q) of NHWC ``y`` for tile rows t0..t1 as a (tc, 2 (r), tw, images, K) view."""
    n, _, wd, k = y.shape
    return y[:, 2 * t0:2 * t1, q::2].reshape(n, t1 - t0, 2, wd // 2, k).transpose(1, 2, 3, 0, 4)


def _output_transform(m: Any, y: Any, t0: int, t1: int) -> None:
    """NHWC y rows 2*t0..2*t1 = A^T M A for every tile (M (tc, 16, tw*images, K), planes in ORDER)."""
    n, _, wd, k = y.shape
    tc, tw = t1 - t0, wd // 2
    mm = m.reshape(tc, 2, 2, 4, tw, n, k)
    # rows: r=0: M0 + M1 + M2, r=1: M1 - M2 - M3 (for every b at once)
    s = np.empty((tc, 2, 4, tw, n, k), dtype=m.dtype)
    np.add(mm[:, 1, 0], mm[:, 1, 1], out=s[:, 0])
    s[:, 0] += mm[:, 0, 0]
    np.subtract(mm[:, 1, 0], mm[:, 1, 1], out=s[:, 1])
    s[:, 1] -= mm[:, 0, 1]
    # columns: q=0: S0 + S1 + S2, q=1: S1 - S2 - S3 (both r at once), the last add written into y
    part = np.empty((tc, 2, tw, n, k), dtype=m.dtype)
    np.add(s[:, :, 2], s[:, :, 3], out=part)
    np.add(part, s[:, :, 0], out=_out_view(y, t0, t1, 0))
    np.subtract(s[:, :, 2], s[:, :, 3], out=part)
    np.subtract(part, s[:, :, 1], out=_out_view(y, t0, t1, 1))


_SIGNS = np.array([[1.0, -1.0], [-1.0, 1.0]])[:, :, None, None, None]


def _output_adjoint(gy: Any, t0: int, t1: int) -> Any:
    """dM (tc, 16, tw*images, K) = A gy A^T for each 2x2 block of NHWC gy in tile rows t0..t1 (planes in
    ORDER; the adjoint of _output_transform)."""
    n, _, wd, k = gy.shape
    tc, tw = t1 - t0, wd // 2
    dm = np.empty((tc, 2, 2, 4, tw, n, k), dtype=gy.dtype)
    g = gy[:, 2 * t0:2 * t1].reshape(n, tc, 2, tw, 2, k).transpose(1, 2, 4, 3, 0, 5)  # (t, r, q, s, image, K)
    # dM[a, b] = sum_r,q A[a, r] A[b, q] g[r, q]; group 0 holds a = 0 (r=0 only) and a = 3 (minus r=1):
    # dM[g0, r, b=0] = sign_r g[r, 0], dM[g0, r, b=3] = -sign_r g[r, 1], then b=1 and b=2 from those two
    np.multiply(g, _SIGNS.astype(gy.dtype), out=dm[:, 0, :, 0:2])
    np.subtract(dm[:, 0, :, 0], dm[:, 0, :, 1], out=dm[:, 0, :, 2])
    np.add(dm[:, 0, :, 0], dm[:, 0, :, 1], out=dm[:, 0, :, 3])
    # group 1: a = 1 (r=0 plus r=1) and a = 2 (r=0 minus r=1), from group 0's a = 0 and a = 3 (= minus r=1)
    np.subtract(dm[:, 0, 0], dm[:, 0, 1], out=dm[:, 1, 0])
    np.add(dm[:, 0, 0], dm[:, 0, 1], out=dm[:, 1, 1])
    return dm.reshape(tc, 16, tw * n, k)


def _overlap_view(gp: Any, t0: int, t1: int, rows: tuple[int, int], columns: tuple[int, int]) -> Any:
    """The (tc, 2, 2, tw, images, C) view of polyphase ``gp`` that receives tile rows t0..t1's values for
    padded tile rows ``rows`` (two of 0..3) and padded tile columns ``columns`` (two of 0..3)."""
    wh = gp.shape[2]
    sh, sq, ss = gp.strides[0], gp.strides[1], gp.strides[2]
    (i0, i1), (j0, j1) = rows, columns
    start = gp[2 * t0 + i0, j0 % 2, j0 // 2:j0 // 2 + wh - 1]
    return np.lib.stride_tricks.as_strided(
        start, shape=(t1 - t0, 2, 2, *start.shape),
        strides=(2 * sh, (i1 - i0) * sh, (j1 % 2 - j0 % 2) * sq + (j1 // 2 - j0 // 2) * ss, *start.strides))


def _input_adjoint(dv: Any, gp: Any, t0: int, t1: int) -> None:
    """Add to the polyphase input gradient gp the overlap-add of B dV B^T over the 4x4 tiles of tile rows
    t0..t1, two pixels apart (the adjoint of _input_transform; dV (tc, 16, tw*images, C), planes in ORDER).

    Tile rows t and t+1 share two padded rows: the caller runs chunks that touch the same rows one after
    the other."""
    _, _, wh, n, c = gp.shape
    tc, tw = t1 - t0, wh - 1
    x = dv.reshape(tc, 2, 2, 4, tw, n, c)
    tmp = np.empty((tc, 2, 2, tw, n, c), dtype=dv.dtype)
    # columns (b -> tap j): j0 = v0, j1 = v1 - v2 + v3, j2 = -v0 + v1 + v2, j3 = -v3; planes (v0, v3, v1, v2)
    # become (j0, j3, j2, j1)
    np.subtract(x[:, :, :, 2], x[:, :, :, 3], out=tmp)
    np.add(x[:, :, :, 2], x[:, :, :, 3], out=x[:, :, :, 2])
    x[:, :, :, 2] -= x[:, :, :, 0]
    np.add(tmp, x[:, :, :, 1], out=x[:, :, :, 3])
    np.negative(x[:, :, :, 1], out=x[:, :, :, 1])
    # rows (a -> padded row i), the same matrix: groups (a0, a3), (a1, a2) become (i0, i3), (i2, i1)
    tmp = tmp.reshape(tc, 4, tw, n, c)
    np.subtract(x[:, 1, 0], x[:, 1, 1], out=tmp)
    np.add(x[:, 1, 0], x[:, 1, 1], out=x[:, 1, 0])
    x[:, 1, 0] -= x[:, 0, 0]
    np.add(tmp, x[:, 0, 1], out=x[:, 1, 1])
    np.negative(x[:, 0, 1], out=x[:, 0, 1])
    # overlap-add: padded row 2t + i, padded column 2s + j -> gp[2t + i, j % 2, s + j // 2]; within one call no
    # two values land on the same element
    for g, rows in ((0, (0, 3)), (1, (2, 1))):
        for k, columns in ((0, (0, 3)), (2, (2, 1))):
            dest = _overlap_view(gp, t0, t1, rows, columns)
            np.add(dest, x[:, g, :, k:k + 2], out=dest)


def _chunks(n: int, th: int, tw: int) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """(image blocks [n0, n1), chunks (block, first tile row, end tile row)): each chunk's products have
    about CHUNK rows (tiles x images) per plane."""
    per_block = max(1, min(n, CHUNK // tw))
    count = -(-n // per_block)
    edges = [n * i // count for i in range(count + 1)]
    blocks = list(zip(edges[:-1], edges[1:]))
    chunks = []
    for b, (n0, n1) in enumerate(blocks):
        rows = max(1, CHUNK // (tw * (n1 - n0)))
        chunks += [(b, t0, min(th, t0 + rows)) for t0 in range(0, th, rows)]
    return blocks, chunks


def forward(x: Any, u: Any) -> tuple[Any, Any]:
    """(NHWC output, polyphase input blocks for :func:`backward`) of NHWC ``x`` (N, H, W, C) convolved
    through U (16, C, K) with padding 1."""
    n, h, wd, c = x.shape
    k = u.shape[2]
    blocks, chunks = _chunks(n, h // 2, wd // 2)
    ps: list[Any] = [None] * len(blocks)

    def pad(lo: int, hi: int) -> None:
        for b in range(lo, hi):
            ps[b] = to_polyphase(x[blocks[b][0]:blocks[b][1]])

    for_chunks(len(blocks), 1, x.size, pad)
    y = np.empty((n, h, wd, k), dtype=x.dtype)

    def run(lo: int, hi: int) -> None:
        for b, t0, t1 in chunks[lo:hi]:
            n0, n1 = blocks[b]
            _output_transform(_products(_input_transform(ps[b], t0, t1), u), y[n0:n1], t0, t1)

    for_chunks(len(chunks), 1, y.size * 9, run)
    return y, ps


def backward(ps: Any, u: Any, gy: Any, want_x: bool, want_w: bool) -> tuple[Any, Any]:
    """(dL/dU (16, C, K) or None, dL/dx (N, H, W, C) or None) of :func:`forward`, given its polyphase input
    blocks ``ps`` and the output gradient gy."""
    n, h, wd, k = gy.shape
    c = ps[0].shape[4]
    blocks, chunks = _chunks(n, h // 2, wd // 2)
    gps = [np.zeros_like(p) for p in ps] if want_x else []
    ut = u.transpose(0, 2, 1)

    def run(i: int) -> Any:
        b, t0, t1 = chunks[i]
        n0, n1 = blocks[b]
        dm = _output_adjoint(gy[n0:n1], t0, t1)
        du = None
        if want_w:
            v = _input_transform(ps[b], t0, t1)
            du = _weight_products(v, dm)
        if want_x:
            _input_adjoint(_products(dm, ut), gps[b], t0, t1)
        return du

    # chunks next to each other in a block share two padded rows of its input gradient: every other chunk
    # first, then the rest, so no two chunks running at once write the same values (and the sums come out
    # in the same order whatever the thread count)
    position = [0] * len(chunks)  # of each chunk within its block
    for i in range(1, len(chunks)):
        position[i] = position[i - 1] + 1 if chunks[i][0] == chunks[i - 1][0] else 0
    parts: list[Any] = [None] * len(chunks)
    for parity in (0, 1):
        wave = [i for i, pos in enumerate(position) if pos % 2 == parity]

        def run_wave(lo: int, hi: int, wave: list[int] = wave) -> Any:
            return run(wave[lo])

        for i, du in zip(wave, for_chunks(len(wave), 1, gy.size * 18 * len(wave) // len(chunks), run_wave)):
            parts[i] = du
    du = sum_in_order(parts) if want_w else None
    gx = None
    if want_x:
        gx = np.empty((n, h, wd, c), dtype=gy.dtype)

        def unpack(lo: int, hi: int) -> None:
            for (n0, n1), gp in zip(blocks, gps):
                gx[n0:n1, lo:hi, 0::2] = gp[1 + lo:1 + hi, 1, :wd // 2].transpose(2, 0, 1, 3)
                gx[n0:n1, lo:hi, 1::2] = gp[1 + lo:1 + hi, 0, 1:].transpose(2, 0, 1, 3)

        for_rows(np, h, gx.size, unpack)
    return du, gx
