"""Crash safety: `kill -9` of every stage at a random (seeded) moment, then the checks that matter.

For each of preprocess, teacher, distill and export: a first run writes the stage's output; a second
run that would replace it is started as a subprocess (`python -m leaflens.pipeline.cli ...`) and SIGKILLed
(its whole process group) at a moment drawn uniformly from the duration of an uninterrupted run;
then the previous output must be byte-identical and accepted by the stage's own loader (dataset
checksums verified, teacher tied to its dataset, checkpoint readable, ONNX loadable with the
checksums recorded in parity.json), the rerun must complete, and no temporary folder of the
killed run may be left behind after it. A killed distill resumed with --resume must reach exactly
the report metrics and best.npz arrays of an uninterrupted run with the same seed.

The default run kills preprocess only (a few seconds); the other stages are ``slow``.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from rel_helpers import class_folders, encode, kill9, photo, run_cli, start_cli, wait_for

from leaflens.data_prep.manifest import load_dataset

DISTILL_SETS = ["--set", "train.epochs=5", "--set", "train.min_steps=0",
                "--set", "train.batch_size=16", "--set", "model.widths=[8, 16]",
                "--set", "train.warmup_epochs=1", "--set", "train.lr=0.01", "--seed", "3"]


@dataclass
class Kill:
    seed: int
    delay_s: float
    # "before": nothing of the new output on disk yet; "writing": its temporary folder exists;
    # "replaced": the kill came after the swap, the new output is complete
    phase: str
    returncode: int | None  # -9 when the kill landed, 0 when the run had already exited


def _snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative path -> digest)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _temps(parent: Path, name: str) -> list[str]:
    """Temporary folders of a stage writing ``parent/name`` (distill's resumable one included)."""
    marks = (f".{name}.tmp-", f".{name}.old-", f".{name}.partial-")
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(marks) or p.name == f"{name}.partial")


def timed_run(*args: str) -> float:
    t0 = time.monotonic()
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    return time.monotonic() - t0


def kill_at_random_moment(args: list[str], seed: int, duration_s: float, parent: Path, name: str,
                          before: dict[str, str], after=None) -> Kill:
    """Start ``leaflens ARGS``, wait for ``after()`` (default: nothing), sleep a seeded uniform share of
    ``duration_s``, then SIGKILL the process group; classify the moment by what is on disk."""
    rng = random.Random(seed)
    delay = rng.uniform(0.0, duration_s)
    proc = start_cli(*args)
    if after is not None:
        assert wait_for(lambda: after() or proc.poll() is not None, 300), "stage never reached its marker"
    end = time.monotonic() + delay
    while time.monotonic() < end and proc.poll() is None:
        time.sleep(0.005)
    writing = bool(_temps(parent, name))
    rc = kill9(proc)
    out = parent / name
    assert out.is_dir(), f"{out} is gone after a kill at {delay:.3f} s"
    replaced = _snapshot(out) != before
    return Kill(seed, round(delay, 3), "replaced" if replaced else "writing" if writing else "before", rc)


# ---------------------------------------------------------------------------- preprocess (default run)
def test_preprocess_killed_at_random_moments_keeps_previous_dataset(tmp_path):
    src = class_folders(tmp_path / "photos", per_class=150, w=64, h=64)
    out = tmp_path / "ds"
    args = ["preprocess", "--src", str(src), "--out", str(out), "--size", "32", "--workers", "1", "--no-progress"]
    t_full = timed_run(*args)
    before = _snapshot(out)
    load_dataset(out, verify=True)
    (src / "rust" / "added.jpg").write_bytes(encode(photo(99_999, (200, 120, 30), 64, 64), "JPEG"))
    saved = tmp_path / "previous"
    shutil.copytree(out, saved)
    kills = []
    writing_started = lambda: bool(_temps(tmp_path, "ds"))  # noqa: E731
    # Up to 8 kills at random moments, until one lands while the new dataset is being written; the writing
    # window is a small share of the run and moves with the machine's load, so the last try waits for the
    # stage's temporary folder and kills at once: one kill inside the window, whatever the timing.
    for seed in range(9):
        if seed < 8:
            k = kill_at_random_moment(args, seed, t_full, tmp_path, "ds", before)
        else:
            k = kill_at_random_moment(args, seed, 0.0, tmp_path, "ds", before, after=writing_started)
        kills.append(k)
        ds = load_dataset(out, verify=True)  # old or new, never a mix: every checksum matches
        if k.phase == "replaced":  # the kill came after the swap: the new dataset is complete; put the old back
            assert sum(len(ds[s]) for s in ds.splits) == 451
            shutil.rmtree(out)
            shutil.copytree(saved, out)
            continue
        assert k.returncode == -9 and sum(len(ds[s]) for s in ds.splits) == 450
        if k.phase == "writing":
            break
    print("kills:", kills)
    assert any(k.phase == "writing" for k in kills), f"no kill landed while the stage was writing: {kills}"
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    ds = load_dataset(out, verify=True)
    assert sum(len(ds[s]) for s in ds.splits) == 451  # the added photo is in
    assert _temps(tmp_path, "ds") == [], "the killed run's temporary folder was not cleaned up"


# ---------------------------------------------------------------------------- teacher, distill, export (slow)
@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A dataset, teacher, student run and export made by the CLI, with each stage's duration."""
    tmp = tmp_path_factory.mktemp("killed")
    src = class_folders(tmp / "photos", per_class=30)
    times = {}
    times["preprocess"] = timed_run("preprocess", "--src", str(src), "--out", str(tmp / "ds"), "--size", "16",
                                    "--workers", "1", "--no-progress")
    times["teacher"] = timed_run("teacher", "--dataset", str(tmp / "ds"), "--out", str(tmp / "teacher"),
                                 "--train-cnn", "--epochs", "3", "--quiet")
    times["distill"] = timed_run("distill", "--dataset", str(tmp / "ds"), "--teacher", str(tmp / "teacher"),
                                 "--out", str(tmp / "student"), *DISTILL_SETS, "--quiet")
    times["export"] = timed_run(*export_args(tmp))
    return tmp, times


def export_args(tmp: Path) -> list[str]:
    return ["export", "--run", str(tmp / "student"), "--dataset", str(tmp / "ds"), "--out", str(tmp / "export"),
            "--speed-seconds", "0.05", "--calib-images", "32"]


@pytest.mark.slow
@pytest.mark.parametrize("seed,while_writing", [(11, False), (12, False), (13, True), (14, True)])
def test_teacher_killed_keeps_previous_teacher(staged, seed, while_writing):
    """Killed anywhere in the run, or (``while_writing``) within 0.3 s of its features folder appearing."""
    from leaflens.pipeline.teachers.artefact import load_teacher

    tmp, times = staged
    ds = load_dataset(tmp / "ds")
    before = _snapshot(tmp / "teacher")
    args = ["teacher", "--dataset", str(tmp / "ds"), "--out", str(tmp / "teacher"), "--train-cnn", "--epochs", "3",
            "--quiet"]

    def writing() -> bool:
        return bool(list(tmp.glob(".teacher.partial-*")))

    k = kill_at_random_moment(args, seed, 0.3 if while_writing else times["teacher"], tmp, "teacher", before,
                              after=writing if while_writing else None)
    print("kill:", k)
    load_teacher(tmp / "teacher", ds)  # the previous teacher, or (killed after its swap) the complete new one
    if k.phase == "replaced":
        assert set(_snapshot(tmp / "teacher")) == set(before)
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    tt = load_teacher(tmp / "teacher", ds)
    assert tt.has_logits and tt.features["train"].shape[0] == len(ds["train"])
    assert [t for t in _temps(tmp, "teacher") if ".partial" in t] == [], "killed run's partial folder left behind"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [21, 22, 23])
def test_export_killed_keeps_previous_export(staged, seed):
    from leaflens.apps.predictor import Predictor

    tmp, times = staged
    before = _snapshot(tmp / "export")
    k = kill_at_random_moment(export_args(tmp), seed, times["export"], tmp, "export", before)
    print("kill:", k)
    _check_export(tmp / "export")  # the previous export, or (killed after its swap) the complete new one
    if k.phase == "replaced":
        assert set(_snapshot(tmp / "export")) == set(before)
    res = run_cli(*export_args(tmp))
    assert res.returncode == 0, res.stderr[-3000:]
    _check_export(tmp / "export")
    Predictor(tmp / "export" / "student.onnx", intra_op_threads=1)
    assert _temps(tmp, "export") == [], "killed run's temporary folder left behind"
    assert not list((tmp / "export" / "triton").glob(".*")), "temporary Triton folder left behind"


def _check_export(folder: Path) -> None:
    report = json.loads((folder / "parity.json").read_text())
    assert report["passed"]
    for facts in report["files"].values():
        data = (folder / facts["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == facts["sha256"], facts["file"]
    from leaflens.pipeline.export.triton import check_model_dir

    check_model_dir(folder / "triton" / "leaflens_student")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [31, 32])
def test_distill_killed_keeps_previous_run_and_resumes_to_the_same_result(staged, seed):
    from leaflens.engine.checkpoint import read_checkpoint_arrays
    from leaflens.pipeline.runs import load_model

    tmp, times = staged
    out = tmp / "student"
    reference = tmp / f"student_reference_{seed}"
    shutil.copytree(out, reference)  # the uninterrupted run, same config and seed
    before = _snapshot(out)
    args = ["distill", "--dataset", str(tmp / "ds"), "--teacher", str(tmp / "teacher"), "--out", str(out),
            *DISTILL_SETS, "--quiet"]
    first_ckpt = tmp / "student.partial" / "distilled" / "last.npz"
    # a random moment after the first epoch's checkpoint, so that --resume has something to resume
    k = kill_at_random_moment(args, seed, times["distill"] * 0.6, tmp, "student", before, after=first_ckpt.exists)
    print("kill:", k)
    load_model(out)  # the previous run, or (killed after its swap) the complete new one
    if k.phase != "replaced":
        assert _snapshot(out) == before and (tmp / "student.partial").is_dir()
    res = run_cli(*args, "--resume")
    if k.phase == "replaced":  # the run had finished: nothing to continue, and --resume leaves the run as it is
        assert res.returncode == 2 and "is a finished run" in res.stderr, res.stderr[-3000:]
    else:
        assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp / "student.partial").exists()
    a = json.loads((reference / "report.json").read_text())
    b = json.loads((out / "report.json").read_text())
    for key in ("winner", "val_accuracy", "test_accuracy", "uncertain_threshold", "params"):
        assert a[key] == b[key], key
    for name in a["variants"]:
        for key in ("val_accuracy", "best_epoch", "epochs_run", "test_accuracy"):
            assert a["variants"][name][key] == b["variants"][name][key], (name, key)
    for key in ("n", "correct", "accuracy", "confusion_matrix", "macro_f1", "ece", "per_class"):
        assert a["test"][key] == b["test"][key], ("test", key)
    for path in ("best.npz", "distilled/best.npz", "scratch/best.npz"):
        _, x = read_checkpoint_arrays(reference / path)
        _, y = read_checkpoint_arrays(out / path)
        assert x.keys() == y.keys(), path
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"{path}:{key}")
    for variant in a["variants"]:
        ra = (reference / variant / "metrics.jsonl").read_text().splitlines()
        rb = (out / variant / "metrics.jsonl").read_text().splitlines()
        assert len(ra) == len(rb), variant
        for la, lb in zip(ra, rb):
            ja, jb = json.loads(la), json.loads(lb)
            for key in ("val_acc", "val_loss", "train_loss", "skipped_steps"):
                assert ja.get(key) == jb.get(key), (variant, key)
