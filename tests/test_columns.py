"""Tables whose names are not in Latin letters still line up (leaflens.columns)."""

from __future__ import annotations

from pathlib import Path

from leaflens.columns import display_width, pad_right
from leaflens.data_prep.ingest import IngestReport, format_summary


def test_wide_and_combining_characters_take_their_terminal_cells() -> None:
    assert display_width("rust") == 4
    assert display_width("叶锈病") == 6  # each CJK character takes two cells
    assert display_width("ｒｕｓｔ") == 8  # full-width Latin
    assert display_width("cafe\u0301") == 4  # e + combining acute: one cell
    assert pad_right("叶锈病", 8) == "叶锈病  " and pad_right("rust", 8) == "rust    "
    assert pad_right("too long a name", 4) == "too long a name"


def test_preprocess_summary_columns_line_up_with_chinese_class_names() -> None:
    report = IngestReport(out=Path("ds"), up_to_date=False, classes=["healthy", "叶锈病"],
                          counts={"train": {"healthy": 10, "叶锈病": 8}, "val": {"healthy": 2, "叶锈病": 2}})
    rows = format_summary(report).splitlines()[:3]
    ends = {display_width(row) for row in rows}
    assert len(ends) == 1, rows  # the count columns end at the same cell on every row
