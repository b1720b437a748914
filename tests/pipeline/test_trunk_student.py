"""The pretrained student (pipeline/models/trunk.py): the first blocks of EfficientNet-Lite0 with a small head,
as a family member (``liteN``) that trains, distils, exports and serves like the others. Random weights in
Lite0's real shapes, written as a PyTorch checkpoint, stand in for the ImageNet ones (no torch, no shared data)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import class_features, tiny_dataset, write_lite0_shaped

from leaflens.data_prep.manifest import load_dataset
from leaflens.engine import Tensor, no_grad
from leaflens.extras import install_command
from leaflens.pipeline import doctor
from leaflens.pipeline.config import ConfigError, load_config
from leaflens.pipeline.models import pretrained
from leaflens.pipeline.models.family import members
from leaflens.pipeline.models.student import StudentSpec
from leaflens.pipeline.models.trunk import LiteTrunkStudent, lite0_block_specs

MEAN, STD = (0.45, 0.5, 0.4), (0.2, 0.25, 0.22)


@pytest.fixture(scope="module")
def lite0_shaped(tmp_path_factory) -> Path:
    """A legacy-format .pth in EfficientNet-Lite0's real block shapes (a small head), random weights."""
    return write_lite0_shaped(tmp_path_factory.mktemp("lite0") / "lite0-shaped.pth")


def test_the_block_table_is_lite0s():
    try:
        real = pretrained.find_lite0_weights()
    except pretrained.WeightsNotFoundError:
        pytest.skip("the EfficientNet-Lite0 weights are not installed (leaflens[teacher])")
    assert pretrained.load_efficientnet_lite0(real).specs == lite0_block_specs()
    assert len(lite0_block_specs()) == 16 and lite0_block_specs()[7].cout == 80


def test_the_trunk_computes_lite0s_blocks_on_the_pipelines_input(lite0_shaped):
    """The input affine makes the trunk, fed (pixel/255 - mean)/std, give exactly what Lite0's first blocks give
    fed (pixel - 127)/128 (padding included), and only the trunk's weights come from the file."""
    model = LiteTrunkStudent(3, blocks=5, head=24, rng=np.random.default_rng(0))
    head_before = model.head_conv.weight.data.copy()
    assert model.load_pretrained(MEAN, STD, weights=lite0_shaped) == str(lite0_shaped)
    np.testing.assert_array_equal(model.head_conv.weight.data, head_before)
    net = pretrained.load_efficientnet_lite0(lite0_shaped)
    model.eval()
    pixels = np.random.default_rng(1).uniform(0, 255, (2, 24, 24, 3)).astype(np.float32)
    x = ((pixels / 255 - np.array(MEAN)) / np.array(STD)).astype(np.float32)
    with no_grad():
        got = model._trunk(Tensor(x)).numpy()
        want = net.run_blocks(net.stem(Tensor(((pixels - 127) / 128).astype(np.float32))), 0, 5).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    logits, maps = model.forward_blocks(Tensor(x))
    assert logits.shape == (2, 3) and len(maps) == 4  # the stem, and the ends of stages 1-3 (blocks 0, 2, 4)
    assert model.embed_dim == 24


def test_liteN_members_and_their_checkpoint_record():
    cfg = load_config(None, ['model.family=["lite8@128", "lite5", "m"]'])
    got = {m.name: (m.model.block, m.model.trunk_blocks, m.model.input_size) for m in members(cfg.model)}
    assert got == {"lite8@128": ("lite0", 8, 128), "lite5": ("lite0", 5, 64), "m": ("conv", 8, 64)}
    lite = next(m for m in members(cfg.model) if m.name == "lite8@128")
    assert lite.describe() == "ImageNet Lite0 blocks 0-7 + 256-wide head, 128 px"
    spec = StudentSpec.from_recipe(lite.model, 12)
    assert (spec.kind, spec.trunk_blocks, spec.widths) == ("lite0_trunk", 8, (256,))
    assert StudentSpec.from_dict(json.loads(json.dumps(spec.to_dict())), "best.npz") == spec
    net = spec.build(np.random.default_rng(0))  # no normalisation given: random weights, for a checkpoint to fill
    assert isinstance(net, LiteTrunkStudent) and net.num_parameters() < 300_000  # smaller than the m student
    for bad in ("lite0", "lite17", "lite8-ds", "lite@96", "lite8@4"):
        with pytest.raises(ConfigError, match="unknown member"):
            load_config(None, [f"model.family={json.dumps([bad])}"])
    with pytest.raises(ValueError, match="trunk_blocks goes with kind"):
        StudentSpec(num_classes=3, widths=(8,), kind="lite0_trunk")


def test_the_doctor_sizes_a_lite_member():
    spec = doctor.ModelSpec(widths=(32,), num_classes=3, block="lite0", trunk_blocks=3)
    est = doctor.cpu_batch_estimate(spec, 16)
    assert "unavailable" not in est and est["per_image_bytes"] > 0
    assert "Lite0 trunk of 3 blocks" in spec.describe()


def test_a_lite_member_distils_exports_and_serves(tmp_path, lite0_shaped, monkeypatch):
    """Distilled from teacher features with the pretrained weights loaded, kept, exported with its out-of-domain
    score (its own fine-tuned blocks and the frozen generic branch), served by onnxruntime as the engine computes it."""
    pytest.importorskip("onnxruntime")
    from leaflens.apps.predictor import Predictor  # noqa: PLC0415
    from leaflens.pipeline.distill import run_distill  # noqa: PLC0415
    from leaflens.pipeline.export.stage import ExportOptions, export_run  # noqa: PLC0415
    from leaflens.pipeline.runs import load_model  # noqa: PLC0415
    from leaflens.pipeline.teachers.stage import ArrayEncoder, read_features_source, write_teacher  # noqa: PLC0415
    from leaflens.pipeline.train_student import predict_logits  # noqa: PLC0415

    real_find = pretrained.find_lite0_weights
    monkeypatch.setattr(pretrained, "find_lite0_weights", lambda path=None: real_find(path or lite0_shaped))
    ds_dir = tiny_dataset(tmp_path, per_class=14, size=16, unlabeled=6)
    ds = load_dataset(ds_dir)
    feats, logits = read_features_source(class_features(ds_dir, tmp_path / "feats"), ds)
    write_teacher(tmp_path / "teacher", ds, ArrayEncoder(feats, logits, tmp_path / "feats", ds.image_size),
                  progress=False)
    cfg = load_config(None, ["train.epochs=2", "train.min_steps=0",
                             "train.batch_size=8", "model.widths=[8, 16]", "train.warmup_epochs=1",
                             'model.family=["lite3"]', "distill.teacher_margin=1.0"])
    out = tmp_path / "run"
    report = run_distill(ds_dir, tmp_path / "teacher", out, cfg, progress=False)
    assert report["winner"] in ("distilled", "scratch") and set(report["variants"]) == {"distilled", "scratch"}
    model, info = load_model(out)
    assert isinstance(model, LiteTrunkStudent) and info.model_config.trunk_blocks == 3
    # the trained weights differ from the file's (it trained), and the input affine was set from the dataset
    np.testing.assert_allclose(model.input_scale, 255 * np.asarray(ds.std) / 128, rtol=1e-6)
    export_run(ExportOptions(run=out, out=tmp_path / "export", dataset=ds_dir, speed_seconds=0.05, threads=1),
               log=lambda s: None)
    parity = json.loads((tmp_path / "export" / "parity.json").read_text())
    assert parity["passed"] and not parity["failures"] and parity["int8"]["written"]  # INT8 too (tiny, random)
    pred = Predictor(tmp_path / "export" / "student.onnx", intra_op_threads=1)
    assert pred.card.ood is not None and pred.card.ood.method == "block-mahalanobis-2"
    assert pred.card.ood.branch is not None and pred.card.params == model.num_parameters()
    images = np.asarray(ds["test"].images)
    want = predict_logits(model, images, ds.mean, ds.std, size=info.dataset.input_size)
    np.testing.assert_allclose(pred.logits_arrays(images), want, atol=1e-4)


def test_a_lite_member_without_the_weights_is_refused_before_training(tmp_path, monkeypatch):
    from leaflens.pipeline.distill import run_distill  # noqa: PLC0415

    def missing(path=None):
        raise pretrained.WeightsNotFoundError("not installed")

    monkeypatch.setattr(pretrained, "find_lite0_weights", missing)
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    cfg = load_config(None, ["train.epochs=1", "train.min_steps=0", 'model.family=["m", "lite4"]'])
    with pytest.raises(ValueError, match="member 'lite4' starts from ImageNet EfficientNet-Lite0's weights, which "
                                         f"are not installed: {re.escape(install_command('teacher'))}"):
        run_distill(ds_dir, None, tmp_path / "run", cfg, no_teacher=True, progress=False)
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("run*/*/best.npz"))


def test_without_the_weights_the_default_family_trains_the_m_student(tmp_path, monkeypatch, capsys):
    from leaflens.pipeline.distill import run_distill  # noqa: PLC0415

    def missing(path=None):
        raise pretrained.WeightsNotFoundError("not installed")

    monkeypatch.setattr(pretrained, "find_lite0_weights", missing)
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    cfg = load_config(None, ["train.epochs=1", "train.min_steps=0", "model.widths=[4, 8]", "train.batch_size=8"])
    assert cfg.model.family == ("lite8",)  # the default
    report = run_distill(ds_dir, None, tmp_path / "run", cfg, no_teacher=True, progress=False)
    assert "the default student 'lite8' starts from ImageNet EfficientNet-Lite0's weights" in capsys.readouterr().err
    assert report["winner"] == "scratch" and report["config"]["model"]["family"] == ["m"]
    assert 'family = ["m"]' in (tmp_path / "run" / "config.toml").read_text()


def test_the_default_member_asked_for_by_name_without_the_weights_is_refused(tmp_path, monkeypatch, capsys):
    """`--family lite8` (the default's own member, named) trained the 'm' student instead with a warning, as if
    nothing had been asked for; the README says a family asked for with a liteN in it is refused."""
    from leaflens.pipeline.cli import main  # noqa: PLC0415

    def missing(path=None):
        raise pretrained.WeightsNotFoundError("not installed")

    monkeypatch.setattr(pretrained, "find_lite0_weights", missing)
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    base = ["distill", "--dataset", str(ds_dir), "--no-teacher", "--out", str(tmp_path / "run"), "--epochs", "1",
            "--quiet"]
    for asked in (["--family", "lite8"], ["--set", 'model.family=["lite8"]']):
        assert main([*base, *asked]) != 0
        err = capsys.readouterr().err
        assert "member 'lite8' starts from ImageNet EfficientNet-Lite0's weights, which are not installed" in err
        assert "instead" not in err and not (tmp_path / "run").exists()


def test_a_lite_escalation_without_the_weights_is_refused_before_training(tmp_path, monkeypatch):
    from leaflens.pipeline.distill import run_distill  # noqa: PLC0415

    def missing(path=None):
        raise pretrained.WeightsNotFoundError("not installed")

    monkeypatch.setattr(pretrained, "find_lite0_weights", missing)
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    cfg = load_config(None, ["train.epochs=1", "train.min_steps=0", 'model.family=["m"]', 'model.escalate=["lite12"]'])
    with pytest.raises(ValueError, match=r"model.escalate member 'lite12' starts from ImageNet EfficientNet-Lite0's "
                                         f"weights, which are not installed: {re.escape(install_command('teacher'))} "
                                         r"\(or leave it out of model.escalate\)"):
        run_distill(ds_dir, None, tmp_path / "run", cfg, no_teacher=True, progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("freeze", [True, False])
def test_train_freeze_bn_keeps_the_pretrained_statistics_and_trains_the_heads(tmp_path, lite0_shaped, monkeypatch,
                                                                             freeze):
    """``train.freeze_bn``: after training, the stem's and blocks' BatchNorm running statistics are still the
    pretrained file's and the new head's have moved; without it all of them move. The weights train either way."""
    import leaflens.pipeline.train_student as ts  # noqa: PLC0415

    real_find = pretrained.find_lite0_weights
    monkeypatch.setattr(pretrained, "find_lite0_weights", lambda path=None: real_find(path or lite0_shaped))
    cfg = load_config(None, ["train.epochs=1", "train.min_steps=0",
                             "train.batch_size=8", "train.warmup_epochs=0", "train.device=cpu",
                             "train.mixed_precision=off", 'model.family=["lite3"]', "model.block=\"lite0\"",
                             "model.trunk_blocks=3", "model.widths=[16]", "model.input_size=16",
                             f"train.freeze_bn={str(freeze).lower()}"])
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (24, 16, 16, 3), dtype=np.uint8)
    labels = np.arange(24) % 3
    mean, std = np.asarray(MEAN, np.float32), np.asarray(STD, np.float32)
    task, settings, device = ts.student_run(cfg, ts.TrainData(images, labels), images[:6], labels[:6], mean, std,
                                            3, progress=False)
    before = {k: v.copy() for k, v in task.model.state_dict().items()}
    ts.run_training(tmp_path / "run", task, settings, {}, device=device)
    after = task.model.state_dict()
    trunk_stats = [k for k in after if k.startswith(("stem_bn.", "blocks.")) and k.endswith(("running_mean",
                                                                                              "running_var"))]
    head_stats = [k for k in after if k.startswith("head_bn.") and k.endswith(("running_mean", "running_var"))]
    assert trunk_stats and head_stats
    moved = {k for k in trunk_stats + head_stats if not np.array_equal(before[k], after[k])}
    assert set(head_stats) <= moved
    assert moved.isdisjoint(trunk_stats) if freeze else set(trunk_stats) <= moved
    assert not np.array_equal(before["stem_conv.weight"], after["stem_conv.weight"])  # the trunk still learns
