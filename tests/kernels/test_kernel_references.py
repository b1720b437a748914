"""Each NumPy reference twin against maths written independently of it (explicit loops over tiny
inputs, textbook formulas, finite differences). These always run; they pin down the contract that the
CUDA kernels are then tested against."""

from __future__ import annotations

import math

import numpy as np
import pytest

from leaflens.kernels.activation_grad import activation_grad_reference
from leaflens.kernels.fused_optim import adamw_reference, sgd_momentum_reference
from leaflens.kernels.im2col import col2im_reference, conv_output_size, im2col_reference
from leaflens.kernels.l2norm import l2norm_backward_reference, l2norm_forward_reference
from leaflens.kernels.maxpool import maxpool_backward_reference, maxpool_forward_reference
from leaflens.kernels.sgemm import sgemm_reference
from leaflens.kernels.softmax_xent import softmax_xent_backward_reference, softmax_xent_forward_reference


def test_sgemm_reference_against_triple_loop():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal((3, 5)).astype(np.float32)
    want = np.zeros((4, 5))
    for i in range(4):
        for j in range(5):
            want[i, j] = sum(float(a[i, k]) * float(b[k, j]) for k in range(3))
    got = sgemm_reference(a, b)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="do not multiply"):
        sgemm_reference(a, a)


# ---- cross-entropy -------------------------------------------------------------------------------
def _loss_by_formula(z: np.ndarray, q: np.ndarray) -> float:
    total = 0.0
    for row, qrow in zip(z.astype(np.float64), q.astype(np.float64)):
        log_softmax = [v - math.log(sum(math.exp(u) for u in row)) for v in row]
        total += -sum(qi * li for qi, li in zip(qrow, log_softmax))
    return total / len(z)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_xent_reference_hard_targets(smoothing):
    rng = np.random.default_rng(1)
    z = rng.standard_normal((5, 4))
    t = np.array([0, 3, 1, 1, 2], np.int64)
    q = np.full((5, 4), smoothing / 4)
    q[np.arange(5), t] += 1 - smoothing
    loss, stats = softmax_xent_forward_reference(z, t, label_smoothing=smoothing)
    assert float(loss) == pytest.approx(_loss_by_formula(z, q), rel=1e-12)
    np.testing.assert_allclose(stats[:, 0], np.log(np.exp(z).sum(axis=1)), rtol=1e-12)
    np.testing.assert_allclose(stats[:, 1], 1.0, rtol=1e-12)
    # gradient by central differences of the formula (float64 all the way)
    grad = softmax_xent_backward_reference(z, t, stats, grad=2.0, label_smoothing=smoothing)
    h = 1e-6
    for i, j in [(0, 0), (1, 3), (4, 1)]:
        zp, zm = z.copy(), z.copy()
        zp[i, j] += h
        zm[i, j] -= h
        fd = 2.0 * (_loss_by_formula(zp, q) - _loss_by_formula(zm, q)) / (2 * h)
        assert grad[i, j] == pytest.approx(fd, rel=1e-6, abs=1e-9)


def test_xent_reference_soft_targets_not_summing_to_one():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((3, 6))
    q = rng.random((3, 6))  # rows do not sum to one: the gradient must still be exact
    loss, stats = softmax_xent_forward_reference(z, q)
    assert float(loss) == pytest.approx(_loss_by_formula(z, q), rel=1e-12)
    grad = softmax_xent_backward_reference(z, q, stats)
    h = 1e-6
    zp, zm = z.copy(), z.copy()
    zp[2, 4] += h
    zm[2, 4] -= h
    fd = (_loss_by_formula(zp, q) - _loss_by_formula(zm, q)) / (2 * h)
    assert grad[2, 4] == pytest.approx(fd, rel=1e-6)


def test_xent_reference_is_stable_for_huge_logits():
    z = np.array([[1000.0, 0.0, -1000.0]], np.float32)
    loss, stats = softmax_xent_forward_reference(z, np.array([1], np.int64))
    assert float(loss) == pytest.approx(1000.0)
    assert np.isfinite(stats).all()
    with pytest.raises(ValueError, match="out of range"):
        softmax_xent_forward_reference(z, np.array([3], np.int64))


# ---- activations ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind,forward",
    [
        ("relu", lambda x: np.maximum(x, 0)),
        ("leaky_relu", lambda x: np.where(x > 0, x, 0.1 * x)),
        ("relu6", lambda x: np.clip(x, 0, 6)),
    ],
)
def test_activation_grad_reference_is_the_derivative(kind, forward):
    x = np.array([-3.0, -0.5, 0.25, 2.0, 5.5, 6.5, 9.0])  # away from the kinks
    gy = np.linspace(1.0, 2.0, x.size)
    h = 1e-6
    derivative = (forward(x + h) - forward(x - h)) / (2 * h)
    got = activation_grad_reference(kind, forward(x), gy, slope=0.1)
    np.testing.assert_allclose(got, gy * derivative, rtol=1e-6)


def test_activation_grad_reference_masks_nonfinite_upstream():
    y = np.array([0.0, 1.0], np.float32)
    gy = np.array([np.inf, 2.0], np.float32)
    np.testing.assert_array_equal(activation_grad_reference("relu", y, gy), [0.0, 2.0])
    with pytest.raises(ValueError, match="slope must be > 0"):
        activation_grad_reference("leaky_relu", y, gy, slope=0.0)


# ---- L2 normalisation ----------------------------------------------------------------------------
def test_l2norm_reference_forward_and_gradient():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5))
    x[2] = 1e-9  # below eps: clamped
    eps = 1e-6
    y, norm = l2norm_forward_reference(x, eps)
    for r in range(3):
        n = math.sqrt(sum(v * v for v in x[r]))
        assert norm[r] == pytest.approx(n)
        np.testing.assert_allclose(y[r], x[r] / max(n, eps))
    gy = rng.standard_normal((3, 5))
    gx = l2norm_backward_reference(y, gy, norm, eps)

    def f(xx: np.ndarray) -> float:
        return float(np.sum(l2norm_forward_reference(xx, eps)[0] * gy))

    h = 1e-7
    for r, c in [(0, 1), (1, 4), (2, 2)]:
        xp, xm = x.copy(), x.copy()
        xp[r, c] += h * max(1.0, abs(x[r, c]))
        xm[r, c] -= h * max(1.0, abs(x[r, c]))
        fd = (f(xp) - f(xm)) / (xp[r, c] - xm[r, c])
        assert gx[r, c] == pytest.approx(fd, rel=1e-5, abs=1e-7)


# ---- im2col / col2im -----------------------------------------------------------------------------
def _conv_by_loops(x, w, stride, pads):
    """Direct NHWC convolution with an OIHW weight, by the definition."""
    n, h, wd, c = x.shape
    cout, _, kh, kw = w.shape
    (sh, sw), (pt, pb, pl, pr) = stride, pads
    ho, wo = (h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1
    y = np.zeros((n, ho, wo, cout))
    for b in range(n):
        for oh in range(ho):
            for ow in range(wo):
                for o in range(cout):
                    acc = 0.0
                    for i in range(kh):
                        for j in range(kw):
                            hh, ww = oh * sh - pt + i, ow * sw - pl + j
                            if 0 <= hh < h and 0 <= ww < wd:
                                acc += float(np.dot(x[b, hh, ww, :], w[o, :, i, j]))
                    y[b, oh, ow, o] = acc
    return y


@pytest.mark.parametrize(
    "shape,kernel,stride,pads",
    [((2, 5, 4, 3), (3, 3), (1, 1), (1, 1, 1, 1)), ((1, 6, 7, 2), (2, 3), (2, 2), (0, 1, 1, 1))],
)
def test_im2col_reference_gives_convolution(shape, kernel, stride, pads):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((4, shape[3], *kernel))
    cols = im2col_reference(x, kernel, stride, pads)
    ho, wo = conv_output_size(shape[1], shape[2], kernel, stride, pads)
    y = (cols @ w.transpose(2, 3, 1, 0).reshape(-1, 4)).reshape(shape[0], ho, wo, 4)
    np.testing.assert_allclose(y, _conv_by_loops(x, w, stride, pads), rtol=1e-10, atol=1e-12)


def test_col2im_reference_is_the_adjoint():
    rng = np.random.default_rng(8)
    shape, kernel, stride, pads = (2, 7, 6, 3), (3, 3), (2, 1), (1, 0, 2, 1)
    x = rng.standard_normal(shape)
    cols = im2col_reference(x, kernel, stride, pads)
    c = rng.standard_normal(cols.shape)
    # <im2col(x), c> == <x, col2im(c)> for every x and c
    assert np.sum(cols * c) == pytest.approx(np.sum(x * col2im_reference(c, shape, kernel, stride, pads)), rel=1e-12)
    # and explicitly: each input pixel receives the sum of the column entries copied from it
    gx = col2im_reference(c, shape, kernel, stride, pads)
    ho, wo = conv_output_size(7, 6, kernel, stride, pads)
    want = np.zeros(shape)
    for m in range(cols.shape[0]):
        b, rest = divmod(m, ho * wo)
        oh, ow = divmod(rest, wo)
        for k in range(cols.shape[1]):
            tap, ch = divmod(k, 3)
            i, j = divmod(tap, 3)
            hh, ww = oh * 2 - 1 + i, ow - 2 + j
            if 0 <= hh < 7 and 0 <= ww < 6:
                want[b, hh, ww, ch] += c[m, k]
    np.testing.assert_allclose(gx, want, rtol=1e-12, atol=1e-12)


# ---- max-pool ------------------------------------------------------------------------------------
def test_maxpool_reference_against_loops():
    rng = np.random.default_rng(9)
    x = rng.integers(-2, 3, size=(2, 5, 6, 2)).astype(np.float32)  # many ties
    kernel, stride, pads = (3, 2), (2, 2), (1, 1, 0, 1)
    y, idx = maxpool_forward_reference(x, kernel, stride, pads)
    ho, wo = conv_output_size(5, 6, kernel, stride, pads)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    gx_want = np.zeros(x.shape, np.float32)
    for b in range(2):
        for oh in range(ho):
            for ow in range(wo):
                for ch in range(2):
                    best, arg = -np.inf, 0
                    for t in range(6):
                        i, j = divmod(t, 2)
                        hh, ww = oh * 2 - 1 + i, ow * 2 + j
                        v = x[b, hh, ww, ch] if 0 <= hh < 5 and 0 <= ww < 6 else -np.inf
                        if v > best:  # strictly greater: the first maximum wins
                            best, arg = v, t
                    assert y[b, oh, ow, ch] == best
                    assert idx[b, oh, ow, ch] == arg
                    i, j = divmod(arg, 2)
                    hh, ww = oh * 2 - 1 + i, ow * 2 + j
                    if 0 <= hh < 5 and 0 <= ww < 6:
                        gx_want[b, hh, ww, ch] += gy[b, oh, ow, ch]
    np.testing.assert_allclose(maxpool_backward_reference(gy, idx, x.shape, kernel, stride, pads), gx_want, rtol=1e-6)


def test_maxpool_reference_limits():
    with pytest.raises(ValueError, match="uint8"):
        maxpool_forward_reference(np.zeros((1, 20, 20, 1), np.float32), (17, 17))
    with pytest.raises(ValueError, match="does not fit"):
        maxpool_forward_reference(np.zeros((1, 2, 2, 1), np.float32), (3, 3))


# ---- optimisers ----------------------------------------------------------------------------------
def test_sgd_reference_against_step_loop():
    rng = np.random.default_rng(10)
    p0 = rng.standard_normal(6).astype(np.float32)
    grads = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
    for nesterov in (False, True):
        p, buf = p0.copy(), np.zeros(6, np.float32)
        for g in grads:
            sgd_momentum_reference(p, g, buf, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
        # PyTorch's documented algorithm, element by element in float64; the buffer starts as d_1
        for e in range(6):
            pe, b = float(p0[e]), None
            for g in grads:
                d = float(g[e]) + 0.01 * pe
                b = d if b is None else 0.9 * b + d
                pe -= 0.1 * (d + 0.9 * b if nesterov else b)
            assert p[e] == pytest.approx(pe, rel=1e-5, abs=1e-6)


def test_adamw_reference_against_step_loop():
    rng = np.random.default_rng(11)
    p0 = rng.standard_normal(5).astype(np.float32)
    grads = [rng.standard_normal(5).astype(np.float32) for _ in range(4)]
    p, m, v = p0.copy(), np.zeros(5, np.float32), np.zeros(5, np.float32)
    for t, g in enumerate(grads, start=1):
        adamw_reference(p, g, m, v, step=t, lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1)
    for e in range(5):
        pe, me, ve = float(p0[e]), 0.0, 0.0
        for t, g in enumerate(grads, start=1):
            ge = float(g[e])
            pe *= 1 - 0.01 * 0.1
            me = 0.8 * me + 0.2 * ge
            ve = 0.99 * ve + 0.01 * ge * ge
            mhat, vhat = me / (1 - 0.8**t), ve / (1 - 0.99**t)
            pe -= 0.01 * mhat / (math.sqrt(vhat) + 1e-6)
        assert p[e] == pytest.approx(pe, rel=1e-5, abs=1e-6)


def test_grad_scale_equals_prescaled_gradient():
    rng = np.random.default_rng(12)
    g = rng.standard_normal(8).astype(np.float32)
    p1, b1 = np.ones(8, np.float32), np.zeros(8, np.float32)
    p2, b2 = np.ones(8, np.float32), np.zeros(8, np.float32)
    sgd_momentum_reference(p1, g * 256, b1, lr=0.1, grad_scale=1 / 256)
    sgd_momentum_reference(p2, g, b2, lr=0.1)
    np.testing.assert_allclose(p1, p2, rtol=1e-6)
    with pytest.raises(ValueError, match="Nesterov"):
        sgd_momentum_reference(p1, g, b1, lr=0.1, momentum=0.0, nesterov=True)
