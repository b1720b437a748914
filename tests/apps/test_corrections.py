"""The corrections folder (leaflens.apps.corrections): generated names, original bytes, no overwrite, the log,
the cap, a restart, and applying a page's correction to the photos of an answer. No model, no Gradio."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from leaflens.apps import corrections as corr
from leaflens.apps.answered import AnsweredPhotos
from leaflens.apps.corrections import (
    LOG_NAME,
    NOT_A_LEAF,
    CorrectionError,
    CorrectionStore,
    apply_correction,
    mixed_answer,
    render_correction,
    sniff_extension,
)
from leaflens.apps.notes import ClassNotes
from leaflens.data_prep.arrays import sha256_file

CLASSES = ["early_blight", "healthy", "rust"]
MB = 1024 * 1024


def photo_bytes(seed: int, fmt: str = "JPEG", size: tuple[int, int] = (40, 30)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def upload(folder: Path, name: str, data: bytes) -> Path:
    """A file as Gradio keeps an upload: the uploader's name, in a folder of its own."""
    d = folder / f"upload-{len(list(folder.glob('upload-*')))}"
    d.mkdir(parents=True)
    (d / name).write_bytes(data)
    return d / name


def store_at(root: Path, **kw) -> CorrectionStore:
    model = root.parent / "model.onnx"
    if not model.exists():
        model.write_bytes(b"not really a model, but bytes to hash")
    return CorrectionStore(root, CLASSES, model_path=model, run_id="run-7", **kw)


def log_lines(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / LOG_NAME).read_text(encoding="utf-8").splitlines()]


# ----------------------------------------------------------------------------- saving one photo
def test_saves_original_bytes_under_a_generated_name_with_a_log_line(tmp_path):
    data = photo_bytes(1)
    src = upload(tmp_path / "up", "IMG 0001.png", data)
    root = tmp_path / "corrections"
    assert not root.exists()
    store = store_at(root, clock=lambda: 1_764_600_000.0)
    assert not root.exists()  # nothing is created before the first correction
    saved = store.save(src, "rust", photo_name="IMG 0001.png", predicted={"verdict": "diagnosis", "label": "healthy",
                                                                           "confidence": 0.93, "candidates": []},
                       answer={"verdict": "diagnosis", "label": "healthy"})
    path = root / saved.file
    assert path.parent == root / "rust" and path.read_bytes() == data  # the very bytes, not re-encoded
    assert path.suffix == ".jpg"  # from the bytes (JPEG), not from the uploaded name (.png)
    assert "IMG" not in path.name and path.name.startswith("20251201-")
    assert [p.name for p in (root / "rust").iterdir()] == [path.name]  # no temporary left behind
    (rec,) = log_lines(root)
    assert rec["file"] == saved.file and rec["chosen"] == "rust" and rec["photo_name"] == "IMG 0001.png"
    assert rec["predicted"] == {"verdict": "diagnosis", "label": "healthy", "confidence": 0.93, "candidates": []}
    assert rec["answer"] == {"verdict": "diagnosis", "label": "healthy"}
    assert rec["run_id"] == "run-7" and rec["model"] == "model.onnx"
    assert rec["model_sha256"] == "sha256:" + hashlib.sha256((tmp_path / "model.onnx").read_bytes()).hexdigest()
    assert rec["sha256"] == "sha256:" + hashlib.sha256(data).hexdigest() and rec["bytes"] == len(data)
    assert rec["time"] == "2025-12-01T14:40:00Z"


def test_uploaded_name_never_becomes_a_path(tmp_path):
    root = tmp_path / "corrections"
    store = store_at(root)
    src = upload(tmp_path / "up", "leaf.jpg", photo_bytes(2))
    saved = store.save(src, NOT_A_LEAF, photo_name="../../../etc/passwd")
    assert (root / saved.file).parent == root / NOT_A_LEAF
    assert log_lines(root)[0]["photo_name"] == "../../../etc/passwd"  # metadata only
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == sorted(
        [saved.file, LOG_NAME, ".lock"])  # the lock servers sharing the folder take turns with


@pytest.mark.parametrize("fmt,ext", [("JPEG", ".jpg"), ("PNG", ".png"), ("WEBP", ".webp"), ("BMP", ".bmp"),
                                     ("TIFF", ".tif")])
def test_extension_comes_from_the_bytes(fmt, ext):
    assert sniff_extension(photo_bytes(3, fmt)[:32]) == ext


def test_heic_brand_and_non_photos():
    assert sniff_extension(b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00") == ".heic"
    assert sniff_extension(b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00") is None  # an MP4 video
    assert sniff_extension(b"GIF89a" + b"\x00" * 10) is None  # preprocess does not read GIF
    assert sniff_extension(b"just some text in a .jpg") is None


def test_not_a_photo_is_refused_and_nothing_written(tmp_path):
    root = tmp_path / "corrections"
    store = store_at(root)
    src = upload(tmp_path / "up", "notes.jpg", b"this is text, not a photo, whatever the name says")
    with pytest.raises(CorrectionError) as exc:
        store.save(src, "rust", photo_name="notes.jpg")
    assert exc.value.reason == "format" and "notes.jpg" in str(exc.value)
    assert not root.exists()


def test_a_gif_the_page_answered_is_saved_as_the_png_of_the_frame_it_judged(tmp_path):
    """The page answers GIFs, preprocess reads none: the correction keeps the first frame, losslessly, as PNG,
    and the same GIF corrected twice is still one photo."""
    from leaflens.data_prep.scan import IMAGE_EXTENSIONS  # noqa: PLC0415

    rng = np.random.default_rng(11)
    frames = [Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).convert("P") for _ in range(2)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    gif = buf.getvalue()
    root = tmp_path / "corrections"
    store = store_at(root)
    saved = store.save(upload(tmp_path / "up", "leaf.gif", gif), "rust", photo_name="leaf.gif")
    assert saved.file.endswith(".png") and Path(saved.file).suffix in IMAGE_EXTENSIONS
    with Image.open(root / saved.file) as png, Image.open(io.BytesIO(gif)) as first:
        assert np.array_equal(np.asarray(png), np.asarray(first.convert("RGB")))
    again = store.save(upload(tmp_path / "up", "leaf.gif", gif), "rust", photo_name="leaf.gif")
    assert again.duplicate and again.file == saved.file
    line = log_lines(root)[0]
    assert line["saved_as"] == "png from gif" and line["sha256"] == "sha256:" + hashlib.sha256(gif).hexdigest()
    assert line["bytes"] == (root / saved.file).stat().st_size
    with pytest.raises(CorrectionError) as exc:  # GIF magic, then nothing a decoder can read
        store.save(upload(tmp_path / "up", "odd.gif", b"GIF89a" + b"\x00" * 40), "rust", photo_name="odd.gif")
    assert exc.value.reason == "format" and "odd.gif" in str(exc.value)
    assert len(list((root / "rust").iterdir())) == 1


def test_unknown_class_and_missing_upload(tmp_path):
    store = store_at(tmp_path / "corrections")
    src = upload(tmp_path / "up", "a.jpg", photo_bytes(4))
    with pytest.raises(CorrectionError) as exc:
        store.save(src, "mildew", photo_name="a.jpg")
    assert exc.value.reason == "unknown_class" and "mildew" in str(exc.value)
    with pytest.raises(CorrectionError) as exc:
        store.save(tmp_path / "up" / "gone.jpg", "rust", photo_name="gone.jpg")
    assert exc.value.reason == "gone" and "gone.jpg" in str(exc.value)


def test_never_overwrites_even_when_the_generated_name_is_taken(tmp_path, monkeypatch):
    root = tmp_path / "corrections"
    store = store_at(root, clock=lambda: 1_764_600_000.0)
    first = store.save(upload(tmp_path / "up", "a.jpg", photo_bytes(5)), "rust", photo_name="a.jpg")
    before = (root / first.file).read_bytes()
    token = Path(first.file).stem.rsplit("-", 1)[1]
    tokens = iter([token, token, "0badc0de"])  # the same name twice (same clock, same random), then a new one
    monkeypatch.setattr(corr.secrets, "token_hex", lambda n: next(tokens))
    second = store.save(upload(tmp_path / "up", "b.jpg", photo_bytes(6)), "rust", photo_name="b.jpg")
    assert second.file != first.file and second.file.endswith("-0badc0de.jpg")
    assert (root / first.file).read_bytes() == before  # the first photo is untouched
    assert (root / second.file).read_bytes() == photo_bytes(6)


def test_same_photo_twice_is_written_once_per_class(tmp_path):
    root = tmp_path / "corrections"
    store = store_at(root)
    data = photo_bytes(7)
    a = store.save(upload(tmp_path / "up", "a.jpg", data), "rust", photo_name="a.jpg")
    b = store.save(upload(tmp_path / "up", "a.jpg", data), "rust", photo_name="a.jpg")
    assert b.duplicate and b.file == a.file and len(list((root / "rust").iterdir())) == 1
    c = store.save(upload(tmp_path / "up", "a.jpg", data), "healthy", photo_name="a.jpg")  # changed their mind
    assert not c.duplicate and (root / c.file).parent.name == "healthy" and c.replaced == ("rust",)
    assert [r["chosen"] for r in log_lines(root)] == ["rust", "healthy"]
    # the latest answer wins: one photo under two classes would teach a retrain both
    assert not (root / a.file).exists() and list((root / "rust").iterdir()) == []
    assert log_lines(root)[-1]["replaces"] == [{"chosen": "rust", "file": a.file}]
    d = store.save(upload(tmp_path / "up", "a.jpg", data), "rust", photo_name="a.jpg")  # and back again
    assert not d.duplicate and d.replaced == ("healthy",) and not (root / c.file).exists()
    assert sorted(p.parent.name for p in root.rglob("*.jpg")) == ["rust"]


def test_restart_keeps_files_log_and_knows_what_it_saved(tmp_path):
    root = tmp_path / "corrections"
    data = photo_bytes(8)
    first = store_at(root).save(upload(tmp_path / "up", "a.jpg", data), "rust", photo_name="a.jpg")
    again = store_at(root)  # a restarted server: a new store over the same folder
    dup = again.save(upload(tmp_path / "up", "a.jpg", data), "rust", photo_name="a.jpg")
    assert dup.duplicate and dup.file == first.file
    other = again.save(upload(tmp_path / "up", "b.png", photo_bytes(9, "PNG")), "rust", photo_name="b.png")
    assert other.file != first.file and (root / first.file).read_bytes() == data
    assert [r["file"] for r in log_lines(root)] == [first.file, other.file]
    # a photo removed by hand (to fix a wrong label) can be saved again
    (root / first.file).unlink()
    assert not store_at(root).save(upload(tmp_path / "up", "a.jpg", data), "rust", photo_name="a.jpg").duplicate


def test_cap_counts_what_is_there_and_says_when_full(tmp_path):
    root = tmp_path / "corrections"
    (root / "rust").mkdir(parents=True)
    (root / "rust" / "older.jpg").write_bytes(b"\xff\xd8\xff" + b"\0" * (MB - 3))  # 1 MB from an earlier run
    store = store_at(root, max_mb=1.5)
    assert store.used_bytes() == MB and not store.is_full()
    big = upload(tmp_path / "up", "big.jpg", b"\xff\xd8\xff" + os.urandom(MB // 2))
    with pytest.raises(CorrectionError) as exc:
        store.save(big, "rust", photo_name="big.jpg")
    assert exc.value.reason == "full" and "no room left for big.jpg" in str(exc.value)
    assert "--corrections-max-mb" in str(exc.value)
    assert sorted(p.name for p in (root / "rust").iterdir()) == ["older.jpg"]
    small = upload(tmp_path / "up", "small.jpg", photo_bytes(10))
    saved = store.save(small, "rust", photo_name="small.jpg")
    assert store.used_bytes() == MB + len(photo_bytes(10)) + len((root / LOG_NAME).read_bytes())
    assert store.used_bytes() == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert (root / saved.file).is_file()
    (root / "rust" / "filler.jpg").write_bytes(b"\0" * (MB // 2))  # filled behind its back: seen after a restart
    assert store_at(root, max_mb=1.5).is_full()


def test_room_freed_by_moving_photos_out_counts_at_once_and_a_saved_photo_is_never_full(tmp_path):
    root = tmp_path / "corrections"
    a, b = photo_bytes(1, size=(60, 60)), photo_bytes(2, size=(60, 60))
    store = store_at(root, max_mb=(len(a) + 2000 + 4096 + len(b) // 2) / MB)  # room for a and its log line only
    first = upload(tmp_path / "up", "a.jpg", a)
    saved = store.save(first, "rust", photo_name="a.jpg")
    again = upload(tmp_path / "up", "a_again.jpg", a)
    second = upload(tmp_path / "up", "b.jpg", b)
    with pytest.raises(CorrectionError, match=r"has no room left for b.jpg \(\d+\.\d KB\) \(\d+\.\d KB of "
                                              r"\d+\.\d KB used\)") as exc:
        store.save(second, "rust", photo_name="b.jpg")  # the folder is full ...
    assert exc.value.reason == "full"
    assert store.save(again, "rust", photo_name="a_again.jpg").duplicate  # ... but that photo is already saved
    (root / saved.file).rename(tmp_path / "moved_into_training.jpg")  # as the message says to do
    assert not store.save(second, "rust", photo_name="b.jpg").duplicate  # no restart needed


def test_a_photo_relabelled_in_a_nearly_full_folder_is_moved_not_refused(tmp_path):
    """Relabelling replaces the earlier copy, so the folder does not grow: a folder with room for one photo (and
    not two) takes the new label instead of keeping the wrong one for the next training run."""
    root = tmp_path / "corrections"
    a = photo_bytes(1, size=(60, 60))
    store = store_at(root, max_mb=(len(a) + 4096 + len(a) // 2) / MB)  # one copy, a line and not a second copy
    first = store.save(upload(tmp_path / "up", "a.jpg", a), "rust", photo_name="a.jpg")
    moved = store.save(upload(tmp_path / "up2", "a.jpg", a), "healthy", photo_name="a.jpg")
    assert moved.replaced == ("rust",) and not (root / first.file).exists() and (root / moved.file).is_file()
    b = photo_bytes(2, size=(60, 60))
    with pytest.raises(CorrectionError, match="has no room left for b.jpg"):  # a new photo still needs room
        store.save(upload(tmp_path / "up3", "b.jpg", b), "rust", photo_name="b.jpg")


def test_a_folder_just_under_its_cap_says_the_decimals_that_show_it():
    from leaflens.apps.corrections import _used_of
    assert _used_of(int(0.341 * MB), int(0.35 * MB)) == "0.34 MB of 0.35 MB"  # not "0.3 MB of 0.3 MB"
    assert _used_of(int(12.3 * MB), 500 * MB) == "12.3 MB of 500.0 MB"
    assert _used_of(int(499.9996 * MB), 500 * MB) == "500.000 MB of 500.000 MB"  # within a kilobyte: no more said


def test_two_servers_sharing_a_folder_save_a_photo_once(tmp_path):
    root = tmp_path / "corrections"
    one, two = store_at(root), store_at(root)
    src = upload(tmp_path / "up", "leaf.jpg", photo_bytes(4))
    first = one.save(src, "healthy", photo_name="leaf.jpg")
    second = two.save(upload(tmp_path / "up2", "leaf.jpg", src.read_bytes()), "healthy", photo_name="leaf.jpg")
    assert second.duplicate and second.file == first.file
    assert len(list((root / "healthy").iterdir())) == 1 and len(log_lines(root)) == 1


def test_concurrent_saves_all_land(tmp_path):
    root = tmp_path / "corrections"
    store = store_at(root)
    srcs = [upload(tmp_path / "up", f"p{i}.jpg", photo_bytes(100 + i)) for i in range(12)]
    results: list = []
    threads = [threading.Thread(target=lambda s=s: results.append(store.save(s, "healthy", photo_name=s.name)))
               for s in srcs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    files = {r.file for r in results}
    assert len(files) == 12 and {r["file"] for r in log_lines(root)} == files
    assert sorted((root / f).read_bytes() for f in files) == sorted(s.read_bytes() for s in srcs)


# ----------------------------------------------------------------------------- a correction from the page
def answer_for(paths: list[Path], verdicts: list[str]) -> dict:
    photos = []
    for p, v in zip(paths, verdicts):
        ok = v not in ("refused", "error")
        photos.append({"name": p.name, "ok": ok, "verdict": v, "label": "healthy" if v == "diagnosis" else None,
                       "confidence": 0.9 if v == "diagnosis" else None, "candidates": [], "top": []})
    return {"verdict": "diagnosis", "photos": photos, "answer": {"verdict": "diagnosis", "label": "healthy"}}


def test_apply_saves_the_analysed_photos_and_skips_the_rest(tmp_path):
    root = tmp_path / "corrections"
    store = store_at(root)
    paths = [upload(tmp_path / "up", "a.jpg", photo_bytes(11)), upload(tmp_path / "up", "b.jpg", photo_bytes(12)),
             upload(tmp_path / "up", "c.jpg", b"broken")]
    answer = answer_for(paths, ["diagnosis", "diagnosis", "error"])
    res = apply_correction(store, [str(p) for p in paths], answer, "all", "rust")
    assert res["ok"] and [s["photo"] for s in res["saved"]] == ["a.jpg", "b.jpg"]
    assert res["skipped"] == [{"photo": "c.jpg", "reason": "not_analysed",
                               "message": "c.jpg: the model did not analyse it (error)"}]
    assert sorted((root / s["file"]).read_bytes() for s in res["saved"]) == sorted([photo_bytes(11), photo_bytes(12)])
    recs = log_lines(root)
    assert [r["predicted"]["verdict"] for r in recs] == ["diagnosis", "diagnosis"]
    assert all(r["answer"] == {"verdict": "diagnosis", "label": "healthy"} for r in recs)
    text = render_correction(res, ClassNotes({"rust": {"name": "Rust", "name_zh": "锈病"}}), "en")
    assert "Saved 2 photo(s) as **Rust**" in text and "c\\.jpg" in text and "did not analyse" in text
    zh = render_correction(res, ClassNotes({"rust": {"name": "Rust", "name_zh": "锈病"}}), "zh")
    assert "锈病" in zh and "2 张" in zh
    # "not a leaf" is kept, but preprocess skips that folder: the page must not promise the next training run
    res = apply_correction(store, [str(p) for p in paths], answer, "all", "not_a_leaf")
    assert res["ok"] and len(res["saved"]) == 2
    text = render_correction(res, None, "en")
    assert "Saved 2 photo(s) as **Not a leaf" in text and "training does not use them" in text
    assert "next training run" not in text  # neither for the photos nor for the rust copies they replace
    assert "that copy was removed, so training no longer learns them as that" in text
    zh = render_correction(res, None, "zh")
    assert "训练暂不使用" in zh and "下一次训练" not in zh


def test_all_photos_as_a_class_leaves_out_the_photos_the_answer_left_out(tmp_path):
    """A rust leaf and random noise: the answer judged the leaf and left the noise out as not a photo the model
    knows; "all photos" + "rust" saved the noise as a rust training photo (and moved a photo filed earlier as
    not a leaf into rust). "All" now means the photos the answer judged; a left-out one is saved when named."""
    root = tmp_path / "corrections"
    store = store_at(root)
    paths = [upload(tmp_path / "up", "leaf.jpg", photo_bytes(41)), upload(tmp_path / "up", "noise.png",
                                                                          photo_bytes(42, "PNG"))]
    answer = answer_for(paths, ["diagnosis", "out_of_domain"])
    assert apply_correction(store, paths, answer, "2", NOT_A_LEAF)["ok"]
    res = apply_correction(store, paths, answer, "all", "rust")
    assert [s["photo"] for s in res["saved"]] == ["leaf.jpg"]
    assert [(s["photo"], s["reason"]) for s in res["skipped"]] == [("noise.png", "left_out")]
    assert "choose it by its number" in res["skipped"][0]["message"]
    assert sorted(p.parent.name for p in root.rglob("*.*") if p.suffix in (".jpg", ".png")) == [
        NOT_A_LEAF, "rust"]  # the noise stays under not_a_leaf
    text = render_correction(res, None, "en")
    assert "noise\\.png" in text and "Which photo" in text
    assert "哪张照片" in render_correction(res, None, "zh")
    # named by its number, it is saved as the person says (the model may not know a real rust photo)
    named = apply_correction(store, paths, answer, "2", "rust")
    assert named["ok"] and named["saved"][0]["replaced"] == [NOT_A_LEAF]
    # only left-out photos: "all" means them; "not a leaf" for "all" keeps every photo
    assert apply_correction(store, paths[1:], answer_for(paths[1:], ["out_of_domain"]), "all", "healthy")["ok"]
    both = apply_correction(store, paths, answer, "all", NOT_A_LEAF)
    assert [s["photo"] for s in both["saved"]] == ["leaf.jpg", "noise.png"]


def test_the_page_says_what_a_second_save_did(tmp_path):
    """Saving again as the same class said "Saved 1 photo(s)... 1 of them had been saved as this already" though
    nothing was saved; saving as another class saved the photo under both without a word."""
    root = tmp_path / "corrections"
    store = store_at(root)
    notes = ClassNotes({"rust": {"name": "Rust", "name_zh": "锈病"}, "healthy": {"name": "Healthy",
                                                                             "name_zh": "健康"}})
    paths = [upload(tmp_path / "up", "a.jpg", photo_bytes(21)), upload(tmp_path / "up", "b.jpg", photo_bytes(22))]
    answer = answer_for(paths, ["diagnosis", "diagnosis"])
    apply_correction(store, paths, answer, "1", "healthy")
    again = apply_correction(store, paths, answer, "1", "healthy")
    assert render_correction(again, notes, "en") == "Already saved as **Healthy**: nothing new to save."
    assert "已经保存为 **健康**" in render_correction(again, notes, "zh")
    moved = apply_correction(store, paths, answer, "all", "rust")
    text = render_correction(moved, notes, "en")
    assert text.startswith("Saved 2 photo(s) as **Rust**")
    assert "1 of them had been saved as Healthy before; that copy was removed" in text
    assert "健康" in render_correction(moved, notes, "zh")
    assert sorted(p.parent.name for p in root.rglob("*.jpg")) == ["rust", "rust"]


def test_photos_that_disagree_need_the_photo_named(tmp_path):
    """A rust leaf and a wasp disagree; "Not a leaf" for "all photos" (the default) saved the rust leaf as not a
    leaf too. With a disagreeing answer, which photo is asked for ("all" still works when said)."""
    root = tmp_path / "corrections"
    store = store_at(root)
    paths = [upload(tmp_path / "up", "leaf.jpg", photo_bytes(31)), upload(tmp_path / "up", "wasp.jpg", photo_bytes(32))]
    answer = {**answer_for(paths, ["diagnosis", "diagnosis"]), "verdict": "disagree"}
    for which in (None, ""):
        res = apply_correction(store, paths, answer, which, NOT_A_LEAF)
        assert (res["ok"], res["reason"], res["saved"]) == (False, "which_photo", [])
    assert not root.exists()
    assert "choose which photo" in render_correction(res, None, "en") and "哪一张" in render_correction(res, None, "zh")
    one = apply_correction(store, paths, answer, "2", NOT_A_LEAF)
    assert [s["photo"] for s in one["saved"]] == ["wasp.jpg"]
    assert apply_correction(store, paths, answer, "all", "rust")["ok"]  # asked for in so many words
    # a leaf diagnosed and a bee left out as unlike the model's photos: the same question
    leaf_and_bee = answer_for(paths, ["diagnosis", "out_of_domain"])
    # ... said as it is: the photos did not disagree, one was left out (it read "not judged alike"), and what
    # "all" then does: for a class, the photo left out is skipped; as "not a leaf", every photo is saved
    for chosen, said in ((NOT_A_LEAF, "to save every one of them as not a leaf"),
                         ("rust", "to correct the photos it judged (those left out are skipped)")):
        res = apply_correction(store, paths, leaf_and_bee, None, chosen)
        assert res["reason"] == "which_photo_left_out" and res["left_out_photos"] == ["wasp.jpg"]
        assert res["message"].startswith("Left out as unlike the photos this model knows: wasp.jpg.") and said in \
            res["message"]
        text = render_correction(res, None, "en")
        assert "knows: wasp\\.jpg." in text and said in text and "not judged alike" not in text  # escaped name
        assert "已被排除的照片：wasp\\.jpg" in render_correction(res, None, "zh")
    assert not mixed_answer(answer_for(paths, ["diagnosis", "ambiguous"]))  # one plant, judged alike
    assert not mixed_answer(answer_for(paths, ["out_of_domain", "out_of_domain"]))
    assert not mixed_answer(answer_for(paths[:1], ["diagnosis"]))


def test_apply_one_photo_by_number(tmp_path):
    root = tmp_path / "corrections"
    store = store_at(root)
    paths = [upload(tmp_path / "up", "a.jpg", photo_bytes(13)), upload(tmp_path / "up", "b.jpg", photo_bytes(14))]
    res = apply_correction(store, paths, answer_for(paths, ["diagnosis", "diagnosis"]), "2", NOT_A_LEAF)
    assert [s["photo"] for s in res["saved"]] == ["b.jpg"]
    assert (root / res["saved"][0]["file"]).read_bytes() == photo_bytes(14)
    assert "Not a leaf" in render_correction(res, None, "en")


@pytest.mark.parametrize("which,chosen,reason", [("all", None, "no_choice"), ("all", "", "no_choice"),
                                                 ("3", "rust", "bad_photo"), ("0", "rust", "bad_photo"),
                                                 ("x", "rust", "bad_photo"), ("all", "mildew", "unknown_class")])
def test_apply_refuses_bad_requests_and_writes_nothing(tmp_path, which, chosen, reason):
    root = tmp_path / "corrections"
    paths = [upload(tmp_path / "up", "a.jpg", photo_bytes(15)), upload(tmp_path / "up", "b.jpg", photo_bytes(16))]
    res = apply_correction(store_at(root), paths, answer_for(paths, ["diagnosis", "diagnosis"]), which, chosen)
    assert (res["ok"], res["reason"], res["saved"]) == (False, reason, [])
    assert not root.exists()
    # API callers are told why in words, not a bare code
    assert res["message"] and "**" not in res["message"]
    if reason == "unknown_class":
        assert "early_blight, healthy, rust, not_a_leaf" in res["message"]
    assert render_correction(res, None, "en") and render_correction(res, None, "zh")


def test_apply_refuses_photos_that_are_not_the_answers(tmp_path):
    root = tmp_path / "corrections"
    a = upload(tmp_path / "up", "a.jpg", photo_bytes(17))
    b = upload(tmp_path / "up", "b.jpg", photo_bytes(18))
    res = apply_correction(store_at(root), [b], answer_for([a], ["diagnosis"]), "all", "rust")
    assert res["reason"] == "photos_changed" and not root.exists()
    res = apply_correction(store_at(root), [], answer_for([a], ["diagnosis"]), "all", "rust")
    assert res["reason"] == "photos_changed"
    assert apply_correction(store_at(root), [a], None, "all", "rust")["reason"] == "no_answer"


def answered_for(paths: list[Path], answer: dict) -> AnsweredPhotos:
    """The server's record of having given ``answer`` for ``paths``."""
    record = AnsweredPhotos()
    record.record([sha256_file(p) for p in paths], answer)
    return record


def test_apply_checks_the_bytes_and_the_verdict_against_what_the_server_answered(tmp_path):
    root = tmp_path / "corrections"
    store = store_at(root)
    a = upload(tmp_path / "up", "a.jpg", photo_bytes(31))
    tiny = upload(tmp_path / "up", "tiny.jpg", photo_bytes(32, size=(8, 8)))
    told = answer_for([a, tiny], ["diagnosis", "refused"])
    server = answered_for([a, tiny], told)
    # another photo under the answered name: not saved
    other = upload(tmp_path / "up", "a.jpg", photo_bytes(33))
    res = apply_correction(store, [other], answer_for([other], ["diagnosis"]), "all", "rust", answered=server)
    assert (res["ok"], res["reason"]) == (False, "not_diagnosed") and not root.exists()
    assert "Diagnose" in render_correction(res, None, "en") and render_correction(res, None, "zh")
    # an answer edited to call the refused photo diagnosed: the server's record says refused
    forged = answer_for([a, tiny], ["diagnosis", "diagnosis"])
    res = apply_correction(store, [a, tiny], forged, "all", "rust", answered=server)
    assert [s["photo"] for s in res["saved"]] == ["a.jpg"] and res["skipped"][0]["reason"] == "not_analysed"
    # what is logged is the server's prediction, not the client's
    a2 = upload(tmp_path / "up", "a2.jpg", photo_bytes(34))
    server.record([sha256_file(a2)], {"verdict": "ambiguous", "photos": [
        {"name": "a2.jpg", "ok": True, "verdict": "ambiguous", "label": "rust", "confidence": 0.41,
         "candidates": ["rust", "healthy"]}], "answer": {"verdict": "ambiguous", "label": "rust"}})
    lying = answer_for([a2], ["diagnosis"])  # says "healthy 0.9"
    res = apply_correction(store, [a2], lying, "1", "early_blight", answered=server)
    assert res["ok"]
    rec = log_lines(root)[-1]
    assert rec["predicted"] == {"verdict": "ambiguous", "label": "rust", "confidence": 0.41,
                                "candidates": ["rust", "healthy"]}
    assert rec["answer"] == {"verdict": "ambiguous", "label": "rust"}
    # a file gone since is said so
    gone = upload(tmp_path / "up", "gone.jpg", photo_bytes(35))
    record = answered_for([gone], answer_for([gone], ["diagnosis"]))
    gone.unlink()
    res = apply_correction(store, [gone], answer_for([gone], ["diagnosis"]), "all", "rust", answered=record)
    assert res["reason"] == "gone"


@pytest.mark.parametrize("junk", [{"photos": ["a.jpg"]}, {"photos": "abc"}, "garbage", 7, {"photos": [None]}])
def test_apply_refuses_a_malformed_answer(tmp_path, junk):
    a = upload(tmp_path / "up", "a.jpg", photo_bytes(36))
    res = apply_correction(store_at(tmp_path / "corrections"), [a], junk, "all", "rust")
    assert (res["ok"], res["reason"]) == (False, "no_answer")


def test_answered_photos_forget_the_oldest_beyond_their_capacity():
    record = AnsweredPhotos(capacity=2)
    answer = {"verdict": "diagnosis", "answer": {"verdict": "diagnosis", "label": "rust"},
              "photos": [{"name": "x", "ok": True, "verdict": "diagnosis", "label": "rust", "confidence": 0.8}]}
    for d in ("sha256:a", "sha256:b", "sha256:c"):
        record.record([d], answer)
    assert record.lookup("sha256:a") is None and record.lookup("sha256:c")["photo"]["label"] == "rust"
    assert len(record) == 2
    record.record([None], answer)  # unread bytes are not recorded
    assert len(record) == 2
    with pytest.raises(ValueError, match="capacity"):
        AnsweredPhotos(capacity=0)


def test_apply_stops_at_a_full_folder_and_says_so(tmp_path):
    root = tmp_path / "corrections"
    store = store_at(root, max_mb=0.01)  # 10 KB: not even one of these photos fits
    paths = [upload(tmp_path / "up", f"{n}.png", photo_bytes(19 + n, "PNG", (80, 60))) for n in range(2)]
    res = apply_correction(store, paths, answer_for(paths, ["diagnosis", "diagnosis"]), "all", "rust")
    assert not res["ok"] and res["reason"] == "full" and [s["reason"] for s in res["skipped"]] == ["full", "full"]
    assert "no room left" in render_correction(res, None, "en") and "没有空间" in render_correction(res, None, "zh")


def test_a_photo_too_large_for_the_room_left_does_not_stop_a_smaller_one(tmp_path):
    big = photo_bytes(30, "PNG", (120, 90))
    small = photo_bytes(31, size=(40, 30))
    store = store_at(tmp_path / "corrections", max_mb=(len(small) + 4096 + 100) / MB)  # room for the small one only
    paths = [upload(tmp_path / "up", "big.png", big), upload(tmp_path / "up", "small.jpg", small)]
    res = apply_correction(store, paths, answer_for(paths, ["diagnosis", "diagnosis"]), "all", "rust")
    assert res["ok"] and [s["photo"] for s in res["saved"]] == ["small.jpg"]
    assert [(s["photo"], s["reason"]) for s in res["skipped"]] == [("big.png", "full")]
    assert "no room left for big.png" in res["skipped"][0]["message"]


def test_store_rejects_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="> 0 MB"):
        CorrectionStore(tmp_path, CLASSES, max_mb=0)
    with pytest.raises(ValueError, match="folder names"):
        CorrectionStore(tmp_path, ["ok", "../up"])
