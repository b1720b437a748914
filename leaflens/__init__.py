"""leaflens: leaf disease and crop pest recognition, from photo folders to a served model.

One import package over the repository's top-level folders (see pyproject.toml's package-dir):
``leaflens.engine`` (tensors, autograd, layers, optimisers), ``leaflens.kernels`` (CUDA kernels and
their NumPy twins), ``leaflens.data_prep`` (decoding, ingest, manifests), ``leaflens.pipeline`` (the
staged jobs and the ``leaflens`` command) and ``leaflens.apps`` (Predictor, batching, web app).
Importing any of them changes no process-wide setting; the command line makes those explicitly
(:func:`leaflens.pipeline.cli.runtime.configure_process`).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("leaflens")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

# Run from the repository's root (``python -m leaflens``, a script or pytest there puts it first on sys.path),
# this folder is found before an installed leaflens, and its subpackages are not in it: they are the folders
# beside it (pyproject.toml's package-dir). Found there too, the checkout runs as a whole instead of failing on
# ``leaflens.pipeline``. An installed copy holds its subpackages and never takes this branch.
import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if (not _os.path.isdir(_os.path.join(_here, "engine")) and _os.path.isfile(_os.path.join(_root, "pyproject.toml"))
        and _os.path.isdir(_os.path.join(_root, "engine"))):
    __path__.append(_root)
del _os, _here, _root
