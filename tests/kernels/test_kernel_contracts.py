"""The engine's CPU functions that define each CUDA kernel's maths, against maths written independently
of them (explicit loops over tiny inputs, textbook formulas, finite differences). These always run;
they pin down the contract that tests/kernels/test_kernel_launch.py then holds the kernels to."""

from __future__ import annotations

import math

import numpy as np
import pytest

from leaflens.engine import ops
from leaflens.engine.nn.module import Parameter
from leaflens.engine.ops.conv import col2im, im2col, pad_nhwc
from leaflens.engine.optim import SGD, AdamW
from leaflens.engine.tensor import Tensor
from leaflens.kernels.im2col import conv_output_size


def _xent(z: np.ndarray, targets: np.ndarray, smoothing: float = 0.0, grad: float = 1.0) -> tuple[float, np.ndarray]:
    """(loss, gradient for upstream ``grad``) of the engine's cross_entropy."""
    zt = Tensor(z, requires_grad=True)
    loss = ops.cross_entropy(zt, targets, label_smoothing=smoothing)
    loss.backward(np.asarray(grad, z.dtype))
    return float(loss.data), zt.grad


def _im2col(x: np.ndarray, kernel, stride, pads) -> np.ndarray:
    return im2col(pad_nhwc(x, pads), kernel, conv_output_size(x.shape[1], x.shape[2], kernel, stride, pads), stride)


def _col2im(cols: np.ndarray, shape, kernel, stride, pads) -> np.ndarray:
    (n, h, w, c), (pt, pb, pl, pr) = shape, pads
    gx = col2im(cols, (n, h + pt + pb, w + pl + pr, c), kernel, conv_output_size(h, w, kernel, stride, pads), stride)
    return gx[:, pt:pt + h, pl:pl + w, :]


# ---- cross-entropy -------------------------------------------------------------------------------
def _loss_by_formula(z: np.ndarray, q: np.ndarray) -> float:
    total = 0.0
    for row, qrow in zip(z.astype(np.float64), q.astype(np.float64)):
        log_softmax = [v - math.log(sum(math.exp(u) for u in row)) for v in row]
        total += -sum(qi * li for qi, li in zip(qrow, log_softmax))
    return total / len(z)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_xent_hard_targets(smoothing):
    rng = np.random.default_rng(1)
    z = rng.standard_normal((5, 4))
    t = np.array([0, 3, 1, 1, 2], np.int64)
    q = np.full((5, 4), smoothing / 4)
    q[np.arange(5), t] += 1 - smoothing
    loss, grad = _xent(z, t, smoothing, grad=2.0)
    assert loss == pytest.approx(_loss_by_formula(z, q), rel=1e-12)
    # gradient by central differences of the formula (float64 all the way)
    h = 1e-6
    for i, j in [(0, 0), (1, 3), (4, 1)]:
        zp, zm = z.copy(), z.copy()
        zp[i, j] += h
        zm[i, j] -= h
        fd = 2.0 * (_loss_by_formula(zp, q) - _loss_by_formula(zm, q)) / (2 * h)
        assert grad[i, j] == pytest.approx(fd, rel=1e-6, abs=1e-9)


def test_xent_soft_targets_not_summing_to_one():
    rng = np.random.default_rng(2)
    z = rng.standard_normal((3, 6))
    q = rng.random((3, 6))  # rows do not sum to one: the gradient must still be exact
    loss, grad = _xent(z, q)
    assert loss == pytest.approx(_loss_by_formula(z, q), rel=1e-12)
    h = 1e-6
    zp, zm = z.copy(), z.copy()
    zp[2, 4] += h
    zm[2, 4] -= h
    fd = (_loss_by_formula(zp, q) - _loss_by_formula(zm, q)) / (2 * h)
    assert grad[2, 4] == pytest.approx(fd, rel=1e-6)


def test_xent_is_stable_for_huge_logits():
    z = np.array([[1000.0, 0.0, -1000.0]], np.float32)
    loss, grad = _xent(z, np.array([1], np.int64))
    assert loss == pytest.approx(1000.0)
    assert np.isfinite(grad).all()
    with pytest.raises(ValueError, match=r"target class 3 is outside \[0, 3\)"):
        _xent(z, np.array([3], np.int64))


# ---- activations ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "op,forward",
    [
        (ops.relu, lambda x: np.maximum(x, 0)),
        (lambda v: ops.leaky_relu(v, 0.1), lambda x: np.where(x > 0, x, 0.1 * x)),
        (ops.relu6, lambda x: np.clip(x, 0, 6)),
    ],
)
def test_activation_grad_is_the_derivative(op, forward):
    x = np.array([-3.0, -0.5, 0.25, 2.0, 5.5, 6.5, 9.0])  # away from the kinks
    gy = np.linspace(1.0, 2.0, x.size)
    h = 1e-6
    derivative = (forward(x + h) - forward(x - h)) / (2 * h)
    xt = Tensor(x, requires_grad=True)
    y = op(xt)
    np.testing.assert_array_equal(y.data, forward(x))
    y.backward(gy)
    np.testing.assert_allclose(xt.grad, gy * derivative, rtol=1e-6)


# ---- L2 normalisation ----------------------------------------------------------------------------
def test_l2norm_forward_and_gradient():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5))
    x[2] = 1e-9  # below eps: clamped
    eps = 1e-6
    xt = Tensor(x, requires_grad=True)
    y = ops.l2_normalize(xt, axis=-1, eps=eps)
    for r in range(3):
        n = math.sqrt(sum(v * v for v in x[r]))
        np.testing.assert_allclose(y.data[r], x[r] / max(n, eps))
    gy = rng.standard_normal((3, 5))
    y.backward(gy)
    gx = xt.grad

    def f(xx: np.ndarray) -> float:
        return float(np.sum(ops.l2_normalize(Tensor(xx), axis=-1, eps=eps).data * gy))

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
def test_im2col_gives_convolution(shape, kernel, stride, pads):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((4, shape[3], *kernel))
    cols = _im2col(x, kernel, stride, pads)
    ho, wo = conv_output_size(shape[1], shape[2], kernel, stride, pads)
    y = (cols @ w.transpose(2, 3, 1, 0).reshape(-1, 4)).reshape(shape[0], ho, wo, 4)
    np.testing.assert_allclose(y, _conv_by_loops(x, w, stride, pads), rtol=1e-10, atol=1e-12)


def test_col2im_is_the_adjoint():
    rng = np.random.default_rng(8)
    shape, kernel, stride, pads = (2, 7, 6, 3), (3, 3), (2, 1), (1, 0, 2, 1)
    x = rng.standard_normal(shape)
    cols = _im2col(x, kernel, stride, pads)
    c = rng.standard_normal(cols.shape)
    # <im2col(x), c> == <x, col2im(c)> for every x and c
    assert np.sum(cols * c) == pytest.approx(np.sum(x * _col2im(c, shape, kernel, stride, pads)), rel=1e-12)
    # and explicitly: each input pixel receives the sum of the column entries copied from it
    gx = _col2im(c, shape, kernel, stride, pads)
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
def test_maxpool_against_loops():
    rng = np.random.default_rng(9)
    x = rng.integers(-2, 3, size=(2, 5, 6, 2)).astype(np.float32)  # many ties
    kernel, stride, pads = (3, 2), (2, 2), (1, 1, 0, 1)
    xt = Tensor(x, requires_grad=True)
    yt = ops.max_pool2d(xt, kernel, stride, pads)
    y = yt.data
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
                    i, j = divmod(arg, 2)
                    hh, ww = oh * 2 - 1 + i, ow * 2 + j
                    if 0 <= hh < 5 and 0 <= ww < 6:
                        gx_want[b, hh, ww, ch] += gy[b, oh, ow, ch]
    yt.backward(gy)  # the gradient goes to the first maximum of each window (the kernel's tap index)
    np.testing.assert_allclose(xt.grad, gx_want, rtol=1e-6)


def test_maxpool_window_must_fit():
    with pytest.raises(ValueError, match="does not fit"):
        ops.max_pool2d(Tensor(np.zeros((1, 2, 2, 1), np.float32)), (3, 3))


# ---- optimisers ----------------------------------------------------------------------------------
def test_sgd_against_step_loop():
    rng = np.random.default_rng(10)
    p0 = rng.standard_normal(6).astype(np.float32)
    grads = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
    for nesterov in (False, True):
        param = Parameter(p0.copy())
        opt = SGD([param], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
        for g in grads:
            param.grad = g.copy()
            opt.step()
        p = param.data
        # PyTorch's documented algorithm, element by element in float64; the buffer starts as d_1
        for e in range(6):
            pe, b = float(p0[e]), None
            for g in grads:
                d = float(g[e]) + 0.01 * pe
                b = d if b is None else 0.9 * b + d
                pe -= 0.1 * (d + 0.9 * b if nesterov else b)
            assert p[e] == pytest.approx(pe, rel=1e-5, abs=1e-6)


def test_adamw_against_step_loop():
    rng = np.random.default_rng(11)
    p0 = rng.standard_normal(5).astype(np.float32)
    grads = [rng.standard_normal(5).astype(np.float32) for _ in range(4)]
    param = Parameter(p0.copy())
    opt = AdamW([param], lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for g in grads:
        param.grad = g.copy()
        opt.step()
    p = param.data
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
