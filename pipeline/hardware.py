"""What machine a run was trained on, for report.json and report.md.

Reuses ``leaflens doctor``'s CPU facts (leaflens.pipeline.cli.doctor) and the kernels' guarded GPU probe
(leaflens.kernels._cuda), so the report and the doctor always describe a machine the same way. Unlike the
doctor, it measures nothing (no bandwidth test, no batch-size estimate): it is called at the end of
every training run and must be quick and unable to fail the run.
"""

from __future__ import annotations

from typing import Any

from leaflens.pipeline.cli.doctor import cpu_facts


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
        name = props.get("name", b"?")
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        total = props.get("totalGlobalMem")
        return {"gpu": name, "gpu_memory_gib": round(total / 2**30, 1) if total else None, "gpu_reason": None}
    except Exception as exc:  # a report must not fail because a property query did
        return {"gpu": "CUDA GPU (name unavailable)", "gpu_memory_gib": None,
                "gpu_reason": f"device query failed: {type(exc).__name__}: {exc}"}


def describe_hardware(device: str | None = None) -> dict[str, Any]:
    """CPU model, cores, RAM, NumPy's BLAS, and the GPU name (None without a usable GPU).

    ``device`` is the device the run actually used ("cpu" or "cuda"), recorded so that a report does not
    credit a GPU that was present but idle. Keys: ``cpu_model``, ``cpu_cores`` (logical), ``usable_cores``
    (this process's affinity), ``ram_gib``, ``blas``, ``gpu``, ``gpu_memory_gib``, ``gpu_reason`` (why
    there is no GPU), ``device``, and ``summary``, one line for humans.
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
