"""Drive the web app in a real headless browser: upload photos, press Diagnose, read the page.

Used by the end-to-end browser test and to make the README's screenshot::

    python -m leaflens.apps.screenshot --model artifacts/export/student.onnx --photo leaf.jpg --out docs/app.png

(any other ``leaflens serve`` option may follow; ``--phone`` saves what a 390 x 844 phone screen shows after
Diagnose, ``--shot-lang zh`` switches the page to Chinese). The app is started in this process on a free
local port. The browser is the system's Chromium driven by Playwright (``playwright install``
cannot download browsers everywhere, so the executable is found on disk: ``$LEAFLENS_CHROMIUM``,
then ``chromium`` / ``chromium-browser`` / ``google-chrome`` on the PATH). Playwright is a
development dependency; the app itself never imports this module.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from leaflens.files import write_path_atomic

__all__ = ["BROWSER_ARGS", "PageText", "drive", "find_chromium", "free_port", "main", "shrink_png"]

BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run"]
MAX_PNG_BYTES = 300_000
PHONE = (390, 844)  # --phone: the viewport of a common phone, in CSS pixels
VERDICT = "#verdict [data-testid=markdown]"  # the verdict's words (Gradio's progress timer sits beside them)


@dataclass
class PageText:
    """What the page showed after the diagnosis (inner text of each area)."""

    verdict: str
    ranking: str
    notes: str
    per_photo: str


def find_chromium() -> str | None:
    """Path of a Chromium-family browser, or None."""
    env = os.environ.get("LEAFLENS_CHROMIUM")
    if env:
        return env if Path(env).is_file() else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def shrink_png(path: str | os.PathLike, max_bytes: int = MAX_PNG_BYTES) -> int:
    """Re-encode a screenshot with a 256-colour palette when it is larger than ``max_bytes``; its size."""
    from PIL import Image

    p = Path(path)
    if p.stat().st_size <= max_bytes:
        return p.stat().st_size
    with Image.open(p) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    write_path_atomic(p, lambda tmp: small.save(tmp, optimize=True))  # the temporary keeps the .png suffix
    return p.stat().st_size


def drive(url: str, photos: Sequence[str | os.PathLike], screenshot: str | os.PathLike | None = None,
          lang: str | None = None, timeout_s: float = 60.0, width: int = 1200, height: int = 900,
          chromium: str | None = None, full_page: bool = True) -> PageText:
    """Open ``url``, optionally switch language ("en"/"zh"), upload ``photos``, press Diagnose,
    wait for the verdict to change, optionally save a PNG (the whole page, or with ``full_page=False``
    what the screen shows: on a phone, the answer the page scrolled to), and return the page's text.

    Raises ``RuntimeError`` when no browser is found and Playwright's ``TimeoutError`` when the
    page does not answer within ``timeout_s``.
    """
    from playwright.sync_api import sync_playwright

    exe = chromium or find_chromium()
    if exe is None:
        raise RuntimeError("no Chromium found: install it (apt-get install chromium) or set LEAFLENS_CHROMIUM")
    ms = timeout_s * 1000
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(ms)
            page.goto(url, wait_until="domcontentloaded")
            page.wait_for_selector("#diagnose")
            if lang is not None:
                from leaflens.apps.i18n import LANG_CHOICES

                page.locator("#lang").get_by_text(LANG_CHOICES[lang], exact=True).click()
                page.wait_for_function("t => document.querySelector('#diagnose').innerText.trim() === t",
                                       arg=_button_text(lang))
            before = page.inner_text(VERDICT)
            page.locator("#photos input[type=file]").set_input_files([os.fspath(p) for p in photos])
            for p in photos:  # the upload has finished when every file is listed (as stem + extension)
                page.locator("#photos").get_by_text(Path(p).stem, exact=False).first.wait_for()
            page.click("#diagnose")
            page.wait_for_function(f"t => document.querySelector('{VERDICT}').innerText !== t", arg=before)
            time.sleep(0.3)  # let the chained render settle (label, notes, thumbnails arrive together)
            text = PageText(page.inner_text(VERDICT), _text(page, "#ranking"), _text(page, "#notes"),
                            _text(page, "#per-photo [data-testid=markdown]"))
            if screenshot is not None:
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                # not "networkidle": the page keeps a heartbeat connection open while it has per-session state
                page.wait_for_function("() => [...document.images].every(i => i.complete)")
                time.sleep(0.5)  # a phone-sized page scrolls smoothly to the answer
                page.screenshot(path=os.fspath(screenshot), full_page=full_page)
            return text
        finally:
            browser.close()


def _button_text(lang: str) -> str:
    from leaflens.apps.i18n import t

    return t("diagnose", lang)


def _text(page, selector: str) -> str:
    loc = page.locator(selector)
    return loc.inner_text() if loc.count() and loc.first.is_visible() else ""


def main(argv: list[str] | None = None) -> int:
    """Start the app with ``leaflens serve`` options, diagnose ``--photo`` files, save ``--out``."""
    from leaflens.apps import cmd_serve
    from leaflens.apps.web import launch

    own = argparse.ArgumentParser(prog="python -m leaflens.apps.screenshot", description=__doc__.split("\n\n")[0],
                                  epilog="Every other option is `leaflens serve`'s (--model, --lang, --dataset ...; "
                                         "see `leaflens serve --help`); the port is chosen here.")
    own.add_argument("--photo", action="append", required=True, help="photo to upload (repeat for several)")
    own.add_argument("--out", required=True, help="PNG to write (re-encoded to stay under 300 KB)")
    own.add_argument("--shot-lang", choices=["en", "zh"], default=None, help="switch the page to this language")
    own.add_argument("--width", type=int, default=1200)
    own.add_argument("--height", type=int, default=900)
    own.add_argument("--phone", action="store_true",
                     help=f"a phone's screen ({PHONE[0]} x {PHONE[1]}), and only what it shows after Diagnose")
    args, rest = own.parse_known_args(argv)
    serve_parser = cmd_serve.add_parser(argparse.ArgumentParser(prog="serve").add_subparsers())
    serve_args = serve_parser.parse_args(rest)
    serve_args.port = free_port()
    service, demo, config = cmd_serve.build(serve_args)
    try:
        launch(demo, service, config, host="127.0.0.1", port=serve_args.port, block=False, quiet=True)
        width, height = PHONE if args.phone else (args.width, args.height)
        text = drive(f"http://127.0.0.1:{serve_args.port}/", args.photo, args.out, lang=args.shot_lang,
                     width=width, height=height, full_page=not args.phone)
    finally:
        demo.close()
        service.close()
    size = shrink_png(args.out)
    print(f"{args.out}: {size / 1000:.0f} KB; verdict: {text.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
