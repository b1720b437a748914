"""NHWC max-pooling with argmax indices, forward and backward (``maxpool.cu``).

Window (kh, kw), stride, padding (top, bottom, left, right) that behaves as -inf. ``idx`` holds, per
output element, the winning tap ``t = i*kw + j`` as uint8 (first maximum wins on ties; a NaN wins and
propagates). The backward sends each upstream gradient to its recorded tap, summing where windows
overlap; a gradient whose tap lies in the padding is dropped.

The maths is defined once, by the engine's ``MaxPool2d`` (:mod:`leaflens.engine.ops.pool`), which works
out the winning tap in backward instead of storing it; tests/kernels/test_kernel_launch.py holds these
kernels to it. The one deliberate difference: a NaN wins here, where the engine's backward drops it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.kernels import _checks, _cuda
from leaflens.kernels.im2col import conv_geometry


def _check_taps(name: str, kh: int, kw: int) -> None:
    if kh * kw > 256:
        raise ValueError(f"{name}: a {kh}x{kw} window has more taps than a uint8 index can name (256)")


def _ints(geo: tuple[int, ...]) -> tuple[np.int32, ...]:
    n, h, w, c, kh, kw, sh, sw, pt, _pb, pl, _pr, ho, wo = geo
    return tuple(np.int32(v) for v in (n, h, w, c, kh, kw, sh, sw, pt, pl, ho, wo))


def maxpool_forward_cuda(x: Any, kernel: Any, stride: Any = None, padding: Any = 0) -> tuple[Any, Any]:
    """Return ``(y, idx)``: y (N, Ho, Wo, C) like x (float32 or float16), idx the uint8 winning taps.
    stride defaults to kernel."""
    cp = _cuda.cupy_module()
    name = "maxpool_forward"
    stride = kernel if stride is None else stride
    _checks.require_array(cp, name, "x", x, [np.float32, np.float16], ndim=4)
    geo = conv_geometry(tuple(x.shape), kernel, stride, padding, name)
    n, h, w, c, kh, kw, *_rest, ho, wo = geo
    _check_taps(name, kh, kw)
    _checks.require_int32(name, N=n, H=h, W=w, C=c)
    y = cp.empty((n, ho, wo, c), dtype=x.dtype)
    idx = cp.empty((n, ho, wo, c), dtype=np.uint8)
    if y.size:
        suffix = _checks.float_suffix(name, x.dtype) + _checks.index_suffix(int(x.size), int(y.size))
        k = _cuda.load_kernel("maxpool.cu", f"{name}_{suffix}")
        grid, block = _cuda.grid_1d(int(y.size))
        k(grid, block, (x, y, idx) + _ints(geo))
    return y, idx


def maxpool_backward_cuda(
    gy: Any, idx: Any, x_shape: tuple[int, int, int, int], kernel: Any, stride: Any = None, padding: Any = 0
) -> Any:
    """Gradient with respect to x (shape ``x_shape``, dtype of gy) from the forward's ``idx``."""
    cp = _cuda.cupy_module()
    name = "maxpool_backward"
    stride = kernel if stride is None else stride
    geo = conv_geometry(tuple(x_shape), kernel, stride, padding, name)
    n, h, w, c, kh, kw, *_rest, ho, wo = geo
    _check_taps(name, kh, kw)
    _checks.require_array(cp, name, "gy", gy, [np.float32, np.float16], shape=(n, ho, wo, c))
    _checks.require_array(cp, name, "idx", idx, [np.uint8], shape=(n, ho, wo, c))
    _checks.require_int32(name, N=n, H=h, W=w, C=c)
    gx = cp.empty(tuple(int(v) for v in x_shape), dtype=gy.dtype)
    if gx.size:
        suffix = _checks.float_suffix(name, gy.dtype) + _checks.index_suffix(int(gx.size), int(gy.size))
        k = _cuda.load_kernel("maxpool.cu", f"{name}_{suffix}")
        grid, block = _cuda.grid_1d(int(gx.size))
        k(grid, block, (gy, idx, gx) + _ints(geo))
    return gx
