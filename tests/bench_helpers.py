"""A benchmark script loaded as a module, for the tests of its pieces (benchmarks/ is not a package), or run as a
user runs it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str) -> ModuleType:
    """``benchmarks/<script>`` freshly executed as the module ``leaflens_benchmark_<stem>``."""
    path = BENCHMARKS / script
    return load_module(path, f"leaflens_benchmark_{path.stem}")


def load_module(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` freshly executed as the module ``name`` (neither benchmarks/ nor tests/ is a
    package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def run_script(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<script> ARGS`` as a user runs it, its output captured."""
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_refused(out: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """``out`` exited ``code`` with no traceback: a usage error (2: argparse's usage, then one error line) or a
    failure (1: one line on stderr), its last line holding ``words``; returns that line."""
    assert out.returncode == code, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    if code == 1:
        assert len(lines) == 1, out.stderr
    for word in words:
        assert word in lines[-1], (word, lines[-1])
    return lines[-1]
