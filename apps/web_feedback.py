"""The page's "Wrong? The right answer is ..." control, and the list and CSV of this session's diagnoses.

The Gradio side only: what is saved and how is :mod:`leaflens.apps.corrections`, what the history keeps and
the CSV it writes is :mod:`leaflens.apps.history`. :func:`build_feedback` creates the components where it
is called (inside the page's layout); :func:`wire_feedback` connects them to the page's photos, answer and
language switch:

- every new answer (the ``answer`` JSON changes) is added to the session's history (``gr.State``, at most
  ``HISTORY_MAX`` diagnoses), the list is redrawn, the CSV for download rewritten, and the correction
  control offered for the photos the model analysed (a photo list when there are several);
- "Save correction" is the public API endpoint ``/correct`` (the photos, the answer /diagnose returned for
  them, the photo number or "all", the class id or ``not_a_leaf``; out: the JSON of
  :func:`leaflens.apps.corrections.apply_correction`); the page says what happened in a chained private event,
  so the language switch can say it again;
- with ``--no-corrections`` (no store) there is no control and no ``/correct`` endpoint.
"""

from __future__ import annotations

import atexit
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from leaflens.apps.corrections import MB, NOT_A_LEAF, apply_correction, mixed_answer, render_correction
from leaflens.apps.history import (
    add_result,
    clean_stale_results,
    default_results_root,
    new_history,
    remove_session,
    render_history,
    write_session_csv,
)
from leaflens.apps.i18n import lang_from_choice, t
from leaflens.apps.service import DiagnosisService
from leaflens.apps.web_config import AppConfig

__all__ = ["CorrectionControl", "Feedback", "build_feedback", "wire_feedback"]


@dataclass
class CorrectionControl:
    """The "Wrong? The right answer is ..." components."""

    box: gr.Group
    head: gr.Markdown
    photo: gr.Dropdown
    label: gr.Dropdown
    save: gr.Button
    status: gr.Markdown
    result: gr.JSON  # hidden: what /correct answered, for the status line in the page's language


@dataclass
class Feedback:
    """The components :func:`build_feedback` made (``correct`` is None without a corrections folder)."""

    history: gr.State
    history_box: gr.Accordion
    history_md: gr.Markdown
    download: gr.DownloadButton
    correct: CorrectionControl | None = None


_OWN_ROOTS: set[Path] = set()  # default results folders this process removes when it exits


def _results_root(cfg: AppConfig) -> Path:
    """``cfg.results_root``, else this server's own folder (a killed server's leftovers removed first)."""
    if cfg.results_root is not None:
        return cfg.results_root
    root = default_results_root()
    if root not in _OWN_ROOTS:
        _OWN_ROOTS.add(root)
        clean_stale_results()
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _label_choices(service: DiagnosisService, lang: str) -> list[tuple[str, str]]:
    notes = service.notes
    return [(notes.name(c, lang), c) for c in service.predictor.classes] + [(t("not_a_leaf", lang), NOT_A_LEAF)]


def _photo_choices(answer: dict[str, Any] | None, lang: str, max_photos: int) -> list[tuple[str, str]]:
    """"All photos", then each photo the model analysed (the answer's), or every number up to ``max_photos``
    before any answer (so an API call may name any of them)."""
    choices = [(t("correct_all", lang), "all")]
    photos = (answer or {}).get("photos")
    if photos is None:
        return choices + [(str(n), str(n)) for n in range(1, max_photos + 1)]
    return choices + [(t("correct_photo_n", lang, n=n, name=p["name"]), str(n))
                      for n, p in enumerate(photos, 1) if p.get("ok")]


def build_feedback(service: DiagnosisService, cfg: AppConfig, lang: str) -> Feedback:
    """Create the correction control (when ``cfg.corrections`` is set) and the history, in the current layout."""
    root = _results_root(cfg)
    history = gr.State(new_history(), delete_callback=lambda value: remove_session(root, value))
    correct = None
    if cfg.corrections is not None:
        with gr.Group(visible=False, elem_id="correct") as box:
            head = gr.Markdown(t("correct_heading", lang), elem_id="correct-heading")
            with gr.Row():
                photo = gr.Dropdown(_photo_choices(None, lang, service.options.max_photos), value="all",
                                    label=t("correct_photo", lang), visible=False, elem_id="correct-photo",
                                    allow_custom_value=True)
                # custom values (here and for the photo) reach apply_correction, which refuses a class the model
                # lacks with its own message (Gradio's check answered API callers with a traceback in the log)
                label = gr.Dropdown(_label_choices(service, lang), value=None, label=t("correct_label", lang),
                                    elem_id="correct-label", allow_custom_value=True)
            save = gr.Button(t("correct_save", lang), elem_id="correct-save")
            status = gr.Markdown("", elem_id="correct-status")
            result = gr.JSON(visible=False, label="correct")
        correct = CorrectionControl(box, head, photo, label, save, status, result)
    with gr.Accordion(t("history", lang), open=True, visible=False, elem_id="history-box") as history_box:
        history_md = gr.Markdown(t("history_empty", lang), elem_id="history")
        download = gr.DownloadButton(t("download", lang), visible=False, elem_id="download")
    return Feedback(history, history_box, history_md, download, correct)


def wire_feedback(fb: Feedback, service: DiagnosisService, cfg: AppConfig, *, files: gr.File, answer: gr.JSON,
                  lang_input: gr.Radio | gr.Dropdown) -> None:
    """Connect the feedback components to the page's photos, answer and language switch (see module doc)."""
    store = cfg.corrections
    control = fb.correct
    notes = service.notes
    root = _results_root(cfg)
    top_k = service.options.top_k
    max_photos = service.options.max_photos

    def full_text(diagnosis: dict[str, Any] | None, lang: str) -> str:
        """Say so when the folder is full and there is a photo to correct."""
        if store is None or not any(p.get("ok") for p in (diagnosis or {}).get("photos") or []):
            return ""
        if not store.is_full():
            return ""
        return t("correct_full", lang, used=f"{store.used_bytes(max_age_s=5.0) / MB:.1f}",
                 cap=f"{store.max_bytes / MB:g}")

    def correction_updates(result: dict[str, Any] | None, lang: str) -> list[Any]:
        """The correction control for a new answer: shown when the model analysed a photo of it."""
        if store is None:
            return []
        seen = sum(bool(p.get("ok")) for p in (result or {}).get("photos") or [])
        full = full_text(result, lang)
        return [gr.update(visible=seen > 0),
                # photos that may be of different things: which one the correction is for is asked
                gr.update(choices=_photo_choices(result, lang, max_photos),
                          value=None if mixed_answer(result) else "all", visible=seen > 1),
                gr.update(value=None), gr.update(interactive=not full), full, None]

    def on_answer(result: dict[str, Any] | None, history: dict[str, Any] | None, lang_choice: str):
        lang = lang_from_choice(lang_choice)
        history = history or new_history()
        download = gr.update()  # a cleared answer leaves the session's download as it was
        if result and result.get("photos"):
            history = add_result(history, result)
            history, csv_path = write_session_csv(root, history, top_k, lang=lang)
            download = gr.update(value=str(csv_path), visible=csv_path is not None)
        return (history, gr.update(visible=bool(history.get("entries"))), render_history(history, notes, lang),
                download, *correction_updates(result, lang))

    outputs: list[Any] = [fb.history, fb.history_box, fb.history_md, fb.download]
    if control is not None:
        outputs += [control.box, control.photo, control.label, control.save, control.status, control.result]
    answer.change(on_answer, inputs=[answer, fb.history, lang_input], outputs=outputs,
                  api_visibility="private", queue=False)

    if store is not None and control is not None:
        def correct(photos: list[str] | None, diagnosis: dict[str, Any] | None, photo: str | None,
                    label: str | None) -> dict[str, Any]:
            """Save the diagnosed photos (all, or the one numbered ``photo``) as class ``label`` (or
            "not_a_leaf") in the server's corrections folder, for the next training run."""
            return apply_correction(store, photos, diagnosis, photo, label, answered=service.answered)

        def said(result: dict[str, Any] | None, lang_choice: str) -> str:
            return render_correction(result, notes, lang_from_choice(lang_choice))

        control.save.click(correct, inputs=[files, answer, control.photo, control.label], outputs=[control.result],
                           api_name="correct", concurrency_limit=cfg.concurrency, concurrency_id="correct",
                           show_progress="minimal").then(
            said, inputs=[control.result, lang_input], outputs=[control.status], api_visibility="private",
            queue=False)

    def relabel(lang_choice: str, history: dict[str, Any] | None, diagnosis: dict[str, Any] | None,
                result: dict[str, Any] | None = None):
        lang = lang_from_choice(lang_choice)
        download = gr.update(label=t("download", lang))
        if history and history.get("entries") and history.get("token"):  # the CSV's messages follow the switch
            _, csv_path = write_session_csv(root, history, top_k, lang=lang)
            download = gr.update(label=t("download", lang), value=str(csv_path))
        out: list[Any] = [gr.update(label=t("history", lang)), render_history(history, notes, lang), download]
        if control is not None:
            out += [t("correct_heading", lang),
                    gr.update(label=t("correct_photo", lang), choices=_photo_choices(diagnosis, lang, max_photos)),
                    gr.update(label=t("correct_label", lang), choices=_label_choices(service, lang)),
                    gr.update(value=t("correct_save", lang)),
                    render_correction(result, notes, lang) if result else full_text(diagnosis, lang)]
        return out

    relabel_inputs: list[Any] = [lang_input, fb.history, answer]
    relabel_outputs: list[Any] = [fb.history_box, fb.history_md, fb.download]
    if control is not None:
        relabel_inputs.append(control.result)
        relabel_outputs += [control.head, control.photo, control.label, control.save, control.status]
    lang_input.change(relabel, inputs=relabel_inputs, outputs=relabel_outputs, api_visibility="private",
                      queue=False)
