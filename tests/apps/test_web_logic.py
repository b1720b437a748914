"""The web app's logic without a browser or Gradio: verdicts, the combined vote, class notes,
interface strings, and the service's handling of real photo files (formats, sizes, broken files)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from apps_helpers import reference_ood, reference_probs, write_digit, write_grey_noise, write_leaf, write_photo
from PIL import Image

from leaflens.apps.diagnosis import PhotoOutcome, format_percent, is_healthy, md_escape, render, summarise
from leaflens.apps.i18n import LANGS, STRINGS, lang_from_choice, t
from leaflens.apps.notes import ClassNotes, NotesError, find_notes, load_notes
from leaflens.data_prep.decode import decode_image

CLASSES = ["healthy", "rust", "early_blight"]
NOTES = ClassNotes({
    "rust": {"name": "Rust", "name_zh": "锈病", "description": "Orange pustules.", "description_zh": "橙色孢子堆。",
             "advice": "Remove infected leaves.", "advice_zh": "摘除病叶。"},
    "healthy": {"name": "Healthy", "name_zh": "健康"},
})


def outcome(name: str, probs: list[float]) -> PhotoOutcome:
    return PhotoOutcome(name, probs=np.array(probs))


def outcome_v(name: str, probs: list[float], verdict: str, ood_score: float | None = None) -> PhotoOutcome:
    """An outcome with the Predictor's verdict, as the service builds it."""
    return PhotoOutcome(name, probs=np.array(probs), verdict=verdict, ood_score=ood_score)


# ----------------------------------------------------------------------------- the vote and the verdict
def test_photos_that_agree_on_a_near_tie_are_unsure_between_the_two():
    """Two photos each torn between early blight and rust (both early blight first): their average is a near tie,
    which the vote names as "unsure between" them, not a diagnosis with its treatment, whatever the low threshold."""
    res = summarise([outcome_v("a", [0.0, 0.49, 0.51], "diagnosis"), outcome_v("b", [0.0, 0.46, 0.54], "diagnosis")],
                    CLASSES, threshold=0.2)
    ans = res["answer"]
    assert ans["verdict"] == "ambiguous" and ans["candidates"] == ["early_blight", "rust"]
    value, verdict, notes_md, _ = render(res, "en", NOTES)
    assert value is None and notes_md == "" and "**Unsure between early_blight and Rust:**" in verdict
    single = summarise([outcome("c", [0.0, 0.48, 0.52])], CLASSES, threshold=0.2)  # no verdict given: the rule
    assert single["answer"]["verdict"] == "ambiguous"


def test_a_near_certain_answer_never_reads_100_percent():
    """The ranking's bar read "100%" beside the verdict's ">99%": Gradio rounds, so the bar gets at most 0.994."""
    res = summarise([outcome("a.jpg", [0.0005, 0.999, 0.0005])], CLASSES, threshold=0.5)
    value, verdict, _, _ = render(res, "en", NOTES)
    assert ">99%" in verdict and value["Rust"] == 0.994 and round(100 * max(value.values())) == 99
    assert res["answer"]["confidence"] == pytest.approx(0.999)  # the API keeps the model's own figure


def test_vote_is_the_mean_of_the_photos_that_agree():
    a, c = [0.1, 0.7, 0.2], [0.05, 0.8, 0.15]
    res = summarise([outcome("a.jpg", a), PhotoOutcome("x.jpg", reason="not_an_image"), outcome("c.jpg", c)],
                    CLASSES, threshold=0.5)
    mean = np.mean([a, c], axis=0)
    ans = res["answer"]
    assert res["verdict"] == ans["verdict"] == "diagnosis"
    assert ans["label"] == "rust" and ans["confidence"] == pytest.approx(mean[1])
    assert [e["label"] for e in ans["top"]] == ["rust", "early_blight", "healthy"]
    assert ans["photos_used"] == 2 and ans["agree"] == 2 and ans["left_out"] == []
    assert ans["uncertain"] is False  # 0.75 >= 0.5
    assert [p["name"] for p in res["photos"]] == ["a.jpg", "x.jpg", "c.jpg"]
    bad = res["photos"][1]
    assert bad["error"]["reason"] == "not_an_image" and not bad["ok"] and bad["verdict"] == "error"
    json.dumps(res)  # the API answer is plain JSON


def test_photos_with_different_first_classes_disagree_instead_of_being_averaged():
    # one confident photo against two weak ones: averaged, they would say "early_blight" at 47 %
    res = summarise([outcome("a", [0.0, 0.9, 0.1]), outcome("b", [0.1, 0.0, 0.9]), outcome("c", [0.6, 0.0, 0.4])],
                    CLASSES, threshold=0.5)
    ans = res["answer"]
    assert res["verdict"] == ans["verdict"] == "disagree" and ans["uncertain"] is True
    assert ans["label"] is None and ans["top"] == [] and ans["photos_used"] == 3 and res["note"] is None
    assert [(p["label"], p["verdict"]) for p in res["photos"]] == [
        ("rust", "diagnosis"), ("early_blight", "diagnosis"), ("healthy", "diagnosis")]
    value, verdict, notes_md, table = render(res, "en", NOTES)
    assert value is None and notes_md == ""  # no class is the answer
    assert verdict.startswith("**The 3 photos disagree**")
    assert "a: Rust 90%" in verdict and "b: early\\_blight 90%" in verdict and "c: Healthy 60%" in verdict
    assert table.count("\n") == 4 and "| Rust | 90% |" in table
    zh = render(res, "zh", NOTES)[1]
    assert "不一致" in zh and "a：" in zh and "；b：" in zh and "; " not in zh  # Chinese punctuation in Chinese


def test_an_ambiguous_photo_takes_part_in_the_vote_by_its_first_class():
    sure, unsure = [0.1, 0.5, 0.4], [0.3, 0.4, 0.3]
    res = summarise([outcome("a", sure), outcome("b", unsure)], CLASSES, threshold=0.5)
    assert [p["verdict"] for p in res["photos"]] == ["diagnosis", "ambiguous"]
    assert res["photos"][1]["candidates"] == ["rust", "healthy"]  # ties keep the class order
    ans = res["answer"]
    assert ans["verdict"] == "ambiguous" and ans["confidence"] == pytest.approx(0.45)  # the mean is below 0.5
    assert ans["candidates"] == ["rust", "early_blight"]
    value, verdict, notes_md, table = render(res, "en", NOTES)
    assert value is None and notes_md == "" and "%" not in verdict
    assert "**Unsure between Rust and early_blight:** take another photo" in verdict
    assert "Combined vote of 2 photos" in verdict
    assert "| unsure: Rust or Healthy | |" in table  # the ambiguous photo has no percentage either


def test_photos_each_unsure_never_add_up_to_a_diagnosis():
    """Two photos each a near tie for the same first class, with different runners-up: their average has a clear
    lead, and the page gave a diagnosis with its treatment notes (two real aphid photos came back "bacterial
    spot"). No photo was judged with the confidence the threshold stands for, so the answer stays unsure."""
    a, b = [0.05, 0.50, 0.45], [0.48, 0.52, 0.0]
    res = summarise([outcome("a", a), outcome("b", b)], CLASSES, threshold=0.2)
    assert [p["verdict"] for p in res["photos"]] == ["ambiguous", "ambiguous"]
    ans = res["answer"]
    assert ans["verdict"] == "ambiguous" and ans["uncertain"] and ans["agree"] == 2
    assert ans["label"] == res["photos"][0]["label"] and len(ans["candidates"]) == 2
    value, _, notes_md, _ = render(res, "en", NOTES)
    assert value is None and notes_md == ""
    # one of them judged on its own: the vote may then diagnose
    sure = summarise([outcome("a", a), outcome("c", [0.1, 0.8, 0.1])], CLASSES, threshold=0.2)
    assert sure["answer"]["verdict"] == "diagnosis"


def test_photos_unsure_between_the_same_two_classes_in_either_order_agree():
    """Three aphid photos, each "unsure between aphids and healthy", two of them with healthy first: the page said
    "the 3 photos disagree". A class every photo claims (a diagnosed photo's, either of an unsure one's two) is
    agreement; a diagnosis it is not, and photos that share no class still disagree."""
    a, b, c = [0.50, 0.45, 0.05], [0.46, 0.50, 0.04], [0.47, 0.51, 0.02]
    res = summarise([outcome("a", a), outcome("b", b), outcome("c", c)], CLASSES, threshold=0.2)
    assert [p["verdict"] for p in res["photos"]] == ["ambiguous"] * 3
    ans = res["answer"]
    assert res["verdict"] == ans["verdict"] == "ambiguous" and sorted(ans["candidates"]) == ["healthy", "rust"]
    assert "Unsure between" in render(res, "en", NOTES)[1]
    # a photo diagnosed as rust beside one unsure between healthy (first) and rust: not a disagreement, but no
    # diagnosis either: the second photo leans healthy, and its rust might be almost nothing
    both = summarise([outcome("d", [0.05, 0.9, 0.05]), outcome("a", a)], CLASSES, threshold=0.2)
    assert both["answer"]["verdict"] == "ambiguous" and both["answer"]["agree"] == 1
    classes = ["healthy", "rust"] + [f"c{i}" for i in range(8)]
    weak = summarise([outcome_v("x", [0, 1.0] + [0] * 8, "diagnosis"),
                      outcome_v("y", [0.49, 0.06] + [0.45 / 8] * 8, "ambiguous")], classes, threshold=0.5)
    assert weak["answer"]["verdict"] != "diagnosis"  # rust at 6 % is no vote for rust
    # unsure between healthy and rust, and diagnosed as early blight: nothing shared
    apart = summarise([outcome("b", b), outcome("e", [0.05, 0.05, 0.9])], CLASSES, threshold=0.2)
    assert apart["verdict"] == "disagree"


def test_threshold_is_the_ambiguity_boundary():
    probs = [0.1, 0.55, 0.35]
    answer = summarise([outcome("a", probs)], CLASSES, threshold=0.55)["answer"]
    assert answer["verdict"] == "diagnosis" and answer["uncertain"] is False
    answer = summarise([outcome("a", probs)], CLASSES, threshold=0.56)["answer"]
    assert answer["verdict"] == "ambiguous" and answer["uncertain"] is True


def test_the_predictors_verdict_wins_over_the_threshold_rule():
    # the service passes Predictor.judge's verdict: a confident photo can still be out of domain
    res = summarise([outcome_v("a.jpg", [0.02, 0.96, 0.02], "out_of_domain", 3.5)], CLASSES, threshold=0.5,
                    ood_threshold=2.0)
    photo = res["photos"][0]
    assert photo["verdict"] == "out_of_domain" and photo["ok"] and photo["ood_score"] == 3.5
    assert photo["label"] is None and photo["confidence"] is None and photo["top"] == []  # no class named
    assert res["verdict"] == "out_of_domain" and res["answer"]["left_out"] == ["a.jpg"]
    assert res["ood_threshold"] == 2.0 and res["note"] is None
    with pytest.raises(ValueError, match="verdict 'refused'"):
        summarise([outcome_v("a.jpg", [0.02, 0.96, 0.02], "refused")], CLASSES, threshold=0.5)


def test_wrong_number_of_probabilities_is_refused():
    with pytest.raises(ValueError, match="a.jpg"):
        summarise([outcome("a.jpg", [0.5, 0.5])], CLASSES, threshold=0.5)


def test_render_single_confident_photo_with_notes_in_both_languages():
    res = summarise([outcome("leaf.jpg", [0.05, 0.9, 0.05])], CLASSES, 0.5, notes=NOTES)
    assert res["note"]["advice"] == "Remove infected leaves."
    value, verdict, notes_md, table = render(res, "en", NOTES)
    assert value == {"Rust": pytest.approx(0.9), "early_blight": pytest.approx(0.05),
                     "Healthy": pytest.approx(0.05)}
    assert "**Rust**" in verdict and "90%" in verdict and "Unsure" not in verdict
    assert "Orange pustules." in notes_md and "Remove infected leaves." in notes_md
    assert table == ""  # one readable photo: no per-photo table
    value, verdict, notes_md, _ = render(res, "zh", NOTES)
    assert "锈病" in value and "锈病" in verdict and "摘除病叶。" in notes_md and "橙色孢子堆。" in notes_md


def test_render_healthy_and_ambiguous_wording():
    healthy = render(summarise([outcome("a", [0.97, 0.02, 0.01])], CLASSES, 0.5), "en", NOTES)[1]
    assert "healthy" in healthy and "97%" in healthy
    res = summarise([outcome("a", [0.25, 0.4, 0.35])], CLASSES, 0.5, notes=NOTES)
    assert res["verdict"] == "ambiguous" and res["note"] is None  # no treatment notes for a guess
    value, verdict, notes_md, table = render(res, "en", NOTES)
    assert verdict == ("**Unsure between Rust and early_blight:** take another photo of one leaf (or pest), closer, "
                       "in daylight.")
    assert value is None and notes_md == "" and table == ""  # no ranking, no percentage, no advice
    assert "无法确定是锈病还是early_blight" in render(res, "zh", NOTES)[1]


def test_render_out_of_domain_names_what_the_model_knows_and_no_disease():
    res = summarise([outcome_v("cat.jpg", [0.01, 0.98, 0.01], "out_of_domain", 9.0)], CLASSES, 0.5, notes=NOTES)
    value, verdict, notes_md, table = render(res, "en", NOTES, classes=CLASSES)
    assert value is None and notes_md == "" and table == ""
    assert verdict.startswith("**This does not look like the leaves or pests this model knows**")
    assert "trained on photos of: Healthy, Rust, early_blight." in verdict and "filling the frame" in verdict
    assert "%" not in verdict and "Most likely" not in verdict
    zh = render(res, "zh", NOTES, classes=CLASSES)[1]
    assert "不像本模型认识的叶片或害虫" in zh and "健康、锈病、early_blight" in zh
    many = [f"class_{i}" for i in range(11)]
    assert "class_7 and 3 more." in render(res, "en", classes=many)[1]


def test_out_of_domain_photos_are_named_and_left_out_of_the_vote():
    res = summarise([outcome("a.jpg", [0.1, 0.8, 0.1]), outcome_v("wall.jpg", [0.9, 0.05, 0.05], "out_of_domain", 5.0),
                     outcome("b.jpg", [0.2, 0.6, 0.2]), PhotoOutcome("tiny.png", reason="too_small", detail="1x1 px")],
                    CLASSES, 0.5, notes=NOTES)
    ans = res["answer"]
    assert res["verdict"] == "diagnosis" and ans["label"] == "rust" and ans["photos_used"] == 2
    assert ans["confidence"] == pytest.approx(0.7)  # the mean of a and b only: the wall's 0.9 "healthy" is not in it
    assert ans["left_out"] == ["wall.jpg"] and res["note"]["name"] == "Rust"
    assert [p["verdict"] for p in res["photos"]] == ["diagnosis", "out_of_domain", "diagnosis", "refused"]
    value, verdict, notes_md, table = render(res, "en", NOTES, classes=CLASSES)
    assert list(value) == ["Rust", "Healthy", "early_blight"] and "Remove infected leaves." in notes_md
    assert "1 of 4 photos were left out: they do not look like the leaves or pests this model knows " \
           "(wall\\.jpg)" in verdict
    assert "1 of 4 files could not be used" in verdict
    assert "| 2 | wall\\.jpg | not a leaf or pest this model knows | |" in table
    assert "| 4 | tiny\\.png | **not analysed:** the picture is too small" in table

    every = summarise([outcome_v("x.jpg", [0.1, 0.8, 0.1], "out_of_domain", 5.0),
                       outcome_v("y.jpg", [0.1, 0.8, 0.1], "out_of_domain", 6.0)], CLASSES, 0.5, notes=NOTES)
    assert every["verdict"] == "out_of_domain" and every["answer"]["left_out"] == ["x.jpg", "y.jpg"]
    value, verdict, notes_md, table = render(every, "en", NOTES, classes=CLASSES)
    assert value is None and notes_md == "" and verdict.startswith("**None of the 2 photos looks like")
    assert "Rust" not in table and "%" not in table


@pytest.mark.parametrize("reason,words", [("too_small", "too small to show a leaf"),
                                          ("uniform", "almost one flat colour"),
                                          ("low_texture", "too little fine detail to examine a leaf")])
def test_refused_photos_show_their_reason_like_unreadable_files(reason, words):
    res = summarise([PhotoOutcome("p.jpg", reason=reason, detail="measured", verdict="refused")], CLASSES, 0.5)
    assert res["verdict"] == "refused" and res["answer"] is None
    assert res["photos"][0]["verdict"] == "refused" and words in res["photos"][0]["error"]["message"]
    value, verdict, notes_md, table = render(res, "en")
    assert value is None and notes_md == "" and table == ""
    assert verdict.startswith("**p\\.jpg** was not analysed: ") and words in verdict
    assert "未分析" in render(res, "zh")[1]
    both = summarise([PhotoOutcome("p.jpg", reason=reason), PhotoOutcome("q.jpg", reason="uniform")], CLASSES, 0.5)
    assert both["verdict"] == "refused" and "None of the photos could be analysed" in render(both, "en")[1]
    mixed = summarise([PhotoOutcome("p.jpg", reason=reason), PhotoOutcome("q.jpg", reason="truncated")], CLASSES, 0.5)
    assert mixed["verdict"] == "error" and [p["verdict"] for p in mixed["photos"]] == ["refused", "error"]
    # one was read and refused, one could not be read: not "none could be read as a photo"
    said = render(mixed, "en")[1]
    assert said.startswith("None of the files could be analysed: some could not be read as photos, the others were")
    assert "无法判断" in render(mixed, "zh")[1]


def test_render_several_photos_and_failures():
    res = summarise([outcome("one.jpg", [0.1, 0.8, 0.1]), outcome("two.jpg", [0.1, 0.7, 0.2]),
                     PhotoOutcome("notes.txt", reason="not_an_image", detail="not a recognised image format")],
                    CLASSES, 0.5)
    _, verdict, _, table = render(res, "en", NOTES)
    assert "Combined vote of 2 photos" in verdict and "2 of 2 photos" in verdict
    assert "1 of 3 files could not be used" in verdict
    assert "notes\\.txt" in table and "not a picture" in table and "two\\.jpg" in table
    assert table.count("\n") == 4  # header, rule, three rows


def test_render_one_broken_file_says_so_plainly():
    res = summarise([PhotoOutcome("broken.jpg", reason="truncated", detail="image file is truncated")],
                    CLASSES, 0.5)
    assert res["answer"] is None
    value, verdict, notes_md, table = render(res, "en")
    assert value is None and notes_md == "" and table == ""
    assert "broken\\.jpg" in verdict and "incomplete" in verdict and "Traceback" not in verdict
    assert "不完整" in render(res, "zh")[1]


def test_render_size_limit_message_keeps_its_numbers_in_both_languages():
    res = summarise([PhotoOutcome("big.jpg", reason="file_too_big", values={"size": 25.3, "limit": 20.0})],
                    CLASSES, 0.5)
    assert "25.3 MB" in res["photos"][0]["error"]["message"]
    assert "25.3 MB" in render(res, "en")[1] and "20.0 MB" in render(res, "zh")[1]


def test_render_nothing_yet_and_no_photos():
    assert render(None, "en")[1] == t("waiting", "en")
    assert "No photo" in render(summarise([], CLASSES, 0.5), "en")[1]


def test_helpers():
    assert format_percent(0.001) == "<1%" and format_percent(0.9999) == ">99%" and format_percent(0.5) == "50%"
    assert is_healthy("healthy") and is_healthy("Tomato___healthy") and not is_healthy("unhealthy")
    assert not is_healthy("rust")
    assert md_escape("a|b*c_<script>") == "a\\|b\\*c\\_\\<script\\>"


# ----------------------------------------------------------------------------- interface strings
def test_every_string_exists_in_both_languages_with_the_same_placeholders():
    import string

    keys = {lang: set(STRINGS[lang]) for lang in LANGS}
    assert keys["en"] == keys["zh"]
    for key in keys["en"]:
        fields = [{f for _, f, _, _ in string.Formatter().parse(STRINGS[lang][key]) if f} for lang in LANGS]
        assert fields[0] == fields[1], key
    assert lang_from_choice("中文") == "zh" and lang_from_choice("zh") == "zh" and lang_from_choice(None) == "en"


# ----------------------------------------------------------------------------- class notes
def test_notes_from_synth_toml_json_and_fallbacks(tmp_path):
    from leaflens.data_prep.synth import CLASSES as SYNTH_CLASSES
    from leaflens.data_prep.synth import classes_toml

    (tmp_path / "classes.toml").write_text(classes_toml(), encoding="utf-8")
    notes = load_notes(tmp_path / "classes.toml")
    assert set(notes.entries) == set(SYNTH_CLASSES)
    assert notes.name("rust", "zh") == "锈病" and notes.name("rust") == "Rust"
    assert notes.text("rust", "advice", "zh").startswith("摘除")
    partial = tmp_path / "notes.json"
    partial.write_text(json.dumps({"rust": {"name": "Rust", "advice": "Act."}}), encoding="utf-8")
    notes = load_notes(partial)
    assert notes.name("rust", "zh") == "Rust"  # no Chinese name: English
    assert notes.name("blight", "zh") == "blight"  # no entry: the class id
    assert notes.text("rust", "description") == "" and notes.text("rust", "advice", "zh") == "Act."
    assert notes.unknown_classes(["healthy"]) == ["rust"]
    assert find_notes([None, tmp_path / "nowhere", tmp_path]) == tmp_path / "classes.toml"


@pytest.mark.parametrize("name,text,match", [
    ("classes.toml", "[classes.rust\nname = 1", "not valid TOML"),
    ("classes.json", "{", "not valid JSON"),
    ("classes.toml", "[classes.rust]\nname = 3\n", r"'classes\.rust\.name' must be text"),
    ("classes.json", '{"classes": {"rust": "Rust"}}', r"'classes\.rust' must be a table"),
])
def test_bad_notes_files_name_the_file_and_entry(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(NotesError, match=match) as info:
        load_notes(path)
    assert str(path) in str(info.value)


# ----------------------------------------------------------------------------- the service on real files
@pytest.fixture
def service(tiny_model):
    from leaflens.apps.predictor import Predictor
    from leaflens.apps.service import DiagnosisService, ServiceOptions

    path, weights = tiny_model(classes=CLASSES, size=16)
    svc = DiagnosisService(Predictor(path, intra_op_threads=1), NOTES,
                           ServiceOptions(max_upload_mb=0.05, max_photos=4, max_wait_ms=1))
    svc.weights = weights
    yield svc
    svc.close()


def encoded(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def test_the_same_photo_twice_is_one_vote_and_said_so():
    a, b = [0.1, 0.7, 0.2], [0.6, 0.3, 0.1]
    same = "sha256:" + "1" * 64
    res = summarise([PhotoOutcome("a.jpg", probs=np.array(a), sha256=same),
                     PhotoOutcome("b.jpg", probs=np.array(b), sha256="sha256:" + "2" * 64),
                     PhotoOutcome("copy of a.jpg", probs=np.array(a), sha256=same)], CLASSES, threshold=0.5)
    assert [p["duplicate_of"] for p in res["photos"]] == [None, None, "a.jpg"]
    ans = res["answer"]  # a and b disagree; the copy of a is not a third opinion
    assert ans["verdict"] == "disagree" and ans["photos_used"] == 2
    verdict = render(res, "en", NOTES)[1]
    assert "**The 2 photos disagree**" in verdict and "copy of a" not in verdict.split("\n")[0]
    assert "1 photo(s) are the same file as another photo here and were counted once (copy of a\\.jpg = a\\.jpg)" \
        in verdict
    twice = summarise([PhotoOutcome("a.jpg", probs=np.array(a), sha256=same),
                       PhotoOutcome("a2.jpg", probs=np.array(a), sha256=same)], CLASSES, threshold=0.5)
    assert twice["answer"]["photos_used"] == 1 and twice["answer"]["agree"] == 1
    assert "同一个文件" in render(twice, "zh", NOTES)[1]
    # without digests (callers that have none) every photo votes, as before
    plain = summarise([outcome("a.jpg", a), outcome("a2.jpg", a)], CLASSES, threshold=0.5)
    assert plain["answer"]["photos_used"] == 2 and all(p["duplicate_of"] is None for p in plain["photos"])


def test_service_counts_a_file_sent_twice_once_and_remembers_what_it_answered(service, tmp_path):
    path = write_photo(tmp_path / "p.png", (40, 32), seed=5)
    res = service.diagnose([path, path])
    assert res["answer"]["photos_used"] == 1 and res["photos"][1]["duplicate_of"] == "p.png"
    from leaflens.data_prep.arrays import sha256_file  # noqa: PLC0415

    known = service.answered.lookup(sha256_file(path))
    assert known["photo"]["label"] == res["photos"][0]["label"] and known["photo"]["ok"] is True
    assert known["answer"] == {"verdict": res["answer"]["verdict"], "label": res["answer"]["label"]}


def test_photos_with_one_file_name_are_told_apart(service, tmp_path):
    """IMG_0001.png from two folders: a photo left out was named "IMG_0001.png" beside the one used, by the same
    name. Each later file of a name gets " (2)", " (3)" on the page and in the API; a file sent twice too."""
    from leaflens.apps.diagnosis import photo_names  # noqa: PLC0415

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_photo(tmp_path / "a" / "IMG_0001.png", (40, 32), seed=5)
    b = write_photo(tmp_path / "b" / "IMG_0001.png", (40, 32), seed=6)
    res = service.diagnose([a, b, a])
    assert [p["name"] for p in res["photos"]] == ["IMG_0001.png", "IMG_0001.png (2)", "IMG_0001.png (3)"]
    assert res["photos"][2]["duplicate_of"] == "IMG_0001.png"
    assert photo_names(["x/p.jpg", "y/q.jpg", "z/p.jpg"]) == ["p.jpg", "q.jpg", "p.jpg (2)"]
    # a phone's own "IMG.jpg (2)" is not taken for the second IMG.jpg
    named = photo_names(["a/IMG.jpg", "b/IMG.jpg", "c/IMG.jpg (2)"])
    assert len(set(named)) == 3 and named[2] == "IMG.jpg (2)" and named[1] == "IMG.jpg (3)"


def test_service_matches_the_reference_network_and_votes(service, tmp_path):
    paths = [write_photo(tmp_path / f"p{i}.png", (40, 32), seed=i) for i in range(3)]
    res = service.diagnose(paths)
    pixels = np.stack([decode_image(p, 16) for p in paths])
    ref = reference_probs(pixels, service.weights)
    for photo, row in zip(res["photos"], ref):
        assert photo["ok"] and photo["label"] == CLASSES[int(row.argmax())]
        assert photo["confidence"] == pytest.approx(row.max(), abs=1e-5)
    mean = ref.mean(axis=0)
    assert res["answer"]["label"] == CLASSES[int(mean.argmax())]
    assert res["answer"]["confidence"] == pytest.approx(mean.max(), abs=1e-5)
    assert res["server_ms"] > 0 and res["model"] == "tiny.onnx"


def test_service_reads_what_phones_send(service, tmp_path):
    rng = np.random.default_rng(3)
    base = Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    files = {
        "photo.jpg": encoded(base, "JPEG", quality=90),
        "rotated.jpg": encoded(base, "JPEG", quality=90, exif=exif.tobytes()),
        "grey.png": encoded(base.convert("L"), "PNG"),
        "alpha.png": encoded(base.convert("RGBA"), "PNG"),
        "cmyk.jpg": encoded(base.convert("CMYK"), "JPEG"),
        "photo.webp": encoded(base, "WEBP", quality=90),
    }
    paths = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths.append(tmp_path / name)
    res = service.diagnose(paths[:4])
    res2 = service.diagnose(paths[4:])
    photos = res["photos"] + res2["photos"]
    assert [p["name"] for p in photos] == list(files) and all(p["ok"] for p in photos), photos
    # the rotated photo was turned upright: the model saw different pixels than the plain one
    ref = reference_probs(np.stack([decode_image(tmp_path / "rotated.jpg", 16)]), service.weights)[0]
    assert photos[1]["confidence"] == pytest.approx(ref.max(), abs=1e-5)


def test_service_big_phone_photo_is_decoded(tiny_model, tmp_path):
    from leaflens.apps.predictor import Predictor
    from leaflens.apps.service import DiagnosisService

    path, weights = tiny_model(classes=CLASSES, size=16)
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    big = Image.fromarray(small).resize((4000, 3000), Image.Resampling.BILINEAR)
    big.save(tmp_path / "phone.jpg", quality=85)
    with DiagnosisService(Predictor(path, intra_op_threads=1)) as svc:
        res = svc.diagnose([tmp_path / "phone.jpg"])
    assert res["photos"][0]["ok"]
    ref = reference_probs(decode_image(tmp_path / "phone.jpg", 16)[None], weights)[0]
    assert res["answer"]["confidence"] == pytest.approx(ref.max(), abs=1e-5)


def test_service_turns_bad_files_into_reasons(service, tmp_path, monkeypatch, caplog):
    import leaflens.data_prep.decode as decode

    monkeypatch.setattr(decode, "_register_heif", lambda: False)  # as without pillow-heif
    write_photo(tmp_path / "good.jpg", seed=1)
    whole = write_photo(tmp_path / "whole.jpg", (200, 150), seed=2).read_bytes()
    (tmp_path / "notes.txt").write_text("not a photo")
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "iphone.heic").write_bytes(b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + b"\0" * 64)
    (tmp_path / "huge.png").write_bytes(b"\x89PNG" + bytes(60_000))  # over the 0.05 MB limit
    names = ["notes.txt", "empty.jpg", "cut.jpg", "iphone.heic", "huge.png"]
    with caplog.at_level(logging.INFO, logger="leaflens.serve"):
        res = service.diagnose([tmp_path / "good.jpg", *[tmp_path / n for n in names[:3]]])
        res2 = service.diagnose([tmp_path / n for n in names[3:]])
    reasons = {p["name"]: p["error"]["reason"] for p in res["photos"] + res2["photos"] if not p["ok"]}
    assert reasons == {"notes.txt": "not_an_image", "empty.jpg": "empty", "cut.jpg": "truncated",
                       "iphone.heic": "heic_unsupported", "huge.png": "file_too_big"}
    assert res["answer"]["photos_used"] == 1 and res2["answer"] is None
    assert "pillow-heif" in res2["photos"][0]["error"]["message"]
    assert str(tmp_path) not in json.dumps(res2)  # server paths never go back to the client
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("diagnose")]
    assert len(lines) == 2 and "server_ms=" in lines[0] and "photos=4 ok=1 failed=3" in lines[0]


def test_service_caps_photos_per_request(service, tmp_path):
    paths = [write_photo(tmp_path / f"p{i}.png", seed=i) for i in range(6)]
    res = service.diagnose(paths)
    assert len(res["photos"]) == 4 and res["given"] == 6
    assert res["not_used"] == ["p4.png", "p5.png"]  # named: the person knows which to send again
    assert "Only the first 4 photos were used (6 were given). Not used: p4\\.png, p5\\.png;" in render(
        res, "en", max_photos=4)[1]
    assert "张）。未使用：p4\\.png、p5\\.png" in render(res, "zh", max_photos=4)[1]  # no space in Chinese


def test_service_unexpected_failure_costs_one_photo(service, tmp_path, monkeypatch):
    real = service.predictor.decode

    def flaky(src):
        if Path(src).name == "bad.png":
            raise RuntimeError("boom")
        return real(src)

    monkeypatch.setattr(service.predictor, "decode", flaky)
    res = service.diagnose([write_photo(tmp_path / "bad.png"), write_photo(tmp_path / "ok.png", seed=2)])
    assert res["photos"][0]["error"]["reason"] == "internal" and res["photos"][1]["ok"]
    assert "boom" not in render(res, "en")[3]  # the page gets a plain message, the log the details


def test_service_verdicts_are_the_predictors_own(tiny_model, tmp_path):
    """With a model that has the out-of-domain output, each photo's verdict and score are Predictor.judge's."""
    from leaflens.apps.predictor import Predictor
    from leaflens.apps.service import DiagnosisService, ServiceOptions

    path, weights = tiny_model(classes=CLASSES, size=16, seed=2, ood_threshold=-0.1,
                               **{"leaflens.uncertain_threshold": "0.8"})
    predictor = Predictor(path, intra_op_threads=1)
    files = [write_leaf(tmp_path / f"leaf{i}.png", (64, 48), seed=i) for i in range(8)]
    files += [write_grey_noise(tmp_path / "grey.png"), write_digit(tmp_path / "digit.png")]
    Image.new("RGB", (1, 1), (90, 140, 60)).save(tmp_path / "dot.png")
    Image.new("RGB", (80, 60), (90, 140, 60)).save(tmp_path / "flat.png")
    (tmp_path / "cut.png").write_bytes(files[0].read_bytes()[:200])
    files += [tmp_path / "dot.png", tmp_path / "flat.png", tmp_path / "cut.png"]
    with DiagnosisService(predictor, NOTES, ServiceOptions(max_photos=16, max_wait_ms=1)) as svc:
        res = svc.diagnose(files)
    expected = predictor.predict_files(files)
    for photo, want in zip(res["photos"], expected):
        if want.ok:
            assert (photo["verdict"], photo["ood_score"]) == (want.verdict, pytest.approx(want.ood_score, abs=1e-6))
            pixels = decode_image(tmp_path / photo["name"], 16)[None]  # and the reference network agrees
            assert photo["ood_score"] == pytest.approx(float(reference_ood(pixels)[0]), abs=1e-5)
            if want.verdict != "out_of_domain":
                assert photo["label"] == want.label and photo["confidence"] == pytest.approx(want.confidence)
        else:
            assert photo["error"]["reason"] == want.reason and not photo["ok"]
    verdicts = {p["name"]: p["verdict"] for p in res["photos"]}
    assert {verdicts[n] for n in ("grey.png", "digit.png")} == {"out_of_domain"}
    assert (verdicts["dot.png"], verdicts["flat.png"], verdicts["cut.png"]) == ("refused", "refused", "error")
    assert {"diagnosis", "ambiguous"} <= set(verdicts.values())  # the leaves cover both (precondition)
    answer = res["answer"]
    assert answer["left_out"] == ["grey.png", "digit.png"] and res["ood_threshold"] == -0.1
    # they agree when a class is every photo's claim: a diagnosed photo's class, either of an unsure one's two
    claims = [set(p["candidates"]) if p["verdict"] == "ambiguous" else {p["label"]}
              for p in res["photos"] if p["verdict"] in ("diagnosis", "ambiguous")]
    shared = set.intersection(*claims)
    assert res["verdict"] == answer["verdict"]
    if not shared:
        assert answer["verdict"] == "disagree"
    else:
        assert answer["verdict"] == "disagree" or answer["label"] in shared
