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
from typing import Any, TypeVar

import numpy as np

from leaflens.cpus import usable_cpus

T = TypeVar("T")

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


def _as_caller(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` run in a pool thread with the calling thread's NumPy error settings (``np.errstate`` is per
    thread: a caller that silences overflow warnings, as the training loop does, must silence them in the
    threads that do its work too)."""
    settings = np.geterr()

    def run(*args: Any) -> T:
        with np.errstate(**settings):
            return fn(*args)

    return run


def parallel_rows(n: int, work: int, fn: Callable[[int, int], object]) -> list[object]:
    """Call ``fn(lo, hi)`` for slices of n rows, in threads when the work is large enough; results in order.

    Only for NumPy arrays: the caller must not use it for CuPy, whose kernels run asynchronously anyway.
    """
    parts = chunks(n, work)
    if len(parts) <= 1 or threading.current_thread().name.startswith("leaflens-engine"):
        return [fn(lo, hi) for lo, hi in parts] if parts else []
    pool = _get_pool(num_threads())
    futures = [pool.submit(_as_caller(fn), lo, hi) for lo, hi in parts[1:]]
    first = fn(*parts[0])  # the calling thread does a share too
    return [first] + [f.result() for f in futures]


def for_rows(xp: object, n: int, work: int, fn: Callable[[int, int], object]) -> list[object]:
    """:func:`parallel_rows` on NumPy; one call over all rows on any other array module (CuPy)."""
    if xp is not np or n == 0:  # an empty batch: one call over no rows, so sums are zeros of the right shape
        return [fn(0, n)]
    return parallel_rows(n, work, fn)


TILE = 1 << 16  # values per tile of for_tiles: 256 KB of float32, so a few operands fit a 1 MB L2 cache


def for_tiles(xp: object, rows: int, row_size: int, fn: Callable[[int, int], object],
              tile: int | None = None) -> list[object]:
    """Call ``fn(lo, hi)`` over tiles of about ``tile`` (default :data:`TILE`) values (whole rows of
    ``row_size`` values each), the tiles shared out among the threads; results in tile order. One call over
    all rows on CuPy.

    For chains of elementwise passes: run one after another over a tile, they read and write the cache
    instead of memory. The tiles depend only on the shape, so per-tile partial sums added in tile order
    give the same result whatever the thread count.
    """
    if xp is not np or rows == 0:  # an empty batch: one call over no rows, so sums are zeros of the right shape
        return [fn(0, rows)]
    per = rows_per_tile(row_size, tile)
    bounds = [*range(0, rows, per), rows]
    return share(list(zip(bounds[:-1], bounds[1:])), rows * row_size, fn)


def rows_per_tile(row_size: int, tile: int | None = None) -> int:
    """Rows of ``row_size`` values in one tile of :func:`for_tiles`: about ``tile`` (default :data:`TILE`)
    values, at least one row."""
    return max(1, (TILE if tile is None else tile) // max(row_size, 1))


# Whether share() hands items out as threads come free (True) or as one contiguous run per thread (False).
DYNAMIC = True


def share(items: list[tuple[int, int]], work: int, fn: Callable[[int, int], T]) -> list[T]:
    """``[fn(lo, hi) for lo, hi in items]``, the items shared out among the engine's threads when ``work``
    (elements touched in all) is large enough; results in item order.

    Each thread takes the next item as soon as it is done with its last, so a thread the OS stalls (other
    jobs on the same cores) holds up at most one item instead of half the work, as one contiguous run per
    thread did: on a busy machine the other thread keeps going. Which thread runs an item does not change
    its result, and callers add per-item results in item order, so sums stay the same whatever the thread
    count or timing.
    """
    k = min(num_threads(), len(items), max(1, work // MIN_ELEMENTS))
    if k <= 1 or threading.current_thread().name.startswith("leaflens-engine"):
        return [fn(lo, hi) for lo, hi in items]
    results: list[Any] = [None] * len(items)
    if not DYNAMIC:
        bounds = np.linspace(0, len(items), k + 1).astype(int)
        order = [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    lock = threading.Lock()
    taken = [0]

    def worker(mine: list[int] | None) -> None:
        while True:
            if mine is not None:
                if not mine:
                    return
                i = mine.pop(0)
            else:
                with lock:
                    i = taken[0]
                    taken[0] += 1
                if i >= len(items):
                    return
            results[i] = fn(*items[i])

    pool = _get_pool(num_threads())
    futures = [pool.submit(_as_caller(worker), None if DYNAMIC else order[t]) for t in range(1, k)]
    try:
        worker(None if DYNAMIC else order[0])  # the calling thread does a share too
    finally:
        for f in futures:
            f.result()
    return results


def per_tile(xp: object, v: object, rows: int, tile: int | None = None) -> Callable[[int, int], object]:
    """``v`` (one value per column) for the tile of rows lo..hi of a :func:`for_tiles` call with the same
    ``tile``: on NumPy a contiguous (tile rows, columns) array repeating it, made once, so ``tile - v`` runs
    NumPy's flat loop instead of a broadcast one (measured 2x faster at 96-1152 columns, 3-5x at 16-32); ``v``
    on CuPy."""
    if xp is not np:
        return lambda lo, hi: v
    cols = v.shape[-1]  # type: ignore[attr-defined]
    full = np.broadcast_to(v, (min(rows, rows_per_tile(cols, tile)), cols)).copy()  # type: ignore[call-overload]
    return lambda lo, hi: full[:hi - lo]


def sum_in_order(parts: list[Any]) -> Any:
    """Per-tile or per-chunk partial results added in their fixed order, so the total does not depend on the
    thread count or on which thread finished first."""
    if len(parts) == 1:
        return parts[0]
    out = parts[0] + parts[1]  # a new array, so the parts are left as they are
    for p in parts[2:]:
        out += p
    return out


_ones: dict[tuple[int, str], np.ndarray] = {}


def column_sums(xp: object, a: object) -> object:
    """``a.sum(axis=0)`` of a 2-D array. On NumPy as ``ones @ a`` (BLAS): NumPy sums a C-contiguous
    array down its rows one short row at a time, measured 10-20x slower than the product for 16-32
    columns (and no faster for 1000)."""
    if xp is not np or a.dtype not in (np.float32, np.float64):  # type: ignore[attr-defined]
        return a.sum(axis=0)  # type: ignore[attr-defined]
    rows, dtype = a.shape[0], a.dtype  # type: ignore[attr-defined]
    key = (rows, dtype.str)
    ones = _ones.get(key)
    if ones is None:
        if len(_ones) > 64:
            _ones.clear()
        ones = _ones[key] = np.ones(rows, dtype=dtype)
    return ones @ a


def for_chunks(n: int, chunk: int, work: int, fn: Callable[[int, int], T]) -> list[T]:
    """Call ``fn(lo, hi)`` for chunks of ``chunk`` rows out of n, the chunks shared out among the threads
    (:func:`share`); results in chunk order, so sums of them in that order do not
    depend on the thread count.

    BLAS keeps its own thread count here. Asking OpenBLAS for one thread per calling thread
    (``openblas_set_num_threads_local``, 0.3.27+) made a whole training run 2 % faster on the student, 0 % on
    Lite0, but OpenBLAS then split some products one way or the other from run to run: the same distill
    command on 2 threads trained another model 1 time in 3-4 (8 of 8 runs alike without it).
    """
    bounds = [*range(0, n, max(1, chunk)), n]
    return share(list(zip(bounds[:-1], bounds[1:])), work, fn)
