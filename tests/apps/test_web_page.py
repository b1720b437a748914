"""The page as a person meets it, in headless Chromium: on a desktop (1366 x 900) and a phone (390 x 844),
in English and in Chinese (issue #19: phone first, one plant per diagnosis, language, camera, oversize files).

One server per module (`leaflens serve`'s own build path, a free local port) with a tiny 8-class model and
8 example photos, as many as the demo model's: four example tiles per row ran past a phone's right edge.
The browser follows the page's language from its own locale (``en-US`` or ``zh-CN``), as a visitor's does.
Marked ``slow`` and ``browser`` like test_web_server.py; skipped without Playwright or Chromium. With
``LEAFLENS_SCREENSHOT_DIR`` set, the phone and desktop pages are saved there.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
from apps_helpers import build_tiny_model, leaflens_metadata, make_dataset, ood_metadata, serve_args, tiny_weights
from apps_helpers import write_leaf as _write_leaf

from leaflens.apps.diagnosis import error_message
from leaflens.apps.i18n import t
from leaflens.apps.web_assets import HTML_LANG, accept_filter, heic_supported, photos_label

pytestmark = [pytest.mark.slow, pytest.mark.browser]
pytest.importorskip("gradio", reason="gradio is not installed (pip install 'leaflens[serve-cpu]')")

CLASSES = ["aphids", "bacterial_spot", "early_blight", "healthy", "leaf_miner", "mosaic_virus", "powdery_mildew",
           "rust"]  # the synthetic set's eight, sorted as preprocess gives them
SIZE = 32
VIEWPORTS = {"desktop": (1366, 900), "phone": (390, 844)}
LOCALES = {"en": "en-US", "zh": "zh-CN"}
GRADIO_API_WORDS = {"en": "Use via API", "zh": "通过 API 使用"}  # Gradio's own footer, in its own translation
# Accessible names Gradio writes in English whatever the language: the page replaces them in its components.
GRADIO_ENGLISH = ("common.", "Click to upload", "Remove this file", "Thumbnail", "Fullscreen", "Download All",
                  "Drop File Here", "Click to Upload", "Gradio footer navigation", "More tabs")


def _skip_without_browser() -> None:
    from leaflens.apps.screenshot import find_chromium

    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed (pip install 'leaflens[dev]')")
    if find_chromium() is None:
        pytest.skip("no Chromium browser found (apt-get install chromium, or set LEAFLENS_CHROMIUM)")


class Server:
    def __init__(self, root: Path) -> None:
        from leaflens.apps import cmd_serve
        from leaflens.apps.screenshot import free_port
        from leaflens.apps.web import launch

        self.root = root
        dataset = make_dataset(root, CLASSES, SIZE)
        weights = tiny_weights(len(CLASSES), seed=4)
        meta = leaflens_metadata(CLASSES, SIZE, **ood_metadata(-0.1, SIZE))
        model = build_tiny_model(root / "student.onnx", weights, SIZE, meta, ood=True)
        self.port = free_port()
        args = serve_args(model=model, dataset=dataset, port=self.port, max_upload_mb=1,
                          examples_cache=root / "examples", corrections=root / "corrections")
        self.service, self.demo, self.config = cmd_serve.build(args)
        launch(self.demo, self.service, self.config, port=self.port, block=False, quiet=True)
        self.url = f"http://127.0.0.1:{self.port}/"
        self.notes = self.service.notes

    def close(self) -> None:
        self.demo.close()
        self.service.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _skip_without_browser()
    srv = Server(tmp_path_factory.mktemp("page"))
    assert len(srv.config.examples) == 8
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def photos(server) -> list[Path]:
    """Leaf photos (colourful, detailed: each gets a class or "unsure", never a refusal), named a..f."""
    return [_write_leaf(server.root / f"{name}.jpg", (300, 200), seed=i, fmt="JPEG") for i, name in enumerate("abcdef")]


@pytest.fixture(scope="module")
def browser():
    _skip_without_browser()
    from playwright.sync_api import sync_playwright

    from leaflens.apps.screenshot import BROWSER_ARGS, find_chromium

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=find_chromium(), args=BROWSER_ARGS)
        yield chromium
        chromium.close()


def _open(browser, server, viewport: str, lang: str, query: str = "", context=None):
    """A page in a fresh browser whose own language is ``lang``; waits until the page shows its buttons."""
    width, height = VIEWPORTS[viewport]
    context = context or browser.new_context(viewport={"width": width, "height": height}, locale=LOCALES[lang])
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(server.url + query)
    page.wait_for_selector("#diagnose")
    return page


def _wait_language(page, lang: str) -> None:
    page.wait_for_function("t => (document.querySelector('#diagnose') || {}).innerText?.trim() === t",
                           arg=t("diagnose", lang))
    page.wait_for_function("t => (document.querySelector('#photos [data-testid=upload-text]') || {}).innerText"
                           "?.includes(t)", arg=t("upload_drop", lang))


def _upload(page, target: str, files: list[Path]) -> None:
    """Choose ``files`` with the file box (``photos``) or one of the buttons (``add-photos``, ``camera``)."""
    if target == "photos":
        chooser = page.locator("#photos input[type=file]")
    else:  # an upload button's input sits right before the button
        chooser = page.locator(f"#{target}").locator("xpath=preceding-sibling::input[@type='file'][1]")
    chooser.first.set_input_files([os.fspath(f) for f in files])


def _listed(page, names: list[str]) -> None:
    """Wait until the file box lists exactly ``names`` (in order)."""
    page.wait_for_function(
        "names => JSON.stringify([...document.querySelectorAll('#photos td.filename')]"
        ".map(e => e.textContent.replace(/\\s+/g, ''))) === JSON.stringify(names)", arg=names)


VERDICT = "#verdict [data-testid=markdown]"  # the words only (Gradio's progress timer sits beside them)
PER_PHOTO = "#per-photo [data-testid=markdown]"
_VERDICT_JS = f"document.querySelector('{VERDICT}').innerText.trim()"


def _waiting(lang: str) -> str:
    return t("waiting", lang).replace("**", "")


def _no_answer(page, lang: str) -> None:
    """The page shows no answer: the verdict asks for photos, no ranking, no table, no captioned photos."""
    page.wait_for_function(f"w => {_VERDICT_JS} === w", arg=_waiting(lang))
    assert not page.locator("#ranking").is_visible() and not page.locator("#your-photos").is_visible()
    assert page.inner_text(PER_PHOTO).strip() == ""


def _diagnose(page, lang: str) -> str:
    page.click("#diagnose")
    page.wait_for_function(f"w => {{ const v = {_VERDICT_JS}; return v && v !== w; }}",
                           arg=_waiting(lang))  # the chained render has shown it
    return page.inner_text(VERDICT)


def _too_wide(page) -> list[str]:
    """Visible elements that reach past the right edge of the viewport (or the page scrolling sideways).
    An element cut off by an ancestor that clips its overflow inside the viewport is not seen past the edge
    (Gradio's progress bar slides in from -100 % inside its clipped track while a request is pending)."""
    return page.evaluate("""() => {
        const width = document.documentElement.clientWidth, out = [];
        const inside = r => r.left >= -1 && r.right <= width + 1;
        const clipped = el => {
            for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
                const cs = getComputedStyle(p);
                if (/hidden|clip/.test(cs.overflowX)) return inside(p.getBoundingClientRect());
            }
            return false;
        };
        if (document.documentElement.scrollWidth > width + 1) out.push('page ' + document.documentElement.scrollWidth);
        for (const el of document.querySelectorAll('body *')) {
            const r = el.getBoundingClientRect(), s = getComputedStyle(el);
            if (!r.width || !r.height || s.visibility === 'hidden' || s.display === 'none') continue;
            if ((r.right > width + 1 || r.left < -1) && !clipped(el))
                out.push(`${el.tagName}#${el.id}.${String(el.className).slice(0, 40)} ${r.left}..${r.right}`);
        }
        return out.slice(0, 10);
    }""")


def _answer_on_screen(page) -> bool:
    return page.evaluate("() => { const r = document.querySelector('#result').getBoundingClientRect();"
                         " return r.top >= -1 && r.top < window.innerHeight * 0.6; }")


def _shots() -> Path | None:
    where = os.environ.get("LEAFLENS_SCREENSHOT_DIR")
    return Path(where) if where else None


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("viewport", ["desktop", "phone"])
def test_phone_first_one_plant_per_diagnosis_and_the_camera(server, photos, browser, viewport, lang):
    a, b, c, d, e, _ = photos
    page = _open(browser, server, viewport, lang)
    try:
        _wait_language(page, lang)  # the browser's own language, on a first visit
        assert page.evaluate("() => document.documentElement.lang") == HTML_LANG[lang]
        assert page.inner_text("#photos").startswith(photos_label(lang, heic_supported()))
        inputs = page.evaluate("() => [...document.querySelectorAll('input[type=file]')].map(i => "
                               "[i.getAttribute('accept'), i.getAttribute('capture'), i.getAttribute('aria-label')])")
        accept = accept_filter(heic_supported())  # image-only choosers; the camera button opens the camera
        assert sorted(inputs, key=str) == sorted([[accept, None, photos_label(lang, heic_supported())],
                                                  [accept, None, t("add_photos", lang)],
                                                  [accept, "environment", t("camera", lang)]], key=str), inputs
        assert _too_wide(page) == []

        # a diagnosis; on the phone the answer is below the photos and is brought into view
        _upload(page, "photos", [a, b])
        _listed(page, ["a.jpg", "b.jpg"])
        verdict = _diagnose(page, lang)
        assert "a.jpg" in page.inner_text(PER_PHOTO), verdict
        page.wait_for_function("() => { const r = document.querySelector('#result').getBoundingClientRect();"
                               " return r.top >= -1 && r.top < window.innerHeight * 0.6; }")
        if viewport == "phone":  # it was scrolled to (smoothly: wait until it has arrived), not already there
            page.wait_for_function("() => Math.abs(document.querySelector('#result').getBoundingClientRect().top) < 2")
            assert page.evaluate("() => window.scrollY") > 300
        # the per-photo table: stacked cards on the phone, each value with its column's name; a table on a desktop
        page.wait_for_function("() => document.querySelectorAll('#per-photo td[data-label]').length === 8")
        rows = page.evaluate("() => [...document.querySelectorAll('#per-photo tbody tr')].map(r => "
                             "[getComputedStyle(r).display, r.getBoundingClientRect().width, "
                             "[...r.children].map(td => getComputedStyle(td, '::before').content)])")
        assert len(rows) == 2, rows
        for display, width, before in rows:
            if viewport == "phone":
                assert display == "block" and width <= VIEWPORTS["phone"][0]
                assert before[0] == '"#"' and before[2] == f'"{t("col_result", lang)}: "', before
            else:
                assert display == "table-row"
        assert _too_wide(page) == []
        if _shots() and lang == "en":
            _shots().mkdir(parents=True, exist_ok=True)
            page.screenshot(path=os.fspath(_shots() / f"app_{viewport}.png"), full_page=viewport == "desktop")

        # a new upload is a new plant: it replaces the photos and the old answer is gone at once
        _upload(page, "photos", [c])
        _listed(page, ["c.jpg"])
        _no_answer(page, lang)
        _diagnose(page, lang)
        # one photo under "Your photos" fits its box, caption included (it filled the row's width and overflowed)
        page.wait_for_function("() => document.querySelectorAll('#your-photos img').length === 1")
        fits = page.evaluate("() => { const box = document.querySelector('#your-photos').getBoundingClientRect();"
                             " return [...document.querySelectorAll('#your-photos img, #your-photos .caption-label')]"
                             ".map(e => e.getBoundingClientRect().bottom <= box.bottom + 1); }")
        assert fits and all(fits), fits
        # "Add photos" keeps them (and clears the answer, which was about fewer photos)
        _upload(page, "add-photos", [d])
        _listed(page, ["c.jpg", "d.jpg"])
        _no_answer(page, lang)
        verdict = _diagnose(page, lang)
        table = page.inner_text(PER_PHOTO)
        assert "c.jpg" in table and "d.jpg" in table, verdict
        # removing a photo is a change too
        page.locator("#photos button.label-clear-button").last.click()
        _listed(page, ["c.jpg"])
        _no_answer(page, lang)
        # a photo from the camera starts a new plant as well
        _upload(page, "camera", [e])
        _listed(page, ["e.jpg"])
        _no_answer(page, lang)
        _diagnose(page, lang)
        # a new upload holding a photo of the last one keeps it: every photo chosen is the new plant's
        _upload(page, "photos", [e, a])
        _listed(page, ["e.jpg", "a.jpg"])
        _upload(page, "photos", [a])
        _listed(page, ["a.jpg"])
        assert page.evaluate("() => JSON.stringify(window.leaflens.language())") == f'"{lang}"'
    finally:
        page.context.close()


@pytest.mark.parametrize("viewport", ["desktop", "phone"])
def test_language_from_the_address_remembered_and_switched_live(server, browser, viewport):
    width, height = VIEWPORTS[viewport]
    context = browser.new_context(viewport={"width": width, "height": height}, locale="en-US")
    try:
        page = _open(browser, server, viewport, "en", "?lang=zh", context=context)
        _wait_language(page, "zh")  # ?lang= wins over the browser's English
        if viewport == "desktop":
            page.wait_for_function("w => document.querySelector('footer').innerText.includes(w)",
                                   arg=GRADIO_API_WORDS["zh"])
        page.goto(server.url)  # no ?lang= now: the choice was remembered
        _wait_language(page, "zh")
        page.locator("#lang").get_by_text("English", exact=True).click()  # switched live, Gradio's words too
        _wait_language(page, "en")
        assert page.evaluate("() => document.documentElement.lang") == "en"
        if viewport == "desktop":
            page.wait_for_function("w => document.querySelector('footer').innerText.includes(w)",
                                   arg=GRADIO_API_WORDS["en"])
        page.reload()
        page.wait_for_selector("#diagnose")
        _wait_language(page, "en")
        page.goto(server.url + "?lang=zh")
        _wait_language(page, "zh")
        page.locator("#lang").get_by_text("English", exact=True).click()
        _wait_language(page, "en")
        page.wait_for_function("() => new URL(location.href).searchParams.get('lang') === 'en'")  # the address follows
    finally:
        context.close()
    zh = browser.new_context(viewport={"width": width, "height": height}, locale="zh-CN")
    try:  # a Chinese browser asking for English
        page = _open(browser, server, viewport, "zh", "?lang=en", context=zh)
        _wait_language(page, "en")
    finally:
        zh.close()


def test_on_a_phone_labels_are_not_under_buttons_and_the_correction_choices_are_full_width(server, photos,
                                                                                           browser):
    """On a 390 px phone the file box's icons covered the end of its label ("HEIC;" hidden), and "Which photo"
    and the right answer shared a row: "Photo 2: mosaic_virus_0001.jpg" read "Photo 2: mosai" under the arrow."""
    page = _open(browser, server, "phone", "en")
    try:
        _upload(page, "photos", photos[:2])
        _listed(page, ["a.jpg", "b.jpg"])
        page.wait_for_selector("#photos .icon-button-wrapper")
        gap = page.evaluate("""() => {
            const label = document.querySelector('#photos [data-testid=block-label]');
            const range = document.createRange(); range.selectNodeContents(label);
            const right = Math.max(...[...range.getClientRects()].map(r => r.right));
            return document.querySelector('#photos .icon-button-wrapper').getBoundingClientRect().left - right; }""")
        assert gap >= 0, f"the label's text runs {-gap:.0f} px under the icons"
        cut = page.evaluate("() => [...document.querySelectorAll('#examples .caption-label')]"
                            ".filter(c => c.scrollWidth > c.clientWidth + 1).map(c => c.textContent)")
        assert not cut, f"example names cut: {cut}"
        remove = page.locator("#photos button.label-clear-button").first.bounding_box()
        assert min(remove["width"], remove["height"]) >= 32  # a finger's target, not 7 px
        _diagnose(page, "en")
        page.wait_for_selector("#correct-label", state="visible")
        boxes = [page.locator(sel).bounding_box() for sel in ("#correct-label", "#diagnose")]
        assert boxes[0]["width"] >= 0.8 * boxes[1]["width"]  # the whole width, as the Diagnose button
    finally:
        page.close()


def test_the_results_csv_follows_a_switch_of_language(server, browser, tmp_path):
    """The CSV gave a refused photo's message in the language of the page when it was diagnosed; after a switch
    the page said it in the new language and the download still in the old one."""
    import csv

    from PIL import Image

    flat = server.root / "flat.png"
    Image.new("RGB", (120, 90), (90, 140, 60)).save(flat)  # one flat colour: refused, with its message
    page = _open(browser, server, "desktop", "zh", "?lang=zh")
    try:
        _wait_language(page, "zh")
        _upload(page, "photos", [flat])
        _listed(page, ["flat.png"])
        page.click("#diagnose")
        page.locator("#history li").first.wait_for()
        page.locator("#lang").get_by_text("English", exact=True).click()
        page.wait_for_function("t => document.querySelector('#diagnose').innerText.trim() === t",
                               arg=t("diagnose", "en"))
        page.wait_for_function("t => document.querySelector('#history').innerText.includes(t)",
                               arg="flat.png")
        page.wait_for_timeout(1000)  # the switch rewrites the CSV behind the same button
        with page.expect_download() as dl:
            page.click("#download")
        target = tmp_path / "results.csv"
        dl.value.save_as(target)
        rows = list(csv.DictReader(target.open(encoding="utf-8")))
        assert rows[0]["error"] == error_message("uniform", "en")
    finally:
        page.close()


def test_the_upload_boxs_icon_buttons_follow_a_switch_of_language(server, photos, browser):
    """Gradio writes the upload box's icon buttons' names ("Upload", "Clear") once, in the language the page
    opened with: after a switch they stayed in the other one."""
    page = _open(browser, server, "desktop", "en")
    names = "() => [...document.querySelectorAll('#photos [aria-label]')].map(e => e.getAttribute('aria-label'))"
    switched = "t => (document.querySelector('#diagnose') || {}).innerText?.trim() === t"  # the box shows its files
    try:
        _wait_language(page, "en")
        _upload(page, "photos", photos[:2])
        _listed(page, ["a.jpg", "b.jpg"])
        page.wait_for_function(f"() => ({names})().includes('Clear')")
        page.locator("#lang").get_by_text("中文", exact=True).click()
        page.wait_for_function(switched, arg=t("diagnose", "zh"))
        page.wait_for_function(f"() => ({names})().includes('清除') && !({names})().includes('Clear')")
        page.locator("#lang").get_by_text("English", exact=True).click()
        page.wait_for_function(switched, arg=t("diagnose", "en"))
        page.wait_for_function(f"() => ({names})().includes('Clear') && !({names})().includes('清除')")
    finally:
        page.close()


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_every_control_has_a_name_in_the_pages_language(server, photos, browser, lang):
    page = _open(browser, server, "desktop", lang)
    try:
        _wait_language(page, lang)
        _upload(page, "photos", photos[:2])
        _listed(page, ["a.jpg", "b.jpg"])
        _diagnose(page, lang)
        snapshots = [page.locator("body").aria_snapshot()]
        page.get_by_role("tab", name=t("tab_model", lang)).click()
        page.wait_for_selector("#model-card")
        snapshots.append(page.locator("body").aria_snapshot())
        for snapshot in snapshots:
            for line in snapshot.splitlines():
                assert not re.match(r"\s*- (button|radio|tab|combobox|textbox)\s*(:|$)", line), line  # unnamed
                assert not any(word in line for word in GRADIO_ENGLISH), line
        words = t("remove_photo", lang, name="a.jpg")
        assert page.locator(f"#photos button[aria-label='{words}']").count() == 1
    finally:
        page.context.close()


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_file_too_big_gets_the_apps_own_message(server, browser, lang):
    big = server.root / "big.jpg"
    big.write_bytes(b"\xff\xd8\xff\xe0" + os.urandom(int(1.3 * 1024 * 1024)))  # the server's limit is 1 MB
    page = _open(browser, server, "phone", lang)
    try:
        _wait_language(page, lang)
        _upload(page, "photos", [big])
        _listed(page, ["big.jpg"])  # uploaded, not dropped by Gradio with its English popup
        verdict = _diagnose(page, lang)
        expected = error_message("file_too_big", lang, {"size": 1.3, "limit": 1})  # 1.0 comes back as 1
        assert expected in verdict, verdict
        assert page.locator(".toast-body").count() == 0  # no Gradio popup
    finally:
        page.context.close()


def test_heic_is_offered_exactly_when_it_is_read(server, tmp_path):
    """The upload box names HEIC only with pillow-heif installed (the serve extras install it); then a HEIC photo
    is diagnosed through the API like any other."""
    from gradio_client import Client, handle_file

    config = {c["props"].get("elem_id"): c["props"] for c in server.demo.config["components"]}
    assert ("HEIC" in config["photos"]["label"]) is heic_supported()
    if not heic_supported():
        pytest.skip("pillow-heif is not installed: HEIC is neither offered nor read")
    import pillow_heif
    from PIL import Image

    leaf = Image.open(_write_leaf(tmp_path / "leaf.png", (300, 200), seed=3))
    heic = tmp_path / "phone.heic"
    pillow_heif.from_pillow(leaf).save(heic, quality=90)
    result = Client(server.url, verbose=False).predict([handle_file(str(heic))], api_name="/diagnose")
    assert result["photos"][0]["ok"] is True and result["photos"][0]["name"] == "phone.heic", result


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_a_stopped_server_is_said_on_the_page_in_its_language(tmp_path, browser, monkeypatch, lang):
    """The server stopped while the page was open: Gradio's English popups went away and the last answer stayed
    as if the page still worked. A lasting notice in the page's language now says so, and goes when it answers."""
    from leaflens.apps import web_assets

    monkeypatch.setattr(web_assets, "WATCH_MS", 300)
    srv = Server(tmp_path)
    page = None
    try:
        page = _open(browser, srv, "phone", lang)
        _wait_language(page, lang)
        page.wait_for_timeout(1000)
        assert page.evaluate("() => { const b = document.getElementById('server-down'); return !b || b.hidden; }")
        srv.demo.close()
        page.wait_for_function("() => { const b = document.getElementById('server-down');"
                               " return b && !b.hidden && b.getAttribute('role') === 'alert'; }", timeout=20_000)
        assert page.inner_text("#server-down") == t("server_down", lang)
        assert page.evaluate("() => document.getElementById('server-down').getBoundingClientRect().top") <= 1
    finally:
        if page is not None:
            page.context.close()
        srv.service.close()


def test_the_language_choice_shows_keyboard_focus(server, browser):
    """Tabbing to the language radio showed no focus at all (no outline on the input or its label)."""
    page = _open(browser, server, "desktop", "en")
    try:
        _wait_language(page, "en")
        for _ in range(60):
            page.keyboard.press("Tab")
            if page.evaluate("() => !!document.activeElement.closest('#lang')"):
                break
        else:
            pytest.fail("Tab never reached the language choice")
        style = page.evaluate("() => { const s = getComputedStyle(document.activeElement.closest('label'));"
                              " return [s.outlineStyle, parseFloat(s.outlineWidth)]; }")
        assert style[0] == "solid" and style[1] >= 2, style
    finally:
        page.context.close()
