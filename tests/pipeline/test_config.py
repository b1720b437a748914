"""The stage config: typed sections built from the documented default TOML, user TOML, then --set."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from pipeline_helpers import tiny_dataset

from leaflens.data_prep.manifest import load_dataset
from leaflens.pipeline.cli import main as cli
from leaflens.pipeline.config import (
    DEFAULT_CONFIG,
    ConfigError,
    StageConfig,
    TeacherSection,
    dump_toml,
    load_config,
    read_toml,
)
from leaflens.pipeline.teachers.artefact import load_teacher
from leaflens.records import RecordError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# What `leaflens distill` saved as config.toml before the [teacher] section existed (dump_toml of the
# dict config): a run's recipe must stay usable as --config.
PREVIOUS_CONFIG_TOML = """\
[model]
widths = [32, 64, 128]
dropout = 0.1
input_size = 64

[train]
epochs = 12
batch_size = 32
optimizer = "adamw"
lr = 0.003
weight_decay = 0.0005
warmup_epochs = 1
clip_grad_norm = 5.0
label_smoothing = 0.0
early_stopping_patience = 0
seed = 0
max_bad_steps = 10
eval_batch_size = 256
device = "auto"
mixed_precision = "auto"

[augment]
hflip = true
vflip = true
crop = "resized"
scale = [0.5, 1.0]
brightness = 0.2
contrast = 0.2

[distill]
feature_weight = 1.0
alpha = 0.3
kd_weight = 1.0
temperature = 4.0
same_view = true
compare_scratch = true
"""


def test_the_default_file_is_the_typed_default_and_complete():
    cfg = load_config()
    assert cfg == StageConfig.from_dict(read_toml(DEFAULT_CONFIG))
    assert cfg.model.widths == (32, 64, 128, 256) and cfg.train.optimizer == "adamw"
    assert isinstance(cfg.train.lr, float) and isinstance(cfg.augment.scale, tuple)
    assert cfg.teacher.augment == "rrc" and isinstance(cfg.teacher.rrc_scale, tuple) and cfg.teacher.freeze_bn
    # every setting must be in the file: the records have no defaults to fall back on
    data = read_toml(DEFAULT_CONFIG)
    del data["teacher"]["head_lr"]
    with pytest.raises(RecordError, match="teacher: required key 'head_lr' is missing"):
        StageConfig.from_dict(data)


def test_round_trip_through_the_saved_toml():
    cfg = load_config(None, ["model.widths=[8, 16]", "train.lr=0.01", "teacher.view_scale=[0.25, 1]"])
    again = StageConfig.from_dict(tomllib.loads(dump_toml(cfg)))
    assert again == cfg and again.teacher.view_scale == (0.25, 1.0)


def test_layers_user_file_then_overrides(tmp_path):
    user = tmp_path / "mine.toml"
    user.write_text('[train]\nepochs = 5\nlr = 1\n[teacher]\nepochs = 2\n')
    cfg = load_config(user, ["train.epochs=7", "teacher.frozen=true"])
    assert cfg.train.epochs == 7 and cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.teacher.epochs == 2 and cfg.teacher.frozen
    assert cfg.model == load_config().model  # untouched sections keep the defaults


@pytest.mark.parametrize("overrides, message", [
    (["train.epoch=3"], "--set train.epoch=3: unknown key 'train.epoch'"),
    (["trian.lr=1"], "--set trian.lr=1: unknown key 'trian'"),
    (["teacher.epoch=3"], "unknown key 'teacher.epoch' (did you mean 'teacher.epochs'?"),
    (["trian.lr=1"], "unknown key 'trian' (did you mean 'train'?"),
    (["teacher.zzz=1"], "unknown key 'teacher.zzz' (known: teacher.frozen"),  # nothing close: the list alone
    (["train=3"], "'train' is a section"),
    (["train.lr=fast"], "--set train.lr=fast: train: lr: expected a number"),
    (["train.optimizer=adam"], "optimizer: 'adam' is not one of 'adamw', 'sgd'"),
    (["model.widths=[8, 1.5]"], "widths[1]: expected an integer"),
    (["augment.scale=[0.5]"], "scale: expected 2 values"),
    (["teacher.views=0"], "--set teacher.views=0: teacher: views must be at least 1"),
    (["train.epochs"], "must look like section.key=value"),
    # values that would train nothing, or fail deep inside a stage, are refused when the recipe is read
    (["train.lr=0"], "--set train.lr=0: train: lr must be a finite number above 0, got 0.0"),
    (["train.lr=nan"], "train: lr must be a finite number above 0, got nan"),
    (["train.epochs=-1"], "train: epochs must be at least 1"),
    (["train.clip_grad_norm=0"], "train: clip_grad_norm must be a finite number above 0"),
    (["train.weight_decay=-0.1"], "train: weight_decay must be a finite number above 0 (or 0: no weight decay)"),
    (["train.label_smoothing=1"], "train: label_smoothing must be in [0, 1)"),
    (["train.early_stopping_patience=-1"], "early_stopping_patience must be >= 0 (0: never stop early)"),
    (["augment.scale=[0, 1]"], "augment: scale is the [min, max] area fraction"),
    (["augment.contrast=1.5"], "augment: contrast must be in [0, 1)"),
    (["distill.temperature=0"], "distill: temperature must be a finite number above 0"),
    (["distill.kd_weight=-1"], "distill: kd_weight must be a finite number above 0 (or 0: that loss term off)"),
    (["distill.feature_weight=0", "distill.alpha=0", "distill.kd_weight=0"], "the distilled student would learn"),
    (["teacher.head_lr=0"], "teacher: head_lr must be a finite number above 0"),
    (["teacher.view_scale=[0.5, 5]"], "teacher: view_scale is the [min, max] area fraction"),
    (["teacher.warmup_epochs=-1"], "teacher: warmup_epochs must be >= 0"),
    (["model.dropout=1"], "model: dropout must be in [0, 1)"),
    (["train.lr=.001"], "train: lr: expected a number, got '.001' (TOML writes it 0.001)"),
    (["model.family=lite8,m"], "expected a list, got 'lite8,m' (a TOML list in brackets, text quoted: e.g. "
                               '["lite8", "m"])'),
    (["model.input_size=7"], "model: input_size: 0 (the dataset's stored size) or a side of at least 8 pixels, got 7"),
    (["distill.max_ms=nan"], "max_params and max_ms must be finite numbers >= 0 (0: no limit), got 0 and nan"),
    (["distill.max_ms=inf"], "max_ms must be finite numbers >= 0"),
])
def test_bad_overrides_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_a_user_file_with_an_unknown_key_is_named(tmp_path):
    user = tmp_path / "typo.toml"
    user.write_text("[train]\nepoch = 3\n")
    with pytest.raises(ConfigError, match=r"typo.toml: unknown key 'train.epoch'"):
        load_config(user)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_a_config_saved_by_the_previous_code_still_loads(tmp_path):
    saved = tmp_path / "config.toml"
    saved.write_text(PREVIOUS_CONFIG_TOML)
    cfg = load_config(saved)
    assert cfg.model.widths == (32, 64, 128) and cfg.train.epochs == 12
    assert cfg.teacher == load_config().teacher  # no [teacher] then: the defaults


def test_the_demo_recipe_shortens_the_teacher_too():
    demo = load_config(DEFAULT_CONFIG.parent / "distill_demo.toml")
    assert (demo.teacher.epochs, demo.teacher.input_size, demo.teacher.augment) == (3, 160, "cached")
    default = load_config().teacher
    own = ("epochs", "input_size", "augment", "finetune_from_block", "freeze_bn", "batch_size", "lr", "min_steps")
    assert dataclasses.replace(demo.teacher, **{k: getattr(default, k) for k in own}) == default


def test_teacher_flags_are_overrides_of_the_teacher_section():
    from leaflens.pipeline.cli.teacher import flag_overrides  # noqa: PLC0415

    ns = type("Args", (), dict(frozen=True, train_cnn=False, epochs=4, finetune_from_block=15, input_size=96,
                               views=3, view_scale=(0.3, 0.9), batch_size=16))()
    cfg = load_config(None, flag_overrides(ns))
    assert cfg.teacher == dataclasses.replace(load_config().teacher, frozen=True, epochs=4, finetune_from_block=15,
                                              input_size=96, views=3, view_scale=(0.3, 0.9), encode_batch_size=16)
    ns.train_cnn = True
    assert load_config(None, flag_overrides(ns)).teacher.cnn_epochs == 4
    none = type("Args", (), dict(frozen=False, train_cnn=False, epochs=None, finetune_from_block=None,
                                 input_size=None, views=None, view_scale=None, batch_size=None))()
    assert flag_overrides(none) == []


def test_a_flag_s_bad_value_is_named_as_the_flag_was_typed(capsys):
    """``--epochs 0`` used to be reported as ``--set train.epochs=0``, a flag the person never typed."""
    for argv, says in ((["distill", "--epochs", "0"], "leaflens distill: --epochs 0: train: epochs must be at least 1"),
                       (["distill", "--max-params", "-5"], "leaflens distill: --max-params -5: "),
                       (["teacher", "--epochs", "-1"], "leaflens teacher: --epochs -1: teacher: epochs must be at "
                                                       "least 1"),
                       (["teacher", "--view-scale", "0.9", "0.3"], "leaflens teacher: --view-scale 0.9 0.3: "),
                       (["teacher", "--input-size", "10"], "leaflens teacher: --input-size 10: EfficientNet-Lite0 "
                                                           "takes 32 to 1024 px"),
                       (["distill", "--set", "train.epochs=0"], "leaflens distill: --set train.epochs=0: ")):
        assert cli(argv) == 2, argv
        assert capsys.readouterr().err.startswith(says), argv
    with pytest.raises(ConfigError, match=r"^--set train.lr=-1: "):
        load_config(None, ["train.lr=-1"])


@pytest.mark.parametrize("command", ["distill", "teacher"])
def test_a_second_config_file_is_refused_not_dropped(command, capsys):
    """`--config a.toml --config b.toml` read b alone and dropped a's settings without a word."""
    with pytest.raises(SystemExit) as stop:
        cli([command, "--config", "a.toml", "--config", "b.toml"])
    assert stop.value.code == 2
    assert "--config given twice: one file is read, the other would be ignored" in capsys.readouterr().err


def test_teacher_cli_reads_its_recipe_from_the_config(tmp_path, capsys):
    ds_dir = tiny_dataset(tmp_path, per_class=8, size=16)
    user = tmp_path / "recipe.toml"
    user.write_text("[teacher]\ncnn_widths = [4, 8]\ncnn_epochs = 5\n[train]\nbatch_size = 8\n")
    out = tmp_path / "t"
    # the flag wins over the file: 2 epochs, not 5
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(out), "--train-cnn", "--config", str(user),
                "--set", "train.lr=0.01", "--epochs", "2", "--quiet"]) == 0, capsys.readouterr().err
    tt = load_teacher(out, load_dataset(ds_dir))
    assert tt.info.teacher["widths"] == [4, 8]
    saved = load_config(out / "config.toml")
    assert saved.teacher.cnn_widths == (4, 8) and saved.teacher.cnn_epochs == 2
    assert saved.train.batch_size == 8 and saved.train.lr == 0.01
    assert cli(["teacher", "--dataset", str(ds_dir), "--out", str(tmp_path / "u"), "--set", "teacher.epoch=3"]) == 2
    assert "unknown key 'teacher.epoch'" in capsys.readouterr().err
    assert not (tmp_path / "u").exists()


def test_effnet_teacher_takes_its_recipe_from_the_teacher_section(tmp_path):
    from leaflens.pipeline.models import pretrained  # noqa: PLC0415
    from leaflens.pipeline.teachers.effnet import build_effnet_teacher  # noqa: PLC0415

    try:
        pretrained.find_lite0_weights()
    except pretrained.WeightsNotFoundError as exc:
        pytest.skip(f"EfficientNet-Lite0 weights not installed: {exc}")
    ds = load_dataset(tiny_dataset(tmp_path, per_class=6, size=16))
    recipe: TeacherSection = load_config(None, ["teacher.epochs=2", "teacher.min_steps=0", "teacher.input_size=32",
                                                "teacher.finetune_from_block=15", "teacher.batch_size=4"]).teacher
    enc, extra = build_effnet_teacher(ds, recipe, progress=False)
    assert extra["split_block"] == 15 and len(extra["fine_tune_history"]) == 2
    assert enc.identity()["input_size"] == 32 and enc.view_encoder.input_size == 32


def test_a_config_that_is_a_folder_or_not_utf8_is_named_not_a_traceback(tmp_path):
    (tmp_path / "cfg").mkdir()
    with pytest.raises(ConfigError, match=r"config file .*cfg is a folder; give a .toml file"):
        load_config(tmp_path / "cfg")
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"\xff\xfe[train]\n")
    with pytest.raises(ConfigError, match=r"latin1.toml is not UTF-8 text \(byte 0\)"):
        load_config(bad)
    bom = tmp_path / "notepad.toml"  # Windows Notepad's "UTF-8 with BOM"
    bom.write_bytes(b"\xef\xbb\xbf[train]\nepochs = 3\n")
    assert load_config(bom).train.epochs == 3


@pytest.mark.parametrize(("argv", "says"), [
    (["--onnx", "enc.onnx", "--epochs", "3"], "--epochs does nothing with --onnx"),
    (["--frozen", "--epochs", "2"], "--epochs does nothing with --frozen"),
    (["--frozen", "--self-train"], "--self-train does nothing with --frozen"),
    (["--layout", "NHWC"], "--layout does nothing with the default teacher"),
    (["--train-cnn", "--mean", "0.5", "0.5", "0.5"], "--mean does nothing with --train-cnn"),
    (["--features", "f", "--input-size", "64"], "it is for the default teacher, --frozen or --onnx"),
    (["--features", "f", "--from-arrays"], "--from-arrays does nothing with --features"),
    (["--train-cnn", "--finetune-from-block", "3"], "it is for the default teacher; leave it out"),
    (["--onnx", "enc.onnx", "--weights", "w.pth"], "--weights does nothing with --onnx"),
    (["--train-cnn", "--frozen"], "--frozen does nothing with --train-cnn"),
    (["--features", "f", "--frozen"], "--frozen does nothing with --features"),
    (["--onnx", "enc.onnx", "--frozen"], "it is for the EfficientNet-Lite0 teacher; leave it out"),
])
def test_a_teacher_flag_that_would_do_nothing_is_a_usage_error(tmp_path, capsys, argv, says):
    """``--onnx enc.onnx --epochs 5`` used to run, fine-tuning nothing, as if the flag had been obeyed."""
    assert cli(["teacher", "--dataset", str(tmp_path / "none"), *argv]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--epochs", "2", "--finetune-from-block", "6", "--self-train", "--from-arrays"],
                                  ["--frozen", "--weights", "w.pth", "--input-size", "96"],
                                  ["--onnx", "enc.onnx", "--layout", "NHWC", "--output", "feats"],
                                  ["--train-cnn", "--epochs", "2"], ["--frozen", "--no-self-train"]])
def test_teacher_flags_that_apply_pass_the_check(argv):
    from leaflens.pipeline.cli import build_parser  # noqa: PLC0415
    from leaflens.pipeline.cli.teacher import flags_that_do_nothing  # noqa: PLC0415

    assert flags_that_do_nothing(build_parser(only="teacher").parse_args(["teacher", *argv])) is None


def test_epochs_named_on_the_command_line_are_taken_as_given():
    """``--epochs 2`` used to train 240 (train.min_steps) on a small dataset: named epochs turn the floor off,
    unless min_steps is named too; so do epochs in the user's --config file (a CI job that pinned 3 epochs there
    trained 120); the recipe's own epochs keep it."""
    from leaflens.pipeline.config import epochs_as_given  # noqa: PLC0415

    assert epochs_as_given(["train.epochs=2"]) == [("train.min_steps=0", "train.epochs as given (train.min_steps = 0)")]
    assert epochs_as_given([("train.epochs=2", "--epochs 2")])[0][0] == "train.min_steps=0"
    assert epochs_as_given(["train.epochs=2", "train.min_steps=100"]) == []
    assert [o for o, _ in epochs_as_given(["teacher.epochs=3", "train.lr=0.1"])] == ["teacher.min_steps=0"]
    assert [o for o, _ in epochs_as_given(["teacher.cnn_epochs=3", "train.epochs=4"])] == ["train.min_steps=0"]
    assert epochs_as_given(["train.lr=0.1"]) == []
    cfg = load_config(None, ["train.epochs=2", *epochs_as_given(["train.epochs=2"])])
    assert (cfg.train.epochs, cfg.train.min_steps) == (2, 0)
    assert load_config().train.min_steps == 240  # the recipe's floor stays for its own epochs


def test_epochs_in_the_users_config_file_are_taken_as_given(tmp_path):
    from leaflens.pipeline.config import ConfigError, epochs_as_given  # noqa: PLC0415

    pinned = tmp_path / "ci.toml"
    pinned.write_text("[train]\nepochs = 3\nwarmup_epochs = 0\n")
    assert [o for o, _ in epochs_as_given([], pinned)] == ["train.min_steps=0"]
    cfg = load_config(pinned, epochs_as_given([], pinned))
    assert (cfg.train.epochs, cfg.train.min_steps) == (3, 0)
    both = tmp_path / "both.toml"
    both.write_text("[train]\nepochs = 3\nmin_steps = 50\n[teacher]\nlr = 0.001\n")
    assert epochs_as_given([], both) == []  # min_steps named with them: the file's floor
    shared = tmp_path / "shared.toml"  # one file for both stages: each takes only the epochs it trains
    shared.write_text("[teacher]\ncnn_epochs = 30\n")
    assert epochs_as_given([], shared, "distill") == []
    assert [o for o, _ in epochs_as_given([], shared, "teacher")] == ["train.min_steps=0"]
    assert epochs_as_given([], pinned, "teacher") == []  # [train] epochs are the students'
    assert epochs_as_given(["train.epochs=3"], None, "teacher") == []
    with pytest.raises(ConfigError, match="does not exist"):
        epochs_as_given([], tmp_path / "none.toml")


def test_the_commands_take_their_epochs_flag_as_given(tmp_path, monkeypatch):
    import leaflens.pipeline.distill as distill_mod  # noqa: PLC0415
    import leaflens.pipeline.teachers.stage as stage_mod  # noqa: PLC0415

    seen = {}

    def fake_distill(dataset, teacher, out, cfg, **kw):
        seen["distill"] = cfg
        raise ValueError("stop here")

    def fake_teacher(dataset, out, cfg, choice, **kw):
        seen["teacher"] = cfg
        raise ValueError("stop here")

    monkeypatch.setattr(distill_mod, "run_distill", fake_distill)
    monkeypatch.setattr(stage_mod, "run_teacher_stage", fake_teacher)
    assert cli(["distill", "--no-teacher", "--epochs", "2", "--dataset", str(tmp_path)]) == 1
    assert (seen["distill"].train.epochs, seen["distill"].train.min_steps) == (2, 0)
    assert cli(["teacher", "--epochs", "3", "--dataset", str(tmp_path)]) == 1
    assert (seen["teacher"].teacher.epochs, seen["teacher"].teacher.min_steps) == (3, 0)
    assert cli(["teacher", "--dataset", str(tmp_path)]) == 1
    assert seen["teacher"].teacher.min_steps == load_config().teacher.min_steps


def test_a_setting_the_command_never_reads_is_warned_about(tmp_path, capsys):
    """`teacher --set train.epochs=2` fine-tuned for the full recipe without a word; `distill --set
    teacher.epochs=2` likewise."""
    from leaflens.pipeline.config import settings_not_read  # noqa: PLC0415

    assert settings_not_read(["train.epochs=2", "teacher.lr=0.1", ("train.seed=1", "--seed 1"),
                              "train.max_bad_steps=3"], ("teacher", "train.max_bad_steps")) == ["train.epochs=2"]
    cli(["teacher", "--set", "train.epochs=2", "--set", "teacher.epochs=2", "--dataset", str(tmp_path / "no")])
    err = capsys.readouterr().err
    assert "warning: --set train.epochs=2 changes nothing here: [train] is the student's" in err
    assert "teacher.epochs=2 changes" not in err
    cli(["teacher", "--train-cnn", "--set", "train.epochs=2", "--dataset", str(tmp_path / "no")])
    assert "changes nothing" not in capsys.readouterr().err  # the CNN teacher trains with [train]
    cli(["distill", "--no-teacher", "--set", "teacher.epochs=2", "--set", "train.epochs=2",
         "--dataset", str(tmp_path / "no")])
    err = capsys.readouterr().err
    assert "warning: --set teacher.epochs=2 changes nothing here: [teacher] is the teacher stage's" in err
    assert "train.epochs=2 changes" not in err


@pytest.mark.parametrize(("argv", "unread", "read"), [
    ([], "teacher.cnn_epochs=5", "teacher.epochs=3"),
    (["--frozen"], "teacher.epochs=3", "teacher.views=2"),
    (["--onnx", "enc.onnx"], "teacher.self_train=false", "teacher.encode_batch_size=8"),
    (["--train-cnn"], "teacher.lr=0.001", "teacher.cnn_epochs=5"),
])
def test_a_teacher_key_the_chosen_teacher_never_reads_is_warned_about(tmp_path, capsys, argv, unread, read):
    """`--set teacher.epochs=3` with --frozen (nothing is trained) was taken without a word."""
    cli(["teacher", *argv, "--set", unread, "--set", read, "--dataset", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert f"warning: --set {unread} changes nothing with" in err
    assert f"--set {read} changes nothing" not in err


def test_the_zoom_out_bound_is_the_engines():
    from leaflens.engine.data import MAX_ZOOM_OUT
    from leaflens.pipeline import config
    assert config.MAX_ZOOM_OUT == MAX_ZOOM_OUT


def test_a_teacher_without_its_weights_is_a_usage_error_like_a_missing_extra(tmp_path, capsys, monkeypatch):
    """serve without gradio exits 2 with the install line; the teacher without the Lite0 weights exited 1."""
    from leaflens.pipeline.models import pretrained  # noqa: PLC0415
    from leaflens.pipeline.teachers import stage  # noqa: PLC0415

    def no_weights(*args, **kwargs):
        raise pretrained.WeightsNotFoundError("the pretrained EfficientNet-Lite0 weights are not installed: pip ...")

    monkeypatch.setattr(stage, "run_teacher_stage", no_weights)
    assert cli(["teacher", "--dataset", str(tmp_path / "ds"), "--out", str(tmp_path / "t")]) == 2
    assert "leaflens teacher: the pretrained EfficientNet-Lite0 weights are not installed" in capsys.readouterr().err


def test_a_set_that_a_flag_given_with_it_overrides_is_said(tmp_path, capsys):
    """``--set train.seed=5 --seed 7`` ran with seed 7, as documented, without a word about the --set."""
    from leaflens.pipeline.config import sets_a_flag_overrides  # noqa: PLC0415

    assert sets_a_flag_overrides(["train.seed=5", "train.lr=0.1", ("train.seed=7", "--seed 7")]) == [
        ("--set train.seed=5", "--seed 7")]
    assert sets_a_flag_overrides(["train.seed=5", ("train.epochs=2", "--epochs 2")]) == []
    cli(["teacher", "--dataset", str(tmp_path / "none"), "--set", "teacher.epochs=3", "--epochs", "1"])
    assert "leaflens teacher: note: --epochs 1 overrides --set teacher.epochs=3" in capsys.readouterr().err
    cli(["distill", "--dataset", str(tmp_path / "none"), "--set", "train.seed=5", "--seed", "7"])
    assert "leaflens distill: note: --seed 7 overrides --set train.seed=5" in capsys.readouterr().err
