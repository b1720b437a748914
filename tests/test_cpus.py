"""leaflens.cpus: the affinity mask, the cgroup CPU quota (v2 and v1) and LEAFLENS_THREADS decide the CPUs
every pool uses, from fake cgroup trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from leaflens import cpus

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "kernels", "data_prep", "pipeline", "apps", "leaflens")


@pytest.fixture
def eight_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process may run on 8 CPUs, whatever this machine has."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


def _tree(tmp_path: Path, files: dict[str, str], membership: str = "0::/\n") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(membership)
    return root, proc


@pytest.mark.usefixtures("eight_cpus")
@pytest.mark.parametrize(("files", "membership", "quota", "usable"), [
    ({"cpu.max": "200000 100000\n"}, "0::/\n", 2.0, 2),                 # docker --cpus 2, cgroup v2
    ({"cpu.max": "150000 100000\n"}, "0::/\n", 1.5, 1),                 # a fractional quota rounds down
    ({"cpu.max": "50000 100000\n"}, "0::/\n", 0.5, 1),                  # never below 1
    ({"cpu.max": "max 100000\n"}, "0::/\n", None, 8),                   # unlimited
    ({}, "0::/\n", None, 8),                                            # no cgroup file system
    ({"a/b/cpu.max": "max 100000\n", "a/cpu.max": "300000 100000\n"},   # a limit on an ancestor applies
     "0::/a/b\n", 3.0, 3),
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu:/\n", 4.0, 4),  # v1
    ({"cpu,cpuacct/k/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/k/cpu.cfs_period_us": "50000\n"},
     "3:cpu,cpuacct:/k\n", 2.0, 2),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu:/\n", None, 8),  # v1 unlimited
    ({"cpu.max": "not numbers\n"}, "0::/\n", None, 8),                  # unreadable: ignored, not fatal
])
def test_quota_caps_the_affinity(tmp_path: Path, files: dict[str, str], membership: str, quota: float | None,
                                 usable: int) -> None:
    root, proc = _tree(tmp_path, files, membership)
    assert cpus.cgroup_cpu_quota(root, proc) == quota
    assert cpus.usable_cpus(root, proc, environ={}) == usable
    budget = cpus.cpu_budget(root, proc, environ={})
    assert (budget.affinity, budget.quota, budget.override, budget.available, budget.usable) == (
        8, quota, None, usable, usable)


@pytest.mark.usefixtures("eight_cpus")
def test_the_affinity_caps_a_generous_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, proc = _tree(tmp_path, {"cpu.max": "1600000 100000\n"})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert cpus.usable_cpus(root, proc, environ={}) == 3


@pytest.mark.usefixtures("eight_cpus")
def test_leaflens_threads_overrides_everything(tmp_path: Path) -> None:
    root, proc = _tree(tmp_path, {"cpu.max": "100000 100000\n"})
    assert cpus.usable_cpus(root, proc, environ={"LEAFLENS_THREADS": "3"}) == 3
    assert cpus.usable_cpus(root, proc, environ={"LEAFLENS_THREADS": " "}) == 1  # blank: unset
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match="LEAFLENS_THREADS"):
            cpus.usable_cpus(root, proc, environ={"LEAFLENS_THREADS": bad})


def test_every_pool_asks_the_same_function(monkeypatch: pytest.MonkeyPatch) -> None:
    from leaflens.engine import parallel

    monkeypatch.setenv("LEAFLENS_THREADS", "5")
    assert parallel.num_threads() == 5 == cpus.usable_cpus()
    monkeypatch.delenv("LEAFLENS_THREADS")
    assert parallel.num_threads() == cpus.usable_cpus() == cpus.cpu_budget().available


def test_no_other_module_counts_cpus_itself() -> None:
    offenders = []
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "leaflens" / "cpus.py":
                continue
            text = path.read_text(encoding="utf-8")
            for needle in ("os.cpu_count(", "sched_getaffinity(", "cpu.max", "cfs_quota_us"):
                if needle in text:
                    offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not offenders, "count CPUs with leaflens.cpus.usable_cpus:\n" + "\n".join(offenders)


_POOL_SCRIPT = """
import sys, time
from leaflens.cpus import worker_pool

def work(i):
    time.sleep(0.001)
    return bytes(200_000)  # results big enough to be mid-write when a signal lands

if __name__ == "__main__":
    try:
        with worker_pool(2) as pool:
            print("started", flush=True)
            for _ in pool.map(work, range(4000), chunksize=4):
                pass
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_worker_pool_stopped_by_a_signal_to_the_whole_group_ends(tmp_path, sig):
    """Ctrl-C (and timeout, and systemd) signal every process of the group. With multiprocessing.Pool a worker
    killed holding the task-queue lock or half-way through a result left preprocess and data synth hanging
    forever (2 of 5 runs); the workers now ignore the signal, finish their chunk and the pool stops."""
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    script = tmp_path / "pool.py"
    script.write_text(_POOL_SCRIPT, encoding="utf-8")
    # the script turns SIGTERM into KeyboardInterrupt as the command line does
    # SIGINT as a terminal gives it (a job started in the background inherits it ignored)
    prelude = ("import signal, runpy, faulthandler; faulthandler.register(signal.SIGUSR1, all_threads=True); "
               "signal.signal(signal.SIGTERM, signal.default_int_handler); "
               "signal.signal(signal.SIGINT, signal.default_int_handler); ")
    for delay in (0.3, 0.6, 0.9):
        run = prelude + f"runpy.run_path({str(script)!r}, run_name='__main__')"
        proc = subprocess.Popen([sys.executable, "-c", run],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                cwd=ROOT)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
            time.sleep(delay)
            os.killpg(proc.pid, getattr(signal, sig))
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # the stacks of every thread, for the failure message
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            pytest.fail(f"the pool hung after {sig} at {delay} s:\n{err[-3000:]}")
        assert proc.returncode == 130 and "interrupted" in out, err
        assert "Traceback" not in err, err


def _die_in(i: int) -> int:
    if i == 3:
        os.kill(os.getpid(), 9)  # the system's out-of-memory killer, say
    return i


def test_a_worker_that_dies_is_said_in_words_not_a_broken_pool_traceback():
    with pytest.raises(cpus.WorkerDied, match="a worker process stopped abruptly .*fewer --workers"):
        with cpus.worker_pool(2) as pool:
            list(pool.map(_die_in, range(8)))


def test_a_bad_leaflens_threads_is_one_line_and_a_usage_error(monkeypatch, capsys):
    """`LEAFLENS_THREADS=abc leaflens evaluate ...` ended in a ValueError traceback, exit 1."""
    from leaflens.pipeline.cli import main as cli

    for value, says in (("abc", "is not a whole number of threads"), ("0", "must be at least 1")):
        monkeypatch.setenv("LEAFLENS_THREADS", value)
        assert cli(["doctor", "--json"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"leaflens doctor: LEAFLENS_THREADS='{value}'") and says in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
