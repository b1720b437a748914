"""ModelCard: a typed record that embeds the preprocessing contract, in ONNX metadata (formats 1 and 2) and as JSON."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from apps_helpers import build_tiny_model, leaflens_metadata, tiny_weights, write_photo

from leaflens.apps.model_card import ModelCard, ModelError, OODCheck, TrainedOn, trained_on
from leaflens.apps.predictor import Predictor
from leaflens.data_prep.contract import PreprocessContract, area_resize, normalize
from leaflens.data_prep.decode import decode_image
from leaflens.records import RecordError

CLASSES = ["a", "b", "c"]


def _card(**kw) -> ModelCard:
    contract = PreprocessContract(stored_size=32, input_size=16, mean=(0.5, 0.4, 0.3), std=(0.25, 0.2, 0.3),
                                  resize="pad")
    return ModelCard(classes=tuple(CLASSES), contract=contract, **kw)


def test_format_3_records_the_stored_size_and_reads_back():
    card = _card(uncertain_threshold=0.7, threshold_from_model=True, run_id="r1", accuracy=0.9, params=12)
    meta = card.to_metadata()
    assert meta["leaflens.format"] == "3" and meta["leaflens.stored_size"] == "32"
    assert "leaflens.ood" not in meta
    assert meta["leaflens.input_size"] == "16" and meta["leaflens.resize"] == "pad"
    assert ModelCard.from_metadata(meta, "m.onnx") == card
    assert (card.stored_size, card.input_size, card.resize) == (32, 16, "pad")


def test_a_centre_crop_is_format_4_and_a_format_3_file_cannot_carry_one():
    crop = ModelCard(classes=tuple(CLASSES), contract=PreprocessContract(
        stored_size=32, input_size=16, mean=(0.5, 0.4, 0.3), std=(0.25, 0.2, 0.3), centre_crop=0.875))
    meta = crop.to_metadata()
    # a leaflens from before format 4 would serve the whole photo: it refuses the file instead
    assert meta["leaflens.format"] == "4" and meta["leaflens.centre_crop"] == "0.875"
    assert ModelCard.from_metadata(meta, "m.onnx") == crop
    assert "leaflens.centre_crop" not in _card().to_metadata()
    with pytest.raises(ModelError, match=r"m.onnx: metadata key 'leaflens.centre_crop' is in a format 3 file"):
        ModelCard.from_metadata({**meta, "leaflens.format": "3"}, "m.onnx")
    with pytest.raises(ModelError, match=r"'leaflens.centre_crop' must be a share of the stored side in \(0, 1\)"):
        ModelCard.from_metadata({**meta, "leaflens.centre_crop": "1.5"}, "m.onnx")
    with pytest.raises(ModelError, match=r"'leaflens.centre_crop' is not a number"):
        ModelCard.from_metadata({**meta, "leaflens.centre_crop": "most"}, "m.onnx")


def test_the_predictor_applies_the_models_centre_crop(tmp_path):
    weights = tiny_weights(3, seed=4)
    meta = leaflens_metadata(CLASSES, 16, **{"leaflens.format": "4", "leaflens.stored_size": "32",
                                             "leaflens.centre_crop": "0.75"})
    predictor = Predictor(build_tiny_model(tmp_path / "crop.onnx", weights, 16, meta))
    photo = write_photo(tmp_path / "p.png", (60, 40))
    stored = decode_image(photo, 32, "crop")
    assert predictor.card.contract.centre_crop == 0.75
    np.testing.assert_array_equal(predictor.decode(photo), stored)  # step 1 unchanged: the stored pixels
    want = predictor.card.contract.prepare(stored[None])
    np.testing.assert_array_equal(want[0], normalize(area_resize(stored[None, 4:28, 4:28], 16),
                                                     predictor.card.mean, predictor.card.std)[0])
    np.testing.assert_array_equal(predictor.preprocess([stored]), want.transpose(0, 3, 1, 2))


def test_typed_record_round_trip_and_format_1_upgrade():
    card = _card()
    data = card.to_dict()
    assert data["schema_version"] == 4 and data["contract"]["stored_size"] == 32
    assert ModelCard.from_dict(data) == card
    old = {**data, "schema_version": 1, "contract": {k: v for k, v in data["contract"].items() if k != "stored_size"}}
    assert ModelCard.from_dict(old).stored_size == 16  # format 1: decoded straight to the input size
    with pytest.raises(RecordError, match="unknown key 'colour'"):
        ModelCard.from_dict({**data, "colour": "green"})


def test_format_1_metadata_is_read_with_the_stored_size_equal_to_the_input_size(tiny_model, tmp_path):
    path, _ = tiny_model(size=16)  # written as older exports were: format 1, no stored size
    predictor = Predictor(path)
    assert predictor.card.stored_size == predictor.card.input_size == 16
    photo = write_photo(tmp_path / "p.png", (48, 36))
    np.testing.assert_array_equal(predictor.decode(photo), decode_image(photo, 16, "crop"))


@pytest.mark.parametrize("extra,key,why", [
    ({"leaflens.format": "2"}, "leaflens.stored_size", "is missing"),
    ({"leaflens.format": "2", "leaflens.stored_size": "8"}, "leaflens.input_size", "larger than stored_size"),
    ({"leaflens.format": "2", "leaflens.stored_size": "big"}, "leaflens.stored_size", "not an integer"),
    ({"leaflens.format": "one"}, "leaflens.format", "reads formats 1 to 4"),
])
def test_bad_format_2_metadata_names_the_key(tmp_path, extra, key, why):
    path = build_tiny_model(tmp_path / "bad.onnx", tiny_weights(3), 16, leaflens_metadata(CLASSES, 16, **extra))
    with pytest.raises(ModelError) as info:
        Predictor(path)
    assert "bad.onnx" in str(info.value) and key in str(info.value) and why in str(info.value)


def test_predictor_decodes_at_the_stored_size_and_area_averages_to_the_input(tmp_path):
    weights = tiny_weights(3, seed=2)
    path = build_tiny_model(tmp_path / "m.onnx", weights, 16, leaflens_metadata(
        CLASSES, 16, **{"leaflens.format": "2", "leaflens.stored_size": "32"}))
    predictor = Predictor(path)
    photo = write_photo(tmp_path / "leaf.jpg", (90, 70), seed=4)
    stored = predictor.decode(photo)
    np.testing.assert_array_equal(stored, decode_image(photo, 32, "crop"))
    x = predictor.preprocess(stored[None])
    assert x.shape == (1, 3, 16, 16)
    want = (area_resize(stored[None], 16) / 255.0 - np.array([0.5, 0.4, 0.3])) / np.array([0.25, 0.2, 0.3])
    np.testing.assert_allclose(x.transpose(0, 2, 3, 1), want, atol=1e-5)
    assert predictor.predict_image(photo).ok
    with pytest.raises(ValueError, match=r"\[N, 32, 32, 3\]"):  # input-size arrays are not the contract
        predictor.predict_arrays(np.zeros((1, 16, 16, 3), np.uint8))


def test_out_of_domain_check_round_trips_and_format_2_has_none():
    ood = OODCheck(method="block-mahalanobis-1", threshold=9.5, budget=0.03, val_photos=133, val_flagged=0.0226,
                   train_photos=1034, blocks=4)
    card = _card(ood=ood, val_ambiguous=0.01)
    meta = card.to_metadata()
    back = ModelCard.from_metadata(meta, "m.onnx")
    assert back.ood == ood and back.val_ambiguous == 0.01
    old = {k: v for k, v in meta.items() if k not in ("leaflens.ood", "leaflens.val_ambiguous")}
    old["leaflens.format"] = "2"
    assert ModelCard.from_metadata(old, "m.onnx").ood is None


@pytest.mark.parametrize("value, why", [("{", "not JSON"), ('{"method": "x"}', "out-of-domain"),
                                        ('{"method": "x", "threshold": 1, "budget": 0.9, "val_photos": 1, '
                                         '"val_flagged": 0, "train_photos": 1, "blocks": 1}', "budget")])
def test_broken_out_of_domain_metadata_names_the_key(value, why):
    meta = {**_card().to_metadata(), "leaflens.ood": value}
    with pytest.raises(ModelError, match=f"leaflens.ood.*{why}"):
        ModelCard.from_metadata(meta, "m.onnx")


def test_the_calibration_temperature_round_trips_is_said_and_a_bad_one_names_the_key():
    from leaflens.apps.model_info import _threshold_line  # noqa: PLC0415

    card = _card(temperature=0.47)
    meta = card.to_metadata()
    assert meta["leaflens.temperature"] == "0.47" and ModelCard.from_metadata(meta, "m.onnx").temperature == 0.47
    plain = _card().to_metadata()
    assert "leaflens.temperature" not in plain and ModelCard.from_metadata(plain, "m.onnx").temperature is None
    assert "divided by 0.47" in _threshold_line(card, "en") and "除以 0.47" in _threshold_line(card, "zh")
    assert "divided by" not in _threshold_line(_card(), "en")
    for bad in ("0", "-1", "nan", "hot"):
        with pytest.raises(ModelError, match="leaflens.temperature"):
            ModelCard.from_metadata({**plain, "leaflens.temperature": bad}, "m.onnx")


# ---- what the model was trained on (leaflens.dataset) --------------------------------------------------
def test_training_data_round_trips_and_older_files_say_nothing():
    trained = TrainedOn(kind="synthetic", photos=2400, generator="leaflens data synth")
    card = _card(trained_on=trained)
    meta = card.to_metadata()
    assert json.loads(meta["leaflens.dataset"]) == {"kind": "synthetic", "photos": 2400,
                                                    "generator": "leaflens data synth"}
    back = ModelCard.from_metadata(meta, "m.onnx")
    assert back.trained_on == trained and back.trained_on.synthetic and back == card
    assert ModelCard.from_dict(card.to_dict()) == card
    photos = _card(trained_on=TrainedOn(kind="photos", photos=1034))
    assert json.loads(photos.to_metadata()["leaflens.dataset"]) == {"kind": "photos", "photos": 1034}
    assert not ModelCard.from_metadata(photos.to_metadata(), "m.onnx").trained_on.synthetic
    plain = _card()  # exported before the key existed: not recorded, and the dict is as it was
    assert "leaflens.dataset" not in plain.to_metadata() and "trained_on" not in plain.to_dict()
    assert ModelCard.from_metadata(plain.to_metadata(), "m.onnx").trained_on is None


def test_how_the_training_data_was_used_has_a_key_an_older_leaflens_does_not_read():
    """The counts trained on / unlabelled go under leaflens.dataset_use: an older leaflens reads leaflens.dataset
    strictly (an unknown key is an error) and must still serve the file."""
    used = TrainedOn(kind="synthetic", photos=1200, generator="leaflens data synth", train=838, unlabeled=1200)
    meta = _card(trained_on=used).to_metadata()
    assert json.loads(meta["leaflens.dataset"]) == {"kind": "synthetic", "photos": 1200,
                                                    "generator": "leaflens data synth"}
    assert json.loads(meta["leaflens.dataset_use"]) == {"train": 838, "unlabeled": 1200}
    assert ModelCard.from_metadata(meta, "m.onnx").trained_on == used
    assert TrainedOn.from_dict(json.loads(meta["leaflens.dataset"])).photos == 1200  # what an older reader sees
    with pytest.raises(ModelError, match="dataset_use"):
        ModelCard.from_metadata({**meta, "leaflens.dataset_use": '{"val": 3}'}, "m.onnx")


@pytest.mark.parametrize("value, why", [("[", "not JSON"), ('{"kind": "drawings", "photos": 3}', "kind"),
                                        ('{"kind": "photos", "photos": -1}', "photos must be a count"),
                                        ('{"kind": "photos"}', "photos")])
def test_broken_training_data_metadata_names_the_key(value, why):
    meta = {**_card().to_metadata(), "leaflens.dataset": value}
    with pytest.raises(ModelError, match=f"m.onnx: metadata key 'leaflens.dataset'.*{why}"):
        ModelCard.from_metadata(meta, "m.onnx")


def test_trained_on_tells_drawn_leaves_from_photos_by_the_source_folder(tmp_path):
    from apps_helpers import make_dataset

    from leaflens.data_prep.ingest import IngestOptions, ingest
    from leaflens.data_prep.manifest import read_manifest
    from leaflens.data_prep.synth import SynthOptions, generate

    drawn = generate(tmp_path / "synth", SynthOptions(per_class=3, size=32, broken=0, exif_fraction=0.0), workers=1,
                     log=lambda *_: None)
    ds = ingest(tmp_path / "synth", tmp_path / "synth_ds", IngestOptions(size=16), workers=1, log=lambda *_: None).out
    got = trained_on(read_manifest(ds))
    train = read_manifest(ds).splits["train"].count
    assert got == TrainedOn(kind="synthetic", photos=3 * len(drawn.classes), generator="leaflens data synth",
                            train=train)
    assert 0 < train < got.photos  # the card said "trained on" every labelled photo, val and test ones too

    photos = make_dataset(tmp_path / "real", ["healthy", "rust"], per_class=4)  # a photo folder: no synth.json
    assert trained_on(read_manifest(photos)) == TrainedOn(kind="photos", photos=8,
                                                          train=read_manifest(photos).splits["train"].count)
    (tmp_path / "synth" / "synth.json").write_text("{not json")  # another version's file: drawn all the same
    assert trained_on(read_manifest(ds)).kind == "synthetic"
    shutil.rmtree(tmp_path / "real" / "photos")  # the source is gone: cannot tell
    assert trained_on(read_manifest(photos)).kind == "unknown" and trained_on(read_manifest(photos)).photos == 8
    moved = tmp_path / "moved synth"  # the project moved: where the caller found the folder wins over the record
    shutil.move(tmp_path / "synth", moved)
    assert trained_on(read_manifest(ds)).kind == "unknown"
    assert trained_on(read_manifest(ds), source_root=moved).kind == "synthetic"
