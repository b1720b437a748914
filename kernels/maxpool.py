"""NHWC max-pooling with argmax indices, forward and backward (``maxpool.cu``).

Window (kh, kw), stride, padding (top, bottom, left, right) that behaves as -inf. ``idx`` holds, per
output element, the winning tap ``t = i*kw + j`` as uint8 (first maximum wins on ties; a NaN wins and
propagates). The backward sends each upstream gradient to its recorded tap, summing where windows
overlap; a gradient whose tap lies in the padding is dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.kernels import _checks, _cuda
from leaflens.kernels.im2col import conv_geometry


def _check_taps(name: str, kh: int, kw: int) -> None:
    if kh * kw > 256:
        raise ValueError(f"{name}: a {kh}x{kw} window has more taps than a uint8 index can name (256)")


def maxpool_forward_reference(
    x: np.ndarray, kernel: Any, stride: Any = None, padding: Any = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(y, idx)``: y (N, Ho, Wo, C) like x, idx uint8 tap indices. stride defaults to kernel."""
    stride = kernel if stride is None else stride
    n, h, w, c, kh, kw, sh, sw, pt, pb, pl, pr, ho, wo = conv_geometry(x.shape, kernel, stride, padding, "maxpool")
    _check_taps("maxpool", kh, kw)
    xp = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=-np.inf)
    windows = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(1, 2))
    windows = windows[:, : (ho - 1) * sh + 1 : sh, : (wo - 1) * sw + 1 : sw].reshape(n, ho, wo, c, kh * kw)
    idx = np.argmax(windows, axis=-1)  # first maximum; the first NaN if any
    y = np.take_along_axis(windows, idx[..., None], axis=-1)[..., 0]
    return np.ascontiguousarray(y), idx.astype(np.uint8)


def maxpool_backward_reference(
    gy: np.ndarray,
    idx: np.ndarray,
    x_shape: tuple[int, int, int, int],
    kernel: Any,
    stride: Any = None,
    padding: Any = 0,
) -> np.ndarray:
    """Gradient with respect to x (shape ``x_shape``, dtype of gy)."""
    stride = kernel if stride is None else stride
    n, h, w, c, kh, kw, sh, sw, pt, pb, pl, pr, ho, wo = conv_geometry(
        tuple(x_shape), kernel, stride, padding, "maxpool"
    )
    if gy.shape != (n, ho, wo, c) or idx.shape != gy.shape:
        raise ValueError(f"maxpool backward: gy {gy.shape} / idx {idx.shape}, expected {(n, ho, wo, c)}")
    ct = np.result_type(gy.dtype, np.float32)
    g = gy.astype(ct, copy=False)
    gxp = np.zeros((n, h + pt + pb, w + pl + pr, c), dtype=ct)
    for i in range(kh):  # one vectorised add per tap
        for j in range(kw):
            hit = np.where(idx == i * kw + j, g, ct.type(0))
            gxp[:, i : i + (ho - 1) * sh + 1 : sh, j : j + (wo - 1) * sw + 1 : sw, :] += hit
    return gxp[:, pt : pt + h, pl : pl + w, :].astype(gy.dtype)


def _ints(geo: tuple[int, ...]) -> tuple[np.int32, ...]:
    n, h, w, c, kh, kw, sh, sw, pt, _pb, pl, _pr, ho, wo = geo
    return tuple(np.int32(v) for v in (n, h, w, c, kh, kw, sh, sw, pt, pl, ho, wo))


def maxpool_forward_cuda(x: Any, kernel: Any, stride: Any = None, padding: Any = 0) -> tuple[Any, Any]:
    """GPU twin of :func:`maxpool_forward_reference` (float32 or float16 CuPy x)."""
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
        k = _cuda.load_kernel("maxpool.cu", f"{name}_{_checks.float_suffix(name, x.dtype)}")
        grid, block = _cuda.grid_1d(int(y.size))
        k(grid, block, (x, y, idx) + _ints(geo))
    return y, idx


def maxpool_backward_cuda(
    gy: Any, idx: Any, x_shape: tuple[int, int, int, int], kernel: Any, stride: Any = None, padding: Any = 0
) -> Any:
    """GPU twin of :func:`maxpool_backward_reference`."""
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
        k = _cuda.load_kernel("maxpool.cu", f"{name}_{_checks.float_suffix(name, gy.dtype)}")
        grid, block = _cuda.grid_1d(int(gx.size))
        k(grid, block, (gy, idx, gx) + _ints(geo))
    return gx
