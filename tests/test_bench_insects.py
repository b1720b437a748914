"""benchmarks/insects.py: its split (preprocess's stratified, seeded 70/15/15 on a ROOT/<class>/ folder), the
--quick choice of photos, the JSON it prints and what it refuses before any stage runs, on tiny synthetic photos;
the benchmark itself needs the insect photos and an hour or more of training (one end-to-end --quick run is marked
slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from bench_helpers import BENCHMARKS, assert_refused, load_benchmark, run_script
from PIL import Image

from leaflens.pipeline.selection import Budget, Candidate, choose

BENCH = BENCHMARKS / "insects.py"
CLASSES = ("ants", "snail", "weevil")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("insects.py")


def write_photos(root: Path, per_class: int, size: int = 40, seed: int = 0) -> Path:
    """``root/<class>/NN.png``: distinct textured photos (seeded noise around a colour per photo)."""
    rng = np.random.default_rng(seed)
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            img = rng.normal(rng.uniform(40, 215, 3), 40, (size, size, 3))
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / c / f"{i:02d}.png")
    return root


# ---- the --quick choice
def test_subset_source_is_stratified_and_deterministic(bench, tmp_path):
    src = write_photos(tmp_path / "photos", per_class=10, size=8)
    a = bench.subset_source(src, tmp_path / "a", per_class=4, seed=0)
    b = bench.subset_source(src, tmp_path / "b", per_class=4, seed=0)
    c = bench.subset_source(src, tmp_path / "c", per_class=4, seed=1)

    def listing(root: Path) -> dict[str, list[str]]:
        return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(root.iterdir())}

    assert {k: len(v) for k, v in listing(a).items()} == {c_: 4 for c_ in CLASSES}
    assert listing(a) == listing(b)
    assert listing(a) != listing(c)
    link = next((a / "ants").iterdir())
    assert link.is_symlink() and link.resolve().parent == (src / "ants").resolve()
    whole = bench.subset_source(src, tmp_path / "a", per_class=50, seed=0)  # rebuilt; a class smaller: all of it
    assert {k: len(v) for k, v in listing(whole).items()} == {c_: 10 for c_ in CLASSES}


# ---- the split the benchmark trains and tests on
def test_split_is_stratified_deterministic_and_disjoint(bench, tmp_path):
    src = write_photos(tmp_path / "photos", per_class=20)
    bench.preprocess(src, tmp_path / "ds1", 32, 0, progress=False)
    bench.preprocess(src, tmp_path / "ds2", 32, 0, progress=False)
    bench.preprocess(src, tmp_path / "ds3", 32, 1, progress=False)
    s1, s2, s3 = (bench.dataset_splits(tmp_path / d) for d in ("ds1", "ds2", "ds3"))
    assert s1 == s2  # same photos, same seed: the same split
    assert s1 != s3  # another seed: another split
    for c in CLASSES:
        files = {split: set(s1[split][c]) for split in ("train", "val", "test")}
        assert [len(files[s]) for s in ("train", "val", "test")] == [14, 3, 3]  # 70/15/15 of 20, per class
        assert not (files["train"] & files["val"] or files["train"] & files["test"] or files["val"] & files["test"])
        assert {Path(f).name for s in files.values() for f in s} == {f"{i:02d}.png" for i in range(20)}


def test_made_in_records_a_stage_only_when_it_did_work(bench, tmp_path):
    marker = tmp_path / "out" / "done.json"

    def work() -> None:
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(str(time.time_ns()))
        time.sleep(0.05)

    assert bench.made_in(tmp_path, "never", marker, lambda: None) is None  # nothing made, nothing recorded
    took = bench.made_in(tmp_path, "teacher", marker, work)
    assert took is not None and took >= 0.0
    assert bench.made_in(tmp_path, "teacher", marker, lambda: time.sleep(0.2)) == took  # reused: the old figure
    assert json.loads((tmp_path / "walls.json").read_text()) == {"teacher": took}


# ---- the JSON
def report(scratch: float, distilled: float, teacher_val: float | None, test: dict[str, float]) -> dict:
    """A distill report.json as the benchmark reads it, its selection made by the pipeline's own rule."""
    cands = [Candidate("distilled", "student", distilled, test["distilled"], 391_980, 1.2),
             Candidate("scratch", "student", scratch, test["scratch"], 391_980, 1.2)]
    if teacher_val is not None:
        cands.append(Candidate("teacher", "teacher", teacher_val, test["teacher"], 3_386_380, 12.0))
    sel = choose(cands, Budget())
    return {"winner": sel.kept, "test_accuracy": test[sel.kept], "selection": sel.to_dict(),
            "best_student": "distilled" if distilled >= scratch else "scratch",
            "variants": {"distilled": {"val_accuracy": distilled, "test_accuracy": test["distilled"]},
                         "scratch": {"val_accuracy": scratch, "test_accuracy": test["scratch"]}}}


def test_a_family_run_reports_its_best_members_students(bench):
    """With ``--family s,l`` the variants are "s/..." and "l/...": the row holds the best member's pair."""
    cands = [Candidate(f"{m}/{v}", "student", val, val - 0.01, params, ms)
             for m, params, ms in (("s", 100_000, 0.8), ("l", 800_000, 2.0))
             for v, val in (("distilled", 0.70 if m == "l" else 0.50), ("scratch", 0.60 if m == "l" else 0.55))]
    sel = choose(cands, Budget())
    rep = {"winner": sel.kept, "test_accuracy": 0.69, "selection": sel.to_dict(), "best_student": "l/distilled",
           "variants": {c.name: {"val_accuracy": c.val_accuracy, "test_accuracy": c.test_accuracy} for c in cands}}
    row = bench.student_row(rep)
    assert (row["distilled"], row["scratch"], row["distilled_val"]) == (0.69, 0.59, 0.70)
    assert (row["kept"], row["params"], row["ms"]) == ("l/distilled", 800_000, 2.0)


def test_a_larger_student_trained_because_the_teacher_led_is_reported_apart(bench):
    """``model.escalate``: the size's row keeps its own student; the larger one is listed on its own and counts
    for the best-student target."""
    cands = [Candidate(n, "student", val, test, params, ms) for n, val, test, params, ms in (
        ("distilled", 0.56, 0.50, 280_000, 0.5), ("scratch", 0.55, 0.49, 280_000, 0.5),
        ("lite16@96/distilled", 0.87, 0.85, 3_000_000, 4.0), ("lite16@96/scratch", 0.80, 0.79, 3_000_000, 4.0))]
    cands.append(Candidate("teacher", "teacher", 0.88, 0.86, 3_386_380, 12.0))
    sel = choose(cands, Budget())
    rep = {"winner": sel.kept, "test_accuracy": 0.85, "selection": sel.to_dict(), "best_student": "lite16@96/distilled",
           "variants": {c.name: {"val_accuracy": c.val_accuracy, "test_accuracy": c.test_accuracy}
                        for c in cands if c.kind == "student"},
           "escalation": {"teacher_val_accuracy": 0.88, "margin": 0.02,
                          "steps": [{"member": "lite16@96", "trained": True}]}}
    row = bench.student_row(rep)
    assert (row["distilled"], row["scratch"], row["params"]) == (0.50, 0.49, 280_000)  # the size's own student
    assert row["kept"] == "lite16@96/distilled"  # within 2 points of the teacher on val: the student is kept
    big = row["escalated"]["lite16@96"]
    assert (big["distilled"], big["scratch"], big["params"], big["ms"]) == (0.85, 0.79, 3_000_000, 4.0)
    out = bench.summary(0.86, {64: row}, default_size=64, wall_s=1.0)
    assert out["distilled_acc_64"] == 0.50 and out["escalated"]["lite16@96"]["distilled"] == 0.85
    assert out["best_student_acc"] == 0.85 and out["target_best_student"] is True and out["target_kept"] is True
    json.dumps(out)
    plain = bench.summary(0.86, {64: {**row, "escalated": {}}}, default_size=64, wall_s=1.0)
    assert "escalated" not in plain and plain["target_best_student"] is False  # 0.50 is 36 points short


def test_summary_keys_kept_model_and_targets(bench):
    teacher = 0.80
    rows = {64: bench.student_row(report(0.40, 0.45, 0.80, {"scratch": 0.41, "distilled": 0.44, "teacher": 0.80})),
            96: bench.student_row(report(0.60, 0.79, 0.80, {"scratch": 0.62, "distilled": 0.79, "teacher": 0.80})),
            128: bench.student_row(report(0.70, 0.72, None, {"scratch": 0.71, "distilled": 0.70}))}
    out = bench.summary(teacher, rows, default_size=64, wall_s=12.345)
    for key in ("teacher_acc", "kept_model", "kept_acc", "student_params", "wall_s",
                *(f"{k}_acc_{s}" for k in ("scratch", "distilled") for s in (64, 96, 128))):
        assert key in out, key
    assert out["scratch_acc_96"] == 0.62 and out["distilled_acc_128"] == 0.70
    assert (out["kept_model"], out["kept_acc"]) == ("teacher", 0.80)  # the default size's run: the teacher wins
    assert out["kept_model_96"] == "distilled"  # 79 % on val: within the 2-point margin of the teacher's 80 %
    assert out["kept_model_128"] == "distilled"  # no teacher candidate: the best student
    assert out["student_params"] == 391_980 and out["teacher_params"] == 3_386_380
    assert out["best_student_acc"] == 0.79 and out["target_best_student"] is True
    assert out["target_kept"] is False  # the 128 px run kept a 70 % student, 10 points under the teacher
    assert out["wall_s"] == 12.3
    json.dumps(out)  # printable as the last line

    out = bench.summary(teacher, {96: rows[96]}, default_size=64, wall_s=1.0)
    assert out["kept_model"] is None and out["kept_acc"] is None  # the default size was not run
    assert out["target_kept"] is True
    with pytest.raises(ValueError, match="at least one"):
        bench.summary(teacher, {}, default_size=64, wall_s=1.0)


# ---- refusals before any stage runs, and the stages' failures
def test_a_bad_set_is_a_usage_error_before_anything_is_written(tmp_path):
    src = write_photos(tmp_path / "photos", per_class=3, size=8)
    for bad in ("bogus", "train.bogus=1"):
        out = run_script("insects.py", "--data", str(src), "--work", str(tmp_path / "w"), "--quick", "--set", bad)
        assert_refused(out, 2, "--set", bad)
    assert not (tmp_path / "w").exists()


def test_an_already_split_folder_is_refused_before_anything_is_written(tmp_path):
    for split in ("train", "val", "test"):  # the iBeans layout: <split>/<class>/ photos
        write_photos(tmp_path / "ibeans" / split, per_class=1, size=8)
    out = run_script("insects.py", "--data", str(tmp_path / "ibeans"), "--work", str(tmp_path / "w"))
    assert_refused(out, 1, "insects.py:", str(tmp_path / "ibeans"), "is not a folder of <class>/ photo folders")
    assert not (tmp_path / "w").exists()


def test_a_failed_stage_is_named_after_insects_py(tmp_path):
    src = write_photos(tmp_path / "photos", per_class=1, size=40)  # one photo a class: preprocess cannot split it
    out = run_script("insects.py", "--data", str(src), "--work", str(tmp_path / "w"), "--sizes", "8",
                     "--store-size", "8", "--quiet")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("insects.py: `leaflens preprocess --src") and "failed" in last, last


def test_the_quick_recipe_warms_up_less_than_it_trains(bench):
    from leaflens.pipeline.config import load_config

    cfg = load_config(None, list(bench.QUICK_SETS))
    assert cfg.teacher.epochs == bench.QUICK_TEACHER_EPOCHS and cfg.train.epochs == bench.QUICK_EPOCHS
    assert cfg.teacher.warmup_epochs < cfg.teacher.epochs and cfg.train.warmup_epochs < cfg.train.epochs


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    """The whole path on 3 tiny classes: preprocess, teacher, distill at two sizes, the JSON last line."""
    src = write_photos(tmp_path / "photos", per_class=10, size=48)
    cmd = [sys.executable, str(BENCH), "--data", str(src), "--sizes", "32,48", "--store-size", "64",
           "--work", str(tmp_path / "w"), "--quick", "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warmup_epochs" not in done.stderr  # the smoke recipe's own settings draw no warning
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"scratch_acc_32", "distilled_acc_48", "kept_model", "kept_acc", "teacher_acc"} <= set(out)
    assert out["quick"] is True and out["kept_model"] is None  # 64 px (the default) was not among the sizes
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900)  # every stage reused
    assert again.returncode == 0 and "reusing" in again.stdout
    rerun = json.loads(again.stdout.strip().splitlines()[-1])
    assert rerun["scratch_acc_32"] == out["scratch_acc_32"]
    assert rerun["stage_wall_s"] == out["stage_wall_s"]  # what each stage cost when it was made
