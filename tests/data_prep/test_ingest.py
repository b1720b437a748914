"""Tests for folder ingest (leaflens.data_prep.ingest) and manifest validation (leaflens.data_prep.manifest)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from dp_helpers import COLOURS, encode, make_class_folders, photo, png_bomb
from PIL import Image

from leaflens.data_prep import ingest as ingest_mod
from leaflens.data_prep.ingest import IngestError, IngestOptions, ingest
from leaflens.data_prep.manifest import DatasetError, load_dataset

REPO = Path(__file__).resolve().parents[2]
QUIET = {"log": lambda msg: None}


@pytest.fixture
def class_folders(tmp_path: Path) -> Path:
    return make_class_folders(tmp_path / "photos")


def _read_rejected(out: Path) -> dict[str, str]:
    lines = (out / "rejected.jsonl").read_text().splitlines()
    return {Path(json.loads(x)["path"]).name: json.loads(x)["reason"] for x in lines}


def test_broken_files_rejected_with_reason_rest_kept(class_folders, tmp_path):
    d = class_folders / "rust"
    good = encode(photo(999, (200, 120, 30), 64, 64))
    (d / "empty.jpg").write_bytes(b"")
    (d / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (d / "notes.jpeg").write_bytes(b"not a picture at all\n" * 10)
    (d / "bomb.png").write_bytes(png_bomb())
    (d / ".hidden.jpg").write_bytes(good)
    (d / "readme.txt").write_text("hello")
    (class_folders / "healthy" / ".DS_Store").write_bytes(b"\0\0")
    out = tmp_path / "ds"
    report = ingest(class_folders, out, IngestOptions(size=16), workers=2, **QUIET)
    assert _read_rejected(out) == {"empty.jpg": "empty", "truncated.jpg": "truncated",
                                   "notes.jpeg": "not_an_image", "bomb.png": "too_large"}
    assert report.rejected == {"rust": 4}
    assert report.kept_total == 60
    ds = load_dataset(out)
    assert sum(len(ds[s]) for s in ("train", "val", "test")) == 60
    m = ds.manifest
    assert m.ignored == {"hidden": 2, "not_image": 1}
    assert m.rejected.reasons == {"empty": 1, "truncated": 1, "not_an_image": 1, "too_large": 1}
    from leaflens.data_prep.ingest import format_summary

    assert f"the rejected files, each with its reason: {out / 'rejected.jsonl'}" in format_summary(report)
    for s in ("train", "val", "test"):
        files = ds[s].files
        assert len(files) == len(ds[s]) and not any(Path(f).name.startswith(("empty", "bomb")) for f in files)
    (d / "photo.jfif").write_bytes(good)  # a JPEG as Windows browsers save it: a photo, not "not an image"
    again = ingest(class_folders, out, IngestOptions(size=16), workers=1, **QUIET)
    assert again.kept_total == 61 and load_dataset(out).manifest.ignored == {"hidden": 2, "not_image": 1}


def test_a_name_with_a_line_break_is_rejected_and_the_file_lists_stay_aligned(class_folders, tmp_path):
    """`line\\nbreak.jpg` was kept: train_files.txt got one line more than the arrays had rows, so every later
    row named the wrong photo and the teacher reported photos as missing."""
    (class_folders / "rust" / "line\nbreak.jpg").write_bytes(encode(photo(998, (200, 120, 30), 64, 64)))
    out = tmp_path / "ds"
    ingest(class_folders, out, IngestOptions(size=16), workers=1, **QUIET)
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["path"].endswith("line\nbreak.jpg"), r["reason"]) for r in rejected] == [(True, "bad_name")]
    ds = load_dataset(out)
    for s in ("train", "val", "test"):
        assert len(ds[s].files) == len(ds[s])
    # a line break in the folder above the photos is no part of the names the lists record
    odd = tmp_path / "a\nfolder"
    make_class_folders(odd / "photos", per_class=5)
    report = ingest(odd / "photos", tmp_path / "ds2", IngestOptions(size=16), workers=1, **QUIET)
    assert report.kept_total == 15 and not report.rejected


def test_the_summary_names_the_extensions_of_the_files_left_out_as_not_images(class_folders, tmp_path):
    Image.new("RGB", (40, 40), (10, 200, 10)).save(class_folders / "rust" / "leaf.gif")  # a format not read
    Image.new("RGB", (40, 40), (10, 200, 10)).save(class_folders / "blight" / "leaf2.gif")
    (class_folders / "rust" / "notes.txt").write_text("hello")
    (class_folders / "healthy" / "README").write_text("no extension")
    messages: list[str] = []
    report = ingest(class_folders, tmp_path / "ds", IngestOptions(size=16), workers=1, log=messages.append)
    assert report.ignored == {"not_image": 4}
    assert "ignored not_image: 4 (.gif 2, .txt 1, no extension 1)" in messages[-1]
    assert load_dataset(tmp_path / "ds").manifest.ignored == {"not_image": 4}  # the manifest's record is as before


def test_stratified_split_and_labels_match_folders(class_folders, tmp_path):
    ds = load_dataset(ingest(class_folders, tmp_path / "ds", IngestOptions(size=16), workers=1, **QUIET).out)
    assert ds.classes == sorted(COLOURS)
    for s, expected in (("train", 14), ("val", 3), ("test", 3)):  # 20 per class at 70/15/15
        assert ds.manifest.splits[s].per_class == {c: expected for c in COLOURS}
        labels = np.asarray(ds[s].labels)
        for f, y in zip(ds[s].files, labels):
            assert f.split("/")[0] == ds.classes[y]
        # The pixels of each row really come from the named file (colour check).
        for row, y in zip(np.asarray(ds[s].images), labels):
            target = np.array(COLOURS[ds.classes[y]])
            assert np.abs(row.reshape(-1, 3).mean(0) - target).max() < 20


def test_duplicates_never_leak_across_splits(tmp_path):
    root = make_class_folders(tmp_path / "photos", per_class=12)
    for c in COLOURS:  # three copies of one image per class
        src = root / c / "img_01.jpg"
        for k in range(2):
            shutil.copy(src, root / c / f"copy_{k}.jpg")
    for seed in range(5):
        ds = load_dataset(ingest(root, tmp_path / f"ds{seed}", IngestOptions(size=16, seed=seed),
                                 workers=1, **QUIET).out)
        where = {}
        for s in ("train", "val", "test"):
            for f in ds[s].files:
                where[f] = s
        for c in COLOURS:
            assert len({where[f"{c}/img_01.jpg"], where[f"{c}/copy_0.jpg"], where[f"{c}/copy_1.jpg"]}) == 1
        assert ds.manifest.duplicates.groups == 3


def test_given_split_preserved_and_cross_split_duplicate_dropped(tmp_path):
    root = tmp_path / "photos"
    for k, (s, n) in enumerate((("train", 6), ("val", 2), ("test", 2))):
        for c, colour in COLOURS.items():
            d = root / s / c
            d.mkdir(parents=True)
            for i in range(n):
                (d / f"{s}_{i}.jpg").write_bytes(encode(photo(10_000 * k + 100 * len(c) + i, colour)))
    shutil.copy(root / "train" / "rust" / "train_0.jpg", root / "test" / "rust" / "leak.jpg")
    out = tmp_path / "ds"
    ingest(root, out, IngestOptions(size=16), workers=1, **QUIET)
    ds = load_dataset(out)
    assert ds.manifest.source_layout == "split_folders"
    for s, n in (("train", 6), ("val", 2), ("test", 2)):
        assert ds.manifest.splits[s].per_class == {c: n for c in COLOURS}
        assert all(f.startswith(f"{s}/") for f in ds[s].files)
    assert _read_rejected(out) == {"leak.jpg": "duplicate_across_splits"}
    said: list[str] = []  # a --split of a folder already split applied to nothing there, without a word
    ingest(root, tmp_path / "ds2", IngestOptions(size=16, ratios=(0.5, 0.25, 0.25)), workers=1, log=said.append)
    assert any(line.startswith(f"note: {root.resolve()} is already split into train/val/test folders, which are "
                               "kept as they are: --split 50/25/25 applies only to photos added by --also")
               for line in said), said
    assert load_dataset(tmp_path / "ds2").manifest.splits["val"].per_class == {c: 2 for c in COLOURS}


def test_deterministic_for_fixed_seed(class_folders, tmp_path):
    a = ingest(class_folders, tmp_path / "a", IngestOptions(size=16, seed=3), workers=2, **QUIET).out
    b = ingest(class_folders, tmp_path / "b", IngestOptions(size=16, seed=3), workers=1, **QUIET).out
    c = ingest(class_folders, tmp_path / "c", IngestOptions(size=16, seed=4), workers=1, **QUIET).out
    for name in ("train_images.npy", "train_labels.npy", "train_files.txt", "test_files.txt"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    assert ma == mb
    assert (a / "test_files.txt").read_text() != (c / "test_files.txt").read_text()


def test_mean_std_on_train_scale_0_1(class_folders, tmp_path):
    ds = load_dataset(ingest(class_folders, tmp_path / "ds", IngestOptions(size=16), workers=1, **QUIET).out)
    x = np.asarray(ds["train"].images, np.float64) / 255.0
    np.testing.assert_allclose(ds.mean, x.mean(axis=(0, 1, 2)), atol=1e-5)
    np.testing.assert_allclose(ds.std, x.std(axis=(0, 1, 2)), atol=1e-5)


def test_rerun_unchanged_does_no_work_and_changes_trigger_rebuild(class_folders, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    ingest(class_folders, out, IngestOptions(size=16), workers=1, **QUIET)
    calls = []
    real = ingest_mod._decode_all
    monkeypatch.setattr(ingest_mod, "_decode_all", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert ingest(class_folders, out, IngestOptions(size=16), workers=1, **QUIET).up_to_date
    assert calls == []
    assert not ingest(class_folders, out, IngestOptions(size=24), workers=1, **QUIET).up_to_date
    assert len(calls) == 1 and load_dataset(out).image_size == 24
    (class_folders / "rust" / "new.jpg").write_bytes(encode(photo(4242, (200, 120, 30))))
    assert not ingest(class_folders, out, IngestOptions(size=24), workers=1, **QUIET).up_to_date
    assert len(calls) == 2 and "rust/new.jpg" in sum((load_dataset(out)[s].files for s in
                                                      ("train", "val", "test")), [])


def test_interrupted_run_keeps_previous_output(class_folders, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    ingest(class_folders, out, IngestOptions(size=16), workers=1, **QUIET)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ingest_mod, "_write_splits", boom)
    with pytest.raises(KeyboardInterrupt):
        ingest(class_folders, out, IngestOptions(size=24), workers=1, **QUIET)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "photos"]  # temp folder removed
    load_dataset(out)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_worker_processes_work_under_every_start_method(class_folders, tmp_path, method):
    """macOS starts worker processes with "spawn" and Python 3.14 on Linux with "forkserver" (both import the
    task functions afresh, without the parent's memory): `python -m leaflens preprocess` and `data synth` with
    two workers give the same bytes as one process."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import multiprocessing\nmultiprocessing.set_start_method({method!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}

    def leaflens(*args: str) -> None:
        out = subprocess.run([sys.executable, "-m", "leaflens", *args, "--workers", "2"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]

    probe = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == method  # the parent really uses it
    leaflens("preprocess", "--src", str(class_folders), "--out", str(tmp_path / "two"), "--size", "16",
             "--no-progress")
    one = ingest(class_folders, tmp_path / "one", IngestOptions(size=16), workers=1, **QUIET).out
    for name in ("train_images.npy", "val_images.npy", "test_images.npy", "train_files.txt", "rejected.jsonl"):
        assert (tmp_path / "two" / name).read_bytes() == (one / name).read_bytes(), name
    leaflens("data", "synth", "--out", str(tmp_path / "synth"), "--per-class", "3", "--size", "48")
    assert len(list((tmp_path / "synth").rglob("*.jpg"))) >= 8 * 3


def test_killed_process_keeps_previous_output_and_stale_temp_is_cleaned(tmp_path):
    root = make_class_folders(tmp_path / "photos", per_class=60)
    out = tmp_path / "ds"
    ingest(root, out, IngestOptions(size=16), workers=1, **QUIET)
    before = (out / "train_images.npy").read_bytes()
    cmd = [sys.executable, "-m", "leaflens", "preprocess", "--src", str(root), "--out", str(out),
           "--size", "96", "--workers", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline and not list(tmp_path.glob(".ds.tmp-*/staging.bin")):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob(".ds.tmp-*")), "the run finished before it could be interrupted"
    assert (out / "train_images.npy").read_bytes() == before
    assert load_dataset(out).image_size == 16
    ingest(root, out, IngestOptions(size=24), workers=1, **QUIET)
    assert not list(tmp_path.glob(".ds.tmp-*")), "stale temporary folder of the killed run not removed"


def test_manifest_validation_refuses_missing_truncated_altered(class_folders, tmp_path):
    out = ingest(class_folders, tmp_path / "ds", IngestOptions(size=16), workers=1, **QUIET).out
    path = out / "val_images.npy"
    data = path.read_bytes()
    altered = bytearray(data)
    altered[-1] ^= 0xFF
    path.write_bytes(bytes(altered))
    load_dataset(out, verify=False)  # same length: only the checksum can tell
    with pytest.raises(DatasetError, match=r"val_images\.npy was altered: .*`leaflens preprocess --force` with its "
                                           r"--src and --out builds it again"):
        load_dataset(out)
    path.write_bytes(data[:-10])
    with pytest.raises(DatasetError, match=r"val_images\.npy is truncated"):
        load_dataset(out, verify=False)
    path.unlink()
    with pytest.raises(DatasetError, match=r"val_images\.npy is missing"):
        load_dataset(out)
    path.write_bytes(data)
    load_dataset(out)
    (out / "test_labels.npy").unlink()
    with pytest.raises(DatasetError, match=r"test_labels\.npy is missing"):
        load_dataset(out)
    (out / "manifest.json").unlink()
    with pytest.raises(DatasetError, match=r"manifest\.json is missing"):
        load_dataset(out)


def test_unlabeled_split(class_folders, tmp_path):
    extra = tmp_path / "more"
    (class_folders / "unlabeled").mkdir()
    extra.mkdir()
    for i in range(3):
        (class_folders / "unlabeled" / f"u{i}.jpg").write_bytes(encode(photo(7000 + i, (90, 90, 90))))
        (extra / f"x{i}.png").write_bytes(encode(photo(8000 + i, (90, 90, 90)), "PNG"))
    (extra / "broken.jpg").write_bytes(b"")
    out = tmp_path / "ds"
    report = ingest(class_folders, out, IngestOptions(size=16), unlabeled=extra, workers=1, **QUIET)
    ds = load_dataset(out)
    assert "unlabeled" not in ds.classes and len(ds.classes) == 3
    u = ds["unlabeled"]
    assert len(u) == 6 and u.labels is None and not (out / "unlabeled_labels.npy").exists()
    assert ds.manifest.splits["unlabeled"].labels == "absent"
    assert report.rejected == {"unlabeled": 1}
    assert sum(f.startswith("unlabeled/") for f in u.files) == 3


def test_exif_rotation_honoured_in_dataset(tmp_path):
    root = make_class_folders(tmp_path / "photos", per_class=4)
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20] = (255, 0, 0)
    arr[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6
    (root / "rust" / "rotated.jpg").write_bytes(encode(Image.fromarray(arr), quality=95, exif=exif.tobytes()))
    ds = load_dataset(ingest(root, tmp_path / "ds", IngestOptions(size=20, ratios=(1, 0, 0)), workers=1,
                             **QUIET).out)
    row = np.asarray(ds["train"].images)[ds["train"].files.index("rust/rotated.jpg")].astype(int)
    assert row[:8, :, 0].mean() > 200 and row[-8:, :, 2].mean() > 200  # red on top, blue below


def test_unsafe_outputs_refused(class_folders, tmp_path):
    with pytest.raises(IngestError, match="inside the source"):
        ingest(class_folders, class_folders / "out", IngestOptions(size=16), workers=1, **QUIET)
    other = tmp_path / "docs"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    with pytest.raises(IngestError, match="not a leaflens dataset"):
        ingest(class_folders, other, IngestOptions(size=16), workers=1, **QUIET)
    assert (other / "thesis.tex").read_text() == "precious"


def test_sizes_that_cannot_be_stored_are_refused_before_any_work(class_folders, tmp_path, monkeypatch):
    """A typo such as --size 100000 would have decoded every photo to 30 GB; a size that fits the rules but not
    the disk is refused before decoding, with what it needs and what is free; nothing is left behind."""
    with pytest.raises(IngestError, match="image size 100000 is too large .at most 2048"):
        ingest(class_folders, tmp_path / "big", IngestOptions(size=100000), workers=1, **QUIET)
    free = 10 * 1024 ** 2  # 10 MiB: 60 photos at 512 px need 2 x 60 x 512 x 512 x 3 bytes = 90 MiB
    monkeypatch.setattr(ingest_mod.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free, 0, free))
    with pytest.raises(IngestError, match=r"60 photos at 512 px need about 90 MiB .* has 10 MiB free: choose a"):
        ingest(class_folders, tmp_path / "ds", IngestOptions(size=512), workers=1, **QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"]  # no dataset, no temporary folder
    ingest(class_folders, tmp_path / "ds", IngestOptions(size=16), workers=1, **QUIET)  # 16 px fits


SHARED_IBEANS = REPO / ".." / "shared" / "data" / "ibeans"


def test_real_ibeans_sample(tmp_path):
    if not SHARED_IBEANS.is_dir():
        pytest.skip(f"real iBeans photos not present at {SHARED_IBEANS.resolve()}")
    root = tmp_path / "ibeans"
    for s in ("train", "val", "test"):
        for cdir in sorted((SHARED_IBEANS / s).iterdir()):
            (root / s / cdir.name).mkdir(parents=True)
            for f in sorted(cdir.iterdir())[:3]:  # links, not copies
                (root / s / cdir.name / f.name).symlink_to(f.resolve())
    cmd = [sys.executable, "-m", "leaflens", "preprocess", "--src", str(root), "--out",
           str(tmp_path / "ds"), "--size", "64", "--no-progress"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    ds = load_dataset(tmp_path / "ds")
    assert ds.classes == ["angular_leaf_spot", "bean_rust", "healthy"]
    for s in ("train", "val", "test"):
        assert ds.manifest.splits[s].per_class == {c: 3 for c in ds.classes}
        assert all(f.startswith(f"{s}/") for f in ds[s].files)
    assert 0.2 < float(ds.mean[1]) < 0.8 and np.asarray(ds["train"].images).std() > 20
