"""synth.json as a typed record: today's files read back key for key; one it cannot read is made again."""

from __future__ import annotations

import json

import pytest

from leaflens.data_prep.synth import CLASSES, SYNTH_META, BrokenFile, SynthInfo, SynthOptions, generate
from leaflens.records import RecordError

QUIET = {"log": lambda msg: None}

# synth.json as `leaflens data synth` wrote it before SynthInfo
PREVIOUS_SYNTH_JSON = {
    "generator": "leaflens data synth",
    "options": {"per_class": 4, "size": 96, "seed": 5, "broken": 3, "exif_fraction": 0.3},
    "classes": list(CLASSES),
    "images_per_class": 4,
    "backgrounds": ["soil", "hand", "sky", "bench", "grass"],
    "exif_rotated": [{"path": "rust/rust_0002.jpg", "orientation": 6}],
    "broken": [{"path": "healthy/healthy_0004.jpg", "kind": "truncated"},
               {"path": "rust/rust_0005.jpg", "kind": "empty"}],
}


def test_a_synth_json_written_by_the_previous_code_is_read():
    info = SynthInfo.from_dict(json.loads(json.dumps(PREVIOUS_SYNTH_JSON)))
    assert info.options == SynthOptions(per_class=4, size=96, seed=5, broken=3, exif_fraction=0.3)
    assert info.broken[1] == BrokenFile("rust/rust_0005.jpg", "empty")
    # written again, it gains the keys added since, at values that mean what the old file meant (no photo withheld)
    assert info.options.unlabeled_fraction == 0.0 and info.unlabeled == ()
    assert info.to_dict() == {**PREVIOUS_SYNTH_JSON, "unlabeled": [],
                              "options": {**PREVIOUS_SYNTH_JSON["options"], "unlabeled_fraction": 0.0}}


@pytest.mark.parametrize("change, message", [
    ({"colour": 1}, "unknown key 'colour'"),
    ({"options": {**PREVIOUS_SYNTH_JSON["options"], "sizes": 3}}, "options: unknown key 'sizes'"),
    ({"broken": [{"path": "a.jpg", "kind": "melted"}]}, "broken[0]: kind: 'melted' is not one of"),
])
def test_refusals_name_the_key(change, message):
    with pytest.raises(RecordError) as info:
        SynthInfo.from_dict({**PREVIOUS_SYNTH_JSON, **change})
    assert message in str(info.value)


def test_generate_writes_and_returns_the_record(tmp_path):
    out = tmp_path / "synth"
    opts = SynthOptions(per_class=2, size=32, seed=1, broken=3, exif_fraction=0.5)
    info = generate(out, opts, workers=1, **QUIET)
    assert SynthInfo.from_dict(json.loads((out / SYNTH_META).read_text(encoding="utf-8"))) == info
    assert info.options == opts and [b.kind for b in info.broken] == ["truncated", "empty", "not_an_image"]
    assert generate(out, opts, workers=1, **QUIET) == info  # up to date: read back, nothing rewritten
    # a synth.json this version cannot read is not trusted as up to date: the folder is made again
    (out / SYNTH_META).write_text(json.dumps({**info.to_dict(), "colour": "red"}), encoding="utf-8")
    assert generate(out, opts, workers=1, **QUIET) == info
    assert "colour" not in json.loads((out / SYNTH_META).read_text(encoding="utf-8"))
