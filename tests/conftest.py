"""Suite-wide test plumbing, kept minimal: tests marked ``gpu`` are skipped, with the probe's reason,
on machines without a usable CUDA GPU (CuPy missing, no driver, no device, a missing CUDA library).

With ``LEAFLENS_REQUIRE_GPU=1`` (``make gpu-check`` sets it) a gpu test that skips, for that reason or any
other (a skip inside the test or one of its fixtures), fails instead: on a GPU machine a skipped gpu test
is a test that proved nothing."""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

REQUIRE_GPU_ENV = "LEAFLENS_REQUIRE_GPU"


def _require_gpu() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0")


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and _require_gpu()
            and item.get_closest_marker("gpu") is not None):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_GPU_ENV}=1 and this gpu test was skipped: {reason}"
