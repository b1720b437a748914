"""Uploaded photos are deleted once answered (leaflens.apps.uploads), the service hands them over, the page says
so (leaflens.apps.privacy), and `leaflens serve` gives Gradio a folder of its own.

Files are laid out as Gradio 6 writes them (``<folder>/<sha256>/<name>``, ``<folder>/tmpXXXXXXXX``); the sweep's
clock is moved forward instead of waiting. One slow test drives a real server through Gradio's HTTP API.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from apps_helpers import serve_args, write_photo

from leaflens.apps.privacy import privacy_markdown
from leaflens.apps.service import DiagnosisService
from leaflens.apps.uploads import MARKER, UploadFolder, UploadFolderError, UploadPolicy, default_folder


class Clock:
    """Wall time plus an offset the test moves forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def upload(root: Path, name: str = "leaf.png", seed: int = 0, size: tuple[int, int] = (48, 40)) -> Path:
    """A photo where Gradio puts an upload: ``<root>/<sha256 of its bytes>/<name>``."""
    tmp = root.parent / f"upload{seed}.png"  # drawn beside the folder, not in it
    write_photo(tmp, size, seed=seed)
    data = tmp.read_bytes()
    tmp.unlink()
    folder = root / hashlib.sha256(data).hexdigest()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder / name


def files_in(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MARKER)


def folder(tmp_path: Path, **policy) -> tuple[UploadFolder, Clock]:
    clock = Clock()
    uploads = UploadFolder(tmp_path / "uploads", UploadPolicy(**policy), clock=clock)
    uploads.prepare()
    return uploads, clock


@pytest.fixture
def model(tiny_model):
    path, _ = tiny_model(size=16)
    return path


def service_with(model: Path, uploads: UploadFolder | None) -> DiagnosisService:
    from leaflens.apps.predictor import Predictor

    return DiagnosisService(Predictor(model), uploads=uploads)


def test_answered_uploads_are_deleted_and_other_files_are_not(tmp_path, model):
    uploads, _ = folder(tmp_path, grace_s=0.0)
    photo = upload(uploads.root, seed=1)
    mine = write_photo(tmp_path / "elsewhere.png", (48, 40), seed=2)  # an example photo, say: never deleted
    with service_with(model, uploads) as service:
        answer = service.diagnose([photo, mine])
        assert [p["ok"] for p in answer["photos"]] == [True, True]  # answered first, deleted after
        assert not photo.exists() and mine.exists()
        again = service.diagnose([photo])  # the page pressing Diagnose on a photo already answered
        assert again["photos"][0]["error"]["reason"] == "gone"
        assert "no longer on the server" in again["photos"][0]["error"]["message"]
    missing = tmp_path / "not-an-upload.png"  # outside the upload folder a missing file is just unreadable
    with service_with(model, uploads) as service:
        assert service.diagnose([missing])["photos"][0]["error"]["reason"] == "unreadable"


def test_the_service_without_an_upload_folder_leaves_files_alone(tmp_path, model):
    photo = write_photo(tmp_path / "leaf.png", (48, 40), seed=3)
    with service_with(model, None) as service:
        assert service.diagnose([photo])["photos"][0]["ok"]
    assert photo.exists()


def test_retention_after_the_answer_is_honoured(tmp_path, model):
    uploads, clock = folder(tmp_path, keep_s=600.0, grace_s=30.0)
    photo = upload(uploads.root, seed=4)
    with service_with(model, uploads) as service:
        assert service.diagnose([photo])["photos"][0]["ok"]
        clock.offset = 599.0
        assert uploads.sweep() == 0 and photo.exists()
        clock.offset = 601.0
        assert uploads.sweep() == 1 and not photo.exists()


def test_the_grace_keeps_a_photo_for_the_page_and_for_a_second_upload_of_the_same_bytes(tmp_path, model):
    uploads, clock = folder(tmp_path, keep_s=0.0, grace_s=30.0)
    photo = upload(uploads.root, seed=5)
    with service_with(model, uploads) as service:
        assert service.diagnose([photo])["photos"][0]["ok"]
        clock.offset = 29.0
        assert uploads.sweep() == 0
        assert service.diagnose([photo])["photos"][0]["ok"]  # the same bytes, uploaded by a second client
        clock.offset = 29.0 + 29.0
        assert uploads.sweep() == 0 and photo.exists()  # 29 s after the second answer
        clock.offset = 29.0 + 31.0
        assert uploads.sweep() == 1 and not photo.exists()


def test_a_photo_is_never_deleted_while_a_diagnosis_reads_it(tmp_path):
    uploads, clock = folder(tmp_path, grace_s=0.0, unanswered_s=0.0)
    photo = upload(uploads.root, seed=6)
    with uploads.holding([photo]):
        clock.offset = 3600.0
        assert uploads.sweep() == 0 and photo.exists()
        assert uploads.answered([photo]) == 0 and photo.exists()  # another request answered it meanwhile
    assert uploads.sweep() == 1 and not photo.exists()


def test_a_photo_uploaded_again_after_its_answer_counts_as_new(tmp_path):
    uploads, clock = folder(tmp_path, keep_s=0.0, grace_s=10.0, unanswered_s=600.0)
    photo = upload(uploads.root, seed=7)
    clock.offset = -5.0  # answered 5 s before the file was put in place again (Gradio renames over it)
    uploads.answered([photo])
    clock.offset = 60.0
    assert uploads.sweep() == 0 and photo.exists()  # not due: its own answer has not come
    clock.offset = 601.0
    assert uploads.sweep() == 1  # never answered: gone after the unanswered time


def test_leftovers_temp_files_and_the_cap(tmp_path):
    uploads, clock = folder(tmp_path, keep_s=0.0, grace_s=0.0, unanswered_s=1800.0, stale_temp_s=60.0, max_mb=1.0)
    root = uploads.root
    page_own = upload(root, "example.png", seed=8)  # copied there while the page was built
    (root / "vibe_edit_history").mkdir()
    foreign = root / "vibe_edit_history" / "notes.txt"  # not in Gradio's upload layout: never touched
    foreign.write_text("x")
    uploads.start()
    try:
        empty = root / "tmpabcdef12"  # what Gradio 6's gr.File leaves per photo
        empty.touch()
        partial = root / "tmp12345678"  # an upload cut short
        partial.write_bytes(b"x" * 100)
        never = upload(root, seed=9)  # uploaded, page closed, never diagnosed
        clock.offset = 59.0
        assert uploads.sweep() == 0
        clock.offset = 61.0
        assert uploads.sweep() == 1 and not empty.exists() and partial.exists()
        clock.offset = 1801.0
        assert uploads.sweep() == 2 and not partial.exists() and not never.exists()
        # over the cap: the oldest go first, the page's own files stay
        clock.offset = 0.0
        big = []
        for i in range(3):
            path = root / f"{i:064x}" / f"big{i}.bin"
            path.parent.mkdir()
            path.write_bytes(os.urandom(400_000))
            os.utime(path)  # distinct ctimes: the first is the oldest
            big.append(path)
            time.sleep(0.02)
        uploads.sweep()
        assert not big[0].exists() and big[1].exists() and big[2].exists()
        assert page_own.exists() and foreign.exists()
        assert uploads.usage()[1] <= 1024 * 1024
    finally:
        uploads.close()
    assert files_in(root) == [foreign]  # everything Gradio wrote is deleted when the server stops
    assert not any(p.is_dir() for p in root.iterdir() if len(p.name) == 64)
    quiet = UploadFolder(tmp_path / "made-here")
    quiet.prepare()
    upload(quiet.root, seed=60)
    (quiet.root / "vibe_edit_history").mkdir()  # Gradio 6 makes this empty folder when the app starts
    quiet.close()
    assert not quiet.root.exists()  # a folder it made, left empty: removed with it
    kept = UploadFolder(tmp_path / "made-here-too")
    kept.prepare()
    (kept.root / "notes").mkdir()
    (kept.root / "notes" / "mine.txt").write_text("not Gradio's")
    kept.close()
    assert (kept.root / "notes" / "mine.txt").read_text() == "not Gradio's"  # a folder with a file stays


def test_the_folder_stays_bounded_under_many_concurrent_requests(tmp_path, model):
    uploads, _ = folder(tmp_path, keep_s=0.0, grace_s=0.0, sweep_every_s=0.05)
    uploads.start()
    photos = [upload(uploads.root, f"p{i}.png", seed=20 + i) for i in range(12)]
    data = [p.read_bytes() for p in photos]
    errors: list[str] = []
    peak = [0]

    def client(k: int) -> None:
        for r in range(15):
            i = (k + r) % len(photos)
            path = photos[i]
            if not path.exists():  # the client uploads it again, as Gradio would store it
                path.parent.mkdir(exist_ok=True)
                tmp = uploads.root / f"tmpc{k}r{r}"
                tmp.write_bytes(data[i])
                os.replace(tmp, path)
            photo = service.diagnose([path])["photos"][0]
            if not photo["ok"] and photo["error"]["reason"] != "gone":  # a race with a twin: answered "gone"
                errors.append(str(photo["error"]))
            peak[0] = max(peak[0], len(files_in(uploads.root)))

    with service_with(model, uploads) as service:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        uploads.sweep()
        assert errors == []
        assert peak[0] <= len(photos) + len(threads)  # the photos, and one being uploaded again per client
        assert files_in(uploads.root) == []


def python_process() -> subprocess.Popen:
    """Another running Python process, started up (its command line is Python's once it says so)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def test_prepare_refuses_folders_that_are_not_its_own(tmp_path):
    other = tmp_path / "holiday-photos"
    other.mkdir()
    (other / "beach.jpg").write_bytes(b"x")
    with pytest.raises(UploadFolderError, match="holiday-photos: not empty and not a leaflens upload folder"):
        UploadFolder(other).prepare()
    assert (other / "beach.jpg").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    other = python_process()  # a running Python process
    try:
        (busy / MARKER).write_text(f"pid {other.pid}\n")
        with pytest.raises(UploadFolderError, match="in use by another running server"):
            UploadFolder(busy).prepare()
    finally:
        other.kill()
        other.wait()
    if Path("/proc").is_dir():  # where the command line of a process can be read (Linux)
        sleeper = subprocess.Popen(["sleep", "60"])  # a live process that is no server (its number reused, say)
        deadline = time.time() + 10
        while time.time() < deadline and not Path(f"/proc/{sleeper.pid}/cmdline").read_bytes().startswith(b"sleep"):
            time.sleep(0.01)  # until it is "sleep", not the copy of this process it starts as
        try:
            (busy / MARKER).write_text(f"pid {sleeper.pid}\n")
            assert UploadFolder(busy).prepare() == 0
        finally:
            sleeper.kill()
            sleeper.wait()
    mine = UploadFolder(tmp_path / "fresh")
    assert mine.prepare() == 0 and (mine.root / MARKER).is_file()
    assert (mine.root.stat().st_mode & 0o777) == 0o700
    left = upload(mine.root, seed=30)
    assert UploadFolder(mine.root).prepare() == 1 and not left.exists()  # an earlier server's leftovers
    assert default_folder(7860).name == "leaflens-uploads-7860"
    with pytest.raises(ValueError, match="keep_s must be >= 0"):
        UploadPolicy(keep_s=-1)


def test_the_privacy_note_says_what_is_kept_where_and_how_long(tmp_path):
    uploads = UploadFolder(tmp_path / "up")
    en = privacy_markdown(uploads, None, "en")
    assert str(uploads.root) in en and "within 35 seconds of their answer" in en and "after 30 minutes" in en
    assert "nothing is sent anywhere else" in en and "No photo is kept for training" in en
    longer = UploadFolder(tmp_path / "up", UploadPolicy(keep_s=45 * 60))
    with_corrections = privacy_markdown(longer, tmp_path / "corr", "en")
    assert "45 minutes after their answer" in with_corrections and "after 45 minutes" in with_corrections
    assert f"`{tmp_path / 'corr'}`" in with_corrections and "correct its answer" in with_corrections
    zh = privacy_markdown(uploads, tmp_path / "corr", "zh")
    assert "隐私" in zh and str(uploads.root) in zh and "35 秒内" in zh
    assert "temporary folder until it is emptied" in privacy_markdown(None, None, "en")


def test_serve_flags_give_gradio_a_folder_of_its_own(tmp_path, model, monkeypatch):
    from leaflens.apps import cmd_serve

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "shared-gradio"))
    args = serve_args()
    assert args.keep_uploads_minutes is None and args.uploads_dir is None and args.uploads_max_mb == 1024.0
    # unset: photos stay while a correction may still need them, and go at once when corrections are off
    for no_corrections, minutes in ((False, cmd_serve.CORRECTION_WINDOW_MINUTES), (True, 0.0)):
        flags = {"no_corrections": True} if no_corrections else {}
        service, _ = cmd_serve.prepare(serve_args(model=model, uploads_dir=tmp_path / f"up{no_corrections}",
                                                  no_examples=True, **flags))
        try:
            assert service.uploads.policy.keep_s == 60.0 * minutes
        finally:
            service.close()
    args = serve_args(model=model, uploads_dir=tmp_path / "up", keep_uploads_minutes=5, no_examples=True)
    service, _ = cmd_serve.prepare(args)
    try:
        assert service.uploads.root == (tmp_path / "up").resolve()
        assert service.uploads.policy.keep_s == 300.0 and service.uploads.policy.after_answer_s == 300.0
        assert os.environ["GRADIO_TEMP_DIR"] == str(service.uploads.root)
    finally:
        service.close()
    assert cmd_serve.run(serve_args(model=model, keep_uploads_minutes=-1)) == 2
    # the default folder of a port another running process holds: this server takes a fresh one beside it
    taken = UploadFolder(tmp_path / "elsewhere")
    monkeypatch.setattr("leaflens.apps.uploads.default_folder", lambda port: taken.root)
    (taken.root).mkdir()
    other = python_process()  # another Python process
    try:
        (taken.root / MARKER).write_text(f"pid {other.pid}\n")
        service, _ = cmd_serve.prepare(serve_args(model=model, no_examples=True))
        fresh = service.uploads.root
        try:
            assert fresh != taken.root and fresh.name.startswith("elsewhere-")
        finally:
            service.close()
        assert not fresh.exists()  # made in the system temp folder for this server: gone with it
        with pytest.raises(cmd_serve.UsageError, match="in use by another running server"):
            cmd_serve.prepare(serve_args(model=model, no_examples=True, uploads_dir=taken.root))
    finally:
        other.kill()
        other.wait()
    # the process a marker names has ended, or its number now belongs to a program that is no server: free
    (taken.root / MARKER).write_text(f"pid {other.pid}\n")
    service, _ = cmd_serve.prepare(serve_args(model=model, no_examples=True, uploads_dir=taken.root))
    service.close()
    not_ours = tmp_path / "not-ours"
    not_ours.mkdir()
    (not_ours / "x.txt").write_text("x")
    assert cmd_serve.run(serve_args(model=model, uploads_dir=not_ours)) == 2


@pytest.mark.slow
def test_through_gradio_answered_uploads_leave_the_folder(tmp_path, model):
    """A real server: photos uploaded and diagnosed through Gradio's HTTP API leave nothing behind, and Gradio
    makes no empty temporary file per photo; the page carries the privacy note."""
    pytest.importorskip("gradio")
    import httpx

    from leaflens.apps import cmd_serve
    from leaflens.apps.screenshot import free_port
    from leaflens.apps.web import launch

    port = free_port()
    service, demo, config = cmd_serve.build(serve_args(model=model, port=port, uploads_dir=tmp_path / "up",
                                                       no_examples=True, keep_uploads_minutes=0))
    uploads = service.uploads
    # answered photos go at once; a temporary file would stay an hour: none may be left (leaflens.apps.web_uploads)
    uploads.policy = replace(uploads.policy, grace_s=0.0, stale_temp_s=3600.0, sweep_every_s=0.2)
    launch(demo, service, config, port=port, block=False, quiet=True)
    base = f"http://127.0.0.1:{port}"
    try:
        note = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "privacy")
        assert str(uploads.root) in note.value
        with httpx.Client(timeout=30) as http:
            for i in range(8):
                photo = write_photo(tmp_path / f"leaf{i}.png", (48, 40), seed=40 + i)
                r = http.post(base + "/gradio_api/upload",
                              files={"files": (photo.name, photo.read_bytes(), "image/png")})
                path = r.json()[0]
                assert Path(path).is_relative_to(uploads.root)
                r = http.post(base + "/gradio_api/call/diagnose",
                              json={"data": [[{"path": path, "meta": {"_type": "gradio.FileData"}}]]})
                with http.stream("GET", f"{base}/gradio_api/call/diagnose/{r.json()['event_id']}") as s:
                    body = "".join(line for line in s.iter_lines() if line.startswith("data:"))
                assert '"ok": true' in body or '"ok":true' in body
        deadline = time.time() + 10
        while files_in(uploads.root) and time.time() < deadline:
            time.sleep(0.3)
        assert files_in(uploads.root) == []
        assert uploads.deleted >= 8
    finally:
        demo.close()
        service.close()


@pytest.mark.slow
def test_a_server_stopped_with_sigterm_leaves_no_photo_behind(tmp_path, model):
    """`kill` stops `leaflens serve` as Ctrl-C does: the upload folder is emptied on the way out."""
    import signal
    import subprocess
    import sys
    import urllib.request

    pytest.importorskip("gradio")
    from leaflens.apps.screenshot import free_port

    port, root = free_port(), tmp_path / "up"
    proc = subprocess.Popen([sys.executable, "-m", "leaflens", "serve", "--model", str(model), "--port", str(port),
                             "--uploads-dir", str(root), "--no-examples"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
                    break
            except OSError:
                assert time.time() < deadline, "the server did not start"
                time.sleep(0.3)
        left = upload(root, seed=50)  # as if a page had uploaded it and been closed
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not left.exists() and files_in(root) == []
    assert not root.exists()  # the folder the server made goes with it (Gradio's own empty folders too)


def test_an_existing_empty_folder_is_left_as_it_was_found(tmp_path):
    given = tmp_path / "given"
    given.mkdir(mode=0o755)
    os.chmod(given, 0o755)
    uploads = UploadFolder(given)
    uploads.prepare()
    assert (given / MARKER).is_file() and given.stat().st_mode & 0o777 == 0o700  # private while it serves
    (given / "vibe_edit_history").mkdir()  # what Gradio makes when the app starts
    upload(given)
    uploads.close()
    assert given.is_dir() and list(given.iterdir()) == [] and given.stat().st_mode & 0o777 == 0o755
