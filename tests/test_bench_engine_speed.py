"""benchmarks/engine_speed.py's last line: one JSON object with the figures of every case, with --profile and
--ab too (tiny inference cases, a fraction of a second each)."""

from __future__ import annotations

import json

import pytest
from bench_helpers import run_script

TINY = ["--cases", "infer1,infer64", "--size", "16", "--rounds", "1", "--steps-scale", "0.05", "--no-memory"]


@pytest.mark.parametrize(("mode", "keys"), [
    (["--profile"], ("profile_{case}_ms_per_step", "profile_{case}_img_s", "profile_{case}_ops")),
    (["--ab", "fused"], ("ab_{case}_fused",)),
])
def test_the_last_line_is_one_json_object_with_every_case(mode, keys):
    out = run_script("engine_speed.py", *mode, *TINY)
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    for case in ("infer1", "infer64"):
        for key in keys:
            assert key.format(case=case) in last, (key, sorted(last))
    assert sum(line.startswith("{") for line in out.stdout.splitlines()) == 1  # no JSON line per case
