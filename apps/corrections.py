"""Corrections from the web page: a person says what a photo really shows, the photo joins the training data.

Under each answer the page offers "Wrong? The right answer is [class] / not a leaf". :class:`CorrectionStore`
keeps the ORIGINAL bytes of the corrected photo (never the decoded pixels: a retrain decodes them as
`leaflens preprocess` decodes every photo) in ``<root>/<class>/`` or ``<root>/not_a_leaf/``, which is the
class-folder layout `leaflens preprocess` reads, so ``leaflens preprocess --src photos --also <root>`` puts
them in the next training run. Each saved photo gets one JSON line in ``<root>/corrections.jsonl``: when,
which model (file name, SHA-256, training run id), what it predicted, what the person chose, the saved file
and the uploaded file's name (kept as metadata only).

Rules, because the bytes come from strangers' uploads:

- a saved file's name is generated here (``YYYYmmdd-HHMMSS-<random>.<ext>``, the extension from the
  file's own magic bytes): the uploaded name never becomes a path; a GIF, which the page answers but
  `leaflens preprocess` does not read, is saved as the PNG of its first frame (the frame the model judged;
  the log's ``sha256`` stays the GIF's, ``bytes`` the PNG's, ``saved_as`` says "png from gif");
- nothing is ever overwritten: the bytes are copied to a hidden temporary name in the class folder and
  hard-linked to the new name, which fails rather than replace an existing file;
- the same bytes saved twice under the same class are written once (the log is read back at each save, so
  this holds across server restarts and between servers sharing the folder, as long as the earlier file is
  still there), and a photo saved before is "already saved", never "full"; saved under another class, the
  latest answer wins: the earlier copy (a file this store made) is removed once the new one and its log line
  (``replaces``) are written, so a retrain never sees one photo under two classes;
- the folder is capped (``max_mb``, all files in it counted, the log included, counted again at each save, so
  photos moved out free their room at once): when a photo does not fit, :class:`CorrectionError` with reason
  ``full`` says so and nothing is written;
- a save holds an exclusive lock on ``<root>/.lock`` (``fcntl.flock`` where the system has it): two servers
  given one folder take turns, and neither saves a photo the other just saved;
- the folder is created on the first save only, so a server nobody corrects leaves no trace;
- a photo is saved only when the server answered its very bytes and the model analysed it, and its log line
  says what the server answered (:class:`leaflens.apps.answered.AnsweredPhotos`), never what the client's
  copy of the answer claims.

The log is appended to (one ``write`` per line, under a lock), not rewritten: an append cannot lose the
lines already there, which a rewrite interrupted half-way could. A line is written after its photo, so a
crash in between leaves a photo without its line, never a line without its photo.

No Gradio here: the page (leaflens.apps.web_feedback) and the tests use this class directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leaflens.apps.answered import AnsweredPhotos
from leaflens.apps.diagnosis import md_escape, photo_names
from leaflens.apps.i18n import t
from leaflens.apps.notes import ClassNotes
from leaflens.data_prep.arrays import sha256_file
from leaflens.files import clean_stale_temps, temp_path

try:
    import fcntl
except ImportError:  # Windows: one server per folder
    fcntl = None  # type: ignore[assignment]

__all__ = ["DEFAULT_DIR", "DEFAULT_MAX_MB", "LOCK_NAME", "LOG_NAME", "NOT_A_LEAF", "REASONS", "REQUEST_REASONS",
           "CorrectionError", "CorrectionStore", "Saved", "apply_correction", "mixed_answer", "render_correction",
           "size_text", "sniff_extension"]

log = logging.getLogger("leaflens.serve")

NOT_A_LEAF = "not_a_leaf"  # the folder for "this is not a leaf at all"
LOG_NAME = "corrections.jsonl"
DEFAULT_DIR = "artifacts/corrections"  # relative to the working folder, like the other artifacts
DEFAULT_MAX_MB = 500.0
MB = 1024 * 1024
# Why a photo was not saved: the folder is full; the uploaded file is gone (uploads are cleaned up);
# its bytes are not a photo format `leaflens preprocess` reads; the class is not the model's.
REASONS = ("full", "gone", "format", "unknown_class")
_INCOMING = "incoming"  # temporary files are ".incoming.tmp-<pid>-<random>" in the class folder
_CHUNK = 1024 * 1024
_NAME_TRIES = 8
_LINE_ROOM = 4096  # room kept for a photo's log line when checking the cap
LOCK_NAME = ".lock"  # flock()ed by a save (see the module docstring)
_COUNT_AGE_S = 5.0  # is_full() counts the folder again after this many seconds


class CorrectionError(Exception):
    """A correction that cannot be saved; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Saved:
    """One saved correction: ``file`` relative to the store's root (posix), the bytes' SHA-256 and size.

    ``duplicate``: the same bytes were already saved under the same class, so nothing new was written
    and ``file`` is the earlier copy.
    """

    file: str
    sha256: str
    size: int
    duplicate: bool = False
    # classes it had been saved under before, whose copies this save removed: the latest answer is the one a
    # retrain sees (two folders holding one photo would teach it both classes)
    replaced: tuple[str, ...] = ()


def sniff_extension(head: bytes) -> str | None:
    """The file extension for a photo from its first bytes (at least 12), or None when it is none of the
    formats `leaflens preprocess` reads (JPEG, PNG, WebP, BMP, TIFF, HEIC/HEIF). Deliberately not the
    uploaded name's extension: that name is the uploader's, and may lie."""
    if head[:3] == b"\xff\xd8\xff":
        return ".jpg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return ".png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return ".webp"
    if head[:2] == b"BM":
        return ".bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return ".tif"
    if head[4:8] == b"ftyp" and head[8:12] in (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx",
                                                 b"mif1", b"msf1"):
        return ".heic"
    return None


class CorrectionStore:
    """The corrections folder of one server (thread-safe; see the module docstring for the rules).

    ``classes``: the model's classes, the folder names a correction may choose besides :data:`NOT_A_LEAF`.
    ``model_path`` / ``run_id`` identify the model in every log line (its SHA-256 is computed on the
    first save). ``max_mb``: the folder's cap. ``clock``: seconds since the epoch (tests pass their own).
    """

    def __init__(self, root: str | os.PathLike, classes: Sequence[str], *, model_path: str | os.PathLike | None = None,
                 run_id: str | None = None, max_mb: float = DEFAULT_MAX_MB,
                 clock: Callable[[], float] = time.time) -> None:
        if max_mb <= 0:
            raise ValueError(f"the corrections folder's cap must be > 0 MB, got {max_mb}")
        bad = [c for c in classes if not c or c.startswith(".") or "/" in c or "\\" in c or c in (".", "..")]
        if bad:
            raise ValueError(f"class names {bad} cannot be folder names in the corrections folder")
        self.root = Path(root)
        self.classes = tuple(classes)
        self.model_path = Path(model_path) if model_path is not None else None
        self.run_id = run_id
        self.max_bytes = int(max_mb * MB)
        self._clock = clock
        self._lock = threading.Lock()
        self._used: tuple[float, int] | None = None  # (when, bytes in the folder): what is_full() last counted
        self._model_sha: str | None = None

    # ----------------------------------------------------------------------------- what it offers
    @property
    def labels(self) -> tuple[str, ...]:
        """What a correction may choose: the model's classes, then :data:`NOT_A_LEAF`."""
        return (*self.classes, NOT_A_LEAF) if NOT_A_LEAF not in self.classes else self.classes

    @property
    def log_path(self) -> Path:
        return self.root / LOG_NAME

    def used_bytes(self, max_age_s: float = 0.0) -> int:
        """Bytes in the folder (every file, the log included), counted again unless the last count is at most
        ``max_age_s`` old (the page asks after every answer; a save always counts afresh)."""
        with self._lock:
            now = time.monotonic()
            if self._used is None or now - self._used[0] > max_age_s:
                self._used = (now, self._usage())
            return self._used[1]

    def is_full(self) -> bool:
        """Whether the folder is at its cap: not even one more log line fits (a photo may not fit sooner:
        :meth:`save` says so for that photo). Counted at most every few seconds."""
        return self.used_bytes(max_age_s=_COUNT_AGE_S) + _LINE_ROOM > self.max_bytes

    # ----------------------------------------------------------------------------- saving
    def save(self, source: str | os.PathLike, chosen: str, *, photo_name: str,
             predicted: Mapping[str, Any] | None = None, answer: Mapping[str, Any] | None = None) -> Saved:
        """Copy the photo file ``source`` into the ``chosen`` class's folder under a new name and log it.

        ``photo_name``: what the uploader called the file (logged, never used as a path); ``predicted``:
        the photo's own answer (its entry of :func:`leaflens.apps.diagnosis.summarise`); ``answer``: the
        request's combined answer. Raises :class:`CorrectionError` (``unknown_class``, ``gone``,
        ``format``, ``full``) with a message naming the photo, the class or the folder.
        """
        if chosen not in self.labels:
            raise CorrectionError("unknown_class", f"{chosen!r} is not one of this model's classes "
                                                   f"({', '.join(self.labels)})")
        src = Path(source)
        try:
            size = src.stat().st_size
            with open(src, "rb") as fh:
                head = fh.read(32)
        except OSError as exc:
            raise CorrectionError("gone", f"{photo_name}: the uploaded file is no longer on the server "
                                          f"({exc.strerror or exc}); upload the photo again") from exc
        ext = sniff_extension(head)
        as_png = ext is None and head[:6] in (b"GIF87a", b"GIF89a")  # answered, but preprocess reads no GIF
        if as_png:
            ext = ".png"
        if ext is None:
            raise CorrectionError("format", f"{photo_name}: not a JPEG, PNG, WebP, BMP, TIFF, HEIC or GIF photo, so "
                                            "a retrain could not read it; not saved")
        try:
            first = sha256_file(src)
        except OSError as exc:
            raise CorrectionError("gone", f"{photo_name}: the uploaded file is no longer on the server "
                                          f"({exc.strerror or exc}); upload the photo again") from exc
        with self._lock, self._folder_lock():
            index = self._index()
            earlier = index.get((chosen, first))
            if earlier is not None and (self.root / earlier).is_file():  # saved before: no room needed
                return Saved(earlier, first, size, duplicate=True)
            elsewhere = {label: rel for (label, sha), rel in index.items()
                         if sha == first and label != chosen and (self.root / rel).is_file()}
            folder = self.root / chosen
            used = self._usage()
            # a relabelled photo's earlier copy goes once this one is saved: the folder does not grow by it
            old_sizes = {rel: _size_or_zero(self.root / rel) for rel in elsewhere.values()}
            replaced = sum(old_sizes.values())
            if used - replaced + size + _LINE_ROOM > self.max_bytes:
                raise CorrectionError("full", self._full_message(used, f"{photo_name} ({size_text(size)})"))
            folder.mkdir(parents=True, exist_ok=True)
            clean_stale_temps(folder / _INCOMING)
            tmp = temp_path(folder / _INCOMING)
            try:
                digest = _gif_as_png(src, tmp, photo_name) if as_png else _copy_hashing(src, tmp)
                if digest != first:
                    raise CorrectionError("gone", f"{photo_name}: the uploaded file changed while it was saved; "
                                                  "upload the photo again")
                if as_png:
                    size = tmp.stat().st_size
                    if used - replaced + size + _LINE_ROOM > self.max_bytes:
                        raise CorrectionError("full", self._full_message(used, f"{photo_name} as PNG "
                                                                               f"({size_text(size)})"))
                now = self._clock()
                final = self._link_new(tmp, folder, now, ext)
            finally:
                tmp.unlink(missing_ok=True)
            rel = final.relative_to(self.root).as_posix()
            record = self._record(now, rel, chosen, photo_name, digest, size, predicted, answer)
            if as_png:
                record["saved_as"] = "png from gif"
            if elsewhere:
                record["replaces"] = [{"chosen": label, "file": old} for label, old in sorted(elsewhere.items())]
            line = json.dumps(record, ensure_ascii=False) + "\n"
            with open(self.log_path, "a", encoding="utf-8") as fh:
                fh.write(line)
            freed = 0
            for old, old_size in old_sizes.items():  # after the new copy and its line: a crash leaves both
                try:
                    (self.root / old).unlink()
                    freed += old_size
                except FileNotFoundError:  # another server replaced it meanwhile
                    pass
                except OSError as exc:  # both copies stay (preprocess reports them as a label conflict)
                    log.warning("correction %s: could not remove the earlier copy %s (%s)", rel, old,
                                exc.strerror or exc)
            self._used = (time.monotonic(), used + size + len(line.encode("utf-8")) - freed)
        log.info("correction saved: %s as %s (predicted %s)%s", rel, chosen,
                 (predicted or {}).get("label") or (predicted or {}).get("verdict") or "-",
                 f"; replaces {', '.join(sorted(elsewhere.values()))}" if elsewhere else "")
        return Saved(rel, digest, size, replaced=tuple(sorted(elsewhere)))

    # ----------------------------------------------------------------------------- inside
    def _full_message(self, used: int, photo: str) -> str:
        # moving single photos out would leave corrections.jsonl naming files that are gone; the whole folder
        # moves with its log, and a training run reads it wherever it is
        return (f"the corrections folder {self.root} has no room left for {photo} ({_used_of(used, self.max_bytes)} "
                f"used); it was not saved. Start the server with a larger --corrections-max-mb, or, once a training "
                f"run has used these photos (leaflens preprocess --also {self.root}), move the whole folder aside "
                "(its corrections.jsonl with it): the server starts a new one at the next correction")

    def _link_new(self, tmp: Path, folder: Path, now: float, ext: str) -> Path:
        """Give ``tmp`` a fresh generated name in ``folder`` without replacing anything; the new path."""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
        for _ in range(_NAME_TRIES):
            final = folder / f"{stamp}-{secrets.token_hex(4)}{ext}"
            try:
                os.link(tmp, final)  # fails with FileExistsError instead of replacing
                return final
            except FileExistsError:
                continue
            except OSError:  # a file system without hard links: exclusive create, then copy
                try:
                    with open(final, "xb") as out, open(tmp, "rb") as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                except FileExistsError:
                    continue
                return final
        raise CorrectionError("full", f"{folder}: no free file name after {_NAME_TRIES} tries")

    @contextlib.contextmanager
    def _folder_lock(self) -> Any:
        """Exclusive use of the folder against other processes (other servers given the same folder)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_NAME, "a+b") as fh:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def _usage(self) -> int:
        """Bytes in the folder now, counted from the disk (photos moved out free their room at once)."""
        total = 0
        if self.root.is_dir():
            for dirpath, _, filenames in os.walk(self.root):
                for name in filenames:
                    try:
                        total += os.lstat(os.path.join(dirpath, name)).st_size
                    except OSError:
                        continue
        return total

    def _index(self) -> dict[tuple[str, str], str]:
        """(class, sha256) -> saved file, read back from the log (what this server, an earlier one or another
        one sharing the folder saved)."""
        found: dict[tuple[str, str], str] = {}
        try:
            with open(self.log_path, encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    try:
                        rec = json.loads(line)
                        found[(str(rec["chosen"]), str(rec["sha256"]))] = str(rec["file"])
                    except (ValueError, KeyError, TypeError):
                        log.warning("%s line %d is not a correction record; ignored", self.log_path, number)
        except FileNotFoundError:
            pass
        return found

    def model_sha256(self) -> str | None:
        """``sha256:<hex>`` of the model file (computed once), None without a readable model file."""
        if self._model_sha is None and self.model_path is not None:
            try:
                h = hashlib.sha256()
                with open(self.model_path, "rb") as fh:
                    while chunk := fh.read(_CHUNK):
                        h.update(chunk)
                self._model_sha = "sha256:" + h.hexdigest()
            except OSError:
                return None
        return self._model_sha

    def _record(self, now: float, rel: str, chosen: str, photo_name: str, digest: str, size: int,
                predicted: Mapping[str, Any] | None, answer: Mapping[str, Any] | None) -> dict[str, Any]:
        p = predicted or {}
        a = answer or {}
        return {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "file": rel,
            "chosen": chosen,
            "predicted": {"verdict": p.get("verdict"), "label": p.get("label"),
                          "confidence": p.get("confidence"), "candidates": list(p.get("candidates") or [])},
            "answer": {"verdict": a.get("verdict"), "label": a.get("label")},
            "model": self.model_path.name if self.model_path is not None else None,
            "model_sha256": self.model_sha256(),
            "run_id": self.run_id,
            "sha256": digest,
            "bytes": size,
            "photo_name": photo_name,
        }


def size_text(n: int, decimals: int = 1) -> str:
    """A byte count for people: 9.5 KB, 12.3 MB (the corrections folder's sizes, the Model tab's file)."""
    return f"{n / MB:.{decimals}f} MB" if n >= MB / 10 else f"{n / 1024:.{decimals}f} KB"


def _size_or_zero(path: Path) -> int:
    """``path``'s size in bytes, 0 when it is gone (another server may have replaced it meanwhile)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _used_of(used: int, cap: int) -> str:
    """"0.34 MB of 0.35 MB": with the decimals (up to 3) that tell a folder just under its cap from the cap."""
    for decimals in (1, 2, 3):
        a, b = size_text(used, decimals), size_text(cap, decimals)
        if a != b:
            break
    return f"{a} of {b}"


def _copy_hashing(src: Path, tmp: Path) -> str:
    """Copy ``src`` to the new file ``tmp``; the copied bytes' ``sha256:<hex>``."""
    h = hashlib.sha256()
    try:
        with open(src, "rb") as fin, open(tmp, "xb") as fout:
            while chunk := fin.read(_CHUNK):
                h.update(chunk)
                fout.write(chunk)
    except FileNotFoundError as exc:
        raise CorrectionError("gone", f"{src.name}: the uploaded file is no longer on the server; upload the "
                                      "photo again") from exc
    return "sha256:" + h.hexdigest()


def _gif_as_png(src: Path, tmp: Path, photo_name: str) -> str:
    """Write the first frame of the GIF ``src`` (the one the model judged) to the new file ``tmp`` as PNG,
    transparency kept, for `leaflens preprocess`, which reads no GIF; the GIF bytes' ``sha256:<hex>``, so the
    same upload saved twice is still found as one."""
    from PIL import Image  # noqa: PLC0415

    from leaflens.data_prep.decode import DEFAULT_MAX_PIXELS  # noqa: PLC0415

    try:
        data = src.read_bytes()
    except FileNotFoundError as exc:
        raise CorrectionError("gone", f"{photo_name}: the uploaded file is no longer on the server; upload the "
                                      "photo again") from exc
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > DEFAULT_MAX_PIXELS:
                raise CorrectionError("format", f"{photo_name}: a GIF of {im.width}x{im.height} px, too large to "
                                                "save; not saved")
            im.seek(0)
            frame = im.convert("RGBA" if "transparency" in im.info else "RGB")
        with open(tmp, "xb") as out:
            frame.save(out, "PNG")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise CorrectionError("format", f"{photo_name}: its GIF could not be read again to save it as PNG "
                                        f"({exc}); not saved") from exc
    return "sha256:" + hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- one correction from the page
# Why nothing (or not everything) was saved, besides REASONS: no answer to correct; no class chosen; the
# photo number is not one of the answer's; the photos are not those of the answer; the model did not
# analyse the photo (refused or unreadable), so there is nothing to correct; this server never answered
# these bytes (a changed file, or a server restarted since); "all" of an answer whose other photos were judged
# left this one out as unlike the model's photos (a bee beside the leaf is not saved as "rust" by "all").
REQUEST_REASONS = ("no_answer", "no_choice", "bad_photo", "photos_changed", "not_analysed", "not_diagnosed",
                   "which_photo", "left_out", "which_photo_left_out")


def mixed_answer(answer: Mapping[str, Any] | None) -> bool:
    """Whether the analysed photos of an answer may show different things: they disagree, or some were left out
    as unlike the model's photos while others were judged (a leaf and a bee). A correction of such an answer
    names the photo it is for, or says "all" in so many words: "not a leaf" for the bee must not file the leaf
    beside it under not_a_leaf."""
    if not isinstance(answer, Mapping):
        return False
    seen = [p.get("verdict") for p in answer.get("photos") or [] if isinstance(p, Mapping) and p.get("ok")]
    return len(seen) > 1 and (answer.get("verdict") == "disagree" or
                              ("out_of_domain" in seen and any(v != "out_of_domain" for v in seen)))


def apply_correction(store: CorrectionStore, files: Sequence[str | os.PathLike] | None,
                     answer: Mapping[str, Any] | None, which: str | int | None, chosen: str | None,
                     answered: AnsweredPhotos | None = None) -> dict[str, Any]:
    """Save the photos of ``answer`` (what /diagnose returned for ``files``) as ``chosen``, as JSON.

    ``which``: "all" (or empty) for every photo the model analysed, else the photo's number (1-based, the
    per-photo table's #). ``files`` must be the files the answer was given for, in the same order (their
    base names are checked against the answer's photo names: a correction never lands on another photo).
    ``answered``: the server's own record of what it answered (the web app always gives it). Then a photo
    is saved only when its bytes are ones the server answered, and whether the model analysed it and what
    it predicted are taken from that record, never from the client's ``answer``, which may have been edited
    or belong to other bytes of the same name.
    "all" with a class of the model means the photos the answer judged: a photo left out of it as unlike the
    model's photos while others were judged is skipped (``left_out``; name it by its number to save it).
    Returns ``ok`` (at least one photo saved or already there), ``reason`` (None, or why nothing was saved:
    :data:`REQUEST_REASONS` or :data:`REASONS`), ``message`` (None, or that reason in words, for API callers),
    ``chosen``, ``saved`` (``photo``, ``file``, ``duplicate``) and ``skipped`` (``photo``, ``reason``,
    ``message``).
    """
    out: dict[str, Any] = {"ok": False, "reason": None, "message": None, "chosen": chosen, "saved": [],
                           "skipped": []}

    def refuse(reason: str) -> dict[str, Any]:
        out["reason"] = reason
        out["message"] = _refusal_text(reason, store)
        return out

    if not isinstance(answer, Mapping):
        return refuse("no_answer")
    photos = answer.get("photos")
    if not isinstance(photos, list) or not photos or not all(isinstance(p, Mapping) for p in photos):
        return refuse("no_answer")
    if not chosen:
        return refuse("no_choice")
    if chosen not in store.labels:
        return refuse("unknown_class")
    if which in (None, "") and mixed_answer(answer):  # photos that may show different things: "all" must be said
        if answer.get("verdict") == "disagree":
            return refuse("which_photo")
        # they agreed, but some were left out as unlike the model's photos (a leaf and a bee): named
        out["left_out_photos"] = [str(p.get("name")) for p in photos if p.get("verdict") == "out_of_domain"]
        refused = refuse("which_photo_left_out")
        refused["message"] = t(_left_out_key(chosen), "en", names=", ".join(out["left_out_photos"])).replace("**", "")
        return refused
    every = which in (None, "", "all")
    if which in (None, "", "all"):
        picked = list(range(len(photos)))
    else:
        try:
            number = int(which)
        except (TypeError, ValueError):
            return refuse("bad_photo")
        if not 1 <= number <= len(photos):
            return refuse("bad_photo")
        picked = [number - 1]
    paths = [os.fspath(f) for f in (files or [])]
    shown = photo_names(paths)
    if any(i >= len(paths) or shown[i] != photos[i].get("name") for i in picked):
        return refuse("photos_changed")
    told = answer.get("answer") if isinstance(answer.get("answer"), Mapping) else None
    # "all" as a class: the photos the answer judged, when it judged some and left others out
    judged_only = every and chosen != NOT_A_LEAF and mixed_answer(answer)
    for i in picked:
        photo, said = photos[i], told
        name = str(photo.get("name"))
        if answered is not None:
            try:
                known = answered.lookup(sha256_file(paths[i]))
            except OSError:
                out["skipped"].append({"photo": name, "reason": "gone", "message": f"{name}: the uploaded file is "
                                       "no longer on the server; upload the photo again"})
                continue
            if known is None:
                out["skipped"].append({"photo": name, "reason": "not_diagnosed",
                                       "message": f"{name}: this server has no answer for these bytes"})
                continue
            photo, said = {**known["photo"], "name": name}, known["answer"]
        if not photo.get("ok"):
            out["skipped"].append({"photo": name, "reason": "not_analysed",
                                   "message": f"{name}: the model did not analyse it ({photo.get('verdict')})"})
            continue
        if judged_only and photo.get("verdict") == "out_of_domain":
            out["skipped"].append({"photo": name, "reason": "left_out",
                                   "message": f"{name}: left out of this answer as not a photo this model knows; "
                                              f"choose it by its number to save it as {chosen}"})
            continue
        try:  # each photo is tried: one too large for the room left does not stop a smaller one or a relabel
            saved = store.save(paths[i], chosen, photo_name=name, predicted=photo, answer=said)
        except CorrectionError as exc:
            out["skipped"].append({"photo": name, "reason": exc.reason, "message": str(exc)})
            continue
        out["saved"].append({"photo": name, "file": saved.file, "duplicate": saved.duplicate,
                             "replaced": list(saved.replaced)})
    out["ok"] = bool(out["saved"])
    if not out["ok"]:
        out["reason"] = out["skipped"][0]["reason"] if out["skipped"] else "no_answer"
        out["message"] = out["skipped"][0]["message"] if out["skipped"] else _refusal_text("no_answer", store)
    return out


def _left_out_key(chosen: object) -> str:
    """The words for "which photo?" when photos were left out: "all" saves every photo as not a leaf, or the
    judged ones as a class (those left out skipped)."""
    return "correct_which_photo_left_out_all" if chosen == NOT_A_LEAF else "correct_which_photo_left_out"


def _refusal_text(reason: str, store: CorrectionStore) -> str:
    """Why a request saved nothing, in English (the API's ``message``; the page says it in its language)."""
    if reason == "unknown_class":
        return f"that answer is not one of this model's classes ({', '.join(store.labels)})"
    return t(f"correct_{reason}", "en").replace("**", "")


def render_correction(result: Mapping[str, Any] | None, notes: ClassNotes | None, lang: str) -> str:
    """What the page says after "Save correction", in ``lang`` (empty before any)."""
    if not result:
        return ""
    notes = notes or ClassNotes()
    chosen = result.get("chosen")
    name = t("not_a_leaf", lang) if chosen == NOT_A_LEAF else notes.name(str(chosen), lang)
    lines = []
    saved = list(result.get("saved") or [])
    if saved:
        fresh = sum(not s["duplicate"] for s in saved)
        if fresh:
            key = "correct_saved_not_a_leaf" if chosen == NOT_A_LEAF else "correct_saved"
            lines.append(t(key, lang, n=fresh, name=md_escape(name)))
            if fresh < len(saved):
                lines.append(t("correct_saved_before", lang, k=len(saved) - fresh))
        else:
            lines.append(t("correct_all_before", lang, name=md_escape(name)))
        moved = sorted({c for s in saved for c in s.get("replaced") or []})
        if moved:
            names = ", ".join(md_escape(t("not_a_leaf", lang) if c == NOT_A_LEAF else notes.name(c, lang))
                              for c in moved)
            key = "correct_replaced_not_a_leaf" if chosen == NOT_A_LEAF else "correct_replaced"
            lines.append(t(key, lang, k=sum(bool(s.get("replaced")) for s in saved), names=names))
    elif result.get("reason") == "which_photo_left_out":
        names = ", ".join(md_escape(str(n)) for n in result.get("left_out_photos") or [])
        lines.append(t(_left_out_key(chosen), lang, names=names))
    elif result.get("reason") in (*REQUEST_REASONS[:4], "which_photo", "unknown_class"):
        lines.append(t(f"correct_{result['reason']}", lang))
    for skip in result.get("skipped") or []:
        lines.append(t("correct_skipped", lang, photo=md_escape(str(skip["photo"])),
                       why=t(f"correct_why_{skip['reason']}", lang)))
    return "\n\n".join(lines)
