"""Matrix products: matmul (batched, broadcasting) and the fused affine map of a Linear layer."""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.engine import amp
from leaflens.engine.backend import wide_sum
from leaflens.engine.ops.arith import _promoted
from leaflens.engine.parallel import for_chunks, sum_in_order
from leaflens.engine.tensor import Function, Tensor, sum_to


def _swap(a: Any) -> Any:
    return a.swapaxes(-1, -2)


def matmul_tn(a: Any, b: Any) -> Any:
    """``a.T @ b`` for 2-D ``a`` (K, M) and ``b`` (K, N): the weight-gradient product, long in K.

    OpenBLAS computes ``a.T @ b`` (a transposed-times-normal product with a long inner dimension)
    far below its speed when the result has fewer rows than columns: measured here with K = 200704,
    (27, 32) took 2.0 s and the same product as ``(b.T @ a).T``, whose result (32, 27) has more
    rows, 52 ms; with M > N the other way round is the slow one (96 x 24: 29 ms against 2.5 s). So
    on NumPy the product is always taken with the longer side as rows (a transposed view of the
    result comes back; callers reshape or copy it anyway).
    """
    if isinstance(a, np.ndarray) and a.shape[0] >= 2 * TN_ROWS and a.shape[1] * b.shape[1] <= TN_SPLIT_MAX:
        return _split_tn(a, b)
    if isinstance(a, np.ndarray) and a.shape[1] < b.shape[1]:
        return (b.T @ a).T
    return a.T @ b


# matmul_tn splits the long inner dimension into TN_ROWS-row pieces, shared among the engine's threads and
# summed in order, when the result is small (at most TN_SPLIT_MAX values): OpenBLAS divides a product among
# its threads along the result's rows and columns, so a (27, 32) result over 262144 rows (the student's first
# layer) ran on one core, 17 ms; in pieces on both, 10 ms (measured here).
TN_ROWS = 16384
TN_SPLIT_MAX = 1 << 16


def _split_tn(a: Any, b: Any) -> Any:
    """``a.T @ b`` as a sum of per-piece products in piece order (the same result whatever the thread count)."""
    swap = a.shape[1] < b.shape[1]

    def piece(lo: int, hi: int) -> Any:
        return b[lo:hi].T @ a[lo:hi] if swap else a[lo:hi].T @ b[lo:hi]

    out = sum_in_order(for_chunks(a.shape[0], TN_ROWS, a.size + b.size, piece))
    return out.T if swap else out


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
        gw = matmul_tn(gy, self.x) if self.needs_grad[1] else None
        if len(self.needs_grad) > 2:
            return gx, gw, (wide_sum(gy, axis=0) if self.needs_grad[2] else None)
        return gx, gw


def matmul(a: Any, b: Any) -> Tensor:
    return MatMul()(*amp.half_inputs(*_promoted(a, b)))  # float16 under leaflens.engine.amp.autocast()


def linear(x: Any, weight: Any, bias: Any = None) -> Tensor:
    x, weight = _promoted(x, weight)  # integer inputs take the weight's float dtype, as in add and mul
    x, weight, bias = amp.half_inputs(x, weight, bias)  # float16 under leaflens.engine.amp.autocast()
    return Linear()(x, weight) if bias is None else Linear()(x, weight, bias)
