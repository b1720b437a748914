"""``leaflens doctor``: the CPU-only report, the JSON form, and the batch-size arithmetic."""

from __future__ import annotations

import json

import pytest

from kernels import _cuda
from pipeline import cmd_doctor
from pipeline.cli import main


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setenv(_cuda.DISABLE_ENV, "1")
    _cuda.gpu_probe(refresh=True)
    yield
    monkeypatch.delenv(_cuda.DISABLE_ENV)
    _cuda.gpu_probe(refresh=True)


def test_doctor_on_a_cpu_only_machine(no_gpu, capsys):
    assert main(["doctor", "--no-bandwidth"]) == 0
    out = capsys.readouterr().out
    assert f"no GPU: disabled by {_cuda.DISABLE_ENV}=1" in out
    for label in ("Python", "NumPy", "CuPy", "onnxruntime", "cores", "BLAS"):
        assert label in out, label


def test_doctor_json(no_gpu, capsys):
    assert main(["doctor", "--json", "--model", "student", "--input-size", "96"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["gpu"] == {"available": False, "reason": f"disabled by {_cuda.DISABLE_ENV}=1"}
    assert facts["request"] == {"model": "student", "input_size": 96}
    assert facts["cpu"]["logical_cores"] >= 1
    assert facts["software"]["numpy"]


def test_doctor_rejects_tiny_input(capsys):
    assert main(["doctor", "--input-size", "2"]) == 2
    assert "--input-size must be >= 8" in capsys.readouterr().err


def test_largest_safe_batch_fits_a_line_through_measured_peaks():
    mib = 2**20
    gib = 2**30
    # 800 MiB fixed + 200 MiB per sample; 10 GiB free: 85 % usable -> (8704 - 800) / 200 = 39.5
    samples = [(2, 1200 * mib), (8, 2400 * mib)]
    assert cmd_doctor.largest_safe_batch(samples, 10 * gib) == 39
    assert cmd_doctor.largest_safe_batch(samples, 10 * gib, safety=1.0) == 47  # (10240 - 800) / 200 = 47.2
    assert cmd_doctor.largest_safe_batch(samples + [(4, 1600 * mib)], 10 * gib) == 39
    assert cmd_doctor.largest_safe_batch(samples, gib // 2) == 0
    with pytest.raises(ValueError, match="two or more"):
        cmd_doctor.largest_safe_batch([(2, gib)], 10 * gib)
    with pytest.raises(ValueError, match="does not grow"):
        cmd_doctor.largest_safe_batch([(2, gib), (4, gib)], 10 * gib)


def test_batch_estimate_is_measured_or_says_unavailable():
    est = cmd_doctor.batch_estimate("student", 64, 8 * 2**30)
    assert est == {"unavailable": cmd_doctor.ENGINE_GPU_UNAVAILABLE}
    calls = []

    def fake_measure(model: str, size: int, batch: int) -> int:
        calls.append((model, size, batch))
        return 100 + 10 * batch

    est = cmd_doctor.batch_estimate("student", 64, 1000, measure=fake_measure)
    assert calls == [("student", 64, 2), ("student", 64, 8)]
    assert est == {"batch": 75, "samples": [(2, 120), (8, 180)]}  # (850 - 100) / 10


def test_render_with_a_gpu_and_no_engine_path():
    facts = {
        "software": cmd_doctor.software_facts(),
        "cpu": cmd_doctor.cpu_facts(),
        "request": {"model": "student", "input_size": 64},
        "gpu": {
            "available": True,
            "reason": "1 CUDA device(s)",
            "device": 0,
            "name": "Example GPU",
            "compute_capability": "8.6",
            "multiprocessors": 28,
            "total_bytes": 8 * 2**30,
            "free_bytes": 7 * 2**30,
            "driver_version": 12040,
            "runtime_version": 12040,
            "h2d_pinned_gbps": 12.3,
            "batch_estimate": {"unavailable": cmd_doctor.ENGINE_GPU_UNAVAILABLE},
        },
    }
    text = cmd_doctor.render(facts)
    assert "compute capability     8.6" in text
    assert "8.0 GiB total, 7.0 GiB free" in text
    assert "12.3 GB/s" in text
    assert "batch-size estimate unavailable: engine GPU path not built" in text


@pytest.mark.gpu
def test_doctor_on_a_gpu(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "compute capability" in out
    assert "GB/s" in out
    assert "largest safe batch" in out
