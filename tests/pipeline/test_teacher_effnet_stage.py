"""The default teacher stage (ImageNet EfficientNet-Lite0, partially fine-tuned) on a tiny dataset."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pipeline_helpers import tiny_dataset

from leaflens.data_prep.manifest import load_dataset
from leaflens.pipeline.cli import main as cli
from leaflens.pipeline.teachers.artefact import load_teacher

pretrained = pytest.importorskip("leaflens.pipeline.models.pretrained")


def _weights_or_skip():
    try:
        return pretrained.find_lite0_weights()
    except pretrained.WeightsNotFoundError as exc:
        pytest.skip(f"EfficientNet-Lite0 weights not installed: {exc}")


def test_effnet_teacher_fine_tunes_and_writes_features_and_logits(tmp_path, capsys):
    _weights_or_skip()
    ds_dir = tiny_dataset(tmp_path, per_class=10, size=16)
    # 32x32 input keeps the test fast; the original photos are decoded again at that size
    code = cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--epochs", "2",
                "--input-size", "32", "--views", "2", "--set", "teacher.min_steps=0", "--quiet", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ds = load_dataset(ds_dir)
    tt = load_teacher(tmp_path / "t", ds)
    assert tt.feature_dim == 1280 and tt.has_logits
    assert tt.info.teacher["kind"] == "efficientnet-lite0" and tt.info.teacher["fine_tuned"]
    assert tt.info.teacher["input_size"] == 32
    stage = tt.info.stage
    assert stage["front_backend"] in ("onnxruntime", "engine") and len(stage["fine_tune_history"]) == 2
    for split in ds.splits:
        assert np.isfinite(np.asarray(tt.features[split])).all()
        assert np.asarray(tt.logits[split]).shape == (len(ds[split]), ds.num_classes)
    assert "knn_test_acc" in summary
    # the view bank is made by the fine-tuned network (logits for the dataset's classes)
    boxes, vfeats, vlogits = tt.views["train"]
    n = len(ds["train"])
    assert boxes.shape == (n, 2, 6) and vfeats.shape == (n, 2, 1280) and vlogits.shape == (n, 2, ds.num_classes)
    assert np.isfinite(np.asarray(vfeats)).all() and np.isfinite(np.asarray(vlogits)).all()


def test_frozen_teacher_has_no_logits(tmp_path):
    _weights_or_skip()
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--frozen", "--input-size", "32",
                "--quiet"]) == 0
    tt = load_teacher(tmp_path / "t", load_dataset(ds_dir))
    assert not tt.has_logits and not tt.info.teacher["fine_tuned"]


@pytest.mark.parametrize("size", ["16", "7", "2048"])
def test_an_input_size_efficientnet_cannot_use_is_refused_before_any_work(tmp_path, capsys, size):
    ds_dir = tiny_dataset(tmp_path, per_class=6, size=16)  # `--input-size 16` for 160 trained a chance-level teacher
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--input-size", size,
                "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--input-size {size}: EfficientNet-Lite0 takes 32 to 1024 px" in err and "160" in err  # as typed
    assert not (tmp_path / "t").exists()
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--set",
                f"teacher.input_size={size}", "--quiet"]) == 2  # the stage's own check, for --set and TOML files
    assert f"teacher.input_size {size}: EfficientNet-Lite0 takes 32 to 1024 px" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_fine_tuned_teacher_does_not_depend_on_what_ran_before(tmp_path, monkeypatch):
    """The fine-tune's generators (new head, dropout, batch order) come from the recipe's seed: the same
    teacher, bit for bit, whatever drew from NumPy's or the engine's streams or trained earlier."""
    from leaflens.engine import nn  # noqa: PLC0415
    from leaflens.engine import random as erandom  # noqa: PLC0415
    from leaflens.pipeline.config import load_config  # noqa: PLC0415
    from leaflens.pipeline.teachers.effnet import build_effnet_teacher  # noqa: PLC0415

    class Trap:  # stands in for the engine's interactive fallback stream
        def __getattr__(self, name):
            raise AssertionError(f"the teacher drew from the engine's default generator ({name})")

    _weights_or_skip()
    ds = load_dataset(tiny_dataset(tmp_path, per_class=6, size=16))
    recipe = load_config(None, ["teacher.epochs=2", "teacher.min_steps=0", "teacher.input_size=32"]).teacher

    def teacher() -> tuple[dict[str, np.ndarray], np.ndarray]:
        enc, _ = build_effnet_teacher(ds, recipe, progress=False)
        return enc.view_encoder.back.state_dict(), np.asarray(enc.logits["test"])

    first = teacher()
    for seed in (3, 11):
        erandom.seed(seed)
        erandom.default_generator().normal(size=1000)  # an earlier job drew from the engine's stream ...
        np.random.seed(seed)
        np.random.random(1000)  # ... and from NumPy's
        other = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))  # ... and trained something else
        other(np.ones((8, 4), np.float32)).sum().backward()
        weights, logits = teacher()
        np.testing.assert_array_equal(logits, first[1])
        assert weights.keys() == first[0].keys()
        for k, v in weights.items():
            np.testing.assert_array_equal(v, first[0][k], err_msg=k)
    monkeypatch.setattr(erandom, "_default", Trap())
    np.testing.assert_array_equal(teacher()[1], first[1])
