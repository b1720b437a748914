"""Reductions over axes: sum, mean, var, max, min."""

from __future__ import annotations

from typing import Any

from leaflens.engine.backend import array_module, wide_sum
from leaflens.engine.tensor import Function, Tensor


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    out = []
    for a in axis:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a tensor with {ndim} dimensions")
        out.append(a % ndim)
    return tuple(sorted(out))


def _expand(g: Any, in_shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> Any:
    """Reshape a reduced gradient so it broadcasts against the input again."""
    if not keepdims:
        shape = [1 if i in axes else s for i, s in enumerate(in_shape)]
        g = g.reshape(shape)
    return g


class Sum(Function):
    def __init__(self, axis: Any, keepdims: bool):
        self.axis, self.keepdims = axis, keepdims

    def forward(self, x):
        self.axes = _axes(self.axis, x.ndim)
        self.in_shape = x.shape
        return wide_sum(x, axis=self.axes, keepdims=self.keepdims)

    def backward(self, gy):
        g = _expand(gy, self.in_shape, self.axes, self.keepdims)
        return array_module(g).broadcast_to(g, self.in_shape)


class Mean(Function):
    def __init__(self, axis: Any, keepdims: bool):
        self.axis, self.keepdims = axis, keepdims

    def forward(self, x):
        self.axes = _axes(self.axis, x.ndim)
        self.in_shape = x.shape
        self.count = 1
        for a in self.axes:
            self.count *= x.shape[a]
        return x.mean(axis=self.axes, keepdims=self.keepdims)

    def backward(self, gy):
        g = _expand(gy, self.in_shape, self.axes, self.keepdims) / self.count
        return array_module(g).broadcast_to(g, self.in_shape)


class Var(Function):
    def __init__(self, axis: Any, keepdims: bool, ddof: int):
        self.axis, self.keepdims, self.ddof = axis, keepdims, ddof

    def forward(self, x):
        self.axes = _axes(self.axis, x.ndim)
        self.in_shape = x.shape
        n = 1
        for a in self.axes:
            n *= x.shape[a]
        if n - self.ddof <= 0:
            raise ValueError(f"var over {n} values with ddof={self.ddof} is undefined")
        self.denom = n - self.ddof
        self.centred = x - x.mean(axis=self.axes, keepdims=True)
        return wide_sum(self.centred * self.centred, axis=self.axes, keepdims=self.keepdims) / self.denom

    def backward(self, gy):
        g = _expand(gy, self.in_shape, self.axes, self.keepdims)
        return g * (2.0 / self.denom) * self.centred


class _Extreme(Function):
    """max/min over axes; ties share the gradient equally."""

    pick = "max"

    def __init__(self, axis: Any, keepdims: bool):
        self.axis, self.keepdims = axis, keepdims

    def forward(self, x):
        self.axes = _axes(self.axis, x.ndim)
        if x.size == 0:
            raise ValueError(f"{self.pick}() of an empty tensor")
        y = getattr(x, self.pick)(axis=self.axes, keepdims=True)
        self.x, self.y_keep = x, y
        return y if self.keepdims else y.reshape([s for i, s in enumerate(x.shape) if i not in self.axes])

    def backward(self, gy):
        g = _expand(gy, self.x.shape, self.axes, self.keepdims)
        mask = self.x == self.y_keep
        count = mask.sum(axis=self.axes, keepdims=True)
        return g * mask / count.astype(g.dtype)


class Max(_Extreme):
    pick = "max"


class Min(_Extreme):
    pick = "min"


def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return Sum(axis, keepdims)(x)


def mean(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    return Mean(axis, keepdims)(x)


def var(x: Any, axis: Any = None, keepdims: bool = False, ddof: int = 0) -> Tensor:
    return Var(axis, keepdims, ddof)(x)


def max(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return Max(axis, keepdims)(x)


def min(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    return Min(axis, keepdims)(x)
