"""Normalisation: batch normalisation over the channel (last) axis, and L2 normalisation."""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.engine import amp
from leaflens.engine.backend import array_module
from leaflens.engine.ops import _kernels as gpu
from leaflens.engine.ops.arith import _promoted
from leaflens.engine.parallel import column_sums, for_tiles, per_tile, sum_in_order
from leaflens.engine.tensor import Function, Tensor


class BatchNorm(Function):
    """Normalise each channel (last axis) over every other axis.

    Training: batch statistics, and the running statistics are updated in place (momentum as in
    PyTorch: new = (1 - m) * old + m * batch, with the unbiased variance). Evaluation: running
    statistics, i.e. a per-channel affine map.
    """

    def __init__(self, running_mean: Any, running_var: Any, training: bool, momentum: float, eps: float):
        self.running_mean, self.running_var = running_mean, running_var
        self.training, self.momentum, self.eps = training, momentum, eps

    def forward(self, x, gamma, beta):
        c = x.shape[-1]
        if gamma.shape != (c,) or beta.shape != (c,):
            raise ValueError(f"batch_norm: input has {c} channels (last axis of shape {tuple(x.shape)}) but "
                             f"weight/bias have shapes {tuple(gamma.shape)}/{tuple(beta.shape)}")
        xp = array_module(x)
        x2 = x.reshape(-1, c)
        n = x2.shape[0]
        y = xp.empty_like(x2)
        if self.training:
            if n < 2:
                raise ValueError(f"batch_norm in training mode needs more than one value per channel, got "
                                 f"input shape {tuple(x.shape)}")
            mean, var = batch_statistics(xp, x2, y)  # y's tiles as scratch: written below
            mean_t = per_tile(xp, mean, n)
            inv = 1 / xp.sqrt(var + x.dtype.type(self.eps))
            k_t, beta_t = per_tile(xp, inv * gamma, n), per_tile(xp, beta, n)

            def scale(lo: int, hi: int) -> None:
                out = xp.subtract(x2[lo:hi], mean_t(lo, hi), out=y[lo:hi])
                out *= k_t(lo, hi)
                out += beta_t(lo, hi)

            for_tiles(xp, n, c, scale)
            update_running(self.running_mean, self.running_var, mean, var, n, self.momentum)
            if self.recording:
                # the input (which the graph holds anyway) and its statistics, not a normalised copy of it:
                # backward recomputes (x - mean) * inv tile by tile, in the cache
                self.x2, self.mean, self.inv, self.gamma = x2, mean, inv, gamma
        else:
            inv = 1 / xp.sqrt(self.running_var.astype(x.dtype) + x.dtype.type(self.eps))
            scale = gamma * inv
            scale_t, shift_t = per_tile(xp, scale, n), per_tile(xp, beta - self.running_mean.astype(x.dtype) * scale, n)

            def affine(lo: int, hi: int) -> None:
                xp.multiply(x2[lo:hi], scale_t(lo, hi), out=y[lo:hi])
                y[lo:hi] += shift_t(lo, hi)

            for_tiles(xp, n, c, affine)
            if self.recording:
                self.x2, self.inv, self.scale = x2, inv, scale
        return y.reshape(x.shape)

    def backward(self, gy):
        xp = array_module(gy)
        c = gy.shape[-1]
        g2 = gy.reshape(-1, c)
        n = g2.shape[0]
        want_x = self.needs_grad[0]
        gx = xp.empty_like(g2) if want_x else None
        if self.training:
            x2, inv = self.x2, self.inv
            mean_t, inv_t = per_tile(xp, self.mean, n), per_tile(xp, inv, n)

            def sums(lo: int, hi: int) -> Any:
                g = g2[lo:hi]
                # gx's tile as scratch for g * xhat: the gradient itself is written in a second pass
                gxh = xp.subtract(x2[lo:hi], mean_t(lo, hi), out=gx[lo:hi] if want_x else None)
                gxh *= inv_t(lo, hi)
                gxh *= g
                return xp.stack([column_sums(xp, g), column_sums(xp, gxh)])

            gbeta, ggamma = sum_in_order(for_tiles(xp, n, c, sums))
            if want_x:
                k_t, mean_g_t = per_tile(xp, self.gamma * inv, n), per_tile(xp, gbeta / n, n)
                coef_t = per_tile(xp, inv * (ggamma / n), n)

                def grad(lo: int, hi: int) -> None:
                    # gx = k * (g - mean(g) - xhat * mean(g * xhat)), xhat = (x - mean) * inv
                    out = xp.subtract(x2[lo:hi], mean_t(lo, hi), out=gx[lo:hi])
                    out *= coef_t(lo, hi)
                    xp.subtract(g2[lo:hi], out, out=out)
                    out -= mean_g_t(lo, hi)
                    out *= k_t(lo, hi)

                for_tiles(xp, n, c, grad)
                gx = gx.reshape(gy.shape)
            return gx, ggamma, gbeta
        rm_t, scale_t = per_tile(xp, self.running_mean.astype(g2.dtype), n), per_tile(xp, self.scale, n)

        def sums_eval(lo: int, hi: int) -> Any:
            # frozen statistics: gx = g * scale; the affine parameters' gradients are column sums of g and
            # of g * (x - mean), the latter times 1/std after the sum
            g = g2[lo:hi]
            tmp = xp.subtract(self.x2[lo:hi], rm_t(lo, hi))
            tmp *= g
            if want_x:
                xp.multiply(g, scale_t(lo, hi), out=gx[lo:hi])
            return xp.stack([column_sums(xp, g), column_sums(xp, tmp)])

        gbeta, gxc = sum_in_order(for_tiles(xp, n, c, sums_eval))
        return (gx.reshape(gy.shape) if want_x else None), gxc * self.inv, gbeta


def batch_statistics(xp: Any, x2: Any, scratch: Any = None) -> tuple[Any, Any]:
    """(mean, biased variance) of each column of the 2-D ``x2``, in two passes over cache-sized tiles (the
    centred second pass keeps float32 accurate where mean >> std). ``scratch`` (shaped like ``x2``), when
    given, holds each tile's centred values, else each tile gets a new array. Per-tile sums are added in
    tile order: the result does not depend on the thread count."""
    n, c = x2.shape
    mean = sum_in_order(for_tiles(xp, n, c, lambda lo, hi: column_sums(xp, x2[lo:hi]), STATS_TILE)) / n
    mean_t = per_tile(xp, mean, n, STATS_TILE)

    def centre(lo: int, hi: int) -> Any:
        xc = xp.subtract(x2[lo:hi], mean_t(lo, hi), out=None if scratch is None else scratch[lo:hi])
        xc *= xc
        return column_sums(xp, xc)

    return mean, sum_in_order(for_tiles(xp, n, c, centre, STATS_TILE)) / n


# Values per tile of the statistics' two passes: each tile is one or two calls, too short at 2^16 for the
# second thread to gain (Python's lock changes hands at every call); measured at the student's three
# BatchNorm inputs (batch 64, 2 threads, median of 7): 23.0 ms at 2^16, 16.9 at 2^17, 15.8 at 2^18, 33 at 2^19.
STATS_TILE = 1 << 18


def update_running(running_mean: Any, running_var: Any, mean: Any, var: Any, n: int, momentum: float) -> None:
    """PyTorch's running-statistics update, in place: new = (1 - m) * old + m * batch (unbiased variance)."""
    if running_mean is None:
        return
    running_mean *= 1 - momentum
    running_mean += momentum * mean.astype(running_mean.dtype)
    running_var *= 1 - momentum
    running_var += (momentum * n / (n - 1)) * var.astype(running_var.dtype)


class L2Normalize(Function):
    """y = x / max(||x||, eps) over one axis (the feature axis).

    On CuPy, over the last axis, forward and backward run the ``l2norm`` kernels
    (engine/ops/_kernels.py), which keep the float32 row norms instead of ``denom``/``clamped``.
    """

    norm: Any = None  # the kernel forward's row norms; None on the xp path

    def __init__(self, axis: int, eps: float):
        self.axis, self.eps = axis, eps

    def forward(self, x):
        xp = array_module(x)
        fused = gpu.l2norm_forward(xp, x, self.axis, self.eps)
        if fused is not None:
            self.y, self.norm = fused
            return self.y
        # float16 works in float32, as the kernel does: eps = 1e-12 is 0 in float16, and a zero row gave 0 / 0
        wide = x.astype(np.float32) if x.dtype == np.float16 else x
        norm = xp.sqrt((wide * wide).sum(axis=self.axis, keepdims=True))
        self.denom = xp.maximum(norm, wide.dtype.type(self.eps))
        self.clamped = norm < self.eps
        self.y = wide / self.denom
        return self.y.astype(x.dtype, copy=False)

    def backward(self, gy):
        if self.norm is not None:
            return gpu.l2norm_backward(array_module(gy), self.y, gy, self.norm, self.eps)
        y = self.y
        proj = (gy * y).sum(axis=self.axis, keepdims=True)
        # where the norm was clamped to eps the map is linear (x / eps): no projection term
        proj = proj * ~self.clamped
        return ((gy - y * proj) / self.denom).astype(gy.dtype, copy=False)


def batch_norm(x: Any, weight: Any, bias: Any, running_mean: Any = None, running_var: Any = None,
               training: bool = True, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """Batch normalisation over the last axis of ``x`` (NHWC or (N, C))."""
    if not training and (running_mean is None or running_var is None):
        raise ValueError("batch_norm in evaluation mode needs running_mean and running_var")
    x, weight = _promoted(x, weight)  # integer inputs take the weight's float dtype, as in add and mul
    return BatchNorm(running_mean, running_var, training, momentum, eps)(amp.float_input(x), weight, bias)


def l2_normalize(x: Any, axis: int = -1, eps: float = 1e-12) -> Tensor:
    return L2Normalize(axis, eps)(amp.float_input(x))
