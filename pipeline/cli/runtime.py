"""The process-wide settings a leaflens command runs with; the library itself sets none.

Both are about speed on a CPU and are set by the command line (and by benchmarks, which measure
what the command line runs), never as a side effect of importing a module:
- OpenBLAS's worker threads busy-wait for a long time after every call by default. Between matmuls
  the engine runs its own threads (``leaflens.engine.parallel``), and spinning BLAS threads starve
  them: measured here, a training step ran 27 % faster with a short timeout. OpenBLAS reads the
  variable when NumPy loads it, so this must run before NumPy is imported; an explicit setting in
  the environment wins.
- glibc's allocator thresholds, raised so that freed activation buffers are reused instead of
  returned to the OS (``leaflens.engine.allocator``); only for commands that train or run the engine.
"""

from __future__ import annotations

import os
import sys


def configure_process(*, engine: bool) -> None:
    """Apply the settings; ``engine`` for commands that run the training engine (not serving)."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if engine:
        from leaflens.engine.allocator import tune_allocator

        tune_allocator()


def stop_on_sigterm() -> None:
    """SIGTERM (``kill``, ``timeout``, systemd, a scheduler) stops the command as Ctrl-C does: the same
    clean-up (temporary folders removed, the server's uploads emptied, a training run left resumable) and exit
    code 130, instead of the process ending on the spot. Only the main thread can install it."""
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def ignore_late_signals() -> None:
    """Ctrl-C or SIGTERM once the command has returned: the work is done (or its interruption already said), so
    the process exits with the command's own code. Before, such a signal raised KeyboardInterrupt during the
    interpreter's shutdown: a traceback from threading or logging, and an exit code by chance (0, 130, or
    killed by the signal)."""
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
