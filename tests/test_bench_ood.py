"""benchmarks/ood.py: its metrics (AUROC, flagged share, the logit and distance scores), the generators of
its photo sets (blanks, MNIST digits, generated negatives) and the reuse of sets and pipeline stages, on
tiny inputs; the benchmark itself needs real photos and a trained model."""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path

import numpy as np
import pytest
from bench_helpers import load_benchmark
from PIL import Image


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("ood.py")


# ---- metrics
def test_auroc_separable_reversed_identical(bench):
    in_dom, ood = [0.1, 0.2, 0.3], [0.5, 0.9]
    assert bench.auroc(in_dom, ood) == 1.0  # every out-of-domain photo scores above every in-domain one
    assert bench.auroc(ood, in_dom) == 0.0
    assert bench.auroc([0.4, 0.4, 0.4], [0.4, 0.4]) == 0.5  # identical scores: chance
    assert bench.auroc([1.0, 2.0], [2.0, 3.0]) == pytest.approx(0.875)  # one tie of four pairs counts half
    assert np.isnan(bench.auroc([], [1.0])) and np.isnan(bench.auroc([1.0], []))
    with pytest.raises(ValueError, match="finite"):
        bench.auroc([np.nan, 1.0], [2.0])


def test_auroc_matches_pairwise_count(bench):
    rng = np.random.default_rng(0)
    pos, neg = rng.integers(0, 6, 40).astype(float), rng.integers(2, 9, 30).astype(float)  # many ties
    pairs = (neg[None, :] > pos[:, None]).mean() + 0.5 * (neg[None, :] == pos[:, None]).mean()
    assert bench.auroc(pos, neg) == pytest.approx(pairs)


def test_flagged_share_counts_everything_without_a_class(bench):
    verdicts = ["diagnosis", "ambiguous", "out_of_domain", "refused"]
    assert bench.flagged_share(verdicts) == 0.5
    assert bench.flagged_share(["error", "diagnosis"]) == 0.5  # an unreadable file got no class either
    assert bench.flagged_share(["diagnosis"] * 3) == 0.0
    assert np.isnan(bench.flagged_share([]))


def test_logit_scores_rank_flat_logits_as_less_in_domain(bench):
    logits = np.array([[8.0, 0.0, 0.0], [0.1, 0.0, 0.0]])
    msp, energy = bench.softmax_score(logits), bench.energy_score(logits)
    assert msp[1] > msp[0] and energy[1] > energy[0]
    assert msp[0] == pytest.approx(-np.exp(8) / (np.exp(8) + 2))
    assert energy[0] == pytest.approx(-np.log(np.exp(8) + 2))
    assert np.isfinite(bench.energy_score(np.array([[1000.0, -1000.0]]))).all()  # no overflow


def test_distance_scores_grow_away_from_the_training_photos(bench):
    rng = np.random.default_rng(1)
    train = np.concatenate([rng.normal(0, 1, (50, 4)), rng.normal(6, 1, (50, 4))])
    labels = np.repeat([0, 1], 50)
    near, far = np.array([[0.1, 0.0, -0.1, 0.2], [6.0, 6.1, 5.9, 6.0]]), np.array([[20.0, -20.0, 20.0, -20.0]])
    means, precision = bench.fit_mahalanobis(train, labels, 1e-3)
    assert means.shape == (2, 4)
    assert bench.mahalanobis_score(far, means, precision)[0] > bench.mahalanobis_score(near, means, precision).max()
    knn = bench.knn_score(np.concatenate([near, far]), train, k=5)
    assert knn[2] > knn[:2].max()


# ---- photo sets
def test_blanks_are_seeded_png_files_of_each_kind(bench, tmp_path):
    paths = bench.write_blanks(tmp_path / "a", n=10, size=32, seed=3)
    assert len(paths) == 10 and all(p.suffix == ".png" for p in paths)
    assert sorted(p.name.split("_0")[0] for p in paths[:5]) == sorted(bench.BLANK_KINDS)
    again = bench.write_blanks(tmp_path / "b", n=10, size=32, seed=3)
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]
    solid = np.asarray(Image.open(paths[0]))
    noise = np.asarray(Image.open(paths[1]))
    assert solid.shape == (32, 32, 3) and solid.dtype == np.uint8
    assert solid.reshape(-1, 3).std(0).max() == 0 and noise.std() > 30
    with pytest.raises(ValueError, match="kind"):
        bench.blank_image(5, np.random.default_rng(0), 8)


def _idx_file(path: Path, images: np.ndarray) -> Path:
    header = bytes([0, 0, 8, images.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in images.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + images.astype(np.uint8).tobytes())
    return path


def test_digits_are_a_seeded_choice_grey_to_rgb(bench, tmp_path):
    digits = np.arange(20)[:, None, None] * 10 + np.zeros((20, 28, 28), int)  # digit i is flat grey 10*i
    idx = _idx_file(tmp_path / "t10k-images-idx3-ubyte.gz", digits)
    assert bench.mnist_test_images(tmp_path) == idx
    paths = bench.write_digits(idx, tmp_path / "d", n=5, size=32, seed=0)
    again = bench.write_digits(idx, tmp_path / "e", n=5, size=32, seed=0)
    assert [p.name for p in paths] == [p.name for p in again] and len(paths) == 5
    for p in paths:
        img = np.asarray(Image.open(p))
        i = int(p.stem.split("_")[1])
        assert img.shape == (32, 32, 3) and (img == 10 * i).all()  # the digit's own pixels, in all 3 channels
    assert bench.mnist_test_images(tmp_path / "d") is None


def test_read_idx_refuses_a_truncated_file(bench, tmp_path):
    idx = _idx_file(tmp_path / "x.gz", np.zeros((3, 4, 4), np.uint8))
    with gzip.open(idx) as f:
        raw = f.read()
    with gzip.open(idx, "wb") as f:
        f.write(raw[:-5])
    with pytest.raises(ValueError, match="truncated"):
        bench.read_idx(idx)


def test_generated_negatives_are_seeded_stored_size_images(bench):
    train = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    gen = bench.generated_negatives(train, 12, np.random.default_rng(5))
    assert gen.shape == (12, 32, 32, 3) and gen.dtype == np.uint8
    assert np.array_equal(gen, bench.generated_negatives(train, 12, np.random.default_rng(5)))
    assert not any(np.array_equal(g, t) for g in gen for t in train)  # none is a training photo as it was


def test_cached_set_is_reused_only_for_the_same_params(bench, tmp_path):
    calls = []

    def make(out: Path) -> None:
        calls.append(out)
        bench.write_blanks(out, n=2, size=16)

    target = tmp_path / "blank"
    first = bench.cached_set(target, {"n": 2}, make)
    assert [p.name for p in first] == sorted(p.name for p in target.glob("*.png")) and len(calls) == 1
    bench.cached_set(target, {"n": 2}, make)
    assert len(calls) == 1
    bench.cached_set(target, {"n": 2, "seed": 9}, make)
    assert len(calls) == 2 and len(list(target.glob("*.png"))) == 2


def fake_stage_runs(bench, monkeypatch, marker):
    """The `leaflens` commands stage() runs, recorded instead of run; each writes ``marker``."""
    ran = []

    def fake_leaflens(*args: str, script: str = "ood.py") -> None:
        ran.append(args)
        marker.parent.mkdir(exist_ok=True)
        marker.write_text("{}")

    monkeypatch.setattr(bench, "leaflens", fake_leaflens)
    return ran


def test_stage_reruns_only_when_its_command_or_inputs_change(bench, tmp_path, monkeypatch):
    marker, src = tmp_path / "out" / "done.json", tmp_path / "input.txt"
    src.write_text("a")
    ran = fake_stage_runs(bench, monkeypatch, marker)
    bench.stage(tmp_path, "teacher", marker, ["teacher", "--out", "x"], [src], ["--quiet"])
    assert ran == [("teacher", "--out", "x", "--quiet")]
    bench.stage(tmp_path, "teacher", marker, ["teacher", "--out", "x"], [src], [])  # quiet flags: not the key
    assert len(ran) == 1
    src.write_text("b")
    bench.stage(tmp_path, "teacher", marker, ["teacher", "--out", "x"], [src], [])
    assert len(ran) == 2
    bench.stage(tmp_path, "teacher", marker, ["teacher", "--out", "y"], [src], [])
    assert len(ran) == 3
    marker.unlink()
    bench.stage(tmp_path, "teacher", marker, ["teacher", "--out", "y"], [src], [])
    assert len(ran) == 4


def test_a_failed_command_is_named_after_the_calling_script(bench, tmp_path, monkeypatch):
    """ood.py's own messages start "ood.py:"; insects.py, which runs its stages through these helpers, names
    itself."""
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 3))
    with pytest.raises(SystemExit) as exc:
        bench.leaflens("preprocess", "--src", "x")
    assert str(exc.value.code) == "ood.py: `leaflens preprocess --src x` failed (exit 3)"
    with pytest.raises(SystemExit) as exc:
        bench.stage(tmp_path, "teacher", tmp_path / "done.json", ["teacher"], [], [], script="insects.py")
    assert str(exc.value.code) == "insects.py: `leaflens teacher` failed (exit 3)"


def test_a_recipe_input_is_keyed_by_its_settings_not_its_text(bench, tmp_path, monkeypatch):
    """A comment or layout edit in a TOML recipe reuses the stage; a changed value runs it again."""
    marker, recipe = tmp_path / "out" / "done.json", tmp_path / "recipe.toml"
    recipe.write_text("[train]\nepochs = 60\nlr = 0.001\n")
    ran = fake_stage_runs(bench, monkeypatch, marker)
    bench.stage(tmp_path, "distill", marker, ["distill"], [recipe], [])
    recipe.write_text("# the recipe, explained\n[train]\nlr = 0.001   # moved\nepochs = 60\n")
    bench.stage(tmp_path, "distill", marker, ["distill"], [recipe], [])
    assert len(ran) == 1
    recipe.write_text("[train]\nepochs = 61\nlr = 0.001\n")
    bench.stage(tmp_path, "distill", marker, ["distill"], [recipe], [])
    assert len(ran) == 2


# ---- the generic branch's sweep and the latency comparison
def test_branch_maps_match_what_the_exported_branch_reads(bench):
    """The sweep scores a branch of N blocks on the maps GenericBranch reads: the stem (0), then block i
    (i + 1) for the stage ends among the first N blocks and for block N - 1."""
    ends = [0, 2, 4, 7, 10, 14, 15]  # EfficientNet-Lite0's stage ends
    assert bench._branch_maps(ends, 0) == []
    assert bench._branch_maps(ends, 1) == [0, 1]
    assert bench._branch_maps(ends, 5) == [0, 1, 3, 5]
    assert bench._branch_maps(ends, 6) == [0, 1, 3, 5, 6]
    assert bench._branch_maps(ends, 16) == [0, 1, 3, 5, 8, 11, 15, 16]


def test_latency_comparison_times_every_model(bench, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    from leaflens.engine import nn  # noqa: PLC0415
    from leaflens.engine.onnx_export import export_onnx, save_onnx  # noqa: PLC0415

    small = save_onnx(export_onnx(nn.Linear(4, 2, rng=np.random.default_rng(0)), (4,)), tmp_path / "a.onnx")
    two = nn.Sequential(nn.Linear(4, 64, rng=np.random.default_rng(1)), nn.Linear(64, 2, rng=np.random.default_rng(2)))
    big = save_onnx(export_onnx(two, (4,)), tmp_path / "b.onnx")
    monkeypatch.setattr(bench, "LATENCY_ROUNDS", 2)
    monkeypatch.setattr(bench, "LATENCY_SECONDS", 0.02)
    out = bench.compare_latency({"model": small, "other": big}, threads=1)
    assert set(out) == {"model", "other"}
    assert out["model"]["bytes"] == small.stat().st_size < out["other"]["bytes"] == big.stat().st_size
    assert all(v["b1_p50_ms"] > 0 and v["img_s_batch32"] > 0 and v["threads"] == 1 for v in out.values())
