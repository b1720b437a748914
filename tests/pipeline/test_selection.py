"""The rule that picks the kept model among the students and the teacher, within the serving budget."""

from __future__ import annotations

import numpy as np
import pytest

from leaflens.engine import nn
from leaflens.pipeline.selection import Budget, Candidate, choose, measure_ms


def _cands(d=0.80, s=0.82, t=0.95, t_params=3_400_000, t_ms=12.0):
    return [Candidate("distilled", "student", d, d - 0.01, 390_000, 0.5),
            Candidate("scratch", "student", s, s - 0.01, 390_000, 0.5),
            Candidate("teacher", "teacher", t, t - 0.01, t_params, t_ms)]


def _row(sel, name):
    return next(c for c in sel.candidates if c.name == name)


def test_a_teacher_that_wins_by_the_margin_within_the_budget_is_kept():
    sel = choose(_cands(), Budget())
    assert sel.kept == "teacher" and sel.within_budget
    assert _row(sel, "teacher").kept and "+13.0 points over the best student (scratch)" in sel.why
    assert not _row(sel, "scratch").kept and "against the kept teacher" in _row(sel, "scratch").why


def test_the_teacher_is_not_kept_over_max_params_or_max_ms():
    sel = choose(_cands(), Budget(max_params=1_000_000))
    assert sel.kept == "scratch" and sel.within_budget
    t = _row(sel, "teacher")
    assert not t.kept and not t.within_budget and "3,400,000 parameters > max_params 1,000,000" in t.why
    sel = choose(_cands(), Budget(max_ms=5.0))
    t = _row(sel, "teacher")
    assert sel.kept == "scratch" and not t.within_budget and "12.00 ms per photo > max_ms 5" in t.why
    # both limits met: kept
    assert choose(_cands(), Budget(max_params=4_000_000, max_ms=20.0)).kept == "teacher"


def test_the_teacher_must_beat_the_best_student_by_the_margin():
    sel = choose(_cands(t=0.83), Budget(teacher_margin=0.02))  # +1 point over scratch's 82 %
    assert sel.kept == "scratch"
    assert "less than the teacher_margin of 2 points" in _row(sel, "teacher").why
    assert choose(_cands(t=0.83), Budget(teacher_margin=0.01)).kept == "teacher"
    assert choose(_cands(t=0.80), Budget(teacher_margin=0.0)).kept == "scratch"  # worse: never kept


def test_students_tie_to_scratch_and_the_better_student_wins():
    assert choose(_cands(d=0.82, s=0.82, t=0.5), Budget()).kept == "scratch"
    sel = choose(_cands(d=0.85, s=0.82, t=0.5), Budget())
    assert sel.kept == "distilled" and "-3.0 points" in _row(sel, "scratch").why


def test_when_nothing_fits_the_best_student_is_kept_and_flagged():
    sel = choose(_cands(), Budget(max_params=1000))
    assert sel.kept == "scratch" and not sel.within_budget and "no candidate is within the budget" in sel.why
    assert not any(c.within_budget for c in sel.candidates)
    # only the teacher fits (a latency budget the students' figure misses): the teacher, whatever the margin
    cands = _cands(t=0.5)
    cands[2] = Candidate("teacher", "teacher", 0.5, 0.5, 3_400_000, 0.1)
    sel = choose(cands, Budget(max_ms=0.2))
    assert sel.kept == "teacher" and sel.why == "the only candidate within the budget"


def test_budget_and_selection_records_round_trip_and_refuse_nonsense():
    sel = choose(_cands(), Budget(max_params=10**7, max_ms=50.0), teacher_unavailable=None)
    assert type(sel).from_dict(sel.to_dict()) == sel
    with pytest.raises(ValueError, match="max_params and max_ms must be >= 0"):
        Budget(max_params=-1)
    with pytest.raises(ValueError, match="teacher_margin"):
        Budget(teacher_margin=1.5)
    with pytest.raises(ValueError, match="at least one student"):
        choose(_cands()[2:], Budget())


def test_measure_ms_times_a_forward_at_batch_one():
    rng = np.random.default_rng(0)
    small = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, rng=rng), nn.GlobalAvgPool2d(), nn.Linear(4, 2, rng=rng))
    big = nn.Sequential(*[m for i in range(6) for m in (nn.Conv2d(3 if i == 0 else 64, 64, 3, padding=1, rng=rng),
                                                           nn.ReLU())], nn.GlobalAvgPool2d(), nn.Linear(64, 2, rng=rng))
    ms_small, backend = measure_ms(small, 32, threads=1, seconds=0.2)
    ms_big, _ = measure_ms(big, 32, threads=1, seconds=0.2)
    assert backend in ("onnxruntime", "engine") and 0 < ms_small < ms_big  # ~100x the work


def test_timing_a_model_as_served_leaves_it_as_it_was():
    """The stand-in's own switches set the student training again, which distill then drew its figures with."""
    from leaflens.pipeline.models.student import StudentCNN  # noqa: PLC0415

    model = StudentCNN(3, widths=(4, 8), rng=np.random.default_rng(0)).eval()
    for ood in ("branch", "own", "none"):
        measure_ms(model, 16, threads=1, seconds=0.05, ood=ood)
        assert not model.training and not any(m.training for m in model.modules()), ood
