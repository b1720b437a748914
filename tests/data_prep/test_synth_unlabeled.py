"""`leaflens data synth --unlabeled-fraction`: a seeded share of each class's photos in unlabeled/ with the
labels withheld, read by preprocess as the unlabelled split and by the teacher stage from the source."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from leaflens.data_prep.decode import decode_image_at
from leaflens.data_prep.ingest import IngestOptions, ingest
from leaflens.data_prep.manifest import load_dataset
from leaflens.data_prep.synth import CLASSES, SynthOptions, _unlabeled_names, generate
from leaflens.pipeline.cli import main as cli_main
from leaflens.pipeline.teachers.artefact import load_teacher

QUIET = {"log": lambda msg: None}
PER_CLASS = 8
FRACTION = 0.5
N_UNL = 4  # of each class's 8 photos; the 4 labelled ones give preprocess a train, val and test photo per class
OPTS = SynthOptions(per_class=PER_CLASS, size=64, seed=3, broken=0, exif_fraction=0.0,
                    unlabeled_fraction=FRACTION)


@pytest.fixture(scope="module")
def withheld(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth_unl") / "ds"
    generate(out, OPTS, workers=2, **QUIET)
    return out


def test_each_class_keeps_its_labelled_share_and_the_rest_is_unlabelled(withheld):
    n_unl = N_UNL
    for c in CLASSES:
        assert len(list((withheld / c).glob("*.jpg"))) == PER_CLASS - n_unl, c
    unl = sorted(p.name for p in (withheld / "unlabeled").iterdir())
    assert len(unl) == n_unl * len(CLASSES)
    assert not any(c in name for name in unl for c in CLASSES)  # a name does not tell the class
    meta = json.loads((withheld / "synth.json").read_text(encoding="utf-8"))
    assert meta["options"]["unlabeled_fraction"] == FRACTION
    assert sorted(u["path"] for u in meta["unlabeled"]) == [f"unlabeled/{n}" for n in unl]
    assert Counter(u["withheld_class"] for u in meta["unlabeled"]) == dict.fromkeys(CLASSES, n_unl)
    # the numbering is shuffled over the classes, not class after class
    first = [u["withheld_class"] for u in sorted(meta["unlabeled"], key=lambda u: u["path"])[:n_unl]]
    assert len(set(first)) > 1


def test_the_photos_are_the_same_whatever_the_fraction(withheld, tmp_path):
    """Only where a photo is written depends on the fraction: F = 0 gives the same photos, all labelled, the
    withheld ones under the class synth.json names for them."""
    labelled = tmp_path / "labelled"
    generate(labelled, SynthOptions(**{**OPTS.to_dict(), "unlabeled_fraction": 0.0}), workers=1, **QUIET)
    assert not (labelled / "unlabeled").exists()
    meta = json.loads((withheld / "synth.json").read_text(encoding="utf-8"))
    by_bytes = {p.read_bytes(): p.parent.name for p in labelled.rglob("*.jpg")}
    assert len(by_bytes) == PER_CLASS * len(CLASSES)
    for u in meta["unlabeled"]:
        assert by_bytes[(withheld / u["path"]).read_bytes()] == u["withheld_class"], u
    for c in CLASSES:
        for p in (withheld / c).glob("*.jpg"):
            assert by_bytes[p.read_bytes()] == c


def test_the_withheld_photos_follow_the_seed():
    assert _unlabeled_names(OPTS) == _unlabeled_names(SynthOptions(**OPTS.to_dict()))
    other = _unlabeled_names(SynthOptions(**{**OPTS.to_dict(), "seed": 4}))
    assert len(other) == N_UNL * len(CLASSES) and set(other) != set(_unlabeled_names(OPTS))


def test_a_new_fraction_makes_the_folder_again(tmp_path):
    out = tmp_path / "ds"
    small = SynthOptions(per_class=2, size=32, seed=1, broken=0, exif_fraction=0.0, unlabeled_fraction=0.5)
    info = generate(out, small, workers=1, **QUIET)
    assert len(list((out / "unlabeled").iterdir())) == len(info.unlabeled) == len(CLASSES)
    assert generate(out, small, workers=1, **QUIET) == info  # up to date
    generate(out, SynthOptions(**{**small.to_dict(), "unlabeled_fraction": 0.0}), workers=1, **QUIET)
    assert not (out / "unlabeled").exists() and len(list(out.rglob("*.jpg"))) == 2 * len(CLASSES)


@pytest.mark.parametrize("fraction, message", [
    (1.0, "unlabeled_fraction must be at least 0 and below 1"),
    (-0.1, "unlabeled_fraction must be at least 0 and below 1"),
    (0.95, "leaves no labelled photo in a class"),  # round(0.95 * 8) = 8
])
def test_a_fraction_that_leaves_no_labels_is_refused(tmp_path, capsys, fraction, message):
    out = tmp_path / "cli"
    assert cli_main(["data", "synth", "--out", str(out), "--per-class", "8", "--unlabeled-fraction",
                     str(fraction), "--workers", "1"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def _mean_colour_encoder(path: Path, size: int) -> Path:
    """An ONNX 'teacher' whose features are the photo's mean colour and its square: cheap, and each photo's
    features can be checked against the photo itself."""
    nodes = [helper.make_node("GlobalAveragePool", ["input"], ["g"]),
             helper.make_node("Flatten", ["g"], ["m"]),
             helper.make_node("Mul", ["m", "m"], ["sq"]),
             helper.make_node("Concat", ["m", "sq"], ["features"], axis=1)]
    graph = helper.make_graph(nodes, "mean", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                            ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_preprocess_and_the_teacher_stage_use_the_unlabelled_photos(withheld, tmp_path):
    ds_dir = tmp_path / "dataset"
    report = ingest(withheld, ds_dir, IngestOptions(size=32), workers=1, **QUIET)
    assert report.kept_total == PER_CLASS * len(CLASSES)
    ds = load_dataset(ds_dir)
    assert ds["unlabeled"].labels is None and len(ds["unlabeled"]) == N_UNL * len(CLASSES)
    labelled = np.concatenate([np.asarray(ds[s].labels) for s in ("train", "val", "test")])
    assert Counter(labelled.tolist()) == dict.fromkeys(range(len(CLASSES)), PER_CLASS - N_UNL)
    assert all(f.startswith("unlabeled/") for f in ds["unlabeled"].files)

    # at an input size other than the stored one the teacher decodes the original photos from the source,
    # the unlabelled ones from its unlabeled/ folder
    size = 48
    enc = _mean_colour_encoder(tmp_path / "enc.onnx", size)
    assert cli_main(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "t"), "--onnx", str(enc),
                     "--quiet"]) == 0
    tt = load_teacher(tmp_path / "t", ds)
    assert tt.info.input_size == size and tt.info.rows["unlabeled"] == len(ds["unlabeled"])
    got = np.asarray(tt.features["unlabeled"], np.float32)
    photos = np.stack([decode_image_at(withheld / f, size, ds.manifest.resize) for f in ds["unlabeled"].files])
    sess = ort.InferenceSession(str(enc), providers=["CPUExecutionProvider"])
    mean, std = (np.asarray(tt.info.teacher[k], np.float32) for k in ("mean", "std"))
    x = ((photos.astype(np.float32) / 255.0 - mean) / std).transpose(0, 3, 1, 2)
    want = sess.run(None, {"input": np.ascontiguousarray(x)})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
