"""A project folder moved or renamed with its photos beside the dataset (copied to a GPU machine, say): the
stages that go back to the original photos find them again, and only when they are the same photos."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from PIL import Image
from pipeline_helpers import make_class_folders, tiny_dataset

from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.pipeline.evaluate import PhotosUnavailable, dataset_photo_files
from leaflens.pipeline.teachers.stage import split_photo_paths, split_source_dir


def test_the_photos_of_a_moved_project_are_found_again_when_they_decode_to_the_stored_pixels(tmp_path):
    old = tmp_path / "old" / "project"
    tiny_dataset(old, per_class=8, unlabeled=3)  # photos/, unlabeled_photos/ (recorded by absolute path)
    corrections = make_class_folders(old / "corrections", per_class=2, seed=7)  # the web app's, by --also
    ingest(old / "photos", old / "dataset", IngestOptions(size=16), unlabeled=old / "unlabeled_photos",
           also=[corrections], workers=1, force=True, log=lambda s: None)
    shutil.move(tmp_path / "old", tmp_path / "new home")
    project = tmp_path / "new home" / "project"
    ds = load_dataset(project / "dataset")
    assert ds.manifest.source_root == str(old / "photos")  # recorded before the move
    assert any(f.startswith(str(old / "corrections")) for f in ds["train"].files)
    assert split_source_dir(ds, "test") == project / "photos"
    assert split_source_dir(ds, "unlabeled") == project / "unlabeled_photos"
    for split in ("train", "val", "test", "unlabeled"):
        root, files = dataset_photo_files(ds, split)  # every row's file is there
        assert len(files) == len(ds[split]) and all(f.startswith(str(project)) for f in files), split
    _, paths = split_photo_paths(ds, "train")
    moved = sum(p.is_relative_to(project / "corrections") for p in paths)
    assert moved == sum(f.startswith(str(old / "corrections")) for f in ds["train"].files) > 0


def test_other_photos_under_the_same_names_are_not_taken_for_the_recorded_ones(tmp_path):
    tiny_dataset(tmp_path / "old" / "project", per_class=8)
    shutil.move(tmp_path / "old", tmp_path / "new")
    project = tmp_path / "new" / "project"
    for photo in sorted((project / "photos").rglob("*.png")) + sorted((project / "photos").rglob("*.jpg")):
        with Image.open(photo) as im:
            other = Image.fromarray(255 - np.asarray(im.convert("RGB")))
        other.save(photo, format=im.format)
    ds = load_dataset(project / "dataset")
    assert split_source_dir(ds, "test") == tmp_path / "old" / "project" / "photos"  # the record, still gone
    with pytest.raises(PhotosUnavailable, match="no longer in"):
        dataset_photo_files(ds, "test")
