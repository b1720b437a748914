"""``leaflens doctor``: what this machine offers leaflens.

Prints the Python/NumPy/CuPy/onnxruntime versions, the CPU facts (cores, BLAS in use), and either
"no GPU: <reason>" or the GPU's name, compute capability, total/free memory, the host-to-device
bandwidth measured with pinned memory, and the largest safe batch size for a model and input size.

The batch size is derived from the peak GPU memory of real training steps (measured at two small
batches, extrapolated linearly), never guessed; until the engine's GPU training path exists the
command says the estimate is unavailable instead of inventing one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

ENGINE_GPU_UNAVAILABLE = "engine GPU path not built"


class BatchEstimateUnavailable(RuntimeError):
    """The peak memory of a training step cannot be measured here (says why)."""


# ---- software and CPU facts --------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # not installed, or broken underneath
        return None


def software_facts() -> dict[str, Any]:
    """Versions of the interpreter and the libraries leaflens can use (None = not importable)."""
    facts: dict[str, Any] = {
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


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def blas_facts() -> dict[str, Any]:
    """The BLAS/LAPACK NumPy was built with, and what threadpoolctl sees loaded (when installed)."""
    out: dict[str, Any] = {}
    try:
        config = np.show_config(mode="dicts")  # NumPy >= 1.26
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
    """Cores (logical, and usable by this process), CPU model, RAM, BLAS."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "ram_bytes": _ram_bytes(),
        "blas": blas_facts(),
    }


# ---- GPU facts ------------------------------------------------------------------------------------------------
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


def measure_train_step_peak_bytes(model: str, input_size: int, batch: int) -> int:
    """Peak GPU memory (bytes) of one forward + backward + optimiser step of ``model`` on a batch of
    ``batch`` RGB images of ``input_size`` x ``input_size``, measured, not computed.

    To be completed with the engine's GPU training path: build the model by name, move it to "cuda",
    free CuPy's memory pool, run one real step on random data, synchronise, and return the pool's
    high-water mark (``cupy.get_default_memory_pool().total_bytes()`` right after the step, with the
    pool emptied before). Until then this raises, and ``leaflens doctor`` says the estimate is
    unavailable instead of guessing.
    """
    raise BatchEstimateUnavailable(ENGINE_GPU_UNAVAILABLE)


def largest_safe_batch(samples: list[tuple[int, int]], free_bytes: int, safety: float = 0.85) -> int:
    """Largest batch whose predicted peak fits ``safety * free_bytes``.

    ``samples`` are measured (batch, peak_bytes) pairs at two or more batch sizes; peak memory is
    modelled as ``fixed + per_sample * batch`` (weights, optimiser state and workspace are fixed;
    activations grow with the batch), fitted by least squares. Returns 0 if not even one sample fits.
    """
    if len(samples) < 2 or len({b for b, _ in samples}) < 2:
        raise ValueError("largest_safe_batch needs peak measurements at two or more different batch sizes")
    if not 0 < safety <= 1:
        raise ValueError(f"safety must be in (0, 1], got {safety}")
    b = np.array([s[0] for s in samples], dtype=np.float64)
    m = np.array([s[1] for s in samples], dtype=np.float64)
    per_sample, fixed = np.polyfit(b, m, 1)
    if per_sample < 1.0:  # under a byte per sample: flat (or shrinking) peaks, nothing to extrapolate
        raise ValueError(f"peak memory does not grow with the batch ({samples}); cannot extrapolate")
    budget = safety * free_bytes - fixed
    return max(0, int(budget // per_sample))


def batch_estimate(
    model: str,
    input_size: int,
    free_bytes: int,
    measure: Callable[[str, int, int], int] = measure_train_step_peak_bytes,
    batches: tuple[int, int] = (2, 8),
) -> dict[str, Any]:
    """{"batch": int, "samples": [...]} from measured peaks, or {"unavailable": reason}."""
    try:
        samples = [(b, int(measure(model, input_size, b))) for b in batches]
        return {"batch": largest_safe_batch(samples, free_bytes), "samples": samples}
    except BatchEstimateUnavailable as exc:
        return {"unavailable": str(exc)}


def gpu_facts(model: str, input_size: int, measure_bandwidth: bool = True) -> dict[str, Any]:
    """Probe result plus, with a GPU, device properties, memory, bandwidth and the batch estimate."""
    from kernels import _cuda

    ok, reason = _cuda.gpu_probe()
    if not ok:
        return {"available": False, "reason": reason}
    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    free, total = cp.cuda.runtime.memGetInfo()
    name = props.get("name", b"?")
    facts: dict[str, Any] = {
        "available": True,
        "reason": reason,
        "device": dev.id,
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "multiprocessors": props.get("multiProcessorCount"),
        "total_bytes": int(total),
        "free_bytes": int(free),
        "driver_version": cp.cuda.runtime.driverGetVersion(),
        "runtime_version": cp.cuda.runtime.runtimeGetVersion(),
    }
    if measure_bandwidth:
        facts["h2d_pinned_gbps"] = measure_h2d_bandwidth(cp)
    facts["batch_estimate"] = batch_estimate(model, input_size, int(free))
    return facts


def collect(model: str, input_size: int, measure_bandwidth: bool = True) -> dict[str, Any]:
    return {
        "software": software_facts(),
        "cpu": cpu_facts(),
        "gpu": gpu_facts(model, input_size, measure_bandwidth),
        "request": {"model": model, "input_size": input_size},
    }


# ---- report ----------------------------------------------------------------------------------------------------
def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


@dataclass
class _Lines:
    rows: list[str]

    def add(self, key: str, value: Any) -> None:
        self.rows.append(f"  {key:<22} {value}")


def render(facts: dict[str, Any]) -> str:
    """Human-readable report of :func:`collect`'s facts."""
    sw, cpu, gpu, req = facts["software"], facts["cpu"], facts["gpu"], facts["request"]
    out = _Lines(["leaflens doctor", "software"])
    out.add("Python", f"{sw['python']} ({sw['platform']})")
    for key, label in (("numpy", "NumPy"), ("cupy", "CuPy"), ("onnxruntime", "onnxruntime"), ("onnx", "onnx")):
        out.add(label, sw[key] or "not installed")
    if sw.get("onnxruntime_providers"):
        out.add("onnxruntime providers", ", ".join(sw["onnxruntime_providers"]))
    out.rows.append("cpu")
    out.add("model", cpu["model"] or "unknown")
    out.add("cores", f"{cpu['logical_cores']} logical, {cpu['usable_cores']} usable by this process")
    out.add("RAM", _gib(cpu["ram_bytes"]))
    blas = cpu["blas"]
    for key in ("blas", "lapack"):
        if key in blas:
            out.add(key.upper(), f"{blas[key]['name']} {blas[key]['version'] or ''}".strip())
    if blas.get("simd_found"):
        out.add("SIMD", ", ".join(blas["simd_found"]))
    for pool in blas.get("threadpools", []):
        out.add("threadpool", f"{pool['internal_api']} {pool['version']} ({pool['num_threads']} threads)")
    if "error" in blas:
        out.add("BLAS", blas["error"])
    out.rows.append("gpu")
    if not gpu["available"]:
        out.rows.append(f"  no GPU: {gpu['reason']}")
        out.rows.append("  (training and inference run on the CPU path; install leaflens[gpu] on a CUDA machine)")
        return "\n".join(out.rows)
    out.add("name", f"{gpu['name']} (device {gpu['device']}, {gpu['multiprocessors']} SMs)")
    out.add("compute capability", gpu["compute_capability"])
    out.add("memory", f"{_gib(gpu['total_bytes'])} total, {_gib(gpu['free_bytes'])} free")
    out.add("CUDA driver/runtime", f"{gpu['driver_version']} / {gpu['runtime_version']}")
    if "h2d_pinned_gbps" in gpu:
        out.add("host->device (pinned)", f"{gpu['h2d_pinned_gbps']:.1f} GB/s")
    est = gpu["batch_estimate"]
    what = f"{req['model']} at {req['input_size']}x{req['input_size']}"
    if "unavailable" in est:
        out.add("largest safe batch", f"batch-size estimate unavailable: {est['unavailable']}")
    else:
        measured = ", ".join(f"batch {b}: {_gib(p)}" for b, p in est["samples"])
        out.add("largest safe batch", f"{est['batch']} for {what} (measured peaks {measured})")
    return "\n".join(out.rows)


def run(args: argparse.Namespace) -> int:
    if args.input_size < 8:
        print(f"doctor: --input-size must be >= 8, got {args.input_size}", file=sys.stderr)
        return 2
    facts = collect(args.model, args.input_size, measure_bandwidth=not args.no_bandwidth)
    print(json.dumps(facts, indent=2, default=str) if args.json else render(facts))
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="report Python, NumPy, CuPy, GPU and BLAS facts",
        description="Report versions, CPU facts (cores, BLAS) and, with a GPU, its memory, measured pinned "
        "host-to-device bandwidth and the largest safe training batch for a model and input size.",
    )
    parser.add_argument("--model", default="student", help="model to size the batch for (default: student)")
    parser.add_argument("--input-size", type=int, default=64, help="square input side in pixels (default: 64)")
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the host-to-device bandwidth measurement")
    parser.set_defaults(func=run)
    return parser
