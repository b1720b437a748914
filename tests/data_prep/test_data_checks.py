"""Data that would spoil a model is refused or warned about, with what to do (issue #21, items 1-2)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from dp_helpers import make_class_folders

from leaflens.data_prep.ingest import IngestError, IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.data_prep.split import MIN_PER_CLASS, assign_auto, parse_ratios


def _ingest(src: Path, out: Path, ratios=(0.7, 0.15, 0.15), **kw):
    messages: list[str] = []
    report = ingest(src, out, IngestOptions(size=16, ratios=ratios), workers=1, log=messages.append, **kw)
    return report, messages


@pytest.mark.parametrize("text", ["70/15/15", "0.7,0.15,0.15", "70:15:15", "33/33/33", "80/0/20"])
def test_split_shares_in_percentages_or_fractions_are_read(text):
    ratios = parse_ratios(text)
    assert sum(ratios) == pytest.approx(1.0)
    assert ratios[0] > ratios[2] or text == "33/33/33"


@pytest.mark.parametrize("text, says", [
    ("70/20/20", "adds up to 110"),  # a typo, not a wish for 63.6/18.2/18.2
    ("0.7,0.2,0.2", "adds up to 1.1"),
    ("60/20/10", "adds up to 90"),
    ("70/30", "three shares"),
    ("70/x/15", "three numbers"),
    ("0/50/50", "train above 0"),
    ("nan/15/15", "0 or more"),
    ("110/-5/-5", "0 or more"),
])
def test_split_shares_that_do_not_add_up_are_refused_naming_the_sum(text, says):
    with pytest.raises(ValueError, match="--split") as err:
        parse_ratios(text)
    assert says in str(err.value) and text in str(err.value)


def test_preprocess_refuses_a_split_that_does_not_add_up_before_writing(tmp_path, capsys):
    from leaflens.pipeline.cli import main

    src = make_class_folders(tmp_path / "photos", per_class=6)
    out = tmp_path / "ds"
    assert main(["preprocess", "--src", str(src), "--out", str(out), "--split", "70/20/20", "--workers", "1",
                 "--no-progress"]) == 2  # a usage error, like a bad flag
    assert "adds up to 110" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("n", range(MIN_PER_CLASS, 12))
def test_every_class_of_three_or_more_gets_a_val_and_a_test_photo(n):
    labels = [0] * n + [1] * (n + 5)
    splits = assign_auto(labels, list(range(len(labels))), (0.7, 0.15, 0.15), seed=n)
    for cls in (0, 1):
        got = Counter(s for s, y in zip(splits, labels) if y == cls)
        assert got["val"] >= 1 and got["test"] >= 1 and got["train"] >= 1, (n, cls, got)


def test_a_class_of_two_stays_in_train_and_explicit_zero_ratios_are_kept():
    assert assign_auto([0, 0], [0, 1], (0.7, 0.15, 0.15), seed=0) == ["train", "train"]
    splits = assign_auto([0] * 5, list(range(5)), (1.0, 0.0, 0.0), seed=0)
    assert splits == ["train"] * 5


@pytest.mark.parametrize("seed", range(6))
def test_a_large_group_of_look_alikes_stays_in_train_and_does_not_empty_it(seed):
    # 11 of a class's 15 photos hashed into one group: before, a shuffle that drew the group first sent all
    # 11 to test and left the class 0 training photos, without a word
    labels = [0] * 15 + [1] * 15
    hashes = ["big"] * 11 + list(range(4)) + list(range(100, 115))
    splits = assign_auto(labels, hashes, (0.7, 0.15, 0.15), seed=seed)
    got = Counter(s for s, y in zip(splits, labels) if y == 0)
    assert {splits[i] for i in range(11)} == {"train"}
    assert got["train"] == 11 + (4 - got["val"] - got["test"]) and got["val"] + got["test"] == 4
    assert got["val"] >= 1 and got["test"] >= 1


@pytest.mark.parametrize("seed", range(6))
def test_the_last_group_goes_to_train_when_train_has_none(seed):
    splits = assign_auto([0] * 4, ["a", "a", "b", "b"], (0.7, 0.15, 0.15), seed=seed)
    assert splits.count("train") == 2


@pytest.mark.parametrize("seed", range(3))
def test_a_pair_of_copies_still_fills_the_last_place_of_val_and_test(seed):
    # 3 val and 3 test photos wanted: two pairs each (4, one over) rather than one pair (2, one under), as
    # before groups were weighed, so datasets of single photos and pairs keep their splits
    hashes = [i // 2 for i in range(20)]
    got = Counter(assign_auto([0] * 20, hashes, (0.7, 0.15, 0.15), seed=seed))
    assert got == {"train": 12, "val": 4, "test": 4}


def _given_split_folders(root: Path, leave_out: dict[str, str]) -> Path:
    """ROOT/{train,val,test}/<class>/ of distinct photos, without the (split -> class) folders named."""
    src = make_class_folders(tmp := root / "flat", per_class=9)
    for c in sorted(p.name for p in tmp.iterdir()):
        for k, f in enumerate(sorted((tmp / c).iterdir())):
            split = ("train", "train", "train", "train", "train", "val", "val", "test", "test")[k]
            if leave_out.get(split) == c:
                continue
            (root / "given" / split / c).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, root / "given" / split / c / f.name)
    shutil.rmtree(src)
    return root / "given"


def test_a_class_with_no_training_photo_is_refused_naming_it_and_where_to_put_photos(tmp_path):
    src = _given_split_folders(tmp_path, {"train": "rust"})
    with pytest.raises(IngestError, match=r"no training photo for 'rust' \(train 0, val 2, test 2\)") as err:
        _ingest(src, tmp_path / "ds")
    assert str(src / "train" / "rust") in str(err.value)
    assert not (tmp_path / "ds").exists()


def test_a_class_with_no_val_photo_is_warned_about_naming_it(tmp_path):
    src = _given_split_folders(tmp_path, {"val": "blight"})
    _, messages = _ingest(src, tmp_path / "ds")
    warned = [m for m in messages if m.startswith("warning: no val photo")]
    assert len(warned) == 1 and "'blight' (train 5, val 0, test 2)" in warned[0]
    assert str(src / "val" / "blight") in warned[0]
    assert not any(m.startswith("warning: no test photo") for m in messages)


def test_one_class_is_refused_with_what_to_do(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=5)
    for extra in ("healthy", "rust"):
        shutil.rmtree(src / extra)
    with pytest.raises(IngestError, match=r"1 class folder found \('blight'\).*at least 2 classes"):
        _ingest(src, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
    res = subprocess.run([sys.executable, "-m", "leaflens", "preprocess", "--src", str(src), "--out",
                          str(tmp_path / "ds"), "--no-progress", "--workers", "1"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1
    assert "at least 2 classes" in res.stderr and "Traceback" not in res.stderr


def test_two_classes_of_three_photos_get_one_photo_in_each_split(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=3)
    shutil.rmtree(src / "rust")
    report, messages = _ingest(src, tmp_path / "ds")
    ds = load_dataset(report.out)
    for split in ("train", "val", "test"):
        assert sorted(np.asarray(ds[split].labels).tolist()) == [0, 1], split
    assert not any(m.startswith("warning") for m in messages)


def test_a_class_too_small_for_every_split_is_named_and_refused_when_strict(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=8)
    for p in sorted((src / "rust").iterdir())[2:]:
        p.unlink()
    report, messages = _ingest(src, tmp_path / "ds")
    warnings = [m for m in messages if m.startswith("warning")]
    assert len(warnings) == 1 and "'rust' (2 photos)" in warnings[0] and "blight" not in warnings[0]
    with pytest.raises(IngestError, match=r"'rust' \(2 photos\).*--strict"):
        _ingest(src, tmp_path / "ds2", strict=True)
    assert not (tmp_path / "ds2").exists()


def test_given_folders_without_a_test_split_are_refused_naming_the_counts(tmp_path):
    classes = make_class_folders(tmp_path / "flat", per_class=4)
    src = tmp_path / "given"
    for split, keep in (("train", slice(0, 3)), ("val", slice(3, 4))):
        for cls in sorted(p.name for p in classes.iterdir()):
            dest = src / split / cls
            dest.mkdir(parents=True)
            for f in sorted((classes / cls).iterdir())[keep]:
                shutil.copy(f, dest / f.name)
    with pytest.raises(IngestError, match=r"the test split would be empty \(train 9, val 3, test 0 photos\).*Put "
                                         r"photos of every class in .*given/test, photos not found in the other"):
        _ingest(src, tmp_path / "ds")
    # a test/ folder whose photos are all copies of training photos: said, not "put some in test/"
    for cls in sorted(p.name for p in classes.iterdir()):
        (src / "test" / cls).mkdir(parents=True)
        for f in sorted((src / "train" / cls).iterdir())[:1]:
            shutil.copy(f, src / "test" / cls / f"copy_{f.name}")
    with pytest.raises(IngestError, match=r"the 3 photo\(s\) of test/ were all left out \(rejected, or copies of "
                                         r"photos in another split"):
        _ingest(src, tmp_path / "ds")


def test_a_split_asked_to_be_empty_is_a_warning_and_distill_names_it(tmp_path):
    src = make_class_folders(tmp_path / "photos", per_class=6)
    report, messages = _ingest(src, tmp_path / "ds", ratios=(0.8, 0.0, 0.2))
    assert any(m.startswith("warning: no val photos, as --split asked") for m in messages)
    from leaflens.pipeline.config import load_config
    from leaflens.pipeline.distill import run_distill

    with pytest.raises(ValueError, match=r"the val split is empty \(train 1[0-9], val 0, test [0-9] photos\)"):
        run_distill(report.out, None, tmp_path / "run", load_config(), no_teacher=True, progress=False)
    assert not (tmp_path / "run").exists()
    # the teacher says the same, before any work (it ended in "need at least one array to concatenate")
    from leaflens.pipeline.teachers.stage import TeacherChoice, run_teacher_stage

    with pytest.raises(ValueError, match=r"the val split is empty .*chosen on val"):
        run_teacher_stage(report.out, tmp_path / "t", load_config(), TeacherChoice(train_cnn=True), progress=False)
    assert not (tmp_path / "t").exists()


def test_photos_the_app_would_refuse_are_kept_and_named_in_the_data_report(tmp_path):
    """A lens-cap frame, a thumbnail and a smooth gradient under a class: a served model refuses each before
    it looks, so preprocess names them (kept: the user may know better) instead of training on them silently."""
    import json  # noqa: PLC0415

    from dp_helpers import encode, photo  # noqa: PLC0415
    from PIL import Image  # noqa: PLC0415

    src = make_class_folders(tmp_path / "photos", per_class=6)
    (src / "blight" / "lens_cap.jpg").write_bytes(encode(Image.new("RGB", (64, 48), (12, 12, 14))))
    (src / "rust" / "thumb.png").write_bytes(encode(photo(7, (200, 120, 30), 24, 20), "PNG"))
    ramp = np.linspace(0, 255, 64, dtype=np.float32)
    smooth = np.stack([np.tile(ramp, (64, 1)), np.tile(ramp[:, None], (1, 64)), np.full((64, 64), 90.0)], -1)
    (src / "healthy" / "smooth.png").write_bytes(encode(Image.fromarray(smooth.astype(np.uint8)), "PNG"))
    messages: list[str] = []
    report = ingest(src, tmp_path / "ds", IngestOptions(size=32), workers=1, log=messages.append)
    assert report.kept_total == 21  # kept, every one
    lines = "\n".join(messages).splitlines()
    warned = [m for m in lines if m.startswith("warning: photos the app would not judge")]
    assert len(warned) == 1, lines
    assert "3 labelled photos (low_texture" not in warned[0]  # kinds are said in words
    for name, cls in (("lens_cap.jpg", "blight"), ("thumb.png", "rust"), ("smooth.png", "healthy")):
        assert f"{name} ({cls})" in warned[0]
    assert "no fine detail 1, under 32 px on a side 1, one flat colour 1" in warned[0]
    data = json.loads((tmp_path / "ds" / "data_report.json").read_text())
    assert {(Path(p["file"]).name, p["reason"]) for p in data["not_judged"]} == {
        ("lens_cap.jpg", "uniform"), ("thumb.png", "too_small"), ("smooth.png", "low_texture")}
    messages.clear()
    clean = ingest(make_class_folders(tmp_path / "clean", per_class=6), tmp_path / "ds2", IngestOptions(size=32),
                   workers=1, log=messages.append)
    assert not any("would not judge" in m for m in messages) and clean.data.not_judged == ()


def test_a_class_left_without_val_or_test_is_told_the_real_reason(tmp_path):
    """A photo copied under another class is kept in one split with its copy, and --dedupe removes photos
    after the split: either can leave a class without a val or test photo. The warning said "its photos are
    copies of each other" for both, which was not what happened."""
    import shutil  # noqa: PLC0415

    src = make_class_folders(tmp_path / "photos", per_class=8)
    for f in sorted((src / "rust").iterdir())[2:]:
        f.unlink()
    shutil.copy(src / "blight" / "img_02.jpg", src / "rust" / "copy_02.jpg")
    for dedupe in (False, True):
        messages: list[str] = []
        ingest(src, tmp_path / f"ds{dedupe}", IngestOptions(size=16, dedupe=dedupe), workers=1, log=messages.append)
        lines = [m for m in "\n".join(messages).splitlines() if m.startswith("warning: no ")]
        assert lines, messages
        assert not any("copies or look-alikes of each other" in m for m in lines), lines
        if not dedupe:
            assert any("'rust'" in m and "rust/copy_02.jpg, is also filed under blight" in m for m in lines), lines
        else:
            assert any("--dedupe left out 1 of its photos after the split" in m for m in lines), lines


def test_class_folders_nested_one_level_too_deep_are_named(tmp_path):
    """ROOT/beans/{healthy,rust}/ made one class 'beans' of two diagnoses without a word; a lone wrapper folder
    was refused with advice to rearrange the photos instead of pointing --src one level down."""
    import shutil  # noqa: PLC0415

    src = make_class_folders(tmp_path / "made", per_class=5)
    deep = tmp_path / "deep"
    shutil.copytree(src / "blight", deep / "beans" / "blight")
    shutil.copytree(src / "healthy", deep / "beans" / "healthy")
    shutil.copytree(src / "rust", deep / "more")  # photos directly in the class folder: a class as usual
    shutil.copytree(src / "rust", deep / "dated" / "2024")  # one subfolder: a class kept in a dated folder
    _, messages = _ingest(deep, tmp_path / "ds")
    warned = [m for m in messages if m.startswith("warning: class")]
    assert len(warned) == 1, messages
    assert "'beans' is made of the photos of its subfolders (blight 5, healthy 5)" in warned[0]
    assert f"point --src at {deep / 'beans'}" in warned[0]
    with pytest.raises(IngestError, match=r"its subfolders \(blight, healthy, rust\) look like the classes: "
                                          r"point --src at .*wrap/photos"):
        shutil.copytree(src, tmp_path / "wrap" / "photos")
        _ingest(tmp_path / "wrap", tmp_path / "ds2")

    # photos kept in dated subfolders in every class (rust/2024-06/, the README's own example): not classes
    dated = tmp_path / "dated_all"
    for cls in ("blight", "rust"):
        files = sorted((src / cls).iterdir())
        for month, part in (("2024-06", files[:3]), ("2024-07", files[3:])):
            (dated / cls / month).mkdir(parents=True)
            for f in part:
                shutil.copy(f, dated / cls / month / f.name)
    _, messages = _ingest(dated, tmp_path / "ds3")
    assert not [m for m in messages if m.startswith("warning: class")], messages


def test_one_class_in_split_folders_is_told_the_split_layout(tmp_path):
    import shutil  # noqa: PLC0415

    src = make_class_folders(tmp_path / "made", per_class=6)
    given = tmp_path / "given"
    for split in ("train", "val", "test"):
        shutil.copytree(src / "healthy", given / split / "healthy")
    with pytest.raises(IngestError, match=r"e\.g\. .*given/train/rust, .*given/val/rust, .*given/test/rust beside the "
                                          r"'healthy' folders"):
        _ingest(given, tmp_path / "ds")


def test_check_says_what_a_build_would_keep_and_leave_out(tmp_path):
    """--check is "the checks alone", but a full run's summary named files it does not read as photos (a .gif
    among them) and --check said nothing of them."""
    src = make_class_folders(tmp_path / "photos", per_class=5)
    (src / "rust" / "a.gif").write_bytes(b"GIF89a")
    (src / "blight" / "notes.txt").write_text("x")
    messages: list[str] = []
    ingest(src, None, IngestOptions(size=16), workers=1, check=True, log=messages.append)
    last = messages[-1].splitlines()
    assert last[0].split() == ["class", "train", "val", "test", "rejected"]
    assert last[-1].startswith("would keep 15, would reject 0, ignored not_image: 2 (.gif 1, .txt 1)")
    assert last[-1].endswith("nothing written (--check)")
    assert not (tmp_path / "photos" / "manifest.json").exists()


def test_nesting_in_split_folders_is_counted_once_and_told_to_move_up(tmp_path):
    import shutil  # noqa: PLC0415

    sp = tmp_path / "SP"
    made = {split: make_class_folders(tmp_path / f"made_{split}", per_class=4, seed=k)
            for k, split in enumerate(("train", "val", "test"))}  # other photos in each split, no copies
    for split, src in made.items():
        shutil.copytree(src / "blight", sp / split / "beans" / "blight")
        shutil.copytree(src / "healthy", sp / split / "beans" / "healthy")
    with pytest.raises(IngestError, match=r"its subfolders \(blight, healthy\) look like the classes: move them up "
                                          r"a level, into each split folder"):
        _ingest(sp, tmp_path / "ds")
    for split, src in made.items():
        shutil.copytree(src / "rust", sp / split / "rust")
    _, messages = _ingest(sp, tmp_path / "ds")
    warned = [m for m in messages if m.startswith("warning: class")]
    assert len(warned) == 1 and "(blight 12, healthy 12)" in warned[0] and "into each split folder" in warned[0]


def test_every_warning_preprocess_logs_is_in_data_report_json_and_a_refusal_says_why(tmp_path):
    """"no val photo for 'rust'", a nested class folder, an empty folder... were printed on the console only:
    data_report.json (and the report.md that shows it) said "No warning." A refused run's --report said nothing
    of the refusal."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    src = make_class_folders(tmp_path / "made", per_class=6)
    (src / "empty_one").mkdir()
    _, messages = _ingest(src, tmp_path / "ds")
    data = json.loads((tmp_path / "ds" / "data_report.json").read_text())
    logged = [m[len("warning: "):] for m in messages if m.startswith("warning: ")]
    assert logged and any("'empty_one' holds no photo" in w for w in logged)
    assert all(w in data["warnings"] for w in logged), (logged, data["warnings"])
    assert "refused" not in data
    _, again = _ingest(src, tmp_path / "ds")  # up to date: its warnings are pointed to, not lost
    assert any(m.startswith(f"note: its build warned {len(data['warnings'])} time") for m in again), again

    one = tmp_path / "one"
    shutil.copytree(src / "rust", one / "train" / "rust")
    shutil.copytree(src / "blight", one / "train" / "blight")
    with pytest.raises(IngestError) as refusal:
        _ingest(one, tmp_path / "ds2", report_path=tmp_path / "refused.json")
    assert json.loads((tmp_path / "refused.json").read_text())["refused"] == str(refusal.value)
    with pytest.raises(IngestError):
        ingest(one, None, IngestOptions(size=16), workers=1, check=True, report_path=tmp_path / "checked.json",
               log=lambda m: None)
    assert json.loads((tmp_path / "checked.json").read_text())["refused"] == str(refusal.value)
