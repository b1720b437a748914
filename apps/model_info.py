"""What the app knows beyond the ONNX file: the training run, its dataset, the class notes.

``leaflens serve --model artifacts/export/student.onnx`` should need nothing else, so
:func:`discover` follows the artefacts' own records: the export folder's ``parity.json`` names the
run (``run.path``) and the dataset (``dataset.root``), found again after the project folder was moved or
renamed when the folder that takes their place is the same run (its ``run_id``) or the same dataset (its
manifest's SHA-256); the run's ``report.json`` holds the test
accuracy with its confidence interval, and ``curves.png`` / ``confusion.png`` sit beside it; the
dataset folder carries ``classes.toml``. Explicit ``--run`` / ``--dataset`` / ``--classes-notes``
win. Anything missing is reported as a warning and simply not shown.

:func:`model_markdown` writes the "Model" tab in plain words first: a banner when the model is the demo
trained on drawn leaves (:func:`demo_banner`, from the model card's ``trained_on``), which classes and crops
it knows (display names from the class notes; a class's ``crop`` note names its crop), what it was trained
on, how often it is right, and how reliable each class is in a sentence (:func:`reliability_lines`, from the
test split's confusion matrix in the run's ``report.json``: "Healthy is often mistaken for Leaf miner").
The numbers follow below the words: the file, run, accuracy with its interval, input size, how the two
thresholds behind the verdicts were chosen and what they cost on the validation photos (from the model card:
``uncertain_threshold`` and ``val_ambiguous``; ``ood``), or that the model has no out-of-domain check. This
module reads JSON only (no engine import).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leaflens.apps.corrections import size_text
from leaflens.apps.i18n import t
from leaflens.apps.model_card import TIE_RATIO
from leaflens.apps.notes import find_notes
from leaflens.files import find_moved

__all__ = ["EXPORT_REPORT", "RUN_REPORT", "ServeContext", "demo_banner", "discover", "model_markdown", "page_banner",
           "reliability_lines", "run_images"]

EXPORT_REPORT = "parity.json"  # written by `leaflens export` next to student.onnx
RUN_REPORT = "report.json"  # written by `leaflens distill` into the run folder
# Reliability in words: a class mistaken for one other class in at least OFTEN of its test photos is "often
# mistaken", from SOMETIMES on "sometimes"; with fewer than FEW test photos the sentence says it is unsure;
# an answer right in less than UNRELIABLE_SAID of the photos it was given to is named as such.
OFTEN, SOMETIMES, FEW, UNRELIABLE_SAID = 0.2, 0.05, 10, 0.8


@dataclass
class ServeContext:
    """The run folder and its report, the dataset folder and the notes file (each may be None)."""

    run_dir: Path | None = None
    run_report: dict[str, Any] | None = None
    dataset_root: Path | None = None
    notes_path: Path | None = None
    warnings: list[str] = field(default_factory=list)


def _read_json(path: Path, warnings: list[str]) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        warnings.append(f"{path}: cannot read ({exc}); ignored")
        return None
    if not isinstance(data, dict):
        warnings.append(f"{path}: not a JSON object; ignored")
        return None
    return data


def _get(data: dict[str, Any] | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _recorded_dir(recorded: Path, model_dir: Path, same: Callable[[Path], bool] | None = None) -> Path | None:
    """The folder a record names. A relative path (exports made before they were recorded absolute) was relative
    to the folder the export ran in, unknown now: it is looked up from here, then from the model's folder and each
    one above it (``artifacts/student`` from ``.../project/artifacts/export/``). An absolute path that is gone (the
    project was moved or renamed) is looked up the same way by its last parts (``artifacts/student`` of
    ``/old/project/artifacts/student``), taken only when ``same`` confirms it is the recorded folder. A folder
    that is there but is no longer the recorded one (the run trained again since the export) is not taken."""
    if recorded.is_dir():
        return recorded if same is None or same(recorded) else None
    if recorded.is_absolute():
        return find_moved(recorded, model_dir, same) if same is not None else None
    for base in (model_dir, *model_dir.parents):
        if (base / recorded).is_dir():
            return base / recorded
    return None


def _is_run(run_id: Any) -> Callable[[Path], bool] | None:
    """Whether a folder is the run ``run_id`` (its report.json says so); None without an id to compare."""
    if not isinstance(run_id, str) or not run_id:
        return None

    def same(folder: Path) -> bool:
        try:
            return json.loads((folder / RUN_REPORT).read_text(encoding="utf-8")).get("run_id") == run_id
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            return False
    return same


def _is_dataset(manifest_sha256: Any) -> Callable[[Path], bool] | None:
    """Whether a folder is the dataset whose manifest.json hashes to ``manifest_sha256``; None without one."""
    from leaflens.data_prep.manifest import is_dataset  # noqa: PLC0415

    return is_dataset(manifest_sha256)


def discover(model_path: str | os.PathLike, run_dir: str | os.PathLike | None = None,
             dataset_root: str | os.PathLike | None = None,
             notes_path: str | os.PathLike | None = None) -> ServeContext:
    """Find the run, dataset and notes belonging to ``model_path`` (explicit arguments win).

    An explicit path that does not exist raises ``FileNotFoundError`` naming it; what is only
    inferred and missing becomes a warning in ``ServeContext.warnings``.
    """
    ctx = ServeContext()
    model_dir = Path(model_path).resolve().parent
    for given, what, want_dir in ((run_dir, "--run", True), (dataset_root, "--dataset", True),
                                  (notes_path, "--classes-notes", False)):
        if given is not None and not (Path(given).is_dir() if want_dir else Path(given).is_file()):
            raise FileNotFoundError(f"{what} {os.fspath(given)}: no such {'folder' if want_dir else 'file'}")
    export = _read_json(model_dir / EXPORT_REPORT, ctx.warnings) if (model_dir / EXPORT_REPORT).is_file() else None

    if run_dir is not None:
        ctx.run_dir = Path(run_dir)
    elif _get(export, "run", "path"):
        recorded = Path(_get(export, "run", "path")).parent
        same_run = _is_run(_get(export, "run", "id"))
        guess = _recorded_dir(recorded, model_dir, same_run)
        if guess is not None:
            ctx.run_dir = guess
        elif recorded.is_dir() and same_run is not None and same_run(recorded.parent):
            # `export --run RUN/scratch`: one student of a run, whose report is the kept model's, not this one's
            ctx.warnings.append(f"{model_dir / EXPORT_REPORT} names {recorded}, one student ({recorded.name}) of the "
                                f"run in {recorded.parent}: that run's figures and plots are those of the model it "
                                "kept, so none are shown for this one")
        elif recorded.is_dir():
            ctx.warnings.append(f"{model_dir / EXPORT_REPORT} names run folder {recorded}, which now holds another "
                                "run (trained again since this export): its figures and plots are not shown; "
                                "export the new run, or pass --run")
        else:
            ctx.warnings.append(f"{model_dir / EXPORT_REPORT} names run folder {recorded}, which is gone")
    if ctx.run_dir is not None:
        report_path = ctx.run_dir / RUN_REPORT
        if report_path.is_file():
            ctx.run_report = _read_json(report_path, ctx.warnings)
        else:
            ctx.warnings.append(f"{report_path} not found: no accuracy or plots in the Model tab")

    if dataset_root is not None:
        ctx.dataset_root = Path(dataset_root)
    else:
        for record in (_get(export, "dataset"), _get(ctx.run_report, "dataset")):
            recorded = _get(record, "root")
            found = (_recorded_dir(Path(recorded), model_dir, _is_dataset(_get(record, "manifest_sha256")))
                     if recorded else None)
            if found is not None:
                ctx.dataset_root = found
                break

    if notes_path is not None:
        ctx.notes_path = Path(notes_path)
    else:
        ctx.notes_path = find_notes([model_dir, ctx.run_dir, ctx.dataset_root])
    return ctx


def _kept_teacher(ctx: ServeContext) -> bool:
    """Whether the run shipped its fine-tuned teacher (under the student's file name) rather than a student."""
    return (ctx.run_report or {}).get("winner") == "teacher"


def run_images(ctx: ServeContext) -> dict[str, Path]:
    """The run's ``confusion.png`` and ``curves.png`` that exist, keyed "confusion" / "curves". A run that kept
    its teacher has no curves of the served model (``curves.png`` is its students' training; the confusion
    matrix is the teacher's): they are left out rather than shown beside a model they do not describe."""
    if ctx.run_dir is None:
        return {}
    found = {key: ctx.run_dir / f"{key}.png" for key in ("confusion", *(() if _kept_teacher(ctx) else ("curves",)))}
    return {key: path for key, path in found.items() if path.is_file()}


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _report_is_this_file(card: Any, report: dict[str, Any] | None) -> bool:
    """Whether the run's test figures are the served file's: the file's own test accuracy (when it records one)
    is the run's. Not so for the FP16 and INT8 files of an export, which are measured on their own (files
    exported since say so, ``leaflens.precision``; this is how older ones are told)."""
    own = card.accuracy
    test = _get(report, "test")
    ran = test.get("accuracy") if isinstance(test, dict) else None
    ran = ran if ran is not None else _get(report, "test_accuracy")
    return own is None or ran is None or abs(float(own) - float(ran)) < 1e-6


def _accuracy_line(card: Any, report: dict[str, Any] | None, lang: str) -> str:
    test = _get(report, "test")
    if isinstance(test, dict) and test.get("accuracy") is not None and test.get("accuracy_ci"):
        lo, hi = test["accuracy_ci"]
        return t("m_accuracy_ci", lang, acc=_pct(test["accuracy"]), level=f"{test.get('ci_level', 0.95):.0%}",
                 lo=_pct(lo), hi=_pct(hi), n=test.get("n", "?"))
    acc = _get(report, "test_accuracy")
    acc = acc if acc is not None else card.accuracy
    return _pct(acc) if acc is not None else t("m_accuracy_unknown", lang)


def _threshold_line(card: Any, lang: str) -> str:
    """When the answer is "unsure between two classes", how that was chosen and what it costs."""
    below = t("m_threshold_below", lang, threshold=f"{card.uncertain_threshold:.2f}", tie=f"{TIE_RATIO:.0%}")
    calibrated = ([t("m_calibrated", lang, temperature=f"{card.temperature:.3g}")]
                  if getattr(card, "temperature", None) is not None else [])
    if not card.threshold_from_model:
        return t("m_sep", lang).join([f"{below} {t('m_threshold_default', lang)}", *calibrated])
    parts = [below, t("m_threshold_how", lang)]
    if card.val_ambiguous is not None:
        key = "m_threshold_cost" if card.tie_ratio is not None else "m_threshold_cost_threshold_only"
        parts.append(t(key, lang, share=_pct(card.val_ambiguous)))
    return t("m_sep", lang).join([*parts, *calibrated])


def _ood_line(card: Any, lang: str) -> str:
    """How the out-of-domain check judges a photo and what it costs on validation, or that there is none."""
    ood = card.ood
    if ood is None:
        return t("m_ood_none", lang)
    branch = "" if ood.branch is None else t("m_ood_branch", lang, blocks=ood.branch.blocks)
    if ood.confidence is None:  # exported when the budget was the validation photos' own share
        calibration = t("m_ood_calibration_val", lang, val=f"{ood.val_photos:,}", budget=_pct(ood.budget),
                        flagged=_pct(ood.val_flagged))
    else:
        calibration = t("m_ood_calibration", lang, val=f"{ood.val_photos:,}", budget=_pct(ood.budget),
                        confidence=_pct(ood.achieved_confidence), flagged=_pct(ood.val_flagged))
    return t("m_ood_value", lang, threshold=f"{ood.threshold:.3g}", method=f"`{ood.method}`", branch=branch,
             train=f"{ood.train_photos:,}", calibration=calibration)


def demo_banner(card: Any, lang: str) -> str:
    """The "demo model" banner (Markdown) when the model was trained on drawn leaves, else ""."""
    trained = getattr(card, "trained_on", None)
    return t("m_demo_banner", lang) if trained is not None and trained.synthetic else ""


def page_banner(card: Any, ctx: ServeContext, lang: str) -> str:
    """What the page says above everything about the model's answers (Markdown, "" for none): the demo banner,
    and a model whose run found it no better than guessing on validation (report.json's
    ``no_better_than_chance``, leaflens.pipeline.chance)."""
    said = [demo_banner(card, lang)]
    if _get(ctx.run_report, "no_better_than_chance") is True:
        said.append(t("m_chance_banner", lang))
    return "\n\n".join(s for s in said if s)


def _names(classes: Sequence[str], notes: Any, lang: str) -> list[str]:
    return [notes.name(c, lang) if notes is not None else c for c in classes]


def _crops(card: Any, notes: Any, lang: str) -> str:
    """The crops the classes belong to, from each class's ``crop`` note; what is known otherwise."""
    trained = getattr(card, "trained_on", None)
    if trained is not None and trained.synthetic:
        return t("m_crops_synthetic", lang)
    crops: list[str] = []
    for c in card.classes:
        crop = notes.text(c, "crop", lang) if notes is not None else ""
        if crop and crop not in crops:
            crops.append(crop)
    return t("list_sep", lang).join(crops) if crops else t("m_crops_unknown", lang)


def _trained_on_line(card: Any, lang: str) -> str:
    trained = getattr(card, "trained_on", None)
    if trained is None:
        return t("m_trained_unrecorded", lang)
    line = t(f"m_trained_{trained.kind}", lang, n=f"{trained.photos:,}")
    if trained.train is not None and 0 < trained.train < trained.photos:  # the others chose and tested it
        line += t("m_trained_split", lang, train=f"{trained.train:,}", rest=f"{trained.photos - trained.train:,}")
    if trained.unlabeled:
        line += t("m_trained_unlabeled", lang, n=f"{trained.unlabeled:,}")
    return line


def _bold_list(names: Sequence[str], lang: str) -> str:
    """"**A**, **B** and **C**" (Chinese: "**A**、**B**、**C**": a CJK comma after a closing ** keeps the
    emphasis closed, where 和 would not)."""
    bold = [f"**{n}**" for n in names]
    if len(bold) < 2:
        return "".join(bold)
    return t("m_rel_sep", lang).join(bold[:-1]) + t("m_rel_last", lang) + bold[-1]


def _file_size(predictor: Any, lang: str) -> str:
    """What the served file weighs: the parameter count is the network's, and the out-of-domain check (its
    statistics, and the generic branch when there is one) is carried beside it in the same file."""
    try:
        size = predictor.model_path.stat().st_size
    except OSError:
        return ""
    return t("m_params_file" if predictor.card.ood is not None else "m_params_file_plain", lang, size=size_text(size))


def reliability_lines(report: dict[str, Any] | None, classes: Sequence[str], notes: Any, lang: str) -> list[str]:
    """One sentence per class on how reliable it is, from the test split's confusion matrix (rows: true class,
    columns: predicted) in the run's report; [] when the report has none that fits ``classes``.

    A class mistaken for one other class in at least 20 % of its test photos is "often mistaken" for it,
    from 5 % on "sometimes"; every sentence keeps the counts ("right 23 of 45 times"). An answer that is
    right in less than 80 % of the photos it was given to says so ("When it says Rust, it is right only ...").
    """
    test = _get(report, "test")
    cm_raw, order = _get(test, "confusion_matrix"), _get(test, "classes")
    order = list(order) if isinstance(order, list) else list(classes)
    try:
        cm = [[int(v) for v in row] for row in cm_raw]
    except (TypeError, ValueError):
        return []
    k = len(order)
    if k == 0 or len(cm) != k or any(len(row) != k for row in cm) or sorted(order) != sorted(classes):
        return []
    names = dict(zip(order, _names(order, notes, lang)))
    lines = []
    for i, c in enumerate(order):
        n, right = sum(cm[i]), cm[i][i]
        if n == 0:
            continue
        count = max((cm[i][j] for j in range(k) if j != i), default=0)
        # every class it is mistaken for that often, in the matrix's order: a tie names them all
        tied = [names[order[j]] for j in range(k) if j != i and count and cm[i][j] == count]
        values = {"name": names[c], "k": right, "n": n, "c": count, "other": tied[0] if tied else "",
                  "others": _bold_list(tied, lang)}
        suffix = "_tied" if len(tied) > 1 else ""
        if count and count / n >= OFTEN:
            line = t("m_rel_often" + suffix, lang, **values)
        elif count and count / n >= SOMETIMES:
            line = t("m_rel_sometimes" + suffix, lang, **values)
        else:
            line = t("m_rel_good", lang, **values)
        said = sum(cm[r][i] for r in range(k))
        if said and cm[i][i] / said < UNRELIABLE_SAID:
            line += " " + t("m_rel_said", lang, name=names[c], k=cm[i][i], n=said)
        if n < FEW:
            line += " " + t("m_rel_few", lang)
        lines.append(f"- {line}")
    return lines


def _framing_line(card: Any, lang: str) -> str:
    """How a photo is framed for the model: the resize rule and, when the model has one, its centre crop."""
    side = card.contract.shorter_side  # a served teacher's: the shorter side scaled to it, then the middle square
    framing = (t("m_resize_pad", lang) if card.resize != "crop" else t("m_resize_crop", lang) if side is None else
               t("m_resize_shorter", lang, side=side, size=card.contract.stored_size,
                 share=_pct(card.contract.stored_size / side)))
    crop = card.contract.centre_crop
    return framing if crop is None else t("m_resize_centre", lang, framing=framing, share=_pct(crop))


def model_markdown(predictor: Any, ctx: ServeContext, lang: str, notes: Any = None,
                   batching: tuple[int, float] | None = None) -> str:
    """The Model tab: in plain words first (the demo banner, classes with their display names, crops, what it
    was trained on, how often it is right, each class's reliability), then the numbers: file, run, classes
    (with their ids), accuracy with CI, input, the "unsure" threshold and the out-of-domain check (how chosen,
    cost on validation), provider, params."""
    card = predictor.card
    report = ctx.run_report
    params = card.params if card.params is not None else _get(report, "params")
    variant = card.precision is not None or not _report_is_this_file(card, report)
    if variant:
        # an FP16 or INT8 file holds its own test accuracy: the run's figures (accuracy, per-class results) are
        # those of the FP32 model it was made from, not of the file served
        report = {k: v for k, v in (report or {}).items() if k not in ("test", "test_accuracy")}
    names = _names(card.classes, notes, lang)
    classes = ", ".join(n if n == c else f"{n} (`{c}`)" for n, c in zip(names, card.classes))
    lines = [t("model_heading", lang), ""]
    banner = page_banner(card, ctx, lang)
    if banner:
        lines += [f"> {banner}", ""]
    words = [
        (t("m_knows", lang), t("m_knows_value", lang, n=len(names), names=t("list_sep", lang).join(names))),
        (t("m_crops", lang), _crops(card, notes, lang)),
        (t("m_trained_on", lang), _trained_on_line(card, lang)),
        (t("m_right", lang), _accuracy_line(card, report, lang)),
    ]
    lines += [f"**{k}:** {v}  " for k, v in words]
    reliability = reliability_lines(report, card.classes, notes, lang)
    lines += ["", t("m_rel_heading", lang), ""]
    lines += reliability or [t("m_rel_variant" if variant else "m_rel_none", lang)]
    rows = [
        (t("m_file", lang), f"`{predictor.model_path.name}`"
         # a run that kept its teacher ships it under the student's file name: say which network this is
         + (t("m_file_teacher", lang) if _kept_teacher(ctx) else "")),
        (t("m_run", lang), f"`{card.run_id}`" if card.run_id else "-"),
        (t("m_classes", lang), f"{len(card.classes)}: {classes}"),
        (t("m_accuracy", lang), _accuracy_line(card, report, lang)),
        (t("m_input", lang), f"{card.input_size} x {card.input_size} RGB"),
        (t("m_resize", lang), _framing_line(card, lang)),
        (t("m_threshold", lang), _threshold_line(card, lang)),
        (t("m_ood", lang), _ood_line(card, lang)),
        (t("m_provider", lang), f"`{predictor.provider}`"),
        (t("m_params", lang), (f"{int(params):,}" if params is not None else "-") + _file_size(predictor, lang)),
    ]
    if batching is not None:
        rows.append((t("m_batching", lang), t("m_batching_value", lang, batch=batching[0], wait=batching[1])))
    lines += ["", t("m_numbers_heading", lang), ""]
    lines += [f"- **{k}:** {v}" for k, v in rows]
    if report is None:
        lines += ["", t("m_no_report", lang)]
    return "\n".join(lines)
