"""`leaflens predict` on a folder: CSV rows, the error column, exit codes."""

from __future__ import annotations

import csv

import numpy as np
from apps_helpers import reference_probs, write_photo

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
    assert list(rows[0]) == ["path", "label", "probability", "uncertain", "class_1", "prob_1",
                             "class_2", "prob_2", "error"]
    broken = by_name["broken.jpg"]
    assert broken["label"] == "" and "broken.jpg" in broken["error"] and "cannot decode" in broken["error"]
    for name in ("a.jpg", "b.png", "c.JPEG"):
        row = by_name[name]
        expected = reference_probs(decode_image(row["path"], 16, "crop")[None], weights)[0]
        assert row["error"] == "" and row["label"] == CLASSES[int(np.argmax(expected))]
        assert abs(float(row["probability"]) - expected.max()) < 1e-5
        assert row["class_1"] == row["label"] and float(row["prob_2"]) <= float(row["prob_1"])
        assert row["uncertain"] == str(bool(expected.max() < 0.5)).lower()
    assert "1 unreadable" in capsys.readouterr().err


def test_all_good_files_exit_zero_and_print_lines(tiny_model, tmp_path, capsys):
    model, _ = tiny_model()
    a = write_photo(tmp_path / "a.png", seed=1)
    b = write_photo(tmp_path / "b.webp", seed=2, fmt="WEBP")
    code = main(["predict", str(a), str(b), str(a), "--model", str(model), "--no-progress"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2  # a given twice is classified once
    assert lines[0].startswith(str(a) + "\t") and lines[0].split("\t")[1].split(" ")[0] in CLASSES


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
    assert "no image files found" in capsys.readouterr().err
    assert main(["predict", str(photo), "--model", str(model), "--top-k", "0"]) == 2


def test_collect_images_order_and_filtering(tmp_path):
    folder = make_folder(tmp_path)
    names = [p.split("/")[-1] for p in collect_images([folder])]
    assert names == ["a.jpg", "broken.jpg", "b.png", "c.JPEG"]  # sorted per folder, subfolders after
