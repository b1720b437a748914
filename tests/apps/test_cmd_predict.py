"""`leaflens predict` on a folder: CSV rows, verdicts, the error column, exit codes."""

from __future__ import annotations

import csv
import io
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from apps_helpers import reference_ood, reference_probs, write_digit, write_grey_noise, write_leaf, write_photo
from PIL import Image

from leaflens.apps.cmd_predict import collect_images
from leaflens.data_prep.decode import decode_image
from leaflens.pipeline.cli import main

CLASSES = ["angular_leaf_spot", "bean_rust", "healthy"]


def make_folder(root):
    (root / "field" / "sub").mkdir(parents=True)
    write_photo(root / "field" / "a.jpg", seed=1)
    write_photo(root / "field" / "sub" / "b.png", seed=2)
    write_photo(root / "field" / "sub" / "c.JPEG", seed=3, fmt="JPEG")
    (root / "field" / "broken.jpg").write_bytes(b"\xff\xd8\xff not a real jpeg")
    (root / "field" / "notes.txt").write_text("not an image, ignored")
    (root / "field" / ".hidden.jpg").write_bytes(b"ignored")
    return root / "field"


def test_folder_with_one_broken_file(tiny_model, tmp_path, capsys):
    model, weights = tiny_model(size=16, seed=2)
    folder = make_folder(tmp_path)
    out = tmp_path / "out.csv"
    code = main(["predict", str(folder), "--model", str(model), "--csv", str(out), "--top-k", "2",
                 "--batch-size", "2", "--no-progress"])
    assert code == 1
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    by_name = {r["path"].split("/")[-1]: r for r in rows}
    assert sorted(by_name) == ["a.jpg", "b.png", "broken.jpg", "c.JPEG"]
    assert list(rows[0]) == ["path", "verdict", "label", "probability", "uncertain", "ood_score", "class_1",
                             "prob_1", "class_2", "prob_2", "error"]
    broken = by_name["broken.jpg"]
    assert broken["label"] == "" and "broken.jpg" in broken["error"] and "cannot decode" in broken["error"]
    assert broken["verdict"] == "error"
    for name in ("a.jpg", "b.png", "c.JPEG"):
        row = by_name[name]
        expected = reference_probs(decode_image(row["path"], 16, "crop")[None], weights)[0]
        claimed = expected.max() >= 0.5  # an ambiguous photo's classes are class_1 and class_2, neither claimed
        assert row["error"] == "" and row["class_1"] == CLASSES[int(np.argmax(expected))]
        assert abs(float(row["prob_1"]) - expected.max()) < 1e-5 and float(row["prob_2"]) <= float(row["prob_1"])
        assert (row["label"], row["probability"]) == ((row["class_1"], row["prob_1"]) if claimed else ("", ""))
        assert row["uncertain"] == str(not claimed).lower()
        assert row["verdict"] == ("diagnosis" if claimed else "ambiguous")
        assert row["ood_score"] == ""  # this model has no out-of-domain output
    err = capsys.readouterr().err
    assert "1 unreadable" in err and "no out-of-domain check" in err
    assert "1 other file in the folders skipped, not images by their extension (.txt 1)" in err


def test_all_good_files_exit_zero_and_print_lines(tiny_model, tmp_path, capsys):
    model, _ = tiny_model()
    a = write_photo(tmp_path / "a.png", seed=1)
    b = write_photo(tmp_path / "b.webp", seed=2, fmt="WEBP")
    code = main(["predict", str(a), str(b), str(a), "--model", str(model), "--no-progress"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2  # a given twice is classified once
    fields = lines[0].split("\t")
    assert fields[0] == str(a) and fields[1] in ("diagnosis", "ambiguous") and fields[2].split(" ")[0] in CLASSES


def test_verdicts_in_csv_lines_and_summary(tiny_model, tmp_path, capsys):
    """A model with the out-of-domain output: every verdict, as the reference network and the thresholds say."""
    threshold, ood_threshold = 0.8, -0.1
    model, weights = tiny_model(size=16, seed=2, ood_threshold=ood_threshold,
                                **{"leaflens.uncertain_threshold": str(threshold)})
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(8):
        write_leaf(folder / f"leaf{i}.png", (64, 48), seed=i)
    write_grey_noise(folder / "grey.png")
    write_digit(folder / "digit.png")
    Image.new("RGB", (1, 1), (90, 140, 60)).save(folder / "dot.png")
    Image.new("RGB", (80, 60), (90, 140, 60)).save(folder / "flat.png")
    out = tmp_path / "out.csv"
    code = main(["predict", str(folder), "--model", str(model), "--csv", str(out), "--top-k", "1", "--no-progress"])
    assert code == 1  # two photos refused
    rows = {Path(r["path"]).name: r for r in csv.DictReader(out.open(encoding="utf-8"))}
    assert (rows["dot.png"]["verdict"], rows["flat.png"]["verdict"]) == ("refused", "refused")
    assert "1x1 px" in rows["dot.png"]["error"] and "uniform" in rows["flat.png"]["error"]
    seen = set()
    for name, row in rows.items():
        if name in ("dot.png", "flat.png"):
            continue
        pixels = decode_image(folder / name, 16)[None]
        probs, ood = reference_probs(pixels, weights)[0], float(reference_ood(pixels)[0])
        want = "out_of_domain" if ood > ood_threshold else "ambiguous" if probs.max() < threshold else "diagnosis"
        assert row["verdict"] == want, (name, row)
        assert float(row["ood_score"]) == pytest.approx(ood, abs=1e-5)
        assert row["uncertain"] == str(want != "diagnosis").lower() and "class_2" not in row  # --top-k 1
        named = want != "out_of_domain"  # no class is named for a photo unlike the training photos
        top = ["angular_leaf_spot", "bean_rust", "healthy"][int(np.argmax(probs))]  # tiny_model's classes
        assert (row["class_1"] == top) == named and bool(row["prob_1"]) == named, (name, row)
        # the diagnosis columns claim a class for a diagnosis only (an ambiguous photo's are class_1 and class_2)
        assert (row["label"] == top and bool(row["probability"])) == (want == "diagnosis"), (name, row)
        assert want == "diagnosis" or (row["label"], row["probability"]) == ("", ""), (name, row)
        seen.add(want)
    assert seen == {"diagnosis", "ambiguous", "out_of_domain"}, seen  # the photos cover every verdict
    assert rows["grey.png"]["verdict"] == rows["digit.png"]["verdict"] == "out_of_domain"
    counts = {v: sum(r["verdict"] == v for r in rows.values()) for v in ("diagnosis", "ambiguous", "out_of_domain")}
    err = capsys.readouterr().err
    assert (f"{counts['diagnosis']} diagnosis, {counts['ambiguous']} ambiguous, {counts['out_of_domain']} out of "
            "domain, 2 refused, 0 unreadable") in err

    code = main(["predict", str(folder), "--model", str(model), "--top-k", "1", "--no-progress"])
    lines = {Path(line.split("\t")[0]).name: line.split("\t") for line in capsys.readouterr().out.splitlines()}
    assert code == 1 and lines["dot.png"][1:3] == ["refused", "too_small"]
    assert lines["grey.png"][1:3] == ["out_of_domain", "-"] and lines["grey.png"][3].startswith("ood_score ")
    for name, row in rows.items():
        assert lines[name][1] == row["verdict"]
        if row["verdict"] == "ambiguous":  # names the top two even with --top-k 1
            assert " or " in lines[name][2] and lines[name][2].startswith(row["class_1"] + " or ")
        elif row["verdict"] == "diagnosis":
            assert lines[name][2] == row["label"]

    code = main(["predict", str(folder), "--model", str(model), "--csv", "-", "--top-k", "1", "--no-progress"])
    captured = capsys.readouterr()  # "-": the same CSV on standard output, no file named "-"
    assert code == 1 and list(csv.DictReader(io.StringIO(captured.out))) == list(csv.DictReader(out.open()))
    assert not Path("-").exists() and "results in" not in captured.err


def test_a_stale_link_named_by_a_glob_is_one_error_row_not_the_batch(tiny_model, tmp_path, capsys):
    """`predict photos/*.jpg` with a link to a deleted photo among them refused the whole batch (exit 2, no CSV)."""
    model, _ = tiny_model()
    photo = write_photo(tmp_path / "a.png")
    (tmp_path / "gone.jpg").symlink_to(tmp_path / "deleted.jpg")
    out = tmp_path / "r.csv"
    assert main(["predict", str(photo), str(tmp_path / "gone.jpg"), "--model", str(model), "--csv", str(out),
                 "--no-progress"]) == 1  # some photos could not be read
    rows = {Path(r["path"]).name: r for r in csv.DictReader(out.open(encoding="utf-8"))}
    assert rows["a.png"]["verdict"] in ("diagnosis", "ambiguous") and rows["gone.jpg"]["verdict"] == "error"
    capsys.readouterr()


def test_usage_and_model_errors_exit_two(tiny_model, tmp_path, capsys):
    model, _ = tiny_model()
    photo = write_photo(tmp_path / "a.png")
    assert main(["predict", str(tmp_path / "missing.jpg"), "--model", str(model)]) == 2
    assert "missing.jpg: no such file or folder" in capsys.readouterr().err
    assert main(["predict", str(photo), "--model", str(tmp_path / "none.onnx")]) == 2
    assert "none.onnx: model file not found" in capsys.readouterr().err
    bad, _ = tiny_model(name="bad.onnx", drop=("leaflens.classes",))
    assert main(["predict", str(photo), "--model", str(bad)]) == 2
    assert "leaflens.classes" in capsys.readouterr().err
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    assert main(["predict", str(empty), "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert "no image files found" in err and "skipped" not in err
    (empty / "leaf.gif").write_bytes(b"GIF89a")
    (empty / "README").write_text("no extension")
    assert main(["predict", str(empty), "--model", str(model)]) == 2
    assert "(2 other files in the folders skipped, not images by their extension (no extension 1, .gif 1)" \
        in capsys.readouterr().err
    assert main(["predict", str(photo), "--model", str(model), "--top-k", "0"]) == 2
    before = photo.read_bytes()
    assert main(["predict", str(tmp_path), "--model", str(model), "--csv", str(photo)]) == 2  # a typo'd --csv
    assert "is not an earlier results file" in capsys.readouterr().err and photo.read_bytes() == before
    assert main(["predict", str(photo), "--model", str(model), "--csv", str(empty)]) == 2
    assert "is a folder" in capsys.readouterr().err
    model_bytes = model.read_bytes()
    assert main(["predict", str(photo), "--model", str(model), "--csv", str(model)]) == 2
    assert "is the model" in capsys.readouterr().err and model.read_bytes() == model_bytes


def test_without_model_the_export_s_file_is_used_as_by_serve(tiny_model, tmp_path, capsys, monkeypatch):
    """`leaflens predict photo.jpg` and `leaflens evaluate --photos P` in the project folder after an export."""
    import shutil  # noqa: PLC0415

    model, _ = tiny_model()
    photo = write_photo(tmp_path / "a.png")
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    assert main(["predict", str(photo)]) == 2
    assert ("artifacts/export/student.onnx: model file not found (`leaflens export` writes one; another model: "
            "--model PATH)") in capsys.readouterr().err
    assert main(["evaluate", "--photos", str(tmp_path)]) == 2
    assert "artifacts/export/student.onnx: model file not found" in capsys.readouterr().err
    (project / "artifacts" / "export").mkdir(parents=True)
    shutil.copyfile(model, project / "artifacts" / "export" / "student.onnx")
    assert main(["predict", str(photo), "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(str(photo))


def test_collect_images_order_and_filtering(tmp_path):
    folder = make_folder(tmp_path)
    skipped: Counter[str] = Counter()
    names = [p.split("/")[-1] for p in collect_images([folder], skipped)]
    assert names == ["a.jpg", "broken.jpg", "b.png", "c.JPEG"]  # sorted per folder, subfolders after
    # hidden files are not counted among the other extensions, but apart (the summary says how many)
    from leaflens.apps.cmd_predict import HIDDEN  # noqa: PLC0415

    assert skipped == {".txt": 1, HIDDEN: 1}


def test_a_link_to_a_photo_already_listed_is_said_not_dropped_silently(tiny_model, tmp_path, capsys):
    """A symlink in the folder to another of its photos: answered once (it is the same photo), and no word of
    it: the summary said "1 image" for two names, and preprocess and evaluate counted both."""
    model, _ = tiny_model()
    folder = tmp_path / "photos"
    folder.mkdir()
    write_photo(folder / "a.png")
    (folder / "link_to_a.png").symlink_to("a.png")
    assert main(["predict", str(folder), "--model", str(model), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "1 image with" in err and "1 name of a photo already listed (a link to it" in err


def test_odd_folders_are_said_not_tracebacks(tiny_model, tmp_path, capsys, monkeypatch):
    """A file name not in UTF-8 is classified and written escaped; a folder that cannot be read is named."""
    model, _ = tiny_model()
    folder = tmp_path / "photos"
    folder.mkdir()
    write_photo(folder / "a.png")
    if sys.platform.startswith("linux"):
        os.rename(write_photo(tmp_path / "b.png"), os.fsencode(folder) + b"/caf\xe9.png")
        out = tmp_path / "r.csv"
        assert main(["predict", str(folder), "--model", str(model), "--csv", str(out)]) == 0
        rows = list(csv.reader(out.open(encoding="utf-8")))
        assert len(rows) == 3 and any(r[0].endswith("caf\\udce9.png") for r in rows)  # was a UnicodeEncodeError
    real_scandir = os.scandir

    def scandir(path=".", *a, **kw):
        if os.fspath(path) == os.fspath(folder):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", scandir)
    assert main(["predict", str(folder), "--model", str(model)]) == 2
    assert f"cannot read the folder {folder}: Permission denied" in capsys.readouterr().err


def test_csv_replaces_only_an_earlier_results_file(tiny_model, tmp_path, capsys):
    model, _ = tiny_model()
    photo = write_photo(tmp_path / "a.png")
    for name, content in (("parity.json", b'{"passed": true}'), ("victim.jpg", photo.read_bytes()),
                          ("notes.csv", b"name,comment\nx,y\n")):
        other = tmp_path / name
        other.write_bytes(content)
        assert main(["predict", str(photo), "--model", str(model), "--csv", str(other), "--no-progress"]) == 2
        assert "is not an earlier results file" in capsys.readouterr().err
        assert other.read_bytes() == content
    out = tmp_path / "results.csv"
    for _ in range(2):  # written, then replaced: it is our own
        assert main(["predict", str(photo), "--model", str(model), "--csv", str(out), "--no-progress"]) == 0
    assert out.read_text(encoding="utf-8").startswith("path,verdict,")

    assert main(["predict", str(photo), "--model", str(model), "--csv", str(photo / "x.csv"), "--no-progress"]) == 2
    assert f"{photo} is a file, not a folder" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_results_folder_nobody_can_write_in_is_said_before_the_work(tiny_model, tmp_path, capsys):
    """/proc refuses new files even to root, which os.access lets through: the check creates one to know."""
    model, _ = tiny_model()
    photo = write_photo(tmp_path / "a.png")
    assert main(["predict", str(photo), "--model", str(model), "--csv", "/proc/x.csv", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--csv /proc/x.csv: cannot write in the folder /proc" in err and "Traceback" not in err
    assert main(["evaluate", "--model", str(model), "--photos", str(tmp_path), "--json", "/proc/x.json"]) == 2
    assert "--json /proc/x.json: cannot write in the folder /proc" in capsys.readouterr().err


def test_results_that_cannot_be_written_after_the_work_are_printed_not_lost(tiny_model, tmp_path, capsys,
                                                                            monkeypatch):
    from leaflens.apps import cmd_predict  # noqa: PLC0415

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    model, _ = tiny_model()
    photo = write_photo(tmp_path / "a.png")
    monkeypatch.setattr(cmd_predict, "write_csv", disk_full)
    assert main(["predict", str(photo), "--model", str(model), "--csv", str(tmp_path / "r.csv"),
                 "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "cannot write" in captured.err and "No space left on device" in captured.err
    assert captured.out.startswith(f"{photo}\t") and "Traceback" not in captured.err


def test_pipes_and_devices_are_unreadable_rows_not_hangs(tiny_model, tmp_path, capsys):
    model, _ = tiny_model()
    photo = write_photo(tmp_path / "a.png")
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    code = main(["predict", str(fifo), str(photo), os.devnull, "--model", str(model), "--no-progress"])
    assert code == 1
    out = capsys.readouterr().out
    assert "pipe.jpg\terror\tunreadable\t" in out and "not a regular file" in out
    assert f"{os.devnull}\terror\tunreadable" in out and "a.png\t" in out


def test_names_cannot_break_lines_or_run_in_a_spreadsheet(tiny_model, tmp_path, capsys, monkeypatch):
    model, _ = tiny_model()
    folder = tmp_path / "imgs"
    folder.mkdir()
    write_photo(folder / "new\nline.png", seed=1)
    write_photo(folder / "tab\tname.png", seed=2)
    write_photo(folder / "=HYPERLINK(1)+cmd.png", seed=3)
    assert main(["predict", str(folder), "--model", str(model), "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all(len(line.split("\t")) == 4 for line in lines)
    assert any("new\\nline.png\t" in line for line in lines) and any("tab\\tname.png\t" in line for line in lines)
    monkeypatch.chdir(folder)  # the names alone, as a spreadsheet would read them
    out = tmp_path / "r.csv"
    assert main(["predict", "=HYPERLINK(1)+cmd.png", "--model", str(model), "--csv", str(out),
                 "--no-progress"]) == 0
    rows = list(csv.DictReader(out.open(encoding="utf-8", newline="")))
    assert rows[0]["path"] == "'=HYPERLINK(1)+cmd.png"


def test_a_named_file_is_not_counted_as_skipped(tiny_model, tmp_path, capsys):
    model, _ = tiny_model()
    folder = tmp_path / "imgs"
    folder.mkdir()
    write_photo(folder / "a.png", seed=1)
    Image.new("RGB", (64, 64), (30, 120, 40)).save(folder / "palette.gif")
    (folder / "notes.txt").write_text("x")
    main(["predict", str(folder), str(folder / "palette.gif"), "--model", str(model), "--no-progress"])
    captured = capsys.readouterr()
    assert "palette.gif\t" in captured.out
    assert "(.txt 1)" in captured.err and ".gif" not in captured.err
    # hidden files and folders were skipped without a word (evaluate and preprocess count them)
    (folder / ".thumbnails").mkdir()
    write_photo(folder / ".thumbnails" / "a.png", seed=2)
    write_photo(folder / "._a.png", seed=3)
    main(["predict", str(folder), "--model", str(model), "--no-progress"])
    captured = capsys.readouterr()
    assert "2 hidden files or folders skipped (names starting with '.'" in captured.err
    assert ".thumbnails" not in captured.out and "._a.png" not in captured.out


def test_the_skipped_files_note_names_the_commonest_extensions_only():
    """A folder holding a link to /usr skipped about 500 kinds of file, all named on one summary line."""
    from collections import Counter  # noqa: PLC0415

    from leaflens.apps.cmd_predict import skipped_note  # noqa: PLC0415

    skipped = Counter({f".x{i:03d}": 1000 - i for i in range(500)})
    note = skipped_note(skipped)
    assert note.startswith(f"{sum(skipped.values())} other files in the folders skipped, not images by their "
                           "extension (.x000 1000, .x001 999,")
    assert ".x007 993 and 492 other extensions); name a file" in note and ".x008" not in note
    assert "and 1 other extension);" in skipped_note(Counter({f".y{i}": 1 for i in range(9)}))
    assert skipped_note(Counter({".txt": 2, ".gif": 2})) == ("4 other files in the folders skipped, not images by "
                                                             "their extension (.gif 2, .txt 2); name a file to "
                                                             "classify it anyway")
