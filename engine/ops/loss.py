"""Losses: cross-entropy fused with log-softmax, and mean squared error."""

from __future__ import annotations

from typing import Any

from leaflens.engine import amp
from leaflens.engine.backend import array_module
from leaflens.engine.deferred import require
from leaflens.engine.ops import _kernels as gpu
from leaflens.engine.ops.activation import _log_softmax
from leaflens.engine.tensor import Function, Tensor


class CrossEntropy(Function):
    """Mean over rows of -sum(q * log_softmax(logits)).

    ``q`` is the one-hot target (optionally smoothed: (1 - eps) * onehot + eps / C) for integer
    class targets, or a given probability matrix for soft targets (knowledge distillation). Rows
    whose integer target equals ``ignore_index`` contribute nothing and are left out of the mean.
    On CuPy, reduction 'mean'/'sum' uses the fused ``softmax_xent`` kernel (see engine/ops/_kernels.py)
    for integer targets (with smoothing and ``ignore_index``) and soft targets; reduction 'none' and
    anything the kernel does not cover run the xp code below, which defines the maths.
    """

    fused: gpu.SoftmaxXentSaved | None = None  # set when the forward ran the fused kernel

    def __init__(self, target: Any, label_smoothing: float, ignore_index: int | None, reduction: str):
        self.target, self.smoothing, self.ignore_index = target, label_smoothing, ignore_index
        self.reduction = reduction

    def forward(self, logits):
        xp = array_module(logits)
        if logits.ndim != 2:
            raise ValueError(f"cross_entropy expects (batch, classes) logits, got shape {tuple(logits.shape)}")
        fused = gpu.softmax_xent_forward(xp, logits, self.target, self.smoothing, self.ignore_index, self.reduction)
        if fused is not None:
            loss, self.fused = fused
            return loss
        n, c = logits.shape
        t = self.target
        logp = _log_softmax(logits, axis=1)
        if t.dtype.kind in "iu":
            if t.shape != (n,):
                raise ValueError(f"cross_entropy: {n} rows of logits but targets of shape {tuple(t.shape)}")
            valid = xp.ones(n, dtype=bool) if self.ignore_index is None else t != self.ignore_index
            tv = xp.where(valid, t, 0)
            bad = (tv < 0) | (tv >= c)
            # on a GPU inside a training step this flag is read with the step's other checks (engine/deferred.py)
            require(~bad.any(), lambda: f"cross_entropy: target class {int(tv[bad][0])} is outside [0, {c})")
            q = xp.zeros_like(logp)
            q[xp.arange(n), xp.clip(tv, 0, c - 1)] = 1  # clip: a deferred check has not raised yet
            if self.smoothing:
                q = q * logits.dtype.type(1 - self.smoothing) + logits.dtype.type(self.smoothing / c)
            q *= valid[:, None]
            count = xp.maximum(valid.sum(), 1).astype(logits.dtype)  # stays on the device
        else:
            if t.shape != logits.shape:
                raise ValueError(f"cross_entropy: soft targets of shape {tuple(t.shape)} for logits of shape "
                                 f"{tuple(logits.shape)}")
            q = t.astype(logits.dtype, copy=False)
            count = logits.dtype.type(max(n, 1))  # an empty batch: 0, as for class indices
        # a class with no target mass adds nothing, even at a logit of -inf (masked out): 0 * -inf would be NaN
        per_row = -(q * xp.where(q != 0, logp, 0)).sum(axis=1)
        self.q, self.logp, self.count = q, logp, count
        if self.reduction == "none":
            return per_row
        total = per_row.sum()
        return total / count if self.reduction == "mean" else total

    def backward(self, gy):
        xp = array_module(gy)
        if self.fused is not None:
            return gpu.softmax_xent_backward(xp, self.fused, gy)
        p = xp.exp(self.logp)
        # sum(q) per row is 1 (or 0 for ignored rows): d/dlogits = p * sum(q) - q
        g = p * self.q.sum(axis=1, keepdims=True) - self.q
        if self.reduction == "none":
            return g * gy[:, None]
        if self.reduction == "mean":
            return g * (gy / self.count)
        return g * gy


def cross_entropy(logits: Any, target: Any, label_smoothing: float = 0.0, ignore_index: int | None = None,
                  reduction: str = "mean") -> Tensor:
    """Softmax cross-entropy of (N, C) logits against class indices (N,) or probabilities (N, C);
    ``label_smoothing`` eps mixes either target with the uniform one: (1 - eps) * q + eps / C."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    t = target.data if isinstance(target, Tensor) else target
    if not hasattr(t, "dtype"):
        t = array_module(logits.data if isinstance(logits, Tensor) else logits).asarray(t)
    if label_smoothing and t.dtype.kind not in "iu" and t.ndim == 2:  # soft targets are smoothed the same way
        c = t.shape[1]
        t = t * t.dtype.type(1 - label_smoothing) + t.dtype.type(label_smoothing / c)
        label_smoothing = 0.0
    return CrossEntropy(t, label_smoothing, ignore_index, reduction)(amp.float_input(logits))


def mse_loss(a: Any, b: Any, reduction: str = "mean") -> Tensor:
    """Squared error: 'mean' over every element, 'sum', or 'none' (elementwise)."""
    a, b = amp.float_input(a), amp.float_input(b)  # float32 under leaflens.engine.amp.autocast()
    a = a if isinstance(a, Tensor) else Tensor(a)
    diff = a - b
    sq = diff * diff
    if reduction == "none":
        return sq
    if reduction == "sum":
        return sq.sum()
    if reduction == "mean":
        return sq.mean()
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
