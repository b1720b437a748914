"""parallel.share (for_tiles and for_chunks hand their items out through it): every item runs once, results
come back in item order whichever thread ran them, per-thread setup is undone, and errors reach the caller."""

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


def test_setup_runs_once_per_thread_and_is_undone(two_threads):
    active, calls = threading.local(), []

    def setup():
        active.on = True
        calls.append("setup")

        def undo():
            active.on = False
            calls.append("undo")

        return undo

    seen = parallel.share([(i, i + 1) for i in range(8)], 10**6, lambda lo, hi: active.on, setup)
    assert all(seen) and calls.count("setup") == calls.count("undo") == 2
    assert not active.on  # the calling thread's setting is restored


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
