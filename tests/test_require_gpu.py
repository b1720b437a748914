"""tests/conftest.py: gpu tests skip cleanly without a GPU, and LEAFLENS_REQUIRE_GPU=1 turns any skip of a
gpu test (no GPU, or a skip inside the test) into a failure, while other tests keep their skips."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from leaflens.kernels import _cuda

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
import pytest

@pytest.mark.gpu
def test_on_the_gpu():
    pass

@pytest.mark.gpu
def test_skips_inside():
    pytest.skip("needs something else")

def test_cpu_skip():
    pytest.skip("not a gpu test")

def test_cpu():
    pass
'''


def run_pytest(tmp_path: Path, require: str | None, pretend_gpu: bool = False) -> subprocess.CompletedProcess[str]:
    """pytest on TESTS with the suite's conftest, without a GPU (or with the probe pretending to find one)."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_tiny.py").write_text(TESTS, encoding="utf-8")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n", encoding="utf-8")
    (tmp_path / "pretend_gpu.py").write_text(
        "from leaflens.kernels import _cuda\n_cuda._probe_result = (True, 'pretend')\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "LEAFLENS_REQUIRE_GPU"}
    env[_cuda.DISABLE_ENV] = "1"  # no GPU, whatever this machine has
    if require is not None:
        env["LEAFLENS_REQUIRE_GPU"] = require
    plugin = ["-p", "pretend_gpu"] if pretend_gpu else []
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *plugin,
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)


def test_gpu_tests_skip_without_the_requirement(tmp_path):
    proc = run_pytest(tmp_path, "0")  # as if unset
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 3 skipped" in proc.stdout
    assert f"no GPU: disabled by {_cuda.DISABLE_ENV}=1" in proc.stdout


def test_require_gpu_fails_gpu_tests_skipped_for_want_of_a_gpu(tmp_path):
    proc = run_pytest(tmp_path, "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "1 passed, 1 skipped, 2 errors" in out, out  # the skip marker acts at setup: reported as errors
    assert out.count(f"LEAFLENS_REQUIRE_GPU=1 and this gpu test was skipped: Skipped: no GPU: disabled by "
                     f"{_cuda.DISABLE_ENV}=1") == 2, out
    assert "SKIPPED [1] test_tiny.py:13: not a gpu test" in out


def test_require_gpu_fails_a_gpu_test_that_skips_itself(tmp_path):
    proc = run_pytest(tmp_path, "1", pretend_gpu=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "1 failed, 2 passed, 1 skipped" in out, out
    assert "LEAFLENS_REQUIRE_GPU=1 and this gpu test was skipped: Skipped: needs something else" in out
    assert run_pytest(tmp_path, None, pretend_gpu=True).returncode == 0
