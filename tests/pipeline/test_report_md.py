"""report.md carries the key figures of report.json; leaflens.pipeline.hardware describes the machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from leaflens.pipeline import hardware
from leaflens.pipeline.report import markdown as report_md
from leaflens.pipeline.report import metrics

CLASSES = ["angular_leaf_spot", "bean_rust", "healthy"]


def summary() -> dict[str, Any]:
    y = np.repeat([0, 1, 2], 40)
    pred = y.copy()
    pred[[0, 1, 2]] = 1  # three angular_leaf_spot images called bean_rust
    pred[[50]] = 2
    probs = np.full((120, 3), 0.05)
    probs[np.arange(120), pred] = 0.9
    return metrics.evaluation_summary(probs, y, CLASSES)


def report(**over: Any) -> dict[str, Any]:
    base = {
        "run_id": "run-7",
        "kept": "distilled",
        "candidates": {"distilled": {"val_accuracy": 0.962, "test_accuracy": 0.953},
                       "scratch": {"val_accuracy": 0.947, "test_accuracy": 0.945}},
        "val_accuracy": 0.962, "test_accuracy": 116 / 120, "params": 391234, "train_seconds": 754.2,
        "test": summary(),
        "uncertain": {"threshold": 0.61, "coverage": 0.9, "accuracy": 0.97, "kept": 90, "n_val": 100,
                      "target": 0.95, "reached": True, "method": "target"},
        "hardware": {"summary": "trained on CPU AMD EPYC (2 cores); no GPU"}, "leaflens_version": "0.1.0",
        "epochs": 60, "best_epoch": 47,
    }
    base.update(over)
    return base


def test_report_contains_the_key_figures(tmp_path: Path) -> None:
    (tmp_path / "curves.png").write_bytes(b"png")
    (tmp_path / "confusion.png").write_bytes(b"png")
    path = report_md.write_report(tmp_path, report())
    assert path == tmp_path / "report.md"
    text = path.read_text(encoding="utf-8")
    assert "distilled student is kept" in text and "+1.5 points" in text
    assert report_md.NO_GAIN not in text
    acc, lo, hi = metrics.accuracy_ci(116, 120)
    assert f"{100 * acc:.1f} %" in text and f"{100 * lo:.1f} % to {100 * hi:.1f} %" in text
    assert "| angular_leaf_spot | 1.000 | 0.925 | 0.961 | 40 |" in text  # per-class P/R/F1/support
    assert "| angular_leaf_spot | 37 | 3 | 0 |" in text  # confusion row
    assert "391,234" in text and "12 min 34 s" in text and "AMD EPYC" in text and "Software: leaflens 0.1.0" in text
    assert "[Training curves](curves.png)" in text and "![Confusion matrix (test)](confusion.png)" in text
    assert "Not produced in this run: hardest.png, feature_maps.png." in text
    assert "0.610" in text  # the uncertain threshold
    assert not list(tmp_path.glob(".*tmp"))


def test_report_says_plainly_when_distillation_did_not_help(tmp_path: Path) -> None:
    rep = report(kept="scratch",
                 candidates={"distilled": {"val_accuracy": 0.93}, "scratch": {"val_accuracy": 0.95}})
    text = report_md.write_report(tmp_path, rep).read_text(encoding="utf-8")
    assert report_md.NO_GAIN in text and "-2.0 points" in text
    assert "scratch (kept)" in text


def test_report_without_a_comparison_or_figures_does_not_invent_them(tmp_path: Path) -> None:
    rep = {"kept": "scratch", "candidates": {"scratch": {"val_accuracy": 0.9}}, "test_accuracy": 0.88}
    text = report_md.write_report(tmp_path, rep).read_text(encoding="utf-8")
    assert "gain from distillation was not measured" in text
    assert "88.0 %" in text and "no confidence interval recorded" in text
    assert "Parameters (inference model): not recorded" in text and "Hardware: not recorded" in text
    assert "Software:" not in text  # a run recorded before the version was
    assert report_md.NO_GAIN not in text


def test_report_numbers_columns_of_wide_confusion_tables_and_escapes_pipes(tmp_path: Path) -> None:
    classes = [f"class|{i}" for i in range(12)]
    y = np.arange(12).repeat(3)
    probs = np.full((36, 12), 0.01)
    probs[np.arange(36), y] = 0.89
    rep = report(test=metrics.evaluation_summary(probs, y, classes))
    text = report_md.write_report(tmp_path, rep).read_text(encoding="utf-8")
    assert "| true \\ predicted | 0 | 1 | 2 |" in text
    assert "| 11. class\\|11 |" in text


def test_report_needs_an_existing_run_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        report_md.write_report(tmp_path / "missing", report())


# ---- hardware -------------------------------------------------------------------------------------------
def test_describe_hardware_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from leaflens.kernels import _cuda

    monkeypatch.setattr(_cuda, "gpu_probe", lambda refresh=False: (False, "no CUDA here"))
    facts = hardware.describe_hardware(device="cpu")
    assert facts["cpu_cores"] >= 1 and facts["usable_cores"] >= 1
    assert facts["gpu"] is None and facts["gpu_reason"] == "no CUDA here"
    assert facts["summary"].startswith("trained on CPU") and f"{facts['cpu_cores']} cores" in facts["summary"]


def test_describe_hardware_names_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from leaflens.kernels import _cuda

    class FakeRuntime:
        @staticmethod
        def getDeviceProperties(i: int) -> dict[str, Any]:
            return {"name": b"NVIDIA Test GPU", "totalGlobalMem": 24 * 2**30}

    class FakeCuda:
        runtime = FakeRuntime

        class Device:
            id = 0

    class FakeCupy:
        cuda = FakeCuda

    monkeypatch.setattr(_cuda, "gpu_probe", lambda refresh=False: (True, "1 CUDA device(s)"))
    monkeypatch.setattr(_cuda, "cupy_module", lambda: FakeCupy)
    facts = hardware.describe_hardware(device="cuda")
    assert facts["gpu"] == "NVIDIA Test GPU" and facts["gpu_memory_gib"] == 24.0
    assert facts["summary"].startswith("trained on GPU NVIDIA Test GPU, 24.0 GiB")
    assert "(not used)" in hardware.describe_hardware(device="cpu")["summary"]


def test_report_reads_the_distill_stage_schema(tmp_path: Path) -> None:
    """leaflens.pipeline.distill's report.json spells the keys winner/variants/threshold_choice."""
    rep = {
        "winner": "scratch", "val_accuracy": 0.95, "test_accuracy": 116 / 120, "params": 12345,
        "train_seconds": 42.0, "uncertain_threshold": 0.7,
        "threshold_choice": {"threshold": 0.7, "coverage": 0.8, "accuracy": 0.99, "target": 0.95,
                             "method": "target"},
        "variants": {
            "distilled": {"val_accuracy": 0.95, "best_epoch": 9, "epochs_run": 12, "test_accuracy": 0.9},
            "scratch": {"val_accuracy": 0.95, "best_epoch": 7, "epochs_run": 10, "test_accuracy": 0.92},
        },
        "test": summary(),
        "teacher": {"kind": "efficientnet-lite0", "weights": "/x/y/efficientnet-lite0-57934424.pth",
                    "fine_tuned": True},
    }
    text = report_md.write_report(tmp_path, rep).read_text(encoding="utf-8")
    assert report_md.NO_GAIN in text and "+0.0 points" in text  # a tie keeps scratch
    assert "Epochs (scratch student): 10, best on validation at epoch 7" in text
    assert "0.700" in text and "80.0 %" in text
    assert "efficientnet-lite0-57934424.pth" in text and "/x/y/" not in text
    partial = tmp_path / "student.partial"  # the distill stage writes into "<out>.partial" first
    partial.mkdir()
    assert report_md.write_report(partial, rep).read_text(encoding="utf-8").startswith(
        "# leaflens run report: student\n")


def test_report_says_how_many_unlabelled_photos_the_distilled_student_learned_from(tmp_path: Path) -> None:
    counts = {"train": 600, "unlabeled": 1200, "val": 180, "test": 180}
    text = report_md.render_report(tmp_path, report(dataset={"counts": counts}))
    assert "The distilled student learned from 600 labelled and 1,200 unlabelled photos" in text
    assert "the scratch student from the 600 labelled ones only" in text
    text = report_md.render_report(tmp_path, report(dataset={"counts": {"train": 600, "val": 180, "test": 180}}))
    assert "same 600 labelled training photos; there were no unlabelled photos" in text
    assert "learned from" not in report_md.render_report(tmp_path, report())  # not recorded: nothing invented
    text = report_md.render_report(tmp_path, report(dataset={"counts": counts}, teacher_has_logits=False))
    assert "(the teacher's features only: it gives no answers to stand in for the withheld labels)" in text
    also = {"folders": ["/srv/corrections"], "counts": {"train": 5, "val": 1, "test": 2}}
    for ds in ({"counts": counts, "also": also}, {"also": also}):  # said whichever students were trained
        text = report_md.render_report(tmp_path, report(dataset=ds, candidates={}))
        assert "Photos from `preprocess --also` (/srv/corrections: the web app's corrections" in text
        assert "5 train, 1 val, 2 test" in text


def test_report_says_what_the_out_of_domain_score_reads(tmp_path: Path) -> None:
    check = {"fitted": True, "method": "block-mahalanobis-2", "threshold": 19.12, "budget": 0.025,
             "val_photos": 133, "val_flagged": 0.0226, "train_photos": 1034, "blocks": 8,
             "branch": {"kind": "efficientnet-lite0-imagenet", "blocks": 5, "maps": 4, "params": 55504,
                        "weights": "efficientnet-lite0-57934424.pth"}}
    line = next(x for x in report_md.render_report(tmp_path, report(out_of_domain=check)).splitlines()
                if x.startswith("- Out-of-domain check"))
    assert "(block-mahalanobis-2)" in line and "19.120" in line and "1034 training photos" in line
    assert "first 5 blocks of ImageNet EfficientNet-Lite0 (frozen, 55504 parameters" in line
    # without the branch's weights: the model's own blocks, and the reason
    own = {**{k: v for k, v in check.items() if k != "branch"}, "method": "block-mahalanobis-1",
           "note": "the out-of-domain score reads the model's own blocks only (block-mahalanobis-1): ..."}
    text = report_md.render_report(tmp_path, report(out_of_domain=own))
    assert "EfficientNet" not in text and "- Note: the out-of-domain score reads the model's own blocks only" in text
    # a run from before the confidence was recorded: the budget was the validation photos' own share
    assert "chosen on the 133 validation photos to flag at most 2.5 % of them, and flags 2.3 %" in text


def test_report_says_what_the_threshold_promises_new_photos(tmp_path: Path) -> None:
    check = {"fitted": True, "method": "block-mahalanobis-1", "threshold": 21.7, "budget": 0.03, "confidence": 0.9,
             "val_photos": 133, "val_flagged": 1 / 133, "train_photos": 1034, "blocks": 16}
    text = report_md.render_report(tmp_path, report(out_of_domain=check))
    assert ("so that at most 3.0 % of genuine new photos are flagged, with 91.1 % confidence (it flags 0.8 % of the "
            "validation photos)") in text


def test_report_shows_each_students_accuracy_at_every_centre_crop_and_the_one_kept(tmp_path: Path) -> None:
    cands = {"distilled": {"val_accuracy": 0.79, "test_accuracy": 0.807, "centre_crop": 0.75,
                           "val_by_crop": {"1": 0.757, "0.875": 0.77, "0.75": 0.79}, "test_accuracy_whole": 0.746,
                           "crop_choice": {"share": 0.75, "why": "the centre 0.75 gained 9 and lost 3"}},
             "scratch": {"val_accuracy": 0.652, "test_accuracy": 0.652, "centre_crop": None,
                         "val_by_crop": {"1": 0.652, "0.875": 0.64, "0.75": 0.63}, "test_accuracy_whole": 0.652}}
    text = report_md.render_report(tmp_path, report(candidates=cands))
    assert "## Centre crop" in text and "significantly more validation photos" in text
    assert "| student | val at 1 | val at 0.875 | val at 0.75 | kept | test: whole -> kept | why |" in text
    assert ("| distilled | 75.7 % | 77.0 % | 79.0 % | centre 0.75 | 74.6 % -> 80.7 % | the centre 0.75 gained 9 "
            "and lost 3 |") in text
    assert "| scratch | 65.2 % | 64.0 % | 63.0 % | whole photo | 65.2 % -> 65.2 % |  |" in text
    # runs from before the crop (or with distill.centre_crops = []) have no such section
    assert "## Centre crop" not in report_md.render_report(tmp_path, report())
    only_whole = {k: {**v, "val_by_crop": {"1": v["val_accuracy"]}} for k, v in cands.items()}
    assert "## Centre crop" not in report_md.render_report(tmp_path, report(candidates=only_whole))


def test_report_names_the_students_whose_batchnorm_statistics_were_kept(tmp_path: Path) -> None:
    text = report_md.render_report(tmp_path, report(freeze_bn=["distilled", "scratch"]))
    assert ("- BatchNorm statistics (train.freeze_bn): distilled, scratch kept their stem's and blocks' pretrained "
            "statistics while training") in text
    assert "no student is pretrained" in report_md.render_report(tmp_path, report(freeze_bn=[]))
    assert "train.freeze_bn" not in report_md.render_report(tmp_path, report())  # off: nothing said


def test_report_says_when_the_students_weights_are_a_running_average(tmp_path: Path) -> None:
    assert ("- Weights (train.ema = 0.99): each student was validated, chosen and kept as a running average of its "
            "training steps' weights") in report_md.render_report(tmp_path, report(config={"train": {"ema": 0.99}}))
    assert "train.ema" not in report_md.render_report(tmp_path, report())  # off: nothing said
    assert "train.ema" not in report_md.render_report(tmp_path, report(config={"train": {"ema": 0.0}}))


def test_a_warning_about_the_kept_model_comes_first_in_its_section(tmp_path: Path) -> None:
    from leaflens.pipeline.chance import chance_warning  # noqa: PLC0415
    from leaflens.pipeline.selection import Budget, Candidate, choose  # noqa: PLC0415

    sel = choose([Candidate("distilled", "student", 0.34, 0.33, 1000, 1.0),
                  Candidate("scratch", "student", 0.33, 0.33, 1000, 1.0)], Budget())
    said = chance_warning(0.34, np.repeat([0, 1, 2], 40))
    text = report_md.render_report(tmp_path, report(selection=sel.to_dict(), warnings=[said]))
    assert f"**Warning:** {said}." in text
    assert text.index("## Kept model") < text.index("**Warning:**") < text.index("**distilled** is kept")
    assert "**Warning:**" not in report_md.render_report(tmp_path, report(selection=sel.to_dict(), warnings=[]))


def test_the_ambiguous_line_says_when_the_budget_is_less_than_one_validation_photo(tmp_path: Path) -> None:
    from leaflens.pipeline.report.metrics import choose_uncertain_threshold  # noqa: PLC0415

    rng = np.random.default_rng(0)
    for n, small in ((36, True), (400, False)):  # 1.5 % of 36 photos is half a photo; of 400, six
        probs = rng.dirichlet(np.ones(3), size=n)
        choice = choose_uncertain_threshold(probs, rng.integers(0, 3, n))
        text = report_md.render_report(tmp_path, report(threshold_choice=choice))
        assert (f"at least one: 1 of the {n} here" in text) is small, choice
        assert "too few for that share" not in text
    # a record where none was flagged (a run before the at-least-one rule, or ties at the cut) says so
    old = dict(choose_uncertain_threshold(rng.dirichlet(np.ones(3), size=36), rng.integers(0, 3, 36)), kept=36)
    assert "none of the 36 here, too few for that share" in report_md.render_report(tmp_path,
                                                                                     report(threshold_choice=old))


def test_the_ambiguous_lines_say_what_was_flagged_not_the_budget(tmp_path: Path) -> None:
    """The budget (1.5 %) was printed as the share flagged (2 of 180: 1.1 %), and the out-of-domain line counted
    the threshold alone as what the "ambiguous" rule leaves unanswered (1.1 %, where near ties made it 3.9 %)."""
    from leaflens.pipeline.report.metrics import choose_uncertain_threshold  # noqa: PLC0415

    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(8) * 2, size=180)
    choice = choose_uncertain_threshold(probs, rng.integers(0, 8, 180))
    assert choice["kept"] == 178 and choice["answered"] < choice["coverage"]  # near ties on top of the threshold
    check = {"fitted": True, "method": "block-mahalanobis-1", "threshold": 24.1, "budget": 0.03, "confidence": 0.9,
             "val_photos": 180, "val_flagged": 2 / 180, "train_photos": 839, "blocks": 3,
             "val_ambiguous": 1 - choice["answered"]}
    text = report_md.render_report(tmp_path, report(threshold_choice=choice, out_of_domain=check))
    assert "(the least confident 1.1 % of the validation photos (budget 1.5 %);" in text
    assert (f"the \"ambiguous\" rule (its threshold and near ties) leaves {100 * (1 - choice['answered']):.1f} % of "
            "validation photos unanswered") in text


def test_distill_counts_near_ties_in_what_the_ambiguous_rule_leaves(monkeypatch) -> None:
    from leaflens.pipeline import distill  # noqa: PLC0415

    class Check:
        def to_dict(self) -> dict:
            return {"threshold": 1.0}

    monkeypatch.setattr(distill.ood, "supports_ood", lambda model: True)
    monkeypatch.setattr(distill.ood, "with_generic_branch", lambda model, mean, std: (model, None))
    monkeypatch.setattr(distill.ood, "fit_for_dataset", lambda *a: (None, Check(), None, None))
    contract = type("C", (), {"mean": 0, "std": 1})()
    ds = type("D", (), {"num_classes": 8})()
    summary = distill.out_of_domain_summary(object(), ds, contract, {"coverage": 0.99, "answered": 0.96})
    assert summary["val_ambiguous"] == pytest.approx(0.04)
    old = distill.out_of_domain_summary(object(), ds, contract, {"coverage": 0.99})  # before "answered"
    assert old["val_ambiguous"] == pytest.approx(0.01)


def test_a_class_without_test_photos_reads_n_a_not_zero(tmp_path: Path) -> None:
    """A class with no test photo showed precision, recall and F1 of 0.000, as if the model always missed it."""
    y = np.repeat([0, 1], 20)  # no healthy photo in test
    probs = np.full((40, 3), 0.05)
    pred = y.copy()
    pred[0] = 1
    probs[np.arange(40), pred] = 0.9
    text = report_md.render_report(tmp_path, report(test=metrics.evaluation_summary(probs, y, CLASSES)))
    assert "| healthy | n/a | n/a | n/a | 0 |" in text
    pred[1] = 2  # called healthy once: its precision is a measured 0
    probs = np.full((40, 3), 0.05)
    probs[np.arange(40), pred] = 0.9
    text = report_md.render_report(tmp_path, report(test=metrics.evaluation_summary(probs, y, CLASSES)))
    assert "| healthy | 0.000 | n/a | n/a | 0 |" in text


def test_the_ambiguous_line_says_what_the_served_rule_answers(tmp_path: Path) -> None:
    unc = {"threshold": 0.196, "coverage": 0.989, "accuracy": 0.77, "kept": 179, "n_val": 181, "target": 0.95,
           "reached": False, "method": "best_effort", "answered": 0.917, "answered_accuracy": 0.80}
    text = report_md.render_report(tmp_path, report(uncertain=unc))
    assert "with both rules, as served, it answers 91.7 % of the validation images at 80.0 % accuracy" in text
    assert "as served" not in report_md.render_report(tmp_path, report())  # not recorded: nothing invented
