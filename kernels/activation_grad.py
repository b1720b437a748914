"""ReLU / LeakyReLU / ReLU6 backward from the saved output ``y`` (``activation_grad.cu``).

The forward keeps only its output, so the masks are read from y: relu passes dy where y > 0, leaky
ReLU passes dy there and ``slope * dy`` elsewhere (slope > 0, so y > 0 exactly when x > 0), ReLU6
passes dy where 0 < y < 6. Masked positions are exactly 0 (also for inf/NaN dy), as in PyTorch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.kernels import _checks, _cuda

KINDS = ("relu", "leaky_relu", "relu6")


def _check_kind(kind: str, slope: float) -> None:
    if kind not in KINDS:
        raise ValueError(f"activation_grad: kind must be one of {KINDS}, got {kind!r}")
    if kind == "leaky_relu" and not slope > 0:
        raise ValueError(f"activation_grad: leaky_relu slope must be > 0 to be invertible from y, got {slope}")


def activation_grad_reference(kind: str, y: np.ndarray, gy: np.ndarray, slope: float = 0.01) -> np.ndarray:
    """Gradient with respect to the activation's input, given its output ``y`` and ``gy`` (same shape)."""
    _check_kind(kind, slope)
    if y.shape != gy.shape:
        raise ValueError(f"activation_grad: y {y.shape} and gy {gy.shape} differ in shape")
    ct = np.result_type(gy.dtype, np.float32)
    yf = y.astype(ct, copy=False)
    g = gy.astype(ct, copy=False)
    if kind == "relu":
        gx = np.where(yf > 0, g, ct.type(0))
    elif kind == "leaky_relu":
        gx = np.where(yf > 0, g, ct.type(slope) * g)
    else:
        gx = np.where((yf > 0) & (yf < 6), g, ct.type(0))
    return gx.astype(gy.dtype, copy=False)


def activation_grad_cuda(kind: str, y: Any, gy: Any, slope: float = 0.01, out: Any | None = None) -> Any:
    """GPU twin of :func:`activation_grad_reference`; float32 or float16 CuPy arrays, any shape."""
    _check_kind(kind, slope)
    cp = _cuda.cupy_module()
    name = f"{kind}_grad"
    _checks.require_array(cp, name, "y", y, [np.float32, np.float16])
    _checks.require_array(cp, name, "gy", gy, [y.dtype], shape=y.shape)
    if out is None:
        out = cp.empty_like(gy)
    else:
        _checks.require_array(cp, name, "out", out, [y.dtype], shape=y.shape)
    n = int(y.size)
    if n == 0:
        return out
    kernel = _cuda.load_kernel("activation_grad.cu", f"{name}_{_checks.float_suffix(name, y.dtype)}")
    grid, block = _cuda.grid_1d(n)
    args: tuple[Any, ...] = (y, gy, out, np.int64(n))
    if kind == "leaky_relu":
        args += (np.float32(slope),)
    kernel(grid, block, args)
    return out
