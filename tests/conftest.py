"""Suite-wide test plumbing, kept minimal: tests marked ``gpu`` are skipped, with the probe's reason,
on machines without a usable CUDA GPU (CuPy missing, no driver, no device)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from leaflens.kernels._cuda import gpu_probe  # imported only when gpu tests were collected

    ok, reason = gpu_probe()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"no GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)
