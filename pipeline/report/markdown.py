"""``report.md``: the short human report of a distill run, written from the same dict as report.json.

The report dict (what ``leaflens.pipeline.distill`` puts in report.json); every key is optional except where
noted, and a missing one is written as "not recorded" rather than failing the report:

- ``run_id``: str
- ``winner`` (or ``kept``): "distilled", "scratch" or "teacher", the model the run keeps (chosen on validation
  within the serving budget), or "<member>/distilled" / "<member>/scratch" in a run of several student family
  members; ``best_student``: the better student when the teacher is kept
- ``selection``: :class:`leaflens.pipeline.selection.Selection` as a dict (every candidate's accuracy, size and
  latency, the budget, and why the kept one was kept); the "Kept model" section is left out when absent
- ``variants`` (or ``candidates``): {"distilled": {"val_accuracy", "test_accuracy", "best_epoch",
  "epochs_run", "centre_crop", "val_by_crop", "crop_choice", "test_accuracy_whole"}, "scratch": {...}}; one
  entry when only one student was trained (``--no-teacher``); the accuracies are at the student's centre crop
  (None: the whole photo), chosen on ``val_by_crop`` (share -> validation accuracy, "1" the whole photo) by the
  rule of leaflens.pipeline.centre_crop (``crop_choice``: its :class:`CropChoice` record, ``why`` in words)
- ``val_accuracy``, ``test_accuracy``, ``params``, ``train_seconds``: of the kept model (report.json's
  required figures)
- ``test``: :func:`leaflens.pipeline.report.metrics.evaluation_summary` of the kept model on the test split (accuracy
  and its confidence interval, per-class precision/recall/F1, confusion matrix, ECE)
- ``threshold_choice`` (or ``uncertain``): :func:`leaflens.pipeline.report.metrics.choose_uncertain_threshold`'s result;
  ``uncertain_threshold`` alone (a float) is shown when the choice details are absent
- ``hardware``: :func:`leaflens.pipeline.hardware.describe_hardware`'s result
- ``teacher``: the teacher's identity (teacher.json's ``teacher`` entry)
- ``teacher_online``: with ``distill.teacher_online``, the teacher in the loop's backend, input and stored sizes and
  ``val_accuracy_at_stored_pixels``
- ``trunk_init``: with a Lite0-trunk student, where the distilled students' stem and blocks started (``asked``,
  ``used``: "imagenet" or "teacher", ``why`` the teacher's could not be used)
- ``freeze_bn``: with ``train.freeze_bn``, the students whose stem and blocks kept their pretrained BatchNorm
  statistics (the pretrained ones; an empty list: none was)
- ``config``: the run's recipe (``StageConfig.to_dict()``); ``train.ema`` above 0 is named (every student's
  validation and ``best.npz`` weights were a running average of its steps)
- ``escalation``: with ``model.escalate``, the teacher's validation accuracy, the margin and, per larger member
  weighed, the best student's validation accuracy then, the teacher's lead, whether it was trained and why not
- ``epochs``, ``best_epoch``: ints (else taken from the kept variant's ``epochs_run``/``best_epoch``)
- ``data``: the dataset's ``data_report.json`` (:class:`leaflens.data_prep.data_report.DataReport`: duplicates,
  leakage, photos per class, the metadata shortcut check, warnings); the section is left out when absent

The figures (curves.png, confusion.png, hardest.png, feature_maps.png) are linked when they exist in the
run directory, so write them before the report.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from leaflens.apps.model_card import TIE_RATIO, flag_confidence
from leaflens.files import write_text_atomic

REPORT_MD = "report.md"
#: Figures of a run directory, in the order the report shows them.
FIGURES = (
    ("curves.png", "Training curves"),
    ("confusion.png", "Confusion matrix (test)"),
    ("hardest.png", "Hardest misclassified test images"),
    ("feature_maps.png", "First convolution feature maps"),
)
NO_GAIN = "distillation did not beat training from scratch on this data; the scratch model is kept"
_NAMED_COLUMNS_MAX = 10  # wider confusion tables number their columns instead of naming them


def _ood_calibration(ood: Mapping[str, Any]) -> str:
    """How the out-of-domain threshold was chosen: for genuine new photos with a confidence (recorded since the
    budget became theirs), or for the validation photos themselves (earlier runs)."""
    val, budget, flagged = ood.get("val_photos"), _float(ood.get("budget")), _float(ood.get("val_flagged"))
    if _float(ood.get("confidence")) is None or not isinstance(val, int) or budget is None or flagged is None:
        return (f"the threshold was chosen on the {val} validation photos to flag at most {_pct(budget)} of them, "
                f"and flags {_pct(flagged)}")
    achieved = flag_confidence(val, round(flagged * val), budget)
    return (f"the threshold was chosen on the {val} validation photos so that at most {_pct(budget)} of genuine "
            f"new photos are flagged, with {_pct(achieved)} confidence (it flags {_pct(flagged)} of the validation "
            "photos)")


def _pct(v: Any, digits: int = 1) -> str:
    try:
        return f"{100 * float(v):.{digits}f} %"
    except (TypeError, ValueError):
        return "not recorded"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _duration(seconds: Any) -> str:
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "not recorded"
    if s < 60:
        return f"{s:.1f} s"
    minutes, sec = divmod(int(round(s)), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]],
           align: Sequence[str] | None = None) -> list[str]:
    align = align or ["l"] + ["r"] * (len(header) - 1)
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _count(n: Any, noun: str) -> str:
    """"1 group", "3 groups"."""
    return f"{n} {noun}{'' if str(n) == '1' else 's'}"


def _float(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _kept(report: Mapping[str, Any]) -> Any:
    return report.get("winner") or report.get("kept")


def _candidates(report: Mapping[str, Any]) -> Mapping[str, Any]:
    return report.get("variants") or report.get("candidates") or {}


def _kept_section(report: Mapping[str, Any]) -> list[str]:
    """Every candidate's accuracy against size and latency, the budget, and why the kept one was kept."""
    sel = report.get("selection")
    if not isinstance(sel, Mapping):
        return []
    budget = sel.get("budget") or {}
    limits = [f"at most {int(budget['max_params']):,} parameters" if budget.get("max_params") else "any size",
              f"at most {float(budget['max_ms']):g} ms per photo" if budget.get("max_ms") else "any latency"]
    timing = sel.get("timing") or {}
    warned = [f"**Warning:** {_cell(w)}." for w in report.get("warnings") or []]  # e.g. no better than chance
    for resumed in report.get("resumed_with_changes") or []:  # the epochs before it ran with the old settings
        changed = ", ".join(f"`{k}` {_cell(str(v[0]))} -> {_cell(str(v[1]))}"
                            for k, v in (resumed.get("changed") or {}).items())
        warned.append(f"**Resumed** ({_cell(str(resumed.get('time', '?')))}) with changed settings: {changed}; "
                      "the epochs trained before it used the earlier ones.")
    lines = ["## Kept model", "", *warned, *([""] if warned else []),
             f"**{sel.get('kept')}** is kept: {sel.get('why', 'no reason recorded')}.", "",
             f"Serving budget: {', '.join(limits)}; the teacher must gain at least "
             f"{100 * float(budget.get('teacher_margin', 0)):g} points of validation accuracy over the best student. "
             f"Latency: median milliseconds per photo at batch 1 on this machine ({timing.get('backend', '?')}, "
             f"{timing.get('threads', '?')} threads; "
             + (f"as served: {timing['served_as']}" if timing.get("served_as") else "the network alone")
             + ", without decoding the photo).", ""]
    rows = []
    cands = sel.get("candidates") or []
    # a family run (several student members): say what each student is (widths, input size)
    family = len({c.get("member") for c in cands if c.get("kind") == "student"}) > 1
    for c in cands:
        params = c.get("params")
        ms = _float(c.get("ms_per_photo"))
        arch = [c.get("architecture") or ("EfficientNet-Lite0" if c.get("kind") == "teacher" else "")] if family else []
        rows.append([c.get("name"), *arch, _pct(c.get("val_accuracy")), _pct(c.get("test_accuracy")),
                     f"{int(params):,}" if isinstance(params, (int, float)) else "not recorded",
                     "not measured" if ms is None else f"{ms:.2f}", "yes" if c.get("within_budget") else "no",
                     ("**kept**: " if c.get("kept") else "") + str(c.get("why", ""))])
    lines += _table(["candidate", *(["network"] if family else []), "val accuracy", "test accuracy", "parameters",
                     "ms per photo", "within budget", "kept / why not"],
                    rows, ["l", *(["l"] if family else []), "r", "r", "r", "r", "l", "l"])
    if sel.get("teacher_unavailable"):
        lines += ["", f"The teacher was not a candidate: {sel['teacher_unavailable']}"]
    return lines + _escalation_lines(report) + [""]


def _escalation_lines(report: Mapping[str, Any]) -> list[str]:
    """Which larger students (``model.escalate``) were trained because the teacher led, and which were not."""
    esc = report.get("escalation")
    if not isinstance(esc, Mapping) or not esc.get("steps"):
        return []
    teacher = _pct(esc.get("teacher_val_accuracy"))
    lines = ["", f"Larger students (model.escalate), each tried while the teacher ({teacher} on validation) led "
                 f"every student so far by {100 * float(esc.get('margin') or 0):g} points or more:"]
    for step in esc["steps"]:
        lead = _float(step.get("teacher_lead"))
        done = "trained" if step.get("trained") else f"not trained: {step.get('why', 'no reason recorded')}"
        lines.append(f"- {step.get('member')}: best student then {_pct(step.get('best_student_val'))}, teacher lead "
                     f"{'?' if lead is None else f'{100 * lead:.1f}'} points; {done}")
    return lines


def _winner_section(report: Mapping[str, Any]) -> list[str]:
    """Distilled against scratch; in a family run, the two students of the best student's member."""
    cands = _candidates(report)
    kept = _kept(report)
    teacher_kept = kept == "teacher"
    if teacher_kept:
        kept = report.get("best_student")
    member = str(kept or "")[:str(kept or "").rfind("/") + 1]  # "m/" in a family run, else ""
    kept = kept[len(member):] if isinstance(kept, str) else kept
    d_val = _float((cands.get(member + "distilled") or {}).get("val_accuracy"))
    s_val = _float((cands.get(member + "scratch") or {}).get("val_accuracy"))
    lines = ["## Distilled or scratch", ""]
    if member:
        lines += [f"The two students of family member {member[:-1]}, the best student's (every member is in the "
                  "table above):", ""]
    if d_val is not None and s_val is not None:
        if kept not in ("distilled", "scratch"):
            kept = "distilled" if d_val > s_val else "scratch"
        gap = 100 * (d_val - s_val)
        if teacher_kept:
            lines.append(f"The better student is the **{kept}** one ({_pct(d_val)} validation accuracy distilled, "
                         f"{_pct(s_val)} from scratch, {gap:+.1f} points); the run keeps the teacher (above).")
        elif kept == "distilled":
            lines.append(f"**The distilled student is kept**: {_pct(d_val)} validation accuracy against "
                         f"{_pct(s_val)} for the same student trained from scratch ({gap:+.1f} points).")
        else:
            lines.append(f"**Result:** {NO_GAIN} (validation accuracy {_pct(s_val)} from scratch, "
                         f"{_pct(d_val)} distilled, {gap:+.1f} points).")
        lines += _photos_learned_from(report)
        lines.append("")
        rows = []
        for name in ("distilled", "scratch"):
            c = cands.get(member + name) or {}
            mark = (" (better)" if teacher_kept else " (kept)") if name == kept else ""
            rows.append([member + name + mark, _pct(c.get("val_accuracy")),
                         _pct(c.get("test_accuracy"))])
        lines += _table(["student", "val accuracy", "test accuracy"], rows)
    elif s_val is not None or kept == "scratch":
        lines.append("Only the scratch student was trained (no teacher): the gain from distillation was "
                     "not measured on this run.")
    elif d_val is not None or kept == "distilled":
        lines.append("Only the distilled student was trained: there is no scratch baseline in this run, "
                     "so the gain from distillation was not measured.")
    else:
        lines.append("No comparison recorded.")
    return lines + [""]


def _crop_section(report: Mapping[str, Any]) -> list[str]:
    """Each student's validation accuracy on the whole photo and on its centre crops, and the crop it keeps."""
    rows = []
    shares: list[str] = []
    for name, c in _candidates(report).items():
        by_crop = c.get("val_by_crop") if isinstance(c, Mapping) else None
        if not isinstance(by_crop, Mapping) or len(by_crop) < 2:
            continue
        shares += [k for k in by_crop if k not in shares]
        crop = _float(c.get("centre_crop"))
        whole, test = _float(c.get("test_accuracy_whole")), _float(c.get("test_accuracy"))
        choice = c.get("crop_choice")
        why = choice.get("why", "") if isinstance(choice, Mapping) else ""
        rows.append((name, by_crop, "whole photo" if crop is None else f"centre {crop:g}",
                     "" if whole is None or test is None else f"{_pct(whole)} -> {_pct(test)}", why))
    if not rows:
        return []
    lines = ["## Centre crop", "",
             "Each student was scored on the validation photos whole (1) and on the centre square of a share of "
             "each photo's side (distill.centre_crops). The best crop replaces the whole photo only when it is "
             "right on significantly more validation photos (sign test on the photos where the two differ, 5 % "
             "shared by the crops tried). Its validation and test figures above, the answer thresholds and the "
             "export use what it keeps; test accuracy on the whole photo is shown for comparison, not used.", ""]
    table = [[name, *(_pct(by_crop.get(k)) if k in by_crop else "-" for k in shares), chosen, test, why]
             for name, by_crop, chosen, test, why in rows]
    return lines + _table(["student", *(f"val at {k}" for k in shares), "kept", "test: whole -> kept", "why"],
                          table, ["l", *(["r"] * len(shares)), "l", "r", "l"]) + [""]


def _photos_learned_from(report: Mapping[str, Any]) -> list[str]:
    """What each student saw: unlabelled photos are where distillation can pay, so say how many there were."""
    counts = (report.get("dataset") or {}).get("counts") or {}
    labelled, unlabelled = counts.get("train"), counts.get("unlabeled") or 0
    if labelled is None:
        return []
    if not unlabelled:
        said = [f"Both students learned from the same {labelled:,} labelled training photos; there were no "
                "unlabelled photos, which is where a teacher helps most."]
    else:
        taught = ("the teacher's features only: it gives no answers to stand in for the withheld labels"
                  if report.get("teacher_has_logits") is False
                  else "the teacher's answers standing in for the withheld labels")
        said = [f"The distilled student learned from {labelled:,} labelled and {unlabelled:,} unlabelled photos "
                f"({taught}); the scratch student from the {labelled:,} labelled ones only."]
    return said


def _accuracy_section(report: Mapping[str, Any]) -> list[str]:
    test = report.get("test") or {}
    lines = ["## Accuracy", ""]
    if "accuracy" in test and "accuracy_ci" in test:
        lo, hi = test["accuracy_ci"]
        level = int(round(100 * float(test.get("ci_level", 0.95))))
        lines.append(f"- Test accuracy: **{_pct(test['accuracy'])}** ({test.get('correct', '?')} of "
                     f"{test.get('n', '?')}; {level} % confidence interval {_pct(lo)} to {_pct(hi)}, Wilson)")
    else:
        lines.append(f"- Test accuracy: **{_pct(report.get('test_accuracy'))}** "
                     "(no confidence interval recorded)")
    lines.append(f"- Validation accuracy: {_pct(report.get('val_accuracy'))}")
    if "macro_f1" in test:
        lines.append(f"- Macro F1 (test): {float(test['macro_f1']):.3f}")
    if "ece" in test:
        cal = report.get("calibration") or {}
        temperature, before = _float(cal.get("temperature")), _float(cal.get("test_ece_uncalibrated"))
        how = (f" with the probabilities calibrated on validation (logits / {temperature:.3f})"
               + (f"; {before:.3f} before" if before is not None else "")
               if temperature is not None and temperature != 1.0 else
               f"; the probabilities are not calibrated ({cal['not_fitted']})" if cal.get("not_fitted") else "")
        lines.append(f"- Expected calibration error (test, {len(test.get('calibration', [])) or 15} bins): "
                     f"{float(test['ece']):.3f}{how}")
    unc = report.get("threshold_choice") or report.get("uncertain") or {}
    if "threshold" not in unc and _float(report.get("uncertain_threshold")) is not None:
        lines.append(f"- \"Uncertain\" below a top probability of {float(report['uncertain_threshold']):.3f}")
    if "threshold" in unc:
        cap = _float(unc.get("max_flagged"))
        capped = "" if cap is None else f" while leaving at most {_pct(cap)} of them unanswered"
        how = {"target": f"chosen on validation to keep {_pct(unc.get('target'), 0)} accuracy{capped}",
               "best_effort": f"the {_pct(unc.get('target'), 0)} target was not reachable on validation{capped}",
               "budget": (f"the least confident {_pct(1 - float(unc['coverage']))} of the validation photos "
                          f"(budget {_pct(unc.get('max_flagged'))}{_budget_words(unc)})"
                          if _float(unc.get("coverage")) is not None
                          else f"the least confident {_pct(unc.get('max_flagged'))} of the validation photos"),
               "default": "default: too few validation images to choose one"}.get(str(unc.get("method")), "")
        lines.append(f"- \"Ambiguous\" below a top probability of {float(unc['threshold']):.3f} ({how}; on "
                     f"validation it keeps {_pct(unc.get('coverage'))} of the images at "
                     f"{_pct(unc.get('accuracy'))} accuracy), and whenever the second class has at least "
                     f"{TIE_RATIO:.0%} of the first's probability (a near tie)"
                     + (f"; with both rules, as served, it answers {_pct(unc['answered'])} of the validation "
                        f"images at {_pct(unc.get('answered_accuracy'))} accuracy"
                        if _float(unc.get("answered")) is not None else ""))
    lines += _out_of_domain_lines(report.get("out_of_domain") or {})
    return lines + [""]


def _budget_words(unc: Mapping[str, Any]) -> str:
    """What the "ambiguous" budget came to on a validation split too small for its share of one photo."""
    n, kept, cap = unc.get("n_val"), unc.get("kept"), _float(unc.get("max_flagged"))
    if n is None or kept is None or cap is None or cap * int(n) >= 1:
        return ""
    if kept == n:
        return f": none of the {int(n)} here, too few for that share"
    return f", at least one: {int(n) - int(kept)} of the {int(n)} here"


def _out_of_domain_lines(ood: Mapping[str, Any]) -> list[str]:
    """How the "not a photo this model knows" threshold was chosen and what it costs on validation."""
    if not ood:
        return []
    if not ood.get("fitted"):
        return [f"- Out-of-domain check: not fitted ({ood.get('reason', 'no reason recorded')})"]
    line = (f"- Out-of-domain check ({ood.get('method')}): a photo whose score is above "
            f"{float(ood['threshold']):.3f} is answered \"not a photo this model knows\". The score is the "
            f"distance of the model's feature-map statistics{_branch_words(ood.get('branch'))} from the "
            f"{ood.get('train_photos')} training photos; {_ood_calibration(ood)}")
    if _float(ood.get("val_ambiguous")) is not None:
        line += (f"; the \"ambiguous\" rule (its threshold and near ties) leaves {_pct(ood.get('val_ambiguous'))} "
                 "of validation photos unanswered (a photo may be counted by both)")
    return [line] + ([f"- Note: {ood['note']}"] if ood.get("note") else [])


def _branch_words(branch: Any) -> str:
    """The generic-feature branch the score also reads (pipeline/ood.py), in words; "" without one."""
    if not isinstance(branch, Mapping):
        return ""
    return (f" and those of the first {branch.get('blocks')} blocks of ImageNet EfficientNet-Lite0 (frozen, "
            f"{branch.get('params')} parameters, from {branch.get('weights')})")


def _per_class_section(test: Mapping[str, Any]) -> list[str]:
    per_class = test.get("per_class") or []
    if not per_class:
        return ["## Per class (test)", "", "Not recorded.", ""]
    cm = test.get("confusion_matrix")
    predicted = ([sum(int(row[j]) for row in cm) for j in range(len(per_class))]
                 if isinstance(cm, list) and all(isinstance(r, list) and len(r) == len(per_class) for r in cm)
                 else None)

    def row(i: int, c: Mapping[str, Any]) -> list[Any]:
        if int(c["support"]):
            return [c.get("class", i), f"{c['precision']:.3f}", f"{c['recall']:.3f}", f"{c['f1']:.3f}", c["support"]]
        # no test photo of the class: recall and F1 have nothing to count; precision only if it was predicted
        said = predicted is not None and predicted[i] > 0
        return [c.get("class", i), f"{c['precision']:.3f}" if said else "n/a", "n/a", "n/a", 0]

    rows = [row(i, c) for i, c in enumerate(per_class)]
    if "macro_f1" in test:
        rows.append(["*macro mean*", f"{test.get('macro_precision', 0):.3f}",
                     f"{test.get('macro_recall', 0):.3f}", f"{test['macro_f1']:.3f}",
                     sum(int(c["support"]) for c in per_class)])
    table = _table(["class", "precision", "recall", "F1", "support"], rows)
    return ["## Per class (test)", ""] + table + [""]


def _confusion_section(test: Mapping[str, Any]) -> list[str]:
    cm = test.get("confusion_matrix")
    per_class = test.get("per_class") or []
    classes = list(test.get("classes") or [c.get("class", str(i)) for i, c in enumerate(per_class)])
    if not cm:
        return ["## Confusion matrix (test)", "", "Not recorded.", ""]
    if len(classes) != len(cm):
        classes = [str(i) for i in range(len(cm))]
    lines = ["## Confusion matrix (test)", "", "Rows: true class; columns: predicted class.", ""]
    if len(classes) <= _NAMED_COLUMNS_MAX:
        cols = classes
    else:
        cols = [str(i) for i in range(len(classes))]
        lines[-2] = "Rows: true class (numbered); columns: predicted class, by the same numbers."
    rows = [[(f"{i}. " if len(classes) > _NAMED_COLUMNS_MAX else "") + name, *row]
            for i, (name, row) in enumerate(zip(classes, cm))]
    return lines + _table(["true \\ predicted", *cols], rows) + [""]


def _facts_section(report: Mapping[str, Any]) -> list[str]:
    hw = report.get("hardware") or {}
    params = report.get("params")
    params_text = f"{int(params):,}" if isinstance(params, (int, float)) else "not recorded"
    lines = ["## Model and run", "",
             f"- Parameters (inference model): {params_text}",
             f"- Training time: {_duration(report.get('train_seconds'))}"]
    also = (report.get("dataset") or {}).get("also") or {}
    if also.get("counts"):
        per = ", ".join(f"{n:,} {s}" for s, n in also["counts"].items())
        lines.append(f"- Photos from `preprocess --also` ({', '.join(map(_cell, also.get('folders') or []))}: "
                     f"the web app's corrections, or other extra photos): {per}")
    kept_variant = _candidates(report).get(_kept(report)) or {}
    epochs = report.get("epochs", kept_variant.get("epochs_run"))
    if epochs is not None:
        best_epoch = report.get("best_epoch", kept_variant.get("best_epoch"))
        best = f", best on validation at epoch {best_epoch}" if best_epoch is not None else ""
        lines.append(f"- Epochs ({_kept(report) or 'kept'} student): {epochs}{best}")
    teacher = report.get("teacher")
    if isinstance(teacher, Mapping):
        shown = {k: teacher[k] for k in ("kind", "name", "fine_tuned", "params") if k in teacher}
        if teacher.get("weights"):
            shown["weights"] = Path(str(teacher["weights"])).name
        if teacher.get("path"):  # an ONNX encoder or features file: which one, and its content
            shown["file"] = f"`{Path(str(teacher['path'])).name}`"
        if teacher.get("sha256"):
            shown["sha256"] = str(teacher["sha256"]).removeprefix("sha256:")[:12]
        described = ", ".join(f"{k} {v}" for k, v in shown.items())
        lines.append(f"- Teacher: {described or 'recorded in report.json'}")
    elif teacher:
        lines.append(f"- Teacher: {teacher}")
    online = report.get("teacher_online")
    if isinstance(online, Mapping):
        lines.append(f"- Teacher in the training loop ({online.get('backend')}): it judged each batch's own views, "
                     f"cut at {online.get('input_size')} px from the stored {online.get('stored_size')} px photos, "
                     f"where it is {_pct(online.get('val_accuracy_at_stored_pixels'))} right on validation")
    trunk = report.get("trunk_init")
    if isinstance(trunk, Mapping):
        if trunk.get("used") == "teacher":
            start = "the fine-tuned teacher's (model.trunk_init = \"teacher\")"
        elif trunk.get("why"):
            start = f"ImageNet EfficientNet-Lite0's, not the teacher's as asked: {trunk['why']}"
        else:
            start = "ImageNet EfficientNet-Lite0's"
        lines.append(f"- Pretrained students: the distilled ones' stem and blocks started from {start}; those trained "
                     "without the teacher from ImageNet's")
    frozen = report.get("freeze_bn")
    if isinstance(frozen, list):
        lines.append("- BatchNorm statistics (train.freeze_bn): " + (
            f"{', '.join(map(str, frozen))} kept their stem's and blocks' pretrained statistics while training"
            if frozen else "no student is pretrained, so every one learnt its own"))
    train = (report.get("config") or {}).get("train") or {}
    ema = _float(train.get("ema"))
    if ema:
        lines.append(f"- Weights (train.ema = {ema:g}): each student was validated, chosen and kept as a running "
                     "average of its training steps' weights, not its last step's")
    lines.append(f"- Hardware: {hw.get('summary') or 'not recorded'}")
    if report.get("leaflens_version"):  # runs before it was recorded have none
        lines.append(f"- Software: leaflens {report['leaflens_version']}")
    return lines + [""]


def _data_section(report: Mapping[str, Any]) -> list[str]:
    """What `leaflens preprocess` found in the photos (duplicates, leakage, imbalance, shortcuts) and its warnings."""
    data = report.get("data")
    if not isinstance(data, Mapping) or not data:
        return []
    lines = ["## Data checks (preprocess)", ""]
    if "error" in data:
        return lines + [f"The dataset's data report could not be read: {data['error']}", ""]
    balance = data.get("balance") or {}
    per_class = balance.get("per_class") or {}
    if per_class:
        ratio = balance.get("ratio")
        lines.append("- Photos per class: " + ", ".join(f"{_cell(c)} {n}" for c, n in per_class.items())
                     + (f" (largest/smallest {float(ratio):g})" if ratio is not None else " (a class has none)"))
    dup = data.get("duplicates") or {}
    if dup:
        leak = ", ".join(f"{k} {v}" for k, v in (dup.get("leakage") or {}).items()) or "none"
        colour = (f" and within {float(dup['colour_threshold']):g} grey levels in colour"
                  if _float(dup.get("colour_threshold")) is not None else "")
        lines.append(f"- Duplicates (exact, or within {dup.get('threshold', '?')} bits of a perceptual hash{colour}): "
                     f"{_count(dup.get('within_split', 0), 'group')} within a split, "
                     f"{dup.get('across_splits', 0)} across splits, "
                     f"{_count(dup.get('label_conflicts', 0), 'label conflict')}; photos with a copy in an earlier "
                     f"split: {leak}")
        if dup.get("look_alike_pairs"):
            lines.append(f"- Look-alikes (alike in grey shapes, not in colour; counted as different photos): "
                         f"{dup['look_alike_pairs']} pairs, listed in the dataset's data_report.json")
    shortcut = data.get("shortcut") or {}
    if shortcut.get("skipped"):
        lines.append(f"- Shortcut check: skipped ({shortcut['skipped']})")
    elif _float(shortcut.get("balanced_accuracy")) is not None:
        features = ", ".join(shortcut.get("features") or ()) or "the photos' metadata"
        lines.append(f"- Shortcut check: the metadata alone ({features}) predict the class with a balanced "
                     f"accuracy of {float(shortcut['balanced_accuracy']):.2f} (chance {float(shortcut['chance']):.2f}; "
                     f"a warning from {float(shortcut['warn_at']):.2f})")
    removed = data.get("removed") or []
    if data.get("dedupe"):
        unlabelled = len(data.get("unlabeled_copies") or [])
        lines.append(f"- `--dedupe` left out {len(removed)} photos"
                     + (f" and {unlabelled} unlabelled copies of validation or test photos" if unlabelled else "")
                     + " (listed in the dataset's data_report.json)")
    warnings = data.get("warnings") or []
    if warnings:
        lines += ["", "Warnings:", ""] + [f"- {_cell(w)}" for w in warnings]
    else:
        lines += ["", "No warning."]
    return lines + [""]


def _figures_section(run_dir: Path) -> list[str]:
    present = [(name, caption) for name, caption in FIGURES if (run_dir / name).is_file()]
    missing = [name for name, _ in FIGURES if not (run_dir / name).is_file()]
    lines = ["## Figures", ""]
    lines += [f"- [{caption}]({name})" for name, caption in present]
    lines.append("")
    for name, caption in present:
        lines += [f"![{caption}]({name})", ""]
    if missing:
        lines.append("Not produced in this run: " + ", ".join(missing) + ".")
        lines.append("")
    return lines


def render_report(run_dir: str | os.PathLike[str], report: Mapping[str, Any]) -> str:
    """The Markdown text of :func:`write_report` (figures are looked up in ``run_dir``)."""
    run_dir = Path(run_dir)
    # written inside the stage's temporary folder ("<out>.partial") before it is renamed into place
    run_id = report.get("run_id") or run_dir.name.removesuffix(".partial").removesuffix(".tmp")
    kept = _kept(report)
    head = [f"# leaflens run report: {run_id}", ""]
    if kept:
        what = "**teacher** (fine-tuned)" if kept == "teacher" else f"**{kept}** student"
        head += [f"Kept model: {what}. Test accuracy {_pct(report.get('test_accuracy'))}, "
                 f"validation accuracy {_pct(report.get('val_accuracy'))}.", ""]
    test = report.get("test") or {}
    parts = (head + _kept_section(report) + _winner_section(report) + _crop_section(report) + _accuracy_section(report)
             + _per_class_section(test)
             + _confusion_section(test) + _facts_section(report) + _data_section(report) + _figures_section(run_dir))
    return "\n".join(parts).rstrip() + "\n"


def write_report(run_dir: str | os.PathLike[str], report: Mapping[str, Any]) -> Path:
    """Write ``run_dir/report.md`` atomically (temporary file, then ``os.replace``) and return its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"write_report: run directory {run_dir} does not exist")
    return write_text_atomic(run_dir / REPORT_MD, render_report(run_dir, report))
