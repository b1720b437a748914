"""Predictor: probabilities against a NumPy re-computation, metadata, uncertainty, broken files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from apps_helpers import reference_probs, tiny_weights, write_photo

from leaflens.apps.model_card import DEFAULT_UNCERTAIN_THRESHOLD, ModelCard, ModelError
from leaflens.apps.predictor import Predictor
from leaflens.data_prep.decode import decode_image

CLASSES = ["angular_leaf_spot", "bean_rust", "healthy"]


def test_probabilities_match_numpy_reference(tiny_model):
    path, weights = tiny_model(size=16, seed=3)
    predictor = Predictor(path)
    batch = np.random.default_rng(1).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    probs = predictor.predict_arrays(batch)
    assert probs.shape == (5, 3) and probs.dtype == np.float32
    np.testing.assert_allclose(probs, reference_probs(batch, weights), atol=2e-5)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    # Rows are independent of their batch-mates (batching must not change answers).
    np.testing.assert_allclose(predictor.predict_arrays(batch[2:3])[0], probs[2], atol=1e-6)


def test_provider_and_threads_reported(tiny_model):
    path, _ = tiny_model()
    predictor = Predictor(path, intra_op_threads=1)
    assert predictor.provider == predictor.providers[0]
    assert predictor.provider in predictor.session.get_providers()
    assert predictor.intra_op_threads == 1
    assert predictor.classes == tuple(CLASSES)


def test_predict_files_matches_decode_and_reference(tiny_model, tmp_path):
    path, weights = tiny_model(size=16, seed=5)
    predictor = Predictor(path)
    files = [write_photo(tmp_path / f"leaf{i}.png", size=(48 + i, 36), seed=i) for i in range(7)]
    results = predictor.predict_files(files, top_k=2, batch_size=3)
    assert [r.source for r in results] == [str(f) for f in files]
    for f, r in zip(files, results):
        expected = reference_probs(decode_image(f, 16, "crop")[None], weights)[0]
        order = np.argsort(-expected)[:2]
        assert r.ok and len(r.top) == 2
        assert [c for c, _ in r.top] == [CLASSES[i] for i in order]
        np.testing.assert_allclose([p for _, p in r.top], expected[order], atol=2e-5)
        assert r.uncertain == (expected.max() < DEFAULT_UNCERTAIN_THRESHOLD)


def test_unreadable_file_gives_error_result(tiny_model, tmp_path):
    path, _ = tiny_model()
    predictor = Predictor(path)
    good = write_photo(tmp_path / "good.jpg", seed=1)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    results = predictor.predict_files([broken, good, empty], batch_size=2)
    assert [r.ok for r in results] == [False, True, False]
    assert "broken.jpg" in results[0].error and results[0].top == () and results[0].label is None
    assert "empty.png" in results[2].error
    assert results[1].label in CLASSES
    single = predictor.predict_image(broken)
    assert not single.ok and "broken.jpg" in single.error
    assert predictor.predict_image(good.read_bytes()).top == results[1].top


def test_uncertain_flag_follows_threshold_in_metadata(tiny_model):
    # A model whose class weights are all zero and biases equal gives 1/3 to each class: uncertain.
    flat = tiny_weights(3)
    flat["fc_w"][:] = 0.0
    flat["fc_b"][:] = 0.0
    path, _ = tiny_model(name="flat.onnx", weights=flat, **{"leaflens.uncertain_threshold": "0.9"})
    predictor = Predictor(path)
    assert predictor.card.uncertain_threshold == 0.9 and predictor.card.threshold_from_model
    photo = np.random.default_rng(0).integers(0, 256, (1, 16, 16, 3), dtype=np.uint8)
    ranked = predictor.rank(predictor.predict_arrays(photo)[0], top_k=3)
    assert ranked.uncertain and ranked.confidence == pytest.approx(1 / 3, abs=1e-6)
    confident = predictor.rank(np.array([0.05, 0.92, 0.03]), top_k=1)
    assert confident.label == "bean_rust" and not confident.uncertain and len(confident.top) == 1
    doubtful = predictor.rank(np.array([0.30, 0.85, 0.25]), top_k=5)  # top_k above C is clipped
    assert doubtful.uncertain
    assert [c for c, _ in doubtful.top] == ["bean_rust", "angular_leaf_spot", "healthy"]
    # Without the key, the documented default applies.
    default = Predictor(tiny_model(name="default.onnx")[0])
    assert default.card.uncertain_threshold == DEFAULT_UNCERTAIN_THRESHOLD
    assert not default.card.threshold_from_model
    assert default.rank(np.array([0.3, 0.45, 0.25])).uncertain
    assert not default.rank(np.array([0.2, 0.55, 0.25])).uncertain


def test_a_near_tie_is_ambiguous_whatever_the_threshold(tiny_model):
    """A weak model's threshold (the demo's is 0.20 for 8 classes) let "Mosaic virus 24 %, next Powdery mildew
    24 %" through as a diagnosis with treatment notes; a second class within TIE_RATIO of the first is now
    "unsure between them", in the Predictor and in the page's vote alike."""
    from leaflens.apps.model_card import TIE_RATIO, unsure  # noqa: PLC0415

    low, _ = tiny_model(name="low.onnx", **{"leaflens.uncertain_threshold": "0.2"})
    predictor = Predictor(low)
    tie = predictor.rank(np.array([0.26, 0.25, 0.49]))  # third class top at 0.49, second 0.26: 0.53 of it
    assert tie.verdict == "diagnosis"
    close = predictor.rank(np.array([0.05, 0.48, 0.47]))
    assert close.verdict == "ambiguous" and close.uncertain
    assert predictor.rank(np.array([0.05, 0.50, 0.45])).verdict == "ambiguous"  # exactly at 0.9
    assert predictor.rank(np.array([0.06, 0.50, 0.44])).verdict == "diagnosis"  # 0.88 of it
    assert TIE_RATIO == 0.9
    rows = np.array([[0.5, 0.45, 0.05], [0.9, 0.05, 0.05], [0.3, 0.3, 0.4]])
    assert unsure(rows, 0.2).tolist() == [True, False, False]
    assert unsure(rows, 0.45).tolist() == [True, False, True]
    assert unsure(np.array([0.5, 0.5]), 0.0) is True and unsure(np.array([1.0]), 0.5) is False


def test_metadata_round_trip(tiny_model):
    extra = {"leaflens.run_id": "run-42", "leaflens.accuracy": "0.953", "leaflens.params": "93123",
             "leaflens.uncertain_threshold": "0.61"}
    path, _ = tiny_model(classes=["a", "b c", "é"], size=16, **extra)
    card = Predictor(path).card
    assert card.classes == ("a", "b c", "é") and card.input_size == 16 and card.resize == "crop"
    assert card.mean == (0.5, 0.4, 0.3) and card.std == (0.25, 0.2, 0.3)
    assert (card.run_id, card.accuracy, card.params) == ("run-42", 0.953, 93123)
    assert card.uncertain_threshold == 0.61
    assert ModelCard.from_metadata(card.to_metadata(), "x.onnx") == card
    written = card.to_metadata()
    assert json.loads(written["leaflens.classes"]) == ["a", "b c", "é"]
    assert written["leaflens.run_id"] == "run-42"


@pytest.mark.parametrize("key", ["leaflens.classes", "leaflens.input_size", "leaflens.mean", "leaflens.std",
                                 "leaflens.format", "leaflens.layout", "leaflens.resize"])
def test_missing_required_key_names_file_and_key(tiny_model, key):
    path, _ = tiny_model(name="nokey.onnx", drop=(key,))
    with pytest.raises(ModelError) as info:
        Predictor(path)
    assert "nokey.onnx" in str(info.value) and key in str(info.value)


@pytest.mark.parametrize("key,value,why", [
    ("leaflens.classes", "not json", "not JSON"),
    ("leaflens.classes", '["a", "b"]', "expected [N, 2]"),
    ("leaflens.input_size", "32", "expected [N, 3, 32, 32]"),
    ("leaflens.mean", "[0.5, 0.5]", "3 numbers"),
    ("leaflens.std", "[0.5, 0.0, 0.5]", "positive"),
    ("leaflens.resize", "stretch", "'crop' or 'pad'"),
    ("leaflens.layout", "NHWC", "NCHW"),
    ("leaflens.format", "5", "format"),
    ("leaflens.uncertain_threshold", "1.5", "[0, 1]"),
])
def test_invalid_metadata_is_a_clear_error(tiny_model, key, value, why):
    path, _ = tiny_model(name="bad.onnx", **{key: value})
    with pytest.raises(ModelError) as info:
        Predictor(path)
    assert "bad.onnx" in str(info.value) and why in str(info.value)


def test_missing_or_garbage_model_file(tmp_path):
    with pytest.raises(ModelError, match="nothere.onnx: model file not found"):
        Predictor(tmp_path / "nothere.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"definitely not a protobuf")
    with pytest.raises(ModelError, match="junk.onnx"):
        Predictor(junk)


def test_predict_arrays_rejects_wrong_input(tiny_model):
    predictor = Predictor(tiny_model()[0])
    with pytest.raises(ValueError, match=r"\[N, 16, 16, 3\]"):
        predictor.predict_arrays(np.zeros((2, 16, 16, 3), np.float32))
    with pytest.raises(ValueError, match=r"\[N, 16, 16, 3\]"):
        predictor.predict_arrays(np.zeros((16, 16, 3), np.uint8))
    assert predictor.predict_arrays(np.zeros((0, 16, 16, 3), np.uint8)).shape == (0, 3)


def test_model_file_is_self_describing(tiny_model, tmp_path: Path):
    """The card's metadata written into a fresh model reads back identically (exporter contract)."""
    path, _ = tiny_model(size=16, **{"leaflens.uncertain_threshold": "0.4"})
    card = Predictor(path).card
    import onnx
    model = onnx.load(str(path))
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, card.to_metadata())
    copy = tmp_path / "copy.onnx"
    onnx.save(model, str(copy))
    assert Predictor(copy).card == card


def test_a_photo_without_colour_is_refused_only_by_a_model_that_learnt_from_colour(tiny_model, tmp_path):
    from apps_helpers import write_grey_noise

    grey = write_grey_noise(tmp_path / "grey.png")
    colour = write_photo(tmp_path / "colour.png", seed=3)
    colour_only, _ = tiny_model(name="colour.onnx", **{"leaflens.grey_share": "0.0"})
    pred = Predictor(colour_only, intra_op_threads=1)
    assert pred.card.refuses_grey
    refused = pred.predict_image(grey)
    assert refused.verdict == "refused" and refused.reason == "no_colour" and "without colour" in refused.error
    assert pred.predict_image(colour).ok
    for share in ("0.004", None):  # some training photos without colour, or not recorded: judged as usual
        extra = {} if share is None else {"leaflens.grey_share": share}
        model, _ = tiny_model(name=f"m{share}.onnx", **extra)
        assert Predictor(model, intra_op_threads=1).predict_image(grey).ok
    bad, _ = tiny_model(name="bad.onnx", **{"leaflens.grey_share": "1.5"})
    with pytest.raises(ModelError, match="grey_share"):
        Predictor(bad)


@pytest.mark.parametrize(("head", "says"), [
    (b"PK\x03\x04rest of a zip", "training checkpoint or other zip/.npz archive"),
    (b"\x93NUMPY\x01\x00", "a NumPy array (.npy)"),
    (b"\xff\xd8\xff\xe0JFIF", "a JPEG photo, not a model"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image, not a model"),
    (b"", "an empty file"),
])
def test_a_file_that_is_plainly_no_model_is_named_for_what_it_is(tmp_path, head, says):
    """``--model best.npz`` (or a photo, or an interrupted copy) used to give onnxruntime's "Protobuf parsing
    failed"; the message now says what the file is and which file --model takes."""
    path = tmp_path / "best.npz"
    path.write_bytes(head)
    with pytest.raises(ModelError) as err:
        Predictor(path)
    assert str(err.value).startswith(f"{path}: ")
    assert says in str(err.value)
    assert "Protobuf" not in str(err.value)


def test_other_bytes_keep_onnxruntime_s_own_reason(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x08\x07garbage that is not a graph")
    with pytest.raises(ModelError, match="onnxruntime cannot load this model"):
        Predictor(path)


def test_a_folder_given_as_the_model_points_at_the_file_inside(tmp_path):
    from leaflens.apps.model_arg import missing_model  # noqa: PLC0415

    (tmp_path / "export").mkdir()
    assert missing_model(tmp_path / "export") == (f"{tmp_path / 'export'}: a folder, not a model file (`leaflens "
                                                  "export` writes the .onnx file that --model takes)")
    (tmp_path / "export" / "student.onnx").write_bytes(b"")
    (tmp_path / "export" / "teacher.onnx").write_bytes(b"")
    assert missing_model(tmp_path / "export").endswith(f"e.g. --model {tmp_path / 'export' / 'student.onnx'}")
    assert missing_model(tmp_path / "export" / "student.onnx") is None
    assert "model file not found" in missing_model(tmp_path / "nothing.onnx")


@pytest.mark.parametrize("ood", [None, 0.5])
def test_the_module_docstrings_server_example_runs(tiny_model, tmp_path, ood):
    """The example paired predict_arrays with rank(), which refuses every model `leaflens export` writes (they
    have an out-of-domain score): a developer copying it hit a ValueError at once."""
    import textwrap

    from leaflens.apps import predictor as module
    from leaflens.apps.batcher import DynamicBatcher
    from leaflens.cpus import usable_cpus

    model, _ = tiny_model(ood_threshold=ood)
    photo = write_photo(tmp_path / "leaf.png")
    doc = module.__doc__ or ""
    block = doc.split("pair it with the dynamic batcher::", 1)[1].split("\n\n", 2)[1]
    code = textwrap.dedent(block).replace('"student.onnx"', repr(str(model)))
    namespace = {"Predictor": Predictor, "DynamicBatcher": DynamicBatcher, "usable_cpus": usable_cpus,
                 "photo_path": str(photo)}
    exec(code, namespace)  # noqa: S102 - the docstring's own example
    try:
        answer = namespace["answer"]
        assert answer.verdict in ("diagnosis", "ambiguous", "out_of_domain") and answer.source == str(photo)
    finally:
        namespace["batcher"].close()
