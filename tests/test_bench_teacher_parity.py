"""benchmarks/teacher_parity.py without PyTorch (its reference): skipped cleanly, as benchmarks/gpu.py is
without a GPU: exit 0, the reason on stderr, a JSON last line with ``skipped`` and null figures."""

from __future__ import annotations

import json
import subprocess
import sys

from bench_helpers import BENCHMARKS

# `import torch` fails in the child whether or not torch is installed here
NO_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = [sys.argv[1]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_without_torch_the_benchmark_is_skipped_with_a_json_line():
    out = subprocess.run([sys.executable, "-c", NO_TORCH, str(BENCHMARKS / "teacher_parity.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "skipped" in out.stderr and "PyTorch" in out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert "PyTorch" in last["skipped"]
    assert last["reader_identical"] is None and last["engine_img_s"] is None and last["torch_img_s"] is None
