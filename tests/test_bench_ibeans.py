"""benchmarks/ibeans.py end to end on a tiny iBeans-shaped folder (train/val/test/<class>/): its teachers are
written as `leaflens teacher` writes them, served teacher included, so its student runs can keep the teacher,
start from it or run it in the training loop. Needs the EfficientNet-Lite0 weights; marked slow (two teacher
fine-tunes, about a minute)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "data_prep"))

from dp_helpers import make_class_folders  # noqa: E402

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pretrained = pytest.importorskip("leaflens.pipeline.models.pretrained")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "ibeans.py"
PER_SPLIT = {"train": 8, "val": 4, "test": 4}


def write_ibeans(root: Path) -> Path:
    """``root/<split>/<class>/``: dp_helpers' three colour classes, distinct photos in every split."""
    for k, (split, n) in enumerate(PER_SPLIT.items()):
        make_class_folders(root / split, per_class=n, seed=k)
    return root


@pytest.mark.slow
def test_ibeans_benchmark_writes_served_teachers_and_runs_the_teacher_in_the_loop(tmp_path):
    try:
        pretrained.find_lite0_weights()
    except pretrained.WeightsNotFoundError as exc:
        pytest.skip(f"EfficientNet-Lite0 weights not installed: {exc}")
    data, work = write_ibeans(tmp_path / "ibeans"), tmp_path / "work"
    # the teacher in the loop needs the teacher's network (model.npz) beside its features: the run fails without it
    out = subprocess.run([sys.executable, str(BENCH), "--data", str(data), "--seeds", "1", "--epochs", "1",
                          "--teacher-epochs", "1", "--settings", "full", "--work", str(work),
                          "--set", "distill.teacher_online=true", "--set", "teacher.min_steps=0",
                          "--set", "train.min_steps=0"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(figures["kept_models"]) == {"full"} and len(figures["kept_models"]["full"]) == 1
    assert figures["kept_models"]["full"][0] in {"scratch", "distilled", "teacher"}
    assert 0.0 <= figures["distilled_acc"] <= 1.0 and 0.0 <= figures["teacher_finetuned_acc"] <= 1.0
    for name in ("full", "frac"):
        # the folder's name carries the teacher settings given (here teacher.min_steps=0)
        (folder,) = work.glob(f"teacher_{name}_e1_v1_s128*")
        served = json.loads((folder / "teacher.json").read_text())["stage"]["served"]
        assert served["written"], served
        assert (folder / "teacher.onnx").is_file() and (folder / "model.npz").is_file()
    report = json.loads((work / "run_full_0" / "report.json").read_text())
    assert report["teacher_online"]  # the distilled student learned from the teacher run on its own views
    assert report["selection"]["teacher_unavailable"] is None  # the served teacher was a candidate
    assert "teacher" in {row["name"] for row in report["selection"]["candidates"]}


def test_teacher_settings_on_the_command_line_change_the_fine_tuned_teachers_and_their_folders():
    from bench_helpers import load_benchmark

    bench = load_benchmark("ibeans.py")
    sets = ["train.ema=0.99", "teacher.ema=0.5"]
    assert bench.teacher_recipe(False, 3, sets).ema == 0.5 and bench.teacher_recipe(False, 3, sets).epochs == 3
    # a student setting leaves the teacher's recipe at its default
    assert bench.teacher_recipe(False, None, ["train.ema=0.5"]).ema == bench.teacher_recipe(False, None).ema != 0.5
    assert bench.teacher_tag(["train.ema=0.5"]) == ""  # the default teacher keeps its folder name
    assert bench.teacher_tag(sets).startswith("_") and bench.teacher_tag(sets) != bench.teacher_tag(
        ["teacher.ema=0.9"])


def test_a_bad_set_is_refused_before_any_stage_runs(tmp_path):
    from bench_helpers import assert_refused, run_script

    data, work = write_ibeans(tmp_path / "ibeans"), tmp_path / "work"
    for bad in ("bogus", "train.bogus=1", "teacher.bogus=1", "model.input_size=abc"):
        out = run_script("ibeans.py", "--data", str(data), "--work", str(work), "--set", bad, timeout=60)
        assert_refused(out, 2, "--set", bad)
    assert not work.exists()  # nothing preprocessed, no teacher trained
