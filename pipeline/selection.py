"""Which model a distill run keeps: the best of its candidates on validation, within a serving budget.

Candidates: the students the run trained (``distilled``, ``scratch``; with several members of the student
family, pipeline/models/family.py, each member's, named ``<member>/distilled`` and ``<member>/scratch``
after their folders in the run) and, when the teacher folder holds a servable fine-tuned teacher
(``teacher.onnx``, pipeline/teachers/served.py), the ``teacher``. Each is weighed by its validation
accuracy, its size (parameters) and its latency (milliseconds per photo at batch 1 on this machine, as served
with its out-of-domain check: :func:`measure_ms`). The rule (:func:`choose`):

1. A candidate is within the budget when its parameters are at most ``max_params`` and its latency at
   most ``max_ms`` (0: no limit on that figure).
2. The best student within the budget on validation accuracy is the default choice. Ties go to the
   smaller student (parameters), then the faster (ms per photo), then ``scratch``: a bigger model and
   distillation each have to earn their place.
3. The teacher replaces it when the teacher is within the budget and its validation accuracy is at
   least ``teacher_margin`` above that student's, or when no student is within the budget.
4. When no candidate is within the budget, the best student is kept and the report says so (a run
   never ends without a model; tighten the students' recipe or widen the budget).

Why a margin for the teacher: it is 10 to 40 times the size and latency of a student, and validation
splits are small (133 photos on iBeans: one photo is 0.75 points), so it is kept only for an advantage
a couple of photos cannot explain. On leaf photos the students matched it on test (iBeans: teacher and
scratch student both 95.3 %; a held-out 5-class leaf set: teacher 94.2 %, scratch 95.3 %), so a student
is expected to stay, as before (the rule has not been re-run on those validation splits); on pest photos,
where the 64 px student sees too little of a small insect (test: teacher 80.1 %, student 41.1 %), the
teacher would be shipped.

The two students of one member share one architecture, so they share one size and one latency figure:
measured once, noise can never put one inside a latency budget and the other outside.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from leaflens.engine.nn import Module
from leaflens.records import Record

__all__ = ["Budget", "Candidate", "Selection", "choose", "measure_ms"]


@dataclass(frozen=True)
class Budget(Record):
    """The serving budget and the teacher's margin (``[distill]`` max_params, max_ms, teacher_margin)."""

    max_params: int = 0      # 0: no limit
    max_ms: float = 0.0      # per photo at batch 1 on this machine; 0: no limit
    teacher_margin: float = 0.02  # validation accuracy (a fraction) the teacher must gain over the best student

    def __post_init__(self) -> None:
        if self.max_params < 0 or not (math.isfinite(self.max_ms) and self.max_ms >= 0):
            raise ValueError(f"max_params and max_ms must be >= 0 (0: no limit), got {self.max_params} and "
                             f"{self.max_ms}")
        if not 0.0 <= self.teacher_margin <= 1.0:
            raise ValueError(f"teacher_margin is a share of the validation photos in [0, 1], got "
                             f"{self.teacher_margin}")

    def over(self, params: int, ms: float | None) -> list[str]:
        """Why a model of ``params`` parameters answering in ``ms`` ms is over the budget (empty: within)."""
        out = []
        if self.max_params and params > self.max_params:
            out.append(f"{params:,} parameters > max_params {self.max_params:,}")
        if self.max_ms and (ms is None or ms > self.max_ms):
            out.append("latency not measured" if ms is None else f"{ms:.2f} ms per photo > max_ms {self.max_ms:g}")
        return out

    def describe(self) -> str:
        parts = [f"at most {self.max_params:,} parameters" if self.max_params else "any size",
                 f"at most {self.max_ms:g} ms per photo" if self.max_ms else "any latency"]
        return ", ".join(parts)


@dataclass(frozen=True)
class Candidate(Record):
    """One row of the report's candidate table."""

    name: str                         # distilled | scratch | teacher, or <member>/distilled | <member>/scratch
    kind: Literal["student", "teacher"]
    val_accuracy: float
    test_accuracy: float | None
    params: int
    ms_per_photo: float | None
    within_budget: bool = True
    kept: bool = False
    why: str = ""
    member: str | None = None         # the student's family member (pipeline/models/family.py)
    architecture: str | None = None   # the student's widths and input size, in words

    @property
    def is_scratch(self) -> bool:
        return self.kind == "student" and self.name.rsplit("/", 1)[-1] == "scratch"

    @property
    def rank(self) -> tuple[float, int, float, bool]:
        """Higher is better: validation accuracy, then fewer parameters, then fewer ms, then scratch."""
        return (self.val_accuracy, -self.params, -(math.inf if self.ms_per_photo is None else self.ms_per_photo),
                self.is_scratch)


@dataclass(frozen=True)
class Selection(Record):
    """What :func:`choose` decided: the kept candidate's name, why, and every candidate's row."""

    kept: str
    why: str
    budget: Budget
    candidates: tuple[Candidate, ...]
    within_budget: bool               # False: nothing fitted, the best student was kept anyway
    teacher_unavailable: str | None = None  # why the teacher was not a candidate (None: it was, or no teacher)
    timing: dict[str, Any] | None = None     # how ms_per_photo was measured (backend, threads, batch)
    best_student: str | None = None   # the best student by the rule (best.npz's), kept or not


def _pts(x: float) -> str:
    return f"{100 * x:+.1f} points"


def choose(candidates: Sequence[Candidate], budget: Budget, teacher_unavailable: str | None = None) -> Selection:
    """Apply the rule of the module docstring to ``candidates`` (at least one student)."""
    rows = {c.name: replace(c, within_budget=not budget.over(c.params, c.ms_per_photo)) for c in candidates}
    students = [c for c in rows.values() if c.kind == "student"]
    if not students:
        raise ValueError("choose() needs at least one student candidate")

    def best(of: Sequence[Candidate]) -> Candidate:
        return max(of, key=lambda c: c.rank)

    fitting = [c for c in students if c.within_budget]
    student = best(fitting or students)
    teacher = next((c for c in rows.values() if c.kind == "teacher"), None)
    kept, why = student, ""
    if teacher is not None and teacher.within_budget and not fitting:
        kept, why = teacher, "the only candidate within the budget"
    elif teacher is not None and teacher.within_budget:
        gain = teacher.val_accuracy - student.val_accuracy
        if gain >= budget.teacher_margin - 1e-12:
            kept, why = teacher, (f"best on validation, {_pts(gain)} over the best student ({student.name}), at least "
                                  f"the teacher_margin of {100 * budget.teacher_margin:g} points, within the budget")
    if kept is student:
        why = ("best student on validation" + (", within the budget" if fitting else
                                               ": no candidate is within the budget, so the best student is kept"))
    for name, c in rows.items():
        if c is kept:
            rows[name] = replace(c, kept=True, why=why)
            continue
        over = budget.over(c.params, c.ms_per_photo)
        if over:
            reason = "over the budget: " + "; ".join(over)
        elif c.kind == "teacher":
            gain = c.val_accuracy - student.val_accuracy
            reason = (f"{_pts(gain)} on validation over the best student ({student.name}), less than the "
                      f"teacher_margin of {100 * budget.teacher_margin:g} points: the smaller model is kept")
        elif c.val_accuracy == kept.val_accuracy and kept.kind == "student":
            reason = "ties on validation with the kept student, which is " + (
                "smaller" if c.params > kept.params else "faster" if c.rank[2] < kept.rank[2] else "the simpler recipe")
        else:
            reason = f"{_pts(c.val_accuracy - kept.val_accuracy)} on validation against the kept {kept.name}"
        rows[name] = replace(c, why=reason)
    return Selection(kept=kept.name, why=why, budget=budget, candidates=tuple(rows.values()),
                     within_budget=kept.within_budget, teacher_unavailable=teacher_unavailable,
                     best_student=student.name)


def measure_ms(model: Module, input_size: int, threads: int, seconds: float = 0.5,
               ood: Literal["branch", "own", "none"] = "branch") -> tuple[float, str]:
    """Median milliseconds per photo of ``model`` at batch 1 on this machine, and the backend measured:
    onnxruntime on the graph as it will be served (``threads`` CPU threads), else the engine's forward.

    As served means with its out-of-domain score (``ood``): "branch" with the generic branch export gives a
    student, "own" on the model's own blocks (the Lite0 teacher), "none" the logits alone. It more than doubled
    the demo student's time (about 0.23 -> 0.6 ms), so a budget on the network alone admitted models the server
    then ran slower than ``max_ms``. A student exported with --no-ood or --no-ood-branch is faster than timed.
    Decoding the photo is not included."""
    from leaflens.pipeline import ood as ood_check  # noqa: PLC0415  (it imports the apps' model card)

    original, was = model, model.training  # the stand-in is timed in eval mode, as served: put back after
    if ood != "none":
        model = ood_check.timing_stand_in(model, input_size, branch=ood == "branch")
    x = np.random.default_rng(0).standard_normal((1, input_size, input_size, 3)).astype(np.float32)
    try:
        import onnxruntime  # noqa: F401, PLC0415

        from leaflens.engine.onnx_export import export_onnx  # noqa: PLC0415
        from leaflens.pipeline.export.parity import cpu_session  # noqa: PLC0415
    except ImportError:
        from leaflens.engine import Tensor, no_grad  # noqa: PLC0415

        model.eval()

        def run() -> Any:
            with no_grad():
                return model(Tensor(x))
        backend = "engine"
    else:
        outputs = ("logits", ood_check.OOD_OUTPUT) if isinstance(model, ood_check.ServedModel) else "logits"
        graph = export_onnx(model, (3, input_size, input_size), output_name=outputs)
        sess = cpu_session(graph.SerializeToString(), threads)
        feed = {sess.get_inputs()[0].name: np.ascontiguousarray(x.transpose(0, 3, 1, 2))}

        def run() -> Any:
            return sess.run(None, feed)
        backend = "onnxruntime"
    try:
        for _ in range(2):  # warm-up: the first runs allocate and pick kernels
            run()
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 5:
            t = time.perf_counter()
            run()
            times.append((time.perf_counter() - t) * 1e3)
    finally:
        original.train(was)
    return float(np.median(times)), backend
