"""What the web page carries besides its components: style sheet, a small script, Gradio's own words.

Kept apart from leaflens.apps.web so the page's layout code stays readable; importing this module does not
import Gradio (only :func:`gradio_i18n` does, when called). The browser tests (tests/apps/test_web_page.py)
check all of it at 1366 x 900 and 390 x 844, in English and Chinese.

- :data:`CSS`: phone first. Below 640 px the example and photo galleries fit as many tiles as the width
  allows instead of fixed 100 px columns (which ran past the right edge at 390 px), the language switch
  comes first, and the per-photo table becomes one card per photo (a table squeezed to 390 px broke
  "Confidence" into fragments).
- :func:`page_head`: a ``<script>`` for the page's ``<head>`` that defines ``window.leaflens``:

  - the language: ``?lang=en|zh`` first, then the choice remembered in ``localStorage``, then the
    browser's languages (the first of English or Chinese it lists), then the server's ``--lang``;
    a choice made with the switch (or ``?lang=``) is remembered across reloads; ``?lang=`` in the
    address follows the switch; ``<html lang>`` follows (screen readers, CJK fonts). Gradio's own words
    follow too. Gradio takes them from the browser's language and has no public call to change it, so
    the script calls the ``changeLocale`` export of the Gradio build's ``core`` module (found on disk by
    :func:`gradio_core_module`; the URL the page already loaded, so the same module instance): words
    Gradio looks up when it shows them (footer, status, popups) then follow. Words it renders once, when
    a component appears, and the accessible names it writes in English only ("Remove this file",
    "Thumbnail 1 of 8", "Fullscreen") are replaced in our components with ours, from
    :mod:`leaflens.apps.i18n` (the upload box's "Drop File Here - or - Click to Upload" included);
  - the file inputs: an image-only ``accept`` filter (``image/*``, plus ``.heic,.heif`` when the
    server reads HEIC; set here rather than with Gradio's ``file_types``, which would also make the
    server refuse a whole request with its own English error when one file is not an image, where the app
    answers for each file), ``capture="environment"`` on the camera button (a phone opens its camera
    directly; unlike Gradio's webcam source this needs no HTTPS), accessible names in the chosen language;
  - one plant per diagnosis: Gradio's file box adds every upload to the files it holds; after an upload
    the script keeps only the new files (compared by path: Gradio stores an upload in a folder named
    after its content's hash), "Add photos" keeps the old ones, and any change of the photos clears the
    answer. In the browser, at once: a Diagnose pressed right after an upload cannot see the previous
    plant's photos, nor have its answer wiped by a late reply;
  - the per-photo cards' labels (each cell gets its column's heading as ``data-label``);
  - after Diagnose, the answer is scrolled into view when it is not on screen (on a phone it sits
    below the photos) and announced to screen readers (``aria-live``).

- :func:`gradio_i18n`: words Gradio asks for but has no translation of, e.g. the status it announces
  to screen readers when an answer arrives (``common.complete``, read out as the raw key).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from leaflens.apps.i18n import DEFAULT_LANG, LANGS, t

__all__ = [
    "CSS", "GRADIO_LOCALES", "HTML_LANG", "JS_ADDED", "JS_APPLY_LANG", "JS_EDITED", "JS_PHOTOGRAPHED",
    "JS_PHOTO_SET", "JS_PICK_LANG", "JS_REMEMBER_LANG", "JS_REVEAL", "JS_UPLOADED", "STORAGE_KEY",
    "UPLOAD_CAP_FACTOR", "accept_filter", "gradio_core_module", "gradio_i18n", "heic_supported", "page_head",
    "photos_label", "upload_cap_bytes"
]

STORAGE_KEY = "leaflens.lang"
# Gradio's locale codes and the page's <html lang> for each interface language.
GRADIO_LOCALES = {"en": "en", "zh": "zh-CN"}
HTML_LANG = {"en": "en", "zh": "zh-CN"}
# Gradio refuses larger uploads itself, in its own English words; up to this many times the app's limit
# a file is uploaded so that the app can answer "the file is 25 MB; the largest accepted is 20 MB".
UPLOAD_CAP_FACTOR = 5
NARROW_PX = 640

CSS = f"""
#server-down {{
  position: sticky; top: 0; z-index: 1000; padding: 0.7em 1em; font-weight: 600;
  background: #b3261e; color: #fff; text-align: center;
}}
#server-down[hidden] {{ display: none; }}
#verdict {{ font-size: 1.15em; }}
#verdict p {{ margin: 0.3em 0; }}
#lang label:has(input:focus-visible) {{  /* Gradio's radio showed no keyboard focus at all */
  outline: 2px solid var(--color-accent); outline-offset: 2px;
}}
#photos [data-testid="block-label"] {{  /* the file box's upload and clear icons sit over its label's end */
  padding-right: 56px; box-sizing: border-box;
}}
#examples .caption-label, #your-photos .caption-label {{  /* "Leaf min…", "Bacterial …": whole, on two lines */
  white-space: normal !important; text-overflow: clip !important; overflow-wrap: anywhere; line-height: 1.15;
}}
#photos button.label-clear-button {{ min-width: 32px; min-height: 32px; }}  /* 7 px wide: too small for a finger */
#confusion .image-container, #curves .image-container {{  /* their label and full-screen button sat on the */
  padding-top: 32px; box-sizing: border-box;                /* chart's own title */
}}
#your-photos .grid-container {{  /* one photo filled the row's width and overflowed the box, its caption hidden */
  grid-template-columns: repeat(auto-fill, minmax(110px, 180px)) !important;
}}
@media (max-width: {NARROW_PX}px) {{
  #lang {{ order: -1; }}
  #correct .row {{ flex-direction: column; }}  /* "which photo" and the answer, each the width of the screen */
  #correct .row > * {{ width: 100% !important; min-width: 100% !important; }}
  #intro {{ min-width: 100% !important; }}
  #examples .grid-container, #your-photos .grid-container {{
    grid-template-columns: repeat(auto-fill, minmax(88px, 1fr)) !important;
  }}
  #examples, #your-photos, #examples .gallery-container, #your-photos .gallery-container,
  #examples .grid-wrap, #your-photos .grid-wrap {{ height: auto !important; max-height: none !important; }}
  #per-photo table, #per-photo tbody, #per-photo tr, #per-photo td {{
    display: block; width: 100% !important; box-sizing: border-box;
  }}
  #per-photo table {{ border: none; }}
  #per-photo thead {{ position: absolute; width: 1px; height: 1px; overflow: hidden; clip: rect(0 0 0 0); }}
  #per-photo tr {{
    border: 1px solid var(--border-color-primary); border-radius: var(--radius-md);
    margin: 0 0 0.6em 0; padding: 0.4em 0.7em;
  }}
  #per-photo td {{ border: none !important; padding: 0.1em 0 !important; text-align: left !important; }}
  #per-photo td:first-child {{ font-weight: 600; }}
  #per-photo td:first-child::before {{ content: "#"; }}
  #per-photo td:empty {{ display: none; }}
  #per-photo td[data-label]:not(:first-child)::before {{ content: attr(data-label) ": "; font-weight: 600; }}
}}
"""

# Event scripts (Gradio runs them in the browser; ``window.leaflens`` comes from page_head).
JS_PICK_LANG = "() => (window.leaflens ? window.leaflens.start() : null)"
JS_APPLY_LANG = "(lang) => { if (window.leaflens) window.leaflens.apply(lang, false); }"
JS_REMEMBER_LANG = "(lang) => { if (window.leaflens) window.leaflens.apply(lang, true); }"
JS_REVEAL = "() => { if (window.leaflens) window.leaflens.reveal(); }"
# The photo set (one plant per diagnosis). Outputs: the file box, the set's paths (a hidden JSON), [the upload
# button, emptied,] the answer and what shows it (ranking, verdict, notes, per-photo table, "Your photos").
WATCH_MS = 5000  # how often the page asks whether its server still answers (a HEAD request for the page)
JS_UPLOADED = "(files, known) => window.leaflens.uploaded(files, known)"
JS_ADDED = "(added, files) => window.leaflens.added(added, files)"
JS_PHOTOGRAPHED = "(photo) => window.leaflens.photographed(photo)"
JS_EDITED = "(files) => window.leaflens.edited(files)"
JS_PHOTO_SET = "(files) => window.leaflens.paths(files)"

_SCRIPT = r"""
(() => {
  const CFG = __CFG__;
  const valid = (l) => CFG.langs.includes(l);
  let current = CFG.fallback;
  const gradioWords = {};  // Gradio's English name, or its translation in any language -> Gradio's name
  for (const labels of Object.values(CFG.labels)) {
    for (const [key, text] of Object.entries(labels.gradio)) { gradioWords[key] = key; gradioWords[text] = key; }
  }

  function chosen() {
    const q = new URLSearchParams(window.location.search).get("lang");
    if (valid(q)) return [q, true];
    try {
      const s = window.localStorage.getItem(CFG.storageKey);
      if (valid(s)) return [s, true];
    } catch (e) { /* storage disabled: follow the browser */ }
    const prefs = (navigator.languages && navigator.languages.length) ? navigator.languages
      : [navigator.language || ""];
    for (const l of prefs) {
      const base = String(l).toLowerCase().split("-")[0];
      if (valid(base)) return [base, false];
    }
    return [CFG.fallback, false];
  }

  let core = null;
  async function gradioLocale(lang) {
    try {
      if (!core) {
        let url = CFG.core ? new URL(CFG.core, document.baseURI).href : null;
        if (!url) {
          url = performance.getEntriesByType("resource").map((r) => r.name)
            .find((n) => /\/assets\/core-[^/]*\.js$/.test(n)) || null;
        }
        if (!url) return false;
        core = await import(url);
      }
      if (typeof core.changeLocale !== "function") return false;
      core.changeLocale(CFG.gradioLocales[lang] || lang);
      document.documentElement.dataset.gradioLocale = CFG.gradioLocales[lang] || lang;
      return true;
    } catch (e) {
      console.warn("leaflens: cannot switch Gradio's own words", e);
      return false;
    }
  }

  function decorate() {
    const L = CFG.labels[current] || CFG.labels[CFG.fallback];
    for (const [sel, spec] of Object.entries(CFG.inputs)) {
      const box = document.querySelector(sel);
      if (!box) continue;
      const inputs = [...box.querySelectorAll("input[type=file]")];
      const before = box.previousElementSibling;  // an upload button's input sits just before the button
      if (before && before.matches("input[type=file]")) inputs.push(before);
      for (const input of inputs) {
        if (input.getAttribute("accept") !== CFG.accept) input.setAttribute("accept", CFG.accept);
        if (spec.capture && input.getAttribute("capture") !== "environment") {
          input.setAttribute("capture", "environment");
        }
        const name = L[spec.label];
        if (name && input.getAttribute("aria-label") !== name) input.setAttribute("aria-label", name);
      }
    }
    for (const table of document.querySelectorAll("#per-photo table")) {
      const heads = [...table.querySelectorAll("thead th")].map((th) => th.textContent.trim());
      for (const row of table.querySelectorAll("tbody tr")) {
        [...row.children].forEach((td, i) => {
          if (heads[i] && td.dataset.label !== heads[i]) td.dataset.label = heads[i];
        });
      }
    }
    for (const prompt of document.querySelectorAll("#photos [data-testid=upload-text]")) {
      let seenOr = false;
      for (const node of prompt.childNodes) {  // Gradio's text nodes around its "- or -" span: ours instead
        if (node.nodeType === Node.ELEMENT_NODE && node.classList.contains("or")) {
          seenOr = true;
          if (node.textContent !== L.or) node.textContent = L.or;
        } else if (node.nodeType === Node.TEXT_NODE && node.nodeValue.trim()) {
          const text = seenOr ? " " + L.click : L.drop + " ";
          if (node.nodeValue !== text) node.nodeValue = text;
        }
      }
    }
    // Gradio's own accessible names that it does not translate (written in English in its components)
    const name = (el, text) => { if (el.getAttribute("aria-label") !== text) el.setAttribute("aria-label", text); };
    for (const button of document.querySelectorAll("#photos button.upload-container")) name(button, L.uploadAria);
    for (const button of document.querySelectorAll("#photos button.label-clear-button")) {
      const file = button.closest("tr") && button.closest("tr").querySelector("td.filename");
      name(button, L.remove.replace("{name}", file ? file.textContent.replace(/\s+/g, "") : ""));
    }
    for (const el of document.querySelectorAll("[aria-label], [title]")) {  // e.g. the images' "Fullscreen"
      for (const attr of ["aria-label", "title"]) {
        const key = gradioWords[el.getAttribute(attr)];
        if (key && el.getAttribute(attr) !== L.gradio[key]) el.setAttribute(attr, L.gradio[key]);
      }
    }
    for (const id of ["confusion", "curves"]) {  // the picture itself is a button: named after its heading
      const block = document.getElementById(id);
      const button = block && block.querySelector(".image-container > button");
      if (button) name(button, L[id]);
    }
    for (const gallery of document.querySelectorAll("#examples, #your-photos")) {
      const tiles = [...gallery.querySelectorAll("button.thumbnail-item")];
      tiles.forEach((tile, i) => {
        const caption = tile.querySelector(".caption-label");
        const text = L.thumbnail.replace("{i}", i + 1).replace("{n}", tiles.length)
          .replace("{caption}", caption ? caption.textContent.trim() : "");
        name(tile, text);
      });
    }
    const verdict = document.querySelector("#verdict [data-testid=markdown]");  // the words, not Gradio's timer
    if (verdict && verdict.getAttribute("aria-live") !== "polite") {
      verdict.setAttribute("aria-live", "polite");
      verdict.setAttribute("role", "status");
    }
    const result = document.getElementById("result");
    if (result && result.getAttribute("aria-label") !== L.answer) {
      result.setAttribute("role", "region");
      result.setAttribute("aria-label", L.answer);
    }
  }

  let pending = false;
  const observer = new MutationObserver(() => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; decorate(); });
  });
  const watch = () => {
    observer.observe(document.body, {childList: true, subtree: true, characterData: true});
    decorate();
  };
  if (document.body) watch(); else document.addEventListener("DOMContentLoaded", watch);

  let picked = false;  // the person used the switch already (before the page's own start, on a slow load)
  function apply(lang, remember) {
    if (!valid(lang)) return;
    current = lang;
    picked = picked || remember;
    document.documentElement.lang = CFG.htmlLang[lang] || lang;
    if (remember) {
      try { window.localStorage.setItem(CFG.storageKey, lang); } catch (e) { /* not remembered */ }
    }
    const url = new URL(window.location.href);
    if (url.searchParams.has("lang") && url.searchParams.get("lang") !== lang) {
      url.searchParams.set("lang", lang);
      window.history.replaceState(window.history.state, "", url);
    }
    gradioLocale(lang);
    decorate();
  }

  // The server stopped or cannot be reached: say so, in the page's language, until it answers again. Gradio's
  // own popups are English and go away, leaving the last answer on screen as if the page still worked.
  let watchingServer = false;
  function serverDown(down) {
    let bar = document.getElementById("server-down");
    if (down && !bar) {
      bar = document.createElement("div");
      bar.id = "server-down";
      bar.setAttribute("role", "alert");
      document.body.prepend(bar);
    }
    if (!bar) return;
    const L = CFG.labels[current] || CFG.labels[CFG.fallback];
    bar.textContent = L.serverDown;
    bar.hidden = !down;
  }
  function watchServer() {
    if (watchingServer) return;
    watchingServer = true;
    const check = async () => {
      let down = false;
      try {
        const r = await fetch(document.baseURI, {method: "HEAD", cache: "no-store"});
        down = !r.ok;
      } catch (e) { down = true; }
      serverDown(down);
    };
    setInterval(check, CFG.watchMs);
  }

  function start() {
    watchServer();
    if (picked) return current;  // never undo a choice made while the page was loading
    const [lang, explicit] = chosen();
    apply(lang, explicit);
    return lang;
  }
  current = chosen()[0];
  gradioLocale(current);  // as early as possible: Gradio renders some of its words once, when a component mounts

  function reveal() {
    const box = document.getElementById("result");
    if (!box) return;
    const top = box.getBoundingClientRect().top;
    if (top < 0 || top > window.innerHeight * 0.6) box.scrollIntoView({behavior: "smooth", block: "start"});
  }

  // One plant per diagnosis: the file box adds every upload to the files it holds; keep the new ones only.
  const list = (v) => (v ? (Array.isArray(v) ? v : [v]) : []);
  const pathOf = (f) => (typeof f === "string" ? f : f && f.path);
  const unique = (files) => {
    const seen = new Set();
    return files.filter((f) => pathOf(f) && !seen.has(pathOf(f)) && seen.add(pathOf(f)));
  };
  const paths = (files) => list(files).map(pathOf).filter(Boolean);
  function cleared() {  // [answer, ranking, verdict, notes, per-photo table, "Your photos"] before any answer
    const L = CFG.labels[current] || CFG.labels[CFG.fallback];
    return [null, {__type__: "update", value: {}, visible: false}, L.waiting, "", "",  // {}: Gradio's empty Label
            {__type__: "update", value: [], visible: false}];
  }
  function uploaded(files, known) {
    const before = list(known);
    const all = list(files);
    // The box appends an upload to the files it held, so the upload is what follows them: a photo chosen
    // again with new ones is part of it (Gradio gives the same bytes the same path, so telling the new ones
    // apart by path dropped it, and the answer was about fewer photos than chosen).
    const held = all.slice(0, before.length).map(pathOf);
    const appended = held.length === before.length && held.every((p, i) => p === before[i]);
    const known_ = new Set(before);
    const fresh = appended ? unique(all.slice(before.length)) : unique(all).filter((f) => !known_.has(pathOf(f)));
    const photos = fresh.length ? fresh : unique(all);  // the same photos again: keep them
    return [photos, paths(photos), ...cleared()];
  }
  function added(more, files) {
    const photos = unique([...list(files), ...list(more)]);
    return [photos, paths(photos), null, ...cleared()];
  }
  function photographed(photo) {
    const photos = list(photo);
    return [photos, paths(photos), null, ...cleared()];
  }
  function edited(files) {
    return [paths(files), ...cleared()];
  }

  window.leaflens = {start, apply, reveal, decorate, language: () => current,
                     uploaded, added, photographed, edited, paths};
})();
"""


def heic_supported() -> bool:
    """Whether this server reads HEIC/HEIF photos (pillow-heif installed), so the page may offer them."""
    return importlib.util.find_spec("pillow_heif") is not None


def accept_filter(heic: bool) -> str:
    """The file inputs' ``accept`` attribute: pictures only (phones then offer the camera and gallery)."""
    return "image/*,.heic,.heif" if heic else "image/*"


def photos_label(lang: str, heic: bool) -> str:
    """The upload box's label, naming HEIC only when the server can read it."""
    return t("photos", lang, formats=t("formats_heic" if heic else "formats", lang))


def upload_cap_bytes(max_upload_bytes: int) -> int:
    """Gradio's own upload limit: ``UPLOAD_CAP_FACTOR`` times the app's, see :data:`UPLOAD_CAP_FACTOR`."""
    return int(max_upload_bytes) * UPLOAD_CAP_FACTOR


def gradio_core_module() -> str | None:
    """``assets/core-<hash>.js`` of the installed Gradio's page (where its ``changeLocale`` lives), or None."""
    spec = importlib.util.find_spec("gradio")
    if spec is None or not spec.submodule_search_locations:
        return None
    assets = Path(next(iter(spec.submodule_search_locations))) / "templates" / "frontend" / "assets"
    found = sorted(assets.glob("core-*.js"))
    return f"assets/{found[0].name}" if len(found) == 1 else None


def page_head(default_lang: str = DEFAULT_LANG, heic: bool = False) -> str:
    """The ``<script>`` for the page's head (see the module docstring); ``default_lang`` is the server's
    ``--lang``, used when neither the address, a remembered choice nor the browser names a language."""
    cfg: dict[str, Any] = {
        "langs": list(LANGS),
        "fallback": default_lang if default_lang in LANGS else DEFAULT_LANG,
        "storageKey": STORAGE_KEY,
        "gradioLocales": GRADIO_LOCALES,
        "htmlLang": HTML_LANG,
        "core": gradio_core_module(),
        "accept": accept_filter(heic),
        "watchMs": WATCH_MS,
        "inputs": {"#photos": {"label": "photos"}, "#add-photos": {"label": "add"},
                   "#camera": {"label": "camera", "capture": True}},
        "labels": {lang: {"photos": photos_label(lang, heic), "add": t("add_photos", lang),
                          "camera": t("camera", lang), "answer": t("answer_region", lang),
                          "waiting": t("waiting", lang), "drop": t("upload_drop", lang), "or": t("upload_or", lang),
                          "click": t("upload_click", lang), "uploadAria": t("upload_aria", lang),
                          "remove": t("remove_photo", lang, name="{name}"),
                          "thumbnail": t("thumbnail", lang, i="{i}", n="{n}", caption="{caption}"),
                          "confusion": t("confusion", lang), "curves": t("curves", lang),
                          "serverDown": t("server_down", lang),
                          # Gradio's names, written once in the language the page opened with: the icon buttons
                          # of the upload box and of its pop-ups follow a switch of language too
                          "gradio": {"Fullscreen": t("fullscreen", lang), "Exit fullscreen": t("fullscreen_exit", lang),
                                     "Exit fullscreen mode": t("fullscreen_exit", lang),
                                     "Upload": t("gradio_upload", lang), "Clear": t("gradio_clear", lang),
                                     "Close": t("gradio_close", lang),
                                     "Gradio footer navigation": t("gradio_footer_nav", lang),
                                     "More tabs": t("gradio_more_tabs", lang)}}
                   for lang in LANGS},
    }
    script = _SCRIPT.replace("__CFG__", json.dumps(cfg, ensure_ascii=False).replace("</", "<\\/"))
    return f"<script>{script}</script>"


def gradio_i18n() -> Any:
    """``gr.I18n`` with the Gradio words it lacks, in English and Chinese (for ``launch(i18n=...)``)."""
    import gradio as gr

    done = {"en": "Done", "zh": "完成"}
    return gr.I18n(**{GRADIO_LOCALES[lang]: {"common.complete": done[lang], "common.upload": t("gradio_upload", lang)}
                      for lang in LANGS})
