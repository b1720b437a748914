"""Every command the README shows exists: each `make` target and each `leaflens` subcommand and option."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from leaflens.pipeline.cli import SUBCOMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def code_lines() -> list[str]:
    """The lines of the README's shell blocks (fences opened with bash, sh, console or no language), comments cut.
    Fences are paired in order, so a closing fence is never taken for an opening one."""
    lines: list[str] = []
    language = None  # None: outside a fence; else the open fence's language
    for raw in README.splitlines():
        if raw.startswith("```"):
            language = raw[3:].strip() if language is None else None
            continue
        if language in ("", "bash", "sh", "console"):
            line = raw.split("#", 1)[0].strip()
            if line:
                lines.append(line)
    return lines


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.M))


def test_readme_names_the_two_commands():
    assert "make demo" in README and "make test" in README


def test_every_make_target_in_the_readme_exists():
    targets = make_targets()
    named = {m for line in code_lines() for m in re.findall(r"\bmake ([a-z][\w-]*)", line)}
    assert named, "the README shows no make commands"
    assert named <= targets, f"README names make targets that do not exist: {sorted(named - targets)}"


def test_every_leaflens_subcommand_and_option_in_the_readme_exists():
    used = [line[line.index("leaflens "):] for line in code_lines() if "leaflens " in line]
    assert used, "the README shows no leaflens commands"
    for line in used:
        words = line.split()
        sub = words[1]
        assert sub in SUBCOMMANDS, f"README uses unknown subcommand: {line}"
        parser = build_parser(only=sub)
        subparser = parser._subparsers._group_actions[0].choices[sub]  # noqa: SLF001
        rest = words[2:]
        nested = [a for a in subparser._actions if a.choices and isinstance(a.choices, dict)]  # noqa: SLF001
        if nested and rest and rest[0] in nested[0].choices:  # `leaflens data synth ...`
            subparser, rest = nested[0].choices[rest[0]], rest[1:]
        known = {opt for action in subparser._actions for opt in action.option_strings}  # noqa: SLF001
        for w in rest:
            if w.startswith("--"):
                assert w.split("=")[0] in known, f"README uses unknown option {w} of `leaflens {sub}`: {line}"


@pytest.mark.parametrize("sub", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(sub):
    out = subprocess.run([str(Path(__import__("sys").executable)), "-m", "leaflens", sub, "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: leaflens" in out.stdout


def test_version_is_the_installed_package_version():
    from importlib.metadata import version

    out = subprocess.run([str(Path(__import__("sys").executable)), "-m", "leaflens", "--version"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"leaflens {version('leaflens')}"


@pytest.mark.parametrize("argv", [[], ["data"]])
def test_no_command_is_a_usage_error_with_the_help_on_stderr(argv, capsys):
    """`leaflens` and `leaflens data` alone exit 2 (a usage error) and printed the help to stdout, where a script
    takes output for results."""
    from leaflens.pipeline.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: leaflens" in err


@pytest.mark.parametrize("sub", sorted(SUBCOMMANDS))
def test_a_subcommand_says_what_leaflens_help_says(sub):
    """`leaflens --help` lists the one-line helps without importing the stages; each stage's own parser
    must say the same (they are written twice, and drifted once)."""
    import argparse
    import importlib

    module_name, help_text = SUBCOMMANDS[sub]
    parser = argparse.ArgumentParser(prog="leaflens")
    importlib.import_module(module_name).add_parser(parser.add_subparsers(metavar="COMMAND"))
    assert " ".join(help_text.split()) in " ".join(parser.format_help().split())


def test_make_clean_deletes_the_stage_outputs_and_keeps_the_corrections(tmp_path):
    """Corrections are people's work (the web page's "Wrong?"), not a stage output: `make clean` keeps them."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    art = tmp_path / "art"
    for name in ("synthetic", "dataset", "teacher", "student", "export", "corrections/rust", ".teacher.finetune-work",
                 ".teacher.cnn-work", "student.partial"):  # the last three: interrupted runs' checkpoints
        (art / name).mkdir(parents=True)
        (art / name / "file").write_text("x")
    out = subprocess.run(["make", "-s", "clean", f"ART={art}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in art.iterdir()) == ["corrections"]
    assert (art / "corrections" / "rust" / "file").read_text() == "x"
    assert f"kept {art}/corrections" in out.stdout


def test_make_resume_passes_resume_to_the_training_stages_only_when_asked(tmp_path):
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")

    def commands(*extra: str) -> list[str]:
        out = subprocess.run(["make", "-n", "export", f"ART={tmp_path}", *extra], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return [line for line in out.stdout.replace("\\\n", " ").splitlines() if " -m leaflens " in line]

    # only a stage with an interrupted run to go on from gets --resume: distill refused `make export RESUME=1`
    # after a Ctrl-C in the teacher ("a finished run and no interrupted one to continue")
    assert not any("--resume" in line for line in commands("RESUME=1"))
    (tmp_path / ".teacher.finetune-work").mkdir()
    assert {line.split(" -m leaflens ")[1].split()[0] for line in commands("RESUME=1") if "--resume" in line} == {
        "teacher"}
    (tmp_path / "student.partial").mkdir()
    resumed = {line.split(" -m leaflens ")[1].split()[0] for line in commands("RESUME=1") if "--resume" in line}
    assert resumed == {"teacher", "distill"}
    assert not any("--resume" in line for line in commands())


def test_make_goes_on_with_the_photos_of_the_last_preprocess(tmp_path):
    """`make preprocess DATA=photos` then `make teacher`: the teacher stage's preprocess re-run is of the user's
    photos, not the synthetic demo's over them (it was, with the demo's recipe); DATA= on the line wins and
    `make clean` forgets them."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")

    def commands(target: str, *extra: str) -> list[str]:
        out = subprocess.run(["make", "-n", target, f"ART={tmp_path}", *extra], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.replace("\\\n", " ").splitlines()
        return [line for line in lines if "leaflens " in line or "printf" in line]

    first = commands("preprocess", "DATA=photos", "SIZE=96")
    assert any("preprocess --src photos" in c for c in first) and any(".make-data.mk" in c for c in first)
    (tmp_path / ".make-data.mk").write_text("DATA ?= photos\nSIZE ?= 96\nEXTRA ?= \n")  # what that recipe writes
    later = commands("teacher")
    assert any("preprocess --src photos" in c and "--size 96" in c for c in later)
    assert not any("synthetic" in c or "distill_demo.toml" in c for c in later)
    assert any("preprocess --src other" in c for c in commands("teacher", "DATA=other"))
    subprocess.run(["make", "-s", "clean", f"ART={tmp_path}"], cwd=ROOT, capture_output=True, timeout=60)
    assert not (tmp_path / ".make-data.mk").exists()
    assert any("synthetic" in c for c in commands("teacher"))


def test_make_installs_leaflens_again_in_a_venv_made_in_another_folder(tmp_path):
    """A venv's editable install points at the folder it was made in: after the project is moved or renamed,
    `make` installs leaflens again (it failed with "No module named 'leaflens.pipeline'"); where it was made,
    and for the empty stamps of earlier versions, nothing is done."""
    import os
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    venv = tmp_path / "venv"
    venv.mkdir()
    stamp = venv / ".installed"

    def dry_run(made_in: str | None) -> str:
        stamp.write_text("" if made_in is None else made_in + "\n")
        newer = (ROOT / "pyproject.toml").stat().st_mtime + 10
        os.utime(stamp, (newer, newer))
        out = subprocess.run(["make", "-n", "venv", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    moved = dry_run("/old/place/of/the project")
    assert "was made in /old/place/of/the project: installing leaflens again" in moved
    assert "pip install" in moved and f'echo "{ROOT}" > {stamp}' in moved
    assert "pip install" not in dry_run(str(ROOT))
    assert "pip install" not in dry_run(None)


def _make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`make` with every stage command echoed instead of run, and a stand-in venv made here (never installs)."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    venv = tmp_path / "venv"
    venv.mkdir(exist_ok=True)
    (venv / ".installed").write_text(f"{ROOT}\n")  # newer than pyproject.toml, made in this folder
    return subprocess.run(["make", *args, f"ART={tmp_path}", f"VENV={venv}", "LEAFLENS=echo RUN", "DATA=photos"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_stage_whose_make_options_changed_runs_again(tmp_path):
    """`make teacher TEACHER_ARGS=--frozen` after a fine-tuned teacher printed nothing and did nothing: the
    options are now a prerequisite, so a change re-runs the stage and the same options skip it."""
    import os
    import time

    (tmp_path / "dataset").mkdir()
    (tmp_path / "teacher").mkdir()
    (tmp_path / "dataset" / "manifest.json").write_text("{}")
    old = time.time() - 100
    os.utime(tmp_path / "dataset" / "manifest.json", (old, old))
    (tmp_path / "teacher" / "teacher.json").write_text("{}")  # made after the dataset: up to date
    target = f"{tmp_path}/teacher/teacher.json"

    def teacher_runs(*extra: str) -> bool:
        out = _make(tmp_path, target, *extra)
        assert out.returncode == 0, out.stderr
        return "RUN teacher" in out.stdout

    assert not teacher_runs()  # no options file yet: outputs made before it are not remade for it alone
    assert not teacher_runs()
    assert teacher_runs("TEACHER_ARGS=--frozen --set model.family='[\"m\"]'")
    assert (tmp_path / ".make-teacher.args").read_text() == "--frozen --set model.family='[\"m\"]'\n"
    (tmp_path / "teacher" / "teacher.json").write_text("{}")  # what that run would have written
    assert not teacher_runs("TEACHER_ARGS=--frozen --set model.family='[\"m\"]'")
    # a later target without TEACHER_ARGS does not remake the frozen teacher with the default options
    assert not teacher_runs()
    assert (tmp_path / ".make-teacher.args").read_text() == "--frozen --set model.family='[\"m\"]'\n"
    _make(tmp_path, "-s", "clean")
    assert not (tmp_path / ".make-teacher.args").exists()
    # outputs made before the options file existed: options given on the command line run the stage
    (tmp_path / "dataset").mkdir(exist_ok=True)
    (tmp_path / "teacher").mkdir(exist_ok=True)
    (tmp_path / "dataset" / "manifest.json").write_text("{}")
    os.utime(tmp_path / "dataset" / "manifest.json", (old, old))
    (tmp_path / "teacher" / "teacher.json").write_text("{}")
    assert teacher_runs("TEACHER_ARGS=--train-cnn")


def test_a_stage_remade_for_new_photos_keeps_its_last_options_and_other_photos_forget_them(tmp_path):
    """`make teacher TEACHER_ARGS=--frozen`, then a photo changed and `make teacher`: the teacher was remade with
    the default options (a 64-epoch fine-tune) while .make-teacher.args still said --frozen. Other photos on the
    command line forget the old photos' options and extra folders (corrections of other classes)."""
    out = _make(tmp_path, "-s", "teacher", "TEACHER_ARGS=--frozen --set a='b c'", "EXTRA=corr")
    assert out.returncode == 0, out.stderr
    assert "RUN teacher --dataset" in out.stdout and "--frozen --set a=b c" in out.stdout
    again = _make(tmp_path, "-s", "teacher")  # the dataset is "remade" (echo writes nothing): so is the teacher
    assert "--frozen --set a=b c" in again.stdout and "--also corr" in again.stdout
    (tmp_path / ".make-data.mk").write_text("DATA ?= photos\nSIZE ?= 128\nEXTRA ?= corr\nREMEMBERED_DATA := photos\n")
    import subprocess as sp

    other = sp.run(["make", "-s", "teacher", f"ART={tmp_path}", f"VENV={tmp_path / 'venv'}", "LEAFLENS=echo RUN",
                    "DATA=other"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    assert "--src other" in other.stdout and "--also" not in other.stdout and "--frozen" not in other.stdout


def test_make_demo_does_not_replace_the_model_of_the_remembered_photos(tmp_path):
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    (tmp_path / ".make-data.mk").write_text("DATA ?= photos\nSIZE ?= 96\nEXTRA ?= \n")
    out = subprocess.run(["make", "demo", f"ART={tmp_path}", "LEAFLENS=echo RUN"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "RUN" not in out.stdout
    assert "holds the stages of your own photos (DATA=photos" in out.stderr
    assert f"make demo ART={tmp_path}/demo" in out.stderr
    dry = subprocess.run(["make", "-n", "demo", f"ART={tmp_path}/demo"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert dry.returncode == 0 and "synthetic" in dry.stdout
    # the demo beside them keeps its corrections beside its own stages, not in the real model's folder
    assert f"--corrections {tmp_path}/demo/corrections" in dry.stdout


@pytest.mark.parametrize("var, value", [("DATA", "my photos"), ("ART", "art dir")])
def test_make_refuses_a_path_with_a_space_in_one_line(tmp_path, var, value):
    """DATA="my photos" became `--src my` and `unrecognized arguments: photos`; ART="art dir" gave a screen of
    make's own warnings and ran leaflens even under -n."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    extra = [] if var == "ART" else [f"ART={tmp_path}"]
    out = subprocess.run(["make", "-n", "preprocess", f"{var}={value}", *extra], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    said = [line for line in out.stderr.splitlines() if not line.startswith("make[")]  # a make inside make says so
    assert out.returncode == 2 and "leaflens " not in out.stdout  # nothing run, not even under -n
    assert f'{var}="{value}"' in out.stderr and "leaflens" in out.stderr and len(said) == 1


def test_make_does_not_replace_a_dataset_leaflens_preprocess_made_from_other_photos(tmp_path):
    """`leaflens preprocess --src "sp ace" --out artifacts/dataset` (the README's way for a path make cannot
    take), then `make teacher`: make preprocessed the synthetic demo over it without a word."""
    import json
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "manifest.json").write_text(json.dumps({"source_root": "/home/me/my photos"},
                                                                   indent=2))
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").write_text(f"{ROOT}\n")
    run = ["make", "-s", "teacher", f"ART={tmp_path}", f"VENV={venv}", "LEAFLENS=echo RUN"]
    out = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "RUN preprocess" not in out.stdout
    assert "was made from /home/me/my photos by leaflens preprocess" in out.stderr
    demo = subprocess.run(["make", "-s", "demo", *run[3:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert demo.returncode == 2 and "its dataset was made from /home/me/my photos" in demo.stderr
    named = subprocess.run([*run, "DATA=photos"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert named.returncode == 0 and "RUN preprocess --src photos" in named.stdout


def test_the_demo_without_make_is_what_make_demo_runs(tmp_path):
    """The README's commands for a machine without make are the stages `make demo` runs, options included: the
    demo's shorter recipes (distill_demo.toml) were added by make alone, so a user copying the README's stage
    commands ran the full recipes on the demo's data."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    out = subprocess.run(["make", "-n", "serve", f"ART={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    made = [" ".join(line.split(" -m leaflens ", 1)[1].replace(str(tmp_path), "artifacts").split())
            for line in out.stdout.replace("\\\n", " ").splitlines() if " -m leaflens " in line]
    block = README.split("Without make", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    written = [" ".join(line.split()[1:]) for line in block.strip().splitlines()]
    assert written == made


def test_make_serve_serves_the_export_as_it_is(tmp_path):
    """On a machine that only serves (the model copied into artifacts/export/), `make serve` ran every stage:
    synthetic photos, preprocess, teacher, distill, export, then served the retrained demo model in place of the
    copied one. It serves the file there; `make demo` still brings the export up to date first."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "student.onnx").write_bytes(b"copied here")
    stages = {}
    for target in ("serve", "demo"):
        out = subprocess.run(["make", "-n", target, f"ART={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        stages[target] = [line.split(" -m leaflens ", 1)[1].split()[0] for line in out.stdout.splitlines()
                          if " -m leaflens " in line]
    assert stages["serve"] == ["serve"]
    assert stages["demo"] == ["data", "preprocess", "teacher", "distill", "export", "serve"]
    both = subprocess.run(["make", "-n", "export", "serve", f"ART={tmp_path}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert both.returncode == 0, both.stderr  # asked together, serve waits for the export (with -j too)
    assert [line.split(" -m leaflens ", 1)[1].split()[0] for line in both.stdout.splitlines()
            if " -m leaflens " in line][-2:] == ["export", "serve"]


def test_stage_options_given_on_the_demo_data_keep_the_demo_recipe(tmp_path):
    """`make distill DISTILL_ARGS="--seed 1"` on the demo's data dropped --config pipeline/distill_demo.toml: hours
    of the full recipe on 2 cores instead of minutes. A --config of the user's own is the one read."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")

    def distill_line(*extra: str) -> str:
        # --no-print-directory: under a make (CI's), make's own "Leaving directory" lines would join the command
        out = subprocess.run(["make", "-n", "--no-print-directory", "distill", f"ART={tmp_path}", *extra], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        line = " ".join(out.stdout.replace("\\\n", " ").split())
        return line.split("-m leaflens distill", 1)[1].split(" -m leaflens ", 1)[0]

    assert distill_line("DISTILL_ARGS=--seed 1").endswith("--config pipeline/distill_demo.toml --seed 1")
    own = distill_line("DISTILL_ARGS=--config mine.toml --seed 1")
    assert own.endswith("--config mine.toml --seed 1") and "distill_demo" not in own
    assert "distill_demo" not in distill_line("DATA=photos")  # real photos: the full recipe
    typed = subprocess.run(["make", "-n", "distill", f"ART={tmp_path}", "DATA=photos", "DISTILL_ARGS=--set a='b   c'"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "--set a='b   c'" in typed.stdout  # the options as typed, spaces within quotes kept
    assert "distill_demo" not in distill_line("DISTILL_ARGS=--conf mine.toml")  # argparse's --config too


def test_the_engine_example_trains():
    """The README's example of the engine on its own runs and learns (it is the in-place update a student writes;
    before, ``p -= ...`` updated nothing)."""
    block = README.split("### The engine on its own", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - our own README's example
    assert scope["accuracy"] >= 0.9 and float(scope["loss"].data) < 0.3


def test_the_demo_folder_named_with_a_trailing_slash_is_the_demo(tmp_path):
    """`make preprocess DATA=artifacts/synthetic/` (as a shell completes it) was taken for other photos: the demo's
    short recipes were dropped and the full ones ran on the demo's data."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    for data in (f"{tmp_path}/synthetic/", f"{tmp_path}/./synthetic"):
        out = subprocess.run(["make", "-n", "teacher", f"ART={tmp_path}", f"DATA={data}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "--config pipeline/distill_demo.toml" in out.stdout and " data synth " in out.stdout, data
