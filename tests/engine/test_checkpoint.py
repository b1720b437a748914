"""Checkpoints: atomic, pickle-free, refusing foreign files, and resuming exactly after a kill -9."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from leaflens.engine import nn
from leaflens.engine.checkpoint import (
    CheckpointError,
    checkpoint_meta,
    load_checkpoint,
    read_checkpoint_arrays,
    save_checkpoint,
)
from leaflens.engine.optim import Adam

SCRIPT = Path(__file__).with_name("_resume_script.py")


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(out), "6", *extra], capture_output=True, text=True,
                          timeout=120)


def test_resume_after_kill_matches_an_uninterrupted_run(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    full.mkdir(), cut.mkdir()
    assert _run(full).returncode == 0
    killed = _run(cut, "--kill-after-epoch", "2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (cut / "checkpoint.npz").exists() and not (cut / "final.npz").exists()
    resumed = _run(cut, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = np.load(full / "final.npz"), np.load(cut / "final.npz")
    assert a.files == b.files
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _model():
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))


def test_checkpoint_round_trip_and_no_pickle(tmp_path):
    m = _model()
    opt = Adam(m.parameters(), lr=0.01)
    path = save_checkpoint(tmp_path / "c.npz", m, opt, epoch=3, step=30, extra={"best": 0.5})
    with np.load(path, allow_pickle=False) as data:  # loads without pickle
        assert "meta" in data.files
    m2 = _model()
    c = load_checkpoint(path, m2, Adam(m2.parameters(), lr=0.01))
    assert (c.epoch, c.step, c.extra) == (3, 30, {"best": 0.5})
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, m2.state_dict()[k])
    assert not list(tmp_path.glob(".*tmp*")), "temporary file left behind"


def test_checkpoint_from_another_model_is_refused_naming_the_file(tmp_path):
    path = save_checkpoint(tmp_path / "c.npz", _model())
    other = nn.Sequential(nn.Linear(4, 5))
    with pytest.raises(CheckpointError, match=r"c\.npz.*different model"):
        load_checkpoint(path, other)


def test_truncated_and_foreign_files_are_refused(tmp_path):
    path = save_checkpoint(tmp_path / "c.npz", _model())
    data = path.read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cut.npz"):
        load_checkpoint(tmp_path / "cut.npz", _model())
    np.savez(tmp_path / "plain.npz", a=np.zeros(2))
    with pytest.raises(CheckpointError, match="not a leaflens checkpoint"):
        load_checkpoint(tmp_path / "plain.npz", _model())
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.npz", _model())
    for bad, why in (("cut.npz", "cut.npz"), ("plain.npz", "not a leaflens checkpoint"), ("missing.npz", "does not")):
        with pytest.raises(CheckpointError, match=why):
            checkpoint_meta(tmp_path / bad)
    assert checkpoint_meta(path) == read_checkpoint_arrays(path)[0]


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    m = _model()
    path = save_checkpoint(tmp_path / "c.npz", m, epoch=1)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, m, epoch=2)
    monkeypatch.undo()
    assert load_checkpoint(path, _model()).epoch == 1
    assert not list(tmp_path.glob(".*tmp*"))


def test_named_generators_are_saved_and_restored_in_place(tmp_path):
    rng = np.random.default_rng(5)
    rng.random(7)  # somewhere in the middle of its stream
    path = save_checkpoint(tmp_path / "c.npz", _model(), generators={"model": rng})
    expected = rng.random(4)  # what the saved state draws next
    later = np.random.default_rng(99)
    load_checkpoint(path, _model(), generators={"model": later})
    np.testing.assert_array_equal(later.random(4), expected)
    with pytest.raises(CheckpointError, match=r"c\.npz.*no state for the random generator 'dropout'"):
        load_checkpoint(path, _model(), generators={"dropout": np.random.default_rng(0)})
    other = np.random.Generator(np.random.MT19937(0))  # a state of another kind of bit generator is refused
    with pytest.raises(CheckpointError, match="'model'.*PCG64"):
        load_checkpoint(path, _model(), generators={"model": other})


def test_a_checkpoint_from_before_named_generators_resumes_a_one_generator_run(tmp_path):
    """Older checkpoints kept the engine's single stream as "rng": a run drawing from one generator of
    its own (the student's) continues from it; a run with several cannot tell which is which."""
    rng = np.random.default_rng(5)
    rng.random(3)
    path = save_checkpoint(tmp_path / "new.npz", _model(), generators={"model": rng})
    expected = rng.random(4)
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays["meta"]))
    meta["rng"] = json.dumps(meta.pop("generators")["model"])  # the old layout: one JSON string
    arrays["meta"] = np.array(json.dumps(meta))
    old = tmp_path / "old.npz"
    np.savez(old, **arrays)
    later = np.random.default_rng(99)
    load_checkpoint(old, _model(), generators={"model": later})
    np.testing.assert_array_equal(later.random(4), expected)
    with pytest.raises(CheckpointError, match=r"old\.npz.*no state for the random generator"):
        load_checkpoint(old, _model(), generators={"batches": np.random.default_rng(0),
                                                   "dropout": np.random.default_rng(0)})


def test_a_failed_load_puts_back_the_weight_average_and_the_generators_too(tmp_path):
    """All or nothing: the model, optimiser and scheduler were put back after a failed load, but the weight
    average and the generators loaded before the failure kept the checkpoint's state."""
    from leaflens.engine import nn
    from leaflens.engine.optim import ModelEMA

    m = nn.Linear(3, 2, rng=np.random.default_rng(0))
    ema = ModelEMA(m, 0.9)
    m.weight.data[...] = 5.0
    ema.update(m)
    save_checkpoint(tmp_path / "ck.npz", m, ema=ema, generators={"a": np.random.default_rng(1)})
    m2 = nn.Linear(3, 2, rng=np.random.default_rng(7))
    ema2 = ModelEMA(m2, 0.9)
    ga, gb = np.random.default_rng(42), np.random.default_rng(43)
    shadow, state = ema2.shadow["weight"].copy(), ga.bit_generator.state
    with pytest.raises(CheckpointError, match="random generator 'b'"):
        load_checkpoint(tmp_path / "ck.npz", m2, ema=ema2, generators={"a": ga, "b": gb})
    np.testing.assert_array_equal(ema2.shadow["weight"], shadow)
    assert ema2.updates == 0 and ga.bit_generator.state == state
