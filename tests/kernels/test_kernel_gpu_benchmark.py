"""benchmarks/gpu.py: the no-GPU skip (last line JSON with nulls) and a smoke run of every case at tiny
sizes on the kernel backends (CPU emulator always; the real GPU where there is one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from bench_helpers import BENCHMARKS, load_benchmark

from leaflens.kernels import _cuda

BENCH = BENCHMARKS / "gpu.py"


def _load_bench():
    return load_benchmark("gpu.py")


def test_benchmark_skips_without_gpu():
    env = dict(os.environ, **{_cuda.DISABLE_ENV: "1"})
    proc = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "skipped, no GPU: disabled by" in lines[0]
    result = json.loads(lines[-1])
    assert result["skipped"].startswith("disabled by")
    assert result["train_step"] is None
    bench = _load_bench()
    assert result["kernels"] == {name: None for name in bench.KERNEL_NAMES}


def test_every_case_runs_and_agrees_with_cupy_expression(backend):
    bench = _load_bench()
    cases = bench.build_cases(backend.xp, bench.SIZES["tiny"])
    assert [c.name for c in cases] == bench.KERNEL_NAMES
    timer = bench.cpu_timer if backend.name == "emu" else bench.gpu_timer(backend.xp)
    results = bench.run_cases(cases, timer, repeats=1)
    for name, r in results.items():
        assert r["max_abs_diff"] is not None and r["max_abs_diff"] < 1e-3, (name, r["max_abs_diff"])
        assert np.isfinite(r["ours_rate"]) and r["ours_rate"] > 0
    bench.print_table(results)
