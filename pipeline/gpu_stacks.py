"""The two GPU stacks leaflens can use, CuPy (training) and onnxruntime (serving): what is installed, the
CUDA major each is built for, whether each starts here and, if not, the library it misses; the NVIDIA
driver's CUDA version and the install extra that matches it (``leaflens doctor`` prints these).

A driver runs its own CUDA major and every older one, so the extra is the newest whose major the driver
supports (leaflens.apps.providers.GPU_EXTRAS), except that CUDA 13 no longer builds for GPUs below compute
capability 7.5 (Maxwell, Pascal, Volta): those get the CUDA 12 extra. Probing only: the onnxruntime side
is the serving probe itself (quiet, cached), the CuPy side the kernels' probe.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from typing import Any

from leaflens.apps.providers import (
    CUDA,
    GPU_EXTRAS,
    TENSORRT,
    cuda_major,
    driver_cuda_version,
    extra_for_cuda,
    onnxruntime_build,
    probe,
)
from leaflens.extras import install_command

__all__ = ["cupy_facts", "driver_facts", "gpu_stack_facts", "missing_libraries", "onnxruntime_facts", "recommend"]

CUDA13_MIN_CC = 7.5  # CUDA 13 dropped Maxwell, Pascal and Volta
_LIB = re.compile(r"\b(lib[\w.+-]*?\.so(?:\.\d+)*)\b")
_CUPY_WHEEL = re.compile(r"^cupy-cuda(\d+)x$")


def missing_libraries(reason: str) -> list[str]:
    """The shared libraries (``libcublasLt.so.13``) a probe's reason names, in order, each once."""
    return list(dict.fromkeys(_LIB.findall(reason)))


def _installed(prefix: str) -> dict[str, str]:
    """Installed distributions whose name starts with ``prefix``: {name: version}."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(prefix):
            found[name] = dist.version
    return found


def _nvidia_smi() -> list[dict[str, str]]:
    """Name, driver version and compute capability per GPU from nvidia-smi, or [] when it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    return [{"name": r[0], "driver": r[1], "compute_capability": r[2]} for r in rows if len(r) == 3]


def driver_facts() -> dict[str, Any]:
    """{"cuda_version": "13.0" or None, "cuda_major", "gpus": nvidia-smi's rows (name, driver, capability)}."""
    version = driver_cuda_version()
    return {"cuda_version": None if version is None else f"{version // 1000}.{version % 1000 // 10}",
            "cuda_major": cuda_major(version), "gpus": _nvidia_smi() if version is not None else []}


def cupy_facts() -> dict[str, Any]:
    """The installed CuPy wheel (``cupy-cuda13x`` ...), the CUDA major it is built for, whether it starts
    (the kernels' probe) and the libraries it misses."""
    from leaflens.kernels import _cuda  # noqa: PLC0415

    wheels = _installed("cupy")
    facts: dict[str, Any] = {"packages": wheels, "cuda_major": None, "starts": False, "reason": "not installed",
                             "missing": []}
    if not wheels:
        return facts
    majors = {int(m.group(1)) for name in wheels if (m := _CUPY_WHEEL.match(name))}
    facts["cuda_major"] = majors.pop() if len(majors) == 1 else None
    ok, reason = _cuda.gpu_probe()
    facts.update(starts=ok, reason=reason, missing=[] if ok else missing_libraries(reason))
    return facts


def onnxruntime_facts() -> dict[str, Any]:
    """The installed onnxruntime packages, the CUDA version the importable one is built for, and whether its
    CUDA (and, when built in, TensorRT) provider starts (the serving probe) with the libraries it misses."""
    packages = _installed("onnxruntime")
    facts: dict[str, Any] = {"packages": packages, "package": None, "version": None, "cuda": None,
                             "cuda_major": None, "providers": {}}
    if not packages:
        return facts
    try:
        import onnxruntime as ort  # noqa: PLC0415
    except Exception as exc:  # installed but broken underneath
        facts["error"] = f"{type(exc).__name__}: {exc}"
        return facts
    build = onnxruntime_build(ort)
    facts.update(package=build["package"], version=build["version"], cuda=build["cuda"],
                 cuda_major=cuda_major(build["cuda"]))
    for provider in (CUDA, TENSORRT):
        if provider in ort.get_available_providers():
            result = probe(provider)
            facts["providers"][provider] = {"starts": result.ok, "reason": result.reason,
                                            "missing": [] if result.ok else missing_libraries(result.reason)}
    return facts


def _capabilities(gpus: list[dict[str, str]]) -> list[float]:
    caps = []
    for gpu in gpus:
        try:
            caps.append(float(gpu["compute_capability"]))
        except (KeyError, ValueError):
            continue
    return caps


def recommend(driver: dict[str, Any], cupy: dict[str, Any], ort: dict[str, Any]) -> dict[str, Any]:
    """{"extra": the extra for this driver or None, "command": the pip line, "why": one line, "warnings": [...]}
    from the facts above: mismatched CUDA majors between the stacks or against the driver, and an
    ``onnxruntime`` installed beside ``onnxruntime-gpu`` (they share one folder: the last installed runs)."""
    warnings: list[str] = []
    major = driver["cuda_major"]
    extra = extra_for_cuda(major)
    if extra == GPU_EXTRAS[13] and any(c < CUDA13_MIN_CC for c in _capabilities(driver["gpus"])):
        extra = GPU_EXTRAS[12]
        why = (f"the driver supports CUDA {driver['cuda_version']}, but a GPU below compute capability "
               f"{CUDA13_MIN_CC} needs the CUDA 12 builds")
    elif major is None:
        why = "no NVIDIA driver: leaflens trains and serves on the CPU"
    elif extra is None:
        why = f"the driver supports CUDA {driver['cuda_version']} only, older than any GPU extra: update the driver"
    else:
        why = f"the driver supports CUDA {driver['cuda_version']}"
    command = install_command(f"{extra or 'serve'},teacher")  # teacher: the Lite0 weights training starts from
    stacks = {"CuPy": cupy.get("cuda_major"), ort.get("package") or "onnxruntime": ort.get("cuda_major")}
    built = {name: m for name, m in stacks.items() if m is not None}
    if len(set(built.values())) > 1:
        warnings.append("the GPU stacks are built for different CUDA majors ("
                        + ", ".join(f"{n} for CUDA {m}" for n, m in built.items())
                        + f"): install one GPU extra ({command})")
    for name, m in built.items():
        if major is not None and m > major:
            warnings.append(f"{name} is built for CUDA {m}, newer than the driver's CUDA {driver['cuda_version']}: "
                            f"it cannot start ({command})")
    if len(ort.get("packages", {})) > 1:
        warnings.append(f"{' and '.join(sorted(ort['packages']))} are installed together: they share one folder and "
                        "the one installed last runs; pip uninstall them all, then install one extra")
    return {"extra": extra, "command": command, "why": why, "warnings": warnings}


def gpu_stack_facts() -> dict[str, Any]:
    """Driver, CuPy, onnxruntime and the install recommendation, as one JSON-able dict."""
    driver, cupy, ort = driver_facts(), cupy_facts(), onnxruntime_facts()
    return {"driver": driver, "cupy": cupy, "onnxruntime": ort, "install": recommend(driver, cupy, ort)}
