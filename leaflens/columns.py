"""Text columns that line up in a terminal whatever the script of the names in them.

Class and file names come from users: a Chinese class name takes two terminal cells per character, an
accent written as a combining mark none, so ``str.ljust`` and ``f"{name:<20}"`` misalign the tables the
commands print (preprocess's per-class counts, evaluate's per-class figures and confusion matrix).
"""

from __future__ import annotations

import unicodedata


def display_width(text: str) -> int:
    """Terminal cells ``text`` takes: 2 for East Asian wide and full-width characters, 0 for combining marks
    and zero-width characters, 1 otherwise."""
    cells = 0
    for ch in text:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            continue
        cells += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return cells


def pad_right(text: str, width: int) -> str:
    """``text`` followed by spaces up to ``width`` terminal cells (left-aligned in its column)."""
    return text + " " * max(width - display_width(text), 0)
