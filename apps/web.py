"""The leaflens web page (Gradio Blocks): drop leaf photos, get ranked diagnoses.

Layout: a language switch (English / 中文), then two tabs.

- "Diagnose": a file drop zone for the photos of one plant (a new upload replaces them; "Add photos"
  adds to them; "Take a photo" opens a phone's camera), a Diagnose button, the ranked labels
  (``gr.Label``, for a diagnosis only), the verdict in plain words (a diagnosis; "unsure between" two
  classes; "does not look like the leaves or pests this model knows"; the photos disagree; or why a
  photo was not analysed), the class notes (what it is, what to do; for a diagnosis only), a per-photo
  table when there are several files or a file could not be used, "Wrong? The right answer is ..." and
  the diagnoses since the page was opened with their CSV (leaflens.apps.web_feedback), the answer as
  JSON (closed), and example photos from the training data (clicking one diagnoses it). On a phone the
  answer comes right below the photos and is scrolled into view after Diagnose.
- "Model": the model card (classes, test accuracy with its confidence interval, input size,
  provider, parameters, how the "unsure" and out-of-domain thresholds were chosen and what they cost
  on validation) and the run's confusion matrix and training curves.

The Diagnose button's event is the public API endpoint ``/diagnose`` (files in, the JSON of
:func:`leaflens.apps.diagnosis.summarise` out); the page then renders that JSON in the chosen language in a
chained, private event, so a language switch re-renders the last answer without asking the model
again. The language follows ``?lang=``, the choice remembered in the browser, or the browser's own, and
Gradio's words follow it (leaflens.apps.web_assets, with the page's style sheet and script). "Save
correction" is the public endpoint ``/correct`` (see leaflens.apps.web_feedback). Gradio's
queue feeds the service's dynamic batcher: up to ``concurrency`` requests run at
once (each decoding its photos and submitting them to the shared batcher) and at most
``queue_size`` more wait.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import gradio as gr

from leaflens.apps.diagnosis import PhotoOutcome, photo_caption, photo_names, render, summarise
from leaflens.apps.i18n import LANG_CHOICES, lang_from_choice, t
from leaflens.apps.model_info import model_markdown, page_banner, run_images
from leaflens.apps.privacy import privacy_markdown
from leaflens.apps.service import DiagnosisService
from leaflens.apps.web_assets import (
    CSS,
    JS_ADDED,
    JS_APPLY_LANG,
    JS_EDITED,
    JS_PHOTO_SET,
    JS_PHOTOGRAPHED,
    JS_PICK_LANG,
    JS_REMEMBER_LANG,
    JS_REVEAL,
    JS_UPLOADED,
    gradio_i18n,
    heic_supported,
    page_head,
    photos_label,
    upload_cap_bytes,
)
from leaflens.apps.web_config import AppConfig
from leaflens.apps.web_feedback import build_feedback, wire_feedback

__all__ = ["AppConfig", "build_app", "launch"]

log = logging.getLogger("leaflens.serve")


# Uploaded files shown back as thumbnails (what browsers display; HEIC and TIFF are not).
BROWSER_FORMATS = (".jpg", ".jpeg", ".jfif", ".jpe", ".png", ".webp", ".gif", ".bmp")
EXAMPLE_COLUMNS = 8  # example tiles per row on a wide screen (a phone fits as many as its width allows)


def build_app(service: DiagnosisService, config: AppConfig | None = None) -> gr.Blocks:
    """The Blocks app around ``service`` (queue configured; call :func:`launch` or ``.launch()``)."""
    cfg = config or AppConfig()
    notes = service.notes
    predictor = service.predictor
    opts = service.options
    images = run_images(cfg.context)
    batching = (opts.max_batch_size, opts.max_wait_ms)
    lang0 = lang_from_choice(cfg.lang)
    heic = heic_supported()  # the upload box names HEIC only when this server reads it

    def example_items(lang: str) -> list[tuple[str, str]]:
        return [(str(p), notes.name(p.stem.rsplit("_", 1)[0] if p.stem not in predictor.classes else p.stem, lang))
                for p in cfg.examples]

    with gr.Blocks(title="leaflens", analytics_enabled=False) as demo:
        title = gr.Markdown(t("title", lang0))
        # "demo model: trained on drawn leaves" or "no better than guessing" above everything (leaflens.apps.model_info)
        banner = gr.Markdown(page_banner(predictor.card, cfg.context, lang0),
                             visible=bool(page_banner(predictor.card, cfg.context, lang0)), elem_id="demo-banner")
        with gr.Row():
            intro = gr.Markdown(t("intro", lang0), elem_id="intro")
            lang_radio = gr.Radio([(label, code) for code, label in LANG_CHOICES.items()], value=lang0,
                                  label=t("language", lang0), elem_id="lang", scale=0, min_width=200)
        with gr.Tabs():
            with gr.Tab(t("tab_diagnose", lang0), id="diagnose") as tab_diagnose:
                with gr.Row():
                    with gr.Column(scale=1):
                        files = gr.File(label=photos_label(lang0, heic), file_count="multiple", type="filepath",
                                        elem_id="photos")
                        # the paths of the photo set last shown, kept in the browser: an upload replaces the set
                        known = gr.JSON([], visible=False, elem_id="photo-set")
                        with gr.Row():
                            add = gr.UploadButton(t("add_photos", lang0), file_count="multiple", type="filepath",
                                                  size="md", elem_id="add-photos")
                            camera = gr.UploadButton(t("camera", lang0), file_count="single", type="filepath",
                                                     size="md", elem_id="camera")
                        with gr.Row():
                            go = gr.Button(t("diagnose", lang0), variant="primary", elem_id="diagnose")
                            clear = gr.Button(t("clear", lang0), elem_id="clear")
                        shown = gr.Gallery(label=t("gallery", lang0), columns=4, height=260, object_fit="contain",
                                           interactive=False, visible=False, elem_id="your-photos", buttons=[])
                    with gr.Column(scale=1, elem_id="result"):  # on a phone: right below the photos
                        label = gr.Label(label=t("ranking", lang0), num_top_classes=opts.top_k, elem_id="ranking",
                                         visible=False)
                        verdict = gr.Markdown(t("waiting", lang0), elem_id="verdict")
                        notes_md = gr.Markdown("", elem_id="notes")
                        table = gr.Markdown("", elem_id="per-photo")
                        feedback = build_feedback(service, cfg, lang0)  # "Wrong?", history, CSV download
                        with gr.Accordion(t("details", lang0), open=False) as details:
                            answer = gr.JSON(label="diagnose", elem_id="answer")
                gallery = gr.Gallery(example_items(lang0), label=t("examples", lang0), columns=EXAMPLE_COLUMNS,
                                     height=120 * max(1, math.ceil(len(cfg.examples) / EXAMPLE_COLUMNS)) + 30,
                                     allow_preview=False, interactive=False, buttons=[],
                                     visible=bool(cfg.examples), elem_id="examples")
            with gr.Tab(t("tab_model", lang0), id="model") as tab_model:
                model_md = gr.Markdown(model_markdown(predictor, cfg.context, lang0, notes, batching),
                                       elem_id="model-card")
                with gr.Row():
                    confusion = gr.Image(str(images["confusion"]) if "confusion" in images else None,
                                         label=t("confusion", lang0), interactive=False, elem_id="confusion",
                                         visible="confusion" in images, buttons=["fullscreen"])
                    curves = gr.Image(str(images["curves"]) if "curves" in images else None,
                                      label=t("curves", lang0), interactive=False, visible="curves" in images,
                                      buttons=["fullscreen"], elem_id="curves")

        def diagnose(photos: list[str] | None) -> dict[str, Any]:
            """Diagnose one or several leaf photos; returns ranked classes per photo and their combined vote."""
            try:
                return service.diagnose(photos or [])
            except Exception:  # never a traceback in the page: log it, answer with a clear message
                log.exception("diagnose failed")
                names = photo_names(photos or [])
                return summarise([PhotoOutcome(n, reason="internal") for n in names], predictor.classes,
                                 predictor.card.uncertain_threshold, given=len(names))

        def show(result: dict[str, Any] | None, lang: str, paths: list[str] | None):
            lang = lang_from_choice(lang)
            value, verdict_text, notes_text, table_text = render(result, lang, notes, opts.max_photos,
                                                                 predictor.classes)
            items = photo_items(result, paths, lang)
            return (gr.update(value=value, visible=value is not None), verdict_text, notes_text, table_text,
                    gr.update(value=items, visible=bool(items)))

        def photo_items(result: dict[str, Any] | None, paths: list[str] | None, lang: str) -> list[tuple[str, str]]:
            """The uploaded photos the model saw that a browser can show, captioned with their own answer."""
            return [(path, photo_caption(photo, notes, lang))
                    for photo, path in zip((result or {}).get("photos", []), paths or [])
                    if photo["ok"] and Path(path).suffix.lower() in BROWSER_FORMATS
                    and Path(path).is_file()]  # answered uploads are deleted (leaflens.apps.uploads)

        def relabel(lang_choice: str, result: dict[str, Any] | None, paths: list[str] | None):
            lang = lang_from_choice(lang_choice)
            return (
                t("title", lang), t("intro", lang), gr.update(label=t("language", lang)),
                gr.update(label=t("tab_diagnose", lang)), gr.update(label=t("tab_model", lang)),
                gr.update(label=photos_label(lang, heic)), gr.update(value=t("diagnose", lang)),
                gr.update(value=t("clear", lang)), gr.update(label=t("add_photos", lang)),
                gr.update(label=t("camera", lang)),
                gr.update(value=example_items(lang), label=t("examples", lang)),
                gr.update(label=t("ranking", lang)), gr.update(label=t("details", lang)),
                model_markdown(predictor, cfg.context, lang, notes, batching),
                gr.update(label=t("confusion", lang)), gr.update(label=t("curves", lang)),
                *show(result, lang, paths)[:4], gr.update(label=t("gallery", lang),
                                                          value=photo_items(result, paths, lang)),
            )

        def pick_example(evt: gr.SelectData, lang: str):
            index = evt.index if isinstance(evt.index, int) else evt.index[0]
            return ([str(cfg.examples[index])], None, *show(None, lang, None))

        def reset(lang: str):
            return (None, [], None, *show(None, lang, None))

        rendered = [label, verdict, notes_md, table, shown]
        private: dict[str, Any] = {"api_visibility": "private", "queue": False}
        go.click(diagnose, inputs=[files], outputs=[answer], api_name="diagnose",
                 concurrency_limit=cfg.concurrency, concurrency_id="diagnose").then(
            show, inputs=[answer, lang_radio, files], outputs=rendered, **private).then(
            None, js=JS_REVEAL, **private)  # on a phone the answer is below the photos: bring it into view
        gallery.select(pick_example, inputs=[lang_radio], outputs=[files, answer, *rendered], **private).then(
            None, inputs=[files], outputs=[known], js=JS_PHOTO_SET, **private).then(
            diagnose, inputs=[files], outputs=[answer], api_visibility="private",
            concurrency_limit=cfg.concurrency, concurrency_id="diagnose").then(
            show, inputs=[answer, lang_radio, files], outputs=rendered, **private).then(
            None, js=JS_REVEAL, **private)
        clear.click(reset, inputs=[lang_radio], outputs=[files, known, answer, *rendered], **private)
        # One plant per diagnosis: a new upload replaces the photos, "Add photos" adds to them, and every change
        # clears the old answer. Done in the browser (web_assets), at once, so a Diagnose pressed right after an
        # upload can neither see the previous plant's photos nor have its answer wiped by a late reply.
        files.upload(None, inputs=[files, known], outputs=[files, known, answer, *rendered], js=JS_UPLOADED,
                     **private)
        add.upload(None, inputs=[add, files], outputs=[files, known, add, answer, *rendered], js=JS_ADDED, **private)
        camera.upload(None, inputs=[camera], outputs=[files, known, camera, answer, *rendered], js=JS_PHOTOGRAPHED,
                      **private)
        for removed in (files.delete, files.clear):
            removed(None, inputs=[files], outputs=[known, answer, *rendered], js=JS_EDITED, **private)
        lang_radio.change(relabel, inputs=[lang_radio, answer, files],
                          outputs=[title, intro, lang_radio, tab_diagnose, tab_model, files, go, clear, add, camera,
                                   gallery, label, details, model_md, confusion, curves, *rendered],
                          api_visibility="private", queue=False)
        # The language: ?lang=, the remembered choice, else the browser's (web_assets.page_head); Gradio's own
        # words and <html lang> follow the switch; a choice made with the switch is remembered.
        demo.load(None, outputs=[lang_radio], js=JS_PICK_LANG, **private)
        lang_radio.change(None, inputs=[lang_radio], js=JS_APPLY_LANG, **private)
        lang_radio.input(None, inputs=[lang_radio], js=JS_REMEMBER_LANG, **private)
        # what is kept of the photos, where, how long (leaflens.apps.privacy), from the server's own settings
        kept_for_training = getattr(getattr(cfg, "corrections", None), "root", None)
        privacy = gr.Markdown(privacy_markdown(service.uploads, kept_for_training, lang0), elem_id="privacy")

        def page_words(choice: str) -> tuple[str, str]:
            lang = lang_from_choice(choice)
            return (page_banner(predictor.card, cfg.context, lang),
                    privacy_markdown(service.uploads, kept_for_training, lang))

        lang_radio.change(page_words, inputs=[lang_radio], outputs=[banner, privacy], api_visibility="private",
                          queue=False)
        wire_feedback(feedback, service, cfg, files=files, answer=answer, lang_input=lang_radio)

    demo.queue(max_size=cfg.queue_size, default_concurrency_limit=cfg.concurrency)
    return demo


def launch(demo: gr.Blocks, service: DiagnosisService, config: AppConfig, host: str = "127.0.0.1",
           port: int = 7860, share: bool = False, block: bool = True, quiet: bool = False) -> gr.Blocks:
    """Start the server (``block=False`` returns once it listens, for tests and benchmarks)."""
    allowed = [str(p.parent) for p in config.examples[:1]]
    if config.context.run_dir is not None:
        allowed.append(str(config.context.run_dir))
    # Gradio's limit is above the app's, so a file too big gets the app's own answer ("the file is 25 MB; the
    # largest accepted is 20 MB", in the page's language and through the API) instead of Gradio's popup.
    demo.launch(server_name=host, server_port=port, share=share, inbrowser=False, show_error=False,
                max_file_size=upload_cap_bytes(service.max_upload_bytes), allowed_paths=allowed,
                prevent_thread_lock=not block, quiet=quiet, footer_links=["api"], css=CSS, ssr_mode=False,
                head=page_head(config.lang, heic_supported()), i18n=gradio_i18n(),
                # Gradio keeps per-session state for 10,000 sessions by default and every API call is a
                # session: measured ~56 KB each (docs/reliability.md). 200 keeps a long-running server flat.
                state_session_capacity=200,
                # nothing leaves the machine: no run history (Gradio 6 keeps each call's inputs, the photos, in
                # the browser and can send them to a Hugging Face bucket)
                run_history=False)
    return demo
