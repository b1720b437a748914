"""A benchmark script loaded as a module, for the tests of its pieces (benchmarks/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str) -> ModuleType:
    """``benchmarks/<script>`` freshly executed as the module ``leaflens_benchmark_<stem>``."""
    path = BENCHMARKS / script
    spec = importlib.util.spec_from_file_location(f"leaflens_benchmark_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module
