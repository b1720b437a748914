"""benchmarks/eval_crop.py: the validation rule that chooses a ratio, which checkpoints of a run count as
students, and its one-line refusals of a missing run or dataset; the figures themselves need trained runs
(README, "What is measured")."""

from __future__ import annotations

import pytest
from bench_helpers import assert_refused, load_benchmark, run_script


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("eval_crop.py")


def test_the_best_validation_ratio_is_chosen_ties_to_the_larger(bench):
    assert bench.chosen_ratio({1.0: 0.90, 0.875: 0.92, 0.75: 0.91}) == 0.875
    assert bench.chosen_ratio({1.0: 0.92, 0.875: 0.92, 0.75: 0.90}) == 1.0
    assert bench.chosen_ratio({1.0: 0.80, 0.875: 0.85, 0.75: 0.85}) == 0.875


def test_students_are_the_variant_checkpoints_not_the_kept_copy(bench, tmp_path):
    for rel in ("best.npz", "distilled/best.npz", "scratch/best.npz", "lite16@128/distilled/best.npz",
                "distilled/last.npz"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    names = [p.relative_to(tmp_path).as_posix() for p in bench.student_dirs(tmp_path)]
    assert names == ["distilled", "lite16@128/distilled", "scratch"]


def test_a_missing_run_or_dataset_is_one_line_before_the_table(tmp_path):
    out = run_script("eval_crop.py", "--run", "/nonexistent", "/nonexistent")
    assert_refused(out, 1, "eval_crop.py:", "/nonexistent")
    assert out.stdout == ""  # no table header before the failure
    (tmp_path / "run" / "distilled").mkdir(parents=True)
    (tmp_path / "run" / "distilled" / "best.npz").write_bytes(b"")
    out = run_script("eval_crop.py", "--run", str(tmp_path / "run"), str(tmp_path / "dataset"))
    assert_refused(out, 1, "eval_crop.py:", str(tmp_path / "dataset"))
    assert out.stdout == ""
    (tmp_path / "empty").mkdir()
    out = run_script("eval_crop.py", "--run", str(tmp_path / "empty"), str(tmp_path / "dataset"))
    assert_refused(out, 1, "no trained student")
