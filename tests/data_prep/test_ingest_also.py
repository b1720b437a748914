"""`leaflens preprocess --also DIR`: extra labelled photos (the web app's corrections folder) merged into the
source's classes; not_a_leaf/ skipped with a note; unknown classes, split folders and overlaps refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dp_helpers import COLOURS, encode, make_class_folders, photo

from leaflens.data_prep.ingest import IngestError, IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.data_prep.scan import NOT_A_LEAF, ScanError, scan_source
from leaflens.pipeline.cli import main


def corrections_folder(root, per_class: dict[str, int], seed: int = 5000, not_a_leaf: int = 0):
    """What `leaflens serve` leaves: class folders of generated names, a log, maybe not_a_leaf/."""
    for c, n in per_class.items():
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (root / c / f"20261201-1200{i:02d}-{seed + i:08x}.jpg").write_bytes(encode(photo(seed + i, COLOURS[c])))
        seed += 100
    if not_a_leaf:
        (root / NOT_A_LEAF).mkdir(parents=True)
        for i in range(not_a_leaf):
            (root / NOT_A_LEAF / f"n{i}.jpg").write_bytes(encode(photo(9000 + i, (90, 90, 90))))
    (root / "corrections.jsonl").write_text('{"file": "x"}\n', encoding="utf-8")
    (root / ".rust.tmp-1-ab.jpg").write_bytes(b"half a photo")  # a temporary: hidden, never read
    return root


def test_scan_merges_extra_photos_into_the_sources_classes(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=5)
    extra = corrections_folder(tmp_path / "corrections", {"rust": 3, "healthy": 1}, not_a_leaf=2)
    plain = scan_source(src)
    scan = scan_source(src, also=[extra])
    assert scan.classes == plain.classes and scan.also == [str(extra.resolve())] and scan.also_files == 4
    added = scan.files[len(plain.files):]
    assert sorted((scan.classes[f.label], f.path.split("/")[-2]) for f in added) == \
        [("healthy", "healthy")] + [("rust", "rust")] * 3
    assert all(f.split is None and f.rel == f.path for f in added)  # recorded by absolute path, split later
    assert scan.ignored.get(NOT_A_LEAF) == 2 and "not_image" not in scan.ignored  # the log is not counted
    assert scan.stats_digest != plain.stats_digest


def test_preprocess_includes_corrections_and_notes_not_a_leaf(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=10)
    extra = corrections_folder(tmp_path / "corrections", {"rust": 4}, not_a_leaf=3)
    out = tmp_path / "ds"
    said: list[str] = []
    report = ingest(src, out, IngestOptions(size=16), workers=1, also=[extra], log=said.append)
    ds = load_dataset(out)
    files = [f for s in ("train", "val", "test") for f in ds[s].files]
    from_extra = [f for f in files if f.startswith(str(extra.resolve()))]
    assert len(files) == 34 and len(from_extra) == 4 and all("/rust/" in f for f in from_extra)
    rust = ds.classes.index("rust")
    for s in ("train", "val", "test"):  # the label of every extra row is its folder's class
        labels = np.asarray(ds[s].labels)
        for f, y in zip(ds[s].files, labels):
            if f in from_extra:
                assert y == rust
    assert sum(ds.manifest.splits[s].per_class["rust"] for s in ("train", "val", "test")) == 14
    assert report.ignored[NOT_A_LEAF] == 3 and ds.manifest.ignored[NOT_A_LEAF] == 3
    assert ds.manifest.also_sources == (str(extra.resolve()),)  # the manifest says corrections went in
    from leaflens.pipeline.distill import _also_counts
    assert sum(_also_counts(ds)["also"]["counts"].values()) == 4
    assert any("4 labelled photo(s)" in m for m in said) and any("not_a_leaf/ folders skipped" in m for m in said)
    # a new correction makes the dataset out of date; without --also it is rebuilt as before
    again = ingest(src, out, IngestOptions(size=16), workers=1, also=[extra], log=said.append)
    assert again.up_to_date
    (extra / "rust" / "20261202-000000-feedbeef.jpg").write_bytes(encode(photo(7777, COLOURS["rust"])))
    assert not ingest(src, out, IngestOptions(size=16), workers=1, also=[extra], log=said.append).up_to_date
    assert load_dataset(out).manifest.splits["train"].count + load_dataset(out).manifest.splits["val"].count + \
        load_dataset(out).manifest.splits["test"].count == 35


def test_split_folders_source_takes_extra_photos_into_train(tmp_path):
    src = tmp_path / "photos"
    for s in ("train", "val", "test"):
        make_class_folders(src / s, per_class=4, seed={"train": 1, "val": 2, "test": 3}[s])
    extra = corrections_folder(tmp_path / "corrections", {"blight": 2})
    out = tmp_path / "ds"
    ingest(src, out, IngestOptions(size=16), workers=1, also=[extra], log=lambda m: None)
    ds = load_dataset(out)
    assert ds.manifest.splits["train"].per_class["blight"] == 6
    assert ds.manifest.splits["val"].per_class["blight"] == ds.manifest.splits["test"].per_class["blight"] == 4


def test_refuses_unknown_classes_split_folders_and_overlaps(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=3)
    unknown = corrections_folder(tmp_path / "c1", {"rust": 1})
    (unknown / "mildew").mkdir()
    (unknown / "mildew" / "m.jpg").write_bytes(encode(photo(1, (10, 10, 10))))
    with pytest.raises(ScanError, match=r"'mildew' are not classes of the source .*blight, healthy, rust"):
        scan_source(src, also=[unknown])
    split = tmp_path / "c2"
    (split / "train" / "rust").mkdir(parents=True)
    with pytest.raises(ScanError, match="'train'; an extra folder holds class folders only"):
        scan_source(src, also=[split])
    with pytest.raises(ScanError, match="overlaps the source folder"):
        scan_source(src, also=[src / "rust"])
    ok = corrections_folder(tmp_path / "c3", {"rust": 1})
    with pytest.raises(ScanError, match="given twice"):
        scan_source(src, also=[ok, ok])
    with pytest.raises(ScanError, match="does not exist"):
        scan_source(src, also=[tmp_path / "nowhere"])


def test_cli_also_is_repeatable_and_errors_name_the_folder(tmp_path, capsys):
    src = make_class_folders(tmp_path / "photos", per_class=6)
    a = corrections_folder(tmp_path / "a", {"rust": 2})
    b = corrections_folder(tmp_path / "b", {"healthy": 3}, seed=6000)
    out = tmp_path / "ds"
    assert main(["preprocess", "--src", str(src), "--out", str(out), "--size", "16", "--workers", "1",
                 "--no-progress", "--also", str(a), "--also", str(b)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    total = sum(v["count"] for v in manifest["splits"].values())
    assert total == 18 + 5
    assert main(["preprocess", "--src", str(src), "--out", str(out), "--also", str(tmp_path / "none")]) == 1
    assert "--also folder" in capsys.readouterr().err


def test_a_project_moved_as_a_whole_stays_up_to_date_and_datasets_of_before_are_not_rebuilt(tmp_path):
    """The fingerprint names the photos relative to the dataset folder: a project moved or renamed with its
    photos (copied to a GPU machine) is still up to date, so `make` does not retrain everything after it; a
    dataset fingerprinted the old way (absolute paths) is still up to date where it was built."""
    import shutil

    from leaflens.data_prep.ingest import _fingerprint
    from leaflens.data_prep.manifest import manifest_self_digest

    old = tmp_path / "old" / "project"
    src = make_class_folders(old / "photos", per_class=6)
    extra = corrections_folder(old / "corrections", {"rust": 2})
    unl = make_class_folders(old / "unlabelled", per_class=1, seed=9)
    opts = IngestOptions(size=16)
    out = old / "dataset"
    ingest(src, out, opts, workers=1, also=[extra], unlabeled=unl, log=lambda s: None)
    written = (out / "manifest.json").read_bytes()
    shutil.move(tmp_path / "old", tmp_path / "new home")
    new = tmp_path / "new home" / "project"
    said: list[str] = []
    again = ingest(new / "photos", new / "dataset", opts, workers=1, also=[new / "corrections"],
                   unlabeled=new / "unlabelled", log=said.append)
    assert again.up_to_date and (new / "dataset" / "manifest.json").read_bytes() == written
    assert any("up to date" in m for m in said)
    (new / "corrections" / "rust" / "20261204-000000-feedbeef.jpg").write_bytes(encode(photo(77, COLOURS["rust"])))
    assert not ingest(new / "photos", new / "dataset", opts, workers=1, also=[new / "corrections"],
                      unlabeled=new / "unlabelled", log=lambda s: None).up_to_date

    # a dataset of an earlier version, fingerprinted with absolute paths, where it was built
    scan = scan_source(new / "photos", new / "unlabelled", [new / "corrections"])
    manifest = json.loads((new / "dataset" / "manifest.json").read_text())
    manifest["input_fingerprint"] = _fingerprint(scan, opts, str((new / "unlabelled").resolve()))
    manifest["manifest_sha256"] = manifest_self_digest(manifest)
    (new / "dataset" / "manifest.json").write_text(json.dumps(manifest))
    assert ingest(new / "photos", new / "dataset", opts, workers=1, also=[new / "corrections"],
                  unlabeled=new / "unlabelled", log=lambda s: None).up_to_date


def test_photos_copied_or_touched_with_the_same_contents_keep_their_dataset(tmp_path):
    """`cp -r` without -p, an unpacked archive or `touch` gives every photo a new time stamp: the dataset was
    built again, its manifest rewritten, and `make` fine-tuned the teacher and trained the students again for
    the same photos. Now the contents are compared when the time stamps differ; a changed photo (even one of
    the same size and time stamp) still rebuilds, and a dataset without the contents' fingerprint (built by an
    earlier version) is built again as before."""
    import os
    import shutil

    old = tmp_path / "old"
    src = make_class_folders(old / "photos", per_class=6)
    (src / "rust" / "empty.jpg").write_bytes(b"")  # rejected, and counted by its reason
    extra = corrections_folder(old / "corrections", {"rust": 2})
    opts = IngestOptions(size=16)
    out = tmp_path / "dataset"
    ingest(src, out, opts, workers=1, also=[extra], log=lambda s: None)
    written = (out / "manifest.json").read_bytes()
    assert json.loads(written)["input_content_fingerprint"].startswith("sha256:")

    new = tmp_path / "new"
    shutil.copytree(old, new, copy_function=shutil.copy)  # contents, not time stamps
    shutil.rmtree(old)
    new.rename(old)
    for f in old.rglob("*"):
        os.utime(f, (1_700_000_000, 1_700_000_000))
    said: list[str] = []
    from leaflens.data_prep import ingest as ingest_module

    reads: list[str] = []
    real_read = ingest_module.read_source

    def counted(path, *args, **kwargs):
        reads.append(str(path))
        return real_read(path, *args, **kwargs)

    ingest_module.read_source = counted
    try:
        assert ingest(src, out, opts, workers=1, also=[extra], log=said.append).up_to_date
        assert (out / "manifest.json").read_bytes() == written
        assert any("same contents" in m for m in said), said
        photos = len(reads)
        assert photos == 21  # 18 photos, the empty file and 2 corrections: read once to compare their contents
        assert ingest(src, out, opts, workers=1, also=[extra], log=lambda s: None).up_to_date
        assert len(reads) == photos  # the new time stamps were noted: not read again
        (src / "rust" / "new.jpg").write_bytes(encode(photo(4242, COLOURS["rust"])))
        assert not ingest(src, out, opts, workers=1, also=[extra], log=lambda s: None).up_to_date
        # another photo: the contents are not compared first, only decoded (22), the rejected file hashed (1)
        assert len(reads) == photos + 22 + 1
    finally:
        ingest_module.read_source = real_read
    (src / "rust" / "new.jpg").unlink()
    ingest(src, out, opts, workers=1, also=[extra], log=lambda s: None)

    victim = sorted((src / "healthy").iterdir())[0]
    stamp = victim.stat()
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, same time stamp, other bytes
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    for f in old.rglob("*"):
        os.utime(f, (1_700_000_100, 1_700_000_100))
    assert not ingest(src, out, opts, workers=1, also=[extra], log=lambda s: None).up_to_date

    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["input_content_fingerprint"]  # as an earlier version wrote it
    from leaflens.data_prep.manifest import manifest_self_digest

    manifest["manifest_sha256"] = manifest_self_digest(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    (src / "rust" / "empty.jpg").touch()
    assert not ingest(src, out, opts, workers=1, also=[extra], log=lambda s: None).up_to_date


def test_a_photo_folder_inside_the_output_folder_is_refused_not_deleted(tmp_path):
    """Rebuilding a dataset replaces its folder whole: photos kept inside it (the source, extra or unlabelled
    photos) would go with it."""
    src = make_class_folders(tmp_path / "photos", per_class=5)
    out = tmp_path / "ds"
    ingest(src, out, IngestOptions(size=16), workers=1, log=lambda s: None)
    inside = corrections_folder(out / "corrections", {"rust": 1})
    unlabeled = out / "unl"
    unlabeled.mkdir()
    (unlabeled / "u.jpg").write_bytes(encode(photo(77, COLOURS["rust"])))
    moved = out / "photos"
    src.rename(moved)
    photos = sorted(p for p in moved.rglob("*") if p.is_file())
    other = make_class_folders(tmp_path / "other", per_class=5)
    for kwargs, option in (({"also": [inside]}, "--also"), ({"unlabeled": unlabeled}, "--unlabeled")):
        with pytest.raises(IngestError, match=f"{option} .* is inside the output folder"):
            ingest(other, out, IngestOptions(size=16), force=True, workers=1, log=lambda s: None, **kwargs)
    with pytest.raises(IngestError, match="--src .* is inside the output folder"):
        ingest(moved, out, IngestOptions(size=16), force=True, workers=1, log=lambda s: None)
    assert sorted(p for p in moved.rglob("*") if p.is_file()) == photos and len(photos) >= 15
    assert (inside / "rust").is_dir() and (unlabeled / "u.jpg").is_file()


def _split_of(out) -> dict[str, str]:
    ds = load_dataset(out)
    return {f: s for s in ("train", "val", "test") for f in ds[s].files}


def test_corrections_move_none_of_the_sources_photos_between_splits(tmp_path):
    """One added correction moved 5 of 110 source photos between splits (some from test into train): the
    retrained model trained on photos the old one was tested on. The source is now split as without --also,
    and each correction's split comes from its own bytes, so a later correction moves no earlier one."""
    src = make_class_folders(tmp_path / "photos", per_class=20)
    ingest(src, tmp_path / "plain", IngestOptions(size=16), workers=1, log=lambda m: None)
    plain = _split_of(tmp_path / "plain")
    extra = corrections_folder(tmp_path / "corrections", {"rust": 12, "healthy": 12})
    ingest(src, tmp_path / "with", IngestOptions(size=16), workers=1, also=[extra], log=lambda m: None)
    first = _split_of(tmp_path / "with")
    assert {f: s for f, s in first.items() if f in plain} == plain
    added = {f: s for f, s in first.items() if f not in plain}
    assert len(added) == 24 and "train" in added.values() and set(added.values()) - {"train"}  # tested on too
    corrections_folder(extra, {"rust": 3}, seed=8000)  # three more corrections
    ingest(src, tmp_path / "more", IngestOptions(size=16), workers=1, also=[extra], log=lambda m: None)
    more = _split_of(tmp_path / "more")
    assert {f: s for f, s in more.items() if f in first} == first and len(more) == len(first) + 3


def test_a_correction_of_a_source_photo_leaves_the_sources_copy_where_it_is(tmp_path):
    """With the source's own train/val/test folders, correcting a test photo (same class) took it out of test
    as a "duplicate across splits" (the correction went to train, an earlier split). The correction's copy is
    the one left out now, and said; under another class both stay, as a label conflict."""
    src = tmp_path / "photos"
    for s in ("train", "val", "test"):
        make_class_folders(src / s, per_class=4, seed={"train": 1, "val": 2, "test": 3}[s])
    extra = tmp_path / "corrections"
    (extra / "rust").mkdir(parents=True)
    (extra / "healthy").mkdir(parents=True)
    tested = sorted((src / "test" / "rust").iterdir())
    (extra / "rust" / "same.jpg").write_bytes(tested[0].read_bytes())
    (extra / "healthy" / "other.jpg").write_bytes(tested[1].read_bytes())
    said: list[str] = []
    ingest(src, tmp_path / "ds", IngestOptions(size=16), workers=1, also=[extra], log=said.append)
    ds = load_dataset(tmp_path / "ds")
    assert ds.manifest.splits["test"].per_class["rust"] == 4  # nothing left out of test
    assert {f"test/rust/{tested[0].name}", f"test/rust/{tested[1].name}"} <= set(ds["test"].files)
    rejected = [json.loads(line) for line in (tmp_path / "ds" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["path"].endswith("same.jpg"), r["reason"]) for r in rejected] == [(True, "duplicate_of_source")]
    assert str((extra / "healthy" / "other.jpg").resolve()) in ds["train"].files  # a label conflict, reported
    assert any("already in the source under the same class" in m for m in said)


def test_a_correction_alike_to_two_source_photos_moves_neither(tmp_path):
    """A correction within the near-copy distance of two source photos that are not near copies of each other
    joined them into one group, which reshuffled their whole class (8 photos moved, some out of test). The
    source is now grouped and split on its own photos."""
    from PIL import Image

    from leaflens.data_prep.ingest import IngestOptions as Opts
    from leaflens.data_prep.near_dup import hamming, photo_hashes

    def smooth(seed: int) -> np.ndarray:  # large structures, so a blend moves the perceptual hash gradually
        rng = np.random.default_rng(seed)
        return np.asarray(Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize(
            (64, 64), Image.Resampling.BICUBIC)).astype(float)

    a, c = smooth(1), smooth(2)

    def blend(t: float) -> np.ndarray:
        return np.clip((1 - t) * a + t * c, 0, 255).astype(np.uint8)

    def dist(x: np.ndarray, y: np.ndarray) -> int:
        hx, hy = photo_hashes(x), photo_hashes(y)
        return min(int(hamming(hx[i], hy[j])) for i in range(len(hx)) for j in range(len(hy)))

    base = blend(0.0)
    t = next((t for t in np.linspace(0.02, 1, 50) if dist(base, blend(t)) > 8 and dist(base, blend(t / 2)) <= 8
              and dist(blend(t / 2), blend(t)) <= 8), None)
    if t is None:
        pytest.skip("no blend bridges two photos with these hashes")
    src = make_class_folders(tmp_path / "photos", per_class=12)
    Image.fromarray(base).save(src / "rust" / "A.png")
    Image.fromarray(blend(t)).save(src / "rust" / "B.png")
    extra = tmp_path / "corrections"
    (extra / "rust").mkdir(parents=True)
    Image.fromarray(blend(t / 2)).save(extra / "rust" / "M.png")
    ingest(src, tmp_path / "plain", Opts(size=32), workers=1, log=lambda m: None)
    ingest(src, tmp_path / "with", Opts(size=32), workers=1, also=[extra], log=lambda m: None)
    plain, both = _split_of(tmp_path / "plain"), _split_of(tmp_path / "with")
    assert {f: s for f, s in both.items() if f in plain} == plain


def test_class_names_in_two_unicode_forms_are_one_name(tmp_path, capsys):
    """A class folder copied from macOS spells an accented name decomposed (NFD): --also refused it as "not a
    class of the source" printing two names that look the same, a source holding both forms gave two classes
    that look the same, and evaluate refused the folder."""
    import shutil
    import unicodedata

    composed, decomposed = unicodedata.normalize("NFC", "mancha_é"), unicodedata.normalize("NFD", "mancha_é")
    assert composed != decomposed
    src = make_class_folders(tmp_path / "photos", per_class=6)
    (src / "rust").rename(src / composed)
    extra = corrections_folder(tmp_path / "corrections", {"rust": 2})
    (extra / "rust").rename(extra / decomposed)
    scan = scan_source(src, also=[extra])
    assert scan.classes.count(composed) == 1 and decomposed not in scan.classes
    assert sum(f.extra and scan.classes[f.label] == composed for f in scan.files) == 2

    from leaflens.pipeline.evaluate import class_folder_photos

    files, labels = class_folder_photos(extra, ["healthy", composed, "blight"])  # a model's classes, composed
    assert len(files) == 2 and set(labels.tolist()) == {1}
    both = sorted([composed, decomposed, "bean"])  # a model trained with both forms: the exact name wins
    files, labels = class_folder_photos(extra, both)
    assert set(labels.tolist()) == {both.index(decomposed)}

    shutil.copytree(src / composed, src / decomposed)
    with pytest.raises(ScanError, match=r"same name written in two Unicode forms \(U\+0301 and U\+00E9"):
        scan_source(src)


def test_an_unlabelled_photo_labelled_in_the_app_leaves_the_unlabelled_pool(tmp_path):
    """The web app's correction of a photo from unlabeled/ is the same bytes under a class: it used to join
    val or test while its unlabelled copy stayed for the teacher and students to train on (a leak preprocess
    then warned about). The unlabelled copy is left out now, and said."""
    src = make_class_folders(tmp_path / "photos", per_class=8)
    (src / "unlabeled").mkdir()
    for i in range(6):
        (src / "unlabeled" / f"u{i}.jpg").write_bytes(encode(photo(7000 + i, COLOURS["rust"])))
    extra = tmp_path / "corrections"
    (extra / "rust").mkdir(parents=True)
    for i in range(6):  # enough that some land in val or test by their bytes
        (extra / "rust" / f"c{i}.jpg").write_bytes((src / "unlabeled" / f"u{i}.jpg").read_bytes())
    said: list[str] = []
    ingest(src, tmp_path / "ds", IngestOptions(size=16), workers=1, also=[extra], log=said.append)
    ds = load_dataset(tmp_path / "ds")
    assert "unlabeled" not in ds.splits or not len(ds["unlabeled"])  # all six have their label now
    labelled = [f for s in ("train", "val", "test") for f in ds[s].files if f.startswith(str(extra.resolve()))]
    assert len(labelled) == 6
    assert any(str(extra.resolve()) in f for s in ("val", "test") for f in ds[s].files)  # the case that leaked
    rejected = [json.loads(line) for line in (tmp_path / "ds" / "rejected.jsonl").read_text().splitlines()]
    assert sorted(r["path"] for r in rejected if r["reason"] == "labelled_by_correction") == \
        [f"unlabeled/u{i}.jpg" for i in range(6)]
    assert any("6 unlabelled photo(s) have a label now from --also" in m for m in said)
    assert not any("leakage" in m and "unlabelled" in m for m in said)
