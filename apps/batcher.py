"""Dynamic batching: many callers submit single items, one worker runs them in batches.

Why: an onnxruntime call has a fixed cost (thread pool wake-up, graph dispatch) and a convolution
runs more efficiently on N images than N times on one. A server receiving single photos from many
clients therefore gains throughput by grouping them, as long as no caller waits long for the group
to fill. :class:`DynamicBatcher` does this with bounded latency and bounded memory:

- a batch is started as soon as ``max_batch_size`` items are waiting, or when the oldest waiting
  item has waited ``max_wait_ms`` (measured from its submission, so items that queued up while the
  previous batch ran are not held any longer);
- the queue holds at most ``max_queue`` items; a submission beyond that fails at once with
  :class:`BatcherBusy` instead of adding unbounded latency;
- every request may carry a deadline; when it passes, the request's future fails with
  :class:`TimeoutError` (and, if it had not been run yet, the item is dropped from the queue);
- an exception raised by ``run_batch`` fails the futures of that batch only; the worker carries on;
- :meth:`DynamicBatcher.close` answers (``drain=True``) or fails with :class:`BatcherClosed`
  (``drain=False``) every pending request: no future is ever left unresolved.

Every accepted request ends in exactly one of: answered, failed, timed out, cancelled (by its
caller, before it ran). The counters returned by :meth:`DynamicBatcher.stats` keep that account.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BatcherBusy", "BatcherClosed", "BatcherStats", "DynamicBatcher"]


class BatcherBusy(RuntimeError):
    """The queue is full: the request was rejected immediately (retry later or shed load)."""


class BatcherClosed(RuntimeError):
    """The batcher is closed (or closing) and does not accept or will not run this request."""


@dataclass
class BatcherStats:
    """A snapshot of the batcher's counters.

    ``submitted`` counts accepted requests; ``busy`` counts rejected ones (queue full), which are
    not in ``submitted``. Accepted requests end as ``answered``, ``failed`` (``run_batch`` raised or
    the batcher closed without running them), ``timed_out`` or ``cancelled``; until then they are
    ``pending``.
    """

    submitted: int = 0
    answered: int = 0
    busy: int = 0
    failed: int = 0
    timed_out: int = 0
    cancelled: int = 0
    batches: int = 0
    batched_items: int = 0
    pending: int = 0

    @property
    def mean_batch_size(self) -> float:
        """Mean number of items per ``run_batch`` call (0.0 before the first batch)."""
        return self.batched_items / self.batches if self.batches else 0.0

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict (for logs, JSON and the web app's status line)."""
        return {
            "submitted": self.submitted,
            "answered": self.answered,
            "busy": self.busy,
            "failed": self.failed,
            "timed_out": self.timed_out,
            "cancelled": self.cancelled,
            "batches": self.batches,
            "pending": self.pending,
            "mean_batch_size": round(self.mean_batch_size, 3),
        }


@dataclass(eq=False)
class _Request:
    item: np.ndarray | None
    future: Future
    enqueued: float  # time.monotonic() at submission
    deadline: float | None  # time.monotonic() after which the request times out
    state: str = "queued"  # queued -> running -> done, or queued -> done; guarded by the lock


# (request, result, exception, counter name): one settlement decided under the lock, applied outside it
_Settlement = tuple[_Request, Any, "BaseException | None", str]


class DynamicBatcher:
    """Group single-item requests from many threads (or asyncio tasks) into batched calls.

    Args:
        run_batch: called from the worker thread with a stacked array ``[n, *item_shape]``
            (``1 <= n <= max_batch_size``); must return an array (or sequence) of length ``n`` whose
            row ``i`` is the answer for item ``i``.
        max_batch_size: most items per ``run_batch`` call.
        max_wait_ms: how long the oldest waiting item may wait for the batch to fill. 0 runs
            whatever is waiting as soon as the worker is free (batches still form under load).
        max_queue: most items waiting (not yet running); beyond it :meth:`submit` raises
            :class:`BatcherBusy`.
        timeout_s: default per-request deadline, counted from submission (None: no deadline).
        num_workers: worker threads, each running one batch at a time (like Triton's instance
            count). With more than one, ``run_batch`` must be thread-safe (an onnxruntime session
            is); on a CPU, two single-threaded runs side by side use the cores better than one
            two-threaded run of a small batch.
        name: the worker threads' name prefix (shows in stack dumps).

    All items must share one shape and dtype: the first accepted item fixes them, and a
    submission that differs is refused with ``ValueError`` (one caller's odd input must not fail
    the whole batch it would have joined). Futures are resolved outside the batcher's lock, so a
    done-callback may itself submit.
    """

    def __init__(
        self,
        run_batch: Callable[[np.ndarray], Any],
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_queue: int = 1024,
        timeout_s: float | None = None,
        num_workers: int = 1,
        name: str = "leaflens-batcher",
    ) -> None:
        if not callable(run_batch):
            raise TypeError("run_batch must be callable")
        if int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if int(max_queue) < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        if int(num_workers) < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._run_batch = run_batch
        self.max_batch_size = int(max_batch_size)
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.max_queue = int(max_queue)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._work_cond = threading.Condition(self._lock)  # worker: first item, batch full, closing
        self._reap_cond = threading.Condition(self._lock)  # reaper: earlier deadline, closing
        self._queue: deque[_Request] = deque()
        self._running: set[_Request] = set()  # requests inside run_batch right now (all workers)
        self._deadlines: list[tuple[float, int, _Request]] = []  # heap of (deadline, seq, request)
        self._seq = 0
        self._reaper_wakes_at = float("inf")  # deadline the reaper sleeps until
        self._item_spec: tuple[tuple[int, ...], np.dtype] | None = None
        self._closing = False
        self._workers_alive = int(num_workers)
        self._stats = BatcherStats()
        self._workers = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(int(num_workers))]
        self._reaper = threading.Thread(target=self._reap, name=f"{name}-deadlines", daemon=True)
        for worker in self._workers:
            worker.start()
        self._reaper.start()

    # ----------------------------------------------------------------------------- public API
    def submit(self, item: Any, timeout_s: float | None = None) -> Future:
        """Queue one item; return a future resolved with its row of ``run_batch``'s output.

        ``timeout_s`` overrides the batcher's default deadline for this request. Raises
        :class:`BatcherBusy` when the queue is full, :class:`BatcherClosed` after :meth:`close`,
        and ``ValueError`` when the item's shape or dtype differs from the first item's.
        """
        arr = np.asarray(item)
        spec = (arr.shape, arr.dtype)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout}")
        future: Future = Future()
        with self._lock:
            if self._closing:
                raise BatcherClosed("the batcher is closed; no new requests are accepted")
            if self._item_spec is None:
                self._item_spec = spec
            elif spec != self._item_spec:
                shape, dtype = self._item_spec
                raise ValueError(
                    f"item of shape {arr.shape} and dtype {arr.dtype} does not match this batcher's "
                    f"items (shape {shape}, dtype {dtype})"
                )
            if len(self._queue) >= self.max_queue:
                self._stats.busy += 1
                raise BatcherBusy(
                    f"server busy: {len(self._queue)} requests already waiting (max_queue={self.max_queue})"
                )
            now = time.monotonic()
            request = _Request(arr, future, now, None if timeout is None else now + timeout)
            self._queue.append(request)
            self._stats.submitted += 1
            # Wake the worker only when that can change its decision: it sleeps with an empty queue,
            # or until the oldest item is due, or it has to start a now-full batch.
            if len(self._queue) == 1 or len(self._queue) == self.max_batch_size:
                self._work_cond.notify()
            if request.deadline is not None:
                live = len(self._queue) + len(self._running)
                if len(self._deadlines) > 2 * live + 1024:  # forget answered requests (amortised O(1))
                    self._deadlines = [e for e in self._deadlines if e[2].state != "done"]
                    heapq.heapify(self._deadlines)
                self._seq += 1
                heapq.heappush(self._deadlines, (request.deadline, self._seq, request))
                if request.deadline < self._reaper_wakes_at:
                    self._reap_cond.notify()
        return future

    async def submit_async(self, item: Any, timeout_s: float | None = None) -> np.ndarray:
        """Asyncio form of :meth:`submit`: await the item's result (raises what the future raises)."""
        return await asyncio.wrap_future(self.submit(item, timeout_s))

    def stats(self) -> BatcherStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            snap = dataclasses.replace(self._stats)
        ended = snap.answered + snap.failed + snap.timed_out + snap.cancelled
        snap.pending = snap.submitted - ended
        return snap

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closing

    def close(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop accepting requests and settle every pending one; idempotent.

        ``drain=True`` runs what is queued (in batches, without waiting for them to fill) and then
        stops; ``drain=False`` fails queued requests at once with :class:`BatcherClosed` and lets
        only the batch already running finish. If the worker has not finished after ``timeout_s``
        (a ``run_batch`` that hangs), every request still unresolved fails with
        :class:`BatcherClosed`, so no caller waits forever.
        """
        settlements: list[_Settlement] = []
        with self._lock:
            self._closing = True
            if not drain:
                for request in self._queue:
                    settlements.extend(self._decide(request, exc=BatcherClosed(
                        "the batcher closed before this request ran")))
                self._queue.clear()
            self._work_cond.notify_all()
            self._reap_cond.notify_all()
        self._apply(settlements)
        if threading.current_thread() in (*self._workers, self._reaper):
            return  # close() from a done-callback: the workers drain (or stop) once it returns
        end = None if timeout_s is None else time.monotonic() + timeout_s
        for worker in self._workers:
            worker.join(None if end is None else max(0.0, end - time.monotonic()))
        settlements = []
        with self._lock:
            for request in list(self._queue) + list(self._running):
                settlements.extend(self._decide(request, exc=BatcherClosed(
                    "the batcher closed before this request finished")))
            self._queue.clear()
            self._reap_cond.notify_all()
        self._apply(settlements)
        if not any(w.is_alive() for w in self._workers):
            self._reaper.join(timeout_s)

    def __enter__(self) -> DynamicBatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- internals
    @staticmethod
    def _decide(request: _Request, result: Any = None, exc: BaseException | None = None,
                counter: str | None = None) -> list[_Settlement]:
        """Mark a request done (caller holds the lock); return its settlement, or [] if already done."""
        if request.state == "done":
            return []
        request.state = "done"
        if counter is None:
            counter = "answered" if exc is None else "failed"
        return [(request, result, exc, counter)]

    def _apply(self, settlements: list[_Settlement]) -> None:
        """Resolve futures outside the lock (their callbacks may call back in), then count them."""
        if not settlements:
            return
        counts: dict[str, int] = {}
        for request, result, exc, counter in settlements:
            try:
                if exc is None:
                    request.future.set_result(result)
                else:
                    request.future.set_exception(exc)
            except InvalidStateError:  # cancelled by its caller while it waited
                counter = "cancelled"
            counts[counter] = counts.get(counter, 0) + 1
        with self._lock:
            for counter, n in counts.items():
                setattr(self._stats, counter, getattr(self._stats, counter) + n)

    def _take_batch(self) -> tuple[list[_Request], list[_Settlement]] | None:
        """Block until a batch is due; return it (None when closing and nothing is left)."""
        with self._lock:
            while True:
                if not self._queue:
                    if self._closing:
                        self._work_cond.notify_all()  # let the other workers see it too
                        return None
                    self._work_cond.wait()
                    continue
                now = time.monotonic()
                due = self._queue[0].enqueued + self.max_wait_s
                if len(self._queue) >= self.max_batch_size or now >= due or self._closing:
                    break
                self._work_cond.wait(due - now)
            batch: list[_Request] = []
            skipped: list[_Settlement] = []
            while self._queue and len(batch) < self.max_batch_size:
                request = self._queue.popleft()
                # set_running_or_notify_cancel() is False when the caller cancelled it while it waited.
                if request.future.set_running_or_notify_cancel():
                    request.state = "running"
                    batch.append(request)
                else:
                    request.state = "done"
                    skipped.append((request, None, None, "cancelled"))
            self._running.update(batch)
            if self._queue:  # more is waiting: let another idle worker watch its fill window
                self._work_cond.notify()
            return batch, skipped

    def _work(self) -> None:
        try:
            while True:
                taken = self._take_batch()
                if taken is None:
                    return
                batch, skipped = taken
                if skipped:
                    with self._lock:
                        self._stats.cancelled += len(skipped)
                if not batch:
                    continue
                try:
                    items = [r.item for r in batch if r.item is not None]
                    if len(items) != len(batch):  # an item is let go only once its batch has stacked it
                        raise RuntimeError("internal error: a batch holds a request that has already run")
                    stacked = np.stack(items)
                    for request in batch:
                        request.item = None  # the batch holds the data now; a late timeout holds none
                    out = self._run_batch(stacked)
                    if len(out) != len(batch):
                        raise RuntimeError(
                            f"run_batch returned {len(out)} results for a batch of {len(batch)} items"
                        )
                    rows = [np.array(out[i], copy=True) for i in range(len(batch))]
                    error: BaseException | None = None
                except Exception as exc:  # any failure belongs to this batch only
                    rows, error = [], exc
                settlements: list[_Settlement] = []
                with self._lock:
                    self._stats.batches += 1
                    self._stats.batched_items += len(batch)
                    for i, request in enumerate(batch):
                        if error is None:
                            settlements.extend(self._decide(request, result=rows[i]))
                        else:
                            settlements.extend(self._decide(request, exc=error))
                    self._running.difference_update(batch)
                self._apply(settlements)
        finally:
            with self._lock:
                self._workers_alive -= 1
                self._reap_cond.notify_all()

    def _reap(self) -> None:
        """Fail requests whose deadline passed, waiting or running, as soon as it passes."""
        while True:
            settlements: list[_Settlement] = []
            with self._lock:
                if self._workers_alive == 0 and self._closing:
                    return
                now = time.monotonic()
                dropped = False
                heap = self._deadlines
                while heap and (heap[0][2].state == "done" or heap[0][0] <= now):
                    deadline, _, request = heapq.heappop(heap)
                    if request.state == "done":
                        continue
                    dropped = dropped or request.state == "queued"
                    error = TimeoutError(f"request timed out after {deadline - request.enqueued:.3f} s")
                    settlements.extend(self._decide(request, exc=error, counter="timed_out"))
                if dropped:  # timed-out items neither run nor hold queue space
                    self._queue = deque(r for r in self._queue if r.state != "done")
                if not settlements:
                    self._reaper_wakes_at = self._deadlines[0][0] if self._deadlines else float("inf")
                    wait = None if not self._deadlines else max(self._reaper_wakes_at - now, 0.0)
                    self._reap_cond.wait(wait)
                    self._reaper_wakes_at = float("inf")
            self._apply(settlements)
