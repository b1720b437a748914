"""Pooling on NHWC activations: max (with argmax taps), average, global average."""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.engine.backend import array_module
from leaflens.engine.ops import _kernels as gpu
from leaflens.engine.ops.conv import Padding, _pair, _unpad, pad_nhwc, resolve_padding, tap
from leaflens.engine.parallel import for_rows
from leaflens.engine.tensor import Function, Tensor


def _geometry(x: Any, kernel: tuple[int, int], stride: tuple[int, int], padding: Padding, op: str):
    if x.ndim != 4:
        raise ValueError(f"{op} expects NHWC input with 4 dimensions, got shape {tuple(x.shape)}")
    h, w = x.shape[1:3]
    pads = resolve_padding(padding, (h, w), kernel, stride)
    ho = (h + pads[0] + pads[1] - kernel[0]) // stride[0] + 1
    wo = (w + pads[2] + pads[3] - kernel[1]) // stride[1] + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"{op}: a {kernel[0]}x{kernel[1]} window does not fit a {h}x{w} input")
    return pads, (ho, wo)


class _Pool(Function):
    """Kernel, stride (default: the kernel) and padding shared by the windowed pools."""

    def __init__(self, kernel, stride, padding):
        self.kernel = _pair(kernel, "kernel_size")
        self.stride = _pair(stride if stride is not None else kernel, "stride")
        self.padding = padding


class MaxPool2d(_Pool):
    """Max over the kernel taps; in backward the gradient goes to the first tap that equals the max.

    The forward is a chain of ``maximum`` calls over shifted views. Which tap won is worked out
    only in backward, from the saved input (usually the ReLU output that is saved anyway), so no
    index array is built in forward.

    On CuPy the ``maxpool`` kernels run instead (engine/ops/_kernels.py). They are NHWC like the
    engine, so the activations go in as they are (no transpose); their forward records the winning
    tap per output as uint8 (1 byte per output) and their backward scatters through it.
    """

    idx: Any = None  # the kernel forward's uint8 tap indices; None on the xp path

    def forward(self, x):
        xp = array_module(x)
        self.pads, self.out_hw = _geometry(x, self.kernel, self.stride, self.padding, "max_pool2d")
        self.in_shape = x.shape
        fused = gpu.maxpool_forward(xp, x, self.kernel, self.stride, self.pads)
        if fused is not None:
            y, idx = fused
            if self.recording:
                self.idx = idx
            return y
        xpad = pad_nhwc(x, self.pads, value=-xp.inf)
        kh, kw = self.kernel
        y = xp.empty((x.shape[0], *self.out_hw, x.shape[3]), dtype=x.dtype)

        def run(lo: int, hi: int) -> None:
            src, yy = xpad[lo:hi], y[lo:hi]
            yy[...] = tap(src, 0, 0, self.out_hw, self.stride)
            for t in range(1, kh * kw):
                xp.maximum(yy, tap(src, t // kw, t % kw, self.out_hw, self.stride), out=yy)

        for_rows(xp, x.shape[0], x.size, run)
        if self.recording:
            self.xpad, self.y = xpad, y
        return y

    def backward(self, gy):
        xp = array_module(gy)
        if self.idx is not None:
            return gpu.maxpool_backward(xp, gy, self.idx, self.in_shape, self.kernel, self.stride, self.pads)
        kh, kw = self.kernel
        gx = xp.empty(self.xpad.shape, dtype=gy.dtype)
        overlapping = self.stride[0] < kh or self.stride[1] < kw
        covered = not overlapping and self.xpad.shape[1] == kh * self.out_hw[0] \
            and self.xpad.shape[2] == kw * self.out_hw[1]

        def one(b: slice) -> None:
            g, src, y, gyy = gx[b], self.xpad[b], self.y[b], gy[b]
            if not covered:  # some input pixels fall in no window (or in several): start from zero
                g[...] = 0
            unclaimed = xp.ones(gyy.shape, dtype=bool)
            hit = xp.empty(gyy.shape, dtype=bool)
            for t in range(kh * kw):
                i, j = t // kw, t % kw
                xp.equal(tap(src, i, j, self.out_hw, self.stride), y, out=hit)
                if t:
                    hit &= unclaimed
                if t + 1 < kh * kw:
                    unclaimed ^= hit  # hit lies within unclaimed: this clears the taps just claimed
                dst = tap(g, i, j, self.out_hw, self.stride)
                if overlapping:
                    dst += gyy * hit
                else:
                    xp.multiply(gyy, hit, out=dst)

        def run(lo: int, hi: int) -> None:
            if xp is not np:
                one(slice(lo, hi))
                return
            # a few images at a time (about 2^17 input values): their gradient, input and masks stay in the cache
            step = max(1, (1 << 17) // max(self.xpad[0].size, 1))
            for b in range(lo, hi, step):
                one(slice(b, min(b + step, hi)))

        for_rows(xp, gy.shape[0], self.xpad.size, run)
        return _unpad(gx, self.pads, self.in_shape[1:3])


class AvgPool2d(_Pool):
    """Mean over each window; padded positions are left out of the count (ONNX count_include_pad=0)."""

    def forward(self, x):
        xp = array_module(x)
        self.pads, self.out_hw = _geometry(x, self.kernel, self.stride, self.padding, "avg_pool2d")
        self.in_shape = x.shape
        xpad = pad_nhwc(x, self.pads)
        self.padded_shape = xpad.shape
        kh, kw = self.kernel
        y = xp.zeros((x.shape[0], *self.out_hw, x.shape[3]), dtype=x.dtype)
        for i in range(kh):
            for j in range(kw):
                y += tap(xpad, i, j, self.out_hw, self.stride)
        if any(self.pads):
            ones = pad_nhwc(xp.ones((1, *x.shape[1:3], 1), dtype=x.dtype), self.pads)
            count = xp.zeros((1, *self.out_hw, 1), dtype=x.dtype)
            for i in range(kh):
                for j in range(kw):
                    count += tap(ones, i, j, self.out_hw, self.stride)
            self.inv_count = 1 / count
        else:
            self.inv_count = x.dtype.type(1.0 / (kh * kw))
        return y * self.inv_count

    def backward(self, gy):
        xp = array_module(gy)
        g = gy * self.inv_count
        gx = xp.zeros(self.padded_shape, dtype=gy.dtype)
        kh, kw = self.kernel
        for i in range(kh):
            for j in range(kw):
                tap(gx, i, j, self.out_hw, self.stride)[...] += g
        return _unpad(gx, self.pads, self.in_shape[1:3])


class GlobalAvgPool2d(Function):
    """NHWC (N, H, W, C) -> (N, C)."""

    def forward(self, x):
        if x.ndim != 4:
            raise ValueError(f"global_avg_pool2d expects NHWC input with 4 dimensions, got {tuple(x.shape)}")
        self.in_shape = x.shape
        return x.mean(axis=(1, 2))

    def backward(self, gy):
        xp = array_module(gy)
        n, h, w, c = self.in_shape
        return xp.broadcast_to((gy / (h * w))[:, None, None, :], self.in_shape)


def max_pool2d(x: Any, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
               padding: Padding = 0) -> Tensor:
    return MaxPool2d(kernel_size, stride, padding)(x)


def avg_pool2d(x: Any, kernel_size: int | tuple[int, int], stride: int | tuple[int, int] | None = None,
               padding: Padding = 0) -> Tensor:
    return AvgPool2d(kernel_size, stride, padding)(x)


def global_avg_pool2d(x: Any) -> Tensor:
    return GlobalAvgPool2d()(x)
