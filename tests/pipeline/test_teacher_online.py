"""The teacher in the student's training loop (``distill.teacher_online``): its views, its two backends, the
batch it gives the loss (mixed images judged as mixed), and a distill run that resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest
from pipeline_helpers import class_features, tiny_dataset, with_moved_bn_stats

from leaflens.data_prep.contract import normalize
from leaflens.data_prep.manifest import load_dataset, manifest_sha256
from leaflens.engine.data import Augment, Batch, apply_view_boxes
from leaflens.pipeline.config import load_config
from leaflens.pipeline.distill import run_distill
from leaflens.pipeline.models.efficientnet import BlockSpec, EfficientNetLite, normalize_images
from leaflens.pipeline.models.student import StudentSpec
from leaflens.pipeline.teachers import served
from leaflens.pipeline.teachers.online import OnlineTeacher, TeacherOnlineError, load_online_teacher, view_boxes
from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source, write_teacher
from leaflens.pipeline.train_student import TrainData, _host_batch, distill_loss, mixup_batch

MEAN = np.array([0.45, 0.5, 0.4], np.float32)
STD = np.array([0.2, 0.25, 0.22], np.float32)
AUG = Augment(hflip=True, vflip=True, crop="resized", scale=(0.5, 1.0))


def tiny_net(classes: int = 3, head: int = 12) -> EfficientNetLite:
    net = EfficientNetLite([BlockSpec(8, 8, 8, 3, 1), BlockSpec(8, 12, 24, 3, 2)], num_classes=classes,
                           stem_channels=8, head_channels=head, rng=np.random.default_rng(1))
    return with_moved_bn_stats(net)


def photos(n: int = 6, size: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3)).astype(np.uint8)


def test_view_boxes_are_seeded_per_batch_and_crop_inside_the_photo():
    a = view_boxes(32, AUG, seed=0, epoch=1, batch=2)
    np.testing.assert_array_equal(a, view_boxes(32, AUG, seed=0, epoch=1, batch=2))
    assert not np.array_equal(a, view_boxes(32, AUG, seed=0, epoch=1, batch=3))
    assert not np.array_equal(a, view_boxes(32, AUG, seed=0, epoch=2, batch=2))
    top, left, h, w = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 1 + 1e-6).all() and (left + w <= 1 + 1e-6).all()
    assert (h * w < 0.999).any()  # crops, not the plain photo


def test_teacher_views_undo_the_students_normalisation():
    """A plain box at the teacher's own size gives the teacher the photo's pixels, normalised its way."""
    x = photos()
    t = OnlineTeacher(tiny_net(), 16, "tf")
    plain = np.tile(np.array([[0, 0, 1, 1, 0, 0]], np.float32), (len(x), 1))
    got = t.teacher_views(normalize(x, MEAN, STD), MEAN, STD, plain)
    np.testing.assert_allclose(got, normalize_images(x, "tf"), atol=1e-4)
    # larger teacher input: the same region, upsampled (never beyond the pixel range)
    big = OnlineTeacher(tiny_net(), 24, "tf").teacher_views(normalize(x, MEAN, STD), MEAN, STD, plain)
    assert big.shape == (len(x), 24, 24, 3) and big.min() >= -127 / 128 - 1e-6 and big.max() <= 1.0 + 1e-6


def test_onnxruntime_and_the_engine_give_the_same_targets():
    pytest.importorskip("onnxruntime")
    x = normalize_images(photos(5), "tf")
    ort = OnlineTeacher(tiny_net(), 16, "tf", batch=2)
    assert ort.backend == "onnxruntime"
    eng = OnlineTeacher(tiny_net(), 16, "tf", batch=2)
    eng.session = None
    (fa, la), (fb, lb) = ort(x), eng(x)
    assert fa.shape == (5, 12) and la.shape == (5, 3)
    np.testing.assert_allclose(fa, fb, atol=1e-4)
    np.testing.assert_allclose(la, lb, atol=1e-4)


def test_a_batch_gets_the_targets_of_its_own_mixed_views():
    x = photos(8)
    xn = normalize(x, MEAN, STD)
    teacher = OnlineTeacher(tiny_net(), 16, "tf")
    teacher.session = None  # the engine: exact reference below
    data = TrainData(images=x, labels=np.arange(8) % 3, features=np.zeros((8, 12), np.float32),
                     logits=np.zeros((8, 3), np.float32), online=teacher)
    batch = Batch(xn, np.arange(8) % 3, np.arange(8), 4)
    got = _host_batch(data, batch, seed=7, epoch=2, size=8, mixup=0.4, mean=MEAN, std=STD, view_aug=AUG)
    boxes = view_boxes(8, AUG, 7, 2, 4)
    want_x, mix = mixup_batch(apply_view_boxes(xn, boxes, 8), 0.4, np.random.default_rng([7, 2, 4, 0x31]))
    assert mix is not None and got.targets_mixed
    np.testing.assert_array_equal(got.images, want_x)
    np.testing.assert_array_equal(got.mix_perm, mix.perm)
    tv = teacher.teacher_views(xn, MEAN, STD, boxes)
    want_f, want_l = teacher(tv * np.float32(mix.lam) + tv[mix.perm] * np.float32(1 - mix.lam))
    np.testing.assert_allclose(got.features, want_f, atol=1e-5)
    np.testing.assert_allclose(got.logits, want_l, atol=1e-5)
    # the same batch again (a resumed run): the same views and targets
    again = _host_batch(data, batch, seed=7, epoch=2, size=8, mixup=0.4, mean=MEAN, std=STD, view_aug=AUG)
    np.testing.assert_array_equal(again.images, got.images)
    np.testing.assert_array_equal(again.features, got.features)


def test_targets_already_mixed_are_not_mixed_again():
    cfg = load_config(None, ["model.family=[\"m\"]", "model.widths=[8, 16]"])
    model = StudentSpec.from_recipe(cfg.model, 3).build(np.random.default_rng(0), 12, None).eval()  # no dropout
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 8, 8, 3)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2])
    feats, logits = rng.standard_normal((6, 12)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32)
    _, mix = mixup_batch(x, 0.4, np.random.default_rng(1))
    plain = distill_loss(model, x, y, feats, logits, cfg.distill, 0.0, mix=None)[1]
    as_is = distill_loss(model, x, y, feats, logits, cfg.distill, 0.0, mix=mix, targets_mixed=True)[1]
    remixed = distill_loss(model, x, y, feats, logits, cfg.distill, 0.0, mix=mix)[1]
    assert float(as_is["feature"]) == pytest.approx(float(plain["feature"]), rel=1e-6)
    assert float(as_is["kd"]) == pytest.approx(float(plain["kd"]), rel=1e-6)
    assert float(remixed["feature"]) != pytest.approx(float(plain["feature"]), rel=1e-3)
    assert float(as_is["ce"]) == pytest.approx(float(remixed["ce"]), rel=1e-6)  # labels are mixed either way


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny dataset and a teacher folder whose network (model.npz) matches its cached targets' shapes."""
    tmp = tmp_path_factory.mktemp("online")
    ds_dir = tiny_dataset(tmp, per_class=14, size=16, unlabeled=6)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(class_features(ds_dir, tmp / "feats"), ds)
    write_teacher(tmp / "teacher", ds, ArrayEncoder(feats, logits, tmp / "feats", ds.image_size), progress=False)
    net = tiny_net(ds.num_classes)
    meta = served.TeacherModelMeta(architecture=net.architecture(), classes=tuple(ds.classes), contract=None,
                                   teacher={"kind": "efficientnet-lite0", "input_size": 16, "normalization": "tf"},
                                   dataset_manifest_sha256=manifest_sha256(ds_dir), reason="test network")
    served.save_teacher_model(tmp / "teacher" / served.MODEL_FILE, net, meta)
    return tmp, ds_dir


def _cfg(epochs: int = 3):
    return load_config(None, [f"train.epochs={epochs}", "train.min_steps=0", "train.batch_size=8", 'model.family=["m"]',
                              "model.widths=[8, 16]", "train.warmup_epochs=1", "distill.compare_scratch=false",
                              "distill.teacher_online=true", "distill.mixup=0.2"])


def test_a_teacher_without_a_network_is_refused_before_anything_trains(tiny, tmp_path):
    tmp, ds_dir = tiny
    with pytest.raises(TeacherOnlineError, match="inconsistent"):
        load_online_teacher(tmp / "teacher", 3, 99)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(tmp / "feats", ds)
    write_teacher(tmp_path / "t", ds, ArrayEncoder(feats, logits, tmp / "feats", ds.image_size), progress=False)
    with pytest.raises(TeacherOnlineError, match=r"model\.npz.*teacher_online = false"):
        run_distill(ds_dir, tmp_path / "t", tmp_path / "run", _cfg(), progress=False)
    assert not (tmp_path / "run").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # no run.partial left behind either


def test_distill_with_the_teacher_online_resumes_exactly(tiny, monkeypatch):
    tmp, ds_dir = tiny
    cfg = _cfg()
    full = run_distill(ds_dir, tmp / "teacher", tmp / "full", cfg, progress=False)
    assert set(full["variants"]) == {"distilled"}
    online = full["teacher_online"]
    assert online["input_size"] == 16 and online["stored_size"] == 16
    assert 0 <= online["val_accuracy_at_stored_pixels"] <= 1
    assert "Teacher in the training loop" in (tmp / "full" / "report.md").read_text()

    import leaflens.pipeline.training as training

    calls = {"n": 0}
    real = training.save_checkpoint

    def dying_save(path, *a, **k):
        real(path, *a, **k)
        if path.name == "last.npz":
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt("simulated crash after epoch 2")

    monkeypatch.setattr(training, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run_distill(ds_dir, tmp / "teacher", tmp / "cut", cfg, progress=False)
    monkeypatch.setattr(training, "save_checkpoint", real)
    resumed = run_distill(ds_dir, tmp / "teacher", tmp / "cut", cfg, resume=True, progress=False)
    assert resumed["test_accuracy"] == full["test_accuracy"]
    a, b = np.load(tmp / "full" / "best.npz"), np.load(tmp / "cut" / "best.npz")
    for k in a.files:
        if k != "meta":
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_online_targets_differ_from_the_cached_ones(tiny):
    """The run really learns from the network: its feature loss is not the cached targets' loss."""
    tmp, ds_dir = tiny
    online = run_distill(ds_dir, tmp / "teacher", tmp / "on", _cfg(1), progress=False)
    cached_cfg = load_config(None, ["train.epochs=1", "train.min_steps=0", "train.batch_size=8", 'model.family=["m"]',
                                    "model.widths=[8, 16]", "train.warmup_epochs=1", "distill.compare_scratch=false",
                                    "distill.mixup=0.2"])
    cached = run_distill(ds_dir, tmp / "teacher", tmp / "off", cached_cfg, progress=False)
    import json

    def first_feature(run):
        return json.loads((run / "distilled" / "metrics.jsonl").read_text().splitlines()[0])["train_feature"]

    assert online["variants"]["distilled"] and cached["variants"]["distilled"]
    assert first_feature(tmp / "on") != pytest.approx(first_feature(tmp / "off"), rel=1e-3)


@pytest.mark.gpu
def test_on_a_gpu_the_teacher_runs_in_the_engine_there_with_the_cpu_answers():
    x = normalize_images(photos(5), "tf")
    gpu = OnlineTeacher(tiny_net(), 16, "tf", device="cuda", batch=2)
    assert gpu.backend == "engine on cuda" and gpu.session is None
    cpu = OnlineTeacher(tiny_net(), 16, "tf", batch=2)
    cpu.session = None
    (fa, la), (fb, lb) = gpu(x), cpu(x)
    assert isinstance(fa, np.ndarray) and isinstance(la, np.ndarray)  # targets come back to the host
    np.testing.assert_allclose(fa, fb, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(la, lb, rtol=1e-3, atol=1e-4)
