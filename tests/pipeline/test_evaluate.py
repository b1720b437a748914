"""`leaflens evaluate` (the served model on photo files) and the export stage's served-accuracy check."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("onnxruntime")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))

from apps_helpers import build_tiny_model, leaflens_metadata, reference_probs, tiny_weights  # noqa: E402

from leaflens.data_prep.contract import area_resize, normalize  # noqa: E402
from leaflens.data_prep.decode import decode_image  # noqa: E402
from leaflens.data_prep.ingest import IngestOptions, ingest  # noqa: E402
from leaflens.data_prep.manifest import load_dataset, manifest_sha256  # noqa: E402
from leaflens.engine import Tensor, ops  # noqa: E402
from leaflens.engine.checkpoint import save_checkpoint  # noqa: E402
from leaflens.engine.optim import Adam  # noqa: E402
from leaflens.pipeline.cli import main  # noqa: E402
from leaflens.pipeline.evaluate import PhotoEvaluation  # noqa: E402
from leaflens.pipeline.export.stage import ExportFailed, ExportOptions, export_run  # noqa: E402
from leaflens.pipeline.models.student import StudentCNN  # noqa: E402

CLASSES = ["blight", "healthy", "rust"]
COLOURS = {"blight": (150, 90, 40), "healthy": (40, 160, 50), "rust": (170, 60, 30)}
STORED, INPUT = 32, 16


def _jpeg(cls: str, seed: int) -> bytes:
    """A 96x72 class-coloured textured photo; every third one EXIF-rotated as phones write them."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:72, 0:96]
    ci = CLASSES.index(cls)
    stripes = 40 * np.sin((xx if ci % 2 else yy) / (2 + ci) + rng.uniform(0, 6))[..., None]
    img = np.clip(np.array(COLOURS[cls], np.float64) + stripes + rng.normal(0, 25, (72, 96, 3)), 0, 255)
    kw = {}
    if seed % 3 == 0:
        exif = Image.Exif()
        exif[0x0112] = 6
        kw["exif"] = exif.tobytes()
    buf = io.BytesIO()
    Image.fromarray(img.astype(np.uint8)).save(buf, "JPEG", quality=92, **kw)
    return buf.getvalue()


def _photos(root: Path, per_class: int = 14) -> Path:
    for ci, cls in enumerate(CLASSES):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            (root / cls / f"{cls}_{i:02d}.jpg").write_bytes(_jpeg(cls, 100 * ci + i))
    return root


def _trained_run(tmp: Path) -> tuple[Path, Path, Path]:
    """(photos, dataset stored at 32 px, run of a StudentCNN trained at 16 px input)."""
    photos = _photos(tmp / "photos")
    dataset = tmp / "dataset"
    ingest(photos, dataset, IngestOptions(size=STORED), workers=1, log=lambda s: None)
    ds = load_dataset(dataset)
    model = StudentCNN(len(CLASSES), widths=(8, 16), rng=np.random.default_rng(0))
    x = normalize(area_resize(np.asarray(ds["train"].images), INPUT), ds.mean, ds.std)
    y = np.asarray(ds["train"].labels)
    opt = Adam(model.parameters(), lr=0.02)
    model.train()
    for _ in range(40):
        loss = ops.cross_entropy(model(Tensor(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    extra = {"model_config": {"kind": "student_cnn", "num_classes": 3, "widths": [8, 16], "in_channels": 3,
                              "dropout": 0.0},
             "dataset": {"classes": ds.classes, "mean": ds.mean.tolist(), "std": ds.std.tolist(),
                         "image_size": STORED, "input_size": INPUT, "resize": "crop",
                         "manifest_sha256": manifest_sha256(dataset)},
             "metrics": {"val_accuracy": 0.9, "test_accuracy": 0.9, "uncertain_threshold": 0.5},
             "run_id": "eval-run"}
    run = tmp / "student"
    save_checkpoint(run / "best.npz", model, epoch=1, step=40, extra=extra)
    return photos, dataset, run


def _opts(run: Path, dataset: Path, out: Path) -> ExportOptions:
    return ExportOptions(run=run, out=out, dataset=dataset, int8=False, speed_seconds=0.02, threads=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, Path]:
    return _trained_run(tmp_path_factory.mktemp("served"))


def test_export_records_the_served_test_accuracy_next_to_the_engines(trained, tmp_path):
    photos, dataset, run = trained
    out = tmp_path / "export"
    report = export_run(_opts(run, dataset, out), log=lambda s: None)
    served = report["served"]
    ds = load_dataset(dataset)
    assert served["checked"] and served["photos"] == len(ds["test"]) and served["source"] == str(photos)
    engine = report["accuracy"]["test"]["engine"]
    assert served["engine_test_accuracy"] == engine
    # the photo files decode to the stored pixels and go down to 16 px exactly as in evaluation
    assert served["served_test_accuracy"] == engine and served["difference_points"] == 0.0
    assert served["max_difference_points"] == 0.5
    assert json.loads((out / "parity.json").read_text())["served"] == served
    # `leaflens evaluate` on the same photos says the same for the whole folder
    code = main(["evaluate", "--model", str(out / "student.onnx"), "--photos", str(photos), "--json",
                 str(tmp_path / "eval.json")])
    assert code == 0
    ev = PhotoEvaluation.from_dict(json.loads((tmp_path / "eval.json").read_text()))
    assert ev.summary["n"] == sum(len(ds[s]) for s in ("train", "val", "test")) and not ev.unreadable


def test_served_check_is_skipped_with_a_warning_when_the_photos_are_gone(tmp_path):
    photos, dataset, run = _trained_run(tmp_path)
    shutil.rmtree(photos)
    logged: list[str] = []
    report = export_run(_opts(run, dataset, tmp_path / "export"), log=logged.append)
    served = report["served"]
    assert not served["checked"] and served["served_test_accuracy"] is None
    assert "no longer in" in served["reason"] and str(photos) in served["reason"]
    assert any("served-accuracy check skipped" in w for w in report["warnings"])
    assert any(line.startswith("warning: served-accuracy check skipped") for line in logged)
    assert report["passed"] and (tmp_path / "export" / "student.onnx").is_file()


def test_a_missing_correction_is_named_in_its_own_folder(tmp_path):
    """A photo of `preprocess --also` (a correction) that was moved away: the message said it was no longer in
    the source folder, where it had never been."""
    from leaflens.pipeline.evaluate import PhotosUnavailable, dataset_photo_files

    photos = _photos(tmp_path / "photos", per_class=6)
    extra = tmp_path / "corrections"
    for cls in CLASSES:
        (extra / cls).mkdir(parents=True)
        for i in range(4):
            (extra / cls / f"c{i}.jpg").write_bytes(_jpeg(cls, 5000 + i))
    ingest(photos, tmp_path / "ds", IngestOptions(size=32), workers=1, also=[extra], log=lambda m: None)
    ds = load_dataset(tmp_path / "ds")
    split, gone = next((s, Path(f)) for s in ("train", "val", "test") for f in ds[s].files
                       if f.startswith(str(extra.resolve())))
    gone.unlink()
    with pytest.raises(PhotosUnavailable) as err:
        dataset_photo_files(ds, split)
    assert f"no longer in {gone.parent} (first: {gone})" in str(err.value) and str(photos) not in str(err.value)


def test_served_gate_fails_and_replaces_nothing_when_the_photos_no_longer_match(tmp_path):
    photos, dataset, run = _trained_run(tmp_path)
    out = tmp_path / "export"
    export_run(_opts(run, dataset, out), log=lambda s: None)
    previous = (out / "student.onnx").read_bytes()
    ds = load_dataset(dataset)
    for rel, label in zip(ds["test"].files, ds["test"].labels):  # every test photo now shows another class
        other = CLASSES[(int(label) + 1) % 3]
        (photos / rel).write_bytes((photos / other / f"{other}_00.jpg").read_bytes())
    with pytest.raises(ExportFailed, match=r"served test accuracy .* differs from the engine's") as info:
        export_run(_opts(run, dataset, out), log=lambda s: None)
    assert "changed since `leaflens preprocess`" in str(info.value)
    assert (out / "student.onnx").read_bytes() == previous
    failed = json.loads((tmp_path / "export.parity-failed.json").read_text())
    assert failed["served"]["checked"] and failed["served"]["difference_points"] < -0.5


# ---------------------------------------------------------------------------- leaflens evaluate
def _tiny_model(tmp: Path, weights: dict[str, np.ndarray]) -> Path:
    meta = leaflens_metadata(CLASSES, 16, **{"leaflens.format": "2", "leaflens.stored_size": "32"})
    return build_tiny_model(tmp / "tiny.onnx", weights, 16, meta)


def test_evaluate_prints_accuracy_per_class_and_confusion_and_writes_json(tmp_path, capsys):
    weights = tiny_weights(3, seed=1)
    model = _tiny_model(tmp_path, weights)
    photos = _photos(tmp_path / "photos", per_class=4)
    (photos / "healthy" / "notes.txt").write_text("not a photo")  # ignored, like preprocess does
    code = main(["evaluate", "--model", str(model), "--photos", str(photos), "--json", str(tmp_path / "e.json")])
    out = capsys.readouterr().out
    assert code == 0
    # the figures of the NumPy re-computation of the model on the contract's input
    files = sorted(photos.glob("*/*.jpg"))
    labels = np.array([CLASSES.index(f.parent.name) for f in files])
    stored = np.stack([decode_image(f, 32, "crop") for f in files])
    small = np.clip(area_resize(stored, 16), 0, 255)
    pred = reference_probs(small, weights).argmax(1)
    want = float((pred == labels).mean())
    ev = json.loads((tmp_path / "e.json").read_text())
    assert ev["summary"]["accuracy"] == pytest.approx(want) and ev["summary"]["n"] == 12
    cm = np.zeros((3, 3), int)
    np.add.at(cm, (labels, pred), 1)
    assert ev["summary"]["confusion_matrix"] == cm.tolist()
    assert f"accuracy {want:.2%}" in out and "confusion matrix" in out
    for i, cls in enumerate(CLASSES):
        assert f"{i} {cls}" in out


def test_evaluate_refuses_a_class_the_model_does_not_know(tmp_path, capsys):
    model = _tiny_model(tmp_path, tiny_weights(3))
    photos = _photos(tmp_path / "photos", per_class=2)
    (photos / "mildew").mkdir()
    (photos / "mildew" / "m.jpg").write_bytes(_jpeg("rust", 7))
    code = main(["evaluate", "--model", str(model), "--photos", str(photos)])
    err = capsys.readouterr().err
    assert code == 2 and "'mildew'" in err and "name no class the model knows" in err and "'healthy'" in err
    nested = _photos(tmp_path / "nested" / "plants", per_class=2)  # the class folders one level down
    code = main(["evaluate", "--model", str(model), "--photos", str(tmp_path / "nested")])
    err = capsys.readouterr().err
    assert code == 2 and "'plants' name no class the model knows" in err
    assert f"; {nested} holds folders named as the model's classes: point at it" in err


def test_evaluate_reads_the_web_apps_corrections_folder(tmp_path, capsys):
    """The corrections folder holds not_a_leaf/ beside the class folders; evaluate refused it as "a class the
    model does not know", so the photos the old model got wrong could not be scored against the new one."""
    model = _tiny_model(tmp_path, tiny_weights(3))
    photos = _photos(tmp_path / "corrections", per_class=2)
    (photos / "not_a_leaf").mkdir()
    (photos / "not_a_leaf" / "bee.jpg").write_bytes(_jpeg("rust", 8))
    (photos / "corrections.jsonl").write_text("{}\n")
    code = main(["evaluate", "--model", str(model), "--photos", str(photos), "--json", str(tmp_path / "e.json")])
    err = capsys.readouterr().err
    assert code == 0 and f"--not-known {photos / 'not_a_leaf'}" in err
    assert "outside the class folders" not in err  # corrections.jsonl is the folder's own log, not a stray file
    assert json.loads((tmp_path / "e.json").read_text())["summary"]["n"] == 6
    code = main(["evaluate", "--model", str(model), str(photos), "--not-known", str(photos / "not_a_leaf")])
    assert code == 0 and "not_a_leaf left out" not in capsys.readouterr().err  # asked for already: no advice
    from leaflens.apps.corrections import LOG_NAME

    assert LOG_NAME == "corrections.jsonl"  # the name leaflens.data_prep.scan counts as the folder's own


def test_evaluate_says_what_it_leaves_out_and_where_to_point_it(tmp_path, capsys):
    """An unlabeled/ folder was skipped without a word; a photo file was "not a folder" (it exists), and one
    class's folder "has no class folders" with no hint to point at the folder above."""
    model = _tiny_model(tmp_path, tiny_weights(3))
    photos = _photos(tmp_path / "photos", per_class=2)
    (photos / "unlabeled").mkdir()
    (photos / "unlabeled" / "u.jpg").write_bytes(_jpeg("rust", 9))
    (photos / "rust" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    assert main(["evaluate", "--model", str(model), str(photos)]) == 0
    err = capsys.readouterr().err
    assert "1 link(s) to a missing file (rust/gone.jpg)" in err
    assert f"note: {photos / 'unlabeled'} left out (1 photo)" in err
    assert f"leaflens predict {photos / 'unlabeled'}" in err and "--not-known " + str(photos) not in err
    one = next((photos / "rust").iterdir())
    assert main(["evaluate", "--model", str(model), str(one)]) == 2
    assert "is a file; evaluate takes a folder of class folders" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(model), str(photos / "rust")]) == 2
    assert f"if it is one class's folder, point at the folder above it, {photos.resolve()}" in capsys.readouterr().err


def test_evaluate_counts_unreadable_photos_apart_and_exits_1(tmp_path, capsys):
    model = _tiny_model(tmp_path, tiny_weights(3))
    photos = _photos(tmp_path / "photos", per_class=2)
    (photos / "rust" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    code = main(["evaluate", "--model", str(model), "--photos", str(photos), "--json", str(tmp_path / "e.json")])
    captured = capsys.readouterr()
    assert code == 1 and "broken.jpg" in captured.out and "could not be read" in captured.out
    ev = json.loads((tmp_path / "e.json").read_text())
    assert ev["summary"]["n"] == 6 and [Path(u["file"]).name for u in ev["unreadable"]] == ["broken.jpg"]
    nothing = tmp_path / "nothing" / "rust"
    nothing.mkdir(parents=True)
    (nothing / "a.jpg").write_bytes(b"")
    assert main(["evaluate", "--model", str(model), "--photos", str(nothing.parent)]) == 1  # not a usage error
    assert "none of the 1 photos could be read" in capsys.readouterr().err


def test_macro_figures_average_the_classes_with_photos(tmp_path, capsys):
    model = _tiny_model(tmp_path, tiny_weights(3))
    photos = _photos(tmp_path / "photos", per_class=3)
    for cls in CLASSES[1:]:  # a field set of one class
        for f in (photos / cls).iterdir():
            f.unlink()
        (photos / cls).rmdir()
    (photos / "loose.jpg").write_bytes((photos / CLASSES[0] / next(iter(os.listdir(photos / CLASSES[0])))).read_bytes())
    (photos / CLASSES[0] / "notes.txt").write_text("x")
    assert main(["evaluate", "--model", str(model), "--photos", str(photos), "--json", str(tmp_path / "e.json")]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "1 file(s) outside the class folders" in captured.err and "1 file(s) not images" in captured.err
    s = json.loads((tmp_path / "e.json").read_text())["summary"]
    (only,) = [c for c in s["per_class"] if c["support"]]
    assert s["macro_classes"] == 1 and s["macro_recall"] == only["recall"] and s["macro_f1"] == only["f1"]
    assert "n/a" in out and "average the 1 classes with photos here, of 3" in out
    for c in s["per_class"]:  # --json has no figure where the console says n/a (it wrote 0.0)
        if not c["support"]:
            assert c["recall"] is None and c["f1"] is None
            assert (c["precision"] is None) == (not c.get("predicted"))


def test_evaluate_usage_errors_exit_2(tmp_path, capsys):
    model = _tiny_model(tmp_path, tiny_weights(3))
    split = tmp_path / "split"
    _photos(split / "test", per_class=1)
    assert main(["evaluate", "--model", str(model), "--photos", str(split)]) == 2
    assert "point --photos at one of them" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(model), "--photos", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(tmp_path / "none.onnx"), "--photos", str(split / "test")]) == 2
    assert "model file not found" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(model)]) == 2  # no folder
    assert "give the folder of class folders once" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(model), str(split / "test"), "--photos", str(split / "test")]) == 2
    assert "not both" in capsys.readouterr().err
    # --json never replaces the model or a photo, and a bad path is said before the work
    model_bytes = model.read_bytes()
    photo = next((split / "test").rglob("*.jpg"))
    photo_bytes = photo.read_bytes()
    report = tmp_path / "parity.json"  # an existing file that is not an earlier evaluation is not replaced
    report.write_text('{"passed": true}')
    for target, words in ((model, "is the model"), (photo, "is a file in the photos"), (split, "is a folder"),
                          (tmp_path / "no" / "x.json", "does not exist"),
                          (report, "is not an earlier results file")):
        assert main(["evaluate", str(split / "test"), "--model", str(model), "--json", str(target)]) == 2
        assert words in capsys.readouterr().err
    assert model.read_bytes() == model_bytes and photo.read_bytes() == photo_bytes
    assert report.read_text() == '{"passed": true}'
    earlier = split / "test" / "eval.json"  # an earlier results file in the photo folder may be replaced
    for _ in range(2):
        assert main(["evaluate", str(split / "test"), "--model", str(model), "--json", str(earlier)]) == 0


def test_evaluate_takes_the_folder_as_an_argument_as_predict_does(tmp_path, capsys):
    model = _tiny_model(tmp_path, tiny_weights(3, seed=2))
    photos = _photos(tmp_path / "photos", per_class=3)
    assert main(["evaluate", "--model", str(model), "--photos", str(photos), "--json", str(tmp_path / "a.json")]) == 0
    assert main(["evaluate", str(photos), "--model", str(model), "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    assert a["summary"] == b["summary"] and a["summary"]["n"] == 9


def test_evaluate_counts_verdicts_and_the_photos_the_app_would_refuse(tmp_path, capsys):
    """A model with the out-of-domain output: verdicts counted as the reference says; a 1x1 and a flat photo are
    listed as refused by the app but still measured (the figures are the model's on every readable photo)."""
    from apps_helpers import ood_metadata, reference_ood, write_grey_noise

    weights = tiny_weights(3, seed=1)
    meta = leaflens_metadata(CLASSES, 16, **ood_metadata(-0.05, 32), **{"leaflens.uncertain_threshold": "0.6"})
    model = build_tiny_model(tmp_path / "ood.onnx", weights, 16, meta, ood=True)
    photos = _photos(tmp_path / "photos", per_class=4)
    write_grey_noise(photos / "rust" / "grey.png")
    Image.new("RGB", (1, 1), COLOURS["rust"]).save(photos / "blight" / "dot.png")
    Image.new("RGB", (90, 70), COLOURS["healthy"]).save(photos / "healthy" / "flat.png")
    code = main(["evaluate", "--model", str(model), "--photos", str(photos), "--json", str(tmp_path / "e.json")])
    out = capsys.readouterr().out
    assert code == 0  # refused photos are no failure here: they are measured
    files = sorted(f for f in photos.glob("*/*") if f.suffix in (".jpg", ".png"))
    labels = np.array([CLASSES.index(f.parent.name) for f in files])
    small = np.clip(area_resize(np.stack([decode_image(f, 32, "crop") for f in files]), 16), 0, 255)
    probs, ood = reference_probs(small, weights), reference_ood(small)
    outside = ood > -0.05
    ambiguous = ~outside & (probs.max(1) < 0.6)
    diagnosed = ~outside & ~ambiguous
    ev = PhotoEvaluation.from_dict(json.loads((tmp_path / "e.json").read_text()))
    assert ev.summary["n"] == len(files) == 15 and not ev.unreadable
    assert ev.summary["accuracy"] == pytest.approx(float((probs.argmax(1) == labels).mean()))
    assert (ev.out_of_domain, ev.ambiguous, ev.diagnosed) == (outside.sum(), ambiguous.sum(), diagnosed.sum())
    assert outside[[f.name for f in files].index("grey.png")]  # precondition: the grey photo is out of domain
    assert ev.diagnosed_correct == int((probs.argmax(1) == labels)[diagnosed].sum()) and ev.diagnosed > 0
    assert ev.uncertain == ev.out_of_domain + ev.ambiguous
    assert ev.ambiguous > 0  # precondition: the photos cover every verdict
    assert sorted((Path(r.file).name, r.reason) for r in ev.refused) == [("dot.png", "too_small"),
                                                                         ("flat.png", "uniform")]
    assert f"verdicts: {ev.diagnosed} diagnosis ({ev.diagnosed_correct / ev.diagnosed:.1%} of them right), " \
           f"{ev.ambiguous} ambiguous, {ev.out_of_domain} out of domain" in out
    assert "2 photo(s) would be refused by the app's photo checks (1 too_small, 1 uniform)" in out


def test_a_version_1_evaluation_file_is_still_read():
    old = {"model": "m.onnx", "photos": "p", "provider": "CPU", "classes": CLASSES, "unreadable": [],
           "uncertain": 2, "summary": {"accuracy": 0.5}, "schema_version": 1}
    ev = PhotoEvaluation.from_dict(old)
    assert ev.uncertain == 2 and ev.refused == [] and ev.diagnosed == 0 and ev.schema_version == 2


def test_not_known_photos_are_counted_by_what_the_model_answers_them(tmp_path, capsys):
    """--not-known: photos of no class of the model; each counted once as out of domain, ambiguous, turned away
    by the app's checks or given a diagnosis (named), as the reference computes them; broken files apart."""
    from apps_helpers import ood_metadata, reference_ood, write_grey_noise

    weights = tiny_weights(3, seed=1)
    meta = leaflens_metadata(CLASSES, 16, **ood_metadata(-0.05, 32), **{"leaflens.uncertain_threshold": "0.6"})
    model = build_tiny_model(tmp_path / "ood.onnx", weights, 16, meta, ood=True)
    photos = _photos(tmp_path / "photos", per_class=2)
    other = tmp_path / "other" / "sub"
    other.mkdir(parents=True)
    for i, cls in enumerate(CLASSES * 2):  # photos the model may well take for its own
        (other / f"{cls}{i}.jpg").write_bytes(_jpeg(cls, 50 + i))
    write_grey_noise(other / "grey.png")
    Image.new("RGB", (1, 1), COLOURS["rust"]).save(other / "dot.png")
    Image.new("RGB", (90, 70), COLOURS["healthy"]).save(other / "flat.png")
    (other / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    code = main(["evaluate", str(photos), "--model", str(model), "--not-known", str(tmp_path / "other"),
                 "--json", str(tmp_path / "e.json")])
    out = capsys.readouterr().out
    assert code == 1  # a not-known photo could not be read: said by the exit code too
    nk = PhotoEvaluation.from_dict(json.loads((tmp_path / "e.json").read_text())).not_known
    answered = sorted(f for f in other.glob("*.*") if f.name not in ("dot.png", "flat.png", "broken.jpg"))
    small = np.clip(area_resize(np.stack([decode_image(f, 32, "crop") for f in answered]), 16), 0, 255)
    probs, ood = reference_probs(small, weights), reference_ood(small)
    outside = ood > -0.05
    ambiguous = ~outside & (probs.max(1) < 0.6)
    diagnosed = ~outside & ~ambiguous
    assert (nk["out_of_domain"], nk["ambiguous"], nk["diagnosis"], nk["refused"]) == (
        outside.sum(), ambiguous.sum(), diagnosed.sum(), 2)
    assert nk["n"] == len(answered) + 2 and [Path(u["file"]).name for u in nk["unreadable"]] == ["broken.jpg"]
    named = np.array(CLASSES)[probs.argmax(1)[diagnosed]]
    assert nk["diagnoses"] == {c: int((named == c).sum()) for c in set(named)}
    assert nk["diagnosed_share"] == pytest.approx(diagnosed.sum() / nk["n"])
    assert outside.any() and diagnosed.any()  # precondition: both kinds of answer are counted
    assert f"photos of no class of the model: {nk['n']} in" in out and "turned away before the model" in out
    assert "1 could not be read and is not counted: " in out and "broken.jpg" in out  # which one
    assert main(["evaluate", str(photos), "--model", str(model), "--not-known", str(tmp_path / "nowhere")]) == 2
    assert "--not-known" in capsys.readouterr().err
    # the model's own class folders as --not-known: every right answer would count as a wrong diagnosis
    assert main(["evaluate", str(photos), "--model", str(model), "--not-known", str(photos)]) == 0
    assert "holds folders named as the model's classes" in capsys.readouterr().err
    plain = build_tiny_model(tmp_path / "plain.onnx", weights, 16, leaflens_metadata(CLASSES, 16))
    assert main(["evaluate", str(photos), "--model", str(plain), "--not-known", str(tmp_path / "other")]) == 1
    assert "plain.onnx has no out-of-domain check, so none of these photos can be called" in capsys.readouterr().err
