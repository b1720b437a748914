"""setuptools' build step copies the package into build/lib and never removes what the source no longer has, so
a module deleted from the clone (after a `git pull`) would stay in every later wheel and `pip install .`: each
build starts from an empty copy. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class FreshBuildPy(build_py):
    def run(self) -> None:
        if not self.editable_mode:  # an editable install links the source instead of copying it
            shutil.rmtree(Path(self.build_lib) / "leaflens", ignore_errors=True)
        super().run()


setup(cmdclass={"build_py": FreshBuildPy})
