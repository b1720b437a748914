"""The distill stage end to end on a tiny dataset: both variants, winner, reports, resume, refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import class_features, crash_after_checkpoints, tiny_dataset

from leaflens.data_prep.manifest import load_dataset
from leaflens.engine.checkpoint import CheckpointError
from leaflens.pipeline.cli import main as cli
from leaflens.pipeline.config import load_config
from leaflens.pipeline.distill import run_distill
from leaflens.pipeline.runs import load_model
from leaflens.pipeline.teachers.artefact import TeacherError, load_teacher
from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source, write_teacher


def _cfg(epochs=4, **extra):
    sets = [f"train.epochs={epochs}", "train.min_steps=0",
            "train.batch_size=8", "model.widths=[8, 16]", "train.warmup_epochs=1",
            "train.lr=0.01"] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, sets)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    ds_dir = tiny_dataset(tmp, per_class=14, size=16, unlabeled=6)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(class_features(ds_dir, tmp / "feats"), ds)
    write_teacher(tmp / "teacher", ds, ArrayEncoder(feats, logits, tmp / "feats", ds.image_size), progress=False)
    return tmp, ds_dir


def test_distill_writes_run_with_both_variants(tiny):
    tmp, ds_dir = tiny
    out = tmp / "run"
    report = run_distill(ds_dir, tmp / "teacher", out, _cfg(), progress=False)
    assert set(report["variants"]) == {"distilled", "scratch"}
    assert report["winner"] in report["variants"]
    from importlib.metadata import version

    assert report["leaflens_version"] == version("leaflens")
    for key in ("test_accuracy", "val_accuracy", "params", "train_seconds"):
        assert report[key] is not None
    # 4 epochs on 6 validation photos may or may not be told apart from guessing (CI's BLAS once got 4 of 6):
    # whichever it is, the report's flag and warning follow the kept model's own validation accuracy
    from leaflens.pipeline.chance import chance_warning  # noqa: PLC0415

    said = chance_warning(report["val_accuracy"], load_dataset(ds_dir)["val"].labels)
    assert report["no_better_than_chance"] is (said is not None)
    from leaflens.pipeline.distill import few_validation_photos  # noqa: PLC0415

    few = few_validation_photos(len(load_dataset(ds_dir)["val"]))  # 6 photos: too few, and the report says so
    assert few is not None and report["warnings"] == ([] if said is None else [said]) + [few]
    assert f"**Warning:** {few}." in (out / "report.md").read_text(encoding="utf-8")
    for name in ("best.npz", "report.json", "report.md", "curves.png", "confusion.png", "feature_maps.png",
                 "config.toml", "distilled/metrics.jsonl", "scratch/metrics.jsonl"):
        assert (out / name).exists(), name
    assert not (tmp / "run.partial").exists()
    rows = [json.loads(line) for line in (out / "distilled" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {"train_feature", "train_ce", "train_kd", "val_acc", "lr"} <= set(rows[0])
    # both loss terms go down over the run
    assert rows[-1]["train_feature"] < rows[0]["train_feature"]
    assert rows[-1]["train_ce"] < rows[0]["train_ce"]
    model, info = load_model(out)
    assert list(info.dataset.classes) == load_dataset(ds_dir).classes
    assert info.metrics.uncertain_threshold is not None
    assert model.projection is None  # the training-only head is not part of the kept model
    # 6 validation photos are too few to fit a temperature on: the logits are served as they are, and said so
    assert report["calibration"]["temperature"] == info.metrics.temperature == 1.0
    assert "fewer than the 20 a temperature is fitted on" in report["calibration"]["not_fitted"]
    # stored at the input size: no centre crop could be tried, and the report says why
    assert "the photos are stored at 16 px" in report["variants"]["distilled"]["crop_choice"]["why"]
    md = (out / "report.md").read_text()
    assert "the probabilities are not calibrated (6 labelled validation photos, fewer than the 20" in md


def test_no_teacher_trains_scratch_only(tiny, monkeypatch):
    tmp, ds_dir = tiny
    monkeypatch.chdir(Path(ds_dir).parent)  # the dataset named as a person in its parent folder types it
    report = run_distill(Path(ds_dir).name, None, tmp / "scratch_only", _cfg(epochs=2), no_teacher=True,
                         progress=False)
    assert set(report["variants"]) == {"scratch"} and report["winner"] == "scratch"
    assert report["dataset"]["root"] == str(Path(ds_dir).resolve())  # usable from any folder, as run.json's


def test_the_student_trains_and_is_judged_at_model_input_size(tiny):
    """Stored at 16 px: input_size 8 trains and evaluates on 8 px images; 64 is never blown up beyond 16."""
    tmp, ds_dir = tiny
    report = run_distill(ds_dir, tmp / "teacher", tmp / "at8", _cfg(epochs=2, **{"model.input_size": 8}),
                         progress=False)
    assert report["dataset"]["image_size"] == 16 and report["dataset"]["input_size"] == 8
    _, info = load_model(tmp / "at8")
    assert info.dataset.input_size == 8
    # the kept weights score on val exactly what the report says when fed the 8 px images of the run's contract
    # (its centre crop, if validation chose one, then the area resize)
    from leaflens.data_prep.contract import contract_for_dataset  # noqa: PLC0415
    from leaflens.pipeline.train_student import predict_logits  # noqa: PLC0415

    model, _ = load_model(tmp / "at8")
    ds = load_dataset(ds_dir)
    small = contract_for_dataset(ds, 8, info.dataset.centre_crop).to_input_size(np.asarray(ds["val"].images))
    kept = small.copy()
    acc = float((predict_logits(model, small, ds.mean, ds.std, size=8).argmax(1)
                 == np.asarray(ds["val"].labels)).mean())
    assert acc == pytest.approx(report["val_accuracy"])
    np.testing.assert_array_equal(small, kept)  # the caller's images are not normalised in place
    big = run_distill(ds_dir, None, tmp / "at64", _cfg(epochs=1, **{"model.input_size": 64}), no_teacher=True,
                      progress=False)
    assert big["dataset"]["input_size"] == 16


def test_each_student_is_scored_at_every_centre_crop_and_judged_with_the_one_it_keeps(tiny):
    """Stored 16 px, input 8: every student is scored whole and at each crop on val; the run's figures, its
    record and the report are at the kept crop (leaflens.pipeline.centre_crop's rule); the whole photo's figure
    is the training loop's own."""
    from leaflens.data_prep.contract import contract_for_dataset  # noqa: PLC0415
    from leaflens.pipeline.report import metrics  # noqa: PLC0415
    from leaflens.pipeline.train_student import predict_logits  # noqa: PLC0415

    tmp, ds_dir = tiny
    ds = load_dataset(ds_dir)
    out = tmp / "crops"
    report = run_distill(ds_dir, tmp / "teacher", out, _cfg(epochs=3, **{"model.input_size": 8}), progress=False)
    for name, v in report["variants"].items():
        assert list(v["val_by_crop"]) == ["1", "0.9375", "0.875", "0.8125", "0.75"]
        kept = "1" if v["centre_crop"] is None else f"{v['centre_crop']:g}"
        assert v["val_by_crop"][kept] == v["val_accuracy"]
        choice = v["crop_choice"]
        assert choice["share"] == v["centre_crop"] and choice["why"]
        assert v["val_by_crop"][f"{choice['best']:g}"] == max(v["val_by_crop"][k] for k in list(v["val_by_crop"])[1:])
        assert (choice["share"] is not None) == (choice["gained"] > choice["lost"] and choice["p_value"] < 0.0125)
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert v["val_by_crop"]["1"] == max(r["val_acc"] for r in rows)  # the loop judged the whole photo
    _, info = load_model(out)
    best = report["variants"][report["best_student"]]
    assert info.dataset.centre_crop == best["centre_crop"] and info.metrics.val_accuracy == best["val_accuracy"]
    # the recorded contract reproduces the test figure
    model, _ = load_model(out)
    contract = contract_for_dataset(ds, 8, info.dataset.centre_crop)
    probs = metrics.softmax(predict_logits(model, contract.to_input_size(np.asarray(ds["test"].images)), ds.mean,
                                           ds.std, size=8))
    assert float(np.mean(probs.argmax(1) == np.asarray(ds["test"].labels))) == pytest.approx(best["test_accuracy"])
    assert "## Centre crop" in (out / "report.md").read_text()
    off = run_distill(ds_dir, tmp / "teacher", tmp / "no_crops",
                      _cfg(epochs=1, **{"model.input_size": 8, "distill.centre_crops": "[]"}), progress=False)
    assert all(v["centre_crop"] is None and list(v["val_by_crop"]) == ["1"] for v in off["variants"].values())
    assert load_model(tmp / "no_crops")[1].dataset.centre_crop is None
    assert "## Centre crop" not in (tmp / "no_crops" / "report.md").read_text()


def test_a_crop_validation_chose_is_the_run_contract(tiny, monkeypatch):
    """Whatever validation prefers, the kept student's record carries it, and its figures are those of the crop."""
    from leaflens.pipeline import centre_crop  # noqa: PLC0415

    tmp, ds_dir = tiny
    forced = centre_crop.CropChoice(0.75, 0.75, 1, 0, 0.5, 0.0125, "forced by the test")
    monkeypatch.setattr(centre_crop, "choose_crop", lambda correct, untried="": forced)
    report = run_distill(ds_dir, tmp / "teacher", tmp / "forced", _cfg(epochs=1, **{"model.input_size": 8}),
                         progress=False)
    assert all(v["centre_crop"] == 0.75 and v["val_accuracy"] == v["val_by_crop"]["0.75"]
               for v in report["variants"].values())
    assert load_model(tmp / "forced")[1].dataset.centre_crop == 0.75
    assert report["out_of_domain"]["fitted"]


def test_resume_gives_the_same_result_as_an_uninterrupted_run(tiny, monkeypatch):
    tmp, ds_dir = tiny
    cfg = _cfg(epochs=3, **{"distill.compare_scratch": "false"})
    full = run_distill(ds_dir, tmp / "teacher", tmp / "full", cfg, progress=False)

    crash_after_checkpoints(monkeypatch, 2)  # after epoch 2
    with pytest.raises(KeyboardInterrupt):
        run_distill(ds_dir, tmp / "teacher", tmp / "cut", cfg, progress=False)
    assert (tmp / "cut.partial" / "distilled" / "last.npz").exists()
    resumed = run_distill(ds_dir, tmp / "teacher", tmp / "cut", cfg, resume=True, progress=False)
    assert resumed["variants"]["distilled"]["val_accuracy"] == full["variants"]["distilled"]["val_accuracy"]
    assert resumed["test_accuracy"] == full["test_accuracy"]
    a = np.load(tmp / "full" / "best.npz")
    b = np.load(tmp / "cut" / "best.npz")
    for k in a.files:
        if k != "meta":
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_resume_refuses_a_run_begun_on_another_dataset_or_teacher(tmp_path, monkeypatch):
    """A dataset preprocessed again (same photo count, other photos) or a teacher made again since the run
    was interrupted: resuming would train its students on data their first epochs never saw."""
    import shutil  # noqa: PLC0415

    ds_dir = tiny_dataset(tmp_path / "a", per_class=10, size=16)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(class_features(ds_dir, tmp_path / "feats"), ds)
    write_teacher(tmp_path / "teacher", ds, ArrayEncoder(feats, logits, tmp_path / "feats", ds.image_size),
                  progress=False)
    cfg = _cfg(epochs=3, **{"distill.compare_scratch": "false"})
    crash_after_checkpoints(monkeypatch, 1)  # after epoch 1
    with pytest.raises(KeyboardInterrupt):
        run_distill(ds_dir, tmp_path / "teacher", tmp_path / "run", cfg, progress=False)
    partial = tmp_path / "run.partial"
    before = {p.relative_to(partial): p.read_bytes() for p in partial.rglob("*") if p.is_file()}
    assert (partial / "inputs.json").exists()

    # the teacher made again (same features, a new teacher.json)
    shutil.rmtree(tmp_path / "teacher")
    write_teacher(tmp_path / "teacher", ds, ArrayEncoder(feats, logits, tmp_path / "feats", ds.image_size),
                  progress=False, seconds=1.0)
    with pytest.raises(ValueError, match="began on another teacher"):
        run_distill(ds_dir, tmp_path / "teacher", tmp_path / "run", cfg, resume=True, progress=False)
    record = partial / "inputs.json"  # as if the run had begun with --no-teacher
    saved = record.read_bytes()
    record.write_text(json.dumps({**json.loads(saved), "teacher_json_sha256": None}))
    with pytest.raises(ValueError, match=r"began without a teacher \(--no-teacher\), and this one has one: resume it "
                                         r"with --no-teacher"):
        run_distill(ds_dir, tmp_path / "teacher", tmp_path / "run", cfg, resume=True, progress=False)
    record.write_bytes(saved)
    # the dataset preprocessed again from other photos of the same count
    other = tiny_dataset(tmp_path / "b", per_class=10, size=16)
    shutil.rmtree(ds_dir)
    shutil.copytree(other, ds_dir)
    with pytest.raises(ValueError, match="began on another dataset"):
        run_distill(ds_dir, None, tmp_path / "run", cfg, no_teacher=True, resume=True, progress=False)
    after = {p.relative_to(partial): p.read_bytes() for p in partial.rglob("*") if p.is_file()}
    assert after == before  # refused: nothing in the interrupted run changed


def test_a_resume_says_what_changed_and_a_refused_one_changes_nothing(tiny, monkeypatch, capsys):
    tmp, ds_dir = tiny
    cfg = _cfg(epochs=3, **{"distill.compare_scratch": "false"})
    crash_after_checkpoints(monkeypatch, 1)  # after epoch 1
    with pytest.raises(KeyboardInterrupt):
        run_distill(ds_dir, tmp / "teacher", tmp / "changed", cfg, progress=False)
    monkeypatch.undo()
    partial = tmp / "changed.partial"
    before = {p.relative_to(partial): p.read_bytes() for p in partial.rglob("*") if p.is_file()}
    for key, value, words in (("train.batch_size", "4", "train.batch_size"),
                              ("model.widths", "[4, 8]", "model.widths")):
        with pytest.raises((ValueError, CheckpointError), match=f"--resume: .*{key.split('.')[0]}") as refused:
            run_distill(ds_dir, tmp / "teacher", tmp / "changed", _cfg(epochs=3, **{
                "distill.compare_scratch": "false", key: value}), resume=True, progress=False)
        assert words in str(refused.value) and "run without --resume to start over" in str(refused.value)
        after = {p.relative_to(partial): p.read_bytes() for p in partial.rglob("*") if p.is_file()}
        assert after == before  # its config.toml says what its checkpoints were trained with, still
    with pytest.raises(ValueError, match=r"model.family"):  # other students: the progress would be dropped
        run_distill(ds_dir, tmp / "teacher", tmp / "changed", _cfg(epochs=3, **{
            "distill.compare_scratch": "false", "model.family": '["m", "s"]'}), resume=True, progress=False)
    with pytest.raises(ValueError, match="began with a teacher, and this one has none"):
        run_distill(ds_dir, None, tmp / "changed", cfg, no_teacher=True, resume=True, progress=False)
    assert {p.relative_to(partial): p.read_bytes() for p in partial.rglob("*") if p.is_file()} == before
    capsys.readouterr()
    report = run_distill(ds_dir, tmp / "teacher", tmp / "changed", _cfg(epochs=3, **{
        "distill.compare_scratch": "false", "distill.temperature": "2.0"}), resume=True, progress=False)
    assert "settings changed since the run began" in capsys.readouterr().err
    (change,) = report["resumed_with_changes"]
    assert change["changed"] == {"distill.temperature": [4.0, 2.0]}
    assert "**Resumed**" in (tmp / "changed" / "report.md").read_text() and "`distill.temperature`" in \
        (tmp / "changed" / "report.md").read_text()


def test_a_budget_no_model_fits_is_a_warning_in_the_report(tiny, capsys):
    tmp, ds_dir = tiny
    report = run_distill(ds_dir, None, tmp / "over", _cfg(epochs=1, **{"distill.max_params": "10"}),
                         no_teacher=True, progress=False)
    warning = [w for w in report["warnings"] if "no model fits the serving budget" in w]
    assert warning and "at most 10 parameters" in warning[0]
    assert "warning: no model fits the serving budget" in capsys.readouterr().err  # said with progress off too
    assert "no model fits the serving budget" in (tmp / "over" / "report.md").read_text()
    # the export is what gets shipped: it says so again (a user who set a hard limit may not read report.md)
    pytest.importorskip("onnxruntime")
    assert cli(["export", "--run", str(tmp / "over"), "--out", str(tmp / "over_export"), "--no-int8",
                "--speed-seconds", "0.05"]) == 0
    said = capsys.readouterr()
    out = said.out + said.err
    assert "although no model fitted its serving budget (" in out and "> max_params 10)" in out


def test_resume_never_replaces_a_finished_run(tiny, capsys):
    """--resume continues <out>.partial; asked of a finished run it changes nothing (a new run would replace it),
    and with nothing at all to continue it starts a new run, saying so."""
    tmp, ds_dir = tiny
    cfg = _cfg(epochs=1)
    out = tmp / "finished"
    run_distill(ds_dir, None, out, cfg, no_teacher=True, resume=True, progress=False)
    assert "no interrupted run" in capsys.readouterr().err and (out / "best.npz").exists()
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="is a finished run and there is no interrupted one"):
        run_distill(ds_dir, None, out, cfg, no_teacher=True, resume=True, progress=False)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not (tmp / "finished.partial").exists()


def test_a_folder_distill_did_not_write_is_never_replaced(tiny, tmp_path):
    """A mistyped --out (or its .partial) that names someone's folder: refused before training, untouched."""
    _, ds_dir = tiny
    theirs = tmp_path / "thesis"
    theirs.mkdir()
    (theirs / "chapter1.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not a leaflens run folder .no report.json in it.; refusing"):
        run_distill(ds_dir, None, theirs, _cfg(epochs=1), no_teacher=True, progress=False)
    assert [p.name for p in theirs.iterdir()] == ["chapter1.txt"]
    other = tmp_path / "run.partial"
    other.mkdir()
    (other / "notes.txt").write_text("mine too")
    with pytest.raises(ValueError, match="is not a leaflens run folder in progress"):
        run_distill(ds_dir, None, tmp_path / "run", _cfg(epochs=1), no_teacher=True, progress=False)
    assert (other / "notes.txt").read_text() == "mine too" and not (tmp_path / "run").exists()
    # a negative seed is a usage error naming the setting, before anything is written
    neg = ["distill", "--dataset", str(ds_dir), "--no-teacher", "--out", str(tmp_path / "neg"), "--seed", "-1"]
    assert cli(neg) == 2
    assert not (tmp_path / "neg").exists() and not (tmp_path / "neg.partial").exists()
    # a run inside the dataset folder would be deleted by the next `leaflens preprocess` of it: refused
    with pytest.raises(ValueError, match=r"is inside the dataset folder .*`leaflens preprocess` replaces whole"):
        run_distill(ds_dir, None, Path(ds_dir) / "run", _cfg(epochs=1), no_teacher=True, progress=False)
    assert not (Path(ds_dir) / "run").exists() and not (Path(ds_dir) / "run.partial").exists()


def test_features_of_another_dataset_are_refused(tiny, tmp_path):
    tmp, ds_dir = tiny
    other = tiny_dataset(tmp_path, per_class=12, size=16)
    with pytest.raises(TeacherError, match="another dataset"):
        load_teacher(tmp / "teacher", load_dataset(other))


def test_cli_distill_reports_and_refuses_unknown_settings(tiny, capsys):
    tmp, ds_dir = tiny
    code = cli(["distill", "--dataset", str(ds_dir), "--teacher", str(tmp / "teacher"), "--out", str(tmp / "cli"),
                "--set", "train.epochs=1", "--set", "train.min_steps=0", "--set", "model.widths=[8]", "--quiet"])
    assert code == 0
    out = capsys.readouterr()
    assert "kept:" in out.out and "kept:" not in out.err  # one line: what was kept, why, its figures
    assert "(best student on validation" in out.out and "val accuracy" in out.out
    assert "warning: only 6 validation photos" in out.err and "needs 76" in out.err  # said even with --quiet
    code = cli(["distill", "--dataset", str(ds_dir), "--out", str(tmp / "cli2"), "--set", "train.epoks=1"])
    assert code == 2
    assert "unknown key 'train.epoks'" in capsys.readouterr().err


def test_a_log_file_gets_the_epoch_lines_without_progress_bar_redraws(tiny, capsys):
    tmp, ds_dir = tiny  # capsys's stderr is no terminal, like `leaflens distill ... 2> log.txt`
    assert cli(["distill", "--dataset", str(ds_dir), "--teacher", str(tmp / "teacher"), "--out", str(tmp / "log"),
                "--set", "train.epochs=2", "--set", "train.min_steps=0", "--set", "model.widths=[8]"]) == 0
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert "distilled epoch 2/2: loss" in err and "scratch epoch 2/2: loss" in err
    assert "\r" not in err and "batch/s" not in err


def test_equal_val_accuracy_is_broken_by_the_lower_val_loss():
    from leaflens.pipeline.training import is_better_epoch  # noqa: PLC0415

    assert is_better_epoch(0.9, 0.5, 0.8, 0.1)        # higher accuracy wins whatever the loss
    assert not is_better_epoch(0.8, 0.1, 0.9, 0.5)
    assert is_better_epoch(0.9, 0.2, 0.9, 0.3)        # a tie: the lower loss wins
    assert not is_better_epoch(0.9, 0.3, 0.9, 0.3)    # an exact repeat is no improvement
    assert is_better_epoch(0.0, 1.0, -1.0, float("inf"))  # the first epoch always counts


def test_the_kept_epoch_is_the_best_by_accuracy_then_loss(tiny):
    tmp, ds_dir = tiny
    report = run_distill(ds_dir, None, tmp / "select", _cfg(epochs=6), no_teacher=True, progress=False)
    rows = [json.loads(line) for line in (tmp / "select" / "scratch" / "metrics.jsonl").read_text().splitlines()]
    best = min(rows, key=lambda r: (-r["val_acc"], r["val_loss"], r["epoch"]))
    assert report["variants"]["scratch"]["best_epoch"] == best["epoch"]
    ck = np.load(tmp / "select" / "scratch" / "best.npz")
    assert json.loads(str(ck["meta"]))["epoch"] == best["epoch"] - 1


def test_few_validation_photos_are_named_until_the_out_of_domain_check_has_enough():
    from leaflens.pipeline.distill import few_validation_photos

    assert few_validation_photos(76) is None and few_validation_photos(500) is None
    said = few_validation_photos(75)
    assert said is not None and said.startswith("only 75 validation photos") and "1.3 points" in said
    assert "needs 76" in few_validation_photos(1)


def test_a_run_on_photos_that_do_not_show_their_classes_says_its_model_learnt_nothing(tmp_path, capsys):
    """Every class folder holds the same kind of noise: whatever is kept, its validation accuracy cannot be
    told apart from guessing, and the run says so (stderr, report.json, report.md) instead of a quiet "kept"."""
    from PIL import Image  # noqa: PLC0415

    from leaflens.data_prep.ingest import IngestOptions, ingest  # noqa: PLC0415

    rng = np.random.default_rng(5)
    for cls in ("a", "b", "c"):
        (tmp_path / "photos" / cls).mkdir(parents=True)
        for i in range(20):
            Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "photos" / cls /
                                                                                    f"{i}.png")
    ingest(tmp_path / "photos", tmp_path / "ds", IngestOptions(size=16), workers=1, log=lambda s: None)
    report = run_distill(tmp_path / "ds", None, tmp_path / "run", _cfg(epochs=2), no_teacher=True, progress=False)
    assert report["no_better_than_chance"] is True
    assert report["warnings"] and "validation photos" in report["warnings"][0]
    assert "could not be told apart" not in report["warnings"][0]  # the page's words, not the run's
    assert "warning: the kept model is right on" in capsys.readouterr().err
    assert f"**Warning:** {report['warnings'][0]}." in (tmp_path / "run" / "report.md").read_text(encoding="utf-8")
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["no_better_than_chance"] is True


def test_a_run_interrupted_before_its_inputs_were_recorded_resumes_with_a_warning(tmp_path, capsys):
    from leaflens.pipeline.distill import check_run_inputs  # noqa: PLC0415

    check_run_inputs(tmp_path, {"dataset_manifest_sha256": "a", "teacher_json_sha256": None})
    assert "records no dataset or teacher" in capsys.readouterr().err
    (tmp_path / "inputs.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        check_run_inputs(tmp_path, {"dataset_manifest_sha256": "a", "teacher_json_sha256": None})


def test_a_second_run_on_the_same_out_is_refused_and_a_linked_out_is_written_through(tiny, tmp_path, capsys,
                                                                                      monkeypatch):
    """Two runs on one --out both exited 0 and left a run folder without best.npz (the second removed the
    first's work in progress); --out a symbolic link became a real folder beside a stale link; an interrupted
    run was discarded by a run without --resume without a word."""
    from leaflens.files import OutputBusy, output_lock

    _, ds_dir = tiny
    busy = tmp_path / "busy"
    with output_lock(busy, "teacher"):  # whoever holds it is named (a teacher given the run's folder)
        with pytest.raises(OutputBusy, match=rf"{busy} is being written by leaflens teacher "
                                             rf"\(process {os.getpid()}\)"):
            run_distill(ds_dir, None, busy, _cfg(epochs=1), no_teacher=True, progress=False)
        assert cli(["distill", "--dataset", str(ds_dir), "--no-teacher", "--out", str(busy), "--epochs", "1",
                    "--quiet"]) == 1
        assert "is being written by leaflens teacher" in capsys.readouterr().err
        assert not busy.exists() and not (tmp_path / "busy.partial").exists()
    run_distill(ds_dir, None, busy, _cfg(epochs=1), no_teacher=True, progress=False)  # free again
    assert (busy / "best.npz").is_file() and not (tmp_path / ".busy.lock").exists()  # no lock file stays

    real = tmp_path / "disk" / "run"
    real.parent.mkdir()
    link = tmp_path / "run"
    link.symlink_to(real)
    run_distill(ds_dir, None, link, _cfg(epochs=1), no_teacher=True, progress=False)
    assert link.is_symlink() and (real / "best.npz").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".run.old")]

    crash_after_checkpoints(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        run_distill(ds_dir, None, tmp_path / "cut", _cfg(epochs=2), no_teacher=True, progress=False)
    monkeypatch.undo()
    capsys.readouterr()
    run_distill(ds_dir, None, tmp_path / "cut", _cfg(epochs=1), no_teacher=True, progress=False)
    assert "the interrupted run in" in capsys.readouterr().err


def test_an_input_size_above_the_stored_size_is_said(tiny, tmp_path, capsys):
    """model.input_size=100000 trained at the stored 16 px without a word, while config.toml said 100000."""
    _, ds_dir = tiny
    report = run_distill(ds_dir, None, tmp_path / "run", _cfg(epochs=1, **{"model.input_size": 100000}),
                         no_teacher=True, progress=False)
    assert report["dataset"]["input_size"] == 16
    assert "input size 100000 is above the 16 px the dataset stores: it takes 16 px" in \
        capsys.readouterr().err
    run_distill(ds_dir, None, tmp_path / "fam", _cfg(epochs=1, **{"model.family": '["s@96"]'}), no_teacher=True,
                progress=False)  # a family member's own size: said as well
    assert "student s@96: input size 96 is above the 16 px" in capsys.readouterr().err


def test_an_exported_distilled_student_records_the_unlabelled_photos_it_learned_from(tiny, tmp_path):
    """The export dropped the unlabelled count for every run (it asked for a kept "distilled" that RunInfo never
    holds), so the Model tab never said them."""
    from leaflens.apps.model_card import ModelCard
    from leaflens.pipeline.export.stage import ExportOptions, export_run

    tmp, ds_dir = tiny
    run = tmp_path / "run"
    run_distill(ds_dir, tmp / "teacher", run, _cfg(epochs=1, **{"distill.compare_scratch": "false"}),
                progress=False)
    out = tmp_path / "export"
    export_run(ExportOptions(run=run, out=out, dataset=ds_dir, speed_seconds=0.05, threads=1, int8=False),
               log=lambda s: None)
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(out / "student.onnx")).metadata_props}
    card = ModelCard.from_metadata(meta, "student.onnx")
    ds = load_dataset(ds_dir)
    assert card.trained_on.unlabeled == len(ds["unlabeled"]) and card.trained_on.train == len(ds["train"])
    scratch = tmp_path / "scratch_run"
    run_distill(ds_dir, None, scratch, _cfg(epochs=1), no_teacher=True, progress=False)
    export_run(ExportOptions(run=scratch, out=tmp_path / "export2", dataset=ds_dir, speed_seconds=0.05, threads=1,
                             int8=False), log=lambda s: None)
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "export2" / "student.onnx")).metadata_props}
    assert ModelCard.from_metadata(meta, "student.onnx").trained_on.unlabeled is None  # never saw them


def test_a_fitted_temperature_is_what_the_threshold_figures_and_run_record_use(tiny, monkeypatch):
    """The tiny dataset has too few validation photos to fit a temperature: one is given. The "ambiguous"
    threshold is chosen on the calibrated probabilities (those export serves), best.npz records it, and
    report.md says the calibration error before and after."""
    from leaflens.pipeline import distill as distill_stage  # noqa: PLC0415
    from leaflens.pipeline.report import metrics  # noqa: PLC0415
    from leaflens.pipeline.train_student import predict_logits  # noqa: PLC0415

    monkeypatch.setattr(distill_stage.calibration, "fit_temperature", lambda logits, labels: 0.5)
    tmp, ds_dir = tiny
    out = tmp / "run_calibrated"
    report = run_distill(ds_dir, tmp / "teacher", out, _cfg(), progress=False)
    model, info = load_model(out)
    ds = load_dataset(ds_dir)
    assert info.metrics.temperature == 0.5 and report["calibration"]["temperature"] == 0.5
    logits = predict_logits(model, ds["val"].images, ds.mean, ds.std, 64, info.dataset.model_input_size,
                            info.dataset.centre_crop)
    y = np.asarray(ds["val"].labels)
    want = metrics.choose_uncertain_threshold(metrics.softmax(logits / 0.5), y)["threshold"]
    assert info.metrics.uncertain_threshold == pytest.approx(want)
    test_logits = predict_logits(model, ds["test"].images, ds.mean, ds.std, 64, info.dataset.model_input_size,
                                 info.dataset.centre_crop)
    y_test = np.asarray(ds["test"].labels)
    assert report["test"]["ece"] == pytest.approx(
        metrics.expected_calibration_error(metrics.softmax(test_logits / 0.5), y_test))
    assert report["calibration"]["test_ece_uncalibrated"] == pytest.approx(
        metrics.expected_calibration_error(metrics.softmax(test_logits), y_test))
    assert "with the probabilities calibrated on validation (logits / 0.500)" in (out / "report.md").read_text()


def test_a_resume_says_it_continues(tiny, monkeypatch, capsys):
    """teacher --resume said "continuing the interrupted training"; distill --resume said nothing."""
    tmp, ds_dir = tiny
    cfg = _cfg(epochs=2, **{"distill.compare_scratch": "false"})
    crash_after_checkpoints(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        run_distill(ds_dir, tmp / "teacher", tmp / "said", cfg, progress=False)
    monkeypatch.undo()
    capsys.readouterr()
    run_distill(ds_dir, tmp / "teacher", tmp / "said", cfg, resume=True, progress=True)
    assert f"distill: continuing the interrupted run in {tmp / 'said.partial'}" in capsys.readouterr().err
