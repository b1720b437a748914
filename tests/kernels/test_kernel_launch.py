"""Each ``*_cuda`` wrapper + ``.cu`` kernel against the engine's CPU function that defines its maths.

Runs twice per case: on the CPU emulator (the real kernel source built for the host; always) and on a
real GPU (marked ``gpu``; skipped with the probe's reason where there is none). The expected values come
from the engine's NumPy path (the one definition of each kernel's maths), computed in float32 from the
same inputs; what only the kernels have (cross-entropy ``stats``, max-pool tap indices, ``grad_scale``,
masking a NaN/inf upstream gradient, a NaN winning a pool window) is checked against explicit maths.
Tolerances: rtol 1e-4 for float32, looser for float16 (storage rounding), as the kernels accumulate in
float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

from leaflens.engine import nn, ops
from leaflens.engine.nn.module import Parameter
from leaflens.engine.ops.conv import col2im, im2col, pad_nhwc
from leaflens.engine.ops.norm import L2Normalize
from leaflens.engine.optim import SGD, AdamW, ModelEMA
from leaflens.engine.tensor import Tensor
from leaflens.kernels.activation_grad import activation_grad_cuda
from leaflens.kernels.fused_optim import adamw_cuda, ema_cuda, sgd_momentum_cuda
from leaflens.kernels.im2col import col2im_cuda, conv_output_size, im2col_cuda
from leaflens.kernels.l2norm import l2norm_backward_cuda, l2norm_forward_cuda
from leaflens.kernels.maxpool import maxpool_backward_cuda, maxpool_forward_cuda
from leaflens.kernels.sgemm import sgemm_cuda
from leaflens.kernels.softmax_xent import softmax_xent_backward_cuda, softmax_xent_forward_cuda

TOL = {np.float32: dict(rtol=1e-4, atol=1e-6), np.float16: dict(rtol=2e-3, atol=2e-3)}


def close(actual: np.ndarray, expected: np.ndarray, dtype=np.float32, **kw) -> None:
    tol = dict(TOL[np.dtype(dtype).type])
    tol.update(kw)
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), **tol)


def f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


@contextlib.contextmanager
def launched(backend, cu_file: str, kernel: str) -> Iterator[None]:
    """On the emulator: the block must launch ``kernel`` (which variant ran is not visible on a GPU)."""
    def count() -> int:
        k = backend.emulator.kernels.get((cu_file, kernel)) if backend.emulator is not None else None
        return k.launches if k is not None else 0

    before = count()
    yield
    if backend.emulator is not None:
        assert count() > before, f"{kernel} was not launched"


# ---- the engine's functions, on NumPy float32 copies of the kernel's inputs ----------------------------
def engine_xent(logits: np.ndarray, targets: np.ndarray, smoothing: float, grad: float, ignore_index=None,
                reduction: str = "mean") -> tuple[float, np.ndarray]:
    """(loss, gradient for upstream ``grad``) of the engine's cross_entropy."""
    z = Tensor(f32(logits), requires_grad=True)
    loss = ops.cross_entropy(z, targets, label_smoothing=smoothing, ignore_index=ignore_index, reduction=reduction)
    loss.backward(np.float32(grad))
    return float(loss.data), z.grad


def log_sum_exp(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    m = z.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]


def engine_activation_grad(kind: str, y: np.ndarray, gy: np.ndarray, slope: float) -> np.ndarray:
    """The engine's backward for an activation whose output is ``y`` (x is chosen to give exactly y's signs)."""
    y32 = f32(y)
    fn = {"relu": ops.relu, "leaky_relu": lambda v: ops.leaky_relu(v, slope), "relu6": ops.relu6}[kind]
    x = Tensor(np.where(y32 > 0, y32, y32 / np.float32(slope)) if kind == "leaky_relu" else y32, requires_grad=True)
    fn(x).backward(f32(gy))
    return x.grad


def engine_l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """y of the engine's l2_normalize over the last axis."""
    return ops.l2_normalize(Tensor(f32(x)), axis=-1, eps=eps).data


def engine_l2norm_backward(y: np.ndarray, gy: np.ndarray, norm: np.ndarray, eps: float) -> np.ndarray:
    """The engine's L2Normalize backward for the kernel's own inputs (its saved y and row norms), so a
    float16 y's storage rounding enters both sides alike."""
    fn = L2Normalize(-1, eps)
    norm = f32(norm)[..., None]
    fn.y, fn.denom, fn.clamped = f32(y), np.maximum(norm, np.float32(eps)), norm < eps
    return fn.backward(f32(gy))


def engine_im2col(x: np.ndarray, kernel, stride, padding) -> np.ndarray:
    ho, wo = conv_output_size(x.shape[1], x.shape[2], kernel, stride, padding)
    return im2col(pad_nhwc(x, padding), kernel, (ho, wo), stride)


def engine_col2im(cols: np.ndarray, shape, kernel, stride, padding) -> np.ndarray:
    (n, h, w, c), (pt, pb, pl, pr) = shape, padding
    ho, wo = conv_output_size(h, w, kernel, stride, padding)
    gx = col2im(f32(cols), (n, h + pt + pb, w + pl + pr, c), kernel, (ho, wo), stride)
    return gx[:, pt:pt + h, pl:pl + w, :]


def engine_maxpool(x: np.ndarray, gy: np.ndarray, kernel, stride, padding) -> tuple[np.ndarray, np.ndarray]:
    """(y, gradient) of the engine's max_pool2d."""
    xt = Tensor(f32(x), requires_grad=True)
    y = ops.max_pool2d(xt, kernel, stride, padding)
    y.backward(f32(gy))
    return y.data, xt.grad


def maxpool_by_loops(x: np.ndarray, kernel, stride, padding) -> tuple[np.ndarray, np.ndarray]:
    """(y, tap index) by the definition: padding is -inf, the first maximum wins, the first NaN wins."""
    (kh, kw), (sh, sw), (pt, _pb, pl, _pr) = kernel, stride, padding
    n, h, w, c = x.shape
    ho, wo = conv_output_size(h, w, kernel, stride, padding)
    y = np.zeros((n, ho, wo, c), x.dtype)
    idx = np.zeros((n, ho, wo, c), np.uint8)
    for b in range(n):
        for oh in range(ho):
            for ow in range(wo):
                for ch in range(c):
                    best, arg = -np.inf, 0
                    for t in range(kh * kw):
                        hh, ww = oh * sh - pt + t // kw, ow * sw - pl + t % kw
                        v = float(x[b, hh, ww, ch]) if 0 <= hh < h and 0 <= ww < w else -np.inf
                        if np.isnan(v):
                            best, arg = v, t
                            break
                        if v > best:  # strictly greater: the first maximum wins
                            best, arg = v, t
                    y[b, oh, ow, ch], idx[b, oh, ow, ch] = best, arg
    return y, idx


# ---- SGEMM ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,k,n", [(70, 33, 65), (1, 1, 1), (64, 16, 64), (5, 0, 3), (3, 40, 130)])
def test_sgemm_matches_the_matrix_product(backend, m, k, n):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = backend.get(sgemm_cuda(backend.put(a), backend.put(b)))
    assert c.dtype == np.float32 and c.shape == (m, n)
    close(c, a.astype(np.float64) @ b.astype(np.float64), atol=1e-5)


def test_sgemm_rejects_bad_arguments(backend):
    a = backend.put(np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match="inner dimensions"):
        sgemm_cuda(a, backend.put(np.ones((4, 2), np.float32)))
    with pytest.raises(TypeError, match="b has dtype float64"):
        sgemm_cuda(a, backend.put(np.ones((3, 2), np.float64)))
    with pytest.raises(ValueError, match="C-contiguous"):
        sgemm_cuda(a, backend.put(np.ones((2, 3), np.float32)).T)
    with pytest.raises(TypeError, match="must be a"):
        sgemm_cuda(a, [[1.0]])


# ---- softmax + cross-entropy ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n,c,smoothing", [(7, 3, 0.0), (5, 300, 0.1), (3, 1, 0.0), (4, 1000, 0.0)])
def test_softmax_xent_hard_targets(backend, dtype, n, c, smoothing):
    rng = np.random.default_rng(n + c)
    logits = (rng.standard_normal((n, c)) * 4 + 30).astype(dtype)  # offset: stability needs the max shift
    targets = rng.integers(0, c, size=n).astype(np.int64)
    loss, stats = softmax_xent_forward_cuda(backend.put(logits), backend.put(targets), label_smoothing=smoothing)
    want_loss, want_d = engine_xent(logits, targets, smoothing, 0.5)
    close(backend.get(stats), np.stack([log_sum_exp(f32(logits)), np.ones(n)], axis=1))  # smoothed rows sum to 1
    close(float(backend.get(loss)), want_loss, atol=1e-5)
    grad = backend.put(np.array(0.5, np.float32))
    d = softmax_xent_backward_cuda(backend.put(logits), backend.put(targets), stats, grad, smoothing)
    assert backend.get(d).dtype == dtype
    close(backend.get(d), want_d.astype(dtype), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softmax_xent_soft_targets(backend, dtype):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 37)).astype(dtype)
    q = rng.random((6, 37)).astype(np.float32)
    q[:3] /= q[:3].sum(axis=1, keepdims=True)  # half the rows sum to one, half do not
    loss, stats = softmax_xent_forward_cuda(backend.put(logits), backend.put(q))
    want_loss, want_d = engine_xent(logits, q, 0.0, 1.0)  # the engine's gradient is exact for any row mass too
    close(float(backend.get(loss)), want_loss)
    close(backend.get(stats), np.stack([log_sum_exp(f32(logits)), q.sum(axis=1)], axis=1))
    d = softmax_xent_backward_cuda(backend.put(logits), backend.put(q), stats, 1.0)
    close(backend.get(d), want_d.astype(dtype), dtype)


def test_softmax_xent_soft_targets_with_a_masked_class(backend):
    logits = np.array([[-np.inf, 0.0, 0.0], [1.0, -np.inf, 2.0]], np.float32)  # a class masked out per row
    q = np.array([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]], np.float32)  # no target mass on the masked classes
    loss, stats = softmax_xent_forward_cuda(backend.put(logits), backend.put(q))
    want_loss, want_d = engine_xent(logits, q, 0.0, 1.0)
    assert np.isfinite(want_loss)
    close(float(backend.get(loss)), want_loss)
    d = softmax_xent_backward_cuda(backend.put(logits), backend.put(q), stats, 1.0)
    close(backend.get(d), want_d)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore_index,smoothing", [(-1, 0.0), (-1, 0.1), (2, 0.05)])
def test_softmax_xent_ignore_index(backend, dtype, reduction, ignore_index, smoothing):
    """Ignored rows add nothing, are left out of the mean's count and get a zero gradient (the engine's
    generic path defines it); -1 is what the student's loss passes for unlabelled photos, and an index
    inside [0, C) is ignored the same way."""
    rng = np.random.default_rng(7)
    n, c = 9, 5
    logits = (rng.standard_normal((n, c)) * 3).astype(dtype)
    targets = rng.integers(0, c, size=n).astype(np.int64)
    targets[[1, 4, 5]] = ignore_index
    loss, stats = softmax_xent_forward_cuda(backend.put(logits), backend.put(targets), smoothing,
                                            ignore_index=ignore_index, reduction=reduction)
    want_loss, want_d = engine_xent(logits, targets, smoothing, 0.5, ignore_index, reduction)
    mass = (targets != ignore_index).astype(np.float64)
    close(backend.get(stats), np.stack([log_sum_exp(f32(logits)), mass], axis=1))
    close(float(backend.get(loss)), want_loss, atol=1e-5)
    d = backend.get(softmax_xent_backward_cuda(backend.put(logits), backend.put(targets), stats,
                                               backend.put(np.array(0.5, np.float32)), smoothing,
                                               ignore_index=ignore_index, reduction=reduction))
    assert (d[[1, 4, 5]] == 0).all()
    close(d, want_d.astype(dtype), dtype)


def test_softmax_xent_every_row_ignored(backend):
    """The engine's mean divides by max(count, 1): all rows ignored gives loss 0 and zero gradients."""
    logits = backend.put(np.ones((3, 4), np.float32))
    targets = backend.put(np.full(3, -1, np.int64))
    loss, stats = softmax_xent_forward_cuda(logits, targets, ignore_index=-1)
    assert float(backend.get(loss)) == 0.0
    d = softmax_xent_backward_cuda(logits, targets, stats, 1.0, ignore_index=-1)
    np.testing.assert_array_equal(backend.get(d), np.zeros((3, 4), np.float32))


@pytest.mark.parametrize("soft", [False, True], ids=["hard", "soft"])
def test_softmax_xent_64_bit_index_variant(backend, monkeypatch, soft):
    """Past 2^31 elements the backward launches the ``_i64`` kernels; lowering the limit makes a small
    case take that path, which must give the 32-bit variant's numbers exactly."""
    from leaflens.kernels import _checks  # noqa: PLC0415

    rng = np.random.default_rng(2)
    logits = backend.put(rng.standard_normal((5, 7)).astype(np.float32))
    targets = backend.put(rng.dirichlet(np.ones(7), 5).astype(np.float32) if soft else
                          rng.integers(0, 7, 5).astype(np.int64))
    _, stats = softmax_xent_forward_cuda(logits, targets)
    d32 = backend.get(softmax_xent_backward_cuda(logits, targets, stats, 1.0))
    monkeypatch.setattr(_checks, "INDEX32_MAX", 34)  # 5 * 7 = 35 elements: past the lowered limit
    with launched(backend, "softmax_xent.cu", f"xent_{'soft' if soft else 'hard'}_backward_f32_i64"):
        d64 = backend.get(softmax_xent_backward_cuda(logits, targets, stats, 1.0))
    np.testing.assert_array_equal(d64, d32)


def test_softmax_xent_is_stable_for_huge_logits(backend):
    z = np.array([[1000.0, 0.0, -1000.0]], np.float32)
    loss, stats = softmax_xent_forward_cuda(backend.put(z), backend.put(np.array([1], np.int64)))
    assert float(backend.get(loss)) == pytest.approx(1000.0)
    assert np.isfinite(backend.get(stats)).all()


def test_softmax_xent_hard_targets_with_a_masked_class(backend):
    # eps = 0 used to multiply the row's sum of logits (-inf) by 0: NaN on the GPU, a finite loss on the CPU
    logits = np.array([[1.0, -np.inf, 2.0, 0.5], [0.3, 0.2, -np.inf, 0.1]], np.float32)
    targets = np.array([0, 3], np.int64)
    loss, stats = softmax_xent_forward_cuda(backend.put(logits), backend.put(targets))
    want_loss, want_d = engine_xent(logits, targets, 0.0, 1.0)
    assert np.isfinite(want_loss)
    close(float(backend.get(loss)), want_loss)
    close(backend.get(softmax_xent_backward_cuda(backend.put(logits), backend.put(targets), stats, 1.0)), want_d)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("soft", [False, True])
def test_softmax_xent_loss_keeps_its_digits_for_large_logits(backend, smoothing, soft):
    # lse - z_t from two logits of 3e4 lost 1e-4 of a loss of 5 in float32; shifted sums keep it
    if soft and smoothing:
        pytest.skip("smoothing applies to class-index targets only")
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((64, 10)) * 2 + 3e4).astype(np.float32)
    z64 = z.astype(np.float64)
    logp = z64 - log_sum_exp(z64)[:, None]
    if soft:
        q = rng.random((64, 10)).astype(np.float32)
        targets = backend.put(q)
    else:
        t = rng.integers(0, 10, 64).astype(np.int64)
        q = np.full((64, 10), smoothing / 10)
        q[np.arange(64), t] += 1 - smoothing
        targets = backend.put(t)
    want = -(q.astype(np.float64) * logp).sum(axis=1).mean()
    loss, _ = softmax_xent_forward_cuda(backend.put(z), targets, label_smoothing=smoothing)
    np.testing.assert_allclose(float(backend.get(loss)), want, rtol=1e-5)


@pytest.mark.parametrize("masked", [-1e4, -1e9, float(np.finfo(np.float32).min)])
@pytest.mark.parametrize("smoothing,soft", [(0.0, True), (0.0, False), (0.1, False)])
def test_softmax_xent_with_a_large_finite_mask_in_the_first_column(backend, masked, smoothing, soft):
    # sums shifted by the row's FIRST logit turned a finite mask of -1e9 there into a loss of -24 (soft targets);
    # relative to the row's maximum they keep their digits whatever column holds the mask
    rng = np.random.default_rng(4)
    z = rng.standard_normal((8, 10)).astype(np.float32)
    z[:, 0] = masked
    z64 = z.astype(np.float64)
    logp = z64 - log_sum_exp(z64)[:, None]
    if soft:
        q = rng.random((8, 10)).astype(np.float32)
        q[:, 0] = 0
        targets = backend.put(q)
        want = -(q.astype(np.float64) * logp).sum(axis=1).mean()
    else:
        t = rng.integers(1, 10, 8).astype(np.int64)
        q64 = np.full((8, 10), smoothing / 10)
        q64[np.arange(8), t] += 1 - smoothing
        targets = backend.put(t)
        want = -(q64 * logp).sum(axis=1).mean()
    loss, _ = softmax_xent_forward_cuda(backend.put(z), targets, label_smoothing=smoothing)
    np.testing.assert_allclose(float(backend.get(loss)), want, rtol=1e-5)


def test_softmax_xent_bad_targets(backend):
    logits = backend.put(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="outside"):
        softmax_xent_forward_cuda(logits, backend.put(np.array([0, 3], np.int64)))
    # Without validation the kernel must not read out of bounds: the row loss becomes NaN.
    loss, _ = softmax_xent_forward_cuda(logits, backend.put(np.array([0, 3], np.int64)), validate=False)
    assert np.isnan(float(backend.get(loss)))
    with pytest.raises(TypeError, match="int64 class indices"):
        softmax_xent_forward_cuda(logits, backend.put(np.array([0, 1], np.int32)))
    with pytest.raises(ValueError, match="soft targets must have shape"):
        softmax_xent_forward_cuda(logits, backend.put(np.zeros((2, 4), np.float32)))


# ---- activation gradients ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kind", ["relu", "leaky_relu", "relu6"])
def test_activation_grad(backend, kind, dtype):
    rng = np.random.default_rng(11)
    y = (rng.standard_normal((3, 5, 7, 11)) * 4).astype(dtype)
    y.flat[:6] = [0.0, 6.0, -0.0, 5.999, 1e-3, -1e-3]  # mask boundaries
    if kind != "leaky_relu":
        y = np.maximum(y, 0).astype(dtype)  # a ReLU output is never negative
    if kind == "relu6":
        y = np.minimum(y, 6).astype(dtype)
    gy = rng.standard_normal(y.shape).astype(dtype)
    gx = activation_grad_cuda(kind, backend.put(y), backend.put(gy), slope=0.2)
    np.testing.assert_array_equal(backend.get(gx), engine_activation_grad(kind, y, gy, 0.2).astype(dtype))


def test_activation_grad_masks_nonfinite_upstream(backend):
    """Masked positions are exactly 0 even for an inf/NaN upstream gradient (the engine's gy * mask is NaN there)."""
    y = np.array([0.0, 1.0, 0.0, 7.0], np.float32)
    gy = np.array([np.inf, 2.0, np.nan, np.nan], np.float32)
    np.testing.assert_array_equal(backend.get(activation_grad_cuda("relu", backend.put(y), backend.put(gy))),
                                  [0.0, 2.0, 0.0, np.nan])
    np.testing.assert_array_equal(backend.get(activation_grad_cuda("relu6", backend.put(y), backend.put(gy))),
                                  [0.0, 2.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="slope must be > 0"):
        activation_grad_cuda("leaky_relu", backend.put(y), backend.put(gy), slope=0.0)


def test_activation_grad_large_grid(backend):
    # More elements than one grid-stride pass covers at the capped block count would be slow to
    # emulate; 3 blocks with a ragged tail still exercise the loop bound.
    y = np.linspace(-1, 1, 700, dtype=np.float32)
    gy = np.ones_like(y)
    gx = backend.get(activation_grad_cuda("relu", backend.put(y), backend.put(gy)))
    np.testing.assert_array_equal(gx, (y > 0).astype(np.float32))


# ---- L2 normalisation ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(5, 3), (4, 300), (2, 3, 40)])
def test_l2norm(backend, dtype, shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(dtype)
    x.reshape(-1, shape[-1])[0] = 0  # a zero row: clamped branch
    x.reshape(-1, shape[-1])[1] *= 1e-4
    eps = 1e-3
    y, norm = l2norm_forward_cuda(backend.put(x), eps)
    assert backend.get(norm).dtype == np.float32
    close(backend.get(norm), np.sqrt(np.sum(np.square(x, dtype=np.float64), axis=-1)), dtype)
    close(backend.get(y), engine_l2norm(x, eps).astype(dtype), dtype)
    gy = rng.standard_normal(shape).astype(dtype)
    gx = l2norm_backward_cuda(y, backend.put(gy), norm, eps)
    want = engine_l2norm_backward(backend.get(y), gy, backend.get(norm), eps)
    close(backend.get(gx), want.astype(dtype), dtype, atol=5e-3)


# ---- im2col / col2im -----------------------------------------------------------------------------
GEOMETRIES = [
    # (N, H, W, C), kernel, stride, padding (top, bottom, left, right)
    ((2, 5, 6, 3), (3, 3), (1, 1), (1, 1, 1, 1)),
    ((1, 7, 5, 2), (3, 2), (2, 1), (0, 1, 1, 0)),  # asymmetric, TF "same"-style
    ((2, 4, 4, 5), (1, 1), (1, 1), (0, 0, 0, 0)),
    ((1, 9, 8, 1), (5, 5), (3, 2), (2, 2, 2, 2)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape,kernel,stride,padding", GEOMETRIES)
def test_im2col_col2im(backend, dtype, shape, kernel, stride, padding):
    rng = np.random.default_rng(shape[1] * 10 + kernel[0])
    x = rng.standard_normal(shape).astype(dtype)
    cols = im2col_cuda(backend.put(x), kernel, stride, padding)
    want_cols = engine_im2col(x, kernel, stride, padding)
    assert want_cols.dtype == dtype
    np.testing.assert_array_equal(backend.get(cols), want_cols)  # a pure copy: exact
    g = rng.standard_normal(want_cols.shape).astype(dtype)
    gx = col2im_cuda(backend.put(g), shape, kernel, stride, padding)
    close(backend.get(gx), engine_col2im(g, shape, kernel, stride, padding).astype(dtype), dtype)


def test_im2col_col2im_64_bit_index_variant(backend, monkeypatch):
    """Past 2^31 elements the ``_i64`` kernels run; with the limit lowered a small case takes them and
    must give exactly what the 32-bit variants give."""
    from leaflens.kernels import _checks  # noqa: PLC0415

    shape, kernel, stride, padding = GEOMETRIES[1]
    rng = np.random.default_rng(4)
    x = backend.put(rng.standard_normal(shape).astype(np.float32))
    cols32 = backend.get(im2col_cuda(x, kernel, stride, padding))
    g = backend.put(rng.standard_normal(cols32.shape).astype(np.float32))
    gx32 = backend.get(col2im_cuda(g, shape, kernel, stride, padding))
    monkeypatch.setattr(_checks, "INDEX32_MAX", int(np.prod(shape)) - 1)  # x passes the limit, cols too
    with launched(backend, "im2col.cu", "im2col_nhwc_f32_i64"):
        np.testing.assert_array_equal(backend.get(im2col_cuda(x, kernel, stride, padding)), cols32)
    with launched(backend, "im2col.cu", "col2im_nhwc_f32_i64"):
        np.testing.assert_array_equal(backend.get(col2im_cuda(g, shape, kernel, stride, padding)), gx32)


# ---- max-pool ------------------------------------------------------------------------------------
POOLS = [
    ((2, 6, 6, 3), (2, 2), (2, 2), (0, 0, 0, 0)),
    ((1, 7, 5, 4), (3, 3), (2, 2), (1, 1, 1, 1)),  # overlapping windows
    ((2, 5, 5, 2), (3, 3), (1, 1), (0, 2, 1, 1)),  # asymmetric padding, stride 1
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape,kernel,stride,padding", POOLS)
def test_maxpool(backend, dtype, shape, kernel, stride, padding):
    rng = np.random.default_rng(shape[1] + kernel[0])
    x = rng.integers(-3, 4, size=shape).astype(dtype)  # small integers: many ties
    x[0, 0, 0, 0] = -np.inf
    y, idx = maxpool_forward_cuda(backend.put(x), kernel, stride, padding)
    loop_y, loop_idx = maxpool_by_loops(x, kernel, stride, padding)
    gy = rng.standard_normal(loop_y.shape).astype(dtype)
    want_y, want_gx = engine_maxpool(x, gy, kernel, stride, padding)
    np.testing.assert_array_equal(backend.get(y), want_y.astype(dtype))
    np.testing.assert_array_equal(backend.get(y), loop_y)
    np.testing.assert_array_equal(backend.get(idx), loop_idx)  # the first maximum, as the engine's backward
    gx = maxpool_backward_cuda(backend.put(gy), idx, shape, kernel, stride, padding)
    close(backend.get(gx), want_gx.astype(dtype), dtype)


def test_maxpool_nan_and_all_padding(backend):
    """A NaN wins its windows (the engine's backward drops it); a window half in the padding still works."""
    x = np.zeros((1, 3, 3, 2), np.float32)
    x[0, 1, 1, 0] = np.nan
    x[0, 0, 0, 1] = 5.0
    y, idx = maxpool_forward_cuda(backend.put(x), (2, 2), (1, 1), (1, 0, 1, 0))
    loop_y, loop_idx = maxpool_by_loops(x, (2, 2), (1, 1), (1, 0, 1, 0))
    assert np.isnan(loop_y[0, 1:, 1:, 0]).all() and (loop_idx[0, 1:, 1:, 0] == [[3, 2], [1, 0]]).all()
    np.testing.assert_array_equal(backend.get(y), loop_y)
    np.testing.assert_array_equal(backend.get(idx), loop_idx)
    gx = maxpool_backward_cuda(backend.put(np.ones_like(loop_y)), idx, x.shape, (2, 2), (1, 1), (1, 0, 1, 0))
    assert backend.get(gx)[0, 1, 1, 0] == 4  # the NaN got the gradient of all four windows it won


def test_maxpool_limits(backend):
    with pytest.raises(ValueError, match="uint8"):
        maxpool_forward_cuda(backend.put(np.zeros((1, 20, 20, 1), np.float32)), (17, 17))
    with pytest.raises(ValueError, match="does not fit"):
        maxpool_forward_cuda(backend.put(np.zeros((1, 2, 2, 1), np.float32)), (3, 3))


def test_maxpool_64_bit_index_variant(backend, monkeypatch):
    from leaflens.kernels import _checks  # noqa: PLC0415

    shape, kernel, stride, padding = POOLS[1]
    rng = np.random.default_rng(6)
    x = backend.put(rng.standard_normal(shape).astype(np.float16))
    y32, idx32 = maxpool_forward_cuda(x, kernel, stride, padding)
    gy = backend.put(rng.standard_normal(tuple(y32.shape)).astype(np.float16))
    gx32 = backend.get(maxpool_backward_cuda(gy, idx32, shape, kernel, stride, padding))
    monkeypatch.setattr(_checks, "INDEX32_MAX", int(np.prod(shape)) - 1)
    with launched(backend, "maxpool.cu", "maxpool_forward_f16_i64"):
        y64, idx64 = maxpool_forward_cuda(x, kernel, stride, padding)
    np.testing.assert_array_equal(backend.get(y64), backend.get(y32))
    np.testing.assert_array_equal(backend.get(idx64), backend.get(idx32))
    with launched(backend, "maxpool.cu", "maxpool_backward_f16_i64"):
        gx64 = maxpool_backward_cuda(gy, idx64, shape, kernel, stride, padding)
    np.testing.assert_array_equal(backend.get(gx64), gx32)


# ---- fused optimisers ----------------------------------------------------------------------------
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_steps(backend, nesterov):
    rng = np.random.default_rng(5)
    n = 1000
    p = rng.standard_normal(n).astype(np.float32)
    param = Parameter(p.copy())
    opt = SGD([param], lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=nesterov)
    dp, dbuf = backend.put(p), backend.put(np.zeros(n, np.float32))
    for _ in range(3):
        g = rng.standard_normal(n).astype(np.float32)
        sgd_momentum_cuda(dp, backend.put(g), dbuf, lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=nesterov,
                          grad_scale=0.5)
        param.grad = g * np.float32(0.5)  # grad_scale multiplies the gradient first (exact: a power of 2)
        opt.step()
    close(backend.get(dp), param.data)
    close(backend.get(dbuf), opt.state[id(param)]["momentum_buffer"])


@pytest.mark.parametrize("betas,weight_decay", [((0.9, 0.999), 0.1), ((0.5, 0.9), 0.3), ((0.9, 0.999), 0.0)])
def test_adamw_steps(backend, betas, weight_decay):
    """Decoupled decay and both bias corrections, over enough steps for the corrections to fade."""
    rng = np.random.default_rng(6)
    n = 777
    p = rng.standard_normal(n).astype(np.float32)
    param = Parameter(p.copy())
    opt = AdamW([param], lr=1e-2, betas=betas, eps=1e-8, weight_decay=weight_decay)
    dp, dm, dv = backend.put(p), backend.put(np.zeros(n, np.float32)), backend.put(np.zeros(n, np.float32))
    for step in range(1, 31):
        g = (rng.standard_normal(n) * (10.0 if step % 7 == 0 else 0.1)).astype(np.float32)
        adamw_cuda(dp, backend.put(g * 128), dm, dv, step=step, lr=1e-2, beta1=betas[0], beta2=betas[1], eps=1e-8,
                   weight_decay=weight_decay, grad_scale=1 / 128)
        param.grad = g
        opt.step()
    state = opt.state[id(param)]
    assert int(state["step"]) == 30
    close(backend.get(dm), state["exp_avg"])
    close(backend.get(dv), state["exp_avg_sq"], rtol=2e-4)
    close(backend.get(dp), param.data)


def test_ema_steps(backend):
    """The running average of the weights over steps whose decay warms up, against ModelEMA's arithmetic."""
    rng = np.random.default_rng(7)
    n = 901
    model = nn.Linear(n, 1, bias=False, rng=rng)
    ema = ModelEMA(model, 0.95)
    avg = backend.put(model.weight.data.reshape(-1).copy())
    for _ in range(12):
        model.weight.data += rng.standard_normal(model.weight.data.shape).astype(np.float32)
        decay = ema.current_decay()
        with launched(backend, "fused_optim.cu", "ema_f32"):
            ema_cuda(avg, backend.put(model.weight.data.reshape(-1).copy()), decay=decay)
        ema.update(model)
    close(backend.get(avg), ema.shadow["weight"].reshape(-1))
    with pytest.raises(ValueError, match="param has 901"):
        ema_cuda(avg, backend.put(np.zeros(3, np.float32)), decay=0.5)
    with pytest.raises(ValueError, match="decay"):
        ema_cuda(avg, avg, decay=1.5)


def test_grad_scale_equals_prescaled_gradient(backend):
    g = np.random.default_rng(12).standard_normal(8).astype(np.float32)
    p1, b1 = backend.put(np.ones(8, np.float32)), backend.put(np.zeros(8, np.float32))
    p2, b2 = backend.put(np.ones(8, np.float32)), backend.put(np.zeros(8, np.float32))
    sgd_momentum_cuda(p1, backend.put(g * 256), b1, lr=0.1, grad_scale=1 / 256)
    sgd_momentum_cuda(p2, backend.put(g), b2, lr=0.1)
    close(backend.get(p1), backend.get(p2), rtol=1e-6)
    with pytest.raises(ValueError, match="Nesterov"):
        sgd_momentum_cuda(p1, backend.put(g), b1, lr=0.1, momentum=0.0, nesterov=True)


def test_optimiser_rejects_mismatched_buffers(backend):
    p = backend.put(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="momentum_buffer has 3 elements"):
        sgd_momentum_cuda(p, backend.put(np.zeros(4, np.float32)), backend.put(np.zeros(3, np.float32)), lr=0.1)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        z = backend.put(np.zeros(4, np.float32))
        adamw_cuda(p, z, z, z, step=0, lr=0.1)
