"""The CPU speed paths (benchmarks/engine_speed.py) compute what the plain formulas do.

The gradient checks in test_gradcheck_ops.py run on shapes too small to reach some of these paths
(several depthwise tiles per image, the swapped weight-gradient product), so they are forced here.
"""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import Tensor, ops
from leaflens.engine.gradcheck import gradcheck
from leaflens.engine.ops import conv as conv_mod
from leaflens.engine.ops import norm as norm_mod
from leaflens.engine.ops.linalg import matmul_tn

rng = np.random.default_rng(7)


@pytest.mark.parametrize("m,n", [(3, 8), (8, 3), (5, 5)])
def test_matmul_tn_either_orientation_is_a_transpose_times_b(m, n):
    a = rng.standard_normal((50, m)).astype(np.float32)
    b = rng.standard_normal((50, n)).astype(np.float32)
    np.testing.assert_allclose(matmul_tn(a, b), a.T @ b, rtol=1e-5, atol=1e-5)
    assert matmul_tn(a, b).shape == (m, n)


@pytest.mark.parametrize("m,n", [(3, 8), (8, 3)])
def test_matmul_tn_in_pieces_is_the_same_product_whatever_the_thread_count(m, n, monkeypatch):
    from leaflens.engine import parallel
    from leaflens.engine.ops import linalg

    monkeypatch.setattr(linalg, "TN_ROWS", 16)  # 103 rows: pieces of 16, the last one short
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
    a = rng.standard_normal((103, m)).astype(np.float32)
    b = rng.standard_normal((103, n)).astype(np.float32)
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(parallel, "num_threads", lambda t=threads: t)
        results.append(matmul_tn(a, b))
    np.testing.assert_allclose(results[0], a.T @ b, rtol=1e-5, atol=1e-5)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    monkeypatch.setattr(linalg, "TN_SPLIT_MAX", 1)  # a larger result: one product
    np.testing.assert_allclose(matmul_tn(a, b), a.T @ b, rtol=1e-5, atol=1e-5)


DW = {
    "3x3_s1_pad1": dict(x=(2, 5, 4, 3), k=3, stride=1, padding=1),
    "3x3_s2_same": dict(x=(2, 7, 6, 2), k=3, stride=2, padding="same"),
    "5x5_s2_same_even": dict(x=(1, 8, 9, 3), k=5, stride=2, padding="same"),
    "5x5_s1_same": dict(x=(2, 6, 5, 2), k=5, stride=1, padding="same"),
    "3x3_s2_valid": dict(x=(2, 8, 7, 2), k=3, stride=2, padding=0),  # last padded row reached by no tap
}


@pytest.mark.parametrize("name", sorted(DW))
def test_depthwise_with_many_tiles_per_image_passes_gradcheck(name, monkeypatch):
    c = DW[name]
    monkeypatch.setattr(conv_mod, "DEPTHWISE_TILE", 1)  # one output row per tile
    ch = c["x"][-1]

    def f(x, w):
        return ops.conv2d(x, w, stride=c["stride"], padding=c["padding"], groups=ch)

    assert gradcheck(f, [rng.standard_normal(c["x"]), rng.standard_normal((ch, 1, c["k"], c["k"]))])


@pytest.mark.parametrize("tile", [1, 5, 64])
def test_depthwise_tiles_match_one_tile_per_image(tile, monkeypatch):
    x = rng.standard_normal((3, 11, 9, 4)).astype(np.float32)
    w = rng.standard_normal((4, 1, 5, 5)).astype(np.float32)
    gy = rng.standard_normal((3, 6, 5, 4)).astype(np.float32)

    def run():
        xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        y = ops.conv2d(xt, wt, stride=2, padding="same", groups=4)
        y.backward(gy)
        return y.data, xt.grad, wt.grad

    monkeypatch.setattr(conv_mod, "DEPTHWISE_TILE", 1 << 30)
    whole = run()
    monkeypatch.setattr(conv_mod, "DEPTHWISE_TILE", tile)
    for a, b in zip(run(), whole):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def tiny_tiles_in_threads(monkeypatch):
    """Tiles of a few values, handed to the engine's threads even for tiny arrays."""
    from leaflens.engine import parallel

    monkeypatch.setattr(parallel, "TILE", 6)
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(parallel, "num_threads", lambda: 2)


def test_batch_norm_in_tiles_passes_gradcheck(tiny_tiles_in_threads):
    g, b = rng.standard_normal(3) + 1.5, rng.standard_normal(3)
    assert gradcheck(lambda x, g, b: ops.batch_norm(x, g, b, np.zeros(3), np.ones(3), training=True),
                     [rng.standard_normal((3, 4, 5, 3)), g, b])
    mean, var = rng.standard_normal(3), np.abs(rng.standard_normal(3)) + 0.5
    assert gradcheck(lambda x, g, b: ops.batch_norm(x, g, b, mean, var, training=False),
                     [rng.standard_normal((3, 4, 5, 3)), g, b])


@pytest.mark.parametrize("op", [ops.relu, ops.relu6])
def test_activations_in_tiles_pass_gradcheck(op, tiny_tiles_in_threads):
    x = rng.standard_normal((3, 4, 5, 2)) * 5 + 2
    x[np.abs(x) < 0.05] += 0.2  # no value at a kink
    x[np.abs(x - 6) < 0.05] += 0.2
    assert gradcheck(op, [x])


def test_batch_norm_statistics_do_not_depend_on_the_tiling(monkeypatch):
    from leaflens.engine import parallel

    x = (rng.standard_normal((4, 6, 6, 5)) * 3 + 1).astype(np.float32)
    g, b = np.ones(5, np.float32), np.zeros(5, np.float32)

    def run():
        rm, rv = np.zeros(5, np.float32), np.ones(5, np.float32)
        y = ops.batch_norm(x, g, b, rm, rv, training=True, momentum=1.0)
        return y.data, rm, rv

    whole = run()
    monkeypatch.setattr(parallel, "TILE", 7)
    monkeypatch.setattr(norm_mod, "STATS_TILE", 9)  # the statistics' own tiles
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
    for a, w in zip(run(), whole):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(whole[1], x.reshape(-1, 5).mean(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(whole[2], x.reshape(-1, 5).var(axis=0, ddof=1), rtol=1e-5)


@pytest.mark.parametrize("stride,padding", [(1, 0), (2, 0), (1, 1)])
def test_dense_conv_of_a_strided_view_equals_that_of_a_copy(stride, padding):
    """im2col copies kernel rows as kw*C-long runs when the input's rows are contiguous, tap by tap
    otherwise (an unpadded view of another array)."""
    base = rng.standard_normal((2, 7, 6, 8)).astype(np.float32)
    view = base[:, ::-1, :, 1:4]  # rows not contiguous in C
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    a = ops.conv2d(view, w, stride=stride, padding=padding).data
    b = ops.conv2d(np.ascontiguousarray(view), w, stride=stride, padding=padding).data
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_max_pool_ties_go_to_the_first_tap_in_image_groups():
    x = np.zeros((5, 4, 4, 3), np.float32)  # every window a four-way tie
    xt = Tensor(x, requires_grad=True)
    ops.max_pool2d(xt, 2).backward(np.ones((5, 2, 2, 3), np.float32))
    expected = np.zeros_like(x)
    expected[:, ::2, ::2] = 1
    np.testing.assert_array_equal(xt.grad, expected)


@pytest.mark.parametrize("rows,cols", [(1, 3), (10, 4), (1000, 16)])
def test_per_tile_repeats_the_vector_for_every_tile(rows, cols, monkeypatch):
    from leaflens.engine import parallel

    monkeypatch.setattr(parallel, "TILE", 64)
    v = rng.standard_normal(cols).astype(np.float32)
    for tile in (None, 200):  # the default tiles, and tiles of their own
        rep = parallel.per_tile(np, v, rows, tile)

        def matches(lo: int, hi: int, rep=rep) -> bool:
            return rep(lo, hi).shape == (hi - lo, cols) and bool((rep(lo, hi) == v).all())

        seen = parallel.for_tiles(np, rows, cols, matches, tile)
        assert seen and all(seen)


def test_pool_threads_take_the_callers_numpy_error_settings():
    """np.errstate is per thread: the training loop's silencing of overflow warnings did not reach the engine's
    pool threads, so a diverging run still printed "overflow encountered in matmul" from them."""
    import warnings  # noqa: PLC0415

    from leaflens.engine import parallel  # noqa: PLC0415

    big = np.full((4096, 8), 3e38, np.float32)

    def overflow(lo: int, hi: int) -> float:
        return float((big[lo:hi] * np.float32(10)).sum())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with np.errstate(over="ignore", invalid="ignore"):
            parallel.share([(i, i + 512) for i in range(0, 4096, 512)], 10**9, overflow)
            parallel.parallel_rows(4096, 10**9, overflow)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    with pytest.raises(FloatingPointError):  # and "raise" reaches them too
        with np.errstate(over="raise"):
            parallel.share([(i, i + 512) for i in range(0, 4096, 512)], 10**9, overflow)
