"""The preprocessing contract: area resize, normalisation, the typed record, and its agreement with the engine."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.data_prep.contract import (
    ContractError,
    PreprocessContract,
    area_resize,
    centre_crop,
    contract_for_dataset,
    normalize,
    rgb_floats,
)
from leaflens.records import RecordError

MEAN, STD = (0.45, 0.5, 0.35), (0.2, 0.25, 0.3)


def test_area_resize_averages_blocks_at_whole_number_ratios():
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    want = x.reshape(3, 8, 2, 8, 2, 3).astype(np.float64).mean(axis=(2, 4))
    got = area_resize(x, 8)
    assert got.dtype == np.float32 and got.shape == (3, 8, 8, 3)
    np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_allclose(area_resize(x.astype(np.float32), 8), want, atol=1e-4)
    same = area_resize(x, 16)
    np.testing.assert_array_equal(same, x.astype(np.float32))  # already at size: a float32 copy
    assert not np.shares_memory(same, x)


def test_area_resize_weights_each_source_pixel_by_the_area_it_covers():
    """At 5 -> 3 every output pixel covers 5/3 source pixels: the exact average, checked against a
    brute-force one (each source pixel split into 3 x 3 sub-pixels, blocks of 5 x 5 sub-pixels averaged)."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (2, 5, 5, 3), dtype=np.uint8)
    fine = x.astype(np.float64).repeat(3, axis=1).repeat(3, axis=2)  # 15 x 15
    want = fine.reshape(2, 3, 5, 3, 5, 3).mean(axis=(2, 4))
    np.testing.assert_allclose(area_resize(x, 3), want, atol=1e-4)
    # a fine checkerboard becomes flat grey, not stripes
    board = (np.indices((15, 15)).sum(0) % 2 * 255).astype(np.uint8)[None, :, :, None].repeat(3, -1)
    small = area_resize(board, 6)
    assert small.shape == (1, 6, 6, 3) and np.ptp(small) < 60 and abs(small.mean() - 127.5) < 15


@pytest.mark.parametrize("size", [64, 96, 50])
def test_area_resize_of_an_image_does_not_depend_on_its_batch(size):
    x = np.random.default_rng(2).integers(0, 256, (9, 128, 128, 3), dtype=np.uint8)
    whole = area_resize(x, size)
    for i in range(len(x)):
        np.testing.assert_array_equal(area_resize(x[i:i + 1], size)[0], whole[i])
    np.testing.assert_array_equal(area_resize(x[3:7], size), whole[3:7])


def test_area_resize_refuses_to_blow_images_up():
    with pytest.raises(ValueError, match="size 32 must be in 1..16"):
        area_resize(np.zeros((1, 16, 16, 3), np.uint8), 32)


def test_normalize_scales_per_channel_and_leaves_its_input_alone():
    x = np.random.default_rng(3).integers(0, 256, (4, 6, 6, 3)).astype(np.float32)
    kept = x.copy()
    got = normalize(x, MEAN, STD)
    np.testing.assert_allclose(got, (x / 255.0 - np.array(MEAN)) / np.array(STD), atol=1e-5)
    np.testing.assert_array_equal(x, kept)


def test_the_engine_loader_agrees_with_the_contract_bit_for_bit():
    """Training batches go through the engine's own resampler and fused normalisation (the engine may not
    import data_prep): with nothing random switched on, they equal the contract's steps exactly at 128 -> 64."""
    from leaflens.engine.data import Augment, augment_batch
    from leaflens.engine.data import normalize as engine_normalize

    x = np.random.default_rng(4).integers(0, 256, (6, 128, 128, 3), dtype=np.uint8)
    want = area_resize(x, 64)
    plain = Augment(hflip=False, crop=None, out_size=64, brightness=0, contrast=0)
    np.testing.assert_array_equal(augment_batch(x, plain, np.random.default_rng(0)), want)
    whole_crop = Augment(hflip=False, crop="resized", scale=(1.0, 1.0), ratio=(1, 1), out_size=64)
    np.testing.assert_array_equal(augment_batch(x, whole_crop, np.random.default_rng(0)), want)
    np.testing.assert_array_equal(engine_normalize(want, MEAN, STD), normalize(want, MEAN, STD))


def test_contract_record_round_trips_and_checks_its_fields():
    c = PreprocessContract(stored_size=128, input_size=64, mean=[0.5, 0.4, 0.3], std=[0.2, 0.2, 0.2])
    assert c.mean == (0.5, 0.4, 0.3) and c.resize == "crop"  # lists from callers become tuples
    assert PreprocessContract.from_dict(c.to_dict()) == c
    assert c.to_dict() == {"stored_size": 128, "input_size": 64, "mean": [0.5, 0.4, 0.3],
                           "std": [0.2, 0.2, 0.2], "resize": "crop"}
    for kw, field, why in [({"input_size": 256}, "input_size", "larger than stored_size"),
                           ({"stored_size": 0}, "stored_size", ">= 1"),
                           ({"std": (0.2, 0.0, 0.2)}, "std", "positive"),
                           ({"mean": (0.5, 0.5)}, "mean", "3 numbers"),
                           ({"resize": "stretch"}, "resize", "'crop' or 'pad'")]:
        args = {"stored_size": 128, "input_size": 64, "mean": MEAN, "std": STD, **kw}
        with pytest.raises(ContractError) as info:
            PreprocessContract(**args)
        assert info.value.field == field and why in str(info.value)
    with pytest.raises(RecordError, match="unknown key 'size'"):
        PreprocessContract.from_dict({**c.to_dict(), "size": 3})


def test_prepare_takes_stored_size_pixels_and_gives_the_model_input():
    c = PreprocessContract(stored_size=32, input_size=16, mean=MEAN, std=STD)
    x = np.random.default_rng(6).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_array_equal(c.prepare(x), normalize(area_resize(x, 16), MEAN, STD))
    with pytest.raises(ValueError, match=r"\[N, 32, 32, 3\]"):
        c.prepare(x[:, :16, :16])


def test_centre_crop_keeps_the_middle_square_of_each_image():
    x = np.arange(2 * 8 * 8 * 1, dtype=np.uint8).reshape(2, 8, 8, 1)
    np.testing.assert_array_equal(centre_crop(x, 0.5), x[:, 2:6, 2:6])
    np.testing.assert_array_equal(centre_crop(x, 0.75), x[:, 1:7, 1:7])  # 6 of 8 pixels
    np.testing.assert_array_equal(centre_crop(x, 0.875), x[:, 0:7, 0:7])  # odd margin: the extra pixel right/bottom
    assert centre_crop(x, 1.0).shape == x.shape
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            centre_crop(x, bad)
    with pytest.raises(ValueError, match="square"):
        centre_crop(x[:, :, :6], 0.5)


def test_a_contract_with_a_centre_crop_crops_the_stored_pixels_before_the_resize():
    c = PreprocessContract(stored_size=32, input_size=16, mean=MEAN, std=STD, centre_crop=0.75)
    x = np.random.default_rng(7).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_array_equal(c.to_input_size(x), area_resize(x[:, 4:28, 4:28], 16))
    np.testing.assert_array_equal(c.prepare(x), normalize(area_resize(x[:, 4:28, 4:28], 16), MEAN, STD))
    whole = PreprocessContract(stored_size=32, input_size=16, mean=MEAN, std=STD)
    assert not np.array_equal(c.prepare(x), whole.prepare(x))
    assert c.to_dict()["centre_crop"] == 0.75 and "centre_crop" not in whole.to_dict()  # old readers: unchanged
    assert PreprocessContract.from_dict(c.to_dict()) == c
    for crop, why in [(1.0, "in (0, 1)"), (0.0, "in (0, 1)"), (True, "in (0, 1)"), ("0.5", "in (0, 1)"),
                      (0.4, "keeps 13 of the stored 32 px, fewer than the input size 16")]:
        with pytest.raises(ContractError) as info:
            PreprocessContract(stored_size=32, input_size=16, mean=MEAN, std=STD, centre_crop=crop)
        assert info.value.field == "centre_crop" and why in str(info.value)


def test_contract_for_dataset_reads_stored_size_resize_and_statistics(tmp_path):
    from dp_helpers import make_class_folders

    from leaflens.data_prep.ingest import IngestOptions, ingest
    from leaflens.data_prep.manifest import load_dataset

    out = tmp_path / "ds"
    ingest(make_class_folders(tmp_path / "photos", per_class=4), out, IngestOptions(size=24, resize="pad"),
           workers=1, log=lambda s: None)
    ds = load_dataset(out)
    c = contract_for_dataset(ds, 12)
    assert (c.stored_size, c.input_size, c.resize) == (24, 12, "pad")
    np.testing.assert_allclose(c.mean, ds.mean)
    np.testing.assert_allclose(c.std, ds.std)
    assert c.centre_crop is None and contract_for_dataset(ds, 12, 0.75).centre_crop == 0.75
    # step 1 is what preprocess stored
    first = ds["train"].files[0]
    np.testing.assert_array_equal(c.decode(tmp_path / "photos" / first), ds["train"].images[0])


def test_rgb_floats_keeps_each_channel_and_refuses_another_count():
    mean = np.array([0.1234567, 0.5, 0.75], np.float32)
    triple = rgb_floats(mean, "mean")
    assert triple == (float(mean[0]), float(mean[1]), float(mean[2]))
    assert all(type(v) is float for v in triple)
    with pytest.raises(ContractError, match=r"^stats: the mean must have one value per RGB channel \(3\), got 2$"):
        rgb_floats([0.5, 0.5], "stats: the mean")
