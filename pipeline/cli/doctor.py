"""``leaflens doctor``: what this machine offers leaflens.

Prints the Python/NumPy/CuPy/onnxruntime versions, the CPU facts (cores, BLAS in use), and either
"no GPU: <reason>" or the GPU's name, compute capability, total/free memory, the host-to-device
bandwidth measured with pinned memory, and the largest safe training batch for a model and input
size (``--widths``/``--size``, or read from a trained run with ``--run``).

The batch size is derived from the peak memory of real training steps (forward, backward, optimiser
step) measured at two small batches: the two peaks give a fixed cost (weights, optimiser state,
workspace) and a cost per image, and the largest batch is the one whose predicted peak stays within
80 % of the free memory (20 % is left as a margin for fragmentation, the CUDA context and libraries).
On a GPU the peak is CuPy's memory pool after the step (emptied before it), plus the loader's two
device batch buffers. On a CPU-only machine the same fit runs on the Python/NumPy heap peak
(``tracemalloc``) against the RAM the kernel reports available, and is labelled for what it is: a
memory ceiling, while on a CPU the batch size is limited by speed long before memory.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.cpus import THREADS_ENV, cpu_budget

SAFETY = 0.8  # use at most 80 % of the free memory: 20 % stays free as a margin
GPU_BATCHES = (16, 64)  # measured on a GPU (large enough that the pool's rounding does not dominate)
CPU_BATCHES = (2, 8)    # measured on the CPU (cheap)


class BatchEstimateUnavailable(RuntimeError):
    """The peak memory of a training step cannot be measured here (says why)."""


@dataclass(frozen=True)
class ModelSpec:
    """The student to size a batch for: conv widths, classes, precision (what ``leaflens distill`` trains)."""

    widths: tuple[int, ...]  # the default recipe's come from its [model] section (default_spec)
    num_classes: int = 10
    mixed_precision: str = "auto"  # "auto" (on with a GPU), "on", "off": as train.mixed_precision
    source: str = "defaults"       # where the numbers came from (defaults, options, a run folder)
    configured_batch: int | None = None  # train.batch_size of that recipe or run

    def describe(self) -> str:
        return f"student CNN widths {'-'.join(map(str, self.widths))}, {self.num_classes} classes"


def default_spec() -> ModelSpec:
    """The student of the default recipe (pipeline/distill_default.toml)."""
    from leaflens.pipeline.config import load_config  # noqa: PLC0415

    cfg = load_config()
    return ModelSpec(widths=cfg.model.widths, mixed_precision=cfg.train.mixed_precision,
                     configured_batch=cfg.train.batch_size)


def spec_from_run(run_dir: str | os.PathLike[str]) -> tuple[ModelSpec, int]:
    """(model, input size) of a trained run folder: widths and classes from best.npz, the recipe's batch
    size and precision from its config.toml when present."""
    from leaflens.pipeline.config import read_toml  # noqa: PLC0415
    from leaflens.pipeline.runs import read_run  # noqa: PLC0415

    info = read_run(run_dir)
    mc = info.model_config
    cfg_path = Path(run_dir) / "config.toml"
    train = read_toml(cfg_path).get("train", {}) if cfg_path.exists() else {}
    spec = ModelSpec(widths=mc.widths, num_classes=mc.num_classes,
                     mixed_precision=str(train.get("mixed_precision", "auto")), source=str(run_dir),
                     configured_batch=int(train["batch_size"]) if "batch_size" in train else None)
    return spec, info.dataset.model_input_size


def _as_spec(model: ModelSpec | str) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if model == "student":
        return default_spec()
    raise BatchEstimateUnavailable(f"unknown model {model!r}: only the student CNN can be sized")


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


def _use_amp(spec: ModelSpec, device: str) -> bool:
    from leaflens.pipeline.train_student import resolve_precision  # noqa: PLC0415

    return resolve_precision(spec.mixed_precision, device)


def _training_step(spec: ModelSpec, input_size: int, batch: int, device: str) -> Callable[[], None]:
    """One real training step of the student (AdamW, cross-entropy, mixed precision as the spec says)
    on random data that lives on ``device``: the training loop's own step (leaflens.engine.amp.train_step)."""
    from leaflens.engine import Tensor, ops  # noqa: PLC0415
    from leaflens.engine.amp import GradScaler, train_step  # noqa: PLC0415
    from leaflens.engine.optim import AdamW  # noqa: PLC0415
    from leaflens.pipeline.models.student import StudentCNN  # noqa: PLC0415

    use_amp = _use_amp(spec, device)
    model = StudentCNN(spec.num_classes, widths=spec.widths, rng=np.random.default_rng(0))
    if device != "cpu":
        model.to(device)
    opt = AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler(enabled=use_amp)
    shape = (batch, input_size, input_size, 3)
    if device == "cpu":
        rng = np.random.default_rng(0)
        x = rng.standard_normal(shape, dtype=np.float32)
        y = rng.integers(0, spec.num_classes, batch)
    else:
        import cupy as cp  # noqa: PLC0415

        x = cp.random.standard_normal(shape, dtype=cp.float32)
        y = cp.random.randint(0, spec.num_classes, batch)

    def step() -> None:
        train_step(opt, scaler, lambda: ops.cross_entropy(model(Tensor(x)), y))

    return step


def loader_buffer_bytes(input_size: int, batch: int) -> int:
    """Device memory of DeviceLoader's two batch buffers (float32 images, int64 labels)."""
    return 2 * batch * (input_size * input_size * 3 * 4 + 8)


def measure_train_step_peak_bytes(model: ModelSpec | str, input_size: int, batch: int) -> int:
    """Peak GPU memory (bytes) of one forward + backward + optimiser step of ``model`` on a batch of
    ``batch`` RGB images of ``input_size`` x ``input_size``, measured, not computed.

    A warm-up step first (optimiser state, cuBLAS workspace, kernel compilation); then CuPy's memory
    pool is emptied of cached blocks, one more step runs, and the pool's size right after it is the
    high-water mark (blocks freed during the step stay cached in the pool, so the pool only grows when
    the step needs more at once). The loader's two device buffers are added. Raises
    BatchEstimateUnavailable without a usable GPU.
    """
    from leaflens.engine.device_loader import gpu_usable  # noqa: PLC0415

    ok, why = gpu_usable()
    if not ok:
        raise BatchEstimateUnavailable(f"no usable GPU: {why}")
    import cupy as cp  # noqa: PLC0415

    spec = _as_spec(model)
    pool = cp.get_default_memory_pool()
    step = _training_step(spec, input_size, batch, "cuda")
    try:
        step()
        cp.cuda.Device().synchronize()
        pool.free_all_blocks()
        step()
        cp.cuda.Device().synchronize()
        peak = int(pool.total_bytes())
    except cp.cuda.memory.OutOfMemoryError as exc:
        raise BatchEstimateUnavailable(f"out of GPU memory at batch {batch}: {exc}") from exc
    finally:
        del step
        gc.collect()
        pool.free_all_blocks()
    return peak + loader_buffer_bytes(input_size, batch)


def measure_cpu_step_peak_bytes(model: ModelSpec | str, input_size: int, batch: int) -> int:
    """Peak Python/NumPy heap growth (bytes) of one CPU training step, measured with ``tracemalloc``
    (NumPy reports its array buffers to it), after a warm-up step that allocates the optimiser state."""
    spec = _as_spec(model)
    step = _training_step(spec, input_size, batch, "cpu")
    step()
    gc.collect()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        step()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return int(peak)


def largest_safe_batch(samples: list[tuple[int, int]], free_bytes: int, safety: float = SAFETY) -> int:
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
    return max(0, int(np.floor(budget / per_sample + 1e-6)))  # + 1e-6: least-squares rounding, not memory


def batch_estimate(
    model: ModelSpec | str,
    input_size: int,
    free_bytes: int,
    measure: Callable[[Any, int, int], int] = measure_train_step_peak_bytes,
    batches: tuple[int, int] = GPU_BATCHES,
    safety: float = SAFETY,
) -> dict[str, Any]:
    """{"batch", "samples", "free_bytes", "safety", "per_image_bytes"} from measured peaks, or
    {"unavailable": reason}."""
    try:
        samples = [(b, int(measure(model, input_size, b))) for b in batches]
        batch = largest_safe_batch(samples, free_bytes, safety)
    except (BatchEstimateUnavailable, ValueError) as exc:
        return {"unavailable": str(exc)}
    (b0, p0), (b1, p1) = samples[0], samples[-1]
    return {"batch": batch, "samples": samples, "free_bytes": int(free_bytes), "safety": safety,
            "per_image_bytes": (p1 - p0) / (b1 - b0)}


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


CPU_SPEED_NOTE = ("a memory ceiling, not a recommendation: on the CPU the batch size is limited by speed, not "
                  "memory (a step's time grows with its batch)")


def cpu_batch_estimate(spec: ModelSpec, input_size: int,
                       measure: Callable[[Any, int, int], int] = measure_cpu_step_peak_bytes) -> dict[str, Any]:
    """The memory ceiling for a CPU batch (measured heap peaks vs available RAM), with the speed caveat."""
    ram = available_ram_bytes()
    if ram is None:
        return {"unavailable": "available RAM unknown on this system", "note": CPU_SPEED_NOTE}
    est = batch_estimate(spec, input_size, ram, measure=measure, batches=CPU_BATCHES)
    est["note"] = CPU_SPEED_NOTE
    return est


def gpu_facts(model: ModelSpec | str, input_size: int, measure_bandwidth: bool = True,
              measure_batch: bool = True) -> dict[str, Any]:
    """Probe result plus, with a GPU, device properties, memory, bandwidth and the batch estimate."""
    from leaflens.kernels import _cuda

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
    if measure_batch:
        est = batch_estimate(model, input_size, int(free))
        if "out of GPU memory" in est.get("unavailable", ""):  # a small GPU or a large input: smaller probes
            est = batch_estimate(model, input_size, int(free), batches=CPU_BATCHES)
        facts["batch_estimate"] = est
    else:
        facts["batch_estimate"] = {"unavailable": "not measured (--no-measure)"}
    return facts


def collect(model: ModelSpec | str, input_size: int, measure_bandwidth: bool = True,
            measure_batch: bool = True) -> dict[str, Any]:
    """Every fact the report shows, as one JSON-able dict (``--json`` prints it as it is)."""
    spec = _as_spec(model)
    gpu = gpu_facts(spec, input_size, measure_bandwidth, measure_batch)
    facts = {
        "software": software_facts(),
        "cpu": cpu_facts(),
        "gpu": gpu,
        "request": {"model": "student", "input_size": input_size, "widths": list(spec.widths),
                    "num_classes": spec.num_classes, "mixed_precision": _use_amp(spec, "cuda" if gpu["available"]
                                                                                  else "cpu"),
                    "source": spec.source, "configured_batch": spec.configured_batch},
    }
    if not gpu["available"]:  # CPU-only: the memory ceiling of a CPU batch, with its caveat
        facts["cpu_batch_estimate"] = (cpu_batch_estimate(spec, input_size) if measure_batch
                                       else {"unavailable": "not measured (--no-measure)", "note": CPU_SPEED_NOTE})
    return facts


# ---- report ----------------------------------------------------------------------------------------------------
def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass
class _Lines:
    rows: list[str]

    def add(self, key: str, value: Any) -> None:
        self.rows.append(f"  {key:<22} {value}")


def _estimate_lines(out: _Lines, est: dict[str, Any], req: dict[str, Any], memory: str) -> None:
    what = (f"student {'-'.join(map(str, req.get('widths', [])))} at {req['input_size']}x{req['input_size']}"
            f"{', mixed precision' if req.get('mixed_precision') else ', float32'}")
    if "unavailable" in est:
        out.add("largest safe batch", f"batch-size estimate unavailable: {est['unavailable']}")
        return
    measured = ", ".join(f"batch {b}: {_mib(p)}" for b, p in est["samples"])
    out.add("largest safe batch", f"{est['batch']} for {what}")
    out.add("  from", f"measured peaks {measured}; {_mib(est['per_image_bytes'])} per image; "
                      f"{est['safety']:.0%} of {_gib(est['free_bytes'])} {memory}")
    configured = req.get("configured_batch")
    if configured:
        verdict = "fits" if configured <= est["batch"] else "does NOT fit: lower train.batch_size"
        out.add("  recipe batch", f"{configured} ({verdict})")


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
    out.add("cores", f"{cpu['logical_cores']} logical, {cpu['usable_cores']} usable by this process"
                     + (f" (cgroup CPU quota {cpu['cpu_quota']:g})" if cpu.get("cpu_quota") else ""))
    if cpu.get("threads_override") is not None:
        out.add("threads", f"{cpu['threads']} ({THREADS_ENV} is set)")
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
        out.rows.append("  CPU-only machine: training and inference run on the CPU path "
                        "(install leaflens[gpu] on a CUDA machine)")
        est = facts.get("cpu_batch_estimate")
        if est is not None:
            out.rows.append("training batch on the CPU")
            _estimate_lines(out, est, req, "available RAM")
            out.add("note", est["note"])
        return "\n".join(out.rows)
    out.add("name", f"{gpu['name']} (device {gpu['device']}, {gpu['multiprocessors']} SMs)")
    out.add("compute capability", gpu["compute_capability"])
    out.add("memory", f"{_gib(gpu['total_bytes'])} total, {_gib(gpu['free_bytes'])} free")
    out.add("CUDA driver/runtime", f"{gpu['driver_version']} / {gpu['runtime_version']}")
    if "h2d_pinned_gbps" in gpu:
        out.add("host->device (pinned)", f"{gpu['h2d_pinned_gbps']:.1f} GB/s")
    _estimate_lines(out, gpu["batch_estimate"], req, "free GPU memory")
    return "\n".join(out.rows)


def _parse_widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.replace(" ", "").strip("[]()").split(",") if w)
    except ValueError:
        raise ValueError(f"--widths must be comma-separated integers, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise ValueError(f"--widths must be positive integers, got {text!r}")
    return widths


def run(args: argparse.Namespace) -> int:
    if args.run is not None:
        try:
            spec, size = spec_from_run(args.run)
        except Exception as exc:  # CheckpointError, a missing folder, a foreign file
            print(f"doctor: cannot read the run {args.run}: {exc}", file=sys.stderr)
            return 2
        size = args.input_size or size
    else:
        spec, size = default_spec(), args.input_size or 64
        if args.model != "student":
            print(f"doctor: unknown --model {args.model!r}: only 'student' can be sized", file=sys.stderr)
            return 2
    if size < 8:
        print(f"doctor: --input-size must be >= 8, got {size}", file=sys.stderr)
        return 2
    changes: dict[str, Any] = {}
    try:
        if args.widths:
            changes["widths"] = _parse_widths(args.widths)
    except ValueError as exc:
        print(f"doctor: {exc}", file=sys.stderr)
        return 2
    if args.classes:
        changes["num_classes"] = args.classes
    if args.mixed_precision:
        changes["mixed_precision"] = args.mixed_precision
    if changes:
        spec = ModelSpec(**{**asdict(spec), **changes, "source": "options" if args.run is None else spec.source})
    facts = collect(spec, size, measure_bandwidth=not args.no_bandwidth, measure_batch=not args.no_measure)
    print(json.dumps(facts, indent=2, default=str) if args.json else render(facts))
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor",
        help="report Python, NumPy, CuPy, GPU and BLAS facts",
        description="Report versions, CPU facts (cores, BLAS) and, with a GPU, its memory, measured pinned "
        "host-to-device bandwidth and the largest safe training batch for a model and input size (measured "
        "from real training steps at two small batches). Without a GPU, the memory ceiling of a CPU batch.",
    )
    parser.add_argument("--model", default="student", help="model to size the batch for (default: student)")
    parser.add_argument("--input-size", "--size", dest="input_size", type=int, default=None,
                        help="square input side in pixels (default: 64, or the run's image size)")
    parser.add_argument("--widths", default=None,
                        help="student conv widths, e.g. 32,64,128,256 (default: the distill recipe's)")
    parser.add_argument("--classes", type=int, default=None, help="number of classes (default: 10, or the run's)")
    parser.add_argument("--mixed-precision", choices=("auto", "on", "off"), default=None,
                        help="size for float16 training (auto: on with a GPU; default: the recipe's setting)")
    parser.add_argument("--run", type=Path, default=None,
                        help="a trained run folder (leaflens distill --out): size its student and image size")
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the host-to-device bandwidth measurement")
    parser.add_argument("--no-measure", action="store_true", help="skip the training-step memory measurements")
    parser.set_defaults(func=run)
    return parser
