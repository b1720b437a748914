"""The counting CuPy stand-in (leaflens.engine.sync_count) and the engine pieces that keep a training
step free of host reads on a GPU: device-side clipping, Adam's host step counter after a resume, the
one-read train_step and its deferred input check."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import Tensor, ops
from leaflens.engine.amp import GradScaler, train_step
from leaflens.engine.backend import array_module, to_device
from leaflens.engine.nn import Linear
from leaflens.engine.nn.module import Parameter
from leaflens.engine.optim import SGD, AdamW, clip_grad_norm_
from leaflens.engine.sync_count import DeviceArray, counting_device


def test_each_kind_of_host_read_is_counted_once_and_device_work_not_at_all():
    with counting_device() as counter:
        a = to_device(np.arange(6, dtype=np.float32).reshape(2, 3), "cuda")
        xp = array_module(a)
        assert isinstance(a, DeviceArray) and xp is not np
        s = (a * 2 + 1).sum()
        m = xp.maximum(a.max(axis=1), 1.0)
        a[xp.arange(2), xp.asarray([0, 1])] = 5
        assert isinstance(s, DeviceArray) and s.shape == ()  # reductions stay on the device, as in CuPy
        assert counter.total == 0
        reads = [lambda: float(s), lambda: int(s), lambda: bool(s > 0), lambda: s.item(), lambda: m.tolist(),
                 lambda: m.get(), lambda: xp.asnumpy(m), lambda: np.asarray(m), lambda: a[a > 3],
                 lambda: xp.nonzero(a)]
        for k, read in enumerate(reads, 1):
            read()
            assert counter.total == k, counter.events
        with pytest.raises(TypeError, match="host NumPy array"):  # CuPy refuses mixing; so does the stand-in
            a + np.ones(3, np.float32)
    assert array_module(np.ones(1)) is np  # the backend is put back


def _grads(xp, seed=0):
    rng = np.random.default_rng(seed)
    params = [Parameter(xp.asarray(rng.normal(size=s).astype(np.float32))) for s in [(3, 4), (4,), (2, 2)]]
    for p in params:
        p.grad = xp.asarray(rng.normal(size=p.shape).astype(np.float32) * 3)
    return params


def test_clipping_runs_on_the_device_and_gives_the_host_result():
    host = _grads(np)
    norm_host = float(clip_grad_norm_(host, 1.0))
    with counting_device() as counter:
        dev = _grads(array_module(to_device(np.ones(1), "cuda")))
        norm_dev = clip_grad_norm_(dev, 1.0)
        assert counter.total == 0
        assert float(norm_dev) == norm_host
        for h, d in zip(host, dev):
            np.testing.assert_array_equal(h.grad, d.grad.get())


def test_a_resumed_adam_keeps_its_step_count_on_the_host():
    with counting_device() as counter:
        xp = array_module(to_device(np.ones(1), "cuda"))
        first = AdamW(_grads(xp), lr=0.1)
        first.step()
        saved = first.state_dict()
        params = _grads(xp, seed=1)
        resumed = AdamW(params, lr=0.1)
        resumed.load_state_dict(saved)
        assert all(type(s["step"]) is int and s["step"] == 1 for s in resumed.state.values())
        start = counter.total
        resumed.step()
        SGD(params, lr=0.1, momentum=0.9).step()
        assert counter.since(start) == []
        assert all(s["step"] == 2 for s in resumed.state.values())


def _model_and_batch(xp):
    rng = np.random.default_rng(0)
    model = Linear(4, 3, rng=rng)
    x = xp.asarray(rng.normal(size=(6, 4)).astype(np.float32))
    y = xp.asarray(np.array([0, 1, 2, -1, 1, 0]))
    return model, x, y


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_train_step_reads_the_device_once(mixed_precision):
    with counting_device() as counter:
        xp = array_module(to_device(np.ones(1), "cuda"))
        model, x, y = _model_and_batch(np)
        model.to("cuda")
        x, y = xp.asarray(x), xp.asarray(y)
        opt = AdamW(model.parameters(), lr=0.01)
        scaler = GradScaler(enabled=mixed_precision)
        start = counter.total
        result = train_step(opt, scaler, lambda: ops.cross_entropy(model(Tensor(x)), y, ignore_index=-1), 0.5)
        assert len(counter.since(start)) == 1, counter.by_site(start)
        assert result.stepped is True or result.overflow
        assert isinstance(result.grad_norm, float) and result.grad_norm > 0


def test_an_out_of_range_target_on_the_device_fails_as_on_the_host_with_the_weights_untouched():
    model, x, y = _model_and_batch(np)
    y = y.copy()
    y[2] = 7
    with pytest.raises(ValueError, match=r"target class 7 is outside \[0, 3\)") as host_error:
        train_step(AdamW(model.parameters()), GradScaler(enabled=False),
                   lambda: ops.cross_entropy(model(Tensor(x)), y, ignore_index=-1), 1.0)
    with counting_device():
        model.to("cuda")
        before = [p.data.get() for p in model.parameters()]
        xp = array_module(model.parameters()[0].data)
        with pytest.raises(ValueError) as device_error:
            train_step(AdamW(model.parameters()), GradScaler(enabled=False),
                       lambda: ops.cross_entropy(model(Tensor(xp.asarray(x))), xp.asarray(y), ignore_index=-1), 1.0)
        assert str(device_error.value) == str(host_error.value)
        for b, p in zip(before, model.parameters()):
            np.testing.assert_array_equal(b, p.data.get())


def test_a_non_finite_loss_on_the_device_is_refused_with_the_optimiser_untouched():
    from leaflens.engine import NonFiniteLossError

    with counting_device():
        model, x, _ = _model_and_batch(np)
        model.to("cuda")
        xp = array_module(model.parameters()[0].data)
        x = x.copy()
        x[0, 0] = np.nan
        opt = AdamW(model.parameters())
        before = [p.data.get() for p in model.parameters()]
        with pytest.raises(NonFiniteLossError, match="loss is nan"):
            train_step(opt, GradScaler(enabled=True), lambda: ops.cross_entropy(model(Tensor(xp.asarray(x))),
                                                                                xp.asarray(np.zeros(6, np.int64))))
        assert opt.state == {}
        for b, p in zip(before, model.parameters()):
            np.testing.assert_array_equal(b, p.data.get())
