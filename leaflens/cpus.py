"""How many CPUs leaflens may use: one answer for every pool it starts.

The engine's threads, data_prep's decode processes, the Predictor's onnxruntime threads and the
web app's decode workers all size themselves with :func:`usable_cpus`. ``os.cpu_count()`` is the
wrong number inside a container: it counts the HOST's cores, so a 2-CPU container on a 64-core host
would start 64 processes that share 2 CPUs' worth of time. The answer here is

- ``LEAFLENS_THREADS`` when set (a positive integer): the user's choice, for every pool;
- otherwise the CPUs this process may be scheduled on (its affinity mask, e.g. ``taskset``/cpusets),
  capped by the cgroup CPU quota (``docker --cpus``, Kubernetes CPU limits): ``cpu.max`` under
  cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` under v1. A fractional quota is rounded
  down (1.5 CPUs -> 1 thread), never below 1.

Lives at the package root and imports nothing from leaflens, so every package may use it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

THREADS_ENV = "LEAFLENS_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    """The facts behind :func:`usable_cpus` (``leaflens doctor`` and run reports show them)."""

    logical: int            # CPUs of the machine (os.cpu_count())
    affinity: int           # CPUs this process may be scheduled on
    quota: float | None     # cgroup CPU quota in CPUs; None when unlimited or not found
    override: int | None    # LEAFLENS_THREADS, when set

    @property
    def available(self) -> int:
        """CPUs the process can really use: the affinity mask capped by the quota (at least 1)."""
        return _available(self.affinity, self.quota)

    @property
    def usable(self) -> int:
        """How many CPUs leaflens uses: the override when set, else :attr:`available`."""
        return self.override if self.override is not None else self.available


def _available(affinity: int, quota: float | None) -> int:
    return max(1, affinity if quota is None else min(affinity, int(quota)))


def _affinity() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, dict[str, str]]:
    """(cgroup v2 path, {v1 controller: path}) of this process, from /proc/self/cgroup."""
    v2, v1 = None, {}
    try:
        lines = proc_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None, {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        for controller in controllers.split(","):
            if controller:
                v1[controller] = path
    return v2, v1


def _dirs_up(base: Path, rel: str | None) -> list[Path]:
    """``base/rel`` and each of its parents up to ``base`` (a limit on any ancestor applies too)."""
    out = [base]
    if rel:
        here = base
        for part in Path(rel.strip("/")).parts:
            here = here / part
            out.append(here)
    return out


def _read_quota_v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text(encoding="utf-8").split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _read_quota_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text(encoding="utf-8"))
        period = int((folder / "cpu.cfs_period_us").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None  # -1: unlimited


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup or its ancestors; None when unlimited.

    ``root`` is where the cgroup file system is mounted and ``proc_cgroup`` the process's membership
    file: both are parameters so tests can point them at a fake tree.
    """
    v2_path, v1_paths = _cgroup_paths(proc_cgroup)
    quotas = [_read_quota_v2(d) for d in _dirs_up(root, v2_path)]
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):  # v1 mounts the cpu controller under one of these
        base = root / controller
        if base.is_dir():
            quotas += [_read_quota_v1(d) for d in _dirs_up(base, v1_paths.get("cpu"))]
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def threads_override(environ: Mapping[str, str] | None = None) -> int | None:
    """``LEAFLENS_THREADS`` as a positive integer, None when unset or empty; ValueError naming it otherwise."""
    value = (os.environ if environ is None else environ).get(THREADS_ENV, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{THREADS_ENV}={value!r} is not a whole number of threads") from None
    if n < 1:
        raise ValueError(f"{THREADS_ENV}={value!r}: the number of threads must be at least 1")
    return n


@functools.lru_cache(maxsize=1)
def _this_process_quota() -> float | None:
    return cgroup_cpu_quota()


def cpu_budget(root: Path | None = None, proc_cgroup: Path = PROC_CGROUP,
               environ: Mapping[str, str] | None = None) -> CpuBudget:
    """Every fact :func:`usable_cpus` is decided from.

    With the default ``root`` the quota is read once per process (the engine asks on every op); the
    affinity mask and ``LEAFLENS_THREADS`` are read on each call.
    """
    return CpuBudget(logical=max(1, os.cpu_count() or 1), affinity=_affinity(), quota=_quota(root, proc_cgroup),
                     override=threads_override(environ))


def _quota(root: Path | None, proc_cgroup: Path) -> float | None:
    return _this_process_quota() if root is None else cgroup_cpu_quota(root, proc_cgroup)


def usable_cpus(root: Path | None = None, proc_cgroup: Path = PROC_CGROUP,
                environ: Mapping[str, str] | None = None) -> int:
    """How many CPUs leaflens should spread work over (threads or processes); see the module docstring.

    Cheap enough for the engine to ask on every op (a few microseconds: no ``os.cpu_count()``).
    """
    override = threads_override(environ)
    return override if override is not None else _available(_affinity(), _quota(root, proc_cgroup))


def worker_context() -> Any:
    """The multiprocessing context for worker pools: "forkserver" where the platform's default is "fork", else
    the default. A fork copies the parent mid-way, with whatever locks its other threads hold (onnxruntime's
    pool, a web server's, a test run's): the child can wait on one forever. Seen as a preprocess hung after
    its process had served a model. The fork server is a fresh process with no such threads; workers fork
    from it (its start costs about a second, once per process)."""
    import multiprocessing  # noqa: PLC0415

    default = multiprocessing.get_context()
    if default.get_start_method() == "fork" and "forkserver" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("forkserver")
    return default


def _worker_start(initializer: Callable[[], None] | None) -> None:
    """A pool worker leaves Ctrl-C and SIGTERM to the process that started it: it moves to a process group of
    its own, out of reach of the terminal's Ctrl-C and of ``timeout``'s SIGTERM, which signal every process of
    the command's group (a worker killed by them may die half-way through writing a result, and the pool then
    waits for the rest of that message forever). SIGTERM sent to the worker itself still ends it: that is how
    the pool stops its workers when one of them died (ignoring it deadlocked Python 3.13's pool there)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # before its own group: a Ctrl-C at its very start
    if hasattr(os, "setpgrp"):
        os.setpgrp()
    if initializer is not None:
        initializer()


@contextlib.contextmanager
def worker_pool(workers: int, initializer: Callable[[], None] | None = None,
                stop_seconds: float = 10.0) -> Iterator[Any]:
    """A ``concurrent.futures.ProcessPoolExecutor`` of ``workers`` processes, for ``pool.map(fn, items,
    chunksize=...)``.

    Stopped by Ctrl-C or SIGTERM (which the command line turns into KeyboardInterrupt), it never hangs and
    leaves no process behind: the tasks not started are cancelled, the workers (which those signals do not
    reach) finish the chunk in hand (and the one queued for them) and exit, and the exception goes on; workers still
    busy ``stop_seconds`` later (a photo that never finishes decoding), or when a second Ctrl-C comes, are
    killed. A worker that dies (the system's out-of-memory killer) raises :class:`WorkerDied`. A
    ``multiprocessing.Pool`` hung here: a worker killed by the signal while it held the pool's task-queue lock,
    or half-way through a result, left it waiting forever. The workers are started with "spawn", as children of
    this process: a fork server is one more process the signal kills, after which the pool could no longer
    tell its workers' state (and a fork of this process could inherit locks its other threads hold).
    """
    import multiprocessing  # noqa: PLC0415
    import time  # noqa: PLC0415
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415
    from concurrent.futures.process import BrokenProcessPool  # noqa: PLC0415

    if sys.platform == "win32":
        workers = min(workers, 61)  # the most ProcessPoolExecutor takes there
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_start,
                               initargs=(initializer,))
    try:
        yield pool
    except BaseException as exc:
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + stop_seconds
        try:
            for p in procs:  # one deadline for all of them, not stop_seconds each
                p.join(max(0.0, deadline - time.monotonic()))
        finally:  # also when a second Ctrl-C cuts the wait short: nothing keeps running behind the command
            for p in procs:
                if p.is_alive():
                    p.kill()
        if isinstance(exc, BrokenProcessPool):
            raise WorkerDied(f"a worker process stopped abruptly ({workers} were running; the system may have "
                             "killed it for memory): run again with fewer --workers") from None
        raise
    else:
        pool.shutdown(wait=True)


class WorkerDied(RuntimeError):
    """A process of :func:`worker_pool` ended without finishing its work (killed, or crashed in native code)."""
