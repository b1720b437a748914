"""Fixtures for the serving tests (helpers live in apps_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from apps_helpers import build_tiny_model, leaflens_metadata, ood_metadata, tiny_weights  # noqa: E402


@pytest.fixture
def tiny_model(tmp_path: Path) -> Callable[..., tuple[Path, dict[str, np.ndarray]]]:
    """Factory: tiny_model(classes=..., size=16, seed=0, name=..., drop=(), weights=None, ood_threshold=None,
    **metadata). With ``ood_threshold`` the model is format 3 with the ``ood_score`` output of
    apps_helpers.build_tiny_model (grey photos score 0, colourful ones about -0.33) judged at that threshold."""

    def make(classes: list[str] | None = None, size: int = 16, seed: int = 0, name: str = "tiny.onnx",
             drop: tuple[str, ...] = (), weights: dict[str, np.ndarray] | None = None,
             ood_threshold: float | None = None, **extra: str) -> tuple[Path, dict[str, np.ndarray]]:
        classes = classes or ["angular_leaf_spot", "bean_rust", "healthy"]
        weights = weights or tiny_weights(len(classes), seed)
        if ood_threshold is not None:
            extra = {**ood_metadata(ood_threshold, size), **extra}
        meta = leaflens_metadata(classes, size, **extra)
        for key in drop:
            meta.pop(key)
        return build_tiny_model(tmp_path / name, weights, size, meta, ood=ood_threshold is not None), weights

    return make
