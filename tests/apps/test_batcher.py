"""DynamicBatcher: own results under concurrency, bounded queue, deadlines, shutdown, failures."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import pytest

from leaflens.apps.batcher import BatcherBusy, BatcherClosed, DynamicBatcher


class Recorder:
    """run_batch that answers row i with a value derived from input i (and remembers every batch)."""

    def __init__(self, gate: threading.Event | None = None, delay_s: float = 0.0) -> None:
        self.gate = gate
        self.delay_s = delay_s
        self.batches: list[list[int]] = []
        self.started = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        with self.lock:
            self.batches.append([int(v) for v in batch[:, 0]])
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test gate never opened"
        if self.delay_s:
            time.sleep(self.delay_s)
        if (batch[:, 0] < 0).any():
            raise ValueError("poisoned batch")
        return np.stack([batch[:, 0] * 3 + 1, batch[:, 1]], axis=1)  # depends on each row only

    def seen(self) -> list[int]:
        return [v for b in self.batches for v in b]


def item(i: int) -> np.ndarray:
    return np.array([i, -i * 7], dtype=np.int64)


def wait_running(rec: Recorder, batcher: DynamicBatcher) -> None:
    assert rec.started.wait(5)


@pytest.mark.parametrize("workers", [1, 3])
def test_hundreds_of_concurrent_requests_each_get_their_own_result(workers):
    rec = Recorder(delay_s=0.002)
    batcher = DynamicBatcher(rec, max_batch_size=16, max_wait_ms=3, max_queue=1000, num_workers=workers)
    n = 600

    def client(i: int) -> tuple[int, np.ndarray]:
        return i, batcher.submit(item(i)).result(timeout=20)

    with ThreadPoolExecutor(max_workers=48) as pool:
        results = list(pool.map(client, range(n)))
    batcher.close()
    assert len(results) == n
    for i, out in results:
        assert out.tolist() == [i * 3 + 1, -i * 7], f"request {i} got another caller's answer"
    assert sorted(rec.seen()) == list(range(n))  # every item ran exactly once
    assert max(len(b) for b in rec.batches) <= 16
    stats = batcher.stats()
    assert stats.submitted == stats.answered == n and stats.pending == 0
    assert stats.batches == len(rec.batches) < n  # requests were really grouped
    assert stats.mean_batch_size == pytest.approx(n / len(rec.batches))
    assert stats.mean_batch_size > 2


def test_two_workers_run_batches_side_by_side():
    active, peak, calls, lock = [0], [0], [0], threading.Lock()
    both = threading.Barrier(2, timeout=5)

    def run_batch(batch: np.ndarray) -> np.ndarray:
        with lock:
            active[0] += 1
            calls[0] += 1
            first_two = calls[0] <= 2
            peak[0] = max(peak[0], active[0])
        if first_two:  # 4 items, batches of <= 2: at least two batches exist to meet here
            both.wait()  # times out (and the batch fails) unless two batches really run at once
        with lock:
            active[0] -= 1
        return batch * 2

    with DynamicBatcher(run_batch, max_batch_size=2, max_wait_ms=0, num_workers=2) as batcher:
        futures = [batcher.submit(item(i)) for i in range(4)]
        assert [int(f.result(5)[0]) for f in futures] == [0, 2, 4, 6]
    assert peak[0] == 2


def test_asyncio_callers():
    rec = Recorder()
    with DynamicBatcher(rec, max_batch_size=32, max_wait_ms=5) as batcher:

        async def main() -> list[np.ndarray]:
            return await asyncio.gather(*(batcher.submit_async(item(i)) for i in range(300)))

        outs = asyncio.run(main())
    assert [int(o[0]) for o in outs] == [i * 3 + 1 for i in range(300)]
    assert batcher.stats().batches < 300


def test_batch_waits_at_most_max_wait():
    rec = Recorder()
    with DynamicBatcher(rec, max_batch_size=64, max_wait_ms=50) as batcher:
        t0 = time.perf_counter()
        out = batcher.submit(item(5)).result(timeout=5)
        elapsed = time.perf_counter() - t0
    assert out[0] == 16
    assert 0.045 <= elapsed < 1.0  # held for the window (the batch never filled), then run alone


def test_full_queue_rejects_immediately_then_recovers():
    gate = threading.Event()
    rec = Recorder(gate)
    batcher = DynamicBatcher(rec, max_batch_size=1, max_wait_ms=0, max_queue=4)
    first = batcher.submit(item(0))
    wait_running(rec, batcher)  # item 0 is inside run_batch; the queue is empty again
    queued = [batcher.submit(item(i)) for i in range(1, 5)]
    t0 = time.perf_counter()
    with pytest.raises(BatcherBusy, match="max_queue=4"):
        batcher.submit(item(99))
    assert time.perf_counter() - t0 < 0.1
    assert batcher.stats().busy == 1
    gate.set()
    assert [int(f.result(5)[0]) for f in [first, *queued]] == [1, 4, 7, 10, 13]
    assert batcher.submit(item(6)).result(5)[0] == 19  # accepts again once drained
    batcher.close()
    assert 99 not in rec.seen()
    stats = batcher.stats()
    assert (stats.submitted, stats.answered, stats.busy) == (6, 6, 1)


def test_timeout_drops_waiting_item_and_fails_running_one():
    gate = threading.Event()
    rec = Recorder(gate)
    batcher = DynamicBatcher(rec, max_batch_size=1, max_wait_ms=0, max_queue=10)
    running = batcher.submit(item(1), timeout_s=0.2)
    wait_running(rec, batcher)
    waiting = batcher.submit(item(2), timeout_s=0.1)
    patient = batcher.submit(item(3))  # no deadline
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        waiting.result(timeout=5)
    assert time.perf_counter() - t0 < 1.0  # failed at its deadline, not when the worker got free
    with pytest.raises(TimeoutError):
        running.result(timeout=5)  # the caller is released even though run_batch still runs
    gate.set()
    assert patient.result(5)[0] == 10
    batcher.close()
    assert 2 not in rec.seen()  # the expired item was dropped, never run
    stats = batcher.stats()
    assert (stats.timed_out, stats.answered, stats.pending) == (2, 1, 0)


def test_default_timeout_applies():
    gate = threading.Event()
    rec = Recorder(gate)
    batcher = DynamicBatcher(rec, max_batch_size=1, max_wait_ms=0, timeout_s=0.05)
    futures = [batcher.submit(item(i)) for i in range(3)]
    done, not_done = wait(futures, timeout=5)
    assert not not_done and all(isinstance(f.exception(), TimeoutError) for f in futures)
    gate.set()
    batcher.close()
    assert batcher.stats().timed_out == 3


def test_failing_run_batch_fails_only_its_batch():
    gate = threading.Event()
    rec = Recorder(gate)
    batcher = DynamicBatcher(rec, max_batch_size=4, max_wait_ms=200, max_queue=100)
    opener = batcher.submit(item(100))
    wait_running(rec, batcher)  # the worker is busy: the next 8 queue up and form two full batches
    poisoned = [batcher.submit(item(i)) for i in (1, -2, 3, 4)]
    healthy = [batcher.submit(item(i)) for i in (5, 6, 7, 8)]
    gate.set()
    assert opener.result(5)[0] == 301
    for f in poisoned:
        with pytest.raises(ValueError, match="poisoned batch"):
            f.result(5)
    assert [int(f.result(5)[0]) for f in healthy] == [16, 19, 22, 25]
    assert batcher.submit(item(9)).result(5)[0] == 28  # the worker survived
    batcher.close()
    assert rec.batches[1:3] == [[1, -2, 3, 4], [5, 6, 7, 8]]
    stats = batcher.stats()
    assert (stats.failed, stats.answered, stats.pending) == (4, 6, 0)


def test_wrong_number_of_results_fails_that_batch():
    batcher = DynamicBatcher(lambda x: x[:-1], max_batch_size=8, max_wait_ms=1)
    with pytest.raises(RuntimeError, match="returned 0 results for a batch of 1"):
        batcher.submit(item(1)).result(5)
    batcher.close()


def test_close_drains_pending_requests():
    gate = threading.Event()
    rec = Recorder(gate)
    batcher = DynamicBatcher(rec, max_batch_size=4, max_wait_ms=10_000, max_queue=100)
    futures = [batcher.submit(item(i)) for i in range(11)]
    wait_running(rec, batcher)
    closer = threading.Thread(target=batcher.close)
    closer.start()
    time.sleep(0.05)
    with pytest.raises(BatcherClosed):
        batcher.submit(item(50))
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    # Drained without waiting for the 10 s fill window; every request answered.
    assert [int(f.result(0)[0]) for f in futures] == [i * 3 + 1 for i in range(11)]
    assert batcher.stats().answered == 11 and batcher.stats().pending == 0


def test_close_without_drain_fails_waiting_requests():
    gate = threading.Event()
    rec = Recorder(gate)
    # a long fill window: the first batch leaves only when full, so it is exactly items 0 and 1 however
    # late this thread is scheduled (with max_wait_ms=0 a busy machine could run item 0 alone)
    batcher = DynamicBatcher(rec, max_batch_size=2, max_wait_ms=60_000, max_queue=100)
    running = [batcher.submit(item(i)) for i in range(2)]
    wait_running(rec, batcher)
    waiting = [batcher.submit(item(i)) for i in range(2, 9)]
    threading.Timer(0.1, gate.set).start()
    batcher.close(drain=False)
    assert all(isinstance(f.exception(0), BatcherClosed) for f in waiting)
    assert [int(f.result(0)[0]) for f in running] == [1, 4]  # the batch already running finished
    stats = batcher.stats()
    assert (stats.answered, stats.failed, stats.pending) == (2, 7, 0)
    assert sorted(rec.seen()) == [0, 1]


def test_close_with_hung_run_batch_fails_everything_after_timeout():
    gate = threading.Event()  # never opened until the end: run_batch hangs
    rec = Recorder(gate)
    batcher = DynamicBatcher(rec, max_batch_size=2, max_wait_ms=0, max_queue=100)
    futures = [batcher.submit(item(i)) for i in range(6)]
    wait_running(rec, batcher)
    t0 = time.perf_counter()
    batcher.close(timeout_s=0.2)
    assert time.perf_counter() - t0 < 2.0
    assert all(f.done() and isinstance(f.exception(0), BatcherClosed) for f in futures)
    assert batcher.stats().pending == 0
    gate.set()  # the late batch result is discarded without error


def test_cancelled_request_is_not_run():
    gate = threading.Event()
    rec = Recorder(gate)
    batcher = DynamicBatcher(rec, max_batch_size=8, max_wait_ms=0)
    first = batcher.submit(item(1))
    wait_running(rec, batcher)
    doomed = batcher.submit(item(2))
    kept = batcher.submit(item(3))
    assert doomed.cancel()
    gate.set()
    assert first.result(5)[0] == 4 and kept.result(5)[0] == 10
    batcher.close()
    assert 2 not in rec.seen()
    stats = batcher.stats()
    assert (stats.cancelled, stats.answered, stats.pending) == (1, 2, 0)


def test_item_shape_must_match_and_arguments_checked():
    with DynamicBatcher(Recorder(), max_batch_size=4, max_wait_ms=1) as batcher:
        batcher.submit(item(1)).result(5)
        with pytest.raises(ValueError, match=r"shape \(3,\)"):
            batcher.submit(np.array([1, 2, 3]))
        with pytest.raises(ValueError, match="dtype float32"):
            batcher.submit(item(1).astype(np.float32))
    with pytest.raises(ValueError, match="max_batch_size"):
        DynamicBatcher(Recorder(), max_batch_size=0)
    with pytest.raises(ValueError, match="max_queue"):
        DynamicBatcher(Recorder(), max_queue=0)


def test_done_callback_may_submit_again():
    rec = Recorder()
    batcher = DynamicBatcher(rec, max_batch_size=4, max_wait_ms=1)
    chained: list = []
    first = batcher.submit(item(1))
    first.add_done_callback(lambda f: chained.append(batcher.submit(item(2))))
    first.result(5)
    deadline = time.monotonic() + 5
    while not chained and time.monotonic() < deadline:
        time.sleep(0.01)
    assert chained and chained[0].result(5)[0] == 7  # no deadlock: futures resolve outside the lock
    batcher.close()
