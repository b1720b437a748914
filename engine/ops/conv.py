"""2-D convolution on NHWC activations with OIHW weights.

Why NHWC: im2col built from kh*kw shifted slices of an NHWC array lays each output pixel's
receptive field out contiguously (tap-major, channel fastest), so one BLAS matmul with the
(kh*kw*Cin, Cout) weight matrix yields the NHWC output directly, with no transpose before or after.
BatchNorm and pooling also reduce over the leading axes of a contiguous array. In NCHW the same
approach needs a transpose of the activations at every layer. Weights stay OIHW, as in ONNX and
PyTorch, so export and pretrained weights need no reshuffle; turning them into the matmul layout
costs a copy of the (small) weight per call.

On NumPy, 3x3 stride-1 pad-1 dense convolutions with at least 16 input channels (the student's second
and later layers) run Winograd F(2x2, 3x3) instead (engine/ops/winograd.py): 2.25x fewer multiplies, no
im2col columns built or kept for backward.

Depthwise convolutions (groups == channels) skip im2col: they are kh*kw multiply-adds of shifted
slices, which moves far less memory than building columns for a matmul of width one. On NumPy they
run tile by tile (a few output rows of one image), so every tap's pass reads and writes the cache
instead of memory; forward and both gradients of a tile are made in one sweep over its taps.

On CuPy, ``im2col``/``col2im`` run the ``im2col.cu`` kernels (engine/ops/_kernels.py): their column
layout (row ``(n*Ho+ho)*Wo+wo``, column ``(i*kw+j)*C+c``) is exactly the one built here, so one
kernel launch replaces kh*kw strided copies with no reshuffle before or after. The matrix products
stay on ``cupy.matmul`` (cuBLAS), and depthwise convolutions stay on the shifted-slice xp code.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.engine import amp
from leaflens.engine.backend import array_module, wide_sum
from leaflens.engine.ops import _kernels as gpu
from leaflens.engine.ops import winograd
from leaflens.engine.ops.arith import _promoted
from leaflens.engine.ops.linalg import matmul_tn
from leaflens.engine.parallel import for_rows, sum_in_order
from leaflens.engine.tensor import Function, Tensor

Padding = int | tuple[int, int] | tuple[int, int, int, int] | str


def _pair(v: int | tuple[int, int], name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    if len(v) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v!r}")
    return int(v[0]), int(v[1])


def resolve_padding(padding: Padding, in_hw: tuple[int, int], kernel: tuple[int, int],
                    stride: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) from an int, a pair, a 4-tuple, 'valid' or TF-style 'same'."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding != "same":
            raise ValueError(f"padding must be an int, a tuple, 'valid' or 'same', got {padding!r}")
        pads = []
        for size, k, s in zip(in_hw, kernel, stride):
            out = -(-size // s)
            total = max((out - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return pads[0], pads[1], pads[2], pads[3]
    if isinstance(padding, int):
        return padding, padding, padding, padding
    if len(padding) == 2:
        return padding[0], padding[0], padding[1], padding[1]
    if len(padding) == 4:
        top, bottom, left, right = (int(p) for p in padding)
        return top, bottom, left, right
    raise ValueError(f"padding must be an int, a pair or (top, bottom, left, right), got {padding!r}")


def pad_nhwc(x: Any, pads: tuple[int, int, int, int], value: float = 0.0) -> Any:
    t, b, l, r = pads
    if not any(pads):
        return x
    xp = array_module(x)
    n, h, w, c = x.shape
    out = xp.empty((n, h + t + b, w + l + r, c), dtype=x.dtype)

    def fill(lo: int, hi: int) -> None:
        out[lo:hi] = value
        out[lo:hi, t:t + h, l:l + w, :] = x[lo:hi]

    for_rows(xp, n, out.size, fill)
    return out


def tap(xpad: Any, i: int, j: int, out_hw: tuple[int, int], stride: tuple[int, int]) -> Any:
    """The view of the padded input that kernel tap (i, j) sees for every output pixel."""
    (ho, wo), (sh, sw) = out_hw, stride
    return xpad[:, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw, :]


def im2col(xpad: Any, kernel: tuple[int, int], out_hw: tuple[int, int], stride: tuple[int, int],
           pads: tuple[int, int, int, int] | None = None) -> Any:
    """Columns (N*Ho*Wo, kh*kw*C), tap-major with channels fastest, of the padded input ``xpad``; with
    ``pads``, ``xpad`` is the unpadded input and the GPU kernel reads the padding itself."""
    xp = array_module(xpad)
    fused = gpu.im2col(xp, xpad, kernel, stride, pads or (0, 0, 0, 0))
    if fused is not None:
        return fused
    if pads is not None:
        xpad = pad_nhwc(xpad, pads)
    n, c = xpad.shape[0], xpad.shape[3]
    kh, kw = kernel
    ho, wo = out_hw
    cols = xp.empty((n, ho, wo, kh, kw, c), dtype=xpad.dtype)
    item = xpad.dtype.itemsize
    rows_of_taps = xp is np and xpad.strides[3] == item and xpad.strides[2] == c * item

    def fill(lo: int, hi: int) -> None:
        if rows_of_taps:
            # The kw taps of kernel row i read kw*C consecutive values of the padded input: one copy per
            # kernel row (kh copies with kw*C-long inner runs instead of kh*kw with C-long ones; the
            # student's first layer has C = 3).
            wide = cols[lo:hi].reshape(hi - lo, ho, wo, kh, kw * c)
            s = xpad.strides
            for i in range(kh):
                src = np.lib.stride_tricks.as_strided(
                    xpad[lo:hi, i:], shape=(hi - lo, ho, wo, kw * c), strides=(s[0], stride[0] * s[1],
                                                                                stride[1] * s[2], s[3]),
                    writeable=False)
                wide[:, :, :, i, :] = src
            return
        for i in range(kh):
            for j in range(kw):
                cols[lo:hi, :, :, i, j, :] = tap(xpad[lo:hi], i, j, out_hw, stride)

    for_rows(xp, n, cols.size, fill)
    return cols.reshape(n * ho * wo, kh * kw * c)


def col2im(cols: Any, padded_shape: tuple[int, ...], kernel: tuple[int, int], out_hw: tuple[int, int],
           stride: tuple[int, int], pads: tuple[int, int, int, int] | None = None) -> Any:
    """The adjoint of im2col: overlapping contributions are summed into the padded input; with ``pads``,
    into the unpadded input (what lands in the padding is dropped, by the GPU kernel itself)."""
    xp = array_module(cols)
    if pads is not None:
        (n, h, w, c), (t, b, l, r) = padded_shape, pads
        fused = gpu.col2im(xp, cols, (n, h - t - b, w - l - r, c), kernel, stride, pads)
        if fused is not None:
            return fused
        return _unpad(col2im(cols, padded_shape, kernel, out_hw, stride), pads, (h - t - b, w - l - r))
    fused = gpu.col2im(xp, cols, padded_shape, kernel, stride)
    if fused is not None:
        return fused
    n, c = padded_shape[0], padded_shape[3]
    kh, kw = kernel
    ho, wo = out_hw
    cols = cols.reshape(n, ho, wo, kh, kw, c)
    gx = xp.empty(padded_shape, dtype=cols.dtype)

    def add(lo: int, hi: int) -> None:
        g = gx[lo:hi]
        g[...] = 0
        for i in range(kh):
            for j in range(kw):
                tap(g, i, j, out_hw, stride)[...] += cols[lo:hi, :, :, i, j, :]

    for_rows(xp, n, cols.size, add)
    return gx


# Output values per depthwise tile (256 KB of float32): a tile, the input rows it reads and a scratch buffer
# stay in a 1 MB L2 cache through all kh*kw taps, and the tile is large enough that NumPy's per-call cost
# stays small. Measured on 2 cores at EfficientNet-Lite0's 224 px shapes (batch 16): 2^16 and 2^17 fastest,
# 2^13 up to twice as slow (per-call cost), whole images (the untiled code) 1.3-2x slower.
DEPTHWISE_TILE = 1 << 16


def _depthwise_tiles(xp: Any, lo: int, hi: int, ho: int, row_size: int) -> Any:
    """(image slice, first row, end row) tiles of output rows for images lo..hi. On NumPy each tile holds
    about DEPTHWISE_TILE values of one image; elsewhere (CuPy, whose kernels are launched per call) one
    tile covers every image and row."""
    if xp is not np:
        yield slice(lo, hi), 0, ho
        return
    rows = max(1, DEPTHWISE_TILE // max(row_size, 1))
    for b in range(lo, hi):
        for r0 in range(0, ho, rows):
            yield slice(b, b + 1), r0, min(ho, r0 + rows)


def _tap_rows(xpad: Any, i: int, j: int, r0: int, r1: int, wo: int, stride: tuple[int, int]) -> Any:
    """:func:`tap` for output rows r0..r1 only."""
    sh, sw = stride
    return xpad[:, i + sh * r0:i + sh * (r1 - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw, :]


def _windows(src: Any, r0: int, r1: int, wo: int, kernel: tuple[int, int], stride: tuple[int, int]) -> Any:
    """(r1-r0, wo, kh, kw, C) read-only view of one image's padded input (H, W, C): every kernel window of
    output rows r0..r1, for one ``np.einsum`` over the taps (measured 1.1-2.5x faster than a multiply and
    an add per tap on EfficientNet's tiles, forward and weight gradient)."""
    (kh, kw), (sh, sw) = kernel, stride
    s0, s1, s2 = src.strides
    return np.lib.stride_tricks.as_strided(src[sh * r0:], shape=(r1 - r0, wo, kh, kw, src.shape[2]),
                                           strides=(sh * s0, sw * s1, s0, s1, s2), writeable=False)


def _scratch(xp: Any, buf: Any, like: Any) -> Any:
    """A scratch array shaped like ``like``, carved from ``buf`` when it is large enough."""
    if buf is None or buf.size < like.size:
        return xp.empty_like(like)
    return buf.reshape(-1)[:like.size].reshape(like.shape)


def _unpad(gx: Any, pads: tuple[int, int, int, int], hw: tuple[int, int]) -> Any:
    t, _, l, _ = pads
    if not any(pads):
        return gx
    return gx[:, t:t + hw[0], l:l + hw[1], :]


class Conv2d(Function):
    def __init__(self, stride: int | tuple[int, int], padding: Padding, groups: int):
        self.stride = _pair(stride, "stride")
        self.padding = padding
        self.groups = groups

    def forward(self, x, w, b=None):
        if x.ndim != 4:
            raise ValueError(f"conv2d expects NHWC input with 4 dimensions, got shape {tuple(x.shape)}")
        if w.ndim != 4:
            raise ValueError(f"conv2d expects an OIHW weight with 4 dimensions, got shape {tuple(w.shape)}")
        n, h, wd, c = x.shape
        cout, cg, kh, kw = w.shape
        g = self.groups
        if c != cg * g:
            raise ValueError(f"conv2d: input has {c} channels (NHWC shape {tuple(x.shape)}) but the weight "
                             f"{tuple(w.shape)} with groups={g} expects {cg * g}")
        if cout % g:
            raise ValueError(f"conv2d: {cout} output channels are not divisible by groups={g}")
        pads = resolve_padding(self.padding, (h, wd), (kh, kw), self.stride)
        sh, sw = self.stride
        ho = (h + pads[0] + pads[1] - kh) // sh + 1
        wo = (wd + pads[2] + pads[3] - kw) // sw + 1
        if ho <= 0 or wo <= 0:
            raise ValueError(f"conv2d: a {kh}x{kw} kernel does not fit a {h}x{wd} input with padding {pads}")
        self.pads, self.kernel, self.out_hw, self.in_shape = pads, (kh, kw), (ho, wo), x.shape
        depthwise = g == c and cg == 1 and cout == c
        # On the GPU the im2col/col2im kernels read and drop the padding themselves: no padded copy of x
        pointwise = (kh, kw) == (1, 1) and self.stride == (1, 1)
        self.kernel_pads = pads if any(pads) and not depthwise and not pointwise and gpu.active(
            array_module(x)) else None
        self.padded_shape = (n, h + pads[0] + pads[1], wd + pads[2] + pads[3], c)
        if not depthwise and winograd.applies(x, w, self.stride, pads, g):
            self.mode = "winograd"  # pads the input itself, into its own layout
            y = self._winograd_forward(x, w)
        else:
            xpad = x if self.kernel_pads else pad_nhwc(x, pads)
            self.mode = "depthwise" if depthwise else "dense" if g == 1 else "grouped"
            y = {"depthwise": self._depthwise_forward, "dense": self._dense_forward,
                 "grouped": self._grouped_forward}[self.mode](xpad, w)
        if b is not None:
            def add_bias(lo: int, hi: int) -> None:
                y[lo:hi] += b

            for_rows(array_module(y), y.shape[0], y.size, add_bias)
        return y

    # -- groups == 1: im2col + one matmul ---------------------------------------------------------
    def _dense_forward(self, xpad, w):
        n = xpad.shape[0]
        cout, c, kh, kw = w.shape
        ho, wo = self.out_hw
        if (kh, kw) == (1, 1) and self.stride == (1, 1):
            cols = xpad.reshape(-1, c)
        else:
            cols = im2col(xpad, (kh, kw), self.out_hw, self.stride, self.kernel_pads)
        wmat = w.transpose(2, 3, 1, 0).reshape(kh * kw * c, cout)
        if self.recording:
            self.cols = cols if self.needs_grad[1] else None
            self.wmat = wmat if self.needs_grad[0] else None
        return (cols @ wmat).reshape(n, ho, wo, cout)

    def _dense_backward(self, gy):
        cout = gy.shape[-1]
        gy2 = gy.reshape(-1, cout)
        kh, kw = self.kernel
        c = self.padded_shape[-1]
        gx = gw = None
        if self.needs_grad[1]:
            gw = matmul_tn(self.cols, gy2).reshape(kh, kw, c, cout).transpose(3, 2, 0, 1)
        if self.needs_grad[0]:
            gcols = gy2 @ self.wmat.T
            if (kh, kw) == (1, 1) and self.stride == (1, 1):
                gx = gcols.reshape(self.padded_shape)
            else:
                gx = col2im(gcols, self.padded_shape, self.kernel, self.out_hw, self.stride, self.kernel_pads)
            if self.kernel_pads is None:
                gx = _unpad(gx, self.pads, self.in_shape[1:3])
        return gx, gw

    # -- 3x3 stride 1 pad 1 on NumPy: Winograd F(2x2, 3x3) (engine/ops/winograd.py) -----------------------
    def _winograd_forward(self, x, w):
        u = winograd.transform_filter(w)
        y, padded = winograd.forward(x, u)
        if self.recording:
            self.padded = padded  # the transformed input is made again from it in backward (no columns kept)
            self.u = u
            self.w_shape = w.shape
        return y

    def _winograd_backward(self, gy):
        du, gx = winograd.backward(self.padded, self.u, gy, self.needs_grad[0], self.needs_grad[1])
        gw = winograd.filter_grad(du, self.w_shape) if du is not None else None
        return gx, gw

    # -- depthwise: kh*kw shifted multiply-adds -----------------------------------------------------
    def _depthwise_forward(self, xpad, w):
        xp = array_module(xpad)
        n, c = xpad.shape[0], xpad.shape[3]
        kh, kw = self.kernel
        ho, wo = self.out_hw
        wt = xp.ascontiguousarray(w.reshape(c, kh, kw).transpose(1, 2, 0))  # (kh, kw, c)
        y = xp.empty((n, ho, wo, c), dtype=xpad.dtype)

        def run(lo: int, hi: int) -> None:
            tmp = None
            for b, r0, r1 in _depthwise_tiles(xp, lo, hi, ho, wo * c):
                if xp is np:
                    np.einsum("rwijc,ijc->rwc", _windows(xpad[b.start], r0, r1, wo, self.kernel, self.stride), wt,
                              out=y[b.start, r0:r1])
                    continue
                yy, src = y[b, r0:r1], xpad[b]
                tmp = _scratch(xp, tmp, yy)
                xp.multiply(_tap_rows(src, 0, 0, r0, r1, wo, self.stride), wt[0, 0], out=yy)
                for t in range(1, kh * kw):
                    i, j = divmod(t, kw)
                    xp.multiply(_tap_rows(src, i, j, r0, r1, wo, self.stride), wt[i, j], out=tmp)
                    yy += tmp

        for_rows(xp, n, y.size * kh * kw, run)
        if self.recording:
            self.xpad = xpad if self.needs_grad[1] else None
            self.wt = wt if self.needs_grad[0] else None
        return y

    def _depthwise_backward(self, gy):
        xp = array_module(gy)
        kh, kw = self.kernel
        sh = self.stride[0]
        n, ho, wo, c = gy.shape
        hp = self.padded_shape[1]
        want_x, want_w = self.needs_grad[0], self.needs_grad[1]
        # NumPy, stride 1: the input gradient is itself a depthwise correlation (of gy padded by k-1 with the
        # flipped kernel), computed straight into the unpadded gradient; otherwise taps scatter-add into it
        gather = xp is np and self.stride == (1, 1)
        gxpad = xp.empty(self.padded_shape, dtype=gy.dtype) if want_x and not gather else None
        gx_out = xp.empty(self.in_shape, dtype=gy.dtype) if want_x and gather else None
        flipped = self.wt[::-1, ::-1] if want_x and gather else None

        def run(lo: int, hi: int) -> Any:
            # One pass over row tiles of gy (each stays in cache for all kh*kw taps) gives both gradients.
            # Threads own whole images, so the overlapping input rows of neighbouring tiles are never
            # written by two threads; within an image, rows are zeroed just before a tile first reaches them.
            wide = np.float32 if gy.dtype == np.float16 else gy.dtype  # float16 weight sums accumulate in float32
            part: Any = xp.zeros((kh, kw, c), dtype=wide) if want_w else None
            tmp = None
            zeroed = 0
            for b, r0, r1 in _depthwise_tiles(xp, lo, hi, ho, wo * c):
                gyy = gy[b, r0:r1]
                if xp is np and want_w:
                    part += np.einsum("rwijc,rwc->ijc", _windows(self.xpad[b.start], r0, r1, wo, self.kernel,
                                                                 self.stride), gyy[0])
                if gather:
                    continue
                tmp = _scratch(xp, tmp, gyy)
                if want_x:
                    g = gxpad[b]
                    if r0 == 0:
                        zeroed = 0
                    reach = sh * (r1 - 1) + kh if r1 < ho else hp  # the last tile also clears rows no tap reaches
                    g[:, zeroed:reach] = 0
                    zeroed = reach
                for i in range(kh):
                    for j in range(kw):
                        if want_w and xp is not np:
                            xp.multiply(_tap_rows(self.xpad[b], i, j, r0, r1, wo, self.stride), gyy, out=tmp)
                            part[i, j] += wide_sum(tmp.reshape(-1, c), axis=0)
                        if want_x:
                            xp.multiply(gyy, self.wt[i, j], out=tmp)
                            _tap_rows(g, i, j, r0, r1, wo, self.stride)[...] += tmp
            if want_x and gather:
                h, wd = self.in_shape[1:3]
                t, _, l, _ = self.pads
                for b in range(lo, hi):
                    gyp = np.zeros((ho + 2 * (kh - 1), wo + 2 * (kw - 1), c), dtype=gy.dtype)
                    gyp[kh - 1:kh - 1 + ho, kw - 1:kw - 1 + wo] = gy[b]
                    # gx[p, q] = gxpad[p + t, q + l] = sum_ij gyp[p + t + i, q + l + j] * w[k-1-i, k-1-j]
                    src = gyp[t:, l:]
                    for _, r0, r1 in _depthwise_tiles(xp, 0, 1, h, wd * c):
                        np.einsum("rwijc,ijc->rwc", _windows(src, r0, r1, wd, self.kernel, (1, 1)), flipped,
                                  out=gx_out[b, r0:r1])
            return part

        parts = for_rows(xp, n, gy.size * kh * kw * (want_x + want_w), run)
        gx = gw = None
        if want_w:
            gw = sum_in_order(parts).transpose(2, 0, 1).reshape(c, 1, kh, kw).astype(gy.dtype, copy=False)
        if want_x:
            gx = gx_out if gather else _unpad(gxpad, self.pads, self.in_shape[1:3])
        return gx, gw

    # -- other groupings: one batched matmul over groups ----------------------------------------------
    def _grouped_forward(self, xpad, w):
        xp = array_module(xpad)
        n = xpad.shape[0]
        g = self.groups
        cout, cg, kh, kw = w.shape
        ho, wo = self.out_hw
        m = n * ho * wo
        cols = im2col(xpad, (kh, kw), self.out_hw, self.stride, self.kernel_pads)
        cols = xp.ascontiguousarray(cols.reshape(m, kh * kw, g, cg).transpose(2, 0, 1, 3)).reshape(g, m, kh * kw * cg)
        wg = w.reshape(g, cout // g, cg, kh, kw).transpose(0, 3, 4, 2, 1).reshape(g, kh * kw * cg, cout // g)
        if self.recording:
            self.cols = cols if self.needs_grad[1] else None
            self.wmat = wg if self.needs_grad[0] else None
        y = cols @ wg  # (g, m, cout/g)
        return xp.ascontiguousarray(y.transpose(1, 0, 2)).reshape(n, ho, wo, cout)

    def _grouped_backward(self, gy):
        g = self.groups
        cout = gy.shape[-1]
        kh, kw = self.kernel
        c = self.padded_shape[-1]
        cg = c // g
        gyg = gy.reshape(-1, g, cout // g).transpose(1, 0, 2)  # (g, m, cout/g)
        gx = gw = None
        if self.needs_grad[1]:
            gwg = self.cols.transpose(0, 2, 1) @ gyg  # (g, kh*kw*cg, cout/g)
            gw = gwg.reshape(g, kh, kw, cg, cout // g).transpose(0, 4, 3, 1, 2).reshape(cout, cg, kh, kw)
        if self.needs_grad[0]:
            gcols = gyg @ self.wmat.transpose(0, 2, 1)  # (g, m, kh*kw*cg)
            m = gcols.shape[1]
            gcols = gcols.reshape(g, m, kh * kw, cg).transpose(1, 2, 0, 3).reshape(m, kh * kw * c)
            gx = col2im(gcols, self.padded_shape, self.kernel, self.out_hw, self.stride, self.kernel_pads)
            if self.kernel_pads is None:
                gx = _unpad(gx, self.pads, self.in_shape[1:3])
        return gx, gw

    def backward(self, gy):
        if self.mode == "depthwise":
            gx, gw = self._depthwise_backward(gy)
        elif self.mode == "winograd":
            gx, gw = self._winograd_backward(gy)
        elif self.mode == "dense":
            gx, gw = self._dense_backward(gy)
        else:
            gx, gw = self._grouped_backward(gy)
        if len(self.needs_grad) > 2:
            gb = wide_sum(gy.reshape(-1, gy.shape[-1]), axis=0) if self.needs_grad[2] else None
            return gx, gw, gb
        return gx, gw


def conv2d(x: Any, weight: Any, bias: Any = None, stride: int | tuple[int, int] = 1,
           padding: Padding = 0, groups: int = 1) -> Tensor:
    """Convolve NHWC ``x`` with OIHW ``weight`` (dilation 1); ``padding`` may be asymmetric or 'same'."""
    x, weight = _promoted(x, weight)  # integer inputs take the weight's float dtype, as in add and mul
    x, weight, bias = amp.half_inputs(x, weight, bias)  # float16 under leaflens.engine.amp.autocast()
    fn = Conv2d(stride, padding, groups)
    return fn(x, weight) if bias is None else fn(x, weight, bias)
