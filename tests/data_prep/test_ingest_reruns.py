"""Running `leaflens preprocess` again, and its refusals: what a user is told and what is left on disk."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dp_helpers import make_class_folders

from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.data_prep.scan import ScanError
from leaflens.pipeline.cli import main


def quiet(_: str) -> None:
    pass


def test_up_to_date_means_whole_and_with_the_same_class_notes(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=5)
    (src / "classes.toml").write_text('[classes.rust]\nname = "Rust"\n', encoding="utf-8")
    out = tmp_path / "ds"
    assert not ingest(src, out, IngestOptions(size=16), workers=1, log=quiet).up_to_date
    assert ingest(src, out, IngestOptions(size=16), workers=1, log=quiet).up_to_date
    (src / "classes.toml").write_text('[classes.rust]\nname = "Bean rust"\n', encoding="utf-8")  # new advice
    assert not ingest(src, out, IngestOptions(size=16), workers=1, log=quiet).up_to_date
    assert "Bean rust" in (out / "classes.toml").read_text(encoding="utf-8")
    arr = np.load(out / "train_images.npy", mmap_mode="r+")
    arr[0, 0, 0, 0] ^= 0xFF  # damaged on disk
    arr.flush()
    del arr
    assert not ingest(src, out, IngestOptions(size=16), workers=1, log=quiet).up_to_date  # built again, not trusted
    load_dataset(out, verify=True)


def test_a_killed_runs_temporary_folder_goes_even_when_nothing_is_rebuilt(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=5)
    out = tmp_path / "ds"
    ingest(src, out, IngestOptions(size=16), workers=1, log=quiet)
    stale = tmp_path / ".ds.tmp-999999-deadbeef"
    stale.mkdir()
    (stale / "staging.npy").write_bytes(b"x" * 100)
    assert ingest(src, out, IngestOptions(size=16), workers=1, log=quiet).up_to_date and not stale.exists()


def test_reports_and_reasons_are_given_when_asked_and_when_refused(tmp_path, capsys):
    src = make_class_folders(tmp_path / "photos", per_class=5)
    out = tmp_path / "ds"
    args = ["preprocess", "--src", str(src), "--out", str(out), "--size", "16", "--workers", "1", "--no-progress"]
    assert main(args) == 0
    assert main([*args, "--report", str(tmp_path / "again.json")]) == 0  # up to date: the report of that build
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads((out / "data_report.json").read_text())
    broken = src / "broken"
    broken.mkdir()
    (broken / "a.jpg").write_bytes(b"")
    (broken / "b.jpg").write_bytes(b"not a photo")
    capsys.readouterr()
    assert main([*args, "--report", str(tmp_path / "refused.json")]) == 1
    err = capsys.readouterr()
    said = err.out + err.err
    assert "broken/a.jpg: empty" in said and "broken/b.jpg: not_an_image" in said and "see the list above" in said
    assert "class imbalance" not in said  # the refusal says what is wrong with 'broken'
    assert (tmp_path / "refused.json").is_file() and (out / "manifest.json").is_file()  # the old dataset stays
    assert main(["preprocess", "--src", str(src), "--check", "--size", "16", "--workers", "1", "--no-progress"]) == 1
    err = capsys.readouterr()
    assert "broken/a.jpg: empty" in err.out + err.err  # --check names them too


def test_option_and_folder_mistakes_are_refused_before_any_work(tmp_path, capsys):
    src = make_class_folders(tmp_path / "photos", per_class=5)
    base = ["preprocess", "--src", str(src), "--out", str(tmp_path / "ds"), "--size", "16", "--workers", "1"]
    assert main([*base, "--max-pixels", "0"]) == 2
    assert "--max-pixels must be at least 1" in capsys.readouterr().err
    assert main([*base, "--unlabeled", str(src / "rust")]) == 1
    assert "overlaps the source folder" in capsys.readouterr().err
    assert main([*base, "--unlabeled", str(tmp_path)]) == 1
    assert not (tmp_path / "ds").exists()
    with pytest.raises(ScanError, match="overlaps the source folder"):
        ingest(src, tmp_path / "ds", IngestOptions(size=16), unlabeled=src, workers=1, log=quiet)


def test_a_dataset_holding_tiffs_is_built_again_when_their_decoding_changed(tmp_path, monkeypatch):
    """The TIFF decoder was fixed (an orientation tag applied twice): a dataset built before kept the wrong
    pixels as "up to date". Datasets without TIFFs are not rebuilt for it."""
    from PIL import Image

    from leaflens.data_prep import decode

    plain = make_class_folders(tmp_path / "plain", per_class=5)
    with_tiff = make_class_folders(tmp_path / "tiffs", per_class=5)
    Image.new("RGB", (40, 30), (10, 120, 40)).save(with_tiff / "rust" / "scan.tif")
    monkeypatch.setattr(decode, "TIFF_REVISION", 1)
    for src in (plain, with_tiff):
        ingest(src, tmp_path / f"ds_{src.name}", IngestOptions(size=16), workers=1, log=quiet)
    monkeypatch.setattr(decode, "TIFF_REVISION", 2)
    assert ingest(plain, tmp_path / "ds_plain", IngestOptions(size=16), workers=1, log=quiet).up_to_date
    assert not ingest(with_tiff, tmp_path / "ds_tiffs", IngestOptions(size=16), workers=1, log=quiet).up_to_date
    assert ingest(with_tiff, tmp_path / "ds_tiffs", IngestOptions(size=16), workers=1, log=quiet).up_to_date
