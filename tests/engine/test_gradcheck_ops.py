"""Every differentiable op against central differences in float64 (leaflens.engine.gradcheck)."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import ops
from leaflens.engine.gradcheck import GradcheckError, gradcheck

rng = np.random.default_rng(1234)


def r(*shape, lo=None):
    a = rng.standard_normal(shape)
    if lo is not None:
        a = np.abs(a) + lo
    return a


def distinct(*shape):
    """Values far apart from each other, so max/min/pool have no near-ties."""
    n = int(np.prod(shape))
    return (rng.permutation(n).reshape(shape) * 0.1 + rng.uniform(0, 0.01, shape))


CASES = {
    "add_broadcast": (lambda a, b: a + b, [r(3, 4), r(4)]),
    "add_broadcast_col": (lambda a, b: a + b, [r(3, 1), r(1, 4)]),
    "sub_broadcast": (lambda a, b: a - b, [r(2, 3, 4), r(3, 1)]),
    "mul_broadcast": (lambda a, b: a * b, [r(3, 4), r(1, 4)]),
    "div_broadcast": (lambda a, b: a / b, [r(3, 4), r(4, lo=0.5)]),
    "scalar_ops": (lambda a: (2.0 - a) * 3.0 / (a * a + 1.0) + 1.5, [r(5)]),
    "neg": (lambda a: -a, [r(3)]),
    "pow_scalar": (lambda a: a ** 3, [r(3, 2)]),
    "pow_tensor": (lambda a, b: ops.pow(a, b), [r(3, 2, lo=0.5), r(3, 2)]),
    "exp": (ops.exp, [r(4, 3)]),
    "log": (ops.log, [r(4, 3, lo=0.2)]),
    "sqrt": (ops.sqrt, [r(4, 3, lo=0.2)]),
    "abs": (ops.abs, [r(4, 3, lo=0.1) * np.sign(r(4, 3))]),
    "clip": (lambda a: ops.clip(a, -0.5, 0.5), [distinct(4, 5) - 1.0]),
    "maximum": (ops.maximum, [distinct(3, 4), distinct(3, 4) + 0.05]),
    "minimum_broadcast": (ops.minimum, [distinct(3, 4), np.array([0.3, 0.7, 1.1, 0.9])]),
    "sum_all": (lambda a: a.sum(), [r(3, 4)]),
    "sum_axis": (lambda a: a.sum(axis=1), [r(3, 4, 2)]),
    "sum_axes_keepdims": (lambda a: a.sum(axis=(0, 2), keepdims=True), [r(3, 4, 2)]),
    "mean_axis": (lambda a: a.mean(axis=-1), [r(3, 4)]),
    "var_axis": (lambda a: a.var(axis=0), [r(5, 3)]),
    "var_ddof": (lambda a: a.var(axis=(0, 1), ddof=1, keepdims=True), [r(4, 3, 2)]),
    "max_axis": (lambda a: a.max(axis=1), [distinct(3, 5)]),
    "min_all": (lambda a: a.min(), [distinct(3, 5)]),
    "reshape": (lambda a: a.reshape(4, 6) * np.arange(24.0).reshape(4, 6), [r(2, 3, 4)]),
    "transpose": (lambda a: a.transpose(2, 0, 1) * np.arange(24.0).reshape(4, 2, 3), [r(2, 3, 4)]),
    "getitem_slice": (lambda a: a[1:, ::2], [r(4, 5)]),
    "getitem_advanced_repeats": (lambda a: a[np.array([0, 2, 0, 0])], [r(3, 4)]),
    "getitem_mixed": (lambda a: a[np.array([1, 1, 2]), np.array([0, 3, 3])], [r(3, 4)]),
    "concatenate": (lambda a, b: ops.concatenate([a, b, a], axis=1), [r(2, 3), r(2, 2)]),
    "stack": (lambda a, b: ops.stack([a, b], axis=1), [r(2, 3), r(2, 3)]),
    "matmul": (ops.matmul, [r(3, 4), r(4, 5)]),
    "matmul_batched_broadcast": (ops.matmul, [r(2, 3, 4), r(4, 5)]),
    "linear": (ops.linear, [r(3, 4), r(5, 4), r(5)]),
    "relu": (ops.relu, [r(4, 5)]),
    "leaky_relu": (lambda a: ops.leaky_relu(a, 0.1), [r(4, 5)]),
    "relu6": (ops.relu6, [r(4, 5) * 5 + 2]),
    "sigmoid": (ops.sigmoid, [r(4, 5) * 3]),
    "tanh": (ops.tanh, [r(4, 5)]),
    "softmax": (lambda a: ops.softmax(a, axis=1), [r(3, 5)]),
    "softmax_axis0": (lambda a: ops.softmax(a, axis=0), [r(3, 5)]),
    "log_softmax": (ops.log_softmax, [r(3, 5)]),
    "l2_normalize": (lambda a: ops.l2_normalize(a, axis=1), [r(4, 6)]),
    "global_avg_pool": (ops.global_avg_pool2d, [r(2, 3, 4, 5)]),
    "max_pool_2x2": (lambda a: ops.max_pool2d(a, 2), [distinct(2, 4, 6, 3)]),
    "max_pool_2x2_odd_size": (lambda a: ops.max_pool2d(a, 2), [distinct(2, 5, 7, 2)]),
    "max_pool_3x3_s2_p1": (lambda a: ops.max_pool2d(a, 3, 2, 1), [distinct(2, 5, 5, 2)]),
    "avg_pool_2x2": (lambda a: ops.avg_pool2d(a, 2), [r(2, 4, 4, 3)]),
    "avg_pool_3x3_pad": (lambda a: ops.avg_pool2d(a, 3, 1, 1), [r(1, 4, 5, 2)]),
    "mse_loss": (ops.mse_loss, [r(3, 4), r(3, 4)]),
    "mse_loss_sum": (lambda a, b: ops.mse_loss(a, b, reduction="sum"), [r(3, 4), r(3, 4)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_gradients(name):
    fn, inputs = CASES[name]
    assert gradcheck(fn, inputs)


CONV_CASES = {
    "3x3_pad1": dict(x=(2, 5, 5, 3), w=(4, 3, 3, 3), stride=1, padding=1, groups=1),
    "3x3_stride2_same": dict(x=(2, 6, 7, 2), w=(3, 2, 3, 3), stride=2, padding="same", groups=1),
    "5x5_asymmetric_pad": dict(x=(1, 6, 6, 2), w=(2, 2, 5, 5), stride=2, padding=(1, 2, 2, 1), groups=1),
    "1x1": dict(x=(2, 3, 4, 5), w=(6, 5, 1, 1), stride=1, padding=0, groups=1),
    "1x1_stride2": dict(x=(2, 4, 4, 3), w=(2, 3, 1, 1), stride=2, padding=0, groups=1),
    "grouped": dict(x=(2, 5, 5, 4), w=(6, 2, 3, 3), stride=1, padding=1, groups=2),
    "depthwise": dict(x=(2, 5, 5, 3), w=(3, 1, 3, 3), stride=1, padding=1, groups=3),
    "depthwise_stride2_5x5": dict(x=(2, 7, 6, 4), w=(4, 1, 5, 5), stride=2, padding="same", groups=4),
    "depthwise_multiplier2": dict(x=(1, 4, 4, 2), w=(4, 1, 3, 3), stride=1, padding=1, groups=2),
}


@pytest.mark.parametrize("name", sorted(CONV_CASES))
@pytest.mark.parametrize("bias", [False, True])
def test_conv2d_gradients(name, bias):
    c = CONV_CASES[name]
    inputs = [r(*c["x"]), r(*c["w"])] + ([r(c["w"][0])] if bias else [])

    def f(x, w, b=None):
        return ops.conv2d(x, w, b, stride=c["stride"], padding=c["padding"], groups=c["groups"])

    assert gradcheck(f, inputs)


def test_batch_norm_train_gradients():
    running = [np.zeros(3), np.ones(3)]
    assert gradcheck(lambda x, g, b: ops.batch_norm(x, g, b, *[a.copy() for a in running], training=True),
                     [r(4, 3, 2, 3), r(3) + 1.5, r(3)])


def test_batch_norm_2d_input_gradients():
    assert gradcheck(lambda x, g, b: ops.batch_norm(x, g, b, training=True), [r(6, 4), r(4) + 1.5, r(4)])


def test_batch_norm_eval_gradients():
    mean, var = r(3), r(3, lo=0.5)
    assert gradcheck(lambda x, g, b: ops.batch_norm(x, g, b, mean, var, training=False),
                     [r(2, 3, 3, 3), r(3), r(3)])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_int_targets_gradients(smoothing):
    t = np.array([0, 3, 2, 3, 1])
    assert gradcheck(lambda z: ops.cross_entropy(z, t, label_smoothing=smoothing), [r(5, 4)])


def test_cross_entropy_soft_targets_gradients():
    q = rng.dirichlet(np.ones(4), size=3)
    assert gradcheck(lambda z: ops.cross_entropy(z, q), [r(3, 4)])


def test_cross_entropy_ignore_index_and_none_reduction():
    t = np.array([0, -1, 2])
    assert gradcheck(lambda z: ops.cross_entropy(z, t, ignore_index=-1), [r(3, 4)])
    assert gradcheck(lambda z: ops.cross_entropy(z, t, ignore_index=-1, reduction="none"), [r(3, 4)])


def test_dropout_gradients_with_fixed_mask():
    def f(x):
        return ops.dropout(x, 0.3, training=True, rng=np.random.default_rng(7))

    assert gradcheck(f, [r(4, 6)])


def test_gradcheck_catches_a_wrong_backward():
    from leaflens.engine.tensor import Function

    class BadSquare(Function):
        def forward(self, x):
            self.x = x
            return x * x

        def backward(self, gy):
            return gy * self.x  # should be 2 * x

    with pytest.raises(GradcheckError, match="differs"):
        gradcheck(lambda a: BadSquare()(a), [r(3)])


def test_gradcheck_perturbs_transposed_and_sliced_inputs_in_place():
    # reshaping a non-contiguous array copies it: the check used to perturb the copy, see a numerical
    # gradient of 0 and report a correct backward as wrong
    assert gradcheck(lambda a: a * 2.0, [r(4, 3).T])
    assert gradcheck(lambda a, b: ops.matmul(a, b), [r(4, 3).T, r(8, 5)[::2]])


def test_pow_tensor_exponent_gradient_is_zero_where_the_base_is_zero():
    from leaflens.engine.tensor import Tensor

    a = Tensor(np.array([0.0, 1.0, 2.0]), requires_grad=True)
    b = Tensor(np.array([2.0, 2.0, 2.0]), requires_grad=True)
    ops.pow(a, b).sum().backward()
    np.testing.assert_allclose(b.grad, [0.0, 0.0, 4.0 * np.log(2.0)])  # a**b log a, 0 at a == 0 (was NaN)
    np.testing.assert_allclose(a.grad, [0.0, 2.0, 4.0])
