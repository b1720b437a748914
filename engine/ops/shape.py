"""Shape ops: reshape, transpose, flatten, indexing, concatenate, stack."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from leaflens.engine.backend import array_module, scatter_add
from leaflens.engine.tensor import Function, Tensor


class Reshape(Function):
    def __init__(self, shape: tuple[int, ...]):
        self.shape = tuple(shape)

    def forward(self, x):
        self.in_shape = x.shape
        try:
            return x.reshape(self.shape)
        except ValueError:
            raise ValueError(f"cannot reshape a tensor of shape {tuple(x.shape)} ({x.size} values) "
                             f"into {self.shape}") from None

    def backward(self, gy):
        return gy.reshape(self.in_shape)


class Transpose(Function):
    def __init__(self, axes: Sequence[int] | None):
        self.axes = None if axes is None else tuple(axes)

    def forward(self, x):
        if self.axes is not None and sorted(a % x.ndim for a in self.axes) != list(range(x.ndim)):
            raise ValueError(f"transpose axes {self.axes} are not a permutation of {x.ndim} dimensions")
        return x.transpose(self.axes)

    def backward(self, gy):
        if self.axes is None:
            return gy.transpose()
        return gy.transpose(np.argsort([a % gy.ndim for a in self.axes]))


def _is_basic(key: Any) -> bool:
    """Basic indexing (ints, slices, None, Ellipsis) never repeats an element."""
    items = key if isinstance(key, tuple) else (key,)
    return all(isinstance(k, (int, slice, type(None), type(Ellipsis))) for k in items)


class GetItem(Function):
    def __init__(self, key: Any):
        self.key = key

    def forward(self, x):
        self.in_shape, self.dtype = x.shape, x.dtype
        return x[self.key]

    def backward(self, gy):
        xp = array_module(gy)
        gx = xp.zeros(self.in_shape, dtype=gy.dtype)
        if _is_basic(self.key):
            gx[self.key] += gy
        else:
            scatter_add(xp, gx, self.key, gy)
        return gx


class Concatenate(Function):
    def __init__(self, axis: int):
        self.axis = axis

    def forward(self, *xs):
        self.sizes = [x.shape[self.axis] for x in xs]
        try:
            return array_module(xs[0]).concatenate(xs, axis=self.axis)
        except ValueError as exc:
            shapes = [tuple(x.shape) for x in xs]
            raise ValueError(f"concatenate along axis {self.axis}: incompatible shapes {shapes}") from exc

    def backward(self, gy):
        bounds = np.cumsum(self.sizes)[:-1]
        return tuple(array_module(gy).split(gy, bounds, axis=self.axis))


class Stack(Function):
    def __init__(self, axis: int):
        self.axis = axis

    def forward(self, *xs):
        shapes = {tuple(x.shape) for x in xs}
        if len(shapes) > 1:
            raise ValueError(f"stack needs tensors of one shape, got {sorted(shapes)}")
        return array_module(xs[0]).stack(xs, axis=self.axis)

    def backward(self, gy):
        xp = array_module(gy)
        return tuple(xp.take(gy, i, axis=self.axis) for i in range(gy.shape[self.axis]))


def reshape(x: Any, shape: Sequence[int]) -> Tensor:
    return Reshape(tuple(shape))(x)


def transpose(x: Any, axes: Sequence[int] | None = None) -> Tensor:
    return Transpose(axes)(x)


def flatten(x: Any, start_dim: int = 1) -> Tensor:
    """Merge every dimension from ``start_dim`` on into one."""
    t = x if isinstance(x, Tensor) else Tensor(x)
    lead = t.shape[:start_dim]
    return Reshape((*lead, int(np.prod(t.shape[start_dim:], dtype=np.int64))))(t)  # not -1: an empty batch has no -1


def getitem(x: Any, key: Any) -> Tensor:
    if isinstance(key, Tensor):
        key = key.data
    elif isinstance(key, tuple):
        key = tuple(k.data if isinstance(k, Tensor) else k for k in key)
    return GetItem(key)(x)


def concatenate(xs: Sequence[Any], axis: int = 0) -> Tensor:
    if len(xs) == 0:
        raise ValueError("concatenate needs at least one tensor")
    return Concatenate(axis)(*xs)


def stack(xs: Sequence[Any], axis: int = 0) -> Tensor:
    if len(xs) == 0:
        raise ValueError("stack needs at least one tensor")
    return Stack(axis)(*xs)
