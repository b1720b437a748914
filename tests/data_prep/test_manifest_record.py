"""manifest.json as a typed record: today's files read back key for key, the self digest keeps working."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from dp_helpers import make_class_folders

from leaflens.data_prep.decode import DEFAULT_MAX_PIXELS
from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import (
    MANIFEST_NAME,
    SELF_DIGEST_KEY,
    DatasetError,
    Manifest,
    load_dataset,
    manifest_self_digest,
    read_manifest,
)
from leaflens.records import RecordError


def _previous_manifest() -> dict:
    """A manifest as the ingest wrote it before the Manifest record (with an unlabeled split)."""
    m = {
        "format": "leaflens-dataset",
        "format_version": 1,
        "classes": ["healthy", "rust"],
        "image_size": 16,
        "layout": "NHWC",
        "dtype": "uint8",
        "mean": [0.41, 0.52, 0.33],
        "std": [0.21, 0.2, 0.19],
        "mean_std_scale": "pixel / 255, per RGB channel, computed on train",
        "splits": {"train": {"count": 14, "labels": "present", "per_class": {"healthy": 7, "rust": 7}},
                   "val": {"count": 3, "labels": "present", "per_class": {"healthy": 2, "rust": 1}},
                   "test": {"count": 3, "labels": "present", "per_class": {"healthy": 1, "rust": 2}},
                   "unlabeled": {"count": 5, "labels": "absent"}},
        "source_root": "/photos",
        "source_layout": "class_folders",
        "unlabeled_source": "/photos_unlabeled",
        "class_info": None,
        "options": {"size": 16, "resize": "crop", "ratios": [0.7, 0.15, 0.15], "seed": 0, "max_pixels": 40000000},
        "rejected": {"total": 1, "per_class": {"rust": 1}, "reasons": {"truncated": 1}, "list": "rejected.jsonl"},
        "ignored": {"hidden": 2},
        "duplicates": {"groups": 0, "files": 0, "label_conflicts": 0},
        "checksums": {"train_images.npy": "sha256:" + "0" * 64},
        "input_fingerprint": "sha256:" + "1" * 64,
    }
    m[SELF_DIGEST_KEY] = manifest_self_digest(m)
    return m


def test_a_manifest_written_by_the_previous_code_reads_back_the_same():
    old = _previous_manifest()
    rec = Manifest.from_dict(json.loads(json.dumps(old)))
    assert rec.classes == ("healthy", "rust") and rec.splits["unlabeled"].per_class is None
    assert rec.options == IngestOptions(size=16, max_pixels=40_000_000) and rec.resize == "crop"
    assert rec.to_dict() == old  # key for key: the self digest of a rewritten manifest still matches
    assert manifest_self_digest(rec.to_dict()) == old[SELF_DIGEST_KEY]
    assert rec.with_self_digest() == rec


def test_older_manifests_with_only_the_required_fields_are_read():
    old = _previous_manifest()
    minimal = {k: old[k] for k in ("format", "format_version", "classes", "image_size", "mean", "std",
                                   "splits", "checksums")}
    rec = Manifest.from_dict(minimal)
    assert rec.options is None and rec.resize == IngestOptions().resize and rec.manifest_sha256 is None


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(colour="red"), "unknown key 'colour'"),
    (lambda m: m["splits"]["train"].update(cuont=3), "splits.train: unknown key 'cuont'"),
    (lambda m: m["options"].update(resize="stretch"), "options: resize: 'stretch' is not one of 'crop', 'pad'"),
    (lambda m: m.update(mean=[0.5, 0.5]), "mean: expected 3 values"),
    (lambda m: m.pop("classes"), "required key 'classes' is missing"),
    (lambda m: m.update(format_version=2), "written by a newer leaflens (format_version 2"),
])
def test_refusals_name_the_key(change, message):
    data = _previous_manifest()
    change(data)
    with pytest.raises(RecordError) as info:
        Manifest.from_dict(data, "manifest.json")
    assert message in str(info.value)


def test_the_ingest_writes_the_record_and_load_dataset_refuses_an_unknown_key(tmp_path: Path):
    out = tmp_path / "ds"
    ingest(make_class_folders(tmp_path / "photos", per_class=6), out, IngestOptions(size=16), workers=1,
           log=lambda s: None)
    written = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
    rec = read_manifest(out)
    assert rec.to_dict() == written and written[SELF_DIGEST_KEY] == manifest_self_digest(written)
    assert load_dataset(out).manifest == rec and rec.options == IngestOptions(size=16)
    assert rec.rejected is not None and rec.duplicates is not None
    # an unknown key, with the self digest made to match, is refused by name
    edited = copy.deepcopy(written)
    edited["splits"]["train"]["flipped"] = True
    edited[SELF_DIGEST_KEY] = manifest_self_digest(edited)
    (out / MANIFEST_NAME).write_text(json.dumps(edited), encoding="utf-8")
    with pytest.raises(DatasetError, match=r"manifest\.json: splits\.train: unknown key 'flipped'"):
        load_dataset(out)
    (out / MANIFEST_NAME).write_text(json.dumps({k: v for k, v in written.items() if k != "format_version"}),
                                     encoding="utf-8")
    with pytest.raises(DatasetError, match="format_version is missing"):
        load_dataset(out)


def test_ingest_options_keep_the_fingerprint_shape():
    """The fingerprint hashes the options' dict: it must be what the previous code hashed, or every
    existing dataset would look out of date."""
    assert IngestOptions(size=16).to_dict() == {"size": 16, "resize": "crop", "ratios": [0.7, 0.15, 0.15],
                                                "seed": 0, "max_pixels": DEFAULT_MAX_PIXELS}


def test_a_folder_that_is_no_dataset_is_told_what_it_is(tmp_path):
    """`distill --dataset photos/` said "manifest.json is missing (run `leaflens preprocess` or `leaflens data
    synth`)": synth writes photos, not a manifest, and the folder was the photos preprocess needs."""
    from leaflens.data_prep.manifest import DatasetError, read_manifest  # noqa: PLC0415

    (tmp_path / "photos" / "rust").mkdir(parents=True)
    (tmp_path / "photos" / "rust" / "a.JPG").write_bytes(b"x")
    (tmp_path / "split" / "val" / "rust").mkdir(parents=True)
    (tmp_path / "split" / "val" / "rust" / "a.jpg").write_bytes(b"x")
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "b.png").write_bytes(b"x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "teacher.json").write_text("{}")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.json").write_text("{}")
    (tmp_path / "run" / "curves.png").write_bytes(b"x")  # a run's plots are no photos to preprocess
    cases = {"photos": f"a folder of photos, not a dataset: `leaflens preprocess --src {tmp_path / 'photos'} --out "
                       "DATASET`",
             "split": "a folder of photos, not a dataset",
             "loose": "a folder of photos without class folders, not a dataset: put each class's photos in a folder",
             "empty": f"{tmp_path / 'empty' / 'manifest.json'} is missing (`leaflens preprocess --src PHOTOS --out "
                      "DATASET` writes a dataset, in a new folder)",
             "teacher": "this is a teacher folder (teacher.json), not a dataset",
             "run": "this is a distill run folder, not a dataset",
             "file": "not a folder", "nothing": "no such folder"}
    for name, says in cases.items():
        with pytest.raises(DatasetError) as err:
            read_manifest(tmp_path / name)
        assert says in str(err.value) and "data synth" not in str(err.value), (name, str(err.value))
