"""A pretrained student: the first blocks of ImageNet EfficientNet-Lite0, a small head, fine-tuned and distilled.

A student trained from scratch on a thousand photos learns what it can from them alone: on fine-grained
pest photos the 64 px CNN reached 45-48 % where the fine-tuned teacher reached 86 % (benchmarks/insects.py).
The first blocks of a network trained on ImageNet are generic colour, texture and part detectors; cut there,
they are as small as the scratch student (8 blocks: 254 k weights, stride 16) and start from features that
already tell an insect's legs from a leaf's veins. The trunk is followed by a 1x1 conv to ``head`` channels
(BatchNorm, ReLU6), global average pooling (the embedding), dropout and a linear classifier; distillation
adds a linear projection to the teacher's feature dimension, as for :class:`StudentCNN`.

The student's input is normalised with the dataset's mean and std; Lite0's weights expect (pixel - 127) / 128.
A per-channel affine in the graph (``input_scale``, ``input_shift``: buffers, saved with the weights, set by
:meth:`LiteTrunkStudent.load_pretrained`) turns one into the other before the stem, so the network takes the
pipeline's input as every student does and its zero padding is Lite0's. (Folded into the stem convolution
instead, the padding would differ: 4 % off after 8 blocks at 64 px.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from leaflens.engine import Tensor, nn, ops
from leaflens.pipeline.models.efficientnet import BlockSpec, LiteConfig, MBConv, _conv_padding, tf_input_affine

__all__ = ["LITE0_BLOCKS", "LiteTrunkStudent", "lite0_block_specs"]

# EfficientNet-Lite0's stages: (expansion, kernel, stride, output channels, repeats); stem 32 channels.
_LITE0_STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
                 (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
_STEM = 32
LITE0_BLOCKS = sum(r for *_, r in _LITE0_STAGES)  # 16


def lite0_block_specs() -> list[BlockSpec]:
    """EfficientNet-Lite0's 16 blocks (what its ImageNet weights describe; a test checks them against the file)."""
    specs, cin = [], _STEM
    for expand, kernel, stride, cout, repeats in _LITE0_STAGES:
        for i in range(repeats):
            specs.append(BlockSpec(cin=cin, cout=cout, hidden=cin * expand, kernel=kernel,
                                   stride=stride if i == 0 else 1))
            cin = cout
    return specs


class LiteTrunkStudent(nn.Module):
    """Stem + the first ``blocks`` Lite0 blocks + 1x1 conv to ``head`` -> pooled embedding -> classifier.

    ``rng`` gives the initial weights (all of them random: :func:`load_pretrained` then replaces the stem's
    and the blocks' by ImageNet's) and the dropout masks, as for :class:`StudentCNN`."""

    def __init__(self, num_classes: int, blocks: int = 8, head: int = 256, teacher_dim: int | None = None,
                 dropout: float = 0.0, *, rng: np.random.Generator | None = None):
        super().__init__()
        if not 1 <= blocks <= LITE0_BLOCKS:
            raise ValueError(f"a Lite0 trunk has 1 to {LITE0_BLOCKS} blocks, got {blocks}")
        if head < 1:
            raise ValueError(f"the trunk's head needs at least 1 channel, got {head}")
        self.config = LiteConfig()
        self.specs = lite0_block_specs()[:blocks]
        cfg = self.config
        self.register_buffer("input_scale", np.ones(3, np.float32))  # identity until load_pretrained
        self.register_buffer("input_shift", np.zeros(3, np.float32))
        self.stem_conv = nn.Conv2d(3, _STEM, 3, stride=2, padding=_conv_padding(cfg, 3), bias=False, rng=rng)
        self.stem_bn = nn.BatchNorm2d(_STEM, eps=cfg.bn_eps, momentum=cfg.bn_momentum)
        self.blocks = nn.Sequential(*[MBConv(s, cfg, rng=rng) for s in self.specs])
        self.head_conv = nn.Conv2d(self.specs[-1].cout, head, 1, bias=False, rng=rng)
        self.head_bn = nn.BatchNorm2d(head, eps=cfg.bn_eps, momentum=cfg.bn_momentum)
        self.pool = nn.GlobalAvgPool2d()
        self.dropout = nn.Dropout(dropout, rng=rng) if dropout else nn.Identity()
        self.classifier = nn.Linear(head, num_classes, rng=rng)
        self.projection = nn.Linear(head, teacher_dim, rng=rng) if teacher_dim else None
        self.head_channels = head

    @property
    def embed_dim(self) -> int:
        return self.head_channels

    @property
    def first_conv(self) -> nn.Module:
        """The convolution that sees the photo (whose maps the run's feature_maps.png shows)."""
        return self.stem_conv

    def _stage_ends(self) -> list[int]:
        n = len(self.specs)
        return [i for i, s in enumerate(self.specs) if i + 1 == n or self.specs[i + 1].cout != s.cout]

    def _trunk(self, x: Any, maps: list[Any] | None = None) -> Any:
        x = x * Tensor(self.input_scale) + Tensor(self.input_shift)
        pre = self.stem_bn(self.stem_conv(x))
        h = ops.relu6(pre)
        ends = set(self._stage_ends()) if maps is not None else set()
        if maps is not None:
            maps.append(pre)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i in ends:
                maps.append(h)  # type: ignore[union-attr]
        return h

    def _embed_from(self, h: Any) -> Any:
        return self.pool(ops.relu6(self.head_bn(self.head_conv(h))))

    def embed(self, x: Any) -> Any:
        """NHWC images -> (N, head) embedding."""
        return self._embed_from(self._trunk(x))

    def forward(self, x: Any) -> Any:
        return self.classifier(self.dropout(self.embed(x)))

    def forward_blocks(self, x: Any) -> tuple[Any, list[Any]]:
        """(logits, the stem's map before its ReLU6 and the last block's output of every stage): what the
        out-of-domain score reads, as :meth:`EfficientNetLite.forward_blocks` gives the teacher's."""
        maps: list[Any] = []
        h = self._trunk(x, maps)
        return self.classifier(self.dropout(self._embed_from(h))), maps

    def forward_with_projection(self, x: Any) -> tuple[Any, Any]:
        """(logits, projected embedding) for distillation; needs ``teacher_dim``."""
        if self.projection is None:
            raise RuntimeError("LiteTrunkStudent was built without teacher_dim: no projection head to distil through")
        e = self.embed(x)
        return self.classifier(self.dropout(e)), self.projection(e)

    def freeze_trunk_batchnorm(self) -> int:
        """Make the stem's and the blocks' BatchNorm layers (those whose statistics come with the pretrained
        weights) use and keep their running statistics in training too; the new head's still learns its own.
        Returns how many were frozen."""
        return nn.freeze_batchnorm(self.stem_bn) + nn.freeze_batchnorm(self.blocks)

    def load_pretrained(self, mean: Sequence[float], std: Sequence[float],
                        weights: str | os.PathLike[str] | None = None) -> str:
        """Replace the stem's and the blocks' weights and BatchNorm statistics by ImageNet Lite0's, and set the
        input affine from the pipeline's normalisation (``mean``, ``std`` on the [0, 1] scale); returns the file read.
        Raises :class:`leaflens.pipeline.models.pretrained.WeightsNotFoundError` (saying what to install)."""
        from leaflens.pipeline.models.pretrained import find_lite0_weights, load_efficientnet_lite0  # noqa: PLC0415

        path = find_lite0_weights(weights)
        net = load_efficientnet_lite0(path)
        self._load_trunk_of(net, mean, std, str(path))
        return str(path)

    def load_teacher_trunk(self, path: str | os.PathLike[str], mean: Sequence[float], std: Sequence[float]) -> str:
        """Replace the stem's and the blocks' weights and BatchNorm statistics by those of a fine-tuned teacher
        (a teacher folder's ``model.npz``, :mod:`leaflens.pipeline.teachers.served`) and set the input affine;
        returns the file read. The teacher has learnt the user's classes with these very blocks, at its own
        input size: a student cut from it starts where ImageNet's weights would take it many epochs to get.
        ValueError naming the file when its network is not EfficientNet-Lite0's blocks as this trunk runs them."""
        from leaflens.pipeline.teachers.served import load_teacher_model  # noqa: PLC0415

        net, _ = load_teacher_model(os.fspath(path))
        ours, theirs = self.config, net.config
        if net.folded or ((theirs.padding, theirs.normalization, theirs.bn_eps)
                          != (ours.padding, ours.normalization, ours.bn_eps)):
            raise ValueError(f"{path}: the teacher's network (padding {theirs.padding!r}, normalisation "
                             f"{theirs.normalization!r}, BatchNorm eps {theirs.bn_eps:g}"
                             f"{', BatchNorm folded' if net.folded else ''}) is not run as a Lite0 trunk is (padding "
                             f"{ours.padding!r}, normalisation {ours.normalization!r}, eps {ours.bn_eps:g})")
        self._load_trunk_of(net, mean, std, str(path))
        return str(path)

    def _load_trunk_of(self, net: Any, mean: Sequence[float], std: Sequence[float], source: str) -> None:
        if net.specs[:len(self.specs)] != self.specs or net.stem_channels != _STEM:
            raise ValueError(f"{source} does not describe EfficientNet-Lite0's first "
                             f"{len(self.specs)} blocks: {net.specs[:len(self.specs)]}")
        state = {k: v for k, v in net.state_dict().items() if k.split(".")[0] in ("stem_conv", "stem_bn")
                 or (k.startswith("blocks.") and int(k.split(".")[1]) < len(self.specs))}
        state["input_scale"], state["input_shift"] = tf_input_affine(mean, std)
        self.load_state_dict({**self.state_dict(), **state})  # strict: a name the trunk lacks is refused
