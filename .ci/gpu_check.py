"""``make gpu-check``: on a machine with an NVIDIA GPU, install the GPU stack and prove that it works, or fail
loudly with the reason.

Steps, in order (each timed; a table at the end):

1. preflight: the NVIDIA driver (``libcuda.so.1``, through ctypes) initialises and sees at least one device.
   Without one the check stops at once, before any download, with exit status 2.
2. install: a virtual environment of its own (``--venv``, default ``build/venv-gpu``) gets
   ``pip install -e ".[<gpu extra>,dev,teacher]"``, the extra chosen for the driver (``gpu`` for CUDA 13,
   ``gpu-cuda12``, ``gpu-cuda11``: the table of ``leaflens doctor``). Its own venv, because a GPU extra must
   not sit beside ``serve``'s onnxruntime in ``.venv`` (both install the same folder).
3. PyTorch with CUDA, the benchmark's reference: installed when missing; a failure is a warning only.
4. ``leaflens doctor --require-gpu``: the probe compiles a kernel with NVRTC and multiplies with cuBLAS; a missing
   library is named.
5. ``pytest -m gpu`` with ``LEAFLENS_REQUIRE_GPU=1``: every gpu test runs; a skipped one fails (tests/conftest.py).
6. ``benchmarks/gpu.py --require-gpu``: each dispatched kernel against its generic CuPy fallback (fails over
   1.2x slower) and the training step, engine beside PyTorch.

Steps 4-6 share one time budget (``--budget``, 8 minutes); the installs depend on the download speed and have
their own limits. Exit status: 0 all passed (warnings allowed), 1 a step failed, 2 no usable GPU found by the
preflight. Standard library only: it runs before anything is installed.

    python3 .ci/gpu_check.py [--venv build/venv-gpu] [--extra gpu] [--no-install] [--budget 480]
    python3 .ci/gpu_check.py --python /path/to/python3   # an offline GPU machine whose Python has CuPy

``--python`` uses an interpreter that already holds CuPy, pytest, NumPy, Pillow and onnx (a GPU machine's image,
where nothing can be downloaded): only leaflens itself is installed into it, without its dependencies.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DISABLE_ENV = "LEAFLENS_DISABLE_GPU"  # as leaflens.kernels._cuda: set, the machine counts as having no GPU
REQUIRE_ENV = "LEAFLENS_REQUIRE_GPU"  # tests/conftest.py: a skipped gpu test fails
EXTRAS = {13: "gpu", 12: "gpu-cuda12", 11: "gpu-cuda11"}  # leaflens.apps.providers.GPU_EXTRAS (a test compares)
CUDA13_MIN_CC = 7.5  # leaflens.pipeline.gpu_stacks: CUDA 13 no longer builds for Maxwell, Pascal, Volta
CHECK_BUDGET_S = 480.0
INSTALL_TIMEOUT_S = 1800.0
TORCH_TIMEOUT_S = 1200.0

OK, WARNING, FAILED, NOT_RUN = "ok", "warning", "FAILED", "not run"


class NoGPU(RuntimeError):
    """The preflight found no usable NVIDIA GPU (the message says why)."""


@dataclass(frozen=True)
class Driver:
    """What the NVIDIA driver reports: its CUDA version (13000 = 13.0) and each device's name and capability."""

    cuda_version: int
    devices: list[tuple[str, float]]

    @property
    def cuda_major(self) -> int:
        return self.cuda_version // 1000

    def describe(self) -> str:
        gpus = "; ".join(f"{name}, compute capability {cc:.1f}" for name, cc in self.devices)
        return f"driver supports CUDA {self.cuda_major}.{self.cuda_version % 1000 // 10}; {gpus}"


@dataclass
class Step:
    """One row of the summary: what ran, how it ended, how long it took, and one line of detail."""

    name: str
    result: str = NOT_RUN
    seconds: float = 0.0
    detail: str = ""


def probe_driver(load: Callable[[str], ctypes.CDLL] = ctypes.CDLL) -> Driver:
    """The driver's CUDA version and devices, or NoGPU saying what is missing. Needs no CUDA toolkit."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        raise NoGPU(f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}")
    try:
        lib = load("libcuda.so.1")
    except OSError:
        raise NoGPU("no NVIDIA driver (libcuda.so.1 not found)") from None
    status = lib.cuInit(0)
    if status != 0:
        raise NoGPU(f"the NVIDIA driver does not initialise (cuInit returned CUDA error {status}; 100 means "
                    "no CUDA-capable device)")
    version, count = ctypes.c_int(0), ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        raise NoGPU("the NVIDIA driver does not answer (cuDriverGetVersion/cuDeviceGetCount failed)")
    if count.value < 1:
        raise NoGPU("the NVIDIA driver sees no CUDA device")
    devices = []
    for ordinal in range(count.value):
        dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGet(ctypes.byref(dev), ordinal)
        lib.cuDeviceGetName(name, 256, dev)
        lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # ..._MINOR
        devices.append((name.value.decode(errors="replace") or f"device {ordinal}", major.value + minor.value / 10))
    return Driver(int(version.value), devices)


def extra_for(driver: Driver) -> str:
    """The GPU extra for this driver and these GPUs (as ``leaflens doctor`` recommends), or NoGPU when the
    driver is older than every extra."""
    fitting = [m for m in EXTRAS if m <= driver.cuda_major]
    if not fitting:
        raise NoGPU(f"the driver supports CUDA {driver.cuda_major} only, older than any GPU extra: update the driver")
    major = max(fitting)
    if major >= 13 and any(cc < CUDA13_MIN_CC for _, cc in driver.devices):
        major = 12
    return EXTRAS[major]


# ---- running a step -------------------------------------------------------------------------------------------
Runner = Callable[[Sequence[str], dict[str, str], float], tuple[int, list[str]]]


def run_streamed(cmd: Sequence[str], env: dict[str, str], timeout: float) -> tuple[int, list[str]]:
    """Run ``cmd`` in the repository root, its output shown as it comes; (exit status, last 40 lines). A run past
    ``timeout`` seconds is killed with every process it started, and answers 124."""
    proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1, start_new_session=True)
    tail: deque[str] = deque(maxlen=40)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the step's own process group: pytest's and pip's children too
        proc.wait()
        rc = 124
    reader.join(timeout=5)
    return rc, list(tail)


def last_line(lines: list[str]) -> str:
    """The last informative output line (not a JSON object, not a rule of dashes or equals signs)."""
    for line in reversed(lines):
        text = line.strip().strip("=").strip()
        if text and not text.startswith("{") and set(text) - set("-="):
            return text[:160]
    return ""


@dataclass
class Check:
    """The plan and its results; ``runner`` is replaceable in tests."""

    venv: Path
    extra: str | None = None
    interpreter: str | None = None  # an existing Python with the GPU stack: leaflens alone is installed into it
    install: bool = True
    budget: float = CHECK_BUDGET_S
    runner: Runner = run_streamed
    steps: list[Step] = field(default_factory=list)

    @property
    def python(self) -> str:
        return self.interpreter or str(self.venv / "bin" / "python")

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (DISABLE_ENV, "VIRTUAL_ENV")}
        env.update(extra)
        return env

    def step(self, name: str, cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> Step:
        step = Step(name)
        self.steps.append(step)
        if timeout <= 0:
            step.result, step.detail = FAILED, f"not started: the checks' {self.budget:.0f} s are spent"
            return step
        print(f"\n==== make gpu-check: {name}", flush=True)
        start = time.monotonic()
        rc, lines = self.runner(cmd, env or self.env(), timeout)
        step.seconds = time.monotonic() - start
        step.result = OK if rc == 0 else FAILED
        if rc == 124:
            step.detail = f"timed out after {timeout:.0f} s"
        elif rc != 0:
            step.detail = f"exit status {rc}: {last_line(lines)}"
        else:
            step.detail = last_line(lines)
        return step

    def not_run(self, *names: str, why: str) -> None:
        self.steps.extend(Step(n, NOT_RUN, 0.0, why) for n in names)

    def run(self) -> int:
        checks = ("leaflens doctor --require-gpu", f"pytest -m gpu ({REQUIRE_ENV}=1)",
                  "benchmarks/gpu.py --require-gpu")
        pre = Step("preflight: NVIDIA driver and GPU")
        self.steps.append(pre)
        start = time.monotonic()
        try:
            driver = probe_driver()
            extra = self.extra or extra_for(driver)
        except NoGPU as exc:
            pre.result, pre.detail, pre.seconds = FAILED, f"no GPU: {exc}", time.monotonic() - start
            print(f"make gpu-check: no GPU: {exc}", file=sys.stderr)
            self.not_run("install", "PyTorch CUDA reference", *checks, why="no GPU")
            return 2
        pre.result, pre.detail, pre.seconds = OK, driver.describe(), time.monotonic() - start

        if not self.install_stack(extra):
            self.not_run("PyTorch CUDA reference", *checks, why="the GPU stack is not installed")
            return 1
        self.install_torch()
        deadline = time.monotonic() + self.budget
        self.step(checks[0], [self.python, "-m", "leaflens", "doctor", "--require-gpu"], deadline - time.monotonic())
        self.step(checks[1], [self.python, "-m", "pytest", "-q", "-m", "gpu"],
                  deadline - time.monotonic(), self.env(**{REQUIRE_ENV: "1"}))
        self.step(checks[2], [self.python, "benchmarks/gpu.py", "--require-gpu", "--repeats", "10"],
                  deadline - time.monotonic())
        return 1 if any(s.result == FAILED for s in self.steps) else 0

    def install_stack(self, extra: str) -> bool:
        """The venv with the GPU extra; False when it cannot be used (then nothing else runs)."""
        if self.interpreter:
            return self.install_into_interpreter()
        name = f"install leaflens[{extra},dev,teacher] into {self.venv}"
        if not self.install:
            ok = Path(self.python).exists()
            self.steps.append(Step(name, OK if ok else FAILED, 0.0,
                                   "skipped (--no-install), using the venv as it is" if ok
                                   else f"--no-install, but {self.python} does not exist"))
            return ok
        if not Path(self.python).exists():
            made = self.step(f"create {self.venv}", [sys.executable, "-m", "venv", str(self.venv)], 120)
            if made.result != OK:
                return False
        step = self.step(name, [self.python, "-m", "pip", "install", "-e", f".[{extra},dev,teacher]"],
                         INSTALL_TIMEOUT_S)
        if step.result == OK:
            return True
        has_cupy, _ = self.runner([self.python, "-c", "import cupy, pytest, leaflens"], self.env(), 120)
        if has_cupy == 0:  # e.g. no network, but the venv was prepared before: go on, and say so
            step.result = WARNING
            step.detail = f"pip failed ({step.detail}); going on with the CuPy already in the venv"
            return True
        return False

    def install_into_interpreter(self) -> bool:
        """leaflens alone (no dependencies, no download) into ``--python``, which must already import CuPy."""
        step = self.step(f"install leaflens (no dependencies) into {self.python}",
                         [self.python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "-e", "."], INSTALL_TIMEOUT_S)
        if step.result != OK:
            return False
        rc, lines = self.runner([self.python, "-c", "import cupy, pytest, onnx, PIL, leaflens"], self.env(), 120)
        if rc != 0:
            step.result, step.detail = FAILED, f"{self.python} lacks part of the GPU stack: {last_line(lines)}"
            return False
        return True

    def install_torch(self) -> None:
        """PyTorch with CUDA for the benchmark's reference columns; any failure is a warning."""
        probe = [self.python, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"]
        rc, _ = self.runner(probe, self.env(), 300)
        if rc == 0:
            self.steps.append(Step("PyTorch CUDA reference", OK, 0.0, "already installed"))
            return
        cmd = [self.python, "-m", "pip", "install", "torch"]
        if os.environ.get("TORCH_INDEX_URL"):
            cmd += ["--index-url", os.environ["TORCH_INDEX_URL"]]
        step = self.step("PyTorch CUDA reference", cmd, TORCH_TIMEOUT_S)
        if step.result == OK:
            rc, _ = self.runner(probe, self.env(), 300)
            if rc != 0:
                step.result, step.detail = WARNING, "installed, but torch.cuda.is_available() is False"
        else:
            step.result = WARNING
            step.detail = f"pip install torch failed ({step.detail}): the benchmark's PyTorch columns stay empty"

    def table(self, status: int) -> str:
        width = max(len(s.name) for s in self.steps)
        rows = [f"{'step':<{width}}  {'result':<7}  {'seconds':>7}  detail", "-" * (width + 40)]
        rows += [f"{s.name:<{width}}  {s.result:<7}  {s.seconds:>7.1f}  {s.detail}" for s in self.steps]
        verdict = {0: "PASSED", 1: "FAILED", 2: "FAILED: no usable GPU"}[status]
        rows.append(f"make gpu-check: {verdict} (exit status {status})")
        return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=ROOT / "build" / "venv-gpu",
                        help="the virtual environment to install into and run from (default: build/venv-gpu)")
    parser.add_argument("--extra", choices=sorted(EXTRAS.values()), default=None,
                        help="the GPU extra (default: the one for this driver, as leaflens doctor names it)")
    parser.add_argument("--no-install", action="store_true",
                        help="use the venv as it is (an offline machine prepared beforehand)")
    parser.add_argument("--python", default=None, metavar="PATH",
                        help="use this Python, which already has CuPy (offline GPU machines), instead of a venv")
    parser.add_argument("--budget", type=float, default=CHECK_BUDGET_S,
                        help="seconds for doctor, pytest and the benchmark together (default: 480)")
    args = parser.parse_args(argv)
    venv = args.venv if args.venv.is_absolute() else Path.cwd() / args.venv
    check = Check(venv=venv, extra=args.extra, install=not args.no_install, budget=args.budget,
                  interpreter=args.python)
    status = check.run()
    print("\n" + check.table(status), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
