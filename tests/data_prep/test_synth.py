"""Tests for the synthetic leaf dataset (leaflens.data_prep.synth) and `leaflens data synth`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from leaflens.data_prep.decode import decode_image
from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.data_prep.synth import CLASSES, SynthOptions, generate, image_seed, render
from leaflens.pipeline.cli import main as cli_main

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

QUIET = {"log": lambda msg: None}


@pytest.fixture(scope="module")
def small_synth(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "ds"
    generate(out, SynthOptions(per_class=4, size=96, seed=5, broken=3, exif_fraction=0.3), workers=2, **QUIET)
    return out


def test_layout_and_metadata(small_synth):
    meta = json.loads((small_synth / "synth.json").read_text())
    assert meta["classes"] == list(CLASSES) and len(CLASSES) >= 8
    for c in CLASSES:
        files = sorted((small_synth / c).glob("*.jpg"))
        assert len(files) == 4 + sum(b["path"].startswith(c + "/") for b in meta["broken"])
    assert [b["kind"] for b in meta["broken"]] == ["truncated", "empty", "not_an_image"]
    assert meta["exif_rotated"], "exif_fraction 0.3 over 32 images should rotate some"
    with Image.open(small_synth / meta["exif_rotated"][0]["path"]) as im:
        assert im.getexif().get(0x0112) == meta["exif_rotated"][0]["orientation"]
        assert im.size == (96, 96)


def test_classes_toml_bilingual(small_synth):
    info = tomllib.loads((small_synth / "classes.toml").read_text(encoding="utf-8"))["classes"]
    assert list(info) == list(CLASSES)
    for c, entry in info.items():
        for key in ("name", "name_zh", "description", "description_zh", "advice", "advice_zh"):
            assert isinstance(entry[key], str) and entry[key].strip(), (c, key)
        assert any("\u4e00" <= ch <= "\u9fff" for ch in entry["name_zh"] + entry["description_zh"]), c


def test_deterministic_and_independent_of_workers(small_synth, tmp_path):
    other = tmp_path / "again"
    opts = SynthOptions(per_class=4, size=96, seed=5, broken=3, exif_fraction=0.3)
    generate(other, opts, workers=1, **QUIET)
    for p in sorted(small_synth.rglob("*.jpg")):
        assert (other / p.relative_to(small_synth)).read_bytes() == p.read_bytes(), p
    different = render("rust", 96, np.random.default_rng(image_seed(6, 1, 0)))
    assert not np.array_equal(different, render("rust", 96, np.random.default_rng(image_seed(5, 1, 0))))


def test_rerun_is_a_no_op(small_synth):
    before = {p: p.stat().st_mtime_ns for p in small_synth.rglob("*")}
    generate(small_synth, SynthOptions(per_class=4, size=96, seed=5, broken=3, exif_fraction=0.3), workers=2,
             **QUIET)
    assert {p: p.stat().st_mtime_ns for p in small_synth.rglob("*")} == before


def test_exif_rotated_files_decode_upright(small_synth):
    meta = json.loads((small_synth / "synth.json").read_text())
    for entry in meta["exif_rotated"][:3]:
        cls, name = entry["path"].split("/")
        i = int(name.split("_")[-1].split(".")[0])
        upright = render(cls, 96, np.random.default_rng(image_seed(5, CLASSES.index(cls), i)))
        decoded = decode_image(small_synth / entry["path"], 96).astype(int)
        assert np.abs(decoded - upright).mean() < 6, entry
        with Image.open(small_synth / entry["path"]) as im:  # the stored pixels alone are not upright
            raw = np.asarray(im.convert("RGB")).astype(int)
        assert np.abs(raw - upright).mean() > 10, entry


def test_ingest_rejects_exactly_the_broken_files(small_synth, tmp_path):
    out = tmp_path / "arrays"
    report = ingest(small_synth, out, IngestOptions(size=32), workers=2, **QUIET)
    meta = json.loads((small_synth / "synth.json").read_text())
    rejected = {json.loads(x)["path"]: json.loads(x)["reason"] for x in
                (out / "rejected.jsonl").read_text().splitlines()}
    assert rejected == {b["path"]: b["kind"] for b in meta["broken"]}
    assert report.kept_total == 4 * len(CLASSES)
    ds = load_dataset(out)
    assert ds.classes == sorted(CLASSES)
    assert ds.manifest.class_info == "classes.toml"
    assert (out / "classes.toml").read_bytes() == (small_synth / "classes.toml").read_bytes()


def test_not_separable_by_mean_colour():
    """Nearest-class-mean on mean RGB (2-fold) must stay far below 90 % (chance is 1/8)."""
    n = 16
    feats, labels = [], []
    for ci, c in enumerate(CLASSES):
        for i in range(n):
            img = render(c, 64, np.random.default_rng(image_seed(123, ci, i)))
            feats.append(img.reshape(-1, 3).mean(0))
            labels.append(ci)
    x, y = np.array(feats), np.array(labels)
    fold = np.arange(len(y)) % 2
    correct = 0
    for f in (0, 1):
        tr, te = fold != f, fold == f
        means = np.stack([x[tr & (y == k)].mean(0) for k in range(len(CLASSES))])
        pred = np.argmin(((x[te][:, None] - means[None]) ** 2).sum(-1), axis=1)
        correct += int((pred == y[te]).sum())
    acc = correct / len(y)
    print(f"nearest-class-mean accuracy on mean RGB: {acc:.3f}")
    assert acc < 0.45, acc


def test_cli_synth_and_errors(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["data", "synth", "--out", str(out), "--per-class", "1", "--broken", "0",
                     "--workers", "1"]) == 0
    assert len(list(out.rglob("*.jpg"))) == len(CLASSES)
    blocker = tmp_path / "notes"
    blocker.mkdir()
    (blocker / "a.txt").write_text("keep me")
    assert cli_main(["data", "synth", "--out", str(blocker), "--per-class", "1", "--workers", "1"]) == 1
    assert "refusing" in capsys.readouterr().err
    for size in ("16", "100000"):  # 100000: gigabytes per drawn image
        assert cli_main(["data", "synth", "--out", str(tmp_path / "big"), "--size", size, "--workers", "1"]) == 2
        assert "a size of 32 to 4096 px" in capsys.readouterr().err and not (tmp_path / "big").exists()
    with pytest.raises(ValueError):
        render("sunburn", 64, np.random.default_rng(0))
    # an empty path (an unset shell variable) is a usage error, not the current folder
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["data", "synth", "--out", ""])
    assert exit_info.value.code == 2 and "an empty path" in capsys.readouterr().err
    for argv in (["--src", "", "--out", str(tmp_path / "d")], ["--src", str(out), "--out", " "],
                 ["--src", str(out), "--out", str(tmp_path / "d"), "--also", ""]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["preprocess", *argv])
        assert exit_info.value.code == 2 and "an empty path" in capsys.readouterr().err


@pytest.mark.parametrize("option,value,words", [("--broken", "-1", "broken must be 0 or more"),
                                                ("--seed", "-1", "seed must be 0 or more, got -1"),
                                                ("--exif-fraction", "1.5", "exif_fraction must be from 0 to 1"),
                                                ("--exif-fraction", "nan", "exif_fraction must be from 0 to 1"),
                                                ("--workers", "0", "workers must be at least 1")])
def test_synth_options_that_make_no_sense_are_usage_errors(tmp_path, capsys, option, value, words):
    from leaflens.pipeline.cli import main  # noqa: PLC0415

    assert main(["data", "synth", "--out", str(tmp_path / "s"), "--per-class", "2", option, value]) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "s").exists()
