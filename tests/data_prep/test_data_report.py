"""The data report of `leaflens preprocess` (issue #21, items 3-4): duplicates, leakage, label conflicts,
class balance, the metadata shortcut check, --dedupe and --check, on tiny photo folders made here."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dp_helpers import make_class_folders
from PIL import Image

from leaflens.data_prep import near_dup
from leaflens.data_prep.data_report import DATA_REPORT_NAME, DataReport, read_data_report
from leaflens.data_prep.ingest import IngestError, IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.data_prep.near_dup import (
    COLOUR_THRESHOLD,
    colour_distance,
    colour_signatures,
    find_copies,
    hamming,
    near_pairs,
    photo_hashes,
)
from leaflens.data_prep.shortcut import PhotoMeta, check_shortcuts

SIZE = 32  # stored size; --check decodes at the same size, so its hashes equal a build's


def scene(seed: int, w: int = 96, h: int = 72) -> Image.Image:
    """A photo-like image: smooth random shapes (low frequencies a perceptual hash sees) and a little noise."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.asarray(base, np.float32) + rng.normal(0, 6, (h, w, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def save(im: Image.Image, path: Path, fmt: str = "JPEG", **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    im.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}) | kw)
    path.write_bytes(buf.getvalue())
    return path


def given_splits(root: Path, counts=(("train", 8), ("val", 3), ("test", 3)), classes=("blight", "rust")) -> Path:
    """ROOT/{train,val,test}/<class>/ of distinct scenes."""
    for k, (split, n) in enumerate(counts):
        for c, cls in enumerate(classes):
            for i in range(n):
                save(scene(10_000 * k + 100 * c + i), root / split / cls / f"{split}_{i}.jpg")
    return root


def run(src: Path, out: Path | None, **kw):
    messages: list[str] = []
    opts = kw.pop("opts", IngestOptions(size=SIZE))
    report = ingest(src, out, opts, workers=1, log=messages.append, **kw)
    return report, messages


def warnings_of(messages: list[str]) -> list[str]:
    return [m for m in "\n".join(messages).splitlines() if m.startswith("warning:")]


def test_unlabelled_copies_of_validation_or_test_photos_are_leakage(tmp_path):
    """The teacher self-trains on the unlabelled photos: a copy of a val or test photo among them would be
    learnt and then scored. Warned about; --dedupe leaves the copies out (they were not even compared)."""
    src = given_splits(tmp_path / "photos")
    unl = src / "unlabeled"
    unl.mkdir()
    for i in range(4):
        save(scene(50_000 + i), unl / f"own_{i}.jpg")  # unlabelled photos of their own
    shutil.copy(src / "val" / "rust" / "val_0.jpg", unl / "u1.jpg")  # an exact copy
    scene(10_000 * 2 + 1).resize((80, 60)).save(unl / "u2.jpg", quality=70)  # test/blight/test_1.jpg, resized
    report, messages = run(src, tmp_path / "ds")
    (warned,) = [w for w in warnings_of(messages) if "unlabelled" in w]
    assert warned.startswith("warning: leakage: 2 unlabelled photos are copies of validation or test photos")
    assert sorted(report.data.unlabeled_copies) == ["unlabeled/u1.jpg = val/rust/val_0.jpg (val)",
                                                    "unlabeled/u2.jpg = test/blight/test_1.jpg (test)"]
    assert len(load_dataset(tmp_path / "ds")["unlabeled"]) == 6
    report, messages = run(src, tmp_path / "dd", opts=IngestOptions(size=SIZE, dedupe=True))
    assert len(load_dataset(tmp_path / "dd")["unlabeled"]) == 4 and "left out by --dedupe" in "\n".join(messages)
    # the --dedupe line counts them too (it said "removed 0 duplicates" beside "rejected 2 (duplicate: 2)")
    said = "\n".join(messages)
    assert "and 2 unlabelled photos copying validation or test photos (listed in data_report.json)" in said
    from leaflens.pipeline.report.markdown import _data_section  # noqa: PLC0415

    text = "\n".join(_data_section({"data": report.data.to_dict()}))
    assert "`--dedupe` left out 0 photos and 2 unlabelled copies of validation or test photos" in text


# ---------------------------------------------------------------------------- near duplicates
def test_altered_copies_are_near_and_different_photos_are_not():
    original = scene(1, 160, 120)
    stored = [np.asarray(original.resize((SIZE, SIZE)))]
    for copy in (original.resize((80, 60)), original.crop((5, 4, 155, 116))):  # resized; cropped ~3 %
        stored.append(np.asarray(copy.resize((SIZE, SIZE))))
    hashes = np.stack([photo_hashes(p) for p in stored]
                      + [photo_hashes(np.asarray(scene(s, 160, 120).resize((SIZE, SIZE)))) for s in range(2, 40)])
    i, j, d = near_pairs(hashes)
    assert {(int(a), int(b)) for a, b in zip(i, j)} == {(0, 1), (0, 2), (1, 2)}
    (group,) = find_copies(hashes).groups
    assert group.members == (0, 1, 2) and group.distance == max(int(x) for x in d)


def test_pair_search_in_blocks_finds_what_a_full_comparison_finds(monkeypatch):
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, np.iinfo(np.int64).max, (300, near_dup.HASH_COLUMNS), dtype=np.int64).astype(np.uint64)
    for a, b in ((3, 250), (10, 11), (120, 299)):  # plant near copies: a few flipped bits
        hashes[b] = hashes[a] ^ np.uint64(0b1011)
    hashes[77, 2] = hashes[5, 0] ^ np.uint64(1)  # 77's crop hash is near 5's plain one
    hashes[180, 4] = hashes[40, 0] ^ np.uint64(0b11)  # 180 turned (a TURNS column) is near 40's plain one
    full = hamming(hashes[:, None, 0], hashes[None, :, 0])
    for k in range(1, near_dup.HASH_COLUMNS):  # the crops and the turns, compared either way round
        cross = hamming(hashes[:, None, 0], hashes[None, :, k])
        full = np.minimum(full, np.minimum(cross, cross.T))
    want = {(a, b) for a, b in zip(*np.nonzero(np.triu(full <= 8, 1)))}
    monkeypatch.setattr(near_dup, "_BLOCK_ELEMENTS", 1000)  # 3 rows per block: many block boundaries
    i, j, _ = near_pairs(hashes)
    assert {(int(a), int(b)) for a, b in zip(i, j)} == want
    assert {(3, 250), (10, 11), (120, 299), (5, 77), (40, 180)} <= want
    hashes = np.concatenate([hashes, hashes[[10] * 50]])  # 50 more identical copies: merged before the search
    groups = find_copies(hashes).groups
    assert [g.members for g in groups] == [(3, 250), (5, 77), (10, 11, *range(300, 350)), (40, 180), (120, 299)]
    assert [g.distance for g in groups] == [3, 1, 3, 2, 3]


def tinted(seed: int, tint: tuple[float, float, float], w: int = 96, h: int = 72) -> Image.Image:
    """The grey shapes of ``scene(seed)`` in the colour ``tint``: two tints share their perceptual hash."""
    grey = np.asarray(scene(seed, w, h).convert("L"), np.float32)[..., None]
    return Image.fromarray(np.clip(grey * np.array(tint, np.float32), 0, 255).astype(np.uint8))


RED, BLUE = (1.25, 0.8, 0.45), (0.5, 0.85, 1.3)


def test_colour_signature_is_the_grid_mean_colour_and_a_brightened_copy_stays_close():
    original = scene(3, 160, 120)
    px = np.asarray(original.resize((SIZE, SIZE)))
    sig = colour_signatures(px)
    assert sig.shape == (3, 27) and sig.dtype == np.uint8
    square = np.asarray(original.resize((30, 30)), np.float64)  # 3x3 cells of 10x10 pixels
    want = square.reshape(3, 10, 3, 10, 3).mean(axis=(1, 3)).reshape(-1)
    assert np.abs(colour_signatures(square.astype(np.uint8))[0] - want).max() <= 0.5
    brighter = np.clip(px.astype(np.int16) + 12, 0, 255).astype(np.uint8)
    cropped = np.asarray(original.crop((5, 4, 155, 116)).resize((SIZE, SIZE)))
    assert colour_distance(sig, colour_signatures(brighter)) < 1.5
    assert colour_distance(sig, colour_signatures(cropped)) < COLOUR_THRESHOLD / 2
    assert colour_distance(sig, colour_signatures(np.ascontiguousarray(px[..., ::-1]))) > 2 * COLOUR_THRESHOLD


def test_photos_alike_in_grey_shapes_but_not_in_colour_are_look_alikes_not_copies():
    red, blue = (np.asarray(tinted(5, t, SIZE, SIZE)) for t in (RED, BLUE))
    copy = np.asarray(tinted(5, RED, 160, 120).resize((SIZE, SIZE)))  # the red one, resized
    other = np.asarray(scene(6, SIZE, SIZE))
    pixels = [red, blue, copy, other]
    hashes = np.stack([photo_hashes(p) for p in pixels])
    colours = np.stack([colour_signatures(p) for p in pixels])
    assert int(hamming(hashes[0, 0], hashes[1, 0])) <= 2  # one grey picture
    found = find_copies(hashes, colours)
    assert [g.members for g in found.groups] == [(0, 2)]
    assert found.look_alike_pairs == 2 and [(p.a, p.b) for p in found.look_alikes] == [(0, 1), (1, 2)]
    assert all(p.colour > COLOUR_THRESHOLD and p.bits <= 8 for p in found.look_alikes)
    assert [g.members for g in found.shape_groups] == [(0, 1, 2)]
    assert [g.members for g in find_copies(hashes).groups] == [(0, 1, 2)]  # grey shapes alone


def test_look_alikes_across_classes_are_listed_not_warned_and_kept_in_one_split(tmp_path):
    src = tmp_path / "photos"
    for c, cls in enumerate(("blight", "rust")):
        for i in range(10):
            save(scene(100 * c + i), src / cls / f"p{i}.jpg")
    save(tinted(999, RED), src / "blight" / "leaf_red.jpg")
    save(tinted(999, BLUE), src / "rust" / "leaf_blue.jpg")
    for seed in range(3):
        report, messages = run(src, tmp_path / f"ds{seed}", opts=IngestOptions(size=SIZE, seed=seed))
        d = report.data.duplicates
        assert (d.label_conflicts, d.within_split, d.across_splits) == (0, 0, 0) and warnings_of(messages) == []
        (pair,) = d.look_alikes
        assert d.look_alike_pairs == 1 and {p.file for p in pair.photos} == {"blight/leaf_red.jpg",
                                                                            "rust/leaf_blue.jpg"}
        assert "look-alikes: 1 pair of photos alike in grey shapes but not in colour" in "\n".join(messages)
        ds = load_dataset(report.out)
        where = {f: s for s in ("train", "val", "test") for f in ds[s].files}
        assert where["blight/leaf_red.jpg"] == where["rust/leaf_blue.jpg"]
        on_disk = DataReport.from_dict(json.loads((report.out / DATA_REPORT_NAME).read_text()))
        assert on_disk.duplicates == d and on_disk.duplicates.colour_threshold == COLOUR_THRESHOLD


def test_a_data_report_written_before_the_colour_check_still_reads(tmp_path):
    report, _ = run(make_class_folders(tmp_path / "photos", per_class=6), tmp_path / "ds")
    old = report.data.to_dict()
    for key in ("colour_threshold", "look_alike_pairs", "look_alikes"):
        del old["duplicates"][key]
    assert DataReport.from_dict(old).duplicates.look_alike_pairs == 0


def test_near_copies_across_given_splits_are_counted_per_split_pair(tmp_path):
    src = given_splits(tmp_path / "photos")
    save(Image.open(src / "train/blight/train_0.jpg").resize((48, 36)), src / "val/blight/small_copy.jpg", quality=70)
    save(Image.open(src / "train/blight/train_1.jpg"), src / "test/blight/resaved.png", "PNG")
    save(Image.open(src / "val/rust/val_0.jpg").resize((120, 90)), src / "test/rust/bigger.jpg", quality=80)
    report, messages = run(src, tmp_path / "ds")
    data = DataReport.from_dict(json.loads((report.out / DATA_REPORT_NAME).read_text()))
    assert data.duplicates.leakage == {"train-val": 1, "train-test": 1, "val-test": 1}
    assert (data.duplicates.across_splits, data.duplicates.within_split, data.duplicates.label_conflicts) == (3, 0, 0)
    assert {g.kind for g in data.duplicates.groups} == {"near"}
    grouped = {frozenset(p.file for p in g.photos) for g in data.duplicates.groups}
    assert frozenset({"train/blight/train_0.jpg", "val/blight/small_copy.jpg"}) in grouped
    warned = warnings_of(messages)
    assert len(warned) == 1 and "leakage: 3 photos" in warned[0] and "--dedupe" in warned[0]
    assert "(train-val 1, train-test 1, val-test 1)" in warned[0]
    assert data.balance.per_class == {"blight": 16, "rust": 15}
    assert load_dataset(report.out)["test"].files.count("test/rust/bigger.jpg") == 1  # reported, not removed


def test_the_same_photo_in_two_classes_is_a_named_label_conflict(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=8)
    (src / "rust" / "which_one.jpg").write_bytes((src / "healthy" / "img_05.jpg").read_bytes())
    report, messages = run(src, tmp_path / "ds")
    d = report.data.duplicates
    assert d.label_conflicts == 1 and d.within_split == 0
    (group,) = d.groups
    assert group.scope == "across_classes" and group.kind == "exact"
    assert {(p.file, p.class_name) for p in group.photos} == {("healthy/img_05.jpg", "healthy"),
                                                             ("rust/which_one.jpg", "rust")}
    (warned,) = warnings_of(messages)
    assert warned.startswith("warning: label conflict: 1 photo filed under different classes")
    assert "healthy/img_05.jpg" in warned and "rust/which_one.jpg" in warned


def test_a_label_conflict_across_given_splits_is_kept_and_reported_not_dropped_silently(tmp_path):
    src = given_splits(tmp_path / "photos")
    (src / "test/rust/same.jpg").write_bytes((src / "train/blight/train_2.jpg").read_bytes())
    report, messages = run(src, tmp_path / "ds")
    assert report.data.duplicates.label_conflicts == 1 and report.data.duplicates.leakage == {"train-test": 1}
    assert "test/rust/same.jpg" in load_dataset(report.out)["test"].files
    assert any("label conflict" in w and "test/rust/same.jpg" in w for w in warnings_of(messages))


def test_the_automatic_split_keeps_near_copies_together_and_dedupe_keeps_one(tmp_path):
    src = tmp_path / "photos"
    for c, cls in enumerate(("blight", "healthy", "rust")):
        for i in range(10):
            save(scene(100 * c + i), src / cls / f"p{i}.jpg")
    original = Image.open(src / "healthy/p1.jpg")
    for k, size in enumerate(((48, 36), (72, 54), (120, 90))):
        save(original.resize(size), src / "healthy" / f"p1_copy{k}.jpg", quality=75)
    for seed in range(4):
        report, messages = run(src, tmp_path / f"ds{seed}", opts=IngestOptions(size=SIZE, seed=seed))
        ds = load_dataset(report.out)
        where = {f: s for s in ("train", "val", "test") for f in ds[s].files}
        assert len({where["healthy/p1.jpg"]} | {where[f"healthy/p1_copy{k}.jpg"] for k in range(3)}) == 1
        d = report.data.duplicates
        assert (d.within_split, d.extra_copies, d.leakage) == (1, 3, {})
        assert any(w.startswith("warning: duplicates: 1 group of copies within a split (3 extra photos") for w in
                   warnings_of(messages))
    report, messages = run(src, tmp_path / "dedupe", opts=IngestOptions(size=SIZE, dedupe=True))
    files = {f for s in ("train", "val", "test") for f in load_dataset(report.out)[s].files}
    assert "healthy/p1.jpg" in files and not any("copy" in f for f in files)
    assert {r.kept for r in report.data.removed} == {"healthy/p1.jpg"} and warnings_of(messages) == []


# ---------------------------------------------------------------------------- shortcut check
def _shortcut_folders(root: Path, per_class: int, kind: str) -> Path:
    """Two classes of distinct scenes that differ only by ``kind``: "size" or "format"."""
    for c, cls in enumerate(("blight", "rust")):
        for i in range(per_class):
            im = scene(1000 * c + i)
            if kind == "size":
                save(im.resize((64, 48) if c == 0 else (96, 72)), root / cls / f"p{i}.jpg")
            elif c == 0:
                save(im, root / cls / f"p{i}.jpg")
            else:
                save(im, root / cls / f"p{i}.png", "PNG")
    return root


@pytest.mark.parametrize("kind, feature", [("size", "image size"), ("format", "file format")])
def test_classes_that_differ_only_by_size_or_format_warn_naming_the_feature(tmp_path, kind, feature):
    report, messages = run(_shortcut_folders(tmp_path / "photos", 30, kind), tmp_path / "ds")
    s = report.data.shortcut
    assert s.flagged == (feature,), s
    assert s.balanced_accuracy >= s.warn_at > s.chance
    (warned,) = warnings_of(messages)
    assert warned.startswith(f"warning: shortcut: {feature} alone predicts the class")
    if kind == "format":
        assert "100 % of the 'rust' photos are PNG against 0 % of the others" in warned
        assert "re-save every photo in one format" in warned
    else:
        assert "'blight' 64x48, 'rust' 96x72" in warned


def test_one_class_from_another_source_among_many_is_named():
    """A class told apart from the rest and nothing else scores about 2/K on all classes at once, under the
    threshold with many classes: it is found by scoring each class against the rest."""
    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(8), 40)
    metas = [PhotoMeta(int(rng.integers(300, 3000)), int(rng.integers(300, 3000)), "PNG" if y == 5 else "JPEG",
                     True, bool(rng.random() < 0.5)) for y in labels]
    result = check_shortcuts(metas, labels, [f"insect{i}" for i in range(8)])
    assert result.warns and result.one_class == "insect5" and result.chance == 0.5
    assert result.flagged == ("file format",)
    assert "100 % of the 'insect5' photos are PNG against 0 % of the others" in result.evidence["file format"]


@pytest.mark.parametrize("field,values,feature,words", [
    ("camera", ("PhoneX", "PhoneY"), "camera", "come from PhoneX"),
    ("orientation", (6, 1), "EXIF orientation", "have orientation 6"),
    ("mode", ("L", "RGB"), "colour mode", "are stored in mode L"),
    ("jpeg_q", (40, 3), "JPEG quality", "'a' 40")])
def test_camera_orientation_colour_mode_and_jpeg_quality_are_checked(field, values, feature, words):
    rng = np.random.default_rng(4)
    labels = np.repeat(np.arange(3), 30)
    metas = [dataclasses.replace(PhotoMeta(int(rng.integers(300, 3000)), int(rng.integers(300, 3000)), "JPEG",
                                           True, True, jpeg_q=int(rng.integers(3, 5))),
                                 **{field: values[0] if y == 0 else values[1]}) for y in labels]
    result = check_shortcuts(metas, labels, ["a", "b", "c"])
    assert result.warns and feature in result.flagged, result
    assert words in result.evidence[feature]


def test_shuffled_labels_never_warn():
    rng = np.random.default_rng(7)
    for trial in range(60):
        n, k = int(rng.integers(20, 200)), int(rng.integers(2, 6))
        metas = [PhotoMeta(int(rng.integers(100, 4000)), int(rng.integers(100, 3000)),
                           ["JPEG", "PNG", "WEBP"][int(rng.integers(0, 3))], bool(rng.random() < 0.9),
                           bool(rng.random() < 0.5), ["RGB", "L"][int(rng.random() < 0.1)],
                           ["", "PhoneX", "PhoneY"][int(rng.integers(0, 3))], int(rng.choice([1, 6])),
                           int(rng.integers(2, 40))) for _ in range(n)]
        result = check_shortcuts(metas, rng.integers(0, k, n), [f"c{i}" for i in range(k)], seed=trial)
        assert isinstance(result, str) or not result.warns, (trial, result)
    # a real shortcut, its labels shuffled: no warning either
    metas = [PhotoMeta(64 if i % 2 else 96, 48, "JPEG", True, False) for i in range(80)]
    assert check_shortcuts(metas, [i % 2 for i in range(80)], ["a", "b"]).warns
    assert not check_shortcuts(metas, rng.permutation([i % 2 for i in range(80)]), ["a", "b"]).warns


def test_a_normal_dataset_gives_no_warning(tmp_path):
    report, messages = run(make_class_folders(tmp_path / "photos", per_class=20), tmp_path / "ds")
    assert warnings_of(messages) == []
    data = report.data
    assert data.warnings == () and data.duplicates.groups == () and data.shortcut.flagged == ()
    assert data.balance.per_class == {"blight": 20, "healthy": 20, "rust": 20} and data.balance.ratio == 1.0
    assert "data checks on 60 labelled photos" in messages[0]


def test_a_class_much_smaller_than_another_is_an_imbalance_warning(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=36)
    for p in sorted((src / "rust").iterdir())[6:]:
        p.unlink()
    _, messages = run(src, tmp_path / "ds")
    (warned,) = warnings_of(messages)
    assert warned.startswith("warning: class imbalance: 'blight' has 6 times the photos of 'rust' (36 against 6")


# ---------------------------------------------------------------------------- --dedupe
def test_dedupe_keeps_the_earliest_split_and_records_what_it_removed(tmp_path):
    src = given_splits(tmp_path / "photos")
    save(Image.open(src / "train/blight/train_0.jpg").resize((48, 36)), src / "test/blight/copy.jpg", quality=70)
    save(Image.open(src / "val/rust/val_1.jpg").resize((48, 36)), src / "test/rust/copy.jpg", quality=70)
    (src / "train/rust/train_3_copy.jpg").write_bytes((src / "train/rust/train_3.jpg").read_bytes())  # in train
    (src / "val/rust/conflict.jpg").write_bytes((src / "val/blight/val_2.jpg").read_bytes())  # two classes
    report, messages = run(src, tmp_path / "ds", opts=IngestOptions(size=SIZE, dedupe=True))
    removed = {(r.file, r.reason, r.kept) for r in report.data.removed}
    assert removed == {("test/blight/copy.jpg", "duplicate", "train/blight/train_0.jpg"),
                       ("test/rust/copy.jpg", "duplicate", "val/rust/val_1.jpg"),
                       ("train/rust/train_3_copy.jpg", "duplicate", "train/rust/train_3.jpg"),
                       ("val/blight/val_2.jpg", "label_conflict", None),
                       ("val/rust/conflict.jpg", "label_conflict", None)}
    ds = load_dataset(report.out)
    kept = {f for s in ("train", "val", "test") for f in ds[s].files}
    assert not kept & {r[0] for r in removed}
    assert {"train/blight/train_0.jpg", "val/rust/val_1.jpg", "train/rust/train_3.jpg"} <= kept
    on_disk = json.loads((report.out / DATA_REPORT_NAME).read_text())
    assert on_disk["dedupe"] is True and len(on_disk["removed"]) == 5
    rejected = [json.loads(x) for x in (report.out / "rejected.jsonl").read_text().splitlines()]
    assert {(r["path"], r["reason"]) for r in rejected} == {(f, why) for f, why, _ in removed}
    assert ds.manifest.options.dedupe is True
    (warned,) = warnings_of(messages)  # the conflict; the removed duplicates need no warning
    assert "all 2 copies were left out" in warned and "val/rust/conflict.jpg" in warned


def test_dedupe_off_is_left_out_of_the_manifest_so_older_datasets_keep_their_identity():
    assert "dedupe" not in IngestOptions().to_dict() and "dedupe" not in IngestOptions(dedupe=False).to_dict()
    assert IngestOptions(dedupe=True).to_dict()["dedupe"] is True


# ---------------------------------------------------------------------------- --check
def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_check_writes_nothing_and_reports_what_preprocess_finds(tmp_path):
    src = given_splits(tmp_path / "photos")
    save(Image.open(src / "train/blight/train_0.jpg").resize((48, 36)), src / "val/blight/copy.jpg", quality=70)
    (src / "test/rust/same.jpg").write_bytes((src / "train/blight/train_2.jpg").read_bytes())
    before = _tree(tmp_path)
    cmd = [sys.executable, "-m", "leaflens", "preprocess", "--src", str(src), "--check", "--size", str(SIZE),
           "--workers", "1", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert _tree(tmp_path) == before  # not a file written, not even a temporary folder
    checked = [line for line in res.stdout.splitlines() if line.startswith(("warning:", "  "))]
    report, messages = run(src, tmp_path / "ds")
    assert checked == [line for line in "\n".join(messages).splitlines() if line.startswith(("warning:", "  "))]
    res = subprocess.run(cmd + ["--report", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0
    got = json.loads((tmp_path / "r.json").read_text())
    built = json.loads((report.out / DATA_REPORT_NAME).read_text())
    assert got["mode"] == "check" and built["mode"] == "preprocess"
    for key in ("duplicates", "balance", "warnings", "removed", "photos"):
        assert got[key] == built[key], key
    assert got["shortcut"]["flagged"] == built["shortcut"]["flagged"] == []


def test_check_exits_1_when_preprocess_would_refuse_the_data(tmp_path):
    src = given_splits(tmp_path / "photos", counts=(("train", 6), ("val", 2)))
    res = subprocess.run([sys.executable, "-m", "leaflens", "preprocess", "--src", str(src), "--check",
                          "--workers", "1", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "the test split would be empty" in res.stderr and "Traceback" not in res.stderr
    assert "data checks on 16 labelled photos" in res.stdout  # the report comes first
    with pytest.raises(IngestError, match="no output folder"):
        run(src, None)
    # --check writes nothing: an --out beside it is a usage error, not silently ignored
    res = subprocess.run([sys.executable, "-m", "leaflens", "preprocess", "--src", str(src), "--check", "--out",
                          str(tmp_path / "ds"), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--check writes no dataset" in res.stderr and not (tmp_path / "ds").exists()


# ---------------------------------------------------------------------------- the run report
def test_the_run_report_shows_the_data_section(tmp_path):
    from leaflens.pipeline.report.markdown import render_report

    src = make_class_folders(tmp_path / "photos", per_class=8)
    (src / "rust" / "which_one.jpg").write_bytes((src / "healthy" / "img_05.jpg").read_bytes())
    save(tinted(999, RED), src / "blight" / "leaf_red.jpg")
    save(tinted(999, BLUE), src / "healthy" / "leaf_blue.jpg")
    report, _ = run(src, tmp_path / "ds")
    data = read_data_report(report.out)
    text = render_report(tmp_path, {"data": data})
    assert "## Data checks (preprocess)" in text
    assert "- Photos per class: blight 9, healthy 9, rust 9 (largest/smallest 1)" in text
    assert "within 8 bits of a perceptual hash and within 5 grey levels in colour" in text
    assert "0 groups within a split, 0 across splits, 1 label conflict;" in text
    assert "- Look-alikes (alike in grey shapes, not in colour; counted as different photos): 1 pairs" in text
    assert "- label conflict: 1 photo filed under different classes" in text
    assert "- Shortcut check: the metadata alone (image size, aspect ratio, file format, format vs extension, EXIF, " \
           "camera, EXIF orientation, colour mode, JPEG quality) predict the class" in text
    assert "## Data checks" not in render_report(tmp_path, {"data": None})
    (report.out / DATA_REPORT_NAME).write_text("{")
    assert "could not be read" in render_report(tmp_path, {"data": read_data_report(report.out)})


def test_too_few_photos_to_stand_out_from_chance_are_said_not_scored():
    """22 photos in 2 classes: the warning threshold came out at 1.12, above any possible score, and the log said
    "balanced accuracy 0.33, chance 0.50, warning from 1.12": a check that could never warn, shown as run."""
    rng = np.random.default_rng(3)
    metas = [PhotoMeta(640, 480, "JPEG", True, False, "RGB", "", 1, 20) for _ in range(22)]
    result = check_shortcuts(metas, rng.permutation([0] * 11 + [1] * 11), ["a", "b"])
    assert result == "only 22 photos in 2 classes: too few to tell metadata from chance"


def test_a_class_no_other_shares_a_value_with_is_named_even_in_a_small_set():
    """12 + 12 photos, every 'healthy' one from one phone and every 'rust' one from another, and 60 + 6 (many of
    one's own photos, a few from the web): the check said "too few photos to tell metadata from chance", while a
    random labelling splits them so cleanly about once in 2.7 million (12 + 12) or 90 million (60 + 6)."""
    def metas(cameras):
        return [PhotoMeta(640, 480, "JPEG", True, False, "RGB", cam, 1, 20) for cam in cameras]

    result = check_shortcuts(metas(["iPhone 12"] * 12 + ["SM-G991B"] * 12), [0] * 12 + [1] * 12, ["healthy", "rust"])
    assert not isinstance(result, str) and result.warns and result.flagged == ("camera",)
    assert result.one_class is None and "100 % of the 'rust' photos come from SM-G991B" in result.evidence["camera"]
    result = check_shortcuts(metas(["own phone"] * 60 + ["no camera"] * 6), [0] * 60 + [1] * 6, ["healthy", "rust"])
    assert not isinstance(result, str) and result.flagged == ("camera",)
    # 5 + 5 split so cleanly happens once in 252 random labellings: still too few to say
    result = check_shortcuts(metas(["a"] * 5 + ["b"] * 5), [0] * 5 + [1] * 5, ["healthy", "rust"])
    assert isinstance(result, str) and "too few" in result
    # random metadata and random labels in small sets never warn
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(10, 30))
        cams = [f"cam{int(c)}" for c in rng.integers(0, 4, n)]
        labels = rng.permutation(np.arange(n) % 2)
        result = check_shortcuts(metas(cams), labels, ["a", "b"])
        assert isinstance(result, str) or not result.warns, cams
        sized = [PhotoMeta(int(w), 480, "JPEG", True, False) for w in rng.integers(100, 4000, n)]  # each its own
        result = check_shortcuts(sized, labels, ["a", "b"])
        assert isinstance(result, str) or not result.warns


def test_a_label_conflicts_listed_photos_show_its_classes():
    """A group of many copies listed its first five files, all of one class, the other class hidden in
    "(+2 more)": the warning did not show the conflict it named."""
    from leaflens.data_prep.data_report import DuplicatePhoto, _names, _one_per_class_first

    photos = [DuplicatePhoto(f"rust/{i}.jpg", "rust", "train") for i in range(6)] + [
        DuplicatePhoto("healthy/x.jpg", "healthy", "val")]
    shown = _names(_one_per_class_first(photos))
    assert shown.startswith("rust/0.jpg (train) = healthy/x.jpg (val) = rust/1.jpg (train)") and "(+2 more)" in shown


def test_turned_and_mirrored_copies_are_copies_and_stay_in_one_split(tmp_path):
    """A folder augmented before the split (mirrored and rotated copies beside each photo) put 7 of 24 mirrored
    copies and 13 of 24 rotated ones in another split than their original, with "leakage: none"."""
    from PIL import ImageOps

    original = scene(1, 160, 120)
    turned = [ImageOps.mirror(original), original.transpose(Image.Transpose.ROTATE_90),
              original.transpose(Image.Transpose.ROTATE_180), ImageOps.flip(original)]
    stored = [np.asarray(original.resize((SIZE, SIZE)))] + [np.asarray(t.resize((SIZE, SIZE))) for t in turned]
    others = [np.asarray(scene(s, 160, 120).resize((SIZE, SIZE))) for s in range(2, 40)]
    hashes = np.stack([photo_hashes(p) for p in stored + others])
    colours = np.stack([colour_signatures(p) for p in stored + others])
    (group,) = find_copies(hashes, colours).groups
    assert group.members == (0, 1, 2, 3, 4)

    src = tmp_path / "augmented"
    for c, cls in enumerate(("blight", "rust")):
        (src / cls).mkdir(parents=True)
        for i in range(8):
            im = scene(1000 * (c + 1) + i)
            save(im, src / cls / f"p{i}.jpg")
            save(ImageOps.mirror(im), src / cls / f"p{i}_mirror.jpg")
            save(im.transpose(Image.Transpose.ROTATE_90), src / cls / f"p{i}_rot.jpg")
    run(src, tmp_path / "ds")
    ds = load_dataset(tmp_path / "ds")
    split_of = {Path(f).with_suffix("").as_posix(): s for s in ("train", "val", "test") for f in ds[s].files}
    assert len(split_of) == 48
    for c in ("blight", "rust"):
        for i in range(8):
            assert split_of[f"{c}/p{i}"] == split_of[f"{c}/p{i}_mirror"] == split_of[f"{c}/p{i}_rot"], (c, i)


def test_a_pair_linked_unturned_is_not_made_a_copy_by_colours_that_match_turned():
    """Two different leaves the hash linked as they are (6 bits) had colours 5.0 apart, a look-alike, but 4.4
    once one was turned: the colour check took the smallest distance over every pairing and made them a copy,
    a label conflict across two classes. Each link is confirmed by colour the way the hash linked it."""
    from leaflens.data_prep.near_dup import _linked_colour

    rng = np.random.default_rng(0)
    h = rng.integers(0, np.iinfo(np.int64).max, (2, near_dup.HASH_COLUMNS), dtype=np.int64).astype(np.uint64)
    h[1, 0] = h[0, 0] ^ np.uint64(0b111)  # linked as they are, 3 bits; their turned hashes far apart
    base = rng.integers(60, 200, (3, 27)).astype(np.uint8)
    colours = np.stack([base, base])
    colours[1, 0] = near_dup._turn_cells(colours[0, 0], "mirror")  # unlike as they are, alike once mirrored
    as_linked = float(_linked_colour(h, colours, np.array([0]), np.array([1]), 8)[0])
    assert as_linked == pytest.approx(float(colour_distance(colours[:1], colours[1:], "crops")[0]))
    assert as_linked > float(colour_distance(colours[:1], colours[1:], "turns")[0])


def test_each_turned_hash_and_colour_grid_is_the_turned_pictures_own():
    """The turns are computed from the plain picture's DCT block and colour grid: each must equal what the
    turned picture itself gives."""
    rng = np.random.default_rng(0)
    px = np.asarray(Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).resize((96, 96)))
    turned = {"mirror": px[:, ::-1], "flip": px[::-1], "rot180": px[::-1, ::-1], "transpose": px.transpose(1, 0, 2),
              "rot90": np.rot90(px, -1), "rot270": np.rot90(px, 1), "antitranspose": px[::-1, ::-1].transpose(1, 0, 2)}
    assert set(turned) == set(near_dup.TURNS)
    hashes, grid = photo_hashes(px), colour_signatures(px)[0]
    for k, turn in enumerate(near_dup.TURNS):
        own = np.ascontiguousarray(turned[turn])
        assert photo_hashes(own)[0] == hashes[len(near_dup.HASH_CROPS) + k], turn
        np.testing.assert_array_equal(colour_signatures(own)[0], near_dup._turn_cells(grid, turn), err_msg=turn)
