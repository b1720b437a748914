"""benchmarks/near_ties.py on a tiny model and dataset: its counts agree with the served rule."""

from __future__ import annotations

import json

import numpy as np
from apps_helpers import build_tiny_model, leaflens_metadata, make_dataset, tiny_weights
from bench_helpers import load_benchmark

from leaflens.apps.model_card import TIE_RATIO, unsure
from leaflens.apps.predictor import Predictor
from leaflens.data_prep.manifest import load_dataset

CLASSES = ["aphids", "healthy", "rust"]


def test_near_ties_are_counted_as_the_served_rule_counts_them(tmp_path, capsys):
    dataset = make_dataset(tmp_path, CLASSES, 16, per_class=10)
    model = build_tiny_model(tmp_path / "m.onnx", tiny_weights(3, seed=2), 16,
                             leaflens_metadata(CLASSES, 16, **{"leaflens.uncertain_threshold": "0.4"}))
    assert load_benchmark("near_ties.py").main(["--model", str(model), "--dataset", str(dataset)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ds = load_dataset(dataset)
    probs = Predictor(model).predict_arrays(np.asarray(ds["val"].images))
    two = -np.sort(-probs, axis=1)[:, :2]
    assert out["photos"] == len(probs) and out["tie_ratio"] == TIE_RATIO
    assert out["near_ties"] == int((two[:, 1] >= TIE_RATIO * two[:, 0]).sum())
    assert out["rule_ambiguous"] == int(np.sum(unsure(probs, 0.4)))
    assert out["threshold_ambiguous"] == int((two[:, 0] < 0.4).sum())
    ties = [r["near_ties"] for r in out["per_ratio"]]
    assert ties == sorted(ties, reverse=True)  # a lower ratio takes every near tie of a higher one
