"""Argument checks run before every kernel launch.

CuPy passes raw pointers to a RawKernel and checks nothing, so a wrong dtype, shape or a strided view
would read garbage or write out of bounds. These checks raise TypeError/ValueError naming the kernel
and the argument instead. They only look at metadata (no device synchronisation).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

INT32_MAX = 2**31 - 1
INDEX32_MAX = INT32_MAX  # largest array size the 32-bit index kernel variants take (tests lower it)


def require_array(
    xp: Any,
    kernel: str,
    name: str,
    arr: Any,
    dtypes: Iterable[Any],
    *,
    ndim: int | None = None,
    shape: tuple[int, ...] | None = None,
) -> None:
    """Check that ``arr`` is a C-contiguous ``xp.ndarray`` with an allowed dtype and shape."""
    if not isinstance(arr, xp.ndarray):
        raise TypeError(f"{kernel}: {name} must be a {xp.__name__}.ndarray, got {type(arr).__name__}")
    allowed = [np.dtype(d) for d in dtypes]
    if arr.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{kernel}: {name} has dtype {arr.dtype}, expected {names}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{kernel}: {name} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{kernel}: {name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{kernel}: {name} must be C-contiguous (make a copy with ascontiguousarray)")


def require_int32(kernel: str, **sizes: int) -> None:
    """Sizes handed to the kernel as ``int`` must fit in int32."""
    for name, value in sizes.items():
        if not 0 <= value <= INT32_MAX:
            raise ValueError(f"{kernel}: {name}={value} does not fit the kernel's 32-bit int")


def index_suffix(*sizes: int) -> str:
    """Kernel-name suffix for the flat index type: '' (32-bit, unsigned) when every array the kernel
    indexes has fewer than 2^31 elements, '_i64' (64-bit) otherwise.

    A grid-stride loop (``_cuda.grid_1d``: at most 65535 blocks of at most 1024 threads) adds less than
    2^31 to an index below 2^31, so an unsigned 32-bit index cannot wrap; 32-bit division and modulo
    are several times cheaper on the GPU than 64-bit ones.
    """
    return "" if all(0 <= int(s) <= INDEX32_MAX for s in sizes) else "_i64"


def require_pair(kernel: str, name: str, value: Any, minimum: int) -> tuple[int, int]:
    """An int or a pair of ints, each >= minimum, as a tuple of two Python ints."""
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) for v in pair):
        raise ValueError(f"{kernel}: {name} must be an int or two ints, got {value!r}")
    if min(pair) < minimum:
        raise ValueError(f"{kernel}: {name} values must be >= {minimum}, got {value!r}")
    return int(pair[0]), int(pair[1])


def require_padding(kernel: str, padding: Any) -> tuple[int, int, int, int]:
    """Padding as (top, bottom, left, right); an int or a (pad_h, pad_w) pair is expanded."""
    if isinstance(padding, (int, np.integer)):
        pads = (padding,) * 4
    else:
        pads = tuple(padding)
        if len(pads) == 2:
            pads = (pads[0], pads[0], pads[1], pads[1])
    if len(pads) != 4 or not all(isinstance(v, (int, np.integer)) and v >= 0 for v in pads):
        raise ValueError(f"{kernel}: padding must be int, (h, w) or (top, bottom, left, right) >= 0, got {padding!r}")
    return int(pads[0]), int(pads[1]), int(pads[2]), int(pads[3])


def float_suffix(kernel: str, dtype: Any) -> str:
    """Kernel-name suffix for a floating storage type: 'f32' or 'f16'."""
    dt = np.dtype(dtype)
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "f16"
    raise TypeError(f"{kernel}: dtype {dt} is not supported (float32 or float16)")
