"""Every ``kernels/*.cu`` compiles to PTX with nvcc for compute capability 7.5 (Turing, the oldest that
current CUDA supports) and 9.0 (Hopper), so a syntax or type error in a kernel fails CI without a GPU.

The source compiled is exactly what NVRTC receives at run time (local includes inlined by
``leaflens.kernels._cuda.kernel_source``); warnings are errors. Skipped where nvcc is not on the PATH.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from leaflens.kernels import _cuda

CU_FILES = sorted(p.name for p in _cuda.KERNEL_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")
KERNEL_NAME = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)')


def test_every_family_has_a_source():
    expected = {"sgemm", "softmax_xent", "activation_grad", "l2norm", "im2col", "maxpool", "fused_optim"}
    assert expected <= {name[:-3] for name in CU_FILES}
    for stem in expected:  # and a Python module beside it
        assert (_cuda.KERNEL_DIR / f"{stem}.py").is_file()


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on the PATH")
@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
@pytest.mark.parametrize("cu_file", CU_FILES)
def test_nvcc_compiles_to_ptx(tmp_path, cu_file, arch):
    src = tmp_path / cu_file
    src.write_text(_cuda.kernel_source(cu_file), encoding="utf-8")
    out = tmp_path / f"{cu_file}.{arch}.ptx"
    cmd = [NVCC, "--ptx", f"-arch={arch}", "-Werror", "all-warnings", str(src), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"nvcc failed for {cu_file} ({arch}):\n{proc.stderr}"
    ptx = out.read_text()
    # every extern "C" kernel is present under its plain (unmangled) name
    names = KERNEL_NAME.findall(src.read_text())
    assert names, f"{cu_file}: no kernels found"
    for name in names:
        assert f".entry {name}(" in ptx, f"{cu_file}: kernel {name} missing from the PTX"
