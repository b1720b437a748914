"""The web app's upload folder: where the photos people send are written, and when they are deleted.

Gradio writes each uploaded file to ``<folder>/<SHA-256 of its bytes>/<file name>``, streaming it first into a
``<folder>/tmpXXXXXXXX`` file, and copies what the page shows (example photos, the run's plots) into the same
layout; its ``gr.File`` also leaves one empty ``tmpXXXXXXXX`` file per photo it hands to an event (Gradio
6.31). It deletes none of them while the server runs: one afternoon of testing left 830 entries in the
system temp folder, and 32 clients for 30 s added 800 files. `leaflens serve` therefore gives Gradio a
folder of its own (``GRADIO_TEMP_DIR``: :func:`default_folder`, or ``--uploads-dir``), and an
:class:`UploadFolder` deletes, in a background sweep every few seconds:

- an uploaded photo once it has been answered: ``keep_s`` after its answer (``--keep-uploads-minutes``,
  default 0), but not sooner than ``grace_s`` (30 s) after it, so that the page can still show the photo
  beside its answer and a second request that uploaded the same bytes at the same moment (Gradio keeps
  identical bytes once, under one path) is answered too. Never while a diagnosis reads it; a photo uploaded
  again after its answer counts as a new upload;
- a photo never diagnosed (uploaded, then the page was closed) ``unanswered_s`` after its upload (30 min);
- Gradio's temporary files: empty ones a minute after they were last written, others (an upload cut
  short) after ``unanswered_s``;
- the oldest files first, whatever the folder holds beyond ``max_mb``;
- all of it when the server stops (:meth:`UploadFolder.close`).

Files already in the folder when :meth:`UploadFolder.start` runs are the page's own (the examples and plots
it was built with) and stay until the server stops; leftovers of an earlier server are deleted by
:meth:`UploadFolder.prepare`. Files outside Gradio's layout are never touched. The folder is marked with a
``.leaflens-uploads`` file naming the server's process and created private to its user (mode 0700); a
non-empty folder without the mark is refused, so a mistyped ``--uploads-dir`` cannot lose anyone's files, and
so is a folder another running server marked.

No Gradio import here: the service, the tests and the load benchmark use this class directly.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ANSWER_GRACE_S", "MARKER", "UNANSWERED_S", "UploadFolder", "UploadFolderError", "UploadFolderInUse",
           "UploadPolicy", "default_folder"]

log = logging.getLogger("leaflens.serve")

MARKER = ".leaflens-uploads"
ANSWER_GRACE_S = 30.0  # an answered photo stays at least this long (the page shows it; same-bytes uploads)
UNANSWERED_S = 30 * 60.0  # a photo never diagnosed
STALE_TEMP_S = 60.0  # an empty Gradio temporary file not written for this long is left over
SWEEP_EVERY_S = 5.0
MB = 1024 * 1024
_HASH_DIR = re.compile(r"[0-9a-f]{64}")  # Gradio's folder per content hash


def _owner(marker: Path) -> int | None:
    """The process id a marker names (None: no marker, or one without a pid)."""
    try:
        first = marker.read_text(encoding="utf-8").split("\n", 1)[0]
    except (OSError, UnicodeDecodeError):
        return None
    parts = first.split()
    return int(parts[1]) if len(parts) == 2 and parts[0] == "pid" and parts[1].isdigit() else None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` is running and could be a server: not a zombie (killed, not yet reaped), and,
    where /proc tells, a Python process (after a crash the number may have gone to another program)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return False
    proc = Path("/proc") / str(pid)
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").lower()
    except (OSError, IndexError):
        return True  # no /proc (macOS) or it vanished just now: take it as running
    if not command.strip():  # a process between fork and exec, or a kernel thread: cannot tell, so running
        return state != "Z"
    return state != "Z" and (b"python" in command or b"leaflens" in command)


class UploadFolderError(ValueError):
    """An upload folder that cannot be used; the message names the folder."""


class UploadFolderInUse(UploadFolderError):
    """The folder is marked by another process that is still running (another server, or a test)."""


@dataclass(frozen=True)
class UploadPolicy:
    """How long files stay in the upload folder (seconds) and how big it may grow (MB)."""

    keep_s: float = 0.0  # after the answer; 0: as soon as the grace below allows
    grace_s: float = ANSWER_GRACE_S
    unanswered_s: float = UNANSWERED_S
    stale_temp_s: float = STALE_TEMP_S
    max_mb: float = 1024.0
    sweep_every_s: float = SWEEP_EVERY_S

    def __post_init__(self) -> None:
        for name in ("keep_s", "grace_s", "unanswered_s", "stale_temp_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"UploadPolicy.{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.max_mb > 0 or not self.sweep_every_s > 0:
            raise ValueError(f"UploadPolicy needs max_mb > 0 and sweep_every_s > 0, got {self}")

    @property
    def after_answer_s(self) -> float:
        """How long an answered photo stays: the retention asked for, at least the grace."""
        return max(self.keep_s, self.grace_s)


def default_folder(port: int) -> Path:
    """``<system temp>/leaflens-uploads-<port>``: one folder per server, so one never sweeps another's."""
    return Path(tempfile.gettempdir()) / f"leaflens-uploads-{int(port)}"


@dataclass
class _File:
    path: str
    size: int
    ctime: float  # when it was put in place (rename or copy): the upload's time
    mtime: float
    temp: bool  # a Gradio temporary file (tmpXXXXXXXX) rather than an upload in its hash folder


class UploadFolder:
    """Deletes uploaded photos once answered (thread-safe; see the module docstring for the rules).

    ``clock`` is the wall clock the sweep compares file times with (``time.time``; tests pass their own).
    ``on_delete`` is called with each deleted path (the server drops it from Gradio's own file lists).
    """

    def __init__(self, root: str | os.PathLike, policy: UploadPolicy | None = None,
                 clock: Callable[[], float] = time.time, made_for_it: bool = False) -> None:
        self.root = Path(os.path.realpath(os.fspath(root)))
        self.policy = policy or UploadPolicy()
        self.clock = clock
        self.on_delete: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._answered: dict[str, float] = {}  # path -> when it was last answered
        self._held: Counter[str] = Counter()  # paths a diagnosis is reading now
        self._protected: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.deleted = 0  # files deleted since the start (for the log and the tests)
        self._created = made_for_it  # made for this server (by prepare() or its caller): close() removes it
        self._mode: int | None = None  # an existing folder's permissions, put back by close()

    # ----------------------------------------------------------------------------- set-up
    def prepare(self) -> int:
        """Create the folder (mode 0700) and mark it, or check an existing one; delete an earlier server's
        leftovers. Returns how many files were deleted. Raises :class:`UploadFolderError` naming the folder."""
        try:
            self._created = self._created or not self.root.exists()
            if not self._created:
                self._mode = self.root.stat().st_mode & 0o7777
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise UploadFolderError(f"upload folder {self.root}: cannot create it ({exc.strerror or exc})") from exc
        if not self.root.is_dir():
            raise UploadFolderError(f"upload folder {self.root}: exists and is not a folder")
        marker = self.root / MARKER
        try:
            names = [n for n in os.listdir(self.root) if n != MARKER]
        except OSError as exc:
            raise UploadFolderError(f"upload folder {self.root}: cannot list it ({exc.strerror or exc})") from exc
        if names and not marker.is_file():
            raise UploadFolderError(
                f"upload folder {self.root}: not empty and not a leaflens upload folder (no {MARKER} in it); "
                "give an empty or new folder, since everything Gradio writes there is deleted")
        owner = _owner(marker)
        if owner is not None and owner != os.getpid() and _alive(owner):
            raise UploadFolderInUse(f"upload folder {self.root}: in use by another running server (process {owner}); "
                                    "give each server its own folder")
        try:
            marker.write_text(f"pid {os.getpid()}\nPhotos uploaded to `leaflens serve`, deleted once answered.\n",
                              encoding="utf-8")
            os.chmod(self.root, 0o700)
        except OSError as exc:
            raise UploadFolderError(f"upload folder {self.root}: cannot write in it ({exc.strerror or exc})") from exc
        removed = sum(self._unlink(f.path) for f in self._scan())
        self._remove_empty_dirs(min_age_s=0.0)
        if removed:
            log.info("upload folder %s: deleted %d files left by an earlier server", self.root, removed)
        return removed

    def start(self) -> None:
        """Keep the files the page was built with (examples, plots) and start the background sweep."""
        with self._lock:
            self._protected = {f.path for f in self._scan()}
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="leaflens-uploads", daemon=True)
            self._thread.start()

    def close(self, delete_all: bool = True) -> None:
        """Stop the sweep; with ``delete_all``, delete every file Gradio wrote (the server is stopping), and
        the folder itself when :meth:`prepare` made it and nothing else is left in it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if delete_all and self.root.is_dir():
            with self._lock:
                self._protected.clear()
                self._held.clear()
            for f in self._scan():
                self._unlink(f.path)
            self._remove_empty_dirs(min_age_s=0.0)
            self._remove_empty_subfolders()
            try:
                if set(os.listdir(self.root)) <= {MARKER}:  # emptied: no trace of the server is left
                    (self.root / MARKER).unlink(missing_ok=True)
                    if self._created:
                        self.root.rmdir()
                if not self._created and self._mode is not None:
                    os.chmod(self.root, self._mode)
            except OSError:
                pass

    # ----------------------------------------------------------------------------- the service's calls
    def owns(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` lies in this folder (other files, an example photo say, are never deleted)."""
        return Path(os.path.realpath(os.fspath(path))).is_relative_to(self.root)

    def _inside(self, paths: Iterable[str | os.PathLike]) -> list[str]:
        return [p for p in (os.path.realpath(os.fspath(q)) for q in paths) if Path(p).is_relative_to(self.root)]

    @contextmanager
    def holding(self, paths: Iterable[str | os.PathLike]) -> Iterator[None]:
        """While the block runs, the sweep leaves ``paths`` alone (a diagnosis is reading them)."""
        mine = self._inside(paths)
        with self._lock:
            self._held.update(mine)
        try:
            yield
        finally:
            with self._lock:
                self._held.subtract(mine)
                for p in mine:
                    if self._held[p] <= 0:
                        del self._held[p]

    def answered(self, paths: Iterable[str | os.PathLike]) -> int:
        """``paths`` have their answer: they go after the retention (now, when it and the grace are 0).
        Returns how many were deleted at once."""
        now = self.clock()
        mine = self._inside(paths)
        with self._lock:
            for p in mine:
                self._answered[p] = now
        if self.policy.after_answer_s > 0:
            return 0
        deleted = 0
        for p in mine:
            with self._lock:
                if self._held[p] or p in self._protected:
                    continue
                self._answered.pop(p, None)
                deleted += self._unlink(p)
        return deleted

    def usage(self) -> tuple[int, int]:
        """(files, bytes) in the folder now, Gradio's temporary files included."""
        files = self._scan()
        return len(files), sum(f.size for f in files)

    # ----------------------------------------------------------------------------- the sweep
    def sweep(self) -> int:
        """Delete what is due (see the module docstring); returns how many files were deleted."""
        pol, now = self.policy, self.clock()
        files = self._scan()
        deleted, kept = 0, []
        for f in files:
            with self._lock:
                if f.path not in self._protected and not self._held[f.path] and self._due(f, now) <= now:
                    self._answered.pop(f.path, None)
                    if self._unlink(f.path):
                        deleted += 1
                        continue
            kept.append(f)
        total = sum(f.size for f in kept)  # the page's own files and those in use count, but stay
        cap = pol.max_mb * MB
        if total > cap:  # oldest first: answered photos before the rest, in-progress uploads never
            answered = self._answered.copy()
            kept.sort(key=lambda f: (f.path not in answered, f.ctime))
            for f in kept:
                if total <= cap:
                    break
                if f.temp and now - f.mtime < pol.stale_temp_s:
                    continue
                with self._lock:
                    if f.path in self._protected or self._held[f.path]:
                        continue
                    self._answered.pop(f.path, None)
                    if self._unlink(f.path):
                        deleted += 1
                        total -= f.size
            if total > cap:
                log.warning("upload folder %s holds %.0f MB, over its %.0f MB cap, in files still in use",
                            self.root, total / MB, pol.max_mb)
        with self._lock:  # forget answers whose file is gone (deleted by hand, or replaced and swept)
            present = {f.path for f in files}
            for p in [p for p in self._answered if p not in present]:
                del self._answered[p]
        self._remove_empty_dirs(min_age_s=pol.stale_temp_s)
        return deleted

    def _due(self, f: _File, now: float) -> float:
        pol = self.policy
        if f.temp:
            return f.mtime + (pol.stale_temp_s if f.size == 0 else max(pol.unanswered_s, pol.keep_s))
        answered_at = self._answered.get(f.path)
        if answered_at is not None and f.ctime <= answered_at:
            return answered_at + pol.after_answer_s
        return f.ctime + max(pol.unanswered_s, pol.keep_s)  # never answered, or uploaded again since

    def _run(self) -> None:
        while not self._stop.wait(self.policy.sweep_every_s):
            try:
                n = self.sweep()
            except Exception:  # a sweep must never stop the next one
                log.exception("upload folder %s: sweep failed", self.root)
                continue
            if n:
                log.debug("upload folder %s: deleted %d files", self.root, n)

    # ----------------------------------------------------------------------------- files
    def _scan(self) -> list[_File]:
        """Gradio's files in the folder: ``tmp*`` at the top, one level of files in each hash folder."""
        out: list[_File] = []
        try:
            top = list(os.scandir(self.root))
        except OSError:
            return out
        for entry in top:
            try:
                if entry.name.startswith("tmp") and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    out.append(_File(entry.path, st.st_size, st.st_ctime, st.st_mtime, True))
                elif _HASH_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                    for inner in os.scandir(entry.path):
                        if inner.is_file(follow_symlinks=False) or inner.is_symlink():
                            st = inner.stat(follow_symlinks=False)
                            out.append(_File(inner.path, st.st_size, st.st_ctime, st.st_mtime, False))
            except OSError:  # deleted while we looked
                continue
        return out

    def _unlink(self, path: str) -> int:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            log.warning("upload folder: cannot delete %s: %s", path, exc.strerror or exc)
            return 0
        self.deleted += 1
        if self.on_delete is not None:
            try:
                self.on_delete(path)
            except Exception:
                log.exception("upload folder: on_delete failed for %s", path)
        return 1

    def _remove_empty_subfolders(self) -> None:
        """Remove the empty folders Gradio makes in its temporary folder besides uploads (6.x makes
        ``vibe_edit_history`` when the app starts), so that a folder :meth:`prepare` made can go too."""
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    os.rmdir(entry.path)  # fails, harmlessly, when not empty
            except OSError:
                continue

    def _remove_empty_dirs(self, min_age_s: float) -> None:
        """Remove hash folders left empty for ``min_age_s`` (a younger one may be receiving an upload)."""
        now = self.clock()
        try:
            entries = [e for e in os.scandir(self.root) if _HASH_DIR.fullmatch(e.name)]
        except OSError:
            return
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False) and now - entry.stat().st_mtime >= min_age_s:
                    os.rmdir(entry.path)  # fails, harmlessly, when not empty
            except OSError:
                continue
