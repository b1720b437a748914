"""Optimisers, schedules and clipping against hand-written reference steps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from leaflens.engine.nn import Parameter
from leaflens.engine.optim import SGD, Adam, AdamW, StepLR, WarmupCosine, clip_grad_norm_

GRADS = [np.array([0.5, -1.0, 2.0]), np.array([-0.3, 0.2, 0.1]), np.array([1.0, 1.0, -1.0])]


def run(opt_cls, **kw):
    p = Parameter(np.array([1.0, 2.0, -3.0]))
    opt = opt_cls([p], **kw)
    for g in GRADS:
        p.grad = g.copy()
        opt.step()
    return p.data


def test_sgd_momentum_nesterov_weight_decay():
    lr, mom, wd = 0.1, 0.9, 0.01
    for nesterov in (False, True):
        p, buf = np.array([1.0, 2.0, -3.0]), None
        for g in GRADS:
            g = g + wd * p
            buf = g.copy() if buf is None else mom * buf + g
            p = p - lr * (g + mom * buf if nesterov else buf)
        np.testing.assert_allclose(run(SGD, lr=lr, momentum=mom, weight_decay=wd, nesterov=nesterov), p)


def _adam_reference(decoupled, lr=0.01, b1=0.9, b2=0.999, eps=1e-8, wd=0.1):
    p, m, v = np.array([1.0, 2.0, -3.0]), 0.0, 0.0
    for t, g in enumerate(GRADS, start=1):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p


def test_adam_and_adamw():
    np.testing.assert_allclose(run(Adam, lr=0.01, weight_decay=0.1), _adam_reference(False))
    np.testing.assert_allclose(run(AdamW, lr=0.01, weight_decay=0.1), _adam_reference(True))


def test_parameters_without_gradient_are_left_alone():
    a, b = Parameter(np.ones(2)), Parameter(np.ones(2))
    opt = SGD([a, b], lr=1.0)
    a.grad = np.ones(2)
    opt.step()
    np.testing.assert_array_equal(b.data, np.ones(2))
    np.testing.assert_array_equal(a.data, np.zeros(2))


def test_parameter_groups_take_their_own_learning_rate():
    a, b = Parameter(np.ones(1)), Parameter(np.ones(1))
    opt = SGD([{"params": [a], "lr": 0.1}, {"params": [b]}], lr=1.0)
    a.grad, b.grad = np.ones(1), np.ones(1)
    opt.step()
    np.testing.assert_allclose([a.data[0], b.data[0]], [0.9, 0.0])


def test_gradient_accumulation_is_not_zeroing():
    from leaflens.engine import Tensor

    p = Parameter(np.array([2.0]))
    for _ in range(3):
        (p * Tensor(np.array([1.5]))).sum().backward()
    np.testing.assert_allclose(p.grad, [4.5])


def test_optimizer_state_dict_round_trip_continues_identically():
    def make():
        p = Parameter(np.array([1.0, 2.0, -3.0]))
        return p, AdamW([p], lr=0.01)

    p1, o1 = make()
    for g in GRADS[:2]:
        p1.grad = g.copy()
        o1.step()
    p2, o2 = make()
    p2.data = p1.data.copy()
    o2.load_state_dict(o1.state_dict())
    for p, o in ((p1, o1), (p2, o2)):
        p.grad = GRADS[2].copy()
        o.step()
    np.testing.assert_array_equal(p1.data, p2.data)


def test_warmup_cosine_and_step_schedules():
    p = Parameter(np.ones(1))
    opt = SGD([p], lr=1.0)
    sched = WarmupCosine(opt, total_steps=110, warmup_steps=10)
    lrs = [sched.get_lr()[0]]
    for _ in range(110):
        sched.step()
        lrs.append(sched.get_lr()[0])
    assert lrs[0] == pytest.approx(1 / 11)
    assert lrs[9] == pytest.approx(10 / 11)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))

    opt2 = SGD([Parameter(np.ones(1))], lr=1.0)
    s2 = StepLR(opt2, step_size=3, gamma=0.5)
    seen = []
    for _ in range(7):
        seen.append(s2.get_lr()[0])
        s2.step()
    assert seen == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]


def test_clip_grad_norm():
    a, b = Parameter(np.zeros(2)), Parameter(np.zeros(1))
    a.grad, b.grad = np.array([3.0, 0.0]), np.array([4.0])
    total = clip_grad_norm_([a, b], 1.0)
    assert total == pytest.approx(5.0)
    assert math.sqrt((a.grad ** 2).sum() + (b.grad ** 2).sum()) == pytest.approx(1.0, rel=1e-5)
    a.grad = np.array([np.nan, 1.0])
    assert math.isnan(clip_grad_norm_([a], 1.0))
    assert np.isnan(a.grad[0]) and a.grad[1] == 1.0  # left alone for the caller to handle


def test_invalid_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="Nesterov"):
        SGD([Parameter(np.ones(1))], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="no parameters"):
        Adam([], lr=0.1)
