"""Which onnxruntime execution provider can really run here: found out once, quietly.

``onnxruntime.get_available_providers()`` tells what the installed wheel was *built* with, not what can
start on this machine: ``onnxruntime-gpu`` lists TensorRT and CUDA on a laptop without a GPU. Asking for
one whose libraries are missing fills the terminal: onnxruntime's C++ logger writes its errors straight
to the process's stderr (file descriptor 2, past Python's ``sys.stderr``), and its Python wrapper prints
an "EP Error" block on stdout before it falls back. So a GPU provider is tried only after a probe says
it starts (:func:`probe`):

1. the provider must be in this build, and ``LEAFLENS_DISABLE_GPU`` unset (as for the CuPy probe);
2. an NVIDIA driver must answer (``libcuda.so.1``'s ``cuDriverGetVersion``; no driver: no attempt at
   all, so a CPU-only machine never sees onnxruntime's GPU messages), and it must support the CUDA
   major the onnxruntime-gpu wheel was built for;
3. a session on a one-node model (:func:`probe_model`) is created with ``[provider, CPU]``, with
   onnxruntime's default logger raised to errors, file descriptor 2 sent to a temporary file and
   stdout captured (:func:`quiet_native_output`), after ``onnxruntime.preload_dlls()`` has loaded the
   CUDA libraries of NVIDIA's pip wheels (``leaflens[gpu]`` installs them there, where the loader
   would not look). The provider starts when the session reports it first; if not, the captured
   text gives the one-line reason (:func:`reason_from_log`: the missing library, the CUDA error).

Each provider is probed once per process (:func:`probe` caches). The driver helpers here also serve
``leaflens doctor``, which maps the driver's CUDA major to the install extra (:data:`GPU_EXTRAS`).

Like the rest of leaflens.apps this imports no engine, and onnxruntime only inside functions.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import io
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from leaflens.extras import install_command
from leaflens.kernels._cuda import DISABLE_ENV

__all__ = ["CPU", "CUDA", "GPU_EXTRAS", "SHORT_NAMES", "TENSORRT", "Probe", "ProviderChoice",
           "add_provider_argument", "cuda_major", "driver_cuda_version", "extra_for_cuda", "onnxruntime_build", "probe",
           "probe_model", "provider_name", "quiet_native_output", "reason_from_log", "requested_providers",
           "unmet_request"]

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
#: What ``--provider`` accepts (the full onnxruntime names are accepted too).
SHORT_NAMES = {"cpu": CPU, "cuda": CUDA, "tensorrt": TENSORRT}
#: The install extra (pyproject.toml) whose CuPy and onnxruntime-gpu are built for each CUDA major; a driver
#: supports its own CUDA major and every older one. tests/test_extras.py holds pyproject.toml to this table.
GPU_EXTRAS = {13: "gpu", 12: "gpu-cuda12", 11: "gpu-cuda11"}
#: onnxruntime's default logger severity (0 verbose .. 4 fatal): WARNING, restored after a probe.
ORT_DEFAULT_SEVERITY = 2
_ERRORS_ONLY = 3


@dataclass(frozen=True)
class Probe:
    """Whether ``provider`` starts here; ``reason`` says why not (one line), or what started."""

    provider: str
    ok: bool
    reason: str


def provider_name(name: str) -> str:
    """The onnxruntime name of ``cpu``/``cuda``/``tensorrt`` (any case), or of a full name, unchanged.

    Raises ValueError naming the accepted names for anything else."""
    key = name.strip()
    if key.lower() in SHORT_NAMES:
        return SHORT_NAMES[key.lower()]
    if key.endswith("ExecutionProvider"):
        return key
    raise ValueError(f"unknown execution provider {name!r}: use one of {', '.join(SHORT_NAMES)} "
                     "(or an onnxruntime name such as CUDAExecutionProvider)")


@dataclass(frozen=True)
class ProviderChoice:
    """What to ask onnxruntime for (``providers``, the CPU last) and the wanted providers left out because
    they cannot start here (``failed``: provider, reason)."""

    providers: tuple[str, ...]
    failed: tuple[tuple[str, str], ...] = ()

    def line(self, used: str) -> str:
        """The one line the commands print: the provider ``used`` (the session's first) and, when a wanted
        GPU provider could not start, why (providers with the same reason named together)."""
        by_reason: dict[str, list[str]] = {}
        for provider, reason in self.failed:
            by_reason.setdefault(reason, []).append(provider)
        notes = [f"{' and '.join(names)} could not start: {reason}" for reason, names in by_reason.items()]
        if self.providers and used != self.providers[0]:
            notes.append(f"{self.providers[0]} passed the probe but onnxruntime did not start it for this model")
        return f"onnxruntime provider: {used}" + (f" ({'; '.join(notes)})" if notes else "")


def add_provider_argument(parser: argparse.ArgumentParser) -> None:
    """``--provider auto|cpu|cuda|tensorrt`` for the commands that run a model (predict, evaluate, serve)."""
    parser.add_argument("--provider", choices=("auto", *SHORT_NAMES), default="auto",
                        help="onnxruntime execution provider (default auto: CUDA when it starts here, else the CPU; "
                             "tensorrt only when asked for, with CUDA behind it). One line on stderr says which "
                             "runs and, when a GPU provider could not start, why; a provider named here that "
                             "cannot start is an error (exit 2), not a quiet fall back to the CPU")


def requested_providers(choice: str) -> list[str] | None:
    """The Predictor's ``providers`` for a ``--provider`` value: None (the default order) for ``auto``."""
    return None if choice == "auto" else [provider_name(choice)]


def unmet_request(choice: str, used: str, line: str) -> str | None:
    """Why a ``--provider`` named on the command line is not the one that runs (``used``), or None.

    ``auto`` falls back to the CPU by design; a provider asked for by name is a promise the user relies on
    (a benchmark, a GPU server), so running on the CPU instead would answer exit status 0 for the wrong
    thing. ``line`` is the Predictor's provider line, which carries the reason."""
    if choice == "auto" or provider_name(choice) == used:
        return None
    return (f"--provider {choice} was asked for but cannot run here; {line}. Without --provider (auto), the "
            "model runs on what starts here: CUDA when it does, else the CPU")


# ---- the driver --------------------------------------------------------------------------------------------
def _libcuda() -> Any | None:
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def driver_cuda_version() -> int | None:
    """The newest CUDA version the NVIDIA driver supports, as the driver API encodes it (13000 = 13.0), or
    None without a driver (no ``libcuda``) or when it does not answer. Needs no GPU and initialises nothing."""
    lib = _libcuda()
    if lib is None:
        return None
    version = ctypes.c_int(0)
    try:
        status = lib.cuDriverGetVersion(ctypes.byref(version))
    except (AttributeError, OSError):
        return None
    return int(version.value) if status == 0 and version.value > 0 else None


def cuda_major(version: int | str | None) -> int | None:
    """The CUDA major of 13000, "13.0" or "12": 13, 13, 12; None for None, "" or nonsense."""
    if version is None or version == "":
        return None
    if isinstance(version, int):
        return version // 1000 if version >= 1000 else version
    head = str(version).strip().split(".", 1)[0]
    return int(head) if head.isdigit() else None


def extra_for_cuda(major: int | None) -> str | None:
    """The install extra for a driver that supports CUDA ``major``: the newest CUDA major it runs that an
    extra exists for (``gpu`` for 13 and newer), or None below the oldest (or without a driver)."""
    if major is None:
        return None
    fitting = [m for m in GPU_EXTRAS if m <= major]
    return GPU_EXTRAS[max(fitting)] if fitting else None


def onnxruntime_build(ort: Any | None = None) -> dict[str, Any]:
    """{"package": "onnxruntime-gpu", "version": "1.31.1", "cuda": "13.0" or None} of the importable
    onnxruntime (``ort``, else imported here)."""
    if ort is None:
        ort = importlib.import_module("onnxruntime")
    cuda = getattr(ort, "cuda_version", None)
    if cuda is None:
        with contextlib.suppress(Exception):
            from onnxruntime.capi import build_and_package_info as info  # noqa: PLC0415

            cuda = getattr(info, "cuda_version", None)
    return {"package": getattr(ort, "package_name", None) or "onnxruntime",
            "version": str(getattr(ort, "__version__", "?")), "cuda": str(cuda) if cuda else None}


# ---- a model to probe with -----------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value: int | bytes | str) -> bytes:
    """One protobuf field: an integer (varint) or bytes/str (length-delimited)."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def probe_model() -> bytes:
    """A serialized ONNX model of one node, ``y = Relu(x)`` on float32 ``[1, 8]`` (IR 8, opset 17), written
    field by field so that probing needs no ``onnx`` package."""

    def value_info(name: str) -> bytes:
        dims = b"".join(_field(1, _field(1, d)) for d in (1, 8))  # TensorShapeProto.dim.dim_value
        tensor = _field(1, 1) + _field(2, dims)  # TypeProto.Tensor: elem_type FLOAT, shape
        return _field(1, name) + _field(2, _field(1, tensor))  # ValueInfoProto: name, type.tensor_type

    node = _field(1, "x") + _field(2, "y") + _field(4, "Relu")  # NodeProto: input, output, op_type
    graph = _field(1, node) + _field(2, "leaflens_probe") + _field(11, value_info("x")) + _field(12, value_info("y"))
    opset = _field(1, "") + _field(2, 17)  # OperatorSetIdProto: default domain, version 17
    return _field(1, 8) + _field(7, graph) + _field(8, opset)  # ModelProto: ir_version, graph, opset_import


# ---- quiet ---------------------------------------------------------------------------------------------------
_quiet_lock = threading.Lock()


@contextlib.contextmanager
def quiet_native_output(ort: Any | None = None) -> Iterator[list[str]]:
    """Run the body with onnxruntime's default logger at errors only, file descriptor 2 (where its C++
    logger writes) sent to a temporary file and ``sys.stdout`` (where its Python wrapper prints) captured.
    Yields a list that holds, after the body, what was written (stderr text, then stdout text).

    File descriptor 2 is the process's: anything another thread writes to stderr meanwhile is captured
    too, so keep the body short (one session creation). The logger goes back to onnxruntime's default
    severity afterwards (onnxruntime has no getter for the previous one)."""
    captured: list[str] = []
    with _quiet_lock, tempfile.TemporaryFile() as sink:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        saved = os.dup(2)
        printed = io.StringIO()
        if ort is not None:
            ort.set_default_logger_severity(_ERRORS_ONLY)
        try:
            os.dup2(sink.fileno(), 2)
            with contextlib.redirect_stdout(printed):
                yield captured
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if ort is not None:
                ort.set_default_logger_severity(ORT_DEFAULT_SEVERITY)
            sink.seek(0)
            captured += [sink.read().decode("utf-8", "replace"), printed.getvalue()]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MISSING_LIB = re.compile(r"with error: (\S+?): cannot open shared object file")
_CUDA_FAILURE = re.compile(r"CUDA failure \d+: ([^;\n]+)")
_LOG_PREFIX = re.compile(r"^.*?\[[EWF]:onnxruntime:[^\]]*\]\s*")


def reason_from_log(text: str) -> str:
    """One line saying why a provider did not start, from what onnxruntime wrote while trying: the shared
    libraries it could not load, a CUDA error, else its first error message (shortened)."""
    text = _ANSI.sub("", text)
    missing = list(dict.fromkeys(_MISSING_LIB.findall(text)))
    if missing:
        return f"{', '.join(missing)} not found"
    failure = _CUDA_FAILURE.search(text)
    if failure:
        return f"CUDA error: {failure.group(1).strip()}"
    if "Please install TensorRT libraries" in text:
        return "the TensorRT libraries (libnvinfer) are not installed"
    for line in text.splitlines():
        if "[E:" in line or "[W:" in line or line.startswith("EP Error"):
            message = _LOG_PREFIX.sub("", line).strip()
            message = message.split(" : FAIL : ")[-1].strip()
            return message if len(message) <= 200 else message[:197] + "..."
    return "onnxruntime fell back to the CPU without saying why"


def _hint(build: dict[str, Any]) -> str:
    """What to install for the CUDA libraries this onnxruntime-gpu needs."""
    major = cuda_major(build["cuda"])
    extra = GPU_EXTRAS.get(major) if major is not None else None
    where = f": {install_command(extra)}" if extra else ""
    return f"{build['package']} {build['version']} needs the CUDA {build['cuda']} libraries{where}"


# ---- the probe -----------------------------------------------------------------------------------------------
_probe_lock = threading.Lock()
_probes: dict[str, Probe] = {}


def _probe(ort: Any, provider: str) -> Probe:
    if provider == CPU:
        return Probe(provider, True, "always available")
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return Probe(provider, False, f"disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}")
    build = onnxruntime_build(ort)
    if provider not in ort.get_available_providers():
        return Probe(provider, False, f"{build['package']} {build['version']} has no {provider} "
                                      "(a GPU needs onnxruntime-gpu: `leaflens doctor` says which extra)")
    if provider not in (CUDA, TENSORRT):
        return Probe(provider, True, "in this onnxruntime build (not probed)")
    driver = driver_cuda_version()
    if driver is None:
        return Probe(provider, False, "no NVIDIA driver (libcuda.so.1 not found)")
    driver_major, build_major = cuda_major(driver), cuda_major(build["cuda"])
    if build_major is not None and driver_major is not None and driver_major < build_major:
        extra = extra_for_cuda(driver_major)
        return Probe(provider, False,
                     f"{build['package']} {build['version']} is built for CUDA {build['cuda']} but the driver supports "
                     f"CUDA {driver // 1000}.{driver % 1000 // 10} at most"
                     + (f": {install_command(extra)}" if extra else ": update the NVIDIA driver"))
    options = ort.SessionOptions()
    options.log_severity_level = _ERRORS_ONLY
    started: list[str] = []
    error = ""
    with quiet_native_output(ort) as captured:
        # onnxruntime >= 1.21 finds the CUDA libraries of NVIDIA's wheels only once preload_dlls has loaded
        # them (measured: without it the CUDA 13 wheels' libcublasLt.so.13 is "not found"); a library it cannot
        # load shows again in the session's attempt below, which decides.
        with contextlib.suppress(Exception):
            if hasattr(ort, "preload_dlls"):
                ort.preload_dlls()
        try:
            session = ort.InferenceSession(probe_model(), sess_options=options, providers=[provider, CPU])
            started = list(session.get_providers())
        except Exception as exc:  # onnxruntime raises its own types
            error = f"EP Error {type(exc).__name__}: {exc}"
    if started and started[0] == provider:
        return Probe(provider, True, f"started on a probe model (driver supports CUDA {driver // 1000}."
                                     f"{driver % 1000 // 10})")
    reason = reason_from_log("\n".join([*captured, error]))
    if "libcuda.so" in reason:
        reason += " (libcuda comes with the NVIDIA driver)"
    elif "libnvinfer" in reason or "libnvonnxparser" in reason or "TensorRT" in reason:
        reason += f" (no leaflens extra installs TensorRT: NVIDIA's TensorRT for CUDA {build['cuda']} is needed)"
    elif "not found" in reason and build["cuda"]:
        reason += f" ({_hint(build)})"
    return Probe(provider, False, reason)


def probe(provider: str, refresh: bool = False) -> Probe:
    """Whether ``provider`` (an onnxruntime name) starts here: cached per process after the first call
    (``refresh`` probes again). Never raises; writes nothing to stdout or stderr."""
    with _probe_lock:
        if refresh or provider not in _probes:
            try:
                import onnxruntime as ort  # noqa: PLC0415

                _probes[provider] = _probe(ort, provider)
            except Exception as exc:  # the probe must not raise
                _probes[provider] = Probe(provider, False, f"probe failed ({type(exc).__name__}: {exc})")
        return _probes[provider]
