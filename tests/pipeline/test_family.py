"""The student family (pipeline/models/family.py): members, the choice among them, export and resume."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from pipeline_helpers import class_features, tiny_dataset

from leaflens.data_prep.manifest import load_dataset
from leaflens.pipeline.cli import main as cli
from leaflens.pipeline.config import ConfigError, load_config
from leaflens.pipeline.distill import run_distill
from leaflens.pipeline.models.family import members
from leaflens.pipeline.models.student import StudentSpec
from leaflens.pipeline.runs import load_model
from leaflens.pipeline.selection import Budget, Candidate, choose
from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source, write_teacher


def _cfg(epochs=2, family=None, **extra):
    sets = [f"train.epochs={epochs}", "train.min_steps=0",
            "train.batch_size=8", "model.widths=[8, 16]", "train.warmup_epochs=1",
            "train.lr=0.01"] + [f"{k}={v}" for k, v in extra.items()]
    if family is not None:
        sets.append(f"model.family={json.dumps(family)}")
    return load_config(None, sets)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("family")
    ds_dir = tiny_dataset(tmp, per_class=14, size=16, unlabeled=6)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(class_features(ds_dir, tmp / "feats"), ds)
    write_teacher(tmp / "teacher", ds, ArrayEncoder(feats, logits, tmp / "feats", ds.image_size), progress=False)
    return tmp, ds_dir


def _params(cfg, name, num_classes=3):
    member = next(m for m in members(cfg.model) if m.name == name)
    return StudentSpec.from_recipe(member.model, num_classes).build(np.random.default_rng(0)).num_parameters()


def test_the_default_family_is_the_pretrained_student_and_m_is_the_recipes_own():
    cfg = load_config()
    (only,) = members(cfg.model)
    assert cfg.model.family == ("lite8",) and only.name == "lite8"
    assert (only.model.block, only.model.trunk_blocks, only.model.input_size) == ("lite0", 8, cfg.model.input_size)
    (m,) = members(load_config(None, ['model.family=["m"]']).model)
    assert m.model == dataclasses.replace(cfg.model, family=("m",))
    assert "block" not in StudentSpec.from_recipe(m.model, 5).to_dict()  # checkpoints as before families


def test_members_scale_the_recipes_widths_and_set_block_and_input_size():
    cfg = load_config(None, ['model.family=["s", "m", "l", "m-ds", "s@96"]'])
    got = {m.name: (m.model.widths, m.model.block, m.model.input_size) for m in members(cfg.model)}
    assert got == {"s": ((16, 32, 64, 128), "conv", 64), "m": ((32, 64, 128, 256), "conv", 64),
                   "l": ((48, 96, 192, 384), "conv", 64), "m-ds": ((32, 64, 128, 256), "separable", 64),
                   "s@96": ((16, 32, 64, 128), "conv", 96)}
    sizes = {name: _params(cfg, name, 12) for name in got}
    assert sizes["s"] < sizes["m"] < sizes["l"] and sizes["m-ds"] < sizes["m"] / 5
    assert sizes["s@96"] == sizes["s"]
    assert members(cfg.model)[3].describe() == "32-64-128-256, 64 px, separable"


@pytest.mark.parametrize("family, message", [
    (["m", "xl"], "family: unknown member 'xl'"), (["m@4"], "unknown member 'm@4'"), ([], "at least one member"),
    (["s", "s"], "member 's' is listed twice")])
def test_bad_family_names_are_refused_naming_the_field(family, message):
    with pytest.raises(ConfigError, match=message) as exc:
        load_config(None, [f"model.family={json.dumps(family)}"])
    assert "model" in str(exc.value)


def test_cli_family_option_refuses_an_unknown_member(tiny, capsys):
    tmp, ds_dir = tiny
    code = cli(["distill", "--dataset", str(ds_dir), "--no-teacher", "--out", str(tmp / "bad"), "--family", "s,xs"])
    err = capsys.readouterr().err
    assert code == 2 and "model: family: unknown member 'xs'" in err and "s, m or l" in err
    assert not (tmp / "bad.partial").exists()


def _student(name, val, params, ms):
    return Candidate(name, "student", val, None, params, ms, member=name.split("/")[0])


def test_the_better_member_on_val_wins_and_ties_go_to_the_smaller_then_faster():
    cands = [_student("s/scratch", 0.80, 1000, 0.2), _student("m/scratch", 0.85, 4000, 0.5)]
    assert choose(cands, Budget()).kept == "m/scratch"
    cands[0] = _student("s/scratch", 0.85, 1000, 0.2)
    sel = choose(cands, Budget())
    assert sel.kept == "s/scratch" and sel.best_student == "s/scratch"
    assert "ties on validation with the kept student, which is smaller" in sel.candidates[1].why
    # same size (another input size): the faster one
    sel = choose([_student("m@96/scratch", 0.85, 4000, 0.9), _student("m/scratch", 0.85, 4000, 0.5)], Budget())
    assert sel.kept == "m/scratch" and "which is faster" in sel.candidates[0].why
    # within one member, distillation still has to beat scratch
    assert choose([_student("m/distilled", 0.85, 4000, 0.5), _student("m/scratch", 0.85, 4000, 0.5)],
                  Budget()).kept == "m/scratch"


def test_the_budget_excludes_a_member_even_when_it_is_better():
    cands = [_student("s/scratch", 0.80, 1000, 0.2), _student("m/scratch", 0.90, 4000, 0.5)]
    sel = choose(cands, Budget(max_params=2000))
    assert sel.kept == "s/scratch" and sel.within_budget
    assert "4,000 parameters > max_params 2,000" in sel.candidates[1].why
    assert choose(cands, Budget(max_ms=0.3)).kept == "s/scratch"


def test_a_two_member_run_trains_both_and_keeps_the_best_on_val(tiny):
    tmp, ds_dir = tiny
    out = tmp / "two"
    report = run_distill(ds_dir, tmp / "teacher", out, _cfg(family=["s", "m"]), progress=False)
    names = {"s/distilled", "s/scratch", "m/distilled", "m/scratch"}
    assert set(report["variants"]) == names
    for name in names:
        assert (out / name / "best.npz").exists() and (out / name / "metrics.jsonl").exists()
    rows = {c["name"]: c for c in report["selection"]["candidates"]}
    assert set(rows) == names
    assert rows["s/scratch"]["params"] == rows["s/distilled"]["params"] < rows["m/scratch"]["params"]
    assert rows["s/scratch"]["architecture"] == "4-8, 16 px" and rows["m/scratch"]["member"] == "m"
    for name, row in rows.items():
        assert row["val_accuracy"] == report["variants"][name]["val_accuracy"]
    best = max(rows.values(), key=lambda c: (c["val_accuracy"], -c["params"], -c["ms_per_photo"],
                                             c["name"].endswith("scratch")))
    assert report["winner"] == report["best_student"] == best["name"] and rows[best["name"]]["kept"]
    # best.npz is the kept student: its architecture and its weights
    model, info = load_model(out)
    kept_member = best["name"].split("/")[0]
    assert info.model_config.widths == {"s": (4, 8), "m": (8, 16)}[kept_member]
    assert model.num_parameters() == best["params"] == report["params"]
    a, b = np.load(out / "best.npz"), np.load(out / best["name"] / "best.npz")
    for k in a.files:
        if k.startswith("model/"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    md = (out / "report.md").read_text()
    assert "| network |" in md and "4-8, 16 px" in md and f"family member {kept_member}" in md


def test_a_non_default_member_kept_under_the_budget_exports_and_serves(tiny, tmp_path):
    pytest.importorskip("onnxruntime")
    from leaflens.apps.predictor import Predictor  # noqa: PLC0415
    from leaflens.pipeline.export.stage import ExportOptions, export_run  # noqa: PLC0415
    from leaflens.pipeline.train_student import predict_logits  # noqa: PLC0415

    tmp, ds_dir = tiny
    cfg = _cfg(family=["s-ds@8", "m"], **{"distill.max_params": 0})
    budget = _params(cfg, "s-ds@8")
    assert budget < _params(cfg, "m")
    cfg = _cfg(family=["s-ds@8", "m"], **{"distill.max_params": budget})
    out = tmp / "small"
    report = run_distill(ds_dir, None, out, cfg, no_teacher=True, progress=False)
    assert report["winner"] == "s-ds@8/scratch" and report["dataset"]["input_size"] == 8
    m_row = next(c for c in report["selection"]["candidates"] if c["name"] == "m/scratch")
    assert not m_row["within_budget"] and "max_params" in m_row["why"]
    model, info = load_model(out)
    assert info.model_config.block == "separable" and info.dataset.input_size == 8
    export_run(ExportOptions(run=out, out=tmp_path / "export", dataset=ds_dir, int8=False, ood_branch=False,
                             speed_seconds=0.05, threads=1), log=lambda s: None)
    pred = Predictor(tmp_path / "export" / "student.onnx", intra_op_threads=1)
    assert pred.card.input_size == 8 and pred.card.params == model.num_parameters()
    ds = load_dataset(ds_dir)
    want = predict_logits(model, np.asarray(ds["test"].images), ds.mean, ds.std, size=8)  # the engine at 8 px
    np.testing.assert_allclose(pred.logits_arrays(np.asarray(ds["test"].images)), want, atol=1e-4)


def test_a_resumed_family_run_continues_where_it_stopped(tiny, monkeypatch):
    tmp, ds_dir = tiny
    cfg = _cfg(epochs=2, family=["s", "m"])
    full = run_distill(ds_dir, None, tmp / "fam_full", cfg, no_teacher=True, progress=False)

    import leaflens.pipeline.training as training

    saves: list[str] = []
    real = training.save_checkpoint

    def dying_save(path, *a, **k):
        real(path, *a, **k)
        if path.name == "last.npz":
            saves.append(path.parent.parent.name)
            if len(saves) == 3:  # s finished (2 epochs), m stopped after its first
                raise KeyboardInterrupt("simulated crash in the second member")

    monkeypatch.setattr(training, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run_distill(ds_dir, None, tmp / "fam_cut", cfg, no_teacher=True, progress=False)
    assert saves == ["s", "s", "m"]
    saves.clear()
    resumed = run_distill(ds_dir, None, tmp / "fam_cut", cfg, no_teacher=True, resume=True, progress=False)
    assert saves == ["m"]  # s was not trained again; m ran its one missing epoch
    for name in ("s/scratch", "m/scratch"):
        assert resumed["variants"][name]["val_accuracy"] == full["variants"][name]["val_accuracy"]
        assert resumed["variants"][name]["epochs_run"] == 2
    assert resumed["winner"] == full["winner"] and resumed["test_accuracy"] == full["test_accuracy"]
    a, b = np.load(tmp / "fam_full" / "best.npz"), np.load(tmp / "fam_cut" / "best.npz")
    for k in a.files:
        if k != "meta":
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
