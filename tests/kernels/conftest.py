"""Fixtures for the kernel tests: a ``backend`` that runs the ``*_cuda`` wrappers either on the CPU
emulator (always, where a C++20 compiler exists) or on a real GPU (``gpu`` marker)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from kernel_emu import Emulator, compiler

from leaflens.kernels import _cuda


@dataclass
class Backend:
    """Where the kernels run: ``put`` moves a NumPy array there, ``get`` brings one back."""

    name: str
    xp: ModuleType
    emulator: Emulator | None = None

    def put(self, a: np.ndarray) -> Any:
        return self.xp.asarray(np.ascontiguousarray(a)) if self.xp is not np else np.array(a, copy=True, order="C")

    def get(self, a: Any) -> np.ndarray:
        return np.asarray(a) if self.xp is np else self.xp.asnumpy(a)


@pytest.fixture(scope="session")
def emulator(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Emulator:
    """A host build of every kernel source, cached by source hash in pytest's cache folder
    (.pytest_cache, git-ignored) so that it is rebuilt only when a source changes."""
    cxx = compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/clang++) to build the kernel emulator")
    cache = getattr(request.config, "cache", None)
    build_dir = Path(cache.mkdir("kernel_emu")) if cache is not None else tmp_path_factory.mktemp("kernel_emu")
    return Emulator(build_dir, cxx, sorted(p.name for p in _cuda.KERNEL_DIR.glob("*.cu")))


@pytest.fixture(params=[pytest.param("emu", id="emu"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    if request.param == "gpu":
        yield Backend("gpu", _cuda.cupy_module())
        return
    emu = request.getfixturevalue("emulator")
    monkeypatch.setattr(_cuda, "cupy_module", lambda: np)
    monkeypatch.setattr(_cuda, "load_kernel", emu.load_kernel)
    yield Backend("emu", np, emu)
