"""benchmarks/engine_speed.py --ab: the student step with each CPU path switched off against all on, on a
tiny batch (the figures themselves come from the full benchmark)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_speed.py"


def test_ab_reports_a_ratio_per_switch():
    res = subprocess.run([sys.executable, str(BENCH), "--cases", "student", "--ab", "fused,dynamic,winograd",
                          "--batch", "2", "--size", "16", "--rounds", "2", "--steps-scale", "0.1"],
                         capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    figures = json.loads(res.stdout.strip().splitlines()[-1])
    for switch in ("fused", "dynamic", "winograd"):
        assert figures[f"ab_student_{switch}"] > 0
    assert "fused off" in res.stdout and "all on" in res.stdout


def test_ab_rejects_an_unknown_switch():
    res = subprocess.run([sys.executable, str(BENCH), "--ab", "warp"], capture_output=True, text=True,
                         check=False, timeout=120)
    assert res.returncode != 0 and "unknown switch 'warp'" in res.stderr
