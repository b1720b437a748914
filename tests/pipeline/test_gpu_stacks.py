"""`leaflens doctor`'s GPU stacks (leaflens.pipeline.gpu_stacks): the extra for a driver, the warnings for
mismatched stacks, the missing libraries, and the report's section."""

from __future__ import annotations

import json

import pytest

from leaflens.apps import providers
from leaflens.extras import install_command
from leaflens.kernels import _cuda
from leaflens.pipeline import gpu_stacks
from leaflens.pipeline.cli import doctor as cmd_doctor
from leaflens.pipeline.cli import main


def driver(version: str | None, *caps: str) -> dict:
    major = None if version is None else int(version.split(".")[0])
    return {"cuda_version": version, "cuda_major": major,
            "gpus": [{"name": "GPU", "driver": "580.65", "compute_capability": c} for c in caps]}


def cupy(major: int | None) -> dict:
    return {"packages": {f"cupy-cuda{major}x": "14.2.0"} if major else {}, "cuda_major": major}


def ort(package: str = "onnxruntime", major: int | None = None, *others: str) -> dict:
    return {"packages": {package: "1.31.1", **{o: "1.32.0" for o in others}}, "package": package,
            "cuda_major": major}


@pytest.mark.parametrize(("facts", "extra"), [
    (driver("13.0", "9.0"), "gpu"),
    (driver("13.1"), "gpu"),              # no nvidia-smi: the driver alone decides
    (driver("13.0", "6.1"), "gpu-cuda12"),  # a Pascal GPU under a CUDA 13 driver
    (driver("12.4", "8.6"), "gpu-cuda12"),
    (driver("11.8"), "gpu-cuda11"),
    (driver("10.2"), None),
    (driver(None), None),
])
def test_the_extra_for_the_driver(facts, extra):
    advice = gpu_stacks.recommend(facts, cupy(None), ort())
    assert advice["extra"] == extra
    assert advice["command"] == install_command(f"{extra or 'serve'},teacher")
    assert advice["warnings"] == []


def test_why_names_the_reason():
    assert "below compute capability 7.5" in gpu_stacks.recommend(driver("13.0", "7.0"), cupy(None), ort())["why"]
    assert "update the driver" in gpu_stacks.recommend(driver("10.2"), cupy(None), ort())["why"]
    assert "no NVIDIA driver" in gpu_stacks.recommend(driver(None), cupy(None), ort())["why"]


def test_mismatched_stacks_are_named():
    # The report: onnxruntime-gpu for CUDA 13 beside cupy-cuda12x.
    warnings = gpu_stacks.recommend(driver("13.0", "9.0"), cupy(12), ort("onnxruntime-gpu", 13))["warnings"]
    assert warnings == ["the GPU stacks are built for different CUDA majors (CuPy for CUDA 12, onnxruntime-gpu for "
                        f"CUDA 13): install one GPU extra ({install_command('gpu,teacher')})"]
    newer = gpu_stacks.recommend(driver("12.4"), cupy(13), ort("onnxruntime-gpu", 13))["warnings"]
    assert len(newer) == 2 and all("newer than the driver's CUDA 12.4" in w for w in newer)
    both = gpu_stacks.recommend(driver(None), cupy(None), ort("onnxruntime-gpu", 13, "onnxruntime"))["warnings"]
    assert both == ["onnxruntime and onnxruntime-gpu are installed together: they share one folder and the one "
                    "installed last runs; pip uninstall them all, then install one extra"]


def test_missing_libraries_from_a_reason():
    reason = ("libcublasLt.so.13 not found (onnxruntime-gpu 1.31.1 needs the CUDA 13.0 libraries); "
              "CuPy failed to load libnvrtc.so.13: OSError: libnvrtc.so.13: cannot open shared object file")
    assert gpu_stacks.missing_libraries(reason) == ["libcublasLt.so.13", "libnvrtc.so.13"]
    assert gpu_stacks.missing_libraries("CuPy sees no CUDA device") == []


def test_driver_facts_without_a_driver(monkeypatch):
    monkeypatch.setattr(gpu_stacks, "driver_cuda_version", lambda: None)
    assert gpu_stacks.driver_facts() == {"cuda_version": None, "cuda_major": None, "gpus": []}
    monkeypatch.setattr(gpu_stacks, "driver_cuda_version", lambda: 12040)
    monkeypatch.setattr(gpu_stacks, "_nvidia_smi", lambda: [])
    assert gpu_stacks.driver_facts() == {"cuda_version": "12.4", "cuda_major": 12, "gpus": []}


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setenv(_cuda.DISABLE_ENV, "1")
    monkeypatch.setattr(providers, "_probes", {})
    _cuda.gpu_probe(refresh=True)
    yield
    monkeypatch.delenv(_cuda.DISABLE_ENV)
    _cuda.gpu_probe(refresh=True)


def test_doctor_reports_the_gpu_stacks(no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(gpu_stacks, "driver_cuda_version", lambda: None)
    assert main(["doctor", "--json", "--no-measure", "--no-bandwidth"]) == 0
    stacks = json.loads(capsys.readouterr().out)["gpu_stacks"]
    assert stacks["driver"]["cuda_version"] is None
    assert stacks["install"]["command"] == install_command("serve,teacher")
    assert set(stacks) == {"driver", "cupy", "onnxruntime", "install"}
    assert main(["doctor", "--no-measure", "--no-bandwidth"]) == 0
    out = capsys.readouterr().out
    assert "gpu stacks" in out and "NVIDIA driver          none (libcuda.so.1 not found)" in out
    assert f"install                {install_command('serve,teacher')}" in out


def test_render_names_what_each_stack_misses():
    lines = cmd_doctor._Lines([])
    cmd_doctor._stack_lines(lines, {
        "driver": driver("13.0", "9.0"),
        "cupy": {**cupy(13), "starts": False, "reason": "CuPy failed to load libnvrtc.so.13",
                 "missing": ["libnvrtc.so.13"]},
        "onnxruntime": {"packages": {"onnxruntime-gpu": "1.31.1"}, "package": "onnxruntime-gpu", "version": "1.31.1",
                        "cuda": "13.0", "cuda_major": 13,
                        "providers": {providers.CUDA: {"starts": False, "reason": "libcublasLt.so.13 not found",
                                                       "missing": ["libcublasLt.so.13"]}}},
        "install": {"extra": "gpu", "command": "pip install 'leaflens[gpu,teacher]'",
                    "why": "the driver supports CUDA 13.0", "warnings": []},
    })
    text = "\n".join(lines.rows)
    assert "NVIDIA driver          supports CUDA 13.0 (GPU, driver 580.65, compute capability 9.0)" in text
    assert "cupy-cuda13x 14.2.0 for CUDA 13: cannot start: CuPy failed to load libnvrtc.so.13" in text
    assert "  missing              libnvrtc.so.13" in text
    assert "onnxruntime-gpu 1.31.1 for CUDA 13.0" in text and "CUDA provider        cannot start" in text
    assert "install                pip install 'leaflens[gpu,teacher]' (the driver supports CUDA 13.0)" in text
