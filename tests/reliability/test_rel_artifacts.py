"""Corrupted artefacts are refused through the CLI, with the file named, before any work starts.

Each case damages one input the way it happens in practice (a copy cut short, a hand-edited
manifest, a checkpoint or features file from somewhere else, a file that is not an ONNX model)
and runs the stage that reads it through ``leaflens``'s own entry point: the exit code must be the
stage's error code, stderr must name the file, and the stage must not have written anything (no
output folder, no temporary or partial folder).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from rel_helpers import class_folders, tiny_model

from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.engine.checkpoint import read_checkpoint_arrays, save_checkpoint
from leaflens.pipeline.cli import main as cli
from leaflens.pipeline.config import load_config
from leaflens.pipeline.distill import run_distill
from leaflens.pipeline.models.student import StudentCNN
from leaflens.pipeline.teachers.stage import ArrayEncoder, write_teacher

TINY = ["train.epochs=1", "train.min_steps=0", "train.batch_size=8", "model.widths=[8]", "train.warmup_epochs=0"]


def _features(ds_dir: Path) -> dict[str, np.ndarray]:
    ds = load_dataset(ds_dir)
    rng = np.random.default_rng(0)
    protos = rng.standard_normal((ds.num_classes, 8))
    return {s: (protos[np.asarray(ds[s].labels)] + 0.2 * rng.standard_normal((len(ds[s]), 8))).astype(np.float32)
            for s in ds.splits}


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A dataset, a teacher tied to it and a one-epoch student run, all tiny, made in-process."""
    tmp = tmp_path_factory.mktemp("artefacts")
    ds_dir = ingest(class_folders(tmp / "photos", per_class=10), tmp / "ds", IngestOptions(size=16), workers=1,
                    log=lambda *_: None).out
    ds = load_dataset(ds_dir)
    write_teacher(tmp / "teacher", ds, ArrayEncoder(_features(ds_dir), None, tmp, ds.image_size), progress=False)
    cfg = load_config(None, TINY + ["distill.compare_scratch=false"])
    run_distill(ds_dir, tmp / "teacher", tmp / "student", cfg, progress=False)
    return tmp


def _refused(capsys, args: list[str], code: int, names: Path | str, *more: str) -> str:
    got = cli(args)
    err = capsys.readouterr().err
    assert got == code, f"exit {got}, expected {code}: {err}"
    assert str(names) in err, f"the message does not name {names}: {err}"
    for text in more:
        assert text in err, f"{text!r} not in: {err}"
    assert "Traceback" not in err
    return err


def _nothing_written(parent: Path, name: str) -> None:
    left = [p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")
            or p.name == f"{name}.partial"]
    assert left == [], f"the refused stage wrote {left}"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_truncated_npy_in_the_dataset(staged, tmp_path, capsys):
    ds = _copy(staged / "ds", tmp_path / "ds")
    victim = ds / "val_images.npy"
    victim.write_bytes(victim.read_bytes()[:-100])  # an interrupted copy
    _refused(capsys, ["teacher", "--dataset", str(ds), "--out", str(tmp_path / "t"), "--train-cnn", "--quiet"],
             1, victim, "truncated")
    _nothing_written(tmp_path, "t")
    _refused(capsys, ["distill", "--dataset", str(ds), "--teacher", str(staged / "teacher"), "--out",
                      str(tmp_path / "s"), "--quiet"], 1, victim, "truncated")
    _nothing_written(tmp_path, "s")
    _refused(capsys, ["export", "--run", str(staged / "student"), "--dataset", str(ds), "--out",
                      str(tmp_path / "e")], 1, victim, "truncated")
    _nothing_written(tmp_path, "e")


@pytest.mark.parametrize("edit", ["classes_reordered", "mean_changed", "count_changed"])
def test_edited_manifest(staged, tmp_path, capsys, edit):
    ds = _copy(staged / "ds", tmp_path / "ds")
    path = ds / "manifest.json"
    m = json.loads(path.read_text())
    if edit == "classes_reordered":  # every label would silently get another class's name
        m["classes"] = m["classes"][::-1]
    elif edit == "mean_changed":
        m["mean"] = [0.5, 0.5, 0.5]
    else:
        m["splits"]["val"]["count"] -= 1
    path.write_text(json.dumps(m, indent=2))
    _refused(capsys, ["teacher", "--dataset", str(ds), "--out", str(tmp_path / "t"), "--train-cnn", "--quiet"],
             1, path, "edited")
    _nothing_written(tmp_path, "t")
    _refused(capsys, ["distill", "--dataset", str(ds), "--no-teacher", "--out", str(tmp_path / "s"), "--quiet"],
             1, path, "edited")
    _nothing_written(tmp_path, "s")


def test_truncated_teacher_features(staged, tmp_path, capsys):
    teacher = _copy(staged / "teacher", tmp_path / "teacher")
    victim = teacher / "features_train.npy"
    victim.write_bytes(victim.read_bytes()[:-64])
    _refused(capsys, ["distill", "--dataset", str(staged / "ds"), "--teacher", str(teacher), "--out",
                      str(tmp_path / "s"), "--quiet"], 1, victim)
    _nothing_written(tmp_path, "s")


def test_features_of_another_dataset(staged, tmp_path, capsys):
    other = ingest(class_folders(tmp_path / "photos", per_class=11, seed=7), tmp_path / "other", IngestOptions(size=16),
                   workers=1, log=lambda *_: None).out
    _refused(capsys, ["distill", "--dataset", str(other), "--teacher", str(staged / "teacher"), "--out",
                      str(tmp_path / "s"), "--quiet"], 1, staged / "teacher", "another dataset")
    _nothing_written(tmp_path, "s")
    # a features folder computed elsewhere for the other dataset, imported for this one
    feats = tmp_path / "feats"
    feats.mkdir()
    for split, f in _features(other).items():
        np.save(feats / f"features_{split}.npy", f)
    _refused(capsys, ["teacher", "--dataset", str(staged / "ds"), "--features", str(feats), "--out",
                      str(tmp_path / "t"), "--quiet"], 1, feats, "rows")
    _nothing_written(tmp_path, "t")


def test_checkpoint_of_another_model(staged, tmp_path, capsys):
    meta, _ = read_checkpoint_arrays(staged / "student" / "best.npz")
    run = tmp_path / "run"
    run.mkdir()
    # weights of a wider student saved under this run's model_config (a best.npz copied over another)
    save_checkpoint(run / "best.npz", StudentCNN(3, widths=[16, 32]), extra=meta["extra"])
    _refused(capsys, ["export", "--run", str(run), "--dataset", str(staged / "ds"), "--out", str(tmp_path / "e")],
             1, run / "best.npz", "different model")
    _nothing_written(tmp_path, "e")
    # an engine checkpoint that is not a distilled student at all (e.g. the CNN teacher's)
    save_checkpoint(run / "best.npz", StudentCNN(3, widths=[8]), extra={"teacher": "train-cnn"})
    _refused(capsys, ["export", "--run", str(run), "--dataset", str(staged / "ds"), "--out", str(tmp_path / "e")],
             1, run / "best.npz", "model_config")
    # a truncated checkpoint
    data = (staged / "student" / "best.npz").read_bytes()
    (run / "best.npz").write_bytes(data[: len(data) // 2])
    _refused(capsys, ["export", "--run", str(run), "--dataset", str(staged / "ds"), "--out", str(tmp_path / "e")],
             1, run / "best.npz", "truncated")
    _nothing_written(tmp_path, "e")


def test_resume_from_a_checkpoint_of_another_model(staged, tmp_path, capsys):
    """--resume after changing the architecture: the partial run's last.npz is refused by name, unchanged."""
    out = tmp_path / "s"
    args = ["distill", "--dataset", str(staged / "ds"), "--no-teacher", "--out", str(out), "--quiet"]
    sets = [x for s in TINY for x in ("--set", s)]
    partial = tmp_path / "s.partial"
    cfg = load_config(None, TINY)
    run_distill(staged / "ds", None, out, cfg, no_teacher=True, progress=False)
    shutil.move(out, partial)  # as if killed after the training
    last = partial / "scratch" / "last.npz"
    before = last.read_bytes()
    _refused(capsys, args + sets + ["--set", "model.widths=[16]", "--resume"], 1, last, "different model")
    assert last.read_bytes() == before
    data = before[: len(before) // 3]
    last.write_bytes(data)
    _refused(capsys, args + sets + ["--resume"], 1, last, "truncated")


def test_onnx_file_that_is_not_a_model(staged, tmp_path, capsys):
    fake = tmp_path / "student.onnx"
    fake.write_text("this is not an ONNX model\n")
    photo_dir = staged / "photos" / "rust"
    _refused(capsys, ["predict", "--model", str(fake), str(photo_dir), "--no-progress"], 2, fake,
             "cannot load")
    _refused(capsys, ["teacher", "--dataset", str(staged / "ds"), "--onnx", str(fake), "--out",
                      str(tmp_path / "t"), "--quiet"], 1, fake)
    _nothing_written(tmp_path, "t")
    # a valid ONNX graph that is not a leaflens model (no model card in its metadata)
    import onnx

    plain = tmp_path / "plain.onnx"
    model = onnx.load(str(tiny_model(tmp_path / "tiny.onnx")))
    del model.metadata_props[:]
    onnx.save(model, str(plain))
    _refused(capsys, ["predict", "--model", str(plain), str(photo_dir), "--no-progress"], 2, plain,
             "not a leaflens model")
    if importlib.util.find_spec("gradio") is None:  # find_spec: importing gradio costs seconds
        pytest.skip("gradio is not installed (leaflens serve needs it)")
    _refused(capsys, ["serve", "--model", str(fake), "--no-examples", "--port", "7999"], 2, fake, "cannot load")
