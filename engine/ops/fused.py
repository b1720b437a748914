"""BatchNorm (batch statistics) -> ReLU -> 2x2 stride-2 max-pool as one op on NumPy, in cache-sized tiles.

Why: the student's blocks end in exactly this chain, and on a CPU the three ops are memory passes, not
arithmetic: run one after another, each reads and writes the whole convolution output (BatchNorm's
output, ReLU's output and the pooling gradient are full-size arrays that go through memory), and the
graph keeps ReLU's output for backward. Fused, a tile of image row pairs is normalised, rectified and
pooled while it sits in the cache; only the pooled quarter-size output is written and kept.

Forward: the batch statistics in BatchNorm's two passes (:func:`leaflens.engine.ops.norm.batch_statistics`,
the same code, so the same numbers), then per tile ``z = (x - mean) * k + beta`` (BatchNorm's formula,
``k = gamma / std``), the max over the 4 taps, then ReLU on the pooled values (``relu(max z) = max relu(z)``).

When every channel's scale ``k`` is positive (the usual case; :data:`MONOTONE`), the formula is non-decreasing
in x, rounding included, so ``max z = z(max x)``: forward takes the tap maxima of x and normalises only those
(a quarter of the values), keeping them for backward. There BatchNorm's sums need only the pooled arrays (its
output gradient is the pooled one at each window's maximum of x, where x is that saved maximum), and one pass
over the full-size tiles writes the input gradient. Where the normalised values of two taps round to the same
number but x differs, the gradient goes to the larger x (the true maximum), not to the first tap.
Measured at the student's training step (batch 64): the fused op's backward 47.5 -> 25.9 ms per step, the
step 1.04-1.11x faster (interleaved A/B runs; README, "The engine").

Otherwise (a zero, negative or NaN scale), backward: per tile, ``z`` and its tap maxima are recomputed from
the input (which the graph holds anyway); the pooled gradient times the ReLU mask (pooled output > 0, which
is ReLU's mask at the winning tap) goes to the first tap equal to the max, as MaxPool2d's backward does; that
is BatchNorm's output gradient ``g`` for the tile, written into the input gradient's tile, with the column
sums of ``g`` and ``g * (x - mean)`` taken in the same pass. A second pass turns those tiles into BatchNorm's
input gradient.

Values equal BatchNorm2d -> ReLU -> MaxPool2d(2) computed one after another (the tests compare them); the
gradients differ by rounding only (the affine parameters' sums are taken in another order). Measured at the
student's three blocks (batch 64, forward + backward, interleaved): 1.25x faster than the three ops, and
the training step's memory growth 250 -> 153 MB (README, "The engine"). NumPy only: on CuPy (and for
other shapes) :class:`leaflens.engine.nn.Sequential` runs the three modules as they are. The module tree,
the state dict and the ONNX export (traced in eval mode, where nothing is fused) do not change.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.engine import amp
from leaflens.engine.ops.norm import batch_statistics, update_running
from leaflens.engine.parallel import column_sums, for_tiles, rows_per_tile, sum_in_order
from leaflens.engine.tensor import Function, Tensor

# Whether leaflens.engine.nn.Sequential runs BatchNorm2d -> ReLU -> MaxPool2d(2) through this op (tests and the
# speed benchmark turn it off to compare with the three ops run one after another).
ENABLED = True

# Values per tile of the normalise-pool passes and of backward (the statistics use BatchNorm's tiles, so they are
# the same numbers): several tile-sized operands live at once here (input, normalised values, gradient, masks),
# and NumPy's per-call cost weighs more than with one pass per tile. Measured at the student's three blocks
# (batch 64, forward + backward, interleaved, median of 11 rounds, 2 cores at load 7-8), before the monotone
# path: against 2^16, 2^15 took 1.26x the time, 2^17 0.83-0.91x, 2^18 0.89-0.92x, 2^19-2^20 6-8x. With it
# (fewer passes, longer calls), the student's step at 2^17 took 1.034x its time at 2^18 (9 rounds, idle).
TILE = 1 << 18

# Whether the op takes the monotone path when every channel's scale is positive (tests and the speed benchmark
# turn it off to compare with the general path, which recomputes the normalised values in backward).
MONOTONE = True

# the taps of a 2x2 window in MaxPool2d's order (row-major): ties go to the first
_TAPS = ((0, 0), (0, 1), (1, 0), (1, 1))


def pool_is_2x2(kernel_size: Any, stride: Any, padding: Any) -> bool:
    """Whether MaxPool2d(kernel_size, stride, padding) is the 2x2, stride-2, unpadded pool fused here."""
    def pair(v: Any) -> Any:
        return (v, v) if isinstance(v, int) else tuple(v) if isinstance(v, (tuple, list)) else v

    return (pair(kernel_size) == (2, 2) and (stride is None or pair(stride) == (2, 2))
            and (padding in (0, "valid") or pair(padding) in ((0, 0), (0, 0, 0, 0))))


def applies(x: Any) -> bool:
    """Whether the fused op serves this (NHWC) input: NumPy float32/64 with even height and width."""
    return (isinstance(x, np.ndarray) and x.ndim == 4 and x.dtype in (np.float32, np.float64)
            and x.shape[1] % 2 == 0 and x.shape[2] % 2 == 0 and x.shape[1] > 0 and x.shape[2] > 0
            and x.shape[0] * x.shape[1] * x.shape[2] >= 2)


def _template(v: Any, rows: int) -> Any:
    """``v`` (one value per column) repeated over ``rows`` contiguous rows: a tile minus it runs NumPy's
    flat loop, not a broadcast one (see leaflens.engine.parallel.per_tile)."""
    return np.broadcast_to(v, (rows, v.shape[-1])).copy()


def _tap_max(z5: Any, out: Any = None) -> Any:
    """(t, Wo, C) maxima over the 2x2 taps of a (t, 2, Wo, 2, C) tile."""
    rows = np.maximum(z5[:, 0], z5[:, 1])
    return np.maximum(rows[:, :, 0], rows[:, :, 1], out=out)


def _first_hits(hits: Any) -> None:
    """Keep only the first hit (in MaxPool2d's tap order) of each window of a (t, 2, Wo, 2, C) mask."""
    claimed = None
    for i, j in _TAPS:
        hit = hits[:, i, :, j]
        if claimed is None:
            claimed = hit.copy()
        else:
            np.greater(hit, claimed, out=hit)  # hit and not claimed by an earlier tap
            claimed |= hit


class BatchNormReLUMaxPool(Function):
    """``max_pool2d(relu(batch_norm(x, gamma, beta, training=True)), 2)`` on NHWC NumPy arrays."""

    def __init__(self, running_mean: Any, running_var: Any, momentum: float, eps: float):
        self.running_mean, self.running_var = running_mean, running_var
        self.momentum, self.eps = momentum, eps

    def forward(self, x, gamma, beta):
        if not applies(x):
            raise ValueError(f"batch_norm_relu_max_pool needs a NumPy float NHWC input with even height and "
                             f"width, got {type(x).__name__} of shape {tuple(x.shape)}")
        n, h, w, c = x.shape
        if gamma.shape != (c,) or beta.shape != (c,):
            raise ValueError(f"batch_norm_relu_max_pool: input has {c} channels (last axis of shape "
                             f"{tuple(x.shape)}) but weight/bias have shapes {tuple(gamma.shape)}/{tuple(beta.shape)}")
        x2 = np.ascontiguousarray(x).reshape(-1, c)
        mean, var = batch_statistics(np, x2)
        inv = 1 / np.sqrt(var + x.dtype.type(self.eps))
        update_running(self.running_mean, self.running_var, mean, var, x2.shape[0], self.momentum)
        self.shape, self.x2, self.mean, self.inv, self.gamma, self.beta = x.shape, x2, mean, inv, gamma, beta
        self.row = 2 * w  # x2 rows per row pair (two image rows: one row of pooling windows)
        self.per = rows_per_tile(self.row * c, TILE)  # row pairs per tile, as for_tiles cuts them
        self.mean_t = _template(mean, self.per * self.row)
        self.k_t = _template(inv * gamma, self.per * self.row)
        self.beta_t = _template(beta, self.per * self.row)
        y = np.empty((n, h // 2, w // 2, c), dtype=x.dtype)
        y3 = y.reshape(-1, w // 2, c)
        # Every channel's scale k > 0: BatchNorm's formula is then non-decreasing in x (each rounded step is),
        # so the normalised maximum of a window is the normalised maximum of x; only the pooled maxima need
        # normalising, and backward finds each window's winner from x alone.
        self.monotone = MONOTONE and bool(np.all(self.k_t[0] > 0))
        if self.monotone:
            self.xmax3 = np.empty_like(y3)
            quarter = self.row // 4

            def run(lo: int, hi: int) -> None:
                m = _tap_max(self.x2[lo * self.row:hi * self.row].reshape(hi - lo, 2, quarter, 2, c),
                             out=self.xmax3[lo:hi])
                z = np.subtract(m, self.mean_t[:(hi - lo) * quarter].reshape(m.shape), out=y3[lo:hi])
                z *= self.k_t[:(hi - lo) * quarter].reshape(m.shape)
                z += self.beta_t[:(hi - lo) * quarter].reshape(m.shape)
                np.maximum(z, 0, out=z)
        else:
            def run(lo: int, hi: int) -> None:
                np.maximum(_tap_max(self._z(lo, hi)), 0, out=y3[lo:hi])

        for_tiles(np, y3.shape[0], self.row * c, run, TILE)
        self.y3 = y3
        return y

    def _z(self, lo: int, hi: int, out: Any = None) -> Any:
        """BatchNorm's output for row pairs lo..hi, as a (pairs, 2, Wo, 2, C) tile (BatchNorm's own formula,
        so forward and backward see the same values)."""
        a, b = lo * self.row, hi * self.row
        z = np.subtract(self.x2[a:b], self.mean_t[:b - a], out=out)
        z *= self.k_t[:b - a]
        z += self.beta_t[:b - a]
        c = self.x2.shape[1]
        return z.reshape(hi - lo, 2, self.row // 4, 2, c)

    def backward(self, gy):
        if self.monotone:
            return self._backward_monotone(gy)
        n, h, w, c = self.shape
        want_x = self.needs_grad[0]
        x2, row = self.x2, self.row
        gx2 = np.empty_like(x2) if want_x else None
        gy3 = gy.reshape(-1, w // 2, c)

        def sums(lo: int, hi: int) -> Any:
            a, b = lo * row, hi * row
            z5 = self._z(lo, hi)
            m = _tap_max(z5)
            g = gy3[lo:hi] * (self.y3[lo:hi] > 0)  # ReLU's mask at the winning tap
            d = gx2[a:b] if want_x else np.empty((b - a, c), dtype=x2.dtype)  # BatchNorm's output gradient
            d5 = d.reshape(z5.shape)
            hits = np.equal(z5, m[:, None, :, None, :])  # every tap at its window's max, one pass
            # A finite max is one of its taps, so every window has a hit; as many hits as windows then means
            # one each. Otherwise (ties, or NaN) keep only the first hit of each window, as MaxPool2d does.
            if np.count_nonzero(hits) != m.size or not np.isfinite(m).all():
                _first_hits(hits)
            np.multiply(g[:, None, :, None, :], hits, out=d5)
            xc = np.subtract(x2[a:b], self.mean_t[:b - a], out=z5.reshape(b - a, c))  # z's buffer, no longer read
            xc *= d
            sum_d: Any = column_sums(np, d)
            sum_xc: Any = column_sums(np, xc)
            return np.stack([sum_d, sum_xc])

        pairs = gy3.shape[0]
        gbeta, gxc = sum_in_order(for_tiles(np, pairs, row * c, sums, TILE))
        count = x2.shape[0]
        ggamma = gxc * self.inv
        if want_x:
            coef_t = _template(self.inv * (ggamma / count), self.per * row)
            mean_g_t = _template(gbeta / count, self.per * row)

            def grad(lo: int, hi: int) -> None:
                # BatchNorm's: gx = k * (g - mean(g) - xhat * mean(g * xhat)), xhat = (x - mean) * inv
                a, b = lo * row, hi * row
                out = gx2[a:b]
                tmp = np.subtract(x2[a:b], self.mean_t[:b - a])
                tmp *= coef_t[:b - a]
                out -= tmp
                out -= mean_g_t[:b - a]
                out *= self.k_t[:b - a]

            for_tiles(np, pairs, row * c, grad, TILE)
        return (gx2.reshape(self.shape) if want_x else None), ggamma, gbeta

    def _backward_monotone(self, gy):
        """Backward when every scale k > 0: BatchNorm's output gradient is the pooled gradient (times ReLU's
        mask) at each window's maximum of x, so its sums are sums over the pooled quarter-size arrays (x there is
        the saved maximum); one pass over full-size tiles then writes ``k * (g - mean(g)) - xc * k * coef``
        everywhere and adds ``k * g`` at the winners."""
        n, h, w, c = self.shape
        x2, row, quarter = self.x2, self.row, self.row // 4
        gy3 = gy.reshape(-1, w // 2, c)
        pairs = gy3.shape[0]
        g3 = np.empty_like(self.y3)  # the pooled gradient through ReLU
        xc3 = np.empty_like(self.y3)  # x - mean at each window's winner
        # the sums read quarter-size arrays: tiles of 4 x TILE input values keep the calls as long as the others
        sums_tile = 4 * TILE
        mean_q = _template(self.mean, rows_per_tile(row * c, sums_tile) * quarter)

        def sums(lo: int, hi: int) -> Any:
            g = np.multiply(gy3[lo:hi], self.y3[lo:hi] > 0, out=g3[lo:hi]).reshape(-1, c)
            xc = np.subtract(self.xmax3[lo:hi].reshape(-1, c), mean_q[:(hi - lo) * quarter],
                             out=xc3[lo:hi].reshape(-1, c))
            xc *= g
            sum_g: Any = column_sums(np, g)
            sum_xc: Any = column_sums(np, xc)
            return np.stack([sum_g, sum_xc])

        gbeta, gxc = sum_in_order(for_tiles(np, pairs, row * c, sums, sums_tile))
        ggamma = gxc * self.inv
        if not self.needs_grad[0]:
            return None, ggamma, gbeta
        count = x2.shape[0]
        k = self.k_t[0]
        slope_t = _template(-k * self.inv * (ggamma / count), self.per * row)
        shift_t = _template(-k * (gbeta / count), self.per * row)
        gx2 = np.empty_like(x2)

        def grad(lo: int, hi: int) -> None:
            a, b = lo * row, hi * row
            out = np.subtract(x2[a:b], self.mean_t[:b - a], out=gx2[a:b])
            out *= slope_t[:b - a]
            out += shift_t[:b - a]
            x5 = x2[a:b].reshape(hi - lo, 2, quarter, 2, c)
            m = self.xmax3[lo:hi]
            hits = np.equal(x5, m[:, None, :, None, :])  # finite: a NaN or inf in x makes its scale NaN
            if np.count_nonzero(hits) != m.size:
                _first_hits(hits)  # ties: the first tap at the maximum wins, as in MaxPool2d
            kg = np.multiply(g3[lo:hi].reshape(-1, c), self.k_t[:(hi - lo) * quarter]).reshape(m.shape)
            # k * g at the winners, zero elsewhere, then one flat add (an add with where= measured 4x slower)
            out += np.multiply(kg[:, None, :, None, :], hits).reshape(out.shape)

        for_tiles(np, pairs, row * c, grad, TILE)
        return gx2.reshape(self.shape), ggamma, gbeta


def batch_norm_relu_max_pool(x: Any, weight: Any, bias: Any, running_mean: Any = None, running_var: Any = None,
                             momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``max_pool2d(relu(batch_norm(x, weight, bias, running_mean, running_var, training=True)), 2)`` in one
    op (NumPy, NHWC, even height and width: see :func:`applies`)."""
    return BatchNormReLUMaxPool(running_mean, running_var, momentum, eps)(amp.float_input(x), weight, bias)
