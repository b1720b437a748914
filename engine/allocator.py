"""Keep freed activation buffers in the process heap (glibc) instead of returning them to the OS.

A training step allocates and frees the same large arrays (tens of MB each) every time. glibc
serves blocks above its mmap threshold with fresh ``mmap`` calls, so each step pays page faults and
kernel zeroing for every activation: measured here, elementwise ops on a 33 MB array ran about
twice as fast once the memory was reused. Raising the mmap and trim thresholds makes freed blocks
reusable; the resident size then stays at the step's high-water mark instead of bouncing.

Set ``LEAFLENS_NO_MALLOC_TUNING=1`` to leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30  # 1 GiB: any single activation buffer stays in the heap
_applied = False


def tune_allocator() -> bool:
    """Apply the thresholds once on Linux/glibc; returns whether they are in force."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux") or os.environ.get("LEAFLENS_NO_MALLOC_TUNING"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, _THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, _THRESHOLD))
    return _applied
