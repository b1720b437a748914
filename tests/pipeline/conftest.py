"""Fixtures shared by the pipeline tests."""

from __future__ import annotations

import pytest
from test_teacher_finetune import tiny_net

from leaflens.pipeline.teachers import effnet


@pytest.fixture
def tiny_lite0(monkeypatch, tmp_path):
    """The teacher stage builds a tiny random EfficientNet-Lite (tiny_net) in place of the ImageNet
    EfficientNet-Lite0, from an empty stand-in weights file."""
    weights = tmp_path / "tiny.pth"
    weights.write_bytes(b"")
    monkeypatch.setattr(effnet, "find_lite0_weights", lambda path=None: weights)
    monkeypatch.setattr(effnet, "load_efficientnet_lite0", lambda path, cfg: tiny_net(cfg))
