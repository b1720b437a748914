"""NHWC im2col / col2im (``im2col.cu``): convolution as one matrix product.

Column layout (the engine's contract): row ``m = (n*Ho + ho)*Wo + wo``, column ``k = (i*kw + j)*C + c``,
so ``cols @ W.transpose(2, 3, 1, 0).reshape(kh*kw*C, Cout)`` (W stored OIHW) is the NHWC output.
Padding is (top, bottom, left, right), asymmetric allowed (TF "same"); stride (sh, sw); dilation 1.
col2im is the adjoint: it sums every cols entry back onto the pixel it was copied from.

The maths is defined once, by the engine's ``im2col``/``col2im`` (:mod:`leaflens.engine.ops.conv`,
which pads first with ``pad_nhwc``); tests/kernels/test_kernel_launch.py holds these kernels to them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.kernels import _checks, _cuda


def conv_output_size(
    h: int, w: int, kernel: Any, stride: Any = 1, padding: Any = 0, name: str = "conv"
) -> tuple[int, int]:
    """Output (Ho, Wo) of a kh x kw window with the given stride and (top, bottom, left, right) padding."""
    kh, kw = _checks.require_pair(name, "kernel", kernel, 1)
    sh, sw = _checks.require_pair(name, "stride", stride, 1)
    pt, pb, pl, pr = _checks.require_padding(name, padding)
    ho = (h + pt + pb - kh) // sh + 1
    wo = (w + pl + pr - kw) // sw + 1
    if ho < 1 or wo < 1:
        raise ValueError(f"{name}: a {kh}x{kw} window does not fit a {h}x{w} input with padding {padding}")
    return ho, wo


def conv_geometry(shape: tuple[int, ...], kernel: Any, stride: Any, padding: Any, name: str) -> tuple[int, ...]:
    if len(shape) != 4:
        raise ValueError(f"{name}: x must be NHWC (4-D), got shape {shape}")
    n, h, w, c = shape
    kh, kw = _checks.require_pair(name, "kernel", kernel, 1)
    sh, sw = _checks.require_pair(name, "stride", stride, 1)
    pt, pb, pl, pr = _checks.require_padding(name, padding)
    ho, wo = conv_output_size(h, w, (kh, kw), (sh, sw), (pt, pb, pl, pr), name)
    return n, h, w, c, kh, kw, sh, sw, pt, pb, pl, pr, ho, wo


def _launch(kernel_name: str, src: Any, dst: Any, geo: tuple[int, ...], total: int) -> None:
    n, h, w, c, kh, kw, sh, sw, pt, _pb, pl, _pr, ho, wo = geo
    # 32-bit flat indices unless x or cols has 2^31 elements or more
    kernel = _cuda.load_kernel("im2col.cu", kernel_name + _checks.index_suffix(int(src.size), int(dst.size)))
    grid, block = _cuda.grid_1d(total)
    ints = (n, h, w, c, kh, kw, sh, sw, pt, pl, ho, wo)
    kernel(grid, block, (src, dst) + tuple(np.int32(v) for v in ints))


def im2col_cuda(x: Any, kernel: Any, stride: Any = 1, padding: Any = 0) -> Any:
    """(N, H, W, C) -> (N*Ho*Wo, kh*kw*C) patch matrix of float32 or float16 CuPy x, same dtype."""
    cp = _cuda.cupy_module()
    name = "im2col_nhwc"
    _checks.require_array(cp, name, "x", x, [np.float32, np.float16], ndim=4)
    geo = conv_geometry(tuple(x.shape), kernel, stride, padding, name)
    n, h, w, c, kh, kw, *_rest, ho, wo = geo
    _checks.require_int32(name, N=n, H=h, W=w, C=c, taps_times_C=kh * kw * c)
    cols = cp.empty((n * ho * wo, kh * kw * c), dtype=x.dtype)
    if cols.size:
        _launch(f"{name}_{_checks.float_suffix(name, x.dtype)}", x, cols, geo, int(cols.size))
    return cols


def col2im_cuda(cols: Any, x_shape: tuple[int, int, int, int], kernel: Any, stride: Any = 1, padding: Any = 0) -> Any:
    """Adjoint of :func:`im2col_cuda`: (N*Ho*Wo, kh*kw*C) -> (N, H, W, C), overlaps summed in float32."""
    cp = _cuda.cupy_module()
    name = "col2im_nhwc"
    geo = conv_geometry(tuple(x_shape), kernel, stride, padding, name)
    n, h, w, c, kh, kw, *_rest, ho, wo = geo
    _checks.require_array(cp, name, "cols", cols, [np.float32, np.float16], shape=(n * ho * wo, kh * kw * c))
    _checks.require_int32(name, N=n, H=h, W=w, C=c, taps_times_C=kh * kw * c)
    x = cp.empty(tuple(int(v) for v in x_shape), dtype=cols.dtype)
    if x.size:
        _launch(f"{name}_{_checks.float_suffix(name, cols.dtype)}", cols, x, geo, int(x.size))
    return x
