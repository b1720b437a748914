"""Facts about this machine: Python and library versions, CPU (cores, the CPU quota, BLAS), RAM, GPU.

``leaflens doctor`` (:mod:`leaflens.pipeline.doctor`) reports all of them, and every training run records
:func:`describe_hardware`'s short form in report.json and report.md, so the two always describe a
machine the same way. Probing only: nothing here trains or prints. ``describe_hardware`` measures
nothing (no bandwidth test) because it runs at the end of every training run and must be quick and
unable to fail the run; the GPU goes through the kernels' guarded probe (leaflens.kernels._cuda).
"""

from __future__ import annotations

import importlib
import os
import platform
from typing import Any, cast

import numpy as np

from leaflens.cpus import cpu_budget


# ---- software and CPU facts ----------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # not installed, or broken underneath
        return None


def software_facts() -> dict[str, Any]:
    """Versions of the interpreter and the libraries leaflens can use (None = not importable)."""
    from leaflens import __version__

    facts: dict[str, Any] = {
        "leaflens": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "cupy": _version("cupy"),
        "onnxruntime": _version("onnxruntime"),
        "onnx": _version("onnx"),
    }
    if facts["onnxruntime"]:
        import onnxruntime

        facts["onnxruntime_providers"] = list(onnxruntime.get_available_providers())
    return facts


def _cpuinfo(field: str) -> str | None:
    """The first value of ``field`` in /proc/cpuinfo (None where there is none: not Linux, or no such field)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str | None:
    return _cpuinfo("model name") or platform.processor() or None


def cpu_int8_dot() -> str | None:
    """How this CPU multiplies INT8 in onnxruntime: "vnni" (exact 32-bit sums), "no-vnni" (x86 without it: 16-bit
    pair sums that 8-bit weights can saturate), or None where /proc/cpuinfo does not say (not Linux, or ARM,
    whose dot products do not saturate either)."""
    flags = set((_cpuinfo("flags") or "").split())
    if not {"avx2", "sse4_1"} & flags:
        return None
    return "vnni" if {"avx512_vnni", "avx_vnni"} & flags else "no-vnni"


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def blas_facts() -> dict[str, Any]:
    """The BLAS/LAPACK NumPy was built with, and what threadpoolctl sees loaded (when installed)."""
    out: dict[str, Any] = {}
    try:
        config = cast(dict[str, Any], np.show_config(mode="dicts"))  # NumPy >= 1.26
        deps = config.get("Build Dependencies", {})
        for key in ("blas", "lapack"):
            dep = deps.get(key) or {}
            if dep:
                out[key] = {"name": dep.get("name"), "version": dep.get("version")}
        simd = config.get("SIMD Extensions", {})
        if simd:
            out["simd_found"] = simd.get("found")
    except Exception as exc:  # older NumPy: no dict mode
        out["error"] = f"numpy.show_config(mode='dicts') unavailable: {exc}"
    try:
        from threadpoolctl import threadpool_info  # optional; never a dependency

        out["threadpools"] = [
            {k: info.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer")}
            for info in threadpool_info()
        ]
    except ImportError:
        pass
    return out


def cpu_facts() -> dict[str, Any]:
    """Cores (logical; usable by this process: affinity capped by the cgroup quota; the thread count leaflens
    uses, see leaflens.cpus), CPU model, RAM, BLAS."""
    budget = cpu_budget()
    return {
        "model": _cpu_model(),
        "logical_cores": budget.logical,
        "usable_cores": budget.available,
        "cpu_quota": budget.quota,
        "threads": budget.usable,
        "threads_override": budget.override,
        "ram_bytes": _ram_bytes(),
        "blas": blas_facts(),
    }


def available_ram_bytes() -> int | None:
    """RAM the kernel says new allocations can use without swapping (MemAvailable), else free pages."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None



# ---- GPU facts -----------------------------------------------------------------------------------------
def _device_name(props: dict[str, Any]) -> str:
    name = props.get("name", b"?")
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def measure_h2d_bandwidth(cp: Any, nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Host-to-device copy bandwidth in GB/s from a pinned host buffer (best of ``repeats``, CUDA events)."""
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
    host[:] = 1
    dev = cp.empty(nbytes, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    dev.set(host, stream=stream)  # warm-up
    stream.synchronize()
    best_ms = float("inf")
    for _ in range(repeats):
        start.record(stream)
        dev.set(host, stream=stream)
        end.record(stream)
        end.synchronize()
        best_ms = min(best_ms, cp.cuda.get_elapsed_time(start, end))
    del dev
    return nbytes / (best_ms / 1e3) / 1e9



def gpu_facts(measure_bandwidth: bool = True) -> dict[str, Any]:
    """The GPU probe's answer and, with a usable GPU, its name, compute capability, total/free memory,
    CUDA driver/runtime versions and (``measure_bandwidth``) the pinned host-to-device bandwidth."""
    from leaflens.kernels import _cuda

    ok, reason = _cuda.gpu_probe()
    if not ok:
        return {"available": False, "reason": reason}
    cp = _cuda.cupy_module()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    free, total = cp.cuda.runtime.memGetInfo()
    facts: dict[str, Any] = {
        "available": True,
        "reason": reason,
        "device": dev.id,
        "name": _device_name(props),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "multiprocessors": props.get("multiProcessorCount"),
        "total_bytes": int(total),
        "free_bytes": int(free),
        "driver_version": cp.cuda.runtime.driverGetVersion(),
        "runtime_version": cp.cuda.runtime.runtimeGetVersion(),
    }
    if measure_bandwidth:
        facts["h2d_pinned_gbps"] = measure_h2d_bandwidth(cp)
    return facts


# ---- the short form for run reports --------------------------------------------------------------------
def _blas_name(blas: dict[str, Any]) -> str | None:
    info = blas.get("blas") or {}
    name = info.get("name")
    if not name:
        return None
    return f"{name} {info.get('version') or ''}".strip()


def _gpu() -> dict[str, Any]:
    """Name and memory of the current CUDA device, or ``gpu: None`` with the probe's reason."""
    from leaflens.kernels import _cuda

    ok, reason = _cuda.gpu_probe()
    if not ok:
        return {"gpu": None, "gpu_memory_gib": None, "gpu_reason": reason}
    try:
        cp = _cuda.cupy_module()
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = _device_name(props)
        total = props.get("totalGlobalMem")
        return {"gpu": name, "gpu_memory_gib": round(total / 2**30, 1) if total else None, "gpu_reason": None}
    except Exception as exc:  # a report must not fail because a property query did
        return {"gpu": "CUDA GPU (name unavailable)", "gpu_memory_gib": None,
                "gpu_reason": f"device query failed: {type(exc).__name__}: {exc}"}


def describe_hardware(device: str | None = None) -> dict[str, Any]:
    """CPU model, cores, RAM, NumPy's BLAS, and the GPU name (None without a usable GPU).

    ``device`` is the device the run actually used ("cpu" or "cuda"), recorded so that a report does not
    credit a GPU that was present but idle. Keys: ``cpu_model``, ``cpu_cores`` (logical), ``usable_cores``
    (this process's affinity capped by its CPU quota), ``ram_gib``, ``blas``, ``gpu``, ``gpu_memory_gib``,
    ``gpu_reason`` (why there is no GPU), ``device``, and ``summary``, one line for humans.
    """
    cpu = cpu_facts()
    ram = cpu.get("ram_bytes")
    facts: dict[str, Any] = {
        "cpu_model": cpu.get("model"),
        "cpu_cores": cpu.get("logical_cores"),
        "usable_cores": cpu.get("usable_cores"),
        "ram_gib": round(ram / 2**30, 1) if ram else None,
        "blas": _blas_name(cpu.get("blas") or {}),
    }
    facts.update(_gpu())
    facts["device"] = device
    facts["summary"] = hardware_summary(facts)
    return facts


def hardware_summary(facts: dict[str, Any]) -> str:
    """One line: the device used first, then the rest of the machine."""
    cores = facts.get("cpu_cores")
    usable = facts.get("usable_cores")
    core_text = f"{cores} cores" if cores else "? cores"
    if usable and cores and usable != cores:
        core_text += f", {usable} usable"
    cpu = f"CPU {facts.get('cpu_model') or 'unknown model'} ({core_text})"
    if facts.get("blas"):
        cpu += f", NumPy BLAS {facts['blas']}"
    gpu = facts.get("gpu")
    if gpu:
        mem = f", {facts['gpu_memory_gib']} GiB" if facts.get("gpu_memory_gib") else ""
        gpu_text = f"GPU {gpu}{mem}"
    else:
        gpu_text = "no GPU"
    device = facts.get("device")
    if device == "cuda" and gpu:
        return f"trained on {gpu_text}; host {cpu}"
    if device == "cpu":
        return f"trained on {cpu}; {gpu_text + ' (not used)' if gpu else gpu_text}"
    return f"{cpu}; {gpu_text}"
