"""L2-normalisation over the last axis, forward and backward (``l2norm.cu``).

``y = x / max(||x||, eps)``; the backward is ``(gy - y * <gy, y>) / ||x||``, or ``gy / eps`` for rows
whose norm is below eps (the map is linear there). The forward returns the row norms (float32) that
the backward needs. Any leading shape is allowed; it is treated as rows of the last axis.

The maths is defined once, by the engine's ``L2Normalize`` (:mod:`leaflens.engine.ops.norm`), which
keeps ``max(norm, eps)`` where these kernels keep the norm; tests/kernels/test_kernel_launch.py holds
the kernels to it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.kernels import _checks, _cuda


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    d = shape[-1]
    n = int(np.prod(shape[:-1], dtype=np.int64))
    return n, d


def l2norm_forward_cuda(x: Any, eps: float = 1e-12) -> tuple[Any, Any]:
    """Return ``(y, norm)``: y like x (float32/float16), norm of shape ``x.shape[:-1]`` in float32."""
    cp = _cuda.cupy_module()
    name = "l2norm_forward"
    _checks.require_array(cp, name, "x", x, [np.float32, np.float16])
    if x.ndim < 1:
        raise ValueError(f"{name}: x must have at least one axis")
    n, d = _rows(x.shape)
    _checks.require_int32(name, rows=n, D=d)
    y = cp.empty_like(x)
    norm = cp.empty(x.shape[:-1], dtype=np.float32)
    if n == 0:
        return y, norm
    if d == 0:
        norm.fill(0)
        return y, norm
    kernel = _cuda.load_kernel("l2norm.cu", f"{name}_{_checks.float_suffix(name, x.dtype)}")
    kernel((n,), (_cuda.row_block(d),), (x, y, norm, np.int32(n), np.int32(d), np.float32(eps)))
    return y, norm


def l2norm_backward_cuda(y: Any, gy: Any, norm: Any, eps: float = 1e-12) -> Any:
    """Gradient with respect to x from the forward's ``y`` and ``norm`` and the upstream ``gy``."""
    cp = _cuda.cupy_module()
    name = "l2norm_backward"
    _checks.require_array(cp, name, "y", y, [np.float32, np.float16])
    _checks.require_array(cp, name, "gy", gy, [y.dtype], shape=y.shape)
    _checks.require_array(cp, name, "norm", norm, [np.float32], shape=y.shape[:-1])
    n, d = _rows(y.shape)
    _checks.require_int32(name, rows=n, D=d)
    gx = cp.empty_like(gy)
    if n == 0 or d == 0:
        return gx
    kernel = _cuda.load_kernel("l2norm.cu", f"{name}_{_checks.float_suffix(name, y.dtype)}")
    kernel((n,), (_cuda.row_block(d),), (y, gy, norm, gx, np.int32(n), np.int32(d), np.float32(eps)))
    return gx
