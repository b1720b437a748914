"""A signal that arrives once a command has returned: the process exits with the command's code, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from leaflens.pipeline.cli import main
    sys.argv = ["leaflens", "doctor", "--json"]
    code = main()
    os.kill(os.getpid(), getattr(signal, "{sig}"))
    time.sleep(0.3)  # the signal is handled here, as it would be during the interpreter's shutdown
    print("exited with", code, file=sys.stderr)
    sys.exit(code)
""")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_after_the_command_returned_changes_nothing(sig):
    """Ctrl-C or SIGTERM as a command finished: exit 0 with a traceback from threading, or 130, or killed by the
    signal, by chance. The command's own code now, and no traceback."""
    done = subprocess.run([sys.executable, "-c", SCRIPT.replace("{sig}", sig)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exited with 0" in done.stderr and "Traceback" not in done.stderr


def test_ctrl_c_while_the_command_is_being_loaded_is_one_line(monkeypatch, capsys):
    """Ctrl-C in the first moments (the stage's modules being imported) printed a 17-66 line traceback."""
    from leaflens.pipeline import cli  # noqa: PLC0415

    def interrupted(only=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["distill", "--help"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("err,words", [
    (OSError(28, "No space left on device", "/data/run.partial/x.npz"),
     "leaflens distill: no space left on the disk of /data/run.partial/x.npz: free some space and run it again "
     "(what was there before is unchanged; with --resume a training goes on from its last finished epoch, if one "
     "finished)"),
    (OSError(30, "Read-only file system", "/mnt/ro/.run.lock"),
     "leaflens distill: /mnt/ro/.run.lock is on a read-only disk: give an --out you can write in"),
    (FileExistsError(17, "File exists", "NOTES"),
     "leaflens distill: NOTES: File exists (a file is where a folder should be): give another --out"),
])
def test_an_output_the_disk_refuses_is_one_line_not_a_traceback(monkeypatch, capsys, tmp_path, err, words):
    from leaflens.pipeline import cli  # noqa: PLC0415

    if err.filename == "NOTES":  # a file where the output's folder should be
        (tmp_path / "notes").write_text("mine")
        err = FileExistsError(17, "File exists", str(tmp_path / "notes"))
        words = words.replace("NOTES", str(tmp_path / "notes"))

    def refused(argv, command):
        raise err

    monkeypatch.setattr(cli, "_run", refused)
    assert cli.main(["distill", "--out", "x"]) == cli.EXIT_REFUSED
    assert capsys.readouterr().err == words + "\n"
    monkeypatch.setattr(cli, "_run", refused)
    with pytest.raises(OSError):  # serving and predicting say their own errors: not taken for an output's
        cli.main(["predict", "x"])
    err = FileExistsError(17, "File exists", str(tmp_path / "a_folder"))  # EEXIST of a race or a bug: no file there
    with pytest.raises(OSError):
        cli.main(["distill", "--out", "x"])


def test_distill_interrupted_offers_resume_only_when_an_epoch_was_kept(monkeypatch, tmp_path, capsys):
    from leaflens.pipeline import cli, distill  # noqa: PLC0415

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "run_distill", interrupted)
    argv = ["distill", "--dataset", str(tmp_path), "--no-teacher", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 130
    assert "interrupted before a training epoch ended: nothing to resume" in capsys.readouterr().err
    (tmp_path / "run.partial" / "scratch").mkdir(parents=True)
    (tmp_path / "run.partial" / "scratch" / "last.npz").write_bytes(b"")
    assert cli.main(argv) == 130
    assert "the same command with --resume" in capsys.readouterr().err


PIPED = textwrap.dedent("""
    import sys
    from leaflens.pipeline import cli
    def many_lines(argv, command):  # a command with more output than a pipe holds (predict on many photos)
        for i in range(200000):
            print(f"photo_{i}.jpg\\thealthy\\t0.97")
        return 0
    cli._run = many_lines
    sys.argv = ["leaflens", "predict"]
    sys.exit(cli.main())
""")


LATE = textwrap.dedent("""
    import sys, time
    from leaflens.pipeline import cli
    def some_lines(argv, command):  # more than Python's 8 KB buffer, less than two: the rest is written at the end
        for i in range(500):
            print(f"photo_{i:04d}.jpg\\thealthy\\t0.97")
        time.sleep(1.0)  # the reader has gone by now
        return 0
    cli._run = some_lines
    sys.argv = ["leaflens", "predict"]
    sys.exit(cli.main())
""")

ON_STDERR = textwrap.dedent("""
    import sys
    from leaflens.pipeline import cli
    def progress(argv, command):  # a training command's progress lines, read through `2>&1 | head`
        for i in range(200000):
            print(f"epoch {i}: loss 0.5", file=sys.stderr)
        return 0
    cli._run = progress
    sys.argv = ["leaflens", "teacher"]
    sys.exit(cli.main())
""")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes")
@pytest.mark.parametrize("script, stream", [(LATE, "stdout"), (ON_STDERR, "stderr")])
def test_output_left_for_the_end_or_on_stderr_ends_quietly_too(script, stream):
    """Output still buffered when the command returned was written at exit, past the handler ("Exception ignored
    ... BrokenPipeError", exit 120), and so was stderr after a closed `2>&1 | head`."""
    out = subprocess.PIPE if stream == "stdout" else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.PIPE,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    pipe = proc.stdout if stream == "stdout" else proc.stderr
    assert pipe is not None and pipe.readline()
    pipe.close()
    other = proc.stderr if stream == "stdout" else None
    said = other.read() if other is not None else b""
    assert proc.wait(timeout=120) == 141, said.decode()
    assert b"Traceback" not in said and b"Exception ignored" not in said, said.decode()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes")
def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`leaflens predict ... | head -1` printed a BrokenPipeError traceback and exited 1, the code for "some photos
    could not be read"; now 141, as a command killed by SIGPIPE, and nothing on stderr."""
    proc = subprocess.Popen([sys.executable, "-c", PIPED], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"photo_0.jpg")
    proc.stdout.close()  # as `head -1` does once it has its line
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file descriptors")
@pytest.mark.parametrize("closed", [1, 2])
def test_a_command_started_with_a_stream_closed_runs(closed):
    """`leaflens doctor >&-` (sys.stdout is None then) ended in an AttributeError from the flush that catches a
    reader gone away."""
    script = "import sys; from leaflens.pipeline.cli import main; sys.argv = ['leaflens', 'doctor', '--json', " \
             "'--no-measure']; sys.exit(main())"
    done = subprocess.run(["bash", "-c", f'"$0" -c "$1" {closed}>&-', sys.executable, script], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


def test_help_and_version_need_no_threads_setting(monkeypatch, capsys):
    """A bad LEAFLENS_THREADS is a usage error for a command that runs, not for asking how to run one."""
    from leaflens.pipeline.cli import main  # noqa: PLC0415

    monkeypatch.setenv("LEAFLENS_THREADS", "abc")
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0 and "usage" in capsys.readouterr().out
    assert main(["doctor", "--json"]) == 2 and "LEAFLENS_THREADS='abc'" in capsys.readouterr().err
