"""Tiled shared-memory SGEMM ``C = A @ B`` (row-major float32).

The kernel (``sgemm.cu``) is the educational one of the set: the engine may keep using cuBLAS
(``cupy.matmul``) where it is faster, and ``benchmarks/gpu.py`` reports both side by side. Its maths
is NumPy's matrix product, which tests/kernels/test_kernel_launch.py compares it with.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from leaflens.kernels import _checks, _cuda

TILE_M = 64  # rows of C per block (must match SGEMM_BM in sgemm.cu)
TILE_N = 64  # columns of C per block (SGEMM_BN)
THREADS = 256  # threads per block (SGEMM_THREADS)


def sgemm_cuda(a: Any, b: Any, out: Any | None = None) -> Any:
    """``a @ b`` on the GPU with the tiled kernel; a (M, K), b (K, N) C-contiguous float32 CuPy arrays."""
    cp = _cuda.cupy_module()
    name = "sgemm_tiled"
    _checks.require_array(cp, name, "a", a, [np.float32], ndim=2)
    _checks.require_array(cp, name, "b", b, [np.float32], ndim=2)
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"{name}: inner dimensions differ: a is {a.shape}, b is {b.shape}")
    _checks.require_int32(name, M=m, N=n, K=k)
    if out is None:
        out = cp.empty((m, n), dtype=np.float32)
    else:
        _checks.require_array(cp, name, "out", out, [np.float32], shape=(m, n))
    if m == 0 or n == 0:
        return out
    grid = ((n + TILE_N - 1) // TILE_N, (m + TILE_M - 1) // TILE_M)
    if grid[1] > 65535:
        raise ValueError(f"{name}: M={m} needs more than 65535 row tiles")
    kernel = _cuda.load_kernel("sgemm.cu", name)
    kernel(grid, (THREADS,), (a, b, out, np.int32(m), np.int32(n), np.int32(k)))
    return out
