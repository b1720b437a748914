"""Fused softmax + cross-entropy over the last axis of (N, C) logits (``softmax_xent.cu``).

Targets are either int64 class indices (N,) with optional label smoothing ``eps`` (target distribution
``(1 - eps) * onehot + eps / C``) and an optional ``ignore_index`` (such rows contribute nothing and are
left out of the mean), or a float32 soft-target matrix (N, C) (knowledge distillation against
``softmax(teacher / T)``). The loss is the mean (or, reduction 'sum', the sum) over rows of
``-sum(q * log_softmax(z))``. The forward returns the loss and ``stats`` (N, 2) float32 = per row
(log-sum-exp, total target mass: 0 on an ignored row); the backward computes
``(softmax * mass - q) * g / count``, which is the exact gradient of that loss and equals the usual
``(softmax - q) * g / N`` when each row of q sums to 1 and no row is ignored. The count of a mean
(``max(sum of the masses, 1)`` with an ignore index, else N) stays on the device: nothing is read back.
All arithmetic is float32 (float16 logits are widened as they are read).

The maths is defined once, by the engine's ``cross_entropy`` (:mod:`leaflens.engine.ops.loss`), which
also covers what these kernels do not (reduction 'none'); tests/kernels/test_kernel_launch.py holds the
kernels to it, and ``stats`` to its formula.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.kernels import _checks, _cuda


def _targets_kind(targets: Any, n: int, c: int, name: str) -> str:
    if targets.dtype == np.int64:
        if tuple(targets.shape) != (n,):
            raise ValueError(f"{name}: class-index targets must have shape ({n},), got {tuple(targets.shape)}")
        return "hard"
    if targets.dtype.kind == "f":
        if tuple(targets.shape) != (n, c):
            raise ValueError(f"{name}: soft targets must have shape ({n}, {c}), got {tuple(targets.shape)}")
        return "soft"
    raise TypeError(f"{name}: targets must be int64 class indices or float soft targets, got {targets.dtype}")


def _check_smoothing(name: str, kind: str, label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if kind == "soft" and label_smoothing != 0.0:
        raise ValueError(f"{name}: label_smoothing applies to class-index targets only; smooth soft targets yourself")


def _count(cp: Any, kind: str, stats: Any, n: int, ignore_index: int | None) -> Any:
    """The mean's row count: rows not ignored (a device scalar, at least 1) or simply N."""
    if kind == "hard" and ignore_index is not None:
        return cp.maximum(stats[:, 1].sum(), np.float32(1))
    return np.float32(max(n, 1))  # an empty batch's mean is 0, as in the engine


def _check_reduction(name: str, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{name}: reduction must be 'mean' or 'sum', got {reduction!r}")


def softmax_xent_forward_cuda(
    logits: Any,
    targets: Any,
    label_smoothing: float = 0.0,
    validate: bool = True,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> tuple[Any, Any]:
    """Return ``(loss, stats)``: the mean (or summed) loss (0-d float32) and per-row (log-sum-exp,
    target mass) (N, 2).

    ``validate`` checks class indices on the device first (one host synchronisation); without it an
    out-of-range index gives a NaN row loss rather than a wrong number. ``ignore_index`` applies to
    class-index targets only (soft targets have no class index to compare).
    """
    cp = _cuda.cupy_module()
    name = "softmax_xent_forward"
    _checks.require_array(cp, name, "logits", logits, [np.float32, np.float16], ndim=2)
    n, c = logits.shape
    kind = _targets_kind(targets, n, c, name)
    _check_smoothing(name, kind, label_smoothing)
    _check_reduction(name, reduction)
    _checks.require_int32(name, N=n, C=c)
    if n == 0 or c == 0:
        raise ValueError(f"{name}: logits must have at least one row and one class, got {tuple(logits.shape)}")
    suffix = _checks.float_suffix(name, logits.dtype)
    row_loss = cp.empty((n,), dtype=np.float32)
    stats = cp.empty((n, 2), dtype=np.float32)
    block = (_cuda.row_block(c),)
    if kind == "hard":
        _checks.require_array(cp, name, "targets", targets, [np.int64], shape=(n,))
        if validate:
            bad = (targets < 0) | (targets >= c)
            if ignore_index is not None:
                bad &= targets != ignore_index
            if bool(bad.any()):
                raise ValueError(f"{name}: a class index is outside [0, {c})")
        kernel = _cuda.load_kernel("softmax_xent.cu", f"xent_hard_forward_{suffix}")
        ignore = np.int64(0 if ignore_index is None else ignore_index)
        kernel(
            (n,),
            block,
            (logits, targets, row_loss, stats, np.int32(n), np.int32(c), np.float32(label_smoothing), ignore,
             np.int32(ignore_index is not None)),
        )
    else:
        _checks.require_array(cp, name, "targets", targets, [np.float32], shape=(n, c))
        kernel = _cuda.load_kernel("softmax_xent.cu", f"xent_soft_forward_{suffix}")
        kernel((n,), block, (logits, targets, row_loss, stats, np.int32(n), np.int32(c)))
    if reduction == "sum":
        return row_loss.sum(), stats
    if kind == "hard" and ignore_index is not None:
        return row_loss.sum() / _count(cp, kind, stats, n, ignore_index), stats
    return row_loss.mean(), stats


def softmax_xent_backward_cuda(
    logits: Any,
    targets: Any,
    stats: Any,
    grad: Any = 1.0,
    label_smoothing: float = 0.0,
    *,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> Any:
    """Gradient of the loss (mean or sum, as in the forward) with respect to the logits, scaled by the
    upstream ``grad`` (a float or a device scalar). Ignored rows come out as zeros (their mass in
    ``stats`` is 0); ``ignore_index`` here only says that the mean counts the rows not ignored."""
    cp = _cuda.cupy_module()
    name = "softmax_xent_backward"
    _checks.require_array(cp, name, "logits", logits, [np.float32, np.float16], ndim=2)
    n, c = logits.shape
    kind = _targets_kind(targets, n, c, name)
    _check_smoothing(name, kind, label_smoothing)
    _check_reduction(name, reduction)
    _checks.require_array(cp, name, "stats", stats, [np.float32], shape=(n, 2))
    _checks.require_int32(name, N=n, C=c)
    g = cp.asarray(grad, dtype=np.float32).reshape(1)  # stays on the device: no synchronisation
    dlogits = cp.empty_like(logits)
    if n == 0 or c == 0:
        return dlogits
    scale = g if reduction == "sum" else cp.ascontiguousarray(g / _count(cp, kind, stats, n, ignore_index),
                                                              dtype=np.float32)
    suffix = _checks.float_suffix(name, logits.dtype) + _checks.index_suffix(n * c)
    grid, block = _cuda.grid_1d(n * c)
    args: tuple[Any, ...]  # the hard-label kernel also takes the label smoothing
    if kind == "hard":
        _checks.require_array(cp, name, "targets", targets, [np.int64], shape=(n,))
        kernel = _cuda.load_kernel("softmax_xent.cu", f"xent_hard_backward_{suffix}")
        args = (logits, targets, stats, scale, dlogits, np.int32(n), np.int32(c), np.float32(label_smoothing))
    else:
        _checks.require_array(cp, name, "targets", targets, [np.float32], shape=(n, c))
        kernel = _cuda.load_kernel("softmax_xent.cu", f"xent_soft_backward_{suffix}")
        args = (logits, targets, stats, scale, dlogits, np.int32(n), np.int32(c))
    kernel(grid, block, args)
    return dlogits
