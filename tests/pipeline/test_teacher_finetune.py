"""The EfficientNet teacher's fine-tune on fresh random-resized crops (pipeline/teachers/finetune.py), on a tiny
random EfficientNet-Lite and a tiny synthetic dataset (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import tiny_dataset, with_moved_bn_stats

from leaflens.data_prep.manifest import load_dataset
from leaflens.engine import Tensor, ops
from leaflens.engine.nn import BatchNorm2d
from leaflens.pipeline.config import ConfigError, load_config
from leaflens.pipeline.models.efficientnet import BlockSpec, EfficientNetLite, LiteConfig
from leaflens.pipeline.teachers import effnet
from leaflens.pipeline.teachers.finetune import FreshViewTask, epochs_for
from leaflens.pipeline.teachers.stage import TeacherChoice, TeacherStageError, run_teacher_stage
from leaflens.pipeline.training import LoopSettings, run_training

SIZE = 32


def tiny_net(config: LiteConfig | None = None) -> EfficientNetLite:
    """Four blocks, 24 channels at most; BatchNorm running statistics away from (0, 1) so that freezing them
    is visible."""
    specs = [BlockSpec(8, 8, 8, 3, 1), BlockSpec(8, 12, 24, 3, 2), BlockSpec(12, 12, 24, 3, 1),
             BlockSpec(12, 16, 24, 3, 2)]
    net = EfficientNetLite(specs, num_classes=10, stem_channels=8, head_channels=24,
                           config=config or LiteConfig(), rng=np.random.default_rng(1))
    return with_moved_bn_stats(net)


def recipe(*overrides: str):
    return load_config(None, [f"teacher.input_size={SIZE}", "teacher.batch_size=8", "teacher.epochs=2",
                             "teacher.min_steps=0", *overrides]).teacher


def make_task(ds, teacher, k: int = 1) -> tuple[FreshViewTask, EfficientNetLite]:
    net = tiny_net(LiteConfig(dropout=teacher.dropout))
    net.reset_classifier(ds.num_classes, np.random.default_rng(teacher.seed))
    front_module, back = net.split(k)
    front = effnet.FrontRunner(front_module.eval(), teacher.input_size)
    return FreshViewTask(front, back, ds, teacher, "tf", False, effnet.shorter_side(teacher.input_size)), net


def test_every_epoch_shows_each_photo_as_a_new_crop(tmp_path):
    ds = load_dataset(tiny_dataset(tmp_path, per_class=8, size=16))
    task, _ = make_task(ds, recipe())
    seen: list[dict[int, np.ndarray]] = []
    for epoch in range(2):
        rows: dict[int, np.ndarray] = {}
        for batch in task.batches(epoch):
            assert batch.inputs.shape[1:] == task.front(np.zeros((1, SIZE, SIZE, 3), np.float32)).shape[1:]
            rows.update({int(i): x for i, x in zip(batch.indices, batch.inputs)})
        seen.append(rows)
    common = sorted(set(seen[0]) & set(seen[1]))
    assert len(common) >= 4
    # the front is deterministic, so a different output means a different view of the same photo
    assert all(not np.allclose(seen[0][r], seen[1][r]) for r in common)
    # and the photos are decoded again from the originals at twice the input, not the 16 px arrays
    assert task.photos.paths is not None and task.photos.photos(np.array([0])).shape == (1, 2 * SIZE, 2 * SIZE, 3)


@pytest.mark.parametrize("freeze", [True, False])
def test_batchnorm_statistics_stay_frozen_when_configured(tmp_path, freeze):
    ds = load_dataset(tiny_dataset(tmp_path, per_class=8, size=16))
    task, net = make_task(ds, recipe(f"teacher.freeze_bn={str(freeze).lower()}", "teacher.epochs=1"), k=1)
    stats = {k: v.copy() for k, v in net.state_dict().items() if "running" in k}
    weights = {k: v.copy() for k, v in net.state_dict().items() if k.endswith("bn1.weight")}
    run_training(tmp_path / "run", task, LoopSettings(epochs=1, clip_grad_norm=5.0, max_bad_steps=3, progress=False),
                 {})
    after = net.state_dict()
    trained = [k for k in stats if not k.startswith(("stem", "blocks.0."))]  # block 0 is in the frozen front
    assert trained
    changed = [k for k in trained if not np.array_equal(stats[k], after[k])]
    assert changed == ([] if freeze else trained)
    # the front's statistics never move, and the BatchNorm scales of the trained blocks learn either way
    assert all(np.array_equal(stats[k], after[k]) for k in stats if k.startswith(("stem", "blocks.0.")))
    assert any(not np.array_equal(weights[k], after[k]) for k in weights if not k.startswith("blocks.0."))


def test_frozen_batchnorm_uses_running_statistics_in_training_mode():
    bn = BatchNorm2d(3)
    bn.running_mean[...] = [1.0, -2.0, 0.5]
    bn.running_var[...] = [4.0, 0.25, 1.0]
    x = Tensor(np.random.default_rng(0).normal(0, 3, (4, 5, 5, 3)).astype(np.float32), requires_grad=True)
    bn.frozen = True
    y = bn.train()(x)
    expect = (x.numpy() - bn.running_mean) / np.sqrt(bn.running_var + bn.eps)
    np.testing.assert_allclose(y.numpy(), expect, rtol=1e-5, atol=1e-5)
    ops.sum(y * y).backward()
    assert bn.weight.grad is not None and np.abs(bn.weight.grad).sum() > 0 and x.grad is not None
    np.testing.assert_array_equal(bn.running_mean, [1.0, -2.0, 0.5])
    bn.frozen = False
    bn(x)
    assert not np.allclose(bn.running_mean, [1.0, -2.0, 0.5])


def test_pretrained_layers_and_new_head_get_their_own_learning_rates(tmp_path):
    ds = load_dataset(tiny_dataset(tmp_path, per_class=8, size=16))
    teacher = recipe("teacher.lr=0.0002", "teacher.head_lr=0.004", "teacher.warmup_epochs=0")
    task, net = make_task(ds, teacher)
    body, head = task.optimizer.param_groups
    assert {id(p) for p in head["params"]} == {id(p) for p in net.fc.parameters()}
    assert {id(p) for p in body["params"]} | {id(p) for p in head["params"]} == {id(p) for p in task.model.parameters()}
    assert body["lr"] == pytest.approx(0.0002) and head["lr"] == pytest.approx(0.004)
    for _ in range(3):
        task.scheduler.step()
    assert head["lr"] / body["lr"] == pytest.approx(20.0)  # the cosine scales both alike


def test_stage_records_the_recipe_in_teacher_json(tmp_path, tiny_lite0):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    cfg = load_config(None, [f"teacher.input_size={SIZE}", "teacher.batch_size=8", "teacher.epochs=2",
                             "teacher.min_steps=0",
                             "teacher.finetune_from_block=0", "teacher.rrc_scale=[0.3, 0.9]", "teacher.dropout=0.1"])
    summary = run_teacher_stage(ds_dir, tmp_path / "t", cfg, TeacherChoice(), progress=False)
    info = json.loads(Path(tmp_path / "t" / "teacher.json").read_text())
    rec = info["stage"]["recipe"]
    assert rec["augment"] == "rrc" and rec["rrc_scale"] == [0.3, 0.9] and rec["freeze_bn"] is True
    assert rec["dropout"] == 0.1 and rec["finetune_from_block"] == 0 and rec["epochs"] == 2
    assert rec["lr"] == cfg.teacher.lr and rec["head_lr"] == cfg.teacher.head_lr
    assert len(info["stage"]["fine_tune_history"]) == 2 and 1 <= info["stage"]["fine_tune_best_epoch"] <= 2
    assert info["teacher"]["fine_tuned"] and info["teacher"]["split_block"] == 0
    assert 0.0 <= summary["test_acc"] <= 1.0
    ds = load_dataset(ds_dir)
    logits = np.load(tmp_path / "t" / "logits_test.npy")
    assert logits.shape == (len(ds["test"]), ds.num_classes) and np.isfinite(logits).all()


def test_teacher_ema_reaches_the_fine_tune_loop_and_is_recorded(tmp_path, tiny_lite0, monkeypatch):
    seen: list[float] = []
    real = effnet.run_training

    def spy(work_dir, task, settings, *args, **kwargs):
        seen.append(settings.ema_decay)
        return real(work_dir, task, settings, *args, **kwargs)

    monkeypatch.setattr(effnet, "run_training", spy)
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    cfg = load_config(None, [f"teacher.input_size={SIZE}", "teacher.batch_size=8", "teacher.epochs=1",
                             "teacher.min_steps=0",
                             "teacher.ema=0.9"])
    run_teacher_stage(ds_dir, tmp_path / "t", cfg, TeacherChoice(), progress=False)
    assert seen == [0.9]
    assert json.loads(Path(tmp_path / "t" / "teacher.json").read_text())["stage"]["recipe"]["ema"] == 0.9
    assert load_config(None, []).teacher.ema == 0.99  # the default recipe's, chosen on validation (README)


def test_few_labelled_photos_raise_the_epochs_to_the_fewest_steps():
    teacher = load_config(None, ["teacher.epochs=8", "teacher.batch_size=16", "teacher.min_steps=128"]).teacher
    assert epochs_for(teacher, 42) == 64  # 2 steps an epoch
    assert epochs_for(teacher, 5) == 128  # fewer photos than a batch: one step an epoch
    assert epochs_for(teacher, 100) == 22  # 6 steps an epoch: ceil(128 / 6)
    assert epochs_for(teacher, 256) == 8 and epochs_for(teacher, 1034) == 8  # enough steps: as given
    unraised = load_config(None, ["teacher.epochs=8", "teacher.batch_size=16", "teacher.min_steps=0"]).teacher
    assert epochs_for(unraised, 42) == 8
    assert load_config(None, []).teacher.min_steps == 128  # the default recipe's (README)
    with pytest.raises(ConfigError, match="min_steps"):
        load_config(None, ["teacher.min_steps=-1"])


@pytest.mark.parametrize("augment", ["rrc", "cached"])
def test_the_stage_raises_the_epochs_says_so_and_records_it(tmp_path, tiny_lite0, capsys, augment):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    steps = max(len(load_dataset(ds_dir)["train"]) // 8, 1)
    cfg = load_config(None, [f"teacher.input_size={SIZE}", "teacher.batch_size=8", "teacher.epochs=1",
                             f"teacher.min_steps={3 * steps}", f"teacher.augment=\"{augment}\"",
                             "teacher.finetune_from_block=2", "teacher.self_train=false"])
    run_teacher_stage(ds_dir, tmp_path / "t", cfg, TeacherChoice(), progress=False)
    stage = json.loads(Path(tmp_path / "t" / "teacher.json").read_text())["stage"]
    assert stage["recipe"]["epochs"] == 3 and stage["epochs_raised_from"] == 1
    assert len(stage["fine_tune_history"]) == 3
    assert "the fine-tune runs 3 epochs instead of 1" in capsys.readouterr().err


def test_cached_mode_still_available(tmp_path, tiny_lite0):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    cfg = load_config(None, [f"teacher.input_size={SIZE}", "teacher.batch_size=8", "teacher.epochs=1",
                             "teacher.min_steps=0",
                             "teacher.augment=\"cached\"", "teacher.finetune_from_block=2"])
    run_teacher_stage(ds_dir, tmp_path / "t", cfg, TeacherChoice(), progress=False)
    info = json.loads(Path(tmp_path / "t" / "teacher.json").read_text())
    assert info["stage"]["recipe"]["augment"] == "cached" and info["stage"]["front_seconds"] >= 0


@pytest.mark.parametrize(("override", "message"), [
    ("teacher.augment=\"crops\"", "augment"),
    ("teacher.rrc_scale=[0.0, 1.0]", "rrc_scale"),
    ("teacher.rrc_scale=[0.8, 0.5]", "rrc_scale"),
    ("teacher.dropout=1.0", "dropout"),
    ("teacher.finetune_from_block=-1", "finetune_from_block"),
    ("teacher.freeze_bn=\"yes\"", "freeze_bn"),
    ("teacher.ema=1.0", "ema must be in"),
    ("train.ema=-0.1", "ema must be in"),
])
def test_teacher_recipe_keys_are_checked(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [override])
    assert "--set" in str(err.value)


def test_cut_point_beyond_the_network_is_refused(tmp_path, tiny_lite0):
    ds = load_dataset(tiny_dataset(tmp_path, per_class=6, size=16))
    with pytest.raises(TeacherStageError, match="finetune_from_block = 9.*4 blocks"):
        effnet.build_effnet_teacher(ds, recipe("teacher.finetune_from_block=9"), progress=False)
