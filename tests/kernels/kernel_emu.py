"""Run the real ``kernels/*.cu`` sources on the CPU, so kernel logic is tested without a GPU.

Each source (with its includes inlined exactly as NVRTC gets it) is compiled by the host C++ compiler
with a small prelude that supplies what CUDA provides: ``threadIdx``/``blockIdx`` (thread-local),
``__syncthreads`` (a barrier across the block's threads), ``__shfl_xor_sync`` (a barrier across the
warp's 32 threads), ``__shared__`` (function-static storage, safe because blocks run one after
another). Every CUDA thread is an OS thread, so barriers and shuffles behave as on the device, and a
barrier reached by only part of a block deadlocks here just as it is undefined there.

``EmuKernel`` stands in for ``cupy.RawKernel``: it checks each argument against the kernel's C
signature (array dtype for each pointer, numpy scalar type for each ``int``/``float``/``long long``,
the mistake CuPy would not catch), checks grid/block limits, runs the kernel on copies of the arrays
surrounded by NaN-filled guard bands (out-of-bounds reads poison the result; out-of-bounds writes are
detected in the guards), then copies the results back.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.files import write_path_atomic

PRELUDE = r"""
#define LEAFLENS_HOST_EMULATION 1
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 { unsigned x = 1, y = 1, z = 1; };
static dim3 gridDim, blockDim;
static thread_local dim3 threadIdx, blockIdx;
static thread_local int emu_tid;

struct EmuWarp {
    std::unique_ptr<std::barrier<>> bar;
    unsigned long long slot[32];
    int size;
};
static std::barrier<>* emu_block_barrier = nullptr;
static std::vector<EmuWarp>* emu_warps = nullptr;
static int emu_errors = 0;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
    EmuWarp& w = (*emu_warps)[emu_tid / 32];
    const int lane = emu_tid % 32;
    const int src = lane ^ lane_mask;
    if (mask != 0xffffffffu || w.size != 32 || src >= w.size) __atomic_add_fetch(&emu_errors, 1, __ATOMIC_RELAXED);
    std::memcpy(&w.slot[lane], &v, sizeof(T));
    w.bar->arrive_and_wait();
    T r;
    std::memcpy(&r, &w.slot[src < w.size ? src : lane], sizeof(T));
    w.bar->arrive_and_wait();
    return r;
}

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __int_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }

template <typename F>
static void emu_run(const int* g, const int* b, F fn) {
    gridDim = dim3{(unsigned)g[0], (unsigned)g[1], (unsigned)g[2]};
    blockDim = dim3{(unsigned)b[0], (unsigned)b[1], (unsigned)b[2]};
    const int nthreads = b[0] * b[1] * b[2];
    for (int bz = 0; bz < g[2]; ++bz)
        for (int by = 0; by < g[1]; ++by)
            for (int bx = 0; bx < g[0]; ++bx) {
                std::barrier<> block_barrier(nthreads);
                std::vector<EmuWarp> warps((nthreads + 31) / 32);
                for (size_t w = 0; w < warps.size(); ++w) {
                    int size = nthreads - 32 * (int)w;
                    warps[w].size = size < 32 ? size : 32;
                    warps[w].bar = std::make_unique<std::barrier<>>(warps[w].size);
                }
                emu_block_barrier = &block_barrier;
                emu_warps = &warps;
                std::vector<std::thread> threads;
                threads.reserve(nthreads);
                for (int t = 0; t < nthreads; ++t)
                    threads.emplace_back([&, t] {
                        blockIdx = dim3{(unsigned)bx, (unsigned)by, (unsigned)bz};
                        threadIdx = dim3{(unsigned)(t % b[0]), (unsigned)((t / b[0]) % b[1]),
                                         (unsigned)(t / (b[0] * b[1]))};
                        emu_tid = t;
                        fn();
                    });
                for (auto& th : threads) th.join();
            }
}

extern "C" int emu_take_errors() { int e = emu_errors; emu_errors = 0; return e; }
"""

_SIG_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)', re.S
)

# C parameter type -> numpy dtype (pointers) or numpy scalar type (by value).
_POINTER_DTYPES = {
    "float": np.dtype(np.float32),
    "half_bits": np.dtype(np.float16),
    "long long": np.dtype(np.int64),
    "int": np.dtype(np.int32),
    "unsigned char": np.dtype(np.uint8),
}
_SCALAR_TYPES = {
    "int": (np.int32, ctypes.c_int32),
    "float": (np.float32, ctypes.c_float),
    "long long": (np.int64, ctypes.c_int64),
}
GUARD_BYTES = 256


def parse_signatures(source: str) -> dict[str, list[tuple[str, bool]]]:
    """Kernel name -> [(base C type, is_pointer)] for every ``extern "C" __global__`` function."""
    sigs: dict[str, list[tuple[str, bool]]] = {}
    for name, params in _SIG_RE.findall(source):
        parsed = []
        for param in params.split(","):
            p = " ".join(param.replace("__restrict__", " ").split())
            is_ptr = "*" in p
            p = p.replace("*", " ").replace("const", " ")
            words = p.split()
            parsed.append((" ".join(words[:-1]), is_ptr))  # drop the parameter name
        sigs[name] = parsed
    return sigs


def _launcher(name: str, params: list[tuple[str, bool]]) -> str:
    args = ", ".join(f"*({ctype}{'*' if ptr else ''}*)a[{i}]" for i, (ctype, ptr) in enumerate(params))
    return (
        f'extern "C" void emu_launch_{name}(const int* g, const int* b, void** a) {{\n'
        f"    emu_run(g, b, [&] {{ {name}({args}); }});\n}}\n"
    )


def compiler() -> str | None:
    """The host C++ compiler used for emulation, if there is one that has <barrier> (C++20)."""
    for cxx in ("g++", "clang++"):
        if shutil.which(cxx):
            return cxx
    return None


class EmuKernel:
    """Callable like ``cupy.RawKernel``: ``kernel(grid, block, args, shared_mem=0)`` on numpy arrays."""

    def __init__(self, lib: ctypes.CDLL, name: str, params: list[tuple[str, bool]]) -> None:
        self.name = name
        self.params = params
        self._fn = getattr(lib, f"emu_launch_{name}")
        self._fn.restype = None
        self._take_errors = lib.emu_take_errors
        self.launches = 0

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], shared_mem: int = 0):
        if shared_mem:
            raise AssertionError(f"{self.name}: dynamic shared memory is not emulated")
        g = (tuple(grid) + (1, 1, 1))[:3]
        b = (tuple(block) + (1, 1, 1))[:3]
        if not all(isinstance(v, int) and v >= 1 for v in g + b):
            raise AssertionError(f"{self.name}: grid {grid} / block {block} must be positive ints")
        if b[0] * b[1] * b[2] > 1024 or g[1] > 65535 or g[2] > 65535 or g[0] > 2**31 - 1:
            raise AssertionError(f"{self.name}: launch {grid} x {block} exceeds CUDA limits")
        if len(args) != len(self.params):
            raise AssertionError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        holders: list[Any] = []
        copies: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for i, (arg, (ctype, is_ptr)) in enumerate(zip(args, self.params)):
            if is_ptr:
                want = _POINTER_DTYPES[ctype]
                if not isinstance(arg, np.ndarray) or arg.dtype != want or not arg.flags.c_contiguous:
                    got = f"{type(arg).__name__} {getattr(arg, 'dtype', '')}"
                    raise AssertionError(f"{self.name}: argument {i} must be a contiguous {want} array, got {got}")
                raw = np.full(arg.nbytes + 2 * GUARD_BYTES, 0xFF, dtype=np.uint8)
                inner = raw[GUARD_BYTES : GUARD_BYTES + arg.nbytes]
                inner[...] = arg.reshape(-1).view(np.uint8)
                copies.append((arg, raw, inner))
                holders.append(ctypes.c_void_p(raw.ctypes.data + GUARD_BYTES))
            else:
                np_type, c_type = _SCALAR_TYPES[ctype]
                if type(arg) is not np_type:
                    raise AssertionError(
                        f"{self.name}: argument {i} ({ctype}) must be {np_type.__name__}, got {type(arg).__name__}"
                    )
                holders.append(c_type(arg.item()))
        ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        self._fn((ctypes.c_int * 3)(*g), (ctypes.c_int * 3)(*b), ptrs)
        self.launches += 1
        errors = self._take_errors()
        if errors:
            raise AssertionError(f"{self.name}: {errors} warp shuffles with a partial mask or warp")
        for arg, raw, inner in copies:
            if not (raw[:GUARD_BYTES] == 0xFF).all() or not (raw[GUARD_BYTES + arg.nbytes :] == 0xFF).all():
                raise AssertionError(f"{self.name}: wrote outside an argument array of {arg.nbytes} bytes")
            arg.reshape(-1).view(np.uint8)[...] = inner


class Emulator:
    """One host build of all the given ``kernels/*.cu`` sources (one translation unit, which compiles
    faster than one per file; cached by source hash) handing out :class:`EmuKernel` objects."""

    def __init__(self, build_dir: Path, cxx: str, cu_files: list[str]) -> None:
        from leaflens.kernels import _cuda

        self.kernels: dict[tuple[str, str], EmuKernel] = {}
        self._sigs: dict[str, dict[str, list[tuple[str, bool]]]] = {}
        parts = [PRELUDE]
        for cu_file in cu_files:
            source = _cuda.kernel_source(cu_file)
            sigs = parse_signatures(source)
            if not sigs:
                raise AssertionError(f'{cu_file}: no extern "C" __global__ kernels found')
            self._sigs[cu_file] = sigs
            parts.append(f'\n#line 1 "{cu_file}"\n{source}\n')
            parts.extend(_launcher(name, params) for name, params in sigs.items())
        text = "".join(parts)
        digest = hashlib.sha256((cxx + text).encode()).hexdigest()[:16]
        lib_path = build_dir / f"kernels-{digest}.so"
        if not lib_path.exists():
            src_path = build_dir / f"kernels-{digest}.{os.getpid()}.cpp"
            src_path.write_text(text, encoding="utf-8")

            def build(tmp_lib: Path) -> None:
                cmd = [cxx, "-std=c++20", "-O0", "-pthread", "-shared", "-fPIC", "-w", str(src_path), "-o",
                       str(tmp_lib)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise AssertionError(f"host build of the kernels failed:\n{proc.stderr[-4000:]}")

            try:  # atomic: a concurrent run sees the whole library or none
                write_path_atomic(lib_path, build)
            finally:
                src_path.unlink(missing_ok=True)
        self._lib = ctypes.CDLL(str(lib_path))

    def load_kernel(self, cu_file: str, name: str, options: tuple[str, ...] = ()) -> EmuKernel:
        """Drop-in for ``leaflens.kernels._cuda.load_kernel``: the kernel must live in ``cu_file``."""
        sigs = self._sigs.get(cu_file)
        if sigs is None:
            raise FileNotFoundError(f"kernel source not built by the emulator: {cu_file}")
        if name not in sigs:
            raise RuntimeError(f"{cu_file}: cannot get kernel {name!r}")
        key = (cu_file, name)
        if key not in self.kernels:
            self.kernels[key] = EmuKernel(self._lib, name, sigs[name])
        return self.kernels[key]
