"""The running app's corrections and history: a correction through the API (/correct) and through the page
lands in the corrections folder with its log line, and `leaflens preprocess --also` puts it in the next
dataset; the page lists this session's diagnoses and offers their CSV. A server of its own (tiny model,
tiny dataset, corrections and CSVs under pytest's tmp path); marked ``slow`` (Gradio), the page test also
``browser``."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path

import pytest
from apps_helpers import (
    build_tiny_model,
    fake_run,
    leaflens_metadata,
    reference_ood,
    reference_probs,
    serve_args,
    served_tiny_model,
    tiny_weights,
    write_grey_noise,
    write_leaf,
)

from leaflens.apps.cmd_predict import csv_header
from leaflens.apps.corrections import LOG_NAME, NOT_A_LEAF
from leaflens.data_prep.decode import decode_image
from leaflens.data_prep.quality import refusal_reason

pytestmark = pytest.mark.slow
gr = pytest.importorskip("gradio", reason="gradio is not installed (pip install 'leaflens[serve-cpu]')")

CLASSES = ["early_blight", "healthy", "rust"]
SIZE = 32
OOD_THRESHOLD = -0.1


class App:
    def __init__(self, root: Path) -> None:
        from leaflens.apps import cmd_serve
        from leaflens.apps.screenshot import free_port
        from leaflens.apps.web import build_app, launch

        self.root = root
        self.dataset, self.weights, self.model = served_tiny_model(root, CLASSES, SIZE, OOD_THRESHOLD,
                                                                   "feedback-run")
        self.photos = root / "photos"  # the source folder make_dataset preprocessed
        self.corrections = root / "corrections"
        self.port = free_port()
        args = serve_args(model=self.model, run=fake_run(root, self.dataset), port=self.port,
                          examples_cache=root / "examples", corrections=self.corrections)
        self.service, self.config = cmd_serve.prepare(args)
        self.config.results_root = root / "results"
        self.demo = build_app(self.service, self.config)
        launch(self.demo, self.service, self.config, port=self.port, block=False, quiet=True)
        self.url = f"http://127.0.0.1:{self.port}/"

    def expected(self, path: Path) -> str:
        return CLASSES[int(reference_probs(decode_image(path, SIZE)[None], self.weights)[0].argmax())]

    def close(self) -> None:
        self.demo.close()
        self.service.close()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    a = App(tmp_path_factory.mktemp("feedback"))
    yield a
    a.close()


def in_domain_leaf(folder: Path, prefix: str, start: int = 0) -> Path:
    """A leaf-like JPEG the tiny model analyses (in domain, not refused), unique to ``prefix``."""
    for seed in range(start, start + 60):
        path = write_leaf(folder / f"{prefix}_{seed}.jpg", (300, 200), seed=seed, fmt="JPEG")
        pixels = decode_image(path, SIZE)
        if float(reference_ood(pixels[None])[0]) <= OOD_THRESHOLD and refusal_reason(pixels) is None:
            return path
    pytest.fail("no in-domain test photo found; the tiny model changed")


@pytest.fixture(scope="module")
def leaf(app) -> Path:
    return in_domain_leaf(app.root, "field")


def log_records(app) -> list[dict]:
    path = app.corrections / LOG_NAME
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def test_correction_through_the_api_lands_in_the_folder_and_the_next_dataset(app, leaf, tmp_path):
    from gradio_client import Client, handle_file

    from leaflens.data_prep.manifest import load_dataset
    from leaflens.pipeline.cli import main

    client = Client(app.url, verbose=False)
    assert sorted(client.view_api(print_info=False, return_format="dict")["named_endpoints"]) == \
        ["/correct", "/diagnose"]
    res = client.predict([handle_file(str(leaf))], api_name="/diagnose")
    predicted = res["photos"][0]["label"]
    right = next(c for c in CLASSES if c != predicted)  # the person says the model was wrong
    before = len(log_records(app))
    out = client.predict([handle_file(str(leaf))], res, "all", right, api_name="/correct")
    assert out["ok"] and out["reason"] is None and [s["photo"] for s in out["saved"]] == [leaf.name]
    saved = app.corrections / out["saved"][0]["file"]
    assert saved.parent == app.corrections / right and saved.read_bytes() == leaf.read_bytes()
    assert leaf.stem not in saved.name  # a generated name, never the uploaded one
    rec = log_records(app)[before]
    assert rec["chosen"] == right and rec["predicted"]["label"] == predicted and rec["photo_name"] == leaf.name
    assert rec["run_id"] == "feedback-run" and rec["model"] == "student.onnx"
    assert rec["model_sha256"].startswith("sha256:")

    # the same answer for other photos is refused, and nothing is written
    other = write_leaf(tmp_path / "another.jpg", seed=99, fmt="JPEG")
    wrong = client.predict([handle_file(str(other))], res, "all", right, api_name="/correct")
    assert not wrong["ok"] and wrong["reason"] == "photos_changed"
    # ... also under the answered photo's name: the server checks the bytes against what it answered
    swapped = tmp_path / "swapped" / leaf.name
    swapped.parent.mkdir()
    swapped.write_bytes(other.read_bytes())
    wrong = client.predict([handle_file(str(swapped))], res, "all", right, api_name="/correct")
    assert not wrong["ok"] and wrong["reason"] == "not_diagnosed" and len(log_records(app)) == before + 1
    # an answer edited to say a refused photo was diagnosed saves nothing
    tiny = write_leaf(tmp_path / "tiny.png", (8, 8), seed=3, fmt="PNG")
    res_tiny = client.predict([handle_file(str(tiny))], api_name="/diagnose")
    assert res_tiny["photos"][0]["verdict"] == "refused"
    res_tiny["photos"][0].update(ok=True, verdict="diagnosis", label=right, confidence=0.99)
    forged = client.predict([handle_file(str(tiny))], res_tiny, "all", right, api_name="/correct")
    assert not forged["ok"] and forged["reason"] == "not_analysed" and len(log_records(app)) == before + 1
    # a malformed answer is refused with a reason, not an exception
    for junk in ({"photos": [leaf.name]}, {"photos": "abc"}, "garbage"):
        out_junk = client.predict([handle_file(str(leaf))], junk, "all", right, api_name="/correct")
        assert out_junk["reason"] == "no_answer" and not out_junk["ok"]
    # a class the model does not have: refused by the app with its reason (Gradio's own choice check raised,
    # answering with an exception and a traceback in the server's log)
    unknown = client.predict([handle_file(str(leaf))], res, "all", "bean_rust", api_name="/correct")
    assert not unknown["ok"] and unknown["reason"] == "unknown_class" and unknown["chosen"] == "bean_rust"
    # "not a leaf" for a photo of something else
    noise = write_grey_noise(tmp_path / "noise.png")
    res2 = client.predict([handle_file(str(noise))], api_name="/diagnose")
    out2 = client.predict([handle_file(str(noise))], res2, "1", NOT_A_LEAF, api_name="/correct")
    assert out2["ok"] and (app.corrections / out2["saved"][0]["file"]).parent.name == NOT_A_LEAF

    # the next `leaflens preprocess --also` includes the corrected photo under the class the person chose
    ds_out = tmp_path / "ds"
    assert main(["preprocess", "--src", str(app.photos), "--out", str(ds_out), "--size", str(SIZE), "--workers", "1",
                 "--no-progress", "--also", str(app.corrections)]) == 0
    ds = load_dataset(ds_out)
    rows = {f: (s, i) for s in ("train", "val", "test") for i, f in enumerate(ds[s].files)}
    assert str(saved.resolve()) in rows
    split, i = rows[str(saved.resolve())]
    assert ds.classes[int(ds[split].labels[i])] == right
    assert ds.manifest.ignored.get(NOT_A_LEAF, 0) >= 1  # not_a_leaf/ is skipped, and counted
    assert not any(NOT_A_LEAF in f for f in rows)


def test_no_corrections_means_no_control_and_no_endpoint(tmp_path, monkeypatch):
    from leaflens.apps import cmd_serve
    from leaflens.apps.web import build_app

    # prepare() points GRADIO_TEMP_DIR, process-wide, at this test's upload folder: put it back afterwards, or the
    # module's running server would keep uploading into a folder this test deletes
    if "GRADIO_TEMP_DIR" in os.environ:
        monkeypatch.setenv("GRADIO_TEMP_DIR", os.environ["GRADIO_TEMP_DIR"])
    else:
        monkeypatch.delenv("GRADIO_TEMP_DIR", raising=False)

    weights = tiny_weights(len(CLASSES), seed=1)
    model = build_tiny_model(tmp_path / "m.onnx", weights, 16, leaflens_metadata(CLASSES, 16))
    service, config = cmd_serve.prepare(serve_args(model=model, no_corrections=True, no_examples=True,
                                                   uploads_dir=tmp_path / "uploads"))
    try:
        assert config.corrections is None
        demo = build_app(service, config)
        public = {d.get("api_name") for d in demo.config["dependencies"] if d.get("api_visibility") == "public"}
        assert public == {"diagnose"}
        assert not any(c.get("props", {}).get("elem_id") == "correct" for c in demo.config["components"])
    finally:
        service.close()


def test_cli_refuses_bad_corrections_settings(tmp_path):
    from leaflens.apps import cmd_serve

    weights = tiny_weights(len(CLASSES), seed=1)
    model = build_tiny_model(tmp_path / "m.onnx", weights, 16, leaflens_metadata(CLASSES, 16))
    (tmp_path / "afile").write_text("x")
    assert cmd_serve.run(serve_args(model=model, corrections=tmp_path / "afile")) == 2
    assert cmd_serve.run(serve_args(model=model, corrections_max_mb=0)) == 2


# ----------------------------------------------------------------------------- the page, in a browser
def _browser_or_skip() -> None:
    from leaflens.apps.screenshot import find_chromium

    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed (pip install 'leaflens[dev]')")
    if find_chromium() is None:
        pytest.skip("no Chromium browser found (apt-get install chromium, or set LEAFLENS_CHROMIUM)")


PHONE = (390, 844)


def _fits(page, selector: str, width: int) -> bool:
    """Whether every element matching ``selector`` lies within the viewport's width (no sideways scrolling)."""
    return page.evaluate("([s, w]) => Array.from(document.querySelectorAll(s)).every(e => "
                         "e.getBoundingClientRect().right <= w + 1)", [selector, width])


@pytest.mark.browser
@pytest.mark.parametrize("lang,viewport", [("en", (1200, 900)), ("zh", (1200, 900)), ("en", PHONE), ("zh", PHONE)])
def test_page_correction_history_and_download(app, tmp_path, lang, viewport):
    _browser_or_skip()
    from playwright.sync_api import sync_playwright

    from leaflens.apps.i18n import LANG_CHOICES, t
    from leaflens.apps.screenshot import BROWSER_ARGS, find_chromium

    notes = app.service.notes
    phone = viewport == PHONE
    leaf = in_domain_leaf(tmp_path, f"page_{lang}", start=(100 if lang == "en" else 200) + (400 if phone else 0))
    second = in_domain_leaf(tmp_path, f"second_{lang}", start=300)
    predicted = app.expected(leaf)
    right = next(c for c in CLASSES if c != predicted)
    before = len(log_records(app))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=find_chromium(), args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]}, accept_downloads=True)
            page.set_default_timeout(60_000)
            page.goto(app.url, wait_until="domcontentloaded")
            page.wait_for_selector("#diagnose")
            if lang != "en":
                page.locator("#lang").get_by_text(LANG_CHOICES[lang], exact=True).click()
                page.wait_for_function("t => document.querySelector('#diagnose').innerText.trim() === t",
                                       arg=t("diagnose", lang))
            assert not page.locator("#correct-save").is_visible()  # nothing to correct before an answer
            for n, photo in enumerate((leaf, second), 1):
                page.locator("#photos input[type=file]").set_input_files([str(photo)])
                page.locator("#photos").get_by_text(photo.stem, exact=False).first.wait_for()
                page.click("#diagnose")
                page.locator("#history li").nth(n - 1).wait_for()
                if n == 1:
                    page.locator("#correct-save").wait_for()
                    assert t("correct_label", lang) in page.inner_text("#correct-label")
                    for part in ("#correct-heading", "#correct-label", "#correct-save", "#correct-status"):
                        assert _fits(page, part, viewport[0]), (part, viewport)
                    page.locator("#correct-label input").click()
                    page.get_by_role("option", name=notes.name(right, lang), exact=True).click()
                    page.click("#correct-save")
                    said = t("correct_saved", lang, n=1, name=notes.name(right, lang)).replace("**", "")
                    page.wait_for_function("s => document.querySelector('#correct-status').innerText.includes(s)",
                                           arg=said)
                    page.click("#clear")  # the next photo is another plant; wait until the page is cleared
                    page.wait_for_function("t => document.querySelector('#verdict').innerText.trim() === t",
                                           arg=t("waiting", lang).replace("**", ""))
                    page.locator("#correct-save").wait_for(state="hidden")  # no answer, nothing to correct
            assert _fits(page, "#history-box", viewport[0]) and _fits(page, "#download", viewport[0])
            history = page.inner_text("#history")
            assert history.index(second.name) < history.index(leaf.name)  # newest first
            with page.expect_download() as dl:
                page.click("#download")
            target = tmp_path / "results.csv"
            dl.value.save_as(target)
        finally:
            browser.close()
    rows = list(csv.reader(target.open(encoding="utf-8")))
    assert rows[0] == ["diagnosis", "time", "answer", *csv_header(app.service.options.top_k)]
    assert [r[3] for r in rows[1:]] == [leaf.name, second.name] and [r[0] for r in rows[1:]] == ["1", "2"]
    new = log_records(app)[before:]
    assert [(r["chosen"], r["photo_name"], r["predicted"]["label"]) for r in new] == [(right, leaf.name, predicted)]
    saved = app.corrections / new[0]["file"]
    assert saved.parent.name == right and saved.read_bytes() == leaf.read_bytes()
