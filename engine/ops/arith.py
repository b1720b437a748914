"""Elementwise arithmetic with broadcasting-aware gradients."""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.engine.backend import array_module
from leaflens.engine.tensor import Function, Tensor, as_tensor, sum_to


def _check_broadcast(op: str, a: Any, b: Any) -> None:
    try:
        array_module(a).broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ValueError(f"{op}: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be broadcast together") from None


class Add(Function):
    def forward(self, a, b):
        _check_broadcast("add", a, b)
        self.shapes = a.shape, b.shape
        return a + b

    def backward(self, gy):
        sa, sb = self.shapes
        return sum_to(gy, sa), sum_to(gy, sb)


class Sub(Function):
    def forward(self, a, b):
        _check_broadcast("sub", a, b)
        self.shapes = a.shape, b.shape
        return a - b

    def backward(self, gy):
        sa, sb = self.shapes
        return sum_to(gy, sa), (sum_to(-gy, sb) if self.needs_grad[1] else None)


class Mul(Function):
    def forward(self, a, b):
        _check_broadcast("mul", a, b)
        self.a, self.b = a, b
        return a * b

    def backward(self, gy):
        ga = sum_to(gy * self.b, self.a.shape) if self.needs_grad[0] else None
        gb = sum_to(gy * self.a, self.b.shape) if self.needs_grad[1] else None
        return ga, gb


class Div(Function):
    def forward(self, a, b):
        _check_broadcast("div", a, b)
        self.a, self.b = a, b
        return a / b

    def backward(self, gy):
        a, b = self.a, self.b
        ga = sum_to(gy / b, a.shape) if self.needs_grad[0] else None
        gb = sum_to(-gy * a / (b * b), b.shape) if self.needs_grad[1] else None
        return ga, gb


class Neg(Function):
    def forward(self, x):
        return -x

    def backward(self, gy):
        return -gy


class Pow(Function):
    """x ** p for a constant exponent p."""

    def __init__(self, p: float):
        self.p = p

    def forward(self, x):
        self.x = x
        return x ** self.p

    def backward(self, gy):
        if self.p == 0:  # x ** 0 is constant: 0 * x ** -1 would be NaN at x = 0
            return gy * gy.dtype.type(0)
        return gy * self.p * self.x ** (self.p - 1)


class PowTensor(Function):
    """a ** b with both sides differentiable (a > 0 where b's gradient is wanted)."""

    def forward(self, a, b):
        _check_broadcast("pow", a, b)
        self.a, self.b = a, b
        self.y = a ** b
        return self.y

    def backward(self, gy):
        xp = array_module(gy)
        a, b, y = self.a, self.b, self.y
        ga = sum_to(gy * b * a ** (b - 1), a.shape) if self.needs_grad[0] else None
        # d(a**b)/db = a**b log a, taken as 0 where a == 0 (a**b is 0 there for b > 0), as PyTorch does
        gb = sum_to(gy * y * xp.log(xp.where(a == 0, 1, a)), b.shape) if self.needs_grad[1] else None
        return ga, gb


class Exp(Function):
    def forward(self, x):
        self.y = array_module(x).exp(x)
        return self.y

    def backward(self, gy):
        return gy * self.y


class Log(Function):
    def forward(self, x):
        self.x = x
        return array_module(x).log(x)

    def backward(self, gy):
        return gy / self.x


class Sqrt(Function):
    def forward(self, x):
        self.y = array_module(x).sqrt(x)
        return self.y

    def backward(self, gy):
        return gy / (2 * self.y)


class Abs(Function):
    def forward(self, x):
        self.x = x
        return array_module(x).abs(x)

    def backward(self, gy):
        return gy * array_module(gy).sign(self.x)


class Clip(Function):
    def __init__(self, lo: float | None, hi: float | None):
        self.lo, self.hi = lo, hi

    def forward(self, x):
        self.x = x
        return array_module(x).clip(x, self.lo, self.hi)

    def backward(self, gy):
        mask = True
        if self.lo is not None:
            mask = self.x >= self.lo
        if self.hi is not None:
            mask = mask & (self.x <= self.hi)
        return gy * mask


class Maximum(Function):
    """Elementwise max of two tensors; on ties the gradient goes to the first."""

    def forward(self, a, b):
        _check_broadcast("maximum", a, b)
        self.a_wins = a >= b
        self.shapes = a.shape, b.shape
        return array_module(a).maximum(a, b)

    def backward(self, gy):
        sa, sb = self.shapes
        return sum_to(gy * self.a_wins, sa), sum_to(gy * ~self.a_wins, sb)


class Minimum(Function):
    def forward(self, a, b):
        _check_broadcast("minimum", a, b)
        self.a_wins = a <= b
        self.shapes = a.shape, b.shape
        return array_module(a).minimum(a, b)

    def backward(self, gy):
        sa, sb = self.shapes
        return sum_to(gy * self.a_wins, sa), sum_to(gy * ~self.a_wins, sb)


class Cast(Function):
    """Change the dtype (float16 <-> float32 for mixed precision); the gradient is cast back."""

    def __init__(self, dtype: Any):
        self.dtype = dtype

    def forward(self, x):
        self.src = x.dtype
        return x.astype(self.dtype, copy=False)

    def backward(self, gy):
        return gy.astype(self.src, copy=False)


def _promoted(a: Any, b: Any) -> tuple[Tensor, Tensor]:
    """The two operands of an elementwise op, an integer or boolean one cast to the other's float dtype
    (as PyTorch does): NumPy would make int64 * float32 float64, which the next float32 op refuses."""
    like = a if isinstance(a, Tensor) else b if isinstance(b, Tensor) else None
    ta, tb = as_tensor(a, like), as_tensor(b, like)
    if ta.dtype.kind == "f" and tb.dtype.kind in "biu":
        tb = Tensor(tb.data.astype(ta.dtype))
    elif tb.dtype.kind == "f" and ta.dtype.kind in "biu":
        ta = Tensor(ta.data.astype(tb.dtype))
    return ta, tb


def add(a: Any, b: Any) -> Tensor:
    return Add()(*_promoted(a, b))


def sub(a: Any, b: Any) -> Tensor:
    return Sub()(*_promoted(a, b))


def mul(a: Any, b: Any) -> Tensor:
    return Mul()(*_promoted(a, b))


def div(a: Any, b: Any) -> Tensor:
    ta, tb = _promoted(a, b)
    if ta.dtype.kind in "biu" and tb.dtype.kind in "biu":  # true division of integers: float32, not NumPy's float64
        ta, tb = Tensor(ta.data.astype(np.float32)), Tensor(tb.data.astype(np.float32))
    return Div()(ta, tb)


def neg(x: Any) -> Tensor:
    return Neg()(x)


def pow(x: Any, p: Any) -> Tensor:  # noqa: A001
    if isinstance(p, (np.integer, np.floating)):
        p = p.item()  # a NumPy float64 exponent would make float32 values float64
    if isinstance(p, (int, float)) and isinstance(x, Tensor):
        if isinstance(p, float) and x.dtype.kind in "biu":  # a root of integers: float32, as x * 0.5 is
            x = Tensor(x.data.astype(np.float32))
        return Pow(p)(x)
    return PowTensor()(*_promoted(x, p))


def exp(x: Any) -> Tensor:
    return Exp()(x)


def log(x: Any) -> Tensor:
    return Log()(x)


def sqrt(x: Any) -> Tensor:
    return Sqrt()(x)


def abs(x: Any) -> Tensor:  # noqa: A001
    return Abs()(x)


def clip(x: Any, lo: float | None, hi: float | None) -> Tensor:
    return Clip(lo, hi)(x)


def maximum(a: Any, b: Any) -> Tensor:
    return Maximum()(*_promoted(a, b))


def minimum(a: Any, b: Any) -> Tensor:
    return Minimum()(*_promoted(a, b))


def cast(x: Any, dtype: Any) -> Tensor:
    return Cast(dtype)(x)
