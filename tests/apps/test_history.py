"""The session's history of diagnoses and its CSV download (leaflens.apps.history): bounded, newest first on the
page, and the CSV has `leaflens predict --csv`'s columns and, photo for photo, its values."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
from apps_helpers import write_digit, write_grey_noise, write_leaf
from PIL import Image

from leaflens.apps import history as hist
from leaflens.apps.cmd_predict import csv_header
from leaflens.apps.history import (
    HISTORY_MAX,
    _request_columns,
    add_result,
    new_history,
    predictions,
    remove_session,
    render_history,
    write_session_csv,
)
from leaflens.apps.notes import ClassNotes

NOTES = ClassNotes({"rust": {"name": "Rust", "name_zh": "锈病"}, "healthy": {"name": "Healthy", "name_zh": "健康"}})


def result(n: int, verdict: str = "diagnosis", label: str = "rust") -> dict:
    """A /diagnose answer with one photo named ``leaf<n>.jpg``."""
    photo = {"name": f"leaf{n}.jpg", "ok": True, "verdict": verdict, "label": label, "confidence": 0.8,
             "uncertain": verdict != "diagnosis", "top": [{"label": label, "probability": 0.8},
                                                          {"label": "healthy", "probability": 0.15}],
             "candidates": [label, "healthy"] if verdict == "ambiguous" else [], "ood_score": -0.3, "error": None}
    return {"verdict": verdict, "photos": [photo],
            "answer": {"verdict": verdict, "label": label, "confidence": 0.8, "candidates": photo["candidates"]}}


def test_history_is_bounded_and_keeps_the_newest():
    h = new_history()
    for n in range(HISTORY_MAX + 7):
        h = add_result(h, result(n), now=1000.0 + n)
    assert len(h["entries"]) == HISTORY_MAX
    assert h["entries"][0]["photos"][0]["name"] == "leaf7.jpg"
    assert h["entries"][-1]["photos"][0]["name"] == f"leaf{HISTORY_MAX + 6}.jpg"
    text = render_history(h, NOTES, "en")
    assert text.index(f"leaf{HISTORY_MAX + 6}") < text.index("leaf7")  # newest first
    assert "leaf6.jpg" not in text and f"last {HISTORY_MAX}" in text


def test_no_photos_is_not_a_diagnosis_and_the_input_is_not_changed():
    h = add_result(new_history(), result(1))
    before = [dict(e) for e in h["entries"]]
    assert add_result(h, {"verdict": None, "photos": [], "answer": None})["entries"] == before
    assert add_result(h, None)["entries"] == before
    add_result(h, result(2))
    assert h["entries"] == before  # a new dict is returned; the session's old value is left alone


def test_a_double_click_is_one_diagnosis_and_times_carry_the_servers_zone(tmp_path):
    """Double-clicking Diagnose ran it twice: the history and the CSV had the same diagnosis twice, and their
    times were the server's clock with no zone (a phone in another zone read them as its own)."""
    h = add_result(new_history(), result(1), now=1000.0)
    h = add_result(h, result(1), now=1000.3)  # the same photos, the same answer, a moment later
    assert len(h["entries"]) == 1
    h = add_result(h, result(1), now=1000.3 + 5)  # asked again later: a diagnosis of its own
    h = add_result(h, result(2), now=1005.4)  # other photos at once: of course
    assert len(h["entries"]) == 3
    assert len(add_result(h, result(2), now=900.0)["entries"]) == 4  # a clock set back: not a double click
    text = render_history(h, NOTES, "en")
    zone = time.strftime("%z", time.localtime(1000.0))  # "+0800", not "CST" (China, or US Central?)
    assert f" {zone} · leaf1\\.jpg" in text  # markdown-escaped name
    columns, rows = _request_columns(h)
    assert rows[0][1] == time.strftime("%Y-%m-%d %H:%M:%S%z", time.localtime(1000.0))
    assert rows[0][1][-5] in "+-" and rows[0][1][-4:].isdigit()


def test_history_words_in_both_languages():
    h = new_history()
    for n, (verdict, label) in enumerate([("diagnosis", "rust"), ("ambiguous", "rust"), ("out_of_domain", None),
                                          ("disagree", None)]):
        h = add_result(h, result(n, verdict, label or "rust"))
    en, zh = render_history(h, NOTES, "en"), render_history(h, NOTES, "zh")
    assert "**Rust** 80%" in en and "unsure: Rust or Healthy" in en and "not a leaf or pest" in en
    assert "the photos disagree" in en
    assert "**锈病** 80%" in zh and "不确定" in zh and "照片结果不一致" in zh
    assert render_history(new_history(), NOTES, "en") == "No diagnosis yet."


def test_session_csv_one_file_per_session_and_removed_with_it(tmp_path):
    root = tmp_path / "results"
    h = add_result(new_history(), result(1))
    h, first = write_session_csv(root, h, top_k=2, now=1000.0)
    assert first is not None and first.parent.parent == root and h["token"] and first.name.endswith(".csv")
    h = add_result(h, result(2))
    h, second = write_session_csv(root, h, top_k=2, now=1060.0)
    assert second.parent == first.parent and not first.exists()  # the newer CSV replaces the older
    rows = list(csv.reader(second.open(encoding="utf-8")))
    assert rows[0] == ["diagnosis", "time", "answer", *csv_header(2)]
    assert [r[3] for r in rows[1:]] == ["leaf1.jpg", "leaf2.jpg"] and [r[0] for r in rows[1:]] == ["1", "2"]
    assert write_session_csv(root, new_history(), top_k=2)[1] is None
    remove_session(root, h)
    assert not second.parent.exists()
    remove_session(root, {"token": "../.."})  # never anything but a token's own folder
    assert tmp_path.is_dir()


def test_session_folders_are_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(hist, "MAX_SESSION_FOLDERS", 3)
    root = tmp_path / "results"
    paths = []
    for n in range(5):
        _, p = write_session_csv(root, add_result(new_history(), result(n)), top_k=1)
        paths.append(p)
    assert len([d for d in root.iterdir()]) == 3 and paths[-1].exists()


def test_csv_matches_leaflens_predict_photo_for_photo(tiny_model, tmp_path):
    """The same photos through the service (page) and through `leaflens predict --csv`: same columns, same
    verdict, class ranking, probabilities, out-of-domain score and error for every photo the page names a
    class for; an out-of-domain photo has its verdict and score (the page names no class for it)."""
    from leaflens.apps.predictor import Predictor
    from leaflens.apps.service import DiagnosisService, ServiceOptions
    from leaflens.pipeline.cli import main

    model, _ = tiny_model(size=16, seed=2, ood_threshold=-0.1, **{"leaflens.uncertain_threshold": "0.8"})
    folder = tmp_path / "photos"
    folder.mkdir()
    files = [write_leaf(folder / f"leaf{i}.png", (64, 48), seed=i) for i in range(5)]
    files += [write_grey_noise(folder / "grey.png"), write_digit(folder / "digit.png")]
    Image.new("RGB", (1, 1), (90, 140, 60)).save(folder / "dot.png")
    (folder / "cut.png").write_bytes(files[0].read_bytes()[:100])
    files += [folder / "dot.png", folder / "cut.png"]
    top_k = 3
    h = new_history()
    with DiagnosisService(Predictor(model, intra_op_threads=1), None,
                          ServiceOptions(max_photos=16, max_wait_ms=1, top_k=top_k)) as svc:
        for chunk in (files[:4], files[4:]):  # two diagnoses in one session
            h = add_result(h, svc.diagnose(chunk))
    h, page_csv = write_session_csv(tmp_path / "results", h, top_k)
    cli_csv = tmp_path / "cli.csv"
    main(["predict", *map(str, files), "--model", str(model), "--csv", str(cli_csv), "--top-k", str(top_k),
          "--no-progress"])
    page_rows = list(csv.DictReader(page_csv.open(encoding="utf-8")))
    cli_rows = list(csv.DictReader(cli_csv.open(encoding="utf-8")))
    assert list(page_rows[0]) == ["diagnosis", "time", "answer", *list(cli_rows[0])]
    assert list(cli_rows[0]) == csv_header(top_k)
    # which diagnosis each row belongs to, and its answer (a photo's own verdict may differ from it)
    assert [r["diagnosis"] for r in page_rows] == ["1"] * 4 + ["2"] * (len(files) - 4)
    assert all(r["answer"] == str(h["entries"][int(r["diagnosis"]) - 1]["verdict"]) or
               r["answer"].startswith(str(h["entries"][int(r["diagnosis"]) - 1]["verdict"]) + ": ") for r in page_rows)
    assert [r["path"] for r in page_rows] == [f.name for f in files]
    verdicts = set()
    for page, cli in zip(page_rows, cli_rows):
        assert Path(cli["path"]).name == page["path"]
        assert page["verdict"] == cli["verdict"] and page["uncertain"] == cli["uncertain"], (page, cli)
        verdicts.add(page["verdict"])
        if page["ood_score"] or cli["ood_score"]:
            assert float(page["ood_score"]) == pytest.approx(float(cli["ood_score"]), rel=1e-4)
        if page["verdict"] in ("diagnosis", "ambiguous"):
            for i in range(1, top_k + 1):
                assert page[f"class_{i}"] == cli[f"class_{i}"]
                assert float(page[f"prob_{i}"]) == pytest.approx(float(cli[f"prob_{i}"]), abs=1e-5)
            assert page["label"] == cli["label"]
        elif page["verdict"] == "out_of_domain":  # neither names a class here
            assert page["label"] == cli["label"] == "" and page["class_1"] == cli["class_1"] == ""
            assert page["probability"] == cli["probability"] == ""
        else:
            assert page["error"] and cli["error"] and page["label"] == cli["label"] == ""
    assert {"out_of_domain", "refused", "error"} <= verdicts and verdicts & {"diagnosis", "ambiguous"}
    assert len(predictions(h)) == len(files)


def test_default_results_folder_is_the_servers_own_and_stale_ones_are_removed(tmp_path):
    import os
    import subprocess
    import sys

    from leaflens.apps.history import clean_stale_results, default_results_root

    assert default_results_root().name == f"leaflens-results-{os.getpid()}"
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)  # a process that has exited
    for name in (f"leaflens-results-{dead}", f"leaflens-results-{os.getpid()}", "leaflens-results-1",
                 "leaflens-results-notes"):
        (tmp_path / name / "abc").mkdir(parents=True)
    assert clean_stale_results(tmp_path) == [tmp_path / f"leaflens-results-{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"leaflens-results-{os.getpid()}", "leaflens-results-1", "leaflens-results-notes"])


def test_the_csv_of_a_chinese_page_gives_its_messages_in_chinese(tmp_path):
    """The page said "这张图片几乎只有一种颜色" and the CSV of the same diagnosis said it in English."""
    import csv as csv_module

    from leaflens.apps.diagnosis import error_message

    photo = {"name": "flat.png", "ok": False, "verdict": "refused", "label": None, "confidence": None, "top": [],
             "candidates": [], "ood_score": None,
             "error": {"reason": "uniform", "message": error_message("uniform", "en"), "values": {}}}
    h = add_result(new_history(), {"verdict": "refused", "photos": [photo], "answer": None}, now=1000.0)
    for lang in ("en", "zh"):
        h, path = write_session_csv(tmp_path, h, top_k=2, lang=lang)
        rows = list(csv_module.DictReader(path.open(encoding="utf-8")))
        assert rows[0]["error"] == error_message("uniform", lang), lang
