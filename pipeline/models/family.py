"""The student family: named variants of the ``[model]`` student that `leaflens distill` trains side by side.

``[model] family`` lists the members to train (``--family s,m`` or ``--set model.family='["s", "m"]'``);
the run keeps the best on validation within the serving budget (leaflens.pipeline.selection). A member's
name is a size, then optionally ``-ds``, then optionally ``@<px>``:

- ``s``, ``m``, ``l``: the ``[model]`` widths times 0.5, 1 and 1.5. With the default widths (32-64-128-256):
  16-32-64-128, 32-64-128-256 and 48-96-192-384, about 0.10 M, 0.39 M and 0.88 M parameters.
- ``-ds``: depthwise-separable blocks after the first one (3x3 depthwise conv + BatchNorm + ReLU, then
  1x1 conv + BatchNorm + ReLU, then the 2x2 max-pool), about an eighth of a plain block's weights; the
  first block stays a full 3x3 conv, since a depthwise conv of the 3 colour channels mixes nothing.
- ``liteN``: a pretrained student (leaflens.pipeline.models.trunk): the first N of ImageNet EfficientNet-Lite0's
  16 blocks and a ``widths[-1]``-wide 1x1 head, fine-tuned and distilled like the others (``lite8``: 0.28 M
  exported parameters, stride 16). Needs the Lite0 weights (``leaflens[teacher]``), as the default teacher does.
- ``@<px>``: that input size instead of ``model.input_size`` (never above the dataset's stored size, as
  for the single student: photos are not blown up). Small insects may need more pixels than 64.

``m`` is the ``[model]`` section itself, so the default family ``["m"]`` trains exactly the one student
the recipe describes, with the run's folders and report as before families existed.

A member is a ``ModelSection`` like the recipe's own: distillation trains it with the recipe whose
``[model]`` is replaced by the member's, so every other setting is shared.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from leaflens.pipeline.config import ModelSection

__all__ = ["SCALES", "Member", "check_family", "family_option", "members"]

SCALES = {"s": 0.5, "m": 1.0, "l": 1.5}  # width multipliers of the [model] widths
_NAME = re.compile(r"^(?:(?P<size>[a-z]+)(?P<ds>-ds)?|lite(?P<trunk>\d+))(?:@(?P<px>\d+))?$")
_HOW = ("a member is s, m or l (the [model] widths x0.5, x1, x1.5), optionally followed by -ds "
        "(depthwise-separable blocks), or liteN (the first N of ImageNet EfficientNet-Lite0's 16 blocks, "
        "pretrained), each optionally followed by @<px> (its own input size, at least 8), e.g. \"m\", \"s-ds\", "
        "\"m@96\", \"lite8@128\"")


@dataclass(frozen=True)
class Member:
    """One member of the family: its name and the ``[model]`` section it is trained with."""

    name: str
    model: ModelSection

    def describe(self, input_size: int | None = None) -> str:
        """``32-64-128-256, 64 px`` (``, separable`` for depthwise-separable blocks); ``input_size``: the
        side the member actually sees on the dataset (its own setting is capped at the stored size)."""
        size = self.model.input_size if input_size is None else input_size
        px = "stored size" if size <= 0 else f"{size} px"
        if self.model.block == "lite0":
            return f"ImageNet Lite0 blocks 0-{self.model.trunk_blocks - 1} + {self.model.widths[-1]}-wide head, {px}"
        return (f"{'-'.join(map(str, self.model.widths))}, {px}"
                + (", separable" if self.model.block == "separable" else ""))


def _parse(name: str) -> tuple[float, bool, int | None, int | None]:
    """(width multiplier, separable, input size or None, Lite0 trunk blocks or None) of a member name;
    ValueError naming the field."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if (m is None or (m["trunk"] is None and m["size"] not in SCALES) or (m["px"] is not None and int(m["px"]) < 8)
            or (m["trunk"] is not None and not 1 <= int(m["trunk"]) <= 16)):
        raise ValueError(f"family: unknown member {name!r}: {_HOW}")
    px = None if m["px"] is None else int(m["px"])
    if m["trunk"] is not None:
        return 1.0, False, px, int(m["trunk"])
    return SCALES[m["size"]], m["ds"] is not None, px, None


def check_family(names: Sequence[str]) -> None:
    """Refuse an empty family, an unknown member name or a repeated one (``model.family``)."""
    if not names:
        raise ValueError(f"family: at least one member is needed (default: [\"lite8\"]); {_HOW}")
    for name in names:
        _parse(name)
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise ValueError(f"family: member {repeated[0]!r} is listed twice")


def family_option(text: str) -> tuple[str, ...]:
    """The member names of a ``--family`` option (``leaflens distill``, ``leaflens doctor``): comma-separated,
    blanks ignored; not checked here (check_family, or the recipe's own check, does that)."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def escalation_names(model: ModelSection) -> tuple[str, ...]:
    """The ``model.escalate`` members not already in ``model.family``: a member is trained once."""
    return tuple(n for n in model.escalate if n not in model.family)


def members(model: ModelSection, names: Sequence[str] | None = None) -> list[Member]:
    """The members ``model.family`` lists (or ``names``, e.g. ``model.escalate``), each with its own ``[model]``
    section (widths scaled, block kind and input size set), in the listed order."""
    names = model.family if names is None else tuple(names)
    check_family(names)
    out = []
    for name in names:
        scale, separable, px, trunk = _parse(name)
        widths = tuple(max(1, round(w * scale)) for w in model.widths)
        block = "lite0" if trunk is not None else "separable" if separable else model.block
        out.append(Member(name, dataclasses.replace(
            model, family=(name,), escalate=(), widths=widths, block=block,
            trunk_blocks=model.trunk_blocks if trunk is None else trunk,
            input_size=model.input_size if px is None else px)))
    return out
