"""The Model tab in plain words (leaflens.apps.model_info): the demo banner, classes with display names, crops,
what the model was trained on, and each class's reliability in a sentence from the run's confusion matrix;
the numbers stay, below the words."""

from __future__ import annotations

import json

import pytest

from leaflens.apps.model_info import ServeContext, demo_banner, model_markdown, page_banner, reliability_lines
from leaflens.apps.notes import ClassNotes

CLASSES = ["aphids", "healthy", "leaf_miner", "rust"]
NOTES = ClassNotes({"aphids": {"name": "Aphids", "name_zh": "蚜虫"},
                    "healthy": {"name": "Healthy", "name_zh": "健康"},
                    "leaf_miner": {"name": "Leaf miner", "name_zh": "潜叶蝇"},
                    "rust": {"name": "Rust", "name_zh": "锈病"}})
# rows: true class, columns: predicted (CLASSES order). Healthy: 23 of 45 right, 15 taken for leaf miner;
# aphids: 40 of 43, 3 taken for rust (7 %); leaf miner: 44 of 44 but only 44 of 59 "leaf miner" answers right;
# rust: 6 of 6 (too few to be sure).
MATRIX = [[40, 0, 0, 3],
          [4, 23, 15, 3],
          [0, 0, 44, 0],
          [0, 0, 0, 6]]


def report(matrix=MATRIX, classes=CLASSES) -> dict:
    return {"test": {"accuracy": 0.821, "accuracy_ci": [0.75, 0.88], "ci_level": 0.95, "n": 138,
                     "classes": classes, "confusion_matrix": matrix}}


def test_each_class_gets_a_sentence_with_its_counts():
    lines = reliability_lines(report(), CLASSES, NOTES, "en")
    assert lines == [
        "- **Aphids**: right 40 of 43 times; sometimes mistaken for **Rust** (3 times).",
        "- **Healthy** is often mistaken for **Leaf miner** (15 of 45 times); right 23 of 45 times.",
        "- **Leaf miner**: right 44 of 44 times. When it answers **Leaf miner**, it is right only 44 of 59 times.",
        "- **Rust**: right 6 of 6 times. When it answers **Rust**, it is right only 6 of 12 times. "
        "Too few test photos to be sure.",
    ]
    zh = reliability_lines(report(), CLASSES, NOTES, "zh")
    assert zh[1] == "- **健康** 常被误认为 **潜叶蝇**（45 次中 15 次）；45 次中认对 23 次。"
    assert reliability_lines(report(), CLASSES, None, "en")[1].startswith("- **healthy** is often mistaken for")


def test_a_class_mistaken_equally_often_for_two_others_names_both():
    tied = [[3, 8, 0, 8],  # aphids: 3 of 19 right, 8 taken for healthy and 8 for rust
            [0, 45, 0, 0],
            [0, 1, 43, 0],
            [0, 0, 1, 19]]  # rust: 1 taken for leaf miner (5 %)
    en = reliability_lines(report(tied), CLASSES, NOTES, "en")
    assert en[0] == ("- **Aphids** is often mistaken for **Healthy** and **Rust** (8 of 19 times each); "
                     "right 3 of 19 times.")
    zh = reliability_lines(report(tied), CLASSES, NOTES, "zh")
    assert zh[0] == "- **蚜虫** 常被误认为 **健康**、**锈病**（19 次中各 8 次）；19 次中认对 3 次。"
    three = [[3, 5, 5, 5], [0, 45, 0, 0], [0, 1, 43, 0], [0, 0, 1, 19]]
    assert "mistaken for **Healthy**, **Leaf miner** and **Rust** (5 of 18 times each)" in reliability_lines(
        report(three), CLASSES, NOTES, "en")[0]
    assert "**健康**、**潜叶蝇**、**锈病**" in reliability_lines(report(three), CLASSES, NOTES, "zh")[0]
    tied[0] = [34, 2, 0, 2]  # 2 of 38 each: 5 %, "sometimes"
    assert reliability_lines(report(tied), CLASSES, NOTES, "en")[0] == (
        "- **Aphids**: right 34 of 38 times; sometimes mistaken for **Healthy** and **Rust** (2 times each).")


@pytest.mark.parametrize("bad", [
    None, {}, {"test": {"accuracy": 0.9}},  # no matrix recorded
    report(classes=["a", "b", "c", "d"]),  # another model's classes
    report(matrix=[[1, 2], [3, 4]]),  # wrong shape
    report(matrix=[["x"] * 4] * 4),  # not counts
])
def test_no_sentences_without_a_matrix_that_fits(bad):
    assert reliability_lines(bad, CLASSES, NOTES, "en") == []


def served(tiny_model, **meta: str):
    """A Predictor over a tiny model of CLASSES with ``meta`` in its metadata."""
    from leaflens.apps.predictor import Predictor

    path, _ = tiny_model(classes=CLASSES, **meta)
    return Predictor(path)


def test_a_demo_model_says_so_first_and_the_numbers_come_after_the_words(tiny_model):
    synthetic = json.dumps({"kind": "synthetic", "photos": 2400, "generator": "leaflens data synth"})
    predictor = served(tiny_model, **{"leaflens.dataset": synthetic})
    md = model_markdown(predictor, ServeContext(run_report=report()), "en", NOTES)
    banner = demo_banner(predictor.card, "en")
    assert banner.startswith("**Demo model: trained on drawn leaves, not real photos.**")
    assert md.index(banner) < md.index("**What it recognises:**") < md.index("#### How reliable each class is")
    assert md.index("#### How reliable each class is") < md.index("#### The numbers") < md.index("- **File:**")
    assert "**What it recognises:** 4 classes: Aphids, Healthy, Leaf miner, Rust" in md
    assert "**Crops:** none in particular: the leaves were drawn by a program" in md
    assert "**Trained on:** 2,400 drawn leaves (the demo set made by `leaflens data synth`), no real photos" in md
    assert "**How often it is right:** 82.1% (95% confidence interval 75.0% to 88.0%, 138 test photos)" in md
    assert "**Healthy** is often mistaken for **Leaf miner**" in md
    assert "- **Classes:** 4: Aphids (`aphids`)" in md  # the class ids stay, with the numbers
    zh = model_markdown(predictor, ServeContext(run_report=report()), "zh", NOTES)
    assert "演示模型" in zh and "2,400 张绘制的叶片" in zh and "#### 具体数字" in zh
    # the parameter count is the network's; what the served file weighs is said beside it
    size = predictor.model_path.stat().st_size
    assert f"(the file is {size / 1024:.1f} KB)" in md and f"（文件大小 {size / 1024:.1f} KB）" in zh
    from leaflens.apps.predictor import Predictor
    with_check = Predictor(tiny_model(classes=CLASSES, name="ood.onnx", ood_threshold=-0.1)[0])
    assert "(the network's; the file, with its out-of-domain check, is" in model_markdown(with_check, ServeContext(),
                                                                                           "en", NOTES)


def test_a_photo_model_has_no_banner_and_names_its_crops(tiny_model):
    photos = json.dumps({"kind": "photos", "photos": 1034})
    predictor = served(tiny_model, **{"leaflens.dataset": photos})
    notes = ClassNotes({c: {"name": c.title(), "crop": "Bean", "crop_zh": "菜豆"} for c in CLASSES[:2]}
                       | {c: {"name": c.title(), "crop": "Tomato"} for c in CLASSES[2:]})
    md = model_markdown(predictor, ServeContext(), "en", notes)
    assert demo_banner(predictor.card, "en") == "" and "Demo model" not in md
    assert "**Crops:** Bean, Tomato" in md and "**Trained on:** 1,034 photos" in md
    assert "No per-class test results were found" in md and "No training report was found" in md
    assert "**作物:** 菜豆、Tomato" in model_markdown(predictor, ServeContext(), "zh", notes)


def test_a_model_its_run_found_no_better_than_guessing_says_so_above_everything(tiny_model):
    photos = json.dumps({"kind": "photos", "photos": 60})
    predictor = served(tiny_model, **{"leaflens.dataset": photos})
    guessed = ServeContext(run_report={**report(), "no_better_than_chance": True})
    banner = page_banner(predictor.card, guessed, "en")
    assert banner.startswith("**On its validation photos this model could not be told apart from guessing.**")
    md = model_markdown(predictor, guessed, "en", NOTES)
    assert md.index(banner) < md.index("**What it recognises:**")
    assert "与猜测无法区分" in page_banner(predictor.card, guessed, "zh")
    assert page_banner(predictor.card, ServeContext(run_report=report()), "en") == ""  # a run that learnt
    assert page_banner(predictor.card, ServeContext(), "en") == ""  # no run found: nothing invented
    synthetic = json.dumps({"kind": "synthetic", "photos": 2400, "generator": "leaflens data synth"})
    demo = served(tiny_model, **{"leaflens.dataset": synthetic})
    both = page_banner(demo.card, guessed, "en")
    assert both.startswith("**Demo model") and "could not be told apart from guessing" in both


def test_an_older_model_says_its_training_data_is_not_recorded(tiny_model):
    predictor = served(tiny_model)
    md = model_markdown(predictor, ServeContext(), "en", NOTES)
    assert "**Trained on:** not recorded in this model file" in md and "Demo model" not in md
    assert "**Crops:** not named in the class notes" in md


def test_the_framing_line_names_the_models_centre_crop(tiny_model):
    whole = model_markdown(served(tiny_model), ServeContext(), "en", NOTES)
    assert "**Photo framing:** centre crop of the shorter side\n" in whole
    crop = served(tiny_model, **{"leaflens.format": "4", "leaflens.stored_size": "32",
                                 "leaflens.centre_crop": "0.875"})
    md = model_markdown(crop, ServeContext(), "en", NOTES)
    assert ("**Photo framing:** centre crop of the shorter side, then its middle 87.5% (chosen on the validation "
            "photos)") in md
    assert "再取中间的 87.5%" in model_markdown(crop, ServeContext(), "zh", NOTES)
    # a served teacher's: the shorter side scaled beyond the input, then the middle (it said "centre crop of the
    # shorter side", which a client following it would frame wider)
    teacher = served(tiny_model, **{"leaflens.shorter_side": "18"})
    side = teacher.card.contract.stored_size
    assert (f"**Photo framing:** shorter side scaled to 18 px, then the middle {side} x {side} px "
            f"({100 * side / 18:.1f}% of the shorter side)\n") in model_markdown(teacher, ServeContext(), "en", NOTES)
    assert "短边缩放到 18 像素" in model_markdown(teacher, ServeContext(), "zh", NOTES)


@pytest.mark.slow
@pytest.mark.parametrize("kind, shown", [("synthetic", True), ("photos", False)])
def test_the_page_shows_the_banner_above_everything_for_a_demo_model(tiny_model, kind, shown):
    pytest.importorskip("gradio")
    from leaflens.apps.service import DiagnosisService
    from leaflens.apps.web import build_app

    predictor = served(tiny_model, **{"leaflens.dataset": json.dumps({"kind": kind, "photos": 10})})
    with DiagnosisService(predictor) as service:
        demo = build_app(service)
        blocks = list(demo.blocks.values())
        banner = next(b for b in blocks if getattr(b, "elem_id", None) == "demo-banner")
        assert banner.visible is shown
        assert ("Demo model: trained on drawn leaves, not real photos" in banner.value) is shown
        tabs = [b for b in blocks if type(b).__name__ == "Tab"]
        assert tabs and banner._id < min(tab._id for tab in tabs)  # above the tabs: on every page


def test_an_int8_file_shows_its_own_accuracy_not_the_fp32_runs(tiny_model):
    """Serving student_int8.onnx, the tab said "75.1%" (the FP32 model's, from the run's report) where the file
    records its own 74.0%, and showed the FP32 model's per-class results as the file's."""
    predictor = served(tiny_model, **{"leaflens.accuracy": "0.7403"})
    md = model_markdown(predictor, ServeContext(run_report=report()), "en", NOTES)
    assert "**How often it is right:** 74.0%" in md and "82.1%" not in md
    assert "those of the FP32 model this file was made from" in md and "often mistaken" not in md
    # an INT8 file whose accuracy happens to equal the FP32 run's: the file says what it is
    level = served(tiny_model, **{"leaflens.accuracy": "0.821", "leaflens.precision": "int8"})
    md = model_markdown(level, ServeContext(run_report=report()), "en", NOTES)
    assert "those of the FP32 model this file was made from" in md and "often mistaken" not in md
    same = served(tiny_model, **{"leaflens.accuracy": "0.821"})  # the run's own file: its figures stand
    md = model_markdown(same, ServeContext(run_report=report()), "en", NOTES)
    assert "82.1% (95% confidence interval" in md and "often mistaken" in md


def test_the_trained_on_line_says_how_many_photos_it_learned_from(tiny_model):
    """"Trained on: 1,200 drawn leaves" counted the validation and test photos, and not the 1,200 unlabelled
    ones the distilled student learned from through its teacher."""
    card = json.dumps({"kind": "synthetic", "photos": 1200, "generator": "leaflens data synth", "train": 838,
                       "unlabeled": 1200})
    md = model_markdown(served(tiny_model, **{"leaflens.dataset": card}), ServeContext(), "en", NOTES)
    assert ("1,200 drawn leaves (the demo set made by `leaflens data synth`), no real photos; 838 of them to learn "
            "from, the other 362 to choose and test the model; and 1,200 more without labels") in md
    zh = model_markdown(served(tiny_model, **{"leaflens.dataset": card}), ServeContext(), "zh", NOTES)
    assert "838 张用于学习" in zh and "1,200 张无标注" in zh
