"""Walking a photo folder (leaflens.data_prep.scan.walk_folder and scan_source): a folder that cannot be read is
an error naming it, a folder link back up (a loop) is not followed, a link to nothing and a file name that is
not UTF-8 are counted and left out, never a traceback; `leaflens predict` and `evaluate` say the same."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from dp_helpers import encode, photo

from leaflens.data_prep.scan import ScanError, scan_source, walk_folder


def _photos(root: Path, classes: tuple[str, ...] = ("healthy", "rust"), n: int = 2) -> Path:
    for ci, cls in enumerate(classes):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            (root / cls / f"{cls}_{i}.jpg").write_bytes(encode(photo(10 * ci + i, (40 + 90 * ci, 150, 60))))
    return root


def test_an_unreadable_class_folder_is_an_error_naming_it(tmp_path, monkeypatch):
    root = _photos(tmp_path / "src")
    real_scandir = os.scandir

    def scandir(path=".", *a, **kw):  # chmod 000 does not stop root, so the refusal is simulated
        if os.fspath(path).endswith("rust"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ScanError, match=r"cannot read the folder .*rust: Permission denied; fix its permissions"):
        scan_source(root)  # before: the rust class was left out without a word


def test_a_folder_link_back_up_is_not_followed(tmp_path):
    root = _photos(tmp_path / "src")
    (root / "rust" / "up").symlink_to("..")  # rust/up/rust/up/... and rust/up/healthy: healthy labelled rust
    scan = scan_source(root)
    assert sorted(Path(f.path).name for f in scan.files) == ["healthy_0.jpg", "healthy_1.jpg", "rust_0.jpg",
                                                            "rust_1.jpg"]
    assert scan.ignored["link_loop"] == 1
    seen = [d for d, _, _ in walk_folder(root)]
    assert len(seen) == 3  # root, healthy, rust: up/ not entered


def test_a_link_to_nothing_and_a_name_not_in_utf8_are_counted_and_left_out(tmp_path):
    root = _photos(tmp_path / "src")
    (root / "rust" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    if sys.platform.startswith("linux"):
        with open(os.fsencode(root / "rust") + b"/caf\xe9.jpg", "wb") as fh:
            fh.write(encode(photo(99, (30, 160, 40))))
    scan = scan_source(root)  # before: FileNotFoundError / UnicodeEncodeError tracebacks
    assert len(scan.files) == 4 and scan.ignored["broken_link"] == 1
    if sys.platform.startswith("linux"):
        assert scan.ignored["name_not_utf8"] == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a file name in bytes that are not UTF-8")
def test_a_class_folder_named_in_another_encoding_is_refused_not_lost(tmp_path):
    """A class folder named in GBK lost every photo to the name check: the class was dropped, warned of as a
    folder holding no photo, and the dataset made without it."""
    root = _photos(tmp_path / "src")
    gbk = os.fsencode(root) + b"/\xb2\xa1\xba\xa6"  # "病害" in GBK
    os.mkdir(gbk)
    with open(gbk + b"/leaf.jpg", "wb") as fh:
        fh.write(encode(photo(7, (120, 90, 40))))
    with pytest.raises(ScanError, match="has a name that is not UTF-8 text, so none of its photos can be recorded"):
        scan_source(root)


@pytest.mark.parametrize("option,value,words", [("--seed", "-1", "seed must be a whole number from 0"),
                                                ("--size", "4", "image size 4 is too small"),
                                                ("--size", "4000", "image size 4000 is too large")])
def test_preprocess_option_errors_are_usage_errors(tmp_path, capsys, option, value, words):
    from leaflens.pipeline.cli import main  # noqa: PLC0415

    src = _photos(tmp_path / "src")
    assert main(["preprocess", "--src", str(src), "--out", str(tmp_path / "ds"), option, value]) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "ds").exists()


def test_an_empty_class_folder_is_said_and_a_class_without_a_usable_photo_refused(tmp_path, capsys):
    from leaflens.pipeline.cli import main  # noqa: PLC0415

    src = _photos(tmp_path / "src", ("healthy", "rust", "aphids"), n=4)
    (src / "mildew").mkdir()  # nothing in it
    assert scan_source(src).empty_folders == ["mildew"]
    assert main(["preprocess", "--src", str(src), "--out", str(tmp_path / "ds"), "--size", "16", "--workers", "1",
                 "--no-progress"]) == 0
    assert "'mildew' holds no photo" in "".join(capsys.readouterr())
    (src / "broken").mkdir()
    (src / "broken" / "x.jpg").write_bytes(b"")  # a class whose every file is rejected
    assert main(["preprocess", "--src", str(src), "--out", str(tmp_path / "ds2"), "--size", "16", "--workers", "1",
                 "--no-progress"]) == 1
    assert "no usable photo in 'broken'" in "".join(capsys.readouterr()) and not (tmp_path / "ds2").exists()


def test_file_links_to_each_other_are_a_loop_not_a_link_to_nothing(tmp_path):
    root = _photos(tmp_path / "src")
    (root / "rust" / "a.jpg").symlink_to(root / "rust" / "b.jpg")
    (root / "rust" / "b.jpg").symlink_to(root / "rust" / "a.jpg")
    scan = scan_source(root)
    assert scan.ignored.get("link_loop") == 2 and "broken_link" not in scan.ignored


def test_the_summary_names_the_files_left_out_that_a_person_can_fix(tmp_path):
    """Links to nothing, link loops and loose files were only counted ("broken_link: 2"): which ones, the user
    had to find out alone."""
    from leaflens.data_prep.ingest import IngestOptions, format_summary, ingest

    root = _photos(tmp_path / "src", n=8)
    (root / "rust" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (root / "rust" / "a.jpg").symlink_to(root / "rust" / "b.jpg")
    (root / "rust" / "b.jpg").symlink_to(root / "rust" / "a.jpg")
    (root / "loose.jpg").write_bytes(b"x")
    scan = scan_source(root)
    assert scan.ignored == {"broken_link": 1, "link_loop": 2, "outside_class_folders": 1}
    said: list[str] = []
    report = ingest(root, None, IngestOptions(size=16), workers=1, check=True, log=said.append)
    line = format_summary(report, check=True)
    assert "broken_link: 1 (rust/gone.jpg)" in line and "link_loop: 2 (rust/a.jpg, rust/b.jpg)" in line
    assert "outside_class_folders: 1 (loose.jpg)" in line
