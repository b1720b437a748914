"""The one switch between NumPy (CPU) and CuPy (GPU).

Every op asks ``xp = array_module(x)`` and writes its maths once against ``xp``. CuPy is imported
only when a GPU array is asked for, so the CPU path never needs it installed.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

_cupy: types.ModuleType | None = None
_cupy_checked = False


def cupy_module() -> types.ModuleType | None:
    """CuPy if it is installed and a CUDA device answers; None otherwise (never raises)."""
    global _cupy, _cupy_checked
    if not _cupy_checked:
        _cupy_checked = True
        try:
            import cupy  # noqa: PLC0415

            if cupy.cuda.runtime.getDeviceCount() > 0:
                _cupy = cupy
        except Exception:  # no CuPy, no driver, or a driver that cannot start: CPU it is
            _cupy = None
    return _cupy


def array_module(x: Any) -> types.ModuleType:
    """numpy or cupy, whichever owns ``x``."""
    if _cupy is not None and isinstance(x, _cupy.ndarray):
        return _cupy
    return np


def device_of(x: Any) -> str:
    return "cuda" if array_module(x) is not np else "cpu"


def to_device(x: Any, device: str) -> Any:
    """Move an array to "cpu" or "cuda" (a no-op when it is already there)."""
    if device == "cpu":
        return x.get() if array_module(x) is not np else x
    if device in ("cuda", "gpu") or device.startswith("cuda:"):
        cp = cupy_module()
        if cp is None:
            raise RuntimeError("device 'cuda' requested but no usable CUDA GPU with CuPy was found "
                               "(install leaflens[gpu] and check `leaflens doctor`)")
        return cp.asarray(x)
    raise ValueError(f"unknown device {device!r}: expected 'cpu' or 'cuda'")


def scatter_add(xp: types.ModuleType, target: Any, index: Any, values: Any) -> None:
    """target[index] += values, accumulating repeated indices (np.add.at / cupyx.scatter_add)."""
    if xp is np:
        np.add.at(target, index, values)
    else:
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(target, index, values)
