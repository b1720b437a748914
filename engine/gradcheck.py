"""Numerical gradient checks: central differences in float64 against the analytic backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from leaflens.engine.config import enable_grad
from leaflens.engine.tensor import Tensor


class GradcheckError(AssertionError):
    """Analytic and numerical gradients disagree."""


def numerical_grad(f: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d f / d x by central differences, perturbing ``x`` in place one element at a time.

    ``x`` may have any memory layout (a transposed or sliced array): it is indexed, never reshaped,
    since reshaping a non-contiguous array copies it and the perturbation would miss ``x``.
    """
    grad = np.zeros(x.shape, dtype=x.dtype)
    for i in np.ndindex(*x.shape):
        old = x[i]
        x[i] = old + eps
        up = f()
        x[i] = old - eps
        down = f()
        x[i] = old
        grad[i] = (up - down) / (2 * eps)
    return grad


def gradcheck(fn: Callable[..., Tensor], inputs: Sequence[Any], eps: float = 1e-6, atol: float = 1e-5,
              rtol: float = 1e-4, seed: int = 0) -> bool:
    """Check ``fn``'s backward against finite differences for every float input.

    ``fn(*tensors)`` may return any shape: it is reduced to a scalar with fixed random weights, so
    every output element's gradient is tested, not only their sum. Inputs are converted to float64
    (integer inputs, such as class targets, are passed through unchanged and not differentiated).
    Raises GradcheckError naming the input and the worst element; returns True otherwise.
    """
    arrays = [np.array(x.data if isinstance(x, Tensor) else x) for x in inputs]
    arrays = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays]
    rng = np.random.default_rng(seed)

    with enable_grad():
        probe = fn(*[Tensor(a) for a in arrays])
    weights = rng.standard_normal(probe.shape) if probe.shape else np.array(1.0)

    def scalar() -> float:
        out = fn(*[Tensor(a) for a in arrays])
        return float((out.data * weights).sum())

    tensors = [Tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    with enable_grad():
        out = fn(*tensors)
        if out.dtype != np.float64:
            raise GradcheckError(f"gradcheck: the function returned {out.dtype}; ops must keep float64")
        (out * Tensor(weights)).sum().backward()

    for k, (t, a) in enumerate(zip(tensors, arrays)):
        if not t.requires_grad:
            continue
        num = numerical_grad(scalar, a, eps)
        ana = t.grad if t.grad is not None else np.zeros_like(a)
        err = np.abs(ana - num)
        tol = atol + rtol * np.abs(num)
        if (err > tol).any():
            i = np.unravel_index(int(np.argmax(err - tol)), a.shape)
            raise GradcheckError(f"gradient of input {k} (shape {a.shape}) differs at index {i}: analytic "
                                 f"{ana[i]:.8g}, numerical {num[i]:.8g} (max abs error {err.max():.3g})")
    return True
