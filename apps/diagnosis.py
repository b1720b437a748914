"""What the web app says about a set of photos: per-photo answers, the combined vote, the verdict.

Pure logic without Gradio, so it is unit-tested directly and shared by the page and the API:

- :func:`summarise` turns per-photo class probabilities (or per-photo errors) into the JSON-able
  answer the ``diagnose`` API returns. With several photos of one plant the answer is the vote of
  all readable photos: their probabilities are averaged (a soft vote), which is steadier than any
  single leaf; the answer is "uncertain" when the averaged top probability is below the model's
  threshold, exactly as for a single photo.
- :func:`render` turns that answer into what a person reads, in English or Chinese: the ranked
  labels for ``gr.Label``, a plain-language verdict, the class notes (description, what to do) and
  a per-photo table. Error messages are the friendly ones of :mod:`leaflens.apps.i18n`, never tracebacks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from leaflens.apps.i18n import t
from leaflens.apps.notes import ClassNotes

__all__ = ["PhotoOutcome", "error_message", "format_percent", "is_healthy", "md_escape", "render", "summarise"]


@dataclass
class PhotoOutcome:
    """One uploaded file: its probabilities over the model's classes, or why it has none.

    ``name`` is what the person called the file (never a server path); ``reason`` is an
    :class:`leaflens.data_prep.decode.ImageDecodeError` reason or one of the app's own ("file_too_big",
    "internal"); ``detail`` is the technical message (logged, and returned by the API).
    """

    name: str
    probs: np.ndarray | None = None
    reason: str | None = None
    detail: str | None = None
    values: dict[str, object] | None = None  # placeholders of the friendly message (e.g. sizes)

    @property
    def ok(self) -> bool:
        return self.probs is not None


def is_healthy(class_id: str) -> bool:
    """Whether a class id names the healthy state (the verdict is worded differently for it)."""
    return "healthy" in class_id.lower() and not class_id.lower().startswith("un")


def format_percent(p: float) -> str:
    """0.923 -> "92%"; tiny values -> "<1%", near-certain values -> ">99%" (never a false 100 %)."""
    if p < 0.005:
        return "<1%"
    if p > 0.995:
        return ">99%"
    return f"{p:.0%}"


_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~])")


def md_escape(text: str) -> str:
    """Escape Markdown/HTML specials so a file name shows as typed and cannot inject markup."""
    return _MD_SPECIAL.sub(r"\\\1", text.replace("\n", " "))


def error_message(reason: str | None, lang: str = "en", values: dict[str, object] | None = None) -> str:
    """The friendly message for a decode/upload failure ``reason`` in ``lang``."""
    key = f"err_{reason}"
    try:
        return t(key, lang, **(values or {}))
    except KeyError:
        return t("err_corrupt", lang)


def _ranked(probs: np.ndarray, classes: Sequence[str], top_k: int) -> list[dict[str, Any]]:
    order = np.argsort(-probs, kind="stable")[: max(1, min(top_k, len(classes)))]
    return [{"label": classes[i], "probability": float(probs[i])} for i in order]


def summarise(outcomes: Sequence[PhotoOutcome], classes: Sequence[str], threshold: float,
              top_k: int = 3, given: int | None = None, notes: ClassNotes | None = None) -> dict[str, Any]:
    """The answer for one request, as plain JSON types.

    Keys: ``photos`` (one entry per file, in upload order: ``name``, ``ok``, ``label``,
    ``confidence``, ``uncertain``, ``top``, ``error``), ``answer`` (None when no file was readable;
    else ``label``, ``confidence``, ``uncertain``, ``top``, ``photos_used``, ``agree``: how many
    readable photos have that label first), ``threshold``, ``given`` (files received; more than
    ``len(photos)`` when some were cut off) and ``note`` (the notes entry of the answer's label).
    """
    classes = list(classes)
    photos: list[dict[str, Any]] = []
    good: list[np.ndarray] = []
    for o in outcomes:
        if o.ok:
            probs = np.asarray(o.probs, dtype=np.float64).reshape(-1)
            if probs.shape != (len(classes),):
                raise ValueError(f"{o.name}: {probs.shape[0]} probabilities for {len(classes)} classes")
            good.append(probs)
            top = _ranked(probs, classes, top_k)
            photos.append({"name": o.name, "ok": True, "label": top[0]["label"],
                           "confidence": top[0]["probability"],
                           "uncertain": bool(top[0]["probability"] < threshold), "top": top, "error": None})
        else:
            photos.append({"name": o.name, "ok": False, "label": None, "confidence": None, "uncertain": None,
                           "top": [], "error": {"reason": o.reason or "corrupt",
                                                "message": error_message(o.reason, "en", o.values),
                                                "detail": o.detail, "values": dict(o.values or {})}})
    answer = None
    if good:
        mean = np.mean(np.stack(good), axis=0)
        top = _ranked(mean, classes, top_k)
        label = top[0]["label"]
        answer = {"label": label, "confidence": top[0]["probability"],
                  "uncertain": bool(top[0]["probability"] < threshold), "top": top,
                  "photos_used": len(good), "agree": sum(p["label"] == label for p in photos if p["ok"])}
    note = None
    if answer is not None and notes is not None and answer["label"] in notes:
        note = dict(notes.entries[answer["label"]])
    return {"photos": photos, "answer": answer, "threshold": float(threshold),
            "given": int(given if given is not None else len(outcomes)), "note": note}


def _label_dict(top: list[dict[str, Any]], notes: ClassNotes, lang: str) -> dict[str, float]:
    """``gr.Label`` value: display name -> probability (ids appended if two names collide)."""
    names = [notes.name(e["label"], lang) for e in top]
    out: dict[str, float] = {}
    for name, e in zip(names, top):
        key = name if names.count(name) == 1 else f"{name} ({e['label']})"
        out[key] = e["probability"]
    return out


def _verdict(answer: dict[str, Any], notes: ClassNotes, lang: str) -> str:
    top = answer["top"]
    name, conf = notes.name(top[0]["label"], lang), format_percent(top[0]["probability"])
    if answer["uncertain"]:
        text = t("verdict_uncertain", lang, name=name, conf=conf)
    elif is_healthy(top[0]["label"]):
        text = t("verdict_healthy", lang, conf=conf)
    else:
        text = t("verdict_sick", lang, name=name, conf=conf)
    if len(top) > 1 and (answer["uncertain"] or top[1]["probability"] >= 0.2):
        text += " " + t("runner_up", lang, name=notes.name(top[1]["label"], lang),
                        conf=format_percent(top[1]["probability"]))
    return text


def _notes_md(label: str, notes: ClassNotes, lang: str) -> str:
    description = notes.text(label, "description", lang)
    advice = notes.text(label, "advice", lang)
    if not (description or advice):
        return ""
    parts = [f"### {notes.name(label, lang)}"]
    if description:
        parts.append(f"**{t('what_it_is', lang)}:** {description}")
    if advice:
        parts.append(f"**{t('what_to_do', lang)}:** {advice}")
    return "\n\n".join(parts)


def _table_md(photos: list[dict[str, Any]], notes: ClassNotes, lang: str) -> str:
    rows = [f"| # | {t('col_photo', lang)} | {t('col_result', lang)} | {t('col_conf', lang)} |",
            "|---|---|---|---|"]
    for i, p in enumerate(photos, 1):
        name = md_escape(p["name"])
        if p["ok"]:
            result = md_escape(notes.name(p["label"], lang))
            if p["uncertain"]:
                result += f" ({t('uncertain_tag', lang)})"
            rows.append(f"| {i} | {name} | {result} | {format_percent(p['confidence'])} |")
        else:
            err = p["error"]
            message = error_message(err["reason"], lang, _values_from(err))
            rows.append(f"| {i} | {name} | **{t('error_tag', lang)}:** {message} | |")
    return "\n".join(rows)


def _values_from(err: dict[str, Any]) -> dict[str, object]:
    return dict(err.get("values") or {})


def render(result: dict[str, Any] | None, lang: str, notes: ClassNotes | None = None,
           max_photos: int | None = None) -> tuple[dict[str, float] | None, str, str, str]:
    """``(label value, verdict Markdown, notes Markdown, per-photo Markdown)`` for one answer in ``lang``.

    ``result`` is what :func:`summarise` returned (None: nothing asked yet). The per-photo table is
    shown when there is more than one file or any file failed.
    """
    notes = notes or ClassNotes()
    if not result:
        return None, t("waiting", lang), "", ""
    photos, answer = result.get("photos", []), result.get("answer")
    if not photos:
        return None, t("no_photos", lang), "", ""
    lines: list[str] = []
    given = int(result.get("given", len(photos)))
    if given > len(photos):
        lines.append(t("too_many", lang, max=max_photos or len(photos), n=given))
    failed = sum(not p["ok"] for p in photos)
    label_value = None
    notes_md = ""
    if answer is None and len(photos) == 1:
        err = photos[0]["error"]
        lines.insert(0, t("one_failed", lang, name=md_escape(photos[0]["name"]),
                          message=error_message(err["reason"], lang, _values_from(err))))
        return None, "\n\n".join(lines), "", ""
    if answer is None:
        lines.insert(0, t("all_failed", lang))
    else:
        verdict = _verdict(answer, notes, lang)
        if answer["photos_used"] > 1:
            verdict = t("combined", lang, n=answer["photos_used"]) + verdict + " " + t(
                "agreement", lang, k=answer["agree"], n=answer["photos_used"])
        lines.insert(0, verdict)
        if failed:
            lines.append(t("skipped_some", lang, k=failed, n=len(photos)))
        label_value = _label_dict(answer["top"], notes, lang)
        if not answer["uncertain"]:
            notes_md = _notes_md(answer["label"], notes, lang)
    table = _table_md(photos, notes, lang) if (len(photos) > 1 or failed) else ""
    return label_value, "\n\n".join(lines), notes_md, table
