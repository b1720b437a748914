"""CuPy access for the kernels: a guarded GPU probe and a compile-once cache of raw kernels.

This is the only module that imports CuPy, and only inside functions, so the CPU path never needs
it. ``gpu_available()`` never raises: a missing CuPy, a missing driver, or ``cupy.cuda.is_available()``
itself raising all mean "no GPU", with the reason kept for messages (``gpu_unavailable_reason()``).

Sources are read from this folder; ``#include "x.cuh"`` lines naming a file here are inlined (once per
file) before compiling, so NVRTC needs no include path and CuPy's on-disk kernel cache, which hashes
the source text, notices any change to a shared header.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent

#: Set to 1 to make the probe report no GPU even where one exists (CPU-path testing, debugging).
DISABLE_ENV = "LEAFLENS_DISABLE_GPU"

_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE_RE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)

_probe_lock = threading.Lock()
_probe_result: tuple[bool, str] | None = None
_kernel_lock = threading.Lock()
_modules: dict[tuple[str, tuple[str, ...], int], Any] = {}
_kernels: dict[tuple[str, str, tuple[str, ...], int], Any] = {}


#: The install extra whose CuPy wheel is built for each CUDA major (the same table as
#: leaflens.apps.providers.GPU_EXTRAS, repeated so this module imports nothing above it; a test holds them equal).
CUDA_EXTRAS = {13: "gpu", 12: "gpu-cuda12", 11: "gpu-cuda11"}

# The probe's NVRTC test: compiled at run time, so a missing libnvrtc shows here and not at the first real kernel.
_PROBE_KERNEL = r"""
extern "C" __global__ void leaflens_probe(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i] + (float)i;
}
"""
_LIB_RE = re.compile(r"\b(lib[\w.+-]*?\.so(?:\.\d+)*)")
_NOT_FOUND_RE = re.compile(r"cannot open shared object|no such file|not found|failed to load|could not (?:find|load)",
                           re.IGNORECASE)


def _cuda_major(cupy: Any) -> int | None:
    """The CUDA major CuPy is built for (its runtime version), or None when it does not say."""
    try:
        return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:
        return None


def library_reason(label: str, soname: str, wheel: str, major: int | None, exc: BaseException) -> str:
    """One line naming the CUDA library behind ``exc`` (``label`` "NVRTC", ``soname`` "libnvrtc.so.13", used
    when the error does not name the file): when the library is missing, which file and where it comes from;
    otherwise what failed."""
    text = f"{type(exc).__name__}: {exc}"
    if not (isinstance(exc, (ImportError, OSError)) or _NOT_FOUND_RE.search(text)):
        return f"{label} failed ({text})"
    base = soname.split(".so")[0]
    named = [lib for lib in _LIB_RE.findall(text) if lib.startswith(base)]
    lib = named[0] if named else soname
    extra = CUDA_EXTRAS.get(major or 13, "gpu")
    if major is not None and major < 12:
        where = (f"install the CUDA {major} toolkit's {label} from your distribution or NVIDIA's repository "
                 "(CuPy for this CUDA has no [ctk] extra)")
    else:
        from leaflens.extras import install_command  # noqa: PLC0415

        where = f"{install_command(extra)}, which brings {wheel} via cupy's [ctk] extra"
    return f"{label} ({lib}) not found: {where} ({text})"


def probe_cupy(cupy: Any) -> tuple[bool, str]:
    """Whether ``cupy`` can really compute here, in the order a first training step needs it: a device,
    memory and a copy, NVRTC (compile and launch a tiny kernel), cuBLAS (a 2x2 matrix product), cuRAND (device
    dropout masks: eight uniform numbers), each result checked. The reason names the first thing that fails (a
    missing library by its file name)."""
    import numpy as np

    try:
        if not cupy.cuda.is_available():
            return False, "CuPy sees no CUDA device (no GPU, or no working NVIDIA driver)"
        count = cupy.cuda.runtime.getDeviceCount()
        x = cupy.asarray(np.arange(8, dtype=np.float32))
        y = cupy.zeros(8, dtype=cupy.float32)
    except Exception as exc:  # CUDARuntimeError, driver/runtime mismatch, ...
        return False, f"CUDA probe failed ({type(exc).__name__}: {exc})"
    major = _cuda_major(cupy)
    suffix = f".{major}" if major else ""
    try:
        kernel = cupy.RawKernel(_PROBE_KERNEL, "leaflens_probe")
        kernel.compile()
    except Exception as exc:
        return False, library_reason("NVRTC", f"libnvrtc.so{suffix}", "nvidia-cuda-nvrtc", major, exc)
    try:
        kernel((1,), (32,), (x, y, np.int32(8)))
        got = cupy.asnumpy(y)
    except Exception as exc:
        return False, f"CUDA probe failed to launch a kernel ({type(exc).__name__}: {exc})"
    if not np.array_equal(got, 3 * np.arange(8, dtype=np.float32)):
        return False, f"CUDA probe computed a wrong result: {got.tolist()}"
    a = np.array([[1, 2], [3, 4]], dtype=np.float32)
    try:
        cupy.cuda.device.get_cublas_handle()  # loads libcublas even if matmul found another route
        product = cupy.asnumpy(cupy.matmul(cupy.asarray(a), cupy.asarray(a)))
    except Exception as exc:
        return False, library_reason("cuBLAS", f"libcublas.so{suffix}", "nvidia-cublas", major, exc)
    if not np.array_equal(product, a @ a):
        return False, f"cuBLAS probe computed a wrong product: {product.tolist()}"
    try:
        u = cupy.asnumpy(cupy.random.RandomState(0).random_sample(8, dtype=np.float32))
    except Exception as exc:  # libcurand is .so.10 for CUDA 11 to 13
        return False, library_reason("cuRAND", "libcurand.so.10", "nvidia-curand", major, exc)
    if not (u.shape == (8,) and np.all((u >= 0) & (u < 1)) and len(set(u.tolist())) > 1):
        return False, f"cuRAND probe drew wrong uniform numbers: {u.tolist()}"
    return True, f"{count} CUDA device(s) usable through CuPy {cupy.__version__} (NVRTC, cuBLAS and cuRAND work)"


def _probe() -> tuple[bool, str]:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA library underneath
        return False, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    return probe_cupy(cupy)


def gpu_probe(refresh: bool = False) -> tuple[bool, str]:
    """Return ``(usable, description)``; cached after the first call. Never raises."""
    global _probe_result
    with _probe_lock:
        if _probe_result is None or refresh:
            try:
                _probe_result = _probe()
            except Exception as exc:  # belt and braces: the probe must not raise
                _probe_result = (False, f"GPU probe raised {type(exc).__name__}: {exc}")
        return _probe_result


def gpu_available() -> bool:
    """True when CuPy imports and a CUDA device can allocate and run a kernel."""
    return gpu_probe()[0]


def gpu_unavailable_reason() -> str | None:
    """Why there is no usable GPU, or None when there is one."""
    ok, why = gpu_probe()
    return None if ok else why


def cupy_module() -> ModuleType:
    """The ``cupy`` module, or RuntimeError naming the reason no GPU can be used."""
    ok, why = gpu_probe()
    if not ok:
        raise RuntimeError(f"CUDA kernels need a GPU with CuPy: {why}")
    import cupy

    return cupy


def kernel_path(cu_file: str | os.PathLike[str]) -> Path:
    """Absolute path of a kernel source; a bare name is looked up in this folder."""
    path = Path(cu_file)
    if not path.is_absolute():
        path = KERNEL_DIR / path
    if not path.is_file():
        raise FileNotFoundError(f"kernel source not found: {path}")
    return path


def kernel_source(cu_file: str | os.PathLike[str]) -> str:
    """The source of ``cu_file`` with its local ``#include "..."`` files inlined (each at most once)."""
    path = kernel_path(cu_file)
    seen: set[Path] = set()

    def expand(p: Path) -> str:
        seen.add(p)
        text = p.read_text(encoding="utf-8")
        if p != path:  # inlined once by construction; a leftover pragma would warn in the main file
            text = _PRAGMA_ONCE_RE.sub("// (include-once header, inlined by kernels/_cuda.py)", text)

        def replace(match: re.Match[str]) -> str:
            inc = (p.parent / match.group(1)).resolve()
            if not inc.is_file():
                raise FileNotFoundError(f"{p.name}: included file not found: {match.group(1)}")
            if inc in seen:
                return f"// (already included: {match.group(1)})"
            return f"// ---- begin {match.group(1)} ----\n{expand(inc)}\n// ---- end {match.group(1)} ----"

        return _INCLUDE_RE.sub(replace, text)

    return expand(path)


def load_kernel(cu_file: str | os.PathLike[str], name: str, options: tuple[str, ...] = ()) -> Any:
    """Return the ``cupy.RawKernel`` ``name`` from ``cu_file``, compiled once per (file, options, device).

    Compilation goes through ``cupy.RawModule`` (NVRTC); CuPy also keeps the binary in its on-disk
    cache, so later processes skip the compiler too.
    """
    cupy = cupy_module()
    options = tuple(options)
    path = str(kernel_path(cu_file))
    device = cupy.cuda.Device().id
    key = (path, name, options, device)
    with _kernel_lock:
        kernel = _kernels.get(key)
        if kernel is None:
            mod_key = (path, options, device)
            module = _modules.get(mod_key)
            if module is None:
                module = cupy.RawModule(code=kernel_source(path), options=options)
                _modules[mod_key] = module
            try:
                kernel = module.get_function(name)
            except Exception as exc:
                raise RuntimeError(f"{Path(path).name}: cannot get kernel {name!r}: {exc}") from exc
            _kernels[key] = kernel
        return kernel


def grid_1d(n: int, threads: int = 256, max_blocks: int = 65535) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) for a grid-stride loop over ``n`` elements (n >= 1)."""
    if n < 1:
        raise ValueError(f"grid_1d needs at least one element, got {n}")
    blocks = min(max_blocks, (n + threads - 1) // threads)
    return (blocks,), (threads,)


def row_block(width: int, max_threads: int = 256) -> int:
    """Threads for a one-block-per-row kernel: a multiple of 32 covering ``width``, capped."""
    return max(32, min(max_threads, (width + 31) // 32 * 32))
