"""Numerical faults in training: a poisoned batch is skipped and logged, repeated faults stop the run.

The poison is real data, not a patched loss: a teacher whose float16 feature file overflowed to
inf on chosen rows (what an fp16 teacher with large activations produces). Every batch holding
such a row has a non-finite loss; it must be skipped, logged in faults.jsonl with its row indices,
and training must go on. When every batch is poisoned, or the learning rate blows the weights up,
`leaflens distill` must stop with exit code 3, a message saying what to do, and no non-finite
checkpoint on disk; the saved state must resume once the cause is fixed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rel_helpers import class_folders

from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.engine.checkpoint import read_checkpoint_arrays
from leaflens.pipeline.cli import main as cli
from leaflens.pipeline.teachers.stage import ArrayEncoder, write_teacher

# the faults are induced on purpose: NumPy's overflow/invalid-value warnings are the expected symptoms
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SETS = ["--set", "train.epochs=3", "--set", "train.min_steps=0",
        "--set", "train.batch_size=4", "--set", "model.widths=[8, 16]",
        "--set", "train.warmup_epochs=0", "--set", "train.lr=0.01", "--set", "distill.compare_scratch=false",
        "--quiet"]
POISONED = (2, 17)


def _write_teacher(ds_dir: Path, out: Path, poison: str | tuple[int, ...] = ()) -> Path:
    """Class-prototype features (a good teacher), stored as float16; then ``poison`` rows of train (or "all")
    are overwritten with inf in the file. The teacher stage refuses to write such a file (since 2026-12-04 it
    checks what it stores), so the poison is put in afterwards: distill must still cope with a teacher folder
    made by an older version, or edited."""
    ds = load_dataset(ds_dir)
    rng = np.random.default_rng(0)
    protos = rng.standard_normal((ds.num_classes, 12))
    feats = {}
    for split in ds.splits:
        f = protos[np.asarray(ds[split].labels)] + 0.3 * rng.standard_normal((len(ds[split]), 12))
        feats[split] = f.astype(np.float32)
    write_teacher(out, ds, ArrayEncoder(feats, None, out, ds.image_size), dtype=np.float16, progress=False)
    stored = np.load(out / "features_train.npy", mmap_mode="r+")
    stored[slice(None) if poison == "all" else list(poison)] = np.inf
    stored.flush()
    del stored
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    src = class_folders(tmp / "photos", per_class=12)
    ds_dir = ingest(src, tmp / "ds", IngestOptions(size=16), workers=1, log=lambda *_: None).out
    return tmp, ds_dir


def _distill(ds_dir: Path, teacher: Path | None, out: Path, *extra: str) -> int:
    args = ["distill", "--dataset", str(ds_dir), "--out", str(out), *SETS, *extra]
    args += ["--teacher", str(teacher)] if teacher is not None else ["--no-teacher"]
    return cli(args)


def _finite_checkpoint(path: Path) -> bool:
    _, arrays = read_checkpoint_arrays(path)
    return all(np.isfinite(v).all() for k, v in arrays.items() if k.startswith("model/"))


def test_poisoned_batches_are_skipped_logged_and_training_continues(data, capsys):
    tmp, ds_dir = data
    teacher = _write_teacher(ds_dir, tmp / "teacher_poisoned", POISONED)
    assert not np.isfinite(np.load(teacher / "features_train.npy")[list(POISONED)]).any()
    out = tmp / "run_poisoned"
    loud = ["distill", "--dataset", str(ds_dir), "--out", str(out), "--teacher", str(teacher),
            *[a for a in SETS if a != "--quiet"]]  # the epoch lines on the console, as a person sees them
    assert cli(loud) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    faults = [json.loads(line) for line in (out / "distilled" / "faults.jsonl").read_text().splitlines()]
    assert faults, "no poisoned batch was detected"
    for f in faults:
        assert set(f["rows"]) & set(POISONED), f"a batch without poisoned rows was skipped: {f}"
        assert "non-finite" in f["error"] or "nan" in f["error"].lower()
    seen = set().union(*(set(f["rows"]) & set(POISONED) for f in faults))
    assert seen == set(POISONED), f"poisoned rows never caught: {set(POISONED) - seen}"
    metrics = [json.loads(line) for line in (out / "distilled" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3, "training did not run all its epochs"
    assert sum(m["skipped_steps"] for m in metrics) == len(faults)
    assert "batch(es) left out for non-finite values (their rows: " in err  # said, not only in faults.jsonl
    assert all(np.isfinite(m["train_loss"]) and m["skipped_steps"] <= 2 for m in metrics)
    steps_per_epoch = len(load_dataset(ds_dir)["train"]) // 4
    meta, _ = read_checkpoint_arrays(out / "distilled" / "last.npz")
    assert meta["step"] == 3 * steps_per_epoch - len(faults)  # skipped batches made no optimiser step
    assert _finite_checkpoint(out / "best.npz")


def test_every_batch_poisoned_stops_with_exit_3_and_resumes_after_the_fix(data, capsys):
    tmp, ds_dir = data
    teacher = _write_teacher(ds_dir, tmp / "teacher_all", "all")
    out = tmp / "run_all"
    code = _distill(ds_dir, teacher, out, "--set", "train.max_bad_steps=3")
    err = capsys.readouterr().err
    assert code == 3, err
    assert "3 consecutive non-finite" in err and "faults.jsonl" in err and "--resume" in err
    last = tmp / "run_all.partial" / "distilled" / "last.npz"
    assert last.exists() and _finite_checkpoint(last)  # bad data, sound weights: the state is kept
    assert not out.exists()
    faults = (tmp / "run_all.partial" / "distilled" / "faults.jsonl").read_text().splitlines()
    assert len(faults) == 3
    _write_teacher(ds_dir, teacher)  # the data is fixed
    assert _distill(ds_dir, teacher, out, "--set", "train.max_bad_steps=3", "--resume") == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["variants"]["distilled"]["epochs_run"] == 3 and _finite_checkpoint(out / "best.npz")


def test_divergence_stops_and_rewinds_to_a_state_a_lower_lr_resumes_from(data, capsys):
    """lr 1e8 blows the weights up on the first step (finite but enormous: a training loss of ~1e16 here),
    and the losses turn non-finite within the first epoch. Resuming from those weights diverges again at any
    learning rate (or not, by the luck of rounding), so the stop must rewind last.npz to the last sound state,
    here the initial one, and say so; then the advice, a lower train.lr and --resume, must work every time."""
    tmp, ds_dir = data
    out = tmp / "run_lr"
    # the m student: the pretrained default's initial state holds ImageNet's statistics, far from "small"
    code = _distill(ds_dir, None, out, "--set", "train.lr=1e8", "--family", "m")
    err = capsys.readouterr().err
    assert code == 3, err
    assert "non-finite" in err and "lower train.lr" in err and "--resume" in err
    assert "starts from the initial state (no epoch ended soundly before the faults began)" in err, err
    scratch = tmp / "run_lr.partial" / "scratch"
    for ckpt in scratch.glob("*.npz"):
        assert _finite_checkpoint(ckpt), f"{ckpt} holds non-finite weights"
    first_fault = json.loads((scratch / "faults.jsonl").read_text().splitlines()[0])
    assert first_fault["epoch"] == 0 and first_fault["batch"] > 0  # steps were taken before the faults began
    meta, arrays = read_checkpoint_arrays(scratch / "last.npz")
    assert meta["epoch"] == -1 and meta["step"] == 0 and meta["extra"]["train_state"]["history"] == []
    weights = [v for k, v in arrays.items() if k.startswith("model/") and v.dtype.kind == "f"]
    assert max(float(np.abs(w).max()) for w in weights) < 100, "last.npz holds the blown-up weights"
    assert not (scratch / "rewind.npz").exists()
    lowered = "train.lr=0.01"  # the suite's own lr, 1e-10 of the one that diverged
    assert _distill(ds_dir, None, out, "--set", lowered, "--family", "m", "--resume") == 0, capsys.readouterr().err
    metrics = [json.loads(line) for line in (out / "scratch" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(m["lr"] <= 0.01 and np.isfinite(m["val_loss"]) for m in metrics)
    assert _finite_checkpoint(out / "best.npz")


def test_resume_uses_the_configured_learning_rate(data, tmp_path):
    """The advice after a stop is 'lower train.lr, then --resume': the resumed epochs must use it."""
    from leaflens.pipeline.config import load_config
    from leaflens.pipeline.train_student import TrainData, train_run

    _, ds_dir = data
    ds = load_dataset(ds_dir)

    def cfg(lr: float, epochs: int):
        return load_config(None, [f"train.lr={lr}", f"train.epochs={epochs}", "train.min_steps=0",
                                                          "train.warmup_epochs=0", "train.batch_size=8",
                                                          "model.widths=[8]"])

    args = (TrainData(ds["train"].images, np.asarray(ds["train"].labels)), ds["val"].images,
            np.asarray(ds["val"].labels), ds.mean, ds.std, ds.num_classes, {})
    train_run(tmp_path / "r", cfg(0.05, 2), *args, progress=False)
    result = train_run(tmp_path / "r", cfg(0.001, 4), *args, resume=True, progress=False)
    lrs = [row["lr"] for row in result.history]
    assert lrs[0] > 0.01 and max(lrs[2:]) <= 0.001, lrs
