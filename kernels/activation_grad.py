"""ReLU / LeakyReLU / ReLU6 backward from the saved output ``y`` (``activation_grad.cu``).

The forward keeps only its output, so the masks are read from y: relu passes dy where y > 0, leaky
ReLU passes dy there and ``slope * dy`` elsewhere (slope > 0, so y > 0 exactly when x > 0), ReLU6
passes dy where 0 < y < 6. Masked positions are exactly 0 (also for inf/NaN dy), as in PyTorch.

The maths is defined once, by the engine's CPU backward of ``ReLU``, ``LeakyReLU`` and ``ReLU6``
(:mod:`leaflens.engine.ops.activation`); tests/kernels/test_kernel_launch.py holds this kernel to it.
The one deliberate difference: the engine's ``gy * mask`` gives NaN where an inf/NaN dy is masked.
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


def activation_grad_cuda(kind: str, y: Any, gy: Any, slope: float = 0.01, out: Any | None = None) -> Any:
    """Gradient with respect to the activation's input, given its output ``y`` and ``gy`` (float32 or
    float16 CuPy arrays of one shape); ``out`` receives it when given."""
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
