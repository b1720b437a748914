"""A signal that arrives once a command has returned: the process exits with the command's code, no traceback."""

from __future__ import annotations

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
