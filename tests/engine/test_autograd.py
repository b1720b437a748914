"""The autograd core: accumulation, graph walking, memory release, modes, and clear errors."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

from leaflens.engine import GraphFreedError, NonFiniteLossError, Tensor, no_grad, ops
from leaflens.engine.config import grad_enabled


def test_leaf_gradients_accumulate_across_backward_calls():
    x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    (x * x).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * x.data + 3)


def test_shared_subexpression_gets_both_contributions():
    x = Tensor(np.array([2.0]), requires_grad=True)
    y = (x * 3.0) * (x + 1.0)  # 3x^2 + 3x -> 6x + 3
    y.backward()
    np.testing.assert_allclose(x.grad, [15.0])


def test_graph_deeper_than_ten_thousand_nodes():
    x = Tensor(np.array([1.0], dtype=np.float64), requires_grad=True)
    y = x
    for _ in range(20_000):
        y = y * 1.0001
    y.sum().backward()
    np.testing.assert_allclose(x.grad, [1.0001 ** 20_000], rtol=1e-9)


def test_backward_releases_intermediates():
    x = Tensor(np.ones((4, 4), dtype=np.float32), requires_grad=True)
    h = ops.relu(x * 2.0)
    fn_ref = weakref.ref(h.creator)
    saved = weakref.ref(h.creator.y)  # the ReLU keeps its output for backward
    loss = h.sum()
    del h
    loss.backward()
    gc.collect()
    assert fn_ref() is None or getattr(fn_ref(), "released", False)
    assert saved() is None, "ReLU's saved output should be freed after backward"


def test_second_backward_without_retain_graph_is_refused():
    x = Tensor(np.ones(3), requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(GraphFreedError, match="retain_graph"):
        y.backward()


def test_retain_graph_allows_second_backward():
    x = Tensor(np.ones(3), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad, 4 * np.ones(3))


def test_no_grad_records_nothing_and_is_thread_local():
    x = Tensor(np.ones(3), requires_grad=True)
    seen = {}

    def other_thread():
        seen["enabled"] = grad_enabled()

    with no_grad():
        y = x * 2.0
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert y.creator is None and not y.requires_grad
    assert seen["enabled"] is True
    assert grad_enabled()


def test_backward_on_non_scalar_without_grad_names_the_shape():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"scalar.*\(2, 3\)"):
        (x * 2.0).backward()


def test_backward_with_explicit_grad_for_non_scalar():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    (x * 2.0).backward(np.full((2, 3), 0.5))
    np.testing.assert_allclose(x.grad, np.ones((2, 3)))


def test_nan_loss_is_refused_with_a_clear_error():
    x = Tensor(np.array([1.0, -1.0]), requires_grad=True)
    with np.errstate(invalid="ignore"):  # NumPy's own warning is not what is tested: the refusal is
        loss = ops.log(x).sum()  # log(-1) = nan
    with pytest.raises(NonFiniteLossError, match="nan"):
        loss.backward()


def test_mismatched_dtypes_are_refused():
    a = Tensor(np.ones(3, dtype=np.float32))
    b = Tensor(np.ones(3, dtype=np.float64))
    with pytest.raises(TypeError, match="float32 and float64"):
        a + b


def test_python_scalars_keep_the_tensor_dtype():
    a = Tensor(np.ones(3, dtype=np.float32))
    assert (a * 0.5 + 1).dtype == np.float32
    assert (2.0 / a).dtype == np.float32


def test_wrong_shapes_are_named():
    with pytest.raises(ValueError, match=r"\(3, 4\) and \(5,\)"):
        Tensor(np.ones((3, 4))) + Tensor(np.ones(5))
    with pytest.raises(ValueError, match=r"inner dimensions.*\(2, 3\) @ \(4, 5\)"):
        ops.matmul(Tensor(np.ones((2, 3))), Tensor(np.ones((4, 5))))
    with pytest.raises(ValueError, match="input has 3 channels"):
        ops.conv2d(Tensor(np.ones((1, 5, 5, 3), np.float32)), Tensor(np.ones((4, 2, 3, 3), np.float32)))
    with pytest.raises(ValueError, match="NHWC"):
        ops.conv2d(Tensor(np.ones((5, 5, 3), np.float32)), Tensor(np.ones((4, 3, 3, 3), np.float32)))
    with pytest.raises(ValueError, match="cannot reshape"):
        Tensor(np.ones(6)).reshape(4, 2)


def test_cross_entropy_rejects_bad_targets():
    z = Tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="class 5"):
        ops.cross_entropy(z, np.array([0, 5]))
    with pytest.raises(ValueError, match="targets of shape"):
        ops.cross_entropy(z, np.array([0, 1, 2]))


def test_gradient_only_where_required():
    x = Tensor(np.random.randn(2, 4, 4, 3).astype(np.float32))  # an input image: no grad wanted
    w = Tensor(np.random.randn(5, 3, 3, 3).astype(np.float32), requires_grad=True)
    ops.conv2d(x, w, padding=1).sum().backward()
    assert x.grad is None and w.grad is not None


def test_comparisons_and_item():
    t = Tensor(np.array([1.0, 3.0]))
    assert (t > 2).tolist() == [False, True]
    assert Tensor(np.array([4.0])).item() == 4.0
    with pytest.raises(ValueError, match="one element"):
        t.item()
