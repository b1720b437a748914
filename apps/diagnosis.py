"""What the web app says about a set of photos: per-photo verdicts, the combined answer, the words.

Pure logic without Gradio, so it is unit-tested directly and shared by the page and the API.

Every photo has one verdict (leaflens.apps.predictor.VERDICTS): ``diagnosis``; ``ambiguous`` (a known
kind of photo, but the model is torn between two classes: both are named, neither is claimed);
``out_of_domain`` (it does not look like the photos the model was trained on: no class is named);
``refused`` (decoded, but too small, one flat colour or too blurred to judge: the model never saw it);
``error`` (not readable, too big, server busy, ...). The per-photo verdict is the Predictor's own
(:meth:`leaflens.apps.predictor.Predictor.judge`, applied by the service); :func:`summarise` only falls
back to the top-probability rule for outcomes that carry probabilities alone.

- :func:`summarise` turns the per-photo outcomes into the JSON-able answer the ``diagnose`` API returns.
  Several photos of one plant: out-of-domain, refused and unreadable photos are named and left out; when
  the others (diagnosis or ambiguous) share a class (a diagnosed photo's class, or either of an unsure
  photo's two), their probabilities are averaged (a soft vote, steadier than any single leaf) and the
  average is judged with the model's threshold as a single photo would be; otherwise the answer is
  ``disagree`` and no class is claimed. When every photo the model saw is out of domain, the answer is
  ``out_of_domain``.
- :func:`render` turns that answer into what a person reads, in English or Chinese: the ranked labels
  for ``gr.Label`` (for a diagnosis only), a plain-language verdict, the class notes (description, what to
  do; for a diagnosis only) and a per-photo table. Messages are the friendly ones of
  :mod:`leaflens.apps.i18n`, never tracebacks.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leaflens.apps.i18n import t
from leaflens.apps.model_card import unsure
from leaflens.apps.notes import ClassNotes
from leaflens.data_prep.quality import REFUSAL_REASONS

__all__ = ["ANSWER_VERDICTS", "REFUSAL_REASONS", "PhotoOutcome", "error_message", "format_percent", "is_healthy",
           "md_escape", "photo_caption", "photo_names", "render", "summarise"]

# Why a readable photo is not shown to the model (leaflens.data_prep.decode min_side, leaflens.data_prep.quality).
# The verdict of a whole request: a photo's verdicts, plus "disagree" (the photos share no class they claim).
ANSWER_VERDICTS = ("diagnosis", "ambiguous", "out_of_domain", "disagree", "refused", "error")
# The model's ranking is only shown when it answered: these verdicts name classes.
_VOTING = ("diagnosis", "ambiguous")
_MAX_KNOWN = 8  # classes listed by name in the out-of-domain message


@dataclass
class PhotoOutcome:
    """One uploaded file: its probabilities over the model's classes and verdict, or why it has none.

    ``name`` is what the person called the file (never a server path). ``verdict`` is the Predictor's
    (``diagnosis`` / ``ambiguous`` / ``out_of_domain`` when ``probs`` is set; None there means "judge by
    the top-probability threshold alone"); a failed file has ``refused`` or ``error``, derived from
    ``reason`` when not given. ``reason`` is an :class:`leaflens.data_prep.decode.ImageDecodeError` reason
    or one of the app's own ("file_too_big", "internal", "busy"); ``detail`` is the technical message
    (logged, and returned by the API); ``ood_score`` is the model's out-of-domain score, when it has one.
    """

    name: str
    probs: np.ndarray | None = None
    reason: str | None = None
    detail: str | None = None
    values: dict[str, object] | None = None  # placeholders of the friendly message (e.g. sizes)
    verdict: str | None = None
    ood_score: float | None = None
    sha256: str | None = None  # the file's bytes (``sha256:<hex>``): the same photo sent twice is one vote

    @property
    def ok(self) -> bool:
        """The model looked at the photo (whatever its verdict)."""
        return self.probs is not None


def photo_names(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The name each file of one request is shown by: its base name, with " (2)", " (3)"... after the first
    when several files share it (IMG_0001.jpg from two folders), so a photo left out or disagreeing is told
    apart from the one that was used."""
    names = [Path(p).name for p in paths]
    taken = set(names)
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        if seen[n] == 1:
            out.append(n)
            continue
        k = seen[n]
        while f"{n} ({k})" in taken:  # a file already called "IMG.jpg (2)" keeps that name for itself
            k += 1
        out.append(f"{n} ({k})")
        taken.add(out[-1])
    return out


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
    """The friendly message for a decode/upload failure or refusal ``reason`` in ``lang``."""
    key = f"err_{reason}"
    try:
        return t(key, lang, **(values or {}))
    except KeyError:
        return t("err_corrupt", lang)


def _ranked(probs: np.ndarray, classes: Sequence[str], top_k: int) -> list[dict[str, Any]]:
    order = np.argsort(-probs, kind="stable")[: max(1, min(top_k, len(classes)))]
    return [{"label": classes[i], "probability": float(probs[i])} for i in order]


def _judged(verdict: str | None, probs: np.ndarray, threshold: float) -> str:
    """A photo's verdict: the Predictor's when given, else its rule (:func:`leaflens.apps.model_card.unsure`)."""
    if verdict is None:
        return "ambiguous" if unsure(probs, threshold) else "diagnosis"
    if verdict not in ("diagnosis", "ambiguous", "out_of_domain"):
        raise ValueError(f"a photo with probabilities has verdict {verdict!r}, expected diagnosis, ambiguous "
                         "or out_of_domain")
    return verdict


def _photo_entry(o: PhotoOutcome, classes: list[str], threshold: float, top_k: int) -> tuple[dict[str, Any],
                                                                                              np.ndarray | None]:
    """The JSON entry of one photo, and its probabilities when it takes part in the vote."""
    if not o.ok:
        verdict = o.verdict or ("refused" if o.reason in REFUSAL_REASONS else "error")
        if verdict not in ("refused", "error"):
            raise ValueError(f"{o.name}: verdict {verdict!r} without probabilities")
        return {"name": o.name, "ok": False, "verdict": verdict, "label": None, "confidence": None,
                "uncertain": None, "top": [], "candidates": [], "ood_score": o.ood_score,
                "error": {"reason": o.reason or "corrupt", "message": error_message(o.reason, "en", o.values),
                          "detail": o.detail, "values": dict(o.values or {})}}, None
    probs = np.asarray(o.probs, dtype=np.float64).reshape(-1)
    if probs.shape != (len(classes),):
        raise ValueError(f"{o.name}: {probs.shape[0]} probabilities for {len(classes)} classes")
    top = _ranked(probs, classes, max(top_k, 2))
    verdict = _judged(o.verdict, probs, threshold)
    entry = {"name": o.name, "ok": True, "verdict": verdict, "label": top[0]["label"],
             "confidence": top[0]["probability"], "uncertain": verdict != "diagnosis", "top": top[:top_k],
             "candidates": [e["label"] for e in top[:2]] if verdict == "ambiguous" else [],
             "ood_score": o.ood_score, "error": None}
    if verdict == "out_of_domain":  # no class is named for a photo unlike the training photos
        entry.update(label=None, confidence=None, top=[])
        return entry, None
    return entry, probs


def _combined(voters: list[tuple[dict[str, Any], np.ndarray]], classes: list[str], threshold: float,
              top_k: int) -> dict[str, Any]:
    """The answer of the photos that take part in the vote (diagnosis or ambiguous, at least one).

    The photos agree when some class is every photo's claim: a diagnosed photo claims its class, an unsure one
    either of its two (three photos each "unsure between aphids and healthy", in either order, agree). The
    average must then put one of those classes first; anything else is ``disagree``."""
    disagree: dict[str, Any] = {"verdict": "disagree", "label": None, "confidence": None, "uncertain": True, "top": [],
                "candidates": [], "photos_used": len(voters), "agree": None}
    claims = [set(p["candidates"]) if p["verdict"] == "ambiguous" and p["candidates"] else {p["label"]}
              for p, _ in voters]
    shared = set.intersection(*claims)
    if not shared:
        return disagree
    if len(voters) == 1:  # one photo: its own verdict, exactly the Predictor's
        photo, probs = voters[0]
        verdict = photo["verdict"]
    else:
        probs = np.mean(np.stack([p for _, p in voters]), axis=0)
        verdict = None
    top = _ranked(probs, classes, max(top_k, 2))
    if top[0]["label"] not in shared:
        return disagree
    # the average of photos that were each unsure is not a diagnosis: it can pass the threshold (two near ties
    # for the same class average to a clearer lead), but no photo was judged with the confidence the threshold
    # was chosen for, so a combined diagnosis needs one photo diagnosed on its own, as that class; and a photo
    # that puts another class first (unsure, its runner-up the shared class however weak) leaves it unsure
    judged = any(p["verdict"] == "diagnosis" and p["label"] == top[0]["label"] for p, _ in voters)
    all_first = all(p["label"] == top[0]["label"] for p, _ in voters)
    verdict = verdict or ("ambiguous" if unsure(probs, threshold) or not judged or not all_first else "diagnosis")
    return {"verdict": verdict, "label": top[0]["label"], "confidence": top[0]["probability"],
            "uncertain": verdict != "diagnosis", "top": top[:top_k],
            "candidates": [e["label"] for e in top[:2]] if verdict == "ambiguous" else [],
            "photos_used": len(voters), "agree": sum(p["label"] == top[0]["label"] for p, _ in voters)}


def summarise(outcomes: Sequence[PhotoOutcome], classes: Sequence[str], threshold: float,
              top_k: int = 3, given: int | None = None, notes: ClassNotes | None = None,
              ood_threshold: float | None = None) -> dict[str, Any]:
    """The answer for one request, as plain JSON types.

    Keys:

    - ``verdict``: the request's verdict, one of :data:`ANSWER_VERDICTS` (None when no file was given);
    - ``photos``: one entry per file, in upload order: ``name``, ``ok`` (the model saw it), ``verdict``,
      ``label``, ``confidence``, ``uncertain`` (verdict is not ``diagnosis``), ``top``, ``candidates``
      (the two classes an ``ambiguous`` photo is torn between), ``ood_score``, ``error`` (``reason``,
      ``message``, ``detail``, ``values``) and ``duplicate_of`` (the name of an earlier photo of the request
      with the same bytes, which alone takes part in the vote; else None). An ``out_of_domain`` photo names
      no class (label None, top []);
    - ``answer``: None when the model saw no photo; else ``verdict``, ``label``, ``confidence``,
      ``uncertain``, ``top``, ``candidates``, ``photos_used`` (photos in the vote), ``agree`` (how many of
      them have ``label`` first; None for ``disagree``, where each photo's own answer is the answer) and
      ``left_out`` (the out-of-domain photos' names);
    - ``threshold`` / ``ood_threshold``: the model's thresholds; ``given``: files received (more than
      ``len(photos)`` when some were cut off); ``note``: the notes entry of a diagnosed class.
    """
    classes = list(classes)
    photos: list[dict[str, Any]] = []
    voters: list[tuple[dict[str, Any], np.ndarray]] = []
    first_of: dict[str, str] = {}  # the bytes' digest -> the first photo with them
    for o in outcomes:
        entry, probs = _photo_entry(o, classes, threshold, top_k)
        entry["duplicate_of"] = first_of.get(o.sha256) if o.sha256 else None
        if o.sha256:
            first_of.setdefault(o.sha256, o.name)
        photos.append(entry)
        if probs is not None and entry["duplicate_of"] is None:  # a copy is not a second opinion
            voters.append((entry, probs))
    outside = [p["name"] for p in photos if p["verdict"] == "out_of_domain"]
    answer: dict[str, Any] | None = None
    if voters:
        answer = _combined(voters, classes, threshold, top_k)
    elif outside:
        answer = {"verdict": "out_of_domain", "label": None, "confidence": None, "uncertain": True, "top": [],
                  "candidates": [], "photos_used": 0, "agree": None}
    if answer is not None:
        answer["left_out"] = outside
        verdict: str | None = answer["verdict"]
    elif photos:
        verdict = "refused" if all(p["verdict"] == "refused" for p in photos) else "error"
    else:
        verdict = None
    note = None
    if answer is not None and answer["verdict"] == "diagnosis" and notes is not None and answer["label"] in notes:
        note = dict(notes.entries[answer["label"]])
    return {"verdict": verdict, "photos": photos, "answer": answer, "threshold": float(threshold),
            "ood_threshold": None if ood_threshold is None else float(ood_threshold),
            "given": int(given if given is not None else len(outcomes)), "note": note}


def _label_dict(top: list[dict[str, Any]], notes: ClassNotes, lang: str) -> dict[str, float]:
    """``gr.Label`` value: display name -> probability (ids appended if two names collide). Gradio rounds the
    bars' percentages, so a probability above 0.995 is given as 0.994: the bar reads 99 % beside the verdict's
    ">99%", never a false 100 %, as :func:`format_percent` words it."""
    names = [notes.name(e["label"], lang) for e in top]
    out: dict[str, float] = {}
    for name, e in zip(names, top):
        key = name if names.count(name) == 1 else f"{name} ({e['label']})"
        out[key] = min(float(e["probability"]), 0.994)
    return out


def _known(classes: Sequence[str], notes: ClassNotes, lang: str) -> str:
    """What the model knows, for the out-of-domain message: its classes' display names."""
    names = [notes.name(c, lang) for c in classes]
    shown = t("list_sep", lang).join(names[:_MAX_KNOWN])
    if len(names) > _MAX_KNOWN:
        shown += t("and_more", lang, n=len(names) - _MAX_KNOWN)
    return shown


def _between(candidates: list[str], notes: ClassNotes, lang: str) -> tuple[str, str]:
    first = notes.name(candidates[0], lang)
    return first, notes.name(candidates[1], lang) if len(candidates) > 1 else first


def _diagnosis_text(answer: dict[str, Any], notes: ClassNotes, lang: str) -> str:
    top = answer["top"]
    name, conf = notes.name(top[0]["label"], lang), format_percent(top[0]["probability"])
    text = t("verdict_healthy", lang, conf=conf) if is_healthy(top[0]["label"]) else \
        t("verdict_sick", lang, name=name, conf=conf)
    if len(top) > 1 and top[1]["probability"] >= 0.2:
        text += " " + t("runner_up", lang, name=notes.name(top[1]["label"], lang),
                        conf=format_percent(top[1]["probability"]))
    return text


def photo_caption(photo: dict[str, Any], notes: ClassNotes, lang: str) -> str:
    """One photo's answer in a few words (the per-photo table, the thumbnails' captions): no class for an
    out-of-domain photo, the two candidates and no percentage for an ambiguous one."""
    verdict = photo["verdict"]
    if verdict == "diagnosis":
        return f"{notes.name(photo['label'], lang)} {format_percent(photo['confidence'])}"
    if verdict == "ambiguous":
        a, b = _between(photo["candidates"], notes, lang)
        return t("photo_ambiguous", lang, a=a, b=b)
    if verdict == "out_of_domain":
        return t("photo_ood", lang)
    return t("refused_tag" if verdict == "refused" else "error_tag", lang)


def _verdict(answer: dict[str, Any], photos: list[dict[str, Any]], classes: Sequence[str], notes: ClassNotes,
             lang: str) -> str:
    """The headline of an answer the model gave (``summarise(...)["answer"]``)."""
    verdict, used = answer["verdict"], answer["photos_used"]
    if verdict == "out_of_domain":
        seen = len(answer["left_out"])
        key = "verdict_ood" if seen == 1 else "verdict_ood_all"
        return t(key, lang, n=seen, known=_known(classes, notes, lang))
    if verdict == "disagree":
        answers = t("item_sep", lang).join(
            t("named_answer", lang, name=md_escape(p["name"]), answer=md_escape(photo_caption(p, notes, lang)))
            for p in photos if p["verdict"] in _VOTING and not p.get("duplicate_of"))
        return t("verdict_disagree", lang, n=used, answers=answers)
    if verdict == "ambiguous":
        a, b = _between(answer["candidates"], notes, lang)
        text = t("verdict_ambiguous", lang, a=a, b=b)
    else:
        text = _diagnosis_text(answer, notes, lang)
        if used > 1:
            text += " " + t("agreement", lang, k=answer["agree"], n=used)
    return t("combined", lang, n=used) + text if used > 1 else text


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
        verdict = p["verdict"]
        if verdict == "diagnosis":
            rows.append(f"| {i} | {name} | {md_escape(notes.name(p['label'], lang))} | "
                        f"{format_percent(p['confidence'])} |")
        elif p["ok"]:  # ambiguous or out of domain: no class claimed, no percentage
            rows.append(f"| {i} | {name} | {md_escape(photo_caption(p, notes, lang))} | |")
        else:
            err = p["error"]
            message = error_message(err["reason"], lang, _values_from(err))
            tag = t("refused_tag" if verdict == "refused" else "error_tag", lang)
            rows.append(f"| {i} | {name} | **{tag}:** {message} | |")
    return "\n".join(rows)


def _values_from(err: dict[str, Any]) -> dict[str, object]:
    return dict(err.get("values") or {})


def render(result: dict[str, Any] | None, lang: str, notes: ClassNotes | None = None,
           max_photos: int | None = None, classes: Sequence[str] | None = None,
           ) -> tuple[dict[str, float] | None, str, str, str]:
    """``(label value, verdict Markdown, notes Markdown, per-photo Markdown)`` for one answer in ``lang``.

    ``result`` is what :func:`summarise` returned (None: nothing asked yet); ``classes`` (the model's)
    are named in the out-of-domain message. The ranking (label value) and the class notes are given for
    a ``diagnosis`` only: an ambiguous, out-of-domain or disagreeing answer shows no class as the answer
    and no percentage. The per-photo table is shown when there is more than one file or a file failed.
    """
    notes = notes or ClassNotes()
    classes = list(classes or [])
    if not result:
        return None, t("waiting", lang), "", ""
    photos, answer = result.get("photos", []), result.get("answer")
    if not photos:
        return None, t("no_photos", lang), "", ""
    lines: list[str] = []
    given = int(result.get("given", len(photos)))
    if given > len(photos):
        left = [md_escape(str(n)) for n in result.get("not_used") or []]
        lines.append(t("too_many", lang, max=max_photos or len(photos), n=given)
                     + (t("sentence_gap", lang) + t("not_used", lang, names=t("list_sep", lang).join(left))
                        if left else ""))
    failed = sum(not p["ok"] for p in photos)
    label_value = None
    notes_md = ""
    if answer is None and len(photos) == 1:
        err = photos[0]["error"]
        key = "one_refused" if photos[0]["verdict"] == "refused" else "one_failed"
        lines.insert(0, t(key, lang, name=md_escape(photos[0]["name"]),
                          message=error_message(err["reason"], lang, _values_from(err))))
        return None, "\n\n".join(lines), "", ""
    if answer is None:
        refused = sum(p["verdict"] == "refused" for p in photos)
        key = "all_refused" if refused == len(photos) else "all_failed" if not refused else "all_unusable"
        lines.insert(0, t(key, lang))
    else:
        lines.insert(0, _verdict(answer, photos, classes, notes, lang))
        left_out = answer["left_out"]
        if left_out and answer["verdict"] != "out_of_domain":
            lines.append(t("left_out_ood", lang, k=len(left_out), n=len(photos),
                           names=", ".join(md_escape(n) for n in left_out)))
        copies = [p for p in photos if p.get("duplicate_of")]
        if copies:
            lines.append(t("duplicates", lang, k=len(copies), names=", ".join(
                f"{md_escape(p['name'])} = {md_escape(str(p['duplicate_of']))}" for p in copies)))
        if failed:
            lines.append(t("skipped_some", lang, k=failed, n=len(photos)))
        if answer["verdict"] == "diagnosis":
            label_value = _label_dict(answer["top"], notes, lang)
            notes_md = _notes_md(answer["label"], notes, lang)
    table = _table_md(photos, notes, lang) if (len(photos) > 1 or failed) else ""
    return label_value, "\n\n".join(lines), notes_md, table

