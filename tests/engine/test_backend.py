"""leaflens.engine.backend: a CuPy array is recognised whatever ran first in the process.

CuPy is not needed: a stand-in module registered as ``cupy`` in ``sys.modules`` (with its own ndarray
class) plays the part, and the backend's remembered module is reset to "never asked" first, as in a
fresh process where ``Tensor(cupy.asarray(x))`` is the first GPU operation.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from leaflens.engine import backend


class _FakeDeviceArray:
    """An array type that is not a NumPy array (as cupy.ndarray is not)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.dtype = a.dtype
        self.shape = a.shape
        self.ndim = a.ndim


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.ndarray = _FakeDeviceArray  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.setattr(backend, "_cupy", None)  # nothing has asked for CuPy in this "process" yet
    monkeypatch.setattr(backend, "_cupy_checked", False)
    return mod


def test_a_cupy_array_is_recognised_before_anything_asked_for_cupy(fake_cupy):
    arr = fake_cupy.ndarray(np.zeros(3, np.float32))
    assert backend.array_module(arr) is fake_cupy
    assert backend.device_of(arr) == "cuda"
    # remembered: later calls (and NumPy arrays beside it) answer without looking again
    assert backend._cupy is fake_cupy
    assert backend.array_module(np.zeros(2)) is np
    assert backend.array_module(arr) is fake_cupy


def test_numpy_and_host_values_stay_numpy_with_cupy_imported(fake_cupy):
    for v in (np.zeros(2), np.float32(1.0), 3.0, [1, 2], None):
        assert backend.array_module(v) is np
    assert backend._cupy is None  # nothing adopted CuPy: no device array was seen


def test_tensor_of_a_device_array_is_on_the_device(fake_cupy):
    from leaflens.engine.tensor import Tensor  # noqa: PLC0415

    t = Tensor(fake_cupy.ndarray(np.ones((2, 2), np.float32)))
    assert isinstance(t.data, fake_cupy.ndarray)  # kept as is: not turned into a NumPy array
    assert t.device == "cuda"


def test_without_cupy_imported_nothing_is_imported(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(backend, "_cupy", None)
    assert backend.array_module(object()) is np
    assert "cupy" not in sys.modules
