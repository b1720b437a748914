"""The running app: its API through gradio_client, and the page in headless Chromium (Playwright).

One server per module (started through `leaflens serve`'s own build path on a free local port)
with a tiny model made here, a tiny preprocessed dataset (examples, class notes) and a run folder.
Importing Gradio alone takes several seconds on a loaded 2-core machine, so every test here is
marked ``slow``; the browser tests are also marked ``browser``. CI runs them (see .ci/run):
``pytest -m slow tests/apps``. The browser test saves its screenshot to
``$LEAFLENS_SCREENSHOT_DIR/app.png`` when that is set, else under pytest's tmp path.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from apps_helpers import (
    fake_run,
    reference_ood,
    reference_probs,
    serve_args,
    served_tiny_model,
    write_digit,
    write_grey_noise,
    write_leaf,
    write_photo,
)
from PIL import Image

from leaflens.apps.notes import load_notes
from leaflens.data_prep.decode import decode_image
from leaflens.data_prep.quality import refusal_reason

pytestmark = pytest.mark.slow
gr = pytest.importorskip("gradio", reason="gradio is not installed (pip install 'leaflens[serve-cpu]')")

CLASSES = ["early_blight", "healthy", "rust"]
SIZE = 32  # stored and input size; the example photos are stored-size PNGs, and smaller ones are refused
OOD_THRESHOLD = -0.1  # the tiny model's out-of-domain score: grey photos 0, colourful ones -0.2 to -0.5
OOD_MESSAGE = "does not look like the leaves or pests this model knows"


class Server:
    def __init__(self, root: Path) -> None:
        from leaflens.apps import cmd_serve
        from leaflens.apps.screenshot import free_port
        from leaflens.apps.web import launch

        self.root = root
        self.dataset, self.weights, self.model = served_tiny_model(root, CLASSES, SIZE, OOD_THRESHOLD,
                                                                   "test-run")
        self.run = fake_run(root, self.dataset)
        self.notes = load_notes(self.dataset / "classes.toml")
        self.port = free_port()
        args = serve_args(model=self.model, run=self.run, port=self.port, max_upload_mb=1,
                          examples_cache=root / "examples", corrections=root / "corrections")
        self.service, self.demo, self.config = cmd_serve.build(args)
        launch(self.demo, self.service, self.config, port=self.port, block=False, quiet=True)
        self.url = f"http://127.0.0.1:{self.port}/"

    def expected(self, path: Path) -> tuple[str, float]:
        probs = reference_probs(decode_image(path, SIZE)[None], self.weights)[0]
        return CLASSES[int(probs.argmax())], float(probs.max())

    def in_domain(self, path: Path) -> bool:
        return float(reference_ood(decode_image(path, SIZE)[None])[0]) <= OOD_THRESHOLD

    def close(self) -> None:
        self.demo.close()
        self.service.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("app"))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def leaves(server) -> dict[str, Path]:
    """In-domain photos whose reference answers are confident, one per class found (at least two classes:
    precondition of the page checks)."""
    found: dict[str, Path] = {}
    for seed in range(60):
        path = write_leaf(server.root / f"leaf_{seed}.jpg", (300, 200), seed=seed, fmt="JPEG")
        label, conf = server.expected(path)
        if conf > 0.8 and server.in_domain(path) and refusal_reason(decode_image(path, SIZE)) is None:
            found.setdefault(label, path)
    if len(found) < 2:
        pytest.fail(f"confident in-domain test photos found for {sorted(found)} only; the tiny model changed")
    return found


@pytest.fixture(scope="module")
def leaf(leaves) -> Path:
    return next(iter(leaves.values()))


@pytest.fixture(scope="module")
def strangers(server) -> dict[str, Path]:
    """Photos of something else: grey noise and a handwritten-looking digit (out of domain by the reference)."""
    found = {"noise": write_grey_noise(server.root / "noise.png", (300, 200)),
             "digit": write_digit(server.root / "digit.png", 120)}
    assert not any(server.in_domain(p) for p in found.values())
    return found


# ----------------------------------------------------------------------------- the API
def test_app_is_wired_from_the_cli_build(server):
    assert server.service.notes.name("rust", "zh") == "锈病"  # found through the run report's dataset
    assert sorted(p.stem for p in server.config.examples) == CLASSES
    public = {d.get("api_name") for d in server.demo.config["dependencies"] if d.get("api_visibility") == "public"}
    assert public == {"diagnose", "correct"}  # correct: "Wrong? The right answer is" (test_web_feedback.py)


def test_gradio_client_api(server, leaves, strangers):
    from gradio_client import Client, handle_file

    client = Client(server.url, verbose=False)
    info = client.view_api(print_info=False, return_format="dict")
    assert sorted(info["named_endpoints"]) == ["/correct", "/diagnose"]
    broken = server.root / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 this is not really a JPEG")
    leaf = next(iter(leaves.values()))
    other = write_photo(server.root / "other.png", (64, 48), seed=99)  # colourful noise: in domain
    assert server.in_domain(other)
    noise = strangers["noise"]
    res = client.predict([handle_file(str(p)) for p in (leaf, broken, noise, other)], api_name="/diagnose")
    label, conf = server.expected(leaf)
    first, bad, stranger, second = res["photos"]
    assert first["name"] == leaf.name and first["label"] == label and first["verdict"] == "diagnosis"
    assert first["confidence"] == pytest.approx(conf, abs=1e-5)
    assert first["ood_score"] == pytest.approx(float(reference_ood(decode_image(leaf, SIZE)[None])[0]), abs=1e-5)
    assert bad["ok"] is False and bad["error"]["reason"] == "corrupt" and "damaged" in bad["error"]["message"]
    assert bad["verdict"] == "error"
    assert stranger["verdict"] == "out_of_domain" and stranger["label"] is None
    assert stranger["ood_score"] > OOD_THRESHOLD
    answer = res["answer"]
    assert answer["left_out"] == [noise.name] and res["ood_threshold"] == OOD_THRESHOLD
    if second["label"] != label:
        assert res["verdict"] == answer["verdict"] == "disagree" and answer["label"] is None
    else:
        ref = reference_probs(np.stack([decode_image(p, SIZE) for p in (leaf, other)]), server.weights).mean(axis=0)
        assert answer["label"] == CLASSES[int(ref.argmax())]
        assert answer["confidence"] == pytest.approx(float(ref.max()), abs=1e-5)
    assert answer["photos_used"] == 2 and res["server_ms"] > 0
    if answer["label"] == "rust" and answer["verdict"] == "diagnosis":
        assert res["note"]["name_zh"] == "锈病"


def test_upload_size_limit_is_enforced(server, leaf):
    """A file over the app's limit (1 MB here) is answered in the app's own format, next to the other photos;
    Gradio's own limit, UPLOAD_CAP_FACTOR times higher, refuses far larger files before they are sent."""
    from gradio_client import Client, handle_file

    from leaflens.apps.web_assets import UPLOAD_CAP_FACTOR

    big = server.root / "big.png"
    big.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(int(1.2 * 1024 * 1024)))
    client = Client(server.url, verbose=False)
    res = client.predict([handle_file(str(big)), handle_file(str(leaf))], api_name="/diagnose")
    too_big, fine = res["photos"]
    assert too_big["name"] == "big.png" and too_big["ok"] is False and too_big["verdict"] == "error"
    assert too_big["error"]["reason"] == "file_too_big"
    assert too_big["error"]["message"] == "the file is 1.2 MB; the largest accepted is 1.0 MB."
    assert fine["ok"] is True and res["answer"]["photos_used"] == 1  # the other photo is still answered
    huge = server.root / "huge.png"
    huge.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(UPLOAD_CAP_FACTOR * 1024 * 1024))
    with pytest.raises(ValueError, match=f"exceeds the maximum file size of {UPLOAD_CAP_FACTOR * 1048576} bytes"):
        client.predict([handle_file(str(huge))], api_name="/diagnose")  # refused before uploading
    # and the service refuses it by itself when handed such a path directly (examples, scripts)
    res = server.service.diagnose([big])
    assert res["photos"][0]["error"]["reason"] == "file_too_big"


# ----------------------------------------------------------------------------- the page, in a browser
def _browser_or_skip() -> None:
    from leaflens.apps.screenshot import find_chromium

    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed (pip install 'leaflens[dev]')")
    if find_chromium() is None:
        pytest.skip("no Chromium browser found (apt-get install chromium, or set LEAFLENS_CHROMIUM)")


@pytest.mark.browser
def test_page_in_headless_chromium(server, leaf, tmp_path):
    _browser_or_skip()
    from leaflens.apps.screenshot import drive

    shots = Path(os.environ.get("LEAFLENS_SCREENSHOT_DIR") or tmp_path)
    label, conf = server.expected(leaf)
    name = server.notes.name(label, "en")
    page = drive(server.url, [leaf], screenshot=shots / "app.png")
    assert name in page.ranking and name in page.verdict, page
    assert f"{conf:.0%}" in page.verdict or ">99%" in page.verdict
    advice = server.notes.text(label, "advice", "en")
    assert advice and advice in page.notes  # the class notes come with the result
    png = (shots / "app.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    broken = server.root / "broken_upload.jpg"
    broken.write_bytes(b"this is a text file called .jpg, not a photo")
    page = drive(server.url, [broken], screenshot=shots / "app_error.png")
    assert "broken_upload.jpg could not be read" in page.verdict, page
    assert "not a picture" in page.verdict and "Traceback" not in page.verdict
    assert page.ranking == ""  # no ranking without a readable photo


@pytest.mark.browser
def test_page_in_chinese(server, leaf):
    _browser_or_skip()
    from leaflens.apps.screenshot import drive

    label, _ = server.expected(leaf)
    page = drive(server.url, [leaf], lang="zh")
    zh_name = server.notes.name(label, "zh")
    assert zh_name in page.verdict and zh_name in page.ranking, page
    assert "怎么处理" in page.notes and server.notes.text(label, "advice", "zh") in page.notes


@pytest.mark.browser
def test_clicking_an_example_diagnoses_it(server):
    _browser_or_skip()
    from playwright.sync_api import sync_playwright

    from leaflens.apps.screenshot import BROWSER_ARGS, find_chromium

    example = server.config.examples[0]  # sorted by class id: early_blight
    label, _ = server.expected(example)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=find_chromium(), args=BROWSER_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(server.url)
            page.wait_for_selector("#examples img")
            before = page.inner_text("#verdict")
            page.locator("#examples img").first.click()
            page.wait_for_function("t => document.querySelector('#verdict').innerText !== t", arg=before)
            assert server.notes.name(label, "en") in page.inner_text("#ranking")
            page.locator("#photos").get_by_text(example.stem).first.wait_for()  # the example became the input
        finally:
            browser.close()


@pytest.mark.browser
def test_page_says_out_of_domain_refused_and_disagreeing(server, leaves, strangers, tmp_path):
    _browser_or_skip()
    from leaflens.apps.screenshot import drive

    shots = Path(os.environ.get("LEAFLENS_SCREENSHOT_DIR") or tmp_path)
    names = [server.notes.name(c, "en") for c in CLASSES]
    for kind, photo in strangers.items():  # no disease, no ranking, no percentage, no advice
        page = drive(server.url, [photo], screenshot=shots / f"app_ood_{kind}.png")
        assert OOD_MESSAGE in page.verdict and "trained on photos of: " + ", ".join(names) in page.verdict, page
        assert page.ranking == "" and page.notes == "" and "%" not in page.verdict and "Most likely" not in page.verdict

    dot = server.root / "dot.png"
    Image.new("RGB", (1, 1), (80, 150, 60)).save(dot)
    page = drive(server.url, [dot])
    assert "dot.png was not analysed" in page.verdict and "too small to show a leaf" in page.verdict, page
    assert page.ranking == "" and page.notes == ""

    (a_label, a), (b_label, b) = list(leaves.items())[:2]
    page = drive(server.url, [a, b, strangers["digit"]], screenshot=shots / "app_disagree.png")
    assert "The 2 photos disagree" in page.verdict, page
    for label, photo in ((a_label, a), (b_label, b)):  # each photo's own answer is shown
        answer = f"{photo.name}: {server.notes.name(label, 'en')}"
        assert answer in page.verdict and server.notes.name(label, "en") in page.per_photo
    assert "digit.png" in page.verdict and "left out" in page.verdict and "digit.png" in page.per_photo
    assert page.ranking == "" and page.notes == ""
