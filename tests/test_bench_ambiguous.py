"""benchmarks/ambiguous_small_val.py: the resampling study of the "ambiguous" rule on small validation splits,
on made-up teacher logits (a teacher folder's logits_val.npy and a dataset's val_labels.npy)."""

from __future__ import annotations

import json

import numpy as np
from bench_helpers import load_benchmark


def test_the_rule_of_today_flags_where_the_old_one_flagged_none(tmp_path, capsys):
    bench = load_benchmark("ambiguous_small_val.py")
    rng = np.random.default_rng(0)
    n, k = 90, 3
    labels = rng.integers(0, k, n)
    logits = rng.normal(0, 0.3, (n, k))  # about 80 % right and sure; the mistakes unsure
    right = rng.random(n) < 0.8
    logits[np.arange(n)[right], labels[right]] += 2.5
    logits[np.arange(n)[~right], (labels[~right] + 1) % k] += 0.4
    teacher, ds = tmp_path / "t", tmp_path / "ds"
    teacher.mkdir()
    ds.mkdir()
    np.save(teacher / "logits_val.npy", logits.astype(np.float32))
    np.save(ds / "val_labels.npy", labels)
    assert bench.main(["--case", str(teacher), str(ds), "--sizes", "36", "--draws", "40"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    figures = out["t"]["36"]
    before, now = figures["before (none under one photo)"], figures["now (at least one)"]
    assert now["unanswered"] > before["unanswered"] and now["mistakes_caught"] > before["mistakes_caught"]
    assert now["flagged_wrong"] > 1 - out["t"]["accuracy"]  # what it flags is wrong more often than the rest
    assert 0 < figures["95 % target"]["unanswered"] <= 1
