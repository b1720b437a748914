"""Distilled Lite0-trunk students that start from the fine-tuned teacher's blocks (``model.trunk_init``).

The teacher's network here is EfficientNet-Lite0's first blocks in their real shapes with random weights and
BatchNorm statistics; a PyTorch checkpoint of other random weights stands in for ImageNet's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import class_features, tiny_dataset, with_moved_bn_stats, write_lite0_shaped

from leaflens.data_prep.manifest import load_dataset, manifest_sha256
from leaflens.engine.checkpoint import read_checkpoint_arrays
from leaflens.pipeline.config import ConfigError, load_config
from leaflens.pipeline.distill import run_distill
from leaflens.pipeline.models import pretrained
from leaflens.pipeline.models.efficientnet import EfficientNetLite, LiteConfig, tf_input_affine
from leaflens.pipeline.models.trunk import LiteTrunkStudent, lite0_block_specs
from leaflens.pipeline.teachers import served
from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source, write_teacher

MEAN, STD = (0.45, 0.5, 0.4), (0.2, 0.25, 0.22)


def teacher_net(blocks: int = 3, classes: int = 3, config: LiteConfig | None = None) -> EfficientNetLite:
    """Lite0's first ``blocks`` blocks as a fine-tuned teacher would hold them: random weights and statistics."""
    net = EfficientNetLite(lite0_block_specs()[:blocks], num_classes=classes, stem_channels=32, head_channels=12,
                           config=config, rng=np.random.default_rng(7))
    return with_moved_bn_stats(net, seed=8)


def save_teacher_net(path: Path, net: EfficientNetLite, classes: tuple[str, ...], ds_dir: Path) -> Path:
    meta = served.TeacherModelMeta(architecture=net.architecture(), classes=classes, contract=None,
                                   teacher={"kind": "efficientnet-lite0", "input_size": 16, "normalization": "tf"},
                                   dataset_manifest_sha256=manifest_sha256(ds_dir), reason="test network")
    return served.save_teacher_model(path, net, meta)


def trunk_state(state: dict[str, np.ndarray], blocks: int) -> dict[str, np.ndarray]:
    return {k: v for k, v in state.items() if k.split(".")[0] in ("stem_conv", "stem_bn")
            or (k.startswith("blocks.") and int(k.split(".")[1]) < blocks)}


@pytest.fixture(scope="module")
def imagenet_stand_in(tmp_path_factory) -> Path:
    return write_lite0_shaped(tmp_path_factory.mktemp("lite0") / "lite0-shaped.pth")


def test_the_trunk_takes_the_teachers_stem_and_blocks_and_keeps_its_own_head(tmp_path):
    ds_dir = tiny_dataset(tmp_path, per_class=4, size=16)
    net = teacher_net(blocks=4)
    path = save_teacher_net(tmp_path / "model.npz", net, ("a", "b", "c"), ds_dir)
    model = LiteTrunkStudent(3, blocks=3, head=10, rng=np.random.default_rng(0))
    head_before = model.head_conv.weight.data.copy()
    assert model.load_teacher_trunk(path, MEAN, STD) == str(path)
    got, want = model.state_dict(), trunk_state(net.state_dict(), 3)
    assert want and set(want) <= set(got) and not any(k.startswith("blocks.3") for k in want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    np.testing.assert_array_equal(model.head_conv.weight.data, head_before)
    scale, shift = tf_input_affine(MEAN, STD)
    np.testing.assert_array_equal(model.input_scale, scale)
    np.testing.assert_array_equal(model.input_shift, shift)


def test_a_teacher_that_does_not_hold_the_trunks_blocks_is_refused_naming_the_file(tmp_path):
    ds_dir = tiny_dataset(tmp_path, per_class=4, size=16)
    short = save_teacher_net(tmp_path / "short.npz", teacher_net(blocks=2), ("a", "b", "c"), ds_dir)
    with pytest.raises(ValueError, match=r"short\.npz does not describe EfficientNet-Lite0's first 3 blocks"):
        LiteTrunkStudent(3, blocks=3, rng=np.random.default_rng(0)).load_teacher_trunk(short, MEAN, STD)
    other = save_teacher_net(tmp_path / "other.npz", teacher_net(config=LiteConfig(padding="symmetric")),
                             ("a", "b", "c"), ds_dir)
    with pytest.raises(ValueError, match=r"other\.npz: the teacher's network \(padding 'symmetric'"):
        LiteTrunkStudent(3, blocks=3, rng=np.random.default_rng(0)).load_teacher_trunk(other, MEAN, STD)


def test_the_setting_is_checked():
    assert load_config(None, ['model.trunk_init="teacher"']).model.trunk_init == "teacher"
    with pytest.raises(ConfigError, match="trunk_init: 'imagenett' is not one of 'imagenet', 'teacher'"):
        load_config(None, ['model.trunk_init="imagenett"'])


@pytest.fixture()
def run_setup(tmp_path, imagenet_stand_in, monkeypatch):
    real_find = pretrained.find_lite0_weights
    monkeypatch.setattr(pretrained, "find_lite0_weights", lambda path=None: real_find(path or imagenet_stand_in))
    ds_dir = tiny_dataset(tmp_path, per_class=10, size=16)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(class_features(ds_dir, tmp_path / "feats"), ds)
    write_teacher(tmp_path / "teacher", ds, ArrayEncoder(feats, logits, tmp_path / "feats", ds.image_size),
                  progress=False)
    return tmp_path, ds_dir, ds


def _cfg(trunk_init: str):
    # a learning rate too small to move a weight by 1e-6: the checkpoints hold the weights the students started from
    return load_config(None, ["train.epochs=1", "train.min_steps=0",
                              "train.batch_size=8", "train.warmup_epochs=0", "train.lr=1e-9",
                              'model.family=["lite3"]', f"model.trunk_init={json.dumps(trunk_init)}"])


def _stem(path: Path) -> np.ndarray:
    _, arrays = read_checkpoint_arrays(path)
    return arrays["model/stem_conv.weight"]


def test_the_distilled_student_starts_from_the_teacher_and_the_scratch_one_from_imagenet(run_setup,
                                                                                          imagenet_stand_in):
    tmp, ds_dir, ds = run_setup
    net = teacher_net(blocks=3, classes=ds.num_classes)
    save_teacher_net(tmp / "teacher" / served.MODEL_FILE, net, tuple(ds.classes), ds_dir)
    out = tmp / "run"
    report = run_distill(ds_dir, tmp / "teacher", out, _cfg("teacher"), progress=False)
    assert report["trunk_init"] == {"asked": "teacher", "used": "teacher",
                                    "file": str(tmp / "teacher" / served.MODEL_FILE)}
    np.testing.assert_allclose(_stem(out / "distilled" / "last.npz"), net.stem_conv.weight.data, atol=1e-6)
    imagenet = pretrained.load_efficientnet_lite0(imagenet_stand_in).stem_conv.weight.data
    np.testing.assert_allclose(_stem(out / "scratch" / "last.npz"), imagenet, atol=1e-6)
    assert not np.allclose(imagenet, net.stem_conv.weight.data, atol=1e-3)
    md = (out / "report.md").read_text()
    assert "the distilled ones' stem and blocks started from the fine-tuned teacher's" in md


def test_without_a_teacher_network_the_students_start_from_imagenet_and_say_why(run_setup, imagenet_stand_in,
                                                                                 capsys):
    tmp, ds_dir, _ = run_setup  # the teacher folder holds features only
    out = tmp / "run"
    report = run_distill(ds_dir, tmp / "teacher", out, _cfg("teacher"), progress=True)
    info = report["trunk_init"]
    assert info["asked"] == "teacher" and info["used"] == "imagenet" and "holds no teacher network" in info["why"]
    assert "the students start from ImageNet's Lite0 weights" in capsys.readouterr().err
    imagenet = pretrained.load_efficientnet_lite0(imagenet_stand_in).stem_conv.weight.data
    np.testing.assert_allclose(_stem(out / "distilled" / "last.npz"), imagenet, atol=1e-6)
    assert "not the teacher's as asked: " in (out / "report.md").read_text()


def test_imagenet_asked_is_imagenet_and_a_run_without_a_trunk_records_nothing(run_setup, imagenet_stand_in):
    tmp, ds_dir, ds = run_setup
    save_teacher_net(tmp / "teacher" / served.MODEL_FILE, teacher_net(classes=ds.num_classes), tuple(ds.classes),
                     ds_dir)
    report = run_distill(ds_dir, tmp / "teacher", tmp / "run", _cfg("imagenet"), progress=False)
    assert report["trunk_init"] == {"asked": "imagenet", "used": "imagenet"}
    imagenet = pretrained.load_efficientnet_lite0(imagenet_stand_in).stem_conv.weight.data
    np.testing.assert_allclose(_stem(tmp / "run" / "distilled" / "last.npz"), imagenet, atol=1e-6)
    cfg = load_config(None, ["train.epochs=1", "train.min_steps=0",
                             "train.batch_size=8", 'model.family=["s"]', "model.widths=[4, 8]",
                             'model.trunk_init="teacher"'])
    assert "trunk_init" not in run_distill(ds_dir, tmp / "teacher", tmp / "conv", cfg, progress=False)
