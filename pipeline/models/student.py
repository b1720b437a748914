"""The student: a compact CNN that runs fast on a CPU and exports cleanly to ONNX.

Blocks of 3x3 conv -> BatchNorm -> ReLU -> 2x2 max-pool (or, for a ``separable`` student, blocks after
the first made of a 3x3 depthwise conv -> BatchNorm -> ReLU -> 1x1 conv -> BatchNorm -> ReLU -> 2x2
max-pool), then global average pooling gives the embedding; a linear classifier gives the logits. For
distillation, an optional linear projection maps the embedding to the teacher's feature dimension; it
is used only in training and is not exported.

``StudentSpec`` is the one description of a student's architecture: the recipe's ``[model]``
section and the dataset's class count make one, distillation builds the network from it, and it is
what a run's checkpoint records as ``model_config`` and what loading a run rebuilds from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from leaflens.engine import nn
from leaflens.records import Record

if TYPE_CHECKING:
    from leaflens.pipeline.config import ModelSection


def conv_block(cin: int, cout: int, rng: np.random.Generator | None = None) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False, rng=rng), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.MaxPool2d(2))


def separable_block(cin: int, cout: int, rng: np.random.Generator | None = None) -> nn.Sequential:
    """A depthwise-separable block: 9 * cin + cin * cout conv weights instead of 9 * cin * cout. It ends in
    BatchNorm -> ReLU -> max-pool like :func:`conv_block`, so the engine's fused path serves that part too."""
    return nn.Sequential(nn.Conv2d(cin, cin, 3, padding=1, groups=cin, bias=False, rng=rng), nn.BatchNorm2d(cin),
                         nn.ReLU(), nn.Conv2d(cin, cout, 1, bias=False, rng=rng), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.MaxPool2d(2))


class StudentCNN(nn.Module):
    """The student network; ``rng`` gives its initial weights and its dropout masks, in that order (the
    trainer passes one made from the recipe's seed, see :mod:`leaflens.engine.random`)."""

    def __init__(self, num_classes: int, widths: Sequence[int] = (32, 64, 128), in_channels: int = 3,
                 teacher_dim: int | None = None, dropout: float = 0.0, *, separable: bool = False,
                 rng: np.random.Generator | None = None):
        super().__init__()
        if not widths:
            raise ValueError("StudentCNN needs at least one conv block width")
        self.widths = list(widths)
        chans = [in_channels, *widths]
        self.features = nn.Sequential(*[(separable_block if separable and i else conv_block)(a, b, rng)
                                        for i, (a, b) in enumerate(zip(chans[:-1], chans[1:]))])
        self.pool = nn.GlobalAvgPool2d()
        self.dropout = nn.Dropout(dropout, rng=rng) if dropout else nn.Identity()
        self.classifier = nn.Linear(widths[-1], num_classes, rng=rng)
        self.projection = nn.Linear(widths[-1], teacher_dim, rng=rng) if teacher_dim else None

    @property
    def embed_dim(self) -> int:
        return self.widths[-1]

    @property
    def first_conv(self) -> nn.Module:
        """The convolution that sees the photo (whose maps the run's feature_maps.png shows)."""
        first = self.features[0]
        assert isinstance(first, nn.Sequential)
        return first[0]

    def embed(self, x: Any) -> Any:
        """NHWC images -> (N, embed_dim) embedding."""
        return self.pool(self.features(x))

    def forward(self, x: Any) -> Any:
        return self.classifier(self.dropout(self.embed(x)))

    def forward_blocks(self, x: Any) -> tuple[Any, list[Any]]:
        """(logits, the output of every conv block): what the out-of-domain score reads
        (leaflens.pipeline.ood), from the same pass that gives the answer."""
        blocks = []
        for block in self.features:
            x = block(x)
            blocks.append(x)
        return self.classifier(self.dropout(self.pool(x))), blocks

    def forward_with_projection(self, x: Any) -> tuple[Any, Any]:
        """(logits, projected embedding) for distillation; needs ``teacher_dim``."""
        if self.projection is None:
            raise RuntimeError("StudentCNN was built without teacher_dim: no projection head to distil through")
        e = self.embed(x)
        return self.classifier(self.dropout(e)), self.projection(e)


@dataclass(frozen=True)
class StudentSpec(Record):
    """A student's architecture, as a run's checkpoint records it (``model_config``).

    ``in_channels`` and ``dropout`` have defaults only because checkpoints written before they were
    recorded lack them (RGB input, no dropout); a recipe's values come from ``[model]``. ``block`` is
    recorded only for depthwise-separable students (absent: 3x3 conv blocks, as every run before it).
    """

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset({"block", "trunk_blocks"})
    num_classes: int
    widths: tuple[int, ...]
    in_channels: int = 3
    dropout: float = 0.0
    kind: Literal["student_cnn", "lite0_trunk"] = "student_cnn"
    block: Literal["separable"] | None = None
    trunk_blocks: int | None = None  # kind "lite0_trunk": Lite0 blocks in the trunk (widths: its head's width)

    def __post_init__(self) -> None:
        if (self.kind == "lite0_trunk") != (self.trunk_blocks is not None):
            raise ValueError(f"model_config: trunk_blocks goes with kind 'lite0_trunk' (kind {self.kind!r}, "
                             f"trunk_blocks {self.trunk_blocks!r})")

    @classmethod
    def from_recipe(cls, model: ModelSection, num_classes: int) -> StudentSpec:
        """The student the recipe's ``[model]`` section describes, for ``num_classes`` classes."""
        if model.block == "lite0":
            return cls(num_classes=num_classes, widths=(int(model.widths[-1]),), dropout=model.dropout,
                       kind="lite0_trunk", trunk_blocks=int(model.trunk_blocks))
        return cls(num_classes=num_classes, widths=tuple(model.widths), dropout=model.dropout,
                   block="separable" if model.block == "separable" else None)

    @property
    def pretrained(self) -> bool:
        """Whether :meth:`build` starts from pretrained weights when given the input normalisation."""
        return self.kind == "lite0_trunk"

    def build(self, rng: np.random.Generator, teacher_dim: int | None = None,
              normalisation: tuple[Sequence[float], Sequence[float]] | None = None,
              trunk_from: str | os.PathLike[str] | None = None) -> Any:
        """The network (with a distillation projection to ``teacher_dim`` when given), its initial weights
        and dropout masks drawn from ``rng``. A pretrained student (:attr:`pretrained`) given the input's
        ``normalisation`` (mean, std) then loads its ImageNet weights, or, given ``trunk_from`` (a fine-tuned
        teacher's ``model.npz``), the teacher's; without ``normalisation``, its weights stay random (to be
        replaced by a checkpoint's)."""
        if self.kind == "lite0_trunk":
            from leaflens.pipeline.models.trunk import LiteTrunkStudent  # noqa: PLC0415

            model = LiteTrunkStudent(self.num_classes, blocks=int(self.trunk_blocks or 0), head=self.widths[-1],
                                     teacher_dim=teacher_dim, dropout=self.dropout, rng=rng)
            if normalisation is not None and trunk_from is not None:
                model.load_teacher_trunk(trunk_from, *normalisation)
            elif normalisation is not None:
                model.load_pretrained(*normalisation)
            return model
        return StudentCNN(self.num_classes, widths=self.widths, in_channels=self.in_channels,
                          teacher_dim=teacher_dim, dropout=self.dropout, separable=self.block == "separable",
                          rng=rng)
