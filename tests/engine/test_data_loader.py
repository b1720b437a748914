"""Tests for leaflens.engine.data: ArrayDataset, DataLoader (shuffle, resume, prefetch) and augmentation."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from leaflens.engine.data import ArrayDataset, Augment, DataLoader, augment_batch, normalize


def _indexed(n: int = 50, size: int = 8) -> ArrayDataset:
    """Image i is filled with (i % 256, i // 256, 7); label i % 5."""
    x = np.zeros((n, size, size, 3), np.uint8)
    x[..., 0] = (np.arange(n) % 256)[:, None, None]
    x[..., 1] = (np.arange(n) // 256)[:, None, None]
    x[..., 2] = 7
    return ArrayDataset(x, (np.arange(n) % 5).astype(np.int64))


def _ids(xb: np.ndarray, mean=(0, 0, 0), std=(1, 1, 1)) -> np.ndarray:
    raw = (xb * np.array(std, np.float32) + np.array(mean, np.float32)) * 255.0
    return np.rint(raw[:, 0, 0, 0] + 256 * raw[:, 0, 0, 1]).astype(int)


def test_each_sample_once_per_epoch_and_labels_follow():
    ds = _indexed(50)
    loader = DataLoader(ds, 8, seed=1)
    assert len(loader) == 7
    seen = []
    sizes = []
    for b, (xb, yb, idx, number) in enumerate(loader):
        assert xb.dtype == np.float32 and yb.dtype == np.int64 and xb.shape[1:] == (8, 8, 3)
        ids = _ids(xb)
        np.testing.assert_array_equal(yb, ids % 5)
        np.testing.assert_array_equal(idx, ids)  # the indices name the rows the batch holds, in its order
        assert idx.dtype == np.int64 and number == b
        seen.extend(ids)
        sizes.append(len(yb))
    assert sorted(seen) == list(range(50)) and sizes[-1] == 2
    assert loader.epoch == 1
    dl = DataLoader(ds, 8, drop_last=True)
    assert len(dl) == 6 and sum(len(batch.labels) for batch in dl) == 48


def test_seeded_shuffle_differs_per_epoch_and_reproduces():
    ds = _indexed(40)
    a = DataLoader(ds, 40, seed=3)
    e0 = _ids(next(iter(a))[0])
    a.set_epoch(1)
    e1 = _ids(next(iter(a))[0])
    b = DataLoader(ds, 40, seed=3)
    b.set_epoch(1)
    assert not np.array_equal(e0, e1)
    np.testing.assert_array_equal(_ids(next(iter(b))[0]), e1)
    c = DataLoader(ds, 40, seed=4)
    assert not np.array_equal(_ids(next(iter(c))[0]), e0)
    d = DataLoader(ds, 40, shuffle=False)
    np.testing.assert_array_equal(_ids(next(iter(d))[0]), np.arange(40))


def test_batch_rows_follow_epoch_order():
    ds = _indexed(37)
    loader = DataLoader(ds, 8, seed=11, augment=Augment(crop="pad"))
    loader.set_epoch(2)
    order = loader.epoch_order(2)
    for b, (_, yb, idx, _) in enumerate(loader):
        np.testing.assert_array_equal(yb, order[b * 8:(b + 1) * 8] % 5)
        np.testing.assert_array_equal(idx, order[b * 8:(b + 1) * 8])
    plain = DataLoader(ds, 8, seed=11)
    order = plain.epoch_order(0)
    for b, (xb, _, idx, _) in enumerate(plain):
        np.testing.assert_array_equal(_ids(xb), order[b * 8:(b + 1) * 8])
        np.testing.assert_array_equal(idx, order[b * 8:(b + 1) * 8])


def test_normalize_leaves_input_alone_unless_inplace():
    x = np.full((2, 3, 3, 3), 51.0, np.float32)
    out = normalize(x, np.zeros(3), np.ones(3))
    assert np.all(x == 51.0) and np.allclose(out, 0.2)
    out = normalize(x, np.zeros(3), np.ones(3), inplace=True)
    assert out is x and np.allclose(x, 0.2)


def test_normalisation_uses_mean_std_on_unit_scale():
    x = np.random.default_rng(0).integers(0, 256, (4, 6, 6, 3), dtype=np.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    loader = DataLoader(ArrayDataset(x, np.zeros(4, np.int64)), 4, shuffle=False, mean=mean, std=std)
    xb = next(iter(loader)).images
    np.testing.assert_allclose(xb, (x / 255.0 - np.array(mean)) / np.array(std), rtol=1e-5, atol=1e-5)


def _epoch(loader):
    return [(x.copy(), y.copy(), idx.copy(), number) for x, y, idx, number in loader]


def test_augmentation_deterministic_regardless_of_threads():
    x = np.random.default_rng(1).integers(0, 256, (64, 16, 16, 3), dtype=np.uint8)
    ds = ArrayDataset(x, np.arange(64) % 3)
    runs = [_epoch(DataLoader(ds, 10, seed=9, augment=Augment(vflip=True), num_threads=t, prefetch=p))
            for t, p in ((0, 0), (1, 2), (3, 5))]
    for other in runs[1:]:
        for (xa, ya, ia, _), (xb, yb, ib, _) in zip(runs[0], other):
            np.testing.assert_array_equal(xa, xb)
            np.testing.assert_array_equal(ya, yb)
            np.testing.assert_array_equal(ia, ib)
    plain = _epoch(DataLoader(ds, 10, seed=9))
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(runs[0], plain))


def test_resume_mid_epoch_reproduces_the_rest_of_the_run():
    ds = _indexed(45)
    aug = Augment(crop="pad", pad=2)
    ref = DataLoader(ds, 6, seed=5, augment=aug)
    full = _epoch(ref) + _epoch(ref)  # epochs 0 and 1
    run = DataLoader(ds, 6, seed=5, augment=aug)
    _epoch(run)
    it = iter(run)
    got = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(run.state_dict()))  # must survive JSON
    assert state["epoch"] == 1 and state["batches_done"] == 3
    fresh = DataLoader(ds, 6, seed=0, augment=aug)
    fresh.load_state_dict(state)
    rest = _epoch(fresh)
    resumed = [(x.copy(), y.copy(), idx.copy(), number) for x, y, idx, number in got] + rest
    assert len(resumed) == len(full) // 2
    assert [r[3] for r in rest] == list(range(3, len(full) // 2))  # batch numbers go on from the resume point
    for (xa, ya, ia, na), (xb, yb, ib, nb) in zip(full[len(full) // 2:], resumed):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(ia, ib)  # side data looked up by index matches after a resume too
        assert na == nb
    assert fresh.epoch == 2
    bad = dict(state, num_samples=44)
    with pytest.raises(ValueError, match="num_samples"):
        DataLoader(ds, 6, augment=aug).load_state_dict(bad)
    with pytest.raises(ValueError, match="rng"):
        DataLoader(ds, 6, augment=aug).load_state_dict(dict(state, epoch=0))
    with pytest.raises(ValueError, match="augment"):  # other augmentation: the rest of the run would differ
        DataLoader(ds, 6, augment=Augment(crop="pad", pad=3)).load_state_dict(state)
    with pytest.raises(ValueError, match="augment"):
        DataLoader(ds, 6).load_state_dict(state)


def test_break_restarts_the_same_epoch():
    ds = _indexed(30)
    loader = DataLoader(ds, 5, seed=2)
    first = next(iter(loader))[0]
    assert loader.epoch == 0
    np.testing.assert_array_equal(next(iter(loader))[0], first)


def test_flip_and_crops_are_what_they_claim():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (32, 12, 12, 3), dtype=np.uint8)
    out = augment_batch(x, Augment(crop=None), np.random.default_rng(1))
    flipped = [np.array_equal(o, xi[:, ::-1]) for o, xi in zip(out, x)]
    same = [np.array_equal(o, xi) for o, xi in zip(out, x)]
    assert all(f or s for f, s in zip(flipped, same)) and 5 < sum(flipped) < 27
    pad = augment_batch(x, Augment(hflip=False, crop="pad", pad=3), np.random.default_rng(2))
    for o, xi in zip(pad, x):  # the centre of a shifted image is a window of the original
        found = any(np.array_equal(o[3:9, 3:9], xi[3 + dy:9 + dy, 3 + dx:9 + dx])
                    for dy in range(-3, 4) for dx in range(-3, 4))
        assert found
    const = np.full((8, 10, 10, 3), 77, np.uint8)
    rc = augment_batch(const, Augment(scale=(0.3, 0.5)), np.random.default_rng(3))
    np.testing.assert_allclose(rc, 77.0)
    ramp = np.broadcast_to(np.arange(64, dtype=np.uint8)[None, None, :, None] * 4, (16, 64, 64, 3)).copy()
    rc = augment_batch(ramp, Augment(hflip=False, scale=(0.25, 0.25), ratio=(1, 1)), np.random.default_rng(4))
    spans = rc[:, :, -1, 0] - rc[:, :, 0, 0]
    np.testing.assert_allclose(spans, 0.5 * 63 * 4, rtol=0.05)  # half the width, stretched to full


def test_brightness_contrast_jitter_ranges():
    x = np.full((200, 4, 4, 3), 100.0, np.float32)
    out = normalize(x.copy(), np.zeros(3), np.ones(3), Augment(brightness=0.2, contrast=0.5),
                    np.random.default_rng(0)) * 255.0
    v = out[:, 0, 0, 0]
    assert v.min() >= 80 - 1e-3 and v.max() <= 120 + 1e-3 and v.std() > 5  # contrast is a no-op on flat


def test_prefetch_runs_in_background_and_is_bounded():
    class Slow(ArrayDataset):
        def __init__(self):
            super().__init__(np.zeros((40, 4, 4, 3), np.uint8), np.zeros(40, np.int64))
            self.calls, self.threads = 0, set()

        def get_batch(self, idx):
            self.calls += 1
            self.threads.add(threading.current_thread().name)
            time.sleep(0.01)
            return super().get_batch(idx)

    ds = Slow()
    it = iter(DataLoader(ds, 2, prefetch=3, num_threads=1))
    next(it)
    time.sleep(0.2)
    assert ds.calls <= 1 + 3, ds.calls
    assert all(name.startswith("leaflens-loader") for name in ds.threads)
    before = threading.active_count()
    it.close()
    assert threading.active_count() < before


def test_producer_errors_propagate():
    class Broken(ArrayDataset):
        def get_batch(self, idx):
            raise OSError("disk gone")

    ds = Broken(np.zeros((10, 4, 4, 3), np.uint8))
    with pytest.raises(OSError, match="disk gone"):
        list(DataLoader(ds, 2, num_threads=2))


def test_memmap_input_and_unlabelled(tmp_path):
    path = tmp_path / "imgs.npy"
    np.save(path, np.random.default_rng(0).integers(0, 256, (20, 8, 8, 3), dtype=np.uint8))
    mm = np.load(path, mmap_mode="r")
    xb, yb, idx, _ = next(iter(DataLoader(ArrayDataset(mm), 20, augment=Augment())))
    assert xb.shape == (20, 8, 8, 3) and np.all(yb == -1) and sorted(idx) == list(range(20))


def test_bad_arguments():
    with pytest.raises(ValueError):
        ArrayDataset(np.zeros((3, 4, 4, 3), np.float32))
    with pytest.raises(ValueError):
        ArrayDataset(np.zeros((3, 4, 4, 3), np.uint8), np.zeros(2, np.int64))
    with pytest.raises(ValueError):
        DataLoader(_indexed(), 0)
    with pytest.raises(ValueError):
        DataLoader(_indexed(), 4, std=(1, 0, 1))
    with pytest.raises(ValueError):
        Augment(crop="zoom")


def test_crops_cut_from_a_larger_stored_image_come_out_at_out_size():
    rng = np.random.default_rng(6)
    x = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    whole = Augment(hflip=False, scale=(1.0, 1.0), ratio=(1, 1), out_size=16, brightness=0, contrast=0)
    block_means = x.reshape(4, 16, 2, 16, 2, 3).astype(np.float64).mean(axis=(2, 4))
    np.testing.assert_allclose(augment_batch(x, whole, np.random.default_rng(0)), block_means, atol=1e-3)
    # a non-integer factor still averages: a fine checkerboard becomes flat grey, not stripes
    board = (np.indices((15, 15)).sum(0) % 2 * 255).astype(np.uint8)[None, :, :, None].repeat(3, -1)
    small = augment_batch(board, Augment(hflip=False, crop=None, out_size=6), np.random.default_rng(0))
    assert small.shape == (1, 6, 6, 3) and np.ptp(small) < 60 and abs(small.mean() - 127.5) < 15
    for crop in ("resized", "pad", None):
        out = augment_batch(x, Augment(crop=crop, out_size=16), np.random.default_rng(1))
        assert out.shape == (4, 16, 16, 3) and out.dtype == np.float32
    # a quarter-area crop of a ramp spans half the ramp, at the output size
    ramp = np.broadcast_to(np.arange(64, dtype=np.uint8)[None, None, :, None] * 4, (8, 64, 64, 3)).copy()
    rc = augment_batch(ramp, Augment(hflip=False, scale=(0.25, 0.25), ratio=(1, 1), out_size=16),
                       np.random.default_rng(4))
    assert rc.shape == (8, 16, 16, 3)
    np.testing.assert_allclose(rc[:, :, -1, 0] - rc[:, :, 0, 0], 0.5 * 64 * 4 * 15 / 16, rtol=0.05)
    with pytest.raises(ValueError, match="out_size"):
        Augment(out_size=0)


def test_zoomed_out_crops_show_the_photo_mirrored_around_it():
    from leaflens.engine.data import MAX_ZOOM_OUT, apply_view_boxes, sample_view_boxes
    x = np.random.default_rng(7).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    tiled = np.pad(x, ((0, 0), (5, 5), (7, 7), (0, 0)), mode="symmetric").astype(np.float32)
    # a box three times the photo, one photo above and left of it, sampled at the 5 x 7 grid: every third
    # pixel of the mirror tiling
    out = apply_view_boxes(x, np.array([[-1, -1, 3, 3, 0, 0]] * 2, np.float32))
    np.testing.assert_array_equal(out, tiled[:, 1::3, 1::3])
    # the random resized crop zooms out up to the largest area asked for: a 64-px ramp in a box twice its side
    # rises over half the output's columns and falls (mirrored) over the rest
    ramp = np.broadcast_to(np.arange(64, dtype=np.uint8)[None, None, :, None] * 4, (16, 64, 64, 3)).copy()
    z = augment_batch(ramp, Augment(hflip=False, scale=(4.0, 4.0), ratio=(1, 1), brightness=0, contrast=0),
                      np.random.default_rng(0))
    steps = np.diff(z[:, 32, :, 0], axis=1)
    assert np.all(np.abs(np.count_nonzero(steps > 0, axis=1) - 31) <= 1)
    assert np.all(np.count_nonzero(steps < 0, axis=1) >= 28)
    b = sample_view_boxes(50, 3, Augment(scale=(1.5, MAX_ZOOM_OUT), ratio=(1, 1)), np.random.default_rng(0))
    assert np.all(b[:, 0, :4] == [0, 0, 1, 1])  # view 0 is the plain photo
    side = b[:, 1:, 2]
    assert side.min() >= np.sqrt(1.5) - 1e-6 and side.max() <= 2 + 1e-6
    assert np.all(b[:, 1:, 0] <= 0) and np.all(b[:, 1:, 0] + side >= 1)  # the photo lies inside every box
    with pytest.raises(ValueError, match="scale"):
        Augment(scale=(0.5, MAX_ZOOM_OUT + 1))


@pytest.mark.parametrize("scale", [1.0, 2.0, 4.0])
def test_zoomed_out_crops_are_area_filtered_too(scale):
    """A box twice the photo's side holds twice the source pixels per output pixel: sampled as for the photo
    alone, a one-pixel checkerboard came out as moire (output spread 15.9 grey levels at 2x, 69.8 at 4x)."""
    from leaflens.engine.data import apply_view_boxes
    board = (np.indices((128, 128)).sum(0) % 2 * 255).astype(np.uint8)[None, :, :, None].repeat(3, -1)
    out = augment_batch(np.repeat(board, 4, 0), Augment(hflip=False, scale=(scale, scale), ratio=(1, 1),
                                                        brightness=0, contrast=0, out_size=64),
                        np.random.default_rng(0))
    # a whole number of source pixels per output pixel (1x, 4x) averages exactly; 2x (2.83 px) nearly, as any
    # box-sampled resize does (the photo's own 15 -> 6 px above)
    assert out.std() < (1.0 if scale != 2.0 else 6.0) and abs(out.mean() - 127.5) < 1.0
    side = np.sqrt(scale)
    boxes = np.array([[(1 - side) / 2, (1 - side) / 2, side, side, 0, 0]], np.float32)
    view = apply_view_boxes(board, boxes, out_size=64)
    assert view.std() < (1.0 if scale != 2.0 else 6.0)
