"""The one switch between NumPy (CPU) and CuPy (GPU).

Every op asks ``xp = array_module(x)`` and writes its maths once against ``xp``. CuPy is imported
only when a GPU array is asked for, so the CPU path never needs it installed.
"""

from __future__ import annotations

import sys
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
    """numpy or cupy, whichever owns ``x``.

    A CuPy array is recognised even when nothing in this process has called :func:`cupy_module` yet
    (``Tensor(cupy.asarray(x))`` as the first GPU operation): whoever made it imported CuPy, so the
    module is taken from ``sys.modules`` and remembered. NumPy arrays answer after one type test.
    """
    if isinstance(x, np.ndarray):
        return np
    cp = _cupy
    if cp is None:
        cp = _adopt_cupy(x)
        if cp is None:
            return np
    return cp if isinstance(x, cp.ndarray) else np


def _adopt_cupy(x: Any) -> types.ModuleType | None:
    """The imported CuPy module when ``x`` is one of its arrays (and remember it), else None.

    Importing CuPy is never triggered here: an object can only be a CuPy array if CuPy is imported.
    """
    global _cupy, _cupy_checked
    cp = sys.modules.get("cupy")
    if cp is None or not isinstance(x, getattr(cp, "ndarray", ())):
        return None
    _cupy, _cupy_checked = cp, True  # an array exists on the device, so the device answers
    return cp


def device_of(x: Any) -> str:
    return "cuda" if array_module(x) is not np else "cpu"


def to_device(x: Any, device: str) -> Any:
    """Move an array to "cpu" or "cuda" (a no-op when it is already there)."""
    if device == "cpu":
        return x.get() if array_module(x) is not np else x
    if device in ("cuda", "gpu") or device.startswith("cuda:"):
        cp = cupy_module()
        if cp is None:
            from leaflens.extras import install_command  # noqa: PLC0415

            raise RuntimeError("device 'cuda' requested but no usable CUDA GPU with CuPy was found "
                               f"(`leaflens doctor` names the GPU extra for this driver: {install_command('gpu')} "
                               "for CUDA 13)")
        return cp.asarray(x)
    raise ValueError(f"unknown device {device!r}: expected 'cpu' or 'cuda'")


def scatter_add(xp: types.ModuleType, target: Any, index: Any, values: Any) -> None:
    """target[index] += values, accumulating repeated indices (np.add.at / cupyx.scatter_add)."""
    if xp is np:
        np.add.at(target, index, values)
    else:
        import cupyx  # noqa: PLC0415

        cupyx.scatter_add(target, index, values)


def wide_sum(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
    """x.sum(...) in x's dtype, but a float16 sum accumulates in float32.

    NumPy adds float16 along a non-contiguous axis one rounded step at a time, so a sum of a few
    thousand terms stops growing (65,536 ones sum to 2048); CuPy already accumulates in float32.
    Mixed precision's bias gradients are such sums.
    """
    if x.dtype == np.float16:
        return x.sum(axis=axis, keepdims=keepdims, dtype=np.float32).astype(np.float16)
    return x.sum(axis=axis, keepdims=keepdims)
