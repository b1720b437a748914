"""The GPU probe never raises and explains itself; sources resolve their includes; argument checks."""

from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest

from leaflens.kernels import _checks, _cuda

INCLUDE = re.compile(r"^\s*#\s*include", re.MULTILINE)


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(_cuda, "_probe_result", None)
    yield
    _cuda.gpu_probe(refresh=True)


def test_probe_reports_missing_cupy(monkeypatch, fresh_probe):
    monkeypatch.delenv(_cuda.DISABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert _cuda.gpu_available() is False
    assert "CuPy is not importable" in _cuda.gpu_unavailable_reason()
    with pytest.raises(RuntimeError, match="CUDA kernels need a GPU with CuPy: CuPy is not importable"):
        _cuda.cupy_module()


def test_probe_survives_is_available_raising(monkeypatch, fresh_probe):
    fake = types.ModuleType("cupy")

    def boom() -> bool:
        raise RuntimeError("cudaErrorInsufficientDriver")

    fake.cuda = types.SimpleNamespace(is_available=boom)
    monkeypatch.delenv(_cuda.DISABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    ok, why = _cuda.gpu_probe()
    assert ok is False
    assert "cudaErrorInsufficientDriver" in why


def test_probe_reports_no_device(monkeypatch, fresh_probe):
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.delenv(_cuda.DISABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert _cuda.gpu_unavailable_reason() == "CuPy sees no CUDA device (no GPU, or no working NVIDIA driver)"


def test_probe_can_be_disabled(monkeypatch, fresh_probe):
    monkeypatch.setenv(_cuda.DISABLE_ENV, "1")
    assert _cuda.gpu_probe() == (False, f"disabled by {_cuda.DISABLE_ENV}=1")


def test_kernel_source_inlines_local_includes_once(tmp_path):
    (tmp_path / "a.cuh").write_text("#pragma once\nint a_value;\n")
    (tmp_path / "b.cuh").write_text('#include "a.cuh"\nint b_value;\n')
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n__global__ void k() {}\n')
    text = _cuda.kernel_source(tmp_path / "k.cu")
    assert text.count("int a_value;") == 1
    assert "int b_value;" in text
    assert not INCLUDE.search(text)
    assert "#pragma once" not in text
    (tmp_path / "bad.cu").write_text('#include "missing.cuh"\n')
    with pytest.raises(FileNotFoundError, match="missing.cuh"):
        _cuda.kernel_source(tmp_path / "bad.cu")
    with pytest.raises(FileNotFoundError, match="nope.cu"):
        _cuda.kernel_source("nope.cu")


def test_shipped_sources_need_no_headers():
    # NVRTC gets no include path: after inlining, no #include may remain.
    for path in _cuda.KERNEL_DIR.glob("*.cu"):
        assert not INCLUDE.search(_cuda.kernel_source(path.name)), path.name


def test_launch_shapes():
    assert _cuda.grid_1d(1) == ((1,), (256,))
    assert _cuda.grid_1d(257) == ((2,), (256,))
    assert _cuda.grid_1d(10**12)[0] == (65535,)
    with pytest.raises(ValueError):
        _cuda.grid_1d(0)
    assert [_cuda.row_block(w) for w in (1, 32, 33, 300, 5000)] == [32, 32, 64, 256, 256]


def test_checks_name_the_argument():
    with pytest.raises(TypeError, match="k: x has dtype float64, expected float32"):
        _checks.require_array(np, "k", "x", np.zeros(3), [np.float32])
    with pytest.raises(ValueError, match="k: x must be 2-D"):
        _checks.require_array(np, "k", "x", np.zeros(3, np.float32), [np.float32], ndim=2)
    with pytest.raises(ValueError, match="C-contiguous"):
        _checks.require_array(np, "k", "x", np.zeros((3, 4), np.float32)[:, ::2], [np.float32])
    with pytest.raises(ValueError, match="32-bit"):
        _checks.require_int32("k", N=2**31)
    assert _checks.require_padding("k", 1) == (1, 1, 1, 1)
    assert _checks.require_padding("k", (1, 2)) == (1, 1, 2, 2)
    with pytest.raises(ValueError, match="padding"):
        _checks.require_padding("k", (1, 2, 3))
    with pytest.raises(TypeError, match="float64 is not supported"):
        _checks.float_suffix("k", np.float64)
