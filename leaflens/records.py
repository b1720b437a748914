"""Typed records stored as JSON objects: configs, manifests, teacher and run metadata, model cards.

A record is a ``@dataclass`` that also derives from :class:`Record`. ``to_dict`` gives plain JSON
types; ``from_dict`` rebuilds the record from a parsed file and refuses what it cannot trust with
the key named: a key the record does not know (a typo in a config would otherwise be ignored), a
required key that is missing, or a value of the wrong type. Nested records, ``list``/``tuple``/
``dict`` of them, ``X | None`` and ``Literal`` are followed through the type hints.

Versioning: a record whose files change shape over time declares ``SCHEMA_VERSION`` and a
``schema_version`` field (or another name in ``VERSION_KEY``, for files that already carried their
version under it, such as the dataset manifest's ``format_version``); ``from_dict`` refuses a file
written by a newer leaflens and hands older ones to ``_upgrade`` first, so each record keeps the
knowledge of its own history. A file without the key is version 1.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

R = TypeVar("R", bound="Record")


class RecordError(ValueError):
    """A stored record that does not match its type; the message names the file and the key."""


class Record:
    """Base of the typed records (use with ``@dataclass``)."""

    # Set by @dataclass on every record; declared so that type checkers take a Record for a dataclass.
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    SCHEMA_VERSION: ClassVar[int | None] = None
    VERSION_KEY: ClassVar[str] = "schema_version"
    # Optional fields that files leave out rather than write as null (as they did before records existed,
    # so that a file read and written again is the same file, digests included).
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values (records -> dicts, tuples -> lists)."""
        return {f.name: _to_plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if not (f.name in self.OMIT_WHEN_NONE and getattr(self, f.name) is None)}

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any], where: str | None = None) -> R:
        """Rebuild from parsed JSON/TOML; ``where`` (a file name, a section) prefixes every error."""
        where = where or cls.__name__
        if not isinstance(data, Mapping):
            raise RecordError(f"{where}: expected a table of keys, got {type(data).__name__}")
        data = dict(data)
        if cls.SCHEMA_VERSION is not None:
            key = cls.VERSION_KEY
            version = data.get(key, 1)
            if not isinstance(version, int) or isinstance(version, bool):
                raise RecordError(f"{where}: {key!r} must be an integer, got {version!r}")
            if version > cls.SCHEMA_VERSION:
                raise RecordError(f"{where}: written by a newer leaflens ({key} {version}; this "
                                  f"version reads up to {cls.SCHEMA_VERSION}); upgrade leaflens")
            if version < cls.SCHEMA_VERSION:
                data = cls._upgrade(data, version, where)
            data[key] = cls.SCHEMA_VERSION
        return _build(cls, data, where)

    @classmethod
    def _upgrade(cls, data: dict[str, Any], version: int, where: str) -> dict[str, Any]:
        """Turn a dict written with an older ``schema_version`` into the current shape."""
        raise RecordError(f"{where}: schema_version {version} is no longer readable; rebuild it")


def _to_plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _build(cls: type[R], data: dict[str, Any], where: str) -> R:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise RecordError(f"{where}: unknown key {unknown[0]!r}{more}; known keys: {', '.join(sorted(known))}")
    kwargs = {}
    for name, f in known.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordError(f"{where}: required key {name!r} is missing")
            continue
        kwargs[name] = _convert(data[name], hints[name], f"{where}: {name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, RecordError):
            raise
        raise RecordError(f"{where}: {exc}") from exc


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, where)
            except RecordError as exc:
                errors.append(str(exc))
        raise RecordError(errors[0] if errors else f"{where}: unexpected {value!r}")
    if origin is Literal:
        if value not in args:
            raise RecordError(f"{where}: {value!r} is not one of {', '.join(repr(a) for a in args)}")
        return value
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_dict(value, where)
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            hint_text = (f" (a TOML list in brackets, text quoted: e.g. {_as_toml_list(value)})"
                         if isinstance(value, str) and value else "")
            raise RecordError(f"{where}: expected a list, got {value!r}{hint_text}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if origin is tuple and args:
            if len(args) != len(value):
                raise RecordError(f"{where}: expected {len(args)} values, got {len(value)}")
            return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        items = [_convert(v, args[0], f"{where}[{i}]") if args else v for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise RecordError(f"{where}: expected a table, got {value!r}")
        vt = args[1] if args else Any
        return {str(k): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise RecordError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(f"{where}: expected a number, got {value!r}{_number_hint(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise RecordError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: records cannot hold values of type {hint!r}")


def _as_toml_list(text: str) -> str:
    """``lite8,m`` as the TOML list it was probably meant to be: ``["lite8", "m"]`` (numbers unquoted)."""
    items = [t.strip() for t in text.strip("[]").split(",") if t.strip()]

    def item(t: str) -> str:
        try:
            float(t)
            return t
        except ValueError:
            return '"' + t.strip("'\"") + '"'
    return "[" + ", ".join(item(t) for t in items) + "]"


def _number_hint(value: Any) -> str:
    """How TOML writes a number Python would read (``.001``, ``1.``, ``1_0.``): said, since the text looks right."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    return f" (TOML writes it {number!r})"
