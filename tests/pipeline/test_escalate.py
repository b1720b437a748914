"""Larger students tried only while the teacher leads (``model.escalate``, pipeline/distill.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pipeline_helpers import class_features, crash_after_checkpoints, tiny_dataset

from leaflens.data_prep.manifest import load_dataset
from leaflens.engine.checkpoint import read_checkpoint_arrays
from leaflens.pipeline.config import ConfigError, load_config
from leaflens.pipeline.distill import run_distill
from leaflens.pipeline.models.family import members
from leaflens.pipeline.models.student import StudentSpec
from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source, write_teacher


def _cfg(escalate=("m",), margin=0.0, **extra):
    sets = ["train.epochs=2", "train.min_steps=0",
            "train.batch_size=8", "model.widths=[8, 16]", "train.warmup_epochs=1", "train.lr=0.01",
            'model.family=["s"]', f"model.escalate={json.dumps(list(escalate))}", f"distill.teacher_margin={margin}",
            *(f"{k}={v}" for k, v in extra.items())]
    return load_config(None, sets)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("escalate")
    ds_dir = tiny_dataset(tmp, per_class=14, size=16)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(class_features(ds_dir, tmp / "feats"), ds)
    write_teacher(tmp / "teacher", ds, ArrayEncoder(feats, logits, tmp / "feats", ds.image_size), progress=False)
    teacher_val = float(np.mean(logits["val"].argmax(1) == np.asarray(ds["val"].labels)))
    return tmp, ds_dir, teacher_val


def test_a_leading_teacher_gets_the_larger_student_trained_and_weighed(tiny):
    tmp, ds_dir, teacher_val = tiny
    out = tmp / "lead"
    report = run_distill(ds_dir, tmp / "teacher", out, _cfg(margin=0.0, **{"model.escalate_lr": 0.002}),
                         progress=False)
    # the larger student distilled only (the teacher leads), at escalate_lr; the others at train.lr (0.01)
    assert set(report["variants"]) == {"distilled", "scratch", "m/distilled"}
    for name in ("distilled", "m/distilled"):
        lrs = [json.loads(line)["lr"] for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        want = 0.002 if name.startswith("m/") else 0.01
        assert max(lrs) == pytest.approx(want, rel=1e-6), (name, lrs)
    assert (out / "m" / "distilled" / "best.npz").exists() and not (out / "m" / "scratch").exists()
    small_best = max(report["variants"][n]["val_accuracy"] for n in ("distilled", "scratch"))
    esc = report["escalation"]
    assert esc["teacher_val_accuracy"] == pytest.approx(teacher_val, abs=1e-4) and esc["margin"] == 0.0
    assert esc["lr"] == 0.002
    (step,) = esc["steps"]
    assert step["member"] == "m" and step["trained"]
    assert step["best_student_val"] == pytest.approx(small_best, abs=1e-4)
    assert step["teacher_lead"] == pytest.approx(teacher_val - small_best, abs=1e-4)
    rows = {c["name"]: c for c in report["selection"]["candidates"]}
    assert {"m/distilled", "distilled", "scratch"} <= set(rows)
    assert rows["m/distilled"]["params"] > rows["scratch"]["params"] and rows["m/distilled"]["member"] == "m"
    md = (out / "report.md").read_text()
    assert "Larger students (model.escalate)" in md and "- m: best student then" in md and "; trained" in md


def test_a_student_within_the_margin_stops_the_escalation(tiny):
    tmp, ds_dir, teacher_val = tiny
    report = run_distill(ds_dir, tmp / "teacher", tmp / "close", _cfg(escalate=("m", "l"), margin=1.0),
                         progress=False)
    assert set(report["variants"]) == {"distilled", "scratch"}  # neither m nor l trained
    (step,) = report["escalation"]["steps"]  # the first one not trained ends the escalation
    assert step["member"] == "m" and not step["trained"] and "within 100 points" in step["why"]
    assert not (tmp / "close" / "m").exists()


def test_a_member_over_max_params_is_skipped_and_the_next_one_tried(tiny):
    tmp, ds_dir, _ = tiny
    cfg = _cfg(escalate=("l", "m"))
    params = {m.name: StudentSpec.from_recipe(m.model, 3).build(np.random.default_rng(0)).num_parameters()
              for m in members(cfg.model, ("s", "m", "l"))}
    assert params["s"] < params["m"] < params["l"]
    cfg = _cfg(escalate=("l", "m"), **{"distill.max_params": params["m"], "distill.compare_scratch": "false"})
    report = run_distill(ds_dir, tmp / "teacher", tmp / "budget", cfg, progress=False)
    big, mid = report["escalation"]["steps"]
    assert big["member"] == "l" and not big["trained"] and f"{params['l']:,} parameters" in big["why"]
    assert mid["member"] == "m" and mid["trained"] and mid["params"] == params["m"]
    assert set(report["variants"]) == {"distilled", "m/distilled"}


def test_without_teacher_logits_nothing_is_escalated(tiny):
    tmp, ds_dir, _ = tiny
    report = run_distill(ds_dir, None, tmp / "alone", _cfg(), no_teacher=True, progress=False)
    assert "escalation" not in report and set(report["variants"]) == {"scratch"}


def test_a_run_stopped_in_the_larger_student_resumes_to_the_same_result(tiny, monkeypatch):
    tmp, ds_dir, _ = tiny
    cfg = _cfg(**{"distill.compare_scratch": "false"})
    full = run_distill(ds_dir, tmp / "teacher", tmp / "esc_full", cfg, progress=False)

    saves = crash_after_checkpoints(monkeypatch, 3)  # the small student finished (2 epochs), m after its first

    def students() -> list[str]:
        return [str(p.parent.relative_to(tmp / "esc_cut.partial")) for p in saves]

    with pytest.raises(KeyboardInterrupt):
        run_distill(ds_dir, tmp / "teacher", tmp / "esc_cut", cfg, progress=False)
    assert students() == ["distilled", "distilled", "m/distilled"]
    saves.clear()
    resumed = run_distill(ds_dir, tmp / "teacher", tmp / "esc_cut", cfg, resume=True, progress=False)
    assert students() == ["m/distilled"]  # the same decision from the small student's checkpoint; m's missing epoch
    assert resumed["escalation"] == full["escalation"]
    for name in ("distilled", "m/distilled"):
        assert resumed["variants"][name]["val_accuracy"] == full["variants"][name]["val_accuracy"]
    assert resumed["winner"] == full["winner"] and resumed["test_accuracy"] == full["test_accuracy"]


@pytest.mark.parametrize("family, escalate, message", [
    (["s"], ["xl"], "escalate: unknown member 'xl'"),
    (["s"], ["m", "m"], "escalate: member 'm' is listed twice"),
    (["s"], ["m"], "escalate_lr: 0 \\(train.lr\\) or a learning rate above 0, got -0.1"),
])
def test_bad_escalations_are_refused_naming_the_field(family, escalate, message):
    lr = ["model.escalate_lr=-0.1"] if "escalate_lr" in message else []
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"model.family={json.dumps(family)}", f"model.escalate={json.dumps(escalate)}", *lr])


def test_the_members_of_an_escalation_are_built_like_the_familys():
    cfg = load_config(None, ['model.family=["s"]', 'model.escalate=["lite12@96", "m-ds"]'])
    lite, ds = members(cfg.model, cfg.model.escalate)
    assert lite.model.block == "lite0" and lite.model.trunk_blocks == 12 and lite.model.input_size == 96
    assert ds.model.block == "separable" and lite.model.escalate == () and lite.model.family == ("lite12@96",)


def test_the_default_recipe_ships_the_teacher_without_trying_and_names_a_gentle_rate():
    cfg = load_config()
    assert cfg.model.family == ("lite8",) and cfg.model.escalate == ()
    assert cfg.model.escalate_lr == 0.001 < cfg.train.lr


def test_a_member_already_in_the_family_is_not_trained_twice(tiny):
    tmp, ds_dir, _ = tiny
    cfg = _cfg(escalate=("s", "m"), **{"distill.compare_scratch": "false"})  # family ["s"]
    report = run_distill(ds_dir, tmp / "teacher", tmp / "twice", cfg, progress=False)
    assert [s["member"] for s in report["escalation"]["steps"]] == ["m"]
    assert set(report["variants"]) == {"distilled", "m/distilled"}


def test_the_cli_escalate_option(tiny):
    from leaflens.pipeline.cli import main as cli  # noqa: PLC0415

    tmp, ds_dir, _ = tiny
    common = ["distill", "--dataset", str(ds_dir), "--teacher", str(tmp / "teacher"), "--family", "s", "--quiet",
              "--set", "train.epochs=1", "--set", "train.min_steps=0",
              "--set", "train.batch_size=8", "--set", "model.widths=[8, 16]",
              "--set", "distill.teacher_margin=0", "--set", "distill.compare_scratch=false"]
    assert cli([*common, "--out", str(tmp / "cli_m"), "--escalate", "m"]) == 0
    report = json.loads((tmp / "cli_m" / "report.json").read_text())
    assert report["config"]["model"]["escalate"] == ["m"] and set(report["variants"]) == {"distilled", "m/distilled"}
    assert cli([*common, "--out", str(tmp / "cli_none"), "--escalate", ""]) == 0
    report = json.loads((tmp / "cli_none" / "report.json").read_text())
    assert report["config"]["model"]["escalate"] == [] and "escalation" not in report


def test_the_escalation_weighs_the_students_as_they_would_be_kept(tiny, monkeypatch):
    """The best student's figure is the crop-aware one the selection weighs, not the training loop's whole-photo
    one: a student whose kept crop brings it within the margin stops the escalation."""
    import leaflens.pipeline.distill as distill  # noqa: PLC0415

    tmp, ds_dir, teacher_val = tiny
    real = distill._evaluate_variant  # noqa: SLF001
    seen: list[str] = []

    def as_kept(best_path, cfg, ds):
        out = real(best_path, cfg, ds)
        seen.append(best_path.parent.name)
        out["val_accuracy"] = teacher_val  # as if its centre crop made it the teacher's equal
        return out

    monkeypatch.setattr(distill, "_evaluate_variant", as_kept)
    report = run_distill(ds_dir, tmp / "teacher", tmp / "as_kept", _cfg(margin=0.01), progress=False)
    (step,) = report["escalation"]["steps"]
    assert not step["trained"] and step["best_student_val"] == pytest.approx(teacher_val, abs=1e-4)
    assert set(report["variants"]) == {"distilled", "scratch"} and sorted(seen) == ["distilled", "scratch"]


def test_freeze_bn_and_ema_are_recorded(tiny):
    """``train.freeze_bn`` concerns pretrained students only: with the conv family none is named, and report.md
    says so rather than claiming statistics were kept. ``train.ema`` is recorded with its decay, and each
    variant's best.npz holds the average its validation judged."""
    tmp, ds_dir, _ = tiny
    report = run_distill(ds_dir, tmp / "teacher", tmp / "freeze", _cfg(escalate=(), **{"train.freeze_bn": "true",
                                                                                        "train.ema": "0.9"}),
                         progress=False)
    assert report["freeze_bn"] == [] and report["config"]["train"]["ema"] == 0.9
    text = (tmp / "freeze" / "report.md").read_text()
    assert "no student is pretrained" in text and "(train.ema = 0.9)" in text
    for variant in ("distilled", "scratch"):
        _, arrays = read_checkpoint_arrays(tmp / "freeze" / variant / "last.npz")
        best = read_checkpoint_arrays(tmp / "freeze" / variant / "best.npz")[1]
        averaged = [k for k in arrays if k.startswith("ema/")]
        assert averaged and not any(k.startswith("ema/") for k in best)
    run_distill(ds_dir, tmp / "teacher", tmp / "plain", _cfg(escalate=()), progress=False)
    assert "train.ema" not in (tmp / "plain" / "report.md").read_text()
    assert not any(k.startswith("ema/") for k in read_checkpoint_arrays(tmp / "plain" / "distilled" / "last.npz")[1])
