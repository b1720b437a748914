"""The teacher's view bank: views line up between teacher and student, and the student trains on them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from pipeline_helpers import tiny_dataset
from test_teacher_stage import _tiny_encoder

from leaflens.data_prep.contract import area_resize
from leaflens.data_prep.manifest import load_dataset
from leaflens.engine.data import Augment, apply_view_boxes, sample_view_boxes
from leaflens.pipeline.cli import main as cli
from leaflens.pipeline.config import load_config
from leaflens.pipeline.distill import run_distill
from leaflens.pipeline.teachers.artefact import TeacherError, load_teacher
from leaflens.pipeline.teachers.onnx_encoder import OnnxEncoder
from leaflens.pipeline.teachers.stage import ArrayEncoder
from leaflens.pipeline.teachers.views import write_view_bank


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp("views"), per_class=12, size=16, unlabeled=5)


def test_view_zero_is_the_plain_image_and_flips_are_exact():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (4, 12, 12, 3)).astype(np.uint8)
    boxes = sample_view_boxes(4, 5, Augment(hflip=True, vflip=True, scale=(0.5, 1.0)), rng)
    assert boxes.shape == (4, 5, 6)
    np.testing.assert_array_equal(apply_view_boxes(x, boxes[:, 0]), x)
    assert (boxes[:, 1:, 2] * boxes[:, 1:, 3] <= 1.0 + 1e-6).all() and (boxes[:, 1:, :2] >= 0).all()
    assert (boxes[:, :, 0] + boxes[:, :, 2] <= 1 + 1e-6).all() and (boxes[:, :, 1] + boxes[:, :, 3] <= 1 + 1e-6).all()
    flip = np.array([[0, 0, 1, 1, 1, 1]] * 4, np.float32)
    np.testing.assert_array_equal(apply_view_boxes(x, flip), x[:, ::-1, ::-1])
    # uint8 and float inputs take different code paths and must agree
    for v in range(5):
        np.testing.assert_allclose(apply_view_boxes(x, boxes[:, v]), apply_view_boxes(x.astype(np.float32),
                                                                                       boxes[:, v]), atol=1e-3)


def test_a_view_is_the_same_region_at_any_resolution():
    """Cut at 96 px then shrunk to 24 px ~= cut at 24 px from the shrunk image: teacher and student agree."""
    yy, xx = np.mgrid[0:96, 0:96] / 96.0
    big = np.stack([255 * xx, 255 * yy, 127 + 100 * np.sin(6 * xx)], -1).astype(np.uint8)[None]
    small = np.asarray(Image.fromarray(big[0]).resize((24, 24), Image.Resampling.BOX))[None]
    box = np.array([[0.2, 0.1, 0.6, 0.7, 1, 0]], np.float32)
    view_big = apply_view_boxes(big, box)[0].clip(0, 255).astype(np.uint8)
    from_big = np.asarray(Image.fromarray(view_big).resize((24, 24), Image.Resampling.BOX), np.float32)
    from_small = apply_view_boxes(small, box)[0]
    assert np.abs(from_big - from_small).mean() < 3.0  # grey levels; a misplaced box gives tens
    # the student's view cut straight from the 96 px image at its 24 px input size (out_size) agrees too
    direct = apply_view_boxes(big, box, out_size=24)[0]
    assert direct.shape == (24, 24, 3) and np.abs(from_big - direct).mean() < 3.0
    assert np.abs(apply_view_boxes(big.astype(np.float32), box, out_size=24)[0] - direct).max() < 1e-3
    plain = np.array([[0, 0, 1, 1, 0, 0]], np.float32)
    np.testing.assert_allclose(apply_view_boxes(big, plain, out_size=24), area_resize(big, 24), atol=1e-3)


def test_teacher_writes_a_view_bank_that_distill_learns_from(ds_dir, tmp_path, capsys):
    enc = _tiny_encoder(tmp_path / "enc.onnx")
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(enc),
                "--views", "4", "--quiet"]) == 0
    ds = load_dataset(ds_dir)
    tt = load_teacher(tmp_path / "t", ds)
    assert tt.info.views.count == 4 and set(tt.views) == {"train", "unlabeled"}
    boxes, feats, logits = tt.views["train"]
    assert boxes.shape == (len(ds["train"]), 4, 6) and feats.shape == (len(ds["train"]), 4, 6) and logits is None
    # each stored view's features are the encoder's features of that view of the stored image
    encoder = OnnxEncoder(enc)
    images = np.asarray(ds["train"].images[:5])
    for v in range(4):
        cut = np.clip(np.rint(apply_view_boxes(images, np.asarray(boxes[:5, v]))), 0, 255).astype(np.uint8)
        np.testing.assert_allclose(feats[:5, v], encoder.encode(cut)[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(feats[:, 1], feats[:, 2])  # the views differ

    cfg = load_config(None, ["train.epochs=3", "train.min_steps=0", "train.batch_size=8", "model.widths=[8, 16]",
                                                     "train.warmup_epochs=1", "train.lr=0.01"])
    report = run_distill(ds_dir, tmp_path / "t", tmp_path / "run", cfg, progress=False)
    assert report["variants"]["distilled"]["val_accuracy"] is not None
    rows = [json.loads(line) for line in (tmp_path / "run" / "distilled" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train_feature"] < rows[0]["train_feature"]


def test_views_need_a_teacher_that_sees_images(ds_dir, tmp_path):
    ds = load_dataset(ds_dir)
    feats = {s: np.zeros((len(ds[s]), 4), np.float32) for s in ds.splits}
    with pytest.raises(ValueError, match="can look at images"):
        write_view_bank(tmp_path, ds, ArrayEncoder(feats, None, tmp_path, ds.image_size).view_encoder, 3,
                        Augment(), 0, 8, False, np.float32, False)


def test_a_missing_view_file_is_refused(ds_dir, tmp_path):
    enc = _tiny_encoder(tmp_path / "enc.onnx")
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(enc),
                "--views", "2", "--quiet"]) == 0
    (tmp_path / "t" / "features_views_train.npy").unlink()
    with pytest.raises(TeacherError, match="features_views_train.npy is missing"):
        load_teacher(tmp_path / "t", load_dataset(ds_dir))
