"""leaflens.engine.amp: autocast (float16 conv/linear/matmul, float32 losses and normalisation, float32 master
gradients), GradScaler (skip and back off on overflow, growth, unscale before clipping, state), and mixed
precision in the student training loop on the CPU (it learns; resume is exact), plus one GPU step."""

from __future__ import annotations

import functools
import json
import threading

import numpy as np
import pytest

from leaflens.engine import NonFiniteLossError, Tensor, amp, ops
from leaflens.engine.amp import GradScaler, autocast
from leaflens.engine.nn import BatchNorm2d, Conv2d, Linear, Parameter
from leaflens.engine.optim import SGD, clip_grad_norm_
from leaflens.pipeline.config import load_config
from leaflens.pipeline.models.student import StudentCNN


# ---- autocast ----------------------------------------------------------------------------------------------
def _weight_grads(layer, x, g, use_amp: bool):
    layer.zero_grad()
    with autocast(use_amp):
        y = layer(Tensor(x))
        out_dtype = y.dtype
        loss = (y.astype(np.float32) * g).sum()
    loss.backward()
    return out_dtype, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("make", [
    lambda rng: (Conv2d(3, 8, 3, padding=1, rng=rng), (4, 10, 10, 3), (4, 10, 10, 8)),
    lambda rng: (Conv2d(6, 6, 3, stride=2, padding=1, groups=3, rng=rng), (2, 9, 9, 6), (2, 5, 5, 6)),
    lambda rng: (Linear(20, 7, rng=rng), (16, 20), (16, 7)),
])
def test_autocast_computes_in_float16_and_master_grads_stay_float32(make):
    layer, xshape, gshape = make(np.random.default_rng(0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal(xshape).astype(np.float32)
    g = rng.standard_normal(gshape).astype(np.float32)
    dt32, ref = _weight_grads(layer, x, g, use_amp=False)
    dt16, got = _weight_grads(layer, x, g, use_amp=True)
    assert dt32 == np.float32 and dt16 == np.float16
    for name, p in layer.named_parameters():
        assert p.dtype == np.float32 and got[name].dtype == np.float32, name
        scale = np.abs(ref[name]).max()
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-2, atol=1e-2 * scale, err_msg=name)


def test_matmul_casts_down_and_losses_softmax_norms_cast_up():
    rng = np.random.default_rng(1)
    a = Parameter(rng.standard_normal((5, 4)).astype(np.float32))
    b = Parameter(rng.standard_normal((4, 3)).astype(np.float32))
    with autocast():
        z = ops.matmul(a, b)
        assert z.dtype == np.float16
        assert ops.softmax(z).dtype == np.float32
        assert ops.log_softmax(z).dtype == np.float32
        assert ops.l2_normalize(z, axis=1).dtype == np.float32
        assert ops.mse_loss(z, np.zeros((5, 3), np.float32)).dtype == np.float32
        bn = BatchNorm2d(3)
        assert bn(z).dtype == np.float32 and bn.running_mean.dtype == np.float32
        loss = ops.cross_entropy(z, np.array([0, 1, 2, 0, 1]))
        assert loss.dtype == np.float32
    loss.backward()
    assert a.grad.dtype == np.float32 and b.grad.dtype == np.float32
    # outside autocast nothing is cast
    assert ops.matmul(a, b).dtype == np.float32


def test_autocast_is_per_thread_and_float16_only():
    seen = {}
    with autocast():
        t = threading.Thread(target=lambda: seen.setdefault("other", amp.autocast_enabled()))
        t.start()
        t.join()
        assert amp.autocast_enabled()
        with autocast(False):
            assert not amp.autocast_enabled()
        assert amp.autocast_enabled()
    assert not amp.autocast_enabled() and seen["other"] is False
    with pytest.raises(ValueError, match="float16 only"):
        with autocast(dtype=np.float32):
            pass


# ---- GradScaler ----------------------------------------------------------------------------------------------
def _param_with_grad(grad) -> Parameter:
    p = Parameter(np.ones(3, np.float32))
    p.grad = np.asarray(grad, np.float32)
    return p


def test_scaler_skips_the_step_and_halves_the_scale_on_inf():
    p = _param_with_grad([1.0, np.inf, 2.0])
    opt = SGD([p], lr=0.1)
    scaler = GradScaler(init_scale=1024.0)
    assert scaler.unscale_(opt) is True
    assert scaler.step(opt) is False
    np.testing.assert_array_equal(p.data, np.ones(3, np.float32))  # untouched
    scaler.update()
    assert scaler.get_scale() == 512.0 and scaler.skipped_steps == 1 and scaler.growth_tracker == 0
    p.grad = np.array([np.nan, 0, 0], np.float32)
    assert scaler.step(opt) is False  # step() unscales by itself when the caller did not
    scaler.update()
    assert scaler.get_scale() == 256.0 and scaler.skipped_steps == 2


def test_scaler_grows_after_growth_interval_good_steps():
    scaler = GradScaler(init_scale=8.0, growth_interval=3)
    p = _param_with_grad([8.0, 16.0, 0.0])
    opt = SGD([p], lr=0.0)
    for i in range(1, 7):
        p.grad = np.array([8.0, 16.0, 0.0], np.float32) * scaler.get_scale() / 8.0
        assert scaler.step(opt) is True
        scaler.update()
        assert scaler.get_scale() == (8.0 if i < 3 else 16.0 if i < 6 else 32.0), i
    # an overflow restarts the count of good steps
    p.grad = np.array([np.inf, 0, 0], np.float32)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 16.0 and scaler.growth_tracker == 0


def test_unscale_comes_before_clipping_so_clipping_sees_the_true_gradients():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 5)).astype(np.float32)
    w = rng.standard_normal((3, 5)).astype(np.float32)

    def grads(scaler):
        layer = Linear(5, 3)
        layer.weight.data, layer.bias.data = w.copy(), np.zeros(3, np.float32)
        loss = ops.cross_entropy(layer(Tensor(x)), np.arange(8) % 3)
        scaler.scale(loss).backward()
        scaler.unscale_(layer.parameters())
        norm = clip_grad_norm_(layer.parameters(), 0.1)
        return norm, layer.weight.grad

    ref_norm, ref_grad = grads(GradScaler(enabled=False))
    norm, grad = grads(GradScaler(init_scale=4096.0))
    assert norm == pytest.approx(ref_norm, rel=1e-5)  # the unscaled norm, not 4096x it
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert np.linalg.norm(grad) <= 0.1 + 1e-6
    scaler = GradScaler()
    p = _param_with_grad([1, 2, 3])
    scaler.unscale_([p])
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_([p])


def test_scaler_state_round_trips_through_json_and_disabled_is_a_passthrough():
    a = GradScaler(init_scale=64.0, growth_interval=5)
    a.growth_tracker, a.skipped_steps = 3, 2
    b = GradScaler()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    with pytest.raises(ValueError, match="invalid scale"):
        b.load_state_dict({**a.state_dict(), "scale": float("inf")})
    off = GradScaler(enabled=False)
    loss = Tensor(np.float32(2.0))
    assert off.scale(loss) is loss and off.get_scale() == 1.0
    p = _param_with_grad([np.inf, 0, 0])
    opt = SGD([p], lr=0.0)
    with np.errstate(invalid="ignore"):
        assert off.unscale_(opt) is False and off.step(opt) is True  # disabled: the caller's checks decide
    off.update()


# ---- train_step: the one optimiser step of the training loop, doctor and benchmarks/gpu.py ------------------------
def test_train_step_is_the_plain_float32_step_when_the_scaler_is_off():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 5)).astype(np.float32)
    y = np.arange(8) % 3
    layers = [Linear(5, 3, rng=np.random.default_rng(1)) for _ in range(2)]
    opts = [SGD(layer.parameters(), lr=0.5, momentum=0.9) for layer in layers]
    for _ in range(3):
        opts[0].zero_grad()
        ops.cross_entropy(layers[0](Tensor(x)), y).backward()
        ref_norm = clip_grad_norm_(layers[0].parameters(), 0.2)
        opts[0].step()
        result = amp.train_step(opts[1], GradScaler(enabled=False),
                                lambda: (ops.cross_entropy(layers[1](Tensor(x)), y), "extra"), clip_grad_norm=0.2)
        assert result.stepped and not result.overflow and result.output == "extra"
        assert result.grad_norm == ref_norm
    for a, b in zip(layers[0].parameters(), layers[1].parameters()):
        np.testing.assert_array_equal(a.data, b.data)


def test_train_step_skips_an_overflow_but_raises_on_what_scaling_cannot_explain():
    start = np.array([1.0, -1.0, 0.0], np.float32)  # the losses below are 0: finite, however scaled
    p = Parameter(start.copy())
    opt = SGD([p], lr=0.1)
    scaler = GradScaler(init_scale=2.0 ** 40)
    with np.errstate(over="ignore"):
        result = amp.train_step(opt, scaler, lambda: (p * 1e30).sum())  # gradient 1e30 * 2**40 overflows float32
    assert result.overflow and not result.stepped and scaler.get_scale() == 2.0 ** 39
    np.testing.assert_array_equal(p.data, start)
    at_one = GradScaler(init_scale=1.0)
    with pytest.raises(NonFiniteLossError, match="loss scale at 1"), np.errstate(over="ignore"):
        amp.train_step(opt, at_one, lambda: (p * 1e38).sum() * 1e3)
    assert at_one.found_inf is None  # ready for the next step
    with pytest.raises(NonFiniteLossError):
        amp.train_step(opt, GradScaler(enabled=False), lambda: (p * np.float32(np.nan)).sum())
    with pytest.raises(NonFiniteLossError, match="gradient norm"), np.errstate(over="ignore", invalid="ignore"):
        amp.train_step(opt, GradScaler(enabled=False), lambda: (p * 3e38).sum() * 0.5, clip_grad_norm=1.0)
    np.testing.assert_array_equal(p.data, start)  # no failed step touched the parameters


# ---- the training loop -----------------------------------------------------------------------------------------
def _tiny_data(n_train: int = 48, n_val: int = 12, size: int = 12):
    rng = np.random.default_rng(0)
    colours = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200]], np.float32)

    def make(n):
        y = np.arange(n) % 3
        x = colours[y][:, None, None, :] + rng.normal(0, 25, (n, size, size, 3))
        return np.clip(x, 0, 255).astype(np.uint8), y.astype(np.int64)

    return make(n_train), make(n_val)


def _amp_cfg(epochs: int, **extra):
    sets = [f"train.epochs={epochs}", "train.min_steps=0",
            "train.batch_size=8", "model.widths=[8, 16]", "train.warmup_epochs=0",
            "train.lr=0.01", "train.device=cpu", "train.mixed_precision=on", "model.dropout=0.0"]
    return load_config(None, sets + [f"{k}={v}" for k, v in extra.items()])


def _run(tmp, cfg, resume=False):
    from leaflens.pipeline.train_student import TrainData, train_run

    (xt, yt), (xv, yv) = _tiny_data()
    mean, std = np.full(3, 0.5, np.float32), np.full(3, 0.25, np.float32)
    return train_run(tmp, cfg, TrainData(xt, yt), xv, yv, mean, std, 3, {"test": True}, resume=resume,
                     progress=False)


@pytest.fixture
def small_scaler(monkeypatch):
    """A scaler that starts too high (the first steps overflow in float16 and are skipped) and grows
    every 4 good steps, so a short run exercises back-off, growth and their state across a resume."""
    import leaflens.pipeline.training as training

    monkeypatch.setattr(training, "GradScaler", functools.partial(GradScaler, init_scale=2.0 ** 19, growth_interval=4))


def test_mixed_precision_training_on_cpu_learns_and_skips_overflow_steps_without_faults(tmp_path, small_scaler):
    result = _run(tmp_path / "run", _amp_cfg(3))
    assert result.mixed_precision and result.device == "cpu"
    rows = result.history
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[0]["amp_skipped_steps"] >= 1 and sum(r["skipped_steps"] for r in rows) == 0
    assert all("loss_scale" in r for r in rows)
    assert not (tmp_path / "run" / "faults.jsonl").exists()


def test_mixed_precision_resume_is_exact_including_the_loss_scale(tmp_path, monkeypatch, small_scaler):
    import leaflens.pipeline.training as training

    cfg = _amp_cfg(3)
    full = _run(tmp_path / "full", cfg)
    real = training.save_checkpoint
    calls = {"n": 0}

    def dying_save(path, *a, **k):
        real(path, *a, **k)
        if path.name == "last.npz":
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt("simulated crash after epoch 2")

    monkeypatch.setattr(training, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "cut", cfg)
    monkeypatch.setattr(training, "save_checkpoint", real)
    resumed = _run(tmp_path / "cut", cfg, resume=True)
    timing = {"images_per_s", "peak_rss_mb", "epoch_seconds"}
    strip = [{k: v for k, v in r.items() if k not in timing} for r in full.history]
    assert [{k: v for k, v in r.items() if k not in timing} for r in resumed.history] == strip
    a, b = np.load(tmp_path / "full" / "last.npz"), np.load(tmp_path / "cut" / "last.npz")
    for k in a.files:
        if k != "meta":
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    sa = json.loads(str(a["meta"]))["extra"]["train_state"]["grad_scaler"]
    sb = json.loads(str(b["meta"]))["extra"]["train_state"]["grad_scaler"]
    assert sa == sb and sa["skipped_steps"] >= 1


def test_precision_and_device_settings():
    from leaflens.engine.device_loader import resolve_device
    from leaflens.pipeline.train_student import resolve_precision

    assert resolve_precision("auto", "cuda") and not resolve_precision("auto", "cpu")
    assert resolve_precision("on", "cpu") and not resolve_precision("off", "cuda")
    with pytest.raises(ValueError, match="mixed_precision"):
        resolve_precision("fp8", "cuda")
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")


# ---- on a GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_mixed_precision_training_step_on_cupy_matches_float32():
    import cupy as cp

    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 5, 16)

    def step(device, use_amp):
        model = StudentCNN(5, widths=(16, 32), rng=np.random.default_rng(0))
        model.to(device)
        opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = GradScaler(init_scale=2.0 ** 10, enabled=use_amp)  # low enough not to overflow on step one
        xs = cp.asarray(x) if device == "cuda" else x
        ys = cp.asarray(y) if device == "cuda" else y
        with autocast(use_amp):
            logits = model(Tensor(xs))
            loss = ops.cross_entropy(logits, ys)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads = {n: cp.asnumpy(p.grad) if device == "cuda" else p.grad for n, p in model.named_parameters()}
        assert scaler.step(opt)
        scaler.update()
        for p in model.parameters():
            assert p.dtype == np.float32 and p.device == device
        return logits.dtype, float(loss.item()), grads

    _, loss_ref, ref = step("cpu", False)
    dt, loss, got = step("cuda", True)
    assert dt == np.float16
    assert loss == pytest.approx(loss_ref, rel=2e-2)
    for k in ref:  # float16 rounding through BatchNorm's backward: a few % here (NumPy float16 gives ~4 %)
        err = np.linalg.norm(got[k] - ref[k]) / np.linalg.norm(ref[k])
        assert err < 0.1, (k, err)


def test_a_float16_loss_trains_under_the_default_scale():
    """A loss written with plain arithmetic under autocast stays float16; scaled in float16 the default scale
    (2**16, past float16's largest value) made every loss inf and every step a NonFiniteLossError that never
    lowered the scale. Scaled in float32, the first step's gradient overflows and is skipped, then it trains."""
    from leaflens.engine import nn, optim

    rng = np.random.default_rng(0)
    lin = nn.Linear(4, 1, rng=rng)
    opt = optim.SGD(lin.parameters(), lr=0.01)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.standard_normal((8, 1)).astype(np.float16)
    scaler = amp.GradScaler()
    with amp.autocast():
        loss = (lin(Tensor(x)) - Tensor(y)).abs().mean()
    assert loss.dtype == np.float16 and np.isfinite(scaler.scale(loss).item())
    results = [amp.train_step(opt, scaler, lambda: (lin(Tensor(x)) - Tensor(y)).abs().mean()) for _ in range(4)]
    assert [r.overflow for r in results] == [True, False, False, False] and scaler.get_scale() == 2.0 ** 15
    assert all(r.stepped for r in results[1:])


def test_float16_bias_and_sum_gradients_accumulate_in_float32():
    # NumPy adds float16 along axis 0 one rounded step at a time: 16,384 rows of ~1 summed to 4096
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64, 64, 3)).astype(np.float32)
    gy = rng.uniform(0.75, 1.25, (4, 64, 64, 4)).astype(np.float32)
    conv = Conv2d(3, 4, 1)
    y = conv(Tensor(x))
    want = gy.reshape(-1, 4).sum(axis=0, dtype=np.float64)
    with autocast():
        y = conv(Tensor(x))
    assert y.dtype == np.float16
    y.backward(gy.astype(np.float16))
    np.testing.assert_allclose(conv.bias.grad, want, rtol=2e-3)
    lin = Linear(3, 4)
    with autocast():
        z = lin(Tensor(rng.standard_normal((8192, 3)).astype(np.float32)))
    gz = rng.uniform(0.75, 1.25, (8192, 4))
    z.backward(gz.astype(np.float16))
    np.testing.assert_allclose(lin.bias.grad, gz.astype(np.float16).astype(np.float64).sum(axis=0), rtol=2e-3)
    quarters = Tensor(np.full((16384, 2), 0.25, np.float16))
    assert quarters.sum(axis=0).data.tolist() == [4096.0, 4096.0]  # stalled at 512 before
