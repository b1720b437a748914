"""Class notes: a display name, a short description and what to do, per class, in one or two languages.

The synthetic dataset ships ``classes.toml`` (written by ``leaflens data synth`` and carried into
the dataset folder by ``leaflens preprocess``)::

    [classes.rust]
    name = "Rust"
    name_zh = "锈病"
    description = "..."
    description_zh = "..."
    advice = "..."
    advice_zh = "..."

A JSON file with the same structure (``{"classes": {"rust": {...}}}``, or the class table at the
top level) is read too. Every key is optional; a missing Chinese text falls back to the English one
and a missing name to the class id, so partial notes never break the page.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["NOTE_FIELDS", "NOTES_FILENAMES", "ClassNotes", "NotesError", "find_notes", "load_notes"]

NOTE_FIELDS = ("name", "description", "advice")
NOTES_FILENAMES = ("classes.toml", "classes.json")


class NotesError(ValueError):
    """A class-notes file that cannot be read; the message names the file and the entry."""


@dataclass(frozen=True)
class ClassNotes:
    """Notes per class id: ``entries[class_id][field or field_zh] = text``."""

    entries: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    source: str | None = None

    def __contains__(self, class_id: str) -> bool:
        return class_id in self.entries

    def text(self, class_id: str, key: str, lang: str = "en") -> str:
        """``key`` ("name", "description", "advice") for ``class_id`` in ``lang``, falling back to
        English, then (for "name" only) to the class id itself; "" when nothing is known."""
        entry = self.entries.get(class_id, {})
        value = entry.get(f"{key}_{lang}") if lang != "en" else None
        value = value or entry.get(key) or ""
        if not value and key == "name":
            return class_id
        return value

    def name(self, class_id: str, lang: str = "en") -> str:
        """The display name of ``class_id`` (the id when the notes have none)."""
        return self.text(class_id, "name", lang)

    def unknown_classes(self, classes: Iterable[str]) -> list[str]:
        """Note entries that name no class of the model (likely a notes file for another model)."""
        known = set(classes)
        return sorted(c for c in self.entries if c not in known)


def _entries_from(data: object, source: str) -> dict[str, dict[str, str]]:
    if isinstance(data, Mapping) and "classes" in data and isinstance(data["classes"], Mapping):
        data = data["classes"]
    if not isinstance(data, Mapping):
        raise NotesError(f"{source}: expected a table of classes, got {type(data).__name__}")
    entries: dict[str, dict[str, str]] = {}
    for class_id, entry in data.items():
        if not isinstance(entry, Mapping):
            raise NotesError(f"{source}: entry 'classes.{class_id}' must be a table of texts, "
                             f"got {type(entry).__name__}")
        clean: dict[str, str] = {}
        for key, value in entry.items():
            if not isinstance(value, str):
                raise NotesError(f"{source}: 'classes.{class_id}.{key}' must be text, got {type(value).__name__}")
            clean[str(key)] = value.strip()
        entries[str(class_id)] = clean
    return entries


def load_notes(path: str | os.PathLike) -> ClassNotes:
    """Read a ``classes.toml`` or ``.json`` notes file; raise :class:`NotesError` naming the file."""
    p = Path(path)
    name = os.fspath(p)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise NotesError(f"{name}: cannot read class notes: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotesError(f"{name}: class notes must be UTF-8 text ({exc})") from exc
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if p.suffix.lower() == ".json" else "TOML"
        raise NotesError(f"{name}: not valid {kind}: {exc}") from exc
    return ClassNotes(_entries_from(data, name), source=name)


def find_notes(folders: Iterable[str | os.PathLike | None]) -> Path | None:
    """The first ``classes.toml`` / ``classes.json`` found in ``folders`` (in order), or None."""
    for folder in folders:
        if folder is None:
            continue
        for filename in NOTES_FILENAMES:
            candidate = Path(folder) / filename
            if candidate.is_file():
                return candidate
    return None
