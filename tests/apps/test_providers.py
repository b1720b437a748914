"""Execution providers chosen by what starts here (leaflens.apps.providers, Predictor's choose_providers):
the choice under mocked availability and probes, the one provider line, the quiet probe, and, where an
``onnxruntime-gpu`` environment exists without CUDA, that nothing but the provider line reaches stderr.

The last test runs in a separate environment with the GPU wheel: the interpreter named by
``LEAFLENS_ORT_GPU_PYTHON`` (.ci/run makes one in build/venv-ortgpu), or this one when its onnxruntime
is the GPU build; it is skipped otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from apps_helpers import write_photo

from leaflens.apps import providers as prov
from leaflens.apps.model_card import ModelError
from leaflens.apps.predictor import PREFERRED_PROVIDERS, Predictor, choose_providers
from leaflens.apps.providers import CPU, CUDA, TENSORRT, Probe, ProviderChoice
from leaflens.extras import install_command

ort = pytest.importorskip("onnxruntime")

GPU_BUILD = [TENSORRT, CUDA, CPU]  # what onnxruntime-gpu lists on any machine
CPU_BUILD = ["AzureExecutionProvider", CPU]  # what the CPU wheel lists


class FakeProbe:
    """A probe that answers from a table and counts the calls per provider."""

    def __init__(self, **answers: str | None) -> None:  # provider short name -> None (starts) or the reason
        self.answers = {prov.SHORT_NAMES[k]: v for k, v in answers.items()}
        self.calls: list[str] = []

    def __call__(self, provider: str) -> Probe:
        self.calls.append(provider)
        reason = self.answers[provider]
        return Probe(provider, reason is None, reason or "started")


# ---- the choice ----------------------------------------------------------------------------------------------
def test_default_is_cuda_when_it_starts_and_never_tensorrt():
    assert PREFERRED_PROVIDERS == (CUDA, CPU)
    works = FakeProbe(cuda=None, tensorrt=None)
    choice = choose_providers(GPU_BUILD, works=works)
    assert choice.providers == (CUDA, CPU) and choice.failed == ()
    assert works.calls == [CUDA]  # TensorRT is not even probed unless asked for
    assert choice.line(CUDA) == f"onnxruntime provider: {CUDA}"


def test_a_gpu_wheel_without_cuda_runs_on_the_cpu_and_says_why():
    works = FakeProbe(cuda="libcublasLt.so.13 not found")
    choice = choose_providers(GPU_BUILD, works=works)
    assert choice.providers == (CPU,)
    assert choice.failed == ((CUDA, "libcublasLt.so.13 not found"),)
    line = choice.line(CPU)
    assert line == f"onnxruntime provider: {CPU} ({CUDA} could not start: libcublasLt.so.13 not found)"
    assert "\n" not in line


def test_the_cpu_wheel_wants_no_gpu_and_probes_nothing():
    works = FakeProbe()
    choice = choose_providers(CPU_BUILD, works=works)
    assert choice.providers == (CPU,) and choice.failed == () and works.calls == []
    assert choice.line(CPU) == f"onnxruntime provider: {CPU}"


def test_tensorrt_when_asked_for_with_cuda_behind_it():
    both = choose_providers(GPU_BUILD, ["tensorrt"], works=FakeProbe(tensorrt=None, cuda=None))
    assert both.providers == (TENSORRT, CUDA, CPU)
    no_trt = choose_providers(GPU_BUILD, ["TensorrtExecutionProvider"],
                              works=FakeProbe(tensorrt="libnvinfer.so.10 not found", cuda=None))
    assert no_trt.providers == (CUDA, CPU)
    assert no_trt.line(CUDA) == (f"onnxruntime provider: {CUDA} ({TENSORRT} could not start: "
                                 "libnvinfer.so.10 not found)")
    neither = choose_providers(GPU_BUILD, ["tensorrt"], works=FakeProbe(tensorrt="no driver", cuda="no driver"))
    assert neither.providers == (CPU,)
    assert neither.line(CPU) == f"onnxruntime provider: {CPU} ({TENSORRT} and {CUDA} could not start: no driver)"


def test_a_requested_provider_this_build_lacks_falls_back_without_a_probe():
    works = FakeProbe()
    choice = choose_providers(CPU_BUILD, ["cuda"], works=works)
    assert choice.providers == (CPU,) and works.calls == []
    assert "has no CUDAExecutionProvider" in choice.line(CPU) and "leaflens doctor" in choice.line(CPU)


def test_cpu_on_request_probes_nothing_and_unknown_names_are_refused():
    works = FakeProbe()
    assert choose_providers(GPU_BUILD, ["cpu"], works=works).providers == (CPU,) and works.calls == []
    with pytest.raises(ValueError, match="unknown execution provider 'gpu'.*cpu, cuda, tensorrt"):
        choose_providers(GPU_BUILD, ["gpu"], works=works)


def test_the_line_names_a_provider_that_passed_the_probe_but_did_not_start():
    line = ProviderChoice(providers=(CUDA, CPU)).line(CPU)
    assert line == (f"onnxruntime provider: {CPU} ({CUDA} passed the probe but onnxruntime did not start it "
                    "for this model)")


def test_requested_providers_and_names():
    assert prov.requested_providers("auto") is None
    assert prov.requested_providers("cuda") == [CUDA]
    assert prov.provider_name("TensorRT") == TENSORRT and prov.provider_name(CPU) == CPU


# ---- driver and extras ---------------------------------------------------------------------------------------
def test_cuda_majors_and_the_extra_for_a_driver():
    majors = [prov.cuda_major(v) for v in (13000, 12040, "13.0", "12", "", None, "x")]
    assert majors == [13, 12, 13, 12, None, None, None]
    assert prov.extra_for_cuda(13) == "gpu" and prov.extra_for_cuda(14) == "gpu"  # a newer driver runs CUDA 13
    assert prov.extra_for_cuda(12) == "gpu-cuda12" and prov.extra_for_cuda(11) == "gpu-cuda11"
    assert prov.extra_for_cuda(10) is None and prov.extra_for_cuda(None) is None


# ---- the probe -----------------------------------------------------------------------------------------------
def test_the_probe_model_is_valid_onnx_and_runs():
    import numpy as np

    onnx = pytest.importorskip("onnx")
    model = onnx.load_from_string(prov.probe_model())
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(prov.probe_model(), providers=[CPU])
    x = np.array([[-1, 2, -3, 4, 0, -0.5, 7, 8]], np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x, 0))


def test_reasons_from_what_onnxruntime_wrote():
    # Lines as onnxruntime-gpu 1.31 writes them on a machine with a driver but without the CUDA 13 libraries.
    log = ("\x1b[1;31m2026-12-01 18:32:31.3 [E:onnxruntime:Default, provider_bridge_ort.cc:2458 operator()] "
           "/onnxruntime_src/provider_bridge_ort.cc:2043 onnxruntime::Provider& onnxruntime::ProviderLibrary::Get() "
           "[ONNXRuntimeError] : 1 : FAIL : Failed to load library /x/capi/libonnxruntime_providers_cuda.so with "
           "error: libcublasLt.so.13: cannot open shared object file: No such file or directory\n\x1b[m\n"
           "\x1b[0;93m2026-12-01 [W:onnxruntime:Default, onnxruntime_pybind_state.cc:1295 "
           "CreateExecutionProviderFactoryInstance] Failed to create CUDAExecutionProvider. Require cuDNN 9.* "
           "and CUDA 13.*.\x1b[m\n")
    assert prov.reason_from_log(log) == "libcublasLt.so.13 not found"
    assert prov.reason_from_log("CUDA failure 100: no CUDA-capable device is detected ; GPU=0") == \
        "CUDA error: no CUDA-capable device is detected"
    assert prov.reason_from_log("[E:onnxruntime:Default, x.cc:1 f] something else broke") == "something else broke"
    assert "without saying why" in prov.reason_from_log("")


def test_quiet_output_captures_fd_2_and_stdout_and_restores_them():
    code = textwrap.dedent("""
        import os, sys
        from leaflens.apps.providers import quiet_native_output
        with quiet_native_output() as captured:
            os.write(2, b"native error text\\n")
            print("wrapper text")
        os.write(2, b"after\\n")
        print("captured:", captured[0].strip(), "|", captured[1].strip())
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr == "after\n"
    assert res.stdout == "captured: native error text | wrapper text\n"


@pytest.fixture
def fresh_probes(monkeypatch):
    monkeypatch.setattr(prov, "_probes", {})
    return prov


def test_probe_reasons_without_trying_a_session(fresh_probes, monkeypatch):
    monkeypatch.setenv(prov.DISABLE_ENV, "1")
    assert prov.probe(CUDA) == Probe(CUDA, False, f"disabled by {prov.DISABLE_ENV}=1")
    monkeypatch.delenv(prov.DISABLE_ENV)
    assert prov.probe(CPU).ok

    class GpuWheel:  # what the probe reads of onnxruntime-gpu 1.31.1, built for CUDA 13.0
        package_name, __version__, cuda_version = "onnxruntime-gpu", "1.31.1", "13.0"

        @staticmethod
        def get_available_providers():
            return GPU_BUILD

        def InferenceSession(self, *args, **kwargs):  # noqa: N802 (onnxruntime's name)
            raise AssertionError("the probe must not open a session here")

    wheel = GpuWheel()
    monkeypatch.setattr(prov, "driver_cuda_version", lambda: None)
    assert prov._probe(wheel, CUDA) == Probe(CUDA, False, "no NVIDIA driver (libcuda.so.1 not found)")
    monkeypatch.setattr(prov, "driver_cuda_version", lambda: 12040)
    reason = prov._probe(wheel, CUDA).reason
    assert reason == ("onnxruntime-gpu 1.31.1 is built for CUDA 13.0 but the driver supports CUDA 12.4 at most: "
                      f"{install_command('gpu-cuda12')}")


def test_probe_is_cached_per_provider(fresh_probes, monkeypatch):
    calls = []
    monkeypatch.setattr(prov, "_probe", lambda ort_module, p: calls.append(p) or Probe(p, False, "nope"))
    assert prov.probe(CUDA).reason == "nope" and prov.probe(CUDA).reason == "nope"
    assert calls == [CUDA]
    prov.probe(CUDA, refresh=True)
    assert calls == [CUDA, CUDA]


def test_probe_with_this_onnxruntime(fresh_probes):
    """The real probe here: the CPU wheel has no CUDA; a GPU wheel on a machine without a driver has none."""
    result = prov.probe(CUDA)
    if CUDA not in ort.get_available_providers():
        assert not result.ok and "has no CUDAExecutionProvider" in result.reason
    elif prov.driver_cuda_version() is None:
        assert result == Probe(CUDA, False, "no NVIDIA driver (libcuda.so.1 not found)")


# ---- the Predictor -------------------------------------------------------------------------------------------
def test_predictor_reports_its_provider_line(tiny_model):
    path, _ = tiny_model()
    predictor = Predictor(path, intra_op_threads=1, providers=["cpu"])
    assert predictor.provider == CPU and predictor.provider_line == f"onnxruntime provider: {CPU}"
    default = Predictor(path, intra_op_threads=1)
    assert default.provider_line.startswith(f"onnxruntime provider: {default.provider}")
    with pytest.raises(ModelError, match="unknown execution provider 'gpu'"):
        Predictor(path, providers=["gpu"])


def test_predictor_falls_back_to_the_cpu_with_the_reason(tiny_model, monkeypatch, fresh_probes):
    path, _ = tiny_model()
    monkeypatch.setattr(prov, "_probe", lambda ort_module, p: Probe(p, False, f"{p} probe says no"))
    monkeypatch.setattr(ort, "get_available_providers", lambda: GPU_BUILD)
    predictor = Predictor(path, intra_op_threads=1, providers=["tensorrt"])
    assert predictor.provider == CPU
    assert predictor.provider_line == (f"onnxruntime provider: {CPU} ({TENSORRT} could not start: {TENSORRT} probe "
                                       f"says no; {CUDA} could not start: {CUDA} probe says no)")


def test_a_provider_named_on_the_command_line_that_cannot_start_is_an_error(tiny_model, tmp_path, capsys,
                                                                           monkeypatch, fresh_probes):
    """--provider cuda on a machine where CUDA cannot start: exit 2 with the reason, no results (the run would
    otherwise answer 0 for work done on the CPU); --provider auto and cpu go on."""
    from leaflens.pipeline.cli import main

    path, _ = tiny_model()
    monkeypatch.setattr(prov, "_probe", lambda ort_module, p: Probe(p, False, f"{p} probe says no"))
    monkeypatch.setattr(ort, "get_available_providers", lambda: GPU_BUILD)
    (tmp_path / "photos").mkdir()
    photo = write_photo(tmp_path / "photos" / "leaf.png", size=(40, 40), seed=1)
    csv_path = tmp_path / "out.csv"
    commands = {"predict": ["predict", str(photo), "--model", str(path), "--no-progress", "--csv", str(csv_path)],
                "evaluate": ["evaluate", "--model", str(path), str(tmp_path / "photos")]}
    for name, argv in commands.items():
        assert main([*argv, "--provider", "cuda"]) == 2, name
        err = capsys.readouterr().err
        assert "--provider cuda was asked for but cannot run here" in err, err
        assert f"{CUDA} could not start: {CUDA} probe says no" in err and "Without --provider (auto)" in err, err
    assert not csv_path.exists()
    assert main([*commands["predict"], "--provider", "auto"]) == 0 and csv_path.exists()
    assert main([*commands["predict"], "--provider", "cpu"]) == 0
    assert prov.unmet_request("tensorrt", CPU, "line") is not None and prov.unmet_request("cpu", CPU, "l") is None
    assert prov.unmet_request("cuda", CUDA, "line") is None and prov.unmet_request("auto", CPU, "line") is None


# ---- with the GPU wheel and no CUDA --------------------------------------------------------------------------
def _gpu_wheel_python() -> str | None:
    named = os.environ.get("LEAFLENS_ORT_GPU_PYTHON")
    if named:
        return named
    return sys.executable if prov.onnxruntime_build(ort)["package"] == "onnxruntime-gpu" else None


CHILD = textwrap.dedent("""
    import sys
    from leaflens.apps import providers
    if sys.argv[2] == "driver":  # pretend a CUDA 13 driver answers, so the probe really opens a CUDA session
        providers.driver_cuda_version = lambda: 13000
    from leaflens.apps.predictor import Predictor
    predictor = Predictor(sys.argv[1], intra_op_threads=1)
    print(predictor.provider_line, file=sys.stderr)
""")


@pytest.mark.parametrize("driver", ["none", "driver"])
def test_gpu_wheel_without_cuda_writes_only_the_provider_line(tiny_model, tmp_path, driver):
    python = _gpu_wheel_python()
    if python is None:
        pytest.skip("no onnxruntime-gpu environment (set LEAFLENS_ORT_GPU_PYTHON; .ci/run makes one)")
    check = subprocess.run([python, "-c", "import onnxruntime as o, leaflens.apps.providers as p; "
                            "print(p.onnxruntime_build(o)['package'], p.driver_cuda_version())"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    package, found_driver = check.stdout.split()
    assert package == "onnxruntime-gpu", f"{python} has {package}, not the GPU wheel"
    if found_driver != "None":
        pytest.skip(f"{python} finds an NVIDIA driver (CUDA {found_driver}): this test is for machines without CUDA")
    path, _ = tiny_model()
    res = subprocess.run([python, "-c", CHILD, str(path), driver], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""  # onnxruntime's Python wrapper prints its "EP Error" blocks there
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"onnxruntime provider: {CPU} ({CUDA} could not start: "), res.stderr
    if driver == "driver":  # the probe opened a CUDA session and its complaints went to the reason, not the terminal
        assert "not found" in lines[0] and "pip install " in lines[0] and "[gpu" in lines[0], lines[0]
    else:
        assert "no NVIDIA driver" in lines[0]

    # The command a new user runs: the provider line, then the results (stdout) and the summary line.
    photo = write_photo(tmp_path / "leaf.png", size=(40, 40), seed=1)
    cli = subprocess.run([python, "-m", "leaflens", "predict", str(photo), "--model", str(path), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    err = cli.stderr.splitlines()
    assert len(err) == 2 and err[0].startswith(f"onnxruntime provider: {CPU} ("), cli.stderr
    assert err[1].startswith("1 image with"), cli.stderr
    assert cli.stdout.startswith(str(Path(photo))) and len(cli.stdout.splitlines()) == 1, cli.stdout
