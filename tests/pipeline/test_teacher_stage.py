"""The teacher stage's sources (features file, ONNX encoder, engine-trained CNN) and its artefact."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from pipeline_helpers import class_features, tiny_dataset

from leaflens.data_prep.manifest import load_dataset
from leaflens.pipeline.cli import main as cli
from leaflens.pipeline.config import load_config
from leaflens.pipeline.teachers.artefact import load_teacher
from leaflens.pipeline.teachers.stage import (
    TeacherChoice,
    TeacherStageError,
    knn_accuracy,
    run_teacher_stage,
    write_teacher,
)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp("teacher"), per_class=12, size=16)


def _tiny_encoder(path, size=16, dim=6, batch="batch", channels=3, tail=(), pool=True, width=None):
    """NCHW conv encoder: 3 -> dim channels, global average pool, flatten (then ``tail``'s ops, e.g. "Log");
    without ``pool``, its output is the [batch, dim, size, size] feature map. ``width``: the input's, when not
    ``size``."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [dim, channels, 3, 3],
                           rng.standard_normal((dim, channels, 3, 3)).ravel())
    nodes = [helper.make_node("Conv", ["input", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["g"]),
             helper.make_node("Flatten", ["g"], ["features" if not tail else "f0"])]
    for i, op in enumerate(tail):
        nodes.append(helper.make_node(op, [f"f{i}"], ["features" if i == len(tail) - 1 else f"f{i + 1}"]))
    out_shape = [batch, dim]
    if not pool:
        nodes = nodes[:1] + [helper.make_node("Relu", ["c"], ["features"])]
        out_shape = [batch, dim, size, size]
    graph = helper.make_graph(nodes, "enc", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                           [batch, channels, size, width or size])],
                              [helper.make_tensor_value_info("features", TensorProto.FLOAT, out_shape)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_features_file_is_imported_and_tied_to_the_dataset(ds_dir, tmp_path, capsys):
    feats = class_features(ds_dir, tmp_path / "feats", dim=8)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--features", str(feats),
                "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["feature_dim"] == 8 and summary["knn_test_acc"] > 0.9
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--features", str(feats),
                "--quiet"]) == 0
    said = capsys.readouterr().out  # without --json: sentences with the same figures
    assert said.startswith("teacher: features-file, 8 features, ") and f"-> {tmp_path / 't'}" in said
    assert f"test accuracy {100 * summary['test_acc']:.1f} %" in said
    assert f"nearest training photo by features {100 * summary['knn_test_acc']:.1f} %" in said
    ds = load_dataset(ds_dir)
    tt = load_teacher(tmp_path / "t", ds)
    np.testing.assert_allclose(tt.features["val"], np.load(feats / "features_val.npy"))
    assert tt.has_logits and tt.info.teacher["kind"] == "features-file"


def test_the_stage_runs_as_a_library_call(ds_dir, tmp_path):
    """run_teacher_stage is the whole stage; `leaflens teacher` only maps its options onto it."""
    feats = class_features(ds_dir, tmp_path / "feats", dim=8)
    summary = run_teacher_stage(ds_dir, tmp_path / "t", load_config(), TeacherChoice(features=feats), fp16=True,
                                progress=False)
    assert summary["teacher"]["kind"] == "features-file" and summary["feature_dim"] == 8
    assert summary["knn_test_acc"] > 0.9 and 0.0 <= summary["test_acc"] <= 1.0
    tt = load_teacher(tmp_path / "t", load_dataset(ds_dir))
    assert tt.features["train"].dtype == np.float16 and tt.info.stage == {}


def test_a_folder_the_stage_did_not_write_is_never_replaced(ds_dir, tmp_path, capsys):
    """A mistyped --out that names someone's folder: refused before any work, every file left as it was; a
    teacher folder, or an empty one, is replaced as before."""
    feats = class_features(ds_dir, tmp_path / "feats", dim=8)
    theirs = tmp_path / "thesis"
    theirs.mkdir()
    (theirs / "chapter1.txt").write_text("mine")
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(theirs), "--features", str(feats), "--quiet"]) == 1
    assert "is not a leaflens teacher folder (no teacher.json in it); refusing to replace it" in capsys.readouterr().err
    assert [p.name for p in theirs.iterdir()] == ["chapter1.txt"] and (theirs / "chapter1.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "empty"):  # an empty folder, then the teacher folder it became
        assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(out), "--features", str(feats), "--quiet"]) == 0
        assert (out / "teacher.json").is_file()


def test_misaligned_features_are_refused(ds_dir, tmp_path, capsys):
    feats = class_features(ds_dir, tmp_path / "feats", dim=8)
    np.save(feats / "features_val.npy", np.zeros((3, 8), np.float32))
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--features", str(feats)]) == 1
    assert "aligned with the manifest" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_onnx_encoder_teacher(ds_dir, tmp_path, capsys):
    enc = _tiny_encoder(tmp_path / "enc.onnx")
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(enc),
                "--quiet"]) == 0
    ds = load_dataset(ds_dir)
    tt = load_teacher(tmp_path / "t", ds)
    assert tt.feature_dim == 6 and not tt.has_logits
    assert tt.info.teacher["kind"] == "onnx" and tt.info.input_size == 16
    assert np.isfinite(np.asarray(tt.features["train"])).all()


def test_onnx_encoders_that_cannot_teach_are_refused_by_name(ds_dir, tmp_path, capsys):
    """NaN features (they made distill stop on "non-finite losses", pointing at the learning rate), a grey
    model, and a zero std are said in one line naming the model; a graph with a fixed batch of 1 runs."""
    nan = _tiny_encoder(tmp_path / "nan.onnx", tail=("Neg", "Log"))  # log of minus a mean of ReLUs: NaN or -inf
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(nan), "--quiet"]) == 1
    assert "nan.onnx gives features that are NaN or inf as float32" in capsys.readouterr().err
    grey = _tiny_encoder(tmp_path / "grey.onnx", channels=1)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(grey)]) == 1
    assert "its input has 1 channel(s)" in capsys.readouterr().err
    wide = _tiny_encoder(tmp_path / "wide.onnx", size=40, width=24)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(wide)]) == 1
    assert "wide.onnx: its input is fixed at 40 x 24 px (height x width, NCHW); leaflens feeds square photos" in (
        capsys.readouterr().err)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx",
                str(_tiny_encoder(tmp_path / "e16.onnx")), "--input-size", "24"]) == 1
    assert "e16.onnx: its input is fixed at 16 px, not 24 as --input-size 24: pass --input-size 16 (or leave it " in (
        capsys.readouterr().err)
    said = onnx.load(str(tmp_path / "e16.onnx"))
    helper.set_model_props(said, {"leaflens.input_size": "24"})  # a model whose metadata disagrees with its graph
    onnx.save(said, str(tmp_path / "said24.onnx"))
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx",
                str(tmp_path / "said24.onnx")]) == 1
    assert "not 24 as its metadata's leaflens.input_size = 24: pass --input-size 16" in capsys.readouterr().err
    enc = _tiny_encoder(tmp_path / "enc.onnx")
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(enc), "--std", "0",
                "0", "0"]) == 2
    assert "--std must be 3 numbers above 0" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
    one = _tiny_encoder(tmp_path / "one.onnx", batch=1)  # exported for one photo at a time
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t1"), "--onnx", str(one),
                "--quiet"]) == 0
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t2"), "--onnx", str(enc),
                "--quiet"]) == 0
    ds = load_dataset(ds_dir)
    np.testing.assert_allclose(load_teacher(tmp_path / "t1", ds).features["val"],
                               load_teacher(tmp_path / "t2", ds).features["val"], rtol=1e-5, atol=1e-6)


def test_onnx_encoders_with_a_fixed_batch_or_a_feature_map_teach_and_say_what_was_assumed(ds_dir, tmp_path, capsys):
    """A graph exported for batches of 4 runs on splits that do not divide by 4 (the last batch is padded,
    its padding's rows dropped); a feature map is averaged over its positions, not flattened; the layout
    and the normalisation the model does not record are said, not silently assumed."""
    ds = load_dataset(ds_dir)
    assert any(len(ds[s]) % 4 for s in ds.splits)
    runs = {}
    for name, kw in [("dyn", {}), ("four", {"batch": 4}), ("map", {"pool": False})]:
        enc = _tiny_encoder(tmp_path / f"{name}.onnx", **kw)
        assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / name), "--onnx", str(enc)]) == 0
        runs[name] = (load_teacher(tmp_path / name, ds), capsys.readouterr().err)
    dyn, said = runs["dyn"]
    assert "note: dyn.onnx records no normalisation: its input is (pixel / 255 - 0.5) / 0.5" in said
    assert "note: dyn.onnx: input 'input' [batch, 3, 16, 16] read as NCHW; --layout sets it" in said
    for name in ("four", "map"):
        tt = runs[name][0]
        assert tt.feature_dim == 6
        np.testing.assert_allclose(tt.features["val"], dyn.features["val"], rtol=1e-5, atol=1e-6)
    assert "output 'features' [batch, 6, 16, 16] is averaged over axes [2, 3] into 6 features a photo" in runs["map"][1]
    assert runs["map"][0].info.teacher["pooled_axes"] == [2, 3]


def test_features_files_that_cannot_teach_are_refused_by_name(ds_dir, tmp_path, capsys):
    """Logits for another class count, a pickled .npz (never loaded), values that overflow float32, and a
    teacher folder made for another dataset (its rows are other photos); the identity pins the content."""
    ds = load_dataset(ds_dir)

    def refused(source, words: str) -> None:
        assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--features",
                    str(source)]) == 1
        assert words in capsys.readouterr().err and not (tmp_path / "t").exists()

    feats = class_features(ds_dir, tmp_path / "five", dim=8)
    for split in ds.splits:
        np.save(feats / f"logits_{split}.npy", np.zeros((len(ds[split]), ds.num_classes + 2), np.float32))
    refused(feats, f"gives logits for {ds.num_classes + 2} classes, the dataset has {ds.num_classes}")
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--features",
                str(class_features(ds_dir, tmp_path / "plain", dim=8)), "--views", "2"]) == 2  # a usage error
    assert "cannot be recomputed on augmented views" in capsys.readouterr().err
    marker = tmp_path / "pwned"
    np.savez(tmp_path / "evil.npz", **{f"features_{s}": np.array([object()] * len(ds[s])) for s in ds.splits})
    refused(tmp_path / "evil.npz", "cannot be read as an .npz of numeric arrays")
    assert not marker.exists()
    big = class_features(ds_dir, tmp_path / "big", dim=8)
    np.save(big / "features_train.npy", np.full((len(ds["train"]), 8), 1e300))  # finite in float64, inf as float32
    refused(big, "gives features that are NaN or inf as float32")
    ok = class_features(ds_dir, tmp_path / "ok", dim=8)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "made"), "--features", str(ok),
                "--quiet"]) == 0
    identity = load_teacher(tmp_path / "made", ds).info.teacher
    assert identity["kind"] == "features-file" and re.fullmatch("[0-9a-f]{64}", identity["sha256"])  # as the ONNX's
    other = tiny_dataset(tmp_path / "other_ds", per_class=13, size=16)
    assert cli(["teacher", "--dataset", str(other), "--out", str(tmp_path / "t"), "--features",
                str(tmp_path / "made")]) == 1
    assert "is a teacher folder made for another dataset" in capsys.readouterr().err


def test_a_features_source_out_of_the_dataset_s_row_order_is_caught(ds_dir, tmp_path, capsys):
    """Rows are matched to photos by position: a source that names its rows (files_<split>) is checked
    against <split>_files.txt; one that does not but whose logits are no better than chance on val is
    noted; constant features (no gradient for the feature loss) are refused."""
    ds = load_dataset(ds_dir)
    good = class_features(ds_dir, tmp_path / "good", dim=8)
    arrays = {f"{kind}_{s}": np.load(good / f"{kind}_{s}.npy") for s in ds.splits for kind in ("features", "logits")}
    named = {**arrays, **{f"files_{s}": np.array(ds[s].files) for s in ds.splits}}
    np.savez(tmp_path / "named.npz", **named)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--features",
                str(tmp_path / "named.npz")]) == 0
    assert "no better than chance" not in capsys.readouterr().err
    swapped = dict(named)
    swapped["files_val"] = named["files_val"][::-1]
    np.savez(tmp_path / "swapped.npz", **swapped)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t2"), "--features",
                str(tmp_path / "swapped.npz")]) == 1
    err = capsys.readouterr().err
    assert "the rows for 'val' are not in the dataset's order: row 0 is" in err and not (tmp_path / "t2").exists()
    twice = {**named, "files_val": np.array([ds["val"].files[0], *ds["val"].files[:-1]])}
    np.savez(tmp_path / "twice.npz", **twice)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t7"), "--features",
                str(tmp_path / "twice.npz")]) == 1
    assert f"files_val names {ds['val'].files[0]!r} more than once" in capsys.readouterr().err
    as_bytes = {**named, **{f"files_{s}": np.array([f.encode() for f in ds[s].files]) for s in ds.splits}}
    np.savez(tmp_path / "bytes.npz", **as_bytes)  # names as h5py and np.array([b"..."]) store them
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t5"), "--features",
                str(tmp_path / "bytes.npz")]) == 0
    capsys.readouterr()
    absolute = {**named, "files_val": np.array([str(ds_dir / "photos" / f) for f in ds["val"].files])}
    np.savez(tmp_path / "absolute.npz", **absolute)
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t6"), "--features",
                str(tmp_path / "absolute.npz")]) == 1
    err = capsys.readouterr().err
    assert f"files_val names {len(ds['val'])} photos the dataset's 'val' split does not have" in err
    assert f"relative to the photos' folder (e.g. {ds['val'].files[0]!r})" in err
    reordered = class_features(ds_dir, tmp_path / "reordered", dim=8)
    for kind in ("features", "logits"):
        a = np.load(reordered / f"{kind}_val.npy")
        np.save(reordered / f"{kind}_val.npy", np.roll(a, len(a) // 2, axis=0))  # every val row another photo's
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t3"), "--features",
                str(reordered)]) == 0
    assert "logits put 0 % of the val photos in their class, no better than chance" in capsys.readouterr().err
    flat = class_features(ds_dir, tmp_path / "flat", dim=8)
    np.save(flat / "features_train.npy", np.zeros((len(ds["train"]), 8), np.float32))
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t4"), "--features", str(flat)]) == 1
    assert "every 'train' photo has the same features" in capsys.readouterr().err


def test_a_stage_going_back_to_the_photos_refuses_ones_changed_since_preprocess(tmp_path, capsys):
    """An ONNX encoder at another size decodes the original photos again. One of them replaced by another class's
    photo after preprocess was taken as it is now (the teacher's features and answers for that row changed, with
    the dataset's label kept): every photo must still decode to the stored pixels."""
    ds_dir = tiny_dataset(tmp_path / "d", per_class=6, size=16)
    ds = load_dataset(ds_dir)
    src = Path(ds.manifest.source_root)
    first, other = src / ds["train"].files[0], next(src / f for f in ds["train"].files
                                                   if ds["train"].labels[ds["train"].files.index(f)] !=
                                                   ds["train"].labels[0])
    enc = _tiny_encoder(tmp_path / "enc24.onnx", size=24)
    first.write_bytes(other.read_bytes())
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(enc)]) == 1
    err = capsys.readouterr().err
    assert "1 of the" in err and "no longer decode to the pixels preprocess stored" in err and str(first) in err
    assert not (tmp_path / "t").exists()
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(enc),
                "--from-arrays", "--quiet"]) == 0  # the stored arrays, as the message offers
    second = src / ds["train"].files[1]
    second.rename(tmp_path / "relabelled.png")  # as the web app moves a photo corrected into another class
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t2"), "--onnx", str(enc)]) == 1
    err = capsys.readouterr().err
    assert f"1 original photo of split 'train' is missing, first {second} (moved, deleted or relabelled" in err
    assert "run `leaflens preprocess` again so the dataset holds the photos as they are now, or pass" in err


def test_not_an_onnx_file_is_refused(ds_dir, tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_text("not a model")
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(bad)]) == 1
    assert "bad.onnx" in capsys.readouterr().err


def test_train_cnn_teacher_learns_the_classes(ds_dir, tmp_path, capsys):
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--train-cnn", "--epochs", "6",
                "--set", "train.min_steps=0", "--quiet"]) == 0
    ds = load_dataset(ds_dir)
    tt = load_teacher(tmp_path / "t", ds)
    assert tt.has_logits and tt.info.teacher["kind"] == "train-cnn"
    acc = float((np.asarray(tt.logits["test"]).argmax(1) == np.asarray(ds["test"].labels)).mean())
    assert acc >= 0.6, acc
    recipe = json.loads((tmp_path / "t" / "teacher.json").read_text())["stage"]["recipe"]  # as the fine-tune's
    assert recipe["teacher.cnn_epochs"] == 6 and recipe["teacher.cnn_widths"] == list(tt.info.teacher["widths"])
    assert recipe["train.min_steps"] == 0 and "train.lr" in recipe and "augment.hflip" in recipe


def test_knn_accuracy():
    a = np.array([[1.0, 0], [0, 1.0]])
    assert knn_accuracy(a, np.array([0, 1]), np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([0, 1])) == 1.0


def test_an_encoder_with_classes_but_no_logits_is_refused(ds_dir, tmp_path):
    """An encoder that declares classes must return logits: write_teacher names it instead of writing None."""

    class NoLogits:
        input_size, feature_dim, num_classes = 16, 4, 3

        def encode(self, images):
            return np.zeros((len(images), 4), np.float32), None

        def identity(self):
            return {"kind": "test"}

    with pytest.raises(TeacherStageError, match="NoLogits teacher has 3 classes but returned no logits"):
        write_teacher(tmp_path / "t", load_dataset(ds_dir), NoLogits(), from_arrays=True, progress=False)
    assert not (tmp_path / "t").exists()


def test_an_output_of_one_number_per_photo_is_named_as_such(tmp_path):
    """`--output ood_score` (one number a photo) was refused as "a feature output has one row per photo", which
    it has: the message now says what is missing, a feature dimension."""
    from leaflens.pipeline.teachers.onnx_encoder import OnnxEncoder  # noqa: PLC0415

    enc = OnnxEncoder(_tiny_encoder(tmp_path / "enc.onnx"))

    class OneNumber:
        def run(self, names, feeds):
            return [np.zeros(len(next(iter(feeds.values()))), np.float32)]

    enc.session = OneNumber()
    with pytest.raises(ValueError, match=r"has shape \[5\] for 5 photos: one number per photo, not a feature"):
        enc._run(np.zeros((5, 16, 16, 3), np.uint8))


def test_an_encoder_that_drops_rows_is_refused(ds_dir, tmp_path):
    """Fewer feature rows than photos (an encoder with a fixed batch, say): refused when its split's file is
    closed, and no teacher folder is left behind."""

    class DropsOne:
        input_size, feature_dim, num_classes = 16, 4, 3

        def encode(self, images):
            n = len(images) - 1
            return np.zeros((n, 4), np.float32), np.zeros((n, 3), np.float32)

        def identity(self):
            return {"kind": "test"}

    with pytest.raises(ValueError, match=r"wrote \d+ rows, expected \d+"):
        write_teacher(tmp_path / "t", load_dataset(ds_dir), DropsOne(), from_arrays=True, progress=False)
    assert not (tmp_path / "t").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # nor its temporary folder


def test_a_broken_teacher_array_is_refused_by_name(ds_dir, tmp_path):
    """Missing, unreadable or misshapen feature and logit files: a TeacherError naming the file."""
    from leaflens.pipeline.teachers.artefact import TeacherError

    feats = class_features(ds_dir, tmp_path / "feats", dim=8)
    run_teacher_stage(ds_dir, tmp_path / "t", load_config(), TeacherChoice(features=feats), progress=False)
    ds = load_dataset(ds_dir)
    logits = tmp_path / "t" / "logits_val.npy"
    good = logits.read_bytes()
    logits.write_bytes(b"not an npy file")
    with pytest.raises(TeacherError, match=r"cannot read .*logits_val\.npy"):
        load_teacher(tmp_path / "t", ds)
    logits.write_bytes(good)
    bad = np.load(logits)
    bad[1, 0] = np.nan  # distill said "probs_val contains NaN or infinite values", naming no file
    np.save(logits, bad)
    with pytest.raises(TeacherError, match=r"logits_val\.npy holds NaN or infinite values \(row 1\)"):
        load_teacher(tmp_path / "t", ds)
    np.save(logits, np.zeros((1, 3), np.float32))
    with pytest.raises(TeacherError, match=r"logits_val\.npy has shape \(1, 3\), expected"):
        load_teacher(tmp_path / "t", ds)
    logits.unlink()
    with pytest.raises(TeacherError, match=r"logits_val\.npy is missing \(teacher.json says the teacher has logits\)"):
        load_teacher(tmp_path / "t", ds)
    logits.write_bytes(good)
    (tmp_path / "t" / "features_test.npy").unlink()
    with pytest.raises(TeacherError, match=r"features_test\.npy is missing"):
        load_teacher(tmp_path / "t", ds)


def test_unlabeled_photos_are_found_inside_the_source_or_in_their_own_folder():
    from types import SimpleNamespace

    from leaflens.pipeline.teachers.stage import split_source_dir

    inside = SimpleNamespace(manifest=SimpleNamespace(source_root="/photos", unlabeled_source=None))
    apart = SimpleNamespace(manifest=SimpleNamespace(source_root="/photos", unlabeled_source="/more"))
    assert split_source_dir(inside, "unlabeled") == Path("/photos")  # files read "unlabeled/x.jpg"
    assert split_source_dir(apart, "unlabeled") == Path("/more")
    assert split_source_dir(apart, "train") == Path("/photos")
    assert split_source_dir(SimpleNamespace(manifest=SimpleNamespace(source_root=None, unlabeled_source=None)),
                            "unlabeled") is None
