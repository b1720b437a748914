"""The NumPy twins against the engine's plain CPU ops: the kernels must compute what the engine's CPU
path computes, so swapping one for the other on the GPU changes nothing but speed."""

from __future__ import annotations

import numpy as np
import pytest

ops = pytest.importorskip("leaflens.engine.ops", reason="engine ops not built in this checkout")
from leaflens.engine.nn.module import Parameter  # noqa: E402
from leaflens.engine.optim import SGD, Adam, AdamW  # noqa: E402
from leaflens.engine.tensor import Tensor  # noqa: E402
from leaflens.kernels.activation_grad import activation_grad_reference  # noqa: E402
from leaflens.kernels.fused_optim import adamw_reference, sgd_momentum_reference  # noqa: E402
from leaflens.kernels.im2col import col2im_reference, im2col_reference  # noqa: E402
from leaflens.kernels.l2norm import l2norm_backward_reference, l2norm_forward_reference  # noqa: E402
from leaflens.kernels.maxpool import maxpool_backward_reference, maxpool_forward_reference  # noqa: E402
from leaflens.kernels.softmax_xent import softmax_xent_backward_reference, softmax_xent_forward_reference  # noqa: E402

F32 = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stride,pads", [((1, 1), (1, 1, 1, 1)), ((2, 2), (0, 1, 0, 1)), ((2, 1), (1, 0, 2, 0))])
def test_conv_via_im2col_matches_engine_conv2d(stride, pads):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 6, 3)).astype(np.float32)
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    xt = Tensor(x, requires_grad=True)
    y = ops.conv2d(xt, Tensor(w), stride=stride, padding=pads)
    cols = im2col_reference(x, (3, 3), stride, pads)
    wmat = w.transpose(2, 3, 1, 0).reshape(-1, 5)
    np.testing.assert_allclose(cols @ wmat, y.data.reshape(-1, 5), **F32)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    y.backward(gy)
    gx = col2im_reference(gy.reshape(-1, 5) @ wmat.T, x.shape, (3, 3), stride, pads)
    np.testing.assert_allclose(gx, xt.grad, **F32)


@pytest.mark.parametrize("kernel,stride,pads", [((2, 2), (2, 2), (0, 0, 0, 0)), ((3, 3), (2, 2), (1, 1, 1, 1))])
def test_maxpool_matches_engine(kernel, stride, pads):
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 4, size=(2, 7, 7, 3)).astype(np.float32)  # ties: both pick the first tap
    xt = Tensor(x, requires_grad=True)
    y = ops.max_pool2d(xt, kernel, stride, pads)
    ref_y, idx = maxpool_forward_reference(x, kernel, stride, pads)
    np.testing.assert_array_equal(ref_y, y.data)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    y.backward(gy)
    np.testing.assert_allclose(maxpool_backward_reference(gy, idx, x.shape, kernel, stride, pads), xt.grad, **F32)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_engine(smoothing):
    rng = np.random.default_rng(2)
    z = rng.standard_normal((6, 5)).astype(np.float32) * 3
    t = rng.integers(0, 5, size=6).astype(np.int64)
    zt = Tensor(z, requires_grad=True)
    loss = ops.cross_entropy(zt, t, label_smoothing=smoothing)
    ref_loss, stats = softmax_xent_forward_reference(z, t, label_smoothing=smoothing)
    assert float(ref_loss) == pytest.approx(float(loss.data), rel=1e-5)
    loss.backward(np.float32(0.7))
    ref_grad = softmax_xent_backward_reference(z, t, stats, 0.7, smoothing)
    np.testing.assert_allclose(ref_grad, zt.grad, **F32)


def test_soft_target_cross_entropy_matches_engine():
    rng = np.random.default_rng(3)
    z = rng.standard_normal((4, 7)).astype(np.float32)
    q = rng.random((4, 7)).astype(np.float32)
    q /= q.sum(axis=1, keepdims=True)
    zt = Tensor(z, requires_grad=True)
    loss = ops.cross_entropy(zt, q)
    ref_loss, stats = softmax_xent_forward_reference(z, q)
    assert float(ref_loss) == pytest.approx(float(loss.data), rel=1e-5)
    loss.backward()
    np.testing.assert_allclose(softmax_xent_backward_reference(z, q, stats), zt.grad, **F32)


@pytest.mark.parametrize("kind", ["relu", "leaky_relu", "relu6"])
def test_activation_grads_match_engine(kind):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 4, 5)) * 5).astype(np.float32)
    xt = Tensor(x, requires_grad=True)
    y = {"relu": ops.relu, "leaky_relu": lambda v: ops.leaky_relu(v, 0.2), "relu6": ops.relu6}[kind](xt)
    gy = rng.standard_normal(x.shape).astype(np.float32)
    y.backward(gy)
    np.testing.assert_allclose(activation_grad_reference(kind, y.data, gy, slope=0.2), xt.grad, **F32)


def test_l2norm_matches_engine():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    x[0] = 0
    xt = Tensor(x, requires_grad=True)
    y = ops.l2_normalize(xt, axis=-1, eps=1e-6)
    ref_y, norm = l2norm_forward_reference(x, 1e-6)
    np.testing.assert_allclose(ref_y, y.data, **F32)
    gy = rng.standard_normal(x.shape).astype(np.float32)
    y.backward(gy)
    np.testing.assert_allclose(l2norm_backward_reference(ref_y, gy, norm, 1e-6), xt.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_matches_engine_sgd(nesterov):
    rng = np.random.default_rng(6)
    p0 = rng.standard_normal(12).astype(np.float32)
    param = Parameter(p0.copy())
    opt = SGD([param], lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    flat, buf = p0.copy(), np.zeros(12, np.float32)
    for _ in range(3):
        g = rng.standard_normal(12).astype(np.float32)
        param.grad = g.copy()
        opt.step()
        sgd_momentum_reference(flat, g, buf, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    np.testing.assert_allclose(flat, param.data, **F32)


def test_fused_adamw_matches_engine_adamw():
    rng = np.random.default_rng(7)
    p0 = rng.standard_normal(12).astype(np.float32)
    param = Parameter(p0.copy())
    opt = AdamW([param], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    flat, m, v = p0.copy(), np.zeros(12, np.float32), np.zeros(12, np.float32)
    for step in range(1, 5):
        g = rng.standard_normal(12).astype(np.float32)
        param.grad = g.copy()
        opt.step()
        adamw_reference(flat, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
    np.testing.assert_allclose(flat, param.data, **F32)


@pytest.mark.parametrize("betas,weight_decay", [((0.9, 0.999), 0.01), ((0.5, 0.9), 0.3), ((0.9, 0.999), 0.0)])
def test_fused_adamw_matches_engine_adamw_over_many_steps(betas, weight_decay):
    """Decoupled decay and both bias corrections, over enough steps for the corrections to fade: the
    fused kernel's reference follows engine/optim/adam.py (the engine routes CuPy AdamW to the kernel)."""
    rng = np.random.default_rng(8)
    p0 = rng.standard_normal((3, 5)).astype(np.float32)
    param = Parameter(p0.copy())
    opt = AdamW([param], lr=3e-3, betas=betas, eps=1e-8, weight_decay=weight_decay)
    flat, m, v = p0.reshape(-1).copy(), np.zeros(15, np.float32), np.zeros(15, np.float32)
    for step in range(1, 31):
        g = (rng.standard_normal((3, 5)) * (10.0 if step % 7 == 0 else 0.1)).astype(np.float32)
        param.grad = g.copy()
        opt.step()
        adamw_reference(flat, g.reshape(-1), m, v, step=step, lr=3e-3, beta1=betas[0], beta2=betas[1], eps=1e-8,
                        weight_decay=weight_decay)
    np.testing.assert_allclose(flat.reshape(3, 5), param.data, **F32)
    np.testing.assert_allclose(m.reshape(3, 5), opt.state[id(param)]["exp_avg"], **F32)
    np.testing.assert_allclose(v.reshape(3, 5), opt.state[id(param)]["exp_avg_sq"], **F32)
    assert int(opt.state[id(param)]["step"]) == 30


def test_adam_l2_decay_is_the_fused_kernel_with_decay_folded_into_the_gradient():
    """Adam (not AdamW) adds ``wd * p`` to the gradient; the engine's CuPy path does exactly that and
    runs the AdamW kernel with decay 0 (engine/ops/_kernels.adam_step)."""
    rng = np.random.default_rng(9)
    p0 = rng.standard_normal(12).astype(np.float32)
    param = Parameter(p0.copy())
    opt = Adam([param], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    flat, m, v = p0.copy(), np.zeros(12, np.float32), np.zeros(12, np.float32)
    for step in range(1, 6):
        g = rng.standard_normal(12).astype(np.float32)
        param.grad = g.copy()
        opt.step()
        adamw_reference(flat, g + np.float32(0.1) * flat, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                        weight_decay=0.0)
    np.testing.assert_allclose(flat, param.data, **F32)
