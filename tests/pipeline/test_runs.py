"""A run's records: the student described once (StudentSpec) and best.npz's metadata (RunMeta)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from leaflens.engine.checkpoint import CheckpointError, save_checkpoint
from leaflens.pipeline.config import load_config
from leaflens.pipeline.models.student import StudentCNN, StudentSpec
from leaflens.pipeline.runs import RunDataset, RunMeta, RunMetrics, load_model, read_run
from leaflens.records import RecordError

# best.npz's extra as `leaflens distill` wrote it before RunMeta (dicts built in distill.py).
PREVIOUS_RUN_EXTRA = {
    "model_config": {"kind": "student_cnn", "num_classes": 3, "widths": [8, 16], "in_channels": 3, "dropout": 0.1},
    "dataset": {"classes": ["healthy", "mildew", "rust"], "mean": [0.4, 0.5, 0.3], "std": [0.2, 0.2, 0.25],
                "image_size": 32, "input_size": 16, "resize": "crop", "manifest_sha256": "cd" * 32,
                "root": "/data/ds"},
    "run_id": "20250101-120000-abcdef",
    "variant": "distilled",
    "metrics": {"val_accuracy": 0.9, "test_accuracy": 0.875, "uncertain_threshold": 0.55},
    "teacher": {"kind": "features-file", "path": "/data/feats"},
}


def test_the_student_spec_is_the_one_description_of_the_architecture():
    cfg = load_config(None, ["model.widths=[8, 16]", "model.dropout=0.25"])
    spec = StudentSpec.from_recipe(cfg.model, 5)
    assert spec == StudentSpec(num_classes=5, widths=(8, 16), dropout=0.25)
    model = spec.build(np.random.default_rng(0), teacher_dim=7)
    direct = StudentCNN(5, widths=(8, 16), teacher_dim=7, dropout=0.25, rng=np.random.default_rng(0))
    assert model.num_parameters() == direct.num_parameters() and model.projection is not None
    for (ka, a), (kb, b) in zip(sorted(model.state_dict().items()), sorted(direct.state_dict().items())):
        assert ka == kb
        np.testing.assert_array_equal(a, b, err_msg=ka)
    assert StudentSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_model_configs_written_by_the_previous_code_are_read():
    full = StudentSpec.from_dict(PREVIOUS_RUN_EXTRA["model_config"])
    assert full == StudentSpec(3, (8, 16), 3, 0.1) and full.to_dict() == PREVIOUS_RUN_EXTRA["model_config"]
    # hand-made checkpoints (tests, older runs) left dropout out
    hand_made = {"kind": "student_cnn", "num_classes": 5, "widths": [8], "in_channels": 3}
    assert StudentSpec.from_dict(hand_made).dropout == 0.0


@pytest.mark.parametrize("data, message", [
    ({**PREVIOUS_RUN_EXTRA["model_config"], "widht": 3}, "unknown key 'widht'"),
    ({**PREVIOUS_RUN_EXTRA["model_config"], "kind": "resnet"}, "kind: 'resnet' is not one of 'student_cnn'"),
    ({"kind": "student_cnn", "widths": [8]}, "required key 'num_classes' is missing"),
])
def test_student_spec_refusals_name_the_key(data, message):
    with pytest.raises(RecordError) as info:
        StudentSpec.from_dict(data)
    assert message in str(info.value)


def test_run_metadata_written_by_the_previous_code_is_read():
    meta = RunMeta.from_dict(json.loads(json.dumps(PREVIOUS_RUN_EXTRA)))
    assert meta.model_config == StudentSpec(3, (8, 16), 3, 0.1) and meta.variant == "distilled"
    assert meta.dataset.model_input_size == 16 and meta.metrics.uncertain_threshold == 0.55
    assert meta.to_dict() == {**PREVIOUS_RUN_EXTRA, "schema_version": 1}
    # a variant's own best.npz (the training loop adds its val accuracy) and a run from before input_size
    variant = {**PREVIOUS_RUN_EXTRA, "metrics": {"val_accuracy": 0.8}}
    assert RunMeta.from_dict(variant).metrics == RunMetrics(val_accuracy=0.8)
    old = {**PREVIOUS_RUN_EXTRA, "dataset": {k: v for k, v in PREVIOUS_RUN_EXTRA["dataset"].items()
                                             if k not in ("input_size", "resize", "root")}}
    assert RunMeta.from_dict(old).dataset.model_input_size == 32


@pytest.mark.parametrize("change, message", [
    ({"varaint": "scratch"}, "unknown key 'varaint'"),
    ({"dataset": {**PREVIOUS_RUN_EXTRA["dataset"], "mean": [0.5]}}, "dataset: mean: expected 3 values"),
    ({"metrics": {"val_acc": 0.9}}, "metrics: unknown key 'val_acc'"),
    ({"schema_version": 2}, "written by a newer leaflens"),
    ({"dataset": {**PREVIOUS_RUN_EXTRA["dataset"], "centre_crop": 1.0}}, "centre_crop must be a share"),
    ({"dataset": {**PREVIOUS_RUN_EXTRA["dataset"], "centre_crop": 0.25}}, "keeps 8 of the stored 32 px, fewer than"),
])
def test_run_metadata_refusals_name_the_key(change, message):
    with pytest.raises(RecordError) as info:
        RunMeta.from_dict({**PREVIOUS_RUN_EXTRA, **change}, "best.npz")
    assert message in str(info.value)


def test_the_runs_contract_carries_its_centre_crop():
    whole = RunMeta.from_dict(PREVIOUS_RUN_EXTRA).dataset.contract()
    assert (whole.stored_size, whole.input_size, whole.centre_crop, whole.mean) == (32, 16, None, (0.4, 0.5, 0.3))
    crop = RunMeta.from_dict({**PREVIOUS_RUN_EXTRA, "dataset": {**PREVIOUS_RUN_EXTRA["dataset"], "centre_crop": 0.75}})
    assert crop.dataset.contract().centre_crop == 0.75 and crop.to_dict()["dataset"]["centre_crop"] == 0.75


def test_read_run_and_load_model_use_the_record(tmp_path):
    meta = RunMeta(model_config=StudentSpec(3, (8, 16)),
                   dataset=RunDataset(classes=("a", "b", "c"), mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25),
                                      image_size=32, input_size=16),
                   metrics=RunMetrics(test_accuracy=0.5))
    model = meta.model_config.build(np.random.default_rng(1))
    save_checkpoint(tmp_path / "run" / "best.npz", model, extra=meta.to_dict())
    info = read_run(tmp_path / "run")
    assert info.run_id == "run" and info.dataset == meta.dataset and info.metrics == meta.metrics
    loaded, _ = load_model(tmp_path / "run")
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k], v, err_msg=k)
    bad = {**meta.to_dict(), "dataset": {**meta.dataset.to_dict(), "colour": "green"}}
    save_checkpoint(tmp_path / "bad" / "best.npz", model, extra=bad)
    with pytest.raises(CheckpointError, match=r"best\.npz: dataset: unknown key 'colour'"):
        read_run(tmp_path / "bad")
    named = dataclasses.replace(meta, run_id="r-7")
    save_checkpoint(tmp_path / "named" / "best.npz", model, extra=named.to_dict())
    assert read_run(tmp_path / "named").run_id == "r-7"
