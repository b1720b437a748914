"""leaflens.files: atomic writes keep the old file on failure, leave no temporary, and never collide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from leaflens import files
from leaflens.cpus import worker_context


def _leftovers(folder: Path, target: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{target}."))


def test_json_text_and_bytes_round_trip(tmp_path: Path) -> None:
    files.write_json_atomic(tmp_path / "sub" / "a.json", {"b": 1, "a": "é"})  # the folder is created
    text = (tmp_path / "sub" / "a.json").read_text(encoding="utf-8")
    assert text == '{\n  "b": 1,\n  "a": "é"\n}\n'  # key order and non-ASCII kept, newline at the end
    files.write_text_atomic(tmp_path / "t.txt", "line\r\n")
    assert (tmp_path / "t.txt").read_bytes() == b"line\r\n"
    files.write_bytes_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert _leftovers(tmp_path, "a.json") == [] and _leftovers(tmp_path, "b.bin") == []


def test_json_writes_numpy_values_and_paths(tmp_path: Path) -> None:
    obj = {"x": np.float32(0.5), "n": np.int64(3), "a": np.arange(2), "p": tmp_path / "f"}
    files.write_json_atomic(tmp_path / "n.json", obj)
    assert json.loads((tmp_path / "n.json").read_text()) == {"x": 0.5, "n": 3, "a": [0, 1], "p": str(tmp_path / "f")}
    files.write_json_atomic(tmp_path / "d.json", {"s": {1}}, default=sorted)
    assert json.loads((tmp_path / "d.json").read_text()) == {"s": [1]}


def test_a_writer_that_fails_midway_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.npz"
    target.write_bytes(b"old content")

    def torn(fh) -> None:
        fh.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.write_atomic(target, torn)
    assert target.read_bytes() == b"old content"
    assert _leftovers(tmp_path, "ckpt.npz") == []


def test_unserialisable_json_writes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    target.write_text("{}")
    with pytest.raises(TypeError, match="not JSON-serialisable: object"):
        files.write_json_atomic(target, {"x": object()})
    assert target.read_text() == "{}" and _leftovers(tmp_path, "r.json") == []


def test_a_failed_rename_leaves_no_temporary(tmp_path: Path) -> None:
    blocked = tmp_path / "out.png"
    blocked.mkdir()  # os.replace of a file onto a folder fails
    (blocked / "inside").write_text("kept")
    with pytest.raises(OSError):
        files.write_bytes_atomic(blocked, b"png")
    assert (blocked / "inside").read_text() == "kept"
    assert _leftovers(tmp_path, "out.png") == []


def test_path_writer_keeps_the_suffix_and_must_create_the_file(tmp_path: Path) -> None:
    seen = []
    files.write_path_atomic(tmp_path / "a.npy", lambda p: (seen.append(p), np.save(p, np.arange(3))))
    assert seen[0].suffix == ".npy" and seen[0].parent == tmp_path  # np.save adds no second .npy
    assert np.load(tmp_path / "a.npy").tolist() == [0, 1, 2]
    with pytest.raises(FileNotFoundError, match="did not create"):
        files.write_path_atomic(tmp_path / "b.npy", lambda p: None)
    assert not (tmp_path / "b.npy").exists()


def test_fsync_syncs_the_file_and_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    files.write_bytes_atomic(tmp_path / "a", b"x")
    assert synced == []  # off by default
    files.write_bytes_atomic(tmp_path / "a", b"y", fsync=True)
    assert len(synced) == 2 and (tmp_path / "a").read_bytes() == b"y"


def test_temp_names_are_unique_per_call_and_process(tmp_path: Path) -> None:
    names = {files.temp_path(tmp_path / "x.json") for _ in range(200)}
    assert len(names) == 200
    assert all(n.name.startswith(f".x.json.tmp-{os.getpid()}-") and n.suffix == ".json" for n in names)


def _write_many(args: tuple[str, int]) -> None:
    target, who = args
    payload = bytes([who]) * 200_000
    for _ in range(20):
        files.write_bytes_atomic(target, payload)


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_concurrent_writers_never_tear_the_file(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "shared.bin"
    jobs = [(str(target), who) for who in range(1, 5)]
    stop = threading.Event()
    torn = []

    def reader() -> None:
        while not stop.is_set():
            if target.exists():
                data = target.read_bytes()
                if len(data) != 200_000 or len(set(data)) != 1:
                    torn.append(len(data))

    watcher = threading.Thread(target=reader)
    watcher.start()
    try:
        if kind == "threads":
            with ThreadPoolExecutor(len(jobs)) as pool:
                list(pool.map(_write_many, jobs))  # re-raises a writer's error here
        else:
            # forkserver, as the product's pools: a fork of this multi-threaded process (the reader above, the
            # engine's pool threads of earlier tests) can copy a held lock, and the child waited on it forever
            with worker_context().Pool(4) as pool:
                pool.map(_write_many, jobs)
    finally:
        stop.set()
        watcher.join()
    data = target.read_bytes()
    assert torn == [] and len(data) == 200_000 and len(set(data)) == 1 and data[0] in range(1, 5)
    assert _leftovers(tmp_path, "shared.bin") == []


def test_swap_into_place_replaces_a_folder_whole(tmp_path: Path) -> None:
    out = tmp_path / "dataset"
    first = files.new_temp_dir(out)
    (first / "manifest.json").write_text("1")
    assert files.swap_into_place(first, out) and (out / "manifest.json").read_text() == "1"
    second = files.new_temp_dir(out)
    (second / "manifest.json").write_text("2")
    assert files.swap_into_place(second, out)
    assert (out / "manifest.json").read_text() == "2"
    assert _leftovers(tmp_path, "dataset") == []  # the old folder and the temporaries are gone


def test_swap_without_replace_keeps_an_existing_copy(tmp_path: Path) -> None:
    out = tmp_path / "cache"
    mine = files.new_temp_dir(out)
    (mine / "a.png").write_text("mine")
    out.mkdir()
    assert files.swap_into_place(mine, out, replace=False)  # an empty folder is taken over
    theirs = files.new_temp_dir(out)
    (theirs / "a.png").write_text("theirs")
    assert not files.swap_into_place(theirs, out, replace=False)
    assert (out / "a.png").read_text() == "mine" and _leftovers(tmp_path, "cache") == []


def test_clean_stale_temps_removes_only_dead_processes_leftovers(tmp_path: Path) -> None:
    out = tmp_path / "export"
    out.mkdir()  # in place: the old copy beside it is a leftover (put back when it is missing: test below)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    stale_dir = tmp_path / f".export.tmp-{dead_pid}-abcd1234"
    stale_dir.mkdir()
    stale_old = tmp_path / f".export.old-{dead_pid}-abcd1234"
    stale_old.mkdir()
    stale_file = tmp_path / f".export.partial-{dead_pid}-00"
    stale_file.write_text("x")
    live = tmp_path / f".export.tmp-{os.getppid()}-beef"  # a running process: not ours to remove
    live.mkdir()
    mine = files.new_temp_dir(out)
    other = tmp_path / f".exported.tmp-{dead_pid}-1"  # another target's name
    other.mkdir()
    removed = files.clean_stale_temps(out)
    assert sorted(removed) == sorted([stale_dir, stale_old, stale_file])
    assert live.is_dir() and mine.is_dir() and other.is_dir()


def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path: Path, monkeypatch) -> None:
    from leaflens.files import OutputNotWritableError, check_replaceable  # noqa: PLC0415

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    with pytest.raises(OutputNotWritableError, match=r"locked is not a folder you can write in"):
        check_replaceable(locked / "run" / "deeper", "report.json", "leaflens run folder")
    check_replaceable(tmp_path / "free" / "run", "report.json", "leaflens run folder")  # a folder to create: fine
    (tmp_path / "afile").write_text("notes")
    with pytest.raises(OutputNotWritableError, match=r"afile is a file, not a folder; give another --out"):
        check_replaceable(tmp_path / "afile" / "sub", "report.json", "leaflens run folder")
    from leaflens.files import NotOurFolderError  # noqa: PLC0415

    with pytest.raises(NotOurFolderError, match=r"afile exists and is a file, not a folder; refusing to replace it"):
        check_replaceable(tmp_path / "afile", "report.json", "leaflens run folder")  # not "not a run folder"


def test_a_folder_set_aside_by_a_swap_killed_half_way_is_put_back(tmp_path: Path) -> None:
    """swap_into_place renames the old folder aside, then the new one into place: killed between the two, the
    target was missing and the next stage's clean-up removed the complete old copy (an hour of training)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    target = tmp_path / "teacher"
    aside = tmp_path / f".teacher.old-{dead_pid}-deadbeef"
    aside.mkdir()
    (aside / "teacher.json").write_text("{}")
    (tmp_path / f".teacher.tmp-{dead_pid}-1").mkdir()  # the new folder, half-written: still removed
    removed = files.clean_stale_temps(target)
    assert (target / "teacher.json").read_text() == "{}" and not aside.exists()
    assert [p.name for p in removed] == [f".teacher.tmp-{dead_pid}-1"]
    again = tmp_path / f".teacher.old-{dead_pid}-cafe"
    again.mkdir()
    assert files.restore_interrupted_swap(target) is None  # the target is there: an old copy is only a leftover
    assert files.clean_stale_temps(target) == [again] and (target / "teacher.json").is_file()
