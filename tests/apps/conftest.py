"""Fixtures for the serving tests (helpers live in apps_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from apps_helpers import build_tiny_model, leaflens_metadata, tiny_weights  # noqa: E402


@pytest.fixture
def tiny_model(tmp_path: Path) -> Callable[..., tuple[Path, dict[str, np.ndarray]]]:
    """Factory: tiny_model(classes=..., size=16, seed=0, name=..., drop=(), weights=None, **metadata)."""

    def make(classes: list[str] | None = None, size: int = 16, seed: int = 0, name: str = "tiny.onnx",
             drop: tuple[str, ...] = (), weights: dict[str, np.ndarray] | None = None,
             **extra: str) -> tuple[Path, dict[str, np.ndarray]]:
        classes = classes or ["angular_leaf_spot", "bean_rust", "healthy"]
        weights = weights or tiny_weights(len(classes), seed)
        meta = leaflens_metadata(classes, size, **extra)
        for key in drop:
            meta.pop(key)
        return build_tiny_model(tmp_path / name, weights, size, meta), weights

    return make
