"""The GPU probe's NVRTC and cuBLAS stages on a CuPy stand-in (NumPy underneath): a working stack passes, a
missing library is named by its file with where it comes from, a wrong result fails, and the CuPy-wheel table
agrees with the serving side's."""

from __future__ import annotations

import sys
import types

import numpy as np

from leaflens.apps.providers import GPU_EXTRAS
from leaflens.extras import install_command
from leaflens.kernels import _cuda
from leaflens.pipeline.gpu_stacks import missing_libraries


class FakeKernel:
    """A RawKernel whose launch computes the probe kernel's maths in NumPy (y = 2x + i)."""

    def __init__(self, source: str, name: str, fail: BaseException | None) -> None:
        assert name in source
        self.fail = fail

    def compile(self) -> None:
        if self.fail is not None:
            raise self.fail

    def __call__(self, grid, block, args) -> None:
        x, y, n = args
        y[:n] = 2 * x[:n] + np.arange(n, dtype=np.float32)


class FakeRandomState:
    """cupy.random.RandomState on NumPy's generator (``fail``: the error creating it raises, as without cuRAND)."""

    def __init__(self, seed: int, fail: BaseException | None, draw) -> None:
        if fail is not None:
            raise fail
        self.rng, self.draw = np.random.default_rng(seed), draw

    def random_sample(self, n: int, dtype) -> np.ndarray:
        return self.draw(self.rng, n).astype(dtype)


def fake_cupy(*, nvrtc: BaseException | None = None, cublas: BaseException | None = None,
              curand: BaseException | None = None, runtime: int = 13000, matmul=np.matmul,
              draw=lambda rng, n: rng.random(n)) -> types.SimpleNamespace:
    def handle() -> int:
        if cublas is not None:
            raise cublas
        return 1

    return types.SimpleNamespace(
        __version__="14.0.0",
        float32=np.float32,
        cuda=types.SimpleNamespace(
            is_available=lambda: True,
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, runtimeGetVersion=lambda: runtime),
            device=types.SimpleNamespace(get_cublas_handle=handle),
        ),
        asarray=np.asarray,
        asnumpy=np.asarray,
        zeros=np.zeros,
        matmul=matmul,
        RawKernel=lambda source, name: FakeKernel(source, name, nvrtc),
        random=types.SimpleNamespace(RandomState=lambda seed: FakeRandomState(seed, curand, draw)),
    )


def test_a_working_stack_passes():
    ok, why = _cuda.probe_cupy(fake_cupy())
    assert ok, why
    assert why == "1 CUDA device(s) usable through CuPy 14.0.0 (NVRTC, cuBLAS and cuRAND work)"


def test_missing_nvrtc_is_named():
    exc = RuntimeError("CuPy failed to load libnvrtc.so.13: OSError: libnvrtc.so.13: cannot open shared object file")
    ok, why = _cuda.probe_cupy(fake_cupy(nvrtc=exc))
    assert not ok
    assert why.startswith(f"NVRTC (libnvrtc.so.13) not found: {install_command('gpu')}, which brings "
                          "nvidia-cuda-nvrtc via cupy's [ctk] extra")
    assert missing_libraries(why) == ["libnvrtc.so.13"]  # what `leaflens doctor` lists as missing


def test_missing_cublas_is_named_for_the_cuda_major_cupy_is_built_for():
    ok, why = _cuda.probe_cupy(fake_cupy(cublas=ImportError("no module"), runtime=12080))
    assert not ok
    assert why.startswith(f"cuBLAS (libcublas.so.12) not found: {install_command('gpu-cuda12')}, which brings "
                          "nvidia-cublas via cupy's [ctk] extra")


def test_missing_curand_is_named_and_bad_draws_fail():
    ok, why = _cuda.probe_cupy(fake_cupy(curand=RuntimeError("CuPy failed to load libcurand.so.10")))
    assert not ok and why.startswith(f"cuRAND (libcurand.so.10) not found: {install_command('gpu')}, which brings "
                                     "nvidia-curand via cupy's [ctk] extra")
    ok, why = _cuda.probe_cupy(fake_cupy(draw=lambda rng, n: np.zeros(n)))
    assert not ok and why.startswith("cuRAND probe drew wrong uniform numbers")


def test_cuda11_points_at_the_system_toolkit():
    ok, why = _cuda.probe_cupy(fake_cupy(cublas=OSError("libcublas.so.11: cannot open shared object file"),
                                         runtime=11080))
    assert not ok and why.startswith("cuBLAS (libcublas.so.11) not found: install the CUDA 11 toolkit's cuBLAS")


def test_a_compile_error_is_not_called_a_missing_library():
    ok, why = _cuda.probe_cupy(fake_cupy(nvrtc=RuntimeError("NVRTC_ERROR_COMPILATION (6)")))
    assert not ok and why == "NVRTC failed (RuntimeError: NVRTC_ERROR_COMPILATION (6))"


def test_a_wrong_product_fails():
    ok, why = _cuda.probe_cupy(fake_cupy(matmul=lambda a, b: np.matmul(a, b) + 1))
    assert not ok and why.startswith("cuBLAS probe computed a wrong product")


def test_probe_goes_through_the_stages(monkeypatch):
    """gpu_probe() runs these stages on the imported cupy (here the stand-in)."""
    monkeypatch.delenv(_cuda.DISABLE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(nvrtc=OSError("libnvrtc.so.13: not found")))
    monkeypatch.setattr(_cuda, "_probe_result", None)
    try:
        ok, why = _cuda.gpu_probe()
        assert not ok and "NVRTC (libnvrtc.so.13) not found" in why
    finally:
        monkeypatch.undo()
        _cuda.gpu_probe(refresh=True)


def test_extra_table_matches_the_serving_side():
    assert _cuda.CUDA_EXTRAS == GPU_EXTRAS
