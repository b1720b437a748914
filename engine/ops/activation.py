"""Activations, softmax and dropout.

The ReLU family saves its output, not its input: the gradient mask can be read from y, and the
input array can then be freed (the GPU kernels do the same from the saved output). On CuPy their
backward runs the ``activation_grad`` kernel (engine/ops/_kernels.py); on NumPy the code below.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from leaflens.engine import amp
from leaflens.engine import random as erandom
from leaflens.engine.backend import array_module
from leaflens.engine.ops import _kernels as gpu
from leaflens.engine.parallel import for_tiles
from leaflens.engine.tensor import Function, Tensor


def _rows(a: Any) -> tuple[int, int]:
    """(rows, values per row) of ``a`` seen as a 2-D array over its last axis, for :func:`for_tiles`."""
    if a.ndim == 0:
        return 1, 1
    return a.size // max(a.shape[-1], 1), a.shape[-1]


class ReLU(Function):
    def forward(self, x):
        xp = array_module(x)
        rows, cols = _rows(x)
        x2 = x.reshape(rows, cols)
        y = xp.empty_like(x2)
        for_tiles(xp, rows, cols, lambda lo, hi: xp.maximum(x2[lo:hi], 0, out=y[lo:hi]))
        self.y = y.reshape(x.shape)
        return self.y

    def backward(self, gy):
        xp = array_module(gy)
        fused = gpu.activation_grad(xp, "relu", self.y, gy)
        if fused is not None:
            return fused
        rows, cols = _rows(gy)
        g2, y2 = gy.reshape(rows, cols), self.y.reshape(rows, cols)
        g = xp.empty_like(g2)

        def grad(lo: int, hi: int) -> None:
            mask = xp.greater(y2[lo:hi], 0)
            xp.multiply(g2[lo:hi], mask, out=g[lo:hi])

        for_tiles(xp, rows, cols, grad)
        return g.reshape(gy.shape)


class LeakyReLU(Function):
    def __init__(self, slope: float):
        self.slope = slope

    def forward(self, x):
        xp = array_module(x)
        self.y = xp.where(x > 0, x, x * x.dtype.type(self.slope))
        return self.y

    def backward(self, gy):
        xp = array_module(gy)
        fused = gpu.activation_grad(xp, "leaky_relu", self.y, gy, self.slope)
        if fused is not None:
            return fused
        return gy * xp.where(self.y > 0, gy.dtype.type(1), gy.dtype.type(self.slope))


class ReLU6(Function):
    """min(max(x, 0), 6). The backward's mask and product go tile by tile over the rows, in threads on
    NumPy (engine/parallel.py); ``clip`` in one call for the forward (measured 10 ms for 19 M values, against
    30 ms for ``maximum`` then ``minimum``, and no faster in tiles)."""

    def forward(self, x):
        self.y = array_module(x).clip(x, 0, 6)
        return self.y

    def backward(self, gy):
        xp = array_module(gy)
        fused = gpu.activation_grad(xp, "relu6", self.y, gy)
        if fused is not None:
            return fused
        rows, cols = _rows(gy)
        g2, y2 = gy.reshape(rows, cols), self.y.reshape(rows, cols)
        g = xp.empty_like(g2)

        def grad(lo: int, hi: int) -> None:
            y = y2[lo:hi]
            inside = xp.greater(y, 0)
            inside &= xp.less(y, 6)
            xp.multiply(g2[lo:hi], inside, out=g[lo:hi])

        for_tiles(xp, rows, cols, grad)
        return g.reshape(gy.shape)


class Sigmoid(Function):
    def forward(self, x):
        xp = array_module(x)
        # exp(-|x|) never overflows, and e / (1 + e) keeps sigmoid's tiny values for very negative x
        # (1 - 1 / (1 + e), or the tanh form, rounds them to 0 below about -17 in float32)
        e = xp.exp(-xp.abs(x))
        self.y = xp.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)
        return self.y

    def backward(self, gy):
        return gy * self.y * (1 - self.y)


class Tanh(Function):
    def forward(self, x):
        self.y = array_module(x).tanh(x)
        return self.y

    def backward(self, gy):
        return gy * (1 - self.y * self.y)


def _log_softmax(x: Any, axis: int) -> Any:
    xp = array_module(x)
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))


class Softmax(Function):
    def __init__(self, axis: int):
        self.axis = axis

    def forward(self, x):
        xp = array_module(x)
        e = xp.exp(x - x.max(axis=self.axis, keepdims=True))
        self.y = e / e.sum(axis=self.axis, keepdims=True)
        return self.y

    def backward(self, gy):
        y = self.y
        return y * (gy - (gy * y).sum(axis=self.axis, keepdims=True))


class LogSoftmax(Function):
    def __init__(self, axis: int):
        self.axis = axis

    def forward(self, x):
        self.y = _log_softmax(x, self.axis)
        return self.y

    def backward(self, gy):
        xp = array_module(gy)
        return gy - xp.exp(self.y) * gy.sum(axis=self.axis, keepdims=True)


class Dropout(Function):
    def __init__(self, p: float, rng: np.random.Generator | None):
        self.p = p
        self.rng = rng

    def forward(self, x):
        xp = array_module(x)
        keep = 1.0 - self.p
        draw = _uniform(xp, erandom.generator(self.rng), x.shape, x.dtype)
        self.mask = (draw < keep).astype(x.dtype) / x.dtype.type(keep)
        return x * self.mask

    def backward(self, gy):
        return gy * self.mask


_device_rng = threading.local()  # .states: CuPy device id -> cupy.random.RandomState, reseeded per draw


def _uniform(xp: Any, gen: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """Uniform [0, 1) numbers of ``shape`` for a dropout mask, in float32 (float64 for float64 ``x``).

    NumPy's Generator cannot draw float16, so float16 masks are drawn in float32 and cast by the
    caller. On CuPy the numbers are drawn on the device (no host-side draw, no upload) by a Philox
    generator seeded from ``gen``: the mask still depends only on the caller's generator (checkpoints
    and resumes stay exact), at the cost of one host draw per mask.
    """
    draw_dtype = np.float64 if dtype == np.float64 or dtype.kind != "f" else np.float32
    if xp is np:
        return gen.random(shape, dtype=draw_dtype)
    states = getattr(_device_rng, "states", None)
    if states is None:
        states = _device_rng.states = {}
    device = xp.cuda.Device().id
    rs = states.get(device)
    seed = int(gen.integers(0, 2**63 - 1))
    if rs is None:
        from cupy.cuda import curand  # noqa: PLC0415  (only on the CuPy path)

        rs = states[device] = xp.random.RandomState(seed, method=curand.CURAND_RNG_PSEUDO_PHILOX4_32_10)
    else:
        rs.seed(seed)
    return rs.random_sample(shape, dtype=draw_dtype)


def relu(x: Any) -> Tensor:
    return ReLU()(x)


def leaky_relu(x: Any, slope: float = 0.01) -> Tensor:
    """max(x, 0) + slope * min(x, 0) for a slope in [0, 1): the backward reads its mask from the output's
    sign (as the GPU kernel does), which a negative slope would flip."""
    if not 0 <= slope < 1:
        raise ValueError(f"leaky_relu: slope must be in [0, 1), got {slope}")
    return LeakyReLU(slope)(x)


def relu6(x: Any) -> Tensor:
    return ReLU6()(x)


def sigmoid(x: Any) -> Tensor:
    return Sigmoid()(x)


def tanh(x: Any) -> Tensor:
    return Tanh()(x)


def softmax(x: Any, axis: int = -1) -> Tensor:
    return Softmax(axis)(amp.float_input(x))


def log_softmax(x: Any, axis: int = -1) -> Tensor:
    return LogSoftmax(axis)(amp.float_input(x))


def dropout(x: Any, p: float = 0.5, training: bool = True, rng: np.random.Generator | None = None) -> Tensor:
    """Zero each value with probability p and scale the rest by 1/(1-p); identity when not training.

    The mask is drawn from ``rng`` (on the device for CuPy arrays, by a generator seeded from ``rng``);
    ``None`` is the interactive fallback stream of :mod:`leaflens.engine.random`.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    t = x if isinstance(x, Tensor) else Tensor(x)
    if not training or p == 0.0:
        return t
    return Dropout(p, rng)(t)
