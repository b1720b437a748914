"""The installed shape: one top-level import package, `leaflens`, and imports without side effects."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = ("engine", "kernels", "data_prep", "pipeline", "apps")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_in_the_package_list():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {"leaflens"}
    for top in TOP_FOLDERS:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            found.add(".".join(("leaflens", *rel)))
    assert found == listed, f"pyproject.toml packages: missing {sorted(found - listed)}, extra {sorted(listed - found)}"


def test_no_module_imports_the_old_top_level_names():
    old = tuple(f"{kind} {top}" for top in TOP_FOLDERS for kind in ("import", "from"))
    offenders = []
    for folder in (*TOP_FOLDERS, "leaflens", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                stripped = line.strip()
                if stripped.startswith(old) and stripped.split()[1].split(".")[0] in TOP_FOLDERS:
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {stripped}")
    assert not offenders, "\n".join(offenders)


STALE = ROOT / "build" / "lib" / "leaflens" / "zz_deleted_since_the_last_build.py"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # what an earlier build left of a module since deleted from the source (setuptools' build/lib keeps it)
    STALE.parent.mkdir(parents=True, exist_ok=True)
    STALE.write_text("x = 1\n")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and "No module named" in res.stderr and "setuptools" in res.stderr:
        pytest.skip("setuptools is not installed here (it comes with the dev extra)")
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = out.glob("leaflens-*.whl")
    return whl


def test_a_module_deleted_from_the_source_is_not_in_the_next_wheel(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert f"leaflens/{STALE.name}" not in names and not STALE.exists()


def test_the_wheel_adds_exactly_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/")[0] for n in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"leaflens"}, sorted(tops)
    top_level = [n for n in names if n.endswith("top_level.txt")]
    if top_level:
        with zipfile.ZipFile(wheel) as zf:
            assert zf.read(top_level[0]).decode().split() == ["leaflens"]
    # data files the package reads at run time travel with it
    assert "leaflens/kernels/sgemm.cu" in names and "leaflens/kernels/common.cuh" in names
    assert "leaflens/pipeline/distill_default.toml" in names


def test_the_wheel_carries_the_license_its_metadata_names(wheel):
    """pyproject says Apache-2.0; the licence's text travels in the wheel, as the licence asks of anyone passing
    the code on."""
    assert _pyproject()["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    with zipfile.ZipFile(wheel) as zf:
        licences = [n for n in zf.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert licences, "no LICENSE in the wheel"
        assert zf.read(licences[0]).decode() == text
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata


def test_the_installed_wheel_imports_without_the_repository(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # -S: no site processing, so this venv's editable-install finder is not active; its site-packages
    # stays reachable for NumPy and Pillow through PYTHONPATH, after the wheel's files.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]))
    code = ("import leaflens.engine, leaflens.kernels, leaflens.data_prep.decode, leaflens.pipeline.cli, "
            "leaflens.apps.batcher; print(leaflens.engine.__file__)")
    res = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith(str(target)), res.stdout


def test_a_non_editable_install_runs_from_the_repository_root(wheel, tmp_path):
    """`pip install .` then `python -m leaflens ...` in the clone (the README's paths are relative to it): the
    clone's leaflens/ folder comes first on sys.path and hid the installed package, and its subpackages are
    the folders beside it, so every command failed with "No module named 'leaflens.pipeline'"."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]))
    res = subprocess.run([sys.executable, "-S", "-m", "leaflens", "--version"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("leaflens "), res.stderr[-2000:]
    code = "import leaflens.pipeline.cli as c, leaflens.engine as e; print(c.__file__); print(e.__file__)"
    res = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == [str(ROOT / "pipeline" / "cli" / "__init__.py"), str(ROOT / "engine" / "__init__.py")]


def test_importing_the_package_changes_no_process_state():
    code = """
import os
before = dict(os.environ)
import leaflens, leaflens.engine, leaflens.kernels, leaflens.data_prep.ingest, leaflens.pipeline.distill
import leaflens.pipeline.teachers.stage, leaflens.pipeline.export.stage, leaflens.apps.predictor
from leaflens.engine import allocator
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
assert not allocator._applied, "importing leaflens tuned the allocator"
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_the_command_line_makes_its_runtime_settings():
    code = """
import os, sys
from leaflens.pipeline.cli import main
from leaflens.pipeline.cli.runtime import configure_process
configure_process(engine=True)
from leaflens.engine import allocator
print(os.environ.get("OPENBLAS_THREAD_TIMEOUT"), allocator._applied or sys.platform != "linux")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "LEAFLENS_NO_MALLOC_TUNING")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["4", "True"]
