"""benchmarks/robustness.py: each phone edit does what its name says, and a run through an exported model
scores every photo of the split once per edit (the figures need a trained model: README, "What is measured")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from bench_helpers import assert_refused, load_benchmark, load_module, run_script
from PIL import Image


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("robustness.py")


def _photo(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    img = np.clip(rng.normal(120, 40, (60, 80, 3)), 0, 255).astype(np.uint8)
    path = tmp_path / "leaf.png"
    Image.fromarray(img).save(path)
    return path


def _edited(bench, src: Path, name: str, tmp_path: Path) -> np.ndarray:
    out = bench.write_edit(str(src), name, tmp_path / name)
    with Image.open(out) as im:
        assert im.size == (80, 60)
        return np.asarray(im.convert("RGB"), np.float64)


def test_each_edit_changes_what_it_says(bench, tmp_path):
    src = _photo(tmp_path)
    plain = np.asarray(Image.open(src), np.float64)
    np.testing.assert_allclose(_edited(bench, src, "dark50", tmp_path), np.rint(plain * 0.5), atol=0.51)
    warm = _edited(bench, src, "warm", tmp_path)
    assert warm[..., 0].mean() > plain[..., 0].mean() and warm[..., 2].mean() < plain[..., 2].mean()
    zoom = _edited(bench, src, "zoom50", tmp_path)
    small = np.asarray(Image.open(src).resize((40, 30), Image.Resampling.LANCZOS), np.float64)
    np.testing.assert_array_equal(zoom[15:45, 20:60], small)  # the whole photo, half the side, centred
    assert zoom[:15].std() < plain.std() / 3  # around it, a blurred enlargement: no detail of its own
    stamp = _edited(bench, src, "stamp", tmp_path)
    changed = np.argwhere(np.any(stamp != plain, axis=-1))
    assert len(changed) and changed[:, 0].min() >= 45 and changed[:, 1].max() >= 70  # along the bottom, to the right
    jpeg = bench.write_edit(str(src), "jpeg20", tmp_path / "q20")
    assert jpeg.suffix == ".jpg" and Image.open(jpeg).format == "JPEG"
    assert 0 < np.abs(np.asarray(Image.open(jpeg), np.float64) - plain).mean()
    assert np.abs(_edited(bench, src, "blur", tmp_path) - plain).mean() > 5


def test_an_unknown_edit_or_a_missing_dataset_is_refused(tmp_path):
    assert_refused(run_script("robustness.py", "--model", "m.onnx", "--dataset", "d", "--edits", "zoom50,sepia"),
                   2, "sepia")
    out = run_script("robustness.py", "--model", "m.onnx", "--dataset", str(tmp_path / "nothing"))
    assert_refused(out, 1, "robustness.py:", str(tmp_path / "nothing"))
    assert_refused(run_script("robustness.py", "--model", "m.onnx", "--dataset", "d", "--threads", "0"), 2, "threads")


def _evaluate_helpers():
    """tests/pipeline/test_evaluate.py's trained tiny run (photos, a dataset, a run) and export options."""
    return load_module(Path(__file__).resolve().parent / "pipeline" / "test_evaluate.py",
                       "leaflens_test_evaluate_helpers")


def test_every_photo_of_the_split_is_scored_once_per_edit(tmp_path):
    pytest.importorskip("onnxruntime")
    helpers = _evaluate_helpers()
    _, dataset, run = helpers._trained_run(tmp_path)
    helpers.export_run(helpers._opts(run, dataset, tmp_path / "export"), log=lambda s: None)
    out = run_script("robustness.py", "--model", str(tmp_path / "export" / "student.onnx"), "--dataset",
                     str(dataset), "--edits", "zoom50,dark50", "--threads", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    val = len(helpers.load_dataset(dataset)["val"])
    assert figures["photos"] == val and figures["split"] == "val"
    for edit in ("plain", "zoom50", "dark50"):
        shares = [figures[f"{k}_{edit}"] for k in ("right", "wrong", "unanswered")]
        assert abs(sum(shares) - 1) < 1e-3 and all(0 <= s <= 1 for s in shares)
        assert all(round(s * val) == pytest.approx(s * val, abs=0.01) for s in shares)  # whole photos
    assert figures["mean_right_edited"] == pytest.approx((figures["right_zoom50"] + figures["right_dark50"]) / 2,
                                                         abs=1e-4)
    assert figures["right_plain"] > 0.5  # the tiny model knows its own classes
    out = run_script("robustness.py", "--model", str(tmp_path / "export" / "student.onnx"), "--dataset",
                     str(dataset), "--split", "unlabeled")
    assert_refused(out, 1, "robustness.py:", "no labelled photos in split 'unlabeled'")
