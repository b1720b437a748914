"""Matrix products: matmul (batched, broadcasting) and the fused affine map of a Linear layer."""

from __future__ import annotations

from typing import Any

from leaflens.engine import amp
from leaflens.engine.tensor import Function, Tensor, sum_to


def _swap(a: Any) -> Any:
    return a.swapaxes(-1, -2)


class MatMul(Function):
    def forward(self, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs tensors with at least 2 dimensions, got shapes {tuple(a.shape)} "
                             f"and {tuple(b.shape)} (reshape vectors to (1, n) or (n, 1))")
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(f"matmul: inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)} "
                             f"({a.shape[-1]} != {b.shape[-2]})")
        self.a, self.b = a, b
        return a @ b

    def backward(self, gy):
        a, b = self.a, self.b
        ga = sum_to(gy @ _swap(b), a.shape) if self.needs_grad[0] else None
        gb = sum_to(_swap(a) @ gy, b.shape) if self.needs_grad[1] else None
        return ga, gb


class Linear(Function):
    """y = x @ W.T + b with W of shape (out, in), as in ONNX Gemm(transB=1)."""

    def forward(self, x, w, b=None):
        if x.ndim != 2:
            raise ValueError(f"linear expects a (batch, features) input, got shape {tuple(x.shape)}")
        if x.shape[1] != w.shape[1]:
            raise ValueError(f"linear: input has {x.shape[1]} features but the weight expects {w.shape[1]} "
                             f"(weight shape {tuple(w.shape)})")
        self.x, self.w = x, w
        y = x @ w.T
        if b is not None:
            y += b
        return y

    def backward(self, gy):
        gx = gy @ self.w if self.needs_grad[0] else None
        gw = gy.T @ self.x if self.needs_grad[1] else None
        if len(self.needs_grad) > 2:
            return gx, gw, (gy.sum(axis=0) if self.needs_grad[2] else None)
        return gx, gw


def matmul(a: Any, b: Any) -> Tensor:
    return MatMul()(*amp.half_inputs(a, b))  # float16 under leaflens.engine.amp.autocast()


def linear(x: Any, weight: Any, bias: Any = None) -> Tensor:
    x, weight, bias = amp.half_inputs(x, weight, bias)  # float16 under leaflens.engine.amp.autocast()
    return Linear()(x, weight) if bias is None else Linear()(x, weight, bias)
