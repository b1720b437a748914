"""The ``--model`` option of the commands that run an exported model (predict, evaluate, serve).

One default for all three, the file ``make export`` / ``leaflens export`` writes, so a person in the project
folder can run ``leaflens predict photo.jpg`` after an export, and one message when it is not there.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_MODEL = "artifacts/export/student.onnx"


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="exported model (.onnx with leaflens metadata; default %(default)s)")


def missing_model(path: str | os.PathLike) -> str | None:
    """What to tell a person whose ``--model`` is not a file; None when it is one."""
    if os.path.isfile(path):
        return None
    if os.path.isdir(path):
        inside = sorted(n for n in os.listdir(path) if n.endswith(".onnx"))
        hint = f": the model file is inside it, e.g. --model {os.path.join(os.fspath(path), inside[0])}" if inside \
            else " (`leaflens export` writes the .onnx file that --model takes)"
        return f"{os.fspath(path)}: a folder, not a model file{hint}"
    return (f"{os.fspath(path)}: model file not found (`leaflens export` writes one; another model: "
            "--model PATH)")
