"""The diagnoses made since the page was opened: a short list on the page and a CSV to download.

One browser session's history lives in that session's ``gr.State`` (a plain dict, so Gradio can copy it
per session): :func:`new_history`, then :func:`add_result` after every answer. At most
:data:`HISTORY_MAX` diagnoses are kept, the oldest dropped first, so a page left open all day holds a
bounded amount of memory. :func:`render_history` lists them, newest first, in the page's language.

The download is the CSV `leaflens predict --csv` writes, with the same columns and the same row writer
(:func:`leaflens.apps.cmd_predict.write_csv`) after three of its own (``diagnosis``: the number of the
diagnosis in the file, 1 the oldest kept; ``time``; ``answer``: that diagnosis's answer, e.g. "disagree" where each
photo's own verdict is a diagnosis): one row per photo of every diagnosis in the history, oldest
first; ``path`` is the photo's file name as uploaded. The page's answer names no class for an
out-of-domain photo, so neither does its row (``leaflens predict`` adds the model's ranking there).
:func:`write_session_csv` writes it to ``<root>/<session token>/leaflens-results-<time>.csv`` (the one
file of that folder: each write removes the previous one); at most :data:`MAX_SESSION_FOLDERS` session
folders are kept under ``root``, the oldest removed first, and :func:`remove_session` deletes a session's
folder when Gradio forgets the session. By default ``root`` is the server's own folder
(:func:`default_results_root`), removed when the server's process exits.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from leaflens.apps.cmd_predict import csv_text, write_csv
from leaflens.apps.diagnosis import error_message, format_percent, md_escape
from leaflens.apps.i18n import t
from leaflens.apps.notes import ClassNotes
from leaflens.apps.predictor import VERDICTS, Prediction

__all__ = ["HISTORY_MAX", "MAX_SESSION_FOLDERS", "add_result", "clean_stale_results", "default_results_root",
           "new_history",
           "predictions", "remove_session", "render_history", "write_session_csv"]

HISTORY_MAX = 50  # diagnoses kept per browser session
MAX_SESSION_FOLDERS = 200  # CSV folders kept under the results root (Gradio keeps 200 sessions too)
_CSV_PREFIX = "leaflens-results-"
_ROOT_PREFIX = "leaflens-results-"  # + the server's process id
_PHOTO_KEYS = ("name", "ok", "verdict", "label", "confidence", "top", "candidates", "ood_score")


def default_results_root() -> Path:
    """Where this server writes the page's CSV downloads: ``<system temp>/leaflens-results-<pid>``, its own
    folder (the page removes it when the process exits; :func:`clean_stale_results` removes a killed one's)."""
    return Path(tempfile.gettempdir()) / f"{_ROOT_PREFIX}{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


def clean_stale_results(parent: str | os.PathLike | None = None) -> list[Path]:
    """Remove the ``leaflens-results-<pid>`` folders under ``parent`` (default: the system temp folder) of
    processes that no longer run (a server killed before it could remove its own); the removed folders."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{_ROOT_PREFIX}*"):
        pid = folder.name[len(_ROOT_PREFIX):]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)) or not folder.is_dir():
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


REPEAT_SECONDS = 2.0  # the same photos with the same answer again within this: a double click, kept once


def new_history() -> dict[str, Any]:
    """An empty history: ``token`` (the session's CSV folder, made on first write) and ``entries``."""
    return {"token": None, "entries": []}


def _photo(p: Mapping[str, Any]) -> dict[str, Any]:
    """What the history keeps of one photo's entry: its answer and, for a failed photo, the reason."""
    kept = {k: p.get(k) for k in _PHOTO_KEYS}
    err = p.get("error")
    kept["error"] = None if not err else {"reason": err.get("reason"), "message": err.get("message"),
                                          "values": dict(err.get("values") or {})}
    return kept


def add_result(history: Mapping[str, Any] | None, result: Mapping[str, Any] | None,
               now: float | None = None) -> dict[str, Any]:
    """The history with ``result`` (an answer of :func:`leaflens.apps.diagnosis.summarise`) added at the end,
    bounded to :data:`HISTORY_MAX` entries. A result without photos is not a diagnosis: nothing is added."""
    base = dict(history or new_history())
    entries = list(base.get("entries") or [])
    if result and result.get("photos"):
        answer = result.get("answer") or {}
        stamp = time.time() if now is None else now
        entry: dict[str, Any] = {
            "time": stamp,
            "verdict": result.get("verdict"),
            "answer": {k: answer.get(k) for k in ("verdict", "label", "confidence", "candidates")},
            "photos": [_photo(p) for p in result["photos"]],
        }
        last = entries[-1] if entries else None
        # a double click diagnoses the same photos twice within a moment: one diagnosis, not two
        repeated = (last is not None and 0 <= stamp - float(last.get("time") or 0) < REPEAT_SECONDS
                    and {**last, "time": None} == {**entry, "time": None})
        if not repeated:
            entries.append(entry)
    base["entries"] = entries[-HISTORY_MAX:]
    return base


def _summary(entry: Mapping[str, Any], notes: ClassNotes, lang: str) -> str:
    """One diagnosis in a few words."""
    answer, verdict = entry.get("answer") or {}, entry.get("verdict")
    if verdict == "diagnosis" and answer.get("label"):
        return f"**{md_escape(notes.name(answer['label'], lang))}** {format_percent(answer['confidence'])}"
    if verdict == "ambiguous" and answer.get("candidates"):
        a = answer["candidates"][0]
        b = answer["candidates"][1] if len(answer["candidates"]) > 1 else a
        return md_escape(t("photo_ambiguous", lang, a=notes.name(a, lang), b=notes.name(b, lang)))
    if verdict == "out_of_domain":
        return t("photo_ood", lang)
    if verdict == "disagree":
        return t("history_disagree", lang)
    return t("refused_tag" if verdict == "refused" else "error_tag", lang)


def render_history(history: Mapping[str, Any] | None, notes: ClassNotes | None, lang: str) -> str:
    """The history as a Markdown list, newest first: time, the photos' names, the answer in a few words."""
    entries = list((history or {}).get("entries") or [])
    if not entries:
        return t("history_empty", lang)
    notes = notes or ClassNotes()
    lines = []
    for entry in reversed(entries):
        names = [md_escape(str(p["name"])) for p in entry["photos"]]
        shown = ", ".join(names[:3]) + (t("and_more_photos", lang, n=len(names) - 3) if len(names) > 3 else "")
        stamp = time.strftime("%H:%M:%S %z", time.localtime(entry["time"]))  # the server's clock: its UTC offset
        lines.append(f"- {stamp} · {shown}: {_summary(entry, notes, lang)}")
    if len(entries) >= HISTORY_MAX:
        lines.append("")
        lines.append(t("history_bounded", lang, n=HISTORY_MAX))
    return "\n".join(lines)


def _prediction(p: Mapping[str, Any], lang: str = "en") -> Prediction:
    """A history photo as the :class:`Prediction` `leaflens predict` writes a CSV row from; its error message in
    ``lang`` (the page's: the page said it so)."""
    verdict = p.get("verdict") if p.get("verdict") in VERDICTS else "error"
    if p.get("ok"):
        top = tuple((str(e["label"]), float(e["probability"])) for e in p.get("top") or [])
        return Prediction(str(p["name"]), top=top, verdict=str(verdict), ood_score=p.get("ood_score"))
    err = p.get("error") or {}
    message = err.get("message")
    if lang != "en" and err.get("reason"):
        message = error_message(err.get("reason"), lang, err.get("values") or None)
    return Prediction(str(p["name"]), verdict=str(verdict), ood_score=p.get("ood_score"),
                      error=str(message or err.get("reason") or "not read"), reason=err.get("reason"))


def predictions(history: Mapping[str, Any] | None, lang: str = "en") -> list[Prediction]:
    """Every photo of every diagnosis in the history, oldest first, as CSV rows' Predictions."""
    return [_prediction(p, lang) for entry in (history or {}).get("entries") or [] for p in entry["photos"]]


def _request_columns(history: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The download's first columns, per photo row: which diagnosis it belongs to (1 = the oldest kept),
    when it was made, and that diagnosis's answer (a photo's own verdict may differ: one of several photos
    that disagree reads "diagnosis", the request's answer "disagree")."""
    rows = []
    for number, entry in enumerate((history or {}).get("entries") or [], 1):
        answer, verdict = entry.get("answer") or {}, str(entry.get("verdict") or "")
        said = verdict
        if verdict == "diagnosis" and answer.get("label"):
            said = f"diagnosis: {answer['label']}"
        elif verdict == "ambiguous" and answer.get("candidates"):
            said = "ambiguous: " + " or ".join(str(c) for c in answer["candidates"][:2])
        stamp = time.strftime("%Y-%m-%d %H:%M:%S%z", time.localtime(entry["time"]))  # with the server's UTC offset
        rows += [[str(number), stamp, csv_text(said) or ""] for _ in entry["photos"]]
    return ["diagnosis", "time", "answer"], rows


def write_session_csv(root: str | os.PathLike, history: Mapping[str, Any], top_k: int,
                      now: float | None = None, lang: str = "en") -> tuple[dict[str, Any], Path | None]:
    """Write the history's CSV for download; ``(history, path)`` (the history gains its token on the first
    write; path None when the history is empty). See the module docstring for where and how many. The column
    names and answers are the CSV's fixed words; the messages of unreadable or refused photos are in ``lang``."""
    if not (history.get("entries") or []):
        return dict(history), None
    base = dict(history)
    token = base.get("token") or secrets.token_hex(8)
    base["token"] = token
    folder = Path(root) / str(token)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    target = folder / f"{_CSV_PREFIX}{stamp}.csv"
    write_csv(target, predictions(base, lang), top_k, leading=_request_columns(base))
    for old in folder.glob(f"{_CSV_PREFIX}*.csv"):
        if old != target:
            old.unlink(missing_ok=True)
    _cap_sessions(Path(root), keep=folder)
    return base, target


def _cap_sessions(root: Path, keep: Path) -> None:
    """Remove the oldest session folders beyond :data:`MAX_SESSION_FOLDERS` (never ``keep``)."""
    try:
        folders = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return
    if len(folders) <= MAX_SESSION_FOLDERS:
        return

    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0

    for old in sorted(folders, key=mtime)[: len(folders) - MAX_SESSION_FOLDERS]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def remove_session(root: str | os.PathLike, history: Mapping[str, Any] | None) -> None:
    """Delete the CSV folder of a session Gradio has forgotten (its ``gr.State`` delete callback)."""
    token = (history or {}).get("token")
    if token and all(c in "0123456789abcdef" for c in str(token)):
        shutil.rmtree(Path(root) / str(token), ignore_errors=True)
