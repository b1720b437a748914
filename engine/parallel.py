"""Spread memory-bound array work over the CPU's cores by splitting it along the batch axis.

NumPy runs each elementwise ufunc, copy or reduction on one core, while BLAS uses them all; in a
conv-net training step those single-core passes (im2col copies, BatchNorm, ReLU, pooling) take
about as long as the matmuls. NumPy releases the GIL inside those loops, so giving each thread
one slice of the batch runs them side by side: measured here about 1.8x on a 33 MB multiply with 2
threads. The split depends only on the batch size and the thread count, so results stay
deterministic on a given machine. Set ``LEAFLENS_THREADS=1`` to turn it off (it sets every leaflens
pool's size: :mod:`leaflens.cpus`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from leaflens.cpus import usable_cpus

MIN_ELEMENTS = 1 << 18  # below ~1 MB of float32 the hand-off costs more than it saves

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def num_threads() -> int:
    """Threads the engine splits work over: :func:`leaflens.cpus.usable_cpus` (affinity, cgroup quota,
    ``LEAFLENS_THREADS``), the count every leaflens pool uses."""
    return usable_cpus()


def _get_pool(n: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers != n:  # noqa: SLF001
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="leaflens-engine")
        return _pool


def chunks(n: int, work: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges over n batch rows for an op touching ``work`` elements in all."""
    k = min(num_threads(), n, max(1, work // MIN_ELEMENTS))
    bounds = np.linspace(0, n, k + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def parallel_rows(n: int, work: int, fn: Callable[[int, int], object]) -> list[object]:
    """Call ``fn(lo, hi)`` for slices of n rows, in threads when the work is large enough; results in order.

    Only for NumPy arrays: the caller must not use it for CuPy, whose kernels run asynchronously anyway.
    """
    parts = chunks(n, work)
    if len(parts) <= 1 or threading.current_thread().name.startswith("leaflens-engine"):
        return [fn(lo, hi) for lo, hi in parts] if parts else []
    pool = _get_pool(num_threads())
    futures = [pool.submit(fn, lo, hi) for lo, hi in parts[1:]]
    first = fn(*parts[0])  # the calling thread does a share too
    return [first] + [f.result() for f in futures]


def for_rows(xp: object, n: int, work: int, fn: Callable[[int, int], object]) -> list[object]:
    """:func:`parallel_rows` on NumPy; one call over all rows on any other array module (CuPy)."""
    if xp is not np:
        return [fn(0, n)]
    return parallel_rows(n, work, fn)
