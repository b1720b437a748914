"""teacher.json as a typed record: written and read as TeacherInfo, refusing what it does not know by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pipeline_helpers import class_features, tiny_dataset

from leaflens.data_prep.manifest import load_dataset, manifest_sha256
from leaflens.pipeline.teachers.artefact import TEACHER_JSON, TeacherError, TeacherInfo, ViewBankInfo, load_teacher
from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source, write_teacher
from leaflens.records import RecordError

# teacher.json as the code before TeacherInfo wrote it: an EfficientNet teacher with a view bank, and the
# "stage"/"seconds" keys the teacher command added.
PREVIOUS_TEACHER_JSON = {
    "format": "leaflens-teacher-1",
    "teacher": {"kind": "efficientnet-lite0", "weights": "/w/efficientnet-lite0-57934424.pth", "fine_tuned": True,
                "split_block": 14, "input_size": 224, "shorter_side": 256, "padding": "same",
                "normalization": "tf", "bn_eps": 0.001},
    "feature_dim": 1280,
    "num_classes": 3,
    "classes": ["angular_leaf_spot", "bean_rust", "healthy"],
    "input_size": 224,
    "shorter_side": 256,
    "from_arrays": False,
    "dtype": "float16",
    "dataset_manifest_sha256": "ab" * 32,
    "dataset_root": "/data/ibeans",
    "rows": {"train": 1034, "val": 133, "test": 128},
    "views": {"count": 8, "splits": ["train"], "seed": 0, "scale": [0.5, 1.0], "ratio": [0.75, 1.3333333333333333],
              "hflip": True, "vflip": True, "region": "whole shorter side (as the student's arrays)"},
    "stage": {"weights": "/w/efficientnet-lite0-57934424.pth", "split_block": 14, "front_backend": "onnxruntime",
              "front_seconds": 80.2, "fine_tuned": True, "fine_tune_history": [{"epoch": 1, "loss": 0.9,
                                                                                 "val_acc": 0.8, "seconds": 20.1}],
              "fine_tune_best_epoch": 1, "fine_tune_val_acc": 0.8, "fine_tune_seconds": 20.1},
    "seconds": 312.5,
}


def test_a_teacher_json_written_by_the_previous_code_is_read():
    info = TeacherInfo.from_dict(json.loads(json.dumps(PREVIOUS_TEACHER_JSON)))
    assert info.feature_dim == 1280 and info.num_classes == 3 and info.dtype == "float16"
    assert info.views == ViewBankInfo(8, ("train",), 0, (0.5, 1.0), (0.75, 4 / 3), True, True,
                                      "whole shorter side (as the student's arrays)")
    assert info.stage["fine_tune_best_epoch"] == 1 and info.seconds == 312.5
    assert info.to_dict() == PREVIOUS_TEACHER_JSON  # the same file again, key for key
    # features-only teachers written without the stage's extra keys and with no view bank
    bare = {k: v for k, v in PREVIOUS_TEACHER_JSON.items() if k not in ("stage", "seconds")}
    bare.update(num_classes=None, classes=None, views=None)
    info = TeacherInfo.from_dict(bare)
    assert info.views is None and info.stage == {} and info.seconds is None and info.classes is None


@pytest.mark.parametrize("change, message", [
    ({"colour": 1}, "unknown key 'colour'"),
    ({"views": {**PREVIOUS_TEACHER_JSON["views"], "cuont": 8}}, "views: unknown key 'cuont'"),
    ({"feature_dim": "1280"}, "feature_dim: expected an integer"),
    ({"dtype": "float64"}, "dtype: 'float64' is not one of"),
])
def test_refusals_name_the_key(change, message):
    with pytest.raises(RecordError, match=None) as info:
        TeacherInfo.from_dict({**PREVIOUS_TEACHER_JSON, **change}, "teacher.json")
    assert message in str(info.value)


def test_the_stage_writes_a_typed_record_and_load_teacher_refuses_a_bad_one(tmp_path):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(class_features(ds_dir, tmp_path / "feats", dim=6), ds)
    out = write_teacher(tmp_path / "t", ds, ArrayEncoder(feats, logits, tmp_path / "feats", ds.image_size),
                        dtype=np.float16, stage={"note": "test"}, seconds=1.5, progress=False)
    tt = load_teacher(out, ds)
    assert isinstance(tt.info, TeacherInfo)
    assert tt.info.dataset_manifest_sha256 == manifest_sha256(ds_dir) and tt.info.dtype == "float16"
    assert tt.info.classes == tuple(ds.classes) and tt.info.rows == {s: len(ds[s]) for s in ds.splits}
    assert tt.info.stage == {"note": "test"} and tt.info.seconds == 1.5 and tt.feature_dim == 6
    data = json.loads((out / TEACHER_JSON).read_text(encoding="utf-8"))
    assert TeacherInfo.from_dict(data) == tt.info
    (out / TEACHER_JSON).write_text(json.dumps({**data, "feature_dims": 6}), encoding="utf-8")
    with pytest.raises(TeacherError, match=r"teacher.json: unknown key 'feature_dims'"):
        load_teacher(out, ds)
    (out / TEACHER_JSON).write_text(json.dumps({**data, "format": "leaflens-teacher-2"}), encoding="utf-8")
    with pytest.raises(TeacherError, match="has format 'leaflens-teacher-2', expected 'leaflens-teacher-1'"):
        load_teacher(out, ds)
