"""BatchNorm2d -> ReLU -> MaxPool2d(2) fused into one op (engine/ops/fused.py) computes what the three ops
compute one after another, and nn.Sequential uses it exactly where it applies."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import Tensor, nn, no_grad, ops, parallel
from leaflens.engine.gradcheck import gradcheck
from leaflens.engine.ops import fused, norm
from leaflens.engine.ops.fused import BatchNormReLUMaxPool

rng = np.random.default_rng(5)


def _chain(x, g, b, gy, *, fuse: bool, dtype, monotone: bool | None = None):
    """(output, gx, ggamma, gbeta, running mean, running var) of the fused op or of the three ops; with
    ``monotone``, the fused op must have taken that path."""
    c = x.shape[-1]
    rm, rv = np.full(c, 0.5, dtype), np.full(c, 2.0, dtype)
    xt, gt, bt = (Tensor(a.astype(dtype), requires_grad=True) for a in (x, g, b))
    if fuse:
        y = ops.batch_norm_relu_max_pool(xt, gt, bt, rm, rv, momentum=0.3, eps=1e-3)
        assert isinstance(y.creator, BatchNormReLUMaxPool)
        assert monotone is None or y.creator.monotone == monotone
    else:
        y = ops.max_pool2d(ops.relu(ops.batch_norm(xt, gt, bt, rm, rv, training=True, momentum=0.3, eps=1e-3)), 2)
    y.backward(gy.astype(dtype))
    return y.data, xt.grad, gt.grad, bt.grad, rm, rv


def _input(shape):
    x = rng.standard_normal(shape) * 2 + 0.5
    x[0, 0, 0] = x[0, 0, 1]  # a tie between the first two taps of a window
    x[-1, -2:, -2:] = x[-1, -2:, -2:].min() - 1  # a window whose maximum ReLU zeroes, in every channel
    return x


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(2, 4, 6, 3), (3, 2, 2, 5), (4, 8, 10, 16)])
@pytest.mark.parametrize("tiles", ["default", "tiny", "uneven"])
@pytest.mark.parametrize("negative_scale", [True, False])
def test_values_and_gradients_equal_the_three_ops(dtype, shape, tiles, negative_scale, monkeypatch):
    if tiles == "tiny":  # a row pair per tile (a row for the statistics), handed to two threads even at these sizes
        monkeypatch.setattr(parallel, "TILE", 1)
        monkeypatch.setattr(fused, "TILE", 1)
        monkeypatch.setattr(norm, "STATS_TILE", 1)
    if tiles == "uneven":  # tiles that do not hold a whole number of row pairs (nor 4 of them, 4x as many)
        monkeypatch.setattr(fused, "TILE", 3 * shape[2] * shape[3])  # 1.5 row pairs
        monkeypatch.setattr(norm, "STATS_TILE", 3 * shape[3] + 1)
        monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
        monkeypatch.setattr(parallel, "num_threads", lambda: 2)
        monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
        monkeypatch.setattr(parallel, "num_threads", lambda: 2)
    c = shape[-1]
    x, g, b = _input(shape), rng.standard_normal(c) + 1.5, rng.standard_normal(c)
    if negative_scale:
        g[0] = -0.7  # the max of the normalised values is not at the max of x: the general path
    else:
        g = np.abs(g) + 0.1  # every scale positive: the monotone path
    gy = rng.standard_normal((shape[0], shape[1] // 2, shape[2] // 2, c))
    got = _chain(x, g, b, gy, fuse=True, dtype=dtype, monotone=not negative_scale)
    want = _chain(x, g, b, gy, fuse=False, dtype=dtype)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    for a, w, name in zip(got, want, ("y", "gx", "ggamma", "gbeta", "running_mean", "running_var")):
        assert a.dtype == dtype, name
        if name in ("y", "running_mean", "running_var"):
            np.testing.assert_array_equal(a, w, err_msg=name)  # the same statistics code and formula
        else:
            np.testing.assert_allclose(a, w, rtol=tol, atol=tol * np.abs(w).max(), err_msg=name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_ties_in_every_window_go_where_max_pool_sends_them(dtype):
    """Every window holds a tie at its maximum (two, three or four equal taps): the gradient goes to the
    first tied tap, as MaxPool2d's does; a wrong tap would move BatchNorm's input gradient."""
    windows = rng.permutation(np.repeat(rng.standard_normal(24), 1)).reshape(2, 2, 2, 1, 1, 3)
    taps = np.tile(windows, (1, 1, 1, 2, 2, 1))  # (n, ho, wo, 2, 2, c): four equal taps
    taps[:, 0, :, 1, 1] -= 1.0  # three-way ties
    taps[:, 1, :, 0, 0] -= 1.0
    taps[:, 1, :, 1, 0] -= 2.0  # two-way ties (taps (0, 1) and (1, 1))
    x = taps.transpose(0, 1, 3, 2, 4, 5).reshape(2, 4, 4, 3)
    g, b, gy = np.ones(3), np.full(3, 3.0), rng.standard_normal((2, 2, 2, 3))
    got = _chain(x, g, b, gy, fuse=True, dtype=dtype, monotone=True)
    want = _chain(x, g, b, gy, fuse=False, dtype=dtype)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5 * np.abs(want[1]).max())


def test_gradcheck():
    x = rng.permutation(96).reshape(2, 4, 4, 3) / 10.0  # distinct values: no ties, no value at ReLU's kink
    assert gradcheck(lambda x, g, b: ops.batch_norm_relu_max_pool(x, g, b),
                     [x, rng.standard_normal(3) + 1.5, rng.standard_normal(3) + 0.3])


def test_rejects_odd_sizes_and_mismatched_parameters():
    with pytest.raises(ValueError, match="even height and width"):
        ops.batch_norm_relu_max_pool(np.zeros((1, 3, 4, 2)), np.ones(2), np.zeros(2))
    with pytest.raises(ValueError, match="weight/bias have shapes"):
        ops.batch_norm_relu_max_pool(np.zeros((1, 2, 2, 2)), np.ones(3), np.zeros(3))


def _block(pool: nn.Module | None = None) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False, rng=np.random.default_rng(0)), nn.BatchNorm2d(4),
                         nn.ReLU(), pool if pool is not None else nn.MaxPool2d(2))


def _ran_fused(model: nn.Module, x: np.ndarray) -> bool:
    out = model(Tensor(x, requires_grad=True))
    return isinstance(out.creator, BatchNormReLUMaxPool)


def test_sequential_fuses_the_chain_only_where_it_applies(monkeypatch):
    x = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
    assert _ran_fused(_block().train(), x)
    assert not _ran_fused(_block().eval(), x)  # running statistics: nothing to fuse (and what export traces)
    frozen = _block().train()
    frozen[1].frozen = True
    assert not _ran_fused(frozen, x)
    assert not _ran_fused(_block(nn.MaxPool2d(3, 2, padding=1)).train(), x)
    assert not _ran_fused(_block(nn.AvgPool2d(2)).train(), x)
    assert not _ran_fused(_block().train(), x[:, :5, :5])  # odd height and width
    hooked = _block().train()
    seen = []
    hooked[2].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert not _ran_fused(hooked, x) and seen == [(2, 6, 6, 4)]  # a hooked module still runs (and calls its hook)
    monkeypatch.setattr(fused, "ENABLED", False)
    assert not _ran_fused(_block().train(), x)


def test_student_training_step_is_the_same_fused_or_not(monkeypatch):
    from leaflens.pipeline.models.student import StudentCNN

    x = rng.standard_normal((4, 16, 16, 3)).astype(np.float32)
    y = rng.integers(0, 3, 4)
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(fused, "ENABLED", enabled)
        model = StudentCNN(3, widths=(8, 16), rng=np.random.default_rng(1))
        loss = ops.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        state = {k: np.array(v) for k, v in model.state_dict().items()}
        results.append((float(loss.data), [p.grad.copy() for p in model.parameters()], state))
        with no_grad():  # eval mode after the step: the running statistics the step left give the same logits
            model.eval()
            results[-1] += (model(Tensor(x)).data,)
    (loss_f, grads_f, state_f, eval_f), (loss_u, grads_u, state_u, eval_u) = results
    assert loss_f == loss_u
    for a, b in zip(grads_f, grads_u):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b).max())
    for k in state_u:
        np.testing.assert_array_equal(state_f[k], state_u[k], err_msg=k)
    np.testing.assert_array_equal(eval_f, eval_u)


def test_a_nan_in_one_channel_gives_what_the_three_ops_give():
    """NaN reaches the windows' maxima (no tap equals them): the path for ties and NaN, not the one-hit one."""
    x, gy = _input((2, 4, 4, 3)), rng.standard_normal((2, 2, 2, 3))
    x[1, 2, 3, 1] = np.nan
    # NaN makes its channel's statistics and scale NaN: the general path
    got = _chain(x, np.ones(3), np.zeros(3), gy, fuse=True, dtype=np.float64, monotone=False)
    want = _chain(x, np.ones(3), np.zeros(3), gy, fuse=False, dtype=np.float64)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-12, atol=1e-12)  # NaN where the three ops give NaN
    assert np.isnan(got[1][..., 1]).all() and np.isfinite(got[1][..., [0, 2]]).all()


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_a_zero_or_negative_scale_takes_the_general_path(scale):
    """With gamma = 0 every tap ties after normalisation (the first tap wins, whatever x is); with gamma < 0 the
    normalised maximum sits at the minimum of x: neither is the maximum of x, so the op recomputes the taps."""
    x, gy = _input((2, 4, 4, 3)), rng.standard_normal((2, 2, 2, 3))
    g = np.array([1.0, scale, 2.0])
    got = _chain(x, g, np.full(3, 0.2), gy, fuse=True, dtype=np.float64, monotone=False)
    want = _chain(x, g, np.full(3, 0.2), gy, fuse=False, dtype=np.float64)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=1e-12, atol=1e-12)


def test_the_monotone_path_equals_the_general_one_on_a_student_sized_block(monkeypatch):
    x = rng.standard_normal((8, 16, 16, 32)).astype(np.float32) * 3 + 1
    g, b = rng.uniform(0.5, 2, 32), rng.standard_normal(32)
    gy = rng.standard_normal((8, 8, 8, 32))
    got = _chain(x, g, b, gy, fuse=True, dtype=np.float32, monotone=True)
    monkeypatch.setattr(fused, "MONOTONE", False)
    general = _chain(x, g, b, gy, fuse=True, dtype=np.float32, monotone=False)
    np.testing.assert_array_equal(got[0], general[0])
    for a, w in zip(got[1:4], general[1:4]):
        np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())
