"""The GPU checks' verdicts without a GPU: benchmarks/gpu.py --require-gpu exits 1 when there is none, and its
1.2x rule (a dispatched kernel may be at most 1.2 times slower than its generic CuPy fallback) decides pass or
fail from fake timings; .ci/gpu_check.py (make gpu-check) stops at once, before installing anything."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leaflens.apps.providers import GPU_EXTRAS
from leaflens.kernels import _cuda
from leaflens.pipeline.gpu_stacks import CUDA13_MIN_CC

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "gpu.py"
CHECK = ROOT / ".ci" / "gpu_check.py"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load(BENCH, "leaflens_gpu_benchmark_require")


@pytest.fixture(scope="module")
def check():
    return _load(CHECK, "leaflens_gpu_check")


# ---- benchmarks/gpu.py ------------------------------------------------------------------------------------------
def test_benchmark_require_gpu_fails_without_a_gpu():
    env = dict(os.environ, **{_cuda.DISABLE_ENV: "1"})
    proc = subprocess.run([sys.executable, str(BENCH), "--require-gpu"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED (--require-gpu): no usable GPU: disabled by" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"].startswith("disabled by")


def timing(ours: float, cupy: float, diff: float | None = 0.0) -> dict:
    return {"ours_ms": ours, "cupy_ms": cupy, "max_abs_diff": diff}


def test_the_slowdown_rule(bench):
    assert bench.SLOWDOWN_LIMIT == 1.2
    assert bench.kernel_failures({"im2col": timing(1.2, 1.0), "maxpool": timing(0.5, 1.0)}) == []
    failures = bench.kernel_failures({"im2col": timing(1.21, 1.0), "maxpool": timing(1.0, 1.0),
                                      "adamw": timing(3.0, 1.0)})
    assert len(failures) == 2
    assert failures[0].startswith("im2col: our kernel takes 1.210 ms, 1.21x the generic CuPy fallback's 1.000 ms")
    assert failures[1].startswith("adamw:")
    assert bench.kernel_failures({"maxpool": timing(1.3, 1.0)}, limit=1.5) == []


def test_sgemm_is_exempt_but_a_nan_difference_is_not(bench):
    assert set(bench.NOT_DISPATCHED) < set(bench.KERNEL_NAMES)
    assert bench.kernel_failures({"sgemm": timing(5.0, 1.0), "sgemm_conv_shape": timing(3.0, 1.0)}) == []
    assert bench.kernel_failures({"sgemm": timing(1.0, 1.0, float("nan"))}) == [
        "sgemm: our kernel and the CuPy expression differ by nan"]


def test_an_engine_error_in_the_training_step_fails(bench):
    train = {"cases": {"b64_fp32": {"engine_img_s": 1000.0, "torch_error": "RuntimeError: x"},
                       "b64_amp": {"engine_error": "TypeError: float16"}}}
    assert bench.train_failures(train) == ["training step b64_amp: the engine raised TypeError: float16"]
    assert bench.train_failures(None) == []


# ---- .ci/gpu_check.py (make gpu-check) ---------------------------------------------------------------------------
def test_gpu_check_stops_at_once_without_a_gpu(tmp_path):
    venv = tmp_path / "venv"
    env = dict(os.environ, **{_cuda.DISABLE_ENV: "1"})
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(CHECK), "--venv", str(venv)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert time.monotonic() - start < 20
    assert not venv.exists()  # nothing was created, nothing installed
    assert proc.stderr.strip() == f"make gpu-check: no GPU: disabled by {_cuda.DISABLE_ENV}=1"
    table = proc.stdout.strip().splitlines()
    assert table[-1] == "make gpu-check: FAILED: no usable GPU (exit status 2)"
    assert any(r.startswith("preflight: NVIDIA driver and GPU") and "FAILED" in r for r in table)
    assert sum("not run" in r for r in table) == 5


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_gpu_check_fails_without_a_gpu(tmp_path):
    env = dict(os.environ, **{_cuda.DISABLE_ENV: "1"})
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", f"GPU_VENV={tmp_path / 'v'}",
                           f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0
    assert "make gpu-check: no GPU: disabled by" in proc.stderr
    assert not (tmp_path / "v").exists()


class FakeDriver:
    """libcuda.so.1 as ctypes sees it: cuInit's status, the CUDA version, devices (name, capability)."""

    def __init__(self, init: int = 0, version: int = 13000, devices: tuple = (("NVIDIA H200", 9, 0),)) -> None:
        self.init, self.version, self.devices = init, version, devices

    def cuInit(self, flags):  # noqa: N802 - the driver API's names
        return self.init

    def cuDriverGetVersion(self, out):  # noqa: N802
        out._obj.value = self.version
        return 0

    def cuDeviceGetCount(self, out):  # noqa: N802
        out._obj.value = len(self.devices)
        return 0

    def cuDeviceGet(self, out, ordinal):  # noqa: N802
        out._obj.value = ordinal
        return 0

    def cuDeviceGetName(self, buf, size, dev):  # noqa: N802
        ctypes.memmove(buf, self.devices[dev.value][0].encode(), len(self.devices[dev.value][0]))
        return 0

    def cuDeviceGetAttribute(self, out, attr, dev):  # noqa: N802
        out._obj.value = self.devices[dev.value][1 if attr == 75 else 2]
        return 0


def test_preflight_reads_the_driver(check, monkeypatch):
    monkeypatch.delenv(_cuda.DISABLE_ENV, raising=False)
    driver = check.probe_driver(lambda name: FakeDriver())
    assert driver.cuda_major == 13 and driver.devices == [("NVIDIA H200", 9.0)]
    assert driver.describe() == "driver supports CUDA 13.0; NVIDIA H200, compute capability 9.0"
    with pytest.raises(check.NoGPU, match="cuInit returned CUDA error 100"):
        check.probe_driver(lambda name: FakeDriver(init=100))
    with pytest.raises(check.NoGPU, match="sees no CUDA device"):
        check.probe_driver(lambda name: FakeDriver(devices=()))

    def no_lib(name):
        raise OSError(f"{name}: cannot open shared object file")

    with pytest.raises(check.NoGPU, match=r"no NVIDIA driver \(libcuda.so.1 not found\)"):
        check.probe_driver(no_lib)


@pytest.mark.parametrize(("version", "cc", "extra"), [(13000, 8.9, "gpu"), (13020, 7.0, "gpu-cuda12"),
                                                       (12080, 8.6, "gpu-cuda12"), (11080, 7.5, "gpu-cuda11")])
def test_the_extra_follows_the_driver_like_doctor(check, version, cc, extra):
    assert check.extra_for(check.Driver(version, [("gpu", cc)])) == extra
    assert check.EXTRAS == GPU_EXTRAS and check.CUDA13_MIN_CC == CUDA13_MIN_CC


def test_a_driver_older_than_any_extra_is_refused(check):
    with pytest.raises(check.NoGPU, match="older than any GPU extra"):
        check.extra_for(check.Driver(10020, [("old", 6.1)]))


def fake_run(check, monkeypatch, tmp_path, outcomes: dict[str, int], interpreter: str | None = None):
    """Check.run() with a GPU pretended and every command answered from ``outcomes`` (by a word in it)."""
    monkeypatch.setattr(check, "probe_driver", lambda: check.Driver(13000, [("NVIDIA H200", 9.0)]))
    (tmp_path / "bin").mkdir(parents=True)
    (tmp_path / "bin" / "python").write_text("")
    ran: list[tuple[list[str], dict[str, str]]] = []

    def runner(cmd, env, timeout):
        ran.append((list(cmd), env))
        line = " ".join(cmd)
        for word, rc in outcomes.items():
            if word in line:
                return rc, [f"{word} said {rc}", "{}"]
        return 0, ["fine"]

    c = check.Check(venv=tmp_path, runner=runner, interpreter=interpreter)
    return c, c.run(), ran


def test_all_steps_pass(check, monkeypatch, tmp_path):
    c, status, ran = fake_run(check, monkeypatch, tmp_path, {})
    assert status == 0
    assert [s.result for s in c.steps] == ["ok"] * 6
    assert any(".[gpu,dev,teacher]" in cmd for cmd, _ in ran)
    [(pytest_cmd, env)] = [(cmd, env) for cmd, env in ran if "pytest" in cmd]
    assert pytest_cmd[-2:] == ["-m", "gpu"] and env["LEAFLENS_REQUIRE_GPU"] == "1"
    assert [cmd[1:] for cmd, _ in ran if "doctor" in cmd] == [["-m", "leaflens", "doctor", "--require-gpu"]]
    assert any("benchmarks/gpu.py" in cmd and "--require-gpu" in cmd for cmd, _ in ran)
    assert c.table(status).splitlines()[-1] == "make gpu-check: PASSED (exit status 0)"


def test_a_failed_gpu_test_fails_the_check_and_torch_only_warns(check, monkeypatch, tmp_path):
    c, status, _ = fake_run(check, monkeypatch, tmp_path, {"import torch": 1, "pip install torch": 1,
                                                           "-m pytest": 1})
    assert status == 1
    results = {s.name: (s.result, s.detail) for s in c.steps}
    assert results["PyTorch CUDA reference"][0] == "warning"
    assert results["pytest -m gpu (LEAFLENS_REQUIRE_GPU=1)"] == ("FAILED", "exit status 1: -m pytest said 1")
    assert results["benchmarks/gpu.py --require-gpu"][0] == "ok"  # every check runs, the table shows them all


def test_a_failed_install_stops_unless_cupy_is_there(check, monkeypatch, tmp_path):
    c, status, _ = fake_run(check, monkeypatch, tmp_path, {"pip install -e": 1, "import cupy": 1})
    assert status == 1 and [s.result for s in c.steps][-3:] == ["not run"] * 3
    c, status, _ = fake_run(check, monkeypatch, tmp_path / "again", {"pip install -e": 1})
    assert status == 0 and c.steps[1].result == "warning" and "going on with the CuPy" in c.steps[1].detail


def test_an_existing_python_gets_leaflens_alone_offline(check, monkeypatch, tmp_path):
    py = "/opt/py/bin/python3"
    c, status, ran = fake_run(check, monkeypatch, tmp_path, {}, interpreter=py)
    assert status == 0
    installs = [cmd for cmd, _ in ran if "pip" in cmd and "install" in cmd]
    assert installs == [[py, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                         "--no-index", "-e", "."]]
    assert all(cmd[0] == py for cmd, _ in ran)
    c, status, _ = fake_run(check, monkeypatch, tmp_path / "again", {"import cupy": 1}, interpreter=py)
    assert status == 1 and "lacks part of the GPU stack" in c.steps[1].detail
    assert [s.result for s in c.steps][-3:] == ["not run"] * 3


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            return "\nState:\tZ" not in f.read()  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to see processes")
def test_a_step_past_its_time_is_killed_with_its_children(check):
    child = ("import subprocess; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); p.wait()")
    start = time.monotonic()
    rc, lines = check.run_streamed([sys.executable, "-c", child], dict(os.environ), 1.5)
    assert rc == 124 and time.monotonic() - start < 20
    grandchild = int(lines[0])
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)
    assert check.last_line(["ran", '{"json": 1}', "====", ""]) == "ran"
