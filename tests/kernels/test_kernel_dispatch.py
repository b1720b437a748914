"""The engine's ops handing work to the CUDA kernels (engine/ops/_kernels.py).

Three layers:

* CPU, always: on NumPy arrays every dispatcher answers None/False and touches nothing, and the
  switches (``LEAFLENS_NO_KERNELS``, ``use_kernels``) behave.
* CPU emulator, always (where a C++20 compiler exists): the dispatch is pointed at NumPy arrays with
  ``leaflens.kernels._cuda`` patched to the host build of the real ``.cu`` sources, so each engine op runs its
  kernel branch end to end (argument preparation, saved state, backward) and must equal the same op
  with the kernels switched off.
* GPU (``gpu`` marker, skipped with the probe's reason without one): each wired op on CuPy arrays
  with the kernels equals the same op with the kernels off and the NumPy result, forward and
  backward, float32 and float16; a small CNN's training steps on CuPy give NumPy's losses.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from leaflens.engine import nn, ops
from leaflens.engine.backend import to_device
from leaflens.engine.nn.module import Parameter
from leaflens.engine.ops import _kernels as gpu
from leaflens.engine.optim import SGD, Adam, AdamW, ModelEMA
from leaflens.engine.tensor import Tensor
from leaflens.kernels import _cuda

TOL = {np.float32: dict(rtol=1e-4, atol=1e-5), np.float16: dict(rtol=2e-2, atol=3e-2)}
EMU_TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float16: dict(rtol=2e-2, atol=3e-2)}


def close(actual: Any, expected: Any, tol: dict[str, float]) -> None:
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), **tol)


def host(a: Any) -> np.ndarray:
    return np.asarray(to_device(a, "cpu"))


# ---- op cases: each runs forward + backward on arrays placed by ``put`` and returns host arrays -----
Put = Callable[[np.ndarray], Any]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _unary(fn: Callable[[Tensor], Tensor], shape: tuple[int, ...], scale: float, seed: int):
    def run(put: Put, dtype: Any) -> list[np.ndarray]:
        rng = _rng(seed)
        x = Tensor(put((rng.standard_normal(shape) * scale).astype(dtype)), requires_grad=True)
        y = fn(x)
        gy = rng.standard_normal(y.shape).astype(dtype)
        y.backward(put(gy))
        return [host(y.data), host(x.grad)]

    return run


def _xent(smoothing: float = 0.0, reduction: str = "mean", **kw: Any):
    def run(put: Put, dtype: Any) -> list[np.ndarray]:
        rng = _rng(11)
        z = Tensor(put((rng.standard_normal((6, 5)) * 3).astype(dtype)), requires_grad=True)
        t = rng.integers(0, 5, 6)
        if "ignore_index" in kw:
            t[1] = kw["ignore_index"]
        target = put(rng.dirichlet(np.ones(5), 6).astype(dtype)) if kw.get("soft") else put(t)
        extra = {k: v for k, v in kw.items() if k != "soft"}
        loss = ops.cross_entropy(z, target, label_smoothing=smoothing, reduction=reduction, **extra)
        gy = put(rng.standard_normal(loss.shape).astype(dtype) if loss.ndim else np.asarray(0.7, dtype))
        loss.backward(gy)
        return [host(loss.data), host(z.grad)]

    return run


def _conv(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: Any, padding: Any, groups: int = 1):
    def run(put: Put, dtype: Any) -> list[np.ndarray]:
        rng = _rng(13)
        x = Tensor(put(rng.standard_normal(x_shape).astype(dtype)), requires_grad=True)
        w = Tensor(put((rng.standard_normal(w_shape) * 0.3).astype(dtype)), requires_grad=True)
        b = Tensor(put(rng.standard_normal(w_shape[0]).astype(dtype)), requires_grad=True)
        y = ops.conv2d(x, w, b, stride=stride, padding=padding, groups=groups)
        y.backward(put(rng.standard_normal(y.shape).astype(dtype)))
        return [host(y.data), host(x.grad), host(w.grad), host(b.grad)]

    return run


# name -> (case, kernel families it must dispatch)
CASES: dict[str, tuple[Callable[[Put, Any], list[np.ndarray]], set[str]]] = {
    "xent_mean": (_xent(), {"softmax_xent"}),
    "xent_sum_smoothed": (_xent(0.1, "sum"), {"softmax_xent"}),
    "xent_ignore_index": (_xent(ignore_index=3), {"softmax_xent"}),
    "xent_ignore_minus1_smoothed": (_xent(0.1, ignore_index=-1), {"softmax_xent"}),
    "xent_ignore_minus1_sum": (_xent(0.0, "sum", ignore_index=-1), {"softmax_xent"}),
    "xent_soft_targets": (_xent(soft=True), {"softmax_xent"}),
    "xent_soft_targets_sum": (_xent(0.0, "sum", soft=True), {"softmax_xent"}),
    "xent_soft_targets_smoothed": (_xent(0.1, soft=True), {"softmax_xent"}),  # smoothed targets, then the kernel
    "relu": (_unary(ops.relu, (3, 4, 5), 2.0, 1), {"activation_grad"}),
    "leaky_relu": (_unary(lambda v: ops.leaky_relu(v, 0.2), (3, 4, 5), 2.0, 2), {"activation_grad"}),
    "relu6": (_unary(ops.relu6, (3, 4, 5), 5.0, 3), {"activation_grad"}),
    "l2norm": (_unary(lambda v: ops.l2_normalize(v, axis=-1), (4, 3, 16), 1.0, 4), {"l2norm"}),
    "maxpool_2x2": (_unary(lambda v: ops.max_pool2d(v, 2), (2, 6, 6, 3), 1.0, 5), {"maxpool"}),
    "maxpool_3x3_s2_p1": (_unary(lambda v: ops.max_pool2d(v, 3, 2, 1), (2, 7, 7, 3), 1.0, 6), {"maxpool"}),
    "maxpool_same": (_unary(lambda v: ops.max_pool2d(v, 3, 2, "same"), (1, 6, 5, 2), 1.0, 7), {"maxpool"}),
    "conv_3x3_p1": (_conv((2, 5, 5, 4), (6, 4, 3, 3), 1, 1), {"im2col", "col2im"}),
    "conv_3x3_s2_same": (_conv((2, 6, 5, 3), (4, 3, 3, 3), 2, "same"), {"im2col", "col2im"}),
    "conv_grouped": (_conv((1, 5, 5, 4), (6, 2, 3, 3), 1, 1, groups=2), {"im2col", "col2im"}),
}

# Cases the kernels do not cover: with dispatch on they must still run the xp code and agree.
FALLBACKS: dict[str, Callable[[Put, Any], list[np.ndarray]]] = {
    "xent_reduction_none": _xent(reduction="none"),
    "leaky_relu_slope_0": _unary(lambda v: ops.leaky_relu(v, 0.0), (3, 5), 2.0, 8),
    "l2norm_axis_0": _unary(lambda v: ops.l2_normalize(v, axis=0), (6, 4), 1.0, 9),
    "conv_1x1": _conv((2, 4, 4, 3), (5, 3, 1, 1), 1, 0),  # a reshape, no im2col
    "conv_depthwise": _conv((2, 5, 5, 3), (3, 1, 3, 3), 1, 1, groups=3),
}


def _run(case: Callable[[Put, Any], list[np.ndarray]], put: Put, dtype: Any, enabled: bool):
    before = gpu.dispatch_counts()
    with gpu.use_kernels(enabled):
        out = case(put, dtype)
    return out, gpu.dispatch_counts() - before


# ---- CPU: NumPy never dispatches ---------------------------------------------------------------------
def test_numpy_arrays_never_dispatch():
    x4 = np.ones((1, 4, 4, 2), np.float32)
    v = np.ones((3, 4), np.float32)
    assert not gpu.active(np)
    assert gpu.softmax_xent_forward(np, v, np.zeros(3, np.int64), 0.0, None, "mean") is None
    assert gpu.activation_grad(np, "relu", v, v) is None
    assert gpu.l2norm_forward(np, v, -1, 1e-12) is None
    assert gpu.maxpool_forward(np, x4, (2, 2), (2, 2), (0, 0, 0, 0)) is None
    assert gpu.im2col(np, x4, (3, 3), (1, 1)) is None
    assert gpu.col2im(np, np.ones((4, 18), np.float32), (1, 4, 4, 2), (3, 3), (1, 1)) is None
    state: dict[str, Any] = {}
    p = np.ones(4, np.float32)
    assert not gpu.sgd_step(np, p, p, state, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)
    assert not gpu.adam_step(np, p, p, np.zeros(4, np.float32), np.zeros(4, np.float32), 1, lr=0.1, beta1=0.9,
                             beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
    assert state == {} and (p == 1).all()


def test_numpy_ops_do_not_count_dispatches():
    before = gpu.dispatch_counts()
    for case, _families in CASES.values():
        case(np.asarray, np.float32)
    assert gpu.dispatch_counts() == before


def test_switches(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(gpu.DISABLE_ENV, raising=False)
    assert gpu.kernels_enabled()
    monkeypatch.setenv(gpu.DISABLE_ENV, "1")
    assert not gpu.kernels_enabled()
    with gpu.use_kernels(True):
        assert gpu.kernels_enabled()
        with gpu.use_kernels(False):
            assert not gpu.kernels_enabled()
        assert gpu.kernels_enabled()
    assert not gpu.kernels_enabled()
    monkeypatch.setenv(gpu.DISABLE_ENV, "0")
    assert gpu.kernels_enabled()
    with gpu.use_kernels(False):
        assert not gpu.active(np)


def test_switch_is_per_thread(monkeypatch: pytest.MonkeyPatch):
    """Two threads hold different settings at the same time; a third, outside any ``use_kernels``,
    follows the environment default; each thread's setting is restored when its block ends."""
    monkeypatch.delenv(gpu.DISABLE_ENV, raising=False)
    inside = threading.Barrier(3)  # both blocks are open while every thread looks
    seen: dict[str, list[bool]] = {}

    def worker(name: str, setting: bool | None) -> None:
        ctx = gpu.use_kernels(setting) if setting is not None else contextlib.nullcontext()
        with ctx:
            inside.wait(timeout=10)
            before = gpu.kernels_enabled()
            inside.wait(timeout=10)
        seen[name] = [before, gpu.kernels_enabled()]

    threads = [threading.Thread(target=worker, args=args) for args in (("off", False), ("on", True),
                                                                          ("default", None))]
    with gpu.use_kernels(False):  # the main thread's own setting reaches none of them
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not gpu.kernels_enabled()
    assert seen == {"off": [False, True], "on": [True, True], "default": [True, True]}
    monkeypatch.setenv(gpu.DISABLE_ENV, "1")  # the environment is every thread's default
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(gpu.kernels_enabled()))
    t.start()
    t.join(timeout=20)
    assert out == [False]


# ---- CPU emulator: the kernel branch of every op, end to end ------------------------------------------
@pytest.fixture
def emulated(emulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Dispatch NumPy arrays to the emulated kernels (the real .cu sources built for the host)."""
    monkeypatch.setattr(_cuda, "cupy_module", lambda: np)
    monkeypatch.setattr(_cuda, "load_kernel", emulator.load_kernel)
    monkeypatch.setattr(gpu, "_EMULATE_ON_NUMPY", True)
    monkeypatch.delenv(gpu.DISABLE_ENV, raising=False)
    yield


def _copy_put(a: np.ndarray) -> np.ndarray:
    return np.array(a, copy=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_kernel_branch_matches_xp_path(emulated, name: str, dtype: Any):
    case, families = CASES[name]
    got, hits = _run(case, _copy_put, dtype, enabled=True)
    want, none = _run(case, _copy_put, dtype, enabled=False)
    assert families <= set(hits), f"{name}: dispatched {dict(hits)}, expected {families}"
    assert not none
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        close(g, w, EMU_TOL[dtype])


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_emulated_unsupported_cases_fall_back(emulated, name: str):
    case = FALLBACKS[name]
    got, hits = _run(case, _copy_put, np.float32, enabled=True)
    want, _ = _run(case, _copy_put, np.float32, enabled=False)
    assert not hits, f"{name}: dispatched {dict(hits)}"
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_emulated_cross_entropy_rejects_bad_targets_like_the_xp_path(emulated):
    z = Tensor(np.zeros((2, 3), np.float32), requires_grad=True)
    with pytest.raises(ValueError, match=r"target class 3 is outside \[0, 3\)"):
        ops.cross_entropy(z, np.array([0, 3]))
    with pytest.raises(ValueError, match=r"target class -2 is outside \[0, 3\)"):
        ops.cross_entropy(z, np.array([-1, -2]), ignore_index=-1)
    before = gpu.dispatch_counts()
    ops.cross_entropy(z, np.array([-1, 2]), ignore_index=-1)  # the ignore index itself is fine
    assert (gpu.dispatch_counts() - before)["softmax_xent"] == 1


def _distill_setup(label_smoothing: float):
    from leaflens.pipeline.config import load_config  # noqa: PLC0415
    from leaflens.pipeline.models.student import StudentCNN  # noqa: PLC0415

    cfg = load_config(None, ["distill.kd_weight=1.0", "distill.alpha=0.5", "distill.temperature=3.0"])
    rng = _rng(9)
    x = rng.standard_normal((6, 8, 8, 3)).astype(np.float32)
    y = np.array([0, -1, 2, -1, 1, 3], np.int64)  # -1: unlabelled photos, as the pipeline passes them
    feats = rng.standard_normal((6, 5)).astype(np.float32)
    tlogits = (rng.standard_normal((6, 4)) * 2).astype(np.float32)
    model = StudentCNN(4, widths=(4,), teacher_dim=5, rng=np.random.default_rng(1))
    return model, x, y, feats, tlogits, cfg.distill, label_smoothing


@pytest.mark.parametrize("with_features", [True, False], ids=["ce_and_kd", "ce_only"])
def test_emulated_distill_loss_runs_the_fused_kernel(emulated, with_features: bool):
    """The student's real loss (pipeline/train_student.py distill_loss: cross-entropy with ignore_index=-1
    and label smoothing, and the KD term against softmax(teacher / T)) takes the fused kernel for every
    cross-entropy it computes, and gives the xp path's loss and gradients."""
    from leaflens.pipeline.train_student import distill_loss  # noqa: PLC0415

    results = {}
    for enabled in (True, False):
        model, x, y, feats, tlogits, dcfg, smoothing = _distill_setup(0.1)
        before = gpu.dispatch_counts()
        with gpu.use_kernels(enabled):
            loss, parts, _ = distill_loss(model, x, y, feats if with_features else None,
                                          tlogits if with_features else None, dcfg, smoothing)
            loss.backward()
        hits = gpu.dispatch_counts() - before
        results[enabled] = (float(loss.data), parts, [host(p.grad) for p in model.parameters()], hits)
    (l_on, parts_on, g_on, hits), (l_off, parts_off, g_off, none) = results[True], results[False]
    assert hits["softmax_xent"] == (2 if with_features else 1), dict(hits)  # ce (+ kd): every one fused
    assert not none
    assert l_on == pytest.approx(l_off, rel=1e-5)
    assert parts_on.keys() == parts_off.keys()
    for k in parts_on:
        assert parts_on[k] == pytest.approx(parts_off[k], rel=1e-5, abs=1e-6), k
    for a, b in zip(g_on, g_off):
        close(a, b, dict(rtol=1e-4, atol=1e-6))


def test_conv_helpers_with_pads_equal_padding_first():
    """``im2col``/``col2im`` given ``pads`` (the GPU branch's call) equal padding first / cropping after on
    the xp path, which is where they land whenever the kernel does not apply."""
    from leaflens.engine.ops import conv  # noqa: PLC0415

    rng = _rng(17)
    x = rng.standard_normal((2, 5, 6, 3)).astype(np.float32)
    pads, kernel, stride, out_hw = (1, 2, 0, 1), (3, 2), (2, 1), (3, 6)
    xpad = conv.pad_nhwc(x, pads)
    want = conv.im2col(xpad, kernel, out_hw, stride)
    np.testing.assert_array_equal(conv.im2col(x, kernel, out_hw, stride, pads), want)
    g = rng.standard_normal(want.shape).astype(np.float32)
    full = conv.col2im(g, xpad.shape, kernel, out_hw, stride)
    np.testing.assert_array_equal(conv.col2im(g, xpad.shape, kernel, out_hw, stride, pads), full[:, 1:6, 0:6])


@pytest.mark.parametrize("name", ["conv_3x3_p1", "conv_3x3_s2_same", "conv_grouped"])
def test_emulated_conv_makes_no_padded_copy(emulated, monkeypatch: pytest.MonkeyPatch, name: str):
    """With the kernels, a padded dense or grouped convolution never builds a padded copy of its input:
    im2col/col2im read and drop the padding themselves (the results equal the xp path: see above)."""
    from leaflens.engine.ops import conv  # noqa: PLC0415

    calls: list[tuple[int, ...]] = []
    real_pad = conv.pad_nhwc

    def counting_pad(x: Any, pads: tuple[int, int, int, int], value: float = 0.0) -> Any:
        calls.append(tuple(pads))
        return real_pad(x, pads, value)

    monkeypatch.setattr(conv, "pad_nhwc", counting_pad)
    case, _ = CASES[name]
    _run(case, _copy_put, np.float32, enabled=True)
    assert not calls
    _run(case, _copy_put, np.float32, enabled=False)
    assert calls  # the xp path pads (so the check above can fail)


def _opt_run(make: Callable[[list[Parameter]], Any], enabled: bool, steps: int = 3) -> tuple[list, list]:
    rng = _rng(21)
    params = [Parameter(rng.standard_normal(s).astype(np.float32)) for s in [(4, 3, 3, 2), (7,), (5, 6)]]
    opt = make(params)
    with gpu.use_kernels(enabled):
        for _ in range(steps):
            for i, p in enumerate(params):
                g = rng.standard_normal(p.shape).astype(np.float32)
                p.grad = g.T.copy().T if i == 2 else g  # one Fortran-ordered gradient: must be made contiguous
            opt.step()
    return [p.data for p in params], [v for st in opt.state.values() for v in st.values()]


OPTIMISERS: dict[str, tuple[Callable[[list[Parameter]], Any], str | None]] = {
    "sgd_momentum": (lambda ps: SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3), "sgd_momentum"),
    "sgd_nesterov": (lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True), "sgd_momentum"),
    "sgd_plain": (lambda ps: SGD(ps, lr=0.05), None),  # no momentum: stays on xp
    "sgd_dampening": (lambda ps: SGD(ps, lr=0.05, momentum=0.9, dampening=0.5), None),  # kernel has none
    "adam_l2": (lambda ps: Adam(ps, lr=1e-2, weight_decay=0.1), "adamw"),
    "adamw": (lambda ps: AdamW(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05), "adamw"),
}


@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_emulated_fused_optimisers_match_xp_path(emulated, name: str):
    make, family = OPTIMISERS[name]
    before = gpu.dispatch_counts()
    got, got_state = _opt_run(make, enabled=True)
    hits = gpu.dispatch_counts() - before
    want, want_state = _opt_run(make, enabled=False)
    assert (hits[family] == 9) if family else not hits, dict(hits)
    for g, w in zip(got, want):
        close(g, w, dict(rtol=1e-5, atol=1e-6))
    assert len(got_state) == len(want_state)  # same state entries (momentum buffers, moments, step)
    for g, w in zip(got_state, want_state):
        assert np.shape(g) == np.shape(w)
        close(g, w, dict(rtol=1e-5, atol=1e-6))


def test_emulated_weight_average_matches_xp_path(emulated):
    """ModelEMA takes the fused ``ema`` kernel for every float32 array (parameters and BatchNorm statistics)
    and only then; the averages equal the xp path's."""
    results = {}
    for enabled in (True, False):
        rng = _rng(22)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, rng=rng), nn.BatchNorm2d(4))
        ema = ModelEMA(model, 0.9)
        with gpu.use_kernels(enabled):
            before = gpu.dispatch_counts()
            for _ in range(3):
                for p in model.parameters():
                    p.data += rng.standard_normal(p.data.shape).astype(np.float32)
                ema.update(model)
            results[enabled] = ({k: host(v) for k, v in ema.shadow.items()}, gpu.dispatch_counts() - before)
    (on, hits), (off, none) = results[True], results[False]
    assert hits["ema"] == 3 * len(on) and not none, (dict(hits), dict(none))
    for k in on:
        close(on[k], off[k], dict(rtol=1e-6, atol=1e-7))


def _tiny_cnn() -> nn.Module:
    rng = np.random.default_rng(3)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, rng=rng), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 6, 3, padding=1, rng=rng), nn.ReLU6(), nn.GlobalAvgPool2d(),
                         nn.Linear(6, 3, rng=rng))


def _train(model: nn.Module, opt: Any, x: Any, y: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ops.cross_entropy(model(Tensor(x)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_emulated_cnn_training_step_matches_xp_path(emulated):
    rng = _rng(5)
    x = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
    y = rng.integers(0, 3, 2)
    results = {}
    for enabled in (True, False):
        model = _tiny_cnn()
        with gpu.use_kernels(enabled):
            before = gpu.dispatch_counts()
            losses = _train(model, AdamW(model.parameters(), lr=1e-2), x, y, steps=2)
            results[enabled] = (losses, [host(p.data) for p in model.parameters()], gpu.dispatch_counts() - before)
    (l_on, p_on, hits), (l_off, p_off, none) = results[True], results[False]
    assert {"softmax_xent", "activation_grad", "maxpool", "im2col", "col2im", "adamw"} <= set(hits), dict(hits)
    assert not none
    np.testing.assert_allclose(l_on, l_off, rtol=1e-5)
    for a, b in zip(p_on, p_off):
        close(a, b, dict(rtol=1e-4, atol=1e-5))


# ---- GPU: CuPy with kernels == CuPy without == NumPy ------------------------------------------------
@pytest.fixture
def cupy_put(monkeypatch: pytest.MonkeyPatch) -> Put:
    monkeypatch.delenv(gpu.DISABLE_ENV, raising=False)
    return lambda a: to_device(np.asarray(a), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_kernel_ops_match_xp_and_numpy(cupy_put: Put, name: str, dtype: Any):
    case, families = CASES[name]
    got, hits = _run(case, cupy_put, dtype, enabled=True)
    xp_cupy, none = _run(case, cupy_put, dtype, enabled=False)
    ref = case(np.asarray, dtype)
    assert families <= set(hits), f"{name}: dispatched {dict(hits)}, expected {families}"
    assert not none
    for g, c, r in zip(got, xp_cupy, ref):
        assert g.dtype == c.dtype == r.dtype and g.shape == c.shape == r.shape
        close(g, c, TOL[dtype])
        close(g, r, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_gpu_unsupported_cases_fall_back(cupy_put: Put, name: str):
    case = FALLBACKS[name]
    got, _ = _run(case, cupy_put, np.float32, enabled=True)
    ref = case(np.asarray, np.float32)
    for g, r in zip(got, ref):
        close(g, r, TOL[np.float32])


@pytest.mark.gpu
def test_gpu_environment_switch_disables_dispatch(cupy_put: Put, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(gpu.DISABLE_ENV, "1")
    before = gpu.dispatch_counts()
    CASES["xent_mean"][0](cupy_put, np.float32)
    assert gpu.dispatch_counts() == before


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_gpu_fused_optimisers_match_numpy(cupy_put: Put, name: str):
    make, family = OPTIMISERS[name]
    want, want_state = _opt_run(make, enabled=True)  # NumPy parameters: the xp path
    rng = _rng(21)
    params = [Parameter(cupy_put(rng.standard_normal(s).astype(np.float32))) for s in [(4, 3, 3, 2), (7,), (5, 6)]]
    opt = make(params)
    before = gpu.dispatch_counts()
    for _ in range(3):
        for i, p in enumerate(params):
            g = rng.standard_normal(p.shape).astype(np.float32)
            p.grad = cupy_put(g)
            if i == 2:
                p.grad = p.grad.T.copy().T  # Fortran-ordered on the device too
        opt.step()
    hits = gpu.dispatch_counts() - before
    assert (hits[family] == 9) if family else not hits, dict(hits)
    for p, w in zip(params, want):
        close(host(p.data), w, TOL[np.float32])
    got_state = [v for st in opt.state.values() for v in st.values()]
    for g, w in zip(got_state, want_state):
        close(host(g), w, TOL[np.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("optimiser", ["sgd", "adamw"])
def test_gpu_cnn_training_steps_match_numpy(cupy_put: Put, optimiser: str):
    rng = _rng(8)
    x = rng.standard_normal((8, 12, 12, 3)).astype(np.float32)
    y = rng.integers(0, 3, 8)

    def make_opt(model: nn.Module) -> Any:
        if optimiser == "sgd":
            return SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        return AdamW(model.parameters(), lr=1e-3)

    cpu_model = _tiny_cnn()
    cpu_losses = _train(cpu_model, make_opt(cpu_model), x, y, steps=3)
    gpu_model = _tiny_cnn().to("cuda")
    before = gpu.dispatch_counts()
    gpu_losses = _train(gpu_model, make_opt(gpu_model), cupy_put(x), cupy_put(y), steps=3)
    hits = gpu.dispatch_counts() - before
    expected = {"softmax_xent", "activation_grad", "maxpool", "im2col", "col2im"}
    expected.add("sgd_momentum" if optimiser == "sgd" else "adamw")
    assert expected <= set(hits), dict(hits)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
    for a, b in zip(gpu_model.parameters(), cpu_model.parameters()):
        close(host(a.data), host(b.data), dict(rtol=1e-3, atol=1e-4))


@pytest.mark.gpu
def test_gpu_distill_loss_runs_the_fused_kernel_and_matches_numpy(cupy_put: Put):
    """On CuPy the student's real loss (ce with ignore_index=-1 and smoothing, KD on soft targets) runs
    the fused kernel for both cross-entropies and gives NumPy's loss and gradients."""
    from leaflens.pipeline.train_student import distill_loss  # noqa: PLC0415

    model, x, y, feats, tlogits, dcfg, smoothing = _distill_setup(0.1)
    ref, _, _ = distill_loss(model, x, y, feats, tlogits, dcfg, smoothing, any_labelled=True)
    ref.backward()
    want = [host(p.grad) for p in model.parameters()]
    model, *_ = _distill_setup(0.1)
    model.to("cuda")
    before = gpu.dispatch_counts()
    loss, _, _ = distill_loss(model, cupy_put(x), cupy_put(y), cupy_put(feats), cupy_put(tlogits), dcfg, smoothing,
                              any_labelled=True)
    loss.backward()
    assert (gpu.dispatch_counts() - before)["softmax_xent"] == 2
    close(host(loss.data), host(ref.data), TOL[np.float32])
    for p, w in zip(model.parameters(), want):
        close(host(p.grad), w, dict(rtol=1e-3, atol=1e-5))
