"""``leaflens doctor``: the CPU-only report, the JSON form, run folders, and the batch-size arithmetic
and measurements (CPU heap peaks here; the GPU memory pool where there is a GPU) of leaflens.pipeline.doctor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from leaflens.engine.checkpoint import save_checkpoint
from leaflens.kernels import _cuda
from leaflens.pipeline import doctor, hardware
from leaflens.pipeline.cli import doctor as cmd_doctor
from leaflens.pipeline.cli import main
from leaflens.pipeline.models.student import StudentCNN


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
    assert "CPU-only machine" in out
    for label in ("Python", "NumPy", "CuPy", "onnxruntime", "cores", "BLAS", "largest safe batch",
                  "per image", "available RAM", "limited by speed, not memory"):
        assert label in out, label


def test_doctor_json(no_gpu, capsys):
    assert main(["doctor", "--json", "--model", "student", "--input-size", "96", "--no-measure"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["gpu"] == {"available": False, "reason": f"disabled by {_cuda.DISABLE_ENV}=1"}
    req = facts["request"]
    # the default student: lite8, the first 8 Lite0 blocks and a 256-wide head
    assert req["model"] == "student" and req["input_size"] == 96 and req["widths"] == [256]
    assert req["block"] == "lite0" and req["trunk_blocks"] == 8
    assert req["mixed_precision"] is False and req["source"] == "defaults" and req["configured_batch"] == 64
    assert "--no-measure" in facts["cpu_batch_estimate"]["unavailable"]
    assert facts["cpu"]["logical_cores"] >= 1
    assert facts["software"]["numpy"]
    from importlib.metadata import version

    assert facts["software"]["leaflens"] == version("leaflens")  # bug reports carry it


def test_doctor_sizes_the_student_distill_trains_without_the_lite0_weights(no_gpu, capsys, monkeypatch):
    """Without the teacher extra distill trains the 'm' student instead of lite8; doctor sized lite8 all the same
    and never said the weights were missing."""
    from leaflens.pipeline.models import pretrained

    def missing(path=None):
        raise pretrained.WeightsNotFoundError("not installed")

    monkeypatch.setattr(pretrained, "find_lite0_weights", missing)
    assert main(["doctor", "--json", "--no-measure"]) == 0
    captured = capsys.readouterr()
    req = json.loads(captured.out)["request"]
    assert req.get("block", "conv") != "lite0" and req.get("trunk_blocks") is None
    assert req["widths"] == [32, 64, 128, 256]  # the [model] section's student, 'm'
    assert "which are not installed" in captured.err and "distill would train the 'm' student instead" in captured.err
    assert main(["doctor", "--json", "--no-measure", "--family", "lite8"]) == 0  # sized as asked, and said
    assert "note: distill --family lite8 would be refused here" in capsys.readouterr().err


def test_doctor_sizes_a_given_student_on_the_cpu(no_gpu, capsys):
    assert main(["doctor", "--json", "--no-bandwidth", "--widths", "8,16", "--size", "24", "--classes", "4"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["request"]["widths"] == [8, 16] and facts["request"]["input_size"] == 24
    assert facts["request"]["source"] == "options"
    est = facts["cpu_batch_estimate"]
    assert est["batch"] > 0 and est["per_image_bytes"] > 0 and est["safety"] == doctor.SAFETY
    (b0, p0), (b1, p1) = est["samples"]
    assert (b0, b1) == doctor.CPU_BATCHES and p1 > p0 > 0
    assert "limited by speed" in est["note"]
    assert main(["doctor", "--widths", "8,x"]) == 2
    assert "--widths must be" in capsys.readouterr().err


def test_doctor_reads_a_run_folder(no_gpu, tmp_path, capsys):
    model = StudentCNN(5, widths=(8, 16, 24))
    save_checkpoint(tmp_path / "best.npz", model, extra={
        "model_config": {"kind": "student_cnn", "num_classes": 5, "widths": [8, 16, 24], "in_channels": 3},
        "dataset": {"classes": list("abcde"), "image_size": 40, "mean": [0.5] * 3, "std": [0.25] * 3}})
    (tmp_path / "config.toml").write_text('[train]\nbatch_size = 16\nmixed_precision = "on"\n')
    assert main(["doctor", "--json", "--no-bandwidth", "--no-measure", "--run", str(tmp_path)]) == 0
    req = json.loads(capsys.readouterr().out)["request"]
    assert req["widths"] == [8, 16, 24] and req["num_classes"] == 5 and req["input_size"] == 40
    assert req["configured_batch"] == 16 and req["mixed_precision"] is True and req["source"] == str(tmp_path)
    assert main(["doctor", "--run", str(tmp_path / "nothing")]) == 2
    assert "cannot read the run" in capsys.readouterr().err


def test_cpu_step_peak_is_measured_and_grows_with_the_batch():
    spec = doctor.ModelSpec(widths=(4, 8), num_classes=3)
    small = doctor.measure_cpu_step_peak_bytes(spec, 16, 2)
    big = doctor.measure_cpu_step_peak_bytes(spec, 16, 8)
    # at least the input batch and the first conv's float32 output per image, more for the larger batch
    assert big - small >= 6 * 16 * 16 * (3 + 4) * 4
    est = doctor.cpu_batch_estimate(spec, 16, measure=lambda m, s, b: 1000 + 100 * b)
    assert est["batch"] > 0 and "limited by speed" in est["note"]


def test_doctor_rejects_tiny_input(capsys):
    for size in ("2", "0", "100000"):  # 0 was sized at 64 without a word, 100000 accepted
        assert main(["doctor", "--input-size", size, "--no-measure"]) == 2
        assert f"--input-size must be from 8 to 1024, got {size}" in capsys.readouterr().err
    assert main(["doctor", "--classes", "0"]) == 2  # it sized a 0-class model
    assert "--classes must be >= 2" in capsys.readouterr().err


def test_largest_safe_batch_fits_a_line_through_measured_peaks():
    mib = 2**20
    gib = 2**30
    # 800 MiB fixed + 200 MiB per sample; 10 GiB free: 80 % usable -> (8192 - 800) / 200 = 36.96
    samples = [(2, 1200 * mib), (8, 2400 * mib)]
    assert doctor.largest_safe_batch(samples, 10 * gib) == 36
    assert doctor.largest_safe_batch(samples, 10 * gib, safety=1.0) == 47  # (10240 - 800) / 200 = 47.2
    assert doctor.largest_safe_batch(samples + [(4, 1600 * mib)], 10 * gib) == 36
    assert doctor.largest_safe_batch(samples, gib // 2) == 0
    with pytest.raises(ValueError, match="two or more"):
        doctor.largest_safe_batch([(2, gib)], 10 * gib)
    with pytest.raises(ValueError, match="does not grow"):
        doctor.largest_safe_batch([(2, gib), (4, gib)], 10 * gib)


def test_batch_estimate_is_measured_or_says_unavailable(no_gpu):
    est = doctor.batch_estimate("student", 64, 8 * 2**30)
    assert est == {"unavailable": f"no usable GPU: disabled by {_cuda.DISABLE_ENV}=1"}
    calls = []

    def fake_measure(model: str, size: int, batch: int) -> int:
        calls.append((model, size, batch))
        return 100 + 10 * batch

    est = doctor.batch_estimate("student", 64, 1000, measure=fake_measure, batches=(2, 8))
    assert calls == [("student", 64, 2), ("student", 64, 8)]
    assert est == {"batch": 70, "samples": [(2, 120), (8, 180)], "free_bytes": 1000,  # (800 - 100) / 10
                   "safety": 0.8, "per_image_bytes": 10.0}
    flat = doctor.batch_estimate("student", 64, 1000, measure=lambda m, s, b: 500)
    assert "does not grow" in flat["unavailable"]


def _gpu_facts(estimate):
    return {
        "software": hardware.software_facts(),
        "cpu": hardware.cpu_facts(),
        "request": {"model": "student", "input_size": 64, "widths": [32, 64], "mixed_precision": True,
                    "configured_batch": 64},
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
            "batch_estimate": estimate,
        },
    }


def test_render_with_a_gpu():
    mib = 2**20
    text = cmd_doctor.render(_gpu_facts({"batch": 1234, "samples": [(16, 300 * mib), (64, 396 * mib)],
                                         "free_bytes": 7 * 2**30, "safety": 0.8, "per_image_bytes": 2 * mib}))
    assert "compute capability     8.6" in text
    assert "8.0 GiB total, 7.0 GiB free" in text
    assert "12.3 GB/s" in text
    assert "largest safe batch     1234 for student 32-64 at 64x64, mixed precision" in text
    assert "batch 16: 300.0 MiB, batch 64: 396.0 MiB; 2.0 MiB per image; 80% of 7.0 GiB free GPU memory" in text
    assert "64 (fits)" in text
    text = cmd_doctor.render(_gpu_facts({"unavailable": "out of GPU memory at batch 64"}))
    assert "batch-size estimate unavailable: out of GPU memory at batch 64" in text


def test_render_shows_the_cpu_quota_and_the_thread_override():
    facts = _gpu_facts({"unavailable": "not measured (--no-measure)"})
    facts["cpu"].update(logical_cores=64, usable_cores=2, cpu_quota=2.5, threads=3, threads_override=3)
    text = cmd_doctor.render(facts)
    assert "64 logical, 2 usable by this process (cgroup CPU quota 2.5)" in text
    assert "threads                3 (LEAFLENS_THREADS is set)" in text
    facts["cpu"].update(cpu_quota=None, threads=2, threads_override=None)
    text = cmd_doctor.render(facts)
    assert "quota" not in text and "LEAFLENS_THREADS" not in text


def test_collect_sizes_the_batch_against_the_gpu_memory(monkeypatch):
    """The GPU branch without a GPU: probe facts and measurements are faked, the logic is real."""
    free = 6 * 2**30
    monkeypatch.setattr(doctor, "gpu_facts", lambda measure_bandwidth: {"available": True, "free_bytes": free})
    calls = []

    def fake_estimate(model, input_size, free_bytes, batches=doctor.GPU_BATCHES, **kw):
        calls.append((input_size, free_bytes, batches))
        if batches == doctor.GPU_BATCHES:  # a small GPU: the usual probe batches do not fit
            return {"unavailable": "out of GPU memory at batch 64"}
        return {"batch": 99}

    monkeypatch.setattr(doctor, "batch_estimate", fake_estimate)
    facts = doctor.collect(doctor.ModelSpec(widths=(8, 16)), 32, measure_bandwidth=False)
    assert facts["gpu"]["batch_estimate"] == {"batch": 99}
    assert calls == [(32, free, doctor.GPU_BATCHES), (32, free, doctor.CPU_BATCHES)]
    assert "cpu_batch_estimate" not in facts and facts["request"]["widths"] == [8, 16]
    facts = doctor.collect(doctor.ModelSpec(widths=(8, 16)), 32, measure_bandwidth=False, measure_batch=False)
    assert facts["gpu"]["batch_estimate"] == {"unavailable": "not measured (--no-measure)"}


def test_machine_facts_do_not_need_the_command_line():
    """hardware and the doctor's measurements are library modules: importing them loads no CLI module."""
    code = ("import sys, leaflens.pipeline.hardware, leaflens.pipeline.doctor; "
            "print(sorted(m for m in sys.modules if m.startswith('leaflens.pipeline.cli')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.gpu
def test_doctor_on_a_gpu(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "compute capability" in out
    assert "GB/s" in out
    assert "largest safe batch" in out


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["on", "off"])
def test_gpu_batch_estimate_is_positive_and_a_step_at_that_batch_fits(precision):
    spec = doctor.ModelSpec(widths=(16, 32), num_classes=5, mixed_precision=precision)
    free = 2 * 2**30  # size for a 2 GiB budget, whatever the GPU has, so that the check stays quick
    est = doctor.batch_estimate(spec, 32, free)
    assert est["batch"] > 0, est
    peak = doctor.measure_train_step_peak_bytes(spec, 32, est["batch"])
    assert peak <= free, (peak, est)


def test_doctor_says_which_extras_are_installed(monkeypatch, capsys):
    """Without the Lite0 weights doctor sized another student than the default and never said why; gradio and
    pillow-heif went unmentioned too."""
    from leaflens.pipeline.models import pretrained

    def missing(path=None):
        raise pretrained.WeightsNotFoundError("not installed")

    monkeypatch.setattr(pretrained, "find_lite0_weights", missing)
    assert main(["doctor", "--json", "--no-measure"]) == 0
    sw = json.loads(capsys.readouterr().out)["software"]
    assert sw["lite0_weights"] is None and {"gradio", "pillow_heif"} <= set(sw)
    assert main(["doctor", "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert "Lite0 weights          not installed: no EfficientNet-Lite0 teacher, and distill trains the 'm' student" \
        in text and "[teacher]" in text
