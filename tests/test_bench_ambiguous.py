"""benchmarks/ambiguous_small_val.py: the resampling study of the "ambiguous" rule on small validation splits,
on made-up teacher logits (a teacher folder's logits_val.npy and a dataset's val_labels.npy)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from bench_helpers import load_benchmark


def write_case(root: Path, n: int = 90, k: int = 3, seed: int = 0) -> tuple[Path, Path]:
    """``root/t/logits_val.npy`` and ``root/ds/val_labels.npy``: about 80 % right and sure, the mistakes unsure."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    logits = rng.normal(0, 0.3, (n, k))
    right = rng.random(n) < 0.8
    logits[np.arange(n)[right], labels[right]] += 2.5
    logits[np.arange(n)[~right], (labels[~right] + 1) % k] += 0.4
    teacher, ds = root / "t", root / "ds"
    teacher.mkdir(parents=True)
    ds.mkdir()
    np.save(teacher / "logits_val.npy", logits.astype(np.float32))
    np.save(ds / "val_labels.npy", labels)
    return teacher, ds


def test_the_rule_of_today_flags_where_the_old_one_flagged_none(tmp_path, capsys):
    bench = load_benchmark("ambiguous_small_val.py")
    teacher, ds = write_case(tmp_path)
    assert bench.main(["--case", str(teacher), str(ds), "--sizes", "36", "--draws", "40"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    figures = out[str(teacher)]["36"]
    before, now = figures["before (none under one photo)"], figures["now (at least one)"]
    assert now["unanswered"] > before["unanswered"] and now["mistakes_caught"] > before["mistakes_caught"]
    assert now["flagged_wrong"] > 1 - out[str(teacher)]["accuracy"]  # what it flags is wrong more often
    assert 0 < figures["95 % target"]["unanswered"] <= 1


def test_cases_with_the_same_folder_name_are_kept_apart_and_skipped_sizes_said(tmp_path, capsys):
    bench = load_benchmark("ambiguous_small_val.py")
    (t1, d1), (t2, d2) = write_case(tmp_path / "a", n=60), write_case(tmp_path / "b", n=40, seed=1)
    assert t1.name == t2.name
    assert bench.main(["--case", str(t1), str(d1), "--case", str(t2), str(d2), "--sizes", "24,36",
                       "--draws", "5"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert set(out) == {str(t1), str(t2)}
    assert out[str(t1)]["val_photos"] == 60 and out[str(t2)]["val_photos"] == 40
    assert {"24", "36"} <= set(out[str(t1)]) and "24" in out[str(t2)] and "36" not in out[str(t2)]
    # 36 of 40 photos would leave 4 to measure on: skipped, and said
    assert f"{t2}: sizes 36 skipped" in captured.err and str(t1) not in captured.err
