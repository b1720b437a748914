"""What the app knows beyond the ONNX file: the training run, its dataset, the class notes.

``leaflens serve --model artifacts/export/student.onnx`` should need nothing else, so
:func:`discover` follows the artefacts' own records: the export folder's ``parity.json`` names the
run (``run.path``) and the dataset (``dataset.root``); the run's ``report.json`` holds the test
accuracy with its confidence interval, and ``curves.png`` / ``confusion.png`` sit beside it; the
dataset folder carries ``classes.toml``. Explicit ``--run`` / ``--dataset`` / ``--classes-notes``
win. Anything missing is reported as a warning and simply not shown.

:func:`model_markdown` writes the "Model" tab, including how the two thresholds behind the verdicts were
chosen and what they cost on the validation photos (from the model card: ``uncertain_threshold`` and
``val_ambiguous``; ``ood``), or that the model has no out-of-domain check. This module reads JSON only (no
engine import).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leaflens.apps.i18n import t
from leaflens.apps.notes import find_notes

__all__ = ["EXPORT_REPORT", "RUN_REPORT", "ServeContext", "discover", "model_markdown", "run_images"]

EXPORT_REPORT = "parity.json"  # written by `leaflens export` next to student.onnx
RUN_REPORT = "report.json"  # written by `leaflens distill` into the run folder


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
        guess = Path(_get(export, "run", "path")).parent
        if guess.is_dir():
            ctx.run_dir = guess
        else:
            ctx.warnings.append(f"{model_dir / EXPORT_REPORT} names run folder {guess}, which is gone")
    if ctx.run_dir is not None:
        report_path = ctx.run_dir / RUN_REPORT
        if report_path.is_file():
            ctx.run_report = _read_json(report_path, ctx.warnings)
        else:
            ctx.warnings.append(f"{report_path} not found: no accuracy or plots in the Model tab")

    if dataset_root is not None:
        ctx.dataset_root = Path(dataset_root)
    else:
        for recorded in (_get(export, "dataset", "root"), _get(ctx.run_report, "dataset", "root")):
            if recorded and Path(recorded).is_dir():
                ctx.dataset_root = Path(recorded)
                break

    if notes_path is not None:
        ctx.notes_path = Path(notes_path)
    else:
        ctx.notes_path = find_notes([model_dir, ctx.run_dir, ctx.dataset_root])
    return ctx


def run_images(ctx: ServeContext) -> dict[str, Path]:
    """The run's ``confusion.png`` and ``curves.png`` that exist, keyed "confusion" / "curves"."""
    if ctx.run_dir is None:
        return {}
    found = {key: ctx.run_dir / f"{key}.png" for key in ("confusion", "curves")}
    return {key: path for key, path in found.items() if path.is_file()}


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


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
    below = t("m_threshold_below", lang, threshold=f"{card.uncertain_threshold:.2f}")
    if not card.threshold_from_model:
        return f"{below} {t('m_threshold_default', lang)}"
    parts = [below, t("m_threshold_how", lang)]
    if card.val_ambiguous is not None:
        parts.append(t("m_threshold_cost", lang, share=_pct(card.val_ambiguous)))
    return t("m_sep", lang).join(parts)


def _ood_line(card: Any, lang: str) -> str:
    """How the out-of-domain check judges a photo and what it costs on validation, or that there is none."""
    ood = card.ood
    if ood is None:
        return t("m_ood_none", lang)
    return t("m_ood_value", lang, threshold=f"{ood.threshold:.3g}", method=f"`{ood.method}`",
             train=f"{ood.train_photos:,}", val=f"{ood.val_photos:,}", budget=_pct(ood.budget),
             flagged=_pct(ood.val_flagged))


def model_markdown(predictor: Any, ctx: ServeContext, lang: str, notes: Any = None,
                   batching: tuple[int, float] | None = None) -> str:
    """The Model tab: file, run, classes (display names), accuracy with CI, input, the "unsure" threshold and
    the out-of-domain check (how chosen, cost on validation), provider, params."""
    card = predictor.card
    report = ctx.run_report
    params = card.params if card.params is not None else _get(report, "params")
    names = [notes.name(c, lang) if notes is not None else c for c in card.classes]
    classes = ", ".join(n if n == c else f"{n} (`{c}`)" for n, c in zip(names, card.classes))
    rows = [
        (t("m_file", lang), f"`{predictor.model_path.name}`"),
        (t("m_run", lang), f"`{card.run_id}`" if card.run_id else "-"),
        (t("m_classes", lang), f"{len(card.classes)}: {classes}"),
        (t("m_accuracy", lang), _accuracy_line(card, report, lang)),
        (t("m_input", lang), f"{card.input_size} x {card.input_size} RGB"),
        (t("m_resize", lang), t("m_resize_crop" if card.resize == "crop" else "m_resize_pad", lang)),
        (t("m_threshold", lang), _threshold_line(card, lang)),
        (t("m_ood", lang), _ood_line(card, lang)),
        (t("m_provider", lang), f"`{predictor.provider}`"),
        (t("m_params", lang), f"{int(params):,}" if params is not None else "-"),
    ]
    if batching is not None:
        rows.append((t("m_batching", lang), t("m_batching_value", lang, batch=batching[0], wait=batching[1])))
    lines = [t("model_heading", lang), ""]
    lines += [f"- **{k}:** {v}" for k, v in rows]
    if report is None:
        lines += ["", t("m_no_report", lang)]
    return "\n".join(lines)
