"""Winograd F(2x2, 3x3) for 3x3, stride-1, pad-1 dense convolutions on NumPy (NHWC, OIHW weights).

Each 2x2 block of output pixels is computed from the 4x4 input tile around it through
``Y = A^T [(G g G^T) . (B^T d B)] A``: 16 element-wise products per channel pair instead of 36 (2.25x
fewer multiplies), done as 16 batched matrix products (tiles x Cin) @ (Cin x Cout). The input and output
transforms are additions and subtractions of strided views of whole arrays, no im2col.

Backward differentiates that same computation (Lavin & Gray, 2016): the output gradient is taken back
through the output transform once (``dM = A gy A^T``), then ``dU = V^T dM`` gives the weight gradient
(through the filter transform's adjoint, ``G^T dU G``) and ``dV = dM U^T`` the input gradient (through the
input transform's adjoint, an overlap-add of 4x4 tiles two pixels apart). Nothing of the size of im2col's
columns (9x the input) is kept for backward: the input is transformed again from the input itself, which
the graph holds anyway.

In exact arithmetic the result equals the direct convolution; in float32 the transforms add a few ulps
(the tests bound the difference to im2col's result).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.engine.parallel import for_chunks

# F(2x2, 3x3) matrices (Lavin & Gray): input B^T (4x4), filter G (4x3), output A^T (2x4).
BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=np.float64)
G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=np.float64)
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=np.float64)

# Below this many input channels the products are too thin for Winograd to pay (the student's first layer,
# C = 3, measured slower than im2col); see Conv2d's dispatch.
MIN_CHANNELS = 16


def applies(x: Any, w: Any, stride: tuple[int, int], pads: tuple[int, int, int, int], groups: int) -> bool:
    """Whether the Winograd path serves this convolution: NumPy float32/64, 3x3, stride 1, pad 1 on every
    side, groups 1, an even output height and width, and at least MIN_CHANNELS input channels."""
    return (isinstance(x, np.ndarray) and x.dtype in (np.float32, np.float64) and x.dtype == w.dtype
            and w.shape[2:] == (3, 3) and stride == (1, 1) and pads == (1, 1, 1, 1) and groups == 1
            and x.shape[1] % 2 == 0 and x.shape[2] % 2 == 0 and x.shape[3] >= MIN_CHANNELS)


def _combine(srcs: list[Any], mat: np.ndarray, outs: list[Any]) -> None:
    """outs[k] = sum_j mat[k, j] * srcs[j] for a matrix of 0 and +-1 entries, by adds and subtracts."""
    for k, out in enumerate(outs):
        terms = [(mat[k, j], s) for j, s in enumerate(srcs) if mat[k, j] != 0]
        (c0, s0), (c1, s1) = terms[0], terms[1]
        if c0 > 0:
            (np.add if c1 > 0 else np.subtract)(s0, s1, out=out)
        elif c1 > 0:
            np.subtract(s1, s0, out=out)
        else:
            np.add(s0, s1, out=out)
            np.negative(out, out=out)
        for c, s in terms[2:]:
            (np.add if c > 0 else np.subtract)(out, s, out=out)


def transform_filter(w: Any) -> Any:
    """OIHW (K, C, 3, 3) weight -> U (16, C, K), U[4a+b] = (G w G^T)[a, b]."""
    u = np.einsum("ai,kcij,bj->abck", G.astype(w.dtype), w, G.astype(w.dtype), optimize=True)
    return np.ascontiguousarray(u.reshape(16, w.shape[1], w.shape[0]))


def filter_grad(du: Any, shape: tuple[int, ...]) -> Any:
    """Adjoint of transform_filter: dU (16, C, K) -> dW (K, C, 3, 3) = G^T dU G."""
    g = G.astype(du.dtype)
    return np.ascontiguousarray(np.einsum("ai,abck,bj->kcij", g, du.reshape(4, 4, *du.shape[1:]), g,
                                          optimize=True))


def _input_transform(xpad: Any, v: Any, lo: int, hi: int) -> None:
    """V[:, tiles of images lo..hi] = B^T d B for every 4x4 tile d (stride 2) of the padded input."""
    n, hp, wp, c = xpad.shape
    th, tw = (hp - 2) // 2, (wp - 2) // 2
    vv = v.reshape(16, n, th, tw, c)
    rows = [xpad[lo:hi, i:i + 2 * th:2] for i in range(4)]  # (b, th, wp, c)
    tmp = [np.empty((hi - lo, th, wp, c), dtype=xpad.dtype) for _ in range(4)]
    _combine(rows, BT, tmp)
    for a in range(4):
        cols = [tmp[a][:, :, j:j + 2 * tw:2] for j in range(4)]
        _combine(cols, BT, [vv[4 * a + b, lo:hi] for b in range(4)])


def _output_transform(m: Any, y: Any, lo: int, hi: int) -> None:
    """y[images lo..hi] = A^T M A, every tile's 2x2 output block written in place."""
    n, h, wd, k = y.shape
    th, tw = h // 2, wd // 2
    mm = m.reshape(16, n, th, tw, k)
    s = [np.empty((hi - lo, th, tw, k), dtype=m.dtype) for _ in range(8)]
    for b in range(4):  # rows first: s[2b + r] = sum_a AT[r, a] M[a, b]
        _combine([mm[4 * a + b, lo:hi] for a in range(4)], AT, [s[2 * b], s[2 * b + 1]])
    for r in range(2):
        _combine([s[2 * b + r] for b in range(4)], AT, [y[lo:hi, r::2, q::2] for q in range(2)])


def _output_adjoint(gy: Any, dm: Any, lo: int, hi: int) -> None:
    """dM[tiles of images lo..hi] = A gy A^T (the output transform's adjoint) for each 2x2 block of gy."""
    n, h, wd, k = gy.shape
    th, tw = h // 2, wd // 2
    dd = dm.reshape(16, n, th, tw, k)
    a_mat = AT.T  # (4, 2)
    e = [np.empty((hi - lo, th, tw, k), dtype=gy.dtype) for _ in range(8)]
    for q in range(2):  # rows: e[4q + a] = sum_r A[a, r] gy[r, q]
        _copy_combine([gy[lo:hi, r::2, q::2] for r in range(2)], a_mat, e[4 * q:4 * q + 4])
    for a in range(4):
        _copy_combine([e[4 * q + a] for q in range(2)], a_mat, [dd[4 * a + b, lo:hi] for b in range(4)])


def _copy_combine(srcs: list[Any], mat: np.ndarray, outs: list[Any]) -> None:
    """Like _combine, for rows that may have a single (+-1) term."""
    for k, out in enumerate(outs):
        terms = [(mat[k, j], s) for j, s in enumerate(srcs) if mat[k, j] != 0]
        if len(terms) == 1:
            c, s = terms[0]
            if c > 0:
                np.copyto(out, s)
            else:
                np.negative(s, out=out)
        else:
            _combine(srcs, mat[k:k + 1], [out])


def _input_adjoint(dv: Any, gx: Any, lo: int, hi: int) -> None:
    """gx[images lo..hi] = the unpadded part of the overlap-add of B dV B^T over 4x4 tiles two pixels apart.

    B's rows are (1, 0, 0, 0), (0, 1, -1, 1), (-1, 1, 1, 0), (0, 0, 0, -1): the copy and the negation go
    straight into (or are subtracted from) their destination, and the other two rows are written where they
    land, instead of through temporaries: measured 1.14x / 1.16x faster than through them at the student's
    chunks (2 images of 32x32x32, 5 of 16x16x64; one thread, interleaved, median of 30)."""
    n, h, wd, c = gx.shape
    th, tw = h // 2, wd // 2
    dd = dv.reshape(16, n, th, tw, c)
    # columns first: rows[a] = tile columns sum_b B[j, b] dV[a, b] overlap-added into (th, wd + 2)
    rows = [np.empty((hi - lo, th, wd + 2, c), dtype=dv.dtype) for _ in range(4)]
    scratch = np.empty((hi - lo, th, tw, c), dtype=dv.dtype)
    for a in range(4):
        d0, d1, d2, d3 = (dd[4 * a + b, lo:hi] for b in range(4))
        r = rows[a]
        r[:, :, 0:2 * tw:2] = d0
        odd = r[:, :, 1:2 * tw:2]
        np.subtract(d1, d2, out=odd)
        odd += d3
        r[:, :, 2 * tw:] = 0
        np.add(d1, d2, out=scratch)
        scratch -= d0
        r[:, :, 2:2 * tw + 2:2] += scratch
        r[:, :, 3:2 * tw + 2:2] -= d3
    # then rows: padded row 2t + i of tile row t gets sum_a B[i, a] rows[a][t]; padded row p is gx row p - 1
    # (and padded column q + 1 is gx column q)
    r0, r1, r2, r3 = (r[:, :, 1:wd + 1] for r in rows)
    g = gx[lo:hi]
    even, odd_rows = g[:, 0::2], g[:, 1::2]
    np.subtract(r1, r2, out=even)  # i = 1: rows[1] - rows[2] + rows[3]
    even += r3
    g[:, 2::2] -= r3[:, :-1]  # i = 3 of the tile row above: -rows[3]
    np.add(r1, r2, out=odd_rows)  # i = 2: -rows[0] + rows[1] + rows[2]
    odd_rows -= r0
    g[:, 1:2 * th - 2:2] += r0[:, 1:]  # i = 0 of the tile row below: rows[0]


def _images_per_chunk(n: int, tiles_per_image: int, channels: int) -> int:
    """Images per chunk: about CHUNK values of transformed input and output (16 per tile and channel)."""
    return max(1, min(n, CHUNK // max(16 * tiles_per_image * channels, 1)))


# Transformed values (V and M together) per chunk of images: 2^20 (4 MB of float32). Measured at the student's
# shapes (batch 64, one thread, CPU time of forward + backward, median of 5): 32x32x32->64 130, 130, 121,
# 132 ms and 16x16x64->128 123, 106, 76, 89 ms for 2^18, 2^19, 2^20, 2^21: smaller chunks pay NumPy's
# per-call cost (about 100 calls a chunk) more often than they gain from the cache.
CHUNK = 1 << 20


def forward(xpad: Any, u: Any, out_hw: tuple[int, int]) -> Any:
    """NHWC output of the padded input ``xpad`` (N, H+2, W+2, C) convolved through U (16, C, K)."""
    n, c = xpad.shape[0], xpad.shape[3]
    h, wd = out_hw
    k = u.shape[2]
    per = (h // 2) * (wd // 2)
    y = np.empty((n, h, wd, k), dtype=xpad.dtype)

    def run(lo: int, hi: int) -> None:
        v = np.empty((16, (hi - lo) * per, c), dtype=xpad.dtype)
        _input_transform(xpad[lo:hi], v, 0, hi - lo)
        _output_transform(np.matmul(v, u), y[lo:hi], 0, hi - lo)

    for_chunks(n, _images_per_chunk(n, per, c + k), y.size * 9, run)
    return y


def backward(xpad: Any, u: Any, gy: Any, want_x: bool, want_w: bool) -> tuple[Any, Any]:
    """(dL/dU (16, C, K) or None, dL/dx (N, H, W, C) or None) of :func:`forward` for output gradient gy."""
    n, h, wd, k = gy.shape
    c = xpad.shape[3]
    per = (h // 2) * (wd // 2)
    gx = np.empty((n, h, wd, c), dtype=gy.dtype) if want_x else None

    def run(lo: int, hi: int) -> Any:
        dm = np.empty((16, (hi - lo) * per, k), dtype=gy.dtype)
        _output_adjoint(gy[lo:hi], dm, 0, hi - lo)
        du = None
        if want_w:
            v = np.empty((16, (hi - lo) * per, c), dtype=xpad.dtype)
            _input_transform(xpad[lo:hi], v, 0, hi - lo)
            du = np.matmul(v.transpose(0, 2, 1), dm)
        if want_x:
            _input_adjoint(np.matmul(dm, u.transpose(0, 2, 1)), gx[lo:hi], 0, hi - lo)  # type: ignore[index]
        return du

    parts = for_chunks(n, _images_per_chunk(n, per, 2 * c + k), gy.size * 18, run)
    du = None
    if want_w:
        du = parts[0].copy()
        for p in parts[1:]:
            du += p
    return du, gx
