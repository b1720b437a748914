"""leaflens.records: typed records round-trip through JSON and refuse what they do not know, by name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pytest

from leaflens.records import Record, RecordError


@dataclass(frozen=True)
class Inner(Record):
    size: int
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Outer(Record):
    SCHEMA_VERSION: ClassVar[int | None] = 2
    name: str
    inner: Inner
    layers: tuple[Inner, ...] = ()
    kind: Literal["a", "b"] = "a"
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = 2

    @classmethod
    def _upgrade(cls, data: dict[str, Any], version: int, where: str) -> dict[str, Any]:
        data = dict(data)
        if "title" in data:
            data["name"] = data.pop("title")
        return data


def test_round_trip_through_json():
    rec = Outer("x", Inner(64, (0.5, 0.25, 1.0)), (Inner(1), Inner(2)), "b", None, {"k": [1, 2]})
    again = Outer.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert again == rec
    assert rec.to_dict()["inner"] == {"size": 64, "mean": [0.5, 0.25, 1.0]}


@pytest.mark.parametrize("data, message", [
    ({"name": "x", "inner": {"size": 1}, "colour": 3}, "f.json: unknown key 'colour'"),
    ({"name": "x", "inner": {"size": 1, "szie": 2}}, "f.json: inner: unknown key 'szie'"),
    ({"inner": {"size": 1}}, "f.json: required key 'name' is missing"),
    ({"name": "x", "inner": {"size": "64"}}, "f.json: inner: size: expected an integer"),
    ({"name": "x", "inner": {"size": True}}, "expected an integer"),
    ({"name": "x", "inner": {"size": 1, "mean": [1, 2]}}, "expected 3 values"),
    ({"name": "x", "inner": {"size": 1}, "kind": "c"}, "kind: 'c' is not one of 'a', 'b'"),
    ({"name": "x", "inner": {"size": 1}, "layers": [{"size": 1}, {"size": 1.5}]}, "layers[1]: size"),
    ({"name": "x", "inner": {"size": 1}, "schema_version": 3}, "written by a newer leaflens"),
    ([1, 2], "expected a table"),
])
def test_refusals_name_the_key(data, message):
    with pytest.raises(RecordError, match=None) as info:
        Outer.from_dict(data, "f.json")
    assert message in str(info.value)


def test_older_versions_are_upgraded():
    rec = Outer.from_dict({"title": "old", "inner": {"size": 3}, "schema_version": 1})
    assert rec.name == "old" and rec.schema_version == 2
    rec = Outer.from_dict({"title": "older", "inner": {"size": 3}})  # no version: the first one
    assert rec.name == "older"


def test_ints_are_accepted_as_floats_and_optional_values_as_none():
    rec = Outer.from_dict({"name": "x", "inner": {"size": 1, "mean": [0, 1, 2]}, "note": None})
    assert rec.inner.mean == (0.0, 1.0, 2.0) and all(isinstance(v, float) for v in rec.inner.mean)


@dataclass(frozen=True)
class Formatted(Record):
    """A record whose files carried their version under another key before records existed."""

    SCHEMA_VERSION: ClassVar[int | None] = 2
    VERSION_KEY: ClassVar[str] = "format_version"
    size: int
    format_version: int = 2

    @classmethod
    def _upgrade(cls, data: dict[str, Any], version: int, where: str) -> dict[str, Any]:
        return {**data, "size": data["size"] * 10}


def test_the_version_can_live_under_another_key():
    assert Formatted.from_dict({"size": 3, "format_version": 1}) == Formatted(30, 2)
    assert Formatted.from_dict({"size": 3, "format_version": 2}).size == 3
    with pytest.raises(RecordError, match="format_version 3"):
        Formatted.from_dict({"size": 3, "format_version": 3})
    with pytest.raises(RecordError, match="'format_version' must be an integer"):
        Formatted.from_dict({"size": 3, "format_version": "2"})
    with pytest.raises(RecordError, match="unknown key 'schema_version'"):
        Formatted.from_dict({"size": 3, "schema_version": 2})


@dataclass(frozen=True)
class Sparse(Record):
    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"note"})
    size: int
    note: str | None = None
    other: str | None = None


def test_fields_can_be_left_out_when_none():
    assert Sparse(1).to_dict() == {"size": 1, "other": None}
    assert Sparse(1, "x").to_dict() == {"size": 1, "note": "x", "other": None}
    assert Sparse.from_dict({"size": 1, "other": None}) == Sparse(1)
