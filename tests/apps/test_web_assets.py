"""The page's style sheet, head script and Gradio words (leaflens.apps.web_assets), without a browser.

What the script does in a browser is checked in test_web_page.py (slow, Chromium); here: what the server
puts into the page, that HEIC is offered exactly when it can be read, the upload limits, and that the
Gradio build still exports the function the language switch relies on.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from leaflens.apps.i18n import LANGS, t
from leaflens.apps.web_assets import (
    GRADIO_LOCALES,
    JS_ADDED,
    JS_EDITED,
    JS_PHOTOGRAPHED,
    JS_UPLOADED,
    UPLOAD_CAP_FACTOR,
    accept_filter,
    gradio_core_module,
    heic_supported,
    page_head,
    photos_label,
    upload_cap_bytes,
)


def _config(head: str) -> dict:
    match = re.search(r"const CFG = (\{.*?\});\n", head)
    assert match, head[:300]
    return json.loads(match.group(1))


@pytest.mark.parametrize("heic", [False, True])
def test_the_upload_box_offers_heic_only_when_the_server_reads_it(heic):
    for lang in LANGS:
        label = photos_label(lang, heic)
        assert ("HEIC" in label) is heic, label
        assert "{" not in label and t("formats_heic" if heic else "formats", lang) in label
    assert accept_filter(heic) == ("image/*,.heic,.heif" if heic else "image/*")
    cfg = _config(page_head("en", heic))
    assert cfg["accept"] == accept_filter(heic)
    assert ("HEIC" in cfg["labels"]["zh"]["photos"]) is heic


def test_heic_support_is_pillow_heif():
    assert heic_supported() is (importlib.util.find_spec("pillow_heif") is not None)


def test_head_script_carries_both_languages_and_the_server_default():
    cfg = _config(page_head("zh", heic=False))
    assert cfg["fallback"] == "zh" and cfg["langs"] == list(LANGS)
    assert _config(page_head("fr"))["fallback"] == "en"  # an unknown default falls back to English
    assert cfg["gradioLocales"] == GRADIO_LOCALES and cfg["storageKey"] == "leaflens.lang"
    for lang in LANGS:
        labels = cfg["labels"][lang]
        assert labels["waiting"] == t("waiting", lang) and labels["drop"] == t("upload_drop", lang)
        assert labels["remove"] == t("remove_photo", lang, name="{name}")
        assert set(labels["gradio"]) == {"Fullscreen", "Exit fullscreen", "Exit fullscreen mode", "Upload", "Clear",
                                         "Close", "Gradio footer navigation", "More tabs"}
    assert cfg["inputs"]["#camera"] == {"label": "camera", "capture": True}
    assert set(cfg["inputs"]) == {"#photos", "#add-photos", "#camera"}


def test_head_script_cannot_be_closed_by_its_own_text(monkeypatch):
    from leaflens.apps.i18n import STRINGS

    monkeypatch.setitem(STRINGS["en"], "camera", "Take a </script><b>photo</b>")
    head = page_head("en")
    assert head.startswith("<script>") and head.endswith("</script>")
    assert head.count("</script>") == 1  # "</" inside the configuration is escaped
    assert _config(head)["labels"]["en"]["camera"] == "Take a </script><b>photo</b>"


def test_photo_set_scripts_call_the_head_script():
    for js, name in ((JS_UPLOADED, "uploaded"), (JS_ADDED, "added"), (JS_PHOTOGRAPHED, "photographed"),
                     (JS_EDITED, "edited")):
        assert f"window.leaflens.{name}(" in js
        assert f"function {name}(" in page_head("en")


def test_gradio_refuses_only_far_larger_files_than_the_app():
    limit = 20 * 1024 * 1024
    assert upload_cap_bytes(limit) == UPLOAD_CAP_FACTOR * limit > limit


def test_the_gradio_build_exports_change_locale():
    """The language switch calls Gradio's changeLocale: a Gradio upgrade that renames or moves it fails here."""
    if importlib.util.find_spec("gradio") is None:
        pytest.skip("gradio is not installed")
    from pathlib import Path

    module = gradio_core_module()
    assert module is not None and module.startswith("assets/core-") and module.endswith(".js")
    spec = importlib.util.find_spec("gradio")
    source = (Path(next(iter(spec.submodule_search_locations))) / "templates" / "frontend" / module).read_text()
    assert re.search(r"\bas changeLocale\b", source), "Gradio's core module no longer exports changeLocale"
    assert _config(page_head("en"))["core"] == module
