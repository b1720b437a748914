"""benchmarks/calibration.py: a run's probabilities before and after the temperature distill would fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from bench_helpers import assert_refused, load_module, run_script

from leaflens.data_prep.manifest import load_dataset
from leaflens.pipeline import calibration
from leaflens.pipeline.report import metrics
from leaflens.pipeline.runs import load_model
from leaflens.pipeline.train_student import predict_logits


def test_a_trained_run_is_measured_raw_and_calibrated(tmp_path):
    helpers = load_module(Path(__file__).resolve().parent / "pipeline" / "test_evaluate.py",
                          "leaflens_test_evaluate_helpers")
    _, dataset, run = helpers._trained_run(tmp_path)
    out = run_script("calibration.py", "--run", str(run), "--dataset", str(dataset))
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    ds = load_dataset(dataset)
    model, info = load_model(run)
    logits = predict_logits(model, ds["val"].images, ds.mean, ds.std, 64, info.dataset.model_input_size)
    y = np.asarray(ds["val"].labels)
    t = calibration.fit_temperature(logits, y)
    assert figures["temperature"] == round(t, 4)
    assert figures["val_raw_ece"] == round(metrics.expected_calibration_error(metrics.softmax(logits), y), 4)
    assert figures["val_calibrated_ece"] == round(metrics.expected_calibration_error(metrics.softmax(logits / t), y),
                                                  4)
    assert figures["val_raw_accuracy"] == figures["val_calibrated_accuracy"]  # no answer changes


def test_the_calibrated_figures_are_those_of_the_fitted_temperature(tmp_path, monkeypatch, capsys):
    """The tiny run has too few validation photos to fit one: a temperature is given, and the figures follow."""
    from bench_helpers import load_benchmark  # noqa: PLC0415

    helpers = load_module(Path(__file__).resolve().parent / "pipeline" / "test_evaluate.py",
                          "leaflens_test_evaluate_helpers")
    _, dataset, run = helpers._trained_run(tmp_path)
    bench = load_benchmark("calibration.py")
    monkeypatch.setattr(bench.calibration, "fit_temperature", lambda logits, labels: 0.5)
    assert bench.main(["--run", str(run), "--dataset", str(dataset)]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ds = load_dataset(dataset)
    model, info = load_model(run)
    logits = predict_logits(model, ds["val"].images, ds.mean, ds.std, 64, info.dataset.model_input_size)
    assert figures["temperature"] == 0.5
    assert figures["val_calibrated_mean_top"] == round(float(metrics.softmax(logits / 0.5).max(1).mean()), 4)
    assert figures["val_raw_mean_top"] == round(float(metrics.softmax(logits).max(1).mean()), 4)
    assert figures["val_calibrated_mean_top"] > figures["val_raw_mean_top"]  # sharper, as T < 1 makes them


def test_a_missing_run_is_refused(tmp_path):
    assert_refused(run_script("calibration.py", "--run", str(tmp_path / "none"), "--dataset", str(tmp_path)), 2,
                   "--run")


def test_a_teacher_is_measured_on_the_logits_teacher_json_records(tmp_path):
    """--teacher: the logits distill weighs a teacher candidate by, the temperature fitted as distill fits it."""
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parent / "pipeline"))
    from pipeline_helpers import class_features, tiny_dataset  # noqa: PLC0415

    from leaflens.pipeline.teachers.artefact import load_teacher  # noqa: PLC0415
    from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source, write_teacher  # noqa: PLC0415

    ds_dir = tiny_dataset(tmp_path, per_class=60, size=8)
    ds = load_dataset(ds_dir)
    # noisy prototypes: enough validation photos and mistakes (calibration.MIN_*) for a temperature to be fitted
    feats, logits = read_features_source(class_features(ds_dir, tmp_path / "feats", noise=1.5), ds)
    write_teacher(tmp_path / "t", ds, ArrayEncoder(feats, logits, tmp_path / "feats", ds.image_size), progress=False)
    out = run_script("calibration.py", "--teacher", str(tmp_path / "t"), "--dataset", str(ds_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    tt = load_teacher(tmp_path / "t", ds)
    y = np.asarray(ds["val"].labels)
    t = calibration.fit_temperature(np.asarray(tt.logits["val"]), y)
    assert t != 1.0 and figures["temperature"] == round(t, 4) and figures["recorded_temperature"] is None
    val = np.asarray(tt.logits["val"], np.float32)
    assert figures["val_raw_ece"] == round(metrics.expected_calibration_error(metrics.softmax(val), y), 4)
    assert figures["val_calibrated_nll"] < figures["val_raw_nll"]  # what the temperature is chosen to lower
    both = run_script("calibration.py", "--teacher", str(tmp_path / "t"), "--run", str(tmp_path), "--dataset",
                      str(ds_dir))
    assert_refused(both, 2, "not allowed with argument")
    record = json.loads((tmp_path / "t" / "teacher.json").read_text())
    record.setdefault("stage", {})["served"] = {"written": "yes"}  # not a record distill could read either
    (tmp_path / "t" / "teacher.json").write_text(json.dumps(record))
    assert_refused(run_script("calibration.py", "--teacher", str(tmp_path / "t"), "--dataset", str(ds_dir)), 1,
                   "stage.served")
