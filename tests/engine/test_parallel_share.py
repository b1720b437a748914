"""parallel.share (for_tiles and for_chunks hand their items out through it): every item runs once, results
come back in item order whichever thread ran them, errors reach the caller, and training is repeatable."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from leaflens.engine import parallel


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(parallel, "num_threads", lambda: 2)


@pytest.mark.parametrize("dynamic", [True, False])
def test_every_item_once_results_in_order(dynamic, two_threads, monkeypatch):
    monkeypatch.setattr(parallel, "DYNAMIC", dynamic)
    items = [(i, i + 3) for i in range(0, 60, 3)]
    threads: set[str] = set()
    lock = threading.Lock()

    def fn(lo: int, hi: int) -> tuple[int, int]:
        with lock:
            threads.add(threading.current_thread().name)
        time.sleep(0.001 * (lo % 2))  # uneven items: the dynamic hand-out reorders who runs what
        return lo, hi

    assert parallel.share(items, 10**6, fn) == items
    if not dynamic:
        assert len(threads) == 2  # the caller and one engine thread each ran their run of items


def test_a_stalled_thread_holds_up_only_its_item(two_threads):
    """Item 0 stalls until every other item is done: the other thread runs them all (with one contiguous
    run per thread it would wait for the stalled one's half, and the wait would time out)."""
    ran_by: dict[int, str] = {}
    rest_done = threading.Event()

    def fn(lo: int, hi: int) -> int:
        if lo == 0:
            assert rest_done.wait(timeout=10), "the other items were not handed to the free thread"
        ran_by[lo] = threading.current_thread().name
        if len(ran_by) == 9 and 0 not in ran_by:
            rest_done.set()
        return lo

    assert parallel.share([(i, i + 1) for i in range(10)], 10**6, fn) == list(range(10))
    assert sum(name != ran_by[0] for name in ran_by.values()) == 9


def test_the_same_training_on_two_threads_is_the_same_bit_for_bit():
    """README: the same run on the same machine with the same thread count trains the same model, bit for bit.
    Asking OpenBLAS for one thread per engine thread broke that (it split some products one way or the other
    from run to run: another model 1 time in 3-4 on 2 threads)."""
    from leaflens.engine import Tensor, ops  # noqa: PLC0415
    from leaflens.engine import random as erandom  # noqa: PLC0415
    from leaflens.engine.optim import SGD  # noqa: PLC0415
    from leaflens.pipeline.models.student import StudentCNN  # noqa: PLC0415

    if parallel.num_threads() < 2:
        pytest.skip("one usable CPU: nothing runs side by side")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 48, 48, 3)).astype(np.float32)
    y = rng.integers(0, 4, 64)

    def train() -> list[np.ndarray]:
        erandom.seed(0)
        model = StudentCNN(4, widths=(16, 32, 64))
        opt = SGD(model.parameters(), lr=0.05, momentum=0.9)
        for _ in range(8):
            opt.zero_grad()
            ops.cross_entropy(model(Tensor(x)), y).backward()
            opt.step()
        return [p.data.copy() for p in model.parameters()]

    first = train()
    for _ in range(3):
        again = train()
        assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_an_error_in_an_item_reaches_the_caller(two_threads):
    def fn(lo: int, hi: int) -> int:
        if lo == 5:
            raise ValueError("item 5")
        return lo

    with pytest.raises(ValueError, match="item 5"):
        parallel.share([(i, i + 1) for i in range(10)], 10**6, fn)


def test_tile_sums_do_not_depend_on_the_hand_out(two_threads, monkeypatch):
    monkeypatch.setattr(parallel, "TILE", 8)
    a = np.random.default_rng(0).standard_normal((100, 4)).astype(np.float32)
    sums = []
    for dynamic in (True, False):
        monkeypatch.setattr(parallel, "DYNAMIC", dynamic)
        parts = parallel.for_tiles(np, 100, 4, lambda lo, hi: a[lo:hi].sum(axis=0))
        sums.append(sum(parts[1:], parts[0]))
    np.testing.assert_array_equal(*sums)


@pytest.mark.parametrize("count", [1, 2, 5])
def test_sum_in_order_adds_left_to_right_and_leaves_the_parts(count):
    # values whose float32 sum depends on the order: any other order gives a different total
    rng = np.random.default_rng(3)
    parts = [(rng.standard_normal(64) * 10.0 ** rng.integers(-3, 4, 64)).astype(np.float32) for _ in range(count)]
    before = [p.copy() for p in parts]
    expected = before[0].copy()
    for p in before[1:]:
        expected = expected + p
    total = parallel.sum_in_order(parts)
    assert total.dtype == np.float32
    np.testing.assert_array_equal(total, expected)
    for p, b in zip(parts, before):
        np.testing.assert_array_equal(p, b)
    if count > 1:
        total += 1  # the total is an array of its own: changing it leaves the parts alone
        np.testing.assert_array_equal(parts[0], before[0])
