"""``leaflens doctor`` and the student family: the block kind changes what a training step needs, every member
of the family is sized at its own widths, blocks and input size, and the report names the member whose
batch limits the family's (every member trains with the same train.batch_size)."""

from __future__ import annotations

import json
import re

import pytest
from test_cmd_doctor import no_gpu  # noqa: F401  (the fixture: the doctor's CPU path even on a GPU machine)

from leaflens.engine.checkpoint import save_checkpoint
from leaflens.pipeline import doctor
from leaflens.pipeline.cli import main
from leaflens.pipeline.models.student import StudentCNN

FAST = ["doctor", "--no-bandwidth"]
REQUEST_KEYS = {"model", "input_size", "widths", "num_classes", "mixed_precision", "source", "configured_batch"}




def test_a_separable_student_needs_less_memory_per_step_than_a_plain_one():
    """Same widths, so the same activations' channel counts at the block outputs; the separable blocks have about
    an eighth of the conv weights, hence far smaller weight gradients and optimiser temporaries in the step."""
    plain = doctor.ModelSpec(widths=(48, 96, 192, 384), num_classes=3)
    separable = doctor.ModelSpec(widths=(48, 96, 192, 384), num_classes=3, block="separable")
    assert "separable" in separable.describe() and "separable" not in plain.describe()
    p = doctor.measure_cpu_step_peak_bytes(plain, 16, 2)
    s = doctor.measure_cpu_step_peak_bytes(separable, 16, 2)
    assert s < 0.7 * p, (s, p)


def test_a_block_the_student_cnn_does_not_have_is_refused_not_sized_as_another():
    est = doctor.cpu_batch_estimate(doctor.ModelSpec(widths=(8,), block="lite0_trunk"), 16)
    assert "'lite0_trunk' student cannot be sized" in est["unavailable"]


def test_the_limiting_member_is_the_unsizable_one_else_the_smallest_batch():
    assert doctor.limiting_member([{"batch": 40}, {"batch": 12}, {"batch": 12}, {"batch": 30}]) == 1
    assert doctor.limiting_member([{"batch": 5}, {"unavailable": "out of GPU memory at batch 2"}]) == 1
    with pytest.raises(ValueError):
        doctor.limiting_member([])


@pytest.mark.usefixtures("no_gpu")
def test_a_family_of_s_and_l_is_limited_by_l(capsys):
    args = [*FAST, "--widths", "16,32,64", "--size", "24", "--classes", "3"]
    assert main([*args, "--family", "s,l", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    s, l = facts["family"]
    assert (s["member"], s["widths"], l["member"], l["widths"]) == ("s", [8, 16, 32], "l", [24, 48, 96])
    assert s["input_size"] == l["input_size"] == 24
    s_est, l_est = s["batch_estimate"], l["batch_estimate"]
    assert l_est["per_image_bytes"] > s_est["per_image_bytes"]  # measured: 3x the channels, more per image
    assert 0 < l_est["batch"] <= s_est["batch"]
    assert l_est["free_bytes"] == s_est["free_bytes"]  # both sized against one reading of the free memory
    assert facts["request"]["member"] == "l" and facts["request"]["widths"] == [24, 48, 96]
    assert facts["cpu_batch_estimate"] == l_est

    assert main([*args, "--family", "s,l"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"largest safe batch     \d+ for family member l, student 24-48-96 at 24x24, float32", out)
    assert "s, l: the training batch must fit l" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:6] in ("    s ", "    l ")}
    assert rows["s"].endswith("for student 8-16-32 at 24x24") and rows["l"].endswith("(limits the batch)")


@pytest.mark.usefixtures("no_gpu")
def test_a_member_keeps_its_own_block_and_input_size(capsys):
    assert main([*FAST, "--no-measure", "--json", "--widths", "8,16", "--size", "16", "--family", "s,m-ds@32"]) == 0
    facts = json.loads(capsys.readouterr().out)
    s, m = facts["family"]
    assert (s["input_size"], "block" in s) == (16, False)
    assert (m["widths"], m["input_size"], m["block"]) == ([8, 16], 32, "separable")
    # nothing measured: the first member that could not be sized stands for the family
    assert facts["request"]["member"] == "s" and "--no-measure" in facts["cpu_batch_estimate"]["unavailable"]
    assert main([*FAST, "--no-measure", "--widths", "8,16", "--size", "16", "--family", "s,m-ds@32"]) == 0
    out = capsys.readouterr().out
    assert "the family's batch is unknown (s: not measured (--no-measure))" in out
    assert "student 8-16, separable at 32x32: estimate unavailable" in out


@pytest.mark.parametrize("family, message", [
    ("s,xl", "family: unknown member 'xl'"), ("m,m", "member 'm' is listed twice"), (",", "at least one member"),
])
def test_bad_family_names_exit_2_naming_the_member(family, message, capsys):
    assert main([*FAST, "--no-measure", "--family", family]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"doctor: --family {family}: ") and message in err


@pytest.mark.usefixtures("no_gpu")
def test_the_default_family_reports_as_one_student(capsys):
    """The recipe's family is ["lite8"]: the report is the one student's, with neither a member nor a family."""
    assert main([*FAST, "--no-measure", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert set(default["request"]) == REQUEST_KEYS | {"block", "trunk_blocks"} and "family" not in default
    assert main([*FAST, "--no-measure", "--json", "--family", "lite8"]) == 0
    assert json.loads(capsys.readouterr().out)["request"] == default["request"]
    assert main([*FAST, "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert "family" not in text and "estimate unavailable: not measured (--no-measure)" in text
    assert main([*FAST, "--no-measure", "--family", "lite8"]) == 0
    assert capsys.readouterr().out == text
    # one CNN member: the request is the [model] CNN's, with no block key, as before families
    assert main([*FAST, "--no-measure", "--json", "--family", "m"]) == 0
    m = json.loads(capsys.readouterr().out)["request"]
    assert set(m) == REQUEST_KEYS and m["widths"] == [32, 64, 128, 256]


@pytest.mark.usefixtures("no_gpu")
def test_a_run_folder_sizes_its_kept_separable_student(tmp_path, capsys):
    model = StudentCNN(4, widths=(8, 16), separable=True)
    save_checkpoint(tmp_path / "best.npz", model, extra={
        "model_config": {"kind": "student_cnn", "num_classes": 4, "widths": [8, 16], "in_channels": 3,
                         "block": "separable"},
        "dataset": {"classes": list("abcd"), "image_size": 24, "mean": [0.5] * 3, "std": [0.25] * 3}})
    assert main([*FAST, "--json", "--run", str(tmp_path)]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["request"]["block"] == "separable" and facts["request"]["input_size"] == 24
    assert facts["cpu_batch_estimate"]["batch"] > 0 and "family" not in facts
    assert main([*FAST, "--run", str(tmp_path), "--family", "s,m"]) == 2
    assert "--family cannot be used with --run" in capsys.readouterr().err


def test_a_family_on_a_gpu_is_sized_against_its_free_memory(monkeypatch):
    """The GPU branch without a GPU: probe facts and measurements are faked, the choice is real."""
    free = 6 * 2**30
    monkeypatch.setattr(doctor, "gpu_facts", lambda measure_bandwidth: {"available": True, "free_bytes": free})
    calls = []

    def fake_estimate(model, input_size, free_bytes, batches=doctor.GPU_BATCHES, **kw):
        calls.append((model.widths, model.block, input_size, free_bytes))
        return {"batch": 1000 // model.widths[0]}

    monkeypatch.setattr(doctor, "batch_estimate", fake_estimate)
    family = [doctor.MemberSpec("s", doctor.ModelSpec((8, 16)), 32),
              doctor.MemberSpec("l-ds@64", doctor.ModelSpec((12, 24), block="separable"), 64)]
    facts = doctor.collect_family(family, measure_bandwidth=False)
    assert calls == [((8, 16), "conv", 32, free), ((12, 24), "separable", 64, free)]
    assert facts["gpu"]["batch_estimate"] == {"batch": 83} and "cpu_batch_estimate" not in facts
    assert facts["request"]["member"] == "l-ds@64" and facts["request"]["block"] == "separable"
    assert [m["batch_estimate"]["batch"] for m in facts["family"]] == [125, 83]


@pytest.mark.gpu
def test_gpu_estimate_of_a_separable_student_is_positive_and_a_step_at_that_batch_fits():
    spec = doctor.ModelSpec(widths=(16, 32), num_classes=5, block="separable")
    free = 2 * 2**30
    est = doctor.batch_estimate(spec, 32, free)
    assert est["batch"] > 0, est
    assert doctor.measure_train_step_peak_bytes(spec, 32, est["batch"]) <= free


@pytest.mark.usefixtures("no_gpu")
def test_the_recipes_larger_students_are_sized_with_its_family(monkeypatch, capsys):
    """``model.escalate`` members train at the recipe's batch when the teacher leads: the doctor sizes them too."""
    from leaflens.pipeline import config  # noqa: PLC0415

    real = config.load_config
    monkeypatch.setattr(config, "load_config", lambda *a, **k: real(
        None, ['model.family=["s"]', 'model.escalate=["lite12@96", "l"]']))
    assert main([*FAST, "--no-measure", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert [m["member"] for m in facts["family"]] == ["s", "lite12@96", "l"]
    lite = facts["family"][1]
    assert (lite["block"], lite["trunk_blocks"], lite["input_size"]) == ("lite0", 12, 96)
    assert main([*FAST, "--no-measure", "--json", "--family", "s"]) == 0  # a family asked for: that family alone
    assert "family" not in json.loads(capsys.readouterr().out)
