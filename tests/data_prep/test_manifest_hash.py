"""One manifest hash: the dataset identity every stage records and checks is data_prep's manifest_sha256."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from dp_helpers import make_class_folders

from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import MANIFEST_NAME, DatasetError, load_dataset, manifest_sha256, read_manifest
from leaflens.pipeline.teachers.artefact import TeacherError, load_teacher
from leaflens.pipeline.teachers.stage import ArrayEncoder, write_teacher


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("hash")
    return ingest(make_class_folders(tmp / "photos", per_class=6), tmp / "ds", IngestOptions(size=16), workers=1,
                  log=lambda *_: None).out


def test_manifest_sha256_is_the_hex_digest_of_the_file(dataset: Path) -> None:
    digest = manifest_sha256(dataset)
    assert digest == hashlib.sha256((dataset / MANIFEST_NAME).read_bytes()).hexdigest()
    assert len(digest) == 64 and not digest.startswith("sha256:")


def test_any_change_to_the_manifest_changes_the_identity(dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    text = (dataset / MANIFEST_NAME).read_text(encoding="utf-8")
    (copy / MANIFEST_NAME).write_text(text, encoding="utf-8")
    assert manifest_sha256(copy) == manifest_sha256(dataset)
    (copy / MANIFEST_NAME).write_text(text.replace('"image_size": 16', '"image_size": 17'), encoding="utf-8")
    assert manifest_sha256(copy) != manifest_sha256(dataset)
    with pytest.raises(DatasetError, match="was edited after it was written"):  # the self digest catches it too
        read_manifest(copy)


def test_the_teacher_records_and_checks_the_same_identity(dataset: Path, tmp_path: Path) -> None:
    ds = load_dataset(dataset)
    features = {s: ds[s].images.reshape(len(ds[s]), -1)[:, :8].astype("float32") for s in ds.splits}
    np_dir = tmp_path / "features"
    np_dir.mkdir()
    teacher = write_teacher(tmp_path / "teacher", ds, ArrayEncoder(features, None, np_dir, ds.image_size),
                            progress=False)
    info = json.loads((teacher / "teacher.json").read_text(encoding="utf-8"))
    assert info["dataset_manifest_sha256"] == manifest_sha256(dataset)
    info["dataset_manifest_sha256"] = "0" * 64
    (teacher / "teacher.json").write_text(json.dumps(info), encoding="utf-8")
    with pytest.raises(TeacherError, match="another dataset"):
        load_teacher(teacher, ds)
