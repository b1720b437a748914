"""Each ``*_cuda`` wrapper + ``.cu`` kernel against its NumPy reference.

Runs twice per case: on the CPU emulator (the real kernel source built for the host; always) and on a
real GPU (marked ``gpu``; skipped with the probe's reason where there is none). Tolerances: rtol 1e-4
for float32, looser for float16 (storage rounding), as the kernels accumulate in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.kernels.activation_grad import activation_grad_cuda, activation_grad_reference
from leaflens.kernels.fused_optim import adamw_cuda, adamw_reference, sgd_momentum_cuda, sgd_momentum_reference
from leaflens.kernels.im2col import col2im_cuda, col2im_reference, im2col_cuda, im2col_reference
from leaflens.kernels.l2norm import (
    l2norm_backward_cuda,
    l2norm_backward_reference,
    l2norm_forward_cuda,
    l2norm_forward_reference,
)
from leaflens.kernels.maxpool import (
    maxpool_backward_cuda,
    maxpool_backward_reference,
    maxpool_forward_cuda,
    maxpool_forward_reference,
)
from leaflens.kernels.sgemm import sgemm_cuda, sgemm_reference
from leaflens.kernels.softmax_xent import (
    softmax_xent_backward_cuda,
    softmax_xent_backward_reference,
    softmax_xent_forward_cuda,
    softmax_xent_forward_reference,
)

TOL = {np.float32: dict(rtol=1e-4, atol=1e-6), np.float16: dict(rtol=2e-3, atol=2e-3)}


def close(actual: np.ndarray, expected: np.ndarray, dtype=np.float32, **kw) -> None:
    tol = dict(TOL[np.dtype(dtype).type])
    tol.update(kw)
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), **tol)


# ---- SGEMM ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,k,n", [(70, 33, 65), (1, 1, 1), (64, 16, 64), (5, 0, 3), (3, 40, 130)])
def test_sgemm_matches_reference(backend, m, k, n):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = backend.get(sgemm_cuda(backend.put(a), backend.put(b)))
    close(c, sgemm_reference(a, b), atol=1e-5)


def test_sgemm_rejects_bad_arguments(backend):
    a = backend.put(np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match="inner dimensions"):
        sgemm_cuda(a, backend.put(np.ones((4, 2), np.float32)))
    with pytest.raises(TypeError, match="b has dtype float64"):
        sgemm_cuda(a, backend.put(np.ones((3, 2), np.float64)))
    with pytest.raises(ValueError, match="C-contiguous"):
        sgemm_cuda(a, backend.put(np.ones((2, 3), np.float32)).T)
    with pytest.raises(TypeError, match="must be a"):
        sgemm_cuda(a, [[1.0]])


# ---- softmax + cross-entropy ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n,c,smoothing", [(7, 3, 0.0), (5, 300, 0.1), (3, 1, 0.0), (4, 1000, 0.0)])
def test_softmax_xent_hard_targets(backend, dtype, n, c, smoothing):
    rng = np.random.default_rng(n + c)
    logits = (rng.standard_normal((n, c)) * 4 + 30).astype(dtype)  # offset: stability needs the max shift
    targets = rng.integers(0, c, size=n).astype(np.int64)
    loss, stats = softmax_xent_forward_cuda(backend.put(logits), backend.put(targets), label_smoothing=smoothing)
    ref_loss, ref_stats = softmax_xent_forward_reference(logits, targets, label_smoothing=smoothing)
    close(backend.get(stats), ref_stats)
    close(float(backend.get(loss)), ref_loss, atol=1e-5)
    grad = backend.put(np.array(0.5, np.float32))
    d = softmax_xent_backward_cuda(backend.put(logits), backend.put(targets), stats, grad, smoothing)
    assert backend.get(d).dtype == dtype
    ref_d = softmax_xent_backward_reference(logits, targets, ref_stats, 0.5, smoothing)
    close(backend.get(d), ref_d, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softmax_xent_soft_targets(backend, dtype):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 37)).astype(dtype)
    q = rng.random((6, 37)).astype(np.float32)
    q[:3] /= q[:3].sum(axis=1, keepdims=True)  # half the rows sum to one, half do not
    loss, stats = softmax_xent_forward_cuda(backend.put(logits), backend.put(q))
    ref_loss, ref_stats = softmax_xent_forward_reference(logits, q)
    close(float(backend.get(loss)), ref_loss)
    close(backend.get(stats), ref_stats)
    d = softmax_xent_backward_cuda(backend.put(logits), backend.put(q), stats, 1.0)
    close(backend.get(d), softmax_xent_backward_reference(logits, q, ref_stats, 1.0), dtype)


def test_softmax_xent_bad_targets(backend):
    logits = backend.put(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="outside"):
        softmax_xent_forward_cuda(logits, backend.put(np.array([0, 3], np.int64)))
    # Without validation the kernel must not read out of bounds: the row loss becomes NaN.
    loss, _ = softmax_xent_forward_cuda(logits, backend.put(np.array([0, 3], np.int64)), validate=False)
    assert np.isnan(float(backend.get(loss)))
    with pytest.raises(TypeError, match="int64 class indices"):
        softmax_xent_forward_cuda(logits, backend.put(np.array([0, 1], np.int32)))
    with pytest.raises(ValueError, match="soft targets must have shape"):
        softmax_xent_forward_cuda(logits, backend.put(np.zeros((2, 4), np.float32)))


# ---- activation gradients ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kind", ["relu", "leaky_relu", "relu6"])
def test_activation_grad(backend, kind, dtype):
    rng = np.random.default_rng(11)
    y = (rng.standard_normal((3, 5, 7, 11)) * 4).astype(dtype)
    y.flat[:6] = [0.0, 6.0, -0.0, 5.999, 1e-3, -1e-3]  # mask boundaries
    if kind != "leaky_relu":
        y = np.maximum(y, 0).astype(dtype)  # a ReLU output is never negative
    if kind == "relu6":
        y = np.minimum(y, 6).astype(dtype)
    gy = rng.standard_normal(y.shape).astype(dtype)
    gx = activation_grad_cuda(kind, backend.put(y), backend.put(gy), slope=0.2)
    np.testing.assert_array_equal(backend.get(gx), activation_grad_reference(kind, y, gy, slope=0.2))


def test_activation_grad_large_grid(backend):
    # More elements than one grid-stride pass covers at the capped block count would be slow to
    # emulate; 3 blocks with a ragged tail still exercise the loop bound.
    y = np.linspace(-1, 1, 700, dtype=np.float32)
    gy = np.ones_like(y)
    gx = backend.get(activation_grad_cuda("relu", backend.put(y), backend.put(gy)))
    np.testing.assert_array_equal(gx, (y > 0).astype(np.float32))


# ---- L2 normalisation ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(5, 3), (4, 300), (2, 3, 40)])
def test_l2norm(backend, dtype, shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(dtype)
    x.reshape(-1, shape[-1])[0] = 0  # a zero row: clamped branch
    x.reshape(-1, shape[-1])[1] *= 1e-4
    eps = 1e-3
    y, norm = l2norm_forward_cuda(backend.put(x), eps)
    ref_y, ref_norm = l2norm_forward_reference(x, eps)
    close(backend.get(norm), ref_norm, dtype)
    close(backend.get(y), ref_y, dtype)
    gy = rng.standard_normal(shape).astype(dtype)
    gx = l2norm_backward_cuda(backend.put(ref_y), backend.put(gy), backend.put(ref_norm), eps)
    close(backend.get(gx), l2norm_backward_reference(ref_y, gy, ref_norm, eps), dtype, atol=5e-3)


# ---- im2col / col2im -----------------------------------------------------------------------------
GEOMETRIES = [
    # (N, H, W, C), kernel, stride, padding (top, bottom, left, right)
    ((2, 5, 6, 3), (3, 3), (1, 1), (1, 1, 1, 1)),
    ((1, 7, 5, 2), (3, 2), (2, 1), (0, 1, 1, 0)),  # asymmetric, TF "same"-style
    ((2, 4, 4, 5), (1, 1), (1, 1), (0, 0, 0, 0)),
    ((1, 9, 8, 1), (5, 5), (3, 2), (2, 2, 2, 2)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape,kernel,stride,padding", GEOMETRIES)
def test_im2col_col2im(backend, dtype, shape, kernel, stride, padding):
    rng = np.random.default_rng(shape[1] * 10 + kernel[0])
    x = rng.standard_normal(shape).astype(dtype)
    cols = im2col_cuda(backend.put(x), kernel, stride, padding)
    ref_cols = im2col_reference(x, kernel, stride, padding)
    np.testing.assert_array_equal(backend.get(cols), ref_cols)  # a pure copy: exact
    g = rng.standard_normal(ref_cols.shape).astype(dtype)
    gx = col2im_cuda(backend.put(g), shape, kernel, stride, padding)
    close(backend.get(gx), col2im_reference(g, shape, kernel, stride, padding), dtype)


# ---- max-pool ------------------------------------------------------------------------------------
POOLS = [
    ((2, 6, 6, 3), (2, 2), (2, 2), (0, 0, 0, 0)),
    ((1, 7, 5, 4), (3, 3), (2, 2), (1, 1, 1, 1)),  # overlapping windows
    ((2, 5, 5, 2), (3, 3), (1, 1), (0, 2, 1, 1)),  # asymmetric padding, stride 1
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape,kernel,stride,padding", POOLS)
def test_maxpool(backend, dtype, shape, kernel, stride, padding):
    rng = np.random.default_rng(shape[1] + kernel[0])
    x = rng.integers(-3, 4, size=shape).astype(dtype)  # small integers: many ties
    x[0, 0, 0, 0] = -np.inf
    y, idx = maxpool_forward_cuda(backend.put(x), kernel, stride, padding)
    ref_y, ref_idx = maxpool_forward_reference(x, kernel, stride, padding)
    np.testing.assert_array_equal(backend.get(y), ref_y)
    np.testing.assert_array_equal(backend.get(idx), ref_idx)
    gy = rng.standard_normal(ref_y.shape).astype(dtype)
    gx = maxpool_backward_cuda(backend.put(gy), idx, shape, kernel, stride, padding)
    close(backend.get(gx), maxpool_backward_reference(gy, ref_idx, shape, kernel, stride, padding), dtype)


def test_maxpool_nan_and_all_padding(backend):
    x = np.zeros((1, 3, 3, 2), np.float32)
    x[0, 1, 1, 0] = np.nan
    x[0, 0, 0, 1] = 5.0
    y, idx = maxpool_forward_cuda(backend.put(x), (2, 2), (1, 1), (1, 0, 1, 0))
    ref_y, ref_idx = maxpool_forward_reference(x, (2, 2), (1, 1), (1, 0, 1, 0))
    np.testing.assert_array_equal(backend.get(y), ref_y)
    np.testing.assert_array_equal(backend.get(idx), ref_idx)


# ---- fused optimisers ----------------------------------------------------------------------------
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_steps(backend, nesterov):
    rng = np.random.default_rng(5)
    n = 1000
    p = rng.standard_normal(n).astype(np.float32)
    buf = np.zeros(n, np.float32)
    dp, dbuf = backend.put(p), backend.put(buf)
    for _ in range(3):
        g = rng.standard_normal(n).astype(np.float32)
        kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=nesterov, grad_scale=0.5)
        sgd_momentum_cuda(dp, backend.put(g), dbuf, **kw)
        sgd_momentum_reference(p, g, buf, **kw)
    close(backend.get(dp), p)
    close(backend.get(dbuf), buf)


def test_adamw_steps(backend):
    rng = np.random.default_rng(6)
    n = 777
    p = rng.standard_normal(n).astype(np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    dp, dm, dv = backend.put(p), backend.put(m), backend.put(v)
    for step in range(1, 5):
        g = rng.standard_normal(n).astype(np.float32)
        kw = dict(step=step, lr=1e-2, weight_decay=0.1, grad_scale=1 / 128)
        adamw_cuda(dp, backend.put(g * 128), dm, dv, **kw)
        adamw_reference(p, g * 128, m, v, **kw)
    close(backend.get(dm), m)
    close(backend.get(dv), v, rtol=2e-4)
    close(backend.get(dp), p)


def test_optimiser_rejects_mismatched_buffers(backend):
    p = backend.put(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="momentum_buffer has 3 elements"):
        sgd_momentum_cuda(p, backend.put(np.zeros(4, np.float32)), backend.put(np.zeros(3, np.float32)), lr=0.1)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        z = backend.put(np.zeros(4, np.float32))
        adamw_cuda(p, z, z, z, step=0, lr=0.1)
