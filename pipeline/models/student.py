"""The student: a compact CNN that runs fast on a CPU and exports cleanly to ONNX.

Blocks of 3x3 conv -> BatchNorm -> ReLU -> 2x2 max-pool, then global average pooling gives the
embedding; a linear classifier gives the logits. For distillation, an optional linear projection
maps the embedding to the teacher's feature dimension; it is used only in training and is not
exported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from leaflens.engine import nn


def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.MaxPool2d(2))


class StudentCNN(nn.Module):
    def __init__(self, num_classes: int, widths: Sequence[int] = (32, 64, 128), in_channels: int = 3,
                 teacher_dim: int | None = None, dropout: float = 0.0):
        super().__init__()
        if not widths:
            raise ValueError("StudentCNN needs at least one conv block width")
        self.widths = list(widths)
        chans = [in_channels, *widths]
        self.features = nn.Sequential(*[conv_block(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.pool = nn.GlobalAvgPool2d()
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.classifier = nn.Linear(widths[-1], num_classes)
        self.projection = nn.Linear(widths[-1], teacher_dim) if teacher_dim else None

    @property
    def embed_dim(self) -> int:
        return self.widths[-1]

    def embed(self, x: Any) -> Any:
        """NHWC images -> (N, embed_dim) embedding."""
        return self.pool(self.features(x))

    def forward(self, x: Any) -> Any:
        return self.classifier(self.dropout(self.embed(x)))

    def forward_with_projection(self, x: Any) -> tuple[Any, Any]:
        """(logits, projected embedding) for distillation; needs ``teacher_dim``."""
        if self.projection is None:
            raise RuntimeError("StudentCNN was built without teacher_dim: no projection head to distil through")
        e = self.embed(x)
        return self.classifier(self.dropout(e)), self.projection(e)
