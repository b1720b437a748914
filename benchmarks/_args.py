"""Command-line checks shared by the benchmark scripts, so that a bad value is a usage error (exit 2, one line
from argparse) before any work, not a traceback halfway through a run.

benchmarks/ is not a package: a script puts its own folder on ``sys.path`` and imports ``from _args import ...``
(as insects.py imports from ood.py).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from leaflens.pipeline.config import StageConfig


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _number(text: str, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise argparse.ArgumentTypeError(f"must be a number {'of 0 or more' if zero_ok else 'above 0'}, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above 0."""
    return _number(text, zero_ok=False)


def non_negative_float(text: str) -> float:
    """An argparse ``type``: a finite number of 0 or more."""
    return _number(text, zero_ok=True)


def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers of 1 or more ("1,8,32"); empty items are left out."""
    try:
        return [positive_int(item.strip()) for item in text.split(",") if item.strip()]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (comma-separated whole numbers)") from None


def existing_dir(text: str) -> Path:
    """An argparse ``type``: a folder that exists."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder" + ("" if path.exists() else " (it does not exist)"))
    return path


def checked_config(parser: argparse.ArgumentParser, overrides: Sequence[str]) -> StageConfig:
    """The pipeline's default config with ``overrides`` (``--set`` values) applied; a bad override is a usage
    error, said before any stage runs (a stage would otherwise refuse it only after the ones before it)."""
    from leaflens.pipeline.config import ConfigError, load_config  # noqa: PLC0415  (only the scripts with --set)

    try:
        return load_config(None, list(overrides))
    except ConfigError as exc:
        message = str(exc)
        parser.error(message if message.startswith("--set") else f"--set: {message}")
