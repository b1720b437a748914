"""Atomic file and folder writes: a reader sees the old content or the new, never a torn file.

Every write goes to a temporary name in the target's own folder (a rename is atomic only within one
file system), then :func:`os.replace` puts it in place. Temporary names are unique per process and
per call (``.<name>.tmp-<pid>-<random><suffix>``), so two runs writing the same target never write
into each other's temporary file; the last rename wins whole. On any failure, the temporary file or
folder is removed and the old target is left untouched.

The one place for this in every package (engine checkpoints, data_prep manifests and arrays, pipeline
reports and ONNX files, apps outputs): it lives at the package root and imports nothing from
leaflens (only NumPy, to write its numbers as JSON), so each package may use it without breaking the
design's import arrows.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no output lock (see output_lock)
    fcntl = None  # type: ignore[assignment]

PathLike = str | os.PathLike[str]

# The markers of leftover temporaries beside a target: "tmp" from this module, "old" from a folder
# swap, "partial" from stages that write their folder under that name.
_TEMP_KINDS = ("tmp", "old", "partial")


def temp_path(target: PathLike, kind: str = "tmp") -> Path:
    """A fresh temporary name beside ``target``: ``.<name>.<kind>-<pid>-<random><suffix>``.

    The target's suffix is kept, so writers that pick a format from the extension (Pillow) or add one
    (``np.save`` appends ``.npy``) write exactly this path. :func:`clean_stale_temps` reads the pid back.
    """
    target = Path(target)
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}{target.suffix}")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def write_path_atomic(target: PathLike, write: Callable[[Path], object], *, fsync: bool = False) -> Path:
    """Call ``write(tmp)`` to create a temporary file beside ``target``, then rename it over ``target``.

    For writers that take a path (``image.save(tmp)``, ``np.save(tmp, a)``). With ``fsync`` the file
    and its folder are synced, so the new content survives a power cut once this returns (checkpoints).
    The parent folder is created if needed. Returns ``target`` as a Path.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(target)
    try:
        write(tmp)
        if not tmp.is_file():
            raise FileNotFoundError(f"writing {target}: the writer did not create its temporary file {tmp}")
        if fsync:
            _fsync_file(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # after a successful replace it is gone already
    if fsync:
        _fsync_dir(target.parent)
    return target


def write_atomic(target: PathLike, write: Callable[[BinaryIO], object], *, fsync: bool = False) -> Path:
    """Call ``write(fh)`` on a binary file open at a temporary name beside ``target``, then rename it
    over ``target`` (see :func:`write_path_atomic`)."""

    def to_file(tmp: Path) -> None:
        with open(tmp, "xb") as fh:
            write(fh)

    return write_path_atomic(target, to_file, fsync=fsync)


def write_bytes_atomic(target: PathLike, data: bytes, *, fsync: bool = False) -> Path:
    """Write ``data`` to ``target`` atomically."""
    return write_atomic(target, lambda fh: fh.write(data), fsync=fsync)


def write_text_atomic(target: PathLike, text: str, *, encoding: str = "utf-8", fsync: bool = False) -> Path:
    """Write ``text`` to ``target`` atomically (no newline translation)."""
    return write_bytes_atomic(target, text.encode(encoding), fsync=fsync)


def json_default(o: Any) -> Any:
    """What ``json`` cannot write by itself: NumPy scalars and arrays (as numbers and lists), paths."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def write_json_atomic(target: PathLike, obj: Any, *, indent: int | None = 2,
                      default: Callable[[Any], Any] = json_default, fsync: bool = False) -> Path:
    """Write ``obj`` as UTF-8 JSON (non-ASCII kept, key order kept, newline at the end) atomically.

    ``default`` converts what ``json`` cannot (by default :func:`json_default`). The object is
    serialised before anything is written, so an unserialisable value leaves no file behind.
    """
    text = json.dumps(obj, indent=indent, ensure_ascii=False, default=default) + "\n"
    return write_text_atomic(target, text, fsync=fsync)


# ---------------------------------------------------------------------------- folders
def new_temp_dir(target: PathLike, kind: str = "tmp") -> Path:
    """Create and return an empty folder beside ``target`` to build its new content in
    (``.<name>.<kind>-<pid>-<random>``); finish with :func:`swap_into_place`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp


class NotOurFolderError(ValueError):
    """An output folder holds something a stage did not write there: it is never replaced."""


class OutputNotWritableError(NotOurFolderError):
    """An output folder cannot be written where it is asked for (said before the work, not after it)."""


MOVED_DEPTH = 4  # trailing parts of a gone absolute path that find_moved tries


def find_moved(recorded: PathLike, start: PathLike, same: Callable[[Path], bool]) -> Path | None:
    """Where the folder recorded by absolute path ``recorded``, now gone, is after its project was moved or
    renamed: its last parts (``photos``, then ``project/photos``... up to ``MOVED_DEPTH``) under ``start`` and
    each folder above it, the first that ``same`` confirms is the recorded folder; None when none is."""
    parts = Path(recorded).parts[1:]
    here = Path(start).resolve()
    for k in range(1, min(MOVED_DEPTH, len(parts)) + 1):
        tail = Path(*parts[-k:])
        for base in (here, *here.parents):
            if (base / tail).is_dir() and same(base / tail):
                return base / tail
    return None


def csv_starting(columns: Sequence[str]) -> Callable[[Path], bool]:
    """A test for :func:`results_file_problem`: does the file's first line start with these CSV columns?"""
    want = ",".join(columns)

    def test(path: Path) -> bool:
        try:
            with open(path, encoding="utf-8-sig", errors="replace", newline="") as fh:
                return fh.readline(4096).startswith(want)
        except OSError:
            return False
    return test


def json_with(keys: Sequence[str]) -> Callable[[Path], bool]:
    """A test for :func:`results_file_problem`: is the file a JSON object (at most 64 MB) with these keys?"""
    def test(path: Path) -> bool:
        try:
            if path.stat().st_size > 64 * 2**20:
                return False
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and all(k in data for k in keys)
    return test


def results_file_problem(target: PathLike, inputs: dict[str, PathLike], example: str = "results.json",
                         ours: Callable[[Path], bool] | None = None) -> str | None:
    """Why a command's results file (``--csv``, ``--json``) cannot go to ``target``, checked before the work;
    None when it can. ``inputs`` names what the command reads (``{"the model": path, "the photos": folder}``):
    a results file must never replace the model, or a photo inside a folder it reads. ``ours`` tells an earlier
    results file of the same command (:func:`csv_starting`, :func:`json_with`): with it, an existing file that
    is anything else (a model, a report of another stage, a photo) is not replaced either."""
    target = Path(target)
    if target.is_dir():
        return f"{target} is a folder; give a file path (e.g. {target / example})"
    parent = target.resolve().parent
    if not parent.is_dir():
        return (f"{target}: {parent} is a file, not a folder" if parent.exists() else
                f"{target}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{target}: cannot write in the folder {parent} (permission denied)"
    try:  # what os.access cannot tell: a read-only file system, or root where the kernel refuses (/sys, /proc)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        return f"{target}: cannot write in the folder {parent} ({exc.strerror or exc})"
    if target.exists():
        real = Path(os.path.realpath(target))
        own_kind = real.suffix.lower() == Path(example).suffix.lower()  # an earlier results file may be replaced
        for what, source in inputs.items():
            src = Path(os.path.realpath(source))
            if real == src or (src.is_dir() and src in real.parents and not own_kind):
                return (f"{target} is {what}" if real == src else f"{target} is a file in {what} ({source})") + \
                    "; writing the results there would replace it: give a new file path"
        if not real.is_file():
            return f"{target} is not a regular file; give a file path (e.g. {example})"
        if ours is not None and not ours(real):
            return (f"{target} exists and is not an earlier results file of this command; writing the results "
                    "there would replace it: give a new file path (or delete that file first)")
    return None


# The files that mark a folder some stage replaces whole when it runs again (a dataset, a teacher, a run, an
# export, synthetic photos): an output inside one would be deleted by that stage's next run.
_STAGE_FOLDERS = ((("manifest.json", "train_files.txt"), "dataset", "leaflens preprocess"),
                  (("teacher.json", "features_train.npy"), "teacher", "leaflens teacher"),
                  (("report.json", "run_id.json"), "run", "leaflens distill"),
                  (("parity.json", "student.onnx"), "export", "leaflens export"),
                  (("synth.json",), "synthetic photos", "leaflens data synth"))


def stage_folder_above(target: PathLike) -> tuple[Path, str, str] | None:
    """The nearest folder above ``target`` that a stage replaces whole when it runs again, as (folder, kind,
    command); None when there is none."""
    for parent in Path(os.path.abspath(target)).parents:
        for markers, kind, stage in _STAGE_FOLDERS:
            if all((parent / m).is_file() for m in markers):
                return parent, kind, stage
    return None


def check_replaceable(target: PathLike, marker: str, what: str) -> None:
    """Refuse to replace ``target`` unless it is missing, an empty folder, or a folder holding ``marker`` (the
    file this kind of folder always has): a mistyped ``--out`` must never delete someone's files. Refuse as well
    a ``target`` inside another stage's folder, which that stage's next run would delete with it. Raises
    :class:`NotOurFolderError` naming the folder; call it before any work that would end in the swap."""
    target = Path(target)
    here = Path(os.path.abspath(target)).parent  # the folder is built beside the target, then renamed
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise OutputNotWritableError(f"output {target} cannot be written: {here} is a file, not a folder; give "
                                     "another --out")
    if not os.access(here, os.W_OK | os.X_OK):
        raise OutputNotWritableError(f"output {target} cannot be written: {here} is not a folder you can write in "
                                     "(permission denied); give another --out")
    if (above := stage_folder_above(target)) is not None:
        parent, kind, stage = above
        raise NotOurFolderError(f"output {target} is inside the {kind} folder {parent}, which `{stage}` "
                                "replaces whole when it runs again: give a folder outside it")
    if target.exists() and not target.is_dir():
        raise NotOurFolderError(f"output {target} exists and is a file, not a folder; refusing to replace it: give a "
                                "new or empty folder")
    if target.exists() and any(target.iterdir()) and not (target / marker).exists():
        raise NotOurFolderError(f"output {target} exists and is not a {what} (no {marker} in it); refusing to "
                                "replace it: give a new or empty folder")


def swap_into_place(tmp: PathLike, target: PathLike, *, replace: bool = True) -> bool:
    """Rename the finished folder ``tmp`` to ``target``; True when it is in place.

    An existing ``target`` is first renamed aside and removed only after the new folder is in place,
    so at every moment one complete folder exists on disk. With ``replace=False`` (caches, where any
    complete copy will do) an existing non-empty ``target`` is kept: ``tmp`` is removed and False is
    returned.
    """
    tmp, target = Path(tmp), Path(target)
    if not replace:
        try:
            os.rename(tmp, target)  # succeeds onto nothing or an empty folder only
            return True
        except OSError:
            if not target.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return False
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    return True


def restore_interrupted_swap(target: PathLike) -> Path | None:
    """Put back the folder :func:`swap_into_place` had renamed aside (``.<name>.old-<pid>-*``) when its process
    was killed before the new folder took its place: ``target`` is missing, and that complete folder, a whole
    teacher or run, would otherwise be removed as a leftover. The newest of them, when there are several; its
    path as it was, or None when there was nothing to put back."""
    target = Path(target)
    if target.exists() or target.is_symlink():
        return None
    aside = [p for p in _left_by_the_dead(target, "old") if p.is_dir() and not p.is_symlink()]
    if not aside:
        return None
    newest = max(aside, key=lambda p: p.stat().st_mtime)
    try:
        os.rename(newest, target)
    except OSError:
        return None
    return newest


def _left_by_the_dead(target: Path, kind: str) -> list[Path]:
    """The temporaries ``.<name>.<kind>-<pid>-*`` beside ``target`` whose process no longer exists."""
    prefix = f".{target.name}.{kind}-"
    found = []
    for p in target.parent.glob(prefix + "*"):
        try:
            pid = int(p.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            found.append(p)
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def clean_stale_temps(target: PathLike) -> list[Path]:
    """Remove the temporaries (files or folders named ``.<name>.tmp-<pid>-*``, ``.old-``, ``.partial-``)
    that processes killed while writing ``target`` left beside it; the removed paths.

    Only temporaries of processes that no longer exist are touched: a concurrent writer's are its own.
    Stages that write through a temporary folder call this first, so a kill -9 never leaks disk for good.
    A complete folder set aside by a swap that was killed half-way is put back first
    (:func:`restore_interrupted_swap`), never removed.
    """
    target = Path(target)
    restore_interrupted_swap(target)
    removed = []
    for kind in _TEMP_KINDS:
        for p in _left_by_the_dead(target, kind):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


class OutputBusy(RuntimeError):
    """Another process is writing the same output folder (see :func:`output_lock`)."""


def output_folder(target: PathLike) -> Path:
    """The folder a stage writes for ``--out target``: the link's own target when ``target`` is a symbolic link
    (a run kept on another disk behind a link), so the folder swap replaces what the link points at instead of
    the link itself."""
    path = Path(target)
    if not path.is_symlink():
        return path
    try:
        return path.resolve(strict=False)
    except (RuntimeError, OSError) as exc:  # a loop of links (RuntimeError before Python 3.13)
        raise ValueError(f"--out {path} is a symbolic link that leads to no folder ({exc}); give a folder") from None


@contextlib.contextmanager
def output_lock(target: PathLike, stage: str) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside the output folder ``target`` for a stage's whole run, so a second run given
    the same folder (an overlapping cron job, a retry while the first still runs) is refused at once with
    :class:`OutputBusy` naming the process, instead of removing the first one's work in progress under it.
    ``fcntl.flock``: the lock goes with the process, so a killed run never leaves the folder locked (only the
    empty file, which the next run takes and removes). The file is removed while still locked, and a run that
    locked a file already removed takes the new one: two runs never hold two files of one name. Where flock is
    missing (Windows), nothing is locked."""
    path = Path(target)
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.parent / f".{path.name}.lock"
    while True:
        fh = open(lock, "a+", encoding="utf-8")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            pid, _, theirs = fh.read().strip().partition(" ")
            fh.close()
            raise OutputBusy(f"{path} is being written by leaflens {theirs or stage} (process {pid or '?'}); wait "
                             "for it to end, or give another --out") from None
        try:
            current = os.stat(lock).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        fh.close()  # its holder removed it after we opened it: lock the file there now
    try:
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()} {stage}\n")
        fh.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        fh.close()  # closing releases the lock
