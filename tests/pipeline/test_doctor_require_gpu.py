"""``leaflens doctor --require-gpu``: exit 1 with the reason without a usable GPU, naming a CUDA library the
probe found missing and the install command for the driver; exit 0 and nothing on stderr otherwise."""

from __future__ import annotations

import re

import pytest

from leaflens.apps import providers
from leaflens.extras import install_command
from leaflens.kernels import _cuda
from leaflens.pipeline import gpu_stacks
from leaflens.pipeline.cli import main
from leaflens.pipeline.doctor import gpu_requirement_failure

ARGS = ["doctor", "--no-measure", "--no-bandwidth"]


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(providers, "_probes", {})
    yield
    monkeypatch.undo()
    _cuda.gpu_probe(refresh=True)


def test_require_gpu_fails_without_a_gpu(fresh, monkeypatch, capsys):
    monkeypatch.setenv(_cuda.DISABLE_ENV, "1")
    _cuda.gpu_probe(refresh=True)
    assert main(ARGS) == 0  # the report alone never fails
    capsys.readouterr()
    assert main([*ARGS, "--require-gpu"]) == 1
    captured = capsys.readouterr()
    assert "no GPU: disabled by" in captured.out  # the report is still printed
    assert captured.err.strip() == f"doctor: --require-gpu: no usable GPU: disabled by {_cuda.DISABLE_ENV}=1"


def test_require_gpu_names_a_missing_cuda_library(fresh, monkeypatch, capsys):
    reason = ("cuBLAS (libcublas.so.13) not found: install leaflens[gpu], which brings nvidia-cublas via cupy's "
              "[ctk] extra (ImportError: libcublas.so.13: cannot open shared object file)")
    monkeypatch.delenv(_cuda.DISABLE_ENV, raising=False)
    monkeypatch.setattr(_cuda, "_probe_result", (False, reason))
    installed = gpu_stacks._installed
    monkeypatch.setattr(gpu_stacks, "_installed",
                        lambda prefix: {"cupy-cuda13x": "14.0.0"} if prefix == "cupy" else installed(prefix))
    monkeypatch.setattr(gpu_stacks, "driver_cuda_version", lambda: 13000)
    monkeypatch.setattr(gpu_stacks, "_nvidia_smi", lambda: [])
    assert main([*ARGS, "--require-gpu"]) == 1
    captured = capsys.readouterr()
    assert re.search(r"\n +missing +libcublas\.so\.13\n", captured.out)  # the report's gpu stacks section
    assert captured.err.strip() == (f"doctor: --require-gpu: no usable GPU: {reason} (missing: libcublas.so.13); "
                                    f"for this driver: {install_command('gpu,teacher')}")


def test_a_usable_gpu_passes():
    assert gpu_requirement_failure({"gpu": {"available": True, "reason": "1 CUDA device(s)"}}) is None
    assert gpu_requirement_failure({"gpu": {"available": False, "reason": "x"}}) == "no usable GPU: x"
