"""The install extras in pyproject.toml: one CUDA major per GPU extra, named for it (the table
leaflens.apps.providers.GPU_EXTRAS that `leaflens doctor` recommends from), the CUDA libraries brought
along, exactly one onnxruntime package on every platform, and ``serve`` on the CPU.

Which CUDA major an onnxruntime-gpu release is built for is read off its wheels on PyPI (their
``Requires-Dist`` names ``nvidia-cuda-runtime-cu12`` or ``nvidia-cuda-runtime`` 13, and
``onnxruntime.cuda_version``): 1.17-1.18 CUDA 11.8, 1.19-1.26 CUDA 12, 1.27-1.31 CUDA 13.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leaflens.apps.providers import GPU_EXTRAS
from leaflens.extras import install_command

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

packaging = pytest.importorskip("packaging")
from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# onnxruntime-gpu releases on PyPI and the CUDA major each is built for (see the module docstring).
ORT_GPU_RELEASES = {
    **{v: 11 for v in ("1.17.0", "1.17.1", "1.18.0", "1.18.1")},
    **{v: 12 for v in ("1.19.0", "1.19.2", "1.20.0", "1.20.2", "1.21.0", "1.21.1", "1.22.0", "1.23.0", "1.23.2",
                       "1.24.1", "1.24.4", "1.25.0", "1.25.1", "1.26.0")},
    **{v: 13 for v in ("1.27.0", "1.28.0", "1.29.0", "1.30.0", "1.31.0", "1.31.1")},
}
# The environments an extra must install cleanly in: Python x platform x machine.
ENVIRONMENTS = [
    {"python_version": py, "platform_system": system, "platform_machine": machine, "sys_platform": system.lower()}
    for py in ("3.10", "3.11", "3.12", "3.13")
    for system, machine in (("Linux", "x86_64"), ("Linux", "aarch64"), ("Windows", "AMD64"), ("Darwin", "arm64"))
]


def _extras() -> dict[str, list[Requirement]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return {name: [Requirement(r) for r in reqs] for name, reqs in data["project"]["optional-dependencies"].items()}


def _in(req: Requirement, env: dict[str, str]) -> bool:
    return req.marker is None or req.marker.evaluate(env)


def _cuda_majors(req: Requirement) -> set[int]:
    """The CUDA majors a CuPy or onnxruntime-gpu requirement can install (empty for other packages)."""
    cupy = re.fullmatch(r"cupy-cuda(\d+)x", req.name)
    if cupy:
        return {int(cupy.group(1))}
    if req.name == "onnxruntime-gpu":
        allowed = {major for version, major in ORT_GPU_RELEASES.items() if Version(version) in req.specifier}
        assert allowed, f"{req}: allows none of the known onnxruntime-gpu releases"
        return allowed
    return set()


EXTRAS = _extras()
GPU_NAMES = sorted(GPU_EXTRAS.values())


def test_the_gpu_extras_are_the_ones_doctor_recommends():
    for major, name in GPU_EXTRAS.items():
        assert name in EXTRAS, f"pyproject.toml has no extra {name!r} (GPU_EXTRAS names it for CUDA {major})"
        cupy = [r for r in EXTRAS[name] if r.name.startswith("cupy")]
        assert [r.name for r in cupy] == [f"cupy-cuda{major}x"], f"{name}: CuPy for CUDA {major} expected, got {cupy}"
    stray = [n for n in EXTRAS if n.startswith("gpu") and n not in GPU_NAMES]
    assert not stray, f"GPU extras missing from leaflens.apps.providers.GPU_EXTRAS: {stray}"


@pytest.mark.parametrize("name", GPU_NAMES)
def test_one_cuda_major_within_each_gpu_extra(name):
    major = next(m for m, n in GPU_EXTRAS.items() if n == name)
    for req in EXTRAS[name]:
        majors = _cuda_majors(req)
        assert majors <= {major}, f"[{name}] {req} installs builds for CUDA {sorted(majors)}, the extra is CUDA {major}"


@pytest.mark.parametrize("name", GPU_NAMES)
def test_gpu_extras_bring_their_cuda_libraries(name):
    """From 14.0 CuPy's [ctk] pulls NVIDIA's CUDA wheels; onnxruntime-gpu's [cuda,cudnn] does from 1.21."""
    for req in EXTRAS[name]:
        if req.name.startswith("cupy") and name != GPU_EXTRAS[11]:  # CuPy 14 (the one with [ctk]) has no CUDA 11
            assert "ctk" in req.extras, req
            assert Version("14.0") in req.specifier and Version("13.6") not in req.specifier, req
        if req.name == "onnxruntime-gpu":
            assert {"cuda", "cudnn"} <= req.extras, req
            assert all(Version(v) >= Version("1.21") for v in ORT_GPU_RELEASES if Version(v) in req.specifier), req


@pytest.mark.parametrize("name", ["serve", "serve-cpu", *GPU_NAMES])
def test_exactly_one_onnxruntime_everywhere(name):
    for env in ENVIRONMENTS:
        runtimes = [str(r) for r in EXTRAS[name] if r.name in ("onnxruntime", "onnxruntime-gpu") and _in(r, env)]
        assert len(runtimes) == 1, f"[{name}] on {env}: {runtimes} (both share one folder; exactly one must install)"


def test_onnxruntime_gpu_only_where_its_wheels_exist():
    """onnxruntime-gpu for CUDA 13 (>= 1.27) has no Python 3.10 wheels, and none has Linux aarch64 or macOS ones."""
    for name in GPU_NAMES:
        for req in (r for r in EXTRAS[name] if r.name == "onnxruntime-gpu"):
            for env in ENVIRONMENTS:
                if not _in(req, env):
                    continue
                assert (env["platform_system"], env["platform_machine"]) == ("Linux", "x86_64"), (name, env)
                if 13 in _cuda_majors(req):
                    assert env["python_version"] != "3.10", (name, env)


def test_serve_runs_on_the_cpu_and_every_gpu_extra_serves_too():
    assert [r.name for r in EXTRAS["serve"] if r.name.startswith("onnxruntime")] == ["onnxruntime"]
    assert {str(r) for r in EXTRAS["serve-cpu"]} == {str(r) for r in EXTRAS["serve"]}
    serving = {r.name for r in EXTRAS["serve"]} - {"onnxruntime"}
    for name in GPU_NAMES:
        missing = serving - {r.name for r in EXTRAS[name]}
        assert not missing, f"[{name}] lacks {sorted(missing)} that serve installs (a GPU extra replaces serve)"


def test_ci_tests_the_oldest_python_and_numpy_that_pyproject_accepts():
    """.ci/pythons runs the suite on the floor pyproject.toml declares; the two must not drift apart."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    oldest_python = re.fullmatch(r">=\s*(3\.\d+)", project["requires-python"]).group(1)
    numpy = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "numpy")
    oldest_numpy = re.fullmatch(r">=\s*([\d.]+)", str(numpy.specifier)).group(1)
    script = (ROOT / ".ci" / "pythons").read_text(encoding="utf-8")
    floor = re.search(r'^suite (\S+) "numpy==(\S+)"', script, re.M)
    assert floor is not None, ".ci/pythons no longer pins NumPy for its oldest Python"
    assert floor.group(1) == oldest_python
    assert Version(floor.group(2)).release[:2] == Version(oldest_numpy).release[:2]
    assert "bash .ci/pythons" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


BLOCK_SERVE_EXTRA = """
import sys
for name in ("onnx", "onnxruntime", "gradio", "gradio_client"):
    sys.modules[name] = None  # as on an install without the serve extra: importing them fails
from leaflens.pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("args", "module"), [
    (["predict", "--model", "{model}", "{photo}"], "onnxruntime"),
    (["evaluate", "--model", "{model}", "{tmp}"], "onnxruntime"),
    (["export", "--run", "{tmp}/run", "--out", "{tmp}/export"], "onnx"),
])
def test_a_command_without_the_serve_extra_names_the_extra_to_install(tmp_path, args, module):
    """`pip install leaflens` alone trains; predict, evaluate and export need the serve extra, and say so
    (they ended in a ModuleNotFoundError traceback)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    (tmp_path / "m.onnx").write_bytes(b"")
    (tmp_path / "leaf.jpg").write_bytes(b"")
    filled = [a.format(model=tmp_path / "m.onnx", photo=tmp_path / "leaf.jpg", tmp=tmp_path) for a in args]
    out = subprocess.run([sys.executable, "-c", BLOCK_SERVE_EXTRA, *filled], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"needs {module}, which is not installed: {install_command('serve')}" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_install_command_names_the_clone_leaflens_came_from(monkeypatch, tmp_path):
    """leaflens is not on a package index: `pip install 'leaflens[teacher]'` failed for the people told to run
    it. The command names the clone (an editable install or a checkout, as here), or the folder pip recorded."""
    import json as _json

    from leaflens import extras

    root = Path(extras.__file__).resolve().parents[1]
    assert extras.install_command("serve,teacher") == f"pip install -e '{root}[serve,teacher]'"

    class Dist:
        def __init__(self, text):
            self.text = text

        def read_text(self, name):
            return self.text if name == "direct_url.json" else None

    monkeypatch.setattr(extras, "__file__", str(tmp_path / "site-packages" / "leaflens" / "extras.py"))
    for found, want in (([Dist(_json.dumps({"url": "file:///home/me/leaf%20lens", "dir_info": {}}))],
                         "pip install '/home/me/leaf lens[heic]'"),
                        ([Dist(None), Dist(_json.dumps({"url": "https://example.org/x.whl"}))],
                         "pip install 'leaflens[heic]'"),
                        ([], "pip install 'leaflens[heic]'")):
        extras._origin.cache_clear()
        monkeypatch.setattr(extras.metadata, "distributions", lambda name, found=found: iter(found))
        assert extras.install_command("heic") == want
    extras._origin.cache_clear()
